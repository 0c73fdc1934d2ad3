//! Many hash chains at once: the prompts of one `add_batch`, hashed across threads.
//!
//! Chains are independent (each digest depends only on its own sequence's tokens, extra keys and
//! parent), so each one is hashed whole by one thread and nothing is shared but the read-only
//! inputs: the digests are exactly those [`Hasher::extend`] appends, whatever the thread count.
//! The work is split before any thread starts (the longest remaining chain first, to the least
//! loaded thread), so the split, unlike the timing, does not depend on the machine. Threads are
//! scoped (`std::thread::scope`): none outlives the call, and the calling thread hashes a share
//! itself. A batch too small to repay a thread's start is hashed on the calling thread alone.

use crate::hashing::{Digest, ExtraKeys, HashAlgorithm, Hasher};
use crate::limits::MAX_HASH_THREADS;

/// One chain to extend: `hashes` gets the digest of every full unit of `tokens` it lacks.
pub(crate) struct Chain<'a> {
    pub tokens: &'a [u32],
    pub extra: &'a ExtraKeys,
    pub hashes: &'a mut Vec<Digest>,
}

impl Chain<'_> {
    /// Units still to hash (unit size `unit`, at least 1).
    fn remaining(&self, unit: usize) -> usize {
        (self.tokens.len() / unit).saturating_sub(self.hashes.len())
    }
}

/// Token bytes a thread must have to hash before starting one pays. Measured on the 2-core VM
/// (`examples/add_batch.rs`): two threads lose on 8 prompts of 4,096 tokens (128 KiB) and win on
/// 16 (0.37 -> 0.28 ms) with SHA-256; with XXH3 they win from about 2 MiB.
fn min_bytes_per_thread(algorithm: HashAlgorithm) -> usize {
    match algorithm {
        HashAlgorithm::Sha256 => 96 << 10,
        HashAlgorithm::Xxh3_128 => 512 << 10,
    }
}

/// The threads `extend_chains` uses for `units` units of `unit` tokens in `chains` chains, at
/// most `threads` (itself at most `MAX_HASH_THREADS`): one, unless every thread gets at least
/// `min_bytes_per_thread` of tokens.
pub(crate) fn threads_for(
    algorithm: HashAlgorithm,
    units: usize,
    unit: usize,
    chains: usize,
    threads: usize,
) -> usize {
    let bytes = units.saturating_mul(unit).saturating_mul(4);
    let worth = bytes / min_bytes_per_thread(algorithm);
    threads.min(MAX_HASH_THREADS).min(chains).min(worth).max(1)
}

