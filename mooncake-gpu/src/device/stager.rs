//! [`Stager`]: chunked, double-buffered copies between host slices and device
//! memory through pinned staging buffers.

use super::{DeviceMemory, DeviceStream, Fence, PinnedBuffer};
use crate::error::{GpuError, Result};

/// Default chunk of a staged copy: the size of each pinned staging buffer.
/// At PCIe 4/5 speeds a 4 MiB DMA takes 80–160 µs, long enough to hide the
/// per-copy driver overhead and short enough to overlap well.
pub const DEFAULT_CHUNK: usize = 4 << 20;

/// Default number of staging buffers of a [`Stager`] (double buffering).
pub const DEFAULT_LANES: usize = 2;

/// Copies host slices (any memory) to and from device memory in chunks
/// through pinned staging buffers ("lanes"), overlapping the CPU copy of one
/// chunk with the DMA of the previous one.
///
/// Upload: copy chunk *i* into lane *i mod n*, enqueue its DMA, take a fence;
/// before lane *i mod n* is refilled, wait for the fence of the chunk it held.
/// Download: keep *n* DMAs in flight; wait for chunk *i*'s, copy it out of its
/// lane, enqueue chunk *i + n* into that lane.
///
/// A `Stager` owns its lanes and is reused across copies (allocate once: pinned
/// memory is slow to allocate). It works with any [`DeviceMemory`]; with CUDA
/// memory its lanes should come from a CUDA memory (page-locked).
#[derive(Debug)]
pub struct Stager {
    lanes: Vec<PinnedBuffer>,
    chunk: usize,
}

impl Stager {
    /// `lanes` staging buffers of `chunk` bytes from `mem`
    /// ([`DeviceMemory::alloc_pinned`]). `chunk >= 1`, `lanes >= 1` (2 for
    /// double buffering; 1 serialises CPU copy and DMA).
    pub fn new<M: DeviceMemory + ?Sized>(mem: &M, chunk: usize, lanes: usize) -> Result<Self> {
        if chunk == 0 || lanes == 0 {
            return Err(GpuError::InvalidArgument(format!(
                "a stager needs chunk >= 1 and lanes >= 1 (got chunk {chunk}, lanes {lanes})"
            )));
        }
        let lanes = (0..lanes).map(|_| mem.alloc_pinned(chunk)).collect::<Result<Vec<_>>>()?;
        Ok(Self { lanes, chunk })
    }

    /// Bytes per chunk (per staging buffer).
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// Number of staging buffers.
    pub fn lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Whether the staging buffers are page-locked.
    pub fn is_page_locked(&self) -> bool {
        self.lanes.iter().all(PinnedBuffer::is_page_locked)
    }

    /// Copies `src` to `dst_offset` of `mem`; returns when the bytes are in
    /// device memory. `OutOfBounds` (nothing copied) if the range is outside.
    pub fn upload<M: DeviceMemory + ?Sized>(&mut self, mem: &M, src: &[u8], dst_offset: u64) -> Result<()> {
        mem.check_range(dst_offset, src.len() as u64)?;
        if src.is_empty() {
            return Ok(());
        }
        let mut stream = mem.open_stream()?;
        let n = self.lanes.len();
        let mut pending: Vec<Option<Fence>> = vec![None; n];
        for (i, part) in src.chunks(self.chunk).enumerate() {
            let l = i % n;
            if let Some(f) = pending[l].take() {
                stream.wait(f)?;
            }
            let lane = &mut self.lanes[l];
            lane[..part.len()].copy_from_slice(part);
            let off = dst_offset + (i * self.chunk) as u64;
            // SAFETY: the lane is owned by `self`, which `&mut self` keeps
            // untouched by others; it is not written again before its fence is
            // waited (above, next round) or the stream synchronized/dropped
            // (below; the stream is a local dropped before this call returns).
            unsafe { stream.copy_to_device_async(lane.as_ptr(), part.len(), off)? };
            pending[l] = Some(stream.fence()?);
        }
        stream.synchronize()
    }

    /// Copies `dst.len()` bytes at `src_offset` of `mem` into `dst`.
    /// `OutOfBounds` (nothing copied) if the range is outside.
    pub fn download<M: DeviceMemory + ?Sized>(&mut self, mem: &M, dst: &mut [u8], src_offset: u64) -> Result<()> {
        mem.check_range(src_offset, dst.len() as u64)?;
        if dst.is_empty() {
            return Ok(());
        }
        let mut stream = mem.open_stream()?;
        let (n, chunk, total) = (self.lanes.len(), self.chunk, dst.len());
        let chunks = total.div_ceil(chunk);
        let mut pending: Vec<Option<Fence>> = vec![None; n];
        let part = |i: usize| (i * chunk, chunk.min(total - i * chunk));
        let enqueue = |i: usize, lanes: &mut [PinnedBuffer], stream: &mut dyn DeviceStream| -> Result<Fence> {
            let (off, len) = part(i);
            // SAFETY: the lane is owned by `self` (exclusively borrowed); it is
            // not read before this copy's fence is waited on (loop below), and
            // the stream is synchronized when dropped at the end of this call.
            unsafe { stream.copy_from_device_async(lanes[i % n].as_mut_ptr(), len, src_offset + off as u64)? };
            stream.fence()
        };
        for i in 0..n.min(chunks) {
            pending[i % n] = Some(enqueue(i, &mut self.lanes, &mut *stream)?);
        }
        for i in 0..chunks {
            let l = i % n;
            if let Some(f) = pending[l].take() {
                stream.wait(f)?;
            }
            let (off, len) = part(i);
            dst[off..off + len].copy_from_slice(&self.lanes[l][..len]);
            if i + n < chunks {
                pending[l] = Some(enqueue(i + n, &mut self.lanes, &mut *stream)?);
            }
        }
        Ok(())
    }
}
