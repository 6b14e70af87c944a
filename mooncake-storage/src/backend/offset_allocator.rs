//! [`OffsetAllocatorBackend`]: records in one preallocated file.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ahash::{AHashMap, AHashSet};
use mooncake_offset_allocator::{Allocation, OffsetAllocator};
use parking_lot::{Mutex, RwLock};
use xxhash_rust::xxh64::xxh64;

use super::files::{sync_dir, write_file_atomic};
use super::skeleton::{
    batch_results, checked_load, split_generations, validate_batch, BackendCore, Layout, Pinned, Pins, ReadPin, Usage,
    Victims,
};
use super::{BackendOptions, BackendStats, DiskEvictionReport, ObjectMeta, StorageBackend};
use crate::error::{Result, StorageError};
use crate::eviction::{UnitId, UnitInfo};
use crate::io::{AlignedBuf, IoFile, OpenMode, ReadOp, IO_ALIGN};
use crate::meta::{
    align_up, has_record_header_magic, parse_record_header_at, RecordBinding, RecordHeader, DISK_ALIGN,
    RECORD_HEADER_FIXED,
};

/// Number of index shards.
const SHARDS: usize = 1024;
/// Name of the data file.
const DATA_FILE: &str = "kv_cache.data";
/// Name of the file that holds the data file's salt and how far its records are
/// bound to it (see [`Format`]).
const FORMAT_FILE: &str = "kv_cache.format";
const FORMAT_MAGIC: &[u8; 8] = b"MCOAFMT1";
const FORMAT_LEN: usize = 8 + 4 + 8 + 4;

/// How far the records of a data file are bound to their places (version-3
/// headers, [`RecordBinding`]): the state kept in [`FORMAT_FILE`] with the salt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Binding {
    /// No format file: a data file written before records were bound. Its
    /// (unbound) records are read once, then bound.
    Legacy,
    /// Binding under way: bound and unbound records both count.
    Migrating = 1,
    /// Every record is bound: a header counts only where it was written.
    Bound = 2,
}

/// The data file's salt and [`Binding`] state.
#[derive(Clone, Copy, Debug)]
struct Format {
    salt: u64,
    binding: Binding,
}

impl Format {
    /// `magic | state u32 | salt u64 | crc32c u32 of the bytes before`.
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FORMAT_LEN);
        out.extend_from_slice(FORMAT_MAGIC);
        out.extend_from_slice(&(self.binding as u32).to_le_bytes());
        out.extend_from_slice(&self.salt.to_le_bytes());
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// The format file's content; an error for anything this build did not write.
    fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |detail: &str| StorageError::corrupted(FORMAT_FILE, detail.to_owned());
        if bytes.len() != FORMAT_LEN || &bytes[..8] != FORMAT_MAGIC {
            return Err(bad("not a format file of this layout (bad length or magic)"));
        }
        let crc = u32::from_le_bytes(bytes[20..24].try_into().expect("4 bytes"));
        if crc != crc32c::crc32c(&bytes[..20]) {
            return Err(bad("checksum mismatch"));
        }
        let binding = match u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")) {
            1 => Binding::Migrating,
            2 => Binding::Bound,
            n => return Err(bad(&format!("unknown state {n}"))),
        };
        Ok(Format { salt: u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes")), binding })
    }

    /// The format of the data file in `dir`: read from its format file, or, where
    /// there is none, a new salt and `fresh` (a data file just created) or
    /// [`Binding::Legacy`]. A format file that cannot be read refuses the open: its
    /// records cannot be told from bytes that look like records.
    fn load(dir: &Path, fresh: bool) -> Result<Self> {
        match std::fs::read(dir.join(FORMAT_FILE)) {
            Ok(bytes) => Format::decode(&bytes),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Ok(Format { salt: random_salt(), binding: if fresh { Binding::Bound } else { Binding::Legacy } })
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Writes the format file (atomically and durably).
    fn store(&self, dir: &Path) -> Result<()> {
        write_file_atomic(dir, FORMAT_FILE, &self.encode())
    }
}

/// 64 bits nobody can predict: SipHash, under a key the standard library draws from
/// the OS at random, of the time and the process.
fn random_salt() -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), (nanos, std::process::id()))
}
const SCAN_CHUNK: usize = 8 << 20;

