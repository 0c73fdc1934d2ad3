#!/usr/bin/env python3
"""The KDA short convolution on a GPU: torch (``conv.causal_conv``) against Triton
(``conv_triton.causal_conv_triton``), checked and timed.

For each shape (packed rows of Kimi-K3's per-GPU 12 heads and Kimi-Linear's 32 heads, K = V =
128, bf16 inputs, float32 conv cache, one checkpoint per row; and a decode-mixed step, one
prefill row among seven one-token rows, as the reference engine's steps are) it checks that the
two agree (outputs to one bf16 rounding, conv windows exactly but for initial-window rows, see
``conv_triton``) and times both with ``triton.testing.do_bench`` (median, after warm-up, random
data), and the host time of one call (what a synchronised wall clock charges when the GPU waits
for launches). Prints a table; ``--json FILE`` writes the figures.

    PYTHONPATH=<site with the wheel> python3 benchmarks/conv_gpu.py --json "$OUT/conv_gpu.json"
    python3 benchmarks/conv_gpu.py --smoke      # CPU, Triton's interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch


def plan_for(kernels: Any, lengths: list[int], num_slots: int) -> Any:
    """Rows with initial states (slots 0..R-1), running slots R..2R-1, one checkpoint per row
    longer than 32 tokens at its last multiple of 16 (slots after)."""
    rows = len(lengths)
    offsets, slots = [], []
    for row, length in enumerate(lengths):
        at = (length - 1) // 16 * 16
        offsets.append([at] if length > 32 else [0])
        slots.append([2 * rows + row] if length > 32 else [-1])
    return kernels.TorchBackend(16).check_plan(
        query_start_loc=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        initial_slot=list(range(rows)),
        running_slot=[rows + r for r in range(rows)],
        checkpoint_offsets=offsets,
        checkpoint_slots=slots,
        num_slots=num_slots,
        num_tokens=sum(lengths),
    )


def host_us(fn: Callable[[], object], device: torch.device, calls: int = 30) -> float:
    times = []
    for _ in range(calls):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def bench_ms(fn: Callable[[], object], device: torch.device, smoke: bool) -> float:
    if smoke or device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def case(kernels: Any, conv: Any, conv_triton: Any, name: str, heads: int, lengths: list[int],
         device: torch.device, smoke: bool) -> dict[str, Any]:  # fmt: skip
    dim = 128 if not smoke else 8
    params = kernels.KDALayerParams.random(heads, dim, gate="bounded").to(device)
    channels = params.conv_channels
    rows = len(lengths)
    slots = 3 * rows + 1
    plan = plan_for(kernels, lengths, slots)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(sum(lengths), channels, generator=generator).to(device, dtype)
    cache = torch.randn(slots, channels, 3, generator=generator).to(device)
    splits = (heads * dim, heads * dim, heads * dim)
    torch_cache, triton_cache = cache.clone(), cache.clone()
    expected = conv.causal_conv(x, params, torch_cache, plan, splits)
    got = conv_triton.causal_conv_triton(x, params, triton_cache, plan, splits)
    scale = max(float(e.float().abs().max()) for e in expected)
    out_diff = max(
        float((g.float() - e.float()).abs().max()) for g, e in zip(got, expected, strict=True)
    )
    window_diff = float((triton_cache - torch_cache).abs().max())
    torch_ms = bench_ms(
        lambda: conv.causal_conv(x, params, torch_cache, plan, splits), device, smoke
    )
    triton_ms = bench_ms(
        lambda: conv_triton.causal_conv_triton(x, params, triton_cache, plan, splits), device, smoke
    )
    return {
        "case": name,
        "heads": heads,
        "tokens": sum(lengths),
        "rows": rows,
        "max_output_difference_relative": out_diff / scale,
        "max_window_difference": window_diff,
        "torch_ms": torch_ms,
        "triton_ms": triton_ms,
        "torch_host_us": host_us(
            lambda: conv.causal_conv(x, params, torch_cache, plan, splits), device
        ),
        "triton_host_us": host_us(
            lambda: conv_triton.causal_conv_triton(x, params, triton_cache, plan, splits), device
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("conv_gpu.py needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from kernels_support import import_kernels

    kernels = import_kernels()
    import importlib

    conv = importlib.import_module(f"{kernels.__name__}.conv")
    conv_triton = importlib.import_module(f"{kernels.__name__}.conv_triton")
    device = torch.device("cpu" if args.smoke else "cuda")
    scale = 64 if args.smoke else 1
    shapes = [
        ("1 x 8192", [8192 // scale]),
        ("4 x 8192", [8192 // scale] * 4),
        ("1 x 2500 + 7 decode", [2500 // scale] + [1] * 7),
    ]
    results = [
        case(
            kernels, conv, conv_triton, f"{name}, {heads} heads", heads, lengths, device, args.smoke
        )
        for heads in ((12, 32) if not args.smoke else (2,))
        for name, lengths in shapes
    ]
    header = (
        f"{'case':<32} {'torch ms':>9} {'triton ms':>9} {'torch host us':>13} "
        f"{'triton host us':>14} {'out diff':>9} {'window diff':>11}"
    )
    print(header)
    for r in results:
        print(
            f"{r['case']:<32} {r['torch_ms']:9.3f} {r['triton_ms']:9.3f} "
            f"{r['torch_host_us']:13.1f} {r['triton_host_us']:14.1f} "
            f"{r['max_output_difference_relative']:9.1e} {r['max_window_difference']:11.1e}"
        )
    if args.json:
        meta = {"torch": torch.__version__, "device": str(device)}
        if device.type == "cuda":
            meta["gpu"] = torch.cuda.get_device_name()
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"meta": meta, "cases": results}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
