//! What memory an address handed over by a caller is (a framework's tensor
//! pointer, given as an integer): device memory, to be moved only with device
//! copies, or not.
//!
//! * [`PointerClassifier`]: the question and its answer ([`DeviceAllocation`]),
//!   and the borrowed [`DeviceMemory`] over a range of such an allocation.
//! * [`CudaPointers`]: the CUDA driver's answer (`cuPointerGetAttributes`:
//!   memory type, device ordinal, the allocation's range). Without a GPU or a
//!   driver it knows no device memory, so every address is "not device memory"
//!   and callers keep their host behaviour.
//! * [`EmulatedPointers`]: the answer for machines without a GPU, where a test
//!   declares host ranges as "device memory of device N"; the borrowed memory
//!   is a [`HostDeviceMemory`] over the range (deferred copies, as a device's).
//!   Both take the same decisions: an address inside a known allocation is
//!   device memory (a range running past the allocation is refused), anything
//!   else is not.
//! * [`HostPinning`]: page-locking host memory allocated elsewhere (a store's
//!   segment) so that copies between it and a device are one DMA
//!   (`cuMemHostRegister`), with its emulation.
//!
//! ```
//! use mooncake_gpu::{DeviceMemory, EmulatedPointers, PointerClassifier};
//!
//! # fn main() -> mooncake_gpu::Result<()> {
//! let mut tensor = vec![0u8; 4096];
//! let pointers = EmulatedPointers::default();
//! // SAFETY: `tensor` outlives every use of the declaration (forgotten below).
//! unsafe { pointers.declare(tensor.as_mut_ptr() as u64, 4096, 1)? };
//! let base = tensor.as_ptr() as u64;
//! let alloc = pointers.device_allocation(base + 100).expect("declared");
//! assert_eq!((alloc.ordinal, alloc.base, alloc.len), (1, base, 4096));
//! let mem = pointers.borrow(base + 100, 8)?;
//! assert!(mem.copy_from_host(0, b"on-device").is_err()); // 9 bytes into 8
//! mem.copy_from_host(0, b"on-devic")?;
//! drop(mem);
//! assert!(pointers.forget(base));
//! assert_eq!(&tensor[100..108], b"on-devic");
//! # Ok(())
//! # }
//! ```

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::device::{DeviceMemory, HostDeviceMemory};
use crate::error::{GpuError, Result};

/// One device allocation as the classifier knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAllocation {
    /// Device ordinal.
    pub ordinal: usize,
    /// Its first address.
    pub base: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl DeviceAllocation {
    /// Whether `[ptr, ptr + len)` lies inside the allocation.
    pub fn contains(&self, ptr: u64, len: u64) -> bool {
        ptr >= self.base && ptr.checked_add(len).is_some_and(|end| end <= self.base + self.len)
    }
}

/// Tells device memory from other memory by address, and lends device ranges
/// as [`DeviceMemory`]: a CUDA driver ([`CudaPointers`]) or, without one, host
/// ranges a test declares device memory ([`EmulatedPointers`]).
pub trait PointerClassifier: Send + Sync + fmt::Debug {
    /// The device allocation holding `ptr`, or `None` if `ptr` is not device
    /// memory this classifier knows.
    fn device_allocation(&self, ptr: u64) -> Option<DeviceAllocation>;

    /// [`device_allocation`] telling its two kinds of `None` apart: `Ok(None)`
    /// when `ptr` is not device memory, `Err` when the question could not be
    /// answered (a driver is there, but its query failed). A caller about to
    /// treat a "not device memory" address as host memory refuses on `Err`:
    /// device memory dereferenced on the host would crash.
    ///
    /// [`device_allocation`]: Self::device_allocation
    fn classify(&self, ptr: u64) -> Result<Option<DeviceAllocation>> {
        Ok(self.device_allocation(ptr))
    }

    /// `[ptr, ptr + len)` of device memory as a [`DeviceMemory`] (offset 0 is
    /// `ptr`), borrowed: not freed when dropped. `InvalidArgument` if the range
    /// is empty or not inside one allocation [`device_allocation`] reports.
    ///
    /// [`device_allocation`]: Self::device_allocation
    fn borrow(&self, ptr: u64, len: u64) -> Result<Arc<dyn DeviceMemory>>;

