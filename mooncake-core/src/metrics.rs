//! Prometheus text and JSON status of a master (served by `mooncake-master
//! --metrics-listen`), and the bounded HTTP server that serves them.
//!
//! The server ([`HttpServer`], with the `cli` feature) is one thread over one `mio`
//! poll. It holds at most [`HttpBounds::max_connections`] connections (one more
//! closes the oldest), gives each [`HttpBounds::request_timeout`] to send its request
//! and take its answer, reads at most [`HttpBounds::max_request_bytes`] of it, and
//! when the process is out of descriptors it sheds the connections queued on its
//! listener and backs off instead of failing: whatever clients do, it costs the
//! process a bounded number of descriptors and bytes, and the RPC listener beside it
//! keeps its own. Answers come from counters the master keeps up to date
//! ([`MasterStats`]), so rendering one does not grow with the number of objects.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::master::MasterStats;
use crate::rpc::wire::REQUEST_KINDS;
use crate::rpc::RpcServerStats;

/// Renders the master's stats (and its RPC counters, if any) in the Prometheus text
/// exposition format.
pub fn prometheus_text(stats: &MasterStats, rpc: Option<&RpcServerStats>) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, kind: &str, value: f64| write_metric(&mut out, name, help, kind, value);
    gauge("objects", "Complete objects.", "gauge", stats.objects as f64);
    gauge("object_bytes", "Logical bytes of complete objects.", "gauge", stats.object_bytes as f64);
    gauge("pending_puts", "Puts started and not ended.", "gauge", stats.pending_puts as f64);
    gauge("replicas", "Memory replicas.", "gauge", stats.replicas as f64);
    gauge("clients", "Registered clients.", "gauge", stats.clients as f64);
    gauge("segments", "Mounted segments.", "gauge", stats.segments as f64);
    gauge("capacity_bytes", "Bytes of all mounted segments.", "gauge", stats.capacity_bytes as f64);
    gauge("used_bytes", "Bytes allocated in mounted segments.", "gauge", stats.used_bytes as f64);
    gauge(
        "metadata_bytes",
        "Memory of the object index (estimate, keys included).",
        "gauge",
        stats.metadata_bytes as f64,
    );
    gauge("max_fragmentation", "Worst free-space fragmentation of a segment.", "gauge", stats.max_fragmentation);
    gauge("evicted_objects_total", "Objects evicted.", "counter", stats.evicted_objects as f64);
    gauge("evicted_bytes_total", "Bytes freed by eviction.", "counter", stats.evicted_bytes as f64);
    gauge("lease_refusals_total", "Removes refused because of a live lease.", "counter", stats.lease_refusals as f64);
    gauge("put_timeouts_total", "Puts reclaimed after the put timeout.", "counter", stats.put_timeouts as f64);
    gauge("expired_clients_total", "Clients expired after the TTL.", "counter", stats.expired_clients as f64);
    gauge(
        "under_replicated_puts_total",
        "Puts placed with fewer replicas than asked.",
        "counter",
        stats.under_replicated_puts as f64,
    );
    gauge(
        "segment_failures_total",
        "Segments clients reported they could not write to.",
        "counter",
        stats.segment_failures as f64,
    );
    gauge(
        "record_failures_total",
        "Storage nodes forgotten because they could not be told of a change to their records.",
        "counter",
        stats.record_failures as f64,
    );
    gauge("stall_graces_total", "Grace periods granted after a master stall.", "counter", stats.stall_graces as f64);
    gauge(
        "slot_groups_acquired_total",
        "Slot groups this master took the lead of.",
        "counter",
        stats.groups_acquired as f64,
    );
    gauge("slot_groups_released_total", "Slot groups this master gave up.", "counter", stats.groups_released as f64);
    gauge("moved_answers_total", "Calls answered Moved (slot led elsewhere).", "counter", stats.moved_answers as f64);
    if let Some(rpc) = rpc {
        let _ = writeln!(out, "# HELP mooncake_ops_total Requests served, by kind.\n# TYPE mooncake_ops_total counter");
        for (i, kind) in REQUEST_KINDS.iter().enumerate() {
            let _ =
                writeln!(out, "mooncake_ops_total{{kind=\"{kind}\"}} {}", rpc.ops_by_kind[i].load(Ordering::Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_errors_total Requests answered with an error, by kind.\n# TYPE mooncake_errors_total counter"
        );
        for (i, kind) in REQUEST_KINDS.iter().enumerate() {
            let _ = writeln!(
                out,
                "mooncake_errors_total{{kind=\"{kind}\"}} {}",
                rpc.errors_by_kind[i].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_bad_frames_total Connections closed for a malformed frame.\n# TYPE mooncake_bad_frames_total counter\nmooncake_bad_frames_total {}",
            rpc.bad_frames.load(Ordering::Relaxed)
        );
        let connection_metrics = [
            ("open_connections", "Client connections open now.", "gauge", &rpc.open_connections),
            (
                "refused_connections_total",
                "Connections refused at once (protected mode, connection limit).",
                "counter",
                &rpc.refused_connections,
            ),
            (
                "hello_timeouts_total",
                "Connections closed for not completing their hello in time.",
                "counter",
                &rpc.hello_timeouts,
            ),
            (
                "auth_failures_total",
                "Connections that failed the shared-secret handshake.",
                "counter",
                &rpc.auth_failures,
            ),
            ("rpc_buffered_bytes", "Bytes of request bodies held in memory now.", "gauge", &rpc.buffered_bytes),
        ];
        for (name, help, kind, value) in connection_metrics {
            let _ = writeln!(
                out,
                "# HELP mooncake_{name} {help}\n# TYPE mooncake_{name} {kind}\nmooncake_{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
    }
    out
}

/// Renders a cluster member's counters (cluster mode) in the Prometheus text format,
/// to append to [`prometheus_text`].
#[cfg(feature = "etcd")]
pub fn cluster_prometheus_text(stats: &crate::cluster::MemberStats) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, help: &str, kind: &str, value: f64| write_metric(&mut out, name, help, kind, value);
    metric("cluster_groups_led", "Slot groups this master leads now.", "gauge", stats.groups_led as f64);
    metric("cluster_slots_led", "Slots this master leads now.", "gauge", stats.slots_led as f64);
    metric(
        "cluster_failovers_total",
        "Groups taken over from a leader whose lease lapsed.",
        "counter",
        stats.failovers as f64,
    );
    metric(
        "cluster_groups_acquired_total",
        "Groups this master took the lead of.",
        "counter",
        stats.acquired_total as f64,
    );
    metric("cluster_groups_released_total", "Groups this master gave up.", "counter", stats.released_total as f64);
    metric("cluster_lease_renewals_total", "Lease renewals etcd acknowledged.", "counter", stats.lease_renewals as f64);
    metric("cluster_lease_lapses_total", "Times this master's lease lapsed.", "counter", stats.lease_lapses as f64);
    metric(
        "cluster_is_scheduler",
        "1 while this master runs the cluster's scheduler.",
        "gauge",
        u8::from(stats.is_scheduler) as f64,
    );
    out
}

/// One metric in the Prometheus text format: help, type and value lines.
fn write_metric(out: &mut String, name: &str, help: &str, kind: &str, value: f64) {
    let _ = writeln!(out, "# HELP mooncake_{name} {help}\n# TYPE mooncake_{name} {kind}\nmooncake_{name} {value}");
}

/// Renders an HTTP server's own counters in the Prometheus text format.
#[cfg(feature = "cli")]
pub fn http_prometheus_text(stats: &HttpServerStats) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, help: &str, kind: &str, value: &std::sync::atomic::AtomicU64| {
        write_metric(&mut out, name, help, kind, value.load(Ordering::Relaxed) as f64)
    };
    metric("http_open_connections", "Connections to the metrics listener open now.", "gauge", &stats.open);
    metric("http_accepted_total", "Connections the metrics listener accepted.", "counter", &stats.accepted);
    metric("http_served_total", "Requests the metrics listener answered.", "counter", &stats.served);
    metric(
        "http_evicted_total",
        "Connections closed to make room for a newer one (the connection cap).",
        "counter",
        &stats.evicted,
    );
    metric(
        "http_timeouts_total",
        "Connections closed for not sending their request (or taking the answer) in time.",
        "counter",
        &stats.timeouts,
    );
    metric("http_bad_requests_total", "Requests malformed or too large.", "counter", &stats.bad_requests);
    metric(
        "http_denied_total",
        "Requests refused for lack of the secret or a loopback peer.",
        "counter",
        &stats.denied,
    );
    metric(
        "http_accept_failures_total",
        "Accepts that failed (out of descriptors or memory); the listener backed off.",
        "counter",
        &stats.accept_failures,
    );
    metric(
        "http_shed_total",
        "Queued connections closed unserved while the process was out of descriptors.",
        "counter",
        &stats.shed,
    );
    out
}

/// The answer of the master's metrics listener to a `GET` of `path`: Prometheus text
/// at `/metrics`, JSON at `/status` (and `/`), `None` (404) elsewhere.
#[cfg(feature = "cli")]
pub fn render_master(daemon: &crate::MasterDaemon, path: &str, http: &HttpServerStats) -> Option<HttpResponse> {
    let stats = || daemon.master().stats();
    match path {
        "/metrics" => {
            let mut text = prometheus_text(&stats(), Some(daemon.rpc_stats()));
            if let Some(c) = &daemon.cluster_stats() {
                text.push_str(&cluster_prometheus_text(c));
            }
            text.push_str(&http_prometheus_text(http));
            Some(HttpResponse::ok("text/plain; version=0.0.4", text))
        }
        "/status" | "/" => {
            let mut status = serde_json::to_value(stats()).unwrap_or_default();
            if let (Some(c), Some(map)) = (&daemon.cluster_stats(), status.as_object_mut()) {
                map.insert("cluster".into(), serde_json::to_value(c).unwrap_or_default());
            }
            Some(HttpResponse::ok("application/json", serde_json::to_string_pretty(&status).unwrap_or_default()))
        }
        _ => None,
    }
}

/// Serves `daemon`'s `/metrics` and `/status` on `addr` (`host:port`; port 0 picks
/// one, see [`HttpServer::local_addr`]) until the returned server is dropped.
#[cfg(feature = "cli")]
pub fn serve_master(
    addr: &str,
    daemon: std::sync::Arc<crate::MasterDaemon>,
    access: HttpAccess,
    bounds: HttpBounds,
) -> std::io::Result<HttpServer> {
    HttpServer::bind(addr, bounds, access, move |path, http| render_master(&daemon, path, http))
}

#[cfg(feature = "cli")]
pub use server::{HttpAccess, HttpBounds, HttpResponse, HttpServer, HttpServerStats};

/// The bounded HTTP server (see the module's documentation).
#[cfg(feature = "cli")]
mod server {
    use std::collections::BTreeMap;
    use std::io::{ErrorKind, Read, Write};
    use std::net::{Shutdown, SocketAddr};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use mio::net::{TcpListener, TcpStream};
    use mio::{Events, Interest, Poll, Token, Waker};

    /// What the server lets clients take of the process.
    #[derive(Clone, Copy, Debug)]
    pub struct HttpBounds {
        /// Most connections open at once. One more closes the oldest (which has not
        /// been answered yet: answered ones are closed at once), so a crowd of idle
        /// connections cannot keep a scraper out, and never holds more than this many
        /// descriptors.
        pub max_connections: usize,
        /// How long a connection may take from its accept to the end of its answer
        /// (a client that sends half a request is dropped after it).
        pub request_timeout: Duration,
        /// Largest request head read (a larger one is answered 431).
        pub max_request_bytes: usize,
        /// How long the listener rests after an accept failed for lack of
        /// descriptors or memory.
        pub accept_backoff: Duration,
    }

    impl Default for HttpBounds {
        /// 64 connections, 3 s each, 8 KiB of request, 100 ms of back-off.
        fn default() -> Self {
            Self {
                max_connections: 64,
                request_timeout: Duration::from_secs(3),
                max_request_bytes: 8 << 10,
                accept_backoff: Duration::from_millis(100),
            }
        }
    }

    /// Who may read the answers.
    #[derive(Clone, Debug, Default)]
    pub struct HttpAccess {
        /// With a secret: only requests carrying `Authorization: Bearer <secret>`
        /// (others are answered 401).
        pub secret: Option<String>,
        /// Without a secret: any peer (otherwise loopback peers only; others are
        /// answered 403).
        pub insecure: bool,
    }

    impl HttpAccess {
        /// Whether a request from `peer` with `authorization` (the header's value)
        /// may be answered; the refusal's status and text otherwise.
        fn check(&self, peer: SocketAddr, authorization: Option<&[u8]>) -> Result<(), (u16, &'static str)> {
            match &self.secret {
                Some(secret) => {
                    let token = authorization.and_then(|v| v.strip_prefix(b"Bearer "));
                    // Compare keyed digests, not the strings: the time taken tells
                    // nothing of the secret.
                    let digest = |s: &[u8]| mooncake_transfer::SharedSecret::new(s).answer(&[0; 32]);
                    match token {
                        Some(t) if digest(t) == digest(secret.as_bytes()) => Ok(()),
                        _ => Err((401, "send the shared secret: Authorization: Bearer <secret>\n")),
                    }
                }
                None if self.insecure || peer.ip().to_canonical().is_loopback() => Ok(()),
                None => Err((403, "protected mode: metrics are served to loopback clients only\n")),
            }
        }
    }

    /// Counters of an [`HttpServer`].
    #[derive(Debug, Default)]
    pub struct HttpServerStats {
        /// Connections open now.
        pub open: AtomicU64,
        /// Connections accepted.
        pub accepted: AtomicU64,
        /// Requests answered (any status).
        pub served: AtomicU64,
        /// Connections closed unanswered to make room for a newer one.
        pub evicted: AtomicU64,
        /// Connections closed for running past the request timeout.
        pub timeouts: AtomicU64,
        /// Requests malformed, too large, or not `GET`/`HEAD`.
        pub bad_requests: AtomicU64,
        /// Requests refused (401, 403).
        pub denied: AtomicU64,
        /// Accepts that failed for lack of descriptors or memory.
        pub accept_failures: AtomicU64,
        /// Queued connections closed unserved while out of descriptors.
        pub shed: AtomicU64,
    }

    /// An answer: status, content type and body.
    #[derive(Clone, Debug)]
    pub struct HttpResponse {
        /// HTTP status code.
        pub status: u16,
        /// `Content-Type` header.
        pub content_type: &'static str,
        /// The body.
        pub body: String,
    }

    impl HttpResponse {
        /// A 200 answer.
        pub fn ok(content_type: &'static str, body: String) -> Self {
            Self { status: 200, content_type, body }
        }

        fn text(status: u16, body: &str) -> Self {
            Self { status, content_type: "text/plain", body: body.to_owned() }
        }

        /// The bytes on the wire (`Connection: close`: one request per connection).
        fn encode(&self, head_only: bool) -> Vec<u8> {
            let reason = match self.status {
                200 => "OK",
                400 => "Bad Request",
                401 => "Unauthorized",
                403 => "Forbidden",
                404 => "Not Found",
                405 => "Method Not Allowed",
                431 => "Request Header Fields Too Large",
                _ => "Internal Server Error",
            };
            let mut out = format!(
                "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                self.status,
                self.content_type,
                self.body.len()
            )
            .into_bytes();
            if !head_only {
                out.extend_from_slice(self.body.as_bytes());
            }
            out
        }
    }

    /// The handler: the answer to a `GET` of a path (`None`: 404).
    type Handler = dyn Fn(&str, &HttpServerStats) -> Option<HttpResponse> + Send;

    const LISTENER: Token = Token(0);
    const WAKER: Token = Token(1);
    /// Tokens of connections start here and only grow: their order is the order of
    /// accepts, hence of deadlines.
    const FIRST_CONNECTION: usize = 2;

    /// A bounded HTTP/1 server on its own thread; stops when dropped.
    pub struct HttpServer {
        addr: SocketAddr,
        stats: Arc<HttpServerStats>,
        stop: Arc<AtomicBool>,
        waker: Arc<Waker>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl std::fmt::Debug for HttpServer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("HttpServer").field("addr", &self.addr).finish()
        }
    }

    impl HttpServer {
        /// Listens on `addr` (`host:port`; port 0 picks one) and answers each `GET`
        /// or `HEAD` that `access` allows with `handler(path, counters)` (the path
        /// without its query).
        pub fn bind(
            addr: &str,
            bounds: HttpBounds,
            access: HttpAccess,
            handler: impl Fn(&str, &HttpServerStats) -> Option<HttpResponse> + Send + 'static,
        ) -> std::io::Result<Self> {
            let listener = std::net::TcpListener::bind(addr)?;
            listener.set_nonblocking(true)?;
            let mut listener = TcpListener::from_std(listener);
            let addr = listener.local_addr()?;
            let poll = Poll::new()?;
            poll.registry().register(&mut listener, LISTENER, Interest::READABLE)?;
            let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
            let stats = Arc::new(HttpServerStats::default());
            let stop = Arc::new(AtomicBool::new(false));
            let mut event_loop = EventLoop {
                poll,
                listener,
                bounds: HttpBounds { max_connections: bounds.max_connections.max(1), ..bounds },
                access,
                handler: Box::new(handler),
                stats: stats.clone(),
                conns: BTreeMap::new(),
                next_token: FIRST_CONNECTION,
                accept_ready: true,
                paused_until: None,
                spare: spare_descriptor(),
                warnings: Warnings::default(),
            };
            let thread_stop = stop.clone();
            let thread = std::thread::Builder::new()
                .name("mooncake-metrics".into())
                .spawn(move || event_loop.run(&thread_stop))?;
            Ok(Self { addr, stats, stop, waker, thread: Some(thread) })
        }

        /// The address it listens on.
        pub fn local_addr(&self) -> SocketAddr {
            self.addr
        }

        /// Its counters.
        pub fn stats(&self) -> &Arc<HttpServerStats> {
            &self.stats
        }
    }

    impl Drop for HttpServer {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Release);
            let _ = self.waker.wake();
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// A descriptor kept in reserve: closing it makes room to accept one queued
    /// connection and close it at once, so that clients queued while the process is
    /// out of descriptors are told so instead of waiting for a timeout.
    fn spare_descriptor() -> Option<std::fs::File> {
        std::fs::File::open("/dev/null").ok()
    }

    /// One connection: its request as read so far, then its answer as written.
    struct Conn {
        stream: TcpStream,
        peer: SocketAddr,
        deadline: Instant,
        request: Vec<u8>,
        /// The answer and how much of it is written (`None`: still reading).
        answer: Option<(Vec<u8>, usize)>,
    }

    /// What to do with a connection after it made progress.
    enum Next {
        Keep,
        Close,
    }

    /// Warnings of one kind, at most one per interval (a flood of failures must not
    /// flood the log), each saying how many were left out.
    #[derive(Default)]
    struct Warnings {
        last: Option<Instant>,
        left_out: u64,
    }

    impl Warnings {
        const INTERVAL: Duration = Duration::from_secs(10);

        fn warn(&mut self, what: &str, e: &std::io::Error) {
            let now = Instant::now();
            if self.last.is_some_and(|t| now.duration_since(t) < Self::INTERVAL) {
                self.left_out += 1;
                return;
            }
            tracing::warn!(error = %e, left_out = self.left_out, "metrics listener: {what}");
            self.last = Some(now);
            self.left_out = 0;
        }
    }

    struct EventLoop {
        poll: Poll,
        listener: TcpListener,
        bounds: HttpBounds,
        access: HttpAccess,
        handler: Box<Handler>,
        stats: Arc<HttpServerStats>,
        /// Open connections by token: the first is the oldest.
        conns: BTreeMap<usize, Conn>,
        next_token: usize,
        /// The listener may have connections queued (its readiness is edge-triggered:
        /// no new event comes for those left after a pause).
        accept_ready: bool,
        /// Accepting rests until then after running out of descriptors.
        paused_until: Option<Instant>,
        spare: Option<std::fs::File>,
        warnings: Warnings,
    }

    impl EventLoop {
        fn run(&mut self, stop: &AtomicBool) {
            let mut events = Events::with_capacity(256);
            while !stop.load(Ordering::Acquire) {
                let timeout = self.next_wakeup().map(|t| t.saturating_duration_since(Instant::now()));
                if let Err(e) = self.poll.poll(&mut events, timeout) {
                    if e.kind() != ErrorKind::Interrupted {
                        // Not expected of epoll_wait; rest rather than spin.
                        self.warnings.warn("poll failed", &e);
                        std::thread::sleep(self.bounds.accept_backoff);
                    }
                    continue;
                }
                for event in events.iter() {
                    match event.token() {
                        LISTENER => self.accept_ready = true,
                        WAKER => {}
                        Token(token) => self.drive(token),
                    }
                }
                self.accept();
                self.expire(Instant::now());
            }
        }

        /// When the loop must wake without an event: the oldest connection's
        /// deadline, and the end of an accept pause (at once if accepts are due).
        fn next_wakeup(&self) -> Option<Instant> {
            let deadline = self.conns.values().next().map(|c| c.deadline);
            let accept = self.accept_ready.then(|| self.paused_until.unwrap_or_else(Instant::now));
            match (deadline, accept) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            }
        }

        /// Accepts what the listener holds (a batch per turn, so that the
        /// connections in hand are served too), resting after running out of
        /// descriptors.
        fn accept(&mut self) {
            if !self.accept_ready || self.paused_until.is_some_and(|t| Instant::now() < t) {
                return;
            }
            self.paused_until = None;
            for _ in 0..256 {
                match self.listener.accept() {
                    Ok((stream, peer)) => self.admit(stream, peer),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        self.accept_ready = false;
                        return;
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            ErrorKind::Interrupted | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
                        ) =>
                    {
                        continue
                    }
                    Err(e) => {
                        // EMFILE, ENFILE, ENOBUFS, ENOMEM: the connection stays
                        // queued. Tell the queued clients, rest, try again.
                        self.stats.accept_failures.fetch_add(1, Ordering::Relaxed);
                        self.warnings.warn("cannot accept (backing off)", &e);
                        if matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) {
                            self.shed();
                        }
                        self.paused_until = Some(Instant::now() + self.bounds.accept_backoff);
                        return;
                    }
                }
            }
        }

        /// Out of descriptors: closes up to a batch of queued connections through the
        /// spare descriptor.
        fn shed(&mut self) {
            for _ in 0..64 {
                let Some(spare) = self.spare.take().or_else(spare_descriptor) else { return };
                drop(spare);
                let accepted = self.listener.accept();
                let done = accepted.is_err();
                if let Ok((stream, _)) = accepted {
                    self.stats.shed.fetch_add(1, Ordering::Relaxed);
                    drop(stream);
                }
                self.spare = spare_descriptor();
                if done {
                    return;
                }
            }
        }

        /// Takes a new connection in, closing the oldest if at the cap.
        fn admit(&mut self, mut stream: TcpStream, peer: SocketAddr) {
            self.stats.accepted.fetch_add(1, Ordering::Relaxed);
            while self.conns.len() >= self.bounds.max_connections {
                let Some((_, oldest)) = self.conns.pop_first() else { break };
                self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                self.close(oldest);
            }
            let token = self.next_token;
            self.next_token += 1;
            if self
                .poll
                .registry()
                .register(&mut stream, Token(token), Interest::READABLE | Interest::WRITABLE)
                .is_err()
            {
                return; // Dropped: closed.
            }
            let conn = Conn {
                stream,
                peer,
                deadline: Instant::now() + self.bounds.request_timeout,
                request: Vec::new(),
                answer: None,
            };
            self.conns.insert(token, conn);
            self.stats.open.store(self.conns.len() as u64, Ordering::Relaxed);
            // The request often came with the connection: no event will say so
            // (edge-triggered readiness was taken before registering).
            self.drive(token);
        }

        /// Closes the connections past their deadline (the oldest come first).
        fn expire(&mut self, now: Instant) {
            while let Some(entry) = self.conns.first_entry() {
                if entry.get().deadline > now {
                    break;
                }
                let conn = entry.remove();
                // Counted before the close, which a client may be waiting for.
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                self.close(conn);
            }
        }

        fn close(&self, mut conn: Conn) {
            let _ = self.poll.registry().deregister(&mut conn.stream);
            self.stats.open.store(self.conns.len() as u64, Ordering::Relaxed);
        }

        /// Reads what connection `token` sent and answers once its request is whole;
        /// writes what it can of the answer; closes it when done.
        fn drive(&mut self, token: usize) {
            let Some(conn) = self.conns.get_mut(&token) else { return };
            let mut next = Next::Keep;
            if conn.answer.is_none() {
                next = read_request(conn, &self.bounds, &self.access, &*self.handler, &self.stats);
            }
            if matches!(next, Next::Keep) && conn.answer.is_some() {
                next = write_answer(conn);
            }
            if let Next::Close = next {
                if let Some(conn) = self.conns.remove(&token) {
                    self.close(conn);
                }
            }
        }
    }

    /// Reads until the socket has no more; answers a whole request.
    fn read_request(
        conn: &mut Conn,
        bounds: &HttpBounds,
        access: &HttpAccess,
        handler: &Handler,
        stats: &HttpServerStats,
    ) -> Next {
        let mut buf = [0u8; 4096];
        let mut ended = false;
        loop {
            match conn.stream.read(&mut buf) {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => {
                    conn.request.extend_from_slice(&buf[..n]);
                    if conn.request.len() > bounds.max_request_bytes {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return Next::Close,
            }
        }
        if conn.request.len() > bounds.max_request_bytes {
            // Refused whether or not its end came in the same reads.
            stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            stats.served.fetch_add(1, Ordering::Relaxed);
            conn.request = Vec::new();
            conn.answer = Some((HttpResponse::text(431, "request too large\n").encode(false), 0));
            return Next::Keep;
        }
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut req = httparse::Request::new(&mut headers);
        let answer = match req.parse(&conn.request) {
            Ok(httparse::Status::Complete(_)) => {
                let (method, target) = (req.method.unwrap_or(""), req.path.unwrap_or(""));
                let authorization =
                    req.headers.iter().find(|h| h.name.eq_ignore_ascii_case("authorization")).map(|h| h.value);
                let path = target.split(['?', '#']).next().unwrap_or("");
                let answer = if method != "GET" && method != "HEAD" {
                    stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                    HttpResponse::text(405, "only GET and HEAD\n")
                } else if let Err((status, why)) = access.check(conn.peer, authorization) {
                    stats.denied.fetch_add(1, Ordering::Relaxed);
                    HttpResponse::text(status, why)
                } else {
                    // A panic in rendering must not take the listener down with it.
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(path, stats)))
                        .unwrap_or_else(|_| Some(HttpResponse::text(500, "internal error\n")))
                        .unwrap_or_else(|| HttpResponse::text(404, "not found\n"))
                };
                answer.encode(method == "HEAD")
            }
            Ok(httparse::Status::Partial) => return if ended { Next::Close } else { Next::Keep },
            Err(_) => {
                stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                HttpResponse::text(400, "bad request\n").encode(false)
            }
        };
        stats.served.fetch_add(1, Ordering::Relaxed);
        conn.request = Vec::new();
        conn.answer = Some((answer, 0));
        Next::Keep
    }

    /// Writes what the socket takes of the answer; done once it is all written.
    fn write_answer(conn: &mut Conn) -> Next {
        let Some((answer, written)) = &mut conn.answer else { return Next::Keep };
        while *written < answer.len() {
            match conn.stream.write(&answer[*written..]) {
                Ok(0) => return Next::Close,
                Ok(n) => *written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Next::Keep,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => return Next::Close,
            }
        }
        let _ = conn.stream.shutdown(Shutdown::Write);
        Next::Close
    }
}

