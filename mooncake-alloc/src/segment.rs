//! One segment's space: a thread-safe offset allocator and RAII buffers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_offset_allocator::{Allocation, AllocatorReport, Block, OffsetAllocator, DEFAULT_ALIGNMENT};
use parking_lot::Mutex;

use crate::error::AllocationError;

/// Identifier of a mounted segment (given by the master when the segment is mounted).
///
/// ```
/// use mooncake_alloc::{SegmentAllocator, SegmentId};
/// let id: SegmentId = 42;
/// assert_eq!(SegmentAllocator::new(id, "node-a", 4096).id(), 42);
/// ```
pub type SegmentId = u64;

/// The space of one mounted segment. Reads of its counters are lock-free.
///
/// ```
/// use mooncake_alloc::SegmentAllocator;
/// let seg = SegmentAllocator::new(7, "10.0.0.1:17000#1", 1 << 20);
/// let buf = seg.allocate(1000).unwrap();
/// assert_eq!((buf.segment_id(), buf.len()), (7, 1000));
/// assert_eq!(seg.used_bytes(), 1024); // rounded up to the 64-byte alignment
/// drop(buf);
/// assert_eq!(seg.used_bytes(), 0);
/// ```
#[derive(Debug)]
pub struct SegmentAllocator {
    id: SegmentId,
    name: String,
    capacity: u64,
    used: AtomicU64,
    inner: Mutex<OffsetAllocator>,
}

impl SegmentAllocator {
    /// A segment of `capacity` bytes with 64-byte alignment.
    ///
    /// # Panics
    /// If `capacity` is below 64 bytes (see [`with_alignment`](Self::with_alignment)).
    pub fn new(id: SegmentId, name: impl Into<String>, capacity: u64) -> Arc<Self> {
        Self::with_alignment(id, name, capacity, DEFAULT_ALIGNMENT).expect("segment of at least 64 bytes")
    }

    /// A segment of `capacity` bytes (rounded down to the alignment) whose buffers
    /// are aligned to `alignment` (a power of two).
    ///
    /// Fails with [`AllocationError::InvalidAlignment`] if `alignment` is not a power
    /// of two, and with [`AllocationError::InvalidRequest`] if the capacity is smaller
    /// than one alignment unit.
    ///
    /// ```
    /// use mooncake_alloc::{AllocationError, SegmentAllocator};
    /// let seg = SegmentAllocator::with_alignment(1, "gpu0", 1 << 30, 2 << 20)?; // 2 MiB pages
    /// let page = seg.allocate(1).unwrap();
    /// assert_eq!(page.offset() % (2 << 20), 0);
    /// assert_eq!(seg.used_bytes(), 2 << 20); // one whole page reserved
    /// assert_eq!(
    ///     SegmentAllocator::with_alignment(1, "bad", 1 << 30, 3).unwrap_err(),
    ///     AllocationError::InvalidAlignment(3)
    /// );
    /// # Ok::<(), AllocationError>(())
    /// ```
    pub fn with_alignment(
        id: SegmentId,
        name: impl Into<String>,
        capacity: u64,
        alignment: u64,
    ) -> Result<Arc<Self>, AllocationError> {
        let inner = OffsetAllocator::with_alignment(capacity, alignment).map_err(|e| match e {
            mooncake_offset_allocator::OffsetAllocatorError::InvalidAlignment(a) => {
                AllocationError::InvalidAlignment(a)
            }
            other => AllocationError::InvalidRequest(other.to_string()),
        })?;
        Ok(Arc::new(Self {
            id,
            name: name.into(),
            capacity: inner.capacity(),
            used: AtomicU64::new(0),
            inner: Mutex::new(inner),
        }))
    }

    /// The segment's id.
    pub fn id(&self) -> SegmentId {
        self.id
    }

    /// The segment's name (matched by preferred segments).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes managed (the capacity given, rounded down to the alignment).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes reserved (requests rounded up to the alignment). Lock-free.
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes free, possibly in several blocks (see [`report`](Self::report)).
    /// Lock-free.
    pub fn free_bytes(&self) -> u64 {
        self.capacity.saturating_sub(self.used_bytes())
    }

