"""Checkpoints by chaining kernel calls over segments, for kernels that export few or none.

A kernel that cannot write interior states (``flash_kda.fwd``, fla in exact mode) or writes one
per sequence per call (FlashKDA's op) still serves any plan: each row is cut into segments at its
checkpoints, and the i-th segments of all rows form *round* i, packed into one varlen call. A
segment ends at a cut whose slot receives the call's final state; with ``per_call = 1`` a segment
spans two cuts and the kernel exports the first of them itself. The next round starts each row
from the slot the previous round wrote, read back from the cache, so the result is exactly that of
forwards split at the same offsets (on the kernel's chunk grid, also exactly that of one run).

A round that covers whole rows in order runs on the inputs in place; a round whose segments are
back to back runs on slices; other rounds gather their tokens (and scatter the outputs back). The
kernel writes its outputs into the step's output tensor where the round's tokens lie together.
A round whose initial slots are consecutive (ascending, none -1) hands the kernel that stretch
of the cache as its initial states, and one whose final (or exported) slots are consecutive has
the kernel write them there: no state moves. The plan check guarantees that no slot a step
writes is one it reads, so those views never overlap. A round of one row always qualifies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .backend import read_states_at, upload, write_states_at
from .plan import StatePlan

__all__ = [
    "KernelCall",
    "Round",
    "Segment",
    "SegmentBatch",
    "plan_rounds",
    "run_rounds",
]


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
    # Where the call should write (a kernel that cannot returns its own tensors, which are then
    # copied there): outputs [1, n, H, V], final states and interior states [N, H, V, K]; these
    # may be views of the step's output and of the state cache.
    out: torch.Tensor | None = None
    final_state: torch.Tensor | None = None
    checkpoint_state: torch.Tensor | None = None


# A kernel call returns (o [1, n, H, V], final states [N, H, V, K], interior states or None).
KernelCall = Callable[[SegmentBatch], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


def plan_rounds(plan: StatePlan, per_call: int, rows: tuple[int, ...] | None = None) -> list[Round]:
    """Cut every row (of ``rows``, ascending; default all) into segments ending at its cuts;
    ``per_call`` (0 or 1) interior exports.

    Computed once per plan (every layer of a step gets the same list: do not modify it).
    """
    if per_call not in (0, 1):
        raise ValueError(f"per_call must be 0 or 1, got {per_call}")
    chosen = tuple(range(plan.num_rows)) if rows is None else rows
    return plan.derived(("rounds", per_call, chosen), lambda: _cut_rounds(plan, per_call, chosen))


def _cut_rounds(plan: StatePlan, per_call: int, rows: tuple[int, ...]) -> list[Round]:
    by_round: list[list[Segment]] = []
    for row in rows:
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


def _first_of_run(slots: list[int]) -> int | None:
    """``slots[0]`` when ``slots`` are consecutive ascending slots (none -1), else None."""
    if slots and slots[0] >= 0 and all(b == a + 1 for a, b in itertools.pairwise(slots)):
        return slots[0]
    return None


@dataclass(frozen=True)
class _RoundInputs:
    """One round's index arrays on the device, and how its tokens and states are laid out.

    ``whole``: the round covers every row entirely, in order (runs on the inputs in place);
    ``contiguous``: its segments are back to back (runs on a slice); otherwise ``token_index``
    gathers its tokens. ``exported_rows`` / ``exported_slots``: the segments whose interior
    checkpoint the kernel writes, and where it goes (None when there are none).
    ``initial_first`` / ``final_first`` / ``exported_first``: the first of the round's
    consecutive initial / final / exported slots (every segment exporting), else None.
    """

    whole: bool
    contiguous: bool
    token_index: torch.Tensor | None
    cu_seqlens: torch.Tensor
    cu_seqlens_host: torch.Tensor
    initial_slots: torch.Tensor
    final_slots: torch.Tensor
    checkpoint_offsets: torch.Tensor | None
    exported_rows: torch.Tensor | None
    exported_slots: torch.Tensor | None
    initial_first: int | None
    final_first: int | None
    exported_first: int | None

    @classmethod
    def build(cls, plan: StatePlan, round_: Round, device: torch.device) -> _RoundInputs:
        segments = round_.segments
        cu = [0]
        for s in segments:
            cu.append(cu[-1] + s.end - s.start)
        whole = len(segments) == plan.num_rows and all(
            s.row == r and s.start == plan.start(r) and s.end == plan.start(r + 1)
            for r, s in enumerate(segments)
        )
        contiguous = all(a.end == b.start for a, b in itertools.pairwise(segments))
        exported = [(i, s.interior) for i, s in enumerate(segments) if s.interior is not None]
        token_index = torch.empty(0, dtype=torch.int64)
        if not (whole or contiguous):
            token_index = torch.cat([torch.arange(s.start, s.end) for s in segments])
        initial = [s.initial_slot for s in segments]
        final = [s.final_slot for s in segments]
        exported_slots = [interior[1] for _, interior in exported]
        # Every index array of the round in one host-to-device copy.
        cu_d, initial_d, final_d, offsets_d, rows_d, slots_d, index_d = upload(
            device,
            cu,
            initial,
            final,
            [0 if s.interior is None else s.interior[0] for s in segments] if exported else [],
            [i for i, _ in exported],
            exported_slots,
            token_index,
        )
        return cls(
            whole=whole,
            contiguous=contiguous,
            token_index=index_d if token_index.numel() else None,
            cu_seqlens=cu_d,
            cu_seqlens_host=torch.tensor(cu, dtype=torch.int64),
            initial_slots=initial_d,
            final_slots=final_d,
            checkpoint_offsets=offsets_d if exported else None,
            exported_rows=rows_d if exported else None,
            exported_slots=slots_d if exported else None,
            initial_first=_first_of_run(initial),
            final_first=_first_of_run(final),
            exported_first=(
                _first_of_run(exported_slots) if len(exported) == len(segments) else None
            ),
        )


def _stretch(recurrent: torch.Tensor, first: int | None, count: int) -> torch.Tensor | None:
    """The cache rows ``first .. first + count - 1`` as one tensor, when there are such."""
    if first is None or not recurrent.is_contiguous():
        return None
    return recurrent[first : first + count]


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
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Execute ``rounds`` with ``call``, storing every state in the cache; returns ``o [T, H, V]``.

    Inputs are the backend-facing ``[T, H, *]`` tensors (``beta`` ``[T, H]``); initial states
    reach the kernel in ``state_dtype`` (fp32 for the GPU kernels). ``out`` (``[T, H, V]``,
    contiguous; default a new tensor in ``v``'s dtype) receives the rounds' rows' outputs;
    rows no round covers are left as they are.
    """
    device = q.device
    total = plan.num_tokens
    own_out = out is None
    if out is None:
        out = v.new_empty((total, v.shape[1], v.shape[2]))
    elif out.shape != (total, v.shape[1], v.shape[2]) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{total}, H, V], got {tuple(out.shape)}")
    # States go straight to and from the cache where the dtypes agree.
    states = recurrent if recurrent.dtype == state_dtype else None
    # The rounds' index arrays, uploaded once per plan: every layer of a step reuses them.
    pinned, inputs = plan.derived(
        ("round-inputs", device, id(rounds)),
        lambda: (rounds, [_RoundInputs.build(plan, r, device) for r in rounds]),
    )
    if pinned is not rounds:  # a different list under a recycled id: never reuse it
        inputs = [_RoundInputs.build(plan, r, device) for r in rounds]
    for round_, prepared in zip(rounds, inputs, strict=True):
        segments = round_.segments
        count = len(segments)
        whole, index_d = prepared.whole, prepared.token_index
        parts: tuple[torch.Tensor, ...]
        if whole:
            parts = (q, k, v, g, beta)
            destination = out
        elif prepared.contiguous:
            span = slice(segments[0].start, segments[-1].end)
            parts = (q[span], k[span], v[span], g[span], beta[span])
            destination = out[span]
        else:
            gather = index_d
            if gather is None:
                raise RuntimeError("a round whose segments are not contiguous has a token index")
            parts = tuple(x.index_select(0, gather) for x in (q, k, v, g, beta))
            destination = out.new_empty((gather.numel(), *out.shape[1:]))
        initial = None if states is None else _stretch(states, prepared.initial_first, count)
        if initial is None:
            initial = read_states_at(recurrent, prepared.initial_slots, state_dtype)
        final_view = None if states is None else _stretch(states, prepared.final_first, count)
        final_buffer = final_view if final_view is not None else torch.empty_like(initial)
        exported_view = None
        exported_buffer = None
        if prepared.exported_rows is not None:
            if states is not None:
                exported_view = _stretch(states, prepared.exported_first, count)
            exported_buffer = exported_view
            if exported_buffer is None:
                exported_buffer = torch.empty_like(initial)
        batch = SegmentBatch(
            q=parts[0].unsqueeze(0),
            k=parts[1].unsqueeze(0),
            v=parts[2].unsqueeze(0),
            g=parts[3].unsqueeze(0),
            beta=parts[4].unsqueeze(0),
            cu_seqlens=prepared.cu_seqlens,
            cu_seqlens_host=prepared.cu_seqlens_host,
            initial_state=initial,
            checkpoint_offsets=prepared.checkpoint_offsets,
            out=destination.unsqueeze(0),
            final_state=final_buffer,
            checkpoint_state=exported_buffer,
        )
        o, final, interior = call(batch)
        # A kernel that returned outputs of its own: take them where no copy is needed (a whole
        # round into an output of our own), else copy them to where they belong.
        result = destination if o is batch.out else o.squeeze(0)
        if index_d is not None:
            out.index_copy_(0, index_d, result)
        elif result is not destination:
            if whole and own_out:
                out = result
            else:
                destination.copy_(result)
        if prepared.exported_rows is not None and prepared.exported_slots is not None:
            if interior is None:
                raise RuntimeError("the kernel call returned no interior checkpoint states")
            if exported_view is None:
                write_states_at(
                    recurrent, prepared.exported_slots, interior, rows=prepared.exported_rows
                )
            elif interior is not exported_view:
                exported_view.copy_(interior)
        if final_view is None:
            write_states_at(recurrent, prepared.final_slots, final)
        elif final is not final_view:
            final_view.copy_(final)
    return out
