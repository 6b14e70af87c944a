//! `Protocol::Rdma` and the automatic choice, in process and across processes,
//! and device memory moved straight to and from segments over RDMA. Without an
//! RDMA device, the tests run on the software seam (software NICs over loopback;
//! `MOONCAKE_SOFT_RDMA` for the binaries; emulated device memory whose memfd the
//! software NICs import as a dma-buf) and say so: nothing here is an RDMA result.

mod support;

use std::process::Command;
use std::sync::Arc;

use mooncake_core::gpu::{DeviceMemory, HostDeviceMemory};
use mooncake_core::{Error, Protocol, ReplicateConfig, Store};
use mooncake_transfer::{rdma_device_present, SoftRdma, TransferEngine, TransferError};
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

/// Storage nodes in other processes serving RDMA on two software NICs each (a
/// node in this process would be reached by memory copy).
fn soft_rdma_cluster(nodes: usize) -> Cluster {
    Cluster::start_env(&[], nodes, &[("MOONCAKE_SOFT_RDMA", "2")])
}

/// A client of `cluster` whose transport is RDMA over `nics`; it gives `segment`
/// bytes to the pool (and then listens for peers).
fn rdma_client(cluster: &Cluster, nics: &Arc<SoftRdma>, segment: u64) -> Store {
    let b = Store::builder().master_address(&cluster.master_addr).protocol(Protocol::Rdma).rdma_provider(nics.clone());
    let b = if segment > 0 { b.listen("127.0.0.1:0") } else { b };
    b.global_segment_size(segment).build().unwrap()
}

fn device(len: u64) -> HostDeviceMemory {
    HostDeviceMemory::new(len).unwrap()
}

#[test]
fn device_memory_goes_straight_to_and_from_segments_over_soft_rdma() {
    println!("device memory over the soft RDMA seam (emulated GPU memory, not an RDMA result)");
    let cluster = soft_rdma_cluster(1);
    let nics = Arc::new(SoftRdma::new(2).unwrap());
    let client = rdma_client(&cluster, &nics, 0);
    let (src, dst) = (device(16 << 20), device(16 << 20));
    let mut total = 0u64;
    for (i, len) in [1usize, 65_537, 1 << 20, (5 << 20) + 3].into_iter().enumerate() {
        let data = payload(i as u8, len);
        let (src_off, dst_off) = (1000 * i as u64 + 7, (8 << 20) + 4096 * i as u64 + 1);
        src.copy_from_host(src_off, &data).unwrap();
        let key = format!("gpu/{len}");
        client.put_from_device(&key, &src, src_off, len as u64).unwrap();
        // What the segment holds is exactly the device bytes.
        assert!(client.get(&key).unwrap()[..] == data[..], "{len}: stored bytes");
        assert_eq!(client.get_into_device(&key, &dst, dst_off).unwrap(), len);
        let all = dst.to_vec();
        assert!(all[dst_off as usize..dst_off as usize + len] == data[..], "{len}: device bytes");
        assert!(all[..dst_off as usize].iter().all(|&b| b == 0), "{len}: bytes before the range");
        assert!(all[dst_off as usize + len..].iter().all(|&b| b == 0), "{len}: bytes after the range");
        dst.with_bytes_mut(|b| b.fill(0));
        total += len as u64;
    }
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 * total, 0), "every byte went straight");
    assert_eq!((s.puts, s.gets), (4, 8));
    // Each device allocation was registered once, on each of the two NICs.
    assert_eq!(nics.dmabuf_registrations(), 4);
    // The batch forms go straight too.
    let a = payload(7, 300_000);
    let b = payload(8, 200_001);
    src.copy_from_host(0, &a).unwrap();
    src.copy_from_host(1 << 20, &b).unwrap();
    let puts = client.batch_put_from_device(
        &[("batch/a", 0, a.len() as u64), ("batch/b", 1 << 20, b.len() as u64)],
        &src,
        &ReplicateConfig::default(),
    );
    assert!(puts.iter().all(|r| r.is_ok()), "{puts:?}");
    let gets = client.batch_get_into_device(&[("batch/b", 10), ("batch/a", 4 << 20), ("batch/none", 0)], &dst);
    assert_eq!(gets[0].as_ref().ok(), Some(&b.len()));
    assert_eq!(gets[1].as_ref().ok(), Some(&a.len()));
    assert!(matches!(gets[2], Err(Error::NotFound(_))), "{:?}", gets[2]);
    let all = dst.to_vec();
    assert!(all[10..10 + b.len()] == b[..] && all[4 << 20..(4 << 20) + a.len()] == a[..]);
    let batch = 2 * (a.len() + b.len()) as u64;
    assert_eq!(client.stats().device_direct_bytes, 2 * total + batch);
    assert_eq!(nics.dmabuf_registrations(), 4, "no registration after the first of each allocation");
}

