//! `BlockPool`: block ids, reference counts, keys per block and the LRU of cached blocks.
//!
//! Every block id `1..num_blocks` is in exactly one of three states:
//! - **free**: reference count 0, no key; on the free stack (reused first);
//! - **cached**: reference count 0, at least one key (published); in the LRU list;
//! - **owned**: reference count > 0 (a sequence, a step or a pin holds it), keyed or not.
//!
//! Block 0 is the null block: it is never allocated, freed, keyed or evicted.
//!
//! A block's state is one 64-byte record (`Slot`), so that touching a block costs one cache
//! line. The LRU is an intrusive doubly linked list through those records: linking, unlinking
//! and popping are O(1) and allocate nothing. The pool does not know the hash index: when a cached
//! block is evicted its keys are drained into a caller-supplied buffer, and the caller removes
//! them from the index. The pool never panics on ids it handed out; the manager only passes ids
//! it holds.

use crate::hashing::Digest;
use crate::limits::{human_bytes, try_vec, BYTES_PER_BLOCK};

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

impl Key {
    /// The digest's first eight bytes mixed with the group. The digest is already uniformly
    /// distributed, so this is a good map hash, and a 64-bit stand-in for the key wherever a
    /// rare false match costs nothing (the record of recently evicted keys).
    #[must_use]
    pub fn fingerprint(&self) -> u64 {
        let mut head = [0u8; 8];
        head.copy_from_slice(&self.digest.0[..8]);
        u64::from_le_bytes(head) ^ u64::from(self.group).rotate_left(40)
    }
}

impl std::hash::Hash for Key {
    /// The fingerprint: much cheaper than feeding all 32 digest bytes to the hasher.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.fingerprint());
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

/// The state of one block, in one 64-byte record: every field an allocation, a release, a
/// publication or an eviction reads or writes sits in one cache line, so touching a block
/// costs one miss instead of one per parallel array.
#[derive(Clone, Copy, Debug)]
#[repr(align(64))]
struct Slot {
    /// The key most recently added (`NO_BLOCK_KEY` when none): a full block's full key, so
    /// confirming a chain of blocks reads one record per block. When the block carries a
    /// single key (one unit per block) it is the block's only key list.
    last: BlockKey,
    /// Recency: larger is more recently released or used.
    stamp: u64,
    ref_count: u32,
    prev: u32,
    next: u32,
    kind: BlockKind,
    /// The block shares a key with another block (set when the second one is published,
    /// cleared when the block is reused): a chain hint naming it is not taken on trust.
    shared_key: bool,
    in_lru: bool,
    /// The block carries several keys, all in `BlockPool::spill` (`last` is the latest).
    spilled: bool,
}

// One cache line per block, whatever the target: a field added here must find room.
const _: () = assert!(std::mem::size_of::<Slot>() == 64);

/// `last` of a block that carries no key (no group has this id).
const NO_BLOCK_KEY: BlockKey = BlockKey { key: NO_KEY, position: 0 };

const EMPTY_SLOT: Slot = Slot {
    last: NO_BLOCK_KEY,
    stamp: 0,
    ref_count: 0,
    prev: NIL,
    next: NIL,
    kind: BlockKind::Free,
    shared_key: false,
    in_lru: false,
    spilled: false,
};

impl Slot {
    fn keyed(&self) -> bool {
        self.last.key.group != NO_KEY.group
    }
}

/// One pool of blocks.
#[derive(Clone, Debug)]
pub struct BlockPool {
    slots: Vec<Slot>,
    /// The keys of blocks that carry several (one per unit boundary when a block spans
    /// several units), in the order they were added; empty for every other block. Emptied
    /// lists keep their capacity for the block's next use.
    spill: Vec<Vec<BlockKey>>,
    clock: u64,
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
    free: Vec<BlockId>,
    num_checkpoints: u32,
    /// The group of each checkpoint block (meaningful only while the block is labelled a
    /// checkpoint): a state group's cap counts its own checkpoints, also when several groups
    /// share the pool. One byte a block (`MAX_GROUPS` is 256), written only when a checkpoint
    /// is taken.
    checkpoint_group: Vec<u8>,
    /// Checkpoint blocks per group (owned, pending or cached), indexed by group.
    checkpoints_by_group: Vec<u32>,
}

impl BlockPool {
    /// A pool of `num_blocks` ids (the null block included); all usable ids start free.
    ///
    /// # Panics
    /// When the memory cannot be allocated; [`BlockPool::try_new`] returns an error instead.
    #[must_use]
    pub fn new(num_blocks: u32) -> Self {
        match Self::try_new(num_blocks) {
            Ok(pool) => pool,
            Err(message) => panic!("{message}"),
        }
    }

