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

use crate::reference::{boundaries, Model, Retained, SeqModel, StepModel};

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
                self.carries(g, src, seq.key(hit)),
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
            // What a step exports: the retained positions of `(qs, qe]`, requests
            // first, then tail, junction, intervals latest first; each unit boundary is tested
            // against the retention predicate (the core generates them instead).
            let retained = Retained::of(retention, unit, seq.prefill_target, seq.junction);
            let mut candidates = step.requested.clone();
            candidates.extend(retained.tail);
            candidates.extend(retained.junction);
            candidates
                .extend(boundaries(unit, start, end).filter(|&p| retained.on_interval(p)).rev());
            for p in candidates {
                if p > start && p <= end && !wanted.iter().any(|w| w.0 == p) {
                    wanted.push((p, false));
                }
            }
        }
        let limit = config.max_checkpoints_per_step.map_or(usize::MAX, |c| c as usize);
        let mut planned: Vec<(u32, bool)> = Vec::new();
        for (p, decode_tail) in wanted {
            let reason = if self.live[g].contains_key(&seq.key(p)) {
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

    /// Blocks no checkpoint allocation of this plan may evict, per pool: the blocks in use
    /// before it, the copy-on-write sources, and every checkpoint a first step resumes from
    /// (all pinned when the rows were scheduled, before any checkpoint is allocated).
    fn pinned_for_plan(&self, plan: &StepPlan, held: &[HashSet<u32>]) -> Vec<HashSet<u32>> {
        let mut pinned = held.to_vec();
        for (row, id) in plan.seq_ids.iter().enumerate() {
            let Some(step) = self.seqs.get(id).and_then(|s| s.step.as_ref()) else { continue };
            for g in 0..self.groups() {
                if let Some((src, _, _)) = step.cow[g] {
                    pinned[self.s.pool(g)].insert(src);
                }
            }
            if step.first {
                for sp in &plan.state {
                    if sp.initial_slot[row] > 0 {
                        pinned[self.s.pool(sp.group as usize)].insert(sp.initial_slot[row] as u32);
                    }
                }
            }
        }
        pinned
    }

    /// Whether `block` is a published checkpoint of state group `g` (a published decode tail,
    /// with `decode_tail`).
    fn own_checkpoint(&self, g: usize, block: u32, decode_tail: bool) -> bool {
        let pool = self.s.pool(g);
        self.carried[pool].get(&block).is_some_and(|keys| keys.iter().any(|(kg, _)| *kg == g))
            && (!decode_tail || self.decode_tails[pool].contains(&block))
    }

    /// Running and initial slots, checkpoints and skip counters. Every checkpoint is predicted
    /// position by position, in priority order, with the allocations before it applied: it
    /// gets a block unless taking one would leave its pool no more free or evictable blocks
    /// than the `reserve_per_sequence` of any state group of the pool per started sequence
    /// (every group's promise is kept, whichever group checkpoints), or its group is at its
    /// own cap with
    /// none of its own unpinned checkpoints (decode tails, for a decode-tail snapshot) to
    /// evict (`budget` either way). At the cap the group's least recently used one is evicted;
    /// below it a free block is used first, else the pool's least recently used block.
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
        for sp in &plan.state {
            let cmax = sp.max_checkpoints;
            ensure!(
                sp.running_slot.len() == rows
                    && sp.initial_slot.len() == rows
                    && sp.checkpoint_offsets.len() == rows * cmax
                    && sp.checkpoint_slots.len() == rows * cmax
                    && sp.snapshots.len() % 2 == 0,
                "state plan of group {} has the wrong shape",
                sp.group
            );
        }
        let pinned = self.pinned_for_plan(plan, held);
        let mut free: Vec<u64> = usage.iter().map(|u| u64::from(u.free)).collect();
        let mut cached: Vec<u64> = usage.iter().map(|u| u64::from(u.cached)).collect();
        let mut counts: Vec<u64> = (0..self.groups()).map(|g| self.checkpoint_blocks(g)).collect();
        let started = self.seqs.values().filter(|s| s.started).count() as u64;
        let mut expected_skips = vec![[0u64; 5]; self.groups()];
        let mut taken: HashSet<(usize, u32)> = HashSet::new();
        let mut trace = String::new();
        for (row, &id) in plan.seq_ids.iter().enumerate() {
            for sp in &plan.state {
                let g = sp.group as usize;
                let pool = self.s.pool(g);
                let shared = self.s.groups.iter().filter(|(_, p)| *p == pool).count() > 1;
                let config = self.s.state(g).ok_or("state")?.clone();
                let cmax = sp.max_checkpoints;
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
                        ensure!(
                            initial > 0 && self.carries(g, initial as u32, seq.key(step.start)),
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
                for &(p, _) in &written {
                    ensure!(
                        planned.iter().any(|c| c.0 == p),
                        "row {row} wrote a checkpoint at {p}, not among {planned:?}{trace}"
                    );
                }
                // Every state group of the pool promised its sequences its own reserve, and a
                // checkpoint of any group draws on the same blocks: it must keep every promise.
                let promises: Vec<u64> = (0..self.groups())
                    .filter(|&h| self.s.pool(h) == pool)
                    .filter_map(|h| self.s.state(h))
                    .map(|c| u64::from(c.reserve_per_sequence) * started)
                    .collect();
                let mut kept = Vec::new();
                for &(p, decode_tail) in &planned {
                    let avail = free[pool] + cached[pool];
                    let at_cap = config.checkpoint_cap.is_some_and(|c| counts[g] >= u64::from(c));
                    let victims = at_cap
                        && self.carried[pool].keys().any(|&b| {
                            !pinned[pool].contains(&b) && self.own_checkpoint(g, b, decode_tail)
                        });
                    let fits = promises.iter().all(|&reserve| avail > reserve);
                    let take = fits && (!at_cap || victims);
                    let block = written.iter().find(|w| w.0 == p).map(|w| w.1);
                    ensure!(
                        take == block.is_some(),
                        "row {row} group {g}: checkpoint at {p} (decode tail {decode_tail}) {} \
                         with {} free, {} cached, reserves {promises:?}, {} checkpoints of cap {:?}, \
                         {} of its own to evict{trace}",
                        if take {
                            "skipped (budget), expected taken"
                        } else {
                            "taken, expected skipped (budget)"
                        },
                        free[pool],
                        cached[pool],
                        counts[g],
                        config.checkpoint_cap,
                        if victims { "some" } else { "none" }
                    );
                    let Some(block) = block else {
                        expected_skips[g][SkipReason::Budget.index()] += 1;
                        ensure!(
                            !self.s.never_evicts,
                            "row {row}: budget skip at {p} in pools that never run out"
                        );
                        self.saw(if !fits && avail > 0 {
                            "reserve skipped a checkpoint"
                        } else if fits {
                            "cap skipped a checkpoint"
                        } else {
                            "checkpoint skipped in an exhausted pool"
                        });
                        continue;
                    };
                    kept.push((p, block, decode_tail));
                    counts[g] += 1;
                    if !at_cap && free[pool] > 0 {
                        free[pool] -= 1;
                        continue;
                    }
                    // An eviction: at the cap among the group's own checkpoints, else the
                    // pool's least recently used block.
                    cached[pool] -= 1;
                    let event = events.next().ok_or("a checkpoint allocation evicted nothing")?;
                    let CacheEvent::BlockRemoved { group, block: victim, .. } = &event else {
                        return Err(format!("build_plan emitted {event:?}"));
                    };
                    let (vg, victim) = (*group as usize, *victim);
                    let ordered = if at_cap {
                        ensure!(
                            vg == g && self.own_checkpoint(g, victim, decode_tail),
                            "group {g} at its cap evicted block {victim} of group {vg}, not one \
                             of its own {}",
                            if decode_tail { "decode tails" } else { "checkpoints" }
                        );
                        self.check_victim(pool, victim, &pinned[pool], |b| {
                            self.own_checkpoint(g, b, decode_tail)
                        })?
                    } else {
                        self.check_victim(pool, victim, &pinned[pool], |_| true)?
                    };
                    if ordered {
                        self.saw("eviction ordered by recency");
                    }
                    if self.s.state(vg).is_some() {
                        counts[vg] -= 1;
                    }
                    self.remove_block(&event, &pinned)?;
                    self.saw(match (at_cap, decode_tail) {
                        (true, true) => "decode tail replaced a decode tail at the cap",
                        (true, false) if shared => "cap evicted own checkpoint with a shared pool",
                        (true, false) => "checkpoint cap evicted",
                        (false, _) if vg != g => "checkpoint evicted another group's block",
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
                        !pinned[pool].contains(&block)
                            && !self.carried[pool].contains_key(&block)
                            && taken.insert((pool, block))
                            && block as i32 != running
                            && block as i32 != initial,
                        "checkpoint block {block} at {p} is not fresh: pinned {}, carries {:?}, \
                         running {running}, initial {initial}",
                        pinned[pool].contains(&block),
                        self.carried[pool]
                            .get(&block)
                            .map(|k| k.iter().map(|(g, p)| (*g, p.len)).collect::<Vec<_>>())
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
        }
        for (p, now) in self.m.pool_usage().iter().enumerate() {
            ensure!(
                u64::from(now.free) == free[p] && u64::from(now.cached) == cached[p],
                "pool {p} after build_plan: {now:?}, expected {} free and {} cached",
                free[p],
                cached[p]
            );
        }
        Ok(())
    }
}
