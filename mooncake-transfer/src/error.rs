//! The one error type of the transfer layer.

/// Why a transfer (or a region registration) failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// The request touches bytes outside the region the serving engine registered.
    /// Nothing was read or written.
    #[error("out of bounds: offset {offset} + len {len} exceeds region {region} of {region_len} bytes")]
    OutOfBounds {
        /// Region addressed.
        region: u64,
        /// First byte addressed.
        offset: u64,
        /// Bytes addressed.
        len: u64,
        /// Registered length of the region.
        region_len: u64,
    },
    /// No engine answers at this endpoint (it was dropped, or never existed).
    #[error("unknown endpoint {0}")]
    UnknownEndpoint(String),
    /// The region may be read by peers but not written (see
    /// [`RegisteredRegion::peers_may_write`](crate::RegisteredRegion::peers_may_write)).
    /// Nothing was written.
    #[error("region {region} is read-only: peers may not write it")]
    ReadOnly {
        /// Region addressed.
        region: u64,
    },
    /// The endpoint exists but has no region with this id (unregistered, or never).
    #[error("endpoint {endpoint} has no region {region}")]
    UnknownRegion {
        /// Endpoint asked.
        endpoint: String,
        /// Region id asked.
        region: u64,
    },
    /// No transport of this engine can reach the target.
    #[error("no transport reaches endpoint {0}")]
    Unreachable(String),
    /// The connection to a peer failed.
    #[error("i/o with peer: {0}")]
    Io(String),
    /// A peer sent bytes that are not the transfer protocol.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The peer requires a shared secret this engine does not have, or refused the
    /// one it proved.
    #[error("authentication with peer failed: {0}")]
    Auth(String),
    /// A region of zero bytes, or memory that could not be mapped.
    #[error("cannot register region: {0}")]
    Registration(String),
    /// The request did not complete before its deadline; the link that carried it
    /// was reset (nothing of it runs afterwards).
    #[error("deadline exceeded: {0}")]
    TimedOut(String),
    /// A transport was asked for that needs a device this host lacks (RDMA).
    #[error("no device: {0}")]
    NoDevice(String),
}

/// Result alias of this crate.
pub type Result<T, E = TransferError> = std::result::Result<T, E>;
