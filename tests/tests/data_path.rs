//! One data path (issue 23): every put form and every get form of `Store` behave as
//! one, through the public API only.
//!
//! - A model test drives random sequences of every put form (single, batch, parts,
//!   upsert, device over the host emulation) and every get form against a `HashMap`,
//!   over the Local, Shm and Tcp transports (Shm and Tcp through a master daemon),
//!   with storage nodes killed (their endpoint gone while the master still lists
//!   their segment), clients lost (segment unmounted) and replicas corrupted (a byte
//!   flipped in a storage node's memory) at random points. Properties: a read returns
//!   the model's bytes or an error, never other bytes; a corrupted replica is never
//!   returned; a put succeeds while a live segment has room; every form reports the
//!   same outcome for the same situation (missing key, buffer too small, bad key).
//! - Plain tests: `put_parts`, `batch_put`, `batch_put_parts` and `batch_upsert`
//!   re-place an object after a dead segment as `put` does; `batch_get` detects a
//!   flipped byte; `Store::batch_remove` forgets this client's cached replica lists.
//!
//! Bytes are flipped through a transfer engine of this process (the local transport
//! reaches every registered region of the process), at offsets the master gives:
//! `Store` has no public way to touch its segment's memory, and needs none.

mod support;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use mooncake_core::gpu::{DeviceMemory, HostDeviceMemory};
use mooncake_core::{Error, Master, MasterConfig, MasterDaemon, Protocol, ReplicateConfig, Store, MAX_KEY_LEN};
use mooncake_transfer::{RegisteredRegion, ShmTransport, TcpTransport, TransferEngine, Transport};
use proptest::prelude::*;
use support::{payload, wait_until};

/// Keys of the model test.
const KEYS: usize = 6;
/// Stores (each with a segment) of the model test.
const STORES: usize = 3;
/// Largest object of the model test; read buffers have this many bytes.
const MAX_LEN: usize = 40_000;
/// Where the device forms put object `i` of a batch (`i * SLOT`) in device memory.
const SLOT: u64 = 64 << 10;
/// Bytes of each emulated device memory.
const DEV: u64 = 1 << 20;

// --- Helpers ----------------------------------------------------------------------

/// A storage node reduced to its parts: a registered region mounted at the master
/// by a client that never heartbeats. Dropping it kills the node: its endpoint and
/// memory are gone, but the master still lists its segment (as after `kill -9`,
/// until the client's time to live runs out).
struct RawNode {
    _engine: TransferEngine,
    _region: Arc<RegisteredRegion>,
    segment: u64,
}

fn raw_node(master: &Master, len: u64) -> RawNode {
    // Listening, with shareable memory: reachable over Local, Shm and Tcp alike.
    let engine = TransferEngine::builder().shared_memory(true).tcp_listen("127.0.0.1:0").build().unwrap();
    let region = engine.register_region(len).unwrap();
    let client = master.register_client().unwrap().client;
    let segment = master.mount_segment(client, &engine.remote(region.id()), region.len()).unwrap();
    RawNode { _engine: engine, _region: region, segment }
}

/// The name (`endpoint#n`) of a segment the master lists whose node is dead.
fn dead_segment(master: &Master) -> String {
    let node = raw_node(master, 4 << 20);
    let name = master.segment_info(node.segment).unwrap().name;
    drop(node);
    name
}

/// Flips one byte (`at` bytes into the object) of the replica of `key` that lives on
/// `segment`, through `poke` (an engine of this process).
fn flip_byte(poke: &TransferEngine, master: &Master, key: &str, segment: u64, at: u64) {
    let info = master.object_info(key).unwrap();
    let r = info.replicas.iter().find(|r| r.segment == segment).expect("a replica on that segment");
    let region = master.segment_info(segment).unwrap().region;
    let mut byte = [0u8];
    poke.read(&region, r.offset + at, &mut byte).unwrap();
    poke.write(&region, r.offset + at, &[byte[0] ^ 0x5a]).unwrap();
}

/// The variant of an error: the "same error" of the properties.
fn kind(e: &Error) -> String {
    let debug = format!("{e:?}");
    debug.split(['(', ' ', '{']).next().unwrap_or_default().to_owned()
}

/// A read's outcome, comparable across forms.
fn outcome(r: &Result<Vec<u8>, Error>) -> Result<&[u8], String> {
    r.as_ref().map(Vec::as_slice).map_err(kind)
}

/// `buf` cut into up to three non-empty pieces at points picked by `split`.
fn cut(buf: &mut [u8], split: usize) -> Vec<&mut [u8]> {
    let n = buf.len();
    if n < 3 {
        return vec![buf];
    }
    let a = 1 + split % (n - 2);
    let b = a + 1 + (split / 7) % (n - a - 1);
    let (first, rest) = buf.split_at_mut(a);
    let (second, third) = rest.split_at_mut(b - a);
    vec![first, second, third]
}

/// `value` as up to three non-empty parts.
fn parts_of(value: &[u8], split: usize) -> Vec<&[u8]> {
    let n = value.len();
    if n < 3 {
        return vec![value];
    }
    let a = 1 + split % (n - 2);
    let b = a + 1 + (split / 7) % (n - a - 1);
    vec![&value[..a], &value[a..b], &value[b..]]
}

// --- The forms --------------------------------------------------------------------

/// Every put form of `Store`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PutForm {
    Put,
    PutWith,
    PutParts,
    BatchPut,
    BatchPutParts,
    Upsert,
    UpsertWith,
    UpsertParts,
    BatchUpsert,
    BatchUpsertParts,
    PutFromDevice,
    PutFromDeviceWith,
    BatchPutFromDevice,
}

const PUT_FORMS: [PutForm; 13] = [
    PutForm::Put,
    PutForm::PutWith,
    PutForm::PutParts,
    PutForm::BatchPut,
    PutForm::BatchPutParts,
    PutForm::Upsert,
    PutForm::UpsertWith,
    PutForm::UpsertParts,
    PutForm::BatchUpsert,
    PutForm::BatchUpsertParts,
    PutForm::PutFromDevice,
    PutForm::PutFromDeviceWith,
    PutForm::BatchPutFromDevice,
];

impl PutForm {
    fn is_upsert(self) -> bool {
        matches!(self, Self::Upsert | Self::UpsertWith | Self::UpsertParts | Self::BatchUpsert | Self::BatchUpsertParts)
    }

    /// Whether its bytes come from device memory (over Shm they go by DMA into the
    /// peer's mapping, not through the transport's requests).
    fn is_device(self) -> bool {
        matches!(self, Self::PutFromDevice | Self::PutFromDeviceWith | Self::BatchPutFromDevice)
    }

    fn is_batch(self) -> bool {
        matches!(
            self,
            Self::BatchPut
                | Self::BatchPutParts
                | Self::BatchUpsert
                | Self::BatchUpsertParts
                | Self::BatchPutFromDevice
        )
    }