/// A record in the data file: the unit of eviction of this layout.
pub(super) struct Rec {
    unit: UnitId,
    meta: ObjectMeta,
    offset: u64,
    value_offset: u64,
    alloc: Mutex<Option<Allocation>>,
    pins: Pins,
    /// Its header is wiped and synced already (a remove does that at once).
    wiped: std::sync::atomic::AtomicBool,
}

impl Rec {
    /// Bytes of the record's allocation (0 once freed).
    fn size(&self) -> u64 {
        self.alloc.lock().as_ref().map_or(0, |a| a.size())
    }
}

impl Pinned for Rec {
    fn pins(&self) -> &Pins {
        &self.pins
    }
}

/// One of the 1024 index shards.
type Shard = RwLock<AHashMap<String, Arc<Rec>>>;

/// Locked before the eviction strategy and the index shards, never after them.
struct Control {
    units: AHashMap<UnitId, String>,
    writing: AHashSet<String>,
}

/// Records in one preallocated file.
///
/// All objects share `<dir>/kv_cache.data`, whose space is managed by an
/// [`OffsetAllocator`] with 4 KiB alignment. The index is sharded over 1024 maps (by
/// xxh64 of the key), each behind its own lock.
///
/// # On-disk format
///
/// Each record starts at a 4 KiB-aligned offset:
///
/// ```text
/// [ RecordHeader: magic "MCOH" | version u16 | flags u16 | key_len u32 | value_crc u32
///                 | value_len u64 | seq u64 | generation u64 (version 2) | header_crc u32 | key ]
/// [ zero padding to the next 4 KiB boundary ]
/// [ value (value_len bytes) ]
/// ```
///
/// i.e. the C++ Mooncake store's `[key_len | value_len | key | value]` plus a magic,
/// the value's crc32c, a write sequence number and a crc32c of the header and key (see
/// [`RecordHeader`]), with the value 4 KiB-aligned for `O_DIRECT`. Headers are version
/// 3: their checksum also covers a random salt of the data file (kept in
/// `<dir>/kv_cache.format`) and the record's own offset, so a header counts only
/// where this file's writer put it, never as bytes inside a value (a client's value
/// may hold anything, records included, and a removal wipes only a record's first
/// 4 KiB). A data file without a format file (written before headers were bound)
/// is read once with its version-1/2 headers, which are then rewritten bound in
/// place; a format file that cannot be read refuses the open.
///
/// **Crash safety and recovery**: a write is acknowledged after `fdatasync`. Removal
/// and eviction overwrite the record's first 4 KiB with zeros (synced) before its
/// space is freed; a remove returns once that wipe is synced (a failed one leaves the
/// object stored). Opening the file scans it (skipping holes with `SEEK_DATA`): a
/// record counts only if its header checksum holds, it fits the file, and its value
/// matches its crc32c — a torn or partial record is ignored and its space is free.
/// Of two valid records of one key the higher `seq` wins (the other is wiped).
pub struct OffsetAllocatorBackend {
    path: PathBuf,
    core: BackendCore,
    file: IoFile,
    file_size: u64,
    limit: u64,
    evict_enabled: bool,
    shards: Box<[Shard]>,
    alloc: Mutex<OffsetAllocator>,
    ctl: Mutex<Control>,
    next_seq: AtomicU64,
    next_unit: AtomicU64,
    /// Records whose reads outlived `eviction_wait`: freed once unpinned.
    deferred: Mutex<Vec<Arc<Rec>>>,
    /// The data file's salt: every record written is bound to it and its offset.
    salt: u64,
}

fn shard_of(key: &str) -> usize {
    (xxh64(key.as_bytes(), 0) % SHARDS as u64) as usize
}

fn seek_data(fd: i32, off: u64) -> Option<u64> {
    // SAFETY: lseek on a descriptor we own; no memory is involved.
    let r = unsafe { libc::lseek(fd, off as libc::off_t, libc::SEEK_DATA) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENXIO) {
            None
        } else {
            Some(off)
        }
    } else {
        Some(r as u64)
    }
}

