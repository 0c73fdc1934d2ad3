//! Integer sequences: token ids and sequence ids, from lists, `NumPy` arrays and tensors.
//!
//! An input is a list (any iterable of ints), a 1-D `NumPy` integer array of any integer dtype
//! in either byte order (read without a Python-level loop; a big-endian array is viewed as its
//! native dtype and each value swapped as it is read), or an object `NumPy` can view without
//! copying (torch CPU tensors). Its length is checked against a `MaxLen` before anything is
//! read or copied, and the copy is reserved fallibly: an input the machine cannot hold is an
//! `InvalidRequestError` naming the memory it needs, never an abort. Every value is checked
//! against its range (`convert`'s rule: out of range is `InvalidRequestError`, not an int is
//! `TypeError`). Byte data (`bytes`, `bytearray`, `memoryview`) is refused, as are masked
//! arrays, whose mask a read of their data would ignore.

use numpy::prelude::*;
use numpy::{Element, PyArray1, PyUntypedArray};
use prefixcache_core::limits::{human_bytes, MAX_BATCH_SEQUENCES, MAX_SEQUENCE_TOKENS};
use pyo3::exceptions::{PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyMemoryView, PyString};

use crate::convert::{range_error, type_name, Domain};

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
