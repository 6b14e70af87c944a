//! Another process serves a region over RDMA on software NICs (the `transfer_node`
//! example with `MOONCAKE_RDMA=soft`); this process reads and writes it with the
//! `Rdma` transport on its own software NICs. Every test prints which seam
//! implementation ran: nothing here is an RDMA result.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_transfer::{
    RdmaConfig, RdmaProvider, RdmaTransport, RemoteRegion, SoftRdma, TransferEngine, TransferError, TransferRequest,
};

const LEN: u64 = 32 << 20;

/// `target/<profile>/examples/transfer_node`, built (once per test process) so that
/// it is never an older build without the RDMA switch.
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

/// A running `transfer_node` serving soft RDMA; killed on drop.
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

fn spawn_node() -> Node {
    let mut cmd = Command::new(node_binary());
    cmd.args(["127.0.0.1:0", &LEN.to_string()]).env("MOONCAKE_RDMA", "soft");
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

fn pattern(at: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| ((at + i) % 251) as u8).collect()
}

fn rdma_client(config: RdmaConfig) -> (TransferEngine, Arc<RdmaTransport>) {
    let nics = SoftRdma::new(2).unwrap();
    println!("client on the {} RDMA seam (software NICs, not an RDMA result)", nics.implementation());
    let rdma = Arc::new(RdmaTransport::new(&nics, config).unwrap());
    (TransferEngine::builder().transport(rdma.clone()).build().unwrap(), rdma)
}

#[test]
fn another_process_is_read_and_written_over_soft_rdma() {
    let node = spawn_node();
    let (cli, rdma) = rdma_client(RdmaConfig::default());
    let target = &node.target;
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
    let ghost = RemoteRegion { region: target.region.wrapping_add(1000), ..target.clone() };
    assert!(matches!(cli.read(&ghost, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    cli.read(target, LEN - 8, &mut buf).unwrap();
    assert_eq!(buf.to_vec(), pattern(LEN - 8, 8));
    assert!(!rdma.falls_back_to_tcp(&target.endpoint), "the node serves RDMA");
    let s = &cli.stats()[0];
    assert_eq!(s.transport, "rdma");
    assert!(s.bytes_read >= 17 << 20 && s.bytes_written > 0, "{s:?}");
    assert!(rdma.nic_bytes().iter().all(|&b| b > 0), "striped over both NICs: {:?}", rdma.nic_bytes());
}

#[test]
fn a_peer_process_dying_mid_transfer_fails_within_the_deadline() {
    let mut node = spawn_node();
    let (cli, _) = rdma_client(RdmaConfig { deadline: Duration::from_secs(5), ..RdmaConfig::default() });
    let target = node.target.clone();
    let mut warm = [0u8; 16];
    cli.read(&target, 0, &mut warm).unwrap();
    let pid = node.child.id();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(10));
        // SAFETY: kill(2) takes two integers and touches no memory of ours; the pid
        // is our child's, not yet waited for (so not reused).
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    });
    let started = Instant::now();
    let mut failed = false;
    for _ in 0..20 {
        let mut big = vec![0u8; 30 << 20];
        if let Err(e) = cli.read(&target, 0, &mut big) {
            assert!(
                matches!(e, TransferError::Io(_) | TransferError::Unreachable(_) | TransferError::TimedOut(_)),
                "{e}"
            );
            failed = true;
            break;
        }
    }
    killer.join().unwrap();
    let _ = node.child.wait();
    assert!(failed, "reads kept succeeding after the node died");
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    // Later requests fail fast.
    let t = Instant::now();
    for _ in 0..20 {
        assert!(cli.read(&target, 0, &mut warm).is_err());
    }
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
}
