//! The fuzz driver: makes each call, then checks what holds whatever the traffic.
//!
//! It keeps only what it needs for that: the live and finished sequences (tokens, extra keys,
//! prefix identities), the identity of every digest it has seen, the set of prefix identities
//! some committed step computed, the plan in flight and the ids scheduled for the next one.
//! After every call:
//! - `check_invariants` passes; an error is typed (never `Invariant`) and changed nothing
//!   (pools, statistics, sequences, plan in flight, events);
//! - no hit (reconciled, any group's own, the junction) and no chunk start rests on a prefix
//!   that no committed step computed with the same identity (tokens and extra keys);
//! - a commit stores only keys of its own rows' prefixes up to their chunk ends, a `finish`
//!   only keys of the finished sequence's computed prefix, no other call any; every digest an
//!   event names is one of a known prefix;
//! - plans are well formed (shapes, ids and slots in range, offsets within chunks), built in
//!   step order; refills of a foreign or stale plan included;
//! - a few outcomes the protocol fixes: commit or abort of anything but the plan in flight is
//!   `StalePlan`, building or scheduling with a plan in flight is a step error, `add` refuses
//!   live ids and malformed extra keys, a lookahead beyond `MAX_LOOKAHEAD_TOKENS` is refused.
//!
//! At the end every plan is committed and every sequence finished: no block may stay owned.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use prefixcache_core::limits::{MAX_BATCH_SEQUENCES, MAX_HASH_THREADS, MAX_LOOKAHEAD_TOKENS};
use prefixcache_core::{
    hash_prefix, AddRequest, Added, CacheConfig, CacheError, CacheEvent, CacheManager, Digest,
    ExtraKeys, GroupConfig, GroupKind, Hit, PoolUsage, Scheduled, StateGroupConfig, Stats,
    StepPlan,
};

use crate::content::Contents;
use crate::extra::{refusal, resolve};
use crate::ident::{Idents, Prefix};
use crate::ops::{BatchAdd, FuzzOp, Id, Num, Plan};

macro_rules! ensure {
    ($cond:expr, $($arg:tt)+) => {
        if !$cond {
            return Err(format!($($arg)+));
        }
    };
}

/// Sequence ids `Id::Small` picks from.
const SMALL_IDS: u64 = 12;
/// Fresh tokens never collide with base streams.
const FIRST_FRESH_TOKEN: u32 = 1 << 24;

#[derive(Clone, Debug)]
struct Seq {
    tokens: Vec<u32>,
    extra: ExtraKeys,
    keys: Vec<Prefix>,
}

/// What the manager looks like from outside, for "an error changed nothing".
#[derive(Debug, PartialEq)]
struct Outside {
    usage: Vec<PoolUsage>,
    stats: Stats,
    sequences: usize,
    in_flight: Option<u64>,
    scheduled_tokens: usize,
}

/// Which `BlockStored` keys a call may emit.
enum Stores {
    None,
    /// Prefixes of these identities (each sequence's keys up to its chunk end).
    Some(HashSet<Prefix>),
}

pub(crate) struct Fuzz {
    m: CacheManager,
    config: CacheConfig,
    unit: u32,
    /// Plans another manager of the same configuration built (step ids 1 to 4).
    foreign: Vec<StepPlan>,
    idents: Idents,
    digests: HashMap<Digest, Prefix>,
    seqs: BTreeMap<u64, Seq>,
    finished: BTreeMap<u64, Seq>,
    /// Every prefix identity a committed step computed.
    computed: HashSet<Prefix>,
    /// Scheduled for the next plan.
    pending: BTreeSet<u64>,
    /// Sequences with a committed step since they were added or preempted.
    committed_once: HashSet<u64>,
    /// What the engine wrote into every block.
    contents: Contents,
    in_flight: Option<StepPlan>,
    /// The plans built, the latest last (a few).
    built: Vec<StepPlan>,
    reused: StepPlan,
    next_token: u32,
    next_id: u64,
    removed_seen: u64,
    /// A wire buffer kept across drains, as the bindings keep theirs (written in place).
    wire: Vec<u8>,
    /// API calls made.
    pub calls: u64,
    /// How often the interesting outcomes happened (reported by the long run).
    pub seen: BTreeMap<&'static str, u64>,
}

fn num(n: Num, small_scale: u32) -> u32 {
    match n {
        Num::Small(i) => u32::from(i) % small_scale.max(1),
        Num::Bound(i) => MAX_LOOKAHEAD_TOKENS - 1 + u32::from(i % 3),
        Num::Max => u32::MAX,
        Num::Any(v) => v,
    }
}

/// A configuration unlike most the fuzz draws: two paged groups and two state groups.
fn other_groups() -> CacheConfig {
    let state =
        || GroupKind::State(StateGroupConfig { reserve_per_sequence: 0, ..Default::default() });
    CacheConfig {
        hash: prefixcache_core::HashConfig { unit: 2, ..Default::default() },
        pools: vec![prefixcache_core::PoolConfig { num_blocks: 64 }],
        groups: vec![
            GroupConfig { kind: state(), pool: 0 },
            GroupConfig { kind: GroupKind::FullAttention { block_size: 4 }, pool: 0 },
            GroupConfig { kind: GroupKind::SlidingWindow { block_size: 2, window: 4 }, pool: 0 },
            GroupConfig { kind: state(), pool: 0 },
        ],
        ..CacheConfig::default()
    }
}

fn not_invariant<T: std::fmt::Debug>(what: &str, r: &Result<T, CacheError>) -> Result<(), String> {
    ensure!(!matches!(r, Err(CacheError::Invariant { .. })), "{what}: {r:?}");
    Ok(())
}

impl Fuzz {
    /// A manager for `config`, and a second one that builds the foreign plans.
    pub(crate) fn new(config: CacheConfig) -> Result<Self, String> {
        let m = CacheManager::new(config.clone()).map_err(|e| format!("config refused: {e}"))?;
        // Plans of another manager of this configuration (steps 1 to 4) and of one with other
        // groups (steps 1 and 2), whose refills must lay the plan out anew.
        let mut foreign = Vec::new();
        let unit = config.hash.unit;
        for (other, steps) in [(config.clone(), 4u32), (other_groups(), 2)] {
            let mut other = CacheManager::new(other).map_err(|e| e.to_string())?;
            let unit = other.config().hash.unit;
            for i in 0..steps {
                let tokens: Vec<u32> = (0..3 * unit + i).map(|t| t + 7 * i).collect();
                other
                    .add(u64::from(i), &tokens, ExtraKeys::default(), None)
                    .map_err(|e| e.to_string())?;
                let _ = other.schedule(u64::from(i), u32::MAX, 0, false);
                let plan = other.build_plan().map_err(|e| e.to_string())?;
                other.commit(&plan).map_err(|e| e.to_string())?;
                foreign.push(plan);
            }
        }
        Ok(Self {
            m,
            unit,
            config,
            foreign,
            idents: Idents::default(),
            digests: HashMap::new(),
            seqs: BTreeMap::new(),
            finished: BTreeMap::new(),
            computed: HashSet::new(),
            pending: BTreeSet::new(),
            committed_once: HashSet::new(),
            contents: Contents::default(),
            in_flight: None,
            built: Vec::new(),
            reused: StepPlan::default(),
            next_token: FIRST_FRESH_TOKEN,
            next_id: 1000,
            removed_seen: 0,
            wire: vec![0xa5; 7],
            calls: 0,
            seen: BTreeMap::new(),
        })
    }

