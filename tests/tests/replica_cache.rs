//! Gets through replica lists the client kept from recent gets: one round trip for
//! hot objects, never a wrong answer.

use std::time::Duration;

use mooncake_core::{Error, Master, MasterConfig, ReplicateConfig, Store};

fn master(lease_ms: u64) -> Master {
    Master::new(MasterConfig { default_lease: Duration::from_millis(lease_ms), ..Default::default() }).unwrap()
}

/// A store giving memory and a store reading from it (with the default cache).
fn owner_and_reader(m: &Master) -> (Store, Store) {
    let owner = Store::builder().master(m).global_segment_size(4 << 20).build().unwrap();
    let reader = Store::builder().master(m).global_segment_size(0).build().unwrap();
    (owner, reader)
}

#[test]
fn a_hot_object_is_read_through_its_leased_list() {
    let m = master(2_000);
    let (owner, reader) = owner_and_reader(&m);
    owner.put("hot", b"prefix block").unwrap();
    for _ in 0..5 {
        assert_eq!(&reader.get("hot").unwrap()[..], b"prefix block");
    }
    let mut buf = [0u8; 64];
    assert_eq!(reader.get_into("hot", &mut buf).unwrap(), 12);
    assert_eq!(reader.stats().replica_cache_hits, 5, "only the first get asks the master");
    // The reads are over: no lease keeps the object from being removed.
    owner.remove("hot").unwrap();
    owner.put("hot", b"prefix block").unwrap();
    // Too small a buffer is still refused, without a round trip.
    assert!(matches!(reader.get_into("hot", &mut [0u8; 4]), Err(Error::BufferTooSmall { needed: 12, .. })));
}

#[test]
fn a_list_is_not_used_past_its_lease() {
    let m = master(100);
    let (owner, reader) = owner_and_reader(&m);
    owner.put("k", b"version 1").unwrap();
    assert_eq!(&reader.get("k").unwrap()[..], b"version 1");
    std::thread::sleep(Duration::from_millis(150));
    owner.remove("k").unwrap();
    owner.put("k", b"version 2, longer").unwrap();
    assert_eq!(&reader.get("k").unwrap()[..], b"version 2, longer");
    assert_eq!(reader.stats().replica_cache_hits, 0);
    owner.remove("k").unwrap_or(());
}

#[test]
fn a_hot_object_stays_cached_past_its_first_lease() {
    let m = master(500);
    let (owner, reader) = owner_and_reader(&m);
    owner.put("hot", b"prefix block").unwrap();
    reader.get("hot").unwrap();
    reader.get("hot").unwrap();
    assert_eq!(reader.stats().replica_cache_hits, 1);
    // Its list's lease is over: the next get asks the master again, and the gets
    // after it are served through the list once more.
    std::thread::sleep(Duration::from_millis(600));
    reader.get("hot").unwrap();
    assert_eq!(reader.stats().replica_cache_hits, 1, "a list past its lease was used");
    reader.get("hot").unwrap();
    reader.get("hot").unwrap();
    assert_eq!(reader.stats().replica_cache_hits, 3, "the hot object is not cached again after its first lease");
}

#[test]
fn a_lost_replica_falls_back_to_the_master() {
    let m = master(5_000);
    let a = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let b = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let reader = Store::builder().master(&m).global_segment_size(0).build().unwrap();
    a.put_with("two", &[7u8; 100_000], &ReplicateConfig::replicas(2)).unwrap();
    let on_b = m.segment_info(b.segment_id().unwrap()).unwrap().name;
    b.put_with("one", &[9u8; 1000], &ReplicateConfig { preferred_segments: vec![on_b], ..Default::default() }).unwrap();
    assert_eq!(reader.get("two").unwrap().len(), 100_000);
    assert_eq!(reader.get("one").unwrap().len(), 1000);
    // The owner of one replica (and of "one") leaves despite the leases.
    drop(b);
    assert_eq!(&reader.get("two").unwrap()[..], &[7u8; 100_000][..], "the other replica serves");
    let one = reader.get("one");
    assert!(matches!(one, Err(Error::NotFound(_))), "gone with its only replica, never stale: {one:?}");
}

#[test]
fn zero_disables_the_cache() {
    let m = master(2_000);
    let owner = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let reader = Store::builder().master(&m).global_segment_size(0).replica_cache(0).build().unwrap();
    owner.put("k", b"v").unwrap();
    reader.get("k").unwrap();
    reader.get("k").unwrap();
    assert_eq!(reader.stats().replica_cache_hits, 0);
}
