//! Issue 21, finding 7: the master's metrics listener. A crowd of idle connections
//! sending half a `GET`, under `ulimit -n 1024`, used to exhaust the master's
//! descriptors and panic its HTTP accept thread (then RPC clients failed too); a
//! master out of descriptors lost `/metrics` for good. And `/metrics` walked the whole
//! index; its numbers now come from totals kept as objects change, which must stay
//! exactly those of a walk.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use mooncake_core::rpc::wire::{encode_frame, FrameKind, Request};
use mooncake_core::{Master, MasterConfig, ReplicateConfig, Store};
use support::{bin, payload, unique_dir};

/// A `mooncake-master` under `ulimit -n 1024`, its stderr kept in a file.
struct LimitedMaster {
    child: Child,
    rpc: String,
    metrics: String,
    stderr: PathBuf,
    /// Kept open: the master never writes into a closed pipe.
    _stdout: BufReader<ChildStdout>,
}

impl LimitedMaster {
    fn start() -> Self {
        let dir = unique_dir("trust-metrics");
        let stderr = dir.join("master.stderr");
        let mut child = Command::new("sh")
            .args(["-c", "ulimit -n 1024 && exec \"$0\" \"$@\""])
            .arg(bin("mooncake-master"))
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut addr = || {
            let mut line = String::new();
            stdout.read_line(&mut line).unwrap();
            assert!(!line.is_empty(), "the master exited: {}", std::fs::read_to_string(&stderr).unwrap_or_default());
            line.trim().rsplit(' ').next().unwrap().to_owned()
        };
        let (rpc, metrics) = (addr(), addr());
        let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
        assert!(
            limits.lines().any(|l| l.starts_with("Max open files") && l.split_whitespace().nth(3) == Some("1024")),
            "{limits}"
        );
        LimitedMaster { child, rpc, metrics, stderr, _stdout: stdout }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// Descriptors the master holds now.
    fn descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.child.id())).map_or(0, |d| d.count())
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The master is alive and logged no panic.
    fn assert_healthy(&mut self) {
        assert!(self.alive(), "the master exited: {}", self.stderr());
        let log = self.stderr();
        assert!(!log.contains("panicked"), "the master panicked: {log}");
    }

    /// A store (its own 16 MiB segment) talking to the master over RPC.
    fn store(&self) -> Store {
        Store::builder().master_address(&self.rpc).global_segment_size(16 << 20).build().unwrap()
    }
}

impl Drop for LimitedMaster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = self.stderr.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// One `GET` of `path` (no retry), waiting at most `limit` for the whole answer;
/// (status code, body).
fn get_once(addr: &str, path: &str, limit: Duration) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr.parse().unwrap(), limit)?;
    s.set_read_timeout(Some(limit))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

