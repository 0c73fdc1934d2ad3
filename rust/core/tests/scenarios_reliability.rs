//! Regression scenarios of the defects an outside fuzzer found (issue [reliability]), through
//! the public API only: a wrong hit across images, the junction above the attention bound, the
//! checkpoint cap with shared pools, counts near their bounds, the finished cache's memory, and
//! pools or prompts larger than memory. Every call goes through `Harness`, which runs
//! `check_invariants` after it.

mod common;

use common::{tokens, Harness, ALL};
use prefixcache_core::limits::{MAX_BATCH_SEQUENCES, MAX_LOOKAHEAD_TOKENS};
use prefixcache_core::{
    hash_prefix, CacheConfig, CacheError, CacheEvent, CacheManager, ExtraKeys, GroupConfig,
    GroupKind, HashConfig, MultimodalInput, PoolConfig, Retention, StateGroupConfig,
};

fn image(start: u32, end: u32, hash: &[u8]) -> MultimodalInput {
    MultimodalInput { start, end, hash: hash.to_vec() }
}

fn images(multimodal: Vec<MultimodalInput>) -> ExtraKeys {
    ExtraKeys { multimodal, ..ExtraKeys::default() }
}

fn full_attention_u2(verify_tokens: bool) -> Harness {
    Harness::new(CacheConfig {
        hash: HashConfig { unit: 2, verify_tokens, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 64 }],
        groups: vec![GroupConfig { kind: GroupKind::FullAttention { block_size: 2 }, pool: 0 }],
        ..CacheConfig::default()
    })
}

