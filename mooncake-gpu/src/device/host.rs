//! [`HostDeviceMemory`]: host memory standing in for a device allocation, with
//! streams that defer their copies like a device would (or run them at once, to
//! catch the opposite mistake), exportable as a "dma-buf"
//! (its memfd) that software RDMA NICs import.

use std::collections::VecDeque;
use std::fmt;
use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;
use mooncake_transfer::DmaBuf;
use parking_lot::RwLock;

use super::{check_range, DeviceMemory, DeviceRange, DeviceStream, Fence, MemoryLocation, PinnedBuffer};
use crate::error::{GpuError, Result};

/// Allocation ids of emulated memory: the top bit set, so they never meet the
/// small ids a CUDA driver hands out in the same process.
static NEXT_ID: AtomicU64 = AtomicU64::new(1 << 63);

const PAGE: u64 = 4096;

/// Host memory standing in for a device allocation: the same API as device
/// memory, for tests and for machines without a GPU.
///
/// Its streams defer every copy until the stream is waited on (or dropped),
/// in order, like a device that has not got to them yet: a caller that reads
/// or reuses a staging buffer before waiting for its copy sees wrong bytes.
///
/// The bytes live in a memfd, which [`export_dmabuf`](DeviceMemory::export_dmabuf)
/// hands out as the allocation's "dma-buf": a software RDMA NIC
/// (`mooncake_transfer::SoftRdma`) imports it by mapping it and then reads and
/// writes the memory itself, as a NIC does GPU memory, by device address, never
/// through this value (so without its lock: bytes read while a NIC writes them are
/// unspecified, as on a GPU). A real NIC refuses it (it is no dma-buf).
pub struct HostDeviceMemory {
    data: RwLock<Backing>,
    len: u64,
    base: u64,
    /// The memfd behind `data`, if one could be made (else anonymous memory,
    /// which cannot be exported).
    file: Option<File>,
    id: u64,
    /// Copies run when enqueued ([`with_copies_at_enqueue`](Self::with_copies_at_enqueue)).
    at_enqueue: bool,
    /// The device its ranges say they are on ([`with_device_ranges`](Self::with_device_ranges)).
    device: Option<usize>,
    /// Copies its streams ran.
    copies: AtomicU64,
    /// Sums its streams took behind their copies.
    chained_sums: AtomicU64,
}

impl fmt::Debug for HostDeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostDeviceMemory").field("len", &self.len()).finish()
    }
}

/// The bytes behind a [`HostDeviceMemory`].
enum Backing {
    /// Memory it mapped and owns.
    Mapped(MmapMut),
    /// Host memory someone else owns ([`HostDeviceMemory::borrowed`]).
    Borrowed { ptr: *mut u8, len: usize },
}

// SAFETY: a borrowed range is memory its lender keeps valid for the value's life
// (the contract of `HostDeviceMemory::borrowed`), reached only through the lock
// around the backing, like the owned mapping.
unsafe impl Send for Backing {}
// SAFETY: as for `Send`: shared access goes through the `RwLock`.
unsafe impl Sync for Backing {}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            // SAFETY: `borrowed`'s caller keeps `ptr..ptr + len` valid and unused
            // by anyone else while this value lives.
            Backing::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }
}

impl std::ops::DerefMut for Backing {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Backing::Mapped(m) => m,
            // SAFETY: as in `deref`; `&mut self` is the lock's write guard.
            Backing::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts_mut(*ptr, *len) },
        }
    }
}

