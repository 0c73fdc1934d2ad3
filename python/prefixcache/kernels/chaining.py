"""Checkpoints by chaining kernel calls over segments, for kernels that export few or none.

A kernel that cannot write interior states (``flash_kda.fwd``, fla in exact mode) or writes one
per sequence per call (FlashKDA's op) still serves any plan: each row is cut into segments at its
checkpoints, and the i-th segments of all rows form *round* i, packed into one varlen call. A
segment ends at a cut whose slot receives the call's final state; with ``per_call = 1`` a segment
spans two cuts and the kernel exports the first of them itself. The next round starts each row
from the slot the previous round wrote, read back from the cache, so the result is exactly that of
forwards split at the same offsets (on the kernel's chunk grid, also exactly that of one run).

A round that covers whole rows in order runs on the inputs in place; a round of one row runs on
slices; other rounds gather their tokens (and scatter the outputs back).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._convert import to_device
from .backend import read_states, write_states
from .plan import StatePlan

__all__ = ["KernelCall", "Round", "Segment", "SegmentBatch", "plan_rounds", "run_rounds"]


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` (packed-batch indices) of row ``row`` in one call.

    ``initial_slot`` holds its initial state (-1 = zero), ``interior`` is ``(offset from start,
    slot)`` of the checkpoint the kernel exports itself, if any, and ``final_slot`` receives the
    state at ``end``.
    """

    row: int
    start: int
    end: int
    initial_slot: int
    interior: tuple[int, int] | None
    final_slot: int


@dataclass(frozen=True)
class Round:
    """Segments executed by one varlen kernel call."""

    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class SegmentBatch:
    """One call's inputs: packed ``[1, n, H, *]`` tensors and per-sequence metadata."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor  # int64 [N+1], on the device
    cu_seqlens_host: torch.Tensor  # the same on the CPU
    initial_state: torch.Tensor  # [N, H, V, K], fp32 for the GPU kernels
    checkpoint_offsets: torch.Tensor | None  # int64 [N] (0 = none), with per_call = 1


# A kernel call returns (o [1, n, H, V], final states [N, H, V, K], interior states or None).
KernelCall = Callable[[SegmentBatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def plan_rounds(plan: StatePlan, per_call: int) -> list[Round]:
    """Cut every row into segments ending at its cuts; ``per_call`` (0 or 1) interior exports."""
    if per_call not in (0, 1):
        raise ValueError(f"per_call must be 0 or 1, got {per_call}")
    by_round: list[list[Segment]] = []
    for row in range(plan.num_rows):
        cuts = plan.cuts(row)
        start = plan.start(row)
        previous_offset, previous_slot = 0, plan.initial_slot[row]
        index = 0
        round_index = 0
        while index < len(cuts):
            interior = None
            if per_call == 1 and index + 1 < len(cuts):
                interior = (cuts[index].offset - previous_offset, cuts[index].slot)
                index += 1
            end = cuts[index]
            segment = Segment(
                row=row,
                start=start + previous_offset,
                end=start + end.offset,
                initial_slot=previous_slot,
                interior=interior,
                final_slot=end.slot,
            )
            if round_index == len(by_round):
                by_round.append([])
            by_round[round_index].append(segment)
            previous_offset, previous_slot = end.offset, end.slot
            index += 1
            round_index += 1
    return [Round(tuple(segments)) for segments in by_round]


def run_rounds(
    plan: StatePlan,
    rounds: list[Round],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    recurrent: torch.Tensor,
    call: KernelCall,
    state_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Execute ``rounds`` with ``call``, storing every state in the cache; returns ``o [T, H, V]``.

    Inputs are the backend-facing ``[T, H, *]`` tensors (``beta`` ``[T, H]``); initial states
    reach the kernel in ``state_dtype`` (fp32 for the GPU kernels).
    """
    device = q.device
    total = plan.num_tokens
    out: torch.Tensor | None = None
    for round_ in rounds:
        segments = round_.segments
        lengths = [s.end - s.start for s in segments]
        cu_host = torch.zeros(len(segments) + 1, dtype=torch.int64)
        cu_host[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        whole = len(segments) == plan.num_rows and all(
            s.row == r and s.start == plan.start(r) and s.end == plan.start(r + 1)
            for r, s in enumerate(segments)
        )
        contiguous = all(a.end == b.start for a, b in itertools.pairwise(segments))
        index: torch.Tensor | None = None
        parts: tuple[torch.Tensor, ...]
        if whole:
            parts = (q, k, v, g, beta)
        elif contiguous:
            span = slice(segments[0].start, segments[-1].end)
            parts = (q[span], k[span], v[span], g[span], beta[span])
        else:
            host_index = torch.cat([torch.arange(s.start, s.end) for s in segments])
            index = to_device(host_index, device)
            parts = tuple(x.index_select(0, index) for x in (q, k, v, g, beta))
        offsets = None
        if any(s.interior is not None for s in segments):
            host_offsets = torch.tensor(
                [0 if s.interior is None else s.interior[0] for s in segments]
            )
            offsets = to_device(host_offsets, device)
        batch = SegmentBatch(
            q=parts[0].unsqueeze(0),
            k=parts[1].unsqueeze(0),
            v=parts[2].unsqueeze(0),
            g=parts[3].unsqueeze(0),
            beta=parts[4].unsqueeze(0),
            cu_seqlens=to_device(cu_host, device),
            cu_seqlens_host=cu_host,
            initial_state=read_states(recurrent, [s.initial_slot for s in segments], state_dtype),
            checkpoint_offsets=offsets,
        )
        o, final, interior = call(batch)
        o = o.squeeze(0)
        if whole:
            out = o
        else:
            if out is None:
                out = o.new_empty((total, *o.shape[1:]))
            if index is not None:
                out.index_copy_(0, index, o)
            else:
                out[segments[0].start : segments[-1].end] = o
        exported = [(i, s.interior[1]) for i, s in enumerate(segments) if s.interior is not None]
        if exported:
            if interior is None:
                raise RuntimeError("the kernel call returned no interior checkpoint states")
            rows = to_device(torch.tensor([i for i, _ in exported]), device)
            write_states(recurrent, [slot for _, slot in exported], interior.index_select(0, rows))
        write_states(recurrent, [s.final_slot for s in segments], final)
    if out is None:
        raise ValueError("a plan has at least one row, so at least one round")
    return out
