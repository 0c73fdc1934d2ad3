//! Admission: how a scheduled chunk gets its blocks. A first chunk pins the blocks of its hit
//! (full-attention chain, copy-on-write source, the checkpoint a state group resumes from) and
//! allocates its own (paged blocks, copy-on-write destination, running-state buffers); a later
//! chunk extends its tables. `blocks_available` is the capacity check that makes `schedule`
//! atomic; `take_blocks` then cannot fail but for a bug (an invariant error, never a null
//! block in a table).
//!
//! Functions of the store, the layout and one sequence; they allocate through the store and
//! never publish, evict on purpose or plan checkpoints.

use crate::config::{GroupLayout, GroupSlot};
use crate::error::{CacheError, Result};
use crate::hit::hit_block;
use crate::pool::{BlockId, BlockKind, NULL_BLOCK};
use crate::sequence::{PagedSeq, PagedStep, Sequence, StateSeq, StateStep};
use crate::store::BlockStore;

/// How a sequence's first step uses its hit in one paged group.
pub(crate) struct PagedAdmission {
    /// Table entries (null outside a sliding window).
    table: Vec<BlockId>,
    /// Copy-on-write source and tokens to copy.
    cow: Option<(BlockId, u32)>,
}

/// How a sequence's first step uses its hit: per paged group of the layout its table, per
/// state group the checkpoint resumed from (the null block: the zero state).
pub(crate) struct Admission {
    paged: Vec<PagedAdmission>,
    resume: Vec<BlockId>,
}

/// Whether every paged table of a started sequence already has the blocks for tokens
/// `[0, reach)`.
pub(crate) fn tables_cover(layout: &GroupLayout, seq: &Sequence, reach: u32) -> bool {
    layout.paged.iter().zip(&seq.paged).all(|(group, paged)| {
        paged.table.len() as u64 * u64::from(group.block_size) >= u64::from(reach)
    })
}

/// Which published blocks a first step uses, per group, for a hit of `hit` tokens.
/// `chains` are the full-attention blocks the hit's lookup chose (possibly empty). A block the
/// hit counted on that is not published is an invariant error, never a null block in a table.
pub(crate) fn admission(
    store: &BlockStore,
    layout: &GroupLayout,
    seq: &Sequence,
    hit: u32,
    mut chains: Vec<Vec<BlockId>>,
) -> Result<Admission> {
    let seq = seq.content();
    let mut paged = Vec::with_capacity(layout.paged.len());
    for group in &layout.paged {
        let (gid, block_size) = (group.index as u32, group.block_size);
        let first_col = group.window.map_or(0, |w| hit.saturating_sub(w) / block_size);
        let full = hit / block_size;
        let chain = chains.get_mut(group.index).map(std::mem::take).unwrap_or_default();
        let table = if first_col == 0 && chain.len() >= full as usize {
            let mut chain = chain;
            chain.truncate(full as usize);
            chain
        } else {
            let mut table = Vec::with_capacity(full as usize);
            for c in 0..full {
                table.push(if c < first_col {
                    NULL_BLOCK // outside the window
                } else {
                    hit_block(store, seq, gid, (c + 1) * block_size)?
                });
            }
            table
        };
        let cow = match hit % block_size {
            0 => None,
            copied => Some((hit_block(store, seq, gid, hit)?, copied)),
        };
        paged.push(PagedAdmission { table, cow });
    }
    let mut resume = Vec::with_capacity(layout.state.len());
    for group in &layout.state {
        // A hit of 0 resumes from the zero state (the null block).
        resume.push(if hit > 0 {
            hit_block(store, seq, group.index as u32, hit)?
        } else {
            NULL_BLOCK
        });
    }
    Ok(Admission { paged, resume })
}

