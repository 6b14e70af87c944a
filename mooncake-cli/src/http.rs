//! The bounded HTTP server of the master's metrics listener: one thread over one
//! `mio` poll, a connection cap, a deadline per request, a request-size limit, and
//! back-off (never a panic) when the process is out of descriptors.

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
    /// With a token: only requests carrying `Authorization: Bearer <token>` (others
    /// are answered 401). A master with a shared secret uses
    /// [`SharedSecret::http_token`](mooncake_transfer::SharedSecret::http_token), never
    /// the secret itself: the token crosses the wire in clear and sits in scrape
    /// configurations.
    pub token: Option<String>,
    /// Without a token: any peer (otherwise loopback peers only; others are
    /// answered 403).
    pub insecure: bool,
}

/// The request headers access depends on: `Authorization`, `Origin`, `Host`.
type AccessHeaders<'a> = (Option<&'a [u8]>, Option<&'a [u8]>, Option<&'a [u8]>);

/// What a request without the token is told when its `Host` names the listener by
/// a DNS name of someone else's.
const FOREIGN_HOST: &str = "the Host header must name this listener by an IP address, `localhost`, or the name it \
     listens on (other DNS names are refused against DNS rebinding); or set MOONCAKE_SECRET and send the token\n";

/// The name a listener address was given (`master-1` of `master-1:9003`), if it is
/// not an IP address: a `Host` naming it is the listener's own.
fn configured_name(addr: &str) -> Option<String> {
    let (host, _) = addr.rsplit_once(':')?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let host = host.strip_suffix('.').unwrap_or(host);
    (host.parse::<std::net::IpAddr>().is_err() && !host.is_empty()).then(|| host.to_ascii_lowercase())
}

