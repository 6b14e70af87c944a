//! The master's object state machine where replicates, upserts and lost nodes meet:
//! space handed out is never given to another object while a writer may still write
//! it, a lease is never given back twice, and targets sized for one value never join
//! another. Against an embedded `Master`, through its public calls.

mod support;

use std::time::Duration;

use mooncake_core::{ClientId, Error, Master, MasterConfig, ReplicateConfig};
use mooncake_transfer::RemoteRegion;
use support::wait_until;

const LEN: u64 = 4096;

fn client(m: &Master) -> ClientId {
    m.register_client().unwrap().client
}

/// Mounts a segment named `local://{name}#1` for `c`; returns its id and name.
fn segment(m: &Master, c: ClientId, name: &str, capacity: u64) -> (u64, String) {
    let region = RemoteRegion { endpoint: format!("local://{name}"), region: 1 };
    (m.mount_segment(c, &region, capacity).unwrap(), format!("local://{name}#1"))
}

fn on(name: &str) -> ReplicateConfig {
    ReplicateConfig { preferred_segments: vec![name.to_owned()], ..Default::default() }
}

fn replicas(n: usize, names: &[&str]) -> ReplicateConfig {
    ReplicateConfig {
        replica_num: n,
        preferred_segments: names.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn put(m: &Master, c: ClientId, key: &str, cfg: &ReplicateConfig) {
    m.put_start(c, key, LEN, cfg).unwrap();
    m.put_end(c, key, 7).unwrap();
}

/// Two nodes, `a` and `b`, with a 1 MiB segment each, and `k` (4 KiB) on `a`'s.
struct Two {
    m: Master,
    a: ClientId,
    b: ClientId,
    seg_a: String,
    seg_b: String,
    id_b: u64,
}

fn two_nodes_with_k(cfg: MasterConfig) -> Two {
    let m = Master::new(cfg).unwrap();
    let (a, b) = (client(&m), client(&m));
    let (_, seg_a) = segment(&m, a, "a", 1 << 20);
    let (id_b, seg_b) = segment(&m, b, "b", 1 << 20);
    put(&m, a, "k", &on(&seg_a));
    Two { m, a, b, seg_a, seg_b, id_b }
}

fn used(m: &Master, segment: u64) -> u64 {
    m.stats().segment_usage.iter().find(|u| u.segment == segment).map_or(0, |u| u.used)
}

/// An upsert whose object left under it (the node of its only replica was lost)
/// keeps its new replicas' space until its deadline: its writer may still be writing
/// them. Then the space is freed. (It was freed at once, and handed to the next put.)
#[test]
fn an_orphaned_upsert_keeps_its_space_until_its_deadline() {
    let Two { m, a, b, seg_b, id_b, .. } = two_nodes_with_k(MasterConfig {
        put_timeout: Duration::from_millis(1500),
        monitor_interval: Duration::from_millis(20),
        ..Default::default()
    });
    let staged = m.upsert_start(b, "k", LEN, &on(&seg_b)).unwrap();
    m.unregister_client(a).unwrap();
    assert_eq!(used(&m, id_b), LEN, "the upsert's replica still holds its space");
    let x = m.put_start(b, "x", LEN, &on(&seg_b)).unwrap();
    assert_ne!(x[0].offset, staged[0].offset, "the space being written is not handed out again");
    m.put_end(b, "x", 1).unwrap();
    assert!(matches!(m.upsert_end(b, "k", 2), Err(Error::NotFound(_))));
    wait_until(Duration::from_secs(5), || used(&m, id_b) == LEN);
}

/// The same when the object's last replica was a disk replica its node evicted.
#[test]
fn an_upsert_over_an_evicted_disk_replica_keeps_its_space() {
    let m = Master::new(MasterConfig::default()).unwrap();
    let b = client(&m);
    let (id_b, seg_b) = segment(&m, b, "b", 1 << 20);
    assert!(m.register_disk_objects(b, &[("k", LEN, 7, 1)])[0].is_ok());
    m.upsert_start(b, "k", LEN, &on(&seg_b)).unwrap();
    assert!(m.batch_evict_disk_replica(b, &["k"])[0].is_ok());
    assert_eq!(used(&m, id_b), LEN, "the upsert's replica still holds its space");
}

/// A replicate copying from an object that an upsert replaced keeps its sources and
/// targets for its own lease (`put_timeout`), not a get's (`default_lease`).
#[test]
fn an_upsert_keeps_a_replicate_s_targets_for_the_replicate_s_lease() {
    let Two { m, a, b, seg_a, seg_b, id_b } = two_nodes_with_k(MasterConfig {
        default_lease: Duration::from_millis(100),
        put_timeout: Duration::from_secs(30),
        ..Default::default()
    });
    let plan = m.replicate_start(a, "k", &replicas(2, &[&seg_a, &seg_b])).unwrap();
    assert_eq!(plan.targets.len(), 1);
    assert_eq!(used(&m, id_b), LEN);
    m.upsert_start(b, "k", LEN, &on(&seg_a)).unwrap();
    m.upsert_end(b, "k", 9).unwrap();
    std::thread::sleep(Duration::from_millis(250));
    m.get_replica_list("k").unwrap();
    assert_eq!(used(&m, id_b), LEN, "the replicate's target is still being written");
    // Its end finds the object changed: an error, and no lease given back.
    assert!(matches!(m.replicate_end("k", &plan.targets, true), Err(Error::NotFound(_))));
}

/// A `replicate_end` asked twice (its first answer lost) gives the replicate's lease
/// back once: a reader's lease stays, and the object cannot be removed under it.
#[test]
fn a_replicate_end_asked_twice_gives_back_one_lease() {
    let Two { m, a, seg_a, seg_b, .. } =
        two_nodes_with_k(MasterConfig { default_lease: Duration::from_secs(30), ..Default::default() });
    m.get_replica_list("k").unwrap(); // a read in flight
    let plan = m.replicate_start(a, "k", &replicas(2, &[&seg_a, &seg_b])).unwrap();
    m.replicate_end("k", &plan.targets, true).unwrap();
    m.replicate_end("k", &plan.targets, true).unwrap();
    assert!(matches!(m.remove("k"), Err(Error::HasLease(_))), "the reader's lease is still there");
    assert_eq!(m.get_replica_list("k").unwrap().replicas.len(), 2);
}

/// A replicate whose client never ended it does not block the key for good: once
/// its lease (`put_timeout`) ran out, the next replicate takes its targets back and
/// places its own.
#[test]
fn an_abandoned_replicate_is_taken_back_by_the_next() {
    let m = Master::new(MasterConfig {
        put_timeout: Duration::from_millis(100),
        default_lease: Duration::from_millis(50),
        ..Default::default()
    })
    .unwrap();
    let (a, b, c) = (client(&m), client(&m), client(&m));
    let (_, seg_a) = segment(&m, a, "a", 1 << 20);
    let (id_b, seg_b) = segment(&m, b, "b", 1 << 20);
    put(&m, a, "k", &on(&seg_a));
    let abandoned = m.replicate_start(c, "k", &replicas(2, &[&seg_a, &seg_b])).unwrap();
    assert_eq!(abandoned.targets.len(), 1);
    m.unregister_client(c).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let plan = m.replicate_start(a, "k", &replicas(2, &[&seg_a, &seg_b])).unwrap();
    assert_eq!(plan.targets.len(), 1, "the key is not blocked by the abandoned replicate");
    assert_eq!(used(&m, id_b), LEN, "the abandoned target's space was freed");
    m.replicate_end("k", &plan.targets, true).unwrap();
    assert_eq!(m.get_replica_list("k").unwrap().replicas.len(), 2);
}

/// Segments declared with capacities whose sum passes 2^64 do not stop the monitor:
/// the eviction check's sums saturate.
#[test]
fn huge_declared_capacities_do_not_overflow_the_eviction_check() {
    let m = Master::new(MasterConfig::default()).unwrap();
    let a = client(&m);
    segment(&m, a, "a", 1 << 63);
    segment(&m, a, "b", 1 << 63);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| m.evict_if_needed()));
    assert!(r.is_ok(), "the eviction check panicked");
}

