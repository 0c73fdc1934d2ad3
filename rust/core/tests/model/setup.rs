//! Random manager configurations: full attention only, full attention + a state group, and a
//! sliding window (optionally with full attention and a state group). Pools are small relative
//! to the prompts, so admissions are refused and published blocks evicted; the `never_evicts`
//! variants use pools that cannot run out.

use prefixcache_core::{
    CacheConfig, GroupConfig, GroupKind, HashAlgorithm, HashConfig, PoolConfig, Retention,
    StateGroupConfig,
};
use proptest::prelude::*;

use crate::ops::MAX_PROMPT;

/// Blocks of each pool in the `never_evicts` variants: several times what the busiest of
/// thousands of runs held (about 300), and small enough for `check_invariants` after every call.
const NEVER_EVICTING_POOL: u32 = 2048;

#[derive(Clone, Debug)]
pub(crate) enum Kind {
    Full { block: u32 },
    Window { block: u32, window: u32 },
    State(StateGroupConfig),
}

#[derive(Clone, Debug)]
pub(crate) struct Setup {
    pub unit: u32,
    pub algorithm: HashAlgorithm,
    pub seed: u64,
    pub verify_tokens: bool,
    /// `(kind, pool)` per group.
    pub groups: Vec<(Kind, usize)>,
    pub pools: Vec<u32>,
    pub recent_capacity: usize,
    pub never_evicts: bool,
    /// `CacheConfig::reuse_live_prefixes`.
    pub reuse_live_prefixes: bool,
}

impl Setup {
    pub fn hash_config(&self) -> HashConfig {
        HashConfig {
            algorithm: self.algorithm,
            seed: self.seed,
            unit: self.unit,
            verify_tokens: self.verify_tokens,
        }
    }

    pub fn config(&self) -> CacheConfig {
        let groups = self
            .groups
            .iter()
            .map(|(kind, pool)| GroupConfig {
                kind: match kind {
                    Kind::Full { block } => GroupKind::FullAttention { block_size: *block },
                    Kind::Window { block, window } => {
                        GroupKind::SlidingWindow { block_size: *block, window: *window }
                    }
                    Kind::State(state) => GroupKind::State(state.clone()),
                },
                pool: *pool,
            })
            .collect();
        CacheConfig {
            hash: self.hash_config(),
            pools: self.pools.iter().map(|&num_blocks| PoolConfig { num_blocks }).collect(),
            groups,
            recently_evicted_capacity: self.recent_capacity,
            reuse_live_prefixes: self.reuse_live_prefixes,
            ..CacheConfig::default()
        }
    }

    pub fn pool(&self, g: usize) -> usize {
        self.groups[g].1
    }

    pub fn block_size(&self, g: usize) -> Option<u32> {
        match self.groups[g].0 {
            Kind::Full { block } | Kind::Window { block, .. } => Some(block),
            Kind::State(_) => None,
        }
    }

    pub fn state(&self, g: usize) -> Option<&StateGroupConfig> {
        match &self.groups[g].0 {
            Kind::State(state) => Some(state),
            _ => None,
        }
    }

    pub fn has_state(&self) -> bool {
        (0..self.groups.len()).any(|g| self.state(g).is_some())
    }

    /// The least common multiple of the state alignments (1 without state groups).
    pub fn chunk_alignment(&self) -> u32 {
        let gcd = |mut a: u32, mut b: u32| {
            while b != 0 {
                (a, b) = (b, a % b);
            }
            a
        };
        (0..self.groups.len())
            .filter_map(|g| self.state(g).map(|s| s.alignment))
            .fold(1, |acc, a| acc / gcd(acc, a) * a)
    }
}

fn unit_and_block() -> impl Strategy<Value = (u32, u32)> {
    prop::sample::select(vec![1u32, 2, 4, 8])
        .prop_flat_map(|unit| (Just(unit), prop::sample::select(vec![unit, 2 * unit, 4 * unit])))
}

/// `(algorithm, seed, verify_tokens, recently evicted capacity, reuse_live_prefixes)`
type Hashing = (HashAlgorithm, u64, bool, usize, bool);

fn hashing() -> impl Strategy<Value = Hashing> {
    (
        prop_oneof![3 => Just(HashAlgorithm::Xxh3_128), 1 => Just(HashAlgorithm::Sha256)],
        prop_oneof![Just(0u64), any::<u64>()],
        any::<bool>(),
        prop_oneof![Just(0usize), Just(1usize << 20)],
        any::<bool>(),
    )
}

/// Three pool sizes (groups pick one each), from a couple of blocks to a few prompts' worth of
/// blocks of size `block`.
fn pools(never_evicts: bool, block: u32) -> BoxedStrategy<Vec<u32>> {
    if never_evicts {
        return Just(vec![NEVER_EVICTING_POOL; 3]).boxed();
    }
    let prompt_blocks = u32::from(MAX_PROMPT) / block;
    let size = prop_oneof![1 => 2u32..=6, 5 => 6..=6 + 3 * prompt_blocks];
    prop::collection::vec(size, 3).boxed()
}

