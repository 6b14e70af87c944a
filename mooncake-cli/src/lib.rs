//! What the `mooncake-master` and `mooncake-client` binaries share: the master's
//! Prometheus text ([`metrics`]) and the bounded HTTP server that serves it ([`http`]), its segment list ([`segments`]), a storage
//! node's attach file ([`attach`]), and the process limits they raise ([`limits`]).
//!
//! This crate exists so that the library (`mooncake-core`) carries no CLI, HTTP or
//! logging-subscriber dependency: the binaries and what only they use live here, with
//! cluster mode (`mooncake-core/etcd`) always on. Programs that embed a master use
//! `mooncake_core::MasterDaemon` instead.
#![deny(missing_docs)]

pub mod attach;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod segments;
