//! The `Tcp` transport: a listener per engine serving its regions, and a client with
//! pooled, pipelined connections per peer that stripes large requests.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::{Capabilities, OnLanded, TransferOp, TransferRequest, Transport, TransportStats};
use crate::answer_wait::{answer_spin, read_polling};
use crate::auth::{admits_peer, decode_refusal, encode_refusal, read_up_to, SharedSecret, PROTECTED_MODE_REFUSAL};
use crate::error::{Result, TransferError};
use crate::frame::{
    FrameOp, FrameStatus, RequestHeader, ResponseHeader, AUTH_MAGIC, MAX_HANDSHAKE_BYTES, MAX_REQUEST_BYTES,
    REFUSE_MAGIC, REQUEST_HEADER_LEN, RESPONSE_HEADER_LEN,
};
use crate::handshake::{ControlChannel, ControlResponder, ShmInfo};
use crate::registry::RegionRegistry;
use crate::warn_limit::WarnLimiter;

/// Requests larger than this are cut into chunks spread over several connections.
const STRIPE: usize = 1 << 20;
/// Most connections used in parallel for one peer's share of a batch.
const MAX_LANES: usize = 4;

/// Connections used in parallel: one per core (2..=4); more only adds contention
/// for the cores that copy the bytes in and out of the kernel.
fn lanes() -> usize {
    static LANES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *LANES.get_or_init(|| std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, MAX_LANES))
}
/// Requests in flight on one connection before responses are read.
const WINDOW: usize = 128;

/// Most connections that have not authenticated yet (or, without a secret, not sent
/// their first request), each with its thread. Beyond it the oldest is closed to make
/// room: a flood of idle sockets costs a bounded number of threads and descriptors,
/// and a real peer, whose handshake takes a round trip, still gets in.
pub(crate) const MAX_UNAUTHENTICATED: usize = 64;

/// Most connections a listener serves at once, authenticated or not, each with its
/// thread. Beyond it the oldest unauthenticated one is closed to make room, else
/// the one idle longest between requests (a client's pooled connection: it dials
/// again when it needs one); only when every one is in a request is a new
/// connection refused (with a message) until one closes. Idle ones are also closed
/// after [`IDLE_TIMEOUT`].
pub(crate) const MAX_CONNECTIONS: usize = 1024;

/// A served connection that sends no request for this long is closed (its thread
/// ends). Clients pool idle connections, and dial a fresh one when a pooled one
/// turns out closed: only connections nobody uses go.
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(300);

/// A served connection: its stream, and since when (ms, [`served_clock_ms`]) it
/// waits for a request, [`BUSY`] while it reads or answers one.
type Served = (TcpStream, Arc<AtomicU64>);

/// A served connection that is reading or answering a request.
const BUSY: u64 = u64::MAX;

/// Milliseconds since the first call: when served connections went idle.
fn served_clock_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64
}

/// At [`MAX_CONNECTIONS`]: closes the connection idle longest between requests (a
/// client's pooled connection, which it dials again when it needs one), so that a
/// new client is served rather than refused. False if every connection is in a
/// request.
fn close_longest_idle(conns: &Mutex<HashMap<u64, Served>>) -> bool {
    let mut conns = conns.lock();
    let idlest = conns
        .iter()
        .map(|(&id, (_, since))| (since.load(Ordering::Relaxed), id))
        .filter(|&(since, _)| since != BUSY)
        .min();
    match idlest.and_then(|(_, id)| conns.remove(&id)) {
        Some((c, _)) => {
            let _ = c.shutdown(std::net::Shutdown::Both);
            true
        }
        None => false,
    }
}

/// How long one write of an answer may block (a peer that stopped reading the
/// bytes it asked for): then the connection is closed, as a client gives up on a
/// peer that stops reading its requests (`PEER_TIMEOUT`).
pub(crate) const SERVE_WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// What a listener lets its peers hold ([`MAX_CONNECTIONS`], [`IDLE_TIMEOUT`],
/// [`SERVE_WRITE_TIMEOUT`] by default).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServeLimits {
    pub(crate) max_connections: usize,
    pub(crate) idle_timeout: Duration,
    pub(crate) write_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        Self { max_connections: MAX_CONNECTIONS, idle_timeout: IDLE_TIMEOUT, write_timeout: SERVE_WRITE_TIMEOUT }
    }
}

