//! Embedded metadata round trip: put_start + put_end + get_replica_list (+ remove, so
//! the index stays the same size), on one core, no bytes moved. And the cost of
//! durable records on an in-process store: a 4 KiB put + remove with the master
//! tracking records (each acknowledged once the node's records are updated) or not.
//! And a node re-mounting 100,000 records to a restarted master (in its recovery
//! window, so each key's generation is remembered as well).

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use mooncake_core::{Master, MasterConfig, ObjectRecord, ReplicateConfig, Store};
use mooncake_transfer::RemoteRegion;

fn metadata_round_trip(c: &mut Criterion) {
    // The bench's client sends no heartbeats: a client TTL longer than the whole run
    // keeps its segments (and so its objects) mounted throughout.
    let config =
        MasterConfig { default_lease: Duration::ZERO, client_ttl: Duration::from_secs(3600), ..Default::default() };
    let master = Master::new(config).unwrap();
    let client = master.register_client().unwrap().client;
    for i in 0..16 {
        let region = RemoteRegion { endpoint: format!("bench://{i}"), region: 1 };
        master.mount_segment(client, &region, 64 << 30).unwrap();
    }
    let keys: Vec<String> = (0..100_000).map(|i| format!("bench/prefix/{i:08}")).collect();
    let cfg = ReplicateConfig::default();
    let mut group = c.benchmark_group("metadata");
    group.throughput(Throughput::Elements(1));
    let mut i = 0usize;
    group.bench_function("put_start+put_end+get_replica_list+remove", |b| {
        b.iter(|| {
            let key = &keys[i % keys.len()];
            i += 1;
            black_box(master.put_start(client, key, 1 << 20, &cfg).unwrap());
            master.put_end(client, key, 7).unwrap();
            black_box(master.get_replica_list(key).unwrap());
            master.remove(key).unwrap();
        })
    });
    // Reads alone against a populated index.
    for key in &keys {
        master.put_start(client, key, 4096, &cfg).unwrap();
        master.put_end(client, key, 7).unwrap();
    }
    group.bench_function("get_replica_list", |b| {
        b.iter(|| {
            let key = &keys[i % keys.len()];
            i += 1;
            black_box(master.get_replica_list(key).unwrap());
        })
    });
    group.finish();
}

fn embedded_put_with_records(c: &mut Criterion) {
    let mut group = c.benchmark_group("embedded_put_4k");
    group.throughput(Throughput::Elements(1));
    let value = vec![7u8; 4096];
    for track_records in [false, true] {
        let master =
            Master::new(MasterConfig { default_lease: Duration::ZERO, track_records, ..Default::default() }).unwrap();
        let node = Store::builder().master(&master).global_segment_size(64 << 20).build().unwrap();
        let client = Store::builder().master(&master).global_segment_size(0).build().unwrap();
        let name = if track_records { "put+remove, records on" } else { "put+remove, records off" };
        let mut i = 0usize;
        group.bench_function(name, |b| {
            b.iter(|| {
                let key = format!("bench/{i}");
                i += 1;
                client.put(&key, &value).unwrap();
                client.remove(&key).unwrap();
            })
        });
        drop((client, node));
    }
    group.finish();
}

fn remount_after_restart(c: &mut Criterion) {
    const RECORDS: u64 = 100_000;
    let records: Vec<ObjectRecord> = (0..RECORDS)
        .map(|i| ObjectRecord {
            key: format!("bench/prefix/{i:08}"),
            offset: i * 4096,
            len: 4096,
            checksum: i as u32,
            generation: 1 + i,
        })
        .collect();
    let region = RemoteRegion { endpoint: "bench://node".into(), region: 1 };
    let mut group = c.benchmark_group("remount");
    group.throughput(Throughput::Elements(RECORDS));
    group.sample_size(20);
    group.bench_function("100k records to a restarted master", |b| {
        b.iter_batched(
            || {
                let master = Master::new(MasterConfig::default()).unwrap();
                let client = master.register_client().unwrap().client;
                master.reconnected().unwrap();
                (master, client)
            },
            |(master, client)| {
                let (_, taken) = master.remount_segment(client, &region, RECORDS * 4096, &records).unwrap();
                assert_eq!(taken as u64, RECORDS);
                master
            },
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

criterion_group!(benches, metadata_round_trip, embedded_put_with_records, remount_after_restart);
criterion_main!(benches);
