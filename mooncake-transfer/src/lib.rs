//! Moving bytes between the registered memory of Mooncake Store endpoints.
//!
//! A [`TransferEngine`] owns the regions this endpoint serves (a client's global
//! segment, its staging buffers) and the [`Transport`]s that reach peers. Requests are
//! batched: [`TransferEngine::transfer`] takes a slice of [`TransferRequest`]s and
//! blocks until all are done. Every request is checked against the regions the
//! serving engine registered: a peer can never touch bytes outside them.
//!
//! Transports in this crate: [`LocalTransport`] (same process, `memcpy`),
//! [`ShmTransport`] (same host, other process: the peer's memfd is mapped and copied
//! with `memcpy`) and [`TcpTransport`] (anywhere; pooled, pipelined, striped).
//!
//! ```
//! use mooncake_transfer::{TransferEngine, TransferRequest};
//!
//! let node = TransferEngine::new();
//! let seg = node.register_region(64 << 10)?;
//! let target = node.remote(seg.id());
//! let me = TransferEngine::new();
//! let (a, b) = (vec![1u8; 100], vec![2u8; 100]);
//! let mut reqs = [TransferRequest::write(&target, 0, &a), TransferRequest::write(&target, 4096, &b)];
//! assert!(me.transfer(&mut reqs).iter().all(|r| r.is_ok()));
//! # Ok::<(), mooncake_transfer::TransferError>(())
//! ```
#![deny(missing_docs)]

pub mod auth;
mod engine;
mod error;
pub mod frame;
mod local;
mod region;
mod shm;
mod tcp;
mod transport;

pub use auth::SharedSecret;
pub use engine::{TransferEngine, TransferEngineBuilder};
pub use error::{Result, TransferError};
pub use local::{LocalTransport, LOCAL_SCHEME};
pub use region::{RegionId, RegisteredRegion, RemoteRegion};
pub use shm::{host_id, ShmTransport};
pub use tcp::TcpTransport;
pub use transport::{TransferOp, TransferRequest, TransferStats, Transport, TransportStats};
