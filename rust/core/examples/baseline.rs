//! Pure-Rust baseline of `benchmarks/bindings.py`: the same decode steps and 164K-token
//! admissions, timed the same way (median and minimum of short runs), so the Python figures
//! read as core work plus crossing cost.
//!
//! Run: `cargo run --release -p prefixcache-core --example baseline`.
//!
//! `baseline decode N` / `baseline decode_state N` / `baseline hybrid N` / `baseline request N`
//! / `baseline lookup N` run only N steps (requests, lookups) of one case (and its set-up), for
//! instruction counts: `valgrind --tool=callgrind` of N2 and N1 steps, the difference divided by
//! N2 - N1, is the instructions of one step, a figure machine load does not move.
//! `decode_state` is `decode` with a state group (the core's `decode_step/256x164k_b16_state`).
//! `step` / `step_state` run the same step through the one-call `decode_step` (D = 1), and
//! `overlapped` / `overlapped_state` through `decode_step_overlapped` with two plans in flight
//! (D = 2, a ring of two plans; the core's `decode_step/256x164k_*_overlapped_d2`): count them
//! with `--collect-atstart=no --toggle-collect='*CacheManager*decode_step*'` to leave the set-up
//! out.
use std::time::Instant;

use prefixcache_core::{
    CacheConfig, CacheManager, ExtraKeys, GroupConfig, GroupKind, HashConfig, PoolConfig,
    StateGroupConfig, StepPlan,
};

const CONTEXT: u32 = 164_000;
const ROWS: u32 = 256;

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 150_000).collect()
}

fn manager(state: bool, blocks: u32, state_blocks: u32) -> CacheManager {
    geometry_manager(16, 16, state.then_some(16), blocks, state_blocks, 1)
}

/// Full attention at `block`, hashing `unit`, plus a state group when `alignment` is given.
fn geometry_manager(
    block: u32,
    unit: u32,
    alignment: Option<u32>,
    blocks: u32,
    state_blocks: u32,
    depth: u32,
) -> CacheManager {
    let mut groups =
        vec![GroupConfig { kind: GroupKind::FullAttention { block_size: block }, pool: 0 }];
    let mut pools = vec![PoolConfig { num_blocks: blocks }];
    if let Some(alignment) = alignment {
        groups.push(GroupConfig {
            kind: GroupKind::State(StateGroupConfig {
                alignment,
                max_checkpoints_per_step: None,
                ..StateGroupConfig::default()
            }),
            pool: 1,
        });
        pools.push(PoolConfig { num_blocks: state_blocks });
    }
    let config = CacheConfig {
        hash: HashConfig { unit, ..HashConfig::default() },
        pools,
        groups,
        enable_events: false,
        max_steps_in_flight: depth,
        ..CacheConfig::default()
    };
    CacheManager::new(config).expect("valid config")
}

fn admit(m: &mut CacheManager, id: u64, prompt: &[u32], extends: Option<u64>) -> u32 {
    m.add(id, prompt, ExtraKeys::default(), extends).expect("add");
    m.lookup(id).expect("lookup");
    let scheduled = m.schedule(id, u32::MAX, 0, false).expect("schedule").expect("blocks");
    let plan = m.build_plan().expect("plan");
    m.commit(&plan).expect("commit");
    m.finish(id).expect("finish");
    scheduled.num_computed
}

fn report(name: &str, mut times: Vec<f64>) {
    times.sort_by(f64::total_cmp);
    println!("{name:<40} {:9.1} {:9.1}", times[times.len() / 2], times[0]);
}

/// 256 sequences sharing a 164K-token context, all decoding (as `decode_setup` in the core's
/// criterion bench and `bindings.py`).
fn decode(state: bool, steps: u64) -> Vec<f64> {
    let (mut m, ids) = decode_setup(state, 1);
    let budgets = vec![1u32; ids.len()];
    let mut times = Vec::new();
    for step in 0..steps {
        let sampled: Vec<u32> = ids.iter().map(|&i| ((i + step) % 150_000) as u32).collect();
        let start = Instant::now();
        m.append_batch(&ids, &sampled).expect("append");
        let scheduled = m.schedule_batch(&ids, &budgets, false).expect("schedule");
        let plan = m.build_plan().expect("plan");
        m.commit(&plan).expect("commit");
        times.push(start.elapsed().as_secs_f64() * 1e6);
        assert!(scheduled.iter().all(|s| s.as_ref().is_some_and(|s| s.num_tokens == 1)));
    }
    times.split_off(times.len() / 10) // drop the warm-up
}

