//! The tensor API's object layout and the conversions between tensors and objects.
//!
//! A tensor is stored as the reference stores it: a 304-byte header, then the
//! elements in C order. The header is the reference's `TensorMetadata` (a C struct,
//! little-endian on the hosts both run on): magic, version, header size, dtype, ndim,
//! layout kind (full or shard), data offset and length, the global and local shapes
//! (8 dimensions each, unused ones -1) and up to 4 sharding axes. Objects written here
//! are read by the reference's `get_tensor` and the other way round.
//!
//! Tensors come in as numpy arrays, or torch tensors when torch is installed (it is
//! never imported for a numpy array). They come out as torch tensors when torch
//! imports, else as numpy arrays; numpy has no bfloat16 or float8, so without torch
//! those come out with the `ml_dtypes` types when that package imports, else as their
//! raw 16- or 8-bit unsigned storage.

use pyo3::exceptions::{PyImportError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyTuple;

pub use crate::tensor_meta::{Dtype, Meta, META_LEN};

/// Why a Python object cannot be stored as a tensor.
pub enum Refusal {
    /// Not an array or tensor, an unsupported dtype or too many dimensions: -600.
    Invalid,
    /// A tensor on a device other than the CPU or a CUDA GPU: an error is raised.
    Device(String),
}

/// A tensor given by Python, with its elements in C order at `ptr` (kept alive by
/// `_owner`, a contiguous version of it).
pub struct Input<'py> {
    _owner: Bound<'py, PyAny>,
    /// Address of the first element.
    pub ptr: usize,
    /// Its header.
    pub meta: Meta,
    /// Whether the elements are in CUDA device memory (moved only by the store's
    /// device calls, never read on the host).
    pub on_device: bool,
}

fn module_of(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().getattr("__module__").and_then(|m| m.extract::<String>()).unwrap_or_default()
}

fn shape_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    obj.getattr("shape")?.try_iter()?.map(|d| d?.extract::<i64>()).collect()
}

/// What [`input`] found in a Python object.
enum Found<'py> {
    /// A CPU tensor (`false`) or a CUDA one (`true`): a C-contiguous version of it,
    /// its address, dtype name and shape.
    Host(Bound<'py, PyAny>, usize, String, Vec<i64>, bool),
    /// A tensor on this other device type.
    Device(String),
    /// Neither a numpy array nor a torch tensor.
    Other,
}

fn find<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Found<'py>> {
    let module = module_of(obj);
    if module.starts_with("torch") && obj.hasattr("data_ptr")? {
        let device = obj.getattr("device")?.getattr("type")?.extract::<String>()?;
        if device != "cpu" && device != "cuda" {
            return Ok(Found::Device(device));
        }
        // A CUDA tensor's contiguous version is made on its GPU, by torch.
        let t = obj.call_method0("contiguous")?;
        if device == "cuda" {
            wait_for_torch(&t)?;
        }
        let dtype = t.getattr("dtype")?.str()?.to_string();
        let ptr = t.call_method0("data_ptr")?.extract::<usize>()?;
        let shape = shape_of(&t)?;
        return Ok(Found::Host(t, ptr, dtype.trim_start_matches("torch.").to_owned(), shape, device == "cuda"));
    }
    if module.starts_with("numpy") && obj.hasattr("__array_interface__")? {
        // An array as is; a numpy scalar (`np.float64(1.5)`) as a 0-d array of its
        // own. A scalar's `__array_interface__` points into a temporary array that
        // lives only as long as the interface's dict: its address would be freed
        // memory by the time the write reads it.
        let numpy = self::module(obj.py(), &NUMPY, "numpy")
            .ok_or_else(|| PyImportError::new_err("numpy does not import, yet a numpy object was given"))?;
        let mut arr = numpy.call_method1("asarray", (obj,))?;
        if !arr.getattr("flags")?.getattr("c_contiguous")?.extract::<bool>()? {
            arr = arr.call_method1("copy", ("C",))?;
        }
        let dt = arr.getattr("dtype")?;
        if dt.getattr("byteorder")?.extract::<String>()? == ">" {
            // Stored little-endian, as the elements of every tensor are.
            let native = dt.call_method1("newbyteorder", ("<",))?;
            arr = arr.call_method1("astype", (native,))?;
        }
        let name = arr.getattr("dtype")?.getattr("name")?.extract::<String>()?;
        let iface = arr.getattr("__array_interface__")?;
        let ptr = iface.get_item("data")?.get_item(0)?.extract::<usize>()?;
        let shape = shape_of(&arr)?;
        return Ok(Found::Host(arr, ptr, name, shape, false));
    }
    Ok(Found::Other)
}

