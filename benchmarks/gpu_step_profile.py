#!/usr/bin/env python3
"""Where one engine step of the Kimi-K3 cost proxy spends its time: host launches against GPU work.

Runs the reference engine over a short growing-prefix workload with the seed geometry (B = 1536,
U = 128, budget 8,192; 8 streams of ``--first-prompt`` tokens growing by 2,000 a round) and,
once round ``--measure-round`` has begun (default the last: every prefill chunk of a step past
the previous round's prompt; the rounds before warm every shape), measures the next ``--steps``
prefill steps and decode-only steps three ways:

- **syncs**: under ``torch.cuda.set_sync_debug_mode("warn")``, every operation inside the
  forward that waits for the GPU (a device-to-host read, a pageable upload), by source line.
  None should be left: a forward the host launches ahead of the GPU has none.
- **host ms / GPU ms**: the stream is given a backlog first (``torch.cuda._sleep``), so the host
  launches the whole forward before the GPU reaches it; the host's time to return from the
  forward is its launch time, the elapsed time between two events around it the GPU's own
  work. A step whose host time exceeds its GPU time is launch bound: its wall time is the host's.
- **wall ms** (CPU only): the forward's wall time. On CUDA a step's wall time is what the
  seed runs record (``prefixcache simulate``'s step times).

Then one prefill and one decode step under ``torch.profiler``: the top operators by GPU and by
host time go to ``--profile-dir`` (small text files). ``--json FILE`` writes every figure.

    PYTHONPATH=<site with the wheel> PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> \\
        python3 benchmarks/gpu_step_profile.py --json "$OUT/steps.json" --profile-dir "$OUT"
    python3 benchmarks/gpu_step_profile.py --smoke     # CPU, the tiny model: the code path only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefixcache.engine import Engine, build_model, engine_config_for
from prefixcache.engine.policy import Policy
from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload
from prefixcache.kernels import Step
from prefixcache.models import ModelConfig

BACKLOG_CYCLES = 200_000_000  # about 100 ms at the H200's clock: longer than any step's launches


class Probe:
    """The engine's forward, measuring the steps after the first round (module docstring)."""

    def __init__(self, engine_forward: Any, model: Any, after_context: int, steps: int) -> None:
        self.inner = engine_forward
        self.model = model
        self.after_context = after_context
        self.wanted = steps
        self.active = False
        self.records: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
        self.syncs: dict[str, Counter[str]] = {"prefill": Counter(), "decode": Counter()}
        self.profiles: dict[str, Any] = {}

    def __call__(self, step: Step, token_ids: torch.Tensor, caches: Any, indices: Any) -> Any:
        kind = "decode" if step.prefill_tokens is None else "prefill"
        if kind == "prefill" and not self.active:
            prefilling = np.diff(np.asarray(step.query_start_loc, dtype=np.int64)) > 1
            shortest = int(np.asarray(step.seq_lens, dtype=np.int64)[prefilling].min())
            self.active = shortest > self.after_context
        cuda = self.model.device.type == "cuda"
        records = self.records[kind]
        if not self.active or not cuda:
            if self.active and len(records) < self.wanted:
                start = time.perf_counter()
                out = self.inner(step, token_ids, caches, indices)
                records.append({"tokens": step.num_tokens, "wall_ms": _ms(start)})
                return out
            return self.inner(step, token_ids, caches, indices)
        if len(records) < self.wanted:
            return self._measure(kind, step, token_ids, caches, indices)
        if kind not in self.profiles:
            return self._profile(kind, step, token_ids, caches, indices)
        return self.inner(step, token_ids, caches, indices)

    def _measure(self, kind: str, step: Step, token_ids: Any, caches: Any, indices: Any) -> Any:
        # Timing pass: the backlog lets the host launch everything before the GPU starts.
        torch.cuda.synchronize()
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(BACKLOG_CYCLES)
        begin.record()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                start = time.perf_counter()
                out = self.inner(step, token_ids, caches, indices)
                host = _ms(start)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        end.record()
        began_gpu = begin.query()  # True: the GPU reached the forward before the host finished
        end.synchronize()
        gpu = float(begin.elapsed_time(end))
        found = [w for w in caught if "synchroniz" in str(w.message)]
        for w in found:
            self.syncs[kind][f"{Path(w.filename).name}:{w.lineno}"] += 1
        # Wall pass is the same step's cost from an idle GPU: measured on the next step of the
        # kind instead would mix shapes, so the GPU time is paired with the host time here and
        # the wall time comes from the run's own step times.
        self.records[kind].append(
            {
                "tokens": step.num_tokens,
                "rows": step.num_rows,
                "host_ms": host,
                "gpu_ms": gpu,
                "syncs": len(found),
                "backlog_underrun": bool(began_gpu),
            }
        )
        return out

    def _profile(self, kind: str, step: Any, token_ids: Any, caches: Any, indices: Any) -> Any:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = self.inner(step, token_ids, caches, indices)
            torch.cuda.synchronize()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel"))
        launches += sum(e.count for e in events if "LaunchKernel" in e.key and "cuda" not in e.key)
        self.profiles[kind] = {
            "tokens": int(np.asarray(step.query_start_loc)[-1]),
            "by_gpu": events.table(
                sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60
            ),
            "by_host": events.table(
                sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60
            ),
            "kernel_launches": launches,
        }
        return out


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1e3


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of each figure over the measured steps of a kind."""
    if not records:
        return {"steps": 0}
    out: dict[str, Any] = {"steps": len(records)}
    for key in ("tokens", "host_ms", "gpu_ms", "wall_ms", "syncs"):
        values = [r[key] for r in records if key in r]
        if values:
            out[key + "_p50"] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="flashkda-op")
    parser.add_argument("--depth", type=int, default=2, help="layer groups of the proxy")
    parser.add_argument("--policy", default="fine")
    parser.add_argument("--first-prompt", type=int, default=120_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--steps", type=int, default=5, help="measured steps of each kind")
    parser.add_argument(
        "--measure-round",
        type=int,
        default=None,
        help="measure from this round on (default: the last; earlier rounds warm every shape)",
    )
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--profile-dir", help="write the profiler tables here")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode-only steps from CUDA graphs where they can run (default on)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny model, small sizes")
    args = parser.parse_args(argv)
    if args.smoke:
        args.device, args.backend = "cpu", "torch"
        args.first_prompt, args.output_len = 600, 4
    config = None if args.smoke else ModelConfig.kimi_k3_tp8(args.depth)
    model = build_model(
        args.device, args.backend, config=config, cuda_graphs="auto" if args.cuda_graphs else False
    )
    growth = 2_000 if not args.smoke else 100
    spec = GrowingPrefixSpec(
        first_prompt=args.first_prompt,
        growth=growth,
        rounds=args.rounds,
        output_len=args.output_len,
    )
    geometry = Geometry(block_size=1536, unit=128, token_budget=8192, max_running=8)
    if args.smoke:
        geometry = Geometry(block_size=96, unit=8, token_budget=512, max_running=8)
    workload = PresetWorkload("growing-prefix", "profile", spec, geometry)
    geometry = geometry.aligned(model.backend.checkpoint_alignment)
    config_ = engine_config_for(workload, geometry, model.backend, overlap=False)
    policy = Policy.named(args.policy, block_size=geometry.block_size, fine_unit=geometry.unit)
    engine = Engine(model, policy, config_)
    measured = args.rounds if args.measure_round is None else args.measure_round
    # A prefill chunk of round N ends past the prompt of round N - 1.
    probe = Probe(engine.forward, model, spec.prompt_len(max(1, measured - 1)), args.steps)
    engine.forward = probe
    started = time.perf_counter()
    run = engine.run(workload.build(model.config.vocab_size))
    seconds = time.perf_counter() - started
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
        "model": {"depth": args.depth, "layers": list(model.config.layers)},
        "policy": args.policy,
        "workload": {"first_prompt": args.first_prompt, "rounds": args.rounds},
        "run_seconds": seconds,
        "steps": run.steps,
        "cuda_graphs": model.graphs is not None,
        "graph_captures": 0 if model.graphs is None else model.graphs.captures,
        "graph_replays": 0 if model.graphs is None else model.graphs.replays,
    }
    print(
        f"{args.policy}: {run.steps} steps in {seconds:.1f} s, CUDA graphs "
        f"{'on' if report['cuda_graphs'] else 'off'} ({report['graph_captures']} captured, "
        f"{report['graph_replays']} replays)"
    )
    for kind in ("prefill", "decode"):
        report[kind] = summary(probe.records[kind])
        report[kind]["records"] = probe.records[kind]
        report[kind]["syncs_by_line"] = dict(probe.syncs[kind].most_common())
        if kind in probe.profiles:
            report[kind]["kernel_launches"] = probe.profiles[kind]["kernel_launches"]
        print(f"{kind}: {json.dumps({k: v for k, v in report[kind].items() if k != 'records'})}")
    if args.profile_dir:
        folder = Path(args.profile_dir)
        folder.mkdir(parents=True, exist_ok=True)
        for kind, prof in probe.profiles.items():
            text = f"{kind} step, {prof['tokens']} tokens\n\n{prof['by_gpu']}\n\n{prof['by_host']}"
            (folder / f"profile_{kind}.txt").write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
