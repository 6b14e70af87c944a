//! The tensor API's object header: the reference's `TensorMetadata` (304 bytes,
//! little-endian), its checked parse, its encoding and the shards of a tensor.
//!
//! Free of Python (no pyo3) on purpose: the header is read from objects any client
//! may have written, so the integration tests (`tests/tests/tensor_header.rs`,
//! property tests) and the fuzz target `tensor_header` compile this file as it is.

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
    pub(crate) fn from_code(code: i32) -> Option<Self> {
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

    pub(crate) fn from_name(name: &str) -> Option<Self> {
        DTYPES.iter().copied().find(|d| d.name() == name)
    }

    /// Whether numpy itself has no such type.
    pub(crate) fn numpy_lacks(self) -> bool {
        matches!(self, Dtype::Bf16 | Dtype::F8E4M3 | Dtype::F8E5M2)
    }

    /// The numpy type of its raw storage.
    pub(crate) fn storage(self) -> &'static str {
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
