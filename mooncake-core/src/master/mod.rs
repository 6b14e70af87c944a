//! The master: object metadata, segments, leases, eviction and client liveness.
//!
//! The master never touches object bytes. It places replicas (through the
//! [`AllocationStrategy`](mooncake_alloc::AllocationStrategy) of its config), tracks
//! their state, grants read leases, evicts under memory pressure, and drops the
//! segments of clients that stop heartbeating.

mod api;
mod disk;
mod eviction;
mod liveness;
mod object;
mod records;
mod segment;

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::{AllocatedBuffer, AllocationError, AllocationRequest, SegmentAllocator, SegmentId};
use mooncake_transfer::RemoteRegion;
use parking_lot::{Mutex, RwLock};

use crate::config::{check_key, check_value_len, MasterConfig, ReplicateConfig};
use crate::error::{Error, Result};
use object::{ObjectEntry, ObjectIndex, StoredReplica};
use segment::{ClientRecord, MountedSegment, SegmentTable};

pub use api::{ClientRegistration, MasterApi, ObjectRecord, RecordUpdate};

pub use eviction::EvictionReport;

/// Identifier of a client of the master (random, never 0).
pub type ClientId = u64;

/// Where one replica's bytes are: `len` bytes at `offset` of segment `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MemoryReplica {
    /// Segment holding the bytes.
    pub segment: SegmentId,
    /// Offset inside the segment.
    pub offset: u64,
    /// Number of bytes (the object's length).
    pub len: u64,
}

impl MemoryReplica {
    fn of(buf: &AllocatedBuffer) -> Self {
        Self { segment: buf.segment_id(), offset: buf.offset(), len: buf.len() }
    }
}

/// The answer to a replica-list call: the complete replicas of an object and the
/// checksum its bytes must match. The object is leased for `lease`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplicaList {
    /// Object length.
    pub len: u64,
    /// crc32c of the object's bytes.
    pub checksum: u32,
    /// Complete memory replicas.
    pub replicas: Vec<MemoryReplica>,
    /// How long the object is protected from removal and eviction.
    pub lease: Duration,
    /// The client whose SSD holds a `LocalDisk` replica, if any.
    pub disk: Option<ClientId>,
}

/// What the master knows of one object.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ObjectInfo {
    /// Object length.
    pub len: u64,
    /// crc32c of its bytes.
    pub checksum: u32,
    /// Complete memory replicas.
    pub replicas: Vec<MemoryReplica>,
    /// Soft-pinned.
    pub soft_pin: bool,
    /// Milliseconds left on the current read lease (0: none).
    pub lease_ms_left: u64,
}

/// One object a client's SSD tier should write: its bytes are `len` bytes at
/// `offset` of the client's own segment `segment`, and must match `checksum`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OffloadTask {
    /// Object key.
    pub key: String,
    /// The client's segment holding a complete replica.
    pub segment: SegmentId,
    /// Offset of that replica in the segment.
    pub offset: u64,
    /// Object length.
    pub len: u64,
    /// crc32c of the object's bytes.
    pub checksum: u32,
}

/// The answer to an offload heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OffloadPlan {
    /// Objects to write to the SSD, then report with `notify_offload_success`.
    pub tasks: Vec<OffloadTask>,
    /// Keys whose disk replicas the master dropped (the objects were removed): delete them.
    pub discard: Vec<String>,
}

/// A mounted segment, as clients resolve it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// Segment id.
    pub id: SegmentId,
    /// Segment name (`endpoint#n`).
    pub name: String,
    /// Client that owns (and serves) it.
    pub owner: ClientId,
    /// Where its bytes are served.
    pub region: RemoteRegion,
    /// Bytes in the segment.
    pub capacity: u64,
}

/// What a client must do to change an object's replica count: copy the object from a
/// source replica into each target, then call
/// [`MasterService::replicate_end`]. Extra replicas were already dropped.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplicatePlan {
    /// Object length.
    pub len: u64,
    /// crc32c of the object's bytes.
    pub checksum: u32,
    /// Complete replicas to copy from (the object is leased while the plan runs).
    pub sources: Vec<MemoryReplica>,
    /// New replicas to fill; not readable until `replicate_end`.
    pub targets: Vec<MemoryReplica>,
    /// Replicas dropped to reach a lower count.
    pub dropped: usize,
}

