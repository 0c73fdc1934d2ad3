"""What a scheduler pays to drive the Rust core through the Python bindings.

Two scenarios, mirroring the core's criterion benches (``rust/core/benches/manager.rs``) so the
difference is the cost of crossing into Rust (argument conversion, result objects, NumPy
arrays, and releasing the GIL for long calls):

- ``decode``: 256 sequences sharing a 164K-token context, all decoding: one step is
  ``append_batch`` + ``schedule_batch`` + ``build_plan`` + ``commit`` (NumPy id and token arrays),
  with a full-attention group (B = 16) alone and with a state group added;
- ``hybrid decode``: the geometry of the hybrid comparison with vLLM (``benchmarks/vs_vllm.py``):
  B = 1536, U = 128, a state group (A = 64), 8 sequences of 20K tokens decoding; the whole step
  (with a new ``StepPlan``, and with the plan written into persistent ``PlanBuffers``), each of
  its four calls timed alone, reading every plan array once (plan arrays are made on first
  read), and ``num_computed`` (one id in, one int out, under the manager's lock: the floor of
  any call);
- ``next turn``: ``add(.., extends=previous)`` of a 144K-token turn extending a finished
  142K-token one, from a ``uint32`` array (compared in place) and an ``int64`` one (converted);
- ``admission``: one 164K-token prompt, ``add`` + ``lookup`` + ``schedule`` + ``build_plan`` +
  ``commit`` + ``finish``, cold (nothing cached: the whole prompt is scheduled) and warm (an
  identical resend), with the tokens given as a NumPy array and as a list.

Reports medians (and minima, which machine load disturbs least), with the garbage collector off
while timing (as ``timeit`` does), next to the same cases timed the same way in pure Rust by
``rust/core/examples/baseline.rs`` when its binary is built (``cargo build --release -p
prefixcache-core --example baseline``): the difference is the crossing cost.

Run: ``python benchmarks/bindings.py`` (release build of the extension: ``make install``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import prefixcache as pc

CONTEXT = 164_000
ROWS = 256
BASELINE = Path(__file__).resolve().parents[1] / "target" / "release" / "examples" / "baseline"


def tokens(seed: int, n: int) -> np.ndarray:
    """The core bench's token stream: ``(i * 2654435761 ^ seed) % 150000``."""
    i = np.arange(n, dtype=np.uint64)
    return (((i * 2_654_435_761) & 0xFFFFFFFF) ^ seed) % 150_000


def config(
    block: int, unit: int, state: bool, blocks: int, state_blocks: int, depth: int = 1
) -> pc.CacheConfig:
    groups: list[pc.Group] = [pc.FullAttention(block_size=block, pool=0)]
    pools = [pc.PoolConfig(blocks)]
    if state:
        groups.append(pc.StateGroup(alignment=16, pool=1))
        pools.append(pc.PoolConfig(state_blocks))
    return pc.CacheConfig(
        pools=pools,
        groups=groups,
        hash=pc.HashConfig(unit=unit),
        enable_events=False,
        max_steps_in_flight=depth,
    )


def prefill(mgr: pc.CacheManager, seq_id: int, prompt: np.ndarray) -> None:
    mgr.add(seq_id, prompt)
    assert mgr.schedule(seq_id, 2**32 - 1) is not None
    mgr.commit(mgr.build_plan())
    mgr.finish(seq_id)


def decode_setup(state: bool, depth: int = 1) -> tuple[pc.CacheManager, np.ndarray]:
    blocks = CONTEXT // 16 + ROWS * (2048 // 16 + 4)
    mgr = pc.CacheManager(config(16, 16, state, blocks, ROWS * 8, depth))
    prompt = tokens(3, CONTEXT).astype(np.uint32)
    prefill(mgr, 0, prompt)
    ids = np.arange(1, ROWS + 1, dtype=np.int64)
    for seq in ids.tolist():
        prompt[-1] = seq
        mgr.add(seq, prompt, extends=0)
        assert mgr.schedule(seq, 2**32 - 1) is not None
    mgr.commit(mgr.build_plan())
    return mgr, ids


