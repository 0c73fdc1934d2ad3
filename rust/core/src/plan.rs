//! `build_plan`: everything the kernels need for one step, and the checkpoint selection.
//!
//! The plan is plain contiguous vectors (row-major where two-dimensional), ready to be moved
//! into `NumPy` without copying. Per paged group it carries only what changed in the block tables
//! (appended and replaced entries), so a decode step costs O(sequences), not O(context).
//!
//! Checkpoints (per state group, per scheduled sequence, chunk `[qs, qe)`): the retained
//! positions p with `qs < p <= qe` (explicit requests, then tail, junction, intervals latest
//! first), minus those already published for this prefix. `p == qe` is served by a snapshot
//! copy after the step (exempt from the alignment A, not counted against C); interior positions
//! need `(p - qs) % A == 0` and at most C are taken. Decode steps keep only a decode-tail
//! snapshot at `qe` when it is a unit boundary. Every position not served is counted with its
//! reason and gets no block and no key.

use crate::config::GroupLayout;
use crate::config::{is_exportable_offset, Retained, StateGroupConfig};
use crate::error::{CacheError, Result};
use crate::hit::has_key;
use crate::limits::human_bytes;
use crate::manager::{CacheManager, InFlight};
use crate::pool::{BlockId, BlockKind, NULL_BLOCK};
use crate::sequence::{PagedSeq, PlannedCheckpoint, StateStep};
use crate::stats::SkipReason;

/// Per paged group: what changed in the block tables, and where this step's KV goes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PagedGroupPlan {
    pub group: u32,
    /// `[M, 3]` rows `(row, column, block)`: entries appended to the sequences' tables.
    pub appended: Vec<i32>,
    /// `[M', 3]` rows `(row, column, block)`: entries replaced (sliding-window releases -> 0).
    pub replaced: Vec<i32>,
    /// `[T]` slot `block * B + offset` of each scheduled token.
    pub slot_mapping: Vec<i64>,
}

/// Per state group: which slots the kernels read and write.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateGroupPlan {
    pub group: u32,
    /// `[R]` the running buffer written by this step.
    pub running_slot: Vec<i32>,
    /// `[R]` the state read (-1 = zero state); never equal to `running_slot`.
    pub initial_slot: Vec<i32>,
    /// Cmax: the most interior checkpoints any row has this step.
    pub max_checkpoints: usize,
    /// `[R, Cmax]` offsets from the row's query start (0 = none).
    pub checkpoint_offsets: Vec<i32>,
    /// `[R, Cmax]` destination slots (-1 = none).
    pub checkpoint_slots: Vec<i32>,
    /// `[S, 2]` rows `(running block, checkpoint block)` copied after the forward.
    pub snapshots: Vec<i32>,
}

/// Everything the kernels need for one step. R = scheduled sequences, T = scheduled tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub step_id: u64,
    /// The manager that built the plan (`commit` and `abort` refuse another manager's plan).
    pub manager: u64,
    pub seq_ids: Vec<u64>,
    /// `[R + 1]`
    pub query_start_loc: Vec<i32>,
    /// `[R]` tokens computed before this step.
    pub num_computed: Vec<i32>,
    /// `[R]`
    pub num_scheduled: Vec<i32>,
    pub paged: Vec<PagedGroupPlan>,
    pub state: Vec<StateGroupPlan>,
    /// `[K, 4]` rows `(group, src_block, dst_block, num_tokens)`, run before the forward.
    pub copies: Vec<i64>,
}

impl StepPlan {
    /// Empties every vector (keeping its memory) and lays out one part per group.
    fn clear_for(&mut self, manager: u64, step_id: u64, layout: &GroupLayout) {
        self.manager = manager;
        self.step_id = step_id;
        self.seq_ids.clear();
        self.query_start_loc.clear();
        self.num_computed.clear();
        self.num_scheduled.clear();
        self.copies.clear();
        let paged = layout.paged.iter().map(|p| p.index);
        let state = layout.state.iter().map(|s| s.index);
        if !self.paged.iter().map(|p| p.group as usize).eq(paged.clone()) {
            self.paged = paged
                .map(|g| PagedGroupPlan { group: g as u32, ..PagedGroupPlan::default() })
                .collect();
        }
        if !self.state.iter().map(|s| s.group as usize).eq(state.clone()) {
            self.state = state
                .map(|g| StateGroupPlan { group: g as u32, ..StateGroupPlan::default() })
                .collect();
        }
        for p in &mut self.paged {
            p.appended.clear();
            p.replaced.clear();
            p.slot_mapping.clear();
        }
        for s in &mut self.state {
            s.running_slot.clear();
            s.initial_slot.clear();
            s.max_checkpoints = 0;
            s.checkpoint_offsets.clear();
            s.checkpoint_slots.clear();
            s.snapshots.clear();
        }
    }

