//! `BufferHandle`: an object read by `get_buffer`, owned by Python.

use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The bytes of one object, held without a copy until Python asks for them.
///
/// `bytes(handle)` copies them out; `ptr()` is their address, valid while the handle
/// lives.
#[pyclass(name = "BufferHandle", module = "mooncake_rs.store", frozen)]
pub struct BufferHandle {
    data: Bytes,
}

impl BufferHandle {
    /// A handle on `data`.
    pub fn new(data: Bytes) -> Self {
        Self { data }
    }
}

#[pymethods]
impl BufferHandle {
    /// Address of the first byte.
    fn ptr(&self) -> usize {
        self.data.as_ptr() as usize
    }

    /// Length in bytes.
    fn size(&self) -> usize {
        self.data.len()
    }

    fn __len__(&self) -> usize {
        self.data.len()
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.data)
    }
}
