//! [`PinnedBuffer`]: host memory that asynchronous device copies read from or
//! write into.

use std::alloc::Layout;
use std::fmt;
use std::ptr::NonNull;

use crate::error::{GpuError, Result};

/// Page-locked host memory allocated through a device API (`cuMemHostAlloc`);
/// dropping it frees the memory. (Only a device API makes such memory: a build
/// without one has none.)
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) trait PageLockedAlloc: Send + Sync {
    /// Start of the allocation.
    fn ptr(&self) -> NonNull<u8>;
}

/// How a [`PinnedBuffer`]'s memory is freed.
enum Backing {
    /// `std::alloc` memory (not page-locked): host emulation.
    Heap(Layout),
    /// Page-locked memory, freed by the allocation's own Drop.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    PageLocked { _alloc: Box<dyn PageLockedAlloc> },
}

/// A host buffer that asynchronous device copies read from or write into:
/// page-locked (`cuMemHostAlloc`) for CUDA memory, so the DMA engine reaches
/// it directly and copies run asynchronously; plain memory in emulation.
/// Zero-filled when allocated. Dereferences to `[u8]`.
pub struct PinnedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: the buffer exclusively owns its allocation (like a `Box<[u8]>`); a
// page-locked allocation is `Send + Sync` itself (its free is valid from any
// thread).
unsafe impl Send for PinnedBuffer {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for PinnedBuffer {}

impl fmt::Debug for PinnedBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBuffer").field("len", &self.len).field("page_locked", &self.is_page_locked()).finish()
    }
}

impl PinnedBuffer {
    /// `len` zeroed bytes of ordinary (pageable) host memory: the staging
    /// memory of the host emulation. `len` may be 0.
    pub fn unpinned(len: usize) -> Result<Self> {
        let layout = Layout::from_size_align(len.max(1), 64)
            .map_err(|e| GpuError::InvalidArgument(format!("staging buffer of {len} bytes: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            GpuError::InvalidArgument(format!("cannot allocate a {len}-byte staging buffer (out of memory)"))
        })?;
        Ok(Self { ptr, len, backing: Backing::Heap(layout) })
    }

    /// Wraps `len` bytes of page-locked memory (zeroed by the caller).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn page_locked(alloc: Box<dyn PageLockedAlloc>, len: usize) -> Self {
        Self { ptr: alloc.ptr(), len, backing: Backing::PageLocked { _alloc: alloc } }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is page-locked (DMA-able without a driver bounce).
    pub fn is_page_locked(&self) -> bool {
        matches!(self.backing, Backing::PageLocked { .. })
    }

    /// Start of the buffer, for [`DeviceStream`](super::DeviceStream) copies.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start of the buffer, for [`DeviceStream`](super::DeviceStream) copies into it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for PinnedBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed at allocation) bytes
        // owned by `self`, alive as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for PinnedBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        match &self.backing {
            // SAFETY: allocated in `unpinned` with exactly this layout, freed once.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) },
            // The allocation's own Drop frees the page-locked memory.
            Backing::PageLocked { .. } => {}
        }
    }
}
