#!/usr/bin/env python3
"""Where the host's time goes when it launches one KDA + MLP layer group of a seed prefill step.

The Kimi-K3 proxy's first layer group (mixer norm, KDA layer, residual, MLP norm, MLP, residual)
over the seed's prefill step as the engine packs it (7 decode rows and a row of ``--tokens``
with one checkpoint: ``gpu_layers.kda_plans``' ``kda-step``), launched ``--calls`` times behind a
GPU-side spin of about 0.1 s (so no launch waits for the GPU; few enough calls that CUDA's queue
of pending launches never fills, which would block a launch until the GPU drains it) under
``cProfile``: the host time a group takes and the functions it goes to (own time, and cumulative
time of the project's and torch's entry points); and the GPU's execution time of a group. Where
the host's time is more than the GPU's, the GPU of a prefill step waits.

    PYTHONPATH=<site with the wheel> PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> \\
        python3 benchmarks/gpu_host_profile.py --json "$OUT/host_profile.json"
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_layers import gpu_ms, host_ms, kda_plans


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2087)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--backend", default="flashkda-op")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    from prefixcache import kernels
    from prefixcache.engine import build_model
    from prefixcache.models import KDALayer, ModelConfig
    from prefixcache.models.layers import rms_norm

    model = build_model("cuda", args.backend, config=ModelConfig.kimi_k3_tp8(1))
    device, dtype = model.device, model.dtype
    kda = next(layer for layer in model.mixers if isinstance(layer, KDALayer))
    mlp, eps = model.mlps[0], model.config.rms_eps
    state = kernels.StateCache.for_layer(kda.params, 20, device=device)
    plan = kda_plans(model.backend, args.tokens // 16 * 16, state.num_blocks)["kda-step"]
    x = torch.randn(plan.num_tokens, model.config.hidden_size, device=device).to(dtype)

    def group() -> torch.Tensor:
        h = x + kda.forward(rms_norm(x, model.mixer_norms[0], eps), model.backend, state, plan)
        return h + mlp.forward(rms_norm(h, model.mlp_norms[0], eps))

    def groups() -> None:
        for _ in range(args.calls):
            group()

    profiler = cProfile.Profile()

    def profiled_groups() -> None:
        profiler.enable()
        groups()
        profiler.disable()

    rounds = 5
    with torch.inference_mode():
        for _ in range(3):
            group()
        # Host time behind a spin (gpu_layers.host_ms): the launches of --calls groups, a round.
        plain_us = host_ms(groups, device, rounds, backlog=True) * 1e3 / args.calls
        host_ms(profiled_groups, device, rounds, backlog=True)
        # The GPU's execution of --calls groups behind a spin (None: the launches outlasted it).
        groups_ms = gpu_ms(groups, device, rounds, backlog=True)
    gpu_us = None if groups_ms is None else groups_ms * 1e3 / args.calls
    gpu = "-" if gpu_us is None else f"{gpu_us:.1f}"
    print(f"{plan.num_tokens} tokens: host {plain_us:.1f} us a group, GPU {gpu} us a group")
    stats = pstats.Stats(profiler)
    rows: list[dict[str, Any]] = []
    for (filename, line, name), (calls, _, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(filename).name}:{line} {name}",
                "calls_a_group": calls / (rounds * args.calls),
                "own_us": own / (rounds * args.calls) * 1e6,
                "cumulative_us": cumulative / (rounds * args.calls) * 1e6,
            }
        )
    for key, title in (("own_us", "own time"), ("cumulative_us", "cumulative time")):
        print(f"\nby {title} (us a group, under cProfile)")
        for row in sorted(rows, key=lambda r: -r[key])[:28]:
            print(
                f"{row['own_us']:8.1f} {row['cumulative_us']:8.1f} {row['calls_a_group']:5.1f}x"
                f"  {row['function']}"
            )
    if args.json:
        document = {
            "device": torch.cuda.get_device_name(device),
            "tokens": plan.num_tokens,
            "host_us_a_group": plain_us,
            "gpu_us_a_group": gpu_us,
            "functions": sorted(rows, key=lambda r: -r["cumulative_us"])[:80],
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(document, handle, separators=(",", ":"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
