//! The CUDA entry points of a build without the `cuda` feature: the same types
//! and functions as with it, so that code using them compiles either way, but no
//! device heap or buffer can be made — every constructor returns
//! [`GpuError::NoGpu`], so no method of theirs can ever run.

use std::sync::atomic::Ordering;

use super::ipc::IpcHeapHandle;
use crate::cache::{ObjMeta, WritePlan};
use crate::device::{DeviceMemory, DeviceStream, MemoryLocation, PinnedBuffer};
use crate::error::{GpuError, Result};
use crate::header::{HeaderSnapshot, HeaderU32Field, HeaderU64Field};
use crate::heap::{DeviceHeap, PageSpan};
use crate::key::KeyId;

/// Why no CUDA call can succeed in this build.
fn not_built() -> GpuError {
    GpuError::NoGpu("no libcuda support: mooncake-gpu was built without the `cuda` feature".into())
}

/// No value of this type exists: it makes the CUDA types below impossible to
/// construct.
#[derive(Debug)]
enum Never {}

/// Number of CUDA devices: always [`GpuError::NoGpu`] in a build without the
/// `cuda` feature.
pub fn cuda_device_count() -> Result<usize> {
    Err(not_built())
}

/// Whether a CUDA device can be used in this process: never in a build without
/// the `cuda` feature.
pub fn cuda_available() -> bool {
    false
}

/// The crc32c of each item of device ranges, in one batch on their device: in
/// a build without the `cuda` feature never (`Ok(None)`: the caller sums memory
/// by memory).
pub fn crc32c_of_device_ranges(items: &[Vec<crate::DeviceRange>]) -> Result<Option<Vec<u32>>> {
    let _ = items;
    Ok(None)
}

/// No device memory is known in a build without the `cuda` feature.
pub(crate) fn device_allocation(ptr: u64) -> Option<crate::pointer::DeviceAllocation> {
    let _ = ptr;
    None
}

/// No driver to ask in a build without the `cuda` feature: not device memory.
pub(crate) fn classify_pointer(ptr: u64) -> Result<Option<crate::pointer::DeviceAllocation>> {
    let _ = ptr;
    Ok(None)
}

/// No driver in this build: no current context to keep.
pub(crate) fn current_context() -> Option<usize> {
    None
}

/// Never called in this build (there is no context to restore).
pub(crate) fn set_current_context(ctx: usize) {
    let _ = ctx;
}

/// Page-locking host memory: [`GpuError::NoGpu`] in this build.
///
/// # Safety
///
/// None needed (nothing is done); the signature is the CUDA build's.
pub(crate) unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<()> {
    let _ = (ptr, len);
    Err(not_built())
}

/// Nothing was page-locked in this build.
pub(crate) fn host_unregister(ptr: *mut u8) -> Result<()> {
    let _ = ptr;
    Err(not_built())
}

/// Whether the NVRTC library can be loaded: never in a build without the
/// `cuda` feature.
pub fn nvrtc_available() -> bool {
    false
}

/// A device allocation on a CUDA device. A build without the `cuda` feature
/// cannot make one: [`new`](Self::new) and [`from_raw`](Self::from_raw) return
/// [`GpuError::NoGpu`].
#[derive(Debug)]
pub struct DeviceBuffer {
    never: Never,
}

impl DeviceBuffer {
    /// Allocates `bytes` of memory on device `ordinal`: [`GpuError::NoGpu`] in
    /// this build.
    pub fn new(ordinal: usize, bytes: usize) -> Result<Self> {
        let _ = (ordinal, bytes);
        Err(not_built())
    }

    /// Borrows device memory allocated by someone else: [`GpuError::NoGpu`] in
    /// this build.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` must be device memory of `ordinal`, live for as long
    /// as the returned buffer (the contract of the CUDA build).
    pub unsafe fn from_raw(ordinal: usize, ptr: u64, len: usize) -> Result<Self> {
        let _ = (ordinal, ptr, len);
        Err(not_built())
    }

    /// Device pointer.
    pub fn ptr(&self) -> u64 {
        match self.never {}
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// Copies `src` into the start of the buffer (synchronous).
    pub fn upload(&self, src: &[u8]) -> Result<()> {
        let _ = src;
        match self.never {}
    }

    /// Copies the start of the buffer into `dst` (synchronous).
    pub fn download(&self, dst: &mut [u8]) -> Result<()> {
        let _ = dst;
        match self.never {}
    }
}

impl DeviceMemory for DeviceBuffer {
    fn len(&self) -> u64 {
        match self.never {}
    }

    fn location(&self) -> MemoryLocation {
        match self.never {}
    }

    fn device_ptr(&self) -> u64 {
        match self.never {}
    }

    fn alloc_pinned(&self, _len: usize) -> Result<PinnedBuffer> {
        match self.never {}
    }

