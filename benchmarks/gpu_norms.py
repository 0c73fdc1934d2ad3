#!/usr/bin/env python3
"""What the Kimi-K3 proxy's RMS norms cost a prefill step on the GPU: the model's fused norm
against the float32 formula it replaced.

The proxy normalises its hidden state twice a layer (before the mixer and before the MLP,
``[T, hidden]``) and each KDA layer's output once more per head (``[T, H, 128]``, then the
sigmoid output gate). ``models.layers.rms_norm`` is torch's fused ``rms_norm`` (one kernel on
CUDA); until e4490b2 it was :func:`float32_formula`, nine separate operations each passing over
a float32 copy. At the seed's prefill sizes this times both, with the KDA output gate as the
model applies it: the GPU's execution per call (``gpu_layers.gpu_ms`` behind a backlog: no wait
for the host's launches), the host's time to launch one call (``gpu_layers.host_ms``), the
kernels a call launches (``gpu_layers.kernel_breakdown``) and the largest difference between the
two results. The widths and epsilon are the ``kimi-k3-tp8`` model's.

    PYTHONPATH=<site with the wheel> python3 benchmarks/gpu_norms.py --json out.json
    python3 benchmarks/gpu_norms.py --smoke     # CPU, float32, a narrow proxy: the code path only
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layers import gpu_ms, host_ms, kernel_breakdown


def float32_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The model's norm before e4490b2: ``x / rms(x) * weight`` as separate float32 operations."""
    y = x.to(torch.float32)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(torch.float32)).to(x.dtype)


def main(argv: list[str]) -> int:
    from prefixcache.models import ModelConfig
    from prefixcache.models.layers import rms_norm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2087,2727,4096")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, widths / 32")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    config = ModelConfig.kimi_k3_tp8(1, divisor=32 if args.smoke else 1)
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    hidden, heads, dim = config.hidden_size, config.kda_heads, config.kda_head_dim
    eps = config.rms_eps
    torch.manual_seed(0)
    cases: list[dict[str, Any]] = []
    with torch.inference_mode():
        for tokens in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(tokens, hidden, device=device, dtype=dtype)
            w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)
            o = torch.randn(tokens, heads, dim, device=device, dtype=dtype)
            gate = torch.randn_like(o)
            ow = 1 + 0.1 * torch.randn(dim, device=device, dtype=dtype)
            shapes: dict[str, dict[str, Callable[[], torch.Tensor]]] = {
                f"hidden [{tokens}, {hidden}]": {
                    "formula": lambda x=x, w=w: float32_formula(x, w, eps),
                    "model": lambda x=x, w=w: rms_norm(x, w, eps),
                },
                f"KDA output [{tokens}, {heads}, {dim}] * sigmoid(gate)": {
                    "formula": lambda o=o, ow=ow, gate=gate: (
                        float32_formula(o, ow, eps) * torch.sigmoid(gate)
                    ),
                    "model": lambda o=o, ow=ow, gate=gate: (
                        rms_norm(o, ow, eps) * torch.sigmoid(gate)
                    ),
                },
            }
            for shape, impls in shapes.items():
                difference = float(
                    (impls["formula"]().float() - impls["model"]().float()).abs().max()
                )
                for name, fn in impls.items():
                    busy = gpu_ms(fn, device, args.reps, backlog=True)
                    case = {
                        "shape": shape,
                        "tokens": tokens,
                        "impl": name,
                        "busy_us": None if busy is None else busy * 1e3,
                        "host_us": host_ms(fn, device, args.reps) * 1e3,
                        "kernels": (
                            None
                            if args.smoke
                            else sum(row["per_call"] for row in kernel_breakdown(fn))
                        ),
                        "max_abs_difference": difference,
                    }
                    cases.append(case)
                    print(
                        f"{shape:<44} {name:<7} GPU {case['busy_us'] or float('nan'):8.1f} us  "
                        f"host {case['host_us']:6.1f} us  {case['kernels']} kernels  "
                        f"|formula - model| <= {difference:.2e}",
                        flush=True,
                    )
    if args.json:
        document = {
            "device": "cpu" if args.smoke else torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "cases": cases,
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(document, handle, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
