//! Device memory (GPU memory a driver exported as a dma-buf) as the local side of
//! RDMA transfers: its registrations, cached per allocation, and the requests that
//! name it.
//!
//! A host buffer is registered by address; device memory cannot be (the CPU may not
//! reach it, and its pages are the GPU driver's): its driver exports it as a
//! dma-buf, every NIC registers that ([`ProtectionDomain::register_dmabuf`]), and
//! work requests name its bytes by device address. The NIC then reads and writes
//! GPU memory itself: no host staging buffer, no copy through host memory.
//!
//! [`ProtectionDomain::register_dmabuf`]: super::ProtectionDomain::register_dmabuf

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use super::registration::{Nics, Registration};
use super::{DmaBuf, WorkOp};
use crate::error::{Result, TransferError};
use crate::region::RemoteRegion;

/// Device memory registered on every NIC of an
/// [`RdmaTransport`](super::RdmaTransport), named by device address: the local side
/// of [`RdmaTransport::transfer_device`](super::RdmaTransport::transfer_device).
/// Cheap to clone; deregistered when the transport forgets it and no transfer
/// uses it any more.
#[derive(Clone)]
pub struct DeviceRegion {
    pub(crate) reg: Arc<Registration>,
}

impl std::fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegion")
            .field("iova", &format_args!("{:#x}", self.iova()))
            .field("len", &self.len())
            .field("pieces", &self.reg.pieces.len())
            .finish()
    }
}

impl DeviceRegion {
    /// The device address of its first byte.
    pub fn iova(&self) -> u64 {
        self.reg.start
    }

    /// Bytes registered.
    pub fn len(&self) -> u64 {
        self.reg.end() - self.reg.start
    }

    /// Whether no byte is registered (never, for a region the transport made).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the `len` bytes at device address `addr` lie inside.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.iova() && addr.checked_add(len).is_some_and(|end| end <= self.reg.end())
    }
}

/// One request of [`RdmaTransport::transfer_device`](super::RdmaTransport::transfer_device):
/// `op` moves `len` bytes between `target` at `offset` and the device memory of
/// `local` at device address `local_addr` (READ: remote into device memory; WRITE:
/// device memory into the remote region).
#[derive(Clone, Copy, Debug)]
pub struct DeviceTransfer<'a> {
    /// The remote region addressed.
    pub target: &'a RemoteRegion,
    /// Offset inside the remote region.
    pub offset: u64,
    /// READ or WRITE.
    pub op: WorkOp,
    /// The registered device memory.
    pub local: &'a DeviceRegion,
    /// Device address of the first local byte (inside `local`).
    pub local_addr: u64,
    /// Bytes moved.
    pub len: u64,
}

/// Which device memory a registration is of: the allocation's process-unique id
/// and the range (device address, bytes) asked for.
type DeviceKey = (u64, u64, u64);

/// Registrations of device memory by allocation id and range, least recently
/// used evicted beyond the capacity. Allocation ids are never reused by a process
/// (`CU_POINTER_ATTRIBUTE_BUFFER_ID` for CUDA memory), so memory freed and
/// allocated again at the same address is never taken for the old (the host cache
/// has to trust addresses). Refusals are kept too: memory a NIC cannot reach is not
/// exported again on every call.
pub(crate) struct DeviceRegistrations {
    capacity: usize,
    entries: Mutex<HashMap<DeviceKey, (Result<DeviceRegion>, u64)>>,
    clock: AtomicU64,
}

impl DeviceRegistrations {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { capacity: capacity.max(1), entries: Mutex::new(HashMap::new()), clock: AtomicU64::new(0) }
    }

    /// The registration of the `len` bytes at device address `addr` of allocation
    /// `id`: cached, or `export()`ed and registered on every NIC now (once:
    /// concurrent callers wait for the first). An export that does not cover the
    /// range is refused.
    pub(crate) fn get(
        &self,
        nics: &Nics,
        (id, addr, len): DeviceKey,
        export: impl FnOnce() -> Result<DmaBuf>,
    ) -> Result<DeviceRegion> {
        let key = (id, addr, len);
        let now = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.entries.lock();
        if let Some((r, used)) = entries.get_mut(&key) {
            *used = now;
            return r.clone();
        }
        let covering = export().and_then(|buf| {
            let covers = addr >= buf.iova && addr.checked_add(len).is_some_and(|end| end <= buf.iova + buf.len);
            if covers {
                Ok(buf)
            } else {
                Err(TransferError::Registration(format!(
                    "the dma-buf at {:#x}+{} does not cover {addr:#x}+{len}",
                    buf.iova, buf.len
                )))
            }
        });
        let registered = covering.and_then(|buf| {
            // SAFETY: a registration holds its own reference to the dma-buf (the
            // kernel's import of it, or the soft NIC's mapping), so the buffer stays
            // allocated until the registration is dropped; transfers naming it
            // require the allocation alive (`transfer_device`'s contract).
            unsafe { nics.register_dmabuf(&buf) }
        });
        let region = registered
            .map(|reg| DeviceRegion { reg: Arc::new(reg) })
            .map_err(|e| TransferError::Registration(format!("device memory: {e}")));
        if entries.len() >= self.capacity {
            if let Some(oldest) = entries.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| *k) {
                entries.remove(&oldest);
            }
        }
        entries.insert(key, (region.clone(), now));
        region
    }

    /// Forgets every registration and refusal (those in use live until their
    /// transfer ends).
    pub(crate) fn clear(&self) {
        self.entries.lock().clear();
    }
}