    fn saw(&mut self, what: &'static str) {
        *self.seen.entry(what).or_default() += 1;
    }

    fn outside(&self) -> Outside {
        Outside {
            usage: self.m.pool_usage(),
            stats: self.m.stats(),
            sequences: self.m.num_sequences(),
            in_flight: self.m.plan_in_flight(),
            scheduled_tokens: self.m.scheduled_tokens(),
        }
    }

    fn id(&mut self, id: Id) -> u64 {
        match id {
            Id::Fresh => {
                self.next_id += 1;
                self.next_id
            }
            Id::Small(i) => 1 + u64::from(i) % SMALL_IDS,
            Id::Huge(i) => u64::MAX - u64::from(i % 3),
            Id::Known(i) => {
                let known: Vec<u64> =
                    self.seqs.keys().chain(self.finished.keys()).copied().collect();
                if known.is_empty() {
                    1 + u64::from(i) % SMALL_IDS
                } else {
                    known[usize::from(i) % known.len()]
                }
            }
        }
    }

    fn fresh(&mut self, n: usize) -> Vec<u32> {
        let start = self.next_token;
        self.next_token += n as u32;
        (start..self.next_token).collect()
    }

    /// Runs one operation and every check after it.
    #[allow(clippy::too_many_lines)]
    pub(crate) fn apply(&mut self, op: &FuzzOp) -> Result<(), String> {
        match op {
            FuzzOp::Add { id, source, len, suffix, extends, extra, high_tokens } => {
                let known: Vec<&Seq> = self.seqs.values().chain(self.finished.values()).collect();
                let (mut tokens, base) = if source % 3 == 0 || known.is_empty() {
                    let base = if *high_tokens {
                        u32::MAX - 200
                    } else {
                        u32::from(source / 3 % 4) * 1000
                    };
                    ((base..base + u32::from(*len)).collect::<Vec<u32>>(), None)
                } else {
                    let s = known[usize::from(*source) % known.len()];
                    (
                        s.tokens[..s.tokens.len().min(usize::from(*len))].to_vec(),
                        Some(s.extra.clone()),
                    )
                };
                tokens.extend(self.fresh(usize::from(*suffix)));
                let keys = resolve(extra, tokens.len() as u32, base.as_ref());
                let id = self.id(*id);
                let extends = extends.map(|e| self.id(e));
                self.add(id, tokens, keys, extends)?;
            }
            FuzzOp::AddBatch { adds, threads } => self.add_batch(adds, usize::from(*threads))?,
            FuzzOp::Lookup(id) => {
                let id = self.id(*id);
                let before = self.m.pool_usage();
                self.calls += 1;
                let r = self.m.lookup(id);
                not_invariant("lookup", &r)?;
                ensure!(self.m.pool_usage() == before, "lookup changed the pools");
                match (self.seqs.get(&id), r) {
                    (Some(seq), Ok(hit)) => self.check_hit(seq, &hit, "lookup")?,
                    (None, Err(CacheError::UnknownSequence { .. })) => {}
                    (live, r) => {
                        return Err(format!("lookup of {id} (live {}): {r:?}", live.is_some()))
                    }
                }
                self.absorb(&Stores::None)?;
            }
            FuzzOp::Schedule { id, budget, lookahead, exact } => {
                let id = self.id(*id);
                let (budget, lookahead) = (num(*budget, 48), num(*lookahead, 8));
                self.schedule(&[id], &[budget], Some(lookahead), *exact)?;
            }
            FuzzOp::ScheduleBatch { ids, budget, exact, repeat } => {
                let mut ids: Vec<u64> = ids.iter().map(|&i| self.id(i)).collect();
                if ids.is_empty() {
                    ids = self.runnable();
                }
                if *repeat && !ids.is_empty() {
                    ids.push(ids[0]);
                }
                let budgets: Vec<u32> =
                    (0..ids.len()).map(|i| num(*budget, 48) >> (i % 2)).collect();
                self.schedule(&ids, &budgets, None, *exact)?;
            }
            FuzzOp::SuggestChunk { id, budget } => {
                let id = self.id(*id);
                self.calls += 1;
                let r = self.m.suggest_chunk(id, num(*budget, 48));
                not_invariant("suggest_chunk", &r)?;
                if let (Ok(n), Some(seq)) = (&r, self.seqs.get(&id)) {
                    ensure!(
                        *n <= seq.tokens.len() as u32,
                        "suggest_chunk({id}) = {n} for {} tokens",
                        seq.tokens.len()
                    );
                    let budget = *n;
                    self.schedule(&[id], &[budget], Some(0), false)?;
                }
                self.absorb(&Stores::None)?;
            }
            FuzzOp::RequestCheckpoint { id, position } => {
                let id = self.id(*id);
                let len = self.seqs.get(&id).map_or(0, |s| s.tokens.len() as u32);
                let p = match position {
                    Num::Bound(i) => len.wrapping_add(u32::from(*i % 5)).wrapping_sub(2),
                    &n => num(n, len.max(1) + 4),
                };
                self.guarded("request_checkpoint", |m| m.request_checkpoint(id, p))?;
            }
            FuzzOp::BuildPlan { into } => self.build(*into)?,
            FuzzOp::Commit { plan, by_plan } => self.end_plan(plan, *by_plan, true)?,
            FuzzOp::Abort { plan, by_plan } => self.end_plan(plan, *by_plan, false)?,
            FuzzOp::Append { id, tokens } => {
                let id = self.id(*id);
                let tokens = self.fresh(usize::from(*tokens));
                self.append(&[id], &tokens, false)?;
            }
            FuzzOp::AppendBatch { ids, repeat } => {
                let mut ids: Vec<u64> = ids.iter().map(|&i| self.id(i)).collect();
                if ids.is_empty() {
                    ids = self.decoding();
                }
                if *repeat && !ids.is_empty() {
                    ids.push(ids[0]);
                }
                let tokens = self.fresh(ids.len());
                self.append(&ids, &tokens, true)?;
            }
            FuzzOp::DecodeStep { commit, everyone } => {
                let ids =
                    if *everyone { self.seqs.keys().copied().collect() } else { self.decoding() };
                self.decode_step(*commit, &ids)?;
            }
            FuzzOp::Finish(id) => {
                let id = self.id(*id);
                self.release(id, true)?;
            }
            FuzzOp::Preempt(id) => {
                let id = self.id(*id);
                self.release(id, false)?;
            }
            FuzzOp::Reset => self.reset()?,
            FuzzOp::BlockTable { group, ids } => {
                let groups = self.config.groups.len() as u32;
                let group = num(*group, groups + 1);
                let ids: Vec<u64> = ids.iter().map(|&i| self.id(i)).collect();
                let before = self.outside();
                self.calls += 1;
                let r = self.m.block_table(group, &ids);
                not_invariant("block_table", &r)?;
                let paged = self
                    .config
                    .groups
                    .get(group as usize)
                    .and_then(|g| g.kind.block_size())
                    .is_some();
                let known = ids.iter().all(|id| self.seqs.contains_key(id));
                ensure!(
                    r.is_ok() == (paged && known),
                    "block_table({group}, {ids:?}) (paged {paged}, ids known {known}): {r:?}"
                );
                if let Ok((flat, rows, cols)) = &r {
                    let blocks =
                        self.config.pools[self.config.groups[group as usize].pool].num_blocks;
                    ensure!(
                        *rows == ids.len()
                            && flat.len() == rows * cols
                            && flat.iter().all(|&b| b >= 0 && (b as u32) < blocks),
                        "block_table({group}) of {rows} x {cols}: {flat:?}"
                    );
                }
                ensure!(self.outside() == before, "block_table changed the manager");
                self.absorb(&Stores::None)?;
            }
            FuzzOp::Step { budget, exact, request, abort } => {
                self.commit_in_flight()?;
                let ids = self.runnable();
                if ids.is_empty() {
                    return self.check();
                }
                let budgets: Vec<u32> =
                    (0..ids.len()).map(|i| num(*budget, 64) >> (i % 2)).collect();
                self.schedule(&ids, &budgets, None, *exact)?;
                let first = self.pending.iter().next().copied();
                if let (Some(p), Some(id)) = (request, first) {
                    let end = self.m.num_computed(id).unwrap_or(0) + 2 * self.unit;
                    let p = num(*p, end + 1);
                    self.guarded("request_checkpoint", |m| m.request_checkpoint(id, p))?;
                }
                self.build(0)?;
                self.end_plan(&Plan::Current, false, !abort)?;
            }
            FuzzOp::OversizedBatch { call } => {
                let id = self.seqs.keys().next().copied().unwrap_or(1);
                let ids = vec![id; MAX_BATCH_SEQUENCES + 1];
                let small = vec![1u32; ids.len()];
                let before = self.outside();
                self.calls += 1;
                let refused = match call % 4 {
                    0 => self.m.schedule_batch(&ids, &small, false).map(|_| ()),
                    1 => self.m.append_batch(&ids, &small),
                    2 => {
                        let mut plan = StepPlan::default();
                        self.m.decode_step(&ids, &small, &mut plan).map(|_| ())
                    }
                    _ => self.m.block_table(0, &ids).map(|_| ()),
                };
                ensure!(
                    matches!(
                        refused,
                        Err(CacheError::InvalidRequest { .. } | CacheError::Step { .. })
                    ),
                    "a batch of {} ids: {refused:?}",
                    ids.len()
                );
                ensure!(self.outside() == before, "a refused oversized batch changed the manager");
                self.saw("oversized batch refused");
                self.absorb(&Stores::None)?;
            }
            FuzzOp::Decode { rounds, fused } => {
                for _ in 0..*rounds {
                    self.commit_in_flight()?;
                    let ids = self.decoding();
                    if ids.is_empty() {
                        break;
                    }
                    if *fused {
                        self.decode_step(false, &ids)?;
                    } else {
                        let tokens = self.fresh(ids.len());
                        self.append(&ids, &tokens, true)?;
                        self.schedule(&ids, &vec![1; ids.len()], None, false)?;
                        self.build(1)?;
                    }
                }
            }
        }
        self.check()
    }

