//! The step plan as `NumPy` arrays.
//!
//! A [`PyStepPlan`] holds the vectors of the core's `StepPlan` and turns each into a `NumPy`
//! array the first time it is read, then returns that same array object (and buffer) on every
//! later read. Creating an array costs more than a decode step's core work, and a scheduler loop
//! often reads only some of them, so an array nobody reads is never created. A small vector
//! (a decode step's) is copied into an array that owns its memory on first read; a large one (a
//! prefill chunk's slot mapping) is moved into its array when the plan is built, without a copy
//! (`into_pyarray`, which keeps the vector alive through a base object). The arrays are
//! writable so that `torch.from_numpy` shares them without a warning; the manager never reads
//! them back (`commit` uses only the step id). A plan remembers which manager built it.

use std::sync::OnceLock;

use numpy::ndarray::Array2;
use numpy::prelude::*;
use numpy::{PyArray1, PyArray2};
use prefixcache_core::{CacheError, PagedGroupPlan, StateGroupPlan, StepPlan};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use crate::convert::{u32_arg, Domain};
use crate::errors::to_pyerr;

/// Vectors of more bytes than this are moved into their array when the plan is built; smaller
/// ones are copied on first read (a copy of a few hundred bytes costs less than the second
/// Python object a move needs).
const COPY_MAX_BYTES: usize = 4096;

/// One plan array: `[rows, columns]` values (`columns == 0`: one-dimensional, `rows` long),
/// made a `NumPy` array on first read.
struct PlanArray<T: numpy::Element> {
    /// The values, until the array is made (always empty for a moved vector).
    data: Vec<T>,
    rows: usize,
    columns: Option<usize>,
    array: OnceLock<Py<PyAny>>,
}

impl<T: numpy::Element + Copy> PlanArray<T> {
    /// A one-dimensional array of `data`.
    fn vector(py: Python<'_>, data: Vec<T>) -> PyResult<Self> {
        let rows = data.len();
        Self::new(py, data, rows, None)
    }

    /// A `[len / columns, columns]` array of `data` (`len` a multiple of `columns`, checked).
    fn matrix(py: Python<'_>, data: Vec<T>, columns: usize, what: &str) -> PyResult<Self> {
        let rows = data.len().checked_div(columns).unwrap_or(0);
        Self::rows(py, data, rows, columns, what)
    }

    /// A `[rows, columns]` array of `data` (`rows * columns == len`, checked).
    fn rows(
        py: Python<'_>,
        data: Vec<T>,
        rows: usize,
        columns: usize,
        what: &str,
    ) -> PyResult<Self> {
        if rows.checked_mul(columns) != Some(data.len()) {
            return Err(to_pyerr(
                py,
                CacheError::Invariant {
                    message: format!(
                        "plan array {what} has {} values, not {rows} x {columns}",
                        data.len()
                    ),
                },
            ));
        }
        Self::new(py, data, rows, Some(columns))
    }

    fn new(py: Python<'_>, data: Vec<T>, rows: usize, columns: Option<usize>) -> PyResult<Self> {
        let array = OnceLock::new();
        if std::mem::size_of_val(data.as_slice()) <= COPY_MAX_BYTES {
            return Ok(Self { data, rows, columns, array });
        }
        let moved = match columns {
            None => data.into_pyarray(py).into_any().unbind(),
            Some(c) => Array2::from_shape_vec((rows, c), data)
                .map_err(|e| {
                    to_pyerr(
                        py,
                        CacheError::Invariant { message: format!("plan array shape: {e}") },
                    )
                })?
                .into_pyarray(py)
                .into_any()
                .unbind(),
        };
        let _ = array.set(moved);
        Ok(Self { data: Vec::new(), rows, columns, array })
    }

    /// The array (made now on the first read). Made with the GIL held and no lock taken, so
    /// Python code run meanwhile (a garbage collection) cannot deadlock with another reader;
    /// if two threads race, both make one and the first stored wins for every later read.
    fn get(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if let Some(array) = self.array.get() {
            return Ok(array.clone_ref(py));
        }
        let made = self.make(py)?;
        Ok(match self.array.set(made.clone_ref(py)) {
            Ok(()) => made,
            Err(_) => self.array.get().map_or(made, |first| first.clone_ref(py)),
        })
    }

