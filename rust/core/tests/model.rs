//! Model-based property tests of the step protocol: random traffic (add with `extends`, lookup,
//! schedule with exact chunks, small budgets, lookahead and batches, `suggest_chunk`,
//! `request_checkpoint`, `build_plan`, commit, abort, stale commits, append, finish, preempt,
//! reset, whole engine steps and decode steps) on small pools, checked against a deliberately
//! naive reference model (`model/reference.rs`).
//!
//! The model keeps, per group, the published keys as token prefixes and which block carries
//! each. It predicts every key a commit publishes (unit boundaries of the chunk, copy-on-write
//! destinations, the checkpoints the plan wrote) and requires the `BlockStored` events to be
//! exactly those; a `BlockRemoved` event must name an unpinned block with exactly the keys the
//! model recorded for it. From those sets it recomputes every hit by its own statement of the
//! hit rule, candidate by candidate, and compares it with `lookup` (reconciled hit, per-group
//! hits and stop reasons, junction) for every live sequence after every call, and with the hit each first `schedule`
//! used; every hit must also rest only on keys that committed steps published. Checkpoints
//! (which positions have a state) are predicted position by position and compared with the plan
//! and the skip counters. Block accounting (free blocks before cached ones, pins, evictions) is
//! checked against `pool_usage`, the engine's incremental block tables against `block_table`,
//! and `check_invariants` runs after every call.
//!
//! Keys are prefix identities (`model/ident.rs`): the tokens, the cache salt, the `LoRA` id and
//! the hashes of the multimodal inputs on every unit. With extra keys in the traffic
//! (`model/extra.rs`) prompts are copied from other sequences with their images dropped, moved,
//! replaced or added, their salt or adapter changed, and extended by sequences that differ in
//! them; `add` must reuse digests only up to the earliest unit a differing extra key touches,
//! and refuse lists out of order or malformed, changing nothing. Several state groups may share
//! a pool with each other and with the paged group: each group's cap counts its own checkpoint
//! blocks only and evicts only its own, and a checkpoint that would leave its pool no more free
//! or evictable blocks than the reserve of the started sequences (the reserve every state
//! group of the pool asks for, whichever group checkpoints) is skipped (`budget`); both are
//! predicted checkpoint by checkpoint, not just tolerated. Hostile calls (`model/hostile.rs`)
//! pass values at and beyond the API's bounds.
//!
//! The `never_evicting` property uses pools that cannot run out: no eviction, refused schedule
//! or `budget` skip may happen there at all, so every prediction stands on the model alone.
//!
//! `MODEL_TRACE=1` prints every operation of every case as it runs.

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

#[path = "model/batch.rs"]
mod batch;
#[path = "model/extra.rs"]
mod extra;
#[path = "model/hostile.rs"]
mod hostile;
#[path = "model/ident.rs"]
mod ident;
#[path = "model/ops.rs"]
mod ops;
#[path = "model/plan.rs"]
mod plan;
#[path = "model/protocol.rs"]
mod protocol;
#[path = "model/recency.rs"]
mod recency;
#[path = "model/reference.rs"]
mod reference;
#[path = "model/setup.rs"]
mod setup;

use std::collections::BTreeMap;

use prefixcache_core::{Retention, StateGroupConfig};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

use crate::extra::ExtraOp;
use crate::ops::{ops, ops_with_extra_keys, AddOp, Op};
use crate::reference::Model;
use crate::setup::Setup;

/// Cases per property: 64 (about 20 s in all for a debug build on two cores), or
/// `PROPTEST_CASES` for a deeper run (`cargo test --release --test model`).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64)
}

/// Runs one case: every operation, `check_all` after each, then a wind-down that finishes
/// everything and requires every block to be free or cached. Returns how often each path ran.
fn run(setup: &Setup, ops: &[Op]) -> Result<BTreeMap<&'static str, u64>, String> {
    let mut model = Model::new(setup.clone())?;
    let trace = std::env::var_os("MODEL_TRACE").is_some();
    for (i, op) in ops.iter().enumerate() {
        if trace {
            eprintln!("op {i} {op:?}");
        }
        model.apply(op).map_err(|e| format!("op {i} {op:?}: {e}"))?;
        model.check_all().map_err(|e| format!("after op {i} {op:?}: {e}"))?;
    }
    model.wind_down().map_err(|e| format!("winding down: {e}"))?;
    Ok(model.seen)
}

