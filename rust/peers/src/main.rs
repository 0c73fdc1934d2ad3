//! prefixcache's core against Dynamo's `kvbm-logical` 1.6.1 block manager, on the same
//! scheduler loop, in one process, in alternating runs.
//!
//! `benchmarks/peers_kvbm.py` writes the token streams of `benchmarks/vs_vllm_workloads.py`
//! to a folder (`index.json` + `tokens.u32`, see [`Workload::load`]) and reads what this
//! binary prints. The loop ([`simulate`]) is `simulate` of `benchmarks/vs_vllm.py`, step for
//! step: the requests that arrived since the last step taken in with one `add_batch`, then
//! running decodes, then running prefill chunks, then admissions under one token budget per
//! step; a request samples its next output token once all its known tokens are
//! computed and finishes after its last one; a finished request may release follow-ups (the
//! next round of a growing-prefix stream).
//!
//! Each side makes the calls its engine makes, each timed with `Instant` (the loop's own
//! bookkeeping is not timed), hashing included as each side does it:
//!
//! - [`Kvbm`]: one `SchedulableSequence` per request, as Dynamo's scheduler integration
//!   drives it: construction when the request arrives (hashes every full block of the
//!   prompt: `hash`),
//!   `match_and_add_prefix` at admission, `schedule_prefill` per chunk and `apply_prefill`
//!   once the step ran (the final chunk with the first sampled token), `schedule_decode` +
//!   `apply_decode` per decoded token (a completed block is hashed and registered there),
//!   `release` and the drop of the sequence at finish (its blocks go back to the pools).
//! - [`Prefixcache`]: `prefixcache_core::CacheManager`, the calls `PrefixcacheBackend` of
//!   `benchmarks/vs_vllm_backends.py` makes through Python, made directly: `add_batch` of a
//!   step's arrivals (hashing, across the machine's cores), `lookup` + `schedule` at admission, `schedule` per prefill chunk, `decode_step` for a
//!   step that only decodes the sequences that sampled (commit of the step in flight, append,
//!   schedule, plan), otherwise `commit` + `append_batch` + `schedule_batch` +
//!   `build_plan_into`, and `finish`. The engine reads the plan's vectors in place (Python's
//!   `read_plan` has no Rust counterpart).
//!
//! Usage: `kvbm_vs_prefixcache DIR PAIRS` prints one JSON object: per workload, per run, the
//! seconds by call, the call counts, the steps and every request's hit tokens.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

use kvbm_logical::manager::FrequencyTrackingCapacity;
use kvbm_logical::{BlockManager, BlockRegistry, SchedulableSequence, ScheduleError};
use prefixcache_core::{
    AddRequest, CacheConfig, CacheManager, ExtraKeys, GroupConfig, GroupKind, HashAlgorithm,
    HashConfig, PoolConfig, StepPlan,
};
use serde_json::{json, Value};

type Error = Box<dyn std::error::Error>;
type Result<T> = std::result::Result<T, Error>;

/// One request of a workload (see `Request` in `benchmarks/vs_vllm_workloads.py`).
struct Request {
    id: u64,
    prompt: std::ops::Range<usize>,
    output: std::ops::Range<usize>,
    extends: Option<u64>,
    /// Requests with the same key share a prefix (`prefix_len` in `index.json`).
    prefix_key: u64,
    /// Requests released when this one finishes (closed-loop follow-ups).
    follow_ups: Vec<usize>,
}

/// A workload as `peers_kvbm.py` wrote it.
struct Workload {
    name: String,
    block_size: u32,
    token_budget: usize,
    max_running: usize,
    /// Pool size in blocks, the null block included (`ManagerConfig.attention_blocks`).
    pool_blocks: u32,
    tokens: Vec<u32>,
    requests: Vec<Request>,
    initial: Vec<usize>,
}

