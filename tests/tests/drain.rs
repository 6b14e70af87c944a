//! Graceful drain with the real binaries: a storage node leaves without losing what
//! only it held (`mooncake-client drain`, SIGTERM on `serve`), its objects copied to
//! the other nodes or, when the pool has no room, kept on its SSD tier.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mooncake_core::{Master, MasterConfig, ReplicateConfig, Store};
use support::{bin, payload, ssd_node, unique_dir, Cluster, Proc};

/// The endpoint a node serves at (the last word of its first line).
fn endpoint(node: &Proc) -> String {
    node.first_line.rsplit(' ').next().unwrap().to_owned()
}

/// The segment id a node announced (`serving segment ID (...)`).
fn segment_id(node: &Proc) -> u64 {
    node.first_line.split(' ').nth(3).unwrap().parse().unwrap()
}

fn client(master: &str) -> Store {
    Store::builder().master_address(master).global_segment_size(0).build().unwrap()
}

/// A storage node with a segment of `size`, no SSD tier, draining for at most
/// `grace` seconds on SIGTERM.
fn node(master: &str, size: &str, grace: &str) -> Proc {
    let args = ["serve", "--master", master, "--listen", "127.0.0.1:0", "--segment-size", size, "--drain-grace", grace];
    let node = Proc::spawn(&[], &bin("mooncake-client"), &args);
    assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
    node
}

/// The value of object `i`: a few KiB, different for every object.
fn value(i: usize) -> Vec<u8> {
    let mut v = payload(i as u8, 4096 + (i % 7) * 1000);
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    v
}

/// Segments holding a complete memory replica of `key`.
fn homes(store: &Store, key: &str) -> Vec<u64> {
    store.master().object_info(key).map(|i| i.replicas.iter().map(|r| r.segment).collect()).unwrap_or_default()
}