    /// Live sequences with tokens to compute and no pending step.
    fn runnable(&self) -> Vec<u64> {
        self.seqs
            .keys()
            .copied()
            .filter(|id| {
                !self.pending.contains(id)
                    && self.m.num_computed(*id).ok() < self.m.num_tokens(*id).ok()
            })
            .collect()
    }

    /// Live sequences waiting for their next token (started, every token computed).
    fn decoding(&self) -> Vec<u64> {
        let in_flight = |id: &u64| self.in_flight.as_ref().is_some_and(|p| p.seq_ids.contains(id));
        self.seqs
            .keys()
            .copied()
            .filter(|id| {
                let (c, n) = (self.m.num_computed(*id), self.m.num_tokens(*id));
                !self.pending.contains(id) && !in_flight(id) && c == n && c.is_ok_and(|c| c > 0)
            })
            .collect()
    }

    /// A call whose only effect may be an error or a change of pending state: an error must
    /// change nothing.
    fn guarded<T: std::fmt::Debug>(
        &mut self,
        what: &str,
        call: impl FnOnce(&mut CacheManager) -> Result<T, CacheError>,
    ) -> Result<(), String> {
        let before = self.outside();
        self.calls += 1;
        let r = call(&mut self.m);
        not_invariant(what, &r)?;
        if r.is_err() {
            ensure!(self.outside() == before, "a refused {what} changed the manager: {r:?}");
        }
        self.absorb(&Stores::None)
    }

    fn add(
        &mut self,
        id: u64,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        extends: Option<u64>,
    ) -> Result<(), String> {
        let before = self.outside();
        self.calls += 1;
        let r = self.m.add(id, &tokens, extra.clone(), extends);
        self.check_add(id, tokens, extra, extends, r, &before)
    }

