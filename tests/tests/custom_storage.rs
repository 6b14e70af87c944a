//! A user's own SSD backend and disk eviction strategy serving a `Store`, through the
//! public API only: objects are offloaded to the user's backend, loaded back from it
//! with exact bytes once their memory is gone, evicted in the order the user's strategy
//! chooses (the master is told), and found again after a restart.

mod support;

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mooncake_core::storage::{
    BackendOptions, BackendStats, DiskEvictionReport, DiskEvictionStrategy, EvictionListener, ObjectMeta,
    StorageBackend, StorageError, UnitId, UnitInfo,
};
use mooncake_core::{Error, Master, MasterConfig, PersistPolicy, SsdOffloadConfig, Store};
use support::{payload, unique_dir, wait_until};

type StorageResult<T> = Result<T, StorageError>;

/// crc32c (Castagnoli), the checksum `ObjectMeta` carries.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

/// How often the store called into the user's backend.
#[derive(Default)]
struct Calls {
    opens: AtomicU64,
    offloads: AtomicU64,
    loads: AtomicU64,
}

/// The user's backend: one file per object, named after the hex of its key, written to
/// a temporary file, synced and renamed into place; an index in memory, rebuilt from
/// the directory when opened. Past its capacity it evicts the units its strategy picks,
/// telling the listener before it deletes their files. Every object is its own unit.
struct FlatFiles {
    dir: PathBuf,
    capacity: Option<u64>,
    listener: Option<Arc<dyn EvictionListener>>,
    state: Mutex<FlatState>,
    calls: Arc<Calls>,
}

struct FlatState {
    strategy: Box<dyn DiskEvictionStrategy>,
    objects: HashMap<String, (ObjectMeta, UnitId)>,
    units: HashMap<UnitId, String>,
    /// Keys being written: reserved against a second writer.
    writing: HashSet<String>,
    next_unit: UnitId,
    /// Bytes of stored objects and of writes in progress.
    used: u64,
    evicted: u64,
    /// Evicted keys the listener refused, sent again first next time.
    pending: Vec<String>,
}

impl FlatFiles {
    fn open(dir: &Path, options: BackendOptions, calls: Arc<Calls>) -> StorageResult<Self> {
        calls.opens.fetch_add(1, Ordering::Relaxed);
        std::fs::create_dir_all(dir)?;
        let mut state = FlatState {
            strategy: options.eviction,
            objects: HashMap::new(),
            units: HashMap::new(),
            writing: HashSet::new(),
            next_unit: 1,
            used: 0,
            evicted: 0,
            pending: Vec::new(),
        };
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_owned();
            let Some(key) = unhex(&name) else {
                std::fs::remove_file(&path)?; // a torn write's temporary file
                continue;
            };
            let value = std::fs::read(&path)?;
            let meta =
                ObjectMeta { key: key.clone(), len: value.len() as u64, checksum: crc32c(&value), generation: 0 };
            state.insert(meta);
        }
        Ok(FlatFiles {
            dir: dir.to_owned(),
            capacity: options.capacity,
            listener: options.listener,
            state: Mutex::new(state),
            calls,
        })
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(hex(key))
    }

    fn offload_one(&self, key: &str, value: &[u8]) -> StorageResult<ObjectMeta> {
        if key.is_empty() || key.len() > 100 || value.is_empty() {
            return Err(StorageError::InvalidArgument(format!("key {key:?} of a {}-byte value", value.len())));
        }
        let len = value.len() as u64;
        let (victims, room) = {
            let mut s = self.state.lock().unwrap();
            if s.objects.contains_key(key) || !s.writing.insert(key.to_owned()) {
                return Err(StorageError::AlreadyExists(key.to_owned()));
            }
            let (victims, room) = s.make_room(self.capacity, len);
            if room.is_ok() {
                s.used += len;
            } else {
                s.writing.remove(key);
            }
            (victims, room)
        };
        // What was taken out of the index goes even if the write still does not fit.
        self.evict_files(victims);
        room?;
        let written = self.write_file(key, value);
        let mut s = self.state.lock().unwrap();
        s.writing.remove(key);
        s.used -= len;
        written?;
        let meta = ObjectMeta { key: key.to_owned(), len, checksum: crc32c(value), generation: 0 };
        s.insert(meta.clone());
        Ok(meta)
    }

    fn write_file(&self, key: &str, value: &[u8]) -> StorageResult<()> {
        let tmp = self.dir.join(format!("{}.tmp", hex(key)));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(value)?;
        f.sync_all()?;
        std::fs::rename(&tmp, self.path(key))?;
        std::fs::File::open(&self.dir)?.sync_all()?;
        Ok(())
    }

    /// Tells the listener of the victims (with any refused before), then deletes
    /// their files. Whether the listener accepted.
    fn evict_files(&self, victims: Vec<String>) -> bool {
        if victims.is_empty() {
            return true;
        }
        let notified = self.notify(victims.clone());
        for key in &victims {
            std::fs::remove_file(self.path(key)).ok();
        }
        notified
    }

    fn notify(&self, mut keys: Vec<String>) -> bool {
        let Some(listener) = &self.listener else { return true };
        let mut s = self.state.lock().unwrap();
        keys.append(&mut s.pending);
        drop(s);
        match listener.on_evicted(&keys) {
            Ok(()) => true,
            Err(_) => {
                self.state.lock().unwrap().pending.extend(keys);
                false
            }
        }
    }
}

