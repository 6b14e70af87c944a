//! The segments a store page-locks for device copies: piece by piece, only the
//! pieces replicas moved by DMA lie in, one DMA per piece; and they go with the
//! store. (They were kept in a process-wide table: every dropped store's whole
//! segment stayed mapped, and on a GPU page-locked, until the process exited.) Over
//! the host emulation of device memory; alone in its test binary, so the process's
//! mappings of 256 MiB and more are its own (the other tests here map less).

use std::collections::BTreeSet;

use mooncake_core::gpu::{DeviceMemory, HostDeviceMemory};
use mooncake_core::{Error, Store};

fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(0x9E37)) as u8).collect()
}

/// Device puts and gets of replicas lying across the pieces of a segment move by
/// DMA (nothing staged) with exact bytes, and only the pieces they lie in are
/// page-locked, each once.
#[test]
fn replicas_move_by_dma_piece_by_piece_and_only_their_pieces_are_page_locked() {
    const PIECE: u64 = 1 << 20;
    const SEGMENT: u64 = 48 << 20;
    let store = Store::builder().global_segment_size(SEGMENT).page_lock_piece(PIECE).build().unwrap();
    let src = HostDeviceMemory::new(8 << 20).unwrap();
    let dst = HostDeviceMemory::new(8 << 20).unwrap();
    let lens = [3000usize, (1 << 20) + 5, (2 << 20) + 123, 700 << 10, (3 << 20) + 1, 1 << 20, 4096];
    let (mut pieces, mut across, mut total) = (BTreeSet::new(), 0, 0u64);
    for (i, &len) in lens.iter().enumerate() {
        let data = pattern(i, len);
        src.copy_from_host(100 * i as u64, &data).unwrap();
        let key = format!("kv/{i}");
        store.put_from_device(&key, &src, 100 * i as u64, len as u64).unwrap();
        assert!(store.get(&key).unwrap()[..] == data[..], "{len}: stored bytes");
        let r = store.master().get_replica_list(&key).unwrap().replicas[0];
        let (first, last) = (r.offset / PIECE, (r.offset + r.len - 1) / PIECE);
        across += usize::from(last > first);
        pieces.extend(first..=last);
        assert_eq!(store.stats().device_page_locked_bytes, pieces.len() as u64 * PIECE, "{len}: pieces locked");
        dst.with_bytes_mut(|b| b.fill(0));
        let at = 4096 + 7 * i as u64;
        assert_eq!(store.get_into_device(&key, &dst, at).unwrap(), len);
        let all = dst.to_vec();
        assert!(all[at as usize..][..len] == data[..], "{len}: device bytes");
        assert!(all[..at as usize].iter().chain(&all[at as usize + len..]).all(|&b| b == 0), "{len}: around");
        total += len as u64;
    }
    assert!(across >= 3, "only {across} replicas lie across pieces: the test no longer tests that");
    let s = store.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 * total, 0), "every replica by DMA");
    assert_eq!(s.device_page_locked_bytes, pieces.len() as u64 * PIECE);
    assert!(s.device_page_locked_bytes < SEGMENT / 2, "the whole segment was page-locked");
}

/// A server that page-locks at setup: before any device call, the own segment is
/// locked whole, and the device calls after it lock nothing more (the same pins).
#[test]
fn page_locking_at_setup_locks_the_own_segment_before_any_device_call() {
    const SEGMENT: u64 = 24 << 20;
    let store = Store::builder().global_segment_size(SEGMENT).page_lock_piece(4 << 20).build().unwrap();
    assert_eq!(store.stats().device_page_locked_bytes, 0);
    assert_eq!(store.page_lock_segments(), SEGMENT);
    let dev = HostDeviceMemory::new(4 << 20).unwrap();
    let data = pattern(9, 3 << 20);
    dev.copy_from_host(0, &data).unwrap();
    store.put_from_device("kv", &dev, 0, data.len() as u64).unwrap();
    assert_eq!(store.get_into_device("kv", &dev, 1 << 20).unwrap(), data.len());
    let s = store.stats();
    assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (2 * data.len() as u64, 0));
    assert_eq!(s.device_page_locked_bytes, SEGMENT, "locked again, or twice");
    assert_eq!(store.page_lock_segments(), SEGMENT);
    // A client without a segment of its own has nothing to lock.
    let reader = Store::builder().global_segment_size(0).build().unwrap();
    assert_eq!(reader.page_lock_segments(), 0);
}

#[test]
fn a_page_lock_piece_under_a_mib_or_off_the_page_size_is_refused() {
    for bytes in [0, 4096, (1 << 20) - 4096, (1 << 20) + 1, (64 << 20) + 100] {
        let built = Store::builder().global_segment_size(1 << 20).page_lock_piece(bytes).build();
        assert!(matches!(built, Err(Error::InvalidArgument(ref m)) if m.contains("page_lock_piece")), "{bytes}");
    }
    assert!(Store::builder().global_segment_size(1 << 20).page_lock_piece((1 << 20) + 4096).build().is_ok());
}

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
