//! `CacheManager`: the step protocol's entry points and the state they share.
//!
//! Lifecycle of a step (the contract with the engine):
//! `add` -> `lookup` -> `schedule` (per sequence) -> `build_plan` -> kernels -> `commit` | `abort`
//! -> `append` (decode) -> ... -> `finish` | `preempt`.
//!
//! `CacheManager` is the protocol on top of the parts: the block store (`store.rs`: pools,
//! index, evictions, events; the only code that allocates, publishes and evicts), the sequence
//! table (`table.rs`), the group layout and rules (`config.rs`), the sequences and their phase
//! (`sequence.rs`), and three functions of store, layout and one sequence: the hit rule
//! (`hit.rs`), admission (`admission.rs`) and checkpoint planning (`checkpoints.rs`). This file
//! owns the protocol's state and the calls that register, extend, release and inspect sequences
//! (`add`, `lookup`, `append`, `finish`, `preempt`, `reset`, statistics); `schedule.rs`,
//! `plan.rs` and `commit.rs` hold the calls of the step itself, `invariants.rs` checks it all.
//! No part imports this file or those. The protocol never
//! allocates, publishes or evicts itself (it asks the store); it pins and releases blocks
//! through the pools' reference counts.
//! Invariants kept between calls: nothing is reachable through the index before the commit of
//! the step that wrote it, nor before every token of its prefix is known (placeholders); at
//! most `max_steps_in_flight` plans are in flight, ending in build order; every block is free,
//! owned or cached (see `pool.rs`); a started sequence holds exactly the blocks of its tables,
//! its running buffers (the pair, and one more per further step in flight), its resume pin,
//! its decode-tail snapshot, its committed checkpoints waiting for their tokens and the
//! blocks of its scheduled and in-flight steps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::{CacheConfig, CheckpointGrid, GroupLayout, GroupSlot};
use crate::error::{CacheError, Result};
use crate::events::{EventLog, EventRecord};
use crate::hashing::{validate_sequence, Digest, ExtraKeys, Hasher};
use crate::hit::{compute_hit, Hit};
use crate::index::HashIndex;
use crate::pool::{BlockId, BlockPool, LruEnd, NULL_BLOCK};
use crate::sequence::{PagedSeq, Phase, PlaceholderLog, Retiring, Sequence, StateSeq, StepRing};
use crate::stats::{GroupStats, Stats};
use crate::store::BlockStore;
use crate::table::{shared_units, Deferred, SequenceTable};

use crate::hit::pending_hit;
pub use crate::limits::MAX_SEQUENCE_TOKENS;
use crate::limits::{human_bytes, try_vec, MAX_BATCH_SEQUENCES};
use rustc_hash::FxHashMap;

/// The id of the next manager built (0 is no manager's: a default `StepPlan` is foreign).
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// Refuses a batch of more than `MAX_BATCH_SEQUENCES` ids before anything is copied.
pub(crate) fn check_batch_len(len: usize, call: &str) -> Result<()> {
    if len > MAX_BATCH_SEQUENCES {
        return Err(CacheError::invalid(format!(
            "{call} got {len} sequence ids: at most {MAX_BATCH_SEQUENCES} in one call"
        )));
    }
    Ok(())
}

/// The protocol's steps: the one being scheduled (its sequences and tokens) and the plans in
/// flight (at most `max_steps_in_flight`, oldest first).
#[derive(Debug)]
pub(crate) struct Steps {
    /// Slots scheduled since the last plan, in schedule order.
    pub scheduled: Vec<usize>,
    /// Tokens those slots scheduled, at most `MAX_STEP_TOKENS`.
    pub scheduled_tokens: u32,
    pub in_flight: VecDeque<InFlight>,
    /// The id of the next plan built.
    pub next_step: u64,
}

/// The plan in flight.
#[derive(Clone, Debug)]
pub(crate) struct InFlight {
    pub step_id: u64,
    pub slots: Vec<usize>,
}

/// The step error of an append of known tokens after unresolved placeholders.
#[cold]
fn placeholders_pending(seq_id: u64, placeholders: u32) -> CacheError {
    CacheError::step(format!(
        "sequence {seq_id} has {placeholders} placeholder token(s) not yet resolved: resolve them \
         before appending known tokens after them"
    ))
}

/// The error of an append that would take a sequence beyond `MAX_SEQUENCE_TOKENS`.
#[cold]
fn too_long(seq_id: u64, count: usize) -> CacheError {
    CacheError::invalid(format!(
        "appending {count} token(s) to sequence {seq_id} would exceed {MAX_SEQUENCE_TOKENS} tokens"
    ))
}

/// The step error of a call refused while a plan is in flight.
#[cold]
fn refused_in_flight(call: &str, step_id: u64) -> CacheError {
    CacheError::step(format!(
        "{call} is not allowed while the plan of step {step_id} is in flight: commit or abort it \
         first"
    ))
}

/// What `add` did with the prompt's hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Added {
    /// Tokens whose unit hashes were reused: from the `extends` sequence, or without `extends`
    /// from a live sequence with the same prefix (`CacheConfig::reuse_live_prefixes`).
    pub reused_tokens: u32,
    /// Units hashed by this call.
    pub hashed_units: u32,
    /// Whether the `extends` sequence was found (running or in the finished cache).
    pub extends_found: bool,
}

/// Blocks of one pool: what a user sees of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolUsage {
    pub num_blocks: u32,
    pub free: u32,
    pub cached: u32,
    pub owned: u32,
    pub checkpoints: u32,
}

