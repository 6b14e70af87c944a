//! Concurrent get vs evict/remove/re-put: the refcount protocol prevents
//! tearing (a reader never sees bytes of another object or of another version)
//! and eviction skips pinned objects.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_gpu::{
    CacheConfig, DeviceHeap, GpuError, HeaderSnapshot, HeaderU32Field, HostHeap, KeyId, NanoKvCache, ObjectState,
    PageSpan, ReadExpect, RetireOutcome,
};

/// Word `w` of version `gen` of key `k`: every word names its object.
fn word(k: u64, gen: u64, w: u64) -> u64 {
    (k << 48) | ((gen & 0xFF_FFFF) << 24) | (w & 0xFF_FFFF)
}

fn value(k: u64, gen: u64, words: usize) -> Vec<u8> {
    (0..words as u64).flat_map(|w| word(k, gen, w).to_ne_bytes()).collect()
}

/// Checks that `v` is entirely version `gen` (taken from word 0) of key `k`.
fn check(k: u64, v: &[u8]) -> Result<u64, String> {
    if v.is_empty() || !v.len().is_multiple_of(8) {
        return Err(format!("odd length {}", v.len()));
    }
    let w0 = u64::from_ne_bytes(v[..8].try_into().unwrap());
    let gen = (w0 >> 24) & 0xFF_FFFF;
    for (i, c) in v.chunks_exact(8).enumerate() {
        let got = u64::from_ne_bytes(c.try_into().unwrap());
        let want = word(k, gen, i as u64);
        if got != want {
            return Err(format!("torn read of key {k} gen {gen}: word {i} = {got:#x}, want {want:#x}"));
        }
    }
    Ok(gen)
}

