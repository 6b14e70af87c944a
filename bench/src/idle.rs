//! Many idle clients on one master: the master's memory and threads with them
//! connected, and the latency of a 4 KiB get beside them.

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mooncake_core::rpc::wire::{encode_frame, FrameKind, Request};
use mooncake_core::Store;

use crate::{payload, sibling, spawn};

/// Arguments of `mooncake-bench idle`.
#[derive(clap::Args, Debug)]
pub(crate) struct IdleArgs {
    /// Idle connections opened (each completes its hello with one request first).
    #[arg(long, default_value_t = 10_000)]
    connections: usize,
    /// Gets timed before and with the idle connections.
    #[arg(long, default_value_t = 20_000)]
    gets: usize,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub(crate) out: Option<std::path::PathBuf>,
}

/// Resident bytes and threads of a process.
fn rss_and_threads(pid: u32) -> Result<(u64, u64), String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| e.to_string())?;
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or_else(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((field("VmRSS:")? * 1024, field("Threads:")?))
}

/// Raises this process's descriptor limit (as root: beyond the hard limit too).
fn raise_fd_limit(to: usize) {
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("prlimit").args(["--pid", &pid, &format!("--nofile={to}:{to}")]).status();
}

/// p50 of `gets` 4 KiB gets (each a master round trip and a transfer from the
/// node), in microseconds.
fn get_p50(store: &Store, keys: usize, gets: usize) -> Result<f64, String> {
    let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    for i in 0..gets {
        let start = Instant::now();
        store.get(&format!("idle/{}", i % keys)).map_err(|e| e.to_string())?;
        hist.record(start.elapsed().as_nanos() as u64).map_err(|e| e.to_string())?;
    }
    Ok(hist.value_at_quantile(0.5) as f64 / 1000.0)
}

pub(crate) fn idle(a: &IdleArgs) -> Result<serde_json::Value, String> {
    let fds = a.connections + 4096;
    raise_fd_limit(fds);
    let master_bin = sibling("mooncake-master");
    let master_bin = master_bin.to_str().ok_or("binary path is not UTF-8")?;
    let master =
        spawn("prlimit".into(), &[&format!("--nofile={fds}:{fds}"), "--", master_bin, "--listen", "127.0.0.1:0"])?;
    let addr = master.1.rsplit(' ').next().ok_or("no master address")?.to_owned();
    let master_pid = master.0.id();
    let node = spawn(
        sibling("mooncake-client"),
        &["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", "256MiB"],
    )?;
    // No replica cache: every get asks the master, through the loop the idle
    // connections share.
    let store = Store::builder()
        .master_address(&addr)
        .global_segment_size(0)
        .replica_cache(0)
        .build()
        .map_err(|e| e.to_string())?;
    let keys = 1000;
    let value = payload(4096);
    for i in 0..keys {
        store.put(&format!("idle/{i}"), &value).map_err(|e| e.to_string())?;
    }
    get_p50(&store, keys, a.gets / 4)?; // warm up
    let (rss_before, threads_before) = rss_and_threads(master_pid)?;
    let p50_before = get_p50(&store, keys, a.gets)?;
    let hello = encode_frame(FrameKind::Request, 1, &Request::Stats {}).map_err(|e| e.to_string())?;
    let start = Instant::now();
    let mut idle = Vec::with_capacity(a.connections);
    for i in 0..a.connections {
        let mut s = TcpStream::connect(&addr).map_err(|e| format!("connection {i}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(30))).map_err(|e| e.to_string())?;
        s.write_all(&hello).map_err(|e| e.to_string())?;
        mooncake_core::rpc::read_frame(&mut s, 1 << 20).map_err(|e| format!("connection {i}: {e}"))?;
        idle.push(s);
    }
    let connect_s = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(1));
    let (rss_with, threads_with) = rss_and_threads(master_pid)?;
    let p50_with = get_p50(&store, keys, a.gets)?;
    drop(idle);
    drop(store);
    drop(node);
    drop(master);
    Ok(serde_json::json!({
        "system": "mooncake-rs",
        "bench": "idle",
        "connections": a.connections,
        "connect_s": connect_s,
        "master_rss_bytes_before": rss_before,
        "master_rss_bytes_with": rss_with,
        "master_rss_bytes_per_connection": (rss_with.saturating_sub(rss_before)) as f64 / a.connections as f64,
        "master_threads_before": threads_before,
        "master_threads_with": threads_with,
        "get_4k_p50_us_before": p50_before,
        "get_4k_p50_us_with": p50_with,
    }))
}