/// Serves an engine's regions to TCP peers; stops when the engine is dropped (its
/// listener is woken and closed, and every open connection is shut down).
pub(crate) struct TcpServer {
    stop: Arc<AtomicBool>,
    addr: std::net::SocketAddr,
    conns: Arc<Mutex<HashMap<u64, Served>>>,
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so that it sees `stop` and drops the listener.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
        for (_, (conn, _)) in self.conns.lock().drain() {
            let _ = conn.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Connections not authenticated yet, oldest first (their ids; the streams are in
/// the server's connection table).
type Pending = Arc<Mutex<std::collections::VecDeque<u64>>>;

/// The listener's warnings, each held back while it repeats.
#[derive(Default)]
struct Warnings {
    protected: WarnLimiter,
    auth: WarnLimiter,
    crowded: WarnLimiter,
    full: WarnLimiter,
    closed: WarnLimiter,
}

impl TcpServer {
    /// Binds `listener` and serves `regions` on background threads. Without a
    /// secret, and unless `insecure`, only loopback peers are served (protected mode).
    /// `names`: what the listener proves it is called besides its socket address
    /// (the engine's endpoint). `limits`: what its peers may hold.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn start(
        listener: TcpListener,
        regions: Weak<RegionRegistry>,
        host_id: String,
        secret: Option<SharedSecret>,
        insecure: bool,
        responder: Option<Arc<dyn ControlResponder>>,
        names: Vec<String>,
        limits: ServeLimits,
    ) -> Result<Self> {
        let addr = listener.local_addr().map_err(|e| TransferError::Io(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: Arc<Mutex<HashMap<u64, Served>>> = Arc::default();
        let (stop2, conns2) = (stop.clone(), conns.clone());
        let host_id: Arc<str> = host_id.into();
        let names: Arc<[String]> = names.into();
        let pending: Pending = Arc::default();
        let warnings = Arc::new(Warnings::default());
        std::thread::Builder::new()
            .name("mooncake-tcp-accept".into())
            .spawn(move || {
                let mut next_conn = 0u64;
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        return;
                    }
                    let conn = match conn {
                        Ok(c) => c,
                        Err(e) => {
                            // Out of descriptors and the like: don't spin.
                            warnings.crowded.warn(format_args!("accepting a transfer connection: {e}"));
                            std::thread::sleep(Duration::from_millis(10));
                            continue;
                        }
                    };
                    let peer = conn.peer_addr().ok();
                    if peer.is_some_and(|p| !admits_peer(p.ip(), secret.is_some(), insecure)) {
                        warnings
                            .protected
                            .warn(format_args!("protected mode: refusing a non-loopback transfer peer ({peer:?})"));
                        let _ = conn.set_nonblocking(true);
                        let _ = (&conn).write(&encode_refusal(PROTECTED_MODE_REFUSAL));
                        continue;
                    }
                    // A client host that vanishes never closes its connections: the
                    // kernel's probes end them, and the thread serving each.
                    keep_alive(&conn);
                    next_conn += 1;
                    let id = next_conn;
                    let idle = Arc::new(AtomicU64::new(BUSY));
                    {
                        // Room for one more unauthenticated connection, and for one more
                        // connection: the oldest waiting to authenticate goes.
                        let mut waiting = pending.lock();
                        let full = |waiting: &std::collections::VecDeque<u64>| {
                            waiting.len() >= MAX_UNAUTHENTICATED || conns2.lock().len() >= limits.max_connections
                        };
                        while full(&waiting) {
                            let Some(oldest) = waiting.pop_front() else { break };
                            if let Some((c, _)) = conns2.lock().remove(&oldest) {
                                let _ = c.shutdown(std::net::Shutdown::Both);
                            }
                            warnings.crowded.warn(format_args!(
                                "transfer connections waiting to authenticate crowd the listener: closing the oldest"
                            ));
                        }
                        if conns2.lock().len() >= limits.max_connections && !close_longest_idle(&conns2) {
                            // Every connection is authenticated and in a request: this
                            // one waits for one to close.
                            warnings.full.warn(format_args!(
                                "{} transfer connections open: refusing one more ({peer:?})",
                                limits.max_connections
                            ));
                            let _ = conn.set_nonblocking(true);
                            let _ = (&conn).write(&encode_refusal(TOO_MANY_CONNECTIONS));
                            continue;
                        }
                        match conn.try_clone() {
                            Ok(c) => {
                                conns2.lock().insert(id, (c, idle.clone()));
                                waiting.push_back(id);
                            }
                            // Out of descriptors: this one cannot be tracked, so not served.
                            Err(_) => continue,
                        }
                    }
                    let (regions, stop, host_id) = (regions.clone(), stop2.clone(), host_id.clone());
                    let (secret, conns, responder) = (secret.clone(), conns2.clone(), responder.clone());
                    let (names, waiting, warned) = (names.clone(), pending.clone(), warnings.clone());
                    let spawned = std::thread::Builder::new().name("mooncake-tcp-conn".into()).spawn(move || {
                        let (pending, warnings) = (waiting, warned);
                        let authenticated = || pending.lock().retain(|&p| p != id);
                        let admitted = match &secret {
                            Some(s) => admit(s, &conn, &names, &warnings),
                            None => true,
                        };
                        if admitted {
                            if secret.is_some() {
                                authenticated();
                            }
                            let result = serve(
                                &conn,
                                &regions,
                                &stop,
                                &host_id,
                                (secret.is_some(), &limits),
                                responder.as_deref(),
                                (&authenticated, &idle),
                            );
                            if let Err(e) = result {
                                warnings.closed.warn(format_args!("closing transfer connection ({peer:?}): {e}"));
                            }
                        }
                        pending.lock().retain(|&p| p != id);
                        conns.lock().remove(&id);
                    });
                    if spawned.is_err() {
                        warnings.crowded.warn(format_args!("cannot start a transfer connection thread"));
                        pending.lock().retain(|&p| p != id);
                        conns2.lock().remove(&id);
                    }
                }
            })
            .map_err(|e| TransferError::Io(format!("cannot start the transfer server: {e}")))?;
        Ok(Self { stop, addr, conns })
    }
}

/// Accepting side of the handshake ([`SharedSecret::admit`]). A refused peer's
/// pending bytes are drained briefly before the close so that it reads the verdict
/// rather than a reset.
fn admit(secret: &SharedSecret, conn: &TcpStream, names: &[String], warnings: &Warnings) -> bool {
    let peer = conn.peer_addr().ok();
    match secret.admit(conn, names) {
        Ok(()) => true,
        Err(why) => {
            warnings.auth.warn(format_args!("transfer peer {peer:?} failed the shared-secret handshake: {why:?}"));
            let _ = conn.shutdown(std::net::Shutdown::Write);
            let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
            let _ = std::io::copy(&mut (&mut &*conn).take(1 << 20), &mut std::io::sink());
            false
        }
    }
}

fn io(e: std::io::Error) -> TransferError {
    TransferError::Io(e.to_string())
}

fn status_of(e: &TransferError) -> FrameStatus {
    match e {
        TransferError::OutOfBounds { .. } => FrameStatus::OutOfBounds,
        TransferError::UnknownRegion { .. } => FrameStatus::UnknownRegion,
        _ => FrameStatus::Refused,
    }
}

fn respond(w: &mut impl Write, status: FrameStatus, request_id: u64, len: u64) -> Result<()> {
    w.write_all(&ResponseHeader { status, request_id, len }.encode()).map_err(io)
}

/// Writes a frame's header and its payload with one `writev` where the payload is
/// large (through a `BufWriter`, whatever it holds goes first): two sends would put
/// the header in a segment of its own and wake the peer for it alone.
fn write_frame(w: &mut impl Write, header: &[u8], payload: &[u8]) -> std::io::Result<()> {
    let mut bufs = [std::io::IoSlice::new(header), std::io::IoSlice::new(payload)];
    let mut bufs = &mut bufs[..];
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How long a new connection may take to send its first request.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// What a peer refused for [`MAX_CONNECTIONS`] is told.
const TOO_MANY_CONNECTIONS: &str = "too many transfer connections open at this listener: try again later";

/// Whether `e` is a socket timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO` ran out).
fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
}

/// One connection: requests answered in order. Write payloads go from the socket
/// straight into the region, so a peer's announced lengths never size a buffer.
/// Closed quietly once idle for `limits.idle_timeout` between requests; a write of
/// an answer blocked for `limits.write_timeout` fails it.
fn serve(
    conn: &TcpStream,
    regions: &Weak<RegionRegistry>,
    stop: &AtomicBool,
    host_id: &str,
    (authenticated, limits): (bool, &ServeLimits),
    responder: Option<&dyn ControlResponder>,
    (first_request, idle_since): (&dyn Fn(), &AtomicU64),
) -> Result<()> {
    let _ = conn.set_nodelay(true);
    // Kept for the connection's life (the handshake's timeouts end with it): a peer
    // that stops reading what it asked for frees its thread.
    let _ = conn.set_write_timeout(Some(limits.write_timeout));
    // Buffered for headers; payloads larger than the buffer bypass it (`BufReader`
    // reads big requests straight into the destination slice). Small, because a
    // header read fills the buffer with whatever follows it, typically the start of
    // a large write's payload, which then takes an extra copy out of the buffer:
    // with 256 KiB this doubled the receiving side's copies for 256 KiB writes
    // (measured: 7.3 ms of CPU per 16 MiB batch of puts, 3.5 ms after). 16 KiB still
    // takes hundreds of pipelined read headers, or a few small writes, per call.
    let mut r = BufReader::with_capacity(16 << 10, conn);
    let mut w = BufWriter::with_capacity(256 << 10, conn);
    let mut header = [0u8; REQUEST_HEADER_LEN];
    if !authenticated {
        if !first_request_arrives(conn, &mut r, &mut header)? {
            return Ok(());
        }
        first_request();
    }
    let _ = conn.set_read_timeout(Some(limits.idle_timeout));
    let mut have_header = !authenticated;
    loop {
        let got = if std::mem::take(&mut have_header) {
            Ok(())
        } else {
            // Waiting on the socket for the next request: the listener may close this
            // connection to make room (`close_longest_idle`); the client redials.
            if r.buffer().is_empty() {
                idle_since.store(served_clock_ms(), Ordering::Relaxed);
            }
            let got = r.read_exact(&mut header);
            idle_since.store(BUSY, Ordering::Relaxed);
            got
        };
        match got {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            // Idle for the whole timeout: the client redials when it needs one.
            Err(e) if timed_out(&e) => return Ok(()),
            Err(e) => return Err(io(e)),
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let h = RequestHeader::decode(&header).map_err(|e| TransferError::Protocol(e.to_string()))?;
        let Some(regions) = regions.upgrade() else { return Ok(()) };
        let region = regions.region(h.region).and_then(|reg| reg.check_bounds(h.offset, h.len).map(|_| reg));
        match (h.op, region) {
            (FrameOp::Read, Ok(reg)) => {
                let header = ResponseHeader { status: FrameStatus::Ok, request_id: h.request_id, len: h.len }.encode();
                reg.drain_to(h.offset, h.len, &mut |payload: &[u8]| write_frame(&mut w, &header, payload))?;
            }
            (FrameOp::Write, Ok(reg)) if !reg.peers_may_write() => {
                // A read-only region (an SSD tier's staging buffer): refused before
                // one byte was stored; the payload is skipped to stay in sync.
                std::io::copy(&mut (&mut r).take(h.len), &mut std::io::sink()).map_err(io)?;
                respond(&mut w, FrameStatus::Refused, h.request_id, 0)?;
            }
            (FrameOp::Write, Ok(reg)) => {
                reg.fill_from(h.offset, h.len, &mut r)?;
                respond(&mut w, FrameStatus::Ok, h.request_id, 0)?;
            }
            (FrameOp::Write, Err(e)) => {
                // Refused before one byte was stored; skip the payload to stay in sync.
                std::io::copy(&mut (&mut r).take(h.len), &mut std::io::sink()).map_err(io)?;
                respond(&mut w, status_of(&e), h.request_id, 0)?;
            }
            (FrameOp::Read, Err(e)) => respond(&mut w, status_of(&e), h.request_id, 0)?,
            (FrameOp::ShmInfo, _) => {
                // Regions are looked up without the bounds of the request (len is 0).
                match regions.region(h.region) {
                    Ok(reg) => match reg.shared_fd() {
                        Some((fd, ino)) => {
                            let payload = ShmInfo::encode(reg.len(), fd, ino, host_id);
                            respond(&mut w, FrameStatus::Ok, h.request_id, payload.len() as u64)?;
                            w.write_all(&payload).map_err(io)?;
                        }
                        None => respond(&mut w, FrameStatus::Refused, h.request_id, 0)?,
                    },
                    Err(e) => respond(&mut w, status_of(&e), h.request_id, 0)?,
                }
            }
            (FrameOp::Hello, _) => {
                respond(&mut w, FrameStatus::Ok, h.request_id, host_id.len() as u64)?;
                w.write_all(host_id.as_bytes()).map_err(io)?;
            }
            (FrameOp::RdmaConnect | FrameOp::RdmaRegion, _) => {
                let mut payload = vec![0u8; h.len as usize];
                r.read_exact(&mut payload).map_err(io)?;
                let region = if h.op == FrameOp::RdmaRegion { regions.region(h.region).ok() } else { None };
                let answer = match responder {
                    Some(rdma) => rdma.answer(h.op, region, &payload),
                    None => Err(FrameStatus::Refused),
                };
                match answer {
                    Ok(p) => {
                        respond(&mut w, FrameStatus::Ok, h.request_id, p.len() as u64)?;
                        w.write_all(&p).map_err(io)?;
                    }
                    Err(status) => respond(&mut w, status, h.request_id, 0)?,
                }
            }
        }
        // Answer now unless the peer already pipelined more requests.
        if r.buffer().is_empty() {
            w.flush().map_err(io)?;
        }
    }
}

/// The first request of a connection without a secret, read within
/// [`HELLO_TIMEOUT`] into `header`; `false` (after answering with a refusal) if the
/// peer started a shared-secret handshake this listener cannot complete, or sent
/// nothing in time.
fn first_request_arrives(conn: &TcpStream, r: &mut impl Read, header: &mut [u8; REQUEST_HEADER_LEN]) -> Result<bool> {
    let _ = conn.set_read_timeout(Some(HELLO_TIMEOUT));
    let n = read_up_to(&mut *r, &mut header[..4]).map_err(io)?;
    if n < 4 {
        return Ok(false);
    }
    if header[..4] == AUTH_MAGIC {
        let refusal = "this listener has no shared secret but the peer proved one: set the same MOONCAKE_SECRET \
             on every process";
        let _ = (&mut &*conn).write_all(&encode_refusal(refusal));
        return Ok(false);
    }
    r.read_exact(&mut header[4..]).map_err(io)?;
    Ok(true)
}

/// After this long idle, a served connection's peer is probed; after
/// [`KEEPALIVE_PROBES`] unanswered probes, [`KEEPALIVE_INTERVAL`] apart, the connection
/// fails (its thread ends and its descriptor is closed).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: i32 = 3;

/// Turns TCP keepalive on for `conn`, with the probes above (best effort: a socket
/// that refuses keeps the kernel's defaults).
fn keep_alive(conn: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = conn.as_raw_fd();
    let set = |level: i32, name: i32, value: i32| {
        // SAFETY: `fd` is a socket `conn` keeps open for the call; the option value is
        // a live `c_int` whose size is passed with it.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const i32).cast(),
                std::mem::size_of::<i32>() as libc::socklen_t,
            )
        }
    };
    set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE.as_secs() as i32);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, KEEPALIVE_INTERVAL.as_secs() as i32);
    set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_PROBES);
}

