//! The core's defaults and rules, asked for by the typed API, the kernel layer and the engine
//! instead of being written again in Python.
//!
//! `defaults` is the one source of the configuration dataclasses' default values
//! (`prefixcache.config` reads it at import).

use prefixcache_core::{CacheConfig, HashConfig, Retention, StateGroupConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

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
