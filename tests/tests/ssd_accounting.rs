//! The master's side of the SSD tier: `LocalDisk` replicas, per-client SSD usage
//! (reference 002) and its use by `SsdFreeRatioFirst`.

use std::sync::Arc;
use std::time::Duration;

use mooncake_core::alloc::SsdFreeRatioFirst;
use mooncake_core::{Error, Master, MasterConfig, ReplicateConfig, Store};
use mooncake_transfer::RemoteRegion;

/// The generation of an offload task given after every change of its object.
const LATER: u64 = u64::MAX;

fn master() -> Master {
    Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).unwrap()
}

/// A client with a segment of its own, and an object put on it.
fn client_with(master: &Master, name: &str, keys: &[(&str, u64)]) -> u64 {
    let c = master.register_client().unwrap().client;
    let region = RemoteRegion { endpoint: format!("local://{name}"), region: 1 };
    let seg = master.mount_segment(c, &region, 1 << 30).unwrap();
    let on = ReplicateConfig { preferred_segments: vec![master.segment_info(seg).unwrap().name], ..Default::default() };
    for (k, len) in keys {
        master.put_start(c, k, *len, &on).unwrap();
        master.put_end(c, k, 7).unwrap();
    }
    c
}

#[test]
fn usage_grows_only_for_recorded_disk_replicas() {
    let m = master();
    let c = client_with(&m, "a", &[("x", 1000), ("y", 500)]);
    m.report_ssd_capacity(c, 1 << 20).unwrap();
    let res = m.notify_offload_success(c, &[("x", 1000, 7, LATER), ("gone", 10, 7, LATER), ("y", 500, 8, LATER)]);
    assert!(res[0].is_ok());
    assert!(matches!(res[1], Err(Error::NotFound(_))), "vanished objects are ignored");
    assert!(matches!(res[2], Err(Error::NotFound(_))), "a different object under the key is ignored");
    assert_eq!(m.ssd_usage(c), Some((1 << 20, 1000)));
    // Notifying twice does not count twice.
    m.notify_offload_success(c, &[("x", 1000, 7, LATER)]);
    assert_eq!(m.ssd_usage(c).unwrap().1, 1000);
    assert!(matches!(m.report_ssd_capacity(12345, 1), Err(Error::UnknownClient(_))));
}

#[test]
fn disk_eviction_keeps_memory_replicas_and_removes_disk_only_objects() {
    let m = master();
    let c = client_with(&m, "a", &[("x", 1000), ("y", 2000)]);
    m.notify_offload_success(c, &[("x", 1000, 7, LATER), ("y", 2000, 7, LATER)]);
    // y loses its memory replica to eviction but stays, through its disk replica.
    m.evict_for(1 << 40);
    assert!(m.exists("x").unwrap() && m.exists("y").unwrap());
    assert!(m.get_replica_list("y").unwrap().replicas.is_empty());
    assert_eq!(m.get_replica_list("y").unwrap().disk, Some(c));
    // Disk eviction: x and y lose their disk replicas; y has nothing left.
    let res = m.batch_evict_disk_replica(c, &["x", "y", "nope"]);
    assert!(res[0].is_ok() && res[1].is_ok() && res[2].is_err());
    assert!(!m.exists("y").unwrap(), "metadata goes when no replica is left");
    assert_eq!(m.ssd_usage(c).unwrap().1, 0);
    assert_eq!(m.stats().objects, 0, "x was evicted from memory too");
}

