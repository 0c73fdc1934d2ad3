//! `Buffer`: one array of a `PlanBuffers`, written in place step after step.
//!
//! A buffer is a C-contiguous `NumPy` array of `[rows, columns]` values (`columns == 0`: one
//! dimension) that the bindings made and that Python code reads (and may keep, or wrap in a
//! torch tensor). Each write fills its leading rows; a write that needs more rows or columns
//! replaces the array by a larger one. Arrays are allocated fallibly: one the machine cannot
//! hold is an `InvalidRequestError` naming its size, never an abort.
//!
//! Invariant: before every write the array is checked to be what `new` made (its dtype, shape,
//! C-contiguous, aligned and writeable layout), since Python code can change each of those in
//! place (`arr.resize`, `arr.shape = ..`, `arr.dtype = ..`, `arr.strides = ..`,
//! `arr.flags.writeable = False`). A changed array is refused with a message saying which array
//! and what happened; nothing is written into memory the array no longer describes.

use std::marker::PhantomData;

use numpy::npyffi::{npy_intp, NPY_ARRAY_CARRAY, PY_ARRAY_API};
use numpy::prelude::*;
use numpy::{Element, PyArray1, PyArray2, PyArrayDescr, PyUntypedArray};
use prefixcache_core::limits::human_bytes;
use prefixcache_core::CacheError;
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;

use crate::errors::to_pyerr;

