//! A member's coordination loop: the async side of a [`ClusterMember`], confined to
//! one thread with a current-thread tokio runtime.
//!
//! Each turn of the loop: if the lease deadline passed, give up every group and the
//! lease; register (a new lease, `masters/<id>`) if not registered; reload and watch the
//! cluster if the watch broke; then bring the member's groups in line with the
//! assignments (acquire, hand over, clean up) and, when this member holds the
//! `scheduler` key, write the scheduler's plan. A turn runs after every watched change,
//! every scan interval, at the lease deadline, and on commands from the handle.
//!
//! Lease renewals run as a task of their own on the same runtime, so a turn waiting on
//! etcd does not delay them; handler calls run on a thread of their own, so a slow
//! handler does not either.
//!
//! [`ClusterMember`]: super::ClusterMember

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, DeleteOptions, PutOptions, Txn, TxnOp};
use parking_lot::Mutex;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::client::{is_lease_not_found, Etcd};
use super::failures::FailureLog;
use super::fence::Fence;
use super::layout::{Layout, LeaderValue, MasterValue};
use super::member_config::{GroupHandler, MemberConfig, MemberStats};
use super::mirror::{ensure_config, Mirror};
use super::scheduler;
use super::slots::SlotMap;
use super::view::ClusterView;
use crate::error::{Error, Result};

/// Assignments written per transaction (etcd allows 128 operations by default).
const ASSIGNMENTS_PER_TXN: usize = 64;

/// What the handle and the coordination thread share: everything `leads` and `stats`
/// read without asking the thread.
pub(crate) struct Shared {
    /// This member's id.
    pub id: String,
    /// The cluster's slot group count.
    pub groups: u32,
    /// Whether this member holds each group (checked together with the fence).
    pub led: Box<[AtomicBool]>,
    /// The lease deadline.
    pub fence: Fence,
    /// The latest slot map seen.
    pub map: Mutex<Arc<SlotMap>>,
    acquired: AtomicU64,
    failovers: AtomicU64,
    released: AtomicU64,
    renewals: AtomicU64,
    lapses: AtomicU64,
    is_scheduler: AtomicBool,
}

impl Shared {
    fn new(id: String, groups: u32) -> Shared {
        Shared {
            id,
            groups,
            led: (0..groups).map(|_| AtomicBool::new(false)).collect(),
            fence: Fence::new(),
            map: Mutex::new(Arc::new(SlotMap::new(groups).expect("the cluster's group count was checked"))),
            acquired: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            released: AtomicU64::new(0),
            renewals: AtomicU64::new(0),
            lapses: AtomicU64::new(0),
            is_scheduler: AtomicBool::new(false),
        }
    }

    /// Whether this member leads `group` now: it holds the group and its lease
    /// deadline is ahead.
    pub(crate) fn leads(&self, group: u32) -> bool {
        self.led.get(group as usize).is_some_and(|l| l.load(Ordering::Acquire)) && self.fence.is_valid()
    }

    /// The counters.
    pub(crate) fn stats(&self) -> MemberStats {
        let led = (0..self.groups).filter(|&g| self.leads(g)).count() as u32;
        let per_group = u32::from(super::slots::SLOTS) / self.groups;
        MemberStats {
            groups_led: led,
            slots_led: led * per_group,
            acquired_total: self.acquired.load(Ordering::Relaxed),
            failovers: self.failovers.load(Ordering::Relaxed),
            released_total: self.released.load(Ordering::Relaxed),
            lease_renewals: self.renewals.load(Ordering::Relaxed),
            lease_lapses: self.lapses.load(Ordering::Relaxed),
            is_scheduler: self.is_scheduler.load(Ordering::Relaxed),
        }
    }
}

/// Commands from the handle.
pub(crate) enum Control {
    /// Leave cleanly: release every group, delete the leader keys, revoke the lease.
    Leave,
    /// Stop at once, as a crashed process would: no callbacks, nothing revoked.
    Crash,
    /// Block the coordination thread (lease renewals included) this long, as a
    /// stopped process would be.
    Stall(Duration),
}

/// A handler call and where to say it is done.
enum Call {
    Acquired(u32, u64),
    Released(u32),
}

