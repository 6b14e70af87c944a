//! crc32c (Castagnoli) of CUDA device memory, summed on the device: the check a
//! device get runs on the bytes it moved (and the sum a device put stores),
//! without a second pass of the bytes over PCIe.
//!
//! One kernel, `mc_crc32c_blocks`, compiled with NVRTC once per process and
//! device, sums a whole batch (several items, each of one or more ranges) in one
//! launch, with no copy before it (the batch's table goes as parameters where it
//! fits) nor after (the results are written into mapped host memory):
//! - each block sums 16 KiB: each of its 256 threads sums 64 bytes (slice-by-8
//!   tables, copied into shared memory from the module's constants) into a bare
//!   remainder, moves it past the bytes after it in the block with one
//!   multiplication, and the block XORs them;
//! - the block moves its remainder past the bytes of its item after it (one or
//!   two multiplications, by factors the host computed for its range) and XORs it
//!   into its item's accumulator; the last of the item's blocks to arrive adds
//!   the item's constant (the register's start and the final inversion, computed
//!   by the host) and writes the result.
//!
//! Why so: a get's check runs after its copy, so the kernel's own time is the
//! get's. Small blocks spread a 4 MiB object over every SM (the lookups into the
//! shared tables bound the kernel); blocks that shift their own remainder leave
//! no fold in order for a last block to run, nor per-block sums to store.
//!
//! Remainders combine with `crc(A ++ B) = crc(A) * x^(8|B|) mod P  ^  crc(B)`
//! for bare remainders (a zero register, no inversion), which are linear in the
//! bytes: the bare remainder of an item is the XOR of its blocks' remainders,
//! each moved past the bytes after it. The multiplication is in GF(2) modulo the
//! reflected polynomial.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock};

use cudarc::driver::{result as cu, sys, CudaContext, CudaFunction, CudaStream};
use parking_lot::Mutex;

use super::driver::{alloc_mapped_host, drv, guarded, nvrtc_available};
use crate::error::{GpuError, Result};

/// Threads per block of `mc_crc32c_blocks` (also the width of the tables each
/// block copies: one word of each table a thread).
const THREADS: u32 = 256;
/// Bytes each thread sums (a power of two, a multiple of 32: two chains of
/// whole 16-byte loads).
const PER_THREAD: u64 = 64;
/// Bytes each block sums.
const PER_BLOCK: u64 = THREADS as u64 * PER_THREAD;
/// Base-64 digits of a block count the kernel's block-shift tables cover: a
/// range of up to `64^6` blocks (2^50 bytes).
const BLOCK_DIGITS: usize = 6;
/// Words of a batch's table that go as kernel parameters (1.5 KiB, well inside
/// the 4 KiB a launch takes): a batch of up to 47 ranges in one item, such as
/// one block's 32 per-layer parts, skips the copy of its table up to the device.
const TABLE_WORDS: usize = 192;

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;
/// `x^0`, the multiplicative identity (reflected: bit 31).
const ONE: u32 = 1 << 31;

