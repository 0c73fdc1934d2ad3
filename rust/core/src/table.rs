//! The sequence table: the live sequences (by id and by slot), the serials that tell apart
//! sequences added again under one id, the bounded cache of finished sequences that
//! `add(.., extends)` reuses hashes from, and the live prefixes that stand in for `extends`.
//!
//! It finds sequences and their content; it never touches a block, the store or a step (the
//! protocol releases a sequence's blocks before `finish` hands it here).

use std::borrow::Cow;
use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::chains::Chain;
use crate::error::{CacheError, Result};
use crate::hashing::{Digest, ExtraKeys, Hasher};
use crate::limits::human_bytes;
use crate::pool::BlockId;
use crate::sequence::Sequence;

/// What `extends` resolves to: tokens, extra keys and unit hashes.
pub(crate) type ExtendsSource<'a> = (Cow<'a, [u32]>, Cow<'a, ExtraKeys>, Cow<'a, [Digest]>);

#[derive(Debug)]
pub(crate) struct SequenceTable {
    seqs: Vec<Option<Sequence>>,
    free_slots: Vec<usize>,
    pub by_id: FxHashMap<u64, usize>,
    /// With `reuse_live_prefixes`: first-unit digest -> the live sequence added last with it
    /// (the entry goes when that sequence finishes).
    pub live_prefixes: FxHashMap<Digest, u64>,
    pub finished: FinishedCache,
    /// Serial of the next sequence added.
    pub next_serial: u64,
    /// Per slot, the stamp of the last batch call that named it (see `refuse_repeats`).
    batch_marks: Vec<u64>,
    batch_stamp: u64,
}

impl SequenceTable {
    pub fn new(finished_cache_bytes: usize) -> Self {
        Self {
            seqs: Vec::new(),
            free_slots: Vec::new(),
            by_id: FxHashMap::default(),
            live_prefixes: FxHashMap::default(),
            finished: FinishedCache::new(finished_cache_bytes),
            next_serial: 0,
            batch_marks: Vec::new(),
            batch_stamp: 0,
        }
    }

    #[inline]
    pub fn slot(&self, seq_id: u64) -> Result<usize> {
        // A `match`, not `ok_or(..)`: the error is built only on the miss (an eagerly built
        // one is dropped on every hit, through `CacheError`'s drop glue).
        match self.by_id.get(&seq_id) {
            Some(&slot) => Ok(slot),
            None => Err(CacheError::UnknownSequence { seq_id }),
        }
    }

    #[inline]
    pub fn get(&self, slot: usize) -> &Sequence {
        // Slots come from `by_id` or the step lists, which only name live sequences.
        self.seqs[slot].as_ref().unwrap_or_else(|| unreachable!("slot {slot} is not live"))
    }

    #[inline]
    pub fn get_mut(&mut self, slot: usize) -> &mut Sequence {
        self.seqs[slot].as_mut().unwrap_or_else(|| unreachable!("slot {slot} is not live"))
    }

    /// Whether `slot` holds a sequence (live, or finished with steps still in flight).
    #[inline]
    pub fn is_live(&self, slot: usize) -> bool {
        self.seqs.get(slot).is_some_and(Option::is_some)
    }

    /// Takes a live sequence out of its slot (to work on it beside the rest of the manager);
    /// `put` it back.
    #[inline]
    pub fn take(&mut self, slot: usize) -> Option<Sequence> {
        self.seqs[slot].take()
    }

    #[inline]
    pub fn put(&mut self, slot: usize, seq: Sequence) {
        self.seqs[slot] = Some(seq);
    }

