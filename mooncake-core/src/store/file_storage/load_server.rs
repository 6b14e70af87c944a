//! The load server of a client's SSD tier: other clients ask it for objects that
//! live only on this client's disk (`batch_get_offload_object`); it reads them into
//! the staging region, which they pull through their transfer engine.

use std::sync::Arc;

use mooncake_storage::{load_into_staging, ClientBuffer, StorageBackend};
use mooncake_transfer::RemoteRegion;

use super::stats::{inc, SsdCounters};
use crate::rpc::budget::DecodeLimits;
use crate::rpc::wire::{OffloadBatch, Request, Response, WireError};
use crate::rpc::RpcHandler;

/// Most keys one `batch_get_offload_object` may ask for.
const MAX_LOAD_BATCH: usize = 4096;

/// What decoding one request to the load server may allocate: no more keys than a
/// batch holds (a larger one is refused from its announced length), and 64 MiB
/// (4,096 keys of the longest length are charged 35 MiB; see `rpc::budget`).
const DECODE_LIMITS: DecodeLimits = DecodeLimits { max_items: MAX_LOAD_BATCH, max_bytes: 64 << 20 };

/// Answers other clients' loads from this client's disk.
pub(super) struct LoadServer {
    pub(super) backend: Arc<dyn StorageBackend>,
    pub(super) staging: Arc<ClientBuffer>,
    pub(super) region: RemoteRegion,
    pub(super) counters: Arc<SsdCounters>,
}

impl RpcHandler for LoadServer {
    fn handle(&self, request: Request) -> Response {
        match request {
            Request::BatchGetOffloadObject { keys } => self.stage(&keys),
            Request::ReleaseOffloadBuffer { batch_id } => {
                self.staging.release(batch_id);
                Response::Unit
            }
            _ => Response::Error(WireError::InvalidArgument(
                "this is a storage node's load server: it answers only SSD loads".into(),
            )),
        }
    }

    fn decode_limits(&self) -> Option<DecodeLimits> {
        Some(DECODE_LIMITS)
    }
}

impl LoadServer {
    fn stage(&self, keys: &[String]) -> Response {
        if keys.is_empty() || keys.len() > MAX_LOAD_BATCH {
            return Response::Error(WireError::InvalidArgument(format!(
                "a load batch holds 1..={MAX_LOAD_BATCH} keys, not {}",
                keys.len()
            )));
        }
        let present: Vec<&str> =
            keys.iter().map(String::as_str).filter(|k| self.backend.object_meta(k).is_some()).collect();
        let lease = match load_into_staging(&*self.backend, &self.staging, &present) {
            Ok(l) => l,
            Err(e) => return Response::Error(WireError::Storage(e.to_string())),
        };
        inc(&self.counters.served_loads, present.len() as u64);
        let mut staged = present.iter().zip(&lease.locations);
        let mut next = staged.next();
        let objects = keys
            .iter()
            .map(|k| match next {
                Some((p, loc)) if *p == k.as_str() => {
                    next = staged.next();
                    Ok((loc.offset, loc.len))
                }
                _ => Err(WireError::NotFound(format!("{k} is not on this node's disk"))),
            })
            .collect();
        Response::OffloadBatch(OffloadBatch {
            batch_id: lease.batch_id,
            endpoint: self.region.endpoint.clone(),
            region: self.region.region,
            gc_ttl_ms: lease.gc_ttl_ms,
            objects,
        })
    }
}

/// The host part of a `host:port` endpoint (IPv6 hosts keep their brackets); an
/// in-process endpoint (no port) serves on loopback.
pub(crate) fn endpoint_host(endpoint: &str) -> &str {
    match endpoint.rfind(':') {
        Some(i) if endpoint[i + 1..].parse::<u16>().is_ok() => &endpoint[..i],
        _ => "127.0.0.1",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_hosts() {
        assert_eq!(endpoint_host("10.0.0.1:1234"), "10.0.0.1");
        assert_eq!(endpoint_host("[::1]:80"), "[::1]");
        assert_eq!(endpoint_host("local://12/3"), "127.0.0.1");
    }
}