#[test]
fn concurrent_get_vs_evict_remove_reput_never_tears() {
    const KEYS: u64 = 24;
    let heap = Arc::new(HostHeap::new(32, 256 << 10).unwrap());
    let c = Arc::new(
        NanoKvCache::new(
            heap,
            CacheConfig { page_size: 4096, high_watermark: 0.9, low_watermark: 0.6, ..Default::default() },
        )
        .unwrap(),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let gen = Arc::new(AtomicU64::new(1));
    let reads_ok = Arc::new(AtomicU64::new(0));
    let mut threads = vec![];

    // writers: remove + re-put with a new version, sizes 1..12 pages
    for t in 0..2u64 {
        let (c, stop, gen) = (c.clone(), stop.clone(), gen.clone());
        threads.push(std::thread::spawn(move || {
            let mut x = 0x1234_5678u64 + t;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let k = x % KEYS;
                let key = format!("k{k}");
                let _ = c.remove(&key);
                let g = gen.fetch_add(1, Ordering::Relaxed);
                let words = 1 + (x >> 20) as usize % (12 * 512);
                match c.put(&key, &value(k, g, words)) {
                    Ok(()) | Err(GpuError::AlreadyExists) | Err(GpuError::NoSpace { .. }) => {}
                    Err(GpuError::NoHeaderSlot { .. }) => {}
                    // the other writer removed our unfinished put
                    Err(GpuError::Stale) => {}
                    Err(e) => panic!("put: {e:?}"),
                }
            }
        }));
    }
    // evictor
    {
        let (c, stop) = (c.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                c.evict_until_below(0.3);
                std::thread::yield_now();
            }
        }));
    }
    // readers
    let mut readers = vec![];
    for t in 0..3u64 {
        let (c, stop, ok) = (c.clone(), stop.clone(), reads_ok.clone());
        readers.push(std::thread::spawn(move || -> Result<(), String> {
            let mut x = 0xdead_beefu64 + t;
            while !stop.load(Ordering::Relaxed) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let k = x % KEYS;
                match c.get(&format!("k{k}")) {
                    Ok(v) => {
                        check(k, &v)?;
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(GpuError::NotFound | GpuError::NotReady | GpuError::Stale) => {}
                    Err(e) => return Err(format!("get: {e:?}")),
                }
            }
            Ok(())
        }));
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    for r in readers {
        r.join().unwrap().unwrap();
    }
    let s = c.stats();
    eprintln!("reads ok {}, stats {s:?}", reads_ok.load(Ordering::Relaxed));
    assert!(reads_ok.load(Ordering::Relaxed) > 50);
    assert!(s.evict_count > 0);
    // every header's refcount is back to zero
    for slot in 0..c.heap().header_slots() {
        let rc = c.heap().load_u32(slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap();
        assert_eq!(rc, 0, "slot {slot}");
    }
}

/// Drives the heap protocol directly, the way a device evictor/producer pair
/// would: retire the object, overwrite its pages with the next version in
/// place, republish with a new epoch. Readers that asked for epoch `e` must get
/// exactly version `e` or be refused, never a mix.
#[test]
fn retire_and_reuse_in_place_never_tears_readers() {
    const WORDS: usize = 16 * 1024; // 128 KiB, 4 pages of 32 KiB
    let heap = Arc::new(HostHeap::new(1, 256 << 10).unwrap());
    let key = KeyId::of("obj");
    let span = PageSpan::new(0, (WORDS * 8) as u64, 32 << 10).unwrap();
    let header = move |epoch: u32, state: ObjectState| HeaderSnapshot {
        key_hash: key.hash,
        key_fp_hi: key.fp_hi,
        key_len: key.len,
        header_version: 1,
        payload_base: 0,
        bytes_total: span.bytes_total,
        page_size: span.page_size,
        n_pages: span.n_pages,
        last_page_bytes: span.last_page_bytes,
        epoch,
        state: state as u32,
        ..Default::default()
    };
    heap.write_header(0, &header(1, ObjectState::Writing)).unwrap();
    heap.write_pages(&span, 0, &value(7, 1, WORDS)).unwrap();
    heap.publish(0, 1, 0).unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let pinned_skips = Arc::new(AtomicU64::new(0));
    let epochs_done = Arc::new(AtomicU64::new(0));
    let reads_done = Arc::new(AtomicU64::new(0));
    let writer = {
        let (heap, stop, skips) = (heap.clone(), stop.clone(), pinned_skips.clone());
        let epochs_done = epochs_done.clone();
        std::thread::spawn(move || {
            let mut epoch = 1u32;
            while !stop.load(Ordering::Relaxed) {
                match heap.retire(0, ObjectState::Ready, 0).unwrap() {
                    RetireOutcome::Retired => {
                        epoch += 1;
                        heap.write_header(0, &header(epoch, ObjectState::Writing)).unwrap();
                        heap.write_pages(&span, 0, &value(7, u64::from(epoch), WORDS)).unwrap();
                        heap.publish(0, epoch, 0).unwrap();
                        epochs_done.store(u64::from(epoch), Ordering::Relaxed);
                    }
                    RetireOutcome::Pinned(_) => {
                        skips.fetch_add(1, Ordering::Relaxed);
                        std::thread::yield_now();
                    }
                    RetireOutcome::StateChanged(s) => panic!("unexpected state {s}"),
                }
            }
            epoch
        })
    };
    let mut readers = vec![];
    for _ in 0..2 {
        let (heap, stop, reads_done) = (heap.clone(), stop.clone(), reads_done.clone());
        readers.push(std::thread::spawn(move || -> Result<u64, String> {
            let mut ok = 0;
            let mut dst = vec![0u8; WORDS * 8];
            while !stop.load(Ordering::Relaxed) {
                let epoch = heap.read_header(0).unwrap().epoch;
                let expect = ReadExpect { slot: 0, epoch, key };
                match heap.read_object(&expect, &mut dst) {
                    Ok(n) => {
                        assert_eq!(n as usize, WORDS * 8);
                        let g = check(7, &dst)?;
                        if g != u64::from(epoch) {
                            return Err(format!("asked for epoch {epoch}, got version {g}"));
                        }
                        ok += 1;
                        reads_done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(GpuError::Stale | GpuError::NotReady) => {}
                    Err(e) => return Err(format!("{e:?}")),
                }
            }
            Ok(ok)
        }));
    }
    // run at least 1 s, until both sides made progress (at most 20 s)
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20)
        && (start.elapsed() < Duration::from_secs(1)
            || reads_done.load(Ordering::Relaxed) < 20
            || epochs_done.load(Ordering::Relaxed) < 20)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let epochs = writer.join().unwrap();
    let mut ok = 0;
    for r in readers {
        ok += r.join().unwrap().unwrap();
    }
    eprintln!("epochs {epochs}, good reads {ok}, retire skipped (pinned) {}", pinned_skips.load(Ordering::Relaxed));
    assert!(ok >= 20, "readers made no progress");
    assert!(epochs >= 20, "writer made no progress");
    assert_eq!(heap.load_u32(0, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst).unwrap(), 0);
}

#[test]
fn evictor_never_takes_an_object_a_reader_holds() {
    // A reader thread holds objects pinned (as a long device copy would) while
    // the evictor runs flat out; pinned objects survive, then go once released.
    let heap = Arc::new(HostHeap::new(16, 16 * 4096).unwrap());
    let c = Arc::new(NanoKvCache::new(heap, CacheConfig { page_size: 4096, ..Default::default() }).unwrap());
    for i in 0..16u64 {
        c.put(&format!("k{i}"), &value(i, 1, 512)).unwrap();
    }
    let pinned: Vec<u32> = [3u64, 9, 15]
        .iter()
        .map(|i| {
            let m = c.get_location(&format!("k{i}")).unwrap();
            c.heap().fetch_add_u32(m.slot, HeaderU32Field::ReaderRefcnt, 1).unwrap();
            m.slot
        })
        .collect();
    let evictors: Vec<_> = (0..2)
        .map(|_| {
            let c = c.clone();
            std::thread::spawn(move || {
                for _ in 0..200 {
                    c.evict_until_below(0.0);
                }
            })
        })
        .collect();
    for e in evictors {
        e.join().unwrap();
    }
    assert_eq!(c.keys_fifo(), vec!["k3", "k9", "k15"]);
    for i in [3u64, 9, 15] {
        check(i, &c.get(&format!("k{i}")).unwrap()).unwrap();
    }
    for s in pinned {
        c.heap().fetch_add_u32(s, HeaderU32Field::ReaderRefcnt, -1).unwrap();
    }
    assert_eq!(c.evict_until_below(0.0), 3);
}
