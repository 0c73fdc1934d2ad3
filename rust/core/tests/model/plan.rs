//! `build_plan` against the model: rows, incremental block tables (an engine table rebuilt from
//! the plans alone must equal `block_table`), slot mapping, copy-on-write copies, running and
//! initial state slots, and the checkpoints, predicted position by position (explicit requests,
//! tail, junction, intervals, decode tail; alignment, C, already cached, mid-step) and compared
//! with the plan and the skip counters. Only `budget` skips, which depend on pool pressure, are
//! read from the plan; the evictions the checkpoint allocations cause are applied row by row.

use std::collections::HashSet;
use std::fmt::Write as _;

use prefixcache_core::{
    CacheError, CacheEvent, PoolUsage, SkipReason, StateGroupConfig, Stats, StepPlan,
};

use crate::reference::{boundaries, Model, SeqModel, StepModel};

/// Counter names of the skip reasons, in `SkipReason::index` order.
const SKIPS: [&str; 5] =
    ["skip unaligned", "skip capacity", "skip already_cached", "skip budget", "skip mid_step"];

impl Model {
    pub(crate) fn build_plan(&mut self) -> Result<(), String> {
        if self.in_flight.is_some() {
            let result = self.m.build_plan();
            ensure!(
                matches!(result, Err(CacheError::Step { .. })),
                "second build_plan: {result:?}"
            );
            return self.expect_no_events("a refused build_plan");
        }
        let usage = self.m.pool_usage();
        let stats = self.m.stats();
        let held = self.held()?;
        let plan = if self.built.len() % 2 == 1 {
            // A plan refilled in place must hold exactly what a fresh one would.
            self.m
                .build_plan_into(&mut self.reused_plan)
                .map_err(|e| format!("build_plan: {e}"))?;
            self.saw("plan refilled in place");
            self.reused_plan.clone()
        } else {
            self.m.build_plan().map_err(|e| format!("build_plan: {e}"))?
        };
        let ids = std::mem::take(&mut self.scheduled);
        ensure!(plan.seq_ids == ids, "plan rows {:?}, scheduled {ids:?}", plan.seq_ids);
        self.built.push(plan.step_id);
        let mut query_start = vec![0i32];
        for (row, id) in ids.iter().enumerate() {
            let step = self.seq(*id)?.step.as_ref().ok_or("scheduled without a step")?;
            ensure!(
                plan.num_computed[row] == step.start as i32
                    && plan.num_scheduled[row] == (step.end - step.start) as i32,
                "plan row {row}: computed {} scheduled {} for step [{}, {})",
                plan.num_computed[row],
                plan.num_scheduled[row],
                step.start,
                step.end
            );
            query_start.push(query_start[row] + (step.end - step.start) as i32);
        }
        ensure!(plan.query_start_loc == query_start, "query_start_loc {:?}", plan.query_start_loc);
        self.check_paged_plan(&plan)?;
        let mut events = self.events()?.into_iter();
        self.check_state_plan(&plan, &usage, &stats, &held, &mut events)?;
        let rest: Vec<CacheEvent> = events.collect();
        ensure!(rest.is_empty(), "build_plan evicted more than its checkpoints took: {rest:?}");
        self.in_flight = Some(plan);
        Ok(())
    }

