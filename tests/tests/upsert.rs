//! Upserts: random sequences of put / upsert / remove / get against a `HashMap`
//! model (with the storage nodes' durable records checked after every step), readers
//! in a loop during upserts (every read is exactly one value that was written, never
//! an error), concurrent upserts of one key, leases of readers keeping replaced
//! replicas, and acknowledged upserts surviving `kill -9` of the master.

mod support;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_core::{Error, Master, MasterConfig, MasterDaemon, Protocol, ReplicateConfig, Store};
use proptest::prelude::*;

const KEYS: usize = 6;
const STORES: usize = 2;

fn key_name(k: usize) -> String {
    format!("upsert/{k}")
}

/// Bytes that name their generation: the first 8 bytes are `gen`, the rest follow
/// from it, so any mix of two values is detected.
fn value(gen: u64, len: usize) -> Vec<u8> {
    let mut v: Vec<u8> = (0..len).map(|i| (gen as usize).wrapping_mul(131).wrapping_add(i * 7) as u8).collect();
    let head = gen.to_le_bytes();
    let n = len.min(8);
    v[..n].copy_from_slice(&head[..n]);
    v
}

/// The generation of a value read back, if it is exactly one value `value` makes.
fn generation_of(bytes: &[u8]) -> Option<u64> {
    if bytes.len() < 8 {
        return None;
    }
    let gen = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    (value(gen, bytes.len()) == bytes).then_some(gen)
}

#[derive(Clone, Debug)]
enum Op {
    Put { key: usize, seed: u8, len: usize, via: usize },
    Upsert { key: usize, seed: u8, len: usize, replicas: usize, via: usize },
    UpsertParts { key: usize, seed: u8, lens: Vec<usize>, via: usize },
    BatchUpsert { keys: Vec<usize>, seed: u8, len: usize, via: usize },
    Remove { key: usize, via: usize },
    Get { key: usize, via: usize },
    BatchGetInto { via: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..KEYS, any::<u8>(), 1usize..40_000, 0..STORES)
            .prop_map(|(key, seed, len, via)| Op::Put { key, seed, len, via }),
        4 => (0..KEYS, any::<u8>(), 1usize..40_000, 1usize..=2, 0..STORES)
            .prop_map(|(key, seed, len, replicas, via)| Op::Upsert { key, seed, len, replicas, via }),
        1 => (0..KEYS, any::<u8>(), proptest::collection::vec(0usize..9_000, 1..4), 0..STORES)
            .prop_map(|(key, seed, lens, via)| Op::UpsertParts { key, seed, lens, via }),
        1 => (proptest::collection::vec(0..KEYS, 1..4), any::<u8>(), 1usize..20_000, 0..STORES)
            .prop_map(|(keys, seed, len, via)| Op::BatchUpsert { keys, seed, len, via }),
        2 => (0..KEYS, 0..STORES).prop_map(|(key, via)| Op::Remove { key, via }),
        3 => (0..KEYS, 0..STORES).prop_map(|(key, via)| Op::Get { key, via }),
        1 => (0..STORES).prop_map(|via| Op::BatchGetInto { via }),
    ]
}

fn bytes_of(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_mul(29).wrapping_add((i * 13 % 251) as u8)).collect()
}

/// What the model holds per key: the value and how many replicas it was asked with.
type Model = HashMap<usize, (Vec<u8>, usize)>;

