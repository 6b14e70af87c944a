//! Every method of `MooncakeStore` against a real `mooncake-master` daemon, and the
//! mapping of the engine's errors to `StoreError`.

mod support;

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_store::codes::*;
use mooncake_store::{MooncakeStore, ReplicateConfig, StoreError};
use support::{payload, store, Master};

/// The code of an `OperationFailed`, or a panic naming what came instead.
fn failed<T: std::fmt::Debug>(res: Result<T, StoreError>) -> i32 {
    match res {
        Err(StoreError::OperationFailed(code)) => code,
        other => panic!("expected OperationFailed, got {other:?}"),
    }
}

/// Whether `res` is an `InvalidArgument` whose message contains `what`.
fn invalid<T: std::fmt::Debug>(res: Result<T, StoreError>, what: &str) {
    match res {
        Err(StoreError::InvalidArgument(msg)) => {
            assert!(msg.contains(what), "{msg:?} does not mention {what:?}")
        }
        other => panic!("expected InvalidArgument({what:?}), got {other:?}"),
    }
}

fn ptr(buf: &mut [u8]) -> *mut c_void {
    buf.as_mut_ptr().cast()
}

#[test]
fn before_setup_every_method_answers_like_the_reference() {
    let store = MooncakeStore::new().unwrap();
    let mut buf = vec![0u8; 64];
    assert_eq!(failed(store.health_check()), HEALTH_NOT_INITIALIZED);
    assert_eq!(failed(store.put("k", b"v", None)), INVALID_PARAMS);
    assert_eq!(failed(store.get("k")), INVALID_PARAMS);
    assert_eq!(failed(store.is_exist("k")), INVALID_PARAMS);
    assert_eq!(failed(store.get_size("k")), INVALID_PARAMS);
    assert_eq!(failed(store.remove("k", false)), INVALID_PARAMS);
    assert_eq!(failed(store.remove_by_regex(".*", false)), INVALID_PARAMS);
    assert_eq!(failed(store.remove_all(false)), INVALID_PARAMS);
    assert_eq!(failed(store.batch_is_exist(&["k"])), INVALID_PARAMS);
    assert_eq!(store.get_hostname().unwrap(), "");
    // SAFETY (all unsafe calls of this file): `buf` is valid for its length during
    // each call and nothing else touches it.
    unsafe {
        assert_eq!(
            failed(store.register_buffer(ptr(&mut buf), 64)),
            INVALID_PARAMS
        );
        assert_eq!(
            failed(store.unregister_buffer(ptr(&mut buf))),
            INVALID_PARAMS
        );
        assert_eq!(
            failed(store.put_from("k", ptr(&mut buf), 8, None)),
            INVALID_PARAMS
        );
        assert_eq!(
            failed(store.get_into("k", ptr(&mut buf), 8)),
            INVALID_PARAMS
        );
        let p = ptr(&mut buf);
        assert_eq!(
            store
                .batch_put_from(&["a", "b"], &[p, p], &[1, 1], None)
                .unwrap(),
            [INVALID_PARAMS; 2]
        );
        assert_eq!(
            store.batch_get_into(&["a", "b"], &[p, p], &[1, 1]).unwrap(),
            [i64::from(INVALID_PARAMS); 2]
        );
        // Argument checks come first, as in the reference's Rust layer.
        assert!(store
            .batch_put_from(&[], &[p], &[1], None)
            .unwrap()
            .is_empty());
        assert!(store.batch_get_into(&[], &[], &[]).unwrap().is_empty());
        invalid(
            store.batch_put_from(&["a"], &[p, p], &[1], None),
            "same length",
        );
        invalid(
            store.batch_get_into(&["a", "b"], &[p, p], &[1]),
            "same length",
        );
    }
    assert!(store.batch_is_exist(&[]).unwrap().is_empty());
    assert!(matches!(
        store.put("a\0b", b"v", None),
        Err(StoreError::InvalidString(_))
    ));
}