/// The thread that calls the [`GroupHandler`], one call at a time.
struct HandlerThread {
    calls: Option<crossbeam_channel::Sender<(Call, oneshot::Sender<()>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HandlerThread {
    fn spawn(handler: Arc<dyn GroupHandler>) -> Result<HandlerThread> {
        let (tx, rx) = crossbeam_channel::unbounded::<(Call, oneshot::Sender<()>)>();
        let thread = std::thread::Builder::new()
            .name("mooncake-cluster-handler".into())
            .spawn(move || {
                for (call, done) in rx {
                    // A panicking handler is a bug of its own; the member carries on
                    // (as if the call returned) rather than stop renewing its lease.
                    let run = std::panic::AssertUnwindSafe(|| match call {
                        Call::Acquired(g, epoch) => handler.acquired(g, epoch),
                        Call::Released(g) => handler.released(g),
                    });
                    if std::panic::catch_unwind(run).is_err() {
                        tracing::error!("cluster group handler panicked");
                    }
                    let _ = done.send(());
                }
            })
            .map_err(|e| Error::Coordination(format!("cannot start the handler thread: {e}")))?;
        Ok(HandlerThread { calls: Some(tx), thread: Some(thread) })
    }

    /// Makes the call and waits for it to return (other tasks, renewals among them, run
    /// meanwhile).
    async fn call(&self, call: Call) {
        let (done, wait) = oneshot::channel();
        if let Some(calls) = &self.calls {
            if calls.send((call, done)).is_ok() {
                let _ = wait.await;
            }
        }
    }
}

impl Drop for HandlerThread {
    fn drop(&mut self) {
        self.calls = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A registration: the lease and the task renewing it.
struct Session {
    lease: i64,
    renewals: JoinHandle<()>,
    /// Signalled by the renewal task when etcd says the lease is gone.
    lost: Arc<Notify>,
}

impl Drop for Session {
    fn drop(&mut self) {
        self.renewals.abort();
    }
}

/// The state of the coordination thread.
pub(crate) struct Coordinator {
    shared: Arc<Shared>,
    config: MemberConfig,
    layout: Layout,
    etcd: Etcd,
    mirror: Mirror,
    session: Option<Session>,
    /// A lease given up that may still be alive in etcd: revoked before the next one is
    /// granted, so no key of the old registration outlives it.
    stale_lease: Option<i64>,
    /// The epoch of each group this member holds (0: not held).
    epochs: Vec<u64>,
    /// Whether this member holds the scheduler key, as far as it knows.
    scheduler: bool,
    /// The revision of this member's last scheduler write: the view must reach it before
    /// the plan is made again (or it would be made from a view missing its own writes).
    scheduler_seen: i64,
    /// The `led` count last written to `masters/<id>`.
    published_led: Option<u32>,
    handler: HandlerThread,
    /// Failures to reach etcd, logged without repeating themselves.
    failures: FailureLog,
}

impl Coordinator {
    /// Connects, creates or reads the cluster config, registers and loads the cluster.
    pub(crate) async fn start(config: MemberConfig, handler: Arc<dyn GroupHandler>) -> Result<Coordinator> {
        let etcd = Etcd::connect(&config.endpoints, config.request_timeout(), &config.credentials).await?;
        let layout = Layout::new(&config.cluster);
        let groups = ensure_config(&etcd, &layout, config.groups).await?;
        if groups != config.groups {
            tracing::info!(cluster = %config.cluster, groups, "joining a cluster created with {groups} slot groups");
        }
        let id = format!("{:016x}", rand::random::<u64>());
        let shared = Arc::new(Shared::new(id, groups));
        let mut c = Coordinator {
            shared,
            mirror: Mirror::new(layout.clone(), groups),
            layout,
            etcd,
            session: None,
            stale_lease: None,
            epochs: vec![0; groups as usize],
            scheduler: false,
            scheduler_seen: 0,
            published_led: None,
            handler: HandlerThread::spawn(handler)?,
            failures: FailureLog::default(),
            config,
        };
        c.register().await?;
        if let Err(e) = c.mirror.resync(&c.etcd).await {
            c.give_up_lease().await;
            return Err(e);
        }
        c.publish_map();
        tracing::info!(member = %c.shared.id, cluster = %c.config.cluster, "joined the cluster");
        Ok(c)
    }

    /// What the handle shares with this thread.
    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// Runs until told to leave or crash (or the handle is gone).
    pub(crate) async fn run(mut self, mut control: mpsc::UnboundedReceiver<Control>) {
        let retry = (self.config.lease_ttl / 8).clamp(Duration::from_millis(50), Duration::from_millis(500));
        let mut next_scan = Instant::now() + self.config.scan_interval;
        loop {
            let healthy = self.turn().await;
            let now = Instant::now();
            if now >= next_scan {
                next_scan = now + self.config.scan_interval;
            }
            let mut wake = next_scan;
            if !healthy {
                wake = wake.min(now + retry);
            }
            if let (Some(_), Some(until)) = (&self.session, self.shared.fence.until()) {
                wake = wake.min(Instant::from_std(until));
            }
            let lost = self.session.as_ref().map(|s| s.lost.clone());
            let watching = self.mirror.is_watching();
            tokio::select! {
                biased;
                command = control.recv() => match command {
                    Some(Control::Stall(d)) => std::thread::sleep(d),
                    Some(Control::Crash) => {
                        tracing::warn!(member = %self.shared.id, "crashing on purpose: nothing released or revoked");
                        self.shared.fence.revoke();
                        return;
                    }
                    Some(Control::Leave) | None => {
                        self.leave().await;
                        return;
                    }
                },
                _ = async {
                    match &lost {
                        Some(lost) => lost.notified().await,
                        None => std::future::pending().await,
                    }
                } => {}
                changed = self.mirror.next(), if watching => match changed {
                    Ok(true) => self.publish_map(),
                    Ok(false) => {}
                    Err(e) => self.failures.failed(&self.shared.id, "cluster watch", &e),
                },
                _ = tokio::time::sleep_until(wake) => {}
            }
        }
    }

    /// One turn of the loop. Returns false when something failed and should be tried
    /// again soon.
    async fn turn(&mut self) -> bool {
        if self.session.is_some() && !self.shared.fence.is_valid() {
            self.lapse().await;
        }
        if self.session.is_none() {
            if let Err(e) = self.register().await {
                self.failures.failed(&self.shared.id, "cannot register", &e);
                return false;
            }
        }
        if !self.mirror.is_watching() {
            match self.mirror.resync(&self.etcd).await {
                Ok(changed) => {
                    if changed {
                        self.publish_map();
                    }
                }
                Err(e) => {
                    self.failures.failed(&self.shared.id, "cannot load the cluster", &e);
                    return false;
                }
            }
        }
        let groups_ok = self.reconcile().await;
        let scheduler_ok = self.schedule().await;
        let published = self.publish_led().await;
        let worked = groups_ok && scheduler_ok && published;
        if worked {
            self.failures.worked(&self.shared.id);
        }
        worked
    }

    /// Grants a lease, registers under it and starts renewing it.
    async fn register(&mut self) -> Result<()> {
        if let Some(old) = self.stale_lease {
            let mut lease = self.etcd.client.lease_client();
            match self.etcd.call("revoke the old lease", lease.revoke(old)).await {
                Ok(_) => {}
                Err(e) if is_lease_not_found(&e) => {}
                Err(e) => return Err(e),
            }
            self.stale_lease = None;
        }
        let mut lease_client = self.etcd.client.lease_client();
        let sent = std::time::Instant::now();
        let grant = self.etcd.call("grant a lease", lease_client.grant(self.config.ttl_secs(), None)).await?;
        if grant.ttl() <= 0 {
            return Err(self.etcd.error("grant a lease", format!("granted ttl {}", grant.ttl())));
        }
        let ttl = Duration::from_secs(grant.ttl() as u64);
        let lease = grant.id();
        let value = serde_json::to_vec(&MasterValue { addr: self.config.advertise.clone(), led: 0 }).expect("json");
        let mut kv = self.etcd.client.kv_client();
        let key = self.layout.master(&self.shared.id);
        if let Err(e) = self.etcd.call("register", kv.put(key, value, Some(PutOptions::new().with_lease(lease)))).await
        {
            self.stale_lease = Some(lease);
            return Err(e);
        }
        self.shared.fence.extend(Fence::deadline(sent, ttl));
        let lost = Arc::new(Notify::new());
        let renewals = tokio::spawn(renew(self.etcd.clone(), lease, ttl, self.shared.clone(), lost.clone()));
        self.session = Some(Session { lease, renewals, lost });
        self.published_led = Some(0);
        tracing::info!(member = %self.shared.id, lease, ?ttl, "registered");
        Ok(())
    }

    /// The lease deadline passed: stop leading everything, give the lease up (revoked
    /// before the next one), and register again on the next turn.
    async fn lapse(&mut self) {
        self.shared.lapses.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(member = %self.shared.id, "lease lapsed: releasing every group");
        if let Some(s) = self.session.take() {
            self.stale_lease = Some(s.lease);
        }
        self.shared.fence.revoke();
        self.set_scheduler(false);
        self.published_led = None;
        self.release_all().await;
    }

    /// Releases every group held (callbacks only; the keys go with the lease or are
    /// deleted by the caller).
    async fn release_all(&mut self) {
        for g in 0..self.shared.groups {
            if self.epochs[g as usize] != 0 {
                self.release(g).await;
            }
        }
    }

    /// Stops leading `group`, then tells the handler.
    async fn release(&mut self, group: u32) {
        self.shared.led[group as usize].store(false, Ordering::Release);
        self.epochs[group as usize] = 0;
        self.handler.call(Call::Released(group)).await;
        self.shared.released.fetch_add(1, Ordering::Relaxed);
        tracing::info!(member = %self.shared.id, group, "released");
    }

    /// Tells the handler, then starts leading `group` at `epoch`.
    async fn acquire(&mut self, group: u32, epoch: u64) {
        let previous = &self.mirror.view.previous[group as usize];
        let failover = previous.as_ref().is_some_and(|p| p.master != self.shared.id && !p.handed_over);
        self.handler.call(Call::Acquired(group, epoch)).await;
        self.epochs[group as usize] = epoch;
        self.shared.led[group as usize].store(true, Ordering::Release);
        self.shared.acquired.fetch_add(1, Ordering::Relaxed);
        if failover {
            self.shared.failovers.fetch_add(1, Ordering::Relaxed);
        }
        tracing::info!(member = %self.shared.id, group, epoch, failover, "acquired");
    }

    /// Brings the groups in line with the assignments. Returns false if an etcd request
    /// failed.
    async fn reconcile(&mut self) -> bool {
        let Some(lease) = self.session.as_ref().map(|s| s.lease) else { return true };
        let mut ok = true;
        for g in 0..self.shared.groups {
            if !self.shared.fence.is_valid() {
                return ok; // the next turn lapses
            }
            match decide(&self.mirror.view, &self.shared.id, lease, self.epochs[g as usize], g) {
                Step::Keep => {}
                Step::Lost => self.release(g).await,
                Step::HandOver(epoch) => {
                    self.release(g).await;
                    ok &= self.delete_leader(g, epoch).await;
                }
                Step::Adopt(epoch) => self.acquire(g, epoch).await,
                Step::DeleteLeftover(epoch) => ok &= self.delete_leader(g, epoch).await,
                Step::TryAcquire => ok &= self.try_acquire(g, lease).await,
            }
        }
        ok
    }

    /// Creates `leaders/<g>` if it is absent and the group is still assigned to this
    /// member; acquires the group if that worked.
    async fn try_acquire(&mut self, group: u32, lease: i64) -> bool {
        let key = self.layout.leader(group);
        let value = LeaderValue { master: self.shared.id.clone(), addr: self.config.advertise.clone() };
        let txn = Txn::new()
            .when([
                Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                Compare::value(self.layout.assign(group), CompareOp::Equal, self.shared.id.clone()),
            ])
            .and_then([TxnOp::put(
                key,
                serde_json::to_vec(&value).expect("json"),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let mut kv = self.etcd.client.kv_client();
        match self.etcd.call("take a group", kv.txn(txn)).await {
            Ok(resp) if resp.succeeded() => {
                let epoch = resp.header().map_or(0, |h| h.revision()) as u64;
                self.acquire(group, epoch).await;
                true
            }
            Ok(_) => true, // someone holds it, or it was reassigned: the watch will tell
            Err(e) => {
                self.failures.failed(&self.shared.id, &format!("cannot take group {group}"), &e);
                false
            }
        }
    }

    /// Deletes `leaders/<g>` if it is still the key created at `epoch`.
    async fn delete_leader(&mut self, group: u32, epoch: u64) -> bool {
        let key = self.layout.leader(group);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, epoch as i64)])
            .and_then([TxnOp::delete(key, None::<DeleteOptions>)]);
        let mut kv = self.etcd.client.kv_client();
        match self.etcd.call("hand a group over", kv.txn(txn)).await {
            Ok(_) => true,
            Err(e) => {
                self.failures.failed(&self.shared.id, &format!("cannot delete the leader key of group {group}"), &e);
                false
            }
        }
    }

    fn set_scheduler(&mut self, on: bool) {
        if on != self.scheduler {
            tracing::info!(member = %self.shared.id, on, "scheduler role");
        }
        self.scheduler = on;
        self.shared.is_scheduler.store(on, Ordering::Relaxed);
    }

    /// Runs for the scheduler key if it is free, and, holding it, writes the plan.
    async fn schedule(&mut self) -> bool {
        let Some(lease) = self.session.as_ref().map(|s| s.lease) else { return true };
        if !self.shared.fence.is_valid() {
            return true;
        }
        let view = &self.mirror.view;
        if view.revision >= self.scheduler_seen {
            let holds = view.scheduler.as_ref().is_some_and(|(id, l)| *id == self.shared.id && *l == lease);
            self.set_scheduler(holds);
        }
        let key = self.layout.scheduler();
        let mut kv = self.etcd.client.kv_client();
        if !self.scheduler && self.mirror.view.scheduler.is_none() {
            let txn = Txn::new()
                .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(key.clone(), self.shared.id.clone(), Some(PutOptions::new().with_lease(lease)))]);
            match self.etcd.call("run for scheduler", kv.txn(txn)).await {
                Ok(resp) if resp.succeeded() => {
                    self.scheduler_seen = resp.header().map_or(0, |h| h.revision());
                    self.set_scheduler(true);
                }
                Ok(_) => return true,
                Err(e) => {
                    self.failures.failed(&self.shared.id, "cannot run for scheduler", &e);
                    return false;
                }
            }
        }
        if !self.scheduler || self.mirror.view.revision < self.scheduler_seen {
            return true;
        }
        let plan = scheduler::plan(&self.mirror.view);
        for chunk in plan.chunks(ASSIGNMENTS_PER_TXN) {
            let ops: Vec<TxnOp> = chunk
                .iter()
                .map(|a| TxnOp::put(self.layout.assign(a.group), a.member.clone(), None::<PutOptions>))
                .collect();
            let txn =
                Txn::new().when([Compare::value(key.clone(), CompareOp::Equal, self.shared.id.clone())]).and_then(ops);
            match self.etcd.call("write assignments", kv.txn(txn)).await {
                Ok(resp) if resp.succeeded() => {
                    self.scheduler_seen = resp.header().map_or(0, |h| h.revision());
                    for a in chunk {
                        tracing::info!(scheduler = %self.shared.id, group = a.group, to = %a.member, "assigned");
                    }
                }
                Ok(_) => {
                    self.set_scheduler(false); // someone else holds the key now
                    return true;
                }
                Err(e) => {
                    self.failures.failed(&self.shared.id, "cannot write assignments", &e);
                    return false;
                }
            }
        }
        true
    }

    /// Writes the number of groups led into `masters/<id>` when it changed.
    async fn publish_led(&mut self) -> bool {
        let Some(lease) = self.session.as_ref().map(|s| s.lease) else { return true };
        let led = self.epochs.iter().filter(|&&e| e != 0).count() as u32;
        if self.published_led == Some(led) {
            return true;
        }
        let value = serde_json::to_vec(&MasterValue { addr: self.config.advertise.clone(), led }).expect("json");
        let mut kv = self.etcd.client.kv_client();
        let key = self.layout.master(&self.shared.id);
        match self
            .etcd
            .call("update the registration", kv.put(key, value, Some(PutOptions::new().with_lease(lease))))
            .await
        {
            Ok(_) => {
                self.published_led = Some(led);
                true
            }
            Err(e) => {
                self.failures.failed(&self.shared.id, "cannot update the registration", &e);
                false
            }
        }
    }

    fn publish_map(&self) {
        *self.shared.map.lock() = Arc::new(self.mirror.view.slot_map());
    }

    /// Leaves cleanly: release every group (handler first), delete the leader keys
    /// while still registered (so the next leaders see a handoff, not a failure), then
    /// revoke the lease, which takes the registration and the scheduler key with it.
    async fn leave(&mut self) {
        let held: Vec<(u32, u64)> =
            self.epochs.iter().enumerate().filter(|(_, &e)| e != 0).map(|(g, &e)| (g as u32, e)).collect();
        self.release_all().await;
        // Every request has its deadline, but etcd may be gone: leaving takes at most
        // about one lease TTL.
        let deadline = Instant::now() + self.config.lease_ttl;
        let _ = tokio::time::timeout_at(deadline, async {
            if self.session.is_some() && self.shared.fence.is_valid() {
                for (g, epoch) in held {
                    self.delete_leader(g, epoch).await;
                }
            }
        })
        .await;
        self.shared.fence.revoke();
        let _ = tokio::time::timeout_at(deadline, self.give_up_lease()).await;
        tracing::info!(member = %self.shared.id, "left the cluster");
    }

    /// Revokes the lease, and one given up earlier if it was not revoked yet (best
    /// effort; they expire anyway).
    async fn give_up_lease(&mut self) {
        let leases = self.session.take().map(|s| s.lease).into_iter().chain(self.stale_lease.take());
        for id in leases.collect::<Vec<_>>() {
            let mut lease = self.etcd.client.lease_client();
            match self.etcd.call("revoke the lease", lease.revoke(id)).await {
                Ok(_) => {}
                Err(e) if is_lease_not_found(&e) => {}
                Err(e) => tracing::warn!(member = %self.shared.id, "cannot revoke the lease (it will expire): {e}"),
            }
        }
    }
}

/// What a member does about one group, from its view and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// Nothing to do.
    Keep,
    /// Its key is gone (its lease ended, someone deleted it): stop leading.
    Lost,
    /// Assigned to another member: stop leading, then delete the key created at this
    /// epoch so the new assignee can create its own.
    HandOver(u64),
    /// The key is ours under the current lease but not held: its creation's answer was
    /// lost. Lead it at this epoch.
    Adopt(u64),
    /// A key of ours, created at this epoch, for a group assigned elsewhere: delete it.
    DeleteLeftover(u64),
    /// Assigned to us and leaderless: try to create the key.
    TryAcquire,
}

/// Decides what member `id` (registered under `lease`, holding `group` at epoch `held`,
/// 0 if not) does about `group`.
fn decide(view: &ClusterView, id: &str, lease: i64, held: u64, group: u32) -> Step {
    let g = group as usize;
    let assigned = view.assign[g].as_deref();
    let assigned_to_me = assigned == Some(id);
    let leader = view.leaders[g].as_ref();
    let mine = leader.filter(|l| l.master == id);
    if held != 0 {
        let key_there = mine.is_some_and(|l| l.epoch == held);
        // The view may not have caught up with our own creation yet: the key counts as
        // gone only once the view is past the revision that created it.
        if !key_there && view.revision >= held as i64 {
            return Step::Lost;
        }
        if assigned.is_some() && !assigned_to_me {
            return Step::HandOver(held);
        }
        return Step::Keep;
    }
    match mine {
        Some(l) if assigned_to_me && l.lease == lease => Step::Adopt(l.epoch),
        Some(l) if !assigned_to_me => Step::DeleteLeftover(l.epoch),
        // Ours under an older lease: it goes with that lease, which was revoked.
        Some(_) => Step::Keep,
        None if leader.is_none() && assigned_to_me => Step::TryAcquire,
        None => Step::Keep,
    }
}

/// Renews `lease` every third of its TTL, one request at a time, and moves the fence
/// to the deadline each acknowledged renewal gives (counted from when it was sent).
/// When etcd answers that the lease is gone, ends the fence and signals `lost`.
async fn renew(etcd: Etcd, lease: i64, ttl: Duration, shared: Arc<Shared>, lost: Arc<Notify>) {
    let period = ttl / 3;
    let mut stream = None;
    loop {
        let round = Instant::now();
        if stream.is_none() {
            let mut client = etcd.client.lease_client();
            match tokio::time::timeout(period, client.keep_alive(lease)).await {
                Ok(Ok(s)) => stream = Some(s),
                Ok(Err(e)) => tracing::debug!(lease, "cannot open the lease keepalive stream: {e}"),
                Err(_) => tracing::debug!(lease, "opening the lease keepalive stream timed out"),
            }
        }
        if let Some((keeper, responses)) = stream.as_mut() {
            let sent = std::time::Instant::now();
            let answer = tokio::time::timeout(period, async {
                keeper.keep_alive().await?;
                responses.message().await
            })
            .await;
            match answer {
                Ok(Ok(Some(resp))) if resp.ttl() > 0 => {
                    shared.fence.extend(Fence::deadline(sent, Duration::from_secs(resp.ttl() as u64)));
                    shared.renewals.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Ok(Some(_))) => {
                    tracing::warn!(lease, "etcd says the lease is gone");
                    shared.fence.revoke();
                    lost.notify_one();
                    return;
                }
                other => {
                    // A stream that failed or missed its answer is dropped, so a late
                    // answer is never taken for a newer request's.
                    tracing::debug!(lease, "lease renewal failed: {other:?}");
                    stream = None;
                }
            }
        }
        tokio::time::sleep_until(round + period).await;
    }
}

#[cfg(test)]
mod tests {
    use super::super::layout::ClusterKey;
    use super::super::view::Change;
    use super::*;

