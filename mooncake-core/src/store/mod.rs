//! The client: `Store` puts and gets objects through the master and the transfer
//! engine.

mod buffers;
mod builder;
#[cfg(feature = "etcd")]
pub(crate) mod cluster;
mod device;
pub(crate) mod drain;
mod file_storage;
mod leases;
mod parts;
pub(crate) mod records;
mod replica_cache;
mod stats;
mod upsert;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::{bounded, RecvTimeoutError, Sender};
use mooncake_alloc::SegmentId;
use mooncake_transfer::{RegisteredRegion, RemoteRegion, TransferEngine, TransferRequest};
use parking_lot::{Mutex, RwLock};

use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::{ClientId, Master, MasterApi, MemoryReplica, ObjectRecord, ReplicaList};
use crate::rpc::RpcServer;

pub use builder::StoreBuilder;
use file_storage::{DiskPeers, FileStorage};
pub use file_storage::{SsdBackend, SsdOffloadConfig, SsdStats};
use leases::LeaseReleaser;
use records::SegmentRecords;
use replica_cache::ReplicaCache;
use stats::StoreCounters;
pub use stats::StoreStats;

/// The client id of a store that [`Store::close`] unregistered (ids are never 0).
const CLOSED: ClientId = 0;

/// How many times a get re-asks the master after every replica failed its checksum
/// (the memory was freed and reused under a stale list).
const CHECKSUM_RETRIES: usize = 3;

/// How many times a put is placed again after writing to a segment failed (the
/// master is told, and places it elsewhere).
const PUT_ATTEMPTS: usize = 3;

/// Objects below this many bytes, moved by memory copy, are copied and summed piece by
/// piece (`TransferRequest::with_checksum`). Measured on the 2-vCPU development VM
/// (in-process `get_into`, GB/s, three runs): 2 MiB 8.7–10.8 fused vs 5.7–8.0, 4 MiB
/// 7.5–9.4 vs 5.1–7.9; but 16 MiB 3.9–5.6 vs 8.2–9.1, where summing the whole copy on
/// both cores wins. A small object stays in cache either way when read alone, but a
/// batch of them does not (64 x 256 KiB over shm: 3.2 ms per call summed after the
/// copies, 2.0 ms summed piece by piece).
const FUSED_BELOW: usize = 8 << 20;

/// A client of the store: puts and gets objects.
///
/// `Store` is `Clone + Send + Sync`; clones share one client. Dropping the last handle
/// unmounts the client's segment: objects whose only replica lived there are gone.
///
/// ```
/// use mooncake_core::{Error, Store};
///
/// let store = Store::builder().global_segment_size(16 << 20).build()?;
/// store.put("prefix/0", b"kv bytes")?;
/// assert_eq!(&store.get("prefix/0")?[..], b"kv bytes");
/// assert!(matches!(store.put("prefix/0", b"again"), Err(Error::AlreadyExists(_))));
/// let mut buf = [0u8; 64];
/// let n = store.get_into("prefix/0", &mut buf)?;
/// assert_eq!(&buf[..n], b"kv bytes");
/// store.remove("prefix/0").unwrap_or(()); // may be leased by the gets above
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone)]
pub struct Store {
    inner: Arc<StoreInner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("client", &format_args!("{:#x}", self.inner.client()))
            .field("endpoint", &self.inner.engine.endpoint())
            .finish()
    }
}

/// A new record key and the config of the record endpoint that requires it: only a
/// master we tell the key (by mounting on it) can change our records, whatever the
/// cluster's shared secret; anything else is refused and counted. With the key as
/// its secret the endpoint serves masters on any address.
fn record_endpoint_config() -> ([u8; crate::rpc::RECORD_KEY_LEN], crate::rpc::RpcServerConfig) {
    let key: [u8; crate::rpc::RECORD_KEY_LEN] = rand::random();
    let config =
        crate::rpc::RpcServerConfig { secret: Some(crate::rpc::record_endpoint_secret(&key)), ..Default::default() };
    (key, config)
}

/// Where this client serves the records of its segment to the master.
enum RecordEndpoint {
    /// A master in another process: an RPC endpoint of ours, served to whoever
    /// proves `key` (the masters we mounted on: we tell them).
    Rpc { server: RpcServer, key: [u8; crate::rpc::RECORD_KEY_LEN] },
    /// A master in this process: it calls our records directly.
    InProcess(Master),
}

/// The client's segment: registered memory and its id at the master.
struct OwnSegment {
    region: Arc<RegisteredRegion>,
    id: SegmentId,
}

