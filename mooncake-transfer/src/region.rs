//! Registered memory: the regions an engine serves to its peers.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, TransferError};

const PAGE: u64 = 4096;

/// Bytes of a shared region's memfd: the data rounded up to a page, then one page
/// whose first word says whether the owner revoked sharing (peers can't touch it:
/// requests are bounds-checked against the data length).
pub(crate) fn shared_file_len(len: u64) -> Result<u64> {
    len.checked_next_multiple_of(PAGE)
        .and_then(|l| l.checked_add(PAGE))
        .ok_or_else(|| TransferError::Registration(format!("{len} bytes exceed the address space")))
}

/// Identifier of a region inside one engine. Ids are never reused by an engine, so a
/// stale id can never address a newer region.
pub type RegionId = u64;

/// Where a region lives, as a peer names it: the serving engine's endpoint and the
/// region's id there. This is what the master hands out in replica descriptors.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Endpoint of the serving engine (`local://…`, later `host:port`).
    pub endpoint: String,
    /// Region id at that endpoint.
    pub region: RegionId,
}

/// A block of memory owned by an engine and reachable by its peers.
///
/// The memory is an anonymous private mapping: pages are committed on first touch,
/// so a 4 GiB segment costs nothing until it is written.
pub struct RegisteredRegion {
    id: RegionId,
    len: u64,
    ptr: *mut u8,
    // Keeps the mapping alive; accessed only through `ptr`.
    map: Mapping,
    /// Whether peers may write the region (see
    /// [`peers_may_write`](Self::peers_may_write)).
    peers_write: bool,
    /// Shared regions: the revocation word in the page after the data (see
    /// [`shared_file_len`]); nonzero once the owner stopped sharing.
    revoked: Option<*mut u64>,
    /// The memfd behind a shared region (peers on the host map it), until sharing is
    /// revoked (the region is unregistered or its engine dropped): closing it makes
    /// peers' cached mappings stale, so they stop using them.
    memfd: parking_lot::Mutex<Option<std::fs::File>>,
}

/// The memory behind a region: a writable mapping (this process's own memory, or a
/// peer's region that peers may write), or a peer's region mapped read-only (its
/// owner sealed it against peers' writes: `RegisteredRegion::new_shared`).
/// Held only to keep the mapping alive (accessed through `ptr`).
#[allow(dead_code)]
enum Mapping {
    Writable(memmap2::MmapMut),
    ReadOnly(memmap2::Mmap),
}

// SAFETY: the region is plain memory; all access goes through `copy_in`/`copy_out`,
// which copy bytes with raw pointers. Concurrent users write disjoint ranges (the
// master's allocator hands out each range to one writer), and a reader of a range that
// was freed and reused meanwhile can only observe torn bytes, which the store's
// checksum rejects. No references into the region are ever handed out; the only
// slices made over it live for one bounds-checked socket read or write.
unsafe impl Send for RegisteredRegion {}
// SAFETY: see `Send`; shared access only copies bytes through raw pointers.
unsafe impl Sync for RegisteredRegion {}

impl std::fmt::Debug for RegisteredRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredRegion")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("peers_write", &self.peers_write)
            .finish()
    }
}

impl RegisteredRegion {
    /// `len` bytes of fresh zeroed memory; `peers_write`: whether peers may write it.
    pub(crate) fn new(id: RegionId, len: u64, peers_write: bool) -> Result<Self> {
        if len == 0 {
            return Err(TransferError::Registration("region of zero bytes".into()));
        }
        let len_usize = usize::try_from(len)
            .map_err(|_| TransferError::Registration(format!("{len} bytes exceed the address space")))?;
        let mut map = memmap2::MmapOptions::new()
            .len(len_usize)
            .map_anon()
            .map_err(|e| TransferError::Registration(format!("mmap of {len} bytes: {e}")))?;
        let ptr = map.as_mut_ptr();
        Ok(Self {
            id,
            len,
            ptr,
            map: Mapping::Writable(map),
            peers_write,
            revoked: None,
            memfd: parking_lot::Mutex::new(None),
        })
    }

