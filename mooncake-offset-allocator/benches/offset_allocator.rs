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
    // Free every other block; the rest stay reserved for the whole run.
    let mut kept = Vec::new();
    for (i, x) in live.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(x);
        } else {
            kept.push(x);
        }
    }
    let mut sizes = (0..).map(|i: u64| 1024 + (i * 104_729) % 50_000);
    c.bench_function("offset_allocator/alloc+free mixed (fragmented)", |b| {
        b.iter(|| {
            let x = a.allocate(black_box(sizes.next().unwrap())).unwrap();
            a.free(x);
        })
    });
    // Fallback path: a 1 GiB segment full of 3.12 MB blocks with one hole of exactly
    // that size; the rounded-up bin search finds nothing, the own-bin scan finds it.
    let mut a = OffsetAllocator::new(1 << 30);
    let mut full = Vec::new();
    while let Some(x) = a.allocate(3_120_000) {
        full.push(x);
    }
    a.free(full.swap_remove(100));
    c.bench_function("offset_allocator/alloc+free 3.12MB (exact hole, fallback scan)", |b| {
        b.iter(|| {
            let x = a.allocate(black_box(3_120_000)).unwrap();
            a.free(x);
        })
    });
    drop((kept, full));
}

criterion_group!(benches, alloc_free);
criterion_main!(benches);
