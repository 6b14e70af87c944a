//! Cluster mode with the real pieces: a real etcd, real `mooncake-master` processes
//! (`--etcd`), real storage nodes (`mooncake-client serve --master etcd://...`),
//! `kill -9` and `SIGSTOP` for failures. The client side is a `Store` in this process.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use mooncake_core::cluster::{EtcdAddress, SlotMapWatcher};
use mooncake_core::rpc::RpcMasterClient;
use mooncake_core::{Error, MasterApi, ReplicateConfig, Store};
use support::{bin, payload, unique_dir, wait_until, Etcd, Proc};

/// A cluster: etcd, masters, storage nodes.
struct Cluster {
    etcd: Etcd,
    name: String,
    /// (process, RPC address, metrics address).
    masters: Vec<(Proc, String, String)>,
    nodes: Vec<Proc>,
    /// The nodes' SSD directories, removed with the cluster.
    dirs: Vec<PathBuf>,
    /// Flags every master gets besides the common ones.
    master_args: Vec<String>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.nodes.clear();
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

const LEASE_MS: u64 = 2000;

impl Cluster {
    fn start(masters: usize, nodes: usize) -> Option<Cluster> {
        Self::start_with(masters, nodes, &[])
    }

    /// [`start`](Self::start) with `master_args` for every master.
    fn start_with(masters: usize, nodes: usize, master_args: &[&str]) -> Option<Cluster> {
        let etcd = Etcd::start()?;
        let name = format!("c{}", std::process::id());
        let master_args = master_args.iter().map(|a| a.to_string()).collect();
        let mut c = Cluster { etcd, name, masters: Vec::new(), nodes: Vec::new(), dirs: Vec::new(), master_args };
        for _ in 0..masters {
            c.add_master();
        }
        c.wait_all_led(Duration::from_secs(20));
        for _ in 0..nodes {
            c.add_node();
        }
        Some(c)
    }

    fn address(&self) -> String {
        format!("etcd://127.0.0.1:{}/{}", self.etcd.client_port, self.name)
    }

    fn add_master(&mut self) -> String {
        let lease = LEASE_MS.to_string();
        let endpoint = self.etcd.endpoint();
        let mut args = vec![
            "--listen",
            "127.0.0.1:0",
            "--etcd",
            &endpoint,
            "--cluster-id",
            &self.name,
            "--lease-ttl-ms",
            &lease,
            "--client-ttl-ms",
            "2000",
            "--metrics-listen",
            "127.0.0.1:0",
        ];
        args.extend(self.master_args.iter().map(String::as_str));
        let p = Proc::spawn(&[], &bin("mooncake-master"), &args);
        let mut p = p;
        let addr = p.first_line.rsplit(' ').next().unwrap().to_owned();
        let metrics = p.next_addr();
        self.masters.push((p, addr.clone(), metrics));
        addr
    }

    fn add_node(&mut self) {
        let dir = unique_dir("cluster-ssd");
        self.dirs.push(dir.clone());
        self.add_node_in(&dir);
    }

    /// A storage node with an SSD tier in `dir` (a node restarted on its directory).
    fn add_node_in(&mut self, dir: &std::path::Path) {
        let node = Proc::spawn(
            &[],
            &bin("mooncake-client"),
            &[
                "serve",
                "--master",
                &self.address(),
                "--listen",
                "127.0.0.1:0",
                "--segment-size",
                "64MiB",
                "--ssd-dir",
                dir.to_str().unwrap(),
                "--ssd-capacity",
                "64MiB",
            ],
        );
        assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
        self.nodes.push(node);
    }

    /// A storage node without an SSD tier that drains for at most `grace` seconds on
    /// SIGTERM.
    fn add_plain_node(&mut self, grace: &str) {
        let address = self.address();
        let args = [
            "serve",
            "--master",
            &address,
            "--listen",
            "127.0.0.1:0",
            "--segment-size",
            "64MiB",
            "--drain-grace",
            grace,
        ];
        let node = Proc::spawn(&[], &bin("mooncake-client"), &args);
        assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
        self.nodes.push(node);
    }

    /// Waits until the masters lead the 16 groups in equal shares.
    fn wait_balanced(&self) {
        let n = self.masters.len();
        wait_until(Duration::from_secs(15), || {
            let counts = count_by_leader(&self.leaders());
            counts.len() == n && counts.values().all(|&k| k == 16 / n || k == 16_usize.div_ceil(n))
        });
    }

