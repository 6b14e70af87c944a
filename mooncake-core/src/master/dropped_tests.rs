//! Tests of what the master drops while others may still act on it: a node
//! forgotten while a put waits for its record, the room of a put dropped while its
//! writer may still be writing, removals that can no longer reach their node.
//! Some pause `forget_client` half-way (at the placements' lock, after the node's
//! client record and segments left their tables, before its replicas are dropped)
//! to make the windows they test certain rather than likely.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;

use crate::config::{MasterConfig, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::records::tests::Seen;
use crate::master::{ClientId, Master, ObjectRecord, RecordSink, RecordUpdate};

impl Seen {
    /// The record `Added` for `key`, as the node keeps it.
    fn added(&self, key: &str) -> ObjectRecord {
        self.0
            .lock()
            .iter()
            .find_map(|u| match u {
                RecordUpdate::Added { record, .. } if record.key == key => Some(record.clone()),
                _ => None,
            })
            .unwrap()
    }
}

/// A node that cannot be told (paused): every send fails; counts them.
#[derive(Default)]
struct Stalled {
    tries: AtomicU64,
}

impl RecordSink for Stalled {
    fn apply_records(&self, _: &[RecordUpdate]) -> Result<()> {
        self.tries.fetch_add(1, Ordering::SeqCst);
        Err(Error::Timeout("paused".into()))
    }
}

/// A node: a client with a 1 MiB segment.
struct Node {
    client: ClientId,
    region: RemoteRegion,
    segment: SegmentId,
    name: String,
}

fn node(master: &Master, name: &str) -> Node {
    node_of(master, name, 1 << 20)
}

fn node_of(master: &Master, name: &str, capacity: u64) -> Node {
    let client = master.register_client().unwrap().client;
    let region = RemoteRegion { endpoint: format!("local://{name}"), region: 1 };
    let segment = master.mount_segment(client, &region, capacity).unwrap();
    let name = master.segment_info(segment).unwrap().name;
    Node { client, region, segment, name }
}

/// Puts on the segment named `seg` first.
fn on(seg: &str) -> ReplicateConfig {
    ReplicateConfig { preferred_segments: vec![seg.to_owned()], ..Default::default() }
}

/// Waits (bounded) until `done`.
fn wait_for(what: &str, done: impl Fn() -> bool) {
    let until = Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A put whose only node is forgotten while the put waits for the node's record
/// is not acknowledged. The waiter is woken by the node's link closing, before the
/// forgetting drops the node's replicas: it used to find the object still listing
/// that replica, answer Ok, and the object was then dropped (acknowledged, then
/// `NotFound`).
#[test]
fn a_put_whose_only_node_is_forgotten_while_it_waits_is_not_acknowledged() {
    for batch in [false, true] {
        let config =
            MasterConfig { track_records: true, record_timeout: Duration::from_secs(30), ..Default::default() };
        let master = Master::new(config).unwrap();
        let a = node(&master, "a");
        let sink = Arc::new(Stalled::default());
        master.attach_records(a.client, sink.clone()).unwrap();
        let writer = master.register_client().unwrap().client;
        master.put_start(writer, "k", 100, &on(&a.name)).unwrap();
        std::thread::scope(|s| {
            let put = s.spawn(|| match batch {
                false => master.put_end(writer, "k", 1),
                true => master.batch_put_end(writer, &[("k", 1)]).remove(0),
            });
            wait_for("the put to try its node", || sink.tries.load(Ordering::SeqCst) > 0);
            let paused = master.held.pause();
            let forget = s.spawn(|| master.unregister_client(a.client));
            // Woken by the link's close, while the forgetting waits at the pause.
            let ended = put.join().unwrap();
            drop(paused);
            forget.join().unwrap().unwrap();
            let exists = master.exists("k").unwrap();
            assert!(ended.is_err() || exists, "acknowledged (batch: {batch}), then lost: {ended:?}");
            assert!(matches!(ended, Err(Error::MasterUnavailable(_))), "{ended:?}");
        });
    }
}

/// The same put with a second replica on a node that stays: it stands, and is
/// acknowledged.
#[test]
fn a_put_that_keeps_a_live_replica_is_acknowledged_when_another_node_is_forgotten() {
    let config = MasterConfig { track_records: true, record_timeout: Duration::from_secs(30), ..Default::default() };
    let master = Master::new(config).unwrap();
    let (a, b) = (node(&master, "a"), node(&master, "b"));
    let sink = Arc::new(Stalled::default());
    master.attach_records(a.client, sink.clone()).unwrap();
    master.attach_records(b.client, Arc::new(Seen::default())).unwrap();
    let writer = master.register_client().unwrap().client;
    let cfg = ReplicateConfig { replica_num: 2, ..on(&a.name) };
    assert_eq!(master.put_start(writer, "k", 100, &cfg).unwrap().len(), 2);
    std::thread::scope(|s| {
        let put = s.spawn(|| master.put_end(writer, "k", 1));
        wait_for("the put to try its node", || sink.tries.load(Ordering::SeqCst) > 0);
        let paused = master.held.pause();
        let forget = s.spawn(|| master.unregister_client(a.client));
        let ended = put.join().unwrap();
        drop(paused);
        forget.join().unwrap().unwrap();
        ended.unwrap();
    });
    let info = master.object_info("k").unwrap();
    assert_eq!(info.replicas.len(), 1);
    assert_eq!(info.replicas[0].segment, b.segment);
}

/// An object evicted while its node is being forgotten (the node's segment already
/// out of the table, its replicas not dropped yet): the eviction's removal cannot
/// be queued for the node, and used to leave no mark. The key is put again
/// elsewhere and evicted (which leaves no mark of its own); the node comes back
/// with its old record: refused, not served as the key's value.
#[test]
fn an_eviction_that_cannot_reach_a_node_being_forgotten_keeps_its_old_copy_out() {
    let config = MasterConfig { track_records: true, default_lease: Duration::ZERO, ..Default::default() };
    let master = Master::new(config).unwrap();
    let (a, b) = (node(&master, "a"), node(&master, "b"));
    let seen = Arc::new(Seen::default());
    master.attach_records(a.client, seen.clone()).unwrap();
    master.attach_records(b.client, Arc::new(Seen::default())).unwrap();
    master.put_start(a.client, "k", 100, &on(&a.name)).unwrap();
    master.put_end(a.client, "k", 1).unwrap();
    let v1 = seen.added("k");
    std::thread::scope(|s| {
        let paused = master.held.pause();
        let forget = s.spawn(|| master.unregister_client(a.client));
        wait_for("the segment to leave the table", || master.segment_info(a.segment).is_err());
        assert_eq!(master.evict_for(1 << 20).evicted_objects, 1);
        drop(paused);
        forget.join().unwrap().unwrap();
    });
    master.put_start(b.client, "k", 200, &on(&b.name)).unwrap();
    master.put_end(b.client, "k", 2).unwrap();
    assert_eq!(master.evict_for(1 << 20).evicted_objects, 1);
    let a2 = master.register_client().unwrap().client;
    let (_, taken) = master.remount_segment(a2, &a.region, 1 << 20, &[v1]).unwrap();
    assert_eq!(taken, 0, "the copy that missed its removal was taken back");
}

/// An object whose last replica, on an SSD, its client evicted leaves the master's
/// sight as an evicted one does: its key is marked, so that copies made before it
/// (a node's record whose removal never reached it) are refused once the key is
/// put again, even if that object is gone too when they are offered.
#[test]
fn a_disk_eviction_that_removes_the_object_marks_its_key() {
    let config = MasterConfig { track_records: true, default_lease: Duration::ZERO, ..Default::default() };
    let master = Master::new(config).unwrap();
    let (a, b) = (node(&master, "a"), node(&master, "b"));
    let seen = Arc::new(Seen::default());
    master.attach_records(a.client, seen.clone()).unwrap();
    master.attach_records(b.client, Arc::new(Seen::default())).unwrap();
    let ssd = master.register_client().unwrap().client;
    master.mount_ssd(ssd, 1 << 30, "local://ssd").unwrap();
    master.put_start(a.client, "k", 100, &on(&a.name)).unwrap();
    master.put_end(a.client, "k", 1).unwrap();
    let v1 = seen.added("k");
    master.notify_offload_success(ssd, &[("k", 100, 1, v1.generation)])[0].as_ref().unwrap();
    // Memory goes, the object lives on the SSD; then the SSD evicts it too.
    assert_eq!(master.evict_for(1 << 20).evicted_objects, 1);
    assert!(master.exists("k").unwrap());
    master.batch_evict_disk_replica(ssd, &["k"])[0].as_ref().unwrap();
    assert!(!master.exists("k").unwrap());
    master.put_start(b.client, "k", 200, &on(&b.name)).unwrap();
    master.put_end(b.client, "k", 2).unwrap();
    assert_eq!(master.evict_for(1 << 20).evicted_objects, 1);
    // Offered by a node that kept it (a region of its own: node a is still mounted).
    let a2 = master.register_client().unwrap().client;
    let elsewhere = RemoteRegion { endpoint: "local://a2".into(), region: 1 };
    let (_, taken) = master.remount_segment(a2, &elsewhere, 1 << 20, &[v1]).unwrap();
    assert_eq!(taken, 0, "a copy older than the key's last put was taken back");
}

/// How long the quarantines of the tests below last: a client TTL for a revoked
/// put, `put_timeout` for one reclaimed or whose writer was forgotten.
const TTL: Duration = Duration::from_millis(600);
const PUT_TIMEOUT: Duration = Duration::from_millis(300);

/// A master with one segment of `rooms` rooms of 4 KiB, and its client; its
/// monitor never runs on its own (the test ticks it).
fn rooms(rooms: u64) -> (Master, ClientId) {
    let config = MasterConfig {
        client_ttl: TTL,
        put_timeout: PUT_TIMEOUT,
        monitor_interval: Duration::from_secs(3600),
        ..Default::default()
    };
    let master = Master::new(config).unwrap();
    let n = node_of(&master, "n", rooms * 4096);
    (master, n.client)
}

/// A master with one segment of exactly one room of 4 KiB, and its client.
fn one_room() -> (Master, ClientId) {
    rooms(1)
}

/// Where a put of `key` of 4 KiB is placed, if anywhere.
fn room(master: &Master, client: ClientId, key: &str) -> Result<u64> {
    master.put_start(client, key, 4096, &ReplicateConfig::default()).map(|r| r[0].offset)
}

/// Ticks the monitor after `pause`, the client kept alive.
fn tick_after(master: &Master, client: ClientId, pause: Duration) {
    std::thread::sleep(pause);
    master.heartbeat(client).unwrap();
    master.service().tick();
}

/// The room of a dropped put is neither placed nor freed (it stays used, in no
/// object) until its quarantine, `hold` from `dropped`, is over; then it is placed
/// again.
fn quarantined_until(master: &Master, client: ClientId, dropped: Instant, hold: Duration) {
    master.service().tick();
    if dropped.elapsed() < hold {
        assert!(matches!(room(master, client, "next"), Err(Error::NoSpace { .. })), "placed in quarantined room");
        let stats = master.stats();
        assert_eq!((stats.used_bytes, stats.objects, stats.pending_puts), (4096, 0, 0));
    }
    tick_after(master, client, (hold + Duration::from_millis(50)).saturating_sub(dropped.elapsed()));
    assert_eq!(room(master, client, "next").unwrap(), 0, "the quarantine did not end");
}

/// The room of a dropped upsert of "a" stays used, in no object, until its
/// quarantine, `hold` from `dropped`, is over: `objects` objects meanwhile (the room of
/// each, 4 KiB, used too), and its room freed then. (Not probed by placing: a put
/// would evict "a" for room.)
fn upsert_room_kept_until(master: &Master, client: ClientId, dropped: Instant, hold: Duration, objects: u64) {
    master.service().tick();
    if dropped.elapsed() < hold {
        let stats = master.stats();
        assert_eq!(
            (stats.used_bytes, stats.objects),
            ((objects + 1) * 4096, objects),
            "a dropped upsert's room was freed"
        );
    }
    tick_after(master, client, (hold + Duration::from_millis(50)).saturating_sub(dropped.elapsed()));
    assert_eq!(master.stats().used_bytes, objects * 4096, "the quarantine did not end");
}

/// A master with 16 rooms (used little: nothing is evicted), "a" put in the first,
/// complete.
fn a_and_rooms_to_spare() -> (Master, ClientId) {
    let (master, c) = rooms(16);
    assert_eq!(room(&master, c, "a").unwrap(), 0);
    master.put_end(c, "a", 1).unwrap();
    (master, c)
}

/// Where an upsert of "a" (4 KiB) by `client` places its new bytes.
fn upsert_room(master: &Master, client: ClientId) -> u64 {
    master.upsert_start(client, "a", 4096, &ReplicateConfig::default()).unwrap()[0].offset
}

#[test]
fn the_room_of_a_revoked_upsert_is_kept_a_client_ttl() {
    let (master, c) = a_and_rooms_to_spare();
    assert_eq!(upsert_room(&master, c), 4096);
    master.upsert_revoke(c, "a").unwrap();
    let dropped = Instant::now();
    assert_eq!(master.stats().used_bytes, 2 * 4096, "a revoked upsert's room was freed at once");
    // Still kept past a put timeout.
    tick_after(&master, c, PUT_TIMEOUT);
    upsert_room_kept_until(&master, c, dropped, TTL, 1);
}

#[test]
fn the_room_of_an_upsert_whose_time_ran_out_is_kept_a_put_timeout() {
    let (master, c) = a_and_rooms_to_spare();
    assert_eq!(upsert_room(&master, c), 4096);
    std::thread::sleep(PUT_TIMEOUT + Duration::from_millis(20));
    // A read of the object takes the abandoned upsert out of it.
    master.get_replica_list("a").unwrap();
    let dropped = Instant::now();
    upsert_room_kept_until(&master, c, dropped, PUT_TIMEOUT, 1);
}

#[test]
fn the_room_of_an_abandoned_upsert_of_a_removed_object_is_kept_a_put_timeout() {
    let (master, c) = a_and_rooms_to_spare();
    assert_eq!(upsert_room(&master, c), 4096);
    std::thread::sleep(PUT_TIMEOUT + Duration::from_millis(20));
    master.remove("a").unwrap();
    let dropped = Instant::now();
    upsert_room_kept_until(&master, c, dropped, PUT_TIMEOUT, 0);
}

#[test]
fn the_room_of_an_upsert_whose_writer_was_forgotten_is_kept_a_put_timeout() {
    let (master, c) = a_and_rooms_to_spare();
    let writer = master.register_client().unwrap().client;
    assert_eq!(upsert_room(&master, writer), 4096);
    master.unregister_client(writer).unwrap();
    let dropped = Instant::now();
    upsert_room_kept_until(&master, c, dropped, PUT_TIMEOUT, 1);
}

#[test]
fn the_room_of_a_revoked_put_is_kept_a_client_ttl() {
    let (master, c) = one_room();
    assert_eq!(room(&master, c, "a").unwrap(), 0);
    master.put_revoke(c, "a").unwrap();
    let dropped = Instant::now();
    assert!(matches!(room(&master, c, "b"), Err(Error::NoSpace { .. })), "placed over a revoked put's room");
    // Still kept past a put timeout.
    tick_after(&master, c, PUT_TIMEOUT);
    assert!(matches!(room(&master, c, "b"), Err(Error::NoSpace { .. })));
    quarantined_until(&master, c, dropped, TTL);
}

#[test]
fn the_room_of_a_put_the_monitor_reclaimed_is_kept_a_put_timeout() {
    let (master, c) = one_room();
    assert_eq!(room(&master, c, "a").unwrap(), 0);
    tick_after(&master, c, PUT_TIMEOUT + Duration::from_millis(20));
    let dropped = Instant::now();
    assert_eq!(master.stats().put_timeouts, 1);
    quarantined_until(&master, c, dropped, PUT_TIMEOUT);
}

#[test]
fn the_room_of_a_put_reclaimed_by_the_next_put_of_its_key_is_kept_a_put_timeout() {
    let (master, c) = one_room();
    assert_eq!(room(&master, c, "a").unwrap(), 0);
    std::thread::sleep(PUT_TIMEOUT + Duration::from_millis(20));
    // Reclaimed here (the monitor has not run); its own room is not given back.
    assert!(matches!(room(&master, c, "a"), Err(Error::NoSpace { .. })));
    let dropped = Instant::now();
    assert_eq!(master.stats().put_timeouts, 1);
    quarantined_until(&master, c, dropped, PUT_TIMEOUT);
}

#[test]
fn the_room_of_a_put_whose_writer_was_forgotten_is_kept_a_put_timeout() {
    let (master, c) = one_room();
    let writer = master.register_client().unwrap().client;
    assert_eq!(room(&master, writer, "a").unwrap(), 0);
    master.unregister_client(writer).unwrap();
    let dropped = Instant::now();
    quarantined_until(&master, c, dropped, PUT_TIMEOUT);
}

/// Quarantined room on a draining segment is freed at the next tick: nothing is
/// placed there again, and the node's drain waits for its segments to hold nothing.
#[test]
fn the_room_of_a_dropped_put_on_a_draining_segment_is_freed_at_once() {
    let (master, c) = one_room();
    assert_eq!(room(&master, c, "a").unwrap(), 0);
    master.put_revoke(c, "a").unwrap();
    master.service().tick();
    assert_eq!(master.stats().used_bytes, 4096, "quarantined");
    let name =
        master.segment_info(master.service().segments.read().by_id.keys().next().copied().unwrap()).unwrap().name;
    master.drain_segment(&name, 60_000).unwrap();
    master.service().tick();
    assert_eq!(master.stats().used_bytes, 0, "a draining segment kept a dropped put's room");
}
