//! CUDA C source of the data-plane kernels, compiled with NVRTC at run time.
//!
//! Memory-model mapping (PTX ISA memory consistency model, as libcu++ maps C++
//! atomics at system scope):
//!
//! | operation        | PTX                                        |
//! |------------------|--------------------------------------------|
//! | load Relaxed     | `ld.relaxed.sys`                           |
//! | load Acquire     | `ld.acquire.sys`                           |
//! | load SeqCst      | `fence.sc.sys; ld.acquire.sys`             |
//! | store Relaxed    | `st.relaxed.sys`                           |
//! | store Release    | `st.release.sys`                           |
//! | store SeqCst     | `fence.sc.sys; st.relaxed.sys`             |
//! | RMW SeqCst       | `fence.sc.sys; atom.acquire.sys.{cas,add}` |
//!
//! These need `sm_70` or newer. Header field offsets are substituted from
//! [`header_offsets`](crate::header_offsets) so the kernels and the Rust layout cannot drift.

use crate::header::{header_offsets, ObjectState};

/// Operation codes of the `nk_hdr_op` kernel (host access to header atomics).
pub(super) mod op {
    pub const LD32_RELAXED: u32 = 0;
    pub const LD32_ACQUIRE: u32 = 1;
    pub const LD32_SEQCST: u32 = 2;
    pub const ST32_RELAXED: u32 = 3;
    pub const ST32_RELEASE: u32 = 4;
    pub const ST32_SEQCST: u32 = 5;
    pub const CAS32: u32 = 6;
    pub const ADD32: u32 = 7;
    pub const LD64_RELAXED: u32 = 8;
    pub const LD64_ACQUIRE: u32 = 9;
    pub const LD64_SEQCST: u32 = 10;
    pub const ST64_RELAXED: u32 = 11;
    pub const ST64_RELEASE: u32 = 12;
    pub const ST64_SEQCST: u32 = 13;
}

/// Reader status codes written by `nk_reader_enter`.
pub(super) mod status {
    pub const PINNED: u32 = 0;
    pub const NOT_READY: u32 = 1;
    pub const STALE: u32 = 2;
    pub const TOO_SMALL: u32 = 3;
}

/// Names of the kernels in the module.
#[cfg(test)]
const KERNEL_NAMES: [&str; 6] =
    ["nk_hdr_op", "nk_write_header", "nk_publish", "nk_reader_enter", "nk_read_exit", "nk_read"];