impl OffsetAllocatorBackend {
    /// Opens (creating and preallocating if needed) `<dir>/kv_cache.data` of
    /// `file_size` bytes (rounded down to 4 KiB; an existing larger file keeps its
    /// size) and recovers every intact record in it. Eviction runs when
    /// `options.capacity` is set; the usable space is `min(capacity, file size)`.
    pub fn open(dir: impl AsRef<Path>, file_size: u64, options: BackendOptions) -> Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir)?;
        let path = dir.join(DATA_FILE);
        let exists = path.exists();
        let format = Format::load(dir, !exists)?;
        let io = options.io.clone();
        let file = io.open(&path, if exists { OpenMode::ReadWrite } else { OpenMode::Create })?;
        let mut size = file_size / DISK_ALIGN * DISK_ALIGN;
        let current = file.len()?;
        if current > size {
            size = current / DISK_ALIGN * DISK_ALIGN;
        } else if current < size {
            // SAFETY: fallocate on our descriptor; no memory is involved.
            let r = unsafe { libc::fallocate(file.fd(), 0, 0, size as libc::off_t) };
            if r != 0 {
                file.set_len(size)?;
            }
            sync_dir(dir)?;
        }
        let alloc = OffsetAllocator::with_alignment(size, DISK_ALIGN)
            .map_err(|e| StorageError::InvalidArgument(format!("data file of {size} bytes: {e}")))?;
        let b = OffsetAllocatorBackend {
            path,
            file,
            file_size: size,
            limit: options.capacity.map_or(size, |c| c.min(size)),
            evict_enabled: options.capacity.is_some(),
            shards: (0..SHARDS).map(|_| RwLock::new(AHashMap::new())).collect(),
            alloc: Mutex::new(alloc),
            ctl: Mutex::new(Control { units: AHashMap::new(), writing: AHashSet::new() }),
            next_seq: AtomicU64::new(1),
            next_unit: AtomicU64::new(1),
            deferred: Mutex::new(Vec::new()),
            salt: format.salt,
            core: BackendCore::new(options),
        };
        if !exists {
            // Before any record: the file's records are all bound from the first.
            format.store(dir)?;
        }
        b.recover(dir, format)?;
        Ok(b)
    }

    /// Path of the data file.
    pub fn data_file_path(&self) -> &Path {
        &self.path
    }

    /// Offset of `key`'s record in the data file.
    pub fn record_offset(&self, key: &str) -> Option<u64> {
        self.shards[shard_of(key)].read().get(key).map(|r| r.offset)
    }

    /// Size of the data file.
    pub fn file_size(&self) -> u64 {
        self.file_size
    }

    /// The allocator's report (fragmentation of the file's space).
    pub fn allocator_report(&self) -> mooncake_offset_allocator::AllocatorReport {
        self.alloc.lock().report()
    }

    /// Reads `[off, off+len)` of the data file, from the scan chunk when it is there.
    fn crc_of_range(&self, chunk: &[u8], chunk_start: u64, off: u64, len: u64) -> Result<u32> {
        if off >= chunk_start && off + len <= chunk_start + chunk.len() as u64 {
            let s = (off - chunk_start) as usize;
            return Ok(crc32c::crc32c(&chunk[s..s + len as usize]));
        }
        let mut crc = 0u32;
        let mut buf = AlignedBuf::zeroed(SCAN_CHUNK.min(align_up(len) as usize));
        let mut pos = 0u64;
        while pos < len {
            let n = (len - pos).min(buf.len() as u64) as usize;
            self.core.io.read_at(&self.file, off + pos, &mut buf[..n])?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            pos += n as u64;
        }
        Ok(crc)
    }

    /// Scans the file for records (see the type's documentation) and indexes them.
    /// Where the file's records are not all bound yet ([`Binding`]), the unbound
    /// ones found are rewritten bound, then the format file says so.
    fn recover(&self, dir: &Path, format: Format) -> Result<()> {
        // Records found: the header, its offset, and whether it was bound.
        let mut found: AHashMap<String, (RecordHeader, u64, bool)> = AHashMap::new();
        let mut stale: Vec<u64> = Vec::new();
        let mut chunk = AlignedBuf::zeroed(SCAN_CHUNK);
        let mut chunk_start = 0u64;
        let mut chunk_len = 0usize;
        let mut off = 0u64;
        let align = DISK_ALIGN;
        while off + align <= self.file_size {
            let need_end = (off + 2 * align).min(self.file_size);
            if off < chunk_start || need_end > chunk_start + chunk_len as u64 {
                // refill the chunk at `off`, skipping holes
                match seek_data(self.file.fd(), off) {
                    None => break,
                    Some(d) if d >= off + align => {
                        off = d / align * align;
                        continue;
                    }
                    Some(_) => {}
                }
                let n = (self.file_size - off).min(SCAN_CHUNK as u64) as usize;
                self.core.io.read_at(&self.file, off, &mut chunk[..n])?;
                chunk_start = off;
                chunk_len = n;
            }
            let at = (off - chunk_start) as usize;
            let block = &chunk[at..chunk_len];
            if has_record_header_magic(block) {
                let binding = RecordBinding { salt: format.salt, offset: off };
                // Once every record is bound, an unbound header is bytes of some
                // value (a client's), never a record.
                let parsed = parse_record_header_at(block, binding)
                    .ok()
                    .filter(|(_, bound)| *bound || format.binding != Binding::Bound);
                if let Some((h, bound)) = parsed {
                    let end = off.checked_add(h.record_len());
                    if let Some(end) = end.filter(|&e| e <= self.file_size) {
                        let crc =
                            self.crc_of_range(&chunk[..chunk_len], chunk_start, off + h.value_offset(), h.value_len)?;
                        if crc == h.value_crc {
                            match found.get(&h.key) {
                                Some((old, _, _)) if old.seq > h.seq => stale.push(off),
                                Some((_, old_off, _)) => {
                                    stale.push(*old_off);
                                    found.insert(h.key.clone(), (h, off, bound));
                                }
                                None => {
                                    found.insert(h.key.clone(), (h, off, bound));
                                }
                            }
                            off = align_up(end);
                            continue;
                        }
                        tracing::warn!("record {:?} at {off}: value checksum mismatch, ignored", h.key);
                    }
                }
            }
            off += align;
        }
        for off in stale {
            self.wipe(off)?;
        }
        let mut recs: Vec<(RecordHeader, u64, bool)> = found.into_values().collect();
        recs.sort_by_key(|(_, off, _)| *off);
        let mut alloc = self.alloc.lock();
        let mut placed = Vec::with_capacity(recs.len());
        for (h, off, bound) in recs {
            match alloc.allocate_at(off, h.record_len()) {
                Some(a) => placed.push((h, off, a, bound)),
                None => tracing::warn!("record {:?} at {off} overlaps another: ignored", h.key),
            }
        }
        drop(alloc);
        if format.binding != Binding::Bound {
            placed = self.bind_records(dir, format, placed)?;
        }
        let mut placed: Vec<(RecordHeader, u64, Allocation)> =
            placed.into_iter().map(|(h, off, a, _)| (h, off, a)).collect();
        placed.sort_by_key(|(h, _, _)| h.seq);
        let mut ctl = self.ctl.lock();
        let mut strategy = self.core.strategy.lock();
        let mut max_seq = 0;
        for (h, off, a) in placed {
            max_seq = max_seq.max(h.seq);
            let unit = self.next_unit.fetch_add(1, Ordering::Relaxed);
            let rec = Rec {
                unit,
                meta: ObjectMeta {
                    key: h.key.clone(),
                    len: h.value_len,
                    checksum: h.value_crc,
                    generation: h.generation.unwrap_or(0),
                },
                offset: off,
                value_offset: off + h.value_offset(),
                alloc: Mutex::new(Some(a)),
                pins: Pins::default(),
                wiped: Default::default(),
            };
            ctl.units.insert(unit, h.key.clone());
            strategy.add(unit, UnitInfo { bytes: rec.size(), keys: &[h.key.as_str()] });
            self.shards[shard_of(&h.key)].write().insert(h.key, Arc::new(rec));
        }
        // Saturating: a sequence number read from disk must not overflow (and panic).
        self.next_seq.store(max_seq.saturating_add(1), Ordering::Relaxed);
        Ok(())
    }

    /// Rewrites the unbound records of `placed` bound to their offsets, then
    /// records in the format file that every record is bound (the salt first, so
    /// that a crash half way leaves headers that the next open can check). A record
    /// whose bound header would not end before its value (a version-1 header with a
    /// key of 4053..=4060 bytes) is dropped.
    #[allow(clippy::type_complexity)]
    fn bind_records(
        &self,
        dir: &Path,
        format: Format,
        placed: Vec<(RecordHeader, u64, Allocation, bool)>,
    ) -> Result<Vec<(RecordHeader, u64, Allocation, bool)>> {
        if format.binding == Binding::Legacy {
            Format { binding: Binding::Migrating, ..format }.store(dir)?;
        }
        let mut kept = Vec::with_capacity(placed.len());
        let mut dropped = Vec::new();
        for (h, off, a, bound) in placed {
            if bound {
                kept.push((h, off, a, bound));
                continue;
            }
            let encoded = h.encode_bound(RecordBinding { salt: format.salt, offset: off });
            if align_up(encoded.len() as u64) != h.value_offset() {
                tracing::warn!("record {:?} at {off}: its header cannot be bound in place: dropped", h.key);
                self.wipe(off)?;
                dropped.push(a);
                continue;
            }
            let mut head = AlignedBuf::zeroed(h.value_offset() as usize);
            head[..encoded.len()].copy_from_slice(&encoded);
            self.core.io.write_at(&self.file, off, &head)?;
            kept.push((h, off, a, true));
        }
        self.core.io.sync_data(&self.file)?;
        let mut alloc = self.alloc.lock();
        for a in dropped {
            alloc.free(a);
        }
        drop(alloc);
        Format { binding: Binding::Bound, ..format }.store(dir)?;
        tracing::info!("{}: {} records bound to their places", self.path.display(), kept.len());
        Ok(kept)
    }

    /// Overwrites the first 4 KiB of a record with zeros (not synced).
    fn wipe(&self, off: u64) -> Result<()> {
        let zeros = AlignedBuf::zeroed(IO_ALIGN);
        self.core.io.write_at(&self.file, off, &zeros)
    }

    fn used(&self) -> u64 {
        self.alloc.lock().used_bytes()
    }

    /// Frees records whose reads have ended (wipes those not wiped yet, syncs, returns
    /// their space).
    fn free_records(&self, recs: &[Arc<Rec>], wait: Duration) {
        let mut freed = Vec::with_capacity(recs.len());
        let mut wiped = false;
        for r in recs {
            if r.pins.wait_unpinned(wait) {
                if !r.wiped.load(Ordering::Acquire) {
                    if let Err(e) = self.wipe(r.offset) {
                        tracing::warn!("cannot wipe record {:?}: {e}", r.meta.key);
                    }
                    wiped = true;
                }
                freed.push(r);
            } else {
                tracing::warn!("{:?}: reads in flight after {wait:?}; its space is freed later", r.meta.key);
                self.deferred.lock().push(r.clone());
            }
        }
        if freed.is_empty() {
            return;
        }
        if wiped {
            if let Err(e) = self.core.io.sync_data(&self.file) {
                tracing::warn!("sync after wiping records failed: {e}");
            }
        }
        let mut alloc = self.alloc.lock();
        for r in freed {
            if let Some(a) = r.alloc.lock().take() {
                alloc.free(a);
            }
        }
    }

    fn free_deferred(&self) {
        let ready: Vec<Arc<Rec>> = {
            let mut d = self.deferred.lock();
            if d.is_empty() {
                return;
            }
            let (ready, keep) = d.drain(..).partition(|r| r.pins.wait_unpinned(Duration::ZERO));
            *d = keep;
            ready
        };
        self.free_records(&ready, Duration::ZERO);
    }

    /// Allocates `len` bytes within the limit, evicting as needed.
    fn allocate(&self, len: u64) -> Result<Allocation> {
        if len > self.limit {
            return Err(StorageError::NoSpace { needed: len, capacity: self.limit });
        }
        loop {
            self.free_deferred();
            {
                let mut alloc = self.alloc.lock();
                if let Some(a) = alloc.allocate(len) {
                    if alloc.used_bytes() <= self.limit {
                        return Ok(a);
                    }
                    alloc.free(a);
                }
            }
            if !self.evict_enabled {
                return Err(StorageError::NoSpace { needed: len, capacity: self.limit });
            }
            let over = (self.used() + align_up(len)).saturating_sub(self.limit);
            let victims = self.select_victims(over.max(align_up(len)));
            if victims.units.is_empty() {
                return Err(StorageError::NoSpace { needed: len, capacity: self.limit });
            }
            self.notify_and_finalize(victims);
        }
    }

    fn write_record(&self, key: &str, value: &[u8], off: u64, seq: u64, generation: u64) -> Result<RecordHeader> {
        let h = RecordHeader {
            key: key.to_owned(),
            value_len: value.len() as u64,
            value_crc: crc32c::crc32c(value),
            seq,
            generation: Some(generation),
        };
        let mut head = AlignedBuf::zeroed(h.value_offset() as usize);
        let enc = h.encode_bound(RecordBinding { salt: self.salt, offset: off });
        head[..enc.len()].copy_from_slice(&enc);
        self.core.io.write_at(&self.file, off, &head)?;
        self.core.io.write_at(&self.file, off + h.value_offset(), value)?;
        Ok(h)
    }
}

