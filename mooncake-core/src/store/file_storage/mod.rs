//! The SSD tier of a client (`FileStorage`): offload of objects from the client's
//! segment to its disk, loads back, the server other clients load from, and
//! recovery of the disk's objects on start.
//!
//! The master decides what goes to disk ([`PersistPolicy`](crate::PersistPolicy)):
//! the offload thread asks it (`offload_heartbeat`) for objects of this client's
//! segment, reads them from the segment, checks their checksum, writes them with the
//! [`StorageBackend`](mooncake_storage::StorageBackend) and reports them
//! (`notify_offload_success`), after which the master may free their memory. Disk eviction tells the master first
//! (`batch_evict_disk_replica`, through the backend's two-phase eviction), so the
//! master never points a reader at a deleted file.
//!
//! A client reading an object that lives only on another client's disk asks that
//! client's load server (`batch_get_offload_object`): the object is read into a
//! staging region registered with the transfer engine, pulled by the reader through
//! its transfer engine, and released (the staging GC reclaims forgotten batches).

mod config;
mod load_server;
mod peers;
mod stats;
mod tier;

pub use config::{SsdBackend, SsdOffloadConfig};
pub(crate) use load_server::endpoint_host;
pub(crate) use peers::DiskPeers;
pub use stats::SsdStats;
pub(crate) use tier::FileStorage;
