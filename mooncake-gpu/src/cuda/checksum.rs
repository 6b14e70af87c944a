//! crc32c (Castagnoli) of CUDA device memory, summed on the device: the check a
//! device get runs on the bytes it moved (and the sum a device put stores),
//! without a second pass of the bytes over PCIe.
//!
//! Two kernels, compiled with NVRTC once per process and device:
//! - `mc_crc32c_blocks`: each block sums 64 KiB; each of its 256 threads sums
//!   256 bytes (slice-by-8 tables in shared memory), and the block folds its
//!   threads' sums in a tree;
//! - `mc_crc32c_fold`: one block per item folds that item's blocks' sums in order
//!   (several items, or several ranges of one item, are summed in one batch).
//!
//! Sums fold with the identity `crc(A ++ B) = crc(A) * x^(8|B|) mod P  ^  crc(B)`
//! (the standard, pre- and post-inverted crc32c of each piece; the empty piece
//! sums to 0), the multiplication in GF(2) modulo the reflected polynomial.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, LazyLock};

use cudarc::driver::{result as cu, sys, CudaContext, CudaFunction, CudaStream};
use parking_lot::Mutex;

use super::driver::{drv, guarded, nvrtc_available};
use crate::error::{GpuError, Result};

/// Threads per block of `mc_crc32c_blocks`.
const THREADS: u32 = 256;
/// Bytes each thread sums.
const PER_THREAD: u64 = 256;
/// Bytes each block sums.
const PER_BLOCK: u64 = THREADS as u64 * PER_THREAD;
/// Threads of the one `mc_crc32c_fold` block.
const FOLD_THREADS: u32 = 1024;

/// The reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;

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

const BODY: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;

#define MC_POLY 0x82F63B78u
#define MC_THREADS 256
#define MC_PER_THREAD 256ull
#define MC_FOLD_THREADS 1024

// a(x) * b(x) mod P, reflected.
__device__ __forceinline__ u32 mc_mul(u32 a, u32 b) {
    u32 p = 0;
    for (u32 m = 1u << 31; m != 0; m >>= 1) {
        if (a & m) p ^= b;
        b = (b & 1) ? (b >> 1) ^ MC_POLY : b >> 1;
    }
    return p;
}

// x^(8 n) mod P: the factor that moves a sum past n bytes.
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

// crc(A ++ B) from crc(A), crc(B) and |B|. A power-of-two |B| (every full piece
// and every full level of a tree) takes its factor from the table: one multiply.
__device__ __forceinline__ u32 mc_combine(u32 a, u32 b, u64 len_b) {
    if (!len_b) return a;
    u32 op = (len_b & (len_b - 1)) == 0 ? MC_X2N[__ffsll((long long)len_b) - 1 + 3] : mc_shift_op(len_b);
    return mc_mul(op, a) ^ b;
}

// Eight bytes (little-endian words lo, hi) into a running sum, slice-by-8.
__device__ __forceinline__ u32 mc_step8(const u32 (*T)[256], u32 crc, u32 lo, u32 hi) {
    lo ^= crc;
    return T[7][lo & 0xff] ^ T[6][(lo >> 8) & 0xff] ^ T[5][(lo >> 16) & 0xff] ^ T[4][lo >> 24]
        ^ T[3][hi & 0xff] ^ T[2][(hi >> 8) & 0xff] ^ T[1][(hi >> 16) & 0xff] ^ T[0][hi >> 24];
}

// Folds the sums c[0..n) (piece i of l[i] bytes) into c[0], l[0] (n a power of two,
// blockDim.x == n).
__device__ void mc_tree(u32* c, u64* l, u32 n) {
    u32 t = threadIdx.x;
    for (u32 s = 1; s < n; s <<= 1) {
        if ((t & (2 * s - 1)) == 0 && l[t + s]) {
            c[t] = mc_combine(c[t], c[t + s], l[t + s]);
            l[t] += l[t + s];
        }
        __syncthreads();
    }
}

