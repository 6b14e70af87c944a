//! The client: `Store` puts and gets objects through the master and the transfer
//! engine.
//!
//! Every put form is an adapter over the one write engine (`write.rs`), every get
//! form over the one read engine (`read.rs`); `session.rs` connects, heartbeats
//! and leaves; `device/` adds device memory as one more source and destination;
//! `ahead.rs` keeps the room a master daemon holds ahead of device puts.

mod ahead;
mod buffers;
mod builder;
#[cfg(feature = "etcd")]
pub(crate) mod cluster;
mod destination;
mod device;
pub(crate) mod drain;
mod file_storage;
mod leases;
mod read;
pub(crate) mod records;
mod replica_cache;
mod routes;
mod session;
mod stats;
mod write;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use crossbeam_channel::Sender;
use mooncake_alloc::SegmentId;
use mooncake_transfer::{RegisteredRegion, TransferEngine};
use parking_lot::Mutex;

use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{ClientId, Master, MasterApi, ObjectRecord, ReplicaList};
use crate::rpc::RpcServer;

pub use builder::StoreBuilder;
use destination::{Dest, Got};
use file_storage::{DiskPeers, FileStorage};
pub use file_storage::{SsdBackend, SsdOffloadConfig, SsdStats};
use leases::LeaseReleaser;
use read::Lists;
use records::SegmentRecords;
use replica_cache::ReplicaCache;
use routes::Routes;
use stats::StoreCounters;
pub use stats::{ReadTime, StoreStats, WriteTime};
use write::{Source, WriteItem, WriteMode};

/// The client id of a store that [`Store::close`] unregistered (ids are never 0).
const CLOSED: ClientId = 0;

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
    /// Routes to the segments this client reached.
    routes: Routes,
    replicate: ReplicateConfig,
    counters: StoreCounters,
    /// The objects our segment holds, as the master told us: what we re-register if
    /// the master restarts.
    records: Arc<SegmentRecords>,
    /// Where the master tells us of changes to our records before acknowledging them.
    record_endpoint: Option<RecordEndpoint>,
    /// The master is reached over the network (a daemon or a cluster), not in this
    /// process: what a put saves by declaring its checksum (`write.rs`).
    master_is_remote: bool,
    /// Longest time `flush` waits for the SSD tier.
    flush_timeout: Duration,
    /// How long a put waits while its master recovers (see `store::write`): three of
    /// the master's client TTLs (its window after the last node is back), at least
    /// 20 s.
    recovering_wait: Duration,
    /// Cluster mode: the cluster client (also `master`) and the record endpoint of our
    /// extents.
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    cluster: ClusterPart,
    /// Dropping it stops the heartbeat thread.
    _heartbeat_stop: Sender<()>,
    /// Wakes the heartbeat thread at once (the master daemon went away).
    heartbeat_wake: Sender<()>,
    /// Segments this store maps (its own, same-host peers') page-locked for DMA to and
    /// from device memory; unpinned and unmapped with the store.
    pinned: device::PinnedRegions,
    /// Room the master holds ahead of this client's device puts (`ahead.rs`).
    ahead: ahead::PlacementsAhead,
}

/// Cluster mode's part of a store (see `cluster`).
#[cfg(feature = "etcd")]
type ClusterPart = Option<(Arc<crate::cluster_client::ClusterClient>, Option<RpcServer>)>;
/// Without the `etcd` feature there is no cluster mode.
#[cfg(not(feature = "etcd"))]
type ClusterPart = Option<std::convert::Infallible>;

impl Store {
    /// A builder; see [`StoreBuilder`].
    pub fn builder() -> StoreBuilder {
        StoreBuilder::default()
    }

    /// Writes `items` with `cfg` (the write engine).
    fn write(&self, items: &[WriteItem<'_>], cfg: &ReplicateConfig, mode: WriteMode) -> Vec<Result<()>> {
        self.inner.write(items, cfg, mode)
    }

    /// Writes one item with `cfg`.
    fn write_one(&self, key: &str, source: Source<'_>, cfg: &ReplicateConfig, mode: WriteMode) -> Result<()> {
        self.write(&[WriteItem { key, source }], cfg, mode).pop().unwrap_or(Ok(()))
    }

    /// Writes `(key, parts)` items.
    fn write_parts(&self, items: &[(&str, &[&[u8]])], cfg: &ReplicateConfig, mode: WriteMode) -> Vec<Result<()>> {
        let items: Vec<WriteItem<'_>> =
            items.iter().map(|(key, parts)| WriteItem { key, source: Source::Host(parts) }).collect();
        self.write(&items, cfg, mode)
    }

    /// Writes `(key, value)` items.
    fn write_values(&self, items: &[(&str, &[u8])], cfg: &ReplicateConfig, mode: WriteMode) -> Vec<Result<()>> {
        let one: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [*v]).collect();
        let items: Vec<WriteItem<'_>> =
            items.iter().zip(&one).map(|((key, _), v)| WriteItem { key, source: Source::Host(v) }).collect();
        self.write(&items, cfg, mode)
    }

