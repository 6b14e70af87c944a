//! Extents: a storage node's memory in a cluster, one extent per slot group, each
//! mounted with its group's leader and offering the records of the objects it holds.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mooncake_alloc::SegmentId;
use mooncake_transfer::{RegisteredRegion, RemoteRegion};
use parking_lot::Mutex;

use super::ClusterClient;
use crate::error::Result;
use crate::master::{MasterApi, ObjectRecord};
use crate::store::records::SegmentRecords;

/// One extent of this node's memory: the share of one slot group.
pub(crate) struct Extent {
    pub(crate) group: u32,
    pub(crate) region: Arc<RegisteredRegion>,
    pub(crate) remote: RemoteRegion,
    pub(crate) records: SegmentRecords,
    /// Where it is mounted now: (master address, segment id, leader epoch).
    pub(crate) mount: Mutex<Option<(String, SegmentId, u64)>>,
}

impl ClusterClient {
    /// Mounts every extent whose group has a leader it is not mounted with.
    pub(crate) fn place_extents(&self) {
        let map = self.maps.map();
        for x in &self.extents {
            let Some(leader) = map.leader(x.group) else { continue };
            let current = x.mount.lock().clone();
            if current.as_ref().is_some_and(|(a, _, e)| a == &leader.addr && *e == leader.epoch) {
                continue;
            }
            if let Err(e) = self.mount_extent_at(x, &leader.addr, leader.epoch) {
                tracing::debug!(group = x.group, master = leader.addr, error = %e, "extent not mounted yet");
            }
        }
        let due = std::mem::take(&mut *self.mark_due.lock());
        for addr in due {
            self.mark_draining_at(&addr);
        }
    }

    /// A drained node marks its extents at the master at `addr` draining (see
    /// `drained`); a master that cannot be told now is told with the next heartbeat.
    fn mark_draining_at(&self, addr: &str) {
        let Some((node, grace_ms)) = self.drained.lock().clone() else { return };
        match self.session(addr).and_then(|s| s.rpc.drain_segment(&node, grace_ms)) {
            Ok(_) => tracing::info!(master = addr, "our extents mounted there marked draining again"),
            Err(e) => {
                tracing::warn!(master = addr, error = %e, "cannot mark our extents draining there yet");
                let mut due = self.mark_due.lock();
                if !due.iter().any(|a| a == addr) {
                    due.push(addr.to_owned());
                }
            }
        }
    }

    /// Mounts `x` with the leader at `addr` (epoch `epoch`), offering its records.
    fn mount_extent_at(&self, x: &Extent, addr: &str, epoch: u64) -> Result<()> {
        let s = self.session(addr)?;
        let id = self.id_at(&s)?;
        // A new leader wants the records back (a restarted master does, as in single
        // mode); so does the same leader if it forgot us: it takes back only what no
        // removal or put superseded meanwhile.
        let records = x.records.rejoin(&x.region);
        // First the removals we keep for the group's leader: a copy another node
        // forgotten before its removal offers is refused or dropped by them.
        if let Err(e) = x.records.offer_tombstones(&s.rpc, id) {
            tracing::warn!(group = x.group, master = addr, error = %e, "cannot hand the leader the removals we keep");
        }
        let (segment, taken) = s.rpc.mount_extent(id, &x.remote, x.region.len(), x.group, &records)?;
        {
            // The master may have placed objects there and told us before this answer
            // reached us: those updates wait in `unrouted`.
            let mut unrouted = self.unrouted.lock();
            x.records.set_segment(segment);
            *x.mount.lock() = Some((addr.to_owned(), segment, epoch));
            let (ours, rest): (Vec<_>, Vec<_>) = unrouted.drain(..).partition(|(_, u)| u.segment() == Some(segment));
            *unrouted = rest;
            x.records.apply(ours.into_iter().map(|(_, u)| u).collect());
        }
        self.segment_home.write().insert(segment, addr.to_owned());
        // Whatever the memory records it took back: the objects only on our SSD (all
        // of them, right after a restart on the same directory) are known to this
        // master only once the SSD tier announces them to it.
        self.remounted.store(true, Ordering::Release);
        tracing::info!(group = x.group, master = addr, segment, taken, "extent mounted");
        // A mounted extent starts out placeable: a drained node has it marked draining
        // at once (which also has us drain whatever landed there meanwhile).
        self.mark_draining_at(addr);
        Ok(())
    }

    /// Which of our extents is of `key`'s slot group (its index).
    pub(crate) fn extent_of(&self, key: &str) -> Option<usize> {
        let group = self.maps.map().group_of_key(key);
        self.extents.iter().position(|x| x.group == group)
    }

    /// The extents mounted now, by their segment ids (the SSD tier reads offloads there).
    pub(crate) fn extent_regions(&self) -> Vec<(SegmentId, Arc<RegisteredRegion>)> {
        self.extents
            .iter()
            .filter_map(|x| x.mount.lock().as_ref().map(|(_, segment, _)| (*segment, x.region.clone())))
            .collect()
    }

    /// Whether an extent holding records is mounted with no master now (its leader
    /// died or forgot us; it is mounted again once its group has a leader).
    pub(crate) fn unmounted_with_records(&self) -> bool {
        self.extents.iter().any(|x| x.mount.lock().is_none() && !x.records.snapshot().is_empty())
    }

    /// The records of every extent (what this node would offer new leaders).
    pub(crate) fn records(&self) -> Vec<ObjectRecord> {
        self.extents.iter().flat_map(|x| x.records.snapshot()).collect()
    }
}