/// The digests a commit published, in order.
fn published(h: &mut Harness) -> Vec<prefixcache_core::Digest> {
    h.events()
        .into_iter()
        .filter_map(|r| match r.event {
            CacheEvent::BlockStored { keys, .. } => Some(keys),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn multimodal_inputs_out_of_order_are_refused_and_the_manager_is_unchanged() {
    let mut h = full_attention_u2(false);
    let t = [3, 3, 1, 3, 2, 3, 2, 0, 3, 0];
    let unsorted = images(vec![image(9, 10, b"img1"), image(4, 8, b"X")]);
    let err = h.call(|m| m.add(1, &t, unsorted, None)).unwrap_err();
    assert!(matches!(err, CacheError::InvalidRequest { .. }), "{err}");
    assert!(err.to_string().contains("in order of their start"), "{err}");
    assert_eq!(h.m.num_sequences(), 0);
}

#[test]
fn a_request_without_the_image_never_publishes_under_the_digests_of_one_with_it() {
    // Request A has an image at [4, 8) (and another input after it); B has the same text
    // without the image and reuses A's digests (live or through `extends`); C = A again must
    // hit only the 4 tokens before the image, since [4, 8) was computed by B without it.
    for verify_tokens in [false, true] {
        for through_extends in [false, true] {
            let mut h = full_attention_u2(verify_tokens);
            let t = [3, 3, 1, 3, 2, 3, 2, 0, 3, 0];
            let with_image = images(vec![image(4, 8, b"X"), image(9, 10, b"img1")]);
            h.call(|m| m.add(1, &t, with_image.clone(), None)).unwrap();
            let mut b = t[..6].to_vec();
            b.extend([0, 0, 3, 2, 0, 2, 0, 0]);
            let extends = through_extends.then_some(1);
            let added = h.call(|m| m.add(2, &b, ExtraKeys::default(), extends)).unwrap();
            assert_eq!(added.reused_tokens, 4, "the image starts at token 4");
            h.schedule(2, ALL);
            let plan = h.plan();
            h.commit(&plan);
            let own = hash_prefix(&h.config.hash, &b, &ExtraKeys::default()).unwrap();
            assert_eq!(published(&mut h), own, "B publishes B's own digests");
            h.finish(2);
            h.call(|m| m.add(3, &t, with_image.clone(), None)).unwrap();
            assert_eq!(h.lookup(3).tokens, 4, "verify_tokens {verify_tokens}");
        }
    }
}

#[test]
fn reuse_between_sequences_stops_at_the_earliest_differing_input() {
    let mut h = full_attention_u2(false);
    let t: Vec<u32> = (0..20).collect();
    let a = images(vec![image(2, 4, b"p"), image(10, 12, b"q")]);
    let b = images(vec![image(2, 4, b"p"), image(10, 12, b"r")]);
    h.call(|m| m.add(1, &t, a.clone(), None)).unwrap();
    let added = h.call(|m| m.add(2, &t, b, Some(1))).unwrap();
    assert_eq!(added.reused_tokens, 10, "the first differing input starts at 10");
    let added = h.call(|m| m.add(3, &t, a, Some(1))).unwrap();
    assert_eq!(added.reused_tokens, 20, "equal inputs share every unit");
}

#[test]
fn a_checkpoint_above_the_attention_bound_is_not_the_junction() {
    // One attention block of 1536 tokens in a pool of 2 usable blocks, U = 128, a state group
    // that never evicts (tail, junction, decode-tail retention).
    let config = CacheConfig {
        hash: HashConfig { unit: 128, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 3 }, PoolConfig { num_blocks: 64 }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: 1536 }, pool: 0 },
            GroupConfig {
                kind: GroupKind::State(StateGroupConfig {
                    alignment: 16,
                    retention: Retention {
                        tail: true,
                        interval: None,
                        junction: true,
                        decode_tail: true,
                    },
                    ..StateGroupConfig::default()
                }),
                pool: 1,
            },
        ],
        ..CacheConfig::default()
    };
    let mut h = Harness::new(config);
    let a = tokens(1, 513);
    let mut shares_421 = a[..421].to_vec();
    shares_421.extend(tokens(4, 92));
    // A (tail checkpoint at 512), two unrelated prompts that evict A's attention block, then a
    // prompt sharing 421 tokens that re-keys A's prefix up to 384 on its own block.
    for (id, prompt) in [(1, a.clone()), (2, tokens(2, 128)), (3, tokens(3, 1)), (4, shares_421)] {
        h.serve(id, &prompt);
    }
    // A's resend: the attention bound is 384 and A's checkpoint at 512 lies above it.
    h.add(5, &a);
    let hit = h.lookup(5);
    assert_eq!((hit.tokens, hit.groups[0].tokens, hit.groups[1].tokens), (0, 384, 0));
    assert_eq!(hit.junction, Some(384));
    h.schedule(5, ALL);
    let plan = h.plan();
    h.commit(&plan);
    h.finish(5);
    // The junction checkpoint at 384 was taken: a 385-token prefix of A resumes there.
    assert_eq!(h.probe(&a[..385]).tokens, 384);
}

fn two_state_groups_one_pool(cap: Option<u32>) -> Harness {
    let state = |retention, checkpoint_cap| GroupConfig {
        kind: GroupKind::State(StateGroupConfig {
            alignment: 4,
            retention,
            checkpoint_cap,
            ..StateGroupConfig::default()
        }),
        pool: 0,
    };
    Harness::new(CacheConfig {
        hash: HashConfig { unit: 4, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 64 }],
        groups: vec![
            state(Retention { interval: Some(4), ..Retention::default() }, None),
            state(Retention::default(), cap),
        ],
        ..CacheConfig::default()
    })
}

#[test]
fn the_checkpoint_cap_counts_and_evicts_only_its_own_group_in_a_shared_pool() {
    let mut h = two_state_groups_one_pool(Some(1));
    h.serve(1, &(0..40).collect::<Vec<_>>());
    let checkpoints = |h: &Harness, g: usize| h.m.stats().groups[g].checkpoints_published;
    assert_eq!((checkpoints(&h, 0), checkpoints(&h, 1)), (10, 1));
    let evictions_of_0 = h.m.stats().groups[0].evictions;
    // Group 1's next checkpoint displaces its own, never one of group 0's.
    h.serve(2, &(1000..1040).collect::<Vec<_>>());
    assert_eq!(h.m.stats().groups[0].evictions, evictions_of_0);
    assert_eq!(h.m.stats().groups[1].evictions, 1);
    assert_eq!(h.usage(0).checkpoints, 20 + 1);
}

