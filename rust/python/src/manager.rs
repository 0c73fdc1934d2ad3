//! `CacheManager`: the core manager behind a mutex, called from any Python thread.
//!
//! Every method converts its arguments with the GIL held, runs one core call under the lock,
//! and maps the result back. Nothing here decides anything about the cache or the step
//! protocol: whether a plan is this manager's, and whether `decode_step` commits, the core
//! decides (`CacheManager::commit` / `abort` / `decode_step` read the plan's `manager` and
//! step id).
//!
//! # The GIL policy
//!
//! One function takes a manager's lock: [`enter`]. Each call states its [`Work`] under the
//! lock, and `enter` applies one rule to it:
//! - work that may exceed `SHORT_WORK` (4,096 tokens or sequences) releases the GIL before it
//!   takes the lock: hashing (`add`, with or without `extends`), lookups and finishes of long
//!   sequences, batch calls, plans, commits and decode steps of long chunks, event drains,
//!   resets, block tables, the invariant check. [`Work::Long`] always releases it;
//!   [`Work::Sized`] and [`Work::Measured`] release it above `SHORT_WORK`.
//! - shorter work keeps the GIL when the lock is free at once: releasing and retaking the GIL
//!   costs about 0.1 us, more than a decode step's calls do in the core (a decode step of 256
//!   sequences stays under `SHORT_WORK`; a prefill chunk of 8,192 tokens does not). When the
//!   lock is held by another thread it waits without the GIL, like long work, so it never
//!   stalls other Python threads.
//!
//! The lock is never held while Python runs (the core never calls into Python, so waiting for
//! the lock with the GIL held cannot deadlock). A panic in the core never reaches Python: it
//! is caught and raised as `InvariantError`, and the mutex it poisoned makes every later call
//! raise `InvariantError` too (the manager's state is no longer trustworthy; build a new one).
//! `hash_prefix`, which takes no lock, follows the same rule through [`unlocked`].
//!
//! Arguments are copied out of Python objects with the GIL held, never read in place without
//! it (another thread could change them meanwhile): a long prompt is copied once (about 10 us
//! for 144K `uint32` tokens, memory bandwidth), which is what `add(.., extends)` of a next turn
//! pays for running without the GIL; releasing the GIL itself costs about 0.1 us.
//!
//! `PlanBuffers` remember the manager whose step they hold; a manager refuses buffers holding
//! another's step that is still in flight (`refuse_foreign_step`), and `abort_step` /
//! `commit_step` end the step in flight by its id when its plan object is gone.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, PoisonError, TryLockError};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2};
use prefixcache_core::limits::MAX_HASH_THREADS;
use prefixcache_core::{AddRequest, CacheError, CacheManager, HashAlgorithm, Scheduled, StepPlan};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt};

use crate::buffers::{self, Owner, PyPlanBuffers};
use crate::convert::{self, u32_arg, u64_arg, Domain, BATCH, SEQUENCE};
use crate::errors::to_pyerr;
use crate::events;
use crate::plan::PyStepPlan;
use crate::results::{PyAdded, PyHit, PyPoolUsage, PyScheduled, PyStats};

/// Work (tokens or sequences) up to which a call keeps the GIL (see the module doc). A
/// decode step of 256 sequences stays under it; a prefill chunk of 8,192 tokens does not.
const SHORT_WORK: usize = 4096;

/// How much work a call does under the manager's lock: what decides whether it keeps the GIL
/// (see the module doc).
#[derive(Clone, Copy)]
pub(crate) enum Work<'a> {
    /// Small and bounded whatever the arguments (counters, one sequence's state).
    Short,
    /// Proportional to this many tokens or sequences, known before the lock is taken.
    Sized(usize),
    /// Proportional to what this returns of the locked manager (the tokens scheduled, a
    /// sequence's length).
    Measured(&'a dyn Fn(&CacheManager) -> usize),
    /// Possibly long whatever the arguments (hashing, a reset, the invariant check).
    Long,
}

/// Runs `f` on the manager behind `lock`, keeping or releasing the GIL as `work` says (the
/// module doc's policy), and maps core errors and panics to Python exceptions. The only way
/// the shell takes a manager's lock.
pub(crate) fn enter<R, F>(
    py: Python<'_>,
    lock: &Mutex<CacheManager>,
    work: Work<'_>,
    f: F,
) -> PyResult<R>
where
    R: Send,
    F: FnOnce(&mut CacheManager) -> Result<R, CacheError> + Send,
{
    let measure: &dyn Fn(&CacheManager) -> usize = match work {
        Work::Long => return detached(py, lock, f),
        Work::Sized(n) if n > SHORT_WORK => return detached(py, lock, f),
        Work::Short | Work::Sized(_) => &|_| 0,
        Work::Measured(measure) => measure,
    };
    let mut pending = Some(f);
    // The guard lives inside `catch_unwind`, so a panic poisons the mutex as in `detached`.
    let outcome = catch_unwind(AssertUnwindSafe(|| match lock.try_lock() {
        Ok(mut manager) if measure(&manager) <= SHORT_WORK => {
            pending.take().map(|f| f(&mut manager).map_err(Failure::Core))
        }
        Ok(_) | Err(TryLockError::WouldBlock) => None,
        Err(TryLockError::Poisoned(_)) => Some(Err(Failure::Poisoned)),
    }));
    match (outcome, pending) {
        // Long work, or the lock is held: wait for it and run without the GIL.
        (Ok(None), Some(f)) => detached(py, lock, f),
        (Ok(Some(result)), _) => outcome_of(py, Ok(result)),
        (Ok(None), None) => outcome_of(py, Ok(Err(Failure::Poisoned))),
        (Err(payload), _) => outcome_of(py, Err(payload)),
    }
}

