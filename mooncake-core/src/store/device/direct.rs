//! The direct way between device memory and the store: one-sided RDMA straight
//! to and from GPU memory that the NICs registered (a dma-buf the driver
//! exported), no host staging.
//!
//! A replica is read or written directly when the store's transfer engine reaches
//! its segment with the `Rdma` transport over an RDMA link. Anything else of the
//! same call (a replica in our own segment or reached by shared memory, a peer
//! without RDMA, a disk replica) takes the staged way, and the call counts as
//! staged.

use mooncake_alloc::SegmentId;
use mooncake_gpu::DeviceMemory;
use mooncake_transfer::{DeviceRegion, DeviceTransfer, RdmaTransport, RemoteRegion, TransferError, WorkOp};

use super::staging::download;
use crate::config::{check_key, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::{MemoryReplica, ReplicaList};
use crate::store::stats::StoreCounters;
use crate::store::Store;

/// Device memory registered with the store's RDMA NICs.
pub(super) struct Direct<'a> {
    rdma: &'a RdmaTransport,
    region: DeviceRegion,
}

impl Direct<'_> {
    /// One READ or WRITE of `len` bytes between `route` at `remote_offset` and
    /// `mem` at `offset`.
    ///
    /// # Safety
    /// `mem` is the memory `region` registered; its range is not used by anything
    /// else until this returns (not at all for a READ, not written for a WRITE).
    unsafe fn move_bytes(
        &self,
        op: WorkOp,
        route: &RemoteRegion,
        remote_offset: u64,
        mem: &dyn DeviceMemory,
        offset: u64,
        len: u64,
    ) -> std::result::Result<(), TransferError> {
        let req = DeviceTransfer {
            target: route,
            offset: remote_offset,
            op,
            local: &self.region,
            local_addr: mem.device_ptr() + offset,
            len,
        };
        // SAFETY: the caller's contract; `mem` is alive (borrowed for the call).
        let mut out = unsafe { self.rdma.transfer_device(&[req]) };
        out.pop().unwrap_or_else(|| Err(TransferError::Unreachable(route.endpoint.clone())))
    }

    /// Whether a failure means only that `endpoint` has no RDMA link (so a
    /// staged transfer reaches it over TCP).
    fn no_link(&self, e: &TransferError, endpoint: &str) -> bool {
        matches!(e, TransferError::Unreachable(_)) && self.rdma.falls_back_to_tcp(endpoint)
    }
}