    /// `add_batch`: the requests built as `Add` builds them, a batch's earlier requests
    /// counting as known sequences (a prompt, `extends` or an id may be theirs). The rule:
    /// with more than `MAX_HASH_THREADS` threads, or any request `add` would refuse (a live id,
    /// one given earlier in the batch, bad extra keys), the call is refused and changes
    /// nothing; otherwise each result is checked as `add`'s, in order.
    fn add_batch(&mut self, adds: &[BatchAdd], threads: usize) -> Result<(), String> {
        let mut known: Vec<(u64, Vec<u32>, ExtraKeys)> = self
            .seqs
            .iter()
            .chain(self.finished.iter())
            .map(|(&id, s)| (id, s.tokens.clone(), s.extra.clone()))
            .collect();
        let mut requests: Vec<(u64, Vec<u32>, ExtraKeys, Option<u64>)> = Vec::new();
        for (id, source, len, suffix, extends, extra) in adds {
            let (mut tokens, base) = if source % 3 == 0 || known.is_empty() {
                let base = u32::from(source / 3 % 4) * 1000;
                ((base..base + u32::from(*len)).collect::<Vec<u32>>(), None)
            } else {
                let (_, t, e) = &known[usize::from(*source) % known.len()];
                (t[..t.len().min(usize::from(*len))].to_vec(), Some(e.clone()))
            };
            tokens.extend(self.fresh(usize::from(*suffix)));
            let keys = resolve(extra, tokens.len() as u32, base.as_ref());
            let pick = |id: Id, this: &mut Self| match id {
                Id::Known(i) if !known.is_empty() => known[usize::from(i) % known.len()].0,
                other => this.id(other),
            };
            let id = pick(*id, self);
            let extends = extends.map(|e| pick(e, self));
            known.push((id, tokens.clone(), keys.clone()));
            requests.push((id, tokens, keys, extends));
        }
        let mut ids = HashSet::new();
        let refused = requests.iter().position(|(id, tokens, keys, _)| {
            let duplicate = self.seqs.contains_key(id) || !ids.insert(*id);
            duplicate || refusal(keys, tokens.len() as u32).is_some()
        });
        let before = self.outside();
        self.calls += 1;
        let batch = requests
            .iter()
            .map(|(seq_id, tokens, extra, extends)| AddRequest {
                seq_id: *seq_id,
                tokens,
                extra: extra.clone(),
                extends: *extends,
            })
            .collect();
        let r = self.m.add_batch(batch, threads);
        not_invariant("add_batch", &r)?;
        if threads > MAX_HASH_THREADS || refused.is_some() {
            ensure!(
                r.as_ref().is_err_and(|e| e.kind() == "DuplicateSequence"
                    || e.kind() == "InvalidRequest"),
                "add_batch on {threads} threads, request {refused:?} refused by the rule: {r:?}"
            );
            ensure!(self.outside() == before, "a refused add_batch changed the manager");
            self.saw("add_batch refused");
            return self.absorb(&Stores::None);
        }
        let added = r.map_err(|e| format!("add_batch of {} requests: {e}", requests.len()))?;
        ensure!(added.len() == requests.len(), "add_batch returned {} results", added.len());
        for ((id, tokens, keys, extends), a) in requests.into_iter().zip(added) {
            self.check_add(id, tokens, keys, extends, Ok(a), &before)?;
        }
        self.saw("add_batch added");
        Ok(())
    }

    /// Checks what `add` (or `add_batch`, for one request) returned for this request, the
    /// manager's outside being `before` before the call, and records the sequence.
    fn check_add(
        &mut self,
        id: u64,
        tokens: Vec<u32>,
        extra: ExtraKeys,
        extends: Option<u64>,
        r: Result<Added, CacheError>,
        before: &Outside,
    ) -> Result<(), String> {
        not_invariant("add", &r)?;
        let bad = refusal(&extra, tokens.len() as u32);
        let live = self.seqs.contains_key(&id);
        let added = match r {
            Ok(added) => {
                ensure!(!live && bad.is_none(), "add of {id} (live {live}, keys {bad:?}) accepted");
                added
            }
            Err(e) => {
                ensure!(
                    (live && e.kind() == "DuplicateSequence")
                        || (bad.is_some() && e.kind() == "InvalidRequest"),
                    "add of {id} (live {live}, keys {bad:?}): {e}"
                );
                ensure!(self.outside() == *before, "a refused add changed the manager");
                self.saw("add refused");
                return self.absorb(&Stores::None);
            }
        };
        let keys = self.idents.keys(self.unit, &tokens, &extra);
        let digests = hash_prefix(&self.config.hash, &tokens, &extra)
            .map_err(|e| format!("hash_prefix refused what add accepted: {e}"))?;
        for (d, k) in digests.into_iter().zip(&keys) {
            let known = *self.digests.entry(d).or_insert(*k);
            ensure!(known == *k, "one digest for two prefix identities");
        }
        // Whatever was reused is the source's and this prompt's alike.
        let reused = (added.reused_tokens / self.unit) as usize;
        let source = extends.and_then(|e| self.seqs.get(&e).or_else(|| self.finished.get(&e)));
        ensure!(
            !added.extends_found || source.is_some(),
            "add of {id} found extends {extends:?}, which is neither live nor finished"
        );
        if let Some(source) = source.filter(|_| added.extends_found) {
            ensure!(
                source.keys.len() >= reused && source.keys[..reused] == keys[..reused],
                "add of {id} reused {reused} units of {extends:?} whose keys differ"
            );
            self.saw("add reused units of extends");
        } else if reused > 0 {
            // From a live sequence with the same first unit.
            let any = self
                .seqs
                .values()
                .any(|s| s.keys.len() >= reused && s.keys[..reused] == keys[..reused]);
            ensure!(any, "add of {id} reused {reused} units no live sequence shares");
            self.saw("add reused a live prefix");
        }
        ensure!(
            added.reused_tokens as usize <= tokens.len() && added.reused_tokens % self.unit == 0,
            "add of {id}: {added:?}"
        );
        self.finished.remove(&id);
        self.seqs.insert(id, Seq { tokens, extra, keys });
        self.absorb(&Stores::None)
    }

    /// A hit of `seq` rests only on computed prefixes with its identity.
    fn check_hit(&self, seq: &Seq, hit: &Hit, what: &str) -> Result<(), String> {
        let unit = self.unit;
        let max = (seq.tokens.len() as u32 - 1) / unit * unit;
        ensure!(
            hit.max_tokens == max && hit.groups.len() == self.config.groups.len(),
            "{what}: {hit:?} for {} tokens",
            seq.tokens.len()
        );
        let positions = std::iter::once(hit.tokens)
            .chain(hit.groups.iter().map(|g| g.tokens))
            .chain(hit.junction);
        for p in positions {
            ensure!(p % unit == 0 && p <= max, "{what}: position {p} in {hit:?}");
            ensure!(
                p == 0 || self.computed.contains(&seq.keys[(p / unit - 1) as usize]),
                "{what}: {hit:?} rests at {p} on a prefix no committed step computed with these \
                 tokens and extra keys"
            );
        }
        ensure!(
            hit.groups.iter().all(|g| g.tokens >= hit.tokens),
            "{what}: a group's own hit is below the hit: {hit:?}"
        );
        Ok(())
    }

