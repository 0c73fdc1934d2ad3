//! Per-sequence state owned by the manager, and the bounded cache of finished sequences that
//! `add(.., extends)` reuses hashes from.
//!
//! A sequence's life is one [`Phase`]: *waiting* (holding nothing, with its last lookup),
//! *scheduled* (holding blocks, with the step scheduled for the next plan or in flight; a first
//! step holds the pins of its hit) or *running* (holding blocks between steps). While it holds
//! blocks it has, per paged group of the layout, a block table (null entries where a sliding
//! window released blocks) and, per state group, two private running-state buffers: two typed
//! collections that mirror the layout's (`paged[i]` is the layout's `paged[i]`), as a step's work
//! does. Its committed position `num_computed` moves only at `commit`.
//!
//! This file holds data and its small invariants only: it never allocates a block or reads the
//! store (the protocol does both).

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::hashing::{Digest, ExtraKeys};
use crate::hit::Hit;
use crate::pool::BlockId;
use crate::store::Content;

/// A paged group's view of one sequence.
#[derive(Clone, Debug, Default)]
pub(crate) struct PagedSeq {
    /// Block per column; `NULL_BLOCK` for columns a sliding window released (or never held).
    pub table: Vec<BlockId>,
    /// Columns below this were released by the sliding window (or were outside the hit).
    pub window_start: usize,
    /// Columns below this have been reported as replaced in a plan.
    pub window_reported: usize,
}

/// A state group's view of one sequence.
#[derive(Clone, Debug, Default)]
pub(crate) struct StateSeq {
    /// The two private running buffers (0 before the first schedule).
    pub running: [BlockId; 2],
    /// Which buffer holds the committed state; `None` before the first commit.
    pub current: Option<usize>,
    /// The published checkpoint the sequence resumes from, pinned until its first commit.
    pub resume: BlockId,
    /// The latest decode-tail snapshot and its position, private until `finish`.
    pub decode_tail: Option<(BlockId, u32)>,
}

impl StateSeq {
    /// The buffer the next step writes.
    pub fn write_block(&self) -> BlockId {
        match self.current {
            Some(c) => self.running[1 - c],
            None => self.running[0],
        }
    }

    /// The slot the next step reads (-1 = zero state).
    pub fn read_slot(&self) -> i32 {
        match self.current {
            Some(c) => self.running[c] as i32,
            None if self.resume != 0 => self.resume as i32,
            None => -1,
        }
    }
}

/// A checkpoint planned for a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlannedCheckpoint {
    pub position: u32,
    pub block: BlockId,
    /// Decode-tail snapshot (kept private until finish) rather than a prefill checkpoint.
    pub decode_tail: bool,
}

/// What one step does to one paged group of a sequence (enough to commit or undo it).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PagedStep {
    /// Table length before the step: columns from here on were added by it.
    pub table_len_before: usize,
    /// Copy-on-write: (source, destination, tokens copied).
    pub cow: Option<(BlockId, BlockId, u32)>,
}

/// What one step does to one state group of a sequence.
#[derive(Clone, Debug, Default)]
pub(crate) struct StateStep {
    /// Interior checkpoints, written by the kernel.
    pub interior: Vec<PlannedCheckpoint>,
    /// The checkpoint at the chunk end, filled by a snapshot copy after the step.
    pub snapshot: Option<PlannedCheckpoint>,
}

/// A scheduled (or in-flight) step of one sequence. `paged[i]` and `state[i]` are the step's
/// part of the layout's `paged[i]` and `state[i]` groups.
#[derive(Clone, Debug)]
pub(crate) struct StepRecord {
    pub start: u32,
    pub end: u32,
    /// The sequence's first step: its hit was pinned by this schedule.
    pub first: bool,
    pub paged: Vec<PagedStep>,
    pub state: Vec<StateStep>,
    /// Explicitly requested checkpoint positions (validated on request).
    pub requested: Vec<u32>,
}

/// The last lookup of a waiting sequence: the index generation it was computed at, the hit
/// and the full-attention chains it chose (see `hit::compute_hit`).
pub(crate) type LastHit = (u64, Hit, Vec<Vec<BlockId>>);

