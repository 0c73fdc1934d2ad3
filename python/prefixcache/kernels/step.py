"""One engine step as the kernels execute it: a :class:`Step`, built from one step plan.

A step is everything a model needs to run the whole step, in the order it runs it:

1. ``copies`` ``[K, 4]`` rows ``(group, src_block, dst_block, num_tokens)``: copy-on-write
   copies of paged KV blocks, before any layer (:func:`~prefixcache.kernels.apply_copies`);
2. the layers, over a packed batch of R rows and T tokens (``query_start_loc`` ``[R+1]``,
   ``seq_lens`` ``[R]``, each row's context after the step): per paged group
   (:class:`PagedStep`) the KV slot of every token and the rows' block tables, per state group
   (:class:`StateStep`) the slots each row reads and writes and its interior checkpoints;
3. per state group its ``snapshots`` ``[S, 2]`` rows ``(running slot, checkpoint slot)``,
   after the layers (:func:`~prefixcache.kernels.apply_snapshots`).

:meth:`Step.from_plan` builds it from one plan (``prefixcache.StepPlanLike``: a ``StepPlan``,
or the ``PlanBuffers`` an engine writes every plan into) and the
:class:`~prefixcache.kernels.BlockTables` of each paged group (which
:meth:`~prefixcache.kernels.BlockTables.apply_plan` has brought up to date with the same
plan). Its arrays are views of the plan's: from buffers, the step is valid until their next
build.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .block_tables import BlockTables

if TYPE_CHECKING:
    from prefixcache import StepPlanLike

__all__ = ["PagedStep", "StateStep", "Step"]


@dataclass(frozen=True)
class PagedStep:
    """One paged group's part of a step.

    Attributes:
        group: the group's index in the cache configuration.
        slot_mapping: ``int64 [T]`` KV slot of each scheduled token (``-1``: skipped).
        block_tables: ``int32 [R, C]`` each row's blocks (its whole context), null-padded.
    """

    group: int
    slot_mapping: np.ndarray
    block_tables: np.ndarray


@dataclass(frozen=True)
class StateStep:
    """One state group's part of a step.

    Attributes:
        group: the group's index in the cache configuration.
        initial_slot: ``[R]`` the slot each row reads (``-1``: zero state).
        running_slot: ``[R]`` the running-state slot each row writes.
        checkpoint_offsets, checkpoint_slots: ``[R, Cmax]`` interior checkpoints (padding
            ``0`` / ``-1``).
        snapshots: ``[S, 2]`` ``(running slot, checkpoint slot)`` copied after the layers.
    """

    group: int
    initial_slot: np.ndarray
    running_slot: np.ndarray
    checkpoint_offsets: np.ndarray
    checkpoint_slots: np.ndarray
    snapshots: np.ndarray


@dataclass(frozen=True)
class Step:
    """Everything one step executes (see the module docstring).

    Attributes:
        query_start_loc: ``[R+1]`` row boundaries in the packed batch.
        seq_lens: ``int64 [R]`` each row's context length after the step.
        copies: ``[K, 4]`` copy-on-write copies ``(group, src_block, dst_block, num_tokens)``.
        paged: the paged groups' parts, in group order.
        state: the state groups' parts, in group order.
        step_id: the plan's step id (``None`` for a step written by hand).
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    copies: np.ndarray
    paged: tuple[PagedStep, ...]
    state: tuple[StateStep, ...]
    step_id: int | None = None

    @property
    def num_rows(self) -> int:
        """R, the scheduled sequences."""
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the scheduled tokens."""
        return int(self.query_start_loc[-1]) if self.query_start_loc.shape[0] else 0

    @property
    def prefill_tokens(self) -> int | None:
        """T when the step prefills (some row has more than one query token), ``None`` when it
        does not (every row one token, or no rows): how the simulator's step clock and the
        benchmarks that split steps by kind tell prefill steps from decode steps."""
        if self.query_start_loc.shape[0] < 2:
            return None
        longest = int(np.diff(self.query_start_loc).max())
        return self.num_tokens if longest > 1 else None

    def paged_group(self, group: int) -> PagedStep:
        """The part of paged group ``group``; ``KeyError`` when the step has none."""
        for part in self.paged:
            if part.group == group:
                return part
        raise KeyError(
            f"the step has no paged group {group} (it has {[p.group for p in self.paged]})"
        )

    def state_group(self, group: int) -> StateStep:
        """The part of state group ``group``; ``KeyError`` when the step has none."""
        for part in self.state:
            if part.group == group:
                return part
        raise KeyError(
            f"the step has no state group {group} (it has {[s.group for s in self.state]})"
        )

    @classmethod
    def from_plan(cls, plan: StepPlanLike, tables: Iterable[BlockTables]) -> Step:
        """The step of ``plan`` (a ``StepPlan`` or the ``PlanBuffers`` a plan was written
        into: ``prefixcache.StepPlanLike``), with the block tables of ``tables`` (one per paged
        group of the plan, each already brought up to date with this plan)."""
        rows, tokens = plan.num_rows, plan.num_tokens
        seq_ids = plan.seq_ids[:rows]
        by_group = {table.group: table for table in tables}
        paged = tuple(
            PagedStep(
                group=part.group,
                slot_mapping=part.slot_mapping[:tokens],
                block_tables=by_group[part.group].gather(seq_ids),
            )
            for part in plan.paged
        )
        state = tuple(
            StateStep(
                group=part.group,
                initial_slot=part.initial_slot[:rows],
                running_slot=part.running_slot[:rows],
                checkpoint_offsets=part.checkpoint_offsets[:rows, : part.max_checkpoints],
                checkpoint_slots=part.checkpoint_slots[:rows, : part.max_checkpoints],
                snapshots=part.snapshots[: part.num_snapshots],
            )
            for part in plan.state
        )
        seq_lens = plan.num_computed[:rows].astype(np.int64) + plan.num_scheduled[:rows]
        return cls(
            query_start_loc=plan.query_start_loc[: rows + 1],
            seq_lens=seq_lens,
            copies=plan.copies[: plan.num_copies],
            paged=paged,
            state=state,
            step_id=plan.step_id,
        )
