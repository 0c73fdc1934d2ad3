//! The reference model: what the manager must have published, kept deliberately naively.
//!
//! Per group, the published keys are prefix identities (`ident.rs`: the tokens, the salt, the
//! adapter and the multimodal inputs of every unit) mapped to the blocks carrying them; per
//! pool, the keys each block carries. Keys enter only through commits and
//! `finish` (whose `BlockStored` events must equal the model's own prediction) and leave only
//! through `BlockRemoved` events (which must name an unpinned block with exactly its recorded
//! keys) or `reset`. From these sets `expected_hit` applies the hit rule, stated here on its own,
//! candidate by candidate, with no shortcut: full attention bounds the range in which every
//! other group's own hit is searched, and the junction comes from those own hits. Sequences are
//! mirrored with their committed position, their scheduled or in-flight step and what the plan
//! gave it.

use std::collections::{BTreeMap, HashMap, HashSet};

use prefixcache_core::{
    hash_prefix, CacheError, CacheEvent, CacheManager, Digest, ExtraKeys, GroupHit, GroupStats,
    Hit, MissReason, Retention, Stats, StepPlan,
};

use crate::ident::Idents;
pub(crate) use crate::ident::Prefix;
use crate::recency::Recency;
use crate::setup::{Kind, Setup};

/// A key stored by a commit: (group, block, prefix, checkpoint).
pub(crate) type Stored = (usize, u32, Prefix, bool);

/// An id no sequence ever has.
pub(crate) const UNKNOWN_ID: u64 = 999_999;
/// Fresh tokens (suffixes, sampled tokens) never collide with base streams.
const FIRST_FRESH_TOKEN: u32 = 1_000_000;

/// A step of one sequence, scheduled or in flight.
#[derive(Clone, Debug)]
pub(crate) struct StepModel {
    pub(crate) start: u32,
    pub(crate) end: u32,
    pub(crate) first: bool,
    pub(crate) requested: Vec<u32>,
    /// Per group: the block-table row before the schedule.
    pub(crate) rows_before: Vec<Vec<i32>>,
    /// Per group, from the plan: the row the step writes into.
    pub(crate) table: Vec<Vec<i32>>,
    /// Per group, from the plan: copy-on-write (source, destination, tokens).
    pub(crate) cow: Vec<Option<(u32, u32, u32)>>,
    /// Per group, from the plan: checkpoints written (position, block, decode tail).
    pub(crate) written: Vec<Vec<(u32, u32, bool)>>,
    /// Per group, from the plan: running buffer written, and the checkpoint resumed from.
    pub(crate) running: Vec<i32>,
    pub(crate) resume: Vec<u32>,
}

#[derive(Clone, Debug)]
pub(crate) struct SeqModel {
    pub(crate) tokens: Vec<u32>,
    pub(crate) extra: ExtraKeys,
    /// The identity of every full unit's prefix (`keys[i]`: the first `(i + 1) U` tokens).
    pub(crate) keys: Vec<Prefix>,
    pub(crate) started: bool,
    pub(crate) num_computed: u32,
    pub(crate) prefill_target: u32,
    pub(crate) junction: Option<u32>,
    pub(crate) step: Option<StepModel>,
    /// Per state group: the buffer holding the committed state, and the one before it.
    pub(crate) current: Vec<Option<i32>>,
    pub(crate) previous: Vec<Option<i32>>,
    /// Per state group: the private decode-tail snapshot (block, position).
    pub(crate) decode_tail: Vec<Option<(u32, u32)>>,
    /// Per paged group: the engine's persistent block-table row, kept from the plans alone.
    pub(crate) engine_rows: Vec<Vec<i32>>,
}

impl SeqModel {
    pub(crate) fn new(
        tokens: Vec<u32>,
        extra: ExtraKeys,
        keys: Vec<Prefix>,
        groups: usize,
    ) -> Self {
        Self {
            tokens,
            extra,
            keys,
            started: false,
            num_computed: 0,
            prefill_target: 0,
            junction: None,
            step: None,
            current: vec![None; groups],
            previous: vec![None; groups],
            decode_tail: vec![None; groups],
            engine_rows: vec![Vec::new(); groups],
        }
    }

    pub(crate) fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// The key of the prefix of `p` tokens (`p` a positive multiple of U).
    pub(crate) fn key(&self, p: u32) -> Prefix {
        let unit = self.keys[0].len;
        let key = self.keys[(p / unit - 1) as usize];
        debug_assert_eq!(key.len, p);
        key
    }

