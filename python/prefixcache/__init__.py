"""prefixcache: a prefix-cache manager for hybrid attention / recurrent-state LLM serving engines.

A Rust core owns block lifecycle, prefix hashing, eviction and checkpoint planning; this package
is its typed Python face. An engine drives a :class:`CacheManager` through a two-phase step
protocol::

    mgr = CacheManager(CacheConfig(pools=[PoolConfig(1024)], groups=[FullAttention(16)]))
    mgr.add(seq_id, prompt_tokens)
    scheduled = mgr.schedule(seq_id, max_tokens=512)  # None: out of blocks, preempt something
    plan = mgr.build_plan()                           # NumPy arrays for the kernels
    ...                                               # copies, forward, snapshots
    mgr.commit(plan)                                  # or mgr.abort(plan) if the forward failed
    mgr.append(seq_id, [sampled_token])
    mgr.finish(seq_id)

The core's rules are asked, never restated: :func:`is_exportable_offset` and
:func:`nearest_exportable_offsets` (the kernels' checkpoint offsets), :func:`aligned_geometry`,
and a config's ``chunk_alignment``, ``min_token_budget`` and ``blocks_for_sequence``.

The kernel layer reads a step through :class:`StepPlanLike`, which both a :class:`StepPlan`
(``build_plan``) and :class:`PlanBuffers` (``build_plan_into`` / ``decode_step``) satisfy.

Errors derive from :class:`PrefixCacheError`, one class per failure; argument type problems
are ``TypeError`` and out-of-range values ``InvalidRequestError`` / ``ConfigError`` (both
``ValueError``). Running out of blocks is not an error: ``schedule`` returns ``None``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from prefixcache._core import (
    ENCODING_VERSION,
    MAX_BATCH_SEQUENCES,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS_PER_POOL,
    MAX_EXTRA_KEY_BYTES,
    MAX_GROUPS,
    MAX_HASH_THREADS,
    MAX_HASH_UNIT,
    MAX_LOOKAHEAD_TOKENS,
    MAX_MULTIMODAL_INPUTS,
    MAX_PENDING_EVENTS,
    MAX_POOLS,
    MAX_RECENTLY_EVICTED,
    MAX_SEQUENCE_TOKENS,
    MAX_STEP_TOKENS,
    MAX_STEPS_IN_FLIGHT,
    Added,
    AlignmentError,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheManager,
    ConfigError,
    DuplicateSequenceError,
    GroupHit,
    GroupStats,
    Hit,
    InvalidRequestError,
    InvariantError,
    NothingToScheduleError,
    PagedGroupBuffers,
    PagedGroupPlan,
    PlanBuffers,
    PoolUsage,
    PrefixCacheError,
    ResetRefusedError,
    Scheduled,
    StalePlanError,
    StateGroupBuffers,
    StateGroupPlan,
    Stats,
    StepError,
    StepPlan,
    UnknownSequenceError,
    __version__,
    aligned_geometry,
    hash_prefix,
    is_exportable_offset,
    nearest_exportable_offsets,
)
from prefixcache.config import (
    CacheConfig,
    CheckpointBackend,
    ExtraKeys,
    FullAttention,
    Group,
    HashAlgorithm,
    HashConfig,
    MultimodalInput,
    PoolConfig,
    Retention,
    SlidingWindow,
    StateGroup,
)

Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
"""Any event returned by :meth:`CacheManager.drain_events`."""


@runtime_checkable
class PagedGroupPlanLike(Protocol):
    """One paged group's part of a step: :class:`PagedGroupPlan` or :class:`PagedGroupBuffers`.

    The step's values are the leading rows: ``appended[:num_appended]``,
    ``replaced[:num_replaced]`` and ``slot_mapping[:num_tokens]`` (``num_tokens`` of the
    step); rows past them are left from earlier steps in buffers.
    """

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
        ...

    @property
    def num_appended(self) -> int:
        """Rows of ``appended`` in this step."""
        ...

    @property
    def num_replaced(self) -> int:
        """Rows of ``replaced`` in this step."""
        ...

    @property
    def appended(self) -> npt.NDArray[np.int32]:
        """``int32`` rows ``(row, column, block)`` appended to the sequences' tables."""
        ...

    @property
    def replaced(self) -> npt.NDArray[np.int32]:
        """``int32`` rows ``(row, column, block)`` replaced (a window's release: block 0)."""
        ...

    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """``int64`` KV slot ``block * block_size + offset`` of each scheduled token."""
        ...


@runtime_checkable
class StateGroupPlanLike(Protocol):
    """One state group's part of a step: :class:`StateGroupPlan` or :class:`StateGroupBuffers`.

    The step's values are the leading rows: ``running_slot[:R]``, ``initial_slot[:R]``,
    ``checkpoint_offsets[:R, :max_checkpoints]``, ``checkpoint_slots[:R, :max_checkpoints]``
    and ``snapshots[:num_snapshots]`` (``R`` the step's ``num_rows``).
    """

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
        ...

    @property
    def max_checkpoints(self) -> int:
        """Cmax, the checkpoint columns in use in this step."""
        ...

    @property
    def num_snapshots(self) -> int:
        """Rows of ``snapshots`` in this step."""
        ...

    @property
    def running_slot(self) -> npt.NDArray[np.int32]:
        """``int32`` the running-state slot each row writes."""
        ...

    @property
    def initial_slot(self) -> npt.NDArray[np.int32]:
        """``int32`` the slot each row reads (-1 = zero state)."""
        ...

    @property
    def checkpoint_offsets(self) -> npt.NDArray[np.int32]:
        """``int32 [R, Cmax]`` interior checkpoint offsets from the row's query start
        (0 = none)."""
        ...

    @property
    def checkpoint_slots(self) -> npt.NDArray[np.int32]:
        """``int32 [R, Cmax]`` the slot each interior checkpoint goes to (-1 = none)."""
        ...

    @property
    def snapshots(self) -> npt.NDArray[np.int32]:
        """``int32`` rows ``(running slot, checkpoint slot)`` copied after the forward."""
        ...


