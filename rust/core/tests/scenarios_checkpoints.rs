//! Scenario tests of checkpoint planning (issue [checkpoints], scenarios a to m, and the rules
//! around them), through the public API only. Unless stated: B = 16, U = 4, one full-attention
//! group and one state group (A = 4, C = 2, tail + junction + decode tail, no interval), each
//! with its own pool. Every call goes through `Harness`, which runs `check_invariants` after it.

mod common;

use common::{extend, removed, rows, stored, tokens, Harness, Hybrid, ALL, U};
use prefixcache_core::{CacheError, MissReason, Retention, SkipReason, StateGroupPlan, StepPlan};

const STATE: usize = 1;

fn state(plan: &StepPlan) -> &StateGroupPlan {
    &plan.state[0]
}

fn skipped(h: &Harness, reason: SkipReason) -> u64 {
    h.m.stats().groups[STATE].checkpoints_skipped[reason.index()]
}

fn published(h: &Harness) -> u64 {
    h.m.stats().groups[STATE].checkpoints_published
}

/// The position of a prompt's tail checkpoint.
fn tail(len: usize) -> u32 {
    (len as u32 - 1) / U * U
}

// ---------------------------------------------------------------------------------------------
// a. one chunk

#[test]
fn a_40_token_prompt_exports_its_tail_at_36_and_a_resend_resumes_there() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    h.schedule(1, ALL);
    let plan = h.plan();
    let st = state(&plan);
    assert_eq!((st.max_checkpoints, st.checkpoint_offsets.clone()), (1, vec![36]));
    let checkpoint = st.checkpoint_slots[0];
    assert!(checkpoint > 0);
    assert_eq!(st.initial_slot, vec![-1], "no hit: zero state");
    assert!(st.running_slot[0] > 0 && st.running_slot[0] != checkpoint);
    assert!(st.snapshots.is_empty());
    assert_eq!(h.probe(&p).tokens, 0, "not visible before commit");
    h.events();
    h.commit(&plan);
    let events = stored(&h.events());
    let state_events: Vec<_> = events.iter().filter(|e| e.0 == 1).cloned().collect();
    assert_eq!(
        state_events,
        vec![(1, checkpoint as u32, vec![h.digest(&p, 36)], Some(h.digest(&p, 32)), 32, 36, true)]
    );
    assert_eq!(published(&h), 1);
    h.finish(1);

    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.groups[1].tokens), (36, 36));
    let hit = h.probe(&extend(&p, 2, 20));
    assert_eq!((hit.tokens, hit.groups[0].tokens, hit.groups[1].tokens), (36, 40, 36));
    assert_eq!(hit.junction, None);

    // Serving the resend reads the published checkpoint and writes a private buffer.
    h.add(2, &p);
    assert_eq!(h.schedule(2, ALL).num_computed, 36);
    let plan = h.plan();
    assert_eq!(state(&plan).initial_slot, vec![checkpoint]);
    assert_ne!(state(&plan).running_slot, vec![checkpoint]);
    h.commit(&plan);
    assert_eq!(h.m.stats().groups[STATE].checkpoint_hits, 1);
}

// ---------------------------------------------------------------------------------------------
// b. exact chunks off the grid, and trimming onto it

#[test]
fn an_exact_chunk_off_the_grid_skips_the_tail_as_unaligned() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    let (s, plan) = h.step_exact(1, 22);
    assert_eq!((s.num_computed, s.num_tokens), (0, 22));
    assert_eq!(state(&plan).max_checkpoints, 0);
    let s = h.schedule_exact(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (22, 18));
    let plan = h.plan();
    assert_eq!(state(&plan).max_checkpoints, 0);
    assert!(state(&plan).checkpoint_offsets.is_empty() && state(&plan).snapshots.is_empty());
    let usage = h.usage(1);
    assert_eq!((usage.owned, usage.checkpoints), (2, 0), "only the running buffers");
    h.commit(&plan);
    assert_eq!(skipped(&h, SkipReason::Unaligned), 1);
    assert_eq!(published(&h), 0);
    h.finish(1);
    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.groups[0].tokens), (0, 36));
}

