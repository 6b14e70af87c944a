//! `LocalDisk` replicas: objects offloaded to a client's SSD, and the SSD usage the
//! master tracks per client to feed `SsdFreeRatioFirst` (reference 002).
//!
//! `ssd_used` grows by an object's size only once the master has recorded its
//! `LocalDisk` replica (a notification for a vanished object changes nothing), and
//! shrinks whenever such a replica leaves the metadata: remove, disk eviction, or
//! the loss of the client.

use std::sync::atomic::Ordering;

use mooncake_alloc::{SegmentId, SsdMetricsProvider};

use crate::config::{check_key, PersistPolicy};
use crate::error::{Error, Result};

use crate::master::object::ObjectEntry;
use crate::master::record_link::RecordWait;
use crate::master::recovered::Offered;
use crate::master::service::MasterService;
use crate::master::types::{ClientId, OffloadPlan, OffloadTask, RecordUpdate};

/// The master's view of each segment owner's SSD.
pub(crate) struct MasterSsdMetrics<'a>(pub(super) &'a MasterService);

impl MasterSsdMetrics<'_> {
    pub(crate) fn of(&self, segment: SegmentId, f: impl Fn(&crate::master::segment::ClientRecord) -> i64) -> i64 {
        let Some(owner) = self.0.segments.read().by_id.get(&segment).map(|s| s.owner) else { return 0 };
        self.0.clients.read().get(&owner).map_or(0, f)
    }
}

impl SsdMetricsProvider for MasterSsdMetrics<'_> {
    fn ssd_total_capacity(&self, segment: SegmentId) -> i64 {
        self.of(segment, |c| c.ssd_total.load(Ordering::Relaxed))
    }

    fn ssd_used_bytes(&self, segment: SegmentId) -> i64 {
        self.of(segment, |c| c.ssd_used.load(Ordering::Relaxed))
    }
}

impl MasterService {
    /// Records the SSD capacity of a client (what `SsdFreeRatioFirst` ranks by).
    pub fn report_ssd_capacity(&self, client: ClientId, capacity_bytes: i64) -> Result<()> {
        let clients = self.clients.read();
        let rec = clients.get(&client).ok_or(Error::UnknownClient(client))?;
        rec.ssd_total.store(capacity_bytes, Ordering::Relaxed);
        Ok(())
    }

    /// A client offers an SSD tier of `capacity_bytes`, serving loads of its disk
    /// replicas at `endpoint` (the address of its `batch_get_offload_object` server).
    pub fn mount_ssd(&self, client: ClientId, capacity_bytes: i64, endpoint: &str) -> Result<()> {
        if capacity_bytes <= 0 {
            return Err(Error::InvalidArgument(format!("SSD capacity {capacity_bytes} must be positive")));
        }
        let clients = self.clients.read();
        let rec = clients.get(&client).ok_or(Error::UnknownClient(client))?;
        rec.ssd_total.store(capacity_bytes, Ordering::Relaxed);
        *rec.ssd_endpoint.lock() = Some(endpoint.to_owned());
        Ok(())
    }

    /// Where `client` serves loads from its SSD; `NotFound` if it has no SSD tier.
    pub fn disk_endpoint(&self, client: ClientId) -> Result<String> {
        let clients = self.clients.read();
        let rec = clients.get(&client).ok_or_else(|| Error::NotFound(format!("client {client:#x} is gone")))?;
        let ep = rec.ssd_endpoint.lock().clone();
        ep.ok_or_else(|| Error::NotFound(format!("client {client:#x} has no SSD tier")))
    }

    /// The owner of `segment` if it has an SSD tier that offloads are asked of.
    pub(crate) fn offload_owner(&self, segment: SegmentId) -> Option<ClientId> {
        if self.config.persist == PersistPolicy::None {
            return None;
        }
        let owner = self.segments.read().by_id.get(&segment)?.owner;
        let clients = self.clients.read();
        let rec = clients.get(&owner)?;
        rec.takes_offloads().then_some(owner)
    }

    /// Segments whose owners take offloads, with those owners (one lookup per
    /// eviction pass rather than per object).
    pub(crate) fn offload_owners(&self) -> ahash::HashMap<SegmentId, ClientId> {
        if self.config.persist == PersistPolicy::None {
            return Default::default();
        }
        // Clients before segments, the order mounts take them in.
        let clients = self.clients.read();
        let table = self.segments.read();
        table
            .by_id
            .iter()
            .filter(|(_, s)| clients.get(&s.owner).is_some_and(|c| c.takes_offloads()))
            .map(|(id, s)| (*id, s.owner))
            .collect()
    }

