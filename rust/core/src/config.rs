//! Configuration of a [`crate::CacheManager`]: pools, groups, hashing, retention; the rules
//! stated once for every caller; and the validated group layout.
//!
//! Validation lives here and runs once in `CacheManager::new`; every rule violated yields a
//! [`CacheError::Config`] whose message names the field and what to change. After validation
//! the manager relies on: U >= 1, U divides every paged block size, every state alignment A
//! divides U, windows are at least one block, every pool has at least one usable block.
//!
//! The rules the engine and the kernel layer ask for live here, each written once: the
//! checkpoint-offset rule (`is_exportable_offset`, `nearest_exportable_offsets`), the chunk
//! grid (`CheckpointGrid`), the smallest token budget, the aligned geometry, the blocks one
//! sequence holds (`CacheConfig::blocks_for_sequence`) and the retained positions
//! (`Retention::retained`). `GroupLayout` is the configuration as the manager works with it.
//! This file holds no state and touches no block.

use crate::error::{CacheError, Result};
use crate::hashing::HashConfig;

pub use crate::limits::MAX_BLOCKS_PER_POOL;
use crate::limits::{
    MAX_BLOCK_SIZE, MAX_GROUPS, MAX_HASH_UNIT, MAX_PENDING_EVENTS, MAX_POOLS, MAX_RECENTLY_EVICTED,
    MAX_STEPS_IN_FLIGHT,
};

/// One block pool: ids `0..num_blocks`, id 0 being the null block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Number of block ids including the null block 0 (so `num_blocks - 1` usable blocks).
    pub num_blocks: u32,
}

/// Which checkpoint positions a state group keeps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retention {
    /// The last unit boundary strictly before the prompt's end (what a resend resumes from).
    pub tail: bool,
    /// Every `interval` tokens (a multiple of U); `None` = off. `Some(B)` reproduces block caching.
    pub interval: Option<u32>,
    /// Where this sequence's prompt diverged from another cached one (see `Hit::junction`).
    pub junction: bool,
    /// The running state after a decode step that ends on a unit boundary, kept privately and
    /// published by `finish`.
    pub decode_tail: bool,
}

impl Default for Retention {
    fn default() -> Self {
        Self { tail: true, interval: None, junction: true, decode_tail: true }
    }
}

impl Retention {
    /// The positions this policy retains for one sequence whose prefill was scheduled with
    /// `target` tokens known and whose lookup found `junction`: the one statement of the
    /// retention candidates (the planner and `suggest_chunk` both read it).
    #[must_use]
    pub(crate) fn retained(&self, unit: u32, target: u32, junction: Option<u32>) -> Retained {
        Retained {
            tail: (self.tail && target > 0).then(|| (target - 1) / unit * unit),
            junction: junction.filter(|_| self.junction),
            interval: self.interval,
        }
    }
}

/// A sequence's retained positions under a [`Retention`] (see `Retention::retained`): the tail
/// (the last unit boundary before the prefill's end), the junction, and every multiple of the
/// interval. Decode-tail snapshots are the planner's own rule (they depend on the step).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Retained {
    tail: Option<u32>,
    junction: Option<u32>,
    interval: Option<u32>,
}

impl Retained {
    /// The explicit positions in priority order: the tail, then the junction (either may be
    /// outside a given chunk; the two may coincide).
    pub(crate) fn explicit(self) -> impl Iterator<Item = u32> {
        self.tail.into_iter().chain(self.junction)
    }

    /// The interval positions in `(start, end]`, latest first: generated, never collected, so
    /// a long chunk with a small interval costs time in proportion to its length, not memory.
    pub(crate) fn intervals(self, start: u32, end: u32) -> impl DoubleEndedIterator<Item = u32> {
        self.interval
            .into_iter()
            .flat_map(move |k| ((start / k + 1)..=(end / k)).rev().map(move |i| i * k))
    }