    /// Writes `items` (all of them for a batch form, the first otherwise) with this
    /// form; one result per item written. Forms without a config use the store's
    /// default (one replica).
    fn write(
        self,
        store: &Store,
        src: &HostDeviceMemory,
        items: &[(&str, &[u8])],
        cfg: &ReplicateConfig,
        split: usize,
    ) -> Vec<Result<(), Error>> {
        let (key, value) = items[0];
        let parted: Vec<Vec<&[u8]>> = items.iter().map(|(_, v)| parts_of(v, split)).collect();
        let parted_items: Vec<(&str, &[&[u8]])> = items.iter().zip(&parted).map(|((k, _), p)| (*k, &p[..])).collect();
        let on_device = |i: usize| {
            src.copy_from_host(i as u64 * SLOT, items[i].1).unwrap();
            (i as u64 * SLOT, items[i].1.len() as u64)
        };
        match self {
            Self::Put => vec![store.put(key, value)],
            Self::PutWith => vec![store.put_with(key, value, cfg)],
            Self::PutParts => vec![store.put_parts(key, &parted[0])],
            Self::BatchPut => store.batch_put(items, cfg),
            Self::BatchPutParts => store.batch_put_parts(&parted_items, cfg),
            Self::Upsert => vec![store.upsert(key, value)],
            Self::UpsertWith => vec![store.upsert_with(key, value, cfg)],
            Self::UpsertParts => vec![store.upsert_parts(key, &parted[0])],
            Self::BatchUpsert => store.batch_upsert(items, cfg),
            Self::BatchUpsertParts => store.batch_upsert_parts(&parted_items, cfg),
            Self::PutFromDevice => {
                let (off, len) = on_device(0);
                vec![store.put_from_device(key, src, off, len)]
            }
            Self::PutFromDeviceWith => {
                let (off, len) = on_device(0);
                vec![store.put_from_device_with(key, src, off, len, cfg)]
            }
            Self::BatchPutFromDevice => {
                let placed: Vec<(u64, u64)> = (0..items.len()).map(on_device).collect();
                let batch: Vec<(&str, u64, u64)> =
                    items.iter().zip(&placed).map(|((k, _), (off, len))| (*k, *off, *len)).collect();
                store.batch_put_from_device(&batch, src, cfg)
            }
        }
    }
}

/// Every get form of `Store`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GetForm {
    Get,
    GetInto,
    GetIntoParts,
    BatchGet,
    BatchGetInto,
    BatchGetIntoParts,
    GetIntoDevice,
    BatchGetIntoDevice,
}

const GET_FORMS: [GetForm; 8] = [
    GetForm::Get,
    GetForm::GetInto,
    GetForm::GetIntoParts,
    GetForm::BatchGet,
    GetForm::BatchGetInto,
    GetForm::BatchGetIntoParts,
    GetForm::GetIntoDevice,
    GetForm::BatchGetIntoDevice,
];

impl GetForm {
    /// Whether the caller gives the destination (so it can be too small).
    fn has_buffer(self) -> bool {
        !matches!(self, Self::Get | Self::BatchGet)
    }

    fn is_batch(self) -> bool {
        matches!(self, Self::BatchGet | Self::BatchGetInto | Self::BatchGetIntoParts | Self::BatchGetIntoDevice)
    }

    /// Reads `keys` (all of them for a batch form, the first otherwise) with this
    /// form, each into a destination of `size` bytes (cut in parts by `split`); the
    /// bytes read or the error, per key.
    fn read(
        self,
        store: &Store,
        dev: &HostDeviceMemory,
        keys: &[&str],
        size: usize,
        split: usize,
    ) -> Vec<Result<Vec<u8>, Error>> {
        let keys = if self.is_batch() { keys } else { &keys[..1] };
        let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; size]).collect();
        let took = |bufs: &[Vec<u8>], res: Vec<Result<usize, Error>>| -> Vec<Result<Vec<u8>, Error>> {
            res.into_iter().zip(bufs).map(|(r, b)| r.map(|n| b[..n].to_vec())).collect()
        };
        // Device destinations: each key at its own slot, `size` bytes of room (the
        // last slot ends at the end of the device memory).
        let at = |i: usize| if keys.len() == 1 { DEV - size as u64 } else { i as u64 * SLOT };
        let from_device = |res: Vec<Result<usize, Error>>| -> Vec<Result<Vec<u8>, Error>> {
            res.into_iter()
                .enumerate()
                .map(|(i, r)| {
                    r.map(|n| {
                        let mut out = vec![0u8; n];
                        dev.copy_to_host(at(i), &mut out).unwrap();
                        out
                    })
                })
                .collect()
        };
        match self {
            Self::Get => vec![store.get(keys[0]).map(|b| b.to_vec())],
            Self::GetInto => {
                let r = store.get_into(keys[0], &mut bufs[0]);
                took(&bufs, vec![r])
            }
            Self::GetIntoParts => {
                let r = {
                    let mut parts = cut(&mut bufs[0], split);
                    store.get_into_parts(keys[0], &mut parts)
                };
                took(&bufs, vec![r])
            }
            Self::BatchGet => store.batch_get(keys).into_iter().map(|r| r.map(|b| b.to_vec())).collect(),
            Self::BatchGetInto => {
                let r = {
                    let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    store.batch_get_into(keys, &mut views)
                };
                took(&bufs, r)
            }
            Self::BatchGetIntoParts => {
                let r = {
                    let mut parted: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| cut(b, split)).collect();
                    let mut views: Vec<&mut [&mut [u8]]> = parted.iter_mut().map(|p| &mut p[..]).collect();
                    store.batch_get_into_parts(keys, &mut views)
                };
                took(&bufs, r)
            }
            Self::GetIntoDevice => from_device(vec![store.get_into_device(keys[0], dev, at(0))]),
            Self::BatchGetIntoDevice => {
                let items: Vec<(&str, u64)> = keys.iter().enumerate().map(|(i, k)| (*k, at(i))).collect();
                from_device(store.batch_get_into_device(&items, dev))
            }
        }
    }
}

// --- The model test ---------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Net {
    Local,
    Shm,
    Tcp,
}

#[derive(Clone, Debug)]
enum Op {
    /// A put form; batch forms also write `(key + 1) % KEYS`.
    Write {
        form: usize,
        key: usize,
        seed: u8,
        len: usize,
        replicas: usize,
        via: usize,
        split: usize,
    },
    /// A get form; batch forms read every key.
    Read {
        form: usize,
        key: usize,
        via: usize,
        split: usize,
    },
    /// Every get form on one key at the same moment, with buffers of exactly the
    /// object's length (`short`: one byte less).
    ReadAll {
        key: usize,
        via: usize,
        short: bool,
        split: usize,
    },
    Remove {
        key: usize,
        batch: bool,
        via: usize,
    },
    /// Every put, get and remove form with a bad key.
    BadKey {
        via: usize,
        long: bool,
    },
    /// Flips a byte of one live replica of the key.
    Corrupt {
        key: usize,
        pick: usize,
    },
    /// The raw storage node dies (its segment stays listed); a new one starts. At
    /// most two die per case.
    KillNode,
    /// A store is dropped (its segment unmounted) and a new one joins.
    LoseClient {
        which: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..PUT_FORMS.len(), 0..KEYS, any::<u8>(), 2..MAX_LEN, 1usize..=3, 0..STORES, any::<usize>())
            .prop_map(|(form, key, seed, len, replicas, via, split)| Op::Write { form, key, seed, len, replicas, via, split }),
        4 => (0..GET_FORMS.len(), 0..KEYS, 0..STORES, any::<usize>())
            .prop_map(|(form, key, via, split)| Op::Read { form, key, via, split }),
        3 => (0..KEYS, 0..STORES, any::<bool>(), any::<usize>())
            .prop_map(|(key, via, short, split)| Op::ReadAll { key, via, short, split }),
        1 => (0..KEYS, any::<bool>(), 0..STORES).prop_map(|(key, batch, via)| Op::Remove { key, batch, via }),
        1 => (0..STORES, any::<bool>()).prop_map(|(via, long)| Op::BadKey { via, long }),
        2 => (0..KEYS, any::<usize>()).prop_map(|(key, pick)| Op::Corrupt { key, pick }),
        2 => Just(Op::KillNode),
        1 => (0..STORES).prop_map(|which| Op::LoseClient { which }),
    ]
}

