//! The backend suite: every test runs on every backend over io_uring,
//! io_uring + O_DIRECT, POSIX and POSIX + O_DIRECT.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{value, Env, GatedEngine};
use mooncake_storage::*;

all_backends!(
    roundtrip_exact_bytes,
    exists_remove_and_errors,
    restart_recovers_every_object,
    generations_survive_a_restart,
    lru_keeps_a_read_unit,
    fifo_evicts_oldest_first,
    listener_runs_before_files_are_deleted,
    read_in_flight_survives_eviction,
    failed_notifications_are_queued_and_retried,
    no_space_without_capacity_to_evict,
    concurrent_writers_readers_and_eviction,
    staging_serves_remote_loads,
    user_defined_strategy_plugs_in,
    mixed_sizes_in_one_batch,
    open_handles_stay_within_their_bound,
);

const SIZES: [usize; 9] = [1, 7, 4095, 4096, 4097, 65_539, 1 << 20, (1 << 20) + 1, 4 << 20];

fn roundtrip_exact_bytes(env: &Env) {
    let b = env.open(env.opts());
    let keys: Vec<String> = SIZES.iter().map(|s| format!("obj-{s}")).collect();
    let values: Vec<Vec<u8>> = keys.iter().zip(SIZES).map(|(k, s)| value(k, s)).collect();
    let batch: Vec<(&str, &[u8])> = keys.iter().map(|k| k.as_str()).zip(values.iter().map(|v| &v[..])).collect();
    for r in b.batch_offload(&batch) {
        let m = r.unwrap();
        assert_eq!(m.checksum, crc32c::crc32c(&values[keys.iter().position(|k| *k == m.key).unwrap()]));
    }
    for (k, v) in keys.iter().zip(&values) {
        // exact-size buffer
        let mut buf = vec![0u8; v.len()];
        assert_eq!(b.load(k, &mut buf).unwrap(), v.len());
        assert_eq!(&buf, v, "{k}");
        // larger, unaligned buffer
        let mut big = vec![0xAAu8; v.len() + 4097];
        assert_eq!(b.load(k, &mut big[1..]).unwrap(), v.len());
        assert_eq!(&big[1..=v.len()], &v[..]);
        assert!(big[v.len() + 1..].iter().all(|&x| x == 0xAA), "nothing written past the value");
        // aligned buffer
        let mut aligned = AlignedBuf::zeroed(v.len());
        b.load(k, &mut aligned).unwrap();
        assert_eq!(&aligned[..], &v[..]);
        assert_eq!(b.load_vec(k).unwrap(), *v);
        let m = b.object_meta(k).unwrap();
        assert_eq!((m.len, m.checksum), (v.len() as u64, crc32c::crc32c(v)));
    }
    // batch load, in another order, with one missing key
    let mut bufs: Vec<Vec<u8>> = values.iter().rev().map(|v| vec![0u8; v.len()]).collect();
    bufs.push(vec![0u8; 8]);
    let mut names: Vec<&str> = keys.iter().rev().map(|k| k.as_str()).collect();
    names.push("missing");
    let mut reqs: Vec<(&str, &mut [u8])> = names.iter().copied().zip(bufs.iter_mut().map(|b| &mut b[..])).collect();
    let res = b.batch_load(&mut reqs);
    for (i, r) in res.iter().enumerate().take(keys.len()) {
        assert_eq!(*r.as_ref().unwrap(), values[keys.len() - 1 - i].len());
        assert_eq!(bufs[i], values[keys.len() - 1 - i]);
    }
    assert!(res[keys.len()].as_ref().unwrap_err().is_not_found());
    let stats = b.stats();
    assert_eq!(stats.objects, keys.len() as u64);
    assert!(stats.used_bytes >= SIZES.iter().sum::<usize>() as u64);
}