/// What the random traffic must reach over a fixed sample of cases: a property whose generator
/// stopped reaching these would still pass, without testing them.
const PATHS: [&str; 40] = [
    "add reused hashes",
    "add_batch reused a request of its own batch",
    "add_batch refused all of its requests",
    "add reused a live prefix",
    "plan refilled in place",
    "hit",
    "verified hit above a unit nobody publishes",
    "junction",
    "group hit reaches the end",
    "stop not_cached",
    "stop recently_evicted",
    "stop no_state_at_position",
    "stop window_gap",
    "schedule",
    "schedule of 0 tokens",
    "schedule refused",
    "first schedule from a hit",
    "schedule evicted a block",
    "eviction ordered by recency",
    "hit used the copy in use",
    "hit used the most recent copy",
    "copy on write",
    "checkpoint requested",
    "checkpoint request off the grid",
    "interior checkpoint",
    "snapshot checkpoint",
    "decode-tail snapshot",
    "skip unaligned",
    "skip capacity",
    "skip already_cached",
    "skip budget",
    "skip mid_step",
    "chunk starts off the grid",
    "checkpoint evicted",
    "checkpoint cap evicted",
    "commit",
    "stale commit",
    "abort of a step",
    "finish published a decode tail",
    "window released blocks",
];

/// What the traffic with extra keys, several state groups and hostile values must reach too.
const EXTRA_PATHS: [&str; 22] = [
    "add reused hashes of a prompt with images",
    "add reuse stopped by an extra key",
    "add refused unsorted multimodal inputs",
    "add refused a malformed multimodal input",
    "add refused extra keys beyond a bound",
    "hit stopped by an image",
    "hit stopped by a salt or adapter",
    "cap evicted own checkpoint with a shared pool",
    "cap skipped a checkpoint",
    "reserve skipped a checkpoint",
    "checkpoint evicted another group's block",
    "checkpoint skipped in an exhausted pool",
    "lookahead beyond the limit",
    "lookahead beyond the limit refused",
    "lookahead at the limit",
    "checkpoint request past the end",
    "checkpoint request off the grid",
    "huge sequence id",
    "hostile call refused",
    "junction",
    "skip budget",
    "checkpoint cap evicted",
];

/// Runs `cases` generated cases of `setups` and `ops`, adding up the paths they took.
fn reach(
    runner: &mut TestRunner,
    setups: &BoxedStrategy<Setup>,
    ops: &BoxedStrategy<Vec<Op>>,
    cases: usize,
    seen: &mut BTreeMap<&'static str, u64>,
) {
    for case in 0..cases {
        let setup = setups.new_tree(runner).map(|t| t.current());
        let ops = ops.new_tree(runner).map(|t| t.current());
        let (Ok(setup), Ok(ops)) = (setup, ops) else { panic!("cannot generate case {case}") };
        match run(&setup, &ops) {
            Ok(paths) => paths.into_iter().for_each(|(p, n)| *seen.entry(p).or_default() += n),
            Err(e) => panic!("case {case} failed: {e}\n{setup:?}\n{ops:?}"),
        }
    }
}

#[test]
fn model_traffic_reaches_every_path() {
    let mut runner = TestRunner::deterministic();
    let setups = prop_oneof![
        setup::full_attention(false),
        setup::hybrid(false),
        setup::sliding_window(false),
    ]
    .boxed();
    let mut seen: BTreeMap<&str, u64> = BTreeMap::new();
    reach(&mut runner, &setups, &ops().boxed(), 192, &mut seen);
    let missing: Vec<&str> = PATHS.into_iter().filter(|p| !seen.contains_key(p)).collect();
    assert!(missing.is_empty(), "never reached: {missing:?}\nreached: {seen:?}");
    if std::env::var_os("MODEL_TRACE").is_some() {
        eprintln!("{seen:#?}");
    }
}

