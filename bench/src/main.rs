//! `mooncake-bench`: end-to-end benchmarks with JSON output.
//!
//! ```text
//! mooncake-bench remote --transport tcp|shm [--sizes 4K,64K,1M,4M] [--out FILE]
//! mooncake-bench memcpy [--size 4MiB]
//! mooncake-bench trace FILE [--bytes-per-token 128] [--time-scale 20] [--dram 256MiB] [--ssd-dir DIR] [--out FILE]
//! mooncake-bench meta | plot --results DIR --out-dir DIR
//! mooncake-bench ssd [--dir /var/tmp/mooncake-ssd-bench] [--total 2GiB] [--out FILE]
//! mooncake-bench cluster throughput|failover|memory [--out FILE]
//! ```
//! `remote` starts a master and one storage node (the sibling `mooncake-master` and
//! `mooncake-client` binaries) unless `--master` is given, then puts and gets objects
//! from this process, which gives no memory to the pool: every byte crosses to the
//! node over the chosen transport. Rows carry the fields of the reference Mooncake
//! anchor's JSON (`mode/api/size/batch`, ops/s, GB/s, per-call latency percentiles)
//! so the two files compare row for row.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use hdrhistogram::Histogram;
use mooncake_core::{parse_size, Store};
use serde::Serialize;

mod cluster;
mod drain;
mod idle;
mod lru_sim;
mod micro;
mod plot;
mod ssd;
mod trace;

#[derive(Parser, Debug)]
#[command(version, about = "End-to-end benchmarks of mooncake-rs")]
struct Args {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Replays a Mooncake-format request trace (prefix fetch until the first miss,
    /// then puts) against DRAM and optionally SSD; hit ratio per tier, bytes/s,
    /// prefix-fetch latency; compared with an offline LRU simulation.
    Trace(trace::TraceArgs),
    /// Embedded metadata ops/s (one thread, no bytes moved).
    Meta {
        /// Seconds per measured phase.
        #[arg(long, default_value_t = 1.0)]
        secs: f64,
        /// JSON output file (stdout if absent).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// PNG charts of a results directory (as bench/compare.sh writes it).
    Plot {
        /// Directory with the JSON results.
        #[arg(long)]
        results: PathBuf,
        /// Where the PNGs go (default: the results directory).
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Remote put/get between processes.
    Remote {
        /// tcp or shm.
        #[arg(long, default_value = "tcp")]
        transport: String,
        /// Object sizes.
        #[arg(long, default_value = "4K,64K,1M,4M")]
        sizes: String,
        /// Use this master instead of starting one (and a storage node).
        #[arg(long)]
        master: Option<String>,
        /// Segment size of the storage node started.
        #[arg(long, default_value = "2GiB")]
        segment_size: String,
        /// Bytes moved per phase (ops = clamp(phase/size, 64, 2000), as the anchor).
        #[arg(long, default_value = "256MiB")]
        phase_bytes: String,
        /// Time every call phase by phase and write each row's means (`phases_us`):
        /// a few clock readings per call (20 ns each on a VM), so the rows of the
        /// targets are measured without it.
        #[arg(long)]
        phases: bool,
        /// JSON output file (stdout if absent).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Put / get_into / batch_get / batch_put over each transport, with one and
    /// several client threads; p50/p99/p999 per call.
    Micro {
        /// local (same process), shm, tcp.
        #[arg(long, default_value = "local,shm,tcp")]
        transports: String,
        /// Object sizes.
        #[arg(long, default_value = "4K,64K,1M,16M")]
        sizes: String,
        /// Client thread counts.
        #[arg(long, default_value = "1,4")]
        threads: String,
        /// Keys per batch call.
        #[arg(long, default_value_t = 16)]
        batch: usize,
        /// Bytes per phase (items = clamp(phase/size, 64, 4000)).
        #[arg(long, default_value = "256MiB")]
        phase_bytes: String,
        /// JSON output file (stdout if absent).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// memcpy bandwidth of this machine (the Shm reference point).
    Memcpy {
        /// Buffer size.
        #[arg(long, default_value = "4MiB")]
        size: String,
    },
    /// The SSD tier (mooncake-storage) on a directory: offload and load GB/s,
    /// random small-object loads per second (see bench/ssd.sh for fio beside it).
    Ssd(ssd::SsdArgs),
    /// Many idle clients connected to one master (default 10,000): the master's RSS
    /// and threads, and the 4 KiB get p50, before and with them connected.
    Idle(idle::IdleArgs),
    /// Cluster mode with real etcd, masters and nodes: metadata ops/s with 1 and 2
    /// masters, failover time over repeated kills, master memory per object.
    Cluster(cluster::ClusterArgs),
    /// Drain time: a storage node holding `--bytes` (default 1 GiB) of one-replica
    /// objects is drained to another; seconds until done and bytes/s.
    Drain(drain::DrainArgs),
}

/// One measured phase, in the anchor's row format.
#[derive(Serialize, Debug)]
struct Row {
    system: &'static str,
    mode: &'static str,
    transport: String,
    api: &'static str,
    size: u64,
    batch: u64,
    calls: u64,
    items: u64,
    fail: u64,
    wall_s: f64,
    ops_per_s: f64,
    calls_per_s: f64,
    #[serde(rename = "GB_per_s")]
    gb_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    mean_us: f64,
    max_us: f64,
    /// Where a call's time went, mean microseconds per phase
    /// ([`mooncake_core::WriteTime`] for puts, [`mooncake_core::ReadTime`] for gets).
    #[serde(skip_serializing_if = "Option::is_none")]
    phases_us: Option<std::collections::BTreeMap<&'static str, f64>>,
}

fn row(api: &'static str, transport: &str, size: u64, hist: &Histogram<u64>, fail: u64, wall: Duration) -> Row {
    let calls = hist.len();
    let wall_s = wall.as_secs_f64();
    Row {
        system: "mooncake-rs",
        mode: "remote",
        transport: transport.to_owned(),
        api,
        size,
        batch: 1,
        calls,
        items: calls,
        fail,
        wall_s,
        ops_per_s: calls as f64 / wall_s,
        calls_per_s: calls as f64 / wall_s,
        gb_per_s: calls as f64 * size as f64 / wall_s / 1e9,
        p50_us: hist.value_at_quantile(0.50) as f64 / 1000.0,
        p99_us: hist.value_at_quantile(0.99) as f64 / 1000.0,
        mean_us: hist.mean() / 1000.0,
        max_us: hist.max() as f64 / 1000.0,
        phases_us: None,
    }
}

/// A child process stopped when dropped.
pub(crate) struct Child2(Child, pub(crate) String);

impl Drop for Child2 {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg("-TERM").arg(self.0.id().to_string()).status();
        let _ = self.0.wait();
    }
}

pub(crate) fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    exe.with_file_name(name)
}

pub(crate) fn spawn(program: PathBuf, args: &[&str]) -> Result<Child2, String> {
    let mut child =
        Command::new(&program).args(args).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| {
            format!(
                "cannot start {}: {e} (build with `cargo build --release -p mooncake-cli -p mooncake-bench`)",
                program.display()
            )
        })?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line).map_err(|e| e.to_string())?;
    Ok(Child2(child, line.trim().to_owned()))
}

pub(crate) fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 131 % 251) as u8).collect()
}

