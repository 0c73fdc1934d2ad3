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

Errors derive from :class:`PrefixCacheError`, one class per failure; argument type problems
are ``TypeError`` and out-of-range values ``InvalidRequestError`` / ``ConfigError`` (both
``ValueError``). Running out of blocks is not an error: ``schedule`` returns ``None``.
"""

from __future__ import annotations

from typing import TypeAlias

from prefixcache._core import (
    ENCODING_VERSION,
    MAX_BATCH_SEQUENCES,
    MAX_BLOCK_SIZE,
    MAX_BLOCKS_PER_POOL,
    MAX_EXTRA_KEY_BYTES,
    MAX_GROUPS,
    MAX_HASH_UNIT,
    MAX_LOOKAHEAD_TOKENS,
    MAX_MULTIMODAL_INPUTS,
    MAX_PENDING_EVENTS,
    MAX_POOLS,
    MAX_RECENTLY_EVICTED,
    MAX_SEQUENCE_TOKENS,
    MAX_STEP_TOKENS,
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
    hash_prefix,
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

__all__ = [
    "ENCODING_VERSION",
    "MAX_BATCH_SEQUENCES",
    "MAX_BLOCKS_PER_POOL",
    "MAX_BLOCK_SIZE",
    "MAX_EXTRA_KEY_BYTES",
    "MAX_GROUPS",
    "MAX_HASH_UNIT",
    "MAX_LOOKAHEAD_TOKENS",
    "MAX_MULTIMODAL_INPUTS",
    "MAX_PENDING_EVENTS",
    "MAX_POOLS",
    "MAX_RECENTLY_EVICTED",
    "MAX_SEQUENCE_TOKENS",
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
    "Stats",
    "StepError",
    "StepPlan",
    "UnknownSequenceError",
    "__version__",
    "hash_prefix",
]