/// The same rule for work that takes no manager's lock (`hash_prefix`): `f` runs without the
/// GIL when `work` (tokens) exceeds `SHORT_WORK`, with it otherwise.
pub(crate) fn unlocked<R, F>(py: Python<'_>, work: usize, f: F) -> R
where
    R: Send,
    F: FnOnce() -> R + Send,
{
    if work > SHORT_WORK {
        py.detach(f)
    } else {
        f()
    }
}

/// `enter` without the GIL.
fn detached<R, F>(py: Python<'_>, lock: &Mutex<CacheManager>, f: F) -> PyResult<R>
where
    R: Send,
    F: FnOnce(&mut CacheManager) -> Result<R, CacheError> + Send,
{
    let outcome = py.detach(|| {
        catch_unwind(AssertUnwindSafe(|| match lock.lock() {
            Ok(mut manager) => f(&mut manager).map_err(Failure::Core),
            Err(_) => Err(Failure::Poisoned),
        }))
    });
    outcome_of(py, outcome)
}

/// Maps a locked call's outcome: core errors to their Python classes, panics (now or in an
/// earlier call) to `InvariantError`.
fn outcome_of<R>(py: Python<'_>, outcome: std::thread::Result<Result<R, Failure>>) -> PyResult<R> {
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(Failure::Core(e))) => Err(to_pyerr(py, e)),
        Ok(Err(Failure::Poisoned)) => Err(to_pyerr(
            py,
            CacheError::Invariant {
                message: "an earlier call panicked inside prefixcache-core, so this manager's \
                          state cannot be trusted; create a new CacheManager (and please \
                          report the panic message printed on stderr)"
                    .to_string(),
            },
        )),
        Err(payload) => Err(to_pyerr(
            py,
            CacheError::Invariant {
                message: format!(
                    "prefixcache-core panicked: {} (a bug; please report it). This manager is \
                     unusable from now on; create a new CacheManager",
                    panic_message(payload.as_ref())
                ),
            },
        )),
    }
}

/// The tokens of a sequence (0 for an unknown id, whose call fails at once): the work of
/// calls that walk one sequence (a lookup, a finish).
fn sequence_tokens(manager: &CacheManager, seq_id: u64) -> usize {
    manager.num_tokens(seq_id).map_or(0, |n| n as usize)
}

/// `StepError` when buffers holding this manager's step `held` are written while that step
/// is still in flight with overlapped steps (D > 1): the device may still read it. (With D = 1
/// the core refuses the plan itself.)
fn refuse_held_in_flight(m: &CacheManager, held: Option<u64>) -> Result<(), CacheError> {
    if m.config().max_steps_in_flight == 1 {
        return Ok(());
    }
    match held.filter(|s| m.plans_in_flight().contains(s)) {
        Some(step) => Err(CacheError::Step {
            message: format!(
                "these PlanBuffers hold step {step}, still in flight: the device may still read \
                 it; write the next plan into other buffers (a ring of max_steps_in_flight \
                 PlanBuffers)"
            ),
        }),
        None => Ok(()),
    }
}

/// A plan's identity as the core reads it (`commit` / `abort` refuse another manager's).
fn plan_identity(manager: u64, step_id: u64) -> StepPlan {
    StepPlan { manager, step_id, ..StepPlan::default() }
}

/// Sequence ids are `int64` in plans (and torch), so they are limited to its range.
const MAX_SEQ_ID: u64 = i64::MAX as u64;

enum Failure {
    Core(CacheError),
    Poisoned,
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(ToString::to_string)
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

fn seq_id(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    convert::int_in(obj, "seq_id", 0, MAX_SEQ_ID, Domain::Request)
}

/// The ids of a batch call, at most `MAX_BATCH_SEQUENCES` (checked before anything is read).
fn seq_ids(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    convert::int_sequence(obj, "seq_ids", MAX_SEQ_ID, BATCH)
}

/// One entry per id of an `add_batch` (`None` entries kept as `None`), or `None` for each
/// when `obj` is `None`; an `InvalidRequestError` when the lengths differ.
fn per_id<'py>(
    obj: Option<&Bound<'py, PyAny>>,
    n: usize,
    what: &str,
) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(vec![None; n]);
    };
    let len = obj.len()?;
    if len != n {
        let message = format!("add_batch got {n} seq_ids and {len} {what}: give one per id");
        return Err(convert::range_error(obj.py(), Domain::Request, message));
    }
    obj.try_iter()?.map(|item| item.map(|i| Some(i).filter(|i| !i.is_none()))).collect()
}

/// A schedule result as `schedule_tokens` reports it: the tokens, or -1 (out of blocks).
fn tokens_or_refused(result: Option<&Scheduled>) -> i32 {
    result.map_or(-1, |s| i32::try_from(s.num_tokens).unwrap_or(i32::MAX))
}