/// Counters and gauges of the master.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MasterStats {
    /// Complete objects.
    pub objects: u64,
    /// Puts started and not yet ended.
    pub pending_puts: u64,
    /// Logical bytes of complete objects (one replica each).
    pub object_bytes: u64,
    /// Memory replicas (complete or not).
    pub replicas: u64,
    /// Registered clients.
    pub clients: u64,
    /// Mounted segments.
    pub segments: u64,
    /// Bytes of all mounted segments.
    pub capacity_bytes: u64,
    /// Bytes allocated in all mounted segments.
    pub used_bytes: u64,
    /// Worst fragmentation of any segment (0 = none, 1 = all free space in slivers).
    pub max_fragmentation: f64,
    /// Objects evicted since start.
    pub evicted_objects: u64,
    /// Bytes of memory freed by eviction since start.
    pub evicted_bytes: u64,
    /// Removes refused because of a live lease.
    pub lease_refusals: u64,
    /// Puts reclaimed after `put_timeout`.
    pub put_timeouts: u64,
    /// Clients expired after `client_ttl`.
    pub expired_clients: u64,
    /// Times the master noticed it had itself been stalled and granted a grace period.
    pub stall_graces: u64,
    /// Allocation strategy in use.
    pub allocation_strategy: String,
    /// Bytes of memory the object index uses, keys included (an estimate from the
    /// sizes of its structures: table slots, entries, replica lists, allocator nodes).
    pub metadata_bytes: u64,
    /// Bytes of keys, included in `metadata_bytes`.
    pub key_bytes: u64,
    /// Capacity and use of every mounted segment.
    pub segment_usage: Vec<SegmentUsage>,
}

/// Capacity and use of one segment.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SegmentUsage {
    /// Segment id.
    pub segment: SegmentId,
    /// Segment name.
    pub name: String,
    /// Bytes in the segment.
    pub capacity: u64,
    /// Bytes allocated.
    pub used: u64,
    /// Fragmentation of its free space (0..1).
    pub fragmentation: f64,
}

#[derive(Default)]
struct Counters {
    evicted_objects: AtomicU64,
    evicted_bytes: AtomicU64,
    lease_refusals: AtomicU64,
    put_timeouts: AtomicU64,
    expired_clients: AtomicU64,
    stall_graces: AtomicU64,
    pending_puts: AtomicU64,
}

/// The master service: an in-process object. Use it through [`Master`].
pub struct MasterService {
    config: MasterConfig,
    epoch: Instant,
    index: ObjectIndex,
    segments: RwLock<SegmentTable>,
    clients: RwLock<ahash::HashMap<ClientId, ClientRecord>>,
    next_segment: AtomicU64,
    counters: Counters,
    /// Serializes eviction passes (puts that need room wait for the running one).
    eviction: Mutex<()>,
    /// Last tick of the liveness monitor (ms), to detect that the master was stalled.
    last_tick_ms: AtomicU64,
}

/// A handle on a master service running in this process. Clones share it; the
/// service (and its background thread) stops when the last handle is dropped.
///
/// ```
/// use mooncake_core::{Master, MasterConfig, Store};
/// let master = Master::new(MasterConfig::default())?;
/// let a = Store::builder().master(&master).global_segment_size(1 << 20).build()?;
/// let b = Store::builder().master(&master).global_segment_size(1 << 20).build()?;
/// a.put("k", b"v")?;
/// assert_eq!(&b.get("k")?[..], b"v");
/// assert_eq!(master.stats().segments, 2);
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Master {
    service: Arc<MasterService>,
}

impl std::fmt::Debug for Master {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Master").field("config", &self.service.config).finish()
    }
}

impl Deref for Master {
    type Target = MasterService;
    fn deref(&self) -> &MasterService {
        &self.service
    }
}

impl Master {
    /// Starts a master service with `config` (and its monitor thread).
    pub fn new(config: MasterConfig) -> Result<Self> {
        config.check()?;
        let service = Arc::new(MasterService {
            config,
            epoch: Instant::now(),
            index: ObjectIndex::new(),
            segments: RwLock::new(SegmentTable::default()),
            clients: RwLock::new(Default::default()),
            // A random base: segment ids of a restarted master never collide with
            // the ones clients cached before the restart.
            next_segment: AtomicU64::new(((rand::random::<u32>() as u64) << 24) | 1),
            counters: Counters::default(),
            eviction: Mutex::new(()),
            last_tick_ms: AtomicU64::new(0),
        });
        liveness::spawn_monitor(&service)?;
        Ok(Self { service })
    }

