//! The error type of the crate.

use std::io;

/// Result alias of the crate.
pub type Result<T, E = StorageError> = std::result::Result<T, E>;

/// Everything that can go wrong in the SSD tier.
///
/// Bad on-disk input (torn writes, corrupt metadata, bit rot) is always reported as
/// [`StorageError::Corrupted`] or makes the object absent ([`StorageError::NotFound`]);
/// it never panics and never yields bytes of the wrong object.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The key is not stored (never written, removed, evicted, or lost to a crash).
    #[error("not found: {0}")]
    NotFound(String),
    /// Objects are immutable: a key that is already stored cannot be written again.
    #[error("already exists: {0}")]
    AlreadyExists(String),
    /// The write does not fit, even after evicting everything that may be evicted.
    #[error("no space: {needed} bytes needed, capacity {capacity}")]
    NoSpace {
        /// Bytes the write needs.
        needed: u64,
        /// Capacity of the tier.
        capacity: u64,
    },
    /// The caller's buffer is smaller than the object.
    #[error("buffer too small: object has {needed} bytes, buffer {got}")]
    BufferTooSmall {
        /// Length of the object.
        needed: u64,
        /// Length of the buffer given.
        got: u64,
    },
    /// On-disk data failed a check (checksum, bounds, magic, truncation).
    #[error("corrupted {what}: {detail}")]
    Corrupted {
        /// What was being read (a file, an object key).
        what: String,
        /// Which check failed.
        detail: String,
    },
    /// An argument is out of range (empty key, key over 4096 bytes, empty value, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The [`EvictionListener`](crate::EvictionListener) refused a notification; the
    /// keys are queued and retried.
    #[error("eviction notification failed: {0}")]
    Notification(String),
    /// An operating-system I/O error.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
    /// The SSD tier of another node failed (or answered nonsense); its message, as it
    /// crossed the network.
    #[error("{0}")]
    Remote(String),
}

/// Errors are equal when their variants and fields are; two I/O errors when their
/// kind and message are (an [`io::Error`] has no equality of its own).
impl PartialEq for StorageError {
    fn eq(&self, other: &Self) -> bool {
        use StorageError::*;
        match (self, other) {
            (NotFound(a), NotFound(b))
            | (AlreadyExists(a), AlreadyExists(b))
            | (InvalidArgument(a), InvalidArgument(b))
            | (Notification(a), Notification(b))
            | (Remote(a), Remote(b)) => a == b,
            (NoSpace { needed: a, capacity: b }, NoSpace { needed: c, capacity: d })
            | (BufferTooSmall { needed: a, got: b }, BufferTooSmall { needed: c, got: d }) => (a, b) == (c, d),
            (Corrupted { what: a, detail: b }, Corrupted { what: c, detail: d }) => (a, b) == (c, d),
            (Io(a), Io(b)) => a.kind() == b.kind() && a.to_string() == b.to_string(),
            _ => false,
        }
    }
}

impl StorageError {
    /// A [`StorageError::Corrupted`] error.
    pub fn corrupted(what: impl Into<String>, detail: impl Into<String>) -> Self {
        StorageError::Corrupted { what: what.into(), detail: detail.into() }
    }

    /// Whether this is [`StorageError::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, StorageError::NotFound(_))
    }
}
