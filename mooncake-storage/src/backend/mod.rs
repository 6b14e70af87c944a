//! The [`StorageBackend`] trait, its options, the [`EvictionListener`] that tells the
//! master of evictions, and the [`BackendFactory`] a store opens its backend with.
//!
//! The three built-in layouts live one per file ([`bucket`], [`file_per_key`],
//! [`offset_allocator`]); what they share — the two-phase eviction, its report and
//! the stats — is written once in [`skeleton`].

mod bucket;
mod file_per_key;
mod files;
mod offset_allocator;
mod skeleton;

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

pub use bucket::{BucketBackend, BucketConfig};
pub use file_per_key::FilePerKeyBackend;
pub use offset_allocator::OffsetAllocatorBackend;

use crate::error::{Result, StorageError};
use crate::eviction::{DiskEvictionStrategy, FifoEviction};
use crate::io::{io_engine, IoEngine, IoKind};

/// What a backend knows of a stored object.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjectMeta {
    /// The key.
    pub key: String,
    /// Length of the value in bytes.
    pub len: u64,
    /// crc32c of the value.
    pub checksum: u32,
    /// The object's generation: a number its writer handed with it
    /// ([`StorageBackend::batch_offload_generations`]), kept on disk beside the value,
    /// so that after a restart a store can tell an old copy of a key from a newer one.
    /// 0: none (written by [`StorageBackend::batch_offload`], by a backend that keeps
    /// none, or read from a file of a version without generations).
    pub generation: u64,
}

/// The error a listener returns.
pub type NotifyError = Box<dyn std::error::Error + Send + Sync>;

/// Told which keys left the disk by eviction, before their files are deleted.
///
/// The store implements it as `BatchEvictDiskReplica(keys)` to the master (which
/// removes only the disk replicas of those keys). It is called without any backend
/// lock held, but must not write to the same backend (a write may be waiting on the
/// notification queue). Closures `Fn(&[String]) -> Result<(), NotifyError>` implement it.
pub trait EvictionListener: Send + Sync {
    /// `keys` were evicted from the disk. An error queues them for a retry.
    fn on_evicted(&self, keys: &[String]) -> Result<(), NotifyError>;
}

impl<F> EvictionListener for F
where
    F: Fn(&[String]) -> Result<(), NotifyError> + Send + Sync,
{
    fn on_evicted(&self, keys: &[String]) -> Result<(), NotifyError> {
        self(keys)
    }
}

/// Options every backend takes.
pub struct BackendOptions {
    /// The I/O engine (default: `io_uring` without `O_DIRECT`, POSIX if unavailable).
    pub io: Arc<dyn IoEngine>,
    /// Byte limit of the tier; `None`: no limit and no eviction (writes that do not
    /// fit the disk fail). For the offset-allocator backend the limit is also capped by
    /// the data file's size.
    pub capacity: Option<u64>,
    /// Which unit goes first when space is needed (default [`FifoEviction`]).
    pub eviction: Box<dyn DiskEvictionStrategy>,
    /// Told of every eviction before files are deleted.
    pub listener: Option<Arc<dyn EvictionListener>>,
    /// Longest wait for in-flight reads of an evicted unit (default 10 s).
    pub eviction_wait: Duration,
    /// Check each value's crc32c when it is loaded (default `true`).
    pub verify_on_load: bool,
    /// Most read handles kept open between loads (a bucket's data file, an object's
    /// file): beyond it the oldest opened is closed (reopened when read again), so a
    /// large tier cannot take every descriptor of the process. Default: a quarter of
    /// the process's soft limit on open files when the backend opens, 64 ..= 65,536.
    pub max_open_files: usize,
}

/// The default [`BackendOptions::max_open_files`]: a quarter of the soft limit on
/// open files, 64 ..= 65,536.
fn default_max_open_files() -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit for the call to fill.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 { lim.rlim_cur } else { 1024 };
    usize::try_from(soft / 4).unwrap_or(usize::MAX).clamp(64, 65_536)
}

impl Default for BackendOptions {
    fn default() -> Self {
        BackendOptions {
            io: io_engine(IoKind::Uring, false),
            capacity: None,
            eviction: Box::new(FifoEviction::new()),
            listener: None,
            eviction_wait: Duration::from_secs(10),
            verify_on_load: true,
            max_open_files: default_max_open_files(),
        }
    }
}

