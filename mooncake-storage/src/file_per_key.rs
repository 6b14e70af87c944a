//! [`FilePerKeyBackend`]: one file per object.
//!
//! An object with key `k` lives in `<dir>/<h[0..2]>/<h[2..4]>/<h>.obj`, where `h` is
//! the 32-hex-digit 128-bit hash of `k` (two seeded xxh64) — a two-level sharded
//! tree that keeps directories small. Each file is an
//! [`ObjectHeader`] (key, length, crc32c of the value, write sequence; protected by
//! its own crc32c) padded to 4 KiB, then the value (format in [`crate::meta`]).
//!
//! **Crash safety**: a file is written as `<h>.obj.tmp.<seq>`, `fdatasync`ed, renamed
//! into place, and its directory synced before the write is acknowledged. Opening the
//! directory deletes temporary files and files whose header is invalid, whose
//! path does not match their key, or that are shorter than their header says.
//! Values are checked against their crc32c on load.
//!
//! The unit of eviction is the object.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ahash::{AHashMap, AHashSet};
use parking_lot::{Mutex, RwLock};
use xxhash_rust::xxh64::xxh64;

use crate::backend::{
    batch_results, checked_load, remove_file_quiet, sync_dir, validate_batch, BackendOptions, BackendStats,
    EvictionReport, Notifier, ObjectMeta, Pinned, Pins, ReadPin, StorageBackend,
};
use crate::error::{Result, StorageError};
use crate::eviction::{DiskEvictionStrategy, UnitId};
use crate::io::{AlignedBuf, IoEngine, IoFile, OpenMode, ReadOp};
use crate::meta::{align_up, parse_object_header, ObjectHeader, MAX_KEY_LEN, OBJECT_HEADER_FIXED};

const SEED_B: u64 = 0x9E37_79B9_7F4A_7C15;

struct Obj {
    unit: UnitId,
    meta: ObjectMeta,
    path: PathBuf,
    value_offset: u64,
    disk_len: u64,
    pins: Pins,
    file: Mutex<Option<Arc<IoFile>>>,
}

impl Pinned for Obj {
    fn pins(&self) -> &Pins {
        &self.pins
    }
}

#[derive(Default)]
struct Index {
    objects: AHashMap<String, Arc<Obj>>,
    units: AHashMap<UnitId, String>,
    writing: AHashSet<String>,
    used: u64,
}

struct PendingEviction {
    objects: Vec<Arc<Obj>>,
    bytes: u64,
}

/// One file per object in a hash-sharded directory tree (see the module docs).
pub struct FilePerKeyBackend {
    dir: PathBuf,
    io: Arc<dyn IoEngine>,
    capacity: Option<u64>,
    eviction_wait: Duration,
    verify_on_load: bool,
    index: RwLock<Index>,
    strategy: Mutex<Box<dyn DiskEvictionStrategy>>,
    notifier: Notifier,
    next_seq: AtomicU64,
    next_unit: AtomicU64,
}

/// Bytes an object takes on disk: its header block and its value padded to 4 KiB.
fn disk_len(key: &str, value_len: u64) -> u64 {
    align_up((OBJECT_HEADER_FIXED + key.len()) as u64) + align_up(value_len)
}

