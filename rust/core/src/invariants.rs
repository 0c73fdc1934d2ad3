//! `check_invariants`: the whole-manager consistency check that tests run after every call (the
//! store checks its own pools and index; this file checks what the protocol holds).
//!
//! It verifies: each pool's own partition (free / owned / cached, LRU integrity, null block);
//! reference counts equal the number of holders (tables, copy sources, running buffers, resume
//! pins, decode tails, pending checkpoints); keys map only to published blocks of the right
//! pool and every block key is indexed; state blocks carry exactly one key, on a unit boundary;
//! no planned checkpoint is off the kernel grid; the checkpoint cap holds; the bookkeeping of
//! scheduled and started sequences agrees with the sequences themselves; every sequence's and
//! step's typed parts match the layout. It reads everything and changes nothing.

use crate::config::{is_exportable_offset, GroupSlot};
use crate::error::{CacheError, Result};
use crate::manager::CacheManager;
use crate::pool::NULL_BLOCK;

impl CacheManager {
    /// Checks every invariant; `Err(Invariant)` describes the first violation found.
    pub fn check_invariants(&self) -> Result<()> {
        self.store.check_pools()?;
        self.check_holders()?;
        self.store.check_index(&self.layout)?;
        self.check_steps()
    }

    fn check_holders(&self) -> Result<()> {
        let mut expected: Vec<Vec<u32>> =
            self.store.pools.iter().map(|p| vec![0; p.num_blocks() as usize]).collect();
        let mut started = 0;
        for (_, seq) in self.table.iter() {
            started += usize::from(seq.started());
            let (paged_groups, state_groups) = (self.layout.paged.len(), self.layout.state.len());
            let step_shape = seq
                .steps()
                .map(|s| (s.paged.len(), s.state.len()))
                .find(|&shape| shape != (paged_groups, state_groups));
            if (seq.paged.len(), seq.state.len()) != (paged_groups, state_groups)
                || step_shape.is_some()
            {
                return Err(CacheError::invariant(format!(
                    "sequence {}: {} paged and {} state parts (step {step_shape:?}) for a layout \
                     of {paged_groups} paged and {state_groups} state groups",
                    seq.id,
                    seq.paged.len(),
                    seq.state.len()
                )));
            }
            for p in &seq.paged {
                if let Some(col) = p.table[p.window_start..].iter().position(|&b| b == NULL_BLOCK) {
                    return Err(CacheError::invariant(format!(
                        "sequence {}: column {} inside its window holds the null block",
                        seq.id,
                        p.window_start + col
                    )));
                }
            }
            for (g, slot) in self.layout.slots.iter().enumerate() {
                let counts = &mut expected[self.layout.pool(g)];
                let mut hold = |b: u32| {
                    if b != NULL_BLOCK {
                        counts[b as usize] += 1;
                    }
                };
                match *slot {
                    GroupSlot::Paged(i) => {
                        seq.paged[i].table.iter().copied().for_each(&mut hold);
                        for step in seq.steps() {
                            if let Some((src, _, _)) = step.paged[i].cow {
                                hold(src);
                            }
                        }
                    }
                    GroupSlot::State(i) => {
                        let s = &seq.state[i];
                        s.running.iter().chain(&s.extra).copied().for_each(&mut hold);
                        hold(s.resume);
                        for &(pg, b, _) in &seq.pending_checkpoints {
                            if pg == g {
                                hold(b);
                            }
                        }
                        let pool = &self.store.pools[self.layout.pool(g)];
                        let resumable = pool.kind(s.resume).is_checkpoint()
                            && pool
                                .keys(s.resume)
                                .iter()
                                .any(|k| k.key.group == g as u32 && k.position == seq.num_computed);
                        if s.resume != NULL_BLOCK && !resumable {
                            return Err(CacheError::invariant(format!(
                                "sequence {}: resumes group {g} at {} from block {}, which is \
                                 not a checkpoint published at that position",
                                seq.id, seq.num_computed, s.resume
                            )));
                        }
                        if let Some((b, _)) = s.decode_tail {
                            hold(b);
                        }
                        for step in seq.steps() {
                            let st = &step.state[i];
                            st.interior
                                .iter()
                                .chain(st.snapshot.iter())
                                .for_each(|c| hold(c.block));
                        }
                    }
                }
            }
        }
        if started != self.started {
            return Err(CacheError::invariant(format!(
                "{started} sequences hold blocks but the manager counts {}",
                self.started
            )));
        }
        for (i, pool) in self.store.pools.iter().enumerate() {
            for (b, &want) in expected[i].iter().enumerate() {
                let have = pool.ref_count(b as u32);
                if have != want {
                    return Err(CacheError::invariant(format!(
                        "pool {i} block {b}: reference count {have} but {want} holders"
                    )));
                }
            }
        }
        Ok(())
    }

