//! `Protocol::Rdma` and the automatic choice, in process and across processes.
//! Without an RDMA device, the cross-process tests run on the software seam
//! (`MOONCAKE_SOFT_RDMA`: software NICs over loopback) and say so: nothing here is
//! an RDMA result.

mod support;

use std::process::Command;
use std::sync::Arc;

use mooncake_core::{Error, Protocol, Store};
use mooncake_transfer::{rdma_device_present, SoftRdma, TransferError};
use support::{bin, payload, unique_dir, Cluster};

#[test]
fn protocol_rdma_without_a_device_is_a_typed_error_and_auto_falls_back() {
    if rdma_device_present() {
        println!("skipped the no-device half: this host has an RDMA device");
    } else {
        let err = Store::builder().protocol(Protocol::Rdma).listen("127.0.0.1:0").build().unwrap_err();
        assert!(matches!(err, Error::Transport(TransferError::NoDevice(_))), "{err}");
    }
    let store = Store::builder().protocol(Protocol::Auto).listen("127.0.0.1:0").build().unwrap();
    store.put("k", &payload(1, 100_000)).unwrap();
    assert_eq!(store.get("k").unwrap(), payload(1, 100_000));
    assert_eq!("rdma".parse::<Protocol>(), Ok(Protocol::Rdma));
    assert!("infiniband".parse::<Protocol>().is_err());
}

#[test]
fn protocol_rdma_with_software_nics_builds_and_serves() {
    let soft = Arc::new(SoftRdma::new(2).unwrap());
    println!("ran on the soft RDMA seam (not an RDMA result)");
    let store = Store::builder()
        .protocol(Protocol::Rdma)
        .rdma_provider(soft)
        .listen("127.0.0.1:0")
        .global_segment_size(8 << 20)
        .build()
        .unwrap();
    store.put("k", &payload(2, 1 << 20)).unwrap();
    assert_eq!(store.get("k").unwrap(), payload(2, 1 << 20));
}

/// Runs `mooncake-client` with `args` and `env`; (exit code, stderr).
fn run_client(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(bin("mooncake-client")).args(args).envs(env.iter().copied()).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn clients_in_other_processes_put_and_get_over_soft_rdma_and_fall_back_to_tcp() {
    println!("nodes and clients on the soft RDMA seam (MOONCAKE_SOFT_RDMA, not an RDMA result)");
    let soft = [("MOONCAKE_SOFT_RDMA", "2"), ("RUST_LOG", "mooncake_transfer=info")];
    let c = Cluster::start_env(&[], 1, &soft[..1]);
    let dir = unique_dir("rdma");
    let data = payload(3, 5 << 20);
    let src = dir.join("in");
    std::fs::write(&src, &data).unwrap();
    let (code, err) =
        run_client(&["--protocol", "rdma", "put", "--master", &c.master_addr, "kv/1", src.to_str().unwrap()], &soft);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("RDMA link up") && err.contains("soft"), "the put went over soft RDMA: {err}");
    assert!(!err.contains("TCP serves"), "{err}");
    let out = dir.join("out");
    let (code, err) =
        run_client(&["--protocol", "rdma", "get", "--master", &c.master_addr, "kv/1", out.to_str().unwrap()], &soft);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("RDMA link up"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), data);
    // Without any device (no software NICs either), `--protocol rdma` is refused.
    if !rdma_device_present() {
        let (code, err) =
            run_client(&["--protocol", "rdma", "get", "--master", &c.master_addr, "kv/1", out.to_str().unwrap()], &[]);
        assert_eq!(code, 1);
        assert!(err.contains("no device"), "{err}");
    }
    // A node without RDMA: the client's automatic choice reaches it over TCP.
    let plain = Cluster::start(&[], 1);
    let (code, err) = run_client(
        &["--protocol", "rdma", "put", "--master", &plain.master_addr, "kv/2", src.to_str().unwrap()],
        &soft,
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("TCP serves"), "the node offers no RDMA: {err}");
    let (code, err) = run_client(
        &["--protocol", "auto", "get", "--master", &plain.master_addr, "kv/2", out.to_str().unwrap()],
        &soft,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), data);
}
