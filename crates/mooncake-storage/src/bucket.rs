//! [`BucketBackend`]: objects grouped into buckets, the default layout.
//!
//! Each bucket is two files in the backend's directory:
//! * `<id>.bucket` — the values, each starting at a 4 KiB-aligned offset (zero
//!   padding between them);
//! * `<id>.meta` — a [`BucketMeta`]: keys, offsets, lengths and crc32c of every value,
//!   and a crc32c of the meta file itself (format in [`crate::meta`]).
//!
//! Bucket ids are nanosecond timestamps, bumped so they strictly increase (also
//! across restarts), so id order is creation order (FIFO).
//!
//! **Crash safety**: the data file is written and `fdatasync`ed before the meta file,
//! which is written to `<id>.meta.tmp`, synced and renamed into place (then the
//! directory is synced). A bucket without a valid meta file is garbage and is deleted
//! when the directory is opened; objects whose bytes lie beyond the end of a
//! (truncated) data file are dropped; every value's crc32c is checked on load. Removing
//! some keys of a bucket rewrites its meta file (atomically); removing the last one
//! deletes the bucket. Eviction deletes the meta file before the data file.
//!
//! The unit of eviction is the bucket. Reads pin their bucket (an RAII read guard), so an
//! evicted bucket's files outlive every read that found it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use ahash::{AHashMap, AHashSet};
use parking_lot::{Mutex, RwLock};

use crate::backend::{
    remove_file_quiet, validate_batch, verify, write_file_atomic, BackendOptions, BackendStats, EvictionReport,
    Notifier, ObjectMeta, Pinned, Pins, ReadPin, StorageBackend,
};
use crate::error::{Result, StorageError};
use crate::eviction::DiskEvictionStrategy;
use crate::io::{AlignedBuf, IoEngine, IoFile, OpenMode, ReadOp};
use crate::meta::{align_up, parse_bucket_meta, BucketEntry, BucketMeta};

/// Limits of one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketConfig {
    /// Most data bytes per bucket (default 256 MiB); a larger object gets a bucket
    /// of its own.
    pub bucket_size_limit: u64,
    /// Most objects per bucket (default 500).
    pub bucket_keys_limit: usize,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig { bucket_size_limit: 256 << 20, bucket_keys_limit: 500 }
    }
}

struct Bucket {
    id: u64,
    /// Bytes of the data file (with padding): what the bucket counts against capacity.
    data_len: u64,
    entries: Vec<BucketEntry>,
    /// Which entries are still stored, and whether the files are gone; also
    /// serializes meta rewrites.
    state: Mutex<BucketState>,
    pins: Pins,
    file: Mutex<Option<Arc<IoFile>>>,
}

struct BucketState {
    live: Vec<bool>,
    deleted: bool,
}

impl Pinned for Bucket {
    fn pins(&self) -> &Pins {
        &self.pins
    }
}

#[derive(Clone)]
struct Loc {
    bucket: Arc<Bucket>,
    entry: usize,
}

#[derive(Default)]
struct Index {
    buckets: BTreeMap<u64, Arc<Bucket>>,
    objects: AHashMap<String, Loc>,
    /// Keys being written (reserved against duplicates; not yet readable).
    writing: AHashSet<String>,
    /// Bytes of stored buckets plus reservations of writes in progress.
    used: u64,
}

/// The bucket layout (see the module docs).
pub struct BucketBackend {
    dir: PathBuf,
    cfg: BucketConfig,
    io: Arc<dyn IoEngine>,
    capacity: Option<u64>,
    eviction_wait: Duration,
    verify_on_load: bool,
    index: RwLock<Index>,
    strategy: Mutex<Box<dyn DiskEvictionStrategy>>,
    notifier: Notifier,
    last_id: Mutex<u64>,
}

/// Victims removed from the index, awaiting notification and deletion.
struct PendingEviction {
    buckets: Vec<Arc<Bucket>>,
    keys: Vec<String>,
    bytes: u64,
}

