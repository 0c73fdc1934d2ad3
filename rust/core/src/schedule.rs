//! The scheduling calls of the protocol: `schedule`, `schedule_batch`, `decode_step` and
//! `suggest_chunk`, with their argument and state checks and the chunk's end (`CheckpointGrid`).
//!
//! The first schedule of a sequence runs the lookup again, pins the hit (reference counts are
//! taken before anything is allocated, so this call cannot evict its own hit) and starts from
//! it. Every schedule is atomic: when a pool cannot supply the blocks the sequence itself needs
//! (paged blocks, copy-on-write destination, running-state buffers) it returns `None` and
//! changes nothing but a counter. Which blocks a chunk gets is `admission.rs`'s; checkpoint
//! blocks are chosen later, by `build_plan`, and never make a schedule fail. Nothing here
//! publishes or builds a plan's rows (beyond `decode_step` calling `build_plan_into`).

// `#[inline(always)]` where the decode step's instruction count (`baseline step N` under
// callgrind) showed the compiler leaving a small hot function out of line.
#![allow(clippy::inline_always)]

use crate::admission::{admission, assign_running, blocks_available, tables_cover, take_blocks};
use crate::error::{CacheError, Result};
use crate::hit::Hit;
use crate::limits::{MAX_LOOKAHEAD_TOKENS, MAX_SEQUENCE_TOKENS, MAX_STEP_TOKENS};
use crate::manager::{check_batch_len, CacheManager};
use crate::plan::StepPlan;
use crate::pool::NULL_BLOCK;
use crate::sequence::{Phase, Sequence, StepRecord, MAX_INLINE_GROUPS};

/// What `schedule` gave a sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub seq_id: u64,
    /// Tokens already computed before this chunk (the hit, on a first schedule).
    pub num_computed: u32,
    /// Tokens scheduled (0: the budget was below the alignment grid; nothing was pinned).
    pub num_tokens: u32,
    /// The hit this schedule started from (`Some` only on a sequence's first schedule).
    pub hit: Option<Hit>,
}

impl CacheManager {
    /// Schedules up to `max_tokens` tokens of a sequence for the next plan.
    ///
    /// Returns `Ok(None)` when the pool cannot supply the sequence's own blocks (nothing
    /// changed). A non-final prefill chunk is trimmed to end on a multiple of the chunk
    /// alignment unless `exact`; when nothing is left after trimming, 0 tokens are scheduled.
    pub fn schedule(
        &mut self,
        seq_id: u64,
        max_tokens: u32,
        lookahead: u32,
        exact: bool,
    ) -> Result<Option<Scheduled>> {
        self.refuse_in_flight_classic("schedule")?;
        let slot = self.slot(seq_id)?;
        self.check_schedulable(slot, lookahead)?;
        self.schedule_slot::<false>(slot, max_tokens, lookahead, exact)
    }

