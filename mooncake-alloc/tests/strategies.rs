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

/// Fraction of `rounds` single-replica placements that land on segments of `good`.
fn share_on(
    strategy: &dyn AllocationStrategy,
    segs: &[Arc<SegmentAllocator>],
    ssd: Option<&dyn SsdMetricsProvider>,
    good: impl Fn(SegmentId) -> bool,
) -> f64 {
    let rounds = 2000;
    let hits = (0..rounds)
        .filter(|_| {
            let b = strategy.allocate(&req(64, 1), segs, ssd).unwrap();
            good(b[0].segment_id())
        })
        .count();
    hits as f64 / rounds as f64
}

#[test]
fn ranking_prefers_the_freest_in_expectation() {
    // 60 segments, the even ones 90 % full: a sample of 6 misses every odd one with
    // probability ~1/64, so ranked strategies land on odd ones ~98 % of the time,
    // random ~50 %.
    let segs = segments(60, 1 << 20);
    let _fill: Vec<_> = segs.iter().step_by(2).map(|s| s.allocate(900 << 10).unwrap()).collect();
    let odd = |id: SegmentId| id % 2 == 1;
    let ranked = share_on(&FreeRatioFirst, &segs, None, odd);
    let random = share_on(&Random, &segs, None, odd);
    println!("free_ratio_first: {:.1} % on the emptier half; random: {:.1} %", ranked * 100.0, random * 100.0);
    assert!(ranked > 0.93, "{ranked}");
    assert!((0.4..0.6).contains(&random), "{random}");

    // Same for SSD: the even ones' owners have full SSDs (one over-reported).
    let ssd = Ssd((0..60).map(|i| if i % 2 == 0 { (100, if i == 0 { 500 } else { 95 }) } else { (100, 10) }).collect());
    let segs = segments(60, 1 << 20);
    let ranked = share_on(&SsdFreeRatioFirst, &segs, Some(&ssd), odd);
    println!("ssd_free_ratio_first: {:.1} % on the emptier SSDs", ranked * 100.0);
    assert!(ranked > 0.93, "{ranked}");
    // Ties (no provider: every SSD fully free) break uniformly, not towards the
    // first candidates.
    let first_half = share_on(&SsdFreeRatioFirst, &segs, None, |id| id < 30);
    assert!((0.4..0.6).contains(&first_half), "{first_half}");
    let first_half = share_on(&FreeRatioFirst, &segs, None, |id| id < 30);
    assert!((0.4..0.6).contains(&first_half), "{first_half}");
}

#[test]
fn replicas_outside_the_sample_are_found_by_the_random_fallback() {
    // 60 segments, only one has room: the ranked sample (6 per replica) usually
    // misses it, the random fallback must find it, every time.
    let segs = segments(60, 1 << 20);
    let _fill: Vec<_> = segs.iter().filter(|s| s.id() != 41).map(|s| s.allocate(1 << 20).unwrap()).collect();
    let ssd = Ssd(vec![(100, 0); 60]);
    for s in all() {
        for _ in 0..50 {
            let b = s.allocate(&req(4096, 2), &segs, Some(&ssd)).unwrap();
            assert_eq!(b.len(), 1, "{}", s.name());
            assert_eq!(b[0].segment_id(), 41, "{}", s.name());
        }
    }
}

#[test]
fn ssd_strategy_with_degenerate_metrics_still_places() {
    let segs = segments(5, 1 << 20);
    // used < 0, used > total, total = 0, total < 0, i64 extremes.
    let ssd = Ssd(vec![(100, -5), (100, 1000), (0, 50), (-7, 3), (i64::MAX, i64::MIN)]);
    for _ in 0..50 {
        let b = SsdFreeRatioFirst.allocate(&req(100, 5), &segs, Some(&ssd)).unwrap();
        assert_eq!(b.len(), 5);
        assert_ne!(b[0].segment_id(), 1, "the over-used SSD (ratio 0) ranks last");
        assert_eq!(b[4].segment_id(), 1, "the over-used SSD (ratio 0) ranks last");
    }
}

/// A user-defined strategy: the segment with the most free bytes, deterministically.
struct MostFreeBytes;

