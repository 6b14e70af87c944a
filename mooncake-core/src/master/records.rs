//! Object records: what each storage node is told about the objects in its segments,
//! so that a restarted master can be repopulated by the nodes re-mounting.
//!
//! A node that serves a record endpoint ([`mount_records`](MasterService::mount_records))
//! is told of every change synchronously: the change is queued on the node's
//! [`NodeLink`], the first waiting caller sends everything queued in one frame (group
//! commit), and the put or remove that made the change is acknowledged only once every
//! node it touched has answered. A node without a record endpoint gets its changes with
//! the answers to its heartbeats (best effort). A node that cannot be told in time is
//! forgotten, as if it had expired: its replicas are dropped, and when it comes back it
//! registers again and re-mounts with no records.

use std::sync::Arc;

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;

use crate::config::check_key;
use crate::error::{Error, Result};

use crate::master::object::{ObjectEntry, StoredReplica};
use crate::master::record_link::{NodeLink, RecordConnector, RecordSink, RecordWait};
use crate::master::service::MasterService;
use crate::master::types::{ClientId, MemoryReplica, ObjectRecord, RecordUpdate};

impl MasterService {
    /// Tells the master how to reach storage nodes' record endpoints (the daemon
    /// sets the RPC connector). Without one, nodes learn their records with their
    /// heartbeats. Only the first connector set is kept.
    pub fn set_record_connector(&self, connector: Arc<dyn RecordConnector>) {
        let _ = self.record_connector.set(connector);
    }

    /// A client in this process keeps the records of its segments in `sink`: the
    /// in-process form of [`mount_records`](Self::mount_records). Ignored by a master
    /// that does not track records.
    pub fn attach_records(&self, client: ClientId, sink: Arc<dyn RecordSink>) -> Result<()> {
        if !self.config.track_records {
            return Ok(());
        }
        self.link_records(client, sink)
    }

    /// A storage node serves the records of its segments at `endpoint`, to whoever
    /// proves its record `key`. From now on every change to them reaches it before
    /// the call that made the change returns. Ignored by a master that does not track
    /// records or has no connector.
    pub fn mount_records(&self, client: ClientId, endpoint: &str, key: &[u8]) -> Result<()> {
        if !self.config.track_records {
            return Ok(());
        }
        let Some(connector) = self.record_connector.get() else { return Ok(()) };
        if key.len() != crate::rpc::RECORD_KEY_LEN {
            return Err(Error::InvalidArgument(format!(
                "a record key has {} bytes, not {}",
                crate::rpc::RECORD_KEY_LEN,
                key.len()
            )));
        }
        if !self.clients.read().contains_key(&client) {
            return Err(Error::UnknownClient(client));
        }
        self.link_records(client, connector.connect(endpoint, key)?)
    }

    /// From now on, changes to `client`'s records go to `sink` (after those queued).
    fn link_records(&self, client: ClientId, sink: Arc<dyn RecordSink>) -> Result<()> {
        let link = NodeLink::new(client, sink);
        let clients = self.clients.read();
        let Some(rec) = clients.get(&client) else {
            link.close();
            return Err(Error::UnknownClient(client));
        };
        // Updates queued for the heartbeats go first, in order.
        let mut updates = rec.updates.lock();
        for u in updates.drain(..) {
            let _ = link.push(u);
        }
        if let Some(old) = rec.link.lock().replace(link) {
            old.close();
        }
        Ok(())
    }

    /// Queues `update` for the owner of `segment`: on its link, or for its heartbeats.
    pub(crate) fn push_update(&self, segment: SegmentId, update: RecordUpdate, wait: &mut RecordWait) {
        let owner = match self.segments.read().by_id.get(&segment) {
            Some(s) => s.owner,
            None => return,
        };
        if let Some(rec) = self.clients.read().get(&owner) {
            // Under the heartbeat queue's lock, so that `mount_records` moving the
            // queue onto the link cannot reorder updates.
            let mut updates = rec.updates.lock();
            match rec.link.lock().clone() {
                Some(link) => {
                    let ticket = link.push(update);
                    wait.add(owner, link, ticket);
                }
                None => updates.push(update),
            }
        }
    }

    /// Waits until the storage nodes got the updates of `wait`. A node that could not
    /// be told in time is forgotten (its replicas dropped, as on expiry). Returns
    /// whether every node got them.
    pub(crate) fn await_records(&self, wait: RecordWait) -> bool {
        let mut all = true;
        for (client, link, ticket) in wait.tickets {
            if !link.wait(ticket, self.config.record_timeout) {
                all = false;
                link.close();
                if self.clients.read().contains_key(&client) {
                    self.counters.record_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let removed = self.forget_client(client);
                    tracing::warn!(
                        client = format!("{client:#x}"),
                        removed,
                        "storage node could not be told of its records: forgotten"
                    );
                }
            }
        }
        all
    }

