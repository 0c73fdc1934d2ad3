//! `schedule`: admitting a sequence at its hit and giving it the blocks of its next chunk.
//!
//! The first schedule of a sequence runs the lookup again, pins the hit (reference counts are
//! taken before anything is allocated, so this call cannot evict its own hit) and starts from
//! it. Every schedule is atomic: when a pool cannot supply the blocks the sequence itself needs
//! (paged blocks, copy-on-write destination, running-state buffers) it returns `None` and
//! changes nothing but a counter. Checkpoint blocks are chosen later, by `build_plan`, and never
//! make a schedule fail.

use crate::config::GroupRuntime;
use crate::error::{CacheError, Result};
use crate::hit::{choose_block, Hit};
use crate::limits::{MAX_LOOKAHEAD_TOKENS, MAX_SEQUENCE_TOKENS, MAX_STEP_TOKENS};
use crate::manager::{check_batch_len, CacheManager};
use crate::plan::StepPlan;
use crate::pool::{BlockId, BlockKind, NULL_BLOCK};
use crate::sequence::{GroupStep, PagedSeq, SeqGroup, Sequence, StateSeq, StepRecord};

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

/// How a sequence's first step uses its hit in one group.
struct GroupAdmission {
    /// Table entries (null outside a sliding window).
    table: Vec<u32>,
    /// Copy-on-write source and tokens to copy.
    cow: Option<(u32, u32)>,
    /// The checkpoint resumed from (state groups).
    resume: u32,
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
        self.refuse_in_flight("schedule")?;
        let slot = self.slot(seq_id)?;
        self.check_schedulable(slot, lookahead)?;
        self.schedule_slot(slot, max_tokens, lookahead, exact)
    }

    /// `schedule` for many sequences (one crossing from Python). Every id is checked before
    /// anything is scheduled; results are in input order.
    pub fn schedule_batch(
        &mut self,
        seq_ids: &[u64],
        max_tokens: &[u32],
        exact: bool,
    ) -> Result<Vec<Option<Scheduled>>> {
        self.refuse_in_flight("schedule")?;
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
        self.refuse_repeats(&slots, "schedule_batch")?;
        slots
            .into_iter()
            .zip(max_tokens)
            .map(|(slot, &budget)| self.schedule_slot(slot, budget, 0, exact))
            .collect()
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
        self.refuse_in_flight("decode_step")?;
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
        self.refuse_repeats(&slots, "decode_step")?;
        for (&slot, token) in slots.iter().zip(tokens) {
            self.append_slot(slot, std::slice::from_ref(token))?;
        }
        let scheduled = slots
            .into_iter()
            .map(|slot| self.schedule_slot(slot, 1, 0, false))
            .collect::<Result<_>>()?;
        self.build_plan_into(plan)?;
        Ok(scheduled)
    }

    /// `StepError` naming a sequence that appears twice in one `call`: each slot is stamped
    /// with the call's number, in one pass, without sorting or copying the batch.
    pub(crate) fn refuse_repeats(&mut self, slots: &[usize], call: &str) -> Result<()> {
        self.batch_stamp += 1;
        let stamp = self.batch_stamp;
        if self.batch_marks.len() < self.seqs.len() {
            self.batch_marks.resize(self.seqs.len(), 0);
        }
        for &slot in slots {
            let mark = &mut self.batch_marks[slot];
            if *mark == stamp {
                let id = self.seq(slot).id;
                return Err(CacheError::step(format!(
                    "sequence {id} appears twice in one {call}: give each sequence once (several \
                     tokens of one sequence go in one append call)"
                )));
            }
            *mark = stamp;
        }
        Ok(())
    }

    /// `StepError` for a sequence already scheduled for the next plan.
    fn refuse_pending_step(&self, slot: usize) -> Result<()> {
        let seq = self.seq(slot);
        if seq.step.is_some() {
            return Err(CacheError::step(format!(
                "sequence {} is already scheduled for the next plan: build and commit it first",
                seq.id
            )));
        }
        Ok(())
    }

    #[inline]
    fn check_schedulable(&self, slot: usize, lookahead: u32) -> Result<()> {
        self.refuse_pending_step(slot)?;
        let seq = self.seq(slot);
        if seq.num_computed >= seq.num_tokens() {
            return Err(CacheError::NothingToSchedule {
                seq_id: seq.id,
                num_computed: seq.num_computed,
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

    fn schedule_slot(
        &mut self,
        slot: usize,
        max_tokens: u32,
        lookahead: u32,
        exact: bool,
    ) -> Result<Option<Scheduled>> {
        let seq = self.seq(slot);
        if seq.started {
            let end = self.chunk_end(seq.num_computed, max_tokens, seq.num_tokens(), exact);
            return self.schedule_started(slot, end, lookahead);
        }
        let generation = self.store.index.generation();
        let cached = match self.seq_mut(slot).last_hit.take() {
            Some((at, hit, chains)) if at == generation => Some((hit, chains)),
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
        let admissions = self.admissions(slot, hit.tokens, chains);
        if !self.blocks_available(slot, end + lookahead, Some(&admissions)) {
            self.stats.refused_schedules += 1;
            return Ok(None);
        }
        let groups = self.take_blocks(slot, end + lookahead, Some(admissions))?;
        let seq = self.seq_mut(slot);
        seq.hint_chains = Vec::new();
        seq.started = true;
        seq.num_computed = start;
        seq.prefill_target = total;
        seq.junction = hit.junction;
        seq.step = Some(StepRecord { start, end, first: true, groups, requested: Vec::new() });
        self.scheduled.push(slot);
        self.scheduled_tokens += end - start;
        self.started += 1;
        self.stats.admissions += 1;
        self.stats.admitted_hit_tokens += u64::from(start);
        for (g, stats) in self.stats.groups.iter_mut().enumerate() {
            stats.hit_tokens += u64::from(start);
            if start > 0 && matches!(self.groups[g], GroupRuntime::State { .. }) {
                stats.checkpoint_hits += 1;
            }
        }
        self.stats.scheduled_tokens += u64::from(end - start);
        Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: end - start, hit: Some(hit) }))
    }

    /// `schedule_slot` of a started sequence, for its chunk up to `end`: there is no hit to
    /// pin, and when its tables already cover the chunk (most decode steps) there is nothing
    /// to allocate or check.
    fn schedule_started(
        &mut self,
        slot: usize,
        end: u32,
        lookahead: u32,
    ) -> Result<Option<Scheduled>> {
        let seq = self.seq_mut(slot);
        seq.last_hit = None;
        let (seq_id, start) = (seq.id, seq.num_computed);
        if end <= start {
            return Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: 0, hit: None }));
        }
        let reach = end + lookahead;
        let groups = if self.tables_cover(slot, reach) {
            // What `take_blocks` returns when every table covers the chunk, without its
            // per-group block arithmetic (10.2K against 9.1K instructions a hybrid decode
            // step by `baseline hybrid N`).
            let (runtimes, seq) = (&self.groups, self.seqs[slot].as_mut());
            let Some(seq) = seq else { unreachable!("slot {slot} is not live") };
            let mut steps = std::mem::take(&mut seq.spare_step);
            steps.extend(runtimes.iter().zip(&seq.groups).map(|(runtime, group)| {
                match (runtime.block_size(), group) {
                    (Some(_), SeqGroup::Paged(paged)) => {
                        GroupStep::Paged { table_len_before: paged.table.len(), cow: None }
                    }
                    _ => GroupStep::State { interior: Vec::new(), snapshot: None },
                }
            }));
            steps
        } else {
            if !self.blocks_available(slot, reach, None) {
                self.stats.refused_schedules += 1;
                return Ok(None);
            }
            self.take_blocks(slot, reach, None)?
        };
        self.seq_mut(slot).step =
            Some(StepRecord { start, end, first: false, groups, requested: Vec::new() });
        self.scheduled.push(slot);
        self.scheduled_tokens += end - start;
        self.stats.scheduled_tokens += u64::from(end - start);
        Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: end - start, hit: None }))
    }

    /// Whether every paged table of a started sequence already has the blocks for tokens
    /// `[0, reach)`.
    fn tables_cover(&self, slot: usize, reach: u32) -> bool {
        let seq = self.seq(slot);
        self.groups.iter().zip(&seq.groups).all(|(runtime, group)| {
            match (runtime.block_size(), group) {
                (Some(block), SeqGroup::Paged(paged)) => {
                    paged.table.len() as u64 * u64::from(block) >= u64::from(reach)
                }
                (Some(_), SeqGroup::State(_)) => false,
                (None, _) => true,
            }
        })
    }

    /// Where a chunk of up to `max_tokens` from `start` ends: within what the step has left of
    /// `MAX_STEP_TOKENS`, and a non-final chunk is trimmed to a multiple of the chunk alignment
    /// unless `exact`.
    fn chunk_end(&self, start: u32, max_tokens: u32, total: u32, exact: bool) -> u32 {
        let room = MAX_STEP_TOKENS - self.scheduled_tokens;
        let end = start.saturating_add(max_tokens.min(room)).min(total);
        if exact {
            end
        } else {
            self.grid.trim_chunk_end(end, total)
        }
    }

    /// Which published blocks a first step uses, per group, for a hit of `hit` tokens.
    /// `chains` are the full-attention blocks the hit's lookup chose (possibly empty).
    fn admissions(
        &self,
        slot: usize,
        hit: u32,
        mut chains: Vec<Vec<BlockId>>,
    ) -> Vec<GroupAdmission> {
        let seq = self.seq(slot);
        self.groups
            .iter()
            .enumerate()
            .map(|(g, runtime)| {
                let gid = g as u32;
                match *runtime {
                    GroupRuntime::FullAttention { block_size, .. }
                    | GroupRuntime::SlidingWindow { block_size, .. } => {
                        let first_col = match *runtime {
                            GroupRuntime::SlidingWindow { window, .. } => {
                                hit.saturating_sub(window) / block_size
                            }
                            _ => 0,
                        };
                        let full = hit / block_size;
                        let chain = chains.get_mut(g).map(std::mem::take).unwrap_or_default();
                        let table = if first_col == 0 && chain.len() >= full as usize {
                            let mut chain = chain;
                            chain.truncate(full as usize);
                            chain
                        } else {
                            (0..full)
                                .map(|c| {
                                    if c < first_col {
                                        NULL_BLOCK
                                    } else {
                                        choose_block(
                                            &self.store,
                                            seq.content(),
                                            gid,
                                            (c + 1) * block_size,
                                        )
                                    }
                                })
                                .collect()
                        };
                        let cow = (hit % block_size != 0).then(|| {
                            (choose_block(&self.store, seq.content(), gid, hit), hit % block_size)
                        });
                        GroupAdmission { table, cow, resume: NULL_BLOCK }
                    }
                    GroupRuntime::State { .. } => GroupAdmission {
                        table: Vec::new(),
                        cow: None,
                        resume: if hit > 0 {
                            choose_block(&self.store, seq.content(), gid, hit)
                        } else {
                            0
                        },
                    },
                }
            })
            .collect()
    }

    /// Whether every pool can supply the new blocks this chunk needs, counting the cached
    /// blocks the hit is about to pin as unavailable.
    fn blocks_available(
        &self,
        slot: usize,
        end: u32,
        admissions: Option<&[GroupAdmission]>,
    ) -> bool {
        let seq = self.seq(slot);
        (0..self.store.pools.len()).all(|pool| {
            let mut need = 0u64;
            for (g, runtime) in self.groups.iter().enumerate() {
                if runtime.pool() != pool {
                    continue;
                }
                let admission = admissions.map(|a| &a[g]);
                if let Some(a) = admission {
                    let p = &self.store.pools[pool];
                    let cached = a
                        .table
                        .iter()
                        .chain(a.cow.as_ref().map(|(src, _)| src))
                        .chain(std::iter::once(&a.resume))
                        .filter(|&&b| b != NULL_BLOCK && p.is_cached(b))
                        .count();
                    // Pinning takes these out of the evictable set.
                    need += cached as u64;
                }
                match (runtime.block_size(), &seq.groups[g]) {
                    (Some(block), SeqGroup::Paged(paged)) => {
                        let cols = end.div_ceil(block) as usize;
                        let have = admission.map_or(paged.table.len(), |a| a.table.len());
                        need += cols.saturating_sub(have) as u64;
                    }
                    _ if admission.is_some() => need += 2,
                    _ => {}
                }
            }
            need <= u64::from(self.store.pools[pool].num_available())
        })
    }

    /// One block the capacity check (`blocks_available`) promised: its absence is a bug in the
    /// core, reported as an invariant error rather than a null block in a plan.
    fn take_block(&mut self, pool: usize, kind: BlockKind, g: usize) -> Result<BlockId> {
        self.store.allocate(pool, kind, g as u32).ok_or_else(|| {
            CacheError::invariant(format!(
                "pool {pool} could not supply a {kind:?} block for group {g} after its capacity \
                 check promised it"
            ))
        })
    }

    /// Pins the hit and allocates the chunk's blocks; only called once `blocks_available`.
    fn take_blocks(
        &mut self,
        slot: usize,
        end: u32,
        admissions: Option<Vec<GroupAdmission>>,
    ) -> Result<Vec<GroupStep>> {
        let mut steps = std::mem::take(&mut self.seq_mut(slot).spare_step);
        steps.reserve(self.groups.len());
        // Every group's hit is pinned before any group allocates: groups may share a pool, and
        // an allocation must not evict a block another group is about to resume from.
        for (g, a) in admissions.iter().flatten().enumerate() {
            let pool = self.groups[g].pool();
            let cow_src = a.cow.map(|(src, _)| src);
            for &b in a.table.iter().chain([&a.resume]).chain(cow_src.as_ref()) {
                self.store.pools[pool].incref(b);
                self.store.pools[pool].touch(b);
            }
        }
        let mut admissions = admissions.map(Vec::into_iter);
        for g in 0..self.groups.len() {
            let pool = self.groups[g].pool();
            let admission = admissions.as_mut().and_then(Iterator::next);
            let step = if let Some(block) = self.groups[g].block_size() {
                let cols = end.div_ceil(block) as usize;
                if admission.is_none() {
                    // A running sequence whose table already covers the chunk (most decode
                    // steps): nothing to allocate, so its table stays where it is.
                    if let SeqGroup::Paged(paged) = &self.seq(slot).groups[g] {
                        if paged.table.len() >= cols {
                            let table_len_before = paged.table.len();
                            steps.push(GroupStep::Paged { table_len_before, cow: None });
                            continue;
                        }
                    }
                }
                {
                    let mut paged = match (&admission, &mut self.seq_mut(slot).groups[g]) {
                        (Some(a), _) => PagedSeq {
                            window_start: a.table.iter().take_while(|&&b| b == 0).count(),
                            table: a.table.clone(),
                            window_reported: 0,
                        },
                        (None, SeqGroup::Paged(p)) => std::mem::take(p),
                        (None, SeqGroup::State(_)) => PagedSeq::default(),
                    };
                    let table_len_before = if admission.is_some() { 0 } else { paged.table.len() };
                    let mut cow = None;
                    if let Some((src, tokens)) = admission.as_ref().and_then(|a| a.cow) {
                        let dst = self.take_block(pool, BlockKind::Paged, g)?;
                        paged.table.push(dst);
                        cow = Some((src, dst, tokens));
                    }
                    while paged.table.len() < cols {
                        let b = self.take_block(pool, BlockKind::Paged, g)?;
                        paged.table.push(b);
                    }
                    self.seq_mut(slot).groups[g] = SeqGroup::Paged(paged);
                    GroupStep::Paged { table_len_before, cow }
                }
            } else {
                {
                    if let Some(a) = &admission {
                        let r0 = self.take_block(pool, BlockKind::Running, g)?;
                        let r1 = self.take_block(pool, BlockKind::Running, g)?;
                        self.seq_mut(slot).groups[g] = SeqGroup::State(StateSeq {
                            running: [r0, r1],
                            current: None,
                            resume: a.resume,
                            decode_tail: None,
                        });
                    }
                    GroupStep::State { interior: Vec::new(), snapshot: None }
                }
            };
            steps.push(step);
        }
        Ok(steps)
    }

    /// `suggest_chunk` for backends that cannot export interior states (C = 0): how many tokens
    /// to schedule so the chunk ends on the next retained position within `token_budget`, where
    /// a snapshot after the step keeps the state. Without a retained position in reach, the
    /// budget itself; state groups whose kernel exports interior checkpoints (C > 0) do not
    /// cut chunks (their retained positions are exported wherever the chunk ends).
    pub fn suggest_chunk(&self, seq_id: u64, token_budget: u32) -> Result<u32> {
        let slot = self.slot(seq_id)?;
        let seq = self.seq(slot);
        let (start, target, junction) = if seq.started {
            (seq.num_computed, seq.prefill_target, seq.junction)
        } else {
            let hit = self.hit_of(seq).0;
            (hit.tokens, seq.num_tokens(), hit.junction)
        };
        let remaining = seq.num_tokens().saturating_sub(start);
        let budget = token_budget.min(remaining);
        let reach = start + budget;
        let mut best: Option<u32> = None;
        for runtime in &self.groups {
            let GroupRuntime::State { config, .. } = runtime else {
                continue;
            };
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
