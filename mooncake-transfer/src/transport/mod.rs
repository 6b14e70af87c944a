//! The [`Transport`] trait: one way of moving bytes to and from a peer's regions,
//! with its requests and counters; one file per implementation.

mod local;
mod shm;
mod tcp;

use std::sync::atomic::{AtomicU64, Ordering};

pub use local::{LocalTransport, LOCAL_SCHEME};
pub use shm::ShmTransport;
pub use tcp::TcpTransport;
pub(crate) use tcp::{ServeLimits, TcpServer};

use crate::error::Result;
use crate::region::{RegisteredRegion, RemoteRegion};

/// What a request does with its local buffer.
#[derive(Debug)]
pub enum TransferOp<'a> {
    /// Copy bytes of the remote region into this buffer.
    Read(&'a mut [u8]),
    /// Copy this buffer into the remote region.
    Write(&'a [u8]),
}

impl TransferOp<'_> {
    /// Number of bytes the request moves.
    pub fn len(&self) -> usize {
        match self {
            TransferOp::Read(b) => b.len(),
            TransferOp::Write(b) => b.len(),
        }
    }

    /// Whether the request moves no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One request of a batch: move `op`'s bytes to or from `target` at `offset`.
///
/// The local side is a borrowed slice, so the borrow checker guarantees the buffer
/// outlives the (blocking) transfer.
#[derive(Debug)]
pub struct TransferRequest<'a> {
    /// The remote region addressed.
    pub target: &'a RemoteRegion,
    /// Offset inside the remote region.
    pub offset: u64,
    /// Direction and local buffer.
    pub op: TransferOp<'a>,
    checksum: Checksum,
    landed: Option<Landed<'a>>,
}

/// Told of each range of a read's buffer once its bytes have landed, while the rest
/// is still in flight: `(at, len)`, `at` counted from the buffer's first byte. Called
/// on the transport's threads.
pub type OnLanded<'a> = &'a (dyn Fn(u64, usize) + Sync);

/// A read's [`OnLanded`] hook (a newtype, so that requests stay `Debug`).
#[derive(Clone, Copy)]
struct Landed<'a>(OnLanded<'a>);

impl std::fmt::Debug for Landed<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Landed(..)")
    }
}

/// Whether a request's crc32c was asked for, and taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Checksum {
    NotAsked,
    Asked,
    Taken(u32),
}

impl<'a> TransferRequest<'a> {
    /// A request that reads `dst.len()` bytes from `target` at `offset`.
    pub fn read(target: &'a RemoteRegion, offset: u64, dst: &'a mut [u8]) -> Self {
        Self { target, offset, op: TransferOp::Read(dst), checksum: Checksum::NotAsked, landed: None }
    }

    /// A request that writes `src` into `target` at `offset`.
    pub fn write(target: &'a RemoteRegion, offset: u64, src: &'a [u8]) -> Self {
        Self { target, offset, op: TransferOp::Write(src), checksum: Checksum::NotAsked, landed: None }
    }

    /// Asks for the crc32c ([`checksum::crc32c`](crate::checksum::crc32c)) of the
    /// local bytes: a transport that moves them through its own hands (TCP) takes it
    /// piece by piece while each piece is in the CPU's cache, which costs far less than
    /// a pass over the whole buffer afterwards. Read it with [`checksum`](Self::checksum).
    pub fn with_checksum(mut self) -> Self {
        self.checksum = Checksum::Asked;
        self
    }

    /// Asks to be told of the ranges of a read's buffer as they land ([`OnLanded`]),
    /// so that the caller can pass them on (a DMA to a GPU) while the rest is in
    /// flight. A transport may tell of some ranges, of all, or of none (the local and
    /// shared-memory transports copy in one go; TCP tells of each piece it received);
    /// a range told of holds its final bytes, and is not written again unless the
    /// transport retries the request after a broken connection, with the same bytes.
    /// The whole buffer holds its bytes once the request succeeded. Writes ignore it.
    pub fn on_landed(mut self, hook: OnLanded<'a>) -> Self {
        self.landed = Some(Landed(hook));
        self
    }

