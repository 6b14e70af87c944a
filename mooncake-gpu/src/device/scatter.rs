//! [`DeviceScatter`]: several ranges of device memory seen as one contiguous
//! [`DeviceMemory`], so that one object can be copied into (or out of) a list
//! of buffers — the per-layer KV blocks of a framework — or a range narrower
//! than its allocation can be handed to an API that takes a whole memory.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use mooncake_transfer::DmaBuf;

use super::{check_range, DeviceMemory, DeviceRange, DeviceStream, Fence, MemoryLocation, PinnedBuffer};
use crate::error::{GpuError, Result};

/// One range of a [`DeviceScatter`].
struct Part {
    mem: Arc<dyn DeviceMemory>,
    /// Offset of the range in `mem`.
    offset: u64,
    len: u64,
    /// Offset of the range in the scatter.
    at: u64,
}

/// Ranges of device memory (each `(memory, offset, len)`, any allocation, any
/// device) laid end to end as one [`DeviceMemory`]: byte `x` of the scatter is
/// byte `x - at_i + offset_i` of part `i`. A copy that spans parts is split into
/// one copy per part, each on a stream of that part's memory; fences cover all
/// of them.
///
/// It has no allocation id and cannot be exported as a dma-buf: the store
/// stages it (a NIC registers one allocation, not a list of ranges).
///
/// ```
/// use std::sync::Arc;
/// use mooncake_gpu::{DeviceMemory, DeviceScatter, HostDeviceMemory};
///
/// # fn main() -> mooncake_gpu::Result<()> {
/// let a: Arc<dyn DeviceMemory> = Arc::new(HostDeviceMemory::new(8)?);
/// let b: Arc<dyn DeviceMemory> = Arc::new(HostDeviceMemory::new(8)?);
/// // Bytes 2..6 of `a`, then 0..8 of `b`: 12 bytes.
/// let s = DeviceScatter::new(vec![(a.clone(), 2, 4), (b.clone(), 0, 8)])?;
/// s.copy_from_host(0, b"0123456789AB")?;
/// let mut back = [0u8; 12];
/// s.copy_to_host(0, &mut back)?;
/// assert_eq!(&back, b"0123456789AB");
/// assert!(DeviceScatter::new(vec![(a, 6, 4)]).is_err()); // past the end of `a`
/// # Ok(())
/// # }
/// ```
pub struct DeviceScatter {
    parts: Vec<Part>,
    len: u64,
}

impl fmt::Debug for DeviceScatter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceScatter").field("parts", &self.parts.len()).field("len", &self.len).finish()
    }
}

impl DeviceScatter {
    /// The ranges `(memory, offset, len)` in order. `InvalidArgument` for no
    /// range or an empty one, `OutOfBounds` for a range outside its memory.
    pub fn new(ranges: Vec<(Arc<dyn DeviceMemory>, u64, u64)>) -> Result<Self> {
        if ranges.is_empty() {
            return Err(GpuError::InvalidArgument("a scatter of no range".into()));
        }
        let mut parts = Vec::with_capacity(ranges.len());
        let mut at = 0u64;
        for (mem, offset, len) in ranges {
            if len == 0 {
                return Err(GpuError::InvalidArgument("an empty range in a scatter".into()));
            }
            mem.check_range(offset, len)?;
            parts.push(Part { mem, offset, len, at });
            at = at.checked_add(len).ok_or_else(|| GpuError::InvalidArgument("scatter longer than 2^64".into()))?;
        }
        Ok(Self { parts, len: at })
    }

    /// The part whose memory says how the scatter is moved: the first on a device,
    /// else the first (the scatter is host emulation throughout).
    fn leading(&self) -> &Part {
        self.parts.iter().find(|p| !p.mem.location().is_emulated()).unwrap_or(&self.parts[0])
    }

    /// The part holding scatter byte `x` (`x < len`).
    fn part_at(&self, x: u64) -> usize {
        self.parts.partition_point(|p| p.at + p.len <= x)
    }

    /// The pieces of `[offset, offset + len)` (a checked range), in order: each
    /// a part, the offset in its memory and the length.
    fn pieces(&self, offset: u64, len: u64) -> Vec<Piece> {
        let (mut pieces, end) = (Vec::new(), offset + len);
        let mut at = offset;
        while at < end {
            let part = self.part_at(at);
            let p = &self.parts[part];
            let n = (p.at + p.len).min(end) - at;
            pieces.push(Piece { part, offset: p.offset + (at - p.at), len: n });
            at += n;
        }
        pieces
    }

