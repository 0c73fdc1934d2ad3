//! Per-sequence state owned by the manager.
//!
//! A sequence's life is one [`Phase`]: *waiting* (holding nothing, with its last lookup) or
//! *started* (holding blocks, with its steps scheduled for the next plan or in flight, oldest
//! first, in a ring that keeps them in place; a first step holds the pins of its hit). While it holds
//! blocks it has, per paged group of the layout, a block table (null entries where a sliding
//! window released blocks) and, per state group, two private running-state buffers: two typed
//! collections that mirror the layout's (`paged[i]` is the layout's `paged[i]`), as a step's work
//! does. Its committed position `num_computed` moves only at `commit`.
//!
//! This file holds data and its small invariants only: it never allocates a block or reads the
//! store (the protocol does both).

// `#[inline(always)]` where the decode step's instruction count (`baseline step N` under
// callgrind) showed the compiler leaving a small hot function out of line.
#![allow(clippy::inline_always)]

use crate::hashing::{Digest, ExtraKeys};
use crate::hit::Hit;
use crate::pool::{BlockId, NULL_BLOCK};
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
    /// Further private running buffers, for steps in flight beyond the first (D > 1 only);
    /// released when the sequence has no step left.
    pub extra: Vec<BlockId>,
    /// Which buffer holds the committed state; `None` before the first commit.
    pub current: Option<usize>,
    /// The published checkpoint the sequence resumes from, pinned until its first commit.
    pub resume: BlockId,
    /// The latest decode-tail snapshot and its position, private until `finish`.
    pub decode_tail: Option<(BlockId, u32)>,
    /// A spare buffer known without a search (D > 1): the committed state until the latest
    /// commit, which no step in flight writes, unless the newest step does (scheduled since,
    /// with none in flight). Set by every commit, cleared by every continuation and when the
    /// extra buffers are given back; the null block: not known (`Sequence::spare_buffer`
    /// searches).
    pub spare: BlockId,
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
    /// The sliding window's released columns the plan reported (`PagedSeq::window_start`
    /// when it was built): what its commit marks as reported.
    pub reported_to: usize,
}

/// What one step does to one state group of a sequence.
#[derive(Clone, Debug, Default)]
pub(crate) struct StateStep {
    /// The running buffer the step writes.
    pub write: BlockId,
    /// The state it reads (-1 = zero state): the committed state, the checkpoint resumed
    /// from, or the buffer the step before it in flight writes.
    pub read: i32,
    /// Interior checkpoints, written by the kernel.
    pub interior: Vec<PlannedCheckpoint>,
    /// The checkpoint at the chunk end, filled by a snapshot copy after the step.
    pub snapshot: Option<PlannedCheckpoint>,
}

/// A scheduled (or in-flight) step of one sequence. `paged[i]` and `state[i]` are the step's
/// part of the layout's `paged[i]` and `state[i]` groups.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepRecord {
    /// The plan it is in flight in (0: scheduled for the next plan, not built yet).
    pub plan: u64,
    pub start: u32,
    pub end: u32,
    /// The sequence's first step: its hit was pinned by this schedule.
    pub first: bool,
    pub paged: Vec<PagedStep>,
    pub state: Vec<StateStep>,
    /// Explicitly requested checkpoint positions (validated on request).
    pub requested: Vec<u32>,
}

impl StepRecord {
    /// A step after a sequence's first, scheduled for the next plan.
    #[inline]
    pub fn later(start: u32, end: u32, paged: Vec<PagedStep>, state: Vec<StateStep>) -> Self {
        Self { plan: 0, start, end, first: false, paged, state, requested: Vec::new() }
    }
}

/// A sequence's steps scheduled or in flight, oldest first, kept in place: a ring over
/// records that stay allocated (at most `max_steps_in_flight` of them), so that a step is
/// written once where it is scheduled and never moved while it waits, runs and ends.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepRing {
    records: Vec<StepRecord>,
    /// Where the oldest step is.
    head: usize,
    /// Where the newest step is (meaningless while `len` is 0).
    tail: usize,
    len: usize,
}

