//! What the three layouts share, written once: the options every backend keeps
//! ([`BackendCore`]), the two-phase eviction skeleton ([`Layout`]: select victims ->
//! notify -> finalize, the explicit eviction's report and the stats), the notification
//! queue ([`Notifier`]), read pins, cached file handles, batch validation and checked
//! loads.
//!
//! A layout provides only what differs: how a victim leaves its index
//! ([`Layout::select_victims`], built on [`Victims::select`]), how its files go
//! ([`Layout::finalize`]) and its sizes ([`Layout::usage`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ahash::AHashSet;
use parking_lot::Mutex;

use super::{BackendOptions, BackendStats, DiskEvictionReport, EvictionListener, StorageBackend};
use crate::error::{Result, StorageError};
use crate::eviction::{DiskEvictionStrategy, UnitId};
use crate::io::{IoEngine, IoFile};

/// The options every backend keeps, its eviction strategy and its notification queue.
pub(super) struct BackendCore {
    pub(super) io: Arc<dyn IoEngine>,
    pub(super) capacity: Option<u64>,
    pub(super) eviction_wait: Duration,
    pub(super) verify_on_load: bool,
    /// Locked after the layout's index lock, never before it.
    pub(super) strategy: Mutex<Box<dyn DiskEvictionStrategy>>,
    pub(super) notifier: Notifier,
    /// The read handles cached open, bounded.
    pub(super) open_files: OpenFiles,
}

impl BackendCore {
    pub(super) fn new(options: BackendOptions) -> Self {
        BackendCore {
            io: options.io,
            capacity: options.capacity,
            eviction_wait: options.eviction_wait,
            verify_on_load: options.verify_on_load,
            strategy: Mutex::new(options.eviction),
            notifier: Notifier::new(options.listener),
            open_files: OpenFiles::new(options.max_open_files),
        }
    }

    /// Tells the strategy that these units were read.
    pub(super) fn record_accesses(&self, units: impl IntoIterator<Item = UnitId>) {
        let mut strategy = self.strategy.lock();
        for unit in units {
            strategy.record_access(unit);
        }
    }
}

/// Sizes of a layout, for [`BackendStats`].
pub(super) struct Usage {
    pub(super) capacity: Option<u64>,
    pub(super) used_bytes: u64,
    pub(super) objects: u64,
    pub(super) units: u64,
}

/// Units taken out of the index by phase 1, awaiting notification and finalization.
pub(super) struct Victims<U> {
    pub(super) units: Vec<U>,
    /// Keys of the objects the units held.
    pub(super) keys: Vec<String>,
    /// Bytes the units free.
    pub(super) bytes: u64,
}

impl<U> Victims<U> {
    /// Phase 1: asks `strategy` for victims until `target` bytes are freed or it has
    /// none left. `take` removes a victim from the index, pushes its keys, and returns
    /// it with the bytes it frees; `None` when the index no longer holds it.
    pub(super) fn select(
        strategy: &mut dyn DiskEvictionStrategy,
        target: u64,
        mut take: impl FnMut(UnitId, &mut Vec<String>) -> Option<(U, u64)>,
    ) -> Self {
        let mut v = Victims { units: Vec::new(), keys: Vec::new(), bytes: 0 };
        while v.bytes < target {
            let Some(victim) = strategy.select_victim() else { break };
            let Some((unit, bytes)) = take(victim, &mut v.keys) else { continue };
            v.bytes += bytes;
            v.units.push(unit);
        }
        v
    }
}

/// Bytes to free so that `need` more fit under `capacity` with `used` taken (0
/// without a capacity: nothing is evicted).
pub(super) fn bytes_over(capacity: Option<u64>, used: u64, need: u64) -> u64 {
    capacity.map_or(0, |c| (used + need).saturating_sub(c))
}

/// An on-disk layout: the steps of the eviction skeleton that differ between the
/// backends. The provided methods are the skeleton.
pub(super) trait Layout: StorageBackend {
    /// What the layout evicts as a whole (a bucket, an object's file, a record).
    type Unit;

