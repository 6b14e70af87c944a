//! The reference's numeric error codes, and how our errors map to them.
//!
//! Python callers compare return values with these numbers (`-704` for a missing
//! object, `-706` for a leased one, ...), so they are part of the interface and must
//! keep the reference's values: the table and the mapping are `mooncake-core`'s
//! (`mooncake_core::reference_code`, shared with the `mooncake_store` crate).

pub use mooncake_core::reference_code::{
    INVALID_PARAMS, OBJECT_NOT_FOUND, RPC_FAIL, SEGMENT_NOT_FOUND, TASK_NOT_FOUND,
};
use mooncake_core::Error;

/// `health_check`: connected and the master answers.
pub const HEALTHY: i32 = 0;
/// `health_check`: `setup` not called, or `close` called.
pub const NOT_INITIALIZED: i32 = 1;
/// `health_check`: the master does not answer.
pub const MASTER_UNREACHABLE: i32 = 2;

/// The reference's code for an error of ours.
pub fn code(e: &Error) -> i32 {
    mooncake_core::reference_code::of(e)
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
