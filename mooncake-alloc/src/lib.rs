//! Where replicas go: per-segment space allocation and replica placement strategies
//! for Mooncake Store.
//!
//! Each mounted segment has a [`SegmentAllocator`] (thread-safe, O(1) offset
//! allocator inside). An [`AllocationStrategy`] picks, for one put, which segments
//! receive its replicas and reserves the space; the result is one
//! [`AllocatedBuffer`] per replica, each on a distinct segment, freed when dropped.
//!
//! Built-in strategies, as in the reference system:
//! - [`Random`]: distinct segments in random order.
//! - [`FreeRatioFirst`]: sample `min(6 * replica_num, n)` segments, prefer the
//!   emptiest (DRAM free ratio).
//! - [`SsdFreeRatioFirst`]: same sampling, prefer segments whose owner's SSD has the
//!   most room (from an [`SsdMetricsProvider`]).
//!
//! ```
//! use mooncake_alloc::{AllocationRequest, AllocationStrategy, FreeRatioFirst, SegmentAllocator};
//!
//! let segments: Vec<_> = (0..4).map(|i| SegmentAllocator::new(i, format!("node{i}"), 1 << 20)).collect();
//! let request = AllocationRequest { size: 4096, replica_num: 2, ..Default::default() };
//! let bufs = FreeRatioFirst.allocate(&request, &segments, None)?;
//! assert_eq!(bufs.len(), 2);
//! assert_ne!(bufs[0].segment_id(), bufs[1].segment_id());
//! drop(bufs); // the space goes back to the segments
//! assert!(segments.iter().all(|s| s.used_bytes() == 0));
//! # Ok::<(), mooncake_alloc::AllocationError>(())
//! ```
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod error;
mod segment;
mod strategy;

pub use error::AllocationError;
pub use mooncake_offset_allocator::{
    Allocation, AllocatorReport, OffsetAllocator, OffsetAllocatorError, DEFAULT_ALIGNMENT,
};
pub use segment::{AllocatedBuffer, CompactBuffer, SegmentAllocator, SegmentId};
pub use strategy::{
    strategy_from_name, AllocationRequest, AllocationStrategy, FreeRatioFirst, Random, SsdFreeRatioFirst,
    SsdMetricsProvider,
};
