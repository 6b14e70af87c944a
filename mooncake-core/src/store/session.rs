//! A client's session with the master: connecting (segment, SSD tier, record
//! endpoint), heartbeats, re-registering after the master forgot us, the SSD
//! tier's offload thread, and leaving (`flush`, `close`, drop).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crossbeam_channel::bounded;
use mooncake_transfer::{RegisteredRegion, TransferEngine};
use parking_lot::Mutex;

use super::builder::StoreBuilder;
use super::file_storage::{self, DiskPeers, FileStorage};
use super::leases::LeaseReleaser;
use super::records::SegmentRecords;
use super::replica_cache::ReplicaCache;
use super::routes::Routes;
use super::stats::StoreCounters;
use super::write::RECOVERING_WAIT_MIN;
use super::{ClusterPart, OwnSegment, RecordEndpoint, Store, StoreInner, CLOSED};
use crate::error::{Error, Result};
use crate::master::{ClientId, MasterApi};
use crate::rpc::RpcServer;
use mooncake_alloc::SegmentId;

/// How soon a heartbeat the master did not answer is sent again (instead of a whole
/// period later): a restarted master hears from its nodes, and has their objects
/// back, within this of listening.
const UNANSWERED_RETRY: Duration = Duration::from_millis(20);

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

/// Tells `master` where to send changes to `client`'s records: the endpoint we serve
/// them on, or `records` itself for a master of this process (nothing without one).
/// A master that cannot reach the endpoint is logged: the node then learns its
/// records with its heartbeats.
fn announce_records(
    master: &dyn MasterApi,
    endpoint: Option<&RecordEndpoint>,
    records: &Arc<SegmentRecords>,
    client: ClientId,
) -> bool {
    let announced = match endpoint {
        Some(RecordEndpoint::Rpc { server, key }) => {
            master.mount_records(client, &server.local_addr().to_string(), key)
        }
        Some(RecordEndpoint::InProcess(master)) => master.attach_records(client, records.clone()),
        None => Ok(()),
    };
    match announced {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "the master cannot reach our record endpoint");
            false
        }
    }
}

/// Watches a master daemon for going away ([`MasterApi::await_hangup`]) on a thread
/// of its own, and wakes the heartbeat when it does: a master killed and restarted
/// at once is asked within milliseconds, not up to a heartbeat period later, so
/// this node re-mounts sooner, and the reconnection note (`reconnected`) reaches
/// the new master as soon as it listens: a client new to it meanwhile gets
/// `Recovering`, not `NotFound`, for an object this node holds.
fn watch_master(inner: &Arc<StoreInner>, period: Duration) -> Result<()> {
    let master = inner.master.clone();
    let weak: Weak<StoreInner> = Arc::downgrade(inner);
    std::thread::Builder::new()
        .name("mooncake-master-watch".into())
        .spawn(move || loop {
            let hung_up = master.await_hangup(period);
            let Some(inner) = weak.upgrade() else { return };
            if inner.client() == CLOSED {
                return;
            }
            if hung_up {
                let _ = inner.heartbeat_wake.try_send(());
            }
        })
        .map(|_| ())
        .map_err(|e| Error::InvalidArgument(format!("cannot start the master watch thread: {e}")))
}

impl StoreInner {
    pub(super) fn client(&self) -> ClientId {
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
                if let Err(e) = ssd.announce(&*self.master, self.client()) {
                    // Asked again next heartbeat: until then the new leader does not
                    // know the objects only our SSD holds.
                    cluster.set_remounted();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Has the SSD tier write what our segments hold that is on no SSD, until the
    /// master says nothing is left; `Timeout` (naming `what` waited) at `deadline`.
    pub(super) fn flush_until(&self, deadline: Instant, what: &str) -> Result<()> {
        // Each ask walks the master's whole index: asked again soon while the count
        // falls, less and less often (down to 5 times a second) while it does not.
        const FIRST: Duration = Duration::from_millis(5);
        let (mut pause, mut before) = (FIRST, u64::MAX);
        loop {
            let left = self.master.flush_segments(self.client())?;
            if left == 0 {
                return Ok(());
            }
            if left < before {
                pause = FIRST;
            }
            before = left;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout(format!("{what}: {left} objects still not on the SSD tier")));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(200));
        }
    }

    /// Our memory by segment id: the segment, or in a cluster the extents mounted.
    pub(super) fn segment_regions(&self) -> Vec<(SegmentId, Arc<RegisteredRegion>)> {
        #[allow(unused_mut)]
        let mut regions: Vec<_> = self.segment.lock().iter().map(|s| (s.id, s.region.clone())).collect();
        #[cfg(feature = "etcd")]
        if let Some((cluster, _)) = &self.cluster {
            regions.extend(cluster.extent_regions());
        }
        regions
    }