fn key_name(k: usize) -> String {
    format!("data-path/{k}")
}

/// What the model knows of a stored key.
#[derive(Clone, Debug)]
struct Entry {
    value: Vec<u8>,
    /// Segments holding a replica of this object with a flipped byte.
    corrupt: HashSet<u64>,
}

/// What a read of a key must give.
#[derive(Debug)]
enum Expect {
    /// Exactly these bytes (a replica is intact and reachable).
    Bytes(Vec<u8>),
    /// `NotFound`.
    Missing,
    /// No intact reachable replica: these bytes (a dead node's memory still mapped)
    /// or `Corrupted` / `Transport`; only `Corrupted` when every replica is corrupt.
    Degraded { value: Vec<u8>, all_corrupt: bool },
}

struct World {
    net: Net,
    daemon: MasterDaemon,
    stores: Vec<Store>,
    /// The transports (Shm, Tcp) given to every store so far, to show the bytes went
    /// there.
    transports: Vec<Arc<dyn Transport>>,
    node: RawNode,
    dead: HashSet<u64>,
    poke: TransferEngine,
    src: HostDeviceMemory,
    dst: HostDeviceMemory,
    model: HashMap<usize, Entry>,
    wrote: bool,
}

impl World {
    fn new(net: Net) -> World {
        // No read leases (removal would depend on timing, and no replica list is kept
        // between gets), and clients outlive the case (a killed node stays listed).
        let config = MasterConfig {
            default_lease: Duration::ZERO,
            client_ttl: Duration::from_secs(120),
            ..MasterConfig::served()
        };
        let daemon = MasterDaemon::builder("127.0.0.1:0").config(config).serve().unwrap();
        let node = raw_node(daemon.master(), 4 << 20);
        let mut w = World {
            net,
            daemon,
            stores: Vec::new(),
            transports: Vec::new(),
            node,
            dead: HashSet::new(),
            poke: TransferEngine::new(),
            src: HostDeviceMemory::new(DEV).unwrap(),
            dst: HostDeviceMemory::new(DEV).unwrap(),
            model: HashMap::new(),
            wrote: false,
        };
        for _ in 0..STORES {
            let (s, t) = w.new_store();
            w.stores.push(s);
            w.transports.extend(t);
        }
        w
    }

    fn master(&self) -> &Master {
        self.daemon.master()
    }

    fn new_store(&self) -> (Store, Option<Arc<dyn Transport>>) {
        let addr = self.daemon.local_addr().to_string();
        let b = Store::builder().global_segment_size(4 << 20);
        match self.net {
            Net::Local => (b.master(self.master()).build().unwrap(), None),
            Net::Shm => {
                // Ahead of the local transport, which would take in-process peers.
                let shm: Arc<dyn Transport> = Arc::new(ShmTransport::new());
                let b = b.master_address(&addr).listen("127.0.0.1:0").protocol(Protocol::Shm);
                (b.transport(shm.clone()).build().unwrap(), Some(shm))
            }
            Net::Tcp => {
                let tcp: Arc<dyn Transport> = Arc::new(TcpTransport::new());
                let b = b.master_address(&addr).listen("127.0.0.1:0").protocol(Protocol::Tcp);
                (b.transport(tcp.clone()).build().unwrap(), Some(tcp))
            }
        }
    }

    fn expect(&self, key: usize) -> Expect {
        let Some(e) = self.model.get(&key) else { return Expect::Missing };
        let info = self.master().object_info(&key_name(key)).expect("the model holds it, so must the master");
        let intact = |s: &u64| !self.dead.contains(s) && !e.corrupt.contains(s);
        if info.replicas.iter().any(|r| intact(&r.segment)) {
            return Expect::Bytes(e.value.clone());
        }
        let all_corrupt =
            info.replicas.iter().all(|r| e.corrupt.contains(&r.segment) && !self.dead.contains(&r.segment));
        Expect::Degraded { value: e.value.clone(), all_corrupt }
    }

