//! The master's memory per object: one master (the index is laid out the same in a
//! cluster, where each master holds its groups' share), millions of small objects
//! with ~30-byte keys put through batch calls; the master's RSS growth per object,
//! and its own estimate (`MasterStats::metadata_bytes`), each less the key.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mooncake_core::Store;
use serde_json::{json, Value};

use super::daemons::{rss_bytes, Daemon, MasterSpec};
use super::workload::put_batch;

/// Arguments of `mooncake-bench cluster memory`.
#[derive(clap::Args, Debug)]
pub(crate) struct MemoryArgs {
    /// Objects put.
    #[arg(long, default_value_t = 10_000_000)]
    objects: u64,
    /// Fractions of `--objects` at which memory is read (the last is all of them).
    #[arg(long, default_value = "0.1,0.2,0.5,1")]
    checkpoints: String,
    /// Keys per batch call.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Client threads putting.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Bytes each object reserves in the node's segment (the segment is sized to
    /// hold every object below the eviction watermark).
    #[arg(long, default_value_t = 64)]
    object_size: u64,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
}

/// Objects put before the baseline is read (thread pools, connections, first
/// allocations are not per-object costs).
const WARM: u64 = 10_000;

/// Key of object `i`: 30 bytes, like a KV-cache block key with a model and layer.
fn key(i: u64) -> String {
    format!("memory/layer00/{i:015}")
}

pub(crate) fn memory(a: &MemoryArgs) -> Result<Value, String> {
    let fractions: Vec<f64> = a
        .checkpoints
        .split(',')
        .map(|f| f.trim().parse().map_err(|e| format!("--checkpoints {f}: {e}")))
        .collect::<Result<_, _>>()?;
    if a.objects <= WARM || a.batch == 0 || a.threads == 0 || a.object_size == 0 {
        return Err(format!("--objects must exceed {WARM}; --batch, --threads, --object-size positive"));
    }
    let key_len = key(0).len() as f64;
    let master = Daemon::master(&MasterSpec { cluster: None, core: None, lease_ttl_ms: 0, client_ttl_ms: 10_000 })?;
    // Room for every object below the 0.95 eviction watermark.
    let aligned = a.object_size.div_ceil(64) * 64;
    let segment_mib = ((a.objects + WARM) * aligned).div_ceil((1 << 20) * 85 / 100).max(64);
    let node = Daemon::node(&master.addr, &format!("{segment_mib}MiB"))?;
    let store =
        Store::builder().master_address(&master.addr).global_segment_size(0).build().map_err(|e| e.to_string())?;
    let (api, client) = (store.master().clone(), store.client_id());
    let next = AtomicU64::new(0);
    let put_until = |target: u64| -> Result<(), String> {
        let failed = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..a.threads {
                s.spawn(|| loop {
                    let first = next.fetch_add(a.batch as u64, Ordering::Relaxed);
                    if first >= target {
                        return;
                    }
                    let keys: Vec<String> = (first..(first + a.batch as u64).min(target)).map(key).collect();
                    failed.fetch_add(put_batch(&api, client, &keys, a.object_size), Ordering::Relaxed);
                });
            }
        });
        // Threads overshoot `next` past the target once each.
        next.store(target, Ordering::Relaxed);
        match failed.into_inner() {
            0 => Ok(()),
            n => Err(format!("{n} puts failed")),
        }
    };
    let measure = || -> Result<(u64, Value), String> {
        // The nodes' record acknowledgments and the heartbeats settle first.
        std::thread::sleep(Duration::from_secs(2));
        let stats = api.stats().map_err(|e| e.to_string())?;
        Ok((
            stats.objects,
            json!({
                "objects": stats.objects,
                "master_rss_bytes": rss_bytes(master.pid())?,
                "node_rss_bytes": rss_bytes(node.pid())?,
                "metadata_bytes": stats.metadata_bytes,
                "key_bytes": stats.key_bytes,
            }),
        ))
    };
    put_until(WARM)?;
    let (base_objects, base) = measure()?;
    eprintln!("memory: {segment_mib} MiB segment; baseline {base}");
    let mut points = Vec::new();
    let start = Instant::now();
    for f in fractions {
        let target = ((a.objects as f64 * f) as u64).clamp(WARM, a.objects);
        put_until(target)?;
        let (objects, mut p) = measure()?;
        let n = objects.saturating_sub(base_objects).max(1) as f64;
        let grow = |field: &str| (p[field].as_f64().unwrap_or(0.0) - base[field].as_f64().unwrap_or(0.0)) / n;
        let rss_per = grow("master_rss_bytes");
        let est_per = p["metadata_bytes"].as_f64().unwrap_or(0.0) / objects.max(1) as f64;
        let est_key = p["key_bytes"].as_f64().unwrap_or(0.0) / objects.max(1) as f64;
        let node_per = grow("node_rss_bytes");
        p["put_s"] = json!(start.elapsed().as_secs_f64());
        p["master_rss_per_object"] = json!(rss_per);
        p["master_rss_per_object_beyond_key"] = json!(rss_per - key_len);
        p["metadata_bytes_per_object"] = json!(est_per);
        p["metadata_bytes_per_object_beyond_key"] = json!(est_per - est_key);
        p["node_rss_per_object"] = json!(node_per);
        eprintln!(
            "  {objects:>9} objects: master RSS +{rss_per:.0} B/object ({:.0} beyond the key), estimate {est_per:.0} ({:.0} beyond), node RSS +{node_per:.0} B/object",
            rss_per - key_len,
            est_per - est_key
        );
        points.push(p);
    }
    drop(store);
    drop(node);
    drop(master);
    Ok(json!({
        "system": "mooncake-rs", "bench": "cluster-memory", "masters": 1,
        "key_len": key_len, "object_size": a.object_size, "segment_mib": segment_mib,
        "baseline": base, "points": points,
    }))
}