    /// Registers again after the master forgot us (we expired, or it restarted) and
    /// re-mounts the same memory with the objects it still holds. Records whose bytes
    /// no longer match their checksum are not offered. `missed`: we may have missed
    /// record updates (silent for longer than a TTL to a master that was running),
    /// which the master is told first (`MasterApi::missed_updates`).
    fn rejoin(&self, missed: bool) -> Result<()> {
        let reg = self.master.register_client()?;
        let client = reg.client;
        if missed {
            // Before anything is offered: what only we hold may be older than what
            // a node still on its way back holds.
            if let Err(e) = self.master.missed_updates(client) {
                tracing::debug!(error = %e, "the master does not take the note that we may have missed updates");
            }
        }
        // Before anything is offered too: a copy a node forgotten before its removal
        // offers (ours, or another's) is refused or dropped by these.
        if let Err(e) = self.records.offer_tombstones(&*self.master, client) {
            tracing::warn!(error = %e, "cannot hand the master the removals we keep for it");
        }
        // Announced before the segment is placeable again, so that no put placed on
        // it is acknowledged before we hold its record (the master waits for the
        // endpoint it knows).
        if !announce_records(&*self.master, self.record_endpoint.as_ref(), &self.records, client) {
            StoreCounters::inc(&self.counters.record_mount_failures, 1);
        }
        let mut seg = self.segment.lock();
        if let Some(s) = seg.as_mut() {
            let region = &s.region;
            self.records.begin_mount();
            let records = self.records.rejoin(region);
            let (id, taken) =
                self.master.remount_segment(client, &self.engine.remote(s.region.id()), s.region.len(), &records)?;
            s.id = id;
            self.own_segment.store(id, Ordering::Release);
            self.records.set_segment(id);
            tracing::warn!(segment = id, objects = taken, "segment re-mounted");
        }
        drop(seg);
        if let Some(grace_ms) = self.records.drain.drained() {
            // A re-mounted segment starts out placeable: a drained node marks it
            // draining again (and drains whatever landed there meanwhile).
            if let Err(e) = self.master.drain_segment(self.engine.endpoint(), grace_ms) {
                tracing::warn!(error = %e, "cannot mark our re-mounted segment draining");
            }
        }
        self.client.store(client, Ordering::Release);
        if let Some(ssd) = &self.ssd {
            ssd.announce(&*self.master, client)?;
        }
        tracing::warn!(client = format!("{client:#x}"), "client re-registered with the master");
        Ok(())
    }
}

