"""GPU time of the KDA decode kernel at the seed step's shape, per launch configuration.

The seed's prefill step carries 7 decode rows beside its prefill row; each KDA layer updates
their states (Kimi-K3 at TP8: 12 heads of 128 x 128 fp32, 768 KB a row) with
``kernels.kda_decode_triton``. This times that kernel for each ``block_v`` x ``num_warps``, and,
for scale, what the rows' states cost as two state moves (``rows_triton.copy_rows_triton``, the
move in and out a chunked call needs) and the bandwidth floor of reading and writing the states
once. Each figure is the GPU's execution time (``KernelTimer`` in ``gpu`` mode: the launches are
queued behind a GPU-side spin), per launch, the median of ``--repeats`` blocks of ``--launches``.

    python3 benchmarks/gpu_kda_decode.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from prefixcache.kernels import KDALayerParams, StatePlan
from prefixcache.kernels.kda_decode_triton import kda_decode_triton
from prefixcache.kernels.rows_triton import copy_rows_triton
from prefixcache.models.timing import KernelTimer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=7)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--slots", type=int, default=2000)
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    torch.manual_seed(0)
    rows, heads, dim = args.rows, args.heads, 128
    params = KDALayerParams(
        A_log=torch.randn(heads, device=device),
        dt_bias=torch.randn(heads, dim, device=device),
        conv_weight=torch.randn(3 * heads * dim, 4, device=device, dtype=torch.bfloat16),
    )
    q, k, g = (torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16) for _ in "qkg")
    v = torch.randn(rows, heads, dim, device=device, dtype=torch.bfloat16)
    beta = torch.randn(rows, heads, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(v)
    cache = torch.zeros(args.slots, heads, dim, dim, device=device)
    # Rows read slots spread over the cache and write others, as a step does.
    plan = StatePlan(
        query_start_loc=tuple(range(rows + 1)),
        initial_slot=tuple(100 * r + 7 for r in range(rows)),
        running_slot=tuple(100 * r + 57 for r in range(rows)),
        checkpoints=((),) * rows,
    )
    read = torch.tensor(plan.initial_slot, device=device)
    written = torch.tensor(plan.running_slot, device=device)
    packed = torch.empty(rows, heads, dim, dim, device=device)

    def timed(launch) -> float:
        timer = KernelTimer(device, mode="gpu")
        for _ in range(3):
            launch()
        seconds = []
        for _ in range(args.repeats):
            with timer.measure():
                for _ in range(args.launches):
                    launch()
            seconds.append(timer.take() / args.launches)
        if timer.underruns:
            print(f"warning: {timer.underruns} underruns (the host fell behind)", file=sys.stderr)
        return 1e6 * statistics.median(seconds)

    results: dict[str, float] = {}
    for block_v in (16, 32, 64, 128):
        for num_warps in (1, 2, 4, 8):
            name = f"decode block_v={block_v} num_warps={num_warps}"
            results[name] = timed(
                lambda b=block_v, w=num_warps: kda_decode_triton(
                    q, k, v, g, beta, params, cache, plan, out, block_v=b, num_warps=w
                )
            )
    results["two moves (in and out)"] = timed(
        lambda: (
            copy_rows_triton(cache, packed, src_index=read),
            copy_rows_triton(packed, cache, dst_index=written),
        )
    )
    state_bytes = rows * cache[0].numel() * cache.element_size()
    for name, us in results.items():
        print(f"{name:34s} {us:7.2f} us  ({2 * state_bytes / us / 1e3:6.0f} GB/s of states)")
    kib = cache[0].numel() * cache.element_size() / 1024
    print(f"states: {rows} x {kib:.0f} KiB, read and written once")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(device),
                    "rows": rows,
                    "heads": heads,
                    "state_bytes_read_and_written": 2 * state_bytes,
                    "us_per_launch": {name: round(us, 3) for name, us in results.items()},
                },
                handle,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
