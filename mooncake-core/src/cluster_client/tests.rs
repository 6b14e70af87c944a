//! The router against real masters (in-process services behind real RPC servers on
//! loopback) whose slot groups are fixed by the test, with a slot map the test sets:
//! no etcd needed.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use super::routing::{split, Routes};
use super::{ClusterClient, MapSource};
use crate::cluster::{key_slot, GroupLeader, SlotMap};
use crate::error::Error;
use crate::master::{KeyOwnership, Master, MasterApi};
use crate::rpc::RpcServer;
use crate::MasterConfig;

const GROUPS: u32 = 16;

/// Maps set by the test: `map` now, and the ones a wait for a change moves on to.
#[derive(Default)]
struct TestMaps {
    map: Mutex<Option<Arc<SlotMap>>>,
    next: Mutex<Vec<Arc<SlotMap>>>,
    waits: AtomicUsize,
}

struct Shared(Arc<TestMaps>);

impl MapSource for Shared {
    fn map(&self) -> Arc<SlotMap> {
        self.0.map.lock().clone().expect("a map")
    }

    fn wait_change(&self, _seen: u64, _timeout: Duration) -> Arc<SlotMap> {
        self.0.waits.fetch_add(1, Ordering::Relaxed);
        let mut map = self.0.map.lock();
        if let Some(next) = self.0.next.lock().pop() {
            *map = Some(next);
        }
        map.clone().expect("a map")
    }
}

/// A master that leads the groups of `led`, and only those.
struct Led(Range<u32>);

impl KeyOwnership for Led {
    fn group_of(&self, key: &str) -> u32 {
        u32::from(key_slot(key)) * GROUPS / 16384
    }
    fn leads(&self, group: u32) -> bool {
        self.0.contains(&group)
    }
    fn moved(&self, key: &str) -> Error {
        Error::Moved { slot: key_slot(key), leader: None }
    }
    fn group_moved(&self, group: u32) -> Error {
        Error::Moved { slot: (group * 16384 / GROUPS) as u16, leader: None }
    }
}

struct TestMaster {
    master: Master,
    server: RpcServer,
    addr: String,
}

impl TestMaster {
    /// Requests this master answered.
    fn requests(&self) -> u64 {
        self.server.stats().requests.load(Ordering::Relaxed)
    }
}

fn master(led: Range<u32>) -> TestMaster {
    let master = Master::new(MasterConfig::default()).unwrap();
    master.set_ownership(Arc::new(Led(led)));
    let server = RpcServer::bind("127.0.0.1:0", master.service().clone()).unwrap();
    let addr = server.local_addr().to_string();
    TestMaster { master, server, addr }
}

/// A map at `version` where the groups of each range are led by the address given
/// (None: no leader).
fn map(version: u64, leaders: &[(Range<u32>, Option<&str>)]) -> Arc<SlotMap> {
    let mut m = SlotMap::new(GROUPS).unwrap();
    for (groups, addr) in leaders {
        for g in groups.clone() {
            let leader = addr.map(|a| GroupLeader { master: a.to_owned(), addr: a.to_owned(), epoch: version });
            m.set_leader(g, leader);
        }
    }
    m.set_version(version);
    Arc::new(m)
}

fn client(maps: &Arc<TestMaps>) -> Arc<ClusterClient> {
    ClusterClient::with_maps(
        Box::new(Shared(maps.clone())),
        None,
        Duration::from_secs(5),
        Duration::from_secs(15),
        Vec::new(),
    )
}

fn keys(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("layer{}/block{i}", i % 7)).collect()
}

#[test]
fn a_batch_is_split_by_leader_in_item_order_with_the_leaderless_last() {
    let m = map(1, &[(0..4, Some("a")), (4..8, Some("b")), (8..10, Some("a")), (10..15, Some("c")), (15..16, None)]);
    let routes = Routes::new(m.clone());
    assert_eq!(routes.leaders, ["a", "b", "c"]);
    let keys = keys(2000);
    let items: Vec<&str> = keys.iter().map(String::as_str).collect();
    // Every other item pending (a retry), then all of them.
    for pending in [(0..items.len() as u32).step_by(2).collect::<Vec<u32>>(), (0..items.len() as u32).collect()] {
        let s = split(&routes, &items, &pending);
        let mut seen = Vec::new();
        for b in 0..=routes.leaders.len() {
            let part = s.part(b);
            assert!(part.windows(2).all(|w| w[0] < w[1]), "bucket {b} keeps the items' order");
            for &i in part {
                let leader = m.leader_of_key(items[i as usize]).map(|l| l.addr.as_str());
                assert_eq!(leader, routes.leaders.get(b).map(String::as_str), "item {i} in bucket {b}");
            }
            seen.extend_from_slice(part);
        }
        seen.sort_unstable();
        assert_eq!(seen, pending, "every pending item in exactly one bucket");
        assert!(!s.part(3).is_empty() && !s.part(0).is_empty() && !s.part(2).is_empty());
    }
}

