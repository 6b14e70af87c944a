//! CUDA path. On a machine without a GPU every entry point must return the
//! typed no-GPU error (checked here). The device tests run the same
//! correctness checks as the host-heap tests on a real GPU and skip with a
//! printed note when none is present.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mooncake_gpu::{
    cuda_available, cuda_device_count, CacheConfig, CudaDeviceHeap, DeviceHeap, GpuError, HeaderU32Field,
    IpcHeapHandle, KeyId, NanoKvCache,
};

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

fn gpu_heap(slots: u32, bytes: u64) -> Option<Arc<CudaDeviceHeap>> {
    match CudaDeviceHeap::new(0, slots, bytes) {
        Ok(h) => Some(Arc::new(h)),
        Err(e @ (GpuError::NoGpu(_) | GpuError::CudaUnavailable(_))) => {
            eprintln!("note: skipping GPU test: {e}");
            None
        }
        Err(e) => panic!("CudaDeviceHeap::new failed on a machine with a GPU: {e}"),
    }
}

#[test]
fn no_gpu_path_returns_typed_error_not_panic() {
    if cuda_available() {
        eprintln!("note: a GPU is present; the no-GPU path is not exercised here");
        return;
    }
    assert!(matches!(cuda_device_count(), Err(GpuError::NoGpu(_))));
    let r = std::panic::catch_unwind(|| CudaDeviceHeap::new(0, 16, 1 << 20));
    match r {
        Ok(Err(GpuError::NoGpu(msg))) => assert!(!msg.is_empty()),
        Ok(other) => panic!("expected NoGpu, got {other:?}"),
        Err(_) => panic!("CudaDeviceHeap::new panicked without a GPU"),
    }
    let h = IpcHeapHandle { headers: [1; 64], payload: [2; 64], header_slots: 4, payload_bytes: 1 << 20 };
    assert!(matches!(CudaDeviceHeap::open_ipc(0, &h), Err(GpuError::NoGpu(_))));
    // asking twice gives the same answer (the probe is cached, no panic later)
    assert!(matches!(CudaDeviceHeap::new(0, 1, 1), Err(GpuError::NoGpu(_))));
}

#[test]
fn ipc_handle_encoding_roundtrip_and_rejects_garbage() {
    let h = IpcHeapHandle { headers: [7; 64], payload: [9; 64], header_slots: 1024, payload_bytes: 8 << 30 };
    let b = h.to_bytes();
    assert_eq!(b.len(), IpcHeapHandle::ENCODED_LEN);
    assert_eq!(IpcHeapHandle::from_bytes(&b).unwrap(), h);
    assert!(IpcHeapHandle::from_bytes(&b[..100]).is_err());
    let mut bad = b.clone();
    bad[0] = b'X';
    assert!(IpcHeapHandle::from_bytes(&bad).is_err());
    let mut bad = b.clone();
    bad[4] = 99;
    assert!(IpcHeapHandle::from_bytes(&bad).is_err());
    let mut empty = b;
    empty[8..12].copy_from_slice(&0u32.to_le_bytes());
    assert!(IpcHeapHandle::from_bytes(&empty).is_err());
}

#[test]
fn gpu_cache_exact_bytes_64k_to_8m_and_tail_clamp() {
    let Some(heap) = gpu_heap(64, 64 << 20) else { return };
    for page in [128u32 << 10, 256 << 10, 512 << 10] {
        let c = NanoKvCache::new(heap.clone(), CacheConfig { page_size: page, ..Default::default() }).unwrap();
        let sizes = [64usize << 10, 100_000, (1 << 20) + 12_345, 3_000_001, 8 << 20];
        for (i, &len) in sizes.iter().enumerate() {
            let v = pattern(i as u64, len);
            c.put(&format!("k{i}"), &v).unwrap();
            let mut dst = vec![0xAAu8; len + 4096];
            assert_eq!(c.get_into(&format!("k{i}"), &mut dst).unwrap(), len as u64);
            assert_eq!(&dst[..len], &v[..], "page {page} len {len}");
            assert!(dst[len..].iter().all(|&b| b == 0xAA));
        }
    }
}

