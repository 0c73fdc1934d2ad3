//! Prefix hits: the reconciled hit over every group, each group's own hit and why it stops,
//! and the junction where another request diverged.
//!
//! Rules (per candidate L, a multiple of U with L <= N - 1):
//! - full attention: every block `j < L / B` published under its full key `(j + 1) B`, and if
//!   `L % B != 0` a block published under the key at L (copied on write by the consumer). These
//!   hits are downward closed, so the bound is found by one scan from the start;
//! - sliding window: the same, for the blocks covering `[max(0, L - W), L)` only;
//! - state: a checkpoint published under the key at exactly L, or L = 0.
//!
//! Windows and states are not downward closed: candidates are tested from the full-attention
//! bound downward in steps of U. Nothing here changes cache state.

use crate::hashing::unit_extra_entries;
use crate::index::UnitContent;
use crate::manager::{CacheManager, GroupRuntime};
use crate::pool::{BlockId, BlockPool, Key, NULL_BLOCK};
use crate::sequence::Sequence;

/// Why a group's own hit stops where it does.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Hash)]
pub enum MissReason {
    /// The key at the next position was never published (or was evicted long ago).
    NotCached,
    /// The key at the next position was evicted recently.
    RecentlyEvicted,
    /// The paged groups could go further, but no state was saved at the next position.
    NoStateAtPosition,
    /// The window's last block is cached but an earlier block of the window is not.
    WindowGap,
}

impl MissReason {
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::NotCached => "not_cached",
            Self::RecentlyEvicted => "recently_evicted",
            Self::NoStateAtPosition => "no_state_at_position",
            Self::WindowGap => "window_gap",
        }
    }
}

/// One group's part of a [`Hit`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupHit {
    pub group: u32,
    /// The group's own longest hit (a multiple of U, at most `Hit::max_tokens`).
    pub tokens: u32,
    /// Why it does not reach `tokens + U` (`None` when it reaches `Hit::max_tokens`). Windows
    /// and states are not downward closed: for them the reason looks at the candidates above
    /// `tokens` (a state group reports `RecentlyEvicted` when any of them lost its state).
    pub stop: Option<MissReason>,
}

/// The result of a lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit {
    /// The reconciled hit L: every group can resume there.
    pub tokens: u32,
    /// The largest L a lookup could return: `((N - 1) / U) * U`.
    pub max_tokens: u32,
    pub groups: Vec<GroupHit>,
    /// The largest own hit above L when it exceeds L by at least 2U (another request diverged
    /// there; a retained `junction` checkpoint is taken at it).
    pub junction: Option<u32>,
}

enum Probe {
    Ok,
    /// Missing key at this position; whether it is the candidate's last key.
    Missing {
        position: u32,
        last: bool,
    },
}

impl CacheManager {
    fn key_at(seq: &Sequence, group: u32, unit: u32, position: u32) -> Key {
        Key { group, digest: seq.hashes[(position / unit - 1) as usize] }
    }

    /// The pool of `group`'s blocks.
    fn group_pool(&self, group: u32) -> &BlockPool {
        &self.pools[self.groups[group as usize].pool()]
    }

    pub(crate) fn has_key(&self, seq: &Sequence, group: u32, position: u32) -> bool {
        let key = Self::key_at(seq, group, self.unit, position);
        let pool = self.group_pool(group);
        self.index.contains(&key, |b| pool.carries(b, &key))
    }

    fn miss_reason(&self, seq: &Sequence, group: u32, position: u32) -> MissReason {
        let key = Self::key_at(seq, group, self.unit, position);
        let pool = self.group_pool(group);
        if self.index.recently_evicted(&key, |b| pool.carries(b, &key)) {
            MissReason::RecentlyEvicted
        } else {
            MissReason::NotCached
        }
    }

