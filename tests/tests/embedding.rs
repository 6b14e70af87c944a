//! The embedding API as an inference server uses it, through the public API only:
//! leases that end with their read, batch and multi-buffer calls, flush, placement
//! preferences, timeouts and errors, and clients of a master daemon that others
//! can read.

use std::time::{Duration, Instant};

use mooncake_core::rpc::RpcServer;
use mooncake_core::{
    Error, Master, MasterConfig, MasterDaemon, PersistPolicy, ReplicateConfig, SsdOffloadConfig, Store,
};

mod support;

const KIB: usize = 1 << 10;

fn block(i: usize, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i * 31 + j) as u8).collect()
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("mooncake-embedding-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Fills the segment, reads every object back, and checks that new puts succeed
/// at once: the finished reads hold nothing.
fn fill_read_then_put(store: &Store, n: usize) {
    let len = 64 * KIB;
    let mut stored = Vec::new();
    for i in 0..n {
        match store.put(&format!("old{i}"), &block(i, len)) {
            Ok(()) => stored.push(i),
            Err(Error::NoSpace { .. }) => break,
            Err(e) => panic!("put {i}: {e}"),
        }
    }
    assert!(stored.len() > 8, "the segment holds a few objects");
    let mut buf = vec![0u8; len];
    for &i in &stored {
        if let Ok(got) = store.get_into(&format!("old{i}"), &mut buf) {
            assert_eq!(buf[..got], block(i, len)[..]);
        }
    }
    let started = Instant::now();
    for i in 0..stored.len() {
        store.put(&format!("new{i}"), &block(i + 1000, len)).unwrap_or_else(|e| panic!("new put {i}: {e}"));
    }
    assert!(started.elapsed() < Duration::from_secs(5), "no put waited for a lease to expire");
}

#[test]
fn reading_back_a_full_segment_then_putting_evicts_what_was_read() {
    // Leases far longer than the test: only their release can let eviction in.
    let master = Master::new(MasterConfig { default_lease: Duration::from_secs(600), ..Default::default() }).unwrap();
    let store = Store::builder().master(&master).global_segment_size(1 << 20).build().unwrap();
    fill_read_then_put(&store, 64);
    assert!(master.stats().evicted_objects > 0);
}

#[test]
fn reading_back_a_full_segment_then_putting_gives_up_memory_of_objects_on_disk() {
    let master = Master::new(MasterConfig {
        default_lease: Duration::from_secs(600),
        persist: PersistPolicy::Eager,
        ..Default::default()
    })
    .unwrap();
    let dir = temp_dir("eager");
    let store = Store::builder()
        .master(&master)
        .global_segment_size(1 << 20)
        .ssd_offload(SsdOffloadConfig::new(&dir, 64 << 20))
        .build()
        .unwrap();
    fill_read_then_put(&store, 15);
    store.flush().unwrap();
    // The objects whose memory went are still there, from the SSD.
    assert_eq!(store.get("old0").unwrap()[..], block(0, 64 * KIB)[..]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn has_lease_only_while_a_read_is_in_flight() {
    let master = Master::new(MasterConfig { default_lease: Duration::from_secs(600), ..Default::default() }).unwrap();
    let store = Store::builder().master(&master).global_segment_size(1 << 20).build().unwrap();
    store.put("k", b"v").unwrap();
    store.get("k").unwrap();
    store.remove("k").unwrap();
    store.put("k", b"v").unwrap();
    let _read = master.get_replica_list("k").unwrap();
    assert!(matches!(store.remove("k"), Err(Error::HasLease(_))));
    assert!(store.remove("k").unwrap_err().is_retryable());
    master.release_leases(&["k"]).unwrap();
    store.remove("k").unwrap();
}

#[test]
fn batch_exists_and_zero_copy_batch_get_into() {
    let store = Store::builder().global_segment_size(8 << 20).build().unwrap();
    for i in 0..4 {
        store.put(&format!("k{i}"), &block(i, 1000 + i)).unwrap();
    }
    let exists = store.batch_exists(&["k0", "nope", "k3"]);
    assert_eq!(exists.into_iter().map(Result::unwrap).collect::<Vec<_>>(), [true, false, true]);
    let mut bufs = [vec![0u8; 2000], vec![0u8; 2000], vec![0u8; 10], vec![0u8; 2000]];
    let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let got = store.batch_get_into(&["k0", "nope", "k2", "k3"], &mut slices);
    assert_eq!(*got[0].as_ref().unwrap(), 1000);
    assert!(matches!(got[1], Err(Error::NotFound(_))));
    assert!(matches!(got[2], Err(Error::BufferTooSmall { needed: 1002, capacity: 10 })));
    assert_eq!(*got[3].as_ref().unwrap(), 1003);
    assert_eq!(bufs[0][..1000], block(0, 1000)[..]);
    assert_eq!(bufs[3][..1003], block(3, 1003)[..]);
    // Every read is over: all can be removed.
    for i in 0..4 {
        store.remove(&format!("k{i}")).unwrap();
    }
}

#[test]
fn one_object_from_and_into_several_buffers() {
    let owner = Store::builder().global_segment_size(8 << 20).build().unwrap();
    let layers: Vec<Vec<u8>> = (0..4).map(|l| block(l, 4 * KIB + l)).collect();
    let parts: Vec<&[u8]> = layers.iter().map(|l| &l[..]).collect();
    owner.put_parts("block", &parts).unwrap();
    let whole: Vec<u8> = layers.concat();
    assert_eq!(owner.get("block").unwrap()[..], whole[..], "the parts, concatenated");
    let mut out: Vec<Vec<u8>> = layers.iter().map(|l| vec![0u8; l.len()]).collect();
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(owner.get_into_parts("block", &mut outs).unwrap(), whole.len());
    assert_eq!(out, layers);
    let mut small = [vec![0u8; 10], vec![0u8; 10]];
    let mut smalls: Vec<&mut [u8]> = small.iter_mut().map(|b| &mut b[..]).collect();
    assert!(matches!(owner.get_into_parts("block", &mut smalls), Err(Error::BufferTooSmall { .. })));
    // Batch forms.
    let a: [&[u8]; 2] = [b"ab", b"cd"];
    let b: [&[u8]; 3] = [b"e", b"", b"fgh"];
    let res = owner.batch_put_parts(&[("a", &a), ("b", &b)], &ReplicateConfig::default());
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    let (mut a1, mut a2, mut b1) = ([0u8; 3], [0u8; 3], [0u8; 8]);
    let mut for_a: [&mut [u8]; 2] = [&mut a1, &mut a2];
    let mut for_b: [&mut [u8]; 1] = [&mut b1];
    let got = owner.batch_get_into_parts(&["a", "b"], &mut [&mut for_a, &mut for_b]);
    assert_eq!((*got[0].as_ref().unwrap(), *got[1].as_ref().unwrap()), (4, 4));
    assert_eq!((&a1, &a2[..1], &b1[..4]), (b"abc", &b"d"[..], &b"efgh"[..]));
}

#[test]
fn flush_puts_everything_on_the_ssd_and_close_keeps_it() {
    let master = Master::new(MasterConfig::default()).unwrap(); // Lazy
    let dir = temp_dir("flush");
    let store = Store::builder()
        .master(&master)
        .global_segment_size(4 << 20)
        .ssd_offload(SsdOffloadConfig::new(&dir, 64 << 20))
        .build()
        .unwrap();
    for i in 0..20 {
        store.put(&format!("k{i}"), &block(i, 8 * KIB)).unwrap();
    }
    store.flush().unwrap();
    let shown = store.stats().to_string();
    for field in ["replica cache hits", "disk loads", "ssd (", "offloaded", "lease refusals", "pending puts"] {
        assert!(shown.contains(field), "{field} missing from:\n{shown}");
    }
    store.close().unwrap();
    let reader = Store::builder()
        .master(&master)
        .global_segment_size(1 << 20)
        .ssd_offload(SsdOffloadConfig::new(&dir, 64 << 20))
        .build()
        .unwrap();
    for i in 0..20 {
        assert_eq!(reader.get(&format!("k{i}")).unwrap()[..], block(i, 8 * KIB)[..], "k{i} survived the close");
    }
    drop(reader);
    let no_ssd = Store::builder().global_segment_size(1 << 20).build().unwrap();
    assert!(matches!(no_ssd.flush(), Err(Error::InvalidArgument(_))));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn preferred_segments_apply_whatever_the_strategy() {
    let master = Master::new(MasterConfig::default()).unwrap(); // Random
    let a = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let on_b = b.segment_name().unwrap().unwrap();
    assert_eq!(on_b, master.segment_info(b.segment_id().unwrap()).unwrap().name);
    let cfg = ReplicateConfig { preferred_segments: vec![on_b], ..Default::default() };
    for i in 0..16 {
        a.put_with(&format!("k{i}"), &[1u8; 4096], &cfg).unwrap();
    }
    assert_eq!(a.stats().segment_used, 0);
    assert!(b.stats().segment_used >= 16 * 4096);
    let unknown = ReplicateConfig { preferred_segments: vec!["nowhere#1".into()], ..Default::default() };
    assert!(matches!(a.put_with("x", b"v", &unknown), Err(Error::InvalidArgument(_))));
}

#[test]
fn errors_say_what_happened() {
    let store = Store::builder().global_segment_size(1 << 20).build().unwrap();
    match store.put("huge", &vec![0u8; 2 << 20]) {
        Err(Error::NoSpace { needed, reason, .. }) => {
            assert_eq!(needed, 2 << 20);
            assert!(reason.contains("larger than any segment"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    for bad in ["localhost", "host:port", "a b:1", "::1:80"] {
        let e = Store::builder().master_address(bad).build().unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e}");
    }
    assert!(Error::Recovering("k".into()).is_retryable());
    assert!(!Error::NoSpace { needed: 1, largest_free: 0, reason: "x".into() }.is_retryable());
}

#[test]
fn a_client_of_a_master_daemon_is_readable_by_other_processes() {
    let master = Master::new(MasterConfig::served()).unwrap();
    let server = RpcServer::bind("127.0.0.1:0", master.service().clone()).unwrap();
    let addr = server.local_addr().to_string();
    let writer = Store::builder()
        .master_address(&addr)
        .global_segment_size(4 << 20)
        .master_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    // Not an in-process endpoint: a peer in another process reaches it over TCP.
    assert!(!writer.endpoint().starts_with("local://"), "{}", writer.endpoint());
    writer.put("k", b"from the writer").unwrap();
    let reader = Store::builder()
        .master_address(&addr)
        .global_segment_size(0)
        .protocol(mooncake_core::Protocol::Tcp)
        .build()
        .unwrap();
    assert_eq!(&reader.get("k").unwrap()[..], b"from the writer");
}

#[test]
fn a_daemon_runs_a_user_strategy_with_served_defaults() {
    let daemon =
        MasterDaemon::builder("127.0.0.1:0").allocation_strategy(mooncake_core::alloc::FreeRatioFirst).serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let store = Store::builder().master_address(&addr).global_segment_size(4 << 20).build().unwrap();
    store.put("k", b"v").unwrap();
    assert_eq!(daemon.master().stats().allocation_strategy, "free_ratio_first");
    // Records are tracked: the owner learns what its segment holds.
    let deadline = Instant::now() + Duration::from_secs(5);
    while store.segment_records().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(store.segment_records().len(), 1);
}

#[test]
fn a_segment_given_to_a_master_daemon_is_read_by_another_process() {
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    // No `listen`: the builder serves the segment where the master's peers reach it.
    let writer = Store::builder().master_address(&addr).global_segment_size(4 << 20).build().unwrap();
    let here =
        ReplicateConfig { preferred_segments: vec![writer.segment_name().unwrap().unwrap()], ..Default::default() };
    let data = block(7, 300 * KIB);
    writer.put_with("shared/block", &data, &here).unwrap();
    let dir = support::unique_dir("embedding");
    let out = dir.join("out");
    let got = std::process::Command::new(support::bin("mooncake-client"))
        .args(["get", "--master", &addr, "shared/block", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(got.status.success(), "{}", String::from_utf8_lossy(&got.stderr));
    assert_eq!(std::fs::read(&out).unwrap(), data);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restarted_master_answers_retryable_errors_while_clients_come_back() {
    let master = Master::new(MasterConfig::served()).unwrap();
    let fresh = master.register_client().unwrap().client;
    assert!(matches!(master.get_replica_list("missing"), Err(Error::NotFound(_))), "not recovering yet");
    // A client comes back with the objects of its segment: the master restarted.
    let back = master.register_client().unwrap().client;
    let region = mooncake_transfer::RemoteRegion { endpoint: "tcp://10.0.0.9:1".into(), region: 1 };
    let records = [mooncake_core::ObjectRecord { key: "kept".into(), offset: 0, len: 5, checksum: 6, generation: 1 }];
    master.remount_segment(back, &region, 1 << 20, &records).unwrap();
    assert!(master.exists("kept").unwrap());
    let missing = master.get_replica_list("not-back-yet").unwrap_err();
    assert!(matches!(missing, Error::Recovering(_)) && missing.is_retryable(), "{missing}");
    master.unregister_client(back).unwrap();
    let no_room = master.put_start(fresh, "k", 5, &ReplicateConfig::default()).unwrap_err();
    assert!(matches!(no_room, Error::Recovering(_)) && no_room.is_retryable(), "{no_room}");
}
