//! `PagedGroupBuffers` and `StateGroupBuffers`: one group's part of a `PlanBuffers`.
//!
//! Each part holds the arrays of one group of the plan (`buffer::Buffer`s) and the counts of
//! their rows this step. A part is written only by its `PlanBuffers`, during a build; its
//! getters borrow it as `PlanBuffers`' do (a `StepError` while a build writes it).

use prefixcache_core::{PagedGroupPlan, StateGroupPlan};
use pyo3::prelude::*;

use crate::buffer::Buffer;
use crate::buffers::borrow;

/// One paged group's part of the plan in `PlanBuffers`.
#[pyclass(name = "PagedGroupBuffers", module = "prefixcache")]
pub struct PyPagedGroupBuffers {
    group: u32,
    num_appended: usize,
    num_replaced: usize,
    appended: Buffer<i32>,
    replaced: Buffer<i32>,
    slot_mapping: Buffer<i64>,
}

impl PyPagedGroupBuffers {
    pub(crate) fn new(py: Python<'_>, group: u32, rows: usize, tokens: usize) -> PyResult<Self> {
        Ok(Self {
            group,
            num_appended: 0,
            num_replaced: 0,
            appended: Buffer::new(py, "PagedGroupBuffers.appended", rows, 3)?,
            replaced: Buffer::new(py, "PagedGroupBuffers.replaced", rows, 3)?,
            slot_mapping: Buffer::new(py, "PagedGroupBuffers.slot_mapping", tokens, 0)?,
        })
    }

    /// Writes the group's part; whether an array grew.
    pub(crate) fn write(&mut self, py: Python<'_>, plan: &PagedGroupPlan) -> PyResult<bool> {
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
    /// Index of the group in the configuration.
    #[getter]
    fn group(slf: &Bound<'_, Self>) -> PyResult<u32> {
        Ok(borrow(slf)?.group)
    }

    /// Rows of `appended` this step.
    #[getter]
    fn num_appended(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.num_appended)
    }

    /// Rows of `replaced` this step.
    #[getter]
    fn num_replaced(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.num_replaced)
    }

    /// `int32 [>= num_appended, 3]` rows `(row, column, block)` appended to the tables.
    #[getter]
    fn appended(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.appended.get(slf.py()))
    }

    /// `int32 [>= num_replaced, 3]` rows `(row, column, block)` replaced (block 0: released).
    #[getter]
    fn replaced(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.replaced.get(slf.py()))
    }

    /// `int64 [>= num_tokens]` the KV slot of each scheduled token.
    #[getter]
    fn slot_mapping(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.slot_mapping.get(slf.py()))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let this = borrow(slf)?;
        Ok(format!(
            "PagedGroupBuffers(group={}, num_appended={}, num_replaced={})",
            this.group, this.num_appended, this.num_replaced
        ))
    }
}

/// One state group's part of the plan in `PlanBuffers`.
#[pyclass(name = "StateGroupBuffers", module = "prefixcache")]
pub struct PyStateGroupBuffers {
    group: u32,
    max_checkpoints: usize,
    num_snapshots: usize,
    running_slot: Buffer<i32>,
    initial_slot: Buffer<i32>,
    checkpoint_offsets: Buffer<i32>,
    checkpoint_slots: Buffer<i32>,
    snapshots: Buffer<i32>,
}

impl PyStateGroupBuffers {
    pub(crate) fn new(py: Python<'_>, group: u32, rows: usize) -> PyResult<Self> {
        Ok(Self {
            group,
            max_checkpoints: 0,
            num_snapshots: 0,
            running_slot: Buffer::new(py, "StateGroupBuffers.running_slot", rows, 0)?,
            initial_slot: Buffer::new(py, "StateGroupBuffers.initial_slot", rows, 0)?,
            checkpoint_offsets: Buffer::new(py, "StateGroupBuffers.checkpoint_offsets", rows, 1)?,
            checkpoint_slots: Buffer::new(py, "StateGroupBuffers.checkpoint_slots", rows, 1)?,
            snapshots: Buffer::new(py, "StateGroupBuffers.snapshots", rows, 2)?,
        })
    }

    /// Writes the group's part; whether an array grew.
    pub(crate) fn write(&mut self, py: Python<'_>, plan: &StateGroupPlan) -> PyResult<bool> {
        let rows = plan.running_slot.len();
        self.max_checkpoints = plan.max_checkpoints;
        self.num_snapshots = plan.snapshots.len() / 2;
        let mut grew = self.running_slot.write(py, &plan.running_slot, rows, 0)?;
        grew |= self.initial_slot.write(py, &plan.initial_slot, rows, 0)?;
        // Written (grown to R rows) even when the step has no checkpoint column, so that
        // `checkpoint_offsets[:R, :0]` has R rows as `StepPlan`'s `[R, 0]` array does.
        let c = plan.max_checkpoints;
        grew |= self.checkpoint_offsets.write(py, &plan.checkpoint_offsets, rows, c)?;
        grew |= self.checkpoint_slots.write(py, &plan.checkpoint_slots, rows, c)?;
        grew |= self.snapshots.write(py, &plan.snapshots, self.num_snapshots, 2)?;
        Ok(grew)
    }
}

#[pymethods]
impl PyStateGroupBuffers {
    /// Index of the group in the configuration.
    #[getter]
    fn group(slf: &Bound<'_, Self>) -> PyResult<u32> {
        Ok(borrow(slf)?.group)
    }

    /// Cmax this step: the columns of `checkpoint_offsets` / `checkpoint_slots` in use.
    #[getter]
    fn max_checkpoints(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.max_checkpoints)
    }

    /// Rows of `snapshots` this step.
    #[getter]
    fn num_snapshots(slf: &Bound<'_, Self>) -> PyResult<usize> {
        Ok(borrow(slf)?.num_snapshots)
    }

    /// `int32 [>= R]` the running-state slot each row writes.
    #[getter]
    fn running_slot(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.running_slot.get(slf.py()))
    }

    /// `int32 [>= R]` the slot each row reads (-1 = zero state).
    #[getter]
    fn initial_slot(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.initial_slot.get(slf.py()))
    }

    /// `int32 [>= R, >= max_checkpoints]` interior checkpoint offsets (0 = none); only the
    /// first `max_checkpoints` columns of the first R rows belong to this step.
    #[getter]
    fn checkpoint_offsets(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.checkpoint_offsets.get(slf.py()))
    }

    /// `int32 [>= R, >= max_checkpoints]` checkpoint slots (-1 = none), as `checkpoint_offsets`.
    #[getter]
    fn checkpoint_slots(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.checkpoint_slots.get(slf.py()))
    }

    /// `int32 [>= num_snapshots, 2]` rows `(running slot, checkpoint slot)` copied after the
    /// forward.
    #[getter]
    fn snapshots(slf: &Bound<'_, Self>) -> PyResult<Py<PyAny>> {
        Ok(borrow(slf)?.snapshots.get(slf.py()))
    }

    fn __repr__(slf: &Bound<'_, Self>) -> PyResult<String> {
        let this = borrow(slf)?;
        Ok(format!(
            "StateGroupBuffers(group={}, max_checkpoints={}, num_snapshots={})",
            this.group, this.max_checkpoints, this.num_snapshots
        ))
    }
}
