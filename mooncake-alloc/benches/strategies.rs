//! Placement strategies: one allocation (and its drop) per iteration
//! (target >= 2 M placements/s for 1 replica over 16 segments).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_alloc::{
    AllocationRequest, AllocationStrategy, FreeRatioFirst, Random, SegmentAllocator, SegmentId, SsdFreeRatioFirst,
    SsdMetricsProvider,
};

struct Ssd;
impl SsdMetricsProvider for Ssd {
    fn ssd_total_capacity(&self, _: SegmentId) -> i64 {
        1 << 40
    }
    fn ssd_used_bytes(&self, s: SegmentId) -> i64 {
        (s as i64 * 7919) % (1 << 40)
    }
}

fn strategies(c: &mut Criterion) {
    let mut group = c.benchmark_group("placement");
    group.throughput(Throughput::Elements(1));
    for (segments, replicas) in [(16u64, 1usize), (64, 3)] {
        let segs: Vec<Arc<SegmentAllocator>> =
            (0..segments).map(|i| SegmentAllocator::new(i, format!("seg{i}"), 64 << 30)).collect();
        let req = AllocationRequest { size: 1 << 20, replica_num: replicas, ..Default::default() };
        let all: [(&str, Box<dyn AllocationStrategy>); 3] = [
            ("random", Box::new(Random)),
            ("free_ratio_first", Box::new(FreeRatioFirst)),
            ("ssd_free_ratio_first", Box::new(SsdFreeRatioFirst)),
        ];
        for (name, s) in all {
            group.bench_function(format!("{name}/{replicas}x over {segments}"), |b| {
                b.iter(|| s.allocate(&req, &segs, Some(&Ssd)).unwrap())
            });
        }
    }
    group.finish();
}

criterion_group!(benches, strategies);
criterion_main!(benches);
