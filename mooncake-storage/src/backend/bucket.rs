//! [`BucketBackend`]: objects grouped into buckets of a data file and a meta file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ahash::{AHashMap, AHashSet};
use parking_lot::{Mutex, RwLock};

use super::files::{remove_file_durable, remove_file_quiet, write_file_atomic};
use super::skeleton::{
    batch_results, bytes_over, checked_load, split_generations, validate_batch, BackendCore, CachedFile, Layout,
    Pinned, Pins, ReadPin, Usage, Victims,
};
use super::{BackendOptions, BackendStats, DiskEvictionReport, ObjectMeta, StorageBackend};
use crate::error::{Result, StorageError};
use crate::eviction::UnitInfo;
use crate::io::{AlignedBuf, IoFile, OpenMode, ReadOp, WriteData, WriteNext, WriteOp, WriteSource};
use crate::meta::{align_up, checked_align_up, max_bucket_meta_len, parse_bucket_meta, BucketEntry, BucketMeta};

/// Most bytes of a meta file read, whatever the configured keys per bucket: 64 MiB
/// (16,256 entries with keys of the longest length), or what the configured limit
/// writes if more. A larger file is not read (it is left on disk, not served).
const MIN_META_READ_LIMIT: u64 = 64 << 20;

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

impl BucketEntry {
    /// What the backend reports of the entry.
    fn meta(&self) -> ObjectMeta {
        ObjectMeta { key: self.key.clone(), len: self.len, checksum: self.checksum, generation: self.generation }
    }
}

/// A bucket: the unit of eviction of this layout.
pub(super) struct Bucket {
    id: u64,
    /// Bytes of the data file (with padding): what the bucket counts against capacity.
    data_len: u64,
    entries: Vec<BucketEntry>,
    /// Which entries are still stored, and whether the files are gone; also
    /// serializes meta rewrites.
    state: Mutex<BucketState>,
    pins: Pins,
    file: CachedFile,
}

struct BucketState {
    live: Vec<bool>,
    deleted: bool,
}

impl Bucket {
    /// Keys of the objects the bucket still holds.
    fn live_keys(&self) -> Vec<&str> {
        let state = self.state.lock();
        self.entries.iter().zip(&state.live).filter(|(_, &l)| l).map(|(e, _)| e.key.as_str()).collect()
    }

    /// What the eviction strategy learns of the bucket holding `keys`.
    fn info<'a>(&self, keys: &'a [&'a str]) -> UnitInfo<'a> {
        UnitInfo { bytes: self.data_len, keys }
    }
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

/// The bucket layout, the default: objects grouped into buckets.
///
/// Each bucket is two files in the backend's directory:
/// * `<id>.bucket` — the values, each starting at a 4 KiB-aligned offset (zero
///   padding between them);
/// * `<id>.meta` — a [`BucketMeta`]: keys, offsets, lengths and crc32c of every value,
///   and a crc32c of the meta file itself (format in [`BucketMeta`]).
///
/// Bucket ids are nanosecond timestamps, bumped so they strictly increase (also
/// across restarts), so id order is creation order (FIFO).
///
/// A bucket's data file is allocated at its full length (`fallocate`), then its values
/// are streamed in with up to 32 writes in flight while their checksums are computed
/// (`write_bucket`); loads check each value as its read
/// completes.
///
/// **Crash safety**: the data file is written and `fdatasync`ed before the meta file,
/// which is written to `<id>.meta.tmp`, synced and renamed into place (then the
/// directory is synced). A bucket without a valid meta file is garbage and is deleted
/// when the directory is opened; objects whose bytes lie beyond the end of a
/// (truncated) data file are dropped; every value's crc32c is checked on load. Removing
/// some keys of a bucket rewrites its meta file (atomically); removing the last one
/// deletes it (then the directory is synced); a remove returns only once that is
/// durable, and a failed one leaves the object stored. Eviction deletes the meta file
/// durably before the data file. When a key is in two buckets (a removal the disk
/// never saw), the open keeps the newer bucket's copy; a bucket that cannot be read
/// for an I/O error (not a failed check) is left on disk for the next open.
///
/// The unit of eviction is the bucket. Reads pin their bucket (an RAII read guard), so an
/// evicted bucket's files outlive every read that found it.
pub struct BucketBackend {
    dir: PathBuf,
    cfg: BucketConfig,
    core: BackendCore,
    index: RwLock<Index>,
    last_id: Mutex<u64>,
}

/// The whole of the file at `path`, if it holds at most `limit` bytes; a larger one
/// is an I/O error (`FileTooLarge`) and is not read: such a meta file is no bucket's
/// this build wrote, yet it may be one a larger `bucket_keys_limit` wrote, so it is
/// left on disk rather than deleted as garbage.
fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    // One byte more than the limit tells a larger file (also one that grew since).
    f.take(limit + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            format!("{}: a meta file of more than {limit} bytes: not read", path.display()),
        )
        .into());
    }
    Ok(bytes)
}