fn remote(
    transport: &str,
    sizes: &str,
    master: Option<String>,
    segment: &str,
    phase: &str,
    phases: bool,
) -> Result<Vec<Row>, String> {
    let segment_bytes = parse_size(segment).map_err(|e| e.to_string())?;
    let phase_bytes = parse_size(phase).map_err(|e| e.to_string())?;
    // Our own master and pre-faulted node, or a client of the master given.
    let (pool, store) = match master {
        None => {
            let pool = micro::pool(transport, 1, segment_bytes, phases)?;
            let store = pool.clients[0].clone();
            (Some(pool), store)
        }
        Some(m) => {
            let store = Store::builder()
                .phase_times(phases)
                .master_address(&m)
                .protocol(micro::protocol(transport)?)
                .global_segment_size(0)
                .build()
                .map_err(|e| e.to_string())?;
            (None, store)
        }
    };
    let mut rows = Vec::new();
    for size in sizes.split(',') {
        let size = parse_size(size).map_err(|e| e.to_string())?;
        let ops = (phase_bytes / size).clamp(64, 2000);
        let value = payload(size as usize);
        let keys: Vec<String> = (0..ops).map(|i| format!("bench/{transport}/{size}/{i}")).collect();
        // Warm-up: fault the node's pages in and open connections.
        for k in keys.iter().take(8) {
            let _ = store.put(&format!("{k}/warm"), &value);
            let _ = store.get(&format!("{k}/warm"));
        }
        let mut hist = Histogram::<u64>::new(3).expect("histogram");
        let (mut fail, start, written) = (0, Instant::now(), store.stats().write_time);
        for k in &keys {
            let t = Instant::now();
            if store.put(k, &value).is_err() {
                fail += 1;
            }
            hist.record(t.elapsed().as_nanos() as u64).ok();
        }
        let mut put = row("put", transport, size, &hist, fail, start.elapsed());
        put.phases_us = phases.then(|| store.stats().write_time.since(&written).per_call_us().into_iter().collect());
        rows.push(put);
        for (api, into) in [("get", false), ("get_into", true)] {
            let mut hist = Histogram::<u64>::new(3).expect("histogram");
            let mut buf = vec![0u8; size as usize];
            let (mut fail, start, read) = (0, Instant::now(), store.stats().read_time);
            for k in &keys {
                let t = Instant::now();
                let ok = if into { store.get_into(k, &mut buf).is_ok() } else { store.get(k).is_ok() };
                hist.record(t.elapsed().as_nanos() as u64).ok();
                if !ok {
                    fail += 1;
                }
            }
            let mut got = row(api, transport, size, &hist, fail, start.elapsed());
            got.phases_us = phases.then(|| store.stats().read_time.since(&read).per_call_us().into_iter().collect());
            rows.push(got);
        }
        eprintln!(
            "{transport} {size:>8} B: put {:.2} GB/s p50 {:.0} us | get {:.2} GB/s p50 {:.0} us",
            rows[rows.len() - 3].gb_per_s,
            rows[rows.len() - 3].p50_us,
            rows[rows.len() - 1].gb_per_s,
            rows[rows.len() - 1].p50_us
        );
        // Leave the segment empty for the next size (leases expire first).
        std::thread::sleep(Duration::from_millis(50));
        let _ = store.remove_all();
    }
    drop(store);
    drop(pool);
    Ok(rows)
}

