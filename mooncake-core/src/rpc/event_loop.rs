//! The RPC server's connections: the listener and every connection, polled one turn
//! at a time by whichever server thread leads (see [`super::threads`]). A turn reads
//! what clients sent, answers at once the requests the handler answers inline
//! ([`RpcHandler::answers_inline`]), and queues the others as [`Job`]s; a thread
//! answering a job writes the response to the socket itself and hands the connection
//! back with a [`Done`].

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use mio::net::{TcpListener, UnixListener};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use mooncake_transfer::{
    admits_peer, encode_refusal, poll_pause, Acceptor, WarnLimiter, AUTH_HELLO_LEN, AUTH_LEN, AUTH_MAGIC,
    PROTECTED_MODE_REFUSAL,
};

use super::budget::{DecodeError, DecodeLimits, DecodePool, PoolAccess};
use super::frame_reader::FrameReader;
use super::handler::{RpcHandler, RpcServerConfig, RpcServerStats};
use super::socket::{bind_local, local_auth_name, Peer, Socket};
use super::wire::{
    decode_request, encode_frame, request_kind_of, FrameKind, Request, Response, WireError, REQUEST_KINDS,
};

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);
/// The Unix socket for clients of this host (see [`super::socket`]).
const LOCAL_LISTENER: Token = Token(2);
/// Tokens of connections start here (slot `i` is token `FIRST_CONN + i`).
const FIRST_CONN: usize = 3;
/// Bytes read from a socket at a time.
const READ_CHUNK: usize = 64 << 10;
/// Bodies of at most this many bytes are read without waiting for memory budget,
/// and are not counted against it (only in `buffered_bytes`): a connection may hold
/// a read's worth of bytes unparsed anyway, and the small requests that keep a
/// cluster alive (heartbeats, puts, lookups) must not wait behind large ones (a
/// master restarting while many nodes re-mount with their records).
const SMALL_FRAME: usize = READ_CHUNK;
/// How long a refused connection is kept to drain what its peer sent, so that the
/// peer reads the refusal rather than a reset.
const LINGER: Duration = Duration::from_millis(500);
/// Most refused connections lingering at once (beyond it they are closed at once).
const MAX_LINGERING: usize = 256;
/// Most connections that have not finished their handshake (or, without a secret, their
/// first frame) at once: beyond it the oldest is closed to make room, so that a flood
/// of silent sockets cannot take every descriptor while each waits for its deadline.
/// Far above a real burst of clients: a handshake takes one round trip.
pub const MAX_UNAUTHENTICATED: usize = 512;

/// Warnings about connections, each kind written at most once per
/// [`WARN_EVERY`](mooncake_transfer::WARN_EVERY): a flood of refused or silent sockets
/// would otherwise write a line each.
#[derive(Default)]
struct Warnings {
    accept: WarnLimiter,
    refused: WarnLimiter,
    crowded: WarnLimiter,
    handshake: WarnLimiter,
}

/// A complete request, to be answered by a server thread.
pub(super) struct Job {
    slot: usize,
    generation: u64,
    /// The connection's socket, to write the response to: the loop writes nothing to
    /// a connection while its request is being answered.
    stream: Arc<Socket>,
    request_id: u64,
    body: Vec<u8>,
    decoding: Arc<Decoding>,
}

/// How a server decodes requests: the bounds of one, and the pool of bytes every
/// request being answered draws from.
pub(super) struct Decoding {
    limits: DecodeLimits,
    pool: DecodePool,
    wait: Duration,
}

/// A thread is done with a connection's request: the connection may go on.
pub(super) struct Done {
    slot: usize,
    generation: u64,
    outcome: Outcome,
}

/// What became of a response written by the thread that answered.
enum Outcome {
    /// Written whole to the socket.
    Sent,
    /// The socket took only `frame[..pos]`; the loop writes the rest.
    Unsent { frame: Vec<u8>, pos: usize },
    /// The request body was malformed (or its answer could not be encoded).
    Malformed,
    /// The socket failed.
    Broken,
}

impl Job {
    /// Answers the request; the response is written by [`Reply::send`].
    pub(super) fn answer(self, handler: &dyn RpcHandler, stats: &RpcServerStats) -> Reply {
        let (slot, generation, stream) = (self.slot, self.generation, self.stream.clone());
        // A thread may wait for room in the pool: no `Err` comes back.
        let frame = answer(self, handler, stats, None).unwrap_or(None);
        Reply { slot, generation, stream, frame }
    }
}

/// A response to write: the frame, or `None` if the request body was malformed.
pub(super) struct Reply {
    slot: usize,
    generation: u64,
    stream: Arc<Socket>,
    frame: Option<Vec<u8>>,
}

impl Reply {
    /// Writes the response to the socket (what it takes at once).
    pub(super) fn send(self) -> Done {
        let outcome = match self.frame {
            Some(frame) => write_now(&self.stream, frame),
            None => Outcome::Malformed,
        };
        Done { slot: self.slot, generation: self.generation, outcome }
    }
}

/// Writes what the socket takes at once of a response: usually all of it, so that
/// the response leaves without waiting for the thread that polls.
fn write_now(stream: &Socket, frame: Vec<u8>) -> Outcome {
    let mut pos = 0;
    while pos < frame.len() {
        match (&*stream).write(&frame[pos..]) {
            Ok(0) => return Outcome::Broken,
            Ok(n) => pos += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Outcome::Unsent { frame, pos },
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Outcome::Broken,
        }
    }
    Outcome::Sent
}

