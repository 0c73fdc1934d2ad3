//! Scenario tests of the core (issue [core], scenarios a to i, and the protocol around them),
//! through the public API only. B = 16, U = 4, full attention only unless stated. Every call
//! goes through `Harness`, which runs `check_invariants` after it.

mod common;

use std::collections::BTreeSet;

use common::{
    extend, full_attention, removed, rows, sliding_window, stored, tokens, Harness, Hybrid, ALL, B,
    U,
};
use prefixcache_core::{
    Added, CacheConfig, CacheError, CacheEvent, CacheManager, Digest, ExtraKeys, GroupConfig,
    GroupKind, HashConfig, MissReason, MultimodalInput, PoolConfig, Retention, StateGroupConfig,
    StepPlan,
};

fn fa(num_blocks: u32) -> Harness {
    Harness::new(full_attention(B, U, num_blocks))
}

/// `(row, column, block)` triples of a plan's `appended` / `replaced` array.
fn triples(flat: &[i32]) -> Vec<(i32, i32, i32)> {
    rows(flat, 3).into_iter().map(|r| (r[0], r[1], r[2])).collect()
}

// ---------------------------------------------------------------------------------------------
// a. identical resends hit the last unit boundary strictly before the end

#[test]
fn identical_resend_of_a_40_token_prompt_hits_36_in_the_partial_third_block() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.add(1, &p);
    let (first, _) = h.step(1, ALL);
    assert_eq!((first.num_computed, first.num_tokens), (0, 40));
    let table = h.table(0, 1);
    h.finish(1);

    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.max_tokens), (36, 36));
    assert_eq!(hit.groups[0].tokens, 36);
    assert_eq!(hit.groups[0].stop, None);
    assert_eq!(hit.junction, None);

    // Serving it: two whole blocks shared, the third block's first 4 tokens copied on write.
    h.add(2, &p);
    let s = h.schedule(2, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (36, 4));
    assert_eq!(s.hit.as_ref().map(|hit| hit.tokens), Some(36));
    let plan = h.plan();
    let row = h.table(0, 2);
    assert_eq!(row[..2], table[..2]);
    assert_ne!(row[2], table[2]);
    assert_eq!(plan.copies, vec![0, i64::from(table[2]), i64::from(row[2]), 4]);
    h.commit(&plan);
}

#[test]
fn identical_resend_of_a_32_token_prompt_hits_28() {
    let mut h = fa(64);
    let p = tokens(1, 32);
    assert_eq!(h.serve(1, &p), 0);
    assert_eq!(h.probe(&p).tokens, 28);
    assert_eq!(h.serve(2, &p), 28);
}

#[test]
fn with_the_unit_equal_to_the_block_a_32_token_resend_hits_only_16() {
    let mut h = Harness::new(full_attention(16, 16, 64));
    let p = tokens(1, 32);
    assert_eq!(h.serve(1, &p), 0);
    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.max_tokens), (16, 16));
}

// ---------------------------------------------------------------------------------------------
// b. two-phase publish and abort

#[test]
fn nothing_is_hit_before_the_step_that_wrote_it_commits() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.add(1, &p);
    h.schedule(1, ALL);
    assert_eq!(h.probe(&p).tokens, 0, "scheduled, not built");
    let plan = h.plan();
    assert_eq!(h.probe(&p).tokens, 0, "built, in flight");
    assert!(stored(&h.events()).is_empty(), "nothing stored before commit");
    h.commit(&plan);
    assert_eq!(h.probe(&p).tokens, 36);
    let runs = stored(&h.events());
    assert_eq!(runs.len(), 1, "one run of the sequence's commit: {runs:?}");
    assert_eq!(runs[0].2, h.digests(&p, 0, 40));
}

#[test]
fn abort_publishes_nothing_and_puts_the_sequence_back_where_it_was() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.add(1, &p);
    let empty = h.usage(0);

    // An aborted first step: nothing published, no block held, not started.
    h.schedule(1, 16);
    let plan = h.plan();
    h.abort(&plan);
    assert_eq!(h.probe(&p).tokens, 0);
    assert_eq!(h.m.num_computed(1), Ok(0));
    assert_eq!(h.usage(0), empty);
    assert!(h.events().is_empty());

    // A committed first chunk, then an aborted second one: back at 16 with the same table.
    h.step(1, 16);
    let table = h.table(0, 1);
    let usage = h.usage(0);
    let s = h.schedule(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (16, 24));
    let plan = h.plan();
    assert_eq!(triples(&plan.paged[0].appended).len(), 2);
    h.events();
    h.abort(&plan);
    assert_eq!(h.m.num_computed(1), Ok(16));
    assert_eq!(h.table(0, 1), table);
    assert_eq!(h.usage(0), usage);
    assert!(h.events().is_empty());
    assert_eq!(h.probe(&p).tokens, 16);

    // Scheduling again continues from 16 and publishes as usual.
    let (s, _) = h.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (16, 24));
    assert_eq!(h.probe(&p).tokens, 36);
    assert_eq!(h.m.stats().aborts, 2);
}

#[test]
fn abort_of_a_first_step_gives_the_pinned_hit_back() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.serve(1, &p);
    let cached = h.usage(0);
    assert_eq!((cached.cached, cached.owned), (3, 0));
    h.add(2, &p);
    h.schedule(2, ALL);
    let plan = h.plan();
    assert_eq!(plan.copies.len(), 4);
    let pinned = h.usage(0);
    assert_eq!((pinned.cached, pinned.owned), (0, 4), "hit pinned, copy destination owned");
    h.abort(&plan);
    let after = h.usage(0);
    assert_eq!((after.cached, after.owned, after.free), (3, 0, cached.free));
    // The sequence starts over from a fresh lookup.
    let (s, _) = h.step(2, ALL);
    assert_eq!(s.num_computed, 36);
}

// ---------------------------------------------------------------------------------------------
// c. copy on write of a shared partial block

