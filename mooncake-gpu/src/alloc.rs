//! Payload arena allocator: a bump pointer plus an address-ordered free list of
//! reclaimed ranges (first fit, coalescing).

use std::collections::BTreeMap;

/// Bump + free-list range allocator over `[0, capacity)`.
#[derive(Debug, Clone)]
pub(crate) struct RangeAlloc {
    capacity: u64,
    bump: u64,
    /// offset -> length, non-overlapping, non-adjacent (coalesced), all below `bump`.
    free: BTreeMap<u64, u64>,
    used: u64,
}

impl RangeAlloc {
    pub(crate) fn new(capacity: u64) -> Self {
        Self { capacity, bump: 0, free: BTreeMap::new(), used: 0 }
    }

    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    #[cfg(test)]
    pub(crate) fn bump(&self) -> u64 {
        self.bump
    }

    pub(crate) fn free_ranges(&self) -> usize {
        self.free.len()
    }

    /// First fit in the free list, else from the bump pointer.
    pub(crate) fn alloc(&mut self, len: u64) -> Option<u64> {
        debug_assert!(len > 0);
        let hit = self.free.iter().find(|(_, &l)| l >= len).map(|(&o, &l)| (o, l));
        if let Some((off, l)) = hit {
            self.free.remove(&off);
            if l > len {
                self.free.insert(off + len, l - len);
            }
            self.used += len;
            return Some(off);
        }
        if self.capacity - self.bump >= len {
            let off = self.bump;
            self.bump += len;
            self.used += len;
            return Some(off);
        }
        None
    }

    /// Returns `[off, off + len)`; coalesces with neighbours and lowers the
    /// bump pointer when the range touches it.
    pub(crate) fn free(&mut self, off: u64, len: u64) {
        debug_assert!(off + len <= self.bump, "freeing beyond the bump pointer");
        self.used -= len;
        let (mut start, mut l) = (off, len);
        if let Some((&po, &pl)) = self.free.range(..off).next_back() {
            debug_assert!(po + pl <= off, "double free / overlap");
            if po + pl == off {
                self.free.remove(&po);
                start = po;
                l += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(start + l)) {
            self.free.remove(&(start + l));
            l += nl;
        }
        if start + l == self.bump {
            self.bump = start;
        } else {
            self.free.insert(start, l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bump_free_coalesce() {
        let mut a = RangeAlloc::new(1000);
        let x = a.alloc(100).unwrap();
        let y = a.alloc(200).unwrap();
        let z = a.alloc(300).unwrap();
        assert_eq!((x, y, z), (0, 100, 300));
        assert_eq!(a.used(), 600);
        a.free(y, 200);
        assert_eq!(a.free_ranges(), 1);
        assert_eq!(a.alloc(150), Some(100));
        assert_eq!(a.alloc(50), Some(250));
        assert_eq!(a.free_ranges(), 0);
        a.free(100, 150);
        a.free(250, 50);
        assert_eq!(a.free_ranges(), 1);
        a.free(z, 300);
        // the freed tail lowers the bump, swallowing the coalesced range before it
        assert_eq!(a.bump(), 100);
        assert_eq!(a.free_ranges(), 0);
        a.free(x, 100);
        assert_eq!((a.bump(), a.used()), (0, 0));
        assert_eq!(a.alloc(1000), Some(0));
        assert_eq!(a.alloc(1), None);
    }
}
