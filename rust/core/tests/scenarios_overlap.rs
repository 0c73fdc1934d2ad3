//! Scenario tests of overlapped steps (`max_steps_in_flight` = D > 1), one or more per rule,
//! through the public API only; every call goes through `Harness`, which runs
//! `check_invariants` after it.
//!
//! The rules, stated here independently of the code: plans end in the order they were built
//! and `build_plan` is refused at D plans in flight; a sequence in an in-flight step may be
//! scheduled again, its chunk starting where the in-flight one ends, reading the running state
//! that step writes (j in-flight steps: j + 1 running blocks per state group, two at rest);
//! placeholder tokens count in a sequence's length but a key is published only once the step
//! that computed it committed and every token of its prefix is known, whichever comes last;
//! aborting the oldest plan ends every later one and returns every sequence they touched to
//! where it stood, placeholders appended since included; finish and preempt with steps in
//! flight release the blocks when the last step ends; lookup reports the hit pending plans
//! will make possible and the plan it waits for, and schedule never uses it.

mod common;

use common::{extend, full_attention, stored, tokens, Harness, Hybrid, ALL, B, U};
use prefixcache_core::{CacheConfig, CacheError, ExtraKeys, StepPlan};

fn overlapped(config: CacheConfig, depth: u32) -> Harness {
    Harness::new(CacheConfig { max_steps_in_flight: depth, ..config })
}

fn step_error<T: std::fmt::Debug>(r: Result<T, CacheError>) -> String {
    match r {
        Err(CacheError::Step { message }) => message,
        other => panic!("expected a step error, got {other:?}"),
    }
}

fn build(h: &mut Harness) -> StepPlan {
    h.call(prefixcache_core::CacheManager::build_plan).expect("build_plan")
}

#[test]
fn max_steps_in_flight_is_validated() {
    for bad in [0, prefixcache_core::limits::MAX_STEPS_IN_FLIGHT + 1] {
        let config = CacheConfig { max_steps_in_flight: bad, ..full_attention(B, U, 64) };
        let e = prefixcache_core::CacheManager::new(config).unwrap_err();
        assert!(
            matches!(&e, CacheError::Config { message } if message.contains("max_steps_in_flight")),
            "{e}"
        );
    }
}

#[test]
fn plans_end_in_build_order_and_build_plan_is_refused_at_d() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    for id in 1..=3 {
        h.add(id, &tokens(id as u32, 20));
    }
    h.schedule(1, ALL);
    let first = build(&mut h);
    h.schedule(2, ALL);
    let second = build(&mut h);
    h.schedule(3, ALL);
    let refused = step_error(h.call(prefixcache_core::CacheManager::build_plan));
    assert!(refused.contains(&format!("step {}", first.step_id)), "{refused}");
    assert_eq!(h.m.plans_in_flight(), vec![first.step_id, second.step_id]);
    let out_of_order = step_error(h.call(|m| m.commit(&second)));
    assert!(out_of_order.contains(&format!("step {}", first.step_id)), "{out_of_order}");
    let out_of_order = step_error(h.call(|m| m.abort(&second)));
    assert!(out_of_order.contains(&format!("step {}", first.step_id)), "{out_of_order}");
    h.commit(&first);
    let third = build(&mut h);
    h.commit(&second);
    h.commit(&third);
    assert!(matches!(h.call(|m| m.commit(&first)), Err(CacheError::StalePlan { .. })));
    for id in 1..=3 {
        assert_eq!(h.m.num_computed(id).unwrap(), 20);
    }
}

#[test]
fn with_d_1_every_classic_refusal_stays() {
    let mut h = Harness::new(full_attention(B, U, 64));
    h.add(1, &tokens(1, 20));
    h.add(2, &tokens(2, 20));
    h.schedule(1, 8);
    let plan = build(&mut h);
    step_error(h.call(|m| m.schedule(1, 4, 0, false)));
    step_error(h.call(|m| m.schedule(2, 4, 0, false)));
    step_error(h.call(|m| m.append_placeholders(2, 1)));
    step_error(h.call(|m| m.finish(2)));
    step_error(h.call(|m| m.preempt(1)));
    step_error(h.call(prefixcache_core::CacheManager::build_plan));
    assert_eq!(h.call(|m| m.abort(&plan)).unwrap(), vec![plan.step_id]);
}

