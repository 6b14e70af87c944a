//! Copies into the pool with non-temporal (streaming) stores.
//!
//! A put's bytes land in a segment that this core will not read again soon (the
//! next reader is another process, or a peer over the network). An ordinary copy
//! first reads every destination line into the cache (read-for-ownership), then
//! writes it back and evicts what the cache held: twice the memory traffic on the
//! destination side. Streaming stores write whole lines straight to memory. On the
//! development VM (AMD EPYC, AVX2) a 1 and a 4 MiB copy into cold memory ran at 25
//! GB/s with them against 19 GB/s with `memcpy` (glibc switches to streaming stores
//! only above a threshold derived from the cache size: 288 MiB there, tens of MiB on
//! most hosts, far above a KV block).
//!
//! Used where bytes are written into a registered region from this process
//! ([`RegisteredRegion::copy_in`](crate::region::RegisteredRegion)): the local and
//! shared-memory transports' writes.

/// Copies of at least this many bytes stream; smaller ones are cheaper as plain
/// copies (the destination may be read again soon, and the fence costs more than
/// it saves).
pub(crate) const STREAM_FROM: usize = 256 << 10;

/// Copies `len` bytes from `src` to `dst`: with streaming stores when `len >=
/// STREAM_FROM` and the CPU has them (x86-64 with AVX2, checked at run time), else
/// with [`std::ptr::copy_nonoverlapping`]. The streaming stores are fenced before
/// it returns: whatever this thread does next (answering a put, telling a peer) is
/// seen after the bytes.
///
/// # Safety
///
/// As [`std::ptr::copy_nonoverlapping`]: `src` valid for reads and `dst` for writes
/// of `len` bytes, the two not overlapping.
pub(crate) unsafe fn copy_to_pool(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { copy_streaming_from(src, dst, len, STREAM_FROM) }
}

/// Bytes copied, then summed while still in this core's cache, at a time by
/// [`copy_to_pool_summed`]: small enough for the first level of the cache, large
/// enough that the sum's per-call cost is nothing (measured on the VM, 4 MiB: 18.7
/// GB/s in pieces of 16 KiB, 15.9 of 4 KiB, 16.7 of 64 KiB; summing first, then
/// streaming the whole: 15-17).
const SUMMED_PIECE: usize = 16 << 10;

/// [`copy_to_pool`] that also gives the crc32c of the bytes: each piece is summed
/// right after it is copied, from the cache its copy just read it into, instead of
/// in a pass of its own over the source.
///
/// # Safety
///
/// As [`copy_to_pool`].
pub(crate) unsafe fn copy_to_pool_summed(src: *const u8, dst: *mut u8, len: usize) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { copy_summed_streaming_from(src, dst, len, STREAM_FROM) }
}

/// [`copy_to_pool_summed`] streaming from `min` bytes on (tests take every length).
///
/// # Safety
///
/// As [`copy_to_pool`].
pub(crate) unsafe fn copy_summed_streaming_from(src: *const u8, dst: *mut u8, len: usize, min: usize) -> u32 {
    // SAFETY: `src` is valid for reads of `len` bytes and not written meanwhile (the
    // caller's contract: it is only read here).
    let bytes = unsafe { std::slice::from_raw_parts(src, len) };
    #[cfg(target_arch = "x86_64")]
    if len >= min && std::arch::is_x86_feature_detected!("avx2") {
        let mut digest = crate::checksum::Crc32cDigest::new();
        let mut at = 0;
        while at < len {
            let n = SUMMED_PIECE.min(len - at);
            // SAFETY: AVX2 was detected; `[at, at + n)` lies in both ranges.
            unsafe { x86::stream_unfenced(src.add(at), dst.add(at), n) };
            digest.update(&bytes[at..at + n]);
            at += n;
        }
        x86::fence();
        return digest.finish();
    }
    let _ = min;
    let crc = crate::checksum::crc32c(bytes);
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    crc
}