    fn schedule(
        &mut self,
        ids: &[u64],
        budgets: &[u32],
        lookahead: Option<u32>,
        exact: bool,
    ) -> Result<(), String> {
        // A first schedule runs the lookup again: the hit it uses is the one a lookup right
        // before it returns.
        let looked = match lookahead {
            Some(_) if self.seqs.contains_key(&ids[0]) => {
                self.calls += 1;
                self.m.lookup(ids[0]).ok()
            }
            _ => None,
        };
        let before = self.outside();
        self.calls += 1;
        let r = match lookahead {
            Some(l) => self.m.schedule(ids[0], budgets[0], l, exact).map(|s| vec![s]),
            None => self.m.schedule_batch(ids, budgets, exact),
        };
        not_invariant("schedule", &r)?;
        let results = match r {
            Err(e) => {
                ensure!(self.outside() == before, "a refused schedule changed the manager: {e}");
                self.saw("schedule refused with an error");
                return self.absorb(&Stores::None);
            }
            Ok(results) => results,
        };
        ensure!(self.in_flight.is_none(), "schedule accepted with a plan in flight");
        ensure!(
            lookahead.is_none_or(|l| l <= MAX_LOOKAHEAD_TOKENS),
            "schedule accepted a lookahead of {lookahead:?}"
        );
        ensure!(results.len() == ids.len(), "{} results for {} ids", results.len(), ids.len());
        for ((&id, &budget), result) in ids.iter().zip(budgets).zip(results) {
            let Some(s) = result else {
                self.saw("schedule refused for want of blocks");
                continue;
            };
            let seq = self.seqs.get(&id).ok_or_else(|| format!("scheduled unknown {id}"))?;
            let Scheduled { seq_id, num_computed, num_tokens, hit } = &s;
            ensure!(
                *seq_id == id
                    && *num_tokens <= budget
                    && u64::from(*num_computed) + u64::from(*num_tokens) <= seq.tokens.len() as u64,
                "schedule of {id} with budget {budget}: {s:?}"
            );
            if let Some(hit) = hit {
                self.check_hit(seq, hit, "schedule")?;
                if let Some(looked) = looked.as_ref().filter(|_| lookahead.is_some()) {
                    ensure!(
                        looked == hit,
                        "the first schedule of {id} used {hit:?}, the lookup before it gave {looked:?}"
                    );
                }
                ensure!(
                    *num_computed == hit.tokens,
                    "first schedule of {id} not at its hit: {s:?}"
                );
            }
            if *num_tokens > 0 {
                self.pending.insert(id);
            }
        }
        self.absorb(&Stores::None)
    }

    /// `build_plan` (`into % 4 == 0`) or `build_plan_into` a plan of this manager, a foreign
    /// one, or a fresh one.
    fn build(&mut self, into: u8) -> Result<(), String> {
        let before = self.outside();
        self.calls += 1;
        let r = match into % 4 {
            0 => self.m.build_plan(),
            1 => {
                let mut plan = std::mem::take(&mut self.reused);
                let r = self.m.build_plan_into(&mut plan).map(|()| plan.clone());
                self.reused = plan;
                r
            }
            2 => {
                let mut plan = self.foreign[usize::from(into / 4) % self.foreign.len()].clone();
                self.saw("plan built into a foreign plan");
                self.m.build_plan_into(&mut plan).map(|()| plan)
            }
            _ => {
                let mut plan = StepPlan::default();
                self.m.build_plan_into(&mut plan).map(|()| plan)
            }
        };
        not_invariant("build_plan", &r)?;
        let plan = match r {
            Err(e) => {
                ensure!(
                    self.in_flight.is_some() || e.kind() == "InvalidRequest",
                    "build_plan refused with nothing in flight: {e}"
                );
                ensure!(self.outside() == before, "a refused build_plan changed the manager");
                return self.absorb(&Stores::None);
            }
            Ok(plan) => plan,
        };
        ensure!(self.in_flight.is_none(), "build_plan accepted with a plan in flight");
        if let Some(last) = self.built.last() {
            ensure!(
                plan.step_id > last.step_id,
                "step {} built after {}",
                plan.step_id,
                last.step_id
            );
        }
        let ids: BTreeSet<u64> = plan.seq_ids.iter().copied().collect();
        ensure!(
            ids == self.pending && ids.len() == plan.seq_ids.len(),
            "plan rows {:?}, scheduled {:?}",
            plan.seq_ids,
            self.pending
        );
        self.accept_plan(plan)?;
        self.absorb(&Stores::None)
    }

    /// Shapes, ids, slots and offsets of a plan.
    #[allow(clippy::too_many_lines)]
    fn check_plan(&self, plan: &StepPlan) -> Result<(), String> {
        let rows = plan.seq_ids.len();
        ensure!(
            plan.num_computed.len() == rows
                && plan.num_scheduled.len() == rows
                && plan.query_start_loc.len() == rows + 1
                && plan.query_start_loc[0] == 0,
            "plan shape: {plan:?}"
        );
        for r in 0..rows {
            let seq = self.seqs.get(&plan.seq_ids[r]).ok_or("plan row of an unknown sequence")?;
            let (start, n) = (plan.num_computed[r], plan.num_scheduled[r]);
            ensure!(
                start >= 0
                    && n > 0
                    && (start + n) as usize <= seq.tokens.len()
                    && plan.query_start_loc[r + 1] == plan.query_start_loc[r] + n,
                "plan row {r}: computed {start}, scheduled {n} of {} tokens",
                seq.tokens.len()
            );
            let start = start as u32;
            if start > 0 && start % self.unit == 0 {
                ensure!(
                    self.computed.contains(&seq.keys[(start / self.unit - 1) as usize]),
                    "plan row {r} resumes at {start} from a prefix no committed step computed"
                );
            }
        }
        let tokens = plan.query_start_loc[rows] as usize;
        let groups = &self.config.groups;
        let paged: Vec<u32> = (0..groups.len() as u32)
            .filter(|&g| groups[g as usize].kind.block_size().is_some())
            .collect();
        let state: Vec<u32> = (0..groups.len() as u32)
            .filter(|&g| groups[g as usize].kind.block_size().is_none())
            .collect();
        ensure!(
            plan.paged.iter().map(|p| p.group).eq(paged.iter().copied())
                && plan.state.iter().map(|s| s.group).eq(state.iter().copied()),
            "plan groups: paged {:?}, state {:?}",
            plan.paged.iter().map(|p| p.group).collect::<Vec<_>>(),
            plan.state.iter().map(|s| s.group).collect::<Vec<_>>()
        );
        let blocks = |g: u32| i64::from(self.config.pools[groups[g as usize].pool].num_blocks);
        for p in &plan.paged {
            let (n, b) = (
                blocks(p.group),
                i64::from(groups[p.group as usize].kind.block_size().unwrap_or(1)),
            );
            ensure!(
                p.appended.len() % 3 == 0
                    // A first step of a window appends nulls outside the window.
                    && p.appended.chunks(3).all(|t| (t[0] as usize) < rows && t[1] >= 0 && t[2] >= 0 && i64::from(t[2]) < n)
                    && p.replaced.len() % 3 == 0
                    && p.replaced.chunks(3).all(|t| (t[0] as usize) < rows && t[1] >= 0 && t[2] == 0)
                    && p.slot_mapping.len() == tokens
                    && p.slot_mapping.iter().all(|&s| s >= b && s < n * b),
                "paged plan of group {}: {p:?}",
                p.group
            );
        }
        for s in &plan.state {
            let n = blocks(s.group);
            let cmax = s.max_checkpoints;
            ensure!(
                s.running_slot.len() == rows
                    && s.initial_slot.len() == rows
                    && s.checkpoint_offsets.len() == rows * cmax
                    && s.checkpoint_slots.len() == rows * cmax
                    && s.snapshots.len() % 2 == 0,
                "state plan shape of group {}: {s:?}",
                s.group
            );
            for r in 0..rows {
                let (run, init) = (i64::from(s.running_slot[r]), i64::from(s.initial_slot[r]));
                ensure!(
                    run > 0 && run < n && init != run && (init == -1 || (init > 0 && init < n)),
                    "state group {} row {r}: running {run}, initial {init}",
                    s.group
                );
                for c in 0..cmax {
                    let (o, slot) =
                        (s.checkpoint_offsets[r * cmax + c], s.checkpoint_slots[r * cmax + c]);
                    ensure!(
                        (o == 0 && slot == -1)
                            || (o > 0
                                && o < plan.num_scheduled[r]
                                && slot > 0
                                && i64::from(slot) < n),
                        "state group {} row {r}: checkpoint offset {o} slot {slot}",
                        s.group
                    );
                }
            }
            ensure!(
                s.snapshots
                    .chunks(2)
                    .all(|p| s.running_slot.contains(&p[0]) && p[1] > 0 && i64::from(p[1]) < n),
                "snapshots of group {}: {:?}",
                s.group,
                s.snapshots
            );
        }
        ensure!(
            plan.copies.len() % 4 == 0
                && plan.copies.chunks(4).all(|c| {
                    let g = c[0] as usize;
                    g < groups.len()
                        && groups[g]
                            .kind
                            .block_size()
                            .is_some_and(|b| c[3] > 0 && c[3] < i64::from(b))
                        && c[1] > 0
                        && c[2] > 0
                        && c[1] != c[2]
                        && c[1] < blocks(g as u32)
                        && c[2] < blocks(g as u32)
                }),
            "copies {:?}",
            plan.copies
        );
        Ok(())
    }

