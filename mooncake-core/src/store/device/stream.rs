//! Replicas a transport reads into host memory (a TCP peer's; a segment that
//! could not be page-locked), streamed into device memory through two pinned
//! chunks: while the transport fills one chunk, the DMA of the other runs. Puts
//! the other way: while the transport writes one chunk to the replicas, the DMA
//! fills the other from the device. The staging memory a call holds is two
//! chunks, however many objects and bytes it moves.
//!
//! Within a chunk, a get does not wait for the whole transfer either: each range
//! the transport tells of as landed (`TransferRequest::on_landed`; TCP tells of
//! every 256 KiB) is DMA'd at once, so only the last ranges' copies follow the
//! transfer. The transfer runs on a thread of its own; the calling thread
//! enqueues the copies (a device stream stays on one thread).

use mooncake_gpu::{DeviceMemory, DeviceStream, Fence, PooledBuffer};
use mooncake_transfer::{RemoteRegion, TransferEngine, TransferError, TransferRequest};

use super::staging::staging;
use crate::error::{Error, Result};

/// The smallest chunk: a call of up to twice this moves in at most two chunks,
/// and an object of up to this in one (on an H100, TCP transfers of 2 MiB
/// pieces of a 4 MiB object cost more than the overlap saved).
const MIN_CHUNK: usize = 8 << 20;
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

/// The chunk size for `total` bytes: half of them, within the bounds.
fn chunk_for(total: u64) -> usize {
    usize::try_from(total.div_ceil(2)).unwrap_or(MAX_CHUNK).clamp(MIN_CHUNK, MAX_CHUNK)
}

/// Cuts objects of `lens` bytes into chunks of `chunk` bytes, in order: each
/// chunk's pieces (pieces of several objects share a chunk; an object larger
/// than a chunk spans several).
fn cut(lens: impl Iterator<Item = u64>, chunk: usize) -> Vec<Vec<Piece>> {
    let mut waves: Vec<Vec<Piece>> = vec![Vec::new()];
    let mut pos = 0usize;
    for (index, len) in lens.enumerate() {
        let mut at = 0u64;
        while at < len {
            if pos == chunk {
                waves.push(Vec::new());
                pos = 0;
            }
            let n = ((len - at) as usize).min(chunk - pos);
            waves.last_mut().expect("one wave at least").push(Piece { index, at, len: n, pos });
            pos += n;
            at += n as u64;
        }
    }
    waves.retain(|w| !w.is_empty());
    waves
}

