//! Quick end-to-end checks of the step protocol (the full scenario suites live beside this).
use prefixcache_core::*;

fn manager(state: bool) -> CacheManager {
    let mut groups =
        vec![GroupConfig { kind: GroupKind::FullAttention { block_size: 16 }, pool: 0 }];
    if state {
        groups.push(GroupConfig {
            kind: GroupKind::State(StateGroupConfig {
                alignment: 4,
                max_checkpoints_per_step: Some(2),
                ..StateGroupConfig::default()
            }),
            pool: 1,
        });
    }
    CacheManager::new(CacheConfig {
        hash: HashConfig { unit: 4, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: 64 }, PoolConfig { num_blocks: 64 }],
        groups,
        ..CacheConfig::default()
    })
    .unwrap()
}

fn run_prompt(m: &mut CacheManager, id: u64, tokens: &[u32]) -> u32 {
    m.add(id, tokens, ExtraKeys::default(), None).unwrap();
    let s = m.schedule(id, 1 << 20, 0, false).unwrap().unwrap();
    let plan = m.build_plan().unwrap();
    m.check_invariants().unwrap();
    m.commit(&plan).unwrap();
    m.check_invariants().unwrap();
    m.finish(id).unwrap();
    m.check_invariants().unwrap();
    s.num_computed
}

#[test]
fn resend_hits_the_last_unit_boundary() {
    let mut m = manager(false);
    let p: Vec<u32> = (0..40).collect();
    assert_eq!(run_prompt(&mut m, 1, &p), 0);
    assert_eq!(run_prompt(&mut m, 2, &p), 36);
    let q: Vec<u32> = (0..32).collect();
    assert_eq!(run_prompt(&mut m, 3, &q), 28);
}

#[test]
fn hybrid_resend_hits_the_tail_checkpoint() {
    let mut m = manager(true);
    let p: Vec<u32> = (0..40).collect();
    assert_eq!(run_prompt(&mut m, 1, &p), 0);
    assert_eq!(run_prompt(&mut m, 2, &p), 36);
    let q: Vec<u32> = (0..60).collect();
    m.add(3, &q, ExtraKeys::default(), None).unwrap();
    let hit = m.lookup(3).unwrap();
    assert_eq!(hit.tokens, 36);
    assert_eq!(hit.junction, None);
    m.check_invariants().unwrap();
}
