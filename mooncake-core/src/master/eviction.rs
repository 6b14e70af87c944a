//! Memory eviction: approximately-LRU removal of unleased objects above the high
//! watermark.
//!
//! Exact LRU over tens of millions of objects would need a global ordered structure
//! touched by every get. Instead each object carries its last access time; a pass
//! samples a slice of the shards to find the access-time cutoff that frees enough
//! bytes, then removes objects older than the cutoff, those also on an SSD first
//! (they keep living there). Objects being read (leased) are never evicted;
//! soft-pinned ones only when nothing else frees enough.

use std::sync::atomic::Ordering;

use mooncake_alloc::SegmentId;

use crate::master::object::{ObjectEntry, SHARDS};
use crate::master::service::MasterService;
use crate::master::types::EvictionReport;

/// Candidates sampled to estimate the access-time cutoff (whole shards are sampled
/// until this many are seen, or every shard was).
const SAMPLE_TARGET: usize = 4096;

/// Whether `used` bytes of `capacity` are above the `high` watermark: the monitor
/// evicts there.
pub(crate) fn above_watermark(used: u64, capacity: u64, high: f64) -> bool {
    used as f64 > capacity as f64 * high
}

impl MasterService {
    pub(crate) fn low_watermark(&self) -> f64 {
        self.config.high_watermark - self.config.eviction_ratio
    }

    /// Evicts until at least `bytes` are freed and the pool is below the low watermark.
    pub fn evict_for(&self, bytes: u64) -> EvictionReport {
        let _pass = self.eviction.lock();
        let (cap, used) = {
            let t = self.segments.read();
            (t.capacity(), t.used())
        };
        let excess = used.saturating_sub((cap as f64 * self.low_watermark()) as u64);
        self.evict(bytes.max(excess), None)
    }

    /// Evicts at least `bytes` from each of `segments` (cluster mode: the extents of
    /// one slot group, where a put of that group needs room).
    pub(crate) fn evict_in(
        &self,
        bytes: u64,
        segments: &[std::sync::Arc<mooncake_alloc::SegmentAllocator>],
    ) -> EvictionReport {
        let _pass = self.eviction.lock();
        let mut report = EvictionReport::default();
        for seg in segments {
            let excess = seg.used_bytes().saturating_sub((seg.capacity() as f64 * self.low_watermark()) as u64);
            report.add(self.evict(bytes.max(excess), Some(seg.id())));
        }
        report
    }

    /// Evicts where the pool or a segment is above the high watermark. Run by the
    /// monitor thread; callable directly.
    pub fn evict_if_needed(&self) -> EvictionReport {
        let _pass = self.eviction.lock();
        let mut report = EvictionReport::default();
        let candidates = self.candidates();
        // Capacities are what clients declared (up to 2^64 - 1 each): the sums saturate.
        let (cap, used): (u64, u64) = candidates
            .iter()
            .fold((0, 0), |(c, u), s| (c.saturating_add(s.capacity()), u.saturating_add(s.used_bytes())));
        let high = self.config.high_watermark;
        if cap > 0 && above_watermark(used, cap, high) {
            report.add(self.evict(used.saturating_sub((cap as f64 * self.low_watermark()) as u64), None));
        }
        for seg in candidates.iter() {
            let (c, u) = (seg.capacity(), seg.used_bytes());
            if above_watermark(u, c, high) {
                report.add(self.evict(u.saturating_sub((c as f64 * self.low_watermark()) as u64), Some(seg.id())));
            }
        }
        report
    }

    pub(crate) fn evictable(e: &ObjectEntry, now: u64, segment: Option<SegmentId>) -> bool {
        e.complete() && !e.leased(now) && e.memory_bytes(segment) > 0
    }