    fn put(v: &mut ClusterView, key: ClusterKey, value: &str, create: i64, lease: i64) {
        v.apply(&key, Change::Put { value: value.as_bytes(), create_revision: create, lease }, create);
    }

    fn leader(master: &str) -> String {
        format!(r#"{{"master":"{master}","addr":"x"}}"#)
    }

    #[test]
    fn decisions_follow_assignments_and_keys() {
        let mut v = ClusterView::new(4, 1);
        put(&mut v, ClusterKey::Assign(0), "me", 2, 0);
        put(&mut v, ClusterKey::Assign(1), "other", 3, 0);
        put(&mut v, ClusterKey::Assign(2), "me", 4, 0);
        put(&mut v, ClusterKey::Leader(2), &leader("other"), 5, 9);
        // Assigned and leaderless: take it. Leader elsewhere: wait. Not ours: nothing.
        assert_eq!(decide(&v, "me", 7, 0, 0), Step::TryAcquire);
        assert_eq!(decide(&v, "me", 7, 0, 2), Step::Keep);
        assert_eq!(decide(&v, "me", 7, 0, 1), Step::Keep);
        assert_eq!(decide(&v, "me", 7, 0, 3), Step::Keep);
        // Held at epoch 10, the view not there yet: keep. Moved elsewhere: hand over.
        assert_eq!(decide(&v, "me", 7, 10, 0), Step::Keep);
        put(&mut v, ClusterKey::Leader(0), &leader("me"), 10, 7);
        assert_eq!(decide(&v, "me", 7, 10, 0), Step::Keep);
        put(&mut v, ClusterKey::Assign(0), "other", 11, 0);
        assert_eq!(decide(&v, "me", 7, 10, 0), Step::HandOver(10));
        // The key deleted under us: lost, nothing to delete.
        v.apply(&ClusterKey::Leader(0), Change::Delete, 12);
        assert_eq!(decide(&v, "me", 7, 10, 0), Step::Lost);
        // Our key, not held: adopt under our lease, delete if assigned elsewhere, leave
        // it to an old lease otherwise.
        put(&mut v, ClusterKey::Assign(3), "me", 13, 0);
        put(&mut v, ClusterKey::Leader(3), &leader("me"), 14, 7);
        assert_eq!(decide(&v, "me", 7, 0, 3), Step::Adopt(14));
        assert_eq!(decide(&v, "me", 8, 0, 3), Step::Keep);
        put(&mut v, ClusterKey::Assign(3), "other", 15, 0);
        assert_eq!(decide(&v, "me", 7, 0, 3), Step::DeleteLeftover(14));
    }
}
