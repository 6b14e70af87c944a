//! Cluster coordination against a real etcd, started per test on loopback.
//!
//! Every test runs a poller that checks, over and over while the test runs, that no
//! group is led (`leads(g)`) by two members at once.
#![cfg(feature = "etcd")]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use mooncake_core::cluster::{
    ClusterMember, EtcdAddress, GroupHandler, GroupLeader, MemberConfig, SlotMap, SlotMapWatcher,
};
use mooncake_core::Error;

const ETCD: &str = "/usr/bin/etcd";
const GROUPS: u32 = 16;
/// etcd's smallest lease (it raises shorter ones to this).
const TTL: Duration = Duration::from_secs(2);

// ---------------------------------------------------------------------------------
// A real etcd.

/// An etcd server on loopback ports, killed with the test.
struct EtcdServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

enum StartError {
    PortTaken,
    Failed(String),
}

impl EtcdServer {
    /// Starts etcd on free ports (trying others when a port is taken), or returns None
    /// (the test is skipped) when etcd is not installed and this is not CI.
    fn start() -> Option<EtcdServer> {
        if !Path::new(ETCD).exists() {
            if std::env::var_os("CI").is_some() {
                panic!("{ETCD} is missing: CI must install etcd (Debian package etcd-server)");
            }
            eprintln!("SKIPPED: {ETCD} is not installed");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        for attempt in 0..20 {
            let (client_port, peer_port) = random_ports(attempt);
            match spawn_etcd(&dir.path().join("data"), client_port, peer_port) {
                Ok(child) => return Some(EtcdServer { child: Some(child), dir, client_port, peer_port }),
                Err(StartError::PortTaken) => continue,
                Err(StartError::Failed(why)) => panic!("etcd did not start: {why}"),
            }
        }
        panic!("etcd found no free port pair in 20 tries");
    }

    fn address(&self, cluster: &str) -> EtcdAddress {
        format!("etcd://127.0.0.1:{}/{cluster}", self.client_port).parse().unwrap()
    }

    /// `kill -9`.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops it (`SIGSTOP`: connections still open, nothing answers) until the
    /// returned thread resumes it, `d` from now.
    fn stop_for(&self, d: Duration) -> thread::JoinHandle<()> {
        let pid = self.child.as_ref().expect("running").id() as libc::pid_t;
        // SAFETY: signals to our own child process.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        thread::spawn(move || {
            thread::sleep(d);
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        })
    }

    /// Starts it again on the same data and ports (clients know only those).
    fn restart(&mut self) {
        assert!(self.child.is_none(), "running");
        for _ in 0..50 {
            match spawn_etcd(&self.dir.path().join("data"), self.client_port, self.peer_port) {
                Ok(child) => {
                    self.child = Some(child);
                    return;
                }
                // The old process's sockets may linger a moment.
                Err(StartError::PortTaken) => thread::sleep(Duration::from_millis(100)),
                Err(StartError::Failed(why)) => panic!("etcd did not restart: {why}"),
            }
        }
        panic!("etcd's ports stayed taken");
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn random_ports(attempt: u32) -> (u16, u16) {
    // Below the kernel's ephemeral range, so outgoing connections do not take them.
    let seed = std::process::id() as u64 * 7919 + attempt as u64 * 104_729 + nanos();
    let client = 10_000 + (seed % 10_000) as u16 * 2;
    (client, client + 1)
}

fn nanos() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos() as u64
}

