//! The `Rdma` transport on the software seam (`SoftRdma`): every test prints which
//! implementation ran; nothing here is an RDMA result.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_transfer::{
    FrameOp, FrameStatus, RdmaConfig, RdmaProvider, RdmaTransport, RequestHeader, ResponseHeader, SoftPortConfig,
    SoftRdma, TransferEngine, TransferError, TransferRequest, RESPONSE_HEADER_LEN,
};

fn on_seam(test: &str, provider: &dyn RdmaProvider) {
    println!("{test}: ran on the {} RDMA seam (software NICs, not an RDMA result)", provider.implementation());
}

/// A listening engine serving RDMA on `soft`'s NICs.
fn server(soft: &Arc<SoftRdma>) -> TransferEngine {
    TransferEngine::builder().tcp_listen("127.0.0.1:0").rdma(soft.clone(), RdmaConfig::default()).build().unwrap()
}

/// A client engine whose only transport is `Rdma` on `soft`'s NICs.
fn client(soft: &SoftRdma, config: RdmaConfig) -> (TransferEngine, Arc<RdmaTransport>) {
    let rdma = Arc::new(RdmaTransport::new(soft, config).unwrap());
    (TransferEngine::builder().transport(rdma.clone()).build().unwrap(), rdma)
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 249) as u8) ^ (i >> 16) as u8).collect()
}

#[test]
fn rdma_moves_exact_bytes_and_stripes_large_requests_over_both_nics() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(2).unwrap()), SoftRdma::new(2).unwrap());
    on_seam("rdma_moves_exact_bytes", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(64 << 20).unwrap();
    let target = srv.remote(seg.id());
    for (i, len) in [1usize, 4096, 1 << 20, 16 << 20].into_iter().enumerate() {
        let data = bytes(i as u8, len);
        let offset = 4096 * i as u64 + 3;
        cli.write(&target, offset, &data).unwrap();
        let mut back = vec![0u8; len];
        cli.read(&target, offset, &mut back).unwrap();
        assert!(back == data, "{len} bytes came back different");
        let mut local = vec![0u8; len];
        seg.copy_out(offset, &mut local).unwrap();
        assert!(local == data, "the server's memory holds the {len} bytes");
    }
    assert!(!rdma.falls_back_to_tcp(&target.endpoint));
    let s = rdma.stats();
    assert!(s.bytes_read.load(Ordering::Relaxed) >= 17 << 20);
    assert!(s.bytes_written.load(Ordering::Relaxed) >= 17 << 20);
    let per_nic = rdma.nic_bytes();
    assert!(per_nic.iter().all(|&b| b >= 8 << 20), "a 16 MiB request is striped over both NICs: {per_nic:?}");
    assert_eq!(cli.stats()[0].transport, "rdma");
}

