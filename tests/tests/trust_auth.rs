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
use support::{bin, payload, unique_dir, wait_until, Etcd, Proc};

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
            RecordUpdate::Removed { segment: ra.segment, key: "a".into(), offset: ra.offset, generation: u64::MAX },
            RecordUpdate::Added {
                segment: rb.segment,
                record: ObjectRecord {
                    key: "a".into(),
                    offset: rb.offset,
                    len: ib.len,
                    checksum: ib.checksum,
                    // A forger claims the newest generation there is.
                    generation: u64::MAX,
                },
            },
            RecordUpdate::Removed { segment: rb.segment, key: "b".into(), offset: rb.offset, generation: u64::MAX },
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
    let threads =
        status.lines().find_map(|l| l.strip_prefix("Threads:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
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

/// A holder of the cluster's secret cannot move another node's records: once a node
/// mounted its record endpoint, a mount for its client id with another key is refused
/// (it could otherwise freeze the node's records, or point them at a dead port and
/// make the master forget the node). The node is untouched and keeps serving.
#[test]
fn a_node_s_records_cannot_be_mounted_elsewhere_by_another_client() {
    use mooncake_core::rpc::RECORD_KEY_LEN;
    let env = [("MOONCAKE_SECRET", SECRET)];
    let (_m, addr) = master(&env);
    let node = Store::builder()
        .master_address(&addr)
        .listen("127.0.0.1:0")
        .protocol(Protocol::Tcp)
        .global_segment_size(16 << 20)
        .shared_secret(SECRET.as_bytes())
        .build()
        .unwrap();
    assert!(node.record_endpoint().is_some());
    let victim = node.client_id();
    let rogue = RpcMasterClient::connect_with(&addr, Some(SharedSecret::new(SECRET.as_bytes()))).unwrap();
    for endpoint in ["127.0.0.1:1", node.record_endpoint().unwrap().as_str()] {
        let err = rogue.mount_records(victim, endpoint, &[7u8; RECORD_KEY_LEN]).unwrap_err();
        assert!(matches!(&err, mooncake_core::Error::InvalidArgument(m) if m.contains("another record key")), "{err}");
    }
    node.put("k", b"value").unwrap();
    thread::sleep(Duration::from_millis(300));
    assert_eq!(&node.get("k").unwrap()[..], b"value", "the master still knows the node");
}

/// The same flood at the master: 1,500 silent sockets to a master that may hold only
/// 700 descriptors. Beyond [`MAX_UNAUTHENTICATED`] waiting handshakes the master closes
/// the oldest, so it never runs out of descriptors: an authenticated client is served
/// while the sockets are held, and the flood leaves a bounded number of warning lines.
/// (Before, the master held a descriptor per silent socket until its hello expired, up
/// to its limit: then it could accept no one.)
#[test]
fn a_flood_of_silent_sockets_does_not_lock_clients_out_of_the_master() {
    use mooncake_core::rpc::MAX_UNAUTHENTICATED;
    let env = [("MOONCAKE_SECRET", SECRET)];
    let dir = unique_dir("master-flood");
    let log = dir.join("master.log");
    let mut master = Command::new("prlimit")
        .arg("--nofile=700:700")
        .arg(bin("mooncake-master"))
        .args(["--listen", "127.0.0.1:0"])
        .envs(env)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(master.stdout.take().unwrap()), &mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_owned();
    let pid = master.id();
    let data = payload(4, 50_000);
    let node = Proc::spawn_env(
        &[],
        &bin("mooncake-client"),
        &["serve", "--master", &addr, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"],
        &env,
    );
    put_file(&dir, &addr, "before", &data, &env);
    let (fds0, _) = fds_and_threads(pid);
    let socks: Vec<TcpStream> = (0..1500).filter_map(|_| TcpStream::connect(&addr).ok()).collect();
    assert!(socks.len() >= 1400, "{} sockets opened", socks.len());
    thread::sleep(Duration::from_millis(500));
    let (fds, _) = fds_and_threads(pid);
    eprintln!("1500 silent sockets: master descriptors {fds0} -> {fds}");
    assert!(fds <= fds0 + MAX_UNAUTHENTICATED + 16, "descriptors: {fds0} before, {fds} during the flood");
    let start = Instant::now();
    assert_eq!(get_file(&dir, &addr, "before", &env).unwrap(), data, "a client is served during the flood");
    put_file(&dir, &addr, "during", &data, &env);
    assert!(start.elapsed() < Duration::from_secs(4), "served in {:?}", start.elapsed());
    drop(socks);
    drop(node);
    let _ = master.kill();
    let _ = master.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    let warnings = text.lines().filter(|l| l.contains("WARN")).count();
    assert!(warnings <= 10, "{warnings} warning lines for 1500 silent sockets:\n{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Only connections still in their handshake count toward the cap: 600 clients that
/// finished theirs do not crowd out one slow handshake that started before them.
#[test]
fn clients_past_their_hello_do_not_crowd_out_a_slow_handshake() {
    use mooncake_core::rpc::wire::{encode_frame, FrameKind, Request as Req};
    let (_m, addr) = master(&[]);
    let mut slow = TcpStream::connect(&addr).unwrap();
    let request = encode_frame(FrameKind::Request, 1, &Req::Stats {}).unwrap();
    let clients: Vec<TcpStream> = (0..600)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(&request).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            mooncake_core::rpc::read_frame(&mut s, 1 << 20).unwrap();
            s
        })
        .collect();
    // The slow one is still open (within its 5 s hello timeout): a read waits.
    slow.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let mut byte = [0u8; 1];
    match slow.read(&mut byte) {
        Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
        other => panic!("the slow handshake was closed: {other:?}"),
    }
    drop(clients);
}

/// The binaries raise their soft limit on open descriptors to the hard one.
#[test]
fn the_master_raises_its_open_files_limit() {
    let mut master = Command::new("prlimit")
        .arg("--nofile=256:4096")
        .arg(bin("mooncake-master"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(master.stdout.take().unwrap()), &mut line).unwrap();
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", master.id())).unwrap();
    let open_files = limits.lines().find(|l| l.starts_with("Max open files")).unwrap().to_owned();
    let _ = master.kill();
    let _ = master.wait();
    let fields: Vec<&str> = open_files.split_whitespace().collect();
    assert_eq!(&fields[3..5], ["4096", "4096"], "{open_files}");
}

// ---------------------------------------------------------------------------------
// With a real etcd.

/// What these tests do with their etcd beyond starting it (`support::Etcd`).
trait EtcdClient {
    /// Waits until etcd answers a read (it listens before it has elected itself).
    fn wait_ready(&self);
    /// Runs `f` with an etcd client (authenticated as `user`, if given).
    fn with_client<T>(
        &self,
        user: Option<(&str, &str)>,
        f: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<T, etcd_client::Error>,
    ) -> T;
}

impl EtcdClient for Etcd {
    fn wait_ready(&self) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let start = Instant::now();
            loop {
                let ok = async {
                    let mut c = etcd_client::Client::connect([self.endpoint()], None).await?;
                    c.get("ready", None).await
                };
                match tokio::time::timeout(Duration::from_secs(2), ok).await {
                    Ok(Ok(_)) => return,
                    _ if start.elapsed() > Duration::from_secs(20) => panic!("etcd does not answer"),
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        })
    }

    fn with_client<T>(
        &self,
        user: Option<(&str, &str)>,
        f: impl AsyncFnOnce(&mut etcd_client::Client) -> Result<T, etcd_client::Error>,
    ) -> T {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let options = user.map(|(u, p)| etcd_client::ConnectOptions::new().with_user(u, p));
            let mut c = etcd_client::Client::connect([self.endpoint()], options).await.unwrap();
            f(&mut c).await.unwrap()
        })
    }
}

/// Runs `program args` with `env` for at most `limit`: (exit code or None if it was
/// still running and got killed, stdout, stderr).
fn run_for(program: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> (Option<i32>, String) {
    let mut child = Command::new(program)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let code = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status.code();
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    (code, err)
}

/// Masters, nodes and clients authenticate to an etcd that asks: with the user and
/// password a master and a node join and objects go through; without the password, or
/// with a wrong one, each fails at once with one line that says so.
#[test]
fn etcd_authentication_admits_members_with_the_password_only() {
    let Some(etcd) = Etcd::start() else { return };
    etcd.wait_ready();
    etcd.with_client(None, async |c| {
        c.role_add("root").await?;
        c.user_add("root", "etcd-pw", None).await?;
        c.user_grant_role("root", "root").await?;
        c.auth_enable().await
    });
    let cluster = format!("auth{}", std::process::id());
    let endpoint = etcd.endpoint();
    let master_args =
        ["--listen", "127.0.0.1:0", "--etcd", &endpoint, "--cluster-id", &cluster, "--lease-ttl-ms", "2000"];
    let with_user: Vec<&str> = master_args.iter().copied().chain(["--etcd-user", "root"]).collect();
    let address = format!("etcd://127.0.0.1:{}/{cluster}", etcd.client_port);
    let node_args = ["serve", "--master", &address, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"];
    let node_with_user: Vec<&str> = node_args.iter().copied().chain(["--etcd-user", "root"]).collect();

    // Without credentials, with a wrong password, and with a user but no password:
    // a clear error, no hang.
    let wrong = [("MOONCAKE_ETCD_PASSWORD", "guess")];
    for (args, env, expect) in [
        (&master_args[..], &[][..], "user name is empty"),
        (&with_user[..], &wrong[..], "invalid user ID or password"),
        (&with_user[..], &[][..], "MOONCAKE_ETCD_PASSWORD"),
    ] {
        let (code, err) = run_for(&bin("mooncake-master"), args, env, Duration::from_secs(15));
        assert_eq!(code, Some(1), "the master must fail: {err}");
        assert!(err.contains(expect), "expected {expect:?} in {err:?}");
    }

    // With the password: a master joins, then a node, and a client's objects go through.
    let pw = [("MOONCAKE_ETCD_PASSWORD", "etcd-pw")];
    let master = Proc::spawn_env(&[], &bin("mooncake-master"), &with_user, &pw);
    assert!(master.first_line.contains("listening on"), "{}", master.first_line);
    let (code, err) = run_for(&bin("mooncake-client"), &node_args, &[], Duration::from_secs(15));
    assert_eq!(code, Some(1), "a node without credentials must fail: {err}");
    assert!(err.contains("etcd") && err.contains("user name is empty"), "{err}");
    let node = Proc::spawn_env(&[], &bin("mooncake-client"), &node_with_user, &pw);
    assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
    let store = Store::builder()
        .master_address(&address)
        .global_segment_size(0)
        .etcd_credentials(mooncake_core::cluster::EtcdCredentials {
            user: Some(("root".into(), "etcd-pw".into())),
            tls: None,
        })
        .build()
        .unwrap();
    let data = payload(4, 10_000);
    store.put("k", &data).unwrap();
    assert_eq!(store.get("k").unwrap(), data);
    let (code, err) = run_for(
        &bin("mooncake-client"),
        &["slots", "--master", &address, "--etcd-user", "root"],
        &pw,
        Duration::from_secs(15),
    );
    assert_eq!(code, Some(0), "{err}");
    drop(store);
    drop(node);
    drop(master);
}

/// Finding 5 as reported: whoever can write to etcd points every group's leader key
/// at a relay to the real master. Clients follow the key, dial the relay, get the
/// master's proof for the master's own address, and refuse; nothing is removed.
#[test]
fn a_rewritten_leader_key_leads_clients_to_a_relay_they_refuse() {
    let Some(etcd) = Etcd::start() else { return };
    etcd.wait_ready();
    let env = [("MOONCAKE_SECRET", SECRET)];
    let cluster = format!("relay{}", std::process::id());
    let endpoint = etcd.endpoint();
    let m = Proc::spawn_env(
        &[],
        &bin("mooncake-master"),
        &["--listen", "127.0.0.1:0", "--etcd", &endpoint, "--cluster-id", &cluster, "--lease-ttl-ms", "2000"],
        &env,
    );
    let addr = m.first_line.rsplit(' ').next().unwrap().to_owned();
    let address = format!("etcd://127.0.0.1:{}/{cluster}", etcd.client_port);
    let parsed: mooncake_core::cluster::EtcdAddress = address.parse().unwrap();
    wait_until(Duration::from_secs(10), || {
        mooncake_core::cluster::SlotMapWatcher::connect(&parsed).is_ok_and(|w| {
            let map = w.map();
            (0..map.groups()).all(|g| map.leader(g).is_some_and(|l| l.addr == addr))
        })
    });
    let node = Proc::spawn_env(
        &[],
        &bin("mooncake-client"),
        &["serve", "--master", &address, "--listen", "127.0.0.1:0", "--segment-size", "16MiB"],
        &env,
    );
    assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
    let store =
        || Store::builder().master_address(&address).global_segment_size(0).shared_secret(SECRET.as_bytes()).build();
    let writer = store().unwrap();
    for i in 0..20 {
        writer.put(&format!("k{i}"), &payload(i, 1000)).unwrap();
    }
    drop(writer);

    // The attacker rewrites every leader key (keeping the master's id) to its relay.
    let (relay, log) = start_relay(addr.clone(), 64);
    let prefix = format!("/mooncake/{cluster}/leaders/");
    let rewritten = etcd.with_client(None, async |c| {
        let got = c.get(prefix.as_str(), Some(etcd_client::GetOptions::new().with_prefix())).await?;
        let mut n = 0;
        for kv in got.kvs() {
            let value = kv.value_str()?.replace(&format!("\"addr\":\"{addr}\""), &format!("\"addr\":\"{relay}\""));
            c.put(kv.key(), value, None).await?;
            n += 1;
        }
        Ok(n)
    });
    assert!(rewritten > 0, "no leader keys under {prefix}");
    let start = Instant::now();
    let e = store().expect_err("a client must not take the relay for the master");
    assert!(e.to_string().contains("refusing a relay"), "{e}");
    let (code, _, err) = client(&["ls", "--master", &address], &env);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("refusing a relay"), "{err}");
    eprintln!("refused through a rewritten leader key in {:?}", start.elapsed());
    // The relay relayed hellos only, and its injected RemoveAll removed nothing.
    assert!(log.sessions.load(Ordering::Relaxed) > 0);
    assert_eq!(log.from_client.load(Ordering::Relaxed) % 36, 0, "only hellos crossed the relay");
    thread::sleep(Duration::from_millis(300));
    assert_eq!(log.answered_injections.load(Ordering::Relaxed), 0);
    let direct = RpcMasterClient::connect_with(&addr, Some(SharedSecret::new(SECRET.as_bytes()))).unwrap();
    assert_eq!(direct.list_keys(1000).unwrap().len(), 20, "the relay removed nothing");
    drop(node);
    drop(m);
}
