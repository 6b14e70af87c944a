//! [`FilePerKeyBackend`]: one file per object.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ahash::{AHashMap, AHashSet};
use parking_lot::RwLock;
use xxhash_rust::xxh64::xxh64;

use super::files::{remove_file_quiet, sync_dir};
use super::skeleton::{
    batch_results, bytes_over, checked_load, split_generations, validate_batch, BackendCore, CachedFile, Layout,
    Pinned, Pins, ReadPin, Usage, Victims,
};
use super::{BackendOptions, BackendStats, DiskEvictionReport, ObjectMeta, StorageBackend};
use crate::error::{Result, StorageError};
use crate::eviction::{UnitId, UnitInfo};
use crate::io::{AlignedBuf, IoFile, OpenMode, ReadOp};
use crate::meta::{align_up, parse_record_header, RecordHeader, MAX_KEY_LEN, RECORD_HEADER_FIXED};

const SEED_B: u64 = 0x9E37_79B9_7F4A_7C15;

/// A stored object and its file: the unit of eviction of this layout.
pub(super) struct Obj {
    unit: UnitId,
    meta: ObjectMeta,
    path: PathBuf,
    /// The inode of its file: the path is the key's, and a newer version of the key
    /// is renamed onto it.
    ino: u64,
    value_offset: u64,
    disk_len: u64,
    pins: Pins,
    file: CachedFile,
}