    /// The hook [`on_landed`](Self::on_landed) set (for transport implementations).
    pub fn landed_hook(&self) -> Option<OnLanded<'a>> {
        self.landed.map(|l| l.0)
    }

    /// Whether [`with_checksum`](Self::with_checksum) asked for the crc32c (for
    /// transport implementations).
    pub fn checksum_asked(&self) -> bool {
        self.checksum != Checksum::NotAsked
    }

    /// Records the crc32c of the local bytes (for transport implementations: after a
    /// read has filled them, or of the bytes a write sent). It must be the sum of
    /// exactly those bytes: the store checks reads against it instead of summing them
    /// again, and records it as a written object's checksum.
    pub fn set_checksum(&mut self, crc: u32) {
        self.checksum = Checksum::Taken(crc);
    }

    /// The crc32c of the local bytes, when it was asked for, the request succeeded and
    /// its transport took it; `None` otherwise (transports that copy with memcpy or
    /// a NIC leave it to the caller, who then sums the buffer itself).
    pub fn checksum(&self) -> Option<u32> {
        match self.checksum {
            Checksum::Taken(crc) => Some(crc),
            _ => None,
        }
    }
}

/// Moves `req`'s bytes between its local buffer and `region` by memcpy (the `local`
/// and `shm` transports). A request that asks for its checksum has it taken on the
/// way (`stream_copy.rs`: folded into the copy where the CPU can, else each piece
/// summed right after its copy while it is in the cache). A write to a region peers
/// may not write is refused.
pub(crate) fn copy_with_region(region: &RegisteredRegion, req: &mut TransferRequest<'_>) -> Result<()> {
    let (base, asked) = (req.offset, req.checksum_asked());
    let crc = match &mut req.op {
        TransferOp::Read(dst) if asked => region.copy_out_summed(base, dst)?,
        TransferOp::Read(dst) => return region.copy_out(base, dst),
        TransferOp::Write(_) if !region.peers_may_write() => {
            return Err(crate::error::TransferError::ReadOnly { region: region.id() })
        }
        // Copied with streaming stores from 256 KiB, summed on the way.
        TransferOp::Write(src) if asked => region.copy_in_summed(base, src)?,
        TransferOp::Write(src) => return region.copy_in(base, src),
    };
    req.set_checksum(crc);
    Ok(())
}

/// A way of reaching peers' registered regions (memcpy, TCP, shared memory, RDMA…).
///
/// Implementations must check every request against the regions the *serving* engine
/// registered and refuse out-of-bounds requests without touching memory.
///
/// # Example: a transport that counts bytes and delegates
/// ```
/// use mooncake_transfer::{LocalTransport, Result, TransferEngine, TransferRequest, Transport};
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
///
/// #[derive(Default)]
/// struct Counting { inner: LocalTransport, bytes: AtomicU64 }
/// impl Transport for Counting {
///     fn name(&self) -> &str { "counting" }
///     fn can_reach(&self, endpoint: &str) -> bool { self.inner.can_reach(endpoint) }
///     fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
///         let n: usize = requests.iter().map(|r| r.op.len()).sum();
///         self.bytes.fetch_add(n as u64, Ordering::Relaxed);
///         self.inner.transfer(requests)
///     }
/// }
///
/// let counting = Arc::new(Counting::default());
/// let engine = TransferEngine::builder().transport(counting.clone()).build()?;
/// let region = engine.register_region(4096)?;
/// engine.write(&engine.remote(region.id()), 0, b"hello")?;
/// assert_eq!(counting.bytes.load(Ordering::Relaxed), 5);
/// # Ok::<(), mooncake_transfer::TransferError>(())
/// ```
pub trait Transport: Send + Sync {
    /// Short name for logs and stats (`"local"`, `"tcp"`, …).
    fn name(&self) -> &str;

    /// Whether this transport can serve requests to `endpoint`.
    fn can_reach(&self, endpoint: &str) -> bool;

    /// Executes every request of the batch, blocking until all are done, and returns
    /// one result per request, in order.
    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>>;