/// `/metrics`, which must answer 200 within `limit` (retried meanwhile).
fn metrics_within(addr: &str, limit: Duration) -> String {
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < limit {
        match get_once(addr, "/metrics", Duration::from_secs(2)) {
            Ok((200, body)) => return body,
            other => last = format!("{other:?}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("/metrics not served within {limit:?}: {last}");
}

/// The value of metric `name` in Prometheus text.
fn metric(text: &str, name: &str) -> u64 {
    let line = text.lines().find(|l| l.split(' ').next() == Some(name)).unwrap_or_else(|| panic!("no {name}: {text}"));
    line.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64
}

/// Raises this process's soft descriptor limit to its hard one (the tests hold more
/// than a thousand sockets).
fn raise_fd_limit() {
    let pid = std::process::id().to_string();
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let hard = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
        .unwrap();
    let _ = Command::new("prlimit").args(["--pid", &pid, &format!("--nofile={hard}:")]).status();
}

/// A put and a get through the master's RPC listener, each within 5 s.
fn rpc_round_trip(store: &Store, key: &str, seed: u8) {
    let value = payload(seed, 100_000);
    let start = Instant::now();
    store.put(key, &value).unwrap();
    assert_eq!(&store.get(key).unwrap()[..], &value[..]);
    assert!(start.elapsed() < Duration::from_secs(5), "RPC took {:?}", start.elapsed());
}

#[test]
fn a_thousand_half_requests_under_ulimit_1024_leave_metrics_and_rpc_served() {
    raise_fd_limit();
    let mut m = LimitedMaster::start();
    let store = m.store();
    rpc_round_trip(&store, "before", 1);
    let idle: Vec<TcpStream> = (0..1000)
        .filter_map(|_| {
            let mut s = TcpStream::connect_timeout(&m.metrics.parse().unwrap(), Duration::from_secs(2)).ok()?;
            // Half a request, never finished (the master may close it first).
            let _ = s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n");
            Some(s)
        })
        .collect();
    assert_eq!(idle.len(), 1000);
    // While they are open: the master holds a bounded number of them, and serves
    // both listeners.
    std::thread::sleep(Duration::from_millis(200));
    assert!(m.descriptors() < 200, "the master holds {} descriptors", m.descriptors());
    let text = metrics_within(&m.metrics, Duration::from_secs(3));
    assert!(metric(&text, "mooncake_http_open_connections") <= 64, "{text}");
    assert!(metric(&text, "mooncake_http_evicted_total") >= 900, "{text}");
    rpc_round_trip(&store, "during", 2);
    // A new RPC client too (kept: its segment holds objects).
    let newcomer = m.store();
    rpc_round_trip(&newcomer, "new-client", 3);
    m.assert_healthy();
    drop(idle);
    let text = metrics_within(&m.metrics, Duration::from_secs(3));
    assert_eq!(metric(&text, "mooncake_objects"), 3, "{text}");
    rpc_round_trip(&store, "after", 4);
    m.assert_healthy();
}

#[test]
fn a_half_request_is_dropped_after_a_few_seconds() {
    let mut m = LimitedMaster::start();
    let mut s = TcpStream::connect(&m.metrics).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 64];
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "closed without an answer");
    let waited = start.elapsed();
    assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(6), "{waited:?}");
    let text = metrics_within(&m.metrics, Duration::from_secs(3));
    assert_eq!(metric(&text, "mooncake_http_timeouts_total"), 1, "{text}");
    m.assert_healthy();
}