    /// Each item's device ranges (an item: the pieces of one range), if every
    /// piece is [`DeviceRange`]s: then they may be summed as one batch.
    fn device_items(&self, items: &[Vec<Piece>]) -> Option<Vec<Vec<DeviceRange>>> {
        items
            .iter()
            .map(|pieces| {
                let mut ranges = Vec::with_capacity(pieces.len());
                for p in pieces {
                    ranges.extend(self.parts[p.part].mem.device_ranges(p.offset, p.len)?);
                }
                Some(ranges)
            })
            .collect()
    }

    /// Each item's sum as one batch on the device, where every piece is device
    /// ranges of one device (`None`: sum them another way).
    fn crc32c_on_device(&self, items: &[Vec<Piece>]) -> Result<Option<Vec<u32>>> {
        match self.device_items(items) {
            Some(ranges) => crate::cuda::crc32c_of_device_ranges(&ranges),
            None => Ok(None),
        }
    }

    /// The pieces' sums, each by its own memory, folded in order.
    fn crc32c_by_piece(&self, pieces: &[Piece]) -> Result<u32> {
        let mut crc = 0u32;
        for p in pieces {
            crc = fold(crc, self.parts[p.part].mem.crc32c(p.offset, p.len)?, p.len)?;
        }
        Ok(crc)
    }
}

/// A range of one part of a [`DeviceScatter`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    /// The part's index.
    part: usize,
    /// The offset in the part's memory.
    offset: u64,
    len: u64,
}

/// The part every piece of `items` lies in, if there is one such part (`None`
/// also for no piece at all).
fn one_part(items: &[Vec<Piece>]) -> Option<usize> {
    let mut parts = items.iter().flatten().map(|p| p.part);
    parts.next().filter(|&first| parts.all(|p| p == first))
}

/// Each item's range in its part's memory (`(0, 0)` for an empty item), for items
/// of [`one_part`].
fn within_part(items: &[Vec<Piece>]) -> Vec<(u64, u64)> {
    items.iter().map(|i| i.first().map_or((0, 0), |p| (p.offset, p.len))).collect()
}

/// `crc`'s bytes followed by `len` bytes that sum to `piece`.
fn fold(crc: u32, piece: u32, len: u64) -> Result<u32> {
    let len = usize::try_from(len).map_err(|_| GpuError::InvalidArgument(format!("{len} bytes")))?;
    Ok(mooncake_transfer::checksum::crc32c_combine(crc, piece, len))
}

impl DeviceMemory for DeviceScatter {
    fn len(&self) -> u64 {
        self.len
    }

    /// The location of the first part on a device (the parts of one call are
    /// normally on one device; host parts, registered host buffers or scratch, are
    /// emulation): the store moves the scatter as device memory if any part is.
    fn location(&self) -> MemoryLocation {
        self.leading().mem.location()
    }

    fn device_ptr(&self) -> u64 {
        self.parts[0].mem.device_ptr() + self.parts[0].offset
    }

    fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
        // Pinned buffers of a CUDA memory are portable: usable with every part.
        self.leading().mem.alloc_pinned(len)
    }

    /// A scatter of one part is a contiguous range of that part's allocation (how the
    /// Python binding passes a slice of a registered buffer): the allocation's id, so
    /// that RDMA NICs can register the range. Several parts are not one range: `None`.
    fn allocation_id(&self) -> Option<u64> {
        match &*self.parts {
            [one] => one.mem.allocation_id(),
            _ => None,
        }
    }

    /// A scatter of one part: its allocation's dma-buf, which covers the part's range.
    fn export_dmabuf(&self) -> Result<DmaBuf> {
        match &*self.parts {
            [one] => one.mem.export_dmabuf(),
            _ => Err(GpuError::Unsupported("a scatter of several ranges cannot be exported as one dma-buf".into())),
        }
    }

    /// Parts that are ranges of one CUDA device summed as one batch on it
    /// ([`DeviceMemory::device_ranges`]); otherwise each part's range summed by
    /// its own memory (on the device, for CUDA memory), the sums folded in order.
    fn crc32c(&self, offset: u64, len: u64) -> Result<u32> {
        Ok(self.crc32c_each(&[(offset, len)])?[0])
    }

    /// Ranges over parts of one CUDA device in one batch; otherwise range by range.
    fn crc32c_each(&self, ranges: &[(u64, u64)]) -> Result<Vec<u32>> {
        for &(offset, len) in ranges {
            self.check_range(offset, len)?;
        }
        let items: Vec<Vec<Piece>> = ranges.iter().map(|&(offset, len)| self.pieces(offset, len)).collect();
        if let Some(part) = one_part(&items) {
            // A slice of one memory (how the Python binding passes a buffer): its own batch.
            return self.parts[part].mem.crc32c_each(&within_part(&items));
        }
        if let Some(sums) = self.crc32c_on_device(&items)? {
            return Ok(sums);
        }
        items.iter().map(|pieces| self.crc32c_by_piece(pieces)).collect()
    }

    fn device_ranges(&self, offset: u64, len: u64) -> Option<Vec<DeviceRange>> {
        self.check_range(offset, len).ok()?;
        self.device_items(&[self.pieces(offset, len)]).and_then(|mut items| items.pop())
    }

    fn open_stream(&self) -> Result<Box<dyn DeviceStream + '_>> {
        Ok(Box::new(ScatterStream {
            scatter: self,
            streams: (0..self.parts.len()).map(|_| None).collect(),
            fences: BTreeMap::new(),
            next: 0,
        }))
    }
}

/// Copies of a [`DeviceScatter`]: one stream per part, opened when first used.
struct ScatterStream<'a> {
    scatter: &'a DeviceScatter,
    streams: Vec<Option<Box<dyn DeviceStream + 'a>>>,
    /// Per ticket, the fence taken on each open stream.
    fences: BTreeMap<u64, Vec<(usize, Fence)>>,
    next: u64,
}

impl<'a> ScatterStream<'a> {
    fn stream(&mut self, i: usize) -> Result<&mut Box<dyn DeviceStream + 'a>> {
        if self.streams[i].is_none() {
            self.streams[i] = Some(self.scatter.parts[i].mem.open_stream()?);
        }
        Ok(self.streams[i].as_mut().expect("just opened"))
    }

    /// Calls `f(stream, host offset, len, offset in the part)` for each piece of
    /// `[offset, offset + len)` of the scatter.
    fn split(
        &mut self,
        offset: u64,
        len: usize,
        mut f: impl FnMut(&mut Box<dyn DeviceStream + 'a>, usize, usize, u64) -> Result<()>,
    ) -> Result<()> {
        check_range(self.scatter.len, offset, len as u64)?;
        let mut done = 0usize;
        for p in self.scatter.pieces(offset, len as u64) {
            // A piece is at most `len` bytes: it fits a usize.
            let n = p.len as usize;
            f(self.stream(p.part)?, done, n, p.offset)?;
            done += n;
        }
        Ok(())
    }
}

