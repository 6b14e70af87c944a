//! A client of a cluster of masters (`etcd://H:P[,H:P]/NAME`): the [`MasterApi`] a
//! `Store` talks to in cluster mode, and the node's side of its memory in a cluster.
//!
//! Routing: each keyed call goes to the leader of the key's slot group, as the slot
//! map watched in etcd says; batch calls are split by leader and their answers put
//! back in order. A `Moved` answer (the map here was stale), an unreachable leader (it
//! just died) or `Recovering` (a new leader waits for the nodes' extents) is retried
//! as the map changes, for up to `retry_for`.
//!
//! Sessions: the client registers with every master (its client id differs per
//! master; calls carry the id of the master they go to) and heartbeats each.
//!
//! Extents: a storage node cuts its memory into one extent per slot group, each its
//! own registered region, and mounts each with its group's leader, offering the records
//! of the objects it holds. When a group's leader changes, the extent is mounted with
//! the new one on the next heartbeat: that is how a new leader rebuilds the group.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::SegmentId;
use mooncake_transfer::{RegisteredRegion, RemoteRegion, SharedSecret, TransferEngine};
use parking_lot::{Mutex, RwLock};

use crate::cluster::{SlotMap, SlotMapWatcher};
use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{
    ClientId, ClientRegistration, MasterApi, MasterStats, MemoryReplica, ObjectInfo, ObjectRecord, OffloadPlan,
    RecordUpdate, ReplicaList, ReplicatePlan, SegmentInfo,
};
use crate::rpc::wire::{Request, Response, WireError};
use crate::rpc::{RpcHandler, RpcMasterClient};
use crate::store::records::SegmentRecords;

/// Most record updates kept for extents whose mount answer has not arrived yet.
const MAX_UNROUTED: usize = 65_536;

/// Longest wait for one master's answer before the call is routed again.
const SESSION_TIMEOUT: Duration = Duration::from_secs(5);

/// One master of the cluster, as this client knows it.
struct Session {
    addr: String,
    rpc: RpcMasterClient,
    /// Our client id at this master (0: not registered).
    client: AtomicU64,
    /// Held while registering (see `register_session`).
    registering: Mutex<()>,
}

/// One extent of this node's memory: the share of one slot group.
struct Extent {
    group: u32,
    region: Arc<RegisteredRegion>,
    remote: RemoteRegion,
    records: SegmentRecords,
    /// Where it is mounted now: (master address, segment id, leader epoch).
    mount: Mutex<Option<(String, SegmentId, u64)>>,
}

/// The [`MasterApi`] of a cluster of masters; see the module docs.
pub(crate) struct ClusterClient {
    /// Itself, for the sessions' heartbeat threads.
    me: std::sync::Weak<ClusterClient>,
    watcher: SlotMapWatcher,
    secret: Option<Vec<u8>>,
    timeout: Duration,
    retry_for: Duration,
    sessions: RwLock<HashMap<String, Arc<Session>>>,
    /// The id the store sees; each master knows us by its own.
    logical: ClientId,
    /// Whether the store registered (new sessions then register at once).
    registered: AtomicBool,
    /// Which master answered for a segment / a client id (disk replicas), learnt from
    /// the answers routed, for the calls that name them and no key.
    segment_home: RwLock<HashMap<SegmentId, String>>,
    client_home: RwLock<HashMap<ClientId, String>>,
    extents: Vec<Extent>,
    /// Where masters tell us of changes to our extents' records.
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
    unrouted: Mutex<Vec<(Instant, RecordUpdate)>>,
    /// This node's SSD tier, which `Discard` updates are for.
    disk: std::sync::OnceLock<Arc<dyn crate::store::records::DiskDiscard>>,
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
        Ok(Arc::new_cyclic(|me| Self {
            me: me.clone(),
            watcher,
            secret: secret.map(<[u8]>::to_vec),
            // A leader that stopped answering (its slots move within a lease) must not
            // hold a call for the store's whole master timeout.
            timeout: timeout.min(SESSION_TIMEOUT),
            retry_for: Duration::from_secs(15),
            sessions: RwLock::new(HashMap::new()),
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
        }))
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

    // ---- sessions --------------------------------------------------------------------