/// One connection to a peer.
struct Conn {
    stream: TcpStream,
    next_id: u64,
}

/// Reaches peers' regions over TCP: pooled connections per peer, requests to one peer
/// pipelined, requests over 1 MiB striped over up to four connections, bytes read
/// from the socket straight into the destination.
#[derive(Debug, Default)]
pub struct TcpTransport {
    pools: Mutex<HashMap<String, Vec<TcpStream>>>,
    stats: TransportStats,
    secret: Option<SharedSecret>,
    /// How long one read or one write of a connection may block (`None`:
    /// `PEER_TIMEOUT`).
    io_timeout: Option<Duration>,
}

/// How long one read or one write to a peer may block before the connection is
/// given up as broken (a peer that stopped reading, a host that vanished): the
/// transfer fails, or is tried again on a fresh connection, instead of hanging.
const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// How a chunk went: its result, and its crc32c if it was asked for and taken.
type ChunkOutcome = (Result<()>, Option<u32>);

/// A piece of a request moved on one connection.
struct Chunk<'a> {
    req: usize,
    region: u64,
    offset: u64,
    op: TransferOp<'a>,
    /// Whether to take the crc32c of the piece as it passes (into `crc`).
    sum: bool,
    crc: Option<u32>,
    /// A read's hook for the ranges that landed, and where the chunk starts in its
    /// request.
    landed: Option<(OnLanded<'a>, u64)>,
}

