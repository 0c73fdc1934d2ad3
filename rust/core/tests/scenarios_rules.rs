//! The rules the core states once for every caller (issue 16, item 2): the checkpoint-offset
//! rule and its nearest valid offsets, the chunk grid, the smallest token budget, the aligned
//! geometry, the blocks one sequence holds, the manager's id and `decode_step`'s commit
//! decision. Each rule is checked against a brute-force statement of it here.

mod common;

use common::{tokens, Harness, Hybrid, ALL};
use prefixcache_core::{
    aligned_geometry, is_exportable_offset, nearest_exportable_offsets, CacheConfig, CacheError,
    CheckpointGrid, GroupConfig, GroupKind, HashConfig, PoolConfig, Retention, StateGroupConfig,
    StepPlan,
};

// ---------------------------------------------------------------------------------------------
// the checkpoint-offset rule

#[test]
fn an_offset_is_exportable_strictly_inside_the_query_on_a_multiple_of_the_alignment() {
    assert!(is_exportable_offset(4, 4, 9));
    assert!(is_exportable_offset(8, 4, 9));
    assert!(!is_exportable_offset(0, 4, 9), "the query start is no checkpoint");
    assert!(!is_exportable_offset(9, 1, 9), "the query end is a snapshot, not an interior one");
    assert!(!is_exportable_offset(6, 4, 9));
    assert!(!is_exportable_offset(12, 4, 9));
    assert!(!is_exportable_offset(4, 0, 9), "alignment 0 allows nothing");
    for alignment in 0..7u32 {
        for len in 0..20u32 {
            for offset in 0..25u32 {
                let brute = alignment >= 1 && (1..len).contains(&offset) && offset % alignment == 0;
                assert_eq!(is_exportable_offset(offset, alignment, len), brute);
            }
        }
    }
}