    /// Frees at least `target` bytes (on `segment`, or anywhere) if it can.
    pub(crate) fn evict(&self, target: u64, segment: Option<SegmentId>) -> EvictionReport {
        let mut report = EvictionReport::default();
        if target == 0 {
            return report;
        }
        let now = self.now_ms();
        let start = rand::random::<u32>() as usize % SHARDS;

        // 1. Estimate the access-time cutoff from a sample of the shards.
        let mut sample: Vec<(u64, u64)> = Vec::new();
        let mut sampled_shards = 0;
        while sampled_shards < SHARDS && sample.len() < SAMPLE_TARGET {
            let i = sampled_shards;
            sampled_shards += 1;
            let shard = self.index.shard_at((start + i) % SHARDS).lock();
            sample.extend(
                shard
                    .values()
                    .filter(|e| !e.pinned(now) && Self::evictable(e, now, segment))
                    .map(|e| (e.last_access_ms, e.memory_bytes(segment))),
            );
        }
        sample.sort_unstable();
        let scale = SHARDS as f64 / sampled_shards as f64;
        let mut acc = 0u64;
        let mut cutoff = u64::MAX;
        for (t, b) in &sample {
            acc += (*b as f64 * scale) as u64;
            if acc >= target {
                cutoff = *t;
                break;
            }
        }

        // 2. Remove by cutoff, then anything unpinned, then pinned objects too. An
        //    object not yet on the SSD of an owner that has one is offloaded first
        //    (`PersistPolicy::Lazy`): it is queued, kept, and freed by a later pass.
        let offload_owners = self.offload_owners();
        let offload_until = now + self.config.put_timeout.as_millis() as u64;
        let mut to_offload: Vec<(u64, (Box<str>, u32))> = Vec::new();
        // Memory that offloads under way will free: it counts toward the target, so
        // that a pass asks for no more offloads than the room it needs.
        let mut awaiting_bytes = 0u64;
        if !offload_owners.is_empty() {
            for shard in self.index.shards() {
                for e in shard.lock().values() {
                    if e.disk() == 0 && e.offload_pending(now) && Self::evictable(e, now, segment) {
                        awaiting_bytes += e.memory_bytes(segment);
                        report.awaiting_offload += 1;
                    }
                }
            }
        }
        // Objects that also live on an SSD go first among those past the cutoff:
        // they only give up their memory, at once, where others would first have to
        // be offloaded (and the put wait for it) or be lost.
        let passes = [(cutoff, false, true), (cutoff, false, false), (u64::MAX, false, true), (u64::MAX, false, false)];
        for (cutoff, include_pinned, on_disk_only) in passes.into_iter().chain([(u64::MAX, true, false)]) {
            for i in 0..SHARDS {
                if report.freed_bytes + awaiting_bytes >= target {
                    break;
                }
                let mut shard = self.index.shard_at((start + i) % SHARDS).lock();
                shard.retain(|k, e| {
                    if report.freed_bytes + awaiting_bytes >= target
                        || e.last_access_ms > cutoff
                        || (e.pinned(now) && !include_pinned)
                        || (on_disk_only && e.disk() == 0)
                        || !Self::evictable(e, now, segment)
                    {
                        return true;
                    }
                    if e.disk() == 0 && !offload_owners.is_empty() {
                        let owner = e.replicas.first().and_then(|r| offload_owners.get(&r.segment()));
                        if let Some(&owner) = owner {
                            if e.offload_pending(now) {
                                return true; // counted above
                            }
                            if e.offload_deadline_ms() == 0 {
                                e.set_offload_deadline_ms(offload_until);
                                to_offload.push((owner, (Box::<str>::from(k), e.checksum)));
                                report.awaiting_offload += 1;
                                awaiting_bytes += e.memory_bytes(segment);
                                return true;
                            }
                            // Asked before and never reported: the owner cannot
                            // offload it; it is dropped like any other object.
                        }
                    }
                    report.freed_bytes += e.memory_bytes(segment);
                    report.evicted_objects += 1;
                    // Not waited for: a node that still lists an evicted object
                    // offers it again only if its bytes are intact (a cache may keep
                    // what it evicted), and the update precedes, on the node's link,
                    // any later record of the space it frees. A later remove of the
                    // key, or a later put of it, waits for it, though (`unsent_removals`).
                    self.unsent_removals.add(k, self.note_removed(k, &e.replicas));
                    if e.disk() != 0 {
                        // Offloaded: the memory goes, the object stays on its SSD.
                        e.replicas.clear();
                        return true;
                    }
                    if e.offload_deadline_ms() != 0 {
                        // Its offload may still be written, unknown to us.
                        self.tombstones.linger(k);
                    }
                    // An abandoned upsert's replicas (a live one leases the object).
                    self.hold_orphaned_upsert(e, now);
                    false
                });
            }
            if report.freed_bytes + awaiting_bytes >= target {
                break;
            }
        }
        if !to_offload.is_empty() {
            to_offload.sort_unstable_by_key(|(owner, _)| *owner);
            for chunk in to_offload.chunk_by(|a, b| a.0 == b.0) {
                self.queue_offloads(chunk[0].0, chunk.iter().map(|(_, k)| k.clone()));
            }
        }
        self.counters.evicted_objects.fetch_add(report.evicted_objects, Ordering::Relaxed);
        self.counters.evicted_bytes.fetch_add(report.freed_bytes, Ordering::Relaxed);
        if report.evicted_objects > 0 {
            tracing::debug!(?segment, objects = report.evicted_objects, bytes = report.freed_bytes, "evicted");
        }
        report
    }
}