fn exists_remove_and_errors(env: &Env) {
    let b = env.open(env.opts());
    let v = value("a", 5000);
    b.offload("a", &v).unwrap();
    b.offload("b", b"bee").unwrap();
    assert!(b.exists("a") && b.exists("b") && !b.exists("c"));
    assert!(matches!(b.offload("a", b"again"), Err(StorageError::AlreadyExists(_))));
    let res = b.batch_offload(&[("d", b"1"), ("d", b"2"), ("", b"x"), ("e", b"")]);
    assert!(res[0].is_ok());
    assert!(matches!(res[1], Err(StorageError::AlreadyExists(_))));
    assert!(matches!(res[2], Err(StorageError::InvalidArgument(_))));
    assert!(matches!(res[3], Err(StorageError::InvalidArgument(_))));
    let long = "k".repeat(4097);
    assert!(matches!(b.offload(&long, b"x"), Err(StorageError::InvalidArgument(_))));
    let max_key = "k".repeat(4096);
    b.offload(&max_key, b"longest key").unwrap();
    assert_eq!(b.load_vec(&max_key).unwrap(), b"longest key");
    let mut small = [0u8; 10];
    assert!(matches!(b.load("a", &mut small), Err(StorageError::BufferTooSmall { needed: 5000, got: 10 })));
    b.remove("a").unwrap();
    assert!(!b.exists("a"));
    assert!(b.load("a", &mut vec![0u8; 5000]).unwrap_err().is_not_found());
    assert!(b.remove("a").unwrap_err().is_not_found());
    assert_eq!(b.load_vec("b").unwrap(), b"bee", "other objects untouched");
    // a removed key can be written again
    b.offload("a", b"new a").unwrap();
    assert_eq!(b.load_vec("a").unwrap(), b"new a");
    b.remove("b").unwrap();
    b.remove("d").unwrap();
    b.remove("a").unwrap();
    b.remove(&max_key).unwrap();
    assert_eq!(b.stats().objects, 0);
    assert_eq!(b.stats().used_bytes, 0);
    drop(b);
    // removals are durable
    let b = env.open(env.opts());
    assert_eq!(b.scan_meta(&mut |_| {}), 0);
}

fn restart_recovers_every_object(env: &Env) {
    let mut expected = std::collections::BTreeMap::new();
    {
        let b = env.open_with(env.opts(), BucketConfig { bucket_size_limit: 1 << 20, bucket_keys_limit: 3 });
        for round in 0..3 {
            let keys: Vec<String> = (0..5).map(|i| format!("r{round}-k{i}")).collect();
            let vals: Vec<Vec<u8>> = keys.iter().enumerate().map(|(i, k)| value(k, 1 + i * 300_001)).collect();
            let batch: Vec<(&str, &[u8])> = keys.iter().map(|k| k.as_str()).zip(vals.iter().map(|v| &v[..])).collect();
            for r in b.batch_offload(&batch) {
                r.unwrap();
            }
            for (k, v) in keys.into_iter().zip(vals) {
                expected.insert(k, v);
            }
        }
        b.remove("r1-k2").unwrap();
        expected.remove("r1-k2");
    }
    for pass in 0..2 {
        let b = env.open(env.opts());
        let mut seen = std::collections::BTreeMap::new();
        let n = b.scan_meta(&mut |m| {
            seen.insert(m.key.clone(), (m.len, m.checksum));
        });
        assert_eq!(n, expected.len(), "pass {pass}");
        for (k, v) in &expected {
            assert_eq!(seen[k], (v.len() as u64, crc32c::crc32c(v)), "{k}");
            assert_eq!(&b.load_vec(k).unwrap(), v, "{k}");
        }
        assert!(!b.exists("r1-k2"));
        // writes after a restart get fresh names and survive the next restart
        let k = format!("after-{pass}");
        let v = value(&k, 12_345);
        b.offload(&k, &v).unwrap();
        expected.insert(k, v);
    }
}

/// Each object keeps the generation it was written with, across a restart and a
/// partial removal (which rewrites a bucket's meta); plain writes report 0.
fn generations_survive_a_restart(env: &Env) {
    let keys: Vec<String> = (0..6).map(|i| format!("g{i}")).collect();
    let vals: Vec<Vec<u8>> = keys.iter().enumerate().map(|(i, k)| value(k, 1 + i * 5000)).collect();
    let gens = |i: usize| 1_700_000_000_000_000_000u64 + i as u64 * 7;
    {
        let b = env.open_with(env.opts(), BucketConfig { bucket_size_limit: 1 << 20, bucket_keys_limit: 4 });
        let batch: Vec<(&str, &[u8], u64)> =
            keys.iter().zip(&vals).enumerate().map(|(i, (k, v))| (k.as_str(), &v[..], gens(i))).collect();
        for (i, r) in b.batch_offload_generations(&batch).into_iter().enumerate() {
            assert_eq!(r.unwrap().generation, gens(i));
        }
        assert_eq!(b.offload("plain", b"no generation").unwrap().generation, 0);
        b.remove("g1").unwrap();
    }
    let b = env.open(env.opts());
    let mut seen = std::collections::BTreeMap::new();
    b.scan_meta(&mut |m| {
        seen.insert(m.key.clone(), m.generation);
    });
    assert_eq!(seen.remove("plain"), Some(0));
    assert!(!seen.contains_key("g1"));
    for (i, k) in keys.iter().enumerate().filter(|(i, _)| *i != 1) {
        assert_eq!(seen.get(k), Some(&gens(i)), "{k}");
        assert_eq!(b.object_meta(k).unwrap().generation, gens(i), "{k}");
        assert_eq!(b.load_vec(k).unwrap(), vals[i], "{k}");
    }
}

