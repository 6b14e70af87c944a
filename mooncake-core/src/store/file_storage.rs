//! The SSD tier of a client (`FileStorage`): offload of objects from the client's
//! segment to its disk, loads back, the server other clients load from, and
//! recovery of the disk's objects on start.
//!
//! The master decides what goes to disk ([`PersistPolicy`](crate::PersistPolicy)):
//! the offload thread asks it (`offload_heartbeat`) for objects of this client's
//! segment, reads them from the segment, checks their checksum, writes them with the
//! [`StorageBackend`] and reports them (`notify_offload_success`), after which the
//! master may free their memory. Disk eviction tells the master first
//! (`batch_evict_disk_replica`, through the backend's two-phase eviction), so the
//! master never points a reader at a deleted file.
//!
//! A client reading an object that lives only on another client's disk asks that
//! client's load server (`batch_get_offload_object`): the object is read into a
//! staging region registered with the transfer engine, pulled by the reader through
//! its transfer engine, and released (the staging GC reclaims forgotten batches).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mooncake_storage::io::AlignedBuf;
use mooncake_storage::{
    direct_io_supported, io_engine, load_into_staging, BackendOptions, BackendStats, BucketBackend, BucketConfig,
    ClientBuffer, EvictionPolicy, FilePerKeyBackend, GcThread, IoKind, NotifyError, ObjectMeta, OffsetAllocatorBackend,
    StagingStats, StorageBackend, StorageError,
};
use mooncake_transfer::{RegisteredRegion, RemoteRegion, SharedSecret, TransferEngine, TransferRequest};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::master::{ClientId, MasterApi, OffloadPlan, OffloadTask};
use crate::rpc::wire::{OffloadBatch, Request, Response, WireError, DEFAULT_MAX_FRAME};
use crate::rpc::{RpcHandler, RpcMasterClient, RpcServer};

/// Most keys one `batch_get_offload_object` may ask for.
const MAX_LOAD_BATCH: usize = 4096;
/// Objects registered with the master per call when a disk is scanned.
const REGISTER_CHUNK: usize = 1024;

/// Which on-disk layout the SSD tier uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SsdBackend {
    /// Objects grouped into buckets of a data file and a meta file
    /// ([`BucketBackend`]).
    #[default]
    Bucket,
    /// One file per object ([`FilePerKeyBackend`]).
    FilePerKey,
    /// Records in one preallocated file of the tier's capacity
    /// ([`OffsetAllocatorBackend`]).
    OffsetAllocator,
}

impl std::str::FromStr for SsdBackend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "bucket" => Ok(SsdBackend::Bucket),
            "file_per_key" => Ok(SsdBackend::FilePerKey),
            "offset_allocator" => Ok(SsdBackend::OffsetAllocator),
            _ => {
                Err(Error::InvalidArgument(format!("SSD backend {s:?}: use bucket, file_per_key or offset_allocator")))
            }
        }
    }
}

/// Settings of a client's SSD tier ([`StoreBuilder::ssd_offload`](crate::StoreBuilder::ssd_offload)).
///
/// ```
/// use mooncake_core::{SsdBackend, SsdOffloadConfig, Store};
/// use mooncake_core::storage::EvictionPolicy;
///
/// let dir = std::env::temp_dir().join(format!("mooncake-doc-ssd-{}", std::process::id()));
/// let store = Store::builder()
///     .global_segment_size(8 << 20)
///     .ssd_offload(SsdOffloadConfig::new(&dir, 256 << 20).backend(SsdBackend::Bucket).eviction(EvictionPolicy::Lru))
///     .build()?;
/// store.put("block", &[1u8; 4096])?;
/// assert_eq!(store.get("block")?.len(), 4096);
/// # drop(store); std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct SsdOffloadConfig {
    /// Directory of the tier (created if missing). Reopening the same directory finds
    /// the objects written before.
    pub dir: PathBuf,
    /// Bytes the tier may use; older objects are evicted (telling the master) past it.
    pub capacity: u64,
    /// On-disk layout (default [`SsdBackend::Bucket`]).
    pub backend: SsdBackend,
    /// Which objects leave the disk first (default FIFO).
    pub eviction: EvictionPolicy,
    /// I/O engine (default `io_uring`, falling back to POSIX).
    pub io: IoKind,
    /// Use `O_DIRECT` where the filesystem supports it (default true).
    pub direct_io: bool,
    /// Bytes of the staging region remote loads are served from (default 64 MiB).
    pub staging_size: u64,
    /// A staged batch not released by its reader is reclaimed after this (default 5 s).
    pub gc_ttl: Duration,
    /// Pause between offload heartbeats when there is nothing to do (default 20 ms).
    pub heartbeat_interval: Duration,
    /// Most objects offloaded per heartbeat (default 256).
    pub offload_batch: usize,
    /// Address the load server listens on (default: the host of the transfer
    /// endpoint, any port).
    pub listen: Option<String>,
}