    /// The allocation holding the whole range, or `InvalidArgument`.
    fn allocation_of(&self, ptr: u64, len: u64) -> Result<DeviceAllocation> {
        let a = self
            .device_allocation(ptr)
            .ok_or_else(|| GpuError::InvalidArgument(format!("{ptr:#x} is not device memory")))?;
        if len == 0 || !a.contains(ptr, len) {
            return Err(GpuError::InvalidArgument(format!(
                "{ptr:#x}+{len} is not inside the device allocation {:#x}+{}",
                a.base, a.len
            )));
        }
        Ok(a)
    }
}

/// The CUDA driver's classification (`cuPointerGetAttributes`); device ranges
/// are lent as borrowed [`DeviceBuffer`](crate::DeviceBuffer)s. Knows no device
/// memory where there is no usable GPU (or without the `cuda` feature).
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaPointers;

impl PointerClassifier for CudaPointers {
    fn device_allocation(&self, ptr: u64) -> Option<DeviceAllocation> {
        if ptr == 0 {
            return None;
        }
        crate::cuda::device_allocation(ptr)
    }

    fn classify(&self, ptr: u64) -> Result<Option<DeviceAllocation>> {
        if ptr == 0 {
            return Ok(None);
        }
        crate::cuda::classify_pointer(ptr)
    }

    fn borrow(&self, ptr: u64, len: u64) -> Result<Arc<dyn DeviceMemory>> {
        let a = self.allocation_of(ptr, len)?;
        let n = usize::try_from(len).map_err(|_| GpuError::InvalidArgument(format!("{len} bytes")))?;
        // SAFETY: the driver reports `[ptr, ptr + len)` inside a live device
        // allocation of device `a.ordinal`; the buffer is borrowed (never freed
        // here) and device copies into memory freed meanwhile fail in the driver,
        // they never touch host memory.
        let b = unsafe { crate::DeviceBuffer::from_raw(a.ordinal, ptr, n)? };
        Ok(Arc::new(b))
    }
}

/// Host ranges declared as device memory (tests and machines without a GPU):
/// the same decisions as [`CudaPointers`], over [`HostDeviceMemory`].
#[derive(Debug, Default)]
pub struct EmulatedPointers {
    /// Declared allocations by base address: (length, ordinal).
    ranges: RwLock<BTreeMap<u64, (u64, usize)>>,
}

impl EmulatedPointers {
    /// Declares `[ptr, ptr + len)` of host memory as an allocation of device
    /// `ordinal`. `InvalidArgument` for an empty range, a null or wrapping one,
    /// or one overlapping a range already declared.
    ///
    /// # Safety
    ///
    /// The range must stay valid for reads and writes until it is
    /// [`forget`](Self::forget)ten and every [`DeviceMemory`] borrowed over it
    /// is dropped, and nobody else may touch it while a copy runs.
    pub unsafe fn declare(&self, ptr: u64, len: u64, ordinal: usize) -> Result<()> {
        let end = ptr.checked_add(len).filter(|_| ptr != 0 && len != 0);
        let end = end.ok_or_else(|| GpuError::InvalidArgument(format!("emulated device range {ptr:#x}+{len}")))?;
        let mut ranges = self.ranges.write();
        let before = ranges.range(..end).next_back();
        if before.is_some_and(|(&b, &(l, _))| b + l > ptr) {
            return Err(GpuError::InvalidArgument(format!("{ptr:#x}+{len} overlaps a declared range")));
        }
        ranges.insert(ptr, (len, ordinal));
        Ok(())
    }

    /// Forgets the range declared at `ptr`; whether there was one.
    pub fn forget(&self, ptr: u64) -> bool {
        self.ranges.write().remove(&ptr).is_some()
    }
}

impl PointerClassifier for EmulatedPointers {
    fn device_allocation(&self, ptr: u64) -> Option<DeviceAllocation> {
        let ranges = self.ranges.read();
        let (&base, &(len, ordinal)) = ranges.range(..=ptr).next_back()?;
        (ptr - base < len).then_some(DeviceAllocation { ordinal, base, len })
    }

