//! `commit` and `abort`: the second phase of a step.
//!
//! Publishing rule at commit, for a step that computed `[qs, qe)` of a sequence:
//! - paged groups: every unit boundary q with `qs < q <= qe` becomes a key of the block holding
//!   token `q - 1`; a copy-on-write destination is keyed for the boundaries the copy gave it;
//!   lookahead tokens are never keyed; sliding windows release the blocks that left the window;
//! - state groups: the running buffers swap; the checkpoint the sequence resumed from is
//!   released first, then the step's checkpoints are published and released to the LRU as most
//!   recently used; a decode-tail snapshot replaces the previous one and stays private until
//!   `finish`.
//!
//! `abort` publishes nothing, frees the step's new blocks and copies, and puts every sequence
//! back at its pre-step position (a first step gives its pinned hit back).

use crate::error::{CacheError, Result};
use crate::events::CacheEvent;
use crate::hashing::{unit_extra_entries, Digest};
use crate::index::UnitContent;
use crate::manager::{CacheManager, GroupRuntime};
use crate::plan::StepPlan;
use crate::pool::{BlockId, BlockKey, BlockPool, Key, LruEnd, NULL_BLOCK};
use crate::sequence::{GroupStep, PagedSeq, SeqGroup, Sequence, StateSeq};

impl CacheManager {
    fn take_in_flight(&mut self, step_id: u64, verb: &str) -> Result<Vec<usize>> {
        match &self.in_flight {
            Some(f) if f.step_id == step_id => {
                Ok(self.in_flight.take().map(|f| f.slots).unwrap_or_default())
            }
            Some(f) => Err(CacheError::StalePlan {
                plan_step: step_id,
                state: format!("step {} is in flight; cannot {verb} step {step_id}", f.step_id),
            }),
            None => Err(CacheError::StalePlan {
                plan_step: step_id,
                state: if step_id < self.next_step {
                    format!("it was already committed or aborted; cannot {verb} it again")
                } else {
                    "no such plan was built".to_string()
                },
            }),
        }
    }

    /// Publishes what the plan's step wrote and advances every sequence. A plan another
    /// manager built is refused (`StalePlan`), whatever its step id.
    pub fn commit(&mut self, plan: &StepPlan) -> Result<()> {
        self.refuse_foreign(plan, "commit")?;
        self.commit_step(plan.step_id)
    }

    /// `StalePlan` for a plan this manager did not build.
    fn refuse_foreign(&self, plan: &StepPlan, verb: &str) -> Result<()> {
        if plan.manager == self.manager_id {
            return Ok(());
        }
        Err(CacheError::StalePlan {
            plan_step: plan.step_id,
            state: format!("it was built by another manager; cannot {verb} it here"),
        })
    }

    /// `commit` by step id.
    pub fn commit_step(&mut self, step_id: u64) -> Result<()> {
        let slots = self.take_in_flight(step_id, "commit")?;
        for &slot in &slots {
            self.commit_slot(slot);
        }
        self.recycle_slot_list(slots);
        self.stats.commits += 1;
        Ok(())
    }

    /// Hands a finished step's slot list back as the next step's (emptied), so that steps
    /// of a steady batch allocate nothing for it.
    fn recycle_slot_list(&mut self, mut slots: Vec<usize>) {
        if self.scheduled.is_empty() && self.scheduled.capacity() < slots.capacity() {
            slots.clear();
            self.scheduled = slots;
        }
    }

    /// Undoes the plan's step: nothing is published, every sequence is back where it was.
    pub fn abort(&mut self, plan: &StepPlan) -> Result<()> {
        self.refuse_foreign(plan, "abort")?;
        self.abort_step(plan.step_id)
    }

    /// `abort` by step id.
    pub fn abort_step(&mut self, step_id: u64) -> Result<()> {
        let slots = self.take_in_flight(step_id, "abort")?;
        for &slot in slots.iter().rev() {
            self.undo_step(slot);
        }
        self.recycle_slot_list(slots);
        self.stats.aborts += 1;
        Ok(())
    }

