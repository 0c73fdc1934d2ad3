//! `PlanBuffers`: a step plan written into arrays that persist from step to step.
//!
//! `build_plan` returns a fresh `StepPlan` whose arrays are new `NumPy` objects, and making
//! an array costs more than a decode step's whole core work. `build_plan_into` writes the
//! same plan into the arrays of a `PlanBuffers` the engine keeps: no Python object is made in
//! a step unless a buffer has to grow (then that array is replaced by one twice as large). The
//! arrays are sized for the largest step seen so far; each step's values are their leading
//! rows, counted by `num_rows`, `num_copies`, `num_appended`, ... Values past the counts are
//! left from earlier steps. `generation` changes when an array is replaced, so an engine can
//! keep the arrays (or torch tensors over them) and refresh them only then.

use numpy::prelude::*;
use numpy::{Element, PyArray1, PyArray2};
use prefixcache_core::{PagedGroupPlan, StateGroupPlan, StepPlan};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::{int_in, Domain};

/// A `[rows, columns]` array (columns 0: one-dimensional) that grows when a step needs more.
struct Buffer<T: Element> {
    array: Py<PyAny>,
    rows: usize,
    columns: usize,
    _element: std::marker::PhantomData<T>,
}

impl<T: Element + Copy + Default> Buffer<T> {
    fn new(py: Python<'_>, rows: usize, columns: usize) -> Self {
        let array = if columns == 0 {
            PyArray1::<T>::zeros(py, rows, false).into_any().unbind()
        } else {
            PyArray2::<T>::zeros(py, [rows, columns], false).into_any().unbind()
        };
        Self { array, rows, columns, _element: std::marker::PhantomData }
    }

    /// Writes `data`, `rows` rows of `columns` values (`columns == 0`: a vector of `rows`),
    /// into the leading rows, growing the array first if it is too small. Returns whether the
    /// array was replaced by a larger one.
    fn write(&mut self, py: Python<'_>, data: &[T], rows: usize, columns: usize) -> PyResult<bool> {
        if rows == 0 {
            return Ok(false); // nothing to write, and any array holds no rows
        }
        // A one-dimensional buffer is always written with `columns == 0`; a two-dimensional
        // one with at most as many columns as it has, or it grows.
        let grow = rows > self.rows || columns > self.columns;
        if grow {
            let grown_rows = if rows > self.rows { rows.max(2 * self.rows) } else { self.rows };
            *self = Self::new(py, grown_rows, columns.max(self.columns));
        }
        let stride = self.columns.max(1);
        let width = columns.max(1);
        let needed = rows * stride;
        // SAFETY: the array is the type `new` made (no setter replaces it from Python). It is
        // reachable from Python only through this object's getters; the GIL is held, so no
        // Python code reads or resizes it during the write, and this crate never holds another
        // borrow of it. (Native code that works on it without the GIL, such as a torch CPU op
        // on a tensor made from it in another thread, must not run during a build: the class
        // documents that the next build overwrites the arrays.) A user who resized an array in
        // place gets a shorter slice, caught below.
        let slice = unsafe {
            let bound = self.array.bind(py);
            if self.columns == 0 {
                bound.cast_unchecked::<PyArray1<T>>().as_slice_mut()?
            } else {
                bound.cast_unchecked::<PyArray2<T>>().as_slice_mut()?
            }
        };
        if slice.len() < needed {
            return Err(PyValueError::new_err(
                "a PlanBuffers array was resized from Python; create a new PlanBuffers",
            ));
        }
        if stride == width {
            slice[..data.len()].copy_from_slice(data);
        } else {
            for (row, values) in data.chunks_exact(width).enumerate() {
                slice[row * stride..row * stride + width].copy_from_slice(values);
            }
        }
        Ok(grow)
    }

    fn get(&self, py: Python<'_>) -> Py<PyAny> {
        self.array.clone_ref(py)
    }
}