    fn watcher(&self) -> SlotMapWatcher {
        SlotMapWatcher::connect(&self.address().parse::<EtcdAddress>().unwrap()).unwrap()
    }

    /// Leader address of every group (None: leaderless).
    fn leaders(&self) -> Vec<Option<String>> {
        let map = self.watcher().map();
        (0..map.groups()).map(|g| map.leader(g).map(|l| l.addr.clone())).collect()
    }

    /// Waits until every group is led by a live master; returns how long it took.
    fn wait_all_led(&self, limit: Duration) -> Duration {
        let start = Instant::now();
        let live: Vec<String> = self.masters.iter().map(|(_, a, _)| a.clone()).collect();
        wait_until(limit, || self.leaders().iter().all(|l| l.as_ref().is_some_and(|a| live.contains(a))));
        start.elapsed()
    }

    fn store(&self) -> Store {
        Store::builder().master_address(&self.address()).global_segment_size(0).build().unwrap()
    }
}

/// The value of a metric in Prometheus text (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

fn count_by_leader(leaders: &[Option<String>]) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for l in leaders.iter().flatten() {
        *n.entry(l.clone()).or_default() += 1;
    }
    n
}

#[test]
fn kill_9_of_a_master_loses_nothing_acknowledged_and_returns_nothing_removed() {
    let Some(mut c) = Cluster::start(3, 2) else { return };
    // The scheduler balances the groups: about a third each.
    wait_until(Duration::from_secs(20), || {
        let counts = count_by_leader(&c.leaders());
        counts.len() == 3 && counts.values().all(|&n| (5..=6).contains(&n))
    });

    let store = c.store();
    let two = ReplicateConfig::replicas(2);
    let value = |i: usize| payload(i as u8, 1000 + (i * 37) % 7000);
    for i in 0..500 {
        store.put_with(&format!("obj/{i}"), &value(i), &two).unwrap();
    }
    for i in (0..500).step_by(10) {
        store.remove(&format!("obj/{i}")).unwrap();
    }

    let (mut victim, victim_addr, _) = c.masters.remove(0);
    let victim_groups = c.leaders().iter().flatten().filter(|a| **a == victim_addr).count();
    victim.kill9();
    // (A generous limit: the lease runs out in 2 s, but a loaded machine may take
    // much longer to elect and take over; how long it took is printed.)
    let took = c.wait_all_led(Duration::from_secs(20));
    eprintln!("every group led again {took:?} after kill -9");
    assert!(!c.leaders().iter().flatten().any(|a| a == &victim_addr));
    // The survivors count the takeovers as failovers, and the slot map shows them.
    // A survivor counts a takeover once its handler has taken the group up, which
    // may end after etcd (and so the slot map) already names it: wait for the count.
    let failovers = || -> usize {
        c.masters
            .iter()
            .map(|(_, _, m)| metric(&support::http_request(m, "/metrics", None).1, "mooncake_cluster_failovers_total"))
            .sum::<f64>() as usize
    };
    wait_until(Duration::from_secs(20), || failovers() >= victim_groups);
    assert_eq!(failovers(), victim_groups);
    let out =
        std::process::Command::new(bin("mooncake-client")).args(["slots", "--master", &c.address()]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.starts_with("16 slot groups"), "{text}");
    assert!(text.lines().skip(1).all(|l| c.masters.iter().any(|(_, a, _)| l.contains(a.as_str()))), "{text}");

    for i in 0..500 {
        let key = format!("obj/{i}");
        if i % 10 == 0 {
            assert!(matches!(store.get(&key), Err(Error::NotFound(_))), "{key} was removed and came back");
        } else {
            assert_eq!(&store.get(&key).unwrap()[..], &value(i)[..], "{key}");
        }
    }
    for i in 500..550 {
        store.put_with(&format!("obj/{i}"), &value(i), &two).unwrap();
        assert_eq!(&store.get(&format!("obj/{i}")).unwrap()[..], &value(i)[..]);
    }
}

