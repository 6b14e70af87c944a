//! The metadata calls the cluster benchmarks issue: batch puts without bytes
//! (`batch_put_start` then `batch_put_end`, the node's record acknowledged as in a
//! real put) and batch lookups, through any `MasterApi` (a cluster's router or one
//! master's client).

use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_core::{ClientId, MasterApi, ReplicateConfig, Store};

/// The key of object `i` in the throughput and failover runs.
pub(crate) fn key(prefix: &str, i: u64) -> String {
    format!("{prefix}/{i:012}")
}

/// A client of the cluster at `address` giving no memory and keeping no replica
/// lists (every get asks its group's leader), returned once the node's extents of
/// all `groups` are mounted.
pub(crate) fn client_store(address: &str, groups: u64) -> Result<Store, String> {
    let store = Store::builder()
        .master_address(address)
        .global_segment_size(0)
        .replica_cache(0)
        .build()
        .map_err(|e| e.to_string())?;
    wait_extents(&store, groups)?;
    Ok(store)
}

/// Waits until the node has an extent mounted for every group.
pub(crate) fn wait_extents(store: &Store, groups: u64) -> Result<(), String> {
    let start = Instant::now();
    while store.master().stats().map(|s| s.segments).unwrap_or(0) != groups {
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!("the node's {groups} extents were not all mounted in 60 s"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Puts `keys` (metadata only: placement, then the end of the put; no bytes are
/// written, the checksum is a placeholder). Returns the items that failed.
pub(crate) fn put_batch(api: &Arc<dyn MasterApi>, client: ClientId, keys: &[String], len: u64) -> u64 {
    let cfg = ReplicateConfig::default();
    let items: Vec<(&str, u64)> = keys.iter().map(|k| (k.as_str(), len)).collect();
    let started = api.batch_put_start(client, &items, &cfg);
    let placed: Vec<(&str, u32)> =
        keys.iter().zip(&started).filter(|(_, r)| r.is_ok()).map(|(k, _)| (k.as_str(), 0)).collect();
    let ended = api.batch_put_end(client, &placed);
    (keys.len() - placed.len()) as u64 + ended.iter().filter(|r| r.is_err()).count() as u64
}

/// A small xorshift generator: a uniform key choice per item, without a dependency.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for stream `seed`.
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// A value in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}
