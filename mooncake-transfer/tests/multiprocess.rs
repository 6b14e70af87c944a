//! Another process serves a region (the `transfer_node` example); this process reads
//! and writes it over Tcp and over Shm, and the engine picks Shm by itself for a
//! same-host peer.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use mooncake_transfer::{
    RemoteRegion, SharedSecret, ShmTransport, TcpTransport, TransferEngine, TransferError, TransferRequest,
};

const LEN: u64 = 32 << 20;

/// `target/<profile>/examples/transfer_node`, built on demand if `cargo test` did
/// not build examples.
fn node_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
    let bin = profile_dir.join("examples").join("transfer_node");
    if !bin.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let ok = Command::new(cargo)
            .args(["build", "-p", "mooncake-transfer", "--example", "transfer_node"])
            .status()
            .unwrap();
        assert!(ok.success(), "building the transfer_node example");
    }
    bin
}

/// A running `transfer_node`; killed on drop.
struct Node {
    child: Child,
    target: RemoteRegion,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_node(secret: Option<&str>) -> Node {
    let mut cmd = Command::new(node_binary());
    cmd.args(["127.0.0.1:0", &LEN.to_string()]).stdin(Stdio::piped()).stdout(Stdio::piped());
    if let Some(s) = secret {
        cmd.env("MOONCAKE_SECRET", s);
    }
    let mut child = cmd.spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let mut endpoint = None;
    let mut region = None;
    for word in line.split_whitespace() {
        if let Some(e) = word.strip_prefix("endpoint=") {
            endpoint = Some(e.to_owned());
        } else if let Some(r) = word.strip_prefix("region=") {
            region = r.parse().ok();
        }
    }
    let (Some(endpoint), Some(region)) = (endpoint, region) else {
        let _ = child.kill();
        panic!("transfer_node printed {line:?}");
    };
    Node { child, target: RemoteRegion { endpoint, region } }
}

fn pattern(at: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((at + i) % 251) as u8).collect()
}

