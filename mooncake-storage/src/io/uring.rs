//! `io_uring` engine with one ring per thread.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use super::posix::{pread, pwrite};
use super::{IoEngine, IoFile, RawNext, RawRead, RawWriteSource};
use crate::error::Result;

/// Most requests submitted at once (and entries of each thread's ring).
pub const QUEUE_DEPTH: usize = 32;

/// Reads shorter than this are submitted one `io_uring_enter` each, as soon as they are
/// queued. Submitted together, the block layer holds a batch's requests (plugged) until
/// the last one is built, and the disk idles meanwhile: for 4 KiB random reads, 32
/// single submissions per call got 1.1-1.4x the reads per second of one submission of
/// 32 (virtio disk, 2 vCPUs, interleaved A/B runs). Longer reads keep the disk busy long
/// enough that building them together costs nothing, and batching measured faster for
/// 1 MiB reads.
const SUBMIT_ALONE: usize = 128 << 10;

/// The process-wide fixed buffer: base, length and a generation bumped on every
/// change. Rings register it lazily, each on its first I/O after a change.
struct FixedBuf {
    base: usize,
    len: usize,
}

static FIXED: Mutex<FixedBuf> = Mutex::new(FixedBuf { base: 0, len: 0 });
static FIXED_GEN: AtomicU64 = AtomicU64::new(0);

struct Ring {
    ring: IoUring,
    /// Generation of the fixed buffer this ring has registered, and its range.
    fixed_gen: u64,
    fixed: Option<(usize, usize)>,
    /// Completions (user_data, result) of the last wait; kept for its allocation.
    cqes: Vec<(u64, i32)>,
}

enum RingSlot {
    Uninit,
    Failed,
    Ready(Box<Ring>),
}

thread_local! {
    static RING: RefCell<RingSlot> = const { RefCell::new(RingSlot::Uninit) };
}

/// Runs `f` with this thread's ring (created on first use); `None` if the thread
/// cannot have one, or if its ring is busy (I/O from a callback that a batch or stream
/// of this thread is running): then the caller uses POSIX calls.
fn with_ring<T>(f: impl FnOnce(&mut Ring) -> T) -> Option<T> {
    RING.with(|slot| {
        let Ok(mut slot) = slot.try_borrow_mut() else { return None };
        if let RingSlot::Uninit = *slot {
            *slot = match IoUring::new(QUEUE_DEPTH as u32) {
                Ok(ring) => RingSlot::Ready(Box::new(Ring {
                    ring,
                    fixed_gen: 0,
                    fixed: None,
                    cqes: Vec::with_capacity(2 * QUEUE_DEPTH),
                })),
                Err(e) => {
                    tracing::warn!("io_uring ring creation failed in this thread ({e}); using pread/pwrite");
                    RingSlot::Failed
                }
            };
        }
        match &mut *slot {
            RingSlot::Ready(r) => {
                r.refresh_fixed();
                Some(f(r))
            }
            _ => None,
        }
    })
}

impl Ring {
    fn refresh_fixed(&mut self) {
        let gen = FIXED_GEN.load(Ordering::Acquire);
        if gen == self.fixed_gen {
            return;
        }
        let fixed = FIXED.lock();
        let gen = FIXED_GEN.load(Ordering::Acquire);
        if self.fixed.take().is_some() {
            let _ = self.ring.submitter().unregister_buffers();
        }
        if fixed.len > 0 {
            let iov = libc::iovec { iov_base: fixed.base as *mut libc::c_void, iov_len: fixed.len };
            // SAFETY: `register_fixed_buffer`'s caller guaranteed the range stays valid
            // until it is unregistered; the kernel pins its pages.
            match unsafe { self.ring.submitter().register_buffers(&[iov]) } {
                Ok(()) => self.fixed = Some((fixed.base, fixed.len)),
                Err(e) => tracing::warn!("io_uring buffer registration failed ({e}); plain reads used"),
            }
        }
        self.fixed_gen = gen;
    }

    fn fixed_index(&self, ptr: *mut u8, len: usize) -> Option<u16> {
        let (base, flen) = self.fixed?;
        let p = ptr as usize;
        (p >= base && p + len <= base + flen).then_some(0)
    }

    fn read_entry(&self, fd: RawFd, offset: u64, ptr: *mut u8, len: usize) -> io_uring::squeue::Entry {
        let len = len.min(super::MAX_OP) as u32;
        match self.fixed_index(ptr, len as usize) {
            Some(i) => opcode::ReadFixed::new(types::Fd(fd), ptr, len, i).offset(offset).build(),
            None => opcode::Read::new(types::Fd(fd), ptr, len).offset(offset).build(),
        }
    }