#[test]
fn rdma_refuses_requests_outside_registered_regions_and_touches_nothing() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(1).unwrap());
    on_seam("rdma_refuses_out_of_bounds", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, _) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(4096).unwrap();
    let target = srv.remote(seg.id());
    cli.write(&target, 0, &[7u8; 4096]).unwrap();
    let err = cli.write(&target, 4090, &[1u8; 7]).unwrap_err();
    assert!(matches!(err, TransferError::OutOfBounds { offset: 4090, len: 7, region_len: 4096, .. }), "{err}");
    assert!(matches!(cli.write(&target, u64::MAX, &[1u8; 2]), Err(TransferError::OutOfBounds { .. })));
    let mut buf = [0u8; 8];
    assert!(matches!(cli.read(&target, 4093, &mut buf), Err(TransferError::OutOfBounds { .. })));
    let ghost = mooncake_transfer::RemoteRegion { region: target.region.wrapping_add(1000), ..target.clone() };
    assert!(matches!(cli.read(&ghost, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    let mut back = vec![0u8; 4096];
    cli.read(&target, 0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 7), "a refused write changed memory");
    // A region the server stops serving: its keys are revoked, the client asks
    // again and learns the region is gone.
    assert!(srv.unregister_region(seg.id()));
    assert!(matches!(cli.read(&target, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
}

#[test]
fn rdma_batches_of_many_requests_complete_exactly() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(2).unwrap()), SoftRdma::new(2).unwrap());
    on_seam("rdma_batches", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, _) = client(&cli_nics, RdmaConfig { max_batch: 16, ..RdmaConfig::default() });
    let seg = srv.register_region(8 << 20).unwrap();
    let target = srv.remote(seg.id());
    let blocks: Vec<Vec<u8>> = (0..300).map(|i| bytes(i as u8, 1000 + i)).collect();
    let mut reqs: Vec<TransferRequest<'_>> =
        blocks.iter().enumerate().map(|(i, b)| TransferRequest::write(&target, i as u64 * 8192, b)).collect();
    let rung = cli_nics.doorbells();
    assert!(cli.transfer(&mut reqs).iter().all(|r| r.is_ok()));
    // 300 requests over 4 queue pairs, at most 16 per doorbell: 75 per queue pair at
    // most on any of them, so no more than 4 x ceil(75 / 16) = 20 doorbells.
    let rung = cli_nics.doorbells() - rung;
    assert!((19..=20).contains(&rung), "{rung} doorbells for 300 requests in batches of 16");
    let mut backs: Vec<Vec<u8>> = blocks.iter().map(|b| vec![0u8; b.len()]).collect();
    let mut reqs: Vec<TransferRequest<'_>> =
        backs.iter_mut().enumerate().map(|(i, b)| TransferRequest::read(&target, i as u64 * 8192, b)).collect();
    // One bad request in the batch fails alone.
    let mut bad = [0u8; 16];
    reqs.push(TransferRequest::read(&target, (8 << 20) - 8, &mut bad));
    let out = cli.transfer(&mut reqs);
    assert!(out[..300].iter().all(|r| r.is_ok()));
    assert!(matches!(out[300], Err(TransferError::OutOfBounds { .. })));
    drop(reqs);
    assert_eq!(backs, blocks);
}

#[test]
fn rdma_splits_regions_above_max_mr_size() {
    let small = SoftPortConfig { max_mr_size: 64 << 10, ..SoftPortConfig::default() };
    let srv_nics = Arc::new(SoftRdma::with_ports(&[small, small]).unwrap());
    let cli_nics = SoftRdma::with_ports(&[small]).unwrap();
    on_seam("rdma_splits_regions", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    // Crosses many 64 KiB memory regions on both sides, at odd offsets.
    let data = bytes(9, 700_001);
    cli.write(&target, 12_345, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    cli.read(&target, 12_345, &mut back).unwrap();
    assert!(back == data);
    let mut local = vec![0u8; data.len()];
    seg.copy_out(12_345, &mut local).unwrap();
    assert!(local == data);
    assert!(rdma.registrations() >= 11, "700 KB in 64 KiB regions: {}", rdma.registrations());
    // A region larger than the device registers at all is served as pieces too.
    let big = srv.register_region((64 << 10) * 3 + 1).unwrap();
    cli.write(&srv.remote(big.id()), (64 << 10) * 3 - 1, &[5, 6]).unwrap();
    let mut two = [0u8; 2];
    big.copy_out((64 << 10) * 3 - 1, &mut two).unwrap();
    assert_eq!(two, [5, 6]);
}

#[test]
fn rdma_registers_a_reused_buffer_once() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(2).unwrap());
    on_seam("rdma_registration_cache", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    let mut buf = vec![0u8; 256 << 10];
    cli.read(&target, 0, &mut buf).unwrap();
    let after_first = rdma.registrations();
    assert!(after_first > 0);
    for i in 0..20 {
        cli.read(&target, i * 1024, &mut buf).unwrap();
        cli.read(&target, 0, &mut buf[1000..5000]).unwrap();
    }
    assert_eq!(rdma.registrations(), after_first, "the same buffer is never registered again");
    rdma.forget_registrations();
    cli.read(&target, 0, &mut buf).unwrap();
    assert!(rdma.registrations() > after_first, "a forgotten buffer registers again");
}

#[test]
fn rdma_path_mtu_is_the_smaller_of_both_ports() {
    let srv_nics = Arc::new(SoftRdma::with_ports(&[SoftPortConfig { mtu: 1024, ..Default::default() }]).unwrap());
    let cli_nics = SoftRdma::with_ports(&[SoftPortConfig { mtu: 4096, ..Default::default() }]).unwrap();
    on_seam("rdma_path_mtu", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(4096).unwrap();
    cli.write(&srv.remote(seg.id()), 0, b"mtu").unwrap();
    assert_eq!(rdma.path_mtu(srv.endpoint()), Some(1024));
}

#[test]
fn rdma_falls_back_to_tcp_for_a_peer_without_rdma() {
    let cli_nics = SoftRdma::new(1).unwrap();
    on_seam("rdma_falls_back_to_tcp", &cli_nics);
    let srv = TransferEngine::builder().tcp_listen("127.0.0.1:0").build().unwrap();
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    let data = bytes(3, 300_000);
    cli.write(&target, 10, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    cli.read(&target, 10, &mut back).unwrap();
    assert!(back == data);
    assert!(rdma.falls_back_to_tcp(&target.endpoint));
    assert_eq!(rdma.path_mtu(&target.endpoint), None);
    assert!(matches!(cli.read(&target, 1 << 20, &mut back), Err(TransferError::OutOfBounds { .. })));
}

#[test]
fn rdma_handshake_garbage_is_refused_and_the_server_keeps_serving() {
    let srv_nics = Arc::new(SoftRdma::new(1).unwrap());
    on_seam("rdma_handshake_garbage", srv_nics.as_ref());
    let srv = server(&srv_nics);
    let seg = srv.register_region(4096).unwrap();
    for payload in [&b"garbage"[..], b"MCRD\x01\x05\x00", b"MCRD\x09\x00\x00", &[0xffu8; 4000][..]] {
        let h =
            RequestHeader { op: FrameOp::RdmaConnect, request_id: 3, region: 0, offset: 0, len: payload.len() as u64 };
        let mut s = TcpStream::connect(srv.endpoint()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(&h.encode()).unwrap();
        s.write_all(payload).unwrap();
        let mut head = [0u8; RESPONSE_HEADER_LEN];
        s.read_exact(&mut head).unwrap();
        let r = ResponseHeader::decode(&head, 0).unwrap();
        assert_eq!((r.status, r.request_id), (FrameStatus::Refused, 3));
    }
    // Garbage straight at a software NIC's port is dropped too.
    let port = srv_nics.ports()[0].lid;
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(&[0xAB; 64]).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert_eq!(out, [0], "an unknown queue pair is refused");
    let (cli, _) = client(&SoftRdma::new(1).unwrap(), RdmaConfig::default());
    cli.write(&srv.remote(seg.id()), 0, b"still serving").unwrap();
}

#[test]
fn rdma_slow_completions_hit_the_deadline_and_the_link_recovers() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(1).unwrap());
    on_seam("rdma_deadline", &cli_nics);
    let srv = server(&srv_nics);
    let config = RdmaConfig { deadline: Duration::from_millis(300), ..RdmaConfig::default() };
    let (cli, _) = client(&cli_nics, config);
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    cli.write(&target, 0, b"before").unwrap();
    srv_nics.faults().set_completion_delay(Duration::from_secs(2));
    let started = Instant::now();
    let mut buf = vec![0u8; 64 << 10];
    let err = cli.read(&target, 0, &mut buf).unwrap_err();
    assert!(matches!(err, TransferError::TimedOut(_)), "{err}");
    assert!(started.elapsed() < Duration::from_millis(1500), "returned after {:?}", started.elapsed());
    srv_nics.faults().set_completion_delay(Duration::ZERO);
    std::thread::sleep(Duration::from_millis(100));
    let mut back = [0u8; 6];
    cli.read(&target, 0, &mut back).unwrap();
    assert_eq!(&back, b"before");
}

#[test]
fn rdma_queue_pair_errors_are_retried_on_a_new_link() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(1).unwrap());
    on_seam("rdma_qp_error", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, _) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    cli.write(&target, 0, b"one").unwrap();
    cli_nics.faults().fail_next_posts(1);
    cli.write(&target, 3, b"two").unwrap();
    let mut back = [0u8; 6];
    cli.read(&target, 0, &mut back).unwrap();
    assert_eq!(&back, b"onetwo");
}

#[test]
fn rdma_peer_death_fails_fast_without_a_reconnection_storm_and_recovers() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(2).unwrap()), SoftRdma::new(2).unwrap());
    on_seam("rdma_peer_death", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(64 << 20).unwrap();
    let target = srv.remote(seg.id());
    // The NICs die in the middle of a striped 48 MiB read.
    let killer = {
        let nics = srv_nics.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            nics.faults().kill();
        })
    };
    let started = Instant::now();
    let mut big = vec![0u8; 48 << 20];
    let first = cli.read(&target, 0, &mut big);
    killer.join().unwrap();
    // Either it finished before the kill, or it failed with a link error.
    if let Err(e) = &first {
        assert!(matches!(e, TransferError::Io(_) | TransferError::Unreachable(_)), "{e}");
    }
    // Every later request fails fast: no reconnection per request.
    let mut small = [0u8; 64];
    let mut failures = 0;
    for _ in 0..50 {
        if let Err(e) = cli.read(&target, 0, &mut small) {
            assert!(matches!(e, TransferError::Io(_) | TransferError::Unreachable(_)), "{e}");
            failures += 1;
        }
    }
    assert_eq!(failures, 50);
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
    assert!(rdma.stats().errors.load(Ordering::Relaxed) >= 50);
    // The NICs come back: after the cooldown the link is set up again.
    srv_nics.faults().revive();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match cli.read(&target, 0, &mut small) {
            Ok(()) => break,
            Err(e) if Instant::now() < deadline => {
                assert!(matches!(e, TransferError::Io(_) | TransferError::Unreachable(_)), "{e}");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("the link never came back: {e}"),
        }
    }
}