#[test]
fn without_exact_the_first_chunk_is_trimmed_to_the_grid_and_the_tail_exported() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    let (s, _) = h.step(1, 22);
    assert_eq!((s.num_computed, s.num_tokens), (0, 20));
    let (s, plan) = h.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (20, 20));
    assert_eq!(state(&plan).checkpoint_offsets, vec![16]);
    h.finish(1);
    assert_eq!(h.probe(&p).tokens, 36);
    assert_eq!(skipped(&h, SkipReason::Unaligned), 0);
}

// ---------------------------------------------------------------------------------------------
// c. explicit requests

#[test]
fn an_off_grid_checkpoint_request_names_the_offset_the_alignment_and_the_valid_position() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    h.step_exact(1, 22);
    h.schedule_exact(1, ALL);
    let err = h.call(|m| m.request_checkpoint(1, 28)).unwrap_err();
    let CacheError::Alignment { position, offset, alignment, chunk_start, .. } = &err else {
        panic!("expected an alignment error, got {err:?}");
    };
    assert_eq!((*position, *offset, *alignment, *chunk_start), (28, 6, 4, 22));
    let message = err.to_string();
    assert!(message.contains("offset 6") && message.contains("alignment 4"), "{message}");
    assert!(message.contains("only valid position") && message.contains("40"), "{message}");

    // The chunk end itself is valid: a snapshot after the step serves it.
    h.call(|m| m.request_checkpoint(1, 40)).expect("the chunk end is always valid");
    let plan = h.plan();
    let st = state(&plan);
    assert!(st.checkpoint_offsets.is_empty());
    assert_eq!(st.snapshots.len(), 2);
    assert_eq!(st.snapshots[0], st.running_slot[0]);
    h.commit(&plan);
    h.finish(1);
    assert_eq!(h.probe(&extend(&p, 2, 20)).tokens, 40);
}

#[test]
fn an_on_grid_checkpoint_request_is_exported_and_an_outside_one_refused() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    h.step(1, 20);
    h.schedule(1, ALL);
    let err = h.call(|m| m.request_checkpoint(1, 12)).unwrap_err();
    assert!(matches!(err, CacheError::Alignment { position: 12, .. }), "{err}");
    assert!(err.to_string().contains("outside"), "{err}");
    h.call(|m| m.request_checkpoint(1, 28)).expect("offset 8 is on the grid");
    let plan = h.plan();
    assert_eq!(state(&plan).checkpoint_offsets, vec![8, 16]);
    h.commit(&plan);
    h.finish(1);
    assert_eq!(h.probe(&extend(&p[..28], 2, 20)).tokens, 28);
}

// ---------------------------------------------------------------------------------------------
// d. chunked prefill

#[test]
fn a_chunked_prefill_exports_the_tail_in_its_second_chunk_and_hits_like_one_chunk() {
    let p = tokens(1, 40);
    let mut chunked = Hybrid::default().harness();
    chunked.add(1, &p);
    let (_, first) = chunked.step(1, 24);
    assert_eq!(state(&first).max_checkpoints, 0);
    let (s, second) = chunked.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (24, 16));
    assert_eq!(state(&second).checkpoint_offsets, vec![12]);
    assert_eq!(state(&second).initial_slot, state(&first).running_slot);
    chunked.finish(1);

    let mut whole = Hybrid::default().harness();
    whole.serve(1, &p);

    for probe in [
        p.clone(),
        extend(&p, 2, 20),
        extend(&p[..28], 3, 20),
        extend(&p[..36], 4, 8),
        extend(&p[..12], 5, 30),
    ] {
        let (a, b) = (chunked.probe(&probe), whole.probe(&probe));
        assert_eq!(a, b);
    }
    assert_eq!(chunked.probe(&p).tokens, 36);
}

// ---------------------------------------------------------------------------------------------
// e. growing prefix with fine and coarse units

fn growing_prefix_hit(block_size: u32, unit: u32) -> u32 {
    let mut h = Hybrid { block_size, unit, ..Hybrid::default() }.harness();
    let p1 = tokens(1, 1000);
    h.prefill(1, &p1);
    h.decode(1, &tokens(9, 20)); // not sent back
    h.finish(1);
    let p2 = extend(&p1, 2, 200);
    let hit = h.probe(&p2);
    assert_eq!(hit.junction, None);
    h.serve(2, &p2)
}

