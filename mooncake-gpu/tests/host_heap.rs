//! HostHeap + NanoKvCache correctness over 64 KiB .. 8 MiB objects: exact bytes
//! back, tail page clamp, bounds checks, key/epoch verification.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mooncake_gpu::{
    CacheConfig, DeviceHeap, GpuError, HeaderU32Field, HeaderU64Field, HostHeap, KeyId, NanoKvCache, ObjectState,
    PageSpan, ReadExpect,
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

fn cache(page: u32, slots: u32, bytes: u64) -> NanoKvCache<HostHeap> {
    let heap = Arc::new(HostHeap::new(slots, bytes).unwrap());
    NanoKvCache::new(heap, CacheConfig { page_size: page, ..Default::default() }).unwrap()
}

#[test]
fn sizes_64k_to_8m_exact_bytes_every_page_size() {
    let sizes: [usize; 9] = [
        64 << 10,
        (64 << 10) + 1,
        100_000,
        (128 << 10) - 1,
        1 << 20,
        (1 << 20) + 12_345,
        3_000_001,
        (8 << 20) - 7,
        8 << 20,
    ];
    for page in [128 << 10, 256 << 10, 512 << 10] {
        let c = cache(page, 64, 48 << 20);
        for (i, &len) in sizes.iter().enumerate() {
            let key = format!("p{page}/obj{i}");
            let v = pattern(i as u64 + u64::from(page), len);
            c.put(&key, &v).unwrap();
            let meta = c.get_location(&key).unwrap();
            assert_eq!(meta.bytes_total, len as u64);
            assert_eq!(meta.n_pages as usize, len.div_ceil(page as usize));
            let last = len - (meta.n_pages as usize - 1) * page as usize;
            assert_eq!(meta.last_page_bytes as usize, last);
            assert!(meta.last_page_bytes >= 1 && meta.last_page_bytes <= page);
        }
        for (i, &len) in sizes.iter().enumerate() {
            let key = format!("p{page}/obj{i}");
            let v = pattern(i as u64 + u64::from(page), len);
            assert_eq!(c.get(&key).unwrap(), v, "page {page} size {len}");
        }
    }
}

#[test]
fn tail_clamp_never_writes_past_the_object() {
    let page = 128 << 10;
    let c = cache(page, 16, 8 << 20);
    // Leave garbage in the arena first so the slack of a later object's last
    // page holds someone else's bytes.
    c.put("junk", &vec![0xEE; 2 << 20]).unwrap();
    c.remove("junk").unwrap();
    let len = 300_001; // 3 pages, last one 37_857 bytes
    let v = pattern(7, len);
    c.put("obj", &v).unwrap();
    let mut dst = vec![0xAAu8; len + 5000];
    assert_eq!(c.get_into("obj", &mut dst).unwrap(), len as u64);
    assert_eq!(&dst[..len], &v[..]);
    assert!(dst[len..].iter().all(|&b| b == 0xAA), "bytes after the object were written");

    // Page-level reads clamp the last page as well.
    let meta = c.get_location("obj").unwrap();
    let span = meta.span();
    assert_eq!(span.page_len(2), (len - 2 * page as usize) as u32);
    let mut last = vec![0u8; span.page_len(2) as usize];
    c.heap().read_pages(&span, 2, &mut last).unwrap();
    assert_eq!(&last[..], &v[2 * page as usize..]);
    // a full page-sized buffer for the last page is refused (it would read slack)
    let mut too_big = vec![0u8; page as usize];
    assert!(matches!(c.heap().read_pages(&span, 2, &mut too_big), Err(GpuError::InvalidArgument(_))));
    // a buffer that is not whole pages is refused
    let mut odd = vec![0u8; 1000];
    assert!(c.heap().read_pages(&span, 0, &mut odd).is_err());
}

