//! The checksum's pieces: crc32c of 256 KiB, combining two sums (ours against the
//! `crc32c` crate's, which objects of several parts used to pay once per part), and
//! the memory copies of the `local` and `shm` transports with the sum taken on the
//! way (`RegisteredRegion::copy_in_summed` / `copy_out_summed`) against the same
//! copies without it.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_transfer::checksum::{crc32c, crc32c_combine};
use mooncake_transfer::TransferEngine;

fn checksum(c: &mut Criterion) {
    let data: Vec<u8> = (0..256 << 10).map(|i: usize| (i * 31 % 251) as u8).collect();
    let mut g = c.benchmark_group("crc32c");
    g.throughput(Throughput::Bytes(data.len() as u64));
    g.bench_function("crc-fast 256 KiB", |b| b.iter(|| crc32c(black_box(&data))));
    g.bench_function("crc32c crate 256 KiB", |b| b.iter(|| crc32c::crc32c(black_box(&data))));
    g.finish();
    let mut g = c.benchmark_group("crc32c_combine");
    let (a, s) = (crc32c(&data[..1000]), crc32c(&data[1000..]));
    g.bench_function("ours, 256 KiB appended", |b| b.iter(|| crc32c_combine(black_box(a), black_box(s), 256 << 10)));
    g.bench_function("crc32c crate, 256 KiB appended", |b| {
        b.iter(|| crc32c::crc32c_combine(black_box(a), black_box(s), 256 << 10))
    });
    g.finish();
}

/// 4 MiB copied into and out of a 256 MiB region, a different place each time (the
/// pool's memory is cold, as a put's destination is), with and without the sum.
fn summed_copies(c: &mut Criterion) {
    const LEN: usize = 4 << 20;
    const SLOTS: u64 = 64;
    let engine = TransferEngine::builder().build().expect("engine");
    let region = engine.register_region(SLOTS * LEN as u64).expect("region");
    let src: Vec<u8> = (0..LEN).map(|i| (i * 31 % 251) as u8).collect();
    let mut dst = vec![0u8; LEN];
    let mut slot = 0u64;
    let mut next = move || {
        slot = (slot + 1) % SLOTS;
        slot * LEN as u64
    };
    let mut g = c.benchmark_group(format!("copy 4 MiB (folded sums: {})", mooncake_transfer::copies_fold_checksums()));
    g.throughput(Throughput::Bytes(LEN as u64));
    g.bench_function("into the pool", |b| b.iter(|| region.copy_in(next(), black_box(&src)).expect("in")));
    g.bench_function("into the pool, summed", |b| {
        b.iter(|| region.copy_in_summed(next(), black_box(&src)).expect("in"))
    });
    g.bench_function("into the pool, then summed", |b| {
        b.iter(|| {
            region.copy_in(next(), black_box(&src)).expect("in");
            crc32c(&src)
        })
    });
    g.bench_function("out of the pool", |b| b.iter(|| region.copy_out(next(), black_box(&mut dst)).expect("out")));
    g.bench_function("out of the pool, summed", |b| {
        b.iter(|| region.copy_out_summed(next(), black_box(&mut dst)).expect("out"))
    });
    g.finish();
}

criterion_group!(benches, checksum, summed_copies);
criterion_main!(benches);
