//! The step plan as `NumPy` arrays.
//!
//! A [`PyStepPlan`] is built once from the core's `StepPlan`: every vector is *moved* into a
//! `NumPy` array (`into_pyarray`, no copy; two-dimensional ones get their shape from
//! `ndarray::Array2::from_shape_vec`, which keeps the buffer) and the arrays are stored, so every
//! read of an attribute returns the same array object and buffer. The arrays are writable so
//! that `torch.from_numpy` shares them without a warning; the manager never reads them back
//! (`commit` uses only the step id). A plan remembers which manager built it.

use numpy::ndarray::Array2;
use numpy::prelude::*;
use numpy::{PyArray1, PyArray2};
use prefixcache_core::{CacheError, PagedGroupPlan, StateGroupPlan, StepPlan};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::convert::{u32_arg, Domain};
use crate::errors::to_pyerr;

fn matrix<'py, T: numpy::Element>(
    py: Python<'py>,
    data: Vec<T>,
    columns: usize,
    what: &str,
) -> PyResult<Bound<'py, PyArray2<T>>> {
    let rows = data.len().checked_div(columns).unwrap_or(0);
    Array2::from_shape_vec((rows, columns), data).map(|a| a.into_pyarray(py)).map_err(|e| {
        to_pyerr(
            py,
            CacheError::Invariant { message: format!("plan array {what} has a bad length: {e}") },
        )
    })
}

/// A `[rows, columns]` array where `columns` may be 0 with `rows` given separately.
fn matrix_rows<'py, T: numpy::Element>(
    py: Python<'py>,
    data: Vec<T>,
    rows: usize,
    columns: usize,
    what: &str,
) -> PyResult<Bound<'py, PyArray2<T>>> {
    if columns == 0 {
        return PyArray1::from_vec(py, data).reshape([rows, 0]);
    }
    matrix(py, data, columns, what)
}

/// One paged group's part of a plan: block-table updates and the KV slot of every token.
#[pyclass(frozen, name = "PagedGroupPlan", module = "prefixcache")]
pub struct PyPagedGroupPlan {
    /// Index of the group in the configuration.
    #[pyo3(get)]
    group: u32,
    /// `int32 [M, 3]` rows `(row, column, block)`: entries appended to the sequences' tables.
    #[pyo3(get)]
    appended: Py<PyArray2<i32>>,
    /// `int32 [M', 3]` rows `(row, column, block)`: entries replaced (released by a sliding
    /// window: block 0).
    #[pyo3(get)]
    replaced: Py<PyArray2<i32>>,
    /// `int64 [T]` slot `block * block_size + offset` of each scheduled token.
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
}

impl PyPagedGroupPlan {
    fn new(py: Python<'_>, plan: PagedGroupPlan) -> PyResult<Self> {
        Ok(Self {
            group: plan.group,
            appended: matrix(py, plan.appended, 3, "appended")?.unbind(),
            replaced: matrix(py, plan.replaced, 3, "replaced")?.unbind(),
            slot_mapping: plan.slot_mapping.into_pyarray(py).unbind(),
        })
    }
}

#[pymethods]
impl PyPagedGroupPlan {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PagedGroupPlan(group={}, appended={}, replaced={}, tokens={})",
            self.group,
            self.appended.bind(py).shape()[0],
            self.replaced.bind(py).shape()[0],
            self.slot_mapping.bind(py).len(),
        )
    }
}

/// One state group's part of a plan: which slots the kernels read and write.
#[pyclass(frozen, name = "StateGroupPlan", module = "prefixcache")]
pub struct PyStateGroupPlan {
    /// Index of the group in the configuration.
    #[pyo3(get)]
    group: u32,
    /// `int32 [R]` the running-state slot each row writes.
    #[pyo3(get)]
    running_slot: Py<PyArray1<i32>>,
    /// `int32 [R]` the slot each row reads (-1 = zero state); never equal to `running_slot`.
    #[pyo3(get)]
    initial_slot: Py<PyArray1<i32>>,
    /// `int32 [R, Cmax]` interior checkpoint offsets from the row's query start (0 = none).
    #[pyo3(get)]
    checkpoint_offsets: Py<PyArray2<i32>>,
    /// `int32 [R, Cmax]` the slot each interior checkpoint goes to (-1 = none).
    #[pyo3(get)]
    checkpoint_slots: Py<PyArray2<i32>>,
    /// `int32 [S, 2]` rows `(running slot, checkpoint slot)` copied after the forward.
    #[pyo3(get)]
    snapshots: Py<PyArray2<i32>>,
}