struct StoreInner {
    master: Arc<dyn MasterApi>,
    /// Shared with the SSD tier's eviction notices (the id changes on re-registration).
    client: Arc<AtomicU64>,
    engine: TransferEngine,
    /// The SSD tier, if configured.
    ssd: Option<FileStorage>,
    /// Loads from other clients' SSDs.
    disk_peers: DiskPeers,
    /// Replica lists of recent gets, reused for a while (see `ReplicaCache`).
    cache: ReplicaCache,
    /// Ends the read lease of each replica list the master answered, once read.
    leases: LeaseReleaser,
    segment: Mutex<Option<OwnSegment>>,
    /// The segment id of our own segment (0: none), read on every get for locality.
    own_segment: AtomicU64,
    routes: RwLock<HashMap<SegmentId, Arc<RemoteRegion>>>,
    replicate: ReplicateConfig,
    counters: StoreCounters,
    /// The objects our segment holds, as the master told us: what we re-register if
    /// the master restarts.
    records: Arc<SegmentRecords>,
    /// Where the master tells us of changes to our records before acknowledging them.
    record_endpoint: Option<RecordEndpoint>,
    /// Longest time `flush` waits for the SSD tier.
    flush_timeout: Duration,
    /// Cluster mode: the cluster client (also `master`) and the record endpoint of our
    /// extents.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    cluster: ClusterPart,
    /// Dropping it stops the heartbeat thread.
    _heartbeat_stop: Sender<()>,
}

/// Cluster mode's part of a store (see `cluster`).
#[cfg(feature = "etcd")]
type ClusterPart = Option<(Arc<crate::cluster_client::ClusterClient>, Option<RpcServer>)>;
/// Without the `etcd` feature there is no cluster mode.
#[cfg(not(feature = "etcd"))]
type ClusterPart = Option<std::convert::Infallible>;

impl Drop for StoreInner {
    fn drop(&mut self) {
        if self.client() == CLOSED {
            return;
        }
        match self.master.unregister_client(self.client()) {
            Ok(removed) => tracing::debug!(removed, "client unregistered; segment unmounted"),
            Err(e) => tracing::warn!(error = %e, "could not unregister from the master"),
        }
    }
}

impl StoreInner {
    fn client(&self) -> ClientId {
        self.client.load(Ordering::Acquire)
    }

    /// One heartbeat: applies the master's record updates for our segment.
    fn heartbeat(&self) -> Result<()> {
        let updates = self.master.heartbeat(self.client())?;
        if !updates.is_empty() {
            self.records.apply(updates);
        }
        #[cfg(feature = "etcd")]
        if let (Some((cluster, _)), Some(ssd)) = (&self.cluster, &self.ssd) {
            // A new leader of some group: it learns of our SSD's objects again.
            if cluster.take_remounted() {
                ssd.announce(&*self.master, self.client())?;
            }
        }
        Ok(())
    }

    /// Our memory by segment id: the segment, or in a cluster the extents mounted.
    fn segment_regions(&self) -> Vec<(SegmentId, Arc<RegisteredRegion>)> {
        #[allow(unused_mut)]
        let mut regions: Vec<_> = self.segment.lock().iter().map(|s| (s.id, s.region.clone())).collect();
        #[cfg(feature = "etcd")]
        if let Some((cluster, _)) = &self.cluster {
            regions.extend(cluster.extent_regions());
        }
        regions
    }

    /// Tells the master where to send changes to our records (if we serve them).
    fn announce_records(&self, client: ClientId) -> Result<()> {
        match &self.record_endpoint {
            Some(RecordEndpoint::Rpc { server, key }) => {
                self.master.mount_records(client, &server.local_addr().to_string(), key)
            }
            Some(RecordEndpoint::InProcess(master)) => master.attach_records(client, self.records.clone()),
            None => Ok(()),
        }
    }

    /// Registers again after the master forgot us (we expired, or it restarted) and
    /// re-mounts the same memory with the objects it still holds. Records whose bytes
    /// no longer match their checksum are not offered.
    fn rejoin(&self) -> Result<()> {
        let reg = self.master.register_client()?;
        let client = reg.client;
        let mut seg = self.segment.lock();
        if let Some(s) = seg.as_mut() {
            let region = &s.region;
            let records = self.records.rejoin(|r| {
                let mut buf = vec![0u8; r.len as usize];
                region.copy_out(r.offset, &mut buf).is_ok() && crate::checksum::checksum(&buf) == r.checksum
            });
            let (id, taken) =
                self.master.remount_segment(client, &self.engine.remote(s.region.id()), s.region.len(), &records)?;
            s.id = id;
            self.own_segment.store(id, Ordering::Release);
            self.records.set_segment(id);
            tracing::warn!(segment = id, objects = taken, "segment re-mounted");
        }
        drop(seg);
        self.client.store(client, Ordering::Release);
        if let Err(e) = self.announce_records(client) {
            // Without it, the records come with the heartbeats.
            tracing::warn!(error = %e, "the master cannot reach our record endpoint");
        }
        if let Some(ssd) = &self.ssd {
            ssd.announce(&*self.master, client)?;
        }
        tracing::warn!(client = format!("{client:#x}"), "client re-registered with the master");
        Ok(())
    }

