//! [`ClientBuffer`]: the staging area that serves SSD objects to remote clients.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ahash::AHashMap;
use mooncake_offset_allocator::{Allocation, OffsetAllocator};
use parking_lot::{Condvar, Mutex};

use crate::backend::StorageBackend;
use crate::error::{Result, StorageError};
use crate::io::IoUringEngine;

/// Alignment of slots in the buffer.
pub(crate) const SLOT_ALIGN: u64 = 4096;

/// Where one object of a batch lies in the buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BufferLocation {
    /// Offset from the start of the buffer.
    pub offset: u64,
    /// Bytes of the object (the slot may be larger).
    pub len: u64,
}

/// A batch of slots, valid until released or reclaimed by the GC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchLease {
    /// Identifies the batch for [`ClientBuffer::release`]: 64 bits no one can
    /// guess from other batches' ids (a keyed hash of a counter under a key drawn
    /// at random per buffer), so that only the client it was handed to can release
    /// it, and a restarted node never takes an old id for a new batch.
    pub batch_id: u64,
    /// One location per requested size, in order.
    pub locations: Vec<BufferLocation>,
    /// Time after which the GC may reclaim the batch, in milliseconds.
    pub gc_ttl_ms: u64,
}

struct Lease {
    allocs: Vec<Allocation>,
    locations: Vec<BufferLocation>,
    deadline: Instant,
    /// Slots borrowed through [`SlotGuard`]s.
    in_use: Vec<bool>,
    users: usize,
    /// Released (or expired) while slots were borrowed: freed by the last guard.
    released: bool,
}

/// Counters of a [`ClientBuffer`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingStats {
    /// Bytes of the buffer.
    pub capacity: u64,
    /// Bytes held by live batches.
    pub used_bytes: u64,
    /// Live batches.
    pub batches: u64,
    /// Batches reclaimed by the GC since creation.
    pub gc_reclaimed: u64,
}

/// A contiguous, page-aligned staging buffer with batch leases, that serves SSD
/// objects to remote clients.
///
/// A remote client asks this node for objects that live only on its disk
/// (`batch_get_offload_object(keys)`); the node reads them into slots of its
/// `ClientBuffer` ([`load_into_staging`]) and answers with a [`BatchLease`]
/// (`batch_id`, the slots' [`BufferLocation`]s, `gc_ttl_ms`). The requester pulls the
/// bytes with its transfer engine, then releases the batch
/// ([`ClientBuffer::release`]); a lease never released is reclaimed by
/// [`ClientBuffer::gc`] once `gc_ttl` has passed.
///
/// The buffer is one anonymous mapping (page-aligned, so also `O_DIRECT`-aligned),
/// whose space is handed out by an offset allocator with 4 KiB alignment. It can be
/// registered as the `io_uring` fixed buffer ([`ClientBuffer::register_with_uring`])
/// and with a transfer engine ([`ClientBuffer::as_ptr`], [`ClientBuffer::len`]).
pub struct ClientBuffer {
    base: *mut u8,
    len: usize,
    /// Memory lent by someone else (see [`ClientBuffer::from_raw_parts`]): kept alive
    /// by this value, and not unmapped on drop.
    lent: Option<Box<dyn std::any::Any + Send + Sync>>,
    alloc: Mutex<OffsetAllocator>,
    leases: Mutex<AHashMap<u64, Lease>>,
    /// Counts batches; their ids are this count under `batch_ids`.
    next_batch: AtomicU64,
    /// A keyed hash (SipHash under a random key) that turns the count into ids.
    batch_ids: std::collections::hash_map::RandomState,
    gc_ttl: Duration,
    gc_reclaimed: AtomicU64,
    uring_registered: AtomicBool,
}

// SAFETY: the mapping is owned by the ClientBuffer; mutable access to its bytes is
// only given through SlotGuards, which the lease table makes unique per slot, and
// slots never overlap (they come from one allocator).
unsafe impl Send for ClientBuffer {}
// SAFETY: as above; every shared-state field is behind a lock or atomic.
unsafe impl Sync for ClientBuffer {}

