//! The [`StorageBackend`] trait, its options, and the machinery shared by the
//! backends: two-phase eviction with master notification, and read pins.
//!
//! # Two-phase eviction
//!
//! When a capacity limit is set ([`BackendOptions::capacity`]) and a write does not
//! fit, a backend
//! 1. **prepares** — under its index lock, asks its [`DiskEvictionStrategy`] for
//!    victims until the write fits, removes them from the index (from now on reads of
//!    their keys fail with [`StorageError::NotFound`]) and reserves the space; no I/O;
//! 2. **notifies** — calls [`EvictionListener::on_evicted`] once with every evicted
//!    key (the store implements it as `BatchEvictDiskReplica` to the master). A failed
//!    call queues the keys; they are sent again, first, with the next eviction or by
//!    [`StorageBackend::retry_pending_notifications`]. A key written again before its
//!    queued notice is sent is dropped from the queue (the notice is stale);
//! 3. **finalizes** — waits (at most [`BackendOptions::eviction_wait`]) until no read
//!    holds a pin on the victims, drops cached file handles, then deletes the files or
//!    frees the space.
//!
//! The listener is always called before any file is deleted, so the master never
//! points a reader at a deleted file, and a read that was in flight when eviction
//! began completes with the right bytes.

use std::collections::HashSet;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ahash::AHashSet;
use parking_lot::Mutex;

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
}

/// What an explicit [`StorageBackend::evict`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictionReport {
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
/// [`BucketBackend`](crate::BucketBackend) (default),
/// [`FilePerKeyBackend`](crate::FilePerKeyBackend) and
/// [`OffsetAllocatorBackend`](crate::OffsetAllocatorBackend); all are crash-safe
/// (an acknowledged write survives a crash; a torn one is absent after reopening)
/// and recover their index when opened on an existing directory.
pub trait StorageBackend: Send + Sync {
    /// Backend name (`"bucket"`, `"file_per_key"`, `"offset_allocator"`).
    fn name(&self) -> &'static str;

    /// Writes `objects` durably (synced before returning), evicting if a capacity
    /// limit is set. One result per object, in order.
    fn batch_offload(&self, objects: &[(&str, &[u8])]) -> Vec<Result<ObjectMeta>>;

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
    fn remove(&self, key: &str) -> Result<()>;

    /// Calls `visitor` for every stored object; returns how many. After reopening a
    /// directory this reports every intact object (to re-register them with the
    /// master).
    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize;

    /// A snapshot of sizes and counters.
    fn stats(&self) -> BackendStats;

    /// Runs a two-phase eviction now, freeing at least `bytes` (or everything there
    /// is), in the strategy's order.
    fn evict(&self, bytes: u64) -> Result<EvictionReport>;

    /// Sends the queued notifications of failed evictions again; returns how many
    /// keys were delivered. Fails (and keeps them queued) if the listener fails.
    fn retry_pending_notifications(&self) -> Result<usize>;
}

/// The notification queue and counters of one backend.
pub(crate) struct Notifier {
    listener: Option<Arc<dyn EvictionListener>>,
    pending: Mutex<AHashSet<String>>,
    pending_len: AtomicUsize,
    pub(crate) evicted_objects: AtomicU64,
    pub(crate) evicted_units: AtomicU64,
}

impl Notifier {
    pub(crate) fn new(listener: Option<Arc<dyn EvictionListener>>) -> Self {
        Notifier {
            listener,
            pending: Mutex::new(AHashSet::new()),
            pending_len: AtomicUsize::new(0),
            evicted_objects: AtomicU64::new(0),
            evicted_units: AtomicU64::new(0),
        }
    }

    /// Phase 2: tells the listener of `keys` (with any queued ones first). Returns
    /// whether it accepted; on failure everything is queued.
    pub(crate) fn notify(&self, keys: Vec<String>, units: usize) -> bool {
        self.evicted_objects.fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.evicted_units.fetch_add(units as u64, Ordering::Relaxed);
        let Some(listener) = &self.listener else { return true };
        let mut pending = self.pending.lock();
        let mut all: Vec<String> = pending.drain().collect();
        all.extend(keys);
        if all.is_empty() {
            return true;
        }
        match listener.on_evicted(&all) {
            Ok(()) => {
                self.pending_len.store(0, Ordering::Relaxed);
                true
            }
            Err(e) => {
                tracing::warn!("eviction notification of {} keys failed ({e}); queued for retry", all.len());
                pending.extend(all);
                self.pending_len.store(pending.len(), Ordering::Relaxed);
                false
            }
        }
    }