    fn route(&self, segment: SegmentId) -> Result<Arc<RemoteRegion>> {
        if let Some(r) = self.routes.read().get(&segment) {
            return Ok(r.clone());
        }
        let info = self.master.segment_info(segment)?;
        let route = Arc::new(info.region);
        self.routes.write().insert(segment, route.clone());
        Ok(route)
    }

    /// Replicas in the order to try them: our own segment first.
    fn read_order(&self, replicas: &[MemoryReplica]) -> Vec<MemoryReplica> {
        let own = self.own_segment.load(Ordering::Acquire);
        let mut order = replicas.to_vec();
        order.sort_by_key(|r| r.segment != own);
        order
    }

    /// Reads the object of `list` into `dst` (exactly `list.len` bytes) from the first
    /// replica whose bytes match the checksum.
    fn read_replicas(&self, key: &str, list: &ReplicaList, dst: &mut [u8]) -> Result<()> {
        let memory = if list.replicas.is_empty() {
            Err(Error::NotFound(key.to_owned()))
        } else {
            self.read_memory_replicas(key, list, dst)
        };
        match (memory, list.disk) {
            (Err(e), Some(owner)) if !matches!(e, Error::BufferTooSmall { .. }) => {
                self.read_disk_replica(key, list, owner, dst).map_err(|disk| {
                    tracing::debug!(key, memory = %e, %disk, "no replica could be read");
                    disk
                })
            }
            (res, _) => res,
        }
    }

    /// Reads the `LocalDisk` replica on `owner`'s SSD: our own disk directly, another
    /// client's through its load server and our transfer engine.
    fn read_disk_replica(&self, key: &str, list: &ReplicaList, owner: ClientId, dst: &mut [u8]) -> Result<()> {
        let mut one = [(key, dst)];
        self.read_disk_many(owner, &mut one).pop().unwrap_or_else(|| Err(Error::NotFound(key.to_owned())))?;
        let dst = &one[0].1;
        if crate::checksum::checksum(dst) != list.checksum {
            StoreCounters::inc(&self.counters.checksum_mismatches, 1);
            return Err(Error::Corrupted(key.to_owned()));
        }
        Ok(())
    }

    /// Reads objects from the SSD of `owner` (ours, or another client's), each into a
    /// destination of exactly its length; checksums are the caller's to check.
    fn read_disk_many(&self, owner: ClientId, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<()>> {
        match &self.ssd {
            Some(ssd) if owner == self.client() => ssd.load_local_many(requests),
            _ => self
                .disk_peers
                .load_many(&*self.master, &self.engine, owner, requests)
                .unwrap_or_else(|e| vec![Err(e); requests.len()]),
        }
    }

    fn read_memory_replicas(&self, key: &str, list: &ReplicaList, dst: &mut [u8]) -> Result<()> {
        let mut last_err = Error::NotFound(key.to_owned());
        for r in self.read_order(&list.replicas) {
            let route = match self.route(r.segment) {
                Ok(route) => route,
                Err(e) => {
                    last_err = e;
                    continue;
                }
            };
            match self.read_summed(&route, r.offset, dst).map(|crc| crc == list.checksum) {
                Ok(true) => return Ok(()),
                Ok(false) => {
                    // The route may be stale (segment gone, master restarted).
                    self.routes.write().remove(&r.segment);
                    StoreCounters::inc(&self.counters.checksum_mismatches, 1);
                    tracing::warn!(key, segment = r.segment, "replica failed its checksum");
                    last_err = Error::Corrupted(key.to_owned());
                }
                Err(e) => {
                    self.routes.write().remove(&r.segment);
                    last_err = e;
                }
            }
        }
        Err(last_err)
    }

    /// Asks the master for `key`'s replicas and runs `read` on the list, asking again
    /// (a stale list: memory freed and reused, a segment gone) when every replica
    /// failed its checksum or could not be reached.
    fn with_replicas<T>(&self, key: &str, mut read: impl FnMut(&ReplicaList) -> Result<T>) -> Result<T> {
        check_key(key)?;
        if let Some(list) = self.cache.get(key) {
            match read(&list) {
                Ok(v) => {
                    self.cache.hit();
                    return Ok(v);
                }
                Err(e @ Error::BufferTooSmall { .. }) => return Err(e),
                // Whatever failed, the master knows better now.
                Err(_) => self.cache.forget(key),
            }
        }
        let mut attempt = 0;
        loop {
            let asked_at = std::time::Instant::now();
            let list = self.master.get_replica_list(key)?;
            let res = read(&list);
            // The read is over: its lease goes back at once.
            self.leases.release([key]);
            match res {
                Err(Error::Corrupted(_)) | Err(Error::Transport(_)) if attempt < CHECKSUM_RETRIES => attempt += 1,
                done => {
                    if done.is_ok() {
                        self.cache.insert(key, list, asked_at);
                    }
                    return done;
                }
            }
        }
    }

    fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        self.with_replicas(key, |list| {
            if list.len > buf.len() as u64 {
                return Err(Error::BufferTooSmall { needed: list.len, capacity: buf.len() as u64 });
            }
            self.read_replicas(key, list, &mut buf[..list.len as usize]).map(|()| list.len as usize)
        })
    }