/// The records the storage nodes keep match the model: one record per replica of
/// every object (with its length and the master's checksum), none of anything else.
fn check_records(master: &Master, stores: &[Store], model: &Model) -> Result<(), TestCaseError> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    for s in stores {
        for r in s.segment_records() {
            let k: usize = r.key.strip_prefix("upsert/").unwrap().parse().unwrap();
            let Some((v, _)) = model.get(&k) else {
                return Err(TestCaseError::fail(format!("a node still records {} after it was removed", r.key)));
            };
            prop_assert_eq!(r.len, v.len() as u64, "record of {} has a stale length", &r.key);
            let info = master.object_info(&r.key).unwrap();
            prop_assert_eq!(r.checksum, info.checksum, "record of {} has a stale checksum", &r.key);
            *seen.entry(r.key).or_default() += 1;
        }
    }
    for (k, (_, replicas)) in model {
        let info = master.object_info(&key_name(*k)).unwrap();
        prop_assert_eq!(info.replicas.len(), *replicas, "replicas of {}", k);
        prop_assert_eq!(seen.get(&key_name(*k)).copied().unwrap_or(0), *replicas, "records of {}", k);
    }
    Ok(())
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    // No leases, so that a remove never depends on timing, and segments that never
    // reach the watermark (6 keys x 2 replicas x 40 KB), so nothing is evicted.
    let master =
        Master::new(MasterConfig { default_lease: Duration::ZERO, track_records: true, ..MasterConfig::default() })
            .unwrap();
    let stores: Vec<Store> =
        (0..STORES).map(|_| Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap()).collect();
    let mut model: Model = HashMap::new();
    for op in ops {
        match op {
            Op::Put { key, seed, len, via } => {
                let v = bytes_of(seed, len);
                match (stores[via].put(&key_name(key), &v), model.contains_key(&key)) {
                    (Ok(()), false) => {
                        model.insert(key, (v, 1));
                    }
                    (Err(Error::AlreadyExists(_)), true) => {}
                    (res, present) => prop_assert!(false, "put of {} (present: {}): {:?}", key, present, res),
                }
            }
            Op::Upsert { key, seed, len, replicas, via } => {
                let v = bytes_of(seed, len);
                stores[via].upsert_with(&key_name(key), &v, &ReplicateConfig::replicas(replicas)).unwrap();
                model.insert(key, (v, replicas));
            }
            Op::UpsertParts { key, seed, lens, via } => {
                let parts: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &l)| bytes_of(seed ^ i as u8, l)).collect();
                let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
                let joined = parts.concat();
                match stores[via].upsert_parts(&key_name(key), &refs) {
                    Ok(()) => {
                        prop_assert!(!joined.is_empty());
                        model.insert(key, (joined, 1));
                    }
                    Err(Error::InvalidArgument(_)) => prop_assert!(joined.is_empty(), "refused a non-empty value"),
                    Err(e) => prop_assert!(false, "upsert_parts: {}", e),
                }
            }
            Op::BatchUpsert { keys, seed, len, via } => {
                // A key twice in one batch: the later item is the one that stays.
                let values: Vec<Vec<u8>> = (0..keys.len()).map(|i| bytes_of(seed.wrapping_add(i as u8), len)).collect();
                let names: Vec<String> = keys.iter().map(|&k| key_name(k)).collect();
                let items: Vec<(&str, &[u8])> =
                    names.iter().zip(&values).map(|(k, v)| (k.as_str(), v.as_slice())).collect();
                for (res, (k, v)) in stores[via]
                    .batch_upsert(&items, &ReplicateConfig::default())
                    .into_iter()
                    .zip(keys.iter().zip(&values))
                {
                    prop_assert!(res.is_ok(), "batch upsert of {}: {:?}", k, res);
                    model.insert(*k, (v.clone(), 1));
                }
            }
            Op::Remove { key, via } => match (stores[via].remove(&key_name(key)), model.remove(&key)) {
                (Ok(()), Some(_)) | (Err(Error::NotFound(_)), None) => {}
                (res, was) => prop_assert!(false, "remove of {} (present: {}): {:?}", key, was.is_some(), res),
            },
            Op::Get { key, via } => match (stores[via].get(&key_name(key)), model.get(&key)) {
                (Ok(b), Some((v, _))) => prop_assert!(&b[..] == v.as_slice(), "get of {} returned other bytes", key),
                (Err(Error::NotFound(_)), None) => {}
                (res, want) => {
                    prop_assert!(false, "get of {} (present: {}): {:?}", key, want.is_some(), res.map(|b| b.len()))
                }
            },
            Op::BatchGetInto { via } => {
                let names: Vec<String> = (0..KEYS).map(key_name).collect();
                let keys: Vec<&str> = names.iter().map(String::as_str).collect();
                let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 40_000]; KEYS];
                let mut slices: Vec<&mut [u8]> = bufs.iter_mut().map(Vec::as_mut_slice).collect();
                let res = stores[via].batch_get_into(&keys, &mut slices);
                for (k, r) in res.into_iter().enumerate() {
                    match (r, model.get(&k)) {
                        (Ok(n), Some((v, _))) => prop_assert!(&bufs[k][..n] == v.as_slice(), "batch_get_into of {}", k),
                        (Err(Error::NotFound(_)), None) => {}
                        (r, want) => {
                            prop_assert!(false, "batch_get_into of {} (present: {}): {:?}", k, want.is_some(), r)
                        }
                    }
                }
            }
        }
        check_records(&master, &stores, &model)?;
    }
    let stats = master.stats();
    prop_assert_eq!(stats.pending_puts, 0);
    // Replaced replicas were all freed: once every object is removed, no byte is used.
    for k in model.keys() {
        stores[0].remove(&key_name(*k)).unwrap();
    }
    prop_assert_eq!(master.stats().used_bytes, 0, "replicas replaced by upserts were not freed");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn upserts_match_a_hashmap_model(ops in proptest::collection::vec(op(), 1..50)) {
        run(ops)?;
    }
}