/// `a(x) * b(x) mod P` (reflected; bit 31 is x^0).
const fn mul_mod_p(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    while m != 0 {
        if a & m != 0 {
            p ^= b;
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// `x^(2^k) mod P` for k in 0..64, written into the kernels' source.
fn x2n_table() -> [u32; 64] {
    let mut t = [0u32; 64];
    t[0] = 1 << 30; // x^1
    for k in 1..64 {
        t[k] = mul_mod_p(t[k - 1], t[k - 1]);
    }
    t
}

/// The table of `x^(2^k)`, computed once.
static X2N: LazyLock<[u32; 64]> = LazyLock::new(x2n_table);

const BODY: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

#define MC_POLY 0x82F63B78u

// a(x) * b(x) mod P, reflected: unrolled and branch-free (masks, not
// branches): each share's shift and each level of a fold is one.
__device__ __forceinline__ u32 mc_mul(u32 a, u32 b) {
    u32 p = 0;
#pragma unroll
    for (int i = 31; i >= 0; i--) {
        p ^= b & (0u - ((a >> i) & 1u));
        b = (b >> 1) ^ (MC_POLY & (0u - (b & 1u)));
    }
    return p;
}

// x^(8 n) mod P: the factor that moves a sum past n bytes (a short block's
// tail only: fewer than MC_PER_THREAD bytes).
__device__ __forceinline__ u32 mc_shift_op(u64 n) {
    u32 p = 1u << 31;
    u32 k = 3;
    while (n) {
        if (n & 1) p = mc_mul(MC_X2N[k], p);
        n >>= 1;
        k++;
    }
    return p;
}

// x^(8 MC_PER_BLOCK m) mod P: what moves a sum past m whole blocks, one entry of
// MC_BLOCKS a nonzero base-64 digit of m (m < 64^MC_BLOCK_DIGITS, which the
// host checks).
__device__ __forceinline__ u32 mc_blocks_op(u64 m) {
    u32 p = 1u << 31;
    bool first = true;
    for (int l = 0; m && l < MC_BLOCK_DIGITS; l++, m >>= 6) {
        u32 d = (u32)(m & 63);
        if (!d) continue;
        p = first ? MC_BLOCKS[l][d] : mc_mul(MC_BLOCKS[l][d], p);
        first = false;
    }
    return p;
}

// Eight bytes (little-endian words lo, hi) into a running sum, slice-by-8.
__device__ __forceinline__ u32 mc_step8(const u32 (*T)[256], u32 crc, u32 lo, u32 hi) {
    lo ^= crc;
    return T[7][lo & 0xff] ^ T[6][(lo >> 8) & 0xff] ^ T[5][(lo >> 16) & 0xff] ^ T[4][lo >> 24]
        ^ T[3][hi & 0xff] ^ T[2][(hi >> 8) & 0xff] ^ T[1][(hi >> 16) & 0xff] ^ T[0][hi >> 24];
}

// A batch's table (see `Batch`) passed by value, as kernel parameters, when it
// fits: no copy up to the device before the launch.
struct McTable { u64 w[MC_TABLE_WORDS]; };

// Word i of the batch's table: in device memory at `table`, else in `small`.
__device__ __forceinline__ u64 mc_word(const McTable& small, const u64* table, u64 i) {
    return table ? table[i] : small.w[i];
}

// Sums of the 16 KiB blocks of several ranges and of the items they make, one
// launch for all. The table (`small`, or `table` where not null): range r is
// words 4r (address), 4r + 1 (length, > 0), 4r + 2 (its first block; the firsts
// increase) and 4r + 3 (its factors: low half x^(8 a), a being the bytes of its
// item after it; high half x^(8 (a + t)), t being the length of its last
// block); then word 4 n_ranges + i is item i's first block (its blocks are
// [first(i), first(i + 1))), and word 4 n_ranges + n_items + 1 + i its constant
// (the register's start moved past the item, and the final inversion). Block b
// sums its share of the last range whose first block is <= b. Each thread sums
// its 64 bytes from a zero register, without the final inversion (the bare
// remainder, linear in the bytes), and moves it past the bytes after it in the
// block with one multiplication; the block XORs them and moves the result past
// the bytes of its item after the block. A one-block item's sum goes straight
// to results[item]; otherwise each block XORs its part into acc[item], and the
// last of the item's blocks to arrive (arrived[item]) writes results[item]. acc
// and arrived are zero between launches (the last block leaves them so). An item
// of no bytes is not written.
extern "C" __global__ void mc_crc32c_blocks(const __grid_constant__ McTable small, const u64* table, u32 n_ranges,
                                            u32 n_items, u32* arrived, u32* acc, u32* results) {
    __shared__ u32 T[8][256];
    __shared__ u32 C[MC_THREADS];
    __shared__ u64 R[6];
    __shared__ u32 X[2];
    u32 t = threadIdx.x;
    // The tables, from the module's constants: one word of each a thread.
#pragma unroll
    for (int k = 0; k < 8; k++) T[k][t] = MC_T[k][t];
    if (t == 0) {
        u64 b = blockIdx.x;
        u32 lo = 0, hi = n_ranges;
        while (hi - lo > 1) {
            u32 mid = lo + (hi - lo) / 2;
            if (mc_word(small, table, 4 * (u64)mid + 2) <= b) lo = mid; else hi = mid;
        }
        R[0] = mc_word(small, table, 4 * (u64)lo);
        R[1] = mc_word(small, table, 4 * (u64)lo + 1);
        R[2] = b - mc_word(small, table, 4 * (u64)lo + 2);
        R[5] = mc_word(small, table, 4 * (u64)lo + 3);
        // The item: the last whose first block is <= b (an empty item before it
        // shares its first block).
        u64 f = 4 * (u64)n_ranges;
        u32 ilo = 0, ihi = n_items;
        while (ihi - ilo > 1) {
            u32 mid = ilo + (ihi - ilo) / 2;
            if (mc_word(small, table, f + mid) <= b) ilo = mid; else ihi = mid;
        }
        R[3] = ilo;
        R[4] = mc_word(small, table, f + ilo + 1) - mc_word(small, table, f + ilo);
        // A short block's last share: x^(8 tail) (X[1]), 0 when it is whole.
        u64 block_len = min((u64)MC_PER_BLOCK, R[1] - R[2] * MC_PER_BLOCK);
        u64 tail = block_len - ((block_len - 1) / MC_PER_THREAD) * MC_PER_THREAD;
        X[1] = tail == MC_PER_THREAD ? 0u : mc_shift_op(tail);
    }
    __syncthreads();
    if (t == 32) {
        // The block's move past the bytes of its item after it, by a thread of
        // the second warp while the first's thread 0 sums its share.
        u64 len = R[1], bi = R[2], factors = R[5];
        u64 nb = (len + MC_PER_BLOCK - 1) / MC_PER_BLOCK;
        X[0] = bi + 1 == nb ? (u32)factors : mc_mul(mc_blocks_op(nb - 2 - bi), (u32)(factors >> 32));
    }
    const u8* data = (const u8*)R[0];
    u64 len = R[1];
    u64 start = R[2] * MC_PER_BLOCK + (u64)t * MC_PER_THREAD;
    u64 mine = start < len ? min((u64)MC_PER_THREAD, len - start) : 0;
    const u8* p = data + start;
    u64 n = mine;
    u32 crc = 0;
    if (n == MC_PER_THREAD && ((u64)p & 15) == 0) {
        // The common case, a full aligned share: every load is issued before
        // the first is used, so the thread waits for memory once, not once per
        // word (the sum's dependency chain would otherwise serialize them); the
        // two halves are summed as two independent chains, interleaved, and
        // joined with one multiplication (MC_JOIN: x^(8 MC_PER_THREAD / 2)).
        const int H = (int)(MC_PER_THREAD / 32);
        uint4 v[2 * H];
        const uint4* q = (const uint4*)p;
#pragma unroll
        for (int i = 0; i < 2 * H; i++) v[i] = q[i];
        u32 hi = 0;
#pragma unroll
        for (int i = 0; i < H; i++) {
            crc = mc_step8(T, crc, v[i].x, v[i].y);
            hi = mc_step8(T, hi, v[H + i].x, v[H + i].y);
            crc = mc_step8(T, crc, v[i].z, v[i].w);
            hi = mc_step8(T, hi, v[H + i].z, v[H + i].w);
        }
        crc = mc_mul(MC_JOIN, crc) ^ hi;
        n = 0;
    }
    while (n && ((u64)p & 7)) {
        crc = T[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
        p++;
        n--;
    }
    const u64* w = (const u64*)p;
    while (n >= 8) {
        u64 v = *w++;
        crc = mc_step8(T, crc, (u32)v, (u32)(v >> 32));
        n -= 8;
    }
    p = (const u8*)w;
    while (n) {
        crc = T[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
        p++;
        n--;
    }
    // Past the bytes after this share in the block: whole shares of the block's
    // last k = (block length - 1) / MC_PER_THREAD, then, in a short block, its
    // tail.
    u64 block_len = min((u64)MC_PER_BLOCK, len - R[2] * MC_PER_BLOCK);
    u32 k = (u32)((block_len - 1) / MC_PER_THREAD);
    if (mine == 0) {
        crc = 0;
    } else if (t < k) {
        // MC_AFTER[j] moves past MC_THREADS - 1 - j whole shares; X[1] is 0 when
        // the last share is whole.
        crc = X[1] ? mc_mul(mc_mul(MC_AFTER[MC_THREADS - k + t], X[1]), crc) : mc_mul(MC_AFTER[MC_THREADS - 1 - k + t], crc);
    }
    C[t] = crc;
    __syncthreads();
    for (u32 s = MC_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) C[t] ^= C[t + s];
        __syncthreads();
    }
    if (t != 0) return;
    u32 item = (u32)R[3];
    u32 count = (u32)R[4];
    u32 part = mc_mul(X[0], C[0]);
    u32 constant = (u32)mc_word(small, table, 4 * (u64)n_ranges + n_items + 1 + item);
    if (count == 1) {
        results[item] = part ^ constant;
        return;
    }
    atomicXor(acc + item, part);
    __threadfence();
    if (atomicInc(arrived + item, count - 1u) == count - 1u) {
        // Every other block of the item XORed its part before it counted its
        // arrival: the accumulator is whole. Taken, and left at zero.
        __threadfence();
        results[item] = atomicExch(acc + item, 0u) ^ constant;
    }
}
"#;

/// The kernels' source: the tables and sizes, then the body.
fn source() -> String {
    let words = |t: &[u32]| t.iter().map(|v| format!("{v:#010x}u")).collect::<Vec<_>>().join(", ");
    let rows = |rows: &[Vec<u32>]| rows.iter().map(|r| format!("{{{}}}", words(r))).collect::<Vec<_>>().join(",\n");
    let x2n = &*X2N;
    format!(
        "#define MC_THREADS {THREADS}\n#define MC_PER_THREAD {PER_THREAD}ull\n#define MC_PER_BLOCK {PER_BLOCK}ull\n\
         #define MC_BLOCK_DIGITS {BLOCK_DIGITS}\n#define MC_TABLE_WORDS {TABLE_WORDS}\n#define MC_JOIN {join:#010x}u\n\
         __device__ const unsigned int MC_X2N[64] = {{{}}};\n__device__ const unsigned int MC_AFTER[{THREADS}] = {{{}}};\n\
         __device__ const unsigned int MC_BLOCKS[{BLOCK_DIGITS}][64] = {{{}}};\n\
         __device__ const unsigned int MC_T[8][256] = {{{}}};\n{BODY}",
        words(x2n),
        words(&after_table(x2n)),
        rows(&blocks_table(x2n)),
        rows(&slice_tables()),
        join = x_pow_8n(x2n, PER_THREAD / 2),
    )
}

/// `x^(8 n) mod P`: what moves a remainder past `n` bytes (`x2n`: [`x2n_table`]).
fn x_pow_8n(x2n: &[u32; 64], mut n: u64) -> u32 {
    let (mut p, mut k) = (ONE, 3);
    while n != 0 {
        if n & 1 != 0 {
            p = mul_mod_p(x2n[k], p);
        }
        n >>= 1;
        k += 1;
    }
    p
}

/// For each thread `t` of a block, `x^(8 * PER_THREAD * (THREADS - 1 - t)) mod
/// P`: what moves its share's remainder past the shares after it in a whole
/// block.
fn after_table(x2n: &[u32; 64]) -> Vec<u32> {
    (0..u64::from(THREADS)).map(|t| x_pow_8n(x2n, PER_THREAD * (u64::from(THREADS) - 1 - t))).collect()
}

/// For each base-64 digit position `l` and digit `d`, `x^(8 * PER_BLOCK * d *
/// 64^l) mod P`: the factors whose product moves a remainder past a number of
/// whole blocks.
fn blocks_table(x2n: &[u32; 64]) -> Vec<Vec<u32>> {
    (0..BLOCK_DIGITS)
        .map(|l| {
            let base = x_pow_8n(x2n, PER_BLOCK << (6 * l));
            let mut row = vec![ONE; 64];
            for d in 1..64 {
                row[d] = mul_mod_p(row[d - 1], base);
            }
            row
        })
        .collect()
}

/// The slice-by-8 tables: `T[0]` the byte-at-a-time table, `T[k][i]` the
/// remainder of byte `i` followed by `k` zero bytes.
fn slice_tables() -> Vec<Vec<u32>> {
    let mut t = vec![vec![0u32; 256]; 8];
    for i in 0..256u32 {
        let mut c = i;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
        t[0][i as usize] = c;
    }
    for k in 1..8 {
        for i in 0..256 {
            let prev = t[k - 1][i];
            t[k][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
        }
    }
    t
}

/// An item's constant: what the register's start (all ones) becomes after its
/// `len` bytes, with the final inversion; XORed into its bare remainder, it
/// gives the standard crc32c.
fn item_constant(len: u64) -> u32 {
    mul_mod_p(x_pow_8n(&X2N, len), u32::MAX) ^ u32::MAX
}

/// The kernels of one device, with their stream, a device scratch and a
/// page-locked host buffer.
struct Summer {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blocks: CudaFunction,
    /// Device scratch: a table too large for the launch's parameters.
    scratch: sys::CUdeviceptr,
    /// Its size in bytes.
    scratch_bytes: usize,
    /// An item's arrival counter, then an item's accumulator, in device memory
    /// (both zero between launches: the last of an item's blocks leaves them
    /// so). For `n` items, the counters are its first `n` words and the
    /// accumulators the `n` after them.
    arrived: sys::CUdeviceptr,
    /// Its size in bytes.
    arrived_bytes: usize,
    /// Page-locked host memory, mapped for the device: a table too large for
    /// the launch's parameters on its way up, and the results, which the
    /// kernels write straight into it ([`Layout`]).
    io: *mut u8,
    /// `io`'s device address.
    io_dev: sys::CUdeviceptr,
    /// Its size in bytes.
    io_bytes: usize,
}

// SAFETY: the scratch and io pointers are allocations owned by this value,
// used only under the `Mutex` that holds it; the cudarc handles are `Send`.
unsafe impl Send for Summer {}

impl Drop for Summer {
    fn drop(&mut self) {
        let _ = guarded("cuMemFree", || {
            drv("bind", self.ctx.bind_to_thread())?;
            let _ = self.stream.synchronize();
            for ptr in [self.scratch, self.arrived] {
                if ptr != 0 {
                    // SAFETY: allocated by `cuMemAlloc` in this context, freed once.
                    drv("cuMemFree", unsafe { cu::free_sync(ptr) })?;
                }
            }
            if !self.io.is_null() {
                // SAFETY: allocated by `cuMemHostAlloc`, freed once, no copy in
                // flight (the stream was synchronized, and every user synchronized
                // its own before giving the lock up).
                drv("cuMemFreeHost", unsafe { cu::free_host(self.io.cast()) })?;
            }
            Ok(())
        });
    }
}

/// Where a batch of `items` items and `ranges` ranges keeps what, in bytes. On
/// the device (the scratch): the table ([`Batch`]), when too large for the
/// launch's parameters. On the host: the same table on its way up, then the
/// results.
struct Layout {
    /// Bytes of the table.
    words: usize,
    io_results: usize,
    io: usize,
}

impl Layout {
    fn of(items: usize, ranges: usize) -> Self {
        let words = 8 * (4 * ranges + 2 * items + 1);
        Self { words, io_results: words, io: words + 4 * items }
    }
}

/// What the kernel of one batch reads: the range table (address, length, first
/// block and factors of each non-empty range), then each item's first block and,
/// after the last item's, the number of blocks, then each item's constant (see
/// the kernel's comment).
struct Batch {
    words: Vec<u64>,
    ranges: usize,
    blocks: u64,
}

impl Batch {
    /// The table of `items`; `InvalidArgument` for a range of more blocks than
    /// the kernel's shift tables cover (2^50 bytes, beyond any device memory).
    fn of(items: &[Vec<(u64, u64)>]) -> Result<Self> {
        let mut words: Vec<u64> = Vec::new();
        let mut first: Vec<u64> = Vec::with_capacity(items.len() + 1);
        let mut constants: Vec<u64> = Vec::with_capacity(items.len());
        let mut blocks = 0u64;
        let most_blocks = 1u64 << (6 * BLOCK_DIGITS);
        for item in items {
            first.push(blocks);
            let total: u64 = item.iter().map(|&(_, len)| len).sum();
            let mut before = 0u64;
            for &(ptr, len) in item.iter().filter(|&&(_, len)| len > 0) {
                let n = len.div_ceil(PER_BLOCK);
                if n >= most_blocks {
                    return Err(GpuError::InvalidArgument(format!("crc32c of a {len}-byte device range")));
                }
                before += len;
                let after = total - before;
                let last = len - (n - 1) * PER_BLOCK;
                let factors = u64::from(x_pow_8n(&X2N, after)) | u64::from(x_pow_8n(&X2N, after + last)) << 32;
                words.extend([ptr, len, blocks, factors]);
                blocks += n;
            }
            constants.push(u64::from(item_constant(total)));
        }
        first.push(blocks);
        let ranges = words.len() / 4;
        words.extend_from_slice(&first);
        words.extend_from_slice(&constants);
        Ok(Self { words, ranges, blocks })
    }
}

/// A device's summer, or why its kernels cannot be built.
type Built = std::result::Result<Arc<Mutex<Summer>>, GpuError>;

/// Built summers by device; `Err` (the kernels cannot be built) is kept too.
static SUMMERS: LazyLock<Mutex<HashMap<usize, Built>>> = LazyLock::new(|| Mutex::new(HashMap::new()));

fn summer(ctx: &Arc<CudaContext>, ordinal: usize) -> Result<Arc<Mutex<Summer>>> {
    let mut all = SUMMERS.lock();
    all.entry(ordinal).or_insert_with(|| build(ctx)).clone()
}

fn build(ctx: &Arc<CudaContext>) -> Result<Arc<Mutex<Summer>>> {
    build_from(ctx, source())
}

/// A summer of the kernels in `src` (the source with the names of [`source`]'s).
fn build_from(ctx: &Arc<CudaContext>, src: String) -> Result<Arc<Mutex<Summer>>> {
    if !nvrtc_available() {
        return Err(GpuError::CudaUnavailable("the NVRTC library (libnvrtc.so) is not present".into()));
    }
    guarded("crc32c kernels", || {
        drv("bind", ctx.bind_to_thread())?;
        let (major, minor) = drv("compute capability", ctx.compute_capability())?;
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts).map_err(|e| GpuError::Nvrtc(format!("{e:?}")))?;
        let module = drv("cuModuleLoadData", ctx.load_module(ptx))?;
        let blocks = drv("cuModuleGetFunction", module.load_function("mc_crc32c_blocks"))?;
        let stream = drv("cuStreamCreate", ctx.new_stream())?;
        let summer = Summer {
            ctx: ctx.clone(),
            stream,
            blocks,
            scratch: 0,
            scratch_bytes: 0,
            arrived: 0,
            arrived_bytes: 0,
            io: std::ptr::null_mut(),
            io_dev: 0,
            io_bytes: 0,
        };
        Ok(Arc::new(Mutex::new(summer)))
    })
}

/// Whether `e` says the kernels cannot be built here (then the caller sums
/// another way).
pub(crate) fn unavailable(e: &GpuError) -> bool {
    matches!(e, GpuError::CudaUnavailable(_) | GpuError::Nvrtc(_))
}

/// The crc32c of each item, an item being device ranges `(address, length)` whose
/// bytes are summed one after the other, in one batch: the kernel enqueued on
/// `stream` (after whatever was enqueued there before: the copies that wrote the
/// bytes) and the stream synchronized once; on the summer's own stream where
/// `stream` is `None`. One launch however many items and ranges (a batch's
/// objects, each of per-layer parts), its table as parameters up to 47 ranges
/// (one copy up beyond), its results written into mapped host memory. On `Ok`,
/// everything enqueued on `stream` before the call has completed.
pub(crate) fn crc32c_each(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    stream: Option<sys::CUstream>,
    items: &[Vec<(u64, u64)>],
) -> Result<Vec<u32>> {
    let batch = Batch::of(items)?;
    if batch.blocks == 0 {
        return Ok(vec![0; items.len()]);
    }
    sum_with(&*summer(ctx, ordinal)?, stream, &batch, items.len())
}

/// The sums of the `n` items of `batch` (of at least one block) with the
/// kernels of `summer`: [`crc32c_each`].
fn sum_with(summer: &Mutex<Summer>, stream: Option<sys::CUstream>, batch: &Batch, n: usize) -> Result<Vec<u32>> {
    let layout = Layout::of(n, batch.ranges);
    let mut s = summer.lock();
    guarded("crc32c on the device", || {
        drv("bind", s.ctx.bind_to_thread())?;
        // Every use synchronized its stream before giving the lock up: no copy or
        // kernel of another stream still uses the old buffers.
        let s = &mut *s;
        grow_device(&mut s.scratch, &mut s.scratch_bytes, layout.words)?;
        // The counters and accumulators are zeroed once, when allocated: each
        // launch leaves them so.
        if grow_device(&mut s.arrived, &mut s.arrived_bytes, 8 * n)? {
            // SAFETY: `arrived` is the live allocation of `arrived_bytes` just made.
            let zeroed = drv("cuMemsetD8", unsafe { cu::memset_d8_sync(s.arrived, 0, s.arrived_bytes) });
            if zeroed.is_err() {
                // Not known to be zero: allocated (and zeroed) again next time.
                s.arrived_bytes = 0;
            }
            zeroed?;
        }
        if s.io_bytes < layout.io {
            if !s.io.is_null() {
                // SAFETY: allocated below; no copy in flight uses it.
                drv("cuMemFreeHost", unsafe { cu::free_host(s.io.cast()) })?;
                (s.io, s.io_bytes) = (std::ptr::null_mut(), 0);
            }
            let bytes = layout.io.next_power_of_two().max(64);
            // Owned by `s` (freed in its Drop).
            (s.io, s.io_dev) = alloc_mapped_host(bytes)?;
            s.io_bytes = bytes;
        }
        let on = stream.unwrap_or_else(|| s.stream.cu_stream());
        let summed = enqueue(s, on, batch, n, &layout);
        // SAFETY: `on` is a live stream of this context. Synchronized even when
        // an enqueue failed: nothing of it may still use the buffers once the
        // lock is given up.
        let synced = drv("cuStreamSynchronize", unsafe { cu::stream::synchronize(on) });
        if summed.is_err() || synced.is_err() {
            // A launch that did not run to its end may leave counters short of
            // zero and accumulators not taken: zeroed for the next.
            // SAFETY: `arrived` is a live allocation of `arrived_bytes`; nothing
            // runs now.
            let _ = unsafe { cu::memset_d8_sync(s.arrived, 0, s.arrived_bytes) };
        }
        summed?;
        synced?;
        // SAFETY: the io buffer holds the results at `io_results` (4-byte
        // aligned: after 8-byte words), written by the kernels enqueued above,
        // which have completed; it lives under the lock.
        let results = unsafe { std::slice::from_raw_parts(s.io.add(layout.io_results).cast::<u32>(), n) };
        Ok(results.to_vec())
    })
}

/// Makes the device allocation `ptr` of `have` bytes (0 and 0 for none) at
/// least `need` bytes (a power of two), in the bound context, with no work in
/// flight using it; its old bytes are not kept. Whether it was allocated anew.
fn grow_device(ptr: &mut sys::CUdeviceptr, have: &mut usize, need: usize) -> Result<bool> {
    if *have >= need {
        return Ok(false);
    }
    if *ptr != 0 {
        // SAFETY: allocated below in this context, freed once; no work in flight
        // uses it (the caller's contract).
        drv("cuMemFree", unsafe { cu::free_sync(*ptr) })?;
        (*ptr, *have) = (0, 0);
    }
    let bytes = need.next_power_of_two();
    // SAFETY: a plain device allocation, owned by the caller's summer (freed in
    // its Drop).
    *ptr = drv("cuMemAlloc", unsafe { cu::malloc_sync(bytes) })?;
    *have = bytes;
    Ok(true)
}

/// Enqueues the sums of a batch of `n` items on `on`: the range table and the
/// items' first blocks as the launch's parameters where they fit (else copied
/// up to the device first), then one launch over every range's blocks, whose
/// last block of each item writes its sum. The results land in the io buffer, written
/// there by the kernel: nothing to copy back.
fn enqueue(s: &Summer, on: sys::CUstream, batch: &Batch, n: usize, layout: &Layout) -> Result<()> {
    let Batch { words: table, ranges: n_ranges, blocks: block } = batch;
    let (n_ranges, block) = (*n_ranges, *block);
    debug_assert_eq!(table.len() * 8, layout.words);
    // An item of no bytes has no block to write its result: 0, written here.
    // SAFETY: the io buffer has room for `n` results at `io_results` (4-byte
    // aligned); no kernel writes it now (the lock is held, every use synchronized).
    unsafe { std::ptr::write_bytes(s.io.add(layout.io_results).cast::<u32>(), 0, n) };
    let mut small = [0u64; TABLE_WORDS];
    let mut table_dev: sys::CUdeviceptr = 0;
    if table.len() <= TABLE_WORDS {
        small[..table.len()].copy_from_slice(table);
    } else {
        // SAFETY: the io buffer has room for the table at its start (the
        // layout), 8-byte aligned (page-locked allocations are); no copy in
        // flight uses it (the lock is held, every use synchronized).
        unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), s.io.cast::<u64>(), table.len()) };
        table_dev = s.scratch;
        // SAFETY: the scratch has room for the table; the host words stay unchanged until the stream is synchronized
        // (under the lock); `on` is a live stream of this context.
        drv("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(table_dev, s.io.cast::<c_void>(), layout.words, on).result()
        })?;
    }
    let too_many = |what: &str, v: usize| GpuError::InvalidArgument(format!("crc32c of {v} {what}"));
    let grid = u32::try_from(block).map_err(|_| too_many("blocks", block as usize))?;
    let mut n_ranges32 = u32::try_from(n_ranges).map_err(|_| too_many("ranges", n_ranges))?;
    let mut n_items32 = u32::try_from(n).map_err(|_| too_many("items", n))?;
    let mut arrived = s.arrived;
    let mut acc = s.arrived + 4 * n as u64;
    let mut results = s.io_dev + layout.io_results as u64;
    let mut args = [
        (&raw mut small).cast::<c_void>(),
        (&raw mut table_dev).cast::<c_void>(),
        (&raw mut n_ranges32).cast::<c_void>(),
        (&raw mut n_items32).cast::<c_void>(),
        (&raw mut arrived).cast::<c_void>(),
        (&raw mut acc).cast::<c_void>(),
        (&raw mut results).cast::<c_void>(),
    ];
    // SAFETY: the arguments match `mc_crc32c_blocks(McTable (TABLE_WORDS u64, by
    // value), const u64*, u32, u32, u32*, u32*, u32*)` and outlive the call (the
    // driver copies them at launch); the kernel reads the table (by value, or
    // uploaded above, stream-ordered) and each range's bytes (device memory of
    // this context, checked by the caller), counts arrivals in `arrived` and
    // accumulates in `acc` (`n` words each, inside the allocation of at least
    // `8 n` bytes) and writes the `n` results into the io buffer.
    drv("launch mc_crc32c_blocks", unsafe {
        cu::launch_kernel(s.blocks.cu_function(), (grid, 1, 1), (THREADS, 1, 1), 0, on, &mut args)
    })
}

