#!/usr/bin/env bash
# The seed measurement on the lent H200 in one device call (issue 19), everything under $OUT.
#
# Expects, in $DEVICE_DIR (default .device: git-ignored, carried to the machine):
#   wheels/   the prefixcache abi3 wheel built here (pip wheel --no-deps . -w .device/wheels)
#   flashkda/_flashkda_C.abi3.so   the FlashKDA op from the vllm==0.33.0 wheel
# torch, numpy, triton and tqdm come from the machine. Stages, each under its own time limit so
# that a slow one leaves the others' results (simulate writes its JSON after every policy):
#   1. the model's, the kernel layer's, the Triton convolution's, row move's and KDA decode
#      kernel's, the Triton paged decode attention's and the split prefill attention's GPU tests;
#   2. benchmarks/gpu_layers.py over the seed's 1K to 4K tokens a request (19 s on 2026-12-02):
#      GPU time per token and per step of each layer kind (KDA also with the seed steps' two
#      checkpoints and decode rows), the decode attention (gathering torch path against the
#      Triton kernel) and a layer group's decode step;
#   3. the output check: growing-prefix at the default preset (the seed geometry / 16) with the
#      Kimi-K3 proxy, none + block + fine, outputs compared with the no-cache run;
#   4. the seed preset, block then fine, and 5. fine then block (--no-reference: the order check);
#   6. benchmarks/gpu_step_compare.py: a block and a fine prefill step of round 4 profiled (what in
#      a step is fixed: host before the first launch, GPU busy and idle, the idle by the layer
#      whose launches the GPU waited for, kernels by category);
#   7. the warm order apart from the measured one, two processes with --warm-up full: warm
#      block,fine and measure fine,block, then warm fine,block and measure block,fine (in a
#      fine-first process fine was 2 to 6% slower: which of the two firsts sets it);
#   8. KDA GPU work (--kda-timing gpu) with --warm-up full, block then fine (the shapes warm
#      pass left 7 decode graph shapes to the first measured run);
#   0. (a diagnosis, last when chosen) the seed preset with each eager step's layers behind a
#      GPU-side spin (--layers-backlog): the step's layers time without waits for the host;
#   9. benchmarks/gpu_uploads.py: the host time of a step's index uploads (a pageable
#      non-blocking copy, as to_device makes them, against one through pinned memory), GPU idle
#      and busy;
#   h. the host's side of a prefill step: benchmarks/gpu_host_profile.py (a KDA + MLP group's
#      host time by function against its GPU work, at fine's and block's p50 prefill tokens),
#      benchmarks/gpu_op_host.py (the FlashKDA op's host time a call), gpu_op_graph.py (whether
#      the op replays from a CUDA graph over a padded token bucket, and its host time then),
#      gpu_norms.py and gpu_step_profile.py (whole steps' host and GPU time, and any call inside
#      a step's forward that waits for the GPU; about 2 minutes in all).
#
# The figures of docs/BENCHMARKS.md (2026-12-02 12:54: both orders, counterbalanced passes,
# 2 x 190 to 205 s, with stage 9; KDA GPU work is stage 8, about 175 s, a call of its own):
#   STAGES=945 REPEATS=2 WARM_UP=full SEED_ARGS=--no-overlap BUDGET=575 OUT=$OUT \
#       bash benchmarks/gpu_seed.sh
#
# More layers dilute what a request pays whatever its tokens (2026-12-06, H100s: TTFT fine
# against block -18.4% / -20.2% at depth 2, -19.6% / -19.9% at depth 4 in one call of 426 s,
# -21.6% / -20.9% at depth 6, 272 and 281 s a process). Depth 6, the figures of
# docs/BENCHMARKS.md, in two calls on one machine (the H200, 2026-12-06 20:26 to 20:41: TTFT
# -20.8% / -21.0%, KDA GPU work -20.1%, outputs checked; 840 device seconds): both orders as
# counterbalanced passes of one process (block, fine, fine, block) with the GPU tests first
# (437 s on the H200, 499 s on an H100), then the output check (43 s on the H200, 50 s on an
# H100) and KDA GPU work (stage 8, 350 s on the H200, 380 s on an H100: it waits for each layer;
# BUDGET=330 ran out in fine's pass on an H100):
#   DEPTH=6 STAGES=14 REPEATS=2 WARM_UP=full SEED_ARGS=--no-overlap BUDGET=585 OUT=$OUT bash ...
#   DEPTH=6 STAGES=38 WARM_UP=full SEED_ARGS=--no-overlap BUDGET=565 OUT=$OUT bash ...
# One process per order instead (the first with the GPU tests, about 75 s more):
#   DEPTH=6 STAGES=15 WARM_UP=full SEED_ARGS=--no-overlap BUDGET=540 OUT=$OUT bash ...
#   DEPTH=6 STAGES=4 WARM_UP=full SEED_ARGS=--no-overlap BUDGET=380 OUT=$OUT bash ...
#
#   OUT=/tmp/out bash benchmarks/gpu_seed.sh            # DEPTH=2 layer groups by default
#   STAGES=45 OUTPUT_LEN=16 ...                         # the seed runs only, 16 decode tokens
#   DECODE_ATTENTION=torch ...    # decode rows through the gathering path (default: the Triton
#                                 # kernel, unless its GPU tests fail in stage 1)
#   PREFILL_SPLIT=0 ...           # a chunk's cached prefix in one flash call (default: split,
#                                 # unless its GPU tests fail in stage 1)
#   KERNELS=1 ...                 # stage 2 also lists each case's kernels (gpu_layers --kernels)
#   BASELINE=.device/baseline ... # stage 2 also times the layers with the wheel in
#                                 # BASELINE/wheels (carried like .device), same machine
#   CUDA_GRAPHS=0 ...             # every step eager (default: decode-only steps replay CUDA
#                                 # graphs, unless their GPU tests fail in stage 1)
#   REPEATS=2 ...                 # stages 4 and 5 measure each policy twice, counterbalanced,
#                                 # after the warm pass (simulate --repeats: the JSON keeps every
#                                 # pass; gpu_seed_report.py prints them and pass 1 vs pass 2)
# The seed runs share what is left of BUDGET seconds (default 585: one 600 s device call); with
# 200 output tokens each order takes about 125 to 155 s with the decode graphs (240 s eager,
# 2026-12-02): a full warm pass and one measured pass of both policies (61 to 66 s of it), plus
# the process's start. STAGES=45 fits one call with room for stage 1 or 3; with REPEATS=2 (191
# to 194 s an order, 07:21 UTC; stage 4 gets half of what is left, about 285 s) it fits alone,
# and STAGES=134 REPEATS=2 took 350 s; REPEATS=3 with both orders does not fit safely, one order
# (STAGES=4) up to REPEATS=6 does. SEED_ARGS=--no-overlap measures one step at a time, as docs/BENCHMARKS.md's figures
# are (the overlapped engine adds a step's wait to TTFT).
set -uo pipefail
budget=${BUDGET:-585}
device_dir=$(cd "${DEVICE_DIR:-.device}" && pwd)
out=${OUT:?set OUT to the results folder}
mkdir -p "$out"
depth=${DEPTH:-2}
site=${SITE:-/tmp/prefixcache-site}
mkdir -p "$site"
# The package from the wheel in $2/wheels, installed to $1.
install() {
python3 -m pip install -q --upgrade --no-index --no-deps --disable-pip-version-check \
    --target "$1" "$2"/wheels/*.whl
}
install "$site" "$device_dir" || exit 1
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
# Growing contexts ask the caching allocator for ever larger attention temporaries; expandable
# segments grow in place instead of leaving a trail of cached segments that fit nothing later.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PREFIXCACHE_FLASHKDA_LIB="$device_dir/flashkda/_flashkda_C.abi3.so"
log="$out/log.txt"
errors="$out/stderr.txt"
say() { echo "== $(date -u +%T) $*" | tee -a "$log"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$log"
# The GPU's clocks, power and temperature every 250 ms while the stages run (a run that slows
# down over a process, or a step that starts at lower clocks, shows here): $out/gpu_clocks.csv.
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active \
    --format=csv,noheader,nounits -lms 250 >"$out/gpu_clocks.csv" 2>/dev/null &
clocks=$!
trap 'kill $clocks 2>/dev/null' EXIT
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__)' | tee -a "$log"

decode=${DECODE_ATTENTION:-auto}  # the attention of decode rows (auto: the Triton kernel)
split=()  # a prefill chunk's cached prefix split across the GPU (--no-prefill-split: one call)
graphs=()  # decode-only steps from CUDA graphs (--no-cuda-graphs: every step eager)
[[ ${CUDA_GRAPHS:-1} == 1 ]] || graphs=(--no-cuda-graphs)
[[ ${PREFILL_SPLIT:-1} == 1 ]] || split=(--no-prefill-split)
stages=${STAGES:-12345}  # which stages to run, e.g. STAGES=45
run() { [[ $stages == *"$1"* ]]; }

run 1 && say "1. GPU tests"
run 1 && {
timeout 45 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_models.py \
    tests/test_kernels.py 2>&1 | tail -4 | tee -a "$log"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_conv_triton.py \
    tests/test_rows_triton.py tests/test_kda_decode_triton.py 2>&1 | tail -3 | tee -a "$log"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention.py 2>&1 \
    | tail -3 | tee -a "$log"
[[ ${PIPESTATUS[0]} == 0 ]] || { decode=torch; say "decode kernel tests failed: torch decode"; }
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_prefill_attention.py 2>&1 \
    | tail -3 | tee -a "$log"
[[ ${PIPESTATUS[0]} == 0 ]] || { split=(--no-prefill-split); say "split tests failed: no split"; }
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 \
    | tee -a "$out/tests.txt" | tail -3 | tee -a "$log"
[[ ${PIPESTATUS[0]} == 0 ]] || { graphs=(--no-cuda-graphs); say "graph tests failed: eager"; }
}
common=(--device cuda --backend flashkda-op --model kimi-k3-tp8 --depth "$depth"
    --decode-attention "$decode" "${split[@]}" "${graphs[@]}")
seed=(--preset seed "${common[@]}" ${OUTPUT_LEN:+--output-len "$OUTPUT_LEN"} ${WARM_UP:+--warm-up "$WARM_UP"}
    ${REPEATS:+--repeats "$REPEATS"})
# shellcheck disable=SC2206  # SEED_ARGS="--no-overlap ...": more options of the seed runs
seed+=(${SEED_ARGS:-})
run h && say "h. the host's side of a prefill step"
run h && for tokens in 2087 2727; do
timeout 60 python3 benchmarks/gpu_host_profile.py --tokens "$tokens" \
    --json "$out/host_profile_$tokens.json" 2>>"$errors" | head -30 | tee -a "$log"
done
run h && timeout 60 python3 benchmarks/gpu_op_host.py --json "$out/op_host.json" 2>>"$errors" \
    | tee -a "$log"
run h && timeout 60 python3 benchmarks/gpu_op_graph.py --json "$out/op_graph.json" 2>>"$errors" \
    | tee -a "$log"
run h && timeout 60 python3 benchmarks/gpu_norms.py --json "$out/norms.json" 2>>"$errors" \
    | tee -a "$log"
run h && timeout 120 python3 benchmarks/gpu_step_profile.py --depth "$depth" \
    --json "$out/step_profile.json" 2>>"$errors" | tail -12 | tee -a "$log"
run 9 && say "9. host-to-device uploads"
run 9 && timeout 60 python3 benchmarks/gpu_uploads.py --json "$out/uploads.json" 2>>"$errors" \
    | tee -a "$log"
# Stage 2's timing with the package on $1 (the path its wheel was installed to), into $2.
layers() {
PYTHONPATH="$1" timeout 150 python3 benchmarks/gpu_layers.py --backend flashkda-op \
    --tokens 1024,2048,2560,3072,3584,4096 --prefixes 0,131072 ${KERNELS:+--kernels} \
    --json "$out/$2.json" 2>"$out/$2_stderr.txt" | tee -a "$log"
}
run 2 && say "2. layer timing"
run 2 && layers "$site" layers
# BASELINE=DIR: the same timing with the wheel in DIR/wheels (an earlier commit's), in the same
# call, so that a change's layer times compare on one machine: $out/layers_baseline.json.
run 2 && [[ -n ${BASELINE:-} ]] && {
install "$site-baseline" "$BASELINE" || exit 1
say "2b. layer timing, the baseline wheel"
layers "$site-baseline" layers_baseline
}

run 3 && say "3. output check: default preset, none + block + fine"
run 3 && {
# Its limit grows with the layers: 100 s at depth 2, 200 s at depth 6.
timeout $((25 * (depth + 2))) python3 -m prefixcache simulate --preset default "${common[@]}" \
    --json "$out/check.json" 2>>"$errors" | tail -8 | tee -a "$log"
# The overlapped engine (the default) that fails here runs the seed one step at a time.
[[ ${PIPESTATUS[0]} == 0 ]] || { seed+=(--no-overlap); say "output check failed: --no-overlap"; }
}

# The seed processes after stage 5 (7 runs two, 8 one), which stages 4 and 5 leave their shares;
# stage 6 (one process of about 60 s) takes at most 120 s.
later_seed=0
run 7 && later_seed=$((later_seed + 2))
run 8 && later_seed=$((later_seed + 1))
later=$later_seed
run 6 && later=$((later + 1))
run 0 && later=$((later + 1))  # stage 0 runs last, a seed process of its own
run 4 && say "4. seed preset, block then fine"
share=$((1 + later))
run 5 && share=$((share + 1))  # stage 4 leaves stage 5 (and the later ones) their shares
run 4 && timeout $(((budget - SECONDS) / share)) python3 -m prefixcache simulate "${seed[@]}" \
    --policies block,fine --no-reference --json "$out/seed_block_first.json" 2>>"$errors" \
    | tail -32 | tee -a "$log"

run 5 && say "5. seed preset, fine then block"
run 5 && timeout $(((budget - SECONDS) / (1 + later))) python3 -m prefixcache simulate \
    "${seed[@]}" --policies fine,block --no-reference --json "$out/seed_fine_first.json" \
    2>>"$errors" | tail -4 | tee -a "$log"

run 6 && say "6. a block and a fine prefill step of one round, profiled"
left=$((budget - SECONDS))
run 6 && timeout $((left < 120 ? left : 120)) python3 benchmarks/gpu_step_compare.py \
    --backend flashkda-op --depth "$depth" "${graphs[@]}" --json "$out/step_compare.json" \
    --trace-dir "$out" 2>>"$errors" | tee -a "$log"

# Stages 7 and 8: each process its share of what is left (two in 7, one in 8).
warm_full=(--warm-up full --no-reference)
run 7 && say "7a. warm block,fine; measured fine,block"
run 7 && timeout $(((budget - SECONDS) / (later_seed))) python3 -m prefixcache simulate \
    "${seed[@]}" "${warm_full[@]}" --warm-order block,fine --policies fine,block \
    --json "$out/seed_warm_block_measured_fine.json" 2>>"$errors" | tail -4 | tee -a "$log"
run 7 && say "7b. warm fine,block; measured block,fine"
run 7 && timeout $(((budget - SECONDS) / (later_seed - 1))) python3 -m prefixcache simulate \
    "${seed[@]}" "${warm_full[@]}" --warm-order fine,block --policies block,fine \
    --json "$out/seed_warm_fine_measured_block.json" 2>>"$errors" | tail -4 | tee -a "$log"

run 8 && say "8. KDA GPU work, warm-up full, block then fine"
run 8 && timeout $((budget - SECONDS)) python3 -m prefixcache simulate "${seed[@]}" \
    "${warm_full[@]}" --kda-timing gpu --policies block,fine \
    --json "$out/seed_kda_gpu_full.json" 2>>"$errors" | tail -4 | tee -a "$log"
# Stage 0 (a diagnosis, in no default): the seed preset with every eager step's layers behind
# a GPU-side spin of 40M cycles (about 20 ms, twice the host's launches of a prefill step), so
# that prefill_parts' layers time is the GPU's execution alone; compare it with stage 4's.
run 0 && say "0. seed preset, block then fine, layers behind a backlog"
run 0 && timeout $((budget - SECONDS)) python3 -m prefixcache simulate "${seed[@]}" \
    --policies block,fine --no-reference --layers-backlog 40000000 \
    --json "$out/seed_layers_backlog.json" 2>>"$errors" | tail -4 | tee -a "$log"
say "done"
tail -c 3000 "$errors" >"$out/stderr_tail.txt" 2>/dev/null
rm -f "$errors"