#[test]
fn setup_takes_the_reference_arguments_and_refuses_what_it_cannot_serve() {
    let master = Master::start(&[]);
    let store = MooncakeStore::new().unwrap();
    // Metadata server, local buffer and device name are accepted and not needed.
    for metadata in [
        "http://127.0.0.1:8080/metadata",
        "P2PHANDSHAKE",
        "etcd://127.0.0.1:2379",
    ] {
        store
            .setup(
                "127.0.0.1",
                metadata,
                16 << 20,
                1 << 30,
                "tcp",
                "mlx5_0",
                &master.addr,
            )
            .unwrap();
        store.health_check().unwrap();
    }
    // `host:port` with a port the system chose.
    let hostname = store.get_hostname().unwrap();
    let port: u16 = hostname
        .strip_prefix("127.0.0.1:")
        .expect("host:port")
        .parse()
        .unwrap();
    assert_ne!(port, 0);
    // A setup refused for its arguments changes nothing.
    invalid(
        store.setup("127.0.0.1", "", 16 << 20, 0, "nvlink", "", &master.addr),
        "unknown protocol",
    );
    store.health_check().unwrap();
    #[cfg(not(feature = "rdma"))]
    invalid(
        store.setup("127.0.0.1", "", 16 << 20, 0, "rdma", "", &master.addr),
        "`rdma` feature",
    );
    #[cfg(not(feature = "etcd"))]
    invalid(
        store.setup(
            "127.0.0.1",
            "",
            16 << 20,
            0,
            "tcp",
            "",
            "etcd://127.0.0.1:2379/c",
        ),
        "`etcd` feature",
    );
    invalid(
        store.setup("127.0.0.1", "", 16 << 20, 0, "tcp", "", "no-port"),
        "not an address",
    );
    invalid(
        store.setup("", "", 16 << 20, 0, "tcp", "", &master.addr),
        "local_hostname",
    );
    assert!(matches!(
        store.setup("127.0.0.1\0", "", 16 << 20, 0, "tcp", "", &master.addr),
        Err(StoreError::InvalidString(_))
    ));
    // Nothing listens on port 1: the master is unreachable.
    assert_eq!(
        failed(store.setup("127.0.0.1", "", 16 << 20, 0, "tcp", "", "127.0.0.1:1")),
        RPC_FAIL
    );
    // A failure after leaving the master leaves the store not set up.
    assert_eq!(failed(store.health_check()), HEALTH_NOT_INITIALIZED);
    // A hostname with its port keeps it; a client without memory works too.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    store
        .setup(&format!("127.0.0.1:{free}"), "", 0, 0, "", "", &master.addr)
        .unwrap();
    assert_eq!(store.get_hostname().unwrap(), format!("127.0.0.1:{free}"));
    store.health_check().unwrap();
}

#[test]
fn put_get_sizes_and_existence() {
    let master = Master::start(&[]);
    let store = store(&master, 32 << 20);
    let value = payload(1, 100_000);
    store.put("a", &value, None).unwrap();
    assert!(store.is_exist("a").unwrap());
    assert_eq!(store.get_size("a").unwrap(), 100_000);
    assert_eq!(store.get("a").unwrap(), value);
    // Immutable, as in the reference: a second put succeeds and changes nothing.
    store.put("a", b"other", None).unwrap();
    assert_eq!(store.get("a").unwrap(), value);
    // A missing key, with the reference's code.
    assert!(!store.is_exist("missing").unwrap());
    assert_eq!(failed(store.get("missing")), OBJECT_NOT_FOUND);
    assert_eq!(failed(store.get_size("missing")), OBJECT_NOT_FOUND);
    // Bad arguments keep their message; NUL bytes are refused as C strings are.
    invalid(store.put("", b"v", None), "");
    invalid(store.put("empty", b"", None), "");
    assert!(matches!(
        store.get("a\0"),
        Err(StoreError::InvalidString(_))
    ));
    assert!(matches!(
        store.is_exist("a\0"),
        Err(StoreError::InvalidString(_))
    ));
    let nul_segment = ReplicateConfig {
        preferred_segments: vec!["x\0".into()],
        ..Default::default()
    };
    assert!(matches!(
        store.put("b", b"v", Some(&nul_segment)),
        Err(StoreError::InvalidString(_))
    ));
    // A value larger than the pool: no room, with the reference's code.
    assert_eq!(
        failed(store.put("huge", &vec![7u8; 40 << 20], None)),
        NO_AVAILABLE_HANDLE
    );
}

