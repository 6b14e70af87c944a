//! Device memory as a copy target: asynchronous host <-> device copies through
//! pinned (page-locked) host staging buffers.
//!
//! * [`DeviceMemory`]: one device allocation (or a range of one). It hands out
//!   pinned host buffers ([`DeviceMemory::alloc_pinned`]) and copy streams
//!   ([`DeviceMemory::open_stream`]) on which host -> device and device -> host
//!   copies run asynchronously, ordered, with [`Fence`]s to wait on.
//! * [`HostDeviceMemory`]: plain host memory with the same API, used by tests
//!   and on machines without a GPU. Its streams *defer* every copy until the
//!   stream is waited on, so code that reuses a staging buffer before waiting
//!   for the copy out of it reads wrong bytes in tests, as it would on a GPU.
//! * [`DeviceBuffer`](crate::DeviceBuffer): device memory through
//!   the CUDA driver (`cuMemHostAlloc` staging, `cuMemcpyHtoDAsync` /
//!   `cuMemcpyDtoHAsync` on pooled streams, events as fences).
//! * [`Stager`]: copies any host slice (pageable memory) to or from device
//!   memory in chunks through two (or more) pinned buffers, double-buffered:
//!   while the DMA of chunk *i* runs, the CPU copies chunk *i + 1* into the
//!   other buffer.
//! * [`PinnedPool`]: pinned buffers kept for reuse, by size, with a bound on
//!   idle bytes (pinned memory is expensive to allocate and scarce).
//!
//! ```
//! use mooncake_gpu::{DeviceMemory, HostDeviceMemory, Stager};
//!
//! # fn main() -> mooncake_gpu::Result<()> {
//! let gpu = HostDeviceMemory::new(1 << 20)?;
//! let data: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
//! // 64 KiB chunks, double-buffered.
//! let mut stager = Stager::new(&gpu, 64 << 10, 2)?;
//! stager.upload(&gpu, &data, 4096)?;
//! let mut back = vec![0u8; data.len()];
//! stager.download(&gpu, &mut back, 4096)?;
//! assert_eq!(back, data);
//! // Out-of-bounds ranges are refused, nothing is copied.
//! assert!(stager.upload(&gpu, &data, (1 << 20) - 10).is_err());
//! # Ok(())
//! # }
//! ```

use std::alloc::Layout;
use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;

use parking_lot::{Mutex, RwLock};

use crate::error::{GpuError, Result};

/// Default chunk of a staged copy: the size of each pinned staging buffer.
/// At PCIe 4/5 speeds a 4 MiB DMA takes 80–160 µs, long enough to hide the
/// per-copy driver overhead and short enough to overlap well.
pub const DEFAULT_CHUNK: usize = 4 << 20;

/// Default number of staging buffers of a [`Stager`] (double buffering).
pub const DEFAULT_LANES: usize = 2;

/// Where a [`DeviceMemory`] lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryLocation {
    /// Host memory emulating a device ([`HostDeviceMemory`]).
    Emulated,
    /// Memory of CUDA device `ordinal`.
    Cuda {
        /// The device ordinal.
        ordinal: usize,
    },
}

impl MemoryLocation {
    /// Whether this is host emulation rather than a real device.
    pub fn is_emulated(&self) -> bool {
        matches!(self, MemoryLocation::Emulated)
    }
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLocation::Emulated => f.write_str("host emulation (no GPU)"),
            MemoryLocation::Cuda { ordinal } => write!(f, "CUDA device {ordinal}"),
        }
    }
}

/// Page-locked host memory allocated through a device API (`cuMemHostAlloc`);
/// dropping it frees the memory. (Only a device API makes such memory: a build
/// without one has none.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) trait PageLockedAlloc: Send + Sync {
    /// Start of the allocation.
    fn ptr(&self) -> NonNull<u8>;
}

