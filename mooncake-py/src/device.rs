//! GPU pointers in the pointer methods (`put_from`, `get_into`, the batch and
//! multi-buffer forms, `get_into_ranges`, the upserts).
//!
//! A framework hands over its KV-cache tensors by address (`t.data_ptr()`),
//! registered with `register_buffer` or not. Every address a pointer method
//! takes is resolved here, before anything touches it:
//!
//! * inside a registered host buffer: host memory, read and written in place
//!   as before;
//! * inside device memory (a registered device buffer, or an allocation the
//!   CUDA driver reports through `cuPointerGetAttributes`): wrapped as a
//!   borrowed `mooncake_gpu::DeviceMemory` of exactly the caller's range and
//!   moved only through the store's device API (`get_into_device`,
//!   `batch_get_into_devices`, `batch_put_from_devices`,
//!   `batch_upsert_from_devices`) or device copies — never dereferenced on the
//!   host;
//! * anything else: refused with `INVALID_PARAMS` (-600), never a crash.
//!
//! Which memory is device memory is a [`PointerClassifier`]'s answer: the
//! driver's ([`CudaPointers`]; without a GPU or driver it knows none, so host
//! pointers behave exactly as before), or, for tests on machines without a
//! GPU, [`EmulatedPointers`], switched on per store by the test hook
//! `_emulate_device_memory(ptr, size, ordinal)`: the declared host ranges are
//! then "device memory", moved by the same code with the same decisions.
//!
//! A driver that could not answer (its query failed) proves nothing: such an
//! address is refused (-600) by `register_buffer`, never registered as host
//! memory; the test hook `_emulate_failed_pointer_query(ptr, size)` makes the
//! emulation's "driver" fail so for a range.

use std::collections::BTreeMap;
use std::sync::Arc;

use mooncake_core::gpu::{
    CudaPointers, DeviceAllocation, DeviceMemory, DeviceScatter, EmulatedPointers, GpuError, HostDeviceMemory,
    PointerClassifier,
};
use mooncake_core::BufferRegistry;
use parking_lot::RwLock;

use crate::codes::INVALID_PARAMS;

/// What an address range given by Python is.
pub enum Target {
    /// Inside a registered host buffer: may be read and written in place.
    Host,
    /// Device memory: exactly the caller's range, offset 0 at its address.
    Device(Arc<dyn DeviceMemory>),
}

/// A device buffer given to `register_buffer`.
struct DeviceRegion {
    len: u64,
    /// The whole registered range (its copy streams are reused by every call).
    mem: Arc<dyn DeviceMemory>,
}

/// The emulation's classifier (tests on machines without a GPU): the declared
/// device ranges, and the ranges where the "driver's" query fails.
#[derive(Debug, Default)]
struct Emulation {
    pointers: EmulatedPointers,
    /// `(base, len)` of the ranges whose query fails.
    failing: RwLock<Vec<(u64, u64)>>,
}

impl PointerClassifier for Emulation {
    fn device_allocation(&self, ptr: u64) -> Option<DeviceAllocation> {
        self.classify(ptr).ok().flatten()
    }

    fn classify(&self, ptr: u64) -> mooncake_core::gpu::Result<Option<DeviceAllocation>> {
        if self.failing.read().iter().any(|&(base, len)| ptr >= base && ptr - base < len) {
            return Err(GpuError::Cuda { op: "cuPointerGetAttributes", msg: "emulated failure".into() });
        }
        Ok(self.pointers.device_allocation(ptr))
    }

    fn borrow(&self, ptr: u64, len: u64) -> mooncake_core::gpu::Result<Arc<dyn DeviceMemory>> {
        // The driver's rule: only memory it reports as device memory is lent.
        self.allocation_of(ptr, len)?;
        self.pointers.borrow(ptr, len)
    }
}