/// The decode step of `decode` in one call: `decode_step` at D = 1, or at D = 2
/// `decode_step_overlapped` over a ring of two plans (two in flight in steady state: commit of
/// the oldest, resolve of its sampled tokens, one placeholder a sequence, schedule, plan).
fn one_call_decode(state: bool, depth: u32, steps: u64) -> Vec<f64> {
    let (mut m, ids) = decode_setup(state, depth);
    let mut plans = [StepPlan::default(), StepPlan::default()];
    let mut times = Vec::new();
    for step in 0..steps {
        let sampled: Vec<u32> = ids.iter().map(|&i| ((i + step) % 150_000) as u32).collect();
        let start = Instant::now();
        let scheduled = if depth == 1 {
            m.decode_step(&ids, &sampled, &mut plans[0]).expect("step")
        } else {
            overlapped_step(&mut m, &ids, &sampled, &mut plans[(step % 2) as usize])
        };
        times.push(start.elapsed().as_secs_f64() * 1e6);
        assert!(scheduled.iter().all(|s| s.as_ref().is_some_and(|s| s.num_tokens == 1)));
    }
    times.split_off(times.len() / 10)
}

/// One `decode_step_overlapped` of `one_call_decode` at D = 2.
fn overlapped_step(
    m: &mut CacheManager,
    ids: &[u64],
    sampled: &[u32],
    plan: &mut StepPlan,
) -> Vec<Option<prefixcache_core::Scheduled>> {
    let full = m.plans_in_flight().len() == 2;
    let oldest = m.plan_in_flight().filter(|_| full);
    let (resolve, tokens): (&[u64], &[u32]) = if full { (ids, sampled) } else { (&[], &[]) };
    m.decode_step_overlapped(oldest, resolve, tokens, ids, plan).expect("overlapped step")
}

/// 256 sequences of one 164K context decoding, at `depth` plans in flight at most.
fn decode_setup(state: bool, depth: u32) -> (CacheManager, Vec<u64>) {
    let blocks = CONTEXT / 16 + ROWS * (2048 / 16 + 4);
    let mut m = geometry_manager(16, 16, state.then_some(16), blocks, ROWS * 8, depth);
    let mut prompt = tokens(3, CONTEXT);
    admit(&mut m, 0, &prompt, None);
    let ids: Vec<u64> = (1..=u64::from(ROWS)).collect();
    for &id in &ids {
        *prompt.last_mut().expect("non-empty") = id as u32;
        m.add(id, &prompt, ExtraKeys::default(), Some(0)).expect("add");
        m.schedule(id, u32::MAX, 0, false).expect("schedule").expect("blocks");
    }
    let plan = m.build_plan().expect("plan");
    m.commit(&plan).expect("commit");
    (m, ids)
}

/// `bindings.py`'s hybrid decode: 8 sequences of 20K tokens at B = 1536 / U = 128 with a
/// state group (A = 64), one decode token each per step, as `decode_step` (commit the previous
/// step, append, schedule, build into a kept plan).
fn hybrid_decode(steps: u64) -> Vec<f64> {
    const HYBRID_ROWS: u32 = 8;
    let mut m =
        geometry_manager(1536, 128, Some(64), HYBRID_ROWS * 16 + 64, 16 * HYBRID_ROWS + 1024, 1);
    let ids: Vec<u64> = (0..u64::from(HYBRID_ROWS)).collect();
    for &id in &ids {
        m.add(id, &tokens(id as u32, 20_000), ExtraKeys::default(), None).expect("add");
        while m.num_computed(id).expect("live") < 20_000 {
            m.schedule(id, 8192, 0, false).expect("schedule").expect("blocks");
            let plan = m.build_plan().expect("plan");
            m.commit(&plan).expect("commit");
        }
    }
    let mut plan = StepPlan::default();
    let mut times = Vec::new();
    for step in 0..steps {
        let sampled: Vec<u32> = ids.iter().map(|&i| ((i + step) % 150_000) as u32).collect();
        let start = Instant::now();
        let scheduled = m.decode_step(&ids, &sampled, &mut plan).expect("step");
        times.push(start.elapsed().as_secs_f64() * 1e6);
        assert!(scheduled.iter().all(|s| s.as_ref().is_some_and(|s| s.num_tokens == 1)));
    }
    times.split_off(times.len() / 10)
}