    /// The earliest retained position in `(start, end]`, if any.
    pub(crate) fn earliest_in(self, start: u32, end: u32) -> Option<u32> {
        let inside = |p: &u32| *p > start && *p <= end;
        self.explicit().filter(inside).chain(self.intervals(start, end).next_back()).min()
    }
}

/// A recurrent-state group: one state snapshot per block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateGroupConfig {
    /// The kernel's checkpoint alignment A (interior checkpoints need `(p - qs) % A == 0`).
    pub alignment: u32,
    /// Interior checkpoints per sequence per step C; `None` = unbounded, `Some(0)` = none.
    pub max_checkpoints_per_step: Option<u32>,
    /// Which positions are kept.
    pub retention: Retention,
    /// How many blocks of the pool checkpoints may hold (published ones included); `None` = the
    /// pool is the only bound.
    pub checkpoint_cap: Option<u32>,
    /// Blocks kept free or evictable per running sequence before a checkpoint may take one.
    /// State groups sharing a pool keep the largest reserve any of them asks for, whichever
    /// group checkpoints (`GroupLayout::checkpoint_reserve`).
    pub reserve_per_sequence: u32,
}

impl Default for StateGroupConfig {
    fn default() -> Self {
        Self {
            alignment: 1,
            max_checkpoints_per_step: None,
            retention: Retention::default(),
            checkpoint_cap: None,
            reserve_per_sequence: 2,
        }
    }
}

/// What kind of layers a group holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupKind {
    /// Block j holds the KV of tokens `[jB, (j+1)B)`.
    FullAttention { block_size: u32 },
    /// Like full attention, but only the last `window` tokens are needed.
    SlidingWindow { block_size: u32, window: u32 },
    /// Recurrent layers: running states and checkpoints.
    State(StateGroupConfig),
}

impl GroupKind {
    /// The paged block size, `None` for state groups.
    #[must_use]
    pub fn block_size(&self) -> Option<u32> {
        match self {
            Self::FullAttention { block_size } | Self::SlidingWindow { block_size, .. } => {
                Some(*block_size)
            }
            Self::State(_) => None,
        }
    }
}

/// One group of layers sharing a block table, drawing from `pool`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupConfig {
    pub kind: GroupKind,
    /// Index into [`CacheConfig::pools`].
    pub pool: usize,
}

/// A paged group (full attention or sliding window) of the layout.
#[derive(Clone, Debug)]
pub(crate) struct PagedGroup {
    /// Its index in `CacheConfig::groups` (how plans, stats and events name it).
    pub index: usize,
    pub block_size: u32,
    /// The sliding window W; `None` for full attention.
    pub window: Option<u32>,
    pub pool: usize,
}

/// A state group of the layout.
#[derive(Clone, Debug)]
pub(crate) struct StateGroup {
    /// Its index in `CacheConfig::groups`.
    pub index: usize,
    pub config: StateGroupConfig,
    pub pool: usize,
}

/// Where a group (by config index) sits in the layout's typed collections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GroupSlot {
    Paged(usize),
    State(usize),
}

/// The validated group layout, built once from a valid configuration: the paged groups and
/// the state groups in two typed collections (each in config order), which a sequence's
/// blocks and a step's work mirror (`Sequence::paged[i]` belongs to `paged[i]`), so a paged
/// group's data can only meet a paged group's; and per config index where the group sits,
/// for everything that goes through the groups in config order (allocation, release,
/// publication, the hit rule, the plan's parts).
#[derive(Clone, Debug)]
pub(crate) struct GroupLayout {
    pub paged: Vec<PagedGroup>,
    pub state: Vec<StateGroup>,
    /// Per config index.
    pub slots: Vec<GroupSlot>,
    /// Per config index, the group's pool.
    pub pool_of: Vec<usize>,
    /// Per pool, the blocks each started sequence keeps out of checkpoints' reach
    /// (`GroupLayout::checkpoint_reserves`).
    pub checkpoint_reserve: Vec<u64>,
}