/// A replicate whose targets are placed while the object is upserted to another
/// length (the placement waits, unlocked, for offloads to free room) is refused
/// ("ask again"), never handed targets sized for the old value under the new length:
/// its copy would write past them into other objects.
#[test]
fn a_replicate_of_an_object_upserted_while_placing_is_refused() {
    use mooncake_core::PersistPolicy;
    let m = std::sync::Arc::new(
        Master::new(MasterConfig {
            persist: PersistPolicy::Lazy,
            offload_wait: Duration::from_secs(5),
            ..Default::default()
        })
        .unwrap(),
    );
    let (a, b) = (client(&m), client(&m));
    let (_, seg_a) = segment(&m, a, "a", 1 << 20);
    let (_, seg_b) = segment(&m, b, "b", 16 * LEN);
    m.mount_ssd(b, 1 << 30, "127.0.0.1:1").unwrap();
    for i in 0..16 {
        put(&m, b, &format!("fill{i}"), &on(&seg_b));
    }
    put(&m, a, "k", &on(&seg_a));
    let placing = {
        let (m, seg_a, seg_b) = (m.clone(), seg_a.clone(), seg_b.clone());
        std::thread::spawn(move || m.replicate_start(a, "k", &replicas(2, &[&seg_a, &seg_b])))
    };
    // The placement waits for B's objects to reach B's SSD before it evicts them:
    // it asks for them once it runs (asked for until then, however late a loaded
    // machine runs it), and the upsert comes while it waits.
    std::thread::sleep(Duration::from_millis(300));
    let asked = std::time::Instant::now();
    let plan = loop {
        let plan = m.offload_heartbeat(b, 256).unwrap();
        if !plan.tasks.is_empty() || asked.elapsed() > Duration::from_secs(20) {
            break plan;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!plan.tasks.is_empty(), "B's objects were asked to go to its SSD");
    m.upsert_start(a, "k", 4 * LEN, &on(&seg_a)).unwrap();
    m.upsert_end(a, "k", 2).unwrap();
    let items: Vec<(&str, u64, u32, u64)> =
        plan.tasks.iter().map(|t| (t.key.as_str(), t.len, t.checksum, t.generation)).collect();
    m.notify_offload_success(b, &items);
    match placing.join().unwrap() {
        Err(Error::HasLease(_)) => {}
        Ok(p) => {
            assert!(p.targets.iter().all(|t| t.len == p.len), "targets of {:?} for a value of {}", p.targets, p.len)
        }
        Err(e) => panic!("{e}"),
    }
}

/// The old replicas an upsert retired are freed once their time is up even if a reader
/// of them died (its lease never given back) and the key is never touched again.
#[test]
fn retired_replicas_of_a_dead_reader_are_freed_without_touching_the_key() {
    let Two { m, b, seg_b, .. } = two_nodes_with_k(MasterConfig {
        default_lease: Duration::from_millis(600),
        monitor_interval: Duration::from_millis(20),
        ..Default::default()
    });
    let id_a = m.stats().segment_usage.iter().find(|u| u.name == "local://a#1").unwrap().segment;
    m.get_replica_list("k").unwrap(); // a reader that dies: never released
    m.upsert_start(b, "k", LEN, &on(&seg_b)).unwrap();
    m.upsert_end(b, "k", 3).unwrap();
    assert_eq!(used(&m, id_a), LEN, "the old replica is kept for its reader");
    wait_until(Duration::from_secs(5), || used(&m, id_a) == 0);
}
