"""Type stubs of the native module ``prefixcache._core`` (import ``prefixcache`` instead).

Checked against the built module by ``python -m mypy.stubtest prefixcache._core``.
"""

from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol, TypeAlias, TypedDict, final

import numpy as np
import numpy.typing as npt

from prefixcache.config import CacheConfig, ExtraKeys

class _SupportsArray(Protocol):
    def __array__(self) -> npt.NDArray[Any]: ...

_IntArray: TypeAlias = npt.NDArray[np.integer[Any]]
# A list of ints, a 1-D NumPy integer array, or a torch CPU tensor (anything exposing __array__).
_Ints: TypeAlias = Sequence[int] | _IntArray | _SupportsArray

__all__ = [
    "ENCODING_VERSION",
    "ERROR_KINDS",
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
    "CacheManager",
    "ConfigError",
    "DuplicateSequenceError",
    "GroupHit",
    "GroupStats",
    "Hit",
    "InvalidRequestError",
    "InvariantError",
    "NothingToScheduleError",
    "PagedGroupBuffers",
    "PagedGroupPlan",
    "PlanBuffers",
    "PoolUsage",
    "PrefixCacheError",
    "ResetRefusedError",
    "Scheduled",
    "StalePlanError",
    "StateGroupBuffers",
    "StateGroupPlan",
    "Stats",
    "StepError",
    "StepPlan",
    "UnknownSequenceError",
    "__version__",
    "_error_samples",
    "aligned_geometry",
    "blocks_for_sequence",
    "chunk_alignment",
    "defaults",
    "hash_prefix",
    "is_exportable_offset",
    "min_token_budget",
    "nearest_exportable_offsets",
    "validate_config",
]
__version__: str
ENCODING_VERSION: int
# The stable name of every core error variant (`CacheError::KINDS`), each the `kind` of its own
# exception class.
ERROR_KINDS: tuple[str, ...]
# The bounds on every count the API takes (the core's `limits`); beyond one, the call raises
# `ConfigError` / `InvalidRequestError` naming it.
MAX_BATCH_SEQUENCES: int  # ids (and budgets, tokens) of one batch call
MAX_BLOCKS_PER_POOL: int
MAX_BLOCK_SIZE: int  # a paged block size or sliding window, in tokens
MAX_EXTRA_KEY_BYTES: int  # a cache salt or multimodal hash, in bytes
MAX_GROUPS: int
MAX_HASH_THREADS: int  # threads one add_batch hashes on
MAX_HASH_UNIT: int
MAX_LOOKAHEAD_TOKENS: int
MAX_STEPS_IN_FLIGHT: int
MAX_MULTIMODAL_INPUTS: int  # of one sequence
MAX_PENDING_EVENTS: int
MAX_POOLS: int
MAX_RECENTLY_EVICTED: int
MAX_SEQUENCE_TOKENS: int
MAX_STEP_TOKENS: int  # scheduled in one step, all sequences together

class PrefixCacheError(Exception):
    """Base class of every error raised by prefixcache; `kind` names the core variant."""

    kind: ClassVar[str | None]

class ConfigError(PrefixCacheError, ValueError):
    """The configuration is inconsistent; the message names the field to change."""

    kind: ClassVar[str]

class InvalidRequestError(PrefixCacheError, ValueError):
    """A request argument is out of range or malformed."""

    kind: ClassVar[str]

class UnknownSequenceError(PrefixCacheError):
    """The sequence id is not live (never added, or already finished)."""

    kind: ClassVar[str]

class DuplicateSequenceError(PrefixCacheError):
    """`add` of a sequence id that is still live."""

    kind: ClassVar[str]

class NothingToScheduleError(PrefixCacheError):
    """`schedule` of a sequence whose every token is computed: append a token first."""

    kind: ClassVar[str]

class StepError(PrefixCacheError):
    """A call the step protocol does not allow now."""

    kind: ClassVar[str]

class StalePlanError(StepError):
    """`commit` or `abort` of a plan that is not the one in flight."""

class AlignmentError(PrefixCacheError):
    """A checkpoint position the kernel cannot write."""

    kind: ClassVar[str]

class ResetRefusedError(PrefixCacheError):
    """`reset` while sequences still hold blocks."""

    kind: ClassVar[str]