impl BackendOptions {
    /// Sets [`io`](Self::io).
    pub fn with_io(mut self, io: Arc<dyn IoEngine>) -> Self {
        self.io = io;
        self
    }
    /// Sets [`capacity`](Self::capacity).
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }
    /// Sets [`eviction`](Self::eviction).
    pub fn with_eviction(mut self, strategy: impl DiskEvictionStrategy + 'static) -> Self {
        self.eviction = Box::new(strategy);
        self
    }
    /// Sets [`eviction`](Self::eviction) from a box.
    pub fn with_eviction_boxed(mut self, strategy: Box<dyn DiskEvictionStrategy>) -> Self {
        self.eviction = strategy;
        self
    }
    /// Sets [`listener`](Self::listener).
    pub fn with_listener(mut self, listener: Arc<dyn EvictionListener>) -> Self {
        self.listener = Some(listener);
        self
    }
    /// Sets [`eviction_wait`](Self::eviction_wait).
    pub fn with_eviction_wait(mut self, wait: Duration) -> Self {
        self.eviction_wait = wait;
        self
    }
    /// Sets [`max_open_files`](Self::max_open_files) (at least 1).
    pub fn with_max_open_files(mut self, files: usize) -> Self {
        self.max_open_files = files.max(1);
        self
    }
}

impl fmt::Debug for BackendOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendOptions")
            .field("io", &self.io.name())
            .field("direct", &self.io.direct())
            .field("capacity", &self.capacity)
            .field("eviction", &self.eviction.name())
            .field("listener", &self.listener.is_some())
            .field("eviction_wait", &self.eviction_wait)
            .field("verify_on_load", &self.verify_on_load)
            .field("max_open_files", &self.max_open_files)
            .finish()
    }
}

/// A snapshot of a backend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendStats {
    /// Backend name.
    pub backend: &'static str,
    /// I/O engine name.
    pub io: &'static str,
    /// The capacity limit, if any.
    pub capacity: Option<u64>,
    /// Bytes the stored objects take on disk (with padding), including space
    /// reserved by writes in progress.
    pub used_bytes: u64,
    /// Objects stored.
    pub objects: u64,
    /// Evictable units (buckets, or objects).
    pub units: u64,
    /// Objects evicted since open.
    pub evicted_objects: u64,
    /// Units evicted since open.
    pub evicted_units: u64,
    /// Evicted keys whose notification failed and awaits a retry.
    pub pending_notifications: u64,
    /// Read handles closed to stay within [`BackendOptions::max_open_files`] (each
    /// reopened by its next read).
    pub handles_closed: u64,
}

/// What an explicit [`StorageBackend::evict`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskEvictionReport {
    /// Keys evicted.
    pub keys: Vec<String>,
    /// Bytes freed.
    pub bytes_freed: u64,
    /// Whether the listener accepted the notification (or there is no listener).
    pub notified: bool,
}

/// A disk object store: the SSD tier of Mooncake Store, usable on its own.
///
/// Objects are immutable (`AlreadyExists` on a second write of a key). Keys are
/// 1..=4096 bytes of UTF-8; values at least one byte. Implementations are
/// [`BucketBackend`] (default), [`FilePerKeyBackend`] and [`OffsetAllocatorBackend`];
/// all are crash-safe (an acknowledged write survives a crash; a torn one is absent
/// after reopening) and recover their index when opened on an existing directory.
///
/// # Two-phase eviction
///
/// When a capacity limit is set ([`BackendOptions::capacity`]) and a write does not
/// fit, a built-in backend
/// 1. **prepares** — under its index lock, asks its [`DiskEvictionStrategy`] for
///    victims until the write fits, removes them from the index (from now on reads of
///    their keys fail with [`StorageError::NotFound`]) and reserves the space; no I/O;
/// 2. **notifies** — calls [`EvictionListener::on_evicted`] once with every evicted
///    key (the store implements it as `BatchEvictDiskReplica` to the master). A failed
///    call queues the keys; they are sent again, first, with the next eviction or by
///    [`retry_pending_notifications`](Self::retry_pending_notifications). A key written
///    again before its queued notice is sent is dropped from the queue (the notice is
///    stale);
/// 3. **finalizes** — waits (at most [`BackendOptions::eviction_wait`]) until no read
///    holds a pin on the victims, drops cached file handles, then deletes the files or
///    frees the space.
///
/// The listener is always called before any file is deleted, so the master never
/// points a reader at a deleted file, and a read that was in flight when eviction
/// began completes with the right bytes. A backend of your own that evicts must keep
/// the same order: tell the listener first, delete after.
pub trait StorageBackend: Send + Sync {
    /// Backend name (`"bucket"`, `"file_per_key"`, `"offset_allocator"`).
    fn name(&self) -> &'static str;

    /// Writes `objects` durably (synced before returning), evicting if a capacity
    /// limit is set. One result per object, in order.
    fn batch_offload(&self, objects: &[(&str, &[u8])]) -> Vec<Result<ObjectMeta>>;

