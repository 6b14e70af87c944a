//! A real etcd on loopback for the cluster benchmarks, or one already running.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The etcd a benchmark's masters coordinate through: one this process started (killed
/// and its data removed when dropped) or one given by its endpoint.
pub(crate) struct Etcd {
    child: Option<Child>,
    dir: Option<PathBuf>,
    endpoint: String,
}

impl Etcd {
    /// `endpoint` (`http://H:P`) if given, else a new etcd on loopback. Ports are taken
    /// from the kernel and released before etcd binds them, so another process may take
    /// one first: etcd then exits and is started again on other ports.
    pub(crate) fn start_or(endpoint: Option<&str>) -> Result<Etcd, String> {
        if let Some(e) = endpoint {
            return Ok(Etcd { child: None, dir: None, endpoint: e.to_owned() });
        }
        let dir = std::env::temp_dir().join(format!("mooncake-bench-etcd-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for _ in 0..10 {
            let (client, peer) = (free_port()?, free_port()?);
            if let Some(child) = spawn(&dir, client, peer)? {
                return Ok(Etcd { child: Some(child), dir: Some(dir), endpoint: format!("http://127.0.0.1:{client}") });
            }
        }
        Err("etcd did not start on loopback (10 tries)".into())
    }

    /// `http://127.0.0.1:PORT`, what `mooncake-master --etcd` takes.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `etcd://127.0.0.1:PORT/<cluster>`, what clients and nodes take.
    pub(crate) fn cluster_address(&self, cluster: &str) -> String {
        format!("etcd://{}/{cluster}", self.endpoint.trim_start_matches("http://"))
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(listener.local_addr().map_err(|e| e.to_string())?.port())
}

/// Starts etcd and waits until its client port accepts; None when it exited (a port
/// was taken meanwhile).
fn spawn(dir: &std::path::Path, client_port: u16, peer_port: u16) -> Result<Option<Child>, String> {
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let data = dir.join("data");
    let mut child = Command::new("etcd")
        .args(["--name", "bench", "--data-dir", data.to_str().ok_or("temp dir is not UTF-8")?])
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("bench={peer}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start etcd: {e} (apt-get install etcd-server)"))?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if let Ok(Some(_)) = child.try_wait() {
            let _ = std::fs::remove_dir_all(dir);
            return Ok(None);
        }
        if TcpStream::connect(("127.0.0.1", client_port)).is_ok() {
            return Ok(Some(child));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(dir);
    Ok(None)
}