/// The device side of a store's pointer arguments: its classifier and the
/// device buffers registered with it.
pub struct DevicePointers {
    classifier: RwLock<Arc<dyn PointerClassifier>>,
    /// Set when a test switched this store to the emulation.
    emulated: RwLock<Option<Arc<Emulation>>>,
    /// Registered device buffers by address.
    regions: RwLock<BTreeMap<u64, DeviceRegion>>,
}

impl Default for DevicePointers {
    fn default() -> Self {
        Self {
            classifier: RwLock::new(Arc::new(CudaPointers)),
            emulated: RwLock::new(None),
            regions: RwLock::new(BTreeMap::new()),
        }
    }
}

impl DevicePointers {
    /// The registered device buffer holding `[ptr, ptr + len)`, as a range of it.
    fn registered(&self, ptr: u64, len: u64) -> Option<Arc<dyn DeviceMemory>> {
        let regions = self.regions.read();
        let (&base, region) = regions.range(..=ptr).next_back()?;
        let inside = ptr.checked_add(len).is_some_and(|end| end <= base + region.len) && len > 0;
        if !inside {
            return None;
        }
        if ptr == base && len == region.len {
            return Some(region.mem.clone());
        }
        let slice = DeviceScatter::new(vec![(region.mem.clone(), ptr - base, len)]).ok()?;
        Some(Arc::new(slice))
    }

    /// What `[ptr, ptr + len)` is: host memory registered in `host`, device
    /// memory, or `Err(INVALID_PARAMS)`.
    pub fn resolve(&self, host: &BufferRegistry, ptr: usize, len: usize) -> Result<Target, i32> {
        if host.check(ptr, len).is_ok() {
            return Ok(Target::Host);
        }
        if len == 0 || ptr == 0 {
            return Err(INVALID_PARAMS);
        }
        let (p, n) = (ptr as u64, len as u64);
        if let Some(mem) = self.registered(p, n) {
            return Ok(Target::Device(mem));
        }
        let classifier = self.classifier.read().clone();
        classifier.borrow(p, n).map(Target::Device).map_err(|_| INVALID_PARAMS)
    }

    /// Whether `register_buffer(ptr, size)` names device memory; if so it is
    /// registered here (0) or refused (-600: not inside one allocation, or the
    /// driver could not say what the memory is).
    /// `None`: not device memory, the caller registers host memory.
    pub fn register(&self, ptr: usize, size: usize) -> Option<i32> {
        let classifier = self.classifier.read().clone();
        match classifier.classify(ptr as u64) {
            Ok(Some(_)) => {}
            Ok(None) => return None,
            // Registered as host memory, device memory would be dereferenced on
            // the host: refused, as the reference refuses what it cannot register.
            Err(_) => return Some(INVALID_PARAMS),
        }
        Some(match classifier.borrow(ptr as u64, size as u64) {
            Ok(mem) => {
                self.regions.write().insert(ptr as u64, DeviceRegion { len: size as u64, mem });
                0
            }
            Err(_) => INVALID_PARAMS,
        })
    }

    /// Forgets the device buffer registered at `ptr`; whether there was one.
    pub fn unregister(&self, ptr: usize) -> bool {
        self.regions.write().remove(&(ptr as u64)).is_some()
    }

    /// Forgets every registered device buffer.
    pub fn clear(&self) {
        self.regions.write().clear();
    }

    /// The device memory from `ptr` to the end of its registered device buffer
    /// (or of its device allocation), for `get_into_ranges`; `None` if `ptr` is
    /// no device memory.
    pub fn range_from(&self, ptr: usize) -> Option<Arc<dyn DeviceMemory>> {
        let p = ptr as u64;
        let end = {
            let regions = self.regions.read();
            regions.range(..=p).next_back().filter(|(&b, r)| p < b + r.len).map(|(&b, r)| b + r.len)
        };
        if let Some(end) = end {
            return self.registered(p, end - p);
        }
        let classifier = self.classifier.read().clone();
        let a = classifier.device_allocation(p)?;
        classifier.borrow(p, a.base + a.len - p).ok()
    }

