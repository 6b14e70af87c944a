//! How many header / page operations a put and a reservation cost. On a CUDA
//! heap each one is at least one host <-> device synchronization (a kernel or a
//! copy, then a stream sync), so their count is the fixed cost of a put that
//! this machine can check without a GPU. (The time each one takes on a GPU is
//! to be measured there: `gpu_sweep`.)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_gpu::{
    CacheConfig, DeviceHeap, HeaderSnapshot, HeaderU32Field, HeaderU64Field, HostHeap, NanoKvCache, PageSpan, Result,
};

/// A [`HostHeap`] that counts the calls a CUDA heap would synchronize for.
struct Counting {
    inner: HostHeap,
    ops: AtomicU64,
    epoch_loads: AtomicU64,
}

impl Counting {
    fn tick(&self) {
        self.ops.fetch_add(1, Ordering::Relaxed);
    }
}

impl DeviceHeap for Counting {
    fn header_slots(&self) -> u32 {
        self.inner.header_slots()
    }
    fn payload_capacity(&self) -> u64 {
        self.inner.payload_capacity()
    }
    fn header_addr(&self, slot: u32) -> u64 {
        self.inner.header_addr(slot)
    }
    fn payload_addr(&self, offset: u64) -> u64 {
        self.inner.payload_addr(offset)
    }
    fn read_header(&self, slot: u32) -> Result<HeaderSnapshot> {
        self.tick();
        self.inner.read_header(slot)
    }
    fn write_header(&self, slot: u32, h: &HeaderSnapshot) -> Result<()> {
        self.tick();
        self.inner.write_header(slot, h)
    }
    fn load_u32(&self, slot: u32, f: HeaderU32Field, order: Ordering) -> Result<u32> {
        self.tick();
        if f == HeaderU32Field::Epoch {
            self.epoch_loads.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.load_u32(slot, f, order)
    }
    fn store_u32(&self, slot: u32, f: HeaderU32Field, v: u32, order: Ordering) -> Result<()> {
        self.tick();
        self.inner.store_u32(slot, f, v, order)
    }
    fn compare_exchange_u32(
        &self,
        slot: u32,
        f: HeaderU32Field,
        current: u32,
        new: u32,
    ) -> Result<std::result::Result<u32, u32>> {
        self.tick();
        self.inner.compare_exchange_u32(slot, f, current, new)
    }
    fn fetch_add_u32(&self, slot: u32, f: HeaderU32Field, delta: i32) -> Result<u32> {
        self.tick();
        self.inner.fetch_add_u32(slot, f, delta)
    }
    fn load_u64(&self, slot: u32, f: HeaderU64Field, order: Ordering) -> Result<u64> {
        self.tick();
        self.inner.load_u64(slot, f, order)
    }
    fn store_u64(&self, slot: u32, f: HeaderU64Field, v: u64, order: Ordering) -> Result<()> {
        self.tick();
        self.inner.store_u64(slot, f, v, order)
    }
    fn write_pages(&self, span: &PageSpan, first_page: u32, src: &[u8]) -> Result<u32> {
        self.tick();
        self.inner.write_pages(span, first_page, src)
    }
    fn read_pages(&self, span: &PageSpan, first_page: u32, dst: &mut [u8]) -> Result<u32> {
        self.tick();
        self.inner.read_pages(span, first_page, dst)
    }
}

fn counting(slots: u32) -> Arc<Counting> {
    Arc::new(Counting {
        inner: HostHeap::new(slots, 1 << 20).unwrap(),
        ops: AtomicU64::new(0),
        epoch_loads: AtomicU64::new(0),
    })
}

#[test]
fn a_reservation_is_one_header_write() {
    let heap = counting(4);
    let cache = NanoKvCache::new(heap.clone(), CacheConfig { page_size: 4096, ..Default::default() }).unwrap();
    let before = heap.ops.load(Ordering::Relaxed);
    let plan = cache.open_for_write("k", 10_000).unwrap();
    // Was 3 operations (epoch load, header write, WRITING store) and 4
    // synchronizations on a CUDA heap; now one header write.
    assert_eq!(heap.ops.load(Ordering::Relaxed) - before, 1, "one header write per reservation");
    // The slot is WRITING at once: the host producer accepts it and readers wait.
    assert!(matches!(cache.get_location("k"), Err(mooncake_gpu::GpuError::NotReady)));
    cache.write(&plan, 0, &[5u8; 10_000]).unwrap();
    cache.commit(&plan).unwrap();
    assert_eq!(cache.get("k").unwrap(), vec![5u8; 10_000]);
}

#[test]
fn epochs_come_from_the_caches_record_and_still_advance() {
    let heap = counting(1);
    let cfg = CacheConfig { page_size: 4096, ..Default::default() };
    let cache = NanoKvCache::new(heap.clone(), cfg.clone()).unwrap();
    let loads = heap.epoch_loads.load(Ordering::Relaxed);
    let mut last = None;
    for i in 0..5 {
        // One slot: every put reuses it, with a new epoch each time.
        let key = format!("k{i}");
        cache.put(&key, &[i as u8; 100]).unwrap();
        let e = cache.get_location(&key).unwrap().epoch;
        assert!(last.is_none_or(|l: u32| e == l.wrapping_add(1)), "epoch {e} after {last:?}");
        last = Some(e);
        cache.remove(&key).unwrap();
    }
    // The puts' epoch checks (in `write` and `publish`) still read the device;
    // reservations do not.
    let per_put = (heap.epoch_loads.load(Ordering::Relaxed) - loads) / 5;
    assert!(per_put <= 2, "{per_put} epoch loads per put");
    // A new cache over the same heap continues from the header's epoch: a stale
    // location of the old cache can never match a new object.
    drop(cache);
    let cache = NanoKvCache::new(heap.clone(), cfg).unwrap();
    cache.put("again", &[1u8; 100]).unwrap();
    assert_eq!(cache.get_location("again").unwrap().epoch, last.unwrap().wrapping_add(1));
}
