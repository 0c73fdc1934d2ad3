#!/usr/bin/env python3
"""The reference engine's host time between a request's arrival and its forward, without a model.

Runs ``prefixcache simulate`` (one policy, one step at a time) with the model's ``execute``
replaced by a stub that returns fixed logits at once, so that a whole seed preset takes seconds
on a CPU and what is timed is the engine alone. On a GPU these parts run while the GPU waits,
in every request's time to first token:

- ``add``: the admission of a request whose prompt has at least ``--min-prompt`` tokens
  (``CacheManager.add``, which hashes only the tail a follow-up adds to the prompt it extends),
  per request;
- ``schedule`` (the engine's loop over its sequences and the manager's calls), per step that
  schedules that way (every step with a prefill row; decode-only steps take ``decode_step``);
- ``apply_plan`` (the block tables), ``from_plan`` (the kernels' step) and ``inputs`` (the
  step's token ids on the device), per step of any kind.

With ``--prep``, only the model's layers are stubbed (``forward_layers``) and ``execute`` is
timed as well: a prefill step's preparation before its layers (the plan's and the slots'
checks, the copy-on-write copies, the decode rows' tables, the uploads; the snapshots after),
on the CPU model of the seed geometry (tiny widths, so the copies move little), and the prefill
steps that carry a copy-on-write copy are counted.

Medians, in microseconds. The stub changes when requests arrive (every step is instant), not
what each part does.

    python3 benchmarks/engine_host_path.py --preset seed --policy fine [--prep]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

STEP_PARTS = ("schedule", "apply_plan", "from_plan", "inputs")


class _TimedAdds:
    """A ``CacheManager`` whose ``add`` is timed (every other attribute is the manager's)."""

    def __init__(self, manager: Any, min_prompt: int, times: list[float]) -> None:
        self._manager, self._min_prompt, self._times = manager, min_prompt, times

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def add(self, seq_id: int, tokens: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        added = self._manager.add(seq_id, tokens, *args, **kwargs)
        if len(tokens) >= self._min_prompt:
            self._times.append(1e6 * (time.perf_counter() - start))
        return added


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="seed", choices=("default", "seed"))
    parser.add_argument("--policy", default="fine")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=100_000)
    parser.add_argument(
        "--prep",
        action="store_true",
        help="stub the layers only, and time execute's preparation of each prefill step",
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    engine = importlib.import_module("prefixcache.engine.engine")
    hybrid = importlib.import_module("prefixcache.models.hybrid")
    tables = importlib.import_module("prefixcache.kernels.block_tables")
    step_module = importlib.import_module("prefixcache.kernels.step")
    from prefixcache.engine.cli import main as cli

    def fixed_logits(model: Any, rows: int) -> torch.Tensor:
        logits = torch.zeros(rows, model.config.vocab_size)
        logits[:, 7] = 1.0  # every sampled token is 7: the workload does not depend on it
        return logits

    def stub_execute(
        model: Any, step: Any, token_ids: Any, caches: Any, logits_indices: Any = None
    ) -> torch.Tensor:
        if logits_indices is None:
            logits_indices = np.asarray(step.query_start_loc[1:], dtype=np.int64) - 1
        return fixed_logits(model, len(logits_indices))

    def stub_layers(model: Any, token_ids: Any, caches: Any, **kwargs: Any) -> torch.Tensor:
        return fixed_logits(model, len(kwargs["logits_index"]))

    parts = ("add", *STEP_PARTS, *(("prefill_execute",) if args.prep else ()))
    times: dict[str, list[float]] = {part: [] for part in parts}
    copy_rows: list[int] = []  # with --prep: each prefill step's copy-on-write rows

    def timed_execute(
        model: Any, step: Any, token_ids: Any, caches: Any, logits_indices: Any = None
    ) -> torch.Tensor:
        start = time.perf_counter()
        logits = saved["execute"](model, step, token_ids, caches, logits_indices)
        if step.prefill_tokens is not None:
            times["prefill_execute"].append(1e6 * (time.perf_counter() - start))
            copy_rows.append(len(step.copies))
        return logits

    def timed(function: Callable[..., Any], part: str) -> Callable[..., Any]:
        def wrapper(*call_args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            result = function(*call_args, **kwargs)
            times[part].append(1e6 * (time.perf_counter() - start))
            return result

        return wrapper

    loop = engine._Loop
    saved = {
        "execute": hybrid.HybridModel.execute,
        "forward_layers": hybrid.HybridModel.forward_layers,
        "init": loop.__init__,
        "schedule": loop.schedule,
        "inputs": loop.inputs,
        "apply_plan": tables.BlockTables.apply_plan,
        "from_plan": step_module.Step.__dict__["from_plan"],
    }

    def init(self: Any, *init_args: Any, **kwargs: Any) -> None:
        saved["init"](self, *init_args, **kwargs)
        self.manager = _TimedAdds(self.manager, args.min_prompt, times["add"])

    if args.prep:
        hybrid.HybridModel.forward_layers = stub_layers
        hybrid.HybridModel.execute = timed_execute
    else:
        hybrid.HybridModel.execute = stub_execute
    loop.__init__ = init
    loop.schedule = timed(loop.schedule, "schedule")
    loop.inputs = timed(loop.inputs, "inputs")
    tables.BlockTables.apply_plan = timed(tables.BlockTables.apply_plan, "apply_plan")
    step_module.Step.from_plan = classmethod(timed(saved["from_plan"].__func__, "from_plan"))
    try:
        cli(
            [
                "simulate", "--preset", args.preset, "--policies", args.policy,
                "--no-reference", "--no-overlap", "--output-len", str(args.output_len),
            ]
        )  # fmt: skip
    finally:
        hybrid.HybridModel.execute = saved["execute"]
        hybrid.HybridModel.forward_layers = saved["forward_layers"]
        loop.__init__ = saved["init"]
        loop.schedule = saved["schedule"]
        loop.inputs = saved["inputs"]
        tables.BlockTables.apply_plan = saved["apply_plan"]
        step_module.Step.from_plan = saved["from_plan"]
    results: dict[str, Any] = {"preset": args.preset, "policy": args.policy}
    print(f"{args.preset} preset, {args.policy}: median us (count)")
    for part, values in times.items():
        results[part] = {
            "count": len(values),
            "median_us": statistics.median(values) if values else None,
        }
        median = "-" if not values else f"{statistics.median(values):8.1f}"
        print(f"  {part:<12} {median} ({len(values)})")
    if args.prep:
        with_copies = sum(rows > 0 for rows in copy_rows)
        results["prefill_steps_with_copies"] = with_copies
        print(f"  prefill steps with a copy-on-write copy: {with_copies} of {len(copy_rows)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
