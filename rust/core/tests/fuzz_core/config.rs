//! Random configurations for the fuzz property, far wider than the model's: 1 to 3 pools (from
//! a couple of blocks to a few hundred), 1 to 4 groups of every kind in any pool (several state
//! groups included, sharing pools with each other and with paged groups), hash units of 1 to
//! 16 tokens, blocks up to 8 units, windows, alignments, C, retention, caps and reserves at
//! random, both hash algorithms, `verify_tokens`, live-prefix reuse, tiny and default
//! recently-evicted sets, finished caches and event queues. One case in sixteen breaks one rule
//! of the configuration, which `CacheManager::new` must refuse with `CacheError::Config`.

use prefixcache_core::{
    CacheConfig, GroupConfig, GroupKind, HashAlgorithm, HashConfig, PoolConfig, Retention,
    StateGroupConfig,
};
use proptest::prelude::*;

/// A configuration, and whether it was deliberately broken.
#[derive(Clone, Debug)]
pub(crate) struct FuzzConfig {
    pub config: CacheConfig,
    pub broken: Option<&'static str>,
}

fn state(unit: u32) -> impl Strategy<Value = GroupKind> {
    let alignments: Vec<u32> = (1..=unit).filter(|a| unit % a == 0).collect();
    (
        prop::sample::select(alignments),
        prop_oneof![Just(None), (0u32..=3).prop_map(Some)],
        (any::<bool>(), any::<bool>(), any::<bool>()),
        prop_oneof![2 => Just(None), 1 => (1u32..=4).prop_map(move |k| Some(k * unit))],
        prop_oneof![Just(None), (1u32..=6).prop_map(Some)],
        0u32..=3,
    )
        .prop_map(|(alignment, c, (tail, junction, decode_tail), interval, cap, reserve)| {
            GroupKind::State(StateGroupConfig {
                alignment,
                max_checkpoints_per_step: c,
                retention: Retention { tail, interval, junction, decode_tail },
                checkpoint_cap: cap,
                reserve_per_sequence: reserve,
            })
        })
}

fn group(unit: u32, pools: usize) -> impl Strategy<Value = GroupConfig> {
    let paged_block = prop::sample::select(vec![1u32, 1, 2, 4, 8]).prop_map(move |k| k * unit);
    let kind = prop_oneof![
        3 => paged_block.clone().prop_map(|block_size| GroupKind::FullAttention { block_size }),
        2 => (paged_block, 0u32..=3, 0u32..=3).prop_map(|(block_size, blocks, extra)| {
            GroupKind::SlidingWindow { block_size, window: block_size * (1 + blocks) + extra }
        }),
        3 => state(unit),
    ];
    (kind, 0..pools).prop_map(|(kind, pool)| GroupConfig { kind, pool })
}

fn pool() -> impl Strategy<Value = PoolConfig> {
    prop_oneof![1 => 2u32..=8, 3 => 8u32..=64, 2 => 64u32..=400]
        .prop_map(|num_blocks| PoolConfig { num_blocks })
}

/// Which rule a broken configuration breaks: (index, name).
const BREAKS: [&str; 9] = [
    "hash unit 0",
    "a pool of one block",
    "a group in a pool that does not exist",
    "a block size that is not a multiple of the unit",
    "a window smaller than its block",
    "an alignment that does not divide the unit",
    "a checkpoint cap of 0",
    "no plan in flight allowed",
    "more plans in flight than supported",
];

fn breaks(config: &mut CacheConfig, which: usize) -> Option<&'static str> {
    let unit = config.hash.unit;
    let name = BREAKS[which % BREAKS.len()];
    match which % BREAKS.len() {
        0 => config.hash.unit = 0,
        1 => config.pools[0].num_blocks = 1,
        2 => config.groups[0].pool = config.pools.len(),
        3 if unit > 1 => config.groups[0].kind = GroupKind::FullAttention { block_size: unit + 1 },
        4 => config.groups[0].kind = GroupKind::SlidingWindow { block_size: 2 * unit, window: 1 },
        5 if unit > 1 => {
            config.groups[0].kind =
                GroupKind::State(StateGroupConfig { alignment: unit + 1, ..Default::default() });
        }
        6 => {
            config.groups[0].kind = GroupKind::State(StateGroupConfig {
                checkpoint_cap: Some(0),
                ..Default::default()
            });
        }
        7 => config.max_steps_in_flight = 0,
        8 => config.max_steps_in_flight = prefixcache_core::limits::MAX_STEPS_IN_FLIGHT + 1,
        _ => return None,
    }
    Some(name)
}

pub(crate) fn config() -> impl Strategy<Value = FuzzConfig> {
    (prop::sample::select(vec![1u32, 2, 4, 8, 16]), 1usize..=3)
        .prop_flat_map(|(unit, pools)| {
            (
                Just(unit),
                prop::collection::vec(pool(), pools),
                prop::collection::vec(group(unit, pools), 1..=4),
                (
                    prop_oneof![3 => Just(HashAlgorithm::Xxh3_128), 1 => Just(HashAlgorithm::Sha256)],
                    prop_oneof![Just(0u64), any::<u64>()],
                    any::<bool>(),
                    any::<bool>(),
                ),
                (
                    prop::sample::select(vec![0usize, 1, 4, 1 << 20]),
                    prop::sample::select(vec![0usize, 300, 4096, 64 << 20]),
                    prop::sample::select(vec![4usize, 1 << 20]),
                ),
                prop::option::weighted(1.0 / 16.0, any::<usize>()),
            )
        })
        .prop_map(|(unit, pools, groups, hashing, bounds, broken)| {
            let (algorithm, seed, verify_tokens, reuse_live_prefixes) = hashing;
            let (recently_evicted_capacity, finished_cache_bytes, max_pending_events) = bounds;
            let mut config = CacheConfig {
                hash: HashConfig { algorithm, seed, unit, verify_tokens },
                pools,
                groups,
                finished_cache_bytes,
                reuse_live_prefixes,
                recently_evicted_capacity,
                enable_events: true,
                max_pending_events,
                // `driver.rs`'s predictions assume one plan in flight at a time; overlapped
                // steps (D in 1..=3) are driven by `overlap.rs` and the model in
                // `model_overlap.rs`.
                max_steps_in_flight: 1,
                event_block_size: None,
            };
            // Half the seeds put the wire block at the first paged group's block size.
            if seed % 2 == 1 {
                config.event_block_size =
                    config.groups.iter().find_map(|g| g.kind.block_size());
            }
            let broken = broken.and_then(|which| breaks(&mut config, which));
            FuzzConfig { config, broken }
        })
}
