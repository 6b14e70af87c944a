//! A storage node's record endpoint in cluster mode: the masters tell it of every
//! change to the records of its extents (`cluster_client::extents`), and the changes
//! are applied to the extents they concern.

use std::sync::Arc;
use std::time::Instant;

use mooncake_alloc::SegmentId;

use crate::cluster_client::{ClusterClient, UpdatesFrom, SESSION_TIMEOUT};
use crate::master::RecordUpdate;
use crate::rpc::wire::{Request, Response, WireError};
use crate::rpc::RpcHandler;

/// Most record updates kept for extents whose mount answer has not arrived yet (a
/// master sends at most as many in one frame).
pub(crate) const MAX_UNROUTED: usize = 65_536;

impl ClusterClient {
    /// Applies record updates to the extents they concern; updates for a segment not
    /// (yet) known to be ours wait for its mount answer. `Err` with how many could
    /// not wait (only from the [`UpdatesFrom::Endpoint`], which then applied none).
    pub(crate) fn apply_updates(&self, updates: Vec<RecordUpdate>, from: UpdatesFrom) -> Result<(), usize> {
        if updates.is_empty() {
            return Ok(());
        }
        // Under this lock, a mount that just completed has set its segment (below).
        let mut unrouted = self.unrouted.lock();
        let mounted: Vec<Option<SegmentId>> =
            self.extents.iter().map(|x| x.mount.lock().as_ref().map(|(_, segment, _)| *segment)).collect();
        let waiting = updates.iter().filter(|u| u.segment().is_some_and(|s| !mounted.contains(&Some(s)))).count();
        if unrouted.len() + waiting > MAX_UNROUTED {
            // Mount answers arrive within a master timeout; older updates are for
            // segments that are not ours.
            unrouted.retain(|(at, _)| at.elapsed() < SESSION_TIMEOUT * 2);
            if from == UpdatesFrom::Endpoint && unrouted.len() + waiting > MAX_UNROUTED {
                tracing::warn!(
                    waiting,
                    kept = unrouted.len(),
                    "record updates for extents not mounted yet refused: the master sends them again"
                );
                return Err(waiting);
            }
        }
        let mut by_extent: Vec<Vec<RecordUpdate>> = self.extents.iter().map(|_| Vec::new()).collect();
        let mut discards = Vec::new();
        let mut dropped = 0;
        for u in updates {
            if let RecordUpdate::Drain { grace_ms, .. } = u {
                self.drain_asked.ask(grace_ms);
                continue;
            }
            if let RecordUpdate::Tombstone { key, .. } = &u {
                // Kept with the extent of the key's group, and offered to the
                // group's next leader when the extent is mounted there.
                if let Some(i) = self.extent_of(key) {
                    by_extent[i].push(u);
                }
                continue;
            }
            let Some(segment) = u.segment() else {
                discards.push(u);
                continue;
            };
            match mounted.iter().position(|m| *m == Some(segment)) {
                Some(i) => by_extent[i].push(u),
                // For an extent whose mount answer is still on its way to us.
                None if unrouted.len() < MAX_UNROUTED => unrouted.push((Instant::now(), u)),
                None => dropped += 1,
            }
        }
        if dropped > 0 {
            tracing::warn!(dropped, "record updates from a heartbeat for extents not mounted yet dropped");
        }
        for (x, updates) in self.extents.iter().zip(by_extent) {
            if !updates.is_empty() {
                x.records.apply(updates);
            }
        }
        // File deletions (I/O) without the lock.
        drop(unrouted);
        if let Some(disk) = self.disk.get() {
            for u in discards {
                if let RecordUpdate::Discard { key, generation } = u {
                    disk.discard(&key, generation);
                }
            }
        }
        Ok(())
    }

    /// `Discard` updates delete files of `disk` (this node's SSD tier) from now on.
    pub(crate) fn set_disk(&self, disk: Arc<dyn crate::store::records::DiskDiscard>) {
        let _ = self.disk.set(disk);
    }
}

/// The record endpoint of a node in a cluster: updates for any of its extents.
pub(crate) struct ClusterRecords(pub(crate) Arc<ClusterClient>);

impl RpcHandler for ClusterRecords {
    fn handle(&self, request: Request) -> Response {
        match request {
            Request::ApplyRecords { updates } => match self.0.apply_updates(updates, UpdatesFrom::Endpoint) {
                Ok(()) => Response::Unit,
                Err(waiting) => Response::Error(WireError::Other(format!(
                    "{waiting} record updates are for extents whose mount answer has not arrived, and no more \
                     can wait: send them again"
                ))),
            },
            _ => Response::Error(WireError::InvalidArgument(
                "this is a storage node's record endpoint: it answers only record updates".into(),
            )),
        }
    }

    /// As a single node's record endpoint: a few map operations a put waits for,
    /// answered on the polling thread.
    fn answers_inline(&self, kind: usize) -> bool {
        kind == Request::APPLY_RECORDS_KIND
    }
}
