//! The `Rdma` transport and the narrow seam of verbs calls it is written over.
//!
//! The transport ([`RdmaTransport`]) only ever talks to an [`RdmaProvider`]: devices
//! and ports, a protection domain per port, memory regions with their keys, reliable
//! connected queue pairs with their state machine, one-sided READ/WRITE work
//! requests posted in batches (one doorbell per batch) and completion polling.
//! Two implementations: [`SoftRdma`] (software NICs whose one-sided operations travel
//! over loopback sockets between processes: the transport logic runs on it in CI, it
//! is never an RDMA result) and, with the `rdma` feature, `VerbsRdma` (libibverbs,
//! loaded at run time).

mod device;
mod handshake;
mod registration;
mod server;
mod soft;
mod transport;
#[cfg(feature = "rdma")]
mod verbs;

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

pub use device::{DeviceRegion, DeviceTransfer};
pub use handshake::{RdmaHandshake, RdmaRegionInfo, RegionPiece};
pub(crate) use server::RdmaResponder;
pub use soft::{SoftFaults, SoftPortConfig, SoftRdma};
pub(crate) use transport::open_nics;
pub use transport::RdmaTransport;
#[cfg(feature = "rdma")]
pub use verbs::VerbsRdma;

use crate::error::Result;

/// One port of an RDMA device, as discovered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Device name (`mlx5_0`, `soft0`, …).
    pub device: String,
    /// Port number on the device (from 1).
    pub port: u8,
    /// NUMA node the device is attached to, if known.
    pub numa_node: Option<u32>,
    /// Active MTU of the port, in bytes (256..=4096).
    pub active_mtu: u32,
    /// Largest memory region the device registers at once.
    pub max_mr_size: u64,
    /// Local identifier (InfiniBand), 0 on RoCE.
    pub lid: u16,
    /// The GID peers address this port by (for RoCE v2, the IPv4-mapped or IPv6 one).
    pub gid: [u8; 16],
    /// Index of `gid` in the port's GID table.
    pub gid_index: u8,
}

/// How a peer reaches one queue pair: what the handshake exchanges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpAddress {
    /// Index of the NIC (in the owner's list of ports) the queue pair lives on.
    pub nic: u8,
    /// Queue pair number.
    pub qp_num: u32,
    /// Port LID.
    pub lid: u16,
    /// Port GID.
    pub gid: [u8; 16],
    /// Port GID index (meaningful to the owner only).
    pub gid_index: u8,
    /// Active MTU of the owner's port, in bytes.
    pub mtu: u32,
    /// First packet sequence number.
    pub psn: u32,
}

/// States of a queue pair (the verbs state machine, without SQD/SQE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Bound to a port, accepting work requests later.
    Init,
    /// Ready to receive: connected to a remote queue pair.
    Rtr,
    /// Ready to send: work requests may be posted.
    Rts,
    /// Failed: posted work requests complete as flushed.
    Error,
}

/// What peers may do to a memory region with its `rkey` (the region's own
/// process always reads and writes it with its `lkey`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteAccess {
    /// Nothing: the region has no remote key (a local buffer of transfers).
    LocalOnly,
    /// One-sided READ only: peers' WRITEs complete with a remote access error (a
    /// region its engine registered read-only).
    Read,
    /// One-sided READ and WRITE (a segment peers put objects into).
    ReadWrite,
}

impl RemoteAccess {
    /// Whether peers get a remote key at all.
    pub fn is_remote(self) -> bool {
        self != RemoteAccess::LocalOnly
    }
}

/// A registered memory region: `len` bytes at `addr`, with its keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryRegion {
    /// First byte (a virtual address of the registering process).
    pub addr: u64,
    /// Bytes registered.
    pub len: u64,
    /// Key of local accesses.
    pub lkey: u32,
    /// Key peers name the region by.
    pub rkey: u32,
}

/// Device memory exported as a dma-buf, so that NICs can register it
/// ([`ProtectionDomain::register_dmabuf`]) and move its bytes without host staging
/// (a GPU driver exports one with `cuMemGetHandleForAddressRange`).
#[derive(Debug)]
pub struct DmaBuf {
    /// The dma-buf. Closed when this value drops: a registration holds its own
    /// reference to the buffer.
    pub fd: OwnedFd,
    /// Offset in the dma-buf of the first exported byte.
    pub offset: u64,
    /// Bytes exported.
    pub len: u64,
    /// The address work requests name the first exported byte by (the device
    /// pointer), for [`RdmaTransport::transfer_device`].
    pub iova: u64,
}

/// What a work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkOp {
    /// One-sided RDMA READ: remote bytes into the local range.
    Read,
    /// One-sided RDMA WRITE: the local range into remote bytes.
    Write,
}

/// One signaled one-sided work request with one scatter/gather entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkRequest {
    /// Returned in its completion.
    pub wr_id: u64,
    /// READ or WRITE.
    pub op: WorkOp,
    /// Local first byte.
    pub local_addr: u64,
    /// Bytes moved.
    pub len: u32,
    /// Key of the local memory region holding `[local_addr, local_addr + len)`.
    pub lkey: u32,
    /// Remote first byte.
    pub remote_addr: u64,
    /// Key of the remote memory region.
    pub rkey: u32,
}