    fn check_read(&self, key: usize, what: &str, got: &Result<Vec<u8>, Error>) -> Result<(), TestCaseError> {
        match (self.expect(key), got) {
            (Expect::Bytes(v), Ok(b)) => {
                prop_assert!(*b == v, "{}: key {} returned bytes that are not the model's", what, key)
            }
            (Expect::Bytes(_), Err(e)) => {
                prop_assert!(false, "{}: key {} has an intact replica, got {:?}", what, key, e)
            }
            (Expect::Missing, Err(Error::NotFound(_))) => {}
            (Expect::Missing, other) => prop_assert!(false, "{}: absent key {} gave {:?}", what, key, outcome(other)),
            (Expect::Degraded { value, all_corrupt }, Ok(b)) => {
                prop_assert!(!all_corrupt, "{}: key {} returned a corrupted replica's bytes", what, key);
                prop_assert!(*b == value, "{}: key {} returned bytes that are not the model's", what, key);
            }
            (Expect::Degraded { all_corrupt: true, .. }, Err(Error::Corrupted(_))) => {}
            (Expect::Degraded { all_corrupt: false, .. }, Err(Error::Corrupted(_) | Error::Transport(_))) => {}
            (Expect::Degraded { all_corrupt, .. }, Err(e)) => {
                prop_assert!(
                    false,
                    "{}: key {} without an intact replica (all corrupt: {}) gave {:?}",
                    what,
                    key,
                    all_corrupt,
                    e
                )
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Write { form, key, seed, len, replicas, via, split } => {
                let form = PUT_FORMS[form];
                let keys = if form.is_batch() { vec![key, (key + 1) % KEYS] } else { vec![key] };
                let names: Vec<String> = keys.iter().map(|&k| key_name(k)).collect();
                let values: Vec<Vec<u8>> =
                    keys.iter().map(|&k| payload(seed.wrapping_add(k as u8), len - (k * 13) % (len / 2))).collect();
                let items: Vec<(&str, &[u8])> =
                    names.iter().map(String::as_str).zip(values.iter().map(Vec::as_slice)).collect();
                let res = form.write(&self.stores[via], &self.src, &items, &ReplicateConfig::replicas(replicas), split);
                prop_assert_eq!(res.len(), keys.len());
                for ((k, v), r) in keys.iter().zip(values).zip(res) {
                    let present = self.model.contains_key(k);
                    match (form.is_upsert(), present, r) {
                        // A live segment always has room: every put form must store it,
                        // re-placing what a dead segment refused.
                        (_, _, Ok(())) if form.is_upsert() || !present => {
                            self.model.insert(*k, Entry { value: v, corrupt: HashSet::new() });
                            // Bytes certainly crossed the transport under test only if
                            // a replica lies outside the writer's own segment (written
                            // in place), and, over Shm, only from host memory.
                            let own = self.stores[via].segment_id();
                            let crossed = self
                                .master()
                                .object_info(&key_name(*k))
                                .is_ok_and(|i| i.replicas.iter().any(|r| Some(r.segment) != own));
                            if crossed && !(form.is_device() && matches!(self.net, Net::Shm)) {
                                self.wrote = true;
                            }
                        }
                        (false, true, Err(Error::AlreadyExists(_))) => {}
                        (_, _, r) => prop_assert!(
                            false,
                            "{:?} of key {} (present: {}, dead segments: {}) gave {:?}",
                            form,
                            k,
                            present,
                            self.dead.len(),
                            r
                        ),
                    }
                }
            }
            Op::Read { form, key, via, split } => {
                let form = GET_FORMS[form];
                let keys: Vec<usize> = if form.is_batch() { (0..KEYS).collect() } else { vec![key] };
                let names: Vec<String> = keys.iter().map(|&k| key_name(k)).collect();
                let refs: Vec<&str> = names.iter().map(String::as_str).collect();
                let got = form.read(&self.stores[via], &self.dst, &refs, MAX_LEN, split);
                prop_assert_eq!(got.len(), keys.len());
                for (k, g) in keys.iter().zip(&got) {
                    self.check_read(*k, &format!("{form:?}"), g)?;
                }
            }
            Op::ReadAll { key, via, short, split } => {
                let name = key_name(key);
                let len = self.model.get(&key).map_or(1000, |e| e.value.len());
                let size = if short { len - 1 } else { len };
                let mut seen: Vec<(GetForm, Result<Vec<u8>, Error>)> = Vec::new();
                for form in GET_FORMS.into_iter().filter(|f| !short || f.has_buffer()) {
                    let got = form.read(&self.stores[via], &self.dst, &[&name], size, split).pop().unwrap();
                    if short && self.model.contains_key(&key) {
                        prop_assert!(
                            matches!(got, Err(Error::BufferTooSmall { .. })),
                            "{:?} of key {} into {} bytes of {} gave {:?}",
                            form,
                            key,
                            size,
                            len,
                            outcome(&got)
                        );
                    } else {
                        self.check_read(key, &format!("{form:?}"), &got)?;
                    }
                    seen.push((form, got));
                }
                let (first, first_got) = &seen[0];
                for (form, got) in &seen[1..] {
                    prop_assert!(
                        outcome(got) == outcome(first_got),
                        "key {}: {:?} gave {:?} but {:?} gave {:?}",
                        key,
                        first,
                        outcome(first_got).map(<[u8]>::len),
                        form,
                        outcome(got).map(<[u8]>::len)
                    );
                }
            }
            Op::Remove { key, batch, via } => {
                let name = key_name(key);
                let store = &self.stores[via];
                let res = if batch { store.batch_remove(&[&name]).pop().unwrap() } else { store.remove(&name) };
                match (self.model.remove(&key), res) {
                    (Some(_), Ok(())) | (None, Err(Error::NotFound(_))) => {}
                    (known, res) => {
                        prop_assert!(false, "remove of key {} (model {:?}) gave {:?}", key, known.is_some(), res)
                    }
                }
            }
            Op::BadKey { via, long } => {
                let bad = if long { "k".repeat(MAX_KEY_LEN + 1) } else { String::new() };
                let store = &self.stores[via];
                let fine = key_name(KEYS); // never stored
                for form in PUT_FORMS {
                    let items: Vec<(&str, &[u8])> =
                        vec![(bad.as_str(), b"bytes of a bad key"), (fine.as_str(), b"fine")];
                    let res = form.write(store, &self.src, &items, &ReplicateConfig::default(), 5);
                    prop_assert!(
                        matches!(res[0], Err(Error::InvalidArgument(_))),
                        "{:?} with a bad key gave {:?}",
                        form,
                        res[0]
                    );
                    if form.is_batch() {
                        prop_assert!(
                            res[1].is_ok(),
                            "{:?}: the good item of a batch with a bad key gave {:?}",
                            form,
                            res[1]
                        );
                        store.remove(&fine).unwrap();
                    }
                }
                for form in GET_FORMS {
                    let got = form.read(store, &self.dst, &[&bad, &fine], 64, 5);
                    prop_assert!(
                        matches!(got[0], Err(Error::InvalidArgument(_))),
                        "{:?} with a bad key gave {:?}",
                        form,
                        outcome(&got[0])
                    );
                    if form.is_batch() {
                        prop_assert!(
                            matches!(got[1], Err(Error::NotFound(_))),
                            "{:?}: absent key beside a bad one gave {:?}",
                            form,
                            outcome(&got[1])
                        );
                    }
                }
                prop_assert!(matches!(store.remove(&bad), Err(Error::InvalidArgument(_))));
                let res = store.batch_remove(&[&bad]);
                prop_assert!(
                    matches!(res[0], Err(Error::InvalidArgument(_))),
                    "batch_remove with a bad key gave {:?}",
                    res[0]
                );
            }
            Op::Corrupt { key, pick } => {
                let Some(entry) = self.model.get(&key) else { return Ok(()) };
                let len = entry.value.len() as u64;
                let info = self.master().object_info(&key_name(key)).unwrap();
                let live: Vec<u64> =
                    info.replicas.iter().map(|r| r.segment).filter(|s| !self.dead.contains(s)).collect();
                if live.is_empty() {
                    return Ok(());
                }
                let segment = live[pick % live.len()];
                flip_byte(&self.poke, self.master(), &key_name(key), segment, (pick as u64 / 3) % len);
                self.model.get_mut(&key).unwrap().corrupt.insert(segment);
            }
            Op::KillNode => {
                // A put is placed at most three times: with two segments dead but not
                // yet reported, the third placement still finds a live one.
                if self.dead.len() >= 2 {
                    return Ok(());
                }
                let fresh = raw_node(self.master(), 4 << 20);
                let old = std::mem::replace(&mut self.node, fresh);
                self.dead.insert(old.segment);
                drop(old);
            }
            Op::LoseClient { which } => {
                let segments = self.master().stats().segments;
                let (s, t) = self.new_store();
                let old = std::mem::replace(&mut self.stores[which], s);
                self.transports.extend(t);
                drop(old);
                // The last handle may be a heartbeat under way: wait for the unmount.
                let master = self.master();
                wait_until(Duration::from_secs(10), || master.stats().segments == segments);
                // Objects whose only replicas were there are gone with it.
                let master = self.daemon.master();
                self.model.retain(|k, _| !matches!(master.object_info(&key_name(*k)), Err(Error::NotFound(_))));
            }
        }
        Ok(())
    }
}

fn run(net: Net, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut world = World::new(net);
    for op in ops {
        world.apply(op)?;
    }
    // Final sweep: every key through the plainest form.
    for key in 0..KEYS {
        let got = GetForm::Get.read(&world.stores[0], &world.dst, &[&key_name(key)], MAX_LEN, 0).pop().unwrap();
        world.check_read(key, "final get", &got)?;
    }
    // The bytes went through the transport under test.
    if world.wrote {
        let moved: u64 = world
            .transports
            .iter()
            .filter_map(|t| t.stats())
            .map(|s| {
                s.bytes_written.load(std::sync::atomic::Ordering::Relaxed)
                    + s.bytes_read.load(std::sync::atomic::Ordering::Relaxed)
            })
            .sum();
        prop_assert!(matches!(world.net, Net::Local) || moved > 0, "nothing moved over {:?}", world.net);
    }
    Ok(())
}

fn config() -> ProptestConfig {
    // A handful of cases per transport, each a short sequence: the whole file stays
    // well under a minute on two cores in a debug build; shrinking is bounded too.
    ProptestConfig { cases: 8, max_shrink_iters: 64, max_shrink_time: 30_000, ..ProptestConfig::default() }
}

proptest! {
    #![proptest_config(config())]
    #[test]
    fn every_form_matches_a_hashmap_model_over_local(ops in proptest::collection::vec(op(), 4..40)) {
        run(Net::Local, ops)?;
    }

    #[test]
    fn every_form_matches_a_hashmap_model_over_shm(ops in proptest::collection::vec(op(), 4..40)) {
        run(Net::Shm, ops)?;
    }

    #[test]
    fn every_form_matches_a_hashmap_model_over_tcp(ops in proptest::collection::vec(op(), 4..40)) {
        run(Net::Tcp, ops)?;
    }
}

// --- Re-placing after a dead segment ----------------------------------------------

/// A master with one live storage node, and a writer giving no memory whose default
/// (and given) config prefers the segment of a node that just died: the first
/// placement goes there, the write fails, and the put must be placed again on the
/// live node.
struct DeadSegmentSetup {
    master: Master,
    live: Store,
    writer: Store,
    dead: String,
    cfg: ReplicateConfig,
}

fn dead_segment_setup() -> DeadSegmentSetup {
    let master = Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).unwrap();
    let live = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let dead = dead_segment(&master);
    let cfg = ReplicateConfig { preferred_segments: vec![dead.clone()], ..Default::default() };
    let writer =
        Store::builder().master(&master).global_segment_size(0).default_replicate_config(cfg.clone()).build().unwrap();
    DeadSegmentSetup { master, live, writer, dead, cfg }
}