#[test]
fn a_continuation_starts_where_the_in_flight_chunk_ends() {
    let mut h = overlapped(full_attention(B, U, 64), 3);
    let prompt = tokens(1, 40);
    h.add(1, &prompt);
    assert_eq!(h.schedule(1, 16).num_tokens, 16);
    let first = build(&mut h);
    let next = h.schedule(1, 16);
    assert_eq!((next.num_computed, next.num_tokens), (16, 16));
    let second = build(&mut h);
    let last = h.schedule(1, 16);
    assert_eq!((last.num_computed, last.num_tokens), (32, 8));
    let third = build(&mut h);
    assert_eq!(h.m.num_computed(1).unwrap(), 0, "nothing committed yet");
    assert_eq!((second.num_computed[0], third.num_computed[0]), (16, 32));
    assert_eq!(third.paged[0].slot_mapping.len(), 8);
    for plan in [&first, &second, &third] {
        h.commit(plan);
    }
    assert_eq!(h.m.num_computed(1).unwrap(), 40);
    h.finish(1);
    assert_eq!(h.probe(&prompt).tokens, 36);
}

#[test]
fn a_sequence_at_depth_d_is_refused_one_step_more() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    h.add(1, &tokens(1, 40));
    h.schedule(1, 8);
    let a = build(&mut h);
    h.schedule(1, 8);
    let _b = build(&mut h);
    let e = step_error(h.call(|m| m.schedule(1, 8, 0, false)));
    assert!(e.contains("max_steps_in_flight = 2"), "{e}");
    h.commit(&a);
    assert_eq!(h.schedule(1, 8).num_computed, 16);
}

#[test]
fn deep_steps_chain_running_states_and_give_extra_buffers_back_at_rest() {
    let hybrid = Hybrid::default();
    let mut h = overlapped(hybrid.config(), 3);
    h.add(1, &tokens(1, 9));
    h.step(1, ALL);
    let at_rest = h.usage(1).owned;
    let mut plans = Vec::new();
    for _ in 0..3 {
        h.call(|m| m.append_placeholders(1, 1)).unwrap();
        h.schedule(1, 1);
        plans.push(build(&mut h));
    }
    // Each step reads what the one before writes; all write distinct buffers.
    let (run, init): (Vec<i32>, Vec<i32>) =
        plans.iter().map(|p| (p.state[0].running_slot[0], p.state[0].initial_slot[0])).unzip();
    assert_eq!(init[1], run[0]);
    assert_eq!(init[2], run[1]);
    assert!(run[0] != run[1] && run[1] != run[2] && run[0] != run[2]);
    assert_ne!(init[0], run[2], "the committed state is not overwritten");
    // Three in flight: four running blocks (and any decode-tail snapshots planned).
    let planned: usize = plans.iter().map(|p| p.state[0].snapshots.len() / 2).sum();
    assert_eq!(h.usage(1).owned as usize, at_rest as usize + 2 + planned);
    for plan in &plans {
        h.commit(plan);
    }
    h.call(|m| m.resolve(1, &[7, 8, 9])).unwrap();
    // Two running buffers again, and the private decode-tail snapshot the last step took.
    assert_eq!(planned, 1, "a decode tail at 12");
    assert_eq!(h.usage(1).owned, at_rest + 1);
    h.finish(1);
    assert_eq!(h.usage(1).owned, 0);
}

#[test]
fn a_key_over_a_placeholder_is_published_by_resolve_after_the_commit() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    let prompt = tokens(1, 7);
    h.add(1, &prompt);
    h.schedule(1, ALL);
    let prefill = build(&mut h);
    // Step 2 computes the token step 1 is sampling: a placeholder.
    h.call(|m| m.append_placeholders(1, 1)).unwrap();
    assert_eq!(h.m.num_tokens(1).unwrap(), 8);
    assert_eq!(h.schedule(1, ALL).num_tokens, 1);
    let decode = build(&mut h);
    h.commit(&prefill);
    h.events();
    h.commit(&decode);
    assert!(stored(&h.events()).is_empty(), "the unit [4, 8) holds an unknown token");
    let mut full = prompt.clone();
    full.push(77);
    full.push(78);
    assert_eq!(h.probe(&full).tokens, 4);
    h.call(|m| m.resolve(1, &[77])).unwrap();
    let events = stored(&h.events());
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!((events[0].4, events[0].5), (4, 8));
    assert_eq!(h.probe(&full).tokens, 8);
}

