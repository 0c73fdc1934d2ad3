//! The protocol calls as the driver makes them: each predicts the call's outcome (errors
//! included), makes it, and checks the answer, the events and the block accounting against the
//! model before updating it.

use std::collections::HashSet;

use prefixcache_core::limits::MAX_LOOKAHEAD_TOKENS;
use prefixcache_core::{Added, CacheError, CacheEvent, ExtraKeys, PoolUsage, Scheduled};

use crate::extra;
use crate::ops::{AddOp, Op};
use crate::reference::{
    boundaries, sorted, Model, Retained, SeqModel, StepModel, Stored, UNKNOWN_ID,
};
use crate::setup::Kind;

/// Block accounting across the sequences of one `schedule_batch`, per pool.
struct Batch {
    /// Free blocks left.
    free: Vec<u64>,
    /// At most this many cached blocks left (pins are not known one by one).
    cached: Vec<u64>,
    /// New blocks taken, cached blocks the hits may have pinned, blocks evicted.
    need: Vec<u64>,
    pins: Vec<u64>,
    evicted: Vec<u64>,
    /// The call's `BlockRemoved` events, consumed in allocation order.
    events: std::vec::IntoIter<CacheEvent>,
    /// Keyed blocks in use, which no eviction may take.
    held: Vec<HashSet<u32>>,
    /// Blocks the first schedules of this call may have pinned without showing it.
    maybe: Vec<HashSet<u32>>,
}

impl Model {
    pub(crate) fn apply(&mut self, op: &Op) -> Result<(), String> {
        match *op {
            Op::Add(ref add) => self.add(add),
            Op::AddBatch { ref adds, threads } => self.add_batch(adds, usize::from(threads)),
            Op::Lookup { pick } => self.lookup(self.pick(pick, SeqModel::any)),
            Op::Schedule { pick, budget, exact, lookahead } => self.schedule(
                &[self.pick(pick, SeqModel::runnable)],
                &[budget],
                lookahead,
                exact,
                false,
            ),
            Op::ScheduleBatch { budget, exact, everyone } => {
                let ids = self.ids(if everyone { SeqModel::any } else { SeqModel::runnable });
                self.schedule(&ids, &vec![budget; ids.len()], 0, exact, true)
            }
            Op::ScheduleSuggested { pick, budget } => {
                self.schedule_suggested(self.pick(pick, SeqModel::runnable), budget)
            }
            Op::RequestCheckpoint { pick, position } => {
                self.request_checkpoint(self.pick(pick, SeqModel::scheduled), position)
            }
            Op::BuildPlan => self.build_plan(),
            Op::Commit { which } => self.commit(which),
            Op::Abort { which } => self.abort(which),
            Op::Append { pick, len } => {
                let tokens = self.fresh_tokens(usize::from(len));
                self.append(&[self.pick(pick, SeqModel::decoding)], &tokens, false)
            }
            Op::Finish { pick } => self.release(self.pick(pick, SeqModel::any), true),
            Op::Preempt { pick } => self.release(self.pick(pick, SeqModel::any), false),
            Op::Reset => self.reset(),
            Op::Step { budget, exact, request, abort } => self.step(budget, exact, request, abort),
            Op::Decode { len, budget, rounds } => {
                for _ in 0..rounds {
                    self.decode(len, budget)?;
                }
                Ok(())
            }
            Op::Hostile { what, pick } => self.hostile(what, pick),
        }
    }

    /// A decode round: `len` sampled tokens for every sequence whose prompt is computed (one
    /// `append_batch` for one token), then a step.
    fn decode(&mut self, len: u8, budget: u32) -> Result<(), String> {
        if self.in_flight.is_some() {
            self.commit(0)?;
            self.check_all()?;
        }
        let ids = self.ids(SeqModel::decoding);
        if len == 1 {
            let tokens = self.fresh_tokens(ids.len());
            self.append(&ids, &tokens, true)?;
        } else {
            for id in ids {
                let tokens = self.fresh_tokens(usize::from(len));
                self.append(&[id], &tokens, false)?;
            }
        }
        self.check_all()?;
        self.step(budget, false, None, false)?;
        self.check_all()
    }

    /// One engine step, with `check_all` between its calls: what is in flight is committed
    /// first; every runnable sequence is scheduled (every other one with half the budget); one
    /// may get an explicit checkpoint request; the plan is built and committed (or aborted).
    fn step(
        &mut self,
        budget: u32,
        exact: bool,
        request: Option<u8>,
        abort: bool,
    ) -> Result<(), String> {
        if self.in_flight.is_some() {
            self.commit(0)?;
            self.check_all()?;
        }
        let ids = self.ids(SeqModel::runnable);
        if ids.is_empty() {
            return Ok(());
        }
        // Sequences advance at different speeds: every other one gets half the budget.
        let budgets: Vec<u32> =
            (0..ids.len()).map(|i| if i % 2 == 0 { budget } else { budget / 2 }).collect();
        self.schedule(&ids, &budgets, 0, exact, true)?;
        self.check_all()?;
        if let Some(position) = request {
            self.request_checkpoint(self.pick(position, SeqModel::scheduled), position)?;
            self.check_all()?;
        }
        self.build_plan()?;
        self.check_all()?;
        if abort {
            self.abort(0)
        } else {
            self.commit(0)
        }
    }

