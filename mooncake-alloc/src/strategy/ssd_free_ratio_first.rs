//! [`SsdFreeRatioFirst`]: sampled segments ranked by the free ratio of their
//! owner's SSD.

use std::sync::Arc;

use super::placement::ranked;
use super::{AllocationRequest, AllocationStrategy, SsdMetricsProvider};
use crate::error::AllocationError;
use crate::segment::{AllocatedBuffer, SegmentAllocator, SegmentId};

/// SSD free ratio of a segment's owner: `(total - clamp(used, 0, total)) / total`;
/// fully free when unknown.
fn ssd_free_ratio(ssd: Option<&dyn SsdMetricsProvider>, segment: SegmentId) -> f64 {
    let Some(ssd) = ssd else { return 1.0 };
    let total = ssd.ssd_total_capacity(segment);
    if total <= 0 {
        return 1.0;
    }
    let used = ssd.ssd_used_bytes(segment).clamp(0, total);
    (total - used) as f64 / total as f64
}

/// Preferred segments first; then samples `min(6 * replica_num, n)` distinct
/// segments at random, ranks them by the SSD free ratio of their owner,
/// `(total - clamp(used, 0, total)) / total` (fully free when there is no provider
/// or `total <= 0`), and allocates from the top; replicas still missing go to random
/// segments. The master passes an [`SsdMetricsProvider`] because
/// [`uses_ssd_metrics`](AllocationStrategy::uses_ssd_metrics) says so.
///
/// ```
/// use mooncake_alloc::*;
/// struct Ssd;
/// impl SsdMetricsProvider for Ssd {
///     fn ssd_total_capacity(&self, _: SegmentId) -> i64 { 1000 }
///     fn ssd_used_bytes(&self, s: SegmentId) -> i64 { [900, 100, 500][s as usize] }
/// }
/// let segs: Vec<_> = (0..3).map(|i| SegmentAllocator::new(i, format!("n{i}"), 1 << 20)).collect();
/// let req = AllocationRequest { size: 1000, replica_num: 1, ..Default::default() };
/// let bufs = SsdFreeRatioFirst.allocate(&req, &segs, Some(&Ssd))?;
/// assert_eq!(bufs[0].segment_id(), 1); // 90 % of its SSD free
/// # Ok::<(), mooncake_alloc::AllocationError>(())
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct SsdFreeRatioFirst;

impl AllocationStrategy for SsdFreeRatioFirst {
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        ranked(request, candidates, |s| ssd_free_ratio(ssd, s.id()))
    }

    fn uses_ssd_metrics(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        "ssd_free_ratio_first"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Vec<(i64, i64)>);
    impl SsdMetricsProvider for Fixed {
        fn ssd_total_capacity(&self, s: SegmentId) -> i64 {
            self.0[s as usize].0
        }
        fn ssd_used_bytes(&self, s: SegmentId) -> i64 {
            self.0[s as usize].1
        }
    }

    #[test]
    fn ssd_free_ratio_clamps_and_defaults() {
        let m = Fixed(vec![(100, -5), (100, 150), (0, 10), (-1, 0), (1000, 200)]);
        assert_eq!(ssd_free_ratio(Some(&m), 0), 1.0);
        assert_eq!(ssd_free_ratio(Some(&m), 1), 0.0);
        assert_eq!(ssd_free_ratio(Some(&m), 2), 1.0);
        assert_eq!(ssd_free_ratio(Some(&m), 3), 1.0);
        assert!((ssd_free_ratio(Some(&m), 4) - 0.8).abs() < 1e-12);
        assert_eq!(ssd_free_ratio(None, 4), 1.0);
    }
}
