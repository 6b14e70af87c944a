//! Device memory as a copy target: staged (chunked, double-buffered) copies,
//! the pinned pool, and `GpuTransport` through the transfer engine. Runs over
//! the host emulation everywhere; the CUDA variants run when a GPU is present
//! and print a skip note otherwise.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_gpu::{
    allocate_or_emulate, cuda_available, DeviceBuffer, DeviceMemory, DeviceScatter, GpuError, GpuTransport,
    HostDeviceMemory, MemoryLocation, PinnedBuffer, PinnedPool, Stager, DEFAULT_CHUNK,
};
use mooncake_transfer::{LocalTransport, TransferEngine, TransferError, TransferRequest, Transport};
use proptest::prelude::*;

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Sizes around chunk boundaries for a chunk of `c` bytes.
fn boundary_sizes(c: usize) -> Vec<usize> {
    vec![1, c - 1, c, c + 1, 2 * c, 2 * c + 1, 3 * c + 7]
}

#[test]
fn staged_round_trips_at_chunk_boundaries() {
    let chunk = 4096;
    let mem = HostDeviceMemory::new(64 << 10).unwrap();
    for lanes in [1, 2, 3] {
        let mut st = Stager::new(&mem, chunk, lanes).unwrap();
        assert_eq!((st.chunk_size(), st.lanes(), st.is_page_locked()), (chunk, lanes, false));
        for (i, len) in boundary_sizes(chunk).into_iter().enumerate() {
            for offset in [0u64, 1, 4095, 4096, (64 << 10) - len as u64] {
                let data = pattern((lanes * 100 + i) as u64 + offset, len);
                st.upload(&mem, &data, offset).unwrap();
                // The bytes are in "device" memory, at the right place.
                assert_eq!(&mem.to_vec()[offset as usize..offset as usize + len], &data[..], "len {len} off {offset}");
                let mut back = vec![0u8; len];
                st.download(&mem, &mut back, offset).unwrap();
                assert_eq!(back, data, "lanes {lanes} len {len} off {offset}");
            }
        }
    }
}

#[test]
fn kv_sizes_round_trip_with_the_default_chunk() {
    // 64 KiB .. 8 MiB objects; 8 MiB spans two default chunks.
    let mem = HostDeviceMemory::new(16 << 20).unwrap();
    let mut st = Stager::new(&mem, DEFAULT_CHUNK, 2).unwrap();
    for (i, len) in [64usize << 10, 256 << 10, 1 << 20, (4 << 20) + 3, 8 << 20].into_iter().enumerate() {
        let data = pattern(i as u64, len);
        let off = (i as u64) * 1000;
        st.upload(&mem, &data, off).unwrap();
        let mut back = vec![0u8; len];
        st.download(&mem, &mut back, off).unwrap();
        assert!(back == data, "{len} bytes differ");
    }
}