fn exercise(cli: &TransferEngine, target: &RemoteRegion) {
    // The node's own bytes, at odd offsets, including a striped 16 MiB read.
    for (at, len) in [(0u64, 1usize), (7, 4096), (1 << 20, 1 << 20), (3, 16 << 20)] {
        let mut back = vec![0u8; len];
        cli.read(target, at, &mut back).unwrap();
        assert!(back == pattern(at, len), "{len} bytes at {at}");
    }
    // Writes come back; a batch of many requests is pipelined.
    let blocks: Vec<Vec<u8>> = (0..64).map(|i| vec![i as u8 ^ 0x5a; 4096 + i]).collect();
    let base = 20u64 << 20;
    let mut reqs: Vec<TransferRequest<'_>> =
        blocks.iter().enumerate().map(|(i, b)| TransferRequest::write(target, base + i as u64 * 8192, b)).collect();
    assert!(cli.transfer(&mut reqs).iter().all(|r| r.is_ok()));
    let mut backs: Vec<Vec<u8>> = blocks.iter().map(|b| vec![0u8; b.len()]).collect();
    let mut reqs: Vec<TransferRequest<'_>> =
        backs.iter_mut().enumerate().map(|(i, b)| TransferRequest::read(target, base + i as u64 * 8192, b)).collect();
    assert!(cli.transfer(&mut reqs).iter().all(|r| r.is_ok()));
    drop(reqs);
    assert_eq!(backs, blocks);
    // Bounds hold across processes, and the node still serves afterwards.
    let mut buf = [0u8; 8];
    assert!(matches!(cli.read(target, LEN - 4, &mut buf), Err(TransferError::OutOfBounds { .. })));
    assert!(cli.write(target, u64::MAX - 2, &buf).is_err());
    let ghost = RemoteRegion { region: target.region.wrapping_add(1000), ..target.clone() };
    assert!(matches!(cli.read(&ghost, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    cli.read(target, LEN - 8, &mut buf).unwrap();
    assert_eq!(buf.to_vec(), pattern(LEN - 8, 8));
}

#[test]
fn another_process_is_read_and_written_over_tcp() {
    let node = spawn_node(None);
    let tcp = Arc::new(TcpTransport::new());
    let cli = TransferEngine::builder().transport(tcp.clone()).build().unwrap();
    exercise(&cli, &node.target);
    let s = &cli.stats()[0];
    assert_eq!(s.transport, "tcp");
    assert!(s.bytes_read >= 17 << 20 && s.bytes_written > 0, "{s:?}");
}

#[test]
fn another_process_is_mapped_over_shm() {
    let node = spawn_node(None);
    let shm = Arc::new(ShmTransport::new());
    let cli = TransferEngine::builder().transport(shm.clone()).build().unwrap();
    exercise(&cli, &node.target);
    let s = &cli.stats()[0];
    assert_eq!(s.transport, "shm");
    assert!(s.bytes_read >= 17 << 20 && s.bytes_written > 0, "{s:?}");
}

#[test]
fn a_network_engine_picks_shm_for_a_same_host_peer_and_mixes_transports_in_a_batch() {
    let node = spawn_node(None);
    let cli = TransferEngine::builder().network().shared_memory(true).build().unwrap();
    assert_eq!(cli.transport_names(), ["local", "shm", "tcp"]);
    assert_eq!(cli.transport_name(&node.target.endpoint), Some("shm"));
    // One batch: a region of an in-process engine (Local) and the node's (Shm).
    let here = TransferEngine::new();
    let seg = here.register_region(1 << 20).unwrap();
    let local = here.remote(seg.id());
    let (a, b) = (vec![1u8; 100_000], vec![2u8; 100_000]);
    let mut reqs = [TransferRequest::write(&local, 0, &a), TransferRequest::write(&node.target, 30 << 20, &b)];
    assert!(cli.transfer(&mut reqs).iter().all(|r| r.is_ok()));
    let mut back = vec![0u8; 100_000];
    cli.read(&node.target, 30 << 20, &mut back).unwrap();
    assert_eq!(back, b);
    seg.copy_out(0, &mut back).unwrap();
    assert_eq!(back, a);
    let stats = cli.stats();
    let by = |n: &str| stats.iter().find(|s| s.transport == n).cloned().unwrap();
    assert_eq!(by("shm").bytes_written, 100_000);
    assert_eq!(by("shm").bytes_read, 100_000);
    assert_eq!((by("tcp").bytes_read, by("tcp").bytes_written), (0, 0));
    // Without shared memory the same peer is served by Tcp.
    let plain = TransferEngine::builder().network().build().unwrap();
    assert_eq!(plain.transport_name(&node.target.endpoint), Some("tcp"));
    plain.read(&node.target, 0, &mut back).unwrap();
    assert_eq!(back, pattern(0, back.len()));
}

#[test]
fn another_process_requires_its_secret() {
    let node = spawn_node(Some("node secret"));
    for t in [
        Arc::new(TcpTransport::with_secret(SharedSecret::new(b"node secret"))) as Arc<dyn mooncake_transfer::Transport>,
        Arc::new(ShmTransport::with_secret(SharedSecret::new(b"node secret"))),
    ] {
        let cli = TransferEngine::builder().transport(t).build().unwrap();
        let mut buf = [0u8; 16];
        cli.read(&node.target, 100, &mut buf).unwrap();
        assert_eq!(buf.to_vec(), pattern(100, 16));
    }
    let mut buf = [0u8; 16];
    let wrong = TransferEngine::builder()
        .transport(Arc::new(TcpTransport::with_secret(SharedSecret::new(b"x"))))
        .build()
        .unwrap();
    assert!(matches!(wrong.read(&node.target, 0, &mut buf), Err(TransferError::Auth(_))));
    let none = TransferEngine::builder().transport(Arc::new(ShmTransport::new())).build().unwrap();
    assert!(none.read(&node.target, 0, &mut buf).is_err(), "no secret, no mapping either");
}

#[test]
fn a_dead_peer_is_never_served_from_a_cached_mapping() {
    let mut node = spawn_node(None);
    let cli = TransferEngine::builder().transport(Arc::new(ShmTransport::new())).build().unwrap();
    let mut buf = [0u8; 64];
    cli.read(&node.target, 0, &mut buf).unwrap();
    assert_eq!(buf.to_vec(), pattern(0, 64));
    node.child.kill().unwrap();
    node.child.wait().unwrap();
    assert!(cli.read(&node.target, 0, &mut buf).is_err(), "the mapping outlived its owner");
    assert!(cli.write(&node.target, 0, &buf).is_err());
}
