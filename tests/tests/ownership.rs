//! Cluster mode, master side: a master answers only for the slot groups it leads,
//! places a key's replicas only in its group's extents, and gives a group up without
//! touching the storage nodes' records (the next leader rebuilds from them).
//!
//! The ownership here is a plain in-process one (which groups are led is set by the
//! test); the etcd-backed one is exercised in `cluster.rs`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use mooncake_core::{
    Error, KeyOwnership, Master, MasterConfig, ObjectRecord, RecordSink, RecordUpdate, ReplicateConfig,
};
use mooncake_transfer::RemoteRegion;
use std::sync::Mutex;

const GROUPS: u32 = 4;

/// Groups by a stable hash of the key; led groups set by the test.
struct TestOwnership {
    led: Mutex<HashSet<u32>>,
}

impl KeyOwnership for TestOwnership {
    fn group_of(&self, key: &str) -> u32 {
        key.bytes().fold(7u32, |h, b| h.wrapping_mul(31).wrapping_add(b as u32)) % GROUPS
    }
    fn leads(&self, group: u32) -> bool {
        self.led.lock().unwrap().contains(&group)
    }
    fn moved(&self, key: &str) -> Error {
        Error::Moved { slot: self.group_of(key) as u16, leader: Some("elsewhere:1".into()) }
    }
    fn group_moved(&self, group: u32) -> Error {
        Error::Moved { slot: group as u16, leader: None }
    }
}

/// A node's record endpoint that remembers every update.
#[derive(Default)]
struct Recorder(Mutex<Vec<RecordUpdate>>);

impl RecordSink for Recorder {
    fn apply_records(&self, updates: &[RecordUpdate]) -> mooncake_core::Result<()> {
        self.0.lock().unwrap().extend_from_slice(updates);
        Ok(())
    }
}

fn cluster_master(led: &[u32]) -> (Master, Arc<TestOwnership>) {
    let config =
        MasterConfig { track_records: true, client_ttl: Duration::from_millis(400), ..MasterConfig::default() };
    let master = Master::new(config).unwrap();
    let ownership = Arc::new(TestOwnership { led: Mutex::new(led.iter().copied().collect()) });
    master.set_ownership(ownership.clone());
    (master, ownership)
}

fn region(n: u64) -> RemoteRegion {
    RemoteRegion { endpoint: "local://node".into(), region: n }
}

/// A key of `group`.
fn key_in(own: &TestOwnership, group: u32, n: usize) -> String {
    (0..).map(|i| format!("k{n}-{i}")).find(|k| own.group_of(k) == group).unwrap()
}

#[test]
fn keys_of_groups_led_elsewhere_are_moved() {
    let (master, own) = cluster_master(&[0]);
    let client = master.register_client().unwrap().client;
    master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    let here = key_in(&own, 0, 0);
    let there = key_in(&own, 1, 0);
    let cfg = ReplicateConfig::default();
    master.put_start(client, &here, 10, &cfg).unwrap();
    master.put_end(client, &here, 7).unwrap();
    assert!(master.exists(&here).unwrap());
    assert!(matches!(master.put_start(client, &there, 10, &cfg), Err(Error::Moved { .. })));
    assert!(matches!(master.get_replica_list(&there), Err(Error::Moved { .. })));
    assert!(matches!(master.exists(&there), Err(Error::Moved { .. })));
    assert!(matches!(master.remove(&there), Err(Error::Moved { .. })));
    let batch = master.batch_exists(&[here.as_str(), there.as_str()]);
    assert!(matches!(batch[0], Ok(true)));
    assert!(matches!(batch[1], Err(Error::Moved { .. })));
    assert!(Error::Moved { slot: 1, leader: None }.is_retryable());
}