impl PyStateGroupPlan {
    fn new(py: Python<'_>, plan: StateGroupPlan) -> PyResult<Self> {
        let rows = plan.running_slot.len();
        let cmax = plan.max_checkpoints;
        Ok(Self {
            group: plan.group,
            running_slot: plan.running_slot.into_pyarray(py).unbind(),
            initial_slot: plan.initial_slot.into_pyarray(py).unbind(),
            checkpoint_offsets: matrix_rows(py, plan.checkpoint_offsets, rows, cmax, "offsets")?
                .unbind(),
            checkpoint_slots: matrix_rows(py, plan.checkpoint_slots, rows, cmax, "slots")?.unbind(),
            snapshots: matrix(py, plan.snapshots, 2, "snapshots")?.unbind(),
        })
    }
}

#[pymethods]
impl PyStateGroupPlan {
    fn __repr__(&self, py: Python<'_>) -> String {
        let offsets = self.checkpoint_offsets.bind(py).shape().to_vec();
        format!(
            "StateGroupPlan(group={}, rows={}, max_checkpoints={}, snapshots={})",
            self.group,
            offsets[0],
            offsets[1],
            self.snapshots.bind(py).shape()[0],
        )
    }
}

/// Everything the kernels need for one step (R scheduled sequences, T scheduled tokens).
///
/// Arrays are `NumPy` arrays that own the buffers the core produced (no copy); reading an
/// attribute twice returns the same array, and `torch.from_numpy` shares its memory.
#[pyclass(frozen, name = "StepPlan", module = "prefixcache")]
pub struct PyStepPlan {
    /// The manager that built the plan (`commit` on another manager is refused).
    pub(crate) manager_id: u64,
    /// Identifies the step; `commit` and `abort` use it.
    #[pyo3(get)]
    step_id: u64,
    /// `int64 [R]` the scheduled sequences, in schedule order.
    #[pyo3(get)]
    seq_ids: Py<PyArray1<i64>>,
    /// `int32 [R + 1]` where each row's tokens start in the packed batch.
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    /// `int32 [R]` tokens of each row computed before this step.
    #[pyo3(get)]
    num_computed: Py<PyArray1<i32>>,
    /// `int32 [R]` tokens of each row scheduled in this step.
    #[pyo3(get)]
    num_scheduled: Py<PyArray1<i32>>,
    /// `int64 [K, 4]` rows `(group, src_block, dst_block, num_tokens)`: copy-on-write copies
    /// of paged blocks to run before the forward.
    #[pyo3(get)]
    copies: Py<PyArray2<i64>>,
    paged: Vec<Py<PyPagedGroupPlan>>,
    state: Vec<Py<PyStateGroupPlan>>,
    num_tokens: usize,
}

impl PyStepPlan {
    pub(crate) fn new(py: Python<'_>, manager_id: u64, plan: StepPlan) -> PyResult<Self> {
        let num_tokens = plan.num_tokens();
        let seq_ids: Vec<i64> = plan.seq_ids.iter().map(|&id| id as i64).collect();
        Ok(Self {
            manager_id,
            step_id: plan.step_id,
            seq_ids: seq_ids.into_pyarray(py).unbind(),
            query_start_loc: plan.query_start_loc.into_pyarray(py).unbind(),
            num_computed: plan.num_computed.into_pyarray(py).unbind(),
            num_scheduled: plan.num_scheduled.into_pyarray(py).unbind(),
            copies: matrix(py, plan.copies, 4, "copies")?.unbind(),
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
}

#[pymethods]
impl PyStepPlan {
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
    fn num_rows(&self, py: Python<'_>) -> usize {
        self.seq_ids.bind(py).len()
    }

    /// T, the scheduled tokens.
    #[getter]
    fn num_tokens(&self) -> usize {
        self.num_tokens
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

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "StepPlan(step_id={}, rows={}, tokens={}, copies={})",
            self.step_id,
            self.num_rows(py),
            self.num_tokens,
            self.copies.bind(py).shape()[0],
        )
    }
}
