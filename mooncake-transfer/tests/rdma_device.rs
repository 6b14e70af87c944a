//! The `Rdma` transport on a real RDMA device (libibverbs, `rdma` feature). Runs
//! when `/sys/class/infiniband` lists a device; prints that it was skipped
//! otherwise (CI machines have none). These are the only RDMA results.

use mooncake_transfer::rdma_device_present;

#[cfg(feature = "rdma")]
#[test]
fn a_real_device_moves_exact_bytes_between_two_engines() {
    use std::sync::Arc;

    use mooncake_transfer::{RdmaConfig, RdmaProvider, RdmaTransport, TransferEngine, TransferError, VerbsRdma};

    if !rdma_device_present() {
        println!("skipped: no device in /sys/class/infiniband (no RDMA result)");
        assert!(matches!(VerbsRdma::open(), Err(TransferError::NoDevice(_))), "no device is a typed error");
        return;
    }
    let verbs = Arc::new(VerbsRdma::open().expect("a device is listed in /sys/class/infiniband"));
    println!("running on the {} implementation: ports {:?}", verbs.implementation(), verbs.ports());
    let srv =
        TransferEngine::builder().tcp_listen("127.0.0.1:0").rdma(verbs.clone(), RdmaConfig::default()).build().unwrap();
    let rdma = Arc::new(RdmaTransport::new(verbs.as_ref(), RdmaConfig::default()).unwrap());
    let cli = TransferEngine::builder().transport(rdma.clone()).build().unwrap();
    let seg = srv.register_region(64 << 20).unwrap();
    let target = srv.remote(seg.id());
    for len in [1usize, 4096, 1 << 20, 32 << 20] {
        let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        cli.write(&target, 3, &data).unwrap();
        let mut back = vec![0u8; len];
        cli.read(&target, 3, &mut back).unwrap();
        assert!(back == data, "{len} bytes");
    }
    assert!(!rdma.falls_back_to_tcp(&target.endpoint), "the device carried the bytes");
    let mut buf = [0u8; 8];
    assert!(matches!(cli.read(&target, (64 << 20) - 4, &mut buf), Err(TransferError::OutOfBounds { .. })));
    println!("path MTU {:?}, bytes per NIC {:?}", rdma.path_mtu(&target.endpoint), rdma.nic_bytes());
}

#[cfg(not(feature = "rdma"))]
#[test]
fn a_real_device_moves_exact_bytes_between_two_engines() {
    println!("skipped: built without the `rdma` feature (device present: {}); no RDMA result", rdma_device_present());
}