#[test]
fn traffic_with_extra_keys_and_several_state_groups_reaches_every_path() {
    let mut runner = TestRunner::deterministic();
    let setups = prop_oneof![
        1 => setup::full_attention(false),
        1 => setup::hybrid(false),
        3 => setup::several_state_groups(false),
    ]
    .boxed();
    let mut seen: BTreeMap<&str, u64> = BTreeMap::new();
    reach(&mut runner, &setups, &ops_with_extra_keys().boxed(), 128, &mut seen);
    let missing: Vec<&str> = EXTRA_PATHS.into_iter().filter(|p| !seen.contains_key(p)).collect();
    assert!(missing.is_empty(), "never reached: {missing:?}\nreached: {seen:?}");
    if std::env::var_os("MODEL_TRACE").is_some() {
        eprintln!("{seen:#?}");
    }
}

/// Runs `ops` on `setup` through the model, checking everything after each; returns the model.
fn scenario(setup: Setup, ops: &[Op]) -> Model {
    let mut model = Model::new(setup).unwrap();
    for (i, op) in ops.iter().enumerate() {
        model.apply(op).unwrap_or_else(|e| panic!("op {i} {op:?}: {e}"));
        model.check_all().unwrap_or_else(|e| panic!("after op {i} {op:?}: {e}"));
    }
    model
}

/// A setup of unit `unit` with `groups` over pools of `pools` blocks, nothing random.
fn fixed(unit: u32, groups: Vec<(setup::Kind, usize)>, pools: Vec<u32>) -> Setup {
    Setup {
        unit,
        algorithm: prefixcache_core::HashAlgorithm::Xxh3_128,
        seed: 0,
        verify_tokens: false,
        groups,
        pools,
        recent_capacity: 1 << 10,
        never_evicts: false,
        reuse_live_prefixes: true,
    }
}

fn state_group(cap: Option<u32>, retention: Retention) -> setup::Kind {
    setup::Kind::State(StateGroupConfig {
        alignment: 1,
        max_checkpoints_per_step: None,
        retention,
        checkpoint_cap: cap,
        reserve_per_sequence: 0,
    })
}

const STEP: Op = Op::Step { budget: u32::MAX, exact: false, request: None, abort: false };

/// A prompt copied from the sequence `source` names (see `Model::add`) with its extra keys
/// changed by `tweak`, or a fresh one with `images`.
fn prompt(source: u8, len: u8, extends: Option<u8>, extra: ExtraOp) -> Op {
    Op::Add(AddOp { source, len, suffix: 0, extends, reuse: None, twin: false, extra })
}