impl Obj {
    /// What the eviction strategy learns of the object's unit.
    fn info<'a>(&self, keys: &'a [&'a str]) -> UnitInfo<'a> {
        UnitInfo { bytes: self.disk_len, keys }
    }
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

/// One file per object in a hash-sharded directory tree.
///
/// An object with key `k` lives in `<dir>/<h[0..2]>/<h[2..4]>/<h>.obj`, where `h` is
/// the 32-hex-digit 128-bit hash of `k` (two seeded xxh64) — a two-level sharded
/// tree that keeps directories small. Each file is a
/// [`RecordHeader`] (key, length, crc32c of the value, write sequence; protected by
/// its own crc32c) padded to 4 KiB, then the value.
///
/// **Crash safety**: a file is written as `<h>.obj.tmp.<seq>`, `fdatasync`ed, renamed
/// into place, and its directory synced before the write is acknowledged. Opening the
/// directory deletes temporary files and files whose header is invalid, whose
/// path does not match their key, or that are shorter than their header says.
/// Values are checked against their crc32c on load.
///
/// The unit of eviction is the object.
pub struct FilePerKeyBackend {
    dir: PathBuf,
    core: BackendCore,
    index: RwLock<Index>,
    next_seq: AtomicU64,
    next_unit: AtomicU64,
    /// Held while a file is renamed into place or deleted: a delete removes only the
    /// file of the object it deletes, never a newer version renamed onto its path.
    renames: parking_lot::Mutex<()>,
}

/// The inode of the file at `path`, if there is one.
fn inode_of(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.ino())
}

/// Bytes an object takes on disk: its header block and its value padded to 4 KiB.
fn disk_len(key: &str, value_len: u64) -> u64 {
    align_up((RECORD_HEADER_FIXED + key.len()) as u64) + align_up(value_len)
}

impl FilePerKeyBackend {
    /// Opens (creating if needed) a store in `dir`, recovering every intact object
    /// already there and deleting garbage.
    pub fn open(dir: impl AsRef<Path>, options: BackendOptions) -> Result<Self> {
        let dir = dir.as_ref().to_owned();
        std::fs::create_dir_all(&dir)?;
        let b = FilePerKeyBackend {
            dir,
            core: BackendCore::new(options),
            index: RwLock::new(Index::default()),
            next_seq: AtomicU64::new(1),
            next_unit: AtomicU64::new(1),
            renames: parking_lot::Mutex::new(()),
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
        let mut found: Vec<(RecordHeader, PathBuf, u64)> = Vec::new();
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
                        Err(e @ StorageError::Corrupted { .. }) => {
                            tracing::warn!("{} is garbage ({e}): removing it", path.display());
                            remove_file_quiet(&path);
                        }
                        Err(e) => {
                            // An I/O error (EIO, EMFILE) says nothing of the file's
                            // contents: it stays for the next open to try again.
                            tracing::warn!("{} cannot be read ({e}): left on disk, not served", path.display());
                        }
                    }
                }
            }
        }
        found.sort_by_key(|(h, _, _)| h.seq);
        let mut idx = self.index.write();
        let mut strategy = self.core.strategy.lock();
        let mut max_seq = 0;
        for (h, path, file_len) in found {
            max_seq = max_seq.max(h.seq);
            let unit = self.next_unit.fetch_add(1, Ordering::Relaxed);
            let obj = Obj {
                unit,
                meta: ObjectMeta {
                    key: h.key.clone(),
                    len: h.value_len,
                    checksum: h.value_crc,
                    generation: h.generation.unwrap_or(0),
                },
                ino: inode_of(&path).unwrap_or(0),
                path,
                value_offset: h.value_offset(),
                disk_len: file_len.max(disk_len(&h.key, h.value_len)),
                pins: Pins::default(),
                file: CachedFile::default(),
            };
            idx.used += obj.disk_len;
            idx.units.insert(unit, h.key.clone());
            strategy.add(unit, obj.info(&[h.key.as_str()]));
            idx.objects.insert(h.key, Arc::new(obj));
        }
        // Saturating: a sequence number read from disk must not overflow (and panic).
        self.next_seq.store(max_seq.saturating_add(1), Ordering::Relaxed);
        Ok(())
    }

    /// Checks one file found on disk; `Ok(None)` for a removed temporary file.
    fn recover_file(&self, path: &Path) -> Result<Option<(RecordHeader, u64)>> {
        use std::io::Read;
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.contains(".tmp") {
            remove_file_quiet(path);
            return Ok(None);
        }
        let mut f = std::fs::File::open(path)?;
        let len = f.metadata()?.len();
        let mut head = Vec::with_capacity(RECORD_HEADER_FIXED + MAX_KEY_LEN);
        f.by_ref().take((RECORD_HEADER_FIXED + MAX_KEY_LEN) as u64).read_to_end(&mut head)?;
        let h = parse_record_header(&head)?;
        if self.path_for(&h.key) != path {
            return Err(StorageError::corrupted(path.display().to_string(), "file is not at its key's path"));
        }
        if len < h.record_len() {
            return Err(StorageError::corrupted(path.display().to_string(), format!("truncated: {len} bytes")));
        }
        Ok(Some((h, len)))
    }

    /// Phase 1 under the index lock: takes objects out of the index, in the
    /// strategy's order, until `bytes` are freed.
    fn take_victims(&self, idx: &mut Index, bytes: u64) -> Victims<Arc<Obj>> {
        let mut strategy = self.core.strategy.lock();
        Victims::select(&mut **strategy, bytes, |victim, keys| {
            let key = idx.units.remove(&victim)?;
            let obj = idx.objects.remove(&key)?;
            idx.used -= obj.disk_len;
            keys.push(key);
            let freed = obj.disk_len;
            Some((obj, freed))
        })
    }

    /// Unlinks an object's file once no read holds it; returns whether it did (the
    /// caller syncs the directory).
    fn unlink(&self, o: &Obj) -> Result<bool> {
        let wait = self.core.eviction_wait;
        if !o.pins.wait_unpinned(wait) {
            tracing::warn!("{:?}: reads still in flight after {wait:?}; deleting anyway", o.meta.key);
        }
        o.file.close();
        // The wait above may have let a newer version of the key be renamed onto the
        // path (a put again, an upsert): that file is not this object's to delete.
        let _renames = self.renames.lock();
        if inode_of(&o.path) != Some(o.ino) {
            return Ok(false);
        }
        match std::fs::remove_file(&o.path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Deletes objects' files durably: unlinked, then each directory synced once, so
    /// that evicted and removed objects do not come back with a power loss.
    fn delete(&self, objects: &[Arc<Obj>]) -> Result<()> {
        let mut dirs = AHashSet::new();
        let mut first_err = None;
        for o in objects {
            match self.unlink(o) {
                Ok(true) => {
                    dirs.insert(o.path.parent().map(Path::to_owned).unwrap_or_default());
                }
                Ok(false) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        for d in &dirs {
            if let Err(e) = sync_dir(d) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn file_of(&self, o: &Obj) -> Result<Arc<IoFile>> {
        o.file.get_or_open(&self.core.open_files, || self.core.io.open(&o.path, OpenMode::Read))
    }

    /// Writes one object durably under its final name (the directory is synced by
    /// the caller); returns the object.
    fn write_object(&self, key: &str, value: &[u8], generation: u64) -> Result<Obj> {
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
        let h = RecordHeader {
            key: key.to_owned(),
            value_len: value.len() as u64,
            value_crc: crc32c::crc32c(value),
            seq,
            generation: Some(generation),
        };
        let tmp = path.with_extension(format!("obj.tmp.{seq}"));
        let io = &self.core.io;
        let res = (|| {
            let file = io.open(&tmp, OpenMode::Create)?;
            let mut head = AlignedBuf::zeroed(h.value_offset() as usize);
            let enc = h.encode();
            head[..enc.len()].copy_from_slice(&enc);
            io.write_at(&file, 0, &head)?;
            io.write_at(&file, h.value_offset(), value)?;
            io.sync_data(&file)?;
            let ino = inode_of(&tmp).ok_or_else(|| StorageError::Io(std::io::Error::other("the file vanished")))?;
            let _renames = self.renames.lock();
            std::fs::rename(&tmp, &path)?;
            Ok(ino)
        })();
        let ino = match res {
            Ok(ino) => ino,
            Err(e) => {
                remove_file_quiet(&tmp);
                return Err(e);
            }
        };
        Ok(Obj {
            unit: self.next_unit.fetch_add(1, Ordering::Relaxed),
            meta: ObjectMeta { key: key.to_owned(), len: h.value_len, checksum: h.value_crc, generation },
            path,
            ino,
            value_offset: h.value_offset(),
            disk_len: disk_len(key, h.value_len),
            pins: Pins::default(),
            file: CachedFile::default(),
        })
    }
}

impl StorageBackend for FilePerKeyBackend {
    fn name(&self) -> &'static str {
        "file_per_key"
    }

    fn batch_offload(&self, objects: &[(&str, &[u8])]) -> Vec<Result<ObjectMeta>> {
        let items: Vec<(&str, &[u8], u64)> = objects.iter().map(|&(k, v)| (k, v, 0)).collect();
        self.batch_offload_generations(&items)
    }

    fn batch_offload_generations(&self, items: &[(&str, &[u8], u64)]) -> Vec<Result<ObjectMeta>> {
        let (objects, gens) = split_generations(items);
        let objects = &objects[..];
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
                if let Some(cap) = self.core.capacity.filter(|&c| need + size > c) {
                    results[i] = Some(Err(StorageError::NoSpace { needed: size, capacity: cap }));
                } else if idx.objects.contains_key(*k) || !idx.writing.insert(k.to_string()) {
                    results[i] = Some(Err(StorageError::AlreadyExists(k.to_string())));
                } else {
                    need += size;
                    accepted.push(i);
                }
            }
        }
        let capacity = self.core.capacity;
        let pending = {
            let mut idx = self.index.write();
            let over = bytes_over(capacity, idx.used, need);
            let victims = self.take_victims(&mut idx, over);
            idx.used += need;
            victims
        };
        let over = {
            let idx = self.index.read();
            capacity.filter(|&c| idx.used > c)
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
            match self.write_object(k, v, gens[i]) {
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
        let mut strategy = self.core.strategy.lock();
        for (i, o) in written {
            if let Some(msg) = &dir_err {
                remove_file_quiet(&o.path);
                results[i] = Some(Err(StorageError::Io(std::io::Error::other(msg.clone()))));
                continue;
            }
            results[i] = Some(Ok(o.meta.clone()));
            idx.used += o.disk_len;
            idx.units.insert(o.unit, o.meta.key.clone());
            strategy.add(o.unit, o.info(&[o.meta.key.as_str()]));
            idx.objects.insert(o.meta.key.clone(), Arc::new(o));
        }
        drop(strategy);
        drop(idx);
        self.core.notifier.supersede(accepted.iter().map(|&i| objects[i].0));
        batch_results(results)
    }

    fn object_meta(&self, key: &str) -> Option<ObjectMeta> {
        self.index.read().objects.get(key).map(|o| o.meta.clone())
    }

    fn load(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        self.load_one(key, buf)
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
        self.core.record_accesses(pinned.iter().map(|(_, pin)| pin.0.unit));
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
            self.core.io.read_batch_each(&mut ops, &mut |j, r| {
                let (i, pin) = op_of[j];
                let m = &pin.0.meta;
                results[i] = Some(checked_load(self.core.verify_on_load, &m.key, m.len, m.checksum, r));
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
            self.core.strategy.lock().remove(obj.unit);
            obj
        };
        if let Err(e) = self.delete(std::slice::from_ref(&obj)) {
            // If the file is still there, the object stays stored (unless a newer
            // version of the key is already being written); the error says so.
            let _renames = self.renames.lock();
            let mut idx = self.index.write();
            let kept = inode_of(&obj.path) == Some(obj.ino);
            if kept && !idx.objects.contains_key(key) && !idx.writing.contains(key) {
                idx.used += obj.disk_len;
                idx.units.insert(obj.unit, key.to_owned());
                self.core.strategy.lock().add(obj.unit, obj.info(&[key]));
                idx.objects.insert(key.to_owned(), obj);
            }
            return Err(e);
        }
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
        self.snapshot()
    }

    fn evict(&self, bytes: u64) -> Result<DiskEvictionReport> {
        Ok(self.evict_now(bytes))
    }

    fn retry_pending_notifications(&self) -> Result<usize> {
        self.core.notifier.retry()
    }
}

impl Layout for FilePerKeyBackend {
    type Unit = Arc<Obj>;

    fn core(&self) -> &BackendCore {
        &self.core
    }

    fn select_victims(&self, bytes: u64) -> Victims<Arc<Obj>> {
        self.take_victims(&mut self.index.write(), bytes)
    }

    fn finalize(&self, objects: &[Arc<Obj>]) {
        if let Err(e) = self.delete(objects) {
            tracing::warn!("cannot delete evicted objects' files ({e}); they may come back on restart");
        }
    }

    fn usage(&self) -> Usage {
        let idx = self.index.read();
        let objects = idx.objects.len() as u64;
        Usage { capacity: self.core.capacity, used_bytes: idx.used, objects, units: objects }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A remove waits for the reads of the old file before deleting it; a newer
    /// version of the key written meanwhile is renamed onto the same path. The
    /// delete must leave that file alone (before, it deleted the newer version: the
    /// index listed it, its file was gone).
    #[test]
    fn a_delayed_delete_never_removes_a_newer_version_of_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let b = Arc::new(FilePerKeyBackend::open(dir.path(), BackendOptions::default()).unwrap());
        b.offload("k", b"old").unwrap();
        let old = b.index.read().objects.get("k").cloned().unwrap();
        let read_in_flight = ReadPin::new(&old);
        let remover = {
            let b = b.clone();
            std::thread::spawn(move || b.remove("k"))
        };
        while b.exists("k") {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        b.offload("k", b"new").unwrap();
        drop(read_in_flight);
        remover.join().unwrap().unwrap();
        assert_eq!(b.load_vec("k").unwrap(), b"new");
    }
}
