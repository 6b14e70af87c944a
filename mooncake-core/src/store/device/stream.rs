//! Replicas a transport reads into host memory (a TCP peer's; a segment that
//! could not be page-locked), streamed into device memory through pinned
//! chunks. A get does not wait for a chunk's transfer: each range the transport
//! tells of as landed (`TransferRequest::on_landed`; TCP tells of every 256 KiB)
//! is DMA'd at once, so only the last ranges' copies follow the transfer. So a
//! get of up to 64 MiB moves in one transfer into one pinned chunk; a larger
//! one through two chunks of 32 MiB, the transport filling one while the other's
//! last copies finish. Puts the other way, through two chunks: while the
//! transport writes one chunk to the replicas, the DMA fills the other from the
//! device. The staging memory a call holds is at most 64 MiB, however many
//! objects and bytes it moves.
//!
//! A get's transfer runs on the calling thread, and the transport's threads
//! enqueue each landed range's copy themselves, behind a lock on the call's
//! streams: no thread is started and no range handed to another thread. (A
//! thread started per call, woken per range, was the whole 40 us a 4 KiB read
//! paid over the host read on a 2-core VM.)

use mooncake_gpu::{DeviceMemory, DeviceStream, Fence, PooledBuffer};
use mooncake_transfer::{RemoteRegion, TransferEngine, TransferError, TransferRequest};
use parking_lot::Mutex;
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::Duration;

use super::staging::staging;
use crate::error::{Error, Result};

/// The smallest chunk of a put: a put of up to twice this moves in at most two
/// chunks, and an object of up to this in one (on an H100, TCP transfers of 2
/// MiB pieces of a 4 MiB object cost more than the overlap saved).
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

/// The chunk size of a put of `total` bytes: half of them, within the bounds
/// (the DMA of the first chunk is exposed, the rest overlaps the transport).
fn chunk_for(total: u64) -> usize {
    usize::try_from(total.div_ceil(2)).unwrap_or(MAX_CHUNK).clamp(MIN_CHUNK, MAX_CHUNK)
}

/// The chunk size of a get of `total` bytes: all of them, in one transfer, up
/// to the two chunks' worth a call may hold (the landing hooks overlap the DMA
/// with the transfer, so more transfers only add their starts and their lanes'
/// uneven ends); beyond, the largest chunk.
fn read_chunk_for(total: u64) -> usize {
    match usize::try_from(total) {
        Ok(t) if t <= 2 * MAX_CHUNK => t.max(1),
        _ => MAX_CHUNK,
    }
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
    stream_in_chunks(engine, reads, read_chunk_for(reads.iter().map(|r| r.len).sum()))
}

/// What the transport's threads and the calling thread share during
/// [`stream_in_chunks`]: the call's device streams, each read's result, and
/// the current wave's ranges told of and streams used.
struct Shared<'a> {
    streams: Vec<(usize, Box<dyn DeviceStream + 'a>)>,
    results: Vec<Result<()>>,
    /// Per piece of the current wave, the ranges passed on as they landed.
    landed: Vec<Vec<(u64, usize)>>,
    /// The streams the current wave's copies went on.
    used: Vec<usize>,
}