/// Waits for the work torch queued on the current stream of CUDA tensor `t`'s device:
/// the kernels that write a tensor (or still read one about to be written) may be
/// running when it is handed over, and the store's copies run on streams of their
/// own; `tensor.cpu()` waits for the same. Nothing to wait for where torch does not
/// import (an object that only looks like a tensor).
fn wait_for_torch(t: &Bound<'_, PyAny>) -> PyResult<()> {
    let Some(torch) = self::module(t.py(), &TORCH, "torch") else { return Ok(()) };
    torch.getattr("cuda")?.call_method1("current_stream", (t.getattr("device")?,))?.call_method0("synchronize")?;
    Ok(())
}

/// Reads a numpy array or a torch tensor (on the CPU or a CUDA GPU) given by Python.
pub fn input<'py>(obj: &Bound<'py, PyAny>) -> Result<Input<'py>, Refusal> {
    match find(obj) {
        Ok(Found::Host(owner, ptr, dtype, shape, on_device)) => {
            let dtype = Dtype::from_name(&dtype).ok_or(Refusal::Invalid)?;
            let meta = Meta::full(dtype, shape).ok_or(Refusal::Invalid)?;
            Ok(Input { _owner: owner, ptr, meta, on_device })
        }
        Ok(Found::Device(device)) => Err(Refusal::Device(device)),
        _ => Err(Refusal::Invalid),
    }
}

/// A destination tensor of `get_tensor_into_cuda`: a contiguous torch tensor on the
/// CPU or a CUDA GPU (written in place: never a contiguous copy of it), as the
/// reference takes.
pub fn destination<'py>(obj: &Bound<'py, PyAny>) -> Result<Input<'py>, Refusal> {
    let contiguous = module_of(obj).starts_with("torch")
        && obj.call_method0("is_contiguous").and_then(|c| c.extract::<bool>()).unwrap_or(false);
    if !contiguous {
        return Err(Refusal::Invalid);
    }
    input(obj)
}

/// The error raised for a tensor on a device other than the CPU or a CUDA GPU.
pub fn device_error(device: &str) -> PyErr {
    PyValueError::new_err(format!(
        "a tensor on device {device:?} cannot be stored: only CPU and CUDA tensors can; copy it to \
         the CPU first (tensor.cpu())"
    ))
}

static TORCH: PyOnceLock<Option<Py<PyModule>>> = PyOnceLock::new();
static NUMPY: PyOnceLock<Option<Py<PyModule>>> = PyOnceLock::new();
static ML_DTYPES: PyOnceLock<Option<Py<PyModule>>> = PyOnceLock::new();

/// A module, imported once (`None` if it does not import).
fn module<'py>(py: Python<'py>, cell: &PyOnceLock<Option<Py<PyModule>>>, name: &str) -> Option<Bound<'py, PyModule>> {
    cell.get_or_init(py, || py.import(name).ok().map(Bound::unbind)).as_ref().map(|m| m.bind(py).clone())
}

/// How tensors come out: torch when it imports, else numpy.
enum Backend<'py> {
    Torch(Bound<'py, PyModule>),
    Numpy(Bound<'py, PyModule>),
}

fn backend(py: Python<'_>) -> PyResult<Backend<'_>> {
    if let Some(t) = module(py, &TORCH, "torch") {
        return Ok(Backend::Torch(t));
    }
    if let Some(n) = module(py, &NUMPY, "numpy") {
        return Ok(Backend::Numpy(n));
    }
    Err(PyImportError::new_err("reading tensors needs numpy or torch"))
}

/// The numpy dtype of `d`: its own, `ml_dtypes`' for the types numpy lacks, else the
/// raw storage.
fn numpy_dtype<'py>(py: Python<'py>, d: Dtype) -> PyResult<Bound<'py, PyAny>> {
    if d.numpy_lacks() {
        if let Some(ml) = module(py, &ML_DTYPES, "ml_dtypes") {
            return ml.getattr(d.name());
        }
    }
    Ok(pyo3::types::PyString::new(py, d.storage()).into_any())
}

/// A new tensor with `meta`'s dtype and local shape, and the address of its elements.
pub fn empty<'py>(py: Python<'py>, meta: &Meta) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let shape = PyTuple::new(py, &meta.local)?;
    match backend(py)? {
        Backend::Torch(torch) => {
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("dtype", torch.getattr(meta.dtype.name())?)?;
            let t = torch.call_method("empty", (shape,), Some(&kwargs))?;
            let ptr = t.call_method0("data_ptr")?.extract::<usize>()?;
            Ok((t, ptr))
        }
        Backend::Numpy(np) => {
            let a = np.call_method1("empty", (shape, numpy_dtype(py, meta.dtype)?))?;
            let ptr = a.getattr("__array_interface__")?.get_item("data")?.get_item(0)?.extract::<usize>()?;
            Ok((a, ptr))
        }
    }
}