fn data_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id}.bucket"))
}

fn meta_name(id: u64) -> String {
    format!("{id}.meta")
}

impl BucketBackend {
    /// Opens (creating if needed) a bucket store in `dir`, recovering every intact
    /// bucket already there and deleting garbage (see the module docs).
    pub fn open(dir: impl AsRef<Path>, options: BackendOptions, config: BucketConfig) -> Result<Self> {
        if config.bucket_size_limit == 0 || config.bucket_keys_limit == 0 {
            return Err(StorageError::InvalidArgument("bucket limits must be positive".into()));
        }
        let dir = dir.as_ref().to_owned();
        std::fs::create_dir_all(&dir)?;
        let b = BucketBackend {
            dir,
            cfg: config,
            io: options.io,
            capacity: options.capacity,
            eviction_wait: options.eviction_wait,
            verify_on_load: options.verify_on_load,
            index: RwLock::new(Index::default()),
            strategy: Mutex::new(options.eviction),
            notifier: Notifier::new(options.listener),
            last_id: Mutex::new(0),
        };
        b.recover()?;
        Ok(b)
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Ids of the buckets stored, oldest first.
    pub fn bucket_ids(&self) -> Vec<u64> {
        self.index.read().buckets.keys().copied().collect()
    }

    /// The bucket holding `key`, if stored.
    pub fn bucket_of(&self, key: &str) -> Option<u64> {
        self.index.read().objects.get(key).map(|l| l.bucket.id)
    }

    /// Path of a bucket's data file.
    pub fn data_file_path(&self, id: u64) -> PathBuf {
        data_path(&self.dir, id)
    }

    /// Path of a bucket's meta file.
    pub fn meta_file_path(&self, id: u64) -> PathBuf {
        self.dir.join(meta_name(id))
    }

    fn recover(&self) -> Result<()> {
        let mut metas: BTreeMap<u64, PathBuf> = BTreeMap::new();
        let mut datas: BTreeMap<u64, PathBuf> = BTreeMap::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".tmp") {
                remove_file_quiet(&path);
                continue;
            }
            let parsed = name
                .strip_suffix(".meta")
                .map(|s| (s, true))
                .or_else(|| name.strip_suffix(".bucket").map(|s| (s, false)))
                .and_then(|(id, is_meta)| id.parse::<u64>().ok().map(|id| (id, is_meta)));
            match parsed {
                Some((id, true)) => {
                    metas.insert(id, path);
                }
                Some((id, false)) => {
                    datas.insert(id, path);
                }
                None => {}
            }
        }
        let mut idx = self.index.write();
        let mut strategy = self.strategy.lock();
        let mut last = 0u64;
        for (id, data) in &datas {
            let Some(meta_path) = metas.remove(id) else {
                tracing::warn!("bucket {id} has no meta file: removing {}", data.display());
                remove_file_quiet(data);
                continue;
            };
            match self.recover_bucket(*id, data, &meta_path, &idx.objects) {
                Ok(Some(bucket)) => {
                    let bucket = Arc::new(bucket);
                    for (i, e) in bucket.entries.iter().enumerate() {
                        if bucket.state.lock().live[i] {
                            idx.objects.insert(e.key.clone(), Loc { bucket: bucket.clone(), entry: i });
                        }
                    }
                    idx.used += bucket.data_len;
                    idx.buckets.insert(*id, bucket);
                    strategy.add(*id);
                    last = last.max(*id);
                }
                Ok(None) => {
                    remove_file_quiet(&meta_path);
                    remove_file_quiet(data);
                }
                Err(e) => {
                    tracing::warn!("bucket {id} is garbage ({e}): removing it");
                    remove_file_quiet(&meta_path);
                    remove_file_quiet(data);
                }
            }
        }
        for (id, meta) in metas {
            tracing::warn!("bucket {id} has a meta file but no data: removing it");
            remove_file_quiet(&meta);
        }
        *self.last_id.lock() = last;
        Ok(())
    }

    /// Loads one bucket's meta; `Ok(None)` when nothing of it survives.
    fn recover_bucket(
        &self,
        id: u64,
        data: &Path,
        meta_path: &Path,
        known: &AHashMap<String, Loc>,
    ) -> Result<Option<Bucket>> {
        let bytes = std::fs::read(meta_path)?;
        let meta = parse_bucket_meta(&bytes)?;
        if meta.bucket_id != id {
            return Err(StorageError::corrupted(meta_path.display().to_string(), "bucket id differs from file name"));
        }
        let file_len = std::fs::metadata(data)?.len();
        let mut live = Vec::with_capacity(meta.entries.len());
        let mut changed = false;
        for e in &meta.entries {
            let intact = e.offset + e.len <= file_len;
            if !intact {
                tracing::warn!("bucket {id}: object {:?} lies past the end of the data file: dropped", e.key);
            }
            let dup = known.contains_key(&e.key);
            live.push(intact && !dup);
            changed |= !intact || dup;
        }
        if !live.iter().any(|&l| l) {
            return Ok(None);
        }
        let bucket = Bucket {
            id,
            data_len: file_len.max(align_up(meta.data_len)),
            entries: meta.entries,
            state: Mutex::new(BucketState { live, deleted: false }),
            pins: Pins::default(),
            file: Mutex::new(None),
        };
        if changed {
            self.rewrite_meta(&bucket)?;
        }
        Ok(Some(bucket))
    }

    /// Rewrites a bucket's meta file with its live entries only.
    fn rewrite_meta(&self, bucket: &Bucket) -> Result<()> {
        let state = bucket.state.lock();
        if state.deleted {
            return Ok(());
        }
        let entries: Vec<BucketEntry> =
            bucket.entries.iter().zip(&state.live).filter(|(_, &l)| l).map(|(e, _)| e.clone()).collect();
        let meta = BucketMeta { bucket_id: bucket.id, data_len: bucket.data_len, entries };
        write_file_atomic(&self.dir, &meta_name(bucket.id), &meta.encode())
    }

    fn next_id(&self) -> u64 {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut last = self.last_id.lock();
        *last = now.max(*last + 1);
        *last
    }

    fn file_of(&self, bucket: &Bucket) -> Result<Arc<IoFile>> {
        let mut cached = bucket.file.lock();
        if let Some(f) = &*cached {
            return Ok(f.clone());
        }
        let f = Arc::new(self.io.open(&data_path(&self.dir, bucket.id), OpenMode::Read)?);
        *cached = Some(f.clone());
        Ok(f)
    }

    /// Phase 1: under the index lock, evicts until `need` more bytes fit (or, with
    /// `free_at_least`, until that many bytes were freed) and reserves `need`.
    fn prepare(&self, idx: &mut Index, need: u64, free_at_least: Option<u64>) -> PendingEviction {
        let mut p = PendingEviction { buckets: Vec::new(), keys: Vec::new(), bytes: 0 };
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
            let Some(bucket) = idx.buckets.remove(&victim) else { continue };
            let state = bucket.state.lock();
            for (i, e) in bucket.entries.iter().enumerate() {
                if state.live[i] {
                    idx.objects.remove(&e.key);
                    p.keys.push(e.key.clone());
                }
            }
            drop(state);
            idx.used -= bucket.data_len;
            p.bytes += bucket.data_len;
            p.buckets.push(bucket);
        }
        idx.used += need;
        p
    }

    /// Phases 2 and 3.
    fn notify_and_finalize(&self, p: PendingEviction) -> bool {
        if p.buckets.is_empty() {
            return true;
        }
        let notified = self.notifier.notify(p.keys, p.buckets.len());
        for b in &p.buckets {
            self.delete_bucket(b);
        }
        notified
    }

    /// Finalize: waits for reads, drops the cached handle, deletes meta then data.
    fn delete_bucket(&self, b: &Bucket) {
        if !b.pins.wait_unpinned(self.eviction_wait) {
            tracing::warn!("bucket {}: reads still in flight after {:?}; deleting anyway", b.id, self.eviction_wait);
        }
        b.file.lock().take();
        let mut state = b.state.lock();
        state.deleted = true;
        remove_file_quiet(&self.dir.join(meta_name(b.id)));
        remove_file_quiet(&data_path(&self.dir, b.id));
    }

    /// Writes one bucket's files; returns its entries and data length.
    fn write_bucket(&self, id: u64, objects: &[(&str, &[u8])]) -> Result<(Vec<BucketEntry>, u64)> {
        const STAGE: usize = 8 << 20;
        const BIG: usize = 1 << 20;
        let path = data_path(&self.dir, id);
        let file = self.io.open(&path, OpenMode::Create)?;
        let mut entries = Vec::with_capacity(objects.len());
        let mut stage = AlignedBuf::zeroed(0);
        let mut stage_off = 0u64; // file offset of stage[0]
        let mut stage_len = 0usize;
        let mut off = 0u64;
        for (key, value) in objects {
            let padded = align_up(value.len() as u64);
            entries.push(BucketEntry {
                key: key.to_string(),
                offset: off,
                len: value.len() as u64,
                checksum: crc32c::crc32c(value),
            });
            if value.len() >= BIG {
                if stage_len > 0 {
                    self.io.write_at(&file, stage_off, &stage[..stage_len])?;
                    stage_len = 0;
                }
                self.io.write_at(&file, off, value)?;
            } else {
                if stage_len > 0 && stage_len + padded as usize > STAGE {
                    self.io.write_at(&file, stage_off, &stage[..stage_len])?;
                    stage_len = 0;
                }
                if stage_len == 0 {
                    stage_off = off;
                    if stage.len() < STAGE {
                        stage = AlignedBuf::zeroed(STAGE);
                    }
                }
                stage[stage_len..stage_len + value.len()].copy_from_slice(value);
                stage[stage_len + value.len()..stage_len + padded as usize].fill(0);
                stage_len += padded as usize;
            }
            off += padded;
        }
        if stage_len > 0 {
            self.io.write_at(&file, stage_off, &stage[..stage_len])?;
        }
        if file.len()? < off {
            file.set_len(off)?;
        }
        self.io.sync_data(&file)?;
        let meta = BucketMeta { bucket_id: id, data_len: off, entries };
        write_file_atomic(&self.dir, &meta_name(id), &meta.encode())?;
        Ok((meta.entries, off))
    }

    /// Splits accepted objects (indices into the batch) into buckets.
    fn group(&self, objects: &[(&str, &[u8])], accepted: &[usize]) -> Vec<Vec<usize>> {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut size = 0u64;
        for &i in accepted {
            let len = align_up(objects[i].1.len() as u64);
            let fits = groups
                .last()
                .is_some_and(|g| g.len() < self.cfg.bucket_keys_limit && size + len <= self.cfg.bucket_size_limit);
            if !fits {
                groups.push(Vec::new());
                size = 0;
            }
            groups.last_mut().expect("pushed above").push(i);
            size += len;
        }
        groups
    }
}

