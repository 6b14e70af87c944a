//! [`NanoKvCache`]: the owner-side control plane of one device heap.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::alloc::RangeAlloc;
use crate::cuda::CudaDeviceHeap;
use crate::error::{GpuError, Result};
use crate::header::{header_offsets, HeaderSnapshot, HeaderU32Field, HeaderU64Field, ObjectState, HEADER_VERSION};
use crate::heap::{DeviceHeap, PageSpan, ReadExpect, RetireOutcome};
use crate::key::KeyId;

/// Default page size: 256 KiB.
pub const DEFAULT_PAGE_SIZE: u32 = 256 * 1024;
/// Page sizes and payload bases are multiples of this.
pub const PAYLOAD_ALIGN: u32 = 256;
/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// How many times `get` retries a location that went stale under it (the
/// object was being evicted and put back, or re-put) before giving up.
const GET_ATTEMPTS: usize = 16;

/// Configuration of a [`NanoKvCache`].
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Bytes per page; a multiple of [`PAYLOAD_ALIGN`]. Default 256 KiB.
    pub page_size: u32,
    /// Usage ratio above which `open_for_write` evicts first. Default 0.95.
    pub high_watermark: f64,
    /// Usage ratio eviction brings the heap down to. Default 0.85.
    pub low_watermark: f64,
    /// A put left RESERVED/WRITING longer than this (by `state_ts`) is
    /// reclaimed by the watchdog. Default 30 s.
    pub stuck_timeout: Duration,
    /// Rank (segment id) of this owner, reported in plans and locations.
    pub rank: u32,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            page_size: DEFAULT_PAGE_SIZE,
            high_watermark: 0.95,
            low_watermark: 0.85,
            stuck_timeout: Duration::from_secs(30),
            rank: 0,
        }
    }
}

impl CacheConfig {
    fn validate(&self) -> Result<()> {
        if self.page_size == 0 || !self.page_size.is_multiple_of(PAYLOAD_ALIGN) {
            return Err(GpuError::InvalidArgument(format!(
                "page size {} must be a non-zero multiple of {PAYLOAD_ALIGN}",
                self.page_size
            )));
        }
        let (lo, hi) = (self.low_watermark, self.high_watermark);
        if !(lo > 0.0 && lo <= hi && hi <= 1.0) {
            return Err(GpuError::InvalidArgument(format!(
                "watermarks must satisfy 0 < low ({lo}) <= high ({hi}) <= 1"
            )));
        }
        Ok(())
    }
}

/// Where a published object lives (Nano Mooncake `ObjMeta`): what a reader
/// needs to fetch it, from the host or from a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ObjMeta {
    /// `xxh64(key)`.
    pub key_hash: u64,
    /// Owner rank.
    pub owner_rank: u32,
    /// Header slot.
    pub slot: u32,
    /// Address of the header in the owner heap.
    pub header_ptr: u64,
    /// Address of page 0 in the owner heap.
    pub payload_ptr: u64,
    /// Offset of page 0 in the owner heap's arena.
    pub payload_offset: u64,
    /// Object size.
    pub bytes_total: u64,
    /// Bytes per page.
    pub page_bytes: u32,
    /// Number of pages.
    pub n_pages: u32,
    /// Valid bytes of the last page.
    pub last_page_bytes: u32,
    /// Slot epoch; a reader holding an older epoch gets [`GpuError::Stale`].
    pub epoch: u32,
}

impl ObjMeta {
    /// Page geometry.
    pub fn span(&self) -> PageSpan {
        PageSpan {
            payload_base: self.payload_offset,
            bytes_total: self.bytes_total,
            page_size: self.page_bytes,
            n_pages: self.n_pages,
            last_page_bytes: self.last_page_bytes,
        }
    }

    /// Address of the `state` word (what a device reader acquires).
    pub fn state_ptr(&self) -> u64 {
        self.header_ptr + header_offsets::STATE as u64
    }

    /// Address of the `reader_refcnt` word.
    pub fn refcnt_ptr(&self) -> u64 {
        self.header_ptr + header_offsets::READER_REFCNT as u64
    }
}

