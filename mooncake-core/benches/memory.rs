//! The master's memory per object: fills an in-process `Master` with N complete
//! objects (4 KiB each, one replica, keys of ~30 bytes) and prints, as one JSON line,
//! the resident memory it grew by per object beyond the key bytes, next to the
//! master's own estimate (`MasterStats::metadata_bytes`).
//!
//! `cargo bench -p mooncake-core --bench memory -- [N]` (or `MOONCAKE_MEMORY_OBJECTS=N`;
//! default 10 000 000). Linux only (reads `/proc/self/statm`).

use std::time::{Duration, Instant};

use mooncake_core::{Master, MasterConfig, ReplicateConfig};
use mooncake_transfer::RemoteRegion;

const OBJECT_LEN: u64 = 4096;

/// Resident bytes of this process.
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm (Linux only)");
    let pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("statm resident field");
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * page as u64
}

/// Key of object `i`: ~30 bytes, shaped like a KV-cache block key.
fn key(i: u64) -> String {
    format!("model7/prefix/{:09}/layer{:02}", i / 64, i % 64)
}

fn objects_wanted() -> u64 {
    // `cargo bench` passes `--bench`; the first plain number is N.
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .or_else(|| std::env::var("MOONCAKE_MEMORY_OBJECTS").ok().and_then(|v| v.parse().ok()))
        .unwrap_or(10_000_000)
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
    let region = RemoteRegion { endpoint: "bench://memory".into(), region: 1 };
    master.mount_segment(client, &region, capacity).expect("mount");
    let cfg = ReplicateConfig { replica_num: 1, ..Default::default() };

    let before = rss_bytes();
    let started = Instant::now();
    for i in 0..n {
        let k = key(i);
        master.put_start(client, &k, OBJECT_LEN, &cfg).expect("put_start");
        master.put_end(client, &k, i as u32).expect("put_end");
    }
    let fill_s = started.elapsed().as_secs_f64();
    let after = rss_bytes();
    let stats = master.stats();
    assert_eq!(stats.objects, n, "every object is in the index");

    let per_object = (after - before) as f64 / n as f64;
    let key_per_object = stats.key_bytes as f64 / n as f64;
    let json = serde_json::json!({
        "bench": "master_memory_per_object",
        "objects": n,
        "object_len": OBJECT_LEN,
        "replicas": 1,
        "key_bytes_per_object": key_per_object,
        "rss_growth_bytes": after - before,
        "rss_bytes_per_object": per_object,
        "rss_bytes_per_object_beyond_key": per_object - key_per_object,
        "metadata_bytes_per_object": stats.metadata_bytes as f64 / n as f64,
        "metadata_bytes_per_object_beyond_key": (stats.metadata_bytes - stats.key_bytes) as f64 / n as f64,
        "fill_seconds": fill_s,
    });
    println!("{json}");
}
