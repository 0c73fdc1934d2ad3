//! `PlanBuffers`: a step plan written into arrays that persist from step to step.
//!
//! `build_plan` returns a fresh `StepPlan` whose arrays are new `NumPy` objects, and making
//! an array costs more than a decode step's whole core work. `build_plan_into` writes the
//! same plan into the arrays (`buffer::Buffer`) of a `PlanBuffers` the engine keeps: no Python
//! object is made in a step unless a buffer has to grow (then that array is replaced by one
//! twice as large). The arrays are sized for the largest step seen so far; each step's values
//! are their leading rows, counted by `num_rows`, `num_copies`, `num_appended`, ... Values past
//! the counts are left from earlier steps. `generation` changes when an array is replaced, so
//! an engine can keep the arrays (or torch tensors over them) and refresh them only then.
//!
//! The buffers remember the manager whose step they hold (`Owner`), so that another manager
//! does not overwrite a step still in flight (`CacheManager` checks it before a build). A build
//! holds the buffers from before it takes the manager's lock until the plan is written; a read
//! or a build from another thread meanwhile is a `StepError` saying so (`borrow`,
//! `borrow_mut`), never a bare `RuntimeError` of a `PyO3` borrow.

use std::sync::{Mutex, Weak};

use prefixcache_core::limits::MAX_BATCH_SEQUENCES;
use prefixcache_core::{CacheError, CacheManager, StepPlan};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use pyo3::{PyClass, PyRef, PyRefMut};

use crate::buffer::Buffer;
use crate::convert::{int_in, u32_arg, Domain};
use crate::errors::to_pyerr;
use crate::group_buffers::{PyPagedGroupBuffers, PyStateGroupBuffers};

/// The `StepError` of buffers that another thread holds for a build.
fn in_use(py: Python<'_>) -> PyErr {
    to_pyerr(
        py,
        CacheError::Step {
            message: "these PlanBuffers are being written by a build (build_plan_into or \
                      decode_step) in another thread: use them once that call has returned, \
                      and give each thread that builds plans its own PlanBuffers"
                .to_string(),
        },
    )
}

/// Buffers (or one of their parts) to read; `StepError` while a build writes them.
pub(crate) fn borrow<'py, T: PyClass>(slf: &Bound<'py, T>) -> PyResult<PyRef<'py, T>> {
    slf.try_borrow().map_err(|_| in_use(slf.py()))
}

/// Buffers to write; `StepError` while another build writes them (or a read holds them).
pub(crate) fn borrow_mut<'py, T: PyClass<Frozen = pyo3::pyclass::boolean_struct::False>>(
    slf: &Bound<'py, T>,
) -> PyResult<PyRefMut<'py, T>> {
    slf.try_borrow_mut().map_err(|_| in_use(slf.py()))
}

/// The manager whose step a `PlanBuffers` holds.
pub(crate) struct Owner {
    /// The core manager's id (`CacheManager::id`, which its plans carry).
    pub id: u64,
    /// The manager itself, to ask whether the step is still in flight (it may be gone).
    pub manager: Weak<Mutex<CacheManager>>,
    /// `id()` of the Python object, for messages.
    pub address: usize,
}