#[test]
fn a_key_whose_tokens_are_known_first_is_published_at_the_commit() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    let prompt = tokens(1, 7);
    h.add(1, &prompt);
    h.schedule(1, ALL);
    let prefill = build(&mut h);
    h.call(|m| m.append_placeholders(1, 1)).unwrap();
    h.schedule(1, ALL);
    let decode = build(&mut h);
    h.commit(&prefill);
    h.call(|m| m.resolve(1, &[77])).unwrap();
    h.events();
    let mut full = prompt.clone();
    full.extend([77, 78]);
    assert_eq!(h.probe(&full).tokens, 4, "not before its step commits");
    h.commit(&decode);
    assert_eq!(stored(&h.events()).len(), 1);
    assert_eq!(h.probe(&full).tokens, 8);
}

#[test]
fn resolve_and_append_refuse_what_the_placeholders_do_not_allow() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    h.add(1, &tokens(1, 7));
    h.call(|m| m.append_placeholders(1, 2)).unwrap();
    let e = h.call(|m| m.resolve(1, &[1, 2, 3]));
    assert!(matches!(e, Err(CacheError::InvalidRequest { .. })), "{e:?}");
    assert_eq!(h.m.num_placeholders(1).unwrap(), 2, "a refused resolve changes nothing");
    step_error(h.call(|m| m.append(1, &[5])));
    let e = h.call(|m| m.resolve_batch(&[1, 1], &[1, 2]));
    assert!(e.is_err(), "a sequence twice in one batch");
    h.call(|m| m.resolve_batch(&[1], &[1])).unwrap();
    h.call(|m| m.resolve(1, &[2])).unwrap();
    assert_eq!((h.m.num_placeholders(1).unwrap(), h.m.num_tokens(1).unwrap()), (0, 9));
    h.append(1, &[5]);
}

#[test]
fn abort_of_the_oldest_plan_ends_every_later_one_and_rewinds_their_sequences() {
    let mut h = overlapped(Hybrid::default().config(), 3);
    let prompt = tokens(1, 9);
    h.add(1, &prompt);
    h.add(2, &tokens(2, 30));
    h.step(1, ALL);
    let (usage, before) = ((h.usage(0), h.usage(1)), h.m.stats());
    h.events();
    let mut plans = Vec::new();
    for round in 0..3 {
        h.call(|m| m.append_placeholders(1, 1)).unwrap();
        h.schedule(1, 1);
        if round == 0 {
            h.schedule(2, 8);
        }
        plans.push(build(&mut h));
    }
    // Not the oldest: refused, naming it.
    let e = step_error(h.call(|m| m.abort(&plans[1])));
    assert!(e.contains(&format!("step {}", plans[0].step_id)), "{e}");
    let ended = h.call(|m| m.abort(&plans[0])).unwrap();
    assert_eq!(ended, plans.iter().map(|p| p.step_id).collect::<Vec<_>>());
    assert!(h.m.plans_in_flight().is_empty());
    assert_eq!(h.m.num_computed(1).unwrap(), 9);
    // The placeholder appended before the oldest plan was built stands for the token the
    // committed prefill sampled: it stays; those appended since are gone.
    assert_eq!((h.m.num_tokens(1).unwrap(), h.m.num_placeholders(1).unwrap()), (10, 1));
    assert_eq!(h.m.num_computed(2).unwrap(), 0);
    assert_eq!((h.usage(0), h.usage(1)), usage);
    assert!(stored(&h.events()).is_empty(), "nothing any of them wrote is visible");
    assert_eq!(h.m.stats().aborts, before.aborts + 3);
    for plan in &plans {
        assert!(matches!(h.call(|m| m.commit(plan)), Err(CacheError::StalePlan { .. })));
    }
    // The manager is usable: the first of those steps again (over the placeholder kept).
    assert_eq!(h.schedule(1, 1).num_tokens, 1);
    let again = build(&mut h);
    h.commit(&again);
    assert_eq!(h.m.num_computed(1).unwrap(), 10);
}