/// The response frame to one request, or `None` if its body is malformed. `inline`:
/// the kind the loop read from the body's first bytes to answer it itself; a body
/// that decodes as another kind is malformed. The request is decoded within the
/// server's [`Decoding`] bounds and pool; one over its bounds is answered with an
/// error (the connection goes on). Answered inline, it does not wait for room in the
/// pool: `Err(job)` gives it back, to be answered by a thread that may.
fn answer(
    mut job: Job,
    handler: &dyn RpcHandler,
    stats: &RpcServerStats,
    inline: Option<usize>,
) -> Result<Option<Vec<u8>>, Job> {
    let decoding = job.decoding.clone();
    let access = PoolAccess { pool: &decoding.pool, wait: inline.is_none().then_some(decoding.wait) };
    let decoded = decode_request(&job.body, decoding.limits, Some(access));
    let response = match decoded {
        Ok((request, held)) if inline.is_none_or(|k| k == request.kind_index()) => {
            // Decoded: the body's bytes are not needed while answering.
            job.body = Vec::new();
            stats.decoding_bytes.store(decoding.pool.in_use() as u64, Ordering::Relaxed);
            let kind = request.kind_index();
            let response = match std::panic::catch_unwind(AssertUnwindSafe(|| handler.handle(request))) {
                Ok(response) => response,
                // A bug, not the client's doing: the client gets an error and the
                // server goes on (a thread that died here would leave the
                // connection waiting for its answer forever).
                Err(panic) => {
                    stats.handler_panics.fetch_add(1, Ordering::Relaxed);
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    let name = REQUEST_KINDS.get(kind).copied().unwrap_or("?");
                    tracing::error!(request = name, panic = what, "an RPC handler panicked; answering with an error");
                    Response::Error(WireError::Other(format!("internal error answering {name}")))
                }
            };
            stats.requests.fetch_add(1, Ordering::Relaxed);
            stats.ops_by_kind[kind].fetch_add(1, Ordering::Relaxed);
            if Request::is_error(&response) {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                stats.errors_by_kind[kind].fetch_add(1, Ordering::Relaxed);
            }
            let frame = encode_frame(FrameKind::Response, job.request_id, &response);
            // The request is answered: its bytes go back to the pool.
            drop((response, held));
            stats.decoding_bytes.store(decoding.pool.in_use() as u64, Ordering::Relaxed);
            return Ok(frame.map_err(|e| tracing::warn!(error = %e, "cannot encode a response")).ok());
        }
        Ok(_) => {
            stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "closing an RPC connection: a request body that decodes as another kind than it starts with"
            );
            return Ok(None);
        }
        Err(DecodeError::Malformed(e)) => {
            stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(error = %e, "closing an RPC connection: malformed request body");
            return Ok(None);
        }
        Err(DecodeError::Busy { .. }) if inline.is_some() => return Err(job),
        Err(e) => {
            // Over its bounds, or no room in time: an error answer, and the
            // connection goes on (the frame was read whole, the stream is in step).
            let refused = stats.over_budget.fetch_add(1, Ordering::Relaxed) + 1;
            stats.requests.fetch_add(1, Ordering::Relaxed);
            stats.errors.fetch_add(1, Ordering::Relaxed);
            if let Some(kind) = request_kind_of(&job.body) {
                stats.ops_by_kind[kind].fetch_add(1, Ordering::Relaxed);
                stats.errors_by_kind[kind].fetch_add(1, Ordering::Relaxed);
            }
            warn_over_budget(&e, refused);
            match e {
                DecodeError::OverBudget(_) => Response::Error(WireError::InvalidArgument(e.to_string())),
                _ => Response::Error(WireError::Other(e.to_string())),
            }
        }
    };
    Ok(encode_frame(FrameKind::Response, job.request_id, &response).ok())
}

/// Logs a request refused for its decoding budget, at most once a second: an
/// attacker's stream of them must not become a stream of log lines.
fn warn_over_budget(e: &DecodeError, refused: u64) {
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    if LAST.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(error = %e, refused, "refusing an RPC request over its decoding budget");
    }
}

/// Where a connection is in its life.
enum Phase {
    /// A server with a secret sent its challenge; the client's `AUTH_MAGIC` and
    /// nonce are arriving (`proving`: false), then, after the server proved the
    /// secret, the client's proof (`proving`: true).
    Auth { acceptor: Box<Acceptor>, got: [u8; AUTH_HELLO_LEN], filled: usize, proving: bool },
    /// A server without a secret: the first bytes tell a frame from a client that
    /// tries to prove a secret.
    Hello { got: [u8; 4], filled: usize },
    /// Authenticated (or no secret): requests and responses, but the first frame
    /// (without a secret) must still complete in time.
    Open { hello_done: bool },
    /// Refused: what the peer sends is discarded until it closes or the linger ends.
    Closing,
}

struct Conn {
    slot: usize,
    /// Shared with the thread answering the connection's request, which writes the
    /// response itself.
    stream: Arc<Socket>,
    peer: Peer,
    generation: u64,
    phase: Phase,
    reader: FrameReader,
    /// Bytes read from the socket and not consumed yet (kept only while the
    /// connection waits: a request in flight, a response unsent, no memory budget).
    pending: Vec<u8>,
    /// A request of this connection is being answered (by a thread that may be writing to the
    /// socket: the loop does not).
    busy: bool,
    /// Body bytes reserved from the memory budget: the whole body of the frame in
    /// progress, from its header on, until the frame is answered (0: none).
    charged: usize,
    /// Response bytes not yet written, from `out_pos`.
    out: Vec<u8>,
    out_pos: usize,
    /// Waiting for memory budget: the frame's header is read, its body not reserved,
    /// and none of it read. The connection is in [`Loop::starved`].
    starved: bool,
    /// When bytes of the frame in progress last arrived, or bytes of the pending
    /// response last left (see [`RpcServerConfig::frame_timeout`]).
    progress_at: Instant,
    /// When the frame being read must be whole (see
    /// [`RpcServerConfig::min_frame_rate`]); `None` while no reserved frame is read.
    frame_deadline: Option<Instant>,
    /// The deadline of the stall timer queued for this connection, if one is.
    stall_deadline: Option<Instant>,
}

