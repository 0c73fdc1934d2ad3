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
            let step_shape = seq.step().map(|s| (s.paged.len(), s.state.len()));
            if (seq.paged.len(), seq.state.len()) != (paged_groups, state_groups)
                || step_shape.is_some_and(|shape| shape != (paged_groups, state_groups))
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
                        if let Some((src, _, _)) = seq.step().and_then(|s| s.paged[i].cow) {
                            hold(src);
                        }
                    }
                    GroupSlot::State(i) => {
                        let s = &seq.state[i];
                        s.running.iter().copied().for_each(&mut hold);
                        hold(s.resume);
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
                        if let Some(step) = seq.step() {
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
        let in_flight: &[usize] = self.steps.in_flight.as_ref().map_or(&[], |f| f.slots.as_slice());
        for (slot, seq) in self.table.iter() {
            let listed = self.steps.scheduled.contains(&slot) || in_flight.contains(&slot);
            if listed != seq.step().is_some() {
                return Err(CacheError::invariant(format!(
                    "sequence {}: has a step {} but listed {listed}",
                    seq.id,
                    seq.step().is_some()
                )));
            }
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
}
