//! A client of a cluster of masters (`etcd://H:P[,H:P]/NAME`): the [`MasterApi`] a
//! `Store` talks to in cluster mode, and the node's side of its memory in a cluster.
//!
//! Layout:
//! - `routing`: where each call goes. A keyed call goes to the leader of the key's
//!   slot group, as the slot map watched in etcd says; a batch call is split by leader
//!   (a per-map table from group to leader, a counting sort of the items), every
//!   leader's part is written on its connection before any answer is read (merged with
//!   the parts of concurrent calls of the same shape into one request per master:
//!   `combine`), and the answers are gathered and put back in item order. A `Moved` answer
//!   (the map here was stale), an unreachable leader (it just died) or `Recovering` (a
//!   new leader waits for the nodes' extents) is retried, for those items only, as the
//!   map changes, for up to `retry_for`.
//! - `api`: the [`MasterApi`] itself, generated from the table of master calls
//!   (`master::master_calls!`) by each call's route tag; `own`: the few calls routed
//!   by hand (registration, heartbeats, listing, the SSD tier's plans).
//! - `sessions`: the client registers with every master (its client id differs per
//!   master; calls carry the id of the master they go to) and heartbeats each on a
//!   thread of its own.
//! - `extents`: a storage node cuts its memory into one extent per slot group, each
//!   its own registered region, and mounts each with its group's leader, offering the
//!   records of the objects it holds. When a group's leader changes, the extent is
//!   mounted with the new one on the next heartbeat: that is how a new leader rebuilds
//!   the group.
//! - the changes masters make to those records arrive at the store's record endpoint
//!   (`store::cluster`).

mod api;
mod combine;
mod extents;
mod own;
mod routing;
mod sessions;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::SegmentId;
use mooncake_transfer::TransferEngine;
use parking_lot::{Mutex, RwLock};

use crate::cluster::{SlotMap, SlotMapWatcher};
use crate::error::{Error, Result};
use crate::master::{ClientId, RecordUpdate};
use crate::store::records::SegmentRecords;

pub(crate) use extents::Extent;
use routing::Routes;
use sessions::Session;

/// Longest wait for one master's answer before the call is routed again.
pub(crate) const SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the client reads the slot map: the watcher of the cluster's etcd, or in unit
/// tests a map the test sets.
pub(crate) trait MapSource: Send + Sync {
    /// The latest map.
    fn map(&self) -> Arc<SlotMap>;
    /// Blocks until the map's version differs from `seen` or `timeout` passed.
    fn wait_change(&self, seen: u64, timeout: Duration) -> Arc<SlotMap>;
}

impl MapSource for SlotMapWatcher {
    fn map(&self) -> Arc<SlotMap> {
        SlotMapWatcher::map(self)
    }

    fn wait_change(&self, seen: u64, timeout: Duration) -> Arc<SlotMap> {
        SlotMapWatcher::wait_change(self, seen, timeout)
    }
}

/// The [`MasterApi`](crate::master::MasterApi) of a cluster of masters; see the module
/// docs.
pub(crate) struct ClusterClient {
    /// Itself, for the sessions' heartbeat threads.
    me: std::sync::Weak<ClusterClient>,
    maps: Box<dyn MapSource>,
    /// The routing table of the latest map seen (rebuilt when the map changes).
    routes: Mutex<Arc<Routes>>,
    secret: Option<Vec<u8>>,
    timeout: Duration,
    retry_for: Duration,
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    /// The batch calls' rounds in flight, and the calls waiting for the next (see
    /// `combine`).
    rounds: combine::Rounds,
    /// The id the store sees; each master knows us by its own.
    logical: ClientId,
    /// Whether the store registered (new sessions then register at once).
    registered: AtomicBool,
    /// Which master answered for a segment / a client id (disk replicas), learnt from
    /// the answers routed, for the calls that name them and no key.
    segment_home: RwLock<HashMap<SegmentId, String>>,
    client_home: RwLock<HashMap<ClientId, String>>,
    pub(crate) extents: Vec<Extent>,
    /// Our record endpoint and the key a master proves there.
    record_endpoint: Mutex<Option<(String, Vec<u8>)>>,
    /// An extent was mounted with a new leader: the SSD tier should announce its
    /// objects again (the store takes it after a heartbeat).
    remounted: AtomicBool,
    /// The shortest client TTL of the masters registered with (ms).
    client_ttl_ms: AtomicU64,
    /// When a master of the cluster last answered a heartbeat (ms since `started`):
    /// the store's heartbeat fails once none has for half a client TTL.
    last_answer_ms: AtomicU64,
    started: Instant,
    /// Record updates for a segment not (yet) known to be one of our extents.
    pub(crate) unrouted: Mutex<Vec<(Instant, RecordUpdate)>>,
    /// This node's SSD tier, which `Discard` updates are for.
    pub(crate) disk: std::sync::OnceLock<Arc<dyn crate::store::records::DiskDiscard>>,
    /// A master asked this node to drain (`RecordUpdate::Drain`; see `store::drain`).
    pub(crate) drain_asked: crate::store::drain::DrainAsk,
    /// This node drained (its endpoint and the drain's grace in ms): it stays draining
    /// until it leaves, so every extent mounted from then on is marked draining at its
    /// master at once (`extents`), as `rejoin` does for a single master's segment.
    drained: Mutex<Option<(String, u64)>>,
    /// Masters where marking our extents draining failed: tried again with the next
    /// heartbeat.
    mark_due: Mutex<Vec<String>>,
}