class InvariantError(PrefixCacheError):
    """An internal inconsistency (a bug in prefixcache; please report it)."""

    kind: ClassVar[str]

@final
class Added:
    """What `CacheManager.add` did with the prompt's hashes."""

    @property
    def reused_tokens(self) -> int:
        """Tokens whose unit hashes were reused: from the `extends` sequence, or without it
        from a live sequence with the same prefix (`CacheConfig.reuse_live_prefixes`)."""
    @property
    def hashed_units(self) -> int:
        """Units hashed by this call."""
    @property
    def extends_found(self) -> bool:
        """Whether the `extends` sequence was found (running or in the finished cache)."""

@final
class GroupHit:
    """One group's part of a `Hit`: its own longest hit and why it stops there."""

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
    @property
    def tokens(self) -> int:
        """The group's own longest hit in tokens (a multiple of the hash unit)."""
    @property
    def stop(self) -> str | None:
        """`"not_cached"`, `"recently_evicted"`, `"no_state_at_position"`, `"window_gap"`,
        or `None` when the group reaches `Hit.max_tokens`."""

@final
class Hit:
    """The result of a lookup: the prefix every group can resume from, and per-group detail."""

    @property
    def tokens(self) -> int:
        """The reconciled hit L in tokens: every group can resume there."""
    @property
    def max_tokens(self) -> int:
        """The largest hit a lookup could return: `((N - 1) // U) * U`."""
    @property
    def junction(self) -> int | None:
        """The largest own hit of any group, when it exceeds `tokens` by two units or more."""
    @property
    def pending_tokens(self) -> int:
        """The hit once the plans in flight commit (at least `tokens`): hold the request for a
        step instead of recomputing a prefix another request is computing."""
    @property
    def pending_plan(self) -> int | None:
        """The plan `pending_tokens` waits for, or `None` when nothing in flight extends it."""
    @property
    def groups(self) -> list[GroupHit]:
        """Each group's own hit and why it stops, in group order."""

@final
class Scheduled:
    """What `schedule` gave a sequence for the next plan."""

    @property
    def seq_id(self) -> int:
        """The sequence."""
    @property
    def num_computed(self) -> int:
        """Tokens computed before this chunk (the hit used, on a first schedule)."""
    @property
    def num_tokens(self) -> int:
        """Tokens scheduled; 0 when the budget was below the chunk alignment."""
    @property
    def hit(self) -> Hit | None:
        """The hit this schedule started from (only on a sequence's first schedule)."""

@final
class PoolUsage:
    """Blocks of one pool."""

    @property
    def num_blocks(self) -> int:
        """Block ids including the null block 0."""
    @property
    def free(self) -> int:
        """Blocks never used or freed without a key."""
    @property
    def cached(self) -> int:
        """Published blocks nobody references (evictable)."""
    @property
    def owned(self) -> int:
        """Blocks referenced by sequences or by the step in flight."""
    @property
    def checkpoints(self) -> int:
        """Blocks holding checkpoints."""
    def to_dict(self) -> dict[str, int]:
        """The fields as a dict (for JSON output)."""

