//! The checksum of device bytes computed on the CPU: the default of
//! [`DeviceMemory::crc32c`].

use super::{DeviceMemory, DeviceStream, Fence, PinnedBuffer, DEFAULT_CHUNK};
use crate::error::Result;

/// crc32c of `len` bytes at `offset` of `mem` (a range already checked), copied
/// to two pinned buffers in chunks of at most [`DEFAULT_CHUNK`] bytes: the copy of
/// one chunk runs while the previous one is summed.
pub(crate) fn crc32c_by_download<M: DeviceMemory + ?Sized>(mem: &M, offset: u64, len: u64) -> Result<u32> {
    if len == 0 {
        return Ok(crc32c::crc32c(&[]));
    }
    let chunk = usize::try_from(len).unwrap_or(usize::MAX).clamp(1, DEFAULT_CHUNK);
    let pieces = len.div_ceil(chunk as u64);
    let piece = |i: u64| (offset + i * chunk as u64, (len - i * chunk as u64).min(chunk as u64) as usize);
    // Declared before the stream, so dropped after it: the stream's drop waits
    // for copies still going into them.
    let mut lanes = vec![mem.alloc_pinned(chunk)?];
    if pieces > 1 {
        lanes.push(mem.alloc_pinned(chunk)?);
    }
    let mut stream = mem.open_stream()?;
    let (at, n) = piece(0);
    let mut next = enqueue(&mut *stream, &mut lanes[0], at, n)?;
    let mut crc = 0u32;
    for i in 0..pieces {
        let current = next;
        if i + 1 < pieces {
            // Lane (i + 1) % 2 held chunk i - 1, summed in the previous round.
            let (at, n) = piece(i + 1);
            next = enqueue(&mut *stream, &mut lanes[((i + 1) % 2) as usize], at, n)?;
        }
        stream.wait(current)?;
        let (_, n) = piece(i);
        crc = crc32c::crc32c_append(crc, &lanes[(i % 2) as usize][..n]);
    }
    Ok(crc)
}

/// Enqueues the copy of `n` device bytes at `at` into `lane`; the fence after it.
fn enqueue(stream: &mut dyn DeviceStream, lane: &mut PinnedBuffer, at: u64, n: usize) -> Result<Fence> {
    // SAFETY: the lane has room for `n <= chunk` bytes; the caller reads it only
    // after waiting on the returned fence, and enqueues into it again only after
    // summing what it holds (one chunk ahead over two lanes). On an early return
    // the stream, dropped before the lanes, waits for the copy.
    unsafe { stream.copy_from_device_async(lane.as_mut_ptr(), n, at)? };
    stream.fence()
}