#[test]
fn device_memory_and_a_replica_in_the_own_segment_moves_in_one_dma_per_call() {
    println!("device memory over the soft RDMA seam (emulated GPU memory, not an RDMA result)");
    let cluster = soft_rdma_cluster(1);
    let nics = Arc::new(SoftRdma::new(1).unwrap());
    // This client gives memory too: a replica there is in memory this process maps,
    // so it moves in one DMA from or into the (page-locked) segment, not by RDMA.
    let client = rdma_client(&cluster, &nics, 16 << 20);
    let own =
        ReplicateConfig { preferred_segments: vec![client.segment_name().unwrap().unwrap()], ..Default::default() };
    let src = device(1 << 20);
    let data = payload(3, 500_000);
    src.copy_from_host(0, &data).unwrap();
    client.put_from_device_with("mine", &src, 0, data.len() as u64, &own).unwrap();
    assert!(client.get("mine").unwrap()[..] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (data.len() as u64, 0));
    assert_eq!(nics.dmabuf_registrations(), 1, "registered for RDMA, but the replica did not need it");
    let dst = device(1 << 20);
    assert_eq!(client.get_into_device("mine", &dst, 0).unwrap(), data.len());
    assert!(dst.to_vec()[..data.len()] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 * data.len() as u64, 0));
    // The next call, to the node's segment, goes straight over RDMA.
    let node = ReplicateConfig { preferred_segments: node_segments(&client), ..Default::default() };
    client.put_from_device_with("theirs", &src, 0, data.len() as u64, &node).unwrap();
    assert_eq!(client.get_into_device("theirs", &dst, 100).unwrap(), data.len());
    assert!(dst.to_vec()[100..100 + data.len()] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (4 * data.len() as u64, 0));
}

/// The names of the segments that are not `client`'s.
fn node_segments(client: &Store) -> Vec<String> {
    let mine = client.segment_name().unwrap();
    let m = client.master();
    let ids: Vec<u64> = client.stats().master.segment_usage.iter().map(|u| u.segment).collect();
    ids.into_iter().map(|id| m.segment_info(id).unwrap().name).filter(|n| Some(n) != mine.as_ref()).collect()
}

/// Writes `bytes` as object `key` of `client` on the segments the master picks,
/// with the checksum of `claimed` (a replica's memory holding other bytes than
/// its checksum was taken of, as after memory reuse under a stale list); `bad`
/// replicas get `bytes`, the others `claimed`.
fn put_raw(client: &Store, key: &str, replicas: usize, bad: usize, bytes: &[u8], claimed: &[u8]) {
    let (m, me) = (client.master(), client.client_id());
    let cfg = ReplicateConfig { replica_num: replicas, ..Default::default() };
    let placed = m.put_start(me, key, bytes.len() as u64, &cfg).unwrap();
    assert_eq!(placed.len(), replicas);
    let writer = TransferEngine::builder().network().build().unwrap();
    for (i, r) in placed.iter().enumerate() {
        let route = m.segment_info(r.segment).unwrap().region;
        writer.write(&route, r.offset, if i < bad { bytes } else { claimed }).unwrap();
    }
    m.put_end(me, key, crc_of(claimed)).unwrap();
}

/// crc32c of `bytes` (the store's checksum), taken on emulated device memory.
fn crc_of(bytes: &[u8]) -> u32 {
    let mem = device(bytes.len() as u64);
    mem.copy_from_host(0, bytes).unwrap();
    mem.crc32c(0, bytes.len() as u64).unwrap()
}

#[test]
fn device_gets_over_soft_rdma_never_keep_bytes_that_fail_their_checksum() {
    println!("device memory over the soft RDMA seam (emulated GPU memory, not an RDMA result)");
    let cluster = soft_rdma_cluster(2);
    let nics = Arc::new(SoftRdma::new(1).unwrap());
    let client = rdma_client(&cluster, &nics, 0);
    let right = payload(1, 100_000);
    let mut wrong = right.clone();
    wrong[77_777] ^= 1;
    put_raw(&client, "bad", 1, 1, &wrong, &right);
    let dst = device(1 << 20);
    let err = client.get_into_device("bad", &dst, 0).unwrap_err();
    assert!(matches!(err, Error::Corrupted(_)), "{err}");
    let s = client.stats();
    assert!(s.checksum_mismatches >= 1, "{s:?}");
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes, s.gets, s.get_errors), (0, 0, 0, 1));
    // The same read of a good object goes straight.
    put_raw(&client, "good", 1, 0, &right, &right);
    assert_eq!(client.get_into_device("good", &dst, 4096).unwrap(), right.len());
    assert!(dst.to_vec()[4096..4096 + right.len()] == right[..]);
    assert_eq!(client.stats().device_direct_bytes, right.len() as u64);
    // A bad replica and a good one: the get ends with the good bytes.
    put_raw(&client, "mixed", 2, 1, &wrong, &right);
    dst.with_bytes_mut(|b| b.fill(0));
    assert_eq!(client.get_into_device("mixed", &dst, 0).unwrap(), right.len());
    assert!(dst.to_vec()[..right.len()] == right[..]);
    assert_eq!(client.stats().device_direct_bytes, 2 * right.len() as u64);
}