/// The ranges a read with an [`OnLanded`] hook is told of: small enough that the
/// caller's work on one (a DMA) overlaps the receipt of the next, large enough that
/// telling costs nothing beside the bytes.
const LANDED_PIECE: usize = 256 << 10;

impl Chunk<'_> {
    /// Takes the piece's crc32c if asked: right before its bytes are sent, or right
    /// after they arrived, while they are in the cache.
    fn take_sum(&mut self) {
        if self.sum {
            self.crc = Some(crate::checksum::crc32c(match &self.op {
                TransferOp::Read(b) => b,
                TransferOp::Write(b) => b,
            }));
        }
    }
}

impl TcpTransport {
    /// A transport with empty pools.
    pub fn new() -> Self {
        Self::default()
    }

    /// A transport that proves `secret` to every peer it connects to (peers built
    /// with the same [`shared_secret`](crate::TransferEngineBuilder::shared_secret)).
    pub fn with_secret(secret: SharedSecret) -> Self {
        Self { secret: Some(secret), ..Self::default() }
    }

    /// This transport with another limit than 30 s on how long one read or one write
    /// of a connection may block before the connection is given up as broken (at
    /// least 1 ms).
    pub fn with_io_timeout(mut self, timeout: Duration) -> Self {
        self.io_timeout = Some(timeout.max(Duration::from_millis(1)));
        self
    }

