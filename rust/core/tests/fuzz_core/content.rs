//! What the engine wrote into every block, as the fuzz can name it, and the checks that no step
//! reads anything else: the fuzz plays the engine, writing exactly what each committed plan
//! says (the KV of the scheduled tokens through the slot mapping, copy-on-write copies, the
//! running state, interior checkpoints and snapshots), and garbage where an aborted step wrote.
//!
//! Then, for every plan: a first step's hit columns hold the KV of its own prefix (same tokens
//! and extra keys) up to each block's end, its copy-on-write source holds it up to the hit,
//! and its state groups resume from a checkpoint of exactly that prefix (or the zero state);
//! a later step reads the running state its sequence's last committed step wrote; every
//! interior checkpoint is on the kernel's grid (a multiple of U at an offset that is a multiple
//! of the group's alignment, at most C of them) and every snapshot lands on a unit boundary.

use std::collections::{BTreeMap, HashMap};

use prefixcache_core::{CacheConfig, GroupKind, StepPlan};

use crate::ident::Prefix;

/// What a block holds.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Content {
    /// Paged KV: the prefix identity at each unit boundary the block's written tokens end on.
    Kv(BTreeMap<u32, Prefix>),
    /// A state snapshot after this prefix (a checkpoint).
    State(Prefix),
    /// The running state of a sequence after this many tokens.
    Running(u64, u32),
    /// Written by an aborted step.
    Garbage,
}

/// Blocks' contents, per (pool, block).
#[derive(Default)]
pub(crate) struct Contents {
    blocks: HashMap<(usize, u32), Content>,
    /// Reads checked: hit columns, copy-on-write sources, resumed checkpoints, running states.
    pub(crate) checked: [u64; 4],
}

/// A sequence as the content checks need it: its keys (prefix identities per unit).
pub(crate) type Keys<'a> = &'a dyn Fn(u64) -> Option<&'a [Prefix]>;

fn key(keys: &[Prefix], unit: u32, p: u32) -> Option<Prefix> {
    keys.get((p / unit).checked_sub(1)? as usize).copied()
}

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