/// Reads every replica into its device memory; one result per read (an error
/// stops that read's later pieces): the crc32c of the device bytes where the
/// device took it behind the last copies
/// ([`DeviceStream::synchronize_and_crc32c`]), else `None` (the caller sums).
/// The bytes are not checked here.
pub(in crate::store) fn stream_reads(engine: &TransferEngine, reads: &[StreamRead<'_>]) -> Vec<Result<Option<u32>>> {
    stream_in_chunks(engine, reads, chunk_for(reads.iter().map(|r| r.len).sum()))
}

/// [`stream_reads`] through two chunks of `chunk` bytes.
fn stream_in_chunks(engine: &TransferEngine, reads: &[StreamRead<'_>], chunk: usize) -> Vec<Result<Option<u32>>> {
    let mut results: Vec<Result<()>> = reads.iter().map(|_| Ok(())).collect();
    let Some(first) = reads.first() else { return Vec::new() };
    let slots = match two_slots(first.mem, chunk) {
        Ok(s) => s,
        Err(e) => return reads.iter().map(|_| Err(e.clone())).collect(),
    };
    let ptrs = slots.ptrs;
    // Declared after the slots, so dropped before them: a stream's drop waits
    // for the copies that read the slots.
    let mut streams: Vec<(usize, Box<dyn DeviceStream + '_>)> = Vec::new();
    // Per slot, the fences after the copies out of it.
    let mut busy: [Vec<(usize, Fence)>; 2] = [Vec::new(), Vec::new()];
    for (w, wave) in cut(reads.iter().map(|r| r.len), chunk).iter().enumerate() {
        let slot = w % 2;
        // The copies out of this slot two chunks ago are done before it is refilled.
        if let Err(e) = wait_all(&mut streams, std::mem::take(&mut busy[slot])) {
            fail_rest(&mut results, &e);
            return unsummed(results);
        }
        let pieces: Vec<&Piece> = wave.iter().filter(|p| results[p.index].is_ok()).collect();
        if pieces.is_empty() {
            continue;
        }
        // Each range the transport tells of as landed goes on to the device at once,
        // while the rest of the chunk is in flight; what it did not tell of goes
        // once the transfer returned.
        let (tx, rx) = std::sync::mpsc::channel::<Landing>();
        let hooks: Vec<_> = (0..pieces.len())
            .map(|n| {
                let tx = tx.clone();
                move |at: u64, len: usize| {
                    let _ = tx.send(Landing::Range(n, at, len));
                }
            })
            .collect();
        let mut reqs: Vec<TransferRequest<'_>> = Vec::with_capacity(pieces.len());
        for (p, hook) in pieces.iter().zip(&hooks) {
            // SAFETY: the piece lies in the slot (`pos + len <= chunk`), whose
            // earlier copies were waited for above; pieces do not overlap, and
            // nothing else writes the slot until the transfer returns (the copies
            // enqueued meanwhile only read ranges that landed).
            let buf = unsafe { std::slice::from_raw_parts_mut(ptrs[slot].add(p.pos), p.len) };
            reqs.push(TransferRequest::read(reads[p.index].region, reads[p.index].offset + p.at, buf).on_landed(hook));
        }
        let mut landed: Vec<Vec<(u64, usize)>> = vec![Vec::new(); pieces.len()];
        let mut used: Vec<usize> = Vec::new();
        let mut to_device = |n: usize, at: u64, len: usize, results: &mut [Result<()>]| {
            let p = pieces[n];
            let r = &reads[p.index];
            let queued = stream_of(&mut streams, r.mem).and_then(|s| {
                // SAFETY: the range lies in the piece, in the slot; its bytes landed
                // (the transport writes them again only when it retries after a
                // broken connection, with the same bytes), and the slot is not
                // refilled before the fence taken after this wave is waited for.
                let src = unsafe { ptrs[slot].add(p.pos + at as usize) };
                // SAFETY: as above; the slot outlives the stream (declared before it).
                unsafe { streams[s].1.copy_to_device_async(src, len, r.dst + p.at + at)? };
                Ok(s)
            });
            match queued {
                Ok(s) if !used.contains(&s) => used.push(s),
                Ok(_) => {}
                Err(e) => results[p.index] = Err(e),
            }
        };
        let done = std::thread::scope(|scope| {
            let transfer = scope.spawn(move || {
                // Told when the transfer returns, or unwinds (the panic then goes
                // on up through `join`).
                let _done = DoneOnDrop(tx);
                engine.transfer(&mut reqs)
            });
            while let Ok(Landing::Range(n, at, len)) = rx.recv() {
                // A range outside its piece is not trusted: the piece goes whole.
                if at.checked_add(len as u64).is_none_or(|end| end > pieces[n].len as u64) {
                    continue;
                }
                if results[pieces[n].index].is_ok() {
                    to_device(n, at, len, &mut results);
                }
                landed[n].push((at, len));
            }
            transfer.join().unwrap_or_else(|e| std::panic::resume_unwind(e))
        });
        drop(hooks);
        for ((n, p), res) in pieces.iter().enumerate().zip(done) {
            if let Err(e) = res {
                results[p.index] = Err(e.into());
                continue;
            }
            for (at, len) in untold(&mut landed[n], p.len) {
                if results[p.index].is_ok() {
                    to_device(n, at, len, &mut results);
                }
            }
        }
        match fences(&mut streams, used) {
            Ok(f) => busy[slot] = f,
            Err(e) => {
                fail_rest(&mut results, &e);
                return unsummed(results);
            }
        }
    }
    // Each read's check, chained behind its memory's last copies where the device
    // can: one batch per memory, in the same wait as its copies.
    let mut summed = unsummed(results);
    let mut by_stream: Vec<(usize, Vec<usize>)> = Vec::new();
    for (i, r) in reads.iter().enumerate() {
        if summed[i].is_err() {
            continue;
        }
        match stream_of(&mut streams, r.mem) {
            Ok(at) => match by_stream.iter_mut().find(|(s, _)| *s == at) {
                Some((_, reads)) => reads.push(i),
                None => by_stream.push((at, vec![i])),
            },
            Err(e) => summed[i] = Err(e),
        }
    }
    for (at, of) in by_stream {
        let ranges: Vec<(u64, u64)> = of.iter().map(|&i| (reads[i].dst, reads[i].len)).collect();
        match streams[at].1.synchronize_and_crc32c(&ranges) {
            Ok(Some(crcs)) => of.iter().zip(crcs).for_each(|(&i, crc)| summed[i] = Ok(Some(crc))),
            Ok(None) => {}
            Err(e) => {
                let e = Error::from(e);
                of.iter().for_each(|&i| summed[i] = Err(e.clone()));
            }
        }
    }
    if let Err(e) = synchronize_all(&mut streams) {
        return summed.into_iter().map(|r| r.and(Err(e.clone()))).collect();
    }
    summed
}

/// Results with no sum taken.
fn unsummed(results: Vec<Result<()>>) -> Vec<Result<Option<u32>>> {
    results.into_iter().map(|r| r.map(|()| None)).collect()
}

/// What the transfer of one wave tells the thread that enqueues its copies.
enum Landing {
    /// Piece `n` of the wave: `len` bytes at `at` landed.
    Range(usize, u64, usize),
    /// The transfer returned: nothing more lands.
    Done,
}

/// Sends [`Landing::Done`] when dropped.
struct DoneOnDrop(std::sync::mpsc::Sender<Landing>);

impl Drop for DoneOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Landing::Done);
    }
}

