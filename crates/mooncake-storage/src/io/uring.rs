//! `io_uring` engine with one ring per thread.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

use io_uring::{opcode, types, IoUring};
use parking_lot::Mutex;

use super::posix::{pread, pwrite};
use super::{IoEngine, IoFile, RawRead};
use crate::error::Result;

/// Most requests submitted at once (and entries of each thread's ring).
pub const QUEUE_DEPTH: usize = 32;

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
/// cannot have one (then the caller uses POSIX calls).
fn with_ring<T>(f: impl FnOnce(&mut Ring) -> T) -> Option<T> {
    RING.with(|slot| {
        let mut slot = slot.borrow_mut();
        if let RingSlot::Uninit = *slot {
            *slot = match IoUring::new(QUEUE_DEPTH as u32) {
                Ok(ring) => RingSlot::Ready(Box::new(Ring { ring, fixed_gen: 0, fixed: None })),
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

/// `io_uring` I/O: each thread gets its own ring (created lazily, dropped with the
/// thread), so threads never contend on a lock. Batched reads are submitted
/// [`QUEUE_DEPTH`] at a time. A thread whose ring cannot be made uses
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
        let ran = with_ring(|r| {
            for chunk in reads.chunks_mut(QUEUE_DEPTH) {
                let mut queued = 0;
                for (i, rd) in chunk.iter_mut().enumerate() {
                    let e = r.read_entry(rd.fd, rd.offset, rd.ptr, rd.len).user_data(i as u64);
                    // SAFETY: the caller of raw_read_batch guarantees every buffer is
                    // valid and unaliased until we return, and we wait for all
                    // completions of this chunk below.
                    if unsafe { r.ring.submission().push(&e) }.is_err() {
                        rd.result = Some(Err(io::Error::other("submission queue full")));
                        continue;
                    }
                    queued += 1;
                }
                r.submit_wait(queued, |ud, res| {
                    if let Some(rd) = chunk.get_mut(ud as usize) {
                        rd.result = Some(res);
                    }
                });
            }
        });
        if ran.is_none() {
            for rd in reads.iter_mut() {
                // SAFETY: guaranteed by the caller (see the trait's contract).
                let buf = unsafe { std::slice::from_raw_parts_mut(rd.ptr, rd.len) };
                rd.result = Some(pread(rd.fd, rd.offset, buf));
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
