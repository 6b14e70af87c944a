//! The master protocol: framed, versioned, pipelined binary RPC over TCP (and a Unix
//! socket for clients on the server's host).
//!
//! [`RpcServer`] serves a [`MasterService`](crate::master::MasterService);
//! [`RpcMasterClient`] is the [`MasterApi`](crate::master::MasterApi) a remote
//! [`Store`](crate::Store) uses. The frame layout is documented in `wire`, which is
//! crate-private: the `fuzzing` feature exposes it (with `read_frame` and
//! `FrameReader`) to fuzz targets and protocol tests, as no stable API. What decoding a body may allocate is bounded by [`budget`].

pub mod budget;
mod client;
pub(crate) mod convert;
mod event_loop;
mod frame_reader;
mod handler;
mod server;
mod socket;
mod threads;
#[cfg(feature = "fuzzing")]
pub mod wire;
#[cfg(not(feature = "fuzzing"))]
pub(crate) mod wire;

#[cfg(feature = "fuzzing")]
pub use client::{answer_result, decode_answer};
pub use client::{record_endpoint_secret, RpcMasterClient, RpcRecordConnector, RECORD_KEY_LEN};
#[cfg(feature = "etcd")]
pub(crate) use client::{unexpected, Sent};
pub use event_loop::MAX_UNAUTHENTICATED;
#[cfg(feature = "fuzzing")]
pub use frame_reader::{FrameReader, RawFrame};
#[cfg(feature = "fuzzing")]
pub use handler::RpcHandler;
#[cfg(not(feature = "fuzzing"))]
pub(crate) use handler::RpcHandler;
pub use handler::{RpcServerConfig, RpcServerStats, DEFAULT_SERVER_SPIN};
#[cfg(feature = "fuzzing")]
pub use server::{dispatch, read_frame};
pub use server::{RpcServer, LIST_KEYS_MAX_BYTES, MAX_LISTED_KEYS};
pub use wire::REQUEST_KINDS;
