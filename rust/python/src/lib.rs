//! `PyO3` bindings of `prefixcache-core`: the private module `prefixcache._core`.
//!
//! A thin shell: it converts arguments (`convert`), maps every core error to its Python class
//! in one place (`errors`), releases the GIL around long core calls (one policy, in
//! `manager`), exposes the core's defaults and rules (`rules`), and hands plan arrays to
//! `NumPy` without copying (`plan`). It holds no cache rule; users import the typed package
//! `prefixcache`, which re-exports what is here with an explicit `__all__`.

use prefixcache_core::limits;
use prefixcache_core::{CacheError, HashConfig};
use pyo3::exceptions::PyBaseException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

mod buffer;
mod buffers;
mod convert;
mod errors;
mod events;
mod group_buffers;
mod int_sequence;
mod manager;
mod plan;
mod results;
mod rules;

use convert::{u64_arg, Domain};

/// The digests of every full unit of `tokens` (the cache's keys, as bytes: 16 per unit for
/// `xxh3_128`, 32 for `sha256`), computed without the GIL when the tokens are many (the
/// shell's GIL policy, `manager`'s module doc). For external routers: the same settings as a
/// manager's `HashConfig` give the same digests.
#[pyfunction]
#[pyo3(
    signature = (tokens, unit = None, algorithm = None, seed = None, extra_keys = None),
    text_signature = "(tokens, unit=16, algorithm='xxh3_128', seed=0, extra_keys=None)"
)]
fn hash_prefix<'py>(
    tokens: &Bound<'py, PyAny>,
    unit: Option<&Bound<'py, PyAny>>,
    algorithm: Option<&Bound<'py, PyAny>>,
    seed: Option<&Bound<'py, PyAny>>,
    extra_keys: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let py = tokens.py();
    let defaults = HashConfig::default();
    let present = |o: Option<&Bound<'py, PyAny>>| o.filter(|o| !o.is_none()).cloned();
    let config = HashConfig {
        unit: match present(unit) {
            Some(u) => convert::int_in(&u, "unit", 1, u64::from(u32::MAX), Domain::Request)? as u32,
            None => defaults.unit,
        },
        algorithm: match present(algorithm) {
            Some(a) => convert::algorithm(&a, "algorithm", Domain::Request)?,
            None => defaults.algorithm,
        },
        seed: match present(seed) {
            Some(s) => u64_arg(&s, "seed", Domain::Request)?,
            None => defaults.seed,
        },
        verify_tokens: false,
    };
    let tokens = convert::tokens(tokens, "tokens", convert::SEQUENCE)?;
    let extra = convert::extra_keys(extra_keys)?;
    let digests = manager::unlocked(py, tokens.len(), || {
        prefixcache_core::hash_prefix(&config, &tokens, &extra)
    })
    .map_err(|e| errors::to_pyerr(py, e))?;
    Ok(digests.iter().map(|d| PyBytes::new(py, d.as_bytes(config.algorithm))).collect())
}

/// Checks a `CacheConfig` (types, ranges and every core rule); raises what `CacheManager`
/// would.
#[pyfunction]
fn validate_config(config: &Bound<'_, PyAny>) -> PyResult<()> {
    convert::cache_config(config).map(|_| ())
}

/// One exception of every core error variant, as `(kind, exception)` pairs, mapped exactly as
/// the manager maps them (for the mapping test).
#[pyfunction]
fn _error_samples(py: Python<'_>) -> Vec<(&'static str, Bound<'_, PyBaseException>)> {
    errors::samples()
        .into_iter()
        .map(|e| (e.kind(), errors::to_pyerr(py, e).into_value(py).into_bound(py)))
        .collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("ENCODING_VERSION", prefixcache_core::ENCODING_VERSION)?;
    // The bounds on every count the API takes (`prefixcache_core::limits`), for callers that
    // split work to fit them.
    m.add("MAX_BATCH_SEQUENCES", limits::MAX_BATCH_SEQUENCES)?;
    m.add("MAX_HASH_THREADS", limits::MAX_HASH_THREADS)?;
    m.add("MAX_BLOCK_SIZE", limits::MAX_BLOCK_SIZE)?;
    m.add("MAX_BLOCKS_PER_POOL", limits::MAX_BLOCKS_PER_POOL)?;
    m.add("MAX_EXTRA_KEY_BYTES", limits::MAX_EXTRA_KEY_BYTES)?;
    m.add("MAX_GROUPS", limits::MAX_GROUPS)?;
    m.add("MAX_HASH_UNIT", limits::MAX_HASH_UNIT)?;
    m.add("MAX_LOOKAHEAD_TOKENS", limits::MAX_LOOKAHEAD_TOKENS)?;
    m.add("MAX_STEPS_IN_FLIGHT", limits::MAX_STEPS_IN_FLIGHT)?;
    m.add("MAX_MULTIMODAL_INPUTS", limits::MAX_MULTIMODAL_INPUTS)?;
    m.add("MAX_PENDING_EVENTS", limits::MAX_PENDING_EVENTS)?;
    m.add("MAX_POOLS", limits::MAX_POOLS)?;
    m.add("MAX_RECENTLY_EVICTED", limits::MAX_RECENTLY_EVICTED)?;
    m.add("MAX_SEQUENCE_TOKENS", limits::MAX_SEQUENCE_TOKENS)?;
    m.add("MAX_STEP_TOKENS", limits::MAX_STEP_TOKENS)?;
    // The stable name of every core error variant (each has its own exception class, whose
    // `kind` it is).
    m.add("ERROR_KINDS", PyTuple::new(m.py(), CacheError::KINDS)?)?;
    errors::register(m)?;
    m.add_class::<manager::PyCacheManager>()?;
    m.add_class::<results::PyAdded>()?;
    m.add_class::<results::PyGroupHit>()?;
    m.add_class::<results::PyHit>()?;
    m.add_class::<results::PyScheduled>()?;
    m.add_class::<results::PyPoolUsage>()?;
    m.add_class::<results::PyGroupStats>()?;
    m.add_class::<results::PyStats>()?;
    m.add_class::<plan::PyStepPlan>()?;
    m.add_class::<plan::PyPagedGroupPlan>()?;
    m.add_class::<plan::PyStateGroupPlan>()?;
    m.add_class::<buffers::PyPlanBuffers>()?;
    m.add_class::<group_buffers::PyPagedGroupBuffers>()?;
    m.add_class::<group_buffers::PyStateGroupBuffers>()?;
    m.add_class::<events::PyBlockStored>()?;
    m.add_class::<events::PyBlockRemoved>()?;
    m.add_class::<events::PyAllBlocksCleared>()?;
    m.add_function(wrap_pyfunction!(hash_prefix, m)?)?;
    m.add_function(wrap_pyfunction!(validate_config, m)?)?;
    m.add_function(wrap_pyfunction!(_error_samples, m)?)?;
    m.add_function(wrap_pyfunction!(rules::defaults, m)?)?;
    m.add_function(wrap_pyfunction!(rules::is_exportable_offset, m)?)?;
    m.add_function(wrap_pyfunction!(rules::nearest_exportable_offsets, m)?)?;
    m.add_function(wrap_pyfunction!(rules::aligned_geometry, m)?)?;
    m.add_function(wrap_pyfunction!(rules::chunk_alignment, m)?)?;
    m.add_function(wrap_pyfunction!(rules::min_token_budget, m)?)?;
    m.add_function(wrap_pyfunction!(rules::blocks_for_sequence, m)?)?;
    Ok(())
}
