//! The reference's numeric error codes that this crate reports in
//! [`StoreError::OperationFailed`](crate::StoreError::OperationFailed) and in the
//! per-key results of the batch methods.
//!
//! They are the values of the reference's `ErrorCode` (`mooncake-store/include/types.h`),
//! which its C layer hands to its Rust crate unchanged, so code that compares
//! with these numbers keeps working. `mooncake-py` returns the same numbers to Python.

/// Internal error: a failure with no closer code (SSD tier, cluster coordination, ...).
pub const INTERNAL_ERROR: i32 = -1;
/// The master no longer knows this client (it expired, or the master restarted).
pub const CLIENT_NOT_FOUND: i32 = -103;
/// No segment has room for the object, even after eviction.
pub const NO_AVAILABLE_HANDLE: i32 = -200;
/// Bad input: a buffer too small or outside every registered buffer, or a store that
/// is not set up.
pub const INVALID_PARAMS: i32 = -600;
/// No object under this key.
pub const OBJECT_NOT_FOUND: i32 = -704;
/// An object exists under this key (the put methods answer success for it, as the
/// reference does: objects are immutable and the first value stays).
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

/// `health_check`: `setup` has not succeeded (reported as `OperationFailed(1)`).
pub const HEALTH_NOT_INITIALIZED: i32 = 1;
/// `health_check`: the master does not answer (reported as `OperationFailed(2)`).
pub const HEALTH_MASTER_UNREACHABLE: i32 = 2;