impl SsdOffloadConfig {
    /// A tier in `dir` of `capacity` bytes, other settings by default.
    pub fn new(dir: impl AsRef<Path>, capacity: u64) -> Self {
        Self {
            dir: dir.as_ref().to_path_buf(),
            capacity,
            backend: SsdBackend::default(),
            eviction: EvictionPolicy::default(),
            io: IoKind::default(),
            direct_io: true,
            staging_size: 64 << 20,
            gc_ttl: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(20),
            offload_batch: 256,
            listen: None,
        }
    }

    /// Sets [`backend`](Self::backend).
    pub fn backend(mut self, backend: SsdBackend) -> Self {
        self.backend = backend;
        self
    }

    /// Sets [`eviction`](Self::eviction).
    pub fn eviction(mut self, policy: EvictionPolicy) -> Self {
        self.eviction = policy;
        self
    }

    /// Sets [`io`](Self::io) and [`direct_io`](Self::direct_io).
    pub fn io(mut self, kind: IoKind, direct: bool) -> Self {
        self.io = kind;
        self.direct_io = direct;
        self
    }

    /// Sets [`staging_size`](Self::staging_size).
    pub fn staging_size(mut self, bytes: u64) -> Self {
        self.staging_size = bytes;
        self
    }

    /// Sets [`listen`](Self::listen).
    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = Some(addr.to_owned());
        self
    }

    fn check(&self) -> Result<()> {
        if self.capacity == 0 {
            return Err(Error::InvalidArgument("SSD capacity must be positive".into()));
        }
        if self.offload_batch == 0 || self.heartbeat_interval.is_zero() {
            return Err(Error::InvalidArgument("offload_batch and heartbeat_interval must be positive".into()));
        }
        Ok(())
    }
}

/// A snapshot of a client's SSD tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SsdStats {
    /// The backend's sizes and counters.
    pub backend: BackendStats,
    /// The staging region's.
    pub staging: StagingStats,
    /// Objects written to disk at the master's request and reported.
    pub offloaded_objects: u64,
    /// Bytes of those objects.
    pub offloaded_bytes: u64,
    /// Offloads skipped or failed (memory changed under them, disk errors).
    pub offload_failures: u64,
    /// Reads of this client served from its own disk.
    pub local_loads: u64,
    /// Objects staged for other clients.
    pub served_loads: u64,
    /// Files deleted because the master dropped their objects.
    pub discarded: u64,
    /// Objects found on disk at start and registered with the master.
    pub recovered: u64,
}

#[derive(Default)]
struct Counters {
    offloaded_objects: AtomicU64,
    offloaded_bytes: AtomicU64,
    offload_failures: AtomicU64,
    local_loads: AtomicU64,
    served_loads: AtomicU64,
    discarded: AtomicU64,
    recovered: AtomicU64,
}