/// Extends every chain in `chains` as `hasher.extend` would, on up to `threads` threads (the
/// calling one included; `threads_for` says how many are worth it). `unit` is at least 1.
pub(crate) fn extend_chains(hasher: &Hasher, chains: &mut [Chain<'_>], unit: u32, threads: usize) {
    let unit_len = unit as usize;
    let units: usize = chains.iter().map(|c| c.remaining(unit_len)).sum();
    let threads = threads_for(hasher.algorithm(), units, unit_len, chains.len(), threads);
    if threads <= 1 {
        extend_interleaved(hasher, chains.iter_mut().collect(), unit);
        return;
    }
    // Longest processing time first: each chain, longest first, to the least loaded thread.
    let mut order: Vec<usize> = (0..chains.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(chains[i].remaining(unit_len)));
    let mut load = vec![0usize; threads];
    let mut owner = vec![0usize; chains.len()];
    for i in order {
        let least = (0..threads).min_by_key(|&t| load[t]).unwrap_or(0);
        load[least] += chains[i].remaining(unit_len);
        owner[i] = least;
    }
    let mut shares: Vec<Vec<&mut Chain<'_>>> = (0..threads).map(|_| Vec::new()).collect();
    for (chain, &t) in chains.iter_mut().zip(&owner) {
        shares[t].push(chain);
    }
    let work = |share: Vec<&mut Chain<'_>>| extend_interleaved(hasher, share, unit);
    std::thread::scope(|scope| {
        let mut shares = shares.into_iter();
        let own = shares.next();
        for share in shares {
            scope.spawn(move || work(share));
        }
        if let Some(share) = own {
            work(share);
        }
    });
}

/// Extends every chain of `share` on this thread, two at a time (`Hasher::extend_pair`):
/// when one of the two is complete the next chain takes its place, and the last one left is
/// extended alone.
fn extend_interleaved(hasher: &Hasher, share: Vec<&mut Chain<'_>>, unit: u32) {
    let unit_len = unit as usize;
    let (mut first, mut second) = (hasher.clone(), hasher.clone());
    let mut queue = share.into_iter().filter(|c| c.remaining(unit_len) > 0);
    let mut lanes = (queue.next(), queue.next());
    while let (Some(a), Some(b)) = (&mut lanes.0, &mut lanes.1) {
        first.extend_pair(
            &mut second,
            unit,
            (a.tokens, a.extra, &mut *a.hashes),
            (b.tokens, b.extra, &mut *b.hashes),
        );
        if a.remaining(unit_len) == 0 {
            lanes.0 = queue.next();
        }
        if matches!(&lanes.1, Some(b) if b.remaining(unit_len) == 0) {
            lanes.1 = queue.next();
        }
        if lanes.0.is_none() {
            lanes = (lanes.1.take(), queue.next());
        }
    }
    if let Some(last) = lanes.0.or(lanes.1) {
        first.extend(last.tokens, unit, last.extra, last.hashes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|t| t.wrapping_mul(2_654_435_761) ^ seed).collect()
    }

    /// Every thread count gives each chain the digests `extend` gives it alone, from whatever
    /// it already held.
    #[test]
    fn threads_change_no_digest() {
        let hasher = Hasher::new(HashAlgorithm::Sha256, 7);
        let extra = ExtraKeys::default();
        let prompts: Vec<Vec<u32>> =
            (0..9).map(|s| prompt(s, 16 * (40 + 300 * s as usize) + 5)).collect();
        let mut expected = Vec::new();
        for p in &prompts {
            let mut h = Vec::new();
            hasher.clone().extend(p, 16, &extra, &mut h);
            expected.push(h);
        }
        for threads in [1, 2, 3, 8] {
            // Some chains start part-way (digests already known), one is complete.
            let mut got: Vec<Vec<Digest>> = expected
                .iter()
                .enumerate()
                .map(|(i, h)| h[..h.len() * (i % 3) / 2].to_vec())
                .collect();
            let mut chains: Vec<Chain<'_>> = prompts
                .iter()
                .zip(got.iter_mut())
                .map(|(p, h)| Chain { tokens: p, extra: &extra, hashes: h })
                .collect();
            extend_chains(&hasher, &mut chains, 16, threads);
            assert_eq!(got, expected, "{threads} threads");
        }
    }

    #[test]
    fn small_batches_stay_on_one_thread() {
        assert_eq!(threads_for(HashAlgorithm::Sha256, 100, 16, 10, 8), 1);
        // 8 prompts of 4,096 tokens stay on one thread, 16 get two (the measured crossing).
        assert_eq!(threads_for(HashAlgorithm::Sha256, 8 * 256, 16, 8, 2), 1);
        assert_eq!(threads_for(HashAlgorithm::Sha256, 16 * 256, 16, 16, 2), 2);
        assert_eq!(threads_for(HashAlgorithm::Sha256, 1 << 20, 16, 1, 8), 1);
        assert_eq!(threads_for(HashAlgorithm::Sha256, 1 << 20, 16, 100, 8), 8);
        assert_eq!(
            threads_for(HashAlgorithm::Sha256, 1 << 20, 16, 100, 1000),
            100.min(MAX_HASH_THREADS)
        );
        assert_eq!(threads_for(HashAlgorithm::Xxh3_128, 4096, 16, 100, 8), 1);
    }
}
