//! The master service: its state, and the handle that owns it.
//!
//! The service's calls are facets in sibling files (`clients`, `objects`, `disk`,
//! `eviction`, `records`, `liveness`, `stats`), each an `impl MasterService` block
//! over the state declared here.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::{Mutex, RwLock};

use crate::config::MasterConfig;
use crate::error::{Error, Result};
use crate::master::object::ObjectIndex;
use crate::master::segment::{ClientRecord, SegmentTable};
use crate::master::types::ClientId;

#[derive(Default)]
/// Event counters of the master (gauges are computed by `stats`).
pub(crate) struct MasterCounters {
    pub(super) evicted_objects: AtomicU64,
    pub(super) evicted_bytes: AtomicU64,
    pub(super) lease_refusals: AtomicU64,
    pub(super) put_timeouts: AtomicU64,
    pub(super) expired_clients: AtomicU64,
    pub(super) stall_graces: AtomicU64,
    pub(super) pending_puts: AtomicU64,
    pub(super) under_replicated_puts: AtomicU64,
    pub(super) segment_failures: AtomicU64,
    pub(super) record_failures: AtomicU64,
    pub(super) stale_copies: AtomicU64,
    pub(super) carried_tombstones: AtomicU64,
    pub(super) declared_puts: AtomicU64,
    pub(super) bound_puts: AtomicU64,
}

/// The master service: an in-process object. Use it through [`Master`].
pub struct MasterService {
    pub(super) config: MasterConfig,
    pub(super) epoch: Instant,
    pub(super) index: ObjectIndex,
    /// Lock order: a shard of `index`, then `clients`, then `segments` (a thread that
    /// holds one may take those after it, never those before).
    pub(super) segments: RwLock<SegmentTable>,
    pub(super) clients: RwLock<ahash::HashMap<ClientId, ClientRecord>>,
    pub(super) next_segment: AtomicU64,
    pub(super) counters: MasterCounters,
    /// Serializes eviction passes (puts that need room wait for the running one).
    pub(super) eviction: Mutex<()>,
    /// Last tick of the liveness monitor (ms), to detect that the master was stalled.
    pub(super) last_tick_ms: AtomicU64,
    /// Random per start (see [`ClientRegistration::incarnation`](crate::ClientRegistration)).
    pub(super) incarnation: u64,
    /// How to reach storage nodes' record endpoints (unset: heartbeats only).
    pub(super) record_connector: std::sync::OnceLock<Arc<dyn crate::master::record_link::RecordConnector>>,
    /// Hands out the generations that order every change of a key.
    pub(super) gens: crate::master::generations::GenClock,
    /// Generation high-water marks of keys whose old copies may still be offered: a
    /// record or file older than its key's last removal is refused.
    pub(super) tombstones: crate::master::tombstones::Tombstones,
    /// Whether an index shard may hold generations of copies taken back in a
    /// recovery window (`master/recovered.rs`): the monitor drops them once no
    /// window is open.
    pub(super) recovered_noted: std::sync::atomic::AtomicBool,
    /// Removals that evictions and dropped puts queued (not waited for) and that have
    /// not reached their nodes yet: a later remove or put of the key waits for them.
    pub(super) unsent_removals: crate::master::record_link::UnsentRemovals,
    /// Links with records queued by puts that declared their checksum, to send once
    /// the `put_start` is answered (`RpcHandler::work_after_answer`); one entry per
    /// node at most.
    pub(super) send_after_answer: crate::master::record_link::LinksToSend,
    /// Replicas of upserts whose object went away under them (its last replica's
    /// node was lost, its disk replica evicted) while their writer may still be
    /// writing them: held, so that their space is not given to another object
    /// meanwhile, until the upsert's deadline (`put_timeout`); then the monitor moves
    /// them to `quarantined` for a put timeout more. (The writer's `upsert_end`
    /// answers `NotFound`, and `Store::upsert` starts again.)
    pub(super) orphaned_upserts: Mutex<Vec<(u64, crate::master::object::Replicas)>>,
    /// The room of puts dropped before their end while their writers may still be
    /// writing there (revoked, reclaimed after `put_timeout`, their writer
    /// forgotten), with until when (ms) it is kept: allocated to no object, neither
    /// readable nor placeable, so that late bytes land in no other object; then the
    /// monitor frees it (`MasterService::quarantine_put`).
    pub(super) quarantined: Mutex<Vec<(u64, crate::master::object::Replicas)>>,
    /// The last puts and upserts revoked, by (client, key): a revoke asked again
    /// (sent again after a broken connection whose first copy was served) is
    /// answered as the first was, not `NotFound` (`MasterService::note_revoked`).
    pub(super) revoked: Mutex<std::collections::VecDeque<(ClientId, Box<str>)>>,
    /// Keys whose entry holds retired replicas (an upsert's old ones): the monitor
    /// frees them once their time is up, even for a key never touched again (a reader
    /// that died never gives its lease back).
    pub(super) retiring: Mutex<ahash::HashSet<Box<str>>>,
    /// Until when (ms) the master counts as recovering from a restart: set by each
    /// segment re-mounted with its objects, for one client TTL (every surviving
    /// client re-mounts within it). Meanwhile a missing key or a lack of segments is
    /// `Error::Recovering`, which callers retry, not `NotFound` or `NoSpace`.
    pub(super) recovering_until_ms: AtomicU64,
    /// Cluster mode: the slot groups this master leads (unset: it answers every key).
    pub(super) ownership: std::sync::OnceLock<Arc<dyn crate::master::ownership::KeyOwnership>>,
    /// Cluster mode: until when (ms) each group taken over waits for its extents.
    pub(super) group_recovering: Mutex<ahash::HashMap<u32, GroupRecovery>>,
    /// The latest `until` ever put in `group_recovering`: once it is past, no group
    /// recovers, and a put need not take the map's lock to learn it.
    pub(super) group_recovering_latest_ms: AtomicU64,
    /// Cluster mode: groups taken and given up.
    pub(super) cluster_counters: ClusterCounters,
    /// Placements clients hold ahead of their puts (`master/held.rs`).
    pub(super) held: crate::master::held::HeldPlacements,
    /// Drains by node (`master/drain.rs`): what each draining node last reported.
    pub(super) drains: Mutex<ahash::HashMap<String, crate::master::drain::DrainProgress>>,
}