impl DeadSegmentSetup {
    /// Each key reads back its bytes, from a replica on the live node only.
    fn assert_stored_on_live(&self, items: &[(&str, &[u8])]) {
        let live = self.live.segment_id().unwrap();
        for (key, value) in items {
            let info = self.master.object_info(key).unwrap_or_else(|e| panic!("{key}: {e}"));
            assert!(info.replicas.iter().all(|r| r.segment == live), "{key}: {:?}", info.replicas);
            assert_eq!(&self.live.get(key).unwrap()[..], *value, "{key}");
        }
        assert!(self.master.stats().segment_failures >= 1, "the dead segment was reported");
    }
}

#[test]
fn put_parts_re_places_after_a_dead_segment() {
    let s = dead_segment_setup();
    let value = payload(1, 30_000);
    let parts = parts_of(&value, 12_345);
    s.writer.put_parts("parts", &parts).unwrap_or_else(|e| panic!("put_parts onto {} did not re-place: {e:?}", s.dead));
    s.assert_stored_on_live(&[("parts", &value)]);
}

#[test]
fn batch_put_re_places_after_a_dead_segment() {
    let s = dead_segment_setup();
    let (a, b) = (payload(2, 10_000), payload(3, 20_000));
    let items: Vec<(&str, &[u8])> = vec![("batch/a", &a), ("batch/b", &b)];
    let res = s.writer.batch_put(&items, &s.cfg);
    assert!(res.iter().all(Result::is_ok), "batch_put onto {} did not re-place: {res:?}", s.dead);
    s.assert_stored_on_live(&items);
}

#[test]
fn batch_put_parts_re_places_after_a_dead_segment() {
    let s = dead_segment_setup();
    let (a, b) = (payload(4, 10_000), payload(5, 20_000));
    let (pa, pb) = (parts_of(&a, 77), parts_of(&b, 999));
    let res = s.writer.batch_put_parts(&[("bparts/a", &pa[..]), ("bparts/b", &pb[..])], &s.cfg);
    assert!(res.iter().all(Result::is_ok), "batch_put_parts onto {} did not re-place: {res:?}", s.dead);
    s.assert_stored_on_live(&[("bparts/a", &a), ("bparts/b", &b)]);
}

#[test]
fn batch_upsert_re_places_after_a_dead_segment() {
    let s = dead_segment_setup();
    let (a, b) = (payload(6, 10_000), payload(7, 20_000));
    // One key new, one replacing an object.
    s.live.put("bupsert/b", b"old bytes").unwrap();
    let items: Vec<(&str, &[u8])> = vec![("bupsert/a", &a), ("bupsert/b", &b)];
    let res = s.writer.batch_upsert(&items, &s.cfg);
    assert!(res.iter().all(Result::is_ok), "batch_upsert onto {} did not re-place: {res:?}", s.dead);
    s.assert_stored_on_live(&items);
}

#[test]
fn every_other_put_form_re_places_after_a_dead_segment() {
    let dev = HostDeviceMemory::new(DEV).unwrap();
    for form in PUT_FORMS {
        if matches!(form, PutForm::PutParts | PutForm::BatchPut | PutForm::BatchPutParts | PutForm::BatchUpsert) {
            continue; // each has its own test above
        }
        let s = dead_segment_setup();
        let (a, b) = (payload(8, 12_000), payload(9, 7_000));
        let (ka, kb) = (format!("{form:?}/a"), format!("{form:?}/b"));
        let items: Vec<(&str, &[u8])> = vec![(&ka, &a), (&kb, &b)];
        let res = form.write(&s.writer, &dev, &items, &s.cfg, 321);
        assert!(res.iter().all(Result::is_ok), "{form:?} onto {} did not re-place: {res:?}", s.dead);
        s.assert_stored_on_live(&items[..res.len()]);
    }
}

// --- batch_get and a flipped byte -------------------------------------------------

#[test]
fn batch_get_detects_a_flipped_byte_and_never_returns_a_corrupted_replica() {
    for tcp in [false, true] {
        let master = Master::new(MasterConfig { default_lease: Duration::ZERO, ..Default::default() }).unwrap();
        let node = |tcp: bool| {
            let b = Store::builder().master(&master).global_segment_size(8 << 20);
            if tcp { b.protocol(Protocol::Tcp).listen("127.0.0.1:0") } else { b }.build().unwrap()
        };
        let (a, b, reader) = (node(tcp), node(tcp), node(tcp));
        let on = |s: &Store| ReplicateConfig {
            preferred_segments: vec![master.segment_info(s.segment_id().unwrap()).unwrap().name],
            ..Default::default()
        };
        let values: Vec<Vec<u8>> = [5usize, 70_000, 300_000, 2 << 20].iter().map(|&n| payload(n as u8, n)).collect();
        let keys = ["one", "bad", "two", "big-bad"];
        for (key, v) in keys.iter().zip(&values) {
            a.put_with(key, v, &on(&a)).unwrap();
        }
        // Two replicas, the one on `a` corrupt: the other's bytes come back.
        let both = ReplicateConfig { replica_num: 2, ..on(&a) };
        let twice = payload(99, 100_000);
        b.put_with("twice", &twice, &both).unwrap();
        assert_eq!(master.object_info("twice").unwrap().replicas.len(), 2);
        let poke = TransferEngine::new();
        let seg_a = a.segment_id().unwrap();
        flip_byte(&poke, &master, "bad", seg_a, 69_999);
        flip_byte(&poke, &master, "big-bad", seg_a, (1 << 20) + 3);
        flip_byte(&poke, &master, "twice", seg_a, 4_096);
        let got = reader.batch_get(&["one", "bad", "two", "big-bad", "twice"]);
        assert_eq!(&got[0].as_ref().unwrap()[..], &values[0][..], "tcp: {tcp}");
        assert!(matches!(got[1], Err(Error::Corrupted(_))), "tcp: {tcp}: {:?}", got[1].as_ref().map(|b| b.len()));
        assert_eq!(&got[2].as_ref().unwrap()[..], &values[2][..], "tcp: {tcp}");
        assert!(matches!(got[3], Err(Error::Corrupted(_))), "tcp: {tcp}: {:?}", got[3].as_ref().map(|b| b.len()));
        assert_eq!(&got[4].as_ref().unwrap()[..], &twice[..], "tcp: {tcp}: the intact replica");
        assert!(reader.stats().checksum_mismatches >= 3, "tcp: {tcp}: {:?}", reader.stats().checksum_mismatches);
    }
}