/// [`copy_to_pool`] streaming from `min` bytes on (tests take every length).
///
/// # Safety
///
/// As [`copy_to_pool`].
pub(crate) unsafe fn copy_streaming_from(src: *const u8, dst: *mut u8, len: usize, min: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= min && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected on this CPU; the ranges are the caller's.
        unsafe { x86::stream(src, dst, len) };
        return;
    }
    let _ = min;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::{__m256i, _mm256_loadu_si256, _mm256_stream_si256, _mm_sfence};

    /// Bytes per step of the loop: four 32-byte vectors.
    const STEP: usize = 128;

    /// The streaming copy, then a fence.
    ///
    /// # Safety
    ///
    /// As [`stream_unfenced`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: the caller's contract.
        unsafe { stream_unfenced(src, dst, len) };
        fence();
    }

    /// Orders every streaming store before this thread's later stores: whoever
    /// learns of the bytes from it (a put's answer) then sees them.
    pub(super) fn fence() {
        // SAFETY: `sfence` (SSE, part of x86-64) has no operands and no
        // precondition.
        unsafe { _mm_sfence() };
    }

    /// The streaming copy without its fence: plain copies up to the first 32-byte
    /// aligned destination byte and after the last whole step, streamed vectors
    /// between. The caller fences ([`fence`]) before the bytes are announced.
    ///
    /// # Safety
    ///
    /// AVX2 is available; `src` valid for reads and `dst` for writes of `len` bytes,
    /// not overlapping.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream_unfenced(src: *const u8, dst: *mut u8, len: usize) {
        let head = dst.align_offset(32).min(len);
        // SAFETY: `head <= len`: inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) / STEP * STEP;
        let mut at = head;
        while at < head + body {
            // SAFETY: `at + STEP <= head + body <= len`: inside both ranges; the loads
            // are unaligned loads, the stores go to `dst + at`, 32-byte aligned
            // (`dst + head` is, and `at - head` is a multiple of STEP).
            unsafe {
                let (s, d) = (src.add(at), dst.add(at));
                let a = _mm256_loadu_si256(s.cast::<__m256i>());
                let b = _mm256_loadu_si256(s.add(32).cast::<__m256i>());
                let c = _mm256_loadu_si256(s.add(64).cast::<__m256i>());
                let e = _mm256_loadu_si256(s.add(96).cast::<__m256i>());
                _mm256_stream_si256(d.cast::<__m256i>(), a);
                _mm256_stream_si256(d.add(32).cast::<__m256i>(), b);
                _mm256_stream_si256(d.add(64).cast::<__m256i>(), c);
                _mm256_stream_si256(d.add(96).cast::<__m256i>(), e);
            }
            at += STEP;
        }
        // SAFETY: `at <= len`: the rest of both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) };
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Every byte of the range, and none around it, whatever the alignment of
        /// either side and the length (the streaming path from 0 bytes on).
        #[test]
        fn a_streaming_copy_is_a_copy(len in 0usize..5000, src_at in 0usize..64, dst_at in 0usize..64, seed: u8) {
            let src: Vec<u8> = (0..len + src_at).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
            let mut dst = vec![0xA5u8; len + dst_at + 64];
            // SAFETY: both ranges lie inside their vectors, which do not overlap.
            unsafe { copy_streaming_from(src.as_ptr().add(src_at), dst.as_mut_ptr().add(dst_at), len, 0) };
            prop_assert_eq!(&dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert!(dst[..dst_at].iter().chain(&dst[dst_at + len..]).all(|&b| b == 0xA5));
        }
    }

    proptest! {
        /// The summed copy is the copy, and its sum the crc32c of the bytes, over
        /// pieces, alignments and lengths (the streaming path from 0 bytes on).
        #[test]
        fn a_summed_streaming_copy_is_a_copy_and_its_sum(len in 0usize..(3 * SUMMED_PIECE), src_at in 0usize..64, dst_at in 0usize..64, seed: u8) {
            let src: Vec<u8> = (0..len + src_at).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect();
            let mut dst = vec![0x5Au8; len + dst_at + 64];
            // SAFETY: both ranges lie inside their vectors, which do not overlap.
            let crc = unsafe { copy_summed_streaming_from(src.as_ptr().add(src_at), dst.as_mut_ptr().add(dst_at), len, 0) };
            prop_assert_eq!(crc, crate::checksum::crc32c(&src[src_at..]));
            prop_assert_eq!(&dst[dst_at..dst_at + len], &src[src_at..]);
            prop_assert!(dst[..dst_at].iter().chain(&dst[dst_at + len..]).all(|&b| b == 0x5A));
        }
    }

    #[test]
    fn a_large_copy_into_the_pool_is_a_copy() {
        let src: Vec<u8> = (0..(STREAM_FROM * 3 + 77)).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len() + 3];
        // SAFETY: inside both vectors.
        unsafe { copy_to_pool(src.as_ptr(), dst.as_mut_ptr().add(3), src.len()) };
        assert!(dst[3..] == src[..] && dst[..3] == [0, 0, 0]);
        let mut again = vec![0u8; src.len()];
        // SAFETY: inside both vectors.
        let crc = unsafe { copy_to_pool_summed(src.as_ptr(), again.as_mut_ptr(), src.len()) };
        assert!(again == src && crc == crate::checksum::crc32c(&src));
    }
}