impl DeviceStream for ScatterStream<'_> {
    unsafe fn copy_to_device_async(&mut self, src: *const u8, len: usize, dst_offset: u64) -> Result<()> {
        self.split(dst_offset, len, |s, host, n, dev| {
            // SAFETY: `src + host .. + n` lies inside the caller's `src .. src + len`,
            // which the caller keeps readable until the copy completes; every part's
            // copy completes by the fences of this stream (see `fence`).
            unsafe { s.copy_to_device_async(src.add(host), n, dev) }
        })
    }

    unsafe fn copy_from_device_async(&mut self, dst: *mut u8, len: usize, src_offset: u64) -> Result<()> {
        self.split(src_offset, len, |s, host, n, dev| {
            // SAFETY: as in `copy_to_device_async`, for writes into the caller's range.
            unsafe { s.copy_from_device_async(dst.add(host), n, dev) }
        })
    }

    fn fence(&mut self) -> Result<Fence> {
        let mut taken = Vec::new();
        for (i, s) in self.streams.iter_mut().enumerate() {
            if let Some(s) = s {
                taken.push((i, s.fence()?));
            }
        }
        self.next += 1;
        self.fences.insert(self.next, taken);
        Ok(Fence(self.next))
    }

    fn wait(&mut self, fence: Fence) -> Result<()> {
        // The newest ticket at or before the fence covers the older ones on each stream.
        let covered: Vec<u64> = self.fences.range(..=fence.0).map(|(&t, _)| t).collect();
        let Some(&last) = covered.last() else { return Ok(()) };
        let mut newest: BTreeMap<usize, Fence> = BTreeMap::new();
        for t in &covered {
            for &(i, f) in &self.fences[t] {
                newest.insert(i, f);
            }
        }
        for (i, f) in newest {
            self.streams[i].as_mut().expect("a fence was taken on it").wait(f)?;
        }
        self.fences.retain(|&t, _| t > last);
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        for s in self.streams.iter_mut().flatten() {
            s.synchronize()?;
        }
        self.fences.clear();
        Ok(())
    }

    /// Ranges within one part: that part's stream chains the sums behind its
    /// copies (one wait). Ranges over parts that are ranges of one CUDA device:
    /// every part's copies waited for, then one batch for all the ranges.
    /// Otherwise each piece summed behind its part's copies (chained where the
    /// part's stream can, else by the part's memory once its copies are done),
    /// the sums of each range folded in order.
    fn synchronize_and_crc32c(&mut self, ranges: &[(u64, u64)]) -> Result<Option<Vec<u32>>> {
        for &(offset, len) in ranges {
            check_range(self.scatter.len, offset, len)?;
        }
        let scatter = self.scatter;
        let items: Vec<Vec<Piece>> = ranges.iter().map(|&(offset, len)| scatter.pieces(offset, len)).collect();
        if let Some(only) = one_part(&items) {
            if let Some(sums) = self.stream(only)?.synchronize_and_crc32c(&within_part(&items))? {
                self.synchronize()?;
                return Ok(Some(sums));
            }
        } else if scatter.device_items(&items).is_some() {
            self.synchronize()?;
            if let Some(sums) = scatter.crc32c_on_device(&items)? {
                return Ok(Some(sums));
            }
        }
        let mut sums = Vec::with_capacity(items.len());
        for pieces in &items {
            let mut crc = 0u32;
            for p in pieces {
                let chained = self.stream(p.part)?.synchronize_and_crc32c(&[(p.offset, p.len)])?;
                let piece = match chained {
                    Some(s) => s[0],
                    None => scatter.parts[p.part].mem.crc32c(p.offset, p.len)?,
                };
                crc = fold(crc, piece, p.len)?;
            }
            sums.push(crc);
        }
        self.synchronize()?;
        Ok(Some(sums))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostDeviceMemory;

    /// Host memory that says it is on CUDA device 3 (what the scatter asks of a
    /// part's location, without a GPU).
    #[derive(Debug)]
    struct OnDevice3(HostDeviceMemory);

    impl DeviceMemory for OnDevice3 {
        fn len(&self) -> u64 {
            self.0.len()
        }
        fn location(&self) -> MemoryLocation {
            MemoryLocation::Cuda { ordinal: 3 }
        }
        fn device_ptr(&self) -> u64 {
            self.0.device_ptr()
        }
        fn alloc_pinned(&self, len: usize) -> Result<PinnedBuffer> {
            self.0.alloc_pinned(len)
        }
        fn open_stream(&self) -> Result<Box<dyn DeviceStream + '_>> {
            self.0.open_stream()
        }
    }

    /// A scatter with a part on a device is moved as device memory, whichever part
    /// comes first (a get_into_ranges object starts with host scratch for the bytes
    /// before its first range); one of host parts only stays emulation.
    #[test]
    fn a_scatter_is_where_its_first_device_part_is() {
        let host = || Arc::new(HostDeviceMemory::new(64).unwrap()) as Arc<dyn DeviceMemory>;
        let device: Arc<dyn DeviceMemory> = Arc::new(OnDevice3(HostDeviceMemory::new(64).unwrap()));
        let mixed = DeviceScatter::new(vec![(host(), 0, 8), (device.clone(), 0, 8), (host(), 8, 8)]).unwrap();
        assert_eq!(mixed.location(), MemoryLocation::Cuda { ordinal: 3 });
        let hosts = DeviceScatter::new(vec![(host(), 0, 8), (host(), 0, 8)]).unwrap();
        assert!(hosts.location().is_emulated());
        assert_eq!(DeviceScatter::new(vec![(device, 0, 8)]).unwrap().location(), MemoryLocation::Cuda { ordinal: 3 });
    }

    #[test]
    fn copies_split_across_parts_and_wait_on_all_of_them() {
        let a = Arc::new(HostDeviceMemory::new(16).unwrap());
        let b = Arc::new(HostDeviceMemory::new(16).unwrap());
        let s = DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 10, 6), (b.clone(), 3, 5)]).unwrap();
        assert_eq!(s.len(), 11);
        let data: Vec<u8> = (1..=11).collect();
        let mut st = s.open_stream().unwrap();
        // SAFETY: `data` outlives the stream and is not written.
        unsafe { st.copy_to_device_async(data.as_ptr(), 11, 0).unwrap() };
        let f = st.fence().unwrap();
        assert_eq!(a.to_vec()[10..], [0; 6], "deferred until waited on");
        st.wait(f).unwrap();
        assert_eq!(a.to_vec()[10..], [1, 2, 3, 4, 5, 6]);
        assert_eq!(b.to_vec()[3..8], [7, 8, 9, 10, 11]);
        // A read in the middle, across the boundary.
        let mut back = [0u8; 4];
        // SAFETY: `back` outlives the copy (synchronized below) and is not touched.
        unsafe { st.copy_from_device_async(back.as_mut_ptr(), 4, 4).unwrap() };
        st.synchronize().unwrap();
        assert_eq!(back, [5, 6, 7, 8]);
        // SAFETY: refused before anything is enqueued.
        let r = unsafe { st.copy_to_device_async(data.as_ptr(), 2, 10) };
        assert!(matches!(r, Err(GpuError::OutOfBounds(_))));
    }

    #[test]
    fn the_sum_of_any_range_is_the_sum_of_its_bytes_across_parts() {
        let lens = [70_000u64, 1, 4096, 33_333];
        let mems: Vec<Arc<HostDeviceMemory>> =
            lens.iter().map(|&n| Arc::new(HostDeviceMemory::new(n + 9).unwrap())).collect();
        let mut all = Vec::new();
        for (i, (m, &n)) in mems.iter().zip(&lens).enumerate() {
            let bytes: Vec<u8> = (0..n).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8)).collect();
            m.copy_from_host(9, &bytes).unwrap();
            all.extend(bytes);
        }
        let ranges = mems.iter().zip(&lens).map(|(m, &n)| (m.clone() as Arc<dyn DeviceMemory>, 9, n)).collect();
        let s = DeviceScatter::new(ranges).unwrap();
        let total = all.len() as u64;
        for (offset, len) in [(0, total), (0, 0), (5, 70_000), (69_999, 2), (70_000, 1), (70_001, 4096), (1, total - 2)]
        {
            let want = crc32c::crc32c(&all[offset as usize..(offset + len) as usize]);
            assert_eq!(s.crc32c(offset, len).unwrap(), want, "{offset}+{len}");
        }
        assert!(matches!(s.crc32c(total, 1), Err(GpuError::OutOfBounds(_))));
        // The batch form gives each range's sum.
        let ranges = [(0, total), (69_999, 2), (0, 0), (70_001, 4096)];
        let want: Vec<u32> = ranges.iter().map(|&(o, n)| crc32c::crc32c(&all[o as usize..(o + n) as usize])).collect();
        assert_eq!(s.crc32c_each(&ranges).unwrap(), want);
        assert!(matches!(s.crc32c_each(&[(0, 1), (total, 1)]), Err(GpuError::OutOfBounds(_))));
        // Ranges within one part: that part's memory sums them.
        let inside = [(5, 100), (0, 0), (69_000, 1_000)];
        let want: Vec<u32> = inside.iter().map(|&(o, n)| crc32c::crc32c(&all[o as usize..(o + n) as usize])).collect();
        assert_eq!(s.crc32c_each(&inside).unwrap(), want);
    }

    #[test]
    fn ranges_of_device_memory_are_handed_to_the_device_sum_and_others_summed_by_piece() {
        let on = |ordinal: usize| Arc::new(HostDeviceMemory::new(64).unwrap().with_device_ranges(ordinal));
        let (a, b, c) = (on(0), on(0), on(1));
        let at = |m: &Arc<HostDeviceMemory>, ordinal: usize, offset: u64, len: u64| DeviceRange {
            ordinal,
            address: m.device_ptr() + offset,
            len,
        };
        let two = DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 8, 16), (b.clone(), 0, 32)]).unwrap();
        let items = |s: &DeviceScatter, ranges: &[(u64, u64)]| {
            let pieces: Vec<Vec<Piece>> = ranges.iter().map(|&(o, n)| s.pieces(o, n)).collect();
            s.device_items(&pieces)
        };
        // Each item's pieces, across the parts' boundary or not, as device ranges.
        assert_eq!(
            items(&two, &[(4, 30), (20, 8), (0, 0)]).unwrap(),
            vec![vec![at(&a, 0, 12, 12), at(&b, 0, 0, 18)], vec![at(&b, 0, 4, 8)], vec![]]
        );
        // Two devices: device ranges still (the device sum refuses them).
        let mixed = DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 0, 8), (c.clone(), 0, 8)]).unwrap();
        let ranges = items(&mixed, &[(0, 16)]).unwrap();
        assert_eq!(ranges, vec![vec![at(&a, 0, 0, 8), at(&c, 1, 0, 8)]]);
        assert_eq!(crate::crc32c_of_device_ranges(&ranges).unwrap(), None, "ranges of two devices: not one batch");
        assert_eq!(crate::crc32c_of_device_ranges(&[vec![], vec![]]).unwrap(), None, "no device range at all");
        // Plain emulated memory has no device ranges: piece by piece.
        let host = Arc::new(HostDeviceMemory::new(64).unwrap());
        let plain = DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 0, 8), (host, 0, 8)]).unwrap();
        assert!(items(&plain, &[(0, 16)]).is_none());
        assert!(items(&plain, &[(0, 4)]).is_some(), "a range that stays in the device part");
        // A scatter inside a scatter (a registered buffer's slice, as the Python
        // binding makes them) gives the device ranges of the memory under it.
        let slice: Arc<dyn DeviceMemory> = Arc::new(DeviceScatter::new(vec![(b.clone(), 10, 20)]).unwrap());
        assert_eq!(slice.device_ranges(5, 10), Some(vec![at(&b, 0, 15, 10)]));
        assert_eq!(slice.device_ranges(15, 10), None, "past the slice");
        let nested = DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 0, 4), (slice, 0, 20)]).unwrap();
        assert_eq!(nested.device_ranges(0, 24), Some(vec![at(&a, 0, 0, 4), at(&b, 0, 10, 20)]));
        assert_eq!(two.device_ranges(0, 30), Some(vec![at(&a, 0, 8, 16), at(&b, 0, 0, 14)]));
    }

    #[test]
    fn a_chained_sum_folds_each_parts_sum_taken_behind_its_copies() {
        let a = Arc::new(HostDeviceMemory::new(64).unwrap());
        let b = Arc::new(HostDeviceMemory::new(64).unwrap());
        let s = DeviceScatter::new(vec![(a.clone() as Arc<dyn DeviceMemory>, 40, 24), (b.clone(), 8, 30)]).unwrap();
        let data: Vec<u8> = (0..54u8).map(|i| i.wrapping_mul(37) ^ 0x5c).collect();
        let mut st = s.open_stream().unwrap();
        // SAFETY: `data` outlives the stream and is not written.
        unsafe { st.copy_to_device_async(data.as_ptr(), 54, 0).unwrap() };
        // Across the boundary: the copies of both parts ran first, each part summed its piece.
        let sums = st.synchronize_and_crc32c(&[(3, 40), (0, 54), (30, 0)]).unwrap().unwrap();
        assert_eq!(sums, vec![crc32c::crc32c(&data[3..43]), crc32c::crc32c(&data), 0]);
        assert_eq!((a.chained_sums(), b.chained_sums()), (2, 2));
        // Within one part: that part's stream sums them all, behind its copies.
        let sums = st.synchronize_and_crc32c(&[(25, 20), (30, 4)]).unwrap().unwrap();
        assert_eq!(sums, vec![crc32c::crc32c(&data[25..45]), crc32c::crc32c(&data[30..34])]);
        assert_eq!((a.chained_sums(), b.chained_sums()), (2, 4));
        assert!(matches!(st.synchronize_and_crc32c(&[(0, 1), (50, 5)]), Err(GpuError::OutOfBounds(_))));
        assert_eq!((a.chained_sums(), b.chained_sums()), (2, 4), "nothing summed when a range is refused");
    }
}