#[test]
fn replicate_config_and_drop_unmount() {
    let master = Master::start(&[]);
    let reader = store(&master, 16 << 20);
    let value = payload(2, 4096);
    {
        let writer = store(&master, 16 << 20);
        // Its own hostname names its own segment: the only replica lands there.
        let local = ReplicateConfig {
            preferred_segments: vec![writer.get_hostname().unwrap()],
            ..Default::default()
        };
        writer.put("local", &value, Some(&local)).unwrap();
        // Two replicas on two segments; unknown names are skipped, as in the reference.
        let twice = ReplicateConfig {
            replica_num: 2,
            with_soft_pin: true,
            with_hard_pin: true,
            preferred_segments: vec!["seg-0".into()],
        };
        writer.put("twice", &value, Some(&twice)).unwrap();
        assert_eq!(reader.get("local").unwrap(), value);
        // Dropping the writer leaves the master: its segment goes, with "local".
    }
    assert_eq!(failed(reader.get("local")), OBJECT_NOT_FOUND);
    assert_eq!(
        reader.get("twice").unwrap(),
        value,
        "the replica on the reader's segment survives"
    );
}

#[test]
fn zero_copy_methods_check_raw_ranges_against_registered_buffers() {
    let master = Master::start(&[]);
    let store = store(&master, 16 << 20);
    let value = payload(3, 10_000);
    let mut region = vec![0u8; 64 << 10];
    let base = ptr(&mut region);
    let mut unregistered = vec![0xAAu8; 16 << 10];
    // SAFETY: see `before_setup_every_method_answers_like_the_reference`; `region`
    // outlives its registration.
    unsafe {
        invalid(store.register_buffer(std::ptr::null_mut(), 8), "non-null");
        invalid(store.register_buffer(base, 0), "non-empty");
        store.register_buffer(base, region.len()).unwrap();
        region[..value.len()].copy_from_slice(&value);
        store.put_from("zc", base, value.len(), None).unwrap();
        // A key that exists is a success, as for `put`.
        store.put_from("zc", base, 1, None).unwrap();
        assert_eq!(store.get("zc").unwrap(), value);
        // Read into the middle of the region.
        let at = base.cast::<u8>().add(20_000).cast();
        assert_eq!(
            store.get_into("zc", at, 30_000).unwrap(),
            value.len() as i64
        );
        assert_eq!(&region[20_000..30_000], &value[..]);
        // Too small: the reference's INVALID_PARAMS, nothing written.
        region[40_000..50_000].fill(0);
        assert_eq!(
            failed(store.get_into("zc", base.cast::<u8>().add(40_000).cast(), 9_999)),
            INVALID_PARAMS
        );
        assert!(region[40_000..50_000].iter().all(|&b| b == 0));
        assert_eq!(
            failed(store.get_into("missing", base, 100)),
            OBJECT_NOT_FOUND
        );
        // Ranges outside the registered buffer are refused before any access.
        invalid(
            store.get_into("zc", ptr(&mut unregistered), unregistered.len()),
            "not inside a registered buffer",
        );
        assert!(unregistered.iter().all(|&b| b == 0xAA));
        invalid(
            store.put_from("other", ptr(&mut unregistered), 100, None),
            "not inside a registered buffer",
        );
        invalid(
            store.get_into("zc", base.cast::<u8>().add(60 << 10).cast(), 8 << 10),
            "past the end",
        );
        invalid(store.put_from("other", base, 0, None), "empty");
        assert!(!store.is_exist("other").unwrap());
        // After unregistering, the region is refused too.
        invalid(
            store.unregister_buffer(ptr(&mut unregistered)),
            "no buffer is registered",
        );
        store.unregister_buffer(base).unwrap();
        invalid(
            store.get_into("zc", base, 100),
            "not inside a registered buffer",
        );
    }
}

