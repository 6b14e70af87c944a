//! The checksum's pieces: crc32c of 256 KiB, and combining two sums (ours against the
//! `crc32c` crate's, which objects of several parts used to pay once per part).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_transfer::checksum::{crc32c, crc32c_combine};

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

criterion_group!(benches, checksum);
criterion_main!(benches);