/// Where a sequence is in its life.
#[derive(Clone, Debug)]
pub(crate) enum Phase {
    /// Holding no blocks (added, or preempted): its next schedule admits it at its hit. The
    /// last lookup is kept while nothing was published or evicted since, for that schedule.
    Waiting { last_hit: Option<LastHit> },
    /// Holding blocks, with a step scheduled for the next plan or in flight; a first step
    /// (`step.first`) holds the pins of its hit.
    Scheduled(StepRecord),
    /// Holding blocks, between steps.
    Running,
}

#[derive(Clone, Debug)]
pub(crate) struct Sequence {
    pub id: u64,
    /// Unique for the manager's lifetime, unlike ids, which may be added again.
    pub serial: u64,
    pub tokens: Vec<u32>,
    pub extra: ExtraKeys,
    /// `hashes[i]` fingerprints `tokens[..(i + 1) * U]`.
    pub hashes: Vec<Digest>,
    pub num_computed: u32,
    pub phase: Phase,
    /// Tokens known at the first schedule (the tail checkpoint's basis).
    pub prefill_target: u32,
    /// Junction position of the first schedule's lookup.
    pub junction: Option<u32>,
    /// Per paged group of the layout, its blocks.
    pub paged: Vec<PagedSeq>,
    /// Per state group of the layout, its blocks.
    pub state: Vec<StateSeq>,
    /// Per group, the full-attention blocks the sequence it extends held for the shared
    /// prefix: a hint that lets the first lookup confirm a block through the pool instead of
    /// probing the index (always verified; dropped at the first schedule).
    pub hint_chains: Vec<Vec<BlockId>>,
    /// The per-group step vectors of the last committed or undone step, emptied, for the next
    /// schedule to fill (a decode step then allocates nothing for them).
    pub spare_paged: Vec<PagedStep>,
    pub spare_state: Vec<StateStep>,
}

impl Sequence {
    pub fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32
    }

    /// What its keys are computed from.
    #[inline]
    pub fn content(&self) -> Content<'_> {
        Content { tokens: &self.tokens, extra: &self.extra, hashes: &self.hashes }
    }

    /// Whether it holds blocks (its first schedule pinned its hit).
    #[inline]
    pub fn started(&self) -> bool {
        !matches!(self.phase, Phase::Waiting { .. })
    }

    /// The step scheduled for the next plan or in flight.
    #[inline]
    pub fn step(&self) -> Option<&StepRecord> {
        match &self.phase {
            Phase::Scheduled(step) => Some(step),
            _ => None,
        }
    }

    #[inline]
    pub fn step_mut(&mut self) -> Option<&mut StepRecord> {
        match &mut self.phase {
            Phase::Scheduled(step) => Some(step),
            _ => None,
        }
    }

    /// Takes the step out; the sequence is running (it holds blocks) until told otherwise.
    #[inline]
    pub fn take_step(&mut self) -> Option<StepRecord> {
        match std::mem::replace(&mut self.phase, Phase::Running) {
            Phase::Scheduled(step) => Some(step),
            other => {
                self.phase = other;
                None
            }
        }
    }

    /// Forgets the last lookup (the sequence changed, or was scheduled).
    #[inline]
    pub fn forget_hit(&mut self) {
        if let Phase::Waiting { last_hit } = &mut self.phase {
            *last_hit = None;
        }
    }

    /// Keeps a finished step's group vectors, emptied, for the next schedule.
    #[inline]
    pub fn recycle_step(&mut self, step: &mut StepRecord) {
        let (mut paged, mut state) =
            (std::mem::take(&mut step.paged), std::mem::take(&mut step.state));
        paged.clear();
        state.clear();
        self.spare_paged = paged;
        self.spare_state = state;
    }

    /// Schedules `step` for a running sequence (the phase it must be in).
    #[inline]
    pub fn schedule_step(&mut self, step: StepRecord) {
        let Phase::Running = std::mem::replace(&mut self.phase, Phase::Scheduled(step)) else {
            unreachable!("sequence {} scheduled while not running", self.id)
        };
    }

    /// Back to waiting, holding nothing (its blocks were released or given back).
    pub fn stop(&mut self) {
        self.phase = Phase::Waiting { last_hit: None };
        self.num_computed = 0;
        self.prefill_target = 0;
        self.junction = None;
    }
}

