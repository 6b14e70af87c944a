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

/// Bytes of the header.
pub const META_LEN: usize = 304;
const MAGIC: u32 = 0x4d4f_4f4e;
const VERSION: u16 = 1;
const MAX_DIMS: usize = 8;
const MAX_AXES: usize = 4;
/// Layout kinds.
const FULL: u32 = 0;
const SHARD: u32 = 1;
/// Axis kind of tensor parallelism.
const AXIS_TP: i32 = 1;
/// Byte offsets of the header's fields.
const OFF_GLOBAL: usize = 40;
const OFF_LOCAL: usize = 104;
const OFF_AXIS_COUNT: usize = 168;
const OFF_AXES: usize = 176;
const AXIS_LEN: usize = 32;

/// Element types, with the reference's numbering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// float32
    F32 = 0,
    /// float64
    F64 = 1,
    /// int8
    I8 = 2,
    /// uint8
    U8 = 3,
    /// int16
    I16 = 4,
    /// uint16
    U16 = 5,
    /// int32
    I32 = 6,
    /// uint32
    U32 = 7,
    /// int64
    I64 = 8,
    /// uint64
    U64 = 9,
    /// bool
    Bool = 10,
    /// float16
    F16 = 11,
    /// bfloat16
    Bf16 = 12,
    /// float8_e4m3fn
    F8E4M3 = 13,
    /// float8_e5m2
    F8E5M2 = 14,
}

const DTYPES: [Dtype; 15] = [
    Dtype::F32,
    Dtype::F64,
    Dtype::I8,
    Dtype::U8,
    Dtype::I16,
    Dtype::U16,
    Dtype::I32,
    Dtype::U32,
    Dtype::I64,
    Dtype::U64,
    Dtype::Bool,
    Dtype::F16,
    Dtype::Bf16,
    Dtype::F8E4M3,
    Dtype::F8E5M2,
];

impl Dtype {
    fn from_code(code: i32) -> Option<Self> {
        usize::try_from(code).ok().and_then(|i| DTYPES.get(i).copied())
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::I8 | Dtype::U8 | Dtype::Bool | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
        }
    }

    /// The name torch, numpy and `ml_dtypes` give it.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::I8 => "int8",
            Dtype::U8 => "uint8",
            Dtype::I16 => "int16",
            Dtype::U16 => "uint16",
            Dtype::I32 => "int32",
            Dtype::U32 => "uint32",
            Dtype::I64 => "int64",
            Dtype::U64 => "uint64",
            Dtype::Bool => "bool",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
            Dtype::F8E4M3 => "float8_e4m3fn",
            Dtype::F8E5M2 => "float8_e5m2",
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        DTYPES.iter().copied().find(|d| d.name() == name)
    }

    /// Whether numpy itself has no such type.
    fn numpy_lacks(self) -> bool {
        matches!(self, Dtype::Bf16 | Dtype::F8E4M3 | Dtype::F8E5M2)
    }

    /// The numpy type of its raw storage.
    fn storage(self) -> &'static str {
        match self {
            Dtype::Bf16 => "uint16",
            Dtype::F8E4M3 | Dtype::F8E5M2 => "uint8",
            other => other.name(),
        }
    }
}

/// One sharding axis of the header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Axis {
    kind: i32,
    axis_index: i32,
    rank: i32,
    count: i32,
    split_dim: i32,
    reserved0: i32,
    reserved1: i64,
}

/// A tensor object's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Meta {
    /// Element type.
    pub dtype: Dtype,
    /// Shape of the whole tensor.
    pub global: Vec<i64>,
    /// Shape of what this object holds (the global shape unless it is a shard).
    pub local: Vec<i64>,
    layout: u32,
    axes: Vec<Axis>,
    /// Where the elements start in the object.
    pub data_offset: usize,
    /// Bytes of elements.
    pub data_bytes: usize,
}

/// Elements of a shape, or `None` if a dimension is negative or the count overflows.
fn numel(shape: &[i64]) -> Option<usize> {
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
}

impl Meta {
    /// The header of a whole tensor.
    pub fn full(dtype: Dtype, shape: Vec<i64>) -> Option<Self> {
        if shape.len() > MAX_DIMS {
            return None;
        }
        let data_bytes = numel(&shape)?.checked_mul(dtype.size())?;
        Some(Self {
            dtype,
            global: shape.clone(),
            local: shape,
            layout: FULL,
            axes: Vec::new(),
            data_offset: META_LEN,
            data_bytes,
        })
    }

