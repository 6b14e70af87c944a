//! Starting the real binaries and talking to them.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// Starts a storage node of `master` with a 16 MiB segment and an SSD tier of
/// `capacity` (e.g. "256MiB") in `dir`, listening on a free loopback port.
pub fn ssd_node(master: &str, dir: &Path, capacity: &str) -> Proc {
    ssd_node_on(master, dir, "16MiB", capacity, "bucket")
}

/// [`ssd_node`] with a segment of `segment` bytes (e.g. "64MiB") and the SSD layout
/// `backend` (`bucket`, `file_per_key`, `offset_allocator`). Its first line is
/// printed once the objects its SSD already holds are registered with the master.
pub fn ssd_node_on(master: &str, dir: &Path, segment: &str, capacity: &str, backend: &str) -> Proc {
    let dir = dir.to_str().expect("a UTF-8 test directory");
    let node = Proc::spawn(
        &[],
        &bin("mooncake-client"),
        &[
            "serve",
            "--master",
            master,
            "--listen",
            "127.0.0.1:0",
            "--segment-size",
            segment,
            "--ssd-dir",
            dir,
            "--ssd-capacity",
            capacity,
            "--ssd-backend",
            backend,
        ],
    );
    assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
    node
}

/// Path of a binary of this workspace, next to the test executable's directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let dir = exe.parent().and_then(Path::parent).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not built: run `cargo build -p mooncake-cli` (cargo test --workspace builds it)",
        path.display()
    );
    path
}

/// A fresh directory for one test's files.
pub fn unique_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mooncake-test-{tag}-{}-{}", std::process::id(), rand_u32()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish() as u32
}

/// Deterministic test bytes.
pub fn payload(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_mul(37).wrapping_add((i % 241) as u8) ^ (i >> 12) as u8).collect()
}

/// `chattr +i` on a path while the guard lives: writes, creations and unlinks there
/// fail with EPERM, even for root (a disk that refuses changes).
pub struct Immutable(PathBuf);

impl Immutable {
    /// `None`, with a message, where the filesystem or privileges do not allow it.
    pub fn set(path: &Path) -> Option<Immutable> {
        let ok = Command::new("chattr").arg("+i").arg(path).status().is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipped: `chattr +i` is not possible on {}", path.display());
            return None;
        }
        Some(Immutable(path.to_owned()))
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

/// Polls `cond` until it holds; panics after `limit`.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "condition not reached within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process, killed when dropped.
pub struct Proc {
    pub child: Child,
    pub first_line: String,
    /// The rest of stdout, kept open so later lines can be read and the child never
    /// writes into a closed pipe.
    stdout: BufReader<ChildStdout>,
}

impl Proc {
    /// Spawns `cmd` in `prefix` (e.g. `ip netns exec NS`) and waits for its first line
    /// of stdout.
    pub fn spawn(prefix: &[&str], program: &Path, args: &[&str]) -> Proc {
        Self::spawn_env(prefix, program, args, &[])
    }

    /// [`spawn`](Self::spawn) with extra environment variables.
    pub fn spawn_env(prefix: &[&str], program: &Path, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let mut cmd = if prefix.is_empty() {
            Command::new(program)
        } else {
            let mut c = Command::new(prefix[0]);
            c.args(&prefix[1..]).arg(program);
            c
        };
        let mut child = cmd
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "{} exited before saying where it listens", program.display());
        Proc { child, first_line: line.trim().to_owned(), stdout }
    }

    /// The next line of stdout (blocks until it comes); panics at end of output.
    pub fn next_line(&mut self) -> String {
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert!(!line.is_empty(), "the process ended its output");
        line.trim().to_owned()
    }

    /// The address at the end of the next line (`... metrics on ADDR`).
    pub fn next_addr(&mut self) -> String {
        self.next_line().rsplit(' ').next().unwrap().to_owned()
    }