/// A reservation handed to a producer (Nano Mooncake `WritePlan`): the owner's
/// header and page addresses, so a kernel can push pages straight into the
/// owner heap and then flip `state` to READY with release semantics (or the
/// host calls [`NanoKvCache::commit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WritePlan {
    /// `xxh64(key)`.
    pub key_hash: u64,
    /// Second key fingerprint.
    pub key_fp_hi: u64,
    /// Key length.
    pub key_len: u32,
    /// Owner rank.
    pub dst_rank: u32,
    /// Header slot.
    pub slot: u32,
    /// Address of the header in the owner heap.
    pub header_ptr: u64,
    /// Address of page 0 in the owner heap.
    pub payload_ptr: u64,
    /// Offset of page 0 in the owner heap's arena.
    pub payload_offset: u64,
    /// Bytes per page.
    pub page_bytes: u32,
    /// Number of pages.
    pub n_pages: u32,
    /// Valid bytes of the last page.
    pub last_page_bytes: u32,
    /// Object size.
    pub bytes_total: u64,
    /// Slot epoch of this reservation.
    pub epoch: u32,
    /// Owner clock (ns) when the reservation was made (`state_ts`); the
    /// watchdog reclaims it after `stuck_timeout`.
    pub reserved_at_ns: u64,
}

impl WritePlan {
    /// Page geometry.
    pub fn span(&self) -> PageSpan {
        PageSpan {
            payload_base: self.payload_offset,
            bytes_total: self.bytes_total,
            page_size: self.page_bytes,
            n_pages: self.n_pages,
            last_page_bytes: self.last_page_bytes,
        }
    }

    /// Key identity of the reservation.
    pub fn key_id(&self) -> KeyId {
        KeyId { hash: self.key_hash, fp_hi: self.key_fp_hi, len: self.key_len }
    }

    /// Arena offset of page `i`.
    pub fn page_offset(&self, i: u32) -> u64 {
        self.span().page_offset(i)
    }

    /// Heap address of page `i`.
    pub fn page_ptr(&self, i: u32) -> u64 {
        self.payload_ptr + u64::from(i) * u64::from(self.page_bytes)
    }

    /// Valid bytes of page `i` (tail clamped).
    pub fn page_len(&self, i: u32) -> u32 {
        self.span().page_len(i)
    }

    /// Address of the `state` word the producer flips to READY.
    pub fn state_ptr(&self) -> u64 {
        self.header_ptr + header_offsets::STATE as u64
    }
}

/// Counters of a [`NanoKvCache`] (integers only, as the reference's telemetry).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Arena bytes held by objects (whole pages).
    pub bytes_used: u64,
    /// Arena capacity.
    pub bytes_total: u64,
    /// Objects in the index (any state).
    pub objects: u64,
    /// Objects known published.
    pub ready_count: u64,
    /// Objects reserved/writing as far as the host knows.
    pub writing_count: u64,
    /// Header slots of the heap.
    pub header_slots: u64,
    /// Header slots in use.
    pub header_slots_used: u64,
    /// Objects evicted.
    pub evict_count: u64,
    /// Eviction candidates skipped because readers held them.
    pub evict_in_use_retry: u64,
    /// Eviction candidates skipped because they were not READY.
    pub evict_not_ready_skip: u64,
    /// Reservations refused for lack of space or header slots.
    pub oom_count: u64,
    /// Stuck puts reclaimed by the watchdog.
    pub stuck_put_reclaimed: u64,
    /// Successful `put`s (host path) and `commit`s.
    pub puts: u64,
    /// Successful reads.
    pub gets: u64,
    /// Reads of absent keys.
    pub get_misses: u64,
    /// Ranges in the arena free list.
    pub free_ranges: u64,
}

#[derive(Debug)]
struct Entry {
    key: Arc<str>,
    id: KeyId,
    epoch: u32,
    span: PageSpan,
    seq: u64,
    committed: bool,
}

#[derive(Debug)]
struct Inner {
    index: HashMap<Arc<str>, u32>,
    slots: Vec<Option<Entry>>,
    free_slots: Vec<u32>,
    /// Insertion order (seq -> slot) of every indexed object: the FIFO.
    fifo: BTreeMap<u64, u32>,
    /// Uncommitted reservations (seq -> slot), scanned by the watchdog.
    pending: BTreeMap<u64, u32>,
    next_seq: u64,
    alloc: RangeAlloc,
    evict_count: u64,
    evict_in_use_retry: u64,
    evict_not_ready_skip: u64,
    oom_count: u64,
    stuck_put_reclaimed: u64,
    puts: u64,
    /// Each slot's epoch as last written to its header by this cache (`None`:
    /// unknown, after a header write that failed): the cache is the only writer
    /// of epochs (kernels and readers only compare them), so a reservation
    /// needs no device round trip to learn the next one.
    epochs: Vec<Option<u32>>,
}

