//! Argument conversion: Python integers, token lists and arrays, configuration objects.
//!
//! Owns the one rule of the shell: a value of the wrong *type* is a `TypeError`, a value out
//! of its documented *range* is the core's `InvalidRequest` (or `Config` inside a
//! configuration), both of which are `ValueError`s in Python. Token and id sequences are read
//! by `int_sequence` (re-exported here). Byte fields (a cache salt, a multimodal hash) take
//! any bytes-like object (`bytes`, `bytearray`, `memoryview`, ...) or a `str`, and their length
//! is checked before they are copied. Nothing here knows a cache rule: the core validates what
//! the values mean.

use prefixcache_core::limits::{MAX_EXTRA_KEY_BYTES, MAX_MULTIMODAL_INPUTS};
use prefixcache_core::{
    CacheConfig, CacheError, ExtraKeys, GroupConfig, GroupKind, HashAlgorithm, HashConfig,
    MultimodalInput, PoolConfig, Retention, StateGroupConfig,
};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyMemoryView, PyString};

use crate::errors::to_pyerr;
pub use crate::int_sequence::{int_sequence, tokens, BATCH, SEQUENCE};

/// Which core error a range problem becomes.
#[derive(Clone, Copy)]
pub enum Domain {
    /// A request argument: `InvalidRequestError`.
    Request,
    /// A configuration field: `ConfigError`.
    Config,
}

pub(crate) fn range_error(py: Python<'_>, domain: Domain, message: String) -> PyErr {
    to_pyerr(
        py,
        match domain {
            Domain::Request => CacheError::InvalidRequest { message },
            Domain::Config => CacheError::Config { message },
        },
    )
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map_or_else(|_| "?".to_string(), |n| n.to_string())
}

/// An integer in `min..=max` (`what` names it in messages). Bools are refused.
pub fn int_in(
    obj: &Bound<'_, PyAny>,
    what: &str,
    min: u64,
    max: u64,
    domain: Domain,
) -> PyResult<u64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!("{what} must be an int, not bool")));
    }
    let out_of_range = || {
        let shown = obj.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
        range_error(py, domain, format!("{what} must be in {min}..={max}, got {shown}"))
    };
    match obj.extract::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v),
        Ok(_) => Err(out_of_range()),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Err(out_of_range()),
        Err(_) => {
            Err(PyTypeError::new_err(format!("{what} must be an int, got {}", type_name(obj))))
        }
    }
}

pub fn u32_arg(obj: &Bound<'_, PyAny>, what: &str, domain: Domain) -> PyResult<u32> {
    int_in(obj, what, 0, u64::from(u32::MAX), domain).map(|v| v as u32)
}

pub fn u64_arg(obj: &Bound<'_, PyAny>, what: &str, domain: Domain) -> PyResult<u64> {
    int_in(obj, what, 0, u64::MAX, domain)
}

fn usize_arg(obj: &Bound<'_, PyAny>, what: &str, domain: Domain) -> PyResult<usize> {
    int_in(obj, what, 0, usize::MAX as u64, domain).map(|v| v as usize)
}

fn bool_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    obj.cast::<PyBool>()
        .map(PyBoolMethods::is_true)
        .map_err(|_| PyTypeError::new_err(format!("{what} must be a bool, got {}", type_name(obj))))
}

fn optional<T>(
    obj: &Bound<'_, PyAny>,
    read: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
) -> PyResult<Option<T>> {
    if obj.is_none() {
        Ok(None)
    } else {
        read(obj).map(Some)
    }
}

/// A hash algorithm by name.
pub fn algorithm(obj: &Bound<'_, PyAny>, what: &str, domain: Domain) -> PyResult<HashAlgorithm> {
    let name: String = obj.extract().map_err(|_| {
        PyTypeError::new_err(format!("{what} must be a str, got {}", type_name(obj)))
    })?;
    HashAlgorithm::from_name(&name).ok_or_else(|| {
        range_error(
            obj.py(),
            domain,
            format!("{what} {name:?} is unknown: use \"xxh3_128\" or \"sha256\""),
        )
    })
}

fn attr<'py>(obj: &Bound<'py, PyAny>, name: &str, what: &str) -> PyResult<Bound<'py, PyAny>> {
    obj.getattr(name).map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must have an attribute {name:?} (got a {})",
            type_name(obj)
        ))
    })
}

/// `InvalidRequestError` for a byte field longer than the core takes, raised before it is copied.
fn too_many_bytes(py: Python<'_>, what: &str, len: usize) -> PyErr {
    range_error(
        py,
        Domain::Request,
        format!(
            "{what} is {len} bytes, more than the limit of {MAX_EXTRA_KEY_BYTES} bytes \
             (prefixcache.MAX_EXTRA_KEY_BYTES); pass a digest of it instead"
        ),
    )
}