/// How a [`PinnedBuffer`]'s memory is freed.
enum Backing {
    /// `std::alloc` memory (not page-locked): host emulation.
    Heap(Layout),
    /// Page-locked memory, freed by the allocation's own Drop.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    PageLocked { _alloc: Box<dyn PageLockedAlloc> },
}

/// A host buffer that asynchronous device copies read from or write into:
/// page-locked (`cuMemHostAlloc`) for CUDA memory, so the DMA engine reaches
/// it directly and copies run asynchronously; plain memory in emulation.
/// Zero-filled when allocated. Dereferences to `[u8]`.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: the buffer exclusively owns its allocation (like a `Box<[u8]>`); a
// page-locked allocation is `Send + Sync` itself (its free is valid from any
// thread).
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for PinnedBuffer {}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer").field("len", &self.len).field("page_locked", &self.is_page_locked()).finish()
    }
}

impl PinnedBuffer {
    /// `len` zeroed bytes of ordinary (pageable) host memory: the staging
    /// memory of the host emulation. `len` may be 0.
    pub fn unpinned(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), 64)
            .map_err(|e| GpuError::InvalidArgument(format!("staging buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            GpuError::InvalidArgument(format!("cannot allocate a {len}-byte staging buffer (out of memory)"))
        })?;
        Ok(Self { ptr, len, backing: Backing::Heap(layout) })
    }

    /// Wraps `len` bytes of page-locked memory (zeroed by the caller).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn page_locked(alloc: Box<dyn PageLockedAlloc>, len: usize) -> Self {
        Self { ptr: alloc.ptr(), len, backing: Backing::PageLocked { _alloc: alloc } }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is page-locked (DMA-able without a driver bounce).
    pub fn is_page_locked(&self) -> bool {
        matches!(self.backing, Backing::PageLocked { .. })
    }

    /// Start of the buffer, for [`DeviceStream`] copies.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer, for [`DeviceStream`] copies into it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed at allocation) bytes
        // owned by `self`, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        match &self.backing {
            // SAFETY: allocated in `unpinned` with exactly this layout, freed once.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            // The allocation's own Drop frees the page-locked memory.
            Backing::PageLocked { .. } => {}
        }
    }
}

/// A point in a [`DeviceStream`]'s sequence of copies: waiting on it waits for
/// every copy enqueued before it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence(pub(crate) u64);

/// An ordered queue of asynchronous copies between host memory and one
/// [`DeviceMemory`] (a CUDA stream, or the emulation's deferred queue).
///
/// Copies run in the order enqueued. The host side of a copy is a raw pointer
/// because the copy outlives the call: see the safety contract of
/// [`copy_to_device_async`](Self::copy_to_device_async). The safe entry points
/// built on it are [`Stager`] and [`DeviceMemory::copy_from_host`] /
/// [`DeviceMemory::copy_to_host`].
///
/// Dropping a stream waits for its outstanding copies.
pub trait DeviceStream {
    /// Enqueues a copy of `len` bytes at `src` to `dst_offset` of the device
    /// memory. Returns `OutOfBounds` (and enqueues nothing) if the device range
    /// is outside the memory.
    ///
    /// # Safety
    ///
    /// `src .. src + len` must be valid for reads and must not be written until
    /// this copy has completed: until [`wait`](Self::wait) on a fence taken
    /// after this call, [`synchronize`](Self::synchronize), or the stream's drop
    /// returns. For the copy to be asynchronous on CUDA it should be pinned
    /// memory ([`DeviceMemory::alloc_pinned`]).
    unsafe fn copy_to_device_async(&mut self, src: *const u8, len: usize, dst_offset: u64) -> Result<()>;

    /// Enqueues a copy of `len` bytes at `src_offset` of the device memory into
    /// `dst`. Returns `OutOfBounds` (and enqueues nothing) if the device range
    /// is outside the memory.
    ///
    /// # Safety
    ///
    /// `dst .. dst + len` must be valid for writes and must not be read or
    /// written by anyone else until this copy has completed (as for
    /// [`copy_to_device_async`](Self::copy_to_device_async)).
    unsafe fn copy_from_device_async(&mut self, dst: *mut u8, len: usize, src_offset: u64) -> Result<()>;