#[test]
fn buffer_too_small_and_not_found() {
    let c = cache(64 << 10, 8, 1 << 20);
    c.put("a", &[1u8; 70_000]).unwrap();
    let mut small = vec![0u8; 69_999];
    assert_eq!(c.get_into("a", &mut small), Err(GpuError::BufferTooSmall { need: 70_000, got: 69_999 }));
    assert_eq!(c.get("b"), Err(GpuError::NotFound));
    assert_eq!(c.remove("b"), Err(GpuError::NotFound));
    assert_eq!(c.touch("b"), Err(GpuError::NotFound));
    assert_eq!(c.put("a", &[2u8; 10]), Err(GpuError::AlreadyExists));
    assert!(matches!(c.put("", &[1]), Err(GpuError::InvalidArgument(_))));
    assert!(matches!(c.put("k", &[]), Err(GpuError::InvalidArgument(_))));
    let s = c.stats();
    assert_eq!(s.get_misses, 1);
    assert_eq!(s.objects, 1);
}

#[test]
fn plan_pages_written_out_of_order_then_commit() {
    let page = 64 << 10;
    let c = cache(page, 8, 4 << 20);
    let len = 5 * page as usize + 123;
    let v = pattern(3, len);
    let plan = c.open_for_write("k", len as u64).unwrap();
    assert_eq!(plan.n_pages, 6);
    assert_eq!(plan.page_len(5), 123);
    assert_eq!(plan.page_ptr(1) - plan.page_ptr(0), u64::from(page));
    assert_eq!(plan.page_offset(0), plan.payload_offset);
    assert_eq!(plan.header_ptr, c.heap().header_addr(plan.slot));
    assert_eq!(plan.state_ptr(), plan.header_ptr + 56);
    // header says WRITING, not readable yet
    let h = c.heap().read_header(plan.slot).unwrap();
    assert_eq!(h.object_state(), Some(ObjectState::Writing));
    assert_eq!(h.key_hash, KeyId::of("k").hash);
    assert_eq!(c.get_location("k"), Err(GpuError::NotReady));
    assert_eq!(c.get("k"), Err(GpuError::NotReady));
    // pages in any order, several at a time, tail last
    let p = page as usize;
    c.write(&plan, 5, &v[5 * p..]).unwrap();
    c.write(&plan, 2, &v[2 * p..5 * p]).unwrap();
    c.write(&plan, 0, &v[..2 * p]).unwrap();
    // a misaligned chunk is refused
    assert!(c.write(&plan, 0, &v[..100]).is_err());
    c.commit(&plan).unwrap();
    c.commit(&plan).unwrap(); // idempotent
    assert_eq!(c.get("k").unwrap(), v);
    // writes after publish are refused (objects are immutable)
    assert_eq!(c.write(&plan, 0, &v[..p]), Err(GpuError::Stale));
    assert_eq!(c.stats().puts, 1);
}

#[test]
fn device_side_publish_is_seen_by_get_location_and_commit() {
    // A producer kernel flips READY itself; the host just observes it.
    let c = cache(64 << 10, 8, 1 << 20);
    let plan = c.open_for_write("dev", 1000).unwrap();
    let heap = c.heap();
    heap.write_pages(&plan.span(), 0, &[9u8; 1000]).unwrap();
    heap.publish(plan.slot, plan.epoch, 1).unwrap();
    assert!(c.get_location("dev").is_ok());
    c.commit(&plan).unwrap(); // idempotent after the device publish
    assert_eq!(c.get("dev").unwrap(), vec![9u8; 1000]);
}

