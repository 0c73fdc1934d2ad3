//! The step plan (everything the kernels need for one step) and `build_plan`, which fills it
//! from the scheduled sequences, and `request_checkpoint`.
//!
//! The plan is plain contiguous vectors (row-major where two-dimensional), ready to be moved
//! into `NumPy` without copying. Per paged group it carries only what changed in the block tables
//! (appended and replaced entries), so a decode step costs O(sequences), not O(context). Which
//! checkpoints a row exports is `checkpoints.rs`'s; this file lays them out. It publishes
//! nothing (commit does).

use crate::checkpoints::plan_checkpoints;
use crate::config::GroupLayout;
use crate::error::{CacheError, Result};
use crate::limits::human_bytes;
use crate::manager::{CacheManager, InFlight};
use crate::pool::NULL_BLOCK;
use crate::sequence::{PagedSeq, Sequence, StateStep};

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

/// What the plan being built reports of a sequence's sliding-window releases: its commit's
/// mark (`PagedStep::reported_to`).
fn mark_window_reports(seq: &mut Sequence) {
    if let Some(step) = seq.ring.newest_mut() {
        for (s, p) in step.paged.iter_mut().zip(&seq.paged) {
            s.reported_to = p.window_start;
        }
    }
}

impl CacheManager {
    /// Asks for a checkpoint at `position` in the chunk scheduled for the next plan, on top of
    /// the retention policy (it is considered first). Raises `Alignment` for a position the
    /// kernel cannot write.
    pub fn request_checkpoint(&mut self, seq_id: u64, position: u32) -> Result<()> {
        self.refuse_in_flight_classic("request_checkpoint")?;
        let slot = self.slot(seq_id)?;
        let seq = self.seq(slot);
        let Some(step) = seq.step().filter(|s| s.plan == 0) else {
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

    /// `StepError` when `max_steps_in_flight` plans are in flight (with D = 1: any).
    pub(crate) fn refuse_build_at_depth(&self) -> Result<()> {
        let depth = self.config.max_steps_in_flight;
        if depth == 1 {
            return self.refuse_in_flight("build_plan");
        }
        if self.steps.in_flight.len() >= depth as usize {
            let oldest = self.plan_in_flight().unwrap_or(0);
            return Err(CacheError::step(format!(
                "build_plan: {depth} plans are in flight, the most max_steps_in_flight = {depth} \
                 allows: commit or abort the oldest, step {oldest}, first"
            )));
        }
        Ok(())
    }

    /// Builds the plan of every sequence scheduled since the last plan and puts it in flight.
    /// With `max_steps_in_flight` plans in flight already it raises a step error naming the
    /// oldest (with D = 1: while any plan is in flight).
    pub fn build_plan(&mut self) -> Result<StepPlan> {
        let mut plan = StepPlan::default();
        self.build_plan_into(&mut plan)?;
        Ok(plan)
    }

    /// `build_plan` into an existing plan, whose vectors are cleared and refilled: a caller
    /// that keeps one `StepPlan` across steps allocates nothing for it once the vectors are
    /// large enough. On error the plan is left as it was.
    pub fn build_plan_into(&mut self, plan: &mut StepPlan) -> Result<()> {
        self.refuse_build_at_depth()?;
        // The one array sized by the step's tokens: reserved before anything changes.
        let tokens = self.steps.scheduled_tokens as usize;
        for p in &mut plan.paged {
            if p.slot_mapping.try_reserve(tokens.saturating_sub(p.slot_mapping.len())).is_err() {
                return Err(CacheError::invalid(format!(
                    "a step of {tokens} tokens needs {} of slot mapping per paged group, which \
                     could not be allocated; schedule smaller chunks",
                    human_bytes(tokens.saturating_mul(8))
                )));
            }
        }
        let slots = std::mem::take(&mut self.steps.scheduled);
        self.steps.scheduled_tokens = 0;
        let step_id = self.steps.next_step;
        self.steps.next_step += 1;
        plan.clear_for(self.manager_id, step_id, &self.layout);
        plan.query_start_loc.push(0);
        // (state group part, row, column, offset, slot) of every interior checkpoint; empty,
        // so never allocated, in a step without any (every decode step).
        let mut checkpoints: Vec<(usize, usize, usize, i32, i32)> = Vec::new();
        let mut total = 0i32;
        let windows = self.layout.paged.iter().any(|g| g.window.is_some());
        for &slot in &slots {
            let seq = self.table.get_mut(slot);
            if let Some(step) = seq.step_mut() {
                step.plan = step_id;
            }
            plan_checkpoints(
                &mut self.store,
                &self.layout,
                &mut self.stats.groups,
                self.started,
                seq,
            );
            if windows {
                mark_window_reports(seq);
            }
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
            for (s, StateStep { write, read, interior, snapshot }) in step.state.iter().enumerate()
            {
                let out = &mut plan.state[s];
                out.running_slot.push(*write as i32);
                out.initial_slot.push(*read);
                if let Some(c) = snapshot {
                    out.snapshots.extend([*write as i32, c.block as i32]);
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
        self.steps.in_flight.push_back(InFlight { step_id, slots });
        Ok(())
    }
}
