//! Acknowledged data is never lost and removed data never comes back (issue 21,
//! findings 1-3), with the real binaries, SIGSTOP/SIGCONT and `kill -9`:
//! - a storage node paused for 3 s while removes are in flight loses nothing (the
//!   master forgets a node only through its TTL, never because a record delivery
//!   failed);
//! - a remove acknowledged with eager persistence stays removed through an immediate
//!   `kill -9` of the master (the node deleted the file before the acknowledgment);
//! - an SSD node forgotten and returning after its keys were put again and removed
//!   serves none of its old bytes (generations);
//! - a node paused past its TTL re-joins with the objects it holds, except those put
//!   again or removed meanwhile;
//! - after a master restart, a node that missed its keys' new puts (forgotten while
//!   paused) coming back first does not decide their value: the newer copies win;
//! - after a master restart, a node that missed its keys' removals (forgotten while
//!   paused) does not bring them back: another node kept the removals.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mooncake_core::{Error, ReplicateConfig, Store};
use support::{payload, ssd_node, unique_dir, wait_until, Cluster, Proc};

/// A client of the master at `addr` that gives no memory.
fn client(addr: &str) -> Store {
    Store::builder().master_address(addr).global_segment_size(0).build().unwrap()
}

/// A number in the master's JSON status, e.g. `"segments": 2`.
fn status_number(c: &Cluster, field: &str) -> Option<u64> {
    let status = std::panic::catch_unwind(|| c.status()).ok()?;
    let at = status.find(&format!("\"{field}\": "))? + field.len() + 4;
    status[at..].split(|ch: char| !ch.is_ascii_digit()).next()?.parse().ok()
}

/// The bytes of object `i`, distinct per object and per version.
fn value(i: usize, version: u8, len: usize) -> Vec<u8> {
    let mut v = payload(i as u8 ^ version.wrapping_mul(101), len);
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    v[8] = version;
    v
}

/// `get` with retries of what a master restart makes retryable; `None` for NotFound.
fn get_settled(store: &Store, key: &str) -> Option<Vec<u8>> {
    let start = Instant::now();
    loop {
        match store.get(key) {
            Ok(b) => return Some(b.to_vec()),
            Err(Error::NotFound(_)) => return None,
            Err(e) if start.elapsed() < Duration::from_secs(10) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("get {key}: {e}"),
        }
    }
}

/// `exists`, once the master no longer answers `Recovering` (nodes re-mounting).
fn exists_settled(store: &Store, key: &str) -> bool {
    let start = Instant::now();
    loop {
        match store.exists(key) {
            Ok(found) => return found,
            Err(e) if e.is_retryable() && start.elapsed() < Duration::from_secs(15) => {
                std::thread::sleep(Duration::from_millis(50))
            }
            Err(e) => panic!("exists {key}: {e}"),
        }
    }
}

/// A restarted master hears it from the clients that knew the one before, ahead of
/// any node re-mounting: until the nodes are back, a key it does not hold is
/// `Recovering` (to every client, a new one too), never `NotFound`. A fresh master
/// answers `NotFound` at once.
#[test]
fn a_restarted_master_learns_it_from_its_clients_before_the_nodes_are_back() {
    let mut c = Cluster::start(&["--client-ttl-ms", "3000", "--default-lease-ms", "1"], 1);
    let store = client(&c.master_addr);
    let got = store.get("k");
    assert!(matches!(got, Err(Error::NotFound(_))), "a fresh master has nothing to wait for: {got:?}");
    store.put("k", &value(1, 1, 4096)).unwrap();
    // The node cannot re-mount while stopped; the master restarts meanwhile.
    c.nodes[0].signal("STOP");
    c.master.kill9();
    c.restart_master();
    let got = store.get("k");
    assert!(matches!(got, Err(Error::Recovering(_))), "an acknowledged object, before its node is back: {got:?}");
    let fresh = client(&c.master_addr);
    let there = fresh.exists("k");
    assert!(matches!(there, Err(Error::Recovering(_))), "to a client new to this master as well: {there:?}");
    c.nodes[0].signal("CONT");
    assert_eq!(get_settled(&store, "k"), Some(value(1, 1, 4096)));
}

