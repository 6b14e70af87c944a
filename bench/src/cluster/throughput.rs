//! Metadata ops/s of a cluster with 1, 2, ... masters, each master pinned to its own
//! core, driven by pipelined batch clients: several threads of this process, each
//! with its own batch calls in flight, through the cluster's router (`Store::master`).
//! Each row also reports the client's CPU time per object (`client_cpu_us_per_op`):
//! the router's cost, which must not grow with the number of masters.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mooncake_core::cluster::{EtcdAddress, SlotMapWatcher};
use mooncake_core::{ClientId, MasterApi};
use serde_json::{json, Value};

use super::daemons::{core_ticks, cpu_seconds, load_average, Daemon, MasterSpec};
use super::etcd::Etcd;
use super::leaders::{balanced, wait_map};
use super::workload::{client_store, key, put_batch, Rng};

/// Arguments of `mooncake-bench cluster throughput`.
#[derive(clap::Args, Debug)]
pub(crate) struct ThroughputArgs {
    /// Master counts measured, one fresh cluster each.
    #[arg(long, default_value = "1,2")]
    masters: String,
    /// Cores the masters are pinned to (`taskset -c`), master i on the i-th; "none"
    /// leaves them unpinned.
    #[arg(long, default_value = "0,1")]
    cores: String,
    /// Client threads (each with one batch call in flight at a time).
    #[arg(long, default_value_t = 8)]
    threads: usize,
    /// Keys per batch call.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Seconds per measured phase.
    #[arg(long, default_value_t = 5.0)]
    secs: f64,
    /// Rounds: each starts a fresh cluster per master count; the summary takes the
    /// median over them.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Objects the lookups choose among (put before them, by the put phase and,
    /// if it put fewer, untimed puts after it).
    #[arg(long, default_value_t = 200_000)]
    keys: u64,
    /// Bytes each object reserves in the node's segment.
    #[arg(long, default_value_t = 64)]
    object_size: u64,
    /// Segment of the storage node (cut into one extent per slot group).
    #[arg(long, default_value = "1GiB")]
    segment_size: String,
    /// Use this etcd (`http://H:P`) instead of starting one on loopback.
    #[arg(long)]
    etcd: Option<String>,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
}

/// The calls measured, in the order of the phases.
const APIS: [&str; 3] = ["put", "batch_get_replica_list", "batch_exists"];

/// The processes whose CPU use a phase reports.
struct Pids {
    masters: Vec<u32>,
    node: u32,
}

/// A cluster ready to measure: its masters, a storage node with every extent
/// mounted, and a client.
struct Bench {
    api: Arc<dyn MasterApi>,
    client: ClientId,
    pids: Pids,
}

pub(crate) fn throughput(a: &ThroughputArgs) -> Result<Value, String> {
    let counts: Vec<usize> = a
        .masters
        .split(',')
        .map(|n| n.trim().parse().map_err(|e| format!("--masters {n}: {e}")))
        .collect::<Result<_, _>>()?;
    let cores: Vec<usize> = if a.cores == "none" {
        Vec::new()
    } else {
        a.cores
            .split(',')
            .map(|c| c.trim().parse().map_err(|e| format!("--cores {c}: {e}")))
            .collect::<Result<_, _>>()?
    };
    if a.batch == 0 || a.threads == 0 || a.keys == 0 {
        return Err("--batch, --threads and --keys must be positive".into());
    }
    let load_before = load_average();
    let etcd = Etcd::start_or(a.etcd.as_deref())?;
    // Counts alternate within each round, so that a drift of the host's other load
    // weighs on every count alike.
    let mut runs = Vec::new();
    for round in 0..a.rounds.max(1) {
        for &n in &counts {
            let mut run = one_cluster(a, &etcd, n, &cores, round)?;
            run["round"] = json!(round);
            runs.push(run);
        }
    }
    // Per count and call: the median over the rounds; each count against the first.
    let median_of = |n: usize, api: &str, field: &str| {
        let mut v: Vec<f64> = runs
            .iter()
            .filter(|r| r["masters"].as_u64() == Some(n as u64))
            .flat_map(|r| r["rows"].as_array().cloned().unwrap_or_default())
            .filter(|row| row["api"].as_str() == Some(api))
            .filter_map(|row| row[field].as_f64())
            .collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            f64::NAN
        } else {
            v[v.len() / 2]
        }
    };
    let mut summary = Vec::new();
    for api in APIS {
        for &n in &counts {
            let base = counts[0];
            let ops = median_of(n, api, "ops_per_s");
            let per_cpu = median_of(n, api, "ops_per_master_cpu_s");
            let client_us = median_of(n, api, "client_cpu_us_per_op");
            summary.push(json!({
                "api": api, "masters": n,
                "ops_per_s": ops,
                "ops_per_master_cpu_s": per_cpu,
                "master_cpu_cores_total": median_of(n, api, "master_cpu_cores_total"),
                "client_cpu_us_per_op": client_us,
                "ratio_vs_first": ops / median_of(base, api, "ops_per_s"),
                "ops_per_master_cpu_s_ratio_vs_first": per_cpu / median_of(base, api, "ops_per_master_cpu_s"),
                "client_cpu_us_per_op_ratio_vs_first": client_us / median_of(base, api, "client_cpu_us_per_op"),
            }));
        }
    }
    Ok(json!({
        "system": "mooncake-rs", "bench": "cluster-throughput",
        "host_cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "load_average_before": load_before, "load_average_after": load_average(),
        "threads": a.threads, "batch": a.batch, "secs": a.secs, "keys": a.keys, "object_size": a.object_size,
        "rounds": a.rounds.max(1),
        "summary": summary,
        "runs": runs,
    }))
}