    fn get(&self, key: &str) -> Result<Bytes> {
        self.with_replicas(key, |list| {
            let len = list.len as usize;
            let mut buf = buffers::take(len);
            self.read_replicas(key, list, &mut buf[..len]).map(|()| buffers::freeze(buf, len))
        })
    }

    /// A put: placed, written, ended. A segment that cannot be written to is reported
    /// to the master (which stops placing there) and the put placed again without it.
    fn put(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> Result<()> {
        check_key(key)?;
        check_value_len(value.len() as u64)?;
        // The checksum is taken as the first replica's bytes are sent where the
        // transport can (see `write_replicas`), else summed here before the end.
        let taken = std::cell::Cell::new(None);
        let checksum = || taken.get().unwrap_or_else(|| crate::checksum::checksum(value));
        self.put_placed(key, value.len() as u64, checksum, cfg, |replicas| {
            let (failed, crc) = self.write_replicas(replicas, value);
            taken.set(crc);
            failed
        })
    }

    /// A put of `len` bytes whose crc32c `checksum` gives once they are written, each
    /// placement's replicas filled by `write` (which returns the segments that
    /// failed): placed, written, ended, placed again without a failed segment.
    fn put_placed(
        &self,
        key: &str,
        len: u64,
        checksum: impl Fn() -> u32,
        cfg: &ReplicateConfig,
        mut write: impl FnMut(&[MemoryReplica]) -> Vec<(SegmentId, Error)>,
    ) -> Result<()> {
        let client = self.client();
        let mut attempt = 1;
        loop {
            let replicas = self.master.put_start(client, key, len, cfg)?;
            let failed = write(&replicas);
            let Some((_, err)) = failed.first() else {
                if replicas.len() < cfg.replica_num {
                    StoreCounters::inc(&self.counters.under_replicated_puts, 1);
                }
                return self.master.put_end(client, key, checksum());
            };
            let err = err.clone();
            let _ = self.master.put_revoke(client, key);
            if attempt >= PUT_ATTEMPTS {
                return Err(err);
            }
            for (segment, e) in &failed {
                tracing::warn!(key, segment, error = %e, "cannot write a replica; placing the put again");
                let _ = self.master.report_segment_failure(client, *segment);
            }
            attempt += 1;
        }
    }

    /// Reads `dst.len()` bytes at `offset` of `route` and returns their crc32c, taken
    /// by the transport on the way where that pays (see `sums_in_flight`).
    fn read_summed(&self, route: &RemoteRegion, offset: u64, dst: &mut [u8]) -> Result<u32> {
        let mut req = TransferRequest::read(route, offset, dst);
        if self.sums_in_flight(route, req.op.len()) {
            req = req.with_checksum();
        }
        let mut reqs = [req];
        let res = self.engine.transfer(&mut reqs).pop().unwrap_or(Ok(()));
        let [req] = reqs;
        res?;
        match req.checksum() {
            Some(crc) => Ok(crc),
            None => Ok(crate::checksum::checksum(dst)),
        }
    }

    /// Whether a transfer of an object of `len` bytes to or from `route` should have
    /// its transport take the checksum (`TransferRequest::with_checksum`): TCP sums
    /// each chunk on the lane that moves it, in parallel, at every size; memory copies
    /// sum piece by piece, which a parallel sum afterwards beats for large objects
    /// (`FUSED_BELOW`).
    pub(super) fn sums_in_flight(&self, route: &RemoteRegion, len: usize) -> bool {
        let by_memcpy = matches!(self.engine.transport_name(&route.endpoint), Some("local" | "shm"));
        !by_memcpy || len < FUSED_BELOW
    }

    /// Writes `value` to every replica; returns the segments that failed, with why,
    /// and the crc32c of `value` if the transport took it on the way.
    fn write_replicas(&self, replicas: &[MemoryReplica], value: &[u8]) -> (Vec<(SegmentId, Error)>, Option<u32>) {
        let mut failed = Vec::new();
        let mut routed = Vec::with_capacity(replicas.len());
        for r in replicas {
            match self.route(r.segment) {
                Ok(route) => routed.push((r, route)),
                Err(e) => failed.push((r.segment, e)),
            }
        }
        let mut reqs: Vec<TransferRequest<'_>> = routed
            .iter()
            .enumerate()
            .map(|(j, (r, route))| {
                let req = TransferRequest::write(route, r.offset, value);
                if j == 0 && self.sums_in_flight(route, value.len()) {
                    req.with_checksum()
                } else {
                    req
                }
            })
            .collect();
        for (res, (r, _)) in self.engine.transfer(&mut reqs).into_iter().zip(&routed) {
            if let Err(e) = res {
                // The route may be stale; ask the master again next time.
                self.routes.write().remove(&r.segment);
                failed.push((r.segment, e.into()));
            }
        }
        (failed, reqs.first().and_then(TransferRequest::checksum))
    }
}

impl Store {
    /// A builder; see [`StoreBuilder`].
    pub fn builder() -> StoreBuilder {
        StoreBuilder::default()
    }

