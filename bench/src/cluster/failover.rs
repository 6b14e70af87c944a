//! Failover time over repeated `kill -9`s: a cluster of masters, and each round a
//! master leading groups is killed; timed until every group has a live leader again
//! (as the slot map in etcd shows) and until a get of an object of one of its groups
//! succeeds through a client; then a replacement master joins and every object is
//! read back.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use mooncake_core::cluster::{EtcdAddress, SlotMapWatcher};
use mooncake_core::{Error, Store};
use serde_json::{json, Value};

use super::daemons::{Daemon, MasterSpec};
use super::etcd::Etcd;
use super::leaders::{all_led_by, balanced, led_counts, wait_map};
use super::workload::{client_store, key, wait_extents};
use crate::payload;

/// Arguments of `mooncake-bench cluster failover`.
#[derive(clap::Args, Debug)]
pub(crate) struct FailoverArgs {
    /// Masters killed, one per round.
    #[arg(long, default_value_t = 20)]
    kills: usize,
    /// Masters in the cluster (a replacement joins after each kill).
    #[arg(long, default_value_t = 3)]
    masters: usize,
    /// Leadership lease of the masters (ms; etcd's minimum is 2 s).
    #[arg(long, default_value_t = 3000)]
    lease_ttl_ms: u64,
    /// Client TTL of the masters (ms).
    #[arg(long, default_value_t = 10_000)]
    client_ttl_ms: u64,
    /// Objects put before the kills, read back after each round.
    #[arg(long, default_value_t = 1000)]
    objects: u64,
    /// Bytes per object.
    #[arg(long, default_value_t = 4096)]
    object_size: usize,
    /// Segment of the storage node.
    #[arg(long, default_value = "256MiB")]
    segment_size: String,
    /// Use this etcd (`http://H:P`) instead of starting one on loopback.
    #[arg(long)]
    etcd: Option<String>,
    /// JSON output file (stdout if absent).
    #[arg(long)]
    pub(crate) out: Option<PathBuf>,
}

/// The value of object `i` (differs per object, so a mix-up shows).
fn value(i: u64, size: usize) -> Vec<u8> {
    let mut v = payload(size);
    v[..8].copy_from_slice(&i.to_le_bytes());
    v
}