#[test]
fn a_prompt_sharing_24_tokens_hits_one_block_plus_a_copy_of_8_tokens() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.prefill(1, &p);
    let p_table = h.table(0, 1);
    h.finish(1);

    let q = extend(&p[..24], 2, 16);
    h.add(2, &q);
    let scheduled = h.schedule(2, ALL);
    assert_eq!((scheduled.num_computed, scheduled.num_tokens), (24, 16));
    let hit = scheduled.hit.expect("first schedule reports its hit");
    assert_eq!(hit.tokens, 24);
    assert_eq!(hit.groups[0].stop, Some(MissReason::NotCached));

    let plan = h.plan();
    let q_table = h.table(0, 2);
    assert_eq!(q_table.len(), 3);
    assert_eq!(q_table[0], p_table[0], "the full block is shared");
    let dst = q_table[1];
    assert!(!p_table.contains(&dst));
    assert_eq!(plan.copies, vec![0, i64::from(p_table[1]), i64::from(dst), 8]);
    assert_eq!(
        triples(&plan.paged[0].appended),
        vec![(0, 0, p_table[0]), (0, 1, dst), (0, 2, q_table[2])]
    );
    // Slots of this step: offsets 8..16 of the copy, then 0..8 of the new block.
    let expected: Vec<i64> = (8..16)
        .map(|o| i64::from(dst) * 16 + o)
        .chain((0..8).map(|o| i64::from(q_table[2]) * 16 + o))
        .collect();
    assert_eq!(plan.paged[0].slot_mapping, expected);
    // Both copy blocks are held until the step ends: source pinned, destination owned.
    assert_eq!(h.usage(0).owned, 4);

    h.events();
    h.commit(&plan);
    assert_eq!(h.usage(0).owned, 3, "the copy source is released at commit");
    let records = h.events();
    let events = stored(&records);
    assert_eq!(events.len(), 1, "one BlockStored per run of a sequence per commit: {events:?}");
    let (group, first, keys, parent, start, end, checkpoint) = events[0].clone();
    assert_eq!((group, first), (0, dst as u32));
    assert_eq!(
        keys,
        h.digests(&q, 16, 40),
        "keyed at 20 and 24 (copied) and 28, 32 (new) in the destination, then 36, 40"
    );
    assert_eq!(parent, Some(h.digest(&q, 16)));
    assert_eq!((start, end, checkpoint), (16, 40, false));
    let CacheEvent::BlockStored { blocks, tokens, tokens_start, .. } = &records[0].event else {
        panic!("{records:?}")
    };
    let (d, next) = (dst as u32, q_table[2] as u32);
    assert_eq!(blocks, &[d, d, d, d, next, next], "the block of each key");
    assert_eq!((*tokens_start, tokens.as_slice()), (16, &q[16..40]), "the run's token ids");

    // A third prompt sharing those 24 tokens copies from the destination, which is in use,
    // rather than from the cached original.
    let third = extend(&p[..24], 3, 16);
    h.add(3, &third);
    assert_eq!(h.schedule(3, ALL).num_computed, 24);
    let plan = h.plan();
    assert_eq!(plan.copies[..2], [0, i64::from(dst)]);
    h.commit(&plan);
}

#[test]
fn a_copy_is_keyed_even_when_its_step_ends_before_the_next_boundary() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.serve(1, &p);
    let q = extend(&p[..24], 2, 2);
    h.add(2, &q);
    let s = h.schedule(2, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (24, 2));
    let plan = h.plan();
    let dst = h.table(0, 2)[1];
    h.events();
    h.commit(&plan);
    let events = stored(&h.events());
    assert_eq!(
        events,
        vec![(0, dst as u32, h.digests(&q, 16, 24), Some(h.digest(&q, 16)), 16, 24, false)]
    );
}

// ---------------------------------------------------------------------------------------------
// d. eviction order

#[test]
fn a_finished_chain_loses_its_tail_block_first_with_every_key() {
    let mut h = fa(4); // three usable blocks
    let p = tokens(1, 48);
    h.prefill(1, &p);
    let table = h.table(0, 1);
    let (first, second, last) = (table[0] as u32, table[1] as u32, table[2] as u32);
    h.finish(1);
    assert_eq!((h.usage(0).free, h.usage(0).cached), (0, 3));
    h.events();

    // One block for an unrelated prompt evicts the last one (released first, since tail first).
    h.prefill(2, &tokens(2, 8));
    assert_eq!(h.table(0, 2), vec![last as i32]);
    let events = removed(&h.events());
    assert_eq!(events, vec![(0, last, h.digests(&p, 32, 48))]);
    assert_eq!(h.m.stats().evictions, 1);
    assert_eq!(h.m.stats().groups[0].evictions, 1);

    let hit = h.probe(&p);
    assert_eq!(hit.tokens, 32);
    assert_eq!(hit.groups[0].stop, Some(MissReason::RecentlyEvicted));
    // Then the middle one, then the first.
    h.finish(2);
    h.prefill(3, &tokens(3, 20));
    let evicted: Vec<u32> = removed(&h.events()).iter().map(|e| e.1).collect();
    assert_eq!(evicted, vec![second, first]);
    assert_eq!(h.probe(&p).tokens, 0);
}

#[test]
fn a_freed_unpublished_block_is_reused_before_any_published_one() {
    let mut h = fa(4);
    let p = tokens(1, 32);
    h.serve(1, &p);
    // Three tokens never complete a unit: the block is freed unpublished.
    h.prefill(2, &tokens(2, 3));
    let unpublished = h.table(0, 2);
    h.finish(2);
    assert_eq!((h.usage(0).free, h.usage(0).cached), (1, 2));
    h.events();

    h.prefill(3, &tokens(3, 3));
    assert_eq!(h.table(0, 3), unpublished);
    assert!(removed(&h.events()).is_empty());
    assert_eq!(h.probe(&p).tokens, 28);
}

// ---------------------------------------------------------------------------------------------
// e. atomic refusal

#[test]
fn a_schedule_the_pool_cannot_supply_returns_none_and_changes_nothing() {
    let mut h = fa(4);
    let p = tokens(1, 32);
    h.serve(1, &p);
    let q = extend(&p[..16], 2, 48);
    h.add(2, &q);
    assert_eq!(h.lookup(2).tokens, 16);
    let usage = h.usage(0);
    h.events();

    // 64 tokens from a 16-token hit: three new blocks plus the pinned one, only three exist.
    assert_eq!(h.try_schedule(2, ALL), None);
    assert_eq!(h.usage(0), usage);
    assert!(h.events().is_empty());
    assert_eq!(h.m.num_computed(2), Ok(0));
    assert_eq!(h.probe(&p).tokens, 28);
    assert_eq!(h.m.stats().refused_schedules, 1);
    assert_eq!(h.m.stats().admissions, 1);

    // A smaller chunk fits.
    let s = h.schedule(2, 16);
    assert_eq!((s.num_computed, s.num_tokens), (16, 16));
}

