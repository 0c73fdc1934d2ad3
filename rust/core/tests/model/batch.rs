//! `add_batch` in the model: the requests are built as `add` builds them (a prompt copied from
//! a known sequence, `extends`, a reused id), except that the batch's earlier requests count as
//! known too, so a request may copy, extend or repeat the id of one before it. The model's own
//! statement of the call: when any request is one `add` would refuse (a live id or one given
//! earlier in the batch, extra keys out of bounds or malformed), the call returns the first
//! such request's error and changes nothing; otherwise every request's result is checked as if
//! `add` had returned it, in order.

use std::collections::HashSet;

use prefixcache_core::{AddRequest, CacheError, ExtraKeys};

use crate::extra;
use crate::ops::AddOp;
use crate::reference::{Model, UNKNOWN_ID};

/// One request of a batch: id, tokens, extra keys, `extends`.
type Request = (u64, Vec<u32>, ExtraKeys, Option<u64>);

impl Model {
    pub(crate) fn add_batch(&mut self, adds: &[AddOp], threads: usize) -> Result<(), String> {
        let mut known: Vec<(u64, Vec<u32>, ExtraKeys)> = self
            .seqs
            .iter()
            .map(|(&id, s)| (id, s.tokens.clone(), s.extra.clone()))
            .chain(self.finished.iter().map(|(&id, (t, e))| (id, t.clone(), e.clone())))
            .collect();
        let mut requests: Vec<Request> = Vec::new();
        for add in adds {
            let id = match add.reuse {
                Some(r) if !known.is_empty() => known[usize::from(r) % known.len()].0,
                _ => {
                    self.next_id += 1;
                    self.next_id
                }
            };
            let (mut tokens, base) = if add.source % 4 == 0 || known.is_empty() {
                let base = u32::from(add.source / 4 % 3) * 10_000;
                ((base..base + u32::from(add.len)).collect::<Vec<u32>>(), None)
            } else {
                let (_, t, e) = &known[usize::from(add.source) % known.len()];
                (t[..t.len().min(usize::from(add.len))].to_vec(), Some(e.clone()))
            };
            tokens.extend(self.fresh_tokens(usize::from(add.suffix)));
            let keys = extra::resolve(&add.extra, tokens.len() as u32, base.as_ref());
            let extends = add.extends.map(|e| {
                if known.is_empty() || e % 8 == 7 {
                    UNKNOWN_ID
                } else {
                    known[usize::from(e) % known.len()].0
                }
            });
            known.push((id, tokens.clone(), keys.clone()));
            requests.push((id, tokens, keys, extends));
        }
        // The first request `add` would refuse, if any: (index, a duplicate id, bad keys).
        let mut ids = HashSet::new();
        let refused = requests.iter().enumerate().find_map(|(i, (id, tokens, keys, _))| {
            let duplicate = self.seqs.contains_key(id) || !ids.insert(*id);
            let bad = tokens.is_empty() || extra::refusal(keys, tokens.len() as u32).is_some();
            (duplicate || bad).then_some((i, duplicate, bad))
        });
        let usage = self.m.pool_usage();
        let batch = requests
            .iter()
            .map(|(seq_id, tokens, extra, extends)| AddRequest {
                seq_id: *seq_id,
                tokens,
                extra: extra.clone(),
                extends: *extends,
            })
            .collect();
        let result = self.m.add_batch(batch, threads);
        if let Some((i, duplicate, bad)) = refused {
            let id = requests[i].0;
            let reported = match &result {
                Err(CacheError::DuplicateSequence { seq_id }) => duplicate && *seq_id == id,
                Err(CacheError::InvalidRequest { .. }) => bad,
                _ => false,
            };
            ensure!(
                reported,
                "add_batch of {} requests: request {i} (id {id}, duplicate {duplicate}, bad \
                 keys {bad}) must be refused, got {result:?}",
                requests.len()
            );
            ensure!(self.m.pool_usage() == usage, "a refused add_batch changed the pools");
            for (id, ..) in &requests {
                ensure!(
                    self.seqs.contains_key(id) || self.m.num_tokens(*id).is_err(),
                    "a refused add_batch admitted sequence {id}"
                );
            }
            self.expect_no_events("a refused add_batch")?;
            self.saw("add_batch refused all of its requests");
            return Ok(());
        }
        let added = result.map_err(|e| format!("add_batch of {} requests: {e}", requests.len()))?;
        ensure!(added.len() == requests.len(), "add_batch returned {} results", added.len());
        let mut earlier = HashSet::new();
        for ((id, tokens, keys, extends), a) in requests.into_iter().zip(added) {
            if extends.is_some_and(|e| earlier.contains(&e)) && a.reused_tokens > 0 {
                self.saw("add_batch reused a request of its own batch");
            }
            earlier.insert(id);
            ensure!(
                self.check_add(id, tokens, keys, extends, Ok(a), &usage)?,
                "add_batch: request {id} was not added"
            );
        }
        Ok(())
    }
}
