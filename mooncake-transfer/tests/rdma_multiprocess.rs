//! Another process serves a region over RDMA on software NICs (the `transfer_node`
//! example with `MOONCAKE_RDMA=soft`); this process reads and writes it with the
//! `Rdma` transport on its own software NICs. Every test prints which seam
//! implementation ran: nothing here is an RDMA result.

mod node;

use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_transfer::{RdmaConfig, RdmaProvider, RdmaTransport, SoftRdma, TransferEngine, TransferError};
use node::{exercise, spawn_node};

/// A node serving its region over soft RDMA (and TCP for the handshake).
fn spawn_rdma_node() -> node::Node {
    spawn_node(&[("MOONCAKE_RDMA", "soft")])
}

fn rdma_client(config: RdmaConfig) -> (TransferEngine, Arc<RdmaTransport>) {
    let nics = SoftRdma::new(2).unwrap();
    println!("client on the {} RDMA seam (software NICs, not an RDMA result)", nics.implementation());
    let rdma = Arc::new(RdmaTransport::new(&nics, config).unwrap());
    (TransferEngine::builder().transport(rdma.clone()).build().unwrap(), rdma)
}

#[test]
fn another_process_is_read_and_written_over_soft_rdma() {
    let node = spawn_rdma_node();
    let (cli, rdma) = rdma_client(RdmaConfig::default());
    let target = &node.target;
    exercise(&cli, target);
    assert!(!rdma.falls_back_to_tcp(&target.endpoint), "the node serves RDMA");
    let s = &cli.stats()[0];
    assert_eq!(s.transport, "rdma");
    assert!(s.bytes_read >= 17 << 20 && s.bytes_written > 0, "{s:?}");
    assert!(rdma.nic_bytes().iter().all(|&b| b > 0), "striped over both NICs: {:?}", rdma.nic_bytes());
}

#[test]
fn a_peer_process_dying_mid_transfer_fails_within_the_deadline() {
    let mut node = spawn_rdma_node();
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