impl GroupLayout {
    /// The layout of `config` (validated by the caller).
    pub fn new(config: &CacheConfig) -> Self {
        let (mut paged, mut state, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for (index, g) in config.groups.iter().enumerate() {
            let pool = g.pool;
            slots.push(match &g.kind {
                GroupKind::FullAttention { block_size } => {
                    paged.push(PagedGroup { index, block_size: *block_size, window: None, pool });
                    GroupSlot::Paged(paged.len() - 1)
                }
                GroupKind::SlidingWindow { block_size, window } => {
                    let (block_size, window) = (*block_size, Some(*window));
                    paged.push(PagedGroup { index, block_size, window, pool });
                    GroupSlot::Paged(paged.len() - 1)
                }
                GroupKind::State(s) => {
                    state.push(StateGroup { index, config: s.clone(), pool });
                    GroupSlot::State(state.len() - 1)
                }
            });
        }
        let pool_of = config.groups.iter().map(|g| g.pool).collect();
        let checkpoint_reserve =
            Self::checkpoint_reserves(&state, config.pools.len(), config.max_steps_in_flight);
        Self { paged, state, slots, pool_of, checkpoint_reserve }
    }

    /// The reserve of each pool, per started sequence: the blocks a checkpoint of any of its
    /// state groups must leave free or evictable, so that checkpoints never make a running
    /// sequence's `schedule` fail (DESIGN sections 4 and 10). The reserve is the pool's, not a
    /// group's: every group's checkpoints draw on the same blocks, so the pool keeps the
    /// largest `reserve_per_sequence` any of its state groups asks for (a smaller one would
    /// let that group take what another group promised its sequences), plus, at depth D, the
    /// D - 1 further running buffers a sequence's continuations take in each state group of
    /// the pool.
    fn checkpoint_reserves(state: &[StateGroup], pools: usize, depth: u32) -> Vec<u64> {
        let mut reserve = vec![0u64; pools];
        let mut states = vec![0u64; pools];
        for group in state {
            let r = &mut reserve[group.pool];
            *r = (*r).max(u64::from(group.config.reserve_per_sequence));
            states[group.pool] += 1;
        }
        let further = u64::from(depth.max(1) - 1);
        reserve.iter().zip(&states).map(|(r, k)| r + further * k).collect()
    }

    /// Number of groups.
    #[inline]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// The pool of group `g` (config index).
    #[inline]
    pub fn pool(&self, g: usize) -> usize {
        self.pool_of[g]
    }

    /// The paged group with config index `g`, if it is one.
    #[inline]
    pub fn paged_group(&self, g: usize) -> Option<&PagedGroup> {
        match self.slots.get(g)? {
            GroupSlot::Paged(i) => Some(&self.paged[*i]),
            GroupSlot::State(_) => None,
        }
    }
}

/// Everything a [`crate::CacheManager`] is built from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheConfig {
    pub hash: HashConfig,
    pub pools: Vec<PoolConfig>,
    pub groups: Vec<GroupConfig>,
    /// Bytes of finished sequences' tokens and hashes kept for `add(.., extends)`.
    pub finished_cache_bytes: usize,
    /// An `add` without `extends` reuses the hashes of the live sequence added last with the
    /// same first unit, for the token prefix the two share (compared, not trusted): a system
    /// prompt shared by concurrent requests is hashed once, not once per request.
    pub reuse_live_prefixes: bool,
    /// How many of the latest evictions are remembered to explain misses (`recently_evicted`):
    /// a key counts as recently evicted while one of them evicted it.
    pub recently_evicted_capacity: usize,
    /// Record block events for `drain_events`.
    pub enable_events: bool,
    /// Pending events kept before the oldest are dropped (and counted).
    pub max_pending_events: usize,
    /// D: how many plans may be in flight at once (built, not yet committed or aborted). 1,
    /// the default, is the classic protocol; with D > 1 the next steps are scheduled and
    /// planned while earlier ones run (overlapped steps), and a sequence in j in-flight steps
    /// holds j + 1 running-state blocks per state group (two at rest).
    pub max_steps_in_flight: u32,
    /// The block size W of events on the wire (`drain_events_wire`): `None` is the hash unit U
    /// (routers see prefixes at the granularity hits are found at); otherwise U or a paged
    /// group's block size B.
    pub event_block_size: Option<u32>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            hash: HashConfig::default(),
            pools: Vec::new(),
            groups: Vec::new(),
            finished_cache_bytes: 64 << 20,
            reuse_live_prefixes: true,
            recently_evicted_capacity: 4096,
            enable_events: true,
            max_pending_events: 1 << 20,
            max_steps_in_flight: 1,
            event_block_size: None,
        }
    }
}

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The least common multiple of two positive numbers, `None` beyond `u32`.
fn lcm(a: u32, b: u32) -> Option<u32> {
    (a / gcd(a, b)).checked_mul(b)
}

