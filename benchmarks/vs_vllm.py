"""Manager + hashing time of prefixcache against vLLM 0.33.0's ``KVCacheManager``, side by side.

What is compared: one scheduler-like loop (``simulate`` below) drives either manager through
the same token streams (``vs_vllm_workloads.py``): admission, chunked prefill steps (8,192
tokens per step), decode steps, sampled-token appends and finishing. For vLLM that is request
block hashing + ``get_computed_blocks`` + ``allocate_slots`` (+ the per-step calls its
scheduler makes, and ``free``); for prefixcache ``add`` + ``lookup`` + ``schedule`` /
``schedule_tokens`` + ``build_plan_into`` + reading the block arrays of the plan + ``commit``
+ ``append_batch`` + ``finish`` (``vs_vllm_backends.py`` lists every call). Only manager calls
are timed (``time.perf_counter`` around each), never the loop's own bookkeeping.

Workloads and configurations (``vs_vllm_workloads.py``; ``docs/BENCHMARKS.md``):

- growing-prefix: full attention, block 16, sha256; the same with xxh3-128; hybrid attention +
  recurrent state (vLLM: Mamba in align mode with partial hits; prefixcache: a state group),
  block 1536, hash unit 128, xxh3-128. prefixcache runs twice per pair: without and with hash
  reuse (``add(..., extends=previous round)``); the target is judged with reuse.
- shared-prompts: full attention, block 16, sha256 (target judged without reuse; the reuse run,
  ``extends=`` the latest request with the same system prompt, is reported beside it, and so is
  prefixcache as configured by default, ``+live``: no ``extends``, but ``reuse_live_prefixes``
  takes the system prompt's hashes from a running request that shares it).

In the runs without reuse, ``reuse_live_prefixes`` is off: every prompt is hashed in full.

Every pair runs vLLM, then prefixcache (then prefixcache with reuse), in one process; the ratio
vLLM / prefixcache is reported as min / median / max over the pairs. Hit tokens per request
are compared; a difference is "explained" when each manager's hit is exactly what its own
publication rule gives (vLLM keys blocks when it allocates them, so a request admitted in the
same step as the request computing its prefix hits it; prefixcache publishes at ``commit``).
Each pair also times prefixcache's ``add`` of every prompt alone, without reuse (the hashing
floor, ``hashing_floor``): vLLM's time over it is the highest ratio prefixcache could reach
without hash reuse, reported as the configuration's ceiling; the same with every prompt in
one ``add_batch`` (``hashing_floor_parallel``, hashed across the machine's cores) gives the
parallel ceiling. The loop takes each step's arrivals in with one ``Backend.add_batch`` (vLLM:
each request's block hashing; prefixcache: ``add_batch``) before it admits anything.

Run (vLLM lives in its own virtual environment, never a project dependency)::

    make bench-vllm                       # creates .venv-vllm if missing, then runs this
    .venv-vllm/bin/python benchmarks/vs_vllm.py --scale 1.0 --pairs 3

``--scale`` shrinks the workloads (see ``vs_vllm_workloads.py``); ``--profile`` adds a
cProfile of one prefixcache run per configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vs_vllm_backends import Backend, ManagerConfig, PrefixcacheBackend, make_backend
from vs_vllm_workloads import WORKLOAD_NAMES, Request, Workload, make_workload

ROOT = Path(__file__).resolve().parent.parent
TARGET_RATIO = 50.0

CONFIGS: dict[str, list[ManagerConfig]] = {
    "growing-prefix": [
        ManagerConfig("attention-b16-sha256", "attention", 16, 16, "sha256"),
        ManagerConfig("attention-b16-xxh3", "attention", 16, 16, "xxh3_128"),
        ManagerConfig("hybrid-b1536-u128-xxh3", "hybrid", 1536, 128, "xxh3_128"),
    ],
    "shared-prompts": [
        ManagerConfig("attention-b16-sha256", "attention", 16, 16, "sha256"),
    ],
}
# Why a peer's hit differs from prefixcache's for one request (None: unexplained).
HitRule = Callable[[Request, ManagerConfig, "RunResult", "RunResult"], "str | None"]
REUSE_JUDGED = {"growing-prefix": True, "shared-prompts": False}
# Workloads whose requests share prefixes with requests still running: there prefixcache also
# runs as configured by default (``reuse_live_prefixes``, no ``extends``), reported beside.
LIVE_REUSE = {"growing-prefix": False, "shared-prompts": True}


@dataclass
class RunResult:
    """One run of one manager over one workload."""

    seconds: float
    by_call: dict[str, float]
    calls: dict[str, int]
    steps: int
    hits: dict[int, int]
    # Per request: (tokens of its shared prefix computed by committed steps, the same
    # including chunks scheduled earlier in the step that admitted it).
    cover_at_admission: dict[int, tuple[int, int]] = field(default_factory=dict)


def simulate(workload: Workload, backend: Backend) -> RunResult:
    """The scheduler loop: running requests first (decodes, then prefill chunks), then
    admissions, one token budget per step; every request samples its next output token when
    all its known tokens are computed and finishes after its last one."""
    shape = workload.shape
    waiting: deque[Request] = deque(workload.initial())
    # Requests that arrived since the last step: each step takes them in with one
    # `add_batch` before it admits anything, as vLLM's engine takes a step's new requests.
    arrived: list[Request] = list(waiting)
    running: list[Request] = []
    computed: dict[int, int] = {}
    produced: dict[int, int] = {}
    hits: dict[int, int] = {}
    cover_now: dict[int, int] = {}
    cover_committed: dict[int, int] = {}
    cover_at_admission: dict[int, tuple[int, int]] = {}
    steps = 0

    def covered(request: Request, end: int) -> None:
        key = request.prefix_key
        cover_now[key] = max(cover_now.get(key, 0), min(end, len(request.prompt)))

    while waiting or running:
        steps += 1
        backend.start_step()
        if arrived:
            backend.add_batch(arrived)
            arrived = []
        budget = shape.token_budget
        scheduled: list[tuple[Request, int]] = []
        decoding = [r for r in running if produced[r.request_id] > 0]
        if decoding:
            backend.schedule_decodes(decoding)
            budget -= len(decoding)
            scheduled.extend((r, 1) for r in decoding)
        for request in running:
            if produced[request.request_id] > 0:
                continue
            if budget <= 0:
                break
            tokens = backend.schedule_prefill(request, budget)
            if tokens:
                scheduled.append((request, tokens))
                budget -= tokens
                covered(request, computed[request.request_id] + tokens)
        while waiting and budget > 0 and len(running) < shape.max_running:
            request = waiting[0]
            key = request.prefix_key
            view = (cover_committed.get(key, 0), cover_now.get(key, 0))
            admitted = backend.admit(request, budget)
            if admitted is None or admitted[1] == 0:
                break
            hit, tokens = admitted
            rid = request.request_id
            waiting.popleft()
            running.append(request)
            hits[rid] = hit
            cover_at_admission[rid] = view
            computed[rid] = hit
            produced[rid] = 0
            scheduled.append((request, tokens))
            budget -= tokens
            covered(request, hit + tokens)
        if not scheduled:
            raise RuntimeError(f"{backend.label}: step {steps} scheduled nothing")
        backend.end_step(scheduled)
        cover_committed = dict(cover_now)
        sampled: list[Request] = []
        for request, tokens in scheduled:
            rid = request.request_id
            computed[rid] += tokens
            if computed[rid] >= len(request.prompt) + produced[rid]:
                sampled.append(request)
        if sampled:
            backend.append(sampled, [int(r.output[produced[r.request_id]]) for r in sampled])
        for request in sampled:
            rid = request.request_id
            produced[rid] += 1
            if produced[rid] == len(request.output):
                backend.finish(request)
                running.remove(request)
                follow_ups = workload.on_finished(request)
                waiting.extend(follow_ups)
                arrived.extend(follow_ups)
    return RunResult(
        seconds=backend.total_seconds(),
        by_call=dict(backend.seconds),
        calls=dict(backend.calls),
        steps=steps,
        hits=hits,
        cover_at_admission=cover_at_admission,
    )


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Garbage of earlier runs is collected and what is alive is frozen for the block (as
    vLLM's engine freezes its heap after start-up), so no timed run pays for scanning the
    objects of another."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_once(side: str, config: ManagerConfig, workload: Workload) -> RunResult:
    """One timed run on a fresh manager, on a frozen heap."""
    backend = make_backend(side, config, workload)
    with frozen_heap():
        return simulate(workload, backend)


def hashing_floor(config: ManagerConfig, workload: Workload) -> float:
    """Seconds prefixcache's ``add`` takes for every prompt of the workload, alone: each
    prompt hashed once (no hash reuse) and taken in, on a fresh manager of the run's
    configuration, timed like the runs. prefixcache cannot run the workload in less, so
    vLLM's run time over this is the highest ratio it could reach without hash reuse
    (sampled tokens, also hashed in the runs, are left out: the floor is a lower bound).
    With SHA-256 the floor is nearly all hashing."""
    manager = PrefixcacheBackend(config, workload).manager
    seconds = 0.0
    with frozen_heap():
        for request in _all_requests(workload):
            t0 = time.perf_counter()
            manager.add(request.request_id, request.prompt)
            seconds += time.perf_counter() - t0
            manager.finish(request.request_id)
    return seconds


def hashing_floor_parallel(config: ManagerConfig, workload: Workload) -> float:
    """``hashing_floor`` with every prompt of the workload in one ``add_batch`` (the prompts
    hashed across the machine's cores): the same lower bound when every request is hashed
    in parallel with the others."""
    manager = PrefixcacheBackend(config, workload).manager
    requests = _all_requests(workload)
    ids = [r.request_id for r in requests]
    prompts = [r.prompt for r in requests]
    with frozen_heap():
        t0 = time.perf_counter()
        manager.add_batch(ids, prompts)
        return time.perf_counter() - t0


def floor_to(value: int, multiple: int) -> int:
    return value // multiple * multiple


def vllm_hit_rule(
    request: Request, config: ManagerConfig, peer: RunResult, ours: RunResult
) -> str | None:
    """Why vLLM's hit differs from prefixcache's, or ``None`` when neither publication rule
    gives what was measured: vLLM keys blocks when it allocates them (same step included),
    prefixcache publishes at ``commit``."""
    if config.kind != "attention":
        return None
    rid = request.request_id
    limit = min(request.prefix_len, len(request.prompt) - 1)
    vllm_expected = floor_to(min(limit, peer.cover_at_admission[rid][1]), config.unit)
    our_expected = floor_to(min(limit, ours.cover_at_admission[rid][0]), config.unit)
    if peer.hits[rid] == vllm_expected and ours.hits[rid] == our_expected:
        return "same_step"
    return None


def compare_hits(
    workload: Workload,
    config: ManagerConfig,
    peer_run: RunResult,
    ours: RunResult,
    rule: HitRule = vllm_hit_rule,
    peer: str = "vllm",
) -> dict[str, Any]:
    """Per-request hit tokens of both managers, with every difference classified by
    ``rule`` (a reason, or ``None``: unexplained)."""
    requests = {r.request_id: r for r in _all_requests(workload)}
    differing: list[int] = []
    reasons: dict[str, int] = {}
    for rid, peer_hit in peer_run.hits.items():
        if ours.hits[rid] == peer_hit:
            continue
        differing.append(rid)
        reason = rule(requests[rid], config, peer_run, ours) or "unexplained"
        reasons[reason] = reasons.get(reason, 0) + 1
    result: dict[str, Any] = {
        "requests": len(peer_run.hits),
        f"{peer}_hit_tokens": sum(peer_run.hits.values()),
        "prefixcache_hit_tokens": sum(ours.hits.values()),
        "differing_requests": len(differing),
        "first_differing": differing[:5],
    }
    if peer == "vllm":
        result["explained_same_step"] = reasons.get("same_step", 0)
    else:
        result["differences"] = reasons
    return result


def _all_requests(workload: Workload) -> list[Request]:
    pending = deque(workload.initial())
    result = []
    while pending:
        request = pending.popleft()
        result.append(request)
        pending.extend(workload.on_finished(request))
    return result


def _median_calls(runs: list[RunResult]) -> dict[str, dict[str, float]]:
    names = sorted({name for run in runs for name in run.by_call})
    return {
        name: {
            "seconds": statistics.median(run.by_call.get(name, 0.0) for run in runs),
            "calls": runs[0].calls.get(name, 0),
        }
        for name in names
    }


def _ratios(peer: list[RunResult], ours: list[RunResult]) -> list[float]:
    return [v.seconds / o.seconds for v, o in zip(peer, ours, strict=True)]


def _entry(
    workload: Workload,
    config: ManagerConfig,
    vllm: list[RunResult],
    ours: list[RunResult],
    judged: bool,
    meta: dict[str, Any],
    floors: list[float] | None = None,
    parallel_floors: list[float] | None = None,
    peer: str = "vllm",
    rule: HitRule = vllm_hit_rule,
    target: float = TARGET_RATIO,
) -> dict[str, Any]:
    """One configuration's figures over its pairs; ``peer`` names the other manager's keys
    (``vllm_seconds`` in vs_vllm.json, ``peer_seconds`` in peers.json)."""
    ratios = _ratios(vllm, ours)
    ceiling: dict[str, Any] = {}
    if floors:
        ceilings = [v.seconds / f for v, f in zip(vllm, floors, strict=True)]
        ceiling = {
            "hashing_floor_seconds": statistics.median(floors),
            "ratio_ceiling_median": statistics.median(ceilings),
            "ratio_ceilings": ceilings,
        }
    if parallel_floors:
        ceilings = [v.seconds / f for v, f in zip(vllm, parallel_floors, strict=True)]
        ceiling |= {
            "hashing_floor_parallel_seconds": statistics.median(parallel_floors),
            "ratio_ceiling_parallel_median": statistics.median(ceilings),
        }
    hits = compare_hits(workload, config, vllm[0], ours[0], rule, peer)
    hashed_tokens = sum(len(r.prompt) + len(r.output) for r in _all_requests(workload))
    peer_hash = statistics.median(
        run.by_call.get("hash", 0.0) + run.by_call.get("append_output_token_ids", 0.0)
        for run in vllm
    )
    stable = all(run.hits == vllm[0].hits for run in vllm) and all(
        run.hits == ours[0].hits for run in ours
    )
    median = statistics.median(ratios)
    hashing = {f"{peer}_hashing_us_per_1k_tokens": peer_hash / hashed_tokens * 1e9}
    return {
        "ratio_min": min(ratios),
        "ratio_median": median,
        "ratio_max": max(ratios),
        f"{peer}_seconds": statistics.median(run.seconds for run in vllm),
        "prefixcache_seconds": statistics.median(run.seconds for run in ours),
        "hit_tokens_equal": hits["differing_requests"] == 0,
        "ratios": ratios,
        f"{peer}_runs_seconds": [run.seconds for run in vllm],
        "prefixcache_runs_seconds": [run.seconds for run in ours],
        f"{peer}_calls": _median_calls(vllm),
        "prefixcache_calls": _median_calls(ours),
        "steps": {peer: vllm[0].steps, "prefixcache": ours[0].steps},
        **(hashing if peer_hash else {}),
        "hits": {**hits, "same_in_every_pair": stable},
        "hash_reuse": config.reuse,
        "live_prefix_reuse": config.live_prefixes,
        **ceiling,
        "target_judged_here": judged,
        "target_ratio": target,
        "meets_target": median >= target,
        **meta,
    }


def run_config(
    workload: Workload,
    config: ManagerConfig,
    pairs: int,
    make_peer: Callable[[], Backend],
    meta: dict[str, Any],
    peer: str = "vllm",
    rule: HitRule = vllm_hit_rule,
    target: float = TARGET_RATIO,
) -> dict[str, dict[str, Any]]:
    """Alternating pairs in this process: the peer (a fresh ``make_peer()``), then
    prefixcache in each variant (without reuse; with ``extends``; with live prefixes where
    the workload shares running prefixes), then prefixcache's hashing floor. Returns an entry
    per variant; the judged one is ``REUSE_JUDGED``'s."""
    name = workload.name
    reuse = dataclasses.replace(
        config, name=config.name + "+extends", reuse=True, live_prefixes=True
    )
    live = dataclasses.replace(config, name=config.name + "+live", live_prefixes=True)
    variants = [config, reuse] + ([live] if LIVE_REUSE[name] else [])
    peer_runs: list[RunResult] = []
    runs: dict[str, list[RunResult]] = {v.name: [] for v in variants}
    floors: list[float] = []
    parallel_floors: list[float] = []
    for pair in range(pairs):
        backend = make_peer()
        with frozen_heap():
            peer_runs.append(simulate(workload, backend))
        for variant in variants:
            runs[variant.name].append(run_once("prefixcache", variant, workload))
        floors.append(hashing_floor(config, workload))
        parallel_floors.append(hashing_floor_parallel(config, workload))
        print(
            f"{name} {config.name} pair {pair}: {backend.label} "
            f"{peer_runs[-1].seconds:.3f} s, prefixcache "
            + ", ".join(
                f"{v.name.removeprefix(config.name) or 'no reuse'} {runs[v.name][-1].seconds:.4f} s"
                for v in variants
            )
            + f", hashing floor {floors[-1]:.4f} s (parallel {parallel_floors[-1]:.4f} s)",
            flush=True,
        )
    # Judged with `extends` where the workload re-sends prefixes, elsewhere without any
    # reuse (every prompt hashed in full, as vLLM does).
    judged = reuse if REUSE_JUDGED[name] else config
    return {
        variant.name: _entry(
            workload,
            variant,
            peer_runs,
            runs[variant.name],
            variant is judged,
            meta,
            floors if variant is config else None,
            parallel_floors if variant is config else None,
            peer,
            rule,
            target,
        )
        for variant in variants
    }


def profile_prefixcache(config: ManagerConfig, workload: Workload) -> str:
    """cProfile of one prefixcache run: where the Python-visible time goes."""
    backend = make_backend("prefixcache", config, workload)
    gc.collect()
    profiler = cProfile.Profile()
    profiler.enable()
    simulate(workload, backend)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(14)
    return out.getvalue()


def write_chart(results: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, medians, low, high, colours = [], [], [], [], []
    for workload, configs in results.items():
        for name, entry in configs.items():
            judged = " (judged)" if entry["target_judged_here"] else ""
            labels.append(f"{workload}\n{name}{judged}")
            medians.append(entry["ratio_median"])
            low.append(entry["ratio_median"] - entry["ratio_min"])
            high.append(entry["ratio_max"] - entry["ratio_median"])
            colours.append("#2a7" if entry["ratio_median"] >= TARGET_RATIO else "#d73")
    figure, axis = plt.subplots(figsize=(7.5, 0.42 * len(labels) + 1.2), dpi=90)
    rows = list(range(len(labels)))[::-1]
    axis.barh(rows, medians, xerr=[low, high], color=colours, capsize=3)
    axis.axvline(TARGET_RATIO, color="black", linestyle="--", linewidth=1)
    axis.text(TARGET_RATIO * 1.03, -0.45, "target 50x", fontsize=8)
    axis.set_yticks(rows, labels, fontsize=7)
    axis.set_xscale("log")
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500) if t <= 2 * max([*medians, 60])]
    axis.set_xticks(ticks, [f"{t}x" for t in ticks])
    axis.minorticks_off()
    axis.set_xlabel("vLLM / prefixcache manager + hashing time (median, min-max of pairs)")
    axis.set_title(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def markdown_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        "| workload | config | vLLM s | prefixcache s | ratio min / median / max "
        "| ceiling: vLLM / hashing floor | hits equal |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, configs in results.items():
        for name, e in configs.items():
            judged = " (judged)" if e["target_judged_here"] else ""
            hits = e["hits"]
            equal = (
                "yes"
                if e["hit_tokens_equal"]
                else (
                    f"no: {hits['differing_requests']} of {hits['requests']} "
                    f"({hits['explained_same_step']} same-step)"
                )
            )
            ceiling = (
                f"{e['ratio_ceiling_median']:.1f} ({e['hashing_floor_seconds']:.4f} s)"
                if "ratio_ceiling_median" in e
                else "-"
            )
            lines.append(
                f"| {workload} | {name}{judged} | {e['vllm_seconds']:.3f} | "
                f"{e['prefixcache_seconds']:.4f} | {e['ratio_min']:.1f} / "
                f"**{e['ratio_median']:.1f}** / {e['ratio_max']:.1f} | {ceiling} | {equal} |"
            )
    return "\n".join(lines)


def calls_table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = []
    for workload, configs in results.items():
        for name, e in configs.items():
            parts = []
            for side in ("vllm", "prefixcache"):
                calls = e[f"{side}_calls"]
                items = ", ".join(
                    f"{call} {v['seconds'] * 1e3:.1f} ms/{v['calls']}"
                    for call, v in sorted(calls.items(), key=lambda kv: -kv[1]["seconds"])
                )
                parts.append(f"{side}: {items}")
            lines.append(f"- {workload} / {name}: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="workload size (1.0 = full)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs (>= 3)")
    parser.add_argument(
        "--workload", nargs="+", choices=WORKLOAD_NAMES, default=list(WORKLOAD_NAMES)
    )
    parser.add_argument("--config", nargs="*", help="only these configuration names")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/results/vs_vllm.json")
    parser.add_argument("--chart", type=Path, default=ROOT / "docs/vs_vllm.png")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--profile", action="store_true", help="cProfile prefixcache runs")
    args = parser.parse_args(argv)

    import prefixcache
    import vllm

    command = "python benchmarks/vs_vllm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = {
        "scale": args.scale,
        "pairs": args.pairs,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {_cores()} cores, Python {platform.python_version()}",
        "vllm_version": vllm.__version__,
        "prefixcache_version": prefixcache.__version__,
        "prefixcache_commit": _git_commit(),
        "command": command.strip(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "nice": os.nice(0),
    }
    print(f"# {meta['machine']}, vLLM {vllm.__version__}, scale {args.scale}", flush=True)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    profiles: list[str] = []
    for workload_name in args.workload:
        workload = make_workload(workload_name, args.scale)
        results[workload_name] = {}
        for config in CONFIGS[workload_name]:
            if args.config and config.name not in args.config:
                continue
            entries = run_config(
                workload,
                config,
                args.pairs,
                lambda config=config, workload=workload: make_backend("vllm", config, workload),
                meta,
            )
            results[workload_name].update(entries)
            if args.profile:
                for profiled in entries:
                    variant = _variant(config, profiled)
                    profiles.append(
                        f"## {workload_name} / {profiled}\n"
                        + profile_prefixcache(variant, workload)
                    )
    print(markdown_table(results))
    print(calls_table(results))
    for text in profiles:
        print(text)
    if not args.no_write:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        write_chart(
            results,
            args.chart,
            f"prefixcache vs vLLM {meta['vllm_version']} KVCacheManager: manager + hashing time\n"
            f"scale {args.scale}, {args.pairs} pairs, {meta['date']}, "
            f"{meta['machine'].split(', Python')[0]}",
        )
        print(f"wrote {args.json} and {args.chart}")
    print(f"# load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


def _variant(config: ManagerConfig, name: str) -> ManagerConfig:
    """The prefixcache variant of ``config`` that ``run_config`` names ``name``."""
    suffix = name.removeprefix(config.name)
    return dataclasses.replace(
        config, name=name, reuse=suffix == "+extends", live_prefixes=bool(suffix)
    )


def _git_commit() -> str:
    """The commit of the tree this runs from (the installed wheel is built from it)."""
    import subprocess

    try:
        return subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


if __name__ == "__main__":
    start = time.perf_counter()
    status = main()
    print(f"# total {time.perf_counter() - start:.0f} s")
    sys.exit(status)
