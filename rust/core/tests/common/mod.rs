//! Shared helpers of the scenario suites: configurations, token streams, and a [`Harness`] that
//! runs `check_invariants` after every call it makes on the manager.
// Each test binary uses a different subset of these helpers; panicking on a broken expectation
// is what a test helper is for.
#![allow(dead_code, clippy::missing_panics_doc, clippy::must_use_candidate)]

use prefixcache_core::{
    hash_prefix, Added, CacheConfig, CacheEvent, CacheManager, Digest, EventRecord, ExtraKeys,
    GroupConfig, GroupKind, HashConfig, Hit, PoolConfig, PoolUsage, Retention, Scheduled,
    StateGroupConfig, StepPlan,
};

/// Block size of the scenarios.
pub const B: u32 = 16;
/// Hash unit of the scenarios.
pub const U: u32 = 4;
/// A budget larger than any prompt here: "schedule everything that is left".
pub const ALL: u32 = 1 << 20;

/// Ids of throw-away probe sequences (only looked up), far from the scenarios' ids.
const PROBE_BASE: u64 = 1 << 40;

/// Full attention only: one group of `block_size`, one pool of `num_blocks` ids (null included).
pub fn full_attention(block_size: u32, unit: u32, num_blocks: u32) -> CacheConfig {
    CacheConfig {
        hash: HashConfig { unit, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks }],
        groups: vec![GroupConfig { kind: GroupKind::FullAttention { block_size }, pool: 0 }],
        ..CacheConfig::default()
    }
}

/// One sliding-window group (B, W) with its own pool.
pub fn sliding_window(block_size: u32, window: u32, unit: u32, num_blocks: u32) -> CacheConfig {
    CacheConfig {
        hash: HashConfig { unit, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks }],
        groups: vec![GroupConfig {
            kind: GroupKind::SlidingWindow { block_size, window },
            pool: 0,
        }],
        ..CacheConfig::default()
    }
}

/// The hybrid setup of the checkpoint scenarios: group 0 full attention (B), group 1 a state
/// group, each with its own pool (unless `shared_pool`).
#[derive(Clone, Debug)]
pub struct Hybrid {
    pub block_size: u32,
    pub unit: u32,
    pub alignment: u32,
    pub max_checkpoints: Option<u32>,
    pub retention: Retention,
    pub checkpoint_cap: Option<u32>,
    pub reserve_per_sequence: u32,
    pub attention_blocks: u32,
    pub state_blocks: u32,
    pub shared_pool: bool,
}

impl Default for Hybrid {
    /// B=16, U=4, A=4, C=2, tail + junction + decode tail, no interval, no cap, roomy pools.
    fn default() -> Self {
        Self {
            block_size: B,
            unit: U,
            alignment: 4,
            max_checkpoints: Some(2),
            retention: Retention { tail: true, interval: None, junction: true, decode_tail: true },
            checkpoint_cap: None,
            reserve_per_sequence: 2,
            attention_blocks: 64,
            state_blocks: 64,
            shared_pool: false,
        }
    }
}

impl Hybrid {
    pub fn config(&self) -> CacheConfig {
        let state = StateGroupConfig {
            alignment: self.alignment,
            max_checkpoints_per_step: self.max_checkpoints,
            retention: self.retention.clone(),
            checkpoint_cap: self.checkpoint_cap,
            reserve_per_sequence: self.reserve_per_sequence,
        };
        let mut pools = vec![PoolConfig { num_blocks: self.attention_blocks }];
        if !self.shared_pool {
            pools.push(PoolConfig { num_blocks: self.state_blocks });
        }
        CacheConfig {
            hash: HashConfig { unit: self.unit, ..HashConfig::default() },
            pools,
            groups: vec![
                GroupConfig {
                    kind: GroupKind::FullAttention { block_size: self.block_size },
                    pool: 0,
                },
                GroupConfig { kind: GroupKind::State(state), pool: usize::from(!self.shared_pool) },
            ],
            ..CacheConfig::default()
        }
    }

    pub fn harness(&self) -> Harness {
        Harness::new(self.config())
    }
}

