//! The segments a store page-locks for device copies go with the store. (They were
//! kept in a process-wide table: every dropped store's whole segment stayed mapped,
//! and on a GPU page-locked, until the process exited.) Over the host emulation of
//! device memory; alone in its test binary, so the process's size is its own.

use mooncake_core::gpu::HostDeviceMemory;
use mooncake_core::Store;

/// The process's virtual size, in bytes.
fn vm_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib << 10
}

#[test]
fn a_dropped_store_unpins_and_unmaps_its_segment() {
    const SEGMENT: u64 = 256 << 20;
    let dst = HostDeviceMemory::new(4096).unwrap();
    let mut before = None;
    for round in 0..8 {
        let store = Store::builder().global_segment_size(SEGMENT).build().unwrap();
        store.put("k", &[7u8; 4096]).unwrap();
        assert_eq!(store.get_into_device("k", &dst, 0).unwrap(), 4096);
        assert_eq!(dst.to_vec(), vec![7u8; 4096]);
        assert_eq!(store.stats().device_direct_bytes, 4096, "one DMA from the pinned segment");
        drop(store);
        // The first round sets up what stays for good (thread pools, allocator arenas).
        if round == 0 {
            before = Some(vm_size());
        }
    }
    let grown = vm_size().saturating_sub(before.unwrap());
    assert!(grown < 2 * SEGMENT, "the process grew by {} MiB over 7 stores of {} MiB", grown >> 20, SEGMENT >> 20);
}
