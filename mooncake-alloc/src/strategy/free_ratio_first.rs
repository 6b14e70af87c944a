//! [`FreeRatioFirst`]: sampled segments ranked by DRAM free ratio.

use std::sync::Arc;

use super::placement::ranked;
use super::{AllocationRequest, AllocationStrategy, SsdMetricsProvider};
use crate::error::AllocationError;
use crate::segment::{AllocatedBuffer, SegmentAllocator};

/// Preferred segments first; then samples `min(6 * replica_num, n)` distinct
/// segments at random, ranks them by DRAM [free ratio](SegmentAllocator::free_ratio)
/// (highest first) and allocates from the top; replicas still missing go to random
/// segments. Sampling keeps the cost bounded on large clusters.
///
/// ```
/// use mooncake_alloc::{AllocationRequest, AllocationStrategy, FreeRatioFirst, SegmentAllocator};
/// let segs: Vec<_> = (0..3).map(|i| SegmentAllocator::new(i, format!("n{i}"), 1 << 20)).collect();
/// let _a = segs[0].allocate(512 << 10);
/// let _b = segs[1].allocate(256 << 10);
/// let req = AllocationRequest { size: 1000, replica_num: 2, ..Default::default() };
/// let bufs = FreeRatioFirst.allocate(&req, &segs, None)?; // 3 <= 6 segments: all ranked
/// assert_eq!((bufs[0].segment_id(), bufs[1].segment_id()), (2, 1));
/// # Ok::<(), mooncake_alloc::AllocationError>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct FreeRatioFirst;

impl AllocationStrategy for FreeRatioFirst {
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        _ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        ranked(request, candidates, SegmentAllocator::free_ratio)
    }

    fn name(&self) -> &str {
        "free_ratio_first"
    }
}