    /// Not scheduled, with tokens left to compute.
    pub(crate) fn runnable(&self) -> bool {
        self.step.is_none() && self.num_computed < self.num_tokens()
    }

    /// Started, not scheduled, every token computed: waiting for its sampled token.
    pub(crate) fn decoding(&self) -> bool {
        self.started && self.step.is_none() && self.num_computed == self.num_tokens()
    }

    pub(crate) fn scheduled(&self) -> bool {
        self.step.is_some()
    }

    pub(crate) fn any(_: &Self) -> bool {
        true
    }

    /// Back to "not started" (preempt, or abort of a first step).
    pub(crate) fn unstart(&mut self) {
        let groups = self.current.len();
        self.started = false;
        self.num_computed = 0;
        self.prefill_target = 0;
        self.junction = None;
        self.step = None;
        self.current = vec![None; groups];
        self.previous = vec![None; groups];
    }
}

/// Unit boundaries q with `from < q <= to`.
/// A sequence's retained positions (the retention rule), stated as a predicate on unit
/// boundaries: the tail `((N - 1) // U) * U` of the tokens N known at the prefill's schedule,
/// the junction of its lookup, and every multiple of the interval K.
pub(crate) struct Retained {
    pub(crate) tail: Option<u32>,
    pub(crate) junction: Option<u32>,
    interval: Option<u32>,
}

impl Retained {
    pub(crate) fn of(r: &Retention, unit: u32, known: u32, junction: Option<u32>) -> Self {
        Self {
            tail: if r.tail && known >= 1 { Some((known - 1) / unit * unit) } else { None },
            junction: if r.junction { junction } else { None },
            interval: r.interval,
        }
    }

    pub(crate) fn on_interval(&self, p: u32) -> bool {
        self.interval.is_some_and(|k| p % k == 0)
    }

    pub(crate) fn holds(&self, p: u32) -> bool {
        self.tail == Some(p) || self.junction == Some(p) || self.on_interval(p)
    }
}

pub(crate) fn boundaries(unit: u32, from: u32, to: u32) -> impl DoubleEndedIterator<Item = u32> {
    (from / unit + 1..=to / unit).map(move |i| i * unit)
}

pub(crate) fn sorted<T: Ord>(mut v: Vec<T>) -> Vec<T> {
    v.sort();
    v
}

/// A unit's own tokens, and the salt and adapter of the sequence it was computed for.
pub(crate) type UnitOrigin = (Vec<u32>, Option<Vec<u8>>, Option<u64>);

pub(crate) struct Model {
    pub(crate) s: Setup,
    pub(crate) m: CacheManager,
    pub(crate) unit: u32,
    /// Per group: published key -> blocks carrying it.
    pub(crate) live: Vec<HashMap<Prefix, Vec<u32>>>,
    /// Per pool: block -> keys (group, prefix) it carries.
    pub(crate) carried: Vec<HashMap<u32, Vec<(usize, Prefix)>>>,
    /// Per group: every key a committed step published (never shrinks).
    pub(crate) committed: Vec<HashSet<Prefix>>,
    /// Per group: keys whose last block was evicted.
    pub(crate) recent: Vec<HashSet<Prefix>>,
    pub(crate) idents: Idents,
    /// What every digest seen so far stands for, and back: a bijection.
    pub(crate) digests: HashMap<Digest, Prefix>,
    pub(crate) digest_of: HashMap<Prefix, Digest>,
    /// Per prefix, the tokens of its last unit and the salt and adapter it was computed with
    /// (what a stored run must carry for it).
    pub(crate) unit_content: HashMap<Prefix, UnitOrigin>,
    pub(crate) seqs: BTreeMap<u64, SeqModel>,
    /// Finished sequences available to `extends`: tokens and extra keys.
    pub(crate) finished: BTreeMap<u64, (Vec<u32>, ExtraKeys)>,
    /// With `reuse_live_prefixes`: first unit's key -> the live sequence added last with it.
    pub(crate) live_first: HashMap<Prefix, u64>,
    pub(crate) scheduled: Vec<u64>,
    pub(crate) in_flight: Option<StepPlan>,
    /// Every other plan is built into this one, refilled each time (`build_plan_into`).
    pub(crate) reused_plan: StepPlan,
    pub(crate) built: Vec<u64>,
    pub(crate) next_id: u64,
    pub(crate) next_token: u32,
    pub(crate) last_event: Option<u64>,
    /// Per pool: published decode-tail checkpoints (only these may make room for a new one at
    /// the checkpoint cap).
    pub(crate) decode_tails: Vec<HashSet<u32>>,
    /// Per pool: what the model knows of each published block's recency (`recency.rs`).
    pub(crate) recency: Vec<HashMap<u32, Recency>>,
    /// Calls so far (the recency clock).
    pub(crate) clock: i64,
    /// The statistics the manager must report.
    pub(crate) stats: Stats,
    /// How often each interesting path was taken (see `saw`).
    pub(crate) seen: BTreeMap<&'static str, u64>,
}