/// The NUMA node of the page at `addr`, as the kernel reports it.
fn numa_node_of(addr: *const u8) -> Option<u32> {
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR) writes one int to `node`;
    // no node mask is asked for; `addr` is only looked up.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            3 as libc::c_ulong,
        )
    };
    (rc == 0 && node >= 0).then_some(node as u32)
}

#[test]
fn rdma_small_requests_stay_on_the_nic_nearest_the_buffer() {
    let mut buf = vec![1u8; 64 << 10];
    let node = numa_node_of(buf.as_ptr());
    let far = SoftPortConfig { numa_node: Some(node.unwrap_or(0) + 63), ..SoftPortConfig::default() };
    let near = SoftPortConfig { numa_node: Some(node.unwrap_or(0)), ..SoftPortConfig::default() };
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(2).unwrap()), SoftRdma::with_ports(&[far, near]).unwrap());
    on_seam("rdma_numa_nearest_nic", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig::default());
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    for _ in 0..8 {
        cli.write(&target, 0, &buf).unwrap();
        cli.read(&target, 0, &mut buf).unwrap();
    }
    let per_nic = rdma.nic_bytes();
    match node {
        Some(node) => {
            assert_eq!(per_nic, [0, 16 * (64 << 10)], "the buffer is on node {node}: only that node's NIC moves it")
        }
        None => {
            println!("the kernel does not tell the buffer's NUMA node: requests spread over every NIC");
            assert!(per_nic.iter().all(|&b| b > 0), "{per_nic:?}");
        }
    }
}

