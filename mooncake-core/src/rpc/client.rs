//! `RpcMasterClient`: the [`MasterApi`] of a master daemon, over TCP.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use mooncake_alloc::SegmentId;
use mooncake_transfer::{
    answer_spin, decode_refusal, read_polling, RemoteRegion, SharedSecret, AUTH_MAGIC, REFUSE_MAGIC,
};
use parking_lot::Mutex;

use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{
    master_calls, ClientId, ClientRegistration, DrainProgress, HeldPlacement, MasterApi, MasterStats, MemoryReplica,
    ObjectInfo, ObjectRecord, OffloadPlan, RecordConnector, RecordSink, RecordUpdate, RecordsInFlight, ReplicaList,
    ReplicatePlan, SegmentInfo,
};
use crate::rpc::convert::{BatchLen, IntoWire};
use crate::rpc::handler::local_sockets_enabled;
use crate::rpc::socket::{local_auth_name, same_host, ClientSocket};
use crate::rpc::wire::WireReturn;
use crate::rpc::wire::{
    decode_body, encode_frame, FrameHeader, FrameKind, Request, Response, DEFAULT_MAX_FRAME, HEADER_LEN,
};

/// A client of a master daemon. Connections are pooled: concurrent calls use
/// separate connections; a broken connection is dropped and the call retried once on
/// a fresh one (so a restarted master is picked up).
pub struct RpcMasterClient {
    addr: String,
    pool: Mutex<Vec<Conn>>,
    next_id: AtomicU64,
    /// Connections opened so far: each is numbered (`Conn::serial`) in turn.
    dialed: AtomicU64,
    timeout: Duration,
    secret: Option<SharedSecret>,
    /// Says `Reconnected` first on every connection opened after one broke, until
    /// the master answers it ([`announce_reconnects`](Self::announce_reconnects)).
    announces_reconnects: bool,
    /// A connection broke and no `Reconnected` was answered since.
    reconnect_unannounced: AtomicBool,
    /// A connection nothing is asked on: it closes when the master goes away
    /// ([`MasterApi::await_hangup`]).
    watch: Mutex<Option<Conn>>,
    /// When a dial was last refused ([`MasterApi::last_refused`]).
    refused_at: Mutex<Option<std::time::Instant>>,
}

impl std::fmt::Debug for RpcMasterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcMasterClient").field("addr", &self.addr).finish()
    }
}

impl RpcMasterClient {
    /// Connects to the master at `addr` (`host:port`); fails with
    /// `MasterUnavailable` if it cannot be reached.
    pub fn connect(addr: &str) -> Result<Self> {
        Self::connect_with(addr, None)
    }

    /// [`connect`](Self::connect), proving `secret` on every connection.
    pub fn connect_with(addr: &str, secret: Option<SharedSecret>) -> Result<Self> {
        Self::connect_with_timeout(addr, secret, Duration::from_secs(30))
    }

    /// [`connect_with`](Self::connect_with) where a call fails with `Timeout` when the
    /// master does not answer within `timeout`.
    pub fn connect_with_timeout(addr: &str, secret: Option<SharedSecret>, timeout: Duration) -> Result<Self> {
        let client = Self {
            addr: addr.to_owned(),
            pool: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            dialed: AtomicU64::new(0),
            timeout,
            secret,
            announces_reconnects: false,
            reconnect_unannounced: AtomicBool::new(false),
            watch: Mutex::new(None),
            refused_at: Mutex::new(None),
        };
        let conn = client.dial()?;
        client.pool.lock().push(conn);
        Ok(client)
    }

    /// This client (a store's, of a master daemon) tells the master when it is back
    /// after a connection broke: the first call on every connection opened after a
    /// break is [`MasterApi::reconnected`], until one is answered. A master that
    /// restarted learns so before it answers anything else (a key it does not hold
    /// yet is `Recovering`, not `NotFound`). Not for other servers (storage nodes'
    /// endpoints), which do not serve it.
    pub fn announce_reconnects(mut self) -> Self {
        self.announces_reconnects = true;
        self
    }

    /// A new connection to the server, numbered after every one before it; the
    /// first after a break says `Reconnected` (see
    /// [`announce_reconnects`](Self::announce_reconnects)).
    fn dial(&self) -> Result<Conn> {
        let mut conn = self.open().inspect_err(|_| {
            // Nothing listens where a master answered before: it stopped, and the
            // next one to answer there is another process.
            if self.dialed.load(Ordering::SeqCst) > 0 {
                self.reconnect_unannounced.store(true, Ordering::SeqCst);
            }
        })?;
        if self.announces_reconnects && self.reconnect_unannounced.load(Ordering::SeqCst) {
            self.say_reconnected(&mut conn)?;
        }
        conn.serial = self.dialed.fetch_add(1, Ordering::SeqCst) + 1;
        Ok(conn)
    }