#[test]
fn lookahead_and_budgets_at_their_bounds_are_refused_and_the_manager_stays_usable() {
    let mut h = Harness::new(common::full_attention(4, 4, 64));
    h.add(1, &(0..9).collect::<Vec<_>>());
    for lookahead in [MAX_LOOKAHEAD_TOKENS + 1, u32::MAX - 1, u32::MAX] {
        let err = h.call(|m| m.schedule(1, 100, lookahead, false)).unwrap_err();
        assert!(matches!(err, CacheError::InvalidRequest { .. }), "{err}");
    }
    // The bound itself is accepted (blocks for 9 + 65536 tokens do not fit: out of blocks).
    assert!(h.try_schedule_lookahead(1, 100, MAX_LOOKAHEAD_TOKENS).is_none());
    assert_eq!(h.schedule(1, u32::MAX).num_tokens, 9);
    let plan = h.plan();
    h.commit(&plan);
    h.finish(1);
    assert_eq!(h.serve(2, &(0..9).collect::<Vec<_>>()), 8);
}

#[test]
fn batches_longer_than_the_bound_are_refused_before_anything_is_read() {
    let mut h = Harness::new(common::full_attention(4, 4, 64));
    h.add(1, &[1, 2, 3]);
    let ids = vec![1u64; MAX_BATCH_SEQUENCES + 1];
    let budgets = vec![1u32; MAX_BATCH_SEQUENCES + 1];
    let err = h.call(|m| m.schedule_batch(&ids, &budgets, false)).unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
    let err = h.call(|m| m.append_batch(&ids, &budgets)).unwrap_err();
    assert!(err.to_string().contains("at most"), "{err}");
    assert!(h.call(|m| m.block_table(0, &ids)).is_err());
    assert_eq!(h.m.num_tokens(1), Ok(3));
}

#[test]
fn append_batch_refuses_repeated_ids_and_appends_nothing() {
    let mut h = Harness::new(common::full_attention(4, 4, 64));
    h.add(1, &[1, 2, 3]);
    h.add(2, &[1, 2, 3]);
    let err = h.call(|m| m.append_batch(&[1, 2, 1], &[7, 8, 9])).unwrap_err();
    assert!(matches!(err, CacheError::Step { .. }), "{err}");
    assert!(err.to_string().contains("appears twice"), "{err}");
    assert_eq!((h.m.num_tokens(1), h.m.num_tokens(2)), (Ok(3), Ok(3)));
}

#[test]
fn the_finished_cache_bounds_its_memory_with_ids_that_never_repeat() {
    let mut config = common::full_attention(16, 16, 64);
    config.finished_cache_bytes = 4096;
    config.enable_events = false;
    let mut m = CacheManager::new(config).unwrap();
    let prompt: Vec<u32> = (0..40).collect();
    for id in 0..20_000u64 {
        m.add(id, &prompt, ExtraKeys::default(), None).unwrap();
        m.finish(id).unwrap();
    }
    assert!(m.num_finished_cached() <= 4096 / 160);
    // The last ids are still available to `extends`; the first are gone entirely.
    let added = m.add(1 << 40, &prompt, ExtraKeys::default(), Some(19_999)).unwrap();
    assert!(added.extends_found);
    let added = m.add(1 << 41, &prompt, ExtraKeys::default(), Some(0)).unwrap();
    assert!(!added.extends_found);
    m.check_invariants().unwrap();
}