/// The checkpoint-offset rule: whether a kernel with checkpoint alignment `alignment` can write
/// an interior checkpoint at chunk-relative `offset` of a query of `query_len` tokens. It can
/// iff `0 < offset < query_len` and `offset % alignment == 0`; an alignment of 0 allows none.
/// (The chunk end, `offset == query_len`, is no interior checkpoint: a snapshot after the step
/// serves it, whatever the alignment.)
#[must_use]
#[inline]
pub fn is_exportable_offset(offset: u32, alignment: u32, query_len: u32) -> bool {
    alignment > 0 && offset > 0 && offset < query_len && offset % alignment == 0
}

/// The exportable offsets (see [`is_exportable_offset`]) nearest to `offset`: the largest one
/// at or below it and the smallest one above it, each where it exists, in ascending order.
/// Empty when the query has no exportable offset (`query_len <= alignment`, or alignment 0).
#[must_use]
pub fn nearest_exportable_offsets(offset: u32, alignment: u32, query_len: u32) -> Vec<u32> {
    if alignment == 0 || query_len == 0 {
        return Vec::new();
    }
    let last = (query_len - 1) / alignment * alignment;
    let below = offset.min(last) / alignment * alignment;
    let above = (u64::from(offset) / u64::from(alignment) + 1) * u64::from(alignment);
    let mut out = Vec::with_capacity(2);
    if is_exportable_offset(below, alignment, query_len) {
        out.push(below);
    }
    if above < u64::from(query_len) {
        out.push(above as u32);
    }
    out
}

/// The smallest geometry the manager accepts for a kernel of checkpoint alignment `alignment`,
/// starting from hash unit `unit` and paged block size `block_size`: `(U', B')` with `U'` the
/// least common multiple of `unit` and `alignment` (the alignment must divide the unit) and
/// `B'` that of `block_size` and `U'` (the unit must divide the block size). Unchanged when
/// the alignment already divides the unit and the unit the block size. A zero argument, or a
/// result beyond `u32` or the limits (`MAX_HASH_UNIT`, `MAX_BLOCK_SIZE`), is a config error.
pub fn aligned_geometry(unit: u32, block_size: u32, alignment: u32) -> Result<(u32, u32)> {
    for (name, value) in [("hash unit", unit), ("block size", block_size), ("alignment", alignment)]
    {
        if value == 0 {
            return Err(CacheError::config(format!("{name} must be at least 1, got 0")));
        }
    }
    let aligned_unit = lcm(unit, alignment).filter(|&u| u <= MAX_HASH_UNIT).ok_or_else(|| {
        CacheError::config(format!(
            "the hash unit aligned to the checkpoint alignment, lcm({unit}, {alignment}), is \
             larger than the supported {MAX_HASH_UNIT} tokens"
        ))
    })?;
    let aligned_block =
        lcm(block_size, aligned_unit).filter(|&b| b <= MAX_BLOCK_SIZE).ok_or_else(|| {
            CacheError::config(format!(
                "the block size aligned to the hash unit, lcm({block_size}, {aligned_unit}), is \
                 larger than the supported {MAX_BLOCK_SIZE} tokens"
            ))
        })?;
    Ok((aligned_unit, aligned_block))
}

