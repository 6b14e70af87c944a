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
/// The largest chunk (two of them are held per call). Chunks are large on
/// purpose: a TCP transfer moves a large request faster per byte (more lanes at
/// once) than several small ones, and the DMA (several times faster than TCP)
/// left exposed after the last chunk is small beside it (measured on an H100:
/// four 4 MiB chunks of a 16 MiB object cost more than the overlap gained).
const MAX_CHUNK: usize = 32 << 20;

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
    let total: u64 = reads.iter().map(|r| r.len).sum();
    let chunk = usize::try_from(total.div_ceil(2)).unwrap_or(MAX_CHUNK).clamp(MIN_CHUNK, MAX_CHUNK);
    stream_in_chunks(engine, reads, chunk)
}

/// [`stream_reads`] through two chunks of `chunk` bytes.
fn stream_in_chunks(engine: &TransferEngine, reads: &[StreamRead<'_>], chunk: usize) -> Vec<Result<()>> {
    let mut results: Vec<Result<()>> = reads.iter().map(|_| Ok(())).collect();
    let Some(first) = reads.first() else { return results };
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

#[cfg(test)]
mod tests {
    use mooncake_gpu::HostDeviceMemory;

    use super::*;

    /// Many chunks (each slot refilled many times), pieces of several objects per
    /// chunk and objects over several chunks, two device memories, a 1-byte
    /// object and a read of a region that does not exist: every other object's
    /// device bytes are exact. The emulated device runs a copy only when it is
    /// waited for, so a slot refilled before its copies ran gives wrong bytes.
    #[test]
    fn objects_arrive_exact_through_many_small_chunks() {
        let engine = TransferEngine::builder().build().unwrap();
        let region = engine.register_region(1 << 20).unwrap();
        let remote = engine.remote(region.id());
        let bytes: Vec<u8> = (0..1u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8).collect();
        // SAFETY: the region is 1 MiB of this engine's memory, written only here.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.as_mut_ptr(), bytes.len()) };
        let missing = RemoteRegion { endpoint: remote.endpoint.clone(), region: region.id() + 100 };
        let (a, b) = (HostDeviceMemory::new(200_000).unwrap(), HostDeviceMemory::new(200_000).unwrap());
        // (region, offset, len, memory, device offset)
        let plan: [(&RemoteRegion, u64, u64, &dyn DeviceMemory, u64); 6] = [
            (&remote, 7, 30_001, &a, 3),
            (&remote, 100_000, 1, &b, 0),
            (&remote, 500_000, 77_777, &b, 10),
            (&missing, 0, 5_000, &a, 40_000),
            (&remote, 3, 4_095, &a, 100_000),
            (&remote, 900_000, 50_000, &b, 100_000),
        ];
        let reads: Vec<StreamRead<'_>> = plan
            .iter()
            .map(|&(region, offset, len, mem, dst)| StreamRead { region, offset, len, mem, dst })
            .collect();
        let results = stream_in_chunks(&engine, &reads, 4_096);
        for (i, &(region, offset, len, mem, dst)) in plan.iter().enumerate() {
            if region.region != remote.region {
                assert!(results[i].is_err(), "read {i} of a missing region");
                continue;
            }
            assert!(results[i].is_ok(), "read {i}: {:?}", results[i]);
            let mem = if std::ptr::addr_eq(mem, &a as &dyn DeviceMemory) { &a } else { &b };
            let got = &mem.to_vec()[dst as usize..(dst + len) as usize];
            assert!(got == &bytes[offset as usize..(offset + len) as usize], "read {i}: device bytes");
        }
    }
}
