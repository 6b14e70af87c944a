//! `trace`: replays a Mooncake-format request trace against a store with limited
//! DRAM (and optionally an SSD tier), as a prefix cache would use it.
//!
//! Each line of the trace is a request: `timestamp` (ms), `hash_ids` (one id per
//! block of `--block-tokens` tokens; equal ids are reusable KV blocks). A block is
//! `--block-tokens x --bytes-per-token` bytes (the model size). Requests are
//! dispatched in timestamp order at `timestamp / --time-scale` after the start and
//! served by `--workers` threads. For each request, its blocks are fetched in order
//! with `get_into` until the first miss (the reusable prefix); every later block is
//! `put` (those already present answer `AlreadyExists` and are left alone). Fetched
//! bytes are checked against the value the block was put with (every byte).
//!
//! Reported: hit ratio (prefix blocks fetched / blocks looked up) per tier (DRAM or
//! SSD, from the clients' disk-load counters), bytes/s fetched and put, per-request
//! prefix-fetch latency percentiles and CDF, per-block get/put latency, and how far
//! the replay fell behind the trace's schedule. The same trace is then run through
//! [`lru_sim`](crate::lru_sim) over the same capacities; `--check-sim` fails the
//! command when the two hit ratios differ by more than `--sim-tolerance` points.
//!
//! The store's read lease is short here (`--lease-ms`, default 100 ms): a lease
//! only has to cover one read, and the default 5 s lease would pin, in a replay
//! sped up 20x, every block read in the last 100 s of trace time, which no LRU
//! model (and no real prefix cache, whose reads end in milliseconds) would do.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use hdrhistogram::Histogram;
use mooncake_core::storage::EvictionPolicy;
use mooncake_core::{parse_size, Error, Master, MasterConfig, SsdBackend, SsdOffloadConfig, Store};
use serde::Deserialize;
use serde_json::json;

use crate::lru_sim::{simulate, SimConfig, SimResult, SsdPolicy};
use crate::{sibling, spawn, Child2};

/// Options of the `trace` subcommand.
#[derive(Args, Debug, Clone)]
pub struct TraceArgs {
    /// Mooncake-format trace: JSON lines with `timestamp` (ms) and `hash_ids`.
    pub file: PathBuf,
    /// KV-cache bytes per token: picks the model size (a block is
    /// `block_tokens x bytes_per_token` bytes).
    #[arg(long, default_value_t = 128)]
    pub bytes_per_token: u64,
    /// Tokens per block (hash id) of the trace.
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u64,
    /// Replay arrival times this many times faster (0: no waiting at all).
    #[arg(long, default_value_t = 20.0)]
    pub time_scale: f64,
    /// DRAM of the pool, split evenly over the storage nodes.
    #[arg(long, default_value = "256MiB")]
    pub dram: String,
    /// Storage nodes (each mounts `dram / nodes`).
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// Give every node an SSD tier under this directory (a fresh subdirectory per
    /// run, removed at the end). Without it the run is DRAM-only.
    #[arg(long)]
    pub ssd_dir: Option<PathBuf>,
    /// SSD capacity of the pool, split evenly over the nodes.
    #[arg(long, default_value = "1GiB")]
    pub ssd_capacity: String,
    /// SSD layout: bucket, file_per_key or offset_allocator.
    #[arg(long, default_value = "bucket")]
    pub ssd_backend: String,
    /// SSD eviction: fifo or lru.
    #[arg(long, default_value = "fifo")]
    pub ssd_eviction: String,
    /// local: master and nodes in this process (in-process copies); tcp or shm:
    /// `mooncake-master` and `mooncake-client serve` processes, clients here give
    /// no memory and reach the nodes over that transport.
    #[arg(long, default_value = "local")]
    pub transport: String,
    /// Threads serving requests (1 keeps the trace order exactly).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Replay only the first N requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Read lease of the master (ms).
    #[arg(long, default_value_t = 100)]
    pub lease_ms: u64,
    /// Fail when replay and simulation hit ratios differ by more than the tolerance.
    #[arg(long)]
    pub check_sim: bool,
    /// Tolerance of `--check-sim`, in points of hit ratio.
    #[arg(long, default_value_t = 2.0)]
    pub sim_tolerance: f64,
    /// Only run the simulation (no store), with these capacities.
    #[arg(long)]
    pub sim_only: bool,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[cfg(test)]
impl TraceArgs {
    /// Defaults for `file` (what `mooncake-bench trace FILE` means).
    pub fn new(file: impl AsRef<Path>) -> Self {
        TraceArgs {
            file: file.as_ref().to_owned(),
            bytes_per_token: 128,
            block_tokens: 512,
            time_scale: 20.0,
            dram: "256MiB".into(),
            nodes: 1,
            ssd_dir: None,
            ssd_capacity: "1GiB".into(),
            ssd_backend: "bucket".into(),
            ssd_eviction: "fifo".into(),
            transport: "local".into(),
            workers: 1,
            max_requests: None,
            lease_ms: 100,
            check_sim: false,
            sim_tolerance: 2.0,
            sim_only: false,
            no_progress: true,
            out: None,
        }
    }
}

/// One request of the trace.
#[derive(Deserialize, Debug, Clone)]
pub struct TraceRequest {
    /// Arrival time, ms from the start of the trace.
    pub timestamp: f64,
    /// Block ids of the request's prompt, in order.
    pub hash_ids: Vec<u64>,
}

/// Reads a trace (JSON lines; blank lines skipped), sorted by arrival time.
pub fn load_trace(path: &Path, max: Option<usize>) -> Result<Vec<TraceRequest>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut reqs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if max.is_some_and(|m| reqs.len() >= m) {
            break;
        }
        let r: TraceRequest = serde_json::from_str(line).map_err(|e| format!("{}:{}: {e}", path.display(), n + 1))?;
        reqs.push(r);
    }
    // Stable: requests of the same millisecond keep their file order.
    reqs.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(reqs)
}