/// Starts etcd and waits until it serves clients (or exits).
fn spawn_etcd(data: &PathBuf, client_port: u16, peer_port: u16) -> Result<Child, StartError> {
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let mut command = Command::new(ETCD);
    // SAFETY: the closure runs in the forked child before exec and only calls prctl,
    // which is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            // etcd dies with the test thread that started it, even if the test is killed.
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = command
        .args(["--name", "t", "--data-dir"])
        .arg(data)
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("t={peer}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| StartError::Failed(format!("spawn {ETCD}: {e}")))?;
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    // Reads etcd's log to the end (a full pipe would block etcd), reporting readiness.
    thread::spawn(move || {
        let mut tail = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains("ready to serve client requests") {
                let _ = tx.send(Ok(()));
            }
            if std::env::var_os("ETCD_LOG").is_some() {
                eprintln!("etcd: {line}");
            }
            tail.push(line);
            if tail.len() > 20 {
                tail.remove(0);
            }
        }
        let _ = tx.send(Err(tail.join("\n")));
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(Ok(())) => Ok(child),
        Ok(Err(log)) => {
            let _ = child.wait();
            if log.contains("address already in use") {
                Err(StartError::PortTaken)
            } else {
                Err(StartError::Failed(log))
            }
        }
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(StartError::Failed("not ready within 20 s".into()))
        }
    }
}

// ---------------------------------------------------------------------------------
// Members, their handlers, and the poller.

/// What a handler was told, in order, and what it holds now.
/// Calls out of order (a group acquired twice, or released when not held) are kept in
/// `errors`, checked when the cluster settles.
#[derive(Default)]
struct Recorder {
    events: Mutex<Vec<(bool, u32, u64)>>, // (acquired?, group, epoch)
    held: Mutex<BTreeMap<u32, u64>>,
    errors: Mutex<Vec<String>>,
}

impl GroupHandler for Recorder {
    fn acquired(&self, group: u32, epoch: u64) {
        if let Some(old) = self.held.lock().unwrap().insert(group, epoch) {
            self.errors.lock().unwrap().push(format!("group {group} acquired at {epoch} while held at {old}"));
        }
        self.events.lock().unwrap().push((true, group, epoch));
    }

    fn released(&self, group: u32) {
        match self.held.lock().unwrap().remove(&group) {
            Some(epoch) => self.events.lock().unwrap().push((false, group, epoch)),
            None => self.errors.lock().unwrap().push(format!("group {group} released but not held")),
        }
    }
}

impl Recorder {
    fn held(&self) -> BTreeMap<u32, u64> {
        self.held.lock().unwrap().clone()
    }

    fn released(&self) -> Vec<(u32, u64)> {
        self.events.lock().unwrap().iter().filter(|e| !e.0).map(|e| (e.1, e.2)).collect()
    }
}

struct Node {
    member: ClusterMember,
    recorder: Arc<Recorder>,
    addr: String,
}

/// The members of a test, shared with the poller.
#[derive(Clone, Default)]
struct Cluster {
    nodes: Arc<Mutex<Vec<Node>>>,
}

impl Cluster {
    fn join(&self, etcd: &EtcdServer, name: &str) -> String {
        let addr = format!("{name}.test:1");
        let mut config = MemberConfig::new(&etcd.address("t"), addr.clone());
        config.lease_ttl = TTL;
        config.groups = GROUPS;
        config.scan_interval = Duration::from_millis(200);
        let recorder = Arc::new(Recorder::default());
        let member = ClusterMember::join(config, recorder.clone()).expect("join");
        let id = member.id().to_string();
        self.nodes.lock().unwrap().push(Node { member, recorder, addr });
        id
    }

    /// Takes a member out (the poller stops looking at it).
    fn take(&self, id: &str) -> Node {
        let mut nodes = self.nodes.lock().unwrap();
        let i = nodes.iter().position(|n| n.member.id() == id).expect("member");
        nodes.remove(i)
    }

    fn with<T>(&self, id: &str, f: impl FnOnce(&Node) -> T) -> T {
        let nodes = self.nodes.lock().unwrap();
        f(nodes.iter().find(|n| n.member.id() == id).expect("member"))
    }

    /// Groups each member leads now, by id.
    fn led(&self) -> BTreeMap<String, Vec<u32>> {
        let nodes = self.nodes.lock().unwrap();
        nodes
            .iter()
            .map(|n| (n.member.id().to_string(), (0..GROUPS).filter(|&g| n.member.leads(g)).collect()))
            .collect()
    }