/// `len` tokens of stream `stream`: two different streams share no token.
pub fn tokens(stream: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| stream * 1_000_000 + i).collect()
}

/// `prefix` followed by `len` tokens of stream `stream`.
pub fn extend(prefix: &[u32], stream: u32, len: usize) -> Vec<u32> {
    let mut out = prefix.to_vec();
    out.extend(tokens(stream, len));
    out
}

/// The `[R, cols]` rows of a flat row-major array.
pub fn rows<T: Copy>(flat: &[T], cols: usize) -> Vec<Vec<T>> {
    flat.chunks(cols).map(<[T]>::to_vec).collect()
}

/// A manager plus the configuration it was built from; every call checks the invariants.
pub struct Harness {
    pub m: CacheManager,
    pub config: CacheConfig,
    next_probe: u64,
}

impl Harness {
    pub fn new(config: CacheConfig) -> Self {
        let m = CacheManager::new(config.clone()).expect("valid configuration");
        let h = Self { m, config, next_probe: PROBE_BASE };
        h.check();
        h
    }

    /// `check_invariants`, panicking with the violation.
    pub fn check(&self) {
        if let Err(e) = self.m.check_invariants() {
            panic!("{e}");
        }
    }

    /// Runs one call on the manager, then checks the invariants (whatever the call returned).
    pub fn call<T>(&mut self, f: impl FnOnce(&mut CacheManager) -> T) -> T {
        let out = f(&mut self.m);
        self.check();
        out
    }

    pub fn add(&mut self, id: u64, tokens: &[u32]) -> Added {
        self.call(|m| m.add(id, tokens, ExtraKeys::default(), None)).expect("add")
    }

    pub fn add_extending(&mut self, id: u64, tokens: &[u32], extends: u64) -> Added {
        self.call(|m| m.add(id, tokens, ExtraKeys::default(), Some(extends))).expect("add")
    }

    pub fn lookup(&mut self, id: u64) -> Hit {
        self.call(|m| m.lookup(id)).expect("lookup")
    }

    /// The hit a new request made of `tokens` would get now (the probe is only looked up).
    pub fn probe(&mut self, tokens: &[u32]) -> Hit {
        let id = self.next_probe;
        self.next_probe += 1;
        self.add(id, tokens);
        let hit = self.lookup(id);
        if self.m.plan_in_flight().is_none() {
            self.finish(id);
        }
        hit
    }

    pub fn try_schedule(&mut self, id: u64, max_tokens: u32) -> Option<Scheduled> {
        self.call(|m| m.schedule(id, max_tokens, 0, false)).expect("schedule")
    }

    /// `schedule` with `lookahead` speculative tokens; `None` when out of blocks.
    pub fn try_schedule_lookahead(
        &mut self,
        id: u64,
        max_tokens: u32,
        lookahead: u32,
    ) -> Option<Scheduled> {
        self.call(|m| m.schedule(id, max_tokens, lookahead, false)).expect("schedule")
    }

    /// `schedule` that must not run out of blocks.
    pub fn schedule(&mut self, id: u64, max_tokens: u32) -> Scheduled {
        self.try_schedule(id, max_tokens).expect("the pool supplies the blocks")
    }

    /// `schedule(.., exact = true)` that must not run out of blocks.
    pub fn schedule_exact(&mut self, id: u64, max_tokens: u32) -> Scheduled {
        self.call(|m| m.schedule(id, max_tokens, 0, true))
            .expect("schedule")
            .expect("the pool supplies the blocks")
    }

    pub fn plan(&mut self) -> StepPlan {
        self.call(CacheManager::build_plan).expect("build_plan")
    }

    pub fn commit(&mut self, plan: &StepPlan) {
        self.call(|m| m.commit(plan)).expect("commit");
    }

    pub fn abort(&mut self, plan: &StepPlan) {
        self.call(|m| m.abort(plan)).expect("abort");
    }

    /// One step of one sequence: schedule up to `max_tokens`, build, commit.
    pub fn step(&mut self, id: u64, max_tokens: u32) -> (Scheduled, StepPlan) {
        let scheduled = self.schedule(id, max_tokens);
        let plan = self.plan();
        self.commit(&plan);
        (scheduled, plan)
    }