impl FlatState {
    fn insert(&mut self, meta: ObjectMeta) {
        let unit = self.next_unit;
        self.next_unit += 1;
        self.strategy.add(unit, UnitInfo { bytes: meta.len, keys: &[meta.key.as_str()] });
        self.used += meta.len;
        self.units.insert(unit, meta.key.clone());
        self.objects.insert(meta.key.clone(), (meta, unit));
    }

    /// Takes victims out of the index, in the strategy's order, until `len` more bytes
    /// fit; their keys, and whether it fits.
    fn make_room(&mut self, capacity: Option<u64>, len: u64) -> (Vec<String>, StorageResult<()>) {
        let mut victims = Vec::new();
        let Some(capacity) = capacity else { return (victims, Ok(())) };
        while self.used + len > capacity {
            let Some(unit) = self.strategy.select_victim() else {
                return (victims, Err(StorageError::NoSpace { needed: len, capacity }));
            };
            let Some(key) = self.units.remove(&unit) else { continue };
            let (meta, _) = self.objects.remove(&key).expect("indexed unit");
            self.used -= meta.len;
            self.evicted += 1;
            victims.push(key);
        }
        (victims, Ok(()))
    }
}

impl StorageBackend for FlatFiles {
    fn name(&self) -> &'static str {
        "flat_files"
    }

    fn batch_offload(&self, objects: &[(&str, &[u8])]) -> Vec<StorageResult<ObjectMeta>> {
        self.calls.offloads.fetch_add(objects.len() as u64, Ordering::Relaxed);
        objects.iter().map(|(k, v)| self.offload_one(k, v)).collect()
    }

    fn object_meta(&self, key: &str) -> Option<ObjectMeta> {
        self.state.lock().unwrap().objects.get(key).map(|(m, _)| m.clone())
    }

    fn load(&self, key: &str, buf: &mut [u8]) -> StorageResult<usize> {
        self.calls.loads.fetch_add(1, Ordering::Relaxed);
        let found = self.state.lock().unwrap().objects.get(key).cloned();
        let (meta, unit) = found.ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
        if (buf.len() as u64) < meta.len {
            return Err(StorageError::BufferTooSmall { needed: meta.len, got: buf.len() as u64 });
        }
        let value = std::fs::read(self.path(key))?;
        if value.len() as u64 != meta.len || crc32c(&value) != meta.checksum {
            return Err(StorageError::Corrupted { what: key.to_owned(), detail: "checksum mismatch".into() });
        }
        buf[..value.len()].copy_from_slice(&value);
        self.state.lock().unwrap().strategy.record_access(unit);
        Ok(value.len())
    }

    fn remove(&self, key: &str) -> StorageResult<()> {
        let mut s = self.state.lock().unwrap();
        let (meta, unit) = s.objects.remove(key).ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
        s.units.remove(&unit);
        s.strategy.remove(unit);
        s.used -= meta.len;
        drop(s);
        std::fs::remove_file(self.path(key))?;
        Ok(())
    }

    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize {
        let s = self.state.lock().unwrap();
        for (meta, _) in s.objects.values() {
            visitor(meta);
        }
        s.objects.len()
    }

    fn stats(&self) -> BackendStats {
        let s = self.state.lock().unwrap();
        BackendStats {
            backend: self.name(),
            io: "std::fs",
            capacity: self.capacity,
            used_bytes: s.used,
            objects: s.objects.len() as u64,
            units: s.objects.len() as u64,
            evicted_objects: s.evicted,
            evicted_units: s.evicted,
            pending_notifications: s.pending.len() as u64,
            ..BackendStats::default()
        }
    }

    fn evict(&self, bytes: u64) -> StorageResult<DiskEvictionReport> {
        let mut s = self.state.lock().unwrap();
        let mut keys = Vec::new();
        let mut bytes_freed = 0;
        while bytes_freed < bytes {
            let Some(unit) = s.strategy.select_victim() else { break };
            let Some(key) = s.units.remove(&unit) else { continue };
            let (meta, _) = s.objects.remove(&key).expect("indexed unit");
            s.used -= meta.len;
            s.evicted += 1;
            bytes_freed += meta.len;
            keys.push(key);
        }
        drop(s);
        let notified = self.evict_files(keys.clone());
        Ok(DiskEvictionReport { keys, bytes_freed, notified })
    }

    fn retry_pending_notifications(&self) -> StorageResult<usize> {
        let pending = std::mem::take(&mut self.state.lock().unwrap().pending);
        let n = pending.len();
        if n == 0 || self.notify(pending) {
            Ok(n)
        } else {
            Err(StorageError::Notification("the listener refused again".into()))
        }
    }
}