impl HostDeviceMemory {
    /// Host memory owned by someone else, `[ptr, ptr + len)`, standing in for a
    /// range of device memory (the emulation of a framework's GPU tensor that a
    /// caller hands over by address): its streams defer copies exactly as
    /// [`new`](Self::new)'s do. It cannot be exported as a dma-buf.
    ///
    /// # Safety
    ///
    /// `ptr .. ptr + len` must be valid for reads and writes for as long as the
    /// returned value lives, and not be accessed by anyone else while one of its
    /// copies runs (as device memory would not be).
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Result<Self> {
        if len == 0 || ptr.is_null() {
            return Err(GpuError::InvalidArgument("borrowed device memory must be a non-empty range".into()));
        }
        (ptr as usize)
            .checked_add(len)
            .ok_or_else(|| GpuError::InvalidArgument("borrowed range wraps the address space".into()))?;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            data: RwLock::new(Backing::Borrowed { ptr, len }),
            len: len as u64,
            base: ptr as u64,
            file: None,
            id,
            at_enqueue: false,
            device: None,
            copies: AtomicU64::new(0),
            chained_sums: AtomicU64::new(0),
        })
    }

    /// `len` zeroed bytes of emulated device memory (`len >= 1`).
    pub fn new(len: u64) -> Result<Self> {
        if len == 0 {
            return Err(GpuError::InvalidArgument("device memory of zero bytes".into()));
        }
        let too_large = || GpuError::InvalidArgument(format!("{len} bytes exceed the address space"));
        let mapped =
            usize::try_from(len.checked_next_multiple_of(PAGE).ok_or_else(too_large)?).map_err(|_| too_large())?;
        let file = memfd(mapped);
        let data = match &file {
            // SAFETY: the memfd is private to this value (and to the NICs it is
            // exported to, which only DMA into it, as a device's NICs do).
            Some(f) => unsafe { MmapMut::map_mut(f) },
            None => MmapMut::map_anon(mapped),
        }
        .map_err(|e| GpuError::InvalidArgument(format!("cannot map {len} bytes of emulated device memory: {e}")))?;
        let base = data.as_ptr() as u64;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            data: RwLock::new(Backing::Mapped(data)),
            len,
            base,
            file,
            id,
            at_enqueue: false,
            device: None,
            copies: AtomicU64::new(0),
            chained_sums: AtomicU64::new(0),
        })
    }

    /// This memory, saying that its ranges are device memory of device `ordinal`
    /// ([`DeviceMemory::device_ranges`]), as CUDA memory does: to test what callers
    /// do with device ranges. Its bytes stay in host memory, so the device sum
    /// declines them ([`crc32c_of_device_ranges`](crate::crc32c_of_device_ranges)
    /// finds no such device here) and they are summed as before.
    pub fn with_device_ranges(mut self, ordinal: usize) -> Self {
        self.device = Some(ordinal);
        self
    }

    /// This memory, with streams that run each copy when it is enqueued, like a
    /// copy engine that starts at once: a copy enqueued before its source holds the
    /// bytes (a caller that passes a staging range on too early) gives wrong bytes.
    /// The default streams catch the other mistake: reusing a source before the
    /// copy was waited for.
    pub fn with_copies_at_enqueue(mut self) -> Self {
        self.at_enqueue = true;
        self
    }

    /// How many copies its streams have run.
    pub fn copies_run(&self) -> u64 {
        self.copies.load(Ordering::Relaxed)
    }

    /// How many ranges its streams summed behind their copies
    /// ([`DeviceStream::synchronize_and_crc32c`]).
    pub fn chained_sums(&self) -> u64 {
        self.chained_sums.load(Ordering::Relaxed)
    }

    /// A copy of the whole memory (tests: what a kernel would see).
    pub fn to_vec(&self) -> Vec<u8> {
        self.data.read()[..self.len as usize].to_vec()
    }

    /// Runs `f` on the memory's bytes (tests, and a producer "kernel" in the
    /// emulation writing device memory directly).
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        f(&mut self.data.write()[..self.len as usize])
    }
}

