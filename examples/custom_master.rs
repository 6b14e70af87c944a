//! Running your own master daemon, with your own `AllocationStrategy`, in a few
//! lines: `MasterDaemon` is what the `mooncake-master` binary runs, with the same
//! served defaults (`MasterConfig::served`).
//!
//! Run: `cargo run --example custom_master`

use std::sync::Arc;

use mooncake_core::alloc::{
    AllocatedBuffer, AllocationError, AllocationRequest, AllocationStrategy, SegmentAllocator, SsdMetricsProvider,
};
use mooncake_core::{Error, MasterDaemon, Store};

/// Places replicas on the segments with the most free bytes.
struct MostFree;

impl AllocationStrategy for MostFree {
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        _ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        let mut by_room: Vec<&Arc<SegmentAllocator>> = candidates.iter().collect();
        by_room.sort_by_key(|s| std::cmp::Reverse(s.free_bytes()));
        let placed: Vec<AllocatedBuffer> =
            by_room.into_iter().filter_map(|s| s.allocate(request.size)).take(request.replica_num).collect();
        if placed.is_empty() {
            return Err(AllocationError::NoSpace {
                size: request.size,
                replica_num: request.replica_num,
                candidates: candidates.len(),
            });
        }
        Ok(placed)
    }

    fn name(&self) -> &str {
        "most_free"
    }
}

fn main() -> Result<(), Error> {
    // The daemon: listens until dropped.
    let daemon = MasterDaemon::builder("127.0.0.1:0").allocation_strategy(MostFree).serve()?;
    let addr = daemon.local_addr().to_string();
    println!("master ({}) on {addr}", daemon.master().stats().allocation_strategy);

    // Clients, as other processes would build them. A client that gives memory
    // serves it to the others (here on the address it reaches the master by).
    let a = Store::builder().master_address(&addr).global_segment_size(8 << 20).build()?;
    let b = Store::builder().master_address(&addr).global_segment_size(8 << 20).build()?;
    for i in 0..16 {
        a.put(&format!("block{i}"), &[i as u8; 256 << 10])?;
    }
    let (used_a, used_b) = (a.stats().segment_used, b.stats().segment_used);
    println!("segment a: {used_a} bytes used, segment b: {used_b}");
    assert!(used_a > 0 && used_b > 0, "most-free placement spreads the blocks");
    assert_eq!(b.get("block3")?[..], [3u8; 256 << 10][..]);
    Ok(())
}
