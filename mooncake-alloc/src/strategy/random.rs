//! [`Random`]: preferred segments, then distinct segments in random order.

use std::sync::Arc;

use super::placement::{check, Placement};
use super::{AllocationRequest, AllocationStrategy, SsdMetricsProvider};
use crate::error::AllocationError;
use crate::segment::{AllocatedBuffer, SegmentAllocator};

/// Preferred segments first, then every segment once in random order until the
/// replicas are placed. The default strategy: cheapest, and spreads load evenly.
///
/// ```
/// use mooncake_alloc::{AllocationRequest, AllocationStrategy, Random, SegmentAllocator};
/// let segs: Vec<_> = (0..8).map(|i| SegmentAllocator::new(i, format!("n{i}"), 1 << 20)).collect();
/// let req = AllocationRequest { size: 1000, replica_num: 3, ..Default::default() };
/// let bufs = Random.allocate(&req, &segs, None)?;
/// assert_eq!(bufs.len(), 3);
/// # Ok::<(), mooncake_alloc::AllocationError>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct Random;

impl AllocationStrategy for Random {
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        _ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        check(request, candidates)?;
        let mut p = Placement::new(request.replica_num);
        p.preferred(request, candidates);
        p.random_fill(request.size, candidates);
        p.finish(request, candidates.len())
    }

    fn name(&self) -> &str {
        "random"
    }
}