#[test]
fn an_abort_after_a_commit_keeps_what_the_committed_step_sampled() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    h.add(1, &tokens(1, 7));
    h.schedule(1, ALL);
    let prefill = build(&mut h);
    h.call(|m| m.append_placeholders(1, 1)).unwrap();
    h.schedule(1, 1);
    let decode = build(&mut h);
    h.commit(&prefill);
    h.call(|m| m.resolve(1, &[42])).unwrap();
    assert_eq!(h.call(|m| m.abort(&decode)).unwrap(), vec![decode.step_id]);
    assert_eq!((h.m.num_computed(1).unwrap(), h.m.num_tokens(1).unwrap()), (7, 8));
}

#[test]
fn a_sequence_finished_in_flight_is_released_when_its_last_step_ends() {
    let mut h = overlapped(Hybrid::default().config(), 2);
    let prompt = tokens(1, 20);
    h.add(1, &prompt);
    h.schedule(1, ALL);
    let plan = build(&mut h);
    h.finish(1);
    assert_eq!(h.m.num_sequences(), 0, "its id is free at once");
    assert!(h.usage(0).owned > 0, "its blocks stay until the step ends");
    // Its next turn can extend it already, and the id can be added again.
    let added = h.call(|m| m.add(2, &tokens(1, 24), ExtraKeys::default(), Some(1))).unwrap();
    assert!(added.extends_found);
    h.add(1, &tokens(3, 8));
    h.commit(&plan);
    assert_eq!(h.usage(0).owned, 0);
    assert_eq!(h.probe(&prompt).tokens, 16);
}

#[test]
fn a_sequence_aborted_after_its_finish_publishes_nothing() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    let prompt = tokens(1, 20);
    h.add(1, &prompt);
    h.schedule(1, ALL);
    let plan = build(&mut h);
    h.finish(1);
    h.events();
    h.call(|m| m.abort(&plan)).unwrap();
    assert!(stored(&h.events()).is_empty());
    assert_eq!(h.usage(0).owned, 0);
    assert_eq!(h.probe(&prompt).tokens, 0);
}

#[test]
fn a_sequence_preempted_in_flight_waits_for_its_step_then_holds_nothing() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    let prompt = tokens(1, 20);
    h.add(1, &prompt);
    h.schedule(1, 8);
    let plan = build(&mut h);
    h.preempt(1);
    step_error(h.call(|m| m.schedule(1, 8, 0, false)));
    h.commit(&plan);
    assert_eq!(h.usage(0).owned, 0);
    assert_eq!(h.m.num_computed(1).unwrap(), 0);
    let s = h.schedule(1, ALL);
    assert_eq!(s.num_computed, 8, "it resumes from what its step published");
}

#[test]
fn lookup_reports_the_pending_hit_and_schedule_never_pins_it() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    let prompt = tokens(1, 40);
    h.add(1, &prompt);
    h.schedule(1, ALL);
    let plan = build(&mut h);
    h.add(2, &prompt);
    let hit = h.lookup(2);
    assert_eq!((hit.tokens, hit.pending_tokens, hit.pending_plan), (0, 36, Some(plan.step_id)));
    let s = h.schedule(2, 4);
    assert_eq!(s.num_computed, 0, "schedule uses committed content only");
    let second = build(&mut h);
    h.commit(&plan);
    h.commit(&second);
    h.add(3, &prompt);
    let hit = h.lookup(3);
    assert_eq!((hit.tokens, hit.pending_tokens, hit.pending_plan), (36, 36, None));
}

#[test]
fn the_pending_hit_needs_the_latest_plan_it_reads() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    let prompt = tokens(1, 40);
    h.add(1, &prompt);
    h.schedule(1, 16);
    let a = build(&mut h);
    h.schedule(1, ALL);
    let b = build(&mut h);
    h.add(2, &prompt);
    let hit = h.lookup(2);
    assert_eq!((hit.pending_tokens, hit.pending_plan), (36, Some(b.step_id)));
    h.commit(&a);
    let hit = h.lookup(2);
    assert_eq!((hit.tokens, hit.pending_tokens, hit.pending_plan), (16, 36, Some(b.step_id)));
    h.commit(&b);
}

#[test]
fn blocks_for_sequence_counts_the_steps_in_flight() {
    let one = Hybrid::default().config();
    let two = CacheConfig { max_steps_in_flight: 2, ..one.clone() };
    let (a1, a2) =
        (one.blocks_for_sequence(0, 100).unwrap(), two.blocks_for_sequence(0, 100).unwrap());
    assert_eq!(a1, a2, "attention blocks do not depend on D");
    let (s1, s2) =
        (one.blocks_for_sequence(1, 100).unwrap(), two.blocks_for_sequence(1, 100).unwrap());
    assert!(s2 > s1, "a further running buffer and a further step's checkpoints: {s1} -> {s2}");
}

