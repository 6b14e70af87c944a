//! `batch_get_into` of 16 objects of 256 KiB against 16 `get_into` calls, into the
//! same caller buffers: embedded (same process, memcpy) and over TCP (a master
//! daemon, the segment served by another client, the reader on TCP). The replica
//! cache is off so that each `get_into` pays its master round trip, as a first read
//! of each block does.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_core::{MasterDaemon, Protocol, ReplicateConfig, Store};

const N: usize = 16;
const LEN: usize = 256 << 10;

fn fill(owner: &Store) -> Vec<String> {
    let keys: Vec<String> = (0..N).map(|i| format!("bench/block{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        owner.put_with(k, &vec![i as u8; LEN], &ReplicateConfig::default()).unwrap();
    }
    keys
}

fn compare(c: &mut Criterion, name: &str, reader: &Store, keys: &[String]) {
    let refs: Vec<&str> = keys.iter().map(|k| &k[..]).collect();
    let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; LEN]; N];
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Bytes((N * LEN) as u64));
    group.bench_function("16 x get_into", |b| {
        b.iter(|| {
            for (k, buf) in refs.iter().zip(bufs.iter_mut()) {
                black_box(reader.get_into(k, buf).unwrap());
            }
        })
    });
    group.bench_function("batch_get_into", |b| {
        b.iter(|| {
            let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            for r in reader.batch_get_into(&refs, &mut slices) {
                black_box(r.unwrap());
            }
        })
    });
    group.finish();
}

fn embedded(c: &mut Criterion) {
    let store = Store::builder().global_segment_size(64 << 20).replica_cache(0).build().unwrap();
    let keys = fill(&store);
    compare(c, "embedded 16x256KiB", &store, &keys);
}

fn over_tcp(c: &mut Criterion) {
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let owner = Store::builder()
        .master_address(&addr)
        .listen("127.0.0.1:0")
        .protocol(Protocol::Tcp)
        .global_segment_size(64 << 20)
        .build()
        .unwrap();
    let reader = Store::builder()
        .master_address(&addr)
        .protocol(Protocol::Tcp)
        .global_segment_size(0)
        .replica_cache(0)
        .build()
        .unwrap();
    let keys = fill(&owner);
    compare(c, "tcp 16x256KiB", &reader, &keys);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = embedded, over_tcp
}
criterion_main!(benches);
