//! CUDA device memory as a [`DeviceMemory`]: `cuMemAlloc` buffers (or memory
//! allocated elsewhere, borrowed), `cuMemHostAlloc` pinned staging, and
//! pooled streams on which `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` run with
//! events as fences.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::{Arc, LazyLock};

use cudarc::driver::{result as cu, sys, CudaContext};
use mooncake_transfer::DmaBuf;
use parking_lot::Mutex;

use super::driver::{cuda_device_count, drv, guarded};
use crate::device::{
    check_range, DeviceMemory, DeviceRange, DeviceStream, Fence, MemoryLocation, PageLockedAlloc, PinnedBuffer,
};
use crate::error::{GpuError, Result};

/// Page-locked host memory from `cuMemHostAlloc` (portable: usable with every
/// context), freed with `cuMemFreeHost`.
struct HostAlloc {
    ctx: Arc<CudaContext>,
    ptr: NonNull<u8>,
}

// SAFETY: the allocation is owned by this value alone (like a `Box<[u8]>`) and
// never read or written through it; `cuMemFreeHost` is valid from any thread (Drop
// binds the context first), and `CudaContext` is itself `Send + Sync`.
unsafe impl Send for HostAlloc {}
// SAFETY: shared access only reads the pointer value.
unsafe impl Sync for HostAlloc {}

impl PageLockedAlloc for HostAlloc {
    fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
}

impl Drop for HostAlloc {
    fn drop(&mut self) {
        let _ = guarded("cuMemFreeHost", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: `ptr` came from cuMemHostAlloc and is freed exactly once;
            // its owner (a PinnedBuffer) is being dropped, and every copy using
            // it was waited for (the DeviceStream contract).
            drv("cuMemFreeHost", unsafe { cu::free_host(self.ptr.as_ptr().cast()) })
        });
    }
}

/// A stream and its spare events, kept by a buffer between uses.
struct StreamSlot {
    stream: sys::CUstream,
    events: Vec<sys::CUevent>,
}

// SAFETY: CUDA stream and event handles are opaque driver handles, valid from
// any thread of the process (the driver API is thread-safe); a slot is used by
// one `CudaCopyStream` at a time (it is taken out of the pool while in use).
unsafe impl Send for StreamSlot {}

/// A device allocation (`cuMemAlloc`, or memory borrowed from elsewhere with
/// [`from_raw`](Self::from_raw)) in one CUDA context. A [`DeviceMemory`]:
/// the store's `get_into_device` / `put_from_device` and the
/// [`GpuTransport`](crate::GpuTransport) copy into it asynchronously through
/// pinned staging buffers.
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Freed on drop (false: borrowed with `from_raw`).
    owned: bool,
    /// Idle copy streams.
    streams: Mutex<Vec<StreamSlot>>,
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ordinal", &self.ordinal)
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}

impl DeviceBuffer {
    /// Wraps a `cuMemAlloc` allocation owned from now on by the buffer.
    pub(super) fn owned(ctx: Arc<CudaContext>, ordinal: usize, ptr: sys::CUdeviceptr, len: usize) -> Self {
        Self { ctx, ordinal, ptr, len, owned: true, streams: Mutex::new(Vec::new()) }
    }

