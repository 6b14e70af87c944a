//! The master's clients and their segments: registration, heartbeats, mounting,
//! and what happens to objects when a segment or a client goes away.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mooncake_alloc::{SegmentAllocator, SegmentId, DEFAULT_ALIGNMENT};
use mooncake_transfer::RemoteRegion;

use crate::error::{Error, Result};
use crate::master::object::ObjectEntry;
use crate::master::segment::{ClientRecord, SegmentEntry};
use crate::master::service::MasterService;
use crate::master::types::*;

impl MasterService {
    /// Registers a new client and returns its id.
    pub fn register_client(&self) -> Result<ClientRegistration> {
        let now = self.now_ms();
        let mut clients = self.clients.write();
        loop {
            let id: ClientId = rand::random::<u64>() | 1;
            if let std::collections::hash_map::Entry::Vacant(e) = clients.entry(id) {
                e.insert(ClientRecord::new(now));
                return Ok(ClientRegistration {
                    client: id,
                    client_ttl_ms: self.config.client_ttl.as_millis() as u64,
                    incarnation: self.incarnation,
                });
            }
        }
    }

    /// Records a heartbeat. Fails with `MasterUnavailable` when the master no longer
    /// knows the client (it was expired): the client must register again.
    pub fn heartbeat(&self, client: ClientId) -> Result<Vec<RecordUpdate>> {
        let (updates, cleared, link) = match self.clients.read().get(&client) {
            Some(rec) => {
                rec.touch(self.now_ms());
                let cleared = rec.suspect.swap(false, Ordering::AcqRel).then(|| rec.segments.clone());
                let link = rec.link.lock().clone().filter(|l| l.has_queued());
                (std::mem::take(&mut *rec.updates.lock()), cleared, link)
            }
            None => return Err(Error::UnknownClient(client)),
        };
        // Updates no call waited for (eviction's) go out at the latest now.
        if let Some(link) = link {
            let _ = link.flush(self.config.record_timeout);
        }
        if let Some(segments) = cleared {
            let mut table = self.segments.write();
            for s in segments {
                table.set_suspect(s, false);
            }
        }
        Ok(updates)
    }

    /// Mounts `capacity` bytes served at `region` as a segment of `client`.
    pub fn mount_segment(&self, client: ClientId, region: &RemoteRegion, capacity: u64) -> Result<SegmentId> {
        if self.ownership.get().is_some() {
            return Err(Error::InvalidArgument(
                "this master is in a cluster: storage nodes mount one extent per slot group (mount_extent)".into(),
            ));
        }
        self.mount_group_segment(client, region, capacity, None).map(|(id, _)| id)
    }

    /// Mounts a segment, of `group` in cluster mode; returns its id and whether it is
    /// new. A client's region is mounted once per group: a mount asked again (a
    /// request sent again after a timeout whose first copy was served) gets the
    /// segment already mounted, never a second one over the same memory, whose
    /// placements would overlap the first's.
    pub(crate) fn mount_group_segment(
        &self,
        client: ClientId,
        region: &RemoteRegion,
        capacity: u64,
        group: Option<u32>,
    ) -> Result<(SegmentId, bool)> {
        let alloc = self.new_segment(region, capacity)?;
        self.mount_allocator(client, region, alloc, group)
    }

