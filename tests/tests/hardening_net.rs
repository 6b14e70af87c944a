//! The network hardening of the real binaries: bounded memory per peer, many idle
//! connections under a low descriptor limit, protected mode, bearer-token metrics,
//! and one-line authentication errors in under a second.

mod support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use mooncake_core::rpc::wire::{encode_frame, FrameHeader, FrameKind, Request};
use support::{bin, http_request, unique_dir, Cluster, Proc};

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// Raises this process's descriptor limit to its hard limit (the tests hold
/// more than a thousand sockets).
fn raise_fd_limit() {
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("prlimit").args(["--pid", &pid, "--nofile=unlimited:"]).status();
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let hard = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(4).map(str::to_owned))
        .unwrap();
    let _ = std::process::Command::new("prlimit").args(["--pid", &pid, &format!("--nofile={hard}:")]).status();
}

/// Starts a master with `args` (and `env`) on a free loopback port.
fn master(prefix: &[&str], args: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
    let mut argv = vec!["--listen", "127.0.0.1:0"];
    argv.extend_from_slice(args);
    let p = Proc::spawn_env(prefix, &bin("mooncake-master"), &argv, env);
    let addr = p.first_line.rsplit(' ').next().unwrap().to_owned();
    (p, addr)
}

/// Runs a one-shot client; returns (exit code, stderr, seconds it took).
fn client(args: &[&str], env: &[(&str, &str)]) -> (i32, String, f64) {
    let start = Instant::now();
    let out = std::process::Command::new(bin("mooncake-client"))
        .env_remove("MOONCAKE_SECRET")
        .envs(env.iter().copied())
        .args(args)
        .output()
        .unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned(), start.elapsed().as_secs_f64())
}

/// A connection that completed its hello (one request answered), then stays idle.
fn idle_client(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&encode_frame(FrameKind::Request, 1, &Request::Stats {}).unwrap()).unwrap();
    mooncake_core::rpc::read_frame(&mut s, 1 << 20).unwrap();
    s
}

/// A non-loopback address of this machine, if it has one with a route.
fn local_non_loopback_ip() -> Option<std::net::IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("10.255.255.254:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn headers_announcing_huge_bodies_cost_the_master_no_memory() {
    let (m, addr) = master(&[], &[], &[]);
    let before = rss(m.child.id());
    let header = FrameHeader { kind: FrameKind::Request, request_id: 1, body_len: 64 << 20 }.encode();
    let socks: Vec<TcpStream> = (0..64)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(&header).unwrap();
            // And some of the body, which is all the memory it may cost.
            s.write_all(&[0u8; 4096]).unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let after = rss(m.child.id());
    assert!(after < before + (64 << 20), "RSS grew from {before} to {after} bytes");
    // The master still serves.
    let (code, err, _) = client(&["ls", "--master", &addr], &[]);
    assert_eq!(code, 0, "{err}");
    drop(socks);
}

