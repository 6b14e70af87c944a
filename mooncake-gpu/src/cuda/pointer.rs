//! What the CUDA driver knows about an address (`cuPointerGetAttributes`), and
//! page-locking host memory someone else allocated (`cuMemHostRegister`).

use std::sync::{Arc, OnceLock};

use cudarc::driver::{sys, CudaContext};

use super::driver::{cuda_device_count, drv, guarded};
use crate::error::Result;
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
/// address) or there is no usable GPU. Never panics.
pub(crate) fn device_allocation(ptr: u64) -> Option<DeviceAllocation> {
    // No driver, no device memory: nothing to ask (and nothing loaded).
    cuda_device_count().ok()?;
    // The attributes need no particular context, but the driver wants one
    // current on the thread: the caller's if it has one (a framework's), else
    // device 0's primary context, bound only for the query (the guard puts the
    // thread's context back).
    let _keep = KeepCurrentContext::new();
    let r = guarded("cuPointerGetAttributes", || {
        if current_context().is_none_or(|c| c == 0) {
            drv("bind", primary0()?.bind_to_thread())?;
        }
        let mut mem_type: u32 = 0;
        let mut ordinal: i32 = -1;
        let mut start: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        let mut managed: u32 = 0;
        use sys::CUpointer_attribute as A;
        let mut attrs = [
            A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            A::CU_POINTER_ATTRIBUTE_IS_MANAGED,
        ];
        let mut data: [*mut std::ffi::c_void; 5] = [
            (&mut mem_type as *mut u32).cast(),
            (&mut ordinal as *mut i32).cast(),
            (&mut start as *mut sys::CUdeviceptr).cast(),
            (&mut size as *mut usize).cast(),
            (&mut managed as *mut u32).cast(),
        ];
        // SAFETY: each data pointer points to a live value of the type the driver
        // writes for its attribute (CUmemorytype: unsigned int; ordinal: int;
        // range start: CUdeviceptr; range size: size_t; is-managed: unsigned int
        // used as a bool); unlike cuPointerGetAttribute, an address the driver does
        // not know is no error: the values are left zero.
        let r = unsafe { sys::cuPointerGetAttributes(5, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
        drv("cuPointerGetAttributes", r.result())?;
        Ok((mem_type, ordinal, start, size, managed))
    });
    let (mem_type, ordinal, start, size, managed) = match r {
        Ok(v) => v,
        Err(e) => {
            tracing::debug!(error = %e, ptr, "pointer attributes unavailable: not device memory");
            return None;
        }
    };
    // Device memory, or managed memory (copied by the driver like device memory:
    // never dereferenced on the host by this crate). Pinned host memory reports
    // CU_MEMORYTYPE_HOST and is host memory.
    let device = mem_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || managed != 0;
    if !device || ordinal < 0 || size == 0 || ptr < start || ptr - start >= size as u64 {
        return None;
    }
    Some(DeviceAllocation { ordinal: ordinal as usize, base: start, len: size as u64 })
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