@final
class GroupStats:
    """Per-group counters."""

    @property
    def hit_tokens(self) -> int:
        """Tokens of reconciled hits this group served (first schedules)."""
    @property
    def evictions(self) -> int:
        """Blocks of this group evicted for reuse."""
    @property
    def checkpoints_published(self) -> int:
        """State groups: checkpoints published (decode tails included)."""
    @property
    def checkpoints_skipped(self) -> dict[str, int]:
        """State groups: retained positions not exported, by reason."""
    @property
    def misses(self) -> dict[str, int]:
        """Admissions whose own hit in this group stopped short, by reason."""
    @property
    def checkpoint_hits(self) -> int:
        """State groups: schedules that resumed from a published checkpoint."""
    @property
    def decode_tails_published(self) -> int:
        """State groups: decode-tail snapshots published by `finish`."""
    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (for JSON output)."""

@final
class Stats:
    """Manager-wide counters (a snapshot)."""

    @property
    def lookups(self) -> int:
        """`lookup` calls."""
    @property
    def lookup_hit_tokens(self) -> int:
        """Sum of reconciled hit lengths over lookups."""
    @property
    def admissions(self) -> int:
        """First schedules (admissions)."""
    @property
    def admitted_hit_tokens(self) -> int:
        """Sum of the hits used by admissions."""
    @property
    def admitted_tokens(self) -> int:
        """Sum of the prompt tokens of admissions (vLLM's prefix-cache queries)."""
    @property
    def scheduled_tokens(self) -> int:
        """Tokens scheduled."""
    @property
    def refused_schedules(self) -> int:
        """`schedule` calls that returned `None`."""
    @property
    def copies(self) -> int:
        """Copy-on-write copies planned."""
    @property
    def commits(self) -> int:
        """Plans committed."""
    @property
    def aborts(self) -> int:
        """Plans aborted."""
    @property
    def evictions(self) -> int:
        """Blocks evicted for reuse, all groups."""
    @property
    def events_dropped(self) -> int:
        """Events dropped because nobody drained them in time."""
    @property
    def groups(self) -> list[GroupStats]:
        """Per-group counters, in group order."""
    def to_dict(self) -> dict[str, Any]:
        """The counters as a dict (per-group counters under `"groups"`)."""

@final
class PagedGroupPlan:
    """One paged group's part of a plan: block-table updates and KV slots."""

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
    @property
    def appended(self) -> npt.NDArray[np.int32]:
        """`int32 [M, 3]` rows `(row, column, block)` appended to the block tables."""
    @property
    def replaced(self) -> npt.NDArray[np.int32]:
        """`int32 [M', 3]` rows `(row, column, block)` replaced (window releases: 0)."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """`int64 [T]` slot `block * block_size + offset` of each scheduled token."""
    @property
    def num_appended(self) -> int:
        """Rows of `appended`."""
    @property
    def num_replaced(self) -> int:
        """Rows of `replaced`."""

@final
class StateGroupPlan:
    """One state group's part of a plan: which slots the kernels read and write."""

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
    @property
    def running_slot(self) -> npt.NDArray[np.int32]:
        """`int32 [R]` the running-state slot each row writes."""
    @property
    def initial_slot(self) -> npt.NDArray[np.int32]:
        """`int32 [R]` the slot each row reads (-1 = zero state)."""
    @property
    def checkpoint_offsets(self) -> npt.NDArray[np.int32]:
        """`int32 [R, Cmax]` interior checkpoint offsets from the query start (0 = none)."""
    @property
    def checkpoint_slots(self) -> npt.NDArray[np.int32]:
        """`int32 [R, Cmax]` the slot of each interior checkpoint (-1 = none)."""
    @property
    def snapshots(self) -> npt.NDArray[np.int32]:
        """`int32 [S, 2]` rows `(running slot, checkpoint slot)` copied after the forward."""
    @property
    def max_checkpoints(self) -> int:
        """Cmax, the columns of `checkpoint_offsets` / `checkpoint_slots`."""
    @property
    def num_snapshots(self) -> int:
        """S, the rows of `snapshots`."""

@final
class PagedGroupBuffers:
    """One paged group's part of a plan written into `PlanBuffers`."""

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
    @property
    def num_appended(self) -> int:
        """Rows of `appended` this step."""
    @property
    def num_replaced(self) -> int:
        """Rows of `replaced` this step."""
    @property
    def appended(self) -> npt.NDArray[np.int32]:
        """`int32 [>= num_appended, 3]` rows `(row, column, block)` appended to the tables."""
    @property
    def replaced(self) -> npt.NDArray[np.int32]:
        """`int32 [>= num_replaced, 3]` rows `(row, column, block)` replaced."""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """`int64 [>= T]` the KV slot of each scheduled token."""

@final
class StateGroupBuffers:
    """One state group's part of a plan written into `PlanBuffers`."""

    @property
    def group(self) -> int:
        """Index of the group in the configuration."""
    @property
    def max_checkpoints(self) -> int:
        """Cmax this step: the columns of the checkpoint arrays in use."""
    @property
    def num_snapshots(self) -> int:
        """Rows of `snapshots` this step."""
    @property
    def running_slot(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R]` the running-state slot each row writes."""
    @property
    def initial_slot(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R]` the slot each row reads (-1 = zero state)."""
    @property
    def checkpoint_offsets(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R, >= Cmax]` interior checkpoint offsets (0 = none)."""
    @property
    def checkpoint_slots(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R, >= Cmax]` checkpoint slots (-1 = none)."""
    @property
    def snapshots(self) -> npt.NDArray[np.int32]:
        """`int32 [>= num_snapshots, 2]` rows `(running slot, checkpoint slot)`."""

@final
class PlanBuffers:
    """A step plan written in place by `CacheManager.build_plan_into` / `decode_step`: arrays
    that persist across steps (grown when a step needs more); each step's values are their
    leading rows. The next build overwrites them: finish reading the previous step first
    (reading them during a build in another thread raises `StepError`). One manager at a time:
    another manager refuses buffers whose step is still in flight. The arrays belong to the
    buffers: do not resize, reshape or retype them in place (the next build raises
    `InvalidRequestError`)."""

    def __new__(cls, rows: int = 256) -> PlanBuffers: ...
    @property
    def step_id(self) -> int | None:
        """The step the buffers hold (`None` before the first `build_plan_into`)."""
    @property
    def num_rows(self) -> int:
        """R, the scheduled sequences of this step."""
    @property
    def num_tokens(self) -> int:
        """T, the scheduled tokens of this step."""
    @property
    def num_copies(self) -> int:
        """K, the copy-on-write copies of this step."""
    @property
    def generation(self) -> int:
        """Changes whenever an array is replaced (grown): refresh kept arrays or tensors."""
    @property
    def counts(self) -> tuple[int, ...]:
        """`(num_rows, num_tokens, num_copies)`, then `(num_appended, num_replaced)` per paged
        group and `(max_checkpoints, num_snapshots)` per state group, in group order."""
    @property
    def seq_ids(self) -> npt.NDArray[np.int64]:
        """`int64 [>= R]` the scheduled sequences, in schedule order."""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R + 1]` where each row's tokens start in the packed batch."""
    @property
    def num_computed(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R]` tokens of each row computed before this step."""
    @property
    def num_scheduled(self) -> npt.NDArray[np.int32]:
        """`int32 [>= R]` tokens of each row scheduled in this step."""
    @property
    def copies(self) -> npt.NDArray[np.int64]:
        """`int64 [>= K, 4]` rows `(group, src_block, dst_block, num_tokens)`."""
    @property
    def paged(self) -> tuple[PagedGroupBuffers, ...]:
        """Per paged group, in group order."""
    @property
    def state(self) -> tuple[StateGroupBuffers, ...]:
        """Per state group, in group order."""
    def paged_group(self, group: int) -> PagedGroupBuffers:
        """The part of paged group `group` (its index in the configuration)."""
    def state_group(self, group: int) -> StateGroupBuffers:
        """The part of state group `group` (its index in the configuration)."""

@final
class StepPlan:
    """Everything the kernels need for one step (R sequences, T tokens); each array is made
    on its first read and the same array is returned on every later one."""

    @property
    def step_id(self) -> int:
        """Identifies the step; `commit` and `abort` use it."""
    @property
    def seq_ids(self) -> npt.NDArray[np.int64]:
        """`int64 [R]` the scheduled sequences, in schedule order."""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """`int32 [R + 1]` where each row's tokens start in the packed batch."""
    @property
    def num_computed(self) -> npt.NDArray[np.int32]:
        """`int32 [R]` tokens of each row computed before this step."""
    @property
    def num_scheduled(self) -> npt.NDArray[np.int32]:
        """`int32 [R]` tokens of each row scheduled in this step."""
    @property
    def copies(self) -> npt.NDArray[np.int64]:
        """`int64 [K, 4]` rows `(group, src_block, dst_block, num_tokens)`."""
    @property
    def paged(self) -> list[PagedGroupPlan]:
        """Per paged group, in group order."""
    @property
    def state(self) -> list[StateGroupPlan]:
        """Per state group, in group order."""
    @property
    def num_rows(self) -> int:
        """R, the scheduled sequences."""
    @property
    def num_tokens(self) -> int:
        """T, the scheduled tokens."""
    @property
    def num_copies(self) -> int:
        """K, the copy-on-write copies (the rows of `copies`)."""
    @property
    def counts(self) -> tuple[int, ...]:
        """`(num_rows, num_tokens, num_copies)`, then `(num_appended, num_replaced)` per paged
        group and `(max_checkpoints, num_snapshots)` per state group, in group order."""
    def paged_group(self, group: int) -> PagedGroupPlan:
        """The part of paged group `group` (its index in the configuration)."""
    def state_group(self, group: int) -> StateGroupPlan:
        """The part of state group `group` (its index in the configuration)."""

@final
class BlockStored:
    """A run of keys published at a commit (or a decode-tail checkpoint at `finish`):
    consecutive unit keys of one group, possibly across several blocks."""

    @property
    def sequence(self) -> int:
        """Sequence number of the event (strictly increasing)."""
    @property
    def group(self) -> int:
        """The group the block belongs to."""
    @property
    def block(self) -> int:
        """The block carrying the first key (its id in its group's pool)."""
    @property
    def blocks(self) -> list[int]:
        """The block carrying each key."""
    @property
    def keys(self) -> list[bytes]:
        """The keys added, in position order (digest bytes)."""
    @property
    def parent(self) -> bytes | None:
        """The key just before the first added one (`None` at the start)."""
    @property
    def token_start(self) -> int:
        """First token covered by the added keys."""
    @property
    def token_end(self) -> int:
        """One past the last token covered by the added keys."""
    @property
    def checkpoint(self) -> bool:
        """Whether the block is a recurrent-state checkpoint."""
    @property
    def tokens(self) -> list[int]:
        """The token ids `[tokens_start, token_end)` (the run's, preceded by those of the wire
        block its first key falls in)."""
    @property
    def tokens_start(self) -> int:
        """First token of `tokens`."""
    @property
    def lora_id(self) -> int | None:
        """The sequence's adapter id."""
    @property
    def cache_salt(self) -> bytes | None:
        """The sequence's cache salt, when the run starts at token 0."""

@final
class BlockRemoved:
    """A block lost every key (it was evicted for reuse)."""

    @property
    def sequence(self) -> int:
        """Sequence number of the event."""
    @property
    def group(self) -> int:
        """The group the block belonged to."""
    @property
    def block(self) -> int:
        """The block id in its group's pool."""
    @property
    def keys(self) -> list[bytes]:
        """Every key the block lost (digest bytes)."""
    @property
    def gone(self) -> list[bytes]:
        """The keys at wire-block boundaries no block of the group carries any more."""

@final
class AllBlocksCleared:
    """`reset` dropped every cached block and key."""

    @property
    def sequence(self) -> int:
        """Sequence number of the event."""

@final
class CacheManager:
    """The prefix-cache manager: block pools, prefix hashing, eviction, checkpoint planning.

    Thread-safe; long work (hashing, lookups, plan building) runs without the GIL.
    """

    def __new__(cls, config: CacheConfig) -> CacheManager:
        """Builds a manager from a validated `CacheConfig`."""
    @property
    def config(self) -> CacheConfig:
        """The configuration this manager was built from."""
    @property
    def chunk_alignment(self) -> int:
        """The grid non-final prefill chunks end on (lcm of the state alignments)."""
    @property
    def num_sequences(self) -> int:
        """Number of live sequences."""
    @property
    def num_finished_cached(self) -> int:
        """Number of finished sequences kept for `add(..., extends=...)`."""
    @property
    def plan_in_flight(self) -> int | None:
        """The step id of the plan in flight, or `None`; `commit_step` / `abort_step` end it
        by this id."""
    @property
    def plans_in_flight(self) -> list[int]:
        """Every plan in flight, oldest first (at most `config.max_steps_in_flight`)."""
    def add(
        self,
        seq_id: int,
        tokens: _Ints,
        extra_keys: ExtraKeys | None = None,
        extends: int | None = None,
    ) -> Added:
        """Registers a sequence and hashes its full units (without the GIL).

        With `extends`, the hashes of the prefix shared with that sequence are reused and only
        the new tail is hashed (also without the GIL).
        """
    def add_batch(
        self,
        seq_ids: _Ints,
        prompts: Sequence[_Ints],
        extends: Sequence[int | None] | None = None,
        extra_keys: Sequence[ExtraKeys | None] | None = None,
        threads: int | None = None,
    ) -> list[Added]:
        """`add` of several sequences in one call: the same sequences, digests and results as
        `add` of each in order (reuse among the batch's own requests included), the prompts
        hashed on up to `threads` threads (default: one per core, at most
        `MAX_HASH_THREADS`) without the GIL.

        `extends` and `extra_keys`: one entry (or `None`) per id. All or nothing: when `add`
        would refuse a request (a live or repeated id, an empty prompt, bad extra keys), the
        call raises that request's error and admits none of them.
        """
    def lookup(self, seq_id: int) -> Hit:
        """The hit the sequence would get now (changes no cache state)."""
    def schedule(
        self, seq_id: int, max_tokens: int, lookahead: int = 0, exact: bool = False
    ) -> Scheduled | None:
        """Schedules up to `max_tokens` tokens; `None` when out of blocks."""
    def schedule_batch(
        self, seq_ids: _Ints, max_tokens: int | _Ints, exact: bool = False
    ) -> list[Scheduled | None]:
        """`schedule` for many sequences in one call (results in input order)."""
    def schedule_tokens(
        self, seq_ids: _Ints, max_tokens: int | _Ints, exact: bool = False
    ) -> npt.NDArray[np.int32]:
        """`schedule_batch` without result objects: tokens scheduled per sequence, -1 when
        out of blocks."""
    def request_checkpoint(self, seq_id: int, position: int) -> None:
        """Asks for a checkpoint at `position` in the chunk scheduled for the next plan."""
    def suggest_chunk(self, seq_id: int, token_budget: int) -> int:
        """Tokens to schedule so the chunk ends on the next retained position."""
    def build_plan(self) -> StepPlan:
        """Builds the plan of every sequence scheduled since the last plan."""
    def build_plan_into(self, buffers: PlanBuffers) -> int:
        """`build_plan` written into persistent `buffers`; returns the step id. Buffers holding
        another manager's step still in flight there are refused (`StepError`)."""
    def decode_step(
        self, buffers: PlanBuffers, seq_ids: _Ints, tokens: _Ints
    ) -> npt.NDArray[np.int32]:
        """Commits the step `buffers` hold, appends one token to each sequence, schedules one
        token of each and writes the plan into `buffers`: tokens scheduled, -1 when out of
        blocks. Buffers holding another manager's step still in flight are refused."""
    def commit(self, plan: StepPlan | PlanBuffers) -> None:
        """Publishes what the plan's step wrote and advances every sequence in it."""
    def abort(self, plan: StepPlan | PlanBuffers) -> list[int]:
        """Undoes the plan's step, and every later plan in flight: every sequence is back where
        it was. Returns the ids of the plans ended, oldest first."""
    def commit_step(self, step_id: int) -> None:
        """`commit` by step id (`plan_in_flight`), for a step whose plan object is no longer at
        hand; only once the forward of that very plan has run."""
    def abort_step(self, step_id: int) -> list[int]:
        """`abort` by step id (`plan_in_flight`): the way out for a step whose `StepPlan` or
        `PlanBuffers` was lost or overwritten; `StalePlanError` unless it is in flight."""
    def append(self, seq_id: int, tokens: _Ints, placeholders: int | None = None) -> None:
        """Appends tokens to a sequence, then `placeholders` tokens not yet sampled."""
    def append_placeholders(self, seq_ids: _Ints) -> None:
        """One placeholder per sequence (an overlapped decode step) in one call."""
    def resolve(self, seq_id: int, tokens: _Ints) -> None:
        """Fills the oldest placeholders with the sampled tokens; publishes what became known."""
    def resolve_batch(self, seq_ids: _Ints, tokens: _Ints) -> None:
        """`resolve` of one token per sequence in one call."""
    def num_placeholders(self, seq_id: int) -> int:
        """Placeholder tokens of a live sequence not yet resolved."""
    def decode_step_overlapped(
        self,
        buffers: PlanBuffers,
        seq_ids: _Ints,
        resolve_ids: _Ints | None = None,
        tokens: _Ints | None = None,
        commit: int | None = None,
    ) -> npt.NDArray[np.int32]:
        """Commits step `commit`, resolves `tokens` into `resolve_ids`, appends a placeholder to
        each of `seq_ids`, schedules one token each and writes the plan into `buffers` (which
        must not hold a plan in flight): tokens scheduled, -1 when out of blocks."""
    def append_batch(self, seq_ids: _Ints, tokens: _Ints) -> None:
        """One token per sequence (a decode step) in one call."""
    def finish(self, seq_id: int) -> None:
        """Releases a sequence's blocks and publishes its decode-tail checkpoint."""
    def preempt(self, seq_id: int) -> None:
        """Releases a sequence's blocks; it restarts from a fresh lookup."""
    def reset(self) -> None:
        """Drops every cached block and key."""
    def block_table(self, group: int, seq_ids: _Ints) -> npt.NDArray[np.int32]:
        """Full block-table rows `int32 [R, C]` of a paged group."""
    def drain_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """Takes the pending block events, oldest first."""
    def drain_events_wire(
        self, ts: float, data_parallel_rank: int | None = None
    ) -> tuple[bytes | None, int, int]:
        """Takes the pending block events as one vLLM 0.33 `KVEventBatch` payload (msgpack);
        `(payload, taken, written)`, `payload` `None` when no wire event was written."""
    def stats(self) -> Stats:
        """A snapshot of the counters."""
    def pool_usage(self) -> list[PoolUsage]:
        """Block usage per pool, in pool order."""
    def check_invariants(self) -> None:
        """Checks every internal invariant; `InvariantError` on a violation."""
    def num_computed(self, seq_id: int) -> int:
        """Tokens of a live sequence computed and committed so far."""
    def num_tokens(self, seq_id: int) -> int:
        """Tokens of a live sequence (prompt plus appended)."""

def hash_prefix(
    tokens: _Ints,
    unit: int = 16,
    algorithm: str = "xxh3_128",
    seed: int = 0,
    extra_keys: ExtraKeys | None = None,
) -> list[bytes]:
    """The digests of every full unit of `tokens`, as bytes."""

def validate_config(config: CacheConfig) -> None:
    """Checks a `CacheConfig`; raises what `CacheManager` would."""

def _error_samples() -> list[tuple[str, PrefixCacheError]]:
    """One exception of every core error variant, as `(kind, exception)` pairs."""

class _RetentionDefaults(TypedDict):
    tail: bool
    interval: int | None
    junction: bool
    decode_tail: bool

class _StateGroupDefaults(TypedDict):
    alignment: int
    max_checkpoints_per_step: int | None
    retention: _RetentionDefaults
    checkpoint_cap: int | None
    reserve_per_sequence: int

class _HashDefaults(TypedDict):
    algorithm: Literal["xxh3_128", "sha256"]
    seed: int
    unit: int
    verify_tokens: bool

class _CacheDefaults(TypedDict):
    finished_cache_bytes: int
    reuse_live_prefixes: bool
    recently_evicted_capacity: int
    enable_events: bool
    max_pending_events: int
    max_steps_in_flight: int
    event_block_size: int | None

class _Defaults(TypedDict):
    cache: _CacheDefaults
    hash: _HashDefaults
    state_group: _StateGroupDefaults
    retention: _RetentionDefaults

def defaults() -> _Defaults:
    """The core's default of every configuration field that has one, keyed by the Python
    field names (a new dict on every call)."""

def is_exportable_offset(offset: int, alignment: int, query_len: int) -> bool:
    """Whether a kernel of checkpoint alignment `alignment` can write an interior checkpoint at
    chunk-relative `offset` of a query of `query_len` tokens: `0 < offset < query_len` and
    `offset % alignment == 0` (alignment 0: never)."""

def nearest_exportable_offsets(offset: int, alignment: int, query_len: int) -> list[int]:
    """The exportable offsets nearest to `offset` (the largest at or below it, the smallest
    above it, where they exist), ascending; empty when the query has none."""

def aligned_geometry(unit: int, block_size: int, alignment: int) -> tuple[int, int]:
    """`(lcm(unit, alignment), lcm(block_size, that unit))`: the smallest hash unit and block
    size a kernel of checkpoint alignment `alignment` accepts; `ConfigError` beyond the
    limits."""

def chunk_alignment(config: CacheConfig) -> int:
    """The grid non-final prefill chunks of `config` end on (lcm of its state alignments)."""

def min_token_budget(config: CacheConfig) -> int:
    """The smallest per-step token budget under which a non-final prefill chunk can be
    scheduled without `exact`."""

def blocks_for_sequence(
    config: CacheConfig, group: int, tokens: int, max_chunk: int | None = None
) -> int:
    """The most blocks group `group` holds for one running sequence of `tokens` tokens,
    scheduled in chunks of at most `max_chunk` tokens (any size when `None`)."""
