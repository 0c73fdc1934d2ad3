//! Manager benchmarks: what the scheduler pays per call, against the project's targets.
//!
//! Guards (targets, one core):
//! - `lookup/164k_b16`: lookup of a fully cached 164K-token prompt, full attention B = 16:
//!   <= 300 us;
//! - `lookup/164k_b1536_u128_state`: the same with B = 1536, U = 128 and a state group: <= 60 us;
//! - `request/4096_half_hit_b16`: one 4,096-token request at 50 % hit, add + lookup + schedule +
//!   plan + commit + finish: <= 30 us;
//! - `request/turn_extending_142k_b16`: the next turn of a conversation (142,000 tokens already
//!   cached, 2,000 new) admitted with `extends` naming the finished previous turn: add + lookup +
//!   schedule of an 8,192-token chunk + plan + commit (no target of its own; the growing-prefix
//!   workload is made of these);
//! - `decode_step/256x164k_*`: a decode step of 256 running sequences at 164K context, append +
//!   schedule + plan + commit: <= 50 us in total (block tables are incremental);
//! - `decode_step/256x164k_*_fast_d1` and `_overlapped_d2`: the same step through the one-call
//!   fast paths, `decode_step` with one plan in flight at most and `decode_step_overlapped`
//!   with two (commit of the oldest, resolve, placeholders, schedule, plan): the overlapped
//!   one within 10 % of the other;
//! - `request/4096_half_hit_b16_d2`: the 4,096-token request's lifecycle at D = 2.
//!
//! Run: `cargo bench -p prefixcache-core --bench manager` (add `-- --quick` for a fast look).
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use prefixcache_core::{
    CacheConfig, CacheManager, ExtraKeys, GroupConfig, GroupKind, HashConfig, PoolConfig,
    StateGroupConfig, StepPlan,
};

const CONTEXT: u32 = 164_000;

fn config_d(
    block: u32,
    unit: u32,
    state: bool,
    blocks: u32,
    state_blocks: u32,
    depth: u32,
) -> CacheConfig {
    CacheConfig { max_steps_in_flight: depth, ..config(block, unit, state, blocks, state_blocks) }
}

fn config(block: u32, unit: u32, state: bool, blocks: u32, state_blocks: u32) -> CacheConfig {
    let mut groups =
        vec![GroupConfig { kind: GroupKind::FullAttention { block_size: block }, pool: 0 }];
    let mut pools = vec![PoolConfig { num_blocks: blocks }];
    if state {
        groups.push(GroupConfig {
            kind: GroupKind::State(StateGroupConfig {
                alignment: 16,
                ..StateGroupConfig::default()
            }),
            pool: 1,
        });
        pools.push(PoolConfig { num_blocks: state_blocks });
    }
    CacheConfig {
        hash: HashConfig { unit, ..HashConfig::default() },
        pools,
        groups,
        enable_events: false,
        ..CacheConfig::default()
    }
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 150_000).collect()
}

/// Runs one prompt through a whole prefill (one chunk) and finishes it.
fn prefill(m: &mut CacheManager, id: u64, prompt: &[u32]) {
    m.add(id, prompt, ExtraKeys::default(), None).unwrap();
    m.schedule(id, u32::MAX, 0, false).unwrap().unwrap();
    let plan = m.build_plan().unwrap();
    m.commit(&plan).unwrap();
    m.finish(id).unwrap();
}

fn bench_lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("lookup");
    let prompt = tokens(1, CONTEXT);
    let mut m = CacheManager::new(config(16, 16, false, CONTEXT / 16 + 64, 0)).unwrap();
    prefill(&mut m, 1, &prompt);
    m.add(2, &prompt, ExtraKeys::default(), None).unwrap();
    assert_eq!(m.lookup(2).unwrap().tokens, (CONTEXT - 1) / 16 * 16);
    group.bench_function("164k_b16", |b| b.iter(|| m.lookup(2).unwrap()));

    let mut m = CacheManager::new(config(1536, 128, true, CONTEXT / 1536 + 8, 64)).unwrap();
    prefill(&mut m, 1, &prompt);
    m.add(2, &prompt, ExtraKeys::default(), None).unwrap();
    assert_eq!(m.lookup(2).unwrap().tokens, (CONTEXT - 1) / 128 * 128);
    group.bench_function("164k_b1536_u128_state", |b| b.iter(|| m.lookup(2).unwrap()));
    group.finish();
}

fn bench_request(c: &mut Criterion) {
    // Without and with a state group (what checkpoint planning adds): the state group resumes
    // from the first prompt's tail checkpoint at 2,032, the last unit boundary before 2,048.
    for (name, state, hit, depth) in [
        ("request/4096_half_hit_b16", false, 2048, 1),
        ("request/4096_half_hit_b16_state", true, 2032, 1),
        ("request/4096_half_hit_b16_d2", false, 2048, 2),
        ("request/4096_half_hit_b16_state_d2", true, 2032, 2),
    ] {
        let prompt = tokens(7, 4096);
        let mut m = CacheManager::new(config_d(16, 16, state, 4096, 64, depth)).unwrap();
        prefill(&mut m, 1, &prompt[..2048]);
        let mut id = 10u64;
        c.bench_function(name, |b| {
            b.iter_batched(
                || {
                    // The second half is new every time: exactly `hit` tokens hit.
                    id += 1;
                    let mut request = prompt.clone();
                    for t in &mut request[2048..] {
                        *t ^= (id as u32) << 18;
                    }
                    (id, request)
                },
                |(id, request)| {
                    m.add(id, &request, ExtraKeys::default(), None).unwrap();
                    assert_eq!(m.lookup(id).unwrap().tokens, hit);
                    m.schedule(id, u32::MAX, 0, false).unwrap().unwrap();
                    let plan = m.build_plan().unwrap();
                    m.commit(&plan).unwrap();
                    m.finish(id).unwrap();
                },
                BatchSize::SmallInput,
            );
        });
    }
}