    /// A fence after every copy enqueued so far.
    fn fence(&mut self) -> Result<Fence>;

    /// Blocks until every copy enqueued before `fence` was taken has completed.
    fn wait(&mut self, fence: Fence) -> Result<()>;

    /// Blocks until every copy enqueued so far has completed.
    fn synchronize(&mut self) -> Result<()>;
}

/// A device allocation that bytes are copied into and out of through pinned
/// host buffers, asynchronously, on [`DeviceStream`]s.
///
/// Implemented by [`HostDeviceMemory`] (emulation) and
/// [`DeviceBuffer`](crate::DeviceBuffer); implement it for another
/// device API (ROCm, a framework's tensor allocator) and everything built on
/// it ([`Stager`], [`GpuTransport`](crate::GpuTransport), the store's
/// `get_into_device`) works with it.
///
/// Offsets and lengths are bytes from the start of the allocation; every
/// copy is bounds-checked against [`len`](Self::len).
pub trait DeviceMemory: Send + Sync + fmt::Debug {
    /// Size of the allocation in bytes.
    fn len(&self) -> u64;

    /// Whether the allocation has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory lives.
    fn location(&self) -> MemoryLocation;

    /// The allocation's base address in its address space (a CUDA device
    /// pointer; a host address in emulation), for interop and logs.
    fn device_ptr(&self) -> u64;

    /// A zeroed host buffer of `len` bytes that copies of this memory can DMA
    /// from and into (page-locked on a real device).
    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer>;

    /// A copy stream for this memory. Streams may be pooled by the
    /// implementation: opening one is cheap.
    fn open_stream(&self) -> Result<Box<dyn DeviceStream + '_>>;

    /// `Ok` if `[offset, offset + len)` lies inside the allocation, else
    /// `OutOfBounds`.
    fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self.len(), offset, len)
    }

    /// Copies `src` to `offset` (synchronous; staged through pinned buffers
    /// of at most [`DEFAULT_CHUNK`] bytes, double-buffered). Allocates its
    /// staging buffers on every call: for repeated copies keep a [`Stager`].
    fn copy_from_host(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len() as u64)?;
        Stager::new(self, src.len().clamp(1, DEFAULT_CHUNK), DEFAULT_LANES)?.upload(self, src, offset)
    }

    /// Copies `dst.len()` bytes at `offset` into `dst` (synchronous; staged as
    /// in [`copy_from_host`](Self::copy_from_host)).
    fn copy_to_host(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len() as u64)?;
        Stager::new(self, dst.len().clamp(1, DEFAULT_CHUNK), DEFAULT_LANES)?.download(self, dst, offset)
    }
}

/// `Ok` if `[offset, offset + len)` lies inside `0..capacity`.
pub(crate) fn check_range(capacity: u64, offset: u64, len: u64) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity => Ok(()),
        _ => Err(GpuError::OutOfBounds(format!("device range {offset}+{len} outside the {capacity}-byte allocation"))),
    }
}

// ---------------------------------------------------------------------------
// Host emulation
// ---------------------------------------------------------------------------

/// Host memory standing in for a device allocation: the same API as device
/// memory, for tests and for machines without a GPU.
///
/// Its streams defer every copy until the stream is waited on (or dropped),
/// in order, like a device that has not got to them yet: a caller that reads
/// or reuses a staging buffer before waiting for its copy sees wrong bytes.
pub struct HostDeviceMemory {
    data: RwLock<Box<[u8]>>,
    base: u64,
}

impl fmt::Debug for HostDeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostDeviceMemory").field("len", &self.len()).finish()
    }
}