    /// A region backed by a `memfd`, so that processes on the same host can map it.
    /// Without `peers_write`, the memfd is also sealed against writes from any
    /// mapping made after this process's own (`F_SEAL_FUTURE_WRITE`): peers can only
    /// map it read-only. A kernel without that seal (before Linux 5.1) keeps such a
    /// region to itself: peers reach it through the engine, which refuses their
    /// writes.
    pub(crate) fn new_shared(id: RegionId, len: u64, peers_write: bool) -> Result<Self> {
        if len == 0 {
            return Err(TransferError::Registration("region of zero bytes".into()));
        }
        let name = std::ffi::CString::new(format!("mooncake-region-{id}")).expect("no NUL in the name");
        // SAFETY: `name` is a valid NUL-terminated string; memfd_create has no other
        // preconditions and returns a new descriptor or -1.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(TransferError::Registration(format!("memfd_create: {}", std::io::Error::last_os_error())));
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        file.set_len(shared_file_len(len)?)
            .map_err(|e| TransferError::Registration(format!("memfd of {len} bytes: {e}")))?;
        // This process's own mapping comes before the seals: a write seal forbids
        // writable mappings made after it.
        let mut region = Self::map_file(id, &file, len, false, true)?;
        region.peers_write = peers_write;
        // Seal the size: nobody (a peer that opened it through /proc included) can
        // shrink it under a mapping, which would turn accesses into SIGBUS.
        let seal = |extra: i32| {
            // SAFETY: `file` owns a valid memfd created with MFD_ALLOW_SEALING;
            // F_ADD_SEALS takes an int argument and touches no memory of ours.
            unsafe {
                libc::fcntl(
                    std::os::fd::AsRawFd::as_raw_fd(&file),
                    libc::F_ADD_SEALS,
                    libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL | extra,
                )
            }
        };
        let shareable = if peers_write {
            seal(0) >= 0
        } else if seal(libc::F_SEAL_FUTURE_WRITE) >= 0 {
            true
        } else {
            // No write seal on this kernel: the region is not offered for mapping.
            seal(0);
            false
        };
        if peers_write && !shareable {
            return Err(TransferError::Registration(format!("sealing a memfd: {}", std::io::Error::last_os_error())));
        }
        if shareable {
            *region.memfd.lock() = Some(file);
        }
        Ok(region)
    }

    /// Maps a shared region's memfd: `len` bytes of data and the revocation page
    /// after them (the owner's own mapping, or a peer's through `/proc`).
    /// With `populate`, every page table entry is made at once (`MAP_POPULATE`): a
    /// peer then copies at memcpy speed from the first access instead of taking a
    /// page fault per 4 KiB on its first touch of each page. Without `writable`, the
    /// mapping is read-only (a peer's mapping of a region its owner sealed against
    /// writes) and the region refuses every write.
    pub(crate) fn map_file(
        id: RegionId,
        file: &std::fs::File,
        len: u64,
        populate: bool,
        writable: bool,
    ) -> Result<Self> {
        let total = usize::try_from(shared_file_len(len)?)
            .map_err(|_| TransferError::Registration(format!("{len} bytes exceed the address space")))?;
        let mut opts = memmap2::MmapOptions::new();
        opts.len(total);
        if populate {
            opts.populate();
        }
        let failed = |e: std::io::Error| TransferError::Registration(format!("mmap of a shared region: {e}"));
        let (map, ptr) = if writable {
            // SAFETY: the file is a memfd whose size is sealed before it is shared
            // (no shrink, no grow: `new_shared`; peers check the seal before
            // mapping), so the mapping stays backed; accesses go through raw
            // pointers only (see `Send`).
            let mut map = unsafe { opts.map_mut(file) }.map_err(failed)?;
            let ptr = map.as_mut_ptr();
            (Mapping::Writable(map), ptr)
        } else {
            // SAFETY: as above; nothing writes through the pointer of a read-only
            // mapping (every write checks `writable_memory` first).
            let map = unsafe { opts.map(file) }.map_err(failed)?;
            let ptr = map.as_ptr().cast_mut();
            (Mapping::ReadOnly(map), ptr)
        };
        // SAFETY: `total - PAGE` is inside the mapping (`shared_file_len`), and the
        // mapping is page-aligned, so the word is aligned for a u64.
        let revoked = Some(unsafe { ptr.add(total - PAGE as usize) }.cast::<u64>());
        Ok(Self { id, len, ptr, map, peers_write: writable, revoked, memfd: parking_lot::Mutex::new(None) })
    }