    /// Reads one object (the read engine).
    fn read_one(&self, key: &str, dest: Dest<'_>) -> Result<Got> {
        self.inner.read(vec![(key, dest)], Lists::Cached).pop().unwrap_or_else(|| Err(Error::NotFound(key.to_owned())))
    }

    /// Reads each key into its caller buffers; returns each object's length.
    fn read_into(&self, keys: &[&str], bufs: Vec<Vec<&mut [u8]>>) -> Vec<Result<usize>> {
        if keys.len() != bufs.len() {
            let e = Error::InvalidArgument(format!("{} keys but {} buffers", keys.len(), bufs.len()));
            return vec![Err(e); keys.len()];
        }
        let items = keys.iter().zip(bufs).map(|(k, b)| (*k, Dest::Host(b))).collect();
        self.inner.read(items, Lists::Master).into_iter().map(|r| r.map(|g| g.len())).collect()
    }

    /// Stores `value` under `key` with the builder's default replication.
    /// Fails with `AlreadyExists` if the key exists: objects are immutable.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        self.put_with(key, value, &self.inner.replicate)
    }

    /// Stores `value` under `key` with `cfg`'s replication. A replica whose segment
    /// cannot be written is placed again elsewhere (the master is told), as in
    /// every put form.
    pub fn put_with(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> Result<()> {
        self.write_one(key, Source::Host(&[value]), cfg, WriteMode::Put)
    }

    /// Stores one object made of `parts`, concatenated (one block's KV cache kept
    /// in per-layer buffers, say), without joining them in memory first.
    pub fn put_parts(&self, key: &str, parts: &[&[u8]]) -> Result<()> {
        self.write_one(key, Source::Host(parts), &self.inner.replicate, WriteMode::Put)
    }

    /// Puts many objects with one master round trip per phase and one transfer batch.
    /// One result per item, in order.
    pub fn batch_put(&self, items: &[(&str, &[u8])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        self.write_values(items, cfg, WriteMode::Put)
    }

    /// [`put_parts`](Self::put_parts) for many objects, with one master round trip
    /// per phase and one transfer batch. One result per item, in order.
    pub fn batch_put_parts(&self, items: &[(&str, &[&[u8]])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        self.write_parts(items, cfg, WriteMode::Put)
    }

    /// Stores `value` under `key` with the builder's default replication, replacing
    /// the object stored there if any. See [`batch_upsert_parts`](Self::batch_upsert_parts).
    pub fn upsert(&self, key: &str, value: &[u8]) -> Result<()> {
        self.upsert_with(key, value, &self.inner.replicate)
    }

    /// [`upsert`](Self::upsert) with `cfg`'s replication.
    pub fn upsert_with(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> Result<()> {
        self.write_one(key, Source::Host(&[value]), cfg, WriteMode::Upsert)
    }

    /// Upserts one object made of `parts`, concatenated, with the builder's default
    /// replication.
    pub fn upsert_parts(&self, key: &str, parts: &[&[u8]]) -> Result<()> {
        self.write_one(key, Source::Host(parts), &self.inner.replicate, WriteMode::Upsert)
    }

    /// Upserts many objects, with one master round trip per phase and one transfer
    /// batch. One result per item, in order.
    pub fn batch_upsert(&self, items: &[(&str, &[u8])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        self.write_values(items, cfg, WriteMode::Upsert)
    }

    /// Stores each object (made of its parts, concatenated), replacing the object
    /// stored under its key if any. The replacement is atomic: a reader of the key
    /// gets the old bytes or the new ones, never a mix, and never `NotFound` while
    /// the key exists throughout. An upsert of a key that another put or upsert is
    /// writing waits for it (up to 5 s, then `AlreadyExists`), so concurrent upserts
    /// of a key take effect one after the other. A failed write to a segment is
    /// placed again elsewhere, as a put's is. One result per item, in order.
    pub fn batch_upsert_parts(&self, items: &[(&str, &[&[u8]])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        self.write_parts(items, cfg, WriteMode::Upsert)
    }

    /// The bytes stored under `key`; `NotFound` if absent. The bytes are verified
    /// against the checksum taken at put time.
    pub fn get(&self, key: &str) -> Result<Bytes> {
        match self.read_one(key, Dest::Owned)? {
            Got::Owned(bytes) => Ok(bytes),
            Got::Len(_) => Err(Error::NotFound(key.to_owned())),
        }
    }

    /// Reads the object into `buf` and returns its length; `BufferTooSmall` if it
    /// does not fit. On an error the bytes of `buf` are unspecified: a replica that
    /// failed its checksum may have been read into it before the error was known.
    pub fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        self.read_one(key, Dest::Host(vec![buf])).map(|g| g.len())
    }

    /// Reads one object into `bufs`, filled in order (the first `bufs[0].len()`
    /// bytes into `bufs[0]`, and so on); returns the object's length.
    /// `BufferTooSmall` if the buffers together cannot hold it (nothing is written).
    pub fn get_into_parts(&self, key: &str, bufs: &mut [&mut [u8]]) -> Result<usize> {
        let bufs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut **b).collect();
        self.read_one(key, Dest::Host(bufs)).map(|g| g.len())
    }

    /// Gets many objects with one master round trip and one transfer batch (an
    /// object whose replica fails is read from its next replica in the next
    /// round). One result per key, in order.
    pub fn batch_get(&self, keys: &[&str]) -> Vec<Result<Bytes>> {
        let items = keys.iter().map(|k| (*k, Dest::Owned)).collect();
        self.inner
            .read(items, Lists::Master)
            .into_iter()
            .zip(keys)
            .map(|(r, k)| match r? {
                Got::Owned(bytes) => Ok(bytes),
                Got::Len(_) => Err(Error::NotFound((*k).to_owned())),
            })
            .collect()
    }

    /// Reads each object into the caller's buffer of the same index (no copy through
    /// an intermediate buffer), with one master round trip and one transfer batch;
    /// returns each object's length. A buffer too small gives `BufferTooSmall` for
    /// its key only. One result per key, in order.
    pub fn batch_get_into(&self, keys: &[&str], bufs: &mut [&mut [u8]]) -> Vec<Result<usize>> {
        self.read_into(keys, bufs.iter_mut().map(|b| vec![&mut **b]).collect())
    }

    /// [`get_into_parts`](Self::get_into_parts) for many objects, with one master
    /// round trip and one transfer batch. One result per key, in order.
    pub fn batch_get_into_parts(&self, keys: &[&str], bufs: &mut [&mut [&mut [u8]]]) -> Vec<Result<usize>> {
        self.read_into(keys, bufs.iter_mut().map(|b| b.iter_mut().map(|p| &mut **p).collect()).collect())
    }

    /// Whether a complete object is stored under each key, with one master round
    /// trip. One result per key, in order.
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.inner.master.batch_exists(keys)
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
        // Read through the read engine from the sources the master gave, written
        // through the write engine's replica writer to the targets it placed.
        let copied = match inner.read(vec![(key, Dest::Owned)], Lists::Given(vec![list])).pop() {
            Some(Ok(Got::Owned(bytes))) => inner.write_copy(key, &bytes, plan.checksum, &plan.targets),
            Some(Ok(Got::Len(_))) | None => Err(Error::NotFound(key.to_owned())),
            Some(Err(e)) => Err(e),
        };
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
        self.forget_dropped(keys, self.inner.master.batch_drop_replicas(keys, segment))
    }

    /// [`drop_replicas`](Self::drop_replicas) that never drops a key's last copy
    /// (`NotFound` for it): a drain's, which must not lose an object whose other copy
    /// went away after it looked.
    pub(crate) fn drop_spare_replicas(&self, keys: &[&str], segment: &str) -> Vec<Result<()>> {
        self.forget_dropped(keys, self.inner.master.batch_drop_spare_replicas(keys, segment))
    }

    /// Forgets the cached lists of the keys whose replicas `results` say were dropped.
    fn forget_dropped(&self, keys: &[&str], results: Vec<Result<()>>) -> Vec<Result<()>> {
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
            declared_puts: c.declared_puts.load(Ordering::Relaxed),
            device_direct_bytes: c.device_direct_bytes.load(Ordering::Relaxed),
            device_staged_bytes: c.device_staged_bytes.load(Ordering::Relaxed),
            device_page_locked_bytes: inner.pinned.locked_bytes(),
            ssd: self.ssd_stats(),
            disk_loads: inner.disk_peers.loads(),
            replica_cache_hits: inner.cache.hits(),
            record_refusals: self.record_server().map_or(0, |s| {
                let st = s.stats();
                st.auth_failures.load(Ordering::Relaxed) + st.refused_connections.load(Ordering::Relaxed)
            }),
            record_mount_failures: c.record_mount_failures.load(Ordering::Relaxed),
            write_time: c.write.snapshot(),
            read_time: c.read.snapshot(),
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