fn u32_or(obj: Option<&Bound<'_, PyAny>>, what: &str, default: u32) -> PyResult<u32> {
    obj.filter(|o| !o.is_none()).map_or(Ok(default), |o| u32_arg(o, what, Domain::Request))
}

/// The prefix-cache manager: block pools, prefix hashing, eviction and checkpoint planning.
///
/// Thread-safe: any thread may call any method; long work (hashing, lookups, plan building)
/// runs without the GIL.
#[pyclass(frozen, name = "CacheManager", module = "prefixcache")]
pub struct PyCacheManager {
    /// Shared with the `PlanBuffers` holding this manager's steps, which ask it whether their
    /// step is still in flight (through a `Weak`: buffers do not keep a manager alive).
    inner: Arc<Mutex<CacheManager>>,
    /// The core manager's id (`CacheManager::id`), which its plans carry.
    id: u64,
    algorithm: HashAlgorithm,
    chunk_alignment: u32,
    config: Py<PyAny>,
    /// The buffer `drain_events_wire` encodes into, kept from one drain to the next so that a
    /// drain neither allocates nor clears it (taken out while a drain runs; a drain running
    /// meanwhile on another thread uses a fresh one).
    wire: Mutex<Vec<u8>>,
}

impl PyCacheManager {
    /// `enter` on this manager.
    fn enter<R, F>(&self, py: Python<'_>, work: Work<'_>, f: F) -> PyResult<R>
    where
        R: Send,
        F: FnOnce(&mut CacheManager) -> Result<R, CacheError> + Send,
    {
        enter(py, &self.inner, work, f)
    }
}

#[pymethods]
impl PyCacheManager {
    /// Builds a manager from a `CacheConfig` (validated first: `ConfigError` says what to
    /// change).
    #[new]
    fn new(config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = config.py();
        let core_config = convert::cache_config(config)?;
        let algorithm = core_config.hash.algorithm;
        let manager = CacheManager::new(core_config).map_err(|e| to_pyerr(py, e))?;
        Ok(Self {
            id: manager.id(),
            algorithm,
            chunk_alignment: manager.chunk_alignment(),
            inner: Arc::new(Mutex::new(manager)),
            config: config.clone().unbind(),
            wire: Mutex::new(Vec::new()),
        })
    }