impl Model {
    pub(crate) fn new(s: Setup) -> Result<Self, String> {
        let m = CacheManager::new(s.config()).map_err(|e| format!("config refused: {e}"))?;
        let groups = s.groups.len();
        let pools = s.pools.len();
        Ok(Self {
            unit: s.unit,
            m,
            live: vec![HashMap::new(); groups],
            carried: vec![HashMap::new(); pools],
            committed: vec![HashSet::new(); groups],
            recent: vec![HashSet::new(); groups],
            idents: Idents::default(),
            digests: HashMap::new(),
            digest_of: HashMap::new(),
            unit_content: HashMap::new(),
            seqs: BTreeMap::new(),
            finished: BTreeMap::new(),
            live_first: HashMap::new(),
            scheduled: Vec::new(),
            in_flight: None,
            reused_plan: StepPlan::default(),
            built: Vec::new(),
            next_id: 1,
            next_token: FIRST_FRESH_TOKEN,
            last_event: None,
            seen: BTreeMap::new(),
            decode_tails: vec![HashSet::new(); pools],
            recency: vec![HashMap::new(); pools],
            clock: 0,
            stats: Stats { groups: vec![GroupStats::default(); groups], ..Stats::default() },
            s,
        })
    }

    /// Counts a path taken, so a test can check that the random traffic reaches it.
    pub(crate) fn saw(&mut self, path: &'static str) {
        *self.seen.entry(path).or_default() += 1;
    }

    pub(crate) fn groups(&self) -> usize {
        self.s.groups.len()
    }

    /// The sequence an operation targets: mostly one that `eligible` accepts, sometimes any live
    /// one, now and then an id nobody has.
    pub(crate) fn pick(&self, pick: u8, eligible: fn(&SeqModel) -> bool) -> u64 {
        let fitting: Vec<u64> =
            self.seqs.iter().filter(|(_, s)| eligible(s)).map(|(&id, _)| id).collect();
        let live: Vec<u64> = self.seqs.keys().copied().collect();
        let from = if pick % 16 < 12 && !fitting.is_empty() { fitting } else { live };
        if pick % 16 == 15 || from.is_empty() {
            return UNKNOWN_ID;
        }
        from[usize::from(pick / 16) % from.len()]
    }

    /// Ids of the live sequences `eligible` accepts.
    pub(crate) fn ids(&self, eligible: fn(&SeqModel) -> bool) -> Vec<u64> {
        self.seqs.iter().filter(|(_, s)| eligible(s)).map(|(&id, _)| id).collect()
    }

    pub(crate) fn seq(&self, id: u64) -> Result<&SeqModel, String> {
        self.seqs.get(&id).ok_or_else(|| format!("model has no sequence {id}"))
    }

    pub(crate) fn seq_mut(&mut self, id: u64) -> Result<&mut SeqModel, String> {
        self.seqs.get_mut(&id).ok_or_else(|| format!("model has no sequence {id}"))
    }

    pub(crate) fn fresh_tokens(&mut self, n: usize) -> Vec<u32> {
        let start = self.next_token;
        self.next_token += n as u32;
        (start..self.next_token).collect()
    }

