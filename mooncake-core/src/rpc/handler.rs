//! What serving the framed protocol needs, shared by the server, its threads and its
//! connections: the handler that answers requests, the server's limits and access rules, and its
//! counters.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use mooncake_transfer::SharedSecret;

use crate::rpc::budget::DecodeLimits;
use crate::rpc::wire::{Request, Response, DEFAULT_MAX_FRAME, REQUEST_KINDS};

/// Answers requests of the framed protocol (public with the `fuzzing` feature only,
/// like the wire format it speaks).
#[cfg_attr(feature = "fuzzing", visibility::make(pub))]
pub(crate) trait RpcHandler: Send + Sync + 'static {
    /// The response to one request.
    fn handle(&self, request: Request) -> Response;

    /// Whether requests of this kind (an index into [`REQUEST_KINDS`]) are answered
    /// with no other thread ready to take over the polling meanwhile: this saves
    /// preparing the hand-over (two system calls) and, when a connection becomes
    /// ready during the answer, waking another thread (tens of microseconds of a core
    /// on a virtual machine). Only for requests answered at once from memory (no I/O,
    /// no waiting, no lock held long): while one is answered, no connection is
    /// polled. None by default.
    fn answers_inline(&self, kind: usize) -> bool {
        let _ = kind;
        false
    }

    /// Whether [`work_after_answer`](Self::work_after_answer) has anything to do;
    /// asked after every answer, so it must be cheap. `false` by default.
    fn has_work_after_answer(&self) -> bool {
        false
    }

    /// Work an answer left to do once the response is out (the master: writing the
    /// records a put's start queued to their nodes, while its client writes the
    /// bytes). Run by the thread that answered, which may lead (no connection is
    /// polled meanwhile): it must be short and never wait. Nothing by default.
    fn work_after_answer(&self) {}

    /// What decoding one request to this handler may allocate, if it serves only
    /// requests smaller than [`RpcServerConfig::decode_limits`] allow: a request over
    /// them is refused before it is decoded whole. `None` (the default): the
    /// server's.
    fn decode_limits(&self) -> Option<DecodeLimits> {
        None
    }
}

/// Counters of the RPC server.
#[derive(Debug)]
pub struct RpcServerStats {
    /// Requests by kind (indexed like [`REQUEST_KINDS`]).
    pub ops_by_kind: [AtomicU64; REQUEST_KINDS.len()],
    /// Error answers by kind (indexed like [`REQUEST_KINDS`]).
    pub errors_by_kind: [AtomicU64; REQUEST_KINDS.len()],
    /// Requests answered (the handler's calls: `LocalEndpoint`, part of setting a
    /// connection up, is counted only in [`ops_by_kind`](Self::ops_by_kind)).
    pub requests: AtomicU64,
    /// Requests answered with an error.
    pub errors: AtomicU64,
    /// Connections closed because of a malformed frame.
    pub bad_frames: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections open now.
    pub open_connections: AtomicU64,
    /// Connections refused at once: protected mode, or over the connection limit.
    pub refused_connections: AtomicU64,
    /// Connections closed for not completing their hello (the shared-secret
    /// handshake, or a first frame) in time.
    pub hello_timeouts: AtomicU64,
    /// Connections closed while still in their handshake to make room for a newer one
    /// (more than [`MAX_UNAUTHENTICATED`](crate::rpc::MAX_UNAUTHENTICATED) waited).
    pub crowded_out: AtomicU64,
    /// Connections that failed the shared-secret handshake.
    pub auth_failures: AtomicU64,
    /// Connections closed for holding part of a frame without sending more of it for
    /// [`RpcServerConfig::frame_timeout`], for not sending the whole frame by its
    /// deadline (see [`RpcServerConfig::min_frame_rate`]), or for not reading any of
    /// their pending response for [`RpcServerConfig::frame_timeout`].
    pub frame_timeouts: AtomicU64,
    /// Requests whose handler panicked: answered with an error, and the connection
    /// and the server went on.
    pub handler_panics: AtomicU64,
    /// Bytes of request bodies reserved now, for frames being read or answered (within
    /// [`RpcServerConfig::memory_budget`]): a frame's whole announced body from its
    /// header on, though the memory itself is taken only as its bytes arrive. Small
    /// bodies (64 KiB at most) are counted here but not against the budget.
    pub buffered_bytes: AtomicU64,
    /// Requests answered with an error, unanswered, because decoding them would
    /// allocate more than [`RpcServerConfig::decode_limits`] allow, or the
    /// [`RpcServerConfig::decode_budget`] had no room for them in time.
    pub over_budget: AtomicU64,
    /// Bytes held now for decoded requests being answered (within
    /// [`RpcServerConfig::decode_budget`]).
    pub decoding_bytes: AtomicU64,
}

impl Default for RpcServerStats {
    fn default() -> Self {
        Self {
            ops_by_kind: std::array::from_fn(|_| AtomicU64::new(0)),
            errors_by_kind: std::array::from_fn(|_| AtomicU64::new(0)),
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            bad_frames: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            open_connections: AtomicU64::new(0),
            refused_connections: AtomicU64::new(0),
            hello_timeouts: AtomicU64::new(0),
            crowded_out: AtomicU64::new(0),
            auth_failures: AtomicU64::new(0),
            frame_timeouts: AtomicU64::new(0),
            handler_panics: AtomicU64::new(0),
            buffered_bytes: AtomicU64::new(0),
            over_budget: AtomicU64::new(0),
            decoding_bytes: AtomicU64::new(0),
        }
    }
}