    /// What a plan reads is what the engine wrote (`content.rs`).
    fn check_contents(&mut self, plan: &StepPlan) -> Result<(), String> {
        let seqs = &self.seqs;
        let once = &self.committed_once;
        let keys = |id: u64| seqs.get(&id).map(|s| s.keys.as_slice());
        let first = |r: usize| !once.contains(&plan.seq_ids[r]);
        self.contents.plan(&self.config, plan, &keys, &first)
    }

    /// The engine ran the plan: its writes, or garbage where an aborted step wrote.
    fn run_plan(&mut self, plan: &StepPlan, committed: bool) -> Result<(), String> {
        let seqs = &self.seqs;
        let keys = |id: u64| seqs.get(&id).map(|s| s.keys.as_slice());
        self.contents.ran(&self.config, plan, &keys, committed)?;
        if committed {
            self.committed_once.extend(plan.seq_ids.iter().copied());
        }
        Ok(())
    }

    fn commit_in_flight(&mut self) -> Result<(), String> {
        if self.in_flight.is_some() {
            self.end_plan(&Plan::Current, false, true)?;
        }
        Ok(())
    }

    /// Commit (or abort) of the plan `which` names, by plan or by step id.
    fn end_plan(&mut self, which: &Plan, by_plan: bool, commit: bool) -> Result<(), String> {
        let plan = match which {
            Plan::Current => match self.in_flight.clone().or_else(|| self.built.last().cloned()) {
                Some(plan) => plan,
                None => return Ok(()),
            },
            Plan::Stale(i) if !self.built.is_empty() => {
                self.built[usize::from(*i) % self.built.len()].clone()
            }
            Plan::Foreign(i) => self.foreign[usize::from(*i) % self.foreign.len()].clone(),
            Plan::Stale(i) | Plan::Id(i) => {
                let next = self.built.last().map_or(1, |p| p.step_id + 1);
                StepPlan {
                    step_id: [0, u64::MAX, next][usize::from(*i) % 3],
                    ..StepPlan::default()
                }
            }
        };
        let before = self.outside();
        self.calls += 1;
        let r = match (commit, by_plan) {
            (true, true) => self.m.commit(&plan),
            (true, false) => self.m.commit_step(plan.step_id),
            (false, true) => self.m.abort(&plan).map(drop),
            (false, false) => self.m.abort_step(plan.step_id).map(drop),
        };
        not_invariant("commit/abort", &r)?;
        // By plan, the step in flight ends only for the plan this manager built (a plan carries
        // its manager); by id, any plan's id names it.
        let ours = self
            .in_flight
            .as_ref()
            .is_some_and(|p| p.step_id == plan.step_id && (!by_plan || p.manager == plan.manager));
        if !ours {
            if by_plan && self.in_flight.as_ref().is_some_and(|p| p.step_id == plan.step_id) {
                self.saw("a foreign plan with the step id in flight refused");
            }
            ensure!(
                matches!(r, Err(CacheError::StalePlan { .. })),
                "commit/abort of step {} (in flight {:?}): {r:?}",
                plan.step_id,
                self.in_flight.as_ref().map(|p| p.step_id)
            );
            ensure!(self.outside() == before, "a refused commit changed the manager");
            self.saw("stale or foreign plan refused");
            return self.absorb(&Stores::None);
        }
        r.map_err(|e| format!("commit/abort of the plan in flight: {e}"))?;
        if matches!(which, Plan::Foreign(_)) {
            // `commit_step` / `abort_step` take an id, whoever built the plan it came from.
            self.saw("a foreign plan's step id ended the step in flight");
        }
        let own = self.in_flight.take().ok_or("no plan in flight")?;
        self.run_plan(&own, commit)?;
        if !commit {
            self.saw("abort");
            return self.absorb(&Stores::None);
        }
        self.saw("commit");
        let stores = self.computed_by(&own);
        self.absorb(&Stores::Some(stores))
    }

    /// Checks a plan just built (its shape and what it reads) and puts it in flight, keeping
    /// the last few built for stale commits.
    fn accept_plan(&mut self, plan: StepPlan) -> Result<(), String> {
        self.check_plan(&plan)?;
        self.check_reserve(&plan)?;
        self.check_contents(&plan)?;
        self.pending.clear();
        self.built.push(plan.clone());
        if self.built.len() > 4 {
            self.built.remove(0);
        }
        self.in_flight = Some(plan);
        Ok(())
    }