#[test]
fn withdraw_plan_ends_only_the_newest_plan() {
    let mut h = overlapped(full_attention(B, U, 64), 2);
    h.add(1, &tokens(1, 40));
    h.schedule(1, 8);
    let a = build(&mut h);
    h.schedule(1, 8);
    let b = build(&mut h);
    assert!(matches!(h.call(|m| m.withdraw_plan(a.step_id)), Err(CacheError::StalePlan { .. })));
    h.call(|m| m.withdraw_plan(b.step_id)).unwrap();
    assert_eq!(h.m.plans_in_flight(), vec![a.step_id]);
    h.commit(&a);
    assert_eq!(h.m.num_computed(1).unwrap(), 8);
}

/// The junction rule with a shared prefix still in flight: B shares 32 tokens with A and then
/// diverges. One step at a time, B is scheduled after A committed, its lookup shows the junction
/// at 32 and B's chunk checkpoints it, so a third request sharing the prefix resumes there.
/// Overlapped, B is scheduled while A's step (the prefix's only writer) is in flight: B's hit
/// stays 0 (schedule never uses pending content), but the junction at 32 is the same, and so
/// is C's hit once both committed.
#[test]
fn a_junction_against_a_prefix_in_flight_is_checkpointed_as_one_step_at_a_time() {
    let prefix = tokens(9, 32);
    let mut third = Vec::new();
    for overlap in [false, true] {
        let mut h = overlapped(Hybrid::default().config(), 2);
        h.add(1, &extend(&prefix, 1, 8));
        h.schedule(1, ALL);
        let first = build(&mut h);
        if !overlap {
            h.commit(&first);
        }
        h.add(2, &extend(&prefix, 2, 8));
        let hit = h.lookup(2);
        assert_eq!((hit.tokens, hit.junction), (0, Some(32)), "overlap = {overlap}");
        assert_eq!(hit.pending_tokens, 0, "A's own states are at 36 and 40, not B's");
        assert_eq!(h.schedule(2, ALL).num_computed, 0);
        let second = build(&mut h);
        // B's row starts at 0, so its checkpoint offsets are positions.
        let offsets = &second.state[0].checkpoint_offsets;
        assert!(offsets.contains(&32), "B checkpoints the junction: {offsets:?}");
        if overlap {
            h.commit(&first);
        }
        h.commit(&second);
        third.push(h.probe(&extend(&prefix, 3, 8)).tokens);
    }
    assert_eq!(third, vec![32, 32]);
}

/// A lookup's answer depends on the plans in flight (their keys count for `pending_tokens` and,
/// at D > 1, for the junction) even when nothing was published or evicted: a first schedule
/// after a plan was built or aborted since the sequence's last lookup must use the hit as it
/// stands now, not the one that lookup saw. Here B looks up while A's prefill of the shared
/// prefix is in flight (junction at 32), A's plan is aborted, and B's schedule still reported
/// that junction and checkpointed it although nobody computes that prefix; then, the
/// other way round, B looks up before A's plan is built and must still take the junction.
#[test]
fn a_first_schedule_uses_the_plans_in_flight_now_not_at_its_last_lookup() {
    let prefix = tokens(9, 32);
    let mut h = overlapped(Hybrid::default().config(), 2);
    h.add(1, &extend(&prefix, 1, 8));
    h.schedule(1, ALL);
    let first = build(&mut h);
    h.add(2, &extend(&prefix, 2, 8));
    let hit = h.lookup(2);
    assert_eq!(hit.junction, Some(32));
    h.call(|m| m.abort(&first)).unwrap();
    let hit = h.schedule(2, ALL).hit.expect("a first schedule reports its hit");
    assert_eq!((hit.tokens, hit.junction), (0, None));
    let plan = build(&mut h);
    let offsets = &plan.state[0].checkpoint_offsets;
    assert!(!offsets.contains(&32), "no junction at 32 once A's plan is gone: {offsets:?}");
    h.commit(&plan);

    let mut h = overlapped(Hybrid::default().config(), 2);
    h.add(1, &extend(&prefix, 1, 8));
    h.add(2, &extend(&prefix, 2, 8));
    assert_eq!(h.lookup(2).junction, None);
    h.schedule(1, ALL);
    let first = build(&mut h);
    let hit = h.schedule(2, ALL).hit.expect("a first schedule reports its hit");
    assert_eq!((hit.tokens, hit.junction), (0, Some(32)));
    let second = build(&mut h);
    let offsets = &second.state[0].checkpoint_offsets;
    assert!(offsets.contains(&32), "B checkpoints the junction: {offsets:?}");
    h.commit(&first);
    h.commit(&second);
}