    /// The session with the master at `addr`, connecting (and registering, once the
    /// store registered) on first use.
    fn session(&self, addr: &str) -> Result<Arc<Session>> {
        if let Some(s) = self.sessions.read().get(addr) {
            return Ok(s.clone());
        }
        let rpc =
            RpcMasterClient::connect_with_timeout(addr, self.secret.as_deref().map(SharedSecret::new), self.timeout)?;
        let session =
            Arc::new(Session { addr: addr.to_owned(), rpc, client: AtomicU64::new(0), registering: Mutex::new(()) });
        let (session, new) = {
            let mut sessions = self.sessions.write();
            match sessions.get(addr) {
                Some(s) => (s.clone(), false),
                None => {
                    sessions.insert(addr.to_owned(), session.clone());
                    (session, true)
                }
            }
        };
        if new {
            self.spawn_heartbeats(&session)?;
            if self.registered.load(Ordering::Acquire) {
                self.id_at(&session)?;
            }
        }
        Ok(session)
    }

    /// Heartbeats `s` on a thread of its own, so that a master that stopped answering
    /// delays no other's heartbeats (the others would expire us meanwhile). Ends with
    /// the client, or once the session was replaced.
    fn spawn_heartbeats(&self, s: &Arc<Session>) -> Result<()> {
        let (me, session) = (self.me.clone(), Arc::downgrade(s));
        std::thread::Builder::new()
            .name("mooncake-cluster-heartbeat".into())
            .spawn(move || loop {
                let period = {
                    let Some(me) = me.upgrade() else { return };
                    let ttl = me.client_ttl_ms.load(Ordering::Relaxed).min(10_000);
                    Duration::from_millis((ttl / 4).clamp(1, 250))
                };
                std::thread::sleep(period);
                let (Some(me), Some(s)) = (me.upgrade(), session.upgrade()) else { return };
                if !me.registered.load(Ordering::Acquire) {
                    continue;
                }
                let Ok(id) = me.id_at(&s) else { continue };
                match s.rpc.heartbeat(id) {
                    Ok(updates) => {
                        me.note_answer();
                        me.apply_updates(updates);
                    }
                    Err(Error::UnknownClient(_)) => {
                        if me.register_session(&s, id).is_ok() {
                            me.note_answer();
                            // Its extents are mounted again on the store's next heartbeat.
                        }
                    }
                    Err(e) => tracing::debug!(master = s.addr, error = %e, "heartbeat failed"),
                }
            })
            .map(|_| ())
            .map_err(|e| Error::InvalidArgument(format!("cannot start a heartbeat thread: {e}")))
    }

    fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A master answered a heartbeat.
    fn note_answer(&self) {
        self.last_answer_ms.fetch_max(self.elapsed_ms(), Ordering::Relaxed);
    }

    /// Registers with one master, in place of the id `stale` it no longer knows (0:
    /// none yet), and tells it where our records are served. One registration at a
    /// time per master: callers that saw the same stale id share the new one (two ids
    /// would leave extents mounted under one that nobody heartbeats, and it expires).
    fn register_session(&self, s: &Session, stale: ClientId) -> Result<ClientId> {
        let _one = s.registering.lock();
        let current = s.client.load(Ordering::Acquire);
        if current != stale {
            return Ok(current);
        }
        let reg = s.rpc.register_client()?;
        self.note_answer();
        self.client_ttl_ms.fetch_min(reg.client_ttl_ms, Ordering::Relaxed);
        s.client.store(reg.client, Ordering::Release);
        if let Some((endpoint, key)) = self.record_endpoint.lock().clone() {
            if let Err(e) = s.rpc.mount_records(reg.client, &endpoint, &key) {
                tracing::warn!(master = s.addr, error = %e, "the master cannot reach our record endpoint");
            }
        }
        // Extents it led are not mounted there anymore: mount them again.
        for x in &self.extents {
            let mut m = x.mount.lock();
            if m.as_ref().is_some_and(|(a, _, _)| a == &s.addr) {
                *m = None;
            }
        }
        Ok(reg.client)
    }

    /// Our client id at `s`, registering if needed.
    fn id_at(&self, s: &Session) -> Result<ClientId> {
        match s.client.load(Ordering::Acquire) {
            0 => self.register_session(s, 0),
            id => Ok(id),
        }
    }