    /// Device `ordinal`'s primary context, retained once per process: a borrowed
    /// buffer (every device pointer the Python binding is handed) and a batched
    /// sum ask for it, and retaining it anew costs driver calls each time.
    pub(super) fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
        static CONTEXTS: LazyLock<Mutex<HashMap<usize, Arc<CudaContext>>>> = LazyLock::new(Default::default);
        if let Some(ctx) = CONTEXTS.lock().get(&ordinal) {
            return Ok(ctx.clone());
        }
        let n = cuda_device_count()?;
        if ordinal >= n {
            return Err(GpuError::InvalidArgument(format!("device {ordinal} requested, {n} present")));
        }
        let ctx = guarded("CudaContext::new", || drv("cuDevicePrimaryCtxRetain", CudaContext::new(ordinal)))?;
        Ok(CONTEXTS.lock().entry(ordinal).or_insert(ctx).clone())
    }

    /// Allocates `bytes` of memory on device `ordinal` (its primary context;
    /// no kernels are compiled). `Err(NoGpu)` without a GPU, never a panic.
    pub fn new(ordinal: usize, bytes: usize) -> Result<Self> {
        let ctx = Self::context(ordinal)?;
        guarded("DeviceBuffer::new", || {
            drv("bind", ctx.bind_to_thread())?;
            // SAFETY: plain device allocation, owned by the returned buffer.
            let ptr = drv("cuMemAlloc", unsafe { cu::malloc_sync(bytes.max(1)) })?;
            Ok(Self::owned(ctx.clone(), ordinal, ptr, bytes))
        })
    }

    /// Borrows `len` bytes of device memory at `ptr` on device `ordinal`,
    /// allocated by someone else (a framework's tensor): not freed on drop.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` must be device memory of `ordinal` (in its primary
    /// context, or mapped into it), live for as long as the returned buffer.
    pub unsafe fn from_raw(ordinal: usize, ptr: u64, len: usize) -> Result<Self> {
        let ctx = Self::context(ordinal)?;
        Ok(Self { ctx, ordinal, ptr, len, owned: false, streams: Mutex::new(Vec::new()) })
    }

    /// Device pointer.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Copies `src` into the start of the buffer with a synchronous
    /// `cuMemcpyHtoD` from pageable memory (the plain `cudaMemcpy` reference).
    pub fn upload(&self, src: &[u8]) -> Result<()> {
        if src.len() > self.len {
            return Err(GpuError::OutOfBounds("upload larger than the buffer".into()));
        }
        guarded("upload", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: `ptr` is a live allocation of `len >= src.len()` bytes.
            drv("cuMemcpyHtoD", unsafe { cu::memcpy_htod_sync(self.ptr, src) })
        })
    }

    /// Copies the start of the buffer into `dst` (synchronous).
    pub fn download(&self, dst: &mut [u8]) -> Result<()> {
        if dst.len() > self.len {
            return Err(GpuError::OutOfBounds("download larger than the buffer".into()));
        }
        guarded("download", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: `ptr` is a live allocation of `len >= dst.len()` bytes.
            drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_sync(dst, self.ptr) })
        })
    }

    fn take_slot(&self) -> Result<StreamSlot> {
        if let Some(s) = self.streams.lock().pop() {
            return Ok(s);
        }
        guarded("cuStreamCreate", || {
            drv("bind", self.ctx.bind_to_thread())?;
            let stream = drv("cuStreamCreate", cu::stream::create(cu::stream::StreamKind::NonBlocking))?;
            Ok(StreamSlot { stream, events: Vec::new() })
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let slots = std::mem::take(&mut *self.streams.lock());
        let (ptr, owned) = (self.ptr, self.owned);
        let _ = guarded("DeviceBuffer::drop", || {
            drv("bind", self.ctx.bind_to_thread())?;
            for s in slots {
                // SAFETY: idle slots have no work in flight (a stream is
                // synchronized before it returns to the pool); each handle is
                // destroyed once.
                unsafe {
                    for e in s.events {
                        let _ = cu::event::destroy(e);
                    }
                    let _ = cu::stream::destroy(s.stream);
                }
            }
            if owned {
                // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once.
                drv("cuMemFree", unsafe { cu::free_sync(ptr) })?;
            }
            Ok(())
        });
    }
}

impl DeviceMemory for DeviceBuffer {
    fn len(&self) -> u64 {
        self.len as u64
    }

    fn location(&self) -> MemoryLocation {
        MemoryLocation::Cuda { ordinal: self.ordinal }
    }

    fn device_ptr(&self) -> u64 {
        self.ptr
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        guarded("cuMemHostAlloc", || {
            drv("bind", self.ctx.bind_to_thread())?;
            // SAFETY: a plain page-locked allocation, owned by the returned
            // HostAlloc (freed once in its Drop); zeroed below before any read.
            let raw = drv("cuMemHostAlloc", unsafe { cu::malloc_host(len.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) })?;
            let ptr = NonNull::new(raw.cast::<u8>())
                .ok_or_else(|| GpuError::Cuda { op: "cuMemHostAlloc", msg: "null pointer".into() })?;
            let alloc = HostAlloc { ctx: self.ctx.clone(), ptr };
            // SAFETY: `ptr` is a fresh allocation of at least `len` bytes.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
            Ok(PinnedBuffer::page_locked(Box::new(alloc), len))
        })
    }

    /// Summed on the device ([`crc32c_each`](Self::crc32c_each) of one range), so
    /// a device get's check costs no second pass of the bytes over PCIe; by
    /// download where the kernels cannot be built (no NVRTC).
    fn crc32c(&self, offset: u64, len: u64) -> Result<u32> {
        Ok(self.crc32c_each(&[(offset, len)])?[0])
    }

    /// Every range in one batch on the device; by download, range by range,
    /// where the kernels cannot be built (no NVRTC).
    fn crc32c_each(&self, ranges: &[(u64, u64)]) -> Result<Vec<u32>> {
        for &(offset, len) in ranges {
            self.check_range(offset, len)?;
        }
        let items: Vec<Vec<(u64, u64)>> = ranges.iter().map(|&(at, n)| vec![(self.ptr + at, n)]).collect();
        match super::checksum::crc32c_each(&self.ctx, self.ordinal, None, &items) {
            Err(e) if super::checksum::unavailable(&e) => {
                ranges.iter().map(|&(at, n)| crate::device::crc32c_by_download(self, at, n)).collect()
            }
            other => other,
        }
    }

    fn device_ranges(&self, offset: u64, len: u64) -> Option<Vec<DeviceRange>> {
        self.check_range(offset, len).ok()?;
        Some(vec![DeviceRange { ordinal: self.ordinal, address: self.ptr + offset, len }])
    }

    fn open_stream(&self) -> Result<Box<dyn DeviceStream + '_>> {
        let slot = self.take_slot()?;
        Ok(Box::new(CudaCopyStream { buf: self, slot: Some(slot), pending: VecDeque::new(), next: 0 }))
    }

    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID` of the allocation holding the buffer
    /// (unique in the process; a borrowed buffer shares its allocation's id).
    fn allocation_id(&self) -> Option<u64> {
        let id = guarded("cuPointerGetAttribute", || {
            drv("bind", self.ctx.bind_to_thread())?;
            let mut id: u64 = 0;
            // SAFETY: BUFFER_ID writes one unsigned long long into `id`; `ptr` is
            // a device pointer of this context.
            let r = unsafe {
                sys::cuPointerGetAttribute(
                    (&mut id as *mut u64).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
                    self.ptr,
                )
            };
            drv("cuPointerGetAttribute", r.result())?;
            Ok(id)
        });
        id.map_err(|e| tracing::debug!(error = %e, "no buffer id: device memory is staged")).ok()
    }

    /// The pages holding the buffer as a dma-buf (`cuMemGetHandleForAddressRange`,
    /// CUDA 11.7+ on a device with `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`), for a
    /// NIC to register with `ibv_reg_dmabuf_mr`. Built, never run here: the
    /// machines this was written on have no GPU.
    fn export_dmabuf(&self) -> Result<DmaBuf> {
        // The range must be whole host pages; cuMemAlloc allocations start on
        // large boundaries, and a range the driver will not export is refused.
        // SAFETY: sysconf has no memory-safety requirement.
        let page = match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
            p if p > 0 => p as u64,
            _ => 4096,
        };
        let start = self.ptr & !(page - 1);
        let end = (self.ptr + self.len.max(1) as u64).next_multiple_of(page);
        guarded("cuMemGetHandleForAddressRange", || {
            drv("bind", self.ctx.bind_to_thread())?;
            let dev = drv("cuDeviceGet", cu::device::get(self.ordinal as i32))?;
            // SAFETY: a plain attribute query of a valid device.
            let supported = drv("cuDeviceGetAttribute", unsafe {
                cu::device::get_attribute(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED)
            })?;
            if supported == 0 {
                return Err(GpuError::Unsupported(format!("CUDA device {} cannot export dma-bufs", self.ordinal)));
            }
            let mut fd: libc::c_int = -1;
            // SAFETY: DMA_BUF_FD writes one int (the new file descriptor) into
            // `fd`; the range lies in memory of this context (page-rounded).
            let r = unsafe {
                sys::cuMemGetHandleForAddressRange(
                    (&mut fd as *mut libc::c_int).cast(),
                    start,
                    (end - start) as usize,
                    sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
                    0,
                )
            };
            drv("cuMemGetHandleForAddressRange", r.result())?;
            if fd < 0 {
                return Err(GpuError::Cuda { op: "cuMemGetHandleForAddressRange", msg: "no file descriptor".into() });
            }
            // SAFETY: the driver just created `fd` for us; nobody else owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            Ok(DmaBuf { fd, offset: 0, len: end - start, iova: start })
        })
    }
}

/// The crc32c of each item of [`DeviceRange`]s (an item's ranges summed one after
/// the other), as one batch on their device: one launch over every range (its
/// table as parameters where it fits), whose last block of each item folds it,
/// one synchronization. Work queued on other streams is not waited for: the
/// caller synchronized what wrote the bytes. `Ok(None)` where
/// it cannot be done so (ranges of several devices, no device ranges at all, no
/// GPU, the kernels cannot be built): the caller sums memory by memory.
pub fn crc32c_of_device_ranges(items: &[Vec<DeviceRange>]) -> Result<Option<Vec<u32>>> {
    let Some(ordinal) = items.iter().flatten().map(|r| r.ordinal).next() else { return Ok(None) };
    if items.iter().flatten().any(|r| r.ordinal != ordinal) {
        return Ok(None);
    }
    let ctx = match DeviceBuffer::context(ordinal) {
        Ok(ctx) => ctx,
        Err(GpuError::NoGpu(_) | GpuError::CudaUnavailable(_)) => return Ok(None),
        Err(e) => return Err(e),
    };
    let ranges: Vec<Vec<(u64, u64)>> = items.iter().map(|i| i.iter().map(|r| (r.address, r.len)).collect()).collect();
    match super::checksum::crc32c_each(&ctx, ordinal, None, &ranges) {
        Ok(sums) => Ok(Some(sums)),
        Err(e) if super::checksum::unavailable(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Copies of one [`DeviceBuffer`] on a pooled CUDA stream; fences are events.
struct CudaCopyStream<'a> {
    buf: &'a DeviceBuffer,
    slot: Option<StreamSlot>,
    /// Recorded events not known complete, oldest first, with their ticket.
    pending: VecDeque<(u64, sys::CUevent)>,
    /// Ticket of the next fence.
    next: u64,
}

// SAFETY: the events are opaque driver handles, valid from any thread of the
// process (the driver API is thread-safe), and every call binds the buffer's
// context to the calling thread first; `DeviceBuffer` is `Sync`, and the slot
// `Send`. `&mut self` keeps the stream to one thread at a time.
unsafe impl Send for CudaCopyStream<'_> {}

impl CudaCopyStream<'_> {
    fn slot(&mut self) -> &mut StreamSlot {
        self.slot.as_mut().expect("present until drop")
    }

    fn stream(&self) -> sys::CUstream {
        self.slot.as_ref().expect("present until drop").stream
    }

    /// All pending events up to `ticket` are complete: recycle them.
    fn retire_upto(&mut self, ticket: u64) {
        while self.pending.front().is_some_and(|(t, _)| *t <= ticket) {
            let (_, e) = self.pending.pop_front().expect("checked");
            self.slot().events.push(e);
        }
    }
}

impl DeviceStream for CudaCopyStream<'_> {
    unsafe fn copy_to_device_async(&mut self, src: *const u8, len: usize, dst_offset: u64) -> Result<()> {
        check_range(self.buf.len as u64, dst_offset, len as u64)?;
        let (dst, stream, ctx) = (self.buf.ptr + dst_offset, self.stream(), &self.buf.ctx);
        guarded("cuMemcpyHtoDAsync", || {
            drv("bind", ctx.bind_to_thread())?;
            // SAFETY: the device range is inside the allocation (checked above);
            // the caller keeps `src..src+len` readable and unchanged until the
            // copy completes (this method's contract).
            drv("cuMemcpyHtoDAsync", unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream).result() })
        })
    }

    unsafe fn copy_from_device_async(&mut self, dst: *mut u8, len: usize, src_offset: u64) -> Result<()> {
        check_range(self.buf.len as u64, src_offset, len as u64)?;
        let (src, stream, ctx) = (self.buf.ptr + src_offset, self.stream(), &self.buf.ctx);
        guarded("cuMemcpyDtoHAsync", || {
            drv("bind", ctx.bind_to_thread())?;
            // SAFETY: the device range is inside the allocation (checked above);
            // the caller keeps `dst..dst+len` writable and untouched until the
            // copy completes (this method's contract).
            drv("cuMemcpyDtoHAsync", unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream).result() })
        })
    }

    fn fence(&mut self) -> Result<Fence> {
        let ctx = self.buf.ctx.clone();
        let stream = self.stream();
        let spare = self.slot().events.pop();
        let event = guarded("cuEventRecord", || {
            drv("bind", ctx.bind_to_thread())?;
            let e = match spare {
                Some(e) => e,
                None => drv("cuEventCreate", cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?,
            };
            // SAFETY: `e` is a live event of this context, `stream` a live
            // stream of this slot.
            drv("cuEventRecord", unsafe { cu::event::record(e, stream) })?;
            Ok(e)
        })?;
        self.next += 1;
        self.pending.push_back((self.next, event));
        Ok(Fence(self.next))
    }

    fn wait(&mut self, fence: Fence) -> Result<()> {
        // The newest pending event at or before the fence covers all older ones.
        let Some(&(ticket, event)) = self.pending.iter().take_while(|(t, _)| *t <= fence.0).last() else {
            return Ok(());
        };
        let ctx = self.buf.ctx.clone();
        guarded("cuEventSynchronize", || {
            drv("bind", ctx.bind_to_thread())?;
            // SAFETY: `event` is a live, recorded event of this stream.
            drv("cuEventSynchronize", unsafe { cu::event::synchronize(event) })
        })?;
        self.retire_upto(ticket);
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        let (ctx, stream) = (self.buf.ctx.clone(), self.stream());
        guarded("cuStreamSynchronize", || {
            drv("bind", ctx.bind_to_thread())?;
            // SAFETY: `stream` is a live stream of this slot.
            drv("cuStreamSynchronize", unsafe { cu::stream::synchronize(stream) })
        })?;
        self.retire_upto(u64::MAX);
        Ok(())
    }

    /// The sums' kernels enqueued on this stream behind the copies, every range
    /// in one batch, and one synchronization for all (the launches are queued
    /// while the copies still run); `None` where the kernels cannot be built (no
    /// NVRTC).
    fn synchronize_and_crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Option<Vec<u32>>> {
        for &(offset, len) in ranges {
            check_range(self.buf.len as u64, offset, len)?;
        }
        let (buf, stream) = (self.buf, self.stream());
        let items: Vec<Vec<(u64, u64)>> = ranges.iter().map(|&(at, n)| vec![(buf.ptr + at, n)]).collect();
        if ranges.iter().all(|&(_, n)| n == 0) {
            self.synchronize()?;
            return Ok(Some(vec![0; ranges.len()]));
        }
        match super::checksum::crc32c_each(&buf.ctx, buf.ordinal, Some(stream), &items) {
            Ok(sums) => {
                self.retire_upto(u64::MAX);
                Ok(Some(sums))
            }
            Err(e) if super::checksum::unavailable(&e) => {
                self.synchronize()?;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

impl Drop for CudaCopyStream<'_> {
    fn drop(&mut self) {
        // Host buffers of outstanding copies must not be freed under the DMA.
        if self.synchronize().is_err() {
            // The stream is in an unknown state: do not reuse it (leak it
            // rather than destroy a stream that may still run).
            tracing::warn!("CUDA copy stream failed to synchronize; dropping it from the pool");
            self.slot = None;
            return;
        }
        if let Some(slot) = self.slot.take() {
            self.buf.streams.lock().push(slot);
        }
    }
}
