//! The fuzz's overlapped traffic: the same wide configurations at `max_steps_in_flight` = D in
//! 1..=3, driven by the calls of overlapped steps with raw arguments (placeholders and their
//! batch forms, `resolve` beyond what is pending, plans built at depth, commits and aborts of
//! the oldest, a later, a stale and a foreign plan, withdrawals, `decode_step_overlapped` with
//! and without its commit, finish and preempt with steps in flight, explicit checkpoints).
//!
//! What it checks after every call is stated here, not taken from the core:
//! - the core's own invariants hold, and no call panics or reports a broken invariant;
//! - the plans in flight are exactly those built and not yet ended, oldest first, never more
//!   than D; only the oldest may end: ending a later one is a step error, ending one that is
//!   not in flight (or another manager's) is a stale plan, and an abort of the oldest ends
//!   every plan in flight and says so, oldest first;
//! - building with D plans in flight is a step error; resolving more tokens than a sequence
//!   has placeholders is an invalid request;
//! - a refused call changes nothing that can be observed (statistics, pools, plans in flight,
//!   every sequence's length, committed position and placeholders), except that the one-call
//!   decode steps commit first when asked to, which stands;
//! - a lookup's pending answer is at least its hit, names a plan only when it is longer, and
//!   that plan is in flight; its junction is a unit boundary in range, two units above the hit;
//! - every plan names each sequence at most once, with at least one token each;
//! - once everything in flight is committed and every sequence finished, no block is owned.

use prefixcache_core::{CacheConfig, CacheManager, ExtraKeys, PoolUsage, Stats, StepPlan};
use proptest::prelude::*;

/// Every id `seq_id` gives.
const IDS: [u64; 7] = [0, 1, 2, 3, 4, 5, u64::MAX];

/// A sequence id: one of a few (`i % 6`), or the top of the `u64` range.
fn seq_id(i: u8) -> u64 {
    if i % 16 == 15 {
        u64::MAX
    } else {
        u64::from(i % 6)
    }
}

/// A count: small, or one of the API's bounds and beyond.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Count {
    Small(u8),
    Max,
    Sequence,
}

impl Count {
    fn get(self) -> u32 {
        match self {
            Count::Small(n) => u32::from(n % 5),
            Count::Max => u32::MAX,
            Count::Sequence => prefixcache_core::MAX_SEQUENCE_TOKENS as u32,
        }
    }
}

/// Which plan a commit, abort or withdrawal names.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Which {
    Oldest,
    Newest,
    /// A plan already ended (or the latest built when none has).
    Stale(u8),
    /// A plan of another manager.
    Foreign,
    /// A step id never built.
    Unbuilt,
}

#[derive(Clone, Debug)]
pub(crate) enum OverlapOp {
    Add {
        id: u8,
        stream: u8,
        len: u8,
    },
    Lookup(u8),
    Schedule {
        id: u8,
        budget: Count,
    },
    /// `schedule_batch` of every live id.
    ScheduleAll {
        budget: Count,
    },
    Placeholders {
        id: u8,
        count: Count,
    },
    /// `append_with_placeholders`.
    AppendWith {
        id: u8,
        tokens: u8,
        count: Count,
    },
    PlaceholdersBatch {
        ids: Vec<u8>,
    },
    Resolve {
        id: u8,
        count: Count,
    },
    ResolveBatch {
        ids: Vec<u8>,
    },
    Append {
        id: u8,
        tokens: u8,
    },
    Build,
    Commit {
        which: Which,
        by_plan: bool,
    },
    Abort {
        which: Which,
        by_plan: bool,
    },
    Withdraw(Which),
    /// `decode_step_overlapped`: commit the oldest first (`commit`), resolve one placeholder
    /// of every sequence that has one (`resolve`), of every live id or of the first few.
    Overlapped {
        commit: bool,
        resolve: bool,
        everyone: bool,
    },
    /// `decode_step` into a plan of the ring (committing it when it is the one in flight).
    DecodeStep {
        ring: u8,
    },
    Finish(u8),
    Preempt(u8),
    RequestCheckpoint {
        id: u8,
        position: Count,
    },
    Reset,
}

fn count() -> impl Strategy<Value = Count> {
    prop_oneof![8 => any::<u8>().prop_map(Count::Small), 1 => Just(Count::Max), 1 => Just(Count::Sequence)]
}

fn which() -> impl Strategy<Value = Which> {
    prop_oneof![
        8 => Just(Which::Oldest),
        2 => Just(Which::Newest),
        1 => any::<u8>().prop_map(Which::Stale),
        1 => Just(Which::Foreign),
        1 => Just(Which::Unbuilt),
    ]
}

