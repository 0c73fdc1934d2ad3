# One command surface: demo, test, bench, lint.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# Set-up is idempotent: pip skips what is already installed (torch is large; it is fetched once).
INSTALL_STAMP := target/.python-installed

.PHONY: install demo test test-rust test-python bench bench-python lint fmt clean

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

bench:
	cargo bench -p prefixcache-core

bench-python: install
	$(PYTHON) benchmarks/bindings.py

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