/// Block values: a fixed pseudo-random base plus a per-block word, so that every
/// 8 bytes of a block depend on its id (a block read back under the wrong key, or
/// torn, never compares equal) and making one costs an add per word.
struct Values {
    base: Vec<u64>,
}

impl Values {
    fn new(block_bytes: usize) -> Self {
        let mut x = 0x5EED_u64;
        Values { base: (0..block_bytes / 8).map(|_| splitmix64(&mut x)).collect() }
    }

    fn word(id: u64) -> u64 {
        let mut x = id;
        splitmix64(&mut x)
    }

    fn fill(&self, id: u64, buf: &mut [u8]) {
        let w = Self::word(id);
        for (chunk, b) in buf.chunks_exact_mut(8).zip(&self.base) {
            chunk.copy_from_slice(&b.wrapping_add(w).to_le_bytes());
        }
    }

    fn check(&self, id: u64, buf: &[u8]) -> bool {
        let w = Self::word(id);
        buf.len() == self.base.len() * 8
            && buf
                .chunks_exact(8)
                .zip(&self.base)
                .all(|(c, b)| u64::from_le_bytes(c.try_into().unwrap_or_default()) == b.wrapping_add(w))
    }
}

fn splitmix64(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The pool replayed against: storage nodes (in this process or not) and the
/// stores the workers use.
struct Pool {
    workers: Vec<Store>,
    nodes: Vec<Store>,
    _children: Vec<Child2>,
    ssd_root: Option<PathBuf>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.workers.clear();
        self.nodes.clear();
        self._children.clear();
        if let Some(dir) = &self.ssd_root {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn ssd_policy(s: &str) -> Result<(EvictionPolicy, SsdPolicy), String> {
    match s {
        "fifo" => Ok((EvictionPolicy::Fifo, SsdPolicy::Fifo)),
        "lru" => Ok((EvictionPolicy::Lru, SsdPolicy::Lru)),
        _ => Err(format!("--ssd-eviction {s:?}: use fifo or lru")),
    }
}

fn pool(a: &TraceArgs, dram: u64, ssd: u64) -> Result<Pool, String> {
    let err = |e: Error| e.to_string();
    let nodes = a.nodes.max(1);
    let ssd_root = match &a.ssd_dir {
        Some(d) => {
            let root = d.join(format!("mooncake-trace-{}", std::process::id()));
            std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
            Some(root)
        }
        None => None,
    };
    let backend: SsdBackend = a.ssd_backend.parse().map_err(err)?;
    let (eviction, _) = ssd_policy(&a.ssd_eviction)?;
    let mut pool = Pool { workers: Vec::new(), nodes: Vec::new(), _children: Vec::new(), ssd_root: ssd_root.clone() };
    if a.transport == "local" {
        let cfg = MasterConfig { default_lease: Duration::from_millis(a.lease_ms), ..Default::default() };
        let master = Master::new(cfg).map_err(err)?;
        for i in 0..nodes {
            let mut b = Store::builder().master(&master).global_segment_size(dram / nodes as u64);
            if let Some(root) = &ssd_root {
                let c = SsdOffloadConfig::new(root.join(format!("node{i}")), ssd / nodes as u64)
                    .backend(backend)
                    .eviction(eviction);
                b = b.ssd_offload(c);
            }
            pool.nodes.push(b.build().map_err(err)?);
        }
        // Workers read and write through the nodes themselves (in-process copies):
        // SSD hits are then the nodes' own disk loads.
        pool.workers = (0..a.workers.max(1)).map(|i| pool.nodes[i % nodes].clone()).collect();
        return Ok(pool);
    }
    let protocol = crate::micro::protocol(&a.transport)?;
    let lease = a.lease_ms.to_string();
    let m = spawn(sibling("mooncake-master"), &["--listen", "127.0.0.1:0", "--default-lease-ms", &lease])?;
    let addr = m.1.rsplit(' ').next().unwrap_or_default().to_owned();
    pool._children.push(m);
    let seg = (dram / nodes as u64).to_string();
    let cap = (ssd / nodes as u64).to_string();
    for i in 0..nodes {
        let mut args: Vec<String> = ["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", &seg]
            .iter()
            .map(|s| s.to_string())
            .collect();
        if let Some(root) = &ssd_root {
            let dir = root.join(format!("node{i}")).display().to_string();
            args.extend(["--ssd-dir".into(), dir, "--ssd-capacity".into(), cap.clone()]);
            args.extend([
                "--ssd-backend".into(),
                a.ssd_backend.clone(),
                "--ssd-eviction".into(),
                a.ssd_eviction.clone(),
            ]);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        pool._children.push(spawn(sibling("mooncake-client"), &refs)?);
    }
    for _ in 0..a.workers.max(1) {
        let s =
            Store::builder().master_address(&addr).protocol(protocol).global_segment_size(0).build().map_err(err)?;
        pool.workers.push(s);
    }
    Ok(pool)
}

/// Pre-faults the nodes' segments (fill 85 %, below the eviction watermark, then
/// free), so that first-touch page faults are not timed as puts.
fn prefault(store: &Store, dram: u64) {
    let chunk = 4u64 << 20;
    let fill = vec![7u8; chunk as usize];
    for i in 0..(dram * 85 / 100) / chunk {
        if store.put(&format!("prefault/{i}"), &fill).is_err() {
            break;
        }
    }
    let _ = store.remove_all();
}

/// Counters and histograms of one worker.
struct WorkerStats {
    fetch: Histogram<u64>,
    fetch_hit: Histogram<u64>,
    get: Histogram<u64>,
    put: Histogram<u64>,
    lag: Histogram<u64>,
    requests: u64,
    blocks: u64,
    hits: u64,
    puts: u64,
    present: u64,
    put_fail: u64,
    get_errors: u64,
    verify_failures: u64,
    first_error: Option<String>,
}

impl WorkerStats {
    fn new() -> Self {
        let h = || Histogram::<u64>::new(3).expect("histogram");
        WorkerStats {
            fetch: h(),
            fetch_hit: h(),
            get: h(),
            put: h(),
            lag: h(),
            requests: 0,
            blocks: 0,
            hits: 0,
            puts: 0,
            present: 0,
            put_fail: 0,
            get_errors: 0,
            verify_failures: 0,
            first_error: None,
        }
    }

    fn merge(&mut self, o: WorkerStats) {
        for (a, b) in [
            (&mut self.fetch, &o.fetch),
            (&mut self.fetch_hit, &o.fetch_hit),
            (&mut self.get, &o.get),
            (&mut self.put, &o.put),
            (&mut self.lag, &o.lag),
        ] {
            a.add(b).ok();
        }
        self.requests += o.requests;
        self.blocks += o.blocks;
        self.hits += o.hits;
        self.puts += o.puts;
        self.present += o.present;
        self.put_fail += o.put_fail;
        self.get_errors += o.get_errors;
        self.verify_failures += o.verify_failures;
        if self.first_error.is_none() {
            self.first_error = o.first_error;
        }
    }
}

/// Serves one request: the prefix fetch, then the puts.
fn serve(store: &Store, run: &str, values: &Values, ids: &[u64], buf: &mut [u8], st: &mut WorkerStats) {
    let block = buf.len();
    let t0 = Instant::now();
    let mut first_miss = ids.len();
    let mut hits = 0u64;
    for (i, &id) in ids.iter().enumerate() {
        let key = format!("{run}/{id}");
        let tg = Instant::now();
        match store.get_into(&key, buf) {
            Ok(n) => {
                st.get.record(tg.elapsed().as_nanos() as u64).ok();
                hits += 1;
                if n != block || !values.check(id, buf) {
                    st.verify_failures += 1;
                }
            }
            Err(e) => {
                if !matches!(e, Error::NotFound(_)) {
                    st.get_errors += 1;
                    st.first_error.get_or_insert_with(|| format!("get {key}: {e}"));
                }
                first_miss = i;
                break;
            }
        }
    }
    let fetch = t0.elapsed().as_nanos() as u64;
    st.fetch.record(fetch).ok();
    if hits > 0 {
        st.fetch_hit.record(fetch).ok();
    }
    st.requests += 1;
    st.blocks += ids.len() as u64;
    st.hits += hits;
    for &id in &ids[first_miss..] {
        let key = format!("{run}/{id}");
        values.fill(id, buf);
        let tp = Instant::now();
        match store.put(&key, buf) {
            Ok(()) => {
                st.put.record(tp.elapsed().as_nanos() as u64).ok();
                st.puts += 1;
            }
            Err(Error::AlreadyExists(_)) => st.present += 1,
            Err(e) => {
                st.put_fail += 1;
                st.first_error.get_or_insert_with(|| format!("put {key}: {e}"));
            }
        }
    }
}

/// Gets served from an SSD (own disk or another client's) by these stores so far.
fn ssd_loads(stores: &[Store]) -> u64 {
    // Local workers are clones of the nodes: count each store once.
    let mut seen = std::collections::HashSet::new();
    stores
        .iter()
        .filter_map(|s| {
            let st = s.stats();
            seen.insert(st.client_id).then(|| st.disk_loads + st.ssd.map_or(0, |d| d.local_loads))
        })
        .sum()
}

fn lat_json(h: &Histogram<u64>) -> serde_json::Value {
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    json!({
        "count": h.len(),
        "p50": us(0.5), "p90": us(0.9), "p99": us(0.99), "p999": us(0.999),
        "mean": h.mean() / 1e3, "max": h.max() as f64 / 1e3,
    })
}

/// `[latency_us, fraction <= it]` points of a histogram's CDF.
pub fn cdf_points(h: &Histogram<u64>) -> Vec<[f64; 2]> {
    let mut qs: Vec<f64> = (0..100).map(|i| i as f64 / 100.0).collect();
    qs.extend([0.995, 0.999, 0.9999, 1.0]);
    qs.into_iter().map(|q| [h.value_at_quantile(q) as f64 / 1e3, q]).collect()
}

/// The simulation of the run: the model (watermarks as the master's) and, for
/// reference, plain LRUs at the full and at the low-watermark capacity.
fn simulation(
    reqs: &[TraceRequest],
    dram_blocks: u64,
    ssd_blocks: u64,
    policy: SsdPolicy,
) -> (SimResult, serde_json::Value) {
    let d = MasterConfig::default();
    let model = SimConfig {
        dram_blocks,
        high_watermark: d.high_watermark,
        low_watermark: d.high_watermark - d.eviction_ratio,
        ssd_blocks,
        ssd_policy: policy,
    };
    let run = |cfg: &SimConfig| simulate(reqs.iter().map(|r| &r.hash_ids[..]), cfg);
    let r = run(&model);
    let full = SimConfig { ssd_blocks, ssd_policy: policy, ..SimConfig::lru(dram_blocks) };
    let low = SimConfig { dram_blocks: (dram_blocks as f64 * model.low_watermark) as u64, ..full.clone() };
    let (rf, rl) = (run(&full), run(&low));
    let v = json!({
        "model": "LRU DRAM evicting above the master's high watermark down to its low watermark; DRAM victims go to the SSD tier (its own policy), SSD hits stay on SSD",
        "config": model,
        "result": r,
        "hit_ratio": r.hit_ratio(), "dram_hit_ratio": r.dram_hit_ratio(), "ssd_hit_ratio": r.ssd_hit_ratio(),
        "variants": {
            "lru_full_capacity": { "dram_blocks": full.dram_blocks, "hit_ratio": rf.hit_ratio() },
            "lru_low_watermark_capacity": { "dram_blocks": low.dram_blocks, "hit_ratio": rl.hit_ratio() },
        },
    });
    (r, v)
}

/// Bytes a block takes in an SSD layout: values are padded to 4 KiB pages; one-file
/// and one-record-per-object layouts add a header page (key and checksum).
fn disk_bytes_per_block(backend: &str, block: u64) -> u64 {
    let page = block.div_ceil(4096) * 4096;
    if backend == "bucket" {
        page
    } else {
        page + 4096
    }
}

/// Runs the `trace` subcommand and writes its JSON; fails on wrong bytes, on
/// errors, or (with `--check-sim`) when replay and simulation disagree.
pub fn run(a: &TraceArgs) -> Result<(), String> {
    let json = trace(a)?;
    crate::write_json(&json, a.out.clone())?;
    let bad = json["verify_failures"].as_u64().unwrap_or(0);
    if bad > 0 {
        return Err(format!("{bad} fetched blocks had wrong bytes"));
    }
    if a.check_sim && !a.sim_only {
        let delta = json["sim_delta_points"].as_f64().unwrap_or(f64::INFINITY);
        if delta.abs() > a.sim_tolerance {
            return Err(format!(
                "replay hit ratio {:.4} vs simulation {:.4}: {delta:+.2} points (tolerance {})",
                json["hit_ratio"].as_f64().unwrap_or(0.0),
                json["sim"]["hit_ratio"].as_f64().unwrap_or(0.0),
                a.sim_tolerance
            ));
        }
    }
    Ok(())
}

/// Replays the trace and returns the report.
pub fn trace(a: &TraceArgs) -> Result<serde_json::Value, String> {
    let block = a.block_tokens * a.bytes_per_token;
    if block == 0 || !block.is_multiple_of(8) {
        return Err(format!("block of {block} bytes: must be a non-zero multiple of 8"));
    }
    let dram = parse_size(&a.dram).map_err(|e| e.to_string())?;
    let ssd = if a.ssd_dir.is_some() { parse_size(&a.ssd_capacity).map_err(|e| e.to_string())? } else { 0 };
    let (_, policy) = ssd_policy(&a.ssd_eviction)?;
    let reqs = load_trace(&a.file, a.max_requests)?;
    if reqs.is_empty() {
        return Err(format!("{}: no requests", a.file.display()));
    }
    if a.sim_only {
        let per_block = disk_bytes_per_block(&a.ssd_backend, block);
        let ssd_blocks = if ssd > 0 { ssd / per_block } else { 0 };
        let (_, sim) = simulation(&reqs, dram / block, ssd_blocks, policy);
        eprintln!("simulation: hit ratio {:.4}", sim["hit_ratio"].as_f64().unwrap_or(0.0));
        return Ok(json!({ "system": "lru-sim", "bench": "trace", "sim": sim }));
    }
    let pool = pool(a, dram, ssd)?;
    prefault(&pool.workers[0], dram);
    let values = Values::new(block as usize);
    // Keys unique to this run: a master given by others may hold older runs' keys.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let run = format!("trace/{}-{nanos}", std::process::id());
    let ssd_before = ssd_loads(&pool.workers);

    let total = reqs.len() as u64;
    let bar = if a.no_progress {
        indicatif::ProgressBar::hidden()
    } else {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests ({eta}) {msg}")
                .map_err(|e| e.to_string())?
                .progress_chars("=> "),
        );
        b
    };
    let (hits_now, blocks_now) = (AtomicU64::new(0), AtomicU64::new(0));
    let (tx, rx) = crossbeam_channel::bounded::<(usize, Instant)>(1024);
    let start = Instant::now();
    let mut stats = WorkerStats::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = pool
            .workers
            .iter()
            .map(|store| {
                let (rx, reqs, values, run, bar) = (rx.clone(), &reqs, &values, &run, &bar);
                let (hits_now, blocks_now) = (&hits_now, &blocks_now);
                s.spawn(move || {
                    let mut st = WorkerStats::new();
                    let mut buf = vec![0u8; block as usize];
                    for (i, due) in rx {
                        st.lag.record(due.elapsed().as_nanos() as u64).ok();
                        let (h0, b0) = (st.hits, st.blocks);
                        serve(store, run, values, &reqs[i].hash_ids, &mut buf, &mut st);
                        let h = hits_now.fetch_add(st.hits - h0, Ordering::Relaxed) + st.hits - h0;
                        let b = blocks_now.fetch_add(st.blocks - b0, Ordering::Relaxed) + st.blocks - b0;
                        bar.inc(1);
                        if i % 64 == 0 {
                            bar.set_message(format!("hit ratio {:.3}", h as f64 / b.max(1) as f64));
                        }
                    }
                    st
                })
            })
            .collect();
        drop(rx);
        let t0 = reqs[0].timestamp;
        for (i, r) in reqs.iter().enumerate() {
            let due = if a.time_scale > 0.0 {
                start + Duration::from_secs_f64(((r.timestamp - t0) / 1e3 / a.time_scale).max(0.0))
            } else {
                Instant::now()
            };
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if tx.send((i, due)).is_err() {
                break;
            }
        }
        drop(tx);
        for h in handles {
            stats.merge(h.join().expect("trace worker"));
        }
    });
    let wall = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let ssd_hits = ssd_loads(&pool.workers) - ssd_before;
    // Bytes one block takes on disk (headers and alignment), measured where the
    // nodes are in this process, else the layouts' known padding.
    let disk_per_block = pool
        .nodes
        .iter()
        .filter_map(|n| n.stats().ssd.map(|s| s.backend))
        .filter(|b| b.objects > 0)
        .map(|b| b.used_bytes / b.objects)
        .max()
        .unwrap_or_else(|| disk_bytes_per_block(&a.ssd_backend, block));
    drop(pool);

    let dram_blocks = dram / block;
    let ssd_blocks = if ssd > 0 { ssd / disk_per_block } else { 0 };
    let (sim, sim_json) = simulation(&reqs, dram_blocks, ssd_blocks, policy);
    let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    let hit_ratio = ratio(stats.hits, stats.blocks);
    let fetched = stats.hits * block;
    let put_bytes = stats.puts * block;
    let busy = |h: &Histogram<u64>| h.mean() * h.len() as f64 / 1e9;
    eprintln!(
        "trace: {} requests, {} blocks of {} B: hit ratio {:.4} (DRAM {:.4}, SSD {:.4}); simulation {:.4} ({:+.2} points); fetch p50 {:.0} us p99 {:.0} us; {:.1} s",
        stats.requests,
        stats.blocks,
        block,
        hit_ratio,
        ratio(stats.hits - ssd_hits.min(stats.hits), stats.blocks),
        ratio(ssd_hits, stats.blocks),
        sim.hit_ratio(),
        (hit_ratio - sim.hit_ratio()) * 100.0,
        stats.fetch.value_at_quantile(0.5) as f64 / 1e3,
        stats.fetch.value_at_quantile(0.99) as f64 / 1e3,
        wall
    );
    Ok(json!({
        "system": "mooncake-rs",
        "bench": "trace",
        "trace": a.file.display().to_string(),
        "params": {
            "transport": a.transport, "nodes": a.nodes, "workers": a.workers,
            "block_bytes": block, "bytes_per_token": a.bytes_per_token, "block_tokens": a.block_tokens,
            "time_scale": a.time_scale, "dram_bytes": dram, "ssd_bytes": ssd,
            "ssd_backend": if ssd > 0 { a.ssd_backend.as_str() } else { "none" },
            "ssd_eviction": a.ssd_eviction, "lease_ms": a.lease_ms, "max_requests": a.max_requests,
            "dram_blocks": dram_blocks, "ssd_blocks": ssd_blocks, "ssd_bytes_per_block": disk_per_block,
        },
        "requests": stats.requests,
        "blocks": stats.blocks,
        "hits": stats.hits,
        "dram_hits": stats.hits - ssd_hits.min(stats.hits),
        "ssd_hits": ssd_hits,
        "hit_ratio": hit_ratio,
        "dram_hit_ratio": ratio(stats.hits - ssd_hits.min(stats.hits), stats.blocks),
        "ssd_hit_ratio": ratio(ssd_hits, stats.blocks),
        "puts": stats.puts,
        "present_after_miss": stats.present,
        "put_failures": stats.put_fail,
        "get_errors": stats.get_errors,
        "verify_failures": stats.verify_failures,
        "first_error": stats.first_error,
        "wall_s": wall,
        "requests_per_s": stats.requests as f64 / wall,
        "fetched_bytes": fetched,
        "put_bytes": put_bytes,
        "fetch_GB_per_s": fetched as f64 / wall / 1e9,
        "put_GB_per_s": put_bytes as f64 / wall / 1e9,
        "get_GB_per_s_busy": fetched as f64 / busy(&stats.get).max(1e-9) / 1e9,
        "put_GB_per_s_busy": put_bytes as f64 / busy(&stats.put).max(1e-9) / 1e9,
        "fetch_latency_us": lat_json(&stats.fetch),
        "fetch_latency_hit_us": lat_json(&stats.fetch_hit),
        "get_block_us": lat_json(&stats.get),
        "put_block_us": lat_json(&stats.put),
        "schedule_lag_ms": {
            "p50": stats.lag.value_at_quantile(0.5) as f64 / 1e6,
            "p99": stats.lag.value_at_quantile(0.99) as f64 / 1e6,
            "max": stats.lag.max() as f64 / 1e6,
        },
        "cdf": cdf_points(&stats.fetch),
        "sim": sim_json,
        "sim_delta_points": (hit_ratio - sim.hit_ratio()) * 100.0,
    }))
}

/// `meta`: the embedded master's metadata rate (target: >= 1 M ops/s, BENCHMARKS.md), one
/// thread, no bytes moved: lookups (`get_replica_list`, which also grants a lease)
/// against 100 k objects, and the full put_start + put_end + lookup + remove cycle
/// (4 calls).
pub fn metadata(secs: f64) -> Result<serde_json::Value, String> {
    use mooncake_core::ReplicateConfig;
    use mooncake_transfer::RemoteRegion;
    let err = |e: Error| e.to_string();
    let master = Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).map_err(err)?;
    let client = master.register_client().map_err(err)?.client;
    for i in 0..16 {
        let region = RemoteRegion { endpoint: format!("bench://{i}"), region: 1 };
        master.mount_segment(client, &region, 64 << 30).map_err(err)?;
    }
    let keys: Vec<String> = (0..100_000).map(|i| format!("bench/prefix/{i:08}")).collect();
    let cfg = ReplicateConfig::default();
    let timed = |f: &mut dyn FnMut(usize)| {
        let start = Instant::now();
        let mut n = 0usize;
        while start.elapsed().as_secs_f64() < secs {
            for _ in 0..1024 {
                f(n);
                n += 1;
            }
        }
        n as f64 / start.elapsed().as_secs_f64()
    };
    let cycle = timed(&mut |i| {
        let key = &keys[i % keys.len()];
        std::hint::black_box(master.put_start(client, key, 1 << 20, &cfg).ok());
        master.put_end(client, key, 7).ok();
        std::hint::black_box(master.get_replica_list(key).ok());
        master.remove(key).ok();
    });
    for key in &keys {
        master.put_start(client, key, 4096, &cfg).map_err(err)?;
        master.put_end(client, key, 7).map_err(err)?;
    }
    let lookups = timed(&mut |i| {
        std::hint::black_box(master.get_replica_list(&keys[i.wrapping_mul(7919) % keys.len()]).ok());
    });
    let exists = timed(&mut |i| {
        std::hint::black_box(master.exists(&keys[i.wrapping_mul(7919) % keys.len()]).ok());
    });
    eprintln!(
        "meta: lookups {:.2} M/s, exists {:.2} M/s, put+end+lookup+remove {:.2} M cycles/s ({:.2} M calls/s)",
        lookups / 1e6,
        exists / 1e6,
        cycle / 1e6,
        cycle * 4.0 / 1e6
    );
    Ok(json!({
        "system": "mooncake-rs", "bench": "meta", "threads": 1, "objects": keys.len(),
        "lookup_ops_per_s": lookups, "exists_ops_per_s": exists,
        "cycle_per_s": cycle, "cycle_calls_per_s": cycle * 4.0,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_differ_per_block_and_check() {
        let v = Values::new(4096);
        let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
        v.fill(1, &mut a);
        v.fill(2, &mut b);
        assert!(v.check(1, &a) && v.check(2, &b));
        assert!(!v.check(2, &a) && !v.check(1, &b));
        // Every word differs between two blocks.
        assert!(a.chunks(8).zip(b.chunks(8)).all(|(x, y)| x != y));
        a[4000] ^= 1;
        assert!(!v.check(1, &a));
    }

    /// The replay agrees with the simulation on a prefix of the real trace, with a
    /// DRAM small enough that eviction matters (DRAM-only, embedded master).
    #[test]
    fn replay_matches_simulation_on_trace_prefix() {
        let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/data/traces/synthetic_trace.jsonl");
        if !file.exists() {
            eprintln!("skipped: {} not found", file.display());
            return;
        }
        let mut a = TraceArgs::new(&file);
        // 4 KiB blocks, the whole trace (122 k blocks, 44 k distinct), DRAM of 4000
        // blocks: about a third of the reuse an unbounded cache would see.
        a.bytes_per_token = 8;
        a.dram = (4000 * 4096).to_string();
        // Paced (1022 s of trace in 6.8 s, ~18 k blocks/s): the master's LRU orders
        // objects by the millisecond of their last access, and a replay at full
        // in-process speed (~300 blocks per ms in release) evicts whole milliseconds
        // at a time and falls ~4 points below an exact LRU.
        a.time_scale = 150.0;
        let json = trace(&a).expect("replay");
        assert_eq!(json["verify_failures"], 0);
        assert_eq!(json["put_failures"], 0);
        let (replay, sim) = (json["hit_ratio"].as_f64().unwrap(), json["sim"]["hit_ratio"].as_f64().unwrap());
        assert!(replay > 0.05, "eviction should leave some hits: {replay}");
        assert!((replay - sim).abs() * 100.0 <= 2.0, "replay {replay:.4} vs simulation {sim:.4}");
    }
}