/// One paged group's part of the plan in `PlanBuffers`.
#[pyclass(name = "PagedGroupBuffers", module = "prefixcache")]
pub struct PyPagedGroupBuffers {
    /// Index of the group in the configuration.
    #[pyo3(get)]
    group: u32,
    /// Rows of `appended` this step.
    #[pyo3(get)]
    num_appended: usize,
    /// Rows of `replaced` this step.
    #[pyo3(get)]
    num_replaced: usize,
    appended: Buffer<i32>,
    replaced: Buffer<i32>,
    slot_mapping: Buffer<i64>,
}

impl PyPagedGroupBuffers {
    fn new(py: Python<'_>, group: u32, rows: usize, tokens: usize) -> Self {
        Self {
            group,
            num_appended: 0,
            num_replaced: 0,
            appended: Buffer::new(py, rows, 3),
            replaced: Buffer::new(py, rows, 3),
            slot_mapping: Buffer::new(py, tokens, 0),
        }
    }

    /// Writes the group's part; whether an array grew.
    fn write(&mut self, py: Python<'_>, plan: &PagedGroupPlan) -> PyResult<bool> {
        self.num_appended = plan.appended.len() / 3;
        self.num_replaced = plan.replaced.len() / 3;
        let mut grew = self.appended.write(py, &plan.appended, self.num_appended, 3)?;
        grew |= self.replaced.write(py, &plan.replaced, self.num_replaced, 3)?;
        grew |= self.slot_mapping.write(py, &plan.slot_mapping, plan.slot_mapping.len(), 0)?;
        Ok(grew)
    }
}

#[pymethods]
impl PyPagedGroupBuffers {
    /// `int32 [>= num_appended, 3]` rows `(row, column, block)` appended to the tables.
    #[getter]
    fn appended(&self, py: Python<'_>) -> Py<PyAny> {
        self.appended.get(py)
    }

    /// `int32 [>= num_replaced, 3]` rows `(row, column, block)` replaced (block 0: released).
    #[getter]
    fn replaced(&self, py: Python<'_>) -> Py<PyAny> {
        self.replaced.get(py)
    }

    /// `int64 [>= num_tokens]` the KV slot of each scheduled token.
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> Py<PyAny> {
        self.slot_mapping.get(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "PagedGroupBuffers(group={}, num_appended={}, num_replaced={})",
            self.group, self.num_appended, self.num_replaced
        )
    }
}

/// One state group's part of the plan in `PlanBuffers`.
#[pyclass(name = "StateGroupBuffers", module = "prefixcache")]
pub struct PyStateGroupBuffers {
    /// Index of the group in the configuration.
    #[pyo3(get)]
    group: u32,
    /// Cmax this step: the columns of `checkpoint_offsets` / `checkpoint_slots` in use.
    #[pyo3(get)]
    max_checkpoints: usize,
    /// Rows of `snapshots` this step.
    #[pyo3(get)]
    num_snapshots: usize,
    running_slot: Buffer<i32>,
    initial_slot: Buffer<i32>,
    checkpoint_offsets: Buffer<i32>,
    checkpoint_slots: Buffer<i32>,
    snapshots: Buffer<i32>,
}

impl PyStateGroupBuffers {
    fn new(py: Python<'_>, group: u32, rows: usize) -> Self {
        Self {
            group,
            max_checkpoints: 0,
            num_snapshots: 0,
            running_slot: Buffer::new(py, rows, 0),
            initial_slot: Buffer::new(py, rows, 0),
            checkpoint_offsets: Buffer::new(py, rows, 1),
            checkpoint_slots: Buffer::new(py, rows, 1),
            snapshots: Buffer::new(py, rows, 2),
        }
    }