/// The prefix-cache manager. Single-threaded (`&mut self`); the bindings wrap it in a mutex.
#[derive(Debug)]
pub struct CacheManager {
    pub(crate) config: CacheConfig,
    /// Unique in the process: the plans this manager builds carry it.
    pub(crate) manager_id: u64,
    pub(crate) unit: u32,
    /// Where non-final chunks end and checkpoints may be requested.
    pub(crate) grid: CheckpointGrid,
    /// The groups, paged and state apart.
    pub(crate) layout: GroupLayout,
    /// Pools, index, eviction record and events: every allocation, publication and eviction.
    pub(crate) store: BlockStore,
    pub(crate) hasher: Hasher,
    /// Live sequences by id and slot, the finished ones kept for `extends`, live prefixes.
    pub(crate) table: SequenceTable,
    /// The step being scheduled and the plan in flight.
    pub(crate) steps: Steps,
    /// Started sequences (holding blocks).
    pub(crate) started: usize,
    pub(crate) stats: Stats,
}

/// Most keys the hash index reserves room for up front (one per pool block below it); a
/// larger cache grows the table as it fills.
const INDEX_RESERVE_MAX: usize = 1 << 21;

impl CacheManager {
    /// Builds a manager; the configuration is validated first.
    pub fn new(config: CacheConfig) -> Result<Self> {
        config.validate()?;
        let layout = GroupLayout::new(&config);
        let stats = Stats { groups: vec![GroupStats::default(); layout.len()], ..Stats::default() };
        let pools = config
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                BlockPool::try_new(p.num_blocks)
                    .map_err(|message| CacheError::config(format!("pool {i}: {message}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let index = HashIndex::new(
            config.recently_evicted_capacity,
            config.hash.verify_tokens,
            config
                .pools
                .iter()
                .map(|p| p.num_blocks as usize)
                .sum::<usize>()
                .min(INDEX_RESERVE_MAX),
        );
        let hasher = Hasher::new(config.hash.algorithm, config.hash.seed);
        let store = BlockStore::new(
            pools,
            index,
            EventLog::new(config.enable_events, config.max_pending_events, wire_format(&config)),
            layout.pool_of.clone(),
            config.hash.unit,
            hasher.seed_digest(),
        );
        Ok(Self {
            manager_id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
            unit: config.hash.unit,
            grid: config.checkpoint_grid(),
            store,
            hasher,
            table: SequenceTable::new(config.finished_cache_bytes),
            steps: Steps {
                scheduled: Vec::new(),
                scheduled_tokens: 0,
                in_flight: VecDeque::new(),
                next_step: 1,
            },
            started: 0,
            stats,
            layout,
            config,
        })
    }

    #[must_use]
    pub fn config(&self) -> &CacheConfig {
        &self.config
    }

    /// The grid non-final prefill chunks end on (lcm of the state groups' alignments).
    #[must_use]
    pub fn chunk_alignment(&self) -> u32 {
        self.grid.alignment
    }

    /// This manager's id, unique in the process: every plan it builds carries it
    /// (`StepPlan::manager`), and `commit`, `abort` and `decode_step` tell its plans by it.
    #[must_use]
    pub fn id(&self) -> u64 {
        self.manager_id
    }

    #[inline]
    pub(crate) fn slot(&self, seq_id: u64) -> Result<usize> {
        self.table.slot(seq_id)
    }

    #[inline]
    pub(crate) fn seq(&self, slot: usize) -> &Sequence {
        self.table.get(slot)
    }

    #[inline]
    pub(crate) fn seq_mut(&mut self, slot: usize) -> &mut Sequence {
        self.table.get_mut(slot)
    }

    /// The hit rule applied to a live sequence now, with the full-attention chains it chose.
    /// The hit of `seq` now; with plans in flight also what they will add (`pending_tokens`,
    /// `pending_plan`) and, at D > 1, the junction their keys show, so a prompt scheduled while
    /// a prefix it shares is still being computed takes the junction checkpoint it would take
    /// one step at a time (only the checkpoint's position comes from pending content, never a
    /// hit).
    pub(crate) fn hit_of(&self, seq: &Sequence) -> (Hit, Vec<Vec<BlockId>>) {
        let (mut hit, chains) =
            compute_hit(&self.store, &self.layout, seq.content(), &seq.hint_chains);
        if !self.steps.in_flight.is_empty() {
            let pending = self.pending_keys();
            let p = pending_hit(&self.store, &self.layout, seq.content(), &pending, &hit);
            (hit.pending_tokens, hit.pending_plan) = (p.tokens, p.plan);
            // At D = 1 nothing is scheduled while a plan is in flight: the junction stays the
            // committed one, exactly as before overlapped steps.
            if self.config.max_steps_in_flight > 1 {
                hit.junction = p.junction;
            }
        }
        (hit, chains)
    }

    pub(crate) fn refuse_in_flight(&self, call: &str) -> Result<()> {
        match self.steps.in_flight.front() {
            Some(f) => Err(refused_in_flight(call, f.step_id)),
            None => Ok(()),
        }
    }

    /// `refuse_in_flight` with one plan in flight at most (D = 1); with D > 1 the call is
    /// allowed while plans are in flight (overlapped steps).
    #[inline]
    pub(crate) fn refuse_in_flight_classic(&self, call: &str) -> Result<()> {
        if self.config.max_steps_in_flight > 1 {
            return Ok(());
        }
        self.refuse_in_flight(call)
    }

    /// The overlay of `lookup`'s pending answer: every key an in-flight step will publish at
    /// its commit (its prefix known), with the plan that publishes it (the oldest, if two do).
    fn pending_keys(&self) -> FxHashMap<(u32, Digest), u64> {
        let unit = self.unit;
        let mut keys: FxHashMap<(u32, Digest), u64> = FxHashMap::default();
        let mut add = |group: usize, digest: Digest, plan: u64| {
            keys.entry((group as u32, digest)).and_modify(|p| *p = (*p).min(plan)).or_insert(plan);
        };
        for flight in &self.steps.in_flight {
            for &slot in &flight.slots {
                let seq = self.seq(slot);
                let known = seq.hashes.len() as u32 * unit;
                let Some(step) = seq.steps().find(|s| s.plan == flight.step_id) else {
                    continue;
                };
                let mut q = (step.start / unit + 1) * unit;
                while q <= step.end.min(known) {
                    for group in &self.layout.paged {
                        add(group.index, seq.hashes[(q / unit - 1) as usize], flight.step_id);
                    }
                    q += unit;
                }
                for (state, group) in step.state.iter().zip(&self.layout.state) {
                    for c in state.interior.iter().chain(&state.snapshot) {
                        if !c.decode_tail && c.position <= known {
                            let digest = seq.hashes[(c.position / unit - 1) as usize];
                            add(group.index, digest, flight.step_id);
                        }
                    }
                }
            }
        }
        keys
    }

    /// Registers a sequence and hashes its full units. `extends` names a live or recently
    /// finished sequence whose hashes are reused for the common token prefix.
    pub fn add(
        &mut self,
        seq_id: u64,
        tokens: &[u32],
        extra: ExtraKeys,
        extends: Option<u64>,
    ) -> Result<Added> {
        self.check_add(seq_id, tokens, &extra)?;
        self.admit(seq_id, tokens, extra, extends, None)
    }

    /// What `add` refuses before it changes anything: a live id, an empty prompt, a sequence
    /// `validate_sequence` refuses.
    pub(crate) fn check_add(&self, seq_id: u64, tokens: &[u32], extra: &ExtraKeys) -> Result<()> {
        if self.table.by_id.contains_key(&seq_id) {
            return Err(CacheError::DuplicateSequence { seq_id });
        }
        if tokens.is_empty() {
            return Err(CacheError::invalid(format!(
                "sequence {seq_id} has no tokens: a prompt needs at least one token"
            )));
        }
        validate_sequence(tokens.len(), extra)
    }

    /// `add` of a request `check_add` accepted. With `deferred` (`add_batch`), the digests
    /// past those reused and unit 0 are left for the batch to compute, and a source that is
    /// itself deferred is hashed first if this request reuses more of it than it holds.
    pub(crate) fn admit(
        &mut self,
        seq_id: u64,
        tokens: &[u32],
        extra: ExtraKeys,
        extends: Option<u64>,
        mut deferred: Option<&mut Deferred>,
    ) -> Result<Added> {
        let unit = self.unit;
        // Headroom for decoded tokens, so the first appends do not copy a long prompt.
        let capacity = tokens.len() + tokens.len() / 16 + 256;
        let (first, live) = match extends {
            None => self.live_prefix_source(tokens, &extra),
            Some(_) => (None, None),
        };
        let source = extends.or(live);
        // A deferred source is compared with the digests it will hold, as after its own `add`.
        let source_units = source.and_then(|o| deferred.as_deref()?.units_of(o));
        let (extends_found, (common, n)) = match source.and_then(|o| self.table.extends_source(o)) {
            Some((t, e, h)) => {
                let units = source_units.unwrap_or(h.len());
                (extends.is_some(), shared_units(unit, tokens, &extra, &t, &e, units))
            }
            None => (false, (0, 0)),
        };
        if let (Some(d), Some(o)) = (deferred.as_deref_mut(), source) {
            d.settle(&mut self.table, &mut self.hasher, unit, o, n);
        }
        // From here on the live sequence is `extends`, when it shares a unit.
        let extends = extends.or_else(|| live.filter(|_| n > 0));
        // A finished sequence extended by its next turn hands its buffers over: the shared
        // prefix is compared, neither copied nor rehashed. A record keeps what the new turn
        // does not share, so the finished id stays available to `extends` exactly as it was.
        let shared_tokens = n * unit as usize;
        let mut hint_chains = match extends {
            Some(o) if n > 0 => self.extends_hint(o, shared_tokens),
            _ => Vec::new(),
        };
        let serial = self.table.next_serial;
        self.table.next_serial += 1;
        let direct = extends
            .filter(|&o| n > 0 && !self.table.by_id.contains_key(&o))
            .and_then(|o| self.table.finished.serial_of(o));
        let taken = match direct {
            Some(previous) => self
                .table
                .continue_finished(self.unit, previous, seq_id, serial, common, n, capacity)?,
            None => None,
        };
        let (owned, mut hashes) = if let Some(previous) = taken {
            if hint_chains.is_empty() {
                hint_chains = previous.chains;
            }
            let mut owned = previous.tokens;
            owned.extend_from_slice(&tokens[common..]);
            (owned, previous.hashes)
        } else {
            let mut hashes = try_vec(capacity / unit as usize, "the digests of the prompt")
                .map_err(CacheError::invalid)?;
            if let Some((_, _, other_hashes)) = extends.and_then(|o| self.table.extends_source(o)) {
                hashes.extend_from_slice(&other_hashes[..n]);
            }
            let mut owned =
                try_vec(capacity, "a copy of the prompt's tokens").map_err(CacheError::invalid)?;
            owned.extend_from_slice(tokens);
            (owned, hashes)
        };
        hashes
            .try_reserve((capacity / unit as usize).saturating_sub(hashes.len()))
            .map_err(|_| CacheError::invalid("the prompt's digests could not be allocated"))?;
        let reused = hashes.len();
        if reused == 0 {
            hashes.extend(first); // unit 0, hashed by `live_prefix_source`
        }
        let units = self.hash_prompt(&owned, &extra, &mut hashes, deferred.is_some());
        let hashed_units = (units - reused) as u32;
        if let Some(&h) = hashes.first().filter(|_| self.config.reuse_live_prefixes) {
            self.table.live_prefixes.insert(h, seq_id);
        }
        self.table.finished.unmap(seq_id);
        let seq = Sequence {
            id: seq_id,
            serial,
            tokens: owned,
            extra,
            hashes,
            num_computed: 0,
            phase: Phase::Waiting { last_hit: None },
            prefill_target: 0,
            junction: None,
            paged: vec![PagedSeq::default(); self.layout.paged.len()],
            state: vec![StateSeq::default(); self.layout.state.len()],
            hint_chains,
            ring: StepRing::default(),
            placeholders: 0,
            placeholder_log: PlaceholderLog::default(),
            keys_pending_from: None,
            pending_checkpoints: Vec::new(),
            retiring: None,
        };
        let slot = self.table.insert(seq);
        if let Some(d) = deferred.filter(|_| units > self.seq(slot).hashes.len()) {
            d.defer(seq_id, slot, units);
        }
        Ok(Added { reused_tokens: reused as u32 * unit, hashed_units, extends_found })
    }

    /// Without `extends`, a live sequence with the same first unit stands in for it (with
    /// `reuse_live_prefixes`): `add` compares its tokens and extra keys exactly as those of
    /// `extends`, so only a prefix whose digests are provably this prompt's is reused. Returns
    /// the digest of unit 0 (hashed here, not again by `add`) and that sequence, if any.
    fn live_prefix_source(
        &mut self,
        tokens: &[u32],
        extra: &ExtraKeys,
    ) -> (Option<Digest>, Option<u64>) {
        let reuse = self.config.reuse_live_prefixes;
        let Some(head) = tokens.get(..self.unit as usize).filter(|_| reuse) else {
            return (None, None);
        };
        let first = self.hasher.hash_unit(&self.hasher.seed_digest(), 0, head, extra);
        (Some(first), self.table.live_prefixes.get(&first).copied())
    }

    /// Per group, the first blocks of a sequence's full-attention table covering at most
    /// `tokens` tokens in whole blocks (empty for other groups).
    fn full_attention_tables(&self, seq: &Sequence, tokens: usize) -> Vec<Vec<BlockId>> {
        self.layout
            .slots
            .iter()
            .map(|slot| match *slot {
                GroupSlot::Paged(i) if self.layout.paged[i].window.is_none() => {
                    let paged = &seq.paged[i];
                    let full = tokens / self.layout.paged[i].block_size as usize;
                    paged.table[..full.min(paged.table.len())].to_vec()
                }
                _ => Vec::new(),
            })
            .collect()
    }

    /// The blocks `extends = id` held for the first `tokens` tokens (live or finished).
    fn extends_hint(&self, id: u64, tokens: usize) -> Vec<Vec<BlockId>> {
        if let Some(&slot) = self.table.by_id.get(&id) {
            return self.full_attention_tables(self.seq(slot), tokens);
        }
        let Some(f) =
            self.table.finished.serial_of(id).and_then(|s| self.table.finished.get_serial(s))
        else {
            return Vec::new();
        };
        f.chains
            .iter()
            .enumerate()
            .map(|(g, chain)| {
                let block = self.layout.paged_group(g).map(|p| p.block_size);
                let full = block.map_or(0, |b| tokens / b as usize);
                chain[..full.min(chain.len())].to_vec()
            })
            .collect()
    }

    /// The reconciled hit of a live sequence now. Changes no cache state (counts a statistic).
    /// With plans in flight it also reports the hit the sequence would get once they commit
    /// (`Hit::pending_tokens`) and the plan that commit waits for (`Hit::pending_plan`).
    pub fn lookup(&mut self, seq_id: u64) -> Result<Hit> {
        let slot = self.slot(seq_id)?;
        let (hit, chains) = self.hit_of(self.seq(slot));
        self.stats.lookups += 1;
        self.stats.lookup_hit_tokens += u64::from(hit.tokens);
        // Kept for the next schedule only while no plan is in flight: their keys (and the
        // tokens `resolve` makes known) change the pending answer and, at D > 1, the junction
        // without changing the index.
        let epoch = self.store.hit_epoch();
        let quiet = self.steps.in_flight.is_empty();
        if let Phase::Waiting { last_hit } = &mut self.seq_mut(slot).phase {
            *last_hit = quiet.then(|| Box::new((epoch, hit.clone(), chains)));
        }
        Ok(hit)
    }

    /// Appends sampled (or new user) tokens; new full units are hashed incrementally.
    pub fn append(&mut self, seq_id: u64, tokens: &[u32]) -> Result<()> {
        self.refuse_in_flight_classic("append")?;
        let slot = self.slot(seq_id)?;
        self.check_append(slot, tokens.len())?;
        self.append_slot(slot, tokens)
    }

    /// `append` for many sequences, one token each (a decode step): one crossing from Python.
    /// Every id is checked before anything changes.
    pub fn append_batch(&mut self, seq_ids: &[u64], tokens: &[u32]) -> Result<()> {
        self.refuse_in_flight_classic("append")?;
        if seq_ids.len() != tokens.len() {
            return Err(CacheError::invalid(format!(
                "append_batch got {} sequence ids but {} tokens: give one token per sequence",
                seq_ids.len(),
                tokens.len()
            )));
        }
        check_batch_len(seq_ids.len(), "append_batch")?;
        let mut slots =
            try_vec(seq_ids.len(), "the batch's sequence slots").map_err(CacheError::invalid)?;
        for &id in seq_ids {
            let slot = self.slot(id)?;
            self.check_append(slot, 1)?;
            slots.push(slot);
        }
        self.table.refuse_repeats(&slots, "append_batch")?;
        for (&slot, token) in slots.iter().zip(tokens) {
            self.append_slot(slot, std::slice::from_ref(token))?;
        }
        Ok(())
    }

    /// Whether `count` more known tokens fit sequence `slot` (`MAX_SEQUENCE_TOKENS`) and
    /// may be appended (no placeholder is pending before them).
    #[inline]
    pub(crate) fn check_append(&self, slot: usize, count: usize) -> Result<()> {
        let seq = self.seq(slot);
        // One test on the decode step's path; the refusals are built out of line.
        if seq.placeholders == 0 && seq.tokens.len().saturating_add(count) <= MAX_SEQUENCE_TOKENS {
            return Ok(());
        }
        if seq.placeholders > 0 {
            return Err(placeholders_pending(seq.id, seq.placeholders));
        }
        Err(too_long(seq.id, count))
    }

    /// Whether `count` more tokens (known or placeholders) fit sequence `slot`.
    #[inline]
    fn check_length(&self, slot: usize, count: usize) -> Result<()> {
        let seq = self.seq(slot);
        if (seq.num_tokens() as usize).saturating_add(count) > MAX_SEQUENCE_TOKENS {
            return Err(too_long(seq.id, count));
        }
        Ok(())
    }

    /// Appends to a live sequence whose length the caller checked (`check_append`).
    pub(crate) fn append_slot(&mut self, slot: usize, tokens: &[u32]) -> Result<()> {
        let unit = self.unit;
        let seq = self.table.get_mut(slot);
        // Beyond the headroom `add` reserved (a decode step's token never is), the new tokens
        // and their digests are reserved fallibly: the caller chose how many there are.
        if seq.tokens.capacity() - seq.tokens.len() < tokens.len() {
            let units = (seq.tokens.len() + tokens.len()) / unit as usize;
            if seq.tokens.try_reserve(tokens.len()).is_err()
                || seq.hashes.try_reserve(units.saturating_sub(seq.hashes.len())).is_err()
            {
                return Err(CacheError::invalid(format!(
                    "appending {} tokens to sequence {} needs {} of memory, which could not \
                     be allocated",
                    tokens.len(),
                    seq.id,
                    human_bytes(tokens.len().saturating_mul(4 + 32 / unit as usize))
                )));
            }
        }
        seq.tokens.extend_from_slice(tokens);
        seq.forget_hit();
        self.hasher.extend(&seq.tokens, unit, &seq.extra, &mut seq.hashes);
        Ok(())
    }

    /// Releases a sequence's blocks (tail first), publishes its decode-tail checkpoint, and
    /// keeps its tokens and hashes for `extends`. A sequence scheduled for a step not yet built
    /// is dropped from that step.
    ///
    /// With steps of it in flight (D > 1) its id is free and its record kept for `extends`
    /// at once, but its blocks are released (tail first) when the last of them ends; their
    /// keys are published at commit as far as its tokens are known (its placeholders are never
    /// resolved).
    pub fn finish(&mut self, seq_id: u64) -> Result<()> {
        self.refuse_in_flight_classic("finish")?;
        let slot = self.slot(seq_id)?;
        self.drop_scheduled(slot);
        let chains = self.full_attention_tables(self.seq(slot), usize::MAX);
        if self.seq(slot).num_steps() > 0 {
            self.seq_mut(slot).retiring = Some(Retiring::Finish);
            self.table.retire(slot, chains);
            return Ok(());
        }
        self.release_all(slot, true);
        self.table.finish(slot, chains);
        Ok(())
    }

    /// Releases a sequence's blocks (publishing nothing new); it stays live and is recomputed
    /// from a fresh lookup at its next `schedule`.
    ///
    /// With steps of it in flight (D > 1) its blocks are released when the last of them ends;
    /// it cannot be scheduled before.
    pub fn preempt(&mut self, seq_id: u64) -> Result<()> {
        self.refuse_in_flight_classic("preempt")?;
        let slot = self.slot(seq_id)?;
        self.drop_scheduled(slot);
        if self.seq(slot).num_steps() > 0 {
            self.seq_mut(slot).retiring = Some(Retiring::Preempt);
            return Ok(());
        }
        self.release_all(slot, false);
        Ok(())
    }

    /// Drops the sequence's step scheduled for the next plan, if it has one (not one in
    /// flight).
    pub(crate) fn drop_scheduled(&mut self, slot: usize) {
        if let Some(step) = self.seq(slot).step().filter(|s| s.plan == 0) {
            // Only a step not yet built is on `scheduled` (a built one is in flight).
            if self.steps.scheduled.contains(&slot) {
                self.steps.scheduled_tokens -= step.end - step.start;
            }
            self.steps.scheduled.retain(|&s| s != slot);
            self.undo_step(slot);
        }
    }

    /// What follows the end (commit or undo) of a step of `slot`: a sequence left without a
    /// step gives its extra running buffers back, and one finished or preempted while it was
    /// in flight is released now.
    #[inline]
    pub(crate) fn after_step_ended(&mut self, slot: usize) {
        if !self.table.is_live(slot) {
            return; // released already (a finished sequence in several ended plans)
        }
        let seq = self.seq(slot);
        if seq.num_steps() > 0 {
            return;
        }
        if seq.state.iter().any(|s| !s.extra.is_empty()) {
            for (i, group) in self.layout.state.iter().enumerate() {
                let state = &mut self.table.get_mut(slot).state[i];
                state.spare = NULL_BLOCK; // (it may be one of them)
                let extra = std::mem::take(&mut state.extra);
                for block in extra.into_iter().rev() {
                    self.store.pools[group.pool].decref(block, LruEnd::MostRecent);
                }
            }
        }
        match self.seq(slot).retiring {
            None => {}
            Some(Retiring::Preempt) => {
                self.seq_mut(slot).retiring = None;
                self.release_all(slot, false);
            }
            Some(Retiring::Finish) => {
                self.release_all(slot, true);
                self.table.drop_retired(slot);
            }
        }
    }

    /// Releases every block a started sequence holds, tail first.
    fn release_all(&mut self, slot: usize, publish_decode_tail: bool) {
        let Some(mut seq) = self.table.take(slot) else {
            return;
        };
        if seq.started() {
            self.started -= 1;
        }
        for g in 0..self.layout.len() {
            let pool = self.layout.pool(g);
            match self.layout.slots[g] {
                GroupSlot::Paged(i) => {
                    let paged = std::mem::take(&mut seq.paged[i]);
                    for &block in paged.table.iter().rev() {
                        self.store.pools[pool].decref(block, LruEnd::MostRecent);
                    }
                }
                GroupSlot::State(i) => {
                    let state = std::mem::take(&mut seq.state[i]);
                    for &block in state.extra.iter().rev() {
                        self.store.pools[pool].decref(block, LruEnd::MostRecent);
                    }
                    for block in [state.running[1], state.running[0], state.resume] {
                        self.store.pools[pool].decref(block, LruEnd::MostRecent);
                    }
                    if let Some((block, position)) = state.decode_tail {
                        // (a tail over a placeholder never resolved has no key to publish)
                        let known = seq.hashes.len() as u32 * self.unit;
                        if publish_decode_tail && position <= known {
                            self.publish_decode_tail(g, &seq, block, position);
                        } else {
                            self.store.pools[pool].decref(block, LruEnd::MostRecent);
                        }
                    }
                }
            }
        }
        for (g, block, _) in std::mem::take(&mut seq.pending_checkpoints) {
            self.store.pools[self.layout.pool(g)].decref(block, LruEnd::MostRecent);
        }
        if seq.started() {
            seq.stop();
        }
        self.table.put(slot, seq);
    }

    /// Drops every cached block and key. Refused while any sequence holds blocks or a plan is
    /// in flight.
    pub fn reset(&mut self) -> Result<()> {
        self.refuse_in_flight("reset")?;
        if self.started > 0 {
            return Err(CacheError::ResetRefused { live: self.started });
        }
        for slot in std::mem::take(&mut self.steps.scheduled) {
            self.undo_step(slot);
        }
        self.steps.scheduled_tokens = 0;
        self.store.clear();
        Ok(())
    }

    /// Takes the pending block events, oldest first.
    pub fn drain_events(&mut self) -> Vec<EventRecord> {
        self.store.events.drain()
    }

    /// Takes the pending block events and writes them at the start of `buf`, in place, as one
    /// vLLM 0.33 `KVEventBatch` (msgpack; `events::encode_batch_into`: a buffer kept across
    /// drains is not cleared or reallocated) stamped `ts` (seconds) and `rank`; writes nothing
    /// when none is pending. The batch is `buf[..bytes]` of the result, which counts the events
    /// taken and the wire events written (a run or eviction with no wire-block boundary has no
    /// wire form).
    pub fn drain_events_wire(
        &mut self,
        ts: f64,
        rank: Option<i64>,
        buf: &mut Vec<u8>,
    ) -> crate::events::WireDrain {
        self.store.events.drain_wire(ts, rank, buf)
    }

    /// The wire format `drain_events_wire` encodes in (W, U, digest length, group kinds).
    #[must_use]
    pub fn event_format(&self) -> &crate::events::WireFormat {
        self.store.events.format()
    }

    /// A snapshot of the counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        let mut stats = self.stats.clone();
        stats.events_dropped = self.store.events.dropped();
        stats.evictions = self.store.evictions;
        for (group, &evictions) in stats.groups.iter_mut().zip(&self.store.group_evictions) {
            group.evictions = evictions;
        }
        stats
    }

    /// Block usage per pool.
    #[must_use]
    pub fn pool_usage(&self) -> Vec<PoolUsage> {
        self.store
            .pools
            .iter()
            .map(|p| PoolUsage {
                num_blocks: p.num_blocks(),
                free: p.num_free(),
                cached: p.num_cached(),
                owned: p.num_blocks() - 1 - p.num_free() - p.num_cached(),
                checkpoints: p.num_checkpoints(),
            })
            .collect()
    }

    /// Number of live sequences.
    #[must_use]
    pub fn num_sequences(&self) -> usize {
        self.table.by_id.len()
    }

    /// Number of finished sequences kept for `extends`.
    #[must_use]
    pub fn num_finished_cached(&self) -> usize {
        self.table.finished.len()
    }

    /// Tokens of a live sequence computed and committed so far.
    pub fn num_computed(&self, seq_id: u64) -> Result<u32> {
        Ok(self.seq(self.slot(seq_id)?).num_computed)
    }

    /// Tokens of a live sequence (prompt plus appended).
    pub fn num_tokens(&self, seq_id: u64) -> Result<u32> {
        Ok(self.seq(self.slot(seq_id)?).num_tokens())
    }

    /// Tokens scheduled for the next plan so far (what `build_plan` will work through).
    #[must_use]
    pub fn scheduled_tokens(&self) -> usize {
        self.steps.scheduled_tokens as usize
    }

    /// The oldest plan in flight (the one to commit or abort next), if any.
    #[must_use]
    pub fn plan_in_flight(&self) -> Option<u64> {
        self.steps.in_flight.front().map(|f| f.step_id)
    }

    /// Every plan in flight, oldest first (at most `max_steps_in_flight`).
    #[must_use]
    pub fn plans_in_flight(&self) -> Vec<u64> {
        self.steps.in_flight.iter().map(|f| f.step_id).collect()
    }

    /// Placeholder tokens of a live sequence not yet resolved.
    pub fn num_placeholders(&self, seq_id: u64) -> Result<u32> {
        Ok(self.seq(self.slot(seq_id)?).placeholders)
    }

    /// Appends `count` placeholder tokens: tokens a step in flight is sampling, whose ids are
    /// not known yet. They count in the sequence's length (a step may be scheduled over them)
    /// but no unit holding one is hashed or published; `resolve` fills them in, oldest first.
    pub fn append_placeholders(&mut self, seq_id: u64, count: u32) -> Result<()> {
        self.refuse_in_flight_classic("append")?;
        let slot = self.slot(seq_id)?;
        self.check_length(slot, count as usize)?;
        self.add_placeholders(slot, count);
        Ok(())
    }

    /// `append` of known tokens followed by `count` placeholders, in one call: both are
    /// checked before either changes anything.
    pub fn append_with_placeholders(
        &mut self,
        seq_id: u64,
        tokens: &[u32],
        count: u32,
    ) -> Result<()> {
        self.refuse_in_flight_classic("append")?;
        let slot = self.slot(seq_id)?;
        if tokens.is_empty() {
            self.check_length(slot, count as usize)?;
        } else {
            self.check_append(slot, tokens.len().saturating_add(count as usize))?;
            self.append_slot(slot, tokens)?;
        }
        self.add_placeholders(slot, count);
        Ok(())
    }

    /// `append_placeholders` of one placeholder for each of many sequences (an overlapped
    /// decode step). Every id is checked before anything changes.
    pub fn append_placeholders_batch(&mut self, seq_ids: &[u64]) -> Result<()> {
        self.refuse_in_flight_classic("append")?;
        check_batch_len(seq_ids.len(), "append_placeholders_batch")?;
        let slots = self
            .batch_slots(seq_ids, "append_placeholders_batch", |m, slot| m.check_length(slot, 1))?;
        for slot in slots {
            self.add_placeholders(slot, 1);
        }
        Ok(())
    }

    /// The slots of a batch's ids, each checked by `check`, none repeated.
    pub(crate) fn batch_slots(
        &mut self,
        seq_ids: &[u64],
        call: &str,
        check: impl Fn(&Self, usize) -> Result<()>,
    ) -> Result<Vec<usize>> {
        let mut slots =
            try_vec(seq_ids.len(), "the batch's sequence slots").map_err(CacheError::invalid)?;
        for &id in seq_ids {
            let slot = self.slot(id)?;
            check(self, slot)?;
            slots.push(slot);
        }
        self.table.refuse_repeats(&slots, call)?;
        Ok(slots)
    }

    /// `check_resolve` of one token (the overlapped decode step).
    pub(crate) fn check_resolve_one(&self, slot: usize) -> Result<()> {
        self.check_resolve(slot, 1)
    }

    /// `check_length` of one more token (the overlapped decode step).
    pub(crate) fn check_length_one(&self, slot: usize) -> Result<()> {
        self.check_length(slot, 1)
    }

    /// `resolve_slot` of one token, checked (the overlapped decode step).
    pub(crate) fn resolve_one(&mut self, slot: usize, token: u32) -> Result<()> {
        self.resolve_slot(slot, std::slice::from_ref(&token))
    }

    /// One placeholder appended to a checked sequence (the overlapped decode step).
    pub(crate) fn add_placeholder_one(&mut self, slot: usize) {
        self.add_placeholders(slot, 1);
    }

    /// `resolve_one` of `token` then `add_placeholder_one`, in one visit of the sequence (the
    /// overlapped decode step of a sequence that resolves its oldest placeholder and appends
    /// one for the token the plan being built samples; checked by `check_resolve_one` and
    /// `check_length_one`): its length does not change.
    #[allow(clippy::inline_always)] // (measured: the overlapped decode step's instructions)
    #[inline(always)]
    pub(crate) fn resolve_one_add_one(&mut self, slot: usize, token: u32) -> Result<()> {
        let (unit, stamp) = (self.unit, self.steps.next_step - 1);
        let in_flight = &self.steps.in_flight;
        let seq = self.table.get_mut(slot);
        if seq.tokens.capacity() == seq.tokens.len() && seq.tokens.try_reserve(1).is_err() {
            // (as `resolve_one` then `add_placeholder_one`: the resolve fails, the append stands)
            seq.log_placeholders(stamp, 1, || in_flight.iter().map(|f| f.step_id));
            seq.forget_hit();
            return Err(unresolvable());
        }
        seq.unlog_one_log_one(stamp, || in_flight.iter().map(|f| f.step_id));
        seq.forget_hit();
        let before = seq.hashes.len();
        seq.tokens.push(token);
        self.hasher.extend(&seq.tokens, unit, &seq.extra, &mut seq.hashes);
        if seq.hashes.len() > before
            && (seq.keys_pending_from.is_some() || !seq.pending_checkpoints.is_empty())
        {
            self.publish_known(slot);
        }
        Ok(())
    }

    fn add_placeholders(&mut self, slot: usize, count: u32) {
        if count == 0 {
            return;
        }
        let stamp = self.steps.next_step - 1;
        let in_flight = &self.steps.in_flight;
        let seq = self.table.get_mut(slot);
        seq.log_placeholders(stamp, count, || in_flight.iter().map(|f| f.step_id));
        seq.forget_hit();
    }

    /// Fills the oldest placeholders of a sequence with the tokens sampled for them; the
    /// units they complete are hashed, and every key whose step has committed and whose
    /// prefix is now known is published (with its events). More tokens than placeholders is
    /// an `InvalidRequest`, changing nothing.
    pub fn resolve(&mut self, seq_id: u64, tokens: &[u32]) -> Result<()> {
        let slot = self.slot(seq_id)?;
        self.check_resolve(slot, tokens.len())?;
        self.resolve_slot(slot, tokens)
    }

    /// `resolve` of one token for each of many sequences: one crossing from Python. Every id
    /// is checked before anything changes.
    pub fn resolve_batch(&mut self, seq_ids: &[u64], tokens: &[u32]) -> Result<()> {
        if seq_ids.len() != tokens.len() {
            return Err(CacheError::invalid(format!(
                "resolve_batch got {} sequence ids but {} tokens: give one token per sequence",
                seq_ids.len(),
                tokens.len()
            )));
        }
        check_batch_len(seq_ids.len(), "resolve_batch")?;
        let slots =
            self.batch_slots(seq_ids, "resolve_batch", |m, slot| m.check_resolve(slot, 1))?;
        for (&slot, token) in slots.iter().zip(tokens) {
            self.resolve_slot(slot, std::slice::from_ref(token))?;
        }
        Ok(())
    }

    fn check_resolve(&self, slot: usize, count: usize) -> Result<()> {
        let seq = self.seq(slot);
        if count > seq.placeholders as usize {
            return Err(CacheError::invalid(format!(
                "resolve got {count} token(s) for sequence {}, which has {} placeholder(s): \
                 resolve fills placeholders appended earlier, oldest first",
                seq.id, seq.placeholders
            )));
        }
        Ok(())
    }

    fn resolve_slot(&mut self, slot: usize, tokens: &[u32]) -> Result<()> {
        let unit = self.unit;
        let seq = self.table.get_mut(slot);
        if seq.tokens.capacity() - seq.tokens.len() < tokens.len()
            && seq.tokens.try_reserve(tokens.len()).is_err()
        {
            return Err(unresolvable());
        }
        seq.unlog_resolved(tokens.len() as u32);
        let before = seq.hashes.len();
        seq.forget_hit();
        seq.tokens.extend_from_slice(tokens);
        self.hasher.extend(&seq.tokens, unit, &seq.extra, &mut seq.hashes);
        if seq.hashes.len() > before
            && (seq.keys_pending_from.is_some() || !seq.pending_checkpoints.is_empty())
        {
            self.publish_known(slot);
        }
        Ok(())
    }

    /// Drops the placeholders of `slot` appended since plan `plan` was built (an abort of
    /// that plan: the tokens they stand for will never be sampled).
    pub(crate) fn drop_placeholders_since(&mut self, slot: usize, plan: u64) {
        if !self.table.is_live(slot) {
            return;
        }
        self.seq_mut(slot).drop_placeholders_since(plan);
    }

    /// Full block-table rows of a paged group for the given sequences, padded with the null
    /// block: `(flat row-major table, rows, columns)`. For the first step or debugging; steps
    /// use the plan's incremental updates.
    pub fn block_table(&self, group: u32, seq_ids: &[u64]) -> Result<(Vec<i32>, usize, usize)> {
        let g = group as usize;
        let Some(GroupSlot::Paged(i)) = self.layout.slots.get(g).copied() else {
            return Err(CacheError::invalid(format!(
                "group {group} is not a paged group (there are {} groups)",
                self.layout.len()
            )));
        };
        check_batch_len(seq_ids.len(), "block_table")?;
        let mut rows = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            let seq = self.seq(self.slot(id)?);
            rows.push(seq.paged[i].table.as_slice());
        }
        let cols = rows.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut flat = try_vec(rows.len().saturating_mul(cols), "the block table")
            .map_err(CacheError::invalid)?;
        flat.resize(rows.len() * cols, NULL_BLOCK as i32);
        for (r, row) in rows.iter().enumerate() {
            for (c, &block) in row.iter().enumerate() {
                flat[r * cols + c] = block as i32;
            }
        }
        Ok((flat, rows.len(), cols))
    }
}

/// The wire format of a configuration's events: W, U, digest length and each group's kind.
fn wire_format(config: &CacheConfig) -> crate::events::WireFormat {
    use crate::config::GroupKind;
    use crate::events::WireKind;
    crate::events::WireFormat {
        block_size: config.event_block_size.unwrap_or(config.hash.unit),
        unit: config.hash.unit,
        digest_len: config.hash.algorithm.digest_len(),
        kinds: config
            .groups
            .iter()
            .map(|g| match g.kind {
                GroupKind::FullAttention { .. } => WireKind::FullAttention,
                GroupKind::SlidingWindow { window, .. } => WireKind::SlidingWindow(window),
                GroupKind::State(_) => WireKind::Mamba,
            })
            .collect(),
    }
}

/// A resolve whose tokens could not be allocated.
#[cold]
#[inline(never)]
fn unresolvable() -> CacheError {
    CacheError::invalid("the resolved tokens could not be allocated")
}
