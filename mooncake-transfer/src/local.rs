//! The `Local` transport: peers in the same process, reached by `memcpy`.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::RwLock;

use crate::engine::EngineShared;
use crate::error::{Result, TransferError};
use crate::transport::{TransferOp, TransferRequest, Transport};

/// Prefix of the endpoints of in-process engines.
pub const LOCAL_SCHEME: &str = "local://";

/// Every live engine of this process, by endpoint. Engines add themselves when built
/// and remove themselves when dropped; a `Weak` keeps a dropped engine unreachable.
static LOCAL_ENGINES: LazyLock<RwLock<HashMap<String, Weak<EngineShared>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

pub(crate) fn publish(endpoint: &str, engine: &Arc<EngineShared>) {
    LOCAL_ENGINES.write().insert(endpoint.to_owned(), Arc::downgrade(engine));
}

pub(crate) fn withdraw(endpoint: &str) {
    LOCAL_ENGINES.write().remove(endpoint);
}

fn lookup(endpoint: &str) -> Result<Arc<EngineShared>> {
    LOCAL_ENGINES
        .read()
        .get(endpoint)
        .and_then(Weak::upgrade)
        .ok_or_else(|| TransferError::UnknownEndpoint(endpoint.to_owned()))
}

/// Moves bytes between engines of one process with `memcpy`: no copy beyond the one
/// into the destination.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalTransport;

impl Transport for LocalTransport {
    fn name(&self) -> &str {
        "local"
    }

    fn can_reach(&self, endpoint: &str) -> bool {
        // Any engine of this process, whatever its endpoint (a listening engine is
        // still reached by memcpy from inside its own process).
        lookup(endpoint).is_ok()
    }

    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
        requests
            .iter_mut()
            .map(|req| {
                let engine = lookup(&req.target.endpoint)?;
                let region = engine.region(req.target.region)?;
                match &mut req.op {
                    TransferOp::Read(dst) => region.copy_out(req.offset, dst),
                    TransferOp::Write(src) => region.copy_in(req.offset, src),
                }
            })
            .collect()
    }
}