#[test]
fn a_master_out_of_descriptors_keeps_its_metrics_listener() {
    raise_fd_limit();
    let mut m = LimitedMaster::start();
    // Client connections to the RPC listener, each past its hello (one request sent,
    // its answer left unread): the master keeps them until it has no descriptor left.
    // (Connections still in their handshake it caps at 512, closing the oldest, so
    // silent sockets no longer fill it: `trust_auth.rs`.)
    let request = encode_frame(FrameKind::Request, 1, &Request::Stats {}).unwrap();
    let mut hogs: Vec<TcpStream> = Vec::new();
    let mut refused = None;
    let start = Instant::now();
    while m.descriptors() < 1020 && start.elapsed() < Duration::from_secs(30) {
        for _ in 0..100 {
            match TcpStream::connect_timeout(&m.rpc.parse().unwrap(), Duration::from_secs(2)) {
                Ok(mut s) => {
                    let _ = s.write_all(&request);
                    hogs.push(s);
                }
                Err(e) => refused = Some(e),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        m.descriptors() >= 1020,
        "the master holds only {} descriptors after {} connections in {:?} (last connect error: {refused:?}): {}",
        m.descriptors(),
        hogs.len(),
        start.elapsed(),
        m.stderr().lines().rev().take(10).collect::<Vec<_>>().join("\n")
    );
    // Meanwhile the metrics listener cannot accept: whatever a client gets, it is not
    // kept waiting past its own timeout.
    for _ in 0..3 {
        let start = Instant::now();
        let _ = get_once(&m.metrics, "/metrics", Duration::from_secs(2));
        assert!(start.elapsed() < Duration::from_secs(3));
    }
    m.assert_healthy();
    drop(hogs);
    // Once descriptors are free again, both listeners serve.
    let text = metrics_within(&m.metrics, Duration::from_secs(10));
    assert!(metric(&text, "mooncake_http_accept_failures_total") >= 1, "the listener never ran out: {text}");
    rpc_round_trip(&m.store(), "after", 5);
    m.assert_healthy();
}

#[test]
fn metrics_track_puts_and_removes_exactly() {
    let mut m = LimitedMaster::start();
    let store = m.store();
    let len = |i: usize| 1_000 + i * 37;
    let check = |objects: u64, bytes: u64| {
        let text = metrics_within(&m.metrics, Duration::from_secs(3));
        assert_eq!(metric(&text, "mooncake_objects"), objects, "{text}");
        assert_eq!(metric(&text, "mooncake_object_bytes"), bytes, "{text}");
        assert_eq!(metric(&text, "mooncake_replicas"), objects, "{text}");
        assert!(metric(&text, "mooncake_used_bytes") >= bytes, "{text}");
    };
    check(0, 0);
    for i in 0..50 {
        store.put(&format!("k{i}"), &payload(i as u8, len(i))).unwrap();
    }
    check(50, (0..50).map(|i| len(i) as u64).sum());
    for i in 0..20 {
        store.remove(&format!("k{i}")).unwrap();
    }
    check(30, (20..50).map(|i| len(i) as u64).sum());
    // An upsert replaces a value (and its length) in place.
    store.upsert("k20", &payload(9, 5)).unwrap();
    check(30, (21..50).map(|i| len(i) as u64).sum::<u64>() + 5);
    assert_eq!(store.remove_all().unwrap(), 30);
    check(0, 0);
    m.assert_healthy();
}

#[test]
fn kept_totals_equal_a_walk_of_the_index_after_every_kind_of_change() {
    let m = Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).unwrap();
    let same = |what: &str| {
        // The monitor thread may change something between the two readings: a
        // difference must persist to count.
        let mut pair = (m.stats(), m.recount_stats());
        for _ in 0..3 {
            if pair.0 == pair.1 {
                break;
            }
            pair = (m.stats(), m.recount_stats());
        }
        assert_eq!(pair.0, pair.1, "after {what}");
        pair.0
    };
    let a = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let b = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let two = ReplicateConfig { replica_num: 2, ..Default::default() };
    for i in 0..40 {
        a.put_with(&format!("two{i}"), &payload(i as u8, 10_000 + i), &two).unwrap();
    }
    let s = same("puts of two replicas");
    assert_eq!((s.objects, s.replicas), (40, 80));
    let pinned = ReplicateConfig { soft_pin: true, soft_pin_ttl: Some(Duration::from_secs(60)), ..Default::default() };
    for i in 0..10 {
        b.put_with(&format!("pin{i}"), &payload(i as u8, 3_000), &pinned).unwrap();
    }
    same("pinned puts");
    for i in 0..10 {
        a.upsert(&format!("two{i}"), &payload(7, 20_000)).unwrap();
    }
    same("upserts");
    for i in 30..40 {
        a.remove(&format!("two{i}")).unwrap();
    }
    same("removes");
    // Fill both segments: eviction makes room.
    for i in 0..200 {
        let _ = b.put(&format!("fill{i}"), &payload(i as u8, 100_000));
    }
    let s = same("evictions");
    assert!(s.evicted_objects > 0, "{s:?}");
    // A store that leaves takes its segment's replicas with it.
    drop(b);
    same("a store unmounted");
    a.remove_all().unwrap();
    let s = same("remove_all");
    assert_eq!((s.objects, s.object_bytes, s.replicas, s.key_bytes), (0, 0, 0, 0));
}
