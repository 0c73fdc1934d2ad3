//! The core's defaults and rules, asked for by the typed API, the kernel layer and the engine
//! instead of being written again in Python.
//!
//! `defaults` is the one source of the configuration dataclasses' default values
//! (`prefixcache.config` reads it at import). The rule functions convert their arguments and
//! call the core's one statement of each rule; none is restated here.

use prefixcache_core::{CacheConfig, HashConfig, Retention, StateGroupConfig};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt};

use crate::convert::{self, u32_arg, Domain};
use crate::errors::to_pyerr;

fn retention_dict<'py>(py: Python<'py>, r: &Retention) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tail", r.tail)?;
    d.set_item("interval", r.interval)?;
    d.set_item("junction", r.junction)?;
    d.set_item("decode_tail", r.decode_tail)?;
    Ok(d)
}

/// The core's defaults of every configuration field that has one (`CacheConfig::default()`,
/// `HashConfig::default()`, `StateGroupConfig::default()`, `Retention::default()`), as
/// `{"cache": {..}, "hash": {..}, "state_group": {..}, "retention": {..}}` keyed by the
/// Python field names. A new dict on every call.
#[pyfunction]
pub fn defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let cache = CacheConfig::default();
    let c = PyDict::new(py);
    c.set_item("finished_cache_bytes", cache.finished_cache_bytes)?;
    c.set_item("reuse_live_prefixes", cache.reuse_live_prefixes)?;
    c.set_item("recently_evicted_capacity", cache.recently_evicted_capacity)?;
    c.set_item("enable_events", cache.enable_events)?;
    c.set_item("max_pending_events", cache.max_pending_events)?;
    c.set_item("max_steps_in_flight", cache.max_steps_in_flight)?;
    c.set_item("event_block_size", cache.event_block_size)?;

    let hash = HashConfig::default();
    let h = PyDict::new(py);
    h.set_item("algorithm", hash.algorithm.name())?;
    h.set_item("seed", hash.seed)?;
    h.set_item("unit", hash.unit)?;
    h.set_item("verify_tokens", hash.verify_tokens)?;

    let state = StateGroupConfig::default();
    let s = PyDict::new(py);
    s.set_item("alignment", state.alignment)?;
    s.set_item("max_checkpoints_per_step", state.max_checkpoints_per_step)?;
    s.set_item("retention", retention_dict(py, &state.retention)?)?;
    s.set_item("checkpoint_cap", state.checkpoint_cap)?;
    s.set_item("reserve_per_sequence", state.reserve_per_sequence)?;

    let out = PyDict::new(py);
    out.set_item("cache", c)?;
    out.set_item("hash", h)?;
    out.set_item("state_group", s)?;
    out.set_item("retention", retention_dict(py, &Retention::default())?)?;
    Ok(out)
}

/// A chunk-relative offset as the core's `u32` domain sees it: any Python int, an offset
/// beyond that domain being below 0 or above every query (so never exportable).
enum Offset {
    Below,
    At(u32),
    Above,
}

fn offset_arg(obj: &Bound<'_, PyAny>) -> PyResult<Offset> {
    let int_like = obj.is_instance_of::<PyInt>() || obj.hasattr("__index__")?;
    if obj.is_instance_of::<PyBool>() || !int_like {
        return Err(PyTypeError::new_err(format!(
            "offset must be an int, got {}",
            convert::type_name(obj)
        )));
    }
    let value = obj.call_method0("__index__")?;
    Ok(match value.extract::<u32>() {
        Ok(v) => Offset::At(v),
        Err(_) if value.lt(0)? => Offset::Below,
        Err(_) => Offset::Above,
    })
}

/// The checkpoint-offset rule of the kernels (`prefixcache_core::is_exportable_offset`):
/// whether a kernel of checkpoint alignment `alignment` can write an interior checkpoint at
/// chunk-relative `offset` of a query of `query_len` tokens, i.e. `0 < offset < query_len`
/// and `offset % alignment == 0` (alignment 0: never). `offset` may be any int (outside
/// `0 .. 2**32 - 1` it is never exportable); `alignment` and `query_len` are in
/// `0 .. 2**32 - 1` (`InvalidRequestError` otherwise).
#[pyfunction]
pub fn is_exportable_offset(
    offset: &Bound<'_, PyAny>,
    alignment: &Bound<'_, PyAny>,
    query_len: &Bound<'_, PyAny>,
) -> PyResult<bool> {
    let alignment = u32_arg(alignment, "alignment", Domain::Request)?;
    let query_len = u32_arg(query_len, "query_len", Domain::Request)?;
    Ok(match offset_arg(offset)? {
        Offset::At(o) => prefixcache_core::is_exportable_offset(o, alignment, query_len),
        Offset::Below | Offset::Above => false,
    })
}