    /// The configuration this manager was built from.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyAny> {
        self.config.clone_ref(py)
    }

    /// The grid non-final prefill chunks end on: the least common multiple of the state
    /// groups' alignments (1 without state groups).
    #[getter]
    fn chunk_alignment(&self) -> u32 {
        self.chunk_alignment
    }

    /// Number of live sequences (added, not finished).
    #[getter]
    fn num_sequences(&self, py: Python<'_>) -> PyResult<usize> {
        self.enter(py, Work::Short, |m| Ok(m.num_sequences()))
    }

    /// Number of finished sequences kept for `add(..., extends=...)`.
    #[getter]
    fn num_finished_cached(&self, py: Python<'_>) -> PyResult<usize> {
        self.enter(py, Work::Short, |m| Ok(m.num_finished_cached()))
    }

    /// The step id of the oldest plan in flight (built, not yet committed or aborted: the
    /// next to end), or `None`; `commit_step` / `abort_step` end it by this id.
    #[getter]
    fn plan_in_flight(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.enter(py, Work::Short, |m| Ok(m.plan_in_flight()))
    }

    /// Every plan in flight, oldest first (at most `config.max_steps_in_flight`).
    #[getter]
    fn plans_in_flight(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.enter(py, Work::Short, |m| Ok(m.plans_in_flight()))
    }

    /// Registers a sequence and hashes its full units (without the GIL).
    ///
    /// `tokens`: a list of ints or a 1-D integer `NumPy` array / torch CPU tensor, values in
    /// `0 .. 2**32 - 1`. `extends` names a live or recently finished sequence whose hashes are
    /// reused for the common token prefix, so that only the new tail is hashed (also without
    /// the GIL).
    #[pyo3(signature = (seq_id, tokens, extra_keys = None, extends = None))]
    fn add(
        &self,
        seq_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        extends: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyAdded> {
        let py = seq_id.py();
        let id = self::seq_id(seq_id)?;
        let extra = convert::extra_keys(extra_keys)?;
        let extends = extends.filter(|e| !e.is_none()).map(|e| self::seq_id(e)).transpose()?;
        // The tokens are copied out with the GIL held (no Python thread can change them
        // meanwhile); the core compares, copies and hashes without it (`Work::Long`: even a
        // short prompt may extend a long sequence, whose prefix the core compares).
        let tokens = convert::tokens(tokens, "tokens", SEQUENCE)?;
        self.enter(py, Work::Long, move |m| m.add(id, &tokens, extra, extends)).map(PyAdded::from)
    }

    /// `add` of several sequences in one call, as `add` of each in order would register them
    /// (reuse among the batch's own requests included), their prompts hashed on up to
    /// `threads` threads (0: one per core) without the GIL.
    ///
    /// `seq_ids`: list or 1-D integer array; `prompts`: one token sequence per id; `extends`
    /// and `extra_keys`: `None`, or one entry (or `None`) per id. All or nothing: a request
    /// `add` would refuse makes the call raise that error and admit none of them.
    #[pyo3(signature = (seq_ids, prompts, extends = None, extra_keys = None, threads = None))]
    fn add_batch(
        &self,
        seq_ids: &Bound<'_, PyAny>,
        prompts: &Bound<'_, PyAny>,
        extends: Option<&Bound<'_, PyAny>>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        threads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<PyAdded>> {
        let py = seq_ids.py();
        let ids = self::seq_ids(seq_ids)?;
        let threads = match threads.filter(|t| !t.is_none()) {
            Some(t) => convert::int_in(t, "threads", 0, MAX_HASH_THREADS as u64, Domain::Request)?,
            None => 0,
        };
        let n = ids.len();
        let prompts = per_id(Some(prompts), n, "prompts")?;
        let extends = per_id(extends, n, "extends")?;
        let extra = per_id(extra_keys, n, "extra_keys")?;
        // Copied out with the GIL held, hashed without it.
        let mut tokens = Vec::with_capacity(n);
        for prompt in &prompts {
            match prompt {
                Some(p) => tokens.push(convert::tokens(p, "prompts[i]", SEQUENCE)?),
                None => return Err(PyTypeError::new_err("add_batch: a prompt is None")),
            }
        }
        let extends = extends
            .iter()
            .map(|e| e.as_ref().map(|e| self::seq_id(e)).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        let extra =
            extra.iter().map(|e| convert::extra_keys(e.as_ref())).collect::<PyResult<Vec<_>>>()?;
        self.enter(py, Work::Long, move |m| {
            let requests = ids
                .iter()
                .zip(&tokens)
                .zip(extra.into_iter().zip(extends))
                .map(|((&seq_id, tokens), (extra, extends))| AddRequest {
                    seq_id,
                    tokens,
                    extra,
                    extends,
                })
                .collect();
            m.add_batch(requests, threads as usize)
        })
        .map(|added| added.into_iter().map(PyAdded::from).collect())
    }

    /// The hit the sequence would get now. Changes no cache state (counts a statistic).
    fn lookup(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<PyHit> {
        let id = self::seq_id(seq_id)?;
        let work = Work::Measured(&|m| sequence_tokens(m, id));
        self.enter(seq_id.py(), work, |m| m.lookup(id)).map(PyHit::from)
    }

    /// Schedules up to `max_tokens` tokens of a sequence for the next plan.
    ///
    /// Returns `None` when the pools cannot supply the sequence's own blocks (nothing
    /// changed: preempt something and retry). A non-final prefill chunk is trimmed to end on
    /// `chunk_alignment` unless `exact`; `lookahead` speculative tokens (paged groups only)
    /// get blocks but are never keyed.
    #[pyo3(
        signature = (seq_id, max_tokens, lookahead = None, exact = false),
        text_signature = "(self, seq_id, max_tokens, lookahead=0, exact=False)"
    )]
    fn schedule(
        &self,
        seq_id: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        lookahead: Option<&Bound<'_, PyAny>>,
        exact: bool,
    ) -> PyResult<Option<PyScheduled>> {
        let id = self::seq_id(seq_id)?;
        let max_tokens = u32_arg(max_tokens, "max_tokens", Domain::Request)?;
        let lookahead = u32_or(lookahead, "lookahead", 0)?;
        let work = max_tokens.saturating_add(lookahead) as usize;
        let work = Work::Sized(work);
        self.enter(seq_id.py(), work, move |m| m.schedule(id, max_tokens, lookahead, exact))
            .map(|s| s.map(PyScheduled::from))
    }

    /// `schedule` for many sequences in one call (results in input order).
    ///
    /// `seq_ids`: list or 1-D integer array; `max_tokens`: one int (or numpy integer) for all,
    /// or one per sequence. Every id is checked before anything is scheduled.
    #[pyo3(signature = (seq_ids, max_tokens, exact = false))]
    fn schedule_batch(
        &self,
        seq_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        exact: bool,
    ) -> PyResult<Vec<Option<PyScheduled>>> {
        let results = self.schedule_many(seq_ids, max_tokens, exact)?;
        Ok(results.into_iter().map(|s| s.map(PyScheduled::from)).collect())
    }

    /// `schedule_batch` without result objects, for decode steps: `int32 [N]`, the tokens
    /// scheduled for each sequence in input order, -1 where the pools could not supply its
    /// blocks (nothing changed for it: preempt something and retry).
    #[pyo3(signature = (seq_ids, max_tokens, exact = false))]
    fn schedule_tokens<'py>(
        &self,
        seq_ids: &Bound<'py, PyAny>,
        max_tokens: &Bound<'py, PyAny>,
        exact: bool,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let results = self.schedule_many(seq_ids, max_tokens, exact)?;
        Ok(PyArray1::from_iter(
            seq_ids.py(),
            results.iter().map(Option::as_ref).map(tokens_or_refused),
        ))
    }

    /// Asks for a checkpoint at absolute `position` in the chunk scheduled for the next plan;
    /// `AlignmentError` (naming the nearest valid positions) when the kernel cannot write it.
    fn request_checkpoint(
        &self,
        seq_id: &Bound<'_, PyAny>,
        position: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let position = u32_arg(position, "position", Domain::Request)?;
        self.enter(seq_id.py(), Work::Short, move |m| m.request_checkpoint(id, position))
    }

    /// For backends without interior checkpoints: how many tokens to schedule so the chunk
    /// ends on the next retained position within `token_budget` (else the budget).
    fn suggest_chunk(
        &self,
        seq_id: &Bound<'_, PyAny>,
        token_budget: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let id = self::seq_id(seq_id)?;
        let budget = u32_arg(token_budget, "token_budget", Domain::Request)?;
        let work = Work::Sized(budget as usize);
        self.enter(seq_id.py(), work, move |m| m.suggest_chunk(id, budget))
    }

    /// Builds the plan of every sequence scheduled since the last plan (by any thread) and
    /// puts it in flight (without the GIL when it holds more than 4,096 tokens). Commit or
    /// abort it before the next step.
    fn build_plan(&self, py: Python<'_>) -> PyResult<PyStepPlan> {
        let work = Work::Measured(&CacheManager::scheduled_tokens);
        let plan = self.enter(py, work, CacheManager::build_plan)?;
        let (step_id, tokens) = (plan.step_id, plan.num_tokens());
        PyStepPlan::new(py, plan).inspect_err(|_| {
            // The engine never saw the plan: take it out of flight again.
            let _ = self.enter(py, Work::Sized(tokens), move |m| m.withdraw_plan(step_id));
        })
    }

    /// `build_plan` written into `buffers`, arrays that persist across steps, so that no
    /// Python object is made per step (see `PlanBuffers`). Returns the step id; `commit` and
    /// `abort` take the buffers. The previous step's values are overwritten; buffers holding
    /// another manager's step that is still in flight there are refused (`StepError`).
    fn build_plan_into(slf: &Bound<'_, Self>, buffers: &Bound<'_, PyPlanBuffers>) -> PyResult<u64> {
        let py = buffers.py();
        let this = slf.get();
        let mut target = buffers::borrow_mut(buffers)?;
        this.refuse_foreign_step(py, &target)?;
        // The core refills the plan kept in the buffers (no allocation once it is large enough).
        let held = target.step_id().filter(|_| target.owner().is_some_and(|o| o.id == this.id));
        let mut scratch = target.take_scratch();
        let work = Work::Measured(&CacheManager::scheduled_tokens);
        let plan = this.enter(py, work, move |m| {
            refuse_held_in_flight(m, held)?;
            m.build_plan_into(&mut scratch).map(|()| scratch)
        })?;
        Self::deliver(slf, &mut target, plan)
    }

    /// An engine's decode step in one call: commits the step `buffers` hold when it is the
    /// plan in flight, appends `tokens[i]` (the token sampled for it) to `seq_ids[i]`,
    /// schedules one token of each and writes the plan of everything scheduled into
    /// `buffers`. Returns `int32 [N]` in input order: the tokens scheduled (1; 0 for a
    /// sequence still prefilling whose next token is not on the chunk grid), -1 where the
    /// pools could not supply the sequence's block (it is not in the plan).
    ///
    /// The commit happens first and stands even if the rest is refused; the rest is checked
    /// before any of it changes anything. To finish sequences, `commit(buffers)` first, finish
    /// them, then call this for the others (it commits only a step still in flight). Buffers
    /// holding another manager's step still in flight are refused (`StepError`).
    fn decode_step<'py>(
        slf: &Bound<'py, Self>,
        buffers: &Bound<'py, PyPlanBuffers>,
        seq_ids: &Bound<'py, PyAny>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = buffers.py();
        let this = slf.get();
        let ids = self::seq_ids(seq_ids)?;
        let tokens = convert::tokens(tokens, "tokens", BATCH)?;
        let mut target = buffers::borrow_mut(buffers)?;
        this.refuse_foreign_step(py, &target)?;
        // The scratch plan is the step the buffers hold: the core commits it iff it is this
        // manager's plan in flight. That step may be a long prefill chunk: its tokens count as
        // work too.
        let work = Work::Sized(ids.len() + target.scheduled_tokens());
        let mut scratch = target.take_scratch();
        let (scheduled, plan) = this.enter(py, work, move |m| {
            let scheduled = m.decode_step(&ids, &tokens, &mut scratch)?;
            Ok((scheduled, scratch))
        })?;
        Self::deliver(slf, &mut target, plan)?;
        Ok(PyArray1::from_iter(py, scheduled.iter().map(Option::as_ref).map(tokens_or_refused)))
    }

    /// Publishes what the plan's step wrote and advances every sequence in it. `plan`: the
    /// `StepPlan` of `build_plan` or the `PlanBuffers` of `build_plan_into`.
    fn commit(&self, plan: &Bound<'_, PyAny>) -> PyResult<()> {
        let (manager, step, work) = Self::plan_of(plan, "commit")?;
        self.enter(plan.py(), Work::Sized(work), move |m| m.commit(&plan_identity(manager, step)))
    }

    /// Undoes the plan's step (the forward failed): nothing is published and every sequence
    /// is back where it was. Every later plan in flight is aborted too (it may read what this
    /// one wrote); returns the ids of the plans ended, oldest first.
    fn abort(&self, plan: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let (manager, step, work) = Self::plan_of(plan, "abort")?;
        self.enter(plan.py(), Work::Sized(work), move |m| m.abort(&plan_identity(manager, step)))
    }

    /// `commit` by step id (`plan_in_flight`), for a step whose `StepPlan` or `PlanBuffers` is
    /// no longer at hand: commit only once the forward of that very plan has run.
    /// `StalePlanError` unless `step_id` is the step in flight.
    fn commit_step(&self, step_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = step_id.py();
        let step_id = u64_arg(step_id, "step_id", Domain::Request)?;
        self.enter(py, Work::Long, move |m| m.commit_step(step_id))
    }

    /// `abort` by step id (`plan_in_flight`): the way out for a step whose `StepPlan` or
    /// `PlanBuffers` is no longer at hand (lost, or overwritten), which would otherwise keep
    /// the manager refusing `schedule`, `append`, `finish` and `reset`. Nothing is published
    /// and every sequence is back where it was. `StalePlanError` unless `step_id` is the step
    /// in flight.
    fn abort_step(&self, step_id: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let py = step_id.py();
        let step_id = u64_arg(step_id, "step_id", Domain::Request)?;
        self.enter(py, Work::Long, move |m| m.abort_step(step_id))
    }

    /// Appends sampled (or new user) tokens to a sequence; new full units are hashed.
    /// `placeholders`: that many tokens more, not yet sampled (a step in flight is sampling
    /// them: overlapped steps); `resolve` fills them in, oldest first. Known tokens cannot
    /// follow unresolved placeholders.
    #[pyo3(signature = (seq_id, tokens, placeholders = None))]
    fn append(
        &self,
        seq_id: &Bound<'_, PyAny>,
        tokens: &Bound<'_, PyAny>,
        placeholders: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let tokens = convert::tokens(tokens, "tokens", SEQUENCE)?;
        let count = u32_or(placeholders, "placeholders", 0)?;
        let work = Work::Sized(tokens.len());
        self.enter(seq_id.py(), work, move |m| m.append_with_placeholders(id, &tokens, count))
    }

    /// One placeholder for each sequence (an overlapped decode step) in one call; every id is
    /// checked first.
    fn append_placeholders(&self, seq_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        let work = Work::Sized(ids.len());
        self.enter(seq_ids.py(), work, move |m| m.append_placeholders_batch(&ids))
    }

    /// Fills the oldest placeholders of a sequence with the tokens sampled for them; keys
    /// whose step has committed and whose tokens are now known are published (with their
    /// events). More tokens than placeholders: `InvalidRequestError`, nothing changed.
    fn resolve(&self, seq_id: &Bound<'_, PyAny>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let tokens = convert::tokens(tokens, "tokens", SEQUENCE)?;
        self.enter(seq_id.py(), Work::Sized(tokens.len()), move |m| m.resolve(id, &tokens))
    }

    /// `resolve` of one token per sequence in one call; every id is checked first.
    fn resolve_batch(&self, seq_ids: &Bound<'_, PyAny>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        let tokens = convert::tokens(tokens, "tokens", BATCH)?;
        let work = Work::Sized(tokens.len());
        self.enter(seq_ids.py(), work, move |m| m.resolve_batch(&ids, &tokens))
    }

    /// Placeholder tokens of a live sequence not yet resolved.
    fn num_placeholders(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = self::seq_id(seq_id)?;
        self.enter(seq_id.py(), Work::Short, move |m| m.num_placeholders(id))
    }

    /// An overlapped decode step in one call (`max_steps_in_flight` > 1): commits `commit`
    /// (a step id: the oldest plan in flight, whose forward has run), resolves one placeholder
    /// of each `resolve_ids[i]` with `tokens[i]` (what that step sampled), appends one
    /// placeholder to each of `seq_ids`, schedules one token of each and writes the plan of
    /// everything scheduled into `buffers`. Returns `int32 [N]` in input order: the tokens
    /// scheduled (1), -1 where the pools could not supply the sequence's block. Buffers still
    /// holding a plan in flight are refused (`StepError`): keep a ring of D buffers.
    #[pyo3(signature = (buffers, seq_ids, resolve_ids = None, tokens = None, commit = None))]
    fn decode_step_overlapped<'py>(
        slf: &Bound<'py, Self>,
        buffers: &Bound<'py, PyPlanBuffers>,
        seq_ids: &Bound<'py, PyAny>,
        resolve_ids: Option<&Bound<'py, PyAny>>,
        tokens: Option<&Bound<'py, PyAny>>,
        commit: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let py = buffers.py();
        let this = slf.get();
        let ids = self::seq_ids(seq_ids)?;
        let resolve_ids = match resolve_ids.filter(|o| !o.is_none()) {
            Some(r) => self::seq_ids(r)?,
            None => Vec::new(),
        };
        let tokens = match tokens.filter(|o| !o.is_none()) {
            Some(t) => convert::tokens(t, "tokens", BATCH)?,
            None => Vec::new(),
        };
        let commit = match commit.filter(|o| !o.is_none()) {
            Some(c) => Some(u64_arg(c, "commit", Domain::Request)?),
            None => None,
        };
        let mut target = buffers::borrow_mut(buffers)?;
        this.refuse_foreign_step(py, &target)?;
        let held = target.step_id().filter(|_| target.owner().is_some_and(|o| o.id == this.id));
        let work = Work::Sized(ids.len() + resolve_ids.len());
        let mut scratch = target.take_scratch();
        let result = this.enter(py, work, move |m| {
            if let Some(step) = commit {
                m.commit_step(step)?;
            }
            refuse_held_in_flight(m, held)?;
            let scheduled =
                m.decode_step_overlapped(None, &resolve_ids, &tokens, &ids, &mut scratch);
            Ok((scheduled, scratch))
        });
        let (scheduled, plan) = result?;
        let scheduled = match scheduled {
            Ok(s) => s,
            Err(e) => {
                target.keep_scratch(plan);
                return Err(to_pyerr(py, e));
            }
        };
        Self::deliver(slf, &mut target, plan)?;
        Ok(PyArray1::from_iter(py, scheduled.iter().map(Option::as_ref).map(tokens_or_refused)))
    }

    /// One token per sequence (a decode step) in one call; every id is checked first.
    fn append_batch(&self, seq_ids: &Bound<'_, PyAny>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = self::seq_ids(seq_ids)?;
        let tokens = convert::tokens(tokens, "tokens", BATCH)?;
        let work = Work::Sized(tokens.len());
        self.enter(seq_ids.py(), work, move |m| m.append_batch(&ids, &tokens))
    }

    /// Releases a sequence's blocks (tail first), publishes its decode-tail checkpoint and
    /// keeps its tokens and hashes for `extends`. The id may be added again afterwards.
    fn finish(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let work = Work::Measured(&|m| sequence_tokens(m, id));
        self.enter(seq_id.py(), work, move |m| m.finish(id))
    }

    /// Releases a sequence's blocks; it stays live and restarts from a fresh lookup at its
    /// next `schedule`.
    fn preempt(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let id = self::seq_id(seq_id)?;
        let work = Work::Measured(&|m| sequence_tokens(m, id));
        self.enter(seq_id.py(), work, move |m| m.preempt(id))
    }

    /// Drops every cached block and key; `ResetRefusedError` while sequences hold blocks.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        self.enter(py, Work::Long, CacheManager::reset)
    }

    /// Full block-table rows of paged group `group` for `seq_ids`: `int32 [R, C]`, padded
    /// with the null block 0. For a first step or debugging; steps use the plan's updates.
    fn block_table<'py>(
        &self,
        group: &Bound<'py, PyAny>,
        seq_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let py = group.py();
        let group = u32_arg(group, "group", Domain::Request)?;
        let ids = self::seq_ids(seq_ids)?;
        let (flat, rows, columns) =
            self.enter(py, Work::Long, move |m| m.block_table(group, &ids))?;
        Array2::from_shape_vec((rows, columns), flat).map(|a| a.into_pyarray(py)).map_err(|e| {
            to_pyerr(py, CacheError::Invariant { message: format!("block table shape: {e}") })
        })
    }

    /// Takes the pending block events, oldest first.
    fn drain_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let records = self.enter(py, Work::Long, |m| Ok(m.drain_events()))?;
        records.into_iter().map(|r| events::to_python(py, r, self.algorithm)).collect()
    }

    /// Takes the pending block events as one vLLM 0.33 `KVEventBatch` payload (msgpack bytes:
    /// `[ts, [events...], data_parallel_rank]`, hashes as u64 ids), stamped `ts` (seconds)
    /// and `data_parallel_rank`. Returns `(payload, taken, written)`: the events taken and the
    /// wire events written; `payload` is `None` when none was written.
    #[pyo3(signature = (ts, data_parallel_rank=None))]
    fn drain_events_wire<'py>(
        &self,
        py: Python<'py>,
        ts: f64,
        data_parallel_rank: Option<i64>,
    ) -> PyResult<(Option<Bound<'py, PyBytes>>, usize, usize)> {
        let mut buf =
            std::mem::take(&mut *self.wire.lock().unwrap_or_else(PoisonError::into_inner));
        let (buf, drained) = self.enter(py, Work::Short, move |m| {
            let drained = m.drain_events_wire(ts, data_parallel_rank, &mut buf);
            Ok((buf, drained))
        })?;
        let payload = (drained.written > 0).then(|| PyBytes::new(py, &buf[..drained.bytes]));
        *self.wire.lock().unwrap_or_else(PoisonError::into_inner) = buf;
        Ok((payload, drained.taken, drained.written))
    }

    /// A snapshot of the counters.
    fn stats(&self, py: Python<'_>) -> PyResult<PyStats> {
        self.enter(py, Work::Short, |m| Ok(m.stats())).map(PyStats::from)
    }

    /// Block usage per pool, in pool order.
    fn pool_usage(&self, py: Python<'_>) -> PyResult<Vec<PyPoolUsage>> {
        let usage = self.enter(py, Work::Short, |m| Ok(m.pool_usage()))?;
        Ok(usage.into_iter().map(PyPoolUsage::from).collect())
    }

    /// Checks every internal invariant; `InvariantError` describes the first violation.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.enter(py, Work::Long, |m| m.check_invariants())
    }

    /// Tokens of a live sequence computed and committed so far.
    fn num_computed(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = self::seq_id(seq_id)?;
        self.enter(seq_id.py(), Work::Short, move |m| m.num_computed(id))
    }

    /// Tokens of a live sequence (prompt plus appended).
    fn num_tokens(&self, seq_id: &Bound<'_, PyAny>) -> PyResult<u32> {
        let id = self::seq_id(seq_id)?;
        self.enter(seq_id.py(), Work::Short, move |m| m.num_tokens(id))
    }

    /// Test hook: panics inside the lock, as a core bug would (the manager is unusable after);
    /// `short` panics in a call that keeps the GIL.
    #[pyo3(signature = (short = false))]
    fn _panic_for_testing(&self, py: Python<'_>, short: bool) -> PyResult<()> {
        let f = |_: &mut CacheManager| -> Result<(), CacheError> {
            panic!("deliberate panic for testing")
        };
        self.enter(py, if short { Work::Short } else { Work::Long }, f)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let state = self.enter(py, Work::Short, |m| Ok((m.num_sequences(), m.plan_in_flight())));
        match state {
            Ok((live, plan)) => format!(
                "CacheManager(sequences={live}, plan_in_flight={})",
                plan.map_or_else(|| "None".to_string(), |p| p.to_string())
            ),
            Err(_) => "CacheManager(<unusable>)".to_string(),
        }
    }
}