/// Writes `n` single-object units (one offload call each), `len` bytes each.
fn write_units(b: &dyn StorageBackend, prefix: &str, n: usize, len: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let k = format!("{prefix}{i}");
            b.offload(&k, &value(&k, len)).unwrap();
            k
        })
        .collect()
}

const UNIT: usize = 60_000;

fn lru_keeps_a_read_unit(env: &Env) {
    let cap = 4 * env.unit_cost(UNIT as u64);
    let b = env.open(env.opts().with_capacity(cap).with_eviction(LruEviction::new()));
    let keys = write_units(&*b, "u", 4, UNIT);
    for _ in 0..3 {
        assert_eq!(b.load_vec(&keys[0]).unwrap(), value(&keys[0], UNIT));
    }
    b.load_vec(&keys[2]).unwrap();
    // two more units: the two never-read ones (u1, u3) go, the read ones stay
    write_units(&*b, "v", 2, UNIT);
    assert!(b.exists(&keys[0]) && b.exists(&keys[2]), "read units survive");
    assert!(!b.exists(&keys[1]) && !b.exists(&keys[3]), "never-read units are evicted first");
    // next: the least recently read (u0 was read before u2)
    b.load_vec("v0").unwrap();
    b.load_vec("v1").unwrap();
    write_units(&*b, "w", 1, UNIT);
    assert!(!b.exists(&keys[0]) && b.exists(&keys[2]));
    assert_eq!(b.load_vec(&keys[2]).unwrap(), value(&keys[2], UNIT));
    assert!(b.stats().used_bytes <= cap);
    assert_eq!(b.stats().evicted_objects, 3);
}

fn fifo_evicts_oldest_first(env: &Env) {
    let cap = 3 * env.unit_cost(UNIT as u64);
    let b = env.open(env.opts().with_capacity(cap).with_eviction(FifoEviction::new()));
    let keys = write_units(&*b, "u", 3, UNIT);
    for _ in 0..3 {
        b.load_vec(&keys[0]).unwrap(); // reads do not matter under FIFO
    }
    write_units(&*b, "v", 1, UNIT);
    assert!(!b.exists(&keys[0]));
    assert!(b.exists(&keys[1]) && b.exists(&keys[2]));
    write_units(&*b, "w", 1, UNIT);
    assert!(!b.exists(&keys[1]) && b.exists(&keys[2]));
    assert!(b.load_vec(&keys[0]).unwrap_err().is_not_found());
    // the order survives a restart (oldest first)
    drop(b);
    let b = env.open(env.opts().with_capacity(cap).with_eviction(FifoEviction::new()));
    write_units(&*b, "x", 1, UNIT);
    assert!(!b.exists(&keys[2]), "after restart the oldest ({}) goes first", keys[2]);
    assert!(b.exists("v0") && b.exists("w0") && b.exists("x0"));
}

