//! Upserts: replacing an object atomically.
//!
//! An upsert is a put that may find the key taken. Its first phase places new
//! replicas beside the object's current ones, which stay readable; its second swaps
//! them in one step under the shard lock, so a reader is handed either the old
//! replicas (with the old checksum) or the new ones, and a key that existed
//! throughout is never missing. The replaced replicas are not freed at the swap:
//! reads in flight may still be copying from them. They are kept until no read holds
//! the object (or the leases of those reads ran out), then freed.
//!
//! While an upsert is being written the object counts as leased: it is not removed,
//! evicted or shrunk under the writer. Only one upsert of a key is written at a time;
//! a second one (or an upsert of a key being put) is refused with `AlreadyExists`,
//! for the caller to retry once the first is over (`Store::upsert` does). An upsert
//! of an absent key is an ordinary put.
//!
//! Durable records: the swap queues `Removed` for every old replica and `Added` for
//! every new one under the shard lock, and the upsert is acknowledged once the nodes
//! applied them, as a put is.

use std::sync::atomic::Ordering;

use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::object::{ObjectEntry, Replicas, StagedUpsert, StoredReplica};
use crate::master::record_link::RecordWait;
use crate::master::service::MasterService;
use crate::master::types::{ClientId, MemoryReplica};

/// How often an upsert start goes around when the key changes between its steps
/// (created by a put, or removed, while the new replicas were being placed).
const START_ROUNDS: usize = 4;

/// What an upsert start found under the key.
enum Found {
    /// Nothing (or a put that never ended): the upsert is a put.
    Absent,
    /// A complete object, now marked with the upsert `id` being placed.
    Replacing(u64),
}

impl MasterService {
    /// Keeps the replicas of an upsert under way on `e` (about to be removed): its
    /// writer may be writing them, so their space is held until the upsert's
    /// deadline (see `orphaned_upserts`); an abandoned one's, a put timeout more.
    pub(crate) fn hold_orphaned_upsert(&self, e: &mut ObjectEntry, now: u64) {
        match e.take_staged_replicas() {
            Some((until, replicas)) if until > now => self.orphaned_upserts.lock().push((until, replicas)),
            abandoned => self.quarantine_abandoned_upsert(abandoned.map(|(_, replicas)| replicas)),
        }
    }

    /// Frees the retired replicas whose time is up, of every key that holds some.
    pub(crate) fn free_retired(&self, now: u64) {
        let keys: Vec<Box<str>> = self.retiring.lock().drain().collect();
        let mut left = Vec::new();
        for key in keys {
            let mut shard = self.index.shard(&key).lock();
            if let Some(e) = shard.get_mut(&key) {
                self.quarantine_abandoned_upsert(e.tidy_upsert(now));
                if e.has_retired() {
                    left.push(key);
                }
            }
        }
        self.retiring.lock().extend(left);
    }

    /// Moves the held replicas of orphaned upserts whose deadline passed into the
    /// quarantine of abandoned ones (a put timeout more: their writer may still be
    /// writing them).
    pub(crate) fn free_orphaned_upserts(&self, now: u64) {
        let due: Vec<Replicas> = {
            let mut held = self.orphaned_upserts.lock();
            let (due, kept): (Vec<_>, Vec<_>) = held.drain(..).partition(|(until, _)| *until <= now);
            *held = kept;
            due.into_iter().map(|(_, replicas)| replicas).collect()
        };
        for replicas in due {
            self.quarantine_abandoned_upsert(Some(replicas));
        }
    }