    fn make(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(columns) = self.columns else {
            return Ok(PyArray1::from_slice(py, &self.data).into_any().unbind());
        };
        // SAFETY: the array is created uninitialised with `rows * columns` elements,
        // `data.len()` of them (checked when the plan was built), and all are written before
        // Python can see it; a fresh array is C-contiguous, so `as_slice_mut` succeeds (were it
        // to fail, the array is dropped unseen and the error raised).
        unsafe {
            let array = PyArray2::<T>::new(py, [self.rows, columns], false);
            array.as_slice_mut()?.copy_from_slice(&self.data);
            Ok(array.into_any().unbind())
        }
    }

    /// The first dimension's length.
    fn len(&self) -> usize {
        self.rows
    }

    /// The second dimension's length (0 for a vector).
    fn width(&self) -> usize {
        self.columns.unwrap_or(0)
    }
}

/// One paged group's part of a plan: block-table updates and the KV slot of every token.
#[pyclass(frozen, name = "PagedGroupPlan", module = "prefixcache")]
pub struct PyPagedGroupPlan {
    /// Index of the group in the configuration.
    #[pyo3(get)]
    group: u32,
    appended: PlanArray<i32>,
    replaced: PlanArray<i32>,
    slot_mapping: PlanArray<i64>,
}

impl PyPagedGroupPlan {
    fn new(py: Python<'_>, plan: PagedGroupPlan) -> PyResult<Self> {
        Ok(Self {
            group: plan.group,
            appended: PlanArray::matrix(py, plan.appended, 3, "appended")?,
            replaced: PlanArray::matrix(py, plan.replaced, 3, "replaced")?,
            slot_mapping: PlanArray::vector(py, plan.slot_mapping)?,
        })
    }
}

#[pymethods]
impl PyPagedGroupPlan {
    /// `int32 [M, 3]` rows `(row, column, block)`: entries appended to the sequences' tables.
    #[getter]
    fn appended(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.appended.get(py)
    }

    /// `int32 [M', 3]` rows `(row, column, block)`: entries replaced (released by a sliding
    /// window: block 0).
    #[getter]
    fn replaced(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.replaced.get(py)
    }

    /// `int64 [T]` slot `block * block_size + offset` of each scheduled token.
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.slot_mapping.get(py)
    }

    /// Rows of `appended` (as `PagedGroupBuffers.num_appended`).
    #[getter]
    fn num_appended(&self) -> usize {
        self.appended.len()
    }

    /// Rows of `replaced` (as `PagedGroupBuffers.num_replaced`).
    #[getter]
    fn num_replaced(&self) -> usize {
        self.replaced.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "PagedGroupPlan(group={}, appended={}, replaced={}, tokens={})",
            self.group,
            self.appended.len(),
            self.replaced.len(),
            self.slot_mapping.len(),
        )
    }
}

/// One state group's part of a plan: which slots the kernels read and write.
#[pyclass(frozen, name = "StateGroupPlan", module = "prefixcache")]
pub struct PyStateGroupPlan {
    /// Index of the group in the configuration.
    #[pyo3(get)]
    group: u32,
    running_slot: PlanArray<i32>,
    initial_slot: PlanArray<i32>,
    checkpoint_offsets: PlanArray<i32>,
    checkpoint_slots: PlanArray<i32>,
    snapshots: PlanArray<i32>,
}

impl PyStateGroupPlan {
    fn new(py: Python<'_>, plan: StateGroupPlan) -> PyResult<Self> {
        let rows = plan.running_slot.len();
        let cmax = plan.max_checkpoints;
        Ok(Self {
            group: plan.group,
            running_slot: PlanArray::vector(py, plan.running_slot)?,
            initial_slot: PlanArray::vector(py, plan.initial_slot)?,
            checkpoint_offsets: PlanArray::rows(
                py,
                plan.checkpoint_offsets,
                rows,
                cmax,
                "offsets",
            )?,
            checkpoint_slots: PlanArray::rows(py, plan.checkpoint_slots, rows, cmax, "slots")?,
            snapshots: PlanArray::matrix(py, plan.snapshots, 2, "snapshots")?,
        })
    }
}

