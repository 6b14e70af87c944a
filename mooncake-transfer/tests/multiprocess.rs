//! Another process serves a region (the `transfer_node` example); this process reads
//! and writes it over Tcp and over Shm, and the engine picks Shm by itself for a
//! same-host peer.

mod node;

use std::sync::Arc;

use mooncake_transfer::{SharedSecret, ShmTransport, TcpTransport, TransferEngine, TransferError, TransferRequest};
use node::{exercise, pattern, spawn_node};

#[test]
fn another_process_is_read_and_written_over_tcp() {
    let node = spawn_node(&[]);
    let tcp = Arc::new(TcpTransport::new());
    let cli = TransferEngine::builder().transport(tcp.clone()).build().unwrap();
    exercise(&cli, &node.target);
    let s = &cli.stats()[0];
    assert_eq!(s.transport, "tcp");
    assert!(s.bytes_read >= 17 << 20 && s.bytes_written > 0, "{s:?}");
}

#[test]
fn another_process_is_mapped_over_shm() {
    let node = spawn_node(&[]);
    let shm = Arc::new(ShmTransport::new());
    let cli = TransferEngine::builder().transport(shm.clone()).build().unwrap();
    exercise(&cli, &node.target);
    let s = &cli.stats()[0];
    assert_eq!(s.transport, "shm");
    assert!(s.bytes_read >= 17 << 20 && s.bytes_written > 0, "{s:?}");
}

#[test]
fn a_network_engine_picks_shm_for_a_same_host_peer_and_mixes_transports_in_a_batch() {
    let node = spawn_node(&[]);
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
    let node = spawn_node(&[("MOONCAKE_SECRET", "node secret")]);
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
    let mut node = spawn_node(&[]);
    let cli = TransferEngine::builder().transport(Arc::new(ShmTransport::new())).build().unwrap();
    let mut buf = [0u8; 64];
    cli.read(&node.target, 0, &mut buf).unwrap();
    assert_eq!(buf.to_vec(), pattern(0, 64));
    node.child.kill().unwrap();
    node.child.wait().unwrap();
    assert!(cli.read(&node.target, 0, &mut buf).is_err(), "the mapping outlived its owner");
    assert!(cli.write(&node.target, 0, &buf).is_err());
}