#[test]
fn moved_and_leaderless_items_are_retried_at_their_leaders_and_answered_in_item_order() {
    let (a, b) = (master(0..8), master(8..16));
    let maps = Arc::new(TestMaps::default());
    // A stale map: `a` still leads groups 8..12 (`b` took them) and 12..16 have no
    // leader yet. The next map is right.
    *maps.map.lock() = Some(map(1, &[(0..12, Some(&a.addr)), (12..16, None)]));
    maps.next.lock().push(map(2, &[(0..8, Some(&a.addr)), (8..16, Some(&b.addr))]));
    let c = client(&maps);
    let keys = keys(300);
    let items: Vec<&str> = keys.iter().map(String::as_str).collect();
    let answers = c.batch_get_replica_list(&items);
    assert_eq!(answers.len(), items.len());
    for (key, r) in items.iter().zip(&answers) {
        assert!(matches!(r, Err(Error::NotFound(m)) if m == key), "{key}: {r:?}");
    }
    // `a` refused the keys of the groups it lost, once each; `b` refused none.
    let stale = map(1, &[]);
    let lost = items.iter().filter(|k| (8..12).contains(&stale.group_of_key(k))).count();
    assert!(lost > 0);
    assert_eq!(a.master.stats().moved_answers, lost as u64);
    assert_eq!(b.master.stats().moved_answers, 0);
    assert_eq!(maps.waits.load(Ordering::Relaxed), 1, "one wait for a newer map");

    // A call naming the caller carries the id each master registered it under.
    c.register_client().unwrap();
    let ends: Vec<(&str, u32)> = items.iter().map(|k| (*k, 7)).collect();
    for (key, r) in items.iter().zip(c.batch_put_end(0, &ends)) {
        assert!(matches!(&r, Err(Error::NotFound(m)) if m.starts_with(&format!("{key} "))), "{key}: {r:?}");
    }
    // One key at a time, and every master at once.
    assert!(!c.exists(items[0]).unwrap());
    assert_eq!(c.stats().unwrap().moved_answers, lost as u64);
    assert_eq!(c.remove_all().unwrap(), 0);
    assert!(c.batch_exists(&[]).is_empty());
}

#[test]
fn a_leader_that_does_not_answer_times_out_and_the_others_answer() {
    // A listener that never answers: requests to it time out, the other leader's
    // items are answered meanwhile.
    let a = master(0..8);
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let maps = Arc::new(TestMaps::default());
    *maps.map.lock() = Some(map(1, &[(0..8, Some(&a.addr)), (8..16, Some(&silent_addr))]));
    // One round of routing (no retry), and a short wait for answers.
    let c = ClusterClient::with_maps(
        Box::new(Shared(maps.clone())),
        None,
        Duration::from_millis(300),
        Duration::ZERO,
        Vec::new(),
    );
    let keys = keys(64);
    let items: Vec<&str> = keys.iter().map(String::as_str).collect();
    let started = std::time::Instant::now();
    let answers = c.batch_exists(&items);
    assert!(started.elapsed() < Duration::from_secs(3), "waited {:?}", started.elapsed());
    let m = maps.map.lock().clone().unwrap();
    for (key, r) in items.iter().zip(&answers) {
        if m.group_of_key(key) < 8 {
            assert!(matches!(r, Ok(false)), "{key}: {r:?}");
        } else {
            assert!(matches!(r, Err(Error::Timeout(_))), "{key}: {r:?}");
        }
    }
    drop(silent);
}

#[test]
fn concurrent_batches_to_the_same_masters_are_combined_and_each_gets_its_own_answers() {
    let (a, b) = (master(0..8), master(8..16));
    let maps = Arc::new(TestMaps::default());
    *maps.map.lock() = Some(map(1, &[(0..8, Some(&a.addr)), (8..16, Some(&b.addr))]));
    let c = client(&maps);
    c.register_client().unwrap();
    let (threads, calls) = (16, 40);
    let requests_before = a.requests() + b.requests();
    let started = std::time::Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let c = &c;
            s.spawn(move || {
                for n in 0..calls {
                    // Each thread's own keys, and a different batch size each time.
                    let keys: Vec<String> = (0..1 + (t * 7 + n) % 97).map(|i| format!("t{t}/c{n}/k{i}")).collect();
                    let items: Vec<(&str, u32)> = keys.iter().map(|k| (k.as_str(), 1)).collect();
                    let answers = c.batch_put_end(0, &items);
                    assert_eq!(answers.len(), items.len());
                    for ((key, _), r) in items.iter().zip(&answers) {
                        assert!(
                            matches!(r, Err(Error::NotFound(m)) if m.starts_with(&format!("{key} "))),
                            "{key}: {r:?}"
                        );
                    }
                }
            });
        }
    });
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
    // Every call had a part for each master; the masters answered fewer requests.
    let parts = (threads * calls * 2) as u64;
    let requests = a.requests() + b.requests() - requests_before;
    eprintln!("{parts} parts in {requests} requests");
    assert!(requests < parts, "{parts} parts in {requests} requests: nothing combined");
}