    /// Sends a signal by name (`KILL`, `STOP`, `CONT`, `TERM`).
    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill").arg(format!("-{sig}")).arg(self.child.id().to_string()).status().unwrap();
        assert!(ok.success());
    }

    /// `kill -9` and reap.
    pub fn kill9(&mut self) {
        self.signal("KILL");
        let _ = self.child.wait();
    }

    /// Waits for exit; returns the exit code, or None on timeout.
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A master and storage nodes on loopback (or in network namespaces).
pub struct Cluster {
    pub master: Proc,
    pub master_addr: String,
    pub master_args: Vec<String>,
    pub metrics_addr: String,
    pub nodes: Vec<Proc>,
    /// Command prefix for one-shot clients (e.g. `ip netns exec NS`).
    pub client_prefix: Vec<String>,
    /// Environment of the master and the nodes.
    pub env: Vec<(String, String)>,
}

impl Cluster {
    /// Starts a master with `master_args` and `nodes` storage nodes of 64 MiB.
    pub fn start(master_args: &[&str], nodes: usize) -> Cluster {
        Self::start_env(master_args, nodes, &[])
    }

    /// [`start`](Self::start) with environment variables for the master and nodes.
    pub fn start_env(master_args: &[&str], nodes: usize, env: &[(&str, &str)]) -> Cluster {
        // Port 0 for both listeners: the master says which ports it bound, so no
        // other test can take them between choosing and binding.
        let mut args: Vec<String> =
            vec!["--listen".into(), "127.0.0.1:0".into(), "--metrics-listen".into(), "127.0.0.1:0".into()];
        args.extend(master_args.iter().map(|s| s.to_string()));
        let argv: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut master = Proc::spawn_env(&[], &bin("mooncake-master"), &argv, env);
        let master_addr = master.first_line.rsplit(' ').next().unwrap().to_owned();
        let metrics_addr = master.next_addr();
        // Restarts reuse the bound ports.
        args[1] = master_addr.clone();
        args[3] = metrics_addr.clone();
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut c = Cluster {
            master,
            master_addr,
            master_args: args,
            metrics_addr,
            nodes: Vec::new(),
            client_prefix: Vec::new(),
            env,
        };
        for _ in 0..nodes {
            c.add_node(&[], "127.0.0.1:0");
        }
        c
    }

    /// Starts a storage node (64 MiB) listening on `listen`, in `prefix`.
    pub fn add_node(&mut self, prefix: &[&str], listen: &str) {
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let node = Proc::spawn_env(
            prefix,
            &bin("mooncake-client"),
            &["serve", "--master", &self.master_addr, "--listen", listen, "--segment-size", "64MiB"],
            &env,
        );
        assert!(node.first_line.starts_with("mooncake-client serving segment"), "{}", node.first_line);
        self.nodes.push(node);
    }

    /// Starts the master again on the same address.
    pub fn restart_master(&mut self) {
        let argv: Vec<&str> = self.master_args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        self.master = Proc::spawn_env(&[], &bin("mooncake-master"), &argv, &env);
    }

    /// Runs a one-shot client; returns (exit code, stdout, stderr).
    pub fn client(&self, args: &[&str]) -> (i32, String, String) {
        let prefix: Vec<&str> = self.client_prefix.iter().map(String::as_str).collect();
        let mut cmd = if prefix.is_empty() {
            Command::new(bin("mooncake-client"))
        } else {
            let mut c = Command::new(prefix[0]);
            c.args(&prefix[1..]).arg(bin("mooncake-client"));
            c
        };
        let out = cmd.args(args).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs a one-shot client that must succeed; returns its stdout.
    pub fn client_ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.client(args);
        assert_eq!(code, 0, "mooncake-client {args:?} failed: {err}");
        out
    }

    /// Puts `data` under `key` through a file.
    pub fn put_bytes(&self, dir: &Path, key: &str, data: &[u8], replicas: usize) {
        let file = dir.join(key.replace('/', "_"));
        std::fs::write(&file, data).unwrap();
        let r = replicas.to_string();
        self.client_ok(&["put", "--master", &self.master_addr, key, file.to_str().unwrap(), "--replicas", &r]);
    }

    /// Gets `key` through a file; Err(stderr line) on failure.
    pub fn get_bytes(&self, dir: &Path, key: &str) -> Result<Vec<u8>, String> {
        let file = dir.join(format!("{}.out", key.replace('/', "_")));
        let _ = std::fs::remove_file(&file);
        match self.client(&["get", "--master", &self.master_addr, key, file.to_str().unwrap()]) {
            (0, _, _) => Ok(std::fs::read(&file).unwrap()),
            (_, _, err) => Err(err.trim().to_owned()),
        }
    }

