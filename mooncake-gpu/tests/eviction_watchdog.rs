//! FIFO eviction between watermarks (skipping pinned / not-ready objects) and
//! the stuck-put watchdog.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_gpu::{CacheConfig, DeviceHeap, GpuError, HeaderU32Field, HostHeap, NanoKvCache, ObjectState};

const PAGE: u32 = 64 << 10;

/// 20 pages of arena: each 1-page object is 5 % of it.
fn cache20(timeout: Duration) -> NanoKvCache<HostHeap> {
    let heap = Arc::new(HostHeap::new(64, 20 * u64::from(PAGE)).unwrap());
    NanoKvCache::new(
        heap,
        CacheConfig { page_size: PAGE, high_watermark: 0.95, low_watermark: 0.85, stuck_timeout: timeout, rank: 3 },
    )
    .unwrap()
}

fn pin(c: &NanoKvCache<HostHeap>, key: &str) -> u32 {
    let m = c.get_location(key).unwrap();
    c.heap().fetch_add_u32(m.slot, HeaderU32Field::ReaderRefcnt, 1).unwrap();
    m.slot
}

fn unpin(c: &NanoKvCache<HostHeap>, slot: u32) {
    c.heap().fetch_add_u32(slot, HeaderU32Field::ReaderRefcnt, -1).unwrap();
}

#[test]
fn fifo_order_and_stop_at_low_watermark() {
    let c = cache20(Duration::from_secs(60));
    for i in 0..19 {
        c.put(&format!("k{i:02}"), &[i as u8; 1000]).unwrap();
    }
    assert_eq!(c.stats().bytes_used, 19 * u64::from(PAGE)); // 95 %
    assert_eq!(c.stats().evict_count, 0);
    // The 20th put would go above 95 %: evict oldest until used + new <= 85 %
    // i.e. used <= 16 pages: 3 victims, the three oldest.
    c.put("k19", &[19u8; 1000]).unwrap();
    let s = c.stats();
    assert_eq!(s.evict_count, 3);
    assert_eq!(s.bytes_used, 17 * u64::from(PAGE));
    for i in 0..3 {
        assert_eq!(c.get(&format!("k{i:02}")), Err(GpuError::NotFound));
    }
    for i in 3..20 {
        assert_eq!(c.get(&format!("k{i:02}")).unwrap(), vec![i as u8; 1000]);
    }
    // explicit eviction stops as soon as usage is at or below the ratio
    let n = c.evict_until_below(0.5); // 10 pages
    assert_eq!(n, 7);
    assert_eq!(c.stats().bytes_used, 10 * u64::from(PAGE));
    let keys = c.keys_fifo();
    assert_eq!(keys.first().unwrap(), "k10");
    assert_eq!(keys.len(), 10);
    assert_eq!(c.evict_until_below(0.5), 0); // already below: no-op
}

#[test]
fn eviction_skips_pinned_and_not_ready_keeping_fifo_for_the_rest() {
    let c = cache20(Duration::from_secs(60));
    c.put("a", &[1; 10]).unwrap();
    let writing = c.open_for_write("b-writing", 10).unwrap();
    c.put("c", &[3; 10]).unwrap();
    c.put("d", &[4; 10]).unwrap();
    c.put("e", &[5; 10]).unwrap();
    let pa = pin(&c, "a");
    // target 2 pages of 20: 3 objects must go; a is pinned, b not ready
    let n = c.evict_until_below(0.10);
    assert_eq!(n, 3);
    assert!(c.contains("a"));
    assert!(c.contains("b-writing"));
    assert!(!c.contains("c") && !c.contains("d") && !c.contains("e"));
    let s = c.stats();
    assert!(s.evict_in_use_retry >= 1);
    assert!(s.evict_not_ready_skip >= 1);
    // nothing else evictable: eviction gives up without touching them
    assert_eq!(c.evict_until_below(0.0), 0);
    assert_eq!(c.heap().read_header(pa).unwrap().object_state(), Some(ObjectState::Ready));
    // removal of a pinned object is refused, nothing changes
    assert_eq!(c.remove("a"), Err(GpuError::InUse { readers: 1 }));
    unpin(&c, pa);
    assert_eq!(c.evict_until_below(0.0), 1);
    assert!(!c.contains("a"));
    // finishing the plan makes b evictable
    c.write(&writing, 0, &[2; 10]).unwrap();
    c.commit(&writing).unwrap();
    assert_eq!(c.evict_until_below(0.0), 1);
    assert_eq!(c.stats().bytes_used, 0);
}

