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

mod checksum;
mod host;
mod pinned;
mod pool;
mod scatter;
mod stager;

use std::fmt;

use mooncake_transfer::DmaBuf;

#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use checksum::crc32c_by_download;
pub use host::HostDeviceMemory;
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use pinned::PageLockedAlloc;
pub use pinned::PinnedBuffer;
pub use pool::{PinnedPool, PooledBuffer};
pub use scatter::DeviceScatter;
pub use stager::{Stager, DEFAULT_CHUNK, DEFAULT_LANES};

use crate::error::{GpuError, Result};

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

/// A contiguous range of a CUDA device's memory
/// ([`DeviceMemory::device_ranges`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRange {
    /// The device's ordinal.
    pub ordinal: usize,
    /// The device address of the range's first byte.
    pub address: u64,
    /// Its length in bytes.
    pub len: u64,
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
///
/// A stream is `Send`: it may be used from a thread other than the one that
/// opened it, one thread at a time (the store's streamed reads enqueue copies,
/// behind a lock, from the transport's threads as the bytes land).
pub trait DeviceStream: Send {
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

    /// Blocks until every copy enqueued so far has completed, then gives the
    /// crc32c (Castagnoli) of each range `(offset, len)` of the memory: a get's
    /// check of the objects it copied in. An implementation that can chain the
    /// sums behind the copies (CUDA: the sums' kernels on the same stream, all
    /// ranges in one batch) waits once for everything, where
    /// [`synchronize`](Self::synchronize) then [`DeviceMemory::crc32c`] per range
    /// wait once more per range. `Ok(None)` (the default) when it cannot: the
    /// copies are then complete, and the caller sums with
    /// [`DeviceMemory::crc32c`]. `OutOfBounds` (nothing waited for) for a range
    /// outside the memory.
    fn synchronize_and_crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Option<Vec<u32>>> {
        let _ = ranges;
        self.synchronize()?;
        Ok(None)
    }
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

    /// An id of this allocation that the process never gives another one (CUDA's
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`), so that registrations of it with RDMA
    /// NICs can be cached: memory freed and allocated again at the same address
    /// has a new id. `None` (the default) when there is none: the memory is then
    /// never registered with a NIC, and transfers stage through host memory.
    fn allocation_id(&self) -> Option<u64> {
        None
    }

    /// Exports the allocation as a dma-buf, so that an RDMA NIC can register it
    /// and read and write it without host staging: `cuMemGetHandleForAddressRange`
    /// for CUDA memory, the memfd behind [`HostDeviceMemory`] (which only software
    /// NICs import). The dma-buf covers at least `[device_ptr, device_ptr + len)`;
    /// its `iova` is a device address. `Unsupported` (the default) when the
    /// memory cannot be exported.
    fn export_dmabuf(&self) -> Result<DmaBuf> {
        Err(GpuError::Unsupported(format!("{} cannot be exported as a dma-buf", self.location())))
    }

    /// Where `[offset, offset + len)` lives, in order, if it is ranges of CUDA
    /// device memory that the device-side sum reads: then sums over ranges of
    /// several memories of one device run as one batch
    /// ([`crc32c_of_device_ranges`](crate::crc32c_of_device_ranges): a
    /// [`DeviceScatter`]'s per-layer parts, a batch's objects: one launch and one
    /// synchronization for all the ranges, instead of one each). `None` (the
    /// default): the memory sums its own bytes only, with
    /// [`crc32c`](Self::crc32c).
    fn device_ranges(&self, offset: u64, len: u64) -> Option<Vec<DeviceRange>> {
        let _ = (offset, len);
        None
    }

    /// crc32c (Castagnoli) of the `len` bytes at `offset`, to check what a NIC
    /// wrote into the memory or to checksum what it will read. The default copies
    /// them to pinned host buffers in chunks, double-buffered, and sums them on the
    /// CPU (an implementation may sum on the device instead). `OutOfBounds` for a
    /// range outside the allocation.
    fn crc32c(&self, offset: u64, len: u64) -> Result<u32> {
        self.check_range(offset, len)?;
        checksum::crc32c_by_download(self, offset, len)
    }

    /// The crc32c of each range `(offset, len)`: what [`crc32c`](Self::crc32c)
    /// gives each, which an implementation may take in one batch (CUDA memory:
    /// the kernels launched once for all the ranges, one synchronization, where
    /// `crc32c` per range takes a launch and a synchronization each). `OutOfBounds` for a range outside the
    /// allocation.
    fn crc32c_each(&self, ranges: &[(u64, u64)]) -> Result<Vec<u32>> {
        ranges.iter().map(|&(offset, len)| self.crc32c(offset, len)).collect()
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