    /// Sessions with every master the map names (connecting to new ones).
    fn all_sessions(&self) -> Vec<Arc<Session>> {
        let map = self.watcher.map();
        for (_, addr) in map.masters() {
            if let Err(e) = self.session(&addr) {
                tracing::debug!(master = addr, error = %e, "master not reachable");
            }
        }
        let live: Vec<String> = map.masters().into_iter().map(|(_, a)| a).collect();
        self.sessions.read().values().filter(|s| live.contains(&s.addr)).cloned().collect()
    }

    /// Why the masters the slot map names cannot be reached (": " and their errors,
    /// or nothing if the map names none): a refused impostor or a wrong secret must
    /// not read as "is any running?".
    fn why_unreachable(&self) -> String {
        let errors: Vec<String> = self
            .watcher
            .map()
            .masters()
            .into_iter()
            .filter_map(|(_, addr)| self.session(&addr).err().map(|e| e.to_string()))
            .collect();
        if errors.is_empty() {
            String::new()
        } else {
            format!(": {}", errors.join("; "))
        }
    }

    // ---- routing ---------------------------------------------------------------------

    /// Runs `call` at the leader of `key`'s group, following moves (see module docs).
    fn on_key<T>(&self, key: &str, call: impl Fn(&Session, ClientId) -> Result<T>) -> Result<T> {
        let deadline = Instant::now() + self.retry_for;
        loop {
            let map = self.watcher.map();
            let group = map.group_of_key(key);
            let res = match map.leader(group) {
                None => Err(Error::Moved { slot: crate::cluster::key_slot(key), leader: None }),
                Some(l) => self.session(&l.addr).and_then(|s| {
                    let id = self.id_at(&s)?;
                    match call(&s, id) {
                        Err(Error::UnknownClient(_)) => {
                            let id = self.register_session(&s, id)?;
                            call(&s, id)
                        }
                        other => other,
                    }
                }),
            };
            match res {
                Err(e) if follows(&e) && Instant::now() < deadline => self.wait_for_map(&map, &e),
                other => return other,
            }
        }
    }

    /// Runs a batch call: items split by their keys' leaders, each part sent to its
    /// leader, answers put back in item order; items answered with a move are retried.
    fn on_keys<I: Clone + Sync, T: Send>(
        &self,
        items: &[I],
        key: impl Fn(&I) -> &str + Sync,
        call: impl Fn(&Session, ClientId, &[I]) -> Vec<Result<T>> + Sync,
    ) -> Vec<Result<T>> {
        let deadline = Instant::now() + self.retry_for;
        let mut results: Vec<Option<Result<T>>> = (0..items.len()).map(|_| None).collect();
        let mut pending: Vec<usize> = (0..items.len()).collect();
        loop {
            let map = self.watcher.map();
            let mut by_leader: HashMap<Option<String>, Vec<usize>> = HashMap::new();
            for &i in &pending {
                let leader = map.leader(map.group_of_key(key(&items[i]))).map(|l| l.addr.clone());
                by_leader.entry(leader).or_default().push(i);
            }
            let single = by_leader.len() == 1;
            // Each leader's part in parallel: a batch costs one round trip, not one per
            // leader.
            let parts: Vec<(Vec<usize>, Vec<Result<T>>)> = std::thread::scope(|scope| {
                let handles: Vec<_> = by_leader
                    .into_iter()
                    .map(|(leader, idx)| {
                        let (key, call) = (&key, &call);
                        let run = move || {
                            let answers = self.call_part(items, &idx, leader.as_deref(), key, call);
                            (idx, answers)
                        };
                        if single {
                            Err(run)
                        } else {
                            Ok(scope.spawn(run))
                        }
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| match h {
                        Ok(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                        Err(run) => run(),
                    })
                    .collect()
            });
            let mut retry = Vec::new();
            let mut last_error = None;
            for (idx, answers) in parts {
                for (i, r) in idx.into_iter().zip(answers) {
                    match r {
                        Err(e) if follows(&e) && Instant::now() < deadline => {
                            last_error = Some(e);
                            retry.push(i);
                        }
                        r => results[i] = Some(r),
                    }
                }
            }
            match last_error {
                Some(e) if !retry.is_empty() => {
                    self.wait_for_map(&map, &e);
                    pending = retry;
                }
                _ => break,
            }
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Timeout("cluster routing".into())))).collect()
    }