#[test]
fn removal_and_client_loss_give_back_ssd_usage() {
    let m = master();
    let a = client_with(&m, "a", &[("k1", 100), ("k2", 200), ("k3", 300)]);
    m.notify_offload_success(a, &[("k1", 100, 7, LATER), ("k2", 200, 7, LATER), ("k3", 300, 7, LATER)]);
    assert_eq!(m.ssd_usage(a).unwrap().1, 600);
    m.remove("k1").unwrap();
    assert_eq!(m.ssd_usage(a).unwrap().1, 500);
    assert_eq!(m.remove_all().unwrap(), 2);
    assert_eq!(m.ssd_usage(a).unwrap().1, 0);
    // A disk replica on another client keeps an object whose memory client is lost.
    let b = client_with(&m, "b", &[("kept", 100), ("lost", 100)]);
    let c = m.register_client().unwrap().client;
    m.notify_offload_success(c, &[("kept", 100, 7, LATER)]);
    m.unregister_client(b).unwrap();
    assert!(m.exists("kept").unwrap());
    assert!(!m.exists("lost").unwrap());
    m.unregister_client(c).unwrap();
    assert!(!m.exists("kept").unwrap(), "no replica left once the disk's client is gone");
}

#[test]
fn a_store_reports_an_ssd_only_object_as_a_storage_error_never_garbage() {
    let m = master();
    let c = client_with(&m, "a", &[("k", 4096)]);
    m.notify_offload_success(c, &[("k", 4096, 7, LATER)]);
    m.evict_for(1 << 40);
    let reader = Store::builder().master(&m).global_segment_size(0).build().unwrap();
    assert!(matches!(reader.get("k"), Err(Error::Storage(_))));
}

#[test]
fn ssd_free_ratio_first_places_on_the_client_with_the_emptiest_ssd() {
    let m = Master::new(MasterConfig {
        allocation_strategy: Arc::new(SsdFreeRatioFirst),
        default_lease: Duration::ZERO,
        ..Default::default()
    })
    .unwrap();
    let full = client_with(&m, "full", &[("big", 900)]);
    let empty = client_with(&m, "empty", &[]);
    m.report_ssd_capacity(full, 1000).unwrap();
    m.report_ssd_capacity(empty, 1000).unwrap();
    m.notify_offload_success(full, &[("big", 900, 7, LATER)]);
    let empty_segment = m.stats().segment_usage.iter().find(|u| u.name.starts_with("local://empty")).unwrap().segment;
    for i in 0..20 {
        let r = m.put_start(full, &format!("n{i}"), 64, &ReplicateConfig::default()).unwrap();
        assert_eq!(r[0].segment, empty_segment, "placement must prefer the SSD with room");
    }
}

#[test]
fn ssd_calls_travel_over_rpc() {
    use mooncake_core::MasterApi;
    let m = master();
    let server = mooncake_core::rpc::RpcServer::bind("127.0.0.1:0", m.service().clone()).unwrap();
    let remote = mooncake_core::rpc::RpcMasterClient::connect(&server.local_addr().to_string()).unwrap();
    let c = client_with(&m, "a", &[("k", 64)]);
    remote.report_ssd_capacity(c, 4096).unwrap();
    assert!(remote.notify_offload_success(c, &[("k", 64, 7, LATER)])[0].is_ok());
    assert_eq!(m.ssd_usage(c), Some((4096, 64)));
    assert!(remote.batch_evict_disk_replica(c, &["k"])[0].is_ok());
    assert_eq!(m.ssd_usage(c), Some((4096, 0)));
}

#[test]
fn objects_found_on_disk_are_registered_and_stale_copies_refused() {
    let m = master();
    let c = client_with(&m, "a", &[("known", 100)]);
    let res = m.register_disk_objects(c, &[("fresh", 300, 9, 0), ("known", 100, 7, 0), ("known2", 0, 1, 0)]);
    assert!(res[0].is_ok(), "an object only on disk is created");
    assert!(res[1].is_ok(), "the same object gains its disk replica");
    assert!(matches!(res[2], Err(Error::InvalidArgument(_))), "empty values are refused");
    let list = m.get_replica_list("fresh").unwrap();
    assert!(list.replicas.is_empty());
    assert_eq!((list.len, list.checksum, list.disk), (300, 9, Some(c)));
    assert_eq!(m.ssd_usage(c).unwrap().1, 400);
    let res = m.register_disk_objects(c, &[("known", 100, 8, 0)]);
    assert!(matches!(res[0], Err(Error::AlreadyExists(_))), "a different object under the key makes the copy stale");
    assert!(matches!(m.register_disk_objects(424242, &[("x", 1, 1, 0)])[0], Err(Error::UnknownClient(_))));
}

