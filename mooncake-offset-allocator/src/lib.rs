//! An O(1) offset allocator with 64-bit offsets, after Sebastian Aaltonen's
//! OffsetAllocator (a two-level segregated-fit allocator, TLSF-style).
//!
//! It manages *offsets* into a range it never touches: Mooncake Store uses it for the
//! space of a DRAM segment (up to 1 TiB and beyond) and of a preallocated SSD file.
//!
//! Sizes are binned as small floating-point numbers (3-bit mantissa, so bins are at
//! most 12.5 % apart). A 64-bit mask says which exponent groups have free blocks and
//! an 8-bit mask per group which of its bins do, so finding a block that fits is two
//! bit scans. Every block knows its physical neighbours, so freeing coalesces in O(1).
//! When the rounded-up bin search finds nothing, the request's own bin is scanned
//! (bounded) for a block that is large enough, so the last block that fits is used.
//!
//! ```
//! use mooncake_offset_allocator::OffsetAllocator;
//!
//! let mut a = OffsetAllocator::new(1 << 20); // 1 MiB, 64-byte alignment
//! let x = a.allocate(1000).unwrap();
//! let y = a.allocate(5000).unwrap();
//! assert_eq!(x.offset() % 64, 0);
//! assert!(y.offset() >= x.offset() + x.size());
//! a.free(x);
//! a.free(y);
//! assert_eq!(a.used_bytes(), 0);
//! assert!(a.allocate(1 << 20).is_some(), "frees coalesce back into one block");
//! ```
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};

/// Default alignment of offsets and sizes, in bytes.
pub const DEFAULT_ALIGNMENT: u64 = 64;

const NONE: u32 = u32::MAX;
/// `bin_prev` of a node that is in use (free nodes have a real link or `NONE`).
const USED: u32 = u32::MAX - 1;
const MANTISSA_BITS: u32 = 3;
const LEAVES: usize = 1 << MANTISSA_BITS;
const TOP_BINS: usize = 64;
const BINS: usize = TOP_BINS * LEAVES;
/// Nodes of the fallback scan of a request's own bin.
const FALLBACK_SCAN: usize = 64;

/// Ids tell allocators apart so a foreign allocation is refused. 32 bits keep an
/// [`Allocation`] at 24 bytes (a store keeps one per object); after 2^32 allocators the
/// ids wrap and the check becomes best effort.
static NEXT_ID: AtomicU32 = AtomicU32::new(1);

/// The next allocator id (never 0: the id doubles as `Option<Allocation>`'s niche).
fn next_id() -> NonZeroU32 {
    loop {
        if let Some(id) = NonZeroU32::new(NEXT_ID.fetch_add(1, Ordering::Relaxed)) {
            return id;
        }
    }
}

/// Why an allocator cannot be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OffsetAllocatorError {
    /// Alignment is zero or not a power of two.
    InvalidAlignment(u64),
    /// Capacity is smaller than one alignment unit.
    ZeroCapacity,
    /// An allocation of another allocator was given back.
    ForeignAllocation,
}

impl std::fmt::Display for OffsetAllocatorError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::InvalidAlignment(a) => write!(f, "alignment {a} is not a power of two"),
            Self::ZeroCapacity => write!(f, "capacity is smaller than one alignment unit"),
            Self::ForeignAllocation => write!(f, "allocation belongs to another allocator"),
        }
    }
}

impl std::error::Error for OffsetAllocatorError {}

/// A reserved range. Give it back with [`OffsetAllocator::free`]; it is neither
/// `Clone` nor `Copy`, so it cannot be freed twice.
#[must_use = "an allocation that is dropped without being freed leaks its space"]
#[derive(Debug, PartialEq, Eq)]
pub struct Allocation {
    offset: u64,
    size: u64,
    node: u32,
    owner: NonZeroU32,
}

