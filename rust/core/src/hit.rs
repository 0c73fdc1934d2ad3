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
//! bound downward in steps of U.
//!
//! The rule is a function of the block store, the group layout and one sequence's content
//! (`compute_hit`); it reads the store and never changes it, and knows nothing of steps.

use rustc_hash::FxHashMap;

use crate::config::{GroupLayout, GroupSlot};
use crate::error::{CacheError, Result};
use crate::hashing::unit_extra_entries;
use crate::hashing::Digest;
use crate::index::UnitContent;
use crate::pool::{BlockId, Key};
use crate::store::{BlockStore, Content};

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
    pub const ALL: [Self; 4] =
        [Self::NotCached, Self::RecentlyEvicted, Self::NoStateAtPosition, Self::WindowGap];

    /// Its index in [`MissReason::ALL`] (and in `GroupStats::misses`).
    #[must_use]
    pub fn index(self) -> usize {
        self as usize
    }

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
    /// there; a retained `junction` checkpoint is taken at it). With D > 1 and plans in
    /// flight, their keys count for it as published (another request is computing that
    /// prefix now); they never count for L.
    pub junction: Option<u32>,
    /// The hit the sequence would get once the plans in flight commit (their keys whose
    /// prefix is known): at least `tokens`; `tokens` when nothing in flight extends it.
    pub pending_tokens: u32,
    /// The plan whose commit `pending_tokens` waits for (the latest one it needs), or `None`
    /// when `pending_tokens == tokens`. `schedule` never uses pending content.
    pub pending_plan: Option<u64>,
}

enum Probe {
    Ok,
    /// Missing key at this position; whether it is the candidate's last key.
    Missing {
        position: u32,
        last: bool,
    },
}

/// The hit of one sequence against the store: what `compute_hit` reads.
struct Lookup<'a> {
    store: &'a BlockStore,
    /// Per group (config index), how the rule reads it.
    groups: Vec<Kind>,
    seq: Content<'a>,
    /// Per group, the blocks a sequence this one extends held (see `Sequence::hint_chains`).
    hint_chains: &'a [Vec<BlockId>],
    unit: u32,
    /// Keys in-flight steps will publish (`pending_hit`), counted as published.
    pending: Option<&'a PendingKeys>,
}

/// Keys (group, digest) that plans in flight will publish at commit, with the plan.
pub(crate) type PendingKeys = FxHashMap<(u32, Digest), u64>;

/// The reconciled hit of a sequence, and per group the blocks chosen for the full-attention
/// chain (empty for other groups). Changes nothing.
pub(crate) fn compute_hit(
    store: &BlockStore,
    layout: &GroupLayout,
    seq: Content<'_>,
    hint_chains: &[Vec<BlockId>],
) -> (Hit, Vec<Vec<BlockId>>) {
    let groups = kinds(layout);
    Lookup { store, groups, seq, hint_chains, unit: store.unit(), pending: None }.compute()
}

/// What in-flight steps will add to a sequence's hit: the hit with their keys counted as
/// published, and the junction those keys show.
pub(crate) struct PendingHit {
    /// At least the committed hit.
    pub tokens: u32,
    /// The latest plan among those whose keys `tokens` needs (`None` when it is no longer
    /// than the committed hit).
    pub plan: Option<u64>,
    /// The junction against the committed hit, with in-flight keys counted: another request
    /// is computing a prefix this one shares and diverging there, so a retained junction
    /// checkpoint is worth taking as if that request had already committed.
    pub junction: Option<u32>,
}

/// The hit rule with the keys in-flight steps will publish counted as published, for a
/// sequence whose committed hit is `hit` (see [`PendingHit`]).
pub(crate) fn pending_hit(
    store: &BlockStore,
    layout: &GroupLayout,
    seq: Content<'_>,
    pending: &PendingKeys,
    hit: &Hit,
) -> PendingHit {
    let unchanged = PendingHit { tokens: hit.tokens, plan: None, junction: hit.junction };
    if pending.is_empty() {
        return unchanged;
    }
    let groups = kinds(layout);
    let lookup = Lookup {
        store,
        groups: groups.clone(),
        seq,
        hint_chains: &[],
        unit: store.unit(),
        pending: Some(pending),
    };
    let (with_pending, _, top) = lookup.compute_with_top();
    let unit = store.unit();
    let junction = junction_above(top, hit.tokens, unit);
    let tokens = with_pending.tokens;
    if tokens <= hit.tokens {
        return PendingHit { junction, ..unchanged };
    }
    // Full attention reads every unit below the hit, a sliding window those of the blocks
    // covering `[L - W, L)` (their pending keys come in order, so the latest plan among them
    // is the one the needed ones wait for; a key below the window, missing or recomputed,
    // is not waited for); a state group reads its checkpoint at the hit only, whatever plan
    // writes one below it.
    let mut plan = None;
    for i in 1..=tokens / unit {
        let digest = seq.hashes[(i - 1) as usize];
        for (g, kind) in groups.iter().enumerate() {
            let needed = match *kind {
                Kind::State => i == tokens / unit,
                Kind::SlidingWindow { block_size, window } => {
                    i * unit > tokens.saturating_sub(window) / block_size * block_size
                }
                Kind::FullAttention { .. } => true,
            };
            if !needed {
                continue;
            }
            let g = g as u32;
            if let Some(&p) = pending.get(&(g, digest)) {
                if !store.has_key(&Key { group: g, digest }) {
                    plan = plan.max(Some(p));
                }
            }
        }
    }
    PendingHit { tokens, plan, junction }
}

