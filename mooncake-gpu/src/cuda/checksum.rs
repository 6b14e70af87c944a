//! crc32c (Castagnoli) of CUDA device memory, summed on the device: the check a
//! device get runs on the bytes it moved (and the sum a device put stores),
//! without a second pass of the bytes over PCIe.
//!
//! Two kernels, compiled with NVRTC once per process and device:
//! - `mc_crc32c_blocks`: each block sums 64 KiB; each of its 256 threads sums
//!   256 bytes (slice-by-8 tables in shared memory), and the block folds its
//!   threads' sums in a tree;
//! - `mc_crc32c_fold`: one block folds the blocks' sums in order.
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

// Sums of the 64 KiB blocks of [data, data + len): block b's sum into out[b], its
// length into out_len[b] (several ranges, one launch each, fill one array).
extern "C" __global__ void mc_crc32c_blocks(const u8* data, u64 len, u32* out, u32* out_len) {
    __shared__ u32 T[8][256];
    __shared__ u32 C[MC_THREADS];
    __shared__ u64 L[MC_THREADS];
    u32 t = threadIdx.x;
    u32 c = t;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ MC_POLY : c >> 1;
    T[0][t] = c;
    __syncthreads();
    for (int k = 1; k < 8; k++) {
        u32 prev = T[k - 1][t];
        T[k][t] = (prev >> 8) ^ T[0][prev & 0xff];
        __syncthreads();
    }
    u64 start = ((u64)blockIdx.x * MC_THREADS + t) * MC_PER_THREAD;
    u64 mine = start < len ? min(MC_PER_THREAD, len - start) : 0;
    const u8* p = data + start;
    u64 n = mine;
    u32 crc = 0xFFFFFFFFu;
    while (n && ((u64)p & 7)) {
        crc = T[0][(crc ^ *p) & 0xff] ^ (crc >> 8);
        p++;
        n--;
    }
    const u64* w = (const u64*)p;
    while (n >= 8) {
        u64 v = *w++;
        u32 lo = (u32)v ^ crc;
        u32 hi = (u32)(v >> 32);
        crc = T[7][lo & 0xff] ^ T[6][(lo >> 8) & 0xff] ^ T[5][(lo >> 16) & 0xff] ^ T[4][lo >> 24]
            ^ T[3][hi & 0xff] ^ T[2][(hi >> 8) & 0xff] ^ T[1][(hi >> 16) & 0xff] ^ T[0][hi >> 24];
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

// Folds the blocks' sums in order (each with its length) into *result.
extern "C" __global__ void mc_crc32c_fold(const u32* sums, const u32* lens, u64 blocks, u32* result) {
    __shared__ u32 C[MC_FOLD_THREADS];
    __shared__ u64 L[MC_FOLD_THREADS];
    u32 t = threadIdx.x;
    u32 acc = 0;
    for (u64 g = 0; g < blocks; g += MC_FOLD_THREADS) {
        u64 i = g + t;
        C[t] = i < blocks ? sums[i] : 0;
        L[t] = i < blocks ? (u64)lens[i] : 0;
        __syncthreads();
        mc_tree(C, L, MC_FOLD_THREADS);
        if (t == 0) acc = mc_combine(acc, C[0], L[0]);
        __syncthreads();
    }
    if (t == 0) *result = acc;
}
"#;

/// The kernels' source: the `x^(2^k)` table, then the body.
fn source() -> String {
    let table: Vec<String> = x2n_table().iter().map(|v| format!("{v:#010x}u")).collect();
    format!("__device__ const unsigned int MC_X2N[64] = {{{}}};\n{BODY}", table.join(", "))
}

/// The kernels of one device, with their stream and a scratch allocation.
struct Summer {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blocks: CudaFunction,
    fold: CudaFunction,
    /// Device scratch for the blocks' sums (and the result after them).
    scratch: sys::CUdeviceptr,
    /// Its capacity in sums.
    capacity: u64,
    /// Page-locked host memory the result is copied into (an asynchronous copy
    /// on the summer's stream, waited for once).
    result: *mut u32,
}

// SAFETY: the scratch and result pointers are allocations owned by this value,
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
            // SAFETY: allocated by `cuMemHostAlloc` in `build`, freed once, no copy
            // into it in flight (the stream was synchronized).
            drv("cuMemFreeHost", unsafe { cu::free_host(self.result.cast()) })
        });
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
        // SAFETY: a plain page-locked allocation of one u32, owned by the Summer.
        let result = drv("cuMemHostAlloc", unsafe { cu::malloc_host(4, 0) })?.cast::<u32>();
        let summer = Summer { ctx: ctx.clone(), stream, blocks, fold, scratch: 0, capacity: 0, result };
        Ok(Arc::new(Mutex::new(summer)))
    })
}

/// Whether `e` says the kernels cannot be built here (then the caller sums
/// another way).
pub(crate) fn unavailable(e: &GpuError) -> bool {
    matches!(e, GpuError::CudaUnavailable(_) | GpuError::Nvrtc(_))
}

/// crc32c of the `len` bytes at device address `ptr` (of device `ordinal`, in
/// `ctx`). Work queued on other streams before the call is not waited for: the
/// caller synchronized what wrote the bytes.
pub(crate) fn crc32c(ctx: &Arc<CudaContext>, ordinal: usize, ptr: u64, len: u64) -> Result<u32> {
    crc32c_on(ctx, ordinal, None, &[(ptr, len)])
}