    /// Full-attention bound of one group (downward closed scan), capped at `limit`. The block
    /// chosen for every full block on the way is pushed to `chain`, so the first schedule
    /// does not probe the index again.
    fn full_attention_bound(
        &self,
        seq: &Sequence,
        group: u32,
        block: u32,
        limit: u32,
        chain: &mut Vec<BlockId>,
    ) -> u32 {
        let unit = self.unit;
        let pool = &self.pools[self.groups[group as usize].pool()];
        // Unit indices advance by whole blocks: no division per probe on this hot loop.
        let units_per_block = (block / unit) as usize;
        let full_blocks = (limit / block) as usize;
        let mut block_start = 0;
        let hint = seq.hint_chains.get(group as usize).map_or(&[][..], Vec::as_slice);
        chain.reserve(full_blocks.saturating_sub(chain.len()));
        for col in 0..full_blocks {
            let key = Key { group, digest: seq.hashes[(col + 1) * units_per_block - 1] };
            // The block the extended sequence held here, if it is still the key's only holder,
            // is what the index would return: confirmed through the pool, no index probe.
            match hint.get(col) {
                Some(&b) if pool.sole_holder_of(b, &key) => chain.push(b),
                _ => match self.holder(pool, &key) {
                    Some(b) => chain.push(b),
                    None => break,
                },
            }
            block_start += block;
        }
        let mut bound = block_start;
        let last = limit.min(block_start + block - unit);
        let mut q = block_start + unit;
        while q <= last && self.has_key(seq, group, q) {
            bound = q;
            q += unit;
        }
        bound
    }

    fn window_probe(&self, seq: &Sequence, group: u32, block: u32, window: u32, l: u32) -> Probe {
        if l == 0 {
            return Probe::Ok;
        }
        let first_col = l.saturating_sub(window) / block;
        let last_col = (l - 1) / block;
        // The last key first: a miss there is the common case and ends the candidate.
        let last_position = ((last_col + 1) * block).min(l);
        if !self.has_key(seq, group, last_position) {
            return Probe::Missing { position: last_position, last: true };
        }
        for col in first_col..last_col {
            let position = (col + 1) * block;
            if !self.has_key(seq, group, position) {
                return Probe::Missing { position, last: false };
            }
        }
        Probe::Ok
    }

    fn group_allows(&self, seq: &Sequence, g: usize, l: u32) -> bool {
        match self.groups[g] {
            GroupRuntime::FullAttention { .. } => true,
            GroupRuntime::SlidingWindow { block_size, window, .. } => {
                matches!(self.window_probe(seq, g as u32, block_size, window, l), Probe::Ok)
            }
            GroupRuntime::State { .. } => l == 0 || self.has_key(seq, g as u32, l),
        }
    }

    /// The longest prefix with no unit whose stored content (parent, tokens, extra-key entries)
    /// differs (only with `verify_tokens`).
    /// A unit nobody publishes any more does not stop it: windows and states resume without the
    /// blocks before them, which may be long evicted.
    fn verified_limit(&self, seq: &Sequence, max_tokens: u32) -> u32 {
        if !self.index.verifies_tokens() {
            return max_tokens;
        }
        let unit = self.unit as usize;
        let seed = self.hasher.seed_digest();
        let units = (max_tokens as usize) / unit;
        let mut parent = seed;
        let mut extra = Vec::new();
        for i in 0..units {
            let digest = seq.hashes[i];
            unit_extra_entries(&mut extra, i, unit, &seq.extra);
            let tokens = &seq.tokens[i * unit..(i + 1) * unit];
            if !self.index.verify(&digest, UnitContent { parent: &parent, tokens, extra: &extra }) {
                return (i * unit) as u32;
            }
            parent = digest;
        }
        max_tokens
    }

    /// The reconciled hit of a sequence (no statistics, no state change).
    pub(crate) fn compute_hit(&self, seq: &Sequence) -> Hit {
        self.compute_hit_with_chains(seq).0
    }