#[test]
fn provided_copies_of_device_memory() {
    let mem = HostDeviceMemory::new(10_000).unwrap();
    let data = pattern(9, 7_000);
    mem.copy_from_host(3_000, &data).unwrap();
    let mut back = vec![0u8; 7_000];
    mem.copy_to_host(3_000, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(mem.to_vec()[..3_000], vec![0u8; 3_000][..]);
    assert!(matches!(mem.copy_from_host(3_001, &data), Err(GpuError::OutOfBounds(_))));
    assert!(matches!(mem.copy_to_host(3_001, &mut back), Err(GpuError::OutOfBounds(_))));
    // Empty copies at the very end are fine; past it they are not.
    mem.copy_from_host(10_000, &[]).unwrap();
    assert!(matches!(mem.copy_from_host(10_001, &[]), Err(GpuError::OutOfBounds(_))));
}

#[test]
fn out_of_bounds_copies_are_refused_and_touch_nothing() {
    let mem = HostDeviceMemory::new(8192).unwrap();
    let mut st = Stager::new(&mem, 1000, 2).unwrap();
    let data = pattern(1, 3000);
    for off in [5193u64, 8192, 9000, u64::MAX - 10, u64::MAX] {
        assert!(matches!(st.upload(&mem, &data, off), Err(GpuError::OutOfBounds(_))), "offset {off}");
        let mut back = vec![7u8; 3000];
        assert!(matches!(st.download(&mem, &mut back, off), Err(GpuError::OutOfBounds(_))));
        assert!(back.iter().all(|&b| b == 7), "nothing written into the host buffer");
    }
    assert!(mem.to_vec().iter().all(|&b| b == 0), "nothing written into device memory");
    // The last in-bounds position works.
    st.upload(&mem, &data, 5192).unwrap();
    assert_eq!(&mem.to_vec()[5192..], &data[..]);
}

#[test]
fn bad_arguments_are_errors() {
    let mem = HostDeviceMemory::new(16).unwrap();
    assert!(matches!(Stager::new(&mem, 0, 2), Err(GpuError::InvalidArgument(_))));
    assert!(matches!(Stager::new(&mem, 16, 0), Err(GpuError::InvalidArgument(_))));
    assert!(matches!(HostDeviceMemory::new(0), Err(GpuError::InvalidArgument(_))));
    assert!(matches!(GpuTransport::with_staging(0, 2), Err(GpuError::InvalidArgument(_))));
}

/// The emulation defers copies until a wait, so a staging buffer reused
/// before its copy completed shows up as wrong bytes: the double-buffering
/// tests above would catch a stager that skipped its waits.
#[test]
fn emulation_exposes_a_staging_buffer_reused_before_its_copy_completed() {
    let mem = HostDeviceMemory::new(8).unwrap();
    let mut buf = PinnedBuffer::unpinned(4).unwrap();
    let mut s = mem.open_stream().unwrap();
    buf.copy_from_slice(&[1, 1, 1, 1]);
    // SAFETY: deliberately breaking the contract's *ordering* (not memory
    // safety): `buf` outlives the stream and is rewritten before the wait to
    // show what a missing wait does.
    unsafe { s.copy_to_device_async(buf.as_ptr(), 4, 0).unwrap() };
    buf.copy_from_slice(&[2, 2, 2, 2]); // no wait: wrong
                                        // SAFETY: as above.
    unsafe { s.copy_to_device_async(buf.as_ptr(), 4, 4).unwrap() };
    s.synchronize().unwrap();
    drop(s);
    assert_eq!(mem.to_vec(), vec![2; 8], "the first chunk was overwritten before it was copied");
}

#[test]
fn pinned_pool_reuses_buffers_across_takes() {
    let mem = HostDeviceMemory::new(1).unwrap();
    let pool = PinnedPool::new(64 << 20);
    let first = {
        let mut b = pool.take(&mem, 5 << 20).unwrap();
        assert!(b.len() >= 5 << 20);
        b[0] = 42;
        b.as_ptr()
    };
    for _ in 0..10 {
        let b = pool.take(&mem, 5 << 20).unwrap();
        assert_eq!(b.as_ptr(), first, "a 5 MiB request reuses the idle buffer");
    }
    assert_eq!(pool.idle_bytes(), 8 << 20);
}

#[test]
fn no_gpu_paths_return_typed_errors_and_fall_back_to_emulation() {
    if cuda_available() {
        eprintln!("note: a GPU is present; the no-GPU path is not exercised here");
        return;
    }
    let r = std::panic::catch_unwind(|| DeviceBuffer::new(0, 1 << 20));
    match r {
        Ok(Err(GpuError::NoGpu(msg))) => assert!(msg.contains("libcuda") || msg.contains("device"), "{msg}"),
        Ok(other) => panic!("expected NoGpu, got {other:?}"),
        Err(_) => panic!("DeviceBuffer::new panicked without a GPU"),
    }
    // SAFETY: never dereferenced: the call fails before using the pointer.
    let borrowed = unsafe { DeviceBuffer::from_raw(0, 0x1000, 64) };
    assert!(matches!(borrowed, Err(GpuError::NoGpu(_))));
    let (mem, why) = allocate_or_emulate(0, 1 << 20).unwrap();
    assert_eq!(mem.location(), MemoryLocation::Emulated);
    assert!(matches!(why, Some(GpuError::NoGpu(_))));
    assert_eq!(mem.len(), 1 << 20);
    mem.copy_from_host(0, b"still works").unwrap();
}

// --- GpuTransport through the transfer engine -------------------------------

#[test]
fn gpu_transport_plugs_into_the_engine_builder() {
    let gpu = Arc::new(GpuTransport::with_staging(4096, 2).unwrap());
    let mem = Arc::new(HostDeviceMemory::new(1 << 20).unwrap());
    let region = gpu.register(mem.clone()).unwrap();
    assert!(region.endpoint.starts_with("gpu:emulated@"), "{}", region.endpoint);
    assert_eq!(region.endpoint, gpu.endpoint(MemoryLocation::Emulated));

    let engine = TransferEngine::builder().transport(gpu.clone()).build().unwrap();
    assert_eq!(engine.transport_names(), ["gpu"]);
    assert_eq!(engine.transport_name(&region.endpoint), Some("gpu"));
    for (i, len) in boundary_sizes(4096).into_iter().chain([1 << 20]).enumerate() {
        let data = pattern(i as u64, len);
        engine.write(&region, 0, &data).unwrap();
        assert_eq!(&mem.to_vec()[..len], &data[..]);
        let mut back = vec![0u8; len];
        engine.read(&region, 0, &mut back).unwrap();
        assert_eq!(back, data);
    }
    let s = engine.stats();
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].transport, "gpu");
    assert!(s[0].bytes_written > 1 << 20 && s[0].bytes_written == s[0].bytes_read);
}