/// A memfd of `len` bytes, or `None` if the kernel does not make one.
fn memfd(len: usize) -> Option<File> {
    // SAFETY: the name is a NUL-terminated string; memfd_create has no other
    // memory-safety requirement.
    let fd = unsafe { libc::memfd_create(c"mooncake-emulated-device".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    file.set_len(len as u64).ok()?;
    Some(file)
}

impl DeviceMemory for HostDeviceMemory {
    fn len(&self) -> u64 {
        self.len
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

    fn allocation_id(&self) -> Option<u64> {
        Some(self.id)
    }

    fn device_ranges(&self, offset: u64, len: u64) -> Option<Vec<DeviceRange>> {
        let ordinal = self.device?;
        self.check_range(offset, len).ok()?;
        Some(vec![DeviceRange { ordinal, address: self.base + offset, len }])
    }

    fn export_dmabuf(&self) -> Result<DmaBuf> {
        let file = self
            .file
            .as_ref()
            .ok_or_else(|| GpuError::Unsupported("emulated device memory without a memfd cannot be exported".into()))?;
        let fd = file.try_clone().map_err(|e| GpuError::Unsupported(format!("duplicating the memfd: {e}")))?;
        let len = self.data.read().len() as u64;
        Ok(DmaBuf { fd: fd.into(), offset: 0, len, iova: self.base })
    }
}

enum HostOp {
    ToDevice { src: *const u8, len: usize, offset: usize },
    FromDevice { dst: *mut u8, len: usize, offset: usize },
}

// SAFETY: the pointers are host memory the enqueuer promised valid (and left
// alone) until the copy completes, whichever thread runs it (the stream's
// contract, `DeviceStream::copy_to_device_async`); nothing here is tied to a
// thread.
unsafe impl Send for HostOp {}

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
            self.mem.copies.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Runs what was enqueued, on memory that copies at once.
    fn run_if_at_enqueue(&mut self) {
        if self.mem.at_enqueue {
            self.run_until(self.enqueued);
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
        self.run_if_at_enqueue();
        Ok(())
    }

    unsafe fn copy_from_device_async(&mut self, dst: *mut u8, len: usize, src_offset: u64) -> Result<()> {
        let offset = self.device_range(src_offset, len)?;
        self.queue.push_back(HostOp::FromDevice { dst, len, offset });
        self.enqueued += 1;
        self.run_if_at_enqueue();
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

    /// The sum of the memory's bytes once every copy ran, as a device that
    /// chains the sum behind the copies gives it.
    fn synchronize_and_crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Option<Vec<u32>>> {
        for &(offset, len) in ranges {
            check_range(self.mem.len(), offset, len)?;
        }
        self.run_until(self.enqueued);
        self.mem.chained_sums.fetch_add(ranges.len() as u64, Ordering::Relaxed);
        let data = self.mem.data.read();
        Ok(Some(ranges.iter().map(|&(at, n)| crc32c::crc32c(&data[at as usize..(at + n) as usize])).collect()))
    }
}

impl Drop for HostStream<'_> {
    fn drop(&mut self) {
        // A device finishes what it was given; so does the emulation.
        self.run_until(self.enqueued);
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
        assert_eq!(mem.copies_run(), 1);
    }

    #[test]
    fn a_chained_sum_covers_the_copies_enqueued_before_it() {
        let mem = HostDeviceMemory::new(64).unwrap();
        let mut src = PinnedBuffer::unpinned(8).unwrap();
        src.copy_from_slice(b"kv-block");
        let mut s = mem.open_stream().unwrap();
        // SAFETY: `src` lives, unchanged, until the sum below ran the copy.
        unsafe { s.copy_to_device_async(src.as_ptr(), 8, 16).unwrap() };
        let want = [crc32c::crc32c(b"kv-block"), crc32c::crc32c(b"block"), 0];
        assert_eq!(s.synchronize_and_crc32c(&[(16, 8), (19, 5), (0, 0)]).unwrap(), Some(want.to_vec()));
        assert_eq!((mem.copies_run(), mem.chained_sums()), (1, 3));
        assert_eq!(mem.crc32c(16, 8).unwrap(), crc32c::crc32c(b"kv-block"), "the same as the sum by download");
        assert!(matches!(s.synchronize_and_crc32c(&[(0, 8), (60, 8)]), Err(GpuError::OutOfBounds(_))));
        assert_eq!(mem.chained_sums(), 3, "nothing is summed when a range is refused");
    }

    #[test]
    fn streams_of_memory_that_copies_at_enqueue_read_the_source_at_once() {
        let mem = HostDeviceMemory::new(16).unwrap().with_copies_at_enqueue();
        let mut src = PinnedBuffer::unpinned(4).unwrap();
        src.copy_from_slice(&[1, 2, 3, 4]);
        let mut s = mem.open_stream().unwrap();
        // SAFETY: `src` lives past the copy, which runs inside this call.
        unsafe { s.copy_to_device_async(src.as_ptr(), 4, 0).unwrap() };
        // Written after the enqueue: a device that started at once never sees it.
        src.copy_from_slice(&[9, 9, 9, 9]);
        s.synchronize().unwrap();
        assert_eq!(mem.to_vec()[..4], [1, 2, 3, 4]);
        let mut back = PinnedBuffer::unpinned(4).unwrap();
        // SAFETY: `back` lives past the copy, which runs inside this call.
        unsafe { s.copy_from_device_async(back.as_mut_ptr(), 4, 0).unwrap() };
        assert_eq!(back[..], [1, 2, 3, 4], "copied before any wait");
        assert_eq!(mem.copies_run(), 2);
    }
}
