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
//! with `memcpy`), [`TcpTransport`] (anywhere; pooled, pipelined, striped) and
//! [`RdmaTransport`] (one-sided RDMA READ/WRITE through an [`RdmaProvider`]:
//! [`SoftRdma`] software NICs, or, with the `rdma` feature, `VerbsRdma` on this
//! host's devices through libibverbs loaded at run time).
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
//!
//! # Wire protocol
//!
//! The TCP transport (and the handshakes that set up shared memory) speak
//! fixed-layout little-endian frames, no serialization library needed:
//!
//! ```text
//! request  (40 B): magic "MCTX" | version u8 | op u8 | flags u16 | request id u64
//!                  | region u64 | offset u64 | len u64        [+ len bytes for Write]
//! response (24 B): magic "MCTX" | status u8 | 0 u8 x3 | request id u64 | len u64
//!                  [+ len bytes: data of a Read, or the handshake payload]
//! ```
//! Decoders ([`RequestHeader::decode`], [`ResponseHeader::decode`]) never panic;
//! anything malformed is a [`FrameError`] and the server closes that connection.
//!
//! A listener that requires a shared secret runs the handshake of [`SharedSecret`]
//! (both sides send [`AUTH_MAGIC`] and a nonce, the listener proves the secret for its
//! address, then the peer, then one verdict byte) before
//! it reads any request. A listener that will not serve a connection (protected
//! mode, a peer proving a secret this listener does not have) sends a refusal
//! ([`encode_refusal`]) and closes it.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod answer_wait;
mod auth;
pub mod checksum;
mod engine;
mod error;
mod frame;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod handshake;
mod rdma;
mod region;
mod registry;
mod stream_copy;
mod transport;
mod warn_limit;

pub use answer_wait::{
    answer_spin, poll_pause, read_polling, send_no_signal, spin_from_env, DEFAULT_ANSWER_SPIN, SPIN_BEFORE_YIELD,
};
pub use auth::{
    admits_peer, decode_refusal, encode_refusal, read_up_to, Acceptor, AuthFailure, SharedSecret, AUTH_HELLO_LEN,
    AUTH_LEN, PROTECTED_MODE_REFUSAL,
};
pub use engine::{TransferEngine, TransferEngineBuilder};
pub use error::{Result, TransferError};
pub use frame::{
    decode_frame_header, FrameError, FrameOp, FrameStatus, RequestHeader, ResponseHeader, AUTH_MAGIC, FRAME_MAGIC,
    FRAME_VERSION, MAX_HANDSHAKE_BYTES, MAX_REQUEST_BYTES, REFUSE_MAGIC, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN,
};
pub use handshake::host_id;
#[cfg(feature = "rdma")]
pub use rdma::VerbsRdma;
pub use rdma::{
    rdma_device_present, Completion, CompletionStatus, DeviceRegion, DeviceTransfer, DmaBuf, MemoryRegion, PortInfo,
    ProtectionDomain, QpAddress, QpState, QueuePair, RdmaConfig, RdmaHandshake, RdmaProvider, RdmaRegionInfo,
    RdmaTransport, RegionPiece, RemoteAccess, SoftFaults, SoftPortConfig, SoftRdma, WorkOp, WorkRequest,
};
pub use region::{RegionId, RegisteredRegion, RemoteRegion};
pub use stream_copy::copies_fold_checksums;
pub use transport::{
    Capabilities, LocalTransport, MappedRegion, OnLanded, ShmTransport, TcpTransport, TransferOp, TransferRequest,
    TransferStats, Transport, TransportStats, LOCAL_SCHEME,
};
pub use warn_limit::{WarnLimiter, WARN_EVERY};
