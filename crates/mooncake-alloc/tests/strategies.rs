//! The placement strategies through the public API.

use std::sync::Arc;

use mooncake_alloc::*;
use proptest::prelude::*;

fn segments(n: u64, cap: u64) -> Vec<Arc<SegmentAllocator>> {
    (0..n).map(|i| SegmentAllocator::new(i, format!("seg{i}"), cap)).collect()
}

fn all() -> Vec<Box<dyn AllocationStrategy>> {
    vec![Box::new(Random), Box::new(FreeRatioFirst), Box::new(SsdFreeRatioFirst)]
}

fn req(size: u64, replica_num: usize) -> AllocationRequest {
    AllocationRequest { size, replica_num, preferred_segments: vec![] }
}

#[test]
fn bad_requests_and_no_segments_are_errors() {
    let segs = segments(2, 1 << 20);
    for s in all() {
        assert!(matches!(s.allocate(&req(0, 1), &segs, None), Err(AllocationError::InvalidRequest(_))));
        assert!(matches!(s.allocate(&req(10, 0), &segs, None), Err(AllocationError::InvalidRequest(_))));
        assert_eq!(s.allocate(&req(10, 1), &[], None).unwrap_err(), AllocationError::NoSegment);
        assert!(matches!(s.allocate(&req(2 << 20, 1), &segs, None), Err(AllocationError::NoSpace { .. })));
    }
}

#[test]
fn replicas_land_on_distinct_segments_best_effort() {
    let segs = segments(3, 1 << 20);
    for s in all() {
        let bufs = s.allocate(&req(1000, 5), &segs, None).unwrap();
        assert_eq!(bufs.len(), 3, "{}: as many as there are segments", s.name());
        let mut ids: Vec<_> = bufs.iter().map(|b| b.segment_id()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 3);
    }
}

#[test]
fn preferred_segments_come_first_in_order() {
    let segs = segments(8, 1 << 20);
    for s in all() {
        let r = AllocationRequest { size: 100, replica_num: 2, preferred_segments: vec!["seg5".into(), "seg2".into()] };
        for _ in 0..20 {
            let bufs = s.allocate(&r, &segs, None).unwrap();
            assert_eq!((bufs[0].segment_id(), bufs[1].segment_id()), (5, 2), "{}", s.name());
        }
        // A full preferred segment is skipped, the rest placed by the strategy.
        let full = segs[5].allocate((1 << 20) - 64).unwrap();
        let bufs = s.allocate(&r, &segs, None).unwrap();
        assert_eq!(bufs[0].segment_id(), 2);
        assert_ne!(bufs[1].segment_id(), 5);
        drop(full);
    }
}

#[test]
fn free_ratio_first_prefers_empty_segments() {
    let segs = segments(4, 1 << 20);
    let _fill: Vec<_> = (0..3).map(|i| segs[i].allocate(900 << 10).unwrap()).collect();
    for _ in 0..50 {
        let b = FreeRatioFirst.allocate(&req(1000, 1), &segs, None).unwrap();
        assert_eq!(b[0].segment_id(), 3, "the only empty segment is always in the sample of min(6, 4)");
    }
}

struct Ssd(Vec<(i64, i64)>);
impl SsdMetricsProvider for Ssd {
    fn ssd_total_capacity(&self, s: SegmentId) -> i64 {
        self.0[s as usize].0
    }
    fn ssd_used_bytes(&self, s: SegmentId) -> i64 {
        self.0[s as usize].1
    }
}

#[test]
fn ssd_free_ratio_first_ranks_by_the_owners_ssd() {
    let segs = segments(4, 1 << 20);
    // Ratios: 0.1, 0 (over-used, clamped), 0.5, fully free because total unknown.
    let ssd = Ssd(vec![(100, 90), (100, 150), (100, 50), (0, 0)]);
    assert!(SsdFreeRatioFirst.uses_ssd_metrics());
    assert!(!FreeRatioFirst.uses_ssd_metrics() && !Random.uses_ssd_metrics());
    for _ in 0..20 {
        let b = SsdFreeRatioFirst.allocate(&req(10, 2), &segs, Some(&ssd)).unwrap();
        assert_eq!((b[0].segment_id(), b[1].segment_id()), (3, 2));
    }
    // Negative usage clamps to 0: fully free, ranks with the unknown one.
    let ssd = Ssd(vec![(100, -50), (100, 99), (100, 99), (100, 99)]);
    let b = SsdFreeRatioFirst.allocate(&req(10, 1), &segs, Some(&ssd)).unwrap();
    assert_eq!(b[0].segment_id(), 0);
    // Without a provider every segment is fully free: placement still succeeds.
    assert_eq!(SsdFreeRatioFirst.allocate(&req(10, 4), &segs, None).unwrap().len(), 4);
}

#[test]
fn ssd_ranked_segments_without_room_fall_back_to_random() {
    let segs = segments(3, 1 << 20);
    let _full = segs[0].allocate((1 << 20) - 64).unwrap();
    let ssd = Ssd(vec![(100, 0), (100, 99), (100, 99)]);
    let b = SsdFreeRatioFirst.allocate(&req(4096, 1), &segs, Some(&ssd)).unwrap();
    assert_ne!(b[0].segment_id(), 0);
}

#[test]
fn random_spreads_over_all_segments() {
    let segs = segments(8, 64 << 20);
    let mut hits = [0usize; 8];
    let mut keep = Vec::new();
    for _ in 0..800 {
        let b = Random.allocate(&req(4096, 1), &segs, None).unwrap();
        hits[b[0].segment_id() as usize] += 1;
        keep.extend(b);
    }
    assert!(hits.iter().all(|&h| h > 40), "{hits:?}");
}

#[test]
fn names_map_to_strategies() {
    for n in ["random", "free_ratio_first", "ssd_free_ratio_first"] {
        assert_eq!(strategy_from_name(n).unwrap().name(), n);
    }
    assert!(strategy_from_name("nope").is_none());
}

proptest! {
    #[test]
    fn buffers_are_distinct_in_bounds_and_freed_on_drop(
        caps in proptest::collection::vec(1u64..64, 1..10),
        puts in proptest::collection::vec((1u64..200_000, 1usize..4, 0usize..3), 1..60),
    ) {
        let segs: Vec<_> = caps.iter().enumerate().map(|(i, c)| SegmentAllocator::new(i as u64, format!("s{i}"), c << 16)).collect();
        let strategies = all();
        let mut live: Vec<AllocatedBuffer> = Vec::new();
        for (size, replicas, which) in puts {
            if let Ok(bufs) = strategies[which].allocate(&req(size, replicas), &segs, None) {
                prop_assert!(!bufs.is_empty() && bufs.len() <= replicas);
                let mut ids: Vec<_> = bufs.iter().map(|b| b.segment_id()).collect();
                ids.sort();
                ids.dedup();
                prop_assert_eq!(ids.len(), bufs.len(), "two replicas on one segment");
                for b in &bufs {
                    prop_assert_eq!(b.len(), size);
                    prop_assert!(b.offset() + size <= b.segment().capacity());
                    for other in live.iter().filter(|o| o.segment_id() == b.segment_id()) {
                        prop_assert!(b.offset() + size <= other.offset() || other.offset() + other.len() <= b.offset(), "overlap");
                    }
                }
                live.extend(bufs);
            }
        }
        drop(live);
        prop_assert!(segs.iter().all(|s| s.used_bytes() == 0 && s.free_bytes() == s.capacity()));
    }
}