#[test]
fn a_refusal_by_the_state_pool_pins_nothing_in_the_attention_pool() {
    let mut h = Hybrid { state_blocks: 2, ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    // One usable state block, two running buffers needed.
    let attention = h.usage(0);
    assert_eq!(h.try_schedule(1, ALL), None);
    assert_eq!(h.usage(0), attention);
    assert_eq!(h.usage(1).free, 1);
    assert_eq!(h.m.num_computed(1), Ok(0));
}

// ---------------------------------------------------------------------------------------------
// f. sliding window

#[test]
fn a_sliding_window_releases_blocks_that_left_it_while_the_sequence_runs() {
    let mut h = Harness::new(sliding_window(B, 32, U, 16));
    let p = tokens(1, 80);
    h.prefill(1, &p);
    let table = h.table(0, 1);
    assert_eq!(table[..3], [0, 0, 0], "blocks before 80 - 32 = 48 released: {table:?}");
    assert!(table[3..].iter().all(|&b| b != 0));
    let usage = h.usage(0);
    assert_eq!((usage.owned, usage.cached), (2, 3));

    // The next plan reports the releases as replaced entries, once.
    h.append(1, &[7]);
    let (_, plan) = h.step(1, 1);
    assert_eq!(triples(&plan.paged[0].replaced), vec![(0, 0, 0), (0, 1, 0), (0, 2, 0)]);
    let appended = triples(&plan.paged[0].appended);
    assert_eq!(appended.len(), 1);
    assert_eq!(appended[0].1, 5, "token 80 opens column 5");
    h.append(1, &[8]);
    let (_, plan) = h.step(1, 1);
    assert!(plan.paged[0].replaced.is_empty());
}

#[test]
fn window_releases_reported_by_an_aborted_plan_are_reported_again() {
    let mut h = Harness::new(sliding_window(B, 32, U, 16));
    h.prefill(1, &tokens(1, 80));
    h.append(1, &[7]);
    h.schedule(1, 1);
    let aborted = h.plan();
    assert_eq!(triples(&aborted.paged[0].replaced).len(), 3);
    h.abort(&aborted);
    // The engine drops an aborted plan's table updates: the next plan must repeat them.
    let (_, plan) = h.step(1, 1);
    assert_eq!(triples(&plan.paged[0].replaced), vec![(0, 0, 0), (0, 1, 0), (0, 2, 0)]);
}

#[test]
fn a_window_hit_needs_only_the_blocks_inside_the_window() {
    let mut h = Harness::new(sliding_window(B, 32, U, 6)); // five usable blocks
    let p = tokens(1, 80);
    h.prefill(1, &p);
    h.finish(1);
    h.events();
    // Two blocks for another prompt evict blocks 0 and 1 (they left the window first).
    h.serve(2, &tokens(2, 32));
    let evicted: Vec<Vec<_>> = removed(&h.events()).into_iter().map(|e| e.2).collect();
    assert_eq!(evicted, vec![h.digests(&p, 0, 16), h.digests(&p, 16, 32)]);

    let hit = h.probe(&p);
    assert_eq!(hit.tokens, 76);
    assert_eq!(hit.groups[0].stop, None);
    let q = extend(&p[..40], 3, 40);
    assert_eq!(h.probe(&q).tokens, 0);

    // Serving the resend: null entries outside the window, a copy of the last 12 tokens.
    h.add(4, &p);
    assert_eq!(h.schedule(4, ALL).num_computed, 76);
    let plan = h.plan();
    let row = h.table(0, 4);
    assert_eq!(row[..2], [0, 0]);
    assert_eq!(plan.copies.len(), 4);
    assert_eq!((plan.copies[2], plan.copies[3]), (i64::from(row[4]), 12));
    h.commit(&plan);
}

#[test]
fn a_window_with_a_hole_reports_window_gap() {
    let mut h = Harness::new(sliding_window(B, 32, U, 6));
    let p = tokens(1, 80);
    h.serve(1, &p);
    // Three blocks of another prompt evict blocks 0, 1 and 2: 76 still has its last block.
    h.serve(2, &tokens(2, 48));
    let hit = h.probe(&p);
    assert_eq!(hit.tokens, 0);
    assert_eq!(hit.groups[0].stop, Some(MissReason::WindowGap));
}

// ---------------------------------------------------------------------------------------------
// g. duplicates

#[test]
fn two_sequences_with_the_same_content_keep_both_blocks_valid() {
    let mut h = fa(8); // seven usable blocks
    let p = tokens(1, 40);
    h.add(1, &p);
    h.add(2, &p);
    h.schedule(1, ALL);
    h.schedule(2, ALL);
    let plan = h.plan();
    h.commit(&plan);
    let (t1, t2) = (h.table(0, 1), h.table(0, 2));
    assert!(t1.iter().all(|b| !t2.contains(b)), "computed twice, stored twice");

    h.finish(1);
    assert_eq!(h.probe(&p).tokens, 36);
    h.events();
    // Four blocks of other traffic evict every block of sequence 1 (and use the free one).
    h.serve(3, &tokens(3, 64));
    let evicted: BTreeSet<u32> = removed(&h.events()).iter().map(|e| e.1).collect();
    assert_eq!(evicted, t1.iter().map(|&b| b as u32).collect());
    assert_eq!(h.probe(&p).tokens, 36, "sequence 2's copy still serves the prefix");

    h.finish(2);
    assert_eq!(h.probe(&p).tokens, 36);
    assert_eq!(h.serve(4, &p), 36);
}

#[test]
fn a_hit_uses_the_copy_in_use_rather_than_a_cached_duplicate() {
    let mut h = fa(16);
    let p = tokens(1, 40);
    h.add(1, &p);
    h.add(2, &p);
    h.schedule(1, ALL);
    h.schedule(2, ALL);
    let plan = h.plan();
    h.commit(&plan);
    let t2 = h.table(0, 2);
    h.finish(1);
    let cached = h.usage(0).cached;
    h.add(3, &p);
    h.schedule(3, ALL);
    let plan = h.plan();
    assert_eq!(h.table(0, 3)[..2], t2[..2]);
    assert_eq!(plan.copies[1], i64::from(t2[2]));
    assert_eq!(h.usage(0).cached, cached, "no cached duplicate was pinned");
    h.commit(&plan);
}

// ---------------------------------------------------------------------------------------------
// h. hybrid reconciliation

#[test]
fn a_hybrid_hit_is_the_largest_position_with_a_state_published_there() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    h.schedule(1, ALL);
    h.call(|m| m.request_checkpoint(1, 16)).expect("16 is on the grid");
    let plan = h.plan();
    assert_eq!(plan.state[0].checkpoint_offsets, vec![16, 36]);
    h.commit(&plan);
    h.finish(1);

    // Shares 32 tokens: attention reaches 32, the state only 16.
    let shares_32 = extend(&p[..32], 2, 18);
    let hit = h.probe(&shares_32);
    assert_eq!(hit.tokens, 16);
    assert_eq!((hit.groups[0].tokens, hit.groups[1].tokens), (32, 16));
    assert_eq!(hit.groups[0].stop, Some(MissReason::NotCached));
    assert_eq!(hit.groups[1].stop, Some(MissReason::NoStateAtPosition));
    assert_eq!(hit.junction, Some(32));

    // Extends the prompt: attention 40, state 36; 40 - 36 < 2U, no junction.
    let longer = extend(&p, 3, 20);
    let hit = h.probe(&longer);
    assert_eq!(hit.tokens, 36);
    assert_eq!((hit.groups[0].tokens, hit.groups[1].tokens), (40, 36));
    assert_eq!(hit.junction, None);

    // Shares 20 tokens: the state group's own hit 16 is below attention's 20 by one unit only.
    let shares_20 = extend(&p[..20], 4, 20);
    let hit = h.probe(&shares_20);
    assert_eq!((hit.tokens, hit.groups[0].tokens, hit.junction), (16, 20, None));
}

// ---------------------------------------------------------------------------------------------
// i. zero-token schedules and the plan in flight

#[test]
fn a_budget_below_the_alignment_step_schedules_zero_tokens_and_pins_nothing() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.serve(1, &p);
    h.add(2, &p);
    let usage = (h.usage(0), h.usage(1));
    let s = h.schedule(2, 3);
    assert_eq!((s.num_computed, s.num_tokens), (36, 0));
    assert_eq!(s.hit.map(|hit| hit.tokens), Some(36));
    assert_eq!((h.usage(0), h.usage(1)), usage, "nothing pinned or allocated");
    assert_eq!(h.m.num_computed(2), Ok(0));
    let plan = h.plan();
    assert_eq!(plan.num_rows(), 0);
    h.commit(&plan);
    // Nothing holds blocks, so the cache may even be reset.
    assert_eq!(h.call(CacheManager::reset), Ok(()));

    // From scratch now: a budget of 3 on a 40-token prompt trims to 0 as well.
    let s = h.schedule(2, 3);
    assert_eq!((s.num_computed, s.num_tokens), (0, 0));
    let (s, _) = h.step(2, 6);
    assert_eq!((s.num_computed, s.num_tokens), (0, 4), "trimmed to the grid");
}

