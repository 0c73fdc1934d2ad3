//! `BlockPool`: block ids, reference counts, keys per block and the LRU of cached blocks.
//!
//! Every block id `1..num_blocks` is in exactly one of three states:
//! - **free**: reference count 0, no key; on the free stack (reused first);
//! - **cached**: reference count 0, at least one key (published); in the LRU list;
//! - **owned**: reference count > 0 (a sequence, a step or a pin holds it), keyed or not.
//!
//! Block 0 is the null block: it is never allocated, freed, keyed or evicted.
//!
//! The LRU is an intrusive doubly linked list over `Vec`s of indices: linking, unlinking and
//! popping are O(1) and allocate nothing. The pool does not know the hash index: when a cached
//! block is evicted its keys are drained into a caller-supplied buffer, and the caller removes
//! them from the index. The pool never panics on ids it handed out; the manager only passes ids
//! it holds.

use crate::hashing::Digest;

/// A block id inside one pool; 0 is the null block.
pub type BlockId = u32;

/// The null block: padding in block tables.
pub const NULL_BLOCK: BlockId = 0;

const NIL: u32 = u32::MAX;

/// `last_key` of a block that carries none (no group has this id).
const NO_KEY: Key = Key { group: u32::MAX, digest: Digest([0; 32]) };

/// A cache key: group and prefix digest. A block may carry several (one per unit boundary).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Key {
    pub group: u32,
    pub digest: Digest,
}

impl std::hash::Hash for Key {
    /// The digest is already uniformly distributed: its first eight bytes, mixed with the
    /// group, are a good map hash and much cheaper than feeding all 32 bytes to the hasher.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.digest.0[..8]);
        state.write_u64(u64::from_le_bytes(head) ^ u64::from(self.group).rotate_left(40));
    }
}

/// A key held by a block, with the token position it stands for (a multiple of U).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct BlockKey {
    pub key: Key,
    pub position: u32,
}

/// What a block is used for (kept for the checkpoint cap and the invariant checks).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum BlockKind {
    #[default]
    Free,
    /// KV of a paged group.
    Paged,
    /// One of a sequence's two private running-state buffers.
    Running,
    /// A prefill checkpoint (tail, junction, interval or explicit).
    Checkpoint,
    /// A decode-tail snapshot.
    DecodeTail,
}

impl BlockKind {
    /// Checkpoints of either kind count against a state group's cap.
    #[must_use]
    pub fn is_checkpoint(self) -> bool {
        matches!(self, Self::Checkpoint | Self::DecodeTail)
    }
}

/// Which end of the LRU a released cached block enters.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum LruEnd {
    /// Evicted last (ordinary release).
    MostRecent,
    /// Evicted first (decode-tail snapshots, a bet that may not pay).
    LeastRecent,
}

/// One pool of blocks.
#[derive(Clone, Debug)]
pub struct BlockPool {
    ref_count: Vec<u32>,
    keys: Vec<Vec<BlockKey>>,
    kind: Vec<BlockKind>,
    /// The block shares a key with another block (set when the second one is published,
    /// cleared when the block is reused): a chain hint naming it is not taken on trust.
    shared_key: Vec<bool>,
    /// The key most recently added to each block (a full block's full key), inline so that
    /// confirming a chain of blocks reads one dense array instead of a heap list per block.
    last_key: Vec<Key>,
    prev: Vec<u32>,
    next: Vec<u32>,
    in_lru: Vec<bool>,
    stamp: Vec<u64>,
    clock: u64,
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
    free: Vec<BlockId>,
    num_checkpoints: u32,
}

impl BlockPool {
    /// A pool of `num_blocks` ids (the null block included); all usable ids start free.
    #[must_use]
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        Self {
            ref_count: vec![0; n],
            keys: vec![Vec::new(); n],
            kind: vec![BlockKind::Free; n],
            shared_key: vec![false; n],
            last_key: vec![NO_KEY; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            in_lru: vec![false; n],
            stamp: vec![0; n],
            clock: 0,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            // Popped from the end: block 1 is handed out first.
            free: (1..num_blocks).rev().collect(),
            num_checkpoints: 0,
        }
    }

    /// Number of ids, the null block included.
    #[must_use]
    pub fn num_blocks(&self) -> u32 {
        self.ref_count.len() as u32
    }

    /// Unpublished free blocks.
    #[must_use]
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Cached blocks (published, reference count 0): evictable.
    #[must_use]
    pub fn num_cached(&self) -> u32 {
        self.lru_len
    }

