#!/usr/bin/env python3
"""What in a prefill step is fixed per step: a block and a fine prefill step of one round, profiled.

Runs the reference engine one step at a time (no overlap) over a short growing-prefix workload
with the seed geometry (B = 1,536, U = 128, budget 8,192; 8 streams of ``--first-prompt`` tokens
growing by 2,000 a round), once per policy (block, then fine, on one set of caches after an
unmeasured warm run of each), and takes the steps that schedule a request of round
``--measure-round`` (default: the last; each is prefilled in one step, the other streams
decoding in it). The first such step of each policy runs under ``torch.profiler``; the others
are timed only (their wall time, schedule to first token, without the profiler's cost).

Per profiled step (``analyse``):

- **wall**: from the step's start (the scheduler's decision) to its first token (the sampled id
  and logits on the host, the commit done);
- **host before first launch**: from the step's start to the first kernel launch (memcpy and
  memset included), and the host phases (``schedule``, ``plan``, ``apply_plan``,
  ``step_inputs`` (``Step.from_plan`` and the token ids), ``forward``, ``sample``,
  ``to_host``, ``after_forward``) and the host time in each layer kind's forward;
- **GPU busy**: the union of the device's kernel and copy intervals; **GPU idle inside** the
  step: from its first kernel's start to its last one's end, less busy, also split by where the
  GPU waited (each idle stretch charged to the layer or phase range that launched the work
  ending it, numbered in step order: ``layer:kda#0`` is the first KDA layer); the idle before
  the first kernel and after the last one, up to the step's end;
- **kernel time by category** (``category``: attention, kda, conv, matmul, norm, elementwise,
  reduce, copy, other; by kernel name).

Then block - fine of each figure against the token difference: a category whose difference
per token is its per-token cost follows tokens; the rest of it is fixed per step.
On the CPU (``--smoke``) there are no kernels: the top-level aten operators inside the forward
stand for them (the code path and the parsing, not a measurement).

    PYTHONPATH=<site with the wheel> PREFIXCACHE_FLASHKDA_LIB=<_flashkda_C.abi3.so> \\
        python3 benchmarks/gpu_step_compare.py --json "$OUT/step_compare.json" --trace-dir "$OUT"
    python3 benchmarks/gpu_step_compare.py --smoke     # CPU, the tiny model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefixcache.engine import Engine, build_model, engine_config_for
from prefixcache.engine import engine as engine_module
from prefixcache.engine.policy import Policy
from prefixcache.engine.workloads import Geometry, GrowingPrefixSpec, PresetWorkload
from prefixcache.models import ModelConfig
from prefixcache.models import hybrid as hybrid_module
from prefixcache.models.layers import KDALayer
from torch.autograd import DeviceType  # type: ignore[attr-defined]

#: Kernel categories, in the order the rules are tried (the first whose words a name holds).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kda", ("kda",)),
    ("conv", ("conv_", "conv1d", "aten::conv")),
    (
        "attention",
        ("flash", "fmha", "attn", "attention", "softmax", "split_kernel", "combine_kernel"),
    ),
    (
        "matmul",
        (
            "gemm",
            "gemv",
            "cutlass",
            "xmma",
            "nvjet",
            "cublas",
            "matmul",
            "::mm",
            "addmm",
            "linear",
            "bmm",
        ),
    ),
    ("norm", ("rms", "norm")),
    ("reduce", ("reduce", "mean", "sum", "argmax", "max")),
    (
        "copy",
        (
            "memcpy",
            "memset",
            "copy",
            "cat",
            "index",
            "gather",
            "scatter",
            "fill",
            "::to",
            "slice",
            "stack",
            "contiguous",
            "clone",
        ),
    ),
    (
        "elementwise",
        (
            "elementwise",
            "vectorized",
            "unrolled",
            "pointwise",
            "::add",
            "::mul",
            "::sub",
            "::div",
            "rsqrt",
            "pow",
            "exp",
            "sigmoid",
            "silu",
            "neg",
        ),
    ),
)
CATEGORY_NAMES = (*(name for name, _ in CATEGORIES), "other")
#: Host phases of a step (record_function ranges the probe opens), in step order.
PHASES = ("schedule", "plan", "apply_plan", "step_inputs", "forward", "sample", "after_forward")
#: Gaps between two phases, named: ``Step.from_plan`` runs between ``apply_plan`` and
#: ``step_inputs``, the logits' copy to the host between ``sample`` and ``after_forward``.
GAPS = (("from_plan", "apply_plan", "step_inputs"), ("to_host", "sample", "after_forward"))
LAYER_RANGES = ("layer:kda", "layer:attention", "layer:mlp", "norm")
STEP = "step"


def category(name: str) -> str:
    """The category of a kernel (or, on the CPU, an aten operator) by its name."""
    lower = name.lower()
    for label, words in CATEGORIES:
        if any(word in lower for word in words):
            return label
    return "other"


def is_launch(name: str) -> bool:
    """Whether a host event is a launch of device work (a kernel, a graph, a copy or a set)."""
    return name.startswith("cu") and any(w in name for w in ("Launch", "Memcpy", "Memset"))


@dataclass(frozen=True)
class Span:
    """One profiler event: ``kind`` is ``"range"`` (a host range the probe opened),
    ``"launch"`` (a host launch call) or ``"work"`` (device work: a kernel or copy on CUDA, a
    top-level operator inside the forward on the CPU); times in microseconds."""

    name: str
    kind: str
    start: float
    end: float
    #: The profiler's correlation id, which ties a kernel to its launch (0: none).
    link: int = 0
    #: A kernel's linked correlation: the id of the host operator that launched it (0: none).
    op: int = 0


def _union(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``intervals``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def analyse(spans: Sequence[Span]) -> dict[str, Any]:
    """The figures of one profiled step (module docstring) from its spans; milliseconds.

    ``ValueError`` when the spans hold no ``"step"`` range."""
    steps = [s for s in spans if s.kind == "range" and s.name == STEP]
    if not steps:
        raise ValueError("no 'step' range among the spans")
    step = steps[0]
    inside = [s for s in spans if s.start >= step.start and s.end <= step.end]
    work = [s for s in spans if s.kind == "work" and s.start >= step.start]
    launches = [s for s in inside if s.kind == "launch"]
    ms = 1e-3
    out: dict[str, Any] = {"wall_ms": (step.end - step.start) * ms}
    phases: dict[str, float] = defaultdict(float)
    for s in inside:
        if s.kind == "range" and s.name != STEP:
            phases[s.name] += (s.end - s.start) * ms
    out["phases_ms"] = {name: phases.get(name, 0.0) for name in (*PHASES, *LAYER_RANGES)}
    ends = {s.name: s.end for s in inside if s.kind == "range"}
    starts = {s.name: s.start for s in inside if s.kind == "range"}
    for gap, before, after in GAPS:
        if before in ends and after in starts:
            out["phases_ms"][gap] = max(0.0, starts[after] - ends[before]) * ms
    first_launch = min((s.start for s in launches), default=None)
    out["launches"] = len(launches)
    out["host_before_first_launch_ms"] = (
        None if first_launch is None else (first_launch - step.start) * ms
    )
    out["kernels"] = len(work)
    by_category = dict.fromkeys(CATEGORY_NAMES, 0.0)
    counts = dict.fromkeys(CATEGORY_NAMES, 0)
    for s in work:
        label = category(s.name)
        by_category[label] += (s.end - s.start) * ms
        counts[label] += 1
    out["kernel_ms_by_category"] = by_category
    out["kernels_by_category"] = counts
    out["kernel_ms_by_range"] = _by_range(inside, work)
    if work:
        first = min(s.start for s in work)
        last = max(s.end for s in work)
        busy = _union([(s.start, s.end) for s in work]) * ms
        out["gpu_busy_ms"] = busy
        out["gpu_span_ms"] = (last - first) * ms
        out["gpu_idle_inside_ms"] = (last - first) * ms - busy
        out["gpu_idle_before_ms"] = (first - step.start) * ms
        out["gpu_idle_after_ms"] = max(0.0, step.end - last) * ms
        out["gpu_idle_by_range_ms"] = _idle_by_range(inside, work)
    return out


def _launch_time(item: Span, launched: dict[int, float], ops: dict[int, float]) -> float | None:
    """When ``item``'s launch (its ``link``) or, where that is unknown, the operator that
    launched it (its ``op``) started; ``None`` where neither is among the spans."""
    at = launched.get(item.link) if item.link else None
    if at is None and item.op:
        at = ops.get(item.op)
    return at


def _holder(at: float | None, ranges: Sequence[Span]) -> Span | None:
    """The innermost range holding time ``at`` (the latest-starting one), if any."""
    holders = [] if at is None else [r for r in ranges if r.start <= at <= r.end]
    return max(holders, key=lambda r: r.start) if holders else None


def _links(inside: Sequence[Span]) -> tuple[dict[int, float], dict[int, float]]:
    """Launch and operator start times by their correlation ids."""
    launched = {s.link: s.start for s in inside if s.kind == "launch" and s.link}
    ops = {s.link: s.start for s in inside if s.kind == "op" and s.link}
    return launched, ops


def _by_range(inside: Sequence[Span], work: Sequence[Span]) -> dict[str, float]:
    """Device time by the innermost layer range (or, outside every layer, phase) whose host
    time holds the work's launch (its ``link``), else the operator that launched it (its
    ``op``); ``"unattributed"`` where neither is known."""
    ranges = [s for s in inside if s.kind == "range" and s.name != STEP]
    launched, ops = _links(inside)
    out: dict[str, float] = defaultdict(float)
    for item in work:
        holder = _holder(_launch_time(item, launched, ops), ranges)
        out["unattributed" if holder is None else holder.name] += (item.end - item.start) * 1e-3
    return dict(out)


def _idle_by_range(inside: Sequence[Span], work: Sequence[Span]) -> dict[str, float]:
    """The GPU's idle time inside the step (ms), each stretch with no work running charged to
    the innermost range holding the launch of the work that ends it, named with its place
    among the step's ranges of that name (``layer:kda#0`` is the step's first KDA layer):
    where the GPU waited for the host's launches, in step order. ``"unattributed"`` as in
    :func:`_by_range`."""
    ranges = [s for s in inside if s.kind == "range" and s.name != STEP]
    place: dict[int, int] = {}
    seen: dict[str, int] = defaultdict(int)
    for r in sorted(ranges, key=lambda r: r.start):
        place[id(r)] = seen[r.name]
        seen[r.name] += 1
    launched, ops = _links(inside)
    out: dict[str, float] = defaultdict(float)
    ordered = sorted(work, key=lambda s: s.start)
    reach = ordered[0].end if ordered else 0.0
    for item in ordered[1:]:
        if item.start > reach:
            holder = _holder(_launch_time(item, launched, ops), ranges)
            name = "unattributed" if holder is None else f"{holder.name}#{place[id(holder)]}"
            out[name] += (item.start - reach) * 1e-3
        reach = max(reach, item.end)
    return dict(out)


def spans_from_profile(events: Any, device: str) -> list[Span]:
    """``torch.profiler`` events as :class:`Span` s: on CUDA the device's events are the work,
    on the CPU the aten operators directly under a probe range inside ``forward``."""
    spans: list[Span] = []
    ranges = {STEP, *PHASES, *LAYER_RANGES}
    for event in events:
        start, end = float(event.time_range.start), float(event.time_range.end)
        name = event.name
        on_device = event.device_type != DeviceType.CPU
        if on_device:
            # The profiler mirrors each host range onto the GPU's timeline (a user annotation
            # spanning the kernels launched inside it): not work of the device's own.
            if device == "cuda" and name not in ranges:
                op = int(getattr(event, "linked_correlation_id", 0) or 0)
                spans.append(Span(name, "work", start, end, int(event.id), op))
            continue
        if name in ranges:
            spans.append(Span(name, "range", start, end))
        elif is_launch(name):
            spans.append(Span(name, "launch", start, end, int(event.id)))
        elif device == "cuda" and name.startswith("aten::"):
            spans.append(Span(name, "op", start, end, int(event.id)))
        elif device != "cuda" and name.startswith("aten::"):
            parent = event.cpu_parent
            if parent is not None and parent.name in (*LAYER_RANGES, "forward"):
                # On the CPU an operator is its own launch: linked by a made-up id.
                link = -len(spans) - 1
                spans.append(Span(name, "work", start, end, link))
                spans.append(Span(name, "launch", start, start, link))
    return spans


def compare(block: dict[str, Any], fine: dict[str, Any]) -> dict[str, Any]:
    """Block - fine of each figure of two analysed steps, and of each kernel category in
    microseconds a token of their token difference (``None`` where they computed the same)."""
    tokens = block["tokens"] - fine["tokens"]
    out: dict[str, Any] = {"tokens": tokens}
    for key in (
        "wall_ms",
        "host_before_first_launch_ms",
        "gpu_busy_ms",
        "gpu_idle_inside_ms",
        "gpu_idle_before_ms",
        "gpu_idle_after_ms",
    ):
        a, b = block.get(key), fine.get(key)
        out[key] = None if a is None or b is None else a - b
    per_token: dict[str, float | None] = {}
    difference: dict[str, float] = {}
    for label in CATEGORY_NAMES:
        delta = block["kernel_ms_by_category"][label] - fine["kernel_ms_by_category"][label]
        difference[label] = delta
        per_token[label] = None if tokens == 0 else 1e3 * delta / tokens
    out["kernel_ms_by_category"] = difference
    out["kernel_us_per_token"] = per_token
    busy = out["gpu_busy_ms"]
    out["gpu_busy_us_per_token"] = None if busy is None or tokens == 0 else 1e3 * busy / tokens
    return out


class Probe:
    """Wraps one engine loop's step: profiles or times the steps that schedule a request of
    round ``target`` (module docstring)."""

    def __init__(self, target: int, profile_first: bool, limit: int) -> None:
        self.target = target
        self.profile_first = profile_first
        self.limit = limit
        self.profiled: dict[str, Any] | None = None
        self.timed: list[dict[str, Any]] = []
        self.trace: Any = None

    def wants(self, loop: Any) -> bool:
        seen = len(self.timed) + (self.profiled is not None)
        return seen < self.limit and any(seq.request.round == self.target for seq in loop.waiting)

    def step(self, loop: Any, inner: Callable[[], bool]) -> bool:
        if not self.wants(loop):
            return inner()
        targets = [seq for seq in loop.waiting if seq.request.round == self.target]
        seq = targets[0]
        before = seq.computed_prefill_tokens
        profile = self.profile_first and self.profiled is None
        with _phases(loop):
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as profiler

                activities = [ProfilerActivity.CPU]
                if loop.model.device.type == "cuda":
                    activities.append(ProfilerActivity.CUDA)
                    torch.cuda.synchronize()
                with profiler(activities=activities) as prof:
                    stepped = _timed_step(inner)[0]
                    if loop.model.device.type == "cuda":
                        torch.cuda.synchronize()
                record = analyse(spans_from_profile(prof.events(), loop.model.device.type))
                self.trace = prof
            else:
                stepped, seconds = _timed_step(inner)
                record = {"wall_ms": 1e3 * seconds}
        record["tokens"] = seq.computed_prefill_tokens - before
        record["rows"] = int(loop.buffers.num_rows)
        record["first_token"] = seq.first_token_time is not None
        if profile:
            self.profiled = record
        else:
            self.timed.append(record)
        return stepped


def _timed_step(inner: Callable[[], bool]) -> tuple[bool, float]:
    from torch.profiler import record_function

    start = time.perf_counter()
    with record_function(STEP):
        stepped = inner()
    return stepped, time.perf_counter() - start


@contextmanager
def _phases(loop: Any) -> Iterator[None]:
    """Host ranges around the step's phases and each layer's forward, while open."""
    from torch.profiler import record_function

    def ranged(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function(name):
                return function(*args, **kwargs)

        return wrapper

    model = loop.model
    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attribute: str, name: str) -> None:
        own = vars(owner).get(attribute, _ABSENT)  # an instance attribute to put back, if any
        _set(owner, attribute, ranged(name, getattr(owner, attribute)))
        patched.append((owner, attribute, own))

    patch(loop, "schedule", "schedule")
    patch(loop.tables, "apply_plan", "apply_plan")
    patch(loop, "inputs", "step_inputs")
    patch(loop.engine, "forward", "forward")
    patch(model, "sample", "sample")
    patch(loop, "after_forward", "after_forward")
    patch(hybrid_module, "rms_norm", "norm")
    for mixer in model.mixers:
        patch(mixer, "forward", "layer:kda" if isinstance(mixer, KDALayer) else "layer:attention")
    for mlp in model.mlps:
        patch(mlp, "forward", "layer:mlp")
    manager, plan = loop.manager, _Ranged(loop.manager)
    loop.manager = plan
    try:
        yield
    finally:
        loop.manager = manager
        for owner, attribute, own in reversed(patched):
            if own is _ABSENT:
                try:
                    delattr(owner, attribute)  # the class's again
                except dataclasses.FrozenInstanceError:
                    object.__delattr__(owner, attribute)
            else:
                _set(owner, attribute, own)


_ABSENT = object()


def _set(owner: Any, attribute: str, value: Any) -> None:
    try:
        setattr(owner, attribute, value)
    except dataclasses.FrozenInstanceError:
        # The layers are frozen dataclasses: a wrapped method changes none of their fields.
        object.__setattr__(owner, attribute, value)


class _Ranged:
    """The cache manager with ``build_plan_into`` in a ``plan`` range and the logits' copy
    to the host (``to_host``: what the step does between ``sample`` and ``after_forward``)
    left to the step's own code."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager

    def build_plan_into(self, *args: Any) -> Any:
        from torch.profiler import record_function

        with record_function("plan"):
            return self._manager.build_plan_into(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _install(probe: Probe) -> Callable[[], None]:
    """Route every non-overlapped loop's ``step`` through ``probe``; returns the undo."""
    original = engine_module._Loop.step

    def step(self: Any) -> bool:
        return probe.step(self, lambda: original(self))

    engine_module._Loop.step = step  # type: ignore[method-assign]

    def undo() -> None:
        engine_module._Loop.step = original  # type: ignore[method-assign]

    return undo


def run_policy(
    model: Any, name: str, workload: PresetWorkload, geometry: Geometry, config: Any, args: Any
) -> dict[str, Any]:
    """One measured run of policy ``name`` under the probe: its profiled and timed steps."""
    policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
    probe = Probe(args.measure_round, profile_first=True, limit=args.steps)
    undo = _install(probe)
    try:
        Engine(model, policy, config).run(workload.build(model.config.vocab_size))
    finally:
        undo()
    if probe.profiled is None:
        raise RuntimeError(f"{name}: no step scheduled a request of round {args.measure_round}")
    if args.trace_dir and probe.trace is not None:
        folder = Path(args.trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        table = probe.trace.key_averages().table(
            sort_by="self_cuda_time_total"
            if model.device.type == "cuda"
            else "self_cpu_time_total",
            row_limit=40,
            max_name_column_width=70,
        )
        (folder / f"step_compare_{name}.txt").write_text(table)
    walls = [r["wall_ms"] for r in probe.timed]
    return {
        "profiled": probe.profiled,
        "timed": probe.timed,
        "timed_wall_ms_p50": statistics.median(walls) if walls else None,
        "timed_tokens_p50": statistics.median(r["tokens"] for r in probe.timed)
        if probe.timed
        else None,
    }


def render(report: dict[str, Any]) -> str:
    """The figures as markdown tables."""
    block, fine = report["block"]["profiled"], report["fine"]["profiled"]
    diff = report["difference"]

    def cell(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        f"round {report['measure_round']}: block step {block['tokens']} tokens, fine "
        f"{fine['tokens']} ({diff['tokens']} fewer); {block['rows']} / {fine['rows']} rows",
        "",
        "| figure (ms) | block | fine | block - fine |",
        "|---|---|---|---|",
    ]
    for label, key in (
        ("wall, schedule to first token (profiled)", "wall_ms"),
        ("host before the first launch", "host_before_first_launch_ms"),
        ("GPU busy", "gpu_busy_ms"),
        ("GPU idle inside the step", "gpu_idle_inside_ms"),
        ("GPU idle before the first kernel", "gpu_idle_before_ms"),
        ("GPU idle after the last kernel", "gpu_idle_after_ms"),
    ):
        lines.append(
            f"| {label} | {cell(block.get(key))} | {cell(fine.get(key))} | {cell(diff.get(key))} |"
        )
    lines.append(
        f"| wall p50 of the other steps (unprofiled) | {cell(report['block']['timed_wall_ms_p50'])}"
        f" | {cell(report['fine']['timed_wall_ms_p50'])} | |"
    )
    lines.append(
        f"| launches / kernels | {block['launches']} / {block['kernels']} | "
        f"{fine['launches']} / {fine['kernels']} | |"
    )
    lines += ["", "| host phase (ms) | block | fine |", "|---|---|---|"]
    names = (*PHASES[:3], "from_plan", *PHASES[3:6], "to_host", PHASES[6], *LAYER_RANGES)
    for name in names:
        lines.append(
            f"| {name} | {cell(block['phases_ms'].get(name))} | "
            f"{cell(fine['phases_ms'].get(name))} |"
        )
    lines += ["", "| device ms launched in | block | fine |", "|---|---|---|"]
    for name in sorted(set(block["kernel_ms_by_range"]) | set(fine["kernel_ms_by_range"])):
        lines.append(
            f"| {name} | {block['kernel_ms_by_range'].get(name, 0.0):.3f} | "
            f"{fine['kernel_ms_by_range'].get(name, 0.0):.3f} |"
        )
    idle_block, idle_fine = (
        block.get("gpu_idle_by_range_ms", {}),
        fine.get("gpu_idle_by_range_ms", {}),
    )
    lines += [
        "",
        "| GPU idle inside the step (ms), by where the work after it was launched | block | fine |",
        "|---|---|---|",
    ]
    for name in dict.fromkeys([*idle_block, *idle_fine]):  # in step order
        lines.append(
            f"| {name} | {idle_block.get(name, 0.0):.3f} | {idle_fine.get(name, 0.0):.3f} |"
        )
    lines += [
        "",
        "| kernel category | block ms (n) | fine ms (n) | block - fine ms | us a token of the "
        "difference |",
        "|---|---|---|---|---|",
    ]
    for label in CATEGORY_NAMES:
        lines.append(
            f"| {label} | {block['kernel_ms_by_category'][label]:.3f} "
            f"({block['kernels_by_category'][label]}) | "
            f"{fine['kernel_ms_by_category'][label]:.3f} ({fine['kernels_by_category'][label]}) | "
            f"{diff['kernel_ms_by_category'][label]:.3f} | "
            f"{cell(diff['kernel_us_per_token'][label], 3)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="flashkda-op")
    parser.add_argument("--depth", type=int, default=2, help="layer groups of the proxy")
    parser.add_argument("--first-prompt", type=int, default=120_000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument(
        "--measure-round",
        type=int,
        default=None,
        help="the round whose steps are taken (default: the last)",
    )
    parser.add_argument("--steps", type=int, default=8, help="steps taken a policy (1 profiled)")
    parser.add_argument("--json", help="write the figures to this file")
    parser.add_argument("--trace-dir", help="write each policy's profiler table here")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode-only steps from CUDA graphs where they can run (default on)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, the tiny model, small sizes")
    args = parser.parse_args(argv)
    growth = 2_000
    geometry = Geometry(block_size=1536, unit=128, token_budget=8192, max_running=8)
    config = None
    if args.smoke:
        args.device, args.backend = "cpu", "torch"
        args.first_prompt, args.output_len, growth = 600, 3, 100
        geometry = Geometry(block_size=96, unit=8, token_budget=512, max_running=8)
        torch.set_num_threads(1)
    else:
        config = ModelConfig.kimi_k3_tp8(args.depth)
    if args.measure_round is None:
        args.measure_round = args.rounds
    if not 2 <= args.measure_round <= args.rounds:
        parser.error("--measure-round must be a round after the first")
    model = build_model(
        args.device, args.backend, config=config, cuda_graphs="auto" if args.cuda_graphs else False
    )
    spec = GrowingPrefixSpec(
        first_prompt=args.first_prompt,
        growth=growth,
        rounds=args.rounds,
        output_len=args.output_len,
    )
    workload = PresetWorkload("growing-prefix", "step-compare", spec, geometry)
    geometry = geometry.aligned(model.backend.checkpoint_alignment)
    engine_config = engine_config_for(workload, geometry, model.backend, overlap=False)
    started = time.perf_counter()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
        "model": {"depth": args.depth, "layers": list(model.config.layers)},
        "workload": {"first_prompt": args.first_prompt, "growth": growth, "rounds": args.rounds},
        "measure_round": args.measure_round,
    }
    with model.reusing_caches():
        for name in ("block", "fine"):  # unmeasured: every shape and graph of both policies
            policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
            Engine(model, policy, engine_config).run(workload.build(model.config.vocab_size))
        report["warm_seconds"] = time.perf_counter() - started
        for name in ("block", "fine"):
            report[name] = run_policy(model, name, workload, geometry, engine_config, args)
    report["seconds"] = time.perf_counter() - started
    report["difference"] = compare(report["block"]["profiled"], report["fine"]["profiled"])
    print(render(report))
    print(f"\n{report['seconds']:.1f} s (warm {report['warm_seconds']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
