//! The memory regions Python registered, against which every raw pointer is checked.

use std::collections::BTreeMap;

use parking_lot::RwLock;

use crate::codes::INVALID_PARAMS;

/// Registered regions, by start address. A pointer and size given to a zero-copy call
/// must lie inside one of them: that is what lets the binding turn a Python integer
/// into a slice without trusting it.
#[derive(Default)]
pub struct BufferRegistry {
    regions: RwLock<BTreeMap<usize, usize>>,
}

impl BufferRegistry {
    /// Records `[ptr, ptr + size)`; a region registered again at the same address
    /// takes the new size.
    pub fn register(&self, ptr: usize, size: usize) -> i32 {
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return INVALID_PARAMS;
        }
        self.regions.write().insert(ptr, size);
        0
    }

    /// Forgets the region that starts at `ptr`.
    pub fn unregister(&self, ptr: usize) -> i32 {
        match self.regions.write().remove(&ptr) {
            Some(_) => 0,
            None => INVALID_PARAMS,
        }
    }

    /// Forgets every region.
    pub fn clear(&self) {
        self.regions.write().clear();
    }

    /// Bytes from `ptr` to the end of the registered region that contains it.
    pub fn capacity(&self, ptr: usize) -> Option<usize> {
        let regions = self.regions.read();
        // Regions may overlap (Python may register a view inside a larger buffer):
        // the largest room any of them gives wins.
        regions.range(..=ptr).filter(|&(&base, &len)| ptr < base + len).map(|(&base, &len)| base + len - ptr).max()
    }

    /// Whether `[ptr, ptr + size)` is non-empty and inside one registered region.
    pub fn check(&self, ptr: usize, size: usize) -> Result<(), i32> {
        match self.capacity(ptr) {
            Some(cap) if size > 0 && size <= cap => Ok(()),
            _ => Err(INVALID_PARAMS),
        }
    }
}

/// Whether the memory ranges `(start, len)` overlap nowhere. Destinations that the
/// engine writes through `&mut` slices must not: two slices over the same bytes
/// would alias. Empty ranges overlap nothing.
pub fn disjoint(mut ranges: Vec<(usize, usize)>) -> bool {
    ranges.retain(|&(_, len)| len > 0);
    ranges.sort_unstable();
    ranges.windows(2).all(|w| w[0].0.saturating_add(w[0].1) <= w[1].0)
}