    pub(crate) fn retry(&self) -> Result<usize> {
        let Some(listener) = &self.listener else { return Ok(0) };
        let mut pending = self.pending.lock();
        if pending.is_empty() {
            return Ok(0);
        }
        let all: Vec<String> = pending.iter().cloned().collect();
        match listener.on_evicted(&all) {
            Ok(()) => {
                pending.clear();
                self.pending_len.store(0, Ordering::Relaxed);
                Ok(all.len())
            }
            Err(e) => Err(StorageError::Notification(e.to_string())),
        }
    }

    /// Keys written again: a queued eviction notice for them is stale.
    pub(crate) fn supersede<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        if self.pending_len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut pending = self.pending.lock();
        for k in keys {
            pending.remove(k);
        }
        self.pending_len.store(pending.len(), Ordering::Relaxed);
    }

    /// The eviction counters of [`BackendStats`], the rest left default.
    pub(crate) fn stats(&self) -> BackendStats {
        BackendStats {
            evicted_objects: self.evicted_objects.load(Ordering::Relaxed),
            evicted_units: self.evicted_units.load(Ordering::Relaxed),
            pending_notifications: self.pending(),
            ..BackendStats::default()
        }
    }

    pub(crate) fn pending(&self) -> u64 {
        self.pending_len.load(Ordering::Relaxed) as u64
    }
}

/// Number of reads in flight on a unit.
#[derive(Debug, Default)]
pub(crate) struct Pins(AtomicUsize);

impl Pins {
    pub(crate) fn pin(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
    pub(crate) fn unpin(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
    /// Waits until no read holds a pin, at most `timeout`; false on timeout.
    pub(crate) fn wait_unpinned(&self, timeout: Duration) -> bool {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.0.load(Ordering::Acquire) != 0 {
            if start.elapsed() >= timeout {
                return false;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
        true
    }
}

/// Something that holds [`Pins`].
pub(crate) trait Pinned {
    fn pins(&self) -> &Pins;
}

/// RAII read pin: the unit's files are not deleted (nor its space reused) while it
/// lives. Made under the index lock, so eviction either sees it or the reader does
/// not find the key.
pub(crate) struct ReadPin<T: Pinned>(pub(crate) Arc<T>);

impl<T: Pinned> ReadPin<T> {
    pub(crate) fn new(unit: &Arc<T>) -> Self {
        unit.pins().pin();
        ReadPin(unit.clone())
    }
}

impl<T: Pinned> Drop for ReadPin<T> {
    fn drop(&mut self) {
        self.0.pins().unpin();
    }
}

/// Validates a batch: per-object key/value checks and duplicates within the batch.
/// Returns an error for each rejected object, `None` for accepted ones.
pub(crate) fn validate_batch(objects: &[(&str, &[u8])]) -> Vec<Option<StorageError>> {
    let mut seen = HashSet::with_capacity(objects.len());
    objects
        .iter()
        .map(|(k, v)| {
            if let Err(e) = crate::meta::validate_key(k) {
                return Some(e);
            }
            if v.is_empty() {
                return Some(StorageError::InvalidArgument(format!("empty value for {k:?}")));
            }
            if !seen.insert(*k) {
                return Some(StorageError::AlreadyExists(k.to_string()));
            }
            None
        })
        .collect()
}

/// The length of a value just read, once its bytes match `checksum` (when `check`).
pub(crate) fn checked_load(check: bool, key: &str, len: u64, checksum: u32, read: Result<&mut [u8]>) -> Result<usize> {
    let data = read?;
    if check {
        verify(key, data, checksum)?;
    }
    Ok(len as usize)
}

/// One result per request of a batch; a request no step answered is reported skipped.
pub(crate) fn batch_results<T>(results: Vec<Option<Result<T>>>) -> Vec<Result<T>> {
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(StorageError::InvalidArgument("skipped".into())))).collect()
}

/// Checks a loaded value against its checksum.
pub(crate) fn verify(key: &str, data: &[u8], checksum: u32) -> Result<()> {
    let actual = crc32c::crc32c(data);
    if actual != checksum {
        return Err(StorageError::corrupted(key, format!("value checksum {actual:#010x} != {checksum:#010x}")));
    }
    Ok(())
}

/// Writes `bytes` to `dir/name` atomically: a temporary file, fsync, rename, fsync
/// of the directory.
pub(crate) fn write_file_atomic(dir: &std::path::Path, name: &str, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = dir.join(format!("{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))?;
    sync_dir(dir)
}

/// fsync of a directory (makes renames and creations in it durable).
pub(crate) fn sync_dir(dir: &std::path::Path) -> Result<()> {
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Removes a file, ignoring "not found".
pub(crate) fn remove_file_quiet(path: &std::path::Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("cannot remove {}: {e}", path.display());
        }
    }
}