    /// Writes the group's part; whether an array grew.
    fn write(&mut self, py: Python<'_>, plan: &StateGroupPlan) -> PyResult<bool> {
        let rows = plan.running_slot.len();
        self.max_checkpoints = plan.max_checkpoints;
        self.num_snapshots = plan.snapshots.len() / 2;
        let mut grew = self.running_slot.write(py, &plan.running_slot, rows, 0)?;
        grew |= self.initial_slot.write(py, &plan.initial_slot, rows, 0)?;
        if plan.max_checkpoints > 0 {
            let c = plan.max_checkpoints;
            grew |= self.checkpoint_offsets.write(py, &plan.checkpoint_offsets, rows, c)?;
            grew |= self.checkpoint_slots.write(py, &plan.checkpoint_slots, rows, c)?;
        }
        grew |= self.snapshots.write(py, &plan.snapshots, self.num_snapshots, 2)?;
        Ok(grew)
    }
}

#[pymethods]
impl PyStateGroupBuffers {
    /// `int32 [>= R]` the running-state slot each row writes.
    #[getter]
    fn running_slot(&self, py: Python<'_>) -> Py<PyAny> {
        self.running_slot.get(py)
    }

    /// `int32 [>= R]` the slot each row reads (-1 = zero state).
    #[getter]
    fn initial_slot(&self, py: Python<'_>) -> Py<PyAny> {
        self.initial_slot.get(py)
    }

    /// `int32 [>= R, >= max_checkpoints]` interior checkpoint offsets (0 = none); only the
    /// first `max_checkpoints` columns of the first R rows belong to this step.
    #[getter]
    fn checkpoint_offsets(&self, py: Python<'_>) -> Py<PyAny> {
        self.checkpoint_offsets.get(py)
    }

    /// `int32 [>= R, >= max_checkpoints]` checkpoint slots (-1 = none), as `checkpoint_offsets`.
    #[getter]
    fn checkpoint_slots(&self, py: Python<'_>) -> Py<PyAny> {
        self.checkpoint_slots.get(py)
    }

    /// `int32 [>= num_snapshots, 2]` rows `(running slot, checkpoint slot)` copied after the
    /// forward.
    #[getter]
    fn snapshots(&self, py: Python<'_>) -> Py<PyAny> {
        self.snapshots.get(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "StateGroupBuffers(group={}, max_checkpoints={}, num_snapshots={})",
            self.group, self.max_checkpoints, self.num_snapshots
        )
    }
}

/// A step plan written in place: arrays that persist across steps (see the module doc).
///
/// `CacheManager.build_plan_into(buffers)` and `decode_step(buffers, ..)` fill them;
/// `commit(buffers)` / `abort(buffers)` end the step they hold. One `PlanBuffers` serves one
/// manager at a time. The next build overwrites the arrays: finish reading the previous step
/// (and any work other threads do on tensors made from the arrays) before it.
#[pyclass(name = "PlanBuffers", module = "prefixcache")]
pub struct PyPlanBuffers {
    /// The manager whose step the buffers hold (0: none yet).
    pub(crate) manager_id: u64,
    /// The step the buffers hold, or `None` before the first `build_plan_into`.
    #[pyo3(get)]
    step_id: Option<u64>,
    /// R, the scheduled sequences of this step.
    #[pyo3(get)]
    num_rows: usize,
    /// T, the scheduled tokens of this step.
    #[pyo3(get)]
    num_tokens: usize,
    /// K, the copy-on-write copies of this step.
    #[pyo3(get)]
    num_copies: usize,
    /// Changes whenever an array (or a group's part) is replaced: an engine that keeps the
    /// arrays, or tensors made from them, refreshes them when it differs from the last value
    /// it saw.
    #[pyo3(get)]
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

    pub(crate) fn scheduled_tokens(&self) -> usize {
        self.num_tokens
    }

    /// The core plan to refill (`build_plan_into` hands it back with `keep_scratch`).
    pub(crate) fn take_scratch(&mut self) -> StepPlan {
        std::mem::take(&mut self.scratch)
    }

    pub(crate) fn keep_scratch(&mut self, plan: StepPlan) {
        self.scratch = plan;
    }