impl Inner {
    /// Whether `plan`'s reservation is still the one in its slot. A plan's fields are
    /// public: a slot out of range is a stale plan, not a panic.
    fn holds(&self, plan: &WritePlan) -> bool {
        self.slots
            .get(plan.slot as usize)
            .and_then(Option::as_ref)
            .is_some_and(|e| e.epoch == plan.epoch && e.id == plan.key_id())
    }

    fn entry(&self, key: &str) -> Option<(u32, &Entry)> {
        let slot = *self.index.get(key)?;
        self.slots[slot as usize].as_ref().map(|e| (slot, e))
    }

    /// A put of `slot` was published: counted once, and marked committed.
    fn count_put(&mut self, slot: u32) {
        if !self.slots[slot as usize].as_ref().is_some_and(|e| e.committed) {
            self.puts += 1;
        }
        self.mark_committed(slot);
    }

    fn mark_committed(&mut self, slot: u32) {
        if let Some(e) = self.slots[slot as usize].as_mut() {
            if !e.committed {
                e.committed = true;
                self.pending.remove(&e.seq);
            }
        }
    }

    /// Drops a retired object from every table and frees its space.
    fn release(&mut self, slot: u32) {
        if let Some(e) = self.slots[slot as usize].take() {
            self.index.remove(&e.key);
            self.fifo.remove(&e.seq);
            self.pending.remove(&e.seq);
            self.alloc.free(e.span.payload_base, e.span.alloc_bytes());
            self.free_slots.push(slot);
        }
    }
}

/// Stops and joins the watchdog thread when dropped.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Stops the thread and waits for it.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// How a reservation's header is written.
#[derive(Clone, Copy)]
enum HeaderWrite {
    /// Waited for: the plan may go to another process.
    Waited,
    /// Ordered before the heap's next operation, not waited for: the plan is
    /// filled on this heap (see [`DeviceHeap::write_header_in_order`]).
    InOrder,
}

/// The GPU-resident KV cache of one owner (Nano Mooncake): object index, bump +
/// free-list allocation of the payload arena, FIFO eviction between
/// watermarks, stuck-put watchdog, over any [`DeviceHeap`].
///
/// Thread-safe (`Send + Sync`); the control-plane tables sit behind one mutex,
/// payload copies run outside it, protected by the header state machine
/// (see [`DeviceHeap`]).
pub struct NanoKvCache<H: DeviceHeap + ?Sized = dyn DeviceHeap> {
    heap: Arc<H>,
    cfg: CacheConfig,
    inner: Mutex<Inner>,
    epoch0: Instant,
    gets: AtomicU64,
    get_misses: AtomicU64,
}

impl<H: DeviceHeap + ?Sized> std::fmt::Debug for NanoKvCache<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NanoKvCache").field("cfg", &self.cfg).field("stats", &self.stats()).finish()
    }
}

impl<H: DeviceHeap + ?Sized> NanoKvCache<H> {
    /// A cache owning `heap`. Every header slot is reset to `DEAD` (whatever
    /// the heap held before is discarded); epochs continue from their values.
    pub fn new(heap: Arc<H>, cfg: CacheConfig) -> Result<Self> {
        cfg.validate()?;
        let n = heap.header_slots();
        let mut epochs = Vec::with_capacity(n as usize);
        for slot in 0..n {
            let epoch = heap.load_u32(slot, HeaderU32Field::Epoch, Ordering::Relaxed)?;
            epochs.push(Some(epoch));
            let h = HeaderSnapshot {
                epoch,
                state: ObjectState::Dead.as_u32(),
                header_version: HEADER_VERSION,
                ..Default::default()
            };
            heap.write_header(slot, &h)?;
        }
        // Payload bases stay PAYLOAD_ALIGN-aligned: use whole aligned units.
        let cap = heap.payload_capacity() / u64::from(PAYLOAD_ALIGN) * u64::from(PAYLOAD_ALIGN);
        let inner = Inner {
            index: HashMap::new(),
            slots: (0..n).map(|_| None).collect(),
            free_slots: (0..n).rev().collect(),
            fifo: BTreeMap::new(),
            pending: BTreeMap::new(),
            next_seq: 0,
            alloc: RangeAlloc::new(cap),
            evict_count: 0,
            evict_in_use_retry: 0,
            evict_not_ready_skip: 0,
            oom_count: 0,
            stuck_put_reclaimed: 0,
            puts: 0,
            epochs,
        };
        Ok(Self {
            heap,
            cfg,
            inner: Mutex::new(inner),
            epoch0: Instant::now(),
            gets: AtomicU64::new(0),
            get_misses: AtomicU64::new(0),
        })
    }

