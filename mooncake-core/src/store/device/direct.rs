//! Device memory moved straight to and from replicas, with no host copy: one-sided
//! RDMA READ/WRITE on memory the NICs registered (a dma-buf the driver exported).
//! The engines use it for every replica whose transport moves device memory
//! ([`Capabilities::moves_device_memory`](mooncake_transfer::Capabilities)); the
//! other replicas of the same call are staged.

use mooncake_gpu::DeviceMemory;
use mooncake_transfer::{DeviceRegion, DeviceTransfer, RdmaTransport, RemoteRegion, TransferError, WorkOp};

use crate::store::StoreInner;

/// Device memory registered with the store's RDMA NICs.
pub(in crate::store) struct Direct<'a> {
    rdma: &'a RdmaTransport,
    region: DeviceRegion,
}

/// One READ or WRITE between device memory and a replica.
pub(in crate::store) struct DeviceMove<'a> {
    /// The registration of `mem`.
    pub(in crate::store) direct: &'a Direct<'a>,
    /// The replica's region, and the offset of the replica in it.
    pub(in crate::store) route: &'a RemoteRegion,
    pub(in crate::store) remote_offset: u64,
    /// The device memory, and the offset of the first byte in it.
    pub(in crate::store) mem: &'a dyn DeviceMemory,
    pub(in crate::store) offset: u64,
    pub(in crate::store) len: u64,
}

/// The device memories of one call that the NICs registered, each asked once.
#[derive(Default)]
pub(in crate::store) struct Directs<'a> {
    /// By allocation id, address and length: two memories of one call are the same
    /// registration only if they are the same range of the same allocation (a
    /// scatter starting where another memory starts is not that memory).
    by_memory: Vec<((u64, u64, u64), Option<Direct<'a>>)>,
}

impl<'a> Directs<'a> {
    /// `mem` registered with `inner`'s RDMA NICs, if the store moves bytes over
    /// RDMA and they can register it (registrations and refusals are cached by
    /// the transport); `None`: stage. Returns an index for [`get`](Self::get).
    pub(in crate::store) fn register(&mut self, inner: &'a StoreInner, mem: &dyn DeviceMemory) -> Option<usize> {
        // Memory without an allocation id is never registered: it is staged.
        let id = mem.allocation_id()?;
        let key = (id, mem.device_ptr(), mem.len());
        if let Some(at) = self.by_memory.iter().position(|(k, _)| *k == key) {
            return self.by_memory[at].1.is_some().then_some(at);
        }
        let direct = inner.engine.rdma().and_then(|rdma| {
            let export = || mem.export_dmabuf().map_err(|e| TransferError::Registration(e.to_string()));
            match rdma.register_device(id, mem.device_ptr(), mem.len(), export) {
                Ok(region) => Some(Direct { rdma, region }),
                Err(e) => {
                    tracing::debug!(error = %e, "the RDMA NICs cannot register this device memory: it is staged");
                    None
                }
            }
        });
        let registered = direct.is_some();
        self.by_memory.push((key, direct));
        registered.then_some(self.by_memory.len() - 1)
    }

    /// The registration [`register`](Self::register) numbered `at`.
    pub(in crate::store) fn get(&self, at: usize) -> Option<&Direct<'a>> {
        self.by_memory.get(at).and_then(|(_, d)| d.as_ref())
    }
}

/// Runs `moves` (READs or WRITEs, as `op`) as one batch; one result per move. A
/// move to a peer that turned out to have no RDMA link fails `Unreachable`, and
/// the peer's capabilities say so from then on.
///
/// # Safety
/// Each move's device range is the caller's and is not used by anything else
/// until this returns (not at all for a READ, not written for a WRITE).
pub(in crate::store) unsafe fn move_device(op: WorkOp, moves: &[DeviceMove<'_>]) -> Vec<Result<(), TransferError>> {
    let Some(first) = moves.first() else { return Vec::new() };
    let reqs: Vec<DeviceTransfer<'_>> = moves
        .iter()
        .map(|m| DeviceTransfer {
            target: m.route,
            offset: m.remote_offset,
            op,
            local: &m.direct.region,
            local_addr: m.mem.device_ptr() + m.offset,
            len: m.len,
        })
        .collect();
    // Every registration of one store is with the same transport.
    // SAFETY: the caller's contract; every `mem` is alive (borrowed by `moves`).
    unsafe { first.direct.rdma.transfer_device(&reqs) }
}