impl Store {
    /// Cluster mode: connects to the masters of the cluster at `address`
    /// (`etcd://...`) and gives our memory as one extent per slot group.
    #[cfg(feature = "etcd")]
    pub(super) fn connect_cluster(mut cfg: StoreBuilder, address: &str, engine: TransferEngine) -> Result<Store> {
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
            let handler: Arc<dyn crate::rpc::RpcHandler> = Arc::new(super::cluster::ClusterRecords(cluster.clone()));
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

    pub(super) fn connect(
        cfg: StoreBuilder,
        master: Arc<dyn MasterApi>,
        engine: TransferEngine,
        cluster: ClusterPart,
    ) -> Result<Store> {
        // A daemon can go away beside us: watched (see `watch_master`).
        let master_daemon = cfg.master_address.is_some() && cfg.master.is_none() && cluster.is_none();
        let reg = master.register_client()?;
        let client = reg.client;
        let gives_memory = cfg.global_segment_size > 0;
        // The segment's records, and the endpoint the master tells them on, exist
        // (and are announced) before the segment is mounted: from its first put the
        // master has an endpoint to wait for, so no put is acknowledged before we hold
        // its record.
        let records = Arc::new(SegmentRecords::new(0));
        records.begin_mount();
        let record_endpoint = match (gives_memory, &cfg.master, &cfg.master_address) {
            (false, _, _) => None,
            (true, Some(m), _) => Some(RecordEndpoint::InProcess(m.clone())),
            (true, None, Some(_)) => {
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
            (true, None, None) => None,
        };
        let announced = announce_records(&*master, record_endpoint.as_ref(), &records, client);
        let segment = if gives_memory {
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
        let own = segment.as_ref().map_or(0, |s| s.id);
        records.set_segment(own);
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
        // A master daemon that goes away wakes the heartbeat (see `watch_master`).
        let (wake_tx, wake_rx) = bounded::<()>(1);
        if let Some(ssd) = &ssd {
            records.set_disk(ssd.discarder());
        }
        #[cfg(feature = "etcd")]
        if let (Some((cluster, _)), Some(ssd)) = (&cluster, &ssd) {
            cluster.set_disk(ssd.discarder());
        }
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
            routes: Routes::default(),
            replicate: cfg.replicate,
            counters: StoreCounters {
                record_mount_failures: AtomicU64::new(u64::from(!announced)),
                phase_times: cfg
                    .phase_times
                    .unwrap_or_else(|| std::env::var("MOONCAKE_PHASE_TIMES").is_ok_and(|v| v.trim() == "1")),
                ..StoreCounters::default()
            },
            records,
            record_endpoint,
            // A master passed in (`StoreBuilder::master`) or built here from the
            // builder's config is in this process; a daemon or a cluster is not.
            master_is_remote: cfg.master_address.is_some() || cluster.is_some(),
            flush_timeout: cfg.flush_timeout,
            recovering_wait: RECOVERING_WAIT_MIN.max(Duration::from_millis(reg.client_ttl_ms.saturating_mul(3))),
            cluster,
            _heartbeat_stop: stop_tx,
            heartbeat_wake: wake_tx,
            pinned: super::device::PinnedRegions::new(cfg.page_lock_piece),
            ahead: Default::default(),
        });
        // Heartbeats get their own thread so that no amount of I/O delays them.
        let weak: Weak<StoreInner> = Arc::downgrade(&inner);
        // Well within the TTL, and often enough that segment records stay fresh.
        let period = Duration::from_millis((reg.client_ttl_ms / 4).clamp(1, 250));
        let ttl = Duration::from_millis(reg.client_ttl_ms);
        std::thread::Builder::new()
            .name("mooncake-heartbeat".into())
            .spawn(move || {
                // Since when the master has not answered (`None` while it does).
                let mut failing: Option<Instant> = None;
                // When a master last answered us: silent for longer than a TTL to a
                // master that kept running (it refused no connection meanwhile), we
                // may have been forgotten, and missed removals and puts of what we
                // hold.
                let mut last_answered = Instant::now();
                loop {
                    // A master that stopped answering is asked again soon: once it is
                    // back (restarted), this node re-mounts at once, and its objects are
                    // readable again without waiting out a period.
                    let wait = if failing.is_some() { period.min(UNANSWERED_RETRY) } else { period };
                    crossbeam_channel::select! {
                        recv(stop_rx) -> _ => return,
                        // The master went away: asked at once (then every
                        // `UNANSWERED_RETRY` until it answers).
                        recv(wake_rx) -> _ => {}
                        default(wait) => {}
                    }
                    let Some(inner) = weak.upgrade() else { return };
                    if inner.client() == CLOSED {
                        return;
                    }
                    let answered = match inner.heartbeat() {
                        Ok(()) => {
                            last_answered = Instant::now();
                            true
                        }
                        Err(Error::UnknownClient(_)) => {
                            let old_master_gone = inner
                                .master
                                .last_refused()
                                .filter(|&at| at > last_answered)
                                .unwrap_or_else(Instant::now);
                            let silent = old_master_gone.saturating_duration_since(last_answered);
                            let missed = silent > ttl;
                            if missed {
                                tracing::warn!(
                                    ?silent,
                                    "silent for longer than the client TTL: we may have missed updates"
                                );
                            }
                            match inner.rejoin(missed) {
                                Ok(()) => last_answered = Instant::now(),
                                // Asked again next round, with the same silence: a
                                // rejoin that failed must not lose the note.
                                Err(e) => tracing::error!(error = %e, "cannot re-register with the master"),
                            }
                            true
                        }
                        // Unreachable master: keep our identity and try again; said once
                        // per outage (then quietly, as the retries come fast).
                        Err(e) if failing.is_none() => {
                            tracing::warn!(error = %e, "heartbeat failed; asking again every {UNANSWERED_RETRY:?}");
                            false
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "heartbeat failed");
                            false
                        }
                    };
                    match (answered, failing) {
                        (true, Some(since)) => {
                            tracing::warn!(after = ?since.elapsed(), "the master answers again");
                            failing = None;
                        }
                        (false, None) => failing = Some(Instant::now()),
                        _ => {}
                    }
                    super::drain::poll(&inner);
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("cannot start the heartbeat thread: {e}")))?;
        if master_daemon {
            watch_master(&inner, period)?;
        }
        if let Some(ssd) = &inner.ssd {
            // This announce reaches every leader the extents were just mounted with:
            // the heartbeat need not announce again for those mounts.
            #[cfg(feature = "etcd")]
            if let Some((cluster, _)) = &inner.cluster {
                cluster.take_remounted();
            }
            ssd.announce(&*inner.master, client)?;
            spawn_offloader(&inner, ssd.interval())?;
        }
        Ok(Store { inner })
    }

    /// Returns once every object this client's segment holds is on its SSD tier, so
    /// that dropping the store loses nothing (under `PersistPolicy::Lazy` objects
    /// otherwise live only in memory until eviction needs their room).
    /// `InvalidArgument` without an SSD tier; `Timeout` after the builder's
    /// [`flush_timeout`](super::StoreBuilder::flush_timeout).
    pub fn flush(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.ssd.is_none() {
            return Err(Error::InvalidArgument("flush needs an SSD tier: build the store with ssd_offload(..)".into()));
        }
        inner.flush_until(Instant::now() + inner.flush_timeout, "flush")
    }

    /// Flushes (with an SSD tier) and leaves the master: the segment is unmounted
    /// now rather than when the last handle drops. Other handles of this store fail
    /// afterwards.
    pub fn close(self) -> Result<()> {
        if self.inner.ssd.is_some() {
            self.flush()?;
        }
        let client = self.inner.client.swap(super::CLOSED, std::sync::atomic::Ordering::AcqRel);
        self.inner.master.unregister_client(client).map(|_| ())
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
                ssd.retry_pending();
            }
            drop(inner);
            if !busy {
                std::thread::sleep(idle);
            }
        })
        .map(|_| ())
        .map_err(|e| Error::InvalidArgument(format!("cannot start the offload thread: {e}")))
}
