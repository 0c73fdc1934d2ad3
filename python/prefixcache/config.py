"""Configuration of a :class:`prefixcache.CacheManager`: pools, groups, hashing, retention.

Plain frozen dataclasses that only carry values; their defaults are the core's
(``prefixcache._core.defaults()``, read once at import). Every rule (the hash unit divides each
paged block size, each state alignment divides the unit, ...) lives in the Rust core: a
:class:`CacheConfig` is checked by it when constructed, and a violated rule raises
:class:`prefixcache.ConfigError` (a ``ValueError``) whose message names the field and what to
change. A value of the wrong type raises ``TypeError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, TypeAlias

from prefixcache import _core

__all__ = [
    "CacheConfig",
    "CheckpointBackend",
    "ExtraKeys",
    "FullAttention",
    "Group",
    "HashAlgorithm",
    "HashConfig",
    "MultimodalInput",
    "PoolConfig",
    "Retention",
    "SlidingWindow",
    "StateGroup",
]


def _as_tuple(value: object, name: str) -> tuple[Any, ...]:
    """A list-like field as a tuple (``TypeError`` for anything else, a ``str`` included)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be a list, got {type(value).__name__}")
    return tuple(value)


HashAlgorithm: TypeAlias = Literal["xxh3_128", "sha256"]
"""Name of a hash function: ``"xxh3_128"`` (fast, the default) or ``"sha256"`` (collision
resistant, for multi-tenant deployments)."""