    /// The live sequences, with their slots.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Sequence)> {
        self.seqs.iter().enumerate().filter_map(|(slot, s)| Some((slot, s.as_ref()?)))
    }

    /// Registers a new live sequence; returns its slot.
    pub fn insert(&mut self, seq: Sequence) -> usize {
        let id = seq.id;
        let slot = if let Some(slot) = self.free_slots.pop() {
            self.seqs[slot] = Some(seq);
            slot
        } else {
            self.seqs.push(Some(seq));
            self.seqs.len() - 1
        };
        self.by_id.insert(id, slot);
        slot
    }

    /// Retires the live sequence in `slot` (which holds no block any more) into the finished
    /// cache, with `chains`, the full-attention tables it held (a hint for its next turn).
    pub fn finish(&mut self, slot: usize, chains: Vec<Vec<BlockId>>) {
        let Some(seq) = self.seqs[slot].take() else {
            return;
        };
        let seq_id = seq.id;
        self.by_id.remove(&seq_id);
        if let Some(h) = seq.hashes.first() {
            if self.live_prefixes.get(h) == Some(&seq_id) {
                self.live_prefixes.remove(h);
            }
        }
        self.finished.insert(
            seq_id,
            FinishedSequence {
                id: seq_id,
                serial: seq.serial,
                chains,
                tokens: seq.tokens,
                extra: seq.extra,
                hashes: seq.hashes,
            },
        );
        self.free_slots.push(slot);
    }

    /// `finish` of the live sequence in `slot` while steps of it are in flight: its id is
    /// free and a copy of its tokens and hashes is in the finished cache now, but it keeps its
    /// slot (and its blocks) until `drop_retired`, when the last of its steps has ended.
    pub fn retire(&mut self, slot: usize, chains: Vec<Vec<BlockId>>) {
        let seq = self.get(slot);
        let seq_id = seq.id;
        let record = FinishedSequence {
            id: seq_id,
            serial: seq.serial,
            chains,
            tokens: seq.tokens.clone(),
            extra: seq.extra.clone(),
            hashes: seq.hashes.clone(),
        };
        if self.by_id.get(&seq_id) == Some(&slot) {
            self.by_id.remove(&seq_id);
        }
        if let Some(h) = record.hashes.first() {
            if self.live_prefixes.get(h) == Some(&seq_id) {
                self.live_prefixes.remove(h);
            }
        }
        self.finished.insert(seq_id, record);
    }

    /// Frees the slot of a sequence `retire`d earlier (it holds no block any more).
    pub fn drop_retired(&mut self, slot: usize) {
        if self.seqs[slot].take().is_some() {
            self.free_slots.push(slot);
        }
    }

    /// `StepError` naming a sequence that appears twice in one `call`: each slot is stamped
    /// with the call's number, in one pass, without sorting or copying the batch.
    pub fn refuse_repeats(&mut self, slots: &[usize], call: &str) -> Result<()> {
        self.batch_stamp += 1;
        let stamp = self.batch_stamp;
        if self.batch_marks.len() < self.seqs.len() {
            self.batch_marks.resize(self.seqs.len(), 0);
        }
        for &slot in slots {
            let mark = &mut self.batch_marks[slot];
            if *mark == stamp {
                let id = self.get(slot).id;
                return Err(CacheError::step(format!(
                    "sequence {id} appears twice in one {call}: give each sequence once (several \
                     tokens of one sequence go in one append call)"
                )));
            }
            *mark = stamp;
        }
        Ok(())
    }

    /// Takes the buffers of finished sequence `serial` over for its continuation `seq_id`
    /// (serial `by_serial`), which shares its first `common` tokens (measured against exactly
    /// these tokens) and `units` digests: returns it with its tokens cut to `common` (with room
    /// for `capacity`) and its digests cut to `units`. What the continuation does not share,
    /// and the extra keys, stay in a record. The room is reserved before anything changes: on
    /// failure the finished sequence is kept as it was.
    #[allow(clippy::too_many_arguments)]
    pub fn continue_finished(
        &mut self,
        unit: u32,
        serial: u64,
        seq_id: u64,
        by_serial: u64,
        common: usize,
        units: usize,
        capacity: usize,
    ) -> Result<Option<FinishedSequence>> {
        let unit = unit as usize;
        if let Err(bytes) = self.finished.reserve(serial, capacity, capacity / unit) {
            return Err(CacheError::invalid(format!(
                "the continuation of a finished sequence needs {} more of memory, which could not \
                 be allocated",
                human_bytes(bytes)
            )));
        }
        let Some(previous) = self.finished.take_serial(serial) else {
            return Ok(None);
        };
        let (mut owned, mut hashes) = (previous.tokens, previous.hashes);
        let record = Continued {
            by: seq_id,
            by_serial,
            tokens: common,
            units,
            tail_tokens: owned.split_off(common),
            tail_hashes: hashes.split_off(units),
            extra: previous.extra,
        };
        self.finished.set_continued(previous.serial, previous.id, record);
        Ok(Some(FinishedSequence {
            tokens: owned,
            hashes,
            extra: ExtraKeys::default(),
            ..previous
        }))
    }

    /// The tokens, extra keys and hashes `extends = id` refers to: a live sequence, a finished
    /// one, or a finished one whose buffers its continuation took over (rebuilt from the
    /// continuation's prefix and the record's tail: exactly what the finished sequence held).
    pub fn extends_source(&self, id: u64) -> Option<ExtendsSource<'_>> {
        if let Some(&slot) = self.by_id.get(&id) {
            let s = self.get(slot);
            return Some((
                Cow::Borrowed(&s.tokens),
                Cow::Borrowed(&s.extra),
                Cow::Borrowed(&s.hashes),
            ));
        }
        self.source_by_serial(self.finished.serial_of(id)?, id, 0)
    }

    /// The sequence with this serial, last known under `id`.
    fn source_by_serial(&self, serial: u64, id: u64, depth: usize) -> Option<ExtendsSource<'_>> {
        if let Some(s) = self.by_id.get(&id).map(|&slot| self.get(slot)) {
            if s.serial == serial {
                return Some((
                    Cow::Borrowed(&s.tokens),
                    Cow::Borrowed(&s.extra),
                    Cow::Borrowed(&s.hashes),
                ));
            }
        }
        if let Some(f) = self.finished.get_serial(serial) {
            return Some((
                Cow::Borrowed(&f.tokens),
                Cow::Borrowed(&f.extra),
                Cow::Borrowed(&f.hashes),
            ));
        }
        // Turn after turn, continuations chain; a bounded depth keeps this cheap and finite.
        if depth >= 64 {
            return None;
        }
        let record = self.finished.continued(serial)?;
        let (tokens, _, hashes) = self.source_by_serial(record.by_serial, record.by, depth + 1)?;
        if tokens.len() < record.tokens || hashes.len() < record.units {
            return None;
        }
        let mut own_tokens = tokens[..record.tokens].to_vec();
        own_tokens.extend_from_slice(&record.tail_tokens);
        let mut own_hashes = hashes[..record.units].to_vec();
        own_hashes.extend_from_slice(&record.tail_hashes);
        Some((Cow::Owned(own_tokens), Cow::Borrowed(&record.extra), Cow::Owned(own_hashes)))
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

