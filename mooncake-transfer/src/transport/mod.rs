//! The [`Transport`] trait: one way of moving bytes to and from a peer's regions,
//! with its requests and counters; one file per implementation.

mod local;
mod shm;
mod tcp;

use std::sync::atomic::{AtomicU64, Ordering};

pub use local::{LocalTransport, LOCAL_SCHEME};
pub use shm::ShmTransport;
pub(crate) use tcp::TcpServer;
pub use tcp::TcpTransport;

use crate::error::Result;
use crate::region::RemoteRegion;

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
}

impl<'a> TransferRequest<'a> {
    /// A request that reads `dst.len()` bytes from `target` at `offset`.
    pub fn read(target: &'a RemoteRegion, offset: u64, dst: &'a mut [u8]) -> Self {
        Self { target, offset, op: TransferOp::Read(dst) }
    }

    /// A request that writes `src` into `target` at `offset`.
    pub fn write(target: &'a RemoteRegion, offset: u64, src: &'a [u8]) -> Self {
        Self { target, offset, op: TransferOp::Write(src) }
    }
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

    /// Byte and error counters, for transports that keep them (reported by
    /// [`TransferEngine::stats`](crate::TransferEngine::stats)).
    fn stats(&self) -> Option<&TransportStats> {
        None
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