#[test]
fn batches_answer_per_key() {
    let master = Master::start(&[]);
    let store = store(&master, 16 << 20);
    let mut region = vec![0u8; 32 << 10];
    let base = ptr(&mut region);
    let at = |off: usize| -> *mut c_void { base.cast::<u8>().wrapping_add(off).cast() };
    let mut outside = vec![0u8; 1024];
    for (i, chunk) in region[..12 << 10].chunks_mut(4096).enumerate() {
        chunk.copy_from_slice(&payload(i as u8, 4096));
    }
    // SAFETY: see `before_setup_every_method_answers_like_the_reference`.
    unsafe {
        store.register_buffer(base, region.len()).unwrap();
        let codes = store
            .batch_put_from(
                &["b0", "b1", "b2", "bad"],
                &[at(0), at(4096), at(8192), ptr(&mut outside)],
                &[4096; 4],
                None,
            )
            .unwrap();
        assert_eq!(codes, [0, 0, 0, INVALID_PARAMS]);
        // Again: existing keys are successes.
        assert_eq!(
            store
                .batch_put_from(&["b0"], &[at(0)], &[4096], None)
                .unwrap(),
            [0]
        );
        assert_eq!(
            store.batch_is_exist(&["b0", "bad", "b2"]).unwrap(),
            [true, false, true]
        );

        // Disjoint destinations: read straight into them.
        region[16 << 10..].fill(0);
        let got = store
            .batch_get_into(
                &["b2", "missing", "b1", "b0", "b1"],
                &[
                    at(16 << 10),
                    at(20 << 10),
                    at(24 << 10),
                    at(28 << 10),
                    ptr(&mut outside),
                ],
                &[4096, 4096, 4096, 100, 1024],
            )
            .unwrap();
        assert_eq!(
            got,
            [
                4096,
                OBJECT_NOT_FOUND.into(),
                4096,
                INVALID_PARAMS.into(),
                INVALID_PARAMS.into()
            ]
        );
        assert_eq!(&region[16 << 10..20 << 10], &payload(2, 4096)[..]);
        assert_eq!(&region[24 << 10..28 << 10], &payload(1, 4096)[..]);
        // Overlapping destinations: read through the engine's buffers, copied in order.
        let got = store
            .batch_get_into(&["b0", "b1"], &[at(16 << 10), at(18 << 10)], &[4096, 4096])
            .unwrap();
        assert_eq!(got, [4096, 4096]);
        assert_eq!(&region[16 << 10..18 << 10], &payload(0, 4096)[..2048]);
        assert_eq!(&region[18 << 10..22 << 10], &payload(1, 4096)[..]);
        invalid(
            store.batch_get_into(&["b0"], &[at(0)], &[1, 2]),
            "same length",
        );
        assert!(matches!(
            store.batch_get_into(&["b\0"], &[at(0)], &[1]),
            Err(StoreError::InvalidString(_))
        ));
        assert!(matches!(
            store.batch_is_exist(&["ok", "b\0"]),
            Err(StoreError::InvalidString(_))
        ));
    }
}

#[test]
fn removes_and_leases() {
    // Leases of 1 s: longer than the grace of three removes without `force`, short
    // enough that forced removes wait little.
    let master = Master::start(&["--default-lease-ms", "1000"]);
    let store = store(&master, 16 << 20);
    for key in ["a/1", "a/2", "b/1", "leased", "c/1"] {
        store.put(key, key.as_bytes(), None).unwrap();
    }
    store.remove("c/1", false).unwrap();
    assert_eq!(failed(store.remove("c/1", false)), OBJECT_NOT_FOUND);
    invalid(store.remove_by_regex("a/(", false), "regex");
    assert_eq!(store.remove_by_regex("^a/", false).unwrap(), 2);
    assert_eq!(
        store.batch_is_exist(&["a/1", "a/2", "b/1"]).unwrap(),
        [false, false, true]
    );

    // A reader holds a lease on "leased" (a replica list asked for and not released).
    let reader = mooncake_core::Store::builder()
        .master_address(&master.addr)
        .global_segment_size(0)
        .build()
        .unwrap();
    lease_of(&reader, "leased");
    assert_eq!(failed(store.remove("leased", false)), OBJECT_HAS_LEASE);
    assert_eq!(store.remove_by_regex("leased", false).unwrap(), 0);
    assert_eq!(
        store.remove_all(false).unwrap(),
        1,
        "b/1 goes, the leased object stays"
    );
    assert!(store.is_exist("leased").unwrap());
    // `force` waits for the lease to run out, then removes.
    let start = Instant::now();
    store.remove("leased", true).unwrap();
    assert!(
        start.elapsed() >= Duration::from_millis(100),
        "removed while leased"
    );
    assert!(!store.is_exist("leased").unwrap());

    for (key, force_regex) in [("r", true), ("s", false)] {
        store.put(key, b"v", None).unwrap();
        lease_of(&reader, key);
        if force_regex {
            assert_eq!(store.remove_by_regex("^r$", true).unwrap(), 1);
        } else {
            assert_eq!(store.remove_all(true).unwrap(), 1);
        }
        assert!(!store.is_exist(key).unwrap());
    }
}

