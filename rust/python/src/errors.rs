//! The exception classes of `prefixcache` and the one mapping from core errors to them.
//!
//! Every [`CacheError`] variant has its own class under `PrefixCacheError`, chosen by one
//! `match` without a wildcard in [`to_pyerr`]: a new core variant does not compile until it is
//! mapped here (and listed in [`samples`], which the Python tests check against the classes).
//! `ConfigError` and `InvalidRequestError` are also `ValueError`s, and `StalePlanError` is a
//! `StepError`. Each class carries `kind`, the core's stable variant name.
//!
//! The classes are built once per process with `type(name, bases, namespace)`, because
//! `create_exception!` cannot give a class two bases.

use prefixcache_core::CacheError;
use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// One exception class per core variant, plus the base.
pub struct ErrorClasses {
    pub base: Py<PyType>,
    pub config: Py<PyType>,
    pub invalid_request: Py<PyType>,
    pub unknown_sequence: Py<PyType>,
    pub duplicate_sequence: Py<PyType>,
    pub nothing_to_schedule: Py<PyType>,
    pub step: Py<PyType>,
    pub stale_plan: Py<PyType>,
    pub alignment: Py<PyType>,
    pub reset_refused: Py<PyType>,
    pub invariant: Py<PyType>,
}

static CLASSES: PyOnceLock<ErrorClasses> = PyOnceLock::new();

fn make_class(
    py: Python<'_>,
    name: &str,
    bases: &[&Bound<'_, PyType>],
    kind: Option<&str>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__doc__", doc)?;
    namespace.set_item("__module__", "prefixcache")?;
    namespace.set_item("kind", kind)?;
    let bases = PyTuple::new(py, bases)?;
    let class = py.get_type::<PyType>().call1((name, bases, namespace))?;
    Ok(class.cast_into::<PyType>()?.unbind())
}

fn build(py: Python<'_>) -> PyResult<ErrorClasses> {
    let exception = py.get_type::<PyException>();
    let value_error = py.get_type::<PyValueError>();
    let base = make_class(
        py,
        "PrefixCacheError",
        &[&exception],
        None,
        "Base class of every error raised by prefixcache; `kind` names the core variant.",
    )?;
    let b = base.bind(py);
    let step = make_class(
        py,
        "StepError",
        &[b],
        Some("Step"),
        "A call the step protocol does not allow now (a plan is in flight, the sequence is \
         already scheduled, the PlanBuffers hold another manager's step in flight or are being \
         written by another thread, ...).",
    )?;
    let classes = ErrorClasses {
        config: make_class(
            py,
            "ConfigError",
            &[b, &value_error],
            Some("Config"),
            "The configuration is inconsistent; the message names the field to change.",
        )?,
        invalid_request: make_class(
            py,
            "InvalidRequestError",
            &[b, &value_error],
            Some("InvalidRequest"),
            "A request argument is out of range or malformed (empty tokens, a bad multimodal \
             range, a negative id, ...).",
        )?,
        unknown_sequence: make_class(
            py,
            "UnknownSequenceError",
            &[b],
            Some("UnknownSequence"),
            "The sequence id is not live (never added, or already finished).",
        )?,
        duplicate_sequence: make_class(
            py,
            "DuplicateSequenceError",
            &[b],
            Some("DuplicateSequence"),
            "`add` of a sequence id that is still live.",
        )?,
        nothing_to_schedule: make_class(
            py,
            "NothingToScheduleError",
            &[b],
            Some("NothingToSchedule"),
            "`schedule` of a sequence whose every token is computed: append a token first.",
        )?,
        stale_plan: make_class(
            py,
            "StalePlanError",
            &[step.bind(py)],
            Some("StalePlan"),
            "`commit` or `abort` of a plan that is not the one in flight (committed twice, \
             aborted after commit, or superseded).",
        )?,
        alignment: make_class(
            py,
            "AlignmentError",
            &[b],
            Some("Alignment"),
            "A checkpoint position the kernel cannot write; the message gives the nearest \
             valid positions.",
        )?,
        reset_refused: make_class(
            py,
            "ResetRefusedError",
            &[b],
            Some("ResetRefused"),
            "`reset` while sequences still hold blocks: finish or preempt them first.",
        )?,
        invariant: make_class(
            py,
            "InvariantError",
            &[b],
            Some("Invariant"),
            "An internal inconsistency (a bug in prefixcache; please report it with the \
             message).",
        )?,
        step,
        base,
    };
    Ok(classes)
}

/// The exception classes, built on first use.
pub fn classes(py: Python<'_>) -> PyResult<&ErrorClasses> {
    CLASSES.get_or_try_init(py, || build(py))
}

/// The Python exception of a core error: the one place every variant is mapped.
#[allow(clippy::needless_pass_by_value)] // callers hand over the error they produced
pub fn to_pyerr(py: Python<'_>, err: CacheError) -> PyErr {
    let Ok(c) = classes(py) else {
        return PyRuntimeError::new_err(err.to_string());
    };
    let class = match &err {
        CacheError::Config { .. } => &c.config,
        CacheError::InvalidRequest { .. } => &c.invalid_request,
        CacheError::UnknownSequence { .. } => &c.unknown_sequence,
        CacheError::DuplicateSequence { .. } => &c.duplicate_sequence,
        CacheError::NothingToSchedule { .. } => &c.nothing_to_schedule,
        CacheError::Step { .. } => &c.step,
        CacheError::StalePlan { .. } => &c.stale_plan,
        CacheError::Alignment { .. } => &c.alignment,
        CacheError::ResetRefused { .. } => &c.reset_refused,
        CacheError::Invariant { .. } => &c.invariant,
    };
    PyErr::from_type(class.bind(py).clone(), err.to_string())
}

/// One error of every core variant, for the mapping test.
pub fn samples() -> Vec<CacheError> {
    let message = || "sample".to_string();
    vec![
        CacheError::Config { message: message() },
        CacheError::InvalidRequest { message: message() },
        CacheError::UnknownSequence { seq_id: 7 },
        CacheError::DuplicateSequence { seq_id: 7 },
        CacheError::NothingToSchedule { seq_id: 7, num_computed: 3, num_tokens: 3 },
        CacheError::Step { message: message() },
        CacheError::StalePlan { plan_step: 1, state: message() },
        CacheError::Alignment {
            position: 20,
            offset: 20,
            alignment: 16,
            chunk_start: 0,
            reason: "not a multiple of the backend's alignment 16".to_string(),
            valid: message(),
        },
        CacheError::ResetRefused { live: 1 },
        CacheError::Invariant { message: message() },
    ]
}

/// Registers the classes in the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let c = classes(py)?;
    for (name, class) in [
        ("PrefixCacheError", &c.base),
        ("ConfigError", &c.config),
        ("InvalidRequestError", &c.invalid_request),
        ("UnknownSequenceError", &c.unknown_sequence),
        ("DuplicateSequenceError", &c.duplicate_sequence),
        ("NothingToScheduleError", &c.nothing_to_schedule),
        ("StepError", &c.step),
        ("StalePlanError", &c.stale_plan),
        ("AlignmentError", &c.alignment),
        ("ResetRefusedError", &c.reset_refused),
        ("InvariantError", &c.invariant),
    ] {
        m.add(name, class.clone_ref(py))?;
    }
    Ok(())
}
