//! Replica placement: the [`AllocationStrategy`] trait, the request it serves, the
//! SSD metrics it may read, and the built-in strategies (one file each).

mod free_ratio_first;
mod placement;
mod random;
mod random_order;
mod ssd_free_ratio_first;

use std::sync::Arc;

pub use free_ratio_first::FreeRatioFirst;
pub use random::Random;
pub use ssd_free_ratio_first::SsdFreeRatioFirst;

use crate::error::AllocationError;
use crate::segment::{AllocatedBuffer, SegmentAllocator, SegmentId};

/// One put's placement request.
///
/// ```
/// use mooncake_alloc::AllocationRequest;
/// let req = AllocationRequest {
///     size: 2 << 20,
///     replica_num: 2,
///     preferred_segments: vec!["10.0.0.7:17000".into()], // local segment first
/// };
/// assert_eq!(AllocationRequest::default().replica_num, 0); // fill in before use
/// # let _ = req;
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocationRequest {
    /// Bytes per replica.
    pub size: u64,
    /// Replicas wanted, each on a distinct segment.
    pub replica_num: usize,
    /// Segment names to try first, in order; they bypass ranking.
    pub preferred_segments: Vec<String>,
}

/// SSD usage of the clients that own segments (the master implements it), read by
/// [`SsdFreeRatioFirst`]. Values are a placement signal only: they may drift
/// (`used < 0`, `used > total`) and are clamped by the reader.
///
/// ```
/// use std::collections::HashMap;
/// use mooncake_alloc::{SegmentId, SsdMetricsProvider};
///
/// /// (total, used) per segment; segments it does not know have no SSD.
/// struct Table(HashMap<SegmentId, (i64, i64)>);
/// impl SsdMetricsProvider for Table {
///     fn ssd_total_capacity(&self, s: SegmentId) -> i64 {
///         self.0.get(&s).map_or(0, |v| v.0)
///     }
///     fn ssd_used_bytes(&self, s: SegmentId) -> i64 {
///         self.0.get(&s).map_or(0, |v| v.1)
///     }
/// }
/// let t = Table(HashMap::from([(1, (1 << 40, 200 << 30))]));
/// assert_eq!(t.ssd_total_capacity(2), 0);
/// ```
pub trait SsdMetricsProvider: Send + Sync {
    /// Total SSD capacity (bytes) of the client that owns `segment`; <= 0 means
    /// unknown or none.
    fn ssd_total_capacity(&self, segment: SegmentId) -> i64;
    /// SSD bytes in use on that client (may drift outside `[0, total]`; readers
    /// clamp).
    fn ssd_used_bytes(&self, segment: SegmentId) -> i64;
}

/// Picks segments for a put's replicas and reserves their space.
///
/// # Writing your own
/// ```
/// use std::sync::Arc;
/// use mooncake_alloc::*;
///
/// /// Always the segment with the lowest id that has room.
/// struct Lowest;
/// impl AllocationStrategy for Lowest {
///     fn allocate(&self, r: &AllocationRequest, c: &[Arc<SegmentAllocator>], _: Option<&dyn SsdMetricsProvider>)
///         -> Result<Vec<AllocatedBuffer>, AllocationError> {
///         let mut sorted: Vec<_> = c.iter().collect();
///         sorted.sort_by_key(|s| s.id());
///         let bufs: Vec<_> = sorted.iter().filter_map(|s| s.allocate(r.size)).take(r.replica_num).collect();
///         if bufs.is_empty() {
///             return Err(AllocationError::NoSpace { size: r.size, replica_num: r.replica_num, candidates: c.len() });
///         }
///         Ok(bufs)
///     }
///     fn name(&self) -> &str { "lowest" }
/// }
/// let segs = vec![SegmentAllocator::new(2, "b", 4096), SegmentAllocator::new(1, "a", 4096)];
/// let req = AllocationRequest { size: 100, replica_num: 1, ..Default::default() };
/// assert_eq!(Lowest.allocate(&req, &segs, None).unwrap()[0].segment_id(), 1);
/// ```
pub trait AllocationStrategy: Send + Sync {
    /// Returns between 1 and `replica_num` buffers, each on a distinct segment (fewer
    /// when fewer segments have room), or an error when none could be placed:
    /// [`InvalidRequest`](AllocationError::InvalidRequest) for size 0 or
    /// `replica_num` 0, [`NoSegment`](AllocationError::NoSegment) for no candidates,
    /// [`NoSpace`](AllocationError::NoSpace) when no candidate has a free block of
    /// the size. Segments named in `preferred_segments` come first, in order.
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError>;

    /// Whether the master should pass an [`SsdMetricsProvider`] (default false).
    fn uses_ssd_metrics(&self) -> bool {
        false
    }

    /// Short name (`random`, `free_ratio_first`, `ssd_free_ratio_first`, …).
    fn name(&self) -> &str;
}

/// The built-in strategy of a name used on command lines and in configs:
/// `random`, `free_ratio_first` or `ssd_free_ratio_first`.
///
/// ```
/// let s = mooncake_alloc::strategy_from_name("ssd_free_ratio_first").unwrap();
/// assert!(s.uses_ssd_metrics());
/// assert!(mooncake_alloc::strategy_from_name("best_fit").is_none());
/// ```
pub fn strategy_from_name(name: &str) -> Option<Arc<dyn AllocationStrategy>> {
    match name {
        "random" => Some(Arc::new(Random)),
        "free_ratio_first" => Some(Arc::new(FreeRatioFirst)),
        "ssd_free_ratio_first" => Some(Arc::new(SsdFreeRatioFirst)),
        _ => None,
    }
}