    /// The keys of a sequence, remembering which prefix every digest of it stands for: two
    /// prefixes share a digest exactly when they have the same identity.
    pub(crate) fn learn(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> Result<Vec<Prefix>, String> {
        let keys = self.idents.keys(self.unit, tokens, extra);
        let digests = hash_prefix(&self.s.hash_config(), tokens, extra)
            .map_err(|e| format!("hash_prefix refused a sequence add accepted: {e}"))?;
        ensure!(digests.len() == keys.len(), "hash_prefix gave {} digests", digests.len());
        let unit = self.unit as usize;
        for (i, (&d, &prefix)) in digests.iter().zip(&keys).enumerate() {
            self.unit_content.entry(prefix).or_insert_with(|| {
                let own = tokens[i * unit..(i + 1) * unit].to_vec();
                (own, extra.cache_salt.clone(), extra.lora_id)
            });
            let known = *self.digests.entry(d).or_insert(prefix);
            ensure!(
                known == prefix,
                "one digest for two prefixes of {} and {} tokens that differ in tokens or extra keys",
                known.len,
                prefix.len
            );
            let digest = *self.digest_of.entry(prefix).or_insert(d);
            ensure!(
                digest == d,
                "two digests for one prefix of {} tokens (the digest covers more than tokens, salt, \
                 adapter and the inputs' hashes per unit)",
                prefix.len
            );
        }
        Ok(keys)
    }

    pub(crate) fn prefix_of(&self, d: &Digest) -> Result<Prefix, String> {
        self.digests.get(d).copied().ok_or_else(|| {
            "an event names a digest that is no prefix of any sequence (hashing disagrees with \
             hash_prefix)"
                .to_string()
        })
    }

    pub(crate) fn carries(&self, g: usize, block: u32, prefix: Prefix) -> bool {
        self.carried[self.s.pool(g)]
            .get(&block)
            .is_some_and(|keys| keys.iter().any(|(kg, p)| *kg == g && *p == prefix))
    }

    pub(crate) fn row(&self, g: usize, id: u64) -> Result<Vec<i32>, String> {
        let (flat, _, _) = self
            .m
            .block_table(g as u32, &[id])
            .map_err(|e| format!("block_table({g}, {id}): {e}"))?;
        Ok(flat)
    }

    pub(crate) fn rows(&self, id: u64) -> Result<Vec<Vec<i32>>, String> {
        (0..self.groups())
            .map(|g| match self.s.block_size(g) {
                Some(_) if self.seqs.contains_key(&id) => self.row(g, id),
                _ => Ok(Vec::new()),
            })
            .collect()
    }

    // --- the hit rule, candidate by candidate ----------------------------------------------

    /// The key positions group `g` needs to resume at `l`.
    pub(crate) fn required(&self, g: usize, l: u32) -> Vec<u32> {
        match self.s.groups[g].0 {
            Kind::Full { block } => {
                let mut keys: Vec<u32> = (1..=l / block).map(|j| j * block).collect();
                if l % block != 0 {
                    keys.push(l);
                }
                keys
            }
            Kind::Window { block, window } => {
                if l == 0 {
                    return Vec::new();
                }
                let first = l.saturating_sub(window) / block;
                let last = (l - 1) / block;
                (first..=last).map(|c| ((c + 1) * block).min(l)).collect()
            }
            Kind::State(_) => {
                if l == 0 {
                    Vec::new()
                } else {
                    vec![l]
                }
            }
        }
    }

    /// The hit rule for `seq`, candidate by candidate. Full attention is
    /// downward closed and bounds the range: every other group's own hit is the largest
    /// candidate at or below that bound it can resume from (a state or window that survives
    /// above it is neither a hit nor a junction). Without full attention the bound is the
    /// largest candidate, `((N-1)//U)*U`.
    pub(crate) fn expected_hit(&self, seq: &SeqModel) -> Hit {
        self.hit_and_unbounded(seq).0
    }

    /// The hit, and per group its own hit were it not bounded by full attention.
    pub(crate) fn hit_and_unbounded(&self, seq: &SeqModel) -> (Hit, Vec<u32>) {
        let unit = self.unit;
        let max_tokens = (seq.num_tokens() - 1) / unit * unit;
        let units = (max_tokens / unit) as usize;
        let live: Vec<Vec<bool>> = (0..self.groups())
            .map(|g| {
                (0..=units).map(|i| i > 0 && self.live[g].contains_key(&seq.keys[i - 1])).collect()
            })
            .collect();
        let allows =
            |g: usize, l: u32| self.required(g, l).iter().all(|&p| live[g][(p / unit) as usize]);
        let candidates = |top: u32| (0..=top / unit).rev().map(move |i| i * unit);
        let unbounded: Vec<u32> = (0..self.groups())
            .map(|g| candidates(max_tokens).find(|&l| allows(g, l)).unwrap_or(0))
            .collect();
        let bound = (0..self.groups())
            .filter(|&g| matches!(self.s.groups[g].0, Kind::Full { .. }))
            .map(|g| unbounded[g])
            .min()
            .unwrap_or(max_tokens);
        let groups: Vec<GroupHit> = (0..self.groups())
            .map(|g| {
                let own = match self.s.groups[g].0 {
                    Kind::Full { .. } => unbounded[g],
                    _ => candidates(bound).find(|&l| allows(g, l)).unwrap_or(0),
                };
                let evicted =
                    |p: u32| !live[g][(p / unit) as usize] && self.recent[g].contains(&seq.key(p));
                let stop = (own < max_tokens).then(|| match self.s.groups[g].0 {
                    // Downward closed: the key at the next candidate is what is missing.
                    Kind::Full { .. } if evicted(own + unit) => MissReason::RecentlyEvicted,
                    Kind::Full { .. } => MissReason::NotCached,
                    // Not downward closed: the reason looks at the candidates above the own
                    // hit; a window explains its largest candidate (its last key first).
                    Kind::Window { .. } if evicted(max_tokens) => MissReason::RecentlyEvicted,
                    Kind::Window { .. } if !live[g][units] => MissReason::NotCached,
                    // Every key of the largest candidate is there: full attention bounds it.
                    Kind::Window { .. } if allows(g, max_tokens) => MissReason::NotCached,
                    Kind::Window { .. } => MissReason::WindowGap,
                    Kind::State(_) if boundaries(unit, own, max_tokens).any(evicted) => {
                        MissReason::RecentlyEvicted
                    }
                    Kind::State(_) => MissReason::NoStateAtPosition,
                });
                GroupHit { group: g as u32, tokens: own, stop }
            })
            .collect();
        let tokens_hit =
            candidates(bound).find(|&l| (0..self.groups()).all(|g| allows(g, l))).unwrap_or(0);
        // Where another request diverged: an own hit within the bound (a full-attention group
        // that reaches past another one's bound merely lost fewer blocks).
        let top = groups.iter().map(|g| g.tokens.min(bound)).max().unwrap_or(0);
        let junction = (top >= tokens_hit + 2 * unit).then_some(top);
        // What in-flight steps would add (`pending_tokens`) is `model_overlap.rs`'s to predict;
        // `lookup` compares it apart.
        let hit = Hit {
            tokens: tokens_hit,
            max_tokens,
            groups,
            junction,
            pending_tokens: tokens_hit,
            pending_plan: None,
        };
        (hit, unbounded)
    }

    /// A hit may only rest on keys that committed steps published.
    pub(crate) fn check_hit_was_committed(&self, hit: &Hit, seq: &SeqModel) -> Result<(), String> {
        let max_tokens = (seq.num_tokens() - 1) / self.unit * self.unit;
        ensure!(hit.tokens <= max_tokens && hit.tokens % self.unit == 0, "hit {hit:?} off range");
        ensure!(hit.groups.len() == self.groups(), "hit has {} groups", hit.groups.len());
        for g in 0..self.groups() {
            let own = hit.groups[g].tokens;
            ensure!(own <= max_tokens && own % self.unit == 0, "group hit {own} off range");
            for l in [own, hit.tokens] {
                for p in self.required(g, l) {
                    ensure!(
                        self.committed[g].contains(&seq.key(p)),
                        "hit {hit:?} uses key {p} of group {g}, which no committed step published"
                    );
                }
            }
        }
        Ok(())
    }

    // --- events ----------------------------------------------------------------------------

    pub(crate) fn events(&mut self) -> Result<Vec<CacheEvent>, String> {
        let mut out = Vec::new();
        for record in self.m.drain_events() {
            if let Some(last) = self.last_event {
                ensure!(record.sequence > last, "event sequence {} after {last}", record.sequence);
            }
            self.last_event = Some(record.sequence);
            out.push(record.event);
        }
        Ok(out)
    }

    pub(crate) fn expect_no_events(&mut self, what: &str) -> Result<(), String> {
        let events = self.events()?;
        ensure!(events.is_empty(), "{what} emitted {events:?}");
        Ok(())
    }

    /// Flattens `BlockStored` events into stored keys, checking each event's fields.
    pub(crate) fn stored(&self, events: &[CacheEvent]) -> Result<Vec<Stored>, String> {
        let unit = self.unit;
        let mut out = Vec::new();
        for event in events {
            let CacheEvent::BlockStored {
                group,
                blocks,
                keys,
                parent,
                token_start,
                token_end,
                checkpoint,
                tokens,
                tokens_start,
                lora_id,
                cache_salt,
                ..
            } = event
            else {
                return Err(format!("expected only BlockStored events, got {event:?}"));
            };
            let g = *group as usize;
            ensure!(g < self.groups() && !keys.is_empty(), "malformed {event:?}");
            ensure!(blocks.len() == keys.len(), "one block per key: {event:?}");
            ensure!(*checkpoint == self.s.state(g).is_some(), "checkpoint flag wrong: {event:?}");
            ensure!(!*checkpoint || keys.len() == 1, "a checkpoint event holds one key: {event:?}");
            ensure!(
                *token_end == token_start + keys.len() as u32 * unit,
                "token range [{token_start}, {token_end}) for {} keys",
                keys.len()
            );
            let prefixes = keys.iter().map(|d| self.prefix_of(d)).collect::<Result<Vec<_>, _>>()?;
            let last = prefixes[prefixes.len() - 1];
            for (i, &p) in prefixes.iter().enumerate() {
                ensure!(
                    p.len == token_start + (i as u32 + 1) * unit
                        && self.idents.is_prefix(p, last, unit),
                    "BlockStored keys are not the consecutive prefixes of [{token_start}, \
                     {token_end})"
                );
            }
            // The wire block is the unit here: the run carries exactly its own tokens, unit by
            // unit the tokens each key was computed from, and the sequence's salt and adapter.
            ensure!(*tokens_start == *token_start, "tokens from {tokens_start}: {event:?}");
            ensure!(
                tokens.len() == (token_end - token_start) as usize,
                "{} token ids for [{token_start}, {token_end})",
                tokens.len()
            );
            for (i, p) in prefixes.iter().enumerate() {
                let (own, salt, lora) =
                    self.unit_content.get(p).ok_or("a stored key was never learned")?;
                let u = unit as usize;
                ensure!(
                    &tokens[i * u..(i + 1) * u] == own.as_slice(),
                    "BlockStored token ids of [{}, {}) are not the tokens its key covers",
                    token_start + i as u32 * unit,
                    token_start + (i as u32 + 1) * unit
                );
                ensure!(lora == lora_id, "BlockStored lora_id {lora_id:?}, sequence's {lora:?}");
                let salt_here = if *token_start == 0 { salt.clone() } else { None };
                ensure!(
                    &salt_here == cache_salt,
                    "BlockStored cache_salt {cache_salt:?} from {token_start}, expected {salt_here:?}"
                );
            }
            match parent {
                None => ensure!(*token_start == 0, "no parent for keys from {token_start}"),
                Some(d) => {
                    let parent = self.prefix_of(d)?;
                    ensure!(
                        *token_start > 0
                            && self.idents.is_prefix(parent, last, unit)
                            && parent.len == *token_start,
                        "parent of keys from {token_start} is a prefix of {} tokens",
                        parent.len
                    );
                }
            }
            out.extend(
                prefixes.into_iter().zip(blocks).map(|(p, &block)| (g, block, p, *checkpoint)),
            );
        }
        Ok(out)
    }

    pub(crate) fn publish(&mut self, g: usize, block: u32, prefix: Prefix) {
        if self.s.state(g).is_some() {
            self.stats.groups[g].checkpoints_published += 1;
        }
        self.live[g].entry(prefix).or_default().push(block);
        self.committed[g].insert(prefix);
        self.carried[self.s.pool(g)].entry(block).or_default().push((g, prefix));
    }

    /// Applies one eviction: the block must be unpinned and carry exactly the recorded keys.
    pub(crate) fn remove_block(
        &mut self,
        event: &CacheEvent,
        held: &[HashSet<u32>],
    ) -> Result<usize, String> {
        let CacheEvent::BlockRemoved { group, block, keys, gone } = event else {
            return Err(format!("expected only BlockRemoved events, got {event:?}"));
        };
        let g = *group as usize;
        ensure!(g < self.groups(), "BlockRemoved of unknown group {g}");
        let pool = self.s.pool(g);
        ensure!(!held[pool].contains(block), "evicted block {block} of pool {pool} is in use");
        self.decode_tails[pool].remove(block);
        self.recency[pool].remove(block);
        self.stats.evictions += 1;
        self.stats.groups[g].evictions += 1;
        let recorded = self.carried[pool]
            .remove(block)
            .ok_or_else(|| format!("evicted block {block} of pool {pool} carried no key"))?;
        let removed =
            keys.iter().map(|d| Ok((g, self.prefix_of(d)?))).collect::<Result<Vec<_>, String>>()?;
        ensure!(
            sorted(removed) == sorted(recorded.clone()),
            "BlockRemoved of block {block} does not list exactly its keys"
        );
        let mut no_longer_served = Vec::new();
        for (kg, prefix) in recorded {
            let blocks = self.live[kg].get_mut(&prefix).ok_or("key not live")?;
            blocks.retain(|&b| b != *block);
            if blocks.is_empty() {
                self.live[kg].remove(&prefix);
                no_longer_served.push((kg, prefix));
                if self.s.recent_capacity > 0 {
                    self.recent[kg].insert(prefix);
                }
            }
        }
        // What leaves a router's view: exactly the keys no other block of the group serves.
        let gone =
            gone.iter().map(|d| Ok((g, self.prefix_of(d)?))).collect::<Result<Vec<_>, String>>()?;
        ensure!(
            sorted(gone) == sorted(no_longer_served),
            "BlockRemoved of block {block}: its wire keys are not exactly those no block serves now"
        );
        Ok(pool)
    }

    /// Blocks that carry keys and are pinned (tables, copy sources, resume checkpoints), per pool.
    pub(crate) fn held(&self) -> Result<Vec<HashSet<u32>>, String> {
        let mut held = vec![HashSet::new(); self.s.pools.len()];
        for (&id, seq) in &self.seqs {
            if !seq.started {
                continue;
            }
            for (g, row) in self.rows(id)?.into_iter().enumerate() {
                held[self.s.pool(g)].extend(row.into_iter().filter(|&b| b != 0).map(|b| b as u32));
            }
            if let Some(step) = &seq.step {
                for g in 0..self.groups() {
                    if let Some((src, _, _)) = step.cow[g] {
                        held[self.s.pool(g)].insert(src);
                    }
                    if step.resume[g] != 0 {
                        held[self.s.pool(g)].insert(step.resume[g]);
                    }
                }
            }
        }
        Ok(held)
    }

    pub(crate) fn lookup(&mut self, id: u64) -> Result<(), String> {
        let result = self.m.lookup(id);
        let Some(seq) = self.seqs.get(&id) else {
            ensure!(
                matches!(result, Err(CacheError::UnknownSequence { .. })),
                "lookup of unknown id: {result:?}"
            );
            return Ok(());
        };
        let hit = result.map_err(|e| format!("lookup {id}: {e}"))?;
        self.check_hit_was_committed(&hit, seq)?;
        let (expected, unbounded) = self.hit_and_unbounded(seq);
        // The pending answer: at least the hit, longer only while a plan is in flight, and
        // then naming that plan.
        let flight = self.m.plan_in_flight();
        ensure!(
            hit.pending_tokens >= hit.tokens
                && (hit.pending_tokens > hit.tokens) == hit.pending_plan.is_some()
                && (flight.is_some() || hit.pending_plan.is_none())
                && hit.pending_plan.is_none_or(|p| Some(p) == flight),
            "lookup of {id}: pending {} (plan {:?}) for a hit of {}, plan in flight {flight:?}",
            hit.pending_tokens,
            hit.pending_plan,
            hit.tokens
        );
        let hit = Hit { pending_tokens: hit.tokens, pending_plan: None, ..hit };
        ensure!(hit == expected, "lookup of {id}:\n  got      {hit:?}\n  expected {expected:?}");
        let paths = self.hit_paths(seq, &hit, &unbounded);
        self.stats.lookups += 1;
        self.stats.lookup_hit_tokens += u64::from(hit.tokens);
        for path in paths {
            self.saw(path);
        }
        if hit.junction.is_some() {
            self.saw("junction");
        }
        for g in &hit.groups {
            self.saw(match g.stop {
                None => "group hit reaches the end",
                Some(MissReason::NotCached) => "stop not_cached",
                Some(MissReason::RecentlyEvicted) => "stop recently_evicted",
                Some(MissReason::NoStateAtPosition) => "stop no_state_at_position",
                Some(MissReason::WindowGap) => "stop window_gap",
            });
        }
        Ok(())
    }

    /// Which interesting paths a lookup's hit shows.
    fn hit_paths(&self, seq: &SeqModel, hit: &Hit, unbounded: &[u32]) -> Vec<&'static str> {
        let unit = self.unit;
        let mut paths = Vec::new();
        if hit.tokens > 0 {
            paths.push("hit");
            let unpublished = (1..=hit.tokens / unit)
                .any(|i| self.live.iter().all(|keys| !keys.contains_key(&seq.key(i * unit))));
            if self.s.verify_tokens && unpublished {
                paths.push("verified hit above a unit nobody publishes");
            }
        }
        if (0..self.groups()).any(|g| hit.groups[g].tokens < unbounded[g]) {
            paths.push("group hit bounded by full attention");
        }
        // The next unit is published, for the same tokens, by a sequence with other extra keys.
        let next = hit.tokens + unit;
        if next <= hit.max_tokens && !self.live[0].contains_key(&seq.key(next)) {
            let key = seq.key(next);
            let others = self.live[0].keys().filter(|k| k.len == next);
            for other in others {
                if self.idents.differs_by_images(*other, key) {
                    paths.push("hit stopped by an image");
                    break;
                }
                if self.idents.differs_by_root(*other, key) {
                    paths.push("hit stopped by a salt or adapter");
                    break;
                }
            }
        }
        paths
    }