impl PyCacheManager {
    /// `schedule_batch`'s arguments converted and the core called: the core's results.
    fn schedule_many(
        &self,
        seq_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        exact: bool,
    ) -> PyResult<Vec<Option<Scheduled>>> {
        let py = seq_ids.py();
        let ids = self::seq_ids(seq_ids)?;
        let scalar = max_tokens.is_instance_of::<PyInt>()
            || (max_tokens.hasattr("__index__")? && !max_tokens.hasattr("__len__")?);
        let budgets = if scalar {
            vec![u32_arg(max_tokens, "max_tokens", Domain::Request)?; ids.len()]
        } else {
            convert::int_sequence(max_tokens, "max_tokens", u64::from(u32::MAX), BATCH)?
        };
        let work = budgets.iter().map(|&b| b as usize).fold(ids.len(), usize::saturating_add);
        self.enter(py, Work::Sized(work), move |m| m.schedule_batch(&ids, &budgets, exact))
    }

    /// Writes the plan just built into `target` and keeps it there for the next refill; if the
    /// write fails, the engine never saw the plan, so it is taken out of flight again.
    fn deliver(slf: &Bound<'_, Self>, target: &mut PyPlanBuffers, plan: StepPlan) -> PyResult<u64> {
        let (py, this) = (slf.py(), slf.get());
        let (step_id, plan_tokens) = (plan.step_id, plan.num_tokens());
        let manager = Arc::downgrade(&this.inner);
        let owner = Owner { id: this.id, manager, address: slf.as_ptr() as usize };
        let written = target.write(py, owner, &plan);
        target.keep_scratch(plan);
        written.inspect_err(|_| {
            let _ = this.enter(py, Work::Sized(plan_tokens), move |m| m.withdraw_plan(step_id));
        })?;
        Ok(step_id)
    }

