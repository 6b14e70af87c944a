//! Offset allocator: alloc+free pairs (target < 100 ns).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use mooncake_offset_allocator::OffsetAllocator;

fn alloc_free(c: &mut Criterion) {
    let mut a = OffsetAllocator::new(1 << 30);
    c.bench_function("offset_allocator/alloc+free 64KiB (empty)", |b| {
        b.iter(|| {
            let x = a.allocate(black_box(64 << 10)).unwrap();
            a.free(x);
        })
    });
    // Fragmented: 10k live blocks of mixed sizes with holes.
    let mut a = OffsetAllocator::new(1 << 30);
    let mut live = Vec::new();
    for i in 0..10_000u64 {
        live.push(a.allocate(4096 + (i * 7919) % 60_000).unwrap());
    }
    for x in live.drain(..).step_by(2) {
        a.free(x);
    }
    let mut sizes = (0..).map(|i: u64| 1024 + (i * 104_729) % 50_000);
    c.bench_function("offset_allocator/alloc+free mixed (fragmented)", |b| {
        b.iter(|| {
            let x = a.allocate(black_box(sizes.next().unwrap())).unwrap();
            a.free(x);
        })
    });
}

criterion_group!(benches, alloc_free);
criterion_main!(benches);
