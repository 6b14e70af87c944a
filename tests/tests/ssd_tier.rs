//! The SSD tier wired into the store: offload under memory pressure, loads back
//! (own disk and another client's), recovery after a restart, disk eviction kept in
//! sync with the master.

mod support;

use std::time::Duration;

use mooncake_core::storage::EvictionPolicy;
use mooncake_core::{Error, Master, MasterConfig, PersistPolicy, SsdBackend, SsdOffloadConfig, Store};
use support::{unique_dir, wait_until, Immutable};

const MIB: usize = 1 << 20;

/// Distinct bytes for object `i`.
fn block(i: usize, len: usize) -> Vec<u8> {
    let mut v = support::payload(i as u8, len);
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    v
}

fn ssd_store(master: &Master, dram: u64, dir: &std::path::Path, ssd: u64, backend: SsdBackend) -> Store {
    Store::builder()
        .master(master)
        .global_segment_size(dram)
        .ssd_offload(SsdOffloadConfig::new(dir, ssd).backend(backend))
        .build()
        .unwrap()
}

/// A master that persists every put at once (short leases), and a node with 16 MiB
/// of memory and a 256 MiB bucket SSD tier in `dir`.
fn eager_node(dir: &std::path::Path) -> (Master, Store) {
    let master = Master::new(MasterConfig {
        persist: PersistPolicy::Eager,
        default_lease: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    let node = ssd_store(&master, 16 << 20, dir, 256 << 20, SsdBackend::Bucket);
    (master, node)
}

/// With an SSD tier a put does not fail for lack of DRAM while the SSD has
/// room. 256 MiB through 32 MiB of DRAM, every object read back exactly, and found
/// again after the store is rebuilt on the same directory.
fn dram_overflow_goes_to_disk_and_survives_restart(backend: SsdBackend) {
    let dir = unique_dir(&format!("ssd-overflow-{backend:?}"));
    let master = Master::new(MasterConfig::default()).unwrap();
    let store = ssd_store(&master, 32 << 20, &dir, 1 << 30, backend);
    for i in 0..256 {
        store.put(&format!("obj-{i}"), &block(i, MIB)).unwrap_or_else(|e| panic!("put {i}: {e}"));
    }
    let check_all = |store: &Store| {
        let mut buf = vec![0u8; MIB];
        for i in 0..256 {
            let n = store.get_into(&format!("obj-{i}"), &mut buf).unwrap_or_else(|e| panic!("get {i}: {e}"));
            assert_eq!(n, MIB);
            assert!(buf == block(i, MIB), "object {i} read back wrong bytes");
        }
    };
    check_all(&store);
    let ssd = store.ssd_stats().unwrap();
    assert!(ssd.offloaded_objects >= 256 - 32, "only {} objects reached the disk", ssd.offloaded_objects);
    assert!(ssd.local_loads > 0, "no get was served from the disk");
    assert!(master.stats().used_bytes <= 32 << 20);
    drop(store);
    assert_eq!(master.stats().objects, 0, "dropping the only client forgets its objects");

    let store = ssd_store(&master, 32 << 20, &dir, 1 << 30, backend);
    let recovered = store.ssd_stats().unwrap().recovered;
    assert!(recovered >= 256 - 32, "only {recovered} objects recovered from {}", dir.display());
    let mut buf = vec![0u8; MIB];
    let mut found = 0;
    for i in 0..256 {
        match store.get_into(&format!("obj-{i}"), &mut buf) {
            Ok(n) => {
                assert_eq!(n, MIB);
                assert!(buf == block(i, MIB), "object {i} recovered with wrong bytes");
                found += 1;
            }
            Err(Error::NotFound(_)) => {}
            Err(e) => panic!("get {i} after restart: {e}"),
        }
    }
    assert_eq!(found as u64, recovered);
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bucket_backend_holds_256_mib_in_32_mib_of_dram() {
    dram_overflow_goes_to_disk_and_survives_restart(SsdBackend::Bucket);
}

#[test]
fn file_per_key_backend_holds_256_mib_in_32_mib_of_dram() {
    dram_overflow_goes_to_disk_and_survives_restart(SsdBackend::FilePerKey);
}

#[test]
fn offset_allocator_backend_holds_256_mib_in_32_mib_of_dram() {
    dram_overflow_goes_to_disk_and_survives_restart(SsdBackend::OffsetAllocator);
}

/// Eager persistence: every put reaches the disk without memory pressure, and a
/// client without memory or disk of its own loads an object that lives only on
/// another client's SSD (through that client's load server).
#[test]
fn eager_offload_and_remote_load_from_another_clients_disk() {
    let dir = unique_dir("ssd-remote");
    let (master, node) = eager_node(&dir);
    let reader = Store::builder().master(&master).global_segment_size(0).build().unwrap();
    for i in 0..8 {
        node.put(&format!("k{i}"), &block(i, 300_000)).unwrap();
    }
    wait_until(Duration::from_secs(10), || node.ssd_stats().unwrap().offloaded_objects == 8);
    assert_eq!(master.ssd_usage(node.client_id()).unwrap().1, 8 * 300_000);
    // Free every memory replica: only the disk copies remain.
    let freed = master.evict_for(u64::MAX);
    assert_eq!(freed.evicted_objects, 8);
    assert!(master.object_info("k3").unwrap().replicas.is_empty());
    for i in 0..4 {
        assert_eq!(&reader.get(&format!("k{i}")).unwrap()[..], &block(i, 300_000)[..], "k{i}");
    }
    // A batch pulls every disk-only object of one node with one staging round trip.
    let keys: Vec<String> = (4..8).map(|i| format!("k{i}")).chain(["missing".to_owned()]).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let got = reader.batch_get(&refs);
    for (i, r) in (4..8).zip(&got) {
        assert_eq!(&r.as_ref().unwrap()[..], &block(i, 300_000)[..], "k{i}");
    }
    assert!(matches!(got[4], Err(Error::NotFound(_))));
    assert_eq!(reader.stats().disk_loads, 8);
    assert_eq!(node.ssd_stats().unwrap().served_loads, 8);
    // The node reads its own disk directly, in one submission.
    let all: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = all.iter().map(String::as_str).collect();
    for (i, r) in node.batch_get(&refs).iter().enumerate() {
        assert_eq!(&r.as_ref().unwrap()[..], &block(i, 300_000)[..], "k{i} from the local disk");
    }
    assert_eq!(node.ssd_stats().unwrap().local_loads, 8);
    // Released batches leave the staging region empty (no wait for the GC).
    wait_until(Duration::from_secs(2), || node.ssd_stats().unwrap().staging.batches == 0);

    // A removed object's file is deleted by the node's next offload heartbeat.
    std::thread::sleep(master.config().default_lease);
    master.remove("k0").unwrap();
    wait_until(Duration::from_secs(5), || node.ssd_stats().unwrap().discarded == 1);
    assert!(matches!(reader.get("k0"), Err(Error::NotFound(_))));
    assert_eq!(master.ssd_usage(node.client_id()).unwrap().1, 7 * 300_000);
    drop((reader, node));
    std::fs::remove_dir_all(&dir).ok();
}

/// A removed object's file that cannot be deleted (a disk refusing changes) stays
/// stored, is counted as pending, and its delete is retried on the node's heartbeats
/// until the file is gone for good.
#[test]
fn a_failed_discard_is_retried_until_the_file_is_gone() {
    use mooncake_core::storage::{BackendOptions, BucketBackend, BucketConfig, StorageBackend};
    let dir = unique_dir("ssd-discard-retry");
    let (master, node) = eager_node(&dir);
    for i in 0..2 {
        node.put(&format!("k{i}"), &block(i, 300_000)).unwrap();
    }
    wait_until(Duration::from_secs(10), || node.ssd_stats().unwrap().offloaded_objects == 2);
    std::thread::sleep(master.config().default_lease);
    {
        let Some(_frozen) = Immutable::set(&dir) else { return };
        master.remove("k0").unwrap();
        wait_until(Duration::from_secs(5), || node.ssd_stats().unwrap().discards_pending == 1);
        assert_eq!(node.ssd_stats().unwrap().discarded, 0);
        assert_eq!(node.ssd_stats().unwrap().backend.objects, 2, "the object stays stored while its delete fails");
    }
    wait_until(Duration::from_secs(5), || {
        let s = node.ssd_stats().unwrap();
        s.discarded == 1 && s.discards_pending == 0
    });
    drop(node);
    let disk = BucketBackend::open(&dir, BackendOptions::default(), BucketConfig::default()).unwrap();
    let mut keys = Vec::new();
    disk.scan_meta(&mut |m| keys.push(m.key.clone()));
    assert_eq!(keys, ["k1"], "the removed object's file is gone from the disk");
    drop(disk);
    std::fs::remove_dir_all(&dir).ok();
}

/// Disk eviction tells the master before the files go: once the SSD is full, the
/// oldest objects leave it (FIFO), the master drops exactly their disk replicas
/// (their memory replicas stay), and its usage figure never exceeds the capacity.
#[test]
fn disk_eviction_keeps_the_master_in_sync() {
    let dir = unique_dir("ssd-evict");
    let master = Master::new(MasterConfig { persist: PersistPolicy::Eager, ..Default::default() }).unwrap();
    let store = Store::builder()
        .master(&master)
        .global_segment_size(64 << 20)
        .ssd_offload(
            SsdOffloadConfig::new(&dir, 4 * MIB as u64).backend(SsdBackend::FilePerKey).eviction(EvictionPolicy::Fifo),
        )
        .build()
        .unwrap();
    for i in 0..10 {
        store.put(&format!("e{i}"), &block(i, MIB)).unwrap();
        // One at a time, so that the disk order is the put order.
        wait_until(Duration::from_secs(10), || store.ssd_stats().unwrap().offloaded_objects == i as u64 + 1);
    }
    let ssd = store.ssd_stats().unwrap();
    assert_eq!(ssd.backend.evicted_objects + ssd.backend.objects, 10, "{ssd:?}");
    assert!(ssd.backend.objects <= 4 && ssd.backend.evicted_objects >= 6, "{ssd:?}");
    assert_eq!(ssd.backend.pending_notifications, 0);
    let (cap, used) = master.ssd_usage(store.client_id()).unwrap();
    assert!(used <= cap, "master counts {used} bytes on a {cap}-byte SSD");
    assert_eq!(used as u64, ssd.backend.objects * MIB as u64);
    let on_disk = ssd.backend.objects as usize;
    for i in 0..10 {
        let list = master.get_replica_list(&format!("e{i}")).unwrap();
        assert_eq!(list.replicas.len(), 1, "e{i} keeps its memory replica");
        let expect_disk = i >= 10 - on_disk;
        assert_eq!(list.disk.is_some(), expect_disk, "e{i}: FIFO keeps the newest {on_disk} on disk");
    }
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
}

/// With `PersistPolicy::None` nothing is offloaded: memory eviction drops objects.
#[test]
fn persist_none_never_offloads() {
    let dir = unique_dir("ssd-none");
    let master = Master::new(MasterConfig { persist: PersistPolicy::None, ..Default::default() }).unwrap();
    let store = ssd_store(&master, 8 << 20, &dir, 64 << 20, SsdBackend::Bucket);
    for i in 0..32 {
        store.put(&format!("n{i}"), &block(i, MIB / 2)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(store.ssd_stats().unwrap().offloaded_objects, 0);
    assert!(master.stats().evicted_objects > 0);
    assert!(master.stats().objects < 32);
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
}

/// Bad SSD settings are refused with a clear error, and the client is not left
/// registered.
#[test]
fn bad_ssd_config_is_refused() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let dir = unique_dir("ssd-bad");
    let err =
        Store::builder().master(&master).ssd_offload(SsdOffloadConfig::new(&dir, 0)).build().map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let file = dir.join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = Store::builder()
        .master(&master)
        .ssd_offload(SsdOffloadConfig::new(&file, 1 << 20))
        .build()
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(err, Error::Storage(_)), "{err}");
    assert_eq!(master.stats().clients, 0);
    std::fs::remove_dir_all(&dir).ok();
}