#[test]
fn full_heap_of_pinned_objects_reports_no_space() {
    let c = cache20(Duration::from_secs(60));
    let mut pins = vec![];
    for i in 0..20 {
        c.put(&format!("k{i}"), &[0; 10]).unwrap();
        pins.push(pin(&c, &format!("k{i}")));
    }
    assert!(matches!(c.put("x", &[0; 10]), Err(GpuError::NoSpace { .. })));
    assert_eq!(c.stats().oom_count, 1);
    unpin(&c, pins[7]);
    c.put("x", &[0; 10]).unwrap();
    assert!(!c.contains("k7"));
    // too large for the arena at all
    assert!(matches!(c.put("huge", &vec![0; 21 * PAGE as usize]), Err(GpuError::NoSpace { .. })));
}

#[test]
fn header_slots_exhaustion_evicts_or_fails() {
    let heap = Arc::new(HostHeap::new(2, 100 * u64::from(PAGE)).unwrap());
    let c = NanoKvCache::new(heap, CacheConfig { page_size: PAGE, ..Default::default() }).unwrap();
    c.put("a", &[1]).unwrap();
    c.put("b", &[2]).unwrap();
    c.put("c", &[3]).unwrap(); // evicts a for its header slot
    assert!(!c.contains("a"));
    let pb = pin(&c, "b");
    let pc = pin(&c, "c");
    assert_eq!(c.put("d", &[4]), Err(GpuError::NoHeaderSlot { slots: 2 }));
    // the failed reservation gave its payload back
    assert_eq!(c.stats().bytes_used, 2 * u64::from(PAGE));
    unpin(&c, pb);
    unpin(&c, pc);
}

#[test]
fn fragmentation_is_resolved_by_evicting_more() {
    // watermarks at 100 %: only the fit loop evicts
    let heap = Arc::new(HostHeap::new(64, 20 * u64::from(PAGE)).unwrap());
    let cfg = CacheConfig { page_size: PAGE, high_watermark: 1.0, low_watermark: 1.0, ..Default::default() };
    let c = NanoKvCache::new(heap, cfg).unwrap();
    // 10 two-page objects fill the arena
    for i in 0..10 {
        c.put(&format!("k{i}"), &vec![i as u8; 2 * PAGE as usize]).unwrap();
    }
    // free two non-adjacent holes of 2 pages each
    c.remove("k3").unwrap();
    c.remove("k6").unwrap();
    assert_eq!(c.stats().evict_count, 0);
    // 3 pages fit nowhere contiguous although 4 pages are free
    c.put("big", &vec![9; 3 * PAGE as usize]).unwrap();
    assert_eq!(c.get("big").unwrap(), vec![9; 3 * PAGE as usize]);
    // the fit loop evicted the oldest (k0: still no 3-page hole), then k1,
    // whose range coalesces with k0's into a 4-page hole
    assert!(!c.contains("k0") && !c.contains("k1"));
    assert!(c.contains("k2") && c.contains("k9"));
}

#[test]
fn crash_mid_put_reclaimed_after_timeout_not_before() {
    let timeout = Duration::from_millis(500);
    let c = cache20(timeout);
    let plan = c.open_for_write("crashed", 3 * u64::from(PAGE)).unwrap();
    c.write(&plan, 0, &vec![1; PAGE as usize]).unwrap(); // partial, then "crash"
    c.put("fine", &[1; 10]).unwrap();
    let t0 = plan.reserved_at_ns;
    let tmo = timeout.as_nanos() as u64;
    assert_eq!(c.reclaim_stuck(t0), 0);
    assert_eq!(c.reclaim_stuck(t0 + tmo), 0); // exactly at the timeout: not yet
    assert!(c.contains("crashed"));
    assert_eq!(c.get_location("crashed"), Err(GpuError::NotReady));
    assert_eq!(c.reclaim_stuck(t0 + tmo + 1), 1);
    assert!(!c.contains("crashed"));
    assert_eq!(c.get("crashed"), Err(GpuError::NotFound));
    assert_eq!(c.stats().stuck_put_reclaimed, 1);
    assert_eq!(c.stats().bytes_used, u64::from(PAGE)); // only "fine" left
    assert_eq!(c.get("fine").unwrap(), vec![1; 10]); // committed objects untouched
                                                     // the producer that wakes up late is told its plan is gone
    assert_eq!(c.write(&plan, 1, &vec![1; PAGE as usize]), Err(GpuError::Stale));
    assert_eq!(c.commit(&plan), Err(GpuError::Stale));
    // the key can be put again
    c.put("crashed", &[2; 10]).unwrap();
    assert_eq!(c.reclaim_stuck(u64::MAX), 0); // committed: never reclaimed
}