impl Workload {
    /// `index.json` names the workloads; each has its `tokens` file of little-endian `u32`
    /// and requests whose `prompt` / `output` are `[offset, length]` in it (prompts of one
    /// growing-prefix stream share their tokens), `follow_ups` and `initial` as request
    /// positions.
    fn load(dir: &Path) -> Result<Vec<Self>> {
        let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json"))?)?;
        let field = |v: &Value, k: &str| -> Result<u64> {
            v[k].as_u64().ok_or_else(|| format!("index.json: {k} is not a number").into())
        };
        let range = |v: &Value| -> Result<std::ops::Range<usize>> {
            let start = v[0].as_u64().ok_or("bad range")? as usize;
            let len = v[1].as_u64().ok_or("bad range")? as usize;
            Ok(start..start + len)
        };
        let positions = |v: &Value| -> Result<Vec<usize>> {
            let list = v.as_array().ok_or("not a list")?;
            list.iter().map(|p| Ok(p.as_u64().ok_or("bad position")? as usize)).collect()
        };
        let mut out = Vec::new();
        for w in index["workloads"].as_array().ok_or("index.json: no workloads")? {
            let bytes = std::fs::read(dir.join(w["tokens"].as_str().ok_or("no tokens file")?))?;
            let tokens: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let mut requests = Vec::new();
            for r in w["requests"].as_array().ok_or("no requests")? {
                let request = Request {
                    id: field(r, "id")?,
                    prompt: range(&r["prompt"])?,
                    output: range(&r["output"])?,
                    extends: r["extends"].as_u64(),
                    prefix_key: field(r, "prefix_key")?,
                    follow_ups: positions(&r["follow_ups"])?,
                };
                if request.prompt.end > tokens.len() || request.output.end > tokens.len() {
                    return Err(format!("request {} lies outside the tokens", request.id).into());
                }
                requests.push(request);
            }
            out.push(Self {
                name: w["name"].as_str().ok_or("no name")?.to_owned(),
                block_size: u32::try_from(field(w, "block_size")?)?,
                token_budget: usize::try_from(field(w, "token_budget")?)?,
                max_running: usize::try_from(field(w, "max_running")?)?,
                pool_blocks: u32::try_from(field(w, "pool_blocks")?)?,
                tokens,
                requests,
                initial: positions(&w["initial"])?,
            });
        }
        Ok(out)
    }

    fn prompt(&self, r: &Request) -> &[u32] {
        &self.tokens[r.prompt.clone()]
    }

    fn output(&self, r: &Request) -> &[u32] {
        &self.tokens[r.output.clone()]
    }
}

/// Seconds and call counts by manager call.
#[derive(Default)]
struct Clock {
    seconds: HashMap<&'static str, f64>,
    calls: HashMap<&'static str, u64>,
}

impl Clock {
    fn add(&mut self, name: &'static str, since: Instant, calls: u64) {
        *self.seconds.entry(name).or_default() += since.elapsed().as_secs_f64();
        *self.calls.entry(name).or_default() += calls;
    }
}

/// What the scheduler loop asks of a manager (`Backend` of `vs_vllm_backends.py`).
trait Backend {
    /// Takes in the requests that arrived for this step, in order (hashes their prompts).
    fn add_batch(&mut self, w: &Workload, requests: &[&Request]) -> Result<()>;
    /// Looks the request up and schedules its first chunk: `(hit, tokens)`, or `None` when
    /// the manager has no blocks for it (it stays waiting).
    fn admit(&mut self, w: &Workload, r: &Request, budget: usize)
        -> Result<Option<(usize, usize)>>;
    /// Schedules the next chunk of a running prefill; returns its tokens.
    fn schedule_prefill(&mut self, r: &Request, budget: usize) -> Result<usize>;
    fn schedule_decodes(&mut self, ids: &[u64]) -> Result<()>;
    /// Closes a step in which `scheduled` (request id, tokens) ran.
    fn end_step(&mut self, scheduled: &[(u64, usize)]) -> Result<()>;
    /// One sampled token for each request.
    fn append(&mut self, ids: &[u64], tokens: &[u32]) -> Result<()>;
    fn finish(&mut self, id: u64) -> Result<()>;
    fn clock(&self) -> &Clock;
}

/// One run of one manager over one workload.
struct Run {
    side: String,
    seconds: f64,
    clock_seconds: HashMap<&'static str, f64>,
    calls: HashMap<&'static str, u64>,
    steps: u64,
    hits: Vec<(u64, usize)>,
    /// Per request: the tokens of its shared prefix that steps before its admission computed
    /// (on any request with the same prefix key).
    cover: Vec<(u64, usize)>,
}

impl Run {
    fn to_json(&self) -> Value {
        json!({
            "side": self.side,
            "seconds": self.seconds,
            "by_call": self.clock_seconds,
            "calls": self.calls,
            "steps": self.steps,
            "hits": self.hits.iter().map(|&(id, hit)| json!([id, hit])).collect::<Vec<_>>(),
            "cover_at_admission": self.cover.iter().map(|&(id, c)| json!([id, c])).collect::<Vec<_>>(),
        })
    }
}