/// Whether every pool can supply the new blocks this chunk needs, counting the cached
/// blocks the hit is about to pin as unavailable.
pub(crate) fn blocks_available(
    store: &BlockStore,
    layout: &GroupLayout,
    seq: &Sequence,
    end: u32,
    admission: Option<&Admission>,
    continuation: bool,
) -> bool {
    (0..store.pools.len()).all(|pool| {
        let p = &store.pools[pool];
        let cached = |b: &BlockId| *b != NULL_BLOCK && p.is_cached(*b);
        let mut need = 0u64;
        for (i, group) in layout.paged.iter().enumerate().filter(|(_, g)| g.pool == pool) {
            let cols = end.div_ceil(group.block_size) as usize;
            let have = match admission {
                Some(a) => {
                    let a = &a.paged[i];
                    // Pinning takes these out of the evictable set.
                    let src = a.cow.as_ref().map(|(src, _)| src);
                    need += a.table.iter().chain(src).filter(|b| cached(b)).count() as u64;
                    a.table.len()
                }
                None => seq.paged[i].table.len(),
            };
            need += cols.saturating_sub(have) as u64;
        }
        if let Some(a) = admission {
            for (i, _) in layout.state.iter().enumerate().filter(|(_, g)| g.pool == pool) {
                // The resume pin, and the two running buffers.
                need += u64::from(cached(&a.resume[i])) + 2;
            }
        }
        if continuation {
            for (i, _) in layout.state.iter().enumerate().filter(|(_, g)| g.pool == pool) {
                // A further running buffer, unless a spare one is free.
                need += u64::from(seq.spare_buffer(i).is_none());
            }
        }
        need <= u64::from(p.num_available())
    })
}

/// One block the capacity check (`blocks_available`) promised: its absence is a bug in the
/// core, reported as an invariant error rather than a null block in a plan.
#[inline]
fn take_block(store: &mut BlockStore, pool: usize, kind: BlockKind, g: usize) -> Result<BlockId> {
    match store.allocate(pool, kind, g as u32) {
        Some(block) => Ok(block),
        None => Err(unavailable(pool, kind, g)),
    }
}

#[cold]
#[inline(never)]
fn unavailable(pool: usize, kind: BlockKind, g: usize) -> CacheError {
    CacheError::invariant(format!(
        "pool {pool} could not supply a {kind:?} block for group {g} after its capacity check \
         promised it"
    ))
}

/// Pins the hit and allocates the chunk's blocks, group by group in config order; only
/// called once `blocks_available`. Returns the step's part of each paged and state group.
pub(crate) fn take_blocks(
    store: &mut BlockStore,
    layout: &GroupLayout,
    seq: &mut Sequence,
    end: u32,
    admission: Option<&Admission>,
) -> Result<(Vec<PagedStep>, Vec<StateStep>)> {
    let (mut paged_steps, mut state_steps) = seq.ring.take_free_parts();
    // Every group's hit is pinned before any group allocates: groups may share a pool, and
    // an allocation must not evict a block another group is about to resume from.
    if let Some(a) = admission {
        for (g, group) in layout.slots.iter().enumerate() {
            let pool = &mut store.pools[layout.pool_of[g]];
            let mut pin = |b: BlockId| {
                pool.incref(b);
                pool.touch(b);
            };
            match *group {
                GroupSlot::Paged(i) => {
                    let a = &a.paged[i];
                    a.table.iter().copied().for_each(&mut pin);
                    // (the null resume of a paged group: it advances the pool's clock)
                    pin(NULL_BLOCK);
                    a.cow.iter().for_each(|&(src, _)| pin(src));
                }
                GroupSlot::State(i) => pin(a.resume[i]),
            }
        }
    }
    for g in 0..layout.len() {
        let pool = layout.pool(g);
        match layout.slots[g] {
            GroupSlot::Paged(i) => {
                let cols = end.div_ceil(layout.paged[i].block_size) as usize;
                let Some(a) = admission else {
                    if seq.paged[i].table.len() >= cols {
                        // A running sequence whose table already covers the chunk (most
                        // decode steps): nothing to allocate, so its table stays.
                        let table_len_before = seq.paged[i].table.len();
                        paged_steps.push(PagedStep { table_len_before, cow: None, reported_to: 0 });
                        continue;
                    }
                    let mut paged = std::mem::take(&mut seq.paged[i]);
                    let table_len_before = paged.table.len();
                    while paged.table.len() < cols {
                        paged.table.push(take_block(store, pool, BlockKind::Paged, g)?);
                    }
                    seq.paged[i] = paged;
                    paged_steps.push(PagedStep { table_len_before, cow: None, reported_to: 0 });
                    continue;
                };
                let a = &a.paged[i];
                let mut paged = PagedSeq {
                    window_start: a.table.iter().take_while(|&&b| b == NULL_BLOCK).count(),
                    table: a.table.clone(),
                    window_reported: 0,
                };
                let mut cow = None;
                if let Some((src, tokens)) = a.cow {
                    let dst = take_block(store, pool, BlockKind::Paged, g)?;
                    paged.table.push(dst);
                    cow = Some((src, dst, tokens));
                }
                while paged.table.len() < cols {
                    paged.table.push(take_block(store, pool, BlockKind::Paged, g)?);
                }
                seq.paged[i] = paged;
                paged_steps.push(PagedStep { table_len_before: 0, cow, reported_to: 0 });
            }
            GroupSlot::State(i) => {
                if let Some(a) = admission {
                    let r0 = take_block(store, pool, BlockKind::Running, g)?;
                    let r1 = take_block(store, pool, BlockKind::Running, g)?;
                    seq.state[i] = StateSeq {
                        running: [r0, r1],
                        extra: Vec::new(),
                        current: None,
                        resume: a.resume[i],
                        decode_tail: None,
                        spare: NULL_BLOCK,
                    };
                }
                state_steps.push(StateStep::default());
            }
        }
    }
    Ok((paged_steps, state_steps))
}