/// crc32c of the bytes of `ranges` (device address, length) one after the other,
/// its kernels enqueued on `stream` (after whatever was enqueued there before: the
/// copies that wrote the bytes) and the stream synchronized once; on the summer's
/// own stream where `stream` is `None`. One launch per range and one fold for them
/// all, however many ranges (a block's per-layer parts). On `Ok`, everything
/// enqueued on `stream` before the call has completed.
pub(crate) fn crc32c_on(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    stream: Option<sys::CUstream>,
    ranges: &[(u64, u64)],
) -> Result<u32> {
    let ranges: Vec<(u64, u64)> = ranges.iter().copied().filter(|&(_, len)| len > 0).collect();
    let blocks: u64 = ranges.iter().map(|&(_, len)| len.div_ceil(PER_BLOCK)).sum();
    if blocks == 0 {
        return Ok(0);
    }
    let summer = summer(ctx, ordinal)?;
    let mut s = summer.lock();
    guarded("crc32c on the device", || {
        drv("bind", s.ctx.bind_to_thread())?;
        // Per block a sum and a length, and the result after them.
        if s.capacity < 2 * blocks + 1 {
            // Every use synchronized its stream before giving the lock up: no
            // kernel of another stream still reads the old scratch.
            if s.scratch != 0 {
                // SAFETY: allocated below in this context; no work in flight uses it.
                drv("cuMemFree", unsafe { cu::free_sync(s.scratch) })?;
                s.scratch = 0;
            }
            let capacity = (2 * blocks + 1).next_power_of_two();
            let bytes = usize::try_from(capacity * 4).map_err(|_| GpuError::InvalidArgument("crc32c range".into()))?;
            // SAFETY: a plain device allocation, owned by `s` (freed in its Drop).
            s.scratch = drv("cuMemAlloc", unsafe { cu::malloc_sync(bytes) })?;
            s.capacity = capacity;
        }
        let on = stream.unwrap_or_else(|| s.stream.cu_stream());
        let summed = enqueue(&s, on, &ranges, blocks);
        // SAFETY: `on` is a live stream of this context. Synchronized even when
        // an enqueue failed: nothing of it may still use the scratch once the
        // lock is given up.
        let synced = drv("cuStreamSynchronize", unsafe { cu::stream::synchronize(on) });
        summed?;
        synced?;
        // SAFETY: `s.result` is a live page-locked u32 owned by the summer (under
        // its lock), written by the copy enqueued above, which has completed.
        Ok(unsafe { s.result.read() })
    })
}

/// Enqueues the sum of `ranges` (non-empty ones, `blocks` blocks in all) on `on`:
/// the blocks' kernel per range, the fold, and the copy of the result into the
/// summer's page-locked word. The scratch holds `blocks` sums, then `blocks`
/// lengths, then the result.
fn enqueue(s: &Summer, on: sys::CUstream, ranges: &[(u64, u64)], blocks: u64) -> Result<()> {
    let (sums, lens) = (s.scratch, s.scratch + blocks * 4);
    let mut result = s.scratch + 2 * blocks * 4;
    let mut first = 0u64;
    for &(ptr, len) in ranges {
        let grid = len.div_ceil(PER_BLOCK);
        let grid32 = u32::try_from(grid).map_err(|_| GpuError::InvalidArgument(format!("crc32c of {len} bytes")))?;
        let (mut ptr, mut len, mut out, mut out_len) = (ptr, len, sums + first * 4, lens + first * 4);
        let mut args = [
            (&raw mut ptr).cast::<c_void>(),
            (&raw mut len).cast::<c_void>(),
            (&raw mut out).cast::<c_void>(),
            (&raw mut out_len).cast::<c_void>(),
        ];
        // SAFETY: the arguments match `mc_crc32c_blocks(const u8*, u64, u32*,
        // u32*)` and outlive the call (the driver copies them at launch); the
        // kernel reads `[ptr, ptr + len)` (device memory of this context, checked
        // by the caller) and writes `grid` sums and lengths from block `first` on,
        // inside the scratch (`first + grid <= blocks`); `on` is a live stream of
        // this context.
        drv("launch mc_crc32c_blocks", unsafe {
            cu::launch_kernel(s.blocks.cu_function(), (grid32, 1, 1), (THREADS, 1, 1), 0, on, &mut args)
        })?;
        first += grid;
    }
    // One block's sum is the whole sum: no fold.
    let from = if blocks == 1 {
        sums
    } else {
        let (mut sums, mut lens, mut blocks) = (sums, lens, blocks);
        let mut args = [
            (&raw mut sums).cast::<c_void>(),
            (&raw mut lens).cast::<c_void>(),
            (&raw mut blocks).cast::<c_void>(),
            (&raw mut result).cast::<c_void>(),
        ];
        // SAFETY: the arguments match `mc_crc32c_fold(const u32*, const u32*,
        // u64, u32*)`; it reads the `blocks` sums and lengths and writes one u32
        // after them.
        drv("launch mc_crc32c_fold", unsafe {
            cu::launch_kernel(s.fold.cu_function(), (1, 1, 1), (FOLD_THREADS, 1, 1), 0, on, &mut args)
        })?;
        result
    };
    // SAFETY: `s.result` is a live page-locked u32 owned by the summer (under
    // its lock), written by this copy only and read after the caller's
    // synchronize.
    let r = unsafe { std::slice::from_raw_parts_mut(s.result, 1) };
    // SAFETY: `from` is a live 4-byte range of the scratch; `r` is 4 bytes;
    // `on` is a live stream of this context.
    drv("cuMemcpyDtoH", unsafe { cu::memcpy_dtoh_async(r, from, on) })
}

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

    /// NVRTC compiles the source (no GPU needed; skipped where NVRTC is absent).
    #[test]
    fn the_source_compiles_with_nvrtc() {
        super::super::driver::assert_compiles_with_nvrtc(source());
    }
}
