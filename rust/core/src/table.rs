//! The sequence table: the live sequences (by id and by slot), the serials that tell apart
//! sequences added again under one id, the bounded cache of finished sequences that
//! `add(.., extends)` reuses hashes from, and the live prefixes that stand in for `extends`.
//!
//! It finds sequences and their content; it never touches a block, the store or a step (the
//! protocol releases a sequence's blocks before `finish` hands it here).

use std::borrow::Cow;

use rustc_hash::FxHashMap;

use crate::error::{CacheError, Result};
use crate::hashing::{Digest, ExtraKeys};
use crate::limits::human_bytes;
use crate::pool::BlockId;
use crate::sequence::{Continued, FinishedCache, FinishedSequence, Sequence};

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