impl Contents {
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
    }

    /// Checks what a plan reads, and clears the blocks it gives sequences fresh.
    #[allow(clippy::too_many_lines)]
    pub(crate) fn plan(
        &mut self,
        config: &CacheConfig,
        plan: &StepPlan,
        keys: Keys<'_>,
        first: &dyn Fn(usize) -> bool,
    ) -> Result<(), String> {
        let unit = config.hash.unit;
        for p in &plan.paged {
            let g = p.group as usize;
            let pool = config.groups[g].pool;
            let (block, window) = match config.groups[g].kind {
                GroupKind::FullAttention { block_size } => (block_size, None),
                GroupKind::SlidingWindow { block_size, window } => (block_size, Some(window)),
                GroupKind::State(_) => return Err("a paged plan of a state group".into()),
            };
            for (r, &id) in plan.seq_ids.iter().enumerate() {
                let row: BTreeMap<u32, u32> = p
                    .appended
                    .chunks(3)
                    .filter(|t| t[0] == r as i32)
                    .map(|t| (t[1] as u32, t[2] as u32))
                    .collect();
                let start = plan.num_computed[r] as u32;
                let keys = keys(id).ok_or("a plan row of an unknown sequence")?;
                let fresh_from = if first(r) {
                    let first_col = window.map_or(0, |w| start.saturating_sub(w) / block);
                    for c in first_col..start / block {
                        let b =
                            *row.get(&c).ok_or_else(|| format!("no block at hit column {c}"))?;
                        let at = (c + 1) * block;
                        let want = key(keys, unit, at);
                        let have = match self.blocks.get(&(pool, b)) {
                            Some(Content::Kv(kv)) => kv.get(&at).copied(),
                            _ => None,
                        };
                        ensure!(
                            want.is_some() && have == want,
                            "group {g} row {r}: hit column {c} is block {b}, which does not \
                             hold this prefix's KV up to {at} ({:?})",
                            self.blocks.get(&(pool, b))
                        );
                        self.checked[0] += 1;
                    }
                    start / block
                } else {
                    0
                };
                // New blocks (a first step's row is appended whole, its hit columns first).
                for &b in row.range(fresh_from..).map(|(_, b)| b) {
                    self.blocks.insert((pool, b), Content::Kv(BTreeMap::new()));
                }
                if first(r) && start % block != 0 {
                    let dst = *row.get(&(start / block)).ok_or("no copy-on-write destination")?;
                    let copy = plan
                        .copies
                        .chunks(4)
                        .find(|c| c[0] == g as i64 && c[2] == i64::from(dst))
                        .ok_or_else(|| format!("group {g} row {r}: no copy into block {dst}"))?;
                    ensure!(
                        copy[3] == i64::from(start % block),
                        "copy {copy:?} for a hit at {start}"
                    );
                    let src = copy[1] as u32;
                    let copied = match self.blocks.get(&(pool, src)) {
                        Some(Content::Kv(kv)) => {
                            kv.range(..=start).map(|(&q, &k)| (q, k)).collect()
                        }
                        _ => BTreeMap::new(),
                    };
                    ensure!(
                        copied.get(&start).copied() == key(keys, unit, start),
                        "group {g} row {r}: the copy-on-write source {src} does not hold this \
                         prefix's KV up to the hit {start} ({:?})",
                        self.blocks.get(&(pool, src))
                    );
                    self.blocks.insert((pool, dst), Content::Kv(copied));
                    self.checked[1] += 1;
                }
            }
        }
        for s in &plan.state {
            let g = s.group as usize;
            let pool = config.groups[g].pool;
            let GroupKind::State(state) = &config.groups[g].kind else {
                return Err("a state plan of a paged group".into());
            };
            let cmax = s.max_checkpoints;
            for (r, &id) in plan.seq_ids.iter().enumerate() {
                let keys = keys(id).ok_or("a plan row of an unknown sequence")?;
                let (start, end) = (
                    plan.num_computed[r] as u32,
                    (plan.num_computed[r] + plan.num_scheduled[r]) as u32,
                );
                let initial = s.initial_slot[r];
                let reads = (initial > 0).then(|| self.blocks.get(&(pool, initial as u32)));
                if first(r) {
                    if start == 0 {
                        ensure!(
                            initial == -1,
                            "group {g} row {r} starts from zero but reads {initial}"
                        );
                    } else {
                        let want = key(keys, unit, start).map(Content::State);
                        ensure!(
                            want.is_some() && reads.flatten() == want.as_ref(),
                            "group {g} row {r} resumes at {start} from slot {initial}, which \
                             holds {:?}",
                            reads.flatten()
                        );
                        self.checked[2] += 1;
                    }
                } else {
                    ensure!(
                        reads.flatten() == Some(&Content::Running(id, start)),
                        "group {g} row {r} continues at {start} from slot {initial}, which holds \
                         {:?}",
                        reads.flatten()
                    );
                    self.checked[3] += 1;
                }
                let interior = (0..cmax).filter(|&c| s.checkpoint_slots[r * cmax + c] != -1);
                let mut count = 0;
                for c in interior {
                    count += 1;
                    let offset = s.checkpoint_offsets[r * cmax + c] as u32;
                    ensure!(
                        offset % state.alignment == 0 && (start + offset) % unit == 0,
                        "group {g} row {r}: an interior checkpoint at offset {offset} from {start}, \
                         off the kernel's grid (alignment {}, unit {unit})",
                        state.alignment
                    );
                }
                ensure!(
                    state.max_checkpoints_per_step.is_none_or(|limit| count <= limit),
                    "group {g} row {r}: {count} interior checkpoints, beyond C = {:?}",
                    state.max_checkpoints_per_step
                );
                let running = s.running_slot[r];
                if s.snapshots.chunks(2).any(|pair| pair[0] == running) {
                    ensure!(
                        end % unit == 0,
                        "group {g} row {r}: a snapshot at {end}, off the unit grid"
                    );
                }
            }
        }
        Ok(())
    }

    /// The engine ran `plan` (`committed`) or failed it: writes what it wrote.
    pub(crate) fn ran(
        &mut self,
        config: &CacheConfig,
        plan: &StepPlan,
        keys: Keys<'_>,
        committed: bool,
    ) -> Result<(), String> {
        let unit = config.hash.unit;
        let mut tokens = 0usize;
        for (r, &id) in plan.seq_ids.iter().enumerate() {
            let keys = keys(id).ok_or("a plan row of an unknown sequence")?;
            let (start, n) = (plan.num_computed[r] as u32, plan.num_scheduled[r] as u32);
            let end = start + n;
            for p in &plan.paged {
                let g = p.group as usize;
                let pool = config.groups[g].pool;
                let block = config.groups[g].kind.block_size().unwrap_or(1);
                for pos in start..end {
                    let slot = p.slot_mapping[tokens + (pos - start) as usize];
                    let b = (slot / i64::from(block)) as u32;
                    ensure!(
                        slot % i64::from(block) == i64::from(pos % block),
                        "group {g}: token {pos} goes to slot {slot}, not at its offset in a block"
                    );
                    let entry = self.blocks.entry((pool, b)).or_insert(Content::Garbage);
                    let q = pos + 1;
                    match (committed, entry) {
                        (true, Content::Kv(kv)) => {
                            if q % unit == 0 {
                                kv.insert(q, key(keys, unit, q).ok_or("a key past the tokens")?);
                            }
                        }
                        (true, entry) => {
                            let mut kv = BTreeMap::new();
                            if q % unit == 0 {
                                kv.insert(q, key(keys, unit, q).ok_or("a key past the tokens")?);
                            }
                            *entry = Content::Kv(kv);
                        }
                        (false, Content::Kv(kv)) => kv.retain(|&k, _| k <= start),
                        (false, _) => {}
                    }
                }
            }
            for s in &plan.state {
                let g = s.group as usize;
                let pool = config.groups[g].pool;
                let cmax = s.max_checkpoints;
                let running = s.running_slot[r] as u32;
                let mut written = vec![(running, Content::Running(id, end))];
                for c in 0..cmax {
                    let slot = s.checkpoint_slots[r * cmax + c];
                    if slot > 0 {
                        let p = start + s.checkpoint_offsets[r * cmax + c] as u32;
                        written.push((
                            slot as u32,
                            key(keys, unit, p).map_or(Content::Garbage, Content::State),
                        ));
                    }
                }
                for pair in s.snapshots.chunks(2).filter(|pair| pair[0] == running as i32) {
                    written.push((
                        pair[1] as u32,
                        key(keys, unit, end).map_or(Content::Garbage, Content::State),
                    ));
                }
                for (b, content) in written {
                    self.blocks
                        .insert((pool, b), if committed { content } else { Content::Garbage });
                }
            }
            tokens += n as usize;
        }
        Ok(())
    }
}
