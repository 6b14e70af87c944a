//! Replica placement: the `AllocationStrategy` trait and the built-in strategies.

use std::cell::RefCell;
use std::sync::Arc;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::segment::{AllocatedBuffer, SegmentAllocator, SegmentId};

/// Per-thread randomness: a fast generator and a permutation of `0..n` that
/// successive shuffles keep permuting (a partial Fisher-Yates shuffle of *any*
/// permutation yields a uniformly random prefix, so it never needs resetting while
/// the number of candidates stays the same).
struct Scratch {
    rng: SmallRng,
    perm: Vec<u32>,
}

impl Scratch {
    fn new() -> Self {
        Self { rng: SmallRng::from_rng(&mut rand::rng()), perm: Vec::new() }
    }

    fn order(&mut self, n: usize) -> Order<'_> {
        if self.perm.len() != n {
            self.perm.clear();
            self.perm.extend((0..n).map(|i| i as u32));
        }
        Order { rng: &mut self.rng, perm: &mut self.perm, next: 0 }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::new());
}

/// Runs `f` with a uniformly random order of `0..n`, drawn lazily (O(1) per index
/// taken, no allocation once the thread has seen `n` candidates).
fn with_random_order<R>(n: usize, f: impl FnOnce(&mut Order<'_>) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => f(&mut scratch.order(n)),
        // Re-entered (only possible from a callback): use a private one.
        Err(_) => f(&mut Scratch::new().order(n)),
    })
}

/// Indices of `0..n`, each once, in uniformly random order.
struct Order<'a> {
    rng: &'a mut SmallRng,
    perm: &'a mut [u32],
    next: usize,
}

impl Iterator for Order<'_> {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        let n = self.perm.len();
        if self.next >= n {
            return None;
        }
        let j = self.next;
        let r = self.rng.random_range(j..n);
        self.perm.swap(j, r);
        self.next += 1;
        Some(self.perm[j] as usize)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.perm.len() - self.next;
        (left, Some(left))
    }
}

/// Why nothing could be placed (or a segment could not be made).
///
/// ```
/// use mooncake_alloc::{AllocationError, AllocationRequest, AllocationStrategy, Random, SegmentAllocator};
/// let req = AllocationRequest { size: 4096, replica_num: 1, ..Default::default() };
/// assert_eq!(Random.allocate(&req, &[], None).unwrap_err(), AllocationError::NoSegment);
/// let tiny = [SegmentAllocator::new(0, "tiny", 1024)];
/// let err = Random.allocate(&req, &tiny, None).unwrap_err();
/// assert_eq!(err, AllocationError::NoSpace { size: 4096, replica_num: 1, candidates: 1 });
/// assert_eq!(err.to_string(), "no space for 4096 bytes x1 in 1 segment(s)");
/// ```
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

    /// Every segment once, in random order, until enough replicas are placed.
    fn random_fill(&mut self, size: u64, candidates: &[Arc<SegmentAllocator>]) {
        with_random_order(candidates.len(), |order| {
            for i in order {
                if self.done() {
                    return;
                }
                self.try_on(&candidates[i], size);
            }
        })
    }

    fn finish(self, request: &AllocationRequest, candidates: usize) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        if self.bufs.is_empty() {
            Err(AllocationError::NoSpace { size: request.size, replica_num: request.replica_num, candidates })
        } else {
            Ok(self.bufs)
        }
    }
}

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

/// Segments sampled per replica by the ranking strategies (as the reference system).
const SAMPLE_FACTOR: usize = 6;
/// Samples up to this size (5 replicas) are ranked without allocating.
const STACK_SAMPLE: usize = 32;

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
        let k = request.replica_num.saturating_mul(SAMPLE_FACTOR).min(candidates.len());
        // (score, candidate index); on the stack for up to 5 replicas.
        let mut on_stack = [(0.0f64, 0u32); STACK_SAMPLE];
        let mut on_heap = Vec::new();
        let sample: &mut [(f64, u32)] = if k <= STACK_SAMPLE {
            &mut on_stack[..k]
        } else {
            on_heap.resize(k, (0.0, 0));
            &mut on_heap
        };
        // A uniform sample of k distinct segments, in random order.
        with_random_order(candidates.len(), |order| {
            for (slot, i) in sample.iter_mut().zip(order) {
                slot.1 = i as u32;
            }
        });
        // Scores outside the thread-local borrow: they may call user code.
        for slot in sample.iter_mut() {
            slot.0 = score(&candidates[slot.1 as usize]);
        }
        // Best first, by selection: usually only `replica_num` rounds are needed.
        // The first of equal scores wins; the order is random, so ties break
        // uniformly (no bias towards the first candidates).
        for start in 0..k {
            if p.done() {
                break;
            }
            let rest = &mut sample[start..];
            let best = (1..rest.len()).fold(0, |b, i| if rest[i].0 > rest[b].0 { i } else { b });
            rest.swap(0, best);
            p.try_on(&candidates[rest[0].1 as usize], request.size);
        }
    }
    p.random_fill(request.size, candidates);
    p.finish(request, candidates.len())
}

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
    fn orders_visit_every_index_once_uniformly() {
        for n in 1..40 {
            let mut firsts = vec![0usize; n];
            for _ in 0..400 {
                let mut seen: Vec<usize> = with_random_order(n, |o| o.collect());
                firsts[seen[0]] += 1;
                seen.sort_unstable();
                assert_eq!(seen, (0..n).collect::<Vec<_>>());
            }
            if n <= 8 {
                assert!(firsts.iter().all(|&f| f > 400 / n / 3), "n {n}: {firsts:?}");
            }
        }
    }

    #[test]
    fn samples_are_not_structured() {
        // Every pair of 16 shows up as the first two (a rotation or a fixed stride
        // would give only some).
        let mut pairs = std::collections::HashSet::new();
        for _ in 0..20_000 {
            let w: Vec<usize> = with_random_order(16, |o| o.take(2).collect());
            pairs.insert((w[0], w[1]));
        }
        assert_eq!(pairs.len(), 16 * 15);
        // Changing n mid-thread resets the permutation.
        let w: Vec<usize> = with_random_order(3, |o| o.collect());
        assert_eq!(w.len(), 3);
        assert!(w.iter().all(|&i| i < 3));
    }

    #[test]
    fn reentrant_use_does_not_panic() {
        let inner = with_random_order(4, |o| {
            let first = o.next().unwrap();
            let nested: Vec<usize> = with_random_order(5, |o2| o2.collect());
            (first, nested.len())
        });
        assert!(inner.0 < 4 && inner.1 == 5);
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