#[test]
fn schedule_while_a_plan_is_in_flight_is_a_step_error() {
    let mut h = fa(64);
    h.add(1, &tokens(1, 40));
    h.add(2, &tokens(2, 40));
    h.schedule(1, 16);
    let plan = h.plan();
    let err = h.call(|m| m.schedule(2, ALL, 0, false)).unwrap_err();
    assert!(matches!(err, CacheError::Step { .. }), "{err}");
    assert!(err.to_string().contains("in flight"), "{err}");
    let err = h.call(|m| m.schedule_batch(&[2], &[ALL], false)).unwrap_err();
    assert!(matches!(err, CacheError::Step { .. }), "{err}");
    h.commit(&plan);
    assert_eq!(h.schedule(2, ALL).num_tokens, 40);
}

// ---------------------------------------------------------------------------------------------
// The step protocol around the scenarios

#[test]
fn only_add_lookup_commit_abort_and_statistics_work_while_a_plan_is_in_flight() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.add(1, &p);
    h.add(2, &tokens(2, 8));
    h.schedule(1, 16);
    let plan = h.plan();
    let is_step = |r: Result<(), CacheError>| matches!(r, Err(CacheError::Step { .. }));
    assert!(is_step(h.call(|m| m.build_plan().map(drop))));
    assert!(is_step(h.call(|m| m.append(1, &[1]))));
    assert!(is_step(h.call(|m| m.append_batch(&[1], &[1]))));
    assert!(is_step(h.call(|m| m.finish(2))));
    assert!(is_step(h.call(|m| m.preempt(2))));
    assert!(is_step(h.call(CacheManager::reset)));
    // Allowed: add, lookup, statistics, events, suggest_chunk.
    h.add(3, &p);
    assert_eq!(h.lookup(3).tokens, 0);
    assert_eq!(h.m.stats().commits, 0);
    assert_eq!(h.m.pool_usage().len(), 1);
    h.events();
    assert_eq!(h.call(|m| m.suggest_chunk(3, 8)), Ok(8));
    assert_eq!(h.m.plan_in_flight(), Some(plan.step_id));
    h.commit(&plan);
    assert_eq!(h.m.plan_in_flight(), None);
    assert_eq!(h.lookup(3).tokens, 16);
}

#[test]
fn stale_and_twice_committed_plans_are_refused() {
    let mut h = fa(64);
    h.add(1, &tokens(1, 40));
    h.schedule(1, 16);
    let first = h.plan();
    h.commit(&first);
    let stale = |r: Result<(), CacheError>| match r {
        Err(CacheError::StalePlan { plan_step, .. }) => plan_step,
        other => panic!("expected StalePlan, got {other:?}"),
    };
    assert_eq!(stale(h.call(|m| m.commit(&first))), first.step_id);
    assert_eq!(stale(h.call(|m| m.abort(&first).map(drop))), first.step_id);

    h.schedule(1, 16);
    let second = h.plan();
    assert!(second.step_id > first.step_id);
    // The old plan while the new one is in flight: refused, and the new one is untouched.
    assert_eq!(stale(h.call(|m| m.commit(&first))), first.step_id);
    assert_eq!(h.m.plan_in_flight(), Some(second.step_id));
    let mut forged = second.clone();
    forged.step_id += 1;
    assert_eq!(stale(h.call(|m| m.commit(&forged))), forged.step_id);
    h.abort(&second);
    assert_eq!(stale(h.call(|m| m.commit(&second))), second.step_id);
    assert_eq!(h.m.num_computed(1), Ok(16));
    assert_eq!(h.m.stats().commits, 1);
}

#[test]
fn finish_or_preempt_of_a_sequence_scheduled_for_an_unbuilt_step_drops_it_from_that_step() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.serve(1, &p);
    let usage = h.usage(0);
    h.add(2, &p);
    h.add(3, &tokens(3, 8));
    h.schedule(2, ALL);
    h.schedule(3, ALL);
    h.finish(2);
    h.preempt(3);
    let plan = h.plan();
    assert_eq!(plan.num_rows(), 0);
    h.commit(&plan);
    assert_eq!(h.usage(0), usage);
    assert_eq!(h.m.num_computed(3), Ok(0));
    assert!(h.m.num_computed(2).is_err());
}

#[test]
fn a_preempted_sequence_resumes_from_its_own_published_prefix() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.prefill(1, &p);
    h.decode(1, &[100, 101, 102, 103, 104, 105]); // 46 tokens, 45 computed
    assert_eq!(h.m.num_computed(1), Ok(45));
    h.preempt(1);
    assert_eq!(h.usage(0).owned, 0);
    assert_eq!(h.m.num_computed(1), Ok(0));
    let (s, _) = h.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (44, 2), "decoded tokens were keyed too");
}

#[test]
fn reset_is_refused_while_sequences_hold_blocks_and_clears_everything_after() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.prefill(1, &p);
    let err = h.call(CacheManager::reset).unwrap_err();
    assert_eq!(err, CacheError::ResetRefused { live: 1 });
    assert_eq!(h.probe(&p).tokens, 36, "a refused reset drops nothing");
    h.preempt(1);
    h.events();
    h.call(CacheManager::reset).expect("nothing holds blocks");
    let events = h.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].event, CacheEvent::AllBlocksCleared);
    assert_eq!(h.probe(&p).tokens, 0);
    assert_eq!(h.usage(0).free, 63);
    // The live sequence is recomputed from scratch.
    let (s, _) = h.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (0, 40));
}

#[test]
fn decoded_tokens_are_keyed_like_prompt_tokens() {
    let mut h = fa(64);
    let p = tokens(1, 14);
    h.prefill(1, &p);
    let sampled = [50, 51, 52, 53, 54, 55];
    h.decode(1, &sampled); // 20 tokens, 19 computed: keyed up to 16
    let mut conversation = p.clone();
    conversation.extend_from_slice(&sampled);
    h.finish(1);
    let next = extend(&conversation, 2, 10);
    let hit = h.probe(&next);
    assert_eq!(hit.tokens, 16);
}

#[test]
fn lookahead_slots_are_allocated_but_never_keyed() {
    let mut h = fa(64);
    let p = tokens(1, 14);
    h.prefill(1, &p);
    h.append(1, &[99]);
    let s = h.call(|m| m.schedule(1, 1, 3, false)).unwrap().unwrap();
    assert_eq!((s.num_computed, s.num_tokens), (14, 1));
    let plan = h.plan();
    // Tokens 15..18 are drafts: the second block is needed for them.
    assert_eq!(triples(&plan.paged[0].appended).len(), 1);
    assert_eq!(plan.paged[0].slot_mapping.len(), 1);
    h.commit(&plan);
    assert_eq!(h.m.num_computed(1), Ok(15));
    let mut sent = p.clone();
    sent.push(99);
    sent.extend([1, 2, 3, 4]);
    assert_eq!(h.probe(&sent).tokens, 12, "nothing beyond the computed tokens is keyed");
}

