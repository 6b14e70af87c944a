//! CUDA: device heaps and device memory through the CUDA driver API (loaded at
//! run time by `cudarc`), kernels compiled with NVRTC at run time, CUDA IPC.
//!
//! Every entry point first checks that `libcuda` can be loaded and that a
//! device exists; on a machine without a GPU it returns [`GpuError::NoGpu`]
//! (cudarc itself would panic on its first call). Driver calls are also run
//! under `catch_unwind` so a missing symbol becomes an error, not a crash.
//!
//! Host-side header atomics ([`DeviceHeap::load_u32`], ...) run as one-thread
//! kernels (`nk_hdr_op`) so they use the device's own system-scope atomics; a
//! new header is written by one kernel that takes it by value
//! (`nk_write_header`, the state stored last). The hot paths are the inherent
//! methods: [`CudaDeviceHeap::push_from_device`] (one `cuMemcpyDtoDAsync` of the
//! pages, contiguous on both sides, then `nk_publish` behind it on the stream,
//! which flips READY with release semantics),
//! [`NanoKvCache::put_from_device`](crate::NanoKvCache::put_from_device)
//! (`nk_write_header` not waited for, then the push) and
//! [`CudaDeviceHeap::read_into_device`] (up to 4 MiB `nk_read`: each block
//! acquires and pins on its own, copies its share and unpins, the last to finish
//! answers; beyond, `nk_reader_enter` acquire + pin, then `nk_read_exit`:
//! tail-clamped copy, the last block to finish unpins), all stream-ordered on
//! the heap's stream, one host round trip each. Kernels answer into
//! page-locked host memory mapped into the device (no device-to-host copy to
//! enqueue); the host reads it once the stream synchronized.
//!
//! **Addresses:** [`WritePlan`]/[`ObjMeta`] pointers are valid in the owner's
//! process. Another process opens the owner heap with
//! [`CudaDeviceHeap::open_ipc`] and addresses objects by `slot` and
//! `payload_offset`, which is what the methods here use.
//!
//! Without the `cuda` feature `cudarc` is not built: the same types and
//! functions exist (so code that uses them compiles either way), but nothing
//! can be made — every constructor returns [`GpuError::NoGpu`].
//!
//! [`GpuError::NoGpu`]: crate::GpuError::NoGpu
//! [`DeviceHeap::load_u32`]: crate::DeviceHeap::load_u32
//! [`WritePlan`]: crate::WritePlan
//! [`ObjMeta`]: crate::ObjMeta

#[cfg(feature = "cuda")]
mod checksum;
#[cfg(feature = "cuda")]
mod driver;
mod emulate;
#[cfg(feature = "cuda")]
mod heap;
mod ipc;
// The kernels' source is plain Rust: it is built and tested without the
// `cuda` feature too, and used only with it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod kernels;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod pointer;
#[cfg(not(feature = "cuda"))]
mod unavailable;

#[cfg(feature = "cuda")]
pub use driver::{cuda_available, cuda_device_count, nvrtc_available};
pub use emulate::allocate_or_emulate;
#[cfg(feature = "cuda")]
pub use heap::CudaDeviceHeap;
pub use ipc::IpcHeapHandle;
#[cfg(feature = "cuda")]
pub use memory::{crc32c_of_device_ranges, DeviceBuffer};
#[cfg(feature = "cuda")]
pub(crate) use pointer::{
    classify_pointer, current_context, device_allocation, host_register, host_unregister, set_current_context,
};
#[cfg(not(feature = "cuda"))]
pub(crate) use unavailable::{
    classify_pointer, current_context, device_allocation, host_register, host_unregister, set_current_context,
};
#[cfg(not(feature = "cuda"))]
pub use unavailable::{
    crc32c_of_device_ranges, cuda_available, cuda_device_count, nvrtc_available, CudaDeviceHeap, DeviceBuffer,
};
