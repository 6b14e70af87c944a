//! Host memory the store maps (its own segment, same-host peers' segments),
//! page-locked with CUDA the first time a replica there moves to or from device
//! memory, so that it moves in one DMA straight from or into the segment, with no
//! staging copy. Machines without a GPU take the same decisions over
//! [`HostPinning::emulated`] (device memory that is a
//! [`HostDeviceMemory`](mooncake_gpu::HostDeviceMemory)).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

use mooncake_gpu::{EmulatedPin, HostPinning, PinnedRanges};
use mooncake_transfer::{MappedRegion, RemoteRegion, TransferEngine};
use parking_lot::Mutex;

/// A replica's region, mapped into this process and page-locked.
pub(in crate::store) struct PinnedRegion {
    /// Declared (so dropped) before the mapping: the range is unpinned while it is
    /// still mapped.
    _pin: Pin,
    map: MappedRegion,
}

enum Pin {
    Cuda(#[allow(dead_code)] HostPinning),
    Emulated(#[allow(dead_code)] EmulatedPin),
}

impl PinnedRegion {
    /// The address of `len` bytes at `offset` of the region, if they lie in it.
    pub(in crate::store) fn range(&self, offset: u64, len: u64) -> Option<*mut u8> {
        self.map.range(offset, len)
    }

    /// The region's length.
    pub(in crate::store) fn len(&self) -> u64 {
        self.map.len()
    }
}

/// The ranges the emulation page-locked in this process: like CUDA, it refuses to
/// page-lock a range twice.
static EMULATED: LazyLock<Arc<PinnedRanges>> = LazyLock::new(Arc::default);

/// The address a region was mapped at when it was pinned, and its pin (`None`:
/// refused).
type MappedAt = (usize, Option<Arc<PinnedRegion>>);

/// The regions one store pinned, each once (CUDA refuses to page-lock a range
/// twice), by region and kind (CUDA or emulated), with the address each was mapped
/// at; a region that cannot be pinned is not asked again while its mapping stays the
/// same. Owned by the store: its pins and mappings go with it.
#[derive(Default)]
pub(in crate::store) struct PinnedRegions {
    by_region: Mutex<HashMap<(RemoteRegion, bool), MappedAt>>,
}

impl PinnedRegions {
    /// `region` mapped by the transport that reaches it and page-locked (with
    /// CUDA, or in the emulation when `emulated`); `None`: the bytes are staged.
    pub(in crate::store) fn get(
        &self,
        engine: &TransferEngine,
        region: &RemoteRegion,
        emulated: bool,
    ) -> Option<Arc<PinnedRegion>> {
        // Asked every time: the transport checks that the peer still serves the
        // mapping, and a new mapping is pinned anew.
        let map = engine.map_region(region)?.ok()?;
        let ptr = map.range(0, 0)? as usize;
        let key = (region.clone(), emulated);
        let mut by_region = self.by_region.lock();
        if let Some((at, pinned)) = by_region.get(&key) {
            if *at == ptr {
                return pinned.clone();
            }
        }
        let pin = if emulated {
            HostPinning::emulated(&EMULATED, ptr as u64, map.len()).map(Pin::Emulated)
        } else {
            // SAFETY: `map` keeps the range mapped, and the pin is dropped with it
            // (the two live together in `PinnedRegion`).
            unsafe { HostPinning::pin(ptr as *mut u8, map.len() as usize) }.map(Pin::Cuda)
        };
        let pinned = match pin {
            Ok(pin) => Some(Arc::new(PinnedRegion { map, _pin: pin })),
            Err(e) => {
                tracing::warn!(error = %e, endpoint = region.endpoint, "cannot page-lock a segment: device copies to and from it are staged");
                None
            }
        };
        // A stale entry's pin goes with it (unpinned, then unmapped), once no
        // transfer holds it; so do the entries of regions no longer mapped.
        by_region.insert(key, (ptr, pinned.clone()));
        pinned
    }
}
