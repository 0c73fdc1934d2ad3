"""Validation of step plans, snapshot lists and copy lists against a backend's rules.

A backend declares ``checkpoint_alignment`` (A) and ``max_checkpoints_per_step`` (C); the Rust
core's State group is configured from the same attributes. Every plan a backend receives is
checked here *before any slot is written*, and anything the backend would not execute exactly
raises :class:`KernelPlanError` (never a silent drop: FlashKDA's op, for one, silently skips an
unaligned offset, which would leave an allocated checkpoint block unwritten).

Rules for a state plan (``R`` rows, ``T`` tokens, ``num_slots`` state blocks):

- ``query_start_loc`` int32/int64 ``[R+1]``, starts at 0, strictly increasing, ends at ``T``;
- ``running_slot`` in ``[0, num_slots)``; ``initial_slot`` in ``[-1, num_slots)``, never equal to
  the row's running slot;
- ``checkpoint_offsets`` / ``checkpoint_slots`` ``[R, Cmax]``, padding ``(0, -1)``; a checkpoint
  has an offset the core calls exportable for A (``prefixcache.is_exportable_offset``: strictly
  inside the query, ``offset == query_len`` being a snapshot's job, on the kernel's grid; a
  refusal names the nearest offsets it accepts, ``prefixcache.nearest_exportable_offsets``), a
  slot in ``[0, num_slots)``; no offset twice in a row; at most C per row when C is set;
- every written slot (checkpoints and running slots) is written once and is no row's initial slot.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from prefixcache import is_exportable_offset, nearest_exportable_offsets

from ._convert import ArrayLike, as_host_tensor
from .errors import KernelPlanError
from .plan import Checkpoint, StatePlan

__all__ = ["check_copies", "check_snapshots", "check_state_plan"]


def _offset_error(where: str, offset: int, alignment: int, query_len: int, backend: str) -> str:
    """Why the core's rule refuses ``offset``, with the nearest offsets it accepts."""
    nearest = nearest_exportable_offsets(offset, alignment, query_len)
    hint = (
        "nearest valid offsets: " + ", ".join(str(o) for o in nearest)
        if nearest
        else "the query has no valid offset"
    )
    return (
        f"{where}: checkpoint offset {offset} is not exportable by backend {backend!r} "
        f"(checkpoint_alignment {alignment}) from a query of {query_len} tokens: an interior "
        f"checkpoint needs 0 < offset < {query_len} (the position at the end of the query is "
        f"taken by a snapshot after the step) and a multiple of {alignment}; {hint}"
    )


def _host(array: ArrayLike, name: str) -> torch.Tensor:
    try:
        return as_host_tensor(array, name)
    except (TypeError, ValueError, RuntimeError) as error:
        raise KernelPlanError(f"{name}: {error}") from error


def _vector(array: ArrayLike, name: str, length: int | None) -> list[int]:
    tensor = _host(array, name)
    if tensor.dim() != 1:
        raise KernelPlanError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if length is not None and tensor.shape[0] != length:
        raise KernelPlanError(
            f"{name} has {tensor.shape[0]} entries, expected {length} (one per row)"
        )
    values: list[int] = tensor.tolist()
    return values


def _matrix(array: ArrayLike | None, name: str, rows: int) -> list[list[int]]:
    if array is None:
        return [[] for _ in range(rows)]
    tensor = _host(array, name)
    if tensor.numel() == 0 and (tensor.dim() == 1 or tensor.shape[0] == rows):
        return [[] for _ in range(rows)]
    if tensor.dim() != 2 or tensor.shape[0] != rows:
        raise KernelPlanError(f"{name} must be [R={rows}, Cmax], got shape {tuple(tensor.shape)}")
    values: list[list[int]] = tensor.tolist()
    return values