/// Byte data: `bytes`, `bytearray`, `memoryview` or any other object with the buffer protocol
/// (its bytes, copied), or a `str` (UTF-8); its length is checked before it is copied.
fn bytes_arg(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    let py = obj.py();
    let bounded = |bytes: &[u8]| {
        if bytes.len() > MAX_EXTRA_KEY_BYTES {
            return Err(too_many_bytes(py, what, bytes.len()));
        }
        Ok(bytes.to_vec())
    };
    if let Ok(b) = obj.cast::<PyBytes>() {
        return bounded(b.as_bytes());
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return bounded(s.to_str()?.as_bytes());
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        if b.len() > MAX_EXTRA_KEY_BYTES {
            return Err(too_many_bytes(py, what, b.len()));
        }
        return Ok(b.to_vec());
    }
    if let Ok(view) = PyMemoryView::from(obj) {
        // `memoryview`, `array.array`, a `NumPy` array, ...: its bytes in C order.
        let len: usize = view.getattr("nbytes")?.extract()?;
        if len > MAX_EXTRA_KEY_BYTES {
            return Err(too_many_bytes(py, what, len));
        }
        let bytes = view.call_method0("tobytes")?;
        return Ok(bytes.cast::<PyBytes>()?.as_bytes().to_vec());
    }
    Err(PyTypeError::new_err(format!(
        "{what} must be bytes or str (or another bytes-like object: bytearray, memoryview), \
         got {}",
        type_name(obj)
    )))
}

/// `ExtraKeys` (or `None`: no extra keys).
pub fn extra_keys(obj: Option<&Bound<'_, PyAny>>) -> PyResult<ExtraKeys> {
    let Some(obj) = obj.filter(|o| !o.is_none()) else {
        return Ok(ExtraKeys::default());
    };
    let what = "extra_keys";
    let cache_salt =
        optional(&attr(obj, "cache_salt", what)?, |s| bytes_arg(s, "extra_keys.cache_salt"))?;
    let lora_id = optional(&attr(obj, "lora_id", what)?, |l| {
        u64_arg(l, "extra_keys.lora_id", Domain::Request)
    })?;
    let mut multimodal = Vec::new();
    let inputs = attr(obj, "multimodal", what)?;
    let iter = inputs.try_iter().map_err(|_| {
        PyTypeError::new_err(format!(
            "extra_keys.multimodal must be a sequence of MultimodalInput, got {}",
            type_name(&inputs)
        ))
    })?;
    let too_many = |len: Option<usize>| {
        let count = len.map_or_else(|| "more".to_string(), |len| len.to_string());
        range_error(
            obj.py(),
            Domain::Request,
            format!(
                "extra_keys.multimodal has {count} inputs, more than the limit of \
                 {MAX_MULTIMODAL_INPUTS} a sequence (prefixcache.MAX_MULTIMODAL_INPUTS)"
            ),
        )
    };
    // Counted before anything is read: the core takes at most `MAX_MULTIMODAL_INPUTS`.
    let len = inputs.len().ok();
    if len.is_some_and(|len| len > MAX_MULTIMODAL_INPUTS) {
        return Err(too_many(len));
    }
    for (i, input) in iter.enumerate() {
        if i >= MAX_MULTIMODAL_INPUTS {
            return Err(too_many(len));
        }
        let input = input?;
        let w = format!("extra_keys.multimodal[{i}]");
        multimodal.push(MultimodalInput {
            start: u32_arg(&attr(&input, "start", &w)?, &format!("{w}.start"), Domain::Request)?,
            end: u32_arg(&attr(&input, "end", &w)?, &format!("{w}.end"), Domain::Request)?,
            hash: bytes_arg(&attr(&input, "hash", &w)?, &format!("{w}.hash"))?,
        });
    }
    Ok(ExtraKeys { cache_salt, lora_id, multimodal })
}