/// The listener and every connection.
pub(super) struct Loop {
    poll: Poll,
    /// Taken while a turn walks it.
    events: Option<Events>,
    listener: TcpListener,
    /// The Unix socket for clients of this host, and its name (see
    /// [`super::socket`]), unless the config turned it off or it could not be bound.
    local: Option<(UnixListener, String)>,
    config: RpcServerConfig,
    handler: Arc<dyn RpcHandler>,
    stats: Arc<RpcServerStats>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    /// Hello deadlines and linger ends: (when, slot, generation).
    timers: BinaryHeap<Reverse<(Instant, usize, u64)>>,
    /// Body bytes reserved over all connections (see [`Conn::charged`]), for bodies
    /// over [`SMALL_FRAME`]: what the memory budget bounds.
    buffered: usize,
    /// Body bytes reserved for bodies of at most [`SMALL_FRAME`] bytes.
    buffered_small: usize,
    /// Connections waiting for memory budget, oldest first: each waiting connection
    /// once, and only while it waits.
    starved: VecDeque<(usize, u64)>,
    /// [`Loop::wake_starved`] is running (it is not entered again from a connection
    /// it wakes: its loop goes on with what that connection freed).
    waking: bool,
    lingering: usize,
    accept_retry: Option<Instant>,
    /// Complete requests waiting for a thread to answer them.
    ready: VecDeque<Job>,
    decoding: Arc<Decoding>,
    done: Receiver<Done>,
    scratch: Vec<u8>,
    next_generation: u64,
    /// Connections still in their handshake, oldest first: (slot, generation); some
    /// may have moved on (checked when taken out).
    unauthenticated: VecDeque<(usize, u64)>,
    warnings: Warnings,
    /// Since when and until when turns poll without sleeping (see [`Loop::spin_for`]).
    spin: Option<(Instant, Instant)>,
}

/// What driving a connection came to.
enum Next {
    Keep,
    Close,
}

impl Loop {
    /// Polls `listener` for connections (nonblocking); `done` brings back the
    /// connections whose requests were answered.
    pub(super) fn new(
        listener: std::net::TcpListener,
        handler: Arc<dyn RpcHandler>,
        config: RpcServerConfig,
        stats: Arc<RpcServerStats>,
        done: Receiver<Done>,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(true)?;
        let mut listener = TcpListener::from_std(listener);
        let poll = Poll::new()?;
        poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
        let local = if config.local_socket {
            match bind_local().and_then(|(l, name)| {
                l.set_nonblocking(true)?;
                let mut l = UnixListener::from_std(l);
                poll.registry().register(&mut l, LOCAL_LISTENER, Interest::READABLE)?;
                Ok((l, name))
            }) {
                Ok(bound) => Some(bound),
                Err(e) => {
                    tracing::warn!(error = %e, "no Unix socket for local RPC clients: they use TCP");
                    None
                }
            }
        } else {
            None
        };
        let mut limits = handler.decode_limits().unwrap_or(config.decode_limits);
        // A request the whole pool cannot hold is over its budget, not "busy".
        limits.max_bytes = limits.max_bytes.min(config.decode_budget);
        let decoding =
            Arc::new(Decoding { limits, pool: DecodePool::new(config.decode_budget), wait: config.decode_wait });
        Ok(Loop {
            poll,
            events: Some(Events::with_capacity(1024)),
            listener,
            local,
            config,
            handler,
            stats,
            conns: Vec::new(),
            free: Vec::new(),
            timers: BinaryHeap::new(),
            buffered: 0,
            buffered_small: 0,
            starved: VecDeque::new(),
            waking: false,
            lingering: 0,
            accept_retry: None,
            ready: VecDeque::new(),
            decoding,
            done,
            scratch: vec![0; READ_CHUNK],
            next_generation: 0,
            unauthenticated: VecDeque::new(),
            warnings: Warnings::default(),
            spin: None,
        })
    }

    /// Turns poll without sleeping for `budget` from now: a client in the middle of
    /// an exchange (a put's `put_end` after its `put_start`) sends its next request
    /// within microseconds, and a poll that sleeps costs a wakeup as long as the
    /// round trip itself on many hosts.
    ///
    /// Between two polls that found nothing, the core is yielded once the first
    /// microseconds have passed ([`poll_pause`]): a server polling for a request
    /// that may never come must not hold a core another thread needs.
    pub(super) fn spin_for(&mut self, budget: Duration) {
        if !budget.is_zero() {
            let now = Instant::now();
            self.spin = Some((now, now + budget));
        }
    }

    /// A waker that ends the turn in progress (a [`Done`] was sent, or the server stops).
    pub(super) fn waker(&self) -> std::io::Result<Waker> {
        Waker::new(self.poll.registry(), WAKER)
    }

    /// The descriptor of the poll: readable while events wait to be polled.
    pub(super) fn poll_fd(&self) -> std::os::fd::RawFd {
        self.poll.as_raw_fd()
    }

    /// The oldest request waiting for an answer.
    pub(super) fn next_job(&mut self) -> Option<Job> {
        self.ready.pop_front()
    }

    /// Whether requests wait for an answer.
    pub(super) fn has_jobs(&self) -> bool {
        !self.ready.is_empty()
    }