    /// Whether every group is led by exactly one member, each member's handler holds
    /// exactly what it leads, and every member leads its share (the floor or the
    /// ceiling of groups / members).
    fn settled(&self) -> bool {
        let nodes = self.nodes.lock().unwrap();
        let (floor, ceil) = (GROUPS as usize / nodes.len().max(1), ceil_share(nodes.len().max(1)));
        (0..GROUPS).all(|g| nodes.iter().filter(|n| n.member.leads(g)).count() == 1)
            && nodes.iter().all(|n| {
                let leads: Vec<u32> = (0..GROUPS).filter(|&g| n.member.leads(g)).collect();
                n.recorder.held().keys().copied().collect::<Vec<_>>() == leads && (floor..=ceil).contains(&leads.len())
            })
    }

    /// The slot map the handlers describe: each group's holder and epoch.
    fn truth(&self) -> SlotMap {
        let nodes = self.nodes.lock().unwrap();
        let mut map = SlotMap::new(GROUPS).unwrap();
        for n in nodes.iter() {
            for (g, epoch) in n.recorder.held() {
                let leader = GroupLeader { master: n.member.id().into(), addr: n.addr.clone(), epoch };
                map.set_leader(g, Some(leader));
            }
        }
        map
    }
}

/// Checks, until dropped, that no group is led by two members at once.
struct Poller {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<(u64, Vec<String>)>>,
}

impl Poller {
    fn start(cluster: &Cluster) -> Poller {
        let stop = Arc::new(AtomicBool::new(false));
        let (cluster, flag) = (cluster.clone(), stop.clone());
        let thread = thread::spawn(move || {
            let (mut rounds, mut violations) = (0u64, Vec::new());
            while !flag.load(Ordering::Relaxed) {
                {
                    let nodes = cluster.nodes.lock().unwrap();
                    for g in 0..GROUPS {
                        let leaders: Vec<&str> =
                            nodes.iter().filter(|n| n.member.leads(g)).map(|n| n.member.id()).collect();
                        if leaders.len() > 1 {
                            violations.push(format!("group {g} led by {leaders:?}"));
                        }
                    }
                }
                rounds += 1;
                thread::sleep(Duration::from_millis(1));
            }
            (rounds, violations)
        });
        Poller { stop, thread: Some(thread) }
    }

    /// Stops and asserts that no group ever had two leaders.
    fn finish(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let (rounds, violations) = self.thread.take().unwrap().join().unwrap();
        assert!(rounds > 10, "the poller ran only {rounds} rounds");
        assert!(violations.is_empty(), "two leaders at once: {:?}", &violations[..violations.len().min(10)]);
    }
}

/// Records every map a watcher hands out through `wait_change`.
struct MapLog {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<Vec<Arc<SlotMap>>>>,
}

impl MapLog {
    fn start(watcher: Arc<SlotMapWatcher>) -> MapLog {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = thread::spawn(move || {
            let mut seen = vec![watcher.map()];
            while !flag.load(Ordering::Relaxed) {
                let map = watcher.wait_change(seen.last().unwrap().version(), Duration::from_millis(50));
                if map.version() != seen.last().unwrap().version() {
                    seen.push(map);
                }
            }
            seen
        });
        MapLog { stop, thread: Some(thread) }
    }