impl StorageBackend for BucketBackend {
    fn name(&self) -> &'static str {
        "bucket"
    }

    fn batch_offload(&self, objects: &[(&str, &[u8])]) -> Vec<Result<ObjectMeta>> {
        let mut results: Vec<Option<Result<ObjectMeta>>> =
            validate_batch(objects).into_iter().map(|e| e.map(Err)).collect();
        // reserve keys
        let mut accepted = Vec::new();
        {
            let mut idx = self.index.write();
            for (i, (k, _)) in objects.iter().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                if idx.objects.contains_key(*k) || !idx.writing.insert(k.to_string()) {
                    results[i] = Some(Err(StorageError::AlreadyExists(k.to_string())));
                } else {
                    accepted.push(i);
                }
            }
        }
        for group in self.group(objects, &accepted) {
            let size: u64 = group.iter().map(|&i| align_up(objects[i].1.len() as u64)).sum();
            let res = self.write_group(objects, &group, size);
            let mut idx = self.index.write();
            for &i in &group {
                idx.writing.remove(objects[i].0);
            }
            match res {
                Ok(bucket) => {
                    for (j, &i) in group.iter().enumerate() {
                        idx.objects.insert(objects[i].0.to_owned(), Loc { bucket: bucket.clone(), entry: j });
                        let e = &bucket.entries[j];
                        results[i] = Some(Ok(ObjectMeta { key: e.key.clone(), len: e.len, checksum: e.checksum }));
                    }
                    idx.buckets.insert(bucket.id, bucket.clone());
                    self.strategy.lock().add(bucket.id);
                    drop(idx);
                    self.notifier.supersede(group.iter().map(|&i| objects[i].0));
                }
                Err(e) => {
                    let msg = e.to_string();
                    let mut first = Some(e);
                    for &i in &group {
                        results[i] = Some(Err(first.take().unwrap_or_else(|| clone_err(&msg, objects[i].0))));
                    }
                }
            }
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(StorageError::InvalidArgument("skipped".into())))).collect()
    }

    fn object_meta(&self, key: &str) -> Option<ObjectMeta> {
        let idx = self.index.read();
        let loc = idx.objects.get(key)?;
        let e = &loc.bucket.entries[loc.entry];
        Some(ObjectMeta { key: e.key.clone(), len: e.len, checksum: e.checksum })
    }

    fn load(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        let mut reqs = [(key, buf)];
        self.batch_load(&mut reqs).pop().unwrap_or_else(|| Err(StorageError::NotFound(key.to_owned())))
    }

    fn batch_load(&self, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<usize>> {
        let mut results: Vec<Option<Result<usize>>> = (0..requests.len()).map(|_| None).collect();
        let mut pinned: Vec<(usize, ReadPin<Bucket>, usize)> = Vec::with_capacity(requests.len());
        {
            let idx = self.index.read();
            for (i, (key, buf)) in requests.iter().enumerate() {
                match idx.objects.get(*key) {
                    None => results[i] = Some(Err(StorageError::NotFound(key.to_string()))),
                    Some(loc) => {
                        let len = loc.bucket.entries[loc.entry].len;
                        if (buf.len() as u64) < len {
                            results[i] = Some(Err(StorageError::BufferTooSmall { needed: len, got: buf.len() as u64 }));
                        } else {
                            pinned.push((i, ReadPin::new(&loc.bucket), loc.entry));
                        }
                    }
                }
            }
        }
        {
            let mut strategy = self.strategy.lock();
            for (_, pin, _) in &pinned {
                strategy.record_access(pin.0.id);
            }
        }
        // open files, then one batched read
        let mut files = Vec::with_capacity(pinned.len());
        for (i, pin, _) in &pinned {
            match self.file_of(&pin.0) {
                Ok(f) => files.push(Some(f)),
                Err(e) => {
                    results[*i] = Some(Err(e));
                    files.push(None);
                }
            }
        }
        let mut ops = Vec::with_capacity(pinned.len());
        let mut op_of = Vec::with_capacity(pinned.len());
        {
            let mut bufs: Vec<Option<&mut [u8]>> = requests.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
            for ((i, pin, entry), f) in pinned.iter().zip(&files) {
                let Some(f) = f else { continue };
                let e = &pin.0.entries[*entry];
                let buf = bufs[*i].take().expect("each request once");
                ops.push(ReadOp { file: f, offset: e.offset, buf: &mut buf[..e.len as usize] });
                op_of.push((*i, pin, *entry));
            }
            let io_results = self.io.read_batch(&mut ops);
            drop(ops);
            for (r, (i, pin, entry)) in io_results.into_iter().zip(op_of) {
                let e = &pin.0.entries[entry];
                results[i] = Some(r.and_then(|()| {
                    if self.verify_on_load {
                        verify(&e.key, &requests[i].1[..e.len as usize], e.checksum)?;
                    }
                    Ok(e.len as usize)
                }));
            }
        }
        drop(pinned);
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(StorageError::InvalidArgument("skipped".into())))).collect()
    }

    fn remove(&self, key: &str) -> Result<()> {
        let (bucket, emptied) = {
            let mut idx = self.index.write();
            let loc = idx.objects.remove(key).ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
            let mut state = loc.bucket.state.lock();
            state.live[loc.entry] = false;
            let emptied = !state.live.iter().any(|&l| l);
            drop(state);
            if emptied {
                idx.buckets.remove(&loc.bucket.id);
                idx.used -= loc.bucket.data_len;
                self.strategy.lock().remove(loc.bucket.id);
            }
            (loc.bucket, emptied)
        };
        if emptied {
            self.delete_bucket(&bucket);
            Ok(())
        } else {
            self.rewrite_meta(&bucket)
        }
    }

    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize {
        let idx = self.index.read();
        let mut n = 0;
        for bucket in idx.buckets.values() {
            let state = bucket.state.lock();
            for (e, _) in bucket.entries.iter().zip(&state.live).filter(|(_, &l)| l) {
                visitor(&ObjectMeta { key: e.key.clone(), len: e.len, checksum: e.checksum });
                n += 1;
            }
        }
        n
    }

    fn stats(&self) -> BackendStats {
        let idx = self.index.read();
        BackendStats {
            backend: self.name(),
            io: self.io.name(),
            capacity: self.capacity,
            used_bytes: idx.used,
            objects: idx.objects.len() as u64,
            units: idx.buckets.len() as u64,
            evicted_objects: self.notifier.evicted_objects.load(Ordering::Relaxed),
            evicted_units: self.notifier.evicted_units.load(Ordering::Relaxed),
            pending_notifications: self.notifier.pending(),
        }
    }

    fn evict(&self, bytes: u64) -> Result<EvictionReport> {
        let p = self.prepare(&mut self.index.write(), 0, Some(bytes));
        let report = EvictionReport { keys: p.keys.clone(), bytes_freed: p.bytes, notified: true };
        let notified = self.notify_and_finalize(p);
        Ok(EvictionReport { notified, ..report })
    }

    fn retry_pending_notifications(&self) -> Result<usize> {
        self.notifier.retry()
    }
}