    /// What this transport can do for requests to `endpoint` beyond moving bytes;
    /// callers choose how to use it from this, never from its name. The default
    /// claims nothing (a caller then sums the bytes itself and stages device memory).
    fn capabilities(&self, endpoint: &str) -> Capabilities {
        let _ = endpoint;
        Capabilities::default()
    }

    /// `target` mapped into this process, for a caller that moves its bytes with
    /// something other than this transport (a DMA engine). `None` if this transport
    /// does not map peers' memory ([`Capabilities::maps_peer_memory`]).
    fn map_region(&self, target: &RemoteRegion) -> Option<Result<MappedRegion>> {
        let _ = target;
        None
    }

    /// Byte and error counters, for transports that keep them (reported by
    /// [`TransferEngine::stats`](crate::TransferEngine::stats)).
    fn stats(&self) -> Option<&TransportStats> {
        None
    }
}

/// What a [`Transport`] can do for requests to one endpoint, besides moving bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// The calling thread moves the bytes itself, copying through a mapping of the
    /// peer's memory (`local`, `shm`): a checksum asked for is taken piece by piece
    /// on that thread, which for a large object is slower than one parallel sum
    /// afterwards.
    pub maps_peer_memory: bool,
    /// A request asked for its checksum ([`TransferRequest::with_checksum`]) gets
    /// it, taken as the bytes move (on the lane that moves them, for `tcp`).
    pub sums_in_flight: bool,
    /// Device memory moves to and from this peer directly
    /// ([`RdmaTransport::transfer_device`](crate::RdmaTransport::transfer_device)),
    /// with no host copy.
    pub moves_device_memory: bool,
}

/// A peer's region mapped into this process ([`Transport::map_region`]): it stays
/// mapped while this value lives.
pub struct MappedRegion {
    keep: std::sync::Arc<dyn Send + Sync>,
    ptr: *mut u8,
    len: u64,
    writable: bool,
}

// SAFETY: the value only names memory that `keep` keeps mapped; it hands out no
// reference, and every access through the pointer is the caller's to make sound.
unsafe impl Send for MappedRegion {}
// SAFETY: as `Send`.
unsafe impl Sync for MappedRegion {}

impl MappedRegion {
    /// A mapping of `len` bytes at `ptr`, valid while `keep` lives; `writable`:
    /// whether the region's peers may write it.
    pub(crate) fn new(keep: std::sync::Arc<dyn Send + Sync>, ptr: *mut u8, len: u64, writable: bool) -> Self {
        Self { keep, ptr, len, writable }
    }

    /// Whether the region may be written through this mapping. A region its owner
    /// registered read-only ([`RegisteredRegion::peers_may_write`]) may not: a
    /// same-host peer's is mapped read-only (a write through it faults).
    pub fn is_writable(&self) -> bool {
        self.writable
    }

    /// The address of byte `offset` of the region, if `offset + len` bytes fit in
    /// it. Valid while this value lives; the bytes may be written by others (the
    /// peer, other clients) at any time, so a reader checks what it read. Written
    /// through only if [`is_writable`](Self::is_writable).
    pub fn range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        // SAFETY: `offset <= end <= self.len`: inside the mapping.
        (end <= self.len).then(|| unsafe { self.ptr.add(offset as usize) })
    }

    /// The region's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl std::fmt::Debug for MappedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let _ = &self.keep;
        f.debug_struct("MappedRegion").field("len", &self.len).finish()
    }
}

/// Counters of a transport (bytes it moved itself: a transport that hands a request
/// to another one does not count it).
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Bytes read from peers.
    pub bytes_read: AtomicU64,
    /// Bytes written to peers.
    pub bytes_written: AtomicU64,
    /// Requests that failed.
    pub errors: AtomicU64,
}

impl TransportStats {
    /// The counters now, named after `transport`.
    pub fn snapshot(&self, transport: &str) -> TransferStats {
        TransferStats {
            transport: transport.to_owned(),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }
}

/// The counters of one transport at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TransferStats {
    /// The transport's [`name`](Transport::name).
    pub transport: String,
    /// Bytes read from peers.
    pub bytes_read: u64,
    /// Bytes written to peers.
    pub bytes_written: u64,
    /// Requests that failed.
    pub errors: u64,
}