#[test]
fn batch_forms_schedule_and_append_many_sequences_in_one_call() {
    let mut h = fa(64);
    for id in 1..=3 {
        h.add(id, &tokens(id as u32, 10));
    }
    let scheduled = h.call(|m| m.schedule_batch(&[3, 1, 2], &[ALL, 4, ALL], false)).unwrap();
    let got: Vec<_> =
        scheduled.iter().map(|s| s.as_ref().map(|s| (s.seq_id, s.num_tokens))).collect();
    assert_eq!(got, vec![Some((3, 10)), Some((1, 4)), Some((2, 10))]);
    let plan = h.plan();
    assert_eq!(plan.seq_ids, vec![3, 1, 2]);
    assert_eq!(plan.query_start_loc, vec![0, 10, 14, 24]);
    assert_eq!(plan.num_computed, vec![0, 0, 0]);
    assert_eq!(plan.num_scheduled, vec![10, 4, 10]);
    h.commit(&plan);

    // One bad id in a batch: nothing is appended or scheduled.
    let err = h.call(|m| m.append_batch(&[2, 9], &[5, 6])).unwrap_err();
    assert_eq!(err, CacheError::UnknownSequence { seq_id: 9 });
    assert_eq!(h.m.num_tokens(2), Ok(10));
    let err = h.call(|m| m.schedule_batch(&[1, 1], &[4, 4], false)).unwrap_err();
    assert!(matches!(err, CacheError::Step { .. }), "{err}");
    assert!(h.call(|m| m.schedule_batch(&[3, 1], &[1, 1], false)).is_err(), "3 is done");
    let plan = h.plan();
    assert_eq!(plan.num_rows(), 0, "a refused batch schedules nothing");
    h.commit(&plan);

    h.call(|m| m.append_batch(&[3, 2], &[7, 8])).unwrap();
    assert_eq!((h.m.num_tokens(3), h.m.num_tokens(2)), (Ok(11), Ok(11)));
}

#[test]
fn slot_mapping_covers_every_scheduled_token_of_every_row() {
    let mut h = fa(64);
    h.prefill(1, &tokens(1, 20));
    h.append(1, &[5]);
    h.add(2, &tokens(2, 18));
    h.schedule(1, 1);
    h.schedule(2, ALL);
    let plan = h.plan();
    let (t1, t2) = (h.table(0, 1), h.table(0, 2));
    let mut expected = vec![i64::from(t1[1]) * 16 + 4];
    expected.extend((0..16).map(|o| i64::from(t2[0]) * 16 + o));
    expected.extend((0..2).map(|o| i64::from(t2[1]) * 16 + o));
    assert_eq!(plan.paged[0].slot_mapping, expected);
    assert_eq!(plan.query_start_loc, vec![0, 1, 19]);
    // The decode row appends nothing (its block exists); the new row appends two columns.
    assert_eq!(triples(&plan.paged[0].appended), vec![(1, 0, t2[0]), (1, 1, t2[1])]);
    h.commit(&plan);
    // Rows of different lengths are padded with the null block.
    let (flat, rows, cols) = h.call(|m| m.block_table(0, &[1, 2])).unwrap();
    assert_eq!((rows, cols), (2, 2));
    assert_eq!(flat, vec![t1[0], t1[1], t2[0], t2[1]]);
}

// ---------------------------------------------------------------------------------------------
// Events and statistics

#[test]
fn events_carry_the_keys_of_each_commit_with_increasing_sequence_numbers() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.add(1, &p);
    h.step_exact(1, 22);
    let table = h.table(0, 1);
    h.step(1, ALL);
    let events = h.events();
    let numbers: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    assert!(numbers.windows(2).all(|w| w[0] < w[1]), "{numbers:?}");
    let got = stored(&events);
    let last = h.table(0, 1)[2] as u32;
    let b = |i: usize| table.get(i).map_or(0, |&b| b as u32);
    let q = |position: u32| Some(h.digest(&p, position));
    // One run per commit: [0, 22) keys block 0 full and block 1 at 20; [22, 40) keys block 1
    // at 24..32 and block 2 at 36 and 40.
    let expected = vec![
        (0, b(0), h.digests(&p, 0, 20), None, 0, 20, false),
        (0, b(1), h.digests(&p, 20, 40), q(20), 20, 40, false),
    ];
    assert_eq!(got, expected);
    let CacheEvent::BlockStored { blocks, .. } = &events[1].event else { panic!("{events:?}") };
    assert_eq!(blocks, &[b(1), b(1), b(1), last, last]);

    // Numbers keep growing across drains and kinds of events.
    h.finish(1);
    h.call(CacheManager::reset).unwrap();
    let later = h.events();
    assert_eq!(later.len(), 1);
    assert!(later[0].sequence > *numbers.last().unwrap());
}

#[test]
fn no_events_are_recorded_when_they_are_disabled() {
    let mut h = Harness::new(CacheConfig { enable_events: false, ..full_attention(B, U, 8) });
    h.serve(1, &tokens(1, 40));
    h.serve(2, &tokens(2, 100));
    assert!(h.events().is_empty());
    assert_eq!(h.m.stats().evictions, 3);
}

#[test]
fn statistics_count_lookups_admissions_copies_commits_aborts_and_refusals() {
    let mut h = fa(6);
    let p = tokens(1, 40);
    h.serve(1, &p);
    h.add(2, &p);
    assert_eq!(h.lookup(2).tokens, 36);
    h.schedule(2, ALL);
    let plan = h.plan();
    h.abort(&plan);
    h.step(2, ALL);
    h.finish(2);
    h.add(3, &tokens(3, 100));
    assert_eq!(h.try_schedule(3, ALL), None);
    let stats = h.m.stats();
    assert_eq!((stats.lookups, stats.lookup_hit_tokens), (1, 36));
    assert_eq!((stats.admissions, stats.admitted_hit_tokens), (3, 72));
    assert_eq!(stats.groups[0].hit_tokens, 72);
    assert_eq!(stats.scheduled_tokens, 40 + 4 + 4);
    assert_eq!((stats.copies, stats.commits, stats.aborts), (2, 2, 1));
    assert_eq!((stats.refused_schedules, stats.evictions), (1, 0));
}

// ---------------------------------------------------------------------------------------------
// Hashing-related behaviour of the manager

#[test]
fn add_extending_another_sequence_reuses_the_hashes_of_the_common_prefix() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    h.serve(1, &p);
    // A finished sequence: the whole 40-token prompt is 10 units.
    let q = extend(&p, 2, 22);
    let added = h.add_extending(2, &q, 1);
    assert!(added.extends_found);
    assert_eq!((added.reused_tokens, added.hashed_units), (40, 5));
    assert_eq!(h.lookup(2).tokens, 40);
    // Diverging inside a unit: only whole shared units are reused.
    let mut r = p[..30].to_vec();
    r.extend(tokens(3, 10));
    let added = h.add_extending(3, &r, 2);
    assert_eq!((added.reused_tokens, added.hashed_units), (28, 3));
    assert_eq!(h.lookup(3).tokens, 28);
    // An unknown sequence: everything hashed.
    let added = h.add_extending(4, &p, 77);
    assert!(!added.extends_found);
    assert_eq!((added.reused_tokens, added.hashed_units), (0, 10));
    // A different salt shares nothing.
    let salted = ExtraKeys { cache_salt: Some(b"tenant".to_vec()), ..ExtraKeys::default() };
    let added = h.call(|m| m.add(5, &p, salted, Some(1))).unwrap();
    assert_eq!(added.reused_tokens, 0);
    assert_eq!(h.lookup(5).tokens, 0);
    // The id of a finished sequence may be added again, extending its own previous turn.
    let added = h.add_extending(1, &q, 1);
    assert_eq!(added.reused_tokens, 40);
    assert_eq!(h.lookup(1).tokens, 40);
}