/// Whether a `Host` header's value names the listener in a way a rebound DNS name
/// cannot: an IP address (`127.0.0.1:9003`, `[::1]`), `localhost`, or `own` (the
/// name the listener was configured with), with or without a port.
fn host_is_safe(host: &[u8], own: Option<&str>) -> bool {
    let Ok(host) = std::str::from_utf8(host) else { return false };
    let host = host.trim();
    let port_ok = |p: &str| p.is_empty() || p.parse::<u16>().is_ok();
    if let Some(rest) = host.strip_prefix('[') {
        return match rest.split_once(']') {
            Some((v6, "")) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
            Some((v6, tail)) => tail.strip_prefix(':').is_some_and(port_ok) && v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => false,
        };
    }
    let name = match host.rsplit_once(':') {
        Some((name, port)) if port_ok(port) => name,
        Some(_) => return false,
        None => host,
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || own.is_some_and(|own| name.eq_ignore_ascii_case(own))
}

impl HttpAccess {
    /// Whether a request from `peer` with `authorization` (the header's value),
    /// `origin` and `host` may be answered by a listener configured as `own` (its
    /// address's name, if not an IP address); the refusal's status and text
    /// otherwise.
    ///
    /// A request with an `Origin` header comes from a web page (browsers send it on
    /// every cross-origin request and every POST; scrapers and `curl` do not): it is
    /// refused, so that a page open on the master's host cannot post to `/drain`.
    /// A same-origin `GET` carries no `Origin`: a page served from a DNS name that
    /// its owner then rebinds to the master's address reads the answers as its own
    /// unless the `Host` is checked. So, without a token, a `Host` must name the
    /// listener by an IP address, `localhost`, or its configured name (a request
    /// without one, HTTP/1.0, is no browser's).
    fn check(
        &self,
        peer: SocketAddr,
        (authorization, origin, host): AccessHeaders<'_>,
        own: Option<&str>,
    ) -> Result<(), (u16, &'static str)> {
        if origin.is_some() {
            return Err((403, "requests from web pages (with an Origin header) are refused\n"));
        }
        if self.token.is_none() && host.is_some_and(|h| !host_is_safe(h, own)) {
            return Err((403, FOREIGN_HOST));
        }
        match &self.token {
            Some(token) => {
                let sent = authorization.and_then(|v| v.strip_prefix(b"Bearer "));
                // Compare keyed digests, not the strings: the time taken tells
                // nothing of the token.
                let digest = |s: &[u8]| mooncake_transfer::SharedSecret::new(s).answer(&[0; 32]);
                match sent {
                    Some(t) if digest(t) == digest(token.as_bytes()) => Ok(()),
                    _ => Err((
                        401,
                        "send the metrics token (`mooncake-client metrics-token` prints it): \
                         Authorization: Bearer <token>\n",
                    )),
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

    /// A plain-text answer with `status`.
    pub fn text(status: u16, body: &str) -> Self {
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

/// The handler of `POST`s: the answer to a `POST` of a path with its query string
/// (`None`: 404).
pub type PostHandler = dyn Fn(&str, &str) -> Option<HttpResponse> + Send;

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
        Self::bind_inner(addr, bounds, access, Box::new(handler), None)
    }

    /// [`bind`](Self::bind), also answering each `POST` that `access` allows with
    /// `post(path, query)` (actions, such as the master's `/drain`; the body is not
    /// read).
    pub fn bind_with_post(
        addr: &str,
        bounds: HttpBounds,
        access: HttpAccess,
        handler: impl Fn(&str, &HttpServerStats) -> Option<HttpResponse> + Send + 'static,
        post: Box<PostHandler>,
    ) -> std::io::Result<Self> {
        Self::bind_inner(addr, bounds, access, Box::new(handler), Some(post))
    }

    fn bind_inner(
        addr: &str,
        bounds: HttpBounds,
        access: HttpAccess,
        handler: Box<Handler>,
        post: Option<Box<PostHandler>>,
    ) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let mut listener = TcpListener::from_std(listener);
        let own_name = configured_name(addr);
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
            own_name,
            handler,
            post,
            stats: stats.clone(),
            conns: BTreeMap::new(),
            next_token: FIRST_CONNECTION,
            accept_ready: true,
            paused_until: None,
            spare: spare_descriptor(),
            warnings: Warnings::default(),
        };
        let thread_stop = stop.clone();
        let thread =
            std::thread::Builder::new().name("mooncake-metrics".into()).spawn(move || event_loop.run(&thread_stop))?;
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
    /// The name the listener was configured with, if not an IP address.
    own_name: Option<String>,
    handler: Box<Handler>,
    post: Option<Box<PostHandler>>,
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
        if self.poll.registry().register(&mut stream, Token(token), Interest::READABLE | Interest::WRITABLE).is_err() {
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
            let access = (&self.access, self.own_name.as_deref());
            next = read_request(conn, &self.bounds, access, (&*self.handler, self.post.as_deref()), &self.stats);
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
    (access, own_name): (&HttpAccess, Option<&str>),
    (handler, post): (&Handler, Option<&PostHandler>),
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
            let header = |name: &str| req.headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| h.value);
            let headers = (header("authorization"), header("origin"), header("host"));
            let path = target.split(['?', '#']).next().unwrap_or("");
            let query = target.split_once('?').map_or("", |(_, q)| q.split('#').next().unwrap_or(""));
            let post = post.filter(|_| method == "POST");
            let answer = if method != "GET" && method != "HEAD" && post.is_none() {
                stats.bad_requests.fetch_add(1, Ordering::Relaxed);
                HttpResponse::text(405, "only GET and HEAD\n")
            } else if let Err((status, why)) = access.check(conn.peer, headers, own_name) {
                stats.denied.fetch_add(1, Ordering::Relaxed);
                HttpResponse::text(status, why)
            } else if let Some(post) = post {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| post(path, query)))
                    .unwrap_or_else(|_| Some(HttpResponse::text(500, "internal error\n")))
                    .unwrap_or_else(|| HttpResponse::text(404, "not found\n"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_that_no_rebound_name_can_be() {
        for host in [
            "127.0.0.1",
            "127.0.0.1:9003",
            "10.1.2.3:80",
            "localhost",
            "LocalHost:9003",
            "localhost.:1",
            "[::1]",
            "[::1]:9003",
            "[fe80::1]:",
            "metrics.example",
            "Metrics.Example:9003",
        ] {
            assert!(host_is_safe(host.as_bytes(), Some("metrics.example")), "{host}");
        }
        for host in [
            "evil.example",
            "evil.example:9003",
            "metrics.example.evil.example",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "127.0.0.1:x",
            "::1",
            "[::1]x",
            "[evil.example]:1",
            "",
            "\u{ff}",
        ] {
            assert!(!host_is_safe(host.as_bytes(), Some("metrics.example")), "{host}");
        }
        assert!(!host_is_safe(b"metrics.example", None), "only the listener's own name");
        assert!(!host_is_safe(&[0xff, 0xfe], None));
        assert_eq!(configured_name("Metrics.Example:9003").as_deref(), Some("metrics.example"));
        assert_eq!(configured_name("0.0.0.0:9003"), None);
        assert_eq!(configured_name("[::]:9003"), None);
        assert_eq!(configured_name("127.0.0.1:0"), None);
    }

    /// Answers `request` sent to `s` with its status code.
    fn status(s: &HttpServer, request: &str) -> u16 {
        use std::io::Read as _;
        let mut c = std::net::TcpStream::connect(s.local_addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        std::io::Write::write_all(&mut c, request.as_bytes()).unwrap();
        let mut text = String::new();
        c.read_to_string(&mut text).unwrap();
        text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
    }

    /// Without a token, a request naming the listener by a DNS name of someone
    /// else's (a page that rebound its name to the master's address) is refused;
    /// an IP address, `localhost` or no `Host` at all is answered. With a token, the
    /// token decides.
    #[test]
    fn without_a_token_a_foreign_host_is_refused() {
        let ok = |_: &str, _: &HttpServerStats| Some(HttpResponse::ok("text/plain", "fine".into()));
        for insecure in [false, true] {
            let s = HttpServer::bind("127.0.0.1:0", HttpBounds::default(), HttpAccess { token: None, insecure }, ok)
                .unwrap();
            let port = s.local_addr().port();
            let get = |host: &str| status(&s, &format!("GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n"));
            assert_eq!(get("rebound.evil.example"), 403);
            assert_eq!(get(&format!("rebound.evil.example:{port}")), 403);
            assert_eq!(get(&format!("127.0.0.1:{port}")), 200);
            assert_eq!(get(&format!("localhost:{port}")), 200);
            assert_eq!(status(&s, "GET /metrics HTTP/1.0\r\n\r\n"), 200, "no Host: no browser");
            assert_eq!(s.stats().denied.load(Ordering::Relaxed), 2);
        }
        let token = HttpAccess { token: Some("sesame".into()), insecure: false };
        let s = HttpServer::bind("127.0.0.1:0", HttpBounds::default(), token, ok).unwrap();
        let get = |auth: &str| status(&s, &format!("GET /metrics HTTP/1.1\r\nHost: scrape.example\r\n{auth}\r\n"));
        assert_eq!(get("Authorization: Bearer sesame\r\n"), 200);
        assert_eq!(get(""), 401);
    }
}