/// The pending hit waits for the latest plan among those publishing a key it needs, and a state
/// group needs only its checkpoint at the hit. Plan 1 computes A's prompt with its tail
/// checkpoint at 8; plan 2 computes B, a 5-token prefix of A, with its tail at 4. C shares A's
/// first 8 tokens: its pending hit of 8 waits for plan 1 alone (it named plan 2, whose
/// checkpoint at 4 C does not resume from).
#[test]
fn a_pending_hit_waits_only_for_the_checkpoint_it_resumes_from() {
    let mut h = overlapped(Hybrid::default().config(), 2);
    h.add(1, &tokens(1, 9));
    h.schedule(1, ALL);
    let a = build(&mut h);
    h.add(2, &tokens(1, 5));
    h.schedule(2, ALL);
    let b = build(&mut h);
    assert_eq!(b.state[0].checkpoint_offsets[0], 4, "B checkpoints its tail");
    h.add(3, &tokens(1, 12));
    let hit = h.lookup(3);
    assert_eq!((hit.tokens, hit.pending_tokens, hit.pending_plan), (0, 8, Some(a.step_id)));
    h.commit(&a);
    let hit = h.lookup(3);
    assert_eq!((hit.tokens, hit.pending_tokens, hit.pending_plan), (8, 8, None));
    h.commit(&b);
}

/// Section 4's reserve at depth D (section 10) counts the running states a sequence may still
/// need: a further buffer per state group for each step beyond the first it may have in
/// flight. Two state groups sharing one pool need two per continuation, so checkpoints (here
/// every unit boundary, reserve 0 beyond the depth) must leave both continuations below room.
#[test]
fn checkpoints_leave_room_for_every_state_group_of_a_shared_pool_to_continue() {
    use prefixcache_core::{GroupConfig, GroupKind, PoolConfig, Retention, StateGroupConfig};
    let state = GroupKind::State(StateGroupConfig {
        alignment: 1,
        max_checkpoints_per_step: None,
        retention: Retention {
            tail: false,
            interval: Some(U),
            junction: false,
            decode_tail: false,
        },
        checkpoint_cap: None,
        reserve_per_sequence: 0,
    });
    let config = CacheConfig {
        pools: vec![PoolConfig { num_blocks: 256 }, PoolConfig { num_blocks: 24 }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: B }, pool: 0 },
            GroupConfig { kind: state.clone(), pool: 1 },
            GroupConfig { kind: state, pool: 1 },
        ],
        ..full_attention(B, U, 256)
    };
    let mut h = overlapped(config, 2);
    for id in [1, 2] {
        h.add(id, &tokens(id as u32, 40));
        h.schedule(id, 8);
    }
    let first = build(&mut h);
    h.commit(&first);
    // Both sequences continue (their spare buffers), and the plan's checkpoints take what the
    // reserve lets them.
    for id in [1, 2] {
        h.schedule(id, ALL);
    }
    let _second = build(&mut h);
    for id in [1, 2] {
        h.call(|m| m.append_placeholders(id, 1)).expect("append_placeholders");
        let next = h.try_schedule(id, 1);
        assert!(
            next.is_some(),
            "sequence {id}'s continuation was refused: the checkpoints took the running \
             buffers it needs ({:?})",
            h.usage(1)
        );
    }
}