    fn commit_slot(&mut self, slot: usize) {
        if self.commit_quiet_step(slot) {
            return;
        }
        let Some(mut seq) = self.seqs[slot].take() else {
            return;
        };
        let Some(step) = seq.step.take() else {
            self.seqs[slot] = Some(seq);
            return;
        };
        let (start, end) = (step.start, step.end);
        let mut groups = std::mem::take(&mut seq.groups);
        for (g, group_step) in step.groups.iter().enumerate() {
            let pool = self.groups[g].pool();
            match (group_step, &mut groups[g]) {
                (GroupStep::Paged { cow, .. }, SeqGroup::Paged(paged)) => {
                    let block_size = self.groups[g].block_size().unwrap_or(1);
                    // A copy-on-write destination is keyed for the boundaries the copy gave it
                    // together with those this step adds (the next boundary is in the same
                    // block): one `BlockStored` per block per commit.
                    let mut q = (start / self.unit + 1) * self.unit;
                    let mut from = cow.map_or(q - self.unit, |(_, _, tokens)| start - tokens);
                    while q <= end {
                        let col = ((q - 1) / block_size) as usize;
                        let block_end = ((col as u32 + 1) * block_size).min(end);
                        let block = paged.table[col];
                        self.publish_range(g, &seq, block, from, block_end);
                        q = (block_end / self.unit + 1) * self.unit;
                        from = q - self.unit;
                    }
                    if let Some((src, dst, _)) = *cow {
                        if from < start {
                            // The step ended before the next boundary: only the copied ones.
                            self.publish_range(g, &seq, dst, from, start);
                        }
                        self.pools[pool].decref(src, LruEnd::MostRecent);
                    }
                    if let GroupRuntime::SlidingWindow { window, .. } = self.groups[g] {
                        // The plan reported the releases up to here; an aborted plan's
                        // are reported again by the next one.
                        paged.window_reported = paged.window_start;
                        release_window(&mut self.pools[pool], paged, end, window, block_size);
                    }
                }
                (GroupStep::State { interior, snapshot }, SeqGroup::State(state)) => {
                    advance_running_state(&mut self.pools[pool], state);
                    for c in interior.iter().chain(snapshot.iter()) {
                        if c.decode_tail {
                            if let Some((old, _)) = state.decode_tail.replace((c.block, c.position))
                            {
                                self.pools[pool].decref(old, LruEnd::MostRecent);
                            }
                            continue;
                        }
                        self.publish_checkpoint(g, &seq, c.block, c.position);
                        self.pools[pool].decref(c.block, LruEnd::MostRecent);
                    }
                }
                _ => {}
            }
        }
        seq.groups = groups;
        seq.num_computed = end;
        seq.recycle_step(step.groups);
        self.seqs[slot] = Some(seq);
    }

    /// Commits a step that publishes nothing (most decode steps: no unit boundary crossed, no
    /// copy, no checkpoint, no sliding window) in place, without moving the sequence out of its
    /// slot. Returns false, having changed nothing, for any other step.
    fn commit_quiet_step(&mut self, slot: usize) -> bool {
        let unit = self.unit;
        let Some(seq) = self.seqs[slot].as_mut() else {
            return false;
        };
        let Some(step) = &seq.step else {
            return false;
        };
        let boundary = (step.start / unit + 1) * unit <= step.end;
        let quiet = step.groups.iter().zip(&self.groups).all(|(group_step, runtime)| {
            match (group_step, runtime) {
                (GroupStep::Paged { cow, .. }, GroupRuntime::FullAttention { .. }) => {
                    cow.is_none() && !boundary
                }
                (GroupStep::State { interior, snapshot }, GroupRuntime::State { .. }) => {
                    interior.is_empty() && snapshot.is_none()
                }
                _ => false,
            }
        });
        if !quiet {
            return false;
        }
        let Some(step) = seq.step.take() else {
            return false;
        };
        for (runtime, group) in self.groups.iter().zip(seq.groups.iter_mut()) {
            if let SeqGroup::State(state) = group {
                advance_running_state(&mut self.pools[runtime.pool()], state);
            }
        }
        seq.num_computed = step.end;
        seq.recycle_step(step.groups);
        true
    }

    /// Keys `block` of paged group `g` at every unit boundary in `(from, to]`.
    fn publish_range(&mut self, g: usize, seq: &Sequence, block: BlockId, from: u32, to: u32) {
        let unit = self.unit;
        let hashes = &seq.hashes;
        let pool = self.groups[g].pool();
        let first = from / unit + 1;
        let last = to / unit;
        // Digests are collected for the event only when events are on (no allocation else).
        let record = self.events.enabled();
        let mut added: Vec<Digest> = Vec::new();
        let mut first_added = None;
        for i in first..=last {
            let position = i * unit;
            let key = Key { group: g as u32, digest: hashes[(i - 1) as usize] };
            if self.pools[pool].add_key(block, BlockKey { key, position }) {
                self.index_insert(key, block, seq, i - 1);
                first_added.get_or_insert(position);
                if record {
                    added.push(key.digest);
                }
            }
        }
        if let Some(first_position) = first_added {
            self.store_event(g, block, added, hashes, first_position, false);
        }
    }

    fn publish_checkpoint(&mut self, g: usize, seq: &Sequence, block: BlockId, position: u32) {
        let hashes = &seq.hashes;
        let unit_index = position / self.unit;
        let key = Key { group: g as u32, digest: hashes[(unit_index - 1) as usize] };
        let pool = self.groups[g].pool();
        if self.pools[pool].add_key(block, BlockKey { key, position }) {
            self.index_insert(key, block, seq, unit_index - 1);
            self.stats.groups[g].checkpoints_published += 1;
            self.store_event(g, block, vec![key.digest], hashes, position, true);
        }
    }

