//! Hashing time of `add` against `add_batch` on N prompts of 4,096 tokens (unit 16, no reuse):
//! nanoseconds a unit, the minimum of 9 runs on fresh managers, one mode per process (so that
//! no mode runs on memory another one left behind).
//!
//! `cargo run --release -p prefixcache-core --example add_batch -- N MODE ALGORITHM`, MODE one
//! of `add` (each prompt `add`ed), `b1`, `b2`, ... (`add_batch` on that many threads),
//! ALGORITHM `sha256` or `xxh3`. docs/BENCHMARKS.md has the figures.

use std::time::Instant;

use prefixcache_core::{
    AddRequest, CacheConfig, CacheManager, ExtraKeys, GroupConfig, GroupKind, HashAlgorithm,
    HashConfig, PoolConfig,
};

fn manager(algorithm: HashAlgorithm) -> CacheManager {
    CacheManager::new(CacheConfig {
        hash: HashConfig { algorithm, unit: 16, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 1024 }],
        groups: vec![GroupConfig { kind: GroupKind::FullAttention { block_size: 16 }, pool: 0 }],
        reuse_live_prefixes: false,
        enable_events: false,
        ..CacheConfig::default()
    })
    .expect("a valid configuration")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: add_batch N add|b1|b2|... sha256|xxh3";
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).expect(usage);
    let mode = args.get(2).expect(usage).as_str();
    let algorithm = match args.get(3).map(String::as_str) {
        Some("sha256") => HashAlgorithm::Sha256,
        Some("xxh3") => HashAlgorithm::Xxh3_128,
        _ => panic!("{usage}"),
    };
    let prompts: Vec<Vec<u32>> = (0..n as u32)
        .map(|c| (0..4096u32).map(|i| i.wrapping_mul(2_654_435_761) ^ (c * 7919)).collect())
        .collect();
    let mut best = f64::MAX;
    for _ in 0..9 {
        let mut m = manager(algorithm);
        let t0 = Instant::now();
        if mode == "add" {
            for (i, p) in prompts.iter().enumerate() {
                m.add(i as u64, p, ExtraKeys::default(), None).expect("add");
            }
        } else {
            let threads: usize = mode.strip_prefix('b').and_then(|t| t.parse().ok()).expect(usage);
            let requests = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| AddRequest { seq_id: i as u64, tokens: p, ..AddRequest::default() })
                .collect();
            m.add_batch(requests, threads).expect("add_batch");
        }
        best = best.min(t0.elapsed().as_secs_f64());
    }
    #[allow(clippy::cast_precision_loss)]
    let per_unit = best / (n * 256) as f64 * 1e9;
    println!(
        "{} {n} prompts x 256 units, {mode}: {per_unit:.1} ns a unit, {:.2} ms",
        args[3],
        best * 1e3
    );
}
