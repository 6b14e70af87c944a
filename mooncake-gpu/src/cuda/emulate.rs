//! Device memory on a GPU when there is one, host emulation otherwise.

use super::DeviceBuffer;
use crate::device::{DeviceMemory, HostDeviceMemory};
use crate::error::{GpuError, Result};

/// Device memory of `len` bytes on CUDA device `ordinal` if one can be used,
/// else host emulation (with the reason it was used: `NoGpu` or
/// `CudaUnavailable`). Other errors (out of device memory, a bad ordinal) are
/// returned, not hidden behind the emulation.
pub fn allocate_or_emulate(ordinal: usize, len: u64) -> Result<(Box<dyn DeviceMemory>, Option<GpuError>)> {
    let n = usize::try_from(len).map_err(|_| GpuError::InvalidArgument(format!("{len} bytes")))?;
    match DeviceBuffer::new(ordinal, n) {
        Ok(b) => Ok((Box::new(b), None)),
        Err(e @ (GpuError::NoGpu(_) | GpuError::CudaUnavailable(_))) => {
            tracing::info!(reason = %e, "no usable GPU: device memory is emulated in host memory");
            Ok((Box::new(HostDeviceMemory::new(len)?), Some(e)))
        }
        Err(e) => Err(e),
    }
}
