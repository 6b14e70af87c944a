//! The master's counters and gauges.

use std::sync::atomic::Ordering;

use crate::error::Result;
use crate::master::object;
use crate::master::service::MasterService;
use crate::master::types::*;

impl MasterService {
    /// Counters and gauges of the master.
    pub fn stats(&self) -> Result<MasterStats> {
        Ok(self.collect_stats())
    }

    /// [`stats`](Self::stats), which cannot fail in process.
    ///
    /// Does not walk the index: each shard keeps the totals of its entries up to date
    /// as they change (see `object::Totals`), and this adds up the 1024 shards' (one
    /// short lock each), so its cost does not grow with the number of objects.
    pub fn collect_stats(&self) -> MasterStats {
        let mut totals = object::Totals::default();
        let mut table_bytes = 0u64;
        for shard in self.index.shards() {
            let mut shard = shard.lock();
            totals.add(shard.totals());
            table_bytes += object::table_bytes(&shard);
        }
        self.stats_from(totals, table_bytes)
    }

    /// The stats, counted by walking every entry of the index (what
    /// [`collect_stats`](Self::collect_stats) did before the shards kept totals; its
    /// cost grows with the objects). For tests and benchmarks, to check the kept
    /// totals against the walk: both give the same numbers.
    #[doc(hidden)]
    pub fn recount_stats(&self) -> MasterStats {
        let mut totals = object::Totals::default();
        let mut table_bytes = 0u64;
        for shard in self.index.shards() {
            let shard = shard.lock();
            table_bytes += object::table_bytes(&shard);
            for (k, e) in shard.iter() {
                totals.entries += 1;
                totals.key_bytes += k.len() as u64;
                totals.heap_bytes += object::entry_heap_bytes(k, e);
                totals.replicas += e.replicas.len() as u64;
                if e.complete() {
                    totals.objects += 1;
                    totals.object_bytes += e.len();
                }
            }
        }
        self.stats_from(totals, table_bytes)
    }

    /// The stats, given the index's totals and the bytes of its tables.
    fn stats_from(&self, totals: object::Totals, table_bytes: u64) -> MasterStats {
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
            metadata_bytes: table_bytes + totals.heap_bytes,
            key_bytes: totals.key_bytes,
            objects: totals.objects,
            pending_puts: c.pending_puts.load(Ordering::Relaxed),
            object_bytes: totals.object_bytes,
            replicas: totals.replicas,
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
            carried_tombstones: c.carried_tombstones.load(Ordering::Relaxed),
            declared_puts: c.declared_puts.load(Ordering::Relaxed),
            stall_graces: c.stall_graces.load(Ordering::Relaxed),
            held_placements: self.held.count(),
            bound_puts: c.bound_puts.load(Ordering::Relaxed),
            allocation_strategy: self.config.allocation_strategy.name().to_owned(),
            segment_usage,
            groups_acquired: self.cluster_counters.groups_acquired.load(Ordering::Relaxed),
            groups_released: self.cluster_counters.groups_released.load(Ordering::Relaxed),
            moved_answers: self.cluster_counters.moved_answers.load(Ordering::Relaxed),
        }
    }
}
