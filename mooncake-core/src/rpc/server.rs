//! The master's TCP server: one thread per connection, requests answered in order.

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_transfer::SharedSecret;

use crate::error::{Error, Result};
use crate::master::{master_calls, MasterApi, MasterService};
use crate::rpc::convert::{Arg, Lend};
use crate::rpc::wire::WireReturn;

use super::wire::{
    decode_body, encode_frame, FrameError, FrameHeader, FrameKind, Request, Response, WireError, DEFAULT_MAX_FRAME,
    HEADER_LEN, REQUEST_KINDS,
};

/// Counters of the RPC server.
#[derive(Debug)]
pub struct RpcServerStats {
    /// Requests by kind (indexed like [`REQUEST_KINDS`]).
    pub ops_by_kind: [AtomicU64; REQUEST_KINDS.len()],
    /// Error answers by kind (indexed like [`REQUEST_KINDS`]).
    pub errors_by_kind: [AtomicU64; REQUEST_KINDS.len()],
    /// Requests answered.
    pub requests: AtomicU64,
    /// Requests answered with an error.
    pub errors: AtomicU64,
    /// Connections closed because of a malformed frame.
    pub bad_frames: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
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
        }
    }
}

/// Serves a [`MasterService`] over TCP.
///
/// ```
/// use mooncake_core::{Master, MasterConfig, Store};
/// use mooncake_core::rpc::RpcServer;
///
/// let master = Master::new(MasterConfig::default())?;
/// let server = RpcServer::bind("127.0.0.1:0", master.service().clone())?;
/// let addr = server.local_addr().to_string();
/// let store = Store::builder().master_address(&addr).global_segment_size(1 << 20).build()?;
/// store.put("k", b"over tcp")?;
/// assert_eq!(master.stats().objects, 1);
/// # Ok::<(), mooncake_core::Error>(())
/// ```
pub struct RpcServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    stats: Arc<RpcServerStats>,
    /// Open connections, shut down when the server is dropped.
    conns: Arc<parking_lot::Mutex<Vec<TcpStream>>>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for RpcServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcServer").field("addr", &self.addr).finish()
    }
}

impl RpcServer {
    /// Binds `addr` and starts serving `service` on background threads.
    pub fn bind(addr: &str, service: Arc<MasterService>) -> Result<Self> {
        Self::bind_with_limit(addr, service, DEFAULT_MAX_FRAME)
    }

    /// [`bind`](Self::bind) with a custom largest frame body.
    pub fn bind_with_limit(addr: &str, service: Arc<MasterService>, max_frame: u32) -> Result<Self> {
        Self::bind_with(addr, service, max_frame, None)
    }

    /// [`bind`](Self::bind) with a largest frame body and, optionally, a shared secret
    /// every client must prove before its first request.
    pub fn bind_with(
        addr: &str,
        service: Arc<MasterService>,
        max_frame: u32,
        secret: Option<SharedSecret>,
    ) -> Result<Self> {
        Self::serve(addr, service, max_frame, secret)
    }