    /// Cluster mode: connects to the masters of the cluster at `address`
    /// (`etcd://...`) and gives our memory as one extent per slot group.
    #[cfg(feature = "etcd")]
    fn connect_cluster(mut cfg: StoreBuilder, address: &str, engine: TransferEngine) -> Result<Store> {
        let cluster = crate::cluster_client::ClusterClient::connect(
            address,
            &cfg.etcd_credentials,
            cfg.secret.as_deref(),
            cfg.master_timeout,
            &engine,
            cfg.global_segment_size,
        )?;
        let server = if cluster.has_extents() {
            let listen = format!("{}:0", file_storage::endpoint_host(engine.endpoint()));
            let handler: Arc<dyn crate::rpc::RpcHandler> = Arc::new(cluster::ClusterRecords(cluster.clone()));
            let (key, config) = record_endpoint_config();
            let server = RpcServer::serve_with(&listen, handler, config)?;
            cluster.set_record_endpoint(server.local_addr().to_string(), key.to_vec());
            Some(server)
        } else {
            None
        };
        // The extents are the cluster client's: no segment of the single-master kind.
        cfg.global_segment_size = 0;
        let master: Arc<dyn MasterApi> = cluster.clone();
        Self::connect(cfg, master, engine, Some((cluster, server)))
    }

    fn connect(
        cfg: StoreBuilder,
        master: Arc<dyn MasterApi>,
        engine: TransferEngine,
        cluster: ClusterPart,
    ) -> Result<Store> {
        let reg = master.register_client()?;
        let client = reg.client;
        let segment = if cfg.global_segment_size > 0 {
            let region = engine.register_region(cfg.global_segment_size)?;
            match master.mount_segment(client, &engine.remote(region.id()), region.len()) {
                Ok(id) => Some(OwnSegment { region, id }),
                Err(e) => {
                    let _ = master.unregister_client(client);
                    return Err(e);
                }
            }
        } else {
            None
        };
        let client_id = Arc::new(AtomicU64::new(client));
        let ssd = match &cfg.ssd {
            Some(c) => match FileStorage::open(
                c,
                master.clone(),
                client_id.clone(),
                &engine,
                cfg.secret.as_deref(),
                cfg.insecure,
            ) {
                Ok(f) => Some(f),
                Err(e) => {
                    let _ = master.unregister_client(client);
                    return Err(e);
                }
            },
            None => None,
        };
        let leases = LeaseReleaser::new(master.clone(), cfg.master_address.is_some())?;
        let (stop_tx, stop_rx) = bounded::<()>(0);
        let own = segment.as_ref().map_or(0, |s| s.id);
        let records = Arc::new(SegmentRecords::new(own));
        if let Some(ssd) = &ssd {
            records.set_disk(ssd.discarder());
        }
        #[cfg(feature = "etcd")]
        if let (Some((cluster, _)), Some(ssd)) = (&cluster, &ssd) {
            cluster.set_disk(ssd.discarder());
        }
        let record_endpoint = match (&segment, &cfg.master, &cfg.master_address) {
            (None, _, _) => None,
            (Some(_), Some(m), _) => Some(RecordEndpoint::InProcess(m.clone())),
            (Some(_), None, Some(_)) => {
                let listen = format!("{}:0", file_storage::endpoint_host(engine.endpoint()));
                let handler: Arc<dyn crate::rpc::RpcHandler> = records.clone();
                let (key, config) = record_endpoint_config();
                match RpcServer::serve_with(&listen, handler, config) {
                    Ok(server) => Some(RecordEndpoint::Rpc { server, key }),
                    Err(e) => {
                        let _ = master.unregister_client(client);
                        return Err(e);
                    }
                }
            }
            (Some(_), None, None) => None,
        };
        let inner = Arc::new(StoreInner {
            master,
            client: client_id,
            engine,
            ssd,
            disk_peers: DiskPeers::new(cfg.secret.as_deref()),
            cache: ReplicaCache::new(cfg.replica_cache),
            leases,
            segment: Mutex::new(segment),
            own_segment: AtomicU64::new(own),
            routes: RwLock::new(HashMap::new()),
            replicate: cfg.replicate,
            counters: StoreCounters::default(),
            records,
            record_endpoint,
            flush_timeout: cfg.flush_timeout,
            cluster,
            _heartbeat_stop: stop_tx,
        });
        if let Err(e) = inner.announce_records(client) {
            // Without it, the node still learns its records with its heartbeats.
            tracing::warn!(error = %e, "the master cannot reach our record endpoint");
        }
        // Heartbeats get their own thread so that no amount of I/O delays them.
        let weak: Weak<StoreInner> = Arc::downgrade(&inner);
        // Well within the TTL, and often enough that segment records stay fresh.
        let period = Duration::from_millis((reg.client_ttl_ms / 4).clamp(1, 250));
        std::thread::Builder::new()
            .name("mooncake-heartbeat".into())
            .spawn(move || loop {
                match stop_rx.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => {}
                    _ => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                if inner.client() == CLOSED {
                    return;
                }
                match inner.heartbeat() {
                    Ok(()) => {}
                    Err(Error::UnknownClient(_)) => {
                        if let Err(e) = inner.rejoin() {
                            tracing::error!(error = %e, "cannot re-register with the master");
                        }
                    }
                    // Unreachable master: keep our identity and try again next period.
                    Err(e) => tracing::warn!(error = %e, "heartbeat failed"),
                }
                drain::poll(&inner);
            })
            .map_err(|e| Error::InvalidArgument(format!("cannot start the heartbeat thread: {e}")))?;
        if let Some(ssd) = &inner.ssd {
            ssd.announce(&*inner.master, client)?;
            spawn_offloader(&inner, ssd.interval())?;
        }
        Ok(Store { inner })
    }