    /// Incremental block tables, slot mapping and copy-on-write copies.
    pub(crate) fn check_paged_plan(&mut self, plan: &StepPlan) -> Result<(), String> {
        let paged: Vec<usize> =
            (0..self.groups()).filter(|&g| self.s.block_size(g).is_some()).collect();
        ensure!(
            plan.paged.iter().map(|p| p.group as usize).collect::<Vec<_>>() == paged,
            "plan has paged groups {:?}",
            plan.paged.iter().map(|p| p.group).collect::<Vec<_>>()
        );
        let mut copies = Vec::new();
        for (gp, &g) in plan.paged.iter().zip(&paged) {
            let block = self.s.block_size(g).ok_or("paged")?;
            let mut slots = gp.slot_mapping.iter();
            for (row, &id) in plan.seq_ids.iter().enumerate() {
                let table = self.row(g, id)?;
                let seq = self.seq_mut(id)?;
                let step = seq.step.as_mut().ok_or("no step")?;
                let appended: Vec<(usize, i32)> = gp
                    .appended
                    .chunks(3)
                    .filter(|t| t[0] == row as i32)
                    .map(|t| (t[1] as usize, t[2]))
                    .collect();
                let from = if step.first { 0 } else { step.rows_before[g].len() };
                ensure!(
                    appended.iter().map(|a| a.0).collect::<Vec<_>>()
                        == (from..table.len()).collect::<Vec<_>>(),
                    "group {g} row {row}: appended columns {appended:?} for a table of {} after \
                     {from}",
                    table.len()
                );
                let engine = &mut seq.engine_rows[g];
                if step.first {
                    engine.clear();
                }
                for (c, b) in appended {
                    if engine.len() <= c {
                        engine.resize(c + 1, 0);
                    }
                    engine[c] = b;
                }
                for t in gp.replaced.chunks(3).filter(|t| t[0] == row as i32) {
                    let c = t[1] as usize;
                    ensure!(t[2] == 0 && c < engine.len(), "replaced entry {t:?}");
                    engine[c] = 0;
                }
                ensure!(
                    engine.len() >= table.len() && engine[..table.len()] == table[..],
                    "group {g}: engine row {engine:?} rebuilt from plans differs from {table:?}"
                );
                for pos in step.start..step.end {
                    let b = table[(pos / block) as usize];
                    let expected = i64::from(b) * i64::from(block) + i64::from(pos % block);
                    ensure!(
                        b > 0 && slots.next() == Some(&expected),
                        "slot of token {pos} in group {g}"
                    );
                }
                let hit = step.start;
                if step.first && hit % block != 0 {
                    copies.push((row, g, table[(hit / block) as usize] as u32, hit % block));
                }
                step.table[g] = table;
            }
            ensure!(slots.next().is_none(), "slot_mapping of group {g} too long");
        }
        ensure!(
            plan.copies.len() == copies.len() * 4,
            "copies {:?}, expected {copies:?}",
            plan.copies
        );
        copies.sort_unstable();
        for (c, &(row, g, dst, n)) in plan.copies.chunks(4).zip(&copies) {
            let src = c[1] as u32;
            let id = plan.seq_ids[row];
            let seq = self.seq(id)?;
            let hit = seq.step.as_ref().ok_or("no step")?.start;
            ensure!(
                c[0] == g as i64 && c[2] == i64::from(dst) && c[3] == i64::from(n),
                "copy {c:?}, expected group {g} dst {dst} tokens {n}"
            );
            ensure!(
                self.carries(g, src, &seq.tokens[..hit as usize]),
                "copy source {src} does not carry the key at the hit {hit}"
            );
            self.seq_mut(id)?.step.as_mut().ok_or("no step")?.cow[g] = Some((src, dst, n));
            self.saw("copy on write");
            self.stats.copies += 1;
        }
        Ok(())
    }

