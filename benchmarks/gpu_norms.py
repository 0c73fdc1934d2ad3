#!/usr/bin/env python3
"""What the reference model's RMS norms cost a prefill step on the GPU, against torch's own.

The Kimi-K3 proxy normalises its hidden state twice a layer (before the mixer and before the MLP,
``[T, 7168]``) and each KDA layer's output once more per head (``[T, 12, 128]``, then the sigmoid
output gate). ``models.layers.rms_norm`` computes in float32 as separate torch operations (about
seven launches, each pass reading or writing the float32 copy); an engine runs each as one
fused kernel. This times, at the seed's prefill sizes, the model's function against
``torch.nn.functional.rms_norm`` (whatever this torch runs for it on CUDA: the profile says how many
kernels), with the KDA output gate as the model applies it: the GPU's execution per call
(``KernelTimer`` in ``gpu`` mode: the launches queued behind a GPU-side spin), the host's time to
launch one call (the GPU kept busy, so no launch waits for it), the kernels a call launches and
the largest difference between the two results.

    python3 benchmarks/gpu_norms.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from prefixcache.models.layers import rms_norm
from prefixcache.models.timing import KernelTimer

EPS = 1e-6


def busy_us(fn: Callable[[], object], device: torch.device, launches: int, repeats: int) -> float:
    """The GPU's execution time of one call in us: the median over ``repeats`` blocks of
    ``launches`` calls queued behind a spin."""
    timer = KernelTimer(device, "gpu")
    times = []
    for _ in range(repeats):
        with timer.measure():
            for _ in range(launches):
                fn()
        times.append(timer.take() * 1e6 / launches)
    if timer.underruns:
        raise RuntimeError("the spin drained before the launches ended: raise the backlog")
    return statistics.median(times)


def host_us(fn: Callable[[], object], launches: int, repeats: int) -> float:
    """The host's time to launch one call in us, behind a spin long enough that no launch
    waits for the GPU (the median over ``repeats`` blocks of ``launches`` calls)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]
        start = time.perf_counter()
        for _ in range(launches):
            fn()
        times.append((time.perf_counter() - start) * 1e6 / launches)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernels(fn: Callable[[], object]) -> int:
    """The GPU kernels one call launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type.name == "CUDA")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2087,2727,4096")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--launches", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    cases: list[dict[str, Any]] = []
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
            w = 1 + 0.1 * torch.randn(args.hidden, device=device, dtype=dtype)
            o = torch.randn(tokens, args.heads, 128, device=device, dtype=dtype)
            gate = torch.randn_like(o)
            ow = 1 + 0.1 * torch.randn(128, device=device, dtype=dtype)
            shapes: dict[str, dict[str, Callable[[], torch.Tensor]]] = {
                f"hidden [{tokens}, {args.hidden}]": {
                    "model": lambda x=x, w=w: rms_norm(x, w, EPS),
                    "torch": lambda x=x, w=w: F.rms_norm(x, (x.shape[-1],), w, EPS),
                },
                f"KDA output [{tokens}, {args.heads}, 128] * sigmoid(gate)": {
                    "model": lambda o=o, ow=ow, gate=gate: (
                        rms_norm(o, ow, EPS) * torch.sigmoid(gate)
                    ),
                    "torch": lambda o=o, ow=ow, gate=gate: (
                        F.rms_norm(o, (128,), ow, EPS) * torch.sigmoid(gate)
                    ),
                },
            }
            for shape, impls in shapes.items():
                difference = float(
                    (impls["model"]().float() - impls["torch"]().float()).abs().max()
                )
                for name, fn in impls.items():
                    case = {
                        "shape": shape,
                        "tokens": tokens,
                        "impl": name,
                        "busy_us": busy_us(fn, device, args.launches, args.repeats),
                        "host_us": host_us(fn, args.launches, args.repeats),
                        "kernels": kernels(fn),
                        "max_abs_difference": difference,
                    }
                    cases.append(case)
                    print(
                        f"{shape:<44} {name:<6} GPU {case['busy_us']:8.1f} us  host "
                        f"{case['host_us']:6.1f} us  {case['kernels']} kernels  "
                        f"|model - torch| <= {difference:.2e}",
                        flush=True,
                    )
    if args.json:
        document = {
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cases": cases,
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(document, handle, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
