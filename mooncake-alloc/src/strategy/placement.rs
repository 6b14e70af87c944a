//! What the built-in strategies share: request checks, a placement in progress
//! (preferred segments first, then a random fill) and sampled ranking.

use std::sync::Arc;

use super::random_order::with_random_order;
use super::AllocationRequest;
use crate::error::AllocationError;
use crate::segment::{AllocatedBuffer, SegmentAllocator, SegmentId};

pub(super) fn check(request: &AllocationRequest, candidates: &[Arc<SegmentAllocator>]) -> Result<(), AllocationError> {
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
pub(super) struct Placement {
    bufs: Vec<AllocatedBuffer>,
    want: usize,
}

impl Placement {
    pub(super) fn new(want: usize) -> Self {
        // `want` comes from a request: room for a few, grown as placed (never
        // more than there are segments).
        Self { bufs: Vec::with_capacity(want.min(8)), want }
    }

    pub(super) fn done(&self) -> bool {
        self.bufs.len() >= self.want
    }

    fn holds(&self, id: SegmentId) -> bool {
        self.bufs.iter().any(|b| b.segment_id() == id)
    }

    pub(super) fn try_on(&mut self, seg: &Arc<SegmentAllocator>, size: u64) {
        if !self.done() && !self.holds(seg.id()) {
            if let Some(b) = seg.allocate(size) {
                self.bufs.push(b);
            }
        }
    }

    /// Preferred segments first, in the caller's order.
    pub(super) fn preferred(&mut self, request: &AllocationRequest, candidates: &[Arc<SegmentAllocator>]) {
        for name in &request.preferred_segments {
            if let Some(seg) = candidates.iter().find(|s| s.name() == name) {
                self.try_on(seg, request.size);
            }
        }
    }

    /// Every segment once, in random order, until enough replicas are placed.
    pub(super) fn random_fill(&mut self, size: u64, candidates: &[Arc<SegmentAllocator>]) {
        with_random_order(candidates.len(), |order| {
            for i in order {
                if self.done() {
                    return;
                }
                self.try_on(&candidates[i], size);
            }
        })
    }

    pub(super) fn finish(
        self,
        request: &AllocationRequest,
        candidates: usize,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        if self.bufs.is_empty() {
            Err(AllocationError::NoSpace { size: request.size, replica_num: request.replica_num, candidates })
        } else {
            Ok(self.bufs)
        }
    }
}

/// Segments sampled per replica by the ranking strategies (as the reference system).
const SAMPLE_FACTOR: usize = 6;
/// Samples up to this size (5 replicas) are ranked without allocating.
const STACK_SAMPLE: usize = 32;

/// Samples `min(6 * replica_num, n)` distinct candidates, ranks them by `score`
/// (higher first), allocates from the top, then falls back to random.
pub(super) fn ranked(
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