    #[must_use]
    pub fn num_rows(&self) -> usize {
        self.seq_ids.len()
    }

    #[must_use]
    pub fn num_tokens(&self) -> usize {
        self.query_start_loc.last().map_or(0, |&t| t as usize)
    }
}

/// The explicitly wanted positions of a prefill chunk `(start, end]`, in priority order,
/// without duplicates: requests, then the retained ones (tail, junction). Interval positions
/// come after them, generated by the caller (`Retained::intervals`).
fn explicit_candidates(requested: &[u32], retained: Retained, start: u32, end: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::with_capacity(requested.len() + 2);
    for p in requested.iter().copied().chain(retained.explicit()) {
        if p > start && p <= end && !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// Where one row of a paged group sits in the plan.
struct PagedRows {
    row: usize,
    start: u32,
    end: u32,
    first: bool,
}

/// Appends one sequence's table changes and slot mapping to a paged group's plan.
fn emit_paged(
    out: &mut PagedGroupPlan,
    paged: &PagedSeq,
    table_len_before: usize,
    block: u32,
    rows: &PagedRows,
) {
    let row = rows.row as i32;
    for (col, &b) in paged.table.iter().enumerate().skip(table_len_before) {
        out.appended.extend([row, col as i32, b as i32]);
    }
    if !rows.first {
        // Sliding-window releases since the last plan (a first step appends them as nulls).
        for col in paged.window_reported..paged.window_start {
            out.replaced.extend([row, col as i32, NULL_BLOCK as i32]);
        }
    }
    // One run of consecutive slots per block: a division per block, not per token.
    out.slot_mapping.reserve((rows.end - rows.start) as usize);
    let mut pos = rows.start;
    while pos < rows.end {
        let col = pos / block;
        let run_end = ((col + 1) * block).min(rows.end);
        let first =
            i64::from(paged.table[col as usize]) * i64::from(block) + i64::from(pos % block);
        out.slot_mapping.extend(first..first + i64::from(run_end - pos));
        pos = run_end;
    }
}

impl CacheManager {
    /// Asks for a checkpoint at `position` in the chunk scheduled for the next plan, on top of
    /// the retention policy (it is considered first). Raises `Alignment` for a position the
    /// kernel cannot write.
    pub fn request_checkpoint(&mut self, seq_id: u64, position: u32) -> Result<()> {
        self.refuse_in_flight("request_checkpoint")?;
        let slot = self.slot(seq_id)?;
        let seq = self.seq(slot);
        let Some(step) = seq.step() else {
            return Err(CacheError::step(format!(
                "sequence {seq_id} is not scheduled: request checkpoints between schedule and \
                 build_plan"
            )));
        };
        let (start, end) = (step.start, step.end);
        if self.layout.state.is_empty() {
            return Err(CacheError::invalid("no state group: there is nothing to checkpoint"));
        }
        let grid = self.grid;
        if grid.accepts(position, start, end) {
            let step = self.seq_mut(slot).step_mut().ok_or_else(|| CacheError::step("no step"))?;
            if !step.requested.contains(&position) {
                step.requested.push(position);
            }
            return Ok(());
        }
        let (unit, alignment) = (grid.unit, grid.alignment);
        let (count, near) = grid.nearest_positions(position, start, end);
        let describe = |p: u32| {
            if p == end {
                format!("{p} (the chunk end, served by a snapshot)")
            } else {
                p.to_string()
            }
        };
        let valid = if count == 0 {
            format!(
                "no position in chunk [{start}, {end}) can hold a checkpoint: positions must be \
                 multiples of the hash unit {unit} at offsets that are multiples of {alignment}, \
                 or the chunk end"
            )
        } else if count == 1 {
            let only = grid.nearest_positions(start, start, end).1.first().copied().unwrap_or(end);
            format!("the only valid position in chunk [{start}, {end}) is {}", describe(only))
        } else {
            let near: Vec<String> = near.into_iter().map(describe).collect();
            format!("nearest valid positions in chunk [{start}, {end}): {}", near.join(", "))
        };
        let offset = i64::from(position) - i64::from(start);
        let reason = if position <= start || position > end {
            format!("but the position is outside the chunk [{start}, {end})")
        } else if position % unit != 0 {
            format!(
                "but the position is not a multiple of the hash unit {unit} (checkpoints sit on \
                 unit boundaries, at offsets that are multiples of the backend's alignment \
                 {alignment})"
            )
        } else {
            format!("not a multiple of the backend's alignment {alignment}")
        };
        Err(CacheError::Alignment {
            position,
            offset,
            alignment,
            chunk_start: start,
            reason,
            valid,
        })
    }

    /// Builds the plan of every sequence scheduled since the last plan and puts it in flight.
    pub fn build_plan(&mut self) -> Result<StepPlan> {
        let mut plan = StepPlan::default();
        self.build_plan_into(&mut plan)?;
        Ok(plan)
    }

    /// `build_plan` into an existing plan, whose vectors are cleared and refilled: a caller
    /// that keeps one `StepPlan` across steps allocates nothing for it once the vectors are
    /// large enough. On error the plan is left as it was.
    pub fn build_plan_into(&mut self, plan: &mut StepPlan) -> Result<()> {
        self.refuse_in_flight("build_plan")?;
        // The one array sized by the step's tokens: reserved before anything changes.
        let tokens = self.scheduled_tokens as usize;
        for p in &mut plan.paged {
            if p.slot_mapping.try_reserve(tokens.saturating_sub(p.slot_mapping.len())).is_err() {
                return Err(CacheError::invalid(format!(
                    "a step of {tokens} tokens needs {} of slot mapping per paged group, which \
                     could not be allocated; schedule smaller chunks",
                    human_bytes(tokens.saturating_mul(8))
                )));
            }
        }
        let slots = std::mem::take(&mut self.scheduled);
        self.scheduled_tokens = 0;
        let step_id = self.next_step;
        self.next_step += 1;
        plan.clear_for(self.manager_id, step_id, &self.layout);
        plan.query_start_loc.push(0);
        // (state group part, row, column, offset, slot) of every interior checkpoint; empty,
        // so never allocated, in a step without any (every decode step).
        let mut checkpoints: Vec<(usize, usize, usize, i32, i32)> = Vec::new();
        let mut total = 0i32;
        for &slot in &slots {
            self.select_checkpoints(slot);
            let seq = self.seq(slot);
            let Some(step) = seq.step() else { continue };
            let (start, end) = (step.start, step.end);
            let row = plan.seq_ids.len();
            plan.seq_ids.push(seq.id);
            plan.num_computed.push(start as i32);
            plan.num_scheduled.push((end - start) as i32);
            total += (end - start) as i32;
            plan.query_start_loc.push(total);
            let parts = step.paged.iter().zip(&seq.paged).zip(&self.layout.paged);
            for (p, ((paged_step, paged), group)) in parts.enumerate() {
                let rows = PagedRows { row, start, end, first: step.first };
                emit_paged(
                    &mut plan.paged[p],
                    paged,
                    paged_step.table_len_before,
                    group.block_size,
                    &rows,
                );
                if let Some((src, dst, n)) = paged_step.cow {
                    plan.copies.extend([
                        group.index as i64,
                        i64::from(src),
                        i64::from(dst),
                        i64::from(n),
                    ]);
                }
            }
            for (s, (StateStep { interior, snapshot }, state)) in
                step.state.iter().zip(&seq.state).enumerate()
            {
                let out = &mut plan.state[s];
                out.running_slot.push(state.write_block() as i32);
                out.initial_slot.push(state.read_slot());
                if let Some(c) = snapshot {
                    out.snapshots.extend([state.write_block() as i32, c.block as i32]);
                }
                out.max_checkpoints = out.max_checkpoints.max(interior.len());
                checkpoints.extend(
                    interior
                        .iter()
                        .enumerate()
                        .map(|(i, c)| (s, row, i, (c.position - start) as i32, c.block as i32)),
                );
            }
        }
        let rows = plan.seq_ids.len();
        for out in &mut plan.state {
            let cmax = out.max_checkpoints;
            out.checkpoint_offsets.resize(rows * cmax, 0);
            out.checkpoint_slots.resize(rows * cmax, -1);
        }
        for (s, row, i, offset, slot) in checkpoints {
            let out = &mut plan.state[s];
            let at = row * out.max_checkpoints + i;
            out.checkpoint_offsets[at] = offset;
            out.checkpoint_slots[at] = slot;
        }
        self.stats.copies += (plan.copies.len() / 4) as u64;
        self.in_flight = Some(InFlight { step_id, slots });
        Ok(())
    }

    /// Chooses and allocates the checkpoints of one scheduled sequence, in every state group.
    fn select_checkpoints(&mut self, slot: usize) {
        let unit = self.unit;
        for i in 0..self.layout.state.len() {
            let group = &self.layout.state[i];
            let (g, config, pool) = (group.index, &group.config, group.pool);
            let seq = self.seq(slot);
            let Some(step) = seq.step() else { return };
            let (start, end) = (step.start, step.end);
            let decode = !step.first && start >= seq.prefill_target;
            // The common decode step crosses no unit boundary: nothing to retain or count.
            if decode && step.requested.is_empty() && end / unit == start / unit {
                continue;
            }
            let config = config.clone();
            let mut interior = Vec::new();
            let mut snapshot = None;
            // Skips by reason; `wanted` holds the few explicit positions, and the interval ones
            // (possibly many) are generated after them.
            let mut skipped = [0u64; SkipReason::ALL.len()];
            let mut wanted: Vec<(u32, BlockKind)> = Vec::new();
            let mut retained = None;
            if decode {
                wanted.extend(step.requested.iter().map(|&p| (p, BlockKind::Checkpoint)));
                if config.retention.decode_tail {
                    let first_boundary = start / unit + 1;
                    for i in first_boundary..=end / unit {
                        let p = i * unit;
                        if p < end && !wanted.iter().any(|w| w.0 == p) {
                            skipped[SkipReason::MidStep.index()] += 1;
                        }
                    }
                    if end % unit == 0 && !wanted.iter().any(|w| w.0 == end) {
                        wanted.push((end, BlockKind::DecodeTail));
                    }
                }
            } else {
                let r = config.retention.retained(unit, seq.prefill_target, seq.junction);
                let explicit = explicit_candidates(&step.requested, r, start, end);
                wanted.extend(explicit.into_iter().map(|p| (p, BlockKind::Checkpoint)));
                retained = Some(r);
            }
            let intervals = retained
                .into_iter()
                .flat_map(|r| r.intervals(start, end))
                .filter(|p| !wanted.iter().any(|w| w.0 == *p))
                .map(|p| (p, BlockKind::Checkpoint));
            let limit = config.max_checkpoints_per_step.unwrap_or(u32::MAX) as usize;
            // Each checkpoint taken uses a free or evictable block of the pool, so no more than
            // it holds now can be taken: the others are `budget` skips without being listed.
            let available = self.store.pools[pool].num_available() as usize;
            let mut planned: Vec<(u32, BlockKind)> = Vec::new();
            let mut planned_interior = 0;
            for (p, kind) in wanted.iter().copied().chain(intervals) {
                let reason = if has_key(&self.store, seq.content(), g as u32, p) {
                    SkipReason::AlreadyCached
                } else if p != end
                    && !is_exportable_offset(p - start, config.alignment, end - start)
                {
                    SkipReason::Unaligned
                } else if p != end && planned_interior >= limit {
                    SkipReason::Capacity
                } else if planned.len() >= available {
                    // Selected for export, but no block could be taken for it: it counts
                    // against C as a planned one whose allocation failed would.
                    planned_interior += usize::from(p != end);
                    SkipReason::Budget
                } else {
                    planned_interior += usize::from(p != end);
                    planned.push((p, kind));
                    continue;
                };
                skipped[reason.index()] += 1;
            }
            for (p, kind) in planned {
                match self.allocate_checkpoint(pool, g as u32, &config, kind) {
                    Some(block) => {
                        let c = PlannedCheckpoint {
                            position: p,
                            block,
                            decode_tail: kind == BlockKind::DecodeTail,
                        };
                        if p == end {
                            snapshot = Some(c);
                        } else {
                            interior.push(c);
                        }
                    }
                    None => skipped[SkipReason::Budget.index()] += 1,
                }
            }
            interior.sort_by_key(|c| c.position);
            for (total, count) in self.stats.groups[g].checkpoints_skipped.iter_mut().zip(skipped) {
                *total += count;
            }
            if let Some(step) = self.seq_mut(slot).step_mut() {
                step.state[i] = StateStep { interior, snapshot };
            }
        }
    }

    /// A block for a new checkpoint, or `None` (`budget`): the reserve for running sequences
    /// and the checkpoint cap are honoured; beyond the cap the least recently used evictable
    /// checkpoint is reused (a decode-tail snapshot may only displace another decode tail).
    fn allocate_checkpoint(
        &mut self,
        pool: usize,
        group: u32,
        config: &StateGroupConfig,
        kind: BlockKind,
    ) -> Option<BlockId> {
        let reserve = u64::from(config.reserve_per_sequence) * self.started as u64;
        let p = &self.store.pools[pool];
        if u64::from(p.num_available()) < reserve + 1 {
            return None;
        }
        if let Some(cap) = config.checkpoint_cap {
            // The cap counts this group's checkpoints only, and beyond it the group displaces
            // only its own: groups sharing a pool never evict each other's to stay under a cap.
            if p.num_checkpoints_of(group) >= cap {
                let victim = p.lru_iter().find(|&b| {
                    p.checkpoint_group(b) == Some(group)
                        && (kind != BlockKind::DecodeTail || p.kind(b) == BlockKind::DecodeTail)
                })?;
                return self.store.allocate_cached(pool, victim, kind, group);
            }
        }
        self.store.allocate(pool, kind, group)
    }
}