/// The alignment grid of a configuration: where non-final prefill chunks end and where a
/// checkpoint may be asked for in a chunk. The one statement of both rules; `alignment` is the
/// chunk alignment (the least common multiple of the state groups' alignments, which divides
/// the hash unit once the configuration is valid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointGrid {
    /// The hash unit U: checkpoints sit on its multiples.
    pub unit: u32,
    /// The chunk alignment A.
    pub alignment: u32,
}

impl CheckpointGrid {
    /// Where a chunk that would end at `end` of a sequence of `total` tokens ends: a non-final
    /// chunk is trimmed down to an absolute multiple of the alignment (possibly its start, when
    /// the budget is below the grid step); the final chunk is not trimmed.
    #[must_use]
    #[inline]
    pub fn trim_chunk_end(&self, end: u32, total: u32) -> u32 {
        if end < total {
            end / self.alignment * self.alignment
        } else {
            end
        }
    }

    /// Whether a checkpoint may be asked for at `position` in the chunk `[start, end)`: on a
    /// unit boundary, and either the chunk end (a snapshot after the step) or at an offset from
    /// the chunk start the kernel can export (`is_exportable_offset`).
    #[must_use]
    pub fn accepts(&self, position: u32, start: u32, end: u32) -> bool {
        position > start
            && position <= end
            && position % self.unit == 0
            && (position == end
                || is_exportable_offset(position - start, self.alignment, end - start))
    }

    /// The positions of chunk `[start, end)` that `accepts`, described without listing them (a
    /// chunk may span millions of units): their number, and those nearest to `position` (the
    /// largest at or below it and the smallest above it, where they exist). The alignment
    /// divides the unit, so either every unit boundary of the chunk is on the grid (the chunk
    /// starts on an alignment multiple) or only its end is (when the end is a unit boundary).
    #[must_use]
    pub fn nearest_positions(&self, position: u32, start: u32, end: u32) -> (u32, Vec<u32>) {
        let unit = self.unit;
        let every_boundary = start % self.alignment == 0;
        let end_valid = end % unit == 0 && end > start;
        let count = if every_boundary { end / unit - start / unit } else { u32::from(end_valid) };
        let below = if every_boundary {
            let q = position.min(end) / unit * unit;
            (q > start).then_some(q)
        } else {
            (end_valid && end <= position).then_some(end)
        };
        let above = if every_boundary {
            let q = (u64::from(position.max(start)) / u64::from(unit) + 1) * u64::from(unit);
            (q <= u64::from(end)).then_some(q as u32)
        } else {
            (end_valid && end > position).then_some(end)
        };
        (count, below.into_iter().chain(above).collect())
    }
}

impl CacheConfig {
    /// The least common multiple of the state groups' alignments (1 without state groups):
    /// non-final prefill chunks are trimmed to end on a multiple of it.
    #[must_use]
    pub fn chunk_alignment(&self) -> u32 {
        self.groups.iter().fold(1, |acc, g| match &g.kind {
            GroupKind::State(s) if s.alignment > 0 => acc / gcd(acc, s.alignment) * s.alignment,
            _ => acc,
        })
    }

    /// The alignment grid of this configuration (its hash unit and chunk alignment).
    #[must_use]
    pub fn checkpoint_grid(&self) -> CheckpointGrid {
        CheckpointGrid { unit: self.hash.unit, alignment: self.chunk_alignment() }
    }

    /// The smallest per-step token budget under which a non-final prefill chunk can be
    /// scheduled (without `exact`): below it, trimming to the chunk grid leaves nothing.
    #[must_use]
    pub fn min_token_budget(&self) -> u32 {
        self.chunk_alignment()
    }