    /// A pool of `num_blocks` ids, its memory reserved fallibly: `Err` names the bytes it would
    /// need when they cannot be allocated (`BYTES_PER_BLOCK` a block).
    pub fn try_new(num_blocks: u32) -> Result<Self, String> {
        let n = num_blocks as usize;
        let what = format!("a pool of {num_blocks} blocks");
        let too_big = |_| {
            format!(
                "{what} needs {} of block records ({BYTES_PER_BLOCK} bytes a block), which could \
                 not be allocated; use fewer blocks",
                human_bytes(n.saturating_mul(BYTES_PER_BLOCK))
            )
        };
        let mut slots = try_vec(n, &what).map_err(too_big)?;
        slots.resize(n, EMPTY_SLOT);
        let mut spill = try_vec(n, &what).map_err(too_big)?;
        spill.resize_with(n, Vec::new);
        let mut free = try_vec(n.saturating_sub(1), &what).map_err(too_big)?;
        // Popped from the end: block 1 is handed out first.
        free.extend((1..num_blocks).rev());
        let mut checkpoint_group = try_vec(n, &what).map_err(too_big)?;
        checkpoint_group.resize(n, 0);
        Ok(Self {
            slots,
            spill,
            clock: 0,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            free,
            num_checkpoints: 0,
            checkpoint_group,
            checkpoints_by_group: Vec::new(),
        })
    }

    /// Number of ids, the null block included.
    #[must_use]
    pub fn num_blocks(&self) -> u32 {
        self.slots.len() as u32
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

    /// Blocks currently holding checkpoints of `group` (owned, pending or cached): what the
    /// group's `checkpoint_cap` bounds.
    #[must_use]
    pub fn num_checkpoints_of(&self, group: u32) -> u32 {
        self.checkpoints_by_group.get(group as usize).copied().unwrap_or(0)
    }

    /// The group of a checkpoint block (`None` for any other block).
    #[must_use]
    pub fn checkpoint_group(&self, block: BlockId) -> Option<u32> {
        let b = block as usize;
        self.slots
            .get(b)
            .filter(|s| s.kind.is_checkpoint())
            .map(|_| u32::from(self.checkpoint_group[b]))
    }

    #[must_use]
    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.slots.get(block as usize).map_or(0, |s| s.ref_count)
    }

    #[must_use]
    pub fn keys(&self, block: BlockId) -> &[BlockKey] {
        let b = block as usize;
        match self.slots.get(b) {
            Some(slot) if slot.spilled => &self.spill[b],
            Some(slot) if slot.keyed() => std::slice::from_ref(&slot.last),
            _ => &[],
        }
    }

    #[must_use]
    pub fn kind(&self, block: BlockId) -> BlockKind {
        self.slots.get(block as usize).map_or_else(BlockKind::default, |s| s.kind)
    }

    #[must_use]
    pub fn is_published(&self, block: BlockId) -> bool {
        self.slots.get(block as usize).is_some_and(Slot::keyed)
    }

    #[must_use]
    pub fn is_cached(&self, block: BlockId) -> bool {
        self.slots.get(block as usize).is_some_and(|s| s.in_lru)
    }

    /// Recency of a block: larger is more recently released or used.
    #[must_use]
    pub fn stamp(&self, block: BlockId) -> u64 {
        self.slots.get(block as usize).map_or(0, |s| s.stamp)
    }

    /// Marks a block as sharing a key with another block.
    pub fn mark_shared_key(&mut self, block: BlockId) {
        if let Some(slot) = self.slots.get_mut(block as usize) {
            slot.shared_key = true;
        }
    }

    /// Whether `block` carries `key` (the index confirms its fingerprint matches this way).
    #[must_use]
    #[inline]
    pub fn carries(&self, block: BlockId, key: &Key) -> bool {
        let b = block as usize;
        block != NULL_BLOCK
            && self.slots.get(b).is_some_and(|slot| {
                slot.last.key == *key
                    || (slot.spilled && self.spill[b].iter().any(|k| k.key == *key))
            })
    }