/// The junction rule: the largest own hit `top` (within the full-attention bound) when it
/// exceeds the reconciled hit `tokens` by at least two units.
fn junction_above(top: u32, tokens: u32, unit: u32) -> Option<u32> {
    (top >= tokens + 2 * unit).then_some(top)
}

fn kinds(layout: &GroupLayout) -> Vec<Kind> {
    layout
        .slots
        .iter()
        .map(|slot| match *slot {
            GroupSlot::Paged(i) => match layout.paged[i].window {
                None => Kind::FullAttention { block_size: layout.paged[i].block_size },
                Some(window) => {
                    Kind::SlidingWindow { block_size: layout.paged[i].block_size, window }
                }
            },
            GroupSlot::State(_) => Kind::State,
        })
        .collect()
}

/// What the rule needs of a group.
#[derive(Clone, Copy)]
enum Kind {
    FullAttention { block_size: u32 },
    SlidingWindow { block_size: u32, window: u32 },
    State,
}

/// The block a first step uses for group `g`'s key at `position`, which its hit found
/// published: one already in use if any, else the most recently used. Its absence is a bug
/// (the hit and the store disagree): an invariant error.
pub(crate) fn hit_block(
    store: &BlockStore,
    seq: Content<'_>,
    g: u32,
    position: u32,
) -> Result<BlockId> {
    store.holder(&seq.key_at(g, store.unit(), position)).ok_or_else(|| {
        CacheError::invariant(format!(
            "the hit counted on group {g}'s block at position {position}, which is not published"
        ))
    })
}

/// Whether group `g`'s key at `position` of the sequence is published.
pub(crate) fn has_key(store: &BlockStore, seq: Content<'_>, g: u32, position: u32) -> bool {
    store.has_key(&seq.key_at(g, store.unit(), position))
}

