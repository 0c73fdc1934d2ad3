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
//!
//! With several plans in flight (`max_steps_in_flight` > 1) plans end in the order they were
//! built; `abort` of the oldest ends every later one too (they may read what it wrote), newest
//! first, and drops the placeholders appended to their sequences since it was built. A key
//! whose prefix holds a placeholder at commit is published by the `resolve` that makes it
//! known (`publish_known`).

use crate::config::GroupSlot;
use crate::error::{CacheError, Result};
use crate::manager::CacheManager;
use crate::plan::StepPlan;
use crate::pool::{BlockId, BlockPool, LruEnd, NULL_BLOCK};
use crate::sequence::{PagedSeq, PagedStep, Sequence, StateSeq, StateStep};
use crate::stats::Stats;
use crate::store::BlockStore;

impl CacheManager {
    /// Checks that `step_id` is the oldest plan in flight (the only one that may end).
    fn check_oldest(&self, step_id: u64, verb: &str) -> Result<()> {
        match self.steps.in_flight.front() {
            Some(f) if f.step_id == step_id => Ok(()),
            Some(f) if self.steps.in_flight.iter().any(|p| p.step_id == step_id) => {
                Err(CacheError::step(format!(
                    "plans end in the order they were built: step {step_id} is in flight behind \
                     step {}; {verb} step {} first",
                    f.step_id, f.step_id
                )))
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

    fn take_in_flight(&mut self, step_id: u64, verb: &str) -> Result<Vec<usize>> {
        self.check_oldest(step_id, verb)?;
        Ok(self.steps.in_flight.pop_front().map(|f| f.slots).unwrap_or_default())
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
        if self.config.max_steps_in_flight > 1 {
            let mut idle = false;
            for &slot in &slots {
                idle |= self.commit_slot::<true>(slot);
            }
            if idle {
                for &slot in &slots {
                    self.after_step_ended(slot);
                }
            }
        } else {
            for &slot in &slots {
                self.commit_slot::<false>(slot);
            }
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
    /// Every later plan in flight is aborted too; returns the ids of the plans it ended,
    /// oldest first.
    pub fn abort(&mut self, plan: &StepPlan) -> Result<Vec<u64>> {
        self.refuse_foreign(plan, "abort")?;
        self.abort_step(plan.step_id)
    }

    /// `abort` by step id.
    pub fn abort_step(&mut self, step_id: u64) -> Result<Vec<u64>> {
        self.check_oldest(step_id, "abort")?;
        if self.steps.in_flight.len() == 1 && self.config.max_steps_in_flight == 1 {
            let slots = self.take_in_flight(step_id, "abort")?;
            for &slot in slots.iter().rev() {
                self.undo_step(slot);
            }
            self.recycle_slot_list(slots);
            self.stats.aborts += 1;
            return Ok(vec![step_id]);
        }
        let plans: Vec<_> = self.steps.in_flight.drain(..).collect();
        // The steps scheduled for the next plan that continue an aborted one go first.
        for &slot in plans.iter().flat_map(|p| &p.slots) {
            if self.seq(slot).step().is_some_and(|s| s.plan == 0) {
                self.drop_scheduled(slot);
            }
        }
        for plan in plans.iter().rev() {
            for &slot in plan.slots.iter().rev() {
                self.undo_step(slot);
            }
        }
        let mut ended = Vec::with_capacity(plans.len());
        for plan in plans {
            for &slot in &plan.slots {
                self.drop_placeholders_since(slot, step_id);
                self.after_step_ended(slot);
            }
            ended.push(plan.step_id);
            self.stats.aborts += 1;
            self.recycle_slot_list(plan.slots);
        }
        Ok(ended)
    }

    /// Ends the newest plan in flight, `step_id`, which no engine saw (the caller could not
    /// hand it over): nothing ran it, so no later step depends on it. Its steps are undone as
    /// `abort` would, and the steps scheduled since that continue them are dropped. `StalePlan`
    /// for any other plan.
    pub fn withdraw_plan(&mut self, step_id: u64) -> Result<()> {
        if self.steps.in_flight.back().map(|f| f.step_id) != Some(step_id) {
            return Err(CacheError::StalePlan {
                plan_step: step_id,
                state: "only the newest plan in flight can be withdrawn".to_string(),
            });
        }
        let Some(plan) = self.steps.in_flight.pop_back() else { return Ok(()) };
        for &slot in &plan.slots {
            if self.seq(slot).step().is_some_and(|s| s.plan == 0) {
                self.drop_scheduled(slot);
            }
        }
        for &slot in plan.slots.iter().rev() {
            self.undo_step(slot);
        }
        for &slot in &plan.slots {
            self.after_step_ended(slot);
        }
        self.stats.aborts += 1;
        self.recycle_slot_list(plan.slots);
        Ok(())
    }

    /// Commits the oldest step of `slot`; `DEEP`: `max_steps_in_flight` > 1, where the
    /// buffer that held the committed state is kept as the known spare (`StateSeq::spare`).
    /// Returns whether the sequence is left without a step (`after_step_ended` has work).
    fn commit_slot<const DEEP: bool>(&mut self, slot: usize) -> bool {
        if let Some(idle) = self.commit_quiet_step::<DEEP>(slot) {
            return idle;
        }
        // The sequence is worked on in its slot, beside the store (no move of it out and back).
        let (unit, layout, store, counters) =
            (self.unit, &self.layout, &mut self.store, &mut self.stats);
        let seq = self.table.get_mut(slot);
        let Some(mut step) = seq.take_oldest() else {
            return false;
        };
        let start = step.start;
        // Keys whose prefix holds a placeholder wait for `resolve` (`publish_known`).
        let known = seq.hashes.len() as u32 * unit;
        let end = step.end.min(known.max(start));
        if step.end / unit * unit > end {
            seq.keys_pending_from.get_or_insert(end);
        }
        // The groups' blocks are taken out while the keys are computed from the sequence.
        let (mut paged_seqs, mut state_seqs) =
            (std::mem::take(&mut seq.paged), std::mem::take(&mut seq.state));
        for g in 0..layout.len() {
            match layout.slots[g] {
                GroupSlot::Paged(i) => {
                    let (group, paged) = (&layout.paged[i], &mut paged_seqs[i]);
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
                        store.publish_range(g, seq.content(), block, from, block_end);
                        q = (block_end / unit + 1) * unit;
                        from = q - unit;
                    }
                    if let Some((src, dst, _)) = cow {
                        if from < start {
                            // The step ended before the next boundary: only the copied ones.
                            store.publish_range(g, seq.content(), dst, from, start);
                        }
                        store.pools[pool].decref(src, LruEnd::MostRecent);
                    }
                    if let Some(window) = group.window {
                        // The plan reported the releases up to here; an aborted plan's
                        // are reported again by the next one.
                        paged.window_reported =
                            paged.window_reported.max(step.paged[i].reported_to);
                        let computed = step.end;
                        release_window(&mut store.pools[pool], paged, computed, window, block_size);
                    }
                }
                GroupSlot::State(i) => {
                    let (pool, state) = (layout.state[i].pool, &mut state_seqs[i]);
                    let StateStep { write, interior, snapshot, .. } = &step.state[i];
                    advance_running_state::<DEEP>(&mut store.pools[pool], state, *write);
                    for c in interior.iter().chain(snapshot.iter()) {
                        if c.decode_tail {
                            if let Some((old, _)) = state.decode_tail.replace((c.block, c.position))
                            {
                                store.pools[pool].decref(old, LruEnd::MostRecent);
                            }
                            continue;
                        }
                        if c.position > known {
                            seq.pending_checkpoints.push((g, c.block, c.position));
                            continue;
                        }
                        publish_checkpoint(store, counters, g, seq, c.block, c.position);
                        store.pools[pool].decref(c.block, LruEnd::MostRecent);
                    }
                }
            }
        }
        (seq.paged, seq.state) = (paged_seqs, state_seqs);
        store.events.seal();
        seq.num_computed = step.end;
        seq.recycle_step(&mut step);
        seq.num_steps() == 0
    }

    /// Publishes what `resolve` made known of a sequence's committed steps: the paged keys
    /// of every unit boundary in `(keys_pending_from, num_computed]` its tokens now cover (a
    /// block a sliding window released meanwhile is skipped), and the checkpoints waiting for
    /// their prefix.
    pub(crate) fn publish_known(&mut self, slot: usize) {
        if !self.table.is_live(slot) {
            return;
        }
        // The sequence is worked on in its slot, beside the store (no move of it out and back).
        let (unit, layout, store, stats) =
            (self.unit, &self.layout, &mut self.store, &mut self.stats);
        let seq = self.table.get_mut(slot);
        let known = seq.hashes.len() as u32 * unit;
        if let Some(from) = seq.keys_pending_from {
            let to = seq.num_computed.min(known);
            if to > from {
                for (i, group) in layout.paged.iter().enumerate() {
                    let (g, block_size, table) =
                        (group.index, group.block_size, &seq.paged[i].table);
                    let mut q = (from / unit + 1) * unit;
                    while q <= to {
                        let col = ((q - 1) / block_size) as usize;
                        let block_end = ((col as u32 + 1) * block_size).min(to);
                        let block = table.get(col).copied().unwrap_or(NULL_BLOCK);
                        if block != NULL_BLOCK {
                            store.publish_range(g, seq.content(), block, q - unit, block_end);
                        }
                        q = (block_end / unit + 1) * unit;
                    }
                }
            }
            seq.keys_pending_from =
                (seq.num_computed / unit * unit > to.max(from)).then_some(to.max(from));
        }
        if !seq.pending_checkpoints.is_empty() {
            let pending = std::mem::take(&mut seq.pending_checkpoints);
            for (g, block, position) in pending {
                if position > known {
                    seq.pending_checkpoints.push((g, block, position));
                    continue;
                }
                publish_checkpoint(store, stats, g, seq, block, position);
                store.pools[layout.pool(g)].decref(block, LruEnd::MostRecent);
            }
        }
        store.events.seal();
    }

    /// Commits a step that publishes nothing (most decode steps: no unit boundary crossed, no
    /// copy, no checkpoint, no sliding window) in place, without moving the sequence out of its
    /// slot; returns whether the sequence is left without a step. Returns `None`, having
    /// changed nothing, for any other step.
    fn commit_quiet_step<const DEEP: bool>(&mut self, slot: usize) -> Option<bool> {
        let unit = self.unit;
        let seq = self.table.get_mut(slot);
        // The step is committed where it is; its record stays for a later step.
        let step = seq.ring.oldest_mut()?;
        let boundary = (step.start / unit + 1) * unit <= step.end;
        let layout = &self.layout;
        let quiet = step
            .paged
            .iter()
            .zip(&layout.paged)
            .all(|(s, group)| group.window.is_none() && s.cow.is_none() && !boundary)
            && step.state.iter().all(|s| s.interior.is_empty() && s.snapshot.is_none());
        if !quiet {
            return None;
        }
        for ((state, group), s) in seq.state.iter_mut().zip(&layout.state).zip(&step.state) {
            advance_running_state::<DEEP>(&mut self.store.pools[group.pool], state, s.write);
        }
        seq.num_computed = step.end;
        // (its vectors stay in the record, for the step that reuses it)
        seq.ring.pop_oldest();
        Some(seq.ring.len() == 0)
    }

    /// Publishes checkpoint `block` of state group `g` at `position` (counted when new).
    fn publish_checkpoint(&mut self, g: usize, seq: &Sequence, block: BlockId, position: u32) {
        publish_checkpoint(&mut self.store, &mut self.stats, g, seq, block, position);
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

    /// Undoes the newest (scheduled or in-flight) step of one sequence.
    pub(crate) fn undo_step(&mut self, slot: usize) {
        let Some(mut seq) = self.table.take(slot) else {
            return;
        };
        let Some(mut step) = seq.take_newest() else {
            self.table.put(slot, seq);
            return;
        };
        for slot in &self.layout.slots {
            match *slot {
                GroupSlot::Paged(i) => {
                    let pool = &mut self.store.pools[self.layout.paged[i].pool];
                    let (paged, PagedStep { table_len_before, cow, .. }) =
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
                    let (state, StateStep { interior, snapshot, .. }) =
                        (&mut seq.state[i], &step.state[i]);
                    for c in interior.iter().chain(snapshot.iter()) {
                        pool.decref(c.block, LruEnd::MostRecent);
                    }
                    if step.first {
                        for &block in state.extra.iter().rev() {
                            pool.decref(block, LruEnd::MostRecent);
                        }
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
/// publishes: the buffer the step wrote (`write`) becomes the current one, and the checkpoint
/// the sequence resumed from (its first step only) is released. A buffer beyond the pair
/// (a step deeper in flight wrote it) takes the current one's place in the pair, which
/// becomes a spare. `DEEP` (D > 1): the buffer that held the committed state is the known
/// spare now (`StateSeq::spare`): no step in flight writes it.
#[allow(clippy::inline_always)] // (measured: the decode step's instructions)
#[inline(always)]
fn advance_running_state<const DEEP: bool>(
    pool: &mut BlockPool,
    state: &mut StateSeq,
    write: BlockId,
) {
    if let Some(i) = state.running.iter().position(|&b| b == write) {
        if DEEP {
            // (the committed state was the pair's other buffer, as no step writes it)
            let before = state.running[i ^ 1];
            state.spare = if state.current.is_some() { before } else { NULL_BLOCK };
        }
        state.current = Some(i);
    } else {
        let c = state.current.unwrap_or(0);
        let before = state.running[c];
        if DEEP {
            state.spare = if state.current.is_some() { before } else { NULL_BLOCK };
        }
        if let Some(e) = state.extra.iter().position(|&b| b == write) {
            state.extra[e] = before;
            state.running[c] = write;
        }
        state.current = Some(c);
    }
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

/// Publishes checkpoint `block` of state group `g` at `position` (counted when new).
fn publish_checkpoint(
    store: &mut BlockStore,
    stats: &mut Stats,
    g: usize,
    seq: &Sequence,
    block: BlockId,
    position: u32,
) {
    if store.publish_checkpoint(g, seq.content(), block, position) {
        stats.groups[g].checkpoints_published += 1;
    }
}