fn hex(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The key a file name is the hex of; `None` for any other name.
fn unhex(name: &str) -> Option<String> {
    let pair = |c: &[u8]| u8::from_str_radix(std::str::from_utf8(c).ok().filter(|p| p.len() == 2)?, 16).ok();
    let bytes: Option<Vec<u8>> = name.as_bytes().chunks(2).map(pair).collect();
    String::from_utf8(bytes?).ok()
}

/// The user's strategy: first in, first out, but a unit holding a key that starts with
/// the prefix is never evicted.
struct KeepPrefix {
    prefix: &'static str,
    evictable: VecDeque<UnitId>,
    kept: HashSet<UnitId>,
}

impl KeepPrefix {
    fn new(prefix: &'static str) -> Self {
        KeepPrefix { prefix, evictable: VecDeque::new(), kept: HashSet::new() }
    }
}

impl DiskEvictionStrategy for KeepPrefix {
    fn add(&mut self, unit: UnitId, info: UnitInfo<'_>) {
        if self.kept.contains(&unit) || self.evictable.contains(&unit) {
            return;
        }
        if info.keys.iter().any(|k| k.starts_with(self.prefix)) {
            self.kept.insert(unit);
        } else {
            self.evictable.push_back(unit);
        }
    }
    fn remove(&mut self, unit: UnitId) {
        self.kept.remove(&unit);
        self.evictable.retain(|&u| u != unit);
    }
    fn record_access(&mut self, _unit: UnitId) {}
    fn select_victim(&mut self) -> Option<UnitId> {
        self.evictable.pop_front()
    }
    fn len(&self) -> usize {
        self.kept.len() + self.evictable.len()
    }
    fn name(&self) -> &'static str {
        "keep_prefix"
    }
}

const SIZE: usize = 256 << 10;

/// Distinct bytes for object `i`.
fn block(i: usize) -> Vec<u8> {
    let mut v = payload(i as u8, SIZE);
    v[..8].copy_from_slice(&(i as u64).to_le_bytes());
    v
}

/// A store whose SSD tier of `objects` x [`SIZE`] bytes is the user's backend with the
/// user's strategy.
fn store_on(master: &Master, dir: &Path, objects: u64, calls: &Arc<Calls>) -> Store {
    let calls = calls.clone();
    let config = SsdOffloadConfig::new(dir, objects * SIZE as u64)
        .backend(move |dir: &Path, options: BackendOptions| FlatFiles::open(dir, options, calls.clone()))
        .eviction(|| KeepPrefix::new("pinned/"));
    Store::builder().master(master).global_segment_size(64 << 20).ssd_offload(config).build().unwrap()
}

fn eager_master() -> Master {
    Master::new(MasterConfig { persist: PersistPolicy::Eager, default_lease: Duration::ZERO, ..Default::default() })
        .unwrap()
}

