//! The `Tcp` transport: a listener per engine serving its regions, and a client with
//! pooled, pipelined connections per peer that stripes large requests.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use crate::auth::SharedSecret;
use crate::engine::EngineShared;
use crate::error::{Result, TransferError};
use crate::frame::{
    Op, RequestHeader, ResponseHeader, Status, MAX_INFO_BYTES, MAX_REQUEST_BYTES, REQUEST_LEN, RESPONSE_LEN,
};
use crate::transport::{TransferOp, TransferRequest, Transport};

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

/// Serves an engine's regions to TCP peers; stops when the engine is dropped.
pub(crate) struct TcpServer {
    stop: Arc<AtomicBool>,
    addr: std::net::SocketAddr,
}

impl Drop for TcpServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100));
    }
}

impl TcpServer {
    /// Binds `listener` and serves `engine` on background threads.
    pub(crate) fn start(
        listener: TcpListener,
        engine: Weak<EngineShared>,
        host_id: String,
        secret: Option<SharedSecret>,
    ) -> Result<Self> {
        let addr = listener.local_addr().map_err(|e| TransferError::Io(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let host_id: Arc<str> = host_id.into();
        std::thread::Builder::new()
            .name("mooncake-tcp-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let (engine, stop, host_id) = (engine.clone(), stop2.clone(), host_id.clone());
                    let secret = secret.clone();
                    let _ = std::thread::Builder::new().name("mooncake-tcp-conn".into()).spawn(move || {
                        let peer = conn.peer_addr().ok();
                        if secret.as_ref().is_some_and(|s| !s.admit(&conn)) {
                            tracing::warn!(?peer, "transfer peer failed the shared-secret challenge");
                            return;
                        }
                        if let Err(e) = serve(conn, &engine, &stop, &host_id) {
                            tracing::warn!(?peer, error = %e, "closing transfer connection");
                        }
                    });
                }
            })
            .map_err(|e| TransferError::Io(format!("cannot start the transfer server: {e}")))?;
        Ok(Self { stop, addr })
    }
}

fn io(e: std::io::Error) -> TransferError {
    TransferError::Io(e.to_string())
}

fn status_of(e: &TransferError) -> Status {
    match e {
        TransferError::OutOfBounds { .. } => Status::OutOfBounds,
        TransferError::UnknownRegion { .. } => Status::UnknownRegion,
        _ => Status::Refused,
    }
}

fn respond(w: &mut impl Write, status: Status, request_id: u64, len: u64) -> Result<()> {
    w.write_all(&ResponseHeader { status, request_id, len }.encode()).map_err(io)
}

/// One connection: requests answered in order.
fn serve(conn: TcpStream, engine: &Weak<EngineShared>, stop: &AtomicBool, host_id: &str) -> Result<()> {
    let _ = conn.set_nodelay(true);
    let mut r = BufReader::with_capacity(256 << 10, conn.try_clone().map_err(io)?);
    let mut w = BufWriter::with_capacity(256 << 10, conn);
    let mut header = [0u8; REQUEST_LEN];
    loop {
        match r.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io(e)),
        }
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let h = RequestHeader::decode(&header).map_err(|e| TransferError::Protocol(e.to_string()))?;
        let Some(engine) = engine.upgrade() else { return Ok(()) };
        let region = engine.region(h.region).and_then(|reg| reg.check_bounds(h.offset, h.len).map(|_| reg));
        match (h.op, region) {
            (Op::Read, Ok(reg)) => {
                respond(&mut w, Status::Ok, h.request_id, h.len)?;
                reg.drain_to(h.offset, h.len, &mut w)?;
            }
            (Op::Write, Ok(reg)) => {
                reg.fill_from(h.offset, h.len, &mut r)?;
                respond(&mut w, Status::Ok, h.request_id, 0)?;
            }
            (Op::Write, Err(e)) => {
                // Refused before one byte was stored; skip the payload to stay in sync.
                std::io::copy(&mut (&mut r).take(h.len), &mut std::io::sink()).map_err(io)?;
                respond(&mut w, status_of(&e), h.request_id, 0)?;
            }
            (Op::Read, Err(e)) => respond(&mut w, status_of(&e), h.request_id, 0)?,
            (Op::ShmInfo, _) => {
                // Regions are looked up without the bounds of the request (len is 0).
                match engine.region(h.region) {
                    Ok(reg) => match reg.memfd() {
                        Some(fd) => {
                            let payload = shm_info_payload(reg.len(), fd, host_id);
                            respond(&mut w, Status::Ok, h.request_id, payload.len() as u64)?;
                            w.write_all(&payload).map_err(io)?;
                        }
                        None => respond(&mut w, Status::Refused, h.request_id, 0)?,
                    },
                    Err(e) => respond(&mut w, status_of(&e), h.request_id, 0)?,
                }
            }
            (Op::Hello, _) => {
                respond(&mut w, Status::Ok, h.request_id, host_id.len() as u64)?;
                w.write_all(host_id.as_bytes()).map_err(io)?;
            }
        }
        // Answer now unless the peer already pipelined more requests.
        if r.buffer().is_empty() {
            w.flush().map_err(io)?;
        }
    }
}