impl Store {
    /// `mem` registered with this store's RDMA NICs, if the store moves bytes
    /// over RDMA and they can register it (registrations and refusals are
    /// cached by the transport); `None`: stage.
    pub(super) fn direct(&self, mem: &dyn DeviceMemory) -> Option<Direct<'_>> {
        let rdma = self.inner.engine.rdma()?;
        let id = mem.allocation_id()?;
        let export = || mem.export_dmabuf().map_err(|e| TransferError::Registration(e.to_string()));
        match rdma.register_device(id, mem.device_ptr(), mem.len(), export) {
            Ok(region) => Some(Direct { rdma, region }),
            Err(e) => {
                tracing::debug!(error = %e, "the RDMA NICs cannot register this device memory: it is staged");
                None
            }
        }
    }

    /// `get_into_device` with `dst` registered: counted as a get.
    pub(super) fn get_direct(
        &self,
        key: &str,
        dst: &dyn DeviceMemory,
        offset: u64,
        room: usize,
        direct: &Direct<'_>,
    ) -> Result<usize> {
        let res = self.inner.with_replicas(key, |list| self.read_list(key, list, dst, offset, room, direct));
        self.count_get(res.as_ref().copied().map_err(|_| ()));
        res
    }

    /// Reads the object of `list` into `dst` at `offset`: READ straight from the
    /// first replica reached over RDMA whose bytes match the checksum, else
    /// staged from the replicas not tried yet (or a disk replica).
    fn read_list(
        &self,
        key: &str,
        list: &ReplicaList,
        dst: &dyn DeviceMemory,
        offset: u64,
        room: usize,
        direct: &Direct<'_>,
    ) -> Result<usize> {
        if list.len > room as u64 {
            return Err(Error::BufferTooSmall { needed: list.len, capacity: room as u64 });
        }
        let inner = &self.inner;
        let mut untried = Vec::new();
        let mut last_err = None;
        for r in inner.read_order(&list.replicas) {
            let route = match inner.route(r.segment) {
                Ok(route) => route,
                Err(e) => {
                    last_err = Some(e);
                    continue;
                }
            };
            if inner.engine.transport_name(&route.endpoint) != Some("rdma") {
                untried.push(r);
                continue;
            }
            // SAFETY: `dst` is the memory `direct` registered (the caller's); the
            // device range is the caller's to fill (`get_into_device` writes it,
            // like `get_into` writes its buffer) and nothing else uses it during
            // the call.
            match unsafe { direct.move_bytes(WorkOp::Read, &route, r.offset, dst, offset, list.len) } {
                Ok(()) => {
                    if dst.crc32c(offset, list.len)? == list.checksum {
                        StoreCounters::inc(&inner.counters.device_direct_bytes, list.len);
                        return Ok(list.len as usize);
                    }
                    // The route may be stale (segment gone, memory reused).
                    inner.routes.write().remove(&r.segment);
                    StoreCounters::inc(&inner.counters.checksum_mismatches, 1);
                    tracing::warn!(key, segment = r.segment, "replica read into device memory failed its checksum");
                    last_err = Some(Error::Corrupted(key.to_owned()));
                }
                Err(e) if direct.no_link(&e, &route.endpoint) => untried.push(r),
                Err(e) => {
                    inner.routes.write().remove(&r.segment);
                    last_err = Some(e.into());
                }
            }
        }
        if untried.is_empty() && list.disk.is_none() {
            return Err(last_err.unwrap_or_else(|| Error::NotFound(key.to_owned())));
        }
        let rest = ReplicaList { replicas: untried, ..list.clone() };
        let n = self.stage_list(key, &rest, dst, offset)?;
        StoreCounters::inc(&inner.counters.device_staged_bytes, n as u64);
        Ok(n)
    }

    /// `put_from_device` with `src` registered (its range checked): counted as
    /// a put.
    pub(super) fn put_direct(
        &self,
        key: &str,
        src: &dyn DeviceMemory,
        offset: u64,
        len: u64,
        cfg: &ReplicateConfig,
        direct: &Direct<'_>,
    ) -> Result<()> {
        let c = &self.inner.counters;
        let mut staged = false;
        let res = check_key(key).and_then(|()| {
            let checksum = src.crc32c(offset, len)?;
            self.inner.put_placed(
                key,
                len,
                || checksum,
                cfg,
                |replicas| self.write_replicas_from(replicas, src, offset, len, direct, &mut staged),
            )
        });
        match &res {
            Ok(()) => {
                StoreCounters::inc(&c.puts, 1);
                StoreCounters::inc(&c.put_bytes, len);
                let way = if staged { &c.device_staged_bytes } else { &c.device_direct_bytes };
                StoreCounters::inc(way, len);
            }
            Err(_) => StoreCounters::inc(&c.put_errors, 1),
        }
        res
    }

    /// Writes `len` bytes at `offset` of `src` to every replica: WRITE from device
    /// memory to those reached over RDMA, the others from a staged copy (then
    /// `staged` is set). Returns the segments that failed, with why.
    fn write_replicas_from(
        &self,
        replicas: &[MemoryReplica],
        src: &dyn DeviceMemory,
        offset: u64,
        len: u64,
        direct: &Direct<'_>,
        staged: &mut bool,
    ) -> Vec<(SegmentId, Error)> {
        let inner = &self.inner;
        let mut failed = Vec::new();
        let mut others = Vec::new();
        for r in replicas {
            let route = match inner.route(r.segment) {
                Ok(route) => route,
                Err(e) => {
                    failed.push((r.segment, e));
                    continue;
                }
            };
            if inner.engine.transport_name(&route.endpoint) != Some("rdma") {
                others.push(*r);
                continue;
            }
            // SAFETY: `src` is the memory `direct` registered; the caller does not
            // write the range it puts from during the call (as `put` borrows its
            // value).
            match unsafe { direct.move_bytes(WorkOp::Write, &route, r.offset, src, offset, len) } {
                Ok(()) => {}
                Err(e) if direct.no_link(&e, &route.endpoint) => others.push(*r),
                Err(e) => {
                    // The route may be stale; ask the master again next time.
                    inner.routes.write().remove(&r.segment);
                    failed.push((r.segment, e.into()));
                }
            }
        }
        if !others.is_empty() {
            *staged = true;
            match download(src, offset, len as usize) {
                Ok(copy) => failed.extend(inner.write_replicas(&others, &copy[..len as usize]).0),
                Err(e) => failed.extend(others.iter().map(|r| (r.segment, e.clone()))),
            }
        }
        failed
    }
}