fn state_config(unit: u32, never_evicts: bool) -> impl Strategy<Value = StateGroupConfig> {
    let alignments: Vec<u32> = (1..=unit).filter(|a| unit % a == 0).collect();
    let cap = if never_evicts {
        Just(None).boxed()
    } else {
        prop_oneof![Just(None), (1u32..=4).prop_map(Some)].boxed()
    };
    (
        prop_oneof![Just(unit), prop::sample::select(alignments)],
        prop_oneof![Just(None), (0u32..=3).prop_map(Some)],
        prop::bool::weighted(0.8),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![2 => Just(None), 1 => (1u32..=3).prop_map(move |k| Some(k * unit))],
        cap,
        0u32..=2,
    )
        .prop_map(
            |(
                alignment,
                max_checkpoints_per_step,
                tail,
                junction,
                decode_tail,
                interval,
                cap,
                reserve,
            )| {
                StateGroupConfig {
                    alignment,
                    max_checkpoints_per_step,
                    retention: Retention { tail, interval, junction, decode_tail },
                    checkpoint_cap: cap,
                    reserve_per_sequence: reserve,
                }
            },
        )
}

fn setup(
    unit: u32,
    groups: Vec<(Kind, usize)>,
    pools: Vec<u32>,
    hashing: Hashing,
    never_evicts: bool,
) -> Setup {
    let (algorithm, seed, verify_tokens, recent_capacity, reuse_live_prefixes) = hashing;
    Setup {
        unit,
        algorithm,
        seed,
        verify_tokens,
        groups,
        pools,
        recent_capacity,
        never_evicts,
        reuse_live_prefixes,
    }
}

/// Full attention only: one group, or two with different block sizes in shared or separate
/// pools.
pub(crate) fn full_attention(never_evicts: bool) -> impl Strategy<Value = Setup> {
    unit_and_block()
        .prop_flat_map(move |(unit, block)| {
            (
                Just(unit),
                Just(block),
                prop::option::of((0u32..4, 0usize..3)),
                pools(never_evicts, unit.min(block)),
                hashing(),
            )
        })
        .prop_map(move |(unit, block, second, pools, hashing)| {
            let mut groups = vec![(Kind::Full { block }, 0)];
            if let Some((shift, pool)) = second {
                groups.push((Kind::Full { block: unit << shift }, pool));
            }
            setup(unit, groups, pools, hashing, never_evicts)
        })
}

/// Full attention + one state group (A dividing U, C including 0 and None, random retention,
/// cap and reserve), in a shared or a separate pool.
pub(crate) fn hybrid(never_evicts: bool) -> impl Strategy<Value = Setup> {
    unit_and_block()
        .prop_flat_map(move |(unit, block)| {
            (
                Just(unit),
                Just(block),
                state_config(unit, never_evicts),
                0usize..3,
                pools(never_evicts, block),
                hashing(),
            )
        })
        .prop_map(move |(unit, block, state, pool, pools, hashing)| {
            let groups = vec![(Kind::Full { block }, 0), (Kind::State(state), pool)];
            setup(unit, groups, pools, hashing, never_evicts)
        })
}

/// A sliding window (W >= B, not necessarily a multiple of U), optionally with full attention
/// and a state group.
pub(crate) fn sliding_window(never_evicts: bool) -> impl Strategy<Value = Setup> {
    unit_and_block()
        .prop_flat_map(move |(unit, block)| {
            (
                Just(unit),
                Just(block),
                0..=2 * block,
                prop::option::of(0usize..3),
                prop::option::of((state_config(unit, never_evicts), 0usize..3)),
                pools(never_evicts, block),
                hashing(),
            )
        })
        .prop_map(move |(unit, block, extra, full, state, pools, hashing)| {
            let mut groups = vec![(Kind::Window { block, window: block + extra }, 0)];
            if let Some(pool) = full {
                groups.push((Kind::Full { block }, pool));
            }
            if let Some((state, pool)) = state {
                groups.push((Kind::State(state), pool));
            }
            setup(unit, groups, pools, hashing, never_evicts)
        })
}

/// Two state groups (their own alignments, C, retention, caps and reserves) and, mostly, a
/// full-attention group or a sliding window: both state groups in one pool, with or without
/// the paged group, or one of them beside it. Pools are small enough for the caps, the reserve
/// and evictions across groups to matter; a third of the setups have no full attention, so
/// the hit bound is the largest candidate.
pub(crate) fn several_state_groups(never_evicts: bool) -> impl Strategy<Value = Setup> {
    unit_and_block()
        .prop_flat_map(move |(unit, block)| {
            (
                Just(unit),
                Just(block),
                prop_oneof![2 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)],
                state_config(unit, never_evicts),
                state_config(unit, never_evicts),
                prop_oneof![
                    // Both state groups share the paged group's pool.
                    2 => Just((0usize, 0usize)),
                    // Both share a pool of their own.
                    2 => Just((1, 1)),
                    // One beside the paged group, one alone.
                    1 => Just((0, 1)),
                ],
                pools(never_evicts, block),
                hashing(),
            )
        })
        .prop_map(move |(unit, block, paged, first, second, (p1, p2), pools, hashing)| {
            let mut groups = match paged {
                0 => vec![(Kind::Full { block }, 0)],
                1 => vec![(Kind::Window { block, window: 2 * block }, 0)],
                _ => Vec::new(),
            };
            groups.push((Kind::State(first), p1));
            groups.push((Kind::State(second), p2));
            setup(unit, groups, pools, hashing, never_evicts)
        })
}