fn inc(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

fn storage_err(e: StorageError) -> Error {
    match e {
        StorageError::NotFound(k) => Error::NotFound(k),
        StorageError::Corrupted { .. } => Error::Storage(format!("corrupted on disk: {e}")),
        other => Error::Storage(other.to_string()),
    }
}

/// The SSD tier of one client.
pub(crate) struct FileStorage {
    backend: Arc<dyn StorageBackend>,
    staging: Arc<ClientBuffer>,
    /// The load server (stops when dropped).
    server: RpcServer,
    capacity: u64,
    batch: usize,
    interval: Duration,
    counters: Arc<Counters>,
    _gc: GcThread,
}

/// Answers other clients' loads from this client's disk.
struct LoadServer {
    backend: Arc<dyn StorageBackend>,
    staging: Arc<ClientBuffer>,
    region: RemoteRegion,
    counters: Arc<Counters>,
}

impl RpcHandler for LoadServer {
    fn handle(&self, request: Request) -> Response {
        match request {
            Request::BatchGetOffloadObject { keys } => self.stage(&keys),
            Request::ReleaseOffloadBuffer { batch_id } => {
                self.staging.release(batch_id);
                Response::Unit
            }
            _ => Response::Error(WireError::InvalidArgument(
                "this is a storage node's load server: it answers only SSD loads".into(),
            )),
        }
    }
}

impl LoadServer {
    fn stage(&self, keys: &[String]) -> Response {
        if keys.is_empty() || keys.len() > MAX_LOAD_BATCH {
            return Response::Error(WireError::InvalidArgument(format!(
                "a load batch holds 1..={MAX_LOAD_BATCH} keys, not {}",
                keys.len()
            )));
        }
        let present: Vec<&str> =
            keys.iter().map(String::as_str).filter(|k| self.backend.object_meta(k).is_some()).collect();
        let lease = match load_into_staging(&*self.backend, &self.staging, &present) {
            Ok(l) => l,
            Err(e) => return Response::Error(WireError::Storage(e.to_string())),
        };
        inc(&self.counters.served_loads, present.len() as u64);
        let mut staged = present.iter().zip(&lease.locations);
        let mut next = staged.next();
        let objects = keys
            .iter()
            .map(|k| match next {
                Some((p, loc)) if *p == k.as_str() => {
                    next = staged.next();
                    Ok((loc.offset, loc.len))
                }
                _ => Err(WireError::NotFound(format!("{k} is not on this node's disk"))),
            })
            .collect();
        Response::OffloadBatch(OffloadBatch {
            batch_id: lease.batch_id,
            endpoint: self.region.endpoint.clone(),
            region: self.region.region,
            gc_ttl_ms: lease.gc_ttl_ms,
            objects,
        })
    }
}

/// Tells the master which keys disk eviction removed, before their files go.
struct EvictionNotice {
    master: Arc<dyn MasterApi>,
    client: Arc<AtomicU64>,
}

impl mooncake_storage::EvictionListener for EvictionNotice {
    fn on_evicted(&self, keys: &[String]) -> std::result::Result<(), NotifyError> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let client = self.client.load(Ordering::Acquire);
        for r in self.master.batch_evict_disk_replica(client, &refs) {
            match r {
                // The master no longer lists the replica (removed meanwhile): done.
                Ok(()) | Err(Error::NotFound(_)) => {}
                Err(e) => return Err(Box::new(e)),
            }
        }
        Ok(())
    }
}

impl FileStorage {
    /// Opens the tier: the backend on `cfg.dir` (recovering what it holds), the
    /// staging region registered with `engine`, and the load server.
    pub(crate) fn open(
        cfg: &SsdOffloadConfig,
        master: Arc<dyn MasterApi>,
        client: Arc<AtomicU64>,
        engine: &TransferEngine,
        secret: Option<&[u8]>,
    ) -> Result<Self> {
        cfg.check()?;
        std::fs::create_dir_all(&cfg.dir)
            .map_err(|e| Error::Storage(format!("cannot create {}: {e}", cfg.dir.display())))?;
        let direct = cfg.direct_io && direct_io_supported(&cfg.dir);
        let opts = BackendOptions::default()
            .with_io(io_engine(cfg.io, direct))
            .with_capacity(cfg.capacity)
            .with_eviction_boxed(cfg.eviction.build())
            .with_listener(Arc::new(EvictionNotice { master, client }));
        let backend: Arc<dyn StorageBackend> = match cfg.backend {
            SsdBackend::Bucket => {
                Arc::new(BucketBackend::open(&cfg.dir, opts, BucketConfig::default()).map_err(storage_err)?)
            }
            SsdBackend::FilePerKey => Arc::new(FilePerKeyBackend::open(&cfg.dir, opts).map_err(storage_err)?),
            SsdBackend::OffsetAllocator => {
                Arc::new(OffsetAllocatorBackend::open(&cfg.dir, cfg.capacity, opts).map_err(storage_err)?)
            }
        };
        let region: Arc<RegisteredRegion> = engine.register_region(cfg.staging_size.max(4096))?;
        let staging_region = engine.remote(region.id());
        // SAFETY: the region's mapping is page-aligned and lives as long as the `Arc`
        // handed over as owner; nothing but the staging allocator writes it (peers
        // only read it through the engine).
        let staging = Arc::new(
            unsafe {
                ClientBuffer::from_raw_parts(region.as_mut_ptr(), region.len() as usize, cfg.gc_ttl, Box::new(region))
            }
            .map_err(storage_err)?,
        );
        if cfg.io == IoKind::Uring {
            // Loads for peers then read straight into registered pages (READ_FIXED).
            staging.register_with_uring();
        }
        let gc = staging.spawn_gc(cfg.gc_ttl / 2);
        let counters = Arc::new(Counters::default());
        let listen = match &cfg.listen {
            Some(a) => a.clone(),
            None => format!("{}:0", endpoint_host(engine.endpoint())),
        };
        let handler = Arc::new(LoadServer {
            backend: backend.clone(),
            staging: staging.clone(),
            region: staging_region,
            counters: counters.clone(),
        });
        let server = RpcServer::serve(&listen, handler, DEFAULT_MAX_FRAME, secret.map(SharedSecret::new))?;
        tracing::info!(dir = %cfg.dir.display(), backend = backend.name(), direct, server = %server.local_addr(), "SSD tier open");
        Ok(Self {
            backend,
            staging,
            server,
            capacity: cfg.capacity,
            batch: cfg.offload_batch,
            interval: cfg.heartbeat_interval,
            counters,
            _gc: gc,
        })
    }

