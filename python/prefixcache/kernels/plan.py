"""The validated state-group part of a step plan, as the kernels execute it.

The Rust core emits plan arrays (``query_start_loc``, ``initial_slot``, ``running_slot``,
``checkpoint_offsets`` / ``checkpoint_slots`` padded with ``0`` / ``-1``). ``validate`` turns them
into a :class:`StatePlan`: plain Python values, checkpoints sorted by offset within each row, every
rule already checked. Backends execute a ``StatePlan`` and nothing else, so no backend re-derives
a rule.

A row's *cuts* are its checkpoints followed by the end of its query, each with the slot its state
goes to: the recurrence runs from the initial state through the cuts in order, writing the state
at each cut into the cut's slot (the running slot last).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["Checkpoint", "StatePlan"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class Checkpoint:
    """The state after ``offset`` query tokens of a row goes to state slot ``slot``."""

    offset: int
    slot: int


@dataclass(frozen=True)
class StatePlan:
    """A validated prefill (or decode) plan of one state group; build it with ``validate``."""

    query_start_loc: tuple[int, ...]
    initial_slot: tuple[int, ...]
    running_slot: tuple[int, ...]
    checkpoints: tuple[tuple[Checkpoint, ...], ...]
    # What backends derive from the plan (index tensors on a device, segment rounds), kept so
    # that every layer of a step reuses it: a model runs the same plan through each layer.
    _derived: dict[Hashable, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def derived(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """``build()``, computed once per plan and ``key`` (``key`` names what and where, e.g.
        the device); the result is shared, so it must never be modified in place."""
        try:
            value: _T = self._derived[key]
        except KeyError:
            value = self._derived[key] = build()
        return value

    @property
    def num_rows(self) -> int:
        """R, the scheduled sequences."""
        return len(self.running_slot)

    @property
    def num_tokens(self) -> int:
        """T, the scheduled tokens."""
        return self.query_start_loc[-1]

    @property
    def num_checkpoints(self) -> int:
        """Interior checkpoints of the whole plan."""
        return sum(len(row) for row in self.checkpoints)

    @property
    def max_checkpoints_per_row(self) -> int:
        """The most checkpoints any row has."""
        return max((len(row) for row in self.checkpoints), default=0)

    def start(self, row: int) -> int:
        """Index of the row's first token in the packed batch."""
        return self.query_start_loc[row]

    def query_len(self, row: int) -> int:
        """Tokens the row has in this step."""
        return self.query_start_loc[row + 1] - self.query_start_loc[row]

    def lengths(self) -> list[int]:
        """Query length of every row."""
        return [self.query_len(row) for row in range(self.num_rows)]

    def cuts(self, row: int) -> list[Checkpoint]:
        """The row's checkpoints in offset order, then ``(query_len, running_slot)``."""
        return [*self.checkpoints[row], Checkpoint(self.query_len(row), self.running_slot[row])]

    def all_cuts(self) -> list[tuple[int, Checkpoint]]:
        """``(row, cut)`` for every cut of every row, rows in order."""
        return [(row, cut) for row in range(self.num_rows) for cut in self.cuts(row)]

    def written_slots(self) -> list[int]:
        """Every slot the step writes: all checkpoint slots and all running slots."""
        slots = [c.slot for row in self.checkpoints for c in row]
        return slots + list(self.running_slot)