/// Counters of slot-group changes (cluster mode).
#[derive(Default)]
pub(crate) struct ClusterCounters {
    pub(super) groups_acquired: AtomicU64,
    pub(super) groups_released: AtomicU64,
    pub(super) moved_answers: AtomicU64,
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
            counters: MasterCounters::default(),
            eviction: Mutex::new(()),
            last_tick_ms: AtomicU64::new(0),
            incarnation: rand::random::<u64>() | 1,
            record_connector: std::sync::OnceLock::new(),
            gens: Default::default(),
            tombstones: Default::default(),
            recovered_noted: Default::default(),
            unsent_removals: Default::default(),
            send_after_answer: Default::default(),
            orphaned_upserts: Default::default(),
            quarantined: Default::default(),
            revoked: Default::default(),
            retiring: Default::default(),
            recovering_until_ms: AtomicU64::new(0),
            ownership: std::sync::OnceLock::new(),
            group_recovering: Default::default(),
            group_recovering_latest_ms: AtomicU64::new(0),
            cluster_counters: Default::default(),
            held: Default::default(),
            drains: Default::default(),
        });
        spawn_monitor(&service)?;
        Ok(Self { service })
    }

    /// Counters and gauges of the master (kept up to date: cheap at any size).
    pub fn stats(&self) -> crate::master::types::MasterStats {
        self.service.collect_stats()
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
    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// Starts the monitor. It holds only a weak reference and exits once the service is
/// dropped.
fn spawn_monitor(service: &Arc<MasterService>) -> Result<()> {
    let weak = Arc::downgrade(service);
    let interval = service.config.monitor_interval;
    service.last_tick_ms.store(service.now_ms(), Ordering::Relaxed);
    std::thread::Builder::new()
        .name("mooncake-master-monitor".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            match weak.upgrade() {
                Some(service) => service.tick(),
                None => return,
            }
        })
        .map(|_| ())
        .map_err(|e| Error::InvalidArgument(format!("cannot start the master monitor: {e}")))
}

/// A slot group this master took over, while its nodes re-mount its extents.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupRecovery {
    /// Until when (ms) a missing key of the group may still come back.
    pub(crate) until_ms: u64,
    /// An extent of the group came back with objects: only then may a put of a
    /// missing key take a key a node still brings back (so it waits too).
    pub(crate) objects_back: bool,
}