    /// One `exact` step of one sequence.
    pub fn step_exact(&mut self, id: u64, max_tokens: u32) -> (Scheduled, StepPlan) {
        let scheduled = self.schedule_exact(id, max_tokens);
        let plan = self.plan();
        self.commit(&plan);
        (scheduled, plan)
    }

    /// Adds a prompt and computes all of it in one step.
    pub fn prefill(&mut self, id: u64, tokens: &[u32]) -> (Scheduled, StepPlan) {
        self.add(id, tokens);
        self.step(id, ALL)
    }

    /// Adds, prefills in one step and finishes a prompt; returns the hit its schedule used.
    pub fn serve(&mut self, id: u64, tokens: &[u32]) -> u32 {
        let (scheduled, _) = self.prefill(id, tokens);
        self.finish(id);
        scheduled.num_computed
    }

    /// The engine's decode loop after a prefill: each sampled token is appended, and every one
    /// but the last is then computed in a one-token step (the last is sampled, never processed).
    pub fn decode(&mut self, id: u64, sampled: &[u32]) -> Vec<StepPlan> {
        let mut plans = Vec::new();
        for (i, &token) in sampled.iter().enumerate() {
            self.append(id, &[token]);
            if i + 1 < sampled.len() {
                plans.push(self.step(id, 1).1);
            }
        }
        plans
    }

    pub fn append(&mut self, id: u64, tokens: &[u32]) {
        self.call(|m| m.append(id, tokens)).expect("append");
    }

    pub fn finish(&mut self, id: u64) {
        self.call(|m| m.finish(id)).expect("finish");
    }

    pub fn preempt(&mut self, id: u64) {
        self.call(|m| m.preempt(id)).expect("preempt");
    }

    pub fn events(&mut self) -> Vec<EventRecord> {
        self.call(CacheManager::drain_events)
    }

    pub fn usage(&self, pool: usize) -> PoolUsage {
        self.m.pool_usage()[pool]
    }

    /// Full block-table row of one sequence in a paged group.
    pub fn table(&mut self, group: u32, id: u64) -> Vec<i32> {
        let (flat, rows, _) = self.call(|m| m.block_table(group, &[id])).expect("block_table");
        assert_eq!(rows, 1);
        flat
    }

    /// The digest of the prefix `tokens[..position]` (position a multiple of U).
    pub fn digest(&self, tokens: &[u32], position: u32) -> Digest {
        let unit = self.config.hash.unit;
        hash_prefix(&self.config.hash, &tokens[..position as usize], &ExtraKeys::default()).unwrap()
            [(position / unit - 1) as usize]
    }

    /// The digests at every unit boundary in `(from, to]`.
    pub fn digests(&self, tokens: &[u32], from: u32, to: u32) -> Vec<Digest> {
        let unit = self.config.hash.unit;
        (from / unit + 1..=to / unit).map(|i| self.digest(tokens, i * unit)).collect()
    }
}

/// The `BlockStored` events among `events`: `(group, block, keys, parent, start, end, ckpt)`.
pub type Stored = (u32, u32, Vec<Digest>, Option<Digest>, u32, u32, bool);

pub fn stored(events: &[EventRecord]) -> Vec<Stored> {
    events
        .iter()
        .filter_map(|r| match &r.event {
            CacheEvent::BlockStored {
                group,
                block,
                keys,
                parent,
                token_start,
                token_end,
                checkpoint,
                ..
            } => {
                Some((*group, *block, keys.clone(), *parent, *token_start, *token_end, *checkpoint))
            }
            _ => None,
        })
        .collect()
}

/// The `BlockRemoved` events among `events`: `(group, block, keys)`.
pub fn removed(events: &[EventRecord]) -> Vec<(u32, u32, Vec<Digest>)> {
    events
        .iter()
        .filter_map(|r| match &r.event {
            CacheEvent::BlockRemoved { group, block, keys, .. } => {
                Some((*group, *block, keys.clone()))
            }
            _ => None,
        })
        .collect()
}
