"""Where a reference-engine step spends its time: growing-prefix at a reduced size, profiled.

Runs the reference engine (``prefixcache.engine``) over a growing-prefix workload with the seed
geometry (B = 1536, U = 128, budget 8,192) but shorter prompts, once per policy, and prints for
each policy the KDA prefill time of every round after the first, the number of kernel-layer
calls, and the torch profiler's top operators over the rounds after the first. Meant for the
GPU (``--device cuda --backend flashkda-op``); runs on the CPU with the tiny model too.

    python benchmarks/engine_profile.py --device cuda --backend flashkda-op
"""

from __future__ import annotations

import argparse
import time

from prefixcache.engine import Engine, build_model, engine_config_for
from prefixcache.engine.policy import Policy
from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="flashkda-op")
    parser.add_argument("--first-prompt", type=int, default=24_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--policies", default="block,fine")
    parser.add_argument("--rows", type=int, default=30, help="profiler table rows")
    parser.add_argument("--kda-timing", choices=("wall", "gpu"), default="wall")
    parser.add_argument("--conv", choices=("torch", "triton"), default="torch")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiled runs")
    args = parser.parse_args()

    model = build_model(args.device, args.backend, kda_timing=args.kda_timing, conv=args.conv)
    spec = GrowingPrefixSpec(
        first_prompt=args.first_prompt, rounds=args.rounds, output_len=args.output_len
    )
    seed_geometry = Geometry(block_size=1536, unit=128, token_budget=8192, max_running=8)
    workload = PresetWorkload("growing-prefix", "profile", spec, seed_geometry)
    geometry = seed_geometry.aligned(model.backend.checkpoint_alignment)
    config = engine_config_for(workload, geometry, model.backend)
    activities = [ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for name in args.policies.split(","):
        policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
        engine = Engine(model, policy, config)
        # A whole unprofiled run first (warm-up and the reference figures), then a profiled one.
        started = time.perf_counter()
        run = engine.run(workload.build(model.config.vocab_size))
        seconds = time.perf_counter() - started
        later = [r for r in run.rounds() if r.round > 1]
        kda = sum(r.kda_prefill_seconds for r in later)
        tokens = sum(r.computed_prefill_tokens for r in later)
        print(
            f"\n== {name}: U={policy.unit}, {run.steps} steps ({run.decode_steps} planned by "
            f"decode_step), {seconds:.1f} s; rounds 2-"
            f"{args.rounds}: {tokens:,} prefill tokens, KDA prefill {kda * 1e3:.1f} ms "
            f"({kda / max(tokens, 1) * 1e9:.0f} ns/token), prefill "
            f"{sum(r.prefill_seconds for r in later) * 1e3:.1f} ms"
        )
        for r in later:
            print(
                f"   round {r.round}: {r.computed_prefill_tokens:,} tokens, KDA "
                f"{r.kda_prefill_seconds * 1e3:.1f} ms, prefill {r.prefill_seconds * 1e3:.1f} ms"
            )
        print(f"   KDA timing {args.kda_timing}: {run.kda_timing_underruns} underruns")
        if args.no_profile:
            continue
        with profile(activities=activities) as prof:
            engine.run(workload.build(model.config.vocab_size))
        sort = "self_cuda_time_total" if model.device.type == "cuda" else "self_cpu_time_total"
        print(
            prof.key_averages().table(sort_by=sort, row_limit=args.rows, max_name_column_width=50)
        )
        print(
            prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=50
            )
        )


if __name__ == "__main__":
    main()