impl<'a> Shared<'a> {
    /// Enqueues the copy of `len` bytes at `at` of piece `p` (in the slot whose
    /// address is `slot_at`) to its device memory, unless its read already failed.
    fn enqueue_upload(&mut self, reads: &[StreamRead<'a>], p: &Piece, slot_at: usize, at: u64, len: usize) {
        if self.results[p.index].is_err() {
            return;
        }
        let r = &reads[p.index];
        let streams = &mut self.streams;
        let src = (slot_at + p.pos + at as usize) as *const u8;
        let queued = stream_of(streams, r.mem).and_then(|s| {
            // SAFETY: the range lies in the piece, in the slot; its bytes landed
            // (the transport writes them again only when it retries after a broken
            // connection, with the same bytes), and the slot is not refilled before
            // the fence taken after this wave is waited for. The slot outlives the
            // stream (declared before the shared state).
            unsafe { streams[s].1.copy_to_device_async(src, len, r.dst + p.at + at)? };
            Ok(s)
        });
        match queued {
            Ok(s) if !self.used.contains(&s) => self.used.push(s),
            Ok(_) => {}
            Err(e) => self.results[p.index] = Err(e),
        }
    }
}

/// A transfer of more bytes than this (several TCP connections at once) hands
/// its landed ranges to a copier thread (see [`Handoff`]).
const HANDOFF_ABOVE: usize = 1 << 20;

/// How many adjacent landed bytes the copier of a transfer of `total` bytes
/// copies at once: a sixteenth of them, 1 to 4 MiB. A DMA reading the bytes a
/// core has just received slows that core's receipt of the next ones (on an
/// H200, 256 KiB DMAs as each range landed made a 64 MiB TCP transfer 1.35x
/// slower than with no DMA during it); fewer, larger DMAs cost little of it,
/// and leave at most a few MiB (tens of microseconds of DMA) after the transfer.
fn copier_lag(total: usize) -> usize {
    (total / 16).clamp(1 << 20, 4 << 20)
}

/// Landed ranges handed from the transport's threads to the copier thread,
/// which enqueues their copies (adjacent ranges in one copy), so that the
/// threads receiving the bytes never wait for the driver.
struct Handoff {
    /// Ranges not taken yet: (piece, offset in it, length), and whether the
    /// transfer returned (every range was pushed). One lock for both: the copier
    /// reads `done` where it takes the ranges, so it never parks after `finish`
    /// without seeing it.
    queue: Mutex<Queued>,
    /// The copier, once it runs (to be woken).
    copier: OnceLock<Thread>,
    /// The fewest adjacent landed bytes copied at once before the transfer ends.
    lag: usize,
}

/// What the lanes handed over, and whether the transfer returned.
#[derive(Default)]
struct Queued {
    ranges: Vec<(usize, u64, usize)>,
    done: bool,
}

impl Handoff {
    /// A handoff whose copier copies adjacent landed bytes once there are `lag`
    /// of them (and everything left once the transfer returned).
    fn new(lag: usize) -> Self {
        Handoff { queue: Mutex::new(Queued::default()), copier: OnceLock::new(), lag }
    }

    /// A range landed (called on a transport thread): queued, and the copier
    /// woken if it may be waiting (the queue was empty).
    fn push(&self, n: usize, at: u64, len: usize) {
        let was_empty = {
            let mut q = self.queue.lock();
            q.ranges.push((n, at, len));
            q.ranges.len() == 1
        };
        if was_empty {
            if let Some(t) = self.copier.get() {
                t.unpark();
            }
        }
    }

    /// The transfer returned: the copier takes what is left and ends.
    fn finish(&self) {
        self.queue.lock().done = true;
        if let Some(t) = self.copier.get() {
            t.unpark();
        }
    }