/// The sequences one `add_batch` registered whose digests are not all computed yet (each
/// holds the digests it reused and that of unit 0): by id, its slot and the number of digests
/// it has once hashed, which is what a sequence added alone would hold.
#[derive(Debug, Default)]
pub(crate) struct Deferred {
    pending: FxHashMap<u64, (usize, usize)>,
}

impl Deferred {
    /// The digests `id` will hold once hashed, if its hashing is deferred.
    pub fn units_of(&self, id: u64) -> Option<usize> {
        self.pending.get(&id).map(|&(_, units)| units)
    }

    pub fn defer(&mut self, id: u64, slot: usize, units: usize) {
        self.pending.insert(id, (slot, units));
    }

    /// Hashes `id` now, on this thread, if it is deferred and holds fewer than `needed`
    /// digests: a later request of the batch reuses that many of them.
    pub fn settle(
        &mut self,
        table: &mut SequenceTable,
        hasher: &mut Hasher,
        unit: u32,
        id: u64,
        needed: usize,
    ) {
        let Some(&(slot, _)) = self.pending.get(&id) else { return };
        let seq = table.get_mut(slot);
        if seq.hashes.len() < needed {
            hasher.extend(&seq.tokens, unit, &seq.extra, &mut seq.hashes);
            self.pending.remove(&id);
        }
    }

    /// The slots still to hash, in slot order.
    pub fn slots(&self) -> Vec<usize> {
        let mut slots: Vec<usize> = self.pending.values().map(|&(slot, _)| slot).collect();
        slots.sort_unstable();
        slots
    }
}

impl SequenceTable {
    /// The hash chains of the live sequences in `slots` (in slot order; each slot once).
    pub fn chains(&mut self, slots: &[usize]) -> Vec<Chain<'_>> {
        let mut wanted = vec![false; self.seqs.len()];
        for &slot in slots {
            wanted[slot] = true;
        }
        self.seqs
            .iter_mut()
            .zip(wanted)
            .filter_map(|(seq, wanted)| seq.as_mut().filter(|_| wanted))
            .map(|s| Chain { tokens: &s.tokens, extra: &s.extra, hashes: &mut s.hashes })
            .collect()
    }
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