    /// Whether `block` is the only block published under `key`, as far as the pool knows:
    /// it carries the key and never shared a key with another block since it was allocated.
    #[must_use]
    pub fn sole_holder_of(&self, block: BlockId, key: &Key) -> bool {
        self.carries(block, key) && self.slots.get(block as usize).is_some_and(|s| !s.shared_key)
    }

    /// Labels a block; a checkpoint is counted against `group` (ignored for other kinds).
    fn set_kind(&mut self, block: BlockId, kind: BlockKind, group: u32) {
        let b = block as usize;
        if self.slots[b].kind.is_checkpoint() {
            self.num_checkpoints -= 1;
            self.checkpoints_by_group[usize::from(self.checkpoint_group[b])] -= 1;
        }
        if kind.is_checkpoint() {
            // Group ids are below `MAX_GROUPS` (256), checked by the configuration.
            let g = u8::try_from(group).unwrap_or(u8::MAX);
            self.num_checkpoints += 1;
            self.checkpoint_group[b] = g;
            let by_group = &mut self.checkpoints_by_group;
            if by_group.len() <= usize::from(g) {
                by_group.resize(usize::from(g) + 1, 0);
            }
            by_group[usize::from(g)] += 1;
        }
        self.slots[b].kind = kind;
    }

    /// Takes a block with reference count 1, labelled `kind` (a checkpoint of `group`): a free
    /// one first, else the least recently used cached one, whose keys are appended to
    /// `evicted` (the caller unindexes them). Returns `None` when nothing is free or cached.
    pub fn allocate(
        &mut self,
        kind: BlockKind,
        group: u32,
        evicted: &mut Vec<BlockKey>,
    ) -> Option<BlockId> {
        let block = if let Some(block) = self.free.pop() {
            block
        } else if self.lru_head != NIL {
            let block = self.lru_head;
            self.take_cached(block, evicted);
            block
        } else {
            return None;
        };
        self.own(block, kind, group);
        Some(block)
    }

    /// Takes a specific cached block (evicting it), e.g. the least recently used checkpoint.
    /// Returns false if the block is not cached.
    pub fn allocate_cached(
        &mut self,
        block: BlockId,
        kind: BlockKind,
        group: u32,
        evicted: &mut Vec<BlockKey>,
    ) -> bool {
        if !self.is_cached(block) {
            return false;
        }
        self.take_cached(block, evicted);
        self.own(block, kind, group);
        true
    }

    /// A just taken block: one holder, no shared key, labelled `kind` (of `group`).
    fn own(&mut self, block: BlockId, kind: BlockKind, group: u32) {
        let slot = &mut self.slots[block as usize];
        slot.ref_count = 1;
        slot.shared_key = false;
        self.set_kind(block, kind, group);
    }

    fn take_cached(&mut self, block: BlockId, evicted: &mut Vec<BlockKey>) {
        self.unlink(block);
        let b = block as usize;
        let slot = &mut self.slots[b];
        if slot.spilled {
            evicted.append(&mut self.spill[b]);
            slot.spilled = false;
        } else if slot.keyed() {
            evicted.push(slot.last);
        }
        slot.last = NO_BLOCK_KEY;
    }

    /// Adds a holder. A cached block leaves the LRU (it can no longer be evicted).
    pub fn incref(&mut self, block: BlockId) {
        if block == NULL_BLOCK || block as usize >= self.slots.len() {
            return;
        }
        if self.slots[block as usize].in_lru {
            self.unlink(block);
            // (the block is in use now: which copy of its keys a hit picks may change)
            self.clock += 1;
        }
        self.slots[block as usize].ref_count += 1;
    }

    /// A counter that changes whenever a keyed block starts or stops being in use or is used
    /// again (a release into the LRU, a pin out of it, a touch): what picks one copy among
    /// blocks under the same key (in use, else the most recently used).
    #[must_use]
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Drops a holder. At zero a published block enters the LRU at `end`, an unpublished one
    /// becomes free.
    pub fn decref(&mut self, block: BlockId, end: LruEnd) {
        let b = block as usize;
        let Some(slot) = self.slots.get_mut(b) else {
            return;
        };
        if block == NULL_BLOCK || slot.ref_count == 0 {
            return;
        }
        slot.ref_count -= 1;
        if slot.ref_count > 0 {
            return;
        }
        if slot.keyed() {
            self.link(block, end);
        } else {
            self.set_kind(block, BlockKind::Free, 0);
            self.free.push(block);
        }
    }