fn listener_runs_before_files_are_deleted(env: &Env) {
    let cap = 3 * env.unit_cost(UNIT as u64);
    let locations: Arc<Mutex<Vec<(String, common::Location)>>> = Arc::default();
    let calls: Arc<Mutex<Vec<Vec<String>>>> = Arc::default();
    let (l2, c2) = (locations.clone(), calls.clone());
    let listener = move |keys: &[String]| -> Result<(), NotifyError> {
        let locs = l2.lock().unwrap();
        for k in keys {
            let (_, loc) = locs.iter().find(|(x, _)| x == k).expect("known key");
            assert!(loc.still_there(), "{k}: bytes deleted before the listener was told");
        }
        c2.lock().unwrap().push(keys.to_vec());
        Ok(())
    };
    let b = env.open(env.opts().with_capacity(cap).with_listener(Arc::new(listener)));
    let keys = write_units(&*b, "u", 3, UNIT);
    for k in &keys {
        locations.lock().unwrap().push((k.clone(), b.locate(k).unwrap()));
    }
    write_units(&*b, "v", 2, UNIT);
    let calls = calls.lock().unwrap().clone();
    assert_eq!(calls.concat(), vec![keys[0].clone(), keys[1].clone()]);
    // and after the listener, the bytes are gone
    for (k, loc) in locations.lock().unwrap().iter().take(2) {
        assert!(!loc.still_there(), "{k} still on disk after eviction");
        assert!(b.load(k, &mut vec![0u8; UNIT]).unwrap_err().is_not_found());
    }
    // explicit eviction runs the same protocol
    let report = b.evict(1).unwrap();
    assert_eq!(report.keys, vec![keys[2].clone()]);
    assert!(report.notified && report.bytes_freed >= UNIT as u64);
    assert!(!b.exists(&keys[2]));
    assert_eq!(b.stats().evicted_objects, 3);
}

fn read_in_flight_survives_eviction(env: &Env) {
    let gated = GatedEngine::new(env.io.clone());
    let told = Arc::new(AtomicBool::new(false));
    let t2 = told.clone();
    let listener = move |_: &[String]| -> Result<(), NotifyError> {
        t2.store(true, Ordering::SeqCst);
        Ok(())
    };
    let len = 4 << 20;
    let b = env.open(
        env.opts()
            .with_io(gated.clone())
            .with_capacity(4 * env.unit_cost(len as u64))
            .with_listener(Arc::new(listener)),
    );
    b.offload("big", &value("big", len)).unwrap();
    let loc = b.locate("big").unwrap();
    gated.arm();
    let reader = {
        let b = b.backend.clone();
        std::thread::spawn(move || b.load_vec("big"))
    };
    gated.wait_blocked(); // the read holds its pin and sits in the I/O engine
    let evictor = {
        let b = b.backend.clone();
        std::thread::spawn(move || b.evict(u64::MAX).unwrap())
    };
    let start = std::time::Instant::now();
    while !told.load(Ordering::SeqCst) {
        assert!(start.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!b.exists("big"), "prepared: gone from the index");
    std::thread::sleep(Duration::from_millis(50));
    assert!(loc.still_there(), "finalize waits for the in-flight read");
    assert!(!evictor.is_finished());
    gated.open_gate();
    assert_eq!(reader.join().unwrap().unwrap(), value("big", len), "the read completes with the right bytes");
    let report = evictor.join().unwrap();
    assert_eq!(report.keys, vec!["big".to_string()]);
    assert!(!loc.still_there());
}

fn failed_notifications_are_queued_and_retried(env: &Env) {
    let fail = Arc::new(AtomicBool::new(true));
    let delivered: Arc<Mutex<Vec<String>>> = Arc::default();
    let attempts = Arc::new(AtomicUsize::new(0));
    let (f2, d2, a2) = (fail.clone(), delivered.clone(), attempts.clone());
    let listener = move |keys: &[String]| -> Result<(), NotifyError> {
        a2.fetch_add(1, Ordering::SeqCst);
        if f2.load(Ordering::SeqCst) {
            return Err("master unreachable".into());
        }
        d2.lock().unwrap().extend(keys.iter().cloned());
        Ok(())
    };
    let cap = 2 * env.unit_cost(UNIT as u64);
    let b = env.open(env.opts().with_capacity(cap).with_listener(Arc::new(listener)));
    let keys = write_units(&*b, "u", 2, UNIT);
    write_units(&*b, "v", 1, UNIT); // evicts u0; the notification fails
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
    assert!(!b.exists(&keys[0]));
    assert!(b.load(&keys[0], &mut vec![0u8; UNIT]).unwrap_err().is_not_found(), "clean not-found, no crash");
    assert_eq!(b.stats().pending_notifications, 1);
    assert!(matches!(b.retry_pending_notifications(), Err(StorageError::Notification(_))));
    assert_eq!(b.stats().pending_notifications, 1, "still queued");
    // the next eviction sends the queued key together with its own
    fail.store(false, Ordering::SeqCst);
    write_units(&*b, "w", 1, UNIT); // evicts u1
    let mut got = delivered.lock().unwrap().clone();
    got.sort();
    assert_eq!(got, vec![keys[0].clone(), keys[1].clone()]);
    assert_eq!(b.stats().pending_notifications, 0);
    // explicit retry
    fail.store(true, Ordering::SeqCst);
    let r = b.evict(1).unwrap();
    assert!(!r.notified);
    assert_eq!(b.stats().pending_notifications, 1);
    fail.store(false, Ordering::SeqCst);
    assert_eq!(b.retry_pending_notifications().unwrap(), 1);
    assert_eq!(delivered.lock().unwrap().last(), Some(&"v0".to_string()));
    assert_eq!(b.retry_pending_notifications().unwrap(), 0);
    // a queued notice is dropped when its key is written again (it would be stale)
    fail.store(true, Ordering::SeqCst);
    b.evict(1).unwrap(); // w0
    assert_eq!(b.stats().pending_notifications, 1);
    b.offload("w0", &value("w0", 10)).unwrap();
    assert_eq!(b.stats().pending_notifications, 0);
    assert_eq!(b.load_vec("w0").unwrap(), value("w0", 10));
}

fn no_space_without_capacity_to_evict(env: &Env) {
    let cap = 2 * env.unit_cost(UNIT as u64);
    let b = env.open(env.opts().with_capacity(cap));
    let too_big = value("big", 3 * UNIT);
    assert!(matches!(b.offload("big", &too_big), Err(StorageError::NoSpace { .. })));
    assert!(!b.exists("big"));
    write_units(&*b, "u", 2, UNIT);
    assert!(matches!(b.offload("big", &too_big), Err(StorageError::NoSpace { .. })));
    assert!(b.stats().used_bytes <= cap);
    // a key that failed can be written later
    b.offload("big", b"small now").unwrap();
}

fn concurrent_writers_readers_and_eviction(env: &Env) {
    let len = 20_000;
    let cap = 16 * env.unit_cost(len as u64);
    let b = env.open(env.opts().with_capacity(cap).with_eviction(LruEviction::new()));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let b = b.backend.clone();
            std::thread::spawn(move || {
                let mut ok_reads = 0;
                for i in 0..40 {
                    let k = format!("t{t}-{i}");
                    let v = value(&k, len + i);
                    b.offload(&k, &v).unwrap();
                    for j in (0..=i).rev().step_by(7) {
                        let k = format!("t{}-{j}", (t + j) % 4);
                        let mut buf = vec![0u8; len + 64];
                        match b.load(&k, &mut buf) {
                            Ok(n) => {
                                assert_eq!(&buf[..n], &value(&k, len + j)[..], "never wrong bytes");
                                ok_reads += 1;
                            }
                            Err(e) => assert!(e.is_not_found(), "{e}"),
                        }
                    }
                }
                ok_reads
            })
        })
        .collect();
    let reads: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(reads > 0);
    let s = b.stats();
    assert!(s.used_bytes <= cap, "{s:?}");
    assert!(s.evicted_objects > 0);
    assert_eq!(s.objects + s.evicted_objects, 160);
}

