//! Prometheus text and JSON status of a master (served by `mooncake-master
//! --metrics-listen`), and the bounded HTTP server that serves them.
//!
//! The server ([`HttpServer`], in the `http` module) is one thread over one `mio`
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

use mooncake_core::rpc::{RpcServerStats, REQUEST_KINDS};
use mooncake_core::MasterStats;

use crate::http::{HttpAccess, HttpBounds, HttpResponse, HttpServer, HttpServerStats};

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
        "Storage nodes forgotten because their record endpoint was gone or failed for a whole client TTL.",
        "counter",
        stats.record_failures as f64,
    );
    gauge(
        "declared_puts_total",
        "Puts whose records went to their nodes while their bytes were written (checksum declared before the end).",
        "counter",
        stats.declared_puts as f64,
    );
    gauge(
        "held_placements",
        "Room clients hold ahead of their next put (place_ahead), not bound yet.",
        "gauge",
        stats.held_placements as f64,
    );
    gauge(
        "bound_puts_total",
        "Puts written into room held ahead and bound to their key (put_bind).",
        "counter",
        stats.bound_puts as f64,
    );
    gauge(
        "stale_copies_total",
        "Records and disk files nodes offered back that were refused as older than the key's last put or remove.",
        "counter",
        stats.stale_copies as f64,
    );
    gauge(
        "carried_tombstones_total",
        "Removals handed to storage nodes to keep for a restarted master (their key's copies may have been out of sight).",
        "counter",
        stats.carried_tombstones as f64,
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
                "rpc_crowded_out_total",
                "Connections closed in their handshake to make room (too many waited).",
                "counter",
                &rpc.crowded_out,
            ),
            (
                "auth_failures_total",
                "Connections that failed the shared-secret handshake.",
                "counter",
                &rpc.auth_failures,
            ),
            (
                "rpc_frame_timeouts_total",
                "Connections closed for stopping halfway through a frame.",
                "counter",
                &rpc.frame_timeouts,
            ),
            (
                "rpc_handler_panics_total",
                "Requests whose handler panicked (answered with an error).",
                "counter",
                &rpc.handler_panics,
            ),
            ("rpc_buffered_bytes", "Bytes of request bodies reserved now (a frame's whole announced body from its header on, until it is answered).", "gauge", &rpc.buffered_bytes),
            (
                "rpc_over_budget_total",
                "Requests refused with an error for what decoding them would allocate.",
                "counter",
                &rpc.over_budget,
            ),
            (
                "rpc_decoding_bytes",
                "Bytes charged for decoded requests being answered now.",
                "gauge",
                &rpc.decoding_bytes,
            ),
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
pub fn cluster_prometheus_text(stats: &mooncake_core::cluster::MemberStats) -> String {
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
pub fn render_master(daemon: &mooncake_core::MasterDaemon, path: &str, http: &HttpServerStats) -> Option<HttpResponse> {
    let stats = || daemon.master().stats();
    match path {
        "/metrics" => {
            let mut text = prometheus_text(&stats(), Some(daemon.rpc_stats()));
            if let Some(c) = &daemon.cluster_stats() {
                text.push_str(&cluster_prometheus_text(c));
            }
            text.push_str(&drain_prometheus_text(&daemon.master().drains()));
            text.push_str(&http_prometheus_text(http));
            Some(HttpResponse::ok("text/plain; version=0.0.4", text))
        }
        "/get_all_segments" => {
            Some(HttpResponse::ok(crate::segments::CONTENT_TYPE, crate::segments::all_segments_text(&stats())))
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

/// The drains a master knows of, one series per node (label `node`): objects and
/// bytes moved, left and lost, and whether the node finished.
pub fn drain_prometheus_text(drains: &[mooncake_core::DrainProgress]) -> String {
    let mut out = String::new();
    if drains.is_empty() {
        return out;
    }
    type Series = (&'static str, &'static str, fn(&mooncake_core::DrainProgress) -> u64);
    let series: [Series; 7] = [
        (
            "drain_objects_moved",
            "Objects a draining node moved away (copied, dropped as replicated elsewhere, or to its SSD tier).",
            |p| p.objects_moved(),
        ),
        ("drain_bytes_moved", "Bytes of drain_objects_moved.", |p| p.bytes_moved()),
        ("drain_objects_left", "Objects a draining node has still to move.", |p| p.objects_left),
        ("drain_bytes_left", "Bytes of drain_objects_left.", |p| p.bytes_left),
        ("drain_objects_lost", "Objects a drain could move nowhere before its grace period ended.", |p| p.objects_lost),
        ("drain_bytes_lost", "Bytes of drain_objects_lost.", |p| p.bytes_lost),
        ("drain_done", "1 once the node finished its drain.", |p| u64::from(p.done)),
    ];
    for (name, help, value) in series {
        let _ = writeln!(out, "# HELP mooncake_{name} {help}\n# TYPE mooncake_{name} gauge");
        for p in drains {
            let node = p.node.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            let _ = writeln!(out, "mooncake_{name}{{node=\"{node}\"}} {}", value(p));
        }
    }
    out
}

/// The value of `name` in a query string (`a=1&b=2`), percent-decoded; `None` when
/// absent or not valid UTF-8 once decoded.
fn query_value(query: &str, name: &str) -> Option<String> {
    let raw = query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// The answer of the master's listener to a `POST`: `/drain?segment=NAME[&grace=SECS]`
/// drains the storage node NAME names (its segment name `endpoint#n`, or its
/// endpoint; `#` written `%23`) and answers where its drain stands (JSON).
pub fn post_master(daemon: &mooncake_core::MasterDaemon, path: &str, query: &str) -> Option<HttpResponse> {
    if path != "/drain" {
        return None;
    }
    let Some(segment) = query_value(query, "segment").filter(|s| !s.is_empty()) else {
        return Some(HttpResponse::text(400, "POST /drain?segment=NAME[&grace=SECS]\n"));
    };
    let grace = match query_value(query, "grace").map(|g| g.parse::<f64>()) {
        None => 30.0,
        Some(Ok(g)) if (0.0..=86_400.0).contains(&g) => g,
        Some(_) => return Some(HttpResponse::text(400, "grace: seconds in 0..=86400\n")),
    };
    match daemon.master().drain_segment(&segment, (grace * 1000.0) as u64) {
        Ok(p) if p.segments == 0 => Some(HttpResponse::text(404, "no such segment\n")),
        Ok(p) => Some(HttpResponse::ok("application/json", serde_json::to_string_pretty(&p).unwrap_or_default())),
        Err(e) => Some(HttpResponse::text(400, &format!("{e}\n"))),
    }
}

/// Serves `daemon`'s `/metrics` and `/status` on `addr` (`host:port`; port 0 picks
/// one, see [`HttpServer::local_addr`]), and `POST /drain`, until the returned server
/// is dropped.
pub fn serve_master(
    addr: &str,
    daemon: std::sync::Arc<mooncake_core::MasterDaemon>,
    access: HttpAccess,
    bounds: HttpBounds,
) -> std::io::Result<HttpServer> {
    let posting = daemon.clone();
    HttpServer::bind_with_post(
        addr,
        bounds,
        access,
        move |path, http| render_master(&daemon, path, http),
        Box::new(move |path, query| post_master(&posting, path, query)),
    )
}

#[cfg(test)]
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
        exchange(s, &format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n"))
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
    fn a_post_reaches_the_post_handler_behind_the_access_check() {
        let access = HttpAccess { token: Some("sesame".into()), insecure: false };
        let s = HttpServer::bind_with_post(
            "127.0.0.1:0",
            HttpBounds::default(),
            access,
            |_, _| None,
            Box::new(|path, query| (path == "/act").then(|| HttpResponse::ok("text/plain", format!("{path} {query}")))),
        )
        .unwrap();
        let post = |target: &str, auth: &str| {
            exchange(&s, &format!("POST {target} HTTP/1.1\r\n{auth}Content-Length: 0\r\n\r\n"))
        };
        assert_eq!(post("/act?x=1", "").0, 401, "the token guards POSTs too");
        let bearer = "Authorization: Bearer sesame\r\n";
        assert_eq!(post("/act?x=1#frag", bearer), (200, "/act x=1".into()));
        assert_eq!(post("/other", bearer).0, 404);
        assert_eq!(exchange(&s, "PUT /act HTTP/1.1\r\nAuthorization: Bearer sesame\r\n\r\n").0, 405);
    }

    #[test]
    fn query_values_are_percent_decoded_and_bad_ones_refused() {
        assert_eq!(query_value("segment=127.0.0.1%3A5000%231&grace=3", "segment").as_deref(), Some("127.0.0.1:5000#1"));
        assert_eq!(query_value("segment=a+b", "segment").as_deref(), Some("a b"));
        assert_eq!(query_value("grace=3", "segment"), None);
        assert_eq!(query_value("segment=%zz", "segment"), None);
        assert_eq!(query_value("segment=%4", "segment").as_deref(), Some("%4"));
        assert_eq!(query_value("segment=%ff", "segment"), None, "not UTF-8");
        let p = mooncake_core::DrainProgress { node: "h:\"1".into(), objects_left: 3, ..Default::default() };
        let text = drain_prometheus_text(&[p]);
        assert!(text.contains("mooncake_drain_objects_left{node=\"h:\\\"1\"} 3"), "{text}");
    }

    #[test]
    fn requests_from_web_pages_are_refused() {
        // Loopback and no token: a page on the master's host would be let in without
        // the Origin check (a POST to /drain, or the metrics through a rebound name).
        let s = server(HttpBounds::default(), HttpAccess { token: None, insecure: false });
        assert_eq!(get(&s, "/ok", ""), (200, "fine".into()));
        assert_eq!(get(&s, "/ok", "Origin: http://evil.example\r\n").0, 403);
        let t = server(HttpBounds::default(), HttpAccess { token: Some("sesame".into()), insecure: false });
        assert_eq!(get(&t, "/ok", "Authorization: Bearer sesame\r\norigin: null\r\n").0, 403);
        assert_eq!(s.stats().denied.load(Ordering::Relaxed) + t.stats().denied.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn with_a_secret_only_its_bearer_is_answered() {
        let s = server(HttpBounds::default(), HttpAccess { token: Some("sesame".into()), insecure: false });
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
        // The last admission counts itself first and closes the oldest before it
        // opens: `open` reads 7 for a moment. Then it settles at the cap.
        let settled = || (s.stats().open.load(Ordering::Relaxed), s.stats().evicted.load(Ordering::Relaxed));
        assert!(eventually(|| settled() == (8, 92)), "{:?}", settled());
        assert_eq!(settled(), (8, 92), "and stays there");
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