    pub(crate) fn add(&mut self, add: &AddOp) -> Result<(), String> {
        let known: Vec<u64> = self.seqs.keys().chain(self.finished.keys()).copied().collect();
        let id = match add.reuse {
            Some(r) if !known.is_empty() => known[usize::from(r) % known.len()],
            _ => {
                self.next_id += 1;
                self.next_id
            }
        };
        self.add_with_id(add, id)
    }

    /// `add` of a prompt under the id `id`, then its twin if asked.
    pub(crate) fn add_with_id(&mut self, add: &AddOp, id: u64) -> Result<(), String> {
        let AddOp { source, len, suffix, extends, twin, ref extra, .. } = *add;
        let known: Vec<(u64, Vec<u32>, ExtraKeys)> = self
            .seqs
            .iter()
            .map(|(&id, s)| (id, s.tokens.clone(), s.extra.clone()))
            .chain(self.finished.iter().map(|(&id, (t, e))| (id, t.clone(), e.clone())))
            .collect();
        let (mut tokens, base): (Vec<u32>, Option<&ExtraKeys>) =
            if source % 4 == 0 || known.is_empty() {
                let base = u32::from(source / 4 % 3) * 10_000;
                ((base..base + u32::from(len)).collect(), None)
            } else {
                let (_, t, e) = &known[usize::from(source) % known.len()];
                (t[..t.len().min(usize::from(len))].to_vec(), Some(e))
            };
        tokens.extend(self.fresh_tokens(usize::from(suffix)));
        let keys = extra::resolve(extra, tokens.len() as u32, base);
        let extends = extends.map(|e| {
            if known.is_empty() || e % 8 == 7 {
                UNKNOWN_ID
            } else {
                known[usize::from(e) % known.len()].0
            }
        });
        if !self.add_sequence(id, tokens.clone(), keys.clone(), extends)? {
            return Ok(());
        }
        if twin {
            // The same prompt again, as a concurrent request extending the first one.
            self.next_id += 1;
            self.add_sequence(self.next_id, tokens, keys, Some(id))?;
        }
        Ok(())
    }

    /// `add`, checking what it reused from `extends` (or a live prefix). Returns whether the
    /// sequence was added.
    pub(crate) fn add_sequence(
        &mut self,
        id: u64,
        tokens: Vec<u32>,
        keys: ExtraKeys,
        extends: Option<u64>,
    ) -> Result<bool, String> {
        let usage = self.m.pool_usage();
        let result = self.m.add(id, &tokens, keys.clone(), extends);
        self.check_add(id, tokens, keys, extends, result, &usage)
    }

    /// Checks what `add` (or `add_batch`, for one of its requests) returned for this request
    /// against the model, `usage` being the pools before the call, and records the sequence.
    /// Returns whether it was added.
    pub(crate) fn check_add(
        &mut self,
        id: u64,
        tokens: Vec<u32>,
        keys: ExtraKeys,
        extends: Option<u64>,
        result: Result<Added, CacheError>,
        usage: &[PoolUsage],
    ) -> Result<bool, String> {
        let refusal = extra::refusal(&keys, tokens.len() as u32);
        if self.seqs.contains_key(&id) || refusal.is_some() {
            // Both refusals apply when both are wrong; which one is reported is not specified.
            let duplicate =
                matches!(result, Err(CacheError::DuplicateSequence { seq_id }) if seq_id == id);
            let invalid = matches!(result, Err(CacheError::InvalidRequest { .. }));
            ensure!(
                (duplicate && self.seqs.contains_key(&id)) || (invalid && refusal.is_some()),
                "add of {id} (live: {}, extra keys {refusal:?}: {keys:?}): {result:?}",
                self.seqs.contains_key(&id)
            );
            if invalid {
                self.saw(match refusal {
                    Some("unsorted") => "add refused unsorted multimodal inputs",
                    Some("beyond a bound") => "add refused extra keys beyond a bound",
                    _ => "add refused a malformed multimodal input",
                });
            }
            ensure!(self.m.pool_usage() == usage, "a refused add changed the pools");
            self.expect_no_events("a refused add")?;
            return Ok(false);
        }
        let added = result.map_err(|e| format!("add {id}: {e}"))?;
        let unit = self.unit as usize;
        let new_keys = self.learn(&tokens, &keys)?;
        let other: Option<(Vec<u32>, ExtraKeys)> = extends.and_then(|e| {
            self.seqs
                .get(&e)
                .map(|s| (s.tokens.clone(), s.extra.clone()))
                .or_else(|| self.finished.get(&e).cloned())
        });
        // Without `extends`: the live sequence added last with the same first unit (its key:
        // tokens, salt, adapter and the inputs on it).
        let first = new_keys.first().filter(|_| self.s.reuse_live_prefixes && extends.is_none());
        let live = first
            .and_then(|f| self.live_first.get(f))
            .map(|o| (self.seqs[o].tokens.clone(), self.seqs[o].extra.clone()));
        let source = other.as_ref().or(live.as_ref());
        let reused_units = source.map_or(0, |(t, e)| {
            extra::reusable_units(self.unit, (&tokens, &keys), (t, e)).min(t.len() / unit)
        });
        ensure!(
            added.extends_found == other.is_some()
                && added.reused_tokens as usize == reused_units * unit
                && added.hashed_units as usize == tokens.len() / unit - reused_units,
            "add {id} extending {extends:?}: {added:?}, expected {reused_units} reused units"
        );
        if let Some((t, e)) = source {
            // What may be reused at all: the other sequence's keys are this one's there.
            let other_keys = self.idents.keys(self.unit, t, e);
            ensure!(
                other_keys.iter().zip(&new_keys).take(reused_units).all(|(a, b)| a == b),
                "add {id} may reuse {reused_units} units whose keys differ"
            );
            let common = tokens.iter().zip(t).take_while(|(a, b)| a == b).count() / unit;
            if reused_units < common.min(t.len() / unit) {
                self.saw("add reuse stopped by an extra key");
            }
        }
        if reused_units > 0 {
            self.saw(if other.is_some() {
                "add reused hashes"
            } else {
                "add reused a live prefix"
            });
            if !keys.multimodal.is_empty() {
                self.saw("add reused hashes of a prompt with images");
            }
        }
        if let Some(&f) = new_keys.first().filter(|_| self.s.reuse_live_prefixes) {
            self.live_first.insert(f, id);
        }
        self.finished.remove(&id);
        self.seqs.insert(id, SeqModel::new(tokens, keys, new_keys, self.groups()));
        self.expect_no_events("add")?;
        Ok(true)
    }

