//! What the CUDA driver knows about an address (`cuPointerGetAttributes`), and
//! page-locking host memory someone else allocated (`cuMemHostRegister`).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use super::driver::{cuda_device_count, drv, guarded};
use crate::error::{GpuError, Result};
use crate::pointer::{DeviceAllocation, KeepCurrentContext};

/// Device 0's primary context, retained once per process (a context must be
/// current for the calls below; which one does not matter to them).
fn primary0() -> Result<Arc<CudaContext>> {
    static CTX: OnceLock<std::result::Result<Arc<CudaContext>, String>> = OnceLock::new();
    CTX.get_or_init(|| CudaContext::new(0).map_err(|e| e.to_string()))
        .clone()
        .map_err(|msg| crate::error::GpuError::Cuda { op: "cuDevicePrimaryCtxRetain", msg })
}

/// The device allocation holding `ptr` as the driver sees it, or `None` when the
/// driver knows no device memory there (host memory, pinned or not, a wild
/// address), there is no usable GPU, or the driver could not be asked (see
/// [`classify_pointer`] for a caller that must tell the last case apart). Never
/// panics.
pub(crate) fn device_allocation(ptr: u64) -> Option<DeviceAllocation> {
    classify_pointer(ptr).unwrap_or_else(|e| {
        tracing::debug!(error = %e, ptr, "pointer attributes unavailable: not device memory");
        None
    })
}

/// What the driver says `ptr` is: `Ok(Some(_))` device (or managed) memory,
/// `Ok(None)` not device memory (no driver or no device: nothing is), `Err` when
/// a driver is there but could not answer (no context could be made current,
/// the query failed). Never panics.
pub(crate) fn classify_pointer(ptr: u64) -> Result<Option<DeviceAllocation>> {
    // No driver, no device memory: nothing to ask (and nothing loaded).
    if cuda_device_count().is_err() {
        return Ok(None);
    }
    // The attributes need no particular context, but the driver wants one
    // current on the thread: the caller's if it has one (a framework's), else
    // device 0's primary context, bound only for the query (the guard puts the
    // thread's context back).
    let _keep = KeepCurrentContext::new();
    guarded("cuPointerGetAttributes", || {
        if current_context().is_none_or(|c| c == 0) {
            drv("bind", primary0()?.bind_to_thread())?;
        }
        let mut a = Attributes::default();
        use sys::CUpointer_attribute as A;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        ];
        let mut data: [*mut std::ffi::c_void; 5] = [
            (&mut a.mem_type as *mut u32).cast(),
            (&mut a.ordinal as *mut i32).cast(),
            (&mut a.start as *mut sys::CUdeviceptr).cast(),
            (&mut a.size as *mut usize).cast(),
            (&mut a.managed as *mut u32).cast(),
        ];
        // SAFETY: each data pointer points to a live value of the type the driver
        // writes for its attribute (CUmemorytype: unsigned int; ordinal: int;
        // range start: CUdeviceptr; range size: size_t; is-managed: unsigned int
        // used as a bool); unlike cuPointerGetAttribute, an address the driver does
        // not know is no error: the values are left zero.
        let r = unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
        decide(ptr, r, a)
    })
}

/// The attributes `cuPointerGetAttributes` reports (zero: none).
#[derive(Debug, Default, Clone, Copy)]
struct Attributes {
    mem_type: u32,
    ordinal: i32,
    start: sys::CUdeviceptr,
    size: usize,
    managed: u32,
}

/// What a `cuPointerGetAttributes` status and attributes say about `ptr`.
/// `CUDA_ERROR_INVALID_VALUE` is the driver's "no memory of mine there"; any other
/// error means it could not answer, which is no proof of host memory.
fn decide(ptr: u64, status: sys::CUresult, a: Attributes) -> Result<Option<DeviceAllocation>> {
    match status {
        sys::CUresult::CUDA_SUCCESS => {}
        sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Ok(None),
        // The code's name, not the driver's text for it (which would load the
        // driver to ask it).
        other => return Err(GpuError::Cuda { op: "cuPointerGetAttributes", msg: format!("{other:?}") }),
    }
    // Device memory, or managed memory (copied by the driver like device memory:
    // never dereferenced on the host by this crate). Pinned host memory reports
    // CU_MEMORYTYPE_HOST and is host memory.
    let device = a.mem_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || a.managed != 0;
    if !device || a.ordinal < 0 || a.size == 0 || ptr < a.start || ptr - a.start >= a.size as u64 {
        return Ok(None);
    }
    Ok(Some(DeviceAllocation { ordinal: a.ordinal as usize, base: a.start, len: a.size as u64 }))
}

