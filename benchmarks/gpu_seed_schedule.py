#!/usr/bin/env python3
"""Why TTFT does not follow the prefill tokens in the seed run: the schedule, without a GPU.

Runs the engine over the seed preset (growing-prefix, B = 1,536, U = 128 on a 16-aligned kernel,
budget 8,192) under ``block`` and ``fine`` with a stand-in forward (no model work; the schedule
does not depend on time: follow-up requests arrive when their previous turn finishes), records
every step's scheduled tokens and the step in which each request is admitted and gets its first
token, and prices the steps with a cost model: a step with a prefill row costs ``fixed +
per_token * tokens`` (default 12 ms + 13 us a token: the H200 figures of the Kimi-K3 proxy at
164K contexts, docs/BENCHMARKS.md), a decode step (every row one token) ``decode`` (default: the
same formula). ``--from-json FILE`` takes all three from a seed run's measured step times
(``simulate --json``'s ``step_times``: block's, or each policy's own with ``--per-policy``). It
prints, per policy and over rounds 2 and later, the modelled TTFT p50, how many steps a request
waits for its first token, and the tokens of the step that gives it (its own prefill and the
other requests' prefills and decodes packed with it).

    python benchmarks/gpu_seed_schedule.py [--output-len 8] [--fixed-ms 12] [--token-us 13]
        [--decode-ms 6] [--from-json seed.json [--per-policy]]

It reads the engine loop's private hooks (``_Loop.admit_arrivals``, ``_Loop.after_forward``):
a diagnostic, not an API.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from typing import Any

import numpy as np
import torch


def _hooks(
    original_admit: Any,
    original_after: Any,
    steps: list[int],
    admitted: dict[int, int],
    first: dict[int, int],
) -> tuple[Any, Any]:
    """The loop hooks: a request's admission step and its first token's step (``steps`` holds
    one entry per step run so far, appended by the forward)."""

    def admit(self: Any) -> None:
        before = set(self.live)
        original_admit(self)
        for seq_id in set(self.live) - before:
            admitted[seq_id] = len(steps)

    def after(self: Any, rows: Any, *rest: Any) -> None:
        waiting = {seq.seq_id for seq in rows if seq.first_token_time is None}
        original_after(self, rows, *rest)
        for seq in rows:
            if seq.seq_id in waiting and seq.first_token_time is not None:
                first[seq.seq_id] = len(steps) - 1

    return admit, after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--fixed-ms", type=float, default=12.0)
    parser.add_argument("--token-us", type=float, default=13.0)
    parser.add_argument("--decode-ms", type=float, help="a decode step's cost (default: formula)")
    parser.add_argument("--from-json", help="a seed run's JSON: price steps at its step times")
    parser.add_argument(
        "--per-policy", action="store_true", help="with --from-json: each policy's own step times"
    )
    args = parser.parse_args(argv)
    measured: dict[str, dict[str, float]] = {}
    if args.from_json:
        with open(args.from_json, encoding="utf-8") as handle:
            for name, policy in json.load(handle)["policies"].items():
                measured[name] = policy["step_times"]

    from prefixcache.engine import Engine, Policy, engine_config_for
    from prefixcache.engine import engine as engine_module
    from prefixcache.engine.workloads import workload_preset
    from prefixcache.kernels import Step, TorchBackend
    from prefixcache.models import HybridModel, ModelConfig

    workload = workload_preset("growing-prefix", "seed")
    spec = dataclasses.replace(workload.spec, output_len=args.output_len)
    workload = dataclasses.replace(workload, spec=spec)
    backend = TorchBackend(checkpoint_alignment=16)  # FlashKDA's alignment
    config = ModelConfig(
        vocab_size=64, hidden_size=8, kda_heads=1, kda_head_dim=4, attention_heads=1,
        attention_kv_heads=1, attention_head_dim=4, mlp_hidden_size=8,
    )  # fmt: skip
    model = HybridModel(config, backend)  # its caches are allocated, never computed
    geometry = workload.geometry.aligned(backend.checkpoint_alignment)
    # One step at a time: the hooks are those of the plain loop (the seed runs use --no-overlap).
    pools = engine_config_for(workload, geometry, backend, overlap=False)

    # Per policy run: each step's tokens and whether it only decodes (recorded by the forward,
    # from the step's own statement), each request's admission step and first token's step.
    steps: list[int] = []
    decode_only: list[bool] = []
    admitted: dict[int, int] = {}
    first: dict[int, int] = {}

    def stand_in(step: Step, token_ids: Any, caches: Any, logits_indices: Any) -> torch.Tensor:
        steps.append(step.num_tokens)
        decode_only.append(step.prefill_tokens is None)
        return torch.zeros(len(logits_indices), config.vocab_size)

    loop = engine_module._Loop
    original_admit, original_after = loop.admit_arrivals, loop.after_forward
    admit, after = _hooks(original_admit, original_after, steps, admitted, first)
    for name in ("block", "fine"):
        policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
        fixed, per_token, decode = args.fixed_ms, args.token_us, args.decode_ms
        if measured:
            times = measured[name if args.per_policy else "block"]
            fixed, per_token = times["prefill_fixed_ms"], times["prefill_per_token_us"]
            decode = times["decode_ms_p50"]
        for record in (steps, decode_only, admitted, first):
            record.clear()
        loop.admit_arrivals, loop.after_forward = admit, after  # type: ignore[method-assign]
        try:
            run = Engine(model, policy, pools, forward=stand_in).run(workload.build(64))
        finally:
            loop.admit_arrivals, loop.after_forward = original_admit, original_after  # type: ignore[method-assign]
        cost = [
            decode if decode is not None and only else fixed + per_token * 1e-3 * tokens
            for tokens, only in zip(steps, decode_only, strict=True)
        ]
        ttft, waits, step_tokens, own = [], [], [], []
        for seq_id, result in run.requests.items():
            if result.round < 2:
                continue
            start, end = admitted[seq_id], first[seq_id]
            ttft.append(sum(cost[start : end + 1]))
            waits.append(end - start + 1)
            step_tokens.append(steps[end])
            own.append(result.computed_prefill_tokens)
        p50 = statistics.median(ttft)
        priced = "the formula" if decode is None else f"{decode:.2f} ms"
        print(
            f"{name:>5}: priced {fixed:.2f} ms + {per_token:.2f} us a token, decode steps "
            f"{priced} ({sum(decode_only):,} of {len(steps):,} steps)"
        )
        print(
            f"{name:>5}: prefill tokens {sum(own):,}; modelled TTFT p50 {p50:.1f} ms; "
            f"steps to the first token: {np.mean(waits):.2f} on average, 1 for "
            f"{sum(w == 1 for w in waits)} of {len(waits)}; the first token's step: p50 "
            f"{statistics.median(step_tokens):,.0f} tokens (10/50/90%: "
            f"{', '.join(f'{q:,.0f}' for q in np.percentile(step_tokens, [10, 50, 90]))}), "
            f"the request's own p50 {statistics.median(own):,.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
