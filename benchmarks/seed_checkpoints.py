#!/usr/bin/env python3
"""How many interior checkpoints the engine plans in each prefill row of a preset's steps.

Runs the reference engine one step at a time over a workload preset (default: growing-prefix
at the seed's size) with a forward that computes nothing and returns zero logits, so a run of
the seed's 26M prompt tokens takes seconds on a CPU: the manager, the scheduler and the plans
are the real ones, only the generated tokens differ (always id 0). A kernel that writes one
checkpoint per call (vLLM's FlashKDA op) runs a row with one interior checkpoint in one call and
chains a second call for each further one, so this count says which shape the seed's prefill
steps have (``benchmarks/gpu_layers.py``'s ``kda-step``). Prints, per policy, the prefill rows by
size (up to ``--short`` tokens or more) and interior checkpoints, and the host's work before a
request's first token (TTFT less its share of the forwards, p50 over rounds 2 and later: with a
forward that computes nothing, admission, scheduling and the plan).

    python3 benchmarks/seed_checkpoints.py                  # seed preset, block and fine
    python3 benchmarks/seed_checkpoints.py --preset default --alignment 16
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from typing import Any

import numpy as np
import torch


class _Alignment:
    """The two backend attributes the engine's configuration reads."""

    def __init__(self, alignment: int) -> None:
        self.checkpoint_alignment = alignment
        self.max_checkpoints_per_step = None


def count(
    preset: str, policy_name: str, alignment: int, short: int
) -> tuple[collections.Counter[Any], float]:
    """(row of at most ``short`` tokens, interior checkpoints) -> prefill rows, over one run;
    and the host's milliseconds before a request's first token (p50, rounds 2 and later)."""
    from prefixcache.engine import Engine, build_model, engine_config_for
    from prefixcache.engine.policy import Policy
    from prefixcache.engine.workloads import workload_preset

    model = build_model("cpu", "torch", decode_attention="torch")
    workload = workload_preset("growing-prefix", preset, vocab_size=model.config.vocab_size)
    geometry = workload.geometry.aligned(alignment)
    config = engine_config_for(workload, geometry, _Alignment(alignment), overlap=False)
    counts: collections.Counter[Any] = collections.Counter()

    def forward(step: Any, token_ids: Any, caches: Any, logits_indices: Any) -> torch.Tensor:
        rows = np.diff(np.asarray(step.query_start_loc, dtype=np.int64))
        slots = np.asarray(step.state_group(caches.state_group).checkpoint_slots)
        for row, tokens in enumerate(rows.tolist()):
            if tokens > 1:
                interior = int((slots[row] >= 0).sum()) if slots.size else 0
                counts[(tokens <= short, interior)] += 1
        return torch.zeros(len(logits_indices), model.config.vocab_size)

    policy = Policy.named(policy_name, block_size=geometry.block_size, fine_unit=geometry.unit)
    result = Engine(model, policy, config, forward=forward).run(
        workload.build(model.config.vocab_size)
    )
    host_ms = statistics.median(
        1e3 * (r.ttft_s - r.prefill_seconds) for r in result.requests.values() if r.round > 1
    )
    return counts, host_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="seed", choices=("default", "seed"))
    parser.add_argument("--policies", default="block,fine")
    parser.add_argument("--alignment", type=int, default=16, help="the kernel's grid A")
    parser.add_argument("--short", type=int, default=4096, help="rows up to this many tokens")
    args = parser.parse_args(argv)
    print("| policy | prefill rows | interior checkpoints | rows |")
    print("|---|---|---|---|")
    host = {}
    for name in args.policies.split(","):
        counts, host[name] = count(args.preset, name, args.alignment, args.short)
        for (is_short, interior), rows in sorted(counts.items(), reverse=True):
            size = f"<= {args.short:,} tokens" if is_short else f"> {args.short:,} tokens"
            print(f"| {name} | {size} | {interior} | {rows} |")
    for name, ms in host.items():
        print(f"{name}: the host's work before a request's first token, p50 {ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