/// Records that the steps so far computed `r`'s prompt up to `end` (for its prefix key).
fn covered(cover: &mut HashMap<u64, usize>, r: &Request, end: usize) {
    let c = cover.entry(r.prefix_key).or_default();
    *c = (*c).max(end.min(r.prompt.len()));
}

/// The scheduler loop of `benchmarks/vs_vllm.py` (`simulate`), step for step. Never inlined:
/// `valgrind --tool=callgrind --toggle-collect='*simulate*'` counts the instructions of one
/// side's run (`ONLY`) and nothing of the set-up.
#[inline(never)]
fn simulate(w: &Workload, side: &str, backend: &mut dyn Backend) -> Result<Run> {
    let mut waiting: VecDeque<usize> = w.initial.iter().copied().collect();
    // Requests that arrived since the last step: each step takes them in with one `add_batch`
    // before it admits anything, as vLLM's engine takes a step's new requests.
    let mut arrived: Vec<usize> = w.initial.clone();
    let mut running: Vec<usize> = Vec::new();
    let mut computed: HashMap<usize, usize> = HashMap::new();
    let mut produced: HashMap<usize, usize> = HashMap::new();
    let mut hits = Vec::new();
    let mut cover = Vec::new();
    // Tokens of each prefix key computed by the steps so far, and by the steps before this one.
    let mut cover_now: HashMap<u64, usize> = HashMap::new();
    let mut cover_committed: HashMap<u64, usize> = HashMap::new();
    let mut steps = 0;
    while !waiting.is_empty() || !running.is_empty() {
        steps += 1;
        if !arrived.is_empty() {
            let requests: Vec<&Request> = arrived.iter().map(|&p| &w.requests[p]).collect();
            backend.add_batch(w, &requests)?;
            arrived.clear();
        }
        let mut budget = w.token_budget;
        let mut scheduled: Vec<(usize, usize)> = Vec::new();
        let decoding: Vec<usize> = running.iter().copied().filter(|p| produced[p] > 0).collect();
        if !decoding.is_empty() {
            let ids: Vec<u64> = decoding.iter().map(|&p| w.requests[p].id).collect();
            backend.schedule_decodes(&ids)?;
            budget = budget.saturating_sub(decoding.len());
            scheduled.extend(decoding.iter().map(|&p| (p, 1)));
        }
        for &p in &running {
            if produced[&p] > 0 {
                continue;
            }
            if budget == 0 {
                break;
            }
            let tokens = backend.schedule_prefill(&w.requests[p], budget)?;
            if tokens > 0 {
                scheduled.push((p, tokens));
                budget -= tokens;
                covered(&mut cover_now, &w.requests[p], computed[&p] + tokens);
            }
        }
        while budget > 0 && running.len() < w.max_running {
            let Some(&p) = waiting.front() else { break };
            let Some((hit, tokens)) = backend.admit(w, &w.requests[p], budget)? else { break };
            if tokens == 0 {
                break;
            }
            waiting.pop_front();
            running.push(p);
            let r = &w.requests[p];
            hits.push((r.id, hit));
            cover.push((r.id, cover_committed.get(&r.prefix_key).copied().unwrap_or(0)));
            covered(&mut cover_now, r, hit + tokens);
            computed.insert(p, hit);
            produced.insert(p, 0);
            scheduled.push((p, tokens));
            budget -= tokens;
        }
        if scheduled.is_empty() {
            return Err(format!("{side}: step {steps} scheduled nothing").into());
        }
        let ids: Vec<(u64, usize)> =
            scheduled.iter().map(|&(p, t)| (w.requests[p].id, t)).collect();
        backend.end_step(&ids)?;
        cover_committed.clone_from(&cover_now);
        let mut sampled = Vec::new();
        for &(p, tokens) in &scheduled {
            let c = computed.get_mut(&p).ok_or("unknown request")?;
            *c += tokens;
            if *c >= w.requests[p].prompt.len() + produced[&p] {
                sampled.push(p);
            }
        }
        if !sampled.is_empty() {
            let ids: Vec<u64> = sampled.iter().map(|&p| w.requests[p].id).collect();
            let tokens: Vec<u32> =
                sampled.iter().map(|&p| w.output(&w.requests[p])[produced[&p]]).collect();
            backend.append(&ids, &tokens)?;
        }
        for &p in &sampled {
            let n = produced.get_mut(&p).ok_or("unknown request")?;
            *n += 1;
            if *n == w.requests[p].output.len() {
                backend.finish(w.requests[p].id)?;
                running.retain(|&q| q != p);
                waiting.extend(w.requests[p].follow_ups.iter().copied());
                arrived.extend(w.requests[p].follow_ups.iter().copied());
            }
        }
    }
    let clock = backend.clock();
    Ok(Run {
        side: side.to_owned(),
        seconds: clock.seconds.values().sum(),
        clock_seconds: clock.seconds.clone(),
        calls: clock.calls.clone(),
        steps,
        hits,
        cover,
    })
}