/// The exportable offsets nearest to `offset` (`prefixcache_core::nearest_exportable_offsets`):
/// the largest at or below it and the smallest above it, each where one exists, ascending;
/// empty when the query has none (`query_len <= alignment`, or alignment 0). Arguments as
/// `is_exportable_offset`'s.
#[pyfunction]
pub fn nearest_exportable_offsets(
    offset: &Bound<'_, PyAny>,
    alignment: &Bound<'_, PyAny>,
    query_len: &Bound<'_, PyAny>,
) -> PyResult<Vec<u32>> {
    let alignment = u32_arg(alignment, "alignment", Domain::Request)?;
    let query_len = u32_arg(query_len, "query_len", Domain::Request)?;
    let nearest = |o| prefixcache_core::nearest_exportable_offsets(o, alignment, query_len);
    Ok(match offset_arg(offset)? {
        Offset::At(o) => nearest(o),
        // Below 0: the smallest valid offset is the one above; beyond u32: the largest one is
        // the one below (nothing lies above every query).
        Offset::Below => nearest(0).into_iter().filter(|&o| o > 0).take(1).collect(),
        Offset::Above => nearest(u32::MAX).into_iter().take(1).collect(),
    })
}

/// `(U', B')`, the smallest hash unit and paged block size a kernel of checkpoint alignment
/// `alignment` accepts, starting from `unit` and `block_size`
/// (`prefixcache_core::aligned_geometry`): `U' = lcm(unit, alignment)`,
/// `B' = lcm(block_size, U')`. `ConfigError` for a zero argument or a result beyond the limits.
#[pyfunction]
pub fn aligned_geometry(
    unit: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    alignment: &Bound<'_, PyAny>,
) -> PyResult<(u32, u32)> {
    let py = unit.py();
    let c = Domain::Config;
    let unit = u32_arg(unit, "unit", c)?;
    let block_size = u32_arg(block_size, "block_size", c)?;
    let alignment = u32_arg(alignment, "alignment", c)?;
    prefixcache_core::aligned_geometry(unit, block_size, alignment).map_err(|e| to_pyerr(py, e))
}

/// The chunk alignment of a `CacheConfig` (`CacheConfig::chunk_alignment`): the least common
/// multiple of its state groups' alignments (1 without state groups), the grid non-final
/// prefill chunks end on.
#[pyfunction]
pub fn chunk_alignment(config: &Bound<'_, PyAny>) -> PyResult<u32> {
    Ok(convert::cache_config(config)?.chunk_alignment())
}

/// The smallest per-step token budget under which a non-final prefill chunk of a manager of
/// `config` can be scheduled without `exact` (`CacheConfig::min_token_budget`).
#[pyfunction]
pub fn min_token_budget(config: &Bound<'_, PyAny>) -> PyResult<u32> {
    Ok(convert::cache_config(config)?.min_token_budget())
}

/// The most blocks group `group` of `config` holds for one running sequence of `tokens`
/// tokens at any point of its life, scheduled in chunks of at most `max_chunk` tokens (any
/// size when `None`): what its pool must hold per sequence for that sequence never to be
/// refused for its own blocks (`CacheConfig::blocks_for_chunked_sequence`).
/// `InvalidRequestError` for a group out of range.
#[pyfunction]
#[pyo3(signature = (config, group, tokens, max_chunk = None))]
pub fn blocks_for_sequence(
    config: &Bound<'_, PyAny>,
    group: &Bound<'_, PyAny>,
    tokens: &Bound<'_, PyAny>,
    max_chunk: Option<&Bound<'_, PyAny>>,
) -> PyResult<u32> {
    let py = config.py();
    let config = convert::cache_config(config)?;
    let group = u32_arg(group, "group", Domain::Request)? as usize;
    let tokens = u32_arg(tokens, "tokens", Domain::Request)?;
    let max_chunk = match max_chunk.filter(|m| !m.is_none()) {
        Some(m) => u32_arg(m, "max_chunk", Domain::Request)?,
        None => tokens,
    };
    config.blocks_for_chunked_sequence(group, tokens, max_chunk).map_err(|e| to_pyerr(py, e))
}