impl StepRing {
    /// The record after record `i`, round the ring.
    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.records.len() {
            0
        } else {
            i + 1
        }
    }

    #[inline(always)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline(always)]
    pub fn oldest(&self) -> Option<&StepRecord> {
        if self.len == 0 {
            return None;
        }
        self.records.get(self.head)
    }

    #[inline(always)]
    pub fn oldest_mut(&mut self) -> Option<&mut StepRecord> {
        if self.len == 0 {
            return None;
        }
        self.records.get_mut(self.head)
    }

    #[inline(always)]
    pub fn newest(&self) -> Option<&StepRecord> {
        if self.len == 0 {
            return None;
        }
        self.records.get(self.tail)
    }

    #[inline(always)]
    pub fn newest_mut(&mut self) -> Option<&mut StepRecord> {
        if self.len == 0 {
            return None;
        }
        self.records.get_mut(self.tail)
    }

    /// Its steps, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &StepRecord> {
        let n = self.records.len();
        (0..self.len).map(move |k| &self.records[(self.head + k) % n])
    }

    /// Where the next `push` writes: the record after the newest (the oldest's when empty),
    /// or `None` when every record holds a step (the push grows the ring).
    #[inline(always)]
    fn free_index(&self) -> Option<usize> {
        if self.len == 0 {
            (!self.records.is_empty()).then_some(self.head)
        } else if self.len < self.records.len() {
            Some(self.next(self.tail))
        } else {
            None
        }
    }

    /// Adds `step` as the newest.
    #[inline(always)]
    pub fn push(&mut self, step: StepRecord) {
        *self.push_in_place() = step;
    }

    /// Adds a newest step and returns its record to be filled in place: the record an ended
    /// step left there (its vectors keep their memory), or a new one when the ring is full.
    #[inline(always)]
    pub fn push_in_place(&mut self) -> &mut StepRecord {
        let at = match self.free_index() {
            Some(at) => at,
            None => self.grow(),
        };
        self.tail = at;
        self.len += 1;
        &mut self.records[at]
    }

    /// Makes room in a full ring: one record more, after the others in order; returns it.
    #[inline(never)]
    fn grow(&mut self) -> usize {
        self.records.rotate_left(self.head);
        self.head = 0;
        self.records.push(StepRecord::default());
        self.records.len() - 1
    }

    /// The per-group vectors of the record the next `push` writes, emptied: the parts a
    /// step's schedule fills before pushing it (empty ones when the ring is full).
    pub fn take_free_parts(&mut self) -> (Vec<PagedStep>, Vec<StateStep>) {
        let Some(at) = self.free_index() else { return (Vec::new(), Vec::new()) };
        let record = &mut self.records[at];
        let (mut paged, mut state) =
            (std::mem::take(&mut record.paged), std::mem::take(&mut record.state));
        paged.clear();
        state.clear();
        (paged, state)
    }

    /// Keeps an ended step's per-group vectors in the record the next `push` writes, so a
    /// later step reuses their memory.
    #[inline]
    pub fn give_free_parts(&mut self, step: &mut StepRecord) {
        if let Some(at) = self.free_index() {
            let record = &mut self.records[at];
            record.paged = std::mem::take(&mut step.paged);
            record.state = std::mem::take(&mut step.state);
        }
    }

    /// Forgets the oldest step (its record stays for a later step to overwrite).
    #[inline(always)]
    pub fn pop_oldest(&mut self) {
        if self.len > 0 {
            self.head = self.next(self.head);
            self.len -= 1;
        }
    }

    /// Forgets the newest step.
    #[inline(always)]
    fn pop_newest(&mut self) {
        if self.len > 0 {
            self.tail = if self.tail == 0 { self.records.len() - 1 } else { self.tail - 1 };
            self.len -= 1;
        }
    }

    /// Takes the oldest step out.
    pub fn take_oldest(&mut self) -> Option<StepRecord> {
        let step = std::mem::take(self.oldest_mut()?);
        self.pop_oldest();
        Some(step)
    }

    /// Takes the newest step out.
    pub fn take_newest(&mut self) -> Option<StepRecord> {
        let step = std::mem::take(self.newest_mut()?);
        self.pop_newest();
        Some(step)
    }

    /// Forgets every step.
    pub fn clear(&mut self) {
        self.len = 0;
        self.head = 0;
    }
}