#[test]
fn gpu_device_push_publish_and_device_read() {
    let Some(heap) = gpu_heap(16, 32 << 20) else { return };
    let c = NanoKvCache::new(heap.clone(), CacheConfig::default()).unwrap();
    let len = 3 * (256 << 10) + 777;
    let v = pattern(42, len);
    let src = heap.alloc_buffer(len).unwrap();
    src.upload(&v).unwrap();
    let plan = c.open_for_write("dev", len as u64).unwrap();
    assert_eq!(c.get_location("dev"), Err(GpuError::NotReady));
    // first two pages without publishing, then the rest with the publish
    heap.push_from_device(&plan, src.ptr(), 0, 2, false, 0).unwrap();
    assert_eq!(c.get_location("dev"), Err(GpuError::NotReady));
    let off = 2 * (256 << 10);
    heap.push_from_device(&plan, src.ptr() + off as u64, 2, 2, true, c.now_ns()).unwrap();
    let meta = c.get_location("dev").unwrap();
    c.commit(&plan).unwrap(); // idempotent after the device publish
    assert_eq!(c.get("dev").unwrap(), v);
    // device reader into a device buffer, tail clamped
    let dst = heap.alloc_buffer(len + 4096).unwrap();
    dst.upload(&vec![0xAA; len + 4096]).unwrap();
    let n = heap.read_into_device(&meta, &KeyId::of("dev"), dst.ptr(), (len + 4096) as u64).unwrap();
    assert_eq!(n, len as u64);
    let mut back = vec![0u8; len + 4096];
    dst.download(&mut back).unwrap();
    assert_eq!(&back[..len], &v[..]);
    assert!(back[len..].iter().all(|&b| b == 0xAA));
    assert_eq!(heap.load_u32(meta.slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap(), 0);
    // The one-launch kernels count their blocks' arrivals in a counter each launch
    // leaves at zero: reads and puts in a row, with other grid sizes between them,
    // each answer.
    for round in 0..3u32 {
        let key = format!("again/{round}");
        let n_bytes = (round as usize + 1) * 100_000;
        let p = c.open_for_write(&key, n_bytes as u64).unwrap();
        heap.push_from_device(&p, src.ptr(), 0, p.n_pages, true, c.now_ns()).unwrap();
        assert_eq!(c.get(&key).unwrap(), v[..n_bytes], "put {round}");
        // The one-wait device put: its header write is not waited for, only
        // ordered before the push on the heap's stream; a slot reused round
        // after round must still publish the new header's object.
        let fast = format!("fast/{round}");
        let ready = c.stats().ready_count;
        c.put_from_device(&fast, src.ptr() + 1000, n_bytes as u64).unwrap();
        assert_eq!(c.stats().ready_count, ready + 1, "counted as published at once");
        assert_eq!(c.get(&fast).unwrap(), v[1000..1000 + n_bytes], "device put {round}");
        assert_eq!(c.put_from_device(&fast, src.ptr(), 10), Err(GpuError::AlreadyExists));
        c.remove(&fast).unwrap();
        let n = heap.read_into_device(&meta, &KeyId::of("dev"), dst.ptr(), (len + 4096) as u64).unwrap();
        assert_eq!(n, len as u64, "read {round}");
        assert_eq!(heap.load_u32(meta.slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap(), 0);
    }
    // A read of more blocks than one launch takes (6 MiB: 192 blocks): pinned
    // once by its own kernel, copied and unpinned by a second.
    let big = 6 << 20;
    let bytes = pattern(7, big);
    let big_src = heap.alloc_buffer(big).unwrap();
    big_src.upload(&bytes).unwrap();
    c.put_from_device("big", big_src.ptr(), big as u64).unwrap();
    let big_meta = c.get_location("big").unwrap();
    let big_dst = heap.alloc_buffer(big).unwrap();
    assert_eq!(heap.read_into_device(&big_meta, &KeyId::of("big"), big_dst.ptr(), big as u64).unwrap(), big as u64);
    let mut back = vec![0u8; big];
    big_dst.download(&mut back).unwrap();
    assert!(back == bytes, "the two-launch read moved other bytes");
    assert!(matches!(
        heap.read_into_device(&big_meta, &KeyId::of("big"), big_dst.ptr(), big as u64 - 1),
        Err(GpuError::BufferTooSmall { .. })
    ));
    assert_eq!(heap.load_u32(big_meta.slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap(), 0);
    // too small a destination, wrong key, stale epoch: refused, refcount balanced
    assert!(matches!(
        heap.read_into_device(&meta, &KeyId::of("dev"), dst.ptr(), 10),
        Err(GpuError::BufferTooSmall { .. })
    ));
    assert_eq!(heap.read_into_device(&meta, &KeyId::of("other"), dst.ptr(), (len + 4096) as u64), Err(GpuError::Stale));
    c.remove("dev").unwrap();
    assert_eq!(heap.read_into_device(&meta, &KeyId::of("dev"), dst.ptr(), (len + 4096) as u64), Err(GpuError::Stale));
    assert_eq!(heap.load_u32(meta.slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap(), 0);
}

#[test]
fn gpu_eviction_skips_pinned_and_watchdog_reclaims() {
    let Some(heap) = gpu_heap(32, 20 * (256 << 10)) else { return };
    let cfg = CacheConfig { stuck_timeout: std::time::Duration::from_millis(1), ..Default::default() };
    let c = NanoKvCache::new(heap.clone(), cfg).unwrap();
    for i in 0..5 {
        c.put(&format!("k{i}"), &[i as u8; 1000]).unwrap();
    }
    let m = c.get_location("k0").unwrap();
    heap.fetch_add_u32(m.slot, HeaderU32Field::ReaderRefcnt, 1).unwrap();
    assert_eq!(c.evict_until_below(0.0), 4);
    assert_eq!(c.keys_fifo(), vec!["k0"]);
    assert_eq!(c.remove("k0"), Err(GpuError::InUse { readers: 1 }));
    heap.fetch_add_u32(m.slot, HeaderU32Field::ReaderRefcnt, -1).unwrap();
    c.remove("k0").unwrap();
    let plan = c.open_for_write("stuck", 10).unwrap();
    assert_eq!(c.reclaim_stuck(plan.reserved_at_ns), 0);
    assert_eq!(c.reclaim_stuck(plan.reserved_at_ns + 2_000_000), 1);
    assert!(!c.contains("stuck"));
}

#[test]
fn gpu_ipc_export_open_in_same_process_when_supported() {
    let Some(heap) = gpu_heap(8, 4 << 20) else { return };
    let h = heap.export_ipc().unwrap();
    let h2 = IpcHeapHandle::from_bytes(&h.to_bytes()).unwrap();
    // Opening in the exporting process is refused by the driver
    // (CUDA_ERROR_INVALID_CONTEXT / already mapped); a typed error, no panic.
    match CudaDeviceHeap::open_ipc(0, &h2) {
        Ok(imported) => assert!(imported.is_imported()),
        Err(e) => eprintln!("note: same-process IPC open refused as expected: {e}"),
    }
}

/// Every kind of host memory the store page-locks for one-DMA device copies: a
/// heap buffer, an anonymous mapping (an embedded store's segment, large as a
/// real one), and a `memfd` mapped shared (a segment same-host peers map). Each
/// must page-lock, and a DMA between it and the device must move exact bytes.
#[test]
fn gpu_host_memory_of_every_kind_page_locks_and_moves_in_one_dma() {
    use mooncake_gpu::{DeviceBuffer, DeviceMemory, HostPinning};
    if !cuda_available() {
        eprintln!("note: skipping GPU test: no CUDA device");
        return;
    }
    let len = 8 << 20;
    let dev = DeviceBuffer::new(0, len).expect("a device buffer");
    let mut heap = vec![0u8; len];
    let mut anon = memmap2::MmapMut::map_anon(2 << 30).expect("a 2 GiB anonymous mapping");
    // SAFETY: memfd_create takes a NUL-terminated name and flags; its result is checked.
    let fd = unsafe { libc::memfd_create(c"pin-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(64 << 20).unwrap();
    // SAFETY: the memfd is this test's own; nobody else resizes it while mapped.
    let mut shared = unsafe { memmap2::MmapMut::map_mut(&file) }.expect("mapping the memfd");
    let mut failures = Vec::new();
    let kinds: [(&str, &mut [u8]); 3] =
        [("heap", &mut heap[..]), ("anonymous 2 GiB", &mut anon[..]), ("memfd shared", &mut shared[..])];
    for (what, mem) in kinds {
        let want = pattern(what.len() as u64, len);
        mem[..len].copy_from_slice(&want);
        let start = std::time::Instant::now();
        // SAFETY: `mem` stays mapped while the pin lives (dropped in this iteration).
        let pin = unsafe { HostPinning::pin(mem.as_mut_ptr(), mem.len()) };
        let took = start.elapsed();
        match pin {
            Ok(pin) => {
                eprintln!("note: page-locked {what} ({} bytes) in {took:?}", mem.len());
                let mut stream = dev.open_stream().unwrap();
                // SAFETY: `mem` holds `len` bytes, is pinned, and is not touched until
                // the synchronize below.
                unsafe { stream.copy_to_device_async(mem.as_ptr(), len, 0).unwrap() };
                stream.synchronize().unwrap();
                mem[..len].fill(0);
                // SAFETY: as above, the other way.
                unsafe { stream.copy_from_device_async(mem.as_mut_ptr(), len, 0).unwrap() };
                stream.synchronize().unwrap();
                assert!(mem[..len] == want[..], "{what}: the bytes came back changed");
                drop(pin);
            }
            Err(e) => failures.push(format!("{what}: {e}")),
        }
    }
    assert!(failures.is_empty(), "page-locking failed: {failures:?}");
}