    /// One turn: waits for events (or the next timer), then reads what clients sent,
    /// takes back connections whose requests were answered, and fires timers. Fails
    /// only if polling itself fails.
    pub(super) fn turn(&mut self) -> std::io::Result<()> {
        let now = Instant::now();
        let next_timer = self.timers.peek().map(|Reverse((at, _, _))| *at);
        let wake = [next_timer, self.accept_retry].into_iter().flatten().min();
        self.spin = self.spin.filter(|&(_, until)| now < until);
        let timeout = match self.spin {
            Some((since, _)) => {
                poll_pause(since);
                Some(Duration::ZERO)
            }
            None => wake.map(|at| at.saturating_duration_since(now)),
        };
        let mut events = self.events.take().unwrap_or_else(|| Events::with_capacity(1024));
        let polled = self.poll.poll(&mut events, timeout);
        if let Err(e) = polled {
            self.events = Some(events);
            return if e.kind() == ErrorKind::Interrupted { Ok(()) } else { Err(e) };
        }
        for event in events.iter() {
            match event.token() {
                LISTENER => self.accept(),
                LOCAL_LISTENER => self.accept_local(),
                WAKER => {}
                Token(t) => {
                    let slot = t - FIRST_CONN;
                    if event.is_writable() {
                        self.with_conn(slot, None, |l, c| l.flush(c));
                    }
                    if event.is_readable() || event.is_read_closed() {
                        self.with_conn(slot, None, |l, c| l.drive(c));
                    }
                }
            }
        }
        self.events = Some(events);
        while let Ok(done) = self.done.try_recv() {
            self.take_back(done);
        }
        self.fire_timers();
        // Budget given back during the turn (an inline answer, a closed connection)
        // goes to the connections waiting for it.
        self.wake_starved();
        if self.accept_retry.is_some_and(|at| at <= Instant::now()) {
            self.accept_retry = None;
            // Both listeners: the polls are edge-triggered, and either may hold
            // connections left waiting when accepting failed.
            self.accept();
            self.accept_local();
        }
        Ok(())
    }

    /// Runs `f` on the connection in `slot` (of `generation`, if given), closing it
    /// if `f` says so.
    fn with_conn(&mut self, slot: usize, generation: Option<u64>, f: impl FnOnce(&mut Self, &mut Conn) -> Next) {
        let Some(mut conn) = self.conns.get_mut(slot).and_then(Option::take) else { return };
        if generation.is_some_and(|g| g != conn.generation) {
            self.conns[slot] = Some(conn);
            return;
        }
        match f(self, &mut conn) {
            Next::Keep => self.conns[slot] = Some(conn),
            Next::Close => self.close(slot, conn),
        }
    }

    fn close(&mut self, slot: usize, mut conn: Conn) {
        let _ = self.poll.registry().deregister(&mut SourceFd(&conn.stream.as_raw_fd()));
        if conn.starved {
            let generation = conn.generation;
            self.starved.retain(|&waiting| waiting != (slot, generation));
        }
        self.release(&mut conn);
        if matches!(conn.phase, Phase::Closing) {
            self.lingering -= 1;
        }
        self.stats.open_connections.fetch_sub(1, Ordering::Relaxed);
        self.free.push(slot);
        self.wake_starved();
    }

    /// Gives a connection's body bytes back to the memory budget.
    fn release(&mut self, conn: &mut Conn) {
        if conn.charged > SMALL_FRAME {
            self.buffered -= conn.charged;
        } else {
            self.buffered_small -= conn.charged;
        }
        conn.charged = 0;
        conn.frame_deadline = None;
        self.show_buffered();
    }

    fn show_buffered(&self) {
        self.stats.buffered_bytes.store((self.buffered + self.buffered_small) as u64, Ordering::Relaxed);
    }

    /// Whether a body of `len` bytes may be read now: a small one always; another if
    /// it fits in the memory budget. One larger than the whole budget fits once
    /// nothing else is reserved: it would otherwise wait forever.
    fn fits(&self, len: usize) -> bool {
        len <= SMALL_FRAME || self.buffered == 0 || self.buffered.saturating_add(len) <= self.config.memory_budget
    }

    /// Reserves the whole body of `c`'s frame, `len` bytes, before any of it is read:
    /// a frame that starts can always finish, so the budget always comes back. With
    /// `timed` (unless the whole body has arrived already, the usual case for a small
    /// request, which then costs no clock), its clocks start: the stall timer, and
    /// the deadline for the whole frame.
    fn reserve(&mut self, c: &mut Conn, len: usize, timed: bool) {
        if len > SMALL_FRAME {
            self.buffered += len;
        } else {
            self.buffered_small += len;
        }
        c.charged = len;
        self.show_buffered();
        if !timed {
            return;
        }
        let now = Instant::now();
        let rate = self.config.min_frame_rate;
        c.frame_deadline = (rate > 0).then(|| {
            let nanos = (len as u128 * 1_000_000_000 / u128::from(rate)).min(u64::MAX as u128) as u64;
            now + self.config.frame_timeout + Duration::from_nanos(nanos)
        });
        self.note_progress(c);
    }

    /// Accepts what waits on the TCP listener.
    fn accept(&mut self) {
        loop {
            let (stream, peer) = match self.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors and the like: try again shortly, without spinning.
                    self.warnings.accept.warn(format_args!("accepting an RPC connection: {e}"));
                    self.accept_retry = Some(Instant::now() + Duration::from_millis(100));
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            let local_addr = stream.local_addr().ok();
            self.admit(Socket::Tcp(stream), Peer::tcp(peer, local_addr), local_addr, None);
        }
    }

