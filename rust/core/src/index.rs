//! `HashIndex`: which blocks are published under which key, plus what explains misses.
//!
//! One key may map to several blocks (two sequences computed the same content; duplicates are
//! never merged, so a block id never changes under a running sequence). The index holds only
//! published blocks: a key is inserted at commit and removed when its block is evicted or the
//! cache is reset. It also remembers a bounded set of recently evicted keys, so a lookup can say
//! `recently_evicted` instead of `not_cached`, and, with `verify_tokens`, the tokens and parent
//! digest behind every published digest, so hits can be checked token by token.
//!
//! Recently evicted keys are remembered by their 64-bit fingerprints (`Key::fingerprint`):
//! eight bytes a key instead of 36 keep that record small enough to stay in the caches while
//! evictions stream through an index of many megabytes. Two keys sharing a fingerprint (a
//! chance of about 2^-64 a pair) would at worst label a miss `recently_evicted` instead of
//! `not_cached`; no hit depends on the record.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;

use rustc_hash::{FxBuildHasher, FxHashMap, FxHashSet};

use crate::hashing::Digest;
use crate::pool::{BlockId, Key};

/// Map value meaning "several blocks: see `HashIndex::many`". Block ids never reach it.
const MANY: BlockId = BlockId::MAX;

/// Tokens behind a published digest (only with `verify_tokens`).
#[derive(Clone, Debug)]
struct StoredUnit {
    parent: Digest,
    tokens: Box<[u32]>,
    holders: u32,
}

/// Key -> blocks, recently evicted keys, and optionally the stored unit tokens.
#[derive(Clone, Debug, Default)]
pub struct HashIndex {
    /// Key -> its block. Four bytes a value keep the table dense: a lookup of a long prompt
    /// probes one key per block, and each probe is a cache miss once the index outgrows the
    /// caches.
    map: FxHashMap<Key, BlockId>,
    /// Keys published by several blocks (two sequences computed the same content): all of them.
    many: FxHashMap<Key, Vec<BlockId>>,
    /// Fingerprints of the recently evicted keys, and the order they were evicted in.
    recent: FxHashSet<u64>,
    recent_order: VecDeque<u64>,
    recent_capacity: usize,
    units: Option<FxHashMap<Digest, StoredUnit>>,
    /// Changes whenever a key is inserted or removed (lets a lookup's result be reused).
    generation: u64,
}

impl HashIndex {
    /// `expected_keys`: room reserved up front (a pool's blocks carry at least one key each
    /// once published), so that filling the cache does not rehash the table as it grows.
    #[must_use]
    pub fn new(recent_capacity: usize, verify_tokens: bool, expected_keys: usize) -> Self {
        Self {
            map: FxHashMap::with_capacity_and_hasher(expected_keys, FxBuildHasher),
            recent_capacity,
            units: verify_tokens.then(FxHashMap::default),
            ..Self::default()
        }
    }

    /// Blocks published under `key` (empty if none).
    #[must_use]
    pub fn get(&self, key: &Key) -> &[BlockId] {
        match self.map.get(key) {
            None => &[],
            Some(&MANY) => self.many.get(key).map_or(&[], Vec::as_slice),
            Some(block) => std::slice::from_ref(block),
        }
    }

    #[must_use]
    pub fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// Publishes `block` under `key`. `unit` carries (parent digest, unit tokens) when tokens
    /// are verified.
    /// Returns whether the key already had a block (the key now has duplicates).
    pub fn insert(&mut self, key: Key, block: BlockId, unit: Option<(&Digest, &[u32])>) -> bool {
        self.generation += 1;
        let duplicate = match self.map.entry(key) {
            Entry::Vacant(v) => {
                v.insert(block);
                false
            }
            Entry::Occupied(mut o) => {
                let first = o.get_mut();
                if *first == MANY {
                    self.many.entry(key).or_default().push(block);
                } else {
                    self.many.insert(key, vec![*first, block]);
                    *first = MANY;
                }
                true
            }
        };
        if let (Some(units), Some((parent, tokens))) = (self.units.as_mut(), unit) {
            units
                .entry(key.digest)
                .or_insert_with(|| StoredUnit {
                    parent: *parent,
                    tokens: tokens.into(),
                    holders: 0,
                })
                .holders += 1;
        }
        duplicate
    }

    /// Unpublishes `block` from `key`; `evicted` records the key as recently evicted when no
    /// block is left under it.
    pub fn remove(&mut self, key: &Key, block: BlockId, evicted: bool) {
        let Entry::Occupied(mut o) = self.map.entry(*key) else {
            return;
        };
        self.generation += 1;
        let first = o.get_mut();
        let now_empty = if *first == MANY {
            if let Some(v) = self.many.get_mut(key) {
                v.retain(|&b| b != block);
                if let [last] = v.as_slice() {
                    *first = *last;
                    self.many.remove(key);
                }
            }
            false
        } else {
            *first == block
        };
        if now_empty {
            o.remove();
            if evicted {
                self.remember_evicted(*key);
            }
        }
        if let Some(units) = self.units.as_mut() {
            if let Some(unit) = units.get_mut(&key.digest) {
                unit.holders -= 1;
                if unit.holders == 0 {
                    units.remove(&key.digest);
                }
            }
        }
    }