def _check_query_start_loc(array: ArrayLike, num_tokens: int | None) -> list[int]:
    tensor = _host(array, "query_start_loc")
    if tensor.dtype not in (torch.int32, torch.int64):
        raise KernelPlanError(f"query_start_loc must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1 or tensor.shape[0] < 1:
        raise KernelPlanError(f"query_start_loc must be [R+1], got shape {tuple(tensor.shape)}")
    loc: list[int] = tensor.tolist()
    if loc[0] != 0:
        raise KernelPlanError(f"query_start_loc must start at 0, got {loc[0]}")
    for row in range(len(loc) - 1):
        if loc[row + 1] <= loc[row]:
            raise KernelPlanError(
                f"row {row}: query length {loc[row + 1] - loc[row]}; every scheduled row needs "
                f"at least one token (query_start_loc must be strictly increasing)"
            )
    if num_tokens is not None and loc[-1] != num_tokens:
        raise KernelPlanError(
            f"query_start_loc ends at {loc[-1]} but the inputs have {num_tokens} tokens"
        )
    return loc


def check_state_plan(
    *,
    query_start_loc: ArrayLike,
    initial_slot: ArrayLike,
    running_slot: ArrayLike,
    checkpoint_offsets: ArrayLike | None = None,
    checkpoint_slots: ArrayLike | None = None,
    num_slots: int,
    alignment: int = 1,
    max_checkpoints: int | None = None,
    num_tokens: int | None = None,
    backend: str = "torch",
) -> StatePlan:
    """Check a state group's plan arrays (module docstring) and return the :class:`StatePlan`.

    ``backend`` only names the backend in messages. Raises :class:`KernelPlanError`.
    """
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    loc = _check_query_start_loc(query_start_loc, num_tokens)
    rows = len(loc) - 1
    initial = _vector(initial_slot, "initial_slot", rows)
    running = _vector(running_slot, "running_slot", rows)
    offsets = _matrix(checkpoint_offsets, "checkpoint_offsets", rows)
    slots = _matrix(checkpoint_slots, "checkpoint_slots", rows)
    if (checkpoint_offsets is None) != (checkpoint_slots is None):
        raise KernelPlanError("checkpoint_offsets and checkpoint_slots must be given together")
    if rows and len(offsets[0]) != len(slots[0]):
        raise KernelPlanError(
            f"checkpoint_offsets has {len(offsets[0])} columns but checkpoint_slots has "
            f"{len(slots[0])}"
        )

    writers: dict[int, str] = {}

    def claim(slot: int, what: str) -> None:
        if slot in writers:
            raise KernelPlanError(
                f"{what} {slot} is written twice in one step (also {writers[slot]})"
            )
        writers[slot] = what

    rows_checkpoints: list[tuple[Checkpoint, ...]] = []
    for row in range(rows):
        query_len = loc[row + 1] - loc[row]
        if not 0 <= running[row] < num_slots:
            raise KernelPlanError(
                f"row {row}: running_slot {running[row]} is out of range [0, {num_slots})"
            )
        if not -1 <= initial[row] < num_slots:
            raise KernelPlanError(
                f"row {row}: initial_slot {initial[row]} is out of range [-1, {num_slots}) "
                f"(-1 = zero state)"
            )
        if initial[row] == running[row]:
            raise KernelPlanError(
                f"row {row}: initial_slot equals running_slot ({running[row]}); the running "
                f"state is double-buffered, a step reads one block and writes the other"
            )
        claim(running[row], f"row {row}'s running slot")
        found: list[Checkpoint] = []
        for column, (offset, slot) in enumerate(zip(offsets[row], slots[row], strict=True)):
            if offset == 0 and slot == -1:
                continue
            where = f"row {row}, column {column}"
            if offset == 0 or slot == -1:
                raise KernelPlanError(
                    f"{where}: checkpoint offset {offset} paired with slot {slot}; a checkpoint "
                    f"needs both an offset > 0 and a slot >= 0 (padding is offset 0, slot -1)"
                )
            if not is_exportable_offset(offset, alignment, query_len):
                raise KernelPlanError(_offset_error(where, offset, alignment, query_len, backend))
            if not 0 <= slot < num_slots:
                raise KernelPlanError(
                    f"{where}: checkpoint slot {slot} is out of range [0, {num_slots})"
                )
            if any(c.offset == offset for c in found):
                raise KernelPlanError(f"{where}: checkpoint offset {offset} appears twice")
            if slot == running[row]:
                raise KernelPlanError(
                    f"{where}: checkpoint slot {slot} equals the row's running slot"
                )
            claim(slot, f"row {row}'s checkpoint slot (offset {offset})")
            found.append(Checkpoint(offset, slot))
        if max_checkpoints is not None and len(found) > max_checkpoints:
            raise KernelPlanError(
                f"row {row}: {len(found)} checkpoints exceed backend {backend!r}'s "
                f"max_checkpoints_per_step {max_checkpoints}"
            )
        rows_checkpoints.append(tuple(sorted(found, key=lambda c: c.offset)))

    for row, slot in enumerate(initial):
        if slot >= 0 and slot in writers:
            raise KernelPlanError(
                f"row {row}: initial_slot {slot} is also {writers[slot]}; a step must not "
                f"overwrite a state it reads"
            )
    return StatePlan(
        query_start_loc=tuple(loc),
        initial_slot=tuple(initial),
        running_slot=tuple(running),
        checkpoints=tuple(rows_checkpoints),
    )


def check_snapshots(snapshots: ArrayLike, num_slots: int) -> list[tuple[int, int]]:
    """Check ``snapshots`` ``[S, 2]`` rows ``(src_running_block, dst_checkpoint_block)``.

    Both in ``[0, num_slots)``, ``src != dst``, each ``dst`` once and never a source.
    """
    tensor = _host(snapshots, "snapshots")
    if tensor.numel() == 0:
        return []
    if tensor.dim() != 2 or tensor.shape[1] != 2:
        raise KernelPlanError(f"snapshots must be [S, 2], got shape {tuple(tensor.shape)}")
    pairs: list[list[int]] = tensor.tolist()
    sources = {src for src, _ in pairs}
    seen: set[int] = set()
    for index, (src, dst) in enumerate(pairs):
        for name, slot in (("source", src), ("destination", dst)):
            if not 0 <= slot < num_slots:
                raise KernelPlanError(
                    f"snapshot {index}: {name} slot {slot} is out of range [0, {num_slots})"
                )
        if src == dst:
            raise KernelPlanError(f"snapshot {index}: source and destination are both {src}")
        if dst in seen:
            raise KernelPlanError(f"snapshot {index}: destination slot {dst} is written twice")
        if dst in sources:
            raise KernelPlanError(
                f"snapshot {index}: destination slot {dst} is also a snapshot source"
            )
        seen.add(dst)
    return [(src, dst) for src, dst in pairs]


def check_copies(
    copies: ArrayLike, groups: Mapping[int, tuple[int, int]]
) -> list[tuple[int, int, int, int]]:
    """Check copy-on-write ``copies`` ``[K, 4]`` rows ``(group, src_block, dst_block, num_tokens)``.

    ``groups`` maps each paged group id to ``(num_blocks, block_size)``. Blocks must be in range,
    ``src != dst``, ``0 <= num_tokens <= block_size``, and a destination is written once per group
    and is no source of the same group.
    """
    tensor = _host(copies, "copies")
    if tensor.numel() == 0:
        return []
    if tensor.dim() != 2 or tensor.shape[1] != 4:
        raise KernelPlanError(f"copies must be [K, 4], got shape {tuple(tensor.shape)}")
    rows: list[list[int]] = tensor.tolist()
    sources = {(group, src) for group, src, _, _ in rows}
    seen: set[tuple[int, int]] = set()
    for index, (group, src, dst, num_tokens) in enumerate(rows):
        if group not in groups:
            raise KernelPlanError(
                f"copy {index}: group {group} has no paged KV cache here "
                f"(known groups: {sorted(groups)})"
            )
        num_blocks, block_size = groups[group]
        for name, block in (("source", src), ("destination", dst)):
            if not 0 <= block < num_blocks:
                raise KernelPlanError(
                    f"copy {index}: {name} block {block} is out of range [0, {num_blocks}) "
                    f"of group {group}"
                )
        if src == dst:
            raise KernelPlanError(f"copy {index}: source and destination are both block {src}")
        if not 0 <= num_tokens <= block_size:
            raise KernelPlanError(
                f"copy {index}: num_tokens {num_tokens} is outside [0, block_size={block_size}]"
            )
        if (group, dst) in seen:
            raise KernelPlanError(f"copy {index}: destination block {dst} is written twice")
        if (group, dst) in sources:
            raise KernelPlanError(f"copy {index}: destination block {dst} is also a source")
        seen.add((group, dst))
    return [(g, s, d, n) for g, s, d, n in rows]