#[test]
fn a_master_under_a_low_descriptor_limit_holding_1000_idle_sockets_serves_a_client() {
    raise_fd_limit();
    let (_m, addr) = master(&["prlimit", "--nofile=1024:1024", "--"], &[], &[]);
    let socks: Vec<TcpStream> = (0..1000).map(|_| idle_client(&addr)).collect();
    let (code, err, secs) = client(&["ls", "--master", &addr], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(secs < 5.0, "the client took {secs:.1} s");
    assert_eq!(socks.len(), 1000);
}

#[test]
fn a_connection_that_never_says_hello_is_closed() {
    let (_m, addr) = master(&[], &[], &[]);
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let start = Instant::now();
    let mut buf = [0u8; 1];
    // Closed (end of stream) by the master within its 5 s hello timeout.
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0);
    let waited = start.elapsed();
    assert!(waited >= Duration::from_secs(4) && waited < Duration::from_secs(10), "{waited:?}");
    // Authenticated idle connections stay.
    let mut idle = idle_client(&addr);
    idle.set_read_timeout(Some(Duration::from_secs(7))).unwrap();
    let e = idle.read(&mut buf).unwrap_err();
    assert!(matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{e}");
}

#[test]
fn connections_beyond_the_limit_are_refused_with_a_message() {
    let (_m, addr) = master(&[], &["--max-connections", "8"], &[]);
    let _held: Vec<TcpStream> = (0..8).map(|_| idle_client(&addr)).collect();
    let (code, err, secs) = client(&["ls", "--master", &addr], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("too many connections (limit 8)"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(secs < 1.0, "{secs}");
}

#[test]
fn refusals_and_open_connections_show_in_the_metrics() {
    let c = Cluster::start(&["--max-connections", "4"], 0);
    let _held: Vec<TcpStream> = (0..4).map(|_| idle_client(&c.master_addr)).collect();
    let (code, _, _) = client(&["ls", "--master", &c.master_addr], &[]);
    assert_eq!(code, 1);
    let metrics = c.metrics();
    assert!(metrics.contains("mooncake_open_connections 4"), "{metrics}");
    assert!(metrics.contains("mooncake_refused_connections_total 1"), "{metrics}");
}

#[test]
fn authentication_errors_are_one_clear_line_in_under_a_second() {
    let secret = [("MOONCAKE_SECRET", "right")];
    let (_guarded, guarded) = master(&[], &[], &secret);
    let (_open, open) = master(&[], &[], &[]);
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(&str, Env, &str); 3] = [
        (&guarded, &[("MOONCAKE_SECRET", "wrong")], "wrong secret"),
        (&guarded, &[], "requires a shared secret"),
        (&open, &secret, "has no shared secret"),
    ];
    for (addr, env, expect) in cases {
        let (code, err, secs) = client(&["ls", "--master", addr], env);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(expect), "expected {expect:?} in {err:?}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(secs < 1.0, "{expect}: {secs:.2} s");
    }
    // The right secret works.
    let (code, err, _) = client(&["ls", "--master", &guarded], &secret);
    assert_eq!(code, 0, "{err}");
    // An empty secret is an error, in the client and in the master.
    let (code, err, _) = client(&["ls", "--master", &guarded], &[("MOONCAKE_SECRET", "")]);
    assert_eq!(code, 1);
    assert!(err.contains("MOONCAKE_SECRET is set but empty"), "{err}");
    let out = std::process::Command::new(bin("mooncake-master"))
        .args(["--listen", "127.0.0.1:0"])
        .env("MOONCAKE_SECRET", "")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MOONCAKE_SECRET is set but empty"));
}

#[test]
fn an_empty_secret_is_an_invalid_argument_to_the_builder() {
    let r = mooncake_core::Store::builder().shared_secret(b"").build();
    assert!(matches!(r, Err(mooncake_core::Error::InvalidArgument(_))), "{r:?}");
    let r = mooncake_transfer::TransferEngine::builder().shared_secret(b"").build();
    assert!(r.is_err());
}

#[test]
fn without_a_secret_only_loopback_peers_are_served() {
    let Some(ip) = local_non_loopback_ip() else {
        eprintln!("SKIPPED: this machine has no non-loopback address");
        return;
    };
    let p = Proc::spawn(&[], &bin("mooncake-master"), &["--listen", "0.0.0.0:0"]);
    let port = p.first_line.rsplit(':').next().unwrap().to_owned();
    let remote = format!("{ip}:{port}");
    let (code, err, secs) = client(&["ls", "--master", &remote], &[]);
    assert_eq!(code, 1);
    assert!(err.contains("protected mode"), "{err}");
    assert!(secs < 1.0, "{secs}");
    // Loopback is served.
    let (code, err, _) = client(&["ls", "--master", &format!("127.0.0.1:{port}")], &[]);
    assert_eq!(code, 0, "{err}");
    // Insecure on purpose: served.
    let p = Proc::spawn(&[], &bin("mooncake-master"), &["--listen", "0.0.0.0:0", "--insecure"]);
    let port = p.first_line.rsplit(':').next().unwrap().to_owned();
    let (code, err, _) = client(&["ls", "--master", &format!("{ip}:{port}")], &[]);
    assert_eq!(code, 0, "{err}");
    // A node's transfer listener follows the same rule.
    let engine = mooncake_transfer::TransferEngine::builder().tcp_listen("0.0.0.0:0").build().unwrap();
    let port = engine.endpoint().rsplit(':').next().unwrap().to_owned();
    let mut s = TcpStream::connect(format!("{ip}:{port}")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert_eq!(&got[..4], b"MCNO");
    assert!(String::from_utf8_lossy(&got).contains("protected mode"));
}

#[test]
fn metrics_need_the_bearer_token_when_a_secret_is_set() {
    let c = Cluster::start_env(&[], 0, &[("MOONCAKE_SECRET", "metrics secret")]);
    let (code, body) = http_request(&c.metrics_addr, "/metrics", None);
    assert_eq!(code, 401, "{body}");
    assert!(!body.contains("mooncake_objects"));
    let (code, _) = http_request(&c.metrics_addr, "/status", Some("not it"));
    assert_eq!(code, 401);
    // The secret itself proves nothing here: it must never cross the wire.
    let (code, _) = http_request(&c.metrics_addr, "/metrics", Some("metrics secret"));
    assert_eq!(code, 401);
    // The token `mooncake-client metrics-token` prints.
    let out =
        Command::new(bin("mooncake-client")).arg("metrics-token").env("MOONCAKE_SECRET", "metrics secret").output();
    let token = String::from_utf8(out.unwrap().stdout).unwrap().trim().to_owned();
    assert_eq!(token.len(), 64, "{token:?}");
    assert_eq!(Some(token.clone()), c.http_token());
    let (code, body) = http_request(&c.metrics_addr, "/metrics", Some(&token));
    assert_eq!(code, 200);
    assert!(body.contains("mooncake_objects"), "{body}");
    let (code, body) = http_request(&c.metrics_addr, "/status", Some(&token));
    assert_eq!(code, 200);
    assert!(body.contains("\"segments\""), "{body}");
}

#[test]
fn metrics_without_a_secret_are_served_to_loopback_only() {
    let Some(ip) = local_non_loopback_ip() else {
        eprintln!("SKIPPED: this machine has no non-loopback address");
        return;
    };
    let (mut m, _) = master(&[], &["--metrics-listen", "0.0.0.0:0"], &[]);
    let port = m.next_addr().rsplit(':').next().unwrap().to_owned();
    let (code, _) = http_request(&format!("{ip}:{port}"), "/status", None);
    assert_eq!(code, 403);
    let (code, body) = http_request(&format!("127.0.0.1:{port}"), "/status", None);
    assert_eq!(code, 200, "{body}");
}

#[test]
fn ls_escapes_keys_and_speaks_json() {
    let c = Cluster::start(&[], 1);
    let dir = unique_dir("ls-escape");
    for key in ["plain", "two\nlines", "tab\there", "quote\"d"] {
        c.put_bytes(&dir, key, b"v", 1);
    }
    let out = c.client_ok(&["ls", "--master", &c.master_addr]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines, ["plain", "quote\\\"d", "tab\\there", "two\\nlines"], "{out}");
    let json = c.client_ok(&["ls", "--master", &c.master_addr, "--json"]);
    assert_eq!(json.trim(), r#"["plain","quote\"d","tab\there","two\nlines"]"#);
}

#[test]
fn transfer_listeners_name_secret_mismatches_in_under_a_second() {
    use mooncake_transfer::{SharedSecret, TcpTransport, TransferEngine, TransferError};
    use std::sync::Arc;
    let client = |secret: Option<&[u8]>| {
        let tcp = match secret {
            Some(s) => TcpTransport::with_secret(SharedSecret::new(s)),
            None => TcpTransport::new(),
        };
        TransferEngine::builder().transport(Arc::new(tcp)).build().unwrap()
    };
    let guarded = TransferEngine::builder().tcp_listen("127.0.0.1:0").shared_secret(b"k").build().unwrap();
    let open = TransferEngine::builder().tcp_listen("127.0.0.1:0").build().unwrap();
    let (g, o) = (guarded.register_region(4096).unwrap(), open.register_region(4096).unwrap());
    let cases = [
        (guarded.remote(g.id()), Some(&b"not k"[..]), "wrong secret"),
        (guarded.remote(g.id()), None, "requires a shared secret"),
        (open.remote(o.id()), Some(&b"k"[..]), "no shared secret"),
    ];
    for (target, secret, expect) in cases {
        let start = Instant::now();
        let mut buf = [0u8; 4];
        match client(secret).read(&target, 0, &mut buf) {
            Err(TransferError::Auth(m)) => assert!(m.contains(expect), "expected {expect:?} in {m:?}"),
            other => panic!("{expect}: {other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(1), "{expect}: {:?}", start.elapsed());
    }
    // A transfer connection that never sends a request is closed after its hello timeout.
    let mut s = TcpStream::connect(open.endpoint()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
    let start = Instant::now();
    assert_eq!(s.read(&mut [0u8; 1]).unwrap_or(0), 0);
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
}
