//! The master's metrics, status and drain listener (`mooncake_cli::http::HttpServer`)
//! as it reads a client's request (in whatever pieces it arrives), on real servers
//! over loopback: one with a token and a `POST` handler, one without a token with a
//! `POST` handler, and one `GET`-only with a small request limit. Never a panic or a
//! hang (the server answers or closes once the client has closed its side), always a
//! well-formed `HTTP/1.1` answer or none, and never a handler run for a request the
//! access check must refuse: without the token (on the token server) or with an
//! `Origin` header.
#![no_main]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mooncake_cli::http::{HttpAccess, HttpBounds, HttpResponse, HttpServer, HttpServerStats};

#[path = "common/loopback.rs"]
mod loopback;

/// The token of server 0.
const TOKEN: &str = "fuzz-token";
/// What a request must carry to be let in by server 0 (as a substring: a header's
/// value is a contiguous slice of the request).
const BEARER: &[u8] = b"Bearer fuzz-token";
/// Server 2's request limit: small enough for inputs to reach the 431 answer.
const SMALL_REQUEST: usize = 256;

/// How often each server's `GET`/`HEAD` handler and `POST` handler ran.
static GET_RUNS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];
static POST_RUNS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

/// Server 0: a token and a `POST` handler; 1: no token, a `POST` handler; 2: no
/// token, `GET` only, a small request limit. Each serves `/metrics` and (with a
/// `POST` handler) `POST /drain`; other paths are 404.
static SERVERS: LazyLock<[HttpServer; 3]> = LazyLock::new(|| {
    let get = |i: usize| {
        move |path: &str, _: &HttpServerStats| {
            GET_RUNS[i].fetch_add(1, Ordering::SeqCst);
            (path == "/metrics").then(|| HttpResponse::ok("text/plain", "up 1\n".into()))
        }
    };
    let post = |i: usize| -> Box<mooncake_cli::http::PostHandler> {
        Box::new(move |path: &str, query: &str| {
            POST_RUNS[i].fetch_add(1, Ordering::SeqCst);
            (path == "/drain").then(|| HttpResponse::ok("application/json", format!("{{\"query\":{}}}\n", query.len())))
        })
    };
    let bounds = HttpBounds::default();
    let token = HttpAccess { token: Some(TOKEN.into()), insecure: false };
    let open = HttpAccess { token: None, insecure: false };
    let bind = "127.0.0.1:0";
    [
        HttpServer::bind_with_post(bind, bounds, token, get(0), post(0)).expect("a token server on loopback"),
        HttpServer::bind_with_post(bind, bounds, open.clone(), get(1), post(1)).expect("a server on loopback"),
        HttpServer::bind(bind, HttpBounds { max_request_bytes: SMALL_REQUEST, ..bounds }, open, get(2))
            .expect("a GET-only server on loopback"),
    ]
});

/// Sizes of the pieces the request is written in.
const PIECES: [usize; 16] = [1, 2, 3, 4, 7, 8, 16, 31, 64, 100, 127, 256, 512, 1000, 4096, usize::MAX];

/// Whether `hay` contains `needle`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The request without the empty lines `httparse` skips before its request line.
fn trimmed(request: &[u8]) -> &[u8] {
    let start = request.iter().position(|&b| b != b'\r' && b != b'\n').unwrap_or(request.len());
    &request[start..]
}

/// Whether a request that `httparse` parsed whole carried an `Origin` header: a line
/// (after the request line, before the first empty line) naming it. Only meaningful
/// for a request that was parsed, as one whose handler ran was.
fn has_origin(request: &[u8]) -> bool {
    let request = trimmed(request);
    let end = (0..request.len())
        .find(|&i| request[i..].starts_with(b"\n\n") || request[i..].starts_with(b"\n\r\n"))
        .unwrap_or(request.len());
    let head = &request[..end];
    head.iter()
        .enumerate()
        .any(|(i, &b)| b == b'\n' && head.get(i + 1..i + 8).is_some_and(|name| name.eq_ignore_ascii_case(b"origin:")))
}