    /// Adds a key to a block; false if the block already carries it.
    pub fn add_key(&mut self, block: BlockId, key: BlockKey) -> bool {
        let b = block as usize;
        let Some(slot) = self.slots.get_mut(b) else {
            return false;
        };
        if block == NULL_BLOCK || key.key.group == NO_KEY.group {
            return false;
        }
        if slot.spilled {
            let keys = &mut self.spill[b];
            if keys.iter().any(|k| k.key == key.key) {
                return false;
            }
            keys.push(key);
        } else if slot.keyed() {
            if slot.last.key == key.key {
                return false;
            }
            let keys = &mut self.spill[b];
            keys.push(slot.last);
            keys.push(key);
            slot.spilled = true;
        }
        slot.last = key;
        true
    }

    /// Marks a block as just used (a hit promotes it like a release would).
    pub fn touch(&mut self, block: BlockId) {
        self.clock += 1;
        if let Some(slot) = self.slots.get_mut(block as usize) {
            slot.stamp = self.clock;
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
            cur = self.slots[block as usize].next;
            Some(block)
        })
    }

    /// Drops every key and every cached block; only valid when no block is owned.
    /// Appends the removed keys to `evicted`.
    pub fn clear(&mut self, evicted: &mut Vec<BlockKey>) {
        let n = self.num_blocks();
        for block in 0..n {
            evicted.extend_from_slice(self.keys(block));
        }
        self.slots.fill(EMPTY_SLOT);
        for keys in &mut self.spill {
            keys.clear();
        }
        self.free.clear();
        self.free.extend((1..n).rev());
        self.clock = 0;
        self.lru_head = NIL;
        self.lru_tail = NIL;
        self.lru_len = 0;
        self.num_checkpoints = 0;
        self.checkpoints_by_group.clear();
    }

    fn link(&mut self, block: BlockId, end: LruEnd) {
        self.clock += 1;
        let (head, tail) = (self.lru_head, self.lru_tail);
        let slot = &mut self.slots[block as usize];
        slot.in_lru = true;
        match end {
            LruEnd::MostRecent => {
                slot.stamp = self.clock;
                slot.prev = tail;
                slot.next = NIL;
                if tail == NIL {
                    self.lru_head = block;
                } else {
                    self.slots[tail as usize].next = block;
                }
                self.lru_tail = block;
            }
            LruEnd::LeastRecent => {
                slot.stamp = 0;
                slot.next = head;
                slot.prev = NIL;
                if head == NIL {
                    self.lru_tail = block;
                } else {
                    self.slots[head as usize].prev = block;
                }
                self.lru_head = block;
            }
        }
        self.lru_len += 1;
    }

    fn unlink(&mut self, block: BlockId) {
        let slot = &mut self.slots[block as usize];
        let (p, n) = (slot.prev, slot.next);
        slot.prev = NIL;
        slot.next = NIL;
        slot.in_lru = false;
        if p == NIL {
            self.lru_head = n;
        } else {
            self.slots[p as usize].next = n;
        }
        if n == NIL {
            self.lru_tail = p;
        } else {
            self.slots[n as usize].prev = p;
        }
        self.lru_len -= 1;
    }