impl Lookup<'_> {
    fn has_key(&self, group: u32, position: u32) -> bool {
        has_key(self.store, self.seq, group, position) || self.is_pending(group, position)
    }

    fn is_pending(&self, group: u32, position: u32) -> bool {
        self.pending.is_some_and(|p| {
            p.contains_key(&(group, self.seq.hashes[(position / self.unit - 1) as usize]))
        })
    }

    fn miss_reason(&self, group: u32, position: u32) -> MissReason {
        let key = self.seq.key_at(group, self.unit, position);
        if self.store.recently_evicted(&key) {
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
        group: u32,
        block: u32,
        limit: u32,
        chain: &mut Vec<BlockId>,
    ) -> u32 {
        let (unit, seq) = (self.unit, self.seq);
        let pool = self.store.group_pool(group as usize);
        // Unit indices advance by whole blocks: no division per probe on this hot loop.
        let units_per_block = (block / unit) as usize;
        let full_blocks = (limit / block) as usize;
        let mut block_start = 0;
        let hint = self.hint_chains.get(group as usize).map_or(&[][..], Vec::as_slice);
        chain.reserve(full_blocks.saturating_sub(chain.len()));
        for col in 0..full_blocks {
            let key = Key { group, digest: seq.hashes[(col + 1) * units_per_block - 1] };
            // The block the extended sequence held here, if it is still the key's only holder,
            // is what the index would return: confirmed through the pool, no index probe.
            match hint.get(col) {
                Some(&b) if pool.sole_holder_of(b, &key) => chain.push(b),
                _ => match self.store.holder_in(pool, &key) {
                    Some(b) => chain.push(b),
                    // (the pending answer only: no block to pin there)
                    None if self.pending.is_some_and(|p| p.contains_key(&(group, key.digest))) => {
                        chain.push(0);
                    }
                    None => break,
                },
            }
            block_start += block;
        }
        let mut bound = block_start;
        let last = limit.min(block_start + block - unit);
        let mut q = block_start + unit;
        while q <= last && self.has_key(group, q) {
            bound = q;
            q += unit;
        }
        bound
    }

    fn window_probe(&self, group: u32, block: u32, window: u32, l: u32) -> Probe {
        if l == 0 {
            return Probe::Ok;
        }
        let first_col = l.saturating_sub(window) / block;
        let last_col = (l - 1) / block;
        // The last key first: a miss there is the common case and ends the candidate.
        let last_position = ((last_col + 1) * block).min(l);
        if !self.has_key(group, last_position) {
            return Probe::Missing { position: last_position, last: true };
        }
        for col in first_col..last_col {
            let position = (col + 1) * block;
            if !self.has_key(group, position) {
                return Probe::Missing { position, last: false };
            }
        }
        Probe::Ok
    }

    fn group_allows(&self, g: usize, l: u32) -> bool {
        match self.groups[g] {
            Kind::FullAttention { .. } => true,
            Kind::SlidingWindow { block_size, window } => {
                matches!(self.window_probe(g as u32, block_size, window, l), Probe::Ok)
            }
            Kind::State => l == 0 || self.has_key(g as u32, l),
        }
    }

    /// The longest prefix with no unit whose stored content (parent, tokens, extra-key entries)
    /// differs (only with `verify_tokens`).
    /// A unit nobody publishes any more does not stop it: windows and states resume without the
    /// blocks before them, which may be long evicted.
    fn verified_limit(&self, max_tokens: u32) -> u32 {
        let (index, seq) = (&self.store.index, self.seq);
        if !index.verifies_tokens() {
            return max_tokens;
        }
        let unit = self.unit as usize;
        let seed = *self.store.seed();
        let units = (max_tokens as usize) / unit;
        let mut parent = seed;
        let mut extra = Vec::new();
        for i in 0..units {
            let digest = seq.hashes[i];
            unit_extra_entries(&mut extra, i, unit, seq.extra);
            let tokens = &seq.tokens[i * unit..(i + 1) * unit];
            if !index.verify(&digest, UnitContent { parent: &parent, tokens, extra: &extra }) {
                return (i * unit) as u32;
            }
            parent = digest;
        }
        max_tokens
    }

    fn compute(&self) -> (Hit, Vec<Vec<BlockId>>) {
        let (hit, chains, _) = self.compute_with_top();
        (hit, chains)
    }

    /// `compute`, and the largest own hit within the full-attention bound (the junction's
    /// candidate).
    fn compute_with_top(&self) -> (Hit, Vec<Vec<BlockId>>, u32) {
        let mut chains: Vec<Vec<BlockId>> = vec![Vec::new(); self.groups.len()];
        let unit = self.unit;
        let n = self.seq.tokens.len() as u32;
        let max_tokens = if n == 0 { 0 } else { ((n - 1) / unit) * unit };
        let limit = self.verified_limit(max_tokens);
        // Full attention first: its hits are downward closed, and their bound is the range in
        // which every other group's own hit is searched (a state or window that survives
        // above it cannot be resumed from, so it is neither a hit nor a junction).
        let mut full = vec![0; self.groups.len()];
        let mut bound = limit;
        for (g, runtime) in self.groups.iter().enumerate() {
            if let Kind::FullAttention { block_size } = *runtime {
                full[g] = self.full_attention_bound(g as u32, block_size, limit, &mut chains[g]);
                bound = bound.min(full[g]);
            }
        }
        let mut groups = Vec::with_capacity(self.groups.len());
        for (g, runtime) in self.groups.iter().enumerate() {
            let gid = g as u32;
            let (own, stop) = match *runtime {
                Kind::FullAttention { .. } => {
                    let own = full[g];
                    let stop = (own < max_tokens).then(|| self.miss_reason(gid, own + unit));
                    (own, stop)
                }
                Kind::SlidingWindow { block_size, window } => {
                    let mut l = bound;
                    while l > 0
                        && !matches!(self.window_probe(gid, block_size, window, l), Probe::Ok)
                    {
                        l -= unit;
                    }
                    // The reason explains the largest candidate, its last key first.
                    let stop = (l < max_tokens).then(|| {
                        match self.window_probe(gid, block_size, window, limit) {
                            Probe::Missing { position, last: true } => {
                                self.miss_reason(gid, position)
                            }
                            Probe::Missing { last: false, .. } => MissReason::WindowGap,
                            Probe::Ok => MissReason::NotCached,
                        }
                    });
                    (l, stop)
                }
                Kind::State => {
                    let mut l = bound;
                    while l > 0 && !self.has_key(gid, l) {
                        l -= unit;
                    }
                    // States are not downward closed: a state evicted at any candidate above
                    // the own hit (a resend's tail, typically) is why this group stops there.
                    let stop = (l < max_tokens).then(|| {
                        let mut above = (l / unit + 1..=limit / unit).map(|i| i * unit);
                        if above.any(|p| self.miss_reason(gid, p) == MissReason::RecentlyEvicted) {
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
                groups[g].tokens >= tokens && self.group_allows(g, tokens)
                    || matches!(self.groups[g], Kind::FullAttention { .. })
            })
        {
            tokens -= unit;
        }
        // Own hits within the bound only: a full-attention group reaching past another one's
        // bound merely lost fewer blocks; no request diverged there.
        let top = groups.iter().map(|g| g.tokens.min(bound)).max().unwrap_or(0);
        let junction = junction_above(top, tokens, unit);
        let hit = Hit {
            tokens,
            max_tokens,
            groups,
            junction,
            pending_tokens: tokens,
            pending_plan: None,
        };
        (hit, chains, top)
    }
}
