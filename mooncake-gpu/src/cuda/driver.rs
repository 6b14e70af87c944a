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