    /// The heap.
    pub fn heap(&self) -> &Arc<H> {
        &self.heap
    }

    /// The configuration.
    pub fn config(&self) -> &CacheConfig {
        &self.cfg
    }

    /// The owner clock written into `state_ts`/`last_access`: nanoseconds
    /// since the cache was created (monotonic).
    pub fn now_ns(&self) -> u64 {
        self.epoch0.elapsed().as_nanos() as u64
    }

    fn check_key(key: &str) -> Result<()> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(GpuError::InvalidArgument(format!("key length {} not in 1..={MAX_KEY_LEN}", key.len())));
        }
        Ok(())
    }

    /// Reserves space and a header for `key` (`bytes_total` bytes) and returns
    /// the plan a producer writes through. The header is written in one
    /// `write_header`, its state WRITING stored last (Release): one device round
    /// trip on a CUDA heap, the epoch coming from the cache's own record.
    ///
    /// If the reservation would push usage above the high watermark, the FIFO
    /// evictor first brings usage (including the new object) down to the low
    /// watermark; if the space still cannot be found (fragmentation, pinned
    /// objects) it keeps evicting the oldest evictable object until it fits.
    /// Errors: `AlreadyExists`, `NoSpace`, `NoHeaderSlot`, `InvalidArgument`.
    pub fn open_for_write(&self, key: &str, bytes_total: u64) -> Result<WritePlan> {
        self.reserve(key, bytes_total, HeaderWrite::Waited)
    }

    /// [`open_for_write`](Self::open_for_write), the header written as `how` says.
    fn reserve(&self, key: &str, bytes_total: u64, how: HeaderWrite) -> Result<WritePlan> {
        Self::check_key(key)?;
        let mut span = PageSpan::new(0, bytes_total, self.cfg.page_size)?;
        let need = span.alloc_bytes();
        let mut inner = self.inner.lock();
        if inner.index.contains_key(key) {
            return Err(GpuError::AlreadyExists);
        }
        let cap = inner.alloc.capacity();
        if need > cap {
            inner.oom_count += 1;
            return Err(GpuError::NoSpace { need, free: cap - inner.alloc.used(), total: cap });
        }
        let high = (self.cfg.high_watermark * cap as f64) as u64;
        if inner.alloc.used() + need > high {
            let low = (self.cfg.low_watermark * cap as f64) as u64;
            let target = low.saturating_sub(need);
            self.evict_locked(&mut inner, usize::MAX, &|i: &Inner| i.alloc.used() <= target);
        }
        let off = loop {
            if let Some(off) = inner.alloc.alloc(need) {
                break off;
            }
            if self.evict_locked(&mut inner, 1, &|_: &Inner| false) == 0 {
                inner.oom_count += 1;
                let free = cap - inner.alloc.used();
                return Err(GpuError::NoSpace { need, free, total: cap });
            }
        };
        let slot = loop {
            if let Some(s) = inner.free_slots.pop() {
                break s;
            }
            if self.evict_locked(&mut inner, 1, &|_: &Inner| false) == 0 {
                inner.alloc.free(off, need);
                inner.oom_count += 1;
                return Err(GpuError::NoHeaderSlot { slots: self.heap.header_slots() });
            }
        };
        span.payload_base = off;
        let id = KeyId::of(key);
        let now = self.now_ns();
        let known = inner.epochs[slot as usize].take();
        let init = (|| -> Result<u32> {
            // The next epoch, from this cache's own record of the header (no
            // device round trip) unless a failed write left it unknown.
            let epoch = match known {
                Some(e) => e,
                None => self.heap.load_u32(slot, HeaderU32Field::Epoch, Ordering::Acquire)?,
            }
            .wrapping_add(1);
            let h = HeaderSnapshot {
                key_hash: id.hash,
                key_fp_hi: id.fp_hi,
                key_len: id.len,
                header_version: HEADER_VERSION,
                payload_base: off,
                bytes_total,
                page_size: span.page_size,
                n_pages: span.n_pages,
                last_page_bytes: span.last_page_bytes,
                epoch,
                // Straight to WRITING: RESERVED and WRITING are treated alike by
                // every reader and by the watchdog, `write` accepts only WRITING,
                // and no one holds the plan yet; writing the state once, last and
                // with Release (for the header before it) in `write_header`,
                // saves a second device round trip per put.
                state: ObjectState::Writing.as_u32(),
                reader_refcnt: 0,
                state_ts: now,
                last_access: now,
                flags: 0,
                _pad: 0,
                _reserved: [0; 5],
            };
            match how {
                HeaderWrite::Waited => self.heap.write_header(slot, &h)?,
                HeaderWrite::InOrder => self.heap.write_header_in_order(slot, &h)?,
            }
            Ok(epoch)
        })();
        let epoch = match init {
            Ok(e) => {
                inner.epochs[slot as usize] = Some(e);
                e
            }
            Err(e) => {
                inner.alloc.free(off, need);
                inner.free_slots.push(slot);
                return Err(e);
            }
        };
        let key: Arc<str> = Arc::from(key);
        let seq = inner.next_seq;
        inner.next_seq += 1;
        inner.index.insert(key.clone(), slot);
        inner.fifo.insert(seq, slot);
        inner.pending.insert(seq, slot);
        inner.slots[slot as usize] = Some(Entry { key, id, epoch, span, seq, committed: false });
        Ok(WritePlan {
            key_hash: id.hash,
            key_fp_hi: id.fp_hi,
            key_len: id.len,
            dst_rank: self.cfg.rank,
            slot,
            header_ptr: self.heap.header_addr(slot),
            payload_ptr: self.heap.payload_addr(off),
            payload_offset: off,
            page_bytes: span.page_size,
            n_pages: span.n_pages,
            last_page_bytes: span.last_page_bytes,
            bytes_total,
            epoch,
            reserved_at_ns: now,
        })
    }

    /// Host-side producer: copies `src` into pages `first_page ..` of a
    /// reservation (whole pages; the last page may be short). The slot is
    /// pinned (`reader_refcnt`) for the duration of the copy, so the watchdog
    /// cannot reclaim it mid-copy; `Err(Stale)` if it was already reclaimed.
    pub fn write(&self, plan: &WritePlan, first_page: u32, src: &[u8]) -> Result<u32> {
        let h = &*self.heap;
        h.fetch_add_u32(plan.slot, HeaderU32Field::ReaderRefcnt, 1)?;
        let r = (|| {
            let st = h.load_u32(plan.slot, HeaderU32Field::State, Ordering::SeqCst)?;
            let ep = h.load_u32(plan.slot, HeaderU32Field::Epoch, Ordering::Acquire)?;
            if ep != plan.epoch || st != ObjectState::Writing.as_u32() {
                return Err(GpuError::Stale);
            }
            h.write_pages(&plan.span(), first_page, src)
        })();
        h.fetch_add_u32(plan.slot, HeaderU32Field::ReaderRefcnt, -1)?;
        r
    }

    /// Publishes a reservation: `CAS state WRITING -> READY` with Release, after
    /// all pages were written. Idempotent (a plan the device already published
    /// is Ok). `Err(Stale)` when the watchdog reclaimed it or it was removed.
    pub fn commit(&self, plan: &WritePlan) -> Result<()> {
        let mut inner = self.inner.lock();
        if !inner.holds(plan) {
            return Err(GpuError::Stale);
        }
        self.heap.publish(plan.slot, plan.epoch, self.now_ns())?;
        inner.count_put(plan.slot);
        Ok(())
    }

    /// Gives a reservation up (the producer failed): the object is retired and
    /// its space freed. `Err(Stale)` if it is already gone.
    pub fn abort(&self, plan: &WritePlan) -> Result<()> {
        let mut inner = self.inner.lock();
        if !inner.holds(plan) {
            return Err(GpuError::Stale);
        }
        self.retire_slot(&mut inner, plan.slot)
    }

    /// `open_for_write` + host copy + `commit`; on a failed copy the
    /// reservation is aborted.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let plan = self.open_for_write(key, value.len() as u64)?;
        let r = self.write(&plan, 0, value).and_then(|_| self.commit(&plan));
        if r.is_err() {
            let _ = self.abort(&plan);
        }
        r
    }

    /// Where `key` lives, without blocking: `Err(NotReady)` while it is being
    /// written, `Err(NotFound)` if absent.
    pub fn get_location(&self, key: &str) -> Result<ObjMeta> {
        let mut inner = self.inner.lock();
        let Some((slot, e)) = inner.entry(key) else {
            return Err(GpuError::NotFound);
        };
        let st = self.heap.load_u32(slot, HeaderU32Field::State, Ordering::Acquire)?;
        let meta = ObjMeta {
            key_hash: e.id.hash,
            owner_rank: self.cfg.rank,
            slot,
            header_ptr: self.heap.header_addr(slot),
            payload_ptr: self.heap.payload_addr(e.span.payload_base),
            payload_offset: e.span.payload_base,
            bytes_total: e.span.bytes_total,
            page_bytes: e.span.page_size,
            n_pages: e.span.n_pages,
            last_page_bytes: e.span.last_page_bytes,
            epoch: e.epoch,
        };
        match ObjectState::from_u32(st) {
            Some(ObjectState::Ready) => {
                inner.mark_committed(slot);
                Ok(meta)
            }
            Some(ObjectState::Reserved | ObjectState::Writing) => Err(GpuError::NotReady),
            // DEAD while indexed: an evictor is between its CAS and its revert.
            Some(ObjectState::Dead) => Err(GpuError::NotReady),
            None => Err(GpuError::Corrupted(format!("state {st} in slot {slot}"))),
        }
    }

    /// Reads `key` into the front of `dst` (reader protocol: acquire READY,
    /// pin, re-check epoch and key, tail-clamped copy, unpin). Returns the
    /// object size. Errors: `NotFound`, `NotReady`, `BufferTooSmall`.
    pub fn get_into(&self, key: &str, dst: &mut [u8]) -> Result<u64> {
        let mut last = GpuError::Stale;
        for attempt in 0..GET_ATTEMPTS {
            let expect = {
                let inner = self.inner.lock();
                let Some((slot, e)) = inner.entry(key) else {
                    self.get_misses.fetch_add(1, Ordering::Relaxed);
                    return Err(GpuError::NotFound);
                };
                if e.span.bytes_total > dst.len() as u64 {
                    return Err(GpuError::BufferTooSmall { need: e.span.bytes_total, got: dst.len() as u64 });
                }
                ReadExpect { slot, epoch: e.epoch, key: e.id }
            };
            match self.heap.read_object(&expect, dst) {
                Ok(n) => {
                    self.gets.fetch_add(1, Ordering::Relaxed);
                    let _ =
                        self.heap.store_u64(expect.slot, HeaderU64Field::LastAccess, self.now_ns(), Ordering::Relaxed);
                    return Ok(n);
                }
                Err(GpuError::Stale) | Err(GpuError::BufferTooSmall { .. }) => {
                    // Retired/reused under us, or an evictor is between its CAS
                    // and its revert: look the key up again.
                    last = GpuError::Stale;
                    if attempt > 2 {
                        std::thread::yield_now();
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// Reads `key` into a new vector. See [`get_into`](Self::get_into).
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        for _ in 0..GET_ATTEMPTS {
            let len = {
                let inner = self.inner.lock();
                match inner.entry(key) {
                    Some((_, e)) => e.span.bytes_total,
                    None => {
                        self.get_misses.fetch_add(1, Ordering::Relaxed);
                        return Err(GpuError::NotFound);
                    }
                }
            };
            let mut v = vec![0u8; len as usize];
            match self.get_into(key, &mut v) {
                Ok(n) => {
                    v.truncate(n as usize);
                    return Ok(v);
                }
                // Re-put with a larger size between the two look-ups.
                Err(GpuError::BufferTooSmall { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(GpuError::Stale)
    }

    /// Best-effort `last_access` bump. `Err(NotFound)` if absent.
    pub fn touch(&self, key: &str) -> Result<()> {
        let inner = self.inner.lock();
        let (slot, _) = inner.entry(key).ok_or(GpuError::NotFound)?;
        self.heap.store_u64(slot, HeaderU64Field::LastAccess, self.now_ns(), Ordering::Relaxed)
    }

    /// Removes `key`: `CAS READY -> DEAD` (or `WRITING -> DEAD` for an
    /// unfinished put) when no reader holds it, then frees its space.
    /// `Err(InUse)` while readers are copying it; `Err(NotFound)` if absent.
    pub fn remove(&self, key: &str) -> Result<()> {
        let mut inner = self.inner.lock();
        let (slot, _) = inner.entry(key).ok_or(GpuError::NotFound)?;
        self.retire_slot(&mut inner, slot)
    }

    fn retire_slot(&self, inner: &mut Inner, slot: u32) -> Result<()> {
        for _ in 0..8 {
            let st = self.heap.load_u32(slot, HeaderU32Field::State, Ordering::Acquire)?;
            let from = match ObjectState::from_u32(st) {
                Some(ObjectState::Dead) => {
                    // An evictor is between its CAS and its revert (only
                    // possible with several owners of one heap); retry.
                    std::thread::yield_now();
                    continue;
                }
                Some(s) => s,
                None => return Err(GpuError::Corrupted(format!("state {st} in slot {slot}"))),
            };
            match self.heap.retire(slot, from, self.now_ns())? {
                RetireOutcome::Retired => {
                    inner.release(slot);
                    return Ok(());
                }
                RetireOutcome::Pinned(readers) => return Err(GpuError::InUse { readers }),
                RetireOutcome::StateChanged(_) => continue,
            }
        }
        Err(GpuError::InUse { readers: 0 })
    }

    /// FIFO eviction: walks objects oldest first, skipping those not READY or
    /// with readers, retiring (`CAS READY -> DEAD`, refcount re-check) and
    /// freeing the others, until `done` holds or `max` were evicted.
    fn evict_locked(&self, inner: &mut Inner, max: usize, done: &dyn Fn(&Inner) -> bool) -> usize {
        let mut evicted = 0;
        let mut cursor = 0u64;
        while evicted < max && !done(inner) {
            let Some((&seq, &slot)) = inner.fifo.range(cursor..).next() else {
                break;
            };
            cursor = seq + 1;
            let ready = ObjectState::Ready.as_u32();
            match self.heap.load_u32(slot, HeaderU32Field::State, Ordering::Acquire) {
                Ok(st) if st == ready => {}
                Ok(_) => {
                    inner.evict_not_ready_skip += 1;
                    continue;
                }
                Err(e) => {
                    tracing::warn!(slot, error = %e, "evictor cannot read header");
                    continue;
                }
            }
            inner.mark_committed(slot);
            match self.heap.load_u32(slot, HeaderU32Field::ReaderRefcnt, Ordering::Acquire) {
                Ok(0) => {}
                _ => {
                    inner.evict_in_use_retry += 1;
                    continue;
                }
            }
            match self.heap.retire(slot, ObjectState::Ready, self.now_ns()) {
                Ok(RetireOutcome::Retired) => {
                    inner.release(slot);
                    inner.evict_count += 1;
                    evicted += 1;
                }
                Ok(RetireOutcome::Pinned(_)) => inner.evict_in_use_retry += 1,
                Ok(RetireOutcome::StateChanged(_)) => inner.evict_not_ready_skip += 1,
                Err(e) => tracing::warn!(slot, error = %e, "evictor cannot retire"),
            }
        }
        evicted
    }

    /// Evicts READY, unpinned objects oldest first until usage is at or below
    /// `usage_ratio` of the arena (or nothing evictable is left). Returns how
    /// many objects were evicted.
    pub fn evict_until_below(&self, usage_ratio: f64) -> usize {
        let mut inner = self.inner.lock();
        let target = (usage_ratio.clamp(0.0, 1.0) * inner.alloc.capacity() as f64) as u64;
        self.evict_locked(&mut inner, usize::MAX, &|i: &Inner| i.alloc.used() <= target)
    }

    /// The watchdog pass: retires reservations still RESERVED/WRITING whose
    /// `state_ts` is more than `stuck_timeout` before `now_ns` (owner clock,
    /// see [`now_ns`](Self::now_ns)) and frees their space. Reservations the
    /// device published meanwhile are marked committed. Returns how many were
    /// reclaimed.
    pub fn reclaim_stuck(&self, now_ns: u64) -> usize {
        let timeout = self.cfg.stuck_timeout.as_nanos() as u64;
        let mut inner = self.inner.lock();
        let pending: Vec<u32> = inner.pending.values().copied().collect();
        let mut reclaimed = 0;
        for slot in pending {
            let st = match self.heap.load_u32(slot, HeaderU32Field::State, Ordering::Acquire) {
                Ok(st) => st,
                Err(e) => {
                    tracing::warn!(slot, error = %e, "watchdog cannot read header");
                    continue;
                }
            };
            let from = match ObjectState::from_u32(st) {
                Some(ObjectState::Ready) => {
                    inner.mark_committed(slot);
                    continue;
                }
                Some(s @ (ObjectState::Reserved | ObjectState::Writing)) => s,
                _ => continue,
            };
            let ts = self.heap.load_u64(slot, HeaderU64Field::StateTs, Ordering::Relaxed).unwrap_or(now_ns);
            if now_ns.saturating_sub(ts) <= timeout {
                continue;
            }
            match self.heap.retire(slot, from, now_ns) {
                Ok(RetireOutcome::Retired) => {
                    tracing::warn!(slot, "watchdog reclaimed a stuck put");
                    inner.release(slot);
                    inner.stuck_put_reclaimed += 1;
                    reclaimed += 1;
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(slot, error = %e, "watchdog cannot retire"),
            }
        }
        reclaimed
    }

    /// Counters and usage.
    pub fn stats(&self) -> CacheStats {
        let inner = self.inner.lock();
        let objects = inner.index.len() as u64;
        let writing = inner.pending.len() as u64;
        CacheStats {
            bytes_used: inner.alloc.used(),
            bytes_total: inner.alloc.capacity(),
            objects,
            ready_count: objects - writing,
            writing_count: writing,
            header_slots: inner.slots.len() as u64,
            header_slots_used: (inner.slots.len() - inner.free_slots.len()) as u64,
            evict_count: inner.evict_count,
            evict_in_use_retry: inner.evict_in_use_retry,
            evict_not_ready_skip: inner.evict_not_ready_skip,
            oom_count: inner.oom_count,
            stuck_put_reclaimed: inner.stuck_put_reclaimed,
            puts: inner.puts,
            gets: self.gets.load(Ordering::Relaxed),
            get_misses: self.get_misses.load(Ordering::Relaxed),
            free_ranges: inner.alloc.free_ranges() as u64,
        }
    }

    /// Keys currently indexed, oldest first (the FIFO order).
    pub fn keys_fifo(&self) -> Vec<String> {
        let inner = self.inner.lock();
        inner.fifo.values().filter_map(|&s| inner.slots[s as usize].as_ref().map(|e| e.key.to_string())).collect()
    }

    /// Whether `key` is indexed (in any state).
    pub fn contains(&self, key: &str) -> bool {
        self.inner.lock().index.contains_key(key)
    }
}

impl NanoKvCache<CudaDeviceHeap> {
    /// Puts `bytes_total` bytes of device memory at `src` (a device pointer in
    /// the heap's context, the bytes contiguous) under `key`: the reservation,
    /// the page copy and the READY publish go on the heap's stream in order and
    /// are waited for once (`nk_write_header`, the copy, then `nk_publish`), where
    /// [`open_for_write`](Self::open_for_write) +
    /// [`CudaDeviceHeap::push_from_device`] wait twice. On a failed copy the
    /// reservation is aborted. Errors as `open_for_write`, and `Stale` when the
    /// reservation was reclaimed before the publish.
    pub fn put_from_device(&self, key: &str, src: u64, bytes_total: u64) -> Result<()> {
        let plan = self.reserve(key, bytes_total, HeaderWrite::InOrder)?;
        match self.heap.push_from_device(&plan, src, 0, plan.n_pages, true, self.now_ns()) {
            Ok(()) => {
                let mut inner = self.inner.lock();
                if inner.slots[plan.slot as usize].as_ref().is_some_and(|e| e.epoch == plan.epoch) {
                    inner.count_put(plan.slot);
                }
                Ok(())
            }
            Err(e) => {
                // The header's own write may be what failed: its epoch is no
                // longer known for sure.
                if self.abort(&plan).is_err() {
                    // Then the slot still reads DEAD, which `abort` takes for an
                    // evictor between its steps and leaves alone: the key would stay
                    // reserved for good (the watchdog reclaims only RESERVED and
                    // WRITING). No reader pins a DEAD slot, and this cache is the
                    // heap's only owner: the reservation is freed here.
                    let mut inner = self.inner.lock();
                    let ours = inner.holds(&plan);
                    let dead = self.heap.load_u32(plan.slot, HeaderU32Field::State, Ordering::Acquire).ok()
                        == Some(ObjectState::Dead.as_u32());
                    if ours && dead {
                        inner.release(plan.slot);
                    }
                }
                self.inner.lock().epochs[plan.slot as usize] = None;
                Err(e)
            }
        }
    }
}

impl<H: DeviceHeap + ?Sized + 'static> NanoKvCache<H> {
    /// Starts a watchdog thread that calls [`reclaim_stuck`](Self::reclaim_stuck)
    /// every `interval`. It holds only a weak reference: it ends when the
    /// cache is dropped or the returned handle is dropped/stopped.
    pub fn spawn_watchdog(self: &Arc<Self>, interval: Duration) -> Watchdog {
        let weak: Weak<Self> = Arc::downgrade(self);
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let stop2 = stop.clone();
        let handle = std::thread::Builder::new()
            .name("mooncake-kv-watchdog".into())
            .spawn(move || loop {
                {
                    let mut stopped = stop2.0.lock();
                    if !*stopped {
                        stop2.1.wait_for(&mut stopped, interval);
                    }
                    if *stopped {
                        return;
                    }
                }
                let Some(cache) = weak.upgrade() else { return };
                cache.reclaim_stuck(cache.now_ns());
            })
            .expect("spawn watchdog thread");
        Watchdog { stop, handle: Some(handle) }
    }
}
