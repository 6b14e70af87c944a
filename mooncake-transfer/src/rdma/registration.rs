//! Memory registration on every NIC of an endpoint: ranges above the devices'
//! `max_mr_size` are split into several memory regions, and local buffers'
//! registrations are cached so that repeated transfers into one buffer register once.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::{DmaBuf, MemoryRegion, ProtectionDomain, RdmaProvider, RemoteAccess};
use crate::error::{Result, TransferError};

const PAGE: u64 = 4096;

/// The protection domains of an endpoint, one per NIC (port), in provider order.
pub(crate) struct Nics {
    pub(crate) implementation: &'static str,
    pub(crate) pds: Vec<Arc<dyn ProtectionDomain>>,
    /// Memory regions registered so far (a registration cache hit adds none).
    pub(crate) registrations: AtomicU64,
}

impl Nics {
    /// Opens a protection domain on every port of `provider`; none is an error.
    pub(crate) fn open(provider: &dyn RdmaProvider) -> Result<Self> {
        let ports = provider.ports();
        if ports.is_empty() {
            return Err(TransferError::Registration(format!("no RDMA port ({} provider)", provider.implementation())));
        }
        let pds = (0..ports.len()).map(|i| provider.open(i)).collect::<Result<Vec<_>>>()?;
        Ok(Self { implementation: provider.implementation(), pds, registrations: AtomicU64::new(0) })
    }

    /// The largest memory region every NIC registers.
    pub(crate) fn max_mr_size(&self) -> u64 {
        self.pds.iter().map(|pd| pd.port().max_mr_size).min().unwrap_or(PAGE).max(PAGE)
    }

    /// Registers `[addr, addr + len)` on every NIC, split into pieces of at most
    /// `max_mr_size` bytes: one `(offset, len, regions by NIC)` per piece.
    ///
    /// # Safety
    /// As [`ProtectionDomain::register`], for the whole range.
    pub(crate) unsafe fn register(&self, addr: *mut u8, len: u64, access: RemoteAccess) -> Result<Registration> {
        self.register_pieces(addr as u64, len, |pd, done, n| {
            // SAFETY: a sub-range of the caller's range, under the caller's contract.
            unsafe { pd.register(addr.add(done as usize), n, access) }
        })
    }

    /// Registers the device memory of `buf` on every NIC, for local access only,
    /// split as [`register`](Self::register) does; work requests name it from
    /// `buf.iova` on.
    ///
    /// # Safety
    /// As [`ProtectionDomain::register_dmabuf`]: the dma-buf stays allocated while
    /// the registration lives (its file descriptor may be closed).
    pub(crate) unsafe fn register_dmabuf(&self, buf: &DmaBuf) -> Result<Registration> {
        let fd = buf.fd.as_raw_fd();
        self.register_pieces(buf.iova, buf.len, |pd, done, n| {
            // SAFETY: a sub-range of the dma-buf, under the caller's contract.
            unsafe { pd.register_dmabuf(fd, buf.offset + done, n, buf.iova + done, RemoteAccess::LocalOnly) }
        })
    }

    /// Registers `len` bytes named from `start` on, in pieces of at most
    /// `max_mr_size`, with `one(pd, offset, len)` per piece and NIC; on a failure
    /// every piece registered so far is deregistered.
    fn register_pieces(
        &self,
        start: u64,
        len: u64,
        mut one: impl FnMut(&dyn ProtectionDomain, u64, u64) -> Result<MemoryRegion>,
    ) -> Result<Registration> {
        let step = self.max_mr_size();
        let mut pieces = Vec::new();
        let mut done = 0u64;
        let mut registration = Registration { pds: self.pds.clone(), start, pieces: Vec::new() };
        while done < len {
            let n = step.min(len - done);
            let mut by_nic = Vec::with_capacity(self.pds.len());
            for pd in &self.pds {
                match one(pd.as_ref(), done, n) {
                    Ok(mr) => by_nic.push(mr),
                    Err(e) => {
                        for (pd, mr) in self.pds.iter().zip(&by_nic) {
                            pd.deregister(mr);
                        }
                        // Dropping `registration` deregisters the pieces before this one.
                        registration.pieces = pieces;
                        return Err(e);
                    }
                }
                self.registrations.fetch_add(1, Ordering::Relaxed);
            }
            pieces.push(Piece { offset: done, len: n, mrs: by_nic });
            done += n;
        }
        registration.pieces = pieces;
        Ok(registration)
    }
}

/// One piece of a registered range: its memory region on each NIC.
pub(crate) struct Piece {
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) mrs: Vec<MemoryRegion>,
}

/// A range registered on every NIC; deregistered when dropped.
pub(crate) struct Registration {
    pds: Vec<Arc<dyn ProtectionDomain>>,
    pub(crate) start: u64,
    pub(crate) pieces: Vec<Piece>,
}

impl Registration {
    pub(crate) fn end(&self) -> u64 {
        self.start + self.pieces.last().map_or(0, |p| p.offset + p.len)
    }

    /// The piece holding address `addr`, and the bytes of it from `addr` on.
    pub(crate) fn piece_at(&self, addr: u64) -> Option<(&Piece, u64)> {
        let off = addr.checked_sub(self.start)?;
        let i = self.pieces.partition_point(|p| p.offset + p.len <= off);
        self.pieces.get(i).map(|p| (p, p.offset + p.len - off))
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        for piece in &self.pieces {
            for (pd, mr) in self.pds.iter().zip(&piece.mrs) {
                pd.deregister(mr);
            }
        }
    }
}

/// Local buffers' registrations, by start address, least recently used evicted
/// beyond the capacity. A hit needs the buffer inside a cached range.
///
/// The cache trusts that a cached address range still holds the memory it held
/// when registered (as the reference's and UCX's caches do): a buffer freed and
/// mapped again elsewhere must be forgotten with
/// [`RdmaTransport::forget_registrations`](super::RdmaTransport::forget_registrations)
/// on a real device, whose registration pins the old pages.
pub(crate) struct RegistrationCache {
    capacity: usize,
    entries: Mutex<BTreeMap<u64, (Arc<Registration>, u64)>>,
    clock: AtomicU64,
}

impl RegistrationCache {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), entries: Mutex::new(BTreeMap::new()), clock: AtomicU64::new(0) }
    }

    /// The registration covering `[addr, addr + len)`, registering the pages
    /// around it (local access only) on a miss.
    pub(crate) fn get(&self, nics: &Nics, addr: *const u8, len: u64) -> Result<Arc<Registration>> {
        let (lo, hi) = (addr as u64, addr as u64 + len.max(1));
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.entries.lock();
        let hit = entries.range_mut(..=lo).rev().find(|(_, (r, _))| r.end() >= hi).map(|(_, e)| e);
        if let Some((r, used)) = hit {
            *used = now;
            return Ok(r.clone());
        }
        let start = lo & !(PAGE - 1);
        let end = hi.div_ceil(PAGE) * PAGE;
        // SAFETY: local access only: the range is the caller's live buffer, rounded
        // to pages of the same mapping; work requests name it only while the
        // buffer it belongs to is borrowed by a transfer.
        let reg = Arc::new(unsafe { nics.register(start as *mut u8, end - start, RemoteAccess::LocalOnly) }?);
        if entries.len() >= self.capacity {
            if let Some(oldest) = entries.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k) {
                entries.remove(&oldest);
            }
        }
        entries.insert(start, (reg.clone(), now));
        Ok(reg)
    }

    /// Drops every cached registration (those in use live until their transfer ends).
    pub(crate) fn clear(&self) {
        self.entries.lock().clear();
    }
}