impl HostDeviceMemory {
    /// `len` zeroed bytes of emulated device memory (`len >= 1`).
    pub fn new(len: u64) -> Result<Self> {
        if len == 0 {
            return Err(GpuError::InvalidArgument("device memory of zero bytes".into()));
        }
        let n = usize::try_from(len)
            .map_err(|_| GpuError::InvalidArgument(format!("{len} bytes exceed the address space")))?;
        let data: Box<[u8]> = vec![0u8; n].into_boxed_slice();
        let base = data.as_ptr() as u64;
        Ok(Self { data: RwLock::new(data), base })
    }

    /// A copy of the whole memory (tests: what a kernel would see).
    pub fn to_vec(&self) -> Vec<u8> {
        self.data.read().to_vec()
    }

    /// Runs `f` on the memory's bytes (tests, and a producer "kernel" in the
    /// emulation writing device memory directly).
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        f(&mut self.data.write())
    }
}

impl DeviceMemory for HostDeviceMemory {
    fn len(&self) -> u64 {
        self.data.read().len() as u64
    }

    fn location(&self) -> MemoryLocation {
        MemoryLocation::Emulated
    }

    fn device_ptr(&self) -> u64 {
        self.base
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        PinnedBuffer::unpinned(len)
    }

    fn open_stream(&self) -> Result<Box<dyn DeviceStream + '_>> {
        Ok(Box::new(HostStream { mem: self, queue: VecDeque::new(), enqueued: 0, completed: 0 }))
    }
}

enum HostOp {
    ToDevice { src: *const u8, len: usize, offset: usize },
    FromDevice { dst: *mut u8, len: usize, offset: usize },
}

/// The emulation's stream: a queue of copies run when waited on.
struct HostStream<'a> {
    mem: &'a HostDeviceMemory,
    queue: VecDeque<HostOp>,
    enqueued: u64,
    completed: u64,
}

impl HostStream<'_> {
    fn run_until(&mut self, upto: u64) {
        while self.completed < upto {
            let Some(op) = self.queue.pop_front() else { break };
            match op {
                HostOp::ToDevice { src, len, offset } => {
                    let mut data = self.mem.data.write();
                    // SAFETY: the enqueuer promised `src..src+len` readable and
                    // unchanged until this copy completes (now); the device range
                    // was bounds-checked when enqueued and the memory never resizes.
                    let src = unsafe { std::slice::from_raw_parts(src, len) };
                    data[offset..offset + len].copy_from_slice(src);
                }
                HostOp::FromDevice { dst, len, offset } => {
                    let data = self.mem.data.read();
                    // SAFETY: the enqueuer promised `dst..dst+len` writable and
                    // untouched by anyone else until this copy completes (now).
                    let dst = unsafe { std::slice::from_raw_parts_mut(dst, len) };
                    dst.copy_from_slice(&data[offset..offset + len]);
                }
            }
            self.completed += 1;
        }
    }

    fn device_range(&self, offset: u64, len: usize) -> Result<usize> {
        check_range(self.mem.len(), offset, len as u64)?;
        Ok(offset as usize)
    }
}

impl DeviceStream for HostStream<'_> {
    unsafe fn copy_to_device_async(&mut self, src: *const u8, len: usize, dst_offset: u64) -> Result<()> {
        let offset = self.device_range(dst_offset, len)?;
        self.queue.push_back(HostOp::ToDevice { src, len, offset });
        self.enqueued += 1;
        Ok(())
    }

    unsafe fn copy_from_device_async(&mut self, dst: *mut u8, len: usize, src_offset: u64) -> Result<()> {
        let offset = self.device_range(src_offset, len)?;
        self.queue.push_back(HostOp::FromDevice { dst, len, offset });
        self.enqueued += 1;
        Ok(())
    }

    fn fence(&mut self) -> Result<Fence> {
        Ok(Fence(self.enqueued))
    }

    fn wait(&mut self, fence: Fence) -> Result<()> {
        self.run_until(fence.0.min(self.enqueued));
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.run_until(self.enqueued);
        Ok(())
    }
}