#[test]
fn a_growing_prefix_hits_992_with_fine_units_and_960_with_block_sized_ones() {
    assert_eq!(growing_prefix_hit(64, 8), 992);
    assert_eq!(growing_prefix_hit(64, 64), 960);
}

// ---------------------------------------------------------------------------------------------
// f. and h. junctions

#[test]
fn a_junction_where_another_request_diverged_is_checkpointed() {
    let mut h = Hybrid::default().harness();
    let x = tokens(1, 40);
    h.serve(1, &x);
    let y = extend(&x[..28], 2, 22);
    h.add(2, &y);
    let hit = h.lookup(2);
    assert_eq!((hit.groups[0].tokens, hit.groups[1].tokens, hit.tokens), (28, 0, 0));
    assert_eq!(hit.junction, Some(28));
    h.schedule(2, ALL);
    let plan = h.plan();
    assert_eq!(state(&plan).checkpoint_offsets, vec![28, 48]);
    h.commit(&plan);
    h.finish(2);
    assert_eq!(published(&h), 3);

    let z = extend(&x[..28], 3, 12);
    let hit = h.probe(&z);
    assert_eq!((hit.tokens, hit.junction), (28, None));
    assert_eq!(h.serve(3, &z), 28);
}

#[test]
fn with_one_checkpoint_per_step_the_tail_wins_over_the_junction() {
    let mut h = Hybrid { max_checkpoints: Some(1), ..Hybrid::default() }.harness();
    let x = tokens(1, 40);
    h.serve(1, &x);
    let y = extend(&x[..28], 2, 22);
    h.add(2, &y);
    h.schedule(2, ALL);
    let plan = h.plan();
    assert_eq!(state(&plan).checkpoint_offsets, vec![48]);
    h.commit(&plan);
    assert_eq!(skipped(&h, SkipReason::Capacity), 1);
    h.finish(2);
    assert_eq!(h.probe(&extend(&x[..28], 3, 12)).tokens, 0);
    assert_eq!(h.probe(&y).tokens, 48);
}

// ---------------------------------------------------------------------------------------------
// g. and l. decode tails

#[test]
fn a_decode_tail_snapshot_is_kept_privately_and_published_by_finish() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.prefill(1, &p);
    let sampled = tokens(9, 20);
    let plans = h.decode(1, &sampled);
    assert_eq!(plans.len(), 19);
    // Step k computes token 40 + k; a snapshot follows the steps that end on 44, 48, 52, 56.
    let snapshot_ends: Vec<u32> = plans
        .iter()
        .enumerate()
        .filter(|(_, plan)| !state(plan).snapshots.is_empty())
        .map(|(k, _)| 41 + k as u32)
        .collect();
    assert_eq!(snapshot_ends, vec![44, 48, 52, 56]);
    assert!(plans.iter().all(|plan| state(plan).max_checkpoints == 0));
    // Only the latest snapshot is kept: two running buffers and one snapshot.
    let usage = h.usage(1);
    assert_eq!((usage.owned, usage.cached), (3, 1));

    let mut next = p.clone();
    next.extend(&sampled);
    next.extend(tokens(10, 10));
    let hit = h.probe(&next);
    assert_eq!((hit.tokens, hit.groups[0].tokens), (36, 56), "private until finish");
    h.finish(1);
    assert_eq!(h.probe(&next).tokens, 56);
    assert_eq!(h.m.stats().groups[STATE].decode_tails_published, 1);
    assert_eq!(h.serve(2, &next), 56);
}