    fn index_insert(&mut self, key: Key, block: BlockId, seq: &Sequence, unit_index: u32) {
        let p = self.groups[key.group as usize].pool();
        let mut extra = Vec::new();
        let unit = self.index.verifies_tokens().then(|| {
            let i = unit_index as usize;
            let unit = self.unit as usize;
            unit_extra_entries(&mut extra, i, unit, &seq.extra);
            let parent = if i == 0 { self.hasher.seed_digest() } else { seq.hashes[i - 1] };
            (parent, &seq.tokens[i * unit..(i + 1) * unit])
        });
        let pool = &self.pools[p];
        let carries = |b| pool.carries(b, &key);
        let content =
            unit.as_ref().map(|(parent, tokens)| UnitContent { parent, tokens, extra: &extra });
        let duplicate = self.index.insert(key, block, content, carries);
        if duplicate {
            let holders: Vec<BlockId> = self.index.get(&key, carries).collect();
            for holder in holders {
                self.pools[p].mark_shared_key(holder);
            }
        }
    }

    fn store_event(
        &mut self,
        g: usize,
        block: BlockId,
        keys: Vec<Digest>,
        hashes: &[Digest],
        first_position: u32,
        checkpoint: bool,
    ) {
        if !self.events.enabled() {
            return;
        }
        let unit = self.unit;
        let parent = (first_position > unit).then(|| hashes[(first_position / unit - 2) as usize]);
        let token_end = first_position + (keys.len() as u32 - 1) * unit;
        self.events.push(CacheEvent::BlockStored {
            group: g as u32,
            block,
            keys,
            parent,
            token_start: first_position - unit,
            token_end,
            checkpoint,
        });
    }

    /// `finish`: the decode-tail snapshot becomes a published checkpoint, least recently used.
    pub(crate) fn publish_decode_tail(
        &mut self,
        g: usize,
        seq: &Sequence,
        block: BlockId,
        position: u32,
    ) {
        self.publish_checkpoint(g, seq, block, position);
        if self.pools[self.groups[g].pool()].is_published(block) {
            self.stats.groups[g].decode_tails_published += 1;
        }
        self.pools[self.groups[g].pool()].decref(block, LruEnd::LeastRecent);
    }

    /// Undoes a scheduled or in-flight step of one sequence.
    pub(crate) fn undo_step(&mut self, slot: usize) {
        let Some(mut seq) = self.seqs[slot].take() else {
            return;
        };
        let Some(step) = seq.step.take() else {
            self.seqs[slot] = Some(seq);
            return;
        };
        for (g, group_step) in step.groups.iter().enumerate() {
            let pool = &mut self.pools[self.groups[g].pool()];
            match (group_step, &mut seq.groups[g]) {
                (GroupStep::Paged { table_len_before, cow }, SeqGroup::Paged(paged)) => {
                    for &block in paged.table[*table_len_before..].iter().rev() {
                        pool.decref(block, LruEnd::MostRecent);
                    }
                    paged.table.truncate(*table_len_before);
                    if let Some((src, _, _)) = cow {
                        pool.decref(*src, LruEnd::MostRecent);
                    }
                    if step.first {
                        *paged = PagedSeq::default();
                    }
                }
                (GroupStep::State { interior, snapshot }, SeqGroup::State(state)) => {
                    for c in interior.iter().chain(snapshot.iter()) {
                        pool.decref(c.block, LruEnd::MostRecent);
                    }
                    if step.first {
                        for block in [state.running[1], state.running[0], state.resume] {
                            pool.decref(block, LruEnd::MostRecent);
                        }
                        *state = StateSeq::default();
                    }
                }
                _ => {}
            }
        }
        if step.first {
            seq.started = false;
            seq.num_computed = 0;
            seq.prefill_target = 0;
            seq.junction = None;
            self.started -= 1;
        }
        seq.recycle_step(step.groups);
        self.seqs[slot] = Some(seq);
    }
}

/// A committed step's effect on a state group's running buffers, whatever else the step
/// publishes: the buffer the step wrote becomes the current one, and the checkpoint the
/// sequence resumed from (its first step only) is released.
fn advance_running_state(pool: &mut BlockPool, state: &mut StateSeq) {
    let written = usize::from(state.current == Some(0));
    state.current = Some(written);
    if state.resume != NULL_BLOCK {
        pool.decref(state.resume, LruEnd::MostRecent);
        state.resume = NULL_BLOCK;
    }
}

/// Releases the blocks that left the window once `computed` tokens are done: a block j is no
/// longer read when `(j + 1) * B <= computed - W`.
fn release_window(
    pool: &mut crate::pool::BlockPool,
    paged: &mut PagedSeq,
    computed: u32,
    window: u32,
    block_size: u32,
) {
    let keep_from = (computed.saturating_sub(window) / block_size) as usize;
    while paged.window_start < keep_from.min(paged.table.len()) {
        let col = paged.window_start;
        pool.decref(paged.table[col], LruEnd::MostRecent);
        paged.table[col] = NULL_BLOCK;
        paged.window_start += 1;
    }
}
