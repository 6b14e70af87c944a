//! [`FileStorage`]: a client's SSD tier — offload of objects from the client's
//! segment to its disk, loads back, and recovery of the disk's objects on start.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mooncake_storage::{
    direct_io_supported, io_engine, AlignedBuf, BackendOptions, ClientBuffer, EvictionListener, GcThread, IoKind,
    NotifyError, ObjectMeta, StorageBackend, StorageError,
};
use mooncake_transfer::{RegisteredRegion, SharedSecret, TransferEngine};
use parking_lot::Mutex;

use super::config::SsdOffloadConfig;
use super::load_server::{endpoint_host, LoadServer};
use super::stats::{inc, SsdCounters, SsdStats};
use crate::error::{Error, Result};
use crate::master::{ClientId, MasterApi, OffloadPlan, OffloadTask};
use crate::rpc::{RpcServer, RpcServerConfig};
use crate::store::records::Removals;

/// Objects registered with the master per call when a disk is scanned.
const REGISTER_CHUNK: usize = 1024;

/// Discards remembered, so that a file written after its discard arrived (an offload
/// already under way when its object was removed) goes too.
const RECENT_DISCARDS: usize = 4096;
/// Locks serializing, per key, deleting an old file and writing a new one.
const KEY_LOCKS: usize = 64;

/// Deletes files of removed objects (`Discard` record updates, answered once done).
pub(crate) struct Discarder {
    backend: Arc<dyn StorageBackend>,
    counters: Arc<SsdCounters>,
    /// Recent discards.
    recent: Mutex<Removals>,
    /// Discards whose delete failed (the file is still stored): key -> generation,
    /// retried on each offload heartbeat.
    failed: Mutex<ahash::HashMap<String, u64>>,
    key_locks: Box<[Mutex<()>]>,
}

impl Discarder {
    fn key_lock(&self, key: &str) -> parking_lot::MutexGuard<'_, ()> {
        let h = std::hash::BuildHasher::hash_one(&ahash::RandomState::with_seeds(1, 2, 3, 4), key) as usize;
        self.key_locks[h % KEY_LOCKS].lock()
    }

    /// Deletes `key`'s file if its generation is `generation` or older; returns whether
    /// it did. The caller holds the key's lock.
    fn delete_older(&self, key: &str, generation: u64) -> bool {
        match self.backend.object_meta(key) {
            Some(m) if m.generation <= generation => match self.backend.remove(key) {
                Ok(()) => {
                    inc(&self.counters.discarded, 1);
                    true
                }
                Err(mooncake_storage::StorageError::NotFound(_)) => false,
                Err(e) => {
                    // The master counts the removal as done and the backend still
                    // holds the object: the delete is tried again until it succeeds.
                    tracing::warn!(key, error = %e, "could not delete the file of a removed object; will retry");
                    // Kept with the stored object's generation: a retry never deletes
                    // a newer object written under the key meanwhile.
                    let mut failed = self.failed.lock();
                    let g = failed.entry(key.to_owned()).or_insert(m.generation);
                    *g = (*g).max(m.generation);
                    false
                }
            },
            _ => false,
        }
    }

    /// Tries the failed discards again; returns how many are still pending.
    fn retry_failed(&self) -> usize {
        let failed = std::mem::take(&mut *self.failed.lock());
        for (key, generation) in failed {
            let _guard = self.key_lock(&key);
            self.delete_older(&key, generation);
        }
        self.failed.lock().len()
    }

    /// The newest discard of `key` remembered, if any.
    fn discarded(&self, key: &str) -> Option<u64> {
        self.recent.lock().get(key)
    }
}

impl crate::store::records::DiskDiscard for Discarder {
    fn discard(&self, key: &str, generation: u64) {
        {
            // Remembered first: an offload finishing meanwhile checks it after writing.
            self.recent.lock().keep(key, generation);
        }
        let _guard = self.key_lock(key);
        self.delete_older(key, generation);
    }
}

/// The SSD tier of one client.
pub(crate) struct FileStorage {
    backend: Arc<dyn StorageBackend>,
    discarder: Arc<Discarder>,
    staging: Arc<ClientBuffer>,
    /// The load server (stops when dropped).
    server: RpcServer,
    capacity: u64,
    batch: usize,
    interval: Duration,
    counters: Arc<SsdCounters>,
    /// The tier was offered to a master once already (by this process).
    announced: std::sync::atomic::AtomicBool,
    _gc: GcThread,
}