impl Drop for HostStream<'_> {
    fn drop(&mut self) {
        // A device finishes what it was given; so does the emulation.
        self.run_until(self.enqueued);
    }
}

// ---------------------------------------------------------------------------
// Staged (chunked, double-buffered) copies
// ---------------------------------------------------------------------------

/// Copies host slices (any memory) to and from device memory in chunks
/// through pinned staging buffers ("lanes"), overlapping the CPU copy of one
/// chunk with the DMA of the previous one.
///
/// Upload: copy chunk *i* into lane *i mod n*, enqueue its DMA, take a fence;
/// before lane *i mod n* is refilled, wait for the fence of the chunk it held.
/// Download: keep *n* DMAs in flight; wait for chunk *i*'s, copy it out of its
/// lane, enqueue chunk *i + n* into that lane.
///
/// A `Stager` owns its lanes and is reused across copies (allocate once: pinned
/// memory is slow to allocate). It works with any [`DeviceMemory`]; with CUDA
/// memory its lanes should come from a CUDA memory (page-locked).
#[derive(Debug)]
pub struct Stager {
    lanes: Vec<PinnedBuffer>,
    chunk: usize,
}

impl Stager {
    /// `lanes` staging buffers of `chunk` bytes from `mem`
    /// ([`DeviceMemory::alloc_pinned`]). `chunk >= 1`, `lanes >= 1` (2 for
    /// double buffering; 1 serialises CPU copy and DMA).
    pub fn new<M: DeviceMemory + ?Sized>(mem: &M, chunk: usize, lanes: usize) -> Result<Self> {
        if chunk == 0 || lanes == 0 {
            return Err(GpuError::InvalidArgument(format!(
                "a stager needs chunk >= 1 and lanes >= 1 (got chunk {chunk}, lanes {lanes})"
            )));
        }
        let lanes = (0..lanes).map(|_| mem.alloc_pinned(chunk)).collect::<Result<Vec<_>>>()?;
        Ok(Self { lanes, chunk })
    }

    /// Bytes per chunk (per staging buffer).
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// Number of staging buffers.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Whether the staging buffers are page-locked.
    pub fn is_page_locked(&self) -> bool {
        self.lanes.iter().all(PinnedBuffer::is_page_locked)
    }