// --- Store::batch_remove and the replica cache --------------------------------------

#[test]
fn batch_remove_forgets_cached_replica_lists() {
    // Long leases: a kept list is reused for seconds (the gets give their lease back
    // as soon as they are over, so removal is not blocked).
    let master = Master::new(MasterConfig { default_lease: Duration::from_secs(30), ..Default::default() }).unwrap();
    let (b, c) = (
        Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap(),
        Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap(),
    );
    let reader = Store::builder().master(&master).global_segment_size(0).replica_cache(1024).build().unwrap();
    let on = |s: &Store| ReplicateConfig {
        preferred_segments: vec![master.segment_info(s.segment_id().unwrap()).unwrap().name],
        ..Default::default()
    };
    let old: Vec<Vec<u8>> = (0..3).map(|i| payload(i, 50_000)).collect();
    let new: Vec<Vec<u8>> = (0..3).map(|i| payload(100 + i, 50_000)).collect();
    let keys = ["cached/0", "cached/1", "cached/2"];
    // The setup can show a stale list: removed behind the reader's back (by the
    // master, as another client would), the old memory untouched and the new object
    // elsewhere, the kept list still gives the old bytes.
    b.put_with("probe", &old[0], &on(&b)).unwrap();
    assert_eq!(&reader.get("probe").unwrap()[..], &old[0][..]);
    assert_eq!(&reader.get("probe").unwrap()[..], &old[0][..]);
    let hits = reader.stats().replica_cache_hits;
    assert!(hits >= 1, "the reader keeps lists");
    master.batch_remove(&["probe"]).pop().unwrap().unwrap();
    c.put_with("probe", &new[0], &on(&c)).unwrap();
    assert_eq!(&reader.get("probe").unwrap()[..], &old[0][..], "a kept list is reused (this test could fail)");
    // The same through the reader's own Store::batch_remove: forgotten at once.
    for (key, v) in keys.iter().zip(&old) {
        b.put_with(key, v, &on(&b)).unwrap();
        assert_eq!(&reader.get(key).unwrap()[..], &v[..]);
    }
    let res = reader.batch_remove(&keys);
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    for (key, v) in keys.iter().zip(&new) {
        c.put_with(key, v, &on(&c)).unwrap();
    }
    for (key, v) in keys.iter().zip(&new) {
        assert_eq!(&reader.get(key).unwrap()[..], &v[..], "{key}: a removed key's cached list was used");
    }
    let got = reader.batch_get(&keys);
    for ((key, v), g) in keys.iter().zip(&new).zip(got) {
        assert_eq!(&g.unwrap()[..], &v[..], "{key}");
    }
}

/// A client's own put forgets its cached list of the key: the put succeeded only
/// because the key was gone at the master (removed by another client), so the kept
/// list is of a removed value, and the next get must read the client's own write.
#[test]
fn a_put_forgets_its_own_cached_list_of_the_key() {
    let master = Master::new(MasterConfig { default_lease: Duration::from_secs(30), ..Default::default() }).unwrap();
    let b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let reader = Store::builder().master(&master).global_segment_size(4 << 20).replica_cache(1024).build().unwrap();
    let on = |s: &Store| ReplicateConfig {
        preferred_segments: vec![master.segment_info(s.segment_id().unwrap()).unwrap().name],
        ..Default::default()
    };
    let (old, new) = (payload(1, 50_000), payload(2, 50_000));
    b.put_with("k", &old, &on(&b)).unwrap();
    assert_eq!(&reader.get("k").unwrap()[..], &old[..]);
    assert_eq!(&reader.get("k").unwrap()[..], &old[..]);
    assert!(reader.stats().replica_cache_hits >= 1, "the reader keeps lists");
    // Removed behind the reader's back; the old memory stays untouched.
    master.batch_remove(&["k"]).pop().unwrap().unwrap();
    reader.put_with("k", &new, &on(&reader)).unwrap();
    assert_eq!(&reader.get("k").unwrap()[..], &new[..], "the reader reads its own write");
}

/// A kept list too large for the caller's buffer is not the last word: the object may
/// have been replaced by a smaller one, so the master is asked before `BufferTooSmall`.
#[test]
fn a_kept_list_too_large_for_the_buffer_asks_the_master() {
    let master = Master::new(MasterConfig { default_lease: Duration::from_secs(30), ..Default::default() }).unwrap();
    let b = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    let reader = Store::builder().master(&master).global_segment_size(0).replica_cache(1024).build().unwrap();
    let (big, small) = (payload(1, 100_000), payload(2, 50_000));
    b.put("k", &big).unwrap();
    assert_eq!(&reader.get("k").unwrap()[..], &big[..]);
    master.batch_remove(&["k"]).pop().unwrap().unwrap();
    b.put("k", &small).unwrap();
    let mut buf = vec![0u8; 75_000];
    assert_eq!(reader.get_into("k", &mut buf).unwrap(), small.len(), "the master's list fits");
    assert_eq!(&buf[..small.len()], &small[..]);
    let mut tiny = vec![0u8; 10];
    assert!(matches!(reader.get_into("k", &mut tiny), Err(Error::BufferTooSmall { .. })));
}

/// `len` bytes of `dev` at `at`, read back to the host.
fn dev_bytes(dev: &HostDeviceMemory, at: usize, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    dev.copy_to_host(at as u64, &mut out).unwrap();
    out
}

/// A storage node of the master at `addr` with a 32 MiB segment that same-host
/// clients map (`Protocol::Shm`).
fn shm_node(addr: &str) -> Store {
    Store::builder()
        .master_address(addr)
        .listen("127.0.0.1:0")
        .protocol(Protocol::Shm)
        .global_segment_size(32 << 20)
        .build()
        .unwrap()
}