fn memcpy(size: &str) -> Result<serde_json::Value, String> {
    let size = parse_size(size).map_err(|e| e.to_string())? as usize;
    // Cold: sources rotate over 256 MiB, more than any cache, as a KV pool would.
    let sources: Vec<Vec<u8>> = (0..(256usize << 20).div_ceil(size).max(2)).map(|_| payload(size)).collect();
    let mut dst = vec![0u8; size];
    let rate = |f: &mut dyn FnMut(usize)| {
        let iters = ((8u64 << 30) / size as u64).max(8) as usize;
        let start = Instant::now();
        for i in 0..iters {
            f(i);
        }
        iters as f64 * size as f64 / start.elapsed().as_secs_f64() / 1e9
    };
    let cold = rate(&mut |i| {
        dst.copy_from_slice(std::hint::black_box(&sources[i % sources.len()]));
        std::hint::black_box(&mut dst);
    });
    let warm = rate(&mut |_| {
        dst.copy_from_slice(std::hint::black_box(&sources[0]));
        std::hint::black_box(&mut dst);
    });
    Ok(
        serde_json::json!({ "system": "memcpy", "size": size, "GB_per_s": cold, "cold_GB_per_s": cold, "warm_GB_per_s": warm }),
    )
}

fn write_json(json: &serde_json::Value, out: Option<PathBuf>) -> Result<(), String> {
    let text = serde_json::to_string_pretty(json).map_err(|e| e.to_string())?;
    match out {
        Some(p) => std::fs::write(&p, text).map_err(|e| e.to_string()),
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

fn main() {
    let args = Args::parse();
    let result = match args.command {
        Cmd::Trace(a) => trace::run(&a),
        Cmd::Meta { secs, out } => trace::metadata(secs).and_then(|json| write_json(&json, out)),
        Cmd::Plot { results, out_dir } => plot::plot(&results, out_dir.as_ref().unwrap_or(&results)).map(|files| {
            for f in files {
                eprintln!("wrote {}", f.display());
            }
        }),
        Cmd::Remote { transport, sizes, master, segment_size, phase_bytes, phases, out } => {
            remote(&transport, &sizes, master, &segment_size, &phase_bytes, phases).and_then(|rows| {
                let json = serde_json::json!({ "system": "mooncake-rs", "rows": rows });
                write_json(&json, out)
            })
        }
        Cmd::Ssd(a) => ssd::ssd(&a).and_then(|json| write_json(&json, a.out.clone())),
        Cmd::Idle(a) => idle::idle(&a).and_then(|json| write_json(&json, a.out.clone())),
        Cmd::Drain(a) => drain::drain(&a).and_then(|json| write_json(&json, a.out.clone())),
        Cmd::Cluster(a) => cluster::run(&a).and_then(|(json, out)| write_json(&json, out)),
        Cmd::Memcpy { size } => memcpy(&size).map(|v| println!("{v}")),
        Cmd::Micro { transports, sizes, threads, batch, phase_bytes, out } => {
            micro::micro(&transports, &sizes, &threads, batch, &phase_bytes).and_then(|rows| {
                let json = serde_json::json!({ "system": "mooncake-rs", "bench": "micro", "rows": rows });
                write_json(&json, out)
            })
        }
    };
    if let Err(e) = result {
        eprintln!("mooncake-bench: {e}");
        std::process::exit(1);
    }
}