/// Outcome of a work request (the `ibv_wc_status` values the transport tells apart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompletionStatus {
    /// Done.
    Success,
    /// The local range is not inside a memory region of this protection domain.
    LocalProtection,
    /// The remote key or range was refused by the peer (bad or revoked rkey).
    RemoteAccess,
    /// The peer did not answer within the transport retries (peer dead, link down).
    RetryExceeded,
    /// The queue pair was in error: the request was never executed.
    Flushed,
    /// Any other status code.
    Other(u32),
}

/// The completion of one work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Its outcome.
    pub status: CompletionStatus,
}

/// A source of RDMA ports: the devices of this host, or software ones.
pub trait RdmaProvider: Send + Sync {
    /// Which implementation this is (`"soft"`, `"verbs"`): tests and logs print it.
    fn implementation(&self) -> &'static str;

    /// Active ports, in a stable order (their index is the NIC index of handshakes).
    fn ports(&self) -> Vec<PortInfo>;

    /// A protection domain on `port` (an index into [`ports`](Self::ports)).
    fn open(&self, port: usize) -> Result<Arc<dyn ProtectionDomain>>;
}

/// A protection domain on one port: memory regions and queue pairs that may touch them.
pub trait ProtectionDomain: Send + Sync {
    /// The port it lives on.
    fn port(&self) -> &PortInfo;

    /// Registers `[addr, addr + len)` for local access and for what `access` lets
    /// peers do (`len` at most the port's `max_mr_size`). With
    /// [`RemoteAccess::LocalOnly`] the returned `rkey` is 0.
    ///
    /// # Safety
    /// With remote access, the range must stay mapped (and be used for nothing the
    /// peers' accesses could break) until [`deregister`](Self::deregister) returns.
    /// Without, it must be valid whenever a work request naming it is posted.
    unsafe fn register(&self, addr: *mut u8, len: u64, access: RemoteAccess) -> Result<MemoryRegion>;

    /// Registers `len` bytes at `offset` of a dma-buf (device memory a GPU driver
    /// exported, so that the NIC reads and writes it without host staging), for
    /// local access and for what `access` lets peers do. Work requests
    /// name its bytes from `iova` on (the returned region's `addr`), not by a
    /// host address: the CPU may not be able to reach them at all. Devices or
    /// implementations without dma-buf support refuse (the default).
    ///
    /// # Safety
    /// The dma-buf must stay allocated until [`deregister`](Self::deregister) returns.
    unsafe fn register_dmabuf(
        &self,
        fd: i32,
        offset: u64,
        len: u64,
        iova: u64,
        access: RemoteAccess,
    ) -> Result<MemoryRegion> {
        let _ = (fd, offset, len, iova, access);
        Err(crate::TransferError::Registration(format!("{}: no dma-buf registration", self.port().device)))
    }

    /// Deregisters a region: its keys are refused from now on.
    fn deregister(&self, mr: &MemoryRegion);

    /// A reliable-connected queue pair in [`QpState::Reset`], with a completion queue
    /// of `depth` entries.
    fn create_qp(&self, depth: u32) -> Result<Box<dyn QueuePair>>;
}

/// A reliable-connected queue pair and its (send) completion queue.
pub trait QueuePair: Send {
    /// This queue pair's address, for the peer.
    fn address(&self) -> QpAddress;

    /// The current state.
    fn state(&self) -> QpState;

    /// RESET -> INIT.
    fn to_init(&mut self) -> Result<()>;

    /// INIT -> RTR: connected to `remote`, with path MTU `mtu` bytes.
    fn to_rtr(&mut self, remote: &QpAddress, mtu: u32) -> Result<()>;

    /// RTR -> RTS.
    fn to_rts(&mut self) -> Result<()>;

    /// Any state -> ERR: outstanding work requests complete as flushed.
    fn to_error(&mut self);

    /// The path MTU set at RTR (0 before).
    fn path_mtu(&self) -> u32;

    /// Posts `batch` with one doorbell; each request is signaled.
    ///
    /// # Safety
    /// Every local range must stay valid for its operation (readable for a WRITE,
    /// writable and otherwise unused for a READ) until its completion is polled.
    unsafe fn post(&mut self, batch: &[WorkRequest]) -> Result<()>;

    /// Appends the completions available to `out`, waiting at most `wait` for the
    /// first; the number appended.
    fn poll(&mut self, out: &mut Vec<Completion>, wait: Duration) -> Result<usize>;
}

/// Settings of the [`RdmaTransport`].
#[derive(Clone, Debug)]
pub struct RdmaConfig {
    /// Queue pairs per NIC pair in each peer's pool (default 2).
    pub qps_per_nic: usize,
    /// Largest number of work requests in one post (one doorbell) (default 64).
    pub max_batch: usize,
    /// Requests larger than this are cut and striped over NICs and queue pairs
    /// (default 1 MiB).
    pub stripe: usize,
    /// A request not completed this long after it started fails with
    /// [`TransferError::TimedOut`](crate::TransferError::TimedOut) (default 10 s).
    pub deadline: Duration,
    /// Reconnections tried when a peer's link breaks during a transfer (default 3).
    pub retries: u32,
    /// First wait before a reconnection; doubled each time (default 20 ms).
    pub backoff: Duration,
    /// Local buffers whose registration is kept for reuse (default 1024).
    pub registration_cache: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        Self {
            qps_per_nic: 2,
            max_batch: 64,
            stripe: 1 << 20,
            deadline: Duration::from_secs(10),
            retries: 3,
            backoff: Duration::from_millis(20),
            registration_cache: 1024,
        }
    }
}

/// Whether this host has an RDMA device (a non-empty `/sys/class/infiniband`).
pub fn rdma_device_present() -> bool {
    std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some())
}