    /// Section 4's reserve, stated on its own: each state group promises every started
    /// sequence (the plan's rows, and every live sequence with computed tokens) its
    /// `reserve_per_sequence` free or evictable blocks of its pool, and checkpoints draw on
    /// the pool whichever group takes them. So once the plan has placed a checkpoint in a
    /// pool, that pool still has room for every promise of every state group drawing on it.
    /// (One plan in flight: no further running buffers to keep.)
    fn check_reserve(&mut self, plan: &StepPlan) -> Result<(), String> {
        let mut started: BTreeSet<u64> = plan.seq_ids.iter().copied().collect();
        for &id in self.seqs.keys() {
            if self.m.num_computed(id).map_err(|e| format!("num_computed of live {id}: {e}"))? > 0 {
                started.insert(id);
            }
        }
        let usage = self.m.pool_usage();
        let mut across = false;
        for sp in &plan.state {
            let pool = self.config.groups[sp.group as usize].pool;
            let placed = sp.checkpoint_slots.iter().any(|&s| s > 0) || !sp.snapshots.is_empty();
            if !placed {
                continue;
            }
            let available = u64::from(usage[pool].free + usage[pool].cached);
            for (h, g) in self.config.groups.iter().enumerate().filter(|(_, g)| g.pool == pool) {
                let GroupKind::State(promise) = &g.kind else { continue };
                let kept = u64::from(promise.reserve_per_sequence) * started.len() as u64;
                ensure!(
                    available >= kept,
                    "group {}'s checkpoints left pool {pool} {available} free or evictable \
                     blocks, below the {kept} group {h} keeps for {} started sequences",
                    sp.group,
                    started.len()
                );
                across |= h != sp.group as usize && kept > 0;
            }
        }
        if across {
            self.saw("a checkpoint kept another state group's reserve");
        }
        Ok(())
    }

    /// Marks what `plan`'s step computed, and returns the keys its commit may store.
    fn computed_by(&mut self, plan: &StepPlan) -> HashSet<Prefix> {
        let mut stores = HashSet::new();
        for (r, id) in plan.seq_ids.iter().enumerate() {
            let Some(seq) = self.seqs.get(id) else { continue };
            let end = (plan.num_computed[r] + plan.num_scheduled[r]) as u32;
            let units = (end / self.unit) as usize;
            stores.extend(seq.keys[..units.min(seq.keys.len())].iter().copied());
        }
        self.computed.extend(stores.iter().copied());
        stores
    }

    fn append(&mut self, ids: &[u64], tokens: &[u32], batch: bool) -> Result<(), String> {
        let before = self.outside();
        self.calls += 1;
        let r =
            if batch { self.m.append_batch(ids, tokens) } else { self.m.append(ids[0], tokens) };
        not_invariant("append", &r)?;
        if r.is_err() {
            ensure!(self.outside() == before, "a refused append changed the manager: {r:?}");
            return self.absorb(&Stores::None);
        }
        ensure!(self.in_flight.is_none(), "append accepted with a plan in flight");
        let distinct: BTreeSet<&u64> = ids.iter().collect();
        ensure!(!batch || distinct.len() == ids.len(), "append_batch accepted a repeated id");
        for (i, id) in ids.iter().enumerate() {
            let seq = self.seqs.get_mut(id).ok_or_else(|| format!("append to unknown {id}"))?;
            seq.tokens.extend_from_slice(if batch { &tokens[i..=i] } else { tokens });
            let (t, e) = (seq.tokens.clone(), seq.extra.clone());
            let keys = self.idents.keys(self.unit, &t, &e);
            let digests = hash_prefix(&self.config.hash, &t, &e).map_err(|e| e.to_string())?;
            for (d, k) in digests.into_iter().zip(&keys) {
                let known = *self.digests.entry(d).or_insert(*k);
                ensure!(known == *k, "one digest for two prefix identities");
            }
            self.seqs.get_mut(id).ok_or("gone")?.keys = keys;
        }
        self.absorb(&Stores::None)
    }

    /// `decode_step` with the plan the last one built, made to hold the plan in flight when
    /// `commit` (as an engine's buffers do); otherwise it may hold that plan, an older one or
    /// none.
    fn decode_step(&mut self, commit: bool, ids: &[u64]) -> Result<(), String> {
        let tokens = self.fresh(ids.len());
        let before = self.outside();
        let mut plan = std::mem::take(&mut self.reused);
        if let Some(own) = self.in_flight.as_ref().filter(|_| commit) {
            (plan.manager, plan.step_id) = (own.manager, own.step_id);
        }
        // The step is committed iff the plan holds the one in flight.
        let commits = self
            .in_flight
            .as_ref()
            .is_some_and(|p| (p.manager, p.step_id) == (plan.manager, plan.step_id));
        let held = plan.step_id;
        self.calls += 1;
        let r = self.m.decode_step(ids, &tokens, &mut plan);
        not_invariant("decode_step", &r)?;
        let mut stores = HashSet::new();
        if commits {
            // The commit happens first and stands even if the rest is refused.
            let own = self.in_flight.take().ok_or("no plan in flight")?;
            self.run_plan(&own, true)?;
            stores = self.computed_by(&own);
        } else if let Some(own) = &self.in_flight {
            // Another plan in flight than the one the plan holds: refused, nothing committed.
            ensure!(
                matches!(r, Err(CacheError::Step { .. })),
                "decode_step with a plan of step {held} while step {} is in flight: {r:?}",
                own.step_id
            );
            self.saw("decode_step refused: another plan in flight");
        } else if commit {
            self.saw("decode_step with nothing in flight to commit");
        }
        let results = match r {
            Err(e) => {
                self.reused = plan;
                if !commits {
                    ensure!(
                        self.outside() == before,
                        "a refused decode_step changed the manager: {e}"
                    );
                }
                self.saw("decode_step refused");
                return self.absorb(&Stores::Some(stores));
            }
            Ok(results) => results,
        };
        ensure!(self.in_flight.is_none(), "decode_step built with a plan in flight");
        ensure!(results.len() == ids.len(), "decode_step returned {} results", results.len());
        for (i, id) in ids.iter().enumerate() {
            let seq =
                self.seqs.get_mut(id).ok_or_else(|| format!("decode_step of unknown {id}"))?;
            seq.tokens.push(tokens[i]);
            let (t, e) = (seq.tokens.clone(), seq.extra.clone());
            let keys = self.idents.keys(self.unit, &t, &e);
            for (d, k) in hash_prefix(&self.config.hash, &t, &e)
                .map_err(|e| e.to_string())?
                .into_iter()
                .zip(&keys)
            {
                self.digests.entry(d).or_insert(*k);
            }
            self.seqs.get_mut(id).ok_or("gone")?.keys = keys;
            if results[i].as_ref().is_some_and(|s| s.num_tokens > 0) {
                self.pending.insert(*id);
            }
        }
        let ids: BTreeSet<u64> = plan.seq_ids.iter().copied().collect();
        ensure!(
            ids == self.pending,
            "decode_step planned {:?}, scheduled {:?}",
            plan.seq_ids,
            self.pending
        );
        self.accept_plan(plan.clone())?;
        self.reused = plan;
        self.saw("decode_step");
        self.absorb(&Stores::Some(stores))
    }