/// The status of a whole answer, checking its form: status line, headers,
/// `Content-Length` and the body it counts (none for a `HEAD`, whose answer omits it).
fn check_answer(answer: &[u8], head_request: bool) -> u16 {
    assert!(answer.len() >= 13, "a truncated answer: {:?}", String::from_utf8_lossy(answer));
    assert_eq!(&answer[..9], b"HTTP/1.1 ", "not an HTTP/1.1 answer: {:?}", String::from_utf8_lossy(answer));
    assert!(answer[9..12].iter().all(u8::is_ascii_digit) && answer[12] == b' ', "a status line without a status");
    let status: u16 = std::str::from_utf8(&answer[9..12]).unwrap().parse().unwrap();
    let end = (0..answer.len()).find(|&i| answer[i..].starts_with(b"\r\n\r\n")).expect("an answer without a head end");
    let head = std::str::from_utf8(&answer[..end]).expect("a head that is not text");
    let length: usize = head
        .split("\r\n")
        .find_map(|line| line.strip_prefix("Content-Length: "))
        .expect("an answer without Content-Length")
        .parse()
        .expect("a Content-Length that is no number");
    let body = &answer[end + 4..];
    // The 400 and 431 answers carry their body whatever the method (it is not known).
    if head_request && status != 400 && status != 431 {
        assert!(body.is_empty(), "a body in the answer to a HEAD");
    } else {
        assert_eq!(body.len(), length, "a body of another length than its Content-Length");
    }
    status
}

fuzz_target!(|data: &[u8]| {
    // Bits 0-1: the server; 2: insert the token's header after the first line; 3:
    // insert an Origin header there; 4-7: the size of the pieces written.
    let Some((&how, data)) = data.split_first() else { return };
    let which = usize::from(how & 3) % 3;
    let server = &SERVERS[which];
    let mut request = Vec::with_capacity(data.len() + 64);
    let first_line = data.iter().position(|&b| b == b'\n').map_or(data.len(), |i| i + 1);
    request.extend_from_slice(&data[..first_line]);
    if how & 4 != 0 {
        request.extend_from_slice(b"Authorization: Bearer fuzz-token\r\n");
    }
    if how & 8 != 0 {
        request.extend_from_slice(b"Origin: http://page.example\r\n");
    }
    request.extend_from_slice(&data[first_line..]);
    let piece = PIECES[usize::from(how >> 4)];

    let (gets, posts) = (GET_RUNS[which].load(Ordering::SeqCst), POST_RUNS[which].load(Ordering::SeqCst));
    // The server closes every connection within its 3 s request timeout: far
    // longer is a hang.
    let c = loopback::connect(server.local_addr(), Duration::from_secs(10));
    loopback::send_in_pieces(&c, &request, piece);
    let (answer, whole) = loopback::finish(c);
    let gets = GET_RUNS[which].load(Ordering::SeqCst) - gets;
    let posts = POST_RUNS[which].load(Ordering::SeqCst) - posts;
    let runs = gets + posts;
    assert!(runs <= 1, "{gets} GET and {posts} POST handler runs for one request");

    let prefix = answer.len().min(9);
    assert_eq!(
        answer[..prefix],
        b"HTTP/1.1 "[..prefix],
        "not an HTTP/1.1 answer: {:?}",
        String::from_utf8_lossy(&answer)
    );
    if whole && !answer.is_empty() {
        let status = check_answer(&answer, trimmed(&request).starts_with(b"HEAD "));
        assert!(matches!(status, 200 | 400 | 401 | 403 | 404 | 405 | 431), "an unexpected status {status}");
        // The handlers answer 200 or 404 (and never panic); everything else is a
        // refusal before them.
        assert_eq!(runs == 1, matches!(status, 200 | 404), "status {status} after {runs} handler runs");
    }
    if runs == 1 {
        assert!(!has_origin(&request), "a request with an Origin header was let in");
        if which == 0 {
            assert!(contains(&request, BEARER), "a request without the token was let in");
        }
        let method = trimmed(&request);
        if posts == 1 {
            assert!(method.starts_with(b"POST "), "the POST handler ran for another method");
        } else {
            assert!(
                method.starts_with(b"GET ") || method.starts_with(b"HEAD "),
                "the GET handler ran for a {:?}",
                String::from_utf8_lossy(&method[..method.len().min(8)])
            );
        }
    }
});