/// State groups whose continuation is written in place (`schedule_covered_continuation`);
/// a layout with more takes the general path.
pub(crate) const MAX_INLINE_GROUPS: usize = 4;

/// A later step's record written in place: not in a plan, not a first step, no checkpoint
/// requested, and per paged group its table as it is (nothing appended, no copy).
#[inline(always)]
fn fill_later(step: &mut StepRecord, start: u32, end: u32, paged: &[PagedSeq]) {
    (step.plan, step.start, step.end, step.first) = (0, start, end, false);
    step.requested.clear();
    let part =
        |p: &PagedSeq| PagedStep { table_len_before: p.table.len(), cow: None, reported_to: 0 };
    if step.paged.len() == paged.len() {
        // (a record reused: its parts set in place, in a loop the compiler keeps inline)
        for (s, p) in step.paged.iter_mut().zip(paged) {
            *s = part(p);
        }
    } else {
        step.paged.clear();
        step.paged.extend(paged.iter().map(part));
    }
}

/// Part `i` of a later step's state groups (the parts before it set): it writes `write` and
/// reads `read`, with no checkpoint yet.
#[inline(always)]
fn set_state_step(state: &mut Vec<StateStep>, i: usize, write: BlockId, read: i32) {
    if let Some(st) = state.get_mut(i) {
        (st.write, st.read, st.snapshot) = (write, read, None);
        st.interior.clear();
    } else {
        state.push(StateStep { write, read, interior: Vec::new(), snapshot: None });
    }
}

/// The last lookup of a waiting sequence: the store's hit epoch it was computed at
/// (`BlockStore::hit_epoch`), the hit and the full-attention chains it chose (see
/// `hit::compute_hit`).
pub(crate) type LastHit = ((u64, u64), Hit, Vec<Vec<BlockId>>);

/// Where a sequence is in its life.
#[derive(Clone, Debug)]
pub(crate) enum Phase {
    /// Holding no blocks (added, or preempted): its next schedule admits it at its hit. The
    /// last lookup made with no plan in flight is kept while nothing was published, evicted,
    /// pinned out of the LRU, released into it or touched since, for that schedule (with none
    /// in flight either).
    /// (Boxed: a hit is larger than the phase otherwise needs.)
    Waiting { last_hit: Option<Box<LastHit>> },
    /// Holding blocks, with its steps scheduled for the next plan or in flight in
    /// `Sequence::steps` (none between steps); its first step (`first`) holds the pins of
    /// its hit.
    Started,
}

/// What happens to a sequence finished or preempted while steps of it were in flight, once
/// the last of them ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Retiring {
    /// Finished: its id is free already; its blocks are released (publishing its decode
    /// tail) and its slot freed.
    Finish,
    /// Preempted: its blocks are released; it waits, live.
    Preempt,
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
    /// Its steps scheduled or in flight, oldest first (empty while waiting).
    pub ring: StepRing,
    /// Trailing tokens appended as placeholders (not yet sampled): they are counted in the
    /// sequence's length but not in `tokens`, and no unit holding one is hashed.
    pub placeholders: u32,
    /// Per `append_placeholders` call whose placeholders are not all resolved: the id of the
    /// latest plan built when it was made, and how many of its placeholders are left (oldest
    /// first; an abort drops those appended since the aborted plan was built).
    pub placeholder_log: PlaceholderLog,
    /// Committed paged keys not published because a token of their prefix was a placeholder:
    /// every unit boundary in `(from, num_computed]` (published as `resolve` makes them known).
    pub keys_pending_from: Option<u32>,
    /// Committed checkpoints (state group, block, position) waiting for their prefix's tokens.
    pub pending_checkpoints: Vec<(usize, BlockId, u32)>,
    /// Finished or preempted with steps in flight.
    pub retiring: Option<Retiring>,
}