#[test]
fn concurrent_batches_travel_in_rounds_that_ask_every_master_once() {
    // Every call has keys of both masters' groups (64 keys each). In rounds, each
    // request to one master goes with one to the other: both answer as many requests,
    // whatever their speeds. (With a queue per master cycling on its own, the counts
    // drift apart.)
    let (a, b) = (master(0..8), master(8..16));
    let maps = Arc::new(TestMaps::default());
    *maps.map.lock() = Some(map(1, &[(0..8, Some(&a.addr)), (8..16, Some(&b.addr))]));
    let c = client(&maps);
    let (threads, calls) = (8, 30);
    let m = maps.map.lock().clone().unwrap();
    let (a_before, b_before) = (a.requests(), b.requests());
    std::thread::scope(|s| {
        for t in 0..threads {
            let (c, m) = (&c, &m);
            s.spawn(move || {
                for n in 0..calls {
                    let keys: Vec<String> = (0..64).map(|i| format!("r{t}/c{n}/k{i}")).collect();
                    let items: Vec<&str> = keys.iter().map(String::as_str).collect();
                    assert!(
                        items.iter().any(|k| m.group_of_key(k) < 8) && items.iter().any(|k| m.group_of_key(k) >= 8)
                    );
                    assert!(c.batch_exists(&items).iter().all(|r| matches!(r, Ok(false))));
                }
            });
        }
    });
    let (to_a, to_b) = (a.requests() - a_before, b.requests() - b_before);
    eprintln!("{} calls: {to_a} requests to a, {to_b} to b", threads * calls);
    assert_eq!(to_a, to_b, "every round asks both masters once");
    assert!(to_a < (threads * calls) as u64, "{to_a} requests for {} calls: nothing combined", threads * calls);
}

fn added(segment: u64, i: usize) -> crate::master::RecordUpdate {
    let record = crate::master::ObjectRecord { key: format!("k{i}"), offset: 0, len: 1, checksum: 0, generation: 1 };
    crate::master::RecordUpdate::Added { segment, record }
}

/// Record updates for extents whose mount answer has not arrived wait for it, up to
/// a bound; a batch sent to the record endpoint that cannot wait whole is refused
/// (the master sends it again), never answered and dropped. From a heartbeat (sent
/// once), what fits is kept.
#[test]
fn record_updates_that_cannot_wait_for_their_extent_are_refused_not_dropped() {
    use crate::rpc::wire::{Request, Response};
    use crate::rpc::RpcHandler;
    use crate::store::cluster::{ClusterRecords, MAX_UNROUTED};

    let maps = Arc::new(TestMaps::default());
    *maps.map.lock() = Some(map(1, &[(0..GROUPS, Some("a"))]));
    let c = client(&maps);
    let endpoint = ClusterRecords(c.clone());
    let batch = |from: usize, n: usize| (from..from + n).map(|i| added(7, i)).collect::<Vec<_>>();
    let waiting = || c.unrouted.lock().len();
    let apply = |updates| endpoint.handle(Request::ApplyRecords { updates });

    assert!(matches!(apply(batch(0, MAX_UNROUTED - 10)), Response::Unit));
    assert_eq!(waiting(), MAX_UNROUTED - 10);
    // Eleven more cannot all wait: none is taken, and the answer says so.
    assert!(matches!(apply(batch(MAX_UNROUTED, 11)), Response::Error(_)));
    assert_eq!(waiting(), MAX_UNROUTED - 10);
    // Ten can.
    assert!(matches!(apply(batch(MAX_UNROUTED, 10)), Response::Unit));
    assert_eq!(waiting(), MAX_UNROUTED);
    // A heartbeat's updates are not sent again: what fits is kept (here none).
    assert_eq!(c.apply_updates(batch(2 * MAX_UNROUTED, 5), super::UpdatesFrom::Heartbeat), Ok(()));
    assert_eq!(waiting(), MAX_UNROUTED);
    // A drain request is about no extent: it never waits, and is never refused.
    let drain = crate::master::RecordUpdate::Drain { grace_ms: 5, generation: 2 };
    assert!(matches!(apply(vec![drain]), Response::Unit));
}
