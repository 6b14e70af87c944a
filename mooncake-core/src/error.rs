//! The one error type of the store.

use std::sync::Arc;

use mooncake_alloc::AllocationError;
use mooncake_storage::StorageError;
use mooncake_transfer::TransferError;

/// Everything that can go wrong in a store call. Match on the variant; the message is
/// for people.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No complete object under this key.
    #[error("not found: {0}")]
    NotFound(String),
    /// A put of a key that exists (or is being put). Objects are immutable.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The object is leased to a reader and cannot be removed yet.
    #[error("object has a live lease: {0}")]
    HasLease(String),
    /// No segment has room for the object, even after eviction.
    #[error("no space for {needed} bytes (largest free block {largest_free} bytes): {reason}")]
    NoSpace {
        /// Bytes the request needed (one replica).
        needed: u64,
        /// Largest free block of any candidate segment when the request gave up.
        largest_free: u64,
        /// Why, for people: nothing could be evicted, the object is larger than any
        /// segment, offloads did not finish in time, no segment is mounted.
        reason: String,
    },
    /// The caller's buffer cannot hold the object.
    #[error("buffer too small: object has {needed} bytes, buffer {capacity}")]
    BufferTooSmall {
        /// Size of the object.
        needed: u64,
        /// Size of the buffer given.
        capacity: u64,
    },
    /// Bad input: empty or oversized key or value, bad configuration.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The master cannot be reached, or does not know this client anymore.
    #[error("master unavailable: {0}")]
    MasterUnavailable(String),
    /// The master does not know this client: it expired, or the master restarted.
    /// The client must register again (a `Store` does so by itself).
    #[error("unknown client {0:#x}: register again")]
    UnknownClient(u64),
    /// The call did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// Moving bytes failed.
    #[error("transport: {0}")]
    Transport(#[from] TransferError),
    /// The SSD tier failed: this client's, or another node's (then the source is a
    /// [`StorageError::Remote`] with the message that crossed the network). The
    /// [`StorageError`] is kept as the source, behind an `Arc` so that `Error` stays
    /// `Clone`.
    #[error("storage: {0}")]
    Storage(#[source] Arc<StorageError>),
    /// Every replica read back bytes whose checksum does not match the object's.
    /// The bytes are never returned.
    #[error("corrupted: every replica of {0} failed its checksum")]
    Corrupted(String),
    /// The master restarted moments ago and its clients are still re-mounting their
    /// segments: the object (or the room) may be back in a moment. Retry.
    #[error("master recovering from a restart: {0}")]
    Recovering(String),
    /// Cluster mode: the master asked does not lead the key's slot (it never did, or
    /// its leadership moved or lapsed). Ask `leader`, or read the slot map again.
    #[error("slot {slot} moved{}", .leader.as_deref().map(|l| format!(" to {l}")).unwrap_or_else(|| " (no leader yet)".into()))]
    Moved {
        /// The key's slot (`key_slot`).
        slot: u16,
        /// The RPC address of the slot's leader, as the answering master knows it.
        leader: Option<String>,
    },
    /// Cluster coordination failed: etcd could not be reached or answered an error, or
    /// the cluster's state in etcd is not usable yet (e.g. no master created it).
    /// Retry: etcd may come back, a master may join.
    #[error("cluster coordination: {0}")]
    Coordination(String),
}

impl Error {
    /// Whether the same call may succeed if made again a little later: the master
    /// could not be reached or is recovering, the call timed out, a transfer failed, a
    /// read of the object was in flight (`HasLease`), the master forgot this client
    /// (a `Store` registers again by itself), the key's slot moved to another master
    /// (cluster mode; a `Store` follows it by itself), or cluster coordination failed
    /// (etcd may come back). Not retryable: bad input, objects absent
    /// or present, `NoSpace` (room comes back only when objects are removed), storage
    /// and corruption errors.
    ///
    /// ```
    /// use mooncake_core::Error;
    /// assert!(Error::Timeout("get".into()).is_retryable());
    /// assert!(!Error::NotFound("k".into()).is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::MasterUnavailable(_)
                | Error::Recovering(_)
                | Error::Timeout(_)
                | Error::Transport(_)
                | Error::HasLease(_)
                | Error::UnknownClient(_)
                | Error::Moved { .. }
                | Error::Coordination(_)
        )
    }
}

impl From<AllocationError> for Error {
    fn from(e: AllocationError) -> Self {
        match e {
            AllocationError::InvalidRequest(m) => Error::InvalidArgument(m),
            AllocationError::InvalidAlignment(a) => Error::InvalidArgument(format!("alignment {a}")),
            AllocationError::NoSpace { size, .. } => {
                Error::NoSpace { needed: size, largest_free: 0, reason: e.to_string() }
            }
            other => Error::NoSpace { needed: 0, largest_free: 0, reason: other.to_string() },
        }
    }
}

/// A storage error as a store error: [`StorageError::NotFound`] is
/// [`Error::NotFound`] (the object is not there, whichever tier was asked); anything
/// else is [`Error::Storage`].
impl From<StorageError> for Error {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::NotFound(k) => Error::NotFound(k),
            other => Error::Storage(Arc::new(other)),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
