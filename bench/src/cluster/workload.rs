//! The metadata calls the cluster benchmarks issue: batch puts without bytes
//! (`batch_put_start` then `batch_put_end`, the node's record acknowledged as in a
//! real put) and batch lookups, through any `MasterApi` (a cluster's router or one
//! master's client).

use std::sync::Arc;

use mooncake_core::{ClientId, MasterApi, ReplicateConfig};

/// The key of object `i` in the throughput and failover runs.
pub(crate) fn key(prefix: &str, i: u64) -> String {
    format!("{prefix}/{i:012}")
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