    /// [`MasterApi::await_hangup`]: waits on the watch connection (opened first if
    /// there is none; while the master is unreachable, a dial every 20 ms, the
    /// first that succeeds saying `Reconnected` after a break) until the master
    /// closes it or `timeout` passes.
    fn watch_for_hangup(&self, timeout: Duration) -> bool {
        let mut watch = self.watch.lock();
        if watch.is_none() {
            match self.dial() {
                Ok(conn) => *watch = Some(conn),
                Err(_) => {
                    drop(watch);
                    std::thread::sleep(timeout.min(Duration::from_millis(20)));
                    return false;
                }
            }
        }
        let Some(conn) = watch.as_ref() else { return false };
        let mut fd = libc::pollfd {
            fd: std::os::fd::AsRawFd::as_raw_fd(&conn.stream),
            events: libc::POLLIN | libc::POLLRDHUP,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `fd` is one live `pollfd` naming the socket `conn` owns, which the
        // lock held keeps open for the whole call.
        let n = unsafe { libc::poll(&mut fd, 1, ms) };
        if n <= 0 || conn.open_and_idle() {
            // Quiet (or interrupted): the master that accepted it still runs.
            return false;
        }
        // Closed (or out of step: nothing is ever asked on it): the next connection
        // opened tells a restarted master so before anything else.
        *watch = None;
        self.reconnect_unannounced.store(true, Ordering::SeqCst);
        true
    }

    /// A new connection to the server: over TCP, then, for a server on this host
    /// (dialed over loopback or at this host's own address) that has one, moved to
    /// its Unix socket (see `rpc::socket`); on TCP still if that fails.
    fn open(&self) -> Result<Conn> {
        let unavailable = |e: std::io::Error| Error::MasterUnavailable(format!("{}: {e}", self.addr));
        let addrs: Vec<_> = self.addr.to_socket_addrs().map_err(unavailable)?.collect();
        let mut last = Error::MasterUnavailable(format!("{}: no address", self.addr));
        for a in addrs {
            let s = match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(s) => s,
                Err(e) => {
                    if e.kind() == std::io::ErrorKind::ConnectionRefused {
                        *self.refused_at.lock() = Some(std::time::Instant::now());
                    }
                    last = unavailable(e);
                    continue;
                }
            };
            let here = s.local_addr().is_ok_and(|l| same_host(l.ip(), a.ip()));
            let mut conn = self.tcp_conn(s)?;
            if here && local_sockets_enabled() {
                match self.move_to_local(&mut conn) {
                    Moved::Local(local) => return Ok(local),
                    Moved::Stay => {}
                    // This connection was refused (too many): so would a fresh one.
                    Moved::Refused(e) => return Err(unavailable(e)),
                    Moved::OutOfStep(e) => {
                        tracing::debug!(addr = %self.addr, error = %e, "asking a local server for its socket");
                        drop(conn);
                        return self
                            .tcp_conn(TcpStream::connect_timeout(&a, Duration::from_secs(2)).map_err(unavailable)?);
                    }
                }
            }
            return Ok(conn);
        }
        Err(last)
    }

    /// A connection on the TCP stream `s` just connected: no delay, the call
    /// timeout, and the shared secret proved.
    fn tcp_conn(&self, s: TcpStream) -> Result<Conn> {
        let _ = s.set_nodelay(true);
        let _ = s.set_read_timeout(Some(self.timeout));
        if let Some(secret) = &self.secret {
            secret.prove(&s, &self.addr).map_err(Error::MasterUnavailable)?;
        }
        Ok(Conn { stream: ClientSocket::Tcp(s), buf: Vec::new(), serial: 0 })
    }

    /// Asks the server on `tcp` (on this host) for its Unix socket and
    /// connects there (see [`Moved`]). Whatever fails on the Unix socket keeps
    /// `tcp`, which is in step once the answer is read: the move is an
    /// optimization, never a reason to fail.
    fn move_to_local(&self, tcp: &mut Conn) -> Moved {
        let name = match self.ask_local_endpoint(tcp) {
            Ok(Some(name)) => name,
            Ok(None) => return Moved::Stay,
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => return Moved::Refused(e),
            Err(e) => return Moved::OutOfStep(e),
        };
        match self.connect_local(&name) {
            Ok(local) => Moved::Local(local),
            Err(e) => {
                tracing::debug!(addr = %self.addr, error = %e, "staying on TCP to a local server");
                Moved::Stay
            }
        }
    }