    /// Keys the master lists.
    pub fn ls(&self) -> Vec<String> {
        match self.client(&["ls", "--master", &self.master_addr]) {
            (0, out, _) => out.lines().map(str::to_owned).collect(),
            _ => Vec::new(),
        }
    }

    /// The master's JSON status (from the metrics listener, with the token derived
    /// from the cluster's secret when it has one).
    pub fn status(&self) -> String {
        http_request(&self.metrics_addr, "/status", self.http_token().as_deref()).1
    }

    /// The master's Prometheus text.
    pub fn metrics(&self) -> String {
        http_request(&self.metrics_addr, "/metrics", self.http_token().as_deref()).1
    }

    /// The bearer token of the master's HTTP endpoints, if the cluster has a secret.
    pub fn http_token(&self) -> Option<String> {
        self.secret().map(|s| mooncake_transfer::SharedSecret::new(s.as_bytes()).http_token())
    }

    /// The `MOONCAKE_SECRET` of the master and the nodes, if any.
    pub fn secret(&self) -> Option<&str> {
        self.env.iter().find(|(k, _)| k == "MOONCAKE_SECRET").map(|(_, v)| v.as_str())
    }
}

/// A minimal HTTP GET with an optional bearer token; returns the status code and
/// the body.
pub fn http_request(addr: &str, path: &str, bearer: Option<&str>) -> (u16, String) {
    let auth = bearer.map(|t| format!("Authorization: Bearer {t}\r\n")).unwrap_or_default();
    // A loaded machine may reset or stall one exchange: try a few times before failing.
    let attempt = || http_exchange(addr, path, &auth, Duration::from_secs(10));
    let mut last = None;
    let mut text = String::new();
    for _ in 0..5 {
        match attempt() {
            Ok(t) => {
                text = t;
                last = None;
                break;
            }
            Err(e) => {
                last = Some(e);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    if let Some(e) = last {
        panic!("GET http://{addr}{path} failed 5 times: {e}");
    }
    (status_code(&text), text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or(text))
}

/// One HTTP/1.0 GET of `path` (with the extra header lines `auth`), answered within
/// `timeout`: the whole answer, status line and headers included.
fn http_exchange(addr: &str, path: &str, auth: &str, timeout: Duration) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(timeout))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{auth}\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(text)
}

/// The status code of an HTTP answer (0 if it has none).
fn status_code(answer: &str) -> u16 {
    answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// A minimal HTTP GET (the test talks to our own metrics listener only).
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or(body)
}

/// Resident memory of a process (`VmRSS` of `/proc/PID/status`), in bytes; 0 once
/// it is gone.
pub fn rss(pid: u32) -> u64 {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { return 0 };
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Samples a process's resident memory every 10 ms until stopped; the most seen.
pub struct RssWatch {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: std::thread::JoinHandle<u64>,
}

impl RssWatch {
    /// Starts sampling `pid`.
    pub fn start(pid: u32) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut most = rss(pid);
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(rss(pid));
                std::thread::sleep(Duration::from_millis(10));
            }
            most.max(rss(pid))
        });
        Self { stop, handle }
    }

    /// Stops sampling; the most resident memory seen, in bytes.
    pub fn most(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.join().unwrap()
    }
}