    /// Copies `src` to `dst_offset` of `mem`; returns when the bytes are in
    /// device memory. `OutOfBounds` (nothing copied) if the range is outside.
    pub fn upload<M: DeviceMemory + ?Sized>(&mut self, mem: &M, src: &[u8], dst_offset: u64) -> Result<()> {
        mem.check_range(dst_offset, src.len() as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        let mut stream = mem.open_stream()?;
        let n = self.lanes.len();
        let mut pending: Vec<Option<Fence>> = vec![None; n];
        for (i, part) in src.chunks(self.chunk).enumerate() {
            let l = i % n;
            if let Some(f) = pending[l].take() {
                stream.wait(f)?;
            }
            let lane = &mut self.lanes[l];
            lane[..part.len()].copy_from_slice(part);
            let off = dst_offset + (i * self.chunk) as u64;
            // SAFETY: the lane is owned by `self`, which `&mut self` keeps
            // untouched by others; it is not written again before its fence is
            // waited (above, next round) or the stream synchronized/dropped
            // (below; the stream is a local dropped before this call returns).
            unsafe { stream.copy_to_device_async(lane.as_ptr(), part.len(), off)? };
            pending[l] = Some(stream.fence()?);
        }
        stream.synchronize()
    }

    /// Copies `dst.len()` bytes at `src_offset` of `mem` into `dst`.
    /// `OutOfBounds` (nothing copied) if the range is outside.
    pub fn download<M: DeviceMemory + ?Sized>(&mut self, mem: &M, dst: &mut [u8], src_offset: u64) -> Result<()> {
        mem.check_range(src_offset, dst.len() as u64)?;
        if dst.is_empty() {
            return Ok(());
        }
        let mut stream = mem.open_stream()?;
        let (n, chunk, total) = (self.lanes.len(), self.chunk, dst.len());
        let chunks = total.div_ceil(chunk);
        let mut pending: Vec<Option<Fence>> = vec![None; n];
        let part = |i: usize| (i * chunk, chunk.min(total - i * chunk));
        let enqueue = |i: usize, lanes: &mut [PinnedBuffer], stream: &mut dyn DeviceStream| -> Result<Fence> {
            let (off, len) = part(i);
            // SAFETY: the lane is owned by `self` (exclusively borrowed); it is
            // not read before this copy's fence is waited on (loop below), and
            // the stream is synchronized when dropped at the end of this call.
            unsafe { stream.copy_from_device_async(lanes[i % n].as_mut_ptr(), len, src_offset + off as u64)? };
            stream.fence()
        };
        for i in 0..n.min(chunks) {
            pending[i % n] = Some(enqueue(i, &mut self.lanes, &mut *stream)?);
        }
        for i in 0..chunks {
            let l = i % n;
            if let Some(f) = pending[l].take() {
                stream.wait(f)?;
            }
            let (off, len) = part(i);
            dst[off..off + len].copy_from_slice(&self.lanes[l][..len]);
            if i + n < chunks {
                pending[l] = Some(enqueue(i + n, &mut self.lanes, &mut *stream)?);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Pool of pinned buffers
// ---------------------------------------------------------------------------

/// Smallest buffer a [`PinnedPool`] allocates.
const MIN_POOLED: usize = 64 << 10;

/// Size a pool allocates for a request of `len` bytes: a power of two from
/// 64 KiB up to 64 MiB, whole MiB beyond (so sizes repeat and buffers get
/// reused, without doubling huge requests).
fn pool_class(len: usize) -> usize {
    if len <= 64 << 20 {
        len.max(MIN_POOLED).next_power_of_two()
    } else {
        len.div_ceil(1 << 20).saturating_mul(1 << 20)
    }
}

/// Pinned buffers kept for reuse (allocating page-locked memory costs
/// milliseconds per MiB; a 64 MiB object must not pay it on every copy).
///
/// [`take`](Self::take) hands out the smallest idle buffer that fits (one
/// that is page-locked when the memory is a real device), or allocates one
/// from the memory; the buffer comes back when the [`PooledBuffer`] drops.
/// At most `max_idle_bytes` stay idle; the oldest go first.
#[derive(Debug)]
pub struct PinnedPool {
    max_idle_bytes: usize,
    idle: Mutex<Vec<PinnedBuffer>>,
}

impl PinnedPool {
    /// A pool keeping at most `max_idle_bytes` of idle buffers.
    pub fn new(max_idle_bytes: usize) -> Self {
        Self { max_idle_bytes, idle: Mutex::new(Vec::new()) }
    }

    /// A buffer of at least `len` bytes suited to copies with `mem` (its
    /// contents are whatever the last user left).
    pub fn take<M: DeviceMemory + ?Sized>(&self, mem: &M, len: usize) -> Result<PooledBuffer<'_>> {
        let need_locked = !mem.location().is_emulated();
        let reused = {
            let mut idle = self.idle.lock();
            idle.iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && (b.is_page_locked() || !need_locked))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i)
                .map(|i| idle.remove(i))
        };
        let buf = match reused {
            Some(b) => b,
            None => mem.alloc_pinned(pool_class(len))?,
        };
        Ok(PooledBuffer { buf: Some(buf), pool: self })
    }

    /// Bytes of idle buffers held now.
    pub fn idle_bytes(&self) -> usize {
        self.idle.lock().iter().map(|b| b.len()).sum()
    }

    /// Frees every idle buffer.
    pub fn clear(&self) {
        let freed = std::mem::take(&mut *self.idle.lock());
        drop(freed);
    }

    fn give_back(&self, buf: PinnedBuffer) {
        if buf.len() > self.max_idle_bytes {
            return;
        }
        let mut evicted = Vec::new();
        {
            let mut idle = self.idle.lock();
            let mut total: usize = idle.iter().map(|b| b.len()).sum::<usize>() + buf.len();
            while total > self.max_idle_bytes && !idle.is_empty() {
                let old = idle.remove(0);
                total -= old.len();
                evicted.push(old);
            }
            idle.push(buf);
        }
        // Freed outside the lock (cuMemFreeHost is slow).
        drop(evicted);
    }
}

/// A buffer lent by a [`PinnedPool`]; goes back to it on drop.
#[derive(Debug)]
pub struct PooledBuffer<'a> {
    buf: Option<PinnedBuffer>,
    pool: &'a PinnedPool,
}

impl std::ops::Deref for PooledBuffer<'_> {
    type Target = PinnedBuffer;
    fn deref(&self) -> &PinnedBuffer {
        self.buf.as_ref().expect("present until drop")
    }
}