    pub(crate) fn schedule_error(
        &self,
        ids: &[u64],
        lookahead: u32,
        batch: bool,
    ) -> Option<&'static str> {
        if self.in_flight.is_some() {
            return Some("Step");
        }
        let mut seen = HashSet::new();
        for id in ids {
            let Some(seq) = self.seqs.get(id) else { return Some("UnknownSequence") };
            if seq.step.is_some() {
                return Some("Step");
            }
            if seq.num_computed >= seq.num_tokens() {
                return Some("NothingToSchedule");
            }
            if !batch && lookahead > 0 && self.s.has_state() {
                return Some("InvalidRequest");
            }
            if !seen.insert(*id) {
                return Some("Step");
            }
        }
        None
    }

    /// New blocks a chunk allocating up to `alloc_end` needs, and the most cached blocks its
    /// hit can pin, per pool.
    pub(crate) fn blocks_needed(
        &self,
        rows: &[Vec<i32>],
        hit: Option<u32>,
        alloc_end: u32,
    ) -> (Vec<u64>, Vec<u64>) {
        let pools = self.s.pools.len();
        let (mut need, mut pins) = (vec![0u64; pools], vec![0u64; pools]);
        for ((kind, pool), row) in self.s.groups.iter().zip(rows) {
            let pool = *pool;
            match *kind {
                Kind::Full { block } | Kind::Window { block, .. } => {
                    let cols = alloc_end.div_ceil(block);
                    let have = hit.map_or(row.len() as u32, |h| h / block);
                    need[pool] += u64::from(cols.saturating_sub(have));
                    if let Some(h) = hit {
                        let first_col = match *kind {
                            Kind::Window { window, .. } => h.saturating_sub(window) / block,
                            _ => 0,
                        };
                        pins[pool] += u64::from((h / block).saturating_sub(first_col));
                        pins[pool] += u64::from(h % block != 0);
                    }
                }
                Kind::State(_) => {
                    if let Some(h) = hit {
                        need[pool] += 2;
                        pins[pool] += u64::from(h > 0);
                    }
                }
            }
        }
        (need, pins)
    }

    /// `schedule` (one id) or `schedule_batch`, with one token budget per id.
    pub(crate) fn schedule(
        &mut self,
        ids: &[u64],
        budgets: &[u32],
        lookahead: u32,
        exact: bool,
        batch: bool,
    ) -> Result<(), String> {
        let mut expected_error = self.schedule_error(ids, lookahead, batch);
        // Beyond the bound the lookahead is refused; against the other refusals the order of
        // the checks is not specified.
        let beyond = !batch && lookahead > MAX_LOOKAHEAD_TOKENS;
        if beyond && expected_error.is_none() {
            expected_error = Some("InvalidRequest");
        }
        let usage = self.m.pool_usage();
        let stats = self.m.stats();
        let held = self.held()?;
        let rows_before = ids.iter().map(|&id| self.rows(id)).collect::<Result<Vec<_>, _>>()?;
        let result = if batch {
            self.m.schedule_batch(ids, budgets, exact)
        } else {
            self.m.schedule(ids[0], budgets[0], lookahead, exact).map(|r| vec![r])
        };
        let results = match (expected_error, result) {
            (Some(kind), Err(e)) => {
                ensure!(
                    e.kind() == kind || (beyond && e.kind() == "InvalidRequest"),
                    "schedule {ids:?}: expected a {kind} error, got {e}"
                );
                if beyond {
                    self.saw("lookahead beyond the limit refused");
                }
                ensure!(
                    self.m.pool_usage() == usage && self.m.stats() == stats,
                    "a refused schedule changed the pools or the statistics"
                );
                return self.expect_no_events("a refused schedule");
            }
            (None, Ok(results)) => results,
            (expected, got) => {
                return Err(format!("schedule {ids:?}: expected error {expected:?}, got {got:?}"))
            }
        };
        ensure!(results.len() == ids.len(), "schedule_batch returned {} results", results.len());
        let pools = self.s.pools.len();
        let mut batch = Batch {
            free: usage.iter().map(|u| u64::from(u.free)).collect(),
            cached: usage.iter().map(|u| u64::from(u.cached)).collect(),
            need: vec![0; pools],
            pins: vec![0; pools],
            evicted: vec![0; pools],
            events: self.events()?.into_iter(),
            held,
            maybe: vec![HashSet::new(); pools],
        };
        for (((&id, &budget), result), rows) in
            ids.iter().zip(budgets).zip(results).zip(rows_before)
        {
            self.check_scheduled((id, budget), (lookahead, exact), result, rows, &mut batch)?;
        }
        let rest: Vec<CacheEvent> = batch.events.collect();
        ensure!(rest.is_empty(), "schedule evicted more than it allocated: {rest:?}");
        self.check_schedule_usage(&usage, &batch.need, &batch.pins, &batch.evicted)
    }

    /// One sequence's schedule result: the hit and chunk the model predicts, the blocks taken
    /// (free ones first, then evictions, applied in order), and the admission.
    /// An admission's prompt tokens (the prefix-cache queries) and, per group, why its own
    /// hit stopped short.
    fn count_admission(&mut self, id: u64, hit: Option<&prefixcache_core::Hit>) {
        self.stats.admitted_tokens += self.seqs[&id].tokens.len() as u64;
        for g in hit.map_or(&[][..], |h| &h.groups[..]) {
            if let Some(reason) = g.stop {
                self.stats.groups[g.group as usize].misses[reason.index()] += 1;
            }
        }
    }

    fn check_scheduled(
        &mut self,
        (id, budget): (u64, u32),
        (lookahead, exact): (u32, bool),
        result: Option<Scheduled>,
        rows: Vec<Vec<i32>>,
        batch: &mut Batch,
    ) -> Result<(), String> {
        let pools = self.s.pools.len();
        let seq = self.seq(id)?;
        let first = !seq.started;
        let hit = first.then(|| self.expected_hit(seq));
        let start = hit.as_ref().map_or(seq.num_computed, |h| h.tokens);
        let total = seq.num_tokens();
        let mut end = start.saturating_add(budget).min(total);
        if end < total && !exact {
            end = end / self.s.chunk_alignment() * self.s.chunk_alignment();
        }
        let end = end.max(start);
        let (need, pins) =
            self.blocks_needed(&rows, hit.as_ref().map(|h| h.tokens), end + lookahead);
        self.saw(match (&result, end > start) {
            (None, _) => "schedule refused",
            (Some(_), false) => "schedule of 0 tokens",
            (Some(_), true) if first && start > 0 => "first schedule from a hit",
            (Some(_), true) => "schedule",
        });
        if result.is_some() && end > start && start % self.s.chunk_alignment() != 0 {
            self.saw("chunk starts off the grid");
        }
        let Some(scheduled) = result else {
            self.stats.refused_schedules += 1;
            ensure!(
                !self.s.never_evicts || lookahead >= MAX_LOOKAHEAD_TOKENS,
                "schedule of {id} refused with pools that never run out"
            );
            ensure!(end > start, "schedule of {id} refused a chunk of 0 tokens");
            ensure!(
                (0..pools)
                    .any(|p| need[p] + pins[p] + batch.pins[p] > batch.free[p] + batch.cached[p]),
                "schedule of {id} refused although every pool could supply {need:?} new blocks \
                 and {pins:?} pins (free {:?}, cached {:?})",
                batch.free,
                batch.cached
            );
            return Ok(());
        };
        let junction = hit.as_ref().and_then(|h| h.junction);
        let expected = Scheduled { seq_id: id, num_computed: start, num_tokens: end - start, hit };
        ensure!(
            scheduled == expected,
            "schedule of {id}:\n  got      {scheduled:?}\n  expected {expected:?}"
        );
        if end == start {
            return Ok(());
        }
        self.stats.scheduled_tokens += u64::from(end - start);
        if first {
            self.stats.admissions += 1;
            self.stats.admitted_hit_tokens += u64::from(start);
            self.count_admission(id, expected.hit.as_ref());
            for g in 0..self.groups() {
                self.stats.groups[g].hit_tokens += u64::from(start);
                if start > 0 && self.s.state(g).is_some() {
                    self.stats.groups[g].checkpoint_hits += 1;
                }
            }
        }
        let evicted = Self::take_blocks(&need, &pins, batch)?;
        // The hit was pinned before anything was allocated: the rows' hit columns, and maybe a
        // copy source or resume checkpoint among the holders of the key at the hit.
        let rows_now = self.rows(id)?;
        if first {
            self.check_hit_choices(id, start, &rows_now, batch)?;
            let pins = self.possible_pins(self.seq(id)?, start);
            for (pool, blocks) in pins.into_iter().enumerate() {
                batch.maybe[pool].extend(blocks);
            }
        }
        let mut excluded: Vec<HashSet<u32>> =
            batch.held.iter().zip(&batch.maybe).map(|(h, m)| h | m).collect();
        for (g, row) in rows_now.iter().enumerate() {
            excluded[self.s.pool(g)].extend(row.iter().filter(|&&b| b != 0).map(|&b| b as u32));
        }
        let mut seen = vec![0u64; pools];
        for _ in 0..evicted.iter().sum::<u64>() {
            let event =
                batch.events.next().ok_or("fewer evictions than allocations from the LRU")?;
            if let CacheEvent::BlockRemoved { group, block, .. } = &event {
                let pool = self.s.pool(*group as usize);
                if self.check_victim(pool, *block, &excluded[pool], |_| true)? {
                    self.saw("eviction ordered by recency");
                }
            }
            seen[self.remove_block(&event, &batch.held)?] += 1;
            self.saw("schedule evicted a block");
        }
        ensure!(seen == evicted, "evictions per pool {seen:?}, expected {evicted:?}");
        self.admit(id, (first, start, end), junction, rows)?;
        self.check_rows_after_schedule(id, end + lookahead, &batch.held)?;
        for (g, row) in self.rows(id)?.into_iter().enumerate() {
            batch.held[self.s.pool(g)]
                .extend(row.into_iter().filter(|&b| b != 0).map(|b| b as u32));
        }
        Ok(())
    }

    /// Takes a chunk's new blocks from the batch's accounting: free blocks first, then the
    /// least recently used cached ones. Returns the evictions per pool.
    fn take_blocks(need: &[u64], pins: &[u64], batch: &mut Batch) -> Result<Vec<u64>, String> {
        let pools = need.len();
        let mut evicted = vec![0u64; pools];
        for p in 0..pools {
            ensure!(
                need[p] <= batch.free[p] + batch.cached[p],
                "pool {p} supplied {} blocks with {} free and {} cached",
                need[p],
                batch.free[p],
                batch.cached[p]
            );
            evicted[p] = need[p].saturating_sub(batch.free[p]);
            batch.free[p] -= need[p] - evicted[p];
            batch.cached[p] -= evicted[p];
            batch.need[p] += need[p];
            batch.pins[p] += pins[p];
            batch.evicted[p] += evicted[p];
        }
        Ok(evicted)
    }

    /// The hit columns of a first schedule use the copies the recency rule names.
    fn check_hit_choices(
        &mut self,
        id: u64,
        hit: u32,
        rows: &[Vec<i32>],
        batch: &Batch,
    ) -> Result<(), String> {
        for (g, row) in rows.iter().enumerate() {
            let (block, first_col) = match self.s.groups[g].0 {
                Kind::Full { block } => (block, 0),
                Kind::Window { block, window } => (block, hit.saturating_sub(window) / block),
                Kind::State(_) => continue,
            };
            let pool = self.s.pool(g);
            for c in first_col..hit / block {
                let key = self.seq(id)?.key((c + 1) * block);
                let chosen = row[c as usize] as u32;
                if let Some(rule) =
                    self.check_hit_choice(g, key, chosen, &batch.held[pool], &batch.maybe[pool])?
                {
                    self.saw(rule);
                }
            }
        }
        Ok(())
    }

    /// Free blocks are used before cached ones; pins move cached blocks to owned.
    pub(crate) fn check_schedule_usage(
        &self,
        before: &[PoolUsage],
        need: &[u64],
        pins: &[u64],
        evicted: &[u64],
    ) -> Result<(), String> {
        let after = self.m.pool_usage();
        for p in 0..before.len() {
            let (b, a) = (&before[p], &after[p]);
            ensure!(
                u64::from(b.free) - u64::from(a.free) == need[p] - evicted[p],
                "pool {p}: free {} -> {} for {} new blocks, {} evicted",
                b.free,
                a.free,
                need[p],
                evicted[p]
            );
            let pinned = i64::from(a.owned) - i64::from(b.owned) - need[p] as i64;
            ensure!(
                pinned >= 0 && pinned as u64 <= pins[p],
                "pool {p}: owned {} -> {} for {} new blocks and at most {} pins",
                b.owned,
                a.owned,
                need[p],
                pins[p]
            );
            ensure!(
                i64::from(b.cached) - i64::from(a.cached) == pinned + evicted[p] as i64,
                "pool {p}: cached {} -> {} with {pinned} pinned and {} evicted",
                b.cached,
                a.cached,
                evicted[p]
            );
        }
        Ok(())
    }

    /// Records a scheduled chunk `(first, start, end)`; `junction` is the first schedule's.
    pub(crate) fn admit(
        &mut self,
        id: u64,
        (first, start, end): (bool, u32, u32),
        junction: Option<u32>,
        rows_before: Vec<Vec<i32>>,
    ) -> Result<(), String> {
        let groups = self.groups();
        let seq = self.seq_mut(id)?;
        if first {
            seq.started = true;
            seq.num_computed = start;
            seq.prefill_target = seq.num_tokens();
            seq.junction = junction;
        }
        seq.step = Some(StepModel {
            start,
            end,
            first,
            requested: Vec::new(),
            rows_before,
            table: vec![Vec::new(); groups],
            cow: vec![None; groups],
            written: vec![Vec::new(); groups],
            running: vec![-1; groups],
            resume: vec![0; groups],
        });
        self.scheduled.push(id);
        Ok(())
    }

    /// The table holds the hit's blocks (published under the right keys) and fresh blocks.
    pub(crate) fn check_rows_after_schedule(
        &self,
        id: u64,
        alloc_end: u32,
        held: &[HashSet<u32>],
    ) -> Result<(), String> {
        let seq = self.seq(id)?;
        let step = seq.step.as_ref().ok_or("no step")?;
        for g in 0..self.groups() {
            let Some(block) = self.s.block_size(g) else { continue };
            let row = self.row(g, id)?;
            let before = &step.rows_before[g];
            let cols = alloc_end.div_ceil(block) as usize;
            let fresh_from = if step.first {
                ensure!(
                    row.len() == cols,
                    "row of {id} has {} columns, expected {cols}",
                    row.len()
                );
                let full = (step.start / block) as usize;
                let first_col = match self.s.groups[g].0 {
                    Kind::Window { window, .. } => {
                        (step.start.saturating_sub(window) / block) as usize
                    }
                    _ => 0,
                };
                for (c, &b) in row.iter().enumerate().take(full) {
                    if c < first_col {
                        ensure!(b == 0, "column {c} outside the window holds block {b}");
                    } else {
                        let key = seq.key((c as u32 + 1) * block);
                        ensure!(
                            self.carries(g, b as u32, key),
                            "hit column {c} of {id} holds block {b}, not published there"
                        );
                    }
                }
                full
            } else {
                ensure!(
                    row.len() == cols.max(before.len()) && row.starts_with(before),
                    "row of {id} changed from {before:?} to {row:?}"
                );
                before.len()
            };
            let fresh = &row[fresh_from..];
            ensure!(
                fresh.iter().all(|&b| b > 0
                    && !held[self.s.pool(g)].contains(&(b as u32))
                    && !self.carried[self.s.pool(g)].contains_key(&(b as u32)))
                    && sorted(fresh.to_vec()).windows(2).all(|w| w[0] != w[1]),
                "new blocks {fresh:?} of {id} are not fresh"
            );
        }
        Ok(())
    }

    pub(crate) fn suggested_chunk(&self, seq: &SeqModel, token_budget: u32) -> u32 {
        let (start, target, junction) = if seq.started {
            (seq.num_computed, seq.prefill_target, seq.junction)
        } else {
            let hit = self.expected_hit(seq);
            (hit.tokens, seq.num_tokens(), hit.junction)
        };
        let budget = token_budget.min(seq.num_tokens().saturating_sub(start));
        let mut best: Option<u32> = None;
        for g in 0..self.groups() {
            // Only a backend that cannot export interior states (C = 0) cuts chunks.
            let Some(state) = self.s.state(g).filter(|s| s.max_checkpoints_per_step == Some(0))
            else {
                continue;
            };
            // Chunking with C = 0: the next retained position within the budget,
            // found by walking the unit boundaries (every retained position is one).
            let retained = Retained::of(&state.retention, self.unit, target, junction);
            let next = boundaries(self.unit, start, start + budget).find(|&p| retained.holds(p));
            if let Some(p) = next.filter(|&p| best.is_none_or(|b| p < b)) {
                best = Some(p);
            }
        }
        best.map_or(budget, |p| p - start)
    }

    pub(crate) fn schedule_suggested(&mut self, id: u64, budget: u32) -> Result<(), String> {
        let result = self.m.suggest_chunk(id, budget);
        let Some(seq) = self.seqs.get(&id) else {
            ensure!(result.is_err(), "suggest_chunk of unknown id: {result:?}");
            return Ok(());
        };
        let expected = self.suggested_chunk(seq, budget);
        ensure!(
            result == Ok(expected),
            "suggest_chunk({id}, {budget}) = {result:?}, expected {expected}"
        );
        self.schedule(&[id], &[expected], 0, false, false)
    }

    pub(crate) fn request_checkpoint(&mut self, id: u64, position: u8) -> Result<(), String> {
        let unit = self.unit;
        let alignment = self.s.chunk_alignment();
        let chunk = self.seqs.get(&id).and_then(|s| s.step.as_ref()).map(|s| (s.start, s.end));
        let valid: Vec<u32> = chunk.map_or_else(Vec::new, |(s, e)| {
            boundaries(unit, s, e).filter(|&p| p == e || (p - s) % alignment == 0).collect()
        });
        let p = match chunk {
            Some(_) if position < 160 && !valid.is_empty() => {
                valid[usize::from(position) % valid.len()]
            }
            Some((_, e)) => u32::from(position) % (e + unit + 1),
            None => u32::from(position),
        };
        self.request_checkpoint_at(id, p)
    }

    /// `request_checkpoint(id, p)` against the model.
    pub(crate) fn request_checkpoint_at(&mut self, id: u64, p: u32) -> Result<(), String> {
        let unit = self.unit;
        let alignment = self.s.chunk_alignment();
        let chunk = self.seqs.get(&id).and_then(|s| s.step.as_ref()).map(|s| (s.start, s.end));
        let valid: Vec<u32> = chunk.map_or_else(Vec::new, |(s, e)| {
            boundaries(unit, s, e).filter(|&p| p == e || (p - s) % alignment == 0).collect()
        });
        let result = self.m.request_checkpoint(id, p);
        let expected = if self.in_flight.is_some() {
            Some("Step")
        } else if !self.seqs.contains_key(&id) {
            Some("UnknownSequence")
        } else if chunk.is_none() {
            Some("Step")
        } else if !self.s.has_state() {
            Some("InvalidRequest")
        } else if !valid.contains(&p) {
            Some("Alignment")
        } else {
            None
        };
        match (expected, result) {
            (None, Ok(())) => {
                self.saw("checkpoint requested");
                let step = self.seq_mut(id)?.step.as_mut().ok_or("no step")?;
                if !step.requested.contains(&p) {
                    step.requested.push(p);
                }
            }
            (
                Some("Alignment"),
                Err(CacheError::Alignment {
                    position,
                    offset,
                    alignment: a,
                    chunk_start,
                    reason,
                    valid: text,
                }),
            ) => {
                self.saw("checkpoint request off the grid");
                let (s, e) = chunk.ok_or("no chunk")?;
                // The rule it breaks, by precedence: the chunk's range, the unit, the grid.
                let broken = if p <= s || p > e {
                    "outside the chunk"
                } else if p % self.unit != 0 {
                    "hash unit"
                } else {
                    "alignment"
                };
                ensure!(reason.contains(broken), "AlignmentError for {p} in ({s}, {e}]: {reason}");
                ensure!(
                    position == p
                        && offset == i64::from(p) - i64::from(s)
                        && a == alignment
                        && chunk_start == s,
                    "AlignmentError fields for {p} in a chunk from {s}"
                );
                let below = valid.iter().rev().find(|&&v| v < p);
                let above = valid.iter().find(|&&v| v > p);
                for near in below.into_iter().chain(above) {
                    ensure!(
                        text.contains(&near.to_string()),
                        "AlignmentError '{text}' does not name {near}"
                    );
                }
            }
            (Some(kind), Err(e)) => {
                ensure!(
                    e.kind() == kind,
                    "request_checkpoint({id}, {p}): expected {kind}, got {e}"
                );
            }
            (expected, got) => {
                return Err(format!(
                    "request_checkpoint({id}, {p}): expected {expected:?}, got {got:?}"
                ))
            }
        }
        self.expect_no_events("request_checkpoint")
    }

    /// The step id a commit or abort names: usually the latest plan, sometimes a stale one.
    pub(crate) fn chosen_step(&self, which: u8) -> Option<u64> {
        let latest = self.built.last().copied()?;
        Some(match which {
            0..=223 => latest,
            224..=239 => self.built[usize::from(which) % self.built.len()],
            _ => latest + 1 + u64::from(which % 3),
        })
    }

    pub(crate) fn commit(&mut self, which: u8) -> Result<(), String> {
        let Some(step_id) = self.chosen_step(which) else { return Ok(()) };
        let result = self.m.commit_step(step_id);
        let Some(plan) = self.in_flight.take_if(|p| p.step_id == step_id) else {
            ensure!(
                matches!(result, Err(CacheError::StalePlan { .. })),
                "commit of step {step_id} (in flight: {:?}): {result:?}",
                self.in_flight.as_ref().map(|p| p.step_id)
            );
            self.saw("stale commit");
            return self.expect_no_events("a refused commit");
        };
        result.map_err(|e| format!("commit: {e}"))?;
        self.stats.commits += 1;
        self.saw("commit");
        let unit = self.unit;
        let mut expected: Vec<Stored> = Vec::new();
        for &id in &plan.seq_ids {
            let seq = self.seq(id)?;
            let step = seq.step.as_ref().ok_or("no step")?;
            for g in 0..self.groups() {
                let prefix = |q: u32| seq.key(q);
                if let Some(block) = self.s.block_size(g) {
                    for q in boundaries(unit, step.start, step.end) {
                        let b = step.table[g][((q - 1) / block) as usize] as u32;
                        expected.push((g, b, prefix(q), false));
                    }
                    if let Some((_, dst, n)) = step.cow[g] {
                        for q in boundaries(unit, step.start - n, step.start) {
                            expected.push((g, dst, prefix(q), false));
                        }
                    }
                } else {
                    for &(p, b, decode_tail) in &step.written[g] {
                        if !decode_tail {
                            expected.push((g, b, prefix(p), true));
                        }
                    }
                }
            }
        }
        let events = self.events()?;
        let stored = self.stored(&events)?;
        ensure!(
            sorted(stored.clone()) == sorted(expected.clone()),
            "commit stored {:?}\n  expected {:?}",
            sorted(stored).iter().map(|s| (s.0, s.1, s.2.len)).collect::<Vec<_>>(),
            sorted(expected).iter().map(|s| (s.0, s.1, s.2.len)).collect::<Vec<_>>()
        );
        for (g, block, prefix, _) in stored {
            self.publish(g, block, prefix);
        }
        for &id in &plan.seq_ids {
            let seq = self.seq_mut(id)?;
            let step = seq.step.take().ok_or("no step")?;
            seq.num_computed = step.end;
            for g in 0..step.running.len() {
                if step.running[g] > 0 {
                    seq.previous[g] = seq.current[g];
                    seq.current[g] = Some(step.running[g]);
                }
                if let Some(&(p, b, _)) = step.written[g].iter().find(|w| w.2) {
                    seq.decode_tail[g] = Some((b, p));
                }
            }
            self.check_rows_after_commit(id)?;
        }
        Ok(())
    }

    /// Paged rows cover every computed token; a sliding window released what left it.
    pub(crate) fn check_rows_after_commit(&mut self, id: u64) -> Result<(), String> {
        let end = self.seq(id)?.num_computed;
        for g in 0..self.groups() {
            let (block, window) = match self.s.groups[g].0 {
                Kind::Full { block } => (block, None),
                Kind::Window { block, window } => (block, Some(window)),
                Kind::State(_) => continue,
            };
            let row = self.row(g, id)?;
            let keep_from = window.map_or(0, |w| (end.saturating_sub(w) / block) as usize);
            if keep_from > 0 {
                self.saw("window released blocks");
            }
            let cols = end.div_ceil(block) as usize;
            ensure!(row.len() >= cols, "row of {id} too short after commit: {row:?}");
            for (c, &b) in row.iter().enumerate().take(cols) {
                ensure!(
                    (b == 0) == (c < keep_from),
                    "group {g} column {c} of {id} holds {b} after computing {end} tokens"
                );
            }
        }
        Ok(())
    }

    pub(crate) fn abort(&mut self, which: u8) -> Result<(), String> {
        let Some(step_id) = self.chosen_step(which) else { return Ok(()) };
        let result = self.m.abort_step(step_id);
        let Some(plan) = self.in_flight.take_if(|p| p.step_id == step_id) else {
            ensure!(
                matches!(result, Err(CacheError::StalePlan { .. })),
                "abort of step {step_id}: {result:?}"
            );
            return self.expect_no_events("a refused abort");
        };
        result.map_err(|e| format!("abort: {e}"))?;
        self.stats.aborts += 1;
        if !plan.seq_ids.is_empty() {
            self.saw("abort of a step");
        }
        self.expect_no_events("abort")?;
        for &id in &plan.seq_ids {
            let seq = self.seq_mut(id)?;
            let step = seq.step.take().ok_or("no step")?;
            if step.first {
                seq.unstart();
            }
            let rows = self.rows(id)?;
            ensure!(
                rows == step.rows_before,
                "abort left {id} with rows {rows:?}, not {:?}",
                step.rows_before
            );
        }
        Ok(())
    }

    // --- append / finish / preempt / reset --------------------------------------------------

    pub(crate) fn append(
        &mut self,
        ids: &[u64],
        tokens: &[u32],
        batch: bool,
    ) -> Result<(), String> {
        let result =
            if batch { self.m.append_batch(ids, tokens) } else { self.m.append(ids[0], tokens) };
        let expected = if self.in_flight.is_some() {
            Some("Step")
        } else if ids.iter().any(|id| !self.seqs.contains_key(id)) {
            Some("UnknownSequence")
        } else {
            None
        };
        match (expected, result) {
            (None, Ok(())) => {
                for (i, &id) in ids.iter().enumerate() {
                    let added = if batch { &tokens[i..=i] } else { tokens };
                    let seq = self.seq_mut(id)?;
                    seq.tokens.extend_from_slice(added);
                    let (all, extra) = (seq.tokens.clone(), seq.extra.clone());
                    let keys = self.learn(&all, &extra)?;
                    self.seq_mut(id)?.keys = keys;
                }
            }
            (Some(kind), Err(e)) => ensure!(e.kind() == kind, "append: expected {kind}, got {e}"),
            (expected, got) => {
                return Err(format!("append {ids:?}: expected {expected:?}, got {got:?}"))
            }
        }
        self.expect_no_events("append")
    }

    pub(crate) fn release(&mut self, id: u64, finish: bool) -> Result<(), String> {
        let result = if finish { self.m.finish(id) } else { self.m.preempt(id) };
        let expected = if self.in_flight.is_some() {
            Some("Step")
        } else if !self.seqs.contains_key(&id) {
            Some("UnknownSequence")
        } else {
            None
        };
        match (expected, result) {
            (None, Ok(())) => {}
            (Some(kind), Err(e)) => {
                ensure!(e.kind() == kind, "finish/preempt: expected {kind}, got {e}");
                return self.expect_no_events("a refused finish/preempt");
            }
            (expected, got) => {
                return Err(format!("release {id}: expected {expected:?}, got {got:?}"))
            }
        }
        self.scheduled.retain(|&s| s != id);
        let seq = self.seq_mut(id)?;
        let decode_tails = std::mem::replace(&mut seq.decode_tail, vec![None; seq.current.len()]);
        seq.unstart();
        let events = self.events()?;
        if !finish {
            ensure!(events.is_empty(), "preempt emitted {events:?}");
            return Ok(());
        }
        let seq = self.seqs.remove(&id).ok_or("gone")?;
        if let Some(f) = seq.keys.first() {
            if self.live_first.get(f) == Some(&id) {
                self.live_first.remove(f);
            }
        }
        let expected: Vec<Stored> = decode_tails
            .iter()
            .enumerate()
            .filter_map(|(g, t)| t.map(|(b, p)| (g, b, seq.key(p), true)))
            .collect();
        let stored = self.stored(&events)?;
        ensure!(
            sorted(stored.clone()) == sorted(expected),
            "finish of {id} stored {stored:?}, expected its decode tails {decode_tails:?}"
        );
        if !stored.is_empty() {
            self.saw("finish published a decode tail");
        }
        for (g, block, prefix, _) in stored {
            self.stats.groups[g].decode_tails_published += 1;
            self.decode_tails[self.s.pool(g)].insert(block);
            self.publish(g, block, prefix);
        }
        self.finished.insert(id, (seq.tokens, seq.extra));
        Ok(())
    }

    pub(crate) fn reset(&mut self) -> Result<(), String> {
        let result = self.m.reset();
        let expected = if self.in_flight.is_some() {
            Some("Step")
        } else if self.seqs.values().any(|s| s.started) {
            Some("ResetRefused")
        } else {
            None
        };
        match (expected, result) {
            (None, Ok(())) => {
                let events = self.events()?;
                ensure!(events == vec![CacheEvent::AllBlocksCleared], "reset emitted {events:?}");
                self.saw("reset");
                for map in &mut self.live {
                    map.clear();
                }
                for map in &mut self.carried {
                    map.clear();
                }
                for set in &mut self.decode_tails {
                    set.clear();
                }
                for set in &mut self.recent {
                    set.clear();
                }
                for (p, u) in self.m.pool_usage().iter().enumerate() {
                    ensure!(u.free + 1 == u.num_blocks, "pool {p} after reset: {u:?}");
                }
                Ok(())
            }
            (Some(kind), Err(e)) => {
                ensure!(e.kind() == kind, "reset: expected {kind}, got {e}");
                self.expect_no_events("a refused reset")
            }
            (expected, got) => Err(format!("reset: expected {expected:?}, got {got:?}")),
        }
    }
}