/// The core bench's `request/4096_half_hit_b16`: a 4,096-token request whose first 2,048 tokens
/// are cached, add + lookup + schedule + plan + commit + finish (each evicts the previous
/// request's 128 new blocks once the pool is full).
fn half_hit_requests(requests: u64) {
    let prompt = tokens(7, 4096);
    let mut m = manager(false, 4096, 0);
    admit(&mut m, 1, &prompt[..2048], None);
    for id in 10..10 + requests {
        let mut request = prompt.clone();
        for t in &mut request[2048..] {
            *t ^= (id as u32) << 18;
        }
        assert_eq!(admit(&mut m, id, &request, None), 2048);
    }
}

/// `lookups` lookups of a fully cached 164,000-token prompt at B = 16, without hints (the core
/// bench's `lookup/164k_b16`): every one of its 10,250 blocks is probed in the index and
/// confirmed in its record.
fn cached_lookups(lookups: u64) {
    let prompt = tokens(5, CONTEXT);
    let mut m = manager(false, CONTEXT / 16 + 64, 0);
    admit(&mut m, 1, &prompt, None);
    m.add(2, &prompt, ExtraKeys::default(), None).expect("add");
    for _ in 0..lookups {
        assert_eq!(m.lookup(2).expect("lookup").tokens, (CONTEXT - 1) / 16 * 16);
    }
}

/// One long-lived manager, emptied by `reset` (untimed) between repetitions.
fn admission(warm: bool, reps: u32) -> Vec<f64> {
    let mut m = manager(false, CONTEXT / 16 + 64, 0);
    let mut times = Vec::new();
    for rep in 0..reps {
        m.reset().expect("nothing running");
        let prompt = tokens(11 + rep, CONTEXT);
        let id = 2 * u64::from(rep);
        if warm {
            admit(&mut m, id, &prompt, None);
        }
        let start = Instant::now();
        let hit = admit(&mut m, id + 1, &prompt, None);
        times.push(start.elapsed().as_secs_f64() * 1e6);
        assert_eq!(hit, if warm { (CONTEXT - 1) / 16 * 16 } else { 0 });
    }
    times
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [case, steps] = args.as_slice() {
        let steps: u64 = steps.parse().expect("a number of steps");
        match case.as_str() {
            "decode" => drop(decode(false, steps)),
            "decode_state" => drop(decode(true, steps)),
            "step" => drop(one_call_decode(false, 1, steps)),
            "step_state" => drop(one_call_decode(true, 1, steps)),
            "overlapped" => drop(one_call_decode(false, 2, steps)),
            "overlapped_state" => drop(one_call_decode(true, 2, steps)),
            "hybrid" => drop(hybrid_decode(steps)),
            "request" => half_hit_requests(steps),
            "lookup" => cached_lookups(steps),
            other => panic!(
                "unknown case {other:?}: decode, decode_state, step, step_state, overlapped, \
                 overlapped_state, hybrid, request or lookup"
            ),
        }
        return;
    }
    println!("{:<40} {:>9} {:>9}  (microseconds)", "case (pure Rust)", "median", "min");
    report("decode step, 256 x 164K, B=16", decode(false, 500));
    report("decode step, 256 x 164K, B=16 + state", decode(true, 500));
    report("hybrid decode 8 x 20K: decode_step", hybrid_decode(2000));
    report("admit 164K cold", admission(false, 31));
    report("admit 164K warm resend", admission(true, 31));
}