    /// The revocation word of a region this process may write (its own, or a
    /// peer's writable mapping).
    fn revoked_word(&self) -> Option<&AtomicU64> {
        if matches!(self.map, Mapping::ReadOnly(_)) {
            return None;
        }
        // SAFETY: the word lies in this region's writable mapping, which lives as
        // long as `self`; it is aligned (see `map_file`) and only ever accessed
        // atomically, by this process and by peers mapping the same memfd.
        self.revoked.map(|p| unsafe { AtomicU64::from_ptr(p) })
    }

    /// Whether the owner of this (shared) region stopped sharing it: peers check
    /// this before every use of their mapping.
    pub(crate) fn is_revoked(&self) -> bool {
        match (&self.map, self.revoked) {
            (Mapping::ReadOnly(_), Some(p)) => {
                // SAFETY: the word lies in this region's mapping, which lives as long
                // as `self`, and is aligned (see `map_file`). Read-only memory takes
                // no atomic read-modify-write: an aligned volatile load (one
                // instruction) and a fence read the owner's store as an acquire load.
                let word = unsafe { std::ptr::read_volatile(p) };
                std::sync::atomic::fence(Ordering::Acquire);
                word != 0
            }
            _ => self.revoked_word().is_some_and(|w| w.load(Ordering::Acquire) != 0),
        }
    }

