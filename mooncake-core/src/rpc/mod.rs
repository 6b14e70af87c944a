//! The master protocol: framed, versioned, pipelined binary RPC over TCP.
//!
//! [`RpcServer`] serves a [`MasterService`](crate::master::MasterService);
//! [`RpcMasterClient`] is the [`MasterApi`](crate::master::MasterApi) a remote
//! [`Store`](crate::Store) uses. The frame layout is documented in [`wire`], what
//! decoding a body may allocate in [`budget`].

pub mod budget;
mod client;
mod convert;
mod event_loop;
mod frame_reader;
mod handler;
mod server;
mod threads;
pub mod wire;

pub use client::{RpcMasterClient, RpcRecordConnector};
pub use frame_reader::{FrameReader, RawFrame};
pub use handler::{RpcHandler, RpcServerConfig, RpcServerStats};
pub use server::{dispatch, read_frame, RpcServer};