/// prefixcache's `CacheManager`, called as `PrefixcacheBackend` calls it through Python.
struct Prefixcache {
    manager: CacheManager,
    reuse: bool,
    plan: StepPlan,
    in_flight: bool,
    /// Sampled tokens not yet appended, in sampling order.
    pending: Vec<(u64, u32)>,
    decodes: Option<Vec<u64>>,
    clock: Clock,
}

fn prefixcache_config(w: &Workload, algorithm: HashAlgorithm, live: bool) -> CacheConfig {
    CacheConfig {
        hash: HashConfig { algorithm, seed: 0, unit: w.block_size, ..HashConfig::default() },
        pools: vec![PoolConfig { num_blocks: w.pool_blocks }],
        groups: vec![GroupConfig {
            kind: GroupKind::FullAttention { block_size: w.block_size },
            pool: 0,
        }],
        reuse_live_prefixes: live,
        enable_events: false,
        ..CacheConfig::default()
    }
}

impl Prefixcache {
    /// `reuse`: `add(..., extends=)` names the request the workload names, and live prefixes
    /// are reused (the `+extends` variant of `vs_vllm.py`); otherwise every prompt is hashed
    /// in full.
    fn new(w: &Workload, reuse: bool) -> Result<Self> {
        Ok(Self {
            manager: CacheManager::new(prefixcache_config(w, HashAlgorithm::Xxh3_128, reuse))?,
            reuse,
            plan: StepPlan::default(),
            in_flight: false,
            pending: Vec::new(),
            decodes: None,
            clock: Clock::default(),
        })
    }

    /// Commits the step in flight, appends the pending tokens, schedules the decodes.
    fn flush(&mut self) -> Result<()> {
        if self.in_flight {
            let t0 = Instant::now();
            self.manager.commit(&self.plan)?;
            self.clock.add("commit", t0, 1);
            self.in_flight = false;
        }
        if !self.pending.is_empty() {
            let (ids, tokens): (Vec<u64>, Vec<u32>) = self.pending.drain(..).unzip();
            let t0 = Instant::now();
            self.manager.append_batch(&ids, &tokens)?;
            self.clock.add("append_batch", t0, 1);
        }
        if let Some(ids) = self.decodes.take() {
            let ones = vec![1; ids.len()];
            let t0 = Instant::now();
            let got = self.manager.schedule_batch(&ids, &ones, false)?;
            self.clock.add("schedule_batch", t0, 1);
            if got.iter().any(Option::is_none) {
                return Err("prefixcache ran out of blocks: the pool is sized too small".into());
            }
        }
        Ok(())
    }
}

impl Backend for Prefixcache {
    fn add_batch(&mut self, w: &Workload, requests: &[&Request]) -> Result<()> {
        let batch = requests
            .iter()
            .map(|r| AddRequest {
                seq_id: r.id,
                tokens: w.prompt(r),
                extra: ExtraKeys::default(),
                extends: if self.reuse { r.extends } else { None },
            })
            .collect();
        let t0 = Instant::now();
        self.manager.add_batch(batch, 0)?;
        self.clock.add("add_batch", t0, 1);
        Ok(())
    }

    fn admit(
        &mut self,
        _: &Workload,
        r: &Request,
        budget: usize,
    ) -> Result<Option<(usize, usize)>> {
        self.flush()?;
        let t0 = Instant::now();
        self.manager.lookup(r.id)?;
        self.clock.add("lookup", t0, 1);
        let t0 = Instant::now();
        let scheduled = self.manager.schedule(r.id, u32::try_from(budget)?, 0, false)?;
        self.clock.add("schedule", t0, 1);
        Ok(scheduled.map(|s| (s.num_computed as usize, s.num_tokens as usize)))
    }

    fn schedule_prefill(&mut self, r: &Request, budget: usize) -> Result<usize> {
        self.flush()?;
        let t0 = Instant::now();
        let scheduled = self.manager.schedule(r.id, u32::try_from(budget)?, 0, false)?;
        self.clock.add("schedule", t0, 1);
        let s = scheduled.ok_or("prefixcache ran out of blocks: the pool is sized too small")?;
        Ok(s.num_tokens as usize)
    }

