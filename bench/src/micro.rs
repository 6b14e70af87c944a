//! `micro`: put / get / batch operations for a range of sizes, over each transport,
//! with one and several client threads; p50/p99/p999 per call.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mooncake_core::{parse_size, Master, MasterConfig, Protocol, ReplicateConfig, Store};
use serde::Serialize;

use crate::{payload, sibling, spawn, Child2};

thread_local! {
    static READ_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One measured phase.
#[derive(Serialize, Debug)]
pub struct MicroRow {
    system: &'static str,
    mode: String,
    api: &'static str,
    size: u64,
    batch: u64,
    threads: usize,
    items: u64,
    fail: u64,
    wall_s: f64,
    ops_per_s: f64,
    #[serde(rename = "GB_per_s")]
    gb_per_s: f64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
}

/// A pool to measure against: the stores of the client threads, and what keeps the
/// pool alive (an embedded master, or the master and node processes).
pub(crate) struct Pool {
    pub(crate) clients: Vec<Store>,
    _node: Option<Store>,
    _children: Vec<Child2>,
}

/// The stores first, then the processes in the reverse of their start: a storage
/// node told to stop drains through its master, which must still be there (else it
/// tries for its whole drain grace, 30 s).
impl Drop for Pool {
    fn drop(&mut self) {
        self.clients.clear();
        self._node = None;
        while let Some(child) = self._children.pop() {
            drop(child);
        }
    }
}

/// The client protocol of a transport name (`tcp`, `shm`, `rdma`).
pub(crate) fn protocol(transport: &str) -> Result<Protocol, String> {
    match transport {
        "tcp" => Ok(Protocol::Tcp),
        "shm" => Ok(Protocol::Shm),
        "rdma" => Ok(Protocol::Rdma),
        other => Err(format!("unknown transport {other}")),
    }
}

/// A master and one node with a pre-faulted segment of `segment` bytes, and
/// `threads` clients that give no memory (`local`: all in this process), timing
/// their calls phase by phase with `phase_times`.
pub(crate) fn pool(transport: &str, threads: usize, segment: u64, phase_times: bool) -> Result<Pool, String> {
    let err = |e: mooncake_core::Error| e.to_string();
    if transport == "local" {
        let master = Master::new(MasterConfig::default()).map_err(err)?;
        let node = Store::builder().master(&master).global_segment_size(segment).build().map_err(err)?;
        let clients: Vec<Store> = (0..threads)
            .map(|_| {
                Store::builder().master(&master).phase_times(phase_times).global_segment_size(0).build().map_err(err)
            })
            .collect::<Result<_, _>>()?;
        prefault(&clients[0], segment);
        return Ok(Pool { clients, _node: Some(node), _children: Vec::new() });
    }
    let protocol = protocol(transport)?;
    let m = spawn(sibling("mooncake-master"), &["--listen", "127.0.0.1:0"])?;
    let addr = m.1.rsplit(' ').next().unwrap_or_default().to_owned();
    let size = segment.to_string();
    let node = spawn(
        sibling("mooncake-client"),
        &["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", &size],
    )?;
    let clients = (0..threads)
        .map(|_| {
            let b = Store::builder().master_address(&addr).protocol(protocol).phase_times(phase_times);
            b.global_segment_size(0).build().map_err(err)
        })
        .collect::<Result<Vec<_>, _>>()?;
    prefault(&clients[0], segment);
    Ok(Pool { clients, _node: None, _children: vec![m, node] })
}

/// Pre-faults the node's segment (fill 85 %, free), as the reference bench does:
/// the first touch of a page costs microseconds and would dominate early puts.
fn prefault(store: &Store, segment: u64) {
    let fill = payload(4 << 20);
    for i in 0..(segment * 85 / 100) / (4 << 20) {
        if store.put(&format!("prefault/{i}"), &fill).is_err() {
            break;
        }
    }
    let _ = store.remove_all();
}

/// Runs `op(thread, i)` for `per_thread` items on every client thread; one latency
/// sample per call (a call moves `batch` items).
fn phase(
    pool: &Pool,
    per_thread: usize,
    batch: usize,
    op: impl Fn(&Store, usize, usize) -> usize + Sync,
) -> (Histogram<u64>, u64, Duration) {
    let start = Instant::now();
    let results: Vec<(Histogram<u64>, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = pool
            .clients
            .iter()
            .enumerate()
            .map(|(t, store)| {
                let op = &op;
                s.spawn(move || {
                    let mut h = Histogram::<u64>::new(3).expect("histogram");
                    let mut fail = 0u64;
                    for i in (0..per_thread).step_by(batch) {
                        let t0 = Instant::now();
                        fail += op(store, t, i) as u64;
                        h.record(t0.elapsed().as_nanos() as u64).ok();
                    }
                    (h, fail)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread")).collect()
    });
    let wall = start.elapsed();
    let mut all = Histogram::<u64>::new(3).expect("histogram");
    let mut fail = 0;
    for (h, f) in results {
        all.add(h).ok();
        fail += f;
    }
    (all, fail, wall)
}

#[allow(clippy::too_many_arguments)]
fn row(
    mode: &str,
    api: &'static str,
    size: u64,
    batch: usize,
    threads: usize,
    items: u64,
    h: &Histogram<u64>,
    fail: u64,
    wall: Duration,
) -> MicroRow {
    let w = wall.as_secs_f64();
    MicroRow {
        system: "mooncake-rs",
        mode: mode.to_owned(),
        api,
        size,
        batch: batch as u64,
        threads,
        items,
        fail,
        wall_s: w,
        ops_per_s: items as f64 / w,
        gb_per_s: items as f64 * size as f64 / w / 1e9,
        p50_us: h.value_at_quantile(0.50) as f64 / 1e3,
        p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
        p999_us: h.value_at_quantile(0.999) as f64 / 1e3,
    }
}

/// The whole `micro` run.
pub fn micro(
    transports: &str,
    sizes: &str,
    threads: &str,
    batch: usize,
    phase_bytes: &str,
) -> Result<Vec<MicroRow>, String> {
    let phase_bytes = parse_size(phase_bytes).map_err(|e| e.to_string())?;
    let sizes: Vec<u64> =
        sizes.split(',').map(|s| parse_size(s).map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let threads: Vec<usize> =
        threads.split(',').map(|t| t.trim().parse::<usize>().map_err(|e| e.to_string())).collect::<Result<_, _>>()?;
    let batch = batch.max(1);
    let segment = 2u64 << 30;
    let mut rows = Vec::new();
    for transport in transports.split(',') {
        for &n in &threads {
            let pool = pool(transport, n.max(1), segment, false)?;
            for &size in &sizes {
                // Items per thread: the phase's bytes split over the threads, and
                // never more than 85 % of the segment in flight.
                let total = (phase_bytes / size).clamp(64, 4000).min(segment * 85 / 100 / size);
                let per_thread = (total as usize / n.max(1)).max(batch);
                let items = (per_thread * n.max(1)) as u64;
                let value = payload(size as usize);
                let key = |t: usize, i: usize| format!("micro/{transport}/{size}/{t}/{i}");
                let (h, f, w) = phase(&pool, per_thread, 1, |s, t, i| s.put(&key(t, i), &value).is_err() as usize);
                rows.push(row(transport, "put", size, 1, n, items, &h, f, w));
                let (h, f, w) = phase(&pool, per_thread, 1, |s, t, i| {
                    // One reused destination per thread, as a server reuses its buffers.
                    READ_BUF.with(|b| {
                        let mut b = b.borrow_mut();
                        if b.len() < size as usize {
                            b.resize(size as usize, 0);
                        }
                        s.get_into(&key(t, i), &mut b[..size as usize]).is_err() as usize
                    })
                });
                rows.push(row(transport, "get_into", size, 1, n, items, &h, f, w));
                let (h, f, w) = phase(&pool, per_thread, batch, |s, t, i| {
                    let keys: Vec<String> = (i..(i + batch).min(per_thread)).map(|j| key(t, j)).collect();
                    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                    s.batch_get(&refs).iter().filter(|r| r.is_err()).count()
                });
                rows.push(row(transport, "batch_get", size, batch, n, items, &h, f, w));
                std::thread::sleep(Duration::from_millis(20));
                let _ = pool.clients[0].remove_all();
                let bkeys: Vec<String> = (0..per_thread).map(|i| format!("micro-b/{transport}/{size}/{i}")).collect();
                let (h, f, w) = phase(&pool, per_thread, batch, |s, t, i| {
                    let names: Vec<String> =
                        (i..(i + batch).min(per_thread)).map(|j| format!("{}/{t}", bkeys[j])).collect();
                    let items: Vec<(&str, &[u8])> = names.iter().map(|k| (k.as_str(), &value[..])).collect();
                    s.batch_put(&items, &ReplicateConfig::default()).iter().filter(|r| r.is_err()).count()
                });
                rows.push(row(transport, "batch_put", size, batch, n, items, &h, f, w));
                std::thread::sleep(Duration::from_millis(20));
                let _ = pool.clients[0].remove_all();
                let last = &rows[rows.len() - 4..];
                eprintln!(
                    "{transport:>5} {size:>9} B x{n} threads: put {:.2} GB/s p99 {:.0} us | get_into {:.2} GB/s p99 {:.0} us | batch_get {:.2} GB/s | batch_put {:.2} GB/s",
                    last[0].gb_per_s, last[0].p99_us, last[1].gb_per_s, last[1].p99_us, last[2].gb_per_s, last[3].gb_per_s
                );
            }
        }
    }
    Ok(rows)
}
