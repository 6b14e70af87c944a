//! `BufferHandle`: an object read by `get_buffer`, owned by Python.
//!
//! The class is a `bytes` subclass with the reference handle's `ptr()` and `size()`
//! (defined in `extras.py`): frameworks read handles through the buffer protocol
//! (`memoryview(h)`, `torch.frombuffer(h)`), which a class of this wheel cannot
//! offer under the stable ABI before Python 3.11, while `bytes` offers it everywhere.
//! The object's bytes are copied once, from the engine's buffer into the handle.

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyBytes;

static HANDLE_CLASS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

/// Records the `BufferHandle` class (at module initialisation).
pub fn set_class(py: Python<'_>, class: Bound<'_, PyAny>) {
    let _ = HANDLE_CLASS.set(py, class.unbind());
}

/// A `BufferHandle` holding a copy of `data`.
pub fn buffer_handle<'py>(py: Python<'py>, data: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    let class = HANDLE_CLASS.get(py).ok_or_else(|| PyRuntimeError::new_err("BufferHandle is not initialised"))?;
    let len = pyo3::ffi::Py_ssize_t::try_from(data.len()).map_err(|_| PyRuntimeError::new_err("object too large"))?;
    // PyBUF_READ: a read-only view.
    const PYBUF_READ: std::ffi::c_int = 0x100;
    // SAFETY: the view covers `data`, which outlives it: it is released below, before
    // this function returns, and only `bytes.__new__` reads it (copying).
    let view = unsafe {
        Bound::from_owned_ptr_or_err(py, pyo3::ffi::PyMemoryView_FromMemory(data.as_ptr() as *mut _, len, PYBUF_READ))?
    };
    let handle = class.bind(py).call1((&view,));
    view.call_method0("release")?;
    handle
}

/// Address of the first byte of a `bytes` object (`BufferHandle.ptr()`).
#[pyfunction]
pub fn _bytes_address(b: &Bound<'_, PyBytes>) -> usize {
    b.as_bytes().as_ptr() as usize
}