    /// Submits the queued entries and waits for `n` completions, calling `done`
    /// with each (user_data, result).
    ///
    /// Never returns before all `n` complete: the kernel may be writing into the
    /// callers' buffers. Errors of `io_uring_enter` (all transient in practice) are
    /// retried; a ring that stays broken for 10 s aborts the process rather than
    /// let a buffer be freed under an in-flight read.
    fn submit_wait(&mut self, n: usize, mut done: impl FnMut(u64, io::Result<usize>)) {
        let mut got = 0;
        let mut failures = 0u32;
        while got < n {
            if let Err(e) = self.ring.submit_and_wait(n - got) {
                if e.raw_os_error() != Some(libc::EINTR) {
                    failures += 1;
                    if failures > 10_000 {
                        tracing::error!("io_uring_enter keeps failing ({e}) with I/O in flight; aborting");
                        std::process::abort();
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            for cqe in self.ring.completion() {
                let r = cqe.result();
                let res = if r < 0 { Err(io::Error::from_raw_os_error(-r)) } else { Ok(r as usize) };
                done(cqe.user_data(), res);
                got += 1;
            }
        }
    }

    /// Submits what is queued (and waits for nothing). A failure leaves the entries
    /// queued; the next wait submits them.
    fn submit_queued(&mut self) {
        let _ = self.ring.submit();
    }

    /// Submits what is queued, waits until at least `min` (>= 1, at most the requests in
    /// flight) completions are there, and moves every completion there into `out`.
    /// Failures of `io_uring_enter` are handled as in [`submit_wait`](Self::submit_wait).
    fn wait_cqes(&mut self, min: usize, out: &mut Vec<(u64, i32)>) {
        out.clear();
        let mut failures = 0u32;
        loop {
            let queued = !self.ring.submission().is_empty();
            out.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            if out.len() >= min && !queued {
                return;
            }
            let want = min.saturating_sub(out.len());
            match self.ring.submit_and_wait(want) {
                Ok(_) if want == 0 => {
                    out.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
                    return;
                }
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                Err(e) => {
                    failures += 1;
                    if failures > 10_000 {
                        tracing::error!("io_uring_enter keeps failing ({e}) with I/O in flight; aborting");
                        std::process::abort();
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
        }
    }

    /// Reads with up to [`QUEUE_DEPTH`] in flight, the ring refilled as completions come
    /// back; a short read is resubmitted for the rest until it is full, reaches the end
    /// of the file (a read of 0) or fails. Calls `done(i, total bytes or error)` once
    /// per read, as it finishes.
    ///
    /// # Safety
    /// As [`IoEngine::raw_read_each`].
    unsafe fn read_each(&mut self, reads: &mut [RawRead], done: &mut dyn FnMut(usize, io::Result<usize>)) {
        let mut cqes = std::mem::take(&mut self.cqes);
        let mut g = Inflight { ring: self, n: 0 };
        let mut next = 0;
        loop {
            while next < reads.len() && g.n < QUEUE_DEPTH {
                let rd = &mut reads[next];
                // `result` holds the bytes read so far while the read is in flight
                rd.result = Some(Ok(0));
                // SAFETY: the caller keeps the buffer valid until the read is reported,
                // which happens only after its completion.
                if let Err(e) = unsafe { g.ring.push_read(rd, next as u64, 0) } {
                    rd.result = None;
                    done(next, Err(e));
                } else {
                    g.n += 1;
                    if rd.len < SUBMIT_ALONE {
                        g.ring.submit_queued();
                    }
                }
                next += 1;
            }
            if g.n == 0 {
                break;
            }
            g.ring.wait_cqes(1, &mut cqes);
            // counted out before any callback runs: if one panics, the guard must wait
            // only for what is still in the kernel
            g.n -= cqes.len();
            for &(ud, res) in &cqes {
                let i = ud as usize;
                let Some(rd) = reads.get_mut(i) else { continue };
                let so_far = match rd.result {
                    Some(Ok(n)) => n,
                    _ => 0,
                };
                let again = match res {
                    r if r > 0 && so_far + r as usize >= rd.len => Some(Ok(rd.len)),
                    r if r > 0 => {
                        rd.result = Some(Ok(so_far + r as usize));
                        None
                    }
                    0 => Some(Ok(so_far)),
                    r if -r == libc::EINTR => None,
                    r => Some(Err(io::Error::from_raw_os_error(-r))),
                };
                match again {
                    Some(result) => {
                        rd.result = None;
                        done(i, result);
                    }
                    None => {
                        let at = match rd.result {
                            Some(Ok(n)) => n,
                            _ => 0,
                        };
                        // SAFETY: as above; the rest of the same buffer.
                        match unsafe { g.ring.push_read(rd, ud, at) } {
                            Ok(()) => g.n += 1,
                            Err(e) => {
                                rd.result = None;
                                done(i, Err(e));
                            }
                        }
                    }
                }
            }
        }
        g.ring.cqes = cqes;
    }

    /// Queues the read of `rd` from byte `at` of its range on.
    ///
    /// # Safety
    /// `rd.ptr` must stay valid for `rd.len` writable bytes until the completion.
    unsafe fn push_read(&mut self, rd: &RawRead, user_data: u64, at: usize) -> io::Result<()> {
        let e =
            self.read_entry(rd.fd, rd.offset + at as u64, rd.ptr.wrapping_add(at), rd.len - at).user_data(user_data);
        // SAFETY: guaranteed by the caller.
        unsafe { self.ring.submission().push(&e) }.map_err(|_| io::Error::other("submission queue full"))
    }

    /// Runs the writes of `src` with up to [`QUEUE_DEPTH`] in flight. Each write is
    /// submitted as soon as it is handed over, so the source's work before the next one
    /// overlaps the writes already in flight.
    ///
    /// # Safety
    /// As [`IoEngine::raw_write_stream`].
    unsafe fn write_stream(&mut self, src: &mut dyn RawWriteSource) {
        let mut cqes = std::mem::take(&mut self.cqes);
        let mut g = Inflight { ring: self, n: 0 };
        loop {
            while g.n < QUEUE_DEPTH {
                let w = match src.next() {
                    RawNext::Write(w) => w,
                    RawNext::Wait | RawNext::End => break,
                };
                let len = w.len.min(super::MAX_OP) as u32;
                let e = opcode::Write::new(types::Fd(w.fd), w.ptr, len).offset(w.offset).build().user_data(w.tag);
                // SAFETY: the source keeps `ptr` valid until `done(tag)`, which is called
                // only after the completion.
                if unsafe { g.ring.ring.submission().push(&e) }.is_err() {
                    // cannot happen with fewer than QUEUE_DEPTH in flight; written anyway
                    // SAFETY: as above, for the duration of this call.
                    let buf = unsafe { std::slice::from_raw_parts(w.ptr, w.len) };
                    src.done(w.tag, pwrite(w.fd, w.offset, buf));
                    continue;
                }
                g.n += 1;
                g.ring.submit_queued();
            }
            if g.n == 0 {
                break;
            }
            g.ring.wait_cqes(1, &mut cqes);
            // counted out before the source sees any (as in `read_each`)
            g.n -= cqes.len();
            for &(ud, res) in &cqes {
                src.done(ud, if res < 0 { Err(io::Error::from_raw_os_error(-res)) } else { Ok(res as usize) });
            }
        }
        g.ring.cqes = cqes;
    }

    /// One request, synchronously.
    fn one(&mut self, entry: io_uring::squeue::Entry) -> io::Result<usize> {
        // SAFETY: the buffers named by `entry` are borrowed by the caller for the
        // whole call and the call waits for the completion before returning.
        unsafe {
            self.ring.submission().push(&entry.user_data(0)).map_err(|_| io::Error::other("submission queue full"))?;
        }
        let mut out = Err(io::Error::other("no completion"));
        self.submit_wait(1, |_, r| out = r);
        out
    }
}

/// Requests in flight on a ring. If a caller's callback panics while some are, the
/// unwinding waits for them here: the kernel must not write into (or read from)
/// buffers that unwinding frees.
struct Inflight<'r> {
    ring: &'r mut Ring,
    n: usize,
}

impl Drop for Inflight<'_> {
    fn drop(&mut self) {
        let mut cqes = Vec::new();
        while self.n > 0 {
            self.ring.wait_cqes(1, &mut cqes);
            self.n = self.n.saturating_sub(cqes.len());
        }
    }
}

/// `io_uring` I/O: each thread gets its own ring (created lazily, dropped with the
/// thread), so threads never contend on a lock. Batched reads and streamed writes keep
/// up to [`QUEUE_DEPTH`] requests in flight. A thread whose ring cannot be made uses
/// `pread`/`pwrite` instead.
#[derive(Debug, Clone)]
pub struct IoUringEngine {
    direct: bool,
}

impl IoUringEngine {
    /// An engine; fails if this process cannot create a ring at all (old kernel,
    /// seccomp, `io_uring_disabled`), in which case use [`PosixEngine`](super::PosixEngine).
    pub fn new(direct: bool) -> io::Result<Self> {
        // Probe in this thread: a ring created here is kept as its thread-local ring.
        match with_ring(|_| ()) {
            Some(()) => Ok(IoUringEngine { direct }),
            None => IoUring::new(QUEUE_DEPTH as u32).map(|_| IoUringEngine { direct }),
        }
    }

    /// Registers `[ptr, ptr + len)` as the process-wide fixed buffer: reads that land
    /// entirely inside it use `IORING_OP_READ_FIXED`. Each thread's ring registers it
    /// on its next I/O. `MADV_NOHUGEPAGE` is applied first so that long-term page
    /// pinning works under transparent huge pages. Replaces any earlier registration.
    ///
    /// # Safety
    /// The range must be valid, page-aligned memory that stays mapped until
    /// [`unregister_fixed_buffer`](Self::unregister_fixed_buffer) is called.
    pub unsafe fn register_fixed_buffer(ptr: *mut u8, len: usize) {
        // SAFETY: the caller guarantees the range is mapped memory.
        unsafe { libc::madvise(ptr.cast(), len, libc::MADV_NOHUGEPAGE) };
        let mut f = FIXED.lock();
        f.base = ptr as usize;
        f.len = len;
        FIXED_GEN.fetch_add(1, Ordering::AcqRel);
    }

    /// Stops using the fixed buffer (rings drop their registration lazily; the
    /// memory may be freed once this returns, as no new fixed read targets it).
    pub fn unregister_fixed_buffer() {
        let mut f = FIXED.lock();
        f.base = 0;
        f.len = 0;
        FIXED_GEN.fetch_add(1, Ordering::AcqRel);
    }
}

impl IoUringEngine {
    /// Unregisters the fixed buffer only if it is the one starting at `ptr`.
    pub(crate) fn unregister_fixed_buffer_if(ptr: *mut u8) {
        let mut f = FIXED.lock();
        if f.base == ptr as usize {
            f.base = 0;
            f.len = 0;
            FIXED_GEN.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl IoEngine for IoUringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn raw_read(&self, fd: RawFd, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        with_ring(|r| {
            let e = r.read_entry(fd, offset, ptr, len);
            r.one(e)
        })
        .unwrap_or_else(|| pread(fd, offset, buf))
    }

    fn raw_write(&self, fd: RawFd, offset: u64, buf: &[u8]) -> io::Result<usize> {
        with_ring(|r| {
            let len = buf.len().min(super::MAX_OP) as u32;
            r.one(opcode::Write::new(types::Fd(fd), buf.as_ptr(), len).offset(offset).build())
        })
        .unwrap_or_else(|| pwrite(fd, offset, buf))
    }

    unsafe fn raw_read_batch(&self, reads: &mut [RawRead]) {
        let mut results: Vec<(usize, io::Result<usize>)> = Vec::with_capacity(reads.len());
        // SAFETY: forwarded contract; the callback touches no buffer.
        unsafe { self.raw_read_each(reads, &mut |i, r| results.push((i, r))) };
        for (i, r) in results {
            reads[i].result = Some(r);
        }
    }

    unsafe fn raw_read_each(&self, reads: &mut [RawRead], done: &mut dyn FnMut(usize, io::Result<usize>)) {
        // SAFETY: forwarded contract of raw_read_each.
        let ran = with_ring(|r| unsafe { r.read_each(reads, done) });
        if ran.is_none() {
            for (i, rd) in reads.iter_mut().enumerate() {
                // SAFETY: guaranteed by the caller (see the trait's contract).
                let buf = unsafe { std::slice::from_raw_parts_mut(rd.ptr, rd.len) };
                done(i, pread(rd.fd, rd.offset, buf));
            }
        }
    }

    unsafe fn raw_write_stream(&self, src: &mut dyn RawWriteSource) {
        // SAFETY: forwarded contract of raw_write_stream.
        let ran = with_ring(|r| unsafe { r.write_stream(src) });
        if ran.is_none() {
            while let RawNext::Write(w) = src.next() {
                // SAFETY: the source keeps `ptr` valid for `len` bytes until `done(tag)`.
                let buf = unsafe { std::slice::from_raw_parts(w.ptr, w.len) };
                src.done(w.tag, pwrite(w.fd, w.offset, buf));
            }
        }
    }

    fn sync_data(&self, file: &IoFile) -> Result<()> {
        let fd = file.fd();
        let r = with_ring(|r| r.one(opcode::Fsync::new(types::Fd(fd)).flags(types::FsyncFlags::DATASYNC).build()));
        match r {
            Some(res) => {
                res?;
            }
            None => file.as_file().sync_data()?,
        }
        Ok(())
    }
}
