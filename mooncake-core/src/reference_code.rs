//! The reference's numeric error codes (its `ErrorCode`), and which one each
//! [`Error`] is.
//!
//! The reference-compatible layers (the Python binding, the `mooncake_store` crate)
//! hand these numbers to callers that compare with them (`-704` for a missing object,
//! `-706` for a leased one, ...), so they keep the reference's values. Native users
//! match on [`Error`] instead.

use crate::Error;

/// Internal error: a failure with no closer code (SSD tier, cluster coordination, ...).
pub const INTERNAL_ERROR: i32 = -1;
/// No mounted segment has that name.
pub const SEGMENT_NOT_FOUND: i32 = -101;
/// The master no longer knows this client (it expired, or the master restarted).
pub const CLIENT_NOT_FOUND: i32 = -103;
/// No segment has room for the object, even after eviction (callers such as vLLM
/// treat it as back-pressure).
pub const NO_AVAILABLE_HANDLE: i32 = -200;
/// Bad input: key, size, pointer, configuration, a buffer too small or outside every
/// registered buffer, or a store that is not set up.
pub const INVALID_PARAMS: i32 = -600;
/// No object under this key.
pub const OBJECT_NOT_FOUND: i32 = -704;
/// An object exists under this key.
pub const OBJECT_ALREADY_EXISTS: i32 = -705;
/// A reader holds a lease on the object: it cannot be removed yet.
pub const OBJECT_HAS_LEASE: i32 = -706;
/// Moving the bytes failed.
pub const TRANSFER_FAIL: i32 = -800;
/// Every replica failed its checksum.
pub const CHECKSUM_MISMATCH: i32 = -801;
/// The master cannot be reached.
pub const RPC_FAIL: i32 = -900;
/// A call to the master timed out.
pub const RPC_TIMEOUT: i32 = -901;
/// No copy or move task has that id.
pub const TASK_NOT_FOUND: i32 = -1400;

/// The reference's code for `e`.
pub fn of(e: &Error) -> i32 {
    match e {
        Error::NotFound(_) => OBJECT_NOT_FOUND,
        Error::AlreadyExists(_) => OBJECT_ALREADY_EXISTS,
        Error::HasLease(_) => OBJECT_HAS_LEASE,
        Error::NoSpace { .. } => NO_AVAILABLE_HANDLE,
        // The reference answers a too-small buffer with INVALID_PARAMS too.
        Error::BufferTooSmall { .. } | Error::InvalidArgument(_) => INVALID_PARAMS,
        Error::MasterUnavailable(_) => RPC_FAIL,
        Error::UnknownClient(_) => CLIENT_NOT_FOUND,
        Error::Timeout(_) => RPC_TIMEOUT,
        Error::Transport(_) => TRANSFER_FAIL,
        Error::Corrupted(_) => CHECKSUM_MISMATCH,
        _ => INTERNAL_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_the_reference_codes() {
        assert_eq!(of(&Error::NotFound("k".into())), -704);
        assert_eq!(of(&Error::HasLease("k".into())), -706);
        assert_eq!(of(&Error::InvalidArgument("x".into())), -600);
        assert_eq!(of(&Error::BufferTooSmall { needed: 2, capacity: 1 }), -600);
        assert_eq!(of(&Error::MasterUnavailable("m".into())), -900);
        assert_eq!(of(&Error::Corrupted("k".into())), -801);
    }
}