/// A step plan written in place: arrays that persist across steps (see the module doc).
///
/// `CacheManager.build_plan_into(buffers)` and `decode_step(buffers, ..)` fill them;
/// `commit(buffers)` / `abort(buffers)` end the step they hold. One `PlanBuffers` serves one
/// manager at a time: another manager refuses buffers whose step is still in flight. The next
/// build overwrites the arrays: finish reading the previous step (and any work other threads do
/// on tensors made from the arrays) before it; reading them during a build in another thread
/// raises `StepError`. The arrays belong to the buffers: resizing, reshaping or retyping one in
/// place makes the next build raise `InvalidRequestError`.
#[pyclass(name = "PlanBuffers", module = "prefixcache")]
pub struct PyPlanBuffers {
    /// The manager whose step the buffers hold (`None`: none yet).
    owner: Option<Owner>,
    /// The step the buffers hold, or `None` before the first `build_plan_into`.
    step_id: Option<u64>,
    num_rows: usize,
    num_tokens: usize,
    num_copies: usize,
    generation: u64,
    capacity_rows: usize,
    seq_ids: Buffer<i64>,
    query_start_loc: Buffer<i32>,
    num_computed: Buffer<i32>,
    num_scheduled: Buffer<i32>,
    copies: Buffer<i64>,
    paged: Vec<Py<PyPagedGroupBuffers>>,
    state: Vec<Py<PyStateGroupBuffers>>,
    paged_tuple: Py<PyTuple>,
    /// Every count of the step in one tuple (see the `counts` getter).
    counts: Py<PyTuple>,
    /// The values of `counts`, gathered here first (kept, so a step allocates nothing).
    counts_scratch: Vec<usize>,
    state_tuple: Py<PyTuple>,
    /// The groups of `paged` then `state` (which parts the buffers are laid out for).
    groups: Vec<u32>,
    /// Reused for the `int64` sequence ids (the core's are `u64`).
    ids: Vec<i64>,
    /// The core's plan of the last step, refilled by the next one.
    scratch: StepPlan,
}

impl PyPlanBuffers {
    pub(crate) fn step_id(&self) -> Option<u64> {
        self.step_id
    }

    /// The manager whose step the buffers hold.
    pub(crate) fn owner(&self) -> Option<&Owner> {
        self.owner.as_ref()
    }

    pub(crate) fn scheduled_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The core plan to refill (`build_plan_into` hands it back with `keep_scratch`), carrying
    /// the identity of the step these buffers hold (manager and step id; none: manager 0, which
    /// no core manager has), from which the core's `decode_step` decides whether to commit it.
    /// The identity is set here, not left from the last refill: a build that failed dropped
    /// that plan, and the buffers still hold the step before it.
    pub(crate) fn take_scratch(&mut self) -> StepPlan {
        let mut plan = std::mem::take(&mut self.scratch);
        plan.manager = self.owner.as_ref().map_or(0, |o| o.id);
        plan.step_id = self.step_id.unwrap_or(0);
        plan
    }

    pub(crate) fn keep_scratch(&mut self, plan: StepPlan) {
        self.scratch = plan;
    }

    /// The index in `groups` (within `range`) of the group `group` names; a `ValueError`
    /// naming the groups there otherwise, as `StepPlan`'s lookups.
    fn find_group(
        &self,
        group: &Bound<'_, PyAny>,
        range: std::ops::Range<usize>,
        kind: &str,
    ) -> PyResult<usize> {
        let wanted = u32_arg(group, "group", Domain::Request)?;
        let groups = &self.groups[range.clone()];
        groups.iter().position(|&g| g == wanted).map(|i| range.start + i).ok_or_else(|| {
            PyValueError::new_err(format!(
                "group {wanted} is not a {kind} group of this plan ({kind} groups: {groups:?})"
            ))
        })
    }