    /// `StepError` when `buffers` hold a step of another manager that is still in flight
    /// there: overwriting it would leave that manager no plan to commit or abort it by.
    fn refuse_foreign_step(&self, py: Python<'_>, buffers: &PyPlanBuffers) -> PyResult<()> {
        let (Some(owner), Some(step)) = (buffers.owner(), buffers.step_id()) else {
            return Ok(());
        };
        if owner.id == self.id {
            return Ok(()); // this manager's own step: the core knows whether it is in flight
        }
        let Some(other) = owner.manager.upgrade() else {
            return Ok(()); // that manager is gone, and its step with it
        };
        // A poisoned manager (an error here) is unusable anyway: nothing to protect.
        let in_flight = enter(py, &other, Work::Short, |m| Ok(m.plans_in_flight())).ok();
        if !in_flight.is_some_and(|f| f.contains(&step)) {
            return Ok(());
        }
        Err(to_pyerr(
            py,
            CacheError::Step {
                message: format!(
                    "these PlanBuffers hold step {step} of another CacheManager (the one with \
                     id() {}), which is still in flight there: that manager must end it first \
                     (its commit(buffers), abort(buffers) or abort_step({step})), or give each \
                     manager its own PlanBuffers",
                    owner.address
                ),
            },
        ))
    }

