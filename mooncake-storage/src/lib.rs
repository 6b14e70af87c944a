//! The SSD tier of Mooncake Store: on-disk object layouts, disk eviction that tells
//! the master, `io_uring`/POSIX file I/O, and the staging buffer for remote loads.
//!
//! This crate depends on no other Mooncake crate (but the pure
//! `mooncake-offset-allocator` data structure): it can be used alone as an NVMe object
//! tier. The master-facing parts are traits ([`EvictionListener`]) that the store
//! implements.
//!
//! * [`StorageBackend`]: a crash-safe disk object store. Three layouts:
//!   [`BucketBackend`] (default; objects grouped in buckets of a data file and a meta
//!   file), [`FilePerKeyBackend`] (one file per object in a hash-sharded tree),
//!   [`OffsetAllocatorBackend`] (records in one preallocated file). A
//!   [`BackendFactory`] opens one with the options its owner builds, so that a store
//!   can be served by a backend of your own.
//! * [`DiskEvictionStrategy`]: which unit is evicted when a capacity limit is
//!   reached; [`FifoEviction`] and [`LruEviction`] built in ([`EvictionPolicy`] names
//!   them), an [`EvictionFactory`] makes a fresh one per backend. Eviction is
//!   two-phase (see [`StorageBackend`]): victims leave the index, the
//!   [`EvictionListener`] is told, then files are deleted once in-flight reads finish.
//! * [`IoEngine`]: positional file I/O; [`IoUringEngine`] (thread-local rings;
//!   batched reads reported as each completes, pipelined writes, up to
//!   [`QUEUE_DEPTH`] requests in flight) and [`PosixEngine`], both with optional
//!   `O_DIRECT`.
//! * [`ClientBuffer`]: a staging area with batch leases and a GC, for serving loads
//!   to remote clients.
//! * On-disk formats ([`BucketMeta`], [`RecordHeader`]) and their fuzzed parsers.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use mooncake_storage::{
//!     io_engine, BackendOptions, BucketBackend, BucketConfig, IoKind, LruEviction, NotifyError,
//!     StorageBackend,
//! };
//!
//! let dir = tempfile::tempdir().unwrap();
//! let opts = BackendOptions::default()
//!     .with_io(io_engine(IoKind::Uring, false)) // POSIX if io_uring is unavailable
//!     .with_capacity(64 << 20)
//!     .with_eviction(LruEviction::new())
//!     .with_listener(Arc::new(|keys: &[String]| -> Result<(), NotifyError> {
//!         println!("tell the master: {keys:?} left the disk");
//!         Ok(())
//!     }));
//! let disk = BucketBackend::open(dir.path(), opts, BucketConfig::default()).unwrap();
//! disk.batch_offload(&[("a", b"hello".as_slice()), ("b", b"world".as_slice())]);
//! let mut buf = [0u8; 16];
//! let n = disk.load("a", &mut buf).unwrap();
//! assert_eq!(&buf[..n], b"hello");
//! drop(disk);
//!
//! // After a restart every intact object is found again.
//! let disk = BucketBackend::open(dir.path(), BackendOptions::default(), BucketConfig::default()).unwrap();
//! let mut keys = Vec::new();
//! disk.scan_meta(&mut |m| keys.push(m.key.clone()));
//! keys.sort();
//! assert_eq!(keys, ["a", "b"]);
//! ```
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod backend;
mod error;
mod eviction;
mod io;
mod meta;
mod staging;

pub use backend::{
    BackendFactory, BackendOptions, BackendStats, BucketBackend, BucketConfig, DiskEvictionReport, EvictionListener,
    FilePerKeyBackend, NotifyError, ObjectMeta, OffsetAllocatorBackend, StorageBackend,
};
pub use error::{Result, StorageError};
pub use eviction::{
    DiskEvictionStrategy, EvictionFactory, EvictionPolicy, FifoEviction, LruEviction, UnitId, UnitInfo,
};
pub use io::{
    direct_io_supported, io_engine, AlignedBuf, IoEngine, IoFile, IoKind, IoUringEngine, OpenMode, PosixEngine,
    RawNext, RawRead, RawWrite, RawWriteSource, ReadOp, WriteData, WriteNext, WriteOp, WriteSource, IO_ALIGN,
    QUEUE_DEPTH,
};
pub use meta::{
    parse_bucket_meta, parse_record_header, BucketEntry, BucketMeta, RecordHeader, MAX_BUCKET_DATA_LEN, MAX_KEY_LEN,
};
pub use staging::{load_into_staging, BatchLease, BufferLocation, ClientBuffer, GcThread, SlotGuard, StagingStats};

#[cfg(test)]
pub(crate) mod test_support {
    use std::path::PathBuf;

    /// A directory for test files that is not tmpfs (so O_DIRECT works).
    pub(crate) fn test_root() -> PathBuf {
        let tmp = std::env::temp_dir();
        let root = if is_tmpfs(&tmp) { PathBuf::from("/var/tmp") } else { tmp };
        std::fs::create_dir_all(&root).ok();
        root
    }

    fn is_tmpfs(p: &std::path::Path) -> bool {
        use std::os::unix::ffi::OsStrExt;
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else { return false };
        // SAFETY: statfs is plain data; zeroed is a valid initial value.
        let mut s: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a valid NUL-terminated path and `s` a valid out-pointer.
        let r = unsafe { libc::statfs(c.as_ptr(), &mut s) };
        r == 0 && s.f_type == libc::TMPFS_MAGIC
    }
}