    /// Writes `plan`, built by the manager `owner`, into the buffers.
    pub(crate) fn write(&mut self, py: Python<'_>, owner: Owner, plan: &StepPlan) -> PyResult<()> {
        let groups = plan.paged.iter().map(|p| p.group).chain(plan.state.iter().map(|s| s.group));
        let shape_changed = self.paged.len() != plan.paged.len()
            || self.state.len() != plan.state.len()
            || !groups.clone().eq(self.groups.iter().copied());
        if shape_changed {
            // A first step, or buffers moved to a manager with other groups.
            let rows = self.capacity_rows;
            let paged = plan
                .paged
                .iter()
                .map(|p| Py::new(py, PyPagedGroupBuffers::new(py, p.group, rows, 8 * rows)?))
                .collect::<PyResult<Vec<_>>>()?;
            let state = plan
                .state
                .iter()
                .map(|s| Py::new(py, PyStateGroupBuffers::new(py, s.group, rows)?))
                .collect::<PyResult<Vec<_>>>()?;
            self.paged_tuple = PyTuple::new(py, &paged)?.unbind();
            self.state_tuple = PyTuple::new(py, &state)?.unbind();
            (self.paged, self.state) = (paged, state);
            self.groups = groups.collect();
        }
        let rows = plan.num_rows();
        self.ids.clear();
        self.ids.extend(plan.seq_ids.iter().map(|&id| id as i64));
        let mut grew = shape_changed;
        grew |= self.seq_ids.write(py, &self.ids, rows, 0)?;
        grew |= self.query_start_loc.write(py, &plan.query_start_loc, rows + 1, 0)?;
        grew |= self.num_computed.write(py, &plan.num_computed, rows, 0)?;
        grew |= self.num_scheduled.write(py, &plan.num_scheduled, rows, 0)?;
        self.num_copies = plan.copies.len() / 4;
        grew |= self.copies.write(py, &plan.copies, self.num_copies, 4)?;
        for (buffers, part) in self.paged.iter().zip(&plan.paged) {
            grew |= borrow_mut(buffers.bind(py))?.write(py, part)?;
        }
        for (buffers, part) in self.state.iter().zip(&plan.state) {
            grew |= borrow_mut(buffers.bind(py))?.write(py, part)?;
        }
        if grew {
            self.generation += 1;
        }
        self.capacity_rows = self.capacity_rows.max(rows);
        self.num_rows = rows;
        self.num_tokens = plan.num_tokens();
        let counts = &mut self.counts_scratch;
        counts.clear();
        counts.extend([rows, self.num_tokens, self.num_copies]);
        for part in &plan.paged {
            counts.extend([part.appended.len() / 3, part.replaced.len() / 3]);
        }
        for part in &plan.state {
            counts.extend([part.max_checkpoints, part.snapshots.len() / 2]);
        }
        self.counts = PyTuple::new(py, counts.iter())?.unbind();
        if self.owner.as_ref().is_none_or(|o| o.id != owner.id) {
            self.owner = Some(owner);
        }
        self.step_id = Some(plan.step_id);
        Ok(())
    }
}

#[pymethods]
impl PyPlanBuffers {
    /// Empty buffers with room for `rows` sequences a step (they grow when a step needs more).
    #[new]
    #[pyo3(signature = (rows = None), text_signature = "(rows=256)")]
    fn new(py: Python<'_>, rows: Option<&Bound<'_, PyAny>>) -> PyResult<Self> {
        let max = MAX_BATCH_SEQUENCES as u64;
        let rows = match rows.filter(|r| !r.is_none()) {
            Some(rows) => int_in(rows, "rows", 1, max, Domain::Request)? as usize,
            None => 256,
        };
        Ok(Self {
            owner: None,
            step_id: None,
            num_rows: 0,
            num_tokens: 0,
            num_copies: 0,
            generation: 0,
            capacity_rows: rows,
            seq_ids: Buffer::new(py, "PlanBuffers.seq_ids", rows, 0)?,
            query_start_loc: Buffer::new(py, "PlanBuffers.query_start_loc", rows + 1, 0)?,
            num_computed: Buffer::new(py, "PlanBuffers.num_computed", rows, 0)?,
            num_scheduled: Buffer::new(py, "PlanBuffers.num_scheduled", rows, 0)?,
            copies: Buffer::new(py, "PlanBuffers.copies", rows, 4)?,
            paged: Vec::new(),
            state: Vec::new(),
            paged_tuple: PyTuple::empty(py).unbind(),
            state_tuple: PyTuple::empty(py).unbind(),
            counts: PyTuple::new(py, [0usize, 0, 0])?.unbind(),
            counts_scratch: Vec::new(),
            groups: Vec::new(),
            ids: Vec::with_capacity(rows),
            scratch: StepPlan::default(),
        })
    }

