//! Counters of one client.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::master::MasterStats;

#[derive(Default)]
pub(super) struct StoreCounters {
    pub(super) puts: AtomicU64,
    pub(super) put_bytes: AtomicU64,
    pub(super) put_errors: AtomicU64,
    pub(super) gets: AtomicU64,
    pub(super) get_bytes: AtomicU64,
    pub(super) get_errors: AtomicU64,
    pub(super) checksum_mismatches: AtomicU64,
    pub(super) removes: AtomicU64,
    pub(super) under_replicated_puts: AtomicU64,
    pub(super) declared_puts: AtomicU64,
    pub(super) device_direct_bytes: AtomicU64,
    pub(super) device_staged_bytes: AtomicU64,
    pub(super) record_mount_failures: AtomicU64,
}

impl StoreCounters {
    pub(super) fn inc(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// A snapshot of a client's counters plus the master's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreStats {
    /// This client's id at the master.
    pub client_id: u64,
    /// Bytes this client gives the pool.
    pub segment_capacity: u64,
    /// Bytes allocated in this client's segment.
    pub segment_used: u64,
    /// Successful puts.
    pub puts: u64,
    /// Bytes of successful puts (once per object, not per replica).
    pub put_bytes: u64,
    /// Failed puts.
    pub put_errors: u64,
    /// Successful gets.
    pub gets: u64,
    /// Bytes returned by successful gets.
    pub get_bytes: u64,
    /// Failed gets (including not found).
    pub get_errors: u64,
    /// Replica reads whose bytes failed the checksum (and were retried elsewhere).
    pub checksum_mismatches: u64,
    /// Successful removes.
    pub removes: u64,
    /// Puts stored with fewer replicas than asked (see
    /// [`ReplicateConfig::require_all_replicas`](crate::ReplicateConfig)).
    pub under_replicated_puts: u64,
    /// Successful puts whose checksum this client declared before their end: with
    /// their placement (summed before it) or, for device memory moved into mapped
    /// segments, beside their DMA, so that a master daemon or cluster records them
    /// on their nodes while their bytes are written (what the master made of it:
    /// [`MasterStats::declared_puts`](crate::MasterStats::declared_puts); a master
    /// without durable records ignores the declaration). Never with a master in this
    /// process, whose records cost nothing to wait for.
    pub declared_puts: u64,
    /// Bytes of objects moved straight between device memory and the pool by
    /// `get_into_device` / `put_from_device` (and their batch forms), with no host
    /// copy: one-sided RDMA to and from GPU memory registered with the NICs, or one
    /// DMA from or into a replica in a segment this process maps (its own, a
    /// same-host peer's), page-locked. Counted once per object.
    pub device_direct_bytes: u64,
    /// Bytes of objects those calls staged through pinned host memory instead (a
    /// replica over TCP, on a disk, or in memory that could not be page-locked or
    /// registered). Counted once per object.
    pub device_staged_bytes: u64,
    /// Bytes of mapped segments (this client's own, same-host peers') page-locked
    /// now for device copies: the pieces replicas moved by DMA lie in (see
    /// [`StoreBuilder::page_lock_piece`](crate::StoreBuilder::page_lock_piece)).
    /// Taken back when a mapping is dropped with its store or replaced.
    pub device_page_locked_bytes: u64,
    /// Connections to this storage node's record endpoint that were refused: they
    /// could not prove the record key only the masters it mounted on know (a forged
    /// record change, say). See [`Store::record_endpoint`](crate::Store::record_endpoint).
    pub record_refusals: u64,
    /// Times the master could not reach this node's record endpoint when the node
    /// joined or re-joined (`mount_records` failed): the node's record changes then
    /// come with its heartbeats only, so an acknowledged put may be unknown to a
    /// master restarted before the next heartbeat.
    pub record_mount_failures: u64,
    /// The SSD tier's counters, if this client has one.
    pub ssd: Option<super::SsdStats>,
    /// Objects this client pulled from other clients' SSDs.
    pub disk_loads: u64,
    /// Gets served through a replica list kept from a recent get (one round trip,
    /// to the replica, instead of two).
    pub replica_cache_hits: u64,
    /// The master's view.
    pub master: MasterStats,
}

/// Every field, on a few lines:
///
/// ```text
/// client 0x…: segment 1048576/4194304 bytes used
///   puts 10 (…), gets 12 (…), removes 0, checksum retries 0, declared 0, replica cache hits 3, disk loads 0,
///     device bytes 0 direct / 0 staged (0 B page-locked)
///   ssd (bucket, io …): 8 objects, 65536/… B used, 8 offloaded (65536 B, 0 failed), …
///   master (random): 10 objects (…), … evicted (… B), lease refusals 0, put timeouts 0, …
/// ```
impl std::fmt::Display for StoreStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = &self.master;
        writeln!(
            f,
            "client {:#x}: segment {}/{} bytes used",
            self.client_id, self.segment_used, self.segment_capacity
        )?;
        writeln!(
            f,
            "  puts {} ({} B, {} failed), gets {} ({} B, {} failed), removes {}, checksum retries {}, \
             declared {}, replica cache hits {}, disk loads {}, device bytes {} direct / {} staged ({} B page-locked), record refusals {}, \
             record mounts failed {}",
            self.puts,
            self.put_bytes,
            self.put_errors,
            self.gets,
            self.get_bytes,
            self.get_errors,
            self.removes,
            self.checksum_mismatches,
            self.declared_puts,
            self.replica_cache_hits,
            self.disk_loads,
            self.device_direct_bytes,
            self.device_staged_bytes,
            self.device_page_locked_bytes,
            self.record_refusals,
            self.record_mount_failures
        )?;
        if let Some(s) = &self.ssd {
            let b = &s.backend;
            writeln!(
                f,
                "  ssd ({}, io {}): {} objects in {} units, {}/{} B used, {} evicted ({} units), \
                 {} pending notifications; {} offloaded ({} B, {} failed), {} local loads, {} served loads, \
                 {} discarded ({} pending), {} recovered; staging {:?}",
                b.backend,
                b.io,
                b.objects,
                b.units,
                b.used_bytes,
                b.capacity.map_or_else(|| "unbounded".to_owned(), |c| c.to_string()),
                b.evicted_objects,
                b.evicted_units,
                b.pending_notifications,
                s.offloaded_objects,
                s.offloaded_bytes,
                s.offload_failures,
                s.local_loads,
                s.served_loads,
                s.discarded,
                s.discards_pending,
                s.recovered,
                s.staging
            )?;
        }
        write!(
            f,
            "  master ({}): {} objects ({} B, {} pending puts), {} replicas, {} clients, {} segments, {}/{} B used \
             (max fragmentation {:.2}), {} evicted ({} B), lease refusals {}, put timeouts {}, \
             {} clients expired, {} stall graces, metadata {} B (keys {} B)",
            m.allocation_strategy,
            m.objects,
            m.object_bytes,
            m.pending_puts,
            m.replicas,
            m.clients,
            m.segments,
            m.used_bytes,
            m.capacity_bytes,
            m.max_fragmentation,
            m.evicted_objects,
            m.evicted_bytes,
            m.lease_refusals,
            m.put_timeouts,
            m.expired_clients,
            m.stall_graces,
            m.metadata_bytes,
            m.key_bytes
        )
    }
}