#[test]
fn a_master_stopped_past_its_lease_answers_nothing_for_the_slots_it_lost() {
    let Some(c) = Cluster::start(2, 1) else { return };
    let store = c.store();
    for i in 0..100 {
        store.put(&format!("k{i}"), &payload(i as u8, 2000)).unwrap();
    }
    let stopped_addr = c.masters[0].1.clone();
    let watcher = c.watcher();
    let map = watcher.map();
    let led: Vec<u32> = (0..map.groups()).filter(|&g| map.leader(g).is_some_and(|l| l.addr == stopped_addr)).collect();
    assert!(!led.is_empty());
    // A key of a group the stopped master leads, and a client connected to it before.
    let key = (0..100).map(|i| format!("k{i}")).find(|k| led.contains(&map.group_of_key(k))).unwrap();
    let direct = RpcMasterClient::connect(&stopped_addr).unwrap();
    assert!(direct.get_replica_list(&key).is_ok(), "it answers while it leads");

    c.masters[0].0.signal("STOP");
    // Its groups move once its lease lapses.
    wait_until(Duration::from_secs(3 * LEASE_MS / 1000 + 15), || {
        let map = watcher.map();
        led.iter().all(|&g| map.leader(g).is_some_and(|l| l.addr != stopped_addr))
    });
    // Meanwhile the cluster serves every key through the other master.
    for i in 0..100 {
        assert_eq!(&store.get(&format!("k{i}")).unwrap()[..], &payload(i as u8, 2000)[..]);
    }
    c.masters[0].0.signal("CONT");
    // Resumed, it must not answer for a slot it no longer leads: not even the first
    // request it reads, which may have waited in its socket.
    match direct.get_replica_list(&key) {
        Err(Error::Moved { leader, .. }) => assert_ne!(leader.as_deref(), Some(stopped_addr.as_str())),
        other => panic!("a stopped master answered for a slot it lost: {other:?}"),
    }
    for i in 0..100 {
        assert_eq!(&store.get(&format!("k{i}")).unwrap()[..], &payload(i as u8, 2000)[..]);
    }
}

#[test]
fn a_joining_master_takes_a_share_and_nothing_is_lost() {
    let Some(mut c) = Cluster::start(1, 1) else { return };
    let store = c.store();
    for i in 0..200 {
        store.put(&format!("j{i}"), &payload(i as u8, 3000)).unwrap();
    }
    let newcomer = c.add_master();
    wait_until(Duration::from_secs(20), || {
        let counts = count_by_leader(&c.leaders());
        counts.get(&newcomer).is_some_and(|&n| n >= 6) && c.leaders().iter().all(Option::is_some)
    });
    for i in 0..200 {
        assert_eq!(&store.get(&format!("j{i}")).unwrap()[..], &payload(i as u8, 3000)[..], "j{i}");
    }
    for i in 200..250 {
        store.put(&format!("j{i}"), &payload(i as u8, 3000)).unwrap();
    }
}

#[test]
fn masters_stop_serving_without_etcd_and_resume_when_it_returns() {
    let Some(mut c) = Cluster::start(1, 1) else { return };
    let store = c.store();
    for i in 0..50 {
        store.put(&format!("e{i}"), &payload(i as u8, 1000)).unwrap();
    }
    let direct = RpcMasterClient::connect(&c.masters[0].1).unwrap();
    assert!(direct.exists("e1").unwrap());
    c.etcd.kill();
    // Its lease cannot be renewed: within a lease it answers no key.
    wait_until(Duration::from_secs(2 * LEASE_MS / 1000 + 3), || {
        matches!(direct.exists("e1"), Err(Error::Moved { .. }))
    });
    c.etcd.restart();
    wait_until(Duration::from_secs(15), || matches!(direct.exists("e1"), Ok(true)));
    for i in 0..50 {
        assert_eq!(&store.get(&format!("e{i}")).unwrap()[..], &payload(i as u8, 1000)[..], "e{i}");
    }
}