#[test]
fn a_published_decode_tail_is_evicted_before_prompt_tails() {
    // Five usable state blocks: two running buffers, the prompt tail and two snapshots (the
    // previous one is freed when the next commits).
    let mut h = Hybrid { state_blocks: 6, reserve_per_sequence: 0, ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.prefill(1, &p);
    let sampled = tokens(9, 20);
    h.decode(1, &sampled);
    h.finish(1);
    // Published: the prompt tail at 36 (released at its commit) and the decode tail at 56
    // (released later, at finish, but as least recently used).
    let usage = h.usage(1);
    assert_eq!((usage.cached, usage.free), (2, 3));
    // A running sequence takes two free blocks; a 4-token prompt (no checkpoint) needs two
    // running buffers: one free, one evicted.
    h.prefill(2, &tokens(2, 3));
    h.events();
    h.prefill(3, &tokens(3, 4));
    let evicted = removed(&h.events());
    assert_eq!(evicted.len(), 1);
    let mut conversation = p.clone();
    conversation.extend(&sampled);
    assert_eq!(evicted[0].2, vec![h.digest(&conversation, 56)]);
    assert_eq!(h.probe(&p).tokens, 36);
    assert_eq!(h.probe(&extend(&conversation, 3, 10)).tokens, 36);
}

#[test]
fn a_prompt_finished_right_after_its_prefill_takes_no_decode_tail() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    let (_, plan) = h.prefill(1, &p);
    assert!(state(&plan).snapshots.is_empty());
    h.append(1, &[7]); // sampled, never processed
    h.finish(1);
    assert_eq!(h.m.stats().groups[STATE].decode_tails_published, 0);
    let hit = h.probe(&extend(&p, 2, 20));
    assert_eq!(hit.tokens, 36);
}

#[test]
fn a_unit_boundary_inside_a_multi_token_decode_step_is_skipped_as_mid_step() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.prefill(1, &p);
    h.append(1, &[1, 2, 3, 4, 5, 6]);
    let (s, plan) = h.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (40, 6));
    assert!(state(&plan).snapshots.is_empty() && state(&plan).max_checkpoints == 0);
    assert_eq!(skipped(&h, SkipReason::MidStep), 1);
    // A multi-token decode step that ends on a boundary is snapshotted.
    h.append(1, &[7, 8]);
    let (_, plan) = h.step(1, ALL);
    assert_eq!(state(&plan).snapshots.len(), 2);
}

#[test]
fn preempt_publishes_nothing_new_and_keeps_published_checkpoints() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.prefill(1, &p);
    h.decode(1, &[1, 2, 3, 4, 5, 6]); // 45 computed: a private snapshot at 44
    assert_eq!(h.usage(1).owned, 3);
    let before = published(&h);
    h.preempt(1);
    assert_eq!(published(&h), before);
    assert_eq!(h.usage(1).owned, 0);
    assert_eq!(h.usage(1).checkpoints, 1, "the snapshot was freed, the prompt tail kept");
    assert_eq!(h.probe(&p).tokens, 36);
    // Rescheduled from a fresh lookup: the prompt tail, then everything after it.
    let (s, _) = h.step(1, ALL);
    assert_eq!((s.num_computed, s.num_tokens), (36, 10));
}

// ---------------------------------------------------------------------------------------------
// i. the checkpoint cap

#[test]
fn at_the_cap_a_pinned_checkpoint_is_never_displaced_and_the_lru_one_is() {
    let mut h = Hybrid { checkpoint_cap: Some(1), ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.serve(1, &p);
    assert_eq!(h.usage(1).checkpoints, 1);

    // Sequence 2 resumes from the only checkpoint; sequence 3 wants its own tail.
    h.add(2, &p);
    h.add(3, &tokens(3, 40));
    assert_eq!(h.schedule(2, ALL).num_computed, 36);
    let s3 = h.schedule(3, ALL);
    assert_eq!(s3.num_tokens, 40, "checkpoints never refuse a schedule");
    let plan = h.plan();
    assert_eq!(plan.seq_ids, vec![2, 3]);
    assert_eq!(state(&plan).max_checkpoints, 0);
    assert_eq!(skipped(&h, SkipReason::Budget), 1);
    h.commit(&plan);
    h.finish(2);
    h.finish(3);
    assert_eq!(h.probe(&p).tokens, 36);
    assert_eq!(h.probe(&tokens(3, 40)).tokens, 0);

    // Once released, the old checkpoint is the one the next new checkpoint evicts.
    h.events();
    let (_, plan) = h.prefill(4, &tokens(4, 40));
    assert_eq!(state(&plan).checkpoint_offsets, vec![36]);
    let evicted = removed(&h.events());
    assert_eq!(evicted, vec![(1, evicted[0].1, vec![h.digest(&p, 36)])]);
    h.finish(4);
    assert_eq!(h.usage(1).checkpoints, 1);
    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.groups[0].tokens), (0, 36));
    assert_eq!(h.probe(&tokens(4, 40)).tokens, 36);
}