#[cfg(all(test, feature = "cli"))]
mod tests {
    use std::io::{Read, Write};
    use std::net::TcpStream;
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use super::*;

    /// A server answering `/ok` with "fine" (and panicking at `/panic`).
    fn server(bounds: HttpBounds, access: HttpAccess) -> HttpServer {
        HttpServer::bind("127.0.0.1:0", bounds, access, |path, _| match path {
            "/ok" => Some(HttpResponse::ok("text/plain", "fine".into())),
            "/panic" => panic!("a renderer that panics"),
            _ => None,
        })
        .unwrap()
    }

    /// Sends `request` and reads the answer to its end (status code, body).
    fn exchange(s: &HttpServer, request: &str) -> (u16, String) {
        let mut c = TcpStream::connect(s.local_addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(request.as_bytes()).unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
    }

    fn get(s: &HttpServer, path: &str, extra: &str) -> (u16, String) {
        exchange(s, &format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n"))
    }

    /// Polls `cond` for up to 5 s.
    fn eventually(mut cond: impl FnMut() -> bool) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn answers_routes_and_refuses_what_it_should() {
        let s = server(HttpBounds::default(), HttpAccess::default());
        assert_eq!(get(&s, "/ok", ""), (200, "fine".into()));
        assert_eq!(get(&s, "/ok?x=1", "").0, 200, "the query is not part of the path");
        assert_eq!(get(&s, "/nothing", "").0, 404);
        assert_eq!(exchange(&s, "POST /ok HTTP/1.1\r\nContent-Length: 0\r\n\r\n").0, 405);
        assert_eq!(exchange(&s, "\x01\x02 garbage\r\n\r\n").0, 400);
        let (code, body) = exchange(&s, "HEAD /ok HTTP/1.1\r\n\r\n");
        assert_eq!((code, body.as_str()), (200, ""), "HEAD has no body");
        // Just over the 8 KiB bound (all of it read, so closing sends no reset).
        let huge = format!("GET /ok HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(8400));
        assert_eq!(exchange(&s, &huge).0, 431);
        // A renderer's panic is a 500, and the server goes on.
        assert_eq!(get(&s, "/panic", "").0, 500);
        assert_eq!(get(&s, "/ok", "").0, 200);
        assert_eq!(s.stats().served.load(Ordering::Relaxed), 9);
    }

    #[test]
    fn with_a_secret_only_its_bearer_is_answered() {
        let s = server(HttpBounds::default(), HttpAccess { secret: Some("sesame".into()), insecure: false });
        assert_eq!(get(&s, "/ok", "").0, 401);
        assert_eq!(get(&s, "/ok", "Authorization: Bearer other\r\n").0, 401);
        assert_eq!(get(&s, "/ok", "authorization: Bearer sesame\r\n"), (200, "fine".into()));
        assert_eq!(s.stats().denied.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn half_a_request_is_dropped_after_the_timeout() {
        let bounds = HttpBounds { request_timeout: Duration::from_millis(300), ..Default::default() };
        let s = server(bounds, HttpAccess::default());
        let mut c = TcpStream::connect(s.local_addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n").unwrap();
        let start = Instant::now();
        let mut buf = [0u8; 64];
        // Closed without an answer (end of stream, or a reset).
        assert_eq!(c.read(&mut buf).unwrap_or(0), 0);
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(250) && waited < Duration::from_secs(3), "{waited:?}");
        assert_eq!(s.stats().timeouts.load(Ordering::Relaxed), 1);
        assert!(eventually(|| s.stats().open.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn a_crowd_of_idle_connections_holds_no_more_than_the_cap_and_a_scraper_gets_in() {
        let bounds = HttpBounds { max_connections: 8, request_timeout: Duration::from_secs(30), ..Default::default() };
        let s = server(bounds, HttpAccess::default());
        let idle: Vec<TcpStream> = (0..100)
            .map(|_| {
                let mut c = TcpStream::connect(s.local_addr()).unwrap();
                let _ = c.write_all(b"GET /ok HTTP/1.1\r\n");
                c
            })
            .collect();
        assert!(eventually(|| s.stats().accepted.load(Ordering::Relaxed) == 100));
        assert_eq!(s.stats().open.load(Ordering::Relaxed), 8);
        assert_eq!(s.stats().evicted.load(Ordering::Relaxed), 92);
        // A whole request gets its answer at once, long before the idle ones time out.
        let start = Instant::now();
        assert_eq!(get(&s, "/ok", ""), (200, "fine".into()));
        assert!(start.elapsed() < Duration::from_secs(2));
        drop(idle);
        assert!(eventually(|| s.stats().open.load(Ordering::Relaxed) == 0), "closed by their peers");
    }

    #[test]
    fn dropping_the_server_stops_it() {
        let s = server(HttpBounds::default(), HttpAccess::default());
        let addr = s.local_addr();
        let _idle = TcpStream::connect(addr).unwrap();
        drop(s);
        assert!(TcpStream::connect(addr).is_err(), "the listener is closed");
    }
}