    /// The most blocks group `group` holds for one running sequence of `tokens` tokens (prompt
    /// and outputs, no lookahead) at any point of its life, scheduled in chunks of any size:
    /// what a pool must hold per sequence for that sequence never to be refused for its own
    /// blocks. See [`CacheConfig::blocks_for_chunked_sequence`], of which this is the case
    /// `max_chunk = tokens`.
    pub fn blocks_for_sequence(&self, group: usize, tokens: u32) -> Result<u32> {
        self.blocks_for_chunked_sequence(group, tokens, tokens)
    }

    /// `blocks_for_sequence` for a sequence whose chunks never exceed `max_chunk` tokens (the
    /// engine's per-step token budget); only a sliding window and the checkpoints a state
    /// group plans depend on it. What the manager allocates, group by group (blocks the
    /// sequence holds, its own or cached ones it pins):
    /// - full attention: its table, `ceil(tokens / B)`, plus the copy-on-write source pinned
    ///   during its first step when a hit may end inside a block (`U < B`; the destination is
    ///   a table entry);
    /// - sliding window: the table entries the window still reads while chunks are scheduled,
    ///   `ceil((W + D * chunk + B - 1) / B)` at most (the window's blocks plus those of the D
    ///   chunks in flight), never more than the table, plus the copy-on-write source as above;
    /// - state: the running buffers (two, and one more per further step in flight: D + 1),
    ///   plus either the checkpoint resumed from (pinned until the first commit) or the private
    ///   decode-tail snapshot (held from a decode step on), plus what the D steps in flight
    ///   plan before their commits: each at most C interior checkpoints (bounded by the unit
    ///   boundaries inside a chunk) and one snapshot at the chunk end; the checkpoint cap
    ///   bounds every checkpoint block of the group, so these together.
    ///
    /// D is `max_steps_in_flight`; with D = 1 these are the classic figures.
    ///
    /// A sequence of 0 tokens holds nothing. `group` out of range, or a count beyond `u32`,
    /// is an `InvalidRequest`.
    pub fn blocks_for_chunked_sequence(
        &self,
        group: usize,
        tokens: u32,
        max_chunk: u32,
    ) -> Result<u32> {
        let Some(config) = self.groups.get(group) else {
            return Err(CacheError::invalid(format!(
                "group {group} does not exist (there are {} groups)",
                self.groups.len()
            )));
        };
        if tokens == 0 {
            return Ok(0);
        }
        let unit = u64::from(self.hash.unit.max(1));
        let (tokens, chunk) = (u64::from(tokens), u64::from(max_chunk.clamp(1, tokens)));
        let depth = u64::from(self.max_steps_in_flight.max(1));
        // A hit ends inside a block only when units are smaller than blocks and the sequence
        // has a unit boundary before its last token.
        let cow_source = |block: u64| u64::from(unit < block && tokens > unit);
        let blocks = match &config.kind {
            GroupKind::FullAttention { block_size } => {
                let block = u64::from(*block_size);
                tokens.div_ceil(block) + cow_source(block)
            }
            GroupKind::SlidingWindow { block_size, window } => {
                let block = u64::from(*block_size);
                let read = (u64::from(*window) + depth * chunk + block - 1).div_ceil(block);
                tokens.div_ceil(block).min(read) + cow_source(block)
            }
            GroupKind::State(state) => {
                // Unit boundaries strictly inside a chunk, and whether one can end a chunk.
                let inside = (chunk - 1).div_ceil(unit).min((tokens - 1) / unit);
                let interior =
                    state.max_checkpoints_per_step.map_or(inside, |c| inside.min(u64::from(c)));
                let planned = if tokens >= unit { depth * (interior + 1) } else { 0 };
                // A hit (hence a resume pin) is a unit boundary below the last token.
                let resume = u64::from(tokens > unit);
                let decode_tail = u64::from(state.retention.decode_tail && tokens >= unit);
                // Every checkpoint block of the group, held or cached, counts against its cap.
                let capped = |n: u64| state.checkpoint_cap.map_or(n, |cap| n.min(u64::from(cap)));
                1 + depth + capped(resume + planned).max(capped(decode_tail + planned))
            }
        };
        u32::try_from(blocks).map_err(|_| {
            CacheError::invalid(format!(
                "group {group} would need {blocks} blocks for one sequence: more than a pool holds"
            ))
        })
    }