    fn release(&mut self, id: u64, finish: bool) -> Result<(), String> {
        let before = self.outside();
        let computed = self.m.num_computed(id).unwrap_or(0);
        self.calls += 1;
        let r = if finish { self.m.finish(id) } else { self.m.preempt(id) };
        not_invariant("finish/preempt", &r)?;
        if r.is_err() {
            ensure!(
                self.outside() == before,
                "a refused finish/preempt changed the manager: {r:?}"
            );
            return self.absorb(&Stores::None);
        }
        ensure!(self.in_flight.is_none(), "finish/preempt accepted with a plan in flight");
        self.pending.remove(&id);
        self.committed_once.remove(&id);
        if !finish {
            return self.absorb(&Stores::None);
        }
        let seq = self.seqs.remove(&id).ok_or_else(|| format!("finished unknown {id}"))?;
        let units = (computed / self.unit) as usize;
        let stores: HashSet<Prefix> =
            seq.keys[..units.min(seq.keys.len())].iter().copied().collect();
        self.finished.insert(id, seq);
        self.absorb(&Stores::Some(stores))
    }

    fn reset(&mut self) -> Result<(), String> {
        let before = self.outside();
        self.calls += 1;
        let r = self.m.reset();
        not_invariant("reset", &r)?;
        if r.is_err() {
            ensure!(self.outside() == before, "a refused reset changed the manager: {r:?}");
            return self.absorb(&Stores::None);
        }
        self.pending.clear();
        self.committed_once.clear();
        self.contents.clear();
        let events: Vec<CacheEvent> = self.m.drain_events().into_iter().map(|e| e.event).collect();
        ensure!(
            events.iter().all(|e| matches!(e, CacheEvent::AllBlocksCleared)),
            "reset emitted {events:?}"
        );
        for u in self.m.pool_usage() {
            ensure!(u.free + 1 == u.num_blocks, "after reset: {u:?}");
        }
        self.saw("reset");
        Ok(())
    }

    /// Drains the events of the last call: only the keys `stores` allows may be stored, and
    /// every digest must be one of a known prefix.
    fn absorb(&mut self, stores: &Stores) -> Result<(), String> {
        let records = self.m.drain_events();
        // The wire encoding of any batch the manager emits is total (no slice out of range)
        // and writes the array of three with one entry per event that has a wire form.
        let mut wire = Vec::new();
        let written = prefixcache_core::events::encode_batch(
            &records,
            self.m.event_format(),
            1.0,
            Some(0),
            &mut wire,
        );
        ensure!(written <= records.len() && wire[0] == 0x93, "wire batch of {written} events");
        // Written in place over an earlier batch, the bytes are the same.
        let (size, again) = prefixcache_core::events::encode_batch_into(
            &records,
            self.m.event_format(),
            1.0,
            Some(0),
            &mut self.wire,
        );
        ensure!(
            (again, &self.wire[..size]) == (written, wire.as_slice()),
            "a batch written in place differs from a fresh one"
        );
        for record in records {
            match record.event {
                CacheEvent::BlockStored { keys, group, .. } => {
                    let Stores::Some(allowed) = stores else {
                        return Err(format!(
                            "a call that commits nothing stored keys of group {group}"
                        ));
                    };
                    for d in keys {
                        let p = self.digests.get(&d).ok_or("an event names an unknown digest")?;
                        ensure!(
                            allowed.contains(p),
                            "group {group} stored a key of {} tokens this step did not compute",
                            p.len
                        );
                    }
                }
                CacheEvent::BlockRemoved { keys, .. } => {
                    self.removed_seen += 1;
                    ensure!(
                        keys.iter().all(|d| self.digests.contains_key(d)),
                        "an eviction names an unknown digest"
                    );
                }
                CacheEvent::AllBlocksCleared => return Err("AllBlocksCleared outside reset".into()),
            }
        }
        Ok(())
    }

    /// After every operation.
    pub(crate) fn check(&mut self) -> Result<(), String> {
        self.m.check_invariants().map_err(|e| format!("check_invariants: {e}"))?;
        ensure!(
            self.m.plan_in_flight() == self.in_flight.as_ref().map(|p| p.step_id),
            "plan in flight {:?}, expected {:?}",
            self.m.plan_in_flight(),
            self.in_flight.as_ref().map(|p| p.step_id)
        );
        ensure!(self.m.num_sequences() == self.seqs.len(), "{} sequences", self.m.num_sequences());
        for (p, u) in self.m.pool_usage().iter().enumerate() {
            ensure!(
                u.free + u.cached + u.owned + 1 == u.num_blocks
                    && u.checkpoints <= u.cached + u.owned,
                "pool usage {u:?}"
            );
            // A pool with one state group: its checkpoints are that group's, within its cap.
            let state: Vec<&StateGroupConfig> = self
                .config
                .groups
                .iter()
                .filter(|g| g.pool == p)
                .filter_map(|g| match &g.kind {
                    GroupKind::State(s) => Some(s),
                    _ => None,
                })
                .collect();
            if let [only] = state[..] {
                ensure!(
                    only.checkpoint_cap.is_none_or(|cap| u.checkpoints <= cap),
                    "pool {p} holds {} checkpoints, beyond its state group's cap {:?}",
                    u.checkpoints,
                    only.checkpoint_cap
                );
            }
        }
        let stats = self.m.stats();
        ensure!(
            self.removed_seen <= stats.evictions
                && stats.evictions <= self.removed_seen + stats.events_dropped,
            "{} evictions counted, {} seen, {} events dropped",
            stats.evictions,
            self.removed_seen,
            stats.events_dropped
        );
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.calls += 1;
            let hit = self.m.lookup(id).map_err(|e| format!("lookup of live {id}: {e}"))?;
            self.check_hit(&self.seqs[&id], &hit, "lookup")?;
        }
        self.absorb(&Stores::None)
    }

    /// Commits what is in flight, finishes everything: no block may stay owned.
    pub(crate) fn wind_down(&mut self) -> Result<(), String> {
        self.commit_in_flight()?;
        let ids: Vec<u64> = self.seqs.keys().copied().collect();
        for id in ids {
            self.release(id, true)?;
        }
        self.check()?;
        for (p, u) in self.m.pool_usage().iter().enumerate() {
            ensure!(u.owned == 0, "pool {p} after finishing everything: {u:?}");
        }
        self.reset()?;
        self.check()?;
        let names = [
            "hit column read checked",
            "copy-on-write source checked",
            "resumed checkpoint checked",
            "running state read checked",
        ];
        for (name, n) in names.into_iter().zip(self.contents.checked) {
            *self.seen.entry(name).or_default() += n;
        }
        Ok(())
    }
}
