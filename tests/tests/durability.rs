//! Durable acknowledgments with the real binaries and `kill -9`: a put or remove the
//! master acknowledged is what a restarted master rebuilds from the storage nodes;
//! an object removed while its SSD was away stays removed; a dead node stops
//! blocking puts at once.

mod support;

use std::time::{Duration, Instant};

use support::{payload, ssd_node, unique_dir, wait_until, Cluster};

/// A number in the master's JSON status, e.g. `"segments": 2`.
fn status_number(c: &Cluster, field: &str) -> Option<u64> {
    let status = std::panic::catch_unwind(|| c.status()).ok()?;
    let at = status.find(&format!("\"{field}\": "))? + field.len() + 4;
    status[at..].split(|ch: char| !ch.is_ascii_digit()).next()?.parse().ok()
}

/// `kill -9` of the master and a restart on the same address; returns once every
/// one of `nodes` storage nodes re-mounted its segment.
fn crash_master(c: &mut Cluster, nodes: u64) {
    c.master.kill9();
    c.restart_master();
    wait_until(Duration::from_secs(10), || status_number(c, "segments") == Some(nodes));
}

/// `stat` of a key: its replica count, or None when the master does not know it.
fn replicas_of(c: &Cluster, key: &str) -> Option<usize> {
    match c.client(&["stat", "--master", &c.master_addr, key]) {
        (0, out, _) => {
            let at = out.find(" replica(s)")?;
            out[..at].rsplit(' ').next()?.parse().ok()
        }
        (_, _, err) => {
            assert!(err.contains("not found"), "stat {key}: {err}");
            None
        }
    }
}

#[test]
fn acknowledged_puts_survive_kill_9_of_the_master() {
    let mut c = Cluster::start(&["--client-ttl-ms", "1000"], 2);
    let dir = unique_dir("durable-put");
    let start = Instant::now();
    let rounds = 100;
    for i in 0..rounds {
        let key = format!("put/{i}");
        c.put_bytes(&dir, &key, &payload(i as u8, 4096 + i), 2);
        // Acknowledged: the master dies right away.
        crash_master(&mut c, 2);
        assert_eq!(replicas_of(&c, &key), Some(2), "{key} lost or lost a replica after kill -9 of the master");
    }
    // Nothing acknowledged earlier went missing either, and the bytes are exact.
    assert_eq!(c.ls().len(), rounds);
    for i in (0..rounds).step_by(9) {
        assert_eq!(c.get_bytes(&dir, &format!("put/{i}")).unwrap(), payload(i as u8, 4096 + i));
    }
    eprintln!("{rounds} put/kill -9/restart rounds in {:?}", start.elapsed());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn acknowledged_removes_survive_kill_9_of_the_master() {
    let mut c = Cluster::start(&["--client-ttl-ms", "1000", "--default-lease-ms", "1"], 2);
    let dir = unique_dir("durable-rm");
    let rounds = 100;
    for i in 0..rounds {
        c.put_bytes(&dir, &format!("rm/{i}"), &payload(i as u8, 8192), 1 + i % 2);
    }
    let start = Instant::now();
    for i in 0..rounds {
        let key = format!("rm/{i}");
        c.client_ok(&["rm", "--master", &c.master_addr, &key]);
        crash_master(&mut c, 2);
        assert_eq!(replicas_of(&c, &key), None, "{key} came back after kill -9 of the master");
        if i % 10 == 9 {
            assert_eq!(c.ls().len(), rounds - i - 1, "objects not removed went missing");
        }
    }
    assert!(c.ls().is_empty());
    eprintln!("{rounds} rm/kill -9/restart rounds in {:?}", start.elapsed());
    std::fs::remove_dir_all(&dir).ok();
}

/// Files the bucket backend committed (one meta file per bucket).
fn committed_buckets(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().ends_with(".meta")).count())
        .unwrap_or(0)
}