    /// Stores `value` under `key` with the builder's default replication.
    /// Fails with `AlreadyExists` if the key exists: objects are immutable.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.put_with(key, value, &self.inner.replicate)
    }

    /// Stores `value` under `key` with `cfg`'s replication.
    pub fn put_with(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> Result<()> {
        let c = &self.inner.counters;
        let res = self.inner.put(key, value, cfg);
        match &res {
            Ok(()) => {
                StoreCounters::inc(&c.puts, 1);
                StoreCounters::inc(&c.put_bytes, value.len() as u64);
            }
            Err(_) => StoreCounters::inc(&c.put_errors, 1),
        }
        res
    }

    /// The bytes stored under `key`; `NotFound` if absent. The bytes are verified
    /// against the checksum taken at put time.
    pub fn get(&self, key: &str) -> Result<Bytes> {
        let res = self.inner.get(key);
        self.count_get(res.as_ref().map(|b| b.len()).map_err(|_| ()));
        res
    }

    /// Reads the object into `buf` and returns its length; `BufferTooSmall` if it
    /// does not fit (nothing is written then).
    pub fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        let res = self.inner.get_into(key, buf);
        self.count_get(res.as_ref().copied().map_err(|_| ()));
        res
    }

    fn count_get(&self, res: std::result::Result<usize, ()>) {
        let c = &self.inner.counters;
        match res {
            Ok(n) => {
                StoreCounters::inc(&c.gets, 1);
                StoreCounters::inc(&c.get_bytes, n as u64);
            }
            Err(()) => StoreCounters::inc(&c.get_errors, 1),
        }
    }

    /// Puts many objects with one master round trip per phase and one transfer batch.
    /// One result per item, in order.
    pub fn batch_put(&self, items: &[(&str, &[u8])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        let one: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [*v]).collect();
        let items: Vec<(&str, &[&[u8]])> = items.iter().zip(&one).map(|((k, _), v)| (*k, &v[..])).collect();
        self.inner.batch_put_parts(&items, cfg)
    }