/// TCP ports process `pid` listens on (IPv4), from `/proc/PID/net/tcp` and the
/// socket descriptors the process holds.
pub fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[").and_then(|r| r.strip_suffix(']')).map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    let mut ports: Vec<u16> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // local_address rem_address st ... inode (field 9); 0A is LISTEN.
            (f.len() > 9 && f[3] == "0A" && inodes.iter().any(|i| i == f[9]))
                .then(|| f[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok()))
                .flatten()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// The postcard body of `with_one` with its one-element sequence repeated `n`
/// times: `empty` must be the same message with that sequence empty (the bodies
/// differ only there). Builds frames of millions of items without building the
/// items.
pub fn repeated_body<T: serde::Serialize>(empty: &T, with_one: &T, n: usize) -> Vec<u8> {
    let a = postcard::to_allocvec(empty).unwrap();
    let b = postcard::to_allocvec(with_one).unwrap();
    let at = a.iter().zip(&b).position(|(x, y)| x != y).expect("the messages differ");
    assert_eq!((a[at], b[at]), (0, 1), "the sequence's length, 0 then 1");
    let element = &b[at + 1..at + 1 + (b.len() - a.len())];
    let mut body = a[..at].to_vec();
    let mut len = n;
    while len >= 0x80 {
        body.push((len as u8) | 0x80);
        len >>= 7;
    }
    body.push(len as u8);
    body.reserve(element.len() * n + a.len() - at);
    for _ in 0..n {
        body.extend_from_slice(element);
    }
    body.extend_from_slice(&a[at + 1..]);
    body
}

/// Sends one request frame with `body` on `stream` and reads the answer: the
/// decoded response, or why none came (`Err`: the connection closed, or the
/// answer is not a response).
pub fn rpc_exchange(
    stream: &mut std::net::TcpStream,
    request_id: u64,
    body: &[u8],
) -> Result<mooncake_core::rpc::wire::Response, String> {
    use mooncake_core::rpc::wire::{decode_body, FrameHeader, FrameKind};
    use std::io::Write;
    let header = FrameHeader { kind: FrameKind::Request, request_id, body_len: body.len() as u32 }.encode();
    stream.write_all(&header).map_err(|e| format!("sending: {e}"))?;
    stream.write_all(body).map_err(|e| format!("sending: {e}"))?;
    let (h, body) = mooncake_core::rpc::read_frame(stream, u32::MAX).map_err(|e| format!("no answer: {e}"))?;
    if h.kind != FrameKind::Response || h.request_id != request_id {
        return Err(format!("answer {h:?} is not the response to request {request_id}"));
    }
    decode_body(&body).map_err(|e| format!("answer does not decode: {e}"))
}

/// A real etcd on loopback, killed when dropped.
pub struct Etcd {
    child: Child,
    dir: PathBuf,
    /// Its client port on 127.0.0.1.
    pub client_port: u16,
    peer_port: u16,
}

impl Etcd {
    /// Starts etcd on free loopback ports (tries again on other ports if it cannot
    /// bind). None (test skipped) when etcd is not installed and CI is not set.
    pub fn start() -> Option<Etcd> {
        if which("etcd").is_none() {
            assert!(std::env::var_os("CI").is_none(), "etcd is not installed (apt-get install etcd-server)");
            eprintln!("SKIPPED: etcd is not installed");
            return None;
        }
        let dir = unique_dir("etcd");
        for _ in 0..10 {
            let [client_port, peer_port] = free_ports();
            if let Some(child) = Self::spawn(&dir, client_port, peer_port) {
                return Some(Etcd { child, dir, client_port, peer_port });
            }
        }
        panic!("etcd did not start");
    }

    fn spawn(dir: &Path, client_port: u16, peer_port: u16) -> Option<Child> {
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{peer_port}");
        let mut child = Command::new("etcd")
            .args(["--name", "t", "--data-dir", dir.join("data").to_str().unwrap()])
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("t={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start etcd");
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = child.try_wait() {
                return None;
            }
            if Self::healthy(client_port) {
                return Some(child);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Whether etcd answers its health check on `client_port`. A bare connect is not
    /// enough: a connect to a loopback port of the ephemeral range with no listener
    /// can meet itself (the kernel picks that same port as its source), and a
    /// listener may be another process's, or an etcd about to exit.
    fn healthy(client_port: u16) -> bool {
        let addr = format!("127.0.0.1:{client_port}");
        http_exchange(&addr, "/health", "", Duration::from_secs(2))
            .is_ok_and(|answer| status_code(&answer) == 200 && answer.contains("\"health\":\"true\""))
    }

    /// `http://127.0.0.1:PORT`, what `--etcd` and etcd clients take.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// Stops it (`kill -9`).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        self.child = Self::spawn(&self.dir, self.client_port, self.peer_port).expect("etcd did not restart");
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill();
        // Its write-ahead log preallocates tens of MiB.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(program)).find(|p| p.exists())
}

/// Free loopback ports, distinct: all bound at once, then let go.
fn free_ports<const N: usize>() -> [u16; N] {
    let held: [std::net::TcpListener; N] = std::array::from_fn(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    held.map(|l| l.local_addr().unwrap().port())
}
