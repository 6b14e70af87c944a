//! The `Local` transport: peers in the same process, reached by `memcpy`.

use super::{copy_with_region, Capabilities, MappedRegion, TransferRequest, Transport};
use crate::error::Result;
use crate::region::RemoteRegion;
use crate::registry;

/// Prefix of the endpoints of in-process engines.
pub const LOCAL_SCHEME: &str = "local://";

/// Moves bytes between engines of one process with `memcpy`: no copy beyond the one
/// into the destination.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalTransport;

impl Transport for LocalTransport {
    fn name(&self) -> &str {
        "local"
    }

    fn capabilities(&self, _endpoint: &str) -> Capabilities {
        Capabilities { maps_peer_memory: true, sums_in_flight: true, moves_device_memory: false }
    }

    fn can_reach(&self, endpoint: &str) -> bool {
        // Any engine of this process, whatever its endpoint (a listening engine is
        // still reached by memcpy from inside its own process).
        registry::lookup(endpoint).is_ok()
    }

    fn map_region(&self, target: &RemoteRegion) -> Option<Result<MappedRegion>> {
        let region = registry::lookup(&target.endpoint).and_then(|engine| engine.region(target.region));
        Some(region.map(|r| {
            let (ptr, len, writable) = (r.as_mut_ptr(), r.len(), r.peers_may_write());
            MappedRegion::new(r, ptr, len, writable)
        }))
    }

    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
        requests
            .iter_mut()
            .map(|req| {
                let engine = registry::lookup(&req.target.endpoint)?;
                let region = engine.region(req.target.region)?;
                copy_with_region(&region, req)
            })
            .collect()
    }
}