pub(crate) fn failover(a: &FailoverArgs) -> Result<Value, String> {
    if a.masters < 2 || a.objects == 0 || a.object_size < 8 {
        return Err("--masters must be >= 2, --objects > 0 and --object-size >= 8".into());
    }
    let etcd = Etcd::start_or(a.etcd.as_deref())?;
    let name = format!("fail{}", std::process::id());
    let address = etcd.cluster_address(&name);
    let spec = MasterSpec {
        cluster: Some((etcd.endpoint(), &name)),
        core: None,
        lease_ttl_ms: a.lease_ttl_ms,
        client_ttl_ms: a.client_ttl_ms,
    };
    let mut masters: Vec<Daemon> = (0..a.masters).map(|_| Daemon::master(&spec)).collect::<Result<_, _>>()?;
    let live = |ms: &[Daemon]| ms.iter().map(|m| m.addr.clone()).collect::<Vec<_>>();
    let watcher = SlotMapWatcher::connect(&address.parse::<EtcdAddress>().map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let addrs = live(&masters);
    wait_map(&watcher, Duration::from_secs(60), "groups balanced", |m| balanced(m, &addrs))?;
    let groups = watcher.map().groups() as u64;
    let _node = Daemon::node(&address, &a.segment_size)?;
    let store = client_store(&address, groups)?;
    for i in 0..a.objects {
        store.put(&key("fo", i), &value(i, a.object_size)).map_err(|e| format!("put {i}: {e}"))?;
    }
    eprintln!("failover: {} masters, {groups} groups, {} objects of {} B", a.masters, a.objects, a.object_size);

    let mut rows = Vec::new();
    for round in 0..a.kills {
        let map = watcher.map();
        let addrs = live(&masters);
        let counts = led_counts(&map, &addrs);
        // The master leading the most groups (the longest-lived one on a tie).
        let victim = (0..masters.len()).max_by_key(|&i| (counts[i], usize::MAX - i)).ok_or("no master")?;
        let victim_addr = masters[victim].addr.clone();
        let was_scheduler = masters[victim].metric("mooncake_cluster_is_scheduler")? > 0.0;
        let probe = (0..a.objects)
            .map(|j| (j + round as u64 * 7919) % a.objects)
            .find(|&i| map.leader_of_key(&key("fo", i)).is_some_and(|l| l.addr == victim_addr))
            .ok_or("no object in the victim's groups")?;
        let expected = value(probe, a.object_size);

        let t0 = Instant::now();
        masters[victim].kill9()?;
        drop(masters.remove(victim));
        let survivors = live(&masters);
        let (led, got) = std::thread::scope(|s| {
            let getter = s.spawn(|| get_until_ok(&store, &key("fo", probe), &expected, t0));
            let led = wait_map(&watcher, Duration::from_secs(60), "every group led by a live master", |m| {
                all_led_by(m, &survivors)
            })
            .map(|_| t0.elapsed());
            (led, getter.join().expect("get thread"))
        });
        let (led, (got, get_errors)) = (led?, got?);

        // A replacement joins; the groups rebalance and every object must read back.
        let t1 = Instant::now();
        masters.push(Daemon::master(&spec)?);
        let addrs = live(&masters);
        wait_map(&watcher, Duration::from_secs(60), "groups balanced after the join", |m| balanced(m, &addrs))?;
        wait_extents(&store, groups)?;
        let rebalanced = t1.elapsed();
        let (lost, wrong) = read_back(&store, a)?;
        eprintln!(
            "  kill {round:>2}: {} groups{}; all led after {:>5.0} ms, probe get ok after {:>5.0} ms; rejoin {:>5.0} ms; lost {lost}, wrong {wrong}",
            counts[victim],
            if was_scheduler { " (scheduler)" } else { "" },
            led.as_secs_f64() * 1e3,
            got.as_secs_f64() * 1e3,
            rebalanced.as_secs_f64() * 1e3
        );
        rows.push(json!({
            "round": round, "victim_groups": counts[victim], "victim_was_scheduler": was_scheduler,
            "all_led_ms": led.as_secs_f64() * 1e3, "get_ok_ms": got.as_secs_f64() * 1e3,
            "get_errors_before_ok": get_errors,
            "rejoin_balanced_ms": rebalanced.as_secs_f64() * 1e3,
            "objects_lost": lost, "objects_wrong": wrong,
        }));
    }
    let stat = |field: &str| {
        let mut v: Vec<f64> = rows.iter().filter_map(|r| r[field].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        let p50 = if v.is_empty() { f64::NAN } else { v[(v.len() - 1) / 2] };
        json!({ "p50": p50, "max": v.last().copied().unwrap_or(f64::NAN), "min": v.first().copied().unwrap_or(f64::NAN) })
    };
    let summary = json!({
        "all_led_ms": stat("all_led_ms"), "get_ok_ms": stat("get_ok_ms"),
        "objects_lost": rows.iter().filter_map(|r| r["objects_lost"].as_u64()).sum::<u64>(),
        "objects_wrong": rows.iter().filter_map(|r| r["objects_wrong"].as_u64()).sum::<u64>(),
    });
    eprintln!("failover over {} kills: {summary}", rows.len());
    Ok(json!({
        "system": "mooncake-rs", "bench": "cluster-failover",
        "masters": a.masters, "groups": groups, "lease_ttl_ms": a.lease_ttl_ms, "client_ttl_ms": a.client_ttl_ms,
        "objects": a.objects, "object_size": a.object_size, "kills": rows.len(),
        "summary": summary, "rounds": rows,
    }))
}

/// Gets `key` until it returns `expected`; the time since `t0` and how many gets
/// failed first (each get itself retries moves for up to 15 s).
fn get_until_ok(store: &Store, key: &str, expected: &[u8], t0: Instant) -> Result<(Duration, u64), String> {
    let mut errors = 0;
    loop {
        match store.get(key) {
            Ok(v) if v[..] == *expected => return Ok((t0.elapsed(), errors)),
            Ok(_) => return Err(format!("{key} read back other bytes after a failover")),
            Err(e) if t0.elapsed() < Duration::from_secs(60) => {
                errors += 1;
                if !e.is_retryable() && !matches!(e, Error::NotFound(_)) {
                    eprintln!("  get {key}: {e}");
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(format!("{key} not readable 60 s after the kill: {e}")),
        }
    }
}

/// Reads every object back: (missing, wrong bytes).
fn read_back(store: &Store, a: &FailoverArgs) -> Result<(u64, u64), String> {
    let (mut lost, mut wrong) = (0, 0);
    for i in 0..a.objects {
        match store.get(&key("fo", i)) {
            Ok(v) if v[..] == value(i, a.object_size)[..] => {}
            Ok(_) => wrong += 1,
            Err(Error::NotFound(_)) => lost += 1,
            Err(e) => return Err(format!("get {i} after a failover: {e}")),
        }
    }
    Ok((lost, wrong))
}