#[test]
fn gpu_transport_refuses_out_of_bounds_and_unknown_regions() {
    let gpu = Arc::new(GpuTransport::new());
    let mem = Arc::new(HostDeviceMemory::new(4096).unwrap());
    let region = gpu.register(mem.clone()).unwrap();
    let engine = TransferEngine::builder().transport(gpu.clone()).build().unwrap();
    let mut buf = [9u8; 100];
    match engine.write(&region, 4000, &buf) {
        Err(TransferError::OutOfBounds { region: r, offset: 4000, len: 100, region_len: 4096 }) => {
            assert_eq!(r, region.region)
        }
        other => panic!("expected OutOfBounds, got {other:?}"),
    }
    assert!(matches!(engine.read(&region, u64::MAX, &mut buf), Err(TransferError::OutOfBounds { .. })));
    assert!(mem.to_vec().iter().all(|&b| b == 0));
    assert_eq!(buf, [9u8; 100]);
    assert_eq!(engine.stats()[0].errors, 2);

    let mut stale = region.clone();
    stale.region += 1;
    assert!(matches!(engine.read(&stale, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    assert!(gpu.unregister(&region));
    assert!(!gpu.unregister(&region));
    assert!(matches!(engine.read(&region, 0, &mut buf), Err(TransferError::UnknownRegion { .. })));
    // Another instance's endpoints are not this one's.
    let other = GpuTransport::new();
    assert_ne!(other.endpoint(MemoryLocation::Emulated), gpu.endpoint(MemoryLocation::Emulated));
    assert!(!other.can_reach(&region.endpoint));
    assert!(!gpu.can_reach("local://1/1"));
    assert!(matches!(gpu.register(Arc::new(EmptyMem)), Err(GpuError::InvalidArgument(_))));
}

#[test]
fn mixed_batches_reach_host_and_device_regions() {
    let gpu = Arc::new(GpuTransport::with_staging(1000, 2).unwrap());
    let dev = Arc::new(HostDeviceMemory::new(1 << 16).unwrap());
    let gpu_region = gpu.register(dev.clone()).unwrap();
    // `transport_first` keeps the default (Local) transport after it.
    let engine = TransferEngine::builder().transport_first(gpu.clone()).build().unwrap();
    assert_eq!(engine.transport_names(), ["gpu", "local"]);
    let host = engine.register_region(1 << 16).unwrap();
    let host_region = engine.remote(host.id());
    let (a, b) = (pattern(1, 5000), pattern(2, 3333));
    let mut reqs = [
        TransferRequest::write(&gpu_region, 100, &a),
        TransferRequest::write(&host_region, 200, &b),
        TransferRequest::write(&gpu_region, 60_000, &b),
    ];
    assert!(engine.transfer(&mut reqs).iter().all(|r| r.is_ok()));
    let mut ga = vec![0u8; 5000];
    let mut hb = vec![0u8; 3333];
    let mut gb = vec![0u8; 3333];
    let mut bad = vec![0u8; 10];
    let mut reqs = [
        TransferRequest::read(&gpu_region, 100, &mut ga),
        TransferRequest::read(&host_region, 200, &mut hb),
        TransferRequest::read(&gpu_region, 60_000, &mut gb),
        TransferRequest::read(&gpu_region, (1 << 16) - 5, &mut bad),
    ];
    let res = engine.transfer(&mut reqs);
    assert!(res[..3].iter().all(|r| r.is_ok()), "{res:?}");
    assert!(matches!(res[3], Err(TransferError::OutOfBounds { .. })));
    assert_eq!((ga, hb, gb), (a, b.clone(), b));
}

#[test]
fn concurrent_transfers_to_disjoint_ranges() {
    let gpu = Arc::new(GpuTransport::with_staging(8192, 2).unwrap());
    let mem = Arc::new(HostDeviceMemory::new(8 << 20).unwrap());
    let region = gpu.register(mem.clone()).unwrap();
    let engine = Arc::new(TransferEngine::builder().transport(gpu.clone()).build().unwrap());
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let (engine, region) = (engine.clone(), region.clone());
            std::thread::spawn(move || {
                for round in 0..4u64 {
                    let data = pattern(t * 10 + round, 1 << 20);
                    engine.write(&region, t << 20, &data).unwrap();
                    let mut back = vec![0u8; 1 << 20];
                    engine.read(&region, t << 20, &mut back).unwrap();
                    assert!(back == data, "thread {t} round {round}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let all = mem.to_vec();
    for t in 0..8u64 {
        assert!(all[(t << 20) as usize..((t + 1) << 20) as usize] == pattern(t * 10 + 3, 1 << 20)[..]);
    }
}

/// A user-defined transport wrapping the GPU one (counts device bytes).
struct Counting {
    inner: Arc<GpuTransport>,
    bytes: AtomicU64,
}

impl Transport for Counting {
    fn name(&self) -> &str {
        "counting-gpu"
    }
    fn can_reach(&self, endpoint: &str) -> bool {
        self.inner.can_reach(endpoint)
    }
    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<mooncake_transfer::Result<()>> {
        let n: usize = requests.iter().map(|r| r.op.len()).sum();
        self.bytes.fetch_add(n as u64, Ordering::Relaxed);
        self.inner.transfer(requests)
    }
}

#[test]
fn user_transport_wrapping_the_gpu_transport() {
    let inner = Arc::new(GpuTransport::new());
    let region = inner.register(Arc::new(HostDeviceMemory::new(4096).unwrap())).unwrap();
    let counting = Arc::new(Counting { inner, bytes: AtomicU64::new(0) });
    let engine =
        TransferEngine::builder().transport(counting.clone()).transport(Arc::new(LocalTransport)).build().unwrap();
    engine.write(&region, 0, &[5u8; 1000]).unwrap();
    let mut back = [0u8; 1000];
    engine.read(&region, 0, &mut back).unwrap();
    assert_eq!(back, [5u8; 1000]);
    assert_eq!(counting.bytes.load(Ordering::Relaxed), 2000);
    assert_eq!(engine.transport_name(&region.endpoint), Some("counting-gpu"));
}

#[derive(Debug)]
struct EmptyMem;

impl DeviceMemory for EmptyMem {
    fn len(&self) -> u64 {
        0
    }
    fn location(&self) -> MemoryLocation {
        MemoryLocation::Emulated
    }
    fn device_ptr(&self) -> u64 {
        0
    }
    fn alloc_pinned(&self, len: usize) -> mooncake_gpu::Result<PinnedBuffer> {
        PinnedBuffer::unpinned(len)
    }
    fn open_stream(&self) -> mooncake_gpu::Result<Box<dyn mooncake_gpu::DeviceStream + '_>> {
        Err(GpuError::InvalidArgument("empty".into()))
    }
}

// --- Property test: staged copies against a Vec model ----------------------

#[derive(Debug, Clone)]
enum Op {
    Upload { offset: u64, data: Vec<u8> },
    Download { offset: u64, len: usize },
}

fn op(cap: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..cap + 64, prop::collection::vec(any::<u8>(), 0..3000))
            .prop_map(|(offset, data)| Op::Upload { offset, data }),
        (0..cap + 64, 0usize..3000).prop_map(|(offset, len)| Op::Download { offset, len }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn staged_copies_match_a_vec_model(
        chunk in 1usize..700,
        lanes in 1usize..4,
        cap in 1u64..6000,
        ops in prop::collection::vec(op(6000), 1..24),
    ) {
        let mem = HostDeviceMemory::new(cap).unwrap();
        let mut model = vec![0u8; cap as usize];
        let mut st = Stager::new(&mem, chunk, lanes).unwrap();
        for op in ops {
            match op {
                Op::Upload { offset, data } => {
                    let fits = offset + data.len() as u64 <= cap;
                    let r = st.upload(&mem, &data, offset);
                    prop_assert_eq!(r.is_ok(), fits, "upload {}+{} into {}", offset, data.len(), cap);
                    if fits {
                        model[offset as usize..offset as usize + data.len()].copy_from_slice(&data);
                    } else {
                        prop_assert!(matches!(r, Err(GpuError::OutOfBounds(_))));
                    }
                }
                Op::Download { offset, len } => {
                    let fits = offset + len as u64 <= cap;
                    let mut out = vec![0xA5u8; len];
                    let r = st.download(&mem, &mut out, offset);
                    prop_assert_eq!(r.is_ok(), fits);
                    if fits {
                        prop_assert_eq!(&out[..], &model[offset as usize..offset as usize + len]);
                    } else {
                        prop_assert!(out.iter().all(|&b| b == 0xA5));
                    }
                }
            }
            prop_assert_eq!(mem.to_vec(), model.clone());
        }
    }
}

// --- On a GPU ---------------------------------------------------------------

fn gpu_buffer(bytes: usize) -> Option<DeviceBuffer> {
    match DeviceBuffer::new(0, bytes) {
        Ok(b) => Some(b),
        Err(e @ (GpuError::NoGpu(_) | GpuError::CudaUnavailable(_))) => {
            eprintln!("note: skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("DeviceBuffer::new failed on a machine with a GPU: {e}"),
    }
}

#[test]
fn cuda_staged_round_trips() {
    let Some(buf) = gpu_buffer(16 << 20) else { return };
    assert_eq!(buf.location(), MemoryLocation::Cuda { ordinal: 0 });
    for chunk in [4096usize, 1 << 20, DEFAULT_CHUNK] {
        let mut st = Stager::new(&buf, chunk, 2).unwrap();
        assert!(st.is_page_locked());
        for (i, len) in boundary_sizes(chunk).into_iter().chain([8 << 20]).enumerate() {
            let data = pattern(i as u64 + chunk as u64, len);
            st.upload(&buf, &data, 123).unwrap();
            let mut back = vec![0u8; len];
            st.download(&buf, &mut back, 123).unwrap();
            assert!(back == data, "chunk {chunk} len {len}");
            // Cross-check with the synchronous driver copy.
            let mut raw = vec![0u8; 123 + len];
            buf.download(&mut raw).unwrap();
            assert!(raw[123..] == data[..]);
        }
        assert!(matches!(st.upload(&buf, &[1u8; 10], (16 << 20) - 5), Err(GpuError::OutOfBounds(_))));
    }
}

#[test]
fn cuda_memory_through_the_gpu_transport() {
    let Some(buf) = gpu_buffer(4 << 20) else { return };
    let gpu = Arc::new(GpuTransport::with_staging(1 << 20, 2).unwrap());
    let region = gpu.register(Arc::new(buf)).unwrap();
    assert!(region.endpoint.starts_with("gpu:0@"), "{}", region.endpoint);
    let engine = TransferEngine::builder().transport(gpu).build().unwrap();
    let data = pattern(77, (3 << 20) + 17);
    engine.write(&region, 1000, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    engine.read(&region, 1000, &mut back).unwrap();
    assert!(back == data);
}

/// Sums on the device are the crc32c of the bytes: single ranges around the
/// kernels' 64 KiB blocks, a scatter of per-layer parts over two buffers (summed
/// as one batch), and the sum a scatter's stream chains behind its copies.
#[test]
fn cuda_sums_of_device_ranges_are_the_crc32c_of_the_bytes() {
    let (Some(a), Some(b)) = (gpu_buffer(4 << 20), gpu_buffer(1 << 20)) else { return };
    let (da, db) = (pattern(5, 4 << 20), pattern(6, 1 << 20));
    a.upload(&da).unwrap();
    b.upload(&db).unwrap();
    for (off, len) in [(0u64, 1u64), (3, 65_535), (0, 65_536), (7, 65_537), (100, 3 << 20)] {
        let want = crc32c::crc32c(&da[off as usize..(off + len) as usize]);
        assert_eq!(a.crc32c(off, len).unwrap(), want, "{off}+{len}");
    }
    let ranges = [(0u64, 1u64), (3, 65_535), (0, 0), (7, 65_537), (100, 3 << 20)];
    let want: Vec<u32> = ranges.iter().map(|&(o, n)| crc32c::crc32c(&da[o as usize..(o + n) as usize])).collect();
    assert_eq!(a.crc32c_each(&ranges).unwrap(), want, "one batch");
    let (a, b): (Arc<dyn DeviceMemory>, Arc<dyn DeviceMemory>) = (Arc::new(a), Arc::new(b));
    let parts = [
        (a.clone(), 1u64, 70_000u64),
        (b.clone(), 5, 100),
        (a.clone(), 2 << 20, 65_536),
        (b.clone(), 500_000, 300_001),
    ];
    let mut want = Vec::new();
    for (i, (_, off, len)) in parts.iter().enumerate() {
        let src = if i % 2 == 0 { &da } else { &db };
        want.extend_from_slice(&src[*off as usize..(*off + *len) as usize]);
    }
    let s = DeviceScatter::new(parts.to_vec()).unwrap();
    assert_eq!(s.crc32c(0, s.len()).unwrap(), crc32c::crc32c(&want));
    assert_eq!(s.crc32c(69_990, 200).unwrap(), crc32c::crc32c(&want[69_990..70_190]));
    let fresh = pattern(7, want.len());
    let mut pinned = s.alloc_pinned(fresh.len()).unwrap();
    pinned.copy_from_slice(&fresh);
    let mut st = s.open_stream().unwrap();
    // SAFETY: `pinned` outlives the stream and is not written while the copy runs.
    unsafe { st.copy_to_device_async(pinned.as_ptr(), fresh.len(), 0).unwrap() };
    let n = fresh.len() as u64;
    let sums = st.synchronize_and_crc32c(&[(0, n), (69_990, 200), (n, 0)]).unwrap();
    assert_eq!(sums, Some(vec![crc32c::crc32c(&fresh), crc32c::crc32c(&fresh[69_990..70_190]), 0]));
    // Ranges of one buffer, chained on its own stream, in one batch.
    let one = gpu_buffer(1 << 20).unwrap();
    one.upload(&db).unwrap();
    let mut st = one.open_stream().unwrap();
    let sums = st.synchronize_and_crc32c(&[(0, 1 << 20), (1, 65_536), (7, 0), (100, 3)]).unwrap().unwrap();
    let want: Vec<u32> = [(0usize, 1usize << 20), (1, 65_536), (7, 0), (100, 3)]
        .iter()
        .map(|&(o, n)| crc32c::crc32c(&db[o..o + n]))
        .collect();
    assert_eq!(sums, want);
}

// --- Device memory for RDMA NICs: allocation ids, dma-buf export, checksums --

#[test]
fn emulated_memory_exports_its_bytes_as_a_dmabuf_a_nic_can_map() {
    let mem = HostDeviceMemory::new(10_000).unwrap();
    let other = HostDeviceMemory::new(10_000).unwrap();
    let (a, b) = (mem.allocation_id().unwrap(), other.allocation_id().unwrap());
    assert_ne!(a, b, "every allocation has its own id");
    assert_eq!(mem.allocation_id(), Some(a), "and keeps it");
    let buf = mem.export_dmabuf().unwrap();
    assert_eq!(buf.iova, mem.device_ptr(), "work requests name the bytes by device address");
    assert!(buf.len >= mem.len() && buf.len.is_multiple_of(4096), "{}", buf.len);
    // What a software NIC does with it: map it, and reach the same bytes.
    // SAFETY: the mapping is only read and written by this test, while `mem` lives.
    let mut nic =
        unsafe { memmap2::MmapOptions::new().len(buf.len as usize).map_mut(&std::fs::File::from(buf.fd)) }.unwrap();
    mem.copy_from_host(100, b"from the host side").unwrap();
    assert_eq!(&nic[100..118], b"from the host side");
    nic[5000..5012].copy_from_slice(b"from the NIC");
    let mut back = [0u8; 12];
    mem.copy_to_host(5000, &mut back).unwrap();
    assert_eq!(&back, b"from the NIC");
    assert_eq!(&mem.to_vec()[5000..5012], b"from the NIC");
    assert_eq!(mem.to_vec().len(), 10_000, "the page rounding is not part of the memory");
}

#[test]
fn memory_without_an_export_says_so() {
    // The trait's defaults: no allocation id (never registered with a NIC) and
    // no dma-buf.
    assert_eq!(EmptyMem.allocation_id(), None);
    assert!(matches!(EmptyMem.export_dmabuf(), Err(GpuError::Unsupported(_))));
    if !cuda_available() {
        println!("skipped the CUDA dma-buf export: no GPU (never run on these machines)");
    }
}

#[test]
fn device_checksums_of_ranges_outside_the_memory_are_refused() {
    let mem = HostDeviceMemory::new(5000).unwrap();
    assert!(matches!(mem.crc32c(4000, 1001), Err(GpuError::OutOfBounds(_))));
    assert!(matches!(mem.crc32c(u64::MAX, 2), Err(GpuError::OutOfBounds(_))));
    assert_eq!(mem.crc32c(5000, 0).unwrap(), crc32c::crc32c(&[]));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The checksum of device bytes is the crc32c of the bytes, for ranges of one
    /// to several staging chunks at any offset.
    #[test]
    fn device_checksum_is_the_crc32c_of_the_bytes(
        seed in any::<u64>(),
        offset in 0u64..5000,
        len in prop_oneof![0u64..10_000, (DEFAULT_CHUNK as u64 - 3)..(2 * DEFAULT_CHUNK as u64 + 9)],
    ) {
        let cap = 2 * DEFAULT_CHUNK as u64 + 5000 + 16;
        let mem = HostDeviceMemory::new(cap).unwrap();
        let data = pattern(seed, cap as usize);
        mem.copy_from_host(0, &data).unwrap();
        let want = crc32c::crc32c(&data[offset as usize..(offset + len) as usize]);
        prop_assert_eq!(mem.crc32c(offset, len).unwrap(), want);
    }
}