fn retention(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Retention> {
    let c = Domain::Config;
    Ok(Retention {
        tail: bool_arg(&attr(obj, "tail", what)?, &format!("{what}.tail"))?,
        interval: optional(&attr(obj, "interval", what)?, |v| {
            u32_arg(v, &format!("{what}.interval"), c)
        })?,
        junction: bool_arg(&attr(obj, "junction", what)?, &format!("{what}.junction"))?,
        decode_tail: bool_arg(&attr(obj, "decode_tail", what)?, &format!("{what}.decode_tail"))?,
    })
}

fn group(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<GroupConfig> {
    let c = Domain::Config;
    let kind: String = obj.getattr("kind").and_then(|k| k.extract()).map_err(|_| {
        PyTypeError::new_err(format!(
            "{what} must be a FullAttention, SlidingWindow or StateGroup, got {}",
            type_name(obj)
        ))
    })?;
    let field = |name: &str| attr(obj, name, what);
    let name = |f: &str| format!("{what}.{f}");
    let pool = usize_arg(&field("pool")?, &name("pool"), c)?;
    let kind = match kind.as_str() {
        "full_attention" => GroupKind::FullAttention {
            block_size: u32_arg(&field("block_size")?, &name("block_size"), c)?,
        },
        "sliding_window" => GroupKind::SlidingWindow {
            block_size: u32_arg(&field("block_size")?, &name("block_size"), c)?,
            window: u32_arg(&field("window")?, &name("window"), c)?,
        },
        "state" => GroupKind::State(StateGroupConfig {
            alignment: u32_arg(&field("alignment")?, &name("alignment"), c)?,
            max_checkpoints_per_step: optional(&field("max_checkpoints_per_step")?, |v| {
                u32_arg(v, &name("max_checkpoints_per_step"), c)
            })?,
            retention: retention(&field("retention")?, &name("retention"))?,
            checkpoint_cap: optional(&field("checkpoint_cap")?, |v| {
                u32_arg(v, &name("checkpoint_cap"), c)
            })?,
            reserve_per_sequence: u32_arg(
                &field("reserve_per_sequence")?,
                &name("reserve_per_sequence"),
                c,
            )?,
        }),
        other => {
            return Err(PyTypeError::new_err(format!(
                "{what} has unknown kind {other:?}: use FullAttention, SlidingWindow or StateGroup"
            )))
        }
    };
    Ok(GroupConfig { kind, pool })
}

fn list_of<'py, T>(
    obj: &Bound<'py, PyAny>,
    what: &str,
    read: impl Fn(&Bound<'py, PyAny>, &str) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!("{what} must be a list, got str")));
    }
    let iter = obj.try_iter().map_err(|_| {
        PyTypeError::new_err(format!("{what} must be a list, got {}", type_name(obj)))
    })?;
    iter.enumerate().map(|(i, item)| read(&item?, &format!("{what}[{i}]"))).collect()
}

/// A `CacheConfig` (Python dataclass or any object with the same attributes), validated by
/// the core.
pub fn cache_config(obj: &Bound<'_, PyAny>) -> PyResult<CacheConfig> {
    let c = Domain::Config;
    let what = "config";
    let hash_obj = attr(obj, "hash", what)?;
    let hash = HashConfig {
        algorithm: algorithm(&attr(&hash_obj, "algorithm", "hash")?, "hash.algorithm", c)?,
        seed: u64_arg(&attr(&hash_obj, "seed", "hash")?, "hash.seed", c)?,
        unit: u32_arg(&attr(&hash_obj, "unit", "hash")?, "hash.unit", c)?,
        verify_tokens: bool_arg(&attr(&hash_obj, "verify_tokens", "hash")?, "hash.verify_tokens")?,
    };
    let pools = list_of(&attr(obj, "pools", what)?, "pools", |p, w| {
        Ok(PoolConfig {
            num_blocks: u32_arg(&attr(p, "num_blocks", w)?, &format!("{w}.num_blocks"), c)?,
        })
    })?;
    let groups = list_of(&attr(obj, "groups", what)?, "groups", group)?;
    let config = CacheConfig {
        hash,
        pools,
        groups,
        finished_cache_bytes: usize_arg(
            &attr(obj, "finished_cache_bytes", what)?,
            "finished_cache_bytes",
            c,
        )?,
        reuse_live_prefixes: bool_arg(
            &attr(obj, "reuse_live_prefixes", what)?,
            "reuse_live_prefixes",
        )?,
        recently_evicted_capacity: usize_arg(
            &attr(obj, "recently_evicted_capacity", what)?,
            "recently_evicted_capacity",
            c,
        )?,
        enable_events: bool_arg(&attr(obj, "enable_events", what)?, "enable_events")?,
        max_pending_events: usize_arg(
            &attr(obj, "max_pending_events", what)?,
            "max_pending_events",
            c,
        )?,
        max_steps_in_flight: u32_arg(
            &attr(obj, "max_steps_in_flight", what)?,
            "max_steps_in_flight",
            c,
        )?,
        event_block_size: {
            let w = attr(obj, "event_block_size", what)?;
            if w.is_none() {
                None
            } else {
                Some(u32_arg(&w, "event_block_size", c)?)
            }
        },
    };
    config.validate().map_err(|e| to_pyerr(obj.py(), e))?;
    Ok(config)
}