#[test]
fn the_reserve_for_running_sequences_skips_checkpoints_with_budget() {
    // Five usable state blocks, two sequences running (four buffers), reserve of 2 each.
    let mut h = Hybrid { state_blocks: 6, ..Hybrid::default() }.harness();
    h.add(1, &tokens(1, 40));
    h.add(2, &tokens(2, 40));
    h.schedule(1, ALL);
    h.schedule(2, ALL);
    let plan = h.plan();
    assert_eq!(plan.num_rows(), 2);
    assert_eq!(state(&plan).max_checkpoints, 0);
    h.commit(&plan);
    assert_eq!(skipped(&h, SkipReason::Budget), 2);
    // With one sequence running, one block is spare beyond its reserve.
    h.finish(2);
    h.finish(1);
    let (_, plan) = h.prefill(3, &tokens(3, 40));
    assert_eq!(state(&plan).checkpoint_offsets, vec![36]);
}

// ---------------------------------------------------------------------------------------------
// j. abort

#[test]
fn an_aborted_step_publishes_none_of_its_checkpoints_and_frees_their_blocks() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    h.schedule(1, ALL);
    h.call(|m| m.request_checkpoint(1, 16)).unwrap();
    let plan = h.plan();
    assert_eq!(state(&plan).checkpoint_offsets, vec![16, 36]);
    assert_eq!(h.usage(1).owned, 4);
    h.abort(&plan);
    let usage = h.usage(1);
    assert_eq!((usage.owned, usage.checkpoints, usage.cached), (0, 0, 0));
    assert_eq!(published(&h), 0);
    assert_eq!(h.probe(&p).tokens, 0);
    assert_eq!(h.probe(&extend(&p[..16], 2, 20)).tokens, 0);
    assert!(stored(&h.events()).is_empty());
    h.step(1, ALL);
    h.finish(1);
    assert_eq!(h.probe(&p).tokens, 36);
}