    /// Gets many objects with one master round trip and one transfer batch; a key
    /// whose first replica fails is retried alone. One result per key, in order.
    pub fn batch_get(&self, keys: &[&str]) -> Vec<Result<Bytes>> {
        let inner = &self.inner;
        let lists = inner.master.batch_get_replica_list(keys);
        let mut bufs: Vec<Option<Vec<u8>>> = Vec::with_capacity(keys.len());
        let mut routes: Vec<Option<(u64, Arc<RemoteRegion>)>> = Vec::with_capacity(keys.len());
        for list in &lists {
            let first = list
                .as_ref()
                .ok()
                .and_then(|l| inner.read_order(&l.replicas).first().copied())
                .and_then(|r| inner.route(r.segment).ok().map(|route| (r.offset, route)));
            bufs.push(list.as_ref().ok().filter(|_| first.is_some()).map(|l| buffers::take(l.len as usize)));
            routes.push(first);
        }
        let mut reqs: Vec<TransferRequest<'_>> = Vec::new();
        let mut owner = Vec::new();
        for (i, (buf, route)) in bufs.iter_mut().zip(&routes).enumerate() {
            if let (Some(buf), Some((offset, route)), Ok(list)) = (buf.as_mut(), route, &lists[i]) {
                reqs.push(TransferRequest::read(route, *offset, &mut buf[..list.len as usize]));
                owner.push(i);
            }
        }
        let mut ok = vec![false; keys.len()];
        for (res, i) in inner.engine.transfer(&mut reqs).into_iter().zip(owner) {
            ok[i] = res.is_ok();
        }
        drop(reqs);
        // Objects only on an SSD: one batch per disk that holds some.
        let mut by_disk: HashMap<ClientId, Vec<usize>> = HashMap::new();
        for (i, list) in lists.iter().enumerate() {
            if let (Ok(l), None) = (list, &routes[i]) {
                if let Some(disk) = l.disk {
                    by_disk.entry(disk).or_default().push(i);
                    bufs[i] = Some(buffers::take(l.len as usize));
                }
            }
        }
        for (disk, idxs) in by_disk {
            let mut wanted = vec![false; keys.len()];
            idxs.iter().for_each(|&i| wanted[i] = true);
            let mut reqs: Vec<(&str, &mut [u8])> = bufs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| wanted[*i])
                .filter_map(|(i, b)| {
                    let len = lists[i].as_ref().map_or(0, |l| l.len as usize);
                    b.as_mut().map(|b| (keys[i], &mut b[..len]))
                })
                .collect();
            for (res, i) in inner.read_disk_many(disk, &mut reqs).into_iter().zip(idxs) {
                ok[i] = res.is_ok();
            }
        }
        // Every read of the batch is over (a key retried alone takes a lease of its own).
        inner.leases.release(keys.iter().zip(&lists).filter(|(_, l)| l.is_ok()).map(|(k, _)| *k));
        lists
            .into_iter()
            .enumerate()
            .map(|(i, list)| {
                let list = list?;
                match bufs[i].take() {
                    Some(buf) if ok[i] && crate::checksum::checksum(&buf[..list.len as usize]) == list.checksum => {
                        self.count_get(Ok(list.len as usize));
                        Ok(buffers::freeze(buf, list.len as usize))
                    }
                    _ => self.get(keys[i]),
                }
            })
            .collect()
    }

    /// Whether a complete object is stored under `key`.
    pub fn exists(&self, key: &str) -> Result<bool> {
        self.inner.master.exists(key)
    }

    /// Removes `key`; `HasLease` while a reader's lease is live, `NotFound` if absent.
    pub fn remove(&self, key: &str) -> Result<()> {
        let res = self.inner.master.remove(key);
        self.inner.cache.forget(key);
        if res.is_ok() {
            StoreCounters::inc(&self.inner.counters.removes, 1);
        }
        res
    }

    /// Removes each key with one master round trip (per master in a cluster), as
    /// [`remove`](Self::remove) does one: `HasLease` while a reader's lease is live,
    /// `NotFound` if absent; this client's cached replica lists of the keys are
    /// forgotten. One result per key, in order.
    pub fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>> {
        let results = self.inner.master.batch_remove(keys);
        for key in keys {
            self.inner.cache.forget(key);
        }
        let removed = results.iter().filter(|r| r.is_ok()).count();
        StoreCounters::inc(&self.inner.counters.removes, removed as u64);
        results
    }

    /// Removes every object without a live lease; returns how many were removed.
    pub fn remove_all(&self) -> Result<usize> {
        let n = self.inner.master.remove_all()?;
        self.inner.cache.clear();
        StoreCounters::inc(&self.inner.counters.removes, n as u64);
        Ok(n)
    }

    /// Changes the number of memory replicas of `key` to `cfg.replica_num`, copying
    /// or dropping replicas; best effort (fewer copies when fewer segments have room).
    pub fn replicate(&self, key: &str, cfg: &ReplicateConfig) -> Result<()> {
        let inner = &self.inner;
        let plan = inner.master.replicate_start(inner.client(), key, cfg)?;
        if plan.targets.is_empty() {
            return Ok(());
        }
        let list = ReplicaList {
            len: plan.len,
            checksum: plan.checksum,
            replicas: plan.sources,
            lease: Duration::ZERO,
            disk: None,
        };
        let mut data = vec![0u8; plan.len as usize];
        let copied = inner.read_replicas(key, &list, &mut data).and_then(|_| {
            match inner.write_replicas(&plan.targets, &data).0.into_iter().next() {
                Some((_, e)) => Err(e),
                None => Ok(()),
            }
        });
        let ended = inner.master.replicate_end(key, &plan.targets, copied.is_ok());
        copied.and(ended)
    }

    /// Drops the replicas that the segment named `segment` (`endpoint#n`, as
    /// [`segment_name`](Self::segment_name) and the master's stats name them) holds of
    /// each key; an object left with no replica is removed. One result per key:
    /// `NotFound` (absent, or no replica there), `HasLease` (being read or copied),
    /// `InvalidArgument` (no such segment). With [`replicate`](Self::replicate) to a
    /// preferred segment first, this moves a replica.
    pub fn drop_replicas(&self, keys: &[&str], segment: &str) -> Vec<Result<()>> {
        let results = self.inner.master.batch_drop_replicas(keys, segment);
        for (key, res) in keys.iter().zip(&results) {
            if res.is_ok() {
                self.inner.cache.forget(key);
            }
        }
        results
    }

    /// Counters of this client's SSD tier, if it has one.
    pub fn ssd_stats(&self) -> Option<SsdStats> {
        self.inner.ssd.as_ref().map(FileStorage::stats)
    }

    /// Counters of this client and of the master.
    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        let c = &inner.counters;
        let seg = inner.segment.lock();
        let master = inner.master.stats().unwrap_or_default();
        let (cap, used) = seg
            .as_ref()
            .and_then(|s| master.segment_usage.iter().find(|u| u.segment == s.id))
            .map(|u| (u.capacity, u.used))
            .unwrap_or((0, 0));
        StoreStats {
            client_id: inner.client(),
            segment_capacity: cap,
            segment_used: used,
            puts: c.puts.load(Ordering::Relaxed),
            put_bytes: c.put_bytes.load(Ordering::Relaxed),
            put_errors: c.put_errors.load(Ordering::Relaxed),
            gets: c.gets.load(Ordering::Relaxed),
            get_bytes: c.get_bytes.load(Ordering::Relaxed),
            get_errors: c.get_errors.load(Ordering::Relaxed),
            checksum_mismatches: c.checksum_mismatches.load(Ordering::Relaxed),
            removes: c.removes.load(Ordering::Relaxed),
            under_replicated_puts: c.under_replicated_puts.load(Ordering::Relaxed),
            device_direct_bytes: c.device_direct_bytes.load(Ordering::Relaxed),
            device_staged_bytes: c.device_staged_bytes.load(Ordering::Relaxed),
            ssd: self.ssd_stats(),
            disk_loads: inner.disk_peers.loads(),
            replica_cache_hits: inner.cache.hits(),
            record_refusals: self.record_server().map_or(0, |s| {
                let st = s.stats();
                st.auth_failures.load(Ordering::Relaxed) + st.refused_connections.load(Ordering::Relaxed)
            }),
            master,
        }
    }

    /// The RPC server of our record endpoint, if we serve one.
    fn record_server(&self) -> Option<&RpcServer> {
        if let Some(RecordEndpoint::Rpc { server, .. }) = &self.inner.record_endpoint {
            return Some(server);
        }
        #[cfg(feature = "etcd")]
        if let Some((_, Some(server))) = &self.inner.cluster {
            return Some(server);
        }
        None
    }

    /// The address of the endpoint where masters change this storage node's records
    /// (`None` without one: no segment, or a master in this process). Only the
    /// masters it mounted on can use it; the refusals are counted in
    /// [`StoreStats::record_refusals`].
    pub fn record_endpoint(&self) -> Option<String> {
        self.record_server().map(|s| s.local_addr().to_string())
    }

    /// This client's id at the master.
    pub fn client_id(&self) -> u64 {
        self.inner.client()
    }

    /// The transfer endpoint peers reach this client's segment at.
    pub fn endpoint(&self) -> &str {
        self.inner.engine.endpoint()
    }

    /// The name of this client's segment at the master (what
    /// [`ReplicateConfig::preferred_segments`] lists), if it gives memory to the pool.
    pub fn segment_name(&self) -> Result<Option<String>> {
        match self.segment_id() {
            Some(id) => Ok(Some(self.inner.master.segment_info(id)?.name)),
            None => Ok(None),
        }
    }

    /// The id of this client's segment, if it gives memory to the pool.
    pub fn segment_id(&self) -> Option<SegmentId> {
        self.inner.segment.lock().as_ref().map(|s| s.id)
    }

    /// The master this client talks to, for its low-level calls (two-phase puts,
    /// client registration, object info): tools and tests use them; a server needs
    /// only `Store`'s own methods, which keep the master's state consistent.
    pub fn master(&self) -> &Arc<dyn MasterApi> {
        &self.inner.master
    }

    /// The objects this client's segment holds, as the master last told it (empty
    /// with an embedded master, which does not track records).
    pub fn segment_records(&self) -> Vec<ObjectRecord> {
        #[allow(unused_mut)]
        let mut records = self.inner.records.snapshot();
        #[cfg(feature = "etcd")]
        if let Some((cluster, _)) = &self.inner.cluster {
            records.extend(cluster.records());
        }
        records
    }
}

/// Starts the offload thread of the SSD tier: it runs offload heartbeats back to back
/// while the master has work, and every `idle` otherwise. It holds only a weak
/// reference and exits with the store.
fn spawn_offloader(inner: &Arc<StoreInner>, idle: Duration) -> Result<()> {
    let weak: Weak<StoreInner> = Arc::downgrade(inner);
    std::thread::Builder::new()
        .name("mooncake-offload".into())
        .spawn(move || loop {
            let Some(inner) = weak.upgrade() else { return };
            let Some(ssd) = &inner.ssd else { return };
            let regions = inner.segment_regions();
            let views: Vec<(u64, &RegisteredRegion)> = regions.iter().map(|(id, r)| (*id, &**r)).collect();
            let busy = match ssd.offload_round(&*inner.master, inner.client(), &views) {
                Ok(n) => n > 0,
                Err(e) => {
                    tracing::debug!(error = %e, "offload heartbeat failed");
                    false
                }
            };
            if !busy {
                ssd.retry_notifications();
            }
            drop(inner);
            if !busy {
                std::thread::sleep(idle);
            }
        })
        .map(|_| ())
        .map_err(|e| Error::InvalidArgument(format!("cannot start the offload thread: {e}")))
}