    /// Asks `owner` to offload `objects` (key, checksum; their entries were marked
    /// pending).
    pub(crate) fn queue_offloads(&self, owner: ClientId, objects: impl IntoIterator<Item = (Box<str>, u32)>) {
        if let Some(rec) = self.clients.read().get(&owner) {
            rec.offload.lock().write.extend(objects);
        }
    }

    /// Under [`PersistPolicy::Eager`], asks for a completed object to be offloaded.
    pub(crate) fn offload_on_put(&self, key: &str, first_segment: Option<SegmentId>) {
        if self.config.persist != PersistPolicy::Eager {
            return;
        }
        let Some(owner) = first_segment.and_then(|s| self.offload_owner(s)) else { return };
        let deadline = self.now_ms() + self.config.put_timeout.as_millis() as u64;
        let checksum = {
            let mut shard = self.index.shard(key).lock();
            match shard.get_mut(key) {
                Some(e) if e.complete() && e.disk() == 0 => {
                    e.set_offload_deadline_ms(deadline);
                    e.checksum
                }
                _ => return,
            }
        };
        self.queue_offloads(owner, [(key.into(), checksum)]);
    }

    /// The offload heartbeat of a client's SSD tier: up to `max` objects of its
    /// segments to write to its SSD (eviction leaves their memory alone meanwhile),
    /// and the keys whose disk replicas were dropped (removed objects), whose files
    /// it should delete. Counts as a heartbeat.
    pub fn offload_heartbeat(&self, client: ClientId, max: usize) -> Result<OffloadPlan> {
        let now = self.now_ms();
        let (keys, discard, segments) = {
            let clients = self.clients.read();
            let rec = clients.get(&client).ok_or(Error::UnknownClient(client))?;
            rec.touch(now);
            let mut q = rec.offload.lock();
            let n = q.write.len().min(max);
            let keys: Vec<(Box<str>, u32)> = q.write.drain(..n).collect();
            (keys, std::mem::take(&mut q.discard), rec.segments.clone())
        };
        let hold = now + self.config.put_timeout.as_millis() as u64;
        let mut tasks = Vec::with_capacity(keys.len());
        for (key, checksum) in keys {
            let mut shard = self.index.shard(&key).lock();
            let Some(e) = shard.get_mut(&key) else { continue };
            if e.checksum != checksum || (e.disk() != 0 && e.disk() != client) {
                // Asked for an object since replaced (the new one's request is its
                // own, perhaps of another node), or already on another node's SSD:
                // a second file of one object is one the master would not know of.
                continue;
            }
            if !e.complete() || e.disk() == client {
                e.set_offload_deadline_ms(0);
                continue;
            }
            let Some(r) = e.replicas.iter().find(|r| r.complete() && segments.contains(&r.segment())) else {
                e.set_offload_deadline_ms(0);
                continue;
            };
            // Stamped while the object exists (under its shard lock): later than its
            // put, earlier than its removal.
            let task = OffloadTask {
                key: key.to_string(),
                segment: r.segment(),
                offset: r.offset(),
                len: e.len(),
                checksum: e.checksum,
                generation: self.gens.next(),
            };
            // Eviction skips the object until it is reported (or the deadline
            // passes). A remove may still free the memory under the client's read;
            // the client then sees a checksum mismatch and skips the object.
            e.set_offload_deadline_ms(e.offload_deadline_ms().max(hold));
            tasks.push(task);
        }
        Ok(OffloadPlan { tasks, discard })
    }