# The core's default of every field that has one: the dataclasses below take their defaults
# from it, so that a default is written once, in rust/core/src/config.rs.
_DEFAULTS = _core.defaults()
_CACHE = _DEFAULTS["cache"]
_HASH = _DEFAULTS["hash"]
_STATE = _DEFAULTS["state_group"]
_RETENTION = _DEFAULTS["retention"]


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One block pool: block ids ``0 .. num_blocks - 1``.

    Block 0 is the null block (padding in block tables; never allocated), so a pool holds
    ``num_blocks - 1`` usable blocks. Several groups may share a pool (one id space, one LRU).
    """

    num_blocks: int


@dataclass(frozen=True, slots=True)
class Retention:
    """Which checkpoint positions a state group keeps (all multiples of the hash unit U).

    Attributes:
        tail: the last unit boundary strictly before the prompt's end, which an identical
            resend or the next turn of a conversation resumes from.
        interval: every ``interval`` tokens (a multiple of U); ``None`` = off. Setting it to
            the attention block size reproduces block-boundary caching.
        junction: the position where the prompt diverged from another cached request.
        decode_tail: after a decode step that ends on a unit boundary, the running state is
            snapshotted (kept privately, published by ``finish``).
    """

    tail: bool = _RETENTION["tail"]
    interval: int | None = _RETENTION["interval"]
    junction: bool = _RETENTION["junction"]
    decode_tail: bool = _RETENTION["decode_tail"]


@dataclass(frozen=True, slots=True)
class FullAttention:
    """A group of full-attention layers: block j holds the KV of tokens ``[jB, (j+1)B)``.

    Attributes:
        block_size: B, tokens per block; a multiple of the hash unit U.
        pool: index into :attr:`CacheConfig.pools`.
    """

    kind: ClassVar[str] = "full_attention"
    block_size: int
    pool: int = 0


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """A group of sliding-window attention layers: only the last ``window`` tokens are needed.

    Blocks that left the window are released while the sequence runs.

    Attributes:
        block_size: B, tokens per block; a multiple of the hash unit U.
        window: W, tokens attended to; at least one block.
        pool: index into :attr:`CacheConfig.pools`.
    """

    kind: ClassVar[str] = "sliding_window"
    block_size: int
    window: int
    pool: int = 0


class CheckpointBackend(Protocol):
    """What :meth:`StateGroup.from_backend` reads from a kernel backend."""

    @property
    def checkpoint_alignment(self) -> int:
        """A: interior checkpoint offsets the kernel writes are multiples of it."""
        ...

    @property
    def max_checkpoints_per_step(self) -> int | None:
        """C: interior checkpoints per sequence per step (``None`` = unbounded)."""
        ...


@dataclass(frozen=True, slots=True)
class StateGroup:
    """A group of recurrent-state layers (KDA, Mamba2, Gated DeltaNet): one state per block.

    Prefer :meth:`from_backend`, so the planner and the kernel share one alignment.

    Attributes:
        alignment: A, the kernel's checkpoint alignment; must divide the hash unit U.
        max_checkpoints_per_step: C, interior checkpoints per sequence per step; ``None`` =
            unbounded, ``0`` = none (chunks then end on retained positions, see
            :meth:`prefixcache.CacheManager.suggest_chunk`).
        pool: index into :attr:`CacheConfig.pools` (running states and checkpoints share it).
        retention: which positions are checkpointed.
        checkpoint_cap: how many blocks of the pool checkpoints may hold, published ones
            included; ``None`` = only the pool bounds them.
        reserve_per_sequence: blocks kept free or evictable per running sequence before a
            checkpoint may take one, so checkpoints never make a ``schedule`` fail. State
            groups sharing a pool keep the largest reserve any of them asks for, whichever
            group checkpoints.
    """

    kind: ClassVar[str] = "state"
    alignment: int = _STATE["alignment"]
    max_checkpoints_per_step: int | None = _STATE["max_checkpoints_per_step"]
    pool: int = 0
    retention: Retention = field(default_factory=lambda: Retention(**_STATE["retention"]))
    checkpoint_cap: int | None = _STATE["checkpoint_cap"]
    reserve_per_sequence: int = _STATE["reserve_per_sequence"]

    @classmethod
    def from_backend(
        cls,
        backend: CheckpointBackend,
        pool: int = 0,
        retention: Retention | None = None,
        checkpoint_cap: int | None = _STATE["checkpoint_cap"],
        reserve_per_sequence: int = _STATE["reserve_per_sequence"],
    ) -> StateGroup:
        """A state group whose A and C are the backend's ``checkpoint_alignment`` and
        ``max_checkpoints_per_step``: the one source of truth shared with the kernel layer."""
        missing = [
            name
            for name in ("checkpoint_alignment", "max_checkpoints_per_step")
            if not hasattr(backend, name)
        ]
        if missing:
            raise TypeError(
                f"{type(backend).__name__} is not a kernel backend: it lacks {', '.join(missing)}"
            )
        return cls(
            alignment=backend.checkpoint_alignment,
            max_checkpoints_per_step=backend.max_checkpoints_per_step,
            pool=pool,
            retention=Retention(**_STATE["retention"]) if retention is None else retention,
            checkpoint_cap=checkpoint_cap,
            reserve_per_sequence=reserve_per_sequence,
        )


Group: TypeAlias = FullAttention | SlidingWindow | StateGroup
"""Any group configuration."""


@dataclass(frozen=True, slots=True)
class HashConfig:
    """How sequences are hashed (the encoding is specified in docs/HASHING.md).

    Attributes:
        algorithm: ``"xxh3_128"`` (default) or ``"sha256"``.
        seed: enters every digest; processes, ranks and routers sharing a cache must share it.
        unit: U, the hash unit in tokens; every prefix hit is a multiple of it.
        verify_tokens: a hit also compares the stored tokens (collision-proof, costs memory).
    """

    algorithm: HashAlgorithm = _HASH["algorithm"]
    seed: int = _HASH["seed"]
    unit: int = _HASH["unit"]
    verify_tokens: bool = _HASH["verify_tokens"]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Everything a :class:`prefixcache.CacheManager` is built from; checked on construction.

    Attributes:
        pools: the block pools (stored as a tuple).
        groups: the layer groups, each naming its pool (stored as a tuple).
        hash: hashing settings.
        finished_cache_bytes: bytes of finished sequences' tokens and hashes kept for
            ``add(..., extends=...)``.
        reuse_live_prefixes: an ``add`` without ``extends`` reuses the hashes of the live
            sequence added last with the same first hash unit, for the token prefix the two
            share (compared token by token, with the extra keys): a system prompt shared by
            concurrent requests is hashed once. ``Added.reused_tokens`` reports it.
        recently_evicted_capacity: how many of the latest evictions are remembered to
            explain misses (``"recently_evicted"``): a key counts as recently evicted while
            one of them evicted it.
        enable_events: record block events for ``drain_events``.
        max_pending_events: events kept before the oldest are dropped (and counted).
        max_steps_in_flight: D, how many plans may be in flight at once (1 to
            ``MAX_STEPS_IN_FLIGHT``). 1, the default, is the classic protocol; with D > 1 the
            next steps are scheduled and planned while earlier ones run (overlapped steps:
            placeholders, ``resolve``, ``decode_step_overlapped``), and a running sequence may
            hold up to D + 1 running-state blocks per state group instead of two.
        event_block_size: the block size of events on the wire
            (:meth:`CacheManager.drain_events_wire`, :mod:`prefixcache.events`): ``None`` is
            the hash unit U, so a router sees prefixes at the granularity hits are found at;
            otherwise U or a paged group's block size B.

    Raises:
        ConfigError: a rule is violated (the message says which field to change).
        TypeError: a field has the wrong type.
    """

    pools: Sequence[PoolConfig]
    groups: Sequence[Group]
    hash: HashConfig = field(default_factory=HashConfig)
    finished_cache_bytes: int = _CACHE["finished_cache_bytes"]
    reuse_live_prefixes: bool = _CACHE["reuse_live_prefixes"]
    recently_evicted_capacity: int = _CACHE["recently_evicted_capacity"]
    enable_events: bool = _CACHE["enable_events"]
    max_pending_events: int = _CACHE["max_pending_events"]
    max_steps_in_flight: int = _CACHE["max_steps_in_flight"]
    event_block_size: int | None = _CACHE["event_block_size"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", _as_tuple(self.pools, "pools"))
        object.__setattr__(self, "groups", _as_tuple(self.groups, "groups"))
        _core.validate_config(self)

    @property
    def chunk_alignment(self) -> int:
        """The grid non-final prefill chunks end on: the least common multiple of the state
        groups' alignments (1 without state groups), as
        :attr:`prefixcache.CacheManager.chunk_alignment`."""
        return _core.chunk_alignment(self)

    @property
    def min_token_budget(self) -> int:
        """The smallest per-step token budget under which a non-final prefill chunk can be
        scheduled (without ``exact``): a smaller budget schedules 0 tokens of it."""
        return _core.min_token_budget(self)

    def blocks_for_sequence(self, group: int, tokens: int, max_chunk: int | None = None) -> int:
        """The most blocks group ``group`` holds for one running sequence of ``tokens`` tokens
        (prompt and outputs) at any point of its life, when its chunks never exceed
        ``max_chunk`` tokens (any size when ``None``): what its pool must hold per sequence so
        that the sequence is never refused for its own blocks.

        Raises:
            InvalidRequestError: ``group`` is not a group of this configuration.
        """
        return _core.blocks_for_sequence(self, group, tokens, max_chunk)


@dataclass(frozen=True, slots=True)
class MultimodalInput:
    """A multimodal input (image, audio clip) occupying tokens ``[start, end)`` of a sequence.

    Attributes:
        start: first token of the range.
        end: one past the last token (exclusive); greater than ``start``.
        hash: the engine's content hash of the input (non-empty bytes).
    """

    start: int
    end: int
    hash: bytes


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides the tokens distinguishes two sequences' caches.

    Attributes:
        cache_salt: isolates tenants (``str`` is encoded as UTF-8); ``None`` = no salt.
        lora_id: the LoRA adapter the sequence runs with.
        multimodal: multimodal inputs with their token ranges, in prompt order.
    """

    cache_salt: bytes | str | None = None
    lora_id: int | None = None
    multimodal: Sequence[MultimodalInput] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "multimodal", _as_tuple(self.multimodal, "multimodal"))