#[test]
fn segments_are_mounted_per_group_and_replicas_stay_in_their_group() {
    let (master, own) = cluster_master(&[0, 1]);
    let client = master.register_client().unwrap().client;
    assert!(matches!(master.mount_segment(client, &region(9), 1 << 20), Err(Error::InvalidArgument(_))));
    assert!(matches!(master.mount_extent(client, &region(3), 1 << 20, 2, &[]), Err(Error::Moved { .. })));
    let (e0, _) = master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    let (e1, _) = master.mount_extent(client, &region(2), 1 << 20, 1, &[]).unwrap();
    for n in 0..40 {
        let group = n as u32 % 2;
        let key = key_in(&own, group, n);
        let replicas = master.put_start(client, &key, 4096, &ReplicateConfig::default()).unwrap();
        let want = if group == 0 { e0 } else { e1 };
        assert!(replicas.iter().all(|r| r.segment == want), "{key} of group {group} placed in {replicas:?}");
    }
    // A group whose extents are full gets no room from another group's extent.
    let big = key_in(&own, 0, 1000);
    assert!(matches!(master.put_start(client, &big, 1 << 20, &ReplicateConfig::default()), Err(Error::NoSpace { .. })));
}

#[test]
fn a_released_group_is_dropped_without_telling_the_nodes_and_comes_back_from_their_records() {
    let (master, own) = cluster_master(&[0]);
    let client = master.register_client().unwrap().client;
    let recorder = Arc::new(Recorder::default());
    master.attach_records(client, recorder.clone()).unwrap();
    let (seg, _) = master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    let keys: Vec<String> = (0..5).map(|n| key_in(&own, 0, n)).collect();
    for k in &keys {
        master.put_start(client, k, 100, &ReplicateConfig::default()).unwrap();
        master.put_end(client, k, 42).unwrap();
    }
    let records: Vec<ObjectRecord> = recorder
        .0
        .lock()
        .unwrap()
        .iter()
        .filter_map(|u| match u {
            RecordUpdate::Added { segment, record } if *segment == seg => Some(record.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(records.len(), keys.len(), "every put reached the node's records before its ack");
    let told = recorder.0.lock().unwrap().len();

    // The group moves away: calls are refused, the objects and the extent go, the node
    // hears nothing (its records are what the next leader rebuilds from).
    own.led.lock().unwrap().remove(&0);
    assert_eq!(master.release_group(0), keys.len());
    assert_eq!(recorder.0.lock().unwrap().len(), told, "no record update on release");
    assert_eq!(master.stats().objects, 0);
    assert_eq!(master.stats().segments, 0);
    assert!(matches!(master.get_replica_list(&keys[0]), Err(Error::Moved { .. })));

    // It comes back: until the node re-mounts, a key of the group is Recovering.
    own.led.lock().unwrap().insert(0);
    master.acquire_group(0);
    assert!(matches!(master.get_replica_list(&keys[0]), Err(Error::Recovering(_))));
    // A record of another group's key in this extent is not taken.
    let mut offered = records.clone();
    let stray = key_in(&own, 3, 99);
    offered.push(ObjectRecord { key: stray.clone(), offset: 900_000, len: 10, checksum: 1, generation: 1 });
    let (_, taken) = master.mount_extent(client, &region(1), 1 << 20, 0, &offered).unwrap();
    assert_eq!(taken, keys.len());
    for k in &keys {
        let list = master.get_replica_list(k).unwrap();
        assert_eq!((list.len, list.checksum), (100, 42));
    }
    own.led.lock().unwrap().insert(3);
    assert!(matches!(master.get_replica_list(&stray), Err(Error::NotFound(_))));
}

#[test]
fn a_put_started_before_its_group_moved_cannot_end_after() {
    let (master, own) = cluster_master(&[0]);
    let client = master.register_client().unwrap().client;
    master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    let key = key_in(&own, 0, 0);
    master.put_start(client, &key, 100, &ReplicateConfig::default()).unwrap();
    own.led.lock().unwrap().remove(&0);
    assert!(matches!(master.put_end(client, &key, 1), Err(Error::Moved { .. })));
    master.release_group(0);
    assert_eq!(master.stats().pending_puts, 0);
}

/// A master deposed while it was stopped (its lease lapsed; the group not released
/// here yet) that is asked to remove everything removes only the objects of the
/// groups it still leads: the others, and their nodes' records and files, are the
/// new leader's.
#[test]
fn remove_all_keeps_the_objects_of_groups_led_elsewhere() {
    let (master, own) = cluster_master(&[0, 1]);
    let client = master.register_client().unwrap().client;
    let recorder = Arc::new(Recorder::default());
    master.attach_records(client, recorder.clone()).unwrap();
    master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    master.mount_extent(client, &region(2), 1 << 20, 1, &[]).unwrap();
    let (here, there) = (key_in(&own, 0, 0), key_in(&own, 1, 0));
    for k in [&here, &there] {
        master.put_start(client, k, 100, &ReplicateConfig::default()).unwrap();
        master.put_end(client, k, 42).unwrap();
    }
    let told = recorder.0.lock().unwrap().len();
    own.led.lock().unwrap().remove(&1);
    assert_eq!(master.remove_all().unwrap(), 1);
    let updates: Vec<RecordUpdate> = recorder.0.lock().unwrap()[told..].to_vec();
    assert!(updates.iter().all(|u| u.key() == here), "the node was told about a group led elsewhere: {updates:?}");
    // Still here, untouched, had this master kept the group.
    own.led.lock().unwrap().insert(1);
    assert!(master.exists(&there).unwrap());
    assert!(!master.exists(&here).unwrap());
}

#[test]
fn uniform_keys_fill_every_groups_extents_with_eviction_making_room() {
    let (master, _) = cluster_master(&[0, 1, 2, 3]);
    let client = master.register_client().unwrap().client;
    for g in 0..GROUPS {
        master.mount_extent(client, &region(g as u64 + 1), 1 << 20, g, &[]).unwrap();
    }
    // Three times the memory in 4 KiB objects with uniform keys: every put finds room
    // in its own group's extent, evicting that group's oldest objects when full.
    for n in 0..3072 {
        if n % 64 == 0 {
            // The client TTL is 400 ms: on a loaded machine the loop outlasts it.
            master.heartbeat(client).unwrap();
        }
        let key = format!("uniform/{n}");
        master.put_start(client, &key, 4096, &ReplicateConfig::default()).unwrap();
        master.put_end(client, &key, 1).unwrap();
    }
    let stats = master.stats();
    let used = stats.used_bytes as f64 / stats.capacity_bytes as f64;
    assert!(used >= 0.9, "DRAM use {used:.3} under uniform keys");
}

/// A node whose record endpoint, when first told of a change, sees the master lose
/// its group (the lease lapsed while the master waited for the node).
struct LosesTheGroup {
    ownership: Arc<TestOwnership>,
    seen: Recorder,
}

impl RecordSink for LosesTheGroup {
    fn apply_records(&self, updates: &[RecordUpdate]) -> mooncake_core::Result<()> {
        self.ownership.led.lock().unwrap().clear();
        self.seen.apply_records(updates)
    }
}

/// A put or remove whose wait for the nodes' records outlasts the master's lead of
/// the key's group is not acknowledged by it (`Moved`: the client asks the new
/// leader, which may not have what this master recorded), single and batch forms.
#[test]
fn a_write_is_not_acknowledged_by_a_master_that_lost_its_group_meanwhile() {
    let (master, own) = cluster_master(&[0]);
    let client = master.register_client().unwrap().client;
    master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    let node = Arc::new(LosesTheGroup { ownership: own.clone(), seen: Recorder::default() });
    master.attach_records(client, node.clone()).unwrap();
    let cfg = ReplicateConfig::default();
    let (a, b) = (key_in(&own, 0, 1), key_in(&own, 0, 2));
    master.put_start(client, &a, 10, &cfg).unwrap();
    assert!(matches!(master.put_end(client, &a, 7), Err(Error::Moved { .. })));
    assert!(!node.seen.0.lock().unwrap().is_empty(), "the node was told");
    own.led.lock().unwrap().insert(0);
    master.put_start(client, &b, 10, &cfg).unwrap();
    assert!(matches!(master.batch_put_end(client, &[(&b, 7)])[0], Err(Error::Moved { .. })));
    own.led.lock().unwrap().insert(0);
    assert!(matches!(master.remove(&a), Err(Error::Moved { .. })));
    own.led.lock().unwrap().insert(0);
    assert!(matches!(master.batch_remove(&[&b])[0], Err(Error::Moved { .. })));
}

/// A group taken over waits for puts of keys it does not hold only once a node came
/// back with objects of it: a fresh cluster's groups (and groups whose nodes brought
/// nothing back) take puts at once, while a key a node may still bring back is not
/// put over it.
#[test]
fn puts_wait_in_a_group_taken_over_only_once_its_objects_come_back() {
    let (master, own) = cluster_master(&[]);
    let client = master.register_client().unwrap().client;
    own.led.lock().unwrap().extend([0, 1]);
    master.acquire_group(0);
    master.acquire_group(1);
    master.mount_extent(client, &region(1), 1 << 20, 0, &[]).unwrap();
    let kept = key_in(&own, 1, 0);
    let record = ObjectRecord { key: kept.clone(), offset: 0, len: 100, checksum: 42, generation: 1 };
    master.mount_extent(client, &region(2), 1 << 20, 1, &[record]).unwrap();
    // Group 0: nothing came back, a put of a new key goes through at once.
    let fresh = key_in(&own, 0, 1);
    master.put_start(client, &fresh, 100, &ReplicateConfig::default()).unwrap();
    master.put_end(client, &fresh, 7).unwrap();
    // Group 1: a node came back with objects, so a missing key may still come back
    // with another node: its put waits (`Recovering`, retried by clients) ...
    let missing = key_in(&own, 1, 2);
    assert!(matches!(master.put_start(client, &missing, 100, &ReplicateConfig::default()), Err(Error::Recovering(_))));
    // ... and the key that did come back is taken.
    assert!(matches!(master.put_start(client, &kept, 100, &ReplicateConfig::default()), Err(Error::AlreadyExists(_))));
    // After the window (one client TTL) it goes through.
    let until = std::time::Instant::now() + Duration::from_millis(600);
    while std::time::Instant::now() < until {
        master.heartbeat(client).unwrap();
        std::thread::sleep(Duration::from_millis(50));
    }
    master.put_start(client, &missing, 100, &ReplicateConfig::default()).unwrap();
    master.put_end(client, &missing, 8).unwrap();
}

/// A new leader of a group rebuilds it from the extents nodes mount: a node that
/// missed a key's removal and put again mounts first with the old object, the node
/// of the new put next. The newer copy is the key's value, and the first node is
/// told to drop its record; an older copy mounted after it is refused.
#[test]
fn a_new_leader_keeps_the_newest_copy_whichever_extent_comes_first() {
    let (master, own) = cluster_master(&[0]);
    master.acquire_group(0);
    let key = key_in(&own, 0, 0);
    let record = |checksum: u32, generation: u64| ObjectRecord {
        key: key.clone(),
        offset: 0,
        len: 100 + u64::from(checksum),
        checksum,
        generation,
    };
    let node = |n: u64| {
        let client = master.register_client().unwrap().client;
        let seen = Arc::new(Recorder::default());
        master.attach_records(client, seen.clone()).unwrap();
        (client, seen, region(n))
    };
    let ((a, seen_a, region_a), (b, _, region_b), (c, seen_c, region_c)) = (node(1), node(2), node(3));
    let (extent_a, _) = master.mount_extent(a, &region_a, 1 << 20, 0, &[record(1, 10)]).unwrap();
    let (extent_b, taken) = master.mount_extent(b, &region_b, 1 << 20, 0, &[record(2, 20)]).unwrap();
    assert_eq!(taken, 1, "the newer copy was refused");
    let (extent_c, taken) = master.mount_extent(c, &region_c, 1 << 20, 0, &[record(3, 15)]).unwrap();
    assert_eq!(taken, 0, "an older copy was taken");
    let list = master.get_replica_list(&key).unwrap();
    assert_eq!(list.checksum, 2);
    assert_eq!(list.replicas.iter().map(|r| r.segment).collect::<Vec<_>>(), [extent_b]);
    // The key's remove waits for every removal queued for it: by then node a has it.
    master.release_leases(&[&key]).unwrap();
    master.remove(&key).unwrap();
    let removed = |seen: &Recorder, extent| {
        seen.0
            .lock()
            .unwrap()
            .iter()
            .any(|u| matches!(u, RecordUpdate::Removed { segment, key: k, .. } if *segment == extent && *k == key))
    };
    assert!(removed(&seen_a, extent_a), "the old copy's node still lists it");
    assert!(removed(&seen_c, extent_c), "the refused copy's node still lists it");
}

/// A leader removes a key whose copy went out of sight with a node it forgot: the
/// removal is handed to two other nodes to keep. The group's next leader hears it
/// from them: the old copy the forgotten node brings back is dropped if its extent
/// came first (its node told, and the object withheld meanwhile: the node said it
/// may have missed updates), refused if it came after; a key of a group the new
/// master does not lead is ignored.
#[test]
fn a_new_leader_learns_a_removal_from_the_nodes_that_kept_it() {
    let (old_leader, own) = cluster_master(&[0]);
    old_leader.acquire_group(0);
    let key = key_in(&own, 0, 0);
    let other_group = key_in(&own, 1, 0);
    let record = |generation: u64| ObjectRecord { key: key.clone(), offset: 0, len: 100, checksum: 1, generation };
    let node = |master: &Master, n: u64| {
        let client = master.register_client().unwrap().client;
        let seen = Arc::new(Recorder::default());
        master.attach_records(client, seen.clone()).unwrap();
        (client, seen, region(n))
    };
    let (stale, _, region_stale) = node(&old_leader, 1);
    let (holder, seen_holder, region_holder) = node(&old_leader, 2);
    let (_, seen_other, _) = node(&old_leader, 3);
    old_leader.mount_extent(stale, &region_stale, 1 << 20, 0, &[record(10)]).unwrap();
    old_leader.mount_extent(holder, &region_holder, 1 << 20, 0, &[record(10)]).unwrap();
    old_leader.unregister_client(stale).unwrap();
    old_leader.remove(&key).unwrap();
    let kept = |seen: &Recorder| {
        seen.0.lock().unwrap().iter().find_map(|u| match u {
            RecordUpdate::Tombstone { key: k, generation } if *k == key => Some(*generation),
            _ => None,
        })
    };
    let removed_at = kept(&seen_holder).expect("the holder did not keep the removal");
    assert_eq!(kept(&seen_other), Some(removed_at));
    assert!(removed_at > 10);

    for kept_first in [false, true] {
        let (leader, _) = cluster_master(&[0]);
        leader.acquire_group(0);
        let (stale, seen_stale, region_stale) = node(&leader, 1);
        let (keeper, _, _) = node(&leader, 2);
        let restore = || leader.restore_tombstones(keeper, &[(&key, removed_at), (&other_group, removed_at)]).unwrap();
        if kept_first {
            restore();
        }
        leader.missed_updates(stale).unwrap();
        let (extent, taken) = leader.mount_extent(stale, &region_stale, 1 << 20, 0, &[record(10)]).unwrap();
        assert_eq!(taken, usize::from(!kept_first));
        // Meanwhile not served: the node said it may have missed updates.
        assert!(matches!(leader.get_replica_list(&key), Err(Error::Recovering(_))));
        if !kept_first {
            restore();
        }
        let told =
            || {
                seen_stale.0.lock().unwrap().iter().any(
                    |u| matches!(u, RecordUpdate::Removed { segment, key: k, .. } if *segment == extent && *k == key),
                )
            };
        // Sent at the latest with the node's next heartbeat (the key's next put or
        // remove waits for it).
        leader.heartbeat(stale).unwrap();
        assert!(told(), "the stale copy's node keeps it (kept first: {kept_first})");
        assert!(leader.get_replica_list(&key).is_err(), "the removed key is back (kept first: {kept_first})");
    }
}
