//! Argument conversion: Python integers, token lists and arrays, configuration objects.
//!
//! Owns the one rule of the shell: a value of the wrong *type* is a `TypeError`, a value out
//! of its documented *range* is the core's `InvalidRequest` (or `Config` inside a
//! configuration), both of which are `ValueError`s in Python. Token and id inputs are lists
//! (any iterable of ints), `NumPy` integer arrays of either byte order (read without a
//! Python-level loop) or objects that `NumPy` can view without copying (torch CPU tensors);
//! their length is bounded (`MaxLen`) before anything is read, and their copy is reserved
//! fallibly. Byte data (`bytes`, `bytearray`, `memoryview`) is what byte fields (a cache salt,
//! a multimodal hash) take and what integer sequences refuse; masked arrays are refused, since
//! their mask would be ignored. Nothing here knows a cache rule: the core validates what the
//! values mean.

use numpy::prelude::*;
use numpy::{Element, PyArray1, PyUntypedArray};
use prefixcache_core::limits::{
    human_bytes, MAX_BATCH_SEQUENCES, MAX_EXTRA_KEY_BYTES, MAX_MULTIMODAL_INPUTS,
    MAX_SEQUENCE_TOKENS,
};
use prefixcache_core::{
    CacheConfig, CacheError, ExtraKeys, GroupConfig, GroupKind, HashAlgorithm, HashConfig,
    MultimodalInput, PoolConfig, Retention, StateGroupConfig,
};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyMemoryView, PyString};

use crate::errors::to_pyerr;

/// Which core error a range problem becomes.
#[derive(Clone, Copy)]
pub enum Domain {
    /// A request argument: `InvalidRequestError`.
    Request,
    /// A configuration field: `ConfigError`.
    Config,
}

