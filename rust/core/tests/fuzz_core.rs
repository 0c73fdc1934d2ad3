//! A wide fuzz property over the core: random configurations (1 to 3 pools, 1 to 4 groups of
//! every kind, several state groups, shared pools, caps, windows, tiny pools, `verify_tokens`,
//! both hash algorithms, broken configurations) driven by every call of the API with raw
//! arguments (extra keys, `extends`, live reuse, lookahead, explicit checkpoints, batch calls,
//! `decode_step`, stale and foreign plans, ids and counts at and beyond their bounds). It
//! predicts little; after every call it checks what must hold whatever the traffic
//! (`fuzz_core/driver.rs`): `check_invariants`, errors that are typed and change nothing,
//! hits that rest only on prefixes some committed step computed with the same tokens and extra
//! keys, commits that store only what they computed, well-formed plans, plans that read only
//! what the engine wrote there (`fuzz_core/content.rs`: the driver plays the engine, writing
//! the KV, states and checkpoints each plan names), and no block left owned once everything
//! is finished. A second property (`fuzz_core/overlap.rs`) drives the same configurations at
//! `max_steps_in_flight` 1 to 3 with the overlapped steps' calls (placeholders, resolve, plans
//! ended in and out of order, cascading aborts, `decode_step_overlapped`, finish and preempt in
//! flight) and checks its own statement of their rules. The reference models (`model.rs`,
//! `model_overlap.rs`) predict everything, on narrower traffic.
//!
//! By default a handful of cases run (a few seconds in a debug build). For a long run:
//! `FUZZ_CASES=100000 cargo test --release -p prefixcache-core --test fuzz_core -- --nocapture`
//! (`FUZZ_OPS` the most operations per case, default 120; `FUZZ_SEED` the random seed, fixed
//! at 0 by default and drawn from the clock when `FUZZ_CASES` is set). The run prints its seed,
//! the cases and operations it executed and their rate; a failure prints the seed and the
//! shrunk case, and proptest records it in `fuzz_core.proptest-regressions`, replayed first by
//! every later run.

#[path = "model/extra.rs"]
#[allow(dead_code)]
mod extra;
#[path = "model/ident.rs"]
#[allow(dead_code)]
mod ident;

#[path = "fuzz_core/config.rs"]
mod config;
#[path = "fuzz_core/content.rs"]
mod content;
#[path = "fuzz_core/driver.rs"]
mod driver;
#[path = "fuzz_core/ops.rs"]
mod ops;
#[path = "fuzz_core/overlap.rs"]
mod overlap;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};

use crate::config::FuzzConfig;
use crate::driver::Fuzz;
use crate::ops::FuzzOp;

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Runs one case: the configuration (a broken one must be refused), every operation with its
/// checks, and the wind-down. Returns the calls made and the outcomes seen.
fn run(config: &FuzzConfig, ops: &[FuzzOp]) -> Result<(u64, BTreeMap<&'static str, u64>), String> {
    if let Some(rule) = config.broken {
        let r = prefixcache_core::CacheManager::new(config.config.clone());
        return match r {
            Err(prefixcache_core::CacheError::Config { .. }) => Ok((1, BTreeMap::new())),
            other => Err(format!("a configuration with {rule} gave {:?}", other.map(|_| ()))),
        };
    }
    let mut fuzz = Fuzz::new(config.config.clone())?;
    fuzz.check()?;
    for (i, op) in ops.iter().enumerate() {
        fuzz.apply(op).map_err(|e| format!("op {i} {op:?}: {e}"))?;
    }
    fuzz.wind_down().map_err(|e| format!("winding down: {e}"))?;
    Ok((fuzz.calls, fuzz.seen))
}

/// Operations per second.
#[allow(clippy::cast_precision_loss)]
fn rate(calls: u64, seconds: f64) -> f64 {
    calls as f64 / seconds.max(1e-9)
}

/// What both properties read from the environment: `FUZZ_CASES` (a long run when set),
/// `FUZZ_OPS`, `FUZZ_SEED` (fixed at 0 for a short run, the clock for a long one), and the
/// runner they make.
struct Run {
    long: Option<u32>,
    max_ops: usize,
    seed: u64,
    runner: TestRunner,
}