    fn borrow(&self, ptr: u64, len: u64) -> Result<Arc<dyn DeviceMemory>> {
        self.allocation_of(ptr, len)?;
        let n = usize::try_from(len).map_err(|_| GpuError::InvalidArgument(format!("{len} bytes")))?;
        // SAFETY: the range lies inside a declared one, which `declare`'s caller
        // keeps valid and untouched during copies.
        let m = unsafe { HostDeviceMemory::borrowed(ptr as *mut u8, n)? };
        Ok(Arc::new(m))
    }
}

/// Puts the calling thread's current CUDA context back when dropped.
///
/// The device calls bind the context of the memory they copy; a framework
/// (PyTorch) reads its "current device" from the thread's current context, so
/// a call made for it on its thread must leave that context as it found it.
/// Without a usable driver it does nothing (no driver call). Not `Send`: a
/// current context belongs to one thread.
#[derive(Debug)]
pub struct KeepCurrentContext {
    saved: Option<usize>,
    _thread: std::marker::PhantomData<*const ()>,
}

impl KeepCurrentContext {
    /// Remembers the calling thread's current context.
    pub fn new() -> Self {
        Self { saved: crate::cuda::current_context(), _thread: std::marker::PhantomData }
    }
}

impl Default for KeepCurrentContext {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KeepCurrentContext {
    fn drop(&mut self) {
        if let Some(ctx) = self.saved {
            if crate::cuda::current_context() != Some(ctx) {
                crate::cuda::set_current_context(ctx);
            }
        }
    }
}

/// Host memory allocated elsewhere (a store's segment, a peer's mapped
/// segment), page-locked with CUDA while this value lives so that copies
/// between it and a device run as one DMA straight from or into it
/// (`cuMemHostRegister`; `cuMemHostUnregister` on drop).
///
/// [`pin`](Self::pin) without a usable GPU returns `NoGpu`: the caller keeps
/// staging. [`emulated`](Self::emulated) makes the same decision on a machine
/// without one (a range registered once, refused twice) without calling CUDA,
/// so that the code choosing between one DMA and staging is tested there.
#[derive(Debug)]
pub struct HostPinning {
    ptr: u64,
    len: u64,
    cuda: bool,
}

impl HostPinning {
    /// Page-locks `[ptr, ptr + len)`. `InvalidArgument` for an empty or null
    /// range; `NoGpu` without a usable GPU; `Cuda` if the driver refuses it
    /// (already registered, not mapped).
    ///
    /// # Safety
    ///
    /// The range must be mapped host memory that stays mapped while the
    /// returned value lives.
    pub unsafe fn pin(ptr: *mut u8, len: usize) -> Result<Self> {
        if ptr.is_null() || len == 0 {
            return Err(GpuError::InvalidArgument("page-locking an empty range".into()));
        }
        // SAFETY: the caller keeps the range mapped while the value lives (it
        // unregisters on drop).
        unsafe { crate::cuda::host_register(ptr, len)? };
        Ok(Self { ptr: ptr as u64, len: len as u64, cuda: true })
    }

    /// The emulation of [`pin`](Self::pin): records the range in `registry`
    /// (refusing a range that overlaps one already pinned there, as the driver
    /// does) and forgets it on drop. Calls no CUDA function.
    pub fn emulated(registry: &Arc<PinnedRanges>, ptr: u64, len: u64) -> Result<EmulatedPin> {
        let end = ptr.checked_add(len).filter(|_| ptr != 0 && len != 0);
        let end = end.ok_or_else(|| GpuError::InvalidArgument("page-locking an empty range".into()))?;
        let mut r = registry.ranges.write();
        if r.range(..end).next_back().is_some_and(|(&b, &l)| b + l > ptr) {
            return Err(GpuError::Cuda {
                op: "cuMemHostRegister",
                msg: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED (emulated)".into(),
            });
        }
        r.insert(ptr, len);
        Ok(EmulatedPin { registry: registry.clone(), ptr })
    }

