//! What a client's SSD tier counts: [`SsdStats`] and the counters behind it.

use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_storage::{BackendStats, StagingStats};

/// A snapshot of a client's SSD tier.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SsdStats {
    /// The backend's sizes and counters.
    pub backend: BackendStats,
    /// The staging region's.
    pub staging: StagingStats,
    /// Objects written to disk at the master's request and reported.
    pub offloaded_objects: u64,
    /// Bytes of those objects.
    pub offloaded_bytes: u64,
    /// Offloads skipped or failed (memory changed under them, disk errors).
    pub offload_failures: u64,
    /// Reads of this client served from its own disk.
    pub local_loads: u64,
    /// Objects staged for other clients.
    pub served_loads: u64,
    /// Files deleted because the master dropped their objects.
    pub discarded: u64,
    /// Files of removed objects whose deletion failed and is retried on each offload
    /// heartbeat (the object stays stored on disk meanwhile).
    pub discards_pending: u64,
    /// Objects found on disk at start and registered with the master.
    pub recovered: u64,
}

/// The tier's own counters (the fields of [`SsdStats`] past the backend's and the
/// staging region's).
#[derive(Default)]
pub(super) struct SsdCounters {
    pub(super) offloaded_objects: AtomicU64,
    pub(super) offloaded_bytes: AtomicU64,
    pub(super) offload_failures: AtomicU64,
    pub(super) local_loads: AtomicU64,
    pub(super) served_loads: AtomicU64,
    pub(super) discarded: AtomicU64,
    pub(super) recovered: AtomicU64,
}

impl SsdCounters {
    /// The counters with the backend's and the staging region's snapshots.
    pub(super) fn snapshot(&self, backend: BackendStats, staging: StagingStats, discards_pending: u64) -> SsdStats {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        SsdStats {
            backend,
            staging,
            offloaded_objects: get(&self.offloaded_objects),
            offloaded_bytes: get(&self.offloaded_bytes),
            offload_failures: get(&self.offload_failures),
            local_loads: get(&self.local_loads),
            served_loads: get(&self.served_loads),
            discarded: get(&self.discarded),
            discards_pending,
            recovered: get(&self.recovered),
        }
    }
}

/// Adds `by` to a counter.
pub(super) fn inc(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}
