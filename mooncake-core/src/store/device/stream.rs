//! Replicas a transport reads into host memory (a TCP peer's; a segment that
//! could not be page-locked), streamed into device memory through two pinned
//! chunks: while the transport fills one chunk, the DMA of the other runs. The
//! staging memory a call holds is two chunks, however many objects and bytes it
//! reads; the bytes reach the device as they arrive, not after the last one.

use mooncake_gpu::{DeviceMemory, DeviceStream, Fence, PooledBuffer};
use mooncake_transfer::{RemoteRegion, TransferEngine, TransferRequest};

use super::staging::staging;
use crate::error::{Error, Result};

/// The smallest chunk: below it, a transport call's fixed cost outweighs the
/// overlap.
const MIN_CHUNK: usize = 2 << 20;
/// The largest chunk (two of them are held per call).
const MAX_CHUNK: usize = 16 << 20;

/// One replica to read into device memory.
pub(in crate::store) struct StreamRead<'a> {
    /// The replica's region and the object's offset in it.
    pub region: &'a RemoteRegion,
    pub offset: u64,
    /// The object's length.
    pub len: u64,
    /// Where it goes: `mem` from `dst` on (a range already checked).
    pub mem: &'a dyn DeviceMemory,
    pub dst: u64,
}

/// A piece of one read in one chunk: read `index`, bytes `at .. at + len` of
/// the object, at `pos` in the chunk.
struct Piece {
    index: usize,
    at: u64,
    len: usize,
    pos: usize,
}

/// Reads every replica into its device memory; one result per read (an error
/// stops that read's later pieces). The device bytes are not checked here.
pub(in crate::store) fn stream_reads(engine: &TransferEngine, reads: &[StreamRead<'_>]) -> Vec<Result<()>> {
    let mut results: Vec<Result<()>> = reads.iter().map(|_| Ok(())).collect();
    let Some(first) = reads.first() else { return results };
    let total: u64 = reads.iter().map(|r| r.len).sum();
    let chunk = usize::try_from(total / 4).unwrap_or(MAX_CHUNK).clamp(MIN_CHUNK, MAX_CHUNK);
    // Pinned buffers are portable: any device memory's copies can use them.
    let mut slots: Vec<PooledBuffer<'static>> = Vec::with_capacity(2);
    for _ in 0..2 {
        match staging(first.mem, chunk) {
            Ok(b) => slots.push(b),
            Err(e) => return reads.iter().map(|_| Err(e.clone())).collect(),
        }
    }
    // Declared after the slots, so dropped before them: a stream's drop waits
    // for the copies that read the slots.
    let mut streams: Vec<(u64, Box<dyn DeviceStream + '_>)> = Vec::new();
    // Per slot, the fences after the copies out of it.
    let mut busy: [Vec<(usize, Fence)>; 2] = [Vec::new(), Vec::new()];
    let (mut read, mut at) = (0usize, 0u64);
    let mut wave = 0usize;
    while read < reads.len() {
        let slot = wave % 2;
        wave += 1;
        // The copies out of this slot two chunks ago are done before it is refilled.
        for (s, fence) in busy[slot].drain(..) {
            if let Err(e) = streams[s].1.wait(fence) {
                let e = Error::from(e);
                results.iter_mut().filter(|r| r.is_ok()).for_each(|r| *r = Err(e.clone()));
                return results;
            }
        }
        // The next chunk's worth of pieces, in object order.
        let mut pieces: Vec<Piece> = Vec::new();
        let mut pos = 0usize;
        while pos < chunk && read < reads.len() {
            let r = &reads[read];
            if results[read].is_err() || at >= r.len {
                read += 1;
                at = 0;
                continue;
            }
            let n = ((r.len - at) as usize).min(chunk - pos);
            pieces.push(Piece { index: read, at, len: n, pos });
            pos += n;
            at += n as u64;
        }
        if pieces.is_empty() {
            break;
        }
        let buf = &mut slots[slot][..pos];
        let mut reqs: Vec<TransferRequest<'_>> = Vec::with_capacity(pieces.len());
        let mut rest = buf;
        for p in &pieces {
            let (mine, tail) = rest.split_at_mut(p.len);
            rest = tail;
            reqs.push(TransferRequest::read(reads[p.index].region, reads[p.index].offset + p.at, mine));
        }
        let done = engine.transfer(&mut reqs);
        drop(reqs);
        for (p, res) in pieces.iter().zip(done) {
            if let Err(e) = res {
                results[p.index] = Err(e.into());
            }
        }
        let base = slots[slot].as_ptr();
        let mut used: Vec<usize> = Vec::new();
        for p in &pieces {
            if results[p.index].is_err() {
                continue;
            }
            let r = &reads[p.index];
            let s = match stream_of(&mut streams, r.mem) {
                Ok(s) => s,
                Err(e) => {
                    results[p.index] = Err(e);
                    continue;
                }
            };
            // SAFETY: the piece's bytes lie in the slot (`pos + len <= chunk`); the
            // slot is not written again before the fence taken below is waited
            // for, and outlives the stream (declared before it).
            let queued = unsafe { streams[s].1.copy_to_device_async(base.add(p.pos), p.len, r.dst + p.at) };
            match queued {
                Ok(()) if !used.contains(&s) => used.push(s),
                Ok(()) => {}
                Err(e) => results[p.index] = Err(e.into()),
            }
        }
        for s in used {
            match streams[s].1.fence() {
                Ok(f) => busy[slot].push((s, f)),
                Err(e) => {
                    let e = Error::from(e);
                    results.iter_mut().filter(|r| r.is_ok()).for_each(|r| *r = Err(e.clone()));
                    return results;
                }
            }
        }
    }
    for (_, stream) in &mut streams {
        if let Err(e) = stream.synchronize() {
            let e = Error::from(e);
            results.iter_mut().filter(|r| r.is_ok()).for_each(|r| *r = Err(e.clone()));
        }
    }
    results
}

/// The index of `mem`'s stream in `streams` (opened on first use).
fn stream_of<'a>(streams: &mut Vec<(u64, Box<dyn DeviceStream + 'a>)>, mem: &'a dyn DeviceMemory) -> Result<usize> {
    if let Some(at) = streams.iter().position(|(ptr, _)| *ptr == mem.device_ptr()) {
        return Ok(at);
    }
    streams.push((mem.device_ptr(), mem.open_stream()?));
    Ok(streams.len() - 1)
}