/// Chooses the running buffers a scheduled step reads and writes, per state group. A step of
/// a sequence with no step in flight reads the committed state (or its resume checkpoint, or
/// the zero state) and writes the other buffer of its pair; a `continuation` reads what the
/// step before it writes and writes a spare buffer, allocated when there is none (its
/// capacity was checked by `blocks_available`).
pub(crate) fn assign_running(
    store: &mut BlockStore,
    layout: &GroupLayout,
    seq: &mut Sequence,
    state_steps: &mut [StateStep],
    continuation: bool,
) -> Result<()> {
    for (i, group) in layout.state.iter().enumerate() {
        if !continuation {
            let state = &seq.state[i];
            (state_steps[i].write, state_steps[i].read) = (state.write_block(), state.read_slot());
            continue;
        }
        let read = seq.continuation_read(i);
        let write = if let Some(b) = seq.spare_buffer(i) {
            b
        } else {
            let b = take_block(store, group.pool, BlockKind::Running, group.index)?;
            seq.state[i].extra.push(b);
            b
        };
        seq.state[i].spare = NULL_BLOCK; // (see `StateSeq::spare`)
        (state_steps[i].write, state_steps[i].read) = (write, read);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::take_block;
    use crate::error::CacheError;
    use crate::events::EventLog;
    use crate::hashing::Digest;
    use crate::index::HashIndex;
    use crate::pool::{BlockKind, BlockPool, NULL_BLOCK};
    use crate::store::BlockStore;

    #[test]
    fn a_block_the_capacity_check_promised_but_the_pool_lacks_is_an_invariant_error() {
        // One usable block: the first allocation gets it, the second finds the pool empty.
        let pools = vec![BlockPool::new(2)];
        let index = HashIndex::new(0, false, 0);
        let format =
            crate::events::WireFormat { block_size: 4, unit: 4, digest_len: 16, kinds: vec![] };
        let events = EventLog::new(false, 0, format);
        let mut store = BlockStore::new(pools, index, events, vec![0], 4, Digest([0; 32]));
        let first = take_block(&mut store, 0, BlockKind::Paged, 0).expect("one block is free");
        assert_ne!(first, NULL_BLOCK);
        let second = take_block(&mut store, 0, BlockKind::Paged, 0);
        assert!(matches!(second, Err(CacheError::Invariant { .. })), "{second:?}");
    }
}