    /// Blocks an allocation can obtain now.
    #[must_use]
    pub fn num_available(&self) -> u32 {
        self.num_free() + self.lru_len
    }

    /// Blocks currently holding checkpoints (owned, pending or cached).
    #[must_use]
    pub fn num_checkpoints(&self) -> u32 {
        self.num_checkpoints
    }

    #[must_use]
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_count.get(block as usize).copied().unwrap_or(0)
    }

    #[must_use]
    pub fn keys(&self, block: BlockId) -> &[BlockKey] {
        self.keys.get(block as usize).map_or(&[], Vec::as_slice)
    }

    #[must_use]
    pub fn kind(&self, block: BlockId) -> BlockKind {
        self.kind.get(block as usize).copied().unwrap_or_default()
    }

    #[must_use]
    pub fn is_published(&self, block: BlockId) -> bool {
        !self.keys(block).is_empty()
    }

    #[must_use]
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.in_lru.get(block as usize).copied().unwrap_or(false)
    }

    /// Recency of a block: larger is more recently released or used.
    #[must_use]
    pub fn stamp(&self, block: BlockId) -> u64 {
        self.stamp.get(block as usize).copied().unwrap_or(0)
    }

    /// Marks a block as sharing a key with another block.
    pub fn mark_shared_key(&mut self, block: BlockId) {
        if let Some(flag) = self.shared_key.get_mut(block as usize) {
            *flag = true;
        }
    }

    /// Whether `block` is the only block published under `key`, as far as the pool knows:
    /// it carries the key and never shared a key with another block since it was allocated.
    #[must_use]
    pub fn sole_holder_of(&self, block: BlockId, key: &Key) -> bool {
        let b = block as usize;
        block != NULL_BLOCK
            && b < self.keys.len()
            && !self.shared_key[b]
            && (self.last_key[b] == *key || self.keys[b].iter().any(|k| k.key == *key))
    }

    fn set_kind(&mut self, block: BlockId, kind: BlockKind) {
        let slot = &mut self.kind[block as usize];
        if slot.is_checkpoint() {
            self.num_checkpoints -= 1;
        }
        if kind.is_checkpoint() {
            self.num_checkpoints += 1;
        }
        *slot = kind;
    }

    /// Re-labels an owned block (a decode-tail snapshot stays a `DecodeTail`; a checkpoint
    /// allocated as `Checkpoint` keeps its label). Used only by the manager on blocks it holds.
    pub fn relabel(&mut self, block: BlockId, kind: BlockKind) {
        if block != NULL_BLOCK && (block as usize) < self.kind.len() {
            self.set_kind(block, kind);
        }
    }

    /// Takes a block with reference count 1: a free one first, else the least recently used
    /// cached one, whose keys are appended to `evicted` (the caller unindexes them).
    /// Returns `None` when nothing is free or cached.
    pub fn allocate(&mut self, kind: BlockKind, evicted: &mut Vec<BlockKey>) -> Option<BlockId> {
        let block = if let Some(block) = self.free.pop() {
            block
        } else if self.lru_head != NIL {
            let block = self.lru_head;
            self.take_cached(block, evicted);
            block
        } else {
            return None;
        };
        self.ref_count[block as usize] = 1;
        self.shared_key[block as usize] = false;
        self.set_kind(block, kind);
        Some(block)
    }

    /// Takes a specific cached block (evicting it), e.g. the least recently used checkpoint.
    /// Returns false if the block is not cached.
    pub fn allocate_cached(
        &mut self,
        block: BlockId,
        kind: BlockKind,
        evicted: &mut Vec<BlockKey>,
    ) -> bool {
        if !self.is_cached(block) {
            return false;
        }
        self.take_cached(block, evicted);
        self.ref_count[block as usize] = 1;
        self.shared_key[block as usize] = false;
        self.set_kind(block, kind);
        true
    }

    fn take_cached(&mut self, block: BlockId, evicted: &mut Vec<BlockKey>) {
        self.unlink(block);
        evicted.append(&mut self.keys[block as usize]);
        self.last_key[block as usize] = NO_KEY;
    }

    /// Adds a holder. A cached block leaves the LRU (it can no longer be evicted).
    pub fn incref(&mut self, block: BlockId) {
        if block == NULL_BLOCK || block as usize >= self.ref_count.len() {
            return;
        }
        if self.in_lru[block as usize] {
            self.unlink(block);
        }
        self.ref_count[block as usize] += 1;
    }

    /// Drops a holder. At zero a published block enters the LRU at `end`, an unpublished one
    /// becomes free.
    pub fn decref(&mut self, block: BlockId, end: LruEnd) {
        let b = block as usize;
        if block == NULL_BLOCK || b >= self.ref_count.len() || self.ref_count[b] == 0 {
            return;
        }
        self.ref_count[b] -= 1;
        if self.ref_count[b] > 0 {
            return;
        }
        if self.keys[b].is_empty() {
            self.set_kind(block, BlockKind::Free);
            self.free.push(block);
        } else {
            self.link(block, end);
        }
    }

    /// Adds a key to a block; false if the block already carries it.
    pub fn add_key(&mut self, block: BlockId, key: BlockKey) -> bool {
        let Some(keys) = self.keys.get_mut(block as usize) else {
            return false;
        };
        if block == NULL_BLOCK || keys.iter().any(|k| k.key == key.key) {
            return false;
        }
        keys.push(key);
        self.last_key[block as usize] = key.key;
        true
    }

    /// Marks a block as just used (a hit promotes it like a release would).
    pub fn touch(&mut self, block: BlockId) {
        self.clock += 1;
        if let Some(s) = self.stamp.get_mut(block as usize) {
            *s = self.clock;
        }
    }

    /// Cached blocks from least to most recently used.
    pub fn lru_iter(&self) -> impl Iterator<Item = BlockId> + '_ {
        let mut cur = self.lru_head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let block = cur;
            cur = self.next[block as usize];
            Some(block)
        })
    }

    /// Drops every key and every cached block; only valid when no block is owned.
    /// Appends the removed keys to `evicted`.
    pub fn clear(&mut self, evicted: &mut Vec<BlockKey>) {
        let n = self.num_blocks();
        for keys in &mut self.keys {
            evicted.append(keys);
        }
        *self = Self::new(n);
    }

    fn link(&mut self, block: BlockId, end: LruEnd) {
        let b = block as usize;
        self.clock += 1;
        self.stamp[b] = match end {
            LruEnd::MostRecent => self.clock,
            LruEnd::LeastRecent => 0,
        };
        match end {
            LruEnd::MostRecent => {
                self.prev[b] = self.lru_tail;
                self.next[b] = NIL;
                if self.lru_tail == NIL {
                    self.lru_head = block;
                } else {
                    self.next[self.lru_tail as usize] = block;
                }
                self.lru_tail = block;
            }
            LruEnd::LeastRecent => {
                self.next[b] = self.lru_head;
                self.prev[b] = NIL;
                if self.lru_head == NIL {
                    self.lru_tail = block;
                } else {
                    self.prev[self.lru_head as usize] = block;
                }
                self.lru_head = block;
            }
        }
        self.in_lru[b] = true;
        self.lru_len += 1;
    }

    fn unlink(&mut self, block: BlockId) {
        let b = block as usize;
        let (p, n) = (self.prev[b], self.next[b]);
        if p == NIL {
            self.lru_head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.lru_tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[b] = NIL;
        self.next[b] = NIL;
        self.in_lru[b] = false;
        self.lru_len -= 1;
    }

    /// Checks the pool's own invariants: the three states partition the ids, the LRU list is
    /// well formed, the null block is untouched. Returns a description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        let n = self.ref_count.len();
        if self.ref_count[0] != 0 || !self.keys[0].is_empty() || self.in_lru[0] {
            return Err("the null block was allocated, keyed or cached".into());
        }
        let mut on_free = vec![false; n];
        for &b in &self.free {
            let b = b as usize;
            if b == 0 || b >= n || on_free[b] {
                return Err(format!("free stack holds block {b} twice or out of range"));
            }
            on_free[b] = true;
        }
        let mut seen = 0u32;
        let mut prev = NIL;
        for block in self.lru_iter() {
            seen += 1;
            if seen > self.lru_len || self.prev[block as usize] != prev {
                return Err("LRU list is corrupt".into());
            }
            prev = block;
        }
        if seen != self.lru_len || self.lru_tail != prev {
            return Err(format!("LRU length {} but {seen} linked", self.lru_len));
        }
        let mut checkpoints = 0;
        #[allow(clippy::needless_range_loop)] // b indexes five parallel vectors
        for b in 1..n {
            let (rc, keyed, cached) = (self.ref_count[b], !self.keys[b].is_empty(), self.in_lru[b]);
            let state_ok = if rc > 0 {
                !cached && !on_free[b]
            } else if keyed {
                cached && !on_free[b]
            } else {
                !cached && on_free[b]
            };
            if !state_ok {
                return Err(format!(
                    "block {b}: ref_count {rc}, keyed {keyed}, cached {cached}, free {}: not \
                     exactly one of free / owned / cached",
                    on_free[b]
                ));
            }
            if rc == 0 && !keyed && self.kind[b] != BlockKind::Free {
                return Err(format!("free block {b} still labelled {:?}", self.kind[b]));
            }
            if self.kind[b].is_checkpoint() {
                checkpoints += 1;
            }
            let last_ok = if keyed {
                self.keys[b].iter().any(|k| k.key == self.last_key[b])
            } else {
                self.last_key[b] == NO_KEY
            };
            if !last_ok {
                return Err(format!("block {b}: its last key is not one it carries"));
            }
        }
        if checkpoints != self.num_checkpoints {
            return Err(format!(
                "checkpoint count {} but {checkpoints} blocks labelled",
                self.num_checkpoints
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8, position: u32) -> BlockKey {
        let mut d = [0u8; 32];
        d[0] = n;
        BlockKey { key: Key { group: 0, digest: Digest(d) }, position }
    }

    #[test]
    fn hands_out_blocks_in_order_and_never_the_null_block() {
        let mut pool = BlockPool::new(4);
        let mut ev = Vec::new();
        let got: Vec<_> =
            (0..3).map(|_| pool.allocate(BlockKind::Paged, &mut ev).unwrap_or(0)).collect();
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(pool.allocate(BlockKind::Paged, &mut ev), None);
        pool.check().unwrap();
    }

    #[test]
    fn reuses_unpublished_blocks_before_cached_ones() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = pool.allocate(BlockKind::Paged, &mut ev).unwrap();
        let b = pool.allocate(BlockKind::Paged, &mut ev).unwrap();
        pool.add_key(a, key(1, 16));
        pool.decref(a, LruEnd::MostRecent);
        pool.decref(b, LruEnd::MostRecent);
        assert_eq!(pool.num_cached(), 1);
        assert_eq!(pool.allocate(BlockKind::Paged, &mut ev), Some(b));
        assert!(ev.is_empty());
        assert_eq!(pool.allocate(BlockKind::Paged, &mut ev), Some(a));
        assert_eq!(ev, vec![key(1, 16)]);
        pool.check().unwrap();
    }

    #[test]
    fn evicts_least_recent_first_and_honours_the_least_recent_end() {
        let mut pool = BlockPool::new(5);
        let mut ev = Vec::new();
        let ids: Vec<_> =
            (0..4).map(|_| pool.allocate(BlockKind::Paged, &mut ev).unwrap()).collect();
        for (i, &b) in ids.iter().enumerate() {
            pool.add_key(b, key(i as u8, 4));
        }
        pool.decref(ids[0], LruEnd::MostRecent);
        pool.decref(ids[1], LruEnd::MostRecent);
        pool.decref(ids[2], LruEnd::LeastRecent);
        pool.decref(ids[3], LruEnd::MostRecent);
        let order: Vec<_> = pool.lru_iter().collect();
        assert_eq!(order, vec![ids[2], ids[0], ids[1], ids[3]]);
        // A pin removes a block from the LRU; releasing it puts it back as most recent.
        pool.incref(ids[0]);
        assert_eq!(pool.num_cached(), 3);
        pool.decref(ids[0], LruEnd::MostRecent);
        let order: Vec<_> = pool.lru_iter().collect();
        assert_eq!(order, vec![ids[2], ids[1], ids[3], ids[0]]);
        pool.check().unwrap();
    }

    #[test]
    fn counts_checkpoint_blocks_through_their_life() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let c = pool.allocate(BlockKind::Checkpoint, &mut ev).unwrap();
        assert_eq!(pool.num_checkpoints(), 1);
        pool.add_key(c, key(9, 8));
        pool.decref(c, LruEnd::MostRecent);
        assert_eq!(pool.num_checkpoints(), 1);
        pool.check().unwrap();
        let p = pool.allocate(BlockKind::Paged, &mut ev).unwrap();
        assert_ne!(p, c);
        let again = pool.allocate(BlockKind::Paged, &mut ev).unwrap();
        assert_eq!(again, c);
        assert_eq!(pool.num_checkpoints(), 0);
        pool.check().unwrap();
    }
}