/// Tokens and hashes of a finished sequence, for `extends`.
#[derive(Clone, Debug)]
pub(crate) struct FinishedSequence {
    /// The id it finished under.
    pub id: u64,
    /// The sequence's serial (ids may be reused; serials never are).
    pub serial: u64,
    /// Per group, the full-attention block table it held (a hint for the next turn's lookup;
    /// empty for other groups).
    pub chains: Vec<Vec<BlockId>>,
    pub tokens: Vec<u32>,
    pub extra: ExtraKeys,
    pub hashes: Vec<Digest>,
}

impl FinishedSequence {
    fn bytes(&self) -> usize {
        self.tokens.len() * 4
            + self.hashes.len() * std::mem::size_of::<Digest>()
            + self.chains.iter().map(|c| c.len() * 4).sum::<usize>()
            + 64
    }
}

/// Finished sequences, oldest dropped first once over the byte budget. Entries are keyed by
/// serial: an id may be added again while continuation records still need the sequence that
/// last finished under it.
///
/// The budget bounds everything held here: an id's entry in `ids` leaves with the last thing
/// kept under its serial (the finished sequence, or the record of where its buffers went), and
/// `order` holds one element per thing kept plus at most one stale element per record.
#[derive(Clone, Debug, Default)]
pub(crate) struct FinishedCache {
    /// serial -> finished sequence.
    entries: FxHashMap<u64, FinishedSequence>,
    /// id -> serial of the last sequence that finished under it (until the id is added again).
    ids: FxHashMap<u64, u64>,
    /// `(serial, id)` of finished sequences and records, oldest first; what is gone is skipped.
    order: VecDeque<(u64, u64)>,
    bytes: usize,
    capacity: usize,
    /// serial -> where a finished sequence's buffers went when its continuation took them.
    continued: FxHashMap<u64, Continued>,
}

/// Where the history of a finished sequence went when another sequence extended it: its
/// first `tokens` tokens and `units` hashes are the continuing sequence's, the rest (the
/// outputs the next turn did not send back, typically) is kept here.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Continued {
    pub by: u64,
    /// Serial of the continuing sequence (its id may later name another sequence).
    pub by_serial: u64,
    pub tokens: usize,
    pub units: usize,
    pub tail_tokens: Vec<u32>,
    pub tail_hashes: Vec<Digest>,
    pub extra: ExtraKeys,
}

impl Continued {
    fn bytes(&self) -> usize {
        self.tail_tokens.len() * 4 + self.tail_hashes.len() * std::mem::size_of::<Digest>() + 128
    }
}