/// Nanoseconds since the epoch: the scale of the master's generations.
fn unix_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
}

/// The generation rule on disk copies: a file older than its key's last removal or
/// put is refused (and counted), whether the master saw the removal or the put after
/// the file's node was forgotten; a copy nothing superseded is taken back.
#[test]
fn disk_copies_older_than_their_keys_last_removal_or_put_are_refused() {
    let m = master();
    let written = unix_ns() - 1_000_000_000;
    let a = m.register_client().unwrap().client;
    let res = m.register_disk_objects(a, &[("k", 10, 1, written), ("kept", 10, 2, written)]);
    assert!(res.iter().all(|r| r.is_ok()), "{res:?}");
    // Node a is forgotten: its files are out of sight.
    m.unregister_client(a).unwrap();
    assert!(!m.exists("k").unwrap());
    // k is put again (another object) and then removed, both acknowledged.
    let b = client_with(&m, "b", &[("k", 20)]);
    let c = m.register_client().unwrap().client;
    let refused = m.register_disk_objects(c, &[("k", 10, 1, written)]);
    assert!(matches!(refused[0], Err(Error::AlreadyExists(_))), "another object holds the key: {refused:?}");
    m.remove("k").unwrap();
    // Node a's disk comes back: k's file is older than its removal, kept's is fine.
    let res = m.register_disk_objects(c, &[("k", 10, 1, written), ("kept", 10, 2, written)]);
    assert!(matches!(res[0], Err(Error::AlreadyExists(_))), "an old generation came back: {res:?}");
    assert!(res[1].is_ok(), "a copy nothing superseded is taken back: {res:?}");
    assert!(!m.exists("k").unwrap());
    assert_eq!(m.get_replica_list("kept").unwrap().checksum, 2);
    assert_eq!(m.stats().stale_copies, 1);
    // A copy written after the removal (a later put's) is taken.
    assert!(m.register_disk_objects(c, &[("k", 30, 3, unix_ns() + 1_000_000_000)])[0].is_ok());
    assert_eq!(m.get_replica_list("k").unwrap().checksum, 3);
    let _ = b;
}

/// Lazy persistence: memory is freed only through the disk. A put that needs room
/// asks the owner to offload and waits; with nobody offloading it gives up after
/// `offload_wait` with a clear `NoSpace`, and the object is still there. Removing an
/// offloaded object tells its owner to delete the file.
#[test]
fn lazy_eviction_offloads_first_and_puts_wait_bounded() {
    let m = Master::new(MasterConfig {
        default_lease: Duration::ZERO,
        offload_wait: Duration::from_millis(300),
        ..Default::default()
    })
    .unwrap();
    let c = client_with(&m, "a", &[]);
    let seg = m.segment_info(m.stats().segment_usage[0].segment).unwrap();
    m.mount_ssd(c, 1 << 30, "127.0.0.1:1").unwrap();
    assert_eq!(m.disk_endpoint(c).unwrap(), "127.0.0.1:1");
    assert!(matches!(m.mount_ssd(c, 0, "x"), Err(Error::InvalidArgument(_))));
    let big = seg.capacity * 3 / 4;
    m.put_start(c, "first", big, &ReplicateConfig::default()).unwrap();
    m.put_end(c, "first", 5).unwrap();
    let start = std::time::Instant::now();
    let err = m.put_start(c, "second", big, &ReplicateConfig::default()).unwrap_err();
    assert!(start.elapsed() >= Duration::from_millis(300), "the put waited for the offload");
    assert!(matches!(&err, Error::NoSpace { reason, .. } if reason.contains("offload")), "{err}");
    assert!(m.exists("first").unwrap(), "not dropped: it waits for the disk");
    // The owner is asked to offload exactly that object, at its place in the segment.
    let plan = m.offload_heartbeat(c, 16).unwrap();
    assert_eq!(plan.tasks.len(), 1);
    let t = &plan.tasks[0];
    assert_eq!((t.key.as_str(), t.segment, t.len, t.checksum), ("first", seg.id, big, 5));
    assert!(m.offload_heartbeat(c, 16).unwrap().tasks.is_empty(), "handed out once");
    // Reported: the memory can go, and the put succeeds.
    m.notify_offload_success(c, &[("first", big, 5, LATER)]);
    m.put_start(c, "second", big, &ReplicateConfig::default()).unwrap();
    assert!(m.get_replica_list("first").unwrap().replicas.is_empty());
    m.remove("first").unwrap();
    assert_eq!(m.offload_heartbeat(c, 16).unwrap().discard, vec!["first".to_owned()]);
}