/// The memory-model helpers, in PTX (see the table at the top).
const ATOMICS: &str = r#"
__device__ __forceinline__ void fence_sc() { asm volatile("fence.sc.sys;" ::: "memory"); }
__device__ __forceinline__ u32 ld_relaxed(const u32* p) { u32 v; asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u32 ld_acquire(const u32* p) { u32 v; asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_relaxed(u32* p, u32 v) { asm volatile("st.relaxed.sys.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void st_release(u32* p, u32 v) { asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ u64 ld_relaxed64(const u64* p) { u64 v; asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ u64 ld_acquire64(const u64* p) { u64 v; asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_relaxed64(u64* p, u64 v) { asm volatile("st.relaxed.sys.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ void st_release64(u64* p, u64 v) { asm volatile("st.release.sys.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory"); }
__device__ __forceinline__ u32 cas_sc(u32* p, u32 cmp, u32 val) {
  fence_sc(); u32 old;
  asm volatile("atom.acquire.sys.cas.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(cmp), "r"(val) : "memory");
  return old;
}
__device__ __forceinline__ u32 add_sc(u32* p, u32 v) {
  fence_sc(); u32 old;
  asm volatile("atom.acquire.sys.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
"#;

/// The kernels, over the helpers.
const BODY: &str = r#"
#define F32(h, off) ((u32*)((h) + (off)))
#define F64(h, off) ((u64*)((h) + (off)))

// Copies len bytes, the work split over `parts` blocks of blockDim.x threads.
// 16-byte vector path when both pointers are 16-byte aligned; source loads
// bypass L1 (.cg) as the reference recommends for producer sources.
__device__ __forceinline__ void copy_chunk(u8* d, const u8* s, u32 len, u32 part, u32 parts) {
  u32 tid = part * blockDim.x + threadIdx.x;
  u32 stride = parts * blockDim.x;
  u32 done = 0;
  if ((((u64)d | (u64)s) & 15ull) == 0) {
    u32 nvec = len / 16u;
    const uint4* s4 = (const uint4*)s;
    uint4* d4 = (uint4*)d;
    u32 i = tid;
    // Four loads in flight before their stores: a thread otherwise waits for
    // memory once per vector.
    for (; i + 3u * stride < nvec; i += 4u * stride) {
      uint4 a = __ldcg(s4 + i), b = __ldcg(s4 + i + stride);
      uint4 c = __ldcg(s4 + i + 2u * stride), e = __ldcg(s4 + i + 3u * stride);
      d4[i] = a; d4[i + stride] = b; d4[i + 2u * stride] = c; d4[i + 3u * stride] = e;
    }
    for (; i < nvec; i += stride) { d4[i] = __ldcg(s4 + i); }
    done = nvec * 16u;
  }
  for (u32 i = done + tid; i < len; i += stride) { d[i] = __ldcg(s + i); }
}

// The last block of the grid to get here (every block calls it once, all
// threads): the barrier orders every thread's stores before thread 0's
// system-scope fence, which (fences being cumulative in the PTX model) makes
// them visible system-wide before its arrival, so what the last block does
// after it (a release, a publish) covers every block's stores. The pattern of
// a cooperative grid sync: one fence a block, not one a thread. The counter
// wraps back to 0 as the last block arrives (atomicInc), ready for the next
// launch on the stream.
__device__ __forceinline__ bool last_block(u32* arrived) {
  __shared__ u32 last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    u32 total = gridDim.x * gridDim.y * gridDim.z;
    last = atomicInc(arrived, total - 1u) == total - 1u ? 1u : 0u;
  }
  __syncthreads();
  if (last) __threadfence_system();
  return last != 0u;
}

// An answer for the host, in page-locked host memory it reads after the
// stream synchronized.
__device__ __forceinline__ void answer(volatile u32* out, u32 v) {
  *out = v;
  __threadfence_system();
}

// Host access to one header word: see `op` in kernels.rs. The result goes to
// `out` (page-locked host memory).
extern "C" __global__ void nk_hdr_op(u64 addr, u32 op, u64 a, u64 b, volatile u64* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  u32* p = (u32*)addr; u64* q = (u64*)addr; u64 r = 0;
  switch (op) {
    case 0: r = ld_relaxed(p); break;
    case 1: r = ld_acquire(p); break;
    case 2: fence_sc(); r = ld_acquire(p); break;
    case 3: st_relaxed(p, (u32)a); break;
    case 4: st_release(p, (u32)a); break;
    case 5: fence_sc(); st_relaxed(p, (u32)a); break;
    case 6: r = cas_sc(p, (u32)a, (u32)b); break;
    case 7: r = add_sc(p, (u32)a); break;
    case 8: r = ld_relaxed64(q); break;
    case 9: r = ld_acquire64(q); break;
    case 10: fence_sc(); r = ld_acquire64(q); break;
    case 11: st_relaxed64(q, a); break;
    case 12: st_release64(q, a); break;
    case 13: fence_sc(); st_relaxed64(q, a); break;
    default: r = ~0ull; break;
  }
  *out = r;
  __threadfence_system();
}

// A new reservation's header, by value: the 16 words of its 128 bytes.
struct NkHeader { u64 w[16]; };

// Writes every word of the header but the one holding the state and the
// reader count, then the state with SeqCst (fence.sc.sys: release for the
// words before it): a reader never sees the state before the header it
// guards, and the reader count is left to the readers.
extern "C" __global__ void nk_write_header(u64 hdr, NkHeader h, u32 state) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  u64* q = (u64*)hdr;
  for (u32 i = 0; i < 16u; i++) {
    if (i != OFF_STATE / 8u) st_relaxed64(q + i, h.w[i]);
  }
  fence_sc();
  st_relaxed(F32(hdr, OFF_STATE), state);
}

// READY publish with release semantics after the last page: check the epoch,
// make every earlier store visible system-wide, CAS WRITING -> READY.
// Returns the previous state, or 0xFFFFFFFF on an epoch mismatch.
__device__ __forceinline__ u32 publish_header(u64 hdr, u32 epoch, u64 now_ns) {
  if (ld_acquire(F32(hdr, OFF_EPOCH)) != epoch) return 0xFFFFFFFFu;
  __threadfence_system();
  u32 old = cas_sc(F32(hdr, OFF_STATE), ST_WRITING, ST_READY);
  if (old == ST_WRITING) st_relaxed64(F64(hdr, OFF_STATE_TS), now_ns);
  return old;
}

// The publish alone (a host producer, or pages pushed in parts).
extern "C" __global__ void nk_publish(u64 hdr, u32 epoch, u64 now_ns, volatile u32* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  answer(out, publish_header(hdr, epoch, now_ns));
}

// Reader enter: acquire READY, pin (refcnt += 1), re-check state, epoch, key
// identity and size. Returns 0 pinned, 1 not ready, 2 stale, 3 too small (then
// not pinned).
__device__ __forceinline__ u32 reader_enter(u64 hdr, u32 epoch, u64 key_hash, u64 key_fp, u32 key_len, u64 dst_cap) {
  u32 s = ld_acquire(F32(hdr, OFF_STATE));
  if (s != ST_READY) {
    u32 same = ld_acquire(F32(hdr, OFF_EPOCH)) == epoch;
    return (same && (s == ST_WRITING || s == ST_RESERVED)) ? 1u : 2u;
  }
  add_sc(F32(hdr, OFF_REFCNT), 1u);
  fence_sc();
  s = ld_acquire(F32(hdr, OFF_STATE));
  u32 code = 0;
  if (s != ST_READY || ld_acquire(F32(hdr, OFF_EPOCH)) != epoch
      || ld_relaxed64(F64(hdr, OFF_KEY_HASH)) != key_hash
      || ld_relaxed64(F64(hdr, OFF_KEY_FP_HI)) != key_fp
      || ld_relaxed(F32(hdr, OFF_KEY_LEN)) != key_len) {
    code = 2;
  } else if (ld_relaxed64(F64(hdr, OFF_BYTES_TOTAL)) > dst_cap) {
    code = 3;
  }
  if (code != 0) add_sc(F32(hdr, OFF_REFCNT), 0xFFFFFFFFu);
  return code;
}

// Block (x, y) of a read: its share x of page y of the pinned object, the
// geometry from the (pinned, hence stable) header, the last page clamped to
// last_page_bytes.
__device__ __forceinline__ void read_share(u64 hdr, u64 arena, u8* dst) {
  u32 n_pages = ld_relaxed(F32(hdr, OFF_N_PAGES));
  u32 page = blockIdx.y;
  if (page >= n_pages) return;
  u32 page_size = ld_relaxed(F32(hdr, OFF_PAGE_SIZE));
  u32 last = ld_relaxed(F32(hdr, OFF_LAST_PAGE_BYTES));
  u64 base = ld_relaxed64(F64(hdr, OFF_PAYLOAD_BASE));
  u32 len = (page + 1 == n_pages) ? last : page_size;
  const u8* s = (const u8*)(arena + base + (u64)page * page_size);
  copy_chunk(dst + (u64)page * page_size, s, len, blockIdx.x, gridDim.x);
}

// Reader enter on its own (one thread): status[0] gets reader_enter's code.
extern "C" __global__ void nk_reader_enter(u64 hdr, u32 epoch, u64 key_hash, u64 key_fp, u32 key_len,
                                           u64 dst_cap, u32* status) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  status[0] = reader_enter(hdr, epoch, key_hash, key_fp, key_len, dst_cap);
}

// A whole read in one launch, for a grid small enough that one pin per block
// costs less than a second launch: grid (blocks_per_page, n_pages). Each block
// enters on its own (pins, re-checks), copies its share if pinned, and unpins
// with release semantics after its threads' copies (the barrier, then the
// fence in add_sc). A block that could not pin records its code in `worst`
// (the highest wins: too small, stale, not ready); the last block to finish
// answers it (0: every block pinned the same epoch and copied) and sets
// `worst` back to 0 for the next launch. A read that answers an error may have
// written part of dst.
extern "C" __global__ void nk_read(u64 hdr, u32 epoch, u64 key_hash, u64 key_fp, u32 key_len, u64 dst_cap,
                                   u64 arena, u8* dst, u32* worst, u32* arrived, volatile u32* out) {
  __shared__ u32 st;
  if (threadIdx.x == 0) st = reader_enter(hdr, epoch, key_hash, key_fp, key_len, dst_cap);
  __syncthreads();
  if (st == 0u) read_share(hdr, arena, dst);
  __syncthreads();
  if (threadIdx.x == 0) {
    if (st == 0u) add_sc(F32(hdr, OFF_REFCNT), 0xFFFFFFFFu);
    else atomicMax(worst, st);
  }
  if (!last_block(arrived) || threadIdx.x != 0) return;
  answer(out, atomicExch(worst, 0u));
}

// Reader copy and exit in one launch: grid (blocks_per_page, n_pages). Copies
// only if nk_reader_enter pinned the object; geometry comes from the (pinned,
// hence stable) header; the last page is clamped to last_page_bytes. The
// last block to finish unpins with release semantics (after every block's
// copy) and answers the status.
extern "C" __global__ void nk_read_exit(const u32* status, u64 hdr, u64 arena, u8* dst, u32* arrived,
                                        volatile u32* out) {
  u32 st = ld_relaxed(status);
  if (st == 0u) read_share(hdr, arena, dst);
  if (!last_block(arrived) || threadIdx.x != 0) return;
  if (st == 0u) add_sc(F32(hdr, OFF_REFCNT), 0xFFFFFFFFu);
  answer(out, st);
}
"#;

/// The complete kernel source, with the header offsets and state values
/// defined from the Rust constants.
pub(super) fn source() -> String {
    source_with(ATOMICS)
}

/// The kernel source over the memory-model helpers `atomics`.
fn source_with(atomics: &str) -> String {
    let defs = [
        ("OFF_KEY_HASH", header_offsets::KEY_HASH as u32),
        ("OFF_KEY_FP_HI", header_offsets::KEY_FP_HI as u32),
        ("OFF_KEY_LEN", header_offsets::KEY_LEN as u32),
        ("OFF_PAYLOAD_BASE", header_offsets::PAYLOAD_BASE as u32),
        ("OFF_BYTES_TOTAL", header_offsets::BYTES_TOTAL as u32),
        ("OFF_PAGE_SIZE", header_offsets::PAGE_SIZE as u32),
        ("OFF_N_PAGES", header_offsets::N_PAGES as u32),
        ("OFF_LAST_PAGE_BYTES", header_offsets::LAST_PAGE_BYTES as u32),
        ("OFF_EPOCH", header_offsets::EPOCH as u32),
        ("OFF_STATE", header_offsets::STATE as u32),
        ("OFF_REFCNT", header_offsets::READER_REFCNT as u32),
        ("OFF_STATE_TS", header_offsets::STATE_TS as u32),
        ("ST_RESERVED", ObjectState::Reserved.as_u32()),
        ("ST_WRITING", ObjectState::Writing.as_u32()),
        ("ST_READY", ObjectState::Ready.as_u32()),
        ("ST_DEAD", ObjectState::Dead.as_u32()),
    ];
    let mut s = String::with_capacity(atomics.len() + BODY.len() + 1024);
    s.push_str("typedef unsigned int u32;\ntypedef unsigned long long u64;\ntypedef unsigned char u8;\n");
    for (name, v) in defs {
        s.push_str(&format!("#define {name} {v}u\n"));
    }
    s.push_str(atomics);
    s.push_str(BODY);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_defines_every_macro_it_uses() {
        let src = source();
        for name in ["OFF_STATE", "OFF_REFCNT", "ST_READY", "ST_WRITING", "OFF_EPOCH"] {
            assert!(src.contains(&format!("#define {name} ")), "{name}");
        }
        assert!(src.contains("#define OFF_STATE 56u"));
        assert!(src.contains("#define OFF_REFCNT 60u"));
        for k in KERNEL_NAMES {
            assert!(src.contains(&format!("void {k}(")), "{k}");
        }
        // op codes in the switch agree with the Rust constants
        assert!(src.contains(&format!("case {}: r = cas_sc", op::CAS32)));
        assert!(src.contains(&format!("case {}: r = add_sc", op::ADD32)));
        assert!(src.contains(&format!("case {}: st_release(p", op::ST32_RELEASE)));
        assert!(src.contains(&format!("case {}: fence_sc(); r = ld_acquire(p)", op::LD32_SEQCST)));
        assert!(src.contains(&format!("case {}: st_release64", op::ST64_RELEASE)));
        // balanced braces (a cheap syntax sanity check without a compiler)
        let open = src.matches('{').count();
        let close = src.matches('}').count();
        assert_eq!(open, close);
        assert_eq!(status::PINNED, 0);
        assert_eq!(status::TOO_SMALL, 3);
        // nk_write_header skips the one word that holds the state and the reader
        // count: both must share it.
        assert_eq!(header_offsets::STATE % 8, 0);
        assert_eq!(header_offsets::READER_REFCNT, header_offsets::STATE + 4);
    }

    /// The memory-model helpers as C++ atomics, for the kernels on the CPU.
    const CPU_ATOMICS: &str = r#"
inline void fence_sc() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> std::atomic_ref<T> at(const T* p) { return std::atomic_ref<T>(*const_cast<T*>(p)); }
inline u32 ld_relaxed(const u32* p) { return at(p).load(std::memory_order_relaxed); }
inline u32 ld_acquire(const u32* p) { return at(p).load(std::memory_order_acquire); }
inline void st_relaxed(u32* p, u32 v) { at(p).store(v, std::memory_order_relaxed); }
inline void st_release(u32* p, u32 v) { at(p).store(v, std::memory_order_release); }
inline u64 ld_relaxed64(const u64* p) { return at(p).load(std::memory_order_relaxed); }
inline u64 ld_acquire64(const u64* p) { return at(p).load(std::memory_order_acquire); }
inline void st_relaxed64(u64* p, u64 v) { at(p).store(v, std::memory_order_relaxed); }
inline void st_release64(u64* p, u64 v) { at(p).store(v, std::memory_order_release); }
inline u32 cas_sc(u32* p, u32 cmp, u32 val) { at(p).compare_exchange_strong(cmp, val); return cmp; }
inline u32 add_sc(u32* p, u32 v) { return at(p).fetch_add(v); }
"#;

    /// A put and reads of one object through the kernels, run on the CPU (the
    /// header, arena and buffers in host memory; addresses are host addresses):
    /// what each kernel answers and leaves in the header, the pages and the
    /// destination, and the blocks' arrival counter back at zero after each
    /// launch. Prints `name value` lines.
    const CPU_SCENARIO: &str = r#"
int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    u64 words[16];
    if (!f || fread(words, 8, 16, f) != 16) return 2;
    alignas(16) static u64 header[16];
    std::vector<uint4> arena_v(1 << 16), src_v(1 << 15), dst_v(1 << 15);
    u8* arena = (u8*)arena_v.data(); u8* src = (u8*)src_v.data(); u8* dst = (u8*)dst_v.data();
    u64 hdr = (u64)header;
    u64 base = *(u64*)((u8*)words + OFF_PAYLOAD_BASE), total = *(u64*)((u8*)words + OFF_BYTES_TOTAL);
    u32 page = *(u32*)((u8*)words + OFF_PAGE_SIZE), n_pages = *(u32*)((u8*)words + OFF_N_PAGES);
    u32 epoch = *(u32*)((u8*)words + OFF_EPOCH);
    u64 key_hash = words[OFF_KEY_HASH / 8], key_fp = words[OFF_KEY_FP_HI / 8];
    u32 key_len = *(u32*)((u8*)words + OFF_KEY_LEN);
    for (u64 i = 0; i < total; i++) src[i] = (u8)((i * 2654435761ull) >> 13); // no short period: a misplaced vector shows
    u32 status = 9, arrived = 0;
    volatile u32 answer = 0;
    u64 answer64 = 0;
    // A DEAD slot some readers still pin: the header write leaves the count alone.
    header[OFF_STATE / 8] = ((u64)3 << 32) | ST_DEAD;
    NkHeader h; memcpy(h.w, words, 128);
    launch(1, 1, 1, [&] { nk_write_header(hdr, h, ST_WRITING); });
    int same = 1;
    for (int i = 0; i < 16; i++) if (i != OFF_STATE / 8 && header[i] != words[i]) same = 0;
    printf("header_words_written %d\n", same);
    printf("state_after_write %u\nrefcnt_after_write %u\n", *F32(hdr, OFF_STATE), *F32(hdr, OFF_REFCNT));
    *F32(hdr, OFF_REFCNT) = 0;
    unsigned per_page = page / (32 * 1024);
    memcpy(arena + base, src, total); // the pages, as the driver's copy lays them
    launch(1, 1, 1, [&] { nk_publish(hdr, epoch, 1234, (u32*)&answer); });
    printf("push_answer %u\nstate_after_push %u\nstate_ts %llu\narrived_after_push %u\n", answer,
           *F32(hdr, OFF_STATE), *F64(hdr, OFF_STATE_TS), arrived);
    printf("pages_equal %d\n", memcmp(arena + base, src, total) == 0);
    memcpy(arena + base, src, total);
    launch(1, 1, 1, [&] { nk_publish(hdr, epoch, 99, (u32*)&answer); });
    printf("push_again_answer %u\narrived_after_again %u\n", answer, arrived);
    launch(1, 1, 1, [&] { nk_publish(hdr, epoch + 1, 5, (u32*)&answer); });
    printf("publish_other_epoch %u\n", answer);
    memset(dst, 0xAA, 1 << 19);
    launch(1, 1, 1, [&] { nk_reader_enter(hdr, epoch, key_hash, key_fp, key_len, 1 << 19, &status); });
    printf("enter_status %u\nrefcnt_pinned %u\n", status, *F32(hdr, OFF_REFCNT));
    launch(per_page, n_pages, 256, [&] { nk_read_exit(&status, hdr, (u64)arena, dst, &arrived, (u32*)&answer); });
    int tail = 1;
    for (u64 i = total; i < (1 << 19); i++) if (dst[i] != 0xAA) tail = 0;
    printf("read_answer %u\nrefcnt_after_read %u\narrived_after_read %u\n", answer, *F32(hdr, OFF_REFCNT), arrived);
    printf("read_equal %d\nread_tail_untouched %d\n", memcmp(dst, src, total) == 0, tail);
    memset(dst, 0xBB, 1 << 19);
    launch(1, 1, 1, [&] { nk_reader_enter(hdr, epoch, key_hash, key_fp, key_len, total - 1, &status); });
    printf("small_status %u\n", status);
    launch(per_page, n_pages, 256, [&] { nk_read_exit(&status, hdr, (u64)arena, dst, &arrived, (u32*)&answer); });
    int untouched = 1;
    for (u64 i = 0; i < (1 << 19); i++) if (dst[i] != 0xBB) untouched = 0;
    printf("small_answer %u\nsmall_untouched %d\nrefcnt_after_small %u\n", answer, untouched, *F32(hdr, OFF_REFCNT));
    launch(1, 1, 1, [&] { nk_reader_enter(hdr, epoch, key_hash ^ 1, key_fp, key_len, 1 << 19, &status); });
    printf("other_key_status %u\nrefcnt_after_other %u\n", status, *F32(hdr, OFF_REFCNT));
    // The one-launch read: every block pins, copies its share and unpins.
    u32 worst = 0;
    memset(dst, 0xCC, 1 << 19);
    launch(per_page, n_pages, 256, [&] {
        nk_read(hdr, epoch, key_hash, key_fp, key_len, 1 << 19, (u64)arena, dst, &worst, &arrived, (u32*)&answer);
    });
    tail = 1;
    for (u64 i = total; i < (1 << 19); i++) if (dst[i] != 0xCC) tail = 0;
    printf("fused_answer %u\nfused_equal %d\nfused_tail_untouched %d\nfused_refcnt %u\nfused_worst %u\nfused_arrived %u\n",
           answer, memcmp(dst, src, total) == 0, tail, *F32(hdr, OFF_REFCNT), worst, arrived);
    memset(dst, 0xDD, 1 << 19);
    launch(per_page, n_pages, 256, [&] {
        nk_read(hdr, epoch, key_hash, key_fp, key_len, total - 1, (u64)arena, dst, &worst, &arrived, (u32*)&answer);
    });
    untouched = 1;
    for (u64 i = 0; i < (1 << 19); i++) if (dst[i] != 0xDD) untouched = 0;
    printf("fused_small_answer %u\nfused_small_untouched %d\nfused_small_refcnt %u\nfused_small_worst %u\n", answer,
           untouched, *F32(hdr, OFF_REFCNT), worst);
    launch(per_page, n_pages, 256, [&] {
        nk_read(hdr, epoch + 1, key_hash, key_fp, key_len, 1 << 19, (u64)arena, dst, &worst, &arrived, (u32*)&answer);
    });
    printf("fused_stale_answer %u\nfused_stale_refcnt %u\n", answer, *F32(hdr, OFF_REFCNT));
    launch(1, 1, 1, [&] { nk_hdr_op(hdr + OFF_STATE, 1, 0, 0, &answer64); });
    printf("hdr_op_state %llu\n", answer64);
    return 0;
}
"#;

    #[cfg(feature = "cuda")]
    #[test]
    fn the_kernels_put_and_read_an_object_when_run_on_a_cpu() {
        use crate::header::{HeaderSnapshot, HEADER_VERSION};
        let total = 5 * 65_536 - 1000;
        let h = HeaderSnapshot {
            key_hash: 0x1234_5678_9abc_def0,
            key_fp_hi: 0x0fed_cba9_8765_4321,
            key_len: 11,
            header_version: HEADER_VERSION,
            payload_base: 4096,
            bytes_total: total,
            page_size: 65_536,
            n_pages: 5,
            last_page_bytes: 65_536 - 1000,
            epoch: 7,
            state: ObjectState::Writing.as_u32(),
            state_ts: 1,
            last_access: 1,
            ..Default::default()
        };
        let input: Vec<u8> = h.to_bytes().to_vec();
        let program = format!("{}\n{CPU_SCENARIO}", source_with(CPU_ATOMICS));
        let Some(out) = super::super::driver::run_on_cpu("nanokv", &program, &input) else { return };
        let got: std::collections::HashMap<&str, u64> = out
            .lines()
            .map(|l| {
                let (k, v) = l.split_once(' ').expect("name value");
                (k, v.parse().expect("a number"))
            })
            .collect();
        let (writing, ready) = (u64::from(ObjectState::Writing.as_u32()), u64::from(ObjectState::Ready.as_u32()));
        let want: [(&str, u64); 37] = [
            ("header_words_written", 1),
            ("state_after_write", writing),
            ("refcnt_after_write", 3),
            ("push_answer", writing),
            ("state_after_push", ready),
            ("state_ts", 1234),
            ("arrived_after_push", 0),
            ("pages_equal", 1),
            ("push_again_answer", ready),
            ("arrived_after_again", 0),
            ("publish_other_epoch", 0xFFFF_FFFF),
            ("enter_status", u64::from(status::PINNED)),
            ("refcnt_pinned", 1),
            ("read_answer", u64::from(status::PINNED)),
            ("refcnt_after_read", 0),
            ("arrived_after_read", 0),
            ("read_equal", 1),
            ("read_tail_untouched", 1),
            ("small_status", u64::from(status::TOO_SMALL)),
            ("small_answer", u64::from(status::TOO_SMALL)),
            ("small_untouched", 1),
            ("refcnt_after_small", 0),
            ("other_key_status", u64::from(status::STALE)),
            ("refcnt_after_other", 0),
            ("fused_answer", u64::from(status::PINNED)),
            ("fused_equal", 1),
            ("fused_tail_untouched", 1),
            ("fused_refcnt", 0),
            ("fused_worst", 0),
            ("fused_arrived", 0),
            ("fused_small_answer", u64::from(status::TOO_SMALL)),
            ("fused_small_untouched", 1),
            ("fused_small_refcnt", 0),
            ("fused_small_worst", 0),
            ("fused_stale_answer", u64::from(status::STALE)),
            ("fused_stale_refcnt", 0),
            ("hdr_op_state", ready),
        ];
        for (name, value) in want {
            assert_eq!(got.get(name), Some(&value), "{name}\n{out}");
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn the_source_compiles_with_nvrtc() {
        super::super::driver::assert_compiles_with_nvrtc(source());
    }
}