#[test]
fn refused_device_registration_falls_back_to_staging() {
    println!("device memory over the soft RDMA seam (emulated GPU memory, not an RDMA result)");
    let cluster = soft_rdma_cluster(1);
    let nics = Arc::new(SoftRdma::new(2).unwrap());
    let client = rdma_client(&cluster, &nics, 0);
    // The NICs cannot register GPU memory (no dma-buf support, no peer-to-peer path).
    nics.faults().refuse_dmabuf(true);
    let (src, dst) = (device(4 << 20), device(4 << 20));
    let data = payload(5, 1_234_567);
    src.copy_from_host(99, &data).unwrap();
    client.put_from_device("staged", &src, 99, data.len() as u64).unwrap();
    assert!(client.get("staged").unwrap()[..] == data[..]);
    assert_eq!(client.get_into_device("staged", &dst, 5).unwrap(), data.len());
    assert!(dst.to_vec()[5..5 + data.len()] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (0, 2 * data.len() as u64));
    assert_eq!(nics.dmabuf_registrations(), 0);
    // The staged host bytes still went over RDMA.
    assert!(nics.doorbells() > 0);
}

/// A scatter that starts where another memory of the same call starts, with the same
/// length, is not that memory: each is moved from its own bytes. (The registrations
/// of one call were once cached by address and length only: the scatter's put wrote
/// the other memory's bytes under the scatter's checksum, and the object read back
/// `Corrupted`.)
#[test]
fn a_scatter_is_never_taken_for_another_memory_at_its_address() {
    use mooncake_core::gpu::DeviceScatter;
    println!("device memory over the soft RDMA seam (emulated GPU memory, not an RDMA result)");
    let cluster = soft_rdma_cluster(1);
    let nics = Arc::new(SoftRdma::new(1).unwrap());
    let client = rdma_client(&cluster, &nics, 0);
    let len = 1u64 << 20;
    let x: Arc<dyn DeviceMemory> = Arc::new(device(len));
    let y: Arc<dyn DeviceMemory> = Arc::new(device(len));
    x.copy_from_host(0, &vec![0xAA; len as usize]).unwrap();
    y.copy_from_host(0, &vec![0xBB; len as usize]).unwrap();
    let scatter = DeviceScatter::new(vec![(x.clone(), 0, 4096), (y.clone(), 0, len - 4096)]).unwrap();
    assert_eq!((scatter.device_ptr(), scatter.len()), (x.device_ptr(), x.len()));
    let puts =
        client.batch_put_from_devices(&[("x", &*x, 0, len), ("s", &scatter, 0, len)], &ReplicateConfig::default());
    assert!(puts.iter().all(|r| r.is_ok()), "{puts:?}");
    let mut want = vec![0xAA; 4096];
    want.resize(len as usize, 0xBB);
    assert!(client.get("s").unwrap()[..] == want[..], "the scatter's own bytes");
    assert!(client.get("x").unwrap().iter().all(|&b| b == 0xAA));
}

/// A scatter of one range of a registered allocation (how the Python binding passes a
/// slice of a registered GPU buffer) goes straight over RDMA like the allocation.
#[test]
fn a_one_range_scatter_moves_straight_like_its_allocation() {
    use mooncake_core::gpu::DeviceScatter;
    println!("device memory over the soft RDMA seam (emulated GPU memory, not an RDMA result)");
    let cluster = soft_rdma_cluster(1);
    let nics = Arc::new(SoftRdma::new(1).unwrap());
    let client = rdma_client(&cluster, &nics, 0);
    let host = Arc::new(device(4 << 20));
    let x: Arc<dyn DeviceMemory> = host.clone();
    let data = payload(5, 1 << 20);
    x.copy_from_host(4096, &data).unwrap();
    let slice = DeviceScatter::new(vec![(x.clone(), 4096, 1 << 20)]).unwrap();
    client.put_from_device("slice", &slice, 0, 1 << 20).unwrap();
    assert!(client.get("slice").unwrap()[..] == data[..]);
    let back = DeviceScatter::new(vec![(x.clone(), (1 << 20) + 4096, 1 << 20)]).unwrap();
    assert_eq!(client.get_into_device("slice", &back, 0).unwrap(), 1 << 20);
    assert!(host.to_vec()[(1 << 20) + 4096..(2 << 20) + 4096] == data[..]);
    let s = client.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 << 20, 0), "both ways straight, no staging");
}
