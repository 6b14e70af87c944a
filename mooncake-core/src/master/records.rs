//! Object records: what each storage node is told about the objects in its segments,
//! so that a restarted master can be repopulated by the nodes re-mounting.
//!
//! A node that serves a record endpoint ([`mount_records`](MasterService::mount_records))
//! is told of every change synchronously: the change is queued on the node's
//! [`NodeLink`], the first waiting caller sends everything queued in one frame (group
//! commit), and the put or remove that made the change is acknowledged only once every
//! node it touched has answered. A node without a record endpoint gets its changes with
//! the answers to its heartbeats (best effort). A node that cannot be told yet (slow,
//! paused) keeps its updates queued and retried; the call waits, and is acknowledged
//! once they are delivered. A node is forgotten only when it is certainly gone (its
//! endpoint refuses connections), by its TTL, or when its records could not be
//! delivered for a whole TTL; when it comes back it re-mounts with the records it
//! holds, and the master takes back those no later removal or put superseded
//! (ARCHITECTURE.md, "Generations").

use std::sync::Arc;

use mooncake_alloc::{AllocatedBuffer, SegmentId};
use mooncake_transfer::RemoteRegion;

use crate::config::{check_key, check_value_len};
use crate::error::{Error, Result};

use crate::master::object::{ObjectEntry, StoredReplica};
use crate::master::record_link::{Delivery, NodeLink, RecordConnector, RecordSink, RecordWait};
use crate::master::recovered::Offered;
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
        let refused = || {
            Error::InvalidArgument(format!(
                "client {client}'s records are mounted with another record key: only the node that mounted \
                 them may move them"
            ))
        };
        {
            let clients = self.clients.read();
            let rec = clients.get(&client).ok_or(Error::UnknownClient(client))?;
            if rec.record_key.lock().as_deref().is_some_and(|k| k != key) {
                return Err(refused());
            }
        }
        // Bound only once the endpoint proved it holds the key (the connector's
        // handshake), so a mount that fails binds nothing.
        let sink = connector.connect(endpoint, key)?;
        {
            let clients = self.clients.read();
            let rec = clients.get(&client).ok_or(Error::UnknownClient(client))?;
            let mut bound = rec.record_key.lock();
            match bound.as_deref() {
                Some(k) if k != key => return Err(refused()),
                Some(_) => {}
                None => *bound = Some(key.to_vec()),
            }
        }
        self.link_records(client, sink)
    }

    /// From now on, changes to `client`'s records go to `sink` (after those queued).
    fn link_records(&self, client: ClientId, sink: Arc<dyn RecordSink>) -> Result<()> {
        let link = NodeLink::new(client, sink);
        let clients = self.clients.read();
        let Some(rec) = clients.get(&client) else {
            link.close();
            return Err(Error::UnknownClient(client));
        };
        // Under the heartbeat queue's lock, which every update takes first: none is
        // queued while the link changes.
        let mut updates = rec.updates.lock();
        let old = rec.link.lock().take();
        // What an earlier endpoint of the node did not deliver goes first, then what
        // waited for the heartbeats, in order (their generations are older than any the
        // new link stamps).
        for u in old.map(|old| old.close()).unwrap_or_default().into_iter().chain(updates.drain(..)) {
            let _ = link.push(&self.gens, |_| u);
        }
        *rec.link.lock() = Some(link);
        Ok(())
    }

    /// Queues the update `make` builds (given its generation) for the owner of
    /// `segment`: on its link, or for its heartbeats.
    pub(crate) fn push_update(
        &self,
        segment: SegmentId,
        make: impl FnOnce(u64) -> RecordUpdate,
        wait: &mut RecordWait,
    ) {
        let owner = match self.segments.read().by_id.get(&segment) {
            Some(s) => s.owner,
            None => {
                // The segment went (its node is being forgotten, or unmounted it):
                // whatever its node still holds is out of sight, untold.
                self.linger_untold(&make(self.gens.next()));
                return;
            }
        };
        self.push_to_client(owner, make, wait);
    }

    /// `u` will never reach its node (forgotten, or going): the key's tombstone
    /// keeps what the node holds of it from coming back when the node does. A
    /// removal it missed (an eviction's, which leaves no mark of its own) refuses
    /// whatever it holds of the key, even if the key comes and goes again
    /// meanwhile; anything else lingers (good until the key is put or removed again).
    /// A removal missed while the key holds no object is handed to nodes to keep
    /// (`master/carried.rs`), not waited for: the removal's call was answered when
    /// the node was given up. (While the key holds an object, the update may be
    /// one replica's removal, and a restarted master must not refuse the object's
    /// other copies.)
    pub(crate) fn mark_untold(&self, u: &RecordUpdate) {
        match u {
            // (A drain notice, a tombstone kept for us: about no copy of the node.)
            RecordUpdate::Drain { .. } | RecordUpdate::Tombstone { .. } => {}
            RecordUpdate::Removed { key, generation, .. } => {
                self.tombstones.supersede_unseen(key, *generation);
                if self.index.shard(key).lock().get(key).is_none() {
                    self.carry_tombstone(key, *generation, &mut RecordWait::default());
                }
            }
            u => self.tombstones.linger(u.key()),
        }
    }

    /// `u`, built for a node that went while it was being queued, will never reach
    /// it: the key lingers. Never a removal's supersede here: the update may be one
    /// replica's removal (a replica dropped, memory copies of an offloaded object
    /// evicted) while the object lives on elsewhere, and a mark at its generation
    /// would refuse the other holders' copies too when they re-mount. Lingering is
    /// enough for an eviction's: the key's next put raises the mark past this copy
    /// (`supersede_if_marked`), and an evicted object offered back harms nothing.
    fn linger_untold(&self, u: &RecordUpdate) {
        if !matches!(u, RecordUpdate::Drain { .. } | RecordUpdate::Tombstone { .. }) {
            self.tombstones.linger(u.key());
        }
    }

    /// Queues the update `make` builds for `client`: on its link, or for its
    /// heartbeats. Returns whether the client is known.
    pub(crate) fn push_to_client(
        &self,
        client: ClientId,
        make: impl FnOnce(u64) -> RecordUpdate,
        wait: &mut RecordWait,
    ) -> bool {
        let clients = self.clients.read();
        let Some(rec) = clients.get(&client) else {
            // Forgotten (or being forgotten: its record goes before its segments
            // and replicas), so never told: see `linger_untold`.
            self.linger_untold(&make(self.gens.next()));
            return false;
        };
        // Under the heartbeat queue's lock, so that `mount_records` moving the queue
        // onto the link cannot reorder updates (their generations increase in order).
        let mut updates = rec.updates.lock();
        match rec.link.lock().clone() {
            Some(link) => {
                let ticket = link.push(&self.gens, make);
                wait.add(client, link, ticket);
            }
            None => updates.push(make(self.gens.next())),
        }
        true
    }

    /// The link `client`'s updates go on now. Read under its heartbeat queue's lock:
    /// a node moving to a new endpoint holds it from taking the old link until the
    /// new one has the old one's updates, so this never sees the node between links
    /// (no link: nothing to wait for) nor a new link without the old one's updates.
    fn current_link(&self, client: ClientId) -> Option<Arc<NodeLink>> {
        let clients = self.clients.read();
        let rec = clients.get(&client)?;
        let _moving = rec.updates.lock();
        let link = rec.link.lock().clone();
        link
    }

    /// Whether `client` gets its updates on a record endpoint (which a call can wait for).
    pub(crate) fn has_record_link(&self, client: ClientId) -> bool {
        self.clients.read().get(&client).is_some_and(|rec| rec.link.lock().is_some())
    }

    /// Waits until the storage nodes got the updates of `wait`: a node slow or paused
    /// is waited for (its updates stay queued and are sent again) for as long as it is
    /// registered. A node is given up on only when it is certainly gone (forgotten at
    /// once), when it was forgotten meanwhile (by its TTL), or when sends to it have
    /// failed for a whole client TTL (forgotten then). Returns whether every node got
    /// them.
    pub(crate) fn await_records(&self, wait: RecordWait) -> bool {
        let mut all = true;
        for (mut client, mut link, mut ticket) in wait.tickets {
            loop {
                match link.wait(ticket, self.config.record_timeout) {
                    Delivery::Done => {
                        // Others' updates queued behind a frame this call answered
                        // (another declared put's records): written ahead once this
                        // call is answered, rather than when their own put ends.
                        if link.has_unsent() {
                            self.send_after_answer.add_link(link);
                        }
                        break;
                    }
                    Delivery::Closed => {
                        // The node's memory passed to its newer client id: what this
                        // link did not deliver went to that id's link.
                        if let Some((new, t)) = link.successor() {
                            client = new.client();
                            ticket = t;
                            link = new;
                            continue;
                        }
                        // The node announced a new endpoint: what this link did not
                        // deliver moved to the new one, ahead of what it queues.
                        if let Some(new) = self.current_link(client).filter(|new| !Arc::ptr_eq(new, &link)) {
                            ticket = new.queued();
                            link = new;
                            continue;
                        }
                        all = false;
                        break;
                    }
                    Delivery::Gone => {
                        all = false;
                        self.forget_unreachable(client, "it is gone");
                        break;
                    }
                    Delivery::Pending if link.failing_for() > self.config.client_ttl => {
                        all = false;
                        self.forget_unreachable(client, "its records could not be delivered for a client TTL");
                        break;
                    }
                    Delivery::Pending => {
                        if !self.clients.read().contains_key(&client) {
                            all = false;
                            break;
                        }
                    }
                }
            }
        }
        all
    }

    /// Forgets a node whose records cannot be delivered (`why`), if it is still known.
    pub(crate) fn forget_unreachable(&self, client: ClientId, why: &str) {
        if self.clients.read().contains_key(&client) {
            self.counters.record_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let removed = self.forget_client(client);
            tracing::warn!(client = format!("{client:#x}"), removed, "storage node forgotten: {why}");
        }
    }

    /// Tells the owners of `key`'s complete replicas (or of `only` those) that they hold it.
    pub(crate) fn note_added(&self, key: &str, e: &ObjectEntry, only: Option<&[MemoryReplica]>) -> RecordWait {
        let chosen = e.replicas.iter().filter(|r| r.complete() && only.is_none_or(|o| o.contains(&r.memory(e.len()))));
        self.push_added(key, e, chosen)
    }

    /// Tells the owners of every replica of `key`, a put in progress that declared its
    /// checksum, that they hold it: before its bytes are written, so that the records
    /// travel while they are. A node offers such a record back only if the bytes match.
    pub(crate) fn note_declared(&self, key: &str, e: &ObjectEntry) -> RecordWait {
        self.push_added(key, e, &e.replicas)
    }

    /// Queues an `Added` record of `e` (its length and checksum) for the owner of each
    /// of `replicas`.
    fn push_added<'a>(
        &self,
        key: &str,
        e: &ObjectEntry,
        replicas: impl IntoIterator<Item = &'a StoredReplica>,
    ) -> RecordWait {
        let mut wait = RecordWait::default();
        if !self.config.track_records {
            return wait;
        }
        for r in replicas {
            let m = r.memory(e.len());
            let (len, checksum) = (e.len(), e.checksum);
            let added = |generation| RecordUpdate::Added {
                segment: m.segment,
                record: ObjectRecord { key: key.to_owned(), offset: m.offset, len, checksum, generation },
            };
            self.push_update(m.segment, added, &mut wait);
        }
        wait
    }

    /// A put in progress is dropped (revoked, timed out, reclaimed, its writer
    /// forgotten): if it declared its checksum, its nodes recorded it and are told it
    /// is gone, and the key's tombstone refuses its records from now on (a node
    /// forgotten meanwhile, which is not told, may offer one when it comes back).
    /// Returns what to wait for (nothing for a put that declared nothing).
    pub(crate) fn drop_declared_put(&self, key: &str, e: &ObjectEntry) -> RecordWait {
        if !e.declared() {
            return RecordWait::default();
        }
        let wait = self.push_removed(key, &e.replicas);
        self.tombstones.supersede(key, self.gens.next());
        wait
    }

    /// What the end of `e`'s declared put waits for: the tickets its start took
    /// (`started`), on the links they were queued on; for a node whose link changed
    /// since (it announced a new endpoint, and its queue moved there), everything its
    /// current link has queued.
    pub(crate) fn declared_records_wait(&self, e: &ObjectEntry, started: RecordWait) -> RecordWait {
        let mut wait = RecordWait::default();
        // The owners first, then their links: never `segments` held while `clients` is
        // taken (mounts take them the other way round).
        let owners: smallvec::SmallVec<[ClientId; 2]> = {
            let segments = self.segments.read();
            e.replicas.iter().filter_map(|r| segments.by_id.get(&r.segment()).map(|s| s.owner)).collect()
        };
        for owner in owners {
            let Some(link) = self.current_link(owner) else { continue };
            let ticket = match started.tickets.iter().find(|(_, l, _)| Arc::ptr_eq(l, &link)) {
                Some(&(_, _, ticket)) => ticket,
                None => link.queued(),
            };
            wait.add(owner, link, ticket);
        }
        wait
    }

    /// Whether records wait to be sent after an answer.
    pub(crate) fn has_records_to_send(&self) -> bool {
        self.send_after_answer.any()
    }

    /// Writes what puts that declared their checksum queued, one frame per node, where
    /// that can be done at once ([`NodeLink::send_ahead`]); the puts' ends read the
    /// answers. Never waits: what cannot go now goes with the next waiter, as always.
    pub(crate) fn send_records_after_answer(&self) {
        for link in self.send_after_answer.take() {
            link.send_ahead();
        }
    }

    /// Tells the owners of these replicas of `key` that they no longer hold it.
    pub(crate) fn note_removed<'a>(
        &self,
        key: &str,
        replicas: impl IntoIterator<Item = &'a StoredReplica>,
    ) -> RecordWait {
        self.push_removed(key, replicas.into_iter().filter(|r| r.complete()))
    }

    /// Queues a `Removed` record of `key` for the owner of each of `replicas`.
    fn push_removed<'a>(&self, key: &str, replicas: impl IntoIterator<Item = &'a StoredReplica>) -> RecordWait {
        let mut wait = RecordWait::default();
        if !self.config.track_records {
            return wait;
        }
        for r in replicas {
            let (segment, offset) = (r.segment(), r.offset());
            let removed = |generation| RecordUpdate::Removed { segment, key: key.to_owned(), offset, generation };
            self.push_update(segment, removed, &mut wait);
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
        // In offset order, by index: a re-mount may bring a million records, and the
        // request holds them already (no copy beside the decoded one).
        let mut order: Vec<usize> = (0..records.len()).collect();
        order.sort_by_key(|&i| records[i].offset);
        // Every record's range is reserved before the segment is mounted: from then on
        // it takes new puts, and one placed over a record not reserved yet would have
        // the record refused (an object acknowledged before, lost) and its bytes
        // overwritten.
        let alloc = self.new_segment(region, capacity)?;
        let reserved: Vec<Option<AllocatedBuffer>> = order
            .iter()
            .map(|&i| {
                let r = &records[i];
                if check_key(&r.key).is_err() || check_value_len(r.len).is_err() {
                    return None;
                }
                self.gens.observe(r.generation);
                let buf = alloc.allocate_at(r.offset, r.len);
                if buf.is_none() {
                    tracing::warn!(key = r.key, offset = r.offset, "record does not fit the segment; skipped");
                }
                buf
            })
            .collect();
        // Records back: puts of missing keys wait (`recovering_put`), from before the
        // segment takes puts. (In a cluster, the group's window opened when it was
        // taken over.)
        match group {
            _ if reserved.is_empty() => {}
            None => self.note_recovery(),
            Some(g) => self.note_group_objects_back(g),
        }
        let (id, new) = self.mount_allocator(client, region, alloc, group)?;
        if !new {
            // Asked again: its records were taken (or refused) the first time (what
            // was reserved above, on an allocator never mounted, goes).
            return Ok((id, 0));
        }
        let now = self.now_ms();
        // (The window was opened above when records came back.)
        let offer = self.offer_context(client);
        let mut taken = 0;
        let mut stale = 0u64;
        let mut replaced = 0u64;
        // The records not taken back: the node is told to drop them, or a later
        // master would take back what this one refused (a removed object, an old
        // version of a key put again). Their ranges stay reserved until their
        // removals are queued: a put placed there before would be recorded first,
        // and the node (which keys its records by offset) would drop its record with
        // the refused one's newer removal.
        let mut refused: Vec<(String, u64, Option<AllocatedBuffer>)> = Vec::new();
        for (r, buf) in order.iter().map(|&i| &records[i]).zip(reserved) {
            let Some(buf) = buf else {
                refused.push((r.key.clone(), r.offset, None));
                continue;
            };
            let mut shard = self.index.shard(&r.key).lock();
            let offered = self.classify_offered(&shard, &r.key, r.len, r.checksum, r.generation);
            let remember = match offered {
                Offered::Absent => {
                    let mut e = ObjectEntry::new_complete(r.len, r.checksum, now);
                    e.replicas.push(StoredReplica::new(buf, true));
                    let remember = Self::recovered_copy(&mut e, true, offer);
                    shard.insert(&r.key, e);
                    remember
                }
                Offered::Same | Offered::Newer => {
                    let Some(e) = shard.get_mut(&r.key) else {
                        refused.push((r.key.clone(), r.offset, Some(buf)));
                        continue;
                    };
                    if offered == Offered::Newer {
                        self.take_newer_copy(&r.key, e, (r.len, r.checksum), None, now);
                        replaced += 1;
                    }
                    e.replicas.push(StoredReplica::new(buf, true));
                    Self::recovered_copy(e, offered == Offered::Newer, offer)
                }
                // Removed or put again after this copy was made: not taken back.
                Offered::Stale => {
                    stale += 1;
                    drop(shard);
                    refused.push((r.key.clone(), r.offset, Some(buf)));
                    continue;
                }
                Offered::Conflict => {
                    tracing::warn!(
                        key = r.key,
                        len = r.len,
                        generation = r.generation,
                        "record conflicts with the master's view; skipped"
                    );
                    drop(shard);
                    refused.push((r.key.clone(), r.offset, Some(buf)));
                    continue;
                }
            };
            if remember {
                self.remember_recovered(&mut shard, &r.key, r.generation);
            }
            taken += 1;
        }
        if self.config.track_records && !refused.is_empty() {
            let mut wait = RecordWait::default();
            for (key, offset, _) in &mut refused {
                let (key, offset) = (std::mem::take(key), *offset);
                let removed = |generation| RecordUpdate::Removed { segment: id, key, offset, generation };
                self.push_update(id, removed, &mut wait);
            }
            // Queued: their ranges may take new objects now.
            drop(refused);
            // Before the mount is answered: a master that restarts after it must not
            // find them on the node.
            self.await_records(wait);
        }
        if stale > 0 {
            self.counters.stale_copies.fetch_add(stale, std::sync::atomic::Ordering::Relaxed);
            tracing::info!(segment = id, stale, "records older than their keys' last removal or put: not taken back");
        }
        if replaced > 0 {
            tracing::info!(segment = id, replaced, "records newer than the objects taken back before: those replaced");
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

    /// The first `limit` keys of complete objects after `after` (from the first
    /// when empty), sorted: one page of a listing. Keeps at most twice `limit`
    /// candidates at a time, so a page costs one walk of the index.
    pub fn list_keys_after(&self, after: &str, limit: usize) -> Result<Vec<String>> {
        let mut page: Vec<String> = Vec::new();
        if limit == 0 {
            return Ok(page);
        }
        // Once the page has been cut to `limit`, its largest key bounds the rest:
        // a key at or past it cannot be among the first `limit`.
        let mut bound: Option<String> = None;
        for shard in self.index.shards() {
            for (k, e) in shard.lock().iter() {
                let k: &str = k;
                if e.complete() && k > after && bound.as_deref().is_none_or(|b| k < b) {
                    page.push(k.to_string());
                    if page.len() >= limit.saturating_mul(2) {
                        page.select_nth_unstable(limit);
                        page.truncate(limit);
                        bound = page.iter().max().cloned();
                    }
                }
            }
        }
        if page.len() > limit {
            page.select_nth_unstable(limit);
            page.truncate(limit);
        }
        page.sort_unstable();
        Ok(page)
    }
}

#[cfg(test)]
pub(super) mod tests {
    use parking_lot::Mutex;

    use std::collections::HashMap;

    use super::*;
    use crate::config::{MasterConfig, ReplicateConfig};
    use crate::master::Master;

    /// A node's records, as the master tells them (the master's other tests use it
    /// too: `dropped_tests.rs`).
    #[derive(Default)]
    pub(in crate::master) struct Seen(pub(in crate::master) Mutex<Vec<RecordUpdate>>);

    impl RecordSink for Seen {
        fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
            self.0.lock().extend_from_slice(updates);
            Ok(())
        }
    }

    /// A node whose sends fail while it is `down` (paused).
    #[derive(Default)]
    struct Pausable {
        down: std::sync::atomic::AtomicBool,
        seen: Seen,
    }

    impl RecordSink for Pausable {
        fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::Timeout("paused".into()));
            }
            self.seen.apply_records(updates)
        }

        /// Like a node over the network: what is written ahead is applied (the answer
        /// is read later); nothing is written while it is down.
        fn send_records(&self, updates: &[RecordUpdate]) -> Option<Result<crate::master::RecordsInFlight>> {
            if self.down.load(std::sync::atomic::Ordering::Relaxed) {
                return None;
            }
            Some(self.seen.apply_records(updates).map(|()| crate::master::RecordsInFlight(Box::new(()))))
        }
    }

    /// Registers a client and mounts a 1 MiB segment for it: the client, the region
    /// and the segment's name.
    fn mount(master: &Master, name: &str) -> (ClientId, RemoteRegion, String) {
        let c = master.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: format!("local://{name}"), region: 1 };
        let seg = master.mount_segment(c, &region, 1 << 20).unwrap();
        (c, region, master.segment_info(seg).unwrap().name)
    }

    /// Puts on the segment named `seg` first.
    fn on(seg: &str) -> ReplicateConfig {
        ReplicateConfig { preferred_segments: vec![seg.to_owned()], ..Default::default() }
    }

    /// A master tracking records, with no read leases, and two nodes: `a` (which can
    /// be paused) holding `k` (100 bytes, checksum 1), and `b`.
    struct PausedHolder {
        master: Master,
        a: (ClientId, RemoteRegion, String),
        b: (ClientId, RemoteRegion, String),
        node_a: Arc<Pausable>,
    }

    fn paused_holder() -> PausedHolder {
        let config =
            MasterConfig { track_records: true, default_lease: std::time::Duration::ZERO, ..Default::default() };
        let master = Master::new(config).unwrap();
        let (a, b) = (mount(&master, "a"), mount(&master, "b"));
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a.0, node_a.clone()).unwrap();
        master.attach_records(b.0, Arc::new(Seen::default())).unwrap();
        master.put_start(a.0, "k", 100, &on(&a.2)).unwrap();
        master.put_end(a.0, "k", 1).unwrap();
        PausedHolder { master, a, b, node_a }
    }

    /// A node paused while its object was evicted never got the eviction's removal;
    /// the key is put again elsewhere and evicted too (which leaves no tombstone);
    /// the node is forgotten and comes back with its old record. The record predates
    /// the removal it missed: it is refused, not served as the key's value (before,
    /// the forgotten node's keys got only a lingering mark, which admits any copy).
    #[test]
    fn an_eviction_a_forgotten_node_missed_keeps_its_old_copy_out() {
        let PausedHolder { master, a: (a, region_a, _), b: (b, _, seg_b), node_a } = paused_holder();
        let v1 = match node_a.seen.0.lock().as_slice() {
            [RecordUpdate::Added { record, .. }] => record.clone(),
            other => panic!("{other:?}"),
        };
        node_a.down.store(true, std::sync::atomic::Ordering::Relaxed);
        master.evict_for(1 << 20);
        assert!(matches!(master.get_replica_list("k"), Err(Error::NotFound(_))));
        // Forgotten before the key is put again (a put waits for the removals of its
        // key that a registered node was not told of yet).
        master.unregister_client(a).unwrap();
        master.put_start(b, "k", 200, &on(&seg_b)).unwrap();
        master.put_end(b, "k", 2).unwrap();
        master.evict_for(1 << 20);
        assert!(matches!(master.get_replica_list("k"), Err(Error::NotFound(_))));
        let a2 = master.register_client().unwrap().client;
        let (_, taken) = master.remount_segment(a2, &region_a, 1 << 20, &[v1]).unwrap();
        assert_eq!(taken, 0, "the copy that missed its removal was taken back");
        // (Recovering rather than NotFound: a re-mount with records opens the window
        // in which a young master waits for other nodes.)
        assert!(master.get_replica_list("k").is_err());
    }

    /// A removal that an eviction queued for a paused node has not reached it when
    /// the key is put again elsewhere: that put is acknowledged only once the node
    /// has it too, so that a master restarted after the acknowledgment finds no node
    /// still listing the old copy beside the new one (both would be offered, and the
    /// first node back would decide the key's value).
    #[test]
    fn a_put_again_waits_for_the_eviction_notices_of_its_key() {
        let PausedHolder { master, b: (b, _, seg_b), node_a, .. } = paused_holder();
        node_a.down.store(true, std::sync::atomic::Ordering::Relaxed);
        master.evict_for(1 << 20);
        let removed_on_a =
            || node_a.seen.0.lock().iter().any(|u| matches!(u, RecordUpdate::Removed { key, .. } if key == "k"));
        std::thread::scope(|s| {
            let put = s.spawn(|| {
                master.put_start(b, "k", 200, &on(&seg_b))?;
                master.put_end(b, "k", 2)
            });
            std::thread::sleep(std::time::Duration::from_millis(300));
            assert!(!put.is_finished(), "the put was acknowledged before node a heard of the eviction");
            node_a.down.store(false, std::sync::atomic::Ordering::Relaxed);
            put.join().unwrap().unwrap();
        });
        assert!(removed_on_a(), "node a still lists k's old copy");
        // Nothing is left to wait for: the remove is answered at once.
        master.remove("k").unwrap();
    }

    /// The updates `node` was sent for `key`: (added with this checksum, or removed).
    fn told(node: &Pausable, key: &str) -> Vec<(bool, u32)> {
        let seen = node.seen.0.lock();
        seen.iter()
            .filter_map(|u| match u {
                RecordUpdate::Added { record, .. } if record.key == key => Some((true, record.checksum)),
                RecordUpdate::Removed { key: k, .. } if k == key => Some((false, 0)),
                _ => None,
            })
            .collect()
    }

    /// A put that declares its checksum has its records sent once its start is
    /// answered, with that checksum: its end adds nothing for the node, and waits
    /// only for what was queued. Before the send the node has nothing.
    #[test]
    fn a_declared_put_is_recorded_while_it_is_written() {
        let PausedHolder { master, a: (a, _, seg_a), .. } = paused_holder();
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        let svc = master.service();
        // As an RPC server does after every answer: from now on links are kept.
        assert!(!svc.has_records_to_send());
        master.put_start_summed(a, "d", 100, 7, &on(&seg_a)).unwrap();
        assert!(told(&node_a, "d").is_empty(), "sent before the start was answered");
        assert!(svc.has_records_to_send());
        svc.send_records_after_answer();
        assert!(!svc.has_records_to_send());
        assert_eq!(told(&node_a, "d"), [(true, 7)], "the record goes before the bytes are written");
        // Not readable yet: the record is not the object.
        assert!(master.get_replica_list("d").is_err());
        master.put_end(a, "d", 7).unwrap();
        assert_eq!(told(&node_a, "d"), [(true, 7)], "the end told the node again");
        assert_eq!(master.get_replica_list("d").unwrap().checksum, 7);
        // Removed as any object.
        master.remove("d").unwrap();
        assert_eq!(told(&node_a, "d"), [(true, 7), (false, 0)]);
    }

    /// A put started without its checksum and declared while it is written
    /// (`put_declare`, a device put summed beside its DMA): its records go once the
    /// declaration is answered, its end with the same checksum adds nothing for the
    /// node, and a second declaration changes nothing. Only the put's own writer may
    /// declare, and only while the put is in progress.
    #[test]
    fn a_put_declared_while_it_is_written_is_recorded_before_it_ends() {
        let PausedHolder { master, a: (a, _, seg_a), b: (b, _, _), .. } = paused_holder();
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        let svc = master.service();
        assert!(!svc.has_records_to_send());
        master.put_start(a, "d", 100, &on(&seg_a)).unwrap();
        assert!(!svc.has_records_to_send(), "an undeclared start queued records");
        assert!(matches!(master.put_declare(b, "d", 7), Err(Error::NotFound(_))), "another client declared");
        assert!(matches!(master.put_declare(a, "nope", 7), Err(Error::NotFound(_))));
        master.put_declare(a, "d", 7).unwrap();
        assert!(told(&node_a, "d").is_empty(), "sent before the declaration was answered");
        svc.send_records_after_answer();
        assert_eq!(told(&node_a, "d"), [(true, 7)], "the record goes before the bytes are written");
        assert!(master.get_replica_list("d").is_err(), "readable before its end");
        master.put_declare(a, "d", 9).unwrap();
        svc.send_records_after_answer();
        assert_eq!(told(&node_a, "d"), [(true, 7)], "declared twice");
        master.put_end(a, "d", 7).unwrap();
        assert_eq!(told(&node_a, "d"), [(true, 7)], "the end told the node again");
        assert_eq!(master.get_replica_list("d").unwrap().checksum, 7);
        assert_eq!(master.stats().declared_puts, 1);
        assert!(matches!(master.put_declare(a, "d", 7), Err(Error::NotFound(_))), "declared once complete");
        // In a batch, each item on its own.
        master.put_start(a, "e", 100, &on(&seg_a)).unwrap();
        let res = master.batch_put_declare(a, &[("e", 3), ("d", 3)]);
        assert!(res[0].is_ok() && matches!(res[1], Err(Error::NotFound(_))), "{res:?}");
        svc.send_records_after_answer();
        assert_eq!(told(&node_a, "e"), [(true, 3)]);
        master.put_end(a, "e", 3).unwrap();
        assert_eq!(told(&node_a, "e"), [(true, 3)]);
    }

    /// A put declared while written and then called off is removed from its node, as
    /// one declared at its start is.
    #[test]
    fn a_put_declared_while_written_then_revoked_is_removed_from_its_node() {
        let PausedHolder { master, a: (a, _, seg_a), .. } = paused_holder();
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        // As an RPC server does after every answer: from now on links are kept.
        assert!(!master.service().has_records_to_send());
        master.put_start(a, "d", 100, &on(&seg_a)).unwrap();
        master.put_declare(a, "d", 7).unwrap();
        master.service().send_records_after_answer();
        master.put_revoke(a, "d").unwrap();
        // Behind the declaration's frame: with the node's next heartbeat.
        master.service().send_records_after_answer();
        master.heartbeat(a).unwrap();
        assert_eq!(told(&node_a, "d"), [(true, 7), (false, 0)], "revoked, still recorded");
        assert!(master.get_replica_list("d").is_err());
    }

    /// A declared put whose only replica is on its writer's own segment, the writer
    /// forgotten before the put ended (every byte written): when the node comes back
    /// with the record, it is refused (its put never ended).
    #[test]
    fn a_declared_put_whose_holder_was_forgotten_is_refused_when_it_comes_back() {
        let master = Master::new(MasterConfig { track_records: true, ..Default::default() }).unwrap();
        let (a, region_a, seg_a) = mount(&master, "a");
        master.attach_records(a, Arc::new(Seen::default())).unwrap();
        let placed = master.put_start_summed(a, "k", 100, 7, &on(&seg_a)).unwrap();
        master.unregister_client(a).unwrap();
        let a2 = master.register_client().unwrap().client;
        let record = ObjectRecord { key: "k".into(), offset: placed[0].offset, len: 100, checksum: 7, generation: 1 };
        let (_, taken) = master.remount_segment(a2, &region_a, 1 << 20, &[record]).unwrap();
        assert_eq!(taken, 0, "a put that never ended came back");
    }

    /// A node that announces a new record endpoint while a put waits for its old one:
    /// the put's record moved to the new link, and the put is acknowledged only once
    /// the new endpoint has it (before, the old link's closing ended the wait).
    #[test]
    fn a_put_waiting_on_a_node_that_moves_its_endpoint_waits_for_the_new_one() {
        let master = Master::new(MasterConfig { track_records: true, ..Default::default() }).unwrap();
        let (a, _, seg_a) = mount(&master, "a");
        let old = Arc::new(Pausable::default());
        old.down.store(true, std::sync::atomic::Ordering::Relaxed);
        master.attach_records(a, old.clone()).unwrap();
        let new = Arc::new(Pausable::default());
        master.put_start(a, "k", 100, &on(&seg_a)).unwrap();
        std::thread::scope(|s| {
            let end = s.spawn(|| master.put_end(a, "k", 5));
            std::thread::sleep(std::time::Duration::from_millis(100));
            assert!(!end.is_finished());
            master.attach_records(a, new.clone()).unwrap();
            end.join().unwrap().unwrap();
            assert_eq!(told(&new, "k"), [(true, 5)], "acknowledged before the new endpoint had the record");
        });
        assert!(told(&old, "k").is_empty());
    }

    /// Two declared puts to one node, the second started while the first's frame is
    /// in flight: the first's end reads that frame's answer, and the second's records,
    /// queued behind it, are written once that end is answered, before the second
    /// ends.
    #[test]
    fn records_queued_behind_a_frame_in_flight_go_after_the_next_answer() {
        let PausedHolder { master, a: (a, _, seg_a), .. } = paused_holder();
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        let svc = master.service();
        assert!(!svc.has_records_to_send());
        master.put_start_summed(a, "p1", 100, 1, &on(&seg_a)).unwrap();
        svc.send_records_after_answer();
        master.put_start_summed(a, "p2", 100, 2, &on(&seg_a)).unwrap();
        svc.send_records_after_answer();
        assert!(told(&node_a, "p2").is_empty(), "one frame in flight at a time");
        master.put_end(a, "p1", 1).unwrap();
        assert!(svc.has_records_to_send());
        svc.send_records_after_answer();
        assert_eq!(told(&node_a, "p2"), [(true, 2)], "written before the second put ends");
        master.put_end(a, "p2", 2).unwrap();
        assert_eq!(told(&node_a, "p2"), [(true, 2)]);
    }

    /// Without the send after the answer (an in-process master), the end sends what
    /// the start queued: nothing is acknowledged before the node has the record.
    #[test]
    fn a_declared_put_ends_only_once_its_record_is_delivered() {
        let PausedHolder { master, a: (a, _, seg_a), .. } = paused_holder();
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        node_a.down.store(true, std::sync::atomic::Ordering::Relaxed);
        master.put_start_summed(a, "d", 100, 7, &on(&seg_a)).unwrap();
        master.service().send_records_after_answer();
        assert!(told(&node_a, "d").is_empty());
        std::thread::scope(|s| {
            let end = s.spawn(|| master.put_end(a, "d", 7));
            std::thread::sleep(std::time::Duration::from_millis(300));
            assert!(!end.is_finished(), "acknowledged before the node recorded it");
            node_a.down.store(false, std::sync::atomic::Ordering::Relaxed);
            end.join().unwrap().unwrap();
        });
        assert_eq!(told(&node_a, "d"), [(true, 7)]);
    }

    /// A writer that ends with another checksum than it declared (it summed other
    /// bytes) has the record sent again with the checksum it ended with (a newer
    /// generation: the node keeps that one).
    #[test]
    fn a_declared_put_ended_with_another_checksum_is_recorded_again() {
        let PausedHolder { master, a: (a, _, seg_a), .. } = paused_holder();
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        master.put_start_summed(a, "d", 100, 7, &on(&seg_a)).unwrap();
        master.put_end(a, "d", 8).unwrap();
        assert_eq!(told(&node_a, "d"), [(true, 7), (true, 8)]);
        assert_eq!(master.get_replica_list("d").unwrap().checksum, 8);
    }

    /// A declared put called off (revoked, timed out and reclaimed by the key's next
    /// put, or its writer forgotten) is removed from its nodes: its writer may have
    /// written every byte, and a restarted master must not take the key back. Nobody
    /// waits for the removal but the key's next put (a revoke usually follows a write
    /// to a node that failed); a revoke's is written ahead once it is answered.
    #[test]
    fn a_declared_put_called_off_is_removed_from_its_nodes() {
        let config = MasterConfig {
            track_records: true,
            put_timeout: std::time::Duration::from_millis(50),
            ..Default::default()
        };
        let master = Master::new(config).unwrap();
        let ((a, _, seg_a), (b, _, seg_b)) = (mount(&master, "a"), mount(&master, "b"));
        let node_a = Arc::new(Pausable::default());
        master.attach_records(a, node_a.clone()).unwrap();
        master.attach_records(b, Arc::new(Seen::default())).unwrap();
        let svc = master.service();
        // Served over RPC (see `a_declared_put_is_recorded_while_it_is_written`).
        assert!(!svc.has_records_to_send());
        master.put_start_summed(a, "r", 100, 7, &on(&seg_a)).unwrap();
        svc.send_records_after_answer();
        master.put_revoke(a, "r").unwrap();
        // The frame written for the start still waits for its answer to be read: the
        // removal goes with the node's next heartbeat (or the next waiter).
        svc.send_records_after_answer();
        master.heartbeat(a).unwrap();
        assert_eq!(told(&node_a, "r"), [(true, 7), (false, 0)], "revoked, still recorded");
        // A put undeclared leaves nothing to remove.
        master.put_start(a, "u", 100, &on(&seg_a)).unwrap();
        master.put_revoke(a, "u").unwrap();
        assert!(told(&node_a, "u").is_empty());
        // Timed out while the node is paused, then reclaimed by the key's next put.
        master.put_start_summed(a, "t", 100, 7, &on(&seg_a)).unwrap();
        svc.send_records_after_answer();
        node_a.down.store(true, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(60));
        std::thread::scope(|s| {
            // Elsewhere: only the old copy's removal holds it up.
            let again = s.spawn(|| {
                master.put_start(b, "t", 100, &on(&seg_b))?;
                master.put_end(b, "t", 9)
            });
            std::thread::sleep(std::time::Duration::from_millis(300));
            assert!(!again.is_finished(), "the new put was acknowledged before the node dropped the old one");
            node_a.down.store(false, std::sync::atomic::Ordering::Relaxed);
            again.join().unwrap().unwrap();
        });
        assert_eq!(told(&node_a, "t"), [(true, 7), (false, 0)]);
        assert_eq!(master.get_replica_list("t").unwrap().checksum, 9);
        // Its writer forgotten with the put pending: removed too.
        let writer = master.register_client().unwrap().client;
        master.put_start_summed(writer, "w", 100, 7, &on(&seg_a)).unwrap();
        master.unregister_client(writer).unwrap();
        master.put_start(b, "w", 100, &on(&seg_b)).unwrap();
        master.put_end(b, "w", 9).unwrap();
        assert_eq!(told(&node_a, "w"), [(true, 7), (false, 0)], "the forgotten writer's record stayed");
    }

    /// A node forgotten while it holds a declared put's record (it is not told when
    /// the put is called off) and that re-mounts on the same master: the record is
    /// refused (the dropped put left a tombstone), even with every byte written.
    #[test]
    fn a_called_off_declared_put_is_refused_from_a_node_that_missed_it() {
        let config = MasterConfig { track_records: true, ..Default::default() };
        let master = Master::new(config).unwrap();
        let ((a, region_a, seg_a), (b, _, seg_b)) = (mount(&master, "a"), mount(&master, "b"));
        master.attach_records(a, Arc::new(Seen::default())).unwrap();
        master.attach_records(b, Arc::new(Seen::default())).unwrap();
        let cfg = ReplicateConfig { replica_num: 2, ..on(&seg_a) };
        let placed = master.put_start_summed(b, "k", 100, 7, &cfg).unwrap();
        assert_eq!(placed.len(), 2, "{placed:?} {seg_b}");
        let on_a = placed.iter().find(|r| master.segment_info(r.segment).unwrap().name == seg_a).unwrap().offset;
        // Node a is forgotten; the put is called off.
        master.unregister_client(a).unwrap();
        master.put_revoke(b, "k").unwrap();
        let a2 = master.register_client().unwrap().client;
        let record = ObjectRecord { key: "k".into(), offset: on_a, len: 100, checksum: 7, generation: 1 };
        let (_, taken) = master.remount_segment(a2, &region_a, 1 << 20, &[record]).unwrap();
        assert_eq!(taken, 0, "a called-off put came back");
    }

    /// A node that, when first asked to record, is forgotten and sees another
    /// client put the same key with other bytes elsewhere (then fails the send).
    struct LostWhileWriting {
        master: std::sync::OnceLock<std::sync::Weak<MasterService>>,
        node: ClientId,
        other: (ClientId, String),
    }

    impl RecordSink for LostWhileWriting {
        fn apply_records(&self, _: &[RecordUpdate]) -> Result<()> {
            if let Some(m) = self.master.get().and_then(std::sync::Weak::upgrade) {
                m.unregister_client(self.node).unwrap();
                m.put_start(self.other.0, "k", 300, &on(&self.other.1)).unwrap();
                m.put_end(self.other.0, "k", 2).unwrap();
            }
            Err(Error::Timeout("paused".into()))
        }
    }

    /// A put whose only node is forgotten while it waits for the node's record fails,
    /// even if the key was put again meanwhile by another client with other bytes:
    /// that object is not this put's (before, the key merely existing was taken as
    /// the put having stood).
    #[test]
    fn a_put_whose_node_was_lost_fails_even_if_the_key_was_put_again() {
        let master = Master::new(MasterConfig { track_records: true, ..Default::default() }).unwrap();
        let ((x, _, seg_x), (y, _, seg_y)) = (mount(&master, "x"), mount(&master, "y"));
        master.attach_records(y, Arc::new(Seen::default())).unwrap();
        let sink = Arc::new(LostWhileWriting { master: Default::default(), node: x, other: (y, seg_y) });
        let _ = sink.master.set(Arc::downgrade(master.service()));
        master.attach_records(x, sink).unwrap();
        let writer = master.register_client().unwrap().client;
        master.put_start(writer, "k", 100, &on(&seg_x)).unwrap();
        let ended = master.put_end(writer, "k", 1);
        assert!(matches!(ended, Err(Error::MasterUnavailable(_))), "{ended:?}");
        // The other client's object stands.
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 2);
    }

    /// A mount asked again (a request sent again after a timeout whose first copy
    /// was served) gets the segment already mounted over that memory, and takes its
    /// records once: a second segment over the same bytes would place objects over
    /// the first's.
    #[test]
    fn a_mount_asked_again_gets_the_segment_already_mounted() {
        let master = Master::new(MasterConfig::default()).unwrap();
        let c = master.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: "local://n".into(), region: 1 };
        let first = master.mount_segment(c, &region, 1 << 20).unwrap();
        assert_eq!(master.mount_segment(c, &region, 1 << 20).unwrap(), first);
        assert_eq!(master.stats().segments, 1);
        assert!(matches!(master.mount_segment(c, &region, 2 << 20), Err(Error::InvalidArgument(_))));
        let other = RemoteRegion { region: 2, ..region.clone() };
        assert_ne!(master.mount_segment(c, &other, 1 << 20).unwrap(), first);
        // A re-mount with records, asked twice: one segment, the record taken once.
        let c2 = master.register_client().unwrap().client;
        let third = RemoteRegion { region: 3, ..region };
        let record = ObjectRecord { key: "k".into(), offset: 0, len: 100, checksum: 7, generation: 1 };
        let (id, taken) = master.remount_segment(c2, &third, 1 << 20, std::slice::from_ref(&record)).unwrap();
        assert_eq!(taken, 1);
        assert_eq!(master.remount_segment(c2, &third, 1 << 20, &[record]).unwrap(), (id, 0));
        assert_eq!(master.object_info("k").unwrap().replicas.len(), 1);
    }

    /// A region (endpoint and region id) mounted by another client is the same
    /// memory: a node whose re-join's answer was lost re-joins again under a new id
    /// while the master still holds the first. The newer id takes the older one's
    /// segment with what it holds (the mount answers that segment, its records
    /// already taken), and the older id is forgotten; before, a second segment over
    /// the same bytes placed objects over the first's, and before that fix the
    /// older id's objects went with it.
    #[test]
    fn a_region_mounted_by_another_client_passes_to_it_with_its_objects() {
        let master = Master::new(MasterConfig::default()).unwrap();
        let (first, region, seg) = mount(&master, "n");
        let placed = master.put_start(first, "k", 100, &on(&seg)).unwrap();
        let first_id = placed[0].segment;
        master.put_end(first, "k", 7).unwrap();
        // A writer found it unwritable meanwhile (the node was out of reach).
        master.report_segment_failure(first, first_id).unwrap();
        // Its records do not know of `k` (it was placed after they were taken).
        let again = master.register_client().unwrap().client;
        assert_eq!(master.remount_segment(again, &region, 1 << 20, &[]).unwrap(), (first_id, 0));
        assert_eq!(master.stats().segments, 1, "two segments over the same memory");
        assert!(matches!(master.heartbeat(first), Err(Error::UnknownClient(_))));
        let info = master.object_info("k").unwrap();
        assert_eq!((info.checksum, info.replicas.len()), (7, 1));
        assert_eq!((info.replicas[0].segment, info.replicas[0].offset), (first_id, placed[0].offset));
        // Placeable again after the newer id's heartbeat; room there is still the
        // segment's: a put does not land over `k`.
        master.heartbeat(again).unwrap();
        let other = master.put_start(again, "l", 100, &on(&seg)).unwrap();
        assert_eq!(other[0].segment, first_id);
        assert!(other[0].offset >= placed[0].offset + 100 || other[0].offset + 100 <= placed[0].offset);
        // A plain mount too; another region of the same endpoint is other memory.
        let third = master.register_client().unwrap().client;
        assert_eq!(master.mount_segment(third, &region, 1 << 20).unwrap(), first_id);
        assert!(matches!(master.heartbeat(again), Err(Error::UnknownClient(_))));
        assert!(master.exists("k").unwrap());
        let fourth = master.register_client().unwrap().client;
        master.mount_segment(fourth, &RemoteRegion { region: 2, ..region }, 1 << 20).unwrap();
        assert_eq!(master.stats().segments, 2);
        master.heartbeat(third).unwrap();
    }

    /// A put on a node's segment waits for its record while the node does not answer
    /// under its first re-join's id (that re-join's answer was lost); the node joins
    /// again under a new id: the record goes to the new id's link, the put is
    /// acknowledged once the node has it, and the node's next records list it.
    #[test]
    fn a_put_waiting_for_the_older_ids_record_is_answered_once_the_newer_id_has_it() {
        let config =
            MasterConfig { track_records: true, default_lease: std::time::Duration::ZERO, ..Default::default() };
        let master = Master::new(config).unwrap();
        let (first, region, seg) = mount(&master, "n");
        let old_link = Arc::new(Pausable::default());
        master.attach_records(first, old_link.clone()).unwrap();
        old_link.down.store(true, std::sync::atomic::Ordering::Relaxed);
        let writer = master.register_client().unwrap().client;
        let placed = master.put_start(writer, "p", 100, &on(&seg)).unwrap();
        let first_id = placed[0].segment;
        let ended = std::thread::spawn({
            let master = master.clone();
            move || master.put_end(writer, "p", 5)
        });
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!ended.is_finished(), "acknowledged before any node holds the record");
        // The node again, under a new id, with a link that answers.
        let again = master.register_client().unwrap().client;
        let new_link = Arc::new(Seen::default());
        master.attach_records(again, new_link.clone()).unwrap();
        assert_eq!(master.remount_segment(again, &region, 1 << 20, &[]).unwrap(), (first_id, 0));
        ended.join().unwrap().unwrap();
        let told = new_link.0.lock().iter().any(|u| {
            matches!(u, RecordUpdate::Added { segment, record }
                if *segment == first_id && record.key == "p" && record.offset == placed[0].offset)
        });
        assert!(told, "the record went to the new id's link");
        assert!(master.exists("p").unwrap());
    }

    /// A master past the window after its start in which a re-mount counts as its
    /// restart (two client TTLs of `config`), so that puts of absent keys are taken.
    fn settled(config: MasterConfig) -> Master {
        let ttl = std::time::Duration::from_millis(300);
        let master = Master::new(MasterConfig { client_ttl: ttl, ..config }).unwrap();
        std::thread::sleep(2 * ttl + std::time::Duration::from_millis(50));
        master
    }

    /// Re-mounts `records` on a 32 MiB segment `local://n#1` for `node` while another
    /// client puts 64-byte objects preferring that segment, as fast as it can (its
    /// clients heartbeat meanwhile). Returns the re-mount's answer and the puts
    /// acknowledged, with their offsets.
    fn remount_while_putting(
        master: &Master,
        node: ClientId,
        records: &[ObjectRecord],
    ) -> ((SegmentId, usize), Vec<(String, u64)>) {
        use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
        let writer = master.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: "local://n".into(), region: 1 };
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(Relaxed) {
                    let _ = master.heartbeat(node);
                    let _ = master.heartbeat(writer);
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            });
            let puts = s.spawn(|| {
                let mut acked = Vec::new();
                let cfg = on("local://n#1");
                for i in 0.. {
                    if done.load(Relaxed) {
                        break;
                    }
                    let key = format!("w{i}");
                    // (Refused until the segment is mounted.)
                    let Ok(placed) = master.put_start(writer, &key, 64, &cfg) else { continue };
                    master.put_end(writer, &key, 1).unwrap();
                    acked.push((key, placed[0].offset));
                }
                acked
            });
            let mounted = master.remount_segment(node, &region, 32 << 20, records).unwrap();
            // A few more puts once it is mounted.
            std::thread::sleep(std::time::Duration::from_millis(50));
            done.store(true, Relaxed);
            (mounted, puts.join().unwrap())
        })
    }

    /// A segment re-mounted with its records takes new puts only once every record's
    /// range is reserved: before, it was placeable from the start of the re-mount, a
    /// put could be placed over a record not reserved yet, and the record (an object
    /// acknowledged before) was refused as not fitting and lost.
    #[test]
    fn a_remount_reserves_its_records_before_taking_puts() {
        const N: u64 = 200_000;
        let master = settled(MasterConfig::default());
        let node = master.register_client().unwrap().client;
        let records: Vec<ObjectRecord> = (0..N)
            .map(|i| ObjectRecord { key: format!("r{i}"), offset: i * 64, len: 64, checksum: 7, generation: 1 })
            .collect();
        let ((_, taken), acked) = remount_while_putting(&master, node, &records);
        assert!(!acked.is_empty());
        assert_eq!(taken as u64, N, "records refused");
        for r in &records {
            let info = master.object_info(&r.key).unwrap();
            assert_eq!((info.replicas[0].offset, info.checksum), (r.offset, 7), "{}", r.key);
        }
    }

    /// The ranges of records a re-mount refuses are freed only once their removals
    /// are queued: before, a put placed in a range freed earlier was queued first,
    /// and the node, which keys its records by offset, dropped the put's record with
    /// the refused one's (newer) removal: acknowledged, yet gone after a restart.
    #[test]
    fn a_remount_frees_refused_ranges_only_after_their_removals() {
        const N: u64 = 40_000;
        let master = settled(MasterConfig { track_records: true, ..Default::default() });
        let node = master.register_client().unwrap().client;
        let records_of_node = Arc::new(crate::store::records::SegmentRecords::new(0));
        records_of_node.begin_mount();
        master.attach_records(node, records_of_node.clone()).unwrap();
        let records: Vec<ObjectRecord> = (0..N)
            .map(|i| ObjectRecord { key: format!("r{i}"), offset: i * 64, len: 64, checksum: 7, generation: 1 })
            .collect();
        // Every other record was removed since: refused.
        for r in records.iter().step_by(2) {
            master.tombstones.supersede(&r.key, master.gens.next());
        }
        let ((id, taken), acked) = remount_while_putting(&master, node, &records);
        records_of_node.set_segment(id);
        assert_eq!(taken as u64, N / 2);
        let held: HashMap<u64, String> = records_of_node.snapshot().into_iter().map(|r| (r.offset, r.key)).collect();
        assert!(!acked.is_empty());
        for (key, offset) in &acked {
            assert_eq!(held.get(offset), Some(key), "an acknowledged put's record is gone");
        }
        for r in records.iter().step_by(2) {
            assert_ne!(held.get(&r.offset), Some(&r.key), "a refused record stayed");
        }
    }

    /// While a restarted master waits for nodes to re-mount, a key it does not hold
    /// may still come back: a remove, an existence check or an info of it answer
    /// `Recovering` (retried), not `NotFound` or `false`, which the key's return
    /// would contradict; `remove_all` waits too. Keys it holds answer as usual.
    #[test]
    fn a_missing_key_is_recovering_while_nodes_re_mount() {
        let master = Master::new(MasterConfig::default()).unwrap();
        let c = master.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: "local://n".into(), region: 1 };
        let record = ObjectRecord { key: "back".into(), offset: 0, len: 100, checksum: 7, generation: 1 };
        master.remount_segment(c, &region, 1 << 20, &[record]).unwrap();
        assert!(master.exists("back").unwrap());
        assert!(matches!(master.exists("other"), Err(Error::Recovering(_))));
        assert!(matches!(master.remove("other"), Err(Error::Recovering(_))));
        assert!(matches!(master.object_info("other"), Err(Error::Recovering(_))));
        assert!(matches!(master.remove_all(), Err(Error::Recovering(_))));
        master.remove("back").unwrap();
    }

    /// While a restarted master waits for nodes to re-mount, a put of a key it does
    /// not hold (or an upsert, or a bind of room held ahead) answers `Recovering`:
    /// taken, it would have the key's copy on a node not back yet (an object
    /// acknowledged before the restart) refused when the node re-mounts, where
    /// without the restart the put would have found the key taken. Once the window
    /// is over, the key is taken if no node brought it back.
    #[test]
    fn a_put_of_a_key_not_back_yet_is_recovering() {
        let ttl = std::time::Duration::from_millis(500);
        let master = Master::new(MasterConfig { client_ttl: ttl, ..Default::default() }).unwrap();
        let (w, _, seg) = mount(&master, "w");
        let held = master.place_ahead(w, 100, &on(&seg)).unwrap();
        // A node back with an object: the master restarted, others may follow.
        let a = master.register_client().unwrap().client;
        let first = RemoteRegion { endpoint: "local://a".into(), region: 1 };
        let other = ObjectRecord { key: "other".into(), offset: 0, len: 100, checksum: 5, generation: 1 };
        master.remount_segment(a, &first, 1 << 20, &[other]).unwrap();
        for key in ["k", "gone"] {
            assert!(matches!(master.put_start(w, key, 100, &on(&seg)), Err(Error::Recovering(_))));
            assert!(matches!(master.put_start_summed(w, key, 100, 1, &on(&seg)), Err(Error::Recovering(_))));
            assert!(matches!(master.upsert_start(w, key, 100, &on(&seg)), Err(Error::Recovering(_))));
        }
        assert!(matches!(master.put_bind(w, held.id, "k", 1, false), Err(Error::Recovering(_))));
        // Keys it holds answer as usual.
        assert!(matches!(master.put_start(w, "other", 100, &on(&seg)), Err(Error::AlreadyExists(_))));
        master.upsert_start(w, "other", 100, &on(&seg)).unwrap();
        master.upsert_end(w, "other", 6).unwrap();
        // The holder of "k" comes back: its object stands.
        let b = master.register_client().unwrap().client;
        let second = RemoteRegion { endpoint: "local://b".into(), region: 1 };
        let k = ObjectRecord { key: "k".into(), offset: 0, len: 100, checksum: 7, generation: 1 };
        assert_eq!(master.remount_segment(b, &second, 1 << 20, &[k]).unwrap().1, 1);
        let until = std::time::Instant::now() + ttl + std::time::Duration::from_millis(100);
        while std::time::Instant::now() < until {
            for c in [w, a, b] {
                master.heartbeat(c).unwrap();
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(matches!(master.put_start(w, "k", 100, &on(&seg)), Err(Error::AlreadyExists(_))));
        assert_eq!(master.object_info("k").unwrap().checksum, 7);
        // A key no node brought back is put.
        master.put_start(w, "gone", 100, &on(&seg)).unwrap();
        master.put_end(w, "gone", 8).unwrap();
        assert_eq!(master.object_info("gone").unwrap().checksum, 8);
    }

    /// A put's or an upsert's end asked again of a restarted master before the node
    /// holding the ended object re-mounted (its first answer was lost with the old
    /// master) is `Recovering`, which the caller retries, not `NotFound`: once the
    /// node is back with the object, the same end is answered Ok. After the window a
    /// put that never ended is `NotFound`, as before.
    #[test]
    fn an_end_asked_again_while_nodes_re_mount_is_recovering_then_ok() {
        let ttl = std::time::Duration::from_secs(1);
        let master = Master::new(MasterConfig { client_ttl: ttl, ..Default::default() }).unwrap();
        let c = master.register_client().unwrap().client;
        // A node back with an object: the master restarted, and others may follow.
        let first = RemoteRegion { endpoint: "local://a".into(), region: 1 };
        let other = ObjectRecord { key: "other".into(), offset: 0, len: 100, checksum: 5, generation: 1 };
        master.remount_segment(c, &first, 1 << 20, &[other]).unwrap();
        // The node holding "ended" is not back yet.
        assert!(matches!(master.put_end(c, "ended", 7), Err(Error::Recovering(_))));
        assert!(matches!(master.upsert_end(c, "ended", 7), Err(Error::Recovering(_))));
        let d = master.register_client().unwrap().client;
        let second = RemoteRegion { endpoint: "local://b".into(), region: 1 };
        let record = ObjectRecord { key: "ended".into(), offset: 0, len: 100, checksum: 7, generation: 1 };
        master.remount_segment(d, &second, 1 << 20, &[record]).unwrap();
        master.put_end(c, "ended", 7).unwrap();
        master.upsert_end(c, "ended", 7).unwrap();
        // Other bytes under the key: refused, as before.
        assert!(matches!(master.put_end(c, "ended", 8), Err(Error::AlreadyExists(_))));
        // Once the window is over, an end of a put that never started is NotFound.
        std::thread::sleep(ttl + std::time::Duration::from_millis(100));
        assert!(matches!(master.put_end(c, "never", 7), Err(Error::NotFound(_))));
    }

    /// A put's or an upsert's end asked again once it ended (sent again after a
    /// broken connection, or to a new leader that took the object back from its
    /// records) is answered Ok when the object holds its bytes, and the records are
    /// told again; with other bytes it is refused as before.
    #[test]
    fn an_end_asked_again_after_it_ended_is_answered_ok() {
        let master = Master::new(MasterConfig { track_records: true, ..Default::default() }).unwrap();
        let (c, _, seg) = mount(&master, "n");
        let node = Arc::new(Seen::default());
        master.attach_records(c, node.clone()).unwrap();
        master.put_start(c, "k", 100, &on(&seg)).unwrap();
        master.put_end(c, "k", 7).unwrap();
        master.put_end(c, "k", 7).unwrap();
        assert!(matches!(master.put_end(c, "k", 8), Err(Error::AlreadyExists(_))));
        let added = || node.0.lock().iter().filter(|u| matches!(u, RecordUpdate::Added { .. })).count();
        assert_eq!(added(), 2, "the records were told again");
        master.upsert_start(c, "k", 200, &on(&seg)).unwrap();
        master.upsert_end(c, "k", 9).unwrap();
        master.upsert_end(c, "k", 9).unwrap();
        assert!(master.upsert_end(c, "k", 10).is_err());
        assert_eq!(master.object_info("k").unwrap().checksum, 9);
    }

    #[test]
    fn a_node_announcing_a_new_endpoint_gets_its_changes_there() {
        let master = Master::new(MasterConfig { track_records: true, ..Default::default() }).unwrap();
        let c = master.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: "local://n".into(), region: 1 };
        master.mount_segment(c, &region, 1 << 20).unwrap();
        let (first, second) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
        master.attach_records(c, first.clone()).unwrap();
        master.put_start(c, "a", 10, &ReplicateConfig::default()).unwrap();
        master.put_end(c, "a", 1).unwrap();
        master.attach_records(c, second.clone()).unwrap();
        master.put_start(c, "b", 10, &ReplicateConfig::default()).unwrap();
        master.put_end(c, "b", 2).unwrap();
        master.remove("a").unwrap();
        let keys = |s: &Seen| s.0.lock().iter().map(|u| u.key().to_owned()).collect::<Vec<_>>();
        assert_eq!(keys(&first), ["a"]);
        assert_eq!(keys(&second), ["b", "a"]);
        let gens: Vec<u64> =
            first.0.lock().iter().chain(second.0.lock().iter()).map(RecordUpdate::generation).collect();
        assert!(gens.windows(2).all(|w| w[0] < w[1]), "generations increase in the order changes were queued");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// A page is the first `limit` complete keys after `after`, sorted (a put
        /// not ended is not listed), and walking the pages lists every complete key
        /// once: against the sorted set of keys.
        #[test]
        fn pages_of_keys_are_the_sorted_keys_after_a_key(
            keys in proptest::collection::btree_set("[a-d]{1,4}", 0..60),
            open in proptest::collection::btree_set("[a-d]{1,4}", 0..8),
            after in "[a-d]{0,3}",
            limit in 0usize..12,
        ) {
            let master = Master::new(MasterConfig::default()).unwrap();
            let (c, _, _) = mount(&master, "a");
            for k in &keys {
                master.put_start(c, k, 8, &ReplicateConfig::default()).unwrap();
                master.put_end(c, k, 0).unwrap();
            }
            for k in open.difference(&keys) {
                master.put_start(c, k, 8, &ReplicateConfig::default()).unwrap();
            }
            let model: Vec<&String> = keys.iter().filter(|k| k.as_str() > after.as_str()).take(limit).collect();
            let page = master.list_keys_after(&after, limit).unwrap();
            proptest::prop_assert_eq!(page.iter().collect::<Vec<_>>(), model);
            let mut walked: Vec<String> = Vec::new();
            if limit > 0 {
                loop {
                    let page = master.list_keys_after(walked.last().map_or("", String::as_str), limit).unwrap();
                    if page.is_empty() {
                        break;
                    }
                    walked.extend(page);
                }
            }
            let want: Vec<String> = if limit > 0 { keys.iter().cloned().collect() } else { Vec::new() };
            proptest::prop_assert_eq!(&walked, &want);
            proptest::prop_assert_eq!(crate::MasterApi::all_keys(&**master.service()).unwrap(), keys.into_iter().collect::<Vec<_>>());
        }
    }
}