    /// Tells the owners of `key`'s complete replicas (or of `only` those) that they hold it.
    pub(crate) fn note_added(&self, key: &str, e: &ObjectEntry, only: Option<&[MemoryReplica]>) -> RecordWait {
        let mut wait = RecordWait::default();
        if !self.config.track_records {
            return wait;
        }
        for r in e.replicas.iter().filter(|r| r.complete()) {
            let m = r.memory(e.len());
            if only.is_some_and(|o| !o.contains(&m)) {
                continue;
            }
            let record = ObjectRecord { key: key.to_owned(), offset: m.offset, len: e.len(), checksum: e.checksum };
            self.push_update(m.segment, RecordUpdate::Added { segment: m.segment, record }, &mut wait);
        }
        wait
    }

    /// Tells the owners of these replicas of `key` that they no longer hold it.
    pub(crate) fn note_removed<'a>(
        &self,
        key: &str,
        replicas: impl IntoIterator<Item = &'a StoredReplica>,
    ) -> RecordWait {
        let mut wait = RecordWait::default();
        if !self.config.track_records {
            return wait;
        }
        for r in replicas.into_iter().filter(|r| r.complete()) {
            let segment = r.segment();
            let update = RecordUpdate::Removed { segment, key: key.to_owned(), offset: r.offset() };
            self.push_update(segment, update, &mut wait);
        }
        wait
    }

    /// Mounts a segment that already holds objects, e.g. when a node re-mounts after
    /// the master restarted. Each record's bytes are reserved at its offset; a record
    /// that overlaps another, falls outside the segment, or disagrees (length,
    /// checksum) with what the master already knows of the key is skipped.
    pub fn remount_segment(
        &self,
        client: ClientId,
        region: &RemoteRegion,
        capacity: u64,
        records: &[ObjectRecord],
    ) -> Result<(SegmentId, usize)> {
        self.mount_records_into(client, region, capacity, None, records)
    }

    /// Mounts a segment (of `group`, in cluster mode) and takes its records.
    pub(crate) fn mount_records_into(
        &self,
        client: ClientId,
        region: &RemoteRegion,
        capacity: u64,
        group: Option<u32>,
        records: &[ObjectRecord],
    ) -> Result<(SegmentId, usize)> {
        let mut records = records.to_vec();
        let id = self.mount_group_segment(client, region, capacity, group)?;
        // In a cluster, taking a group over opens its own recovery window.
        if !records.is_empty() && group.is_none() {
            self.note_recovery();
        }
        let Some(alloc) = self.segments.read().by_id.get(&id).map(|s| s.alloc.clone()) else {
            return Ok((id, 0));
        };
        records.sort_by_key(|r| r.offset);
        let now = self.now_ms();
        let mut taken = 0;
        for r in records {
            if check_key(&r.key).is_err() || crate::config::check_value_len(r.len).is_err() {
                continue;
            }
            let Some(buf) = alloc.allocate_at(r.offset, r.len) else {
                tracing::warn!(key = r.key, offset = r.offset, "record does not fit the segment; skipped");
                continue;
            };
            let mut shard = self.index.shard(&r.key).lock();
            match shard.get_mut(r.key.as_str()) {
                None => {
                    shard.insert(&r.key, {
                        let mut e = ObjectEntry::new_complete(r.len, r.checksum, now);
                        e.replicas.push(StoredReplica::new(buf, true));
                        e
                    });
                    taken += 1;
                }
                Some(e) if e.complete() && e.len() == r.len && e.checksum == r.checksum => {
                    e.replicas.push(StoredReplica::new(buf, true));
                    taken += 1;
                }
                Some(_) => tracing::warn!(key = r.key, "record conflicts with the master's view; skipped"),
            }
        }
        tracing::info!(segment = id, taken, "segment re-mounted with its objects");
        Ok((id, taken))
    }

    /// Keys of complete objects, at most `limit` (in no particular order).
    pub fn list_keys(&self, limit: usize) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        for shard in self.index.shards() {
            for (k, e) in shard.lock().iter() {
                if keys.len() >= limit {
                    return Ok(keys);
                }
                if e.complete() {
                    keys.push(k.to_string());
                }
            }
        }
        Ok(keys)
    }
}
