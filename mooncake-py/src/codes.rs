//! The reference's numeric error codes, and how our errors map to them.
//!
//! Python callers compare return values with these numbers (`-704` for a missing
//! object, `-706` for a leased one, ...), so they are part of the interface and must
//! keep the reference's values.

use mooncake_core::Error;

/// Internal error.
pub const INTERNAL_ERROR: i32 = -1;
/// No mounted segment has that name.
pub const SEGMENT_NOT_FOUND: i32 = -101;
/// The master knows no such client.
pub const CLIENT_NOT_FOUND: i32 = -103;
/// No segment has room for the object.
pub const NO_AVAILABLE_HANDLE: i32 = -200;
/// Bad input: key, size, pointer, configuration, or a store that is not set up.
pub const INVALID_PARAMS: i32 = -600;
/// No object under this key.
pub const OBJECT_NOT_FOUND: i32 = -704;
/// A put of a key that exists (the put forms answer 0 for it, see [`put_status`]).
pub const OBJECT_ALREADY_EXISTS: i32 = -705;
/// A remove of an object a reader holds a lease on.
pub const OBJECT_HAS_LEASE: i32 = -706;
/// Moving bytes failed.
pub const TRANSFER_FAIL: i32 = -800;
/// Every replica failed its checksum.
pub const CHECKSUM_MISMATCH: i32 = -801;
/// The master cannot be reached.
pub const RPC_FAIL: i32 = -900;
/// A call to the master timed out.
pub const RPC_TIMEOUT: i32 = -901;

/// No copy or move task has that id.
pub const TASK_NOT_FOUND: i32 = -1400;

/// `health_check`: connected and the master answers.
pub const HEALTHY: i32 = 0;
/// `health_check`: `setup` not called, or `close` called.
pub const NOT_INITIALIZED: i32 = 1;
/// `health_check`: the master does not answer.
pub const MASTER_UNREACHABLE: i32 = 2;

/// The reference's code for an error of ours.
pub fn code(e: &Error) -> i32 {
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

/// A put's code: like [`status`], except that a key that already exists is a success,
/// as in the reference (objects are immutable: the first value stays, and a second
/// writer of the same key, typically the same KV block, has nothing left to do).
pub fn put_status(res: &mooncake_core::Result<()>) -> i32 {
    match res {
        Err(Error::AlreadyExists(_)) => 0,
        other => status(other),
    }
}

/// 0 for success, else the error's code.
pub fn status(res: &mooncake_core::Result<()>) -> i32 {
    match res {
        Ok(()) => 0,
        Err(e) => code(e),
    }
}