/// A client's write and read time, phase by phase (`StoreStats::write_time`,
/// `read_time`, with `StoreBuilder::phase_times`; zeros without): every call
/// counted once, a batch too, and a round each; the
/// phases, each a part of its call, never add up to more than the calls took; only
/// device puts declare or bind beside their DMA, and that time is a part of their
/// move.
#[test]
fn write_and_read_time_account_for_every_call_phase_by_phase() {
    let daemon = MasterDaemon::builder("127.0.0.1:0").serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let _holder = shm_node(&addr);
    let client = Store::builder()
        .master_address(&addr)
        .protocol(Protocol::Shm)
        .global_segment_size(0)
        .phase_times(true)
        .build()
        .unwrap();
    // Off unless asked: a store that does not time phases leaves them at zero.
    let untimed = Store::builder().master_address(&addr).protocol(Protocol::Shm).global_segment_size(0).build();
    let untimed = untimed.unwrap();
    untimed.put("untimed", b"value").unwrap();
    assert_eq!(untimed.get("untimed").unwrap(), b"value".to_vec());
    let s = untimed.stats();
    assert_eq!((s.write_time, s.read_time), Default::default(), "timed though not asked");
    let time = || client.stats().write_time;
    let before = time();
    assert_eq!(before.per_call_us().map(|(_, us)| us), [0.0; 5], "no call yet");

    // Host puts: five single, one batch of four, one upsert.
    let values: Vec<Vec<u8>> = (0..10).map(|i| payload(60 + i, 64 << 10)).collect();
    let started = std::time::Instant::now();
    for (i, v) in values[..5].iter().enumerate() {
        client.put(&format!("h{i}"), v).unwrap();
    }
    let batch: Vec<(String, &[u8])> = (5..9).map(|i| (format!("h{i}"), &values[i][..])).collect();
    let items: Vec<(&str, &[u8])> = batch.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert!(client.batch_put(&items, &ReplicateConfig::default()).iter().all(Result::is_ok));
    client.upsert("h0", &values[9]).unwrap();
    let wall = started.elapsed().as_nanos() as u64;
    let host = time().since(&before);
    assert_eq!((host.calls, host.rounds), (7, 7), "{host:?}");
    assert!(host.place_ns > 0 && host.move_ns > 0 && host.end_ns > 0, "{host:?}");
    assert_eq!(host.declare_ns, 0, "host puts declare with their placement, never beside a move");
    let phases = host.sum_ns + host.place_ns + host.move_ns + host.end_ns;
    assert!(phases <= wall, "the phases ({phases} ns) are parts of calls that took {wall} ns");

    // Device puts into mapped memory: summed and declared (or bound) beside the DMA.
    let dev = HostDeviceMemory::new(4 << 20).unwrap();
    dev.copy_from_host(0, &payload(70, 4 << 20)).unwrap();
    let before = time();
    for i in 0..3 {
        client.put_from_device(&format!("d{i}"), &dev, 0, 1 << 20).unwrap();
    }
    let device = time().since(&before);
    assert_eq!((device.calls, device.rounds), (3, 3), "{device:?}");
    assert!(device.declare_ns > 0, "declared or bound beside the DMA: {device:?}");
    assert!(device.declare_ns <= device.move_ns, "a part of the move: {device:?}");
    let per_call: std::collections::HashMap<&str, f64> = device.per_call_us().into_iter().collect();
    assert_eq!(per_call["declare"], device.declare_ns as f64 / 3.0 / 1e3);
    assert!(client.stats().to_string().contains("writes 10 calls (10 rounds)"), "{}", client.stats());

    // Reads: each call a round (every replica is sound), the phases parts of them.
    let before = client.stats().read_time;
    let started = std::time::Instant::now();
    for (i, v) in values[1..5].iter().enumerate() {
        assert_eq!(&client.get(&format!("h{}", i + 1)).unwrap()[..], &v[..]);
    }
    let dst = HostDeviceMemory::new(1 << 20).unwrap();
    assert_eq!(client.get_into_device("d1", &dst, 0).unwrap(), 1 << 20);
    let wall = started.elapsed().as_nanos() as u64;
    let read = client.stats().read_time.since(&before);
    assert_eq!((read.calls, read.rounds), (5, 5), "{read:?}");
    assert!(read.locate_ns > 0 && read.move_ns > 0 && read.check_ns > 0, "{read:?}");
    let phases = read.locate_ns + read.move_ns + read.check_ns + read.upload_ns;
    assert!(phases <= wall, "the phases ({phases} ns) are parts of calls that took {wall} ns");
    assert!(client.stats().to_string().contains("reads 5 calls (5 rounds)"), "{}", client.stats());
}

/// Device puts into mapped memory through a master daemon use room held ahead: the
/// first of a size is placed by a start and asks for room ahead of the next; each
/// next one of that size is written there at once and bound to its key beside its
/// DMA (`put_bind`, which asks for the next room). Every value reads back exactly
/// and nothing is left in progress; a put of a key that exists fails as before, its
/// room kept until its hold ends; smaller values and a master in the process hold
/// nothing.
#[test]
fn device_puts_through_a_master_daemon_write_into_room_held_ahead() {
    // Held 10 s (usable for 2 s): a loaded machine's pauses do not decide the counts.
    let config = MasterConfig { placement_hold: Duration::from_secs(10), ..MasterConfig::served() };
    let daemon = MasterDaemon::builder("127.0.0.1:0").config(config).serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let holder = shm_node(&addr);
    let client = Store::builder().master_address(&addr).protocol(Protocol::Shm).global_segment_size(0).build().unwrap();
    let stats = || daemon.master().stats();
    const MIB: usize = 1 << 20;
    let dev = HostDeviceMemory::new(8 << 20).unwrap();
    let values: Vec<Vec<u8>> = (0..5).map(|i| payload(40 + i, MIB)).collect();
    for (i, v) in values.iter().enumerate() {
        dev.copy_from_host((i * MIB) as u64, v).unwrap();
        client.put_from_device(&format!("d{i}"), &dev, (i * MIB) as u64, MIB as u64).unwrap();
    }
    let s = stats();
    assert_eq!(s.bound_puts, 4, "every put after the first of its size");
    assert_eq!(s.declared_puts, 5, "a bound put is declared");
    assert_eq!((s.pending_puts, s.held_placements), (0, 1), "room held for the next put only");
    let used = s.used_bytes;
    assert!(matches!(client.put_from_device("d0", &dev, MIB as u64, MIB as u64), Err(Error::AlreadyExists(_))));
    let s = stats();
    assert_eq!((s.bound_puts, s.held_placements, s.pending_puts), (4, 0, 0), "the room is bound no more");
    // Kept until its hold ends (the DMA into it may still be landing; the master's
    // tests see it freed then).
    assert_eq!(s.used_bytes, used);
    for (i, v) in values.iter().enumerate() {
        assert_eq!(&holder.get(&format!("d{i}")).unwrap()[..], &v[..], "d{i}");
    }
    // Placed by a start again, asking for room ahead again.
    client.put_from_device("d5", &dev, 0, MIB as u64).unwrap();
    assert_eq!((stats().bound_puts, stats().held_placements), (4, 1));
    // A batch of two sizes, each with room held (2 MiB's asked by a first put):
    // both bound in one call beside their DMA, one item per size.
    client.put_from_device("two", &dev, 0, 2 * MIB as u64).unwrap();
    let bound = stats().bound_puts;
    let cfg = ReplicateConfig::default();
    let batch = [("b1", 0, MIB as u64), ("b2", MIB as u64, 2 * MIB as u64), ("b3", 0, MIB as u64)];
    assert!(client.batch_put_from_device(&batch, &dev, &cfg).iter().all(Result::is_ok));
    assert_eq!(stats().bound_puts, bound + 2, "one room per size; the third item is placed by a start");
    assert_eq!(stats().pending_puts, 0);
    assert_eq!(&holder.get("b2").unwrap()[..], &dev_bytes(&dev, MIB, 2 * MIB)[..]);
    assert_eq!(&holder.get("b3").unwrap()[..], &values[0][..]);
    // Below 1 MiB: placed as before, holding nothing more.
    let (bound, held) = (stats().bound_puts, stats().held_placements);
    client.put_from_device("small", &dev, 0, (MIB / 2) as u64).unwrap();
    client.put_from_device("small2", &dev, 0, (MIB / 2) as u64).unwrap();
    assert_eq!((stats().bound_puts, stats().held_placements), (bound, held));
    assert_eq!(&holder.get("small2").unwrap()[..], &values[0][..MIB / 2]);
    drop((client, holder));

    // A master in this process: no round trip to save, nothing held.
    let master = Master::new(MasterConfig::served()).unwrap();
    let local = Store::builder().master(&master).global_segment_size(8 << 20).build().unwrap();
    for i in 0..3 {
        local.put_from_device(&format!("d{i}"), &dev, 0, MIB as u64).unwrap();
    }
    assert_eq!((master.stats().bound_puts, master.stats().held_placements), (0, 0));
}