/// A region its engine registered read-only (an SSD tier's staging buffer) is
/// registered for remote READ only: a peer reads it, and its WRITE fails at the NIC
/// without touching a byte.
#[test]
fn rdma_reads_read_only_regions_and_their_writes_fail_at_the_nic() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(1).unwrap());
    on_seam("rdma_read_only_regions", &cli_nics);
    let srv = server(&srv_nics);
    let (cli, rdma) = client(&cli_nics, RdmaConfig { retries: 1, ..RdmaConfig::default() });
    let staging = srv.register_read_only_region(1 << 20).unwrap();
    let data = bytes(5, 1 << 20);
    staging.copy_in(0, &data).unwrap();
    let target = srv.remote(staging.id());
    let mut back = vec![0u8; 1 << 20];
    cli.read(&target, 0, &mut back).unwrap();
    assert!(back == data);
    assert!(!rdma.falls_back_to_tcp(&target.endpoint), "read over RDMA, not TCP");
    assert!(cli.write(&target, 0, &[0u8; 4096]).is_err(), "a peer's write is refused");
    let mut local = vec![0u8; 1 << 20];
    staging.copy_out(0, &mut local).unwrap();
    assert!(local == data, "a refused write changed memory");
    // The link comes back after its cooldown (the refused WRITE broke it, as a NIC
    // does): the region is still read.
    let until = Instant::now() + Duration::from_secs(10);
    back.fill(0);
    while let Err(e) = cli.read(&target, 0, &mut back) {
        assert!(Instant::now() < until, "never read again: {e}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(back == data);
}
