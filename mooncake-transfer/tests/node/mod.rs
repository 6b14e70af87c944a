//! A region served by another process (the `transfer_node` example), and the checks
//! every transport must pass against it. Shared by the multi-process tests.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use mooncake_transfer::{RemoteRegion, TransferEngine, TransferError, TransferRequest};

/// Bytes of the node's region; byte `i` holds `pattern(i)`.
pub const LEN: u64 = 32 << 20;

/// The node's bytes at `[at, at + len)`.
pub fn pattern(at: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((at + i) % 251) as u8).collect()
}

/// `target/<profile>/examples/transfer_node`, built (once per test process) so that
/// it is never an older build.
fn node_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().unwrap();
            let profile_dir = exe.parent().and_then(|d| d.parent()).unwrap().to_path_buf();
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut build = Command::new(cargo);
            build.args(["build", "-p", "mooncake-transfer", "--example", "transfer_node"]);
            if profile_dir.file_name().is_some_and(|p| p == "release") {
                build.arg("--release");
            }
            assert!(build.status().unwrap().success(), "building the transfer_node example");
            profile_dir.join("examples").join("transfer_node")
        })
        .clone()
}

/// A running `transfer_node`; killed on drop.
pub struct Node {
    pub child: Child,
    pub target: RemoteRegion,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a node serving a region of [`LEN`] bytes on a free loopback port, with `env`
/// (`MOONCAKE_SECRET`, `MOONCAKE_RDMA`, ...).
pub fn spawn_node(env: &[(&str, &str)]) -> Node {
    let mut cmd = Command::new(node_binary());
    cmd.args(["127.0.0.1:0", &LEN.to_string()]).envs(env.iter().copied());
    let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let field = |name: &str| line.split_whitespace().find_map(|w| w.strip_prefix(name).map(str::to_owned));
    let (Some(endpoint), Some(region)) = (field("endpoint="), field("region=").and_then(|r| r.parse().ok())) else {
        let _ = child.kill();
        panic!("transfer_node printed {line:?}");
    };
    Node { child, target: RemoteRegion { endpoint, region } }
}

/// Reads the node's bytes at odd offsets (a striped 16 MiB read among them), writes
/// and reads back a pipelined batch of 64 requests, and checks that bounds and region
/// ids hold across processes and that the node still serves afterwards.
pub fn exercise(cli: &TransferEngine, target: &RemoteRegion) {
    for (at, len) in [(0u64, 1usize), (7, 4096), (1 << 20, 1 << 20), (3, 16 << 20)] {
        let mut back = vec![0u8; len];
        cli.read(target, at, &mut back).unwrap();
        assert!(back == pattern(at, len), "{len} bytes at {at}");
    }
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
    let mut buf = [0u8; 8];
    assert!(matches!(cli.read(target, LEN - 4, &mut buf), Err(TransferError::OutOfBounds { .. })));
    assert!(cli.write(target, u64::MAX - 2, &buf).is_err());
    let ghost = RemoteRegion { region: target.region.wrapping_add(1000), ..target.clone() };
    assert!(matches!(cli.read(&ghost, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    cli.read(target, LEN - 8, &mut buf).unwrap();
    assert_eq!(buf.to_vec(), pattern(LEN - 8, 8));
}
