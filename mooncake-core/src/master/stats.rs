//! The master's counters and gauges.

use std::sync::atomic::Ordering;

use crate::error::Result;
use crate::master::object;
use crate::master::service::MasterService;
use crate::master::types::*;

impl MasterService {
    /// Counters and gauges of the master (walks the index: not for hot paths).
    pub fn stats(&self) -> Result<MasterStats> {
        Ok(self.collect_stats())
    }

    /// [`stats`](Self::stats), which cannot fail in process.
    pub fn collect_stats(&self) -> MasterStats {
        let (mut objects, mut object_bytes, mut replicas) = (0u64, 0u64, 0u64);
        let (mut metadata_bytes, mut key_bytes) = (0u64, 0u64);
        for shard in self.index.shards() {
            let shard = shard.lock();
            metadata_bytes += object::table_bytes(&shard);
            for (k, e) in shard.iter() {
                key_bytes += k.len() as u64;
                metadata_bytes += object::entry_heap_bytes(k, e);
                replicas += e.replicas.len() as u64;
                if e.complete() {
                    objects += 1;
                    object_bytes += e.len();
                }
            }
        }
        // Clients before segments: the order mounts take them in (clients, then
        // segments); the other order deadlocks against a mount.
        let clients = self.clients.read().len() as u64;
        let table = self.segments.read();
        // One allocator report per segment (each takes the segment's lock).
        let segment_usage: Vec<SegmentUsage> = table
            .candidates
            .iter()
            .map(|s| SegmentUsage {
                segment: s.id(),
                name: s.name().to_owned(),
                capacity: s.capacity(),
                used: s.used_bytes(),
                fragmentation: s.report().fragmentation,
            })
            .collect();
        let c = &self.counters;
        MasterStats {
            metadata_bytes,
            key_bytes,
            objects,
            pending_puts: c.pending_puts.load(Ordering::Relaxed),
            object_bytes,
            replicas,
            clients,
            segments: table.by_id.len() as u64,
            capacity_bytes: table.capacity(),
            used_bytes: table.used(),
            max_fragmentation: segment_usage.iter().map(|u| u.fragmentation).fold(0.0, f64::max),
            evicted_objects: c.evicted_objects.load(Ordering::Relaxed),
            evicted_bytes: c.evicted_bytes.load(Ordering::Relaxed),
            lease_refusals: c.lease_refusals.load(Ordering::Relaxed),
            put_timeouts: c.put_timeouts.load(Ordering::Relaxed),
            expired_clients: c.expired_clients.load(Ordering::Relaxed),
            under_replicated_puts: c.under_replicated_puts.load(Ordering::Relaxed),
            segment_failures: c.segment_failures.load(Ordering::Relaxed),
            record_failures: c.record_failures.load(Ordering::Relaxed),
            stale_copies: c.stale_copies.load(Ordering::Relaxed),
            stall_graces: c.stall_graces.load(Ordering::Relaxed),
            allocation_strategy: self.config.allocation_strategy.name().to_owned(),
            segment_usage,
            groups_acquired: self.cluster_counters.groups_acquired.load(Ordering::Relaxed),
            groups_released: self.cluster_counters.groups_released.load(Ordering::Relaxed),
            moved_answers: self.cluster_counters.moved_answers.load(Ordering::Relaxed),
        }
    }
}