    /// Re-registers objects (key, length, checksum, generation) a client found on its
    /// SSD when it started (or after the master restarted): an object the master does
    /// not know is created with only its disk replica, unless its key was removed or
    /// put again after the file was written (its tombstone is newer: refused with
    /// `AlreadyExists`); a known one with the same length and checksum gains the disk
    /// replica; one that differs is refused with `AlreadyExists` (the disk copy is
    /// stale and should be deleted).
    pub fn register_disk_objects(&self, client: ClientId, items: &[(&str, u64, u32, u64)]) -> Vec<Result<()>> {
        if !self.clients.read().contains_key(&client) {
            return items.iter().map(|_| Err(Error::UnknownClient(client))).collect();
        }
        let now = self.now_ms();
        let offer = self.offer_context(client);
        items
            .iter()
            .map(|&(key, len, checksum, generation)| {
                check_key(key)?;
                self.fence(key)?;
                crate::config::check_value_len(len)?;
                self.gens.observe(generation);
                let mut shard = self.index.shard(key).lock();
                let offered = self.classify_offered(&shard, key, len, checksum, generation);
                let remember = match offered {
                    Offered::Absent => {
                        let mut e = ObjectEntry::new_complete(len, checksum, now);
                        e.set_disk(client);
                        let remember = Self::recovered_copy(&mut e, true, offer);
                        shard.insert(key, e);
                        self.add_ssd_used(client, len as i64);
                        remember
                    }
                    Offered::Same | Offered::Newer => {
                        let Some(e) = shard.get_mut(key) else {
                            return Err(Error::AlreadyExists(format!("{key} (the master holds a different object)")));
                        };
                        if offered == Offered::Newer {
                            self.take_newer_copy(key, e, (len, checksum), Some(client), now);
                        }
                        let previous = e.disk();
                        self.attach_disk(e, client);
                        if previous != 0 && previous != client {
                            // The master keeps one disk replica: the file of the node
                            // it held it on goes (that node may be this one's dead
                            // previous life on the same directory: then nothing is
                            // delivered). A later remove, upsert or put of the key
                            // waits for it, or a restarted master could take it
                            // back after the key was removed.
                            let mut wait = RecordWait::default();
                            self.discard_on(previous, key, self.gens.next(), &mut wait);
                            self.unsent_removals.add(key, wait);
                        }
                        Self::recovered_copy(e, offered == Offered::Newer, offer)
                    }
                    Offered::Stale => {
                        self.counters.stale_copies.fetch_add(1, Ordering::Relaxed);
                        return Err(Error::AlreadyExists(format!(
                            "{key} (removed or put again after this copy was written)"
                        )));
                    }
                    Offered::Conflict => {
                        return Err(Error::AlreadyExists(format!("{key} (the master holds a different object)")))
                    }
                };
                if remember {
                    self.remember_recovered(&mut shard, key, generation);
                }
                Ok(())
            })
            .collect()
    }

    /// SSD capacity and recorded usage of a client.
    pub fn ssd_usage(&self, client: ClientId) -> Option<(i64, i64)> {
        self.clients
            .read()
            .get(&client)
            .map(|c| (c.ssd_total.load(Ordering::Relaxed), c.ssd_used.load(Ordering::Relaxed)))
    }

