"""The reference engine overlapped against one step at a time: time per step, and the holds.

Two measurements, each printed as a table:

1. ``--timing`` (the default): each workload (default presets of growing-prefix and
   shared-prompts) under one policy, overlapped and not, alternated ``--reps`` times: the
   engine's wall time per step, the forward's time per step (sampling and the logits' copy to
   the host included), the host's time per step (everything but waiting for forwards:
   scheduling, planning, inputs, commits) and the host time hidden behind the forwards
   (``RunResult.hidden_host_seconds``: the host's time less the forwards' idle time, the wall
   time outside them, during which they waited for the host). Wall-clock figures: run it
   alone on the machine (``flock -x``). ``--device-ms LIST`` also runs each with a forward
   that sleeps that long after the model's forward: a stand-in for device time, during which
   (as with a GPU) the forward holds no GIL; the tiny model's own forward is mostly Python
   dispatch, which holds the GIL and so competes with the host's work instead of hiding it.
2. ``--holds``: shared-prompts and agentic overlapped, with and without the pending hold (a
   waiting request whose prefix a plan in flight computes waits for it): prefill tokens
   computed, hits, holds. These counts do not depend on the machine's speed (every request of
   both workloads arrives at time 0 or when its predecessor finishes). ``--system-prompts N``
   gives shared-prompts N system prompts instead of the preset's 20 (with 20, a system prompt's
   next request is admitted ten steps after its first: long after that one committed).

    OPENBLAS_NUM_THREADS=1 python benchmarks/engine_overlap.py --reps 2 --device-ms 0,5
    python benchmarks/engine_overlap.py --holds [--system-prompts 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import numpy as np
import torch
from prefixcache.engine import Engine, ForwardFn, RunResult, build_model, engine_config_for, worker
from prefixcache.engine.policy import Policy
from prefixcache.engine.workloads import PresetWorkload, workload_preset
from prefixcache.kernels import Step
from prefixcache.models import HybridModel, ModelCaches


def one_run(
    model: HybridModel,
    workload: PresetWorkload,
    policy: str,
    *,
    overlap: bool,
    hold: bool = True,
    device_ms: float = 0.0,
) -> RunResult:
    geometry = workload.geometry.aligned(model.backend.checkpoint_alignment)
    config = engine_config_for(workload, geometry, model.backend, overlap=overlap)
    config = dataclasses.replace(config, hold_pending=hold)
    forward: ForwardFn | None = None
    if device_ms > 0:

        def forward(
            step: Step, token_ids: torch.Tensor, caches: ModelCaches, indices: np.ndarray
        ) -> torch.Tensor:
            logits = model.execute(step, token_ids, caches, indices)
            time.sleep(device_ms / 1e3)
            return logits

    engine = Engine(
        model,
        Policy.named(policy, block_size=geometry.block_size, fine_unit=geometry.unit),
        config,
        forward=forward,
    )
    return engine.run(workload.build(model.config.vocab_size))


def timing(
    model: HybridModel, workloads: list[str], policy: str, reps: int, device_ms: list[float]
) -> None:
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the start")
    rows: dict[tuple[str, float, bool], list[RunResult]] = {}
    for _ in range(reps):
        for name in workloads:
            workload = workload_preset(name, "default", vocab_size=model.config.vocab_size)
            for sleep in device_ms:
                for overlap in (False, True):
                    result = one_run(model, workload, policy, overlap=overlap, device_ms=sleep)
                    rows.setdefault((name, sleep, overlap), []).append(result)
                    print(
                        f"  {name:15} +{sleep:g} ms {'overlapped' if overlap else 'one step  '}"
                        f": {result.steps} steps, {result.seconds:.2f} s",
                        flush=True,
                    )
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} at the end\n")

    def per_step(runs: list[RunResult], value: str) -> str:
        figures = [
            1e3
            * (r.seconds - r.forward_seconds if value == "idle" else getattr(r, value))
            / max(r.steps, 1)
            for r in runs
        ]
        return f"{statistics.median(figures):.2f}"

    print(
        f"| workload ({policy}) | device stand-in | mode | steps | wall ms/step | "
        "forward ms/step | forward idle ms/step | host ms/step | host hidden ms/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (name, sleep, overlap), runs in sorted(rows.items()):
        print(
            f"| {name} | {f'+{sleep:g} ms' if sleep else '-'} | "
            f"{'overlapped' if overlap else 'one step'} | "
            f"{statistics.median(r.steps for r in runs):.0f} | {per_step(runs, 'seconds')} | "
            f"{per_step(runs, 'forward_seconds')} | {per_step(runs, 'idle')} | "
            f"{per_step(runs, 'host_seconds')} | "
            f"{per_step(runs, 'hidden_host_seconds')} |"
        )


def holds(model: HybridModel, policies: list[str], system_prompts: int | None) -> None:
    print(
        "| workload | policy | mode | prefill tokens computed | hit tokens | holds "
        "(requests) | steps |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in ("shared-prompts", "agentic"):
        workload = workload_preset(name, "default", vocab_size=model.config.vocab_size)
        if name == "shared-prompts" and system_prompts is not None:
            spec = dataclasses.replace(workload.spec, system_prompts=system_prompts)
            workload = dataclasses.replace(workload, spec=spec)
            name = f"shared-prompts ({system_prompts} system prompts)"
        for policy in policies:
            for overlap, hold, label in (
                (False, True, "one step"),
                (True, False, "overlapped, no hold"),
                (True, True, "overlapped, hold"),
            ):
                r = one_run(model, workload, policy, overlap=overlap, hold=hold)
                print(
                    f"| {name} | {policy} | {label} | {r.computed_prefill_tokens:,} | "
                    f"{r.hit_tokens:,} | {r.holds} ({r.held_requests}) | {r.steps} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holds", action="store_true", help="the hold table instead")
    parser.add_argument("--workloads", default="growing-prefix,shared-prompts")
    parser.add_argument("--policy", default="fine", help="the timing runs' policy")
    parser.add_argument("--policies", default="block,fine", help="the hold runs' policies")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--device-ms", default="0", help="comma-separated device stand-ins, ms a step"
    )
    parser.add_argument("--system-prompts", type=int, help="shared-prompts' system prompts")
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="Python's thread switch interval (s) while overlapped (default: the worker's "
        "SWITCH_INTERVAL, which leaves it alone; 0 leaves it alone too)",
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        worker.SWITCH_INTERVAL = args.switch_interval or None
    print(f"switch interval while overlapped: {worker.SWITCH_INTERVAL}")
    torch.set_num_threads(1)
    model = build_model("cpu", "torch")
    if args.holds:
        holds(model, args.policies.split(","), args.system_prompts)
    else:
        device_ms = [float(x) for x in args.device_ms.split(",")]
        timing(model, args.workloads.split(","), args.policy, args.reps, device_ms)


if __name__ == "__main__":
    main()