/// Readers on two clients read a key in a loop (get, get_into, batch_get,
/// batch_get_into) while a writer upserts it with values of changing lengths, over
/// TCP through a master daemon: every read succeeds and returns exactly one value
/// that was written, each reader sees generations in order, and a reader without a
/// replica cache never reads a generation older than the last acknowledged one.
#[test]
fn readers_get_the_old_or_the_new_value_never_a_mix_or_an_error() {
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let store = |cache: usize| {
        Store::builder()
            .master_address(&addr)
            .protocol(Protocol::Tcp)
            .global_segment_size(32 << 20)
            .replica_cache(cache)
            .build()
            .unwrap()
    };
    // `a` asks the master on every get; `b` keeps replica lists (the default).
    let (a, b) = (store(0), store(65_536));
    a.put("hot", &value(0, 100_000)).unwrap();
    let written = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let mut readers = Vec::new();
    for (t, reader) in [a.clone(), b.clone(), b.clone(), a.clone()].into_iter().enumerate() {
        let (stop, reads, written) = (stop.clone(), reads.clone(), written.clone());
        let cached = t == 1 || t == 2;
        readers.push(std::thread::spawn(move || {
            let mut last = 0;
            let mut buf = vec![0u8; 300_000];
            while !stop.load(Ordering::Acquire) {
                let floor = written.load(Ordering::Acquire);
                let got: Vec<u8> = match t {
                    0 => reader.get("hot").unwrap().to_vec(),
                    1 => {
                        let n = reader.get_into("hot", &mut buf).unwrap();
                        buf[..n].to_vec()
                    }
                    2 => reader.batch_get(&["hot"]).pop().unwrap().unwrap().to_vec(),
                    _ => {
                        let mut one = [&mut buf[..]];
                        let n = reader.batch_get_into(&["hot"], &mut one).pop().unwrap().unwrap();
                        buf[..n].to_vec()
                    }
                };
                let gen = generation_of(&got).unwrap_or_else(|| panic!("reader {t} read a mix ({} bytes)", got.len()));
                assert!(gen >= last, "reader {t} went back from generation {last} to {gen}");
                if !cached {
                    assert!(gen >= floor, "reader {t} read generation {gen} after {floor} was acknowledged");
                }
                last = gen;
                reads.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let start = Instant::now();
    let mut gen = 0;
    while start.elapsed() < Duration::from_secs(3) || gen < 50 {
        gen += 1;
        let len = 50_000 + (gen as usize * 7919) % 200_000;
        a.upsert("hot", &value(gen, len)).unwrap();
        written.store(gen, Ordering::Release);
    }
    stop.store(true, Ordering::Release);
    for r in readers {
        r.join().unwrap();
    }
    assert_eq!(generation_of(&a.get("hot").unwrap()), Some(gen));
    let reads = reads.load(Ordering::Relaxed);
    eprintln!("{gen} upserts, {reads} reads");
    assert!(reads > 100, "the readers hardly ran: {reads} reads");
    // Every replaced replica is freed once the reads are over (their leases go back
    // in the background): one object's bytes remain in use.
    let len = 50_000 + (gen as usize * 7919) % 200_000;
    support::wait_until(Duration::from_secs(10), || daemon.master().stats().used_bytes < 2 * len as u64);
}

/// Two clients upsert one key at once: every upsert succeeds (the second waits for
/// the first), and the value left is one of the last ones written.
#[test]
fn concurrent_upserts_of_one_key_all_succeed_one_after_the_other() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let stores: Vec<Store> =
        (0..2).map(|_| Store::builder().master(&master).global_segment_size(16 << 20).build().unwrap()).collect();
    let threads: Vec<_> = stores
        .iter()
        .enumerate()
        .map(|(w, s)| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..200u64 {
                    s.upsert("contended", &value(w as u64 * 1_000 + i, 20_000 + i as usize)).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let gen = generation_of(&stores[0].get("contended").unwrap()).unwrap();
    assert!(gen == 199 || gen == 1_199, "the last value is neither writer's last: {gen}");
    assert_eq!(master.stats().pending_puts, 0);
}

/// An upsert being written holds the object: a remove is refused with `HasLease`
/// until the upsert ends, and a reader that got the old replica list can still read
/// the old bytes after the swap (its replicas stay until its lease is released).
#[test]
fn the_old_replicas_stay_until_their_readers_are_done() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let store = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let client = store.client_id();
    store.put("k", &value(1, 10_000)).unwrap();
    // A reader in flight: it holds the old list.
    let old = master.get_replica_list("k").unwrap();
    let replicas = master.upsert_start(client, "k", 20_000, &ReplicateConfig::default()).unwrap();
    assert!(matches!(master.remove("k"), Err(Error::HasLease(_))));
    assert!(matches!(
        master.upsert_start(store.client_id() ^ 2, "k", 5, &ReplicateConfig::default()),
        Err(Error::AlreadyExists(_))
    ));
    // Still the old object until the end.
    assert_eq!(master.object_info("k").unwrap().len, 10_000);
    let used_before = master.stats().used_bytes;
    assert!(used_before >= 30_000, "{used_before}");
    let _ = replicas;
    // Ending without writing the bytes is fine for the master (the checksum is the
    // client's business): the swap itself is what is checked here.
    master.upsert_end(client, "k", 42).unwrap();
    let info = master.object_info("k").unwrap();
    assert_eq!((info.len, info.checksum), (20_000, 42));
    // The reader of the old list has not released it: its replica is still held.
    assert_eq!(master.stats().used_bytes, used_before, "the old replica was freed under its reader");
    assert!(old.replicas.iter().all(|r| r.len == 10_000));
    master.release_leases(&["k"]).unwrap();
    assert!(master.stats().used_bytes < used_before, "the old replica outlived its last reader");
    // A revoked upsert leaves the object as it was.
    master.upsert_start(client, "k", 7, &ReplicateConfig::default()).unwrap();
    master.upsert_revoke(client, "k").unwrap();
    assert_eq!(master.object_info("k").unwrap().len, 20_000);
    assert!(matches!(master.upsert_end(client, "k", 1), Err(Error::NotFound(_))));
    master.remove("k").unwrap();
    // The object's room is freed; the revoked upsert's is kept a client TTL (bytes
    // its writer sent may still land there), as a revoked put's is.
    let left = master.stats().used_bytes;
    assert!(left > 0 && left < 20_000, "{left} bytes in use: the revoked upsert's room alone should be");
}

/// A revoke asked again once it was served (a client sends a call again when its
/// connection broke before the answer) is answered as the first was; a revoke of
/// what this client never started, or of another client's put, is still `NotFound`,
/// and the other's put goes on.
#[test]
fn a_revoke_asked_again_is_answered_as_the_first() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let store = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let (me, other) = (store.client_id() ^ 2, store.client_id() ^ 4);
    let cfg = ReplicateConfig::default();
    master.put_start(me, "p", 10, &cfg).unwrap();
    master.put_revoke(me, "p").unwrap();
    master.put_revoke(me, "p").unwrap();
    assert!(matches!(master.put_revoke(other, "p"), Err(Error::NotFound(_))));
    assert!(matches!(master.put_revoke(me, "never"), Err(Error::NotFound(_))));
    // Another client's put of the key, started since: a late copy of my revoke is
    // answered without touching it.
    master.put_start(other, "p", 10, &cfg).unwrap();
    master.put_revoke(me, "p").unwrap();
    master.put_end(other, "p", 7).unwrap();
    assert_eq!(master.object_info("p").unwrap().checksum, 7);
    // Upserts alike, over an object that stays as it was.
    store.put("u", b"kept").unwrap();
    master.upsert_start(me, "u", 3, &cfg).unwrap();
    master.upsert_revoke(me, "u").unwrap();
    master.upsert_revoke(me, "u").unwrap();
    assert!(matches!(master.upsert_revoke(other, "u"), Err(Error::NotFound(_))));
    assert_eq!(&store.get("u").unwrap()[..], b"kept");
    // Batches too.
    master.batch_put_start(me, &[("b1", 4), ("b2", 4)], &cfg).into_iter().for_each(|r| drop(r.unwrap()));
    assert!(master.batch_put_revoke(me, &["b1", "b2"]).iter().all(Result::is_ok));
    let again = master.batch_put_revoke(me, &["b1", "b2", "b3"]);
    assert!(again[0].is_ok() && again[1].is_ok() && matches!(again[2], Err(Error::NotFound(_))));
}

/// An upsert of an absent key is a put; a put of a key an upsert replaced still
/// fails (objects stay immutable to `put`).
#[test]
fn upsert_of_an_absent_key_is_a_put() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let store = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    store.upsert("new", b"first").unwrap();
    assert_eq!(&store.get("new").unwrap()[..], b"first");
    store.upsert("new", b"second, longer").unwrap();
    assert_eq!(&store.get("new").unwrap()[..], b"second, longer");
    assert!(matches!(store.put("new", b"third"), Err(Error::AlreadyExists(_))));
    assert!(matches!(store.upsert("", b"x"), Err(Error::InvalidArgument(_))));
    assert!(matches!(store.upsert("k", b""), Err(Error::InvalidArgument(_))));
    assert_eq!(store.stats().puts, 2);
}

/// Acknowledged upserts survive `kill -9` of the master: the nodes learned the new
/// replicas and forgot the old ones before the acknowledgment, so the restarted
/// master rebuilds the new value (and the old one does not come back).
#[test]
fn acknowledged_upserts_survive_kill_9_of_the_master() {
    use support::{wait_until, Cluster};
    let mut c = Cluster::start(&["--client-ttl-ms", "1000", "--default-lease-ms", "1"], 2);
    let connect = |addr: &str| {
        Store::builder().master_address(addr).protocol(Protocol::Tcp).global_segment_size(0).build().unwrap()
    };
    let two = ReplicateConfig::replicas(2);
    connect(&c.master_addr).put_with("doc", &value(0, 4096), &two).unwrap();
    for gen in 1..=20u64 {
        let len = 1_000 + (gen as usize * 3_001) % 60_000;
        {
            let store = connect(&c.master_addr);
            store.upsert_with("doc", &value(gen, len), &two).unwrap();
        }
        c.master.kill9();
        c.restart_master();
        let addr = c.master_addr.clone();
        wait_until(Duration::from_secs(10), || {
            let Ok(s) = Store::builder().master_address(&addr).protocol(Protocol::Tcp).global_segment_size(0).build()
            else {
                return false;
            };
            s.stats().master.segments == 2 && s.master().object_info("doc").is_ok_and(|i| i.replicas.len() == 2)
        });
        let store = connect(&c.master_addr);
        let got = store.get("doc").unwrap();
        assert_eq!(generation_of(&got), Some(gen), "generation {gen} lost after kill -9 of the master");
        assert_eq!(got.len(), len);
        assert_eq!(store.master().object_info("doc").unwrap().replicas.len(), 2);
    }
}

/// A client that leaves in the middle of an upsert (its process died, or it
/// unregistered) no longer holds the object: it can be removed at once, and the old
/// value stays readable until then.
#[test]
fn an_upsert_whose_writer_left_no_longer_holds_the_object() {
    let put_timeout = Duration::from_secs(1);
    let master = Master::new(MasterConfig { put_timeout, ..Default::default() }).unwrap();
    let keeper = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let writer = Store::builder().master(&master).global_segment_size(0).build().unwrap();
    keeper.put("k", b"old").unwrap();
    master.upsert_start(writer.client_id(), "k", 100, &ReplicateConfig::default()).unwrap();
    assert!(matches!(keeper.remove("k"), Err(Error::HasLease(_))), "an upsert being written holds the object");
    drop(writer);
    assert_eq!(&keeper.get("k").unwrap()[..], b"old");
    keeper.remove("k").unwrap();
    // Its replicas are kept a put timeout (its bytes may still be on their way), then
    // freed.
    assert!(master.stats().used_bytes > 0, "the room of an upsert whose writer left was freed at once");
    let start = Instant::now();
    while master.stats().used_bytes > 0 {
        assert!(start.elapsed() < put_timeout * 10, "the abandoned upsert's replicas were not freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(start.elapsed() >= put_timeout / 2, "freed before its quarantine was over");
}

/// An upsert sets the object's soft pin as its config says, or keeps the pin the
/// replaced object had (`keep_soft_pin`, the binding's `PRESERVE`).
#[test]
fn an_upsert_sets_or_keeps_the_soft_pin() {
    let master = Master::new(MasterConfig::default()).unwrap();
    let store = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let pin = ReplicateConfig { soft_pin: true, ..Default::default() };
    let keep = ReplicateConfig { keep_soft_pin: true, ..Default::default() };
    let pinned = |k: &str| master.object_info(k).unwrap().soft_pin;
    store.upsert_with("k", b"1", &pin).unwrap();
    assert!(pinned("k"));
    store.upsert_with("k", b"2", &keep).unwrap();
    assert!(pinned("k"), "keep_soft_pin dropped the pin");
    store.upsert_with("k", b"3", &ReplicateConfig::default()).unwrap();
    assert!(!pinned("k"), "an upsert without the pin kept it");
    store.upsert_with("k", b"4", &keep).unwrap();
    assert!(!pinned("k"), "keep_soft_pin pinned an unpinned object");
    // A new object takes `soft_pin` whatever `keep_soft_pin` says.
    store.upsert_with("new", b"x", &ReplicateConfig { keep_soft_pin: true, ..pin.clone() }).unwrap();
    assert!(pinned("new"));
    assert_eq!(&store.get("k").unwrap()[..], b"4");
}