fn range_error(py: Python<'_>, domain: Domain, message: String) -> PyErr {
    to_pyerr(
        py,
        match domain {
            Domain::Request => CacheError::InvalidRequest { message },
            Domain::Config => CacheError::Config { message },
        },
    )
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
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

/// The integer dtypes accepted for token and id arrays.
trait IntElement: Element + Copy {
    /// The value as `u64`; `None` when negative.
    fn to_u64(self) -> Option<u64>;
    /// The value with its bytes in the other order (for arrays not in native byte order).
    fn swapped(self) -> Self;
}

macro_rules! int_elements {
    ($($t:ty),*) => {
        $(impl IntElement for $t {
            fn to_u64(self) -> Option<u64> {
                u64::try_from(self).ok()
            }
            fn swapped(self) -> Self {
                self.swap_bytes()
            }
        })*
    };
}

int_elements!(i8, i16, i32, i64, u8, u16, u32, u64);

/// What integer sequences are converted to: `u32` (tokens, budgets) or `u64` (ids).
pub trait Target: Copy {
    /// The value, already checked to fit.
    fn from_checked(value: u64) -> Self;
}

impl Target for u32 {
    fn from_checked(value: u64) -> Self {
        value as u32
    }
}

impl Target for u64 {
    fn from_checked(value: u64) -> Self {
        value
    }
}

/// The most entries a sequence argument may have, checked before anything is copied or read.
#[derive(Clone, Copy)]
pub struct MaxLen {
    len: usize,
    /// The `prefixcache` constant that names the bound.
    name: &'static str,
    /// What to do instead, appended to the message.
    advice: &'static str,
}

/// The tokens of one sequence.
pub const SEQUENCE: MaxLen =
    MaxLen { len: MAX_SEQUENCE_TOKENS, name: "MAX_SEQUENCE_TOKENS", advice: "" };

/// The entries of one batch call: ids, budgets, one token per sequence.
pub const BATCH: MaxLen = MaxLen {
    len: MAX_BATCH_SEQUENCES,
    name: "MAX_BATCH_SEQUENCES",
    advice: ": split the batch into calls of at most that many sequences",
};

/// An empty vector with room for `len` values, reserved fallibly: a copy the machine cannot
/// hold is an `InvalidRequestError` naming the memory it needs, not an abort of the process.
fn reserve<T>(py: Python<'_>, len: usize, what: &str) -> PyResult<Vec<T>> {
    let mut out = Vec::new();
    out.try_reserve_exact(len).map_err(|_| {
        range_error(
            py,
            Domain::Request,
            format!(
                "{what} has {len} entries, and copying them needs {} of memory, which could \
                 not be allocated",
                human_bytes(len.saturating_mul(std::mem::size_of::<T>()))
            ),
        )
    })?;
    Ok(out)
}

/// Arrays up to this length are copied out rather than borrowed (see `read_array`).
const COPY_OUT_BELOW: usize = 1024;

/// Reads a 1-D integer array into `Vec<T>`, checking `0..=max` (`max` fits `T`); `None` when
/// the dtype is not `E`. `SWAPPED`: the array holds `E` in the other byte order. Two passes
/// without branches that depend on each other (a check, then a conversion), so both vectorise.
fn read_array<E: IntElement, T: Target, const SWAPPED: bool>(
    array: &Bound<'_, PyUntypedArray>,
    what: &str,
    max: u64,
) -> PyResult<Option<Vec<T>>> {
    let Ok(typed) = array.cast::<PyArray1<E>>() else { return Ok(None) };
    let value = |v: &E| if SWAPPED { v.swapped() } else { *v };
    let bad = |v: &E| value(v).to_u64().is_none_or(|x| x > max);
    let convert = |v: &E| T::from_checked(value(v).to_u64().unwrap_or(0));
    // A short contiguous array (a decode step's ids and tokens) is copied out first: cheaper
    // than the bookkeeping of a read-only borrow, under which a long one (a prompt) is read
    // in place.
    let copied = if typed.len() <= COPY_OUT_BELOW { typed.to_vec().ok() } else { None };
    let (first_bad, out) = if let Some(values) = copied {
        // Same-sized types (`u32` tokens, `i64` ids) convert in place.
        (values.iter().position(bad), values.into_iter().map(|v| convert(&v)).collect())
    } else {
        let view =
            typed.try_readonly().map_err(|e| PyTypeError::new_err(format!("{what}: {e}")))?;
        let mut out = reserve(array.py(), typed.len(), what)?;
        let first_bad = if let Ok(slice) = view.as_slice() {
            // Contiguous: plain slice loops.
            let first_bad = slice.iter().position(bad);
            if first_bad.is_none() {
                out.extend(slice.iter().map(convert));
            }
            first_bad
        } else {
            let values = view.as_array();
            let first_bad = values.iter().position(bad);
            if first_bad.is_none() {
                out.extend(values.iter().map(convert));
            }
            first_bad
        };
        (first_bad, out)
    };
    match first_bad {
        Some(i) => Err(range_error(
            array.py(),
            Domain::Request,
            format!("{what}[{i}] is out of range 0..={max}"),
        )),
        None => Ok(Some(out)),
    }
}

/// The one typed read of `array` its dtype's kind and size can match (`None`: not an integer
/// dtype). A typed cast that fails costs `NumPy` a dtype comparison through its casting
/// tables, which a decode step's arrays would pay on every call.
fn read_integers<T: Target, const SWAPPED: bool>(
    array: &Bound<'_, PyUntypedArray>,
    what: &str,
    max: u64,
) -> PyResult<Option<Vec<T>>> {
    let descr = array.dtype();
    match (descr.kind(), descr.itemsize()) {
        (b'u', 4) => read_array::<u32, T, SWAPPED>(array, what, max),
        (b'i', 8) => read_array::<i64, T, SWAPPED>(array, what, max),
        (b'i', 4) => read_array::<i32, T, SWAPPED>(array, what, max),
        (b'u', 8) => read_array::<u64, T, SWAPPED>(array, what, max),
        (b'u', 2) => read_array::<u16, T, SWAPPED>(array, what, max),
        (b'i', 2) => read_array::<i16, T, SWAPPED>(array, what, max),
        (b'u', 1) => read_array::<u8, T, SWAPPED>(array, what, max),
        (b'i', 1) => read_array::<i8, T, SWAPPED>(array, what, max),
        _ => Ok(None),
    }
}

/// Reads a 1-D array of any integer dtype, in either byte order, into `Vec<T>` (range
/// `0..=max`).
fn from_array<T: Target>(
    array: &Bound<'_, PyUntypedArray>,
    what: &str,
    max: u64,
) -> PyResult<Vec<T>> {
    let py = array.py();
    if array.ndim() != 1 {
        return Err(range_error(
            py,
            Domain::Request,
            format!("{what} must be 1-D, got an array of shape {:?}", array.shape()),
        ));
    }
    let descr = array.dtype();
    let read = if descr.is_native_byteorder() == Some(false) {
        // Big-endian data on a little-endian machine (or the reverse), as NumPy accepts it
        // everywhere: the same bytes are viewed as the native dtype (no copy) and each value
        // is swapped as it is read.
        let native = descr.call_method1("newbyteorder", ("=",))?;
        let view = array.call_method1("view", (native,))?;
        let view = view.cast::<PyUntypedArray>()?;
        read_integers::<T, true>(view, what, max)?
    } else {
        read_integers::<T, false>(array, what, max)?
    };
    if let Some(v) = read {
        return Ok(v);
    }
    let dtype = descr.str().map_or_else(|_| "?".to_string(), |s| s.to_string());
    Err(PyTypeError::new_err(format!(
        "{what} must be an integer array, got dtype {dtype}; convert it with .astype(numpy.int64)"
    )))
}

/// `TypeError` for a `NumPy` masked array, whose mask a read of its data would ignore.
fn refuse_masked(array: &Bound<'_, PyUntypedArray>, what: &str) -> PyResult<()> {
    let py = array.py();
    if array.get_type().is(py.get_type::<PyUntypedArray>()) {
        return Ok(()); // a plain ndarray (the usual case): no subclass to look at
    }
    let masked = py.import("numpy.ma")?.getattr("MaskedArray")?;
    if array.is_instance(&masked)? {
        return Err(PyTypeError::new_err(format!(
            "{what} is a numpy masked array, and its mask would be ignored: pass a plain array \
             instead (arr.filled(value) replaces the masked entries, arr.compressed() drops \
             them)"
        )));
    }
    Ok(())
}

/// Whether `obj` is byte data (`bytes`, `bytearray`, `memoryview`).
fn is_bytes_like(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyBytes>()
        || obj.is_instance_of::<PyByteArray>()
        || obj.is_instance_of::<PyMemoryView>()
}

/// A list of ints, a 1-D `NumPy` integer array or a torch CPU tensor, as `Vec<T>` in `0..=max`.
///
/// Its length is checked against `max_len` before anything is copied or read, and the copy is
/// reserved fallibly (see `reserve`).
pub fn int_sequence<T: Target>(
    obj: &Bound<'_, PyAny>,
    what: &str,
    max: u64,
    max_len: MaxLen,
) -> PyResult<Vec<T>> {
    let py = obj.py();
    let too_long = |len: usize| {
        range_error(
            py,
            Domain::Request,
            format!(
                "{what} has {len} entries, more than the supported {} (prefixcache.{}){}",
                max_len.len, max_len.name, max_len.advice
            ),
        )
    };
    if let Ok(array) = obj.cast::<PyUntypedArray>() {
        if array.ndim() == 1 && array.len() > max_len.len {
            return Err(too_long(array.len()));
        }
        refuse_masked(array, what)?;
        return from_array(array, what, max);
    }
    if obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list of ints or a 1-D integer array, got str"
        )));
    }
    if is_bytes_like(obj) {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list of ints or a 1-D integer array, got {} (byte data, not \
             token ids or sequence ids: numpy.frombuffer(data, dtype=...) reads integers \
             stored in a buffer)",
            type_name(obj)
        )));
    }
    if obj.hasattr("__array__").unwrap_or(false) {
        // torch CPU tensors and other array-likes: a zero-copy `NumPy` view.
        let array = py.import("numpy")?.call_method1("asarray", (obj,)).map_err(|e| {
            PyTypeError::new_err(format!(
                "{what}: cannot read a {} as a CPU integer array ({e})",
                type_name(obj)
            ))
        })?;
        let array = array.cast::<PyUntypedArray>().map_err(|_| {
            PyTypeError::new_err(format!("{what}: numpy.asarray did not return an array"))
        })?;
        if array.ndim() == 1 && array.len() > max_len.len {
            return Err(too_long(array.len()));
        }
        refuse_masked(array, what)?;
        return from_array(array, what, max);
    }
    let Ok(iter) = obj.try_iter() else {
        return Err(PyTypeError::new_err(format!(
            "{what} must be a list of ints or a 1-D integer array, got {}",
            type_name(obj)
        )));
    };
    let mut out = reserve(py, obj.len().unwrap_or(0).min(max_len.len), what)?;
    for (i, item) in iter.enumerate() {
        if i >= max_len.len {
            return Err(too_long(obj.len().unwrap_or(i + 1)));
        }
        let item = item?;
        // `None`: not an int; `Some(None)`: an int out of range.
        let value = if item.is_instance_of::<PyBool>() {
            None
        } else {
            match item.extract::<u64>() {
                Ok(v) => Some((v <= max).then(|| T::from_checked(v))),
                Err(e) if e.is_instance_of::<PyOverflowError>(py) => Some(None),
                Err(_) => None,
            }
        };
        match value {
            Some(Some(v)) => out.push(v),
            Some(None) => {
                let shown = item.repr().map_or_else(|_| "?".to_string(), |r| r.to_string());
                return Err(range_error(
                    py,
                    Domain::Request,
                    format!("{what}[{i}] must be in 0..={max}, got {shown}"),
                ));
            }
            None => {
                return Err(PyTypeError::new_err(format!(
                    "{what}[{i}] must be an int, got {}",
                    type_name(&item)
                )))
            }
        }
    }
    Ok(out)
}

/// Token ids (`u32`), at most `max_len` of them (`SEQUENCE` for a prompt or an append,
/// `BATCH` for one token per sequence of a batch).
pub fn tokens(obj: &Bound<'_, PyAny>, what: &str, max_len: MaxLen) -> PyResult<Vec<u32>> {
    int_sequence(obj, what, u64::from(u32::MAX), max_len)
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
    };
    config.validate().map_err(|e| to_pyerr(obj.py(), e))?;
    Ok(config)
}