    /// A connection to the server's Unix socket `name`, proving the secret as on
    /// TCP, and admitted: with a secret the handshake's verdict says so, without
    /// one a round trip does (a server at its connection limit refuses it).
    fn connect_local(&self, name: &str) -> std::io::Result<Conn> {
        let u = crate::rpc::socket::connect_local(name)?;
        u.set_read_timeout(Some(self.timeout))?;
        if let Some(secret) = &self.secret {
            secret.prove_unix(&u, &local_auth_name(name)).map_err(std::io::Error::other)?;
        }
        let mut conn = Conn { stream: ClientSocket::Unix(u), buf: Vec::new(), serial: 0 };
        if self.secret.is_none() {
            self.ask_local_endpoint(&mut conn)?;
        }
        Ok(conn)
    }

    /// One `Reconnected` round trip on `conn`, before any call goes there: the
    /// master has taken note once it answers, whatever the answer.
    fn say_reconnected(&self, conn: &mut Conn) -> Result<()> {
        let (id, frame) = self.request_frame(&Request::Reconnected {})?;
        let unavailable = |e: std::io::Error| Error::MasterUnavailable(format!("{}: {e}", self.addr));
        (&conn.stream).write_all(&frame).map_err(unavailable)?;
        let answer = Self::read_answer(conn, id).map_err(unavailable)?;
        if !matches!(answer, Response::Reconnected(Ok(()))) {
            tracing::debug!(addr = %self.addr, ?answer, "the master did not take the reconnection note");
        }
        self.reconnect_unannounced.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// One `LocalEndpoint` round trip on `conn`: the name the server tells.
    fn ask_local_endpoint(&self, conn: &mut Conn) -> std::io::Result<Option<String>> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode_frame(FrameKind::Request, id, &Request::LocalEndpoint {})
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))?;
        (&conn.stream).write_all(&frame)?;
        match Self::read_answer(conn, id)? {
            Response::LocalEndpoint(name) => Ok(name),
            other => Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("unexpected answer {other:?}"))),
        }
    }

    /// Whether this client's pooled connections reach the server on its Unix
    /// socket (tests: which way the calls go).
    #[cfg(test)]
    pub(crate) fn pooled_are_local(&self) -> Vec<bool> {
        self.pool.lock().iter().map(|c| c.stream.is_local()).collect()
    }

    /// Reads the answer to request `id` from `conn`, with the socket's own errors (so
    /// that a timeout stays a timeout). One `read` takes the whole answer when it
    /// fits the connection's buffer (the header and the body together).
    fn read_answer(conn: &mut Conn, id: u64) -> std::io::Result<Response> {
        let Conn { stream, buf, .. } = conn;
        if buf.len() < READ_BUFFER {
            buf.resize(READ_BUFFER, 0);
        }
        // Polled for a moment first: the answer usually comes within it, and a
        // thread woken from sleep pays as much again as the round trip.
        // The stream type named: the solver does not infer it through the bounds
        // of the generic `Stream`'s `Read`.
        let n = read_polling::<ClientSocket>(stream, buf, answer_spin())?;
        answer_from(buf, n, &*stream, id)
    }

    /// Sends `req` and returns the master's response: `send`, then `receive`.
    pub fn call(&self, req: &Request) -> Result<Response> {
        self.receive(self.send(req)?)
    }

    /// The first half of a call: writes `req` on a connection of the pool (a fresh one
    /// if none is idle) and returns without waiting for the answer, so that a caller
    /// may have requests to several masters in flight from one thread. A connection
    /// that breaks while writing is dropped and the request written on a fresh one,
    /// once.
    pub(crate) fn send(&self, req: &Request) -> Result<Sent> {
        let (id, frame) = self.request_frame(req)?;
        self.write(frame, id, false)
    }

    /// `req` framed under a new request id.
    fn request_frame(&self, req: &Request) -> Result<(u64, Vec<u8>)> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode_frame(FrameKind::Request, id, req).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok((id, frame))
    }

    /// [`send`](Self::send) if it can be done at once: over a connection already open
    /// (never connecting, which may wait for a host that does not answer), the whole
    /// frame taken by the socket's buffer in one non-blocking write (never waiting for
    /// a peer that reads nothing). `None` otherwise, the request not sent.
    pub(crate) fn send_pooled(&self, req: &Request) -> Option<Result<Sent>> {
        let (id, frame) = match self.request_frame(req) {
            Ok(framed) => framed,
            Err(e) => return Some(Err(e)),
        };
        let conn = self.pool.lock().pop()?;
        // SAFETY: the descriptor is the open socket `conn` owns for the whole call;
        // `send` only reads `frame.len()` bytes of the live buffer `frame`.
        let n = unsafe {
            libc::send(
                std::os::fd::AsRawFd::as_raw_fd(&conn.stream),
                frame.as_ptr().cast(),
                frame.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        match usize::try_from(n) {
            Ok(n) if n == frame.len() => Some(Ok(Sent { conn, frame, id, retried: false })),
            // Nothing written (the buffer is full): the connection is still in step.
            Err(_) if std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock => {
                self.pool.lock().push(conn);
                None
            }
            // Part of a frame, or a broken connection: dropped (closed), and the
            // request left to a caller that may connect.
            _ => None,
        }
    }

    /// Writes `frame` (request `id`) on a pooled or fresh connection; `retried`: this
    /// request already lost a connection (no second retry).
    fn write(&self, frame: Vec<u8>, id: u64, mut retried: bool) -> Result<Sent> {
        loop {
            let conn = match self.pool.lock().pop() {
                Some(c) => c,
                None => self.dial()?,
            };
            match (&conn.stream).write_all(&frame) {
                Ok(()) => return Ok(Sent { conn, frame, id, retried }),
                Err(e) => match self.classify(e, retried) {
                    Some(e) => return Err(e),
                    None => retried = true,
                },
            }
        }
    }

    /// The second half of a call: waits for the answer to `sent` (up to the client's
    /// timeout) and puts its connection back in the pool. A connection that broke (the
    /// master restarted since it was opened) is dropped and the request sent again on
    /// a fresh one, once.
    pub(crate) fn receive(&self, sent: Sent) -> Result<Response> {
        let Sent { mut conn, frame, id, retried } = sent;
        match Self::read_answer(&mut conn, id) {
            Ok(resp) => {
                if conn.buf.len() > READ_BUFFER {
                    conn.buf = Vec::new();
                }
                self.pool.lock().push(conn);
                Ok(resp)
            }
            Err(e) => match self.classify(e, retried) {
                Some(e) => Err(e),
                None => {
                    drop(conn);
                    self.receive(self.write(frame, id, true)?)
                }
            },
        }
    }

    /// What an I/O error on a connection means: `Some(error)` to report, or `None` to
    /// try again on a fresh connection (the first time a connection broke).
    fn classify(&self, e: std::io::Error, retried: bool) -> Option<Error> {
        match e.kind() {
            std::io::ErrorKind::PermissionDenied => Some(Error::MasterUnavailable(format!("{}: {e}", self.addr))),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Some(Error::Timeout(format!("master {} did not answer: {e}", self.addr)))
            }
            _ if !retried => {
                tracing::debug!(error = %e, "master connection broken; retrying on a new one");
                self.reconnect_unannounced.store(true, Ordering::SeqCst);
                // Every pooled connection may be stale (the master restarted).
                self.pool.lock().clear();
                None
            }
            _ => {
                self.reconnect_unannounced.store(true, Ordering::SeqCst);
                Some(Error::MasterUnavailable(format!("{}: {e}", self.addr)))
            }
        }
    }
}