/// Test only: launches the kernels over the batch in the file named by its
/// argument (see `driver::CPU_CUDA`); prints each item's result, then each
/// block's sum.
#[cfg(test)]
const CPU_DRIVER: &str = r#"
int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    u64 h[5];
    if (!f || fread(h, 8, 5, f) != 5) return 2;
    u64 ranges = h[0], items = h[1], blocks = h[2], len = h[3], by_value = h[4];
    std::vector<u64> words(4 * ranges + 2 * items + 1);
    std::vector<u8> data(len);
    if (fread(words.data(), 8, words.size(), f) != words.size() || fread(data.data(), 1, len, f) != len) return 3;
    for (u64 r = 0; r < ranges; r++) words[4 * r] += (u64)data.data();
    static McTable small;
    const u64* table = words.data();
    if (by_value) {
        if (words.size() > MC_TABLE_WORDS) return 4;
        for (u64 i = 0; i < words.size(); i++) small.w[i] = words[i];
        table = nullptr;
    }
    std::vector<u32> arrived(items, 0), acc(items, 0), results(items, 0);
    launch((unsigned)blocks, 1, MC_THREADS, [&] {
        mc_crc32c_blocks(small, table, (u32)ranges, (u32)items, arrived.data(), acc.data(), results.data());
    });
    for (u64 i = 0; i < items; i++) printf("%u\n", results[i]);
    for (u64 i = 0; i < items; i++) printf("%u\n", arrived[i] | acc[i]);
    return 0;
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// The bare remainder of `bytes` (a zero register, no final inversion).
    fn bare(bytes: &[u8]) -> u32 {
        crc32c::crc32c(bytes) ^ item_constant(bytes.len() as u64)
    }

    /// The kernel's `mc_blocks_op`, on the host: one entry of the block-shift
    /// tables a nonzero base-64 digit.
    fn blocks_op(tables: &[Vec<u32>], mut m: u64) -> u32 {
        let mut p = ONE;
        for row in tables {
            if m == 0 {
                break;
            }
            let d = (m & 63) as usize;
            if d != 0 {
                p = mul_mod_p(row[d], p);
            }
            m >>= 6;
        }
        p
    }

    /// What the kernel computes from a batch's table, on the host, with the
    /// kernel's arithmetic but whole blocks summed by the `crc32c` crate: each
    /// block's bare remainder moved past the bytes of its item after it (by the
    /// range's factors and the block-shift tables), XORed into its item, and the
    /// item's constant. `data` stands for memory (addresses are offsets in it).
    fn model(batch: &Batch, n_items: usize, data: &[u8]) -> Vec<u32> {
        let tables = blocks_table(&X2N);
        let w = &batch.words;
        let first = &w[4 * batch.ranges..4 * batch.ranges + n_items + 1];
        let mut acc = vec![0u32; n_items];
        for r in 0..batch.ranges {
            let (at, len, first_block, factors) = (w[4 * r], w[4 * r + 1], w[4 * r + 2], w[4 * r + 3]);
            let nb = len.div_ceil(PER_BLOCK);
            for bi in 0..nb {
                let b = first_block + bi;
                let item = first.iter().rposition(|&f| f <= b).unwrap().min(n_items - 1);
                let start = (at + bi * PER_BLOCK) as usize;
                let end = (at + len).min(at + (bi + 1) * PER_BLOCK) as usize;
                let f = if bi + 1 == nb {
                    factors as u32
                } else {
                    mul_mod_p(blocks_op(&tables, nb - 2 - bi), (factors >> 32) as u32)
                };
                acc[item] ^= mul_mod_p(f, bare(&data[start..end]));
            }
        }
        (0..n_items)
            .map(|i| if first[i] == first[i + 1] { 0 } else { acc[i] ^ w[4 * batch.ranges + n_items + 1 + i] as u32 })
            .collect()
    }

    /// A power-of-two length's factor is one entry of the `x^(2^k)` table; the
    /// block-shift tables give `x^(8 * PER_BLOCK * m)` for any count of blocks
    /// they cover; the tables the kernel copies are the crc32c's.
    #[test]
    fn the_tables_are_the_factors_they_stand_for() {
        let t = &*X2N;
        for j in 0..40 {
            assert_eq!(x_pow_8n(t, 1 << j), t[j + 3], "2^{j} bytes");
        }
        let tables = blocks_table(t);
        for m in [0u64, 1, 2, 63, 64, 65, 4095, 4096, 262_143, 1 << 30, (1 << 36) - 1] {
            assert_eq!(blocks_op(&tables, m), x_pow_8n(t, PER_BLOCK * m), "{m} blocks");
        }
        let slice = slice_tables();
        for (i, (&one, &eight)) in slice[0].iter().zip(&slice[7]).enumerate() {
            assert_eq!(one, bare(&[i as u8]), "byte {i}");
            let mut bytes = [0u8; 8];
            bytes[0] = i as u8;
            assert_eq!(eight, bare(&bytes), "byte {i} then seven zeros");
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
        /// The kernel's arithmetic (the model, over the host's tables and
        /// factors) gives the crc32c of every item, whatever its ranges: empty
        /// items and ranges, ranges of one block and of more than 64.
        #[test]
        fn the_blocks_add_up_to_each_items_sum(
            items in proptest::collection::vec(
                proptest::collection::vec((0u64..3_000_000, 0u64..1_500_000), 0..4), 1..5)
        ) {
            static DATA: LazyLock<Vec<u8>> =
                LazyLock::new(|| (0..4_500_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect());
            let data = &*DATA;
            let batch = Batch::of(&items).unwrap();
            let got = model(&batch, items.len(), data);
            for (i, item) in items.iter().enumerate() {
                let bytes: Vec<u8> =
                    item.iter().flat_map(|&(at, len)| data[at as usize..(at + len) as usize].iter().copied()).collect();
                proptest::prop_assert_eq!(got[i], crc32c::crc32c(&bytes), "item {}", i);
            }
        }
    }

    /// A range of more blocks than the shift tables cover is refused, not
    /// summed wrong.
    #[test]
    fn a_range_beyond_the_tables_is_refused() {
        let too_long = PER_BLOCK << (6 * BLOCK_DIGITS);
        assert!(matches!(Batch::of(&[vec![(0, too_long)]]), Err(GpuError::InvalidArgument(_))));
        assert!(Batch::of(&[vec![(0, too_long - PER_BLOCK)]]).is_ok());
    }

    #[test]
    fn the_source_carries_the_tables_and_the_kernel() {
        let s = source();
        assert!(s.contains("__device__ const unsigned int MC_X2N[64] = {0x40000000u, 0x20000000u, 0x08000000u"));
        assert!(s.contains("void mc_crc32c_blocks("));
        assert!(s.contains(&format!("MC_AFTER[{THREADS}] = {{0x")));
        assert!(s.contains(&format!("MC_T[8][256] = {{{{{:#010x}u, {:#010x}u", 0, slice_tables()[0][1])));
    }

    /// The kernels' own source, run on the CPU: a C++ prelude stands in for CUDA
    /// (a block's threads are threads meeting at a barrier for `__syncthreads`,
    /// `__shared__` arrays are statics, one block at a time), a driver launches
    /// `mc_crc32c_blocks` over a batch built by [`Batch::of`], addresses being
    /// offsets into one data buffer, its table as parameters and in memory. Each
    /// item's result is its bytes' crc32c and every arrival counter is back at
    /// zero: the range and item searches, the shares and their shifts, the
    /// last-block fold (in rounds, for an item of more blocks than threads) are
    /// checked without a GPU. Skipped with a note where no C++20 compiler is
    /// present.
    #[test]
    fn the_kernels_sum_each_item_when_run_on_a_cpu() {
        let data: Vec<u8> = (0..1_300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let batches: Vec<Vec<Vec<(u64, u64)>>> = vec![
            // One item of one byte, one of exactly a block, one spanning blocks.
            vec![vec![(3, 1)], vec![(0, PER_BLOCK)], vec![(10, 200_001)]],
            // Per-layer parts: an item of many ranges, an empty one, one of empty ranges and data.
            vec![
                (0..20u64).map(|l| (l * 40_000 + 7, 1_000 + l * 3_001)).collect(),
                vec![],
                vec![(5, 0), (900_000, 99_999), (17, 0)],
                vec![(123_456, 65_537), (0, 65_535)],
            ],
            // More ranges than the parameters hold: the table goes through memory.
            vec![(0..60u64).map(|l| (l * 16_000 + 16, 9_000 + l)).collect(), vec![(64, 131_072)]],
            // Every item one block: each block writes its item's result itself.
            vec![vec![(1, 100)], vec![(70_000, PER_BLOCK)], vec![(500_000, 4_096)]],
            // One block each but for an empty item, which no block writes.
            vec![vec![(1, 100)], vec![], vec![(500_000, 4_096)]],
            // Ranges of more than 64 blocks (two digits of the block shift), one
            // aligned and whole, one neither; and an item of 300 small ranges.
            vec![vec![(9, 10)], vec![(0, 72 * PER_BLOCK)], vec![(3, 1_299_990)]],
            vec![(0..300u64).map(|l| (l * 3_000 + 5, 100 + l)).collect()],
        ];
        for (n, items) in batches.iter().enumerate() {
            let batch = Batch::of(items).unwrap();
            // The table as the launches' parameters where it fits, and in memory.
            let modes: &[u64] = if batch.words.len() <= TABLE_WORDS { &[1, 0] } else { &[0] };
            for &by_value in modes {
                let mut input: Vec<u8> = Vec::new();
                for w in [batch.ranges as u64, items.len() as u64, batch.blocks, data.len() as u64, by_value] {
                    input.extend(w.to_le_bytes());
                }
                batch.words.iter().for_each(|w| input.extend(w.to_le_bytes()));
                input.extend(&data);
                let program = format!("{}\n{CPU_DRIVER}", source());
                let Some(out) = super::super::driver::run_on_cpu("crc32c", &program, &input) else { return };
                let lines: Vec<u32> = out.lines().map(|l| l.parse().unwrap()).collect();
                let (results, left) = lines.split_at(items.len());
                assert!(left.iter().all(|&a| a == 0), "batch {n}: every counter and accumulator back at zero");
                for (i, item) in items.iter().enumerate() {
                    let bytes: Vec<u8> = item
                        .iter()
                        .flat_map(|&(at, len)| data[at as usize..(at + len) as usize].iter().copied())
                        .collect();
                    assert_eq!(results[i], crc32c::crc32c(&bytes), "batch {n} item {i} by value {by_value}");
                }
            }
        }
        assert!(
            batches.iter().any(|b| Batch::of(b).unwrap().words.len() > TABLE_WORDS),
            "a table too large for parameters"
        );
    }

    /// Where a device sum's time goes, on a GPU (ignored: run by hand,
    /// `--ignored --nocapture`): the wall time of one batch of one item for
    /// kernels with parts of their work cut out of the source, against the
    /// same copies around an empty kernel.
    #[test]
    #[ignore]
    fn profile_device_sums() {
        use super::super::memory::DeviceBuffer;
        let whole = source();
        let variants: Vec<(&str, String)> = vec![
            ("whole", whole.clone()),
            ("no_data", whole.replace("    u64 n = mine;\n    u32 crc = 0;", "    u64 n = 0;\n    u32 crc = t;")),
            ("no_shift", whole.replace("    } else if (t < k) {", "    } else if (t > MC_THREADS) {")),
            ("no_accumulate", whole.replace("    atomicXor(acc + item, part);", "    return;")),
            (
                "empty",
                whole.replace(
                    "    __shared__ u32 T[8][256];",
                    "    if (arrived) return;\n    __shared__ u32 T[8][256];",
                ),
            ),
        ];
        for (name, src) in &variants {
            assert!(*name == "whole" || src != &variants[0].1, "{name}: the cut did not apply");
        }
        let max = 64usize << 20;
        let Ok(buf) = DeviceBuffer::new(0, max) else {
            eprintln!("note: no GPU: nothing to profile");
            return;
        };
        buf.upload(&(0..max).map(|i| (i * 131 % 251) as u8).collect::<Vec<u8>>()).unwrap();
        let ctx = DeviceBuffer::context(0).unwrap();
        for (name, src) in variants {
            let summer = build_from(&ctx, src).unwrap();
            for len in [64u64 << 10, 1 << 20, 4 << 20, 64 << 20] {
                let batch = Batch::of(&[vec![(buf.ptr(), len)]]).unwrap();
                sum_with(&summer, None, &batch, 1).unwrap();
                let n = 200;
                let t = std::time::Instant::now();
                for _ in 0..n {
                    sum_with(&summer, None, &batch, 1).unwrap();
                }
                let us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
                println!("{{\"variant\":\"{name}\",\"bytes\":{len},\"us\":{us:.1}}}");
            }
        }
    }

    /// NVRTC compiles the source (no GPU needed; skipped where NVRTC is absent).
    #[test]
    fn the_source_compiles_with_nvrtc() {
        super::super::driver::assert_compiles_with_nvrtc(source());
    }
}