#[test]
fn an_object_removed_while_its_ssd_was_down_stays_removed() {
    let c = Cluster::start(&["--client-ttl-ms", "60000", "--persist", "eager", "--default-lease-ms", "1"], 0);
    let ssd = unique_dir("durable-ssd");
    let dir = unique_dir("durable-ssd-io");
    let mut node = ssd_node(&c.master_addr, &ssd, "256MiB");
    c.put_bytes(&dir, "gone", &payload(1, 100_000), 1);
    c.put_bytes(&dir, "kept", &payload(2, 100_000), 1);
    // Eager persistence: both reach the SSD (one bucket each offload round at most).
    wait_until(Duration::from_secs(10), || committed_buckets(&ssd) >= 1 && c.status().contains("\"objects\": 2"));
    let disk_holds = |key: &str| {
        std::fs::read_dir(&ssd).unwrap().filter_map(|e| e.ok()).any(|e| {
            e.file_name().to_string_lossy().ends_with(".meta")
                && String::from_utf8_lossy(&std::fs::read(e.path()).unwrap_or_default()).contains(key)
        })
    };
    wait_until(Duration::from_secs(10), || disk_holds("gone") && disk_holds("kept"));
    node.kill9();
    // Removed while the node (and its SSD) is down: acknowledged.
    c.client_ok(&["rm", "--master", &c.master_addr, "gone"]);
    node = ssd_node(&c.master_addr, &ssd, "256MiB");
    wait_until(Duration::from_secs(10), || status_number(&c, "segments") == Some(1));
    // The node announced its disk when it started: "kept" is back, "gone" is not.
    assert_eq!(c.get_bytes(&dir, "kept").unwrap(), payload(2, 100_000));
    assert_eq!(c.get_bytes(&dir, "gone"), Err("not found: gone".to_owned()));
    assert_eq!(c.ls(), vec!["kept".to_owned()]);
    // Also after a second restart of the node: its file was deleted, not just refused.
    node.kill9();
    wait_until(Duration::from_secs(10), || !disk_holds("gone"));
    let _node = ssd_node(&c.master_addr, &ssd, "256MiB");
    assert_eq!(c.get_bytes(&dir, "gone"), Err("not found: gone".to_owned()));
    std::fs::remove_dir_all(&ssd).ok();
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn puts_succeed_within_a_second_of_kill_9_of_one_of_two_nodes() {
    let mut c = Cluster::start(&["--client-ttl-ms", "10000"], 2);
    let dir = unique_dir("dead-node");
    c.put_bytes(&dir, "before", &payload(1, 65536), 2);
    assert_eq!(replicas_of(&c, "before"), Some(2));
    c.nodes[0].kill9();
    let killed = Instant::now();
    let mut first_ok = None;
    for i in 0..10 {
        c.put_bytes(&dir, &format!("after/{i}"), &payload(i as u8, 65536), 2);
        first_ok.get_or_insert_with(|| killed.elapsed());
    }
    let first_ok = first_ok.unwrap();
    assert!(first_ok < Duration::from_secs(1), "first put after kill -9 of a node took {first_ok:?}");
    // Fewer replicas than asked, and it says so.
    assert_eq!(replicas_of(&c, "after/9"), Some(1));
    assert!(status_number(&c, "under_replicated_puts").unwrap() >= 10, "{}", c.status());
    assert!(status_number(&c, "segment_failures").unwrap() >= 1, "{}", c.status());
    for i in 0..10 {
        assert_eq!(c.get_bytes(&dir, &format!("after/{i}")).unwrap(), payload(i as u8, 65536));
    }
    eprintln!("first put {first_ok:?} after kill -9 of a node");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn require_all_replicas_fails_a_put_that_cannot_get_them() {
    use mooncake_core::{Error, ReplicateConfig, Store};
    let c = Cluster::start(&[], 1);
    let store = Store::builder().master_address(&c.master_addr).global_segment_size(0).build().unwrap();
    let strict = ReplicateConfig { replica_num: 2, require_all_replicas: true, ..Default::default() };
    match store.put_with("strict", b"two or nothing", &strict) {
        Err(Error::NoSpace { reason: m, .. }) => assert!(m.contains("only 1 of 2 replicas"), "{m}"),
        other => panic!("expected NoSpace, got {other:?}"),
    }
    assert!(!store.exists("strict").unwrap());
    store.put_with("lenient", b"one will do", &ReplicateConfig::replicas(2)).unwrap();
    let stats = store.stats();
    assert_eq!(stats.under_replicated_puts, 1);
    assert_eq!(stats.master.under_replicated_puts, 1);
}