    /// Serves any [`RpcHandler`] (the master, or a storage node answering loads from
    /// its SSD) with the same framing, limits and authentication.
    pub fn serve(
        addr: &str,
        service: Arc<dyn RpcHandler>,
        max_frame: u32,
        secret: Option<SharedSecret>,
    ) -> Result<Self> {
        let listener =
            TcpListener::bind(addr).map_err(|e| Error::InvalidArgument(format!("cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(RpcServerStats::default());
        let (stop2, stats2) = (stop.clone(), stats.clone());
        let conns: Arc<parking_lot::Mutex<Vec<TcpStream>>> = Arc::default();
        let conns2 = conns.clone();
        let accept = std::thread::Builder::new()
            .name("mooncake-rpc-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if stop2.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    if let Ok(c) = conn.try_clone() {
                        let mut open = conns2.lock();
                        // Forget connections that are already closed.
                        open.retain(|c| c.peer_addr().is_ok());
                        open.push(c);
                    }
                    stats2.connections.fetch_add(1, Ordering::Relaxed);
                    let (service, stats, stop) = (service.clone(), stats2.clone(), stop2.clone());
                    let secret = secret.clone();
                    let _ = std::thread::Builder::new().name("mooncake-rpc-conn".into()).spawn(move || {
                        let peer = conn.peer_addr().ok();
                        // The server keeps a clone of every connection: close the
                        // socket itself (not just this descriptor) when done.
                        let closer = conn.try_clone().ok();
                        let _closing = CloseOnDrop(closer);
                        if secret.as_ref().is_some_and(|s| !s.admit(&conn)) {
                            stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(?peer, "master client failed the shared-secret challenge");
                            return;
                        }
                        if let Err(e) = serve_connection(conn, &*service, &stats, &stop, max_frame) {
                            tracing::warn!(?peer, error = %e, "closing master connection");
                        }
                    });
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("cannot start the RPC server: {e}")))?;
        tracing::info!(%local, "master RPC listening");
        Ok(Self { addr: local, stop, stats, conns, accept: Some(accept) })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Counters.
    pub fn stats(&self) -> &Arc<RpcServerStats> {
        &self.stats
    }
}

impl Drop for RpcServer {
    /// Stops accepting, closes the listener (the address is free again when this
    /// returns) and shuts every open connection down.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        for c in self.conns.lock().drain(..) {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Shuts a socket down when dropped.
struct CloseOnDrop(Option<TcpStream>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("{0}")]
    Frame(#[from] FrameError),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// Answers requests of the framed protocol.
pub trait RpcHandler: Send + Sync + 'static {
    /// The response to one request.
    fn handle(&self, request: Request) -> Response;
}

impl RpcHandler for MasterService {
    fn handle(&self, request: Request) -> Response {
        dispatch(self, request)
    }
}

fn serve_connection(
    conn: TcpStream,
    service: &dyn RpcHandler,
    stats: &RpcServerStats,
    stop: &AtomicBool,
    max_frame: u32,
) -> std::result::Result<(), ConnError> {
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::with_capacity(64 << 10, conn.try_clone()?);
    let mut writer = BufWriter::with_capacity(64 << 10, conn);
    let mut header = [0u8; HEADER_LEN];
    let mut body = Vec::new();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        match reader.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let h = match FrameHeader::decode(&header, max_frame) {
            Ok(h) if h.kind == FrameKind::Request => h,
            Ok(h) => {
                stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                return Err(FrameError::Kind(h.kind as u8).into());
            }
            Err(e) => {
                stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                return Err(e.into());
            }
        };
        body.resize(h.body_len as usize, 0);
        reader.read_exact(&mut body)?;
        let request: Request = match decode_body(&body) {
            Ok(r) => r,
            Err(e) => {
                stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                return Err(e.into());
            }
        };
        let kind = request.kind_index();
        let response = service.handle(request);
        stats.requests.fetch_add(1, Ordering::Relaxed);
        stats.ops_by_kind[kind].fetch_add(1, Ordering::Relaxed);
        if Request::is_error(&response) {
            stats.errors.fetch_add(1, Ordering::Relaxed);
            stats.errors_by_kind[kind].fetch_add(1, Ordering::Relaxed);
        }
        writer.write_all(&encode_frame(FrameKind::Response, h.request_id, &response)?)?;
        // Answer at once unless the client already pipelined more requests.
        if reader.buffer().is_empty() {
            writer.flush()?;
        }
    }
}

/// Answers one request with a master: the server's dispatch over any
/// [`MasterApi`] (the service itself, or anything that wraps one).
pub fn dispatch(api: &dyn MasterApi, request: Request) -> Response {
    macro_rules! dispatch_calls {
        ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty; )*) => {
            match request {
                $(
                    Request::$variant { $($arg),* } => {
                        $( let $arg = Lend::lend(&$arg); )*
                        Response::$variant(WireReturn::into_wire(api.$name($( Arg::arg(&$arg) ),*)))
                    }
                )*
                Request::BatchGetOffloadObject { .. }
                | Request::ReleaseOffloadBuffer { .. }
                | Request::ApplyRecords { .. } => Response::Error(WireError::InvalidArgument(
                    "this is a master: storage-node requests are served by storage nodes".into(),
                )),
            }
        };
    }
    master_calls!(dispatch_calls)
}

/// Reads one frame body of at most `max` bytes (helper for tests and tools).
pub fn read_frame(r: &mut impl Read, max: u32) -> std::result::Result<(FrameHeader, Vec<u8>), FrameError> {
    let mut header = [0u8; HEADER_LEN];
    r.read_exact(&mut header).map_err(|e| FrameError::Truncated(e.to_string()))?;
    let h = FrameHeader::decode(&header, max)?;
    let mut body = vec![0u8; h.body_len as usize];
    r.read_exact(&mut body).map_err(|e| FrameError::Truncated(e.to_string()))?;
    Ok((h, body))
}