impl Sequence {
    /// Its length: known tokens and placeholders.
    #[inline]
    pub fn num_tokens(&self) -> u32 {
        self.tokens.len() as u32 + self.placeholders
    }

    /// Where its next chunk starts: the end of its newest step, or its committed position.
    #[inline]
    pub fn planned(&self) -> u32 {
        self.step().map_or(self.num_computed, |s| s.end)
    }

    /// Its steps scheduled or in flight.
    #[inline]
    pub fn num_steps(&self) -> usize {
        self.ring.len()
    }

    /// Its steps, oldest first.
    pub fn steps(&self) -> impl Iterator<Item = &StepRecord> {
        self.ring.iter()
    }

    /// Its oldest step (the next to end).
    #[inline]
    pub fn oldest_step(&self) -> Option<&StepRecord> {
        self.ring.oldest()
    }

    /// A private running buffer of state group `i` that neither holds the committed state
    /// nor is written by one of its steps (the one its next step can write), if any: the one
    /// the last commit freed (`StateSeq::spare`) when known, else the first of the pair and
    /// the extras.
    #[inline(never)]
    pub fn spare_buffer(&self, i: usize) -> Option<BlockId> {
        self.spare_buffer_inline(i)
    }

    /// `spare_buffer` inlined (the continuation's schedule: a call there cost 15 to 20
    /// instructions more than the search).
    #[inline(always)]
    pub fn spare_buffer_inline(&self, i: usize) -> Option<BlockId> {
        let state = &self.state[i];
        let newest = self.ring.newest().map_or(NULL_BLOCK, |s| s.state[i].write);
        if state.spare != NULL_BLOCK && state.spare != newest {
            return Some(state.spare);
        }
        // Plain loops over at most D + 1 buffers and D steps.
        let current = state.current.map_or(NULL_BLOCK, |c| state.running[c]);
        // With one step the buffers its steps write are that step's: no walk over the ring.
        let one = self.ring.len() <= 1;
        let spare = |b: BlockId| {
            b != NULL_BLOCK
                && b != current
                && if one { b != newest } else { !self.ring.iter().any(|s| s.state[i].write == b) }
        };
        if spare(state.running[0]) {
            return Some(state.running[0]);
        }
        if spare(state.running[1]) {
            return Some(state.running[1]);
        }
        state.extra.iter().copied().find(|&b| spare(b))
    }