pub(crate) fn op() -> impl Strategy<Value = OverlapOp> {
    let ids = || prop::collection::vec(any::<u8>(), 0..=5);
    prop_oneof![
        6 => (any::<u8>(), 0u8..4, 1u8..=48).prop_map(|(id, stream, len)| OverlapOp::Add { id, stream, len }),
        3 => any::<u8>().prop_map(OverlapOp::Lookup),
        4 => (any::<u8>(), count()).prop_map(|(id, budget)| OverlapOp::Schedule { id, budget }),
        6 => count().prop_map(|budget| OverlapOp::ScheduleAll { budget }),
        4 => (any::<u8>(), count()).prop_map(|(id, count)| OverlapOp::Placeholders { id, count }),
        2 => (any::<u8>(), 0u8..4, count()).prop_map(|(id, tokens, count)| OverlapOp::AppendWith { id, tokens, count }),
        2 => ids().prop_map(|ids| OverlapOp::PlaceholdersBatch { ids }),
        5 => (any::<u8>(), count()).prop_map(|(id, count)| OverlapOp::Resolve { id, count }),
        2 => ids().prop_map(|ids| OverlapOp::ResolveBatch { ids }),
        2 => (any::<u8>(), 1u8..4).prop_map(|(id, tokens)| OverlapOp::Append { id, tokens }),
        7 => Just(OverlapOp::Build),
        6 => (which(), any::<bool>()).prop_map(|(which, by_plan)| OverlapOp::Commit { which, by_plan }),
        2 => (which(), any::<bool>()).prop_map(|(which, by_plan)| OverlapOp::Abort { which, by_plan }),
        1 => which().prop_map(OverlapOp::Withdraw),
        8 => (prop::bool::weighted(0.8), prop::bool::weighted(0.8), prop::bool::weighted(0.7))
            .prop_map(|(commit, resolve, everyone)| OverlapOp::Overlapped { commit, resolve, everyone }),
        2 => any::<u8>().prop_map(|ring| OverlapOp::DecodeStep { ring }),
        3 => any::<u8>().prop_map(OverlapOp::Finish),
        2 => any::<u8>().prop_map(OverlapOp::Preempt),
        2 => (any::<u8>(), count()).prop_map(|(id, position)| OverlapOp::RequestCheckpoint { id, position }),
        1 => Just(OverlapOp::Reset),
    ]
}

/// What a refused call must leave as it was.
#[derive(Debug, PartialEq)]
struct Observed {
    stats: Stats,
    pools: Vec<PoolUsage>,
    in_flight: Vec<u64>,
    scheduled_tokens: usize,
    sequences: usize,
    /// Per id: (tokens, computed, placeholders) while it is live.
    per_id: Vec<Option<(u32, u32, u32)>>,
}

pub(crate) struct Overlap {
    m: CacheManager,
    /// Another manager, whose plans are foreign here.
    other: CacheManager,
    depth: usize,
    /// The plans built and not ended, oldest first, as the driver saw them built.
    plans: Vec<StepPlan>,
    /// The latest plans ended.
    ended: Vec<StepPlan>,
    /// The one-call decode steps' ring of plans.
    ring: Vec<StepPlan>,
    next_token: u32,
    unit: u32,
    pub(crate) calls: u64,
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(what())
    }
}

impl Overlap {
    pub(crate) fn new(config: CacheConfig) -> Result<Self, String> {
        let depth = config.max_steps_in_flight as usize;
        let config_unit = config.hash.unit;
        let m = CacheManager::new(config.clone()).map_err(|e| format!("config refused: {e}"))?;
        let mut other = CacheManager::new(config).map_err(|e| e.to_string())?;
        // One plan of the other manager, so that its ids overlap this one's.
        other.build_plan().map_err(|e| e.to_string())?;
        Ok(Self {
            m,
            other,
            depth,
            plans: Vec::new(),
            ended: Vec::new(),
            ring: vec![StepPlan::default(); depth.max(1)],
            next_token: 1,
            unit: config_unit,
            calls: 0,
        })
    }

    fn observe(&self) -> Observed {
        Observed {
            stats: self.m.stats(),
            pools: self.m.pool_usage(),
            in_flight: self.m.plans_in_flight(),
            scheduled_tokens: self.m.scheduled_tokens(),
            sequences: self.m.num_sequences(),
            per_id: IDS
                .iter()
                .map(|&id| {
                    let t = self.m.num_tokens(id).ok()?;
                    Some((t, self.m.num_computed(id).ok()?, self.m.num_placeholders(id).ok()?))
                })
                .collect(),
        }
    }