impl Run {
    fn from_env() -> Self {
        let long = env::<u32>("FUZZ_CASES");
        let seed = env::<u64>("FUZZ_SEED").unwrap_or_else(|| match long {
            None => 0,
            Some(_) => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        });
        let runner = TestRunner::new(Config {
            cases: long.unwrap_or(24),
            max_shrink_iters: 8192,
            rng_seed: RngSeed::Fixed(seed),
            source_file: Some(file!()),
            ..Config::default()
        });
        Self { long, max_ops: env::<usize>("FUZZ_OPS").unwrap_or(120), seed, runner }
    }
}

#[test]
fn prop_fuzz_core_keeps_its_invariants() {
    let Run { long, max_ops, seed, mut runner } = Run::from_env();
    let calls = AtomicU64::new(0);
    let executed = AtomicU64::new(0);
    let outcomes: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());
    let started = Instant::now();
    let strategy = (config::config(), prop::collection::vec(ops::op(), 1..=max_ops));
    let result = runner.run(&strategy, |(config, ops)| {
        executed.fetch_add(1, Ordering::Relaxed);
        let (n, paths) = run(&config, &ops).map_err(TestCaseError::fail)?;
        calls.fetch_add(n, Ordering::Relaxed);
        let mut outcomes = outcomes.lock().unwrap();
        for (k, v) in paths {
            *outcomes.entry(k).or_default() += v;
        }
        Ok(())
    });
    let elapsed = started.elapsed().as_secs_f64();
    let calls = calls.load(Ordering::Relaxed);
    eprintln!(
        "fuzz_core: seed {seed}, {} runs (shrinking included), {calls} operations in {elapsed:.1} s ({:.0} operations/s)",
        executed.load(Ordering::Relaxed),
        rate(calls, elapsed)
    );
    if long.is_some() {
        eprintln!("fuzz_core: outcomes {:#?}", outcomes.lock().unwrap());
    }
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, (config, ops))) => panic!(
            "fuzz_core failed (seed {seed}; rerun with FUZZ_SEED={seed}): {reason}\nminimal case: \
             {config:?}\n{ops:?}"
        ),
        Err(e) => panic!("fuzz_core (seed {seed}): {e}"),
    }
}

/// The overlapped traffic (`fuzz_core/overlap.rs`) over the same configurations at D in
/// 1..=3: `FUZZ_CASES`, `FUZZ_OPS` and `FUZZ_SEED` as above.
#[test]
fn prop_fuzz_core_overlapped_steps() {
    let Run { max_ops, seed, mut runner, .. } = Run::from_env();
    let calls = AtomicU64::new(0);
    let started = Instant::now();
    let configs =
        (config::config().prop_filter("a working configuration", |c| c.broken.is_none()), 1u32..=3)
            .prop_map(|(c, depth)| prefixcache_core::CacheConfig {
                max_steps_in_flight: depth,
                ..c.config
            });
    let strategy = (configs, prop::collection::vec(overlap::op(), 1..=max_ops));
    let result = runner.run(&strategy, |(config, ops)| {
        let mut fuzz = overlap::Overlap::new(config).map_err(TestCaseError::fail)?;
        for (i, op) in ops.iter().enumerate() {
            fuzz.apply(op).map_err(|e| TestCaseError::fail(format!("op {i} {op:?}: {e}")))?;
        }
        fuzz.wind_down().map_err(|e| TestCaseError::fail(format!("winding down: {e}")))?;
        calls.fetch_add(fuzz.calls, Ordering::Relaxed);
        Ok(())
    });
    let elapsed = started.elapsed().as_secs_f64();
    let calls = calls.load(Ordering::Relaxed);
    eprintln!(
        "fuzz_core (overlapped): seed {seed}, {calls} operations in {elapsed:.1} s ({:.0} operations/s)",
        rate(calls, elapsed)
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(reason, (config, ops))) => panic!(
            "fuzz_core (overlapped) failed (seed {seed}; rerun with FUZZ_SEED={seed}): {reason}\nminimal \
             case: {config:?}\n{ops:?}"
        ),
        Err(e) => panic!("fuzz_core (overlapped, seed {seed}): {e}"),
    }
}