/// Every key the drained `BlockStored` events published, in order.
fn published_keys(h: &mut Harness) -> Vec<Digest> {
    h.events()
        .into_iter()
        .flat_map(|r| match r.event {
            CacheEvent::BlockStored { keys, .. } => keys,
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn add_without_extends_reuses_what_a_live_sequence_provably_shares() {
    let system = tokens(1, 24);
    let (a, b) = (extend(&system, 2, 16), extend(&system, 3, 18));
    let salted = ExtraKeys { cache_salt: Some(b"tenant".to_vec()), ..ExtraKeys::default() };
    let image = |hash: u8| ExtraKeys {
        multimodal: vec![MultimodalInput { start: 8, end: 12, hash: vec![hash] }],
        ..ExtraKeys::default()
    };
    let traffic = |h: &mut Harness| -> Vec<Added> {
        let mut added = vec![h.add(1, &a), h.add(2, &b)];
        // Other extra keys over the shared tokens: a salt changes unit 0, so no live sequence
        // is found; a multimodal input stops the reuse at its first token.
        added.push(h.call(|m| m.add(3, &b, salted.clone(), None)).unwrap());
        added.push(h.call(|m| m.add(4, &a, image(1), None)).unwrap());
        added.push(h.call(|m| m.add(5, &b, image(2), None)).unwrap());
        added.push(h.call(|m| m.add(6, &b, image(2), None)).unwrap());
        for id in 1..=6 {
            h.step(id, ALL);
        }
        // Finished sequences are not live: only `extends` reaches them.
        for id in 1..=6 {
            h.finish(id);
        }
        added.push(h.add(7, &a));
        added
    };
    let mut on = fa(256);
    let reused = traffic(&mut on);
    let summary: Vec<(u32, u32, bool)> =
        reused.iter().map(|a| (a.reused_tokens, a.hashed_units, a.extends_found)).collect();
    assert_eq!(
        summary,
        [
            (0, 10, false),
            (24, 4, false),
            (0, 10, false),
            (8, 8, false),
            (8, 8, false),
            (40, 0, false),
            (0, 10, false)
        ]
    );
    // The reused digests are the real ones: the same traffic with the reuse turned off
    // publishes the very same keys, and every sequence hashed all its units.
    let keys = published_keys(&mut on);
    let mut off =
        Harness::new(CacheConfig { reuse_live_prefixes: false, ..full_attention(B, U, 256) });
    let hashed = traffic(&mut off);
    assert!(hashed.iter().all(|a| a.reused_tokens == 0));
    assert_eq!(published_keys(&mut off), keys);
    assert!(!keys.is_empty());
}

#[test]
fn a_finished_turn_continued_by_the_next_stays_resolvable_for_extends() {
    let mut h = Harness::new(full_attention(B, U, 64));
    let p = tokens(1, 40);
    h.serve(1, &p);
    // The next turn takes the finished turn's buffers over...
    let q = extend(&p, 2, 24);
    let added = h.add_extending(2, &q, 1);
    assert_eq!((added.reused_tokens, added.hashed_units), (40, 6));
    // ...and a second branch from the same finished turn still reuses its 40 tokens, found
    // through the continuation, not the 16 that only the second branch and q share beyond.
    let branch = extend(&p, 3, 16);
    let added = h.add_extending(3, &branch, 1);
    assert!(added.extends_found);
    assert_eq!((added.reused_tokens, added.hashed_units), (40, 4));
    // Chains of turns resolve too, capped at what the original sequence really held.
    h.finish(2);
    let q2 = extend(&q, 4, 8);
    assert_eq!(h.add_extending(4, &q2, 2).reused_tokens, 64);
    let p2 = extend(&p, 5, 8);
    let added = h.add_extending(5, &p2, 1);
    assert_eq!((added.reused_tokens, added.hashed_units), (40, 2));
    // The reused hashes are the real ones: lookups match a plain add's.
    h.add(6, &p2);
    assert_eq!(h.lookup(5), h.lookup(6));
}

#[test]
fn extending_a_turn_still_prefers_a_duplicate_copy_in_use() {
    let mut h = Harness::new(full_attention(B, U, 64));
    let p = tokens(1, 40);
    // Two sequences compute the same prompt in one step: every key gets two blocks.
    h.add(1, &p);
    h.add(2, &p);
    h.schedule(1, ALL);
    h.schedule(2, ALL);
    let plan = h.plan();
    h.commit(&plan);
    let in_use = h.table(0, 2);
    let released = h.table(0, 1);
    assert_ne!(in_use[..2], released[..2]);
    h.finish(1);
    // A turn extending the finished one is handed its blocks as a hint, but the rule wins:
    // the copy still in use (sequence 2's) is the one the hit takes.
    let q = extend(&p, 3, 8);
    h.add_extending(3, &q, 1);
    assert_eq!(h.lookup(3).tokens, 40);
    h.schedule(3, ALL);
    assert_eq!(h.table(0, 3)[..2], in_use[..2]);
    let plan = h.plan();
    h.commit(&plan);
    // Once both are released, the most recently used copy: the one 2 and 3 used last.
    h.finish(2);
    h.finish(3);
    let r = extend(&q, 4, 8);
    h.add_extending(4, &r, 3);
    h.schedule(4, ALL);
    assert_eq!(h.table(0, 4)[..2], in_use[..2]);
}

#[test]
fn verify_tokens_serves_the_same_hits() {
    let mut config = full_attention(B, U, 8);
    config.hash.verify_tokens = true;
    let mut h = Harness::new(config);
    let p = tokens(1, 40);
    assert_eq!(h.serve(1, &p), 0);
    assert_eq!(h.serve(2, &p), 36);
    assert_eq!(h.probe(&extend(&p[..24], 2, 8)).tokens, 24);
    // Evicting the chain forgets the stored tokens along with the keys.
    h.serve(3, &tokens(3, 112));
    assert_eq!(h.probe(&p).tokens, 0);
    assert_eq!(h.serve(4, &p), 0);
    assert_eq!(h.probe(&p).tokens, 36);
}

// ---------------------------------------------------------------------------------------------
// Errors

#[test]
fn every_error_variant_but_invariant_is_reachable_and_says_what_to_change() {
    let mut kinds = BTreeSet::new();
    let mut seen = |e: CacheError| {
        assert!(!e.to_string().is_empty());
        kinds.insert(e.kind());
        e
    };

    // Config.
    let bad_unit = full_attention(16, 5, 8);
    let e = seen(CacheManager::new(bad_unit).unwrap_err());
    assert!(e.to_string().contains("16") && e.to_string().contains("U = 5"), "{e}");
    let bad_alignment = Hybrid { alignment: 3, ..Hybrid::default() }.config();
    let e = seen(CacheManager::new(bad_alignment).unwrap_err());
    assert!(e.to_string().contains("A = 3"), "{e}");
    let narrow = sliding_window(16, 8, 4, 8);
    assert!(matches!(seen(CacheManager::new(narrow).unwrap_err()), CacheError::Config { .. }));
    let empty_pool = full_attention(16, 4, 1);
    assert!(matches!(seen(CacheManager::new(empty_pool).unwrap_err()), CacheError::Config { .. }));
    let no_pools = CacheConfig { pools: vec![], ..full_attention(16, 4, 8) };
    assert!(CacheManager::new(no_pools).is_err());
    let no_groups = CacheConfig { groups: vec![], ..full_attention(16, 4, 8) };
    assert!(CacheManager::new(no_groups).is_err());
    let bad_pool = CacheConfig {
        groups: vec![GroupConfig { kind: GroupKind::FullAttention { block_size: 16 }, pool: 3 }],
        ..full_attention(16, 4, 8)
    };
    assert!(CacheManager::new(bad_pool).is_err());
    let bad_interval = Hybrid {
        retention: Retention { interval: Some(6), ..Retention::default() },
        ..Hybrid::default()
    };
    let e = seen(CacheManager::new(bad_interval.config()).unwrap_err());
    assert!(e.to_string().contains("K = 6"), "{e}");
    let zero_unit = CacheConfig {
        hash: HashConfig { unit: 0, ..HashConfig::default() },
        ..full_attention(16, 4, 8)
    };
    assert!(CacheManager::new(zero_unit).is_err());

    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    // InvalidRequest.
    let e = seen(h.call(|m| m.add(1, &[], ExtraKeys::default(), None)).unwrap_err());
    assert!(matches!(e, CacheError::InvalidRequest { .. }));
    h.add(1, &p);
    let e = seen(h.call(|m| m.schedule(1, ALL, 2, false)).unwrap_err());
    assert!(e.to_string().contains("lookahead"), "{e}");
    assert_eq!(h.m.num_computed(1), Ok(0));
    let e = seen(h.call(|m| m.block_table(1, &[1])).unwrap_err());
    assert!(matches!(e, CacheError::InvalidRequest { .. }));
    let e = seen(h.call(|m| m.schedule_batch(&[1], &[], false)).unwrap_err());
    assert!(matches!(e, CacheError::InvalidRequest { .. }));
    // UnknownSequence.
    for e in [
        h.call(|m| m.lookup(9).map(drop)).unwrap_err(),
        h.call(|m| m.schedule(9, 1, 0, false).map(drop)).unwrap_err(),
        h.call(|m| m.finish(9)).unwrap_err(),
        h.call(|m| m.preempt(9)).unwrap_err(),
        h.call(|m| m.append(9, &[1])).unwrap_err(),
        h.m.num_computed(9).map(drop).unwrap_err(),
    ] {
        assert_eq!(seen(e), CacheError::UnknownSequence { seq_id: 9 });
    }
    // DuplicateSequence.
    let e = seen(h.call(|m| m.add(1, &p, ExtraKeys::default(), None)).unwrap_err());
    assert_eq!(e, CacheError::DuplicateSequence { seq_id: 1 });
    // Step: request before schedule, schedule twice.
    let e = seen(h.call(|m| m.request_checkpoint(1, 8)).unwrap_err());
    assert!(matches!(e, CacheError::Step { .. }));
    h.schedule(1, ALL);
    let e = seen(h.call(|m| m.schedule(1, ALL, 0, false)).unwrap_err());
    assert!(matches!(e, CacheError::Step { .. }));
    // Alignment.
    let e = seen(h.call(|m| m.request_checkpoint(1, 30)).unwrap_err());
    assert!(matches!(e, CacheError::Alignment { position: 30, .. }), "{e}");
    let plan = h.plan();
    h.commit(&plan);
    // NothingToSchedule.
    let e = seen(h.call(|m| m.schedule(1, ALL, 0, false)).unwrap_err());
    assert_eq!(e, CacheError::NothingToSchedule { seq_id: 1, num_computed: 40, num_tokens: 40 });
    // StalePlan.
    let e = seen(h.call(|m| m.commit(&plan)).unwrap_err());
    assert!(matches!(e, CacheError::StalePlan { .. }));
    // ResetRefused.
    let e = seen(h.call(CacheManager::reset).unwrap_err());
    assert_eq!(e, CacheError::ResetRefused { live: 1 });

    // No state group: nothing to checkpoint.
    let mut f = fa(8);
    f.add(1, &tokens(1, 8));
    f.schedule(1, ALL);
    let e = seen(f.call(|m| m.request_checkpoint(1, 4)).unwrap_err());
    assert!(matches!(e, CacheError::InvalidRequest { .. }));

    let all: BTreeSet<&str> = [
        "Config",
        "InvalidRequest",
        "UnknownSequence",
        "DuplicateSequence",
        "NothingToSchedule",
        "Step",
        "StalePlan",
        "Alignment",
        "ResetRefused",
    ]
    .into_iter()
    .collect();
    assert_eq!(kinds, all, "Invariant is only raised by check_invariants on a core bug");
}

#[test]
fn a_pool_with_groups_of_both_kinds_is_accepted_and_serves_hits() {
    let config = CacheConfig {
        hash: HashConfig { unit: U, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 64 }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: B }, pool: 0 },
            GroupConfig {
                kind: GroupKind::State(StateGroupConfig {
                    alignment: 4,
                    max_checkpoints_per_step: Some(2),
                    ..StateGroupConfig::default()
                }),
                pool: 0,
            },
        ],
        ..CacheConfig::default()
    };
    let mut h = Harness::new(config);
    let p = tokens(1, 40);
    assert_eq!(h.serve(1, &p), 0);
    assert_eq!(h.serve(2, &p), 36);
}