    /// The copier's loop: takes the queued ranges, merges adjacent ones, and
    /// passes each to `enqueue`, until [`finish`](Self::finish) and nothing is left.
    fn run(&self, mut enqueue: impl FnMut(usize, u64, usize)) {
        let _ = self.copier.set(std::thread::current());
        // Merged ranges shorter than the lag, held until they grow or the transfer ends.
        let mut held: Vec<(usize, u64, usize)> = Vec::new();
        loop {
            // Taken with the flag: a range pushed before `finish` is in this take or
            // an earlier one. A `finish` after this take unparks the copier once it
            // has set `copier` (before its first take), so the park below returns.
            let (batch, finished) = {
                let mut q = self.queue.lock();
                (std::mem::take(&mut q.ranges), q.done)
            };
            if batch.is_empty() && (!finished || held.is_empty()) {
                if finished {
                    return;
                }
                // Woken by the next push (or `finish`); the timeout is a safety net.
                std::thread::park_timeout(Duration::from_millis(1));
                continue;
            }
            held.extend(batch);
            let merged = merge_adjacent(&mut held);
            held.clear();
            for (n, at, len) in merged {
                if finished || len >= self.lag {
                    enqueue(n, at, len);
                } else {
                    held.push((n, at, len));
                }
            }
        }
    }
}

/// The ranges of `batch` (piece, offset, length), sorted, with ranges of one
/// piece that meet end to start merged into one.
fn merge_adjacent(batch: &mut [(usize, u64, usize)]) -> Vec<(usize, u64, usize)> {
    batch.sort_unstable();
    let mut out: Vec<(usize, u64, usize)> = Vec::with_capacity(batch.len());
    for &(n, at, len) in batch.iter() {
        match out.last_mut() {
            Some((pn, pat, plen)) if *pn == n && *pat + *plen as u64 == at => *plen += len,
            _ => out.push((n, at, len)),
        }
    }
    out
}

/// [`stream_reads`] through (at most) two chunks of `chunk` bytes.
fn stream_in_chunks(engine: &TransferEngine, reads: &[StreamRead<'_>], chunk: usize) -> Vec<Result<Option<u32>>> {
    let Some(first) = reads.first() else { return Vec::new() };
    let waves = cut(reads.iter().map(|r| r.len), chunk);
    let slots = match Slots::take(first.mem, chunk, waves.len()) {
        Ok(s) => s,
        Err(e) => return reads.iter().map(|_| Err(e.clone())).collect(),
    };
    // Addresses, so that the hooks (run on the transport's threads) can share them.
    let ptrs: Vec<usize> = slots.ptrs.iter().map(|&p| p as usize).collect();
    // Declared after the slots, so dropped before them: a stream's drop waits
    // for the copies that read the slots.
    let shared = Mutex::new(Shared {
        streams: Vec::new(),
        results: reads.iter().map(|_| Ok(())).collect(),
        landed: Vec::new(),
        used: Vec::new(),
    });
    // Per slot, the fences after the copies out of it.
    let mut busy: [Vec<(usize, Fence)>; 2] = [Vec::new(), Vec::new()];
    for (w, wave) in waves.iter().enumerate() {
        let slot = w % ptrs.len();
        let pieces: Vec<&Piece> = {
            let mut sh = shared.lock();
            let sh = &mut *sh;
            // The copies out of this slot two chunks ago are done before it is refilled.
            if let Err(e) = wait_all(&mut sh.streams, std::mem::take(&mut busy[slot])) {
                fail_rest(&mut sh.results, &e);
                break;
            }
            sh.landed = vec![Vec::new(); wave.len()];
            sh.used.clear();
            wave.iter().filter(|p| sh.results[p.index].is_ok()).collect()
        };
        if pieces.is_empty() {
            continue;
        }
        // Each range the transport tells of as landed goes on to the device while
        // the rest of the chunk is in flight; what it did not tell of goes once the
        // transfer returned.
        let enqueue = |n: usize, at: u64, len: usize| {
            let mut sh = shared.lock();
            sh.enqueue_upload(reads, pieces[n], ptrs[slot], at, len);
            sh.landed[n].push((at, len));
        };
        // A transfer over several connections hands its ranges to a copier thread:
        // a copy's enqueue costs the driver microseconds, and on the threads that
        // receive it held up the receipt of the next bytes (on an H200, a 64 MiB
        // get's 256 enqueues took 1.6 ms of the lanes' time, serialized behind the
        // streams' lock). One connection's transfer enqueues on its thread: it
        // waits for nothing else, and a thread would cost more than it saves.
        let wave_bytes: usize = pieces.iter().map(|p| p.len).sum();
        let handoff = (wave_bytes > HANDOFF_ABOVE).then(|| Handoff::new(copier_lag(wave_bytes)));
        let land = |n: usize, at: u64, len: usize| {
            // A range outside its piece is not trusted: the piece goes whole, after.
            if at.checked_add(len as u64).is_none_or(|end| end > pieces[n].len as u64) {
                return;
            }
            match &handoff {
                Some(h) => h.push(n, at, len),
                None => enqueue(n, at, len),
            }
        };
        let land = &land;
        let hooks: Vec<_> = (0..pieces.len()).map(|n| move |at: u64, len: usize| land(n, at, len)).collect();
        let mut reqs: Vec<TransferRequest<'_>> = Vec::with_capacity(pieces.len());
        for (p, hook) in pieces.iter().zip(&hooks) {
            // SAFETY: the piece lies in the slot (`pos + len <= chunk`), whose
            // earlier copies were waited for above; pieces do not overlap, and
            // nothing else writes the slot until the transfer returns (the copies
            // enqueued meanwhile only read ranges that landed).
            let buf = unsafe { std::slice::from_raw_parts_mut((ptrs[slot] + p.pos) as *mut u8, p.len) };
            reqs.push(TransferRequest::read(reads[p.index].region, reads[p.index].offset + p.at, buf).on_landed(hook));
        }
        let done = std::thread::scope(|scope| {
            let copier = handoff.as_ref().map(|h| {
                let enqueue = &enqueue;
                std::thread::Builder::new().name("mooncake-dma".into()).spawn_scoped(scope, move || h.run(enqueue))
            });
            // Without a copier thread (none could start), the ranges go after.
            if let Some(Err(e)) = &copier {
                tracing::debug!(error = %e, "no copier thread; a device get's copies follow its transfer");
            }
            let done = engine.transfer(&mut reqs);
            if let Some(h) = &handoff {
                h.finish();
            }
            done
        });
        drop(reqs);
        let mut sh = shared.lock();
        for ((n, p), res) in pieces.iter().enumerate().zip(done) {
            if let Err(e) = res {
                sh.results[p.index] = Err(e.into());
                continue;
            }
            let mut told = std::mem::take(&mut sh.landed[n]);
            for (at, len) in untold(&mut told, p.len) {
                sh.enqueue_upload(reads, p, ptrs[slot], at, len);
            }
        }
        let used = std::mem::take(&mut sh.used);
        match fences(&mut sh.streams, used) {
            Ok(f) => busy[slot] = f,
            Err(e) => {
                fail_rest(&mut sh.results, &e);
                break;
            }
        }
    }
    let Shared { mut streams, results, .. } = shared.into_inner();
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

/// One or two pinned chunks (portable: any device memory's copies can use
/// them) and their addresses; chunk `w` of a call goes in slot `w % ptrs.len()`.
struct Slots {
    _bufs: Vec<PooledBuffer<'static>>,
    ptrs: Vec<*mut u8>,
}

impl Slots {
    /// Slots of `chunk` bytes for `waves` chunks: one for one, else two.
    fn take(mem: &dyn DeviceMemory, chunk: usize, waves: usize) -> Result<Self> {
        let mut bufs = (0..waves.clamp(1, 2)).map(|_| staging(mem, chunk)).collect::<Result<Vec<_>>>()?;
        let ptrs = bufs.iter_mut().map(|b| b.as_mut_ptr()).collect();
        Ok(Slots { _bufs: bufs, ptrs })
    }
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
    let waves = cut(writes.iter().map(|w| w.len), chunk);
    let slots = match Slots::take(first.mem, chunk, waves.len()) {
        Ok(s) => s,
        Err(e) => {
            out.iter_mut().for_each(|w| w.failed = Some(e.clone()));
            return out;
        }
    };
    let ptrs = &slots.ptrs;
    // Declared after the slots, so dropped before them (a stream's drop waits).
    let mut streams: Vec<(usize, Box<dyn DeviceStream + '_>)> = Vec::new();
    let fail_all =
        |out: &mut [Written], e: &Error| out.iter_mut().for_each(|o| o.failed = o.failed.take().or(Some(e.clone())));
    let mut pending = Vec::new();
    for w in 0..=waves.len() {
        // The copies of chunk w run while chunk w - 1 is written: its slot was
        // last read by the transport writing chunk w - 2, which returned.
        let next = match waves.get(w) {
            Some(wave) => match enqueue_downloads(wave, writes, ptrs[w % ptrs.len()], &mut streams, &mut out) {
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
            let bytes = unsafe { std::slice::from_raw_parts(ptrs[prev % ptrs.len()].add(p.pos), p.len) };
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
        // Told range by range, merged where the copier found several adjacent ones
        // waiting: at least one copy per piece of the 3 waves (5). How many more
        // depends on how often the copier ran while the bytes landed (on a loaded
        // machine it may find each piece whole), so no more is asserted.
        assert!(mem.copies_run() >= 5, "{} copies", mem.copies_run());
    }

    /// A get of up to 64 MiB (one object or a batch) moves in one transfer into
    /// one chunk; a larger one in 32 MiB chunks, two held at a time: the pinned
    /// memory a get holds never exceeds 64 MiB, and never exceeds twice its bytes.
    #[test]
    fn a_get_moves_in_one_transfer_up_to_64_mib_and_holds_at_most_64_mib() {
        use proptest::prelude::*;
        proptest!(|(total in prop_oneof![1u64..(1 << 20), 1u64..(200 << 20), Just(64u64 << 20), Just((64u64 << 20) + 1)])| {
            let chunk = read_chunk_for(total);
            let waves = cut(std::iter::once(total), chunk).len();
            let held = chunk as u64 * waves.min(2) as u64;
            prop_assert!(held <= 64 << 20, "{total}: {held} bytes held");
            prop_assert!(held <= 2 * total, "{total}: {held} bytes held");
            prop_assert_eq!(waves == 1, total <= 64 << 20, "{} bytes in {} transfers", total, waves);
        });
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

    /// The copier's merge keeps exactly the bytes of every range (per piece) and
    /// leaves no two ranges of a piece that meet end to start.
    #[test]
    fn merged_ranges_cover_the_same_bytes_and_none_meet() {
        use proptest::prelude::*;
        proptest!(|(ranges in proptest::collection::vec((0usize..3, 0u64..64, 1usize..8), 0..24))| {
            // Ranges of one piece do not overlap (the transport tells each byte once).
            let mut seen = std::collections::HashSet::new();
            let mut batch: Vec<(usize, u64, usize)> = Vec::new();
            for (n, at, len) in ranges {
                let bytes: Vec<(usize, u64)> = (at..at + len as u64).map(|b| (n, b)).collect();
                if bytes.iter().all(|b| !seen.contains(b)) {
                    seen.extend(bytes);
                    batch.push((n, at, len));
                }
            }
            let merged = merge_adjacent(&mut batch);
            let mut covered = std::collections::HashSet::new();
            for &(n, at, len) in &merged {
                for b in at..at + len as u64 {
                    prop_assert!(covered.insert((n, b)), "byte {} of piece {} twice", b, n);
                }
            }
            prop_assert_eq!(covered, seen);
            for w in merged.windows(2) {
                prop_assert!(!(w[0].0 == w[1].0 && w[0].1 + w[0].2 as u64 == w[1].1), "{:?} meet", w);
            }
        });
    }

    /// Ranges pushed from several threads while the copier runs, then `finish`:
    /// the copier passes on every byte once, and ends.
    #[test]
    fn the_copier_passes_on_every_range_pushed_before_finish() {
        let handoff = Handoff::new(64);
        let got = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            s.spawn(|| handoff.run(|n, at, len| got.lock().push((n, at, len))));
            let pushers: Vec<_> = (0..4usize)
                .map(|lane| {
                    let handoff = &handoff;
                    s.spawn(move || {
                        for k in 0..200u64 {
                            handoff.push(lane, k * 10, 10);
                            if k % 50 == 0 {
                                std::thread::yield_now();
                            }
                        }
                    })
                })
                .collect();
            pushers.into_iter().for_each(|p| p.join().unwrap());
            handoff.finish();
        });
        let mut covered = vec![vec![false; 2000]; 4];
        for (n, at, len) in got.into_inner() {
            for (b, c) in covered[n][at as usize..at as usize + len].iter_mut().enumerate() {
                assert!(!std::mem::replace(c, true), "byte {} of lane {n} twice", at as usize + b);
            }
        }
        assert!(covered.iter().flatten().all(|&c| c), "every byte passed on");
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