/// Starts a cluster of `n` masters, measures it, stops it.
fn one_cluster(a: &ThroughputArgs, etcd: &Etcd, n: usize, cores: &[usize], round: usize) -> Result<Value, String> {
    let name = format!("tput{}m{n}r{round}", std::process::id());
    let address = etcd.cluster_address(&name);
    let mut masters = Vec::new();
    for i in 0..n {
        let core = if cores.is_empty() { None } else { Some(cores[i % cores.len()]) };
        let spec =
            MasterSpec { cluster: Some((etcd.endpoint(), &name)), core, lease_ttl_ms: 3000, client_ttl_ms: 10_000 };
        masters.push(Daemon::master(&spec)?);
    }
    let live: Vec<String> = masters.iter().map(|m| m.addr.clone()).collect();
    let watcher = SlotMapWatcher::connect(&address.parse::<EtcdAddress>().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    wait_map(&watcher, Duration::from_secs(60), "groups balanced over the masters", |m| balanced(m, &live))?;
    let groups = watcher.map().groups() as u64;
    let node = Daemon::node(&address, &a.segment_size)?;
    // Every extent of the node mounted with its group's leader.
    let store = client_store(&address, groups)?;
    let api = store.master().clone();
    let bench = Bench {
        api,
        client: store.client_id(),
        pids: Pids { masters: masters.iter().map(Daemon::pid).collect(), node: node.pid() },
    };
    eprintln!("cluster of {n} master(s) on cores {:?}: {groups} groups, node mounted", &cores[..n.min(cores.len())]);
    let rows = phases(a, &bench)?;
    drop(bench);
    drop(store);
    drop(node);
    drop(masters);
    Ok(json!({
        "masters": n,
        "master_cores": if cores.is_empty() { json!("unpinned") } else { json!((0..n).map(|i| cores[i % cores.len()]).collect::<Vec<_>>()) },
        "groups": groups,
        "rows": rows,
    }))
}

/// The put phase, then lookups and exists on the keys put.
fn phases(a: &ThroughputArgs, b: &Bench) -> Result<Vec<Value>, String> {
    let next = AtomicU64::new(0);
    let put = |_: usize, _: &mut Rng| {
        let first = next.fetch_add(a.batch as u64, Ordering::Relaxed);
        let keys: Vec<String> = (first..first + a.batch as u64).map(|i| key("cb", i)).collect();
        (a.batch as u64, 2, put_batch(&b.api, b.client, &keys, a.object_size))
    };
    // Warm-up: connections opened, first allocations made.
    for _ in 0..a.threads {
        put(0, &mut Rng::new(0));
    }
    let mut rows = vec![phase(APIS[0], a, b, &put)?];
    // The lookups choose among `keys` objects: put the rest untimed.
    std::thread::scope(|s| {
        for _ in 0..a.threads {
            s.spawn(|| {
                while next.load(Ordering::Relaxed) < a.keys {
                    put(0, &mut Rng::new(0));
                }
            });
        }
    });
    let batch_keys = |rng: &mut Rng| -> Vec<String> { (0..a.batch).map(|_| key("cb", rng.below(a.keys))).collect() };
    rows.push(phase(APIS[1], a, b, &|_, rng: &mut Rng| {
        let keys = batch_keys(rng);
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let fail = b.api.batch_get_replica_list(&refs).iter().filter(|r| r.is_err()).count();
        (a.batch as u64, 1, fail as u64)
    })?);
    rows.push(phase(APIS[2], a, b, &|_, rng: &mut Rng| {
        let keys = batch_keys(rng);
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let fail = b.api.batch_exists(&refs).iter().filter(|r| !matches!(r, Ok(true))).count();
        (a.batch as u64, 1, fail as u64)
    })?);
    Ok(rows)
}

/// Runs `op` on every client thread for `secs`; `op` returns (items, RPC calls,
/// failed items). One row: items/s, latency per op (one batch), the CPU each process
/// used meanwhile, in cores, and how busy each core of the host was (a master using
/// less than its core while that core was fully busy was starved, not idle).
fn phase(
    api: &str,
    a: &ThroughputArgs,
    b: &Bench,
    op: &(dyn Fn(usize, &mut Rng) -> (u64, u64, u64) + Sync),
) -> Result<Value, String> {
    let me = std::process::id();
    let cpu_before: Vec<f64> =
        b.pids.masters.iter().chain([&b.pids.node, &me]).map(|&p| cpu_seconds(p)).collect::<Result<_, _>>()?;
    let cores_before = core_ticks()?;
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(a.secs);
    let per_thread: Vec<(Histogram<u64>, u64, u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..a.threads)
            .map(|t| {
                s.spawn(move || {
                    let mut rng = Rng::new(t as u64 + 1);
                    let mut hist = Histogram::<u64>::new(3).expect("histogram");
                    let (mut items, mut calls, mut fail) = (0, 0, 0);
                    while Instant::now() < deadline {
                        let t0 = Instant::now();
                        let (i, c, f) = op(t, &mut rng);
                        hist.record(t0.elapsed().as_nanos() as u64).ok();
                        items += i;
                        calls += c;
                        fail += f;
                    }
                    (hist, items, calls, fail)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("client thread")).collect()
    });
    let wall = start.elapsed().as_secs_f64();
    let cpu_after: Vec<f64> =
        b.pids.masters.iter().chain([&b.pids.node, &me]).map(|&p| cpu_seconds(p)).collect::<Result<_, _>>()?;
    let used: Vec<f64> = cpu_before.iter().zip(&cpu_after).map(|(x, y)| (y - x) / wall).collect();
    let core_busy: Vec<f64> = cores_before
        .iter()
        .zip(core_ticks()?)
        .map(|((b0, t0), (b1, t1))| (b1 - b0) as f64 / (t1 - t0).max(1) as f64)
        .collect();
    let n = b.pids.masters.len();
    let mut hist = Histogram::<u64>::new(3).map_err(|e| e.to_string())?;
    let (mut items, mut calls, mut fail) = (0, 0, 0);
    for (h, i, c, f) in &per_thread {
        hist.add(h).map_err(|e| e.to_string())?;
        items += i;
        calls += c;
        fail += f;
    }
    let ops = items as f64 / wall;
    let master_cpu: f64 = used[..n].iter().sum();
    // What the client (this process: the router and the RPC client) spends per
    // object: the figure that must not grow with the number of masters.
    let client_us_per_op = used[n + 1] * 1e6 / ops.max(1e-9);
    eprintln!(
        "  {api:<24} {:>10.0} ops/s  p50 {:>7.0} us/batch  masters' CPU {:?} cores (cores busy {:?}), node {:.2}, clients {:.2} ({:.2} us/op)",
        ops,
        hist.value_at_quantile(0.5) as f64 / 1000.0,
        used[..n].iter().map(|c| (c * 100.0).round() / 100.0).collect::<Vec<_>>(),
        core_busy.iter().map(|c| (c * 100.0).round() / 100.0).collect::<Vec<_>>(),
        used[n],
        used[n + 1],
        client_us_per_op
    );
    Ok(json!({
        "api": api, "items": items, "calls": calls, "fail": fail, "wall_s": wall,
        "ops_per_s": ops, "calls_per_s": calls as f64 / wall,
        "batch_p50_us": hist.value_at_quantile(0.5) as f64 / 1000.0,
        "batch_p99_us": hist.value_at_quantile(0.99) as f64 / 1000.0,
        "master_cpu_cores": &used[..n], "master_cpu_cores_total": master_cpu, "host_core_busy": core_busy,
        "node_cpu_cores": used[n], "client_cpu_cores": used[n + 1], "client_cpu_us_per_op": client_us_per_op,
        "load_average_after": load_average(),
        "ops_per_master_cpu_s": ops / master_cpu.max(1e-9),
    }))
}