#[test]
fn watchdog_thread_reclaims_stuck_put() {
    let timeout = Duration::from_millis(300);
    let c = Arc::new(cache20(timeout));
    let wd = c.spawn_watchdog(Duration::from_millis(20));
    let start = Instant::now();
    let _plan = c.open_for_write("stuck", 10).unwrap();
    let committed = c.open_for_write("ok", 10).unwrap();
    c.write(&committed, 0, &[1; 10]).unwrap();
    c.commit(&committed).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    if start.elapsed() < timeout {
        assert!(c.contains("stuck"), "reclaimed before the timeout");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while c.contains("stuck") {
        assert!(Instant::now() < deadline, "watchdog never reclaimed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(start.elapsed() >= timeout);
    assert!(c.contains("ok"));
    assert_eq!(c.stats().stuck_put_reclaimed, 1);
    wd.stop();
}

#[test]
fn watchdog_does_not_reclaim_while_host_producer_copies() {
    // The host write path pins the slot, so a reclaim racing it backs off.
    let c = cache20(Duration::from_millis(0));
    let plan = c.open_for_write("w", 10).unwrap();
    c.heap().fetch_add_u32(plan.slot, HeaderU32Field::ReaderRefcnt, 1).unwrap(); // as `write` does during its copy
    assert_eq!(c.reclaim_stuck(plan.reserved_at_ns + 1_000_000), 0);
    assert!(c.contains("w"));
    let st = c.heap().load_u32(plan.slot, HeaderU32Field::State, Ordering::SeqCst).unwrap();
    assert_eq!(st, ObjectState::Writing as u32); // state restored
    c.heap().fetch_add_u32(plan.slot, HeaderU32Field::ReaderRefcnt, -1).unwrap();
    assert_eq!(c.reclaim_stuck(plan.reserved_at_ns + 1_000_000), 1);
}

#[test]
fn abort_and_remove_of_unfinished_put() {
    let c = cache20(Duration::from_secs(60));
    let p = c.open_for_write("a", 10).unwrap();
    c.abort(&p).unwrap();
    assert!(!c.contains("a"));
    assert_eq!(c.abort(&p), Err(GpuError::Stale));
    let p = c.open_for_write("a", 10).unwrap();
    c.remove("a").unwrap();
    assert_eq!(c.commit(&p), Err(GpuError::Stale));
    assert_eq!(c.stats().bytes_used, 0);
    assert_eq!(c.stats().header_slots_used, 0);
}

#[test]
fn config_is_validated_and_rank_reported() {
    let heap = Arc::new(HostHeap::new(4, 1 << 20).unwrap());
    for bad in [
        CacheConfig { page_size: 1000, ..Default::default() },
        CacheConfig { page_size: 0, ..Default::default() },
        CacheConfig { low_watermark: 0.9, high_watermark: 0.8, ..Default::default() },
        CacheConfig { high_watermark: 1.5, ..Default::default() },
    ] {
        assert!(matches!(NanoKvCache::new(heap.clone(), bad), Err(GpuError::InvalidArgument(_))));
    }
    let c = cache20(Duration::from_secs(1));
    let p = c.open_for_write("r", 1).unwrap();
    assert_eq!(p.dst_rank, 3);
    // a dyn heap works as well
    let dynheap: Arc<dyn DeviceHeap> = Arc::new(HostHeap::new(4, 1 << 20).unwrap());
    let d: NanoKvCache = NanoKvCache::new(dynheap, CacheConfig { page_size: PAGE, ..Default::default() }).unwrap();
    d.put("x", b"hello").unwrap();
    assert_eq!(d.get("x").unwrap(), b"hello");
}

#[test]
fn routing() {
    use mooncake_gpu::route;
    assert_eq!(route("anything", Some(5), 8), 5);
    let r = route("key-1", None, 8);
    assert_eq!(r as u64, xxhash_like("key-1") % 8);
    // roughly uniform
    let mut counts = [0usize; 4];
    for i in 0..4000 {
        counts[route(&format!("k{i}"), None, 4)] += 1;
    }
    assert!(counts.iter().all(|&n| n > 800), "{counts:?}");
}

fn xxhash_like(k: &str) -> u64 {
    mooncake_gpu::KeyId::of(k).hash
}