    /// Test hook: switches this store to the emulation (once; forgetting the
    /// device buffers registered so far) and declares `[ptr, ptr + size)` as
    /// memory of device `ordinal`.
    ///
    /// # Safety
    ///
    /// The range must stay valid until the store is closed or dropped, and
    /// nothing else may touch it while a call of this store copies it.
    pub unsafe fn emulate(&self, ptr: usize, size: usize, ordinal: usize) -> i32 {
        // SAFETY: the caller's contract is the declaration's.
        match unsafe { self.emulation().pointers.declare(ptr as u64, size as u64, ordinal) } {
            Ok(()) => 0,
            Err(_) => INVALID_PARAMS,
        }
    }

    /// Test hook: switches this store to the emulation (as [`Self::emulate`]) and
    /// makes its "driver" fail to answer for the addresses `[ptr, ptr + size)`.
    pub fn emulate_failed_query(&self, ptr: usize, size: usize) -> i32 {
        if size == 0 || ptr.checked_add(size).is_none() {
            return INVALID_PARAMS;
        }
        self.emulation().failing.write().push((ptr as u64, size as u64));
        0
    }

    /// The emulation, switched on now (forgetting the device buffers registered
    /// so far) unless it was already.
    fn emulation(&self) -> Arc<Emulation> {
        let mut slot = self.emulated.write();
        if slot.is_none() {
            let e = Arc::new(Emulation::default());
            *self.classifier.write() = e.clone();
            self.regions.write().clear();
            *slot = Some(e);
        }
        slot.clone().expect("set above")
    }
}

/// Registered host memory `[ptr, ptr + len)` as a `DeviceMemory`, to be part of a
/// [`DeviceScatter`] with device ranges (a multi-buffer object whose parts are
/// partly host, partly device memory).
pub fn host_part(ptr: usize, len: usize) -> Result<Arc<dyn DeviceMemory>, i32> {
    // SAFETY: the range lies in a registered buffer, which Python keeps valid for
    // the call; it is read or written only by this call's copies.
    let m = unsafe { HostDeviceMemory::borrowed(ptr as *mut u8, len) }.map_err(|_| INVALID_PARAMS)?;
    Ok(Arc::new(m))
}

/// Several ranges as one device memory, or -600.
pub fn scatter(parts: Vec<Arc<dyn DeviceMemory>>) -> Result<DeviceScatter, i32> {
    let ranges = parts.into_iter().map(|m| (m.clone(), 0, m.len())).collect();
    DeviceScatter::new(ranges).map_err(|_| INVALID_PARAMS)
}

impl DevicePointers {
    /// The parts of one multi-buffer object: `Ok(None)` if they are all registered
    /// host memory (or there are none), `Ok(Some(memory))` if one at least is device
    /// memory (all the parts, host ones included, seen as one scatter), `Err(-600)`
    /// if a part is neither or the lists disagree.
    pub fn resolve_parts(
        &self,
        host: &BufferRegistry,
        ptrs: &[usize],
        sizes: &[usize],
    ) -> Result<Option<Arc<dyn DeviceMemory>>, i32> {
        if ptrs.len() != sizes.len() {
            return Err(INVALID_PARAMS);
        }
        let mut targets = Vec::with_capacity(ptrs.len());
        for (&p, &l) in ptrs.iter().zip(sizes) {
            targets.push(self.resolve(host, p, l)?);
        }
        if targets.iter().all(|t| matches!(t, Target::Host)) {
            return Ok(None);
        }
        let mut parts = Vec::with_capacity(targets.len());
        for ((t, &p), &l) in targets.into_iter().zip(ptrs).zip(sizes) {
            parts.push(match t {
                Target::Device(m) => m,
                Target::Host => host_part(p, l)?,
            });
        }
        Ok(Some(Arc::new(scatter(parts)?)))
    }
}