fn staging_serves_remote_loads(env: &Env) {
    let b = env.open(env.opts());
    let keys = ["x", "y", "z"];
    let vals: Vec<Vec<u8>> = keys.iter().zip([10, 5000, 70_000]).map(|(k, n)| value(k, n)).collect();
    for (k, v) in keys.iter().zip(&vals) {
        b.offload(k, v).unwrap();
    }
    let staging = ClientBuffer::new(1 << 20, Duration::from_secs(5)).unwrap();
    if env.io.name() == "io_uring" {
        staging.register_with_uring(); // reads into it use READ_FIXED
    }
    let lease = load_into_staging(&*b.backend, &staging, &keys).unwrap();
    assert_eq!(lease.gc_ttl_ms, 5000);
    for (i, v) in vals.iter().enumerate() {
        assert_eq!(lease.locations[i].len, v.len() as u64);
        assert_eq!(&staging.read_slot(lease.batch_id, i).unwrap(), v);
    }
    assert!(staging.release(lease.batch_id));
    assert!(load_into_staging(&*b.backend, &staging, &["x", "nope"]).unwrap_err().is_not_found());
    assert_eq!(staging.stats().used_bytes, 0, "a failed load releases its batch");
}

/// A user-written strategy: last in, first out.
#[derive(Default)]
struct Lifo(Vec<UnitId>);

