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
//! model recorded for it. From those sets it recomputes every hit by the DESIGN rule, candidate
//! by candidate, and compares it with `lookup` (reconciled hit, per-group hits and stop reasons,
//! junction) for every live sequence after every call, and with the hit each first `schedule`
//! used; every hit must also rest only on keys that committed steps published. Checkpoints
//! (which positions have a state) are predicted position by position and compared with the plan
//! and the skip counters. Block accounting (free blocks before cached ones, pins, evictions) is
//! checked against `pool_usage`, the engine's incremental block tables against `block_table`,
//! and `check_invariants` runs after every call.
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

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

use crate::ops::{ops, Op};
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
const PATHS: [&str; 38] = [
    "add reused hashes",
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

#[test]
fn model_traffic_reaches_every_path() {
    let mut runner = TestRunner::deterministic();
    let setups = prop_oneof![
        setup::full_attention(false),
        setup::hybrid(false),
        setup::sliding_window(false),
    ];
    let mut seen: BTreeMap<&str, u64> = BTreeMap::new();
    for case in 0..192 {
        let setup = setups.new_tree(&mut runner).map(|t| t.current());
        let ops = ops().new_tree(&mut runner).map(|t| t.current());
        let (Ok(setup), Ok(ops)) = (setup, ops) else { panic!("cannot generate case {case}") };
        match run(&setup, &ops) {
            Ok(paths) => paths.into_iter().for_each(|(p, n)| *seen.entry(p).or_default() += n),
            Err(e) => panic!("case {case} failed: {e}\n{setup:?}\n{ops:?}"),
        }
    }
    let missing: Vec<&str> = PATHS.into_iter().filter(|p| !seen.contains_key(p)).collect();
    assert!(missing.is_empty(), "never reached: {missing:?}\nreached: {seen:?}");
    if std::env::var_os("MODEL_TRACE").is_some() {
        eprintln!("{seen:#?}");
    }
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
        ],
        ops in ops(),
    ) {
        run(&setup, &ops).map_err(TestCaseError::fail)?;
    }
}