    /// Free bytes over capacity, in `[0, 1]`; what [`FreeRatioFirst`](crate::FreeRatioFirst)
    /// ranks by. Lock-free.
    ///
    /// ```
    /// use mooncake_alloc::SegmentAllocator;
    /// let seg = SegmentAllocator::new(0, "a", 1 << 20);
    /// let _quarter = seg.allocate(256 << 10).unwrap();
    /// assert_eq!(seg.free_ratio(), 0.75);
    /// ```
    pub fn free_ratio(&self) -> f64 {
        self.free_bytes() as f64 / self.capacity as f64
    }

    fn wrap(self: &Arc<Self>, a: Option<Allocation>, len: u64) -> Option<AllocatedBuffer> {
        let a = a?;
        self.used.fetch_add(a.size(), Ordering::Relaxed);
        Some(AllocatedBuffer { segment: self.clone(), allocation: Some(a), len })
    }

    /// Reserves `size` bytes (rounded up to the alignment); `None` if `size` is 0 or
    /// no free block fits. The space returns when the buffer is dropped.
    pub fn allocate(self: &Arc<Self>, size: u64) -> Option<AllocatedBuffer> {
        if size == 0 || size > self.free_bytes() {
            return None;
        }
        let a = self.inner.lock().allocate(size);
        self.wrap(a, size)
    }

    /// Reserves exactly `[offset, offset + size)` if it is free and `offset` is
    /// aligned (rebuilding a segment's layout after a master restart). Cheapest when
    /// ranges are reserved in increasing offset order.
    ///
    /// ```
    /// use mooncake_alloc::SegmentAllocator;
    /// let seg = SegmentAllocator::new(0, "a", 1 << 20);
    /// let b = seg.allocate_at(8192, 100).unwrap();
    /// assert_eq!((b.offset(), b.len()), (8192, 100));
    /// assert!(seg.allocate_at(8192, 1).is_none(), "taken");
    /// ```
    pub fn allocate_at(self: &Arc<Self>, offset: u64, size: u64) -> Option<AllocatedBuffer> {
        let a = self.inner.lock().allocate_at(offset, size);
        self.wrap(a, size)
    }

    /// Space and fragmentation (takes the segment's lock).
    ///
    /// ```
    /// use mooncake_alloc::SegmentAllocator;
    /// let seg = SegmentAllocator::new(0, "a", 1 << 20);
    /// let mut bufs: Vec<_> = (0..4).map(|_| seg.allocate(256 << 10).unwrap()).collect();
    /// bufs.swap_remove(2);
    /// bufs.swap_remove(0); // two holes of 256 KiB, not adjacent
    /// let r = seg.report();
    /// assert_eq!((r.free_bytes, r.free_regions, r.largest_free_region), (512 << 10, 2, 256 << 10));
    /// assert_eq!(r.fragmentation, 0.5);
    /// ```
    pub fn report(&self) -> AllocatorReport {
        self.inner.lock().report()
    }
}

/// A reserved range of a segment; the space returns to the segment when dropped.
/// Not `Clone` (one owner, one free); `Send + Sync`.
///
/// ```
/// use mooncake_alloc::SegmentAllocator;
/// let seg = SegmentAllocator::new(3, "node-a", 1 << 20);
/// let buf = seg.allocate(1000).unwrap();
/// assert_eq!(buf.segment_id(), 3);
/// assert_eq!(buf.segment().name(), "node-a");
/// assert_eq!((buf.offset(), buf.len(), buf.is_empty()), (0, 1000, false));
/// let moved = std::thread::spawn(move || buf.len()).join().unwrap(); // dropped there
/// assert_eq!((moved, seg.used_bytes()), (1000, 0));
/// ```
#[derive(Debug)]
pub struct AllocatedBuffer {
    segment: Arc<SegmentAllocator>,
    allocation: Option<Allocation>,
    len: u64,
}