impl FilePerKeyBackend {
    /// Opens (creating if needed) a store in `dir`, recovering every intact object
    /// already there and deleting garbage.
    pub fn open(dir: impl AsRef<Path>, options: BackendOptions) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        std::fs::create_dir_all(&dir)?;
        let b = FilePerKeyBackend {
            dir,
            io: options.io,
            capacity: options.capacity,
            eviction_wait: options.eviction_wait,
            verify_on_load: options.verify_on_load,
            index: RwLock::new(Index::default()),
            strategy: Mutex::new(options.eviction),
            notifier: Notifier::new(options.listener),
            next_seq: AtomicU64::new(1),
            next_unit: AtomicU64::new(1),
        };
        b.recover()?;
        Ok(b)
    }

    /// Where the file of `key` lives.
    pub fn path_for(&self, key: &str) -> PathBuf {
        let a = xxh64(key.as_bytes(), 0);
        let b = xxh64(key.as_bytes(), SEED_B);
        let h = format!("{a:016x}{b:016x}");
        self.dir.join(&h[0..2]).join(&h[2..4]).join(format!("{h}.obj"))
    }

    fn recover(&self) -> Result<()> {
        let mut found: Vec<(ObjectHeader, PathBuf, u64)> = Vec::new();
        for l1 in std::fs::read_dir(&self.dir)? {
            let l1 = l1?.path();
            if !l1.is_dir() {
                continue;
            }
            for l2 in std::fs::read_dir(&l1)? {
                let l2 = l2?.path();
                if !l2.is_dir() {
                    continue;
                }
                for f in std::fs::read_dir(&l2)? {
                    let path = f?.path();
                    match self.recover_file(&path) {
                        Ok(Some((h, len))) => found.push((h, path, len)),
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!("{} is garbage ({e}): removing it", path.display());
                            remove_file_quiet(&path);
                        }
                    }
                }
            }
        }
        found.sort_by_key(|(h, _, _)| h.seq);
        let mut idx = self.index.write();
        let mut strategy = self.strategy.lock();
        let mut max_seq = 0;
        for (h, path, file_len) in found {
            max_seq = max_seq.max(h.seq);
            let unit = self.next_unit.fetch_add(1, Ordering::Relaxed);
            let obj = Obj {
                unit,
                meta: ObjectMeta { key: h.key.clone(), len: h.value_len, checksum: h.value_crc },
                path,
                value_offset: h.value_offset(),
                disk_len: file_len.max(disk_len(&h.key, h.value_len)),
                pins: Pins::default(),
                file: Mutex::new(None),
            };
            idx.used += obj.disk_len;
            idx.units.insert(unit, h.key.clone());
            idx.objects.insert(h.key, Arc::new(obj));
            strategy.add(unit);
        }
        self.next_seq.store(max_seq + 1, Ordering::Relaxed);
        Ok(())
    }

    /// Checks one file found on disk; `Ok(None)` for a removed temporary file.
    fn recover_file(&self, path: &Path) -> Result<Option<(ObjectHeader, u64)>> {
        use std::io::Read;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.contains(".tmp") {
            remove_file_quiet(path);
            return Ok(None);
        }
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        let mut head = Vec::with_capacity(OBJECT_HEADER_FIXED + MAX_KEY_LEN);
        f.by_ref().take((OBJECT_HEADER_FIXED + MAX_KEY_LEN) as u64).read_to_end(&mut head)?;
        let h = parse_object_header(&head)?;
        if self.path_for(&h.key) != path {
            return Err(StorageError::corrupted(path.display().to_string(), "file is not at its key's path"));
        }
        if len < h.record_len() {
            return Err(StorageError::corrupted(path.display().to_string(), format!("truncated: {len} bytes")));
        }
        Ok(Some((h, len)))
    }

    fn prepare(&self, idx: &mut Index, need: u64, free_at_least: Option<u64>) -> PendingEviction {
        let mut p = PendingEviction { objects: Vec::new(), bytes: 0 };
        let mut strategy = self.strategy.lock();
        loop {
            let enough = match free_at_least {
                Some(n) => p.bytes >= n,
                None => self.capacity.is_none_or(|c| idx.used + need <= c),
            };
            if enough {
                break;
            }
            let Some(victim) = strategy.select_victim() else { break };
            let Some(key) = idx.units.remove(&victim) else { continue };
            let Some(obj) = idx.objects.remove(&key) else { continue };
            idx.used -= obj.disk_len;
            p.bytes += obj.disk_len;
            p.objects.push(obj);
        }
        idx.used += need;
        p
    }

    fn notify_and_finalize(&self, p: PendingEviction) -> bool {
        if p.objects.is_empty() {
            return true;
        }
        let keys = p.objects.iter().map(|o| o.meta.key.clone()).collect();
        let notified = self.notifier.notify(keys, p.objects.len());
        for o in &p.objects {
            self.delete(o);
        }
        notified
    }

    fn delete(&self, o: &Obj) {
        if !o.pins.wait_unpinned(self.eviction_wait) {
            tracing::warn!("{:?}: reads still in flight after {:?}; deleting anyway", o.meta.key, self.eviction_wait);
        }
        o.file.lock().take();
        remove_file_quiet(&o.path);
    }

    fn file_of(&self, o: &Obj) -> Result<Arc<IoFile>> {
        let mut cached = o.file.lock();
        if let Some(f) = &*cached {
            return Ok(f.clone());
        }
        let f = Arc::new(self.io.open(&o.path, OpenMode::Read)?);
        *cached = Some(f.clone());
        Ok(f)
    }

    /// Writes one object durably under its final name (the directory is synced by
    /// the caller); returns the object.
    fn write_object(&self, key: &str, value: &[u8]) -> Result<Obj> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let path = self.path_for(key);
        let parent = path.parent().expect("sharded path has a parent");
        if !parent.exists() {
            std::fs::create_dir_all(parent)?;
            if let Some(p) = parent.parent() {
                sync_dir(p)?;
                sync_dir(&self.dir)?;
            }
        }
        let h =
            ObjectHeader { key: key.to_owned(), value_len: value.len() as u64, value_crc: crc32c::crc32c(value), seq };
        let tmp = path.with_extension(format!("obj.tmp.{seq}"));
        let res = (|| {
            let file = self.io.open(&tmp, OpenMode::Create)?;
            let mut head = AlignedBuf::zeroed(h.value_offset() as usize);
            let enc = h.encode();
            head[..enc.len()].copy_from_slice(&enc);
            self.io.write_at(&file, 0, &head)?;
            self.io.write_at(&file, h.value_offset(), value)?;
            self.io.sync_data(&file)?;
            std::fs::rename(&tmp, &path)?;
            Ok(())
        })();
        if let Err(e) = res {
            remove_file_quiet(&tmp);
            return Err(e);
        }
        Ok(Obj {
            unit: self.next_unit.fetch_add(1, Ordering::Relaxed),
            meta: ObjectMeta { key: key.to_owned(), len: h.value_len, checksum: h.value_crc },
            path,
            value_offset: h.value_offset(),
            disk_len: disk_len(key, h.value_len),
            pins: Pins::default(),
            file: Mutex::new(None),
        })
    }
}