    fn schedule_decodes(&mut self, ids: &[u64]) -> Result<()> {
        let same = self.pending.len() == ids.len()
            && self.pending.iter().map(|p| p.0).collect::<HashSet<_>>()
                == ids.iter().copied().collect::<HashSet<_>>();
        if !same {
            self.flush()?;
        }
        self.decodes = Some(ids.to_vec());
        Ok(())
    }

    fn end_step(&mut self, scheduled: &[(u64, usize)]) -> Result<()> {
        if scheduled.is_empty() {
            return Ok(());
        }
        if self.decodes.is_some() && !self.pending.is_empty() {
            // A step of decodes only, of the sequences that sampled: one call.
            let ids = self.decodes.take().unwrap_or_default();
            let sampled: HashMap<u64, u32> = self.pending.drain(..).collect();
            let tokens: Vec<u32> = ids.iter().map(|id| sampled[id]).collect();
            let t0 = Instant::now();
            let got = self.manager.decode_step(&ids, &tokens, &mut self.plan)?;
            self.clock.add("decode_step", t0, 1);
            if got.iter().any(Option::is_none) {
                return Err("prefixcache ran out of blocks: the pool is sized too small".into());
            }
        } else {
            self.flush()?;
            let t0 = Instant::now();
            self.manager.build_plan_into(&mut self.plan)?;
            self.clock.add("build_plan_into", t0, 1);
        }
        self.in_flight = true;
        Ok(())
    }

    fn append(&mut self, ids: &[u64], tokens: &[u32]) -> Result<()> {
        self.pending.extend(ids.iter().copied().zip(tokens.iter().copied()));
        Ok(())
    }

    fn finish(&mut self, id: u64) -> Result<()> {
        self.flush()?;
        let t0 = Instant::now();
        self.manager.finish(id)?;
        self.clock.add("finish", t0, 1);
        Ok(())
    }

    fn clock(&self) -> &Clock {
        &self.clock
    }
}

/// The storage tier marker of the blocks (kvbm's `T: BlockMetadata`): device memory.
#[derive(Clone)]
struct G1;

/// Dynamo's `kvbm-logical` `BlockManager`, one `SchedulableSequence` per request.
struct Kvbm {
    manager: BlockManager<G1>,
    block_size: u32,
    sequences: HashMap<u64, SchedulableSequence<G1>>,
    /// Sequences whose final prefill chunk ran: `apply_prefill` waits for the sampled token.
    final_chunk: HashSet<u64>,
    clock: Clock,
}

impl Kvbm {
    /// The builder's defaults (the Lineage inactive backend, a registry without frequency
    /// tracking), with as many usable blocks as prefixcache's pool (which counts its null
    /// block 0). `KVBM_INACTIVE=lru` picks the LRU inactive backend instead (the crate's
    /// README example, with its `TinyLFU` frequency tracker), for comparison.
    fn new(w: &Workload) -> Result<Self> {
        let builder = BlockManager::<G1>::builder()
            .block_count(w.pool_blocks as usize - 1)
            .block_size(w.block_size as usize);
        let manager = match std::env::var("KVBM_INACTIVE").as_deref() {
            Ok("lru") => {
                let tracker = FrequencyTrackingCapacity::Medium.create_tracker();
                let registry = BlockRegistry::builder().frequency_tracker(tracker).build();
                builder.registry(registry).with_lru_backend().build()?
            }
            Ok("lineage") | Err(_) => builder.registry(BlockRegistry::builder().build()).build()?,
            Ok(other) => return Err(format!("KVBM_INACTIVE={other}: lineage or lru").into()),
        };
        Ok(Self {
            manager,
            block_size: w.block_size,
            sequences: HashMap::new(),
            final_chunk: HashSet::new(),
            clock: Clock::default(),
        })
    }

    fn sequence(&mut self, id: u64) -> Result<&mut SchedulableSequence<G1>> {
        self.sequences.get_mut(&id).ok_or_else(|| format!("kvbm: no sequence {id}").into())
    }