    /// The service behind the handle.
    pub fn service(&self) -> &Arc<MasterService> {
        &self.service
    }
}

impl MasterService {
    /// The configuration the master runs with.
    pub fn config(&self) -> &MasterConfig {
        &self.config
    }

    /// Milliseconds since the master started.
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    // ---- clients and segments ------------------------------------------------------

    /// Registers a new client and returns its id.
    pub fn register_client(&self) -> ClientId {
        let now = self.now_ms();
        let mut clients = self.clients.write();
        loop {
            let id: ClientId = rand::random::<u64>() | 1;
            if let std::collections::hash_map::Entry::Vacant(e) = clients.entry(id) {
                e.insert(ClientRecord::new(now));
                return id;
            }
        }
    }

    /// Records a heartbeat. Fails with `MasterUnavailable` when the master no longer
    /// knows the client (it was expired): the client must register again.
    pub fn heartbeat(&self, client: ClientId) -> Result<Vec<RecordUpdate>> {
        match self.clients.read().get(&client) {
            Some(rec) => {
                rec.touch(self.now_ms());
                Ok(std::mem::take(&mut *rec.updates.lock()))
            }
            None => Err(Error::UnknownClient(client)),
        }
    }

    /// Mounts `capacity` bytes served at `region` as a segment of `client`.
    pub fn mount_segment(&self, client: ClientId, region: RemoteRegion, capacity: u64) -> Result<SegmentId> {
        if capacity == 0 {
            return Err(Error::InvalidArgument("segment of zero bytes".into()));
        }
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}#{}", region.endpoint, region.region);
        let alloc = SegmentAllocator::new(id, name, capacity);
        let mut clients = self.clients.write();
        let rec = clients.get_mut(&client).ok_or(Error::UnknownClient(client))?;
        rec.segments.push(id);
        self.segments.write().insert(MountedSegment { alloc, owner: client, region });
        tracing::debug!(segment = id, client, capacity, "segment mounted");
        Ok(id)
    }

    /// Unmounts a segment: its replicas are dropped, objects left without a replica
    /// are removed. Returns how many objects were removed.
    pub fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> Result<usize> {
        {
            let mut clients = self.clients.write();
            if let Some(rec) = clients.get_mut(&client) {
                rec.segments.retain(|&s| s != segment);
            }
        }
        let seg = {
            let mut table = self.segments.write();
            match table.by_id.get(&segment) {
                Some(s) if s.owner == client => {}
                Some(_) => {
                    return Err(Error::InvalidArgument(format!("segment {segment} is not owned by this client")))
                }
                None => return Err(Error::NotFound(format!("segment {segment}"))),
            }
            table.remove(segment)
        };
        drop(seg);
        Ok(self.drop_replicas_on(&[segment]))
    }

    /// Unregisters a client and unmounts all its segments (a clean shutdown).
    pub fn unregister_client(&self, client: ClientId) -> usize {
        self.forget_client(client)
    }

    fn forget_client(&self, client: ClientId) -> usize {
        let rec = self.clients.write().remove(&client);
        let Some(rec) = rec else { return 0 };
        {
            let mut table = self.segments.write();
            for s in &rec.segments {
                table.remove(*s);
            }
        }
        let removed = self.drop_replicas_on(&rec.segments) + self.drop_disk_replicas_of(client);
        // Puts the client started and never ended cannot end anymore.
        let removed_pending = self.retain_entries(|e| e.complete || e.owner != client, |_, _| {});
        removed + removed_pending
    }

    /// Drops every replica on `segments`; removes objects left with none. Returns the
    /// number of objects removed.
    fn drop_replicas_on(&self, segments: &[SegmentId]) -> usize {
        if segments.is_empty() {
            return 0;
        }
        let mut removed = 0;
        for shard in self.index.shards() {
            let mut shard = shard.lock();
            shard.retain(|_, e| {
                let before = e.replicas.len();
                e.replicas.retain(|r| !segments.contains(&r.segment()));
                // An object offloaded to an SSD lives on through its disk replica.
                let keep = !e.replicas.is_empty() || before == 0 || e.disk != 0;
                if !keep {
                    removed += 1;
                    if !e.complete {
                        self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                    }
                }
                keep
            });
        }
        removed
    }

    /// Removes every entry for which `keep` is false; calls `on_removed` for each.
    fn retain_entries(
        &self,
        keep: impl Fn(&ObjectEntry) -> bool,
        mut on_removed: impl FnMut(&str, &ObjectEntry),
    ) -> usize {
        let mut removed = 0;
        for shard in self.index.shards() {
            let mut shard = shard.lock();
            shard.retain(|k, e| {
                if keep(e) {
                    return true;
                }
                removed += 1;
                if !e.complete {
                    self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                }
                on_removed(k, e);
                false
            });
        }
        removed
    }

    /// Where segment `id` is served, and who owns it.
    pub fn segment_info(&self, id: SegmentId) -> Option<SegmentInfo> {
        self.segments.read().by_id.get(&id).map(|s| SegmentInfo {
            id,
            name: s.alloc.name().to_owned(),
            owner: s.owner,
            region: s.region.clone(),
            capacity: s.alloc.capacity(),
        })
    }

    fn candidates(&self) -> Arc<Vec<Arc<SegmentAllocator>>> {
        self.segments.read().candidates.clone()
    }

    // ---- puts ------------------------------------------------------------------------

    /// Phase one of a put: reserves up to `cfg.replica_num` buffers of `len` bytes on
    /// distinct segments (evicting if needed) and returns where to write them.
    pub fn put_start(
        &self,
        client: ClientId,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Result<Vec<MemoryReplica>> {
        check_key(key)?;
        check_value_len(len)?;
        cfg.check()?;
        let now = self.now_ms();
        {
            let mut shard = self.index.shard(key).lock();
            if let Some(e) = shard.get(key) {
                if e.complete || !self.put_expired(e, now) {
                    return Err(Error::AlreadyExists(key.to_owned()));
                }
                // A put that never ended: reclaim it and go on.
                shard.remove(key);
                self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                self.counters.put_timeouts.fetch_add(1, Ordering::Relaxed);
            }
        }
        let bufs = self.allocate(len, cfg, None)?;
        let replicas: Vec<MemoryReplica> = bufs.iter().map(MemoryReplica::of).collect();
        let mut shard = self.index.shard(key).lock();
        if shard.contains_key(key) {
            // Another put of the same key won the race; our buffers are freed on drop.
            return Err(Error::AlreadyExists(key.to_owned()));
        }
        shard.insert(
            key.into(),
            ObjectEntry {
                len,
                checksum: 0,
                soft_pin: cfg.soft_pin,
                complete: false,
                owner: client,
                last_access_ms: now,
                lease_until_ms: 0,
                replicas: bufs.into_iter().map(|buf| StoredReplica { buf, complete: false }).collect(),
                disk: 0,
                offload_deadline_ms: 0,
            },
        );
        self.counters.pending_puts.fetch_add(1, Ordering::Relaxed);
        Ok(replicas)
    }

    fn put_expired(&self, e: &ObjectEntry, now: u64) -> bool {
        !e.complete && now.saturating_sub(e.last_access_ms) >= self.config.put_timeout.as_millis() as u64
    }

    /// Allocates buffers for `cfg`, excluding segments in `exclude`; on lack of space,
    /// evicts and tries once more.
    fn allocate(&self, len: u64, cfg: &ReplicateConfig, exclude: Option<&[SegmentId]>) -> Result<Vec<AllocatedBuffer>> {
        let request = AllocationRequest {
            size: len,
            replica_num: cfg.replica_num,
            preferred_segments: cfg.preferred_segments.clone(),
        };
        let strategy = &self.config.allocation_strategy;
        let mut evictions = 0;
        let mut wait_until: Option<Instant> = None;
        loop {
            let mut candidates = self.candidates();
            if let Some(ex) = exclude {
                candidates = Arc::new(candidates.iter().filter(|s| !ex.contains(&s.id())).cloned().collect());
            }
            if candidates.is_empty() {
                return Err(Error::NoSpace(if exclude.is_some() {
                    "no other segment is mounted".into()
                } else {
                    "no segment is mounted".into()
                }));
            }
            let metrics = disk::MasterSsdMetrics(self);
            let ssd: Option<&dyn mooncake_alloc::SsdMetricsProvider> =
                if strategy.uses_ssd_metrics() { Some(&metrics) } else { None };
            match strategy.allocate(&request, &candidates, ssd) {
                Ok(bufs) => return Ok(bufs),
                // Eviction frees whole objects wherever they are; a fragmented or
                // unlucky segment may need more than one round.
                Err(AllocationError::NoSpace { .. }) if evictions < 8 => {
                    let want = len.saturating_mul(cfg.replica_num as u64);
                    let report = self.evict_for(want);
                    if report.freed_bytes > 0 {
                        evictions += 1;
                        continue;
                    }
                    // Everything evictable is on its way to an SSD: wait for the
                    // offloads to land (bounded), then evict their memory.
                    let until = *wait_until.get_or_insert_with(|| Instant::now() + self.config.offload_wait);
                    if report.awaiting_offload == 0 || Instant::now() >= until {
                        return Err(Error::NoSpace(format!(
                            "no segment has {len} free bytes and nothing can be evicted{}",
                            if report.awaiting_offload > 0 { " (offloads to SSD did not finish in time)" } else { "" }
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Phase two of a put: the bytes are written; the object becomes readable.
    pub fn put_end(&self, client: ClientId, key: &str, checksum: u32) -> Result<()> {
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        match shard.get_mut(key) {
            Some(e) if !e.complete && e.owner == client => {
                e.complete = true;
                e.checksum = checksum;
                e.last_access_ms = now;
                for r in &mut e.replicas {
                    r.complete = true;
                }
                self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                self.note_added(key, e, None);
                let first = e.replicas.first().map(|r| r.segment());
                drop(shard);
                self.offload_on_put(key, first);
                Ok(())
            }
            Some(e) if e.complete => Err(Error::AlreadyExists(key.to_owned())),
            _ => Err(Error::NotFound(format!("{key} (no put in progress by this client)"))),
        }
    }

    /// Abandons a put: its buffers are freed.
    pub fn put_revoke(&self, client: ClientId, key: &str) -> Result<()> {
        let mut shard = self.index.shard(key).lock();
        match shard.get(key) {
            Some(e) if !e.complete && e.owner == client => {
                shard.remove(key);
                self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                Ok(())
            }
            _ => Err(Error::NotFound(format!("{key} (no put in progress by this client)"))),
        }
    }

    /// [`put_start`](Self::put_start) for many keys; one result per key.
    pub fn batch_put_start(
        &self,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        items.iter().map(|(k, len)| self.put_start(client, k, *len, cfg)).collect()
    }

    /// [`put_end`](Self::put_end) for many keys; one result per key.
    pub fn batch_put_end(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        items.iter().map(|(k, c)| self.put_end(client, k, *c)).collect()
    }

    /// [`put_revoke`](Self::put_revoke) for many keys; one result per key.
    pub fn batch_put_revoke(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        keys.iter().map(|k| self.put_revoke(client, k)).collect()
    }

    // ---- reads -----------------------------------------------------------------------

    /// The complete replicas of `key`, and a lease of `default_lease` on the object.
    pub fn get_replica_list(&self, key: &str) -> Result<ReplicaList> {
        check_key(key)?;
        let now = self.now_ms();
        let lease = self.config.default_lease;
        let mut shard = self.index.shard(key).lock();
        match shard.get_mut(key) {
            Some(e) if e.complete => {
                e.lease_until_ms = e.lease_until_ms.max(now + lease.as_millis() as u64);
                e.last_access_ms = now;
                Ok(ReplicaList {
                    len: e.len,
                    checksum: e.checksum,
                    replicas: e.replicas.iter().filter(|r| r.complete).map(|r| MemoryReplica::of(&r.buf)).collect(),
                    lease,
                    disk: (e.disk != 0).then_some(e.disk),
                })
            }
            _ => Err(Error::NotFound(key.to_owned())),
        }
    }

    /// [`get_replica_list`](Self::get_replica_list) for many keys.
    pub fn batch_get_replica_list(&self, keys: &[&str]) -> Vec<Result<ReplicaList>> {
        keys.iter().map(|k| self.get_replica_list(k)).collect()
    }

    /// What the master knows of `key` (no lease is granted).
    pub fn object_info(&self, key: &str) -> Result<ObjectInfo> {
        check_key(key)?;
        let now = self.now_ms();
        match self.index.shard(key).lock().get(key) {
            Some(e) if e.complete => Ok(ObjectInfo {
                len: e.len,
                checksum: e.checksum,
                replicas: e.replicas.iter().filter(|r| r.complete).map(|r| MemoryReplica::of(&r.buf)).collect(),
                soft_pin: e.soft_pin,
                lease_ms_left: e.lease_until_ms.saturating_sub(now),
            }),
            _ => Err(Error::NotFound(key.to_owned())),
        }
    }

    /// Whether a complete object is stored under `key`.
    pub fn exists(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        Ok(self.index.shard(key).lock().get(key).is_some_and(|e| e.complete))
    }

    /// [`exists`](Self::exists) for many keys.
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        keys.iter().map(|k| self.exists(k)).collect()
    }

    // ---- removal ---------------------------------------------------------------------

    /// Removes a complete object; fails with `HasLease` while a reader holds a lease.
    pub fn remove(&self, key: &str) -> Result<()> {
        check_key(key)?;
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        match shard.get(key) {
            Some(e) if e.complete && e.leased(now) => {
                self.counters.lease_refusals.fetch_add(1, Ordering::Relaxed);
                Err(Error::HasLease(key.to_owned()))
            }
            Some(e) if e.complete => {
                if let Some(e) = shard.remove(key) {
                    self.note_removed(key, &e.replicas);
                    self.release_disk(key, &e);
                }
                Ok(())
            }
            _ => Err(Error::NotFound(key.to_owned())),
        }
    }

    /// [`remove`](Self::remove) for many keys.
    pub fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>> {
        keys.iter().map(|k| self.remove(k)).collect()
    }

    /// Removes every complete object without a live lease; returns how many.
    pub fn remove_all(&self) -> usize {
        let now = self.now_ms();
        let refused = std::cell::Cell::new(0u64);
        let removed = self.retain_entries(
            |e| {
                let leased = e.complete && e.leased(now);
                refused.set(refused.get() + u64::from(leased));
                !e.complete || leased
            },
            |k, e| {
                self.note_removed(k, &e.replicas);
                self.release_disk(k, e);
            },
        );
        self.counters.lease_refusals.fetch_add(refused.get(), Ordering::Relaxed);
        removed
    }

    // ---- replica count ---------------------------------------------------------------

    /// Starts changing the number of memory replicas of `key` to `cfg.replica_num`:
    /// drops extra replicas at once (refused with `HasLease` while leased), or
    /// reserves new ones on segments that hold none, for the caller to fill.
    pub fn replicate_start(&self, client: ClientId, key: &str, cfg: &ReplicateConfig) -> Result<ReplicatePlan> {
        check_key(key)?;
        cfg.check()?;
        let now = self.now_ms();
        let (have, held_on, len) = {
            let mut shard = self.index.shard(key).lock();
            let e = match shard.get_mut(key) {
                Some(e) if e.complete => e,
                _ => return Err(Error::NotFound(key.to_owned())),
            };
            let have = e.replicas.iter().filter(|r| r.complete).count();
            if have > cfg.replica_num {
                if e.leased(now) {
                    self.counters.lease_refusals.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::HasLease(key.to_owned()));
                }
                let mut dropped = 0;
                while e.replicas.iter().filter(|r| r.complete).count() > cfg.replica_num {
                    if let Some(i) = e.replicas.iter().rposition(|r| r.complete) {
                        let gone = e.replicas.remove(i);
                        self.note_removed(key, [&gone]);
                        dropped += 1;
                    }
                }
                e.soft_pin = cfg.soft_pin;
                return Ok(ReplicatePlan {
                    len: e.len,
                    checksum: e.checksum,
                    sources: vec![],
                    targets: vec![],
                    dropped,
                });
            }
            e.soft_pin = cfg.soft_pin;
            if have == cfg.replica_num || e.replicas.len() > have {
                // Nothing to do, or another replicate is filling replicas right now.
                return Ok(ReplicatePlan {
                    len: e.len,
                    checksum: e.checksum,
                    sources: vec![],
                    targets: vec![],
                    dropped: 0,
                });
            }
            let held: Vec<SegmentId> = e.replicas.iter().map(|r| r.segment()).collect();
            (have, held, e.len)
        };
        let extra = ReplicateConfig { replica_num: cfg.replica_num - have, ..cfg.clone() };
        let bufs = self.allocate(len, &extra, Some(&held_on))?;
        let mut shard = self.index.shard(key).lock();
        let e = match shard.get_mut(key) {
            Some(e) if e.complete => e,
            _ => return Err(Error::NotFound(key.to_owned())),
        };
        // Sources must stay put while the client copies from them.
        e.lease_until_ms = e.lease_until_ms.max(now + self.config.put_timeout.as_millis() as u64);
        let sources = e.replicas.iter().filter(|r| r.complete).map(|r| MemoryReplica::of(&r.buf)).collect();
        let targets = bufs.iter().map(MemoryReplica::of).collect();
        e.replicas.extend(bufs.into_iter().map(|buf| StoredReplica { buf, complete: false }));
        let _ = client;
        Ok(ReplicatePlan { len: e.len, checksum: e.checksum, sources, targets, dropped: 0 })
    }

    /// Ends a replicate: the targets become readable (`ok`) or are freed (`!ok`).
    pub fn replicate_end(&self, key: &str, targets: &[MemoryReplica], ok: bool) -> Result<()> {
        let mut shard = self.index.shard(key).lock();
        let e = shard.get_mut(key).ok_or_else(|| Error::NotFound(key.to_owned()))?;
        let is_target = |r: &StoredReplica| !r.complete && targets.contains(&MemoryReplica::of(&r.buf));
        if ok {
            for r in e.replicas.iter_mut().filter(|r| is_target(r)) {
                r.complete = true;
            }
            self.note_added(key, e, Some(targets));
        } else {
            e.replicas.retain(|r| !is_target(r));
        }
        // The copy lease is over; readers still get their own leases.
        e.lease_until_ms = e.lease_until_ms.min(self.now_ms() + self.config.default_lease.as_millis() as u64);
        Ok(())
    }

    // ---- stats -----------------------------------------------------------------------

    /// Counters and gauges of the master (walks the index: not for hot paths).
    pub fn stats(&self) -> MasterStats {
        let (mut objects, mut object_bytes, mut replicas) = (0u64, 0u64, 0u64);
        let (mut metadata_bytes, mut key_bytes) = (0u64, 0u64);
        for shard in self.index.shards() {
            let shard = shard.lock();
            metadata_bytes += object::table_bytes(&shard);
            for (k, e) in shard.iter() {
                key_bytes += k.len() as u64;
                metadata_bytes += k.len() as u64 + object::entry_heap_bytes(e);
                replicas += e.replicas.len() as u64;
                if e.complete {
                    objects += 1;
                    object_bytes += e.len;
                }
            }
        }
        let table = self.segments.read();
        // One allocator report per segment (each takes the segment's lock).
        let segment_usage: Vec<SegmentUsage> = table
            .candidates
            .iter()
            .map(|s| SegmentUsage {
                segment: s.id(),
                name: s.name().to_owned(),
                capacity: s.capacity(),
                used: s.used_bytes(),
                fragmentation: s.report().fragmentation,
            })
            .collect();
        let c = &self.counters;
        MasterStats {
            metadata_bytes,
            key_bytes,
            objects,
            pending_puts: c.pending_puts.load(Ordering::Relaxed),
            object_bytes,
            replicas,
            clients: self.clients.read().len() as u64,
            segments: table.by_id.len() as u64,
            capacity_bytes: table.capacity(),
            used_bytes: table.used(),
            max_fragmentation: segment_usage.iter().map(|u| u.fragmentation).fold(0.0, f64::max),
            evicted_objects: c.evicted_objects.load(Ordering::Relaxed),
            evicted_bytes: c.evicted_bytes.load(Ordering::Relaxed),
            lease_refusals: c.lease_refusals.load(Ordering::Relaxed),
            put_timeouts: c.put_timeouts.load(Ordering::Relaxed),
            expired_clients: c.expired_clients.load(Ordering::Relaxed),
            stall_graces: c.stall_graces.load(Ordering::Relaxed),
            allocation_strategy: self.config.allocation_strategy.name().to_owned(),
            segment_usage,
        }
    }
}