    fn finish(mut self) -> Vec<Arc<SlotMap>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until the cluster settled and the watcher's map says what the handlers hold.
fn assert_settles(cluster: &Cluster, watcher: &SlotMapWatcher, within: Duration) {
    let ok = wait_until(within, || cluster.settled() && watcher.map().as_ref().eq_leaders(&cluster.truth()));
    assert!(
        ok,
        "not settled within {within:?}: led {:?}\nwatcher {:?}\ntruth {:?}",
        cluster.led(),
        watcher.map().ranges(),
        cluster.truth().ranges()
    );
    for n in cluster.nodes.lock().unwrap().iter() {
        let errors = n.recorder.errors.lock().unwrap();
        assert!(errors.is_empty(), "handler of {} was told out of order: {errors:?}", n.member.id());
    }
}

trait EqLeaders {
    fn eq_leaders(&self, other: &SlotMap) -> bool;
}

impl EqLeaders for SlotMap {
    fn eq_leaders(&self, other: &SlotMap) -> bool {
        self.groups() == other.groups() && (0..self.groups()).all(|g| self.leader(g) == other.leader(g))
    }
}

fn ceil_share(members: usize) -> usize {
    (GROUPS as usize).div_ceil(members)
}

// ---------------------------------------------------------------------------------
// The tests.

#[test]
fn one_member_leads_every_group_and_leaves_cleanly() {
    let Some(etcd) = EtcdServer::start() else { return };
    let cluster = Cluster::default();
    let poller = Poller::start(&cluster);
    let a = cluster.join(&etcd, "a");
    let watcher = SlotMapWatcher::connect(&etcd.address("t")).expect("watcher");
    assert_eq!(watcher.map().groups(), GROUPS);
    assert_settles(&cluster, &watcher, Duration::from_secs(10));
    assert_eq!(cluster.led()[&a].len(), GROUPS as usize);
    let stats = cluster.with(&a, |n| n.member.stats());
    assert_eq!((stats.groups_led, stats.slots_led, stats.acquired_total), (GROUPS, 16384, u64::from(GROUPS)));
    assert_eq!(stats.failovers, 0, "a new cluster's groups had no leader to fail");
    assert!(stats.is_scheduler);
    assert!(stats.lease_renewals > 0 || wait_until(TTL, || cluster.with(&a, |n| n.member.stats().lease_renewals) > 0));
    // The member's own map catches up through its watch.
    let truth = cluster.truth();
    assert!(wait_until(Duration::from_secs(5), || cluster.with(&a, |n| n.member.slot_map().eq_leaders(&truth))));
    let map = cluster.with(&a, |n| n.member.slot_map());
    assert!(map.is_complete());
    assert_eq!(map.masters(), vec![(a.clone(), "a.test:1".to_string())]);
    assert_eq!(map.ranges().len(), GROUPS as usize, "one range per group: each has its own epoch");
    assert_eq!(watcher.members(), vec![(a.clone(), "a.test:1".to_string())]);

    // The cluster's group count is fixed at creation: a member asking for 32 gets 16.
    let mut config = MemberConfig::new(&etcd.address("t"), "b.test:1");
    config.groups = 32;
    config.lease_ttl = TTL;
    let b = ClusterMember::join(config, Arc::new(Recorder::default())).expect("join");
    assert_eq!(b.groups(), GROUPS);
    drop(b);

    // Leaving releases everything and empties the map.
    let node = cluster.take(&a);
    drop(node.member);
    assert!(node.recorder.held().is_empty());
    assert_eq!(node.recorder.released().len(), GROUPS as usize);
    assert!(wait_until(Duration::from_secs(5), || watcher.map().ranges() == vec![(0..=16383, None)]));
    assert!(wait_until(Duration::from_secs(5), || watcher.members().is_empty()));
    poller.finish();
}

#[test]
fn members_split_the_groups_and_a_newcomer_takes_a_share() {
    let Some(etcd) = EtcdServer::start() else { return };
    let cluster = Cluster::default();
    let poller = Poller::start(&cluster);
    let a = cluster.join(&etcd, "a");
    let watcher = Arc::new(SlotMapWatcher::connect(&etcd.address("t")).expect("watcher"));
    let log = MapLog::start(watcher.clone());
    assert_settles(&cluster, &watcher, Duration::from_secs(10));
    let before = cluster.with(&a, |n| n.recorder.held());

    let b = cluster.join(&etcd, "b");
    assert_settles(&cluster, &watcher, Duration::from_secs(10));
    let led = cluster.led();
    assert_eq!((led[&a].len(), led[&b].len()), (8, 8), "{led:?}");
    // Every group that moved was released by `a` first, and its new epoch is later.
    let released = cluster.with(&a, |n| n.recorder.released());
    assert_eq!(released.len(), 8);
    let b_held = cluster.with(&b, |n| n.recorder.held());
    for (g, old_epoch) in &released {
        assert_eq!(before[g], *old_epoch);
        assert!(b_held[g] > *old_epoch, "group {g}: epoch {} after {old_epoch}", b_held[g]);
    }
    assert_eq!(cluster.with(&b, |n| n.member.stats().failovers), 0, "a handoff is not a failover");

    let c = cluster.join(&etcd, "c");
    assert_settles(&cluster, &watcher, Duration::from_secs(10));
    let led = cluster.led();
    for id in [&a, &b, &c] {
        assert!(led[id].len() <= ceil_share(3) && led[id].len() >= 5, "{led:?}");
    }
    assert_eq!(led.values().map(Vec::len).sum::<usize>(), GROUPS as usize);
    assert_eq!(watcher.members().len(), 3);

    // The watcher saw the changes in order and ends on the truth.
    let maps = log.finish();
    assert!(maps.windows(2).all(|w| w[0].version() < w[1].version()), "versions go up");
    assert!(maps.last().unwrap().eq_leaders(&cluster.truth()));
    assert!(maps.len() >= 3, "saw {} maps", maps.len());
    poller.finish();
}

#[test]
fn a_crashed_members_groups_move_within_the_ttl() {
    let Some(etcd) = EtcdServer::start() else { return };
    let cluster = Cluster::default();
    let poller = Poller::start(&cluster);
    let ids: Vec<String> = ["a", "b", "c"].iter().map(|n| cluster.join(&etcd, n)).collect();
    let watcher = Arc::new(SlotMapWatcher::connect(&etcd.address("t")).expect("watcher"));
    assert_settles(&cluster, &watcher, Duration::from_secs(15));
    // Crash the scheduler, so a new one must be elected too.
    let victim =
        ids.iter().find(|id| cluster.with(id, |n| n.member.stats().is_scheduler)).expect("a scheduler").clone();
    let lost = cluster.with(&victim, |n| n.recorder.held());
    assert!(!lost.is_empty());
    let log = MapLog::start(watcher.clone());
    let crashed_at = Instant::now();
    let node = cluster.take(&victim);
    let released_before = node.recorder.released().len();
    node.member.crash();
    assert_eq!(node.recorder.released().len(), released_before, "a crash calls nothing");

    let moved = wait_until(TTL + Duration::from_secs(2), || cluster.settled());
    let took = crashed_at.elapsed();
    assert!(moved, "groups did not move within ttl + 2 s: {:?}", cluster.led());
    eprintln!("failover of {} groups took {took:?}", lost.len());
    assert_settles(&cluster, &watcher, Duration::from_secs(5));
    let truth = cluster.truth();
    for (g, old) in &lost {
        let now = truth.leader(*g).unwrap();
        assert!(now.epoch > *old, "group {g}: epoch {} after {old}", now.epoch);
        assert_ne!(now.master, victim);
    }
    let survivors: Vec<&String> = ids.iter().filter(|id| **id != victim).collect();
    let failovers: u64 = survivors.iter().map(|id| cluster.with(id, |n| n.member.stats().failovers)).sum();
    assert_eq!(failovers, lost.len() as u64);
    assert!(survivors.iter().any(|id| cluster.with(id, |n| n.member.stats().is_scheduler)), "a new scheduler");
    let led = cluster.led();
    assert!(led.values().all(|g| g.len() == 8), "{led:?}");
    assert_eq!(watcher.members().len(), 2);
    let maps = log.finish();
    assert!(maps.windows(2).all(|w| w[0].version() < w[1].version()));
    assert!(maps.iter().any(|m| lost.keys().any(|g| m.leader(*g).is_none())), "the watcher saw the groups leaderless");
    poller.finish();
}

#[test]
fn a_stalled_member_stops_leading_before_its_groups_move() {
    let Some(etcd) = EtcdServer::start() else { return };
    let cluster = Cluster::default();
    let poller = Poller::start(&cluster);
    let a = cluster.join(&etcd, "a");
    let b = cluster.join(&etcd, "b");
    let watcher = SlotMapWatcher::connect(&etcd.address("t")).expect("watcher");
    assert_settles(&cluster, &watcher, Duration::from_secs(15));
    let held = cluster.with(&a, |n| n.recorder.held());

    // Stop `a`'s coordination (its renewals) past the lease, as SIGSTOP would.
    let stall = TTL + Duration::from_secs(3);
    let stalled_at = Instant::now();
    cluster.with(&a, |n| n.member.stall(stall));
    assert!(wait_until(TTL, || cluster.led()[&a].is_empty()), "a still leads after the ttl");
    let fenced_after = stalled_at.elapsed();
    assert!(fenced_after < TTL, "fenced after {fenced_after:?}");
    // `b` takes every group while `a` is still stopped; the poller checks that `a`
    // answered for none of them meanwhile.
    assert!(wait_until(stall, || cluster.led()[&b].len() == GROUPS as usize), "{:?}", cluster.led());
    assert!(stalled_at.elapsed() < stall, "b took over only after a resumed");

    // When `a` resumes it finds its lease gone, releases everything, registers again
    // and gets its share back.
    assert_settles(&cluster, &watcher, Duration::from_secs(15));
    let stats = cluster.with(&a, |n| n.member.stats());
    assert_eq!(stats.lease_lapses, 1);
    let released: Vec<u32> = cluster.with(&a, |n| n.recorder.released()).iter().map(|r| r.0).collect();
    assert!(held.keys().all(|g| released.contains(g)), "every group released after the lapse");
    let led = cluster.led();
    assert_eq!((led[&a].len(), led[&b].len()), (8, 8), "{led:?}");
    assert_eq!(cluster.with(&b, |n| n.member.stats().failovers), held.len() as u64);
    poller.finish();
}

#[test]
fn members_stop_when_etcd_dies_and_resume_when_it_returns() {
    let Some(mut etcd) = EtcdServer::start() else { return };
    let cluster = Cluster::default();
    let poller = Poller::start(&cluster);
    let a = cluster.join(&etcd, "a");
    let b = cluster.join(&etcd, "b");
    let watcher = SlotMapWatcher::connect(&etcd.address("t")).expect("watcher");
    assert_settles(&cluster, &watcher, Duration::from_secs(15));

    let killed_at = Instant::now();
    etcd.kill();
    let stopped = wait_until(TTL, || cluster.led().values().all(Vec::is_empty));
    assert!(stopped, "still leading {:?} after {:?}", cluster.led(), killed_at.elapsed());
    // Handlers were told.
    assert!(wait_until(Duration::from_secs(2), || cluster.truth().ranges() == vec![(0..=16383, None)]));
    thread::sleep(Duration::from_secs(1)); // stay down a while

    etcd.restart();
    assert_settles(&cluster, &watcher, Duration::from_secs(20));
    for id in [&a, &b] {
        let stats = cluster.with(id, |n| n.member.stats());
        assert!(stats.lease_lapses >= 1, "{stats:?}");
        assert_eq!(stats.groups_led, 8, "{stats:?}");
    }
    assert_eq!(watcher.members().len(), 2);
    poller.finish();
}

/// A member's first contact outlasts an etcd that gives no answer for a moment
/// (stopped for 1.2 s while requests time out after 0.5 s): it asks again and joins,
/// where one request that timed out used to make a master exit at start.
#[test]
fn a_member_joins_through_an_etcd_that_does_not_answer_for_a_moment() {
    let Some(etcd) = EtcdServer::start() else { return };
    // Known to answer first: the connection is there, etcd then stops answering.
    drop(SlotMapWatcher::connect(&etcd.address("nobody")).unwrap_err());
    let mut config = MemberConfig::new(&etcd.address("t"), "a.test:1");
    config.lease_ttl = Duration::from_secs(1);
    let resumed = etcd.stop_for(Duration::from_millis(1200));
    let started = Instant::now();
    let joined = ClusterMember::join(config, Arc::new(Recorder::default()));
    resumed.join().unwrap();
    let member = joined.expect("joined once etcd answered again");
    assert!(started.elapsed() >= Duration::from_millis(1000), "joined while etcd was stopped");
    let watcher = SlotMapWatcher::connect(&etcd.address("t")).unwrap();
    assert!(wait_until(Duration::from_secs(10), || watcher.members().len() == 1));
    drop(member);
}

#[test]
fn unreachable_etcd_and_missing_cluster_are_clear_errors() {
    // Nothing listens on port 1 of loopback.
    let addr: EtcdAddress = "etcd://127.0.0.1:1/t".parse().unwrap();
    let started = Instant::now();
    let err = ClusterMember::join(MemberConfig::new(&addr, "a:1"), Arc::new(Recorder::default())).unwrap_err();
    assert!(matches!(err, Error::Coordination(ref m) if m.contains("127.0.0.1:1")), "{err}");
    assert!(err.is_retryable());
    assert!(started.elapsed() < Duration::from_secs(10));
    let err = SlotMapWatcher::connect(&addr).unwrap_err();
    assert!(matches!(err, Error::Coordination(_)), "{err}");

    let Some(etcd) = EtcdServer::start() else { return };
    let err = SlotMapWatcher::connect(&etcd.address("nobody")).unwrap_err();
    assert!(matches!(err, Error::Coordination(ref m) if m.contains("no master")), "{err}");
    let mut bad = MemberConfig::new(&etcd.address("t"), "a:1");
    bad.groups = 3;
    assert!(matches!(ClusterMember::join(bad, Arc::new(Recorder::default())), Err(Error::InvalidArgument(_))));
}

/// Every WARN or ERROR event of this test binary, as text (fields included), from the
/// first call on: a global subscriber, as the watcher logs from a thread of its own.
fn warnings() -> &'static Mutex<Vec<String>> {
    static LOG: std::sync::OnceLock<&'static Mutex<Vec<String>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let log: &'static Mutex<Vec<String>> = Box::leak(Box::new(Mutex::new(Vec::new())));
        tracing::subscriber::set_global_default(Warnings(log)).expect("no other subscriber in this test binary");
        log
    })
}