impl StorageBackend for OffsetAllocatorBackend {
    fn name(&self) -> &'static str {
        "offset_allocator"
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
        {
            let mut ctl = self.ctl.lock();
            for (i, (k, _)) in objects.iter().enumerate() {
                if results[i].is_some() {
                    continue;
                }
                if self.shards[shard_of(k)].read().contains_key(*k) || !ctl.writing.insert(k.to_string()) {
                    results[i] = Some(Err(StorageError::AlreadyExists(k.to_string())));
                } else {
                    accepted.push(i);
                }
            }
        }
        let mut written: Vec<(usize, RecordHeader, Allocation)> = Vec::with_capacity(accepted.len());
        for &i in &accepted {
            let (k, v) = objects[i];
            let h_len = align_up((RECORD_HEADER_FIXED + k.len()) as u64) + v.len() as u64;
            let a = match self.allocate(h_len) {
                Ok(a) => a,
                Err(e) => {
                    results[i] = Some(Err(e));
                    continue;
                }
            };
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            match self.write_record(k, v, a.offset(), seq, gens[i]) {
                Ok(h) => written.push((i, h, a)),
                Err(e) => {
                    self.alloc.lock().free(a);
                    results[i] = Some(Err(e));
                }
            }
        }
        let synced = if written.is_empty() { Ok(()) } else { self.core.io.sync_data(&self.file) };
        let mut ctl = self.ctl.lock();
        for &i in &accepted {
            ctl.writing.remove(objects[i].0);
        }
        for (i, h, a) in written {
            if let Err(e) = &synced {
                let _ = self.wipe(a.offset());
                self.alloc.lock().free(a);
                results[i] = Some(Err(StorageError::Io(std::io::Error::other(e.to_string()))));
                continue;
            }
            let unit = self.next_unit.fetch_add(1, Ordering::Relaxed);
            let meta = ObjectMeta { key: h.key.clone(), len: h.value_len, checksum: h.value_crc, generation: gens[i] };
            let rec = Rec {
                unit,
                meta: meta.clone(),
                offset: a.offset(),
                value_offset: a.offset() + h.value_offset(),
                alloc: Mutex::new(Some(a)),
                pins: Pins::default(),
                wiped: Default::default(),
            };
            ctl.units.insert(unit, h.key.clone());
            self.core.strategy.lock().add(unit, UnitInfo { bytes: rec.size(), keys: &[h.key.as_str()] });
            self.shards[shard_of(&h.key)].write().insert(h.key, Arc::new(rec));
            results[i] = Some(Ok(meta));
        }
        drop(ctl);
        self.core.notifier.supersede(accepted.iter().map(|&i| objects[i].0));
        batch_results(results)
    }

    fn object_meta(&self, key: &str) -> Option<ObjectMeta> {
        self.shards[shard_of(key)].read().get(key).map(|r| r.meta.clone())
    }

    fn load(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        self.load_one(key, buf)
    }

    fn batch_load(&self, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<usize>> {
        let mut results: Vec<Option<Result<usize>>> = (0..requests.len()).map(|_| None).collect();
        let mut pinned: Vec<(usize, ReadPin<Rec>)> = Vec::with_capacity(requests.len());
        for (i, (key, buf)) in requests.iter().enumerate() {
            let shard = self.shards[shard_of(key)].read();
            match shard.get(*key) {
                None => results[i] = Some(Err(StorageError::NotFound(key.to_string()))),
                Some(r) if (buf.len() as u64) < r.meta.len => {
                    results[i] = Some(Err(StorageError::BufferTooSmall { needed: r.meta.len, got: buf.len() as u64 }))
                }
                Some(r) => pinned.push((i, ReadPin::new(r))),
            }
        }
        self.core.record_accesses(pinned.iter().map(|(_, pin)| pin.0.unit));
        {
            let mut bufs: Vec<Option<&mut [u8]>> = requests.iter_mut().map(|(_, b)| Some(&mut **b)).collect();
            let mut ops = Vec::with_capacity(pinned.len());
            for (i, pin) in &pinned {
                let buf = bufs[*i].take().expect("each request once");
                ops.push(ReadOp {
                    file: &self.file,
                    offset: pin.0.value_offset,
                    buf: &mut buf[..pin.0.meta.len as usize],
                });
            }
            // Each value is checked as its read completes, while the others are in flight.
            self.core.io.read_batch_each(&mut ops, &mut |j, r| {
                let (i, pin) = &pinned[j];
                let m = &pin.0.meta;
                results[*i] = Some(checked_load(self.core.verify_on_load, &m.key, m.len, m.checksum, r));
            });
        }
        drop(pinned);
        batch_results(results)
    }

    fn remove(&self, key: &str) -> Result<()> {
        let rec = {
            let mut ctl = self.ctl.lock();
            let rec =
                self.shards[shard_of(key)].write().remove(key).ok_or_else(|| StorageError::NotFound(key.to_owned()))?;
            ctl.units.remove(&rec.unit);
            self.core.strategy.lock().remove(rec.unit);
            rec
        };
        // The disk first: the record's header is wiped and synced now, before its
        // space waits for reads (which touch only the value, past the header), so a
        // remove that returns cannot come back with a crash.
        if let Err(e) = self.wipe(rec.offset).and_then(|()| self.core.io.sync_data(&self.file)) {
            // Writers insert under `ctl`: holding it, the key cannot appear meanwhile.
            let mut ctl = self.ctl.lock();
            if !self.shards[shard_of(key)].read().contains_key(key) && !ctl.writing.contains(key) {
                ctl.units.insert(rec.unit, key.to_owned());
                self.core.strategy.lock().add(rec.unit, UnitInfo { bytes: rec.size(), keys: &[key] });
                self.shards[shard_of(key)].write().insert(key.to_owned(), rec);
                return Err(e);
            }
            drop(ctl);
            // A newer record of the key is there: it wins over this one on recovery.
            self.free_records(&[rec], self.core.eviction_wait);
            return Err(e);
        }
        rec.wiped.store(true, Ordering::Release);
        self.free_records(&[rec], self.core.eviction_wait);
        Ok(())
    }

    fn scan_meta(&self, visitor: &mut dyn FnMut(&ObjectMeta)) -> usize {
        let mut n = 0;
        for shard in self.shards.iter() {
            for r in shard.read().values() {
                visitor(&r.meta);
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

impl Layout for OffsetAllocatorBackend {
    type Unit = Arc<Rec>;

    fn core(&self) -> &BackendCore {
        &self.core
    }

    /// Removes records from the index, in the strategy's order, until `bytes` are freed.
    fn select_victims(&self, bytes: u64) -> Victims<Arc<Rec>> {
        let mut ctl = self.ctl.lock();
        let mut strategy = self.core.strategy.lock();
        Victims::select(&mut **strategy, bytes, |victim, keys| {
            let key = ctl.units.remove(&victim)?;
            let rec = self.shards[shard_of(&key)].write().remove(&key)?;
            keys.push(key);
            let freed = rec.size();
            Some((rec, freed))
        })
    }

    fn finalize(&self, records: &[Arc<Rec>]) {
        self.free_records(records, self.core.eviction_wait);
    }

    fn usage(&self) -> Usage {
        let objects = self.shards.iter().map(|s| s.read().len()).sum::<usize>() as u64;
        Usage {
            capacity: Some(self.core.capacity.map_or(self.file_size, |c| c.min(self.file_size))),
            used_bytes: self.used(),
            objects,
            units: objects,
        }
    }
}
