//! The block store: every pool, the hash index over their published blocks, the record of
//! recent evictions and the block events. It is the only code that allocates a block, publishes
//! a key (in a pool and in the index, with its event) and evicts one (unindexing every key the
//! evicted block carried).
//!
//! It owns no sequence and no step: callers say which group, block and positions, and hand in
//! the content the keys are computed from ([`Content`]). It never decides what to allocate or
//! publish: that is the protocol's (`schedule`, `build_plan`, `commit`). Lookups read it through
//! `has_key`, `holder` and `recently_evicted`; `check_pools` and `check_index` verify its own
//! invariants.

use crate::config::{GroupLayout, GroupSlot};
use crate::error::{CacheError, Result};
use crate::events::{CacheEvent, EventLog};
use crate::hashing::{unit_extra_entries, Digest, ExtraKeys};
use crate::index::{HashIndex, UnitContent};
use crate::pool::{BlockId, BlockKey, BlockKind, BlockPool, Key};

/// What a sequence's keys are computed from: its tokens, extra keys and unit digests
/// (`hashes[i]` fingerprints `tokens[..(i + 1) * U]`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Content<'a> {
    pub tokens: &'a [u32],
    pub extra: &'a ExtraKeys,
    pub hashes: &'a [Digest],
}

impl Content<'_> {
    /// The key of `group` at unit boundary `position` (at least U).
    #[inline]
    pub fn key_at(&self, group: u32, unit: u32, position: u32) -> Key {
        Key { group, digest: self.hashes[(position / unit - 1) as usize] }
    }
}

/// Pools, index, eviction record and events.
#[derive(Debug)]
pub(crate) struct BlockStore {
    pub pools: Vec<BlockPool>,
    pub index: HashIndex,
    pub events: EventLog,
    /// Per group (config index), the pool it draws from.
    pool_of: Vec<usize>,
    unit: u32,
    /// The parent digest of unit 0 (the hasher's seed digest).
    seed: Digest,
    /// Keys of the block an allocation evicted (scratch, empty between calls).
    evicted: Vec<BlockKey>,
    /// Blocks evicted so far, in all and per group.
    pub evictions: u64,
    pub group_evictions: Vec<u64>,
}

impl BlockStore {
    pub fn new(
        pools: Vec<BlockPool>,
        index: HashIndex,
        events: EventLog,
        pool_of: Vec<usize>,
        unit: u32,
        seed: Digest,
    ) -> Self {
        let groups = pool_of.len();
        Self {
            pools,
            index,
            events,
            pool_of,
            unit,
            seed,
            evicted: Vec::new(),
            evictions: 0,
            group_evictions: vec![0; groups],
        }
    }

    /// The pool of group `g`'s blocks.
    #[inline]
    pub fn group_pool(&self, g: usize) -> &BlockPool {
        &self.pools[self.pool_of[g]]
    }

    /// Allocates one block of `pool`, unindexing whatever the eviction removed.
    #[inline]
    pub fn allocate(&mut self, pool: usize, kind: BlockKind, group: u32) -> Option<BlockId> {
        let mut evicted = std::mem::take(&mut self.evicted);
        let block = self.pools[pool].allocate(kind, group, &mut evicted);
        if let Some(block) = block {
            self.unindex_evicted(block, &mut evicted);
        }
        self.evicted = evicted;
        block
    }

    /// Takes a specific cached block (the checkpoint cap's victim).
    pub fn allocate_cached(
        &mut self,
        pool: usize,
        block: BlockId,
        kind: BlockKind,
        group: u32,
    ) -> Option<BlockId> {
        let mut evicted = std::mem::take(&mut self.evicted);
        let ok = self.pools[pool].allocate_cached(block, kind, group, &mut evicted);
        if ok {
            self.unindex_evicted(block, &mut evicted);
        }
        self.evicted = evicted;
        ok.then_some(block)
    }

    fn unindex_evicted(&mut self, block: BlockId, evicted: &mut Vec<BlockKey>) {
        if evicted.is_empty() {
            return;
        }
        let group = evicted[0].key.group;
        let pool = &self.pools[self.pool_of[group as usize]];
        for k in evicted.iter() {
            self.index.remove(&k.key, block, true, |b| pool.carries(b, &k.key));
        }
        self.evictions += 1;
        if let Some(g) = self.group_evictions.get_mut(group as usize) {
            *g += 1;
        }
        if self.events.enabled() {
            let (index, events) = (&self.index, &mut self.events);
            events.removed(group, block, evicted, |k| {
                index.contains(&k.key, |b| pool.carries(b, &k.key))
            });
        }
        evicted.clear();
    }