/// The subscriber of [`warnings`].
struct Warnings(&'static Mutex<Vec<String>>);

impl tracing::Subscriber for Warnings {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::WARN
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Text(String);
        impl tracing::field::Visit for Text {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!(" {}={value:?}", field.name()));
            }
        }
        let mut text = Text(format!("{} {}:", event.metadata().level(), event.metadata().target()));
        event.record(&mut text);
        self.0.lock().unwrap().push(text.0);
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn an_idle_watch_stays_open_and_a_clean_shutdown_warns_nothing() {
    let log = warnings();
    let Some(etcd) = EtcdServer::start() else { return };
    // A cluster of its own name: the other tests' warnings are not this one's.
    let mut config = MemberConfig::new(&etcd.address("quiet"), "q.test:1");
    config.lease_ttl = TTL;
    config.groups = GROUPS;
    let member = ClusterMember::join(config, Arc::new(Recorder::default())).expect("join");
    let id = member.id().to_string();
    let watcher = SlotMapWatcher::connect(&etcd.address("quiet")).expect("watcher");
    assert!(wait_until(Duration::from_secs(10), || watcher.map().is_complete()));
    // Nothing changes: the watch stream is idle. etcd closes a connection that pings
    // it more often than its --grpc-keepalive-min-time (5 s) allows, after three
    // such pings: a watcher pinging every 2 s lost its watch (and warned) after
    // about 8 s.
    thread::sleep(Duration::from_secs(11));
    assert!(watcher.map().is_complete());
    drop(watcher);
    drop(member);
    let ours: Vec<String> =
        log.lock().unwrap().iter().filter(|l| l.contains("cluster=quiet") || l.contains(&id)).cloned().collect();
    assert!(ours.is_empty(), "warnings: {ours:#?}");
}