    /// The checkpoints a step should export, in priority order, and the predicted skips.
    pub(crate) fn predict_checkpoints(
        &self,
        seq: &SeqModel,
        step: &StepModel,
        g: usize,
        config: &StateGroupConfig,
    ) -> (Vec<(u32, bool)>, [u64; 5]) {
        let unit = self.unit;
        let (start, end) = (step.start, step.end);
        let retention = &config.retention;
        let mut skips = [0u64; 5];
        let mut wanted: Vec<(u32, bool)> = Vec::new();
        if !step.first && start >= seq.prefill_target {
            wanted.extend(step.requested.iter().map(|&p| (p, false)));
            if retention.decode_tail {
                for p in boundaries(unit, start, end).filter(|&p| p < end) {
                    if !wanted.iter().any(|w| w.0 == p) {
                        skips[SkipReason::MidStep.index()] += 1;
                    }
                }
                if end % unit == 0 && !wanted.iter().any(|w| w.0 == end) {
                    wanted.push((end, true));
                }
            }
        } else {
            let mut candidates = step.requested.clone();
            if retention.tail && seq.prefill_target > 0 {
                candidates.push((seq.prefill_target - 1) / unit * unit);
            }
            if retention.junction {
                candidates.extend(seq.junction);
            }
            if let Some(k) = retention.interval {
                let mut p = end / k * k;
                while p > start {
                    candidates.push(p);
                    p -= k;
                }
            }
            for p in candidates {
                if p > start && p <= end && !wanted.iter().any(|w| w.0 == p) {
                    wanted.push((p, false));
                }
            }
        }
        let limit = config.max_checkpoints_per_step.map_or(usize::MAX, |c| c as usize);
        let mut planned: Vec<(u32, bool)> = Vec::new();
        for (p, decode_tail) in wanted {
            let reason = if self.live[g].contains_key(&seq.tokens[..p as usize]) {
                Some(SkipReason::AlreadyCached)
            } else if p != end && (p - start) % config.alignment != 0 {
                Some(SkipReason::Unaligned)
            } else if p != end && planned.iter().filter(|c| c.0 != end).count() >= limit {
                Some(SkipReason::Capacity)
            } else {
                None
            };
            match reason {
                Some(r) => skips[r.index()] += 1,
                None => planned.push((p, decode_tail)),
            }
        }
        (planned, skips)
    }

