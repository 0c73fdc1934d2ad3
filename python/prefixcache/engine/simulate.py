"""Side-by-side runs of caching policies over one workload: what ``prefixcache simulate`` does.

:func:`build_model` picks the device, dtype, kernel backend and model size;
:func:`engine_config_for` sizes the pools for a workload preset; :func:`simulate` runs the
``none`` policy (the reference) and every other requested policy on zeroed caches over the same
workload, checks each policy's outputs against the reference, and returns a
:class:`SimulationReport` whose :meth:`SimulationReport.to_json` is the ``--json`` document.

Output check tolerance: float32 (the CPU default), every generated id equal and final logits
within 1e-4 relative. bf16 (the GPU kernels): final logits within 3e-2 relative, and ids equal
until the first position where the reference's top two logits are closer than that tolerance
(a bf16 near-tie may legitimately flip there; the sequences are not compared beyond it). bf16
keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3); a policy that resumes from a checkpoint
splits the prefill at other positions, so activations are rounded at different points, a few
roundoffs per layer across 4 layers and the final projection.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import numpy as np
import torch

import prefixcache as pc

from ..kernels import KDABackend, KDALayerParams, Step, get_backend
from ..kernels.backend import ConvImpl
from ..kernels.ops import conv_function, default_conv
from ..models import HybridModel, KernelTimer, ModelConfig
from ..models.timing import TimingMode
from .engine import OVERLAP_DEPTH, Engine, EngineConfig
from .policy import PAGED_GROUP, POLICY_NAMES, STATE_GROUP, Policy
from .results import RequestResult, RunResult, outputs_match
from .workloads import Geometry, GrowingPrefixSpec, PresetWorkload

__all__ = [
    "FLOAT32_RTOL",
    "LOW_PRECISION_RTOL",
    "MAX_REPEATS",
    "REPEATED_FIGURES",
    "WARM_UPS",
    "SimulationReport",
    "StepClock",
    "build_model",
    "check_repeats",
    "check_warm_order",
    "engine_config_for",
    "measured_names",
    "measured_order",
    "pass_state",
    "resolve_warm_up",
    "simulate",
    "warm_up_workload",
]

FLOAT32_RTOL = 1e-4
CPU_CHUNK_SIZE = 32  # the torch backend's fastest chunk for the tiny model on a CPU
LOW_PRECISION_RTOL = 3e-2

WarmUp = Literal["none", "shapes", "full"]
#: What runs unmeasured before the measured runs (``simulate``'s ``warm_up``).
WARM_UPS: tuple[WarmUp, ...] = ("none", "shapes", "full")

#: The most measured passes ``simulate`` runs (``repeats``): each is a whole run of every policy.
MAX_REPEATS = 16
#: The figures of a policy's run whose median and spread over the passes a report gives.
REPEATED_FIGURES = ("ttft_p50_ms", "prefill_seconds", "kda_prefill_seconds", "host_seconds")


def check_repeats(repeats: object) -> int:
    """``repeats`` as a pass count, or ``ValueError`` unless it is an integer 1 to MAX_REPEATS."""
    if isinstance(repeats, bool) or not isinstance(repeats, int):
        raise ValueError(f"repeats must be an integer from 1 to {MAX_REPEATS}, got {repeats!r}")
    if not 1 <= repeats <= MAX_REPEATS:
        raise ValueError(f"repeats must be from 1 to {MAX_REPEATS} passes, got {repeats}")
    return repeats


def _spread(values: Sequence[float]) -> float | None:
    """max / min - 1 (0 for one value; None where the smallest is not positive)."""
    low = min(values)
    return max(values) / low - 1.0 if low > 0 else None


def build_model(
    device: str = "cpu",
    backend: str = "auto",
    *,
    config: ModelConfig | None = None,
    backend_options: dict[str, Any] | None = None,
    kda_timing: TimingMode | Literal["auto"] = "auto",
    conv: ConvImpl | Literal["auto"] = "auto",
    decode_attention: str = "auto",
    split_prefill: bool = True,
    cuda_graphs: bool | str = "auto",
) -> HybridModel:
    """The reference model on ``device`` with the kernel backend ``backend``.

    Default model: :meth:`ModelConfig.tiny` on the CPU, the Kimi-K3 cost proxy
    :meth:`ModelConfig.kimi_k3_tp8` (two groups of 3 KDA + 1 attention layers) on CUDA.
    dtype: float32 on the CPU and with the torch backend, bf16 with the GPU kernels.
    On the CPU ``"auto"`` is the torch backend (the others need CUDA), in chunks of 32 tokens.
    ``backend_options`` go to the backend's constructor (e.g. ``checkpoint_alignment`` of the
    torch backend). ``kda_timing`` is how the model's KDA timer measures
    (:mod:`prefixcache.models.timing`; ``"auto"``: ``"events"`` on CUDA, which adds no
    synchronisation to a step, ``"wall"`` on the CPU); ``conv`` the short convolution's
    implementation (``"auto"``: ``"triton"`` on CUDA, ``"torch"`` on the CPU;
    ``prefixcache.kernels.conv_triton``); ``decode_attention`` how attention layers compute
    decode rows (``"auto"``: ``"triton"`` on CUDA, ``"torch"`` on the CPU;
    ``prefixcache.kernels.decode_attention``); ``split_prefill`` whether a prefill chunk's
    cached prefix is split across the GPU (``prefixcache.kernels.prefill_attention``);
    ``cuda_graphs`` whether decode-only steps replay CUDA graphs (``"auto"``: where they can run;
    ``prefixcache.models.graphs``). Raises
    ``BackendUnavailableError`` when the backend cannot run here, ``UnsupportedLayerError`` when
    the convolution or the decode attention cannot.
    """
    torch_device = torch.device(device)
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    if config is None:
        config = ModelConfig.tiny() if torch_device.type == "cpu" else ModelConfig.kimi_k3_tp8()
    options = dict(backend_options or {})
    if backend == "auto" and torch_device.type == "cpu":
        backend = "torch"  # every other backend needs CUDA tensors
    if backend == "torch":
        options.setdefault("chunk_size", CPU_CHUNK_SIZE if torch_device.type == "cpu" else 64)
    if backend == "auto":
        probe = KDALayerParams.random(
            config.kda_heads, config.kda_head_dim, gate=config.kda_gate, device=torch_device
        )
        kernel_backend = get_backend("auto", params=probe, dtype=torch.bfloat16, **options)
    else:
        kernel_backend = get_backend(backend, **options)
    conv_impl = default_conv(torch_device) if conv == "auto" else conv
    conv_function(conv_impl, torch_device)  # refuses an unknown name, or triton where it cannot run
    kernel_backend.conv_impl = cast(ConvImpl, conv_impl)
    timing: TimingMode = cast(TimingMode, kda_timing)
    if kda_timing == "auto":
        timing = "events" if torch_device.type == "cuda" else "wall"
    HybridModel.check_decode_attention(decode_attention, torch_device)  # before the weights
    model = HybridModel(
        config,
        kernel_backend,
        device=torch_device,
        decode_attention=decode_attention,
        split_prefill=split_prefill,
        cuda_graphs=cuda_graphs,
    )
    model.kda_timer = KernelTimer(torch_device, timing)
    return model


def engine_config_for(
    workload: PresetWorkload,
    geometry: Geometry,
    backend: KDABackend,
    *,
    check: bool = False,
    overlap: bool = True,
) -> EngineConfig:
    """Pools large enough that the preset evicts (almost) nothing it could reuse.

    Every running sequence may hold the most blocks the core says one sequence of the
    workload's longest length holds in chunks of the token budget
    (``CacheConfig.blocks_for_sequence``, the largest over the policies' configurations for
    ``backend``); on top of that the pools keep the reusable prefixes (one attention block per
    block of them, and one state slot as slack) and what each finished request leaves
    published: two attention blocks (a partial last block and a copy-on-write destination) and
    three checkpoints (tail, junction, decode tail). ``overlap`` sizes them for an overlapped
    engine (``OVERLAP_DEPTH`` plans in flight: more running states per sequence).
    """
    spec = workload.spec
    cached_blocks = math.ceil(spec.cache_tokens() / geometry.block_size)
    requests = spec.num_requests
    running = geometry.max_running
    longest = spec.longest_sequence()
    paged_bound = state_bound = 0
    for name in POLICY_NAMES:
        policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
        config = policy.cache_config(backend, paged_blocks=2, state_blocks=2)
        if overlap:
            config = dataclasses.replace(config, max_steps_in_flight=OVERLAP_DEPTH)
        budget = geometry.token_budget
        paged_bound = max(paged_bound, config.blocks_for_sequence(PAGED_GROUP, longest, budget))
        state_bound = max(state_bound, config.blocks_for_sequence(STATE_GROUP, longest, budget))
    return EngineConfig(
        token_budget=geometry.token_budget,
        max_running=running,
        paged_blocks=1 + cached_blocks + 2 * requests + running * paged_bound,
        state_blocks=1 + cached_blocks + 3 * requests + running * state_bound,
        check=check,
        overlap=overlap,
    )


@dataclass
class SimulationReport:
    """Runs of several policies over one workload, checked against the ``none`` run."""

    workload: str
    preset: str
    device: str
    backend: str
    geometry: Geometry
    model: ModelConfig
    dtype: str
    rtol: float
    engine_config: EngineConfig | None = None
    kda_timing: str = "wall"
    conv: str = "torch"
    decode_attention: str = "torch"
    split_prefill: bool = True
    cuda_graphs: bool = False
    warm_up: str = "none"
    #: The policies of the warm pass in the order they ran (empty without one).
    warm_order: list[str] = field(default_factory=list)
    runs: dict[str, RunResult] = field(default_factory=dict)
    step_times: dict[str, dict[str, Any]] = field(default_factory=dict)
    policies: dict[str, Policy] = field(default_factory=dict)
    matches: dict[str, tuple[bool | None, str]] = field(default_factory=dict)
    #: Measured passes (``simulate``'s ``repeats``). With more than one, ``passes[name]`` holds
    #: each pass's run of a repeated policy (with its step times and output check), ``order``
    #: the (pass, policy) runs as they ran, and ``runs[name]`` is the median pass.
    repeats: int = 1
    passes: dict[str, list[tuple[RunResult, dict[str, Any], tuple[bool | None, str]]]] = field(
        default_factory=dict
    )
    order: list[tuple[int, str]] = field(default_factory=list)

    def add_pass(
        self,
        name: str,
        run: RunResult,
        step_times: dict[str, Any],
        match: tuple[bool | None, str],
    ) -> None:
        """Record one pass of ``name``: its headline becomes the median pass so far, and its
        output check fails if any pass's does."""
        passes = self.passes.setdefault(name, [])
        passes.append((run, step_times, match))
        self.order.append((len(passes), name))
        headline, times, headline_match = passes[self.median_pass(name)]
        self.runs[name], self.step_times[name] = headline, times
        failed = [(k, m) for k, (_, _, m) in enumerate(passes, 1) if m[0] is False]
        if failed:
            k, (_, detail) = failed[0]
            headline_match = (False, f"pass {k}: {detail}")
        self.matches[name] = headline_match

    def median_pass(self, name: str) -> int:
        """The index of ``name``'s median pass by TTFT p50 (of an even count, the faster of
        the two middle ones; equal figures: the earlier pass)."""
        passes = self.passes[name]
        ranked = sorted(range(len(passes)), key=lambda k: (passes[k][0].ttft_p50_ms, k))
        return ranked[(len(ranked) - 1) // 2]

    def _policy_json(
        self,
        name: str,
        run: RunResult,
        step_times: dict[str, Any],
        checked: tuple[bool | None, str],
    ) -> dict[str, Any]:
        policy = self.policies[name]
        match, detail = checked
        return {
            "requests": len(run.requests),
            "prompt_tokens": run.prompt_tokens,
            "hit_tokens": run.hit_tokens,
            "computed_prefill_tokens": run.computed_prefill_tokens,
            "prefill_seconds": run.prefill_seconds,
            "ttft_p50_ms": run.ttft_p50_ms,
            "outputs_match_no_cache": match,
            "rounds": [summary.to_json() for summary in run.rounds()],
            # (round, TTFT ms) of every request, in request order: p50s over any rounds.
            "request_ttft_ms": [
                [result.round, 1e3 * result.ttft_s] for _, result in sorted(run.requests.items())
            ],
            "outputs_match_detail": detail,
            "kda_prefill_seconds": run.kda_prefill_seconds,
            "unit": policy.unit,
            "block_size": policy.block_size,
            "retention": policy.describe(),
            "steps": run.steps,
            "decode_steps": run.decode_steps,
            "decode_fallbacks": run.decode_fallbacks,
            "aborted_steps": run.aborted_steps,
            "overlap": run.overlap,
            "cascaded_aborts": run.cascaded_aborts,
            "holds": run.holds,
            "held_requests": run.held_requests,
            "held_pending_tokens": run.held_pending_tokens,
            "forward_seconds": run.forward_seconds,
            "host_seconds": run.host_seconds,
            "hidden_host_seconds": run.hidden_host_seconds,
            "preemptions": run.preemptions,
            "kda_timing_underruns": run.kda_timing_underruns,
            "seconds": run.seconds,
            "step_times": step_times,
            "manager_stats": run.manager_stats,
        }

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` document (the issue's shape; extra keys are additions).

        With ``repeats`` above 1 a repeated policy's entry is its median pass, plus ``passes``
        (every pass's entry, in pass order, each with its ``pass`` number and its ``position``
        in the order the runs ran), ``median_pass`` (its number), ``median`` (the median over
        the passes of each of ``REPEATED_FIGURES``) and ``spread`` (their max / min - 1); the
        document adds ``repeats`` and ``pass_order`` ([pass, policy] as they ran).
        """
        policies: dict[str, Any] = {}
        position = {entry: k for k, entry in enumerate(self.order)}
        for name, run in self.runs.items():
            entry = self._policy_json(name, run, self.step_times.get(name, {}), self.matches[name])
            passes = self.passes.get(name, [])
            if self.repeats > 1 and passes:
                entry["passes"] = [
                    {"pass": k, "position": position[(k, name)], **self._policy_json(name, *kept)}
                    for k, kept in enumerate(passes, 1)
                ]
                entry["median_pass"] = self.median_pass(name) + 1
                entry["median"] = {
                    key: statistics.median(getattr(r, key) for r, _, _ in passes)
                    for key in REPEATED_FIGURES
                }
                entry["spread"] = {
                    key: _spread([getattr(r, key) for r, _, _ in passes])
                    for key in REPEATED_FIGURES
                }
            policies[name] = entry
        document: dict[str, Any] = {
            "workload": self.workload,
            "preset": self.preset,
            "device": self.device,
            "backend": self.backend,
            "policies": policies,
            "geometry": {
                "block_size": self.geometry.block_size,
                "fine_unit": self.geometry.unit,
                "token_budget": self.geometry.token_budget,
                "max_running": self.geometry.max_running,
            },
            "model": {
                "name": self.model.name,
                "layers": list(self.model.layers),
                "hidden_size": self.model.hidden_size,
                "kda_heads": self.model.kda_heads,
                "kda_head_dim": self.model.kda_head_dim,
                "attention_heads": self.model.attention_heads,
                "attention_kv_heads": self.model.attention_kv_heads,
                "mlp_hidden_size": self.model.mlp_hidden_size,
                "vocab_size": self.model.vocab_size,
                "macs_per_token": self.model.macs_per_token(),
                "dtype": self.dtype,
            },
            "outputs_rtol": self.rtol,
            "kda_timing": self.kda_timing,
            "conv": self.conv,
            "decode_attention": self.decode_attention,
            "split_prefill": self.split_prefill,
            "cuda_graphs": self.cuda_graphs,
            "warm_up": self.warm_up,
            "warm_order": self.warm_order,
            "pools": None
            if self.engine_config is None
            else {
                "paged_blocks": self.engine_config.paged_blocks,
                "state_blocks": self.engine_config.state_blocks,
                "checkpoint_cap": self.engine_config.checkpoint_cap,
            },
        }
        if self.repeats > 1:
            document["repeats"] = self.repeats
            document["pass_order"] = [[k, name] for k, name in self.order]
        return document


#: The prefill steps :meth:`StepClock.summary` splits into parts: those of at most this many
#: tokens (a growing-prefix round's new turn; a first round's chunks of the 8,192-token
#: budget are left out, they would decide a fit on their own).
PART_STEP_TOKENS = 4096


class StepClock:
    """The engine's forward, with each step's time recorded by its shape.

    A step whose rows all have one query token (a decode step) goes to :attr:`decode_ms`, any
    other to :attr:`prefill` as (tokens, ms). On CUDA the time is the GPU's between two events
    recorded around the forward (nothing waits for them, so an overlapped engine stays
    overlapped; :meth:`summary` reads them), elsewhere the wall clock. With decode graphs,
    :meth:`summary` also counts the graphs captured since the clock was made.

    A prefill step is also split where the model starts launching its layers
    (``HybridModel.layers_starting``): ``prep`` is the host's time before that (the step's
    checks and uploads, while the GPU waits in a step that nothing overlaps), ``launch`` the
    host's time from there until the forward returns, ``layers`` the GPU's time from there to
    the forward's end (on the CPU, ``launch`` again). A ``layers`` time that follows
    ``launch`` says the GPU waited for the host's launches.
    """

    def __init__(self, model: HybridModel) -> None:
        self.model = model
        self._captures = None if model.graphs is None else model.graphs.captures
        self.decode_ms: list[float] = []
        self.prefill: list[tuple[int, float]] = []
        #: Prefill steps' (tokens, prep ms, launch ms, layers ms).
        self.parts: list[tuple[int, float, float, float]] = []
        self._pending: list[tuple[int | None, Any, Any]] = []
        self._pending_parts: list[tuple[int, float, float, Any, Any]] = []

    def __call__(
        self, step: Step, token_ids: torch.Tensor, caches: Any, logits_indices: np.ndarray
    ) -> torch.Tensor:
        tokens = step.prefill_tokens
        cuda = self.model.device.type == "cuda"
        marks: list[tuple[float, Any]] = []

        def layers_starting() -> None:
            event = None
            if cuda:
                event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                event.record()
            marks.append((time.perf_counter(), event))

        if tokens is not None:
            self.model.layers_starting = layers_starting
        begin = end = None
        if cuda:
            begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record()
        start = time.perf_counter()
        try:
            logits = self.model.execute(step, token_ids, caches, logits_indices)
        finally:
            self.model.layers_starting = None
        if end is not None:
            end.record()
        finish = time.perf_counter()
        if cuda:
            self._pending.append((tokens, begin, end))
        else:
            self._add(tokens, 1e3 * (finish - start))
        if tokens is not None and marks:
            at, event = marks[0]
            prep, launch = 1e3 * (at - start), 1e3 * (finish - at)
            if cuda:
                self._pending_parts.append((tokens, prep, launch, event, end))
            else:
                self.parts.append((tokens, prep, launch, launch))
        return logits

    def _add(self, tokens: int | None, ms: float) -> None:
        if tokens is None:
            self.decode_ms.append(ms)
        else:
            self.prefill.append((tokens, ms))

    def _collect(self) -> None:
        if self._pending:
            self._pending[-1][2].synchronize()
            for shape, begin, end in self._pending:
                self._add(shape, float(begin.elapsed_time(end)))
            self._pending.clear()
        for tokens, prep, launch, begin, end in self._pending_parts:
            self.parts.append((tokens, prep, launch, float(begin.elapsed_time(end))))
        self._pending_parts.clear()

    def summary(self) -> dict[str, Any]:
        """Counts, medians and means; for the other steps also the least-squares fit
        ``fixed_ms + per_token_us * tokens`` (what a schedule model prices a step at), and
        ``prefill_parts``: the prep, launch and layers times (class docstring) of the prefill
        steps of at most :data:`PART_STEP_TOKENS` tokens, each with its median and fit."""
        self._collect()
        out: dict[str, Any] = {
            "decode_steps": len(self.decode_ms),
            "prefill_steps": len(self.prefill),
        }
        if self._captures is not None and self.model.graphs is not None:
            out["graph_captures"] = self.model.graphs.captures - self._captures
        if self.decode_ms:
            out["decode_ms_p50"] = statistics.median(self.decode_ms)
            out["decode_ms_mean"] = statistics.fmean(self.decode_ms)
        if self.prefill:
            tokens = np.asarray([t for t, _ in self.prefill], dtype=float)
            ms = np.asarray([m for _, m in self.prefill], dtype=float)
            out["prefill_ms_p50"] = float(np.median(ms))
            out["prefill_tokens_p50"] = float(np.median(tokens))
            out.update(_fit(tokens, ms, "prefill_fixed_ms", "prefill_per_token_us"))
        short = [part for part in self.parts if part[0] <= PART_STEP_TOKENS]
        if short:
            tokens = np.asarray([p[0] for p in short], dtype=float)
            parts: dict[str, Any] = {"steps": len(short), "max_tokens": PART_STEP_TOKENS}
            parts["tokens_p50"] = float(np.median(tokens))
            for k, name in enumerate(("prep", "launch", "layers"), start=1):
                ms = np.asarray([p[k] for p in short], dtype=float)
                parts[name] = {"ms_p50": float(np.median(ms)), **_fit(tokens, ms)}
            out["prefill_parts"] = parts
        return out


def _fit(
    tokens: np.ndarray,
    ms: np.ndarray,
    fixed: str = "fixed_ms",
    per_token: str = "per_token_us",
) -> dict[str, float]:
    """The least-squares line ``ms = fixed + per_token * tokens`` (per token in microseconds),
    or nothing when the tokens do not vary."""
    if len(tokens) < 2 or float(tokens.std()) == 0:
        return {}
    slope, intercept = np.polyfit(tokens, ms, 1)
    return {fixed: float(intercept), per_token: 1e3 * float(slope)}


ProgressFactory = Callable[[str, int], Callable[[RequestResult], None]]


def simulate(
    workload: PresetWorkload,
    policies: Sequence[str],
    model: HybridModel,
    *,
    device_name: str = "cpu",
    backend_name: str = "auto",
    engine_config: EngineConfig | None = None,
    progress: ProgressFactory | None = None,
    on_policy: Callable[[SimulationReport], None] | None = None,
    reference: bool = True,
    warm_up: bool | WarmUp | None = None,
    observe: Callable[[pc.CacheManager], Callable[[], object]] | None = None,
    overlap: bool = True,
    repeats: int = 1,
    warm_order: Sequence[str] | None = None,
) -> SimulationReport:
    """Run ``none`` (first: it is the reference) and the other ``policies``, in their order.

    With ``reference=False`` the ``none`` run is skipped unless ``policies`` names it, and the
    other policies' outputs are not checked (their match is ``None``): for timing runs whose
    reference was checked in another run.

    ``warm_up`` first runs each policy unmeasured, so that no measured run pays the first
    calls' one-time costs (kernel loading and compilation, allocator growth, per-shape set-up):
    otherwise whichever policy runs first, or meets a shape first, is charged them.
    ``"full"`` (the default on a GPU) runs the measured workload itself, so a second pass is
    what is measured (twice the time); ``"shapes"`` (``True``) runs :func:`warm_up_workload`,
    which reaches the measured workload's longest context and fills its chunk budget but, on the
    H200, still left the first measured policy up to twice as slow (docs/BENCHMARKS.md);
    ``"none"`` (``False``; the default on the CPU) runs nothing.

    The geometry is the preset's, with U raised to the backend's checkpoint alignment when
    needed (:meth:`Geometry.aligned`, the core's ``aligned_geometry``).
    ``progress(policy, num_requests)`` returns a callback called for every finished request;
    ``on_policy(report)`` is called after each policy's run (the report then holds the
    policies run so far, each checked), so a long run's finished policies can be saved before
    the next one starts. ``observe`` is handed to every measured run's :class:`Engine` (an
    event publisher or a metrics endpoint following each run's manager). ``overlap`` runs the
    engine overlapped (``EngineConfig.overlap``; ignored with an ``engine_config``, which says).

    ``repeats`` (1 to ``MAX_REPEATS``) measures the policies that many times after the warm
    pass, counterbalanced (:func:`measured_order`: block, fine, fine, block, ...), each run on
    zeroed caches, to tell an effect of the order from run-to-run spread in one process; the
    ``none`` reference runs once, first (it is repeated only when it is the only policy), and every
    pass is checked against it. The report keeps every pass and heads each policy with its
    median pass (:meth:`SimulationReport.median_pass`); ``on_policy`` is called after every run.

    Every run, warm or measured, gets the same set of caches, zeroed
    (:meth:`HybridModel.reusing_caches`; the ``"shapes"`` warm pass runs on the measured
    pools): no measured run allocates caches, frees the previous run's or captures a decode
    graph the warm pass captured (each pass's ``step_times`` count its ``graph_captures``, and
    the time and count of Python's garbage collections inside it, and its ``pass_state``:
    :func:`pass_state` at its start and end).

    ``warm_order`` runs the warm pass in another order than the measured runs (default: the
    same order): it names each measured policy once, ``none`` optional (the measured ``none``
    reference is then warmed first). It tells an effect of the first warm policy from one of the
    first measured policy (``--warm-order block,fine --policies fine,block``). ``ValueError``
    for another set of policies, or with no warm pass.
    """
    repeats = check_repeats(repeats)
    names = measured_names(policies, reference=reference)
    mode = resolve_warm_up(warm_up, model.device)
    warm_names = check_warm_order(names, warm_order, mode)
    geometry = workload.geometry.aligned(model.backend.checkpoint_alignment)
    config = engine_config or engine_config_for(workload, geometry, model.backend, overlap=overlap)
    rtol = FLOAT32_RTOL if model.dtype in (torch.float32, torch.float64) else LOW_PRECISION_RTOL
    report = SimulationReport(
        workload=workload.name,
        preset=workload.preset,
        device=device_name,
        backend=model.backend.name if backend_name == "auto" else backend_name,
        geometry=geometry,
        model=model.config,
        dtype=str(model.dtype).removeprefix("torch."),
        rtol=rtol,
        engine_config=config,
        kda_timing=model.kda_timer.mode,
        conv=model.backend.conv_impl,
        decode_attention=model.decode_attention,
        split_prefill=model.split_prefill,
        cuda_graphs=model.graphs is not None,
        repeats=repeats,
    )
    report.warm_up = mode
    report.warm_order = warm_names
    try:
        with model.reusing_caches():
            _warm_up(model, warm_names, workload, geometry, config, mode)
            _measure(
                report,
                model,
                names,
                workload,
                geometry,
                config,
                repeats,
                progress,
                on_policy,
                observe,
            )
    finally:
        gc.unfreeze()
    return report


def measured_names(policies: Sequence[str], *, reference: bool = True) -> list[str]:
    """The policies :func:`simulate` measures, in order: ``none`` first (the reference, unless
    ``reference`` is false and ``policies`` does not name it), then the others as asked for.
    ``ValueError`` for an unknown name."""
    unknown = [name for name in policies if name not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose among {', '.join(POLICY_NAMES)}")
    names = ["none"] if reference or "none" in policies else []
    return names + [name for name in dict.fromkeys(policies) if name != "none"]


def resolve_warm_up(warm_up: bool | WarmUp | None, device: torch.device) -> WarmUp:
    """:func:`simulate`'s ``warm_up`` as a mode (``None``: ``"full"`` on CUDA, else ``"none"``;
    ``True``: ``"shapes"``; ``False``: ``"none"``), ``ValueError`` for anything else."""
    if warm_up is None:
        return "full" if device.type == "cuda" else "none"
    if isinstance(warm_up, bool):
        return "shapes" if warm_up else "none"
    if warm_up in WARM_UPS:
        return warm_up
    raise ValueError(f"warm_up must be one of {', '.join(WARM_UPS)}, got {warm_up!r}")


def check_warm_order(
    names: Sequence[str], warm_order: Sequence[str] | None, mode: WarmUp
) -> list[str]:
    """The warm pass's policies in order: ``names`` (the measured ones, :func:`measured_names`)
    unless ``warm_order`` says otherwise (:func:`simulate`); empty for ``mode`` ``"none"``."""
    if mode == "none":
        if warm_order is not None:
            raise ValueError("a warm order needs a warm pass (warm-up shapes or full)")
        return []
    if warm_order is None:
        return list(names)
    order = list(warm_order)
    unknown = [name for name in order if name not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown} in the warm order")
    if len(set(order)) != len(order):
        raise ValueError(f"the warm order names a policy twice: {order}")
    if "none" in names and "none" not in order:
        order.insert(0, "none")  # the reference is warmed first, as it is measured first
    if sorted(order) != sorted(names):
        raise ValueError(
            f"the warm order {list(warm_order)} must name the measured policies {list(names)} "
            "once each (none optional)"
        )
    return order


def pass_state(device: torch.device) -> dict[str, Any]:
    """What a measured pass starts (or ends) with that could make it slower than another.

    The process: CPU seconds, minor and major page faults, voluntary and involuntary context
    switches, resident-set peak (KiB), Python's allocated blocks and its collector's three
    generation counts. On CUDA also the caching allocator (``torch.cuda.memory_stats``):
    reserved, allocated and active bytes, segments, its retries and OOMs, device allocations and
    frees (cudaMalloc / cudaFree) and the allocated peak since the last reset (a pass resets
    it at its start).
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    state: dict[str, Any] = {
        "cpu_seconds": usage.ru_utime + usage.ru_stime,
        "minor_faults": usage.ru_minflt,
        "major_faults": usage.ru_majflt,
        "voluntary_switches": usage.ru_nvcsw,
        "involuntary_switches": usage.ru_nivcsw,
        "max_rss_kib": usage.ru_maxrss,
        "python_blocks": sys.getallocatedblocks(),
        "python_frozen": gc.get_freeze_count(),
        "gc_counts": list(gc.get_count()),
    }
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        for key, name in _CUDA_STATS:
            state[name] = int(stats.get(key, -1))
    return state


#: ``torch.cuda.memory_stats`` keys kept by :func:`pass_state`, with their names there.
_CUDA_STATS = (
    ("reserved_bytes.all.current", "cuda_reserved_bytes"),
    ("allocated_bytes.all.current", "cuda_allocated_bytes"),
    ("active_bytes.all.current", "cuda_active_bytes"),
    ("allocated_bytes.all.peak", "cuda_allocated_peak_bytes"),
    ("segment.all.current", "cuda_segments"),
    ("num_alloc_retries", "cuda_alloc_retries"),
    ("num_ooms", "cuda_ooms"),
    ("num_device_alloc", "cuda_device_allocs"),
    ("num_device_free", "cuda_device_frees"),
)


def _pass_states(start: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    """A pass's ``pass_state``: its start, its end and the change of each count."""
    change = {
        key: end[key] - start[key]
        for key in start
        if isinstance(start[key], int | float) and key != "max_rss_kib"
    }
    return {"start": start, "end": end, "change": change}


def _measure(
    report: SimulationReport,
    model: HybridModel,
    names: list[str],
    workload: PresetWorkload,
    geometry: Geometry,
    config: EngineConfig,
    repeats: int,
    progress: ProgressFactory | None,
    on_policy: Callable[[SimulationReport], None] | None,
    observe: Callable[[pc.CacheManager], Callable[[], object]] | None,
) -> None:
    """The measured runs of :func:`simulate`, recorded in ``report``."""
    rtol = report.rtol
    for name in measured_order(names, repeats):
        policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
        clock = StepClock(model)
        engine = Engine(model, policy, config, forward=clock, observe=observe)
        callback = None if progress is None else progress(name, workload.spec.num_requests)
        _settle_heap()
        requests = workload.build(model.config.vocab_size)
        if model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(model.device)
        started = pass_state(model.device)
        with _GcClock() as collections:
            run = engine.run(requests, on_finished=callback)
        states = {"pass_state": _pass_states(started, pass_state(model.device))}
        report.policies[name] = policy
        match: tuple[bool | None, str] = (None, "not checked: run without the none reference")
        if name == "none" and "none" not in report.passes:
            match = outputs_match(run, run, rtol, tie_aware=rtol > FLOAT32_RTOL)
        elif "none" in report.passes:
            match = outputs_match(
                run, report.passes["none"][0][0], rtol, tie_aware=rtol > FLOAT32_RTOL
            )
        report.add_pass(name, run, clock.summary() | collections.summary() | states, match)
        if on_policy is not None:
            on_policy(report)


def measured_order(names: Sequence[str], repeats: int) -> list[str]:
    """The measured runs of :func:`simulate` in the order they run: ``none`` once, first (the
    reference, when ``names`` holds it with other policies), then ``repeats`` passes of the
    others, counterbalanced: every second pass runs them in the reverse order (block, fine, fine,
    block, block, fine, ...), so that over an even number of passes each policy's mean position
    in the process is the same, whichever it runs first. A process whose runs slow down (or
    speed up) steadily over its life, as the H200's did by 4 to 8% a run (docs/BENCHMARKS.md),
    then charges the drift to every policy alike instead of to the one measured last."""
    repeated = [name for name in names if name != "none"] or list(names)
    once = [name for name in names if name not in repeated]
    order = list(once)
    for k in range(repeats):
        order += repeated if k % 2 == 0 else repeated[::-1]
    return order


def _settle_heap() -> None:
    """Before a run: collect the previous runs' garbage, then freeze what is left (their
    results, the model, the caches) out of the collector's sight (``gc.freeze``), so that the
    run's collections scan its own objects only and none of them grows with the runs before it.
    Serving engines do the same after start-up (vLLM freezes its heap once warm). The heap is
    unfrozen when :func:`simulate` returns."""
    gc.collect()
    gc.freeze()


class _GcClock:
    """Python's garbage collections while open: their count and their time in seconds."""

    def __init__(self) -> None:
        self.collections = 0
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.collections += 1
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> _GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        return {"gc_collections": self.collections, "gc_seconds": self.seconds}


def warm_up_workload(workload: PresetWorkload, geometry: Geometry) -> PresetWorkload:
    """The workload of the ``"shapes"`` warm pass: what each policy meets, at a fraction of it.

    Two streams (so steps hold one and two rows, and two sequences decode together) of two
    rounds, in the measured workload's geometry; the first prompt is as long as the measured
    workload's longest sequence less one round of growth, so the warm pass reaches its longest
    context (the largest attention gathers and allocations), fills the chunk budget (full-size
    chunks, then a last partial one), resumes from checkpoints at a hit, and decodes.
    """
    block, unit = geometry.block_size, geometry.unit
    growth = block // 2 + 5
    output_len = 3
    longest = workload.spec.longest_sequence()
    first = max(2 * block + unit + 7, longest - growth - output_len)
    spec = GrowingPrefixSpec(
        streams=2, first_prompt=first, growth=growth, rounds=2, output_len=output_len
    )
    return PresetWorkload(workload.name, "warm-up", spec, geometry)


def _warm_up(
    model: HybridModel,
    names: Sequence[str],
    workload: PresetWorkload,
    geometry: Geometry,
    config: EngineConfig,
    mode: WarmUp,
) -> None:
    """Each policy over the warm workload, on fresh caches, results discarded: the measured
    workload itself (``"full"``) or :func:`warm_up_workload` (``"shapes"``)."""
    if mode == "none":
        return
    if mode == "full":
        warm, warm_config = workload, config
    else:
        warm = warm_up_workload(workload, geometry)
        warm_config = engine_config_for(
            warm, geometry, model.backend, check=config.check, overlap=config.overlap
        )
        # On the measured pools when they hold the warm workload's (they do for the presets):
        # the measured runs then get the warm pass's caches and its decode graphs.
        if (
            config.paged_blocks >= warm_config.paged_blocks
            and config.state_blocks >= warm_config.state_blocks
        ):
            warm_config = dataclasses.replace(
                warm_config, paged_blocks=config.paged_blocks, state_blocks=config.state_blocks
            )
    timer = model.kda_timer
    backlog, underruns = timer.backlog_cycles, timer.underruns
    for name in names:
        policy = Policy.named(name, block_size=geometry.block_size, fine_unit=geometry.unit)
        _settle_heap()
        Engine(model, policy, warm_config).run(warm.build(model.config.vocab_size))
    timer.take()
    timer.backlog_cycles, timer.underruns = backlog, underruns