/// The calling thread's current CUDA context (0: none), or `None` without a
/// usable driver. Never panics.
pub(crate) fn current_context() -> Option<usize> {
    cuda_device_count().ok()?;
    guarded("cuCtxGetCurrent", || {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: `c` is a valid out-pointer for one context handle.
        drv("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut c) }.result())?;
        Ok(c as usize)
    })
    .ok()
}

/// Makes `ctx` (a value [`current_context`] returned, 0 for none) the calling
/// thread's current context again.
pub(crate) fn set_current_context(ctx: usize) {
    let _ = guarded("cuCtxSetCurrent", || {
        // SAFETY: `ctx` is a context handle this thread had current (or null,
        // which unbinds); the primary contexts it can name stay retained by
        // their users.
        drv("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx as sys::CUcontext) }.result())
    });
}

/// Page-locks `[ptr, ptr + len)` of host memory allocated elsewhere
/// (`cuMemHostRegister`, portable), so that copies between it and any device run
/// as one DMA; undone by [`host_unregister`].
///
/// # Safety
///
/// The range must be mapped host memory that stays mapped until
/// [`host_unregister`] is called on `ptr`.
pub(crate) unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<()> {
    cuda_device_count()?;
    guarded("cuMemHostRegister", || {
        drv("bind", primary0()?.bind_to_thread())?;
        // SAFETY: the caller keeps the range mapped until it is unregistered.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        drv("cuMemHostRegister", r.result())
    })
}

/// Undoes [`host_register`] of `ptr`.
pub(crate) fn host_unregister(ptr: *mut u8) -> Result<()> {
    cuda_device_count()?;
    guarded("cuMemHostUnregister", || {
        drv("bind", primary0()?.bind_to_thread())?;
        // SAFETY: unregistering takes only the address `host_register` was given;
        // an address never registered is an error, not undefined behaviour.
        let r = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
        drv("cuMemHostUnregister", r.result())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_query_is_no_proof_of_host_memory() {
        use sys::CUresult as R;
        let device = Attributes {
            mem_type: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
            ordinal: 1,
            start: 0x1000,
            size: 0x100,
            managed: 0,
        };
        let alloc = DeviceAllocation { ordinal: 1, base: 0x1000, len: 0x100 };
        assert_eq!(decide(0x1080, R::CUDA_SUCCESS, device), Ok(Some(alloc)));
        // Outside the range the driver reported, host memory, an unknown address
        // (attributes left zero): not device memory.
        assert_eq!(decide(0x1100, R::CUDA_SUCCESS, device), Ok(None));
        let host = Attributes { mem_type: sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32, ..device };
        assert_eq!(decide(0x1080, R::CUDA_SUCCESS, host), Ok(None));
        assert_eq!(decide(0x1080, R::CUDA_SUCCESS, Attributes::default()), Ok(None));
        // Managed memory is moved as device memory.
        let managed = Attributes { mem_type: 0, managed: 1, ..device };
        assert_eq!(decide(0x1000, R::CUDA_SUCCESS, managed), Ok(Some(alloc)));
        // The driver's "not mine" is an answer; its other errors are not.
        assert_eq!(decide(0x1080, R::CUDA_ERROR_INVALID_VALUE, device), Ok(None));
        for failed in [R::CUDA_ERROR_INVALID_CONTEXT, R::CUDA_ERROR_NOT_INITIALIZED, R::CUDA_ERROR_DEINITIALIZED] {
            assert!(matches!(decide(0x1080, failed, device), Err(crate::GpuError::Cuda { .. })), "{failed:?}");
        }
    }
}
