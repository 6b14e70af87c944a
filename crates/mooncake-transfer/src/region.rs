//! Registered memory: the regions an engine serves to its peers.

use crate::error::{Result, TransferError};

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
    _map: memmap2::MmapMut,
}

// SAFETY: the region is plain memory; all access goes through `copy_in`/`copy_out`,
// which copy bytes with raw pointers. Concurrent users write disjoint ranges (the
// master's allocator hands out each range to one writer), and a reader of a range that
// was freed and reused meanwhile can only observe torn bytes, which the store's
// checksum rejects. No references into the region are ever handed out.
unsafe impl Send for RegisteredRegion {}
// SAFETY: see `Send`; shared access only copies bytes through raw pointers.
unsafe impl Sync for RegisteredRegion {}

impl std::fmt::Debug for RegisteredRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisteredRegion")
            .field("id", &self.id)
            .field("len", &self.len)
            .finish()
    }
}

impl RegisteredRegion {
    pub(crate) fn new(id: RegionId, len: u64) -> Result<Self> {
        if len == 0 {
            return Err(TransferError::Registration("region of zero bytes".into()));
        }
        let len_usize = usize::try_from(len).map_err(|_| {
            TransferError::Registration(format!("{len} bytes exceed the address space"))
        })?;
        let mut map = memmap2::MmapOptions::new()
            .len(len_usize)
            .map_anon()
            .map_err(|e| TransferError::Registration(format!("mmap of {len} bytes: {e}")))?;
        let ptr = map.as_mut_ptr();
        Ok(Self {
            id,
            len,
            ptr,
            _map: map,
        })
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
            _ => Err(TransferError::OutOfBounds {
                region: self.id,
                offset,
                len: len,
                region_len: self.len,
            }),
        }
    }

    /// Copies `src` into the region at `offset`, after a bounds check.
    pub fn copy_in(&self, offset: u64, src: &[u8]) -> Result<()> {
        self.check_bounds(offset, src.len() as u64)?;
        // SAFETY: the bounds check above keeps `[offset, offset+len)` inside the mapping,
        // `src` is a valid slice that cannot overlap the mapping (the mapping is never
        // exposed as a slice), and writers of one range are serialized by the master
        // (see the `Send` impl).
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset as usize), src.len());
        }
        Ok(())
    }

    /// Copies bytes of the region at `offset` into `dst`, after a bounds check.
    pub fn copy_out(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.check_bounds(offset, dst.len() as u64)?;
        // SAFETY: bounds checked above; `dst` is an exclusive slice outside the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.add(offset as usize),
                dst.as_mut_ptr(),
                dst.len(),
            );
        }
        Ok(())
    }

    /// Copies `len` bytes from `src_offset` of `src` to `dst_offset` of this region
    /// (both bounds-checked). The two may be the same region if the ranges don't overlap.
    pub fn copy_from_region(
        &self,
        dst_offset: u64,
        src: &RegisteredRegion,
        src_offset: u64,
        len: u64,
    ) -> Result<()> {
        self.check_bounds(dst_offset, len)?;
        src.check_bounds(src_offset, len)?;
        // SAFETY: both ranges are inside their mappings (checked above); ptr::copy
        // tolerates overlap should a caller pass overlapping ranges of one region.
        unsafe {
            std::ptr::copy(
                src.ptr.add(src_offset as usize),
                self.ptr.add(dst_offset as usize),
                len as usize,
            );
        }
        Ok(())
    }
}