impl Allocation {
    /// First byte of the range.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes reserved (the request rounded up to the alignment).
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// An allocation reduced to its block's name: for owners that keep the offset
/// themselves and want 4 bytes where an [`Allocation`] takes 24 (a store keeps one per
/// object replica). Give it back with [`OffsetAllocator::try_free_block`]. Neither
/// `Clone` nor `Copy`, so it cannot be freed twice; `Option<Block>` is 4 bytes too.
///
/// ```
/// use mooncake_offset_allocator::OffsetAllocator;
/// let mut a = OffsetAllocator::new(1 << 20);
/// let x = a.allocate(1000).unwrap();
/// let offset = x.offset();
/// let block = x.into_block();
/// assert_eq!(a.try_free_block(offset, block), Ok(1024)); // the bytes it reserved
/// assert_eq!(a.used_bytes(), 0);
/// ```
#[must_use = "a block that is dropped without being freed leaks its space"]
#[derive(Debug, PartialEq, Eq)]
pub struct Block(NonZeroU32);

impl Allocation {
    /// The allocation's block, for [`OffsetAllocator::try_free_block`] with
    /// [`offset`](Self::offset). The allocator id is not kept: the free checks instead
    /// that a block in use starts at that offset.
    pub fn into_block(self) -> Block {
        // Node indices stay below `USED` (u32::MAX - 1), so `node + 1` is never 0.
        Block(NonZeroU32::new(self.node + 1).expect("node index below u32::MAX"))
    }
}

/// A snapshot of an allocator's space.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AllocatorReport {
    /// Bytes managed.
    pub capacity: u64,
    /// Bytes reserved.
    pub used_bytes: u64,
    /// Bytes free.
    pub free_bytes: u64,
    /// Number of free blocks.
    pub free_regions: u64,
    /// Largest free block, in bytes.
    pub largest_free_region: u64,
    /// `1 - largest_free_region / free_bytes` (0 when nothing is free): how much of
    /// the free space is unusable by one large request.
    pub fragmentation: f64,
}

/// A block, free or used: 24 bytes (a store keeps one per object replica). Blocks
/// tile the range, so a block's size is not kept: it ends where the next one starts
/// (or at the capacity).
#[derive(Clone, Copy, Debug)]
struct Node {
    offset: u64, // units
    /// Previous node of the same bin (free), `NONE` at the head, `USED` in use.
    bin_prev: u32,
    bin_next: u32,
    prev: u32, // physical neighbours
    next: u32,
}

impl Node {
    fn is_free(&self) -> bool {
        self.bin_prev != USED
    }
}

/// The allocator. All sizes and offsets in its API are bytes; internally it counts in
/// alignment units. It is `Send` and `Sync` (wrap it in a mutex to share it) and not
/// `Clone` (its [`Allocation`]s name it).
///
/// ```
/// use mooncake_offset_allocator::OffsetAllocator;
///
/// let mut a = OffsetAllocator::with_alignment(1 << 40, 4096).unwrap(); // 1 TiB, 4 KiB pages
/// let x = a.allocate(1).unwrap();
/// assert_eq!((x.offset(), x.size()), (0, 4096));
/// assert_eq!(a.used_bytes(), 4096);
/// a.free(x);
/// assert_eq!(a.free_bytes(), 1 << 40);
/// ```
#[derive(Debug)]
pub struct OffsetAllocator {
    id: NonZeroU32,
    shift: u32,
    capacity_units: u64,
    used_units: u64,
    top_mask: u64,
    leaf_masks: [u8; TOP_BINS],
    heads: Box<[u32; BINS]>,
    nodes: Vec<Node>,
    spare: Vec<u32>,
    free_blocks: u64,
    /// The block with the highest offset.
    last: u32,
}

/// Bin of a size, rounding down: every block in bin `b` is at least `bin_size(b)`.
fn bin_down(size: u64) -> usize {
    debug_assert!(size > 0);
    if size < LEAVES as u64 {
        return size as usize;
    }
    let high = 63 - size.leading_zeros();
    let shift = high - MANTISSA_BITS;
    let exp = (shift + 1) as usize;
    let mantissa = ((size >> shift) & (LEAVES as u64 - 1)) as usize;
    (exp << MANTISSA_BITS) | mantissa
}

/// Bin of a size, rounding up: every block in bin `b` or higher holds `size`.
fn bin_up(size: u64) -> usize {
    let down = bin_down(size);
    if bin_size(down) == size {
        down
    } else {
        down + 1
    }
}

/// Smallest size a block in bin `b` may have.
fn bin_size(bin: usize) -> u64 {
    let exp = bin >> MANTISSA_BITS;
    let mantissa = (bin & (LEAVES - 1)) as u64;
    if exp == 0 {
        mantissa
    } else {
        (mantissa | LEAVES as u64) << (exp - 1)
    }
}

