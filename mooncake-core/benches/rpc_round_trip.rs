//! A master call's round trip from a client on the master's host: over the
//! master's Unix socket (what such a client uses) and over loopback TCP (a master
//! served without the socket), one `exists` call at a time, nothing else running.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion};
use mooncake_core::rpc::{RpcMasterClient, RpcServerConfig};
use mooncake_core::{MasterApi, MasterDaemon};

fn round_trip(c: &mut Criterion) {
    let mut group = c.benchmark_group("rpc_round_trip");
    for (name, local_socket) in [("unix_socket", true), ("loopback_tcp", false)] {
        let daemon = MasterDaemon::builder("127.0.0.1:0")
            .rpc_config(RpcServerConfig { local_socket, ..RpcServerConfig::default() })
            .serve()
            .unwrap();
        let client = RpcMasterClient::connect(&daemon.local_addr().to_string()).unwrap();
        group.bench_function(name, |b| b.iter(|| black_box(client.exists("bench/key").unwrap())));
    }
    group.finish();
}

criterion_group!(benches, round_trip);
criterion_main!(benches);