    /// Checkpoint blocks group `g` holds: published ones (cached or pinned), private decode
    /// tails, and those the plan in flight wrote.
    pub(crate) fn checkpoint_blocks(&self, g: usize) -> u64 {
        let pool = self.s.pool(g);
        let published =
            self.carried[pool].values().filter(|keys| keys.iter().any(|(kg, _)| *kg == g)).count();
        let private = self.seqs.values().filter(|s| s.decode_tail[g].is_some()).count();
        let in_flight: usize = self.in_flight.as_ref().map_or(0, |plan| {
            plan.seq_ids
                .iter()
                .filter_map(|id| self.seqs.get(id)?.step.as_ref())
                .map(|step| step.written[g].len())
                .sum()
        });
        (published + private + in_flight) as u64
    }

    /// Every pool's checkpoint count is its state groups' own; no group exceeds its cap.
    fn check_checkpoint_accounting(&self) -> Result<(), String> {
        let usage = self.m.pool_usage();
        let mut per_pool = vec![0u64; usage.len()];
        for g in 0..self.groups() {
            let Some(config) = self.s.state(g) else { continue };
            let n = self.checkpoint_blocks(g);
            per_pool[self.s.pool(g)] += n;
            if let Some(cap) = config.checkpoint_cap {
                ensure!(
                    n <= u64::from(cap),
                    "state group {g} holds {n} checkpoint blocks, beyond its cap of {cap}"
                );
            }
        }
        for (p, u) in usage.iter().enumerate() {
            ensure!(
                u64::from(u.checkpoints) == per_pool[p],
                "pool {p} counts {} checkpoint blocks, its state groups hold {}",
                u.checkpoints,
                per_pool[p]
            );
        }
        Ok(())
    }

