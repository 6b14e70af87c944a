//! `LocalDisk` replicas: objects offloaded to a client's SSD, and the SSD usage the
//! master tracks per client to feed `SsdFreeRatioFirst` (reference 002).
//!
//! `ssd_used` grows by an object's size only once the master has recorded its
//! `LocalDisk` replica (a notification for a vanished object changes nothing), and
//! shrinks whenever such a replica leaves the metadata: remove, disk eviction, or
//! the loss of the client.

use std::sync::atomic::Ordering;

use mooncake_alloc::{SegmentId, SsdMetricsProvider};

use crate::config::check_key;
use crate::error::{Error, Result};

use super::object::ObjectEntry;
use super::{ClientId, MasterService};

/// The master's view of each segment owner's SSD.
pub(super) struct MasterSsdMetrics<'a>(pub(super) &'a MasterService);

impl MasterSsdMetrics<'_> {
    fn of(&self, segment: SegmentId, f: impl Fn(&super::segment::ClientRecord) -> i64) -> i64 {
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

    /// SSD capacity and recorded usage of a client.
    pub fn ssd_usage(&self, client: ClientId) -> Option<(i64, i64)> {
        self.clients
            .read()
            .get(&client)
            .map(|c| (c.ssd_total.load(Ordering::Relaxed), c.ssd_used.load(Ordering::Relaxed)))
    }

    fn add_ssd_used(&self, client: ClientId, delta: i64) {
        if let Some(c) = self.clients.read().get(&client) {
            c.ssd_used.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Gives back the SSD usage of `e`'s disk replica (the entry is leaving).
    pub(super) fn release_disk(&self, e: &ObjectEntry) {
        if e.disk != 0 {
            self.add_ssd_used(e.disk, -(e.len as i64));
        }
    }

    /// A client wrote these objects (key, length, checksum) to its SSD: each gets a
    /// `LocalDisk` replica on that client. An object that vanished, or whose length
    /// or checksum differ (it was replaced meanwhile), is refused with `NotFound`
    /// and changes no counter.
    pub fn notify_offload_success(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>> {
        if !self.clients.read().contains_key(&client) {
            return items.iter().map(|_| Err(Error::UnknownClient(client))).collect();
        }
        items
            .iter()
            .map(|&(key, len, checksum)| {
                check_key(key)?;
                let mut shard = self.index.shard(key).lock();
                match shard.get_mut(key) {
                    Some(e) if e.complete && e.len == len && e.checksum == checksum => {
                        if e.disk != client {
                            if e.disk != 0 {
                                self.add_ssd_used(e.disk, -(len as i64));
                            }
                            e.disk = client;
                            self.add_ssd_used(client, len as i64);
                        }
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
                let mut shard = self.index.shard(key).lock();
                match shard.get_mut(key) {
                    Some(e) if e.disk == client => {
                        self.release_disk(e);
                        e.disk = 0;
                        if e.replicas.is_empty() {
                            shard.remove(key);
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
    pub(super) fn drop_disk_replicas_of(&self, client: ClientId) -> usize {
        let mut removed = 0;
        for shard in self.index.shards() {
            shard.lock().retain(|_, e| {
                if e.disk != client {
                    return true;
                }
                e.disk = 0;
                let keep = !e.replicas.is_empty();
                removed += usize::from(!keep);
                keep
            });
        }
        removed
    }
}
