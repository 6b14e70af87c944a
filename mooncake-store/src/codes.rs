//! The reference's numeric error codes that this crate reports in
//! [`StoreError::OperationFailed`](crate::StoreError::OperationFailed) and in the
//! per-key results of the batch methods.
//!
//! They are the values of the reference's `ErrorCode` (`mooncake-store/include/types.h`),
//! which its C layer hands to its Rust crate unchanged, so code that compares
//! with these numbers keeps working. The table is `mooncake_core::reference_code`,
//! which `mooncake-py` returns to Python too.

pub use mooncake_core::reference_code::{
    CHECKSUM_MISMATCH, CLIENT_NOT_FOUND, INTERNAL_ERROR, INVALID_PARAMS, NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, RPC_FAIL, RPC_TIMEOUT, TRANSFER_FAIL,
};

/// `health_check`: `setup` has not succeeded (reported as `OperationFailed(1)`).
pub const HEALTH_NOT_INITIALIZED: i32 = 1;
/// `health_check`: the master does not answer (reported as `OperationFailed(2)`).
pub const HEALTH_MASTER_UNREACHABLE: i32 = 2;