    /// Pause between idle offload heartbeats.
    pub(crate) fn interval(&self) -> Duration {
        self.interval
    }

    /// Offers the tier to the master and registers every object already on disk
    /// (at start, and again after the master restarted). Stale copies (the master
    /// holds a different object under the key) are deleted.
    pub(crate) fn announce(&self, master: &dyn MasterApi, client: ClientId) -> Result<usize> {
        let mut found: Vec<ObjectMeta> = Vec::new();
        self.backend.scan_meta(&mut |m| found.push(m.clone()));
        let mut registered = 0;
        for chunk in found.chunks(REGISTER_CHUNK) {
            let items: Vec<(&str, u64, u32)> = chunk.iter().map(|m| (m.key.as_str(), m.len, m.checksum)).collect();
            for (m, r) in chunk.iter().zip(master.register_disk_objects(client, &items)) {
                match r {
                    Ok(()) => registered += 1,
                    Err(Error::AlreadyExists(_)) | Err(Error::InvalidArgument(_)) => {
                        let _ = self.backend.remove(&m.key);
                        inc(&self.counters.discarded, 1);
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        inc(&self.counters.recovered, registered as u64);
        let endpoint = self.server.local_addr().to_string();
        master.mount_ssd(client, i64::try_from(self.capacity).unwrap_or(i64::MAX), &endpoint)?;
        if registered > 0 {
            tracing::info!(objects = registered, "objects on disk registered with the master");
        }
        Ok(registered)
    }

    /// One offload heartbeat: deletes what the master discarded, writes what it asks
    /// for (read from `segment`, checked against the checksum) and reports it.
    /// Returns how many objects were asked for.
    pub(crate) fn offload_round(
        &self,
        master: &dyn MasterApi,
        client: ClientId,
        segment: Option<(u64, &RegisteredRegion)>,
    ) -> Result<usize> {
        let OffloadPlan { tasks, discard } = master.offload_heartbeat(client, self.batch)?;
        for key in &discard {
            if self.backend.remove(key).is_ok() {
                inc(&self.counters.discarded, 1);
            }
        }
        if tasks.is_empty() {
            return Ok(0);
        }
        let asked = tasks.len();
        let objects = self.read_tasks(tasks, segment);
        let views: Vec<(&str, &[u8])> = objects.iter().map(|(t, b)| (t.key.as_str(), &b[..])).collect();
        let mut written: Vec<&OffloadTask> = Vec::with_capacity(objects.len());
        for ((task, bytes), res) in objects.iter().zip(self.backend.batch_offload(&views)) {
            match res {
                Ok(_) => written.push(task),
                Err(StorageError::AlreadyExists(_)) => {
                    // Written before (a report that got lost), or a stale copy of an
                    // older object under the same key.
                    match self.backend.object_meta(&task.key) {
                        Some(m) if m.len == task.len && m.checksum == task.checksum => written.push(task),
                        _ => {
                            let _ = self.backend.remove(&task.key);
                            match self.backend.offload(&task.key, bytes) {
                                Ok(_) => written.push(task),
                                Err(e) => self.offload_failed(&task.key, e),
                            }
                        }
                    }
                }
                Err(e) => self.offload_failed(&task.key, e),
            }
        }
        let items: Vec<(&str, u64, u32)> = written.iter().map(|t| (t.key.as_str(), t.len, t.checksum)).collect();
        for (task, r) in written.iter().zip(master.notify_offload_success(client, &items)) {
            match r {
                Ok(()) => {
                    inc(&self.counters.offloaded_objects, 1);
                    inc(&self.counters.offloaded_bytes, task.len);
                }
                // Removed (or replaced) while we wrote it: the file is an orphan.
                Err(Error::NotFound(_)) => {
                    let _ = self.backend.remove(&task.key);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(asked)
    }

    fn offload_failed(&self, key: &str, e: StorageError) {
        inc(&self.counters.offload_failures, 1);
        tracing::warn!(key, error = %e, "offload to SSD failed");
    }

    /// Copies each task's bytes out of our segment, keeping those whose bytes still
    /// match the checksum (the master leased them, so they should).
    fn read_tasks(
        &self,
        tasks: Vec<OffloadTask>,
        segment: Option<(u64, &RegisteredRegion)>,
    ) -> Vec<(OffloadTask, AlignedBuf)> {
        let Some((own, region)) = segment else { return Vec::new() };
        tasks
            .into_iter()
            .filter_map(|t| {
                if t.segment != own {
                    return None;
                }
                // Aligned, so that an `O_DIRECT` backend writes it without a bounce copy.
                let mut buf = AlignedBuf::zeroed(t.len as usize);
                if region.copy_out(t.offset, &mut buf).is_err() || crate::checksum::checksum(&buf) != t.checksum {
                    inc(&self.counters.offload_failures, 1);
                    tracing::warn!(key = t.key, "segment bytes do not match the object; not offloaded");
                    return None;
                }
                Some((t, buf))
            })
            .collect()
    }

    /// Reads several objects from this client's disk, submitted together (the
    /// `io_uring` engine reads them at queue depth up to 32).
    pub(crate) fn load_local_many(&self, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<()>> {
        let expected: Vec<usize> = requests.iter().map(|(_, d)| d.len()).collect();
        let results: Vec<Result<()>> = self
            .backend
            .batch_load(requests)
            .into_iter()
            .zip(requests.iter().zip(expected))
            .map(|(r, ((key, _), want))| match r {
                Ok(n) if n == want => Ok(()),
                Ok(n) => Err(Error::Storage(format!("{key}: {n} bytes on disk, the master says {want}"))),
                Err(e) => Err(storage_err(e)),
            })
            .collect();
        inc(&self.counters.local_loads, results.iter().filter(|r| r.is_ok()).count() as u64);
        results
    }

    /// Runs queued eviction notices again (after the master was unreachable).
    pub(crate) fn retry_notifications(&self) {
        if let Err(e) = self.backend.retry_pending_notifications() {
            tracing::debug!(error = %e, "eviction notices still pending");
        }
    }

    /// A snapshot of the tier.
    pub(crate) fn stats(&self) -> SsdStats {
        let c = &self.counters;
        SsdStats {
            backend: self.backend.stats(),
            staging: self.staging.stats(),
            offloaded_objects: c.offloaded_objects.load(Ordering::Relaxed),
            offloaded_bytes: c.offloaded_bytes.load(Ordering::Relaxed),
            offload_failures: c.offload_failures.load(Ordering::Relaxed),
            local_loads: c.local_loads.load(Ordering::Relaxed),
            served_loads: c.served_loads.load(Ordering::Relaxed),
            discarded: c.discarded.load(Ordering::Relaxed),
            recovered: c.recovered.load(Ordering::Relaxed),
        }
    }
}

/// How any client (with or without an SSD tier of its own) loads objects that live
/// only on another client's disk: through that client's load server and the
/// transfer engine.
pub(crate) struct DiskPeers {
    secret: Option<Vec<u8>>,
    /// Connections to other clients' load servers, by address.
    peers: Mutex<HashMap<String, Arc<RpcMasterClient>>>,
    /// Load-server addresses of other clients, by client id.
    peer_endpoints: Mutex<HashMap<ClientId, String>>,
    /// Objects pulled from other clients' disks.
    loads: AtomicU64,
}

impl DiskPeers {
    pub(crate) fn new(secret: Option<&[u8]>) -> Self {
        Self {
            secret: secret.map(<[u8]>::to_vec),
            peers: Mutex::new(HashMap::new()),
            peer_endpoints: Mutex::new(HashMap::new()),
            loads: AtomicU64::new(0),
        }
    }

    /// Objects pulled from other clients' disks so far.
    pub(crate) fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// Pulls several objects from the disk of `owner` with one staging round trip and
    /// one transfer batch; each destination must be exactly the object's length.
    /// The outer error is the load server's (nothing was pulled); inner ones are per
    /// object.
    pub(crate) fn load_many(
        &self,
        master: &dyn MasterApi,
        engine: &TransferEngine,
        owner: ClientId,
        requests: &mut [(&str, &mut [u8])],
    ) -> Result<Vec<Result<()>>> {
        let peer = self.peer(master, owner)?;
        let keys = requests.iter().map(|(k, _)| (*k).to_owned()).collect();
        let batch = match peer.call(&Request::BatchGetOffloadObject { keys }) {
            Ok(Response::OffloadBatch(b)) if b.objects.len() == requests.len() => b,
            Ok(Response::Error(e)) => return Err(e.into()),
            Ok(other) => return Err(Error::Storage(format!("unexpected answer of a load server: {other:?}"))),
            Err(e) => {
                // The peer may have moved (restart): ask the master again next time.
                self.peer_endpoints.lock().remove(&owner);
                return Err(e);
            }
        };
        let region = RemoteRegion { endpoint: batch.endpoint.clone(), region: batch.region };
        let mut results: Vec<Result<()>> = Vec::with_capacity(requests.len());
        let mut reads: Vec<TransferRequest<'_>> = Vec::with_capacity(requests.len());
        let mut read_of: Vec<usize> = Vec::with_capacity(requests.len());
        for (i, ((key, dst), staged)) in requests.iter_mut().zip(batch.objects).enumerate() {
            match staged {
                Ok((offset, len)) if len == dst.len() as u64 => {
                    results.push(Ok(()));
                    reads.push(TransferRequest::read(&region, offset, dst));
                    read_of.push(i);
                }
                Ok((_, len)) => results
                    .push(Err(Error::Storage(format!("{key}: {len} bytes staged, the master says {}", dst.len())))),
                Err(e) => results.push(Err(e.into())),
            }
        }
        for (res, i) in engine.transfer(&mut reads).into_iter().zip(read_of) {
            if let Err(e) = res {
                results[i] = Err(e.into());
            }
        }
        // Release at once; the GC reclaims the batch should this call be lost.
        let _ = peer.call(&Request::ReleaseOffloadBuffer { batch_id: batch.batch_id });
        let pulled = results.iter().filter(|r| r.is_ok()).count();
        self.loads.fetch_add(pulled as u64, Ordering::Relaxed);
        Ok(results)
    }

    fn peer(&self, master: &dyn MasterApi, owner: ClientId) -> Result<Arc<RpcMasterClient>> {
        let cached = self.peer_endpoints.lock().get(&owner).cloned();
        let endpoint = match cached {
            Some(e) => e,
            None => {
                // The master lists a disk replica it cannot route to: a storage
                // error for this object, not a missing one.
                let e = master.disk_endpoint(owner).map_err(|e| match e {
                    Error::NotFound(m) => Error::Storage(format!("cannot load from an SSD: {m}")),
                    e => e,
                })?;
                self.peer_endpoints.lock().insert(owner, e.clone());
                e
            }
        };
        if let Some(p) = self.peers.lock().get(&endpoint) {
            return Ok(p.clone());
        }
        let secret = self.secret.as_deref().map(SharedSecret::new);
        let p = Arc::new(RpcMasterClient::connect_with_timeout(&endpoint, secret, Duration::from_secs(10))?);
        self.peers.lock().insert(endpoint, p.clone());
        Ok(p)
    }
}

/// The host part of a `host:port` endpoint (IPv6 hosts keep their brackets); an
/// in-process endpoint (no port) serves on loopback.
fn endpoint_host(endpoint: &str) -> &str {
    match endpoint.rfind(':') {
        Some(i) if endpoint[i + 1..].parse::<u16>().is_ok() => &endpoint[..i],
        _ => "127.0.0.1",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_hosts() {
        assert_eq!(endpoint_host("10.0.0.1:1234"), "10.0.0.1");
        assert_eq!(endpoint_host("[::1]:80"), "[::1]");
        assert_eq!(endpoint_host("local://12/3"), "127.0.0.1");
    }

    #[test]
    fn backend_names_parse() {
        assert_eq!("bucket".parse::<SsdBackend>().unwrap(), SsdBackend::Bucket);
        assert_eq!("file-per-key".parse::<SsdBackend>().unwrap(), SsdBackend::FilePerKey);
        assert_eq!("offset_allocator".parse::<SsdBackend>().unwrap(), SsdBackend::OffsetAllocator);
        assert!(matches!("tape".parse::<SsdBackend>(), Err(Error::InvalidArgument(_))));
    }
}
