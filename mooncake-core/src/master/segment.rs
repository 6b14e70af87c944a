//! Mounted segments and the clients that own them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_alloc::{SegmentAllocator, SegmentId};
use mooncake_transfer::RemoteRegion;

use crate::master::types::ClientId;

/// A segment as the master knows it.
pub(crate) struct SegmentEntry {
    pub(crate) alloc: Arc<SegmentAllocator>,
    pub(crate) owner: ClientId,
    pub(crate) region: RemoteRegion,
    /// A client could not write to it: no placement until its owner heartbeats again.
    pub(crate) suspect: bool,
    /// Cluster mode: the slot group whose keys it holds (an extent of the node's memory).
    pub(crate) group: Option<u32>,
    /// Its node is draining (`drain_segment`): no new replica goes there, for good;
    /// what it holds stays readable while the node moves it away.
    pub(crate) draining: bool,
}

/// A registered client.
pub(crate) struct ClientRecord {
    pub(crate) last_heartbeat_ms: AtomicU64,
    pub(crate) segments: Vec<SegmentId>,
    /// Changes to the objects of this client's segments, drained by its heartbeats
    /// (only when the master tracks records).
    pub(crate) updates: parking_lot::Mutex<Vec<crate::master::types::RecordUpdate>>,
    /// The client's record endpoint, once it mounted one: changes go there, not to
    /// the heartbeats.
    pub(crate) link: parking_lot::Mutex<Option<Arc<crate::master::record_link::NodeLink>>>,
    /// The record key of the first endpoint mounted for this client: a later mount
    /// must name the same key (the node keeps one key for its life), so another
    /// holder of the cluster's secret cannot move the client's records elsewhere.
    pub(crate) record_key: parking_lot::Mutex<Option<Vec<u8>>>,
    /// Some segment of this client is suspect (its next heartbeat clears them).
    pub(crate) suspect: std::sync::atomic::AtomicBool,
    /// The client said it may have missed record updates before it registered
    /// (`missed_updates`): what the master takes back only from it waits for the
    /// recovery window to close before it is served (`master/recovered.rs`).
    pub(crate) missed_updates: std::sync::atomic::AtomicBool,
    /// SSD capacity the client reported (bytes; <= 0: none).
    pub(crate) ssd_total: std::sync::atomic::AtomicI64,
    /// Bytes of `LocalDisk` replicas the master records on the client's SSD.
    pub(crate) ssd_used: std::sync::atomic::AtomicI64,
    /// Where the client serves loads from its SSD (`batch_get_offload_object`).
    pub(crate) ssd_endpoint: parking_lot::Mutex<Option<String>>,
    /// Work for the client's offload heartbeat.
    pub(crate) offload: parking_lot::Mutex<OffloadQueue>,
}

/// What a client's SSD tier has to do, drained by its offload heartbeats.
#[derive(Default)]
pub(crate) struct OffloadQueue {
    /// Objects to write to the SSD, oldest request first: the key and the checksum
    /// of the object asked for (a request outlived by a new object under the key is
    /// dropped: the new one is asked for on its own, perhaps of another node).
    pub(crate) write: std::collections::VecDeque<(Box<str>, u32)>,
    /// Keys whose disk replica the master dropped (removed objects): their files go.
    pub(crate) discard: Vec<String>,
}

impl ClientRecord {
    pub(crate) fn new(now_ms: u64) -> Self {
        Self {
            last_heartbeat_ms: AtomicU64::new(now_ms),
            segments: Vec::new(),
            updates: Default::default(),
            link: Default::default(),
            record_key: Default::default(),
            suspect: Default::default(),
            missed_updates: Default::default(),
            ssd_total: Default::default(),
            ssd_used: Default::default(),
            ssd_endpoint: Default::default(),
            offload: Default::default(),
        }
    }

    /// Whether the client has an SSD tier the master can ask to offload to.
    pub(crate) fn takes_offloads(&self) -> bool {
        self.ssd_total.load(Ordering::Relaxed) > 0 && self.ssd_endpoint.lock().is_some()
    }

    pub(crate) fn touch(&self, now_ms: u64) {
        self.last_heartbeat_ms.fetch_max(now_ms, Ordering::Relaxed);
    }
}

/// Segments by id plus the candidate list handed to the allocation strategy. The list
/// is rebuilt on mount/unmount (rare) so that a put only clones an `Arc`.
#[derive(Default)]
pub(crate) struct SegmentTable {
    pub(crate) by_id: HashMap<SegmentId, SegmentEntry>,
    pub(crate) candidates: Arc<Vec<Arc<SegmentAllocator>>>,
    /// The candidates new replicas may go to: all but the suspect segments.
    pub(crate) placeable: Arc<Vec<Arc<SegmentAllocator>>>,
    /// Cluster mode: the placeable segments of each slot group.
    pub(crate) placeable_by_group: Arc<HashMap<u32, Arc<Vec<Arc<SegmentAllocator>>>>>,
}

impl SegmentTable {
    pub(crate) fn insert(&mut self, seg: SegmentEntry) {
        self.by_id.insert(seg.alloc.id(), seg);
        self.rebuild();
    }

    pub(crate) fn remove(&mut self, id: SegmentId) -> Option<SegmentEntry> {
        let seg = self.by_id.remove(&id);
        if seg.is_some() {
            self.rebuild();
        }
        seg
    }

    /// Marks a segment suspect (or not); returns whether it changed.
    pub(crate) fn set_suspect(&mut self, id: SegmentId, suspect: bool) -> bool {
        match self.by_id.get_mut(&id) {
            Some(s) if s.suspect != suspect => {
                s.suspect = suspect;
                self.rebuild();
                true
            }
            _ => false,
        }
    }

    /// Marks a segment draining; returns whether it was not already.
    pub(crate) fn set_draining(&mut self, id: SegmentId) -> bool {
        match self.by_id.get_mut(&id) {
            Some(s) if !s.draining => {
                s.draining = true;
                self.rebuild();
                true
            }
            _ => false,
        }
    }

    fn rebuild(&mut self) {
        let mut list: Vec<_> = self.by_id.values().map(|s| s.alloc.clone()).collect();
        list.sort_by_key(|a| a.id());
        self.placeable = Arc::new(
            list.iter()
                .filter(|a| self.by_id.get(&a.id()).is_some_and(|s| !s.suspect && !s.draining))
                .cloned()
                .collect(),
        );
        let mut by_group: HashMap<u32, Vec<Arc<SegmentAllocator>>> = HashMap::new();
        for a in self.placeable.iter() {
            if let Some(g) = self.by_id.get(&a.id()).and_then(|s| s.group) {
                by_group.entry(g).or_default().push(a.clone());
            }
        }
        self.placeable_by_group = Arc::new(by_group.into_iter().map(|(g, v)| (g, Arc::new(v))).collect());
        self.candidates = Arc::new(list);
    }

    /// The bytes of every candidate segment (saturating: capacities are what clients
    /// declared).
    pub(crate) fn capacity(&self) -> u64 {
        self.candidates.iter().fold(0u64, |sum, s| sum.saturating_add(s.capacity()))
    }

    /// The bytes reserved on every candidate segment (saturating, as `capacity`).
    pub(crate) fn used(&self) -> u64 {
        self.candidates.iter().fold(0u64, |sum, s| sum.saturating_add(s.used_bytes()))
    }
}
