//! `HashIndex`: which blocks are published under which key, plus what explains misses.
//!
//! One key may map to several blocks (two sequences computed the same content; duplicates are
//! never merged, so a block id never changes under a running sequence). The index holds only
//! published blocks: a key is inserted at commit and removed when its block is evicted or the
//! cache is reset. It also remembers a bounded set of recently evicted keys, so a lookup can say
//! `recently_evicted` instead of `not_cached`, and, with `verify_tokens`, everything a published
//! digest covers (its parent digest, the unit's tokens and the unit's extra-key entries), so
//! hits can be checked unit by unit against what was actually computed.
//!
//! Recently evicted keys are remembered by their 64-bit fingerprints (`Key::fingerprint`):
//! eight bytes a key instead of 36 keep that record small enough to stay in the caches while
//! evictions stream through an index of many megabytes. Two keys sharing a fingerprint (a
//! chance of about 2^-64 a pair) would at worst label a miss `recently_evicted` instead of
//! `not_cached`; no hit depends on the record.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;

use rustc_hash::{FxBuildHasher, FxHashMap};

use crate::hashing::Digest;
use crate::pool::{BlockId, Key};

/// Map value meaning "several blocks: see `HashIndex::many`". Block ids never reach it.
const MANY: BlockId = BlockId::MAX;

/// What one unit's digest covers: its parent digest, its tokens and its encoded extra-key
/// entries (empty when the unit has none; see `hashing::unit_extra_entries`).
#[derive(Clone, Copy, Debug)]
pub struct UnitContent<'a> {
    pub parent: &'a Digest,
    pub tokens: &'a [u32],
    pub extra: &'a [u8],
}

/// Everything behind a published digest (only with `verify_tokens`).
#[derive(Clone, Debug)]
struct StoredUnit {
    parent: Digest,
    tokens: Box<[u32]>,
    extra: Box<[u8]>,
    holders: u32,
}

/// Key fingerprint -> blocks, recently evicted keys, and optionally the stored unit tokens.
#[derive(Clone, Debug, Default)]
pub struct HashIndex {
    /// Fingerprint (`Key::fingerprint`) -> its block. The full key is not stored here: the
    /// block's record in its pool holds it, and every query confirms a block through that
    /// record (`carries`), which the caller was about to read anyway (to pin, publish or
    /// evict the block). An entry is 16 bytes instead of the 40 a full key takes, so the
    /// table that every publication, eviction and lookup probes is 2.5 times smaller: once the
    /// cache holds many blocks, each probe is a cache miss, and fewer of them reach memory.
    map: FxHashMap<u64, BlockId>,
    /// Fingerprints with several blocks, in the order they were published: duplicates of one
    /// key (two sequences computed the same content), or distinct keys sharing a fingerprint
    /// (by chance about 2^-64 a pair; with SHA-256 an adversary could make one with about 2^32
    /// work): `carries` tells them apart, so a shared fingerprint never makes a wrong hit.
    many: FxHashMap<u64, Vec<BlockId>>,
    /// The fingerprints of the last `recent_capacity` evictions, oldest first, and how many
    /// times each appears among them (a key evicted again appears again).
    recent: FxHashMap<u64, u32>,
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

    /// The blocks published under `key`'s fingerprint, unconfirmed: the only one, or all of
    /// them when there are several.
    #[must_use]
    #[inline]
    pub fn candidates(&self, key: &Key) -> (Option<BlockId>, &[BlockId]) {
        self.candidates_of(key.fingerprint())
    }

    #[inline]
    fn candidates_of(&self, fingerprint: u64) -> (Option<BlockId>, &[BlockId]) {
        match self.map.get(&fingerprint) {
            None => (None, &[]),
            Some(&MANY) => (None, self.many.get(&fingerprint).map_or(&[], Vec::as_slice)),
            Some(&block) => (Some(block), &[]),
        }
    }

