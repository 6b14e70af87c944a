//! The segments a store page-locks for device copies go with the store. (They were
//! kept in a process-wide table: every dropped store's whole segment stayed mapped,
//! and on a GPU page-locked, until the process exited.) Over the host emulation of
//! device memory; alone in its test binary, so the process's mappings are its own.

use mooncake_core::gpu::HostDeviceMemory;
use mooncake_core::Store;

/// Mappings of this process of at least `len` bytes (a segment each; far larger than
/// anything else here: malloc's arenas, which only grow, are 64 MiB).
fn mappings_of_at_least(len: u64) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter_map(|l| {
            let (start, end) = l.split_whitespace().next()?.split_once('-')?;
            let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
            (end - start >= len).then_some(())
        })
        .count()
}

#[test]
fn a_dropped_store_unpins_and_unmaps_its_segment() {
    const SEGMENT: u64 = 256 << 20;
    let dst = HostDeviceMemory::new(4096).unwrap();
    let before = mappings_of_at_least(SEGMENT);
    for _ in 0..8 {
        let store = Store::builder().global_segment_size(SEGMENT).build().unwrap();
        store.put("k", &[7u8; 4096]).unwrap();
        assert_eq!(store.get_into_device("k", &dst, 0).unwrap(), 4096);
        assert_eq!(dst.to_vec(), vec![7u8; 4096]);
        assert_eq!(store.stats().device_direct_bytes, 4096, "one DMA from the pinned segment");
        assert!(mappings_of_at_least(SEGMENT) > before, "the segment is a mapping of its own");
        drop(store);
    }
    // A dropped store's threads let go of it a moment later (their next tick): the
    // last stores may take that long to be unmapped.
    let start = std::time::Instant::now();
    let mut left = mappings_of_at_least(SEGMENT) - before;
    while left > 0 && start.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(50));
        left = mappings_of_at_least(SEGMENT).saturating_sub(before);
    }
    assert_eq!(left, 0, "segments of dropped stores still mapped");
}