    /// Whether any group is a state group.
    #[must_use]
    pub fn has_state_groups(&self) -> bool {
        self.groups.iter().any(|g| matches!(g.kind, GroupKind::State(_)))
    }

    /// The wire's block size is the hash unit or a paged group's block size.
    fn check_event_block_size(&self) -> Result<()> {
        let (Some(w), unit) = (self.event_block_size, self.hash.unit) else {
            return Ok(());
        };
        let paged = self.groups.iter().filter_map(|g| g.kind.block_size());
        if w != unit && !paged.clone().any(|b| b == w) {
            let sizes: Vec<String> = paged.map(|b| b.to_string()).collect();
            return Err(CacheError::config(format!(
                "event_block_size = {w}: it must be the hash unit ({unit}) or a paged group's \
                 block size ({}); leave it None for the unit",
                if sizes.is_empty() { "none configured".to_string() } else { sizes.join(", ") }
            )));
        }
        Ok(())
    }

    /// Checks every rule; the error message says what to change.
    pub fn validate(&self) -> Result<()> {
        let unit = self.hash.unit;
        if unit == 0 {
            return Err(CacheError::config("hash unit U must be at least 1 token"));
        }
        if unit > MAX_HASH_UNIT {
            return Err(CacheError::config(format!(
                "hash unit U = {unit} is larger than the supported {MAX_HASH_UNIT} tokens"
            )));
        }
        if self.pools.is_empty() {
            return Err(CacheError::config("no pools: give at least one pool"));
        }
        if self.pools.len() > MAX_POOLS {
            return Err(CacheError::config(format!(
                "{} pools configured: at most {MAX_POOLS}",
                self.pools.len()
            )));
        }
        if self.groups.len() > MAX_GROUPS {
            return Err(CacheError::config(format!(
                "{} groups configured: at most {MAX_GROUPS}",
                self.groups.len()
            )));
        }
        if self.recently_evicted_capacity > MAX_RECENTLY_EVICTED {
            return Err(CacheError::config(format!(
                "recently_evicted_capacity = {} is more than the supported {MAX_RECENTLY_EVICTED}",
                self.recently_evicted_capacity
            )));
        }
        if self.max_steps_in_flight == 0 || self.max_steps_in_flight > MAX_STEPS_IN_FLIGHT {
            return Err(CacheError::config(format!(
                "max_steps_in_flight = {} must be between 1 (one plan in flight, no overlap) \
                 and {MAX_STEPS_IN_FLIGHT}",
                self.max_steps_in_flight
            )));
        }
        if self.max_pending_events > MAX_PENDING_EVENTS {
            return Err(CacheError::config(format!(
                "max_pending_events = {} is more than the supported {MAX_PENDING_EVENTS}; drain \
                 events more often instead",
                self.max_pending_events
            )));
        }
        self.check_event_block_size()?;
        for (i, pool) in self.pools.iter().enumerate() {
            if pool.num_blocks < 2 {
                return Err(CacheError::config(format!(
                    "pool {i} has num_blocks = {}: it needs at least 2 (block 0 is the null \
                     block, never allocated)",
                    pool.num_blocks
                )));
            }
            if pool.num_blocks > MAX_BLOCKS_PER_POOL {
                return Err(CacheError::config(format!(
                    "pool {i} has num_blocks = {}: at most {MAX_BLOCKS_PER_POOL} (block ids are \
                     int32 in the step plan)",
                    pool.num_blocks
                )));
            }
        }
        if self.groups.is_empty() {
            return Err(CacheError::config("no groups: give at least one group"));
        }
        for (g, group) in self.groups.iter().enumerate() {
            if group.pool >= self.pools.len() {
                return Err(CacheError::config(format!(
                    "group {g} uses pool {} but only {} pool(s) are configured",
                    group.pool,
                    self.pools.len()
                )));
            }
            match &group.kind {
                GroupKind::FullAttention { block_size } => check_block(g, *block_size, unit)?,
                GroupKind::SlidingWindow { block_size, window } => {
                    check_block(g, *block_size, unit)?;
                    if *window > MAX_BLOCK_SIZE {
                        return Err(CacheError::config(format!(
                            "group {g}: sliding window {window} is larger than the supported \
                             {MAX_BLOCK_SIZE} tokens"
                        )));
                    }
                    if window < block_size {
                        return Err(CacheError::config(format!(
                            "group {g}: sliding window {window} is smaller than its block size \
                             {block_size}; use a window of at least one block"
                        )));
                    }
                }
                GroupKind::State(state) => check_state(g, state, unit)?,
            }
        }
        Ok(())
    }
}

