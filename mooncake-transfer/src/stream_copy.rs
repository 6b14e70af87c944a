//! Copies into and out of the pool: non-temporal (streaming) stores for writes, and
//! the crc32c taken on the way.
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
//!
//! A copy that must also give the bytes' crc32c folds it into the copy where the CPU
//! can (AVX-512 with `vpclmulqdq`, [`copies_fold_checksums`]): each 64-byte vector
//! loaded is stored and multiplied into a running remainder while it is in a
//! register, the carry-less products hidden behind the memory traffic. On the VM a 4
//! MiB copy into cold memory took 118 µs so, 115 µs without any sum, and 164 µs
//! summing each 16 KiB piece right after its copy (the way without the kernel; a
//! crc32c alone, from the cache, takes 66 µs).

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
    #[cfg(target_arch = "x86_64")]
    if x86::has_folding_copy() {
        // SAFETY: the CPU has the kernel's instructions (checked); the ranges are
        // the caller's.
        return unsafe {
            if len >= min {
                let crc = x86::copy_folded::<true>(src, dst, len);
                x86::fence();
                crc
            } else {
                x86::copy_folded::<false>(src, dst, len)
            }
        };
    }
    #[cfg(target_arch = "x86_64")]
    if len >= min && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 was detected; the ranges are the caller's.
        return unsafe { x86::stream_summed_in_pieces(src, dst, len) };
    }
    let _ = min;
    // SAFETY: `src` is valid for reads of `len` bytes and not written meanwhile (the
    // caller's contract: it is only read here).
    let crc = crate::checksum::crc32c(unsafe { std::slice::from_raw_parts(src, len) });
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
    crc
}

/// Copies `len` bytes out of the pool (a get's bytes, into memory its caller reads
/// next: ordinary stores) and gives their crc32c: folded in on the way where the CPU
/// can ([`copies_fold_checksums`]), else each piece of [`OUT_PIECE`] bytes summed
/// right after its copy, while it is in the cache.
///
/// # Safety
///
/// As [`copy_to_pool`].
pub(crate) unsafe fn copy_out_summed(src: *const u8, dst: *mut u8, len: usize) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if x86::has_folding_copy() {
        // SAFETY: the CPU has the kernel's instructions (checked); the ranges are
        // the caller's.
        return unsafe { x86::copy_folded::<false>(src, dst, len) };
    }
    // SAFETY: the caller's contract.
    unsafe { copy_out_summed_in_pieces(src, dst, len) }
}

/// Pieces of a get copied, then summed while they are in a core's second-level
/// cache, where the CPU cannot fold the sum into the copy.
const OUT_PIECE: usize = 256 << 10;

/// [`copy_out_summed`] piece by piece, without the folding kernel.
///
/// # Safety
///
/// As [`copy_to_pool`].
unsafe fn copy_out_summed_in_pieces(src: *const u8, dst: *mut u8, len: usize) -> u32 {
    let mut digest = crate::checksum::Crc32cDigest::new();
    let mut at = 0;
    while at < len {
        let n = OUT_PIECE.min(len - at);
        // SAFETY: `[at, at + n)` lies in both ranges (the caller's contract); the
        // destination piece was just written by this thread and is read only here.
        digest.update(unsafe {
            std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n);
            std::slice::from_raw_parts(dst.add(at), n)
        });
        at += n;
    }
    digest.finish()
}

