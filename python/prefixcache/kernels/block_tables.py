"""The block tables of one paged group, kept up to date from the plans' incremental entries.

The Rust core never sends a whole block table in a step plan: a paged group's part of the plan
lists only what changed, ``appended`` and ``replaced`` rows ``(row, column, block)`` (``row`` is
the plan row, ``replaced`` block 0 a released block). :class:`BlockTables` holds every live
sequence's table in one preallocated ``int32`` array, grown geometrically, applies one step's
entries in ``O(rows + entries)`` (NumPy fancy indexing, no Python loop over blocks), can take
the appended entries of the latest ``depth`` steps back when they are aborted (an engine that
overlaps steps has two plans in flight, and aborting the older one ends both: ``rollback(2)``;
releases stand, as in the core), and hands the kernels the ``[R, C]`` table of a step's rows (a
NumPy gather: no per-step Python rebuild of the tables, whatever the contexts' lengths).

Entries beyond a row's length are always 0 (the null block), so a gathered table is
null-padded, as the core's ``CacheManager.block_table`` is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from prefixcache import StepPlanLike

__all__ = ["BlockTables"]

_Ints = npt.ArrayLike


@dataclass
class _Undo:
    """What one :meth:`BlockTables.apply` changed, to take it back."""

    created: list[int]  # sequence ids whose rows the apply allocated
    rows: np.ndarray  # table rows of the step (int64 [R])
    lengths: np.ndarray  # their lengths before the apply
    cells: tuple[np.ndarray, np.ndarray]  # (rows, columns) written
    old: np.ndarray  # the values they held


class BlockTables:
    """Block-table rows of one paged group, keyed by sequence id (see the module docstring).

    Args:
        group: the paged group's index in the cache configuration (whose plan entries
            :meth:`apply_plan` reads).
        rows, width: initial capacity (sequences, blocks per sequence); both grow by doubling.
        depth: how many of the latest applies :meth:`rollback` can take back (the cache
            configuration's ``max_steps_in_flight``).
    """

    def __init__(self, group: int = 0, *, rows: int = 16, width: int = 16, depth: int = 1) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"rows and width must be >= 1, got {rows} and {width}")
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.group = group
        self.depth = depth
        self._table = np.zeros((rows, width), dtype=np.int32)
        self._lengths = np.zeros(rows, dtype=np.int64)
        self._row_of: dict[int, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))
        # The undo records of the latest applies, oldest first (at most ``depth``).
        self._undo: deque[_Undo] = deque()

    # --- reading ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._row_of

    @property
    def undoable(self) -> int:
        """How many of the latest applies :meth:`rollback` can take back now."""
        return len(self._undo)

    @property
    def capacity(self) -> tuple[int, int]:
        """``(rows, width)`` of the preallocated array."""
        rows, width = self._table.shape
        return int(rows), int(width)

    def length(self, seq_id: int) -> int:
        """Blocks in the table of ``seq_id`` (0 for a sequence without a row)."""
        row = self._row_of.get(seq_id)
        return 0 if row is None else int(self._lengths[row])

    def row(self, seq_id: int) -> list[int]:
        """The table of ``seq_id`` as a list (empty for a sequence without a row)."""
        row = self._row_of.get(seq_id)
        if row is None:
            return []
        values: list[int] = self._table[row, : self._lengths[row]].tolist()
        return values

    def gather(self, seq_ids: Iterable[int]) -> npt.NDArray[np.int32]:
        """The ``int32 [R, C]`` tables of ``seq_ids`` (a copy), null-padded to the longest.

        Raises ``KeyError`` for a sequence without a row.
        """
        rows = np.fromiter((self._row_of[int(s)] for s in seq_ids), dtype=np.int64)
        width = int(self._lengths[rows].max()) if rows.size else 0
        return self._table[rows, :width]

    # --- changing -----------------------------------------------------------------------------

    def apply(self, seq_ids: _Ints, appended: _Ints, replaced: _Ints) -> None:
        """Apply one step's entries; ``seq_ids[r]`` is the sequence of plan row ``r``.

        ``appended`` / ``replaced`` are ``[n, 3]`` rows ``(row, column, block)``: appended
        entries extend the rows, replaced ones overwrite columns the rows already have (the
        core reports a sliding window's released blocks there, as block 0). A sequence seen
        for the first time gets a row. :meth:`rollback` can take the appended entries back
        until ``depth`` later applies have been made, or a :meth:`release` of one of the rows
        (see there). Raises ``ValueError`` (nothing changed) on an entry outside the rows or a
        replaced column a row does not have.
        """
        ids: list[int] = np.asarray(seq_ids, dtype=np.int64).reshape(-1).tolist()
        added = np.asarray(appended, dtype=np.int64).reshape(-1, 3)
        releases = np.asarray(replaced, dtype=np.int64).reshape(-1, 3)
        self._check_entries(len(ids), added, releases)
        created: list[int] = []
        rows = np.empty(len(ids), dtype=np.int64)
        for index, seq_id in enumerate(ids):
            row = self._row_of.get(seq_id)
            if row is None:
                row = self._allocate(seq_id)
                created.append(seq_id)
            rows[index] = row
        cell_rows = rows[added[:, 0]]
        columns = added[:, 1]
        if columns.size:
            self._reserve_width(int(columns.max()) + 1)
        lengths = self._lengths[rows].copy()
        old = self._table[cell_rows, columns]  # read before any write: duplicates see the same
        self._table[cell_rows, columns] = added[:, 2]  # a later entry of a cell wins
        np.maximum.at(self._lengths, cell_rows, columns + 1)
        undo = _Undo(created, rows, lengths, (cell_rows, columns), old)
        released_rows = rows[releases[:, 0]]
        if bool((releases[:, 1] >= self._lengths[released_rows]).any()):
            self._undo_one(undo)
            raise ValueError("a replaced entry names a column its row does not have")
        # Releases stand when the step is aborted (the core does not take them back; the next
        # plan reports them again), so they are not recorded for the rollback.
        self._table[released_rows, releases[:, 1]] = releases[:, 2]
        self._undo.append(undo)
        if len(self._undo) > self.depth:
            self._undo.popleft()  # its step ended long ago (at most depth are in flight)

    @staticmethod
    def _check_entries(num_rows: int, added: np.ndarray, releases: np.ndarray) -> None:
        for name, entries in (("appended", added), ("replaced", releases)):
            if entries.size and (
                entries[:, 0].min() < 0
                or entries[:, 0].max() >= num_rows
                or entries[:, 1].min() < 0
            ):
                raise ValueError(
                    f"{name} entries name rows outside [0, {num_rows}) or negative columns"
                )

    def apply_plan(self, plan: StepPlanLike) -> None:
        """:meth:`apply` of this group's part of ``plan`` (a ``StepPlan`` or ``PlanBuffers``)."""
        part = plan.paged_group(self.group)
        self.apply(
            plan.seq_ids[: plan.num_rows],
            part.appended[: part.num_appended],
            part.replaced[: part.num_replaced],
        )

    def rollback(self, count: int = 1) -> None:
        """Take back the appended entries of the latest ``count`` applies, newest first (their
        steps were aborted: a cascading abort of two plans in flight is ``rollback(2)``).

        Raises ``RuntimeError`` (nothing changed) when fewer than ``count`` can be taken back
        (:attr:`undoable`: they were rolled back already, released, or more than ``depth``).
        """
        if count < 1 or count > len(self._undo):
            raise RuntimeError(
                f"no applied step to roll back: {count} asked, {len(self._undo)} can be "
                f"(rolled back already, released, or beyond the depth {self.depth})"
            )
        for _ in range(count):
            self._undo_one(self._undo.pop())

    def release(self, seq_id: int) -> None:
        """Drop the row of ``seq_id`` (finished or preempted); nothing if it has none.

        The applies that wrote this row, and every apply before them, can no longer be
        rolled back afterwards; later applies that did not touch it still can (a sequence
        finished while the next plan, which it is not in, is in flight).
        """
        row = self._row_of.get(seq_id)
        if row is None:
            return
        for index in range(len(self._undo) - 1, -1, -1):
            if bool((self._undo[index].rows == row).any()):
                for _ in range(index + 1):
                    self._undo.popleft()
                break
        self._drop(seq_id)

    def _undo_one(self, undo: _Undo) -> None:
        self._table[undo.cells] = undo.old
        self._lengths[undo.rows] = undo.lengths
        for seq_id in undo.created:
            self._drop(seq_id)

    # --- storage ------------------------------------------------------------------------------

    def _allocate(self, seq_id: int) -> int:
        if not self._free:
            rows, width = self._table.shape
            table = np.zeros((2 * rows, width), dtype=np.int32)
            table[:rows] = self._table
            lengths = np.zeros(2 * rows, dtype=np.int64)
            lengths[:rows] = self._lengths
            self._table, self._lengths = table, lengths
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free.pop()
        self._row_of[seq_id] = row
        return row

    def _drop(self, seq_id: int) -> None:
        row = self._row_of.pop(seq_id)
        self._table[row, : self._lengths[row]] = 0
        self._lengths[row] = 0
        self._free.append(row)

    def _reserve_width(self, width: int) -> None:
        rows, current = self._table.shape
        if width <= current:
            return
        table = np.zeros((rows, max(width, 2 * current)), dtype=np.int32)
        table[:, :current] = self._table
        self._table = table
