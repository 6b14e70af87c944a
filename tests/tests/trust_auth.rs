//! Trust, second pass (issue 21, findings 5, 6 and 8), with the real binaries:
//!
//! - a relay between a client and the master (a rewritten address) is refused: the
//!   master proves the secret for its own address, the client refuses before it proves
//!   anything, and the relay never gets a session to abuse;
//! - forged record changes sent to a storage node's record endpoint are refused and
//!   counted, and a restarted master finds the node's objects unchanged;
//! - a flood of idle and garbage connections to a transfer listener costs a bounded
//!   number of threads and descriptors and a bounded number of log lines, and the
//!   listener still serves authenticated peers meanwhile.

mod support;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use mooncake_core::rpc::wire::{encode_frame, FrameKind, Request, HEADER_LEN};
use mooncake_core::rpc::RpcMasterClient;
use mooncake_core::{MasterApi, ObjectRecord, Protocol, RecordSink, RecordUpdate, Store};
use mooncake_transfer::SharedSecret;
use support::{bin, payload, unique_dir, wait_until, Proc};

const SECRET: &str = "trust-auth secret";

/// What a relay saw and could do.
#[derive(Default)]
struct RelayLog {
    /// Bytes the client sent through the relay.
    from_client: AtomicU64,
    /// Connections relayed.
    sessions: AtomicU64,
    /// Requests the relay injected upstream after the client left that the master
    /// answered (a session the relay could abuse).
    answered_injections: AtomicU64,
    /// Requests injected.
    injections: AtomicU64,
}