impl ClientBuffer {
    /// Maps `size` bytes (rounded up to 4 KiB); leases expire after `gc_ttl`.
    pub fn new(size: u64, gc_ttl: Duration) -> Result<Self> {
        let len = size.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        if len == 0 {
            return Err(StorageError::InvalidArgument("staging buffer of 0 bytes".into()));
        }
        let len = usize::try_from(len).map_err(|_| StorageError::InvalidArgument("staging buffer too large".into()))?;
        // SAFETY: an anonymous private mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        Self::over(p.cast(), len, None, gc_ttl).inspect_err(|_| {
            // SAFETY: the mapping made above, not handed to anyone.
            unsafe { libc::munmap(p, len) };
        })
    }

    /// A buffer over `len` bytes at `base` (a whole number of slots).
    fn over(
        base: *mut u8,
        len: usize,
        lent: Option<Box<dyn std::any::Any + Send + Sync>>,
        gc_ttl: Duration,
    ) -> Result<Self> {
        let alloc = OffsetAllocator::with_alignment(len as u64, SLOT_ALIGN)
            .map_err(|e| StorageError::InvalidArgument(e.to_string()))?;
        Ok(ClientBuffer {
            base,
            len,
            lent,
            alloc: Mutex::new(alloc),
            leases: Mutex::new(AHashMap::new()),
            next_batch: AtomicU64::new(1),
            batch_ids: std::collections::hash_map::RandomState::new(),
            gc_ttl,
            gc_reclaimed: AtomicU64::new(0),
            uring_registered: AtomicBool::new(false),
        })
    }

    /// A staging buffer over memory someone else owns, typically a region registered
    /// with a transfer engine, so that peers pull staged objects straight out of it
    /// (no copy between the disk read and the network). `owner` keeps the memory
    /// alive and is dropped with the buffer; the memory is not unmapped here. Only
    /// whole 4 KiB slots inside `len` are used.
    ///
    /// # Safety
    /// `base` must be valid for reads and writes of `len` bytes, 4 KiB-aligned, for as
    /// long as `owner` lives, and nothing else may write the range while this buffer
    /// exists (readers, such as a transfer engine serving peers, are fine).
    pub unsafe fn from_raw_parts(
        base: *mut u8,
        len: usize,
        gc_ttl: Duration,
        owner: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Self> {
        if !(base as usize).is_multiple_of(SLOT_ALIGN as usize) {
            return Err(StorageError::InvalidArgument("staging memory is not 4 KiB-aligned".into()));
        }
        let usable = len - len % SLOT_ALIGN as usize;
        if usable == 0 {
            return Err(StorageError::InvalidArgument("staging buffer of less than 4 KiB".into()));
        }
        Self::over(base, usable, Some(owner), gc_ttl)
    }

    /// Start of the buffer (to register it with a transfer engine).
    pub fn as_ptr(&self) -> *const u8 {
        self.base
    }

    /// Bytes of the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false (a buffer has at least 4 KiB).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The lease time-to-live.
    pub fn gc_ttl(&self) -> Duration {
        self.gc_ttl
    }

    /// Registers the buffer as the process-wide `io_uring` fixed buffer (reads into
    /// it then use `READ_FIXED`); undone when the buffer is dropped.
    pub fn register_with_uring(&self) {
        // SAFETY: the mapping stays valid until Drop, which unregisters it first.
        unsafe { IoUringEngine::register_fixed_buffer(self.base, self.len) };
        self.uring_registered.store(true, Ordering::Release);
    }

    /// Reserves one slot per size (all or none); [`StorageError::NoSpace`] if they do
    /// not fit. Zero sizes get an empty location.
    pub fn allocate_batch(&self, sizes: &[u64]) -> Result<BatchLease> {
        let mut allocs = Vec::with_capacity(sizes.len());
        let mut locations = Vec::with_capacity(sizes.len());
        {
            let mut a = self.alloc.lock();
            for &s in sizes {
                match a.allocate(s.max(1)) {
                    Some(x) => {
                        locations.push(BufferLocation { offset: x.offset(), len: s });
                        allocs.push(x);
                    }
                    None => {
                        for x in allocs {
                            a.free(x);
                        }
                        return Err(StorageError::NoSpace { needed: sizes.iter().sum(), capacity: self.len as u64 });
                    }
                }
            }
        }
        let lease = Lease {
            allocs,
            locations: locations.clone(),
            deadline: Instant::now() + self.gc_ttl,
            in_use: vec![false; locations.len()],
            users: 0,
            released: false,
        };
        let batch_id = {
            let mut leases = self.leases.lock();
            // Ids are not sequential: a client releasing a batch it guessed would
            // free slots another client is still reading. One never repeats a live
            // batch's (nor is 0).
            let batch_id = loop {
                let n = self.next_batch.fetch_add(1, Ordering::Relaxed);
                let id = std::hash::BuildHasher::hash_one(&self.batch_ids, n);
                if id != 0 && !leases.contains_key(&id) {
                    break id;
                }
            };
            leases.insert(batch_id, lease);
            batch_id
        };
        Ok(BatchLease { batch_id, locations, gc_ttl_ms: self.gc_ttl.as_millis() as u64 })
    }

    /// Mutable access to slot `index` of a live batch (to fill it), exclusive while
    /// the guard lives; the batch is not freed before the guard drops.
    pub fn slot(&self, batch_id: u64, index: usize) -> Result<SlotGuard<'_>> {
        let mut leases = self.leases.lock();
        let lease = leases
            .get_mut(&batch_id)
            .filter(|l| !l.released)
            .ok_or_else(|| StorageError::NotFound(format!("staging batch {batch_id}")))?;
        let loc = *lease
            .locations
            .get(index)
            .ok_or_else(|| StorageError::InvalidArgument(format!("batch {batch_id} has no slot {index}")))?;
        if lease.in_use[index] {
            return Err(StorageError::InvalidArgument(format!("slot {index} of batch {batch_id} is borrowed")));
        }
        lease.in_use[index] = true;
        lease.users += 1;
        Ok(SlotGuard { buf: self, batch_id, index, loc })
    }

    /// Copies out the bytes of a slot of a live batch (what a transfer engine would
    /// read).
    pub fn read_slot(&self, batch_id: u64, index: usize) -> Result<Vec<u8>> {
        Ok(self.slot(batch_id, index)?.to_vec())
    }

    /// Frees a batch; false if unknown (already released or reclaimed).
    pub fn release(&self, batch_id: u64) -> bool {
        let mut leases = self.leases.lock();
        let Some(lease) = leases.get_mut(&batch_id) else { return false };
        if lease.released {
            return false;
        }
        if lease.users > 0 {
            lease.released = true;
            return true;
        }
        let lease = leases.remove(&batch_id).expect("present");
        drop(leases);
        self.free(lease);
        true
    }

    /// Reclaims every batch whose TTL has passed; returns how many.
    pub fn gc(&self) -> usize {
        let now = Instant::now();
        let expired: Vec<u64> =
            self.leases.lock().iter().filter(|(_, l)| !l.released && l.deadline <= now).map(|(&id, _)| id).collect();
        let n = expired.into_iter().filter(|&id| self.release(id)).count();
        if n > 0 {
            tracing::debug!("staging GC reclaimed {n} batches");
        }
        self.gc_reclaimed.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// Runs [`gc`](Self::gc) every `interval` on a thread until the handle drops.
    pub fn spawn_gc(self: &Arc<Self>, interval: Duration) -> GcThread {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let buf = Arc::downgrade(self);
        let s = stop.clone();
        let handle = std::thread::Builder::new()
            .name("mooncake-staging-gc".into())
            .spawn(move || loop {
                let mut stopped = s.0.lock();
                if !*stopped {
                    s.1.wait_for(&mut stopped, interval);
                }
                if *stopped {
                    return;
                }
                drop(stopped);
                match buf.upgrade() {
                    Some(b) => {
                        b.gc();
                    }
                    None => return,
                }
            })
            .ok();
        GcThread { stop, handle }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> StagingStats {
        StagingStats {
            capacity: self.len as u64,
            used_bytes: self.alloc.lock().used_bytes(),
            batches: self.leases.lock().len() as u64,
            gc_reclaimed: self.gc_reclaimed.load(Ordering::Relaxed),
        }
    }

    fn free(&self, lease: Lease) {
        let mut a = self.alloc.lock();
        for x in lease.allocs {
            a.free(x);
        }
    }

    fn return_slot(&self, batch_id: u64, index: usize) {
        let mut leases = self.leases.lock();
        let Some(lease) = leases.get_mut(&batch_id) else { return };
        lease.in_use[index] = false;
        lease.users -= 1;
        if lease.released && lease.users == 0 {
            let lease = leases.remove(&batch_id).expect("present");
            drop(leases);
            self.free(lease);
        }
    }
}

impl Drop for ClientBuffer {
    fn drop(&mut self) {
        if self.uring_registered.load(Ordering::Acquire) {
            IoUringEngine::unregister_fixed_buffer_if(self.base);
        }
        if self.lent.is_some() {
            // Lent memory: its owner (dropped with `self`) frees it.
            return;
        }
        // SAFETY: `base`/`len` are the mapping made in `new`; no guard outlives `self`.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

impl std::fmt::Debug for ClientBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientBuffer").field("len", &self.len).field("gc_ttl", &self.gc_ttl).finish()
    }
}

/// Exclusive access to one slot of a batch; dereferences to the object's bytes.
pub struct SlotGuard<'a> {
    buf: &'a ClientBuffer,
    batch_id: u64,
    index: usize,
    loc: BufferLocation,
}