    pub(crate) fn check_all(&mut self) -> Result<(), String> {
        self.m.check_invariants().map_err(|e| e.to_string())?;
        self.refresh_recency()?;
        self.check_checkpoint_accounting()?;
        let usage = self.m.pool_usage();
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.lookup(id)?;
            let seq = self.seq(id)?;
            ensure!(
                self.m.num_computed(id) == Ok(seq.num_computed)
                    && self.m.num_tokens(id) == Ok(seq.num_tokens()),
                "sequence {id}: manager at {:?} of {:?}, model at {} of {}",
                self.m.num_computed(id),
                self.m.num_tokens(id),
                seq.num_computed,
                seq.num_tokens()
            );
        }
        self.expect_no_events("lookup")?;
        ensure!(self.m.pool_usage() == usage, "lookups changed the pools");
        ensure!(self.m.num_sequences() == self.seqs.len(), "{} sequences", self.m.num_sequences());
        ensure!(
            self.m.plan_in_flight() == self.in_flight.as_ref().map(|p| p.step_id),
            "plan in flight {:?}",
            self.m.plan_in_flight()
        );
        let stats = self.m.stats();
        ensure!(
            stats == self.stats,
            "statistics\n  got      {stats:?}\n  expected {:?}",
            self.stats
        );
        for (p, u) in usage.iter().enumerate() {
            ensure!(
                u.cached as usize <= self.carried[p].len(),
                "pool {p} caches {} blocks but the model knows {} published ones",
                u.cached,
                self.carried[p].len()
            );
        }
        Ok(())
    }

    /// Commits what is in flight and finishes everything: no block may stay owned.
    pub(crate) fn wind_down(&mut self) -> Result<(), String> {
        if self.in_flight.is_some() {
            self.commit(0)?;
        }
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.release(id, true)?;
            self.check_all()?;
        }
        for (p, u) in self.m.pool_usage().iter().enumerate() {
            let checkpoints = self.carried[p]
                .values()
                .filter(|keys| keys.iter().any(|(g, _)| self.s.state(*g).is_some()))
                .count();
            ensure!(
                u.owned == 0
                    && u.cached as usize == self.carried[p].len()
                    && u.checkpoints as usize == checkpoints,
                "pool {p} after finishing everything: {u:?}, model knows {} published blocks, \
                 {checkpoints} checkpoints",
                self.carried[p].len()
            );
        }
        self.reset()?;
        self.check_all()
    }
}