/// Whether this CPU's copies in and out of the pool take their crc32c at no cost
/// beyond the copy (AVX-512 with carry-less multiplication, `vpclmulqdq`: the sum is
/// folded into the copy, register by register). Without it a sum taken on the way
/// costs a second pass over the bytes in cache.
pub fn copies_fold_checksums() -> bool {
    #[cfg(target_arch = "x86_64")]
    return x86::has_folding_copy();
    #[cfg(not(target_arch = "x86_64"))]
    false
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
    use std::arch::x86_64::{
        __m128i, __m256i, __m512i, _mm256_loadu_si256, _mm256_stream_si256, _mm512_broadcast_i32x4,
        _mm512_castsi512_si128, _mm512_clmulepi64_epi128, _mm512_extracti32x4_epi32, _mm512_loadu_si512,
        _mm512_store_si512, _mm512_stream_si512, _mm512_ternarylogic_epi64, _mm512_xor_si512, _mm512_zextsi128_si512,
        _mm_clmulepi64_si128, _mm_crc32_u64, _mm_crc32_u8, _mm_cvtsi128_si64, _mm_cvtsi32_si128, _mm_extract_epi64,
        _mm_set_epi64x, _mm_sfence, _mm_xor_si128,
    };

    use super::SUMMED_PIECE;
    use crate::checksum::fold_factors;

    /// Bytes per step of the folding copy: two 64-byte vectors, each folded on its own
    /// (two carry-less products in flight hide each other's latency).
    const FOLD_STEP: usize = 128;
    /// The factors that fold a vector one step (1024 bits) along.
    const STEP_FACTORS: (u64, u64) = fold_factors(8 * FOLD_STEP as u64);
    /// The factors that fold a 128-bit lane onto the next (128 bits along).
    const LANE_FACTORS: (u64, u64) = fold_factors(128);

    /// Whether this CPU runs [`copy_folded`]: AVX-512 with its carry-less
    /// multiplication (`vpclmulqdq`), and the `crc32` instruction (SSE 4.2).
    pub(super) fn has_folding_copy() -> bool {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("vpclmulqdq")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
            && std::arch::is_x86_feature_detected!("sse4.2")
    }

    /// A pair of fold factors as one 128-bit lane: the first in its low half (it
    /// multiplies a lane's low half), the second in its high half.
    fn factors((first, second): (u64, u64)) -> __m128i {
        // SAFETY: SSE2, part of x86-64.
        unsafe { _mm_set_epi64x(second as i64, first as i64) }
    }

    /// Stores `v` at `dst`, 64-byte aligned: a streaming store with `STREAM`.
    ///
    /// # Safety
    ///
    /// AVX-512 is available; `dst` is 64-byte aligned and valid for 64 bytes of writes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn store<const STREAM: bool>(dst: *mut u8, v: __m512i) {
        // SAFETY: the caller's contract.
        unsafe {
            if STREAM {
                _mm512_stream_si512(dst.cast::<__m512i>(), v)
            } else {
                _mm512_store_si512(dst.cast::<__m512i>(), v)
            }
        }
    }

    /// Copies `len` bytes with streaming stores, fenced, and gives their crc32c:
    /// each piece of [`SUMMED_PIECE`] bytes summed right after it is copied, from the
    /// first level of the cache its copy read it into (CPUs without the folding
    /// kernel).
    ///
    /// # Safety
    ///
    /// As [`stream_unfenced`].
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn stream_summed_in_pieces(src: *const u8, dst: *mut u8, len: usize) -> u32 {
        // SAFETY: `src` is valid for reads of `len` bytes (the caller's contract).
        let bytes = unsafe { std::slice::from_raw_parts(src, len) };
        let mut digest = crate::checksum::Crc32cDigest::new();
        let mut at = 0;
        while at < len {
            let n = SUMMED_PIECE.min(len - at);
            // SAFETY: `[at, at + n)` lies in both ranges.
            unsafe { stream_unfenced(src.add(at), dst.add(at), n) };
            digest.update(&bytes[at..at + n]);
            at += n;
        }
        fence();
        digest.finish()
    }

    /// The crc32c state (not inverted) after `bytes`, from `state`, one byte or
    /// eight at a time with the `crc32` instruction: the few bytes around the
    /// folding copy's aligned body.
    ///
    /// # Safety
    ///
    /// SSE 4.2 is available.
    #[target_feature(enable = "sse4.2")]
    unsafe fn crc_bytes(mut state: u32, bytes: &[u8]) -> u32 {
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            let w = u64::from_le_bytes(w.try_into().unwrap_or_default());
            state = _mm_crc32_u64(u64::from(state), w) as u32;
        }
        for &b in words.remainder() {
            state = _mm_crc32_u8(state, b);
        }
        state
    }

    /// Copies `len` bytes and returns their crc32c, in one pass: each 64-byte vector
    /// loaded is stored (streaming stores with `STREAM`, the caller then fencing with
    /// [`fence`] before the bytes are announced; else ordinary ones) and folded into
    /// a running remainder (carry-less multiplications, four 128-bit lanes at a time)
    /// while it is in a register, instead of being read again by a sum of its own.
    /// The bytes before the first 64-byte aligned destination byte and after the last
    /// whole step are copied plainly and summed with the `crc32` instruction.
    ///
    /// # Safety
    ///
    /// [`has_folding_copy`]; `src` valid for reads and `dst` for writes of `len`
    /// bytes, not overlapping.
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub(super) unsafe fn copy_folded<const STREAM: bool>(src: *const u8, dst: *mut u8, len: usize) -> u32 {
        let head = dst.align_offset(64).min(len);
        // SAFETY: the caller's contract: `src` is readable for `len >= head` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(src, len) };
        // SAFETY: `head <= len`: inside both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        // SAFETY: SSE 4.2 is available (the caller's contract).
        let mut state = unsafe { crc_bytes(!0, &bytes[..head]) };
        let body = (len - head) / FOLD_STEP * FOLD_STEP;
        if body > 0 {
            let step = _mm512_broadcast_i32x4(factors(STEP_FACTORS));
            // SAFETY: `head + body <= len`: every vector read and stored below lies
            // inside both ranges; the stores go to `dst + head + k * 64`, 64-byte
            // aligned (`dst + head` is).
            let (a, b) = unsafe {
                let (s, d) = (src.add(head), dst.add(head));
                let x = _mm512_loadu_si512(s.cast::<__m512i>());
                let y = _mm512_loadu_si512(s.add(64).cast::<__m512i>());
                store::<STREAM>(d, x);
                store::<STREAM>(d.add(64), y);
                let mut at = FOLD_STEP;
                // The state so far enters as the first 32 bits of the body: a CRC
                // from a state is the CRC from zero of the bytes with the state
                // xored into their first four.
                let (mut a, mut b) = (_mm512_xor_si512(x, _mm512_zextsi128_si512(_mm_cvtsi32_si128(state as i32))), y);
                while at < body {
                    let x = _mm512_loadu_si512(s.add(at).cast::<__m512i>());
                    let y = _mm512_loadu_si512(s.add(at + 64).cast::<__m512i>());
                    store::<STREAM>(d.add(at), x);
                    store::<STREAM>(d.add(at + 64), y);
                    // a * x^1024 + x, lane by lane: 0x96 is a three-way xor.
                    a = _mm512_ternarylogic_epi64(
                        _mm512_clmulepi64_epi128(a, step, 0x00),
                        _mm512_clmulepi64_epi128(a, step, 0x11),
                        x,
                        0x96,
                    );
                    b = _mm512_ternarylogic_epi64(
                        _mm512_clmulepi64_epi128(b, step, 0x00),
                        _mm512_clmulepi64_epi128(b, step, 0x11),
                        y,
                        0x96,
                    );
                    at += FOLD_STEP;
                }
                (a, b)
            };
            // The eight lanes, in the message's order, folded onto the last one.
            let lane = factors(LANE_FACTORS);
            let lanes: [__m128i; 8] = [
                _mm512_castsi512_si128(a),
                _mm512_extracti32x4_epi32::<1>(a),
                _mm512_extracti32x4_epi32::<2>(a),
                _mm512_extracti32x4_epi32::<3>(a),
                _mm512_castsi512_si128(b),
                _mm512_extracti32x4_epi32::<1>(b),
                _mm512_extracti32x4_epi32::<2>(b),
                _mm512_extracti32x4_epi32::<3>(b),
            ];
            let mut r = lanes[0];
            for &next in &lanes[1..] {
                r = _mm_xor_si128(
                    _mm_xor_si128(_mm_clmulepi64_si128(r, lane, 0x00), _mm_clmulepi64_si128(r, lane, 0x11)),
                    next,
                );
            }
            // What is left is congruent to the body's remainder from zero: the CRC
            // of its 16 bytes.
            state = _mm_crc32_u64(0, _mm_cvtsi128_si64(r) as u64) as u32;
            state = _mm_crc32_u64(u64::from(state), _mm_extract_epi64::<1>(r) as u64) as u32;
        }
        let at = head + body;
        // SAFETY: `at <= len`: the rest of both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at) };
        // SAFETY: SSE 4.2 is available (the caller's contract).
        !unsafe { crc_bytes(state, &bytes[at..]) }
    }

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

    /// The summed copies under test: what each does where the CPU can run it.
    type SummedCopy = unsafe fn(*const u8, *mut u8, usize) -> u32;

    /// Every summed copy this CPU runs, named: the dispatchers, and each kernel they
    /// choose between (the folding kernel and the AVX2 pieces only where the CPU has
    /// their instructions; the portable ones everywhere).
    fn summed_copies() -> Vec<(&'static str, SummedCopy)> {
        unsafe fn streaming_from_0(src: *const u8, dst: *mut u8, len: usize) -> u32 {
            // SAFETY: the caller's contract.
            unsafe { copy_summed_streaming_from(src, dst, len, 0) }
        }
        let mut copies: Vec<(&'static str, SummedCopy)> = vec![
            ("copy_summed_streaming_from", streaming_from_0),
            ("copy_to_pool_summed", copy_to_pool_summed),
            ("copy_out_summed", copy_out_summed),
            ("copy_out_summed_in_pieces", copy_out_summed_in_pieces),
        ];
        #[cfg(target_arch = "x86_64")]
        {
            unsafe fn folded_streaming(src: *const u8, dst: *mut u8, len: usize) -> u32 {
                // SAFETY: the caller's contract; `summed_copies` lists it only where
                // the CPU has the kernel's instructions.
                unsafe {
                    let crc = x86::copy_folded::<true>(src, dst, len);
                    x86::fence();
                    crc
                }
            }
            unsafe fn folded(src: *const u8, dst: *mut u8, len: usize) -> u32 {
                // SAFETY: as above.
                unsafe { x86::copy_folded::<false>(src, dst, len) }
            }
            unsafe fn in_pieces(src: *const u8, dst: *mut u8, len: usize) -> u32 {
                // SAFETY: the caller's contract; listed only where AVX2 is.
                unsafe { x86::stream_summed_in_pieces(src, dst, len) }
            }
            if x86::has_folding_copy() {
                copies.push(("copy_folded::<true>", folded_streaming));
                copies.push(("copy_folded::<false>", folded));
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                copies.push(("stream_summed_in_pieces", in_pieces));
            }
        }
        copies
    }

    proptest! {
        /// Each summed copy is the copy, and its sum the crc32c of the bytes, over
        /// pieces, alignments and lengths (every path from 0 bytes on: the folding
        /// kernel's unaligned head, whole steps and tail among them).
        #[test]
        fn a_summed_copy_is_a_copy_and_its_sum(len in 0usize..(3 * SUMMED_PIECE), src_at in 0usize..64, dst_at in 0usize..64, seed: u8) {
            let src: Vec<u8> = (0..len + src_at).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect();
            for (name, copy) in summed_copies() {
                let mut dst = vec![0x5Au8; len + dst_at + 64];
                // SAFETY: both ranges lie inside their vectors, which do not overlap;
                // the CPU runs every copy listed.
                let crc = unsafe { copy(src.as_ptr().add(src_at), dst.as_mut_ptr().add(dst_at), len) };
                prop_assert_eq!(crc, crate::checksum::crc32c(&src[src_at..]), "{}", name);
                prop_assert_eq!(&dst[dst_at..dst_at + len], &src[src_at..], "{}", name);
                prop_assert!(dst[..dst_at].iter().chain(&dst[dst_at + len..]).all(|&b| b == 0x5A), "{}", name);
            }
        }
    }

    /// The folding kernel over many steps (a remainder carried across megabytes), on
    /// the CPUs that have it; the others' copies are checked the same way.
    #[test]
    fn summed_copies_of_megabytes_sum_as_the_crate_does() {
        let src: Vec<u8> = (0..(3 << 20) + 101).map(|i: usize| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let want = crate::checksum::crc32c(&src);
        let names: Vec<&str> = summed_copies().iter().map(|(n, _)| *n).collect();
        eprintln!("summed copies on this CPU: {names:?}");
        for (name, copy) in summed_copies() {
            let mut dst = vec![0u8; src.len()];
            // SAFETY: inside both vectors; the CPU runs every copy listed.
            let crc = unsafe { copy(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
            assert_eq!(crc, want, "{name}");
            assert!(dst == src, "{name}");
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
