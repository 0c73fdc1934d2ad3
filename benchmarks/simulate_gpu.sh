#!/usr/bin/env bash
# `prefixcache simulate` on a GPU machine that cannot reach a package index (the lent H200).
#
# Expects, in the working tree (git-ignored, carried to the machine):
#   .device/wheels/   prefixcache (the abi3 wheel built here: maturin build --release -o
#                     .device/wheels), tqdm and fla_core (pip download --no-deps)
#   .device/flashkda/_flashkda_C.abi3.so   the FlashKDA op from the vllm==0.33.0 wheel
# torch, numpy and triton come from the machine. Runs the model's GPU tests first (a failure
# stops the run; add the kernel backends' with GPU_TESTS=tests/test_kernels_gpu.py), then
# `prefixcache simulate` with this script's arguments.
#
#   bash benchmarks/simulate_gpu.sh --preset seed --device cuda --backend flashkda-op \
#       --json "$OUT/seed.json"
set -euo pipefail
site=${SITE:-/tmp/prefixcache-site}
mkdir -p "$site"
python3 -m pip install -q --upgrade --no-index --no-deps --disable-pip-version-check --target "$site" \
    .device/wheels/*.whl
export PYTHONPATH="$site" PREFIXCACHE_FLASHKDA_LIB="$PWD/.device/flashkda/_flashkda_C.abi3.so"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_models.py ${GPU_TESTS:-}
python3 -m prefixcache simulate "$@"