impl AllocationStrategy for MostFreeBytes {
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        _ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        if candidates.is_empty() {
            return Err(AllocationError::NoSegment);
        }
        let mut sorted: Vec<_> = candidates.iter().collect();
        sorted.sort_by_key(|s| std::cmp::Reverse(s.free_bytes()));
        let bufs: Vec<_> = sorted.iter().filter_map(|s| s.allocate(request.size)).take(request.replica_num).collect();
        if bufs.is_empty() {
            return Err(AllocationError::NoSpace {
                size: request.size,
                replica_num: request.replica_num,
                candidates: candidates.len(),
            });
        }
        Ok(bufs)
    }

    fn name(&self) -> &str {
        "most_free_bytes"
    }
}

#[test]
fn user_defined_strategy_works_through_dyn() {
    let strategy: Arc<dyn AllocationStrategy> = Arc::new(MostFreeBytes);
    assert!(!strategy.uses_ssd_metrics(), "default method");
    assert_eq!(strategy.name(), "most_free_bytes");
    let segs: Vec<_> = [4u64, 1, 3, 2].iter().map(|&c| SegmentAllocator::new(c, format!("s{c}"), c << 20)).collect();
    let bufs = strategy.allocate(&req(1 << 20, 2), &segs, None).unwrap();
    assert_eq!((bufs[0].segment_id(), bufs[1].segment_id()), (4, 3));
    // Shared across threads like the master does.
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let (strategy, segs) = (strategy.clone(), segs.clone());
            std::thread::spawn(move || strategy.allocate(&req(4096, 1), &segs, None).map(|b| b.len()))
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), Ok(1));
    }
    drop(bufs);
    assert!(segs.iter().all(|s| s.used_bytes() == 0));
}

#[test]
fn concurrent_placements_and_drops_keep_counters_exact() {
    let segs = segments(8, 8 << 20);
    let strategies: Vec<Arc<dyn AllocationStrategy>> =
        vec![Arc::new(Random), Arc::new(FreeRatioFirst), Arc::new(SsdFreeRatioFirst)];
    std::thread::scope(|scope| {
        for t in 0..4 {
            let (segs, strategy) = (&segs, strategies[t % 3].clone());
            scope.spawn(move || {
                let mut live = std::collections::VecDeque::new();
                for i in 0..3000u64 {
                    if let Ok(b) = strategy.allocate(&req(1000 + (i * 7919) % 100_000, 2), segs, None) {
                        live.push_back(b);
                    }
                    if live.len() > 20 {
                        live.pop_front();
                    }
                }
            });
        }
    });
    for s in &segs {
        assert_eq!(s.used_bytes(), 0);
        let r = s.report();
        assert_eq!((r.used_bytes, r.free_regions, r.largest_free_region), (0, 1, s.capacity()));
    }
}

#[test]
fn public_types_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<SegmentAllocator>();
    check::<AllocatedBuffer>();
    check::<Arc<dyn AllocationStrategy>>();
    check::<AllocationError>();
}

proptest! {
    #[test]
    fn buffers_are_distinct_in_bounds_and_freed_on_drop(
        caps in proptest::collection::vec(1u64..64, 1..10),
        puts in proptest::collection::vec((1u64..200_000, 1usize..4, 0usize..3, proptest::collection::vec(0usize..12, 0..3)), 1..60),
    ) {
        let segs: Vec<_> = caps.iter().enumerate().map(|(i, c)| SegmentAllocator::new(i as u64, format!("s{i}"), c << 16)).collect();
        let strategies = all();
        let mut live: Vec<AllocatedBuffer> = Vec::new();
        for (size, replicas, which, preferred) in puts {
            let r = AllocationRequest { size, replica_num: replicas, preferred_segments: preferred.iter().map(|p| format!("s{p}")).collect() };
            let fits_on = |id: usize| segs[id].report().largest_free_region >= size.div_ceil(64) * 64;
            let fits = (0..segs.len()).filter(|&id| fits_on(id)).count();
            // Preferred segments that exist and fit, in order, without repeats.
            let mut expected_prefix: Vec<u64> = Vec::new();
            for &p in &preferred {
                if p < segs.len() && fits_on(p) && !expected_prefix.contains(&(p as u64)) && expected_prefix.len() < replicas {
                    expected_prefix.push(p as u64);
                }
            }
            let result = strategies[which].allocate(&r, &segs, None);
            prop_assert_eq!(result.as_ref().map_or(0, Vec::len), fits.min(replicas), "best effort: every segment that fits is used");
            if let Ok(bufs) = result {
                prop_assert!(!bufs.is_empty() && bufs.len() <= replicas);
                let ids: Vec<u64> = bufs.iter().map(|b| b.segment_id()).collect();
                prop_assert_eq!(&ids[..expected_prefix.len()], &expected_prefix[..], "preferred first, in order");
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