impl BucketBackend {
    /// Reserves space (evicting as needed) and writes one group as a new bucket.
    fn write_group(&self, objects: &[(&str, &[u8])], group: &[usize], size: u64) -> Result<Arc<Bucket>> {
        if let Some(cap) = self.capacity {
            if size > cap {
                return Err(StorageError::NoSpace { needed: size, capacity: cap });
            }
        }
        let pending = self.prepare(&mut self.index.write(), size, None);
        let over = {
            let idx = self.index.read();
            self.capacity.filter(|&c| idx.used > c)
        };
        self.notify_and_finalize(pending);
        if let Some(cap) = over {
            // concurrent writers hold the space; nothing left to evict
            self.index.write().used -= size;
            return Err(StorageError::NoSpace { needed: size, capacity: cap });
        }
        let id = self.next_id();
        let items: Vec<(&str, &[u8])> = group.iter().map(|&i| objects[i]).collect();
        match self.write_bucket(id, &items) {
            Ok((entries, data_len)) => {
                let mut idx = self.index.write();
                idx.used = idx.used - size + data_len;
                drop(idx);
                Ok(Arc::new(Bucket {
                    id,
                    data_len,
                    state: Mutex::new(BucketState { live: vec![true; entries.len()], deleted: false }),
                    entries,
                    pins: Pins::default(),
                    file: Mutex::new(None),
                }))
            }
            Err(e) => {
                self.index.write().used -= size;
                remove_file_quiet(&self.dir.join(meta_name(id)));
                remove_file_quiet(&data_path(&self.dir, id));
                Err(e)
            }
        }
    }
}

fn clone_err(msg: &str, _key: &str) -> StorageError {
    StorageError::Io(std::io::Error::other(msg.to_owned()))
}