/// A shape as Python writes it: `(4,)`, `(4, 3)`.
fn shape(dims: &[usize]) -> String {
    match dims {
        [n] => format!("({n},)"),
        _ => format!("({})", dims.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")),
    }
}

/// A `[rows, columns]` array (columns 0: one-dimensional) that grows when a step needs more.
pub struct Buffer<T: Element> {
    array: Py<PyAny>,
    /// The dtype object the array was made with (compared by identity before each write).
    descr: Py<PyArrayDescr>,
    rows: usize,
    columns: usize,
    /// `Class.attribute` the array is read as, for messages.
    name: &'static str,
    _element: PhantomData<T>,
}

impl<T: Element + Copy> Buffer<T> {
    /// A zeroed array; `InvalidRequestError` naming its size when it cannot be allocated.
    pub fn new(py: Python<'_>, name: &'static str, rows: usize, columns: usize) -> PyResult<Self> {
        let descr = T::get_dtype(py);
        let mut dims = [rows as npy_intp, columns as npy_intp];
        let nd = if columns == 0 { 1 } else { 2 };
        // SAFETY: `PyArray_Zeros` takes `nd` dimensions from `dims` and steals the reference to
        // the dtype given to it (a new one, from `clone`); it returns a new reference to a
        // C-ordered array, or NULL with a Python exception set, which `from_owned_ptr_or_err`
        // takes.
        let array = unsafe {
            let ptr = PY_ARRAY_API.PyArray_Zeros(
                py,
                nd,
                dims.as_mut_ptr(),
                descr.clone().into_dtype_ptr(),
                0,
            );
            Bound::from_owned_ptr_or_err(py, ptr)
        };
        let array = array.map_err(|e| {
            if e.is_instance_of::<PyMemoryError>(py) || e.is_instance_of::<PyValueError>(py) {
                let values = rows.saturating_mul(columns.max(1));
                to_pyerr(
                    py,
                    CacheError::InvalidRequest {
                        message: format!(
                            "{name} of {values} values needs {} of memory, which could not be \
                             allocated ({e}): ask for fewer rows",
                            human_bytes(values.saturating_mul(std::mem::size_of::<T>()))
                        ),
                    },
                )
            } else {
                e
            }
        })?;
        Ok(Self {
            array: array.unbind(),
            descr: descr.unbind(),
            rows,
            columns,
            name,
            _element: PhantomData,
        })
    }

    /// Writes `data`, `rows` rows of `columns` values (`columns == 0`: a vector of `rows`),
    /// into the leading rows, growing the array first if it is too small. Returns whether the
    /// array was replaced by a larger one.
    pub fn write(
        &mut self,
        py: Python<'_>,
        data: &[T],
        rows: usize,
        columns: usize,
    ) -> PyResult<bool> {
        if rows == 0 {
            return Ok(false); // nothing to write, and any array holds no rows
        }
        // A one-dimensional buffer is always written with `columns == 0`; a two-dimensional
        // one with at most as many columns as it has, or it grows (with `columns == 0` and no
        // data: only its rows are grown to `rows`).
        let grow = rows > self.rows || columns > self.columns;
        if grow {
            let grown_rows = if rows > self.rows { rows.max(2 * self.rows) } else { self.rows };
            *self = Self::new(py, self.name, grown_rows, columns.max(self.columns))?;
        }
        let stride = self.columns.max(1);
        let width = columns.max(1);
        let slice = self.slice_mut(py)?;
        if stride == width {
            slice[..data.len()].copy_from_slice(data);
        } else {
            for (row, values) in data.chunks_exact(width).enumerate() {
                slice[row * stride..row * stride + width].copy_from_slice(values);
            }
        }
        Ok(grow)
    }

    /// The array's `rows * max(columns, 1)` values, once it is checked to be as `new` made it.
    #[allow(clippy::mut_from_ref)] // the one mutable view of memory only this buffer writes
    fn slice_mut<'a>(&'a self, py: Python<'a>) -> PyResult<&'a mut [T]> {
        let bound = self.array.bind(py);
        // SAFETY: `new` made the object a `NumPy` array, and an object's type can only change
        // to one of the same layout, so it is still one.
        let array = unsafe { bound.cast_unchecked::<PyUntypedArray>() };
        let expected: &[usize] =
            if self.columns == 0 { &[self.rows] } else { &[self.rows, self.columns] };
        let dtype = array.dtype();
        // SAFETY: reads the flags of a live array with the GIL held.
        let flags = unsafe { (*array.as_array_ptr()).flags };
        let problem = if !dtype.is(&self.descr) && !dtype.is_equiv_to(self.descr.bind(py)) {
            Some(format!("had its dtype changed to {dtype} (it is {})", self.descr.bind(py)))
        } else if array.shape() != expected {
            Some(format!(
                "was resized or reshaped to shape {} (it is {})",
                shape(array.shape()),
                shape(expected)
            ))
        } else if flags & NPY_ARRAY_CARRAY != NPY_ARRAY_CARRAY {
            Some(if array.is_c_contiguous() && array.is_aligned() {
                "was made read-only".to_string()
            } else {
                "is no longer C-contiguous (its strides were changed)".to_string()
            })
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(to_pyerr(
                py,
                CacheError::InvalidRequest {
                    message: format!(
                        "{} {problem} from Python: the buffers write every step into the \
                         arrays they made, so do not resize, reshape, retype or re-stride them \
                         or make them read-only (change a copy: arr.copy()); create a new \
                         PlanBuffers to go on",
                        self.name
                    ),
                },
            ));
        }
        // SAFETY: the array has `T`'s dtype, the dimensions `new` gave it and a C-contiguous,
        // aligned, writeable layout (checked above), so its memory is `rows * max(columns, 1)`
        // values of `T`. It is reachable from Python only through the getters; the GIL is held,
        // so no Python code reads or changes it during the write, and this crate holds no other
        // borrow of it. (Native code that works on it without the GIL, such as a torch CPU op on
        // a tensor made from it in another thread, must not run during a build: the class
        // documents that the next build overwrites the arrays.)
        let slice = unsafe {
            if self.columns == 0 {
                bound.cast_unchecked::<PyArray1<T>>().as_slice_mut()
            } else {
                bound.cast_unchecked::<PyArray2<T>>().as_slice_mut()
            }
        };
        slice.map_err(|e| {
            to_pyerr(py, CacheError::Invariant { message: format!("{}: {e}", self.name) })
        })
    }

    pub fn get(&self, py: Python<'_>) -> Py<PyAny> {
        self.array.clone_ref(py)
    }
}