    /// Phase one of an upsert: reserves up to `cfg.replica_num` buffers of `len`
    /// bytes and returns where to write them. The object's current replicas stay
    /// readable until [`upsert_end`](Self::upsert_end). An absent key is put (then
    /// `upsert_end` ends that put). `AlreadyExists` while another put or upsert of
    /// the key is being written.
    pub fn upsert_start(
        &self,
        client: ClientId,
        key: &str,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Result<Vec<MemoryReplica>> {
        check_key(key)?;
        self.fence(key)?;
        check_value_len(len)?;
        cfg.check()?;
        let mut round = 0;
        loop {
            round += 1;
            let res = match self.mark_upsert(client, key, len, cfg)? {
                Found::Absent => self.put_start(client, key, len, cfg),
                Found::Replacing(id) => self.place_upsert(key, len, cfg, id),
            };
            match res {
                // The key changed between the two steps: look again.
                Err(Error::AlreadyExists(_)) | Err(Error::NotFound(_)) if round < START_ROUNDS => continue,
                res => return res,
            }
        }
    }

    /// Marks the complete object under `key` as being replaced by a new upsert (its
    /// replicas are placed next), or finds that the key is free.
    fn mark_upsert(&self, client: ClientId, key: &str, len: u64, cfg: &ReplicateConfig) -> Result<Found> {
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        // Under the shard lock, as in `put_start`: a group released meanwhile drops
        // what it finds under these locks.
        self.fence(key)?;
        let Some(e) = shard.get_mut(key) else { return Ok(Found::Absent) };
        if !e.complete() {
            return if self.put_expired(e, now) {
                Ok(Found::Absent)
            } else {
                Err(Error::AlreadyExists(format!("{key} (a put of it is in progress)")))
            };
        }
        if e.staged(now).is_some() {
            return Err(Error::AlreadyExists(format!("{key} (an upsert of it is in progress)")));
        }
        // An upsert whose writer gave up leaves its replicas to be freed here.
        self.quarantine_abandoned_upsert(e.tidy_upsert(now));
        let id = rand::random::<u64>();
        e.extra.get_or_insert_with(Default::default).staged = Some(StagedUpsert {
            owner: client,
            id,
            len,
            until_ms: now + self.config.put_timeout.as_millis() as u64,
            soft_pin: (!cfg.keep_soft_pin).then_some(cfg.soft_pin),
            soft_pin_ttl_ms: cfg.soft_pin_ttl_ms(),
            replicas: Replicas::new(),
        });
        Ok(Found::Replacing(id))
    }

    /// Places the new replicas of the upsert `id` (the object stays readable and
    /// leased meanwhile) and attaches them to it.
    fn place_upsert(&self, key: &str, len: u64, cfg: &ReplicateConfig, id: u64) -> Result<Vec<MemoryReplica>> {
        let placed = self.allocate(key, len, cfg, None).and_then(|bufs| {
            if bufs.len() < cfg.replica_num && cfg.require_all_replicas {
                return Err(Error::NoSpace {
                    needed: len,
                    largest_free: 0,
                    reason: format!("{key}: only {} of {} replicas could be placed", bufs.len(), cfg.replica_num),
                });
            }
            Ok(bufs)
        });
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        self.fence(key)?;
        let Some(e) = shard.get_mut(key) else {
            // The object went with its segments (a node was lost) while we placed:
            // what is left to do is a put.
            return Err(Error::NotFound(key.to_owned()));
        };
        let Some(staged) = e.extra.as_deref_mut().and_then(|u| u.staged.as_mut()).filter(|s| s.id == id) else {
            return Err(Error::AlreadyExists(format!("{key} (changed while the upsert was placed)")));
        };
        let bufs = match placed {
            Ok(bufs) => bufs,
            Err(err) => {
                if let Some(u) = e.extra.as_deref_mut() {
                    u.staged = None;
                }
                self.quarantine_abandoned_upsert(e.tidy_upsert(now));
                return Err(err);
            }
        };
        if bufs.len() < cfg.replica_num {
            self.counters.under_replicated_puts.fetch_add(1, Ordering::Relaxed);
        }
        let replicas = bufs.iter().map(MemoryReplica::of).collect();
        staged.replicas = bufs.into_iter().map(|buf| StoredReplica::new(buf, false)).collect();
        Ok(replicas)
    }

    /// Phase two of an upsert: the new bytes are written; they replace the object's
    /// in one step. With durable records, returns once every node concerned recorded
    /// the change (see [`put_end`](Self::put_end)).
    pub fn upsert_end(&self, client: ClientId, key: &str, checksum: u32) -> Result<()> {
        let wait = self.upsert_end_queued(client, key, checksum)?;
        self.settle("upsert", key, checksum, wait)
    }

    /// [`upsert_end`](Self::upsert_end) without waiting for the nodes' records.
    fn upsert_end_queued(&self, client: ClientId, key: &str, checksum: u32) -> Result<RecordWait> {
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        // Under the shard lock (see `put_start`).
        self.fence(key)?;
        let Some(e) = shard.get_mut(key) else {
            // As a put's end (see `put_end_queued`): an upsert that ended may come
            // back with a re-mounting node.
            return Err(if self.recovering_key(key) { self.absent(key) } else { no_upsert(key) });
        };
        if !e.complete() {
            // The key was absent: this upsert is a put.
            drop(shard);
            return self.put_end_queued(client, key, checksum);
        }
        let staged = e
            .extra
            .as_deref_mut()
            .and_then(|u| u.staged.take_if(|s| s.owner == client && s.until_ms > now && !s.replicas.is_empty()));
        let Some(staged) = staged else {
            if e.checksum == checksum {
                // Asked again (sent again after a broken connection, or to a new
                // leader) once it ended: the object holds these bytes. Its records
                // are told again, so that the answer waits for them as the first did.
                return Ok(self.note_added(key, e, None));
            }
            return Err(no_upsert(key));
        };
        let mut new = staged.replicas;
        // Replicas on segments that left meanwhile cannot be read.
        {
            let segments = self.segments.read();
            new.retain(|r| segments.by_id.contains_key(&r.segment()));
        }
        if new.is_empty() {
            self.quarantine_abandoned_upsert(e.tidy_upsert(now));
            return Err(Error::NotFound(format!("{key} (the segments of the upsert are gone)")));
        }
        for r in &mut new {
            r.set_complete();
        }
        // The swap. Reads that were handed the old replicas may still be copying
        // from them: they are kept until those reads are over.
        let mut wait = self.note_removed(key, &e.replicas);
        // The old value is superseded (its tombstone is older than the new records'
        // stamps, taken below), and a file of it on an SSD holds the old bytes.
        self.release_disk(key, e, &mut wait);
        // Kept while any read may still use them: a get's lease (`default_lease`), or
        // a longer one the entry holds (a replicate copying from the old replicas,
        // or still filling targets among them, holds `put_timeout`).
        let retire_until = (now + self.config.default_lease.as_millis() as u64).max(e.lease_until_ms());
        let Some(u) = e.extra.as_deref_mut() else { return Err(no_upsert(key)) };
        let old = std::mem::replace(&mut e.replicas, new);
        u.retired.extend(old.into_iter().map(|r| (retire_until, r)));
        self.retiring.lock().insert(key.into());
        e.set_disk(0);
        e.set_offload_deadline_ms(0);
        e.set_len(staged.len);
        e.checksum = checksum;
        e.last_access_ms = now;
        // Put on this master: newer than any copy a node may still offer back.
        e.set_recovered(false);
        e.set_unconfirmed(false);
        if let Some(pin) = staged.soft_pin {
            e.set_soft_pin(pin, staged.soft_pin_ttl_ms);
        }
        self.quarantine_abandoned_upsert(e.tidy_upsert(now));
        wait.merge(self.note_added(key, e, None));
        let first = e.replicas.first().map(|r| r.segment());
        drop(shard);
        // Deletes of earlier copies nodes were not told of yet (an evicted replica's
        // record, a second SSD file's): acknowledged only once they are, as a put.
        wait.merge(self.unsent_removals.take(key));
        self.offload_on_put(key, first);
        Ok(wait)
    }

    /// Abandons an upsert: the object keeps its value; the upsert's new replicas are
    /// freed a client TTL later, as a revoked put's room is (bytes its writer sent
    /// may still land there).
    pub fn upsert_revoke(&self, client: ClientId, key: &str) -> Result<()> {
        let now = self.now_ms();
        // No upsert of `key` by `client` in progress: done already if this revoke
        // was asked again once it was served.
        let none = || if self.was_revoked(client, key) { Ok(()) } else { Err(no_upsert(key)) };
        let mut shard = self.index.shard(key).lock();
        self.fence(key)?;
        let Some(e) = shard.get_mut(key) else { return none() };
        if !e.complete() {
            drop(shard);
            return self.put_revoke(client, key);
        }
        let staged = e.extra.as_deref_mut().and_then(|u| u.staged.take_if(|s| s.owner == client));
        self.quarantine_abandoned_upsert(e.tidy_upsert(now));
        let Some(staged) = staged else { return none() };
        // As a revoked put's room (see `put_revoke`): bytes its writer sent may still
        // be on their way to a paused node.
        self.quarantine_replicas(staged.replicas, self.config.client_ttl);
        self.note_revoked(client, key);
        Ok(())
    }

    /// [`upsert_start`](Self::upsert_start) for many keys; one result per key.
    pub fn batch_upsert_start(
        &self,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        items.iter().map(|(k, len)| self.upsert_start(client, k, *len, cfg)).collect()
    }

    /// [`upsert_end`](Self::upsert_end) for many keys; one result per key. The
    /// nodes' records of all of them are awaited together.
    pub fn batch_upsert_end(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        self.end_batch("upsert", items, |k, c| self.upsert_end_queued(client, k, c))
    }

    /// [`upsert_revoke`](Self::upsert_revoke) for many keys; one result per key.
    pub fn batch_upsert_revoke(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        keys.iter().map(|k| self.upsert_revoke(client, k)).collect()
    }
}

impl MasterService {
    /// Drops the upserts `client` was writing (it is gone: they cannot end), so that
    /// their objects are no longer held for them.
    pub(crate) fn drop_upserts_of(&self, client: ClientId) {
        let now = self.now_ms();
        for shard in self.index.shards() {
            shard.lock().for_each_mut(|_, e| {
                let Some(u) = e.extra.as_deref_mut() else { return };
                if let Some(staged) = u.staged.take_if(|s| s.owner == client) {
                    // As the room of a put whose writer was forgotten: its bytes may
                    // still be on their way.
                    self.quarantine_replicas(staged.replicas, self.config.put_timeout);
                    self.quarantine_abandoned_upsert(e.tidy_upsert(now));
                }
            });
        }
    }
}

fn no_upsert(key: &str) -> Error {
    Error::NotFound(format!("{key} (no upsert in progress by this client)"))
}
