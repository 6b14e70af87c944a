//! Draining this storage node: it leaves without losing what only it holds.
//!
//! The master marks the node's segments draining (`drain_segment`: placement skips
//! them from then on, reads go on) and the node moves its objects away with the calls
//! any client has, so the one write path does the copies:
//! - an object with another complete replica elsewhere: ours is dropped
//!   (`drop_replicas`);
//! - an object whose only replica is here: [`Store::replicate`] to one more replica
//!   (placed elsewhere, since we are draining; the master takes free room only, never
//!   evicting for a drain), then ours is dropped in a later round, once the master
//!   lists the copy;
//! - no room in the pool: with an SSD tier, the master's offload path writes it to
//!   this node's SSD (`flush_segments`) and records the disk replica; then the memory
//!   replica is dropped;
//! - otherwise, once the grace period ends, it is reported lost.
//!
//! Rounds repeat over the records of our segment (the master updates them before it
//! acknowledges a change) until none is left or the grace period ends. Progress goes
//! to the log and to the master (`drain_report`: `drain_status`, `/metrics`).
//! A drain starts from [`Store::drain`] (and [`Store::close_draining`]), or when a
//! master tells the node (`RecordUpdate::Drain`, after `drain_segment` by an operator):
//! the heartbeat thread then runs [`poll`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::SegmentId;
use parking_lot::Mutex;

use super::{RecordEndpoint, Store, StoreInner};
use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{DrainProgress, ObjectRecord};

/// Copies in flight at once: enough to keep a TCP link and the master busy, few
/// enough not to starve the node's other work.
const COPY_THREADS: usize = 4;

/// Most keys per `drop_replicas` call.
const DROP_BATCH: usize = 1024;

/// How often progress is logged and reported to the master.
const REPORT_EVERY: Duration = Duration::from_millis(500);

/// A drain a master asked for: its grace period in ms plus one (0: none asked).
#[derive(Default)]
pub(crate) struct DrainAsk(AtomicU64);

impl DrainAsk {
    /// A master asked for a drain with `grace_ms`.
    pub(crate) fn ask(&self, grace_ms: u64) {
        self.0.store(grace_ms.saturating_add(1), Ordering::Release);
    }

    /// The grace period of a drain asked since the last call.
    fn take(&self) -> Option<Duration> {
        match self.0.swap(0, Ordering::AcqRel) {
            0 => None,
            n => Some(Duration::from_millis(n - 1)),
        }
    }
}

/// A node's drain state: asked by a master, and whether one runs.
#[derive(Default)]
pub(crate) struct DrainSignal {
    /// A master asked (single-master mode: the records' updates).
    pub(crate) asked: DrainAsk,
    /// A drain runs (the heartbeat thread starts no second one).
    running: AtomicBool,
    /// One drain at a time.
    one: Mutex<()>,
    /// The grace of the last drain, plus one (0: never drained). A drained node stays
    /// draining until it leaves: a re-mount (the master restarted, or forgot us) marks
    /// it draining again.
    drained_grace_ms: AtomicU64,
}

impl DrainSignal {
    /// The grace of the last drain this node ran, if it ran one.
    pub(crate) fn drained(&self) -> Option<u64> {
        self.drained_grace_ms.load(Ordering::Acquire).checked_sub(1)
    }
}

/// The heartbeat thread's hook: starts a drain a master asked for, on a thread of its
/// own (the heartbeats must go on meanwhile).
pub(super) fn poll(inner: &Arc<StoreInner>) {
    let signal = &inner.records.drain;
    #[allow(unused_mut)]
    let mut asked = signal.asked.take();
    #[cfg(feature = "etcd")]
    if let Some((cluster, _)) = &inner.cluster {
        asked = asked.or(cluster.drain_asked.take());
    }
    let Some(grace) = asked else { return };
    if signal.running.load(Ordering::Acquire) {
        return;
    }
    let store = Store { inner: inner.clone() };
    let started = std::thread::Builder::new().name("mooncake-drain".into()).spawn(move || {
        if let Err(e) = store.drain(grace) {
            tracing::error!(error = %e, "drain failed");
        }
    });
    if let Err(e) = started {
        tracing::error!(error = %e, "cannot start the drain thread");
    }
}