    fn open_stream(&self) -> Result<Box<dyn DeviceStream + '_>> {
        match self.never {}
    }
}

/// A device heap in GPU memory. A build without the `cuda` feature cannot make
/// one: [`new`](Self::new) and [`open_ipc`](Self::open_ipc) return
/// [`GpuError::NoGpu`] (after the same argument checks as the CUDA build).
#[derive(Debug)]
pub struct CudaDeviceHeap {
    never: Never,
}

impl CudaDeviceHeap {
    /// Allocates a heap of `header_slots` headers and a `payload_bytes` arena
    /// on device `ordinal`: `InvalidArgument` for an empty heap, else
    /// [`GpuError::NoGpu`] in this build.
    pub fn new(ordinal: usize, header_slots: u32, payload_bytes: u64) -> Result<Self> {
        let _ = ordinal;
        if header_slots == 0 || payload_bytes == 0 {
            return Err(GpuError::InvalidArgument("a heap needs at least one header slot and one payload byte".into()));
        }
        Err(not_built())
    }

    /// Opens an owner heap exported by another process: [`GpuError::NoGpu`] in
    /// this build.
    pub fn open_ipc(ordinal: usize, handle: &IpcHeapHandle) -> Result<Self> {
        let _ = (ordinal, handle);
        Err(not_built())
    }

    /// Exports the heap for [`open_ipc`](Self::open_ipc) in another process.
    pub fn export_ipc(&self) -> Result<IpcHeapHandle> {
        match self.never {}
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// Whether this heap was opened through CUDA IPC (memory owned elsewhere).
    pub fn is_imported(&self) -> bool {
        match self.never {}
    }

    /// Producer path: pushes pages of `plan` from the device buffer `src` and
    /// publishes the object if `publish`.
    pub fn push_from_device(
        &self,
        plan: &WritePlan,
        src: u64,
        first_page: u32,
        n_pages: u32,
        publish: bool,
        now_ns: u64,
    ) -> Result<()> {
        let _ = (plan, src, first_page, n_pages, publish, now_ns);
        match self.never {}
    }

    /// Reader path: copies the object at `meta` into the device buffer `dst`;
    /// returns the object size.
    pub fn read_into_device(&self, meta: &ObjMeta, key: &KeyId, dst: u64, dst_cap: u64) -> Result<u64> {
        let _ = (meta, key, dst, dst_cap);
        match self.never {}
    }

    /// Allocates a device buffer of `bytes` in this heap's context.
    pub fn alloc_buffer(&self, bytes: usize) -> Result<DeviceBuffer> {
        let _ = bytes;
        match self.never {}
    }

    /// `cuMemcpyDtoD` of `len` bytes on the heap's stream, synchronous.
    pub fn memcpy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<()> {
        let _ = (dst, src, len);
        match self.never {}
    }
}

impl DeviceHeap for CudaDeviceHeap {
    fn header_slots(&self) -> u32 {
        match self.never {}
    }

    fn payload_capacity(&self) -> u64 {
        match self.never {}
    }

    fn header_addr(&self, _slot: u32) -> u64 {
        match self.never {}
    }

    fn payload_addr(&self, _offset: u64) -> u64 {
        match self.never {}
    }

    fn device_ordinal(&self) -> Option<usize> {
        match self.never {}
    }

    fn read_header(&self, _slot: u32) -> Result<HeaderSnapshot> {
        match self.never {}
    }

    fn write_header(&self, _slot: u32, _h: &HeaderSnapshot) -> Result<()> {
        match self.never {}
    }

    fn load_u32(&self, _slot: u32, _f: HeaderU32Field, _order: Ordering) -> Result<u32> {
        match self.never {}
    }

    fn store_u32(&self, _slot: u32, _f: HeaderU32Field, _v: u32, _order: Ordering) -> Result<()> {
        match self.never {}
    }

    fn compare_exchange_u32(
        &self,
        _slot: u32,
        _f: HeaderU32Field,
        _current: u32,
        _new: u32,
    ) -> Result<std::result::Result<u32, u32>> {
        match self.never {}
    }

    fn fetch_add_u32(&self, _slot: u32, _f: HeaderU32Field, _delta: i32) -> Result<u32> {
        match self.never {}
    }

    fn load_u64(&self, _slot: u32, _f: HeaderU64Field, _order: Ordering) -> Result<u64> {
        match self.never {}
    }

    fn store_u64(&self, _slot: u32, _f: HeaderU64Field, _v: u64, _order: Ordering) -> Result<()> {
        match self.never {}
    }

    fn write_pages(&self, _span: &PageSpan, _first_page: u32, _src: &[u8]) -> Result<u32> {
        match self.never {}
    }

    fn read_pages(&self, _span: &PageSpan, _first_page: u32, _dst: &mut [u8]) -> Result<u32> {
        match self.never {}
    }
}