    /// `schedule` for many sequences (one crossing from Python). Every id is checked before
    /// anything is scheduled; results are in input order.
    pub fn schedule_batch(
        &mut self,
        seq_ids: &[u64],
        max_tokens: &[u32],
        exact: bool,
    ) -> Result<Vec<Option<Scheduled>>> {
        self.refuse_in_flight_classic("schedule")?;
        if seq_ids.len() != max_tokens.len() {
            return Err(CacheError::invalid(format!(
                "schedule_batch got {} sequence ids but {} token budgets",
                seq_ids.len(),
                max_tokens.len()
            )));
        }
        check_batch_len(seq_ids.len(), "schedule_batch")?;
        let mut slots = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            let slot = self.slot(id)?;
            self.check_schedulable(slot, 0)?;
            slots.push(slot);
        }
        self.table.refuse_repeats(&slots, "schedule_batch")?;
        // Collected from an exactly sized iterator (a `collect::<Result<_>>` is not one); an
        // error, a bug in the core (see `take_block`), is returned once the batch is through.
        let mut failure = None;
        let out = slots
            .into_iter()
            .zip(max_tokens)
            .map(|(slot, &budget)| {
                self.schedule_slot::<false>(slot, budget, 0, exact).unwrap_or_else(|e| {
                    failure.get_or_insert(e);
                    None
                })
            })
            .collect();
        failure.map_or(Ok(out), Err)
    }

    /// An engine's decode step in one call: commits the step `plan` holds when it is this
    /// manager's plan in flight, appends `tokens[i]` to `seq_ids[i]`, schedules one token of
    /// each and builds the plan of everything scheduled into `plan` (see `build_plan_into`).
    /// Results are in input order (`None`: the pools could not supply the sequence's block; it
    /// is not in the plan).
    ///
    /// A `plan` holding another step (already committed or aborted, another manager's, or a
    /// fresh one) commits nothing; a plan in flight other than the one `plan` holds is refused
    /// (`Step`), as every call that schedules is while a plan is in flight. The commit happens
    /// first and stands even if the rest is refused; the rest is checked before any of it
    /// changes anything (lengths, known and distinct ids, none already scheduled, the token
    /// limit).
    pub fn decode_step(
        &mut self,
        seq_ids: &[u64],
        tokens: &[u32],
        plan: &mut StepPlan,
    ) -> Result<Vec<Option<Scheduled>>> {
        if plan.manager == self.manager_id && self.plan_in_flight() == Some(plan.step_id) {
            self.commit_step(plan.step_id)?;
        }
        self.refuse_in_flight_classic("decode_step")?;
        if self.config.max_steps_in_flight > 1 {
            // (with D plans in flight the plan could not be built: refused before the appends)
            self.refuse_build_at_depth()?;
        }
        if seq_ids.len() != tokens.len() {
            return Err(CacheError::invalid(format!(
                "decode_step got {} sequence ids but {} tokens: give one token per sequence",
                seq_ids.len(),
                tokens.len()
            )));
        }
        check_batch_len(seq_ids.len(), "decode_step")?;
        let mut slots = Vec::with_capacity(seq_ids.len());
        for &id in seq_ids {
            let slot = self.slot(id)?;
            self.refuse_pending_step(slot)?;
            self.check_append(slot, 1)?;
            slots.push(slot);
        }
        self.table.refuse_repeats(&slots, "decode_step")?;
        for (&slot, token) in slots.iter().zip(tokens) {
            self.append_slot(slot, std::slice::from_ref(token))?;
        }
        self.schedule_each_and_plan::<false>(slots, plan, |_, _, _| Ok(()))
    }

    /// An overlapped decode step in one call (D > 1): commits the oldest plan in flight when
    /// it is `commit`, fills one placeholder of each `resolve_ids[i]` with `resolved[i]` (the
    /// tokens that plan sampled), appends one placeholder to each of `seq_ids` (the token the
    /// step being planned will sample is not known yet), schedules one token of each and
    /// builds the plan of everything scheduled into `plan`. Results are in input order
    /// (`None`: the pools could not supply the sequence's block; it is not in the plan).
    ///
    /// The commit happens first and stands even if the rest is refused; the rest is checked
    /// before any of it changes anything (lengths, known and distinct ids, placeholders to
    /// resolve, none already scheduled for the next plan or at depth D, the plan count).
    pub fn decode_step_overlapped(
        &mut self,
        commit: Option<u64>,
        resolve_ids: &[u64],
        resolved: &[u32],
        seq_ids: &[u64],
        plan: &mut StepPlan,
    ) -> Result<Vec<Option<Scheduled>>> {
        if let Some(step_id) = commit {
            self.commit_step(step_id)?;
        }
        if resolve_ids.len() != resolved.len() {
            return Err(CacheError::invalid(format!(
                "decode_step_overlapped got {} sequence ids to resolve but {} tokens: give one \
                 token per sequence",
                resolve_ids.len(),
                resolved.len()
            )));
        }
        check_batch_len(resolve_ids.len(), "decode_step_overlapped")?;
        check_batch_len(seq_ids.len(), "decode_step_overlapped")?;
        let depth = self.config.max_steps_in_flight as usize;
        if (depth == 1 && !self.steps.in_flight.is_empty()) || self.steps.in_flight.len() >= depth {
            self.refuse_in_flight("decode_step_overlapped")?;
        }
        // The common case resolves the very sequences it schedules: their checks go in one
        // pass over the ids, then their resolve, placeholder and schedule in one more. The
        // checks are those of the general case; if one fails, the general case's passes run
        // again for its first error (checks change nothing).
        let fused = !resolve_ids.is_empty() && resolve_ids == seq_ids;
        let slots = if fused {
            let checked = self.batch_slots(seq_ids, "decode_step_overlapped", |m, slot| {
                m.check_overlapped_one(slot)
            });
            match checked {
                Ok(slots) => slots,
                Err(e) => return Err(self.overlapped_check_error(seq_ids, e)),
            }
        } else {
            let slots = self.batch_slots(seq_ids, "decode_step_overlapped", |m, slot| {
                m.refuse_pending_step(slot)?;
                m.check_length_one(slot)
            })?;
            let resolve_slots =
                self.batch_slots(resolve_ids, "decode_step_overlapped", |m, slot| {
                    m.check_resolve_one(slot)
                })?;
            for (&slot, token) in resolve_slots.iter().zip(resolved) {
                self.resolve_one(slot, *token)?;
            }
            slots
        };
        if fused {
            return self.schedule_each_and_plan::<true>(slots, plan, |m, i, slot| {
                m.resolve_one_add_one(slot, resolved[i])
            });
        }
        self.schedule_each_and_plan::<true>(slots, plan, |m, _, slot| {
            m.add_placeholder_one(slot);
            Ok(())
        })
    }

    /// The first error of the fused overlapped decode step's checks in the general case's
    /// order: every id's schedule checks (known, not pending, length, distinct), then every
    /// id's resolve check (`fused`, the fused pass's error, if the general case finds none).
    #[cold]
    #[inline(never)]
    fn overlapped_check_error(&mut self, seq_ids: &[u64], fused: CacheError) -> CacheError {
        let first = self.batch_slots(seq_ids, "decode_step_overlapped", |m, slot| {
            m.refuse_pending_step(slot)?;
            m.check_length_one(slot)
        });
        let resolved =
            first.and_then(|slots| slots.iter().try_for_each(|&slot| self.check_resolve_one(slot)));
        resolved.err().unwrap_or(fused)
    }

    /// The decode steps' tail: runs `before` on each of `slots` (the `i`-th of the batch),
    /// schedules one token of it, and builds the plan of everything scheduled into `plan`.
    /// Results are in input order, collected from an exactly sized iterator; an error, a bug
    /// in the core (see `take_block`), is returned once the batch is through, before the plan.
    /// `DEEP`: continuations are expected (the overlapped decode step; see `schedule_slot`).
    #[inline(always)]
    fn schedule_each_and_plan<const DEEP: bool>(
        &mut self,
        slots: Vec<usize>,
        plan: &mut StepPlan,
        mut before: impl FnMut(&mut Self, usize, usize) -> Result<()>,
    ) -> Result<Vec<Option<Scheduled>>> {
        let mut failure = None;
        let scheduled = slots
            .into_iter()
            .enumerate()
            .map(|(i, slot)| {
                if let Err(e) = before(self, i, slot) {
                    failure.get_or_insert(e);
                }
                self.schedule_slot::<DEEP>(slot, 1, 0, false).unwrap_or_else(|e| {
                    failure.get_or_insert(e);
                    None
                })
            })
            .collect();
        if let Some(e) = failure {
            return Err(e);
        }
        self.build_plan_into(plan)?;
        Ok(scheduled)
    }

    /// The fused overlapped decode step's checks of one sequence, `refuse_pending_step`,
    /// `check_length_one` and `check_resolve_one`, in one look at it; those report a failure,
    /// in that order.
    #[inline(always)]
    fn check_overlapped_one(&self, slot: usize) -> Result<()> {
        let seq = self.seq(slot);
        let fits = (seq.num_tokens() as usize) < MAX_SEQUENCE_TOKENS;
        if self.free_for_next_step(seq) && fits && seq.placeholders >= 1 {
            return Ok(());
        }
        self.check_overlapped_one_slow(slot)
    }

    #[cold]
    #[inline(never)]
    fn check_overlapped_one_slow(&self, slot: usize) -> Result<()> {
        self.refuse_pending_step(slot)?;
        self.check_length_one(slot)?;
        self.check_resolve_one(slot)
    }

    /// Whether a sequence may be scheduled for the next plan (the decode steps' cases, inlined):
    /// not retiring, with no step (D = 1) or with every step in flight and fewer than
    /// `max_steps_in_flight` of them (D > 1). `refuse_pending_step_slow` says why not.
    #[inline(always)]
    fn free_for_next_step(&self, seq: &Sequence) -> bool {
        let depth = self.config.max_steps_in_flight as usize;
        let free = match seq.step() {
            None => true,
            Some(step) => step.plan != 0 && seq.num_steps() < depth,
        };
        free && seq.retiring.is_none()
    }

    /// `StepError` for a sequence already scheduled for the next plan, in as many in-flight
    /// steps as `max_steps_in_flight` allows, or preempted with steps in flight.
    #[inline]
    fn refuse_pending_step(&self, slot: usize) -> Result<()> {
        let seq = self.seq(slot);
        if self.free_for_next_step(seq) {
            return Ok(());
        }
        self.refuse_pending_step_slow(seq)
    }

    #[cold]
    #[inline(never)]
    fn refuse_pending_step_slow(&self, seq: &Sequence) -> Result<()> {
        if let Some(step) = seq.step() {
            if step.plan == 0 {
                return Err(CacheError::step(format!(
                    "sequence {} is already scheduled for the next plan: build and commit it \
                     first",
                    seq.id
                )));
            }
            let depth = self.config.max_steps_in_flight as usize;
            if seq.num_steps() >= depth {
                return Err(CacheError::step(format!(
                    "sequence {} is in {} in-flight steps, the most max_steps_in_flight = {depth} \
                     allows: commit the oldest (step {}) first",
                    seq.id,
                    seq.num_steps(),
                    seq.oldest_step().map_or(0, |s| s.plan)
                )));
            }
        }
        if seq.retiring.is_some() {
            return Err(CacheError::step(format!(
                "sequence {} was preempted with steps in flight: schedule it again once they end",
                seq.id
            )));
        }
        Ok(())
    }

    #[inline]
    fn check_schedulable(&self, slot: usize, lookahead: u32) -> Result<()> {
        self.refuse_pending_step(slot)?;
        let seq = self.seq(slot);
        if seq.planned() >= seq.num_tokens() {
            return Err(CacheError::NothingToSchedule {
                seq_id: seq.id,
                num_computed: seq.planned(),
                num_tokens: seq.num_tokens(),
            });
        }
        if lookahead > 0 {
            return self.check_lookahead(seq, lookahead);
        }
        Ok(())
    }

    /// The lookahead rules: bounded, within the sequence limit, paged groups only.
    #[cold]
    fn check_lookahead(&self, seq: &Sequence, lookahead: u32) -> Result<()> {
        if lookahead > MAX_LOOKAHEAD_TOKENS {
            return Err(CacheError::invalid(format!(
                "lookahead = {lookahead} speculative tokens is more than the supported \
                 {MAX_LOOKAHEAD_TOKENS}"
            )));
        }
        if seq.tokens.len() + lookahead as usize > MAX_SEQUENCE_TOKENS {
            return Err(CacheError::invalid(format!(
                "lookahead = {lookahead} would take sequence {} beyond {MAX_SEQUENCE_TOKENS} tokens",
                seq.id
            )));
        }
        if self.config.has_state_groups() {
            return Err(CacheError::invalid(
                "lookahead (speculative) tokens are not supported with state groups: a \
                 recurrent state cannot be rolled back past rejected drafts; use lookahead = 0",
            ));
        }
        Ok(())
    }

    /// Schedules a checked sequence. `DEEP`: the continuation's schedule is inlined (the
    /// overlapped decode step, where every sequence continues a step in flight); otherwise it
    /// is a call, which keeps the other paths as lean as they are without overlap (a
    /// choice of code only: both schedule every sequence alike).
    fn schedule_slot<const DEEP: bool>(
        &mut self,
        slot: usize,
        max_tokens: u32,
        lookahead: u32,
        exact: bool,
    ) -> Result<Option<Scheduled>> {
        let seq = self.seq(slot);
        if seq.started() {
            let end = self.chunk_end(seq.planned(), max_tokens, seq.num_tokens(), exact);
            return self.schedule_started::<DEEP>(slot, end, lookahead);
        }
        let epoch = self.store.hit_epoch();
        let last_hit = match &mut self.seq_mut(slot).phase {
            Phase::Waiting { last_hit } => last_hit.take(),
            Phase::Started => None,
        };
        let cached = match last_hit.map(|b| *b) {
            // (looked up with no plan in flight and none in flight now: the hit then depends on
            // the index and on which copies are in use or most recent alone)
            Some((at, hit, chains)) if at == epoch && self.steps.in_flight.is_empty() => {
                Some((hit, chains))
            }
            _ => None,
        };
        let seq = self.seq(slot);
        let (hit, chains) = cached.unwrap_or_else(|| self.hit_of(seq));
        let (seq_id, start, total) = (seq.id, hit.tokens, seq.num_tokens());
        let end = self.chunk_end(start, max_tokens, total, exact);
        if end <= start {
            return Ok(Some(Scheduled {
                seq_id,
                num_computed: start,
                num_tokens: 0,
                hit: Some(hit),
            }));
        }
        let admission = admission(&self.store, &self.layout, self.seq(slot), hit.tokens, chains)?;
        if !blocks_available(
            &self.store,
            &self.layout,
            self.seq(slot),
            end + lookahead,
            Some(&admission),
            false,
        ) {
            self.stats.refused_schedules += 1;
            return Ok(None);
        }
        let seq = self.table.get_mut(slot);
        let (paged, mut state) =
            take_blocks(&mut self.store, &self.layout, seq, end + lookahead, Some(&admission))?;
        if !self.layout.state.is_empty() {
            assign_running(&mut self.store, &self.layout, seq, &mut state, false)?;
        }
        let seq = self.seq_mut(slot);
        seq.hint_chains = Vec::new();
        seq.num_computed = start;
        seq.prefill_target = total;
        seq.junction = hit.junction;
        let requested = Vec::new();
        seq.phase = Phase::Started;
        seq.ring.push(StepRecord { plan: 0, start, end, first: true, paged, state, requested });
        self.steps.scheduled.push(slot);
        self.steps.scheduled_tokens += end - start;
        self.started += 1;
        self.stats.admissions += 1;
        self.stats.admitted_hit_tokens += u64::from(start);
        self.stats.admitted_tokens += u64::from(total);
        for stats in &mut self.stats.groups {
            stats.hit_tokens += u64::from(start);
        }
        for group in &hit.groups {
            if let Some(reason) = group.stop {
                self.stats.groups[group.group as usize].misses[reason.index()] += 1;
            }
        }
        if start > 0 {
            for group in &self.layout.state {
                self.stats.groups[group.index].checkpoint_hits += 1;
            }
        }
        self.stats.scheduled_tokens += u64::from(end - start);
        Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: end - start, hit: Some(hit) }))
    }

    /// `schedule_slot` of a started sequence, for its chunk up to `end`: there is no hit to
    /// pin, and when its tables already cover the chunk (most decode steps) there is nothing
    /// to allocate or check. A sequence with a step in flight (D > 1) continues it
    /// (`schedule_continuation`).
    fn schedule_started<const DEEP: bool>(
        &mut self,
        slot: usize,
        end: u32,
        lookahead: u32,
    ) -> Result<Option<Scheduled>> {
        let seq = self.seq(slot);
        if seq.step().is_some() {
            if !DEEP {
                return self.schedule_continuation_call(slot, end, lookahead);
            }
            return self.schedule_continuation(slot, end, lookahead);
        }
        let (seq_id, start) = (seq.id, seq.num_computed);
        if end <= start {
            return Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: 0, hit: None }));
        }
        let reach = end + lookahead;
        if tables_cover(&self.layout, seq, reach) {
            self.seq_mut(slot).schedule_covered(start, end);
            return Ok(Some(self.enqueued(slot, start, end)));
        }
        if !blocks_available(&self.store, &self.layout, seq, reach, None, false) {
            self.stats.refused_schedules += 1;
            return Ok(None);
        }
        let (paged, mut state) =
            take_blocks(&mut self.store, &self.layout, self.table.get_mut(slot), reach, None)?;
        // (`assign_running` without a step in flight, inlined)
        for (st, s) in state.iter_mut().zip(&self.seq(slot).state) {
            (st.write, st.read) = (s.write_block(), s.read_slot());
        }
        Ok(Some(self.enqueue_step(slot, StepRecord::later(start, end, paged, state))))
    }

    /// `schedule_started` of a sequence whose newest step is in flight (D > 1): the chunk
    /// starts where that step ends, reads the running state it writes and writes a spare
    /// running buffer (allocated when there is none).
    #[inline(always)]
    fn schedule_continuation(
        &mut self,
        slot: usize,
        end: u32,
        lookahead: u32,
    ) -> Result<Option<Scheduled>> {
        let groups = self.layout.state.len();
        if groups == 0 {
            return self.schedule_paged_continuation(slot, end, lookahead);
        }
        let seq = self.seq(slot);
        // Per state group (up to `MAX_INLINE_GROUPS`), from one look at its newest step: the
        // state it reads (what that step writes) and the spare running buffer it writes (the
        // known one unless that step writes it, `StateSeq::spare`; else a search).
        let mut spares = [NULL_BLOCK; MAX_INLINE_GROUPS];
        let mut reads = [-1i32; MAX_INLINE_GROUPS];
        // (plain loops: an `all` here was left out of line, at 75 instructions a sequence)
        let mut buffers = groups <= MAX_INLINE_GROUPS;
        let start = match seq.step() {
            Some(newest) => {
                if buffers {
                    for i in 0..groups {
                        let (write, known) = (newest.state[i].write, seq.state[i].spare);
                        reads[i] = write as i32;
                        spares[i] = if known != NULL_BLOCK && known != write {
                            known
                        } else {
                            seq.spare_buffer(i).unwrap_or(NULL_BLOCK)
                        };
                        if spares[i] == NULL_BLOCK {
                            buffers = false;
                            break;
                        }
                    }
                }
                newest.end
            }
            None => seq.num_computed, // (not a continuation: `schedule_started` checked)
        };
        let seq_id = seq.id;
        if end <= start {
            return Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: 0, hit: None }));
        }
        let reach = end + lookahead;
        if buffers && tables_cover(&self.layout, seq, reach) {
            let (spares, reads) = (&spares[..groups], &reads[..groups]);
            self.seq_mut(slot).schedule_covered_continuation(start, end, spares, reads);
            return Ok(Some(self.enqueued(slot, start, end)));
        }
        // (with a spare buffer found for every group, no further one is needed)
        if !blocks_available(&self.store, &self.layout, seq, reach, None, !buffers) {
            self.stats.refused_schedules += 1;
            return Ok(None);
        }
        let (paged, mut state) =
            take_blocks(&mut self.store, &self.layout, self.table.get_mut(slot), reach, None)?;
        let seq = self.table.get_mut(slot);
        if buffers {
            // (`assign_running` of the buffers found, inlined)
            for (i, st) in state.iter_mut().enumerate().take(groups) {
                (st.write, st.read) = (spares[i], reads[i]);
                seq.state[i].spare = NULL_BLOCK;
            }
        } else {
            assign_running(&mut self.store, &self.layout, seq, &mut state, true)?;
        }
        Ok(Some(self.enqueue_step(slot, StepRecord::later(start, end, paged, state))))
    }

    /// `schedule_continuation` without state groups: no running buffer to choose.
    #[inline(always)]
    fn schedule_paged_continuation(
        &mut self,
        slot: usize,
        end: u32,
        lookahead: u32,
    ) -> Result<Option<Scheduled>> {
        let seq = self.seq(slot);
        let (seq_id, start) = (seq.id, seq.planned());
        if end <= start {
            return Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: 0, hit: None }));
        }
        let reach = end + lookahead;
        if tables_cover(&self.layout, seq, reach) {
            self.seq_mut(slot).schedule_covered(start, end); // (the same record)
            return Ok(Some(self.enqueued(slot, start, end)));
        }
        if !blocks_available(&self.store, &self.layout, seq, reach, None, false) {
            self.stats.refused_schedules += 1;
            return Ok(None);
        }
        let (paged, state) =
            take_blocks(&mut self.store, &self.layout, self.table.get_mut(slot), reach, None)?;
        Ok(Some(self.enqueue_step(slot, StepRecord::later(start, end, paged, state))))
    }

    /// `schedule_continuation`, out of line (`schedule_slot` other than the overlapped
    /// decode step's).
    #[inline(never)]
    fn schedule_continuation_call(
        &mut self,
        slot: usize,
        end: u32,
        lookahead: u32,
    ) -> Result<Option<Scheduled>> {
        self.schedule_continuation(slot, end, lookahead)
    }

    /// Makes `step` (not a first one) the newest step of `slot`, scheduled for the next plan.
    #[inline(always)]
    fn enqueue_step(&mut self, slot: usize, step: StepRecord) -> Scheduled {
        let (start, end) = (step.start, step.end);
        self.seq_mut(slot).schedule_step(step);
        self.enqueued(slot, start, end)
    }

    /// The step of `slot` just made its newest, `[start, end)`, joins the next plan.
    #[inline(always)]
    fn enqueued(&mut self, slot: usize, start: u32, end: u32) -> Scheduled {
        let seq_id = self.seq(slot).id;
        self.steps.scheduled.push(slot);
        self.steps.scheduled_tokens += end - start;
        self.stats.scheduled_tokens += u64::from(end - start);
        Scheduled { seq_id, num_computed: start, num_tokens: end - start, hit: None }
    }

    /// Where a chunk of up to `max_tokens` from `start` ends: within what the step has left of
    /// `MAX_STEP_TOKENS`, and a non-final chunk is trimmed to a multiple of the chunk alignment
    /// unless `exact`.
    fn chunk_end(&self, start: u32, max_tokens: u32, total: u32, exact: bool) -> u32 {
        let room = MAX_STEP_TOKENS - self.steps.scheduled_tokens;
        let end = start.saturating_add(max_tokens.min(room)).min(total);
        if exact {
            end
        } else {
            self.grid.trim_chunk_end(end, total)
        }
    }

    /// `suggest_chunk` for backends that cannot export interior states (C = 0): how many tokens
    /// to schedule so the chunk ends on the next retained position within `token_budget`, where
    /// a snapshot after the step keeps the state. Without a retained position in reach, the
    /// budget itself; state groups whose kernel exports interior checkpoints (C > 0) do not
    /// cut chunks (their retained positions are exported wherever the chunk ends).
    pub fn suggest_chunk(&self, seq_id: u64, token_budget: u32) -> Result<u32> {
        let slot = self.slot(seq_id)?;
        let seq = self.seq(slot);
        let (start, target, junction) = if seq.started() {
            // With steps in flight (D > 1) the next chunk starts after the newest built one.
            let built = seq.steps().filter(|s| s.plan != 0).last().map(|s| s.end);
            let start = built.filter(|_| self.config.max_steps_in_flight > 1);
            (start.unwrap_or(seq.num_computed), seq.prefill_target, seq.junction)
        } else {
            let hit = self.hit_of(seq).0;
            (hit.tokens, seq.num_tokens(), hit.junction)
        };
        let remaining = seq.num_tokens().saturating_sub(start);
        let budget = token_budget.min(remaining);
        let reach = start + budget;
        let mut best: Option<u32> = None;
        for group in &self.layout.state {
            let config = &group.config;
            if config.max_checkpoints_per_step != Some(0) {
                continue;
            }
            let retained = config.retention.retained(self.unit, target, junction);
            if let Some(p) = retained.earliest_in(start, reach) {
                if best.is_none_or(|b| p < b) {
                    best = Some(p);
                }
            }
        }
        Ok(best.map_or(budget, |p| p - start))
    }
}