impl AllocatedBuffer {
    /// Id of the segment holding the range.
    pub fn segment_id(&self) -> SegmentId {
        self.segment.id
    }

    /// The segment holding the range.
    pub fn segment(&self) -> &Arc<SegmentAllocator> {
        &self.segment
    }

    /// First byte of the range.
    pub fn offset(&self) -> u64 {
        self.allocation.as_ref().map_or(0, Allocation::offset)
    }

    /// Bytes requested (the reservation may be rounded up to the alignment).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the buffer has no bytes (never true: empty requests are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AllocatedBuffer {
    fn drop(&mut self) {
        if let Some(a) = self.allocation.take() {
            self.segment.used.fetch_sub(a.size(), Ordering::Relaxed);
            self.segment.inner.lock().free(a);
        }
    }
}

/// A reserved range whose length its owner keeps elsewhere (the master keeps one per
/// replica, and every replica of an object has the object's length): 24 bytes where
/// an [`AllocatedBuffer`] takes 40. The space returns to the segment when dropped.
/// It carries one flag for its owner, [`filled`](Self::filled), in bytes that would
/// otherwise be padding.
///
/// ```
/// use mooncake_alloc::{CompactBuffer, SegmentAllocator};
/// let seg = SegmentAllocator::new(3, "node-a", 1 << 20);
/// let mut buf = CompactBuffer::from(seg.allocate(1000).unwrap());
/// assert_eq!((buf.segment_id(), buf.offset(), buf.filled()), (3, 0, false));
/// buf.set_filled(true);
/// assert!(buf.filled());
/// assert_eq!(seg.used_bytes(), 1024);
/// drop(buf);
/// assert_eq!(seg.used_bytes(), 0);
/// ```
#[derive(Debug)]
pub struct CompactBuffer {
    segment: Arc<SegmentAllocator>,
    offset: u64,
    /// `None` only for a buffer made from an already emptied one (never in practice).
    block: Option<Block>,
    filled: bool,
}

impl CompactBuffer {
    /// Id of the segment holding the range.
    pub fn segment_id(&self) -> SegmentId {
        self.segment.id
    }

    /// The segment holding the range.
    pub fn segment(&self) -> &Arc<SegmentAllocator> {
        &self.segment
    }

    /// First byte of the range.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The owner's flag (false when made): the master sets it once the range's bytes
    /// are all written.
    pub fn filled(&self) -> bool {
        self.filled
    }

    /// Sets the owner's flag.
    pub fn set_filled(&mut self, filled: bool) {
        self.filled = filled;
    }
}

impl From<AllocatedBuffer> for CompactBuffer {
    fn from(mut buf: AllocatedBuffer) -> Self {
        let offset = buf.offset();
        // Taking the allocation leaves `buf`'s drop nothing to free: the range now
        // belongs to the compact buffer.
        let block = buf.allocation.take().map(Allocation::into_block);
        Self { segment: buf.segment.clone(), offset, block, filled: false }
    }
}

impl Drop for CompactBuffer {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            let freed = self.segment.inner.lock().try_free_block(self.offset, block);
            debug_assert!(freed.is_ok(), "{freed:?}");
            if let Ok(bytes) = freed {
                self.segment.used.fetch_sub(bytes, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_buffers_are_small_and_free_their_space() {
        assert_eq!(std::mem::size_of::<CompactBuffer>(), 24);
        let seg = SegmentAllocator::new(1, "s", 1 << 20);
        let a = CompactBuffer::from(seg.allocate(1000).unwrap());
        let b = CompactBuffer::from(seg.allocate(64).unwrap());
        assert_eq!((a.offset(), b.offset()), (0, 1024));
        assert_eq!(seg.used_bytes(), 1088);
        drop(a);
        assert_eq!(seg.used_bytes(), 64);
        let c = seg.allocate(2048).unwrap();
        drop(b);
        drop(c);
        assert_eq!(seg.used_bytes(), 0);
        assert_eq!(seg.report().largest_free_region, 1 << 20, "the frees coalesce");
    }
}