impl DiskEvictionStrategy for Lifo {
    fn add(&mut self, unit: UnitId, _info: UnitInfo<'_>) {
        if !self.0.contains(&unit) {
            self.0.push(unit);
        }
    }
    fn remove(&mut self, unit: UnitId) {
        self.0.retain(|&u| u != unit);
    }
    fn record_access(&mut self, _unit: UnitId) {}
    fn select_victim(&mut self) -> Option<UnitId> {
        self.0.pop()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn name(&self) -> &'static str {
        "lifo"
    }
}

fn user_defined_strategy_plugs_in(env: &Env) {
    let cap = 3 * env.unit_cost(UNIT as u64);
    let b = env.open(env.opts().with_capacity(cap).with_eviction(Lifo::default()));
    let keys = write_units(&*b, "u", 3, UNIT);
    write_units(&*b, "v", 1, UNIT);
    assert!(b.exists(&keys[0]) && b.exists(&keys[1]) && !b.exists(&keys[2]), "the newest unit went");
    assert!(b.exists("v0"));
}

/// One batch of small values (more than the bucket writer's staging buffers hold at
/// once) between large ones from aligned and unaligned memory: every byte comes back,
/// before and after a restart.
fn mixed_sizes_in_one_batch(env: &Env) {
    let mut keys = Vec::new();
    let mut vals: Vec<Vec<u8>> = Vec::new();
    for i in 0..300 {
        let k = format!("mix-{i:03}");
        let len = match i % 50 {
            7 => 1 << 20,
            19 => (1 << 20) + 5,
            33 => 3 << 20,
            _ => 65_536 - (i % 3) * 1000,
        };
        vals.push(value(&k, len));
        keys.push(k);
    }
    // large values at a 4 KiB-aligned address too (written without a bounce copy)
    let aligned: Vec<AlignedBuf> = vals
        .iter()
        .map(|v| {
            let mut a = AlignedBuf::zeroed(v.len());
            a.copy_from_slice(v);
            a
        })
        .collect();
    let batch: Vec<(&str, &[u8])> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), if i % 2 == 0 { &aligned[i][..] } else { &vals[i][..] }))
        .collect();
    {
        let b = env.open(env.opts());
        for (r, v) in b.batch_offload(&batch).into_iter().zip(&vals) {
            assert_eq!(r.unwrap().checksum, crc32c::crc32c(v));
        }
        for (k, v) in keys.iter().zip(&vals).step_by(7) {
            assert_eq!(&b.load_vec(k).unwrap(), v, "{k}");
        }
    }
    let b = env.open(env.opts());
    assert_eq!(b.scan_meta(&mut |_| {}), keys.len());
    let mut bufs: Vec<Vec<u8>> = vals.iter().map(|v| vec![0u8; v.len()]).collect();
    let mut reqs: Vec<(&str, &mut [u8])> =
        keys.iter().map(|k| k.as_str()).zip(bufs.iter_mut().map(|b| &mut b[..])).collect();
    for (r, v) in b.batch_load(&mut reqs).into_iter().zip(&vals) {
        assert_eq!(r.unwrap(), v.len());
    }
    assert!(bufs == vals);
}

/// A tier of more files than `max_open_files`: every object reads back exactly, twice
/// over, while the cached read handles stay within the bound (the oldest opened is
/// closed for a new one, and reopened by its next read). With a bound above the
/// number of files, nothing is closed. (The offset layout has one file: nothing to
/// bound.)
fn open_handles_stay_within_their_bound(env: &Env) {
    for (bound, files) in [(4usize, 20usize), (64, 20)] {
        let b = env.open(env.opts().with_max_open_files(bound));
        let keys: Vec<String> = (0..files).map(|i| format!("b{bound}-f{i}")).collect();
        // One offload per object: one bucket each, or one file each.
        for k in &keys {
            b.offload(k, &value(k, 5000)).unwrap();
        }
        for _ in 0..2 {
            for k in &keys {
                assert_eq!(b.load_vec(k).unwrap(), value(k, 5000), "{k}");
            }
        }
        let closed = b.stats().handles_closed;
        match env.kind {
            common::Kind::Offset => assert_eq!(closed, 0),
            _ if bound < files => {
                assert!(closed as usize >= 2 * files - bound, "bound {bound}: {closed} handles closed")
            }
            _ => assert_eq!(closed, 0, "bound {bound} above {files} files"),
        }
    }
}