    /// The hit, and per group the blocks chosen for the full-attention chain (empty for
    /// other groups).
    pub(crate) fn compute_hit_with_chains(&self, seq: &Sequence) -> (Hit, Vec<Vec<BlockId>>) {
        let mut chains: Vec<Vec<BlockId>> = vec![Vec::new(); self.groups.len()];
        let unit = self.unit;
        let n = seq.num_tokens();
        let max_tokens = if n == 0 { 0 } else { ((n - 1) / unit) * unit };
        let limit = self.verified_limit(seq, max_tokens);
        // Full attention first: its hits are downward closed, and their bound is the range in
        // which every other group's own hit is searched (a state or window that survives
        // above it cannot be resumed from, so it is neither a hit nor a junction).
        let mut full = vec![0; self.groups.len()];
        let mut bound = limit;
        for (g, runtime) in self.groups.iter().enumerate() {
            if let GroupRuntime::FullAttention { block_size, .. } = *runtime {
                full[g] =
                    self.full_attention_bound(seq, g as u32, block_size, limit, &mut chains[g]);
                bound = bound.min(full[g]);
            }
        }
        let mut groups = Vec::with_capacity(self.groups.len());
        for (g, runtime) in self.groups.iter().enumerate() {
            let gid = g as u32;
            let (own, stop) = match *runtime {
                GroupRuntime::FullAttention { .. } => {
                    let own = full[g];
                    let stop = (own < max_tokens).then(|| self.miss_reason(seq, gid, own + unit));
                    (own, stop)
                }
                GroupRuntime::SlidingWindow { block_size, window, .. } => {
                    let mut l = bound;
                    while l > 0
                        && !matches!(self.window_probe(seq, gid, block_size, window, l), Probe::Ok)
                    {
                        l -= unit;
                    }
                    // The reason explains the largest candidate, its last key first.
                    let stop = (l < max_tokens).then(|| {
                        match self.window_probe(seq, gid, block_size, window, limit) {
                            Probe::Missing { position, last: true } => {
                                self.miss_reason(seq, gid, position)
                            }
                            Probe::Missing { last: false, .. } => MissReason::WindowGap,
                            Probe::Ok => MissReason::NotCached,
                        }
                    });
                    (l, stop)
                }
                GroupRuntime::State { .. } => {
                    let mut l = bound;
                    while l > 0 && !self.has_key(seq, gid, l) {
                        l -= unit;
                    }
                    // States are not downward closed: a state evicted at any candidate above
                    // the own hit (a resend's tail, typically) is why this group stops there.
                    let stop = (l < max_tokens).then(|| {
                        let mut above = (l / unit + 1..=limit / unit).map(|i| i * unit);
                        if above
                            .any(|p| self.miss_reason(seq, gid, p) == MissReason::RecentlyEvicted)
                        {
                            MissReason::RecentlyEvicted
                        } else {
                            MissReason::NoStateAtPosition
                        }
                    });
                    (l, stop)
                }
            };
            groups.push(GroupHit { group: gid, tokens: own, stop });
        }
        let mut tokens = bound;
        while tokens > 0
            && !(0..self.groups.len()).all(|g| {
                groups[g].tokens >= tokens && self.group_allows(seq, g, tokens)
                    || matches!(self.groups[g], GroupRuntime::FullAttention { .. })
            })
        {
            tokens -= unit;
        }
        // Own hits within the bound only: a full-attention group reaching past another one's
        // bound merely lost fewer blocks; no request diverged there.
        let top = groups.iter().map(|g| g.tokens.min(bound)).max().unwrap_or(0);
        let junction = (top >= tokens + 2 * unit).then_some(top);
        (Hit { tokens, max_tokens, groups, junction }, chains)
    }

    /// The block to use for a key: one already in use if any, else the most recently used.
    pub(crate) fn choose_block(&self, seq: &Sequence, group: u32, position: u32) -> BlockId {
        let key = Self::key_at(seq, group, self.unit, position);
        self.holder(self.group_pool(group), &key).unwrap_or(NULL_BLOCK)
    }

    /// The block a hit on `key` uses ([`CacheManager::pick`]), `None` when none is published.
    /// A key's only candidate is confirmed directly: the common case, on every probe of a
    /// lookup.
    #[inline]
    fn holder(&self, pool: &BlockPool, key: &Key) -> Option<BlockId> {
        match self.index.candidates(key) {
            (Some(b), _) => Some(b).filter(|&b| pool.carries(b, key)),
            (None, many) => {
                Self::pick(pool, many.iter().copied().filter(|&b| pool.carries(b, key)))
            }
        }
    }

    /// Among the blocks published under one key: one already in use if any, else the most
    /// recently used (ties to the lowest id), so the choice is deterministic. `None` when
    /// there is none.
    fn pick(pool: &BlockPool, mut holders: impl Iterator<Item = BlockId>) -> Option<BlockId> {
        let first = holders.next()?;
        let Some(second) = holders.next() else {
            return Some(first);
        };
        [first, second]
            .into_iter()
            .chain(holders)
            .max_by_key(|&b| (pool.ref_count(b) > 0, pool.stamp(b), u32::MAX - b))
    }
}