impl std::ops::DerefMut for PooledBuffer<'_> {
    fn deref_mut(&mut self) -> &mut PinnedBuffer {
        self.buf.as_mut().expect("present until drop")
    }
}

impl Drop for PooledBuffer<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_streams_defer_copies_until_waited() {
        let mem = HostDeviceMemory::new(16).unwrap();
        let mut src = PinnedBuffer::unpinned(4).unwrap();
        src.copy_from_slice(&[1, 2, 3, 4]);
        let mut s = mem.open_stream().unwrap();
        // SAFETY: `src` lives until after the synchronize below and is only
        // written before the fence is waited on to show the deferral.
        unsafe { s.copy_to_device_async(src.as_ptr(), 4, 8).unwrap() };
        let f = s.fence().unwrap();
        assert_eq!(mem.to_vec()[8..12], [0, 0, 0, 0], "not copied before the wait");
        s.wait(f).unwrap();
        assert_eq!(mem.to_vec()[8..12], [1, 2, 3, 4]);
        // Out of bounds: refused, nothing enqueued.
        // SAFETY: nothing is enqueued (the call fails on the bounds check).
        let r = unsafe { s.copy_to_device_async(src.as_ptr(), 4, 13) };
        assert!(matches!(r, Err(GpuError::OutOfBounds(_))));
        s.synchronize().unwrap();
        assert_eq!(mem.to_vec()[12..], [0, 0, 0, 0]);
    }

    #[test]
    fn pool_classes_and_reuse() {
        assert_eq!(pool_class(1), 64 << 10);
        assert_eq!(pool_class((64 << 10) + 1), 128 << 10);
        assert_eq!(pool_class(64 << 20), 64 << 20);
        assert_eq!(pool_class((64 << 20) + 1), (64 << 20) + (1 << 20));
        let mem = HostDeviceMemory::new(1).unwrap();
        let pool = PinnedPool::new(1 << 20);
        let p = pool.take(&mem, 100_000).unwrap().as_ptr();
        assert_eq!(pool.idle_bytes(), 128 << 10);
        // The same buffer serves a smaller request.
        assert_eq!(pool.take(&mem, 10).unwrap().as_ptr(), p);
        // Two at once: the second is fresh; both come back within the bound.
        let (a, b) = (pool.take(&mem, 100_000).unwrap(), pool.take(&mem, 100_000).unwrap());
        assert_ne!(a.as_ptr(), b.as_ptr());
        drop((a, b));
        assert_eq!(pool.idle_bytes(), 256 << 10);
        // Larger than the bound: not kept.
        drop(pool.take(&mem, 2 << 20).unwrap());
        assert_eq!(pool.idle_bytes(), 256 << 10);
        // Fill past the bound: the oldest go.
        let held: Vec<_> = (0..9).map(|_| pool.take(&mem, 100_000).unwrap()).collect();
        drop(held);
        assert!(pool.idle_bytes() <= 1 << 20);
        pool.clear();
        assert_eq!(pool.idle_bytes(), 0);
    }
}