/// Device puts written into room held ahead are as durable as any other: once
/// acknowledged they come back with their node after the master restarts. Room the
/// client held from the old master is never written afterwards (the new one may
/// have given it to another object): another client's objects, put where that room
/// was, read back intact after the client's next device puts, which are placed on
/// the new master and hold room from it.
#[test]
fn device_puts_into_room_held_ahead_survive_a_master_restart() {
    // Room held 10 s, usable for 2 s: the restart below comes well within it, so
    // what keeps the old room out is the client's checks (the client id it was given
    // to, the master's continuity), not its age.
    let config = || MasterConfig {
        client_ttl: Duration::from_millis(800),
        placement_hold: Duration::from_secs(10),
        ..MasterConfig::served()
    };
    let first = MasterDaemon::builder("127.0.0.1:0").config(config()).serve().unwrap();
    let addr = first.local_addr().to_string();
    let shm = |segment: u64| {
        Store::builder()
            .master_address(&addr)
            .listen("127.0.0.1:0")
            .protocol(Protocol::Shm)
            .global_segment_size(segment)
            .build()
            .unwrap()
    };
    let (holder, client, other) = (shm(32 << 20), shm(0), shm(0));
    const MIB: usize = 1 << 20;
    let dev = HostDeviceMemory::new(8 << 20).unwrap();
    let values: Vec<Vec<u8>> = (0..8).map(|i| payload(60 + i, MIB)).collect();
    let put = |i: usize| {
        dev.copy_from_host((i % 8 * MIB) as u64, &values[i]).unwrap();
        client.put_from_device(&format!("d{i}"), &dev, (i % 8 * MIB) as u64, MIB as u64)
    };
    for i in 0..4 {
        put(i).unwrap();
    }
    let s = first.master().stats();
    assert_eq!((s.bound_puts, s.held_placements), (3, 1));
    // Acknowledged: recorded on the holder already (no heartbeat waited for).
    drop(first);
    let second = MasterDaemon::builder(&addr).config(config()).serve().unwrap();
    wait_until(Duration::from_secs(20), || second.master().stats().objects == 4);
    let others: Vec<Vec<u8>> = (0..4).map(|i| payload(90 + i, MIB)).collect();
    for (i, v) in others.iter().enumerate() {
        wait_until(Duration::from_secs(10), || other.put(&format!("o{i}"), v).is_ok());
    }
    for i in 4..8 {
        wait_until(Duration::from_secs(10), || put(i).is_ok());
    }
    assert_eq!(second.master().stats().bound_puts, 3, "the first put after the restart is placed by a start");
    for (i, v) in values.iter().enumerate() {
        assert_eq!(&holder.get(&format!("d{i}")).unwrap()[..], &v[..], "d{i}");
    }
    for (i, v) in others.iter().enumerate() {
        assert_eq!(&holder.get(&format!("o{i}")).unwrap()[..], &v[..], "o{i}");
    }
}

/// Which puts declare their checksum when they are placed (their records then go to
/// the nodes while the bytes are written), counted by the master: through a master
/// daemon, host values up to 256 KiB (single and batch; up to 1 MiB while every
/// segment reached is mapped memory) and device values (over the host emulation);
/// not a larger host value, nor an upsert; nothing with a master in the process.
/// Every value reads back exactly.
#[test]
fn puts_through_a_master_daemon_declare_their_checksums() {
    let daemon = MasterDaemon::builder("127.0.0.1:0").config(MasterConfig::served()).serve().unwrap();
    let addr = daemon.local_addr().to_string();
    let node = Store::builder()
        .master_address(&addr)
        .listen("127.0.0.1:0")
        .protocol(Protocol::Tcp)
        .global_segment_size(16 << 20)
        .build()
        .unwrap();
    let client = Store::builder().master_address(&addr).protocol(Protocol::Tcp).global_segment_size(0).build().unwrap();
    let declared = || daemon.master().stats().declared_puts;
    let small = payload(1, 200_000);
    client.put("small", &small).unwrap();
    assert_eq!(declared(), 1, "a value up to 256 KiB declares its checksum");
    let batch: Vec<(String, Vec<u8>)> = (0..3).map(|i| (format!("b{i}"), payload(i + 2, 70_000))).collect();
    let items: Vec<(&str, &[u8])> = batch.iter().map(|(k, v)| (k.as_str(), &v[..])).collect();
    assert!(client.batch_put(&items, &ReplicateConfig::default()).iter().all(Result::is_ok));
    assert_eq!(declared(), 4, "each item of a batch");
    let medium = payload(8, 600_000);
    client.put("medium", &medium).unwrap();
    assert_eq!(declared(), 4, "over the network, a larger value is summed on its way instead");
    client.upsert("small", &payload(5, 1000)).unwrap();
    assert_eq!(declared(), 4, "an upsert keeps its own end");
    let dev = HostDeviceMemory::new(1 << 20).unwrap();
    let on_device = payload(7, 500_000);
    dev.copy_from_host(4096, &on_device).unwrap();
    client.put_from_device("device", &dev, 4096, on_device.len() as u64).unwrap();
    assert_eq!(declared(), 5, "device bytes are summed on the device before the placement");
    assert_eq!(client.stats().declared_puts, 5, "the client counts what it declared");
    let reads = [("medium", &medium), ("device", &on_device)];
    for (k, v) in reads.into_iter().chain(batch.iter().map(|(k, v)| (k.as_str(), v))) {
        assert_eq!(&client.get(k).unwrap()[..], &v[..], "{k}");
    }
    drop(node);

    // Over shared memory only (every segment reached is mapped): up to 1 MiB.
    let shm = Store::builder().master_address(&addr).protocol(Protocol::Shm).global_segment_size(0).build().unwrap();
    let holder = Store::builder()
        .master_address(&addr)
        .listen("127.0.0.1:0")
        .protocol(Protocol::Shm)
        .global_segment_size(16 << 20)
        .build()
        .unwrap();
    shm.put("first", &small).unwrap();
    assert_eq!(declared(), 6);
    shm.put("medium2", &medium).unwrap();
    assert_eq!(declared(), 7, "mapped memory only: up to 1 MiB");
    assert_eq!(&shm.get("medium2").unwrap()[..], &medium[..]);
    // A device put into mapped memory: summed beside its DMA, declared while it runs.
    let dev2 = HostDeviceMemory::new(1 << 20).unwrap();
    let mapped = payload(9, 1 << 20);
    dev2.copy_from_host(0, &mapped).unwrap();
    shm.put_from_device("device2", &dev2, 0, 1 << 20).unwrap();
    assert_eq!(declared(), 8, "a device put into mapped memory is declared beside its DMA");
    assert_eq!(shm.stats().declared_puts, 3);
    assert_eq!(&shm.get("device2").unwrap()[..], &mapped[..]);
    drop((shm, holder));

    // A master in this process: its records cost nothing to wait for, nothing declares.
    let master = Master::new(MasterConfig::served()).unwrap();
    let local = Store::builder().master(&master).global_segment_size(4 << 20).build().unwrap();
    local.put("first", &small).unwrap();
    local.put_from_device("device", &dev, 4096, on_device.len() as u64).unwrap();
    assert_eq!(master.stats().declared_puts, 0);
    assert_eq!(local.stats().declared_puts, 0);
    assert_eq!(&local.get("device").unwrap()[..], &on_device[..]);
    // Nor does the master a store builds for itself (no master, no address given).
    let embedded = Store::builder().global_segment_size(4 << 20).build().unwrap();
    embedded.put("first", &small).unwrap();
    embedded.put_from_device("device", &dev, 4096, on_device.len() as u64).unwrap();
    assert_eq!(embedded.stats().declared_puts, 0, "the store of an embedded master declared");
    assert_eq!(&embedded.get("device").unwrap()[..], &on_device[..]);
}
