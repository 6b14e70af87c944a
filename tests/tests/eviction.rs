//! Memory eviction above the high watermark: room for new puts, approximately LRU,
//! leases and soft pins respected.

use std::time::Duration;

use mooncake_core::{Master, MasterConfig, ReplicateConfig, Store};

const OBJ: usize = 100_000;

fn master(lease: Duration) -> Master {
    Master::new(MasterConfig { default_lease: lease, ..Default::default() }).unwrap()
}

#[test]
fn puts_keep_succeeding_when_the_pool_is_full() {
    let m = master(Duration::ZERO);
    let store = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    for i in 0..200 {
        store.put(&format!("k{i}"), &vec![i as u8; OBJ]).unwrap();
    }
    let s = m.stats();
    assert!(s.evicted_objects > 150, "{s:?}");
    assert!(s.used_bytes <= 4 << 20);
    assert!(s.evicted_bytes >= s.evicted_objects * OBJ as u64);
    // The newest object is still there, with its bytes.
    assert_eq!(&store.get("k199").unwrap()[..], &vec![199u8; OBJ][..]);
}

#[test]
fn recently_read_objects_outlive_old_unread_ones() {
    let m = master(Duration::ZERO);
    let store = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    // 36 objects fill ~86 % of the segment.
    for i in 0..36 {
        store.put(&format!("k{i}"), &vec![1u8; OBJ]).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    // Touch the 6 oldest: they become the most recently used.
    for i in 0..6 {
        store.get(&format!("k{i}")).unwrap();
    }
    std::thread::sleep(Duration::from_millis(2));
    // Free ~10 objects' worth.
    let report = m.evict_for(10 * OBJ as u64);
    assert!(report.freed_bytes >= 10 * OBJ as u64);
    for i in 0..6 {
        assert!(store.exists(&format!("k{i}")).unwrap(), "recently read k{i} was evicted");
    }
    let survivors_of_next_10 = (6..16).filter(|i| store.exists(&format!("k{i}")).unwrap()).count();
    assert_eq!(survivors_of_next_10, 0, "the oldest unread objects go first");
    assert!(store.exists("k35").unwrap());
}

#[test]
fn leased_and_soft_pinned_objects_are_kept() {
    let m = master(Duration::from_secs(30));
    let store = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let pinned = ReplicateConfig { soft_pin: true, ..Default::default() };
    store.put_with("pinned", &vec![2u8; OBJ], &pinned).unwrap();
    store.put("leased", &vec![3u8; OBJ]).unwrap();
    m.get_replica_list("leased").unwrap(); // a read in flight: leased (for up to 30 s)
    for i in 0..100 {
        store.put(&format!("k{i}"), &vec![4u8; OBJ]).unwrap();
    }
    assert!(m.stats().evicted_objects > 50);
    assert_eq!(&store.get("leased").unwrap()[..], &vec![3u8; OBJ][..]);
    assert_eq!(&store.get("pinned").unwrap()[..], &vec![2u8; OBJ][..]);
}

#[test]
fn soft_pinned_objects_go_when_nothing_else_can() {
    let m = master(Duration::ZERO);
    let store = Store::builder().master(&m).global_segment_size(1 << 20).build().unwrap();
    let pinned = ReplicateConfig { soft_pin: true, ..Default::default() };
    for i in 0..9 {
        store.put_with(&format!("p{i}"), &vec![5u8; OBJ], &pinned).unwrap();
    }
    // Only pinned objects exist: a new put must still find room.
    store.put("new", &vec![6u8; 3 * OBJ]).unwrap();
    assert!(m.stats().evicted_objects >= 2);
}

#[test]
fn the_background_monitor_brings_a_full_segment_below_the_watermark() {
    let m = Master::new(MasterConfig {
        default_lease: Duration::ZERO,
        monitor_interval: Duration::from_millis(10),
        ..Default::default()
    })
    .unwrap();
    let store = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    // Fill to ~98 % without tripping put-time eviction.
    for i in 0..41 {
        store.put(&format!("k{i}"), &vec![1u8; OBJ]).unwrap();
    }
    let start = std::time::Instant::now();
    while m.stats().used_bytes as f64 > 0.95 * (4 << 20) as f64 {
        assert!(start.elapsed() < Duration::from_secs(20), "monitor never evicted: {:?}", m.stats());
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(m.stats().used_bytes as f64 <= 0.90 * (4 << 20) as f64 + OBJ as f64);
}

#[test]
fn a_soft_pin_with_a_ttl_ends_and_each_read_renews_it() {
    let m = master(Duration::ZERO);
    let store = Store::builder().master(&m).global_segment_size(4 << 20).build().unwrap();
    let pin = |ttl: Option<Duration>| ReplicateConfig { soft_pin: true, soft_pin_ttl: ttl, ..Default::default() };
    let ttl = Duration::from_millis(300);
    // The oldest objects: eviction, approximately LRU, would take them first.
    store.put_with("forever", &vec![1u8; OBJ], &pin(None)).unwrap();
    store.put_with("expires", &vec![2u8; OBJ], &pin(Some(ttl))).unwrap();
    store.put_with("renewed", &vec![3u8; OBJ], &pin(Some(ttl))).unwrap();
    store.put_with("long", &vec![4u8; OBJ], &pin(Some(Duration::from_secs(600)))).unwrap();
    std::thread::sleep(Duration::from_millis(2));
    for i in 0..30 {
        store.put(&format!("k{i}"), &vec![5u8; OBJ]).unwrap();
    }
    assert!(m.object_info("expires").unwrap().soft_pin);
    // Past the TTL, with a read of "renewed" every 100 ms.
    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(&store.get("renewed").unwrap()[..], &vec![3u8; OBJ][..]);
    }
    assert!(!m.object_info("expires").unwrap().soft_pin, "the pin outlived its TTL");
    assert!(m.object_info("renewed").unwrap().soft_pin, "reads did not renew the pin");
    // The unpinned "expires" is now the least recently used object: it goes first;
    // the pins still in force keep the others.
    let report = m.evict_for(OBJ as u64);
    assert!(report.evicted_objects >= 1);
    assert!(!store.exists("expires").unwrap(), "an object whose pin ended was not evicted first");
    for key in ["forever", "renewed", "long"] {
        assert!(store.exists(key).unwrap(), "{key} is still pinned and was evicted");
    }
    // A TTL without a pin is refused.
    let bad = ReplicateConfig { soft_pin_ttl: Some(ttl), ..Default::default() };
    assert!(matches!(store.put_with("bad", b"x", &bad), Err(mooncake_core::Error::InvalidArgument(_))));
}