/// The case the model once missed: A has an image at [4, 8) (and one at [12, 16)); B, the same
/// text with only the later image, extends A, finished before it ran; a resend of A must then
/// hit B's blocks only up to the image's unit, whatever the reuse of A's digests did.
#[test]
fn extends_across_an_image_reuses_only_the_units_before_it() {
    let setup = Setup {
        unit: 4,
        algorithm: prefixcache_core::HashAlgorithm::Xxh3_128,
        seed: 0,
        verify_tokens: false,
        groups: vec![(setup::Kind::Full { block: 4 }, 0)],
        pools: vec![64],
        recent_capacity: 0,
        never_evicts: true,
        reuse_live_prefixes: true,
    };
    let images = ExtraOp { images: vec![(4, 4, 0), (12, 4, 1)], ..ExtraOp::none() };
    let drop_first = ExtraOp { inherit: true, tweak: 1, ..ExtraOp::none() };
    let same = ExtraOp { inherit: true, ..ExtraOp::none() };
    let ops = vec![
        // A: tokens 0..16 of base stream 0, images at [4, 8) and [12, 16); finished unrun.
        prompt(0, 16, None, images),
        Op::Finish { pick: 0 },
        // B: A's text with only the image at [12, 16), extending A.
        prompt(1, 16, Some(0), drop_first),
        STEP,
        // C: A again (B is live: the finished A is the second known sequence).
        prompt(1, 16, None, same),
        Op::Lookup { pick: 0 },
    ];
    let mut model = scenario(setup, &ops);
    let (&c, seq) = model.seqs.iter().next_back().unwrap();
    assert_eq!(seq.extra.multimodal.len(), 2, "C is a resend of A");
    let hit = model.m.lookup(c).unwrap();
    (model.stats.lookups, model.stats.lookup_hit_tokens) =
        (model.stats.lookups + 1, model.stats.lookup_hit_tokens + u64::from(hit.tokens));
    assert_eq!(hit.tokens, 4, "C hits B only before the image");
    assert!(model.seen.contains_key("add reuse stopped by an extra key"));
    assert!(model.seen.contains_key("hit stopped by an image"));
    model.wind_down().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn prop_full_attention_follows_the_model(
        setup in setup::full_attention(false),
        ops in ops(),
    ) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn prop_hybrid_state_follows_the_model(setup in setup::hybrid(false), ops in ops()) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn prop_sliding_window_follows_the_model(
        setup in setup::sliding_window(false),
        ops in ops(),
    ) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn prop_never_evicting_pools_follow_the_model_exactly(
        setup in prop_oneof![
            setup::full_attention(true),
            setup::hybrid(true),
            setup::sliding_window(true),
            setup::several_state_groups(true),
        ],
        ops in ops_with_extra_keys(),
    ) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn prop_extra_keys_follow_the_model(
        setup in prop_oneof![
            setup::full_attention(false),
            setup::hybrid(false),
            setup::sliding_window(false),
        ],
        ops in ops_with_extra_keys(),
    ) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }

    #[test]
    fn prop_several_state_groups_follow_the_model(
        setup in setup::several_state_groups(false),
        ops in ops_with_extra_keys(),
    ) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }
}

/// A checkpoint that survived above the full-attention bound (the attention blocks of its
/// prefix were evicted from their own pool) is neither the state group's hit nor a junction.
#[test]
fn a_state_above_the_attention_bound_is_no_hit_and_no_junction() {
    let retention = Retention { tail: true, interval: None, junction: true, decode_tail: false };
    let groups = vec![(setup::Kind::Full { block: 2 }, 0), (state_group(None, retention), 1)];
    let base = |source: u8| prompt(source, 20, None, ExtraOp::none());
    // A, then B evicting A's attention blocks tail first, then A again.
    let ops =
        [base(0), STEP, Op::Finish { pick: 0 }, base(4), STEP, Op::Finish { pick: 0 }, base(0)];
    let mut model = scenario(fixed(2, groups, vec![12, 64]), &ops);
    let (&id, _) = model.seqs.iter().next_back().unwrap();
    let hit = model.m.lookup(id).unwrap();
    (model.stats.lookups, model.stats.lookup_hit_tokens) =
        (model.stats.lookups + 1, model.stats.lookup_hit_tokens + u64::from(hit.tokens));
    assert_eq!((hit.groups[0].tokens, hit.groups[1].tokens, hit.junction), (2, 0, None));
    assert!(model.seen.contains_key("group hit bounded by full attention"));
    model.wind_down().unwrap();
}

/// At its cap a decode-tail snapshot displaces a published decode tail of its own group, here
/// in a pool it shares with a second state group and the attention blocks.
#[test]
fn a_decode_tail_at_the_cap_replaces_a_published_decode_tail() {
    let decode = Retention { tail: false, interval: None, junction: false, decode_tail: true };
    let other = Retention { tail: true, interval: None, junction: false, decode_tail: false };
    let groups = vec![
        (setup::Kind::Full { block: 2 }, 0),
        (state_group(Some(1), decode), 0),
        (state_group(Some(2), other), 0),
    ];
    let decode_twice = Op::Decode { len: 1, budget: u32::MAX, rounds: 2 };
    let ops = [
        prompt(0, 4, None, ExtraOp::none()),
        STEP,
        decode_twice.clone(),
        Op::Finish { pick: 0 },
        prompt(4, 4, None, ExtraOp::none()),
        STEP,
        decode_twice,
    ];
    let mut model = scenario(fixed(2, groups, vec![64]), &ops);
    assert!(model.seen.contains_key("decode tail replaced a decode tail at the cap"));
    model.wind_down().unwrap();
}