/// A pass under memory pressure asks for as many offloads as the room it needs, not
/// for every object in memory.
#[test]
fn lazy_eviction_asks_only_for_the_room_it_needs() {
    let m = Master::new(MasterConfig {
        default_lease: Duration::ZERO,
        offload_wait: Duration::from_millis(50),
        ..Default::default()
    })
    .unwrap();
    let c = client_with(&m, "a", &[]);
    m.mount_ssd(c, 1 << 40, "127.0.0.1:1").unwrap();
    let cap = m.stats().capacity_bytes;
    for i in 0..9 {
        let k = format!("o{i}");
        m.put_start(c, &k, cap / 10, &ReplicateConfig::default()).unwrap();
        m.put_end(c, &k, 1).unwrap();
    }
    assert!(m.put_start(c, "big", cap / 5, &ReplicateConfig::default()).is_err(), "nobody offloads");
    let asked = m.offload_heartbeat(c, 100).unwrap().tasks.len();
    assert!((1..=3).contains(&asked), "asked for {asked} offloads to free 2 of 9 slots");
}

/// An offload of an object that was removed, then put again with the same bytes,
/// before the offload was reported: the file written is the old object's (its
/// removal deleted it), so the report gives the new object no disk replica (which
/// would let its memory go with nothing behind it). A task of the new object is.
#[test]
fn an_offload_of_a_removed_object_is_refused_for_its_successor_with_the_same_bytes() {
    let m = master();
    let c = client_with(&m, "a", &[("k", 1000)]);
    m.report_ssd_capacity(c, 1 << 20).unwrap();
    let before_removal = 1; // a task given while the first object lived
    m.remove("k").unwrap();
    let on = ReplicateConfig::default();
    m.put_start(c, "k", 1000, &on).unwrap();
    m.put_end(c, "k", 7).unwrap();
    let res = m.notify_offload_success(c, &[("k", 1000, 7, before_removal)]);
    assert!(matches!(res[0], Err(Error::NotFound(_))), "{res:?}");
    assert_eq!(m.get_replica_list("k").unwrap().disk, None);
    assert_eq!(m.ssd_usage(c).unwrap().1, 0);
    assert!(m.notify_offload_success(c, &[("k", 1000, 7, LATER)])[0].is_ok());
    assert_eq!(m.get_replica_list("k").unwrap().disk, Some(c));
}

/// Two clients holding an object's memory replicas, each with an SSD tier, a master
/// that persists every put at once.
fn two_holders(keys: &[&str]) -> (Master, u64, u64, [ReplicateConfig; 2]) {
    let m = Master::new(MasterConfig {
        default_lease: Duration::ZERO,
        persist: mooncake_core::PersistPolicy::Eager,
        ..Default::default()
    })
    .unwrap();
    let (mut clients, mut on) = (Vec::new(), Vec::new());
    for name in ["a", "b"] {
        let c = m.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: format!("local://{name}"), region: 1 };
        let seg = m.mount_segment(c, &region, 1 << 30).unwrap();
        m.mount_ssd(c, 1 << 30, &format!("{name}:1")).unwrap();
        clients.push(c);
        // Two replicas, the first on this client's segment.
        let name = m.segment_info(seg).unwrap().name;
        on.push(ReplicateConfig { replica_num: 2, preferred_segments: vec![name], ..Default::default() });
    }
    let two = ReplicateConfig { replica_num: 2, ..Default::default() };
    for k in keys {
        m.put_start(clients[0], k, 1000, &two).unwrap();
        m.put_end(clients[0], k, 7).unwrap();
    }
    let on: [ReplicateConfig; 2] = on.try_into().unwrap();
    (m, clients[0], clients[1], on)
}

