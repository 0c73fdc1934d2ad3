"""What a run of the engine produces: per-request results, per-round and per-run summaries.

:class:`RequestResult` records what happened to one request (its hit, the prefill tokens it
computed, its time to first token, its generated ids and final logits); :class:`RunResult`
gathers them with the run's counters. :func:`outputs_match` compares two runs request by
request (generated ids equal, final logits within a relative tolerance), which is how a caching
policy is checked against the no-cache run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestResult", "RoundSummary", "RunResult", "outputs_match", "relative_difference"]


@dataclass
class RequestResult:
    """One finished request.

    Attributes:
        request_id, round, prompt_len: from the request.
        hit_tokens: prompt tokens taken from the cache at its first (committed) admission.
        computed_prefill_tokens: tokens computed in prefill steps, recomputation after a
            preemption included (without preemption: ``prompt_len - hit_tokens``).
        prefill_seconds: its share of the forward time of the steps it prefilled in
            (each step's time split by scheduled tokens).
        kda_prefill_seconds: the same share of the time spent in the KDA kernels.
        ttft_s: arrival to first token, seconds.
        output_ids: the generated token ids.
        final_logits: float32 logits the last generated token was sampled from.
        margins: for each generated token, the gap between its logit and the runner-up's,
            relative to the largest absolute logit (how close greedy sampling was to a tie).
        preemptions: how often it was preempted (and recomputed).
    """

    request_id: int
    round: int
    prompt_len: int
    hit_tokens: int
    computed_prefill_tokens: int
    prefill_seconds: float
    kda_prefill_seconds: float
    ttft_s: float
    output_ids: list[int]
    final_logits: np.ndarray
    margins: list[float]
    preemptions: int


@dataclass(frozen=True)
class RoundSummary:
    """Totals of the requests of one round."""

    round: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    computed_prefill_tokens: int
    prefill_seconds: float
    kda_prefill_seconds: float
    ttft_p50_ms: float

    def to_json(self) -> dict[str, Any]:
        """The round's entry in ``--json`` (the issue's keys first)."""
        return {
            "round": self.round,
            "hit_tokens": self.hit_tokens,
            "computed_prefill_tokens": self.computed_prefill_tokens,
            "ttft_p50_ms": self.ttft_p50_ms,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "prefill_seconds": self.prefill_seconds,
            "kda_prefill_seconds": self.kda_prefill_seconds,
        }


def _p50_ms(values: list[float]) -> float:
    return 1000.0 * statistics.median(values) if values else 0.0


@dataclass
class RunResult:
    """Everything one policy's run produced.

    Attributes:
        policy: the policy's name.
        requests: results by request id.
        seconds: wall time of the run.
        steps: forward steps committed.
        overlap: whether the run overlapped steps (``EngineConfig.overlap``).
        aborted_steps: steps whose forward raised (aborted, then retried).
        cascaded_aborts: overlapped, plans in flight after a failed one, aborted with it.
        decode_steps: steps planned by ``decode_step`` (the fast path: commit, append,
            schedule and plan in one call; overlapped, ``decode_step_overlapped``).
        decode_fallbacks: fast-path plans the pools could not supply a sequence's block in:
            not overlapped, aborted (the step was then scheduled the general way, with
            preemption); overlapped, run without that sequence (scheduled later).
        preemptions: preemptions (sequences released to make room, recomputed later).
        kda_timing_underruns: KDA blocks timed in ``"gpu"`` mode whose launches outlasted the
            backlog (their time includes idle GPU time; see ``prefixcache.models.timing``).
        manager_stats: the cache manager's statistics at the end (as a dict).
        forward_seconds: wall time of the forwards (sampling and the copy of the logits to
            the host included; overlapped, the worker's whole job, its placeholder tokens
            filled in too; on CUDA overlapped, the GPU time between two events).
        wait_seconds: wall time the host waited for forwards (not overlapped: all of it).
        holds: overlapped, request-steps a waiting request was held because a plan in flight
            was computing a longer prefix of it than the cache held (``lookup``'s
            ``pending_tokens`` above its ``tokens``), instead of recomputing that prefix.
        held_requests: requests held at least once.
        held_pending_tokens: over the held requests, the prefix tokens in flight beyond
            their hit when first held (what admitting them then would have recomputed).
    """

    policy: str
    requests: dict[int, RequestResult] = field(default_factory=dict)
    seconds: float = 0.0
    steps: int = 0
    aborted_steps: int = 0
    decode_steps: int = 0
    decode_fallbacks: int = 0
    preemptions: int = 0
    kda_timing_underruns: int = 0
    manager_stats: dict[str, Any] = field(default_factory=dict)
    overlap: bool = False
    cascaded_aborts: int = 0
    forward_seconds: float = 0.0
    wait_seconds: float = 0.0
    holds: int = 0
    held_requests: int = 0
    held_pending_tokens: int = 0

    @property
    def host_seconds(self) -> float:
        """Wall time the host worked (scheduling, planning, inputs, commits): not waiting."""
        return self.seconds - self.wait_seconds

    @property
    def hidden_host_seconds(self) -> float:
        """Host time hidden behind forwards: the host's time less the time the forwards
        waited for it (``seconds - forward_seconds``); 0 when nothing overlaps."""
        return self.host_seconds - (self.seconds - self.forward_seconds)

    @property
    def prompt_tokens(self) -> int:
        """Sum of prompt lengths."""
        return sum(r.prompt_len for r in self.requests.values())

    @property
    def hit_tokens(self) -> int:
        """Sum of hits."""
        return sum(r.hit_tokens for r in self.requests.values())

    @property
    def computed_prefill_tokens(self) -> int:
        """Sum of prefill tokens computed."""
        return sum(r.computed_prefill_tokens for r in self.requests.values())

    @property
    def prefill_seconds(self) -> float:
        """Forward time attributed to prefill."""
        return math.fsum(r.prefill_seconds for r in self.requests.values())

    @property
    def kda_prefill_seconds(self) -> float:
        """KDA kernel time attributed to prefill."""
        return math.fsum(r.kda_prefill_seconds for r in self.requests.values())

    @property
    def ttft_p50_ms(self) -> float:
        """Median time to first token, milliseconds."""
        return _p50_ms([r.ttft_s for r in self.requests.values()])

    def rounds(self) -> list[RoundSummary]:
        """Per-round totals, in round order."""
        by_round: dict[int, list[RequestResult]] = {}
        for result in self.requests.values():
            by_round.setdefault(result.round, []).append(result)
        return [
            RoundSummary(
                round=number,
                requests=len(items),
                prompt_tokens=sum(r.prompt_len for r in items),
                hit_tokens=sum(r.hit_tokens for r in items),
                computed_prefill_tokens=sum(r.computed_prefill_tokens for r in items),
                prefill_seconds=math.fsum(r.prefill_seconds for r in items),
                kda_prefill_seconds=math.fsum(r.kda_prefill_seconds for r in items),
                ttft_p50_ms=_p50_ms([r.ttft_s for r in items]),
            )
            for number, items in sorted(by_round.items())
        ]


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    """``max |a - b| / max |b|``: 0 when both are zero, inf on a shape mismatch or when either
    holds a NaN or an infinity (so a poisoned value never passes a tolerance check)."""
    if a.shape != b.shape:
        return float("inf")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    if a.size == 0:
        return 0.0
    scale = float(np.max(np.abs(b)))
    difference = float(np.max(np.abs(a.astype(np.float64) - b)))
    if scale == 0.0:
        return 0.0 if difference == 0.0 else float("inf")
    return difference / scale


def _first_difference(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def outputs_match(
    run: RunResult, reference: RunResult, rtol: float, *, tie_aware: bool = False
) -> tuple[bool, str]:
    """Whether ``run`` reproduced ``reference``, with the reason when not.

    Every request must have generated the same ids and final logits within ``rtol``
    (:func:`relative_difference`). With ``tie_aware`` (low-precision runs), ids may diverge at a
    position where the reference's top two logits were within ``rtol`` of each other (a
    near-tie that rounding may flip); that request is not compared beyond it.
    """
    if set(run.requests) != set(reference.requests):
        missing = sorted(set(reference.requests) ^ set(run.requests))[:5]
        return False, f"the runs finished different requests (e.g. {missing})"
    ties = 0
    for request_id, expected in sorted(reference.requests.items()):
        got = run.requests[request_id]
        if got.output_ids != expected.output_ids:
            position = _first_difference(got.output_ids, expected.output_ids)
            near_tie = position < len(expected.margins) and expected.margins[position] <= rtol
            if tie_aware and near_tie:
                ties += 1
                continue
            return False, (
                f"request {request_id}: generated ids {got.output_ids} instead of "
                f"{expected.output_ids} (first difference at output {position})"
            )
        difference = relative_difference(got.final_logits, expected.final_logits)
        if difference > rtol:
            return False, (
                f"request {request_id}: final logits differ by {difference:.2e} relative "
                f"(tolerance {rtol:.0e})"
            )
    if ties:
        return True, f"every request matches ({ties} diverged at a near-tie, compared up to it)"
    return True, "every request matches"