    /// The state a continuation of state group `i` reads: what its newest step writes.
    #[inline(always)]
    pub fn continuation_read(&self, i: usize) -> i32 {
        self.ring.newest().map_or(-1, |s| s.state[i].write as i32)
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

    /// Its newest step: scheduled for the next plan or in flight.
    #[inline]
    pub fn step(&self) -> Option<&StepRecord> {
        self.ring.newest()
    }

    #[inline]
    pub fn step_mut(&mut self) -> Option<&mut StepRecord> {
        self.ring.newest_mut()
    }

    /// Takes the newest step out; without one the sequence is between steps (it holds
    /// blocks) until told otherwise.
    #[inline]
    pub fn take_newest(&mut self) -> Option<StepRecord> {
        self.ring.take_newest()
    }

    /// Takes the oldest step out (the one that ends next).
    #[inline]
    pub fn take_oldest(&mut self) -> Option<StepRecord> {
        self.ring.take_oldest()
    }

    /// Forgets the last lookup (the sequence changed, or was scheduled).
    #[inline]
    pub fn forget_hit(&mut self) {
        if let Phase::Waiting { last_hit } = &mut self.phase {
            *last_hit = None;
        }
    }

    /// Counts `count` placeholders appended while plan `stamp` is the latest built (the
    /// log an abort reads); `in_flight` lists the ids of the plans in flight, oldest first
    /// (read only when the log is full, to merge the entries no abort can tell apart).
    #[inline(always)]
    pub fn log_placeholders<I>(&mut self, stamp: u64, count: u32, in_flight: impl Fn() -> I)
    where
        I: Iterator<Item = u64>,
    {
        self.placeholders += count;
        self.placeholder_log.log(stamp, count, in_flight);
    }

    /// Takes `count` resolved placeholders (at most those it has) off the log, oldest first.
    #[inline(always)]
    pub fn unlog_resolved(&mut self, count: u32) {
        debug_assert!(self.placeholders >= count);
        self.placeholders -= count;
        self.placeholder_log.take_oldest(count);
    }

    /// `unlog_resolved(1)` then `log_placeholders(stamp, 1, in_flight)`: one placeholder
    /// resolved and one appended (the overlapped decode step); its count does not change.
    #[inline(always)]
    pub fn unlog_one_log_one<I>(&mut self, stamp: u64, in_flight: impl Fn() -> I)
    where
        I: Iterator<Item = u64>,
    {
        debug_assert!(self.placeholders >= 1);
        self.placeholder_log.take_one_log_one(stamp, in_flight);
    }

    /// Drops the placeholders appended since plan `plan` was built (an abort of that plan).
    pub fn drop_placeholders_since(&mut self, plan: u64) {
        self.placeholders -= self.placeholder_log.drop_since(plan);
    }

    /// Keeps a finished step's group vectors for the next schedule (in the ring's free
    /// record).
    #[inline]
    pub fn recycle_step(&mut self, step: &mut StepRecord) {
        self.ring.give_free_parts(step);
    }

    /// Schedules the next step of a started sequence with no step (`start` = its committed
    /// position) whose tables cover the chunk, written in place in its ring: nothing to
    /// allocate, its tables as they are, and per state group the committed-state rule
    /// (`StateSeq::write_block`, `StateSeq::read_slot`).
    #[inline(always)]
    pub fn schedule_covered(&mut self, start: u32, end: u32) {
        let (paged, state) = (&self.paged, &self.state);
        let step = self.ring.push_in_place();
        fill_later(step, start, end, paged);
        step.state.truncate(state.len());
        for (i, s) in state.iter().enumerate() {
            set_state_step(&mut step.state, i, s.write_block(), s.read_slot());
        }
    }

    /// `schedule_covered` of a continuation (a step of it is in flight, D > 1): per state
    /// group it reads `reads[i]` (what its newest step writes) and writes `spares[i]`.
    #[inline(always)]
    pub fn schedule_covered_continuation(
        &mut self,
        start: u32,
        end: u32,
        spares: &[BlockId],
        reads: &[i32],
    ) {
        if spares.is_empty() {
            return self.schedule_covered(start, end); // (no state group: the same record)
        }
        let (paged, states) = (&self.paged, &mut self.state);
        let step = self.ring.push_in_place();
        fill_later(step, start, end, paged);
        step.state.truncate(spares.len());
        for (i, ((&write, &read), state)) in spares.iter().zip(reads).zip(states).enumerate() {
            set_state_step(&mut step.state, i, write, read);
            state.spare = NULL_BLOCK; // (taken, or the newest step's: see `StateSeq::spare`)
        }
    }

    /// Schedules `step` for a started sequence: its newest step, after those it has.
    #[inline(always)]
    pub fn schedule_step(&mut self, step: StepRecord) {
        debug_assert!(self.started(), "sequence {} scheduled while not running", self.id);
        self.ring.push(step);
    }

    /// Back to waiting, holding nothing (its blocks were released or given back).
    pub fn stop(&mut self) {
        self.phase = Phase::Waiting { last_hit: None };
        self.ring.clear();
        self.keys_pending_from = None;
        self.num_computed = 0;
        self.prefill_target = 0;
        self.junction = None;
    }
}

/// Entries of the placeholder log (a power of two): more than the `MAX_STEPS_IN_FLIGHT + 1`
/// entries a merged log can need.
const LOG_ENTRIES: usize = 16;
const _: () = assert!(LOG_ENTRIES > crate::limits::MAX_STEPS_IN_FLIGHT as usize + 1);
const _: () = assert!(LOG_ENTRIES.is_power_of_two());

/// A sequence's placeholders not yet resolved, per the plan that was the latest built when
/// they were appended (`stamp`), oldest first, in a fixed ring: an abort of plan `p` drops the
/// entries stamped `p` or later. Two neighbouring entries no abort can tell apart (no plan in
/// flight between their stamps: a future plan's id is above every stamp) are merged when the
/// ring is full, which leaves at most one entry below the oldest plan in flight and one per
/// plan in flight.
#[derive(Clone, Debug)]
pub struct PlaceholderLog {
    stamps: [u64; LOG_ENTRIES],
    counts: [u32; LOG_ENTRIES],
    head: u8,
    len: u8,
}

impl Default for PlaceholderLog {
    fn default() -> Self {
        Self { stamps: [0; LOG_ENTRIES], counts: [0; LOG_ENTRIES], head: 0, len: 0 }
    }
}

impl PlaceholderLog {
    #[inline(always)]
    fn at(&self, k: usize) -> usize {
        (self.head as usize + k) & (LOG_ENTRIES - 1)
    }