/// `f` of each item, in order, on up to [`COPY_THREADS`] threads.
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = COPY_THREADS.min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let chunk = items.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> =
            items.chunks(chunk).map(|part| s.spawn(|| part.iter().map(&f).collect::<Vec<R>>())).collect();
        // A panic goes on up: results must stay in the items' order.
        parts.into_iter().flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// Clears `running` when the drain ends, however it ends.
struct Running<'a>(&'a AtomicBool);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// What one look at an object found.
enum Found {
    /// Gone from our segment (removed, or moved already).
    NotHere,
    /// Another complete replica exists: ours can go.
    Elsewhere { segment: SegmentId },
    /// Ours is its only memory replica; it has `replicas` in all.
    OnlyHere { segment: SegmentId, replicas: usize },
}

impl Store {
    /// Drains this storage node: its segment takes no new replica from now on, and
    /// every object it holds is made safe before this returns: dropped here when it
    /// has another complete replica, copied to other segments when this is its only
    /// one (placed by the master's strategy, keeping its soft pin), or, when the pool
    /// has no room, kept on this node's SSD tier as a disk replica. Reads go on
    /// throughout. Bounded by `grace`: what could go nowhere by then is counted lost.
    /// Progress is logged and reported to the master (`drain_status`).
    ///
    /// The segment stays mounted, empty and draining, until the store is closed or
    /// dropped. Objects kept on the SSD tier are readable while the node runs, and
    /// again after it restarts on the same directory. With an embedded master that
    /// does not track records, the objects are found by a walk of its keys.
    pub fn drain(&self, grace: Duration) -> Result<DrainProgress> {
        let inner = &self.inner;
        let signal = &inner.records.drain;
        let _one = signal.one.lock();
        signal.running.store(true, Ordering::Release);
        let _running = Running(&signal.running);
        let start = Instant::now();
        let deadline = start + grace;
        let node = self.endpoint().to_owned();
        let grace_ms = grace.as_millis().min(u64::MAX as u128 - 1) as u64;
        signal.drained_grace_ms.store(grace_ms + 1, Ordering::Release);
        #[cfg(feature = "etcd")]
        if let Some((cluster, _)) = &inner.cluster {
            // Extents mounted from now on (a group's leader changed) are marked
            // draining at once, during this drain and after it.
            cluster.set_drained(&node, grace_ms);
        }
        let mut p = DrainProgress { node: node.clone(), started: true, ..Default::default() };
        if inner.segment_regions().is_empty() {
            p.done = true;
            return Ok(p);
        }
        tracing::info!(node, grace_ms, "draining: moving this node's objects away");
        if let Err(e) = self.mark_draining(&node, grace_ms) {
            // A master away (in a cluster: one that just died, whose groups move
            // within its lease) must not stop the drain: the loop marks our segments
            // again every few rounds, and the new leaders' extents when mounted.
            tracing::warn!(error = %e, "drain: cannot mark our segments draining everywhere yet; going on");
        }
        let mut round = 0u64;
        let mut seen: HashMap<String, u64> = HashMap::new();
        let mut copied: HashSet<String> = HashSet::new();
        let mut names: HashMap<SegmentId, String> = HashMap::new();
        let mut on_disk: HashSet<String> = HashSet::new();
        let mut last_report = Instant::now();
        // Whether the loop ended with nothing left here (else the rest is counted).
        let mut clean = false;
        loop {
            // Marked again now and then: a segment re-mounted meanwhile (the master
            // restarted) starts out placeable.
            round += 1;
            if round.is_multiple_of(8) {
                if let Err(e) = self.mark_draining(&node, grace_ms) {
                    tracing::warn!(error = %e, "drain: cannot mark our segments draining again");
                }
            }
            let ours = self.segments_now();
            // Replicas on other draining nodes do not count: they are leaving too.
            let draining = Mutex::new(HashMap::new());
            let mut drop: Vec<(String, SegmentId)> = Vec::new();
            let mut copy: Vec<(String, usize)> = Vec::new();
            let mut stuck = 0u64;
            let (mut left, mut left_bytes) = (0u64, 0u64);
            let records = self.held(&ours);
            // One master round trip per object: several in flight.
            let found = par_map(&records, |r| self.look(&r.key, &ours, &draining));
            for (r, found) in records.into_iter().zip(found) {
                if !seen.contains_key(&r.key) {
                    seen.insert(r.key.clone(), r.len);
                    p.objects_total += 1;
                    p.bytes_total += r.len;
                }
                match found {
                    Ok(Found::NotHere) => continue,
                    Ok(Found::Elsewhere { segment }) => drop.push((r.key, segment)),
                    Ok(Found::OnlyHere { segment, .. }) if on_disk.contains(&r.key) => drop.push((r.key, segment)),
                    Ok(Found::OnlyHere { replicas, .. }) => copy.push((r.key, replicas)),
                    Err(e) => {
                        tracing::debug!(key = r.key, error = %e, "drain: cannot look the object up; again next round");
                        stuck += 1;
                    }
                }
                left += 1;
                left_bytes += r.len;
            }
            (p.objects_left, p.bytes_left) = (left, left_bytes);
            // A segment mounted again while we looked (a group's leader changed: our
            // extent is a new segment there, which `ours` lacks) or an extent with
            // records mounted nowhere (its leader just died): this round's answers
            // and `ours` may miss objects only we hold. Nothing is judged done on them.
            let settled = self.segments_now() == ours && !self.unmounted_records();
            if left == 0 && !settled {
                if Instant::now() >= deadline {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            if left == 0 {
                // A put placed here before the drain began may still be writing: its
                // record comes when it ends. Done once nothing is allocated here.
                let used = self.segments_used(&ours);
                if used == Some(0) {
                    clean = true;
                    break;
                }
                if Instant::now() >= deadline {
                    // Not moved: the report says something is left (its key is not
                    // known until it ends), with the bytes still allocated here.
                    (p.objects_left, p.bytes_left) = (1, used.unwrap_or(0));
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            let dropped = self.drop_ours(&drop, &mut names, |key| {
                let len = seen.get(key).copied().unwrap_or(0);
                if on_disk.contains(key) {
                    p.objects_on_disk += 1;
                    p.bytes_on_disk += len;
                } else if copied.contains(key) {
                    p.objects_copied += 1;
                    p.bytes_copied += len;
                } else {
                    p.objects_dropped += 1;
                    p.bytes_dropped += len;
                }
            });
            let (done, no_room) = self.copy_away(&copy, deadline);
            copied.extend(done.iter().cloned());
            // What the pool has no room for goes to our SSD tier: the master's
            // offload path writes everything our segment holds that is on no SSD
            // (by now, only what found no room), and records the disk replicas.
            // (Only once no copy succeeds: the flush writes every object still here.)
            if !no_room.is_empty() && inner.ssd.is_some() && done.is_empty() {
                match self.inner.flush_until(deadline, "drain") {
                    Ok(()) => on_disk.extend(no_room.iter().cloned()),
                    Err(e) => tracing::warn!(error = %e, "drain: the SSD tier could not take what is left"),
                }
            }
            if last_report.elapsed() >= REPORT_EVERY {
                self.report(&mut p, start);
                last_report = Instant::now();
            }
            if Instant::now() >= deadline {
                break;
            }
            if dropped == 0 && done.is_empty() && (no_room.len() as u64 + stuck) > 0 {
                // Nothing moved this round (no room, leases held, a master away):
                // wait a little for room or for the reads to end.
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // What is still only here when the grace period ends leaves with the node.
        if !clean {
            let ours = self.segments_now();
            let (mut lost, mut lost_bytes) = (0u64, 0u64);
            let (mut unknown, mut unknown_bytes) = (0u64, 0u64);
            let draining = Mutex::new(HashMap::new());
            for r in self.held(&ours) {
                match self.look(&r.key, &ours, &draining) {
                    Ok(Found::OnlyHere { .. }) if !on_disk.contains(&r.key) => {
                        lost += 1;
                        lost_bytes += r.len;
                    }
                    Ok(_) => {}
                    Err(_) => {
                        unknown += 1;
                        unknown_bytes += r.len;
                    }
                }
            }
            (p.objects_lost, p.bytes_lost) = (lost, lost_bytes);
            // Objects no master could answer for now are not known to be safe: left,
            // never a clean node.
            if p.objects_left == 0 && unknown > 0 {
                (p.objects_left, p.bytes_left) = (unknown, unknown_bytes);
            }
        }
        p.done = true;
        self.report(&mut p, start);
        // The summary counts our segments (the master counts its own in its answers).
        p.segments = inner.segment_regions().len() as u64;
        // A drain asked while we ran (our own `drain_segment` calls, the marks of
        // extents mounted meanwhile) is this one.
        let _ = signal.asked.take();
        #[cfg(feature = "etcd")]
        if let Some((cluster, _)) = &inner.cluster {
            let _ = cluster.drain_asked.take();
        }
        let secs = p.elapsed_ms as f64 / 1000.0;
        tracing::info!(
            node = p.node,
            objects = p.objects_total,
            copied = p.objects_copied,
            dropped = p.objects_dropped,
            on_disk = p.objects_on_disk,
            left = p.objects_left,
            lost = p.objects_lost,
            bytes_moved = p.bytes_moved(),
            secs,
            "drain finished"
        );
        Ok(p)
    }

    /// [`drain`](Self::drain)s within `grace`, then [`close`](Self::close)s.
    /// Returns the drain's summary.
    pub fn close_draining(self, grace: Duration) -> Result<DrainProgress> {
        let summary = self.drain(grace)?;
        self.close()?;
        Ok(summary)
    }

    /// The objects our segments `ours` hold: our records, as the master keeps them
    /// up to date; with an embedded master that does not track them, from its keys
    /// (a walk of every object, in process).
    fn held(&self, ours: &[SegmentId]) -> Vec<ObjectRecord> {
        let untracked = match &self.inner.record_endpoint {
            Some(RecordEndpoint::InProcess(m)) => !m.config().track_records,
            Some(RecordEndpoint::Rpc { .. }) => false,
            None => self.inner.cluster.is_none(),
        };
        if !untracked {
            return self.segment_records();
        }
        let master = &self.inner.master;
        let keys = master.all_keys().unwrap_or_default();
        keys.into_iter()
            .filter_map(|key| {
                let info = master.object_info(&key).ok()?;
                let r = info.replicas.iter().find(|r| ours.contains(&r.segment))?;
                let (offset, len, checksum) = (r.offset, info.len, info.checksum);
                Some(ObjectRecord { key, offset, len, checksum, generation: 0 })
            })
            .collect()
    }

    /// Marks our segments (`node`'s) draining at every master, unless each of them
    /// already is. A master whose last drain of this node ended tells us to drain
    /// again when asked again: asked needlessly, that echo of our own call would start
    /// another drain once this one ends, whose own call would do the same, and so on.
    fn mark_draining(&self, node: &str, grace_ms: u64) -> Result<()> {
        let mounted = self.segments_now().len() as u64;
        if self.inner.master.drain_status(node).is_ok_and(|s| s.segments >= mounted) {
            return Ok(());
        }
        self.inner.master.drain_segment(node, grace_ms).map(|_| ())
    }

    /// Our segments now: the segment, or in a cluster the extents mounted.
    fn segments_now(&self) -> Vec<SegmentId> {
        self.inner.segment_regions().iter().map(|(id, _)| *id).collect()
    }

    /// Whether an extent holding records is mounted nowhere now (its leader died, or
    /// forgot us): no master lists its objects as ours until it is mounted again.
    fn unmounted_records(&self) -> bool {
        #[cfg(feature = "etcd")]
        if let Some((cluster, _)) = &self.inner.cluster {
            return cluster.unmounted_with_records();
        }
        false
    }

    /// Bytes allocated in our segments `ours`, as the master counts them (`None`: it
    /// cannot say now, which is not "empty").
    fn segments_used(&self, ours: &[SegmentId]) -> Option<u64> {
        let stats = self.inner.master.stats().ok()?;
        Some(stats.segment_usage.iter().filter(|u| ours.contains(&u.segment)).map(|u| u.used).sum())
    }

    /// Where `key`'s replicas are, as far as our segments `ours` go; a replica on
    /// another draining node (`draining`: what we know of segments) does not count.
    fn look(&self, key: &str, ours: &[SegmentId], draining: &Mutex<HashMap<SegmentId, bool>>) -> Result<Found> {
        let info = match self.inner.master.object_info(key) {
            Ok(info) => info,
            Err(Error::NotFound(_)) => return Ok(Found::NotHere),
            Err(e) => return Err(e),
        };
        // A replica on none of `ours` may still be ours: a group's leader changed
        // since `ours` was read, and our extent is a new segment there. Such an object
        // is still here: checked against the segments mounted now.
        let now: Vec<SegmentId>;
        let ours = if info.replicas.iter().any(|r| ours.contains(&r.segment)) {
            ours
        } else {
            now = self.segments_now();
            &now[..]
        };
        let Some(here) = info.replicas.iter().find(|r| ours.contains(&r.segment)) else {
            return Ok(Found::NotHere);
        };
        let staying = |segment: SegmentId| -> bool {
            if ours.contains(&segment) {
                return false;
            }
            if let Some(leaving) = draining.lock().get(&segment) {
                return !leaving;
            }
            // Unknown: not counted as a place the object stays.
            let leaving = self.inner.master.segment_info(segment).map_or(true, |s| s.draining);
            draining.lock().insert(segment, leaving);
            !leaving
        };
        if info.replicas.iter().any(|r| staying(r.segment)) {
            Ok(Found::Elsewhere { segment: here.segment })
        } else {
            Ok(Found::OnlyHere { segment: here.segment, replicas: info.replicas.len() })
        }
    }

    /// Drops our replica of each of `keys` (with the segment holding it); `moved` is
    /// called with each key dropped. Returns how many were dropped. One refused
    /// (leased: a read is in flight) is tried again next round.
    fn drop_ours(
        &self,
        keys: &[(String, SegmentId)],
        names: &mut HashMap<SegmentId, String>,
        mut moved: impl FnMut(&str),
    ) -> usize {
        let mut by_segment: HashMap<SegmentId, Vec<&str>> = HashMap::new();
        for (k, s) in keys {
            by_segment.entry(*s).or_default().push(k);
        }
        let mut dropped = 0;
        for (segment, keys) in by_segment {
            let name = match names.get(&segment) {
                Some(n) => n.clone(),
                None => match self.inner.master.segment_info(segment) {
                    Ok(info) => names.entry(segment).or_insert(info.name).clone(),
                    Err(e) => {
                        tracing::debug!(segment, error = %e, "drain: no name for our segment");
                        continue;
                    }
                },
            };
            for chunk in keys.chunks(DROP_BATCH) {
                for (key, res) in chunk.iter().zip(self.drop_spare_replicas(chunk, &name)) {
                    match res {
                        Ok(()) => {
                            moved(key);
                            dropped += 1;
                        }
                        Err(e) => tracing::debug!(key, error = %e, "drain: replica not dropped yet"),
                    }
                }
            }
        }
        dropped
    }

    /// Copies each object of `keys` (with its replica count) to one more replica, on
    /// up to [`COPY_THREADS`] threads. Returns the keys copied and those the pool had
    /// no room for.
    fn copy_away(&self, keys: &[(String, usize)], deadline: Instant) -> (Vec<String>, Vec<String>) {
        let next = AtomicUsize::new(0);
        let copied = Mutex::new(Vec::new());
        let no_room = Mutex::new(Vec::new());
        let threads = COPY_THREADS.min(keys.len());
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((key, replicas)) = keys.get(i) else { return };
                    if Instant::now() >= deadline {
                        return;
                    }
                    // One more replica, placed off this node; the object keeps its pin.
                    let cfg = ReplicateConfig { replica_num: replicas + 1, keep_soft_pin: true, ..Default::default() };
                    match self.replicate(key, &cfg) {
                        Ok(()) => copied.lock().push(key.clone()),
                        Err(Error::NoSpace { .. }) => no_room.lock().push(key.clone()),
                        Err(e) => tracing::debug!(key, error = %e, "drain: copy failed; again next round"),
                    }
                });
            }
        });
        (copied.into_inner(), no_room.into_inner())
    }

    /// Logs the progress and reports it to the master (best effort).
    fn report(&self, p: &mut DrainProgress, start: Instant) {
        p.elapsed_ms = start.elapsed().as_millis() as u64;
        tracing::info!(
            node = p.node,
            moved = p.objects_moved(),
            bytes_moved = p.bytes_moved(),
            left = p.objects_left,
            bytes_left = p.bytes_left,
            lost = p.objects_lost,
            "drain progress"
        );
        if let Err(e) = self.inner.master.drain_report(self.inner.client(), p) {
            tracing::debug!(error = %e, "drain: progress not reported");
        }
    }
}