    /// The pinned range `(address, length)`.
    pub fn range(&self) -> (u64, u64) {
        (self.ptr, self.len)
    }
}

impl Drop for HostPinning {
    fn drop(&mut self) {
        if self.cuda {
            if let Err(e) = crate::cuda::host_unregister(self.ptr as *mut u8) {
                tracing::warn!(error = %e, "cuMemHostUnregister failed");
            }
        }
    }
}

/// The ranges page-locked in an emulation ([`HostPinning::emulated`]).
#[derive(Debug, Default)]
pub struct PinnedRanges {
    ranges: RwLock<BTreeMap<u64, u64>>,
}

impl PinnedRanges {
    /// Whether `[ptr, ptr + len)` lies inside one pinned range: a copy of it
    /// would be one DMA.
    pub fn contains(&self, ptr: u64, len: u64) -> bool {
        let r = self.ranges.read();
        r.range(..=ptr).next_back().is_some_and(|(&b, &l)| ptr.checked_add(len).is_some_and(|e| e <= b + l))
    }
}

/// A range pinned in an emulation; forgotten on drop.
#[derive(Debug)]
pub struct EmulatedPin {
    registry: Arc<PinnedRanges>,
    ptr: u64,
}

impl Drop for EmulatedPin {
    fn drop(&mut self) {
        self.registry.ranges.write().remove(&self.ptr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn emulated_classification_matches_the_drivers_rules() {
        let mut buf = vec![0u8; 1000];
        let base = buf.as_mut_ptr() as u64;
        let p = EmulatedPointers::default();
        // SAFETY: `buf` outlives `p` and every borrow below.
        unsafe { p.declare(base + 100, 800, 3).unwrap() };
        assert_eq!(p.device_allocation(base + 99), None);
        assert_eq!(p.device_allocation(base + 100).map(|a| a.ordinal), Some(3));
        assert_eq!(p.device_allocation(base + 899).map(|a| a.base), Some(base + 100));
        assert_eq!(p.device_allocation(base + 900), None);
        // Inside: lent; running past the allocation, empty, or outside: refused.
        let m = p.borrow(base + 200, 100).unwrap();
        m.copy_from_host(0, &[9u8; 100]).unwrap();
        drop(m);
        assert!(buf[200..300].iter().all(|&b| b == 9) && buf[199] == 0 && buf[300] == 0);
        assert!(p.borrow(base + 850, 100).is_err());
        assert!(p.borrow(base + 200, 0).is_err());
        assert!(p.borrow(base, 10).is_err());
        // SAFETY: refused (overlap) before anything is recorded.
        assert!(unsafe { p.declare(base + 50, 100, 0) }.is_err());
        assert!(p.forget(base + 100));
        assert_eq!(p.device_allocation(base + 100), None);
        // The driver's classifier on a machine without a GPU knows no device
        // memory: a host address stays host memory.
        if !crate::cuda_available() {
            // Without a driver the context guard calls nothing and keeps nothing.
            let keep = KeepCurrentContext::new();
            assert!(keep.saved.is_none());
            drop(keep);
            assert_eq!(CudaPointers.device_allocation(base), None);
            assert_eq!(CudaPointers.classify(base), Ok(None));
            assert!(CudaPointers.borrow(base, 10).is_err());
        }
    }

    #[test]
    fn emulated_pinning_refuses_overlaps_and_forgets_on_drop() {
        let reg = Arc::new(PinnedRanges::default());
        let pin = HostPinning::emulated(&reg, 4096, 8192).unwrap();
        assert!(reg.contains(4096, 8192) && reg.contains(8000, 100));
        assert!(!reg.contains(4000, 200) && !reg.contains(12000, 300));
        assert!(HostPinning::emulated(&reg, 8192, 10).is_err(), "already registered");
        drop(pin);
        assert!(!reg.contains(4096, 1));
        assert!(HostPinning::emulated(&reg, 8192, 10).is_ok());
        if !crate::cuda_available() {
            let mut v = vec![0u8; 4096];
            // SAFETY: `v` outlives the (failed) registration.
            assert!(matches!(unsafe { HostPinning::pin(v.as_mut_ptr(), 4096) }, Err(GpuError::NoGpu(_))));
        }
    }
}