    fn remember_evicted(&mut self, key: Key) {
        let fingerprint = key.fingerprint();
        if self.recent_capacity == 0 || !self.recent.insert(fingerprint) {
            return;
        }
        self.recent_order.push_back(fingerprint);
        while self.recent_order.len() > self.recent_capacity {
            if let Some(old) = self.recent_order.pop_front() {
                self.recent.remove(&old);
            }
        }
    }

    /// Whether `key` lost its last block to eviction recently (and was not published since).
    #[must_use]
    pub fn recently_evicted(&self, key: &Key) -> bool {
        self.recent.contains(&key.fingerprint()) && !self.map.contains_key(key)
    }

    /// With `verify_tokens`: false when the unit stored under `digest` has other tokens or
    /// another parent (a hash collision). A digest with no stored unit has no published key in
    /// any group (its blocks were evicted, e.g. behind a sliding window): there is nothing to
    /// compare, and no hit can use a key of it. Without `verify_tokens`: always true.
    #[must_use]
    pub fn verify(&self, digest: &Digest, parent: &Digest, tokens: &[u32]) -> bool {
        match &self.units {
            None => true,
            Some(units) => {
                units.get(digest).is_none_or(|u| u.parent == *parent && *u.tokens == *tokens)
            }
        }
    }

    #[must_use]
    pub fn verifies_tokens(&self) -> bool {
        self.units.is_some()
    }

    /// Iterates over every (key, block) pair (for invariant checks).
    pub fn entries(&self) -> impl Iterator<Item = (&Key, BlockId)> + '_ {
        self.map.keys().flat_map(move |k| self.get(k).iter().map(move |&b| (k, b)))
    }

    /// A counter that changes with every insertion or removal.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Forgets every key (reset). Recently evicted keys are forgotten too.
    pub fn clear(&mut self) {
        self.generation += 1;
        self.map.clear();
        self.many.clear();
        self.recent.clear();
        self.recent_order.clear();
        if let Some(units) = self.units.as_mut() {
            units.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        let mut d = [0u8; 32];
        d[0] = n;
        Digest(d)
    }

    #[test]
    fn verify_rejects_other_tokens_but_not_units_nobody_publishes() {
        let mut index = HashIndex::new(16, true, 0);
        let key = Key { group: 0, digest: digest(1) };
        index.insert(key, 7, Some((&digest(0), &[1, 2])));
        assert!(index.verify(&digest(1), &digest(0), &[1, 2]));
        assert!(!index.verify(&digest(1), &digest(0), &[1, 3]));
        assert!(!index.verify(&digest(1), &digest(9), &[1, 2]));
        // Once evicted, the unit cannot be compared; no key of it is left to hit either.
        index.remove(&key, 7, true);
        assert!(index.verify(&digest(1), &digest(0), &[1, 3]));
        assert!(!index.contains(&key));
    }

    #[test]
    fn remembers_the_latest_evicted_keys_up_to_its_capacity() {
        let mut index = HashIndex::new(2, false, 4);
        let keys: Vec<Key> = (1..=3).map(|n| Key { group: 0, digest: digest(n) }).collect();
        for (block, key) in keys.iter().enumerate() {
            index.insert(*key, block as BlockId + 1, None);
        }
        // Removed without eviction (e.g. a released window): not a recent eviction.
        index.remove(&keys[0], 1, false);
        assert!(!index.recently_evicted(&keys[0]));
        index.remove(&keys[1], 2, true);
        index.remove(&keys[2], 3, true);
        assert!(index.recently_evicted(&keys[1]) && index.recently_evicted(&keys[2]));
        // The same digest in another group is another key.
        assert!(!index.recently_evicted(&Key { group: 1, digest: digest(2) }));
        // Published again: a hit, not a recent eviction.
        index.insert(keys[1], 4, None);
        assert!(!index.recently_evicted(&keys[1]));
        // A third eviction pushes the oldest out of a record of two.
        index.insert(keys[0], 5, None);
        index.remove(&keys[0], 5, true);
        assert!(index.recently_evicted(&keys[0]) && index.recently_evicted(&keys[2]));
        index.remove(&keys[1], 4, true);
        assert!(!index.recently_evicted(&keys[2]), "the oldest of three is forgotten");
        assert!(index.recently_evicted(&keys[0]) && index.recently_evicted(&keys[1]));
    }
}