    /// The allocator of a new segment of `capacity` bytes served at `region`, under a
    /// new id; not mounted yet (see [`mount_allocator`](Self::mount_allocator)).
    pub(crate) fn new_segment(&self, region: &RemoteRegion, capacity: u64) -> Result<Arc<SegmentAllocator>> {
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}#{}", region.endpoint, region.region);
        SegmentAllocator::with_alignment(id, name, capacity, DEFAULT_ALIGNMENT)
            .map_err(|e| Error::InvalidArgument(format!("segment of {capacity} bytes: {e}")))
    }

    /// Mounts `alloc` (from [`new_segment`](Self::new_segment), whatever it already
    /// holds reserved) as the segment of `client` served at `region`, placeable from
    /// now on; as [`mount_group_segment`](Self::mount_group_segment). When the region
    /// is asked again, `alloc` is not mounted: what it holds is the caller's to drop.
    ///
    /// A region mounted by another client is the same memory (an endpoint is served
    /// by one process, and its region ids start at a random base, never reused): a
    /// node that re-joined under a new id after its first re-join's answer was lost.
    /// That older client's segment over the region passes to this one, with what it
    /// holds (objects placed there meanwhile were acknowledged) and the record updates
    /// its node was not told yet; this mount then answers that segment, as a mount
    /// asked again does. The older client is then forgotten, as if it had expired
    /// (two segments over the same bytes would place objects over each other).
    pub(crate) fn mount_allocator(
        &self,
        client: ClientId,
        region: &RemoteRegion,
        alloc: Arc<SegmentAllocator>,
        group: Option<u32>,
    ) -> Result<(SegmentId, bool)> {
        let id = alloc.id();
        let capacity = alloc.capacity();
        let mut clients = loop {
            let clients = self.clients.write();
            if !clients.contains_key(&client) {
                return Err(Error::UnknownClient(client));
            }
            let older =
                self.segments.read().by_id.values().find(|s| s.region == *region && s.owner != client).map(|s| s.owner);
            let Some(older) = older else { break clients };
            let mut clients = clients;
            let handed = self.hand_over_region(&mut clients, older, client, region, group);
            drop(clients);
            let removed = self.forget_client(older);
            tracing::warn!(
                client = format!("{older:#x}"),
                by = format!("{client:#x}"),
                region = format!("{}#{}", region.endpoint, region.region),
                handed,
                removed,
                "client forgotten: its node mounts the same memory under a new id, which takes its segment"
            );
        };
        let rec = clients.get_mut(&client).ok_or(Error::UnknownClient(client))?;
        {
            let table = self.segments.read();
            let same = rec
                .segments
                .iter()
                .filter_map(|s| table.by_id.get(s))
                .find(|s| s.region == *region && s.group == group);
            if let Some(s) = same {
                if s.alloc.capacity() != alloc.capacity() {
                    return Err(Error::InvalidArgument(format!(
                        "{}#{} is already mounted with {} bytes",
                        region.endpoint,
                        region.region,
                        s.alloc.capacity()
                    )));
                }
                return Ok((s.alloc.id(), false));
            }
        }
        rec.segments.push(id);
        self.segments.write().insert(SegmentEntry {
            alloc,
            owner: client,
            region: region.clone(),
            suspect: false,
            group,
            draining: false,
        });
        tracing::debug!(segment = id, client, capacity, "segment mounted");
        Ok((id, true))
    }

    /// Gives `to` the segments of `from` over `region` (for `group`), and moves the
    /// record updates `from`'s node was not told yet to `to`'s link or queue: the
    /// same node under its newer id (see [`mount_allocator`](Self::mount_allocator)).
    /// Returns how many segments passed.
    fn hand_over_region(
        &self,
        clients: &mut ahash::HashMap<ClientId, ClientRecord>,
        from: ClientId,
        to: ClientId,
        region: &RemoteRegion,
        group: Option<u32>,
    ) -> usize {
        let (moved, suspect) = {
            let mut table = self.segments.write();
            let (mut moved, mut suspect) = (Vec::new(), false);
            for s in table.by_id.values_mut() {
                if s.owner == from && s.region == *region && s.group == group {
                    s.owner = to;
                    suspect |= s.suspect;
                    moved.push(s.alloc.id());
                }
            }
            (moved, suspect)
        };
        if moved.is_empty() {
            return 0;
        }
        let (queued, old_link) = match clients.get_mut(&from) {
            Some(old) => {
                old.segments.retain(|s| !moved.contains(s));
                let queued = std::mem::take(&mut *old.updates.lock());
                (queued, old.link.lock().take())
            }
            None => (Vec::new(), None),
        };
        if let Some(new) = clients.get_mut(&to) {
            new.segments.extend_from_slice(&moved);
            // A segment marked suspect under the older id (the table is read under
            // the lock a report marks it under) is placeable again after the newer
            // id's next heartbeat, as it would have been after the older's.
            if suspect {
                new.suspect.store(true, Ordering::Release);
            }
            // Under the heartbeat queue's lock, as every update is queued.
            let mut updates = new.updates.lock();
            match new.link.lock().clone() {
                Some(link) => {
                    if let Some(old) = old_link {
                        old.close_into(&self.gens, &link);
                    }
                    for u in queued {
                        link.push(&self.gens, |_| u);
                    }
                }
                None => {
                    updates.extend(old_link.map(|old| old.close()).unwrap_or_default());
                    updates.extend(queued);
                }
            }
        }
        moved.len()
    }

    /// Unmounts a segment: its replicas are dropped, objects left without a replica
    /// are removed. Returns how many objects were removed.
    pub fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> Result<usize> {
        {
            let mut clients = self.clients.write();
            if let Some(rec) = clients.get_mut(&client) {
                rec.segments.retain(|&s| s != segment);
            }
        }
        let seg = {
            let mut table = self.segments.write();
            match table.by_id.get(&segment) {
                Some(s) if s.owner == client => {}
                Some(_) => {
                    return Err(Error::InvalidArgument(format!("segment {segment} is not owned by this client")))
                }
                None => return Err(Error::NotFound(format!("segment {segment}"))),
            }
            table.remove(segment)
        };
        drop(seg);
        Ok(self.drop_replicas_on(&[segment], false))
    }

    /// Unregisters a client and unmounts all its segments (a clean shutdown).
    pub fn unregister_client(&self, client: ClientId) -> Result<usize> {
        Ok(self.forget_client(client))
    }

    /// Forgets a client: its segments are unmounted, its replicas and disk replicas
    /// dropped. What it holds (records, files) is out of the master's sight from now
    /// on, so the keys concerned get lingering tombstones: the node may offer them
    /// again when it comes back, and they are taken back unless superseded meanwhile.
    pub(crate) fn forget_client(&self, client: ClientId) -> usize {
        let rec = self.clients.write().remove(&client);
        let Some(rec) = rec else { return 0 };
        // Changes the node was never told of: its records of these keys are stale.
        let undelivered = rec.link.lock().take().map(|link| link.close()).unwrap_or_default();
        for u in undelivered.iter().chain(rec.updates.lock().drain(..).as_slice()) {
            self.mark_untold(u);
        }
        {
            let mut table = self.segments.write();
            for s in &rec.segments {
                table.remove(*s);
            }
        }
        let removed = self.drop_replicas_on(&rec.segments, true) + self.drop_disk_replicas_of(client);
        // Puts the client started and never ended cannot end anymore.
        let removed_pending = self.retain_entries(
            |_, e| e.owner() != Some(client),
            |k, e| {
                self.unsent_removals.add(k, self.drop_declared_put(k, e));
                // A client forgotten by its TTL may only be paused, its writes to
                // resume (see `quarantine_put`).
                self.quarantine_put(e, self.config.put_timeout);
            },
        );
        self.drop_upserts_of(client);
        self.close_held_of(client);
        removed + removed_pending
    }

    /// Drops every replica on `segments`; removes objects left with none. Returns the
    /// number of objects removed. With `linger`, the keys of complete replicas dropped
    /// get lingering tombstones (their holder was forgotten, not told).
    pub(crate) fn drop_replicas_on(&self, segments: &[SegmentId], linger: bool) -> usize {
        if segments.is_empty() {
            return 0;
        }
        self.close_held_on(segments);
        let mut removed = 0;
        let now = self.now_ms();
        for shard in self.index.shards() {
            let mut shard = shard.lock();
            shard.retain(|k, e| {
                let before = e.replicas.len();
                let mut dropped_complete = false;
                e.replicas.retain(|r| {
                    let keep = !segments.contains(&r.segment());
                    dropped_complete |= !keep && r.complete();
                    keep
                });
                if linger && dropped_complete {
                    self.tombstones.linger(k);
                }
                // An object offloaded to an SSD lives on through its disk replica.
                let keep = !e.replicas.is_empty() || before == 0 || e.disk() != 0;
                if !keep {
                    self.hold_orphaned_upsert(e, now);
                    removed += 1;
                    if !e.complete() {
                        self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                    }
                    // A declared put whose every replica went: no node is left to
                    // tell, but those gone (not told) may offer its record back.
                    let _ = self.drop_declared_put(k, e);
                }
                keep
            });
        }
        removed
    }

    /// Removes every entry for which `keep` (given its key) is false; calls
    /// `on_removed` for each, which may take what it keeps of it (its replicas).
    pub(crate) fn retain_entries(
        &self,
        keep: impl Fn(&str, &ObjectEntry) -> bool,
        mut on_removed: impl FnMut(&str, &mut ObjectEntry),
    ) -> usize {
        let mut removed = 0;
        for shard in self.index.shards() {
            let mut shard = shard.lock();
            shard.retain(|k, e| {
                if keep(k, e) {
                    return true;
                }
                removed += 1;
                if !e.complete() {
                    self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                }
                on_removed(k, e);
                false
            });
        }
        removed
    }

    /// Where segment `id` is served, and who owns it.
    pub fn segment_info(&self, id: SegmentId) -> Result<SegmentInfo> {
        self.segments
            .read()
            .by_id
            .get(&id)
            .map(|s| SegmentInfo {
                id,
                name: s.alloc.name().to_owned(),
                owner: s.owner,
                region: s.region.clone(),
                capacity: s.alloc.capacity(),
                draining: s.draining,
            })
            .ok_or_else(|| Error::NotFound(format!("segment {id} is not mounted")))
    }

    pub(crate) fn candidates(&self) -> Arc<Vec<Arc<SegmentAllocator>>> {
        self.segments.read().candidates.clone()
    }

    /// Segments new replicas may go to (suspect ones excluded; in cluster mode, the
    /// extents of `group`).
    pub(crate) fn placeable(&self, group: Option<u32>) -> Arc<Vec<Arc<SegmentAllocator>>> {
        let table = self.segments.read();
        match group {
            None => table.placeable.clone(),
            Some(g) => table.placeable_by_group.get(&g).cloned().unwrap_or_default(),
        }
    }

    /// A client could not write to `segment`: no new replica goes there until its owner
    /// heartbeats again (a live owner does within a heartbeat period; a dead one is
    /// expired with its segments).
    pub fn report_segment_failure(&self, client: ClientId, segment: SegmentId) -> Result<()> {
        if !self.clients.read().contains_key(&client) {
            return Err(Error::UnknownClient(client));
        }
        let owner = {
            let mut table = self.segments.write();
            let owner = table.by_id.get(&segment).map(|s| s.owner);
            if table.set_suspect(segment, true) {
                self.counters.segment_failures.fetch_add(1, Ordering::Relaxed);
            }
            owner
        };
        let Some(owner) = owner else { return Err(Error::NotFound(format!("segment {segment} is not mounted"))) };
        if let Some(rec) = self.clients.read().get(&owner) {
            rec.suspect.store(true, Ordering::Release);
        }
        tracing::warn!(segment, reporter = format!("{client:#x}"), "segment reported unwritable; not placing there");
        Ok(())
    }
}