/// The master keeps one disk replica per object and tells only its holder of a
/// removal: a second client's report of the same object is refused (it deletes its
/// file), or a restarted master could take that file back after the removal.
#[test]
fn an_object_on_one_ssd_refuses_a_second_clients_report() {
    let (m, a, b, _) = two_holders(&["k"]);
    assert!(m.notify_offload_success(a, &[("k", 1000, 7, LATER)])[0].is_ok());
    let res = m.notify_offload_success(b, &[("k", 1000, 7, LATER)]);
    assert!(matches!(res[0], Err(Error::NotFound(_))), "{res:?}");
    assert_eq!(m.get_replica_list("k").unwrap().disk, Some(a));
    assert_eq!((m.ssd_usage(a).unwrap().1, m.ssd_usage(b).unwrap().1), (1000, 0));
    // Reported again by its holder: still one.
    assert!(m.notify_offload_success(a, &[("k", 1000, 7, LATER)])[0].is_ok());
    assert_eq!(m.get_replica_list("k").unwrap().disk, Some(a));
}

/// An offload asked of one node for an object that an upsert then replaced is not
/// given to it, though it holds a replica of the new one too: the new object's own
/// request (of the node of its first replica) is the only one, so two nodes never
/// write one object.
#[test]
fn an_offload_asked_for_a_replaced_object_is_not_given() {
    let (m, a, b, [on_a, on_b]) = two_holders(&[]);
    m.put_start(a, "k", 1000, &on_a).unwrap();
    m.put_end(a, "k", 7).unwrap();
    // Replaced before a's SSD asked for work: the new value lives on b.
    m.upsert_start(b, "k", 2000, &on_b).unwrap();
    m.upsert_end(b, "k", 8).unwrap();
    let plan_a = m.offload_heartbeat(a, 16).unwrap();
    assert!(plan_a.tasks.is_empty(), "a was asked for the replaced object: {:?}", plan_a.tasks);
    assert_eq!(m.get_replica_list("k").unwrap().replicas.len(), 2);
    let plan_b = m.offload_heartbeat(b, 16).unwrap();
    assert_eq!(plan_b.tasks.len(), 1);
    assert_eq!((plan_b.tasks[0].len, plan_b.tasks[0].checksum), (2000, 8));
}

/// A node announcing a file of an object another node's SSD holds (its file was
/// written under a master that died before the report): the disk replica moves to
/// the announcer, and the other node is told to delete its copy, so that a later
/// removal, which tells only the holder, leaves no file behind.
#[test]
fn an_object_announced_from_a_second_ssd_keeps_one_file() {
    let (m, a, b, _) = two_holders(&["k"]);
    assert!(m.notify_offload_success(a, &[("k", 1000, 7, LATER)])[0].is_ok());
    let _ = m.offload_heartbeat(a, 16).unwrap();
    assert!(m.register_disk_objects(b, &[("k", 1000, 7, 1)])[0].is_ok());
    assert_eq!(m.get_replica_list("k").unwrap().disk, Some(b));
    assert_eq!((m.ssd_usage(a).unwrap().1, m.ssd_usage(b).unwrap().1), (0, 1000));
    assert_eq!(m.offload_heartbeat(a, 16).unwrap().discard, vec!["k".to_owned()]);
    // The removal tells the new holder.
    m.remove("k").unwrap();
    assert_eq!(m.offload_heartbeat(b, 16).unwrap().discard, vec!["k".to_owned()]);
}