/// A relay on a loopback port that forwards every connection to `upstream` byte for
/// byte (as an impostor behind a rewritten address would), then, once the client
/// closed, tries to use the upstream connection itself: it sends a `RemoveAll`.
/// Serves at most `max` connections, each for at most 10 s.
fn start_relay(upstream: String, max: usize) -> (String, Arc<RelayLog>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let log = Arc::new(RelayLog::default());
    let log2 = log.clone();
    thread::spawn(move || {
        for down in l.incoming().take(max) {
            let Ok(down) = down else { continue };
            let Ok(up) = TcpStream::connect(&upstream) else { continue };
            log2.sessions.fetch_add(1, Ordering::Relaxed);
            let log3 = log2.clone();
            thread::spawn(move || {
                let _ = down.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = up.set_read_timeout(Some(Duration::from_secs(10)));
                let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
                let back = thread::spawn(move || {
                    let _ = std::io::copy(&mut u2, &mut d2);
                });
                // Client -> master, counted, until the client closes.
                let mut buf = [0u8; 4096];
                let mut d = &down;
                while let Ok(n) = d.read(&mut buf) {
                    if n == 0 || (&up).write_all(&buf[..n]).is_err() {
                        break;
                    }
                    log3.from_client.fetch_add(n as u64, Ordering::Relaxed);
                }
                // The client is gone: abuse the upstream session if there is one.
                let frame = encode_frame(FrameKind::Request, 77, &Request::RemoveAll {}).unwrap();
                log3.injections.fetch_add(1, Ordering::Relaxed);
                if (&up).write_all(&frame).is_ok() {
                    // The copy thread reads what comes back; stop it and look ourselves.
                    let _ = up.shutdown(std::net::Shutdown::Write);
                }
                let _ = back.join();
                let _ = down.shutdown(std::net::Shutdown::Both);
                // An answer would have reached the (closed) client side; the master
                // answers a RemoveAll only on an authenticated session, which we test
                // below by the objects still being there. Count a reply seen directly.
                let mut header = [0u8; HEADER_LEN];
                if (&up).read_exact(&mut header).is_ok() {
                    log3.answered_injections.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    (addr, log)
}

/// A master binary with `env`, on a free loopback port.
fn master(env: &[(&str, &str)]) -> (Proc, String) {
    master_at(env, "127.0.0.1:0")
}

/// A master binary with `env` listening on `listen`.
fn master_at(env: &[(&str, &str)], listen: &str) -> (Proc, String) {
    let p = Proc::spawn_env(&[], &bin("mooncake-master"), &["--listen", listen], env);
    let addr = p.first_line.rsplit(' ').next().unwrap().to_owned();
    (p, addr)
}

/// A one-shot `mooncake-client` with `env`: (exit code, stdout, stderr).
fn client(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(bin("mooncake-client")).args(args).envs(env.iter().copied()).output().unwrap();
    let s = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), s(&out.stdout), s(&out.stderr))
}

fn put_file(dir: &Path, master: &str, key: &str, data: &[u8], env: &[(&str, &str)]) {
    let file = dir.join(key);
    std::fs::write(&file, data).unwrap();
    let (code, _, err) = client(&["--protocol", "tcp", "put", "--master", master, key, file.to_str().unwrap()], env);
    assert_eq!(code, 0, "put {key}: {err}");
}

fn get_file(dir: &Path, master: &str, key: &str, env: &[(&str, &str)]) -> Result<Vec<u8>, String> {
    let file = dir.join(format!("{key}.out"));
    let _ = std::fs::remove_file(&file);
    match client(&["--protocol", "tcp", "get", "--master", master, key, file.to_str().unwrap()], env) {
        (0, _, _) => Ok(std::fs::read(&file).unwrap()),
        (_, _, err) => Err(err),
    }
}

/// Finding 5 against a master's own address: the client dials a relay that forwards
/// to the real master. The master's proof names its address, not the relay's, so the
/// client refuses at once and never proves the secret; the relay's upstream session is
/// never authenticated, so its injected `RemoveAll` removes nothing.
#[test]
fn a_relay_to_the_master_is_refused_and_gains_no_session() {
    let env = [("MOONCAKE_SECRET", SECRET)];
    let (_m, addr) = master(&env);
    let node = Proc::spawn_env(
        &[],
        &bin("mooncake-client"),
        &["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"],
        &env,
    );
    let dir = unique_dir("relay");
    for i in 0..20 {
        put_file(&dir, &addr, &format!("k{i}"), &payload(i, 1000), &env);
    }
    let (relay, log) = start_relay(addr.clone(), 8);
    let start = Instant::now();
    let (code, _, err) = client(&["ls", "--master", &relay], &env);
    assert_eq!(code, 1, "the client must refuse the relay: {err}");
    assert!(err.contains("refusing a relay") && err.contains(&addr), "{err}");
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    // The client sent its hello (magic and nonce) and nothing else: no proof, no request.
    wait_until(Duration::from_secs(5), || log.injections.load(Ordering::Relaxed) >= 1);
    assert_eq!(log.from_client.load(Ordering::Relaxed), 36, "only the client's hello crossed the relay");
    // The same through the library: a store cannot be built on the relay either.
    let e = Store::builder().master_address(&relay).global_segment_size(0).shared_secret(SECRET.as_bytes()).build();
    assert!(e.is_err_and(|e| e.to_string().contains("refusing a relay")));
    // Nothing was removed; the master and its objects are fine.
    wait_until(Duration::from_secs(5), || log.injections.load(Ordering::Relaxed) >= 2);
    thread::sleep(Duration::from_millis(200));
    assert_eq!(log.answered_injections.load(Ordering::Relaxed), 0);
    let direct = RpcMasterClient::connect_with(&addr, Some(SharedSecret::new(SECRET.as_bytes()))).unwrap();
    assert_eq!(direct.list_keys(1000).unwrap().len(), 20, "the relay's RemoveAll removed nothing");
    for i in 0..20 {
        assert_eq!(get_file(&dir, &addr, &format!("k{i}"), &env).unwrap(), payload(i, 1000));
    }
    drop(node);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Finding 6: a storage node accepts record changes only from a master it mounted on.
/// A local process without the secret, and a client holding the cluster's secret, both
/// try "a removed; a now at b's offset with b's checksum": refused and counted. After
/// a master `kill -9` and restart, the node re-mounts its true records: `a` reads a's
/// bytes and `b` b's.
#[test]
fn forged_record_changes_are_refused_counted_and_change_nothing() {
    for secret in [None, Some(SECRET)] {
        let env: Vec<(&str, &str)> = secret.map(|s| ("MOONCAKE_SECRET", s)).into_iter().collect();
        let (mut m, addr) = master(&env);
        // The storage node: a store in this process, giving a segment and serving its
        // record endpoint to the master over TCP.
        let mut b = Store::builder()
            .master_address(&addr)
            .listen("127.0.0.1:0")
            .protocol(Protocol::Tcp)
            .global_segment_size(16 << 20);
        if let Some(s) = secret {
            b = b.shared_secret(s.as_bytes());
        }
        let node = b.build().unwrap();
        let records = node.record_endpoint().expect("a node of a master daemon serves a record endpoint");
        let dir = unique_dir("forge");
        let (a, bb) = (payload(1, 5000), payload(2, 7000));
        put_file(&dir, &addr, "a", &a, &env);
        put_file(&dir, &addr, "b", &bb, &env);
        let master_client =
            RpcMasterClient::connect_with(&addr, secret.map(|s| SharedSecret::new(s.as_bytes()))).unwrap();
        let (ia, ib) = (master_client.object_info("a").unwrap(), master_client.object_info("b").unwrap());
        let (ra, rb) = (&ia.replicas[0], &ib.replicas[0]);
        let forged = [
            RecordUpdate::Removed { segment: ra.segment, key: "a".into(), offset: ra.offset },
            RecordUpdate::Added {
                segment: rb.segment,
                record: ObjectRecord { key: "a".into(), offset: rb.offset, len: ib.len, checksum: ib.checksum },
            },
            RecordUpdate::Removed { segment: rb.segment, key: "b".into(), offset: rb.offset },
        ];
        // A local process without any secret, and a holder of the cluster's secret.
        let mut forgers = vec![None];
        forgers.extend(secret.map(|s| Some(SharedSecret::new(s.as_bytes()))));
        for forger in forgers {
            let refused = match RpcMasterClient::connect_with_timeout(&records, forger, Duration::from_secs(5)) {
                Err(e) => e.to_string(),
                Ok(c) => match c.apply_records(&forged) {
                    Err(e) => e.to_string(),
                    Ok(()) => panic!("the node applied forged records (secret {secret:?})"),
                },
            };
            assert!(refused.contains("shared secret"), "{refused}");
        }
        let expected = if secret.is_some() { 2 } else { 1 };
        wait_until(Duration::from_secs(5), || node.stats().record_refusals >= expected);
        // The master restarts on the same address; the node re-mounts its records.
        m.kill9();
        let (m2, _) = master_at(&env, &addr);
        wait_until(Duration::from_secs(20), || get_file(&dir, &addr, "b", &env).is_ok());
        assert_eq!(get_file(&dir, &addr, "a", &env).unwrap(), a, "a reads a's bytes (secret {secret:?})");
        assert_eq!(get_file(&dir, &addr, "b", &env).unwrap(), bb, "b is still there (secret {secret:?})");
        drop(node);
        drop(m2);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Descriptors and threads of a process.
fn fds_and_threads(pid: u32) -> (usize, usize) {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    (fds, threads)
}

/// A storage node whose stderr goes to `log`; returns it and its transfer endpoint.
fn logged_node(master: &str, log: &Path, env: &[(&str, &str)]) -> (Child, String) {
    let mut child = Command::new(bin("mooncake-client"))
        .args(["serve", "--master", master, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"])
        .envs(env.iter().copied())
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.starts_with("mooncake-client serving segment"), "{line}");
    let endpoint = line.trim().rsplit(' ').next().unwrap().to_owned();
    (child, endpoint)
}

/// Finding 8: 600 sockets to a node's transfer listener, half of them idle and half
/// sending garbage instead of the handshake. The node keeps a bounded number of
/// threads and descriptors, still serves an authenticated peer meanwhile, and logs a
/// bounded number of warnings about it.
#[test]
fn a_flood_of_unauthenticated_sockets_is_bounded_and_quiet() {
    let env = [("MOONCAKE_SECRET", SECRET)];
    let (_m, addr) = master(&env);
    let dir = unique_dir("flood");
    let log = dir.join("node.log");
    let (mut node, endpoint) = logged_node(&addr, &log, &env);
    let pid = node.id();
    let data = payload(9, 100_000);
    put_file(&dir, &addr, "before", &data, &env);
    let (fds0, threads0) = fds_and_threads(pid);

    let mut socks = Vec::new();
    for i in 0..600 {
        let Ok(mut s) = TcpStream::connect(&endpoint) else { continue };
        if i % 2 == 1 {
            let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\nnot a handshake, 36+ bytes of garbage....");
        }
        socks.push(s);
    }
    assert!(socks.len() >= 590, "{} sockets opened", socks.len());
    thread::sleep(Duration::from_millis(500));
    let (fds, threads) = fds_and_threads(pid);
    eprintln!("600 sockets: node descriptors {fds0} -> {fds}, threads {threads0} -> {threads}");
    // 64 waiting connections at most, with two descriptors and one thread each.
    assert!(fds <= fds0 + 2 * 64 + 16, "descriptors: {fds0} before, {fds} during the flood");
    assert!(threads <= threads0 + 64 + 8, "threads: {threads0} before, {threads} during the flood");
    // An authenticated peer is still served while the sockets are open and more
    // idle ones keep coming (one a millisecond, each pushing out the oldest waiting).
    let stop = Arc::new(AtomicBool::new(false));
    let flooder = {
        let (stop, endpoint) = (stop.clone(), endpoint.clone());
        thread::spawn(move || {
            let mut held = std::collections::VecDeque::new();
            for _ in 0..20_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(s) = TcpStream::connect(&endpoint) {
                    held.push_back(s);
                }
                if held.len() > 200 {
                    held.pop_front();
                }
                thread::sleep(Duration::from_millis(1));
            }
        })
    };
    put_file(&dir, &addr, "during", &data, &env);
    assert_eq!(get_file(&dir, &addr, "before", &env).unwrap(), data);
    assert_eq!(get_file(&dir, &addr, "during", &env).unwrap(), data);
    stop.store(true, Ordering::Relaxed);
    flooder.join().unwrap();
    drop(socks);
    // The connections the node still held end within the handshake timeout.
    wait_until(Duration::from_secs(10), || fds_and_threads(pid).0 <= fds0 + 8);
    let _ = node.kill();
    let _ = node.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    let warnings = text.lines().filter(|l| l.contains("WARN")).count();
    eprintln!("{warnings} warning lines in the node's log");
    assert!(warnings <= 10, "{warnings} warning lines for 600 refused sockets:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