#[test]
fn a_drained_node_is_killed_and_every_object_reads_back() {
    let mut c = Cluster::start(&["--client-ttl-ms", "2000"], 3);
    let (drained, drained_seg) = (endpoint(&c.nodes[0]), segment_id(&c.nodes[0]));
    let store = client(&c.master_addr);
    let keys: Vec<String> = (0..500).map(|i| format!("drain/{i}")).collect();
    let values: Vec<Vec<u8>> = (0..500).map(value).collect();
    let items: Vec<(&str, &[u8])> = keys.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    for r in store.batch_put(&items, &ReplicateConfig::default()) {
        r.unwrap();
    }
    let on_drained = keys.iter().filter(|k| homes(&store, k).contains(&drained_seg)).count();
    assert!(on_drained > 50, "placement should spread objects over the 3 nodes: {on_drained} on the drained one");

    // A reader that must never fail while the node drains.
    let stop = Arc::new(AtomicBool::new(false));
    let (reads, read_errors) = (Arc::new(AtomicU64::new(0)), Arc::new(Mutex::new(Vec::<String>::new())));
    let reader = {
        let (stop, reads, read_errors) = (stop.clone(), reads.clone(), read_errors.clone());
        let (keys, values, reader) = (keys.clone(), values.clone(), client(&c.master_addr));
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(30) {
                match reader.get(&keys[i % keys.len()]) {
                    Ok(b) if b[..] == values[i % keys.len()][..] => {}
                    Ok(_) => read_errors.lock().unwrap().push(format!("{}: wrong bytes", keys[i % keys.len()])),
                    Err(e) => read_errors.lock().unwrap().push(format!("{}: {e}", keys[i % keys.len()])),
                }
                reads.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };

    let mut drain = std::process::Command::new(bin("mooncake-client"))
        .args(["drain", "--master", &c.master_addr, &drained, "--grace", "20"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Once the master marked the node draining, no put lands there.
    support::wait_until(Duration::from_secs(20), || {
        store.master().drain_status(&drained).map(|p| p.segments > 0).unwrap_or(false)
    });
    let mut written: Vec<(String, Vec<u8>)> = Vec::new();
    let start = Instant::now();
    while drain.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(30) {
        let (key, v) = (format!("during/{}", written.len()), value(1000 + written.len()));
        store.put(&key, &v).unwrap();
        let at = homes(&store, &key);
        assert!(!at.is_empty() && !at.contains(&drained_seg), "{key} was placed on the draining node: {at:?}");
        written.push((key, v));
    }
    let out = drain.wait_with_output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "drain failed: {stdout} {stderr}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.contains(", 0 left") && last.contains(" 0 lost"), "{stdout}");
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    assert!(read_errors.lock().unwrap().is_empty(), "reads failed during the drain: {:?}", read_errors.lock());
    assert!(reads.load(Ordering::Relaxed) > 0);
    for k in &keys {
        assert!(!homes(&store, k).contains(&drained_seg), "{k} still lives on the drained node");
    }
    let status = store.master().drain_status(&drained).unwrap();
    assert!(status.done && status.objects_copied + status.objects_dropped >= on_drained as u64, "{status:?}");

    c.nodes[0].kill9();
    let fresh = client(&c.master_addr);
    for (k, v) in keys.iter().zip(&values).chain(written.iter().map(|(k, v)| (k, v))) {
        assert_eq!(&fresh.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &v[..], "{k}");
    }
    // The drain's progress is in the master's metrics.
    let metrics = c.metrics();
    assert!(metrics.contains("mooncake_drain_objects_moved{node=\""), "{metrics}");
}

#[test]
fn what_the_pool_cannot_take_goes_to_the_ssd_tier_and_survives_a_restart() {
    let mut c = Cluster::start(&["--client-ttl-ms", "2000"], 0);
    let dir = unique_dir("drain-ssd");
    let mut a = ssd_node(&c.master_addr, &dir, "256MiB"); // 16 MiB of memory
    let b = node(&c.master_addr, "8MiB", "0");
    let store = client(&c.master_addr);
    let name = |p: &Proc| store.master().segment_info(segment_id(p)).unwrap().name;
    let (a_name, b_name) = (name(&a), name(&b));
    // 12 MiB on A, 4 MiB on B: A's objects cannot all fit into B's free room.
    let mut objects: HashMap<String, Vec<u8>> = HashMap::new();
    for (seg, n, tag) in [(&a_name, 48, "a"), (&b_name, 16, "b")] {
        let cfg = ReplicateConfig { preferred_segments: vec![seg.clone()], ..Default::default() };
        for i in 0..n {
            let key = format!("full/{tag}/{i}");
            let v = payload(i as u8 ^ tag.as_bytes()[0], 256 << 10);
            store.put_with(&key, &v, &cfg).unwrap();
            objects.insert(key, v);
        }
    }
    let (code, stdout, stderr) = c.client(&["drain", "--master", &c.master_addr, &endpoint(&a), "--grace", "20"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let status = store.master().drain_status(&endpoint(&a)).unwrap();
    assert!(status.objects_copied > 0 && status.objects_on_disk > 0, "{status:?}");
    assert_eq!((status.objects_lost, status.objects_left), (0, 0), "{status:?}");
    let b_seg = segment_id(&b);
    for (k, v) in &objects {
        assert_eq!(&store.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &v[..], "{k}");
        let at = homes(&store, k);
        assert!(at.is_empty() || at == [b_seg], "{k} is still in A's memory: {at:?}");
    }
    // A leaves (crashes) and comes back on the same directory: what it kept on disk
    // is readable again.
    a.kill9();
    a = ssd_node(&c.master_addr, &dir, "256MiB");
    let fresh = client(&c.master_addr);
    support::wait_until(Duration::from_secs(15), || objects.keys().all(|k| fresh.exists(k).unwrap_or(false)));
    for (k, v) in &objects {
        assert_eq!(&fresh.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &v[..], "{k}");
    }
    drop(a);
    c.nodes.clear();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_drains_within_the_grace_period_and_a_second_one_stops_at_once() {
    let c = Cluster::start(&["--client-ttl-ms", "2000"], 0);
    let mut a = node(&c.master_addr, "16MiB", "20");
    let b = node(&c.master_addr, "16MiB", "0");
    let store = client(&c.master_addr);
    let a_name = store.master().segment_info(segment_id(&a)).unwrap().name;
    let cfg = ReplicateConfig { preferred_segments: vec![a_name], ..Default::default() };
    let values: Vec<(String, Vec<u8>)> = (0..100).map(|i| (format!("term/{i}"), value(i))).collect();
    for (k, v) in &values {
        store.put_with(k, v, &cfg).unwrap();
    }
    a.signal("TERM");
    let code = a.wait(Duration::from_secs(20));
    assert_eq!(code, Some(0), "serve should drain and exit");
    let b_seg = segment_id(&b);
    for (k, v) in &values {
        assert_eq!(&store.get(k).unwrap()[..], &v[..], "{k}");
        assert_eq!(homes(&store, k), [b_seg], "{k}");
    }

    // A lone node has nowhere to move its objects: its drain waits for room until
    // the grace period ends, unless a second signal stops it at once.
    drop(b);
    let c2 = Cluster::start(&["--client-ttl-ms", "2000"], 0);
    let mut lone = node(&c2.master_addr, "16MiB", "30");
    let store = client(&c2.master_addr);
    store.put("lone", b"nowhere to go").unwrap();
    lone.signal("TERM");
    // The second signal only once the first was handled (the drain started): sent
    // before, on a slow machine, the two could arrive as one pending signal.
    let lone_name = endpoint(&lone);
    support::wait_until(Duration::from_secs(20), || store.master().drain_status(&lone_name).is_ok_and(|p| p.started));
    assert_eq!(lone.wait(Duration::ZERO), None, "the first signal only starts the drain");
    let start = Instant::now();
    lone.signal("TERM");
    // "At once": well within the 30 s grace period the drain would otherwise wait
    // (10 s leaves room for a loaded machine).
    assert!(lone.wait(Duration::from_secs(10)).is_some(), "a second SIGTERM stops at once");
    assert!(start.elapsed() < Duration::from_secs(10));

    // With a short grace period the drain gives up in time and says what was lost.
    let mut short = node(&c2.master_addr, "16MiB", "1");
    let short_name = store.master().segment_info(segment_id(&short)).unwrap().name;
    let cfg = ReplicateConfig { preferred_segments: vec![short_name], ..Default::default() };
    store.put_with("short", b"also nowhere", &cfg).unwrap();
    let start = Instant::now();
    short.signal("TERM");
    // A 1 s grace period; 10 s leaves room for a loaded machine, and is still far
    // from a drain that waits for room that never comes.
    assert_eq!(short.wait(Duration::from_secs(10)), Some(0));
    assert!(start.elapsed() < Duration::from_secs(10), "the drain ends with its grace period");
    assert!(short.next_line().contains("1 lost"));
}

/// A `POST` with an optional bearer token; returns the status code and the body.
fn http_post(addr: &str, target: &str, bearer: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let auth = bearer.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "POST {target} HTTP/1.0\r\nHost: {addr}\r\n{auth}Content-Length: 0\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or(text))
}

#[test]
fn post_drain_on_the_masters_listener_needs_the_secret_and_drains_the_node() {
    let secret = "drain sesame";
    let c = Cluster::start_env(&["--client-ttl-ms", "2000"], 2, &[("MOONCAKE_SECRET", secret)]);
    let store = Store::builder()
        .master_address(&c.master_addr)
        .global_segment_size(0)
        .shared_secret(secret.as_bytes())
        .build()
        .unwrap();
    let a_seg = segment_id(&c.nodes[0]);
    let a_name = store.master().segment_info(a_seg).unwrap().name;
    let cfg = ReplicateConfig { preferred_segments: vec![a_name.clone()], ..Default::default() };
    for i in 0..50 {
        store.put_with(&format!("post/{i}"), &value(i), &cfg).unwrap();
    }
    let target = format!("/drain?segment={}&grace=20", a_name.replace('#', "%23"));
    assert_eq!(http_post(&c.metrics_addr, &target, None).0, 401, "the listener's token guards /drain");
    assert_eq!(http_post(&c.metrics_addr, &target, Some(secret)).0, 401, "the secret itself is not the token");
    let token = mooncake_transfer::SharedSecret::new(secret.as_bytes()).http_token();
    let token = token.as_str();
    assert_eq!(http_post(&c.metrics_addr, "/drain", Some(token)).0, 400, "no segment named");
    assert_eq!(http_post(&c.metrics_addr, "/drain?segment=nowhere%231", Some(token)).0, 404);
    assert_eq!(http_post(&c.metrics_addr, "/metrics", Some(token)).0, 404, "only /drain takes a POST");
    let (code, body) = http_post(&c.metrics_addr, &target, Some(token));
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"segments\": 1"), "{body}");
    // The node hears of it from the master and drains itself.
    support::wait_until(Duration::from_secs(20), || {
        store.master().drain_status(&a_name).map(|p| p.started && p.done).unwrap_or(false)
    });
    let status = store.master().drain_status(&a_name).unwrap();
    assert_eq!((status.objects_copied, status.objects_lost), (50, 0), "{status:?}");
    for i in 0..50 {
        let key = format!("post/{i}");
        assert!(!homes(&store, &key).contains(&a_seg), "{key}");
        assert_eq!(&store.get(&key).unwrap()[..], &value(i)[..]);
    }
    let metrics = c.metrics();
    assert!(metrics.contains("mooncake_drain_done{node=\""), "{metrics}");
}

#[test]
fn two_nodes_draining_at_once_do_not_count_on_each_other() {
    let mut c = Cluster::start(&["--client-ttl-ms", "2000"], 3);
    let store = client(&c.master_addr);
    let name = |i: usize| store.master().segment_info(segment_id(&c.nodes[i])).unwrap().name;
    // Every object has its two replicas on the two nodes that will drain.
    let cfg = ReplicateConfig { replica_num: 2, preferred_segments: vec![name(0), name(1)], ..Default::default() };
    let values: Vec<(String, Vec<u8>)> = (0..100).map(|i| (format!("pair/{i}"), value(i))).collect();
    for (k, v) in &values {
        store.put_with(k, v, &cfg).unwrap();
        assert_eq!(homes(&store, k).len(), 2);
    }
    let drains: Vec<std::process::Child> = [0, 1]
        .iter()
        .map(|&i| {
            std::process::Command::new(bin("mooncake-client"))
                .args(["drain", "--master", &c.master_addr, &endpoint(&c.nodes[i]), "--grace", "20"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for d in drains {
        let out = d.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    }
    c.nodes[0].kill9();
    c.nodes[1].kill9();
    let fresh = client(&c.master_addr);
    for (k, v) in &values {
        assert_eq!(&fresh.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &v[..], "{k}");
    }
}

#[test]
fn store_drain_in_process_keeps_soft_pins_and_reports_a_summary() {
    use mooncake_core::{Master, MasterConfig};
    // A master that tracks records: a node then knows what its segment holds.
    let master = Master::new(MasterConfig::served()).unwrap();
    let a = Store::builder().master(&master).global_segment_size(8 << 20).build().unwrap();
    let b = Store::builder().master(&master).global_segment_size(8 << 20).build().unwrap();
    let a_name = a.segment_name().unwrap().unwrap();
    let pinned = ReplicateConfig { soft_pin: true, preferred_segments: vec![a_name.clone()], ..Default::default() };
    let plain = ReplicateConfig { preferred_segments: vec![a_name], ..Default::default() };
    for i in 0..20 {
        a.put_with(&format!("pin/{i}"), &value(i), if i % 2 == 0 { &pinned } else { &plain }).unwrap();
    }
    let summary = a.drain(Duration::from_secs(10)).unwrap();
    assert!(summary.done && summary.started && summary.segments == 1, "{summary:?}");
    assert_eq!((summary.objects_total, summary.objects_copied, summary.objects_lost), (20, 20, 0), "{summary:?}");
    assert_eq!(summary.objects_left, 0);
    assert_eq!(summary.bytes_copied, (0..20).map(|i| value(i).len() as u64).sum::<u64>());
    let b_seg = b.segment_id().unwrap();
    for i in 0..20 {
        let info = b.master().object_info(&format!("pin/{i}")).unwrap();
        assert_eq!(info.replicas.iter().map(|r| r.segment).collect::<Vec<_>>(), [b_seg]);
        assert_eq!(info.soft_pin, i % 2 == 0, "pin/{i}: the copy keeps the object's pin");
    }
    // The drained segment takes no new replica, even when asked for by name.
    a.put_with("after", b"x", &plain).unwrap();
    assert_eq!(homes(&a, "after"), [b_seg]);
    // close_draining: nothing left to move, then the segment leaves.
    let again = a.close_draining(Duration::from_secs(5)).unwrap();
    assert_eq!((again.objects_total, again.objects_lost), (0, 0), "{again:?}");
    for i in 0..20 {
        assert_eq!(&b.get(&format!("pin/{i}")).unwrap()[..], &value(i)[..]);
    }
}

#[test]
fn an_embedded_master_without_records_still_drains() {
    use mooncake_core::{Master, MasterConfig};
    let master = Master::new(MasterConfig::default()).unwrap();
    let a = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let cfg = ReplicateConfig { preferred_segments: vec![a.segment_name().unwrap().unwrap()], ..Default::default() };
    for i in 0..10 {
        a.put_with(&format!("e/{i}"), &value(i), &cfg).unwrap();
    }
    let on_b = ReplicateConfig { preferred_segments: vec![b.segment_name().unwrap().unwrap()], ..Default::default() };
    b.put_with("on-b", b"stays", &on_b).unwrap();
    let summary = a.close_draining(Duration::from_secs(10)).unwrap();
    assert_eq!((summary.objects_total, summary.objects_copied, summary.objects_lost), (10, 10, 0), "{summary:?}");
    for i in 0..10 {
        assert_eq!(&b.get(&format!("e/{i}")).unwrap()[..], &value(i)[..]);
    }
}

#[test]
fn a_put_placed_before_the_drain_and_ended_during_it_is_moved_too() {
    use mooncake_core::{Master, MasterConfig};
    let master = Master::new(MasterConfig::served()).unwrap();
    let a = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let w = Store::builder().master(&master).global_segment_size(0).build().unwrap();
    let cfg = ReplicateConfig { preferred_segments: vec![a.segment_name().unwrap().unwrap()], ..Default::default() };
    // Placed on A before the drain; its bytes are the zeros A's fresh memory holds.
    let zeros = [0u8; 4096];
    let placed = w.master().put_start(w.client_id(), "late", zeros.len() as u64, &cfg).unwrap();
    assert_eq!(placed[0].segment, a.segment_id().unwrap());
    let draining = a.clone();
    let drain = std::thread::spawn(move || draining.drain(Duration::from_secs(10)).unwrap());
    std::thread::sleep(Duration::from_millis(300));
    assert!(!drain.is_finished(), "the drain waits for the put still writing on the node");
    w.master().put_end(w.client_id(), "late", mooncake_transfer::checksum::crc32c(&zeros)).unwrap();
    let summary = drain.join().unwrap();
    assert_eq!((summary.objects_copied, summary.objects_lost), (1, 0), "{summary:?}");
    assert_eq!(homes(&b, "late"), [b.segment_id().unwrap()]);
    assert_eq!(&b.get("late").unwrap()[..], &zeros[..]);
}

/// The same put still writing when the grace ends: the drain does not report a clean
/// node (something is left: the put's bytes are still allocated there).
#[test]
fn a_put_still_writing_when_the_grace_ends_is_reported_left() {
    use mooncake_core::{Master, MasterConfig};
    let master = Master::new(MasterConfig::served()).unwrap();
    let a = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let _b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let w = Store::builder().master(&master).global_segment_size(0).build().unwrap();
    let cfg = ReplicateConfig { preferred_segments: vec![a.segment_name().unwrap().unwrap()], ..Default::default() };
    w.master().put_start(w.client_id(), "late", 4096, &cfg).unwrap();
    let summary = a.drain(Duration::from_millis(300)).unwrap();
    assert!(summary.done, "{summary:?}");
    assert!(summary.objects_left + summary.objects_lost > 0, "reported clean with a put still writing: {summary:?}");
    assert_eq!(summary.bytes_left, 4096, "{summary:?}");
}

/// Copies away from a draining node take room below the high watermark only, even
/// when many land on one segment at the same moment. Above it the master's monitor
/// would evict, and a copy whose original the drain has dropped is the object's only
/// replica: evicting it loses what the drain reported moved.
#[test]
fn concurrent_drain_copies_never_push_a_segment_over_the_high_watermark() {
    const OBJ: usize = 100_000;
    for round in 0..40 {
        let m = Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).unwrap();
        let a = Store::builder().master(&m).global_segment_size(8 << 20).build().unwrap();
        let b = Store::builder().master(&m).global_segment_size(1 << 20).build().unwrap();
        let on_a =
            ReplicateConfig { preferred_segments: vec![a.segment_name().unwrap().unwrap()], ..Default::default() };
        let keys: Vec<String> = (0..32).map(|i| format!("r{round}/{i}")).collect();
        for k in &keys {
            a.put_with(k, &vec![1u8; OBJ], &on_a).unwrap();
        }
        m.drain_segment(a.endpoint(), 60_000).unwrap();
        // Every copy can only go to B, which has room for a few of them.
        let cfg = ReplicateConfig { replica_num: 2, keep_soft_pin: true, ..Default::default() };
        let copied = AtomicU64::new(0);
        let (a, cfg, copied_ref) = (&a, &cfg, &copied);
        std::thread::scope(|s| {
            for chunk in keys.chunks(2) {
                s.spawn(move || {
                    for k in chunk {
                        if a.replicate(k, cfg).is_ok() {
                            copied_ref.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        let stats = m.stats();
        let usage = stats.segment_usage.iter().find(|u| Some(u.segment) == b.segment_id()).unwrap();
        assert!(
            usage.used as f64 <= usage.capacity as f64 * 0.95,
            "round {round}: {} copies took {} of {} bytes",
            copied.load(Ordering::Relaxed),
            usage.used,
            usage.capacity
        );
        assert!(copied.load(Ordering::Relaxed) > 0, "round {round}: B had room for some copies");
    }
}

/// A drain whose grace ran out with objects still on the node says so (the command
/// fails, naming them), and asking again, once there is room, runs a new drain with
/// the new grace that moves them. (A drain asked again used to answer the ended
/// one's counts and move nothing.)
#[test]
fn a_drain_asked_again_after_its_grace_ran_out_runs_again() {
    let c = Cluster::start(&["--client-ttl-ms", "2000"], 0);
    let a = node(&c.master_addr, "16MiB", "0");
    let b = node(&c.master_addr, "1MiB", "0");
    let store = client(&c.master_addr);
    let a_name = store.master().segment_info(segment_id(&a)).unwrap().name;
    let on_a = ReplicateConfig { preferred_segments: vec![a_name], ..Default::default() };
    let values: Vec<Vec<u8>> = (0..16).map(|i| payload(i as u8, 256 << 10)).collect();
    for (i, v) in values.iter().enumerate() {
        store.put_with(&format!("again/{i}"), v, &on_a).unwrap();
    }
    let (code, stdout, stderr) = c.client(&["drain", "--master", &c.master_addr, &endpoint(&a), "--grace", "1"]);
    assert_ne!(code, 0, "objects were not moved: the command says so\n{stdout}");
    assert!(stderr.contains("lost") || stderr.contains("still on the node"), "{stderr}");
    let first = store.master().drain_status(&endpoint(&a)).unwrap();
    assert!(first.done && first.objects_lost + first.objects_left > 0, "{first:?}");
    // Room arrives; the drain is asked for again.
    let _c3 = node(&c.master_addr, "32MiB", "0");
    let (code, stdout, stderr) = c.client(&["drain", "--master", &c.master_addr, &endpoint(&a), "--grace", "20"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let a_seg = segment_id(&a);
    for (i, v) in values.iter().enumerate() {
        let key = format!("again/{i}");
        assert!(!homes(&store, &key).contains(&a_seg), "{key} is still on the drained node");
        assert_eq!(&store.get(&key).unwrap()[..], &v[..], "{key}");
    }
    drop(b);
}

/// A drained node stays draining when its segment is mounted again (the master forgot
/// it, or restarted): the re-mounted segment takes no new replica. (A re-mount used to
/// make it placeable again, and puts landed on a node about to stop.)
#[test]
fn a_drained_node_is_draining_again_after_a_re_mount() {
    use mooncake_core::{Master, MasterConfig};
    let master = Master::new(MasterConfig { client_ttl: Duration::from_secs(2), ..MasterConfig::served() }).unwrap();
    let a = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let _b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let summary = a.drain(Duration::from_secs(5)).unwrap();
    assert!(summary.done);
    let first = a.segment_id().unwrap();
    assert!(master.segment_info(first).unwrap().draining);
    // The master forgets the node; it registers again and re-mounts its segment.
    master.unregister_client(a.client_id()).unwrap();
    support::wait_until(Duration::from_secs(20), || a.segment_id().is_some_and(|id| id != first));
    let again = a.segment_id().unwrap();
    support::wait_until(Duration::from_secs(20), || master.segment_info(again).is_ok_and(|s| s.draining));
    let on_a = ReplicateConfig { preferred_segments: vec![a.segment_name().unwrap().unwrap()], ..Default::default() };
    a.put_with("after", b"v", &on_a).unwrap();
    assert!(!homes(&a, "after").contains(&again), "a put landed on the drained node");
}