    /// The header of the bytes as written: header then elements.
    pub fn encode(&self) -> [u8; META_LEN] {
        let mut b = [0u8; META_LEN];
        let mut put = |at: usize, bytes: &[u8]| b[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &MAGIC.to_le_bytes());
        put(4, &VERSION.to_le_bytes());
        put(6, &(META_LEN as u16).to_le_bytes());
        put(8, &(self.dtype as i32).to_le_bytes());
        put(12, &(self.global.len() as i32).to_le_bytes());
        put(16, &self.layout.to_le_bytes());
        put(20, &0u32.to_le_bytes());
        put(24, &(self.data_offset as u64).to_le_bytes());
        put(32, &(self.data_bytes as u64).to_le_bytes());
        for (base, shape) in [(OFF_GLOBAL, &self.global), (OFF_LOCAL, &self.local)] {
            for i in 0..MAX_DIMS {
                put(base + 8 * i, &shape.get(i).copied().unwrap_or(-1).to_le_bytes());
            }
        }
        put(OFF_AXIS_COUNT, &(self.axes.len() as u32).to_le_bytes());
        for (i, a) in self.axes.iter().enumerate() {
            let at = OFF_AXES + AXIS_LEN * i;
            for (j, v) in [a.kind, a.axis_index, a.rank, a.count, a.split_dim, a.reserved0].iter().enumerate() {
                put(at + 4 * j, &v.to_le_bytes());
            }
            put(at + 24, &a.reserved1.to_le_bytes());
        }
        b
    }

    /// The header at the start of an object of `total` bytes (`head` holds at least
    /// its first [`META_LEN`] bytes), checked as the reference checks it: magic,
    /// version, sizes, dtype, dimensions, axes, and that the elements fill the rest of
    /// the object exactly. `None` for anything else.
    pub fn parse(head: &[u8], total: usize) -> Option<Self> {
        if head.len() < META_LEN || total < META_LEN {
            return None;
        }
        let u16_at = |at: usize| u16::from_le_bytes([head[at], head[at + 1]]);
        let u32_at = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().unwrap_or_default());
        let i32_at = |at: usize| u32_at(at) as i32;
        let u64_at = |at: usize| u64::from_le_bytes(head[at..at + 8].try_into().unwrap_or_default());
        let i64_at = |at: usize| u64_at(at) as i64;
        if u32_at(0) != MAGIC || u16_at(4) != VERSION || usize::from(u16_at(6)) != META_LEN {
            return None;
        }
        let dtype = Dtype::from_code(i32_at(8))?;
        let ndim = usize::try_from(i32_at(12)).ok().filter(|&n| n <= MAX_DIMS)?;
        let layout = u32_at(16);
        let axis_count = usize::try_from(u32_at(OFF_AXIS_COUNT)).ok().filter(|&n| n <= MAX_AXES)?;
        if layout > SHARD {
            return None;
        }
        let data_offset = usize::try_from(u64_at(24)).ok().filter(|&o| (META_LEN..=total).contains(&o))?;
        let data_bytes = usize::try_from(u64_at(32)).ok().filter(|&n| n == total - data_offset)?;
        let shape = |base: usize| -> Option<Vec<i64>> {
            let dims: Vec<i64> = (0..MAX_DIMS).map(|i| i64_at(base + 8 * i)).collect();
            let ok = dims[..ndim].iter().all(|&d| d >= 0) && dims[ndim..].iter().all(|&d| d == -1);
            ok.then(|| dims[..ndim].to_vec())
        };
        let global = shape(OFF_GLOBAL)?;
        let local = shape(OFF_LOCAL)?;
        if numel(&local)?.checked_mul(dtype.size())? != data_bytes {
            return None;
        }
        let mut axes = Vec::with_capacity(axis_count);
        for i in 0..axis_count {
            let at = OFF_AXES + AXIS_LEN * i;
            let a = Axis {
                kind: i32_at(at),
                axis_index: i32_at(at + 4),
                rank: i32_at(at + 8),
                count: i32_at(at + 12),
                split_dim: i32_at(at + 16),
                reserved0: i32_at(at + 20),
                reserved1: i64_at(at + 24),
            };
            let valid = (0..=4).contains(&a.kind)
                && a.count > 0
                && (0..a.count).contains(&a.rank)
                && (-1..ndim as i32).contains(&a.split_dim);
            if !valid {
                return None;
            }
            axes.push(a);
        }
        Some(Self { dtype, global, local, layout, axes, data_offset, data_bytes })
    }

    /// The shard `rank` of `count` of this whole tensor along `split_dim`, and the
    /// byte ranges of this tensor's elements that make it (in order). `None` unless
    /// `split_dim` is a dimension that `count` divides, as the reference requires.
    pub fn shard(&self, split_dim: i32, rank: i32, count: i32) -> Option<(Meta, Vec<(usize, usize)>)> {
        let d = usize::try_from(split_dim).ok().filter(|&d| d < self.local.len())?;
        let count_u = usize::try_from(count).ok().filter(|&c| c > 0)?;
        let r = usize::try_from(rank).ok().filter(|&r| r < count_u)?;
        let dim = usize::try_from(self.local[d]).ok()?;
        if dim % count_u != 0 {
            return None;
        }
        let ext = dim / count_u;
        let mut local = self.local.clone();
        local[d] = ext as i64;
        let outer = numel(&self.local[..d])?;
        let inner = numel(&self.local[d + 1..])?.checked_mul(self.dtype.size())?;
        let len = ext.checked_mul(inner)?;
        let mut ranges = Vec::new();
        if len > 0 {
            for o in 0..outer {
                ranges.push(((o * dim + r * ext) * inner, len));
            }
        }
        let meta = Meta {
            dtype: self.dtype,
            global: self.local.clone(),
            local,
            layout: SHARD,
            axes: vec![Axis {
                kind: AXIS_TP,
                axis_index: 0,
                rank,
                count,
                split_dim,
                reserved0: 0,
                reserved1: ext as i64,
            }],
            data_offset: META_LEN,
            data_bytes: len.checked_mul(outer)?,
        };
        Some((meta, ranges))
    }
}

