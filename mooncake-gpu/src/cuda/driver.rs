//! Loading the CUDA driver safely: the probe that answers "no GPU" instead of
//! letting `cudarc` panic, and the wrappers that turn driver errors and loader
//! panics into [`GpuError`]s.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use cudarc::driver::{result as cu, sys};

use crate::error::{GpuError, Result};

fn no_gpu_probe() -> std::result::Result<usize, String> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate library
    // names and drops the handles; it calls no CUDA function.
    if !unsafe { sys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so) is not present".into());
    }
    let r = catch_unwind(|| -> std::result::Result<usize, String> {
        cu::init().map_err(|e| format!("cuInit failed: {e}"))?;
        let n = cu::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e}"))?;
        Ok(n.max(0) as usize)
    });
    match r {
        Ok(Ok(0)) => Err("the CUDA driver reports no device".into()),
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(e),
        Err(_) => Err("the CUDA driver could not be loaded (panic in the loader)".into()),
    }
}

/// Number of CUDA devices, or [`GpuError::NoGpu`] (never panics). The probe
/// runs once per process.
pub fn cuda_device_count() -> Result<usize> {
    static PROBE: OnceLock<std::result::Result<usize, String>> = OnceLock::new();
    PROBE.get_or_init(no_gpu_probe).clone().map_err(GpuError::NoGpu)
}

/// Whether a CUDA device can be used in this process.
pub fn cuda_available() -> bool {
    cuda_device_count().is_ok()
}

/// Whether the NVRTC library can be loaded (needed to build the kernels).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries `dlopen` on the candidate library names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

pub(super) fn drv<T>(op: &'static str, r: std::result::Result<T, cu::DriverError>) -> Result<T> {
    r.map_err(|e| GpuError::Cuda { op, msg: e.to_string() })
}

/// Runs `f`, turning a panic inside cudarc (missing library or symbol) into
/// an error.
pub(super) fn guarded<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            Err(GpuError::CudaUnavailable(format!("{what}: {msg}")))
        }
    }
}

/// `bytes` of page-locked host memory mapped into the device's address space
/// (in the bound context), and its device address: what kernels write answers
/// into, for the host to read once their stream synchronized, with no copy back.
/// Freed with `cuMemFreeHost` by the caller.
pub(super) fn alloc_mapped_host(bytes: usize) -> Result<(*mut u8, sys::CUdeviceptr)> {
    // SAFETY: a plain page-locked, device-mapped allocation, owned by the caller.
    let host = drv("cuMemHostAlloc", unsafe { cu::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) })?;
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: `host` was allocated with DEVICEMAP just above; `dev` is a valid
    // out-pointer.
    let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0).result() };
    // With unified addressing (every 64-bit process) memory from cuMemHostAlloc
    // is reachable from kernels at its host address, whatever the context's
    // flags: the fallback where the driver gives no mapping.
    let dev = if mapped.is_ok() && dev != 0 { dev } else { host as sys::CUdeviceptr };
    Ok((host.cast(), dev))
}

/// Tests: NVRTC compiles `source` for sm_80 (no GPU needed; skipped with a note
/// where NVRTC is absent).
#[cfg(test)]
pub(super) fn assert_compiles_with_nvrtc(source: String) {
    if !nvrtc_available() {
        eprintln!("note: skipping: the NVRTC library (libnvrtc.so) is not present");
        return;
    }
    let opts =
        cudarc::nvrtc::CompileOptions { options: vec!["--gpu-architecture=compute_80".into()], ..Default::default() };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts);
    assert!(ptx.is_ok(), "{ptx:?}");
}

/// Tests: what CUDA gives a kernel source, for a C++20 compiler, so that the
/// kernels run on the CPU: a block's threads are threads meeting at a barrier for
/// `__syncthreads`, `__shared__` arrays are statics (one block runs at a time),
/// fences and atomics are the C++ ones. `launch(grid_x, grid_y, threads, f)` runs
/// `f` as a kernel.
#[cfg(test)]
pub(super) const CPU_CUDA: &str = r#"
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned char u8;
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx;
Dim blockIdx, gridDim = {1, 1, 1}, blockDim = {1, 1, 1};
std::barrier<>* block_barrier;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__
struct uint4 { unsigned x, y, z, w; };
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
template <class T> T min(T a, T b) { return a < b ? a : b; }
template <class T> T __ldcg(const T* p) { return *p; }
inline u32 atomicInc(u32* p, u32 val) {
    std::atomic_ref<u32> a(*p);
    u32 old = a.load();
    while (!a.compare_exchange_weak(old, old >= val ? 0 : old + 1)) {}
    return old;
}
inline u32 atomicMax(u32* p, u32 v) {
    std::atomic_ref<u32> a(*p);
    u32 old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}
inline u32 atomicExch(u32* p, u32 v) { return std::atomic_ref<u32>(*p).exchange(v); }
inline u32 atomicXor(u32* p, u32 v) { return std::atomic_ref<u32>(*p).fetch_xor(v); }
template <class F> void launch(unsigned gx, unsigned gy, unsigned threads, F kernel) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < gy; by++) {
        for (unsigned bx = 0; bx < gx; bx++) {
            blockIdx = {bx, by, 0};
            std::barrier<> bar(threads);
            block_barrier = &bar;
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; t++) ts.emplace_back([=] { threadIdx.x = t; kernel(); });
            for (auto& th : ts) th.join();
        }
    }
}
"#;

/// Tests: compiles `program` (C++20, with [`CPU_CUDA`] before it) and runs it with
/// `input` in a file named by its one argument; its standard output. `None`
/// (after a note) where no C++20 compiler is present.
#[cfg(test)]
pub(super) fn run_on_cpu(name: &str, program: &str, input: &[u8]) -> Option<String> {
    let dir = std::env::temp_dir().join(format!("mc-cpu-cuda-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (cpp, bin, file) = (dir.join("k.cpp"), dir.join("k"), dir.join("input"));
    std::fs::write(&cpp, format!("{CPU_CUDA}\n{program}")).expect("write the program");
    let built =
        std::process::Command::new("c++").args(["-std=c++20", "-O1", "-pthread", "-o"]).arg(&bin).arg(&cpp).output();
    match built {
        Ok(out) if out.status.success() => {}
        Ok(out) if String::from_utf8_lossy(&out.stderr).contains("barrier") => {
            eprintln!("note: skipping: the C++ compiler has no <barrier> (C++20)");
            return None;
        }
        Ok(out) => panic!("the kernels do not compile as C++: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => {
            eprintln!("note: skipping: no C++ compiler ({e})");
            return None;
        }
    }
    std::fs::write(&file, input).expect("write the input");
    let out = std::process::Command::new(&bin).arg(&file).output().expect("run the program");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    Some(String::from_utf8(out.stdout).expect("text"))
}