    /// Whether a block of group `key.group` is published under `key`.
    #[inline]
    pub fn has_key(&self, key: &Key) -> bool {
        let pool = self.group_pool(key.group as usize);
        self.index.contains(key, |b| pool.carries(b, key))
    }

    /// Why `key` is not published: evicted recently, or not cached.
    pub fn recently_evicted(&self, key: &Key) -> bool {
        let pool = self.group_pool(key.group as usize);
        self.index.recently_evicted(key, |b| pool.carries(b, key))
    }

    /// The block a hit on `key` uses ([`BlockStore::pick`]), `None` when none is published.
    /// A key's only candidate is confirmed directly: the common case, on every probe of a
    /// lookup.
    #[inline]
    pub fn holder(&self, key: &Key) -> Option<BlockId> {
        self.holder_in(self.group_pool(key.group as usize), key)
    }

    /// `holder` with the key's group pool at hand (the lookup's hot loop).
    #[inline]
    pub fn holder_in(&self, pool: &BlockPool, key: &Key) -> Option<BlockId> {
        match self.index.candidates(key) {
            (Some(b), _) => Some(b).filter(|&b| pool.carries(b, key)),
            (None, many) => {
                Self::pick(pool, many.iter().copied().filter(|&b| pool.carries(b, key)))
            }
        }
    }

    /// What a hit depends on besides the sequence: the index's generation (keys published or
    /// removed) and the pools' clocks (blocks pinned out of the LRU, released into it or
    /// touched, which decides among copies under one key, [`Self::pick`]). A hit computed at
    /// one epoch is the hit at any later call that finds the same epoch.
    pub fn hit_epoch(&self) -> (u64, u64) {
        let clocks = self.pools.iter().fold(0u64, |sum, p| sum.wrapping_add(p.clock()));
        (self.index.generation(), clocks)
    }

    /// Among the blocks published under one key: one already in use if any, else the most
    /// recently used (ties to the lowest id), so the choice is deterministic. `None` when
    /// there is none.
    fn pick(pool: &BlockPool, mut holders: impl Iterator<Item = BlockId>) -> Option<BlockId> {
        let first = holders.next()?;
        let Some(second) = holders.next() else {
            return Some(first);
        };
        [first, second]
            .into_iter()
            .chain(holders)
            .max_by_key(|&b| (pool.ref_count(b) > 0, pool.stamp(b), u32::MAX - b))
    }

    /// Keys `block` of paged group `g` at every unit boundary in `(from, to]`.
    pub fn publish_range(
        &mut self,
        g: usize,
        seq: Content<'_>,
        block: BlockId,
        from: u32,
        to: u32,
    ) {
        let unit = self.unit;
        let pool = self.pool_of[g];
        let first = from / unit + 1;
        let last = to / unit;
        for i in first..=last {
            let position = i * unit;
            let key = Key { group: g as u32, digest: seq.hashes[(i - 1) as usize] };
            if self.pools[pool].add_key(block, BlockKey { key, position }) {
                self.index_insert(key, block, seq, i - 1);
                self.store_event(g, block, seq, position, false);
            }
        }
    }

    /// Keys checkpoint `block` of state group `g` at `position`; whether it is new there.
    pub fn publish_checkpoint(
        &mut self,
        g: usize,
        seq: Content<'_>,
        block: BlockId,
        position: u32,
    ) -> bool {
        let unit_index = position / self.unit;
        let key = Key { group: g as u32, digest: seq.hashes[(unit_index - 1) as usize] };
        if !self.pools[self.pool_of[g]].add_key(block, BlockKey { key, position }) {
            return false;
        }
        self.index_insert(key, block, seq, unit_index - 1);
        self.store_event(g, block, seq, position, true);
        true
    }

    fn index_insert(&mut self, key: Key, block: BlockId, seq: Content<'_>, unit_index: u32) {
        let p = self.pool_of[key.group as usize];
        let mut extra = Vec::new();
        let unit = self.index.verifies_tokens().then(|| {
            let i = unit_index as usize;
            let unit = self.unit as usize;
            unit_extra_entries(&mut extra, i, unit, seq.extra);
            let parent = if i == 0 { self.seed } else { seq.hashes[i - 1] };
            (parent, &seq.tokens[i * unit..(i + 1) * unit])
        });
        let pool = &self.pools[p];
        let carries = |b| pool.carries(b, &key);
        let content =
            unit.as_ref().map(|(parent, tokens)| UnitContent { parent, tokens, extra: &extra });
        let duplicate = self.index.insert(key, block, content, carries);
        if duplicate {
            let holders: Vec<BlockId> = self.index.get(&key, carries).collect();
            for holder in holders {
                self.pools[p].mark_shared_key(holder);
            }
        }
    }