    /// The identity (the manager that built it, its step id) and the scheduled tokens of a
    /// `StepPlan` or `PlanBuffers`: the core's `commit` / `abort` decide from the identity
    /// whether the plan is this manager's to end.
    fn plan_of(plan: &Bound<'_, PyAny>, verb: &str) -> PyResult<(u64, u64, usize)> {
        let py = plan.py();
        let (manager_id, step_id, tokens) = if let Ok(plan) = plan.cast::<PyStepPlan>() {
            let plan = plan.get();
            (plan.manager_id(), plan.step_id(), plan.scheduled_tokens())
        } else if let Ok(buffers) = plan.cast::<PyPlanBuffers>() {
            let buffers = buffers::borrow(buffers)?;
            let Some(step_id) = buffers.step_id() else {
                return Err(to_pyerr(
                    py,
                    CacheError::Step {
                        message: format!(
                            "cannot {verb} these PlanBuffers: no plan was built into them"
                        ),
                    },
                ));
            };
            (buffers.owner().map_or(0, |o| o.id), step_id, buffers.scheduled_tokens())
        } else {
            return Err(PyTypeError::new_err(format!(
                "{verb} takes a StepPlan or PlanBuffers, got {}",
                plan.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())
            )));
        };
        Ok((manager_id, step_id, tokens))
    }
}