#[pymethods]
impl PyStateGroupPlan {
    /// `int32 [R]` the running-state slot each row writes.
    #[getter]
    fn running_slot(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.running_slot.get(py)
    }

    /// `int32 [R]` the slot each row reads (-1 = zero state); never equal to `running_slot`.
    #[getter]
    fn initial_slot(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.initial_slot.get(py)
    }

    /// `int32 [R, Cmax]` interior checkpoint offsets from the row's query start (0 = none).
    #[getter]
    fn checkpoint_offsets(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.checkpoint_offsets.get(py)
    }

    /// `int32 [R, Cmax]` the slot each interior checkpoint goes to (-1 = none).
    #[getter]
    fn checkpoint_slots(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.checkpoint_slots.get(py)
    }

    /// `int32 [S, 2]` rows `(running slot, checkpoint slot)` copied after the forward.
    #[getter]
    fn snapshots(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.snapshots.get(py)
    }

    /// Cmax, the columns of `checkpoint_offsets` / `checkpoint_slots` (as
    /// `StateGroupBuffers.max_checkpoints`).
    #[getter]
    fn max_checkpoints(&self) -> usize {
        self.checkpoint_offsets.width()
    }

    /// S, the rows of `snapshots` (as `StateGroupBuffers.num_snapshots`).
    #[getter]
    fn num_snapshots(&self) -> usize {
        self.snapshots.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "StateGroupPlan(group={}, rows={}, max_checkpoints={}, snapshots={})",
            self.group,
            self.checkpoint_offsets.len(),
            self.checkpoint_offsets.width(),
            self.snapshots.len(),
        )
    }
}

/// Everything the kernels need for one step (R scheduled sequences, T scheduled tokens).
///
/// Arrays are `NumPy` arrays made on first read; reading an attribute twice returns the same
/// array, and `torch.from_numpy` shares its memory.
#[pyclass(frozen, name = "StepPlan", module = "prefixcache")]
pub struct PyStepPlan {
    /// The core manager that built the plan (`StepPlan::manager`; another manager's `commit`
    /// refuses it).
    manager_id: u64,
    /// Identifies the step; `commit` and `abort` use it.
    #[pyo3(get)]
    step_id: u64,
    seq_ids: PlanArray<i64>,
    query_start_loc: PlanArray<i32>,
    num_computed: PlanArray<i32>,
    num_scheduled: PlanArray<i32>,
    copies: PlanArray<i64>,
    paged: Vec<Py<PyPagedGroupPlan>>,
    state: Vec<Py<PyStateGroupPlan>>,
    num_tokens: usize,
}

impl PyStepPlan {
    pub(crate) fn new(py: Python<'_>, plan: StepPlan) -> PyResult<Self> {
        let num_tokens = plan.num_tokens();
        let seq_ids: Vec<i64> = plan.seq_ids.iter().map(|&id| id as i64).collect();
        Ok(Self {
            manager_id: plan.manager,
            step_id: plan.step_id,
            seq_ids: PlanArray::vector(py, seq_ids)?,
            query_start_loc: PlanArray::vector(py, plan.query_start_loc)?,
            num_computed: PlanArray::vector(py, plan.num_computed)?,
            num_scheduled: PlanArray::vector(py, plan.num_scheduled)?,
            copies: PlanArray::matrix(py, plan.copies, 4, "copies")?,
            paged: plan
                .paged
                .into_iter()
                .map(|p| Py::new(py, PyPagedGroupPlan::new(py, p)?))
                .collect::<PyResult<_>>()?,
            state: plan
                .state
                .into_iter()
                .map(|s| Py::new(py, PyStateGroupPlan::new(py, s)?))
                .collect::<PyResult<_>>()?,
            num_tokens,
        })
    }

