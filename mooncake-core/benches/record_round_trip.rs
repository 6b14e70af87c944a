//! What a durable acknowledgment costs, piece by piece, over loopback TCP:
//!
//! - `tcp_ping_pong`: the floor, one small message each way between two threads of
//!   this process over a plain socket;
//! - `apply_records`: one `ApplyRecords` round trip (one update) from the master's
//!   record client to a record endpoint served by an `RpcServer`;
//! - `put_start`, `put_end`, `remove` (each timed alone) and
//!   `put_start+put_end+remove`: a put's two master calls (no bytes moved) and a
//!   remove against a master daemon whose one storage node serves its records over
//!   TCP, so `put_end` includes the round trip to the node; `remove` likewise.
//! - `remove_kept`: `remove` of a key whose other copy went out of the master's
//!   sight with a node it forgot: the removal is also handed to the storage node to
//!   keep for a restarted master (`RecordUpdate::Tombstone`), on the same link as
//!   its record's removal.
//!
//!   Three threads poll here at once (this one for the master's answer, the master
//!   for the node's, the node for its next request): on a host with fewer free
//!   cores than that, these rows show how the pollers share them.

use std::collections::HashMap;
use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use mooncake_core::rpc::wire::{Request, Response};
use mooncake_core::rpc::{RpcHandler, RpcMasterClient, RpcRecordConnector, RpcServer, RpcServerConfig};
use mooncake_core::{MasterApi, MasterDaemon, ObjectRecord, RecordConnector, RecordUpdate, ReplicateConfig, Store};
use parking_lot::Mutex;

/// A record endpoint keeping the records in a map, as a storage node does.
#[derive(Default)]
struct Records(Mutex<HashMap<u64, ObjectRecord>>);

impl RpcHandler for Records {
    fn handle(&self, request: Request) -> Response {
        if let Request::ApplyRecords { updates } = request {
            let mut map = self.0.lock();
            for u in updates {
                match u {
                    RecordUpdate::Added { record, .. } => {
                        map.insert(record.offset, record);
                    }
                    RecordUpdate::Removed { offset, .. } => {
                        map.remove(&offset);
                    }
                    RecordUpdate::Discard { .. } | RecordUpdate::Drain { .. } | RecordUpdate::Tombstone { .. } => {}
                }
            }
        }
        Response::Unit
    }
}

fn tcp_ping_pong(c: &mut Criterion) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut b = [0u8; 64];
        while s.read_exact(&mut b).is_ok() {
            if s.write_all(&b).is_err() {
                return;
            }
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let mut b = [7u8; 64];
    c.bench_function("records/tcp_ping_pong", |bench| {
        bench.iter(|| {
            s.write_all(&b).unwrap();
            s.read_exact(&mut b).unwrap();
        })
    });
    drop(s);
    echo.join().unwrap();
}

fn apply_records(c: &mut Criterion) {
    // As a storage node serves it: to whoever proves its record key.
    let key = [5u8; mooncake_core::rpc::RECORD_KEY_LEN];
    let config =
        RpcServerConfig { secret: Some(mooncake_core::rpc::record_endpoint_secret(&key)), ..Default::default() };
    let server = RpcServer::serve_with("127.0.0.1:0", Arc::new(Records::default()), config).unwrap();
    let sink = RpcRecordConnector::new(Duration::from_secs(5)).connect(&server.local_addr().to_string(), &key).unwrap();
    let record =
        ObjectRecord { key: "bench/records/key".into(), offset: 4096, len: 1 << 20, checksum: 7, generation: 1 };
    let updates = [RecordUpdate::Added { segment: 1, record }];
    c.bench_function("records/apply_records", |b| b.iter(|| sink.apply_records(black_box(&updates)).unwrap()));
}

fn put_end(c: &mut Criterion) {
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    // The storage node: serves its segment and its record endpoint over TCP.
    let _node = Store::builder().master_address(&addr).global_segment_size(64 << 20).build().unwrap();
    let client = RpcMasterClient::connect(&addr).unwrap();
    let id = client.register_client().unwrap().client;
    let cfg = ReplicateConfig::default();
    let mut i = 0u64;
    // Each call of a put_start, put_end, remove timed alone, the other two run
    // untimed (a revoke instead of the end and remove would keep the put's room
    // quarantined a client TTL, filling the segment).
    for (name, part) in [("records/put_start", 0), ("records/put_end", 1), ("records/remove", 2)] {
        c.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let key = format!("bench/part/{i}");
                    i += 1;
                    for step in 0..3 {
                        let t = std::time::Instant::now();
                        match step {
                            0 => drop(black_box(client.put_start(id, &key, 4096, &cfg).unwrap())),
                            1 => client.put_end(id, &key, 7).unwrap(),
                            _ => client.remove(&key).unwrap(),
                        }
                        if step == part {
                            timed += t.elapsed();
                        }
                    }
                }
                timed
            })
        });
    }
    c.bench_function("records/put_start+put_end+remove", |b| {
        b.iter(|| {
            let key = format!("bench/end/{i}");
            i += 1;
            black_box(client.put_start(id, &key, 4096, &cfg).unwrap());
            client.put_end(id, &key, 7).unwrap();
            client.remove(&key).unwrap();
        })
    });
}

fn remove_kept(c: &mut Criterion) {
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let _node = Store::builder().master_address(&addr).global_segment_size(64 << 20).build().unwrap();
    let client = RpcMasterClient::connect(&addr).unwrap();
    let id = client.register_client().unwrap().client;
    let both = ReplicateConfig { replica_num: 2, ..Default::default() };
    let mut round = 0u64;
    c.bench_function("records/remove_kept", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            // In rounds of at most 4,096 keys (16 MiB of each 64 MiB segment).
            let mut left = iters;
            while left > 0 {
                let n = left.min(4096);
                left -= n;
                // Untimed: keys with a replica on the storage node and one on a node
                // (a segment of this client's) that is then forgotten.
                round += 1;
                let gone = client.register_client().unwrap().client;
                let region = mooncake_transfer::RemoteRegion { endpoint: format!("bench-gone-{round}:1"), region: 1 };
                client.mount_segment(gone, &region, 64 << 20).unwrap();
                let keys: Vec<String> = (0..n).map(|i| format!("bench/kept/{round}/{i}")).collect();
                for key in &keys {
                    black_box(client.put_start(id, key, 4096, &both).unwrap());
                    client.put_end(id, key, 7).unwrap();
                }
                client.unregister_client(gone).unwrap();
                let t = std::time::Instant::now();
                for key in &keys {
                    client.remove(key).unwrap();
                }
                timed += t.elapsed();
            }
            timed
        })
    });
    let stats = client.stats().unwrap();
    assert!(stats.carried_tombstones > 0, "no removal was handed on: the bench measures a plain remove");
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = tcp_ping_pong, apply_records, put_end, remove_kept
}
criterion_main!(benches);
