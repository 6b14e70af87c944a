//! The master's object calls: two-phase puts, replica lists and leases, removal,
//! and changes of the replica count.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::{AllocatedBuffer, AllocationError, AllocationRequest, SegmentAllocator, SegmentId};

use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::eviction::above_watermark;
use crate::master::object::{ObjectEntry, Replicas, Shard, StoredReplica};
use crate::master::record_link::RecordWait;
use crate::master::service::MasterService;
use crate::master::types::*;

/// How many revokes a master remembers for answering one asked again
/// ([`MasterService::was_revoked`]): a client sends a call again at once after its
/// connection broke, so the last few thousand cover every one in flight.
const REVOKES_REMEMBERED: usize = 4096;

/// The largest free block of any of `segments`.
fn largest_free(segments: &[Arc<SegmentAllocator>]) -> u64 {
    segments.iter().map(|s| s.report().largest_free_region).max().unwrap_or(0)
}

impl MasterService {
    /// Phase one of a put: reserves up to `cfg.replica_num` buffers of `len` bytes on
    /// distinct segments (evicting if needed) and returns where to write them.
    pub fn put_start(
        &self,
        client: ClientId,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Result<Vec<MemoryReplica>> {
        self.start_put(client, key, len, cfg, None)
    }

    /// [`put_start`](Self::put_start) of a value whose crc32c the writer knows before
    /// it writes: with durable records, the replicas' records (with that checksum)
    /// are sent to their nodes while the bytes are written, so that
    /// [`put_end`](Self::put_end) with the same checksum rarely waits for them. A node
    /// that re-mounts before the put ended offers the record only if its bytes match
    /// the checksum: all written.
    pub fn put_start_summed(
        &self,
        client: ClientId,
        key: &str,
        len: u64,
        checksum: u32,
        cfg: &ReplicateConfig,
    ) -> Result<Vec<MemoryReplica>> {
        self.start_put(client, key, len, cfg, Some(checksum))
    }

    /// Declares the crc32c of a put this client started without one
    /// ([`put_start`](Self::put_start)), while its bytes are still being written: as
    /// with [`put_start_summed`](Self::put_start_summed), the replicas' records (with
    /// that checksum) go to their nodes now, so that [`put_end`](Self::put_end) with
    /// the same checksum rarely waits for them. For a writer whose sum is ready only
    /// once the placement is known (a device's, taken beside its DMA). A put that
    /// declared already, or a master without durable records, keeps what it has.
    /// `NotFound` when this client has no put of `key` in progress.
    pub fn put_declare(&self, client: ClientId, key: &str, checksum: u32) -> Result<()> {
        check_key(key)?;
        let mut shard = self.index.shard(key).lock();
        // Under the shard lock (see `put_start`).
        self.fence(key)?;
        match shard.get_mut(key) {
            Some(e) if e.owner() == Some(client) => {
                if !e.declared() && self.config.track_records {
                    self.declare(key, e, checksum);
                }
                Ok(())
            }
            _ => Err(Error::NotFound(format!("{key}: no put of this client in progress"))),
        }
    }

    /// [`put_declare`](Self::put_declare) for many keys (key, checksum); one result
    /// per key.
    pub fn batch_put_declare(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        items.iter().map(|(k, crc)| self.put_declare(client, k, *crc)).collect()
    }

    /// Queues the `Added` records of the put in progress `e` of `key` with its
    /// declared `checksum`, to be sent once the call is answered, and keeps their
    /// tickets in the entry. Under the key's shard lock.
    fn declare(&self, key: &str, e: &mut ObjectEntry, checksum: u32) {
        // The put's generation, before its records are stamped (now, under the
        // shard lock, as every update of a node is queued).
        self.supersede_tombstone(key, self.gens.next());
        e.checksum = checksum;
        let wait = self.note_declared(key, e);
        self.send_after_answer.add(wait.clone());
        e.set_declared(wait);
    }

    /// [`put_start`](Self::put_start), with the checksum the writer declares, if any.
    fn start_put(
        &self,
        client: ClientId,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
        declared: Option<u32>,
    ) -> Result<Vec<MemoryReplica>> {
        check_key(key)?;
        self.fence(key)?;
        check_value_len(len)?;
        cfg.check()?;
        let now = self.now_ms();
        self.claim_key(&mut self.index.shard(key).lock(), key, now)?;
        let mut bufs = self.allocate(key, len, cfg, None)?;
        self.check_replica_count(key, len, bufs.len(), cfg)?;
        if bufs.len() < cfg.replica_num {
            self.counters.under_replicated_puts.fetch_add(1, Ordering::Relaxed);
        }
        let replicas: Vec<MemoryReplica> = bufs.iter().map(MemoryReplica::of).collect();
        let mut shard = self.index.shard(key).lock();
        if shard.contains_key(key) {
            // Another put of the same key won the race; our buffers are freed on drop.
            return Err(Error::AlreadyExists(key.to_owned()));
        }
        self.open_put(&mut shard, key, len, client, now, &mut bufs, (cfg.soft_pin, cfg.soft_pin_ttl_ms()), declared)?;
        Ok(replicas)
    }

    /// Makes way for a new put of `key` in its `shard` (locked): `AlreadyExists` if
    /// the key is an object or a put in progress; a put that never ended (older than
    /// `put_timeout`) is reclaimed. `Recovering` while a key the master does not hold
    /// may still come back with a re-mounting node: a put taken then would have the
    /// node's copy (an object acknowledged before the restart) refused when it
    /// re-mounts, where without the restart the put would have found the key taken.
    pub(crate) fn claim_key(&self, shard: &mut Shard, key: &str, now: u64) -> Result<()> {
        let held = shard.get(key);
        if held.is_some_and(|e| e.complete() || !self.put_expired(e, now)) {
            return Err(Error::AlreadyExists(key.to_owned()));
        }
        if self.recovering_put(key) {
            return Err(Error::Recovering(format!(
                "{key} may come back with a node re-mounting its segment: not put before clients re-mounted"
            )));
        }
        if held.is_some() {
            // A put that never ended: reclaim it and go on.
            if let Some(mut e) = shard.remove(key) {
                self.unsent_removals.add(key, self.drop_declared_put(key, &e));
                // Its writer may still be writing (see `quarantine_put`).
                self.quarantine_put(&mut e, self.config.put_timeout);
            }
            self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
            self.counters.put_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// `NoSpace` when only `placed` of `cfg`'s replicas of `len` bytes could be placed
    /// and `cfg` requires them all.
    pub(crate) fn check_replica_count(&self, what: &str, len: u64, placed: usize, cfg: &ReplicateConfig) -> Result<()> {
        if placed < cfg.replica_num && cfg.require_all_replicas {
            return Err(Error::NoSpace {
                needed: len,
                largest_free: 0,
                reason: format!("{what}: only {placed} of {} replicas could be placed", cfg.replica_num),
            });
        }
        Ok(())
    }

    /// Records `client`'s put of `key` (`len` bytes, into `bufs`, taken from the
    /// caller only on success, with the soft pin `(pin, ttl_ms)`) in its `shard`
    /// (locked, the key free), declared with `declared`'s checksum if any.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn open_put(
        &self,
        shard: &mut Shard,
        key: &str,
        len: u64,
        client: ClientId,
        now: u64,
        bufs: &mut Vec<AllocatedBuffer>,
        (pin, pin_ttl_ms): (bool, u32),
        declared: Option<u32>,
    ) -> Result<()> {
        // Again under the shard lock: a group released meanwhile drops what it finds
        // under these locks, so the entry is either refused here or dropped there.
        self.fence(key)?;
        let mut e = ObjectEntry::new(len, client, now);
        e.set_soft_pin(pin, pin_ttl_ms);
        e.replicas = std::mem::take(bufs).into_iter().map(|buf| StoredReplica::new(buf, false)).collect();
        if let Some(checksum) = declared.filter(|_| self.config.track_records) {
            self.declare(key, &mut e, checksum);
        }
        shard.insert(key, e);
        self.counters.pending_puts.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// A client is back after its connection broke (see
    /// [`MasterApi::reconnected`](crate::MasterApi::reconnected)): to a young
    /// master, a restart, noted before the first node re-mounts.
    pub fn reconnected(&self) -> Result<()> {
        if self.ownership.get().is_none() {
            self.note_recovery();
        }
        Ok(())
    }

    /// A segment came back with its objects, or a client after its connection broke.
    /// To a master younger than two client TTLs this means it restarted (a client
    /// that merely expired comes back to an older one): other clients may still be on
    /// their way back for one TTL.
    pub(crate) fn note_recovery(&self) {
        let (now, ttl) = (self.now_ms(), self.config.client_ttl.as_millis() as u64);
        if now < 2 * ttl {
            self.recovering_until_ms.fetch_max(now + ttl, Ordering::Relaxed);
        }
    }

    /// Whether the master is in the window after a restart when clients re-mount.
    pub(crate) fn recovering(&self) -> bool {
        self.now_ms() < self.recovering_until_ms.load(Ordering::Relaxed)
    }

    pub(crate) fn put_expired(&self, e: &ObjectEntry, now: u64) -> bool {
        !e.complete() && now.saturating_sub(e.last_access_ms) >= self.config.put_timeout.as_millis() as u64
    }

    /// Allocates buffers of `key` for `cfg`, excluding segments in `exclude`; on lack of
    /// space, evicts and tries again.
    pub(crate) fn allocate(
        &self,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
        exclude: Option<&[SegmentId]>,
    ) -> Result<Vec<AllocatedBuffer>> {
        self.allocate_with(key, len, cfg, exclude, true)
    }

    /// [`allocate`](Self::allocate); without `evict`, only on segments that stay
    /// below the high watermark with the new replica, and never evicting: a drain's
    /// copy must not push other objects out (nor be evicted right after landing).
    pub(crate) fn allocate_with(
        &self,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
        exclude: Option<&[SegmentId]>,
        evict: bool,
    ) -> Result<Vec<AllocatedBuffer>> {
        let mut evictions = 0;
        let mut raced = 0;
        let high = self.config.high_watermark;
        let mut wait_until: Option<Instant> = None;
        loop {
            let all = self.candidates();
            // Segments whose writes failed are left out until their owner heartbeats again.
            let mounted = self.placeable(self.placement_group(key));
            if let Some(unknown) = cfg.preferred_segments.iter().find(|p| !all.iter().any(|s| s.name() == p.as_str())) {
                return Err(Error::InvalidArgument(format!(
                    "preferred segment {unknown:?} is not mounted (names are `endpoint#n`, see SegmentInfo::name)"
                )));
            }
            let mut candidates: Vec<Arc<SegmentAllocator>> = match exclude {
                Some(ex) => mounted.iter().filter(|s| !ex.contains(&s.id())).cloned().collect(),
                None => mounted.to_vec(),
            };
            if !evict {
                candidates.retain(|s| !above_watermark(s.used_bytes() + len, s.capacity(), high));
            }
            if candidates.is_empty() {
                let reason = match (evict, exclude.is_some()) {
                    (false, _) => "no other segment has room below the high watermark",
                    (true, true) => "no other segment is mounted",
                    (true, false) => "no segment is mounted",
                };
                if self.recovering_key(key) {
                    return Err(Error::Recovering(format!("{reason} yet: clients are re-mounting their segments")));
                }
                return Err(Error::NoSpace { needed: len, largest_free: 0, reason: reason.into() });
            }
            let largest_segment = candidates.iter().map(|s| s.capacity()).max().unwrap_or(0);
            if len > largest_segment {
                return Err(Error::NoSpace {
                    needed: len,
                    largest_free: largest_free(&candidates),
                    reason: format!(
                        "the object is larger than any segment (the largest has {largest_segment} bytes): \
                         give clients larger segments, or split the object"
                    ),
                });
            }
            match self.place(len, cfg, &candidates) {
                // The room was checked before placing, but copies placed at the same
                // moment may together cross the watermark: whichever lands last sees
                // it, gives its room back and looks again (the full segment is then
                // no candidate).
                Ok(bufs)
                    if !evict
                        && bufs
                            .iter()
                            .any(|b| above_watermark(b.segment().used_bytes(), b.segment().capacity(), high)) =>
                {
                    drop(bufs);
                    raced += 1;
                    if raced >= 8 {
                        return Err(Error::NoSpace {
                            needed: len,
                            largest_free: 0,
                            reason: "no other segment has room below the high watermark".into(),
                        });
                    }
                }
                Ok(bufs) => return Ok(bufs),
                // Eviction frees whole objects wherever they are; a fragmented or
                // unlucky segment may need more than one round.
                Err(AllocationError::NoSpace { .. }) if evict && evictions < 8 => {
                    let want = len.saturating_mul(cfg.replica_num as u64);
                    let report = match self.placement_group(key) {
                        // In a cluster only the key's group's extents can take it.
                        Some(_) => self.evict_in(want, &candidates),
                        None => self.evict_for(want),
                    };
                    if report.freed_bytes > 0 {
                        evictions += 1;
                        continue;
                    }
                    // Everything evictable is on its way to an SSD: wait for the
                    // offloads to land (bounded), then evict their memory.
                    let until = *wait_until.get_or_insert_with(|| Instant::now() + self.config.offload_wait);
                    if report.awaiting_offload == 0 || Instant::now() >= until {
                        return Err(Error::NoSpace {
                            needed: len,
                            largest_free: largest_free(&candidates),
                            reason: if report.awaiting_offload > 0 {
                                "offloads to SSD did not finish in time to free memory".into()
                            } else {
                                "nothing can be evicted: every object is being read or written, or pinned \
                                 objects fill the free blocks"
                                    .into()
                            },
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(AllocationError::NoSpace { .. }) => {
                    return Err(Error::NoSpace {
                        needed: len,
                        largest_free: largest_free(&candidates),
                        reason: "no free block of that size after eviction (fragmented segments)".into(),
                    })
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Places `cfg.replica_num` replicas of `len` bytes: on the preferred segments
    /// first, in order (whatever the strategy), then the rest by the strategy among
    /// the other candidates. Best effort: fewer replicas when fewer segments have room.
    fn place(
        &self,
        len: u64,
        cfg: &ReplicateConfig,
        candidates: &[Arc<SegmentAllocator>],
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        let mut placed: Vec<AllocatedBuffer> = Vec::new();
        for name in &cfg.preferred_segments {
            if placed.len() == cfg.replica_num {
                return Ok(placed);
            }
            let Some(seg) = candidates.iter().find(|s| s.name() == name.as_str()) else { continue };
            if placed.iter().all(|b| b.segment_id() != seg.id()) {
                placed.extend(seg.allocate(len));
            }
        }
        if placed.len() == cfg.replica_num {
            return Ok(placed);
        }
        let rest: Vec<Arc<SegmentAllocator>> =
            candidates.iter().filter(|s| placed.iter().all(|b| b.segment_id() != s.id())).cloned().collect();
        let no_space =
            AllocationError::NoSpace { size: len, replica_num: cfg.replica_num, candidates: candidates.len() };
        if rest.is_empty() {
            return if placed.is_empty() { Err(no_space) } else { Ok(placed) };
        }
        let request = AllocationRequest {
            size: len,
            replica_num: cfg.replica_num - placed.len(),
            preferred_segments: Vec::new(),
        };
        let strategy = &self.config.allocation_strategy;
        let metrics = crate::master::disk::MasterSsdMetrics(self);
        let ssd: Option<&dyn mooncake_alloc::SsdMetricsProvider> =
            if strategy.uses_ssd_metrics() { Some(&metrics) } else { None };
        match strategy.allocate(&request, &rest, ssd) {
            Ok(bufs) => {
                placed.extend(bufs);
                Ok(placed)
            }
            Err(_) if !placed.is_empty() => Ok(placed),
            Err(e) => Err(e),
        }
    }

    /// Phase two of a put: the bytes are written; the object becomes readable. With
    /// durable records, returns once every node holding a replica recorded it; a
    /// node that could not be told is forgotten with its replicas, and the put fails
    /// if none is left.
    pub fn put_end(&self, client: ClientId, key: &str, checksum: u32) -> Result<()> {
        let wait = self.put_end_queued(client, key, checksum)?;
        self.settle("put", key, checksum, wait)
    }

    /// After the record updates of a `what` (put, upsert) of `key` with `checksum`:
    /// fails if a node could not record it and the object lost every replica with
    /// that node.
    pub(crate) fn settle(&self, what: &str, key: &str, checksum: u32, wait: RecordWait) -> Result<()> {
        if !self.await_records(wait) && !self.still_holds(key, checksum) {
            return Err(Error::MasterUnavailable(format!("{key}: no storage node of the {what} could record it")));
        }
        // Cluster mode: the wait may outlast this master's lead of the key's group;
        // a new leader may not have what it recorded, so it is not acknowledged here.
        self.fence(key)
    }

    /// Whether `key` is a complete object with `checksum` that a live node holds: a
    /// write whose node was forgotten while it waited still stands (another replica
    /// kept it), as opposed to the key gone, or written again since by another
    /// client with other bytes.
    ///
    /// Live: a complete replica on a segment still mounted whose owner is still
    /// registered, or a disk replica on a registered client. The entry alone is not
    /// enough: a node is forgotten in steps (`forget_client`: its client record goes
    /// and its link closes, waking the waiters, before its replicas are dropped shard
    /// by shard), so a waiter may find the entry still listing the forgotten node's
    /// replica, which the walk then drops: acknowledged, then `NotFound`.
    fn still_holds(&self, key: &str, checksum: u32) -> bool {
        let shard = self.index.shard(key).lock();
        let Some(e) = shard.get(key).filter(|e| e.complete() && e.checksum == checksum) else { return false };
        // Lock order: the shard, then `clients`, then `segments`. The client record
        // goes first when a node is forgotten, so a replica of a node being forgotten
        // is never taken for a live one, whatever step the forgetting is at.
        let clients = self.clients.read();
        if e.disk() != 0 && clients.contains_key(&e.disk()) {
            return true;
        }
        let segments = self.segments.read();
        e.replicas
            .iter()
            .any(|r| r.complete() && segments.by_id.get(&r.segment()).is_some_and(|s| clients.contains_key(&s.owner)))
    }

    /// Ends each item of a batch of `what`s (put, upsert) with `end`, then awaits the
    /// nodes' records of all of them together (one frame per node) and fails the items
    /// [`settle`](Self::settle) would fail; one result per item.
    pub(crate) fn end_batch(
        &self,
        what: &str,
        items: &[(&str, u32)],
        end: impl Fn(&str, u32) -> Result<RecordWait>,
    ) -> Vec<Result<()>> {
        let mut wait = RecordWait::default();
        let mut results: Vec<Result<()>> = items.iter().map(|(k, c)| end(k, *c).map(|w| wait.merge(w))).collect();
        let delivered = self.await_records(wait);
        for (res, (k, c)) in results.iter_mut().zip(items) {
            if res.is_ok() && !delivered && !self.still_holds(k, *c) {
                *res = Err(Error::MasterUnavailable(format!("{k}: no storage node of the {what} could record it")));
            }
            // As in `settle`: not acknowledged by a master that lost the key's group.
            if res.is_ok() {
                *res = self.fence(k);
            }
        }
        results
    }

    /// [`put_end`](Self::put_end) without waiting for the nodes' records.
    pub(crate) fn put_end_queued(&self, client: ClientId, key: &str, checksum: u32) -> Result<RecordWait> {
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        // Under the shard lock (see `put_start`).
        self.fence(key)?;
        match shard.get_mut(key) {
            Some(e) if e.owner() == Some(client) => {
                // A segment unmounted while `put_start` placed on it (after the
                // unmount dropped this shard's replicas there) cannot be read.
                {
                    let segments = self.segments.read();
                    e.replicas.retain(|r| segments.by_id.contains_key(&r.segment()));
                }
                if e.replicas.is_empty() {
                    if let Some(e) = shard.remove(key) {
                        // No node left to tell; the tombstone refuses its record.
                        let _ = self.drop_declared_put(key, &e);
                    }
                    self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                    return Err(Error::NotFound(format!("{key} (the segments of the put are gone)")));
                }
                // Records sent at the start with this checksum: only their delivery is
                // awaited. Another checksum (a writer that summed other bytes than it
                // declared) is recorded again, as an undeclared put's.
                let recorded = e.declared() && e.checksum == checksum;
                let started = if recorded { e.take_declared_records() } else { RecordWait::default() };
                e.mark_complete();
                e.checksum = checksum;
                e.last_access_ms = now;
                for r in &mut e.replicas {
                    r.set_complete();
                }
                self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                let mut wait = if recorded {
                    self.counters.declared_puts.fetch_add(1, Ordering::Relaxed);
                    self.declared_records_wait(e, started)
                } else {
                    // The put's generation, before its records are stamped (later).
                    self.supersede_tombstone(key, self.gens.next());
                    self.note_added(key, e, None)
                };
                let first = e.replicas.first().map(|r| r.segment());
                drop(shard);
                // Removals of earlier copies of the key that nodes were not told of yet
                // (an eviction's, an abandoned put's): acknowledged only once they are,
                // or a restarted master could take an old copy back beside this one.
                wait.merge(self.unsent_removals.take(key));
                self.offload_on_put(key, first);
                Ok(wait)
            }
            // Asked again (sent again after a broken connection, or to a new leader)
            // once it ended: the object holds these bytes. Its records are told again,
            // so that the answer waits for them as the first did.
            Some(e) if e.complete() && e.checksum == checksum => Ok(self.note_added(key, e, None)),
            Some(e) if e.complete() => Err(Error::AlreadyExists(key.to_owned())),
            // Asked again of a master that restarted, or of a new leader of the key's
            // group, before the node holding the ended object re-mounted: it may still
            // come back, and `NotFound` would call a put that stood failed. The caller
            // retries until it is back, or the window ends.
            None if self.recovering_key(key) => Err(self.absent(key)),
            _ => Err(Error::NotFound(format!("{key} (no put in progress by this client)"))),
        }
    }

    /// Abandons a put: it is gone at once; its room is freed a client TTL later, as
    /// bytes its writer sent may still land there.
    pub fn put_revoke(&self, client: ClientId, key: &str) -> Result<()> {
        let mut shard = self.index.shard(key).lock();
        match shard.get(key) {
            Some(e) if e.owner() == Some(client) => {
                if let Some(mut e) = shard.remove(key) {
                    // Not waited for: a revoke usually follows a write that failed, to
                    // a node that may be paused. The key's next put or remove waits for
                    // the removal; meanwhile the record could bring back only the whole
                    // value (a node offers it only if its bytes match), never
                    // acknowledged. Written ahead once this call is answered.
                    let wait = self.drop_declared_put(key, &e);
                    self.send_after_answer.add(wait.clone());
                    self.unsent_removals.add(key, wait);
                    // The writer is done, but bytes it sent may still be on their way
                    // (queued at a paused node): its room is kept a client TTL, beyond
                    // which a node that did not read them is forgotten with its
                    // segments.
                    self.quarantine_put(&mut e, self.config.client_ttl);
                }
                self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                // Under the shard's lock: a copy of this call asked again meanwhile
                // finds it revoked (the list's lock is taken inside a shard's, or
                // alone).
                self.note_revoked(client, key);
                Ok(())
            }
            // Asked again once it was served: done already.
            _ if self.was_revoked(client, key) => Ok(()),
            _ => Err(Error::NotFound(format!("{key} (no put in progress by this client)"))),
        }
    }

    /// Remembers that `client` revoked its put or upsert of `key` (the last
    /// [`REVOKES_REMEMBERED`] revokes), so that the same revoke asked again is
    /// answered `Ok`.
    pub(super) fn note_revoked(&self, client: ClientId, key: &str) {
        let mut revoked = self.revoked.lock();
        if revoked.len() == REVOKES_REMEMBERED {
            revoked.pop_front();
        }
        revoked.push_back((client, key.into()));
    }

    /// Whether `client` revoked its put or upsert of `key` lately (and nothing of
    /// the key by `client` is in progress now: the callers ask only then).
    pub(super) fn was_revoked(&self, client: ClientId, key: &str) -> bool {
        self.revoked.lock().iter().rev().any(|(c, k)| *c == client && &**k == key)
    }

    /// Keeps the room of `e`, a put dropped before its end (revoked, reclaimed, its
    /// writer forgotten), allocated for `hold` more, out of every object's reach (not
    /// readable, not placeable): bytes its writer sent may still land there, and
    /// would otherwise land in the next object placed there. The monitor frees it
    /// once the time is up ([`free_quarantined`](Self::free_quarantined)). Counted in
    /// `used_bytes`, as held placements are, in no object's bytes.
    pub(crate) fn quarantine_put(&self, e: &mut ObjectEntry, hold: std::time::Duration) {
        self.quarantine_replicas(std::mem::take(&mut e.replicas), hold);
    }

    /// Keeps `replicas`, dropped while their writer may still be writing them,
    /// allocated for `hold` more, out of every object's reach (see
    /// [`quarantine_put`](Self::quarantine_put)).
    pub(crate) fn quarantine_replicas(&self, replicas: Replicas, hold: std::time::Duration) {
        let hold_ms = hold.as_millis() as u64;
        if !replicas.is_empty() && hold_ms > 0 {
            self.quarantined.lock().push((self.now_ms() + hold_ms, replicas));
        }
    }

    /// The replicas of an upsert whose writer's time ran out, taken out of its object
    /// ([`ObjectEntry::tidy_upsert`]), kept a put timeout as a reclaimed put's room is:
    /// its writer may still be writing them.
    pub(crate) fn quarantine_abandoned_upsert(&self, abandoned: Option<Replicas>) {
        if let Some(replicas) = abandoned {
            self.quarantine_replicas(replicas, self.config.put_timeout);
        }
    }

    /// Frees the room of dropped puts whose quarantine is over at `now` (ms), and
    /// at once the room on draining segments: nothing is placed there again, so late
    /// bytes land where no object will be, and a drain waits for its node's
    /// segments to hold nothing.
    pub(crate) fn free_quarantined(&self, now: u64) {
        if self.quarantined.lock().is_empty() {
            return;
        }
        // Read before the queue's lock (taken alone, never with another).
        let draining: Vec<SegmentId> =
            self.segments.read().by_id.iter().filter(|(_, s)| s.draining).map(|(id, _)| *id).collect();
        let mut freed: Vec<StoredReplica> = Vec::new();
        {
            let mut q = self.quarantined.lock();
            q.retain_mut(|(until, replicas)| {
                if *until <= now {
                    freed.extend(replicas.drain(..));
                    return false;
                }
                if !draining.is_empty() {
                    let (gone, kept): (Vec<_>, Vec<_>) =
                        replicas.drain(..).partition(|r| draining.contains(&r.segment()));
                    freed.extend(gone);
                    replicas.extend(kept);
                }
                !replicas.is_empty()
            });
        }
        // Freed once the lock is given up.
        drop(freed);
    }

    /// [`put_start`](Self::put_start) for many keys; one result per key.
    pub fn batch_put_start(
        &self,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        items.iter().map(|(k, len)| self.put_start(client, k, *len, cfg)).collect()
    }

    /// [`put_start_summed`](Self::put_start_summed) for many keys (key, length,
    /// checksum); one result per key.
    pub fn batch_put_start_summed(
        &self,
        client: ClientId,
        items: &[(&str, u64, u32)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        items.iter().map(|(k, len, crc)| self.start_put(client, k, *len, cfg, Some(*crc))).collect()
    }

    /// [`put_end`](Self::put_end) for many keys; one result per key.
    /// The nodes' records of all of them are awaited together (one frame per node).
    pub fn batch_put_end(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        self.end_batch("put", items, |k, c| self.put_end_queued(client, k, c))
    }

    /// [`put_revoke`](Self::put_revoke) for many keys; one result per key.
    pub fn batch_put_revoke(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        keys.iter().map(|k| self.put_revoke(client, k)).collect()
    }

    // ---- reads -----------------------------------------------------------------------

    /// The complete replicas of `key`, and a read lease on the object: until the
    /// reader gives it back with [`release_leases`](Self::release_leases) (or
    /// `default_lease` passed, for a reader that died), the object is neither
    /// removed, nor evicted, nor shrunk.
    pub fn get_replica_list(&self, key: &str) -> Result<ReplicaList> {
        check_key(key)?;
        self.fence(key)?;
        let now = self.now_ms();
        let lease = self.config.default_lease;
        let mut shard = self.index.shard(key).lock();
        match shard.get_mut(key) {
            Some(e) if e.complete() && !self.withheld(key, e) => {
                let abandoned = e.lease(now, lease.as_millis() as u64);
                self.quarantine_abandoned_upsert(abandoned);
                e.last_access_ms = now;
                Ok(ReplicaList {
                    len: e.len(),
                    checksum: e.checksum,
                    replicas: e.replicas.iter().filter(|r| r.complete()).map(|r| r.memory(e.len())).collect(),
                    lease,
                    disk: (e.disk() != 0).then_some(e.disk()),
                })
            }
            _ => Err(self.absent(key)),
        }
    }

    /// [`get_replica_list`](Self::get_replica_list) for many keys.
    pub fn batch_get_replica_list(&self, keys: &[&str]) -> Vec<Result<ReplicaList>> {
        keys.iter().map(|k| self.get_replica_list(k)).collect()
    }

    /// Ends one read lease of each key (one per replica-list answer the reader got):
    /// its read is over. Keys that are gone are skipped.
    pub fn release_leases(&self, keys: &[&str]) -> Result<()> {
        // Keys of groups led elsewhere are skipped like absent ones.
        for key in keys.iter().filter(|k| self.fence(k).is_ok()) {
            if let Some(e) = self.index.shard(key).lock().get_mut(key) {
                e.release();
            }
        }
        Ok(())
    }

    /// What the master knows of `key` (no lease is granted).
    pub fn object_info(&self, key: &str) -> Result<ObjectInfo> {
        check_key(key)?;
        self.fence(key)?;
        let now = self.now_ms();
        match self.index.shard(key).lock().get(key) {
            Some(e) if e.complete() && !self.withheld(key, e) => Ok(ObjectInfo {
                len: e.len(),
                checksum: e.checksum,
                replicas: e.replicas.iter().filter(|r| r.complete()).map(|r| r.memory(e.len())).collect(),
                soft_pin: e.pinned(now),
                lease_ms_left: if e.leased(now) { e.lease_until_ms().saturating_sub(now) } else { 0 },
            }),
            _ => Err(self.absent(key)),
        }
    }

    /// Whether a complete object is stored under `key`; `Recovering` rather than
    /// `false` while it may still come back with a re-mounting node.
    pub fn exists(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        self.fence(key)?;
        if self.index.shard(key).lock().get(key).is_some_and(|e| e.complete() && !self.withheld(key, e)) {
            return Ok(true);
        }
        // A miss builds no error unless it is one (batch lookups miss often).
        if self.recovering_key(key) {
            return Err(self.absent(key));
        }
        Ok(false)
    }

    /// [`exists`](Self::exists) for many keys.
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        keys.iter().map(|k| self.exists(k)).collect()
    }

    // ---- persistence -----------------------------------------------------------------

    /// Asks `client`'s SSD tier to offload every object held in its segments that is
    /// on no SSD yet, and returns how many such objects there are (0: all are on
    /// disk). Called repeatedly by a flushing client until it answers 0.
    pub fn flush_segments(&self, client: ClientId) -> Result<u64> {
        let segments = match self.clients.read().get(&client) {
            Some(rec) => rec.segments.clone(),
            None => return Err(Error::UnknownClient(client)),
        };
        let now = self.now_ms();
        let hold = now + self.config.put_timeout.as_millis() as u64;
        let (mut left, mut ask) = (0u64, Vec::new());
        for shard in self.index.shards() {
            shard.lock().for_each_mut(|k, e| {
                if !e.complete()
                    || e.disk() != 0
                    || !e.replicas.iter().any(|r| r.complete() && segments.contains(&r.segment()))
                {
                    return;
                }
                left += 1;
                if !e.offload_pending(now) {
                    e.set_offload_deadline_ms(hold);
                    ask.push((Box::<str>::from(k), e.checksum));
                }
            });
        }
        self.queue_offloads(client, ask);
        Ok(left)
    }

    // ---- removal ---------------------------------------------------------------------

    /// Removes a complete object; fails with `HasLease` while a read of it is in
    /// flight. With durable records, returns once every node that held a replica
    /// dropped its record; a node that cannot be told is forgotten, and the removal is
    /// then handed to other nodes to keep before it is acknowledged (the forgotten
    /// node may offer its copy to a restarted master: `master/carried.rs`).
    pub fn remove(&self, key: &str) -> Result<()> {
        let (wait, removed_at) = self.remove_queued(key)?;
        if !self.await_records(wait) {
            self.keep_untold_removals(&[(key, removed_at)]);
        }
        // Cluster mode: not acknowledged by a master that lost the key's group while
        // it waited (a new leader may have taken the object back meanwhile).
        self.fence(key)
    }

    /// [`remove`](Self::remove) without waiting for the nodes' records; returns what
    /// to wait for and the removal's generation.
    fn remove_queued(&self, key: &str) -> Result<(RecordWait, u64)> {
        check_key(key)?;
        self.fence(key)?;
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        match shard.get(key) {
            Some(e) if e.complete() && e.leased(now) => {
                self.counters.lease_refusals.fetch_add(1, Ordering::Relaxed);
                Err(Error::HasLease(key.to_owned()))
            }
            Some(e) if e.complete() => {
                let mut wait = RecordWait::default();
                let mut removed_at = 0;
                if let Some(mut e) = shard.remove(key) {
                    wait = self.note_removed(key, &e.replicas);
                    removed_at = self.release_disk(key, &e, &mut wait);
                    // An abandoned upsert's replicas (a live one would have leased it).
                    self.hold_orphaned_upsert(&mut e, now);
                }
                drop(shard);
                // Older copies evicted from nodes not told yet: acknowledged only once
                // they are, or a restarted master would take them back.
                wait.merge(self.unsent_removals.take(key));
                Ok((wait, removed_at))
            }
            _ => Err(self.absent(key)),
        }
    }

    /// [`remove`](Self::remove) for many keys.
    pub fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>> {
        let mut wait = RecordWait::default();
        let mut removed: Vec<(&str, u64)> = Vec::new();
        let mut results: Vec<Result<()>> = keys
            .iter()
            .map(|k| {
                self.remove_queued(k).map(|(w, removed_at)| {
                    wait.merge(w);
                    removed.push((k, removed_at));
                })
            })
            .collect();
        if !self.await_records(wait) {
            self.keep_untold_removals(&removed);
        }
        for (res, k) in results.iter_mut().zip(keys) {
            if res.is_ok() {
                *res = self.fence(k);
            }
        }
        results
    }

    /// Removes every complete object without a live lease; returns how many.
    pub fn remove_all(&self) -> Result<usize> {
        if self.recovering_any() {
            // Objects of nodes not re-mounted yet would come back after it.
            return Err(Error::Recovering("clients are re-mounting their segments".into()));
        }
        let now = self.now_ms();
        let refused = std::cell::Cell::new(0u64);
        let mut wait = RecordWait::default();
        let removed = self.retain_entries(
            |k, e| {
                let leased = e.complete() && e.leased(now);
                refused.set(refused.get() + u64::from(leased));
                // Cluster mode: only the keys of the groups this master leads, checked
                // under the key's shard lock as every change is (a master deposed while
                // it was stopped must not remove objects, nor discard their files, for
                // the groups' new leaders).
                !e.complete() || leased || !self.leads_key(k)
            },
            |k, e| {
                wait.merge(self.note_removed(k, &e.replicas));
                self.release_disk(k, e, &mut wait);
            },
        );
        // Copies of evicted objects that nodes were not told of yet: as `remove`.
        wait.merge(self.unsent_removals.take_all());
        self.await_records(wait);
        self.counters.lease_refusals.fetch_add(refused.get(), Ordering::Relaxed);
        Ok(removed)
    }

    // ---- replica count ---------------------------------------------------------------

    /// Starts changing the number of memory replicas of `key` to `cfg.replica_num`:
    /// drops extra replicas at once (refused with `HasLease` while leased), or
    /// reserves new ones on segments that hold none, for the caller to fill.
    pub fn replicate_start(&self, client: ClientId, key: &str, cfg: &ReplicateConfig) -> Result<ReplicatePlan> {
        check_key(key)?;
        self.fence(key)?;
        cfg.check()?;
        let now = self.now_ms();
        let (have, held_on, len, checksum) = {
            let mut shard = self.index.shard(key).lock();
            let e = match shard.get_mut(key) {
                Some(e) if e.complete() => e,
                _ => return Err(Error::NotFound(key.to_owned())),
            };
            let have = e.replicas.iter().filter(|r| r.complete()).count();
            if have > cfg.replica_num {
                if e.leased(now) {
                    self.counters.lease_refusals.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::HasLease(key.to_owned()));
                }
                let mut dropped = 0;
                let mut wait = RecordWait::default();
                while e.replicas.iter().filter(|r| r.complete()).count() > cfg.replica_num {
                    if let Some(i) = e.replicas.iter().rposition(|r| r.complete()) {
                        let gone = e.replicas.remove(i);
                        wait.merge(self.note_removed(key, [&gone]));
                        dropped += 1;
                    }
                }
                if !cfg.keep_soft_pin {
                    e.set_soft_pin(cfg.soft_pin, cfg.soft_pin_ttl_ms());
                }
                let plan =
                    ReplicatePlan { len: e.len(), checksum: e.checksum, sources: vec![], targets: vec![], dropped };
                drop(shard);
                self.await_records(wait);
                return Ok(plan);
            }
            if !cfg.keep_soft_pin {
                e.set_soft_pin(cfg.soft_pin, cfg.soft_pin_ttl_ms());
            }
            if e.replicas.len() > have && !e.leased(now) {
                // Targets of a replicate whose copy outlived its lease (`put_timeout`:
                // its client stalled or is gone): taken back, so that they do not hold
                // their space and block every later replicate of the key for good.
                e.replicas.retain(|r| r.complete());
            }
            if have == cfg.replica_num || e.replicas.len() > have {
                // Nothing to do, or another replicate is filling replicas right now.
                return Ok(ReplicatePlan {
                    len: e.len(),
                    checksum: e.checksum,
                    sources: vec![],
                    targets: vec![],
                    dropped: 0,
                });
            }
            let held: Vec<SegmentId> = e.replicas.iter().map(|r| r.segment()).collect();
            (have, held, e.len(), e.checksum)
        };
        let extra = ReplicateConfig { replica_num: cfg.replica_num - have, ..cfg.clone() };
        // A copy away from a draining node takes free room only (what does not fit
        // goes to that node's SSD tier instead of evicting other objects).
        let evict = !self.any_draining(&held_on);
        let bufs = self.allocate_with(key, len, &extra, Some(&held_on), evict)?;
        let mut shard = self.index.shard(key).lock();
        let e = match shard.get_mut(key) {
            Some(e) if e.complete() => e,
            _ => return Err(Error::NotFound(key.to_owned())),
        };
        // The allocation ran without the lock (it may wait for offloads): the object
        // may have been upserted, or removed and put again, meanwhile. Targets sized
        // for another value must not join this one (the copy would write past them),
        // nor a second replicate's targets the first's.
        let same = e.len() == len && e.checksum == checksum;
        let alone = e.replicas.iter().all(|r| r.complete());
        if !same || !alone || e.replicas.len() != have {
            return Err(Error::HasLease(format!("{key} (changed while its replicas were placed: ask again)")));
        }
        // Sources must stay put while the client copies from them: the copy is a
        // read, released by `replicate_end`.
        let abandoned = e.lease(now, self.config.put_timeout.as_millis() as u64);
        self.quarantine_abandoned_upsert(abandoned);
        let sources = e.replicas.iter().filter(|r| r.complete()).map(|r| r.memory(e.len())).collect();
        let targets = bufs.iter().map(MemoryReplica::of).collect();
        e.replicas.extend(bufs.into_iter().map(|buf| StoredReplica::new(buf, false)));
        let _ = client;
        Ok(ReplicatePlan { len: e.len(), checksum: e.checksum, sources, targets, dropped: 0 })
    }

    /// Ends a replicate: the targets become readable (`ok`) or are freed (`!ok`).
    pub fn replicate_end(&self, key: &str, targets: &[MemoryReplica], ok: bool) -> Result<()> {
        let mut shard = self.index.shard(key).lock();
        self.fence(key)?;
        let e = shard.get_mut(key).ok_or_else(|| Error::NotFound(key.to_owned()))?;
        let len = e.len();
        let is_target = |r: &StoredReplica| !r.complete() && targets.contains(&r.memory(len));
        if !e.replicas.iter().any(is_target) {
            // An end asked again (its first answer lost), or not this replicate's
            // object any more (upserted, or its targets taken back): either way its
            // lease is gone already, and giving one back now would take another
            // reader's.
            let done = ok && targets.iter().all(|t| e.replicas.iter().any(|r| r.complete() && r.memory(len) == *t));
            return if done {
                Ok(())
            } else {
                Err(Error::NotFound(format!("{key}: no replica of this replicate is being filled")))
            };
        }
        let mut wait = RecordWait::default();
        if ok {
            for r in e.replicas.iter_mut().filter(|r| is_target(r)) {
                r.set_complete();
            }
            wait = self.note_added(key, e, Some(targets));
        } else {
            e.replicas.retain(|r| !is_target(r));
        }
        // The copy is over; readers hold their own leases.
        e.release();
        drop(shard);
        self.await_records(wait);
        Ok(())
    }

    // ---- dropping replicas -----------------------------------------------------------

    /// Drops the complete memory replicas that the segment named `segment` holds of
    /// each key (a move's last step, or a client clearing what one segment holds). An
    /// object left with no replica (memory or disk) is removed. Refused with
    /// `HasLease` while a read, a copy or an upsert holds the object: its memory may
    /// be in use. `NotFound` when the object is absent or has no replica there.
    pub fn batch_drop_replicas(&self, keys: &[&str], segment: &str) -> Vec<Result<()>> {
        self.drop_replicas_of(keys, segment, false)
    }

    /// [`batch_drop_replicas`](Self::batch_drop_replicas) that keeps a key's last
    /// copy (`NotFound` for it): the replica goes only while another complete memory
    /// replica or a disk replica stays.
    pub fn batch_drop_spare_replicas(&self, keys: &[&str], segment: &str) -> Vec<Result<()>> {
        self.drop_replicas_of(keys, segment, true)
    }

    /// Drops each key's replicas on the segment named `segment` (`spare_only`: only
    /// while another copy of the key stays).
    fn drop_replicas_of(&self, keys: &[&str], segment: &str, spare_only: bool) -> Vec<Result<()>> {
        let Some(seg) = self.candidates().iter().find(|s| s.name() == segment).map(|s| s.id()) else {
            let e = Error::InvalidArgument(format!("segment {segment:?} is not mounted"));
            return keys.iter().map(|_| Err(e.clone())).collect();
        };
        let mut wait = RecordWait::default();
        let results =
            keys.iter().map(|k| self.drop_replica_queued(k, seg, spare_only).map(|w| wait.merge(w))).collect();
        self.await_records(wait);
        results
    }

    /// Drops `key`'s replica on `seg` (`spare_only`: unless it is the object's last
    /// copy: no other complete memory replica, no disk replica), without waiting for
    /// the nodes' records.
    fn drop_replica_queued(&self, key: &str, seg: SegmentId, spare_only: bool) -> Result<RecordWait> {
        check_key(key)?;
        self.fence(key)?;
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        let e = match shard.get_mut(key) {
            Some(e) if e.complete() => e,
            _ => return Err(Error::NotFound(key.to_owned())),
        };
        let on_seg = |r: &StoredReplica| r.complete() && r.segment() == seg;
        if !e.replicas.iter().any(on_seg) {
            return Err(Error::NotFound(format!("{key} has no replica on segment {seg}")));
        }
        if spare_only && e.disk() == 0 && !e.replicas.iter().any(|r| r.complete() && r.segment() != seg) {
            return Err(Error::NotFound(format!("{key}: its replica on segment {seg} is its last copy; kept")));
        }
        if e.leased(now) {
            self.counters.lease_refusals.fetch_add(1, Ordering::Relaxed);
            return Err(Error::HasLease(key.to_owned()));
        }
        let (gone, kept): (Vec<StoredReplica>, Vec<StoredReplica>) = e.replicas.drain(..).partition(|r| on_seg(r));
        e.replicas.extend(kept);
        let mut wait = self.note_removed(key, &gone);
        // The freed memory may be reused at once: nothing reads it (not leased).
        drop(gone);
        if e.replicas.is_empty() && e.disk() == 0 {
            if let Some(e) = shard.remove(key) {
                wait.merge(self.note_removed(key, &e.replicas));
                self.release_disk(key, &e, &mut wait);
            }
        }
        Ok(wait)
    }
}