    /// Checks the pool's own invariants: the three states partition the ids, the LRU list is
    /// well formed, the null block is untouched, every block's key list is consistent.
    /// Returns a description of the first violation.
    pub fn check(&self) -> Result<(), String> {
        let n = self.slots.len();
        let null = &self.slots[0];
        if null.ref_count != 0 || null.keyed() || null.spilled || null.in_lru {
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
            if seen > self.lru_len || self.slots[block as usize].prev != prev {
                return Err("LRU list is corrupt".into());
            }
            prev = block;
        }
        if seen != self.lru_len || self.lru_tail != prev {
            return Err(format!("LRU length {} but {seen} linked", self.lru_len));
        }
        let mut checkpoints = 0;
        let mut by_group = vec![0u32; self.checkpoints_by_group.len()];
        for (b, slot) in self.slots.iter().enumerate().skip(1) {
            let (rc, keyed, cached) = (slot.ref_count, slot.keyed(), slot.in_lru);
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
            if rc == 0 && !keyed && slot.kind != BlockKind::Free {
                return Err(format!("free block {b} still labelled {:?}", slot.kind));
            }
            if slot.kind.is_checkpoint() {
                checkpoints += 1;
                match by_group.get_mut(usize::from(self.checkpoint_group[b])) {
                    Some(count) => *count += 1,
                    None => return Err(format!("checkpoint block {b} of an uncounted group")),
                }
            }
            let spill = &self.spill[b];
            let keys_ok = if slot.spilled {
                keyed && spill.len() >= 2 && spill.last() == Some(&slot.last)
            } else {
                spill.is_empty()
            };
            if !keys_ok {
                return Err(format!(
                    "block {b}: its key list ({} spilled keys, spilled {}) does not end with \
                     its last key",
                    spill.len(),
                    slot.spilled
                ));
            }
        }
        if by_group != self.checkpoints_by_group {
            return Err(format!(
                "checkpoints per group {:?} but {by_group:?} blocks labelled",
                self.checkpoints_by_group
            ));
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
            (0..3).map(|_| pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap_or(0)).collect();
        assert_eq!(got, vec![1, 2, 3]);
        assert_eq!(pool.allocate(BlockKind::Paged, 0, &mut ev), None);
        pool.check().unwrap();
    }

    #[test]
    fn reuses_unpublished_blocks_before_cached_ones() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap();
        let b = pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap();
        pool.add_key(a, key(1, 16));
        pool.decref(a, LruEnd::MostRecent);
        pool.decref(b, LruEnd::MostRecent);
        assert_eq!(pool.num_cached(), 1);
        assert_eq!(pool.allocate(BlockKind::Paged, 0, &mut ev), Some(b));
        assert!(ev.is_empty());
        assert_eq!(pool.allocate(BlockKind::Paged, 0, &mut ev), Some(a));
        assert_eq!(ev, vec![key(1, 16)]);
        pool.check().unwrap();
    }

    #[test]
    fn evicts_least_recent_first_and_honours_the_least_recent_end() {
        let mut pool = BlockPool::new(5);
        let mut ev = Vec::new();
        let ids: Vec<_> =
            (0..4).map(|_| pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap()).collect();
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
    fn keeps_one_key_inline_and_several_in_order() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let a = pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap();
        assert!(pool.add_key(a, key(1, 4)));
        assert!(!pool.add_key(a, key(1, 4)), "a key a block carries is not added twice");
        assert_eq!(pool.keys(a), &[key(1, 4)]);
        assert!(pool.add_key(a, key(2, 8)));
        assert!(pool.add_key(a, key(3, 12)));
        assert!(!pool.add_key(a, key(2, 8)));
        assert_eq!(pool.keys(a), &[key(1, 4), key(2, 8), key(3, 12)]);
        assert!(pool.sole_holder_of(a, &key(2, 8).key));
        assert!(!pool.sole_holder_of(a, &key(4, 16).key));
        pool.check().unwrap();
        pool.decref(a, LruEnd::MostRecent);
        let b = pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap();
        assert_ne!(a, b);
        // The next allocation evicts `a`: every key it carried comes back, in order.
        assert_eq!(pool.allocate(BlockKind::Paged, 0, &mut ev), Some(a));
        assert_eq!(ev, vec![key(1, 4), key(2, 8), key(3, 12)]);
        assert!(pool.keys(a).is_empty() && !pool.is_published(a));
        // Reused, the block starts with a single inline key again.
        assert!(pool.add_key(a, key(5, 4)));
        assert_eq!(pool.keys(a), &[key(5, 4)]);
        pool.check().unwrap();
        let mut cleared = Vec::new();
        pool.decref(a, LruEnd::MostRecent);
        pool.decref(b, LruEnd::MostRecent);
        pool.clear(&mut cleared);
        assert_eq!(cleared, vec![key(5, 4)]);
        assert_eq!(pool.num_free(), 2);
        pool.check().unwrap();
    }

    #[test]
    fn counts_checkpoint_blocks_through_their_life() {
        let mut pool = BlockPool::new(3);
        let mut ev = Vec::new();
        let c = pool.allocate(BlockKind::Checkpoint, 0, &mut ev).unwrap();
        assert_eq!(pool.num_checkpoints(), 1);
        pool.add_key(c, key(9, 8));
        pool.decref(c, LruEnd::MostRecent);
        assert_eq!(pool.num_checkpoints(), 1);
        pool.check().unwrap();
        let p = pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap();
        assert_ne!(p, c);
        let again = pool.allocate(BlockKind::Paged, 0, &mut ev).unwrap();
        assert_eq!(again, c);
        assert_eq!(pool.num_checkpoints(), 0);
        pool.check().unwrap();
    }
}