/// The answer to request `id`: `buf` holds the `n` bytes of it read so far (at
/// least one header's worth of room), `stream` the rest. The master's bytes are
/// judged here: a refusal, a header within [`DEFAULT_MAX_FRAME`], one answer and
/// nothing after it, a body that decodes.
fn answer_from(buf: &mut Vec<u8>, mut n: usize, mut stream: impl Read, id: u64) -> std::io::Result<Response> {
    while n < HEADER_LEN {
        match stream.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if n >= 4 && buf[..4] == AUTH_MAGIC {
        return Err(refused("the master requires a shared secret and this client has none: set MOONCAKE_SECRET"));
    }
    if n >= 4 && buf[..4] == REFUSE_MAGIC {
        return Err(refused(&format!("the master refused the connection: {}", decode_refusal(&buf[4..n], stream))));
    }
    if n < HEADER_LEN {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the master closed the connection"));
    }
    let h = FrameHeader::decode(&buf[..HEADER_LEN], DEFAULT_MAX_FRAME)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let end = HEADER_LEN + h.body_len as usize;
    if n > end {
        // One request in flight per connection: nothing may follow its answer.
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "bytes after the answer"));
    }
    if end > buf.len() {
        // A large answer (bounded by `DEFAULT_MAX_FRAME`); the buffer shrinks back
        // when the connection returns to the pool.
        buf.resize(end, 0);
    }
    stream.read_exact(&mut buf[n..end])?;
    if h.kind != FrameKind::Response || h.request_id != id {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "response does not match the request"));
    }
    decode_body(&buf[HEADER_LEN..end]).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// The answer a client makes of a master's `bytes` to request `id`, read as
