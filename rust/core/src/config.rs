//! Configuration of a [`crate::CacheManager`]: pools, groups, hashing, retention.
//!
//! Validation lives here and runs once in `CacheManager::new`; every rule violated yields a
//! [`CacheError::Config`] whose message names the field and what to change. After validation
//! the manager relies on: U >= 1, U divides every paged block size, every state alignment A
//! divides U, windows are at least one block, every pool has at least one usable block.

use crate::error::{CacheError, Result};
use crate::hashing::HashConfig;

pub use crate::limits::MAX_BLOCKS_PER_POOL;
use crate::limits::{
    MAX_BLOCK_SIZE, MAX_GROUPS, MAX_HASH_UNIT, MAX_PENDING_EVENTS, MAX_POOLS, MAX_RECENTLY_EVICTED,
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

    /// Whether any group is a state group.
    #[must_use]
    pub fn has_state_groups(&self) -> bool {
        self.groups.iter().any(|g| matches!(g.kind, GroupKind::State(_)))
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
        if self.max_pending_events > MAX_PENDING_EVENTS {
            return Err(CacheError::config(format!(
                "max_pending_events = {} is more than the supported {MAX_PENDING_EVENTS}; drain \
                 events more often instead",
                self.max_pending_events
            )));
        }
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