    /// The step the buffers hold, or `None` before the first `build_plan_into`.
    #[getter(step_id)]
    fn held_step(slf: &Bound<'_, Self>) -> PyResult<Option<u64>> {
        Ok(borrow(slf)?.step_id)
    }

    /// R, the scheduled sequences of this step.
    #[getter]
    fn num_rows(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.num_rows)
    }

    /// T, the scheduled tokens of this step.
    #[getter]
    fn num_tokens(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.num_tokens)
    }

    /// K, the copy-on-write copies of this step.
    #[getter]
    fn num_copies(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.num_copies)
    }

    /// Changes whenever an array (or a group's part) is replaced: an engine that keeps the
    /// arrays, or tensors made from them, refreshes them when it differs from the last value
    /// it saw.
    #[getter]
    fn generation(slf: &Bound<'_, Self>) -> PyResult<u64> {
        Ok(borrow(slf)?.generation)
    }

    /// `int64 [>= R]` the scheduled sequences, in schedule order.
    #[getter]
    fn seq_ids(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.seq_ids.get(slf.py()))
    }

    /// `int32 [>= R + 1]` where each row's tokens start in the packed batch.
    #[getter]
    fn query_start_loc(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.query_start_loc.get(slf.py()))
    }

    /// `int32 [>= R]` tokens of each row computed before this step.
    #[getter]
    fn num_computed(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.num_computed.get(slf.py()))
    }

    /// `int32 [>= R]` tokens of each row scheduled in this step.
    #[getter]
    fn num_scheduled(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.num_scheduled.get(slf.py()))
    }

    /// `int64 [>= num_copies, 4]` rows `(group, src_block, dst_block, num_tokens)`.
    #[getter]
    fn copies(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.copies.get(slf.py()))
    }

    /// Per paged group, in group order (the same tuple every step while the groups stay).
    #[getter]
    fn paged(slf: &Bound<'_, Self>) -> PyResult<Py<PyTuple>> {
        Ok(borrow(slf)?.paged_tuple.clone_ref(slf.py()))
    }

    /// Per state group, in group order.
    #[getter]
    fn state(slf: &Bound<'_, Self>) -> PyResult<Py<PyTuple>> {
        Ok(borrow(slf)?.state_tuple.clone_ref(slf.py()))
    }

    /// The part of paged group `group` (its index in the configuration), as
    /// `StepPlan.paged_group`.
    fn paged_group(
        slf: &Bound<'_, Self>,
        group: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyPagedGroupBuffers>> {
        let this = borrow(slf)?;
        let at = this.find_group(group, 0..this.paged.len(), "paged")?;
        Ok(this.paged[at].clone_ref(slf.py()))
    }

    /// The part of state group `group` (its index in the configuration), as
    /// `StepPlan.state_group`.
    fn state_group(
        slf: &Bound<'_, Self>,
        group: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyStateGroupBuffers>> {
        let this = borrow(slf)?;
        let paged = this.paged.len();
        let at = this.find_group(group, paged..this.groups.len(), "state")?;
        Ok(this.state[at - paged].clone_ref(slf.py()))
    }

    /// Every count of this step in one tuple, for a loop that reads them all each step:
    /// `(num_rows, num_tokens, num_copies)`, then `(num_appended, num_replaced)` per paged
    /// group and `(max_checkpoints, num_snapshots)` per state group, in group order.
    #[getter]
    fn counts(slf: &Bound<'_, Self>) -> PyResult<Py<PyTuple>> {
        Ok(borrow(slf)?.counts.clone_ref(slf.py()))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let this = borrow(slf)?;
        Ok(format!(
            "PlanBuffers(step_id={}, rows={}, tokens={}, copies={})",
            this.step_id.map_or_else(|| "None".to_string(), |s| s.to_string()),
            this.num_rows,
            this.num_tokens,
            this.num_copies
        ))
    }
}