/// A tensor over `meta.data_bytes` bytes of memory at `ptr` (registered by the caller,
/// which must keep it alive while the tensor is used): the reference's
/// `get_tensor_into` returns such a view of the caller's buffer, not a copy.
pub fn view<'py>(py: Python<'py>, meta: &Meta, ptr: usize) -> PyResult<Bound<'py, PyAny>> {
    if meta.data_bytes == 0 {
        return Ok(empty(py, meta)?.0);
    }
    let len =
        pyo3::ffi::Py_ssize_t::try_from(meta.data_bytes).map_err(|_| PyValueError::new_err("tensor too large"))?;
    // PyBUF_WRITE: the view may be written, as the reference's tensor over the buffer.
    const PYBUF_WRITE: std::ffi::c_int = 0x200;
    // SAFETY: `[ptr, ptr + len)` is registered memory the caller keeps alive; the
    // memoryview does not own it, and Python gets a new reference (or NULL with an
    // error set, turned into a PyErr by `from_owned_ptr_or_err`).
    let mv = unsafe {
        Bound::from_owned_ptr_or_err(
            py,
            pyo3::ffi::PyMemoryView_FromMemory(ptr as *mut std::ffi::c_char, len, PYBUF_WRITE),
        )?
    };
    let shape = PyTuple::new(py, &meta.local)?;
    match backend(py)? {
        Backend::Torch(torch) => {
            let kwargs = pyo3::types::PyDict::new(py);
            kwargs.set_item("dtype", torch.getattr(meta.dtype.name())?)?;
            torch.call_method("frombuffer", (mv,), Some(&kwargs))?.call_method1("reshape", (shape,))
        }
        Backend::Numpy(np) => {
            np.call_method1("frombuffer", (mv, numpy_dtype(py, meta.dtype)?))?.call_method1("reshape", (shape,))
        }
    }
}

/// A torch tensor on CUDA device `ordinal` over `meta.data_bytes` bytes of its memory
/// at `ptr` (which the caller keeps alive while the tensor is used): [`view`]'s
/// counterpart for a buffer in GPU memory, made without touching the memory on the
/// host. torch takes the memory through the CUDA array interface as bytes, then
/// reinterprets them as the stored dtype (the interface has no bfloat16 or float8).
/// Without torch an `ImportError`: a numpy array cannot hold device memory (the
/// bytes are in the buffer all the same).
pub fn device_view<'py>(py: Python<'py>, meta: &Meta, ptr: usize, ordinal: usize) -> PyResult<Bound<'py, PyAny>> {
    let Backend::Torch(torch) = backend(py)? else {
        return Err(PyImportError::new_err(
            "a tensor read into GPU memory comes out as a torch CUDA tensor, and torch does not import (the \
             object's bytes are in the buffer)",
        ));
    };
    let device = format!("cuda:{ordinal}");
    let dtype = torch.getattr(meta.dtype.name())?;
    let shape = PyTuple::new(py, &meta.local)?;
    if meta.data_bytes == 0 {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("dtype", dtype)?;
        kwargs.set_item("device", device)?;
        return torch.call_method("empty", (shape,), Some(&kwargs));
    }
    let interface = pyo3::types::PyDict::new(py);
    interface.set_item("shape", (meta.data_bytes,))?;
    interface.set_item("typestr", "|u1")?;
    interface.set_item("data", (ptr, false))?;
    interface.set_item("strides", py.None())?;
    interface.set_item("version", 2)?;
    // torch keeps the holder (not the memory's owner) alive with the tensor.
    let holder = py.import("types")?.getattr("SimpleNamespace")?.call0()?;
    holder.setattr("__cuda_array_interface__", interface)?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("device", device)?;
    let bytes = torch.call_method("as_tensor", (holder,), Some(&kwargs))?;
    bytes.call_method1("view", (dtype,))?.call_method1("reshape", (shape,))
}

/// A tensor holding a copy of the elements of `object` (an object of the tensor
/// layout), or `None` if the object is not one.
pub fn from_object<'py>(py: Python<'py>, object: &[u8]) -> PyResult<Option<Bound<'py, PyAny>>> {
    let Some(meta) = Meta::parse(object, object.len()) else { return Ok(None) };
    let (t, ptr) = empty(py, &meta)?;
    let data = &object[meta.data_offset..];
    if !data.is_empty() {
        // SAFETY: `t` was just made with `meta`'s dtype and shape: its `data_bytes`
        // (= data.len(), checked by `parse`) bytes at `ptr` are ours to write, and
        // cannot overlap the engine's buffer.
        py.detach(|| unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr as *mut u8, data.len()) });
    }
    Ok(Some(t))
}

/// The key of shard `rank`: the reference's `key_tp_<rank>`.
pub fn tp_key(base: &str, rank: i32) -> String {
    format!("{base}_tp_{rank}")
}