/// `RpcMasterClient` reads one: the first `first` bytes in one read, then the rest
/// (for the fuzz targets).
#[cfg(feature = "fuzzing")]
pub fn decode_answer(bytes: &[u8], first: usize, id: u64) -> std::io::Result<Response> {
    let first = first.min(bytes.len()).min(READ_BUFFER);
    let mut buf = vec![0u8; READ_BUFFER];
    buf[..first].copy_from_slice(&bytes[..first]);
    answer_from(&mut buf, first, &bytes[first..], id)
}

/// What a call of `RpcMasterClient` returns for the decoded `response` (as `Debug`
/// text), `items` being the batch it asked about when the call is a batch call (for
/// the fuzz targets: turning any answer, an error's included, into a result).
#[cfg(feature = "fuzzing")]
pub fn answer_result(response: Response, items: Option<usize>) -> String {
    macro_rules! answer_results {
        ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty
        => $route:ident $( ( $($how:tt)* ) )? $( + $hook:ident )?; )*) => {
            match response {
                $(
                    Response::$variant(wire) => {
                        let items = if <$ret as WireReturn>::BATCH { items } else { None };
                        format!("{:?}", <$ret as WireReturn>::from_wire(wire, items))
                    }
                )*
                other => format!("{:?}", unexpected(other)),
            }
        };
    }
    master_calls!(answer_results)
}

/// What asking a local server for its Unix socket came to.
enum Moved {
    /// A connection there, admitted: the TCP one is closed.
    Local(Conn),
    /// Stay on the TCP connection (no socket, or it failed): it is in step.
    Stay,
    /// The server refused the TCP connection (its connection limit).
    Refused(std::io::Error),
    /// The TCP exchange failed half way: that connection is not in step.
    OutOfStep(std::io::Error),
}

/// Bytes a connection reads at once: most answers whole, in one system call.
const READ_BUFFER: usize = 16 << 10;

/// A connection to the master and the buffer its answers are read into.
#[derive(Debug)]
struct Conn {
    stream: ClientSocket,
    buf: Vec<u8>,
    /// Its number among the client's connections, in the order they were opened.
    serial: u64,
}

impl Conn {
    /// Whether the connection is open with nothing to read: its server (the process
    /// that accepted it) still runs. A server that exited closed it; one that wrote
    /// what no call waits for is out of step.
    fn open_and_idle(&self) -> bool {
        let mut byte = 0u8;
        // SAFETY: the descriptor is the open socket this connection owns; `recv`
        // peeks at most one byte into the live local `byte`.
        let n = unsafe {
            libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(&self.stream),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock
    }
}

/// A request written to a master and not answered yet: the first half of a call
/// ([`RpcMasterClient::send`]), finished by [`RpcMasterClient::receive`]. Dropping it
/// closes its connection (the answer is never read).
#[derive(Debug)]
pub(crate) struct Sent {
    conn: Conn,
    /// The whole frame, to send again if the connection turns out to be broken.
    frame: Vec<u8>,
    id: u64,
    retried: bool,
}

#[cfg(feature = "etcd")]
impl Sent {
    /// The connection the answer comes on (to wait for several with `poll`).
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.conn.stream.as_raw_fd()
    }
}

