//! Pure-Rust baseline of `benchmarks/bindings.py`'s admission case: the same 164K-token prompt
//! through `add` + `lookup` + `schedule` + `build_plan` + `commit` + `finish`, cold and warm,
//! so the Python figures can be read as Rust work plus crossing cost.
//!
//! Run: `cargo run --release -p prefixcache-python --example admission`.
use std::time::Instant;

use prefixcache_core::{
    CacheConfig, CacheManager, ExtraKeys, GroupConfig, GroupKind, HashConfig, PoolConfig,
};

const CONTEXT: u32 = 164_000;

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 150_000).collect()
}

fn manager() -> CacheManager {
    let config = CacheConfig {
        hash: HashConfig { unit: 16, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: CONTEXT / 16 + 64 }],
        groups: vec![GroupConfig { kind: GroupKind::FullAttention { block_size: 16 }, pool: 0 }],
        enable_events: false,
        ..CacheConfig::default()
    };
    CacheManager::new(config).expect("valid config")
}

fn admit(m: &mut CacheManager, id: u64, prompt: &[u32]) -> u32 {
    m.add(id, prompt, ExtraKeys::default(), None).expect("add");
    m.lookup(id).expect("lookup");
    let scheduled = m.schedule(id, u32::MAX, 0, false).expect("schedule").expect("blocks");
    let plan = m.build_plan().expect("plan");
    m.commit(&plan).expect("commit");
    m.finish(id).expect("finish");
    scheduled.num_computed
}

fn main() {
    for (name, warm) in [("admit 164K cold", false), ("admit 164K warm resend", true)] {
        // One long-lived manager, emptied by `reset` (untimed) between repetitions, exactly as
        // the Python benchmark does.
        let mut m = manager();
        let mut times = Vec::new();
        for rep in 0..21u32 {
            m.reset().expect("nothing running");
            let prompt = tokens(11 + rep, CONTEXT);
            let id = 2 * u64::from(rep);
            if warm {
                admit(&mut m, id, &prompt);
            }
            let start = Instant::now();
            let hit = admit(&mut m, id + 1, &prompt);
            times.push(start.elapsed().as_secs_f64() * 1e6);
            assert_eq!(hit, if warm { (CONTEXT - 1) / 16 * 16 } else { 0 });
        }
        times.sort_by(f64::total_cmp);
        println!("{name:<40} median {:9.1} us, min {:9.1} us", times[times.len() / 2], times[0]);
    }
}
