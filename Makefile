# One command surface: demo, test, bench, lint.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Set-up is idempotent: pip skips what is already installed (torch is large; it is fetched once).
INSTALL_STAMP := target/.python-installed

.PHONY: install demo test test-rust test-python fuzz bench bench-python lint fmt clean

$(INSTALL_STAMP): pyproject.toml rust/python/Cargo.toml rust/core/Cargo.toml $(shell find rust -name '*.rs') $(shell find python -name '*.py' -o -name '*.pyi')
	$(PIP) install -q --disable-pip-version-check -e '.[demo,test]'
	@mkdir -p target && touch $@

install: $(INSTALL_STAMP)

demo: install
	$(PYTHON) -m prefixcache simulate --workload growing-prefix --preset default

test-rust:
	cargo test -q -p prefixcache-core

test-python: install
	$(PYTHON) -m pytest -q tests

test: test-rust test-python

# Long fuzz runs (minutes; `make test` runs short, fixed-seed versions of each): the core's wide
# fuzz property (1-3 pools, 1-4 groups, every call with hostile values) in release with
# overflow checks and debug assertions on, the model-based properties (one step and overlapped
# steps) at depth, then the Python API's state machine. Each prints its seed and the operations
# it executed; a core failure is shrunk and recorded in rust/core/tests/*.proptest-regressions
# (commit it), a Python one printed as a minimal program. FUZZ_SEED=... replays a core run.
FUZZ_CASES ?= 40000
MODEL_CASES ?= 20000
FUZZ_EXAMPLES ?= 2000
FUZZ_CARGO := CARGO_PROFILE_RELEASE_OVERFLOW_CHECKS=true CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true \
	CARGO_TARGET_DIR=target/fuzz cargo test --release -p prefixcache-core

fuzz: install
	FUZZ_CASES=$(FUZZ_CASES) $(FUZZ_CARGO) --test fuzz_core -- --nocapture
	PROPTEST_CASES=$(MODEL_CASES) $(FUZZ_CARGO) --test model
	PROPTEST_CASES=$(MODEL_CASES) $(FUZZ_CARGO) --test model_overlap
	$(PYTHON) tests/fuzz_api.py --examples $(FUZZ_EXAMPLES)

bench:
	cargo bench -p prefixcache-core

# OPENBLAS_NUM_THREADS=1: NumPy's OpenBLAS otherwise keeps a worker thread spinning after a
# BLAS call, which takes a core of these 2-core machines from the timed loop.
bench-python: install
	OPENBLAS_NUM_THREADS=1 $(PYTHON) benchmarks/bindings.py

# Side by side with vLLM 0.33.0's KVCacheManager (docs/BENCHMARKS.md). vLLM (~10 GB) lives in
# its own virtual environment, never a dependency of the project; prefixcache is installed
# there as a release wheel built from this tree. VS_VLLM_ARGS="--scale 0.25" for a quick run;
# NICE="nice -n -10" (root) keeps other jobs on a shared machine from skewing the timings.
VLLM_VENV := .venv-vllm
VS_VLLM_ARGS ?= --pairs 5
NICE ?=

$(VLLM_VENV)/.vllm-installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check 'vllm==0.33.0' xxhash matplotlib
	@touch $@

.PHONY: bench-vllm
bench-vllm: $(VLLM_VENV)/.vllm-installed
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --force-reinstall --no-deps .
	PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 $(NICE) $(VLLM_VENV)/bin/python benchmarks/vs_vllm.py $(VS_VLLM_ARGS)

# prefixcache against every peer manager (docs/BENCHMARKS.md, "Against SGLang's radix cache, and every peer"):
# benchmarks/peers.py runs each peer's driver in that peer's environment and merges what they
# print into benchmarks/results/peers.json (+ docs/peers.png). vLLM: .venv-vllm as above.
# SGLang 0.5.23: its wheel without its GPU stack, plus what its cache modules import, and torch
# 2.14.1 (its Rust tree core links that torch; it shadows a newer one of the system's
# site-packages, which the environment otherwise shares). kvbm: the project's Python (its
# driver builds the Rust peer binary). PEERS_ARGS="--scale 0.25 --pairs 3" for a quick run;
# PEERS_ARGS="--peers sglang --merge" measures one peer and keeps the others' entries.
SGLANG_VENV := .venv-sglang
SGLANG_IMPORTS := psutil pybase64 starlette aiohttp transformers dill apache-tvm-ffi \
	sentencepiece compressed-tensors gguf openai partial_json_parser datasets xxhash matplotlib
PEERS_ARGS ?=

$(SGLANG_VENV)/.sglang-installed:
	$(PYTHON) -m venv --system-site-packages $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --disable-pip-version-check --no-deps 'sglang==0.5.23'
	$(SGLANG_VENV)/bin/pip install -q --disable-pip-version-check 'torch==2.14.1' 'torchvision==0.29.1' $(SGLANG_IMPORTS)
	@touch $@

.PHONY: bench-peers
bench-peers: $(VLLM_VENV)/.vllm-installed $(SGLANG_VENV)/.sglang-installed
	rm -rf target/peers-wheel
	$(PIP) wheel -q --disable-pip-version-check --no-deps -w target/peers-wheel .
	$(VLLM_VENV)/bin/pip install -q --disable-pip-version-check --force-reinstall --no-deps target/peers-wheel/prefixcache-*.whl
	$(SGLANG_VENV)/bin/pip install -q --disable-pip-version-check --force-reinstall --no-deps target/peers-wheel/prefixcache-*.whl
	PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 $(NICE) $(PYTHON) benchmarks/peers.py \
		--python-vllm $(VLLM_VENV)/bin/python --python-sglang $(SGLANG_VENV)/bin/python \
		--python-kvbm $(PYTHON) $(PEERS_ARGS)

lint: install
	cargo fmt --all -- --check
	cargo clippy -p prefixcache-core --all-targets -- -D warnings
	cargo clippy -p prefixcache-python -- -D warnings
	$(PIP) install -q --disable-pip-version-check 'ruff>=0.5' 'mypy>=1.10'
	$(PYTHON) -m ruff check python tests benchmarks
	$(PYTHON) -m ruff format --check python tests benchmarks
	$(PYTHON) -m mypy
	$(PYTHON) -m mypy.stubtest prefixcache._core

fmt:
	cargo fmt --all
	$(PYTHON) -m ruff format python tests benchmarks

clean:
	cargo clean