    fn core(&self) -> &BackendCore;

    /// Phase 1 of an explicit eviction: under the index lock, units in the
    /// strategy's order until `bytes` are freed.
    fn select_victims(&self, bytes: u64) -> Victims<Self::Unit>;

    /// Phase 3: waits (at most the eviction wait) for the reads of each unit, drops
    /// its cached handle, deletes its files or frees its space.
    fn finalize(&self, units: &[Self::Unit]);

    /// Sizes now.
    fn usage(&self) -> Usage;

    /// Phases 2 and 3: tells the listener of the victims' keys (with any queued ones
    /// first), then finalizes them. Whether the listener accepted.
    fn notify_and_finalize(&self, victims: Victims<Self::Unit>) -> bool {
        if victims.units.is_empty() {
            return true;
        }
        let notified = self.core().notifier.notify(victims.keys, victims.units.len());
        self.finalize(&victims.units);
        notified
    }

    /// [`StorageBackend::evict`]: the three phases, reported.
    fn evict_now(&self, bytes: u64) -> DiskEvictionReport {
        let victims = self.select_victims(bytes);
        let (keys, bytes_freed) = (victims.keys.clone(), victims.bytes);
        let notified = self.notify_and_finalize(victims);
        DiskEvictionReport { keys, bytes_freed, notified }
    }

    /// [`StorageBackend::stats`].
    fn snapshot(&self) -> BackendStats {
        let core = self.core();
        let usage = self.usage();
        BackendStats {
            backend: self.name(),
            io: core.io.name(),
            capacity: usage.capacity,
            used_bytes: usage.used_bytes,
            objects: usage.objects,
            units: usage.units,
            handles_closed: core.open_files.closed(),
            ..core.notifier.stats()
        }
    }

    /// [`StorageBackend::load`]: a batch of one.
    fn load_one(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        let mut reqs = [(key, buf)];
        self.batch_load(&mut reqs).pop().unwrap_or_else(|| Err(StorageError::NotFound(key.to_owned())))
    }
}

/// The notification queue and counters of one backend.
pub(super) struct Notifier {
    listener: Option<Arc<dyn EvictionListener>>,
    pending: Mutex<AHashSet<String>>,
    pending_len: AtomicUsize,
    evicted_objects: AtomicU64,
    evicted_units: AtomicU64,
}

