//! `/metrics` of a master holding N objects: fills an in-process `Master` with N
//! complete objects (4 KiB each, one replica, keys of ~30 bytes), then times, and
//! prints as one JSON line (p50/p99 in ms):
//!
//! - `stats_render`: `Master::stats()` (the totals kept per index shard) and its
//!   Prometheus text, what `mooncake-master` does for each `/metrics`;
//! - `http_get`: a whole `GET /metrics` over loopback from the bounded HTTP server
//!   (`mooncake_cli::http`), connection set-up included;
//! - `walk_render`: the same numbers counted by walking the index
//!   (`recount_stats`), what each `/metrics` cost before the totals were kept.
//!
//! `cargo bench -p mooncake-cli --bench metrics_render -- [N]` (or
//! `MOONCAKE_METRICS_OBJECTS=N`; default 1 000 000).

use std::time::{Duration, Instant};

use mooncake_cli::metrics::prometheus_text;
use mooncake_core::{Master, MasterConfig, ReplicateConfig};
use mooncake_transfer::RemoteRegion;

const OBJECT_LEN: u64 = 4096;

/// Key of object `i`: ~30 bytes, shaped like a KV-cache block key.
fn key(i: u64) -> String {
    format!("model7/prefix/{:09}/layer{:02}", i / 64, i % 64)
}

fn objects_wanted() -> u64 {
    // `cargo bench` passes `--bench`; the first plain number is N.
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .or_else(|| std::env::var("MOONCAKE_METRICS_OBJECTS").ok().and_then(|v| v.parse().ok()))
        .unwrap_or(1_000_000)
}

/// p50 and p99 of `samples`, in milliseconds.
fn percentiles(mut samples: Vec<Duration>) -> serde_json::Value {
    samples.sort();
    let at = |q: f64| {
        let i = ((samples.len() as f64 * q).ceil() as usize).clamp(1, samples.len()) - 1;
        samples[i].as_secs_f64() * 1e3
    };
    serde_json::json!({ "samples": samples.len(), "p50_ms": at(0.50), "p99_ms": at(0.99) })
}

/// Times `runs` calls of `f`.
fn time(runs: usize, mut f: impl FnMut() -> usize) -> Vec<Duration> {
    let mut sink = 0usize;
    let samples = (0..runs)
        .map(|_| {
            let start = Instant::now();
            sink = sink.wrapping_add(f());
            start.elapsed()
        })
        .collect();
    std::hint::black_box(sink);
    samples
}

/// Times `runs` whole `GET /metrics` through the bounded HTTP server.
fn time_http(master: &Master, runs: usize) -> serde_json::Value {
    use std::io::{Read, Write};

    use mooncake_cli::http::{HttpAccess, HttpBounds, HttpResponse, HttpServer};

    let served = master.clone();
    let server = HttpServer::bind("127.0.0.1:0", HttpBounds::default(), HttpAccess::default(), move |path, _| {
        (path == "/metrics").then(|| HttpResponse::ok("text/plain", prometheus_text(&served.stats(), None)))
    })
    .expect("metrics server");
    let addr = server.local_addr();
    percentiles(time(runs, || {
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n").expect("request");
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).expect("answer");
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer));
        answer.len()
    }))
}

fn main() {
    let n = objects_wanted();
    let config = MasterConfig {
        default_lease: Duration::ZERO,
        // Nobody heartbeats: the client must outlive the fill.
        client_ttl: Duration::from_secs(24 * 3600),
        ..Default::default()
    };
    let master = Master::new(config).expect("master");
    let client = master.register_client().expect("register").client;
    // Room for every object below the eviction watermark.
    let capacity = (n * OBJECT_LEN * 2).max(1 << 30);
    let region = RemoteRegion { endpoint: "bench://metrics".into(), region: 1 };
    master.mount_segment(client, &region, capacity).expect("mount");
    let cfg = ReplicateConfig { replica_num: 1, ..Default::default() };
    let started = Instant::now();
    for i in 0..n {
        let k = key(i);
        master.put_start(client, &k, OBJECT_LEN, &cfg).expect("put_start");
        master.put_end(client, &k, i as u32).expect("put_end");
    }
    let fill_s = started.elapsed().as_secs_f64();
    let kept = master.stats();
    assert_eq!(kept.objects, n, "every object is in the index");
    assert_eq!(kept, master.recount_stats(), "the kept totals are those of a walk");

    let stats_render = percentiles(time(1000, || prometheus_text(&master.stats(), None).len()));
    let http_get = time_http(&master, 200);
    let walk_render = percentiles(time(10, || prometheus_text(&master.recount_stats(), None).len()));
    let json = serde_json::json!({
        "bench": "metrics_render",
        "objects": n,
        "object_len": OBJECT_LEN,
        "fill_seconds": fill_s,
        "stats_render": stats_render,
        "http_get": http_get,
        "walk_render": walk_render,
    });
    println!("{json}");
}