#[test]
fn upserts_are_routed_to_the_leader_of_each_key() {
    let Some(c) = Cluster::start(2, 1) else { return };
    let store = c.store();
    let keys: Vec<String> = (0..40).map(|i| format!("up/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        store.put(k, &vec![1u8; 1000 + i]).unwrap();
    }
    // Keys of both masters' groups, one at a time and in one batch.
    for (i, k) in keys.iter().enumerate().take(20) {
        store.upsert(k, &vec![2u8; 2000 + i]).unwrap();
    }
    let values: Vec<Vec<u8>> = (20..40).map(|i| vec![3u8; 3000 + i]).collect();
    let items: Vec<(&str, &[u8])> =
        keys[20..].iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
    assert!(store.batch_upsert(&items, &ReplicateConfig::default()).iter().all(|r| r.is_ok()));
    for (i, k) in keys.iter().enumerate() {
        let want = if i < 20 { vec![2u8; 2000 + i] } else { vec![3u8; 3000 + i] };
        assert_eq!(store.get(k).unwrap().to_vec(), want, "{k}");
    }
}

/// Pages of keys from a cluster of two masters, each master's page cut short:
/// walked page after page, every key once, sorted (a merged page stops where the
/// first master's page stopped, so the next page skips none of its keys).
#[test]
fn the_keys_of_every_master_are_listed_page_by_page() {
    let Some(c) = Cluster::start(2, 1) else { return };
    let store = c.store();
    let mut keys: Vec<String> = (0..60).map(|i| format!("ls/{i:02}")).collect();
    for k in &keys {
        store.put(k, b"v").unwrap();
    }
    keys.sort();
    let on_each: Vec<usize> = c
        .masters
        .iter()
        .map(|(_, addr, _)| RpcMasterClient::connect(addr).unwrap().list_keys(100).unwrap().len())
        .collect();
    assert!(on_each.iter().all(|&n| n > 0) && on_each.iter().sum::<usize>() == 60, "{on_each:?}");
    let mut walked: Vec<String> = Vec::new();
    for _ in 0..60 {
        let page = store.master().list_keys_after(walked.last().map_or("", String::as_str), 7).unwrap();
        assert!(page.len() <= 7);
        if page.is_empty() {
            break;
        }
        walked.extend(page);
    }
    assert_eq!(walked, keys);
    assert_eq!(store.master().all_keys().unwrap(), keys);
}

#[test]
fn a_drained_node_leaves_the_cluster_without_losing_an_object() {
    let Some(mut c) = Cluster::start(2, 3) else { return };
    let store = c.store();
    let node = c.nodes[0].first_line.rsplit(' ').next().unwrap().to_owned();
    let values: Vec<(String, Vec<u8>)> = (0..300).map(|i| (format!("drain/{i}"), payload(i as u8, 4096 + i))).collect();
    for (k, v) in &values {
        store.put(k, v).unwrap();
    }
    // Which masters' segments (extents) are the drained node's.
    let on_node = |store: &Store, key: &str| -> bool {
        let info = store.master().object_info(key).unwrap();
        info.replicas.iter().any(|r| store.master().segment_info(r.segment).is_ok_and(|s| s.name.starts_with(&node)))
    };
    let before = values.iter().filter(|(k, _)| on_node(&store, k)).count();
    assert!(before > 30, "objects should be spread over the 3 nodes: {before} on the drained one");
    let out = std::process::Command::new(bin("mooncake-client"))
        .args(["drain", "--master", &c.address(), &node, "--grace", "20"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout} {}", String::from_utf8_lossy(&out.stderr));
    let status = store.master().drain_status(&node).unwrap();
    // Every master marked its extents of the node draining (16 groups over 2 masters).
    assert_eq!(status.segments, 16, "{status:?}");
    assert!(status.done && status.objects_lost == 0 && status.objects_total >= before as u64, "{status:?}");
    for (k, _) in &values {
        assert!(!on_node(&store, k), "{k} still lives on the drained node");
    }
    c.nodes[0].signal("KILL");
    let _ = c.nodes[0].wait(Duration::from_secs(5));
    let fresh = c.store();
    for (k, v) in &values {
        assert_eq!(&fresh.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &v[..], "{k}");
    }
}

/// The transfer endpoint a storage node serves at (what names it to a drain).
fn endpoint_of(node: &Proc) -> String {
    node.first_line.rsplit(' ').next().unwrap().to_owned()
}

/// Keys (`prefix/i`) whose slot group the master at `addr` leads now.
fn keys_led_by(c: &Cluster, addr: &str, prefix: &str, n: usize) -> Vec<String> {
    let map = c.watcher().map();
    (0..)
        .map(|i| format!("{prefix}/{i}"))
        .filter(|k| map.leader(map.group_of_key(k)).is_some_and(|l| l.addr == addr))
        .take(n)
        .collect()
}

#[test]
fn a_leader_change_in_the_middle_of_a_drain_round_is_no_clean_end() {
    let Some(mut c) = Cluster::start(2, 0) else { return };
    c.wait_balanced();
    // A lone node: its drain has nowhere to copy to and goes round after round.
    c.add_plain_node("40");
    let store = c.store();
    let victim = c.masters[0].1.clone();
    // Only keys of the groups the victim leads: once it dies, every object of the
    // node is on an extent mounted again, as a new segment, with the other master.
    let keys = keys_led_by(&c, &victim, "moving", 40);
    for (i, k) in keys.iter().enumerate() {
        store.put(k, &payload(i as u8, 3000 + i)).unwrap();
    }
    let node = endpoint_of(&c.nodes[0]);
    c.nodes[0].signal("TERM");
    wait_until(Duration::from_secs(20), || store.master().drain_status(&node).is_ok_and(|p| p.started));
    // Its rounds' looks wait through the failover and answer the new segments.
    let (mut dead, _, _) = c.masters.remove(0);
    dead.kill9();
    c.wait_all_led(Duration::from_secs(20));
    assert_eq!(c.nodes[0].wait(Duration::from_secs(2)), None, "the node stopped with its objects still only there");
    // Room for the copies: the drain moves everything there, then the node stops.
    c.add_plain_node("0");
    assert_eq!(c.nodes[0].wait(Duration::from_secs(40)), Some(0), "the drain should end and serve exit");
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(&store.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &payload(i as u8, 3000 + i)[..], "{k}");
    }
}

#[test]
fn a_new_leader_learns_of_the_objects_only_on_a_restarted_nodes_ssd() {
    let Some(mut c) = Cluster::start_with(2, 0, &["--persist", "eager"]) else { return };
    c.wait_balanced();
    let dir = support::unique_dir("cluster-ssd-restart");
    c.dirs.push(dir.clone());
    c.add_node_in(&dir);
    let store = c.store();
    let keys: Vec<String> = (0..100).map(|i| format!("disk/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        store.put(k, &payload(i as u8, 2000 + i)).unwrap();
    }
    // Every object written to the node's SSD (write-behind).
    wait_until(Duration::from_secs(15), || {
        keys.iter().all(|k| store.master().get_replica_list(k).is_ok_and(|l| l.disk.is_some()))
    });
    // The node restarts on its directory: its memory is empty, its SSD holds all.
    c.nodes[0].kill9();
    c.nodes.clear();
    c.add_node_in(&dir);
    let read_all = |store: &Store| {
        for (i, k) in keys.iter().enumerate() {
            let got = store.get(k).unwrap_or_else(|e| panic!("{k}: {e}"));
            assert_eq!(&got[..], &payload(i as u8, 2000 + i)[..], "{k}");
        }
    };
    wait_until(Duration::from_secs(15), || keys.iter().all(|k| store.get(k).is_ok()));
    read_all(&store);
    // The survivor takes the dead master's groups; the node mounts its extents there
    // (no memory record to take back) and the new leader must learn of the SSD's objects.
    let (mut dead, _, _) = c.masters.remove(0);
    dead.kill9();
    c.wait_all_led(Duration::from_secs(20));
    // Fresh clients: none reads through replica lists cached before the failover.
    read_all(&c.store());
    // Still there once the new leader's recovery window closed.
    std::thread::sleep(Duration::from_millis(2500));
    read_all(&c.store());
}

#[test]
fn a_drained_node_stays_draining_when_its_extents_move_to_a_new_master() {
    let Some(mut c) = Cluster::start(1, 2) else { return };
    let node = endpoint_of(&c.nodes[0]);
    let out = std::process::Command::new(bin("mooncake-client"))
        .args(["drain", "--master", &c.address(), &node, "--grace", "20"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // A master joins: half the groups move to it, and the nodes mount those extents there.
    c.add_master();
    c.wait_balanced();
    let store = c.store();
    // A moved extent is mounted at its new master placeable, then marked draining
    // at once (what lands there meanwhile is drained): wait, however slow the
    // machine, until each master marks exactly the 8 extents of the groups it leads
    // (the old one released the moved groups, the new one marked all of its own).
    let masters: Vec<RpcMasterClient> =
        c.masters.iter().map(|(_, a, _)| RpcMasterClient::connect(a).unwrap()).collect();
    let draining = || masters.iter().all(|m| m.drain_status(&node).is_ok_and(|s| s.segments == 8));
    wait_until(Duration::from_secs(20), draining);
    let keys: Vec<String> = (0..200).map(|i| format!("after/{i}")).collect();
    for k in &keys {
        store.put(k, &payload(7, 4096)).unwrap();
    }
    for k in &keys {
        let info = store.master().object_info(k).unwrap();
        for r in &info.replicas {
            let seg = store.master().segment_info(r.segment).unwrap();
            assert!(!seg.name.starts_with(&node), "{k} was placed on the drained node ({})", seg.name);
        }
    }
    let status = store.master().drain_status(&node).unwrap();
    assert_eq!(status.segments, 16, "every extent of the drained node is draining: {status:?}");
}

#[test]
fn a_sigterm_right_after_a_master_died_still_drains_the_node() {
    let Some(mut c) = Cluster::start(2, 0) else { return };
    c.wait_balanced();
    c.add_plain_node("40");
    c.add_plain_node("0");
    let store = c.store();
    let keys: Vec<String> = (0..200).map(|i| format!("term/{i}")).collect();
    for (i, k) in keys.iter().enumerate() {
        store.put(k, &payload(i as u8, 2500 + i)).unwrap();
    }
    let node = endpoint_of(&c.nodes[0]);
    let on_node = keys
        .iter()
        .filter(|k| {
            let info = store.master().object_info(k).unwrap();
            info.replicas
                .iter()
                .any(|r| store.master().segment_info(r.segment).is_ok_and(|s| s.name.starts_with(&node)))
        })
        .count();
    assert!(on_node > 20, "objects should be spread over the 2 nodes: {on_node} on the drained one");
    let (mut dead, _, _) = c.masters.remove(0);
    dead.kill9();
    // At once: the dead master still leads its groups, and cannot be told.
    c.nodes[0].signal("TERM");
    assert_eq!(c.nodes[0].wait(Duration::from_secs(40)), Some(0), "the drain should end and serve exit");
    c.wait_all_led(Duration::from_secs(20));
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(&store.get(k).unwrap_or_else(|e| panic!("{k}: {e}"))[..], &payload(i as u8, 2500 + i)[..], "{k}");
    }
}

/// A node is stopped past its client TTL while keys it holds (one replica of two)
/// are removed: their leaders hand each removal to the other nodes to keep. A
/// leader is then `kill -9`ed and a survivor takes its groups over: the nodes still
/// running mount their extents with it first, handing it the removals; the stopped
/// node comes back last with its records of the removed keys. None may come back.
/// (Before nodes kept removals, the keys of the groups taken over came back.)
#[test]
fn a_new_leader_does_not_take_back_objects_a_forgotten_node_missed_the_removal_of() {
    let Some(mut c) = Cluster::start(2, 3) else { return };
    c.wait_balanced();
    let store = c.store();
    let two = ReplicateConfig::replicas(2);
    let n = 200;
    for i in 0..n {
        store.put_with(&format!("gone/{i}"), &payload(i as u8, 4096), &two).unwrap();
    }
    let metric_sum = |c: &Cluster, name: &str| -> f64 {
        c.masters.iter().map(|(_, _, m)| metric(&support::http_request(m, "/metrics", None).1, name)).sum()
    };
    c.nodes[0].signal("STOP");
    // Forgotten by both masters (each expires it on its own).
    wait_until(Duration::from_secs(20), || {
        c.masters.iter().all(|(_, _, m)| {
            metric(&support::http_request(m, "/metrics", None).1, "mooncake_expired_clients_total") >= 1.0
        })
    });
    for i in 0..n {
        store.remove(&format!("gone/{i}")).unwrap();
    }
    assert!(metric_sum(&c, "mooncake_carried_tombstones_total") > 0.0, "no removal was handed to a node");
    let (mut victim, victim_addr, _) = c.masters.remove(0);
    victim.kill9();
    c.wait_all_led(Duration::from_secs(20));
    assert!(!c.leaders().iter().flatten().any(|a| a == &victim_addr));
    // The running nodes mount their extents of the groups taken over.
    std::thread::sleep(Duration::from_millis(1000));
    c.nodes[0].signal("CONT");
    // The stopped node re-joins and mounts its extents with the survivor.
    std::thread::sleep(Duration::from_millis(3000));
    let mut back = Vec::new();
    for i in 0..n {
        let key = format!("gone/{i}");
        let start = Instant::now();
        loop {
            match store.get(&key) {
                Err(Error::NotFound(_)) => break,
                Ok(_) => {
                    back.push(i);
                    break;
                }
                Err(e) if e.is_retryable() && start.elapsed() < Duration::from_secs(20) => {
                    std::thread::sleep(Duration::from_millis(50))
                }
                Err(e) => panic!("{key}: {e}"),
            }
        }
    }
    assert!(back.is_empty(), "removed keys came back after the failover: {back:?}");
}
