//! The processes of a benchmark cluster: masters (each optionally pinned to one core
//! with `taskset`) and storage nodes, started from the sibling binaries; their CPU
//! time and resident memory read from `/proc`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError};

use crate::sibling;

/// How long a daemon may take to print the lines that announce it.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `mooncake-master` or `mooncake-client serve`, stopped (SIGTERM) when
/// dropped unless it was killed.
pub(crate) struct Daemon {
    child: Child,
    /// The RPC address (master) or transfer endpoint (node) it announced.
    pub(crate) addr: String,
    /// Where a master serves `/metrics` (None for nodes).
    pub(crate) metrics: Option<String>,
    killed: bool,
}

/// How a master is started.
pub(crate) struct MasterSpec<'a> {
    /// etcd endpoint and cluster name (None: a single master).
    pub(crate) cluster: Option<(&'a str, &'a str)>,
    /// Pin it to this core (`taskset -c`).
    pub(crate) core: Option<usize>,
    /// Leadership lease (ms).
    pub(crate) lease_ttl_ms: u64,
    /// Client TTL (ms): also a new leader's recovery window.
    pub(crate) client_ttl_ms: u64,
}

impl Daemon {
    /// Starts a master and reads its RPC and metrics addresses.
    pub(crate) fn master(spec: &MasterSpec<'_>) -> Result<Daemon, String> {
        let (lease, ttl) = (spec.lease_ttl_ms.to_string(), spec.client_ttl_ms.to_string());
        let mut args =
            vec!["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--client-ttl-ms", ttl.as_str()];
        if let Some((etcd, name)) = spec.cluster {
            args.extend(["--etcd", etcd, "--cluster-id", name, "--lease-ttl-ms", lease.as_str()]);
        }
        let (child, lines) = spawn(&sibling("mooncake-master"), spec.core, &args, 2)?;
        let last_word = |l: &String| l.rsplit(' ').next().unwrap_or_default().to_owned();
        Ok(Daemon { child, addr: last_word(&lines[0]), metrics: Some(last_word(&lines[1])), killed: false })
    }

    /// Starts a storage node serving `segment_size` bytes (`mooncake-client serve`).
    pub(crate) fn node(master: &str, segment_size: &str) -> Result<Daemon, String> {
        let args = ["serve", "--master", master, "--listen", "127.0.0.1:0", "--segment-size", segment_size];
        let (child, lines) = spawn(&sibling("mooncake-client"), None, &args, 1)?;
        if !lines[0].starts_with("mooncake-client serving segment") {
            return Err(format!("unexpected first line of a node: {}", lines[0]));
        }
        let addr = lines[0].rsplit(' ').next().unwrap_or_default().to_owned();
        Ok(Daemon { child, addr, metrics: None, killed: false })
    }

    /// Its process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `kill -9`, and reap it.
    pub(crate) fn kill9(&mut self) -> Result<(), String> {
        self.child.kill().map_err(|e| format!("kill -9 {}: {e}", self.pid()))?;
        self.child.wait().map_err(|e| e.to_string())?;
        self.killed = true;
        Ok(())
    }

    /// The value of one metric of its `/metrics` (0 when absent).
    pub(crate) fn metric(&self, name: &str) -> Result<f64, String> {
        let addr = self.metrics.as_deref().ok_or("not a master")?;
        let mut s = TcpStream::connect(addr).map_err(|e| format!("metrics at {addr}: {e}"))?;
        s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| e.to_string())?;
        write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
        let mut text = String::new();
        s.read_to_string(&mut text).map_err(|e| format!("metrics at {addr}: {e}"))?;
        Ok(text
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if !self.killed {
            let _ = Command::new("kill").arg("-TERM").arg(self.pid().to_string()).status();
            let _ = self.child.wait();
        }
    }
}

/// Starts `program` (under `taskset -c core` if given) and returns it with its first
/// `lines` lines of output; the rest of its output is drained on a thread, so that
/// the process never blocks on (or dies of) a full or closed pipe.
fn spawn(program: &Path, core: Option<usize>, args: &[&str], lines: usize) -> Result<(Child, Vec<String>), String> {
    let mut cmd = match core {
        Some(c) => {
            let mut cmd = Command::new("taskset");
            cmd.arg("-c").arg(c.to_string()).arg(program);
            cmd
        }
        None => Command::new(program),
    };
    // The masters log every extent mounted at info: keep the benchmark's output short.
    if std::env::var_os("RUST_LOG").is_none() {
        cmd.env("RUST_LOG", "warn");
    }
    let mut child = cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().map_err(|e| {
        format!(
            "cannot start {}: {e} (build with `cargo build --release -p mooncake-cli -p mooncake-bench`)",
            program.display()
        )
    })?;
    let out = child.stdout.take().ok_or("no stdout")?;
    let rx = read_lines(out);
    let mut got = Vec::new();
    while got.len() < lines {
        match rx.recv_timeout(START_TIMEOUT) {
            Ok(l) => got.push(l),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                let why = match e {
                    RecvTimeoutError::Timeout => "printed nothing in 30 s",
                    RecvTimeoutError::Disconnected => "exited",
                };
                return Err(format!("{} {why} (output so far: {got:?})", program.display()));
            }
        }
    }
    Ok((child, got))
}

/// The lines of `out`, read on a thread until it closes.
fn read_lines(out: impl Read + Send + 'static) -> Receiver<String> {
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            // Nobody listens after the start: keep reading so the pipe never fills.
            let _ = tx.send(line.trim().to_owned());
        }
    });
    rx
}

/// Clock ticks per second of `/proc/<pid>/stat` times.
fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// CPU seconds (user + system) process `pid` has used so far, all its threads.
pub(crate) fn cpu_seconds(pid: u32) -> Result<f64, String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| format!("/proc/{pid}/stat: {e}"))?;
    // Fields after the command name (which may hold spaces) start at field 3, state;
    // utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').ok_or("malformed /proc stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| fields.get(i).and_then(|v| v.parse::<u64>().ok()).ok_or("malformed /proc stat");
    Ok((tick(11)? + tick(12)?) as f64 / clock_ticks())
}

/// Resident bytes of process `pid`.
pub(crate) fn rss_bytes(pid: u32) -> Result<u64, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| format!("no VmRSS in /proc/{pid}/status"))
}

/// Busy and total clock ticks of each CPU of the host so far (`/proc/stat`; busy is
/// all but idle and iowait): sampled twice, the share of each core that was in use,
/// by anyone.
pub(crate) fn core_ticks() -> Result<Vec<(u64, u64)>, String> {
    let stat = std::fs::read_to_string("/proc/stat").map_err(|e| format!("/proc/stat: {e}"))?;
    Ok(stat
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .map(|l| {
            let v: Vec<u64> = l.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
            let total: u64 = v.iter().take(8).sum();
            let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
            (total - idle, total)
        })
        .collect())
}

/// The host's 1-minute load average (other work on a shared host shows here).
pub(crate) fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}
