//! Calls with values at or beyond the API's bounds: lookaheads at and past
//! `MAX_LOOKAHEAD_TOKENS` and at `u32::MAX`, checkpoint requests past the sequence's end,
//! sequence and plan ids at the ends of their range, `block_table` of groups that do not exist,
//! batch calls whose arrays disagree in length. Each must be refused with the typed error the
//! model names (or, for a lookahead the pools cannot hold, `None`), change nothing (pools,
//! statistics, events) and leave `check_invariants` passing (`check_all` runs after it).

use prefixcache_core::limits::MAX_LOOKAHEAD_TOKENS;
use prefixcache_core::CacheError;

use crate::extra::ExtraOp;
use crate::ops::{AddOp, Hostile};
use crate::reference::{Model, SeqModel};

/// Ids near `u64::MAX` the `HugeId` adds use.
pub(crate) const HUGE_ID: u64 = u64::MAX;

impl Model {
    #[allow(clippy::too_many_lines)]
    pub(crate) fn hostile(&mut self, what: Hostile, pick: u8) -> Result<(), String> {
        let usage = self.m.pool_usage();
        let stats = self.m.stats();
        match what {
            Hostile::LookaheadBeyondLimit | Hostile::LookaheadMax | Hostile::LookaheadAtLimit => {
                let lookahead = match what {
                    Hostile::LookaheadBeyondLimit => MAX_LOOKAHEAD_TOKENS + 1,
                    Hostile::LookaheadMax => u32::MAX,
                    _ => MAX_LOOKAHEAD_TOKENS,
                };
                let id = self.pick(pick, SeqModel::runnable);
                let budget = if pick % 2 == 0 { u32::MAX } else { 1 };
                self.saw(if lookahead > MAX_LOOKAHEAD_TOKENS {
                    "lookahead beyond the limit"
                } else {
                    "lookahead at the limit"
                });
                // Through the driver's schedule: it predicts the refusal (or the `None`).
                return self.schedule(&[id], &[budget], lookahead, pick % 4 == 1, false);
            }
            Hostile::CheckpointPastEnd | Hostile::CheckpointMax => {
                let id = self.pick(pick, SeqModel::scheduled);
                let p = match (what, self.seqs.get(&id)) {
                    (Hostile::CheckpointPastEnd, Some(seq)) => seq.num_tokens() + 1,
                    _ => u32::MAX,
                };
                self.saw("checkpoint request past the end");
                return self.request_checkpoint_at(id, p);
            }
            Hostile::HugeId => {
                let add = AddOp {
                    source: pick,
                    len: 1 + pick % 40,
                    suffix: 0,
                    extends: None,
                    reuse: None,
                    twin: false,
                    extra: ExtraOp::none(),
                };
                let id = HUGE_ID - u64::from(pick % 2);
                self.saw("huge sequence id");
                return self.add_with_id(&add, id);
            }
            Hostile::UnknownHugeId => {
                let id = HUGE_ID - u64::from(pick % 2);
                if self.seqs.contains_key(&id) {
                    return self.lookup(id);
                }
                let results = [
                    self.m.lookup(id).err(),
                    self.m.num_computed(id).err(),
                    self.m.schedule(id, u32::MAX, 0, false).err(),
                    self.m.append(id, &[1]).err(),
                    self.m.finish(id).err(),
                    self.m.preempt(id).err(),
                    self.m.suggest_chunk(id, u32::MAX).err(),
                ];
                for r in results {
                    ensure!(
                        matches!(
                            r,
                            Some(CacheError::UnknownSequence { .. } | CacheError::Step { .. })
                        ),
                        "a call on unknown id {id}: {r:?}"
                    );
                }
            }
            Hostile::PlanIdsAtBounds => {
                for (step_id, commit) in [(0, true), (u64::MAX, false), (u64::MAX, true)] {
                    if self.in_flight.as_ref().is_some_and(|p| p.step_id == step_id) {
                        continue;
                    }
                    let r = if commit {
                        self.m.commit_step(step_id)
                    } else {
                        self.m.abort_step(step_id).map(drop)
                    };
                    ensure!(
                        matches!(r, Err(CacheError::StalePlan { .. })),
                        "commit/abort of step {step_id}: {r:?}"
                    );
                }
            }
            Hostile::BlockTableBounds => {
                let ids = self.ids(SeqModel::any);
                for group in [self.groups() as u32, u32::MAX] {
                    let r = self.m.block_table(group, &ids);
                    ensure!(r.is_err(), "block_table of group {group}: {r:?}");
                    ensure!(
                        !matches!(r, Err(CacheError::Invariant { .. })),
                        "block_table of group {group}: {r:?}"
                    );
                }
                let mut with_unknown = ids.clone();
                with_unknown.push(HUGE_ID - 2);
                for g in 0..self.groups() {
                    let r = self.m.block_table(g as u32, &with_unknown);
                    ensure!(
                        if self.s.block_size(g).is_some() {
                            matches!(r, Err(CacheError::UnknownSequence { .. }))
                        } else {
                            matches!(r, Err(CacheError::InvalidRequest { .. }))
                        },
                        "block_table of group {g} with an unknown sequence: {r:?}"
                    );
                }
            }
            Hostile::BatchLengths => {
                let ids = self.ids(SeqModel::runnable);
                let budgets = vec![u32::MAX; ids.len() + 1];
                let r = self.m.schedule_batch(&ids, &budgets, false);
                ensure!(
                    matches!(r, Err(CacheError::InvalidRequest { .. } | CacheError::Step { .. })),
                    "schedule_batch of {} ids with {} budgets: {r:?}",
                    ids.len(),
                    budgets.len()
                );
                let ids = self.ids(SeqModel::decoding);
                let r = self.m.append_batch(&ids, &vec![7; ids.len() + 1]);
                ensure!(
                    matches!(r, Err(CacheError::InvalidRequest { .. } | CacheError::Step { .. })),
                    "append_batch of {} ids with one token too many: {r:?}",
                    ids.len()
                );
            }
        }
        self.saw("hostile call refused");
        ensure!(self.m.pool_usage() == usage, "a refused {what:?} changed the pools");
        ensure!(self.m.stats() == stats, "a refused {what:?} changed the statistics");
        self.expect_no_events("a refused hostile call")
    }
}