impl SlotGuard<'_> {
    /// The slot's location.
    pub fn location(&self) -> BufferLocation {
        self.loc
    }
}

impl std::ops::Deref for SlotGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the slot lies inside the mapping (it came from the allocator over
        // it), stays allocated while the guard lives, and no other guard covers it.
        unsafe { std::slice::from_raw_parts(self.buf.base.add(self.loc.offset as usize), self.loc.len as usize) }
    }
}

impl std::ops::DerefMut for SlotGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`; the guard is the only access path to the slot.
        unsafe { std::slice::from_raw_parts_mut(self.buf.base.add(self.loc.offset as usize), self.loc.len as usize) }
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.buf.return_slot(self.batch_id, self.index);
    }
}

/// The GC thread of [`ClientBuffer::spawn_gc`]; stops (and is joined) on drop.
pub struct GcThread {
    stop: Arc<(Mutex<bool>, Condvar)>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl Drop for GcThread {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// The serving side of a remote load: reads `keys` from `backend` into a new batch
/// of `staging` and returns its lease (what `batch_get_offload_object` answers). All
/// keys must load, or the batch is released and the first error returned.
pub fn load_into_staging(backend: &dyn StorageBackend, staging: &ClientBuffer, keys: &[&str]) -> Result<BatchLease> {
    let mut sizes = Vec::with_capacity(keys.len());
    for k in keys {
        sizes.push(backend.object_meta(k).ok_or_else(|| StorageError::NotFound(k.to_string()))?.len);
    }
    let lease = staging.allocate_batch(&sizes)?;
    let res = (|| {
        let mut guards = Vec::with_capacity(keys.len());
        for i in 0..keys.len() {
            guards.push(staging.slot(lease.batch_id, i)?);
        }
        let mut reqs: Vec<(&str, &mut [u8])> = keys.iter().copied().zip(guards.iter_mut().map(|g| &mut **g)).collect();
        for r in backend.batch_load(&mut reqs) {
            r?;
        }
        Ok(())
    })();
    match res {
        Ok(()) => Ok(lease),
        Err(e) => {
            staging.release(lease.batch_id);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_release_and_gc() {
        let b = ClientBuffer::new(64 << 10, Duration::from_millis(30)).unwrap();
        let l = b.allocate_batch(&[100, 5000, 1]).unwrap();
        assert_eq!(l.locations.len(), 3);
        assert!(l.locations.iter().all(|x| x.offset % SLOT_ALIGN == 0));
        assert!(b.allocate_batch(&[1 << 20]).is_err(), "too large");
        {
            let mut s = b.slot(l.batch_id, 1).unwrap();
            s.fill(7);
            assert!(b.slot(l.batch_id, 1).is_err(), "exclusive");
        }
        assert_eq!(b.read_slot(l.batch_id, 1).unwrap(), vec![7; 5000]);
        assert!(b.release(l.batch_id));
        assert!(!b.release(l.batch_id));
        assert_eq!(b.stats().used_bytes, 0);

        let l2 = b.allocate_batch(&[4096]).unwrap();
        let guard = b.slot(l2.batch_id, 0).unwrap();
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(b.gc(), 1);
        assert!(b.stats().used_bytes > 0, "a borrowed slot survives the GC until returned");
        drop(guard);
        assert_eq!(b.stats().used_bytes, 0);
        assert!(b.slot(l2.batch_id, 0).is_err());
    }

    /// Memory lent to a buffer in a test: freed by its own drop, which is recorded.
    struct Lent {
        ptr: *mut u8,
        layout: std::alloc::Layout,
        dropped: Arc<AtomicBool>,
    }
    // SAFETY: the allocation is owned by `Lent` alone.
    unsafe impl Send for Lent {}
    // SAFETY: `Lent` gives no access to the memory.
    unsafe impl Sync for Lent {}
    impl Drop for Lent {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
            // SAFETY: allocated in the test with this layout.
            unsafe { std::alloc::dealloc(self.ptr, self.layout) };
        }
    }

    #[test]
    fn lent_memory_is_used_whole_slots_only_and_freed_by_its_owner() {
        let layout = std::alloc::Layout::from_size_align(3 * 4096 + 100, 4096).unwrap();
        // SAFETY: a non-zero layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        let dropped = Arc::new(AtomicBool::new(false));
        let owner = Box::new(Lent { ptr, layout, dropped: dropped.clone() });
        // SAFETY: 4 KiB-aligned memory that `owner` keeps alive; nobody else uses it.
        let b = unsafe { ClientBuffer::from_raw_parts(ptr, layout.size(), Duration::from_secs(1), owner) }.unwrap();
        assert_eq!(b.len(), 3 * 4096, "the partial slot at the end is not used");
        assert_eq!(b.as_ptr(), ptr as *const u8);
        let l = b.allocate_batch(&[4096, 8192]).unwrap();
        b.slot(l.batch_id, 1).unwrap().fill(9);
        assert_eq!(b.read_slot(l.batch_id, 1).unwrap(), vec![9; 8192]);
        assert!(b.allocate_batch(&[4096]).is_err(), "three slots, all taken");
        drop(b);
        assert!(dropped.load(Ordering::SeqCst), "the owner is dropped with the buffer");
        let other = Box::new(());
        // SAFETY: refused before any use: misaligned.
        assert!(unsafe { ClientBuffer::from_raw_parts(4097 as *mut u8, 8192, Duration::ZERO, other) }.is_err());
        // SAFETY: refused before any use: less than one slot.
        assert!(unsafe { ClientBuffer::from_raw_parts(4096 as *mut u8, 4095, Duration::ZERO, Box::new(())) }.is_err());
    }

    /// Batch ids tell nothing of other batches' (a client that knows its own cannot
    /// release its neighbours'), and a new buffer (a restarted node) does not hand
    /// out the old one's ids again.
    #[test]
    fn batch_ids_cannot_be_guessed() {
        let b = ClientBuffer::new(1 << 20, Duration::from_secs(60)).unwrap();
        let ids: Vec<u64> = (0..64).map(|_| b.allocate_batch(&[4096]).unwrap().batch_id).collect();
        let set: std::collections::HashSet<u64> = ids.iter().copied().collect();
        assert_eq!(set.len(), ids.len());
        for &id in &ids {
            for guess in [id.wrapping_add(1), id.wrapping_sub(1)] {
                assert!(!set.contains(&guess), "{guess} follows from {id}");
                assert!(!b.release(guess));
            }
        }
        for guess in 0..=64 {
            assert!(set.contains(&guess) || !b.release(guess));
        }
        assert_eq!(b.stats().batches, 64, "no guess released a batch");
        let restarted = ClientBuffer::new(1 << 20, Duration::from_secs(60)).unwrap();
        let again: Vec<u64> = (0..64).map(|_| restarted.allocate_batch(&[4096]).unwrap().batch_id).collect();
        assert!(again.iter().all(|id| !set.contains(id)), "a new buffer's ids are new");
        for id in ids {
            assert!(b.release(id));
        }
    }

    #[test]
    fn gc_thread_reclaims() {
        let b = Arc::new(ClientBuffer::new(1 << 20, Duration::from_millis(10)).unwrap());
        let _gc = b.spawn_gc(Duration::from_millis(5));
        b.allocate_batch(&[1000, 2000]).unwrap();
        let start = Instant::now();
        while b.stats().batches > 0 {
            assert!(start.elapsed() < Duration::from_secs(5), "GC never ran");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(b.stats().gc_reclaimed >= 1);
    }
}