/// Section 4's reserve is the pool's: checkpoints never make another sequence's `schedule`
/// fail, whichever group takes them. In one pool shared by full attention and two state groups
/// (as a unified hybrid allocator does), group A keeps one block per running sequence for the
/// next paged block of its continuation, group B none; B's checkpoints must still leave A's
/// promise (and both groups' running buffers at depth 2) untouched. 23 usable blocks: after
/// the second schedule each sequence owns 2 paged blocks and 4 running buffers, so 11 are
/// left; each continuation of one token takes a paged block and a running buffer per state
/// group, 3, so B's 8 wanted checkpoints may take 5, not the 7 B's own reserve would allow.
#[test]
fn checkpoints_of_one_state_group_keep_the_reserve_another_group_of_the_pool_promised() {
    use prefixcache_core::{GroupConfig, GroupKind, PoolConfig, Retention, StateGroupConfig};
    let state = |reserve_per_sequence, interval| {
        GroupKind::State(StateGroupConfig {
            alignment: 1,
            max_checkpoints_per_step: None,
            retention: Retention { tail: false, interval, junction: false, decode_tail: false },
            checkpoint_cap: None,
            reserve_per_sequence,
        })
    };
    let config = CacheConfig {
        pools: vec![PoolConfig { num_blocks: 24 }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: B }, pool: 0 },
            GroupConfig { kind: state(1, None), pool: 0 },
            GroupConfig { kind: state(0, Some(U)), pool: 0 },
        ],
        ..full_attention(B, U, 24)
    };
    let mut h = overlapped(config, 2);
    for id in [1, 2] {
        h.add(id, &tokens(id as u32, 40));
        h.schedule(id, B);
    }
    let first = build(&mut h);
    h.commit(&first);
    for id in [1, 2] {
        h.schedule(id, B);
    }
    let second = build(&mut h);
    let taken = second.state[1].checkpoint_slots.iter().filter(|&&s| s > 0).count()
        + second.state[1].snapshots.len() / 2;
    for id in [1, 2] {
        let next = h.try_schedule(id, 1);
        assert!(
            next.is_some(),
            "sequence {id}'s continuation was refused: group B's checkpoints took the block \
             group A's reserve kept for it ({:?})",
            h.usage(0)
        );
    }
    assert_eq!(taken, 5, "group B's checkpoints of the second step");
    h.commit(&second);
}

/// The plan a pending hit waits for is the latest among those publishing a key the hit needs
/// (section 10), and a sliding window needs only the blocks covering `[L - W, L)`: a key below
/// the window that a later plan recomputes must not make the hit wait for that plan. A's
/// window keys at 4 and 8 are evicted (its full-attention keys stay); D computes [12, 17) in
/// plan 1 (full attention and window keys at 16), E recomputes [0, 5) in plan 2 (the window
/// key at 4); C's pending hit of 16 waits for plan 1 only.
#[test]
fn a_pending_window_hit_does_not_wait_for_keys_below_the_window() {
    use prefixcache_core::{GroupConfig, GroupKind, PoolConfig};
    let config = CacheConfig {
        pools: vec![PoolConfig { num_blocks: 256 }, PoolConfig { num_blocks: 8 }],
        groups: vec![
            GroupConfig { kind: GroupKind::FullAttention { block_size: U }, pool: 0 },
            GroupConfig { kind: GroupKind::SlidingWindow { block_size: U, window: U }, pool: 1 },
        ],
        ..full_attention(U, U, 256)
    };
    let mut h = overlapped(config, 2);
    let a = tokens(1, 12);
    h.add(1, &a);
    h.schedule(1, ALL);
    let plan = build(&mut h);
    h.commit(&plan);
    h.finish(1);
    // B takes the 4 free window blocks and evicts A's two least recently used: keys 4 and 8.
    h.add(2, &tokens(2, 24));
    h.schedule(2, ALL);
    let plan = build(&mut h);
    h.commit(&plan);
    let c = extend(&a, 3, 12);
    h.add(3, &c);
    assert_eq!(h.lookup(3).tokens, 12, "the window keeps A's key at 12, its full attention all");
    h.add(4, &c[..17]);
    assert_eq!(h.schedule(4, ALL).num_computed, 12);
    let first = build(&mut h);
    h.add(5, &a[..5]);
    assert_eq!(h.schedule(5, ALL).num_computed, 0, "E's window misses the key at 4");
    let second = build(&mut h);
    let hit = h.lookup(3);
    assert_eq!(
        (hit.tokens, hit.pending_tokens, hit.pending_plan),
        (12, 16, Some(first.step_id)),
        "C waits for the plan computing [12, 16), not the one recomputing below its window"
    );
    h.commit(&first);
    h.commit(&second);
}
