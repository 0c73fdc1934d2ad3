//! `commit` and `abort`: the second phase of a step (publication goes through the store).
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

use crate::config::GroupSlot;
use crate::error::{CacheError, Result};
use crate::manager::CacheManager;
use crate::plan::StepPlan;
use crate::pool::{BlockId, BlockPool, LruEnd, NULL_BLOCK};
use crate::sequence::{PagedSeq, PagedStep, Sequence, StateSeq, StateStep};

impl CacheManager {
    fn take_in_flight(&mut self, step_id: u64, verb: &str) -> Result<Vec<usize>> {
        match &self.steps.in_flight {
            Some(f) if f.step_id == step_id => {
                Ok(self.steps.in_flight.take().map(|f| f.slots).unwrap_or_default())
            }
            Some(f) => Err(CacheError::StalePlan {
                plan_step: step_id,
                state: format!("step {} is in flight; cannot {verb} step {step_id}", f.step_id),
            }),
            None => Err(CacheError::StalePlan {
                plan_step: step_id,
                state: if step_id < self.steps.next_step {
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
        if self.steps.scheduled.is_empty() && self.steps.scheduled.capacity() < slots.capacity() {
            slots.clear();
            self.steps.scheduled = slots;
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
        let Some(mut seq) = self.table.take(slot) else {
            return;
        };
        let Some(mut step) = seq.take_step() else {
            self.table.put(slot, seq);
            return;
        };
        let (start, end, unit) = (step.start, step.end, self.unit);
        // The groups' blocks are taken out while the keys are computed from the sequence.
        let (mut paged_seqs, mut state_seqs) =
            (std::mem::take(&mut seq.paged), std::mem::take(&mut seq.state));
        for g in 0..self.layout.len() {
            match self.layout.slots[g] {
                GroupSlot::Paged(i) => {
                    let (group, paged) = (&self.layout.paged[i], &mut paged_seqs[i]);
                    let (pool, block_size, cow) = (group.pool, group.block_size, step.paged[i].cow);
                    // A copy-on-write destination is keyed for the boundaries the copy gave it
                    // together with those this step adds (the next boundary is in the same
                    // block): one `BlockStored` per block per commit.
                    let mut q = (start / unit + 1) * unit;
                    let mut from = cow.map_or(q - unit, |(_, _, tokens)| start - tokens);
                    while q <= end {
                        let col = ((q - 1) / block_size) as usize;
                        let block_end = ((col as u32 + 1) * block_size).min(end);
                        let block = paged.table[col];
                        self.store.publish_range(g, seq.content(), block, from, block_end);
                        q = (block_end / unit + 1) * unit;
                        from = q - unit;
                    }
                    if let Some((src, dst, _)) = cow {
                        if from < start {
                            // The step ended before the next boundary: only the copied ones.
                            self.store.publish_range(g, seq.content(), dst, from, start);
                        }
                        self.store.pools[pool].decref(src, LruEnd::MostRecent);
                    }
                    if let Some(window) = group.window {
                        // The plan reported the releases up to here; an aborted plan's
                        // are reported again by the next one.
                        paged.window_reported = paged.window_start;
                        release_window(&mut self.store.pools[pool], paged, end, window, block_size);
                    }
                }
                GroupSlot::State(i) => {
                    let (pool, state) = (self.layout.state[i].pool, &mut state_seqs[i]);
                    let StateStep { interior, snapshot } = &step.state[i];
                    advance_running_state(&mut self.store.pools[pool], state);
                    for c in interior.iter().chain(snapshot.iter()) {
                        if c.decode_tail {
                            if let Some((old, _)) = state.decode_tail.replace((c.block, c.position))
                            {
                                self.store.pools[pool].decref(old, LruEnd::MostRecent);
                            }
                            continue;
                        }
                        self.publish_checkpoint(g, &seq, c.block, c.position);
                        self.store.pools[pool].decref(c.block, LruEnd::MostRecent);
                    }
                }
            }
        }
        (seq.paged, seq.state) = (paged_seqs, state_seqs);
        seq.num_computed = end;
        seq.recycle_step(&mut step);
        self.table.put(slot, seq);
    }

    /// Commits a step that publishes nothing (most decode steps: no unit boundary crossed, no
    /// copy, no checkpoint, no sliding window) in place, without moving the sequence out of its
    /// slot. Returns false, having changed nothing, for any other step.
    fn commit_quiet_step(&mut self, slot: usize) -> bool {
        let unit = self.unit;
        let seq = self.table.get_mut(slot);
        let Some(step) = seq.step() else {
            return false;
        };
        let boundary = (step.start / unit + 1) * unit <= step.end;
        let layout = &self.layout;
        let quiet = step
            .paged
            .iter()
            .zip(&layout.paged)
            .all(|(s, group)| group.window.is_none() && s.cow.is_none() && !boundary)
            && step.state.iter().all(|s| s.interior.is_empty() && s.snapshot.is_none());
        if !quiet {
            return false;
        }
        let Some(mut step) = seq.take_step() else {
            return false;
        };
        for (state, group) in seq.state.iter_mut().zip(&layout.state) {
            advance_running_state(&mut self.store.pools[group.pool], state);
        }
        seq.num_computed = step.end;
        seq.recycle_step(&mut step);
        true
    }

    /// Publishes checkpoint `block` of state group `g` at `position` (counted when new).
    fn publish_checkpoint(&mut self, g: usize, seq: &Sequence, block: BlockId, position: u32) {
        if self.store.publish_checkpoint(g, seq.content(), block, position) {
            self.stats.groups[g].checkpoints_published += 1;
        }
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
        if self.store.pools[self.layout.pool(g)].is_published(block) {
            self.stats.groups[g].decode_tails_published += 1;
        }
        self.store.pools[self.layout.pool(g)].decref(block, LruEnd::LeastRecent);
    }

    /// Undoes a scheduled or in-flight step of one sequence.
    pub(crate) fn undo_step(&mut self, slot: usize) {
        let Some(mut seq) = self.table.take(slot) else {
            return;
        };
        let Some(mut step) = seq.take_step() else {
            self.table.put(slot, seq);
            return;
        };
        for slot in &self.layout.slots {
            match *slot {
                GroupSlot::Paged(i) => {
                    let pool = &mut self.store.pools[self.layout.paged[i].pool];
                    let (paged, PagedStep { table_len_before, cow }) =
                        (&mut seq.paged[i], step.paged[i]);
                    for &block in paged.table[table_len_before..].iter().rev() {
                        pool.decref(block, LruEnd::MostRecent);
                    }
                    paged.table.truncate(table_len_before);
                    if let Some((src, _, _)) = cow {
                        pool.decref(src, LruEnd::MostRecent);
                    }
                    if step.first {
                        *paged = PagedSeq::default();
                    }
                }
                GroupSlot::State(i) => {
                    let pool = &mut self.store.pools[self.layout.state[i].pool];
                    let (state, StateStep { interior, snapshot }) =
                        (&mut seq.state[i], &step.state[i]);
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
            }
        }
        if step.first {
            seq.stop();
            self.started -= 1;
        }
        seq.recycle_step(&mut step);
        self.table.put(slot, seq);
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