    /// Running and initial slots, checkpoints (compared with the prediction row by row, with
    /// the evictions their allocations caused applied in between) and skip counters.
    #[allow(clippy::too_many_lines)]
    pub(crate) fn check_state_plan(
        &mut self,
        plan: &StepPlan,
        usage: &[PoolUsage],
        stats: &Stats,
        held: &[HashSet<u32>],
        events: &mut std::vec::IntoIter<CacheEvent>,
    ) -> Result<(), String> {
        let state_groups: Vec<usize> =
            (0..self.groups()).filter(|&g| self.s.state(g).is_some()).collect();
        ensure!(
            plan.state.iter().map(|p| p.group as usize).collect::<Vec<_>>() == state_groups,
            "plan has state groups {:?}",
            plan.state.iter().map(|p| p.group).collect::<Vec<_>>()
        );
        let rows = plan.seq_ids.len();
        let mut free: Vec<u64> = usage.iter().map(|u| u64::from(u.free)).collect();
        let mut checkpoints: Vec<u64> = usage.iter().map(|u| u64::from(u.checkpoints)).collect();
        let mut expected_skips = vec![[0u64; 5]; self.groups()];
        let mut allocated = vec![0u64; self.s.pools.len()];
        let mut taken: HashSet<(usize, u32)> = HashSet::new();
        let mut trace = String::new();
        for (row, &id) in plan.seq_ids.iter().enumerate() {
            for sp in &plan.state {
                let g = sp.group as usize;
                let pool = self.s.pool(g);
                let config = self.s.state(g).ok_or("state")?.clone();
                let cmax = sp.max_checkpoints;
                ensure!(
                    sp.running_slot.len() == rows
                        && sp.initial_slot.len() == rows
                        && sp.checkpoint_offsets.len() == rows * cmax
                        && sp.checkpoint_slots.len() == rows * cmax
                        && sp.snapshots.len() % 2 == 0,
                    "state plan of group {g} has the wrong shape"
                );
                let seq = self.seq(id)?;
                let step = seq.step.as_ref().ok_or("no step")?;
                let (running, initial) = (sp.running_slot[row], sp.initial_slot[row]);
                ensure!(
                    running > 0 && running != initial,
                    "row {row}: running {running}, initial {initial}"
                );
                let mut resume = 0;
                if step.first {
                    if step.start == 0 {
                        ensure!(
                            initial == -1,
                            "row {row} starts from zero but reads slot {initial}"
                        );
                    } else {
                        let resumed = &seq.tokens[..step.start as usize];
                        ensure!(
                            initial > 0 && self.carries(g, initial as u32, resumed),
                            "row {row} resumes at {} from slot {initial}, which holds no state \
                             there",
                            step.start
                        );
                        resume = initial as u32;
                    }
                } else {
                    ensure!(
                        Some(initial) == seq.current[g]
                            && seq.previous[g].is_none_or(|prev| prev == running),
                        "row {row}: reads {initial} writes {running}, committed state in {:?} \
                         (previous {:?})",
                        seq.current[g],
                        seq.previous[g]
                    );
                }
                // Which checkpoints the plan wrote for this row.
                let mut written: Vec<(u32, u32)> = Vec::new();
                let offsets = &sp.checkpoint_offsets[row * cmax..(row + 1) * cmax];
                let slots = &sp.checkpoint_slots[row * cmax..(row + 1) * cmax];
                let used = offsets.iter().take_while(|&&o| o != 0).count();
                ensure!(
                    offsets[used..].iter().all(|&o| o == 0)
                        && slots[used..].iter().all(|&s| s == -1),
                    "row {row}: checkpoint offsets {offsets:?} slots {slots:?}"
                );
                for (&o, &slot) in offsets.iter().zip(slots).take(used) {
                    let p = step.start + o as u32;
                    ensure!(o > 0 && p < step.end && slot > 0, "row {row}: offset {o} slot {slot}");
                    ensure!(
                        written.last().is_none_or(|w| w.0 < p),
                        "offsets not ascending: {offsets:?}"
                    );
                    written.push((p, slot as u32));
                }
                for pair in sp.snapshots.chunks(2).filter(|pair| pair[0] == running) {
                    written.push((step.end, pair[1] as u32));
                }
                let (planned, skips) = self.predict_checkpoints(seq, step, g, &config);
                let end = step.end;
                let _ = write!(
                    trace,
                    "\n  row {row} seq {id} step [{}, {}) first {} target {} junction {:?}: \
                     planned {planned:?} wrote {written:?} skips {skips:?}",
                    step.start, step.end, step.first, seq.prefill_target, seq.junction
                );
                for (s, n) in expected_skips[g].iter_mut().zip(skips) {
                    *s += n;
                }
                let mut kept = Vec::new();
                for &(p, block) in &written {
                    let &(_, decode_tail) = planned.iter().find(|c| c.0 == p).ok_or_else(|| {
                        format!("row {row} wrote a checkpoint at {p}, not among {planned:?}")
                    })?;
                    kept.push((p, block, decode_tail));
                }
                // Allocated in priority order (the order the evictions come in).
                kept.sort_by_key(|k| planned.iter().position(|c| c.0 == k.0));
                expected_skips[g][SkipReason::Budget.index()] +=
                    (planned.len() - kept.len()) as u64;
                if self.s.never_evicts {
                    ensure!(
                        kept.len() == planned.len(),
                        "row {row}: wrote {written:?}, planned {planned:?}"
                    );
                }
                // The evictions these allocations caused, in order.
                for &(p, _, decode_tail) in &kept {
                    allocated[pool] += 1;
                    // At the cap the least recently used checkpoint is evicted; below it a free
                    // block is used first, else the pool's least recently used block.
                    let at_cap =
                        config.checkpoint_cap.is_some_and(|c| checkpoints[pool] >= u64::from(c));
                    if !at_cap && free[pool] > 0 {
                        free[pool] -= 1;
                        checkpoints[pool] += 1;
                        continue;
                    }
                    let event = events.next().ok_or("a checkpoint allocation evicted nothing")?;
                    let CacheEvent::BlockRemoved { group, block: victim, .. } = &event else {
                        return Err(format!("build_plan emitted {event:?}"));
                    };
                    let victim_is_checkpoint = self.s.state(*group as usize).is_some();
                    let is_checkpoint = |b: u32| {
                        self.carried[pool].get(&b).is_some_and(|keys| {
                            keys.iter().any(|(kg, _)| self.s.state(*kg).is_some())
                        })
                    };
                    let ordered = match (at_cap, decode_tail) {
                        (true, true) => self.check_victim(pool, *victim, &held[pool], |b| {
                            self.decode_tails[pool].contains(&b)
                        })?,
                        (true, false) => {
                            self.check_victim(pool, *victim, &held[pool], is_checkpoint)?
                        }
                        (false, _) => self.check_victim(pool, *victim, &held[pool], |_| true)?,
                    };
                    if ordered {
                        self.saw("eviction ordered by recency");
                    }
                    ensure!(!at_cap || victim_is_checkpoint, "the cap evicted a paged block");
                    ensure!(
                        !(at_cap && decode_tail) || self.decode_tails[pool].contains(victim),
                        "the decode-tail snapshot at {p} evicted checkpoint {victim}, which is not \
                         a decode tail"
                    );
                    if !victim_is_checkpoint {
                        checkpoints[pool] += 1;
                    }
                    self.remove_block(&event, held)?;
                    self.saw(match (at_cap, decode_tail) {
                        (true, true) => "decode tail replaced a decode tail at the cap",
                        (true, false) => "checkpoint cap evicted",
                        (false, _) => "checkpoint evicted",
                    });
                }
                for &(p, _, decode_tail) in &kept {
                    self.saw(match (decode_tail, p == end) {
                        (true, _) => "decode-tail snapshot",
                        (false, true) => "snapshot checkpoint",
                        (false, false) => "interior checkpoint",
                    });
                }
                for &(p, block, _) in &kept {
                    ensure!(
                        !held[pool].contains(&block)
                            && !self.carried[pool].contains_key(&block)
                            && taken.insert((pool, block))
                            && block as i32 != running
                            && block as i32 != initial,
                        "checkpoint block {block} at {p} is not fresh: held {}, carries {:?}, \
                         running {running}, initial {initial}",
                        held[pool].contains(&block),
                        self.carried[pool]
                            .get(&block)
                            .map(|k| k.iter().map(|(g, p)| (*g, p.len())).collect::<Vec<_>>())
                    );
                }
                let step = self.seq_mut(id)?.step.as_mut().ok_or("no step")?;
                step.written[g] = kept;
                step.running[g] = running;
                step.resume[g] = resume;
            }
        }
        for sp in &plan.state {
            for pair in sp.snapshots.chunks(2) {
                ensure!(sp.running_slot.contains(&pair[0]), "snapshot {pair:?} of no row");
            }
        }
        let after = self.m.stats();
        for &g in &state_groups {
            let got: Vec<u64> = (0..5)
                .map(|i| {
                    after.groups[g].checkpoints_skipped[i] - stats.groups[g].checkpoints_skipped[i]
                })
                .collect();
            for (name, &n) in SKIPS.iter().zip(&got) {
                if n > 0 {
                    self.saw(name);
                }
            }
            for (total, n) in self.stats.groups[g].checkpoints_skipped.iter_mut().zip(&got) {
                *total += n;
            }
            ensure!(
                got == expected_skips[g],
                "group {g} skipped {got:?} (unaligned, capacity, already_cached, budget, \
                 mid_step), expected {:?}{trace}",
                expected_skips[g]
            );
            let config = self.s.state(g).ok_or("state")?;
            let pool = self.s.pool(g);
            let now = &self.m.pool_usage()[pool];
            let started = self.seqs.values().filter(|s| s.started).count() as u64;
            if allocated[pool] > 0 {
                ensure!(
                    u64::from(now.free + now.cached)
                        >= u64::from(config.reserve_per_sequence) * started,
                    "checkpoints left {} free + {} cached blocks, below the reserve for {started} \
                     sequences",
                    now.free,
                    now.cached
                );
            }
        }
        Ok(())
    }
}