    pub(crate) fn add_ssd_used(&self, client: ClientId, delta: i64) {
        if let Some(c) = self.clients.read().get(&client) {
            c.ssd_used.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Records `e`'s disk replica on `client` (moving the usage from a previous one).
    pub(crate) fn attach_disk(&self, e: &mut ObjectEntry, client: ClientId) {
        if e.disk() != client {
            if e.disk() != 0 {
                self.add_ssd_used(e.disk(), -(e.len() as i64));
            }
            e.set_disk(client);
            self.add_ssd_used(client, e.len() as i64);
        }
    }

    /// `e`, the object under `key`, is removed or replaced: its tombstone records the
    /// removal's generation (handed to nodes to keep if copies of the key may be out
    /// of sight: `master/carried.rs`), its disk replica's usage is given back, and every SSD
    /// that holds (or may be writing) a file of it is told to delete it, on the node's
    /// record endpoint when it has one (the call then waits for it in `wait`: a
    /// removal is as durable as a put), else with its next offload heartbeat.
    /// Returns the removal's generation.
    pub(crate) fn release_disk(&self, key: &str, e: &ObjectEntry, wait: &mut RecordWait) -> u64 {
        let generation = self.gens.next();
        if self.tombstones.supersede(key, generation) {
            self.carry_tombstone(key, generation, wait);
        }
        self.discard_copies(key, e, generation, None, wait);
        generation
    }

    /// Gives back the usage of `e`'s disk replica and tells every SSD that holds (or
    /// may be writing) a file of it, but `spare`'s, to delete its file of `key` of
    /// `generation` or older (see [`release_disk`](Self::release_disk)).
    pub(crate) fn discard_copies(
        &self,
        key: &str,
        e: &ObjectEntry,
        generation: u64,
        spare: Option<ClientId>,
        wait: &mut RecordWait,
    ) {
        let mut holders: smallvec::SmallVec<[ClientId; 2]> = smallvec::SmallVec::new();
        if e.disk() != 0 {
            self.add_ssd_used(e.disk(), -(e.len() as i64));
            holders.push(e.disk());
        }
        if e.offload_deadline_ms() != 0 {
            // An offload was asked of the owner of a memory replica: its file may be
            // written (or being written) without the master knowing yet.
            let table = self.segments.read();
            let owners: smallvec::SmallVec<[ClientId; 2]> =
                e.replicas.iter().filter_map(|r| table.by_id.get(&r.segment()).map(|s| s.owner)).collect();
            drop(table);
            for owner in owners {
                if !holders.contains(&owner) {
                    holders.push(owner);
                }
            }
        }
        for client in holders.into_iter().filter(|&c| Some(c) != spare) {
            self.discard_on(client, key, generation, wait);
        }
    }

    /// Tells `holder`'s SSD tier to delete its file of `key` if it is of
    /// `generation` or older: on its record endpoint when it has one (`wait` then
    /// waits for it), else with its next offload heartbeat.
    fn discard_on(&self, holder: ClientId, key: &str, generation: u64, wait: &mut RecordWait) {
        if self.has_record_link(holder) {
            let discard = |_| RecordUpdate::Discard { key: key.to_owned(), generation };
            self.push_to_client(holder, discard, wait);
        } else if let Some(rec) = self.clients.read().get(&holder) {
            rec.offload.lock().discard.push(key.to_owned());
        }
    }

    /// A new put of `key` ended at `generation`: copies of an earlier object under the
    /// key that may linger are refused from now on (see `Tombstones`).
    pub(crate) fn supersede_tombstone(&self, key: &str, generation: u64) {
        self.tombstones.supersede_if_marked(key, generation);
    }

    /// A client wrote these objects (key, length, checksum, and the generation of the
    /// offload task it wrote from) to its SSD: each gets a `LocalDisk` replica on that
    /// client. An object that vanished, whose length or checksum differ, or that was
    /// removed or replaced after the task was given (a put again with the same bytes
    /// included: the file written is the old object's, deleted by its removal), or
    /// that is on another client's SSD already (the master keeps one disk replica, and
    /// tells only its holder of a removal), is refused with `NotFound` (the client
    /// deletes its file) and changes no counter.
    pub fn notify_offload_success(&self, client: ClientId, items: &[(&str, u64, u32, u64)]) -> Vec<Result<()>> {
        if !self.clients.read().contains_key(&client) {
            return items.iter().map(|_| Err(Error::UnknownClient(client))).collect();
        }
        items
            .iter()
            .map(|&(key, len, checksum, generation)| {
                check_key(key)?;
                self.fence(key)?;
                let mut shard = self.index.shard(key).lock();
                match shard.get_mut(key) {
                    Some(e)
                        if e.complete()
                            && e.len() == len
                            && e.checksum == checksum
                            && (e.disk() == 0 || e.disk() == client)
                            && !self.tombstones.superseded_after(key, generation) =>
                    {
                        e.set_offload_deadline_ms(0);
                        self.attach_disk(e, client);
                        Ok(())
                    }
                    _ => Err(Error::NotFound(key.to_owned())),
                }
            })
            .collect()
    }

    /// A client evicted these objects from its SSD: their `LocalDisk` replicas go;
    /// memory replicas stay, and an object is removed only when no replica is left.
    pub fn batch_evict_disk_replica(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        keys.iter()
            .map(|&key| {
                check_key(key)?;
                self.fence(key)?;
                let mut shard = self.index.shard(key).lock();
                match shard.get_mut(key) {
                    Some(e) if e.disk() == client => {
                        // The client evicted the file itself: nothing to discard.
                        self.add_ssd_used(client, -(e.len() as i64));
                        e.set_disk(0);
                        if e.replicas.is_empty() {
                            self.hold_orphaned_upsert(e, self.now_ms());
                            shard.remove(key);
                            // The object leaves the master's sight, as an eviction's
                            // does, while copies it was not told of may remain (a
                            // node's record whose removal never reached it): marked, so
                            // that a later put of the key refuses them.
                            self.tombstones.linger(key);
                        }
                        Ok(())
                    }
                    _ => Err(Error::NotFound(format!("{key} (no disk replica on this client)"))),
                }
            })
            .collect()
    }

    /// Drops the disk replicas of a lost client; returns how many objects had no
    /// other replica and were removed.
    pub(crate) fn drop_disk_replicas_of(&self, client: ClientId) -> usize {
        let mut removed = 0;
        let now = self.now_ms();
        for shard in self.index.shards() {
            shard.lock().retain(|k, e| {
                if e.disk() != client {
                    return true;
                }
                // The file stays on the lost client's disk, out of our sight.
                self.tombstones.linger(k);
                e.set_disk(0);
                let keep = !e.replicas.is_empty();
                if !keep {
                    self.hold_orphaned_upsert(e, now);
                }
                removed += usize::from(!keep);
                keep
            });
        }
        removed
    }
}