fn data_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id}.bucket"))
}

fn meta_name(id: u64) -> String {
    format!("{id}.meta")
}

impl BucketBackend {
    /// Opens (creating if needed) a bucket store in `dir`, recovering every intact
    /// bucket already there and deleting garbage (see [`BucketBackend`]).
    pub fn open(dir: impl AsRef<Path>, options: BackendOptions, config: BucketConfig) -> Result<Self> {
        if config.bucket_size_limit == 0 || config.bucket_keys_limit == 0 {
            return Err(StorageError::InvalidArgument("bucket limits must be positive".into()));
        }
        let dir = dir.as_ref().to_owned();
        std::fs::create_dir_all(&dir)?;
        let b = BucketBackend {
            dir,
            cfg: config,
            core: BackendCore::new(options),
            index: RwLock::new(Index::default()),
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
        let mut strategy = self.core.strategy.lock();
        // New ids must stay above every bucket on disk, kept or not.
        let last = datas.keys().chain(metas.keys()).copied().max().unwrap_or(0);
        // Newest first: when a key is in two buckets (its removal from the older one
        // did not reach the disk before a crash), the newer bucket holds its value.
        for (id, data) in datas.iter().rev() {
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
                }
                Ok(None) => {
                    remove_file_quiet(&meta_path);
                    remove_file_quiet(data);
                }
                Err(e @ StorageError::Corrupted { .. }) => {
                    tracing::warn!("bucket {id} is garbage ({e}): removing it");
                    remove_file_quiet(&meta_path);
                    remove_file_quiet(data);
                }
                Err(e) => {
                    // An I/O error (EIO, EMFILE, ENOMEM) says nothing of the bucket's
                    // contents: its files stay for the next open to try again.
                    tracing::warn!("bucket {id} cannot be read ({e}): left on disk, not served");
                }
            }
        }
        // The strategy learns the buckets oldest first (creation order, for FIFO).
        for (id, bucket) in &idx.buckets {
            strategy.add(*id, bucket.info(&bucket.live_keys()));
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
        let bytes = read_capped(meta_path, MIN_META_READ_LIMIT.max(max_bucket_meta_len(self.cfg.bucket_keys_limit)))?;
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
        let data_len = checked_align_up(meta.data_len)
            .ok_or_else(|| StorageError::corrupted(meta_path.display().to_string(), "data length overflows"))?;
        let bucket = Bucket {
            id,
            data_len: file_len.max(data_len),
            entries: meta.entries,
            state: Mutex::new(BucketState { live, deleted: false }),
            pins: Pins::default(),
            file: CachedFile::default(),
        };
        if changed {
            if let Err(e) = self.rewrite_meta(&bucket) {
                // Served as recovered; the next open drops the same entries again.
                tracing::warn!("bucket {id}: cannot rewrite its meta file without dropped entries ({e})");
            }
        }
        Ok(Some(bucket))
    }

    /// Rewrites a bucket's meta file with its live entries only.
    fn rewrite_meta(&self, bucket: &Bucket) -> Result<()> {
        self.write_meta(bucket, &bucket.state.lock())
    }