    /// Byte and error counters.
    pub fn stats(&self) -> &TransportStats {
        &self.stats
    }

    fn connect(&self, endpoint: &str) -> Result<TcpStream> {
        if let Some(s) = self.pools.lock().get_mut(endpoint).and_then(Vec::pop) {
            return Ok(s);
        }
        let addr = endpoint
            .to_socket_addrs()
            .map_err(|e| TransferError::UnknownEndpoint(format!("{endpoint}: {e}")))?
            .next()
            .ok_or_else(|| TransferError::UnknownEndpoint(endpoint.to_owned()))?;
        let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .map_err(|e| TransferError::Unreachable(format!("{endpoint}: {e}")))?;
        let _ = s.set_nodelay(true);
        if let Some(secret) = &self.secret {
            secret.prove(&s, endpoint).map_err(TransferError::Auth)?;
        }
        // Both ways: a peer that stops reading (paused, wedged) would otherwise hold
        // a write, and every lane of its transfer, for as long as it stays so.
        let timeout = self.io_timeout.unwrap_or(PEER_TIMEOUT);
        let _ = s.set_read_timeout(Some(timeout));
        let _ = s.set_write_timeout(Some(timeout));
        Ok(s)
    }

    fn give_back(&self, endpoint: &str, s: TcpStream) {
        let mut pools = self.pools.lock();
        let pool = pools.entry(endpoint.to_owned()).or_default();
        if pool.len() < 2 * MAX_LANES {
            pool.push(s);
        }
    }