    fn live(&self) -> Vec<u64> {
        IDS.iter().copied().filter(|&id| self.m.num_tokens(id).is_ok()).collect()
    }

    fn tokens(&mut self, n: usize) -> Vec<u32> {
        let out = (0..n as u32).map(|i| self.next_token.wrapping_add(i) % 50_000).collect();
        self.next_token = self.next_token.wrapping_add(n as u32);
        out
    }

    /// A call that is atomic: refused, it changes nothing; a broken invariant is a failure.
    fn atomic<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut CacheManager) -> prefixcache_core::Result<T>,
    ) -> Result<Option<T>, String> {
        let before = self.observe();
        self.calls += 1;
        match f(&mut self.m) {
            Ok(v) => Ok(Some(v)),
            Err(e) => {
                ensure(e.kind() != "Invariant", || format!("{what}: {e}"))?;
                let after = self.observe();
                ensure(before == after, || {
                    format!("{what} was refused ({e}) but changed\n{before:?}\nto\n{after:?}")
                })?;
                Ok(None)
            }
        }
    }

    fn expect_kind<T: std::fmt::Debug>(
        what: &str,
        got: &prefixcache_core::Result<T>,
        kind: &str,
    ) -> Result<(), String> {
        match got {
            Err(e) if e.kind() == kind => Ok(()),
            other => Err(format!("{what}: expected a {kind} error, got {other:?}")),
        }
    }

    /// The plan `which` names, and whether it is the oldest in flight.
    fn named(&self, which: Which) -> (StepPlan, bool) {
        match which {
            Which::Oldest if !self.plans.is_empty() => (self.plans[0].clone(), true),
            Which::Newest if !self.plans.is_empty() => {
                (self.plans[self.plans.len() - 1].clone(), self.plans.len() == 1)
            }
            Which::Foreign => (StepPlan { manager: self.other.id(), ..StepPlan::default() }, false),
            Which::Unbuilt => {
                (StepPlan { manager: self.m.id(), step_id: u64::MAX, ..StepPlan::default() }, false)
            }
            Which::Stale(i) if !self.ended.is_empty() => {
                (self.ended[usize::from(i) % self.ended.len()].clone(), false)
            }
            _ => (StepPlan { manager: self.m.id(), step_id: 0, ..StepPlan::default() }, false),
        }
    }

    /// A plan that was just built (put in flight): its rows are well formed.
    fn built(&mut self, plan: StepPlan) -> Result<(), String> {
        let mut ids = plan.seq_ids.clone();
        ids.sort_unstable();
        ids.dedup();
        ensure(ids.len() == plan.seq_ids.len(), || {
            format!("plan {plan:?} names a sequence twice")
        })?;
        ensure(plan.num_scheduled.iter().all(|&n| n > 0), || format!("an empty row in {plan:?}"))?;
        self.plans.push(plan);
        Ok(())
    }

    fn ended_oldest(&mut self) {
        let plan = self.plans.remove(0);
        self.ended.push(plan);
        if self.ended.len() > 4 {
            self.ended.remove(0);
        }
    }

    /// One operation and its checks (one arm per call, as `driver.rs`'s).
    #[allow(clippy::too_many_lines)]
    pub(crate) fn apply(&mut self, op: &OverlapOp) -> Result<(), String> {
        match op {
            OverlapOp::Add { id, stream, len } => {
                let mut tokens: Vec<u32> =
                    (0..u32::from(*len)).map(|i| u32::from(*stream) * 100_000 + i).collect();
                if len % 3 == 0 {
                    tokens.extend(self.tokens(3));
                }
                self.atomic("add", |m| m.add(seq_id(*id), &tokens, ExtraKeys::default(), None))?;
            }
            OverlapOp::Lookup(id) => {
                self.calls += 1;
                if let Ok(hit) = self.m.lookup(seq_id(*id)) {
                    ensure(hit.pending_tokens >= hit.tokens, || format!("pending below {hit:?}"))?;
                    ensure(
                        hit.pending_plan.is_some() == (hit.pending_tokens > hit.tokens),
                        || {
                            format!("a pending plan without a longer pending hit (or the reverse): {hit:?}")
                        },
                    )?;
                    if let Some(p) = hit.pending_plan {
                        ensure(self.m.plans_in_flight().contains(&p), || {
                            format!("pending plan {p} is not in flight")
                        })?;
                    }
                    // A junction (in-flight keys counted at D > 1) is a unit boundary within
                    // the lookup's range, two units or more above the hit.
                    if let Some(j) = hit.junction {
                        let unit = self.unit;
                        ensure(
                            j % unit == 0 && j >= hit.tokens + 2 * unit && j <= hit.max_tokens,
                            || format!("junction {j} against {hit:?} at unit {unit}"),
                        )?;
                    }
                }
            }
            OverlapOp::Schedule { id, budget } => {
                self.atomic("schedule", |m| m.schedule(seq_id(*id), budget.get(), 0, false))?;
            }
            OverlapOp::ScheduleAll { budget } => {
                let ids = self.live();
                let budgets = vec![budget.get(); ids.len()];
                self.atomic("schedule_batch", |m| m.schedule_batch(&ids, &budgets, false))?;
            }
            OverlapOp::Placeholders { id, count } => {
                self.atomic("append_placeholders", |m| {
                    m.append_placeholders(seq_id(*id), count.get())
                })?;
            }
            OverlapOp::AppendWith { id, tokens, count } => {
                let tokens = self.tokens(usize::from(*tokens));
                self.atomic("append_with_placeholders", |m| {
                    m.append_with_placeholders(seq_id(*id), &tokens, count.get())
                })?;
            }
            OverlapOp::PlaceholdersBatch { ids } => {
                let ids: Vec<u64> = ids.iter().map(|&i| seq_id(i)).collect();
                self.atomic("append_placeholders_batch", |m| m.append_placeholders_batch(&ids))?;
            }
            OverlapOp::Resolve { id, count } => {
                let n = count.get().min(64) as usize;
                let tokens = self.tokens(n);
                let pending = self.m.num_placeholders(seq_id(*id));
                let got = self.atomic("resolve", |m| m.resolve(seq_id(*id), &tokens))?;
                if let Ok(p) = pending {
                    ensure(got.is_some() == (n as u32 <= p), || {
                        format!("resolve of {n} tokens over {p} placeholders gave {got:?}")
                    })?;
                }
            }
            OverlapOp::ResolveBatch { ids } => {
                let ids: Vec<u64> = ids.iter().map(|&i| seq_id(i)).collect();
                let tokens = self.tokens(ids.len());
                self.atomic("resolve_batch", |m| m.resolve_batch(&ids, &tokens))?;
            }
            OverlapOp::Append { id, tokens } => {
                let tokens = self.tokens(usize::from(*tokens));
                self.atomic("append", |m| m.append(seq_id(*id), &tokens))?;
            }
            OverlapOp::Build => {
                let full = self.plans.len() >= self.depth;
                self.calls += 1;
                let before = self.observe();
                let got = self.m.build_plan();
                if full {
                    Self::expect_kind("build_plan at depth", &got, "Step")?;
                    ensure(before == self.observe(), || "a refused build changed".into())?;
                } else {
                    let plan = got.map_err(|e| format!("build_plan below depth: {e}"))?;
                    self.built(plan)?;
                }
            }
            OverlapOp::Commit { which, by_plan } | OverlapOp::Abort { which, by_plan } => {
                let commit = matches!(op, OverlapOp::Commit { .. });
                let (plan, oldest) = self.named(*which);
                let behind = !oldest
                    && self.plans.iter().any(|p| p.step_id == plan.step_id)
                    && plan.manager == self.m.id();
                let before = self.observe();
                self.calls += 1;
                let got = match (commit, *by_plan) {
                    (true, true) => self.m.commit(&plan).map(|()| Vec::new()),
                    (true, false) => self.m.commit_step(plan.step_id).map(|()| Vec::new()),
                    (false, true) => self.m.abort(&plan),
                    (false, false) => self.m.abort_step(plan.step_id),
                };
                if oldest {
                    let ended = got.map_err(|e| format!("ending the oldest plan: {e}"))?;
                    if commit {
                        self.ended_oldest();
                    } else {
                        let all: Vec<u64> = self.plans.iter().map(|p| p.step_id).collect();
                        ensure(ended == all, || {
                            format!("abort of the oldest ended {ended:?}, not every plan {all:?}")
                        })?;
                        while !self.plans.is_empty() {
                            self.ended_oldest();
                        }
                    }
                } else {
                    let kind = if behind { "Step" } else { "StalePlan" };
                    Self::expect_kind("ending a plan that is not the oldest", &got, kind)?;
                    ensure(before == self.observe(), || "a refused end changed".into())?;
                }
            }
            OverlapOp::Withdraw(which) => {
                let (plan, _) = self.named(*which);
                let newest = self.plans.last().is_some_and(|p| p.step_id == plan.step_id);
                let got = self.atomic("withdraw_plan", |m| m.withdraw_plan(plan.step_id))?;
                ensure(got.is_some() == newest, || {
                    format!("withdraw of {} (newest: {newest}) gave {got:?}", plan.step_id)
                })?;
                if newest {
                    self.plans.pop();
                }
            }
            OverlapOp::Overlapped { commit, resolve, everyone } => {
                let mut ids = self.live();
                if !everyone {
                    ids.truncate(2);
                }
                let oldest = self.plans.first().map(|p| p.step_id).filter(|_| *commit);
                let resolve_ids: Vec<u64> = if *resolve {
                    ids.iter()
                        .copied()
                        .filter(|&id| self.m.num_placeholders(id).is_ok_and(|n| n > 0))
                        .collect()
                } else {
                    Vec::new()
                };
                let tokens = self.tokens(resolve_ids.len());
                let slot = (self.calls as usize) % self.ring.len();
                let mut plan = std::mem::take(&mut self.ring[slot]);
                let before = self.observe();
                self.calls += 1;
                let got =
                    self.m.decode_step_overlapped(oldest, &resolve_ids, &tokens, &ids, &mut plan);
                let committed = oldest.is_some() && self.m.plan_in_flight() != oldest;
                if committed {
                    self.ended_oldest();
                }
                match got {
                    Ok(_) => self.built(plan.clone())?,
                    Err(e) => {
                        ensure(e.kind() != "Invariant", || format!("decode_step_overlapped: {e}"))?;
                        ensure(committed || before == self.observe(), || {
                            format!("a refused decode_step_overlapped ({e}) changed")
                        })?;
                    }
                }
                self.ring[slot] = plan;
            }
            OverlapOp::DecodeStep { ring } => {
                let ids = self.live();
                let tokens = self.tokens(ids.len());
                let slot = usize::from(*ring) % self.ring.len();
                let mut plan = std::mem::take(&mut self.ring[slot]);
                let commits = self.plans.first().is_some_and(|p| p.step_id == plan.step_id)
                    && plan.manager == self.m.id();
                let held = plan.step_id;
                let before = self.observe();
                self.calls += 1;
                let got = self.m.decode_step(&ids, &tokens, &mut plan);
                let committed = commits && self.m.plan_in_flight() != Some(held);
                if committed {
                    self.ended_oldest();
                }
                match got {
                    Ok(_) => self.built(plan.clone())?,
                    Err(e) => {
                        ensure(e.kind() != "Invariant", || format!("decode_step: {e}"))?;
                        ensure(committed || before == self.observe(), || {
                            format!("a refused decode_step ({e}) changed")
                        })?;
                    }
                }
                self.ring[slot] = plan;
            }
            OverlapOp::Finish(id) => {
                self.atomic("finish", |m| m.finish(seq_id(*id)))?;
            }
            OverlapOp::Preempt(id) => {
                self.atomic("preempt", |m| m.preempt(seq_id(*id)))?;
            }
            OverlapOp::RequestCheckpoint { id, position } => {
                let id = seq_id(*id);
                let position = match position {
                    Count::Small(n) => {
                        self.m.num_tokens(id).unwrap_or(0).saturating_sub(u32::from(*n % 24))
                    }
                    other => other.get(),
                };
                self.atomic("request_checkpoint", |m| m.request_checkpoint(id, position))?;
            }
            OverlapOp::Reset => {
                self.atomic("reset", CacheManager::reset)?;
            }
        }
        self.check()
    }

    pub(crate) fn check(&self) -> Result<(), String> {
        self.m.check_invariants().map_err(|e| format!("invariants: {e}"))?;
        let in_flight = self.m.plans_in_flight();
        let ours: Vec<u64> = self.plans.iter().map(|p| p.step_id).collect();
        ensure(in_flight == ours, || format!("in flight {in_flight:?}, built {ours:?}"))?;
        ensure(in_flight.len() <= self.depth, || format!("{in_flight:?} beyond depth"))
    }

    /// Commits everything in flight, finishes every sequence: no block stays owned.
    pub(crate) fn wind_down(&mut self) -> Result<(), String> {
        while let Some(plan) = self.plans.first().cloned() {
            self.m.commit(&plan).map_err(|e| format!("commit of {}: {e}", plan.step_id))?;
            self.ended_oldest();
            self.check()?;
        }
        for id in self.live() {
            self.m.finish(id).map_err(|e| format!("finish {id}: {e}"))?;
            self.check()?;
        }
        let owned: u32 = self.m.pool_usage().iter().map(|p| p.owned).sum();
        ensure(owned == 0, || format!("{owned} blocks owned with nothing live"))
    }
}