    /// Accepts what waits on the Unix socket for clients of this host.
    fn accept_local(&mut self) {
        loop {
            let Some((listener, name)) = &self.local else { return };
            let stream = match listener.accept() {
                Ok((s, _)) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.warnings.accept.warn(format_args!("accepting a local RPC connection: {e}"));
                    self.accept_retry = Some(Instant::now() + Duration::from_millis(100));
                    return;
                }
            };
            let name = local_auth_name(name);
            self.admit(Socket::Unix(stream), Peer::Local, None, Some(name));
        }
    }

    /// Takes an accepted connection on: refused (protected mode, too many
    /// connections) with a message, or on to its handshake. `local` (a TCP
    /// socket's address) or `name` (the Unix socket's): what the server proves a
    /// shared secret for on this connection, besides its advertised names.
    fn admit(&mut self, stream: Socket, peer: Peer, local: Option<SocketAddr>, name: Option<String>) {
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let open = self.conns.len() - self.free.len();
        let admitted = match peer.ip() {
            Some(ip) => admits_peer(ip, self.config.secret.is_some(), self.config.insecure),
            // A process of this host: as a loopback peer.
            None => true,
        };
        let refusal = if !admitted {
            self.warnings.refused.warn(format_args!("protected mode: refusing a non-loopback RPC client ({peer})"));
            Some(PROTECTED_MODE_REFUSAL.to_owned())
        } else if open >= self.config.max_connections {
            self.warnings
                .refused
                .warn(format_args!("refusing an RPC connection from {peer}: too many connections ({open})"));
            Some(format!("too many connections (limit {})", self.config.max_connections))
        } else {
            None
        };
        if let Some(message) = &refusal {
            self.stats.refused_connections.fetch_add(1, Ordering::Relaxed);
            let _ = (&stream).write(&encode_refusal(message));
            if self.lingering >= MAX_LINGERING || open >= self.config.max_connections {
                return;
            }
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        let (phase, greeting) = match (&refusal, &self.config.secret) {
            (Some(_), _) => (Phase::Closing, None),
            (None, Some(_)) => {
                let mut names: Vec<String> = name.into_iter().collect();
                names.extend(self.config.names.iter().cloned());
                let (acceptor, greeting) = Acceptor::new(local, &names);
                let acceptor = Box::new(acceptor);
                (Phase::Auth { acceptor, got: [0; AUTH_HELLO_LEN], filled: 0, proving: false }, Some(greeting))
            }
            (None, None) => (Phase::Hello { got: [0; 4], filled: 0 }, None),
        };
        if let Some(g) = greeting {
            // A fresh socket's send buffer takes 36 bytes.
            if (&stream).write(&g).map_or(true, |n| n < g.len()) {
                return;
            }
        }
        let slot = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        // Registered by descriptor: the stream itself is shared with the threads
        // answering requests.
        if self
            .poll
            .registry()
            .register(
                &mut SourceFd(&stream.as_raw_fd()),
                Token(FIRST_CONN + slot),
                Interest::READABLE | Interest::WRITABLE,
            )
            .is_err()
        {
            self.free.push(slot);
            return;
        }
        let deadline = if matches!(phase, Phase::Closing) {
            self.lingering += 1;
            stream.shutdown_write();
            Instant::now() + LINGER
        } else {
            self.make_room_for_a_handshake();
            self.unauthenticated.push_back((slot, generation));
            Instant::now() + self.config.hello_timeout
        };
        self.timers.push(Reverse((deadline, slot, generation)));
        self.stats.open_connections.fetch_add(1, Ordering::Relaxed);
        self.conns[slot] = Some(Conn {
            slot,
            stream: Arc::new(stream),
            peer,
            generation,
            phase,
            reader: FrameReader::new(self.config.max_frame),
            pending: Vec::new(),
            busy: false,
            charged: 0,
            out: Vec::new(),
            out_pos: 0,
            starved: false,
            progress_at: Instant::now(),
            frame_deadline: None,
            stall_deadline: None,
        });
    }

    /// Closes the oldest connections still in their handshake while
    /// [`MAX_UNAUTHENTICATED`] are, so that one more fits.
    fn make_room_for_a_handshake(&mut self) {
        let waiting =
            |c: &Conn| matches!(c.phase, Phase::Auth { .. } | Phase::Hello { .. } | Phase::Open { hello_done: false });
        if self.unauthenticated.len() >= MAX_UNAUTHENTICATED {
            // Entries of connections that moved on (authenticated, closed) first: only
            // connections still waiting count, and only they are closed.
            let conns = &self.conns;
            self.unauthenticated.retain(|&(slot, generation)| {
                conns.get(slot).and_then(Option::as_ref).is_some_and(|c| c.generation == generation && waiting(c))
            });
        }
        while self.unauthenticated.len() >= MAX_UNAUTHENTICATED {
            let Some((slot, generation)) = self.unauthenticated.pop_front() else { break };
            let stats = self.stats.clone();
            self.with_conn(slot, Some(generation), |l, c| {
                if !waiting(c) {
                    return Next::Keep;
                }
                stats.crowded_out.fetch_add(1, Ordering::Relaxed);
                l.warnings.crowded.warn(format_args!(
                    "{MAX_UNAUTHENTICATED} RPC connections wait to authenticate: closing the oldest ({})",
                    c.peer
                ));
                Next::Close
            });
        }
    }

    /// Closes connections whose hello did not complete in time, refused ones whose
    /// linger ended, and those that stopped halfway through a frame (reading or
    /// writing it) or did not send it whole by its deadline.
    fn fire_timers(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, slot, generation))) = self.timers.peek().copied() {
            if at > now {
                return;
            }
            self.timers.pop();
            let stats = self.stats.clone();
            self.with_conn(slot, Some(generation), |l, c| match c.phase {
                Phase::Closing => Next::Close,
                _ if c.stall_deadline == Some(at) => l.check_stall(c, now),
                Phase::Open { hello_done: true } => Next::Keep,
                _ => {
                    stats.hello_timeouts.fetch_add(1, Ordering::Relaxed);
                    l.warnings.handshake.warn(format_args!(
                        "closing an RPC connection that did not complete its hello in time ({})",
                        c.peer
                    ));
                    Next::Close
                }
            });
        }
    }

    /// Bytes of a frame still in progress arrived on `c`, or bytes of its response
    /// left: its stall clock starts again, and a timer watches it if none does.
    fn note_progress(&mut self, c: &mut Conn) {
        c.progress_at = Instant::now();
        self.watch(c);
    }

    /// Arms `c`'s stall timer, unless one is armed: at the stall deadline, or the
    /// frame's deadline if that comes first. A timer armed earlier never fires later
    /// than needed (every clock starts at or after its deadline was set), so one
    /// that fires early just arms the next.
    fn watch(&mut self, c: &mut Conn) {
        if c.stall_deadline.is_none() {
            let stall = c.progress_at + self.config.frame_timeout;
            let deadline = c.frame_deadline.map_or(stall, |d| d.min(stall));
            c.stall_deadline = Some(deadline);
            self.timers.push(Reverse((deadline, c.slot, c.generation)));
        }
    }

    /// `c`'s stall timer fired (the caller matched its deadline): closes the
    /// connection if it holds the reservation of a frame in progress (not being
    /// answered) and sent none of it for the frame timeout or missed the frame's
    /// deadline, or if its pending response took no byte for the frame timeout;
    /// otherwise watches it again while either lasts. A connection waiting for
    /// budget holds none and is not watched: the wait is the server's doing.
    fn check_stall(&mut self, c: &mut Conn, now: Instant) -> Next {
        c.stall_deadline = None;
        let writing = !c.out.is_empty();
        let reading = c.charged > 0;
        if c.busy || !(writing || reading) {
            return Next::Keep;
        }
        let stalled = now.saturating_duration_since(c.progress_at) >= self.config.frame_timeout;
        let late = !writing && c.frame_deadline.is_some_and(|d| now >= d);
        if stalled || late {
            self.stats.frame_timeouts.fetch_add(1, Ordering::Relaxed);
            if writing {
                tracing::warn!(
                    peer = %c.peer,
                    unsent = c.out.len() - c.out_pos,
                    "closing an RPC connection that does not read its response"
                );
            } else if stalled {
                tracing::warn!(
                    peer = %c.peer,
                    held = c.reader.buffered(),
                    "closing an RPC connection that stopped halfway through a frame"
                );
            } else {
                tracing::warn!(
                    peer = %c.peer,
                    held = c.reader.buffered(),
                    of = c.charged,
                    "closing an RPC connection that sent its frame too slowly"
                );
            }
            return Next::Close;
        }
        self.watch(c);
        Next::Keep
    }

    /// A thread is done with a connection's request: write what the socket did not
    /// take of its response, and go on with the connection.
    pub(super) fn take_back(&mut self, done: Done) {
        self.with_conn(done.slot, Some(done.generation), |l, c| {
            c.busy = false;
            l.release(c);
            match done.outcome {
                Outcome::Sent => l.drive(c),
                Outcome::Unsent { frame, pos } => {
                    l.queue_response(c, frame, pos);
                    l.drive(c)
                }
                Outcome::Malformed | Outcome::Broken => Next::Close,
            }
        });
        self.wake_starved();
    }

    /// Reserves budget for the connections waiting for it, oldest first, while the
    /// oldest one's frame fits: a later, smaller frame does not overtake it (small
    /// ones, [`SMALL_FRAME`], wait for nothing and count for nothing here), so a
    /// large one waits only for the frames reserved before it to be answered.
    fn wake_starved(&mut self) {
        if self.waking {
            return;
        }
        self.waking = true;
        while let Some(&(slot, generation)) = self.starved.front() {
            // Out of its slot: the connection is being driven; the end of the turn
            // comes back to it.
            let Some(Some(c)) = self.conns.get(slot) else { break };
            if c.generation != generation {
                // Closed connections leave the queue; this one is only a safety net.
                self.starved.pop_front();
                continue;
            }
            let len = c.reader.body_len().unwrap_or(0);
            if !self.fits(len) {
                break;
            }
            self.starved.pop_front();
            self.with_conn(slot, Some(generation), |l, c| {
                c.starved = false;
                if len > 0 {
                    l.reserve(c, len, true);
                }
                l.drive(c)
            });
        }
        self.waking = false;
    }

    /// Queues the rest of a response, `frame[pos..]`, for the loop to write as the
    /// socket takes it; its stall clock starts now (armed only if the socket fills).
    fn queue_response(&mut self, c: &mut Conn, frame: Vec<u8>, pos: usize) {
        c.out = frame;
        c.out_pos = pos;
        c.progress_at = Instant::now();
    }

    /// Writes what is pending of `c`'s response. Bytes that left restart its stall
    /// clock; a socket that fills arms the timer, so a client that never reads is
    /// closed after the frame timeout instead of keeping its response in memory.
    fn write_pending(&mut self, c: &mut Conn) -> Wrote {
        let before = c.out_pos;
        let wrote = write_out(c);
        if let Wrote::Blocked = wrote {
            if c.out_pos > before {
                c.progress_at = Instant::now();
            }
            self.watch(c);
        }
        wrote
    }

    /// The socket can take bytes: writes what is pending of the response, and goes on
    /// with the connection once it is written.
    fn flush(&mut self, c: &mut Conn) -> Next {
        match self.write_pending(c) {
            Wrote::Nothing | Wrote::Blocked => Next::Keep,
            Wrote::All => self.drive(c),
            Wrote::Failed => Next::Close,
        }
    }

    /// Writes what is pending of the response, then reads and handles what the client
    /// sent, as far as the connection may go now (one request at a time, the previous
    /// response written, memory available).
    fn drive(&mut self, c: &mut Conn) -> Next {
        loop {
            if c.busy || c.starved {
                return Next::Keep;
            }
            match self.write_pending(c) {
                Wrote::Nothing | Wrote::All => {}
                Wrote::Blocked => return Next::Keep,
                Wrote::Failed => return Next::Close,
            }
            // Bytes kept from an earlier read first, then the socket.
            if !c.pending.is_empty() {
                let pending = std::mem::take(&mut c.pending);
                let (used, next) = self.consume(c, &pending);
                if used < pending.len() {
                    c.pending = pending[used..].to_vec();
                }
                if let Next::Close = next {
                    return Next::Close;
                }
                continue;
            }
            let mut buf = std::mem::take(&mut self.scratch);
            let read = (&*c.stream).read(&mut buf);
            let next = match read {
                Ok(0) => {
                    if matches!(c.phase, Phase::Auth { .. }) {
                        // A client that closes during the handshake refused our proof
                        // (another secret) or proved nothing: a failed authentication.
                        self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(Next::Close)
                }
                Ok(n) => {
                    let (used, next) = self.consume(c, &buf[..n]);
                    if used < n {
                        c.pending = buf[used..n].to_vec();
                    }
                    matches!(next, Next::Close).then_some(Next::Close)
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => Some(Next::Keep),
                Err(e) if e.kind() == ErrorKind::Interrupted => None,
                Err(_) => Some(Next::Close),
            };
            self.scratch = buf;
            if let Some(next) = next {
                return next;
            }
        }
    }

    /// Consumes bytes the client sent; returns how many were used (the rest waits
    /// for the connection to be ready again).
    fn consume(&mut self, c: &mut Conn, input: &[u8]) -> (usize, Next) {
        let mut used = 0;
        // A response waiting to be written (answered inline) ends it too: requests are
        // answered one at a time, and the rest waits in `pending`.
        while used < input.len() && !c.busy && !c.starved && c.out.is_empty() {
            let rest = &input[used..];
            match &mut c.phase {
                Phase::Closing => return (input.len(), Next::Keep),
                Phase::Auth { acceptor, got, filled, proving } => {
                    let want = if *proving { AUTH_LEN } else { AUTH_HELLO_LEN };
                    let take = (want - *filled).min(rest.len());
                    got[*filled..*filled + take].copy_from_slice(&rest[..take]);
                    *filled += take;
                    used += take;
                    if !*proving && *filled >= 4 && got[..4] != AUTH_MAGIC {
                        self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                        self.warnings
                            .handshake
                            .warn(format_args!("RPC client {} sent no shared secret; closing", c.peer));
                        return (used, self.linger(c));
                    }
                    if *filled < want {
                        continue;
                    }
                    let secret = self.config.secret.as_ref().expect("the Auth phase exists only with a secret");
                    if !*proving {
                        // The client's nonce: the server proves the secret first, for its
                        // address, and the client checks it before it proves anything.
                        let proof = match acceptor.on_hello(secret, got) {
                            Ok(p) => p,
                            Err(_) => return (used, self.linger(c)),
                        };
                        // A few dozen bytes, after 36 sent: the fresh socket's buffer takes them.
                        if (&*c.stream).write(&proof).map_or(true, |n| n < proof.len()) {
                            return (used, Next::Close);
                        }
                        *proving = true;
                        *filled = 0;
                        continue;
                    }
                    let mut answer = [0u8; AUTH_LEN];
                    answer.copy_from_slice(&got[..AUTH_LEN]);
                    let ok = acceptor.on_proof(secret, &answer);
                    let _ = (&*c.stream).write(&[u8::from(ok)]);
                    if !ok {
                        self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                        self.warnings
                            .handshake
                            .warn(format_args!("RPC client {} proved a wrong shared secret", c.peer));
                        return (used, self.linger(c));
                    }
                    c.phase = Phase::Open { hello_done: true };
                }
                Phase::Hello { got, filled } => {
                    let take = (got.len() - *filled).min(rest.len());
                    got[*filled..*filled + take].copy_from_slice(&rest[..take]);
                    *filled += take;
                    used += take;
                    if *filled < got.len() {
                        continue;
                    }
                    let first = *got;
                    if first == AUTH_MAGIC {
                        self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                        self.warnings.handshake.warn(format_args!(
                            "RPC client {} proves a shared secret this server does not have",
                            c.peer
                        ));
                        let _ = (&*c.stream).write(&encode_refusal(
                            "this server has no shared secret but the client proved one: set the same \
                             MOONCAKE_SECRET on every process",
                        ));
                        return (used, self.linger(c));
                    }
                    c.phase = Phase::Open { hello_done: false };
                    if let Next::Close = self.feed(c, &first) {
                        return (used, Next::Close);
                    }
                }
                Phase::Open { .. } => {
                    let (n, next) = self.feed_some(c, rest);
                    used += n;
                    if let Next::Close = next {
                        return (used, Next::Close);
                    }
                    if n == 0 {
                        break;
                    }
                }
            }
        }
        (used, Next::Keep)
    }

    /// Feeds bytes that must all be taken (at most a header's worth).
    fn feed(&mut self, c: &mut Conn, bytes: &[u8]) -> Next {
        let (n, next) = self.feed_some(c, bytes);
        debug_assert!(n == bytes.len() || matches!(next, Next::Close));
        next
    }

    /// Feeds the frame reader within the memory budget; a complete frame goes to a
    /// thread (or is answered here, inline). Returns the bytes taken. Once a header
    /// is read, no byte of its body is taken before the whole body is reserved (see
    /// [`Loop::reserve`]); a frame that does not fit, or that would overtake frames
    /// waiting already, waits in [`Loop::starved`]. A small one ([`SMALL_FRAME`])
    /// never waits, and holds no one up.
    fn feed_some(&mut self, c: &mut Conn, bytes: &[u8]) -> (usize, Next) {
        let mut n = 0;
        let frame = loop {
            // Header bytes only, until the body is reserved: it is then taken whole.
            let allowance = if c.charged > 0 { usize::MAX } else { 0 };
            let (used, frame) = match c.reader.feed(&bytes[n..], allowance) {
                Ok(r) => r,
                Err(e) => {
                    self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(peer = %c.peer, error = %e, "closing an RPC connection: malformed frame");
                    return (n, Next::Close);
                }
            };
            n += used;
            if frame.is_some() {
                break frame;
            }
            match c.reader.body_len() {
                // A header just read (an empty body completes at once, above).
                Some(len) if c.charged == 0 => {
                    let queued = len > SMALL_FRAME && !self.starved.is_empty();
                    if queued || !self.fits(len) {
                        // No room, or frames waiting already go first: wait, holding
                        // no body byte.
                        c.starved = true;
                        self.starved.push_back((c.slot, c.generation));
                        return (n, Next::Keep);
                    }
                    let arrived = bytes.len() - n;
                    self.reserve(c, len, arrived < len);
                }
                Some(_) if used > 0 => {
                    self.note_progress(c);
                    break None;
                }
                _ => break None,
            }
        };
        let Some((header, body)) = frame else { return (n, Next::Keep) };
        if header.kind != FrameKind::Request {
            self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %c.peer, "closing an RPC connection: a response frame from a client");
            return (n, Next::Close);
        }
        // Read whole: its deadline is met; its reservation stays until it is
        // answered.
        c.frame_deadline = None;
        c.phase = Phase::Open { hello_done: true };
        let job = Job {
            slot: c.slot,
            generation: c.generation,
            stream: c.stream.clone(),
            request_id: header.request_id,
            body,
            decoding: self.decoding.clone(),
        };
        let kind = request_kind_of(&job.body);
        if kind == Some(Request::LOCAL_ENDPOINT_KIND) {
            return (n, self.tell_local_endpoint(c, &job));
        }
        let job = match kind.filter(|&k| self.handler.answers_inline(k)) {
            // Answered here: `drive` writes the response before reading on.
            Some(kind) => match answer(job, &*self.handler, &self.stats, Some(kind)) {
                Ok(frame) => {
                    self.release(c);
                    let Some(frame) = frame else { return (n, Next::Close) };
                    self.queue_response(c, frame, 0);
                    return (n, Next::Keep);
                }
                // No room to decode it now: a thread waits for some.
                Err(job) => job,
            },
            None => job,
        };
        c.busy = true;
        self.ready.push_back(job);
        (n, Next::Keep)
    }

    /// Answers `LocalEndpoint` here, for any handler: the Unix socket's name to a
    /// TCP peer of this host, `None` to any other (see [`super::socket`]). The
    /// response goes out as an inline answer does.
    fn tell_local_endpoint(&mut self, c: &mut Conn, job: &Job) -> Next {
        let kind = Request::LOCAL_ENDPOINT_KIND;
        self.release(c);
        if !matches!(decode_request(&job.body, DecodeLimits::REQUEST, None), Ok((Request::LocalEndpoint {}, _))) {
            self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %c.peer, "closing an RPC connection: malformed request body");
            return Next::Close;
        }
        let name = self.local.as_ref().filter(|_| c.peer.is_same_host_tcp()).map(|(_, name)| name.clone());
        // Counted by kind only: part of setting a connection up, not a call of the
        // handler's (`requests` counts those).
        self.stats.ops_by_kind[kind].fetch_add(1, Ordering::Relaxed);
        match encode_frame(FrameKind::Response, job.request_id, &Response::LocalEndpoint(name)) {
            Ok(frame) => {
                self.queue_response(c, frame, 0);
                Next::Keep
            }
            Err(_) => Next::Close,
        }
    }

    /// Refuses a connection: stop writing, and discard what the peer still sends
    /// until it closes or the linger ends.
    fn linger(&mut self, c: &mut Conn) -> Next {
        if self.lingering >= MAX_LINGERING {
            return Next::Close;
        }
        self.lingering += 1;
        c.stream.shutdown_write();
        c.phase = Phase::Closing;
        self.timers.push(Reverse((Instant::now() + LINGER, c.slot, c.generation)));
        Next::Keep
    }
}

/// What writing a connection's pending response came to.
enum Wrote {
    /// Nothing was pending.
    Nothing,
    /// All of it is written (and its memory freed).
    All,
    /// The socket is full; the rest goes when it is writable again.
    Blocked,
    /// The socket failed.
    Failed,
}

/// Writes what is pending of a connection's response.
fn write_out(c: &mut Conn) -> Wrote {
    if c.out.is_empty() {
        return Wrote::Nothing;
    }
    while c.out_pos < c.out.len() {
        match (&*c.stream).write(&c.out[c.out_pos..]) {
            Ok(0) => return Wrote::Failed,
            Ok(n) => c.out_pos += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Wrote::Blocked,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Wrote::Failed,
        }
    }
    // Keep no response memory while idle.
    c.out = Vec::new();
    c.out_pos = 0;
    Wrote::All
}
