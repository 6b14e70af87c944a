//! Device memory as the local side of the `Rdma` transport, on the software seam:
//! a memfd stands for a GPU driver's dma-buf, the soft NICs import it by mapping
//! it, and work requests name its bytes by a device address (an iova that is no
//! host address of this process, so a transport that dereferenced it would crash).
//! Every test prints which implementation ran; nothing here is an RDMA result.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use mooncake_transfer::{
    DeviceTransfer, DmaBuf, RdmaConfig, RdmaProvider, RdmaTransport, RemoteRegion, SoftPortConfig, SoftRdma,
    TransferEngine, TransferError, WorkOp,
};

fn on_seam(test: &str, provider: &dyn RdmaProvider) {
    println!("{test}: ran on the {} RDMA seam (software NICs, not an RDMA result)", provider.implementation());
}

fn server(soft: &Arc<SoftRdma>) -> TransferEngine {
    TransferEngine::builder().tcp_listen("127.0.0.1:0").rdma(soft.clone(), RdmaConfig::default()).build().unwrap()
}

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i % 251) as u8) ^ (i >> 12) as u8).collect()
}

/// "Device memory": a memfd, which the test reads and writes through a mapping
/// of its own, addressed by the transport from a made-up device address.
struct FakeDevice {
    file: File,
    map: memmap2::MmapMut,
    iova: u64,
}

impl FakeDevice {
    fn new(len: usize, iova: u64) -> Self {
        // SAFETY: a NUL-terminated name; no other requirement.
        let fd = unsafe { libc::memfd_create(c"fake-gpu".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor owned by nobody else.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len as u64).unwrap();
        // SAFETY: the memfd is private to the test (and the NICs it is exported to).
        let map = unsafe { memmap2::MmapMut::map_mut(&file) }.unwrap();
        Self { file, map, iova }
    }

    fn len(&self) -> u64 {
        self.map.len() as u64
    }

    fn export(&self) -> mooncake_transfer::Result<DmaBuf> {
        Ok(DmaBuf { fd: self.file.try_clone().unwrap().into(), offset: 0, len: self.len(), iova: self.iova })
    }
}

/// One request between `target` at `offset` and `len` bytes at `at` of the device.
fn request<'a>(
    op: WorkOp,
    target: &'a RemoteRegion,
    offset: u64,
    local: &'a mooncake_transfer::DeviceRegion,
    at: u64,
    len: u64,
) -> DeviceTransfer<'a> {
    DeviceTransfer { target, offset, op, local, local_addr: local.iova() + at, len }
}

/// Runs `reqs`; the device memory they name is the test's and idle meanwhile.
fn run(rdma: &RdmaTransport, reqs: &[DeviceTransfer<'_>]) -> Vec<mooncake_transfer::Result<()>> {
    // SAFETY: every device region is a live FakeDevice of the caller, whose
    // mapping the test does not touch until the call returns.
    unsafe { rdma.transfer_device(reqs) }
}

#[test]
fn device_memory_moves_by_device_address_straight_through_the_nics() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(2).unwrap()), SoftRdma::new(2).unwrap());
    on_seam("device_memory_moves_by_device_address", &cli_nics);
    let srv = server(&srv_nics);
    let rdma = RdmaTransport::new(&cli_nics, RdmaConfig::default()).unwrap();
    let seg = srv.register_region(32 << 20).unwrap();
    let target = srv.remote(seg.id());
    let mut dev = FakeDevice::new(24 << 20, 0x7e57_0000_0000);
    let region = rdma.register_device(1, dev.iova, dev.len(), || dev.export()).unwrap();
    assert_eq!((region.iova(), region.len()), (dev.iova, 24 << 20));
    for (i, len) in [1usize, 4097, 1 << 20, 8 << 20].into_iter().enumerate() {
        let data = bytes(i as u8, len);
        let (at, remote) = (4096 * i as u64 + 5, 100 + 3 * i as u64);
        dev.map[at as usize..at as usize + len].copy_from_slice(&data);
        // WRITE from device memory into the peer's region.
        let r = run(&rdma, &[request(WorkOp::Write, &target, remote, &region, at, len as u64)]);
        assert!(r[0].is_ok(), "{len}: {r:?}");
        let mut held = vec![0u8; len];
        seg.copy_out(remote, &mut held).unwrap();
        assert!(held == data, "{len}: the peer holds the device bytes");
        // READ them back into another place of device memory.
        let back = (12 << 20) + 7 * i as u64;
        let r = run(&rdma, &[request(WorkOp::Read, &target, remote, &region, back, len as u64)]);
        assert!(r[0].is_ok(), "{len}: {r:?}");
        assert!(dev.map[back as usize..back as usize + len] == data[..], "{len}: device memory holds the bytes");
    }
    let per_nic = rdma.nic_bytes();
    assert!(per_nic.iter().all(|&b| b >= 8 << 20), "8 MiB requests are striped over both NICs: {per_nic:?}");
    assert!(!rdma.falls_back_to_tcp(&target.endpoint));
    // Several requests in one call, in order of the results.
    let a = bytes(40, 5000);
    seg.copy_in(0, &a).unwrap();
    let reqs = [
        request(WorkOp::Read, &target, 0, &region, 0, 5000),
        request(WorkOp::Read, &target, 0, &region, 9000, 5000),
        request(WorkOp::Read, &target, (32 << 20) - 10, &region, 0, 11),
    ];
    let r = run(&rdma, &reqs);
    assert!(r[0].is_ok() && r[1].is_ok(), "{r:?}");
    assert!(matches!(r[2], Err(TransferError::OutOfBounds { .. })), "{r:?}");
    assert!(dev.map[..5000] == a[..] && dev.map[9000..14_000] == a[..]);
}