/// How record updates reached this node, which decides what happens to those it
/// cannot keep (updates for extents whose mount answer is still on its way, past
/// `store::cluster::MAX_UNROUTED`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum UpdatesFrom {
    /// Sent to our record endpoint: a master waits for our answer and sends again
    /// what we refuse, so a batch we cannot keep whole is refused whole (applied
    /// later, never acknowledged and dropped).
    Endpoint,
    /// In a heartbeat's answer (queued for us before our record endpoint was known):
    /// nobody sends them again, so what fits is kept.
    Heartbeat,
}

impl ClusterClient {
    /// Connects to the cluster at `address` (loads the slot map). With
    /// `segment_size > 0`, registers one extent per slot group with `engine`.
    pub(crate) fn connect(
        address: &str,
        credentials: &crate::cluster::EtcdCredentials,
        secret: Option<&[u8]>,
        timeout: Duration,
        engine: &TransferEngine,
        segment_size: u64,
    ) -> Result<Arc<Self>> {
        let addr: crate::cluster::EtcdAddress = address.parse()?;
        let watcher = SlotMapWatcher::connect_with(&addr, credentials)?;
        let groups = watcher.map().groups();
        let mut extents = Vec::new();
        if segment_size > 0 {
            // Page-aligned shares; what does not divide evenly stays unused.
            let share = (segment_size / groups as u64) & !4095;
            if share == 0 {
                return Err(Error::InvalidArgument(format!(
                    "global_segment_size {segment_size} is too small for a cluster of {groups} slot groups \
                     (each group gets an extent of at least 4 KiB)"
                )));
            }
            for group in 0..groups {
                let region = engine.register_region(share)?;
                let remote = engine.remote(region.id());
                extents.push(Extent {
                    group,
                    region,
                    remote,
                    records: SegmentRecords::new(0),
                    mount: Mutex::new(None),
                });
            }
        }
        Ok(Self::with_maps(Box::new(watcher), secret, timeout, Duration::from_secs(15), extents))
    }

    /// A client reading its slot maps from `maps`, giving `extents` to the cluster;
    /// calls are routed again for up to `retry_for` while the map moves on.
    fn with_maps(
        maps: Box<dyn MapSource>,
        secret: Option<&[u8]>,
        timeout: Duration,
        retry_for: Duration,
        extents: Vec<Extent>,
    ) -> Arc<Self> {
        let routes = Mutex::new(Arc::new(Routes::new(maps.map())));
        Arc::new_cyclic(|me| Self {
            me: me.clone(),
            maps,
            routes,
            secret: secret.map(<[u8]>::to_vec),
            // A leader that stopped answering (its slots move within a lease) must not
            // hold a call for the store's whole master timeout.
            timeout: timeout.min(SESSION_TIMEOUT),
            retry_for,
            sessions: RwLock::new(HashMap::new()),
            rounds: combine::Rounds::default(),
            logical: rand::random::<u64>() | 1,
            registered: AtomicBool::new(false),
            segment_home: RwLock::new(HashMap::new()),
            client_home: RwLock::new(HashMap::new()),
            extents,
            record_endpoint: Mutex::new(None),
            remounted: AtomicBool::new(false),
            client_ttl_ms: AtomicU64::new(u64::MAX),
            last_answer_ms: AtomicU64::new(0),
            started: Instant::now(),
            unrouted: Mutex::new(Vec::new()),
            disk: std::sync::OnceLock::new(),
            drain_asked: Default::default(),
            drained: Mutex::new(None),
            mark_due: Mutex::new(Vec::new()),
        })
    }

    /// Where masters send changes to our extents' records (set once the store serves
    /// them); sessions registered from now on announce it.
    pub(crate) fn set_record_endpoint(&self, endpoint: String, key: Vec<u8>) {
        *self.record_endpoint.lock() = Some((endpoint, key));
    }

    /// Whether this node gives memory to the cluster.
    pub(crate) fn has_extents(&self) -> bool {
        !self.extents.is_empty()
    }

    /// Takes the "an extent moved to a new leader" flag (see `remounted`).
    pub(crate) fn take_remounted(&self) -> bool {
        self.remounted.swap(false, Ordering::AcqRel)
    }

    /// Sets the "an extent moved to a new leader" flag again: the SSD tier's announce
    /// it asked for failed, and must be tried again.
    pub(crate) fn set_remounted(&self) {
        self.remounted.store(true, Ordering::Release);
    }

    /// This node (at `node`, its transfer endpoint) drains with `grace_ms`: from now
    /// on every extent it mounts is marked draining at once (see `drained`).
    pub(crate) fn set_drained(&self, node: &str, grace_ms: u64) {
        *self.drained.lock() = Some((node.to_owned(), grace_ms));
    }
}

#[cfg(test)]
mod tests;
