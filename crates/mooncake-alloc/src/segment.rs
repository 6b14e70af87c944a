//! One segment's space: a thread-safe offset allocator and RAII buffers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_offset_allocator::{Allocation, AllocatorReport, OffsetAllocator, DEFAULT_ALIGNMENT};
use parking_lot::Mutex;

use crate::strategy::AllocationError;

/// Identifier of a mounted segment (given by the master).
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

    /// A segment whose buffers are aligned to `alignment` (a power of two).
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

    /// Bytes managed.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes reserved.
    pub fn used_bytes(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Bytes free.
    pub fn free_bytes(&self) -> u64 {
        self.capacity.saturating_sub(self.used_bytes())
    }

    /// Free bytes over capacity.
    pub fn free_ratio(&self) -> f64 {
        self.free_bytes() as f64 / self.capacity as f64
    }

    fn wrap(self: &Arc<Self>, a: Option<Allocation>, len: u64) -> Option<AllocatedBuffer> {
        let a = a?;
        self.used.fetch_add(a.size(), Ordering::Relaxed);
        Some(AllocatedBuffer { segment: self.clone(), allocation: Some(a), len })
    }

    /// Reserves `size` bytes; `None` if no free block fits.
    pub fn allocate(self: &Arc<Self>, size: u64) -> Option<AllocatedBuffer> {
        if size == 0 || size > self.free_bytes() {
            return None;
        }
        let a = self.inner.lock().allocate(size);
        self.wrap(a, size)
    }

    /// Reserves exactly `[offset, offset + size)` if it is free (rebuilding a
    /// segment's layout after a master restart).
    pub fn allocate_at(self: &Arc<Self>, offset: u64, size: u64) -> Option<AllocatedBuffer> {
        let a = self.inner.lock().allocate_at(offset, size);
        self.wrap(a, size)
    }

    /// Space and fragmentation.
    pub fn report(&self) -> AllocatorReport {
        self.inner.lock().report()
    }
}

/// A reserved range of a segment; the space returns to the segment when dropped.
#[derive(Debug)]
pub struct AllocatedBuffer {
    segment: Arc<SegmentAllocator>,
    allocation: Option<Allocation>,
    len: u64,
}

impl AllocatedBuffer {
    /// The segment holding the range.
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