fn lease_of(reader: &mooncake_core::Store, key: &str) {
    reader.master().get_replica_list(key).unwrap();
}

#[test]
fn a_dead_master_is_reported_with_the_reference_codes() {
    let mut master = Master::start(&[]);
    let store = store(&master, 16 << 20);
    store.put("k", b"v", None).unwrap();
    master.kill9();
    assert_eq!(failed(store.health_check()), HEALTH_MASTER_UNREACHABLE);
    let code = failed(store.get_size("k"));
    assert!(code == RPC_FAIL || code == RPC_TIMEOUT, "code {code}");
}

#[test]
fn one_store_is_shared_by_threads() {
    let master = Master::start(&[]);
    let store = Arc::new(store(&master, 32 << 20));
    let threads: Vec<_> = (0..4u8)
        .map(|t| {
            let store = Arc::clone(&store);
            std::thread::spawn(move || {
                for i in 0..25u8 {
                    let key = format!("t{t}/{i}");
                    let value = payload(t ^ i, 1000 + usize::from(i));
                    store.put(&key, &value, None).unwrap();
                    assert_eq!(store.get(&key).unwrap(), value);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    // Right after the gets: their leases are given back asynchronously, and the
    // remove's grace waits for that.
    assert_eq!(store.remove_all(false).unwrap(), 100);
}

/// The table on `impl From<mooncake_core::Error> for StoreError`, row by row.
#[test]
fn engine_errors_map_to_the_reference_codes() {
    use mooncake_core::Error as E;
    let s = || "x".to_owned();
    let rows: Vec<(E, i32)> = vec![
        (E::NotFound(s()), OBJECT_NOT_FOUND),
        (E::AlreadyExists(s()), OBJECT_ALREADY_EXISTS),
        (E::HasLease(s()), OBJECT_HAS_LEASE),
        (
            E::NoSpace {
                needed: 1,
                largest_free: 0,
                reason: s(),
            },
            NO_AVAILABLE_HANDLE,
        ),
        (
            E::BufferTooSmall {
                needed: 2,
                capacity: 1,
            },
            INVALID_PARAMS,
        ),
        (E::UnknownClient(7), CLIENT_NOT_FOUND),
        (E::MasterUnavailable(s()), RPC_FAIL),
        (E::Timeout(s()), RPC_TIMEOUT),
        (
            E::Transport(mooncake_transfer::TransferError::NoDevice(s())),
            TRANSFER_FAIL,
        ),
        (E::Corrupted(s()), CHECKSUM_MISMATCH),
        (E::Recovering(s()), INTERNAL_ERROR),
        (
            E::Moved {
                slot: 1,
                leader: None,
            },
            INTERNAL_ERROR,
        ),
        (E::Coordination(s()), INTERNAL_ERROR),
        (
            E::Storage(Arc::new(mooncake_core::storage::StorageError::Remote(s()))),
            INTERNAL_ERROR,
        ),
    ];
    for (e, code) in rows {
        let shown = e.to_string();
        assert_eq!(failed::<()>(Err(StoreError::from(e))), code, "{shown}");
    }
    match StoreError::from(E::InvalidArgument("bad key".into())) {
        StoreError::InvalidArgument(msg) => assert_eq!(msg, "bad key"),
        other => panic!("{other:?}"),
    }
}