@runtime_checkable
class StepPlanLike(Protocol):
    """One step as the kernel layer reads it: a :class:`StepPlan` or :class:`PlanBuffers`.

    Every array holds the step's values in its leading rows: ``seq_ids[:R]``,
    ``query_start_loc[:R + 1]``, ``num_computed[:R]``, ``num_scheduled[:R]``,
    ``copies[:num_copies]`` (``R`` = ``num_rows``), and each group's part as its protocol
    says. A :class:`StepPlan`'s arrays are exactly that long; a :class:`PlanBuffers`' are at
    least that long (rows past them are left from earlier steps), so code that slices as
    above serves both.
    """

    @property
    def step_id(self) -> int | None:
        """The step (``None`` only for buffers no plan was built into)."""
        ...

    @property
    def num_rows(self) -> int:
        """R, the scheduled sequences."""
        ...

    @property
    def num_tokens(self) -> int:
        """T, the scheduled tokens."""
        ...

    @property
    def num_copies(self) -> int:
        """K, the copy-on-write copies."""
        ...

    @property
    def counts(self) -> tuple[int, ...]:
        """``(num_rows, num_tokens, num_copies)``, then ``(num_appended, num_replaced)`` per
        paged group and ``(max_checkpoints, num_snapshots)`` per state group, in group
        order."""
        ...

    @property
    def seq_ids(self) -> npt.NDArray[np.int64]:
        """``int64`` the scheduled sequences, in schedule order."""
        ...

    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """``int32`` where each row's tokens start in the packed batch (R + 1 values)."""
        ...

    @property
    def num_computed(self) -> npt.NDArray[np.int32]:
        """``int32`` tokens of each row computed before this step."""
        ...

    @property
    def num_scheduled(self) -> npt.NDArray[np.int32]:
        """``int32`` tokens of each row scheduled in this step."""
        ...

    @property
    def copies(self) -> npt.NDArray[np.int64]:
        """``int64`` rows ``(group, src_block, dst_block, num_tokens)``: copy-on-write copies
        to run before the forward."""
        ...

    @property
    def paged(self) -> Sequence[PagedGroupPlanLike]:
        """Per paged group, in group order."""
        ...

    @property
    def state(self) -> Sequence[StateGroupPlanLike]:
        """Per state group, in group order."""
        ...

    def paged_group(self, group: int) -> PagedGroupPlanLike:
        """The part of paged group ``group`` (its index in the configuration)."""
        ...

    def state_group(self, group: int) -> StateGroupPlanLike:
        """The part of state group ``group`` (its index in the configuration)."""
        ...


if TYPE_CHECKING:
    # mypy checks here that both plan representations satisfy the protocol.
    def _both_are_step_plans(
        plan: StepPlan, buffers: PlanBuffers
    ) -> tuple[StepPlanLike, StepPlanLike]:
        return plan, buffers


__all__ = [
    "ENCODING_VERSION",
    "MAX_BATCH_SEQUENCES",
    "MAX_BLOCKS_PER_POOL",
    "MAX_BLOCK_SIZE",
    "MAX_EXTRA_KEY_BYTES",
    "MAX_GROUPS",
    "MAX_HASH_THREADS",
    "MAX_HASH_UNIT",
    "MAX_LOOKAHEAD_TOKENS",
    "MAX_MULTIMODAL_INPUTS",
    "MAX_PENDING_EVENTS",
    "MAX_POOLS",
    "MAX_RECENTLY_EVICTED",
    "MAX_SEQUENCE_TOKENS",
    "MAX_STEPS_IN_FLIGHT",
    "MAX_STEP_TOKENS",
    "Added",
    "AlignmentError",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "CacheManager",
    "CheckpointBackend",
    "ConfigError",
    "DuplicateSequenceError",
    "Event",
    "ExtraKeys",
    "FullAttention",
    "Group",
    "GroupHit",
    "GroupStats",
    "HashAlgorithm",
    "HashConfig",
    "Hit",
    "InvalidRequestError",
    "InvariantError",
    "MultimodalInput",
    "NothingToScheduleError",
    "PagedGroupBuffers",
    "PagedGroupPlan",
    "PagedGroupPlanLike",
    "PlanBuffers",
    "PoolConfig",
    "PoolUsage",
    "PrefixCacheError",
    "ResetRefusedError",
    "Retention",
    "Scheduled",
    "SlidingWindow",
    "StalePlanError",
    "StateGroup",
    "StateGroupBuffers",
    "StateGroupPlan",
    "StateGroupPlanLike",
    "Stats",
    "StepError",
    "StepPlan",
    "StepPlanLike",
    "UnknownSequenceError",
    "__version__",
    "aligned_geometry",
    "hash_prefix",
    "is_exportable_offset",
    "nearest_exportable_offsets",
]
