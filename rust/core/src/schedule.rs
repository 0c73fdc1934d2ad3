//! `schedule`: admitting a sequence at its hit and giving it the blocks of its next chunk.
//!
//! The first schedule of a sequence runs the lookup again, pins the hit (reference counts are
//! taken before anything is allocated, so this call cannot evict its own hit) and starts from
//! it. Every schedule is atomic: when a pool cannot supply the blocks the sequence itself needs
//! (paged blocks, copy-on-write destination, running-state buffers) it returns `None` and
//! changes nothing but a counter. Checkpoint blocks are chosen later, by `build_plan`, and never
//! make a schedule fail.

use crate::config::GroupSlot;
use crate::error::{CacheError, Result};
use crate::hit::{choose_block, Hit};
use crate::limits::{MAX_LOOKAHEAD_TOKENS, MAX_SEQUENCE_TOKENS, MAX_STEP_TOKENS};
use crate::manager::{check_batch_len, CacheManager};
use crate::plan::StepPlan;
use crate::pool::{BlockId, BlockKind, NULL_BLOCK};
use crate::sequence::{PagedSeq, PagedStep, Phase, Sequence, StateSeq, StateStep, StepRecord};

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

/// How a sequence's first step uses its hit in one paged group.
struct PagedAdmission {
    /// Table entries (null outside a sliding window).
    table: Vec<BlockId>,
    /// Copy-on-write source and tokens to copy.
    cow: Option<(BlockId, u32)>,
}

