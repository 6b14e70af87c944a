//! The budgeted decoders (`rpc::budget`) on arbitrary bytes under arbitrary bounds:
//! they never panic; what they accept is within its bounds and decodes as postcard
//! alone would (and what they find malformed, postcard does too); every byte charged goes
//! back to the pool; and what decoding allocates, accepted or refused, stays within
//! the byte bound plus the 1 MiB serde reserves ahead for each open sequence
//! (counted here by the global allocator).
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::budget::{decode, heap_block, DecodeError, DecodeLimits, DecodePool, PoolAccess};
use mooncake_core::rpc::wire::{decode_request, Request, Response};

/// Bytes allocated and not freed, and the most since the last reset.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

fn grow(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call goes to the system allocator unchanged; only counts are kept.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grow(heap_block(layout.size()));
        // SAFETY: the caller's contract is passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(heap_block(layout.size()), Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grow(heap_block(new_size));
        // SAFETY: the caller's contract is passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        LIVE.fetch_sub(heap_block(layout.size()), Ordering::Relaxed);
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Serde reserves up to 1 MiB ahead for each sequence it decodes (three deep at
/// most in these messages), and error messages take a little.
const SLACK: usize = 3 * (1 << 20) + (16 << 10);

/// Runs `f`; the most bytes held at once while it ran, above those held before.
fn peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let out = f();
    (out, PEAK.load(Ordering::Relaxed).saturating_sub(base))
}

/// A message as compared: its encoding (a decoded float may be NaN, which `==`
/// never equals).
fn same<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    postcard::to_allocvec(msg).expect("a decoded message encodes")
}

fuzz_target!(|data: &[u8]| {
    // Two bytes of bounds, one of pool, then the body.
    let [items, bytes, pool_kib, body @ ..] = data else { return };
    let limits = DecodeLimits { max_items: usize::from(*items) * 4, max_bytes: usize::from(*bytes) << 10 };
    let pool = DecodePool::new(usize::from(*pool_kib) << 12);
    let access = Some(PoolAccess { pool: &pool, wait: None });

    let (request, peak) =
        peak_of(|| decode_request(body, limits, access).map(|(r, held)| (r, held.items(), held.charged())));
    assert!(peak <= limits.max_bytes + SLACK, "request: {peak} bytes held under {limits:?}");
    match request {
        Ok((request, items, charged)) => {
            assert!(items <= limits.max_items && charged <= limits.max_bytes);
            assert!(charged <= pool.limit(), "the pool lent {charged} of {}", pool.limit());
            let plain: Request = postcard::from_bytes(body).expect("postcard alone decodes it too");
            assert_eq!(same(&plain), same(&request));
        }
        Err(DecodeError::Malformed(_)) => assert!(postcard::from_bytes::<Request>(body).is_err()),
        Err(DecodeError::OverBudget(_) | DecodeError::Busy { .. }) => {}
    }
    assert_eq!(pool.in_use(), 0, "a request's bytes went back");

    let (response, peak) = peak_of(|| decode::<Response>(body, limits, access).map(|(r, held)| (r, held.charged())));
    assert!(peak <= limits.max_bytes + SLACK, "response: {peak} bytes held under {limits:?}");
    if let Ok((response, charged)) = response {
        assert!(charged <= limits.max_bytes);
        let plain: Response = postcard::from_bytes(body).expect("postcard alone decodes it too");
        assert_eq!(same(&plain), same(&response));
    }
    assert_eq!(pool.in_use(), 0, "a response's bytes went back");
});