#[test]
fn undrained_events_beyond_the_limit_drop_the_oldest_and_are_counted() {
    let mut h = Harness::new(CacheConfig { max_pending_events: 2, ..full_attention(B, U, 64) });
    let p = tokens(3, 40);
    h.serve(1, &tokens(1, 40));
    h.serve(2, &tokens(2, 40));
    h.serve(3, &p);
    let events = h.events();
    let numbers: Vec<u64> = events.iter().map(|e| e.sequence).collect();
    assert_eq!(numbers, vec![1, 2], "the newest two of three runs");
    assert_eq!(stored(&events)[1].2, h.digests(&p, 0, 40));
    assert_eq!(h.m.stats().events_dropped, 1);
}

// ---------------------------------------------------------------------------------------------
// Recency and isolation

#[test]
fn a_hit_promotes_its_blocks_so_an_unused_chain_is_evicted_first() {
    let mut h = fa(8); // seven usable blocks
    let p = tokens(1, 48);
    let q = tokens(2, 48);
    h.serve(1, &p);
    h.serve(2, &q); // q's chain is now the more recently used
    assert_eq!(h.serve(3, &p), 44); // p's blocks pinned, then released again
    assert_eq!(h.usage(0).free, 0);
    h.events();
    h.serve(4, &tokens(4, 40)); // three blocks, all evicted from q's chain, tail first
    let evicted = removed(&h.events());
    let expected: Vec<_> = [(32, 48), (16, 32), (0, 16)]
        .into_iter()
        .map(|(from, to)| h.digests(&q, from, to))
        .collect();
    assert_eq!(evicted.into_iter().map(|e| e.2).collect::<Vec<_>>(), expected);
    assert_eq!(h.probe(&p).tokens, 44);
    assert_eq!(h.probe(&q).tokens, 0);
}