    fn check_steps(&self) -> Result<()> {
        let pending: u64 = self
            .steps
            .scheduled
            .iter()
            .filter_map(|&slot| self.table.get(slot).step())
            .map(|step| u64::from(step.end - step.start))
            .sum();
        if pending != u64::from(self.steps.scheduled_tokens) {
            return Err(CacheError::invariant(format!(
                "the step's token count is {} but its sequences schedule {pending}",
                self.steps.scheduled_tokens
            )));
        }
        self.check_step_chains()?;
        for (_, seq) in self.table.iter() {
            let Some(step) = seq.step() else { continue };
            if step.start >= step.end || step.end > seq.num_tokens() {
                return Err(CacheError::invariant(format!(
                    "sequence {}: step [{}, {}) outside its {} tokens",
                    seq.id,
                    step.start,
                    step.end,
                    seq.num_tokens()
                )));
            }
            for (state_step, group) in step.state.iter().zip(&self.layout.state) {
                let (interior, snapshot, config) =
                    (&state_step.interior, &state_step.snapshot, &group.config);
                let len = step.end - step.start;
                for c in interior {
                    let offset = c.position.wrapping_sub(step.start);
                    if c.position <= step.start
                        || !is_exportable_offset(offset, config.alignment, len)
                    {
                        return Err(CacheError::invariant(format!(
                            "sequence {}: interior checkpoint at {} off the grid of step \
                             [{}, {}) with alignment {}",
                            seq.id, c.position, step.start, step.end, config.alignment
                        )));
                    }
                }
                if let Some(c) = snapshot {
                    if c.position != step.end {
                        return Err(CacheError::invariant(format!(
                            "sequence {}: snapshot at {} but the step ends at {}",
                            seq.id, c.position, step.end
                        )));
                    }
                }
                let limit = config.max_checkpoints_per_step.unwrap_or(u32::MAX) as usize;
                if interior.len() > limit {
                    return Err(CacheError::invariant(format!(
                        "sequence {}: {} interior checkpoints exceed C = {limit}",
                        seq.id,
                        interior.len()
                    )));
                }
            }
        }
        Ok(())
    }

    /// Plans in flight within D, each sequence's steps contiguous from its committed position
    /// (only the newest unbuilt, each built one listed in its plan), each step writing a
    /// running buffer of its own that it does not read, and at most D steps and D + 1 running
    /// buffers per state group.
    fn check_step_chains(&self) -> Result<()> {
        let depth = self.config.max_steps_in_flight as usize;
        if self.steps.in_flight.len() > depth {
            return Err(CacheError::invariant(format!(
                "{} plans in flight, more than max_steps_in_flight = {depth}",
                self.steps.in_flight.len()
            )));
        }
        let in_plan = |plan: u64, slot: usize| {
            self.steps.in_flight.iter().any(|f| f.step_id == plan && f.slots.contains(&slot))
        };
        for (slot, seq) in self.table.iter() {
            let scheduled = self.steps.scheduled.contains(&slot);
            let newest_unbuilt = seq.step().is_some_and(|s| s.plan == 0);
            if scheduled != newest_unbuilt {
                return Err(CacheError::invariant(format!(
                    "sequence {}: a step for the next plan {newest_unbuilt} but listed {scheduled}",
                    seq.id
                )));
            }
            let mut position = seq.num_computed;
            for (k, step) in seq.steps().enumerate() {
                let built_ok = if step.plan == 0 {
                    k + 1 == seq.num_steps()
                } else {
                    in_plan(step.plan, slot)
                };
                if !built_ok || step.start != position {
                    return Err(CacheError::invariant(format!(
                        "sequence {}: step {k} [{}, {}) of plan {} does not follow position \
                         {position} or is not listed in its plan",
                        seq.id, step.start, step.end, step.plan
                    )));
                }
                position = step.end;
                for (st, s) in step.state.iter().zip(&seq.state) {
                    let own = s.running.iter().chain(&s.extra).any(|&b| b == st.write);
                    if !own || st.read == st.write as i32 {
                        return Err(CacheError::invariant(format!(
                            "sequence {}: a step writes running block {} (reads {}), not one of \
                             its own buffers or the one it reads",
                            seq.id, st.write, st.read
                        )));
                    }
                }
            }
            for (i, s) in seq.state.iter().enumerate() {
                // The known spare: its own, not the committed state, written by no step but
                // perhaps the newest (`StateSeq::spare`).
                if s.spare == NULL_BLOCK {
                    continue;
                }
                let own = s.running.iter().chain(&s.extra).any(|&b| b == s.spare);
                let current = s.current.is_some_and(|c| s.running[c] == s.spare);
                let older = seq.num_steps().saturating_sub(1);
                let written = seq.steps().take(older).any(|st| st.state[i].write == s.spare);
                if !own || current || written {
                    return Err(CacheError::invariant(format!(
                        "sequence {}: its known spare running block {} is not its own, holds \
                         the committed state or is written by a step before its newest",
                        seq.id, s.spare
                    )));
                }
            }
            if seq.num_steps() > depth || seq.state.iter().any(|s| s.extra.len() + 1 > depth) {
                return Err(CacheError::invariant(format!(
                    "sequence {}: {} steps and running buffers beyond max_steps_in_flight = \
                     {depth}",
                    seq.id,
                    seq.num_steps()
                )));
            }
        }
        for flight in &self.steps.in_flight {
            for &slot in &flight.slots {
                if !self.table.get(slot).steps().any(|s| s.plan == flight.step_id) {
                    return Err(CacheError::invariant(format!(
                        "plan {} lists slot {slot}, which has no step in it",
                        flight.step_id
                    )));
                }
            }
        }
        Ok(())
    }
}