#[test]
fn device_registrations_are_cached_per_allocation_and_range() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(2).unwrap());
    on_seam("device_registrations_are_cached", &cli_nics);
    let srv = server(&srv_nics);
    let rdma = RdmaTransport::new(&cli_nics, RdmaConfig::default()).unwrap();
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    let dev = FakeDevice::new(1 << 20, 0x5000_0000_0000);
    let exports = AtomicUsize::new(0);
    let export = || {
        exports.fetch_add(1, Ordering::Relaxed);
        dev.export()
    };
    let first = rdma.register_device(7, dev.iova, dev.len(), export).unwrap();
    assert_eq!(cli_nics.dmabuf_registrations(), 2, "one memory region per NIC");
    for i in 0..10u64 {
        let again = rdma.register_device(7, dev.iova, dev.len(), export).unwrap();
        assert_eq!(again.iova(), first.iova());
        assert!(run(&rdma, &[request(WorkOp::Read, &target, i * 100, &again, i * 4096, 4096)])[0].is_ok());
    }
    assert_eq!(exports.load(Ordering::Relaxed), 1, "a cached allocation is not exported again");
    assert_eq!(cli_nics.dmabuf_registrations(), 2, "nor registered again");
    // Another allocation at the same address (the old one freed): a new id, a
    // new registration, never the old one's.
    rdma.register_device(8, dev.iova, dev.len(), export).unwrap();
    assert_eq!((exports.load(Ordering::Relaxed), cli_nics.dmabuf_registrations()), (2, 4));
    // Another range of one allocation (a borrowed view of it) is its own entry.
    rdma.register_device(8, dev.iova + 4096, 8192, export).unwrap();
    assert_eq!(exports.load(Ordering::Relaxed), 3);
    rdma.forget_registrations();
    rdma.register_device(7, dev.iova, dev.len(), export).unwrap();
    assert_eq!(exports.load(Ordering::Relaxed), 4, "a forgotten registration is made again");
    // An export that does not cover the range asked for is refused.
    let short = rdma.register_device(9, dev.iova, dev.len() + 1, || dev.export());
    assert!(matches!(short, Err(TransferError::Registration(_))), "{short:?}");
}

#[test]
fn device_regions_above_max_mr_size_are_split() {
    let small = SoftPortConfig { max_mr_size: 64 << 10, ..SoftPortConfig::default() };
    let srv_nics = Arc::new(SoftRdma::with_ports(&[small]).unwrap());
    let cli_nics = SoftRdma::with_ports(&[small, small]).unwrap();
    on_seam("device_regions_are_split", &cli_nics);
    let srv = server(&srv_nics);
    let rdma = RdmaTransport::new(&cli_nics, RdmaConfig::default()).unwrap();
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    let mut dev = FakeDevice::new(1 << 20, 0x4000_0000_0000);
    let region = rdma.register_device(1, dev.iova, dev.len(), || dev.export()).unwrap();
    assert_eq!(cli_nics.dmabuf_registrations(), 2 * 16, "1 MiB in 64 KiB pieces on two NICs");
    // Crosses many pieces on both sides, at odd offsets.
    let data = bytes(9, 700_001);
    dev.map[12_345..12_345 + data.len()].copy_from_slice(&data);
    assert!(run(&rdma, &[request(WorkOp::Write, &target, 777, &region, 12_345, data.len() as u64)])[0].is_ok());
    let mut held = vec![0u8; data.len()];
    seg.copy_out(777, &mut held).unwrap();
    assert!(held == data);
    dev.map.fill(0);
    assert!(run(&rdma, &[request(WorkOp::Read, &target, 777, &region, 99, data.len() as u64)])[0].is_ok());
    assert!(dev.map[99..99 + data.len()] == data[..]);
}