    /// [`batch_offload`](Self::batch_offload), each object with its generation
    /// (`(key, value, generation)`), which is kept on disk with the value and reported
    /// by [`object_meta`](Self::object_meta) and [`scan_meta`](Self::scan_meta). The
    /// built-in backends keep it; the default writes with `batch_offload` and keeps
    /// none (reports 0, the oldest generation: a store then re-registers such an object
    /// after a restart only where nothing newer of its key is known).
    fn batch_offload_generations(&self, objects: &[(&str, &[u8], u64)]) -> Vec<Result<ObjectMeta>> {
        let plain: Vec<(&str, &[u8])> = objects.iter().map(|&(k, v, _)| (k, v)).collect();
        self.batch_offload(&plain)
    }

    /// Writes one object; see [`batch_offload`](Self::batch_offload).
    fn offload(&self, key: &str, value: &[u8]) -> Result<ObjectMeta> {
        self.batch_offload(&[(key, value)]).pop().unwrap_or_else(|| Err(StorageError::InvalidArgument("empty".into())))
    }

    /// Length and checksum of a stored object.
    fn object_meta(&self, key: &str) -> Option<ObjectMeta>;

    /// Whether `key` is stored.
    fn exists(&self, key: &str) -> bool {
        self.object_meta(key).is_some()
    }

    /// Reads the value of `key` into the front of `buf`; returns its length.
    /// [`StorageError::BufferTooSmall`] if `buf` is shorter than the value,
    /// [`StorageError::NotFound`] if absent, [`StorageError::Corrupted`] if the bytes
    /// on disk fail their checksum. Counts as an access for the eviction strategy.
    fn load(&self, key: &str, buf: &mut [u8]) -> Result<usize>;

    /// Several loads, submitted together where the engine can. One result per request.
    fn batch_load(&self, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<usize>> {
        requests.iter_mut().map(|(k, b)| self.load(k, b)).collect()
    }

    /// Reads a whole value into a new vector.
    fn load_vec(&self, key: &str) -> Result<Vec<u8>> {
        let meta = self.object_meta(key).ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
        let mut buf = vec![0u8; meta.len as usize];
        let n = self.load(key, &mut buf)?;
        buf.truncate(n);
        Ok(buf)
    }

    /// Removes an object (a user removal: the eviction listener is not called).
    ///
    /// Returns once the removal is durable: the object cannot come back with a crash
    /// or power loss. On an error the object stays stored and readable, so the caller
    /// can try again.
    fn remove(&self, key: &str) -> Result<()>;

    /// Calls `visitor` for every stored object; returns how many. After reopening a
    /// directory this reports every intact object (to re-register them with the
    /// master).
    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize;

    /// A snapshot of sizes and counters.
    fn stats(&self) -> BackendStats;

    /// Runs a two-phase eviction now, freeing at least `bytes` (or everything there
    /// is), in the strategy's order.
    fn evict(&self, bytes: u64) -> Result<DiskEvictionReport>;

    /// Sends the queued notifications of failed evictions again; returns how many
    /// keys were delivered. Fails (and keeps them queued) if the listener fails.
    fn retry_pending_notifications(&self) -> Result<usize>;
}

/// Opens a [`StorageBackend`] in a directory with options it is handed.
///
/// Whoever owns the options — a store builds them from its configuration: the
/// [`EvictionListener`] that tells its master, the capacity, the I/O engine, a fresh
/// [`DiskEvictionStrategy`] — opens the backend through a factory, so that a backend of
/// your own can serve it. Implemented by any
/// `Fn(&Path, BackendOptions) -> Result<B> + Send + Sync` closure or function whose
/// `B` is a backend:
///
/// ```
/// use std::path::Path;
/// use mooncake_storage::{BackendFactory, BackendOptions, BucketBackend, BucketConfig};
///
/// // Buckets of at most 64 objects.
/// let small_buckets = |dir: &Path, options: BackendOptions| {
///     BucketBackend::open(dir, options, BucketConfig { bucket_keys_limit: 64, ..BucketConfig::default() })
/// };
/// let dir = tempfile::tempdir().unwrap();
/// let disk = small_buckets.open(dir.path(), BackendOptions::default()).unwrap();
/// assert_eq!(disk.name(), "bucket");
/// ```
pub trait BackendFactory: Send + Sync {
    /// Opens (creating if needed) the backend in `dir`, recovering what it holds.
    fn open(&self, dir: &Path, options: BackendOptions) -> Result<Arc<dyn StorageBackend>>;
}

impl<F, B> BackendFactory for F
where
    F: Fn(&Path, BackendOptions) -> Result<B> + Send + Sync,
    B: StorageBackend + 'static,
{
    fn open(&self, dir: &Path, options: BackendOptions) -> Result<Arc<dyn StorageBackend>> {
        Ok(Arc::new(self(dir, options)?))
    }
}