#[test]
fn a_pool_larger_than_memory_is_a_config_error_naming_the_bytes() {
    // 2^31 - 1 blocks need about 200 GB of records: refused, not aborted (on a machine that
    // could allocate it, the manager would be built; none of CI's can).
    let config = common::full_attention(16, 16, i32::MAX as u32);
    match CacheManager::new(config) {
        Err(err @ CacheError::Config { .. }) => {
            assert!(err.to_string().contains("GiB"), "{err}");
            assert!(err.to_string().contains("bytes a block"), "{err}");
        }
        Err(other) => panic!("not a config error: {other}"),
        Ok(_) => {}
    }
}

#[test]
fn counts_beyond_their_limits_are_config_errors() {
    let base = common::full_attention(16, 16, 64);
    let mut too_many_pools = base.clone();
    too_many_pools.pools = vec![PoolConfig { num_blocks: 2 }; 257];
    let mut huge_unit = base.clone();
    huge_unit.hash.unit = 1 << 21;
    huge_unit.groups[0].kind = GroupKind::FullAttention { block_size: 1 << 21 };
    let mut huge_block = base.clone();
    huge_block.groups[0].kind = GroupKind::FullAttention { block_size: 1 << 28 };
    let mut huge_record = base.clone();
    huge_record.recently_evicted_capacity = usize::MAX;
    let mut huge_events = base;
    huge_events.max_pending_events = usize::MAX;
    for config in [too_many_pools, huge_unit, huge_block, huge_record, huge_events] {
        let err = CacheManager::new(config).unwrap_err();
        assert!(matches!(err, CacheError::Config { .. }), "{err}");
    }
}

#[test]
fn a_full_attention_group_reaching_past_another_ones_bound_is_no_junction() {
    // Two full-attention groups; the second's small pool loses X's blocks to Y. X's resend hits
    // 2 tokens, and no request diverged anywhere: the first group merely lost fewer blocks.
    let mut h = Harness::new(CacheConfig {
        hash: HashConfig { unit: 2, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 64 }, PoolConfig { num_blocks: 12 }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: 2 }, pool: 0 },
            GroupConfig { kind: GroupKind::FullAttention { block_size: 2 }, pool: 1 },
        ],
        ..CacheConfig::default()
    });
    let x: Vec<u32> = (0..20).collect();
    h.serve(1, &x);
    h.serve(2, &(100..120).collect::<Vec<_>>());
    let hit = h.probe(&x);
    assert_eq!((hit.groups[0].tokens, hit.groups[1].tokens), (18, hit.tokens));
    assert_eq!(hit.junction, None);
}

#[test]
fn checkpoints_without_a_block_still_count_against_the_per_step_limit() {
    // C = 1, interval 2 and the tail, in a state pool with no block to spare: every position
    // after the first selected one is a `capacity` skip, as it is with blocks to spare; only
    // the selected one is a `budget` skip.
    let state = StateGroupConfig {
        alignment: 1,
        max_checkpoints_per_step: Some(1),
        retention: Retention { tail: true, interval: Some(2), junction: false, decode_tail: false },
        reserve_per_sequence: 0,
        ..StateGroupConfig::default()
    };
    let config = |state_blocks| CacheConfig {
        hash: HashConfig { unit: 2, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 64 }, PoolConfig { num_blocks: state_blocks }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: 2 }, pool: 0 },
            GroupConfig { kind: GroupKind::State(state.clone()), pool: 1 },
        ],
        ..CacheConfig::default()
    };
    let skips = |state_blocks| {
        let mut h = Harness::new(config(state_blocks));
        h.add(1, &(0..8).collect::<Vec<_>>());
        h.schedule(1, ALL);
        let plan = h.plan();
        h.commit(&plan);
        h.m.stats().groups[1].checkpoints_skipped
    };
    // Skips by reason: unaligned, capacity, already cached, budget, mid step. With two spare
    // blocks the tail at 6 (interior) and the snapshot at 8 are taken, 4 and 2 hit the limit.
    assert_eq!(skips(5), [0, 2, 0, 0, 0]);
    // With no spare block (the two running buffers take both): 6 and 8 get no block.
    assert_eq!(skips(3), [0, 2, 0, 2, 0]);
}