#[test]
fn the_nearest_exportable_offsets_are_the_one_at_or_below_and_the_one_above() {
    assert_eq!(nearest_exportable_offsets(6, 4, 20), vec![4, 8]);
    assert_eq!(nearest_exportable_offsets(8, 4, 20), vec![8, 12]);
    assert_eq!(nearest_exportable_offsets(2, 4, 20), vec![4], "nothing valid below 4");
    assert_eq!(nearest_exportable_offsets(19, 4, 20), vec![16], "nothing valid above 16");
    assert_eq!(nearest_exportable_offsets(100, 4, 20), vec![16]);
    assert!(nearest_exportable_offsets(3, 4, 4).is_empty(), "a query of A tokens has none");
    assert!(nearest_exportable_offsets(3, 0, 40).is_empty());
    assert_eq!(nearest_exportable_offsets(u32::MAX, 1, u32::MAX), vec![u32::MAX - 1]);
    for alignment in 0..7u32 {
        for len in 0..20u32 {
            let valid: Vec<u32> =
                (0..=len).filter(|&o| is_exportable_offset(o, alignment, len)).collect();
            for offset in 0..25u32 {
                let below = valid.iter().rev().find(|&&o| o <= offset);
                let above = valid.iter().find(|&&o| o > offset);
                let brute: Vec<u32> = below.into_iter().chain(above).copied().collect();
                assert_eq!(
                    nearest_exportable_offsets(offset, alignment, len),
                    brute,
                    "offset {offset}, alignment {alignment}, query {len}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// the chunk grid

#[test]
fn non_final_chunks_end_on_a_multiple_of_the_alignment_and_the_final_one_is_not_trimmed() {
    let grid = CheckpointGrid { unit: 8, alignment: 4 };
    assert_eq!(grid.trim_chunk_end(11, 40), 8);
    assert_eq!(grid.trim_chunk_end(12, 40), 12);
    assert_eq!(grid.trim_chunk_end(3, 40), 0, "below the grid step nothing is left");
    assert_eq!(grid.trim_chunk_end(37, 37), 37, "the final chunk ends where the prompt does");
}

#[test]
fn the_grid_accepts_unit_boundaries_at_exportable_offsets_and_the_chunk_end() {
    for (unit, alignment) in [(4, 4), (8, 4), (4, 2), (6, 3), (4, 1)] {
        let grid = CheckpointGrid { unit, alignment };
        for start in 0..30u32 {
            for end in start + 1..start + 30 {
                let brute = |p: u32| {
                    p > start
                        && p <= end
                        && p % unit == 0
                        && (p == end || (p - start) % alignment == 0)
                };
                let valid: Vec<u32> = (0..=end + unit).filter(|&p| brute(p)).collect();
                for p in 0..=end + unit {
                    assert_eq!(grid.accepts(p, start, end), brute(p), "{p} in [{start}, {end})");
                    let (count, near) = grid.nearest_positions(p, start, end);
                    assert_eq!(
                        count as usize,
                        valid.len(),
                        "[{start}, {end}) U {unit} A {alignment}"
                    );
                    let below = valid.iter().rev().find(|&&v| v <= p);
                    let above = valid.iter().find(|&&v| v > p);
                    let expected: Vec<u32> = below.into_iter().chain(above).copied().collect();
                    assert_eq!(
                        near, expected,
                        "near {p} in [{start}, {end}) U {unit} A {alignment}"
                    );
                }
            }
        }
    }
}

#[test]
fn request_checkpoint_names_the_nearest_positions_of_the_grid() {
    let mut h = Hybrid { unit: 8, block_size: 16, ..Hybrid::default() }.harness();
    h.add(1, &tokens(1, 40));
    h.call(|m| m.schedule(1, 30, 0, true)).expect("schedule").expect("blocks");
    let r = h.call(|m| m.request_checkpoint(1, 12));
    let Err(CacheError::Alignment { valid, .. }) = r else { panic!("{r:?}") };
    assert_eq!(valid, "nearest valid positions in chunk [0, 30): 8, 16");
    h.call(|m| m.request_checkpoint(1, 24)).expect("on the grid");
}

#[test]
fn the_smallest_token_budget_is_the_chunk_alignment() {
    let mut config = Hybrid { unit: 8, alignment: 4, ..Hybrid::default() }.config();
    let GroupKind::State(state) = &config.groups[1].kind else { unreachable!() };
    let mut second = state.clone();
    second.alignment = 8;
    config.groups.push(GroupConfig { kind: GroupKind::State(second), pool: 1 });
    assert_eq!(config.min_token_budget(), 8);
    let mut h = Harness::new(config.clone());
    h.add(1, &tokens(1, 40));
    let below = h.call(|m| m.schedule(1, config.min_token_budget() - 1, 0, false));
    assert_eq!(below.expect("schedule").expect("nothing to allocate").num_tokens, 0);
    let at = h.call(|m| m.schedule(1, config.min_token_budget(), 0, false));
    assert_eq!(at.expect("schedule").expect("blocks").num_tokens, 8);
    assert_eq!(Hybrid::default().config().min_token_budget(), 4);
    assert_eq!(common::full_attention(16, 4, 8).min_token_budget(), 1);
}

// ---------------------------------------------------------------------------------------------
// the aligned geometry

#[test]
fn the_aligned_geometry_is_the_least_common_multiple_of_unit_alignment_and_block() {
    assert_eq!(aligned_geometry(16, 64, 4), Ok((16, 64)), "already aligned: unchanged");
    assert_eq!(aligned_geometry(16, 64, 3), Ok((48, 192)));
    assert_eq!(aligned_geometry(128, 1536, 256), Ok((256, 1536)));
    assert_eq!(aligned_geometry(6, 10, 4), Ok((12, 60)));
    for (unit, block, alignment) in [(0, 16, 4), (4, 0, 4), (4, 16, 0)] {
        let r = aligned_geometry(unit, block, alignment);
        assert!(matches!(r, Err(CacheError::Config { .. })), "{r:?}");
    }
    let beyond_unit = aligned_geometry(1 << 20, 1 << 20, 3);
    assert!(matches!(beyond_unit, Err(CacheError::Config { .. })), "{beyond_unit:?}");
    let beyond_u32 = aligned_geometry(65_521, 65_519, 65_497);
    assert!(matches!(beyond_u32, Err(CacheError::Config { .. })), "{beyond_u32:?}");
    let beyond_block = aligned_geometry(1 << 10, (1 << 24) - 1, 1);
    assert!(matches!(beyond_block, Err(CacheError::Config { .. })), "{beyond_block:?}");
    // What it returns is a geometry the manager accepts.
    for (unit, block, alignment) in [(16, 64, 3), (6, 10, 4), (5, 7, 9)] {
        let (u, b) = aligned_geometry(unit, block, alignment).expect("aligned");
        let config = Hybrid { unit: u, block_size: b, alignment, ..Hybrid::default() }.config();
        config.validate().expect("the aligned geometry is valid");
        assert!(u % unit == 0 && u % alignment == 0 && b % block == 0 && b % u == 0);
    }
}

// ---------------------------------------------------------------------------------------------
// the blocks one sequence holds

/// Full attention (B 16), a sliding window (B 16, W 32) and a state group (A 4, C 2, every unit
/// boundary retained), U 4, each group with its own roomy pool.
fn three_groups(retention: Retention, checkpoint_cap: Option<u32>) -> CacheConfig {
    let state = StateGroupConfig {
        alignment: 4,
        max_checkpoints_per_step: Some(2),
        retention,
        checkpoint_cap,
        reserve_per_sequence: 0,
    };
    CacheConfig {
        hash: HashConfig { unit: 4, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 256 }; 3],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: 16 }, pool: 0 },
            GroupConfig { kind: GroupKind::SlidingWindow { block_size: 16, window: 32 }, pool: 1 },
            GroupConfig { kind: GroupKind::State(state), pool: 2 },
        ],
        ..CacheConfig::default()
    }
}

/// One life of sequence 2: `prompt` extends the cached 45-token prompt of sequence 1 (a hit
/// inside a block: copy-on-write), is prefilled in chunks of `chunk` (`exact`), decodes
/// `decode` tokens and finishes. Returns its token count and, per pool, the most blocks in use
/// after any call (sequence 1 finished first, so everything in use is sequence 2's).
fn life(
    config: &CacheConfig,
    prompt: usize,
    chunk: u32,
    exact: bool,
    decode: u32,
) -> (u32, Vec<u32>) {
    let mut h = Harness::new(config.clone());
    let first = tokens(1, 45);
    h.add(1, &first);
    h.step(1, ALL);
    h.finish(1);
    let mut most = vec![0u32; config.pools.len()];
    let mut observe = |h: &Harness| {
        for (m, usage) in most.iter_mut().zip(h.m.pool_usage()) {
            *m = (*m).max(usage.owned);
        }
    };
    observe(&h);
    let mut prompt_tokens = first.clone();
    prompt_tokens.extend(tokens(2, prompt - first.len()));
    h.add(2, &prompt_tokens);
    let mut step = |h: &mut Harness, budget: u32| {
        let s = h.call(|m| m.schedule(2, budget, 0, exact)).expect("schedule").expect("blocks");
        assert!(s.num_tokens > 0, "chunk {budget} from {}", s.num_computed);
        observe(h);
        let plan = h.plan();
        observe(h);
        h.commit(&plan);
        observe(h);
    };
    while h.m.num_computed(2).expect("live") < prompt as u32 {
        step(&mut h, chunk);
    }
    for i in 0..decode {
        h.append(2, &[7 + i]);
        if i + 1 < decode {
            step(&mut h, 1);
        }
    }
    let total = h.m.num_tokens(2).expect("live");
    h.finish(2);
    observe(&h);
    (total, most)
}

#[test]
fn a_sequence_never_holds_more_blocks_than_blocks_for_sequence_says() {
    let every_unit = Retention { tail: true, interval: Some(4), junction: true, decode_tail: true };
    let policies = [
        (every_unit.clone(), None),
        (every_unit.clone(), Some(3)),
        (Retention { decode_tail: false, ..every_unit }, None),
        (Retention::default(), None),
        (Retention { tail: false, interval: None, junction: false, decode_tail: false }, None),
    ];
    // (prompt, chunk, exact, decoded tokens)
    let lives = [
        (76, ALL, false, 3),
        (75, ALL, false, 3),
        (75, 8, false, 20),
        (75, 9, true, 20),
        (61, 1, true, 6),
    ];
    let mut attained = [false; 3];
    for (retention, cap) in policies {
        let config = three_groups(retention.clone(), cap);
        for (prompt, chunk, exact, decode) in lives {
            let (total, most) = life(&config, prompt, chunk, exact, decode);
            for (g, &held) in most.iter().enumerate() {
                let bound = config.blocks_for_chunked_sequence(g, total, chunk).expect("bound");
                let whole = config.blocks_for_sequence(g, total).expect("bound");
                let what = format!(
                    "group {g}: {total} tokens, chunks {chunk} (exact {exact}), {retention:?} \
                     cap {cap:?}: held {held}, chunked bound {bound}, bound {whole}"
                );
                assert!(held <= bound && bound <= whole, "{what}");
                attained[g] |= held == bound;
            }
        }
    }
    // The bound is what the manager allocates, not a loose guess: each group reaches it.
    assert_eq!(attained, [true; 3]);
}

#[test]
fn blocks_for_sequence_counts_each_groups_own_blocks() {
    let config = three_groups(Retention::default(), None);
    // Full attention: ceil(100 / 16) = 7, plus a copy-on-write source.
    assert_eq!(config.blocks_for_sequence(0, 100), Ok(8));
    // A sliding window read by one-token steps: W / B + 1 blocks, plus a copy-on-write source.
    assert_eq!(config.blocks_for_chunked_sequence(1, 100, 1), Ok(4));
    assert_eq!(config.blocks_for_sequence(1, 100), Ok(8));
    // State, C = 2: 2 running + max(resume, decode tail) + 2 interior + 1 snapshot.
    assert_eq!(config.blocks_for_sequence(2, 100), Ok(6));
    assert_eq!(config.blocks_for_chunked_sequence(2, 100, 1), Ok(4));
    assert_eq!(config.blocks_for_sequence(0, 0), Ok(0));
    let r = config.blocks_for_sequence(3, 10);
    assert!(matches!(r, Err(CacheError::InvalidRequest { .. })), "{r:?}");
    let mut one_unit_blocks = config.clone();
    one_unit_blocks.groups[0].kind = GroupKind::FullAttention { block_size: 4 };
    assert_eq!(one_unit_blocks.blocks_for_sequence(0, 100), Ok(25), "U = B: no copy on write");
}

// ---------------------------------------------------------------------------------------------
// the manager's id and decode_step's commit

#[test]
fn plans_carry_the_managers_id() {
    let (mut a, b) = (Hybrid::default().harness(), Hybrid::default().harness());
    assert_ne!(a.m.id(), b.m.id());
    a.add(1, &tokens(1, 20));
    a.schedule(1, ALL);
    assert_eq!(a.plan().manager, a.m.id());
}

#[test]
fn decode_step_commits_the_plan_it_holds_only_when_that_plan_is_in_flight() {
    let mut h = Hybrid::default().harness();
    h.add(1, &tokens(1, 20));
    h.schedule(1, ALL);
    let mut plan = h.plan();
    let first = plan.step_id;
    // This manager's plan in flight: committed, then the next step is built into it.
    h.call(|m| m.decode_step(&[1], &[5], &mut plan)).expect("decode_step");
    assert_eq!((h.m.num_computed(1), h.m.plan_in_flight()), (Ok(20), Some(plan.step_id)));
    assert_ne!(plan.step_id, first);
    // A plan holding an older step while another is in flight: refused, nothing committed.
    let mut stale = StepPlan { step_id: first, ..plan.clone() };
    let r = h.call(|m| m.decode_step(&[1], &[6], &mut stale));
    assert!(matches!(r, Err(CacheError::Step { .. })), "{r:?}");
    assert_eq!(h.m.plan_in_flight(), Some(plan.step_id));
    // Another manager's plan with the step id in flight: refused, nothing committed.
    let mut foreign = StepPlan { manager: h.m.id() + 1000, ..plan.clone() };
    let r = h.call(|m| m.decode_step(&[1], &[6], &mut foreign));
    assert!(matches!(r, Err(CacheError::Step { .. })), "{r:?}");
    assert_eq!((h.m.num_computed(1), h.m.plan_in_flight()), (Ok(20), Some(plan.step_id)));
    // Committed by hand, then a decode step with the plan that held it: nothing to commit.
    h.commit(&plan);
    let computed = h.m.num_computed(1);
    h.call(|m| m.decode_step(&[1], &[6], &mut plan)).expect("decode_step");
    assert_eq!(h.m.num_computed(1), computed);
    assert_eq!(h.m.plan_in_flight(), Some(plan.step_id));
    // A fresh plan commits nothing either: it is no manager's.
    h.commit(&plan);
    let mut fresh = StepPlan::default();
    h.call(|m| m.decode_step(&[1], &[7], &mut fresh)).expect("decode_step");
    assert_eq!(fresh.manager, h.m.id());
}