def bench_decode(state: bool, steps: int) -> list[float]:
    mgr, ids = decode_setup(state)
    times = []
    for step in range(steps):
        sampled = ((ids + step) % 150_000).astype(np.uint32)
        start = time.perf_counter_ns()
        mgr.append_batch(ids, sampled)
        scheduled = mgr.schedule_batch(ids, 1)
        plan = mgr.build_plan()
        mgr.commit(plan)
        times.append((time.perf_counter_ns() - start) / 1e3)
        assert all(s is not None and s.num_tokens == 1 for s in scheduled)
    mgr.check_invariants()
    return times[steps // 10 :]  # drop the warm-up


def bench_decode_fast(state: bool, depth: int, steps: int) -> list[float]:
    """The decode step of 256 sequences as one call: ``decode_step`` with one plan in flight
    (D = 1), or ``decode_step_overlapped`` with two (D = 2: commit of the oldest, resolve of
    the tokens it sampled, one placeholder each, schedule, plan) over a ring of two
    ``PlanBuffers``."""
    mgr, ids = decode_setup(state, depth)
    ring = [pc.PlanBuffers(rows=ROWS), pc.PlanBuffers(rows=ROWS)]
    times = []
    for step in range(steps):
        sampled = ((ids + step) % 150_000).astype(np.uint32)
        if depth == 1:
            start = time.perf_counter_ns()
            scheduled = mgr.decode_step(ring[0], ids, sampled)
        else:
            flight = mgr.plans_in_flight
            full = len(flight) == 2
            start = time.perf_counter_ns()
            scheduled = mgr.decode_step_overlapped(
                ring[step % 2],
                ids,
                resolve_ids=ids if full else None,
                tokens=sampled if full else None,
                commit=flight[0] if full else None,
            )
        times.append((time.perf_counter_ns() - start) / 1e3)
        assert bool((scheduled == 1).all())
    mgr.check_invariants()
    return times[steps // 10 :]


HYBRID_ROWS = 8
HYBRID_CALLS = (
    "step",
    "step_into_buffers",
    "decode_step",
    "append_batch",
    "schedule_tokens",
    "schedule_batch",
    "build_plan",
    "read_plan",
    "commit",
    "num_computed",
)


def bench_hybrid_decode(call: str, steps: int) -> list[float]:
    """One decode step of 8 sequences at B = 1536 / U = 128 with a state group; ``call``
    names what is timed ("step": all four calls; "read_plan": reading all 13 plan arrays once,
    which the step does not include). Decodes are scheduled with ``schedule_tokens``, except
    for the "schedule_batch" row, which times the call that returns ``Scheduled`` objects;
    "step_into_buffers" is the step with the plan written into persistent ``PlanBuffers``
    (``build_plan_into``) instead of a new ``StepPlan``; "decode_step" is the whole step as
    one call (commit of the previous step included)."""
    pools = [pc.PoolConfig(HYBRID_ROWS * 16 + 64), pc.PoolConfig(16 * HYBRID_ROWS + 1024)]
    groups: list[pc.Group] = [
        pc.FullAttention(block_size=1536, pool=0),
        pc.StateGroup(alignment=64, max_checkpoints_per_step=None, pool=1),
    ]
    hash_config = pc.HashConfig(unit=128)
    mgr = pc.CacheManager(
        pc.CacheConfig(pools=pools, groups=groups, hash=hash_config, enable_events=False)
    )
    ids = np.arange(HYBRID_ROWS, dtype=np.int64)
    buffers = pc.PlanBuffers(rows=HYBRID_ROWS)
    for seq in ids.tolist():
        mgr.add(seq, tokens(seq, 20_000).astype(np.uint32))
        while mgr.num_computed(seq) < 20_000:
            assert mgr.schedule(seq, 8192) is not None
            mgr.commit(mgr.build_plan())
    times = []
    for step in range(steps):
        sampled = ((ids + step) % 150_000).astype(np.uint32)
        if call == "decode_step":  # the whole step, commit of the previous one included
            t0 = time.perf_counter_ns()
            scheduled = mgr.decode_step(buffers, ids, sampled).tolist()
            times.append((time.perf_counter_ns() - t0) / 1e3)
            assert scheduled == [1] * HYBRID_ROWS
            continue
        t0 = time.perf_counter_ns()
        mgr.append_batch(ids, sampled)
        t1 = time.perf_counter_ns()
        if call == "schedule_batch":
            scheduled = [s.num_tokens if s else -1 for s in mgr.schedule_batch(ids, 1)]
        else:
            scheduled = mgr.schedule_tokens(ids, 1).tolist()
        t2 = time.perf_counter_ns()
        if call == "step_into_buffers":
            mgr.build_plan_into(buffers)
            t3 = t3r = time.perf_counter_ns()
            mgr.commit(buffers)
        else:
            plan = mgr.build_plan()
            t3 = time.perf_counter_ns()
            read_plan(plan)
            t3r = time.perf_counter_ns()
            mgr.commit(plan)
        t4 = time.perf_counter_ns()
        mgr.num_computed(0)
        t5 = time.perf_counter_ns()
        spans = {
            "step": t4 - t0 - (t3r - t3),
            "step_into_buffers": t4 - t0,
            "append_batch": t1 - t0,
            "schedule_tokens": t2 - t1,
            "schedule_batch": t2 - t1,
            "build_plan": t3 - t2,
            "read_plan": t3r - t3,
            "commit": t4 - t3r,
            "num_computed": t5 - t4,
        }
        times.append(spans[call] / 1e3)
        assert scheduled == [1] * HYBRID_ROWS
    if mgr.plan_in_flight is not None:
        mgr.commit(buffers)
    mgr.check_invariants()
    return times[steps // 10 :]


def read_plan(plan: pc.StepPlan) -> None:
    """Every array of a plan, as an engine building its forward's inputs reads them."""
    rows, tokens = plan.num_rows, plan.num_tokens
    for array in (plan.seq_ids, plan.num_computed, plan.num_scheduled):
        assert array.shape == (rows,)
    assert plan.query_start_loc.shape == (rows + 1,) and int(plan.query_start_loc[-1]) == tokens
    assert plan.copies.shape[1] == 4
    for paged in plan.paged:
        assert paged.appended.ndim == paged.replaced.ndim == 2
        assert paged.slot_mapping.shape == (tokens,)
    for state in plan.state:
        assert state.running_slot.shape == state.initial_slot.shape == (rows,)
        assert state.checkpoint_offsets.shape == state.checkpoint_slots.shape
        assert state.checkpoint_offsets.shape[0] == rows and state.snapshots.ndim == 2


TURN = 142_000


def bench_next_turn(kind: str, reps: int) -> list[float]:
    """``add(.., extends=previous)`` of a 144K-token turn extending a finished 142K-token one
    (B = 16), the prompt given as ``kind``: "uint32" (compared in place) or "int64" (converted
    into a vector first, as every input was before commit 0863b69)."""
    mgr = pc.CacheManager(config(16, 16, False, TURN // 16 + 256, 0))
    prompt = tokens(5, TURN + 2_000).astype(np.uint32)
    mgr.add(0, prompt[:TURN])
    mgr.finish(0)
    times = []
    for rep in range(1, reps + 1):
        turn = prompt if kind == "uint32" else prompt.astype(np.int64)
        start = time.perf_counter_ns()
        added = mgr.add(rep, turn, extends=rep - 1)
        times.append((time.perf_counter_ns() - start) / 1e3)
        assert added.extends_found and added.reused_tokens >= TURN - 16
        mgr.finish(rep)
    return times


def admission(mgr: pc.CacheManager, seq_id: int, prompt: object) -> pc.Scheduled:
    mgr.add(seq_id, prompt)  # type: ignore[arg-type]
    mgr.lookup(seq_id)
    scheduled = mgr.schedule(seq_id, 2**32 - 1)
    assert scheduled is not None
    mgr.commit(mgr.build_plan())
    mgr.finish(seq_id)
    return scheduled


def bench_admission(warm: bool, as_list: bool, reps: int) -> list[float]:
    # One long-lived manager, as in an engine: `reset` (untimed) empties the cache between
    # repetitions, so every cold admission misses and every warm one hits a fresh prefill.
    mgr = pc.CacheManager(config(16, 16, False, CONTEXT // 16 + 64, 0))
    times = []
    for rep in range(reps):
        mgr.reset()
        prompt_array = tokens(11 + rep, CONTEXT).astype(np.uint32)
        prompt: object = prompt_array.tolist() if as_list else prompt_array
        if warm:
            prefill(mgr, 2 * rep, prompt_array)
        start = time.perf_counter_ns()
        scheduled = admission(mgr, 2 * rep + 1, prompt)
        times.append((time.perf_counter_ns() - start) / 1e3)
        expected = (CONTEXT - 1) // 16 * 16 if warm else 0
        assert scheduled.num_computed == expected
    return times


def rust_baseline() -> dict[str, float]:
    """Medians of the pure-Rust baseline by case name, if its binary is built."""
    if not BASELINE.exists():
        return {}
    out = subprocess.run([BASELINE], check=True, capture_output=True, text=True).stdout
    medians = {}
    for line in out.splitlines()[1:]:
        name, median, _best = line.rsplit(maxsplit=2)
        medians[name.strip()] = float(median)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="decode steps per setup")
    parser.add_argument("--reps", type=int, default=31, help="admissions per case")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()

    decode = "decode step, 256 x 164K, B=16"
    cold, warm = "admit 164K cold", "admit 164K warm resend"
    # (case, run, the pure-Rust case it is compared with)
    cases: list[tuple[str, Callable[[], list[float]], str]] = [
        (decode, lambda: bench_decode(False, args.steps), decode),
        (f"{decode} + state", lambda: bench_decode(True, args.steps), f"{decode} + state"),
        *[
            (f"{decode}{plus}: {call}", partial(bench_decode_fast, state, depth, args.steps), "")
            for state, plus in ((False, ""), (True, " + state"))
            for depth, call in ((1, "decode_step"), (2, "decode_step_overlapped D=2"))
        ],
        *[
            (
                f"hybrid decode 8 x 20K: {call}",
                partial(bench_hybrid_decode, call, args.steps),
                "hybrid decode 8 x 20K: decode_step" if call == "decode_step" else "",
            )
            for call in HYBRID_CALLS
        ],
        *[
            (f"next turn 144K, extends, {kind}", partial(bench_next_turn, kind, 4 * args.reps), "")
            for kind in ("uint32", "int64")
        ],
        (f"{cold}, numpy tokens", lambda: bench_admission(False, False, args.reps), cold),
        (f"{cold}, list tokens", lambda: bench_admission(False, True, args.reps), cold),
        (f"{warm}, numpy tokens", lambda: bench_admission(True, False, args.reps), warm),
        (f"{warm}, list tokens", lambda: bench_admission(True, True, args.reps), warm),
    ]
    rust = rust_baseline()
    print(
        f"prefixcache {pc.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()}, load average {os.getloadavg()[0]:.1f}; microseconds"
        + ("" if rust else f"; no pure-Rust baseline (build {BASELINE.name}, see the docstring)")
    )
    print(f"{'case':<40} {'median':>9} {'min':>9} {'rust':>9} {'overhead':>9}")
    results = {}
    for name, run, rust_name in cases:
        gc.disable()
        try:
            times = run()
        finally:
            gc.enable()
        median, best = statistics.median(times), min(times)
        baseline = rust.get(rust_name)
        results[name] = {"median_us": median, "min_us": best, "rust_median_us": baseline}
        extra = f"{baseline:9.1f} {median - baseline:9.1f}" if baseline is not None else f"{'-':>9}"
        print(f"{name:<40} {median:9.1f} {best:9.1f} {extra}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