    /// Writes `plan`, built by manager `manager_id`, into the buffers.
    pub(crate) fn write(
        &mut self,
        py: Python<'_>,
        manager_id: u64,
        plan: &StepPlan,
    ) -> PyResult<()> {
        let groups = plan.paged.iter().map(|p| p.group).chain(plan.state.iter().map(|s| s.group));
        let shape_changed = self.paged.len() != plan.paged.len()
            || self.state.len() != plan.state.len()
            || !groups.clone().eq(self.groups.iter().copied());
        if shape_changed {
            self.groups = groups.collect();
            // A first step, or buffers moved to a manager with other groups.
            let rows = self.capacity_rows;
            self.paged = plan
                .paged
                .iter()
                .map(|p| Py::new(py, PyPagedGroupBuffers::new(py, p.group, rows, 8 * rows)))
                .collect::<PyResult<_>>()?;
            self.state = plan
                .state
                .iter()
                .map(|s| Py::new(py, PyStateGroupBuffers::new(py, s.group, rows)))
                .collect::<PyResult<_>>()?;
            self.paged_tuple = PyTuple::new(py, &self.paged)?.unbind();
            self.state_tuple = PyTuple::new(py, &self.state)?.unbind();
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
            grew |= buffers.borrow_mut(py).write(py, part)?;
        }
        for (buffers, part) in self.state.iter().zip(&plan.state) {
            grew |= buffers.borrow_mut(py).write(py, part)?;
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
        self.manager_id = manager_id;
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
        let rows = match rows.filter(|r| !r.is_none()) {
            Some(rows) => int_in(rows, "rows", 1, 1 << 20, Domain::Request)? as usize,
            None => 256,
        };
        Ok(Self {
            manager_id: 0,
            step_id: None,
            num_rows: 0,
            num_tokens: 0,
            num_copies: 0,
            generation: 0,
            capacity_rows: rows,
            seq_ids: Buffer::new(py, rows, 0),
            query_start_loc: Buffer::new(py, rows + 1, 0),
            num_computed: Buffer::new(py, rows, 0),
            num_scheduled: Buffer::new(py, rows, 0),
            copies: Buffer::new(py, rows, 4),
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

    /// `int64 [>= R]` the scheduled sequences, in schedule order.
    #[getter]
    fn seq_ids(&self, py: Python<'_>) -> Py<PyAny> {
        self.seq_ids.get(py)
    }

    /// `int32 [>= R + 1]` where each row's tokens start in the packed batch.
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> Py<PyAny> {
        self.query_start_loc.get(py)
    }

    /// `int32 [>= R]` tokens of each row computed before this step.
    #[getter]
    fn num_computed(&self, py: Python<'_>) -> Py<PyAny> {
        self.num_computed.get(py)
    }

    /// `int32 [>= R]` tokens of each row scheduled in this step.
    #[getter]
    fn num_scheduled(&self, py: Python<'_>) -> Py<PyAny> {
        self.num_scheduled.get(py)
    }

    /// `int64 [>= num_copies, 4]` rows `(group, src_block, dst_block, num_tokens)`.
    #[getter]
    fn copies(&self, py: Python<'_>) -> Py<PyAny> {
        self.copies.get(py)
    }

    /// Per paged group, in group order (the same tuple every step while the groups stay).
    #[getter]
    fn paged(&self, py: Python<'_>) -> Py<PyTuple> {
        self.paged_tuple.clone_ref(py)
    }

    /// Per state group, in group order.
    #[getter]
    fn state(&self, py: Python<'_>) -> Py<PyTuple> {
        self.state_tuple.clone_ref(py)
    }

    /// Every count of this step in one tuple, for a loop that reads them all each step:
    /// `(num_rows, num_tokens, num_copies)`, then `(num_appended, num_replaced)` per paged
    /// group and `(max_checkpoints, num_snapshots)` per state group, in group order.
    #[getter]
    fn counts(&self, py: Python<'_>) -> Py<PyTuple> {
        self.counts.clone_ref(py)
    }

    fn __repr__(&self) -> String {
        format!(
            "PlanBuffers(step_id={}, rows={}, tokens={}, copies={})",
            self.step_id.map_or_else(|| "None".to_string(), |s| s.to_string()),
            self.num_rows,
            self.num_tokens,
            self.num_copies
        )
    }
}
