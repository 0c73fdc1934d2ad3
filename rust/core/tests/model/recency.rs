//! Recency of published blocks, as far as the model can tell without mirroring the LRU list.
//!
//! After every call, each published block is classified: in use (in a block table, or a copy
//! source or resume checkpoint of a built step), maybe pinned (a candidate copy source or resume
//! checkpoint of a scheduled first step, which only its plan reveals), or cached since some call
//! (negative for decode tails, which enter at the least recently used end; a later one in front
//! of an earlier one). A block whose history the model cannot follow (a candidate that turned
//! out unused, or whose step was dropped) is unknown until it is next released.
//!
//! Rules checked: an eviction takes no block more recent than another evictable one (the cap
//! only among checkpoints, a decode-tail snapshot's cap only among decode tails); a hit uses a
//! copy already in use if there is one, otherwise the most recently used copy. Blocks that
//! became cached in the same call are not ordered against each other.

use std::collections::HashSet;

use crate::reference::{Model, Prefix, SeqModel};
use crate::setup::Kind;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recency {
    InUse,
    Maybe,
    /// Cached since this call (see the module doc for negative values).
    Cached(i64),
    Unknown,
}

impl Model {
    /// Blocks a scheduled, unbuilt first step of `tokens` resuming at `hit` may have pinned
    /// without showing it: every holder of the key at the hit, for copy-on-write sources and
    /// resume checkpoints.
    pub(crate) fn possible_pins(&self, seq: &SeqModel, hit: u32) -> Vec<HashSet<u32>> {
        let mut maybe = vec![HashSet::new(); self.s.pools.len()];
        for g in 0..self.groups() {
            let partial = match self.s.groups[g].0 {
                Kind::Full { block } | Kind::Window { block, .. } => hit % block != 0,
                Kind::State(_) => hit > 0,
            };
            if partial {
                let holders = self.live[g].get(&seq.key(hit)).into_iter().flatten();
                maybe[self.s.pool(g)].extend(holders);
            }
        }
        maybe
    }

    /// Reclassifies every published block after a call.
    pub(crate) fn refresh_recency(&mut self) -> Result<(), String> {
        self.clock += 1;
        let held = self.held()?;
        let mut maybe = vec![HashSet::new(); self.s.pools.len()];
        for id in &self.scheduled {
            let seq = self.seq(*id)?;
            if let Some(step) = seq.step.as_ref().filter(|s| s.first) {
                for (pool, blocks) in self.possible_pins(seq, step.start).into_iter().enumerate() {
                    maybe[pool].extend(blocks);
                }
            }
        }
        for pool in 0..self.s.pools.len() {
            let blocks: Vec<u32> = self.carried[pool].keys().copied().collect();
            let mut next = std::collections::HashMap::new();
            for b in blocks {
                let previous = self.recency[pool].get(&b).copied();
                let now = if held[pool].contains(&b) {
                    Recency::InUse
                } else if maybe[pool].contains(&b) {
                    Recency::Maybe
                } else {
                    match previous {
                        Some(Recency::Cached(since)) => Recency::Cached(since),
                        Some(Recency::Maybe | Recency::Unknown) => Recency::Unknown,
                        // Released now, or published and released at once.
                        Some(Recency::InUse) | None => {
                            if self.decode_tails[pool].contains(&b) && previous.is_none() {
                                Recency::Cached(-self.clock)
                            } else {
                                Recency::Cached(self.clock)
                            }
                        }
                    }
                };
                next.insert(b, now);
            }
            self.recency[pool] = next;
        }
        Ok(())
    }

    /// An eviction took `victim`: no other evictable block (not in `excluded`, accepted by
    /// `eligible`) may have been cached earlier. Returns whether the victim was ordered against
    /// another block cached in an earlier call.
    pub(crate) fn check_victim(
        &self,
        pool: usize,
        victim: u32,
        excluded: &HashSet<u32>,
        eligible: impl Fn(u32) -> bool,
    ) -> Result<bool, String> {
        let Some(Recency::Cached(since)) = self.recency[pool].get(&victim).copied() else {
            return Ok(false);
        };
        let mut ordered = false;
        for (&b, &r) in &self.recency[pool] {
            if let Recency::Cached(other) = r {
                if b == victim || excluded.contains(&b) || !eligible(b) {
                    continue;
                }
                ensure!(
                    other >= since,
                    "pool {pool}: evicted block {victim} (cached since call {since}) while block \
                     {b} (cached since call {other}) was less recently used"
                );
                ordered |= other > since;
            }
        }
        Ok(ordered)
    }

    /// The hit column `key` of a first schedule uses `chosen`: a copy already in use if there is
    /// one (`in_use`; `maybe` may be in use), otherwise the most recently used copy. Returns
    /// which rule decided between several copies, if any did.
    pub(crate) fn check_hit_choice(
        &self,
        g: usize,
        key: Prefix,
        chosen: u32,
        in_use: &HashSet<u32>,
        maybe: &HashSet<u32>,
    ) -> Result<Option<&'static str>, String> {
        let pool = self.s.pool(g);
        let holders: Vec<u32> = self.live[g].get(&key).cloned().unwrap_or_default();
        let known = |b: &u32| self.recency[pool].get(b).copied();
        let may_be_in_use = |b: &u32| maybe.contains(b) || known(b) == Some(Recency::Maybe);
        if holders.iter().any(|b| in_use.contains(b)) {
            ensure!(
                in_use.contains(&chosen) || may_be_in_use(&chosen),
                "group {g}: the hit at {} used cached block {chosen} although copies {:?} were \
                 in use",
                key.len,
                holders.iter().filter(|b| in_use.contains(b)).collect::<Vec<_>>()
            );
            return Ok((holders.len() > 1).then_some("hit used the copy in use"));
        }
        if holders.iter().any(|b| may_be_in_use(b) || !matches!(known(b), Some(Recency::Cached(_))))
        {
            return Ok(None);
        }
        // Decode tails all enter at the least recently used end: equally old for this rule.
        let recency = |b: &u32| match known(b) {
            Some(Recency::Cached(since)) => since.max(0),
            _ => 0,
        };
        let newest = holders.iter().map(recency).max().unwrap_or(0);
        ensure!(
            recency(&chosen) == newest,
            "group {g}: the hit at {} used block {chosen} (cached since call {}) although a copy \
             cached since call {newest} exists",
            key.len,
            recency(&chosen)
        );
        Ok((holders.len() > 1).then_some("hit used the most recent copy"))
    }
}