    /// Runs chunks on one connection, pipelined; returns one result per chunk. A
    /// broken connection (a pooled one may be stale: the peer restarted) is retried
    /// once on a fresh one; reads and writes are idempotent. `poll`: answers are
    /// polled for before the lane sleeps (see `answer_wait`).
    fn run_lane(&self, endpoint: &str, chunks: &mut [Chunk<'_>], poll: bool) -> Vec<Result<()>> {
        let first = self.run_lane_once(endpoint, chunks, poll);
        if first.iter().any(|r| matches!(r, Err(TransferError::Io(_)) | Err(TransferError::Protocol(_)))) {
            self.pools.lock().remove(endpoint);
            return self.run_lane_once(endpoint, chunks, poll);
        }
        first
    }

    fn run_lane_once(&self, endpoint: &str, chunks: &mut [Chunk<'_>], poll: bool) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = Vec::with_capacity(chunks.len());
        let stream = match self.connect(endpoint) {
            Ok(s) => s,
            Err(e) => return chunks.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut conn = Conn { stream, next_id: 1 };
        let mut broken = None;
        for window in windows(chunks) {
            if let Some(e) = &broken {
                results.extend(window.iter().map(|_| Err(TransferError::clone(e))));
                continue;
            }
            match self.pipeline(&mut conn, window, poll) {
                Ok(r) => results.extend(r),
                Err(e) => {
                    results.extend(window.iter().map(|_| Err(e.clone())));
                    broken = Some(e);
                }
            }
        }
        if broken.is_none() {
            self.give_back(endpoint, conn.stream);
        }
        results
    }

    /// Sends every request of `window`, then reads every response. Windows never
    /// hold a Write after a Read (see [`windows`]), so the peer never blocks sending
    /// read data while this side still sends a payload.
    fn pipeline(&self, conn: &mut Conn, window: &mut [Chunk<'_>], poll: bool) -> Result<Vec<Result<()>>> {
        let first_id = conn.next_id;
        {
            let mut w = BufWriter::with_capacity(64 << 10, &conn.stream);
            for c in window.iter_mut() {
                if matches!(c.op, TransferOp::Write(_)) {
                    c.take_sum();
                }
                let (op, len, payload): (FrameOp, usize, Option<&[u8]>) = match &c.op {
                    TransferOp::Read(b) => (FrameOp::Read, b.len(), None),
                    TransferOp::Write(b) => (FrameOp::Write, b.len(), Some(b)),
                };
                let h =
                    RequestHeader { op, request_id: conn.next_id, region: c.region, offset: c.offset, len: len as u64 };
                conn.next_id += 1;
                match payload {
                    Some(p) => write_frame(&mut w, &h.encode(), p).map_err(io)?,
                    None => w.write_all(&h.encode()).map_err(io)?,
                }
            }
            w.flush().map_err(io)?;
        }
        let mut out = Vec::with_capacity(window.len());
        for (i, c) in window.iter_mut().enumerate() {
            let max = match &c.op {
                TransferOp::Read(b) => b.len() as u64,
                TransferOp::Write(_) => 0,
            };
            let h = read_response(&conn.stream, max, poll)?;
            if h.request_id != first_id + i as u64 {
                return Err(TransferError::Protocol("response out of order".into()));
            }
            out.push(match (h.status, &mut c.op) {
                (FrameStatus::Ok, TransferOp::Read(dst)) => {
                    if h.len != dst.len() as u64 {
                        return Err(TransferError::Protocol("short read".into()));
                    }
                    match c.landed {
                        None => (&conn.stream).read_exact(dst).map_err(io)?,
                        Some((hook, at)) => {
                            for (k, piece) in dst.chunks_mut(LANDED_PIECE).enumerate() {
                                (&conn.stream).read_exact(piece).map_err(io)?;
                                hook(at + (k * LANDED_PIECE) as u64, piece.len());
                            }
                        }
                    }
                    self.stats.bytes_read.fetch_add(h.len, Ordering::Relaxed);
                    c.take_sum();
                    Ok(())
                }
                (FrameStatus::Ok, TransferOp::Write(src)) => {
                    self.stats.bytes_written.fetch_add(src.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                (FrameStatus::OutOfBounds, op) => Err(TransferError::OutOfBounds {
                    region: c.region,
                    offset: c.offset,
                    len: op.len() as u64,
                    region_len: 0,
                }),
                (FrameStatus::UnknownRegion, _) => {
                    Err(TransferError::UnknownRegion { endpoint: String::new(), region: c.region })
                }
                // The one write a server refuses in bounds is one to a read-only region.
                (FrameStatus::Refused, TransferOp::Write(_)) => Err(TransferError::ReadOnly { region: c.region }),
                (FrameStatus::Refused, _) => Err(TransferError::Protocol("request refused".into())),
            });
        }
        Ok(out)
    }
}

impl TcpTransport {
    /// One control exchange on a connection from the pool (or a fresh one).
    fn control_once(&self, endpoint: &str, op: FrameOp, region: u64, payload: &[u8]) -> Result<(FrameStatus, Vec<u8>)> {
        let mut s = self.connect(endpoint)?;
        let h = RequestHeader { op, request_id: 1, region, offset: 0, len: payload.len() as u64 };
        let mut frame = h.encode().to_vec();
        frame.extend_from_slice(payload);
        s.write_all(&frame).map_err(io)?;
        let r = read_response(&s, MAX_HANDSHAKE_BYTES, true)?;
        let mut payload = vec![0u8; r.len as usize];
        s.read_exact(&mut payload).map_err(io)?;
        self.give_back(endpoint, s);
        Ok((r.status, payload))
    }
}

impl ControlChannel for TcpTransport {
    /// A one-request control exchange on a pooled connection. A pooled connection
    /// that turns out broken (the peer closed it idle, or restarted) is dropped with
    /// its pool and the exchange made once more on a fresh one, as for transfers.
    fn control_with(&self, endpoint: &str, op: FrameOp, region: u64, payload: &[u8]) -> Result<(FrameStatus, Vec<u8>)> {
        let pooled = self.pools.lock().get(endpoint).is_some_and(|p| !p.is_empty());
        match self.control_once(endpoint, op, region, payload) {
            Err(TransferError::Io(_)) if pooled => {
                self.pools.lock().remove(endpoint);
                self.control_once(endpoint, op, region, payload)
            }
            answer => answer,
        }
    }
}

/// Reads one response header (polled for a moment first when `poll`); a listener's
/// authentication challenge where a response was expected means the peer
/// requires a secret this side lacks.
fn read_response(stream: &TcpStream, max_len: u64, poll: bool) -> Result<ResponseHeader> {
    let mut header = [0u8; RESPONSE_HEADER_LEN];
    // Polled for a moment first (see `answer_wait`): a small answer usually
    // comes within it.
    let budget = if poll { answer_spin() } else { Duration::ZERO };
    let polled = read_polling(stream, &mut header, budget).map_err(io)?;
    let n = polled + read_up_to(stream, &mut header[polled..]).map_err(io)?;
    if n >= 4 && header[..4] == AUTH_MAGIC {
        return Err(TransferError::Auth("the peer requires a shared secret and this side has none".into()));
    }
    if n >= 4 && header[..4] == REFUSE_MAGIC {
        return Err(TransferError::Auth(format!(
            "the peer refused the connection: {}",
            decode_refusal(&header[4..n], stream)
        )));
    }
    if n < RESPONSE_HEADER_LEN {
        return Err(TransferError::Io(format!("connection closed after {n} bytes of a response header")));
    }
    ResponseHeader::decode(&header, max_len).map_err(|e| TransferError::Protocol(e.to_string()))
}

/// Cuts a lane's chunks into pipelined windows of at most [`WINDOW`] requests,
/// starting a new window at a Write that follows a Read: the peer sends read data
/// while this side still sends write payloads otherwise, and both could block on
/// full socket buffers.
fn windows<'c, 'a>(chunks: &'c mut [Chunk<'a>]) -> impl Iterator<Item = &'c mut [Chunk<'a>]> {
    let mut rest = chunks;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = 0;
        let mut seen_read = false;
        while end < rest.len() && end < WINDOW {
            match rest[end].op {
                TransferOp::Read(_) => seen_read = true,
                TransferOp::Write(_) if seen_read => break,
                TransferOp::Write(_) => {}
            }
            end += 1;
        }
        let (window, tail) = std::mem::take(&mut rest).split_at_mut(end);
        rest = tail;
        Some(window)
    })
}

impl Transport for TcpTransport {
    fn name(&self) -> &str {
        "tcp"
    }

    fn capabilities(&self, _endpoint: &str) -> Capabilities {
        Capabilities { maps_peer_memory: false, sums_in_flight: true, moves_device_memory: false }
    }

    fn stats(&self) -> Option<&TransportStats> {
        Some(&self.stats)
    }

    fn can_reach(&self, endpoint: &str) -> bool {
        // host:port endpoints; in-process engines use `local://`.
        !endpoint.contains("://") && endpoint.contains(':')
    }

    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = (0..requests.len()).map(|_| Ok(())).collect();
        // Group chunks by peer.
        let mut by_peer: HashMap<String, Vec<Chunk<'_>>> = HashMap::new();
        for (i, req) in requests.iter_mut().enumerate() {
            if req.op.len() as u64 > MAX_REQUEST_BYTES * 64 {
                results[i] = Err(TransferError::Protocol("request too large".into()));
                continue;
            }
            let (region, base, sum, hook) = (req.target.region, req.offset, req.checksum_asked(), req.landed_hook());
            let peer = by_peer.entry(req.target.endpoint.clone()).or_default();
            match &mut req.op {
                TransferOp::Read(dst) => {
                    for (k, piece) in dst.chunks_mut(STRIPE).enumerate() {
                        let at = (k * STRIPE) as u64;
                        let (offset, op, landed) =
                            (base.saturating_add(at), TransferOp::Read(piece), hook.map(|h| (h, at)));
                        peer.push(Chunk { req: i, region, offset, op, sum, crc: None, landed });
                    }
                }
                TransferOp::Write(src) => {
                    for (k, piece) in src.chunks(STRIPE).enumerate() {
                        let (offset, op) = (base.saturating_add((k * STRIPE) as u64), TransferOp::Write(piece));
                        peer.push(Chunk { req: i, region, offset, op, sum, crc: None, landed: None });
                    }
                }
            }
        }
        // One task per (peer, lane): a peer's chunks are dealt round-robin to as many
        // lanes (connections) as its bytes warrant, and all peers' lanes run at once.
        // Which request each chunk belongs to, and its length (a request's chunks
        // are consecutive here, in the order of their bytes).
        let mut owners: Vec<(usize, usize)> = Vec::new();
        let mut tasks: Vec<(&str, Vec<usize>, Vec<Chunk<'_>>)> = Vec::new();
        for (endpoint, chunks) in &mut by_peer {
            let bytes: usize = chunks.iter().map(|c| c.op.len()).sum();
            let lanes = lanes().min(bytes.div_ceil(STRIPE)).max(1);
            let first = tasks.len();
            tasks.extend((0..lanes).map(|_| (endpoint.as_str(), Vec::new(), Vec::new())));
            for (k, c) in std::mem::take(chunks).into_iter().enumerate() {
                let task = &mut tasks[first + k % lanes];
                task.1.push(owners.len());
                owners.push((c.req, c.op.len()));
                task.2.push(c);
            }
        }
        let mut outcome: Vec<Option<ChunkOutcome>> = (0..owners.len()).map(|_| None).collect();
        // A lane polls for its answers only when it is the transfer's one lane: lanes
        // waiting at once would take the cores their peers need to answer them (on
        // the VM a 4 MiB put's four polling lanes made it 1.2x slower).
        let poll = tasks.len() == 1;
        let run = |(endpoint, idx, mut chunks): (&str, Vec<usize>, Vec<Chunk<'_>>)| {
            let results = self.run_lane(endpoint, &mut chunks, poll);
            idx.into_iter().zip(results.into_iter().zip(chunks.iter().map(|c| c.crc))).collect::<Vec<_>>()
        };
        let done: Vec<Vec<(usize, ChunkOutcome)>> = if tasks.len() == 1 {
            tasks.into_iter().map(run).collect()
        } else {
            std::thread::scope(|scope| {
                let mut tasks = tasks.into_iter();
                let here = tasks.next();
                let handles: Vec<_> = tasks.map(|t| scope.spawn(move || run(t))).collect();
                let mut done: Vec<_> = here.into_iter().map(run).collect();
                done.extend(handles.into_iter().map(|h| h.join().unwrap_or_default()));
                done
            })
        };
        for (k, r) in done.into_iter().flatten() {
            outcome[k] = Some(r);
        }
        // Each request's crc32c from its chunks' (all of them taken, in order).
        let mut sums: Vec<Option<Vec<(u32, usize)>>> =
            requests.iter().map(|r| r.checksum_asked().then(Vec::new)).collect();
        for (k, r) in outcome.into_iter().enumerate() {
            let (req, len) = owners[k];
            let (res, crc) = r.unwrap_or_else(|| (Err(TransferError::Io("lane lost".into())), None));
            match (crc, &mut sums[req]) {
                (Some(crc), Some(pieces)) => pieces.push((crc, len)),
                (None, sum) => *sum = None,
                _ => {}
            }
            if let Err(e) = res {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                if results[req].is_ok() {
                    results[req] = Err(e);
                }
            }
        }
        for ((req, res), pieces) in requests.iter_mut().zip(&results).zip(sums) {
            if let (Ok(()), Some(pieces)) = (res, pieces) {
                req.set_checksum(crate::checksum::crc32c_concat(pieces));
            }
        }
        results
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::RemoteRegion;

    fn option(conn: &TcpStream, level: i32, name: i32) -> i32 {
        use std::os::fd::AsRawFd;
        let mut value: i32 = -1;
        let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
        // SAFETY: a socket `conn` keeps open, a live `c_int` and its size.
        let rc = unsafe { libc::getsockopt(conn.as_raw_fd(), level, name, (&mut value as *mut i32).cast(), &mut len) };
        assert_eq!(rc, 0);
        value
    }

    /// A served connection is probed once idle, so that a client host that vanished
    /// does not hold its thread forever.
    #[test]
    fn served_connections_are_probed_once_idle() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (conn, _) = l.accept().unwrap();
        assert_eq!(option(&conn, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0, "off by default");
        keep_alive(&conn);
        assert_eq!(option(&conn, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(option(&conn, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 60);
        assert_eq!(option(&conn, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 10);
        assert_eq!(option(&conn, libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 3);
    }

    /// A listener with `limits` serving one region of 64 MiB (its endpoint and
    /// region id); no secret, loopback peers.
    fn listener(limits: ServeLimits) -> (TcpServer, Arc<RegionRegistry>, String, u64) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = l.local_addr().unwrap().to_string();
        let regions = Arc::new(RegionRegistry::new(endpoint.clone(), false));
        let region = regions.register(64 << 20, true).unwrap().id();
        let server =
            TcpServer::start(l, Arc::downgrade(&regions), "host".into(), None, false, None, vec![], limits).unwrap();
        (server, regions, endpoint, region)
    }

    /// A raw connection that sent one request and read its answer: served, no
    /// longer waiting for its first request.
    fn served_connection(endpoint: &str) -> TcpStream {
        let mut s = TcpStream::connect(endpoint).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let h = RequestHeader { op: FrameOp::Hello, request_id: 1, region: 0, offset: 0, len: 0 };
        s.write_all(&h.encode()).unwrap();
        let mut head = [0u8; RESPONSE_HEADER_LEN];
        s.read_exact(&mut head).unwrap();
        let r = ResponseHeader::decode(&head, MAX_HANDSHAKE_BYTES).unwrap();
        let mut id = vec![0u8; r.len as usize];
        s.read_exact(&mut id).unwrap();
        assert_eq!(id, b"host");
        s
    }

    /// What a listener sends a new connection before anything is asked: a refusal's
    /// message, or `None` when it waits for a request.
    fn refusal(endpoint: &str) -> Option<String> {
        let s = TcpStream::connect(endpoint).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut magic = [0u8; 4];
        match (&s).read_exact(&mut magic) {
            Ok(()) => {
                assert_eq!(magic, REFUSE_MAGIC);
                Some(decode_refusal(&[], &s))
            }
            Err(e) if timed_out(&e) => None,
            Err(e) => panic!("{e}"),
        }
    }

    fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < until {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The listener serves at most `max_connections` at once: a connection waiting
    /// for its first request is closed to make room for a new one, else the one idle
    /// longest between requests; only when every one is in a request is one more
    /// refused with a message; a closed one frees its place.
    #[test]
    fn served_connections_are_capped() {
        let limits = ServeLimits { max_connections: 2, ..ServeLimits::default() };
        let (_server, _regions, endpoint, region) = listener(limits);
        let mut first = served_connection(&endpoint);
        let waiting = TcpStream::connect(&endpoint).unwrap();
        assert_eq!(refusal(&endpoint), None, "room: the connection waiting for its first request goes");
        let mut buf = [0u8; 1];
        waiting.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert_eq!((&waiting).read(&mut buf).unwrap_or(0), 0, "the waiting one was closed");
        // Full of connections idle between requests (pooled): a new client takes the
        // place of the one idle longest, which its client would dial again.
        let second = served_connection(&endpoint);
        let third = served_connection(&endpoint);
        assert_eq!(first.read(&mut buf).unwrap_or(0), 0, "the connection idle longest was closed");
        // Connections in a request (here: answers their clients do not read) keep
        // their places: a new one is refused, with a message.
        for s in [&second, &third] {
            let h = RequestHeader { op: FrameOp::Read, request_id: 2, region, offset: 0, len: 64 << 20 };
            let mut s = s;
            s.write_all(&h.encode()).unwrap();
        }
        std::thread::sleep(Duration::from_millis(100));
        let refused = refusal(&endpoint).expect("every connection in a request: refused");
        assert!(refused.contains("too many transfer connections"), "{refused}");
        let err = TcpTransport::new().control(&endpoint, FrameOp::Hello, 0).unwrap_err();
        assert!(matches!(&err, TransferError::Auth(m) if m.contains("too many")), "{err}");
        drop((second, third));
        assert!(eventually(|| refusal(&endpoint).is_none()), "a closed connection frees its place");
    }

    /// A peer that asks for bytes and stops reading them holds its connection only
    /// until a write of the answer times out; an idle connection goes after the
    /// idle timeout. Either frees its place (here the only one).
    #[test]
    fn stalled_and_idle_connections_are_closed() {
        let limits = ServeLimits {
            max_connections: 1,
            idle_timeout: Duration::from_millis(500),
            write_timeout: Duration::from_millis(300),
        };
        let (_server, _regions, endpoint, region) = listener(limits);
        let stalled = TcpStream::connect(&endpoint).unwrap();
        let h = RequestHeader { op: FrameOp::Read, request_id: 1, region, offset: 0, len: 64 << 20 };
        (&stalled).write_all(&h.encode()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(refusal(&endpoint).is_some(), "the stalled reader holds the only place");
        assert!(eventually(|| refusal(&endpoint).is_none()), "its answer's write timed out");
        drop(stalled);
        // Alone (no new client wants its place), an idle connection is closed once
        // idle for the timeout.
        let idle = served_connection(&endpoint);
        let mut buf = [0u8; 1];
        let since = std::time::Instant::now();
        assert_eq!((&idle).read(&mut buf).unwrap(), 0, "closed by the listener");
        assert!(since.elapsed() >= Duration::from_millis(400), "not before its idle timeout");
    }

    /// Pooled connections the listener closed while idle are dialled again without
    /// the caller seeing it: transfers and control requests (the shared-memory and
    /// RDMA handshakes) alike.
    #[test]
    fn pooled_connections_closed_while_idle_are_dialled_again() {
        let limits = ServeLimits { idle_timeout: Duration::from_millis(200), ..ServeLimits::default() };
        let (_server, regions, endpoint, region) = listener(limits);
        let tcp = TcpTransport::new();
        let target = RemoteRegion { endpoint: endpoint.clone(), region };
        let data = vec![3u8; 3 << 20];
        for round in 0..3 {
            assert_eq!(tcp.control(&endpoint, FrameOp::Hello, 0).unwrap(), (FrameStatus::Ok, b"host".to_vec()));
            let mut reqs = [TransferRequest::write(&target, 4096, &data)];
            assert_eq!(tcp.transfer(&mut reqs), [Ok(())], "round {round}");
            let mut back = vec![0u8; data.len()];
            let mut reqs = [TransferRequest::read(&target, 4096, &mut back)];
            assert_eq!(tcp.transfer(&mut reqs), [Ok(())], "round {round}");
            assert!(back == data);
            assert!(!tcp.pools.lock().get(&endpoint).is_none_or(Vec::is_empty), "connections are pooled");
            // Every pooled connection is closed by the listener meanwhile.
            std::thread::sleep(Duration::from_millis(500));
        }
        drop(regions);
    }
}