#[test]
fn user_backend_and_user_strategy_serve_a_store() {
    let dir = unique_dir("custom-storage");
    let master = eager_master();
    let calls = Arc::new(Calls::default());
    let store = store_on(&master, &dir, 4, &calls);
    assert_eq!(calls.opens.load(Ordering::Relaxed), 1, "the store opened the user's backend");
    let keys: Vec<String> = ["pinned/0", "pinned/1", "a0", "a1", "a2", "a3", "a4", "a5"].map(String::from).to_vec();
    // One at a time, so that the disk order is the put order.
    let put = |i: usize| {
        store.put(&keys[i], &block(i)).unwrap();
        wait_until(Duration::from_secs(10), || store.ssd_stats().unwrap().offloaded_objects == i as u64 + 1);
    };

    // The first four fill the disk. With their memory gone, they load from the user's
    // backend with their exact bytes.
    (0..4).for_each(put);
    assert_eq!(calls.offloads.load(Ordering::Relaxed), 4, "every offload went through the user's backend");
    assert_eq!(master.evict_for(u64::MAX).evicted_objects, 4);
    for (i, k) in keys[..4].iter().enumerate() {
        assert!(master.get_replica_list(k).unwrap().replicas.is_empty(), "{k} is on disk only");
        assert_eq!(&store.get(k).unwrap()[..], &block(i)[..], "{k} read back from the user's backend");
    }
    assert_eq!(calls.loads.load(Ordering::Relaxed), 4);
    assert_eq!(store.ssd_stats().unwrap().local_loads, 4);

    // Each of the next four evicts one object. The user's policy chooses: the oldest
    // objects that are not pinned, never the (older) pinned ones plain FIFO would take.
    (4..8).for_each(put);
    let ssd = store.ssd_stats().unwrap();
    assert_eq!(ssd.backend.backend, "flat_files");
    assert_eq!((ssd.backend.objects, ssd.backend.evicted_objects), (4, 4), "{ssd:?}");
    assert_eq!(ssd.backend.pending_notifications, 0);
    // The master was told. a0 and a1 lived only on the disk: they are gone. a2 and a3
    // lost their disk replicas and keep their memory ones.
    for k in ["a0", "a1"] {
        assert!(!store.exists(k).unwrap(), "{k} left its only tier");
        assert!(matches!(store.get(k), Err(Error::NotFound(_))), "{k}");
    }
    for (i, k) in [(4, "a2"), (5, "a3")] {
        let list = master.get_replica_list(k).unwrap();
        assert!(list.disk.is_none() && list.replicas.len() == 1, "{k}: {list:?}");
        assert_eq!(&store.get(k).unwrap()[..], &block(i)[..], "{k} from memory");
    }
    for k in ["pinned/0", "pinned/1", "a4", "a5"] {
        assert!(master.get_replica_list(k).unwrap().disk.is_some(), "{k} stays on the disk");
    }
    assert_eq!(master.ssd_usage(store.client_id()).unwrap().1, 4 * SIZE as i64);
    drop(store);

    // A new store on the same directory opens the user's backend again, which finds
    // its four objects; the store registers them with the master.
    let store = store_on(&master, &dir, 4, &calls);
    assert_eq!(calls.opens.load(Ordering::Relaxed), 2);
    assert_eq!(store.ssd_stats().unwrap().recovered, 4);
    for (i, k) in [(0, "pinned/0"), (1, "pinned/1"), (6, "a4"), (7, "a5")] {
        assert_eq!(&store.get(k).unwrap()[..], &block(i)[..], "{k} after the restart");
    }
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
}

/// A disk full of objects the user's strategy keeps takes no more: the offload fails
/// (the object keeps its memory replica), and nothing kept is evicted.
#[test]
fn a_disk_of_kept_objects_refuses_further_offloads() {
    let dir = unique_dir("custom-storage-full");
    let master = eager_master();
    let calls = Arc::new(Calls::default());
    let store = store_on(&master, &dir, 2, &calls);
    for (i, k) in ["pinned/0", "pinned/1"].iter().enumerate() {
        store.put(k, &block(i)).unwrap();
        wait_until(Duration::from_secs(10), || store.ssd_stats().unwrap().offloaded_objects == i as u64 + 1);
    }
    store.put("pinned/2", &block(2)).unwrap();
    wait_until(Duration::from_secs(10), || store.ssd_stats().unwrap().offload_failures > 0);
    let ssd = store.ssd_stats().unwrap();
    assert_eq!((ssd.offloaded_objects, ssd.backend.objects, ssd.backend.evicted_objects), (2, 2, 0), "{ssd:?}");
    assert!(master.get_replica_list("pinned/0").unwrap().disk.is_some());
    assert!(master.get_replica_list("pinned/1").unwrap().disk.is_some());
    let third = master.get_replica_list("pinned/2").unwrap();
    assert!(third.disk.is_none() && third.replicas.len() == 1, "pinned/2 stays in memory only");
    assert_eq!(&store.get("pinned/2").unwrap()[..], &block(2)[..]);
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
}
