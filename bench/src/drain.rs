//! Drain time: a storage node holding `--bytes` of objects (each the only replica)
//! is drained to another node; how long until it reports done, and bytes/s.

use std::time::{Duration, Instant};

use mooncake_core::{parse_size, ReplicateConfig, Store};

use crate::{payload, sibling, spawn};

/// Arguments of `mooncake-bench drain`.
#[derive(clap::Args, Debug)]
pub(crate) struct DrainArgs {
    /// Bytes of objects on the drained node.
    #[arg(long, default_value = "1GiB")]
    bytes: String,
    /// Object size.
    #[arg(long, default_value = "1MiB")]
    size: String,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub(crate) out: Option<std::path::PathBuf>,
}

pub(crate) fn drain(a: &DrainArgs) -> Result<serde_json::Value, String> {
    let total = parse_size(&a.bytes).map_err(|e| e.to_string())?;
    let size = parse_size(&a.size).map_err(|e| e.to_string())?.max(1);
    let n = (total / size).max(1) as usize;
    // Room for everything below the high watermark (a drain's copies never evict).
    let segment = (total + total / 4 + (64 << 20)).to_string();
    let master = spawn(sibling("mooncake-master"), &["--listen", "127.0.0.1:0"])?;
    let addr = master.1.rsplit(' ').next().ok_or("no master address")?.to_owned();
    let node = |grace: &str| {
        spawn(
            sibling("mooncake-client"),
            &[
                "serve",
                "--master",
                &addr,
                "--listen",
                "127.0.0.1:0",
                "--segment-size",
                &segment,
                "--drain-grace",
                grace,
            ],
        )
    };
    let (drained, other) = (node("0")?, node("0")?);
    let endpoint = drained.1.rsplit(' ').next().ok_or("no node endpoint")?.to_owned();
    let seg: u64 = drained.1.split(' ').nth(3).and_then(|s| s.parse().ok()).ok_or("no segment id")?;
    let store = Store::builder().master_address(&addr).global_segment_size(0).build().map_err(|e| e.to_string())?;
    let name = store.master().segment_info(seg).map_err(|e| e.to_string())?.name;
    let cfg = ReplicateConfig { preferred_segments: vec![name], ..Default::default() };
    let value = payload(size as usize);
    let keys: Vec<String> = (0..n).map(|i| format!("drain/{i}")).collect();
    for chunk in keys.chunks(16) {
        let items: Vec<(&str, &[u8])> = chunk.iter().map(|k| (k.as_str(), &value[..])).collect();
        for r in store.batch_put(&items, &cfg) {
            r.map_err(|e| e.to_string())?;
        }
    }
    let start = Instant::now();
    store.master().drain_segment(&endpoint, 600_000).map_err(|e| e.to_string())?;
    let p = loop {
        let p = store.master().drain_status(&endpoint).map_err(|e| e.to_string())?;
        if p.started && p.done {
            break p;
        }
        if start.elapsed() > Duration::from_secs(660) {
            return Err("the drain did not finish in 660 s".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let secs = start.elapsed().as_secs_f64();
    // A sample reads back from the other node.
    for k in keys.iter().step_by((n / 16).max(1)) {
        let got = store.get(k).map_err(|e| format!("{k}: {e}"))?;
        if got[..] != value[..] {
            return Err(format!("{k}: wrong bytes after the drain"));
        }
    }
    drop(store);
    drop((drained, other, master));
    Ok(serde_json::json!({
        "system": "mooncake-rs",
        "bench": "drain",
        "objects": n,
        "object_size": size,
        "bytes_moved": p.bytes_moved(),
        "objects_copied": p.objects_copied,
        "objects_lost": p.objects_lost,
        "secs": secs,
        "node_secs": p.elapsed_ms as f64 / 1000.0,
        "bytes_per_sec": p.bytes_moved() as f64 / secs,
    }))
}