#[test]
fn an_aborted_decode_step_keeps_the_running_state_and_the_previous_snapshot() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.prefill(1, &p);
    h.decode(1, &[1, 2, 3, 4, 5, 6, 7, 8]); // 47 computed, snapshot at 44
    h.schedule(1, 1);
    let aborted = h.plan();
    assert_eq!(state(&aborted).snapshots.len(), 2, "the step ending on 48 snapshots");
    let usage = h.usage(1);
    h.abort(&aborted);
    assert_eq!(h.usage(1).owned, usage.owned - 1);
    assert_eq!(h.m.num_computed(1), Ok(47));
    h.schedule(1, 1);
    let again = h.plan();
    assert_eq!(state(&again).initial_slot, state(&aborted).initial_slot);
    assert_eq!(state(&again).running_slot, state(&aborted).running_slot);
    h.abort(&again);
    // Finishing now publishes the snapshot at 44, the last one a step committed.
    h.finish(1);
    let mut conversation = p.clone();
    conversation.extend([1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(h.probe(&extend(&conversation, 3, 4)).tokens, 44);
}

// ---------------------------------------------------------------------------------------------
// k. C = 0

#[test]
fn with_no_interior_checkpoints_suggest_chunk_ends_the_chunk_on_the_tail() {
    let mut h = Hybrid { max_checkpoints: Some(0), ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.add(1, &p);
    assert_eq!(h.call(|m| m.suggest_chunk(1, ALL)), Ok(36));
    assert_eq!(h.call(|m| m.suggest_chunk(1, 20)), Ok(20), "no retained position in reach");
    let (s, plan) = h.step(1, 36);
    assert_eq!(s.num_tokens, 36);
    let st = state(&plan);
    assert_eq!(st.max_checkpoints, 0);
    assert_eq!(st.snapshots.len(), 2);
    assert_eq!(st.snapshots[0], st.running_slot[0]);
    assert_eq!(h.call(|m| m.suggest_chunk(1, ALL)), Ok(4));
    h.step(1, ALL);
    h.finish(1);
    assert_eq!(h.probe(&p).tokens, 36);
}

#[test]
fn with_no_interior_checkpoints_one_whole_chunk_loses_the_tail_to_capacity() {
    let mut h = Hybrid { max_checkpoints: Some(0), ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    let (_, plan) = h.prefill(1, &p);
    assert_eq!(state(&plan).max_checkpoints, 0);
    assert_eq!(skipped(&h, SkipReason::Capacity), 1);
    h.finish(1);
    assert_eq!(h.probe(&p).tokens, 0);
}

#[test]
fn with_interior_checkpoints_suggest_chunk_leaves_the_budget_alone() {
    let mut h = Hybrid::default().harness();
    h.add(1, &tokens(1, 40));
    assert_eq!(h.call(|m| m.suggest_chunk(1, ALL)), Ok(40));
    assert_eq!(h.call(|m| m.suggest_chunk(1, 24)), Ok(24));
}

// ---------------------------------------------------------------------------------------------
// m. a growing conversation under a cap of two checkpoints

#[test]
fn under_a_cap_decode_tails_never_evict_prompt_tails_and_every_round_hits_the_last_one() {
    let mut h = Hybrid { checkpoint_cap: Some(2), ..Hybrid::default() }.harness();
    let mut prompt = tokens(1, 20);
    let mut previous_tail = 0;
    for round in 0..8u32 {
        let id = u64::from(round) + 1;
        h.add(id, &prompt);
        let hit = h.lookup(id);
        assert_eq!(hit.tokens, previous_tail, "round {round}");
        let (s, _) = h.step(id, ALL);
        assert_eq!(s.num_computed, previous_tail);
        h.events();
        h.decode(id, &tokens(100 + round, 12));
        let evicted = removed(&h.events());
        assert!(evicted.iter().all(|e| e.0 != 1), "round {round}: {evicted:?}");
        previous_tail = tail(prompt.len());
        let next = extend(&prompt, 200 + round, 12);
        assert_eq!(h.probe(&next).tokens, previous_tail, "round {round}, before finish");
        h.finish(id);
        prompt = next;
    }
    assert!(skipped(&h, SkipReason::Budget) > 0, "the cap did bind");
}

// ---------------------------------------------------------------------------------------------
// Other retention rules and reasons

#[test]
fn interval_positions_come_after_the_tail_latest_first() {
    let retention = Retention { interval: Some(16), ..Retention::default() };
    let mut h = Hybrid { retention: retention.clone(), ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    let (_, plan) = h.prefill(1, &p);
    assert_eq!(state(&plan).checkpoint_offsets, vec![32, 36]);
    assert_eq!(skipped(&h, SkipReason::Capacity), 1, "16 is third in line");

    let mut h = Hybrid { retention, max_checkpoints: None, ..Hybrid::default() }.harness();
    let (_, plan) = h.prefill(1, &p);
    assert_eq!(state(&plan).checkpoint_offsets, vec![16, 32, 36]);
    h.finish(1);
    assert_eq!(h.probe(&extend(&p[..20], 2, 20)).tokens, 16);
}

#[test]
fn a_position_already_published_for_the_prefix_is_skipped_as_already_cached() {
    // The attention pool holds one prompt: another prompt evicts its blocks, not its state.
    let mut h = Hybrid { attention_blocks: 4, ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.serve(1, &p);
    h.serve(2, &tokens(2, 48));
    // The state at 36 survives, but above the attention bound (0) it is no hit of its group:
    // own hits are searched below the bound.
    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.groups[0].tokens, hit.groups[1].tokens), (0, 0, 0));
    assert_eq!(hit.junction, None);
    let before = h.usage(1).checkpoints;
    let (_, plan) = h.prefill(3, &p);
    assert_eq!(state(&plan).max_checkpoints, 0);
    assert_eq!(skipped(&h, SkipReason::AlreadyCached), 1);
    h.finish(3);
    assert_eq!(h.usage(1).checkpoints, before);
    assert_eq!(h.probe(&p).tokens, 36);
}

#[test]
fn an_evicted_tail_checkpoint_is_reported_as_recently_evicted() {
    let mut h = Hybrid { checkpoint_cap: Some(1), ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.serve(1, &p);
    h.serve(2, &tokens(2, 40)); // its tail evicts p's at the cap
    let hit = h.probe(&p);
    assert_eq!((hit.tokens, hit.groups[0].tokens, hit.groups[1].tokens), (0, 36, 0));
    assert_eq!(hit.groups[1].stop, Some(MissReason::RecentlyEvicted));
    let never = h.probe(&tokens(3, 40));
    assert_eq!(never.groups[1].stop, Some(MissReason::NoStateAtPosition));
}

#[test]
fn the_running_state_is_double_buffered_across_steps() {
    let mut h = Hybrid::default().harness();
    h.add(1, &tokens(1, 40));
    let plans: Vec<StepPlan> = (0..4).map(|_| h.step(1, 8).1).collect();
    let read: Vec<i32> = plans.iter().map(|p| state(p).initial_slot[0]).collect();
    let written: Vec<i32> = plans.iter().map(|p| state(p).running_slot[0]).collect();
    assert_eq!(read[0], -1);
    assert_eq!(&read[1..], &written[..3], "each step reads what the previous one wrote");
    assert_ne!(written[0], written[1]);
    assert_eq!((written[0], written[1]), (written[2], written[3]));
}

#[test]
fn a_schedule_never_evicts_the_checkpoint_it_resumes_from_in_a_shared_pool() {
    // One pool for both groups. After three prompts, nothing is free: the pool is all cached
    // blocks (the first prompt's checkpoint least recently used) and one running sequence.
    let mut h = Hybrid { shared_pool: true, attention_blocks: 12, ..Hybrid::default() }.harness();
    let p = tokens(1, 40);
    h.serve(1, &p); // 3 attention blocks + 1 checkpoint cached
    h.serve(2, &tokens(2, 40)); // 4 more cached
    h.prefill(3, &tokens(3, 3)); // holds 1 attention block + 2 running buffers
    let usage = h.usage(0);
    assert_eq!((usage.free, usage.cached, usage.owned), (0, 8, 3));
    h.events();

    h.add(4, &p);
    let s = h.schedule(4, ALL);
    assert_eq!(s.num_computed, 36);
    let plan = h.plan();
    let resumed = state(&plan).initial_slot[0];
    let evicted = removed(&h.events());
    assert!(
        evicted.iter().all(|e| e.1 as i32 != resumed),
        "the resumed checkpoint {resumed} was evicted: {evicted:?}"
    );
    assert!(plan.copies.chunks(4).all(|c| c[2] != i64::from(resumed)));
    h.commit(&plan);
}

#[test]
fn the_checkpoint_resumed_from_is_released_before_the_new_ones_are_published() {
    // Cap 3: x keeps 16 and 36; y resumes from 16 and adds its junction (32) and tail (48).
    let mut h = Hybrid { checkpoint_cap: Some(3), ..Hybrid::default() }.harness();
    let x = tokens(1, 40);
    h.add(1, &x);
    h.schedule(1, ALL);
    h.call(|m| m.request_checkpoint(1, 16)).unwrap();
    let plan = h.plan();
    h.commit(&plan);
    h.finish(1);
    let y = extend(&x[..32], 2, 18);
    h.add(2, &y);
    let s = h.schedule(2, ALL);
    assert_eq!((s.num_computed, s.hit.and_then(|hit| hit.junction)), (16, Some(32)));
    let plan = h.plan();
    assert_eq!(state(&plan).checkpoint_offsets, vec![16, 32], "junction 32, tail 48");
    h.commit(&plan);
    h.finish(2);
    // At the cap, a new tail evicts the least recently used checkpoint: the one y resumed
    // from (released first at y's commit), not y's newer ones.
    h.events();
    h.serve(3, &tokens(3, 40));
    let evicted = removed(&h.events());
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0].2, vec![h.digest(&x, 16)]);
    assert_eq!(h.probe(&y).tokens, 48);
    assert_eq!(h.probe(&extend(&y[..32], 4, 20)).tokens, 32);
}

#[test]
fn beyond_the_cap_a_decode_tail_displaces_only_another_decode_tail() {
    let mut h = Hybrid { checkpoint_cap: Some(3), ..Hybrid::default() }.harness();
    let a = tokens(1, 40);
    h.prefill(1, &a);
    let a_sampled = tokens(11, 20);
    h.decode(1, &a_sampled);
    h.finish(1); // checkpoints: a's tail at 36, a's decode tail at 56
    let mut a_conversation = a.clone();
    a_conversation.extend(&a_sampled);
    assert_eq!(h.probe(&extend(&a_conversation, 12, 10)).tokens, 56);

    let b = tokens(2, 40);
    h.prefill(2, &b); // b's tail at 36: the third checkpoint
    h.events();
    h.decode(2, &tokens(21, 10)); // snapshots due at 44 and 48
    let evicted = removed(&h.events());
    assert_eq!(evicted.len(), 1, "{evicted:?}");
    assert_eq!(evicted[0].2, vec![h.digest(&a_conversation, 56)]);
    assert!(skipped(&h, SkipReason::Budget) >= 1, "the second snapshot finds nothing to evict");
    assert_eq!(h.probe(&a).tokens, 36);
    assert_eq!(h.probe(&b).tokens, 36);
    assert_eq!(h.probe(&extend(&a_conversation, 12, 10)).tokens, 36);
}

#[test]
fn an_explicit_request_in_a_decode_step_is_published_at_commit() {
    let mut h = Hybrid::default().harness();
    let p = tokens(1, 40);
    h.prefill(1, &p);
    h.decode(1, &[1, 2, 3, 4, 5, 6, 7, 8]); // 47 computed, 48 tokens
    h.schedule(1, 1);
    h.call(|m| m.request_checkpoint(1, 48)).expect("the end of a decode step");
    let plan = h.plan();
    assert_eq!(state(&plan).snapshots.len(), 2);
    h.commit(&plan);
    let mut conversation = p.clone();
    conversation.extend([1, 2, 3, 4, 5, 6, 7, 8]);
    assert_eq!(h.probe(&extend(&conversation, 2, 4)).tokens, 48, "visible before finish");
}

#[test]
fn checkpoint_arrays_are_padded_to_the_row_with_the_most_checkpoints() {
    let mut h = Hybrid::default().harness();
    let x = tokens(1, 40);
    h.add(1, &x);
    h.add(2, &tokens(2, 10));
    h.add(3, &tokens(3, 40));
    h.schedule(1, ALL);
    h.schedule(2, ALL);
    h.schedule(3, 36); // ends on its own tail: a snapshot, no interior checkpoint
    h.call(|m| m.request_checkpoint(1, 16)).unwrap();
    let plan = h.plan();
    let st = state(&plan);
    assert_eq!(st.max_checkpoints, 2);
    assert_eq!(
        rows(&st.checkpoint_offsets, 2),
        vec![vec![16, 36], vec![8, 0], vec![0, 0]],
        "row 2's tail is at 8 (10 tokens)"
    );
    let slots = rows(&st.checkpoint_slots, 2);
    assert!(slots[0].iter().chain(&slots[1][..1]).all(|&s| s > 0));
    assert_eq!((slots[1][1], slots[2].clone()), (-1, vec![-1, -1]));
    assert_eq!(st.snapshots.len(), 2);
    assert_eq!(st.snapshots[0], st.running_slot[2]);
    assert_eq!(st.initial_slot, vec![-1, -1, -1]);
    // Three running buffers, three interior checkpoints and one snapshot: seven blocks.
    let distinct: std::collections::BTreeSet<i32> = st
        .running_slot
        .iter()
        .chain(slots.iter().flatten())
        .chain(&st.snapshots[1..])
        .copied()
        .filter(|&s| s > 0)
        .collect();
    assert_eq!(distinct.len(), 7, "every slot is its own block");
    h.commit(&plan);
}