#[test]
fn epoch_detects_slot_reuse_and_key_is_verified() {
    let c = cache(64 << 10, 1, 1 << 20); // one slot: every put reuses it
    c.put("a", &[1u8; 100]).unwrap();
    let old = c.get_location("a").unwrap();
    c.remove("a").unwrap();
    c.put("b", &[2u8; 100]).unwrap();
    let new = c.get_location("b").unwrap();
    assert_eq!(old.slot, new.slot);
    assert_eq!(new.epoch, old.epoch.wrapping_add(1));
    let mut dst = [0u8; 100];
    // a reader holding the old location is refused, never given b's bytes
    let stale = ReadExpect { slot: old.slot, epoch: old.epoch, key: KeyId::of("a") };
    assert_eq!(c.heap().read_object(&stale, &mut dst), Err(GpuError::Stale));
    // right epoch, wrong key identity: refused too
    let wrong_key = ReadExpect { slot: new.slot, epoch: new.epoch, key: KeyId::of("a") };
    assert_eq!(c.heap().read_object(&wrong_key, &mut dst), Err(GpuError::Stale));
    assert_eq!(dst, [0u8; 100]);
    // the refcount is balanced after refused reads
    let rc = c.heap().load_u32(new.slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap();
    assert_eq!(rc, 0);
    assert_eq!(c.get("b").unwrap(), vec![2u8; 100]);
}

#[test]
fn heap_bounds_are_checked() {
    let heap = HostHeap::new(2, 1 << 20).unwrap();
    assert!(matches!(heap.read_header(2), Err(GpuError::OutOfBounds(_))));
    assert!(heap.load_u32(9, HeaderU32Field::State, Ordering::Acquire).is_err());
    let span = PageSpan::new((1 << 20) - 4096, 8192, 4096).unwrap();
    assert!(matches!(heap.write_pages(&span, 0, &[0u8; 8192]), Err(GpuError::OutOfBounds(_))));
    let span = PageSpan::new(u64::MAX - 10, 8192, 4096).unwrap();
    assert!(heap.read_pages(&span, 0, &mut [0u8; 8192]).is_err());
    let ok = PageSpan::new(0, 8192, 4096).unwrap();
    assert_eq!(heap.write_pages(&ok, 0, &[5u8; 8192]).unwrap(), 2);
    assert_eq!(heap.write_pages(&ok, 2, &[5u8; 1]).map_err(|_| ()), Err(()));
    heap.store_u64(0, HeaderU64Field::LastAccess, 42, Ordering::Release).unwrap();
    assert_eq!(heap.read_header(0).unwrap().last_access, 42);
}

#[test]
fn touch_bumps_last_access() {
    let c = cache(64 << 10, 4, 1 << 20);
    c.put("t", &[0u8; 10]).unwrap();
    let m = c.get_location("t").unwrap();
    let before = c.heap().read_header(m.slot).unwrap().last_access;
    std::thread::sleep(std::time::Duration::from_millis(2));
    c.touch("t").unwrap();
    let after = c.heap().read_header(m.slot).unwrap().last_access;
    assert!(after > before);
}

/// A plan's fields are public (a plan may come from another owner): one naming a
/// slot past the heap is refused as stale by `commit` and `abort`, never a panic,
/// and the real reservation is untouched.
#[test]
fn a_plan_with_a_slot_out_of_range_is_stale_not_a_panic() {
    let c = cache(4096, 4, 1 << 20);
    let plan = c.open_for_write("k", 10).unwrap();
    let mut forged = plan;
    for slot in [4, 64, u32::MAX] {
        forged.slot = slot;
        assert!(matches!(c.commit(&forged), Err(GpuError::Stale)), "commit of slot {slot}");
        assert!(matches!(c.abort(&forged), Err(GpuError::Stale)), "abort of slot {slot}");
    }
    c.write(&plan, 0, b"0123456789").unwrap();
    c.commit(&plan).unwrap();
    assert_eq!(c.get("k").unwrap(), b"0123456789");
}

/// An object of more pages than one CUDA launch covers (65,535) is refused with a
/// clear error at reservation, on the host heap as on a GPU; one of exactly that many
/// is stored.
#[test]
fn an_object_of_more_than_65535_pages_is_refused_at_reservation() {
    assert_eq!(PageSpan::MAX_PAGES, 65_535);
    let c = cache(256, 4, 32 << 20);
    let err = c.open_for_write("big", 65_536 * 256).unwrap_err();
    assert!(matches!(&err, GpuError::InvalidArgument(m) if m.contains("65535")), "{err}");
    let value = pattern(3, 65_535 * 256);
    c.put("most", &value).unwrap();
    assert!(c.get("most").unwrap() == value);
}