    /// One leader's part of a batch call (`leader` None: the group has none yet).
    fn call_part<I: Clone, T>(
        &self,
        items: &[I],
        idx: &[usize],
        leader: Option<&str>,
        key: &impl Fn(&I) -> &str,
        call: &impl Fn(&Session, ClientId, &[I]) -> Vec<Result<T>>,
    ) -> Vec<Result<T>> {
        let Some(addr) = leader else {
            return idx
                .iter()
                .map(|&i| Err(Error::Moved { slot: crate::cluster::key_slot(key(&items[i])), leader: None }))
                .collect();
        };
        let part: Vec<I> = idx.iter().map(|&i| items[i].clone()).collect();
        match self.session(addr).and_then(|s| self.id_at(&s).map(|id| (s, id))) {
            Ok((s, id)) => {
                let mut answers = call(&s, id, &part);
                if answers.iter().any(|r| matches!(r, Err(Error::UnknownClient(_)))) {
                    if let Ok(id) = self.register_session(&s, id) {
                        answers = call(&s, id, &part);
                    }
                }
                answers
            }
            Err(e) => idx.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Before retrying after `e`: a newer map (moves, dead leaders), or a short pause
    /// (a new leader waiting for its extents).
    fn wait_for_map(&self, seen: &SlotMap, e: &Error) {
        match e {
            Error::Recovering(_) | Error::HasLease(_) => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                self.watcher.wait_change(seen.version(), Duration::from_millis(100));
            }
        }
    }

    /// Runs `call` at the master that handed out `segment` (or at each until one
    /// knows it).
    fn on_segment<T>(&self, segment: SegmentId, call: impl Fn(&Session, ClientId) -> Result<T>) -> Result<T> {
        let home = self.segment_home.read().get(&segment).cloned();
        if let Some(addr) = home {
            if let Ok(s) = self.session(&addr) {
                if let Ok(id) = self.id_at(&s) {
                    if let Ok(v) = call(&s, id) {
                        return Ok(v);
                    }
                }
            }
        }
        let mut last = Error::NotFound(format!("segment {segment}"));
        for s in self.all_sessions() {
            match self.id_at(&s).and_then(|id| call(&s, id)) {
                Ok(v) => {
                    self.segment_home.write().insert(segment, s.addr.clone());
                    return Ok(v);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Remembers that the master at `addr` placed `replicas` (their segments are its).
    fn note_placed<'a>(&self, addr: &str, replicas: impl IntoIterator<Item = &'a MemoryReplica>) {
        let mut homes = self.segment_home.write();
        for r in replicas {
            homes.entry(r.segment).or_insert_with(|| addr.to_owned());
        }
    }

    /// Remembers which master answered for the segments and disk owners of `list`.
    fn note_homes(&self, addr: &str, list: &ReplicaList) {
        self.note_placed(addr, &list.replicas);
        if let Some(owner) = list.disk {
            self.client_home.write().insert(owner, addr.to_owned());
        }
    }

    // ---- extents ---------------------------------------------------------------------

    /// Mounts every extent whose group has a leader it is not mounted with.
    fn place_extents(&self) {
        let map = self.watcher.map();
        for x in &self.extents {
            let Some(leader) = map.leader(x.group) else { continue };
            let current = x.mount.lock().clone();
            if current.as_ref().is_some_and(|(a, _, e)| a == &leader.addr && *e == leader.epoch) {
                continue;
            }
            if let Err(e) = self.mount_extent_at(x, &leader.addr, leader.epoch) {
                tracing::debug!(group = x.group, master = leader.addr, error = %e, "extent not mounted yet");
            }
        }
    }

    /// Mounts `x` with the leader at `addr` (epoch `epoch`), offering its records.
    fn mount_extent_at(&self, x: &Extent, addr: &str, epoch: u64) -> Result<()> {
        let s = self.session(addr)?;
        let id = self.id_at(&s)?;
        // A new leader wants the records back (a restarted master does, as in single
        // mode); so does the same leader if it forgot us: it takes back only what no
        // removal or put superseded meanwhile.
        let records = x.records.rejoin(|r| {
            let mut buf = vec![0u8; r.len as usize];
            x.region.copy_out(r.offset, &mut buf).is_ok() && crate::checksum::checksum(&buf) == r.checksum
        });
        let (segment, taken) = s.rpc.mount_extent(id, &x.remote, x.region.len(), x.group, &records)?;
        {
            // The master may have placed objects there and told us before this answer
            // reached us: those updates wait in `unrouted`.
            let mut unrouted = self.unrouted.lock();
            x.records.set_segment(segment);
            *x.mount.lock() = Some((addr.to_owned(), segment, epoch));
            let (ours, rest): (Vec<_>, Vec<_>) = unrouted.drain(..).partition(|(_, u)| u.segment() == Some(segment));
            *unrouted = rest;
            x.records.apply(ours.into_iter().map(|(_, u)| u).collect());
        }
        self.segment_home.write().insert(segment, addr.to_owned());
        if taken > 0 {
            self.remounted.store(true, Ordering::Release);
        }
        tracing::info!(group = x.group, master = addr, segment, taken, "extent mounted");
        Ok(())
    }

    /// Applies record updates to the extents they concern.
    fn apply_updates(&self, updates: Vec<RecordUpdate>) {
        if updates.is_empty() {
            return;
        }
        // Under this lock, a mount that just completed has set its segment (below).
        let mut unrouted = self.unrouted.lock();
        let mut by_extent: Vec<Vec<RecordUpdate>> = self.extents.iter().map(|_| Vec::new()).collect();
        let mounted: Vec<Option<SegmentId>> =
            self.extents.iter().map(|x| x.mount.lock().as_ref().map(|(_, segment, _)| *segment)).collect();
        let mut discards = Vec::new();
        for u in updates {
            let Some(segment) = u.segment() else {
                discards.push(u);
                continue;
            };
            match mounted.iter().position(|m| *m == Some(segment)) {
                Some(i) => by_extent[i].push(u),
                // For an extent whose mount answer is still on its way to us: kept
                // until it arrives (bounded: a segment nobody mounts here is noise).
                None => {
                    if unrouted.len() >= MAX_UNROUTED {
                        // Mount answers arrive within a master timeout; older ones are
                        // for segments that are not ours.
                        unrouted.retain(|(at, _)| at.elapsed() < SESSION_TIMEOUT * 2);
                    }
                    if unrouted.len() < MAX_UNROUTED {
                        unrouted.push((Instant::now(), u));
                    }
                }
            }
        }
        for (x, updates) in self.extents.iter().zip(by_extent) {
            if !updates.is_empty() {
                x.records.apply(updates);
            }
        }
        // File deletions (I/O) without the lock.
        drop(unrouted);
        if let Some(disk) = self.disk.get() {
            for u in discards {
                if let RecordUpdate::Discard { key, generation } = u {
                    disk.discard(&key, generation);
                }
            }
        }
    }

    /// `Discard` updates delete files of `disk` (this node's SSD tier) from now on.
    pub(crate) fn set_disk(&self, disk: Arc<dyn crate::store::records::DiskDiscard>) {
        let _ = self.disk.set(disk);
    }

    /// The extents mounted now, by their segment ids (the SSD tier reads offloads there).
    pub(crate) fn extent_regions(&self) -> Vec<(SegmentId, Arc<RegisteredRegion>)> {
        self.extents
            .iter()
            .filter_map(|x| x.mount.lock().as_ref().map(|(_, segment, _)| (*segment, x.region.clone())))
            .collect()
    }

    /// The records of every extent (what this node would offer new leaders).
    pub(crate) fn records(&self) -> Vec<ObjectRecord> {
        self.extents.iter().flat_map(|x| x.records.snapshot()).collect()
    }
}

/// Whether an error means "ask again once the map moved on".
fn follows(e: &Error) -> bool {
    matches!(e, Error::Moved { .. } | Error::MasterUnavailable(_) | Error::Recovering(_) | Error::Timeout(_))
}

/// The record endpoint of a node in a cluster: updates for any of its extents.
pub(crate) struct ClusterRecords(pub(crate) Arc<ClusterClient>);

impl RpcHandler for ClusterRecords {
    fn handle(&self, request: Request) -> Response {
        match request {
            Request::ApplyRecords { updates } => {
                self.0.apply_updates(updates);
                Response::Unit
            }
            _ => Response::Error(WireError::InvalidArgument(
                "this is a storage node's record endpoint: it answers only record updates".into(),
            )),
        }
    }

    /// As a single node's record endpoint: a few map operations a put waits for,
    /// answered on the polling thread.
    fn answers_inline(&self, kind: usize) -> bool {
        kind == Request::APPLY_RECORDS_KIND
    }
}

/// Not used by a store in cluster mode (it mounts extents itself).
fn not_in_cluster<T>(call: &str) -> Result<T> {
    Err(Error::InvalidArgument(format!(
        "{call} is not a call of a client of a cluster (extents are mounted per group)"
    )))
}

impl MasterApi for ClusterClient {
    fn register_client(&self) -> Result<ClientRegistration> {
        self.registered.store(true, Ordering::Release);
        let sessions = self.all_sessions();
        if sessions.is_empty() {
            return Err(Error::MasterUnavailable(format!(
                "no master of the cluster is reachable (is any running?){}",
                self.why_unreachable()
            )));
        }
        for s in sessions {
            if let Err(e) = self.id_at(&s) {
                tracing::warn!(master = s.addr, error = %e, "cannot register with a master");
            }
        }
        self.place_extents();
        let ttl = match self.client_ttl_ms.load(Ordering::Relaxed) {
            u64::MAX => 10_000,
            ttl => ttl,
        };
        Ok(ClientRegistration { client: self.logical, client_ttl_ms: ttl, incarnation: self.logical })
    }

    /// Follows the slot map: connects to new masters, mounts extents with new leaders.
    /// The masters themselves are heartbeaten by one thread per session; this fails only
    /// when none of them answered for half a client TTL.
    fn heartbeat(&self, _client: ClientId) -> Result<Vec<RecordUpdate>> {
        let sessions = self.all_sessions();
        self.place_extents();
        let ttl = self.client_ttl_ms.load(Ordering::Relaxed).min(10_000);
        let silent = self.elapsed_ms().saturating_sub(self.last_answer_ms.load(Ordering::Relaxed));
        if silent > ttl / 2 && !sessions.is_empty() && self.registered.load(Ordering::Acquire) {
            return Err(Error::MasterUnavailable(format!(
                "no master of the cluster answered a heartbeat for {silent} ms"
            )));
        }
        Ok(Vec::new())
    }

    fn mount_segment(&self, _client: ClientId, _region: &RemoteRegion, _capacity: u64) -> Result<SegmentId> {
        not_in_cluster("mount_segment")
    }

    fn remount_segment(
        &self,
        _client: ClientId,
        _region: &RemoteRegion,
        _capacity: u64,
        _records: &[ObjectRecord],
    ) -> Result<(SegmentId, usize)> {
        not_in_cluster("remount_segment")
    }

    fn unmount_segment(&self, _client: ClientId, segment: SegmentId) -> Result<usize> {
        self.on_segment(segment, |s, id| s.rpc.unmount_segment(id, segment))
    }

    fn unregister_client(&self, _client: ClientId) -> Result<usize> {
        self.registered.store(false, Ordering::Release);
        let mut removed = 0;
        for s in self.sessions.read().values() {
            let id = s.client.swap(0, Ordering::AcqRel);
            if id != 0 {
                removed += s.rpc.unregister_client(id).unwrap_or(0);
            }
        }
        Ok(removed)
    }

    fn segment_info(&self, segment: SegmentId) -> Result<SegmentInfo> {
        self.on_segment(segment, |s, _| s.rpc.segment_info(segment))
    }

    fn put_start(&self, _client: ClientId, key: &str, len: u64, cfg: &ReplicateConfig) -> Result<Vec<MemoryReplica>> {
        self.on_key(key, |s, id| {
            let replicas = s.rpc.put_start(id, key, len, cfg)?;
            self.note_placed(&s.addr, &replicas);
            Ok(replicas)
        })
    }

    fn put_end(&self, _client: ClientId, key: &str, checksum: u32) -> Result<()> {
        self.on_key(key, |s, id| s.rpc.put_end(id, key, checksum))
    }

    fn put_revoke(&self, _client: ClientId, key: &str) -> Result<()> {
        self.on_key(key, |s, id| s.rpc.put_revoke(id, key))
    }

    fn get_replica_list(&self, key: &str) -> Result<ReplicaList> {
        self.on_key(key, |s, _| {
            let list = s.rpc.get_replica_list(key)?;
            self.note_homes(&s.addr, &list);
            Ok(list)
        })
    }

    fn exists(&self, key: &str) -> Result<bool> {
        self.on_key(key, |s, _| s.rpc.exists(key))
    }

    fn remove(&self, key: &str) -> Result<()> {
        self.on_key(key, |s, _| s.rpc.remove(key))
    }

    fn remove_all(&self) -> Result<usize> {
        let mut n = 0;
        for s in self.all_sessions() {
            n += s.rpc.remove_all()?;
        }
        Ok(n)
    }

    fn replicate_start(&self, _client: ClientId, key: &str, cfg: &ReplicateConfig) -> Result<ReplicatePlan> {
        self.on_key(key, |s, id| s.rpc.replicate_start(id, key, cfg))
    }

    fn replicate_end(&self, key: &str, targets: &[MemoryReplica], ok: bool) -> Result<()> {
        self.on_key(key, |s, _| s.rpc.replicate_end(key, targets, ok))
    }

    fn batch_put_start(
        &self,
        _client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        self.on_keys(
            items,
            |i| i.0,
            |s, id, part| {
                let answers = s.rpc.batch_put_start(id, part, cfg);
                self.note_placed(&s.addr, answers.iter().flatten().flatten());
                answers
            },
        )
    }

    fn batch_put_end(&self, _client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        self.on_keys(items, |i| i.0, |s, id, part| s.rpc.batch_put_end(id, part))
    }

    fn batch_put_revoke(&self, _client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        self.on_keys(keys, |k| k, |s, id, part| s.rpc.batch_put_revoke(id, part))
    }

    fn batch_get_replica_list(&self, keys: &[&str]) -> Vec<Result<ReplicaList>> {
        self.on_keys(
            keys,
            |k| k,
            |s, _, part| {
                let answers = s.rpc.batch_get_replica_list(part);
                for list in answers.iter().flatten() {
                    self.note_homes(&s.addr, list);
                }
                answers
            },
        )
    }

    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.on_keys(keys, |k| k, |s, _, part| s.rpc.batch_exists(part))
    }

    fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>> {
        self.on_keys(keys, |k| k, |s, _, part| s.rpc.batch_remove(part))
    }

    fn list_keys(&self, limit: usize) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        for s in self.all_sessions() {
            if keys.len() >= limit {
                break;
            }
            keys.extend(s.rpc.list_keys(limit - keys.len())?);
        }
        Ok(keys)
    }

    fn stats(&self) -> Result<MasterStats> {
        let mut total = MasterStats::default();
        for s in self.all_sessions() {
            total.merge(&s.rpc.stats()?);
        }
        Ok(total)
    }

    fn object_info(&self, key: &str) -> Result<ObjectInfo> {
        self.on_key(key, |s, _| s.rpc.object_info(key))
    }

    fn report_ssd_capacity(&self, _client: ClientId, capacity_bytes: i64) -> Result<()> {
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            s.rpc.report_ssd_capacity(id, capacity_bytes)?;
        }
        Ok(())
    }

    fn notify_offload_success(&self, _client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>> {
        self.on_keys(items, |i| i.0, |s, id, part| s.rpc.notify_offload_success(id, part))
    }

    fn batch_evict_disk_replica(&self, _client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        self.on_keys(keys, |k| k, |s, id, part| s.rpc.batch_evict_disk_replica(id, part))
    }

    fn mount_ssd(&self, _client: ClientId, capacity_bytes: i64, endpoint: &str) -> Result<()> {
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            s.rpc.mount_ssd(id, capacity_bytes, endpoint)?;
        }
        Ok(())
    }

    fn disk_endpoint(&self, client: ClientId) -> Result<String> {
        let home = self.client_home.read().get(&client).cloned();
        if let Some(addr) = home {
            if let Ok(endpoint) = self.session(&addr).and_then(|s| s.rpc.disk_endpoint(client)) {
                return Ok(endpoint);
            }
        }
        let mut last = Error::UnknownClient(client);
        for s in self.all_sessions() {
            match s.rpc.disk_endpoint(client) {
                Ok(endpoint) => return Ok(endpoint),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn offload_heartbeat(&self, _client: ClientId, max: usize) -> Result<OffloadPlan> {
        let mut plan = OffloadPlan::default();
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            let part = s.rpc.offload_heartbeat(id, max.saturating_sub(plan.tasks.len()))?;
            plan.tasks.extend(part.tasks);
            plan.discard.extend(part.discard);
        }
        Ok(plan)
    }

    fn register_disk_objects(&self, _client: ClientId, items: &[(&str, u64, u32, u64)]) -> Vec<Result<()>> {
        self.on_keys(items, |i| i.0, |s, id, part| s.rpc.register_disk_objects(id, part))
    }

    fn mount_records(&self, _client: ClientId, endpoint: &str, key: &[u8]) -> Result<()> {
        self.set_record_endpoint(endpoint.to_owned(), key.to_vec());
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            s.rpc.mount_records(id, endpoint, key)?;
        }
        Ok(())
    }

    fn report_segment_failure(&self, _client: ClientId, segment: SegmentId) -> Result<()> {
        self.on_segment(segment, |s, id| s.rpc.report_segment_failure(id, segment))
    }

    fn release_leases(&self, keys: &[&str]) -> Result<()> {
        let answers = self.on_keys(
            keys,
            |k| k,
            |s, _, part| match s.rpc.release_leases(part) {
                Ok(()) => part.iter().map(|_| Ok(())).collect(),
                Err(e) => part.iter().map(|_| Err(e.clone())).collect(),
            },
        );
        answers.into_iter().find(|r| r.is_err()).unwrap_or(Ok(()))
    }

    fn flush_segments(&self, _client: ClientId) -> Result<u64> {
        let mut left = 0;
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            left += s.rpc.flush_segments(id)?;
        }
        Ok(left)
    }

    fn mount_extent(
        &self,
        _client: ClientId,
        _region: &RemoteRegion,
        _capacity: u64,
        _group: u32,
        _records: &[ObjectRecord],
    ) -> Result<(SegmentId, usize)> {
        not_in_cluster("mount_extent")
    }

    // Upserts route as puts do: to the leader of the key's group.

    fn upsert_start(
        &self,
        _client: ClientId,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Result<Vec<MemoryReplica>> {
        self.on_key(key, |s, id| {
            let replicas = s.rpc.upsert_start(id, key, len, cfg)?;
            self.note_placed(&s.addr, &replicas);
            Ok(replicas)
        })
    }

    fn upsert_end(&self, _client: ClientId, key: &str, checksum: u32) -> Result<()> {
        self.on_key(key, |s, id| s.rpc.upsert_end(id, key, checksum))
    }

    fn upsert_revoke(&self, _client: ClientId, key: &str) -> Result<()> {
        self.on_key(key, |s, id| s.rpc.upsert_revoke(id, key))
    }

    fn batch_upsert_start(
        &self,
        _client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        self.on_keys(
            items,
            |i| i.0,
            |s, id, part| {
                let answers = s.rpc.batch_upsert_start(id, part, cfg);
                self.note_placed(&s.addr, answers.iter().flatten().flatten());
                answers
            },
        )
    }

    fn batch_upsert_end(&self, _client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        self.on_keys(items, |i| i.0, |s, id, part| s.rpc.batch_upsert_end(id, part))
    }

    fn batch_upsert_revoke(&self, _client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        self.on_keys(keys, |k| k, |s, id, part| s.rpc.batch_upsert_revoke(id, part))
    }

    fn batch_drop_replicas(&self, keys: &[&str], segment: &str) -> Vec<Result<()>> {
        self.on_keys(keys, |k| k, |s, _, part| s.rpc.batch_drop_replicas(part, segment))
    }
}