/// Limits and access rules of an [`RpcServer`](crate::rpc::RpcServer).
#[derive(Clone, Debug)]
pub struct RpcServerConfig {
    /// Largest frame body accepted; also the most request bytes one connection holds.
    pub max_frame: u32,
    /// Secret every client must prove before its first request; the server proves
    /// it first (mutual authentication, see [`SharedSecret`]).
    pub secret: Option<SharedSecret>,
    /// Names the server proves the secret for besides the address a client connected
    /// to (the address it advertises, when clients reach it through a translation).
    pub names: Vec<String>,
    /// Serve clients on any address without a secret. Off by default (protected
    /// mode): without a secret, only loopback clients are served.
    pub insecure: bool,
    /// Most connections open at once; beyond it, new ones are refused with a message.
    pub max_connections: usize,
    /// Most bytes of request bodies held in memory over all connections. A frame
    /// reserves its whole body from its header on, before any body byte is read, and
    /// keeps it until it is answered, so a frame that starts can always finish (and
    /// give its bytes back). A connection whose frame does not fit waits, holding no
    /// body byte, in the order the frames arrived: a large frame is not overtaken by
    /// smaller ones indefinitely. A frame larger than the whole budget (possible when
    /// [`max_frame`](Self::max_frame) is larger) proceeds once nothing else is
    /// reserved. Bodies of at most 64 KiB (a read's worth, which a connection may
    /// hold unparsed anyway) are neither counted against the budget nor made to wait:
    /// heartbeats and lookups do not queue behind large requests.
    pub memory_budget: usize,
    /// What decoding one request may allocate (items, and bytes charged: see
    /// [`budget`](crate::rpc::budget)); a request over them is answered with an
    /// `InvalidArgument` error, and the connection goes on.
    pub decode_limits: DecodeLimits,
    /// Most bytes charged for decoded requests over all those being answered at once;
    /// a request that finds no room waits up to [`decode_wait`](Self::decode_wait),
    /// then is answered with a "server busy" error.
    pub decode_budget: usize,
    /// How long a request waits for room in [`decode_budget`](Self::decode_budget).
    pub decode_wait: Duration,
    /// How long a new connection has to complete its hello: the shared-secret
    /// handshake, or (without a secret) its first request.
    pub hello_timeout: Duration,
    /// How long a connection may hold part of a frame without sending more of it
    /// before it is closed (the bytes it held go back to
    /// [`memory_budget`](Self::memory_budget)): a peer that stops halfway must not
    /// keep the budget from the others. Time spent waiting for budget does not count.
    /// A connection with a response to write that takes none of it for this long is
    /// closed too: a client that does not read its answers must not keep them in
    /// memory forever.
    pub frame_timeout: Duration,
    /// The slowest a frame's body may arrive, in bytes a second, once it has its share
    /// of [`memory_budget`](Self::memory_budget): a frame not read whole within
    /// [`frame_timeout`](Self::frame_timeout) plus its body's length at this rate is
    /// closed, so a peer trickling bytes just often enough cannot hold its share
    /// forever. 4 MiB/s by default (a 64 MiB frame gets 36 s with the default
    /// timeout); 0 turns the deadline off.
    pub min_frame_rate: u64,
    /// Threads serving requests kept ready, polling or answering (0: one per core, at
    /// least 2, at most 16).
    pub workers: usize,
    /// Most threads: a request that blocks (a put waiting for an offload) holds one,
    /// and another is started when none is left to poll the connections. With every
    /// one answering a request, connections wait until one is free.
    pub max_workers: usize,
    /// How long the thread that answered a request keeps polling the connections
    /// without sleeping before it waits for the next one: a client in the middle of
    /// an exchange (a put's `put_end`) is then read without a wakeup, which costs as
    /// much as the round trip itself on many hosts. It burns that much CPU after a
    /// request when no other comes. Default: `MOONCAKE_SERVER_SPIN_US` if set, else
    /// [`DEFAULT_SERVER_SPIN`].
    pub spin: Duration,
    /// Also listen on an abstract Unix socket with a random name, told to clients
    /// that ask over TCP from the same host: a client on the server's host then sends its
    /// requests there, at half the round trip of loopback TCP (see
    /// `rpc::socket`). Default: on, unless `MOONCAKE_RPC_UNIX=0`.
    pub local_socket: bool,
}

/// How long an RPC server's thread polls for the next request after answering
/// one, unless `MOONCAKE_SERVER_SPIN_US` says otherwise.
pub const DEFAULT_SERVER_SPIN: Duration = Duration::from_micros(100);

/// The server's polling budget of this process: `MOONCAKE_SERVER_SPIN_US`
/// (microseconds; `0` never polls), else [`DEFAULT_SERVER_SPIN`]. Read once.
fn server_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| mooncake_transfer::spin_from_env("MOONCAKE_SERVER_SPIN_US", DEFAULT_SERVER_SPIN))
}

/// Whether this process's RPC servers listen, and its clients connect, on Unix
/// sockets for peers of their host: unless `MOONCAKE_RPC_UNIX` is `0` (a way
/// back to loopback TCP only). Read once.
pub(crate) fn local_sockets_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOONCAKE_RPC_UNIX").map_or(true, |v| v.trim() != "0"))
}

impl Default for RpcServerConfig {
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
            secret: None,
            names: Vec::new(),
            insecure: false,
            max_connections: 65_536,
            memory_budget: 1 << 30,
            decode_limits: DecodeLimits::REQUEST,
            decode_budget: 512 << 20,
            decode_wait: Duration::from_secs(1),
            hello_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(20),
            min_frame_rate: 4 << 20,
            workers: 0,
            max_workers: 256,
            spin: server_spin(),
            local_socket: local_sockets_enabled(),
        }
    }
}