#[test]
fn refused_dmabuf_registration_is_a_typed_error_and_remembered() {
    let cli_nics = SoftRdma::new(2).unwrap();
    on_seam("refused_dmabuf_registration", &cli_nics);
    let rdma = RdmaTransport::new(&cli_nics, RdmaConfig::default()).unwrap();
    let dev = FakeDevice::new(64 << 10, 0x1000_0000_0000);
    let exports = AtomicUsize::new(0);
    let export = || {
        exports.fetch_add(1, Ordering::Relaxed);
        dev.export()
    };
    cli_nics.faults().refuse_dmabuf(true);
    for _ in 0..3 {
        let r = rdma.register_device(1, dev.iova, dev.len(), export);
        assert!(matches!(r, Err(TransferError::Registration(_))), "{r:?}");
    }
    assert_eq!(exports.load(Ordering::Relaxed), 1, "a refusal is remembered, not tried on every call");
    assert_eq!(cli_nics.dmabuf_registrations(), 0);
    // A failed export (memory the driver cannot export) is a refusal too.
    let r = rdma.register_device(2, dev.iova, dev.len(), || Err(TransferError::Registration("no dma-buf".into())));
    assert!(matches!(r, Err(TransferError::Registration(_))));
    cli_nics.faults().refuse_dmabuf(false);
    rdma.forget_registrations();
    assert!(rdma.register_device(1, dev.iova, dev.len(), export).is_ok());
    assert_eq!(cli_nics.dmabuf_registrations(), 2);
}

#[test]
fn device_ranges_outside_their_registration_are_refused_and_move_nothing() {
    let (srv_nics, cli_nics) = (Arc::new(SoftRdma::new(1).unwrap()), SoftRdma::new(1).unwrap());
    on_seam("device_ranges_outside_their_registration", &cli_nics);
    let srv = server(&srv_nics);
    let rdma = RdmaTransport::new(&cli_nics, RdmaConfig::default()).unwrap();
    let seg = srv.register_region(1 << 20).unwrap();
    seg.copy_in(0, &[9u8; 1 << 20]).unwrap();
    let target = srv.remote(seg.id());
    let dev = FakeDevice::new(64 << 10, 0x2000_0000_0000);
    let region = rdma.register_device(1, dev.iova, dev.len(), || dev.export()).unwrap();
    let past = request(WorkOp::Write, &target, 0, &region, (64 << 10) - 4, 5);
    let before = DeviceTransfer { local_addr: dev.iova - 1, ..past };
    let wrapping = DeviceTransfer { local_addr: u64::MAX - 2, len: 8, ..past };
    for r in run(&rdma, &[past, before, wrapping]) {
        assert!(matches!(r, Err(TransferError::Registration(_))), "{r:?}");
    }
    let mut held = vec![0u8; 1 << 20];
    seg.copy_out(0, &mut held).unwrap();
    assert!(held.iter().all(|&b| b == 9), "a refused request wrote to the peer");
    assert!(rdma.stats().errors.load(Ordering::Relaxed) >= 3);
}

#[test]
fn device_memory_to_a_peer_without_rdma_is_unreachable_not_tcp() {
    let cli_nics = SoftRdma::new(1).unwrap();
    on_seam("device_memory_to_a_peer_without_rdma", &cli_nics);
    let srv = TransferEngine::builder().tcp_listen("127.0.0.1:0").build().unwrap();
    let rdma = RdmaTransport::new(&cli_nics, RdmaConfig::default()).unwrap();
    let seg = srv.register_region(1 << 20).unwrap();
    let target = srv.remote(seg.id());
    let dev = FakeDevice::new(64 << 10, 0x3000_0000_0000);
    let region = rdma.register_device(1, dev.iova, dev.len(), || dev.export()).unwrap();
    let r = run(&rdma, &[request(WorkOp::Read, &target, 0, &region, 0, 4096)]);
    assert!(matches!(r[0], Err(TransferError::Unreachable(_))), "{r:?}");
    assert!(rdma.falls_back_to_tcp(&target.endpoint), "the caller can tell: stage over TCP");
}