#[test]
fn among_cached_duplicates_a_hit_uses_the_most_recently_used_one() {
    let mut h = fa(16);
    let p = tokens(1, 40);
    for order in [[1u64, 2], [2, 1]] {
        let (first, second) = (order[0] * 10, order[1] * 10);
        h.add(first, &p);
        h.add(second, &p);
        h.schedule(first, ALL);
        h.schedule(second, ALL);
        let plan = h.plan();
        h.commit(&plan);
        let newest = h.table(0, second);
        h.finish(first);
        h.finish(second);
        h.add(99, &p);
        h.schedule(99, ALL);
        let plan = h.plan();
        assert_eq!(h.table(0, 99)[..2], newest[..2]);
        assert_eq!(plan.copies[1], i64::from(newest[2]));
        h.abort(&plan);
        h.finish(99);
        h.call(CacheManager::reset).unwrap();
    }
}

#[test]
fn a_cache_salt_or_a_lora_id_isolates_hits() {
    let mut h = fa(64);
    let p = tokens(1, 40);
    let tenant =
        |salt: &[u8]| ExtraKeys { cache_salt: Some(salt.to_vec()), ..ExtraKeys::default() };
    h.call(|m| m.add(1, &p, tenant(b"a"), None)).unwrap();
    h.step(1, ALL);
    h.finish(1);
    let lookup = |h: &mut Harness, id: u64, extra: ExtraKeys| {
        h.call(|m| m.add(id, &p, extra, None)).unwrap();
        h.lookup(id).tokens
    };
    assert_eq!(lookup(&mut h, 2, tenant(b"a")), 36);
    assert_eq!(lookup(&mut h, 3, tenant(b"b")), 0);
    assert_eq!(lookup(&mut h, 4, ExtraKeys::default()), 0);
    let lora = ExtraKeys { lora_id: Some(7), ..tenant(b"a") };
    assert_eq!(lookup(&mut h, 5, lora), 0);
    // A multimodal range beyond the prompt is refused.
    let image = prefixcache_core::MultimodalInput { start: 30, end: 50, hash: vec![1] };
    let extra = ExtraKeys { multimodal: vec![image], ..ExtraKeys::default() };
    let err = h.call(|m| m.add(6, &p, extra, None)).unwrap_err();
    assert!(matches!(err, CacheError::InvalidRequest { .. }), "{err}");
}

#[test]
fn scheduled_tokens_counts_what_the_next_plan_will_hold() {
    let mut h = fa(64);
    h.add(1, &tokens(1, 40));
    h.add(2, &tokens(2, 40));
    assert_eq!(h.m.scheduled_tokens(), 0);
    h.schedule(1, 16);
    h.schedule(2, 5);
    assert_eq!(h.m.scheduled_tokens(), 21);
    let plan = h.plan();
    assert_eq!(plan.num_tokens(), 21);
    assert_eq!(h.m.scheduled_tokens(), 0);
    h.commit(&plan);
    h.schedule(1, 100);
    assert_eq!(h.m.scheduled_tokens(), 24);
}

#[test]
fn decode_step_equals_commit_append_schedule_and_plan() {
    // Decode tails every unit (U = 4): steps with and without snapshots, on a twin driven by
    // the separate calls.
    let (mut explicit, mut fused) = (Hybrid::default().harness(), Hybrid::default().harness());
    let ids = [1u64, 2, 3];
    for h in [&mut explicit, &mut fused] {
        for &id in &ids {
            h.add(id, &tokens(id as u32, 21));
            h.schedule(id, ALL);
        }
    }
    // Equal plans, but for the manager that built each.
    let same = |a: &StepPlan, b: &StepPlan| StepPlan { manager: b.manager, ..a.clone() } == *b;
    let mut plan = explicit.plan();
    let mut kept = fused.plan();
    assert_ne!(plan.manager, kept.manager);
    assert!(same(&plan, &kept));
    for step in 0..12u32 {
        let sampled: Vec<u32> = ids.iter().map(|&id| 1000 + step * 10 + id as u32).collect();
        explicit.commit(&plan);
        explicit.call(|m| m.append_batch(&ids, &sampled)).expect("append");
        let expected = explicit.call(|m| m.schedule_batch(&ids, &[1; 3], false)).expect("schedule");
        plan = explicit.plan();
        let got = fused.call(|m| m.decode_step(&ids, &sampled, &mut kept)).expect("decode_step");
        assert_eq!(got, expected);
        assert!(same(&plan, &kept), "step {step}: {plan:?} != {kept:?}");
    }
    // Refused before anything changes (after the commit, which stands).
    let before = fused.m.num_tokens(1);
    let twice = fused.call(|m| m.decode_step(&[1, 1], &[5, 6], &mut kept));
    assert!(matches!(twice, Err(CacheError::Step { .. })), "{twice:?}");
    assert_eq!((fused.m.plan_in_flight(), fused.m.num_tokens(1)), (None, before));
}

#[test]
fn a_plan_built_by_another_manager_is_refused_whatever_its_step_id() {
    let (mut a, mut b) = (fa(64), fa(64));
    for h in [&mut a, &mut b] {
        h.add(1, &tokens(1, 20));
        h.schedule(1, ALL);
    }
    let (plan_a, plan_b) = (a.plan(), b.plan());
    assert_eq!(plan_a.step_id, plan_b.step_id);
    for r in [a.call(|m| m.commit(&plan_b)), a.call(|m| m.abort(&plan_b).map(drop))] {
        assert!(matches!(r, Err(CacheError::StalePlan { .. })), "{r:?}");
        assert!(r.unwrap_err().to_string().contains("another manager"));
    }
    assert_eq!(a.m.plan_in_flight(), Some(plan_a.step_id));
    a.commit(&plan_a);
    b.commit(&plan_b);
}

#[test]
fn a_batch_naming_a_sequence_twice_is_refused_whatever_its_size() {
    // A short batch and a long one, the repeat last: the repeated sequence is named and
    // nothing is scheduled; the same ids without the repeat are then scheduled.
    let mut h = fa(256);
    for id in 1..=20u64 {
        h.add(id, &tokens(id as u32, 40));
    }
    for ids in [vec![1u64, 2, 3, 2], (1..=20).chain([7]).collect::<Vec<u64>>()] {
        let budgets = vec![16; ids.len()];
        let got = h.call(|m| m.schedule_batch(&ids, &budgets, false));
        let Err(CacheError::Step { message }) = got else { panic!("{got:?}") };
        let repeated = if ids.len() == 4 { 2 } else { 7 };
        assert!(message.contains(&format!("sequence {repeated} appears twice")), "{message}");
        assert_eq!(h.m.scheduled_tokens(), 0);
    }
    let distinct: Vec<u64> = (1..=20).collect();
    let got = h.call(|m| m.schedule_batch(&distinct, &[16; 20], false)).expect("distinct ids");
    assert!(got.iter().all(|s| s.as_ref().is_some_and(|s| s.num_tokens == 16)), "{got:?}");
}