/// `len u64 | pid u32 | fd i32 | host id`.
fn shm_info_payload(len: u64, fd: &std::fs::File, host_id: &str) -> Vec<u8> {
    use std::os::fd::AsRawFd;
    let mut p = Vec::with_capacity(16 + host_id.len());
    p.extend_from_slice(&len.to_le_bytes());
    p.extend_from_slice(&std::process::id().to_le_bytes());
    p.extend_from_slice(&fd.as_raw_fd().to_le_bytes());
    p.extend_from_slice(host_id.as_bytes());
    p
}

/// What a peer said about one of its shared regions.
pub(crate) struct ShmInfo {
    pub(crate) len: u64,
    pub(crate) pid: u32,
    pub(crate) fd: i32,
    pub(crate) host_id: String,
}

/// Counters of a transport.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Bytes read from peers.
    pub bytes_read: AtomicU64,
    /// Bytes written to peers.
    pub bytes_written: AtomicU64,
    /// Requests that failed.
    pub errors: AtomicU64,
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
}

/// A piece of a request moved on one connection.
struct Chunk<'a> {
    req: usize,
    region: u64,
    offset: u64,
    op: TransferOp<'a>,
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
        let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
        if let Some(secret) = &self.secret {
            let mut conn = &s;
            secret
                .respond(&mut conn)
                .map_err(|e| TransferError::Unreachable(format!("{endpoint}: authentication failed: {e}")))?;
        }
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
    /// once on a fresh one; reads and writes are idempotent.
    fn run_lane(&self, endpoint: &str, chunks: &mut [Chunk<'_>]) -> Vec<Result<()>> {
        let first = self.run_lane_once(endpoint, chunks);
        if first.iter().any(|r| matches!(r, Err(TransferError::Io(_)) | Err(TransferError::Protocol(_)))) {
            self.pools.lock().remove(endpoint);
            return self.run_lane_once(endpoint, chunks);
        }
        first
    }

    fn run_lane_once(&self, endpoint: &str, chunks: &mut [Chunk<'_>]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = Vec::with_capacity(chunks.len());
        let stream = match self.connect(endpoint) {
            Ok(s) => s,
            Err(e) => return chunks.iter().map(|_| Err(e.clone())).collect(),
        };
        let mut conn = Conn { stream, next_id: 1 };
        let mut broken = None;
        for window in chunks.chunks_mut(WINDOW) {
            if let Some(e) = &broken {
                results.extend(window.iter().map(|_| Err(TransferError::clone(e))));
                continue;
            }
            match self.pipeline(&mut conn, window) {
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

    /// Sends every request of `window`, then reads every response.
    fn pipeline(&self, conn: &mut Conn, window: &mut [Chunk<'_>]) -> Result<Vec<Result<()>>> {
        let first_id = conn.next_id;
        {
            let mut w = BufWriter::with_capacity(64 << 10, &conn.stream);
            for c in window.iter() {
                let (op, len, payload): (Op, usize, Option<&[u8]>) = match &c.op {
                    TransferOp::Read(b) => (Op::Read, b.len(), None),
                    TransferOp::Write(b) => (Op::Write, b.len(), Some(b)),
                };
                let h =
                    RequestHeader { op, request_id: conn.next_id, region: c.region, offset: c.offset, len: len as u64 };
                conn.next_id += 1;
                w.write_all(&h.encode()).map_err(io)?;
                if let Some(p) = payload {
                    w.write_all(p).map_err(io)?;
                }
            }
            w.flush().map_err(io)?;
        }
        let mut out = Vec::with_capacity(window.len());
        let mut header = [0u8; RESPONSE_LEN];
        for (i, c) in window.iter_mut().enumerate() {
            (&conn.stream).read_exact(&mut header).map_err(io)?;
            let max = match &c.op {
                TransferOp::Read(b) => b.len() as u64,
                TransferOp::Write(_) => 0,
            };
            let h = ResponseHeader::decode(&header, max).map_err(|e| TransferError::Protocol(e.to_string()))?;
            if h.request_id != first_id + i as u64 {
                return Err(TransferError::Protocol("response out of order".into()));
            }
            out.push(match (h.status, &mut c.op) {
                (Status::Ok, TransferOp::Read(dst)) => {
                    if h.len != dst.len() as u64 {
                        return Err(TransferError::Protocol("short read".into()));
                    }
                    (&conn.stream).read_exact(dst).map_err(io)?;
                    self.stats.bytes_read.fetch_add(h.len, Ordering::Relaxed);
                    Ok(())
                }
                (Status::Ok, TransferOp::Write(src)) => {
                    self.stats.bytes_written.fetch_add(src.len() as u64, Ordering::Relaxed);
                    Ok(())
                }
                (Status::OutOfBounds, op) => Err(TransferError::OutOfBounds {
                    region: c.region,
                    offset: c.offset,
                    len: op.len() as u64,
                    region_len: 0,
                }),
                (Status::UnknownRegion, _) => {
                    Err(TransferError::UnknownRegion { endpoint: String::new(), region: c.region })
                }
                (Status::Refused, _) => Err(TransferError::Protocol("request refused".into())),
            });
        }
        Ok(out)
    }

    /// A one-request control exchange (handshakes).
    fn control(&self, endpoint: &str, op: Op, region: u64) -> Result<(Status, Vec<u8>)> {
        let mut s = self.connect(endpoint)?;
        let h = RequestHeader { op, request_id: 1, region, offset: 0, len: 0 };
        s.write_all(&h.encode()).map_err(io)?;
        let mut header = [0u8; RESPONSE_LEN];
        s.read_exact(&mut header).map_err(io)?;
        let r = ResponseHeader::decode(&header, MAX_INFO_BYTES).map_err(|e| TransferError::Protocol(e.to_string()))?;
        let mut payload = vec![0u8; r.len as usize];
        s.read_exact(&mut payload).map_err(io)?;
        self.give_back(endpoint, s);
        Ok((r.status, payload))
    }

    /// The host identity a peer reports.
    pub(crate) fn hello(&self, endpoint: &str) -> Result<String> {
        let (_, payload) = self.control(endpoint, Op::Hello, 0)?;
        String::from_utf8(payload).map_err(|_| TransferError::Protocol("host id is not UTF-8".into()))
    }

    /// How to map one of a peer's regions.
    pub(crate) fn shm_info(&self, endpoint: &str, region: u64) -> Result<ShmInfo> {
        match self.control(endpoint, Op::ShmInfo, region)? {
            (Status::Ok, p) if p.len() >= 16 => {
                let mut len = [0u8; 8];
                len.copy_from_slice(&p[0..8]);
                let mut pid = [0u8; 4];
                pid.copy_from_slice(&p[8..12]);
                let mut fd = [0u8; 4];
                fd.copy_from_slice(&p[12..16]);
                Ok(ShmInfo {
                    len: u64::from_le_bytes(len),
                    pid: u32::from_le_bytes(pid),
                    fd: i32::from_le_bytes(fd),
                    host_id: String::from_utf8_lossy(&p[16..]).into_owned(),
                })
            }
            (Status::UnknownRegion, _) => Err(TransferError::UnknownRegion { endpoint: endpoint.to_owned(), region }),
            _ => Err(TransferError::Protocol("peer refused the shared-memory handshake".into())),
        }
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &str {
        "tcp"
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
            let (region, base) = (req.target.region, req.offset);
            let peer = by_peer.entry(req.target.endpoint.clone()).or_default();
            match &mut req.op {
                TransferOp::Read(dst) => {
                    for (k, piece) in dst.chunks_mut(STRIPE).enumerate() {
                        let offset = base.saturating_add((k * STRIPE) as u64);
                        peer.push(Chunk { req: i, region, offset, op: TransferOp::Read(piece) });
                    }
                }
                TransferOp::Write(src) => {
                    for (k, piece) in src.chunks(STRIPE).enumerate() {
                        let offset = base.saturating_add((k * STRIPE) as u64);
                        peer.push(Chunk { req: i, region, offset, op: TransferOp::Write(piece) });
                    }
                }
            }
        }
        for (endpoint, chunks) in by_peer {
            let lanes = lanes().min(chunks.len()).max(1);
            let owners: Vec<usize> = chunks.iter().map(|c| c.req).collect();
            let mut outcome: Vec<Option<Result<()>>> = (0..chunks.len()).map(|_| None).collect();
            if lanes == 1 {
                let mut chunks = chunks;
                for (k, r) in self.run_lane(&endpoint, &mut chunks).into_iter().enumerate() {
                    outcome[k] = Some(r);
                }
            } else {
                // Deal chunks round-robin to lanes; each lane runs on its own thread.
                let mut lane_chunks: Vec<Vec<(usize, Chunk<'_>)>> = (0..lanes).map(|_| Vec::new()).collect();
                for (k, c) in chunks.into_iter().enumerate() {
                    lane_chunks[k % lanes].push((k, c));
                }
                let done: Vec<Vec<(usize, Result<()>)>> = std::thread::scope(|scope| {
                    let handles: Vec<_> = lane_chunks
                        .into_iter()
                        .map(|lane| {
                            let endpoint = &endpoint;
                            scope.spawn(move || {
                                let (idx, mut cs): (Vec<usize>, Vec<Chunk<'_>>) = lane.into_iter().unzip();
                                idx.into_iter().zip(self.run_lane(endpoint, &mut cs)).collect::<Vec<_>>()
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
                });
                for (k, r) in done.into_iter().flatten() {
                    outcome[k] = Some(r);
                }
            }
            for (k, r) in outcome.into_iter().enumerate() {
                let r = r.unwrap_or_else(|| Err(TransferError::Io("lane lost".into())));
                if let Err(e) = r {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    if results[owners[k]].is_ok() {
                        results[owners[k]] = Err(e);
                    }
                }
            }
        }
        results
    }
}