/// Why a Python object cannot be stored as a tensor.
pub enum Refusal {
    /// Not an array or tensor, an unsupported dtype or too many dimensions: -600.
    Invalid,
    /// A tensor in device memory: an error is raised (the GPU path is not there yet).
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
}

fn module_of(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().getattr("__module__").and_then(|m| m.extract::<String>()).unwrap_or_default()
}

fn shape_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    obj.getattr("shape")?.try_iter()?.map(|d| d?.extract::<i64>()).collect()
}

/// What [`input`] found in a Python object.
enum Found<'py> {
    /// A CPU tensor: a C-contiguous version of it, its address, dtype name and shape.
    Host(Bound<'py, PyAny>, usize, String, Vec<i64>),
    /// A tensor on this device type.
    Device(String),
    /// Neither a numpy array nor a torch tensor.
    Other,
}

fn find<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Found<'py>> {
    let module = module_of(obj);
    if module.starts_with("torch") && obj.hasattr("data_ptr")? {
        let device = obj.getattr("device")?.getattr("type")?.extract::<String>()?;
        if device != "cpu" {
            return Ok(Found::Device(device));
        }
        let t = obj.call_method0("contiguous")?;
        let dtype = t.getattr("dtype")?.str()?.to_string();
        let ptr = t.call_method0("data_ptr")?.extract::<usize>()?;
        let shape = shape_of(&t)?;
        return Ok(Found::Host(t, ptr, dtype.trim_start_matches("torch.").to_owned(), shape));
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
        return Ok(Found::Host(arr, ptr, name, shape));
    }
    Ok(Found::Other)
}

/// Reads a numpy array or a torch tensor (on the CPU) given by Python.
pub fn input<'py>(obj: &Bound<'py, PyAny>) -> Result<Input<'py>, Refusal> {
    match find(obj) {
        Ok(Found::Host(owner, ptr, dtype, shape)) => {
            let dtype = Dtype::from_name(&dtype).ok_or(Refusal::Invalid)?;
            let meta = Meta::full(dtype, shape).ok_or(Refusal::Invalid)?;
            Ok(Input { _owner: owner, ptr, meta })
        }
        Ok(Found::Device(device)) => Err(Refusal::Device(device)),
        _ => Err(Refusal::Invalid),
    }
}

/// The error raised for a tensor in device memory.
pub fn device_error(device: &str) -> PyErr {
    PyValueError::new_err(format!(
        "a tensor on device {device:?} cannot be stored by this build: the GPU path of the Python \
         binding is not there yet; copy it to the CPU first (tensor.cpu())"
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