    /// The descriptor and inode of a shared region's memfd, while it is shared.
    pub(crate) fn shared_fd(&self) -> Option<(i32, u64)> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let memfd = self.memfd.lock();
        let file = memfd.as_ref()?;
        Some((file.as_raw_fd(), file.metadata().ok()?.ino()))
    }

    /// Stops sharing: closes the memfd, so peers' mappings of it are seen as stale
    /// and further requests go through the engine (which no longer has the region).
    /// This process's own mapping stays valid.
    pub(crate) fn revoke_sharing(&self) {
        let mut memfd = self.memfd.lock();
        if memfd.is_some() {
            if let Some(w) = self.revoked_word() {
                w.store(1, Ordering::Release);
            }
        }
        memfd.take();
    }

    /// Whether peers on this host may map the region.
    pub fn is_shared(&self) -> bool {
        self.memfd.lock().is_some()
    }

    /// Whether peers may write the region. False for a region registered with
    /// [`TransferEngine::register_read_only_region`](crate::TransferEngine::register_read_only_region)
    /// (memory only its owner's process fills, such as an SSD tier's staging
    /// buffer) and for a peer's mapping of such a region: every transport refuses
    /// a write to it with [`TransferError::ReadOnly`] before touching a byte.
    pub fn peers_may_write(&self) -> bool {
        self.peers_write
    }

    /// Refuses a write to memory this process mapped read-only (a peer's region
    /// sealed against writes); before any write through `ptr`.
    fn writable_memory(&self) -> Result<()> {
        match self.map {
            Mapping::Writable(_) => Ok(()),
            Mapping::ReadOnly(_) => Err(TransferError::ReadOnly { region: self.id }),
        }
    }

    /// Fills `[offset, offset + len)` straight from `reader` (bounds-checked first).
    pub(crate) fn fill_from(&self, offset: u64, len: u64, reader: &mut impl std::io::Read) -> Result<()> {
        self.check_bounds(offset, len)?;
        self.writable_memory()?;
        // SAFETY: bounds checked above; the slice lives only for this call, and no
        // other reference into the mapping exists (see the `Send` impl: concurrent
        // writers of one range are excluded by the master's allocator).
        let dst = unsafe { std::slice::from_raw_parts_mut(self.ptr.add(offset as usize), len as usize) };
        reader.read_exact(dst).map_err(|e| TransferError::Io(e.to_string()))
    }

    /// Hands `[offset, offset + len)` to `send` (bounds-checked first), which writes
    /// it out without a copy of its own.
    pub(crate) fn drain_to(
        &self,
        offset: u64,
        len: u64,
        send: &mut impl FnMut(&[u8]) -> std::io::Result<()>,
    ) -> Result<()> {
        self.check_bounds(offset, len)?;
        // SAFETY: bounds checked above; the shared slice lives only for this call.
        let src = unsafe { std::slice::from_raw_parts(self.ptr.add(offset as usize), len as usize) };
        send(src).map_err(|e| TransferError::Io(e.to_string()))
    }

    /// Start of the region's memory in this process, for code that must hand the
    /// memory to another subsystem (an `io_uring` fixed buffer, a staging
    /// allocator). Valid while the region lives; writing through it is only sound
    /// for ranges no transfer is using at the same time (and in this process's
    /// own regions: a region of a peer it may not write is mapped read-only).
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// The region's id inside its engine.
    pub fn id(&self) -> RegionId {
        self.id
    }

    /// Registered length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region has no bytes (never true for a registered region).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Checks `[offset, offset + len)` against the registered length.
    pub fn check_bounds(&self, offset: u64, len: u64) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(TransferError::OutOfBounds { region: self.id, offset, len, region_len: self.len }),
        }
    }

    /// Copies `src` into the region at `offset`, after a bounds check.
    pub fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_bounds(offset, src.len() as u64)?;
        self.writable_memory()?;
        // SAFETY: the bounds check above keeps `[offset, offset+len)` inside the mapping,
        // `src` is a valid slice that cannot overlap the mapping (the mapping is never
        // exposed as a slice), and writers of one range are serialized by the master
        // (see the `Send` impl).
        unsafe {
            crate::stream_copy::copy_to_pool(src.as_ptr(), self.ptr.add(offset as usize), src.len());
        }
        Ok(())
    }

    /// [`copy_in`](Self::copy_in) that also gives the crc32c of `src`, taken while
    /// it is copied (folded into the copy where the CPU can:
    /// [`copies_fold_checksums`](crate::copies_fold_checksums); else each piece
    /// summed from the cache its copy read it into).
    pub fn copy_in_summed(&self, offset: u64, src: &[u8]) -> Result<u32> {
        self.check_bounds(offset, src.len() as u64)?;
        self.writable_memory()?;
        // SAFETY: as in `copy_in`.
        Ok(unsafe { crate::stream_copy::copy_to_pool_summed(src.as_ptr(), self.ptr.add(offset as usize), src.len()) })
    }

    /// [`copy_out`](Self::copy_out) that also gives the crc32c of the bytes copied,
    /// taken on the way (folded into the copy where the CPU can:
    /// [`copies_fold_checksums`](crate::copies_fold_checksums)).
    pub fn copy_out_summed(&self, offset: u64, dst: &mut [u8]) -> Result<u32> {
        self.check_bounds(offset, dst.len() as u64)?;
        // SAFETY: as in `copy_out`.
        Ok(unsafe { crate::stream_copy::copy_out_summed(self.ptr.add(offset as usize), dst.as_mut_ptr(), dst.len()) })
    }

    /// Copies bytes of the region at `offset` into `dst`, after a bounds check.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_bounds(offset, dst.len() as u64)?;
        // SAFETY: bounds checked above; `dst` is an exclusive slice outside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.add(offset as usize), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `len` bytes from `src_offset` of `src` to `dst_offset` of this region
    /// (both bounds-checked). The two may be the same region if the ranges don't overlap.
    pub fn copy_from_region(&self, dst_offset: u64, src: &RegisteredRegion, src_offset: u64, len: u64) -> Result<()> {
        self.check_bounds(dst_offset, len)?;
        src.check_bounds(src_offset, len)?;
        self.writable_memory()?;
        // SAFETY: both ranges are inside their mappings (checked above); ptr::copy
        // tolerates overlap should a caller pass overlapping ranges of one region.
        unsafe {
            std::ptr::copy(src.ptr.add(src_offset as usize), self.ptr.add(dst_offset as usize), len as usize);
        }
        Ok(())
    }
}