    /// `schedule_prefill` of `min(budget, what is left)` tokens; `None` when the pools are
    /// short.
    fn schedule_chunk(&mut self, id: u64, budget: usize) -> Result<Option<usize>> {
        let t0 = Instant::now();
        let manager = &self.manager;
        let seq = self.sequences.get_mut(&id).ok_or("kvbm: unknown sequence")?;
        let tokens = budget.min(seq.num_input_tokens() - seq.prefill_position());
        let result = seq.schedule_prefill(tokens, manager);
        self.clock.add("schedule_prefill", t0, 1);
        match result {
            Ok(()) => Ok(Some(tokens)),
            Err(ScheduleError::AllocationFailed { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}

impl Kvbm {
    /// Builds the request's sequence, which hashes every full block of the prompt; it takes
    /// the engine's token vector (made before the clock starts).
    fn build(&mut self, w: &Workload, r: &Request) {
        let tokens = w.prompt(r).to_vec();
        let t0 = Instant::now();
        let seq = SchedulableSequence::<G1>::new(tokens, r.output.len(), self.block_size, None);
        self.clock.add("hash", t0, 1);
        self.sequences.insert(r.id, seq);
    }
}

impl Backend for Kvbm {
    fn add_batch(&mut self, w: &Workload, requests: &[&Request]) -> Result<()> {
        for r in requests {
            self.build(w, r);
        }
        Ok(())
    }

    fn admit(
        &mut self,
        w: &Workload,
        r: &Request,
        budget: usize,
    ) -> Result<Option<(usize, usize)>> {
        if !self.sequences.contains_key(&r.id) {
            self.build(w, r);
        }
        let t0 = Instant::now();
        let manager = &self.manager;
        let seq = self.sequences.get_mut(&r.id).ok_or("kvbm: unknown sequence")?;
        let matched = seq.match_and_add_prefix(manager)?;
        self.clock.add("match_and_add_prefix", t0, 1);
        let hit = matched * self.block_size as usize;
        if hit >= r.prompt.len() {
            return Err(
                format!("kvbm matched all of request {}'s prompt (not driven)", r.id).into()
            );
        }
        if let Some(tokens) = self.schedule_chunk(r.id, budget)? {
            return Ok(Some((hit, tokens)));
        }
        // The request waits; its next admission builds (hashes) and matches it again.
        let t0 = Instant::now();
        drop(self.sequences.remove(&r.id));
        self.clock.add("release", t0, 1);
        Ok(None)
    }

    fn schedule_prefill(&mut self, r: &Request, budget: usize) -> Result<usize> {
        self.schedule_chunk(r.id, budget)?
            .ok_or_else(|| "kvbm ran out of blocks: the pool is sized too small".into())
    }

    fn schedule_decodes(&mut self, ids: &[u64]) -> Result<()> {
        let t0 = Instant::now();
        for id in ids {
            let manager = &self.manager;
            let seq = self.sequences.get_mut(id).ok_or("kvbm: unknown sequence")?;
            seq.schedule_decode(manager)?;
        }
        self.clock.add("schedule_decode", t0, ids.len() as u64);
        Ok(())
    }

    fn end_step(&mut self, scheduled: &[(u64, usize)]) -> Result<()> {
        // Non-final prefill chunks are applied now (their blocks registered); the final chunk
        // and decodes wait for the token sampled from this step (`append`).
        let t0 = Instant::now();
        let mut applied = 0;
        for &(id, _) in scheduled {
            let manager = &self.manager;
            let seq = self.sequences.get_mut(&id).ok_or("kvbm: unknown sequence")?;
            if let kvbm_logical::SequenceState::PrefillScheduled { num_tokens, .. } = seq.state() {
                if seq.prefill_position() + num_tokens < seq.num_input_tokens() {
                    seq.apply_prefill(None, manager)?;
                    applied += 1;
                } else {
                    self.final_chunk.insert(id);
                }
            }
        }
        if applied > 0 {
            self.clock.add("apply_prefill", t0, applied);
        }
        Ok(())
    }

    fn append(&mut self, ids: &[u64], tokens: &[u32]) -> Result<()> {
        for (&id, &token) in ids.iter().zip(tokens) {
            let prefill = self.final_chunk.remove(&id);
            let t0 = Instant::now();
            let manager = &self.manager;
            let seq = self.sequences.get_mut(&id).ok_or("kvbm: unknown sequence")?;
            if prefill {
                seq.apply_prefill(Some(token), manager)?;
                self.clock.add("apply_prefill", t0, 1);
            } else {
                seq.apply_decode(token, manager)?;
                self.clock.add("apply_decode", t0, 1);
            }
        }
        Ok(())
    }

    fn finish(&mut self, id: u64) -> Result<()> {
        let t0 = Instant::now();
        self.sequence(id)?.release()?;
        drop(self.sequences.remove(&id));
        self.clock.add("release", t0, 1);
        Ok(())
    }

    fn clock(&self) -> &Clock {
        &self.clock
    }
}

/// Seconds prefixcache's `add` takes for every prompt alone, each hashed in full, on a fresh
/// manager (`hashing_floor` of `vs_vllm.py`): a lower bound of its run without reuse.
fn hashing_floor(w: &Workload) -> Result<f64> {
    let mut manager = CacheManager::new(prefixcache_config(w, HashAlgorithm::Xxh3_128, false))?;
    let mut seconds = 0.0;
    for r in &w.requests {
        let t0 = Instant::now();
        manager.add(r.id, w.prompt(r), ExtraKeys::default(), None)?;
        seconds += t0.elapsed().as_secs_f64();
        manager.finish(r.id)?;
    }
    Ok(seconds)
}

/// `hashing_floor` with every prompt in one `add_batch` (hashed across the machine's cores).
fn hashing_floor_parallel(w: &Workload) -> Result<f64> {
    let mut manager = CacheManager::new(prefixcache_config(w, HashAlgorithm::Xxh3_128, false))?;
    let batch = w
        .requests
        .iter()
        .map(|r| AddRequest {
            seq_id: r.id,
            tokens: w.prompt(r),
            extra: ExtraKeys::default(),
            extends: None,
        })
        .collect();
    let t0 = Instant::now();
    manager.add_batch(batch, 0)?;
    Ok(t0.elapsed().as_secs_f64())
}

/// kvbm's hashing alone: every prompt's `TokenBlockSequence` built once (what `hash` times).
fn kvbm_hashing_floor(w: &Workload) -> f64 {
    let mut seconds = 0.0;
    for r in &w.requests {
        let tokens = w.prompt(r).to_vec();
        let t0 = Instant::now();
        let seq = SchedulableSequence::<G1>::new(tokens, r.output.len(), w.block_size, None);
        seconds += t0.elapsed().as_secs_f64();
        drop(seq);
    }
    seconds
}

const USAGE: &str = "usage: kvbm_vs_prefixcache DIR PAIRS [kvbm|prefixcache|prefixcache+extends]";

/// `ONLY`: `runs` runs of one side per workload, their seconds printed (for instruction counts).
fn run_only(dir: &Path, runs: usize, side: &str) -> Result<()> {
    for w in Workload::load(dir)? {
        for _ in 0..runs {
            let run = match side {
                "kvbm" => simulate(&w, side, &mut Kvbm::new(&w)?)?,
                "prefixcache" => simulate(&w, side, &mut Prefixcache::new(&w, false)?)?,
                "prefixcache+extends" => simulate(&w, side, &mut Prefixcache::new(&w, true)?)?,
                _ => return Err(USAGE.into()),
            };
            println!("{} {side}: {:.4} s, {} steps", w.name, run.seconds, run.steps);
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (dir, pairs, only) = match args.as_slice() {
        [_, dir, pairs] => (dir, pairs, None),
        [_, dir, pairs, only] => (dir, pairs, Some(only.as_str())),
        _ => return Err(USAGE.into()),
    };
    let pairs: usize = pairs.parse()?;
    if let Some(side) = only {
        return run_only(Path::new(dir), pairs, side);
    }
    let mut results = serde_json::Map::new();
    for w in Workload::load(Path::new(dir))? {
        let mut runs = Vec::new();
        let mut floors = Vec::new();
        let mut parallel_floors = Vec::new();
        let mut kvbm_floors = Vec::new();
        let mut line = String::new();
        for pair in 0..pairs {
            let kvbm = simulate(&w, "kvbm", &mut Kvbm::new(&w)?)?;
            let plain = simulate(&w, "prefixcache", &mut Prefixcache::new(&w, false)?)?;
            let reuse = simulate(&w, "prefixcache+extends", &mut Prefixcache::new(&w, true)?)?;
            floors.push(hashing_floor(&w)?);
            parallel_floors.push(hashing_floor_parallel(&w)?);
            kvbm_floors.push(kvbm_hashing_floor(&w));
            line.clear();
            write!(
                line,
                "{} pair {pair}: kvbm {:.4} s, prefixcache {:.4} s, +extends {:.4} s",
                w.name, kvbm.seconds, plain.seconds, reuse.seconds
            )?;
            eprintln!("{line}");
            runs.extend([kvbm.to_json(), plain.to_json(), reuse.to_json()]);
        }
        results.insert(
            w.name.clone(),
            json!({
                "runs": runs,
                "hashing_floor_seconds": floors,
                "hashing_floor_parallel_seconds": parallel_floors,
                "kvbm_hashing_floor_seconds": kvbm_floors,
            }),
        );
    }
    println!("{}", Value::Object(results));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One growing-prefix stream: each round's prompt is the previous one plus `growth` tokens
    /// (the previous round's outputs are not fed back), a follow-up of the previous round.
    fn stream(first: usize, growth: usize, rounds: usize, outputs: usize) -> Workload {
        let longest = first + growth * (rounds - 1);
        let mut tokens: Vec<u32> = (0..longest as u32).map(|i| i * 7 + 1).collect();
        let mut requests = Vec::new();
        for round in 0..rounds {
            let output = tokens.len()..tokens.len() + outputs;
            tokens.extend((0..outputs as u32).map(|i| 1_000_000 + round as u32 * 100 + i));
            requests.push(Request {
                id: round as u64,
                prompt: 0..first + growth * round,
                output,
                extends: round.checked_sub(1).map(|r| r as u64),
                prefix_key: 0,
                follow_ups: if round + 1 < rounds { vec![round + 1] } else { vec![] },
            });
        }
        Workload {
            name: "stream".into(),
            block_size: 16,
            token_budget: 64,
            max_running: 4,
            pool_blocks: 64,
            tokens,
            requests,
            initial: vec![0],
        }
    }

    /// Every round hits the previous round's whole blocks on both sides, and both sides run the
    /// same steps: the loop drives each manager through complete requests.
    #[test]
    fn a_round_hits_the_previous_prompts_full_blocks_on_every_side() {
        let w = stream(40, 32, 4, 3);
        // Round r > 0 hits round r - 1's prompt (40 + 32 (r - 1) tokens) rounded down to 16.
        let expected = vec![(0, 0), (1, 32), (2, 64), (3, 96)];
        let kvbm = simulate(&w, "kvbm", &mut Kvbm::new(&w).unwrap()).unwrap();
        let plain = simulate(&w, "prefixcache", &mut Prefixcache::new(&w, false).unwrap()).unwrap();
        let reuse = simulate(&w, "reuse", &mut Prefixcache::new(&w, true).unwrap()).unwrap();
        for run in [&kvbm, &plain, &reuse] {
            assert_eq!(run.hits, expected, "{}", run.side);
            assert_eq!(run.steps, kvbm.steps, "{}", run.side);
        }
        // A prompt of 40 + 3 x 32 tokens in chunks of at most 64, then 3 outputs: each round
        // ran, and every call was counted.
        assert_eq!(kvbm.calls["release"], 4);
        assert_eq!(plain.calls["finish"], 4);
    }

    /// A chunk that ends inside a block: kvbm registers that block once the chunk ran (its
    /// tokens are all known), so a request admitted in the next step hits it; prefixcache keys
    /// a block once all its tokens are computed.
    #[test]
    fn kvbm_registers_the_block_a_chunk_ends_in() {
        // Two 100-token prompts share their first 64 tokens. Step 1 computes request 0's first
        // 56 tokens (the budget); step 2 its last 44, and admits request 1 with the 12 left.
        let mut tokens: Vec<u32> = (0..100).collect();
        tokens.extend(0..64);
        tokens.extend(500..536);
        tokens.extend([9, 9, 9, 9]);
        let request = |id: u64, prompt, output| Request {
            id,
            prompt,
            output,
            extends: None,
            prefix_key: 0,
            follow_ups: vec![],
        };
        let w = Workload {
            name: "chunks".into(),
            block_size: 16,
            token_budget: 56,
            max_running: 2,
            pool_blocks: 64,
            tokens,
            requests: vec![request(0, 0..100, 200..202), request(1, 100..200, 202..204)],
            initial: vec![0, 1],
        };
        let kvbm = simulate(&w, "kvbm", &mut Kvbm::new(&w).unwrap()).unwrap();
        let ours = simulate(&w, "prefixcache", &mut Prefixcache::new(&w, false).unwrap()).unwrap();
        // 56 tokens computed: blocks 0 to 2 whole, block 3 (48..64) holds 8 of its 16.
        assert_eq!(kvbm.cover, vec![(0, 0), (1, 56)]);
        assert_eq!(kvbm.hits, vec![(0, 0), (1, 64)]);
        assert_eq!(ours.hits, vec![(0, 0), (1, 48)]);
    }
}