impl StorageBackend for FilePerKeyBackend {
    fn name(&self) -> &'static str {
        "file_per_key"
    }

    fn batch_offload(&self, objects: &[(&str, &[u8])]) -> Vec<Result<ObjectMeta>> {
        let mut results: Vec<Option<Result<ObjectMeta>>> =
            validate_batch(objects).into_iter().map(|e| e.map(Err)).collect();
        let mut accepted = Vec::new();
        let mut need = 0u64;
        {
            let mut idx = self.index.write();
            for (i, (k, v)) in objects.iter().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                let size = disk_len(k, v.len() as u64);
                if let Some(cap) = self.capacity.filter(|&c| need + size > c) {
                    results[i] = Some(Err(StorageError::NoSpace { needed: size, capacity: cap }));
                } else if idx.objects.contains_key(*k) || !idx.writing.insert(k.to_string()) {
                    results[i] = Some(Err(StorageError::AlreadyExists(k.to_string())));
                } else {
                    need += size;
                    accepted.push(i);
                }
            }
        }
        let pending = self.prepare(&mut self.index.write(), need, None);
        let over = {
            let idx = self.index.read();
            self.capacity.filter(|&c| idx.used > c)
        };
        self.notify_and_finalize(pending);
        if let Some(cap) = over {
            let mut idx = self.index.write();
            idx.used -= need;
            for &i in &accepted {
                idx.writing.remove(objects[i].0);
                results[i] = Some(Err(StorageError::NoSpace { needed: need, capacity: cap }));
            }
            accepted.clear();
        }
        let mut written = Vec::with_capacity(accepted.len());
        let mut dirs = AHashSet::new();
        for &i in &accepted {
            let (k, v) = objects[i];
            match self.write_object(k, v) {
                Ok(o) => {
                    dirs.insert(o.path.parent().map(Path::to_owned).unwrap_or_default());
                    written.push((i, o));
                }
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        let mut dir_err = None;
        for d in &dirs {
            if let Err(e) = sync_dir(d) {
                dir_err = Some(e.to_string());
            }
        }
        let mut idx = self.index.write();
        idx.used -= need;
        for &i in &accepted {
            idx.writing.remove(objects[i].0);
        }
        let mut strategy = self.strategy.lock();
        for (i, o) in written {
            if let Some(msg) = &dir_err {
                remove_file_quiet(&o.path);
                results[i] = Some(Err(StorageError::Io(std::io::Error::other(msg.clone()))));
                continue;
            }
            results[i] = Some(Ok(o.meta.clone()));
            idx.used += o.disk_len;
            idx.units.insert(o.unit, o.meta.key.clone());
            strategy.add(o.unit);
            idx.objects.insert(o.meta.key.clone(), Arc::new(o));
        }
        drop(strategy);
        drop(idx);
        self.notifier.supersede(accepted.iter().map(|&i| objects[i].0));
        batch_results(results)
    }

    fn object_meta(&self, key: &str) -> Option<ObjectMeta> {
        self.index.read().objects.get(key).map(|o| o.meta.clone())
    }

    fn load(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        let mut reqs = [(key, buf)];
        self.batch_load(&mut reqs).pop().unwrap_or_else(|| Err(StorageError::NotFound(key.to_owned())))
    }

    fn batch_load(&self, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<usize>> {
        let mut results: Vec<Option<Result<usize>>> = (0..requests.len()).map(|_| None).collect();
        let mut pinned: Vec<(usize, ReadPin<Obj>)> = Vec::with_capacity(requests.len());
        {
            let idx = self.index.read();
            for (i, (key, buf)) in requests.iter().enumerate() {
                match idx.objects.get(*key) {
                    None => results[i] = Some(Err(StorageError::NotFound(key.to_string()))),
                    Some(o) if (buf.len() as u64) < o.meta.len => {
                        results[i] =
                            Some(Err(StorageError::BufferTooSmall { needed: o.meta.len, got: buf.len() as u64 }))
                    }
                    Some(o) => pinned.push((i, ReadPin::new(o))),
                }
            }
        }
        {
            let mut strategy = self.strategy.lock();
            for (_, pin) in &pinned {
                strategy.record_access(pin.0.unit);
            }
        }
        let files: Vec<Option<Arc<IoFile>>> = pinned
            .iter()
            .map(|(i, pin)| match self.file_of(&pin.0) {
                Ok(f) => Some(f),
                Err(e) => {
                    results[*i] = Some(Err(e));
                    None
                }
            })
            .collect();
        {
            let mut bufs: Vec<Option<&mut [u8]>> = requests.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
            let mut ops = Vec::with_capacity(pinned.len());
            let mut op_of = Vec::with_capacity(pinned.len());
            for ((i, pin), f) in pinned.iter().zip(&files) {
                let Some(f) = f else { continue };
                let buf = bufs[*i].take().expect("each request once");
                ops.push(ReadOp { file: f, offset: pin.0.value_offset, buf: &mut buf[..pin.0.meta.len as usize] });
                op_of.push((*i, pin));
            }
            // Each value is checked as its read completes, while the others are in flight.
            self.io.read_batch_each(&mut ops, &mut |j, r| {
                let (i, pin) = op_of[j];
                let m = &pin.0.meta;
                results[i] = Some(checked_load(self.verify_on_load, &m.key, m.len, m.checksum, r));
            });
        }
        drop(pinned);
        batch_results(results)
    }

    fn remove(&self, key: &str) -> Result<()> {
        let obj = {
            let mut idx = self.index.write();
            let obj = idx.objects.remove(key).ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
            idx.units.remove(&obj.unit);
            idx.used -= obj.disk_len;
            self.strategy.lock().remove(obj.unit);
            obj
        };
        self.delete(&obj);
        Ok(())
    }

    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize {
        let idx = self.index.read();
        for o in idx.objects.values() {
            visitor(&o.meta);
        }
        idx.objects.len()
    }

    fn stats(&self) -> BackendStats {
        let idx = self.index.read();
        BackendStats {
            backend: self.name(),
            io: self.io.name(),
            capacity: self.capacity,
            used_bytes: idx.used,
            objects: idx.objects.len() as u64,
            units: idx.objects.len() as u64,
            ..self.notifier.stats()
        }
    }

    fn evict(&self, bytes: u64) -> Result<EvictionReport> {
        let p = self.prepare(&mut self.index.write(), 0, Some(bytes));
        let keys: Vec<String> = p.objects.iter().map(|o| o.meta.key.clone()).collect();
        let bytes_freed = p.bytes;
        let notified = self.notify_and_finalize(p);
        Ok(EvictionReport { keys, bytes_freed, notified })
    }

    fn retry_pending_notifications(&self) -> Result<usize> {
        self.notifier.retry()
    }
}
