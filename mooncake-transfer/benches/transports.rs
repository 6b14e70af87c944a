//! Read and write throughput of one request over each transport: Local (memcpy in
//! process), Shm (a mapped memfd), Tcp (loopback), for 4 KiB .. 4 MiB.
//!
//! `cargo bench -p mooncake-transfer --bench transports`

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mooncake_transfer::{ShmTransport, TcpTransport, TransferEngine, Transport};

const SIZES: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 4 << 20];

fn transports(c: &mut Criterion) {
    let server = TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_memory(true).build().unwrap();
    let region = server.register_region(64 << 20).unwrap();
    // Touch every page once so no run pays the first-touch faults.
    let zeros = vec![0u8; 1 << 20];
    for i in 0..64 {
        region.copy_in(i << 20, &zeros).unwrap();
    }
    let target = server.remote(region.id());
    let only = |t: Arc<dyn Transport>| TransferEngine::builder().transport(t).build().unwrap();
    let clients = [
        ("local", TransferEngine::new()),
        ("shm", only(Arc::new(ShmTransport::new()))),
        ("tcp", only(Arc::new(TcpTransport::new()))),
    ];
    for (name, client) in &clients {
        let mut first = [0u8; 1];
        client.read(&target, 0, &mut first).unwrap();
        assert_eq!(client.transport_name(&target.endpoint), Some(*name));
    }
    for op in ["read", "write"] {
        let mut group = c.benchmark_group(op);
        for size in SIZES {
            group.throughput(Throughput::Bytes(size as u64));
            let mut buf = vec![7u8; size];
            for (name, client) in &clients {
                group.bench_with_input(BenchmarkId::new(*name, size), &size, |b, _| {
                    // Walk the region so that large sizes don't stay in one cache.
                    let mut at = 0u64;
                    b.iter(|| {
                        at = (at + size as u64) % (64 << 20);
                        if op == "read" {
                            client.read(&target, at, &mut buf).unwrap();
                        } else {
                            client.write(&target, at, &buf).unwrap();
                        }
                    })
                });
            }
        }
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = transports
}
criterion_main!(benches);