/// Tells the master which keys disk eviction removed, before their files go.
struct EvictionNotice {
    master: Arc<dyn MasterApi>,
    client: Arc<AtomicU64>,
}

impl EvictionListener for EvictionNotice {
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
        insecure: bool,
    ) -> Result<Self> {
        cfg.check()?;
        std::fs::create_dir_all(&cfg.dir).map_err(|e| {
            let context = format!("cannot create {}: {e}", cfg.dir.display());
            Error::from(StorageError::Io(std::io::Error::new(e.kind(), context)))
        })?;
        let direct = cfg.direct_io && direct_io_supported(&cfg.dir);
        let opts = BackendOptions::default()
            .with_io(io_engine(cfg.io, direct))
            .with_capacity(cfg.capacity)
            .with_eviction_boxed(cfg.eviction.build())
            .with_listener(Arc::new(EvictionNotice { master, client }));
        let backend = cfg.backend.open(&cfg.dir, opts)?;
        // Read-only for peers: they only pull staged objects out of it, and a write
        // of theirs (refused by every transport) would change a slot under a load.
        let region: Arc<RegisteredRegion> = engine.register_read_only_region(cfg.staging_size.max(4096))?;
        let staging_region = engine.remote(region.id());
        // SAFETY: the region's mapping is page-aligned and lives as long as the `Arc`
        // handed over as owner; nothing but the staging allocator writes it: peers
        // may only read it (registered read-only: the engine's transports refuse
        // their writes, RDMA registers it without remote write, same-host peers
        // map it read-only).
        let staging = Arc::new(unsafe {
            ClientBuffer::from_raw_parts(region.as_mut_ptr(), region.len() as usize, cfg.gc_ttl, Box::new(region))
        }?);
        if cfg.io == IoKind::Uring {
            // Loads for peers then read straight into registered pages (READ_FIXED).
            staging.register_with_uring();
        }
        let gc = staging.spawn_gc(cfg.gc_ttl / 2);
        let counters = Arc::new(SsdCounters::default());
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
        let config = RpcServerConfig { secret: secret.map(SharedSecret::new), insecure, ..RpcServerConfig::default() };
        let server = RpcServer::serve_with(&listen, handler, config)?;
        tracing::info!(dir = %cfg.dir.display(), backend = backend.name(), direct, server = %server.local_addr(), "SSD tier open");
        let discarder = Arc::new(Discarder {
            backend: backend.clone(),
            counters: counters.clone(),
            recent: Mutex::new(Removals::new(RECENT_DISCARDS, usize::MAX)),
            failed: Mutex::new(Default::default()),
            key_locks: (0..KEY_LOCKS).map(|_| Mutex::new(())).collect(),
        });
        Ok(Self {
            backend,
            discarder,
            staging,
            server,
            capacity: cfg.capacity,
            batch: cfg.offload_batch,
            interval: cfg.heartbeat_interval,
            counters,
            announced: Default::default(),
            _gc: gc,
        })
    }

    /// What deletes files of removed objects when the master says so.
    pub(crate) fn discarder(&self) -> Arc<dyn crate::store::records::DiskDiscard> {
        self.discarder.clone()
    }

    /// Pause between idle offload heartbeats.
    pub(crate) fn interval(&self) -> Duration {
        self.interval
    }

    /// Offers the tier to the master and registers every object already on disk
    /// (at start, and again after the master restarted). Stale copies (the master
    /// holds a different object under the key) are deleted. Files found at start
    /// were written before this process: the node was away meanwhile and may have
    /// missed their removals, which the master is told first
    /// (`MasterApi::missed_updates`: a restarted master then withholds what only
    /// they hold while its recovery window is open).
    pub(crate) fn announce(&self, master: &dyn MasterApi, client: ClientId) -> Result<usize> {
        let mut found: Vec<ObjectMeta> = Vec::new();
        self.backend.scan_meta(&mut |m| found.push(m.clone()));
        if !self.announced.swap(true, Ordering::AcqRel) && !found.is_empty() {
            if let Err(e) = master.missed_updates(client) {
                tracing::debug!(error = %e, "the master does not take the note that our files may be stale");
            }
        }
        let mut registered = 0;
        for chunk in found.chunks(REGISTER_CHUNK) {
            let items: Vec<(&str, u64, u32, u64)> =
                chunk.iter().map(|m| (m.key.as_str(), m.len, m.checksum, m.generation)).collect();
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
    /// for (read from our `segments` — one, or one extent per slot group in a cluster —
    /// checked against the checksum) and reports it.
    /// Returns how many objects were asked for.
    pub(crate) fn offload_round(
        &self,
        master: &dyn MasterApi,
        client: ClientId,
        segments: &[(u64, &RegisteredRegion)],
    ) -> Result<usize> {
        let OffloadPlan { tasks, discard } = master.offload_heartbeat(client, self.batch)?;
        for key in &discard {
            let _guard = self.discarder.key_lock(key);
            self.discarder.delete_older(key, u64::MAX);
        }
        if tasks.is_empty() {
            return Ok(0);
        }
        let asked = tasks.len();
        let objects = self.read_tasks(tasks, segments);
        let views: Vec<(&str, &[u8], u64)> =
            objects.iter().map(|(t, b)| (t.key.as_str(), &b[..], t.generation)).collect();
        let mut written: Vec<&OffloadTask> = Vec::with_capacity(objects.len());
        for ((task, bytes), res) in objects.iter().zip(self.backend.batch_offload_generations(&views)) {
            match res {
                Ok(_) => written.push(task),
                Err(StorageError::AlreadyExists(_)) => {
                    // Written before (a report that got lost), or a stale copy of an
                    // older object under the same key.
                    let _guard = self.discarder.key_lock(&task.key);
                    match self.backend.object_meta(&task.key) {
                        Some(m) if m.len == task.len && m.checksum == task.checksum => written.push(task),
                        Some(m) if m.generation > task.generation => {}
                        _ => {
                            let _ = self.backend.remove(&task.key);
                            let item = [(task.key.as_str(), &bytes[..], task.generation)];
                            match self.backend.batch_offload_generations(&item).pop() {
                                Some(Ok(_)) => written.push(task),
                                Some(Err(e)) => self.offload_failed(&task.key, e),
                                None => {}
                            }
                        }
                    }
                }
                Err(e) => self.offload_failed(&task.key, e),
            }
        }
        // The object was removed while we wrote it, and the node told already: the
        // file goes now (the discard found nothing to delete then).
        written.retain(|task| match self.discarder.discarded(&task.key) {
            Some(d) if d >= task.generation => {
                let _guard = self.discarder.key_lock(&task.key);
                self.discarder.delete_older(&task.key, d);
                false
            }
            _ => true,
        });
        let items: Vec<(&str, u64, u32, u64)> =
            written.iter().map(|t| (t.key.as_str(), t.len, t.checksum, t.generation)).collect();
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

    /// Copies each task's bytes out of our segments, keeping those whose bytes still
    /// match the checksum (the master leased them, so they should).
    fn read_tasks(
        &self,
        tasks: Vec<OffloadTask>,
        segments: &[(u64, &RegisteredRegion)],
    ) -> Vec<(OffloadTask, AlignedBuf)> {
        tasks
            .into_iter()
            .filter_map(|t| {
                let (_, region) = segments.iter().find(|(id, _)| *id == t.segment)?;
                // A task's range is the master's word: checked before anything is
                // allocated for it.
                if crate::config::check_value_len(t.len).is_err() || region.check_bounds(t.offset, t.len).is_err() {
                    inc(&self.counters.offload_failures, 1);
                    tracing::warn!(
                        key = t.key,
                        offset = t.offset,
                        len = t.len,
                        "offload task outside the segment; skipped"
                    );
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
                Ok(n) => {
                    Err(StorageError::corrupted(*key, format!("{n} bytes on disk, the master says {want}")).into())
                }
                Err(e) => Err(e.into()),
            })
            .collect();
        inc(&self.counters.local_loads, results.iter().filter(|r| r.is_ok()).count() as u64);
        results
    }

    /// Runs queued eviction notices again (after the master was unreachable), and
    /// the deletes of removed objects' files that failed.
    pub(crate) fn retry_pending(&self) {
        if let Err(e) = self.backend.retry_pending_notifications() {
            tracing::debug!(error = %e, "eviction notices still pending");
        }
        let left = self.discarder.retry_failed();
        if left > 0 {
            tracing::debug!(left, "deletes of removed objects' files still pending");
        }
    }

    /// A snapshot of the tier.
    pub(crate) fn stats(&self) -> SsdStats {
        self.counters.snapshot(self.backend.stats(), self.staging.stats(), self.discarder.failed.lock().len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;
    use std::time::Duration;

    use mooncake_transfer::{RemoteRegion, SharedSecret, TcpTransport, TransferEngine, TransferError};

    use super::FileStorage;
    use crate::error::Error;
    use crate::master::{Master, MasterApi};
    use crate::rpc::wire::{Request, Response};
    use crate::rpc::RpcMasterClient;
    use crate::store::file_storage::config::SsdOffloadConfig;
    use crate::MasterConfig;

    /// The staging region a load server names in its answers is read by peers
    /// holding the secret, and never written by them: their writes are refused and
    /// the staged bytes stay what the disk held.
    #[test]
    fn peers_read_the_staging_region_and_may_not_write_it() {
        let dir = tempfile::tempdir().unwrap();
        let secret = b"tier secret";
        let engine = TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_secret(secret).build().unwrap();
        let master: Arc<dyn MasterApi> = Master::new(MasterConfig::default()).unwrap().service().clone();
        let mut cfg = SsdOffloadConfig::new(dir.path(), 64 << 20);
        cfg.staging_size = 1 << 20;
        let tier = FileStorage::open(&cfg, master, Arc::new(AtomicU64::new(1)), &engine, Some(secret), false).unwrap();
        let value = vec![0x5a; 10_000];
        tier.backend.offload("k", &value).unwrap();
        let load_server = tier.server.local_addr().to_string();
        let peer = RpcMasterClient::connect_with_timeout(
            &load_server,
            Some(SharedSecret::new(secret)),
            Duration::from_secs(5),
        )
        .unwrap();
        let batch = match peer.call(&Request::BatchGetOffloadObject { keys: vec!["k".into()] }).unwrap() {
            Response::OffloadBatch(b) => b,
            other => panic!("{other:?}"),
        };
        let (offset, len) = batch.objects[0].clone().unwrap();
        let staging = RemoteRegion { endpoint: batch.endpoint.clone(), region: batch.region };
        let other = TransferEngine::builder()
            .transport(Arc::new(TcpTransport::with_secret(SharedSecret::new(secret))))
            .build()
            .unwrap();
        let err = other.write(&staging, offset, &vec![0u8; len as usize]).unwrap_err();
        assert_eq!(err, TransferError::ReadOnly { region: batch.region });
        let mut back = vec![0u8; len as usize];
        other.read(&staging, offset, &mut back).unwrap();
        assert_eq!(back, value, "the staged bytes are the disk's");
    }

    /// A node started on an SSD directory that holds files was away for as long as
    /// it was down: to a master in its recovery window (it restarted too), what only
    /// those files hold answers `Recovering` until the window closes, not bytes a
    /// removal it missed may have superseded. Announced again by the same process
    /// (the master restarted meanwhile), its files are served at once.
    #[test]
    fn files_found_at_start_wait_for_a_restarted_masters_window() {
        let dir = tempfile::tempdir().unwrap();
        let engine = TransferEngine::builder().tcp_listen("127.0.0.1:0").build().unwrap();
        let cfg = SsdOffloadConfig::new(dir.path(), 64 << 20);
        let value = vec![0x5a; 10_000];
        {
            let master: Arc<dyn MasterApi> = Master::new(MasterConfig::default()).unwrap().service().clone();
            let tier = FileStorage::open(&cfg, master, Arc::new(AtomicU64::new(1)), &engine, None, true).unwrap();
            tier.backend.offload("k", &value).unwrap();
        }
        let restarted = || {
            let master = Master::new(MasterConfig::default()).unwrap();
            let client = master.register_client().unwrap().client;
            master.reconnected().unwrap();
            (master, client)
        };
        let (master, client) = restarted();
        let api: Arc<dyn MasterApi> = master.service().clone();
        let tier = FileStorage::open(&cfg, api.clone(), Arc::new(AtomicU64::new(client)), &engine, None, true).unwrap();
        assert_eq!(tier.announce(&*api, client).unwrap(), 1);
        assert!(matches!(master.get_replica_list("k"), Err(Error::Recovering(_))), "files from before served");
        let (master, client) = restarted();
        let api: Arc<dyn MasterApi> = master.service().clone();
        assert_eq!(tier.announce(&*api, client).unwrap(), 1);
        assert_eq!(master.get_replica_list("k").unwrap().len, value.len() as u64);
    }
}
