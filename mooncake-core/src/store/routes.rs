//! Where a replica's bytes are: its segment's region at a peer, and what the
//! transport that reaches that peer can do. Resolved once per segment (one
//! `segment_info` round trip, one transport lookup) and kept until a transfer to it
//! fails or its bytes fail their checksum (the segment may be gone, the master
//! restarted), so that no call asks twice.

use std::collections::HashMap;
use std::sync::Arc;

use mooncake_alloc::SegmentId;
use mooncake_transfer::{Capabilities, RemoteRegion, TransferEngine};
use parking_lot::RwLock;

use crate::error::Result;
use crate::master::MasterApi;

/// Objects below this many bytes, moved by a transport that copies through a
/// mapping of the peer's memory on a CPU without the folding copy
/// ([`mooncake_transfer::copies_fold_checksums`]: with it, the sum costs nothing
/// beside the copy at any size), are copied and summed piece by piece
/// (`TransferRequest::with_checksum`). Measured on the 2-vCPU development VM
/// (in-process `get_into`, GB/s, three runs): 2 MiB 8.7–10.8 fused vs 5.7–8.0, 4 MiB
/// 7.5–9.4 vs 5.1–7.9; but 16 MiB 3.9–5.6 vs 8.2–9.1, where summing the whole copy on
/// both cores wins. A small object stays in cache either way when read alone, but a
/// batch of them does not (64 x 256 KiB over shm: 3.2 ms per call summed after the
/// copies, 2.0 ms summed piece by piece).
const FUSED_BELOW: usize = 8 << 20;

/// One segment's region and the capabilities of the transport that reaches it.
#[derive(Debug)]
pub(super) struct Route {
    /// The segment's registered region at its peer.
    pub(super) region: RemoteRegion,
    /// What the transport to `region.endpoint` can do (none if no transport
    /// reaches it: the transfer then fails as unreachable).
    pub(super) caps: Capabilities,
}

impl Route {
    /// Whether a transfer of an object of `len` bytes should have the transport
    /// take its checksum on the way: wherever the transport sums in flight, except
    /// large objects copied through a mapping by a CPU that cannot fold the sum into
    /// the copy, where one parallel sum afterwards beats it (`FUSED_BELOW`).
    pub(super) fn sums_in_flight(&self, len: usize) -> bool {
        self.caps.sums_in_flight
            && !(self.caps.maps_peer_memory && len >= FUSED_BELOW && !mooncake_transfer::copies_fold_checksums())
    }

    /// How near the bytes are, for the read order: 0 this client's own segment,
    /// 1 mapped memory (same process or same host), 2 over the network.
    pub(super) fn distance(&self, segment: SegmentId, own: SegmentId) -> u8 {
        match (segment == own, self.caps.maps_peer_memory) {
            (true, _) => 0,
            (false, true) => 1,
            (false, false) => 2,
        }
    }
}

/// The routes of the segments this client has reached.
#[derive(Default)]
pub(super) struct Routes {
    by_segment: RwLock<HashMap<SegmentId, Arc<Route>>>,
}

impl Routes {
    /// The route to `segment`, asked of the master and the engine the first time.
    pub(super) fn get(
        &self,
        master: &dyn MasterApi,
        engine: &TransferEngine,
        segment: SegmentId,
    ) -> Result<Arc<Route>> {
        if let Some(r) = self.by_segment.read().get(&segment) {
            return Ok(r.clone());
        }
        let region = master.segment_info(segment)?.region;
        let caps = engine.capabilities(&region.endpoint).unwrap_or_default();
        let route = Arc::new(Route { region, caps });
        self.by_segment.write().insert(segment, route.clone());
        Ok(route)
    }

    /// Whether every segment this client reached (one at least) is mapped memory
    /// (its own, a same-host peer's), none over the network.
    pub(super) fn all_map_peer_memory(&self) -> bool {
        let routes = self.by_segment.read();
        !routes.is_empty() && routes.values().all(|r| r.caps.maps_peer_memory)
    }

    /// Forgets the route to `segment`: the next call asks again.
    pub(super) fn forget(&self, segment: SegmentId) {
        self.by_segment.write().remove(&segment);
    }
}