impl Notifier {
    fn new(listener: Option<Arc<dyn EvictionListener>>) -> Self {
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
    fn notify(&self, keys: Vec<String>, units: usize) -> bool {
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

    /// [`StorageBackend::retry_pending_notifications`].
    pub(super) fn retry(&self) -> Result<usize> {
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
    pub(super) fn supersede<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
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
    fn stats(&self) -> BackendStats {
        BackendStats {
            evicted_objects: self.evicted_objects.load(Ordering::Relaxed),
            evicted_units: self.evicted_units.load(Ordering::Relaxed),
            pending_notifications: self.pending_len.load(Ordering::Relaxed) as u64,
            ..BackendStats::default()
        }
    }
}

/// Number of reads in flight on a unit.
#[derive(Debug, Default)]
pub(super) struct Pins(AtomicUsize);

impl Pins {
    fn pin(&self) {
        self.0.fetch_add(1, Ordering::AcqRel);
    }
    fn unpin(&self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
    /// Waits until no read holds a pin, at most `timeout`; false on timeout.
    pub(super) fn wait_unpinned(&self, timeout: Duration) -> bool {
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
pub(super) trait Pinned {
    fn pins(&self) -> &Pins;
}

/// RAII read pin: the unit's files are not deleted (nor its space reused) while it
/// lives. Made under the index lock, so eviction either sees it or the reader does
/// not find the key.
pub(super) struct ReadPin<T: Pinned>(pub(super) Arc<T>);

impl<T: Pinned> ReadPin<T> {
    pub(super) fn new(unit: &Arc<T>) -> Self {
        unit.pins().pin();
        ReadPin(unit.clone())
    }
}

impl<T: Pinned> Drop for ReadPin<T> {
    fn drop(&mut self) {
        self.0.pins().unpin();
    }
}

/// A unit's file handle: opened by the first read, dropped before the unit's files
/// are deleted.
#[derive(Default)]
pub(super) struct CachedFile(Arc<Slot>);

/// Where a [`CachedFile`] keeps its handle (`None`: closed).
type Slot = Mutex<Option<Arc<IoFile>>>;

impl CachedFile {
    /// The open handle, opening it with `open` if there is none (counted in `files`,
    /// which may close the oldest other handle to stay within its bound).
    pub(super) fn get_or_open(&self, files: &OpenFiles, open: impl FnOnce() -> Result<IoFile>) -> Result<Arc<IoFile>> {
        let f = {
            let mut cached = self.0.lock();
            if let Some(f) = &*cached {
                return Ok(f.clone());
            }
            let f = Arc::new(open()?);
            *cached = Some(f.clone());
            f
        };
        // After this handle's lock is released: the bound may close any handle,
        // this one included (the caller's clone stays open for its read).
        files.opened(Arc::downgrade(&self.0));
        Ok(f)
    }

    /// Drops the handle (reads that hold a clone keep theirs).
    pub(super) fn close(&self) {
        self.0.lock().take();
    }
}

/// The cached read handles of one backend, oldest opened first, at most `limit`
/// of them: opening one more closes the oldest. A closed handle is reopened on its
/// next read (one `open` call), so the bound costs speed only when the tier's hot
/// set spans more files than the bound.
pub(super) struct OpenFiles {
    limit: usize,
    /// Handles in the order they were opened (some may be closed or gone already).
    order: Mutex<std::collections::VecDeque<std::sync::Weak<Slot>>>,
    /// Handles closed to stay within the bound.
    closed: AtomicU64,
}

impl OpenFiles {
    pub(super) fn new(limit: usize) -> Self {
        OpenFiles { limit: limit.max(1), order: Mutex::default(), closed: AtomicU64::new(0) }
    }

    /// A handle was opened: closes the oldest while more than `limit` may be open.
    fn opened(&self, handle: std::sync::Weak<Slot>) {
        let mut order = self.order.lock();
        order.push_back(handle);
        while order.len() > self.limit {
            let Some(oldest) = order.pop_front() else { break };
            if let Some(cached) = oldest.upgrade() {
                if cached.lock().take().is_some() {
                    self.closed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Handles closed so far to stay within the bound.
    pub(super) fn closed(&self) -> u64 {
        self.closed.load(Ordering::Relaxed)
    }
}

/// Validates a batch: per-object key/value checks and duplicates within the batch.
/// Returns an error for each rejected object, `None` for accepted ones.
pub(super) fn validate_batch(objects: &[(&str, &[u8])]) -> Vec<Option<StorageError>> {
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
pub(super) fn checked_load(check: bool, key: &str, len: u64, checksum: u32, read: Result<&mut [u8]>) -> Result<usize> {
    let data = read?;
    if check {
        verify(key, data, checksum)?;
    }
    Ok(len as usize)
}

/// One result per request of a batch; a request no step answered is reported skipped.
pub(super) fn batch_results<T>(results: Vec<Option<Result<T>>>) -> Vec<Result<T>> {
    results.into_iter().map(|r| r.unwrap_or_else(|| Err(StorageError::InvalidArgument("skipped".into())))).collect()
}

/// Checks a loaded value against its checksum.
fn verify(key: &str, data: &[u8], checksum: u32) -> Result<()> {
    let actual = crc32c::crc32c(data);
    if actual != checksum {
        return Err(StorageError::corrupted(key, format!("value checksum {actual:#010x} != {checksum:#010x}")));
    }
    Ok(())
}

/// Splits `(key, value, generation)` items into `(key, value)` pairs and generations.
pub(super) fn split_generations<'a>(items: &[(&'a str, &'a [u8], u64)]) -> (Vec<(&'a str, &'a [u8])>, Vec<u64>) {
    items.iter().map(|&(k, v, g)| ((k, v), g)).unzip()
}