fn bench_turn(c: &mut Criterion) {
    let previous = tokens(11, 142_000);
    let mut next = previous.clone();
    next.extend(tokens(12, 2_000));
    c.bench_function("request/turn_extending_142k_b16", |b| {
        b.iter_batched(
            || {
                // A fresh manager whose previous turn is computed and finished (untimed).
                let mut m = CacheManager::new(config(16, 16, false, 20_000, 0)).unwrap();
                prefill(&mut m, 1, &previous);
                m
            },
            |mut m| {
                let added = m.add(2, &next, ExtraKeys::default(), Some(1)).unwrap();
                assert_eq!(added.reused_tokens, 142_000);
                assert_eq!(m.lookup(2).unwrap().tokens, 142_000);
                m.schedule(2, 8_192, 0, false).unwrap().unwrap();
                let plan = m.build_plan().unwrap();
                m.commit(&plan).unwrap();
                m
            },
            BatchSize::PerIteration,
        );
    });
}

/// 256 sequences sharing a 164K-token context (each with its own last token), all decoding.
fn decode_setup(state: bool) -> (CacheManager, Vec<u64>) {
    decode_setup_d(state, 1)
}

fn decode_setup_d(state: bool, depth: u32) -> (CacheManager, Vec<u64>) {
    let rows = 256u32;
    let blocks = CONTEXT / 16 + rows * (2048 / 16 + 4);
    let mut m = CacheManager::new(config_d(16, 16, state, blocks, rows * 8, depth)).unwrap();
    let mut prompt = tokens(3, CONTEXT);
    prefill(&mut m, 0, &prompt);
    let ids: Vec<u64> = (1..=u64::from(rows)).collect();
    for &id in &ids {
        *prompt.last_mut().unwrap() = id as u32;
        m.add(id, &prompt, ExtraKeys::default(), Some(0)).unwrap();
        m.schedule(id, u32::MAX, 0, false).unwrap().unwrap();
    }
    let plan = m.build_plan().unwrap();
    m.commit(&plan).unwrap();
    (m, ids)
}

fn bench_decode(c: &mut Criterion) {
    // Each sequence may decode this many tokens before the setup is rebuilt (untimed).
    const MAX_STEPS: u64 = 2048;
    let mut group = c.benchmark_group("decode_step");
    for (name, state) in [("256x164k_b16", false), ("256x164k_b16_state", true)] {
        let (mut m, mut ids) = decode_setup(state);
        let mut steps = 0u64;
        let budgets = vec![1u32; ids.len()];
        group.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    if steps == MAX_STEPS {
                        (m, ids) = decode_setup(state);
                        steps = 0;
                    }
                    steps += 1;
                    let sampled: Vec<u32> = ids.iter().map(|&i| (i + steps) as u32).collect();
                    let start = Instant::now();
                    m.append_batch(&ids, &sampled).unwrap();
                    let scheduled = m.schedule_batch(&ids, &budgets, false).unwrap();
                    let plan = m.build_plan().unwrap();
                    m.commit(&plan).unwrap();
                    total += start.elapsed();
                    assert!(scheduled
                        .iter()
                        .all(|s| s.as_ref().is_some_and(|s| s.num_tokens == 1)));
                }
                total
            });
        });
    }
    group.finish();
}

/// The decode step through the one-call fast paths: `decode_step` at D = 1 against
/// `decode_step_overlapped` at D = 2 (two plans in flight in steady state, one placeholder a
/// sequence pending, a ring of two plans).
fn bench_decode_fast(c: &mut Criterion) {
    const MAX_STEPS: u64 = 2048;
    let mut group = c.benchmark_group("decode_step");
    for state in [false, true] {
        for depth in [1u32, 2] {
            let name = match (state, depth) {
                (false, 1) => "256x164k_b16_fast_d1",
                (false, _) => "256x164k_b16_overlapped_d2",
                (true, 1) => "256x164k_b16_state_fast_d1",
                (true, _) => "256x164k_b16_state_overlapped_d2",
            };
            let (mut m, mut ids) = decode_setup_d(state, depth);
            let mut plans = [StepPlan::default(), StepPlan::default()];
            let mut steps = 0u64;
            group.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        if steps == MAX_STEPS {
                            (m, ids) = decode_setup_d(state, depth);
                            plans = [StepPlan::default(), StepPlan::default()];
                            steps = 0;
                        }
                        steps += 1;
                        let sampled: Vec<u32> = ids.iter().map(|&i| (i + steps) as u32).collect();
                        let ring = (steps % 2) as usize;
                        let start = Instant::now();
                        let scheduled = if depth == 1 {
                            m.decode_step(&ids, &sampled, &mut plans[0]).unwrap()
                        } else {
                            let full = m.plans_in_flight().len() == 2;
                            let oldest = m.plan_in_flight().filter(|_| full);
                            let resolve: &[u64] = if full { &ids } else { &[] };
                            let tokens: &[u32] = if full { &sampled } else { &[] };
                            let plan = &mut plans[ring];
                            m.decode_step_overlapped(oldest, resolve, tokens, &ids, plan).unwrap()
                        };
                        total += start.elapsed();
                        assert!(scheduled
                            .iter()
                            .all(|s| s.as_ref().is_some_and(|s| s.num_tokens == 1)));
                    }
                    total
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench_lookup, bench_request, bench_turn, bench_decode, bench_decode_fast);
criterion_main!(benches);