    /// Writes a bucket's meta file (atomically and durably) with the entries `state`
    /// says are live; deletes it when none is.
    fn write_meta(&self, bucket: &Bucket, state: &BucketState) -> Result<()> {
        if state.deleted {
            return Ok(());
        }
        if !state.live.iter().any(|&l| l) {
            return remove_file_durable(&self.dir.join(meta_name(bucket.id)));
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
        bucket
            .file
            .get_or_open(&self.core.open_files, || self.core.io.open(&data_path(&self.dir, bucket.id), OpenMode::Read))
    }

    /// Phase 1 under the index lock: takes buckets out of the index, in the
    /// strategy's order, until `bytes` are freed.
    fn take_victims(&self, idx: &mut Index, bytes: u64) -> Victims<Arc<Bucket>> {
        let mut strategy = self.core.strategy.lock();
        Victims::select(&mut **strategy, bytes, |victim, keys| {
            let bucket = idx.buckets.remove(&victim)?;
            let state = bucket.state.lock();
            for (i, e) in bucket.entries.iter().enumerate() {
                if state.live[i] {
                    idx.objects.remove(&e.key);
                    keys.push(e.key.clone());
                }
            }
            drop(state);
            idx.used -= bucket.data_len;
            let freed = bucket.data_len;
            Some((bucket, freed))
        })
    }

    /// Finalize: waits for reads, drops the cached handle, deletes meta then data.
    fn delete_bucket(&self, b: &Bucket) {
        let wait = self.core.eviction_wait;
        if !b.pins.wait_unpinned(wait) {
            tracing::warn!("bucket {}: reads still in flight after {wait:?}; deleting anyway", b.id);
        }
        b.file.close();
        let mut state = b.state.lock();
        state.deleted = true;
        // The meta file names the objects: its deletion must survive a power loss,
        // or evicted and removed objects come back. A data file without one is
        // garbage that the next open deletes.
        if let Err(e) = remove_file_durable(&self.dir.join(meta_name(b.id))) {
            tracing::warn!("bucket {}: cannot delete its meta file ({e}); its objects may come back on restart", b.id);
        }
        remove_file_quiet(&data_path(&self.dir, b.id));
    }

    /// Writes one bucket's files; returns its entries and data length.
    ///
    /// The data file is allocated at its full length first (so that `O_DIRECT`
    /// writes into it are overwrites, which the filesystem runs side by side), the
    /// values are streamed into it with up to `QUEUE_DEPTH` writes in flight while the
    /// checksums are computed ([`BucketWriter`]), then the data file is synced and only
    /// then the meta file written: a crash leaves no meta file naming unsynced data.
    fn write_bucket(&self, id: u64, objects: &[(&str, &[u8])], gens: &[u64]) -> Result<(Vec<BucketEntry>, u64)> {
        let path = data_path(&self.dir, id);
        let io = &self.core.io;
        let file = io.open(&path, OpenMode::Create)?;
        let total: u64 = objects.iter().map(|(_, v)| align_up(v.len() as u64)).sum();
        file.allocate(total)?;
        let mut writer = BucketWriter::new(objects);
        io.write_stream(&file, &mut writer)?;
        let (mut entries, off) = writer.finish()?;
        for (e, g) in entries.iter_mut().zip(gens) {
            e.generation = *g;
        }
        if file.len()? < off {
            file.set_len(off)?;
        }
        io.sync_data(&file)?;
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
        let items: Vec<(&str, &[u8], u64)> = objects.iter().map(|&(k, v)| (k, v, 0)).collect();
        self.batch_offload_generations(&items)
    }

    fn batch_offload_generations(&self, items: &[(&str, &[u8], u64)]) -> Vec<Result<ObjectMeta>> {
        let (objects, gens) = split_generations(items);
        let objects = &objects[..];
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
            let res = self.write_group(objects, &gens, &group, size);
            let mut idx = self.index.write();
            for &i in &group {
                idx.writing.remove(objects[i].0);
            }
            match res {
                Ok(bucket) => {
                    for (j, &i) in group.iter().enumerate() {
                        idx.objects.insert(objects[i].0.to_owned(), Loc { bucket: bucket.clone(), entry: j });
                        let e = &bucket.entries[j];
                        results[i] = Some(Ok(e.meta()));
                    }
                    idx.buckets.insert(bucket.id, bucket.clone());
                    let keys: Vec<&str> = group.iter().map(|&i| objects[i].0).collect();
                    self.core.strategy.lock().add(bucket.id, bucket.info(&keys));
                    drop(idx);
                    self.core.notifier.supersede(group.iter().map(|&i| objects[i].0));
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
        batch_results(results)
    }

    fn object_meta(&self, key: &str) -> Option<ObjectMeta> {
        let idx = self.index.read();
        let loc = idx.objects.get(key)?;
        Some(loc.bucket.entries[loc.entry].meta())
    }

    fn load(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        self.load_one(key, buf)
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
        self.core.record_accesses(pinned.iter().map(|(_, pin, _)| pin.0.id));
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
                op_of.push((*i, &pin.0.entries[*entry]));
            }
            // Each value is checked as its read completes, while the others are in flight.
            self.core.io.read_batch_each(&mut ops, &mut |j, r| {
                let (i, e) = op_of[j];
                results[i] = Some(checked_load(self.core.verify_on_load, &e.key, e.len, e.checksum, r));
            });
        }
        drop(pinned);
        batch_results(results)
    }

    fn remove(&self, key: &str) -> Result<()> {
        let loc = self.index.read().objects.get(key).cloned().ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
        let bucket = &loc.bucket;
        // The disk first: the removal is done only once the meta file without the
        // entry (or no meta file, for the last one) is durable; if that fails the
        // object stays, on disk and in the index, and the error says so.
        let emptied = {
            let mut state = bucket.state.lock();
            if state.deleted || !state.live[loc.entry] {
                return Err(StorageError::NotFound(key.to_owned()));
            }
            state.live[loc.entry] = false;
            if let Err(e) = self.write_meta(bucket, &state) {
                state.live[loc.entry] = true;
                return Err(e);
            }
            !state.live.iter().any(|&l| l)
        };
        let mut idx = self.index.write();
        if idx.objects.get(key).is_some_and(|l| Arc::ptr_eq(&l.bucket, bucket) && l.entry == loc.entry) {
            idx.objects.remove(key);
        }
        // An eviction may have taken the bucket meanwhile: then it deletes it.
        let ours = emptied && idx.buckets.remove(&bucket.id).is_some();
        if ours {
            idx.used -= bucket.data_len;
            self.core.strategy.lock().remove(bucket.id);
        }
        drop(idx);
        if ours {
            self.delete_bucket(bucket);
        }
        Ok(())
    }

    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize {
        let idx = self.index.read();
        let mut n = 0;
        for bucket in idx.buckets.values() {
            let state = bucket.state.lock();
            for (e, _) in bucket.entries.iter().zip(&state.live).filter(|(_, &l)| l) {
                visitor(&e.meta());
                n += 1;
            }
        }
        n
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

impl Layout for BucketBackend {
    type Unit = Arc<Bucket>;

    fn core(&self) -> &BackendCore {
        &self.core
    }

    fn select_victims(&self, bytes: u64) -> Victims<Arc<Bucket>> {
        self.take_victims(&mut self.index.write(), bytes)
    }

    fn finalize(&self, buckets: &[Arc<Bucket>]) {
        for b in buckets {
            self.delete_bucket(b);
        }
    }

    fn usage(&self) -> Usage {
        let idx = self.index.read();
        Usage {
            capacity: self.core.capacity,
            used_bytes: idx.used,
            objects: idx.objects.len() as u64,
            units: idx.buckets.len() as u64,
        }
    }
}

impl BucketBackend {
    /// Reserves space (evicting as needed) and writes one group as a new bucket.
    fn write_group(&self, objects: &[(&str, &[u8])], gens: &[u64], group: &[usize], size: u64) -> Result<Arc<Bucket>> {
        let capacity = self.core.capacity;
        if let Some(cap) = capacity {
            if size > cap {
                return Err(StorageError::NoSpace { needed: size, capacity: cap });
            }
        }
        let pending = {
            let mut idx = self.index.write();
            let over = bytes_over(capacity, idx.used, size);
            let victims = self.take_victims(&mut idx, over);
            idx.used += size;
            victims
        };
        let over = {
            let idx = self.index.read();
            capacity.filter(|&c| idx.used > c)
        };
        self.notify_and_finalize(pending);
        if let Some(cap) = over {
            // concurrent writers hold the space; nothing left to evict
            self.index.write().used -= size;
            return Err(StorageError::NoSpace { needed: size, capacity: cap });
        }
        let id = self.next_id();
        let items: Vec<(&str, &[u8])> = group.iter().map(|&i| objects[i]).collect();
        let item_gens: Vec<u64> = group.iter().map(|&i| gens[i]).collect();
        match self.write_bucket(id, &items, &item_gens) {
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
                    file: CachedFile::default(),
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

/// The writes of one bucket's data file, as a [`WriteSource`].
///
/// Values of [`BucketWriter::DIRECT_MIN`] bytes or more are written straight from the
/// caller's memory, each at its 4 KiB-aligned offset; the crc32c of each is computed
/// on the next call, while its write is in flight. Smaller values are packed (each
/// padded to 4 KiB) into staging buffers of [`BucketWriter::STAGE`] bytes, summed as
/// they are copied; at most [`BucketWriter::MAX_STAGES`] are in flight, the rest wait
/// for one to come back.
struct BucketWriter<'o, 'a> {
    objects: &'o [(&'a str, &'a [u8])],
    /// Next object to hand over, and its file offset.
    next: usize,
    off: u64,
    entries: Vec<BucketEntry>,
    /// Entry whose value was handed over unsummed.
    unsummed: Option<usize>,
    /// The staging buffer being filled, its file offset and bytes used.
    stage: Option<(AlignedBuf, u64, usize)>,
    /// Staging buffers back from the disk.
    spare: Vec<AlignedBuf>,
    /// Staging buffers allocated so far.
    stages: usize,
}

impl<'o, 'a> BucketWriter<'o, 'a> {
    /// Values at least this long are written from the caller's memory.
    const DIRECT_MIN: usize = 1 << 20;
    /// Bytes of one staging buffer (a multiple of 4 KiB, at least `DIRECT_MIN`).
    const STAGE: usize = 2 << 20;
    /// Most staging buffers of one bucket write.
    const MAX_STAGES: usize = 8;

    fn new(objects: &'o [(&'a str, &'a [u8])]) -> Self {
        BucketWriter {
            objects,
            next: 0,
            off: 0,
            entries: Vec::with_capacity(objects.len()),
            unsummed: None,
            stage: None,
            spare: Vec::new(),
            stages: 0,
        }
    }

    fn entry(&mut self, key: &str, len: usize, checksum: u32) {
        self.entries.push(BucketEntry {
            key: key.to_owned(),
            offset: self.off,
            len: len as u64,
            checksum,
            generation: 0,
        });
        self.off += align_up(len as u64);
    }

    /// The staging buffer, filled so far, as a write.
    fn flush_stage(&mut self) -> Option<WriteNext<'a>> {
        let (buf, offset, len) = self.stage.take()?;
        Some(WriteNext::Op(WriteOp { offset, data: WriteData::Owned { buf, len } }))
    }

    /// The entries and the data length, once every value was handed over.
    fn finish(mut self) -> Result<(Vec<BucketEntry>, u64)> {
        self.sum_pending();
        if self.next != self.objects.len() || self.stage.is_some() {
            return Err(StorageError::Io(std::io::Error::other("bucket write stream ended early")));
        }
        Ok((self.entries, self.off))
    }

    fn sum_pending(&mut self) {
        if let Some(e) = self.unsummed.take() {
            // the value is in flight meanwhile: the checksum overlaps its write
            self.entries[e].checksum = crc32c::crc32c(self.objects[e].1);
        }
    }
}

impl<'a> WriteSource<'a> for BucketWriter<'_, 'a> {
    fn next_write(&mut self) -> WriteNext<'a> {
        self.sum_pending();
        loop {
            let Some(&(key, value)) = self.objects.get(self.next) else {
                return self.flush_stage().unwrap_or(WriteNext::Done);
            };
            if value.len() >= Self::DIRECT_MIN {
                if let Some(w) = self.flush_stage() {
                    return w;
                }
                let offset = self.off;
                self.unsummed = Some(self.entries.len());
                self.entry(key, value.len(), 0);
                self.next += 1;
                return WriteNext::Op(WriteOp { offset, data: WriteData::Borrowed(value) });
            }
            let padded = align_up(value.len() as u64) as usize;
            if self.stage.as_ref().is_some_and(|(_, _, used)| used + padded > Self::STAGE) {
                return self.flush_stage().expect("checked above");
            }
            if self.stage.is_none() {
                let buf = match self.spare.pop() {
                    Some(b) => b,
                    None if self.stages < Self::MAX_STAGES => {
                        self.stages += 1;
                        AlignedBuf::zeroed(Self::STAGE)
                    }
                    None => return WriteNext::Wait,
                };
                self.stage = Some((buf, self.off, 0));
            }
            let (buf, _, used) = self.stage.as_mut().expect("set above");
            buf[*used..*used + value.len()].copy_from_slice(value);
            // zero padding: a recycled buffer holds old bytes
            buf[*used + value.len()..*used + padded].fill(0);
            *used += padded;
            // summed while it is hot in the cache, and while earlier writes are in flight
            let checksum = crc32c::crc32c(value);
            self.entry(key, value.len(), checksum);
            self.next += 1;
        }
    }

    fn recycle(&mut self, buf: AlignedBuf) {
        self.spare.push(buf);
    }
}

fn clone_err(msg: &str, _key: &str) -> StorageError {
    StorageError::Io(std::io::Error::other(msg.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(w: &mut BucketWriter<'_, '_>) -> Vec<WriteOp<'static>> {
        let mut out = Vec::new();
        loop {
            match w.next_write() {
                WriteNext::Op(op) => out.push(WriteOp {
                    offset: op.offset,
                    data: match op.data {
                        WriteData::Owned { buf, len } => WriteData::Owned { buf, len },
                        WriteData::Borrowed(b) => WriteData::Owned { buf: AlignedBuf::zeroed(b.len()), len: b.len() },
                    },
                }),
                WriteNext::Wait | WriteNext::Done => return out,
                WriteNext::Fail(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn bucket_writer_packs_small_values_and_waits_for_buffers() {
        let small = vec![7u8; 100_000];
        let big = vec![9u8; (1 << 20) + 3];
        let keys: Vec<String> = (0..400).map(|i| format!("k{i}")).collect();
        let objects: Vec<(&str, &[u8])> =
            keys.iter().enumerate().map(|(i, k)| (k.as_str(), if i == 5 { &big[..] } else { &small[..] })).collect();
        let mut w = BucketWriter::new(&objects);
        // without buffers coming back the writer stops after MAX_STAGES staging buffers
        let first = take(&mut w);
        let owned = first.iter().filter(|op| op.data_is_owned_stage()).count();
        assert_eq!(owned, BucketWriter::MAX_STAGES);
        assert!(matches!(w.next_write(), WriteNext::Wait));
        let mut ops = first;
        loop {
            // a buffer comes back: the writer goes on
            let Some(buf) = ops.iter_mut().rev().find_map(|op| op.take_stage()) else { break };
            w.recycle(buf);
            let more = take(&mut w);
            if more.is_empty() {
                break;
            }
            ops.extend(more);
        }
        let (entries, len) = w.finish().unwrap();
        assert_eq!(entries.len(), objects.len());
        for (e, (k, v)) in entries.iter().zip(&objects) {
            assert_eq!((&e.key[..], e.len, e.checksum), (*k, v.len() as u64, crc32c::crc32c(v)));
            assert_eq!(e.offset % 4096, 0);
        }
        assert_eq!(len, objects.iter().map(|(_, v)| align_up(v.len() as u64)).sum::<u64>());
    }

    impl WriteOp<'_> {
        fn data_is_owned_stage(&self) -> bool {
            matches!(&self.data, WriteData::Owned { buf, .. } if buf.len() == BucketWriter::STAGE)
        }
        fn take_stage(&mut self) -> Option<AlignedBuf> {
            if !self.data_is_owned_stage() {
                return None;
            }
            match std::mem::replace(&mut self.data, WriteData::Borrowed(&[])) {
                WriteData::Owned { buf, .. } => Some(buf),
                WriteData::Borrowed(_) => None,
            }
        }
    }
}