impl FinishedCache {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, ..Self::default() }
    }

    pub fn insert(&mut self, id: u64, entry: FinishedSequence) {
        let size = entry.bytes();
        if size > self.capacity {
            self.ids.remove(&id);
            return;
        }
        self.ids.insert(id, entry.serial);
        self.bytes += size;
        self.order.push_back((entry.serial, id));
        self.entries.insert(entry.serial, entry);
        self.shrink();
    }

    /// Drops the oldest finished sequences and continuation records until within the budget.
    fn shrink(&mut self) {
        while self.bytes > self.capacity {
            let Some((old, id)) = self.order.pop_front() else {
                break;
            };
            if let Some(e) = self.entries.remove(&old) {
                self.bytes -= e.bytes();
            } else if let Some(r) = self.continued.remove(&old) {
                self.bytes -= r.bytes();
            }
            // Nothing is kept under this serial any more: `extends` of its id finds nothing.
            let gone = !self.entries.contains_key(&old) && !self.continued.contains_key(&old);
            if gone && self.ids.get(&id) == Some(&old) {
                self.ids.remove(&id);
            }
        }
    }

    /// The serial of the last sequence finished under `id`, if the id is not live again.
    pub fn serial_of(&self, id: u64) -> Option<u64> {
        self.ids.get(&id).copied()
    }

    pub fn get_serial(&self, serial: u64) -> Option<&FinishedSequence> {
        self.entries.get(&serial)
    }

    /// Grows the buffers of finished sequence `serial` to hold `tokens` tokens and `units`
    /// digests, fallibly (their lengths, which the budget counts, do not change). `Err` carries
    /// the bytes that could not be allocated; nothing changes then.
    pub fn reserve(&mut self, serial: u64, tokens: usize, units: usize) -> Result<(), usize> {
        let Some(entry) = self.entries.get_mut(&serial) else {
            return Ok(());
        };
        let tokens = tokens.saturating_sub(entry.tokens.len());
        let units = units.saturating_sub(entry.hashes.len());
        let bytes = tokens.saturating_mul(4) + units.saturating_mul(std::mem::size_of::<Digest>());
        entry.tokens.try_reserve(tokens).map_err(|_| bytes)?;
        entry.hashes.try_reserve(units).map_err(|_| bytes)?;
        Ok(())
    }

    /// Takes a finished sequence's buffers out (its continuation owns them now).
    pub fn take_serial(&mut self, serial: u64) -> Option<FinishedSequence> {
        let entry = self.entries.remove(&serial)?;
        self.bytes -= entry.bytes();
        Some(entry)
    }

    /// The id is live again: `extends` of it means the live sequence from now on.
    pub fn unmap(&mut self, id: u64) {
        self.ids.remove(&id);
    }

    /// Records where the buffers of finished sequence `serial` went. The record's tail counts
    /// against the same byte budget as finished sequences.
    pub fn set_continued(&mut self, serial: u64, id: u64, continued: Continued) {
        self.bytes += continued.bytes();
        if let Some(old) = self.continued.insert(serial, continued) {
            self.bytes -= old.bytes();
        }
        self.order.push_back((serial, id));
        self.shrink();
    }

    /// Ids mapped to a finished serial (for the bound test).
    #[cfg(test)]
    fn num_ids(&self) -> usize {
        self.ids.len()
    }

    pub fn continued(&self, serial: u64) -> Option<&Continued> {
        self.continued.get(&serial)
    }

    /// Finished sequences kept (their buffers, not continuation records).
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Length of the common prefix of two token lists, compared 64 tokens at a time (a memcmp)
/// before the last partial run.
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    const RUN: usize = 64;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + RUN <= n && a[i..i + RUN] == b[i..i + RUN] {
        i += RUN;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// What two sequences share: `(common tokens, shared units)`. The units are the leading units
/// whose hashes can be reused: the common token prefix, cut before the first unit that any
/// differing multimodal input touches, at most `other_units`. With a different salt or adapter
/// nothing is shared (and the common prefix is not computed: `(0, 0)`).
///
/// The inputs that differ are those from the first list index where the two lists disagree on:
/// every input there or after it, in either list, may enter a unit's digest in another place,
/// so the cut is at the earliest start among all of them. For lists in order of start (which
/// `add` requires) that is the earlier start of the two entries at that index.
pub(crate) fn shared_units(
    unit: u32,
    tokens: &[u32],
    extra: &ExtraKeys,
    other_tokens: &[u32],
    other_extra: &ExtraKeys,
    other_units: usize,
) -> (usize, usize) {
    if extra.cache_salt != other_extra.cache_salt || extra.lora_id != other_extra.lora_id {
        return (0, 0);
    }
    let common = common_prefix(tokens, other_tokens);
    let (a, b) = (&extra.multimodal, &other_extra.multimodal);
    let same = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let differing_start =
        a[same..].iter().chain(&b[same..]).map(|m| m.start as usize).min().unwrap_or(usize::MAX);
    let limit = common.min(differing_start);
    (common, (limit / unit as usize).min(other_units))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::MultimodalInput;

    fn finished(serial: u64, tokens: usize) -> FinishedSequence {
        FinishedSequence {
            id: serial,
            serial,
            chains: Vec::new(),
            tokens: vec![7; tokens],
            extra: ExtraKeys::default(),
            hashes: vec![Digest::default(); tokens / 4],
        }
    }

    fn record(by_serial: u64, tail: usize) -> Continued {
        Continued {
            by: by_serial,
            by_serial,
            tokens: 0,
            units: 0,
            tail_tokens: vec![1; tail],
            tail_hashes: Vec::new(),
            extra: ExtraKeys::default(),
        }
    }

    fn image(start: u32, end: u32, hash: &[u8]) -> MultimodalInput {
        MultimodalInput { start, end, hash: hash.to_vec() }
    }

    fn with(multimodal: Vec<MultimodalInput>) -> ExtraKeys {
        ExtraKeys { multimodal, ..ExtraKeys::default() }
    }

    #[test]
    fn digest_reuse_stops_at_the_earliest_differing_input_whatever_its_list_index() {
        let tokens: Vec<u32> = (0..20).collect();
        let none = ExtraKeys::default();
        // The image at [4, 8) differs, listed first or after a later input: reuse stops at
        // unit 2 (U = 2) either way.
        for other in [
            with(vec![image(4, 8, b"X"), image(9, 10, b"img1")]),
            with(vec![image(9, 10, b"img1"), image(4, 8, b"X")]),
        ] {
            assert_eq!(shared_units(2, &tokens, &none, &tokens, &other, 10), (20, 2));
            assert_eq!(shared_units(2, &tokens, &other, &tokens, &none, 10), (20, 2));
        }
        // Equal leading inputs are shared; the first that differs (another hash) cuts.
        let a = with(vec![image(2, 4, b"p"), image(10, 12, b"q")]);
        let b = with(vec![image(2, 4, b"p"), image(10, 12, b"r")]);
        assert_eq!(shared_units(2, &tokens, &a, &tokens, &b, 10), (20, 5));
        // An input only one side has cuts at its start; none differing shares everything.
        let c = with(vec![image(2, 4, b"p"), image(10, 12, b"q"), image(15, 16, b"s")]);
        assert_eq!(shared_units(2, &tokens, &a, &tokens, &c, 10), (20, 7));
        assert_eq!(shared_units(2, &tokens, &a, &tokens, &a, 10), (20, 10));
        // Different salts share nothing.
        let salted = ExtraKeys { cache_salt: Some(b"t".to_vec()), ..ExtraKeys::default() };
        assert_eq!(shared_units(2, &tokens, &salted, &tokens, &none, 10), (0, 0));
    }

    #[test]
    fn the_byte_budget_bounds_the_ids_of_finished_sequences_too() {
        let entry_bytes = finished(0, 100).bytes();
        let mut cache = FinishedCache::new(4 * entry_bytes);
        for serial in 0..100_000 {
            cache.insert(serial, finished(serial, 100));
            assert!(cache.num_ids() <= 4 && cache.order.len() <= 4, "at {serial}");
        }
        assert_eq!(cache.serial_of(99_999), Some(99_999));
        assert_eq!(cache.serial_of(0), None);
        // A record keeps its id mapped until the record itself leaves.
        let taken = cache.take_serial(99_999).expect("kept");
        cache.set_continued(taken.serial, taken.id, record(7, 10));
        assert_eq!(cache.serial_of(99_999), Some(99_999));
        for serial in 100_000..100_010 {
            cache.insert(serial, finished(serial, 100));
        }
        assert_eq!(cache.serial_of(99_999), None);
        assert!(cache.num_ids() <= 4 && cache.order.len() <= 5);
    }

    #[test]
    fn continuation_records_share_the_byte_budget_oldest_first() {
        let entry_bytes = finished(0, 100).bytes();
        let mut cache = FinishedCache::new(3 * entry_bytes);
        for serial in 0..3 {
            cache.insert(serial, finished(serial, 100));
        }
        assert_eq!(cache.len(), 3);
        // Serial 0 is continued: its buffers leave, a record of its 60-token tail stays.
        assert!(cache.take_serial(0).is_some());
        cache.set_continued(0, 0, record(9, 60));
        assert!(cache.bytes <= cache.capacity);
        assert!(cache.continued(0).is_some());
        // A fourth sequence pushes the oldest things out, the record first (it is serial 0's).
        cache.insert(3, finished(3, 100));
        assert!(cache.bytes <= cache.capacity);
        assert!(cache.continued(0).is_none());
        assert!(cache.get_serial(3).is_some());
        // A record larger than what is left evicts finished sequences too, never overshooting.
        cache.set_continued(1, 1, record(9, 150));
        assert!(cache.bytes <= cache.capacity, "{} > {}", cache.bytes, cache.capacity);
        let accounted: usize = cache.entries.values().map(FinishedSequence::bytes).sum::<usize>()
            + cache.continued.values().map(Continued::bytes).sum::<usize>();
        assert_eq!(accounted, cache.bytes);
    }
}
