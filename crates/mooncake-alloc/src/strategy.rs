//! Replica placement: the `AllocationStrategy` trait and the built-in strategies.

use std::cell::RefCell;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::segment::{AllocatedBuffer, SegmentAllocator, SegmentId};

thread_local! {
    static RNG: RefCell<SmallRng> = RefCell::new(SmallRng::from_rng(&mut rand::rng()));
}

fn random_below(n: usize) -> usize {
    RNG.with(|r| r.borrow_mut().random_range(0..n))
}

/// Why nothing could be placed.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum AllocationError {
    /// There is no segment to place on.
    #[error("no segment is mounted")]
    NoSegment,
    /// Size 0, replica count 0, or similar.
    #[error("invalid allocation request: {0}")]
    InvalidRequest(String),
    /// No candidate segment has a free block of the size.
    #[error("no space for {size} bytes x{replica_num} in {candidates} segment(s)")]
    NoSpace {
        /// Bytes per replica.
        size: u64,
        /// Replicas asked.
        replica_num: usize,
        /// Segments tried.
        candidates: usize,
    },
    /// Alignment is not a power of two.
    #[error("invalid alignment {0}")]
    InvalidAlignment(u64),
}

/// One put's placement request.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AllocationRequest {
    /// Bytes per replica.
    pub size: u64,
    /// Replicas wanted, each on a distinct segment.
    pub replica_num: usize,
    /// Segment names to try first, in order; they bypass ranking.
    pub preferred_segments: Vec<String>,
}

/// SSD usage of the clients that own segments (the master implements it).
pub trait SsdMetricsProvider: Send + Sync {
    /// Total SSD capacity (bytes) of the client that owns `segment`; <= 0 means
    /// unknown or none.
    fn ssd_total_capacity(&self, segment: SegmentId) -> i64;
    /// SSD bytes in use on that client (may drift outside `[0, total]`).
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
    /// when fewer segments have room), or an error when none could be placed.
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

/// The strategy of a name used on command lines.
pub fn strategy_from_name(name: &str) -> Option<Arc<dyn AllocationStrategy>> {
    match name {
        "random" => Some(Arc::new(Random)),
        "free_ratio_first" => Some(Arc::new(FreeRatioFirst)),
        "ssd_free_ratio_first" => Some(Arc::new(SsdFreeRatioFirst)),
        _ => None,
    }
}

fn check(request: &AllocationRequest, candidates: &[Arc<SegmentAllocator>]) -> Result<(), AllocationError> {
    if request.size == 0 {
        return Err(AllocationError::InvalidRequest("size 0".into()));
    }
    if request.replica_num == 0 {
        return Err(AllocationError::InvalidRequest("replica_num 0".into()));
    }
    if candidates.is_empty() {
        return Err(AllocationError::NoSegment);
    }
    Ok(())
}

/// Placement in progress: buffers so far, never two on one segment.
struct Placement {
    bufs: Vec<AllocatedBuffer>,
    want: usize,
}

impl Placement {
    fn new(want: usize) -> Self {
        Self { bufs: Vec::with_capacity(want), want }
    }

    fn done(&self) -> bool {
        self.bufs.len() >= self.want
    }

    fn holds(&self, id: SegmentId) -> bool {
        self.bufs.iter().any(|b| b.segment_id() == id)
    }

    fn try_on(&mut self, seg: &Arc<SegmentAllocator>, size: u64) {
        if !self.done() && !self.holds(seg.id()) {
            if let Some(b) = seg.allocate(size) {
                self.bufs.push(b);
            }
        }
    }

    /// Preferred segments first, in the caller's order.
    fn preferred(&mut self, request: &AllocationRequest, candidates: &[Arc<SegmentAllocator>]) {
        for name in &request.preferred_segments {
            if let Some(seg) = candidates.iter().find(|s| s.name() == name) {
                self.try_on(seg, request.size);
            }
        }
    }

    /// Every segment, from a random start: distinct, uniform, no allocation of a
    /// shuffled copy.
    fn random_fill(&mut self, size: u64, candidates: &[Arc<SegmentAllocator>]) {
        let n = candidates.len();
        let start = random_below(n);
        for i in 0..n {
            if self.done() {
                return;
            }
            self.try_on(&candidates[(start + i) % n], size);
        }
    }

    fn finish(self, request: &AllocationRequest, candidates: usize) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        if self.bufs.is_empty() {
            Err(AllocationError::NoSpace { size: request.size, replica_num: request.replica_num, candidates })
        } else {
            Ok(self.bufs)
        }
    }
}

/// Distinct segments in random order.
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

/// Samples `min(6 * replica_num, n)` distinct candidates, ranks them by `score`
/// (higher first), allocates from the top, then falls back to random.
fn ranked(
    request: &AllocationRequest,
    candidates: &[Arc<SegmentAllocator>],
    score: impl Fn(&SegmentAllocator) -> f64,
) -> Result<Vec<AllocatedBuffer>, AllocationError> {
    check(request, candidates)?;
    let mut p = Placement::new(request.replica_num);
    p.preferred(request, candidates);
    if !p.done() {
        let n = candidates.len();
        let k = request.replica_num.saturating_mul(6).min(n);
        // A random window of k consecutive segments from a random start: distinct,
        // and every segment equally likely to be sampled.
        let start = random_below(n);
        let mut sample: Vec<(f64, &Arc<SegmentAllocator>)> =
            (0..k).map(|i| &candidates[(start + i) % n]).map(|s| (score(s), s)).collect();
        sample.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, seg) in sample {
            p.try_on(seg, request.size);
        }
    }
    p.random_fill(request.size, candidates);
    p.finish(request, candidates.len())
}

/// Prefers segments with the highest DRAM free ratio among a sample.
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

/// SSD free ratio of a segment's owner: `(total - clamp(used, 0, total)) / total`;
/// fully free when unknown.
pub(crate) fn ssd_free_ratio(ssd: Option<&dyn SsdMetricsProvider>, segment: SegmentId) -> f64 {
    let Some(ssd) = ssd else { return 1.0 };
    let total = ssd.ssd_total_capacity(segment);
    if total <= 0 {
        return 1.0;
    }
    let used = ssd.ssd_used_bytes(segment).clamp(0, total);
    (total - used) as f64 / total as f64
}

/// Prefers segments whose owner's SSD has the highest free ratio among a sample.
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