    /// Blocks published under `key`, in publication order. `carries(block)` must say whether
    /// `block` carries `key` (the key's pool knows): only those are returned.
    pub fn get<'a>(
        &'a self,
        key: &Key,
        carries: impl Fn(BlockId) -> bool + 'a,
    ) -> impl Iterator<Item = BlockId> + 'a {
        let (one, many) = self.candidates(key);
        one.into_iter().chain(many.iter().copied()).filter(move |&block| carries(block))
    }

    /// Whether any block is published under `key` (`carries` as for [`HashIndex::get`]).
    #[must_use]
    pub fn contains(&self, key: &Key, carries: impl Fn(BlockId) -> bool) -> bool {
        self.get(key, carries).next().is_some()
    }

    /// Publishes `block` under `key`; the block's record must carry the key already.
    /// `carries(block)` says whether a block carries `key`. `unit` is what the digest covers,
    /// given when units are verified. Returns whether another block already had the
    /// key (the key now has duplicates).
    pub fn insert(
        &mut self,
        key: Key,
        block: BlockId,
        unit: Option<UnitContent<'_>>,
        carries: impl Fn(BlockId) -> bool,
    ) -> bool {
        self.generation += 1;
        let fingerprint = key.fingerprint();
        let duplicate = match self.map.entry(fingerprint) {
            Entry::Vacant(v) => {
                v.insert(block);
                false
            }
            Entry::Occupied(mut o) => {
                let first = o.get_mut();
                if *first == MANY {
                    let blocks = self.many.entry(fingerprint).or_default();
                    let duplicate = blocks.iter().any(|&b| b != block && carries(b));
                    blocks.push(block);
                    duplicate
                } else {
                    let duplicate = *first != block && carries(*first);
                    self.many.insert(fingerprint, vec![*first, block]);
                    *first = MANY;
                    duplicate
                }
            }
        };
        if let (Some(units), Some(unit)) = (self.units.as_mut(), unit) {
            units
                .entry(key.digest)
                .or_insert_with(|| StoredUnit {
                    parent: *unit.parent,
                    tokens: unit.tokens.into(),
                    extra: unit.extra.into(),
                    holders: 0,
                })
                .holders += 1;
        }
        duplicate
    }

    /// Unpublishes `block` from `key` (once: a block publishes a key once). `evicted` records
    /// the key as recently evicted when no block is left under it; `carries(block)` says
    /// whether a block still carries `key`.
    pub fn remove(
        &mut self,
        key: &Key,
        block: BlockId,
        evicted: bool,
        carries: impl Fn(BlockId) -> bool,
    ) {
        let fingerprint = key.fingerprint();
        let Entry::Occupied(mut o) = self.map.entry(fingerprint) else {
            return;
        };
        let first = o.get_mut();
        let now_empty = if *first == MANY {
            let Some(blocks) = self.many.get_mut(&fingerprint) else {
                return;
            };
            let Some(at) = blocks.iter().position(|&b| b == block) else {
                return;
            };
            blocks.remove(at);
            let now_empty = !blocks.iter().any(|&b| carries(b));
            if let [last] = blocks.as_slice() {
                *first = *last;
                self.many.remove(&fingerprint);
            }
            now_empty
        } else if *first == block {
            o.remove();
            true
        } else {
            return;
        };
        self.generation += 1;
        if now_empty && evicted {
            self.remember_evicted(*key);
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
        if self.recent_capacity == 0 {
            return;
        }
        let fingerprint = key.fingerprint();
        *self.recent.entry(fingerprint).or_insert(0) += 1;
        self.recent_order.push_back(fingerprint);
        while self.recent_order.len() > self.recent_capacity {
            let Some(old) = self.recent_order.pop_front() else { break };
            if let Entry::Occupied(mut count) = self.recent.entry(old) {
                *count.get_mut() -= 1;
                if *count.get() == 0 {
                    count.remove();
                }
            }
        }
    }

    /// Whether `key` lost its last block to eviction recently (and was not published since);
    /// `carries` as for [`HashIndex::get`].
    #[must_use]
    pub fn recently_evicted(&self, key: &Key, carries: impl Fn(BlockId) -> bool) -> bool {
        self.recent.contains_key(&key.fingerprint()) && !self.contains(key, carries)
    }

    /// With `verify_tokens`: false when the unit stored under `digest` has another parent,
    /// other tokens or other extra-key entries (a hash collision). A digest with no stored unit has no published key in
    /// any group (its blocks were evicted, e.g. behind a sliding window): there is nothing to
    /// compare, and no hit can use a key of it. Without `verify_tokens`: always true.
    #[must_use]
    pub fn verify(&self, digest: &Digest, unit: UnitContent<'_>) -> bool {
        match &self.units {
            None => true,
            Some(units) => units.get(digest).is_none_or(|u| {
                u.parent == *unit.parent && *u.tokens == *unit.tokens && *u.extra == *unit.extra
            }),
        }
    }

    #[must_use]
    pub fn verifies_tokens(&self) -> bool {
        self.units.is_some()
    }

    /// Iterates over every (fingerprint, block) pair (for invariant checks).
    pub fn entries(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.map.keys().flat_map(move |&fingerprint| {
            let (one, many) = self.candidates_of(fingerprint);
            one.into_iter().chain(many.iter().copied()).map(move |b| (fingerprint, b))
        })
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
    use std::collections::HashMap;

    fn digest(n: u8) -> Digest {
        let mut d = [0u8; 32];
        d[0] = n;
        Digest(d)
    }

    /// The pools' side of the index: which block carries which keys.
    #[derive(Default)]
    struct Carried(HashMap<BlockId, Vec<Key>>);

    impl Carried {
        fn add(&mut self, block: BlockId, key: Key) {
            self.0.entry(block).or_default().push(key);
        }

        fn drop_block(&mut self, block: BlockId) {
            self.0.remove(&block);
        }

        fn carries(&self, key: Key) -> impl Fn(BlockId) -> bool + '_ {
            move |b| self.0.get(&b).is_some_and(|keys| keys.contains(&key))
        }
    }

    fn publish(index: &mut HashIndex, carried: &mut Carried, key: Key, block: BlockId) -> bool {
        carried.add(block, key);
        index.insert(key, block, None, carried.carries(key))
    }

    fn evict(index: &mut HashIndex, carried: &mut Carried, key: Key, block: BlockId) {
        carried.drop_block(block);
        index.remove(&key, block, true, carried.carries(key));
    }

    #[test]
    fn verify_rejects_other_tokens_but_not_units_nobody_publishes() {
        let mut index = HashIndex::new(16, true, 0);
        let mut carried = Carried::default();
        let key = Key { group: 0, digest: digest(1) };
        carried.add(7, key);
        let (d0, d9) = (digest(0), digest(9));
        let unit = |parent, tokens, extra| UnitContent { parent, tokens, extra };
        index.insert(key, 7, Some(unit(&d0, &[1, 2], b"img")), carried.carries(key));
        assert!(index.verify(&digest(1), unit(&d0, &[1, 2], b"img")));
        assert!(!index.verify(&digest(1), unit(&d0, &[1, 3], b"img")));
        assert!(!index.verify(&digest(1), unit(&d9, &[1, 2], b"img")));
        // The extra keys are part of what the digest covers: a unit without the image differs.
        assert!(!index.verify(&digest(1), unit(&d0, &[1, 2], b"")));
        // Once evicted, the unit cannot be compared; no key of it is left to hit either.
        evict(&mut index, &mut carried, key, 7);
        assert!(index.verify(&digest(1), unit(&d0, &[1, 3], b"")));
        assert!(!index.contains(&key, carried.carries(key)));
    }

    #[test]
    fn remembers_the_latest_evicted_keys_up_to_its_capacity() {
        let mut index = HashIndex::new(2, false, 4);
        let mut carried = Carried::default();
        let keys: Vec<Key> = (1..=3).map(|n| Key { group: 0, digest: digest(n) }).collect();
        for (block, key) in keys.iter().enumerate() {
            publish(&mut index, &mut carried, *key, block as BlockId + 1);
        }
        let recent = |index: &HashIndex, carried: &Carried, key: Key| {
            index.recently_evicted(&key, carried.carries(key))
        };
        // Removed without eviction (e.g. a released window): not a recent eviction.
        carried.drop_block(1);
        index.remove(&keys[0], 1, false, carried.carries(keys[0]));
        assert!(!recent(&index, &carried, keys[0]));
        evict(&mut index, &mut carried, keys[1], 2);
        evict(&mut index, &mut carried, keys[2], 3);
        assert!(recent(&index, &carried, keys[1]) && recent(&index, &carried, keys[2]));
        // The same digest in another group is another key.
        assert!(!recent(&index, &carried, Key { group: 1, digest: digest(2) }));
        // Published again: a hit, not a recent eviction.
        publish(&mut index, &mut carried, keys[1], 4);
        assert!(!recent(&index, &carried, keys[1]));
        // A third eviction pushes the oldest out of a record of two.
        publish(&mut index, &mut carried, keys[0], 5);
        evict(&mut index, &mut carried, keys[0], 5);
        assert!(recent(&index, &carried, keys[0]) && recent(&index, &carried, keys[2]));
        evict(&mut index, &mut carried, keys[1], 4);
        assert!(!recent(&index, &carried, keys[2]), "the oldest of three is forgotten");
        assert!(recent(&index, &carried, keys[0]) && recent(&index, &carried, keys[1]));
    }

    #[test]
    fn a_key_evicted_again_is_as_recent_as_its_latest_eviction() {
        let mut index = HashIndex::new(2, false, 4);
        let mut carried = Carried::default();
        let [a, b, c] = [1, 2, 3].map(|n| Key { group: 0, digest: digest(n) });
        let recent = |index: &HashIndex, carried: &Carried, key: Key| {
            index.recently_evicted(&key, carried.carries(key))
        };
        for (key, block) in [(a, 1), (b, 2), (a, 3), (c, 4)] {
            publish(&mut index, &mut carried, key, block);
            evict(&mut index, &mut carried, key, block);
        }
        // The last two evictions are a's second and c's: b's is the one forgotten.
        assert!(recent(&index, &carried, a) && recent(&index, &carried, c));
        assert!(!recent(&index, &carried, b));
        // Two more evictions of others push both of a's out.
        for (n, block) in [(4, 5), (5, 6)] {
            let key = Key { group: 0, digest: digest(n) };
            publish(&mut index, &mut carried, key, block);
            evict(&mut index, &mut carried, key, block);
        }
        assert!(!recent(&index, &carried, a) && !recent(&index, &carried, c));
        assert_eq!(index.recent.len(), 2);
    }

    #[test]
    fn keys_sharing_a_fingerprint_stay_apart_and_duplicates_are_reported() {
        let mut index = HashIndex::new(16, false, 4);
        let mut carried = Carried::default();
        // Two keys whose digests agree on the 8 bytes the fingerprint reads, and differ after.
        let mut other = digest(1);
        other.0[31] = 0xff;
        let (a, b) = (Key { group: 0, digest: digest(1) }, Key { group: 0, digest: other });
        assert_eq!(a.fingerprint(), b.fingerprint());
        assert!(!publish(&mut index, &mut carried, a, 1));
        assert!(!publish(&mut index, &mut carried, b, 2), "another key is not a duplicate");
        let holders = |index: &HashIndex, carried: &Carried, key: Key| -> Vec<BlockId> {
            index.get(&key, carried.carries(key)).collect()
        };
        assert_eq!(holders(&index, &carried, a), [1]);
        assert_eq!(holders(&index, &carried, b), [2]);
        // A real duplicate of `a`: reported, both copies found, in publication order.
        assert!(publish(&mut index, &mut carried, a, 3));
        assert_eq!(holders(&index, &carried, a), [1, 3]);
        // Evicting `b`'s only block leaves `a` whole and records only `b` as evicted.
        evict(&mut index, &mut carried, b, 2);
        assert!(holders(&index, &carried, b).is_empty());
        assert!(index.recently_evicted(&b, carried.carries(b)));
        assert!(!index.recently_evicted(&a, carried.carries(a)));
        assert_eq!(holders(&index, &carried, a), [1, 3]);
        evict(&mut index, &mut carried, a, 1);
        assert_eq!(holders(&index, &carried, a), [3]);
        assert!(!index.recently_evicted(&a, carried.carries(a)), "one copy is left");
        evict(&mut index, &mut carried, a, 3);
        assert!(index.recently_evicted(&a, carried.carries(a)));
        assert_eq!(index.entries().count(), 0);
        // Removing what is not there changes nothing.
        let generation = index.generation();
        index.remove(&a, 3, true, carried.carries(a));
        assert_eq!(index.generation(), generation);
    }
}
