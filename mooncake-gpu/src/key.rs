//! Keys: their identity as stored in a header, and which owner they go to.

use xxhash_rust::xxh64::xxh64;

use crate::header::KEY_FP_SEED;

/// Identity of a key as stored in a header: `xxh64(key, 0)`, a second
/// fingerprint `xxh64(key, KEY_FP_SEED)`, and the length. A reader accepts an
/// object only if all three match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId {
    /// `xxh64(key, 0)` (`key_hash`).
    pub hash: u64,
    /// `xxh64(key, KEY_FP_SEED)` (`key_fp_hi`).
    pub fp_hi: u64,
    /// Key length in bytes (`key_len`).
    pub len: u32,
}

impl KeyId {
    /// The identity of `key`.
    pub fn of(key: &str) -> Self {
        Self { hash: xxh64(key.as_bytes(), 0), fp_hi: xxh64(key.as_bytes(), KEY_FP_SEED), len: key.len() as u32 }
    }
}

/// Owner rank of `key` among `world_size` owners: `preferred_segment` when
/// given (returned unchanged: it is the caller's rank), else
/// `xxh64(key) % world_size`.
///
/// # Panics
///
/// If `world_size` is 0 and no preferred segment is given.
pub fn route(key: &str, preferred_segment: Option<usize>, world_size: usize) -> usize {
    match preferred_segment {
        Some(p) => p,
        None => {
            assert!(world_size > 0, "world_size must be > 0");
            (xxh64(key.as_bytes(), 0) % world_size as u64) as usize
        }
    }
}