    /// The event of a key just published (a run's next key, or a new run).
    #[inline]
    fn store_event(
        &mut self,
        g: usize,
        block: BlockId,
        seq: Content<'_>,
        position: u32,
        checkpoint: bool,
    ) {
        if self.events.enabled() {
            let (tokens, hashes, extra) = (seq.tokens, seq.hashes, seq.extra);
            self.events.stored_key(g as u32, block, position, checkpoint, tokens, hashes, extra);
        }
    }

    /// The hash unit U.
    #[inline]
    pub fn unit(&self) -> u32 {
        self.unit
    }

    /// The parent digest of unit 0.
    #[inline]
    pub fn seed(&self) -> &Digest {
        &self.seed
    }

    /// Drops every cached block and key.
    pub fn clear(&mut self) {
        let mut removed = Vec::new();
        for pool in &mut self.pools {
            pool.clear(&mut removed);
        }
        self.index.clear();
        self.events.push(CacheEvent::AllBlocksCleared);
    }

    /// Every pool's own partition (free / owned / cached, LRU integrity, null block).
    pub fn check_pools(&self) -> Result<()> {
        for (i, pool) in self.pools.iter().enumerate() {
            pool.check().map_err(|m| CacheError::invariant(format!("pool {i}: {m}")))?;
        }
        Ok(())
    }

    /// The index and the pools agree: every entry names a block carrying its key in the right
    /// group's pool, every block key is indexed, keys sit on unit boundaries, a state key is a
    /// checkpoint's only key and a paged key a paged block's, the checkpoint caps hold.
    pub fn check_index(&self, layout: &GroupLayout) -> Result<()> {
        let mut indexed = 0usize;
        for (fingerprint, block) in self.index.entries() {
            indexed += 1;
            // Some group's pool holds the block, and it carries a key with this fingerprint.
            let known = (0..layout.len()).any(|g| {
                self.pools[layout.pool(g)]
                    .keys(block)
                    .iter()
                    .any(|k| k.key.group == g as u32 && k.key.fingerprint() == fingerprint)
            });
            if !known {
                return Err(CacheError::invariant(format!(
                    "index maps fingerprint {fingerprint:#x} to block {block}, which carries no \
                     key with it in any group"
                )));
            }
        }
        let mut carried = 0usize;
        for (i, pool) in self.pools.iter().enumerate() {
            for b in 1..pool.num_blocks() {
                let keys = pool.keys(b);
                carried += keys.len();
                for k in keys {
                    if !self.index.get(&k.key, |x| pool.carries(x, &k.key)).any(|x| x == b) {
                        return Err(CacheError::invariant(format!(
                            "pool {i} block {b} carries a key at {} that is not indexed",
                            k.position
                        )));
                    }
                    if k.position == 0 || k.position % self.unit != 0 {
                        return Err(CacheError::invariant(format!(
                            "pool {i} block {b} keyed at {}, not a unit boundary",
                            k.position
                        )));
                    }
                    let state = matches!(layout.slots[k.key.group as usize], GroupSlot::State(_));
                    if state && (keys.len() != 1 || !pool.kind(b).is_checkpoint()) {
                        return Err(CacheError::invariant(format!(
                            "pool {i} block {b}: a state key on a block labelled {:?} with {} \
                             keys (a checkpoint holds exactly one position)",
                            pool.kind(b),
                            keys.len()
                        )));
                    }
                    if !state && pool.kind(b) != BlockKind::Paged {
                        return Err(CacheError::invariant(format!(
                            "pool {i} block {b}: a paged key on a block labelled {:?}",
                            pool.kind(b)
                        )));
                    }
                }
            }
        }
        if carried != indexed {
            return Err(CacheError::invariant(format!(
                "{indexed} index entries but {carried} block keys"
            )));
        }
        for group in &layout.state {
            if let Some(cap) = group.config.checkpoint_cap {
                let n = self.pools[group.pool].num_checkpoints_of(group.index as u32);
                if n > cap {
                    return Err(CacheError::invariant(format!(
                        "group {} holds {n} checkpoint blocks, more than its cap {cap}",
                        group.index
                    )));
                }
            }
        }
        Ok(())
    }
}
