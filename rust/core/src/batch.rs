//! `add_batch`: a step's arrivals admitted in one call, their prompts hashed across threads.
//!
//! The result is that of `add` called on each request in order: the same sequences, digests,
//! reuse (`extends`, live prefixes, among the batch's own requests too) and `Added` values. The
//! requests are registered in order with their hashing deferred (each keeps the digests it
//! reuses and that of unit 0, which `live_prefixes` and later requests look up); a request that
//! reuses more of an earlier, deferred one than it holds has that one hashed first, on this
//! thread; everything still deferred is then hashed at once by `chains::extend_chains`.
//!
//! Refusals: every check `add` makes on a request (a live id, an id twice in the batch, an empty
//! prompt, a sequence `validate_sequence` refuses) is made on all of them before anything
//! changes, and the first refused request's error, the one its `add` would have returned, is the
//! batch's: nothing is admitted. The one refusal left after that is memory the machine cannot
//! give for a prompt's copies; then the requests before it stay admitted, as a sequence of `add`
//! calls would leave them (their digests complete), and the error says how many.

use std::sync::OnceLock;

use rustc_hash::FxHashSet;

use crate::chains::{extend_chains, threads_for};
use crate::error::{CacheError, Result};
use crate::hashing::{Digest, ExtraKeys, HashAlgorithm};
use crate::limits::MAX_HASH_THREADS;
use crate::manager::{check_batch_len, Added, CacheManager};
use crate::table::Deferred;

/// The machine's cores, asked once: `available_parallelism` may read cgroup files on Linux
/// (system calls on every call; the standard library's documentation suggests caching it), and
/// most batches are one request.
fn cores() -> usize {
    static CORES: OnceLock<usize> = OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, usize::from))
}

/// One request of `add_batch`: the arguments of one `add`.
#[derive(Clone, Debug, Default)]
pub struct AddRequest<'a> {
    pub seq_id: u64,
    pub tokens: &'a [u32],
    pub extra: ExtraKeys,
    pub extends: Option<u64>,
}

impl CacheManager {
    /// The digests of a prompt `add` registers: all of them now, or with `defer` (`add_batch`)
    /// only that of unit 0 if none is known (`live_prefixes` and later requests of the batch
    /// look it up). Returns how many the sequence holds once hashed.
    pub(crate) fn hash_prompt(
        &mut self,
        owned: &[u32],
        extra: &ExtraKeys,
        hashes: &mut Vec<Digest>,
        defer: bool,
    ) -> usize {
        let unit = self.unit;
        if !defer {
            self.hasher.extend(owned, unit, extra, hashes);
            return hashes.len();
        }
        if let Some(head) = owned.get(..unit as usize).filter(|_| hashes.is_empty()) {
            let parent = self.hasher.seed_digest();
            hashes.push(self.hasher.hash_unit(&parent, 0, head, extra));
        }
        (owned.len() / unit as usize).max(hashes.len())
    }

    /// The digests of a live sequence's full units of known tokens, `h[0], h[1], ...` (what
    /// `add`, `add_batch` and `append` computed or reused for it).
    pub fn sequence_digests(&self, seq_id: u64) -> Result<&[Digest]> {
        Ok(&self.seq(self.table.slot(seq_id)?).hashes)
    }

    /// `add` of each request, in order, with the prompts hashed on up to `threads` threads (0:
    /// as many as the machine has cores, at most `MAX_HASH_THREADS`; a batch too small to
    /// repay a thread is hashed on the calling thread). All or nothing (see the module doc).
    ///
    /// # Errors
    /// More than `MAX_BATCH_SEQUENCES` requests or `MAX_HASH_THREADS` threads; otherwise the
    /// error `add` returns for the first request it would refuse.
    pub fn add_batch(
        &mut self,
        requests: Vec<AddRequest<'_>>,
        threads: usize,
    ) -> Result<Vec<Added>> {
        check_batch_len(requests.len(), "add_batch")?;
        if threads > MAX_HASH_THREADS {
            return Err(CacheError::invalid(format!(
                "add_batch got threads = {threads}: at most {MAX_HASH_THREADS}"
            )));
        }
        let mut seen = FxHashSet::default();
        seen.try_reserve(requests.len())
            .map_err(|_| CacheError::invalid("add_batch's ids could not be allocated"))?;
        for r in &requests {
            // An earlier request of the batch is live by the time `add` would see this one.
            if !seen.insert(r.seq_id) {
                return Err(CacheError::DuplicateSequence { seq_id: r.seq_id });
            }
            self.check_add(r.seq_id, r.tokens, &r.extra)?;
        }
        let mut added = Vec::new();
        added
            .try_reserve_exact(requests.len())
            .map_err(|_| CacheError::invalid("add_batch's results could not be allocated"))?;
        let threads = if threads == 0 { cores() } else { threads };
        // Deferred, the prompts are read again after all of them are copied in: worth it for
        // SHA-256 (compute-bound, interleaved even on one thread) or when threads will share
        // the work, not for XXH3 on one thread (it would read them back from a farther cache).
        let unit = self.unit as usize;
        let units = requests.iter().map(|r| r.tokens.len() / unit).sum();
        let algorithm = self.hasher.algorithm();
        let defer = algorithm == HashAlgorithm::Sha256
            || threads_for(algorithm, units, unit, requests.len(), threads) > 1;
        let mut deferred = Deferred::default();
        let mut failure = None;
        for r in requests {
            let d = Some(&mut deferred).filter(|_| defer);
            match self.admit(r.seq_id, r.tokens, r.extra, r.extends, d) {
                Ok(a) => added.push(a),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let slots = deferred.slots();
        let hasher = &self.hasher;
        extend_chains(hasher, &mut self.table.chains(&slots), self.unit, threads);
        match failure {
            None => Ok(added),
            Some(e) => Err(CacheError::invalid(format!(
                "add_batch admitted {} of its requests, then: {e}",
                added.len()
            ))),
        }
    }
}