/// How a sequence's first step uses its hit: per paged group of the layout its table, per
/// state group the checkpoint resumed from (the null block: the zero state).
struct Admission {
    paged: Vec<PagedAdmission>,
    resume: Vec<BlockId>,
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
        self.table.refuse_repeats(&slots, "schedule_batch")?;
        // Collected from an exactly sized iterator (a `collect::<Result<_>>` is not one); an
        // error, a bug in the core (see `take_block`), is returned once the batch is through.
        let mut failure = None;
        let out = slots
            .into_iter()
            .zip(max_tokens)
            .map(|(slot, &budget)| {
                self.schedule_slot(slot, budget, 0, exact).unwrap_or_else(|e| {
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
        self.table.refuse_repeats(&slots, "decode_step")?;
        for (&slot, token) in slots.iter().zip(tokens) {
            self.append_slot(slot, std::slice::from_ref(token))?;
        }
        let mut failure = None;
        let scheduled = slots
            .into_iter()
            .map(|slot| {
                self.schedule_slot(slot, 1, 0, false).unwrap_or_else(|e| {
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

    /// `StepError` for a sequence already scheduled for the next plan.
    fn refuse_pending_step(&self, slot: usize) -> Result<()> {
        let seq = self.seq(slot);
        if seq.step().is_some() {
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
        if seq.started() {
            let end = self.chunk_end(seq.num_computed, max_tokens, seq.num_tokens(), exact);
            return self.schedule_started(slot, end, lookahead);
        }
        let generation = self.store.index.generation();
        let last_hit = match &mut self.seq_mut(slot).phase {
            Phase::Waiting { last_hit } => last_hit.take(),
            _ => None,
        };
        let cached = match last_hit {
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
        let (paged, state) = self.take_blocks(slot, end + lookahead, Some(&admissions))?;
        let seq = self.seq_mut(slot);
        seq.hint_chains = Vec::new();
        seq.num_computed = start;
        seq.prefill_target = total;
        seq.junction = hit.junction;
        let requested = Vec::new();
        seq.phase =
            Phase::Scheduled(StepRecord { start, end, first: true, paged, state, requested });
        self.scheduled.push(slot);
        self.scheduled_tokens += end - start;
        self.started += 1;
        self.stats.admissions += 1;
        self.stats.admitted_hit_tokens += u64::from(start);
        for stats in &mut self.stats.groups {
            stats.hit_tokens += u64::from(start);
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
    /// to allocate or check.
    fn schedule_started(
        &mut self,
        slot: usize,
        end: u32,
        lookahead: u32,
    ) -> Result<Option<Scheduled>> {
        let seq = self.seq(slot);
        let (seq_id, start) = (seq.id, seq.num_computed);
        if end <= start {
            return Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: 0, hit: None }));
        }
        let reach = end + lookahead;
        let (paged, state) = if self.tables_cover(slot, reach) {
            // What `take_blocks` returns when every table covers the chunk, without its
            // per-group block arithmetic (10.2K against 9.1K instructions a hybrid decode
            // step by `baseline hybrid N`).
            let seq = self.seq_mut(slot);
            let mut paged = std::mem::take(&mut seq.spare_paged);
            let mut state = std::mem::take(&mut seq.spare_state);
            paged.extend(
                seq.paged.iter().map(|p| PagedStep { table_len_before: p.table.len(), cow: None }),
            );
            state.resize_with(seq.state.len(), StateStep::default);
            (paged, state)
        } else {
            if !self.blocks_available(slot, reach, None) {
                self.stats.refused_schedules += 1;
                return Ok(None);
            }
            self.take_blocks(slot, reach, None)?
        };
        let requested = Vec::new();
        self.seq_mut(slot).schedule_step(StepRecord {
            start,
            end,
            first: false,
            paged,
            state,
            requested,
        });
        self.scheduled.push(slot);
        self.scheduled_tokens += end - start;
        self.stats.scheduled_tokens += u64::from(end - start);
        Ok(Some(Scheduled { seq_id, num_computed: start, num_tokens: end - start, hit: None }))
    }

    /// Whether every paged table of a started sequence already has the blocks for tokens
    /// `[0, reach)`.
    fn tables_cover(&self, slot: usize, reach: u32) -> bool {
        let seq = self.seq(slot);
        self.layout.paged.iter().zip(&seq.paged).all(|(group, paged)| {
            paged.table.len() as u64 * u64::from(group.block_size) >= u64::from(reach)
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
    fn admissions(&self, slot: usize, hit: u32, mut chains: Vec<Vec<BlockId>>) -> Admission {
        let seq = self.seq(slot).content();
        let paged = self
            .layout
            .paged
            .iter()
            .map(|group| {
                let (gid, block_size) = (group.index as u32, group.block_size);
                let first_col = group.window.map_or(0, |w| hit.saturating_sub(w) / block_size);
                let full = hit / block_size;
                let chain = chains.get_mut(group.index).map(std::mem::take).unwrap_or_default();
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
                                choose_block(&self.store, seq, gid, (c + 1) * block_size)
                            }
                        })
                        .collect()
                };
                let cow = (hit % block_size != 0)
                    .then(|| (choose_block(&self.store, seq, gid, hit), hit % block_size));
                PagedAdmission { table, cow }
            })
            .collect();
        let resume = self
            .layout
            .state
            .iter()
            .map(|group| {
                if hit > 0 {
                    choose_block(&self.store, seq, group.index as u32, hit)
                } else {
                    NULL_BLOCK
                }
            })
            .collect();
        Admission { paged, resume }
    }

    /// Whether every pool can supply the new blocks this chunk needs, counting the cached
    /// blocks the hit is about to pin as unavailable.
    fn blocks_available(&self, slot: usize, end: u32, admission: Option<&Admission>) -> bool {
        let seq = self.seq(slot);
        (0..self.store.pools.len()).all(|pool| {
            let p = &self.store.pools[pool];
            let cached = |b: &BlockId| *b != NULL_BLOCK && p.is_cached(*b);
            let mut need = 0u64;
            for (i, group) in self.layout.paged.iter().enumerate().filter(|(_, g)| g.pool == pool) {
                let cols = end.div_ceil(group.block_size) as usize;
                let have = match admission {
                    Some(a) => {
                        let a = &a.paged[i];
                        // Pinning takes these out of the evictable set.
                        let src = a.cow.as_ref().map(|(src, _)| src);
                        need += a.table.iter().chain(src).filter(|b| cached(b)).count() as u64;
                        a.table.len()
                    }
                    None => seq.paged[i].table.len(),
                };
                need += cols.saturating_sub(have) as u64;
            }
            if let Some(a) = admission {
                for (i, _) in self.layout.state.iter().enumerate().filter(|(_, g)| g.pool == pool) {
                    // The resume pin, and the two running buffers.
                    need += u64::from(cached(&a.resume[i])) + 2;
                }
            }
            need <= u64::from(p.num_available())
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

    /// Pins the hit and allocates the chunk's blocks, group by group in config order; only
    /// called once `blocks_available`. Returns the step's part of each paged and state group.
    fn take_blocks(
        &mut self,
        slot: usize,
        end: u32,
        admission: Option<&Admission>,
    ) -> Result<(Vec<PagedStep>, Vec<StateStep>)> {
        let seq = self.seq_mut(slot);
        let mut paged_steps = std::mem::take(&mut seq.spare_paged);
        let mut state_steps = std::mem::take(&mut seq.spare_state);
        // Every group's hit is pinned before any group allocates: groups may share a pool, and
        // an allocation must not evict a block another group is about to resume from.
        if let Some(a) = admission {
            for (g, group) in self.layout.slots.iter().enumerate() {
                let pool = &mut self.store.pools[self.layout.pool_of[g]];
                let mut pin = |b: BlockId| {
                    pool.incref(b);
                    pool.touch(b);
                };
                match *group {
                    GroupSlot::Paged(i) => {
                        let a = &a.paged[i];
                        a.table.iter().copied().for_each(&mut pin);
                        // (the null resume of a paged group: it advances the pool's clock)
                        pin(NULL_BLOCK);
                        a.cow.iter().for_each(|&(src, _)| pin(src));
                    }
                    GroupSlot::State(i) => pin(a.resume[i]),
                }
            }
        }
        for g in 0..self.layout.len() {
            let pool = self.layout.pool(g);
            match self.layout.slots[g] {
                GroupSlot::Paged(i) => {
                    let cols = end.div_ceil(self.layout.paged[i].block_size) as usize;
                    let seq = self.seq_mut(slot);
                    let Some(a) = admission else {
                        if seq.paged[i].table.len() >= cols {
                            // A running sequence whose table already covers the chunk (most
                            // decode steps): nothing to allocate, so its table stays.
                            let table_len_before = seq.paged[i].table.len();
                            paged_steps.push(PagedStep { table_len_before, cow: None });
                            continue;
                        }
                        let mut paged = std::mem::take(&mut seq.paged[i]);
                        let table_len_before = paged.table.len();
                        while paged.table.len() < cols {
                            paged.table.push(self.take_block(pool, BlockKind::Paged, g)?);
                        }
                        self.seq_mut(slot).paged[i] = paged;
                        paged_steps.push(PagedStep { table_len_before, cow: None });
                        continue;
                    };
                    let a = &a.paged[i];
                    let mut paged = PagedSeq {
                        window_start: a.table.iter().take_while(|&&b| b == NULL_BLOCK).count(),
                        table: a.table.clone(),
                        window_reported: 0,
                    };
                    let mut cow = None;
                    if let Some((src, tokens)) = a.cow {
                        let dst = self.take_block(pool, BlockKind::Paged, g)?;
                        paged.table.push(dst);
                        cow = Some((src, dst, tokens));
                    }
                    while paged.table.len() < cols {
                        paged.table.push(self.take_block(pool, BlockKind::Paged, g)?);
                    }
                    self.seq_mut(slot).paged[i] = paged;
                    paged_steps.push(PagedStep { table_len_before: 0, cow });
                }
                GroupSlot::State(i) => {
                    if let Some(a) = admission {
                        let r0 = self.take_block(pool, BlockKind::Running, g)?;
                        let r1 = self.take_block(pool, BlockKind::Running, g)?;
                        self.seq_mut(slot).state[i] = StateSeq {
                            running: [r0, r1],
                            current: None,
                            resume: a.resume[i],
                            decode_tail: None,
                        };
                    }
                    state_steps.push(StateStep::default());
                }
            }
        }
        Ok((paged_steps, state_steps))
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
            (seq.num_computed, seq.prefill_target, seq.junction)
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