    /// Counts `count` placeholders stamped `stamp` (at least every stamp logged before).
    #[inline(always)]
    pub fn log<I>(&mut self, stamp: u64, count: u32, in_flight: impl Fn() -> I)
    where
        I: Iterator<Item = u64>,
    {
        if self.len > 0 {
            let back = self.at(self.len as usize - 1);
            if self.stamps[back] == stamp {
                self.counts[back] += count;
                return;
            }
        }
        if self.len as usize == LOG_ENTRIES {
            self.merge(in_flight());
        }
        let i = self.at(self.len as usize);
        self.stamps[i] = stamp;
        self.counts[i] = count;
        self.len += 1;
    }

    /// Merges every run of neighbouring entries with no plan of `in_flight` (ids ascending)
    /// in `(earlier stamp, later stamp]`, keeping the later stamp.
    #[cold]
    #[inline(never)]
    fn merge(&mut self, in_flight: impl Iterator<Item = u64>) {
        let ids: Vec<u64> = in_flight.collect();
        let mut out = 0usize;
        for k in 0..self.len as usize {
            let (stamp, count) = (self.stamps[self.at(k)], self.counts[self.at(k)]);
            if out > 0 {
                let prev = self.at(out - 1);
                if !ids.iter().any(|&p| self.stamps[prev] < p && p <= stamp) {
                    self.stamps[prev] = stamp;
                    self.counts[prev] += count;
                    continue;
                }
            }
            let o = self.at(out);
            self.stamps[o] = stamp;
            self.counts[o] = count;
            out += 1;
        }
        self.len = out as u8;
    }

    /// Takes `count` placeholders off the oldest entries (at most those logged).
    #[inline(always)]
    pub fn take_oldest(&mut self, count: u32) {
        let mut left = count;
        while left > 0 && self.len > 0 {
            let f = self.head as usize;
            let used = left.min(self.counts[f]);
            self.counts[f] -= used;
            left -= used;
            if self.counts[f] == 0 {
                self.head = ((f + 1) & (LOG_ENTRIES - 1)) as u8;
                self.len -= 1;
            }
        }
    }

