//! `StoreError`, the reference's error type, and how the engine's errors map to it.

use std::ffi::NulError;

use crate::codes;

/// Errors returned by Mooncake Store operations: the reference's enum, variant for
/// variant.
///
/// Every failure of the engine is [`OperationFailed`](StoreError::OperationFailed)
/// carrying the reference's numeric code for the same condition (`-704` not found,
/// `-706` leased, `-900` master unreachable, ... see [`crate::codes`]), as with the
/// reference, whose C layer hands back only a code. The one exception is a bad
/// argument, which keeps its message as [`InvalidArgument`](StoreError::InvalidArgument).
/// The full mapping is the table on
/// [`From<mooncake_core::Error>`](#impl-From%3CError%3E-for-StoreError).
///
/// The engine's own [`mooncake_core::Error`] is richer: one variant per condition
/// (`NotFound`, `HasLease`, `NoSpace { needed, largest_free, .. }`, ...), each with
/// its message, and [`mooncake_core::Error::is_retryable`]. Use
/// [`mooncake_core::Store`] directly to get it.
///
/// `#[non_exhaustive]` so adding variants is not a breaking change; downstream
/// matches must include a wildcard arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// A required pointer argument was null. Kept for compatibility: this crate
    /// has no C handle and never returns it.
    #[error("null handle or pointer")]
    NullHandle,

    /// A string argument (key, pattern, hostname, address, segment name) contains
    /// an interior null byte. Refused as the reference refuses it (its C layer takes
    /// C strings), so that keys stay usable by clients of the reference.
    #[error("string argument contains null byte: {0}")]
    InvalidString(#[from] NulError),

    /// The operation failed; the code is the reference's `ErrorCode` for the
    /// condition (see [`crate::codes`]). `health_check` reports 1 (not set up) and 2
    /// (master unreachable) this way, as the reference does.
    #[error("store operation failed with code {0}")]
    OperationFailed(i32),

    /// The requested key does not exist in the store. Kept for compatibility: as in
    /// the reference, methods report a missing key as
    /// `OperationFailed(`[`codes::OBJECT_NOT_FOUND`]`)`, and this variant is
    /// for callers that check [`crate::MooncakeStore::is_exist`] first.
    #[error("key not found")]
    NotFound,

    /// One or more arguments are invalid: lists of different lengths, a pointer
    /// range outside every registered buffer, an empty key or value, an unknown
    /// protocol, a bad master address or regular expression.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The Mooncake shared library could not be loaded. Kept for compatibility:
    /// this crate loads no library and never returns it.
    #[error("failed to load Mooncake shared library: {0}")]
    LibraryLoad(String),

    /// `load_library` was called after the library had been loaded. Kept for
    /// compatibility: never returned.
    #[error("Mooncake shared library already loaded; call load_library() before creating a store")]
    LibraryAlreadyLoaded,
}

/// The engine's errors as the reference reports them:
///
/// | `mooncake_core::Error` | `StoreError` |
/// |---|---|
/// | `NotFound` | `OperationFailed(-704)` (`OBJECT_NOT_FOUND`) |
/// | `AlreadyExists` | `OperationFailed(-705)` (`OBJECT_ALREADY_EXISTS`); the put methods answer `Ok` instead, as the reference does |
/// | `HasLease` | `OperationFailed(-706)` (`OBJECT_HAS_LEASE`) |
/// | `NoSpace` | `OperationFailed(-200)` (`NO_AVAILABLE_HANDLE`) |
/// | `BufferTooSmall` | `OperationFailed(-600)` (`INVALID_PARAMS`, the reference's answer to a too-small buffer) |
/// | `InvalidArgument(msg)` | `InvalidArgument(msg)` |
/// | `UnknownClient` | `OperationFailed(-103)` (`CLIENT_NOT_FOUND`) |
/// | `MasterUnavailable` | `OperationFailed(-900)` (`RPC_FAIL`) |
/// | `Timeout` | `OperationFailed(-901)` (`RPC_TIMEOUT`) |
/// | `Transport` | `OperationFailed(-800)` (`TRANSFER_FAIL`) |
/// | `Corrupted` | `OperationFailed(-801)` (`CHECKSUM_MISMATCH`) |
/// | anything else (`Storage`, `Recovering`, `Moved`, `Coordination`, ...) | `OperationFailed(-1)` (`INTERNAL_ERROR`) |
///
/// The codes are the ones `mooncake-py` returns to Python for the same errors. The
/// message is logged (`tracing`, debug level) before it is dropped.
impl From<mooncake_core::Error> for StoreError {
    fn from(e: mooncake_core::Error) -> Self {
        use mooncake_core::Error as E;
        if let E::InvalidArgument(msg) = &e {
            return StoreError::InvalidArgument(msg.clone());
        }
        let code = mooncake_core::reference_code::of(&e);
        tracing::debug!(error = %e, code, "mooncake_store: operation failed");
        StoreError::OperationFailed(code)
    }
}

impl StoreError {
    /// The code a per-key batch result carries for this error (`batch_put_from`,
    /// `batch_get_into`): the `OperationFailed` code, else `INVALID_PARAMS`.
    pub(crate) fn code(&self) -> i32 {
        match self {
            StoreError::OperationFailed(c) => *c,
            _ => codes::INVALID_PARAMS,
        }
    }
}
