//! The master: object metadata, segments, leases, eviction and client liveness.
//!
//! The master never touches object bytes. It places replicas (through the
//! [`AllocationStrategy`](mooncake_alloc::AllocationStrategy) of its config), tracks
//! their state, grants read leases, evicts under memory pressure, and drops the
//! segments of clients that stop heartbeating.
//!
//! Layout: [`types`](self) holds the values the master hands out; `service` the state
//! and the [`Master`] handle; `api` the one table of calls ([`MasterApi`]); the other
//! files are facets of [`MasterService`]: `clients`, `objects`, `disk` (the SSD tier's
//! side), `eviction`, `records` (durable per-node records), `ownership` (cluster mode:
//! the slot groups this master leads), `liveness`, `stats`, `upsert` (atomic
//! replacement of an object), `recovered` (which copy a restarted master keeps), `carried` (removals nodes keep
//! for a restarted master),
//! `held` (placements clients hold ahead of their puts). The internal index and
//! segment table live in `object` and `segment`.

mod api;
mod carried;
mod clients;
mod disk;
mod drain;
#[cfg(test)]
mod dropped_tests;
mod eviction;
mod generations;
mod held;
mod liveness;
mod object;
mod objects;
mod ownership;
mod record_link;
mod records;
mod recovered;
mod segment;
mod service;
mod slot_groups;
mod stats;
mod tombstones;
mod types;
mod upsert;

pub(crate) use api::master_calls;
pub use api::MasterApi;
pub use drain::DrainProgress;
pub use ownership::KeyOwnership;
pub use record_link::{RecordConnector, RecordSink, RecordsInFlight};
pub use service::{Master, MasterService};
pub(crate) use types::remote_region;
pub use types::{
    ClientId, ClientRegistration, EvictionReport, HeldPlacement, MasterStats, MemoryReplica, ObjectInfo, ObjectRecord,
    OffloadPlan, OffloadTask, RecordUpdate, ReplicaList, ReplicatePlan, SegmentInfo, SegmentUsage,
};