/// The ranges of a piece of `len` bytes not covered by the ranges told of
/// (`told`, sorted here), in order.
fn untold(told: &mut [(u64, usize)], len: usize) -> Vec<(u64, usize)> {
    told.sort_unstable();
    let mut gaps = Vec::new();
    let mut covered = 0u64;
    for &(at, n) in told.iter() {
        if at > covered {
            gaps.push((covered, (at - covered) as usize));
        }
        covered = covered.max(at + n as u64);
    }
    if covered < len as u64 {
        gaps.push((covered, len - covered as usize));
    }
    gaps
}

/// Fails every read not failed yet with `e` (a device stream broke).
fn fail_rest(results: &mut [Result<()>], e: &Error) {
    results.iter_mut().filter(|r| r.is_ok()).for_each(|r| *r = Err(e.clone()));
}

/// Two pinned chunks (portable: any device memory's copies can use them) and
/// their addresses.
struct Slots {
    _bufs: [PooledBuffer<'static>; 2],
    ptrs: [*mut u8; 2],
}

fn two_slots(mem: &dyn DeviceMemory, chunk: usize) -> Result<Slots> {
    let mut bufs = [staging(mem, chunk)?, staging(mem, chunk)?];
    let ptrs = [bufs[0].as_mut_ptr(), bufs[1].as_mut_ptr()];
    Ok(Slots { _bufs: bufs, ptrs })
}

/// A fence on each stream of `used`, after the copies enqueued so far.
fn fences(streams: &mut [(usize, Box<dyn DeviceStream + '_>)], used: Vec<usize>) -> Result<Vec<(usize, Fence)>> {
    used.into_iter().map(|s| Ok((s, streams[s].1.fence()?))).collect()
}

/// Waits for every fence.
fn wait_all(streams: &mut [(usize, Box<dyn DeviceStream + '_>)], fences: Vec<(usize, Fence)>) -> Result<()> {
    for (s, fence) in fences {
        streams[s].1.wait(fence)?;
    }
    Ok(())
}

/// Waits for every copy of every stream.
fn synchronize_all(streams: &mut [(usize, Box<dyn DeviceStream + '_>)]) -> Result<()> {
    for (_, stream) in streams {
        stream.synchronize()?;
    }
    Ok(())
}

/// The index of `mem`'s stream in `streams` (opened on first use). Memories
/// are told apart by identity, not by device address: two scatters of one
/// call can start at the same address and differ after it.
pub(super) fn stream_of<'a>(
    streams: &mut Vec<(usize, Box<dyn DeviceStream + 'a>)>,
    mem: &'a dyn DeviceMemory,
) -> Result<usize> {
    let id = identity(mem);
    if let Some(at) = streams.iter().position(|(m, _)| *m == id) {
        return Ok(at);
    }
    streams.push((id, mem.open_stream()?));
    Ok(streams.len() - 1)
}

/// The address of the memory object itself (borrowed for the whole call, so
/// distinct objects have distinct addresses).
fn identity(mem: &dyn DeviceMemory) -> usize {
    (mem as *const dyn DeviceMemory).cast::<()>() as usize
}

/// One device range to write to one or more replicas.
pub(in crate::store) struct StreamWrite<'a> {
    /// The bytes: `len` at `src` of `mem` (a range already checked).
    pub mem: &'a dyn DeviceMemory,
    pub src: u64,
    pub len: u64,
    /// Each replica: its region and the object's offset in it.
    pub targets: Vec<(&'a RemoteRegion, u64)>,
}

/// What one streamed write did: the item's error (a device copy failed: no
/// replica has its bytes), else one result per target.
pub(in crate::store) struct Written {
    pub failed: Option<Error>,
    pub targets: Vec<std::result::Result<(), TransferError>>,
}

/// Writes every device range to its replicas through two pinned chunks: the DMA
/// of the next chunk runs while the transport writes this one.
pub(in crate::store) fn stream_writes(engine: &TransferEngine, writes: &[StreamWrite<'_>]) -> Vec<Written> {
    write_in_chunks(engine, writes, chunk_for(writes.iter().map(|w| w.len).sum()))
}

/// [`stream_writes`] through two chunks of `chunk` bytes.
fn write_in_chunks(engine: &TransferEngine, writes: &[StreamWrite<'_>], chunk: usize) -> Vec<Written> {
    let mut out: Vec<Written> =
        writes.iter().map(|w| Written { failed: None, targets: w.targets.iter().map(|_| Ok(())).collect() }).collect();
    let Some(first) = writes.first() else { return out };
    let slots = match two_slots(first.mem, chunk) {
        Ok(s) => s,
        Err(e) => {
            out.iter_mut().for_each(|w| w.failed = Some(e.clone()));
            return out;
        }
    };
    let ptrs = slots.ptrs;
    // Declared after the slots, so dropped before them (a stream's drop waits).
    let mut streams: Vec<(usize, Box<dyn DeviceStream + '_>)> = Vec::new();
    let waves = cut(writes.iter().map(|w| w.len), chunk);
    let fail_all =
        |out: &mut [Written], e: &Error| out.iter_mut().for_each(|o| o.failed = o.failed.take().or(Some(e.clone())));
    let mut pending = Vec::new();
    for w in 0..=waves.len() {
        // The copies of chunk w run while chunk w - 1 is written: its slot was
        // last read by the transport writing chunk w - 2, which returned.
        let next = match waves.get(w) {
            Some(wave) => match enqueue_downloads(wave, writes, ptrs[w % 2], &mut streams, &mut out) {
                Ok(f) => f,
                Err(e) => {
                    fail_all(&mut out, &e);
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        if let Err(e) = wait_all(&mut streams, std::mem::replace(&mut pending, next)) {
            fail_all(&mut out, &e);
        }
        let Some(prev) = w.checked_sub(1) else { continue };
        let mut reqs: Vec<TransferRequest<'_>> = Vec::new();
        let mut owner: Vec<(usize, usize)> = Vec::new();
        for p in waves[prev].iter().filter(|p| out[p.index].failed.is_none()) {
            // SAFETY: the copy that wrote the piece's bytes was waited for; the
            // slot is written again only by chunk prev + 2's copies, enqueued
            // after this transfer returns.
            let bytes = unsafe { std::slice::from_raw_parts(ptrs[prev % 2].add(p.pos), p.len) };
            for (t, &(region, offset)) in writes[p.index].targets.iter().enumerate() {
                if out[p.index].targets[t].is_ok() {
                    reqs.push(TransferRequest::write(region, offset + p.at, bytes));
                    owner.push((p.index, t));
                }
            }
        }
        for (res, (i, t)) in engine.transfer(&mut reqs).into_iter().zip(owner) {
            if let Err(e) = res {
                out[i].targets[t] = Err(e);
            }
        }
    }
    if let Err(e) = synchronize_all(&mut streams) {
        fail_all(&mut out, &e);
    }
    out
}

/// Enqueues the copies of one chunk's pieces from device memory into `slot`;
/// the fences after them. A piece whose copy cannot be enqueued fails its item.
fn enqueue_downloads<'a>(
    wave: &[Piece],
    writes: &[StreamWrite<'a>],
    slot: *mut u8,
    streams: &mut Vec<(usize, Box<dyn DeviceStream + 'a>)>,
    out: &mut [Written],
) -> Result<Vec<(usize, Fence)>> {
    let mut used: Vec<usize> = Vec::new();
    for p in wave {
        if out[p.index].failed.is_some() {
            continue;
        }
        let item = &writes[p.index];
        let queued = stream_of(streams, item.mem).and_then(|s| {
            // SAFETY: the piece lies in the slot (`pos + len <= chunk`); the slot
            // is read (by the transport) only after the fence taken below is
            // waited for, and is written by nothing else meanwhile.
            unsafe { streams[s].1.copy_from_device_async(slot.add(p.pos), p.len, item.src + p.at)? };
            Ok(s)
        });
        match queued {
            Ok(s) if !used.contains(&s) => used.push(s),
            Ok(_) => {}
            Err(e) => out[p.index].failed = Some(e),
        }
    }
    fences(streams, used)
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
        let reads: Vec<StreamRead<'_>> =
            plan.iter().map(|&(region, offset, len, mem, dst)| StreamRead { region, offset, len, mem, dst }).collect();
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

    /// Over TCP, which tells of each 256 KiB it received: every range goes on to
    /// the device as it lands. The device here copies when a copy is enqueued, so
    /// a range passed on before its bytes arrived gives wrong bytes; objects span
    /// waves and share them, and an odd tail is passed on once the transfer
    /// returned.
    #[test]
    fn ranges_go_to_the_device_as_they_land_and_never_before() {
        use std::sync::Arc;

        use mooncake_transfer::TcpTransport;

        let server = TransferEngine::builder().tcp_listen("127.0.0.1:0").build().unwrap();
        let client = TransferEngine::builder().transport(Arc::new(TcpTransport::new())).build().unwrap();
        let region = server.register_region(8 << 20).unwrap();
        let remote = server.remote(region.id());
        let bytes: Vec<u8> = (0..8u32 << 20).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        // SAFETY: the region is 8 MiB of the server's memory, written only here.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), region.as_mut_ptr(), bytes.len()) };
        let mem = HostDeviceMemory::new(8 << 20).unwrap().with_copies_at_enqueue();
        // (offset, len, device offset): 3 MiB + 5 over two waves, 1 MiB + 3 sharing
        // one, a piece smaller than what TCP tells of.
        let plan = [(11u64, (3 << 20) + 5, 0u64), (4 << 20, (1 << 20) + 3, 4 << 20), (7 << 20, 1000, 6 << 20)];
        let reads: Vec<StreamRead<'_>> = plan
            .iter()
            .map(|&(offset, len, dst)| StreamRead { region: &remote, offset, len, mem: &mem, dst })
            .collect();
        let results = stream_in_chunks(&client, &reads, 2 << 20);
        let device = mem.to_vec();
        for (i, &(offset, len, dst)) in plan.iter().enumerate() {
            assert!(results[i].is_ok(), "read {i}: {:?}", results[i]);
            let got = &device[dst as usize..(dst + len) as usize];
            assert!(got == &bytes[offset as usize..(offset + len) as usize], "read {i}: device bytes");
        }
        // Told range by range: far more copies than the 5 pieces of the 3 waves.
        assert!(mem.copies_run() >= 16, "{} copies", mem.copies_run());
    }

    /// The ranges left to pass on after the transfer are exactly the bytes of the
    /// piece no told range covered, in order, whatever the order, overlaps and
    /// repeats of the told ranges.
    #[test]
    fn untold_ranges_are_the_bytes_no_told_range_covers() {
        use proptest::prelude::*;
        proptest!(|(len in 1usize..4096, told in proptest::collection::vec((0u64..4096, 1usize..600), 0..12))| {
            let mut told: Vec<(u64, usize)> =
                told.into_iter().filter(|&(at, n)| at as usize + n <= len).collect();
            let mut model = vec![false; len];
            for &(at, n) in &told {
                model[at as usize..at as usize + n].iter_mut().for_each(|b| *b = true);
            }
            let gaps = untold(&mut told, len);
            let mut got = vec![true; len];
            let mut last_end = None;
            for &(at, n) in &gaps {
                prop_assert!(n > 0 && at as usize + n <= len);
                prop_assert!(last_end.is_none_or(|e| e < at), "gaps in order, apart");
                got[at as usize..at as usize + n].iter_mut().for_each(|b| *b = false);
                last_end = Some(at + n as u64);
            }
            prop_assert_eq!(got, model);
        });
    }

    /// Puts the other way: many chunks, objects sharing and spanning chunks, two
    /// replicas each (one of them in a region that does not exist: that target
    /// fails, the other is written), exact bytes in every written replica. The
    /// emulated device runs a copy only when waited for, so a chunk written
    /// before its copies ran would carry wrong bytes.
    #[test]
    fn device_ranges_reach_every_replica_exact_through_many_small_chunks() {
        let engine = TransferEngine::builder().build().unwrap();
        let (r1, r2) = (engine.register_region(1 << 20).unwrap(), engine.register_region(1 << 20).unwrap());
        let (t1, t2) = (engine.remote(r1.id()), engine.remote(r2.id()));
        let missing = RemoteRegion { endpoint: t1.endpoint.clone(), region: r2.id() + 100 };
        let src = HostDeviceMemory::new(300_000).unwrap();
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_246_822_519) >> 9) as u8).collect();
        src.copy_from_host(0, &bytes).unwrap();
        // (device offset, length, targets)
        type Plan<'a> = Vec<(u64, u64, Vec<(&'a RemoteRegion, u64)>)>;
        let plan: Plan<'_> = vec![
            (5, 20_000, vec![(&t1, 0), (&t2, 500_000)]),
            (20_005, 1, vec![(&t1, 30_000)]),
            (40_000, 100_003, vec![(&t2, 0), (&missing, 0)]),
            (200_000, 4_096, vec![(&t1, 900_000), (&t2, 900_000)]),
        ];
        let writes: Vec<StreamWrite<'_>> = plan
            .iter()
            .map(|(src_at, len, targets)| StreamWrite { mem: &src, src: *src_at, len: *len, targets: targets.clone() })
            .collect();
        let done = write_in_chunks(&engine, &writes, 4_096);
        for ((src_at, len, targets), w) in plan.iter().zip(&done) {
            assert!(w.failed.is_none(), "{:?}", w.failed);
            for (&(region, offset), res) in targets.iter().zip(&w.targets) {
                if region.region == missing.region {
                    assert!(res.is_err(), "a write into a missing region");
                    continue;
                }
                assert!(res.is_ok(), "{res:?}");
                let reg = if region.region == t1.region { &r1 } else { &r2 };
                // SAFETY: the region is this engine's, and no transfer runs now.
                let got = unsafe { std::slice::from_raw_parts(reg.as_mut_ptr().add(offset as usize), *len as usize) };
                assert!(got == &bytes[*src_at as usize..(*src_at + *len) as usize], "replica at {offset}");
            }
        }
    }
}