#[test]
fn a_node_paused_for_3_s_with_removes_in_flight_loses_nothing() {
    let mut c = Cluster::start(&["--client-ttl-ms", "10000", "--default-lease-ms", "1"], 2);
    let store = client(&c.master_addr);
    let n = 300;
    let len = 4096;
    for i in 0..n {
        store.put(&format!("obj/{i}"), &value(i, 1, len)).unwrap();
    }
    // Which node holds what: both must hold a good share for the test to mean anything.
    let mut by_segment: HashMap<u64, usize> = HashMap::new();
    for i in 0..n {
        let info = store.master().object_info(&format!("obj/{i}")).unwrap();
        *by_segment.entry(info.replicas[0].segment).or_default() += 1;
    }
    assert_eq!(by_segment.len(), 2, "{by_segment:?}");
    assert!(by_segment.values().all(|&k| k >= 60), "{by_segment:?}");

    // Node 0 stops; removes of every 5th object run meanwhile, from 4 threads.
    c.nodes[0].signal("STOP");
    let paused = Instant::now();
    let removers: Vec<_> = (0..4)
        .map(|t| {
            let addr = c.master_addr.clone();
            std::thread::spawn(move || {
                let store = client(&addr);
                let mut acked = Vec::new();
                for i in (0..n).filter(|i| i % 5 == 0 && (i / 5) % 4 == t) {
                    match store.remove(&format!("obj/{i}")) {
                        Ok(()) => acked.push(i),
                        Err(e) => eprintln!("remove obj/{i} during the pause: {e} (not acknowledged)"),
                    }
                }
                acked
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(3000).saturating_sub(paused.elapsed()));
    c.nodes[0].signal("CONT");
    let removed: Vec<usize> = removers.into_iter().flat_map(|h| h.join().unwrap()).collect();
    eprintln!("paused {:?}; {} removes acknowledged", paused.elapsed(), removed.len());
    assert!(removed.len() >= n / 5 / 2, "only {} of {} removes were acknowledged", removed.len(), n / 5);

    let check = |store: &Store, when: &str| {
        let mut lost = 0;
        let mut back = 0;
        for i in 0..n {
            let key = format!("obj/{i}");
            match (get_settled(store, &key), removed.contains(&i)) {
                (Some(b), false) => assert!(b == value(i, 1, len), "{key}: wrong bytes {when}"),
                (None, false) if i % 5 == 0 => {} // a remove that failed may still have happened
                (None, false) => lost += 1,
                (Some(_), true) => back += 1,
                (None, true) => {}
            }
        }
        assert_eq!((lost, back), (0, 0), "{when}: {lost} acknowledged objects lost, {back} removed ones back");
    };
    check(&store, "after the pause");
    assert_eq!(status_number(&c, "record_failures"), Some(0), "{}", c.status());
    assert_eq!(status_number(&c, "expired_clients"), Some(0), "{}", c.status());

    // And what was acknowledged during the pause is what a restarted master rebuilds.
    c.master.kill9();
    c.restart_master();
    wait_until(Duration::from_secs(10), || status_number(&c, "segments") == Some(2));
    check(&client(&c.master_addr), "after kill -9 of the master");
}

#[test]
fn a_node_paused_past_its_ttl_rejoins_with_what_nothing_superseded() {
    let mut c = Cluster::start(&["--client-ttl-ms", "2000", "--default-lease-ms", "1"], 1);
    let store = client(&c.master_addr);
    let len = 4096;
    let n = 30;
    // Everything on node 0, then a second node joins.
    for i in 0..n {
        store.put(&format!("p/{i}"), &value(i, 1, len)).unwrap();
    }
    c.add_node(&[], "127.0.0.1:0");
    c.nodes[0].signal("STOP");
    // Forgotten by its TTL: its objects are gone from the master.
    wait_until(Duration::from_secs(10), || !store.exists("p/0").unwrap_or(true));
    // Meanwhile p/0..10 are put again (on node 1), and p/5..10 removed after that.
    for i in 0..10 {
        store.put(&format!("p/{i}"), &value(i, 2, len)).unwrap();
    }
    for i in 5..10 {
        store.remove(&format!("p/{i}")).unwrap();
    }
    c.nodes[0].signal("CONT");
    // Node 0 re-joins with its records: what nothing superseded comes back.
    wait_until(Duration::from_secs(10), || (10..n).all(|i| store.exists(&format!("p/{i}")).unwrap_or(false)));
    // p/0..5: the later put's bytes; p/5..10: removed; the rest: as first put.
    let check = |store: &Store, when: &str| {
        for i in 0..n {
            let got = get_settled(store, &format!("p/{i}"));
            match i {
                0..5 => assert!(got.unwrap() == value(i, 2, len), "p/{i} {when}: not the later put's bytes"),
                5..10 => assert!(got.is_none(), "p/{i} {when}: removed, back with its old bytes"),
                _ => assert!(got.unwrap() == value(i, 1, len), "p/{i} {when}: wrong bytes"),
            }
        }
    };
    check(&store, "after the re-join");
    assert!(status_number(&c, "stale_copies").unwrap() >= 5, "{}", c.status());

    // The master restarts (its tombstones gone with it): what it refused from node 0
    // must not come back. Node 0 was told to drop those records when it re-joined;
    // before, it kept them, and the new master took back the removed p/5..10 (and
    // p/0..5's old bytes when node 0 re-mounted first).
    c.master.kill9();
    drop(store);
    c.restart_master();
    let store = client(&c.master_addr);
    wait_until(Duration::from_secs(15), || status_number(&c, "segments") == Some(2));
    wait_until(Duration::from_secs(10), || {
        (0..5).chain(10..n).all(|i| store.exists(&format!("p/{i}")).unwrap_or(false))
    });
    check(&store, "after the master's restart");
}

#[test]
fn removes_acknowledged_with_eager_persistence_survive_kill_9_of_the_master() {
    let mut c = Cluster::start(&["--persist", "eager", "--client-ttl-ms", "2000", "--default-lease-ms", "1"], 0);
    let ssd = unique_dir("trust-eager");
    let _node = ssd_node(&c.master_addr, &ssd, "256MiB");
    let len = 16 << 10;
    let mut back_total = 0;
    for run in 0..10 {
        let store = client(&c.master_addr);
        let keys: Vec<String> = (0..12).map(|i| format!("run{run}/{i}")).collect();
        for (i, k) in keys.iter().enumerate() {
            store.put(k, &value(i, run as u8, len)).unwrap();
        }
        // Eager persistence: every object gets its disk replica.
        wait_until(Duration::from_secs(10), || {
            keys.iter().all(|k| store.master().get_replica_list(k).is_ok_and(|l| l.disk.is_some()))
        });
        store.master().release_leases(&keys.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        // Remove ten of them (acknowledged), and kill the master at once.
        for k in &keys[..10] {
            store.remove(k).unwrap();
        }
        c.master.kill9();
        drop(store);
        c.restart_master();
        let store = client(&c.master_addr);
        // The node re-mounts and announces its disk: the two kept objects are back
        // with their disk replicas, so the announcement is over.
        wait_until(Duration::from_secs(15), || {
            keys[10..].iter().all(|k| store.master().get_replica_list(k).is_ok_and(|l| l.disk.is_some()))
        });
        let back: Vec<&String> = keys[..10].iter().filter(|k| exists_settled(&store, k)).collect();
        back_total += back.len();
        assert!(back.is_empty(), "run {run}: removed objects back after kill -9 of the master: {back:?}");
        for (i, k) in keys.iter().enumerate().skip(10) {
            assert!(get_settled(&store, k).unwrap() == value(i, run as u8, len), "{k}: wrong bytes");
        }
    }
    assert_eq!(back_total, 0);
    std::fs::remove_dir_all(&ssd).ok();
}

#[test]
fn a_forgotten_ssd_node_returning_after_a_reput_and_remove_serves_no_old_bytes() {
    let c = Cluster::start(&["--persist", "eager", "--client-ttl-ms", "2000", "--default-lease-ms", "1"], 0);
    let ssd = unique_dir("trust-generations");
    let ssd2 = unique_dir("trust-generations-2");
    let mut node1 = ssd_node(&c.master_addr, &ssd, "256MiB");
    let store = client(&c.master_addr);
    let len = 8 << 10;
    let n = 20;
    // v1 of the `k/` keys and of the control keys `keep/`, all on node 1's SSD.
    let keys: Vec<String> = (0..n).map(|i| format!("k/{i}")).chain((0..4).map(|i| format!("keep/{i}"))).collect();
    for (i, k) in keys.iter().enumerate() {
        store.put(k, &value(i, 1, len)).unwrap();
    }
    wait_until(Duration::from_secs(10), || {
        keys.iter().all(|k| store.master().get_replica_list(k).is_ok_and(|l| l.disk.is_some()))
    });
    // Node 1 dies and is forgotten (its TTL); node 2 takes its place.
    node1.kill9();
    let _node2: Proc = ssd_node(&c.master_addr, &ssd2, "256MiB");
    wait_until(Duration::from_secs(10), || !store.exists("keep/0").unwrap_or(true));
    assert_eq!(status_number(&c, "segments"), Some(1));
    // v2 of the `k/` keys (acknowledged), then removed (acknowledged).
    for (i, k) in keys[..n].iter().enumerate() {
        store.put(k, &value(i, 2, len)).unwrap();
    }
    for k in &keys[..n] {
        store.remove(k).unwrap();
    }
    // Node 1 comes back on its directory: the control keys it alone holds are back,
    // none of the removed keys is, and no v1 byte is served.
    let _node1 = ssd_node(&c.master_addr, &ssd, "256MiB");
    wait_until(Duration::from_secs(10), || keys[n..].iter().all(|k| store.exists(k).unwrap_or(false)));
    let mut old = 0;
    for (i, k) in keys.iter().enumerate() {
        match (get_settled(&store, k), i < n) {
            (None, true) => {}
            (Some(b), true) => {
                assert!(b == value(i, 1, len), "{k}: unexpected bytes");
                old += 1;
            }
            (Some(b), false) => assert!(b == value(i, 1, len), "{k}: wrong bytes"),
            (None, false) => panic!("{k} was not recovered from node 1's SSD"),
        }
    }
    assert_eq!(old, 0, "{old} of {n} removed keys serve their old bytes again");
    std::fs::remove_dir_all(&ssd).ok();
    std::fs::remove_dir_all(&ssd2).ok();
}

/// With node 0 stopped past its TTL (forgotten by the master): stops node 1,
/// `kill -9`s the master, restarts it and lets node 0 come back first. Node 0
/// knows it was silent past its TTL and says so: until the recovery window closes
/// (or a newer copy or a kept removal comes), what only it holds is `Recovering`,
/// never its old bytes; checked for `{prefix}/0..withheld`. Then node 1 comes back.
/// Returns a client of the new master.
fn restart_with_the_stale_node_first(c: &mut Cluster, store: Store, prefix: &str, withheld: usize) -> Store {
    c.nodes[1].signal("STOP");
    c.master.kill9();
    drop(store);
    c.restart_master();
    c.nodes[0].signal("CONT");
    wait_until(Duration::from_secs(15), || status_number(c, "segments") == Some(1));
    let store = client(&c.master_addr);
    for i in 0..withheld {
        let early = store.master().get_replica_list(&format!("{prefix}/{i}"));
        assert!(matches!(early, Err(Error::Recovering(_))), "{prefix}/{i} served from the stale node: {early:?}");
    }
    c.nodes[1].signal("CONT");
    wait_until(Duration::from_secs(15), || status_number(c, "segments") == Some(2));
    store
}

/// Node 0 holds v1 of the `p/` keys, is paused and forgotten; v2 is put on node 1.
/// The master is killed and restarted while node 1 is paused too, so that node 0
/// comes back first and offers its v1 records to a master that lost its tombstones.
/// Node 1 then comes back with v2: v2 must be the keys' value, and meanwhile no v1
/// byte is served. (Before generations decided re-mount conflicts, the first copy
/// offered stayed: v1 was served again and v2, acknowledged, was dropped.)
#[test]
fn a_stale_node_back_first_after_a_master_restart_does_not_decide_the_value() {
    let mut c = Cluster::start(&["--client-ttl-ms", "2000", "--default-lease-ms", "1"], 1);
    let store = client(&c.master_addr);
    let len = 4096;
    let (n, kept) = (20, 25);
    for i in 0..kept {
        store.put(&format!("p/{i}"), &value(i, 1, len)).unwrap();
    }
    c.add_node(&[], "127.0.0.1:0");
    c.nodes[0].signal("STOP");
    wait_until(Duration::from_secs(10), || !store.exists("p/0").unwrap_or(true));
    for i in 0..n {
        store.put(&format!("p/{i}"), &value(i, 2, len)).unwrap();
    }
    let store = restart_with_the_stale_node_first(&mut c, store, "p", kept);
    let mut stale = Vec::new();
    for i in 0..kept {
        let got = get_settled(&store, &format!("p/{i}"));
        let want = value(i, if i < n { 2 } else { 1 }, len);
        match got {
            Some(b) if b == want => {}
            Some(b) if i < n && b == value(i, 1, len) => stale.push(i),
            other => panic!("p/{i}: {:?} bytes, not its last put's", other.map(|b| b.len())),
        }
    }
    assert!(stale.is_empty(), "keys served their old bytes, the newer acknowledged ones lost: {stale:?}");
    assert!(status_number(&c, "stale_copies").unwrap() >= n as u64, "{}", c.status());
}

/// Keys held by both nodes are removed while node 0 is paused past its TTL (the
/// master forgets it with its copies). The master is then `kill -9`ed and restarted,
/// node 1 stays paused, and node 0 comes back first, offering its records of the
/// removed keys to a master that lost its tombstones. None may come back: node 1
/// kept the removals for the master (they were handed to it before each remove was
/// acknowledged), and once it is back the master drops what node 0 brought; until
/// then node 0's copies are not served. (Before, every removed key was readable
/// again once the recovery window closed.)
#[test]
fn a_stale_node_back_first_after_a_master_restart_does_not_bring_back_removed_keys() {
    let mut c = Cluster::start(&["--client-ttl-ms", "2000", "--default-lease-ms", "1"], 2);
    let store = client(&c.master_addr);
    let len = 4096;
    let (n, kept) = (20, 25);
    let both = ReplicateConfig { replica_num: 2, ..Default::default() };
    for i in 0..kept {
        store.put_with(&format!("r/{i}"), &value(i, 1, len), &both).unwrap();
    }
    assert_eq!(store.master().get_replica_list("r/0").unwrap().replicas.len(), 2);
    c.nodes[0].signal("STOP");
    wait_until(Duration::from_secs(10), || status_number(&c, "segments") == Some(1));
    for i in 0..n {
        store.remove(&format!("r/{i}")).unwrap();
    }
    assert!(status_number(&c, "carried_tombstones").unwrap() >= n as u64, "{}", c.status());
    let store = restart_with_the_stale_node_first(&mut c, store, "r", n);
    let mut back = Vec::new();
    for i in 0..kept {
        match get_settled(&store, &format!("r/{i}")) {
            None if i < n => {}
            Some(b) if i < n && b == value(i, 1, len) => back.push(i),
            Some(b) if i >= n && b == value(i, 1, len) => {}
            other => panic!("r/{i}: {:?} bytes, not what its last put or remove left", other.map(|b| b.len())),
        }
    }
    assert!(back.is_empty(), "removed keys came back: {back:?}");
    assert!(status_number(&c, "stale_copies").unwrap() >= n as u64, "{}", c.status());
}