fn check_block(group: usize, block_size: u32, unit: u32) -> Result<()> {
    if block_size > MAX_BLOCK_SIZE {
        return Err(CacheError::config(format!(
            "group {group}: block size {block_size} is larger than the supported \
             {MAX_BLOCK_SIZE} tokens"
        )));
    }
    if block_size == 0 || block_size % unit != 0 {
        return Err(CacheError::config(format!(
            "group {group}: block size {block_size} is not a positive multiple of the hash unit \
             U = {unit}; U must divide every paged block size (choose U among the divisors of \
             {block_size})"
        )));
    }
    Ok(())
}

fn check_state(group: usize, state: &StateGroupConfig, unit: u32) -> Result<()> {
    if state.alignment == 0 || unit % state.alignment != 0 {
        return Err(CacheError::config(format!(
            "group {group}: checkpoint alignment A = {} must divide the hash unit U = {unit} \
             (checkpoints sit on unit boundaries); pick U as a multiple of A",
            state.alignment
        )));
    }
    if let Some(interval) = state.retention.interval {
        if interval == 0 || interval % unit != 0 {
            return Err(CacheError::config(format!(
                "group {group}: retention interval K = {interval} must be a positive multiple of \
                 the hash unit U = {unit}"
            )));
        }
    }
    if state.checkpoint_cap == Some(0) {
        return Err(CacheError::config(format!(
            "group {group}: checkpoint_cap = 0 would disable every checkpoint; use None for no \
             cap, or turn the retention policies off"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Retention;

    #[test]
    fn retained_positions_are_the_tail_the_junction_and_the_interval_multiples() {
        let r = Retention { tail: true, interval: Some(8), junction: true, decode_tail: true };
        let retained = r.retained(4, 41, Some(20));
        assert_eq!(retained.explicit().collect::<Vec<_>>(), vec![40, 20]);
        assert_eq!(retained.intervals(8, 33).collect::<Vec<_>>(), vec![32, 24, 16]);
        assert_eq!(retained.earliest_in(8, 33), Some(16));
        assert_eq!(retained.earliest_in(16, 23), Some(20), "the junction before an interval");
        assert_eq!(retained.earliest_in(40, 47), None, "(40, 47] holds none");
        let off = Retention { tail: false, interval: None, junction: false, decode_tail: true };
        let none = off.retained(4, 41, Some(20));
        assert_eq!((none.explicit().count(), none.earliest_in(0, 100)), (0, None));
        for start in 0..50 {
            for end in start..60 {
                let all = retained.explicit().chain(retained.intervals(start, end));
                let brute = all.filter(|&p| p > start && p <= end).min();
                assert_eq!(retained.earliest_in(start, end), brute, "({start}, {end}]");
            }
        }
    }
}
