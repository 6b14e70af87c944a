//! `BufferRegistry`: the memory a foreign caller declared valid, against which raw
//! pointers are checked before they become slices.
//!
//! The bindings with the reference's interfaces (`mooncake-py`, `mooncake-store`)
//! take buffers as addresses and lengths (`put_from(key, ptr, len)`), as the
//! reference does. An address is not a promise: before the engine reads or writes
//! through one, it must lie inside a region the caller registered
//! (`register_buffer(ptr, len)`), so that a wrong length or a stale pointer is an
//! `InvalidArgument` rather than memory corruption. Native Rust callers give slices
//! to [`Store`](crate::Store) and need none of this.

use std::collections::BTreeMap;

use parking_lot::RwLock;

use crate::error::{Error, Result};

/// Registered memory regions `[ptr, ptr + size)`, by start address.
///
/// ```
/// use mooncake_core::BufferRegistry;
/// let regions = BufferRegistry::default();
/// regions.register(0x1000, 256)?;
/// assert!(regions.check(0x1080, 128).is_ok());
/// assert!(regions.check(0x1080, 129).is_err()); // runs past the region's end
/// regions.unregister(0x1000)?;
/// assert!(regions.check(0x1000, 1).is_err());
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Debug, Default)]
pub struct BufferRegistry {
    regions: RwLock<BTreeMap<usize, usize>>,
}

impl BufferRegistry {
    /// Records `[ptr, ptr + size)`; a region registered again at the same address
    /// takes the new size. `InvalidArgument` for a null pointer, an empty region or
    /// one that wraps around the address space.
    pub fn register(&self, ptr: usize, size: usize) -> Result<()> {
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return Err(Error::InvalidArgument(format!(
                "cannot register {size} bytes at {ptr:#x}: a buffer is a non-null, non-empty range"
            )));
        }
        self.regions.write().insert(ptr, size);
        Ok(())
    }

    /// Forgets the region that starts at `ptr`; `InvalidArgument` if none does.
    pub fn unregister(&self, ptr: usize) -> Result<()> {
        match self.regions.write().remove(&ptr) {
            Some(_) => Ok(()),
            None => Err(Error::InvalidArgument(format!("no buffer is registered at {ptr:#x}"))),
        }
    }

    /// Forgets every region.
    pub fn clear(&self) {
        self.regions.write().clear();
    }

    /// Bytes from `ptr` to the end of the registered region that contains it (the
    /// largest, when registered regions overlap: a view may be registered inside a
    /// larger buffer).
    pub fn capacity(&self, ptr: usize) -> Option<usize> {
        let regions = self.regions.read();
        regions.range(..=ptr).filter(|&(&base, &len)| ptr < base + len).map(|(&base, &len)| base + len - ptr).max()
    }

    /// `Ok` when `[ptr, ptr + size)` is non-empty and inside one registered region,
    /// else `InvalidArgument`.
    pub fn check(&self, ptr: usize, size: usize) -> Result<()> {
        match self.capacity(ptr) {
            Some(cap) if size > 0 && size <= cap => Ok(()),
            Some(cap) if size > 0 => Err(Error::InvalidArgument(format!(
                "{size} bytes at {ptr:#x} run past the end of its registered buffer ({cap} bytes left)"
            ))),
            Some(_) => Err(Error::InvalidArgument(format!("empty buffer at {ptr:#x}"))),
            None => Err(Error::InvalidArgument(format!("{ptr:#x} is not inside a registered buffer"))),
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_must_lie_inside_one_region() {
        let r = BufferRegistry::default();
        assert!(r.register(0, 8).is_err());
        assert!(r.register(8, 0).is_err());
        assert!(r.register(usize::MAX - 1, 4).is_err());
        r.register(100, 50).unwrap();
        assert!(r.check(100, 50).is_ok());
        assert!(r.check(149, 1).is_ok());
        assert!(r.check(149, 2).is_err());
        assert!(r.check(150, 1).is_err());
        assert!(r.check(99, 1).is_err());
        assert!(r.check(120, 0).is_err());
        // A view inside the region may be registered too; the larger room wins.
        r.register(120, 10).unwrap();
        assert_eq!(r.capacity(125), Some(25));
        r.unregister(100).unwrap();
        assert_eq!(r.capacity(125), Some(5));
        assert!(r.unregister(100).is_err());
        r.clear();
        assert_eq!(r.capacity(125), None);
    }

    #[test]
    fn disjoint_ignores_empty_ranges() {
        assert!(BufferRegistry::disjoint(vec![(0, 4), (4, 4), (6, 0)]));
        assert!(!BufferRegistry::disjoint(vec![(4, 4), (0, 5)]));
        assert!(BufferRegistry::disjoint(vec![(usize::MAX - 1, 8), (0, 1)]));
    }
}
