//! Mooncake Store: a distributed KV-cache storage engine for LLM inference.
//!
//! Clients ([`Store`]) give DRAM to a shared pool (their *segment*) and put and get
//! immutable objects by key. A [`Master`] keeps the object metadata and places
//! replicas; bytes move directly between clients through the transfer engine and
//! never through the master. Without [`StoreBuilder::master`], a store starts its own
//! embedded master: a complete single-process store.
//!
//! ```
//! use mooncake_core::{Master, MasterConfig, ReplicateConfig, Store};
//!
//! let master = Master::new(MasterConfig::default())?;
//! let a = Store::builder().master(&master).global_segment_size(8 << 20).build()?;
//! let b = Store::builder().master(&master).global_segment_size(8 << 20).build()?;
//! a.put_with("layer0/block7", &[1u8; 4096], &ReplicateConfig::replicas(2))?;
//! drop(a); // one replica survives on b's segment
//! assert_eq!(b.get("layer0/block7")?.len(), 4096);
//! # Ok::<(), mooncake_core::Error>(())
//! ```
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod buffer_registry;
mod checksum;
pub mod cluster;
#[cfg(feature = "etcd")]
mod cluster_client;
mod config;
mod daemon;
mod error;
mod master;
pub mod reference_code;
pub mod rpc;
mod store;

pub use buffer_registry::BufferRegistry;
pub use config::{
    parse_size, MasterConfig, PersistPolicy, Protocol, ReplicateConfig, MAX_KEY_LEN, MAX_REPLICA_NUM, MAX_VALUE_LEN,
};
pub use daemon::{MasterDaemon, MasterDaemonBuilder};
pub use error::{Error, Result};
pub use master::{
    ClientId, ClientRegistration, DrainProgress, EvictionReport, HeldPlacement, KeyOwnership, Master, MasterApi,
    MasterService, MasterStats, MemoryReplica, ObjectInfo, ObjectRecord, OffloadPlan, OffloadTask, RecordConnector,
    RecordSink, RecordUpdate, RecordsInFlight, ReplicaList, ReplicatePlan, SegmentInfo, SegmentUsage,
};
pub use store::{ReadTime, SsdBackend, SsdOffloadConfig, SsdStats, Store, StoreBuilder, StoreStats, WriteTime};

/// Re-exports of the allocation crate: strategies and the traits to write your own.
pub use mooncake_alloc as alloc;
/// Re-exports of the GPU crate: device memory (`DeviceMemory`, its host emulation, CUDA
/// buffers) for [`Store::get_into_device`] / [`Store::put_from_device`], and `GpuTransport`.
pub use mooncake_gpu as gpu;
/// Re-exports of the SSD-tier crate: eviction policies, I/O engines, backends.
pub use mooncake_storage as storage;