    pub(crate) fn step_id(&self) -> u64 {
        self.step_id
    }

    pub(crate) fn manager_id(&self) -> u64 {
        self.manager_id
    }

    /// Tokens the step schedules (what `commit` and `abort` work through).
    pub(crate) fn scheduled_tokens(&self) -> usize {
        self.num_tokens
    }
}

#[pymethods]
impl PyStepPlan {
    /// `int64 [R]` the scheduled sequences, in schedule order.
    #[getter]
    fn seq_ids(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.seq_ids.get(py)
    }

    /// `int32 [R + 1]` where each row's tokens start in the packed batch.
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.query_start_loc.get(py)
    }

    /// `int32 [R]` tokens of each row computed before this step.
    #[getter]
    fn num_computed(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.num_computed.get(py)
    }

    /// `int32 [R]` tokens of each row scheduled in this step.
    #[getter]
    fn num_scheduled(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.num_scheduled.get(py)
    }

    /// `int64 [K, 4]` rows `(group, src_block, dst_block, num_tokens)`: copy-on-write copies
    /// of paged blocks to run before the forward.
    #[getter]
    fn copies(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.copies.get(py)
    }

    /// Per paged group (full attention, sliding window), in group order.
    #[getter]
    fn paged(&self, py: Python<'_>) -> Vec<Py<PyPagedGroupPlan>> {
        self.paged.iter().map(|p| p.clone_ref(py)).collect()
    }

    /// Per state group, in group order.
    #[getter]
    fn state(&self, py: Python<'_>) -> Vec<Py<PyStateGroupPlan>> {
        self.state.iter().map(|s| s.clone_ref(py)).collect()
    }

    /// R, the scheduled sequences.
    #[getter]
    fn num_rows(&self) -> usize {
        self.seq_ids.len()
    }

    /// T, the scheduled tokens.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// K, the copy-on-write copies (the rows of `copies`).
    #[getter]
    fn num_copies(&self) -> usize {
        self.copies.len()
    }

    /// Every count of the step in one tuple, as `PlanBuffers.counts`: `(num_rows, num_tokens,
    /// num_copies)`, then `(num_appended, num_replaced)` per paged group and
    /// `(max_checkpoints, num_snapshots)` per state group, in group order.
    #[getter]
    fn counts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let mut counts = vec![self.num_rows(), self.num_tokens, self.copies.len()];
        for part in &self.paged {
            let part = part.get();
            counts.extend([part.appended.len(), part.replaced.len()]);
        }
        for part in &self.state {
            let part = part.get();
            counts.extend([part.checkpoint_offsets.width(), part.snapshots.len()]);
        }
        PyTuple::new(py, counts)
    }

    /// The part of paged group `group` (its index in the configuration).
    fn paged_group(&self, group: &Bound<'_, PyAny>) -> PyResult<Py<PyPagedGroupPlan>> {
        let py = group.py();
        let group = u32_arg(group, "group", Domain::Request)?;
        self.paged.iter().find(|p| p.get().group == group).map(|p| p.clone_ref(py)).ok_or_else(
            || {
                let groups: Vec<u32> = self.paged.iter().map(|p| p.get().group).collect();
                PyValueError::new_err(format!(
                    "group {group} is not a paged group of this plan (paged groups: {groups:?})"
                ))
            },
        )
    }

    /// The part of state group `group` (its index in the configuration).
    fn state_group(&self, group: &Bound<'_, PyAny>) -> PyResult<Py<PyStateGroupPlan>> {
        let py = group.py();
        let group = u32_arg(group, "group", Domain::Request)?;
        self.state.iter().find(|s| s.get().group == group).map(|s| s.clone_ref(py)).ok_or_else(
            || {
                let groups: Vec<u32> = self.state.iter().map(|s| s.get().group).collect();
                PyValueError::new_err(format!(
                    "group {group} is not a state group of this plan (state groups: {groups:?})"
                ))
            },
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(step_id={}, rows={}, tokens={}, copies={})",
            self.step_id,
            self.num_rows(),
            self.num_tokens,
            self.copies.len(),
        )
    }
}
