//! Plugging a user-written `AllocationStrategy` into the builder.
//!
//! `FirstFit` places each replica on the first segments (by id) that have room: a
//! deliberately simple policy that packs the pool from one end.
//!
//! A strategy only ranks segments: `ReplicateConfig::preferred_segments` is applied
//! by the master before it asks the strategy (which then places only the replicas
//! left, among the other segments), so every strategy honours it.
//!
//! Run: `cargo run --example custom_strategy`

use std::sync::Arc;

use mooncake_core::alloc::{
    AllocatedBuffer, AllocationError, AllocationRequest, AllocationStrategy, SegmentAllocator, SsdMetricsProvider,
};
use mooncake_core::{Error, Master, MasterConfig, ReplicateConfig, Store};

/// Fills segments in id order.
#[derive(Debug, Default)]
struct FirstFit;

impl AllocationStrategy for FirstFit {
    fn allocate(
        &self,
        request: &AllocationRequest,
        candidates: &[Arc<SegmentAllocator>],
        _ssd: Option<&dyn SsdMetricsProvider>,
    ) -> Result<Vec<AllocatedBuffer>, AllocationError> {
        if request.size == 0 || request.replica_num == 0 {
            return Err(AllocationError::InvalidRequest("empty request".into()));
        }
        let mut sorted: Vec<&Arc<SegmentAllocator>> = candidates.iter().collect();
        sorted.sort_by_key(|s| s.id());
        let placed: Vec<AllocatedBuffer> =
            sorted.into_iter().filter_map(|s| s.allocate(request.size)).take(request.replica_num).collect();
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
        "first_fit"
    }
}

fn main() -> Result<(), Error> {
    let master = Master::new(MasterConfig { allocation_strategy: Arc::new(FirstFit), ..Default::default() })?;
    let first = Store::builder().master(&master).global_segment_size(1 << 20).build()?;
    let second = Store::builder().master(&master).global_segment_size(1 << 20).build()?;
    for i in 0..8 {
        first.put(&format!("block{i}"), &[i as u8; 64 << 10])?;
    }
    let (a, b) = (first.stats().segment_used, second.stats().segment_used);
    println!("strategy {}: first segment {a} bytes used, second {b}", master.stats().allocation_strategy);
    assert!(a >= 8 * (64 << 10) && b == 0, "first fit packs the first segment");
    // A preferred segment wins over the strategy's ranking.
    let on_second = master.segment_info(second.segment_id().expect("has a segment"))?.name;
    let cfg = ReplicateConfig { preferred_segments: vec![on_second], ..Default::default() };
    first.put_with("pinned-here", &[9u8; 64 << 10], &cfg)?;
    assert!(second.stats().segment_used >= 64 << 10, "placed on the preferred segment");
    // The same strategy through the builder of a store with an embedded master.
    let solo = Store::builder().global_segment_size(1 << 20).allocation_strategy(FirstFit).build()?;
    solo.put("k", b"v")?;
    println!("embedded master uses {}", solo.stats().master.allocation_strategy);
    Ok(())
}