/// A storage node's record endpoint, as the master reaches it.
impl RecordSink for RpcMasterClient {
    fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
        match self.call(&Request::ApplyRecords { updates: updates.to_vec() })? {
            Response::Unit => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Written on an idle connection only: a node that does not answer (or a host
    /// that does not take connections) must not hold up the caller.
    fn send_records(&self, updates: &[RecordUpdate]) -> Option<Result<RecordsInFlight>> {
        let sent = self.send_pooled(&Request::ApplyRecords { updates: updates.to_vec() })?;
        Some(sent.map(|sent| RecordsInFlight(Box::new(sent))))
    }

    fn receive_records(&self, sent: RecordsInFlight) -> Result<()> {
        let Ok(sent) = sent.0.downcast::<Sent>() else {
            return Err(Error::InvalidArgument("records in flight of another sink".into()));
        };
        match self.receive(*sent)? {
            Response::Unit => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Nothing listens at the node's endpoint any more (connections are refused): its
    /// process ended. A paused or slow node accepts connections (its kernel does).
    fn gone(&self) -> bool {
        let Ok(mut addrs) = self.addr.to_socket_addrs() else { return false };
        addrs.next().is_some_and(|a| {
            matches!(TcpStream::connect_timeout(&a, Duration::from_millis(500)),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused)
        })
    }
}

/// Bytes of a storage node's record key (see [`record_endpoint_secret`]).
pub const RECORD_KEY_LEN: usize = 32;

/// The secret a storage node's record endpoint requires: derived from the random
/// record key the node gave the masters it mounted on (`mount_records`), and from
/// nothing else. So only those masters can change the node's records; a client, or
/// any other process holding the cluster's shared secret, cannot.
pub fn record_endpoint_secret(key: &[u8]) -> SharedSecret {
    SharedSecret::new(&[&b"mooncake-rs record endpoint\0"[..], key].concat())
}

/// How a master daemon reaches storage nodes' record endpoints: one connection pool
/// per node, proving the node's record key ([`record_endpoint_secret`]); a node
/// silent for `timeout` fails the call.
#[derive(Clone)]
pub struct RpcRecordConnector {
    timeout: Duration,
}

impl RpcRecordConnector {
    /// A connector whose calls time out after `timeout`.
    pub fn new(timeout: Duration) -> Self {
        Self { timeout }
    }
}

impl RecordConnector for RpcRecordConnector {
    fn connect(&self, endpoint: &str, key: &[u8]) -> Result<Arc<dyn RecordSink>> {
        let secret = record_endpoint_secret(key);
        Ok(Arc::new(RpcMasterClient::connect_with_timeout(endpoint, Some(secret), self.timeout)?))
    }
}

/// A refusal by the master: not retried, reported as is.
fn refused(message: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::PermissionDenied, message)
}

/// The error a response that is not the expected one stands for.
pub(crate) fn unexpected(r: Response) -> Error {
    match r {
        Response::Error(e) => e.into(),
        other => Error::MasterUnavailable(format!("unexpected response {other:?}")),
    }
}

/// Implements every master call as one round trip.
macro_rules! impl_rpc_client {
    ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty
        => $route:ident $( ( $($how:tt)* ) )? $( + $hook:ident )?; )*) => {
        impl MasterApi for RpcMasterClient {
            /// The number of connections opened so far.
            fn continuity_mark(&self) -> u64 {
                self.dialed.load(Ordering::SeqCst)
            }

            /// An idle connection opened before `mark` was taken is still open: the
            /// master process that accepted it has run ever since (a restart closes
            /// every connection). No such connection idle (all busy, or none left):
            /// no promise.
            fn unchanged_since(&self, mark: u64) -> bool {
                self.pool.lock().iter().any(|c| c.serial <= mark && c.open_and_idle())
            }

            fn await_hangup(&self, timeout: Duration) -> bool {
                self.watch_for_hangup(timeout)
            }

            fn last_refused(&self) -> Option<std::time::Instant> {
                *self.refused_at.lock()
            }

            $(
                fn $name(&self $(, $arg: $ty)*) -> $ret {
                    let items: Option<usize> = if <$ret as WireReturn>::BATCH {
                        None $( .or(BatchLen::batch_len(&$arg)) )*
                    } else {
                        None
                    };
                    if items == Some(0) {
                        // An empty batch needs no round trip.
                        return <$ret as WireReturn>::failed(Error::InvalidArgument(String::new()), items);
                    }
                    let request = Request::$variant { $( $arg: IntoWire::into_wire($arg) ),* };
                    match self.call(&request) {
                        Ok(Response::$variant(wire)) => <$ret as WireReturn>::from_wire(wire, items),
                        Ok(other) => <$ret as WireReturn>::failed(unexpected(other), items),
                        Err(e) => <$ret as WireReturn>::failed(e, items),
                    }
                }
            )*
        }
    };
}

master_calls!(impl_rpc_client);