    /// `take_oldest(1)` then `log(stamp, 1, in_flight)`. When the oldest entry holds one
    /// placeholder and the newest is stamped below `stamp` (the overlapped decode step's
    /// case), the oldest leaves and a new entry joins behind the newest: no merge can be
    /// needed, as the ring's length does not change.
    #[inline(always)]
    pub fn take_one_log_one<I>(&mut self, stamp: u64, in_flight: impl Fn() -> I)
    where
        I: Iterator<Item = u64>,
    {
        let (head, len) = (self.head as usize, self.len as usize);
        if len > 0 && self.counts[head] == 1 {
            let back = (head + len - 1) & (LOG_ENTRIES - 1);
            if self.stamps[back] != stamp {
                let at = (head + len) & (LOG_ENTRIES - 1);
                self.stamps[at] = stamp;
                self.counts[at] = 1;
                self.head = ((head + 1) & (LOG_ENTRIES - 1)) as u8;
                return;
            }
        }
        self.take_oldest(1);
        self.log(stamp, 1, in_flight);
    }

    /// Drops the entries stamped `plan` or later; returns how many placeholders they held.
    pub fn drop_since(&mut self, plan: u64) -> u32 {
        let mut dropped = 0;
        while self.len > 0 {
            let back = self.at(self.len as usize - 1);
            if self.stamps[back] < plan {
                break;
            }
            dropped += self.counts[back];
            self.len -= 1;
        }
        dropped
    }
}

#[cfg(test)]
mod placeholder_log_tests {
    use super::PlaceholderLog;
    use crate::limits::MAX_STEPS_IN_FLIGHT;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    // The rule, stated on its own: every append is remembered with the id of the plan built
    // last when it was made; a resolve consumes the oldest appends first; an abort of plan p
    // removes what is left of the appends made while p or a later plan was the latest built.
    // The plain list below never merges; the ring must agree with it on every count.
    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn ring_agrees_with_plain_list(ops in proptest::collection::vec((0u8..20, 1u32..4), 1..400)) {
            let mut log = PlaceholderLog::default();
            let mut plain: Vec<(u64, u32)> = Vec::new();
            let mut in_flight: VecDeque<u64> = VecDeque::new();
            let mut next_plan = 1u64;
            for (pick, n) in ops {
                // (weighted: builds and appends often, so the ring fills and merges)
                let op = [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 4, 5, 6, 6][pick as usize];
                match op {
                    0 if in_flight.len() < MAX_STEPS_IN_FLIGHT as usize => {
                        in_flight.push_back(next_plan);
                        next_plan += 1;
                    }
                    1 => { in_flight.pop_front(); }
                    2 => { in_flight.pop_back(); }
                    3 => {
                        let stamp = next_plan - 1;
                        log.log(stamp, n, || in_flight.iter().copied());
                        plain.push((stamp, n));
                    }
                    4 => {
                        let total: u32 = plain.iter().map(|e| e.1).sum();
                        let mut take = n.min(total);
                        log.take_oldest(take);
                        for e in &mut plain {
                            let used = take.min(e.1);
                            e.1 -= used;
                            take -= used;
                        }
                        plain.retain(|e| e.1 > 0);
                    }
                    6 => {
                        // One resolved and one appended (`take_one_log_one`), when there is
                        // one to resolve.
                        if plain.is_empty() {
                            continue;
                        }
                        let stamp = next_plan - 1;
                        log.take_one_log_one(stamp, || in_flight.iter().copied());
                        plain[0].1 -= 1;
                        plain.retain(|e| e.1 > 0);
                        plain.push((stamp, 1));
                    }
                    _ => {
                        if let Some(&oldest) = in_flight.front() {
                            let want: u32 =
                                plain.iter().filter(|e| e.0 >= oldest).map(|e| e.1).sum();
                            prop_assert_eq!(log.drop_since(oldest), want);
                            plain.retain(|e| e.0 < oldest);
                            in_flight.clear();
                        }
                    }
                }
                let total: u32 = plain.iter().map(|e| e.1).sum();
                let held: u32 = (0..log.len as usize).map(|k| log.counts[log.at(k)]).sum();
                prop_assert_eq!(held, total);
                prop_assert!(log.len as usize <= super::LOG_ENTRIES);
            }
        }
    }
}