impl OffsetAllocator {
    /// An allocator of `capacity` bytes with 64-byte alignment.
    ///
    /// # Panics
    /// If `capacity` is below 64 bytes; use [`with_alignment`](Self::with_alignment)
    /// for a fallible constructor.
    pub fn new(capacity: u64) -> Self {
        Self::with_alignment(capacity, DEFAULT_ALIGNMENT).expect("capacity of at least one alignment unit")
    }

    /// An allocator of `capacity` bytes (rounded down to the alignment) whose offsets
    /// and sizes are multiples of `alignment` (a power of two).
    pub fn with_alignment(capacity: u64, alignment: u64) -> Result<Self, OffsetAllocatorError> {
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(OffsetAllocatorError::InvalidAlignment(alignment));
        }
        let shift = alignment.trailing_zeros();
        let units = capacity >> shift;
        if units == 0 {
            return Err(OffsetAllocatorError::ZeroCapacity);
        }
        let mut a = Self {
            id: next_id(),
            shift,
            capacity_units: units,
            used_units: 0,
            top_mask: 0,
            leaf_masks: [0; TOP_BINS],
            heads: Box::new([NONE; BINS]),
            nodes: Vec::with_capacity(64),
            spare: Vec::new(),
            free_blocks: 0,
            last: 0,
        };
        let n = a.new_node(0, NONE, NONE);
        a.insert_free(n);
        Ok(a)
    }

    /// Bytes managed.
    pub fn capacity(&self) -> u64 {
        self.capacity_units << self.shift
    }

    /// Alignment of offsets and sizes.
    pub fn alignment(&self) -> u64 {
        1 << self.shift
    }

    /// Bytes reserved.
    pub fn used_bytes(&self) -> u64 {
        self.used_units << self.shift
    }

    /// Bytes free (possibly in several blocks).
    pub fn free_bytes(&self) -> u64 {
        (self.capacity_units - self.used_units) << self.shift
    }

    fn units(&self, bytes: u64) -> Option<u64> {
        if bytes == 0 {
            return None;
        }
        let align = 1u64 << self.shift;
        Some(bytes.checked_add(align - 1)? >> self.shift)
    }

    /// Size of node `i` in units: up to the next block's offset (or the capacity).
    /// Callers change the links only after they have read the sizes they need.
    fn size(&self, i: u32) -> u64 {
        let n = &self.nodes[i as usize];
        let end = if n.next == NONE { self.capacity_units } else { self.nodes[n.next as usize].offset };
        end - n.offset
    }

    fn new_node(&mut self, offset: u64, prev: u32, next: u32) -> u32 {
        let node = Node { offset, bin_prev: USED, bin_next: NONE, prev, next };
        match self.spare.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn insert_free(&mut self, i: u32) {
        let bin = bin_down(self.size(i));
        let head = self.heads[bin];
        {
            let n = &mut self.nodes[i as usize];
            n.bin_prev = NONE;
            n.bin_next = head;
        }
        if head != NONE {
            self.nodes[head as usize].bin_prev = i;
        }
        self.heads[bin] = i;
        self.top_mask |= 1 << (bin >> MANTISSA_BITS);
        self.leaf_masks[bin >> MANTISSA_BITS] |= 1 << (bin & (LEAVES - 1));
        self.free_blocks += 1;
    }

    fn remove_free(&mut self, i: u32) {
        let n = self.nodes[i as usize];
        if n.bin_prev != NONE {
            self.nodes[n.bin_prev as usize].bin_next = n.bin_next;
        } else {
            let bin = bin_down(self.size(i));
            self.heads[bin] = n.bin_next;
            if n.bin_next == NONE {
                let top = bin >> MANTISSA_BITS;
                self.leaf_masks[top] &= !(1 << (bin & (LEAVES - 1)));
                if self.leaf_masks[top] == 0 {
                    self.top_mask &= !(1 << top);
                }
            }
        }
        if n.bin_next != NONE {
            self.nodes[n.bin_next as usize].bin_prev = n.bin_prev;
        }
        self.nodes[i as usize].bin_prev = USED;
        self.free_blocks -= 1;
    }

    /// First non-empty bin at or above `bin`.
    fn find_bin(&self, bin: usize) -> Option<usize> {
        let top = bin >> MANTISSA_BITS;
        if top >= TOP_BINS {
            return None;
        }
        let leaf = bin & (LEAVES - 1);
        let leaves = self.leaf_masks[top] & (0xffu8 << leaf);
        if leaves != 0 {
            return Some((top << MANTISSA_BITS) | leaves.trailing_zeros() as usize);
        }
        let tops = if top + 1 >= TOP_BINS { 0 } else { self.top_mask & (!0u64 << (top + 1)) };
        if tops == 0 {
            return None;
        }
        let t = tops.trailing_zeros() as usize;
        Some((t << MANTISSA_BITS) | self.leaf_masks[t].trailing_zeros() as usize)
    }

    /// Reserves `size` bytes (rounded up to the alignment); `None` if no free block
    /// is large enough (or `size` is 0). O(1), plus a bounded scan when only the
    /// request's own bin may hold a fitting block.
    pub fn allocate(&mut self, size: u64) -> Option<Allocation> {
        let units = self.units(size)?;
        if units > self.capacity_units - self.used_units {
            return None;
        }
        let node = match self.find_bin(bin_up(units)) {
            Some(bin) => self.heads[bin],
            None => self.scan_bin(bin_down(units), units)?,
        };
        Some(self.take(node, units))
    }

    fn scan_bin(&self, bin: usize, units: u64) -> Option<u32> {
        let mut i = self.heads[bin];
        for _ in 0..FALLBACK_SCAN {
            if i == NONE {
                return None;
            }
            if self.size(i) >= units {
                return Some(i);
            }
            i = self.nodes[i as usize].bin_next;
        }
        None
    }

    /// Uses free node `i` for `units`, splitting off the remainder.
    fn take(&mut self, i: u32, units: u64) -> Allocation {
        self.remove_free(i);
        let n = self.nodes[i as usize];
        if self.size(i) > units {
            let rest = self.new_node(n.offset + units, i, n.next);
            if n.next != NONE {
                self.nodes[n.next as usize].prev = rest;
            } else {
                self.last = rest;
            }
            self.nodes[i as usize].next = rest;
            self.insert_free(rest);
        }
        self.used_units += units;
        Allocation { offset: n.offset << self.shift, size: units << self.shift, node: i, owner: self.id }
    }

    /// Reserves exactly `[offset, offset + size)` (both rounded to the alignment:
    /// `offset` must be aligned), if that range is free. Used to rebuild an
    /// allocator from a list of live ranges; O(number of blocks) in the worst case,
    /// O(1) when ranges are reserved in increasing offset order on a fresh allocator.
    pub fn allocate_at(&mut self, offset: u64, size: u64) -> Option<Allocation> {
        let units = self.units(size)?;
        if offset & ((1 << self.shift) - 1) != 0 {
            return None;
        }
        let start = offset >> self.shift;
        let end = start.checked_add(units)?;
        if end > self.capacity_units {
            return None;
        }
        // Walk the physical chain backwards from the last block: ascending
        // reservations find their block at once.
        let mut i = self.last;
        while i != NONE && self.nodes[i as usize].offset > start {
            i = self.nodes[i as usize].prev;
        }
        if i == NONE {
            return None;
        }
        let n = self.nodes[i as usize];
        if !n.is_free() || n.offset + self.size(i) < end {
            return None;
        }
        // Split off the free head [n.offset, start) and keep it free.
        let target = if n.offset < start {
            self.remove_free(i);
            let t = self.new_node(start, i, n.next);
            if n.next != NONE {
                self.nodes[n.next as usize].prev = t;
            } else {
                self.last = t;
            }
            self.nodes[i as usize].next = t;
            self.insert_free(i);
            self.insert_free(t);
            t
        } else {
            i
        };
        Some(self.take(target, units))
    }

    /// Gives `allocation` back, merging it with free neighbours. O(1).
    ///
    /// An allocation of another allocator is not freed (that would corrupt both): in
    /// debug builds this panics, in release builds it is ignored and the space of
    /// that allocation stays reserved in its own allocator. Use
    /// [`try_free`](Self::try_free) to get an error instead.
    pub fn free(&mut self, allocation: Allocation) {
        let r = self.try_free(allocation);
        debug_assert!(r.is_ok(), "{r:?}");
    }

    /// Gives `allocation` back; fails with
    /// [`ForeignAllocation`](OffsetAllocatorError::ForeignAllocation), changing
    /// nothing, if it belongs to another allocator.
    ///
    /// ```
    /// use mooncake_offset_allocator::{OffsetAllocator, OffsetAllocatorError};
    /// let mut a = OffsetAllocator::new(4096);
    /// let mut b = OffsetAllocator::new(4096);
    /// let x = a.allocate(64).unwrap();
    /// assert_eq!(b.try_free(x), Err(OffsetAllocatorError::ForeignAllocation));
    /// ```
    pub fn try_free(&mut self, allocation: Allocation) -> Result<(), OffsetAllocatorError> {
        if allocation.owner != self.id {
            return Err(OffsetAllocatorError::ForeignAllocation);
        }
        self.free_node(allocation.node);
        Ok(())
    }

    /// Frees used node `i`, merging it with free neighbours.
    fn free_node(&mut self, mut i: u32) {
        let n = self.nodes[i as usize];
        debug_assert!(!n.is_free(), "allocation freed twice");
        self.used_units -= self.size(i);
        // Merge with the previous block: it absorbs us.
        if n.prev != NONE && self.nodes[n.prev as usize].is_free() {
            let p = n.prev;
            self.remove_free(p);
            self.nodes[p as usize].next = n.next;
            if n.next != NONE {
                self.nodes[n.next as usize].prev = p;
            } else {
                self.last = p;
            }
            self.spare.push(i);
            i = p;
        }
        // Merge with the next block: we absorb it.
        let next = self.nodes[i as usize].next;
        if next != NONE && self.nodes[next as usize].is_free() {
            let m = self.nodes[next as usize];
            self.remove_free(next);
            self.nodes[i as usize].next = m.next;
            if m.next != NONE {
                self.nodes[m.next as usize].prev = i;
            } else {
                self.last = i;
            }
            self.spare.push(next);
        }
        self.insert_free(i);
    }

    /// Gives back the block of an allocation that started at `offset` (see
    /// [`Allocation::into_block`]), merging it with free neighbours, and returns the
    /// bytes it had reserved. O(1).
    ///
    /// Fails with [`ForeignAllocation`](OffsetAllocatorError::ForeignAllocation),
    /// changing nothing, if no block in use of this allocator starts at `offset` under
    /// that name (a wrong offset, or a block of another allocator: that one is caught
    /// unless a block in use here happens to have the same name and offset, so keep
    /// blocks next to their allocator, as [`Allocation`]'s own id is not kept).
    ///
    /// ```
    /// use mooncake_offset_allocator::{OffsetAllocator, OffsetAllocatorError};
    /// let mut a = OffsetAllocator::new(1 << 20);
    /// let x = a.allocate(64).unwrap();
    /// let _y = a.allocate(64).unwrap();
    /// assert_eq!(a.try_free_block(64, x.into_block()), Err(OffsetAllocatorError::ForeignAllocation));
    /// ```
    pub fn try_free_block(&mut self, offset: u64, block: Block) -> Result<u64, OffsetAllocatorError> {
        let node = block.0.get() - 1;
        let n = self.nodes.get(node as usize).ok_or(OffsetAllocatorError::ForeignAllocation)?;
        let aligned = offset & ((1 << self.shift) - 1) == 0;
        if !aligned || n.is_free() || n.offset != offset >> self.shift {
            return Err(OffsetAllocatorError::ForeignAllocation);
        }
        let size = self.size(node) << self.shift;
        self.free_node(node);
        Ok(size)
    }

    /// Largest free block in bytes (exact: the highest non-empty bin is scanned).
    pub fn largest_free_region(&self) -> u64 {
        if self.top_mask == 0 {
            return 0;
        }
        let top = 63 - self.top_mask.leading_zeros() as usize;
        let leaf = 7 - self.leaf_masks[top].leading_zeros() as usize;
        let mut i = self.heads[(top << MANTISSA_BITS) | leaf];
        let mut best = 0;
        while i != NONE {
            best = best.max(self.size(i));
            i = self.nodes[i as usize].bin_next;
        }
        best << self.shift
    }

    /// A snapshot of the space.
    pub fn report(&self) -> AllocatorReport {
        let free = self.free_bytes();
        let largest = self.largest_free_region();
        AllocatorReport {
            capacity: self.capacity(),
            used_bytes: self.used_bytes(),
            free_bytes: free,
            free_regions: self.free_blocks,
            largest_free_region: largest,
            fragmentation: if free == 0 { 0.0 } else { 1.0 - largest as f64 / free as f64 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_stay_small() {
        // A store keeps one allocation per object replica: 24 bytes, and `Option`
        // costs nothing (the owner id is never 0).
        assert_eq!(std::mem::size_of::<Allocation>(), 24);
        assert_eq!(std::mem::size_of::<Option<Allocation>>(), 24);
    }

    #[test]
    fn nodes_stay_small() {
        // One node per allocated block: the master's memory per object counts it.
        assert_eq!(std::mem::size_of::<Node>(), 24);
    }

    #[test]
    fn bins_bracket_sizes() {
        for s in (1u64..5000).chain([1 << 20, (1 << 40) + 12345, u64::MAX >> 7]) {
            let d = bin_down(s);
            assert!(bin_size(d) <= s, "{s}");
            let u = bin_up(s);
            assert!(bin_size(u) >= s, "{s}");
            assert!(u - d <= 1);
        }
    }

    #[test]
    fn refuses_bad_alignment_and_capacity() {
        assert_eq!(OffsetAllocator::with_alignment(1024, 3).unwrap_err(), OffsetAllocatorError::InvalidAlignment(3));
        assert_eq!(OffsetAllocator::with_alignment(63, 64).unwrap_err(), OffsetAllocatorError::ZeroCapacity);
    }

    #[test]
    fn huge_and_zero_requests_fail_cleanly() {
        let mut a = OffsetAllocator::new(1 << 20);
        assert!(a.allocate(0).is_none());
        assert!(a.allocate(u64::MAX).is_none());
        assert!(a.allocate((1 << 20) + 1).is_none());
        assert!(a.allocate_at(u64::MAX - 63, 64).is_none());
    }

    #[test]
    fn one_tebibyte_segment() {
        let mut a = OffsetAllocator::new(1 << 40);
        let x = a.allocate(1 << 39).unwrap();
        let y = a.allocate(1 << 39).unwrap();
        assert_eq!(y.offset(), 1 << 39);
        assert!(a.allocate(64).is_none());
        a.free(x);
        a.free(y);
        assert_eq!(a.report().largest_free_region, 1 << 40);
    }

    #[test]
    fn foreign_allocations_are_refused() {
        let mut a = OffsetAllocator::new(1 << 20);
        let mut b = OffsetAllocator::new(1 << 20);
        let x = a.allocate(100).unwrap();
        assert_eq!(b.try_free(x), Err(OffsetAllocatorError::ForeignAllocation));
    }

    #[test]
    fn blocks_free_like_allocations() {
        assert_eq!(std::mem::size_of::<Option<Block>>(), 4);
        let mut a = OffsetAllocator::new(1 << 20);
        let mut b = OffsetAllocator::new(1 << 20);
        let x = a.allocate(100).unwrap();
        let y = a.allocate(1000).unwrap();
        let (xo, yo) = (x.offset(), y.offset());
        // A block of another allocator where nothing is in use, or the wrong offset,
        // is refused.
        let xb = x.into_block();
        assert_eq!(b.try_free_block(xo, Block(xb.0)), Err(OffsetAllocatorError::ForeignAllocation));
        assert_eq!(a.try_free_block(yo, Block(xb.0)), Err(OffsetAllocatorError::ForeignAllocation));
        assert_eq!(a.try_free_block(xo + 1, Block(xb.0)), Err(OffsetAllocatorError::ForeignAllocation));
        assert_eq!(a.try_free_block(xo, xb), Ok(128));
        assert_eq!(a.try_free_block(yo, y.into_block()), Ok(1024));
        assert_eq!(a.used_bytes(), 0);
        assert_eq!(a.report().largest_free_region, 1 << 20, "frees coalesce");
    }

    #[test]
    fn allocate_at_rebuilds_a_layout() {
        let mut a = OffsetAllocator::new(1 << 20);
        let x = a.allocate_at(4096, 1000).unwrap();
        let y = a.allocate_at(8192, 64).unwrap();
        assert_eq!((x.offset(), y.offset()), (4096, 8192));
        assert!(a.allocate_at(4096 + 512, 64).is_none(), "inside a used range");
        assert!(a.allocate_at(100, 64).is_none(), "unaligned");
        let z = a.allocate_at(0, 4096).unwrap();
        assert_eq!(z.offset(), 0);
        a.free(x);
        a.free(y);
        a.free(z);
        assert_eq!(a.report().largest_free_region, 1 << 20);
    }
}