// Sums of the 64 KiB blocks of several ranges, one launch for all: range r is
// ranges[3r] (address), ranges[3r + 1] (length, > 0) and ranges[3r + 2] (its first
// block; the firsts increase). Block b sums its share of the last range whose
// first block is <= b, into out[b], and its length into out_len[b].
extern "C" __global__ void mc_crc32c_blocks(const u64* ranges, u32 n_ranges, u32* out, u32* out_len) {
    __shared__ u32 T[8][256];
    __shared__ u32 C[MC_THREADS];
    __shared__ u64 L[MC_THREADS];
    __shared__ u64 R[3];
    u32 t = threadIdx.x;
    if (t == 0) {
        u64 b = blockIdx.x;
        u32 lo = 0, hi = n_ranges;
        while (hi - lo > 1) {
            u32 mid = lo + (hi - lo) / 2;
            if (ranges[3 * (u64)mid + 2] <= b) lo = mid; else hi = mid;
        }
        R[0] = ranges[3 * (u64)lo];
        R[1] = ranges[3 * (u64)lo + 1];
        R[2] = b - ranges[3 * (u64)lo + 2];
    }
    u32 c = t;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ MC_POLY : c >> 1;
    T[0][t] = c;
    __syncthreads();
    for (int k = 1; k < 8; k++) {
        u32 prev = T[k - 1][t];
        T[k][t] = (prev >> 8) ^ T[0][prev & 0xff];
        __syncthreads();
    }
    const u8* data = (const u8*)R[0];
    u64 len = R[1];
    u64 start = (R[2] * MC_THREADS + t) * MC_PER_THREAD;
    u64 mine = start < len ? min(MC_PER_THREAD, len - start) : 0;
    const u8* p = data + start;
    u64 n = mine;
    u32 crc = 0xFFFFFFFFu;
    if (n == MC_PER_THREAD && ((u64)p & 15) == 0) {
        // The common case, a full aligned share: every load is issued before
        // the first is used, so the thread waits for memory once, not once per
        // word (the sum's dependency chain would otherwise serialize them).
        uint4 v[MC_PER_THREAD / 16];
        const uint4* q = (const uint4*)p;
#pragma unroll
        for (int i = 0; i < (int)(MC_PER_THREAD / 16); i++) v[i] = q[i];
#pragma unroll
        for (int i = 0; i < (int)(MC_PER_THREAD / 16); i++) {
            crc = mc_step8(T, crc, v[i].x, v[i].y);
            crc = mc_step8(T, crc, v[i].z, v[i].w);
        }
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
    C[t] = mine ? ~crc : 0;
    L[t] = mine;
    __syncthreads();
    mc_tree(C, L, MC_THREADS);
    if (t == 0) {
        out[blockIdx.x] = C[0];
        out_len[blockIdx.x] = (u32)L[0];
    }
}

// Folds each item's blocks' sums in order (each with its length): block
// `blockIdx.x` of the grid folds item blockIdx.x, whose blocks are
// [first[item], first[item + 1]), into results[item] (0 for an item of no bytes).
extern "C" __global__ void mc_crc32c_fold(const u32* sums, const u32* lens, const u64* first, u32* results) {
    __shared__ u32 C[MC_FOLD_THREADS];
    __shared__ u64 L[MC_FOLD_THREADS];
    u32 t = threadIdx.x;
    u64 from = first[blockIdx.x], to = first[blockIdx.x + 1];
    u32 acc = 0;
    for (u64 g = from; g < to; g += MC_FOLD_THREADS) {
        u64 i = g + t;
        C[t] = i < to ? sums[i] : 0;
        L[t] = i < to ? (u64)lens[i] : 0;
        __syncthreads();
        mc_tree(C, L, MC_FOLD_THREADS);
        if (t == 0) acc = mc_combine(acc, C[0], L[0]);
        __syncthreads();
    }
    if (t == 0) results[blockIdx.x] = acc;
}
"#;

/// The kernels' source: the `x^(2^k)` table, then the body.
fn source() -> String {
    let table: Vec<String> = x2n_table().iter().map(|v| format!("{v:#010x}u")).collect();
    format!("__device__ const unsigned int MC_X2N[64] = {{{}}};\n{BODY}", table.join(", "))
}

/// The kernels of one device, with their stream, a device scratch and a
/// page-locked host buffer.
struct Summer {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blocks: CudaFunction,
    fold: CudaFunction,
    /// Device scratch: the blocks' sums and lengths, the items' results and the
    /// items' first blocks ([`Layout`]).
    scratch: sys::CUdeviceptr,
    /// Its size in bytes.
    scratch_bytes: usize,
    /// Page-locked host memory: the items' first blocks on their way to the
    /// device, and the results on their way back ([`Layout`]).
    io: *mut u8,
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
            if self.scratch != 0 {
                // SAFETY: allocated by `cuMemAlloc` in this context, freed once.
                drv("cuMemFree", unsafe { cu::free_sync(self.scratch) })?;
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

/// Where a batch of `items` items, `ranges` ranges and `blocks` blocks keeps
/// what, in bytes. On the device: the blocks' sums, their lengths, the items'
/// results, then the range table (3 words a range) and the items' first blocks
/// (`items + 1` words). On the host: the same table and first blocks, on their way
/// up, then the results, on their way back.
struct Layout {
    lens: usize,
    results: usize,
    /// Where the table starts on the device (8-byte aligned).
    table: usize,
    /// Bytes of the table and the first blocks.
    words: usize,
    scratch: usize,
    io_results: usize,
    io: usize,
}

impl Layout {
    fn of(items: usize, ranges: usize, blocks: usize) -> Self {
        let (lens, results) = (4 * blocks, 8 * blocks);
        let table = (results + 4 * items).next_multiple_of(8);
        let words = 8 * (3 * ranges + items + 1);
        Self { lens, results, table, words, scratch: table + words, io_results: words, io: words + 4 * items }
    }
}

/// What the kernels of one batch read: the range table (address, length, first
/// block of each non-empty range), then each item's first block and, last, the
/// number of blocks.
struct Batch {
    words: Vec<u64>,
    ranges: usize,
    blocks: u64,
    /// Every item is one block: its block's sum is its result (no fold).
    one_block_each: bool,
}

impl Batch {
    fn of(items: &[Vec<(u64, u64)>]) -> Self {
        let mut words: Vec<u64> = Vec::new();
        let mut first: Vec<u64> = Vec::with_capacity(items.len() + 1);
        let mut blocks = 0u64;
        for item in items {
            first.push(blocks);
            for &(ptr, len) in item.iter().filter(|&&(_, len)| len > 0) {
                words.extend([ptr, len, blocks]);
                blocks += len.div_ceil(PER_BLOCK);
            }
        }
        first.push(blocks);
        let one_block_each = first.windows(2).all(|w| w[1] - w[0] == 1);
        let ranges = words.len() / 3;
        words.extend_from_slice(&first);
        Self { words, ranges, blocks, one_block_each }
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
        let ptx =
            cudarc::nvrtc::compile_ptx_with_opts(source(), opts).map_err(|e| GpuError::Nvrtc(format!("{e:?}")))?;
        let module = drv("cuModuleLoadData", ctx.load_module(ptx))?;
        let blocks = drv("cuModuleGetFunction", module.load_function("mc_crc32c_blocks"))?;
        let fold = drv("cuModuleGetFunction", module.load_function("mc_crc32c_fold"))?;
        let stream = drv("cuStreamCreate", ctx.new_stream())?;
        let summer = Summer {
            ctx: ctx.clone(),
            stream,
            blocks,
            fold,
            scratch: 0,
            scratch_bytes: 0,
            io: std::ptr::null_mut(),
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
/// bytes are summed one after the other, in one batch: the kernels enqueued on
/// `stream` (after whatever was enqueued there before: the copies that wrote the
/// bytes) and the stream synchronized once; on the summer's own stream where
/// `stream` is `None`. One copy of the range table up, one launch for every
/// range's blocks, one fold for all the items, one copy of the results back,
/// however many items and ranges (a batch's objects, each of per-layer parts). On
/// `Ok`, everything enqueued on `stream` before the call has completed.
pub(crate) fn crc32c_each(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    stream: Option<sys::CUstream>,
    items: &[Vec<(u64, u64)>],
) -> Result<Vec<u32>> {
    let batch = Batch::of(items);
    if batch.blocks == 0 {
        return Ok(vec![0; items.len()]);
    }
    let blocks = usize::try_from(batch.blocks)
        .map_err(|_| GpuError::InvalidArgument(format!("crc32c of {} blocks", batch.blocks)))?;
    let layout = Layout::of(items.len(), batch.ranges, blocks);
    let summer = summer(ctx, ordinal)?;
    let mut s = summer.lock();
    guarded("crc32c on the device", || {
        drv("bind", s.ctx.bind_to_thread())?;
        // Every use synchronized its stream before giving the lock up: no copy or
        // kernel of another stream still uses the old buffers.
        if s.scratch_bytes < layout.scratch {
            if s.scratch != 0 {
                // SAFETY: allocated below in this context; no work in flight uses it.
                drv("cuMemFree", unsafe { cu::free_sync(s.scratch) })?;
                (s.scratch, s.scratch_bytes) = (0, 0);
            }
            let bytes = layout.scratch.next_power_of_two();
            // SAFETY: a plain device allocation, owned by `s` (freed in its Drop).
            s.scratch = drv("cuMemAlloc", unsafe { cu::malloc_sync(bytes) })?;
            s.scratch_bytes = bytes;
        }
        if s.io_bytes < layout.io {
            if !s.io.is_null() {
                // SAFETY: allocated below; no copy in flight uses it.
                drv("cuMemFreeHost", unsafe { cu::free_host(s.io.cast()) })?;
                (s.io, s.io_bytes) = (std::ptr::null_mut(), 0);
            }
            let bytes = layout.io.next_power_of_two().max(64);
            // SAFETY: a plain page-locked allocation, owned by `s` (freed in its Drop).
            s.io = drv("cuMemHostAlloc", unsafe { cu::malloc_host(bytes, 0) })?.cast();
            s.io_bytes = bytes;
        }
        let on = stream.unwrap_or_else(|| s.stream.cu_stream());
        let summed = enqueue(&s, on, &batch, items.len(), &layout);
        // SAFETY: `on` is a live stream of this context. Synchronized even when
        // an enqueue failed: nothing of it may still use the buffers once the
        // lock is given up.
        let synced = drv("cuStreamSynchronize", unsafe { cu::stream::synchronize(on) });
        summed?;
        synced?;
        // SAFETY: the io buffer holds the results at `io_results` (4-byte
        // aligned: after 8-byte words), written by the copy enqueued above,
        // which has completed; it lives under the lock.
        let results = unsafe { std::slice::from_raw_parts(s.io.add(layout.io_results).cast::<u32>(), items.len()) };
        Ok(results.to_vec())
    })
}

/// Enqueues the sums of a batch of `n` items on `on`: the range table and the items' first
/// blocks up to the device, the blocks' kernel over every range (block sums and
/// lengths, item after item, into one array), then, unless every item is one
/// block (its sum is its result), the fold; last the results' copy into the io
/// buffer.
fn enqueue(s: &Summer, on: sys::CUstream, batch: &Batch, n: usize, layout: &Layout) -> Result<()> {
    let Batch { words: table, ranges: n_ranges, blocks: block, one_block_each } = batch;
    let (n_ranges, block) = (*n_ranges, *block);
    debug_assert_eq!(table.len() * 8, layout.words);
    // SAFETY: the io buffer has room for the table and the first blocks at its
    // start (the layout), 8-byte aligned (page-locked allocations are); no copy in
    // flight uses it (the lock is held, every use synchronized).
    unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), s.io.cast::<u64>(), table.len()) };
    let (mut sums, mut lens) = (s.scratch, s.scratch + layout.lens as u64);
    let mut table_dev = s.scratch + layout.table as u64;
    // SAFETY: the scratch has room for the table and the first blocks at
    // `table`; the host words stay unchanged until the stream is synchronized
    // (under the lock); `on` is a live stream of this context.
    drv("cuMemcpyHtoDAsync", unsafe {
        sys::cuMemcpyHtoDAsync_v2(table_dev, s.io.cast::<c_void>(), layout.words, on).result()
    })?;
    let grid = u32::try_from(block).map_err(|_| GpuError::InvalidArgument(format!("crc32c of {block} blocks")))?;
    let mut n_ranges32 =
        u32::try_from(n_ranges).map_err(|_| GpuError::InvalidArgument(format!("crc32c of {n_ranges} ranges")))?;
    let mut args = [
        (&raw mut table_dev).cast::<c_void>(),
        (&raw mut n_ranges32).cast::<c_void>(),
        (&raw mut sums).cast::<c_void>(),
        (&raw mut lens).cast::<c_void>(),
    ];
    // SAFETY: the arguments match `mc_crc32c_blocks(const u64*, u32, u32*,
    // u32*)` and outlive the call (the driver copies them at launch); the kernel
    // reads the table (uploaded above, stream-ordered) and each range's bytes
    // (device memory of this context, checked by the caller), and writes one sum
    // and one length per block, `block` of each, inside the scratch.
    drv("launch mc_crc32c_blocks", unsafe {
        cu::launch_kernel(s.blocks.cu_function(), (grid, 1, 1), (THREADS, 1, 1), 0, on, &mut args)
    })?;
    let from = if *one_block_each {
        sums
    } else {
        let mut first_dev = table_dev + 8 * 3 * n_ranges as u64;
        let mut results = s.scratch + layout.results as u64;
        let items32 = u32::try_from(n).map_err(|_| GpuError::InvalidArgument(format!("crc32c of {n} items")))?;
        let mut args = [
            (&raw mut sums).cast::<c_void>(),
            (&raw mut lens).cast::<c_void>(),
            (&raw mut first_dev).cast::<c_void>(),
            (&raw mut results).cast::<c_void>(),
        ];
        // SAFETY: the arguments match `mc_crc32c_fold(const u32*, const u32*,
        // const u64*, u32*)`; block i reads item i's blocks' sums and lengths and
        // writes results[i], all inside the scratch.
        drv("launch mc_crc32c_fold", unsafe {
            cu::launch_kernel(s.fold.cu_function(), (items32, 1, 1), (FOLD_THREADS, 1, 1), 0, on, &mut args)
        })?;
        results
    };
    // SAFETY: `from` holds n results in the scratch; the io buffer has room for
    // them at `io_results`, read after the caller's synchronize.
    drv("cuMemcpyDtoHAsync", unsafe {
        sys::cuMemcpyDtoHAsync_v2(s.io.add(layout.io_results).cast::<c_void>(), from, 4 * n, on).result()
    })
}

/// Test only: launches the kernels over the batch in the file named by its
/// argument (see `driver::CPU_CUDA`); prints each item's result, then each
/// block's sum.
#[cfg(test)]
const CPU_DRIVER: &str = r#"
int main(int argc, char** argv) {
    FILE* f = fopen(argv[1], "rb");
    u64 h[4];
    if (!f || fread(h, 8, 4, f) != 4) return 2;
    u64 ranges = h[0], items = h[1], blocks = h[2], len = h[3];
    std::vector<u64> words(3 * ranges + items + 1);
    std::vector<u8> data(len);
    if (fread(words.data(), 8, words.size(), f) != words.size() || fread(data.data(), 1, len, f) != len) return 3;
    for (u64 r = 0; r < ranges; r++) words[3 * r] += (u64)data.data();
    std::vector<u32> sums(blocks), lens(blocks), results(items);
    launch((unsigned)blocks, 1, MC_THREADS, [&] {
        mc_crc32c_blocks(words.data(), (u32)ranges, sums.data(), lens.data());
    });
    launch((unsigned)items, 1, MC_FOLD_THREADS, [&] {
        mc_crc32c_fold(sums.data(), lens.data(), words.data() + 3 * ranges, results.data());
    });
    for (u64 i = 0; i < items; i++) printf("%u\n", results[i]);
    for (u64 b = 0; b < blocks; b++) printf("%u\n", sums[b]);
    return 0;
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    /// The fold identity the kernels use, on the host: folding the standard sums
    /// of the pieces with `x^(8|B|)` from the table gives the sum of the whole.
    #[test]
    fn pieces_fold_into_the_sum_of_the_whole() {
        let t = x2n_table();
        let shift_op = |mut n: u64| {
            let (mut p, mut k) = (1u32 << 31, 3);
            while n != 0 {
                if n & 1 != 0 {
                    p = mul_mod_p(t[k], p);
                }
                n >>= 1;
                k += 1;
            }
            p
        };
        // A power-of-two length's factor is one entry of the table (the kernels'
        // short cut): x^(8 * 2^j) = x^(2^(j + 3)).
        for j in 0..40 {
            assert_eq!(shift_op(1 << j), t[j + 3], "2^{j} bytes");
        }
        let combine = |a: u32, b: u32, len_b: u64| if len_b == 0 { a } else { mul_mod_p(shift_op(len_b), a) ^ b };
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for cut in [0usize, 1, 7, 256, 65_536, 123_457, 299_999, 300_000] {
            let (a, b) = data.split_at(cut);
            let folded = combine(crc32c::crc32c(a), crc32c::crc32c(b), b.len() as u64);
            assert_eq!(folded, crc32c::crc32c(&data), "cut at {cut}");
        }
        // Many pieces of the kernels' sizes, folded in order from the empty sum.
        let mut acc = 0;
        for piece in data.chunks(PER_THREAD as usize) {
            acc = combine(acc, crc32c::crc32c(piece), piece.len() as u64);
        }
        assert_eq!(acc, crc32c::crc32c(&data));
    }

    #[test]
    fn the_source_carries_the_table_and_both_kernels() {
        let s = source();
        assert!(s.starts_with("__device__ const unsigned int MC_X2N[64] = {0x40000000u, 0x20000000u, 0x08000000u"));
        assert!(s.contains("mc_crc32c_blocks") && s.contains("mc_crc32c_fold"));
    }

    /// The kernels' own source, run on the CPU: a C++ prelude stands in for CUDA
    /// (a block's threads are threads meeting at a barrier for `__syncthreads`,
    /// `__shared__` arrays are statics, one block at a time), a driver launches
    /// `mc_crc32c_blocks` and `mc_crc32c_fold` over a batch built by
    /// [`Batch::of`], addresses being offsets into one data buffer. Each item's
    /// result is its bytes' crc32c: the range table, the binary search, the
    /// blocks' shares and the fold are checked without a GPU. Skipped with a note
    /// where no C++20 compiler is present.
    #[test]
    fn the_kernels_sum_each_item_when_run_on_a_cpu() {
        let data: Vec<u8> = (0..1_000_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let batches: Vec<Vec<Vec<(u64, u64)>>> = vec![
            // One item of one byte, one of exactly a block, one spanning blocks.
            vec![vec![(3, 1)], vec![(0, 65_536)], vec![(10, 200_001)]],
            // Per-layer parts: an item of many ranges, an empty one, one of empty ranges and data.
            vec![
                (0..20u64).map(|l| (l * 40_000 + 7, 1_000 + l * 3_001)).collect(),
                vec![],
                vec![(5, 0), (900_000, 99_999), (17, 0)],
                vec![(123_456, 65_537), (0, 65_535)],
            ],
            // Every item one block: what the fold would skip.
            vec![vec![(1, 100)], vec![(70_000, 65_536)], vec![(500_000, 4_096)]],
            // One block each but for an empty item: folded (the blocks' sums are
            // not the items' results one for one).
            vec![vec![(1, 100)], vec![], vec![(500_000, 4_096)]],
        ];
        for (n, items) in batches.iter().enumerate() {
            let batch = Batch::of(items);
            let mut input: Vec<u8> = Vec::new();
            for w in [batch.ranges as u64, items.len() as u64, batch.blocks, data.len() as u64] {
                input.extend(w.to_le_bytes());
            }
            batch.words.iter().for_each(|w| input.extend(w.to_le_bytes()));
            input.extend(&data);
            let program = format!("{}\n{CPU_DRIVER}", source());
            let Some(out) = super::super::driver::run_on_cpu("crc32c", &program, &input) else { return };
            let lines: Vec<u32> = out.lines().map(|l| l.parse().unwrap()).collect();
            let (results, sums) = lines.split_at(items.len());
            for (i, item) in items.iter().enumerate() {
                let bytes: Vec<u8> =
                    item.iter().flat_map(|&(at, len)| data[at as usize..(at + len) as usize].iter().copied()).collect();
                assert_eq!(results[i], crc32c::crc32c(&bytes), "batch {n} item {i}");
                if batch.one_block_each {
                    assert_eq!(sums[i], results[i], "batch {n} item {i}: its block's sum is its result");
                }
            }
            assert_eq!(batch.one_block_each, n == 2, "batch {n}");
        }
    }

    /// NVRTC compiles the source (no GPU needed; skipped where NVRTC is absent).
    #[test]
    fn the_source_compiles_with_nvrtc() {
        super::super::driver::assert_compiles_with_nvrtc(source());
    }
}
