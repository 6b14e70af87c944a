//! The I/O layer: positional reads and writes of files, through `io_uring` or POSIX
//! (described on [`IoEngine`]).

mod posix;
mod stream;
mod uring;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use posix::PosixEngine;
pub(crate) use stream::SliceWrites;
pub use stream::{RawNext, RawWrite, RawWriteSource, WriteData, WriteNext, WriteOp, WriteSource};
pub use uring::{IoUringEngine, QUEUE_DEPTH};

use crate::error::{Result, StorageError};

/// Alignment of `O_DIRECT` buffers, offsets and lengths.
pub const IO_ALIGN: usize = 4096;
/// Largest bounce buffer used for one unaligned `O_DIRECT` transfer step.
const BOUNCE_CHUNK: usize = 4 << 20;
/// Largest single kernel request.
pub(crate) const MAX_OP: usize = 1 << 30;

/// An open file and whether it was opened with `O_DIRECT`.
#[derive(Debug)]
pub struct IoFile {
    file: File,
    direct: bool,
    path: PathBuf,
}

impl IoFile {
    /// The raw descriptor.
    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
    /// Whether the file is in `O_DIRECT` mode.
    pub fn is_direct(&self) -> bool {
        self.direct
    }
    /// The path it was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The file's current length.
    pub fn len(&self) -> Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    /// Whether the file is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }
    /// Sets the file's length (truncating or extending with a hole).
    pub fn set_len(&self, len: u64) -> Result<()> {
        Ok(self.file.set_len(len)?)
    }
    /// The underlying `std` file.
    pub fn as_file(&self) -> &File {
        &self.file
    }

    /// Allocates disk blocks for `[0, len)` and makes the file at least `len` long
    /// (`fallocate(2)`, mode 0). Writes into allocated blocks are overwrites for the
    /// filesystem: ext4 then runs `O_DIRECT` writes asynchronously and side by side,
    /// where writes that extend a file are done one at a time (and `io_uring` hands
    /// them to worker threads). `Ok(false)` where the filesystem cannot allocate ahead;
    /// running out of space is an error.
    pub fn allocate(&self, len: u64) -> Result<bool> {
        if len == 0 {
            return Ok(true);
        }
        let len = libc::off_t::try_from(len)
            .map_err(|_| StorageError::InvalidArgument(format!("allocation of {len} bytes")))?;
        loop {
            // SAFETY: fallocate on an open descriptor owned by `self`; no memory is passed.
            let r = unsafe { libc::fallocate(self.fd(), 0, 0, len) };
            if r == 0 {
                return Ok(true);
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => return Ok(false),
                _ => return Err(e.into()),
            }
        }
    }
}

/// How [`IoEngine::open`] opens a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Read only; the file must exist.
    Read,
    /// Read and write; the file must exist.
    ReadWrite,
    /// Read and write; created if missing, truncated if present.
    Create,
}

/// One read of a batch: fill `buf` from `file` at `offset`.
#[derive(Debug)]
pub struct ReadOp<'a> {
    /// File to read.
    pub file: &'a IoFile,
    /// Offset in the file.
    pub offset: u64,
    /// Destination; filled entirely or the read fails.
    pub buf: &'a mut [u8],
}

/// One raw kernel read of a batch (see [`IoEngine::raw_read_batch`]).
#[derive(Debug)]
pub struct RawRead {
    /// Descriptor.
    pub fd: RawFd,
    /// Offset in the file.
    pub offset: u64,
    /// Destination start.
    pub ptr: *mut u8,
    /// Bytes to read (at most 1 GiB).
    pub len: usize,
    /// Filled by the engine: bytes read or the error.
    pub result: Option<io::Result<usize>>,
}

/// Positional file I/O, through `io_uring` or POSIX. Object-safe; engines are
/// shared by every backend thread.
///
/// An engine provides four raw operations ([`raw_read`](IoEngine::raw_read),
/// [`raw_write`](IoEngine::raw_write), [`raw_read_batch`](IoEngine::raw_read_batch),
/// [`sync_data`](IoEngine::sync_data)), may override two more that have sequential
/// defaults ([`raw_read_each`](IoEngine::raw_read_each),
/// [`raw_write_stream`](IoEngine::raw_write_stream)), and gets from them, as provided
/// methods, exact reads and writes that respect `O_DIRECT` rules — one at a time
/// ([`read_at`](IoEngine::read_at), [`write_at`](IoEngine::write_at)), batched reads
/// reported as each completes ([`read_batch_each`](IoEngine::read_batch_each)) and
/// pipelined writes ([`write_stream`](IoEngine::write_stream)). With `O_DIRECT`,
/// buffers, lengths and offsets must be 4 KiB-aligned, so
/// * reads whose buffer and offset are aligned go straight into the caller's buffer
///   (only an unaligned tail goes through a 4 KiB bounce buffer); other reads go
///   through aligned bounce buffers (4 MiB at a time);
/// * writes must start at an aligned offset; an unaligned tail (or an unaligned
///   source buffer) goes through an aligned bounce buffer and **is padded with zeros up
///   to the next 4 KiB boundary** — the file may grow to the padded length. The
///   on-disk formats of this crate keep every value 4 KiB-aligned for this reason.
///
/// Engines:
/// * [`IoUringEngine`]: one ring per thread (thread-local, no lock between threads);
///   batched reads and streamed writes keep up to [`QUEUE_DEPTH`] requests in flight,
///   refilling the ring as completions come back; reads into a registered fixed buffer
///   use `READ_FIXED`. Falls back to POSIX calls in a thread whose ring cannot be
///   created (or while the thread's ring is busy running a caller's callback).
/// * [`PosixEngine`]: `pread`/`pwrite`, one request at a time, optionally on `O_DIRECT`
///   files.
///
/// [`io_engine`] builds either, falling back to POSIX when `io_uring` is unavailable.
/// Opening a file with `O_DIRECT` on a filesystem that refuses it (tmpfs) falls back
/// to buffered I/O for that file with a logged warning.
pub trait IoEngine: Send + Sync + std::fmt::Debug {
    /// Short name (`"io_uring"`, `"posix"`).
    fn name(&self) -> &'static str;

    /// Whether files are opened with `O_DIRECT`.
    fn direct(&self) -> bool;

    /// One kernel read at `offset` into `buf` (at most 1 GiB); may be short.
    fn raw_read(&self, fd: RawFd, offset: u64, buf: &mut [u8]) -> io::Result<usize>;

    /// One kernel write at `offset` from `buf` (at most 1 GiB); may be short.
    fn raw_write(&self, fd: RawFd, offset: u64, buf: &[u8]) -> io::Result<usize>;

    /// Independent kernel reads, each possibly short; sets every `result`.
    ///
    /// # Safety
    /// Every `ptr` must be valid for writes of `len` bytes, and the ranges must not
    /// overlap each other or any live reference, for the duration of the call.
    unsafe fn raw_read_batch(&self, reads: &mut [RawRead]) {
        for r in reads.iter_mut() {
            // SAFETY: the caller guarantees `ptr` is valid for `len` writable bytes and
            // unaliased for the duration of the call.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) };
            r.result = Some(self.raw_read(r.fd, r.offset, buf));
        }
    }

    /// Like [`raw_read_batch`](Self::raw_read_batch), but each read is reported to
    /// `done` (its index, bytes read or the error) as soon as it finishes, in
    /// completion order, while others may still be in flight; nothing is stored in
    /// `result`. The default runs [`raw_read_batch`](Self::raw_read_batch), then reports.
    ///
    /// # Safety
    /// As [`raw_read_batch`](Self::raw_read_batch); in addition `done` must not touch
    /// the buffer of a read that has not been reported yet.
    unsafe fn raw_read_each(&self, reads: &mut [RawRead], done: &mut dyn FnMut(usize, io::Result<usize>)) {
        // SAFETY: forwarded contract of raw_read_batch.
        unsafe { self.raw_read_batch(reads) };
        for (i, r) in reads.iter_mut().enumerate() {
            done(i, r.result.take().unwrap_or_else(|| Err(io::Error::other("the engine gave no result"))));
        }
    }

    /// Runs the raw writes of `src`, each possibly short, reporting each to
    /// [`RawWriteSource::done`]. The source is asked for the next write whenever the
    /// engine has room; the stream ends when it answers [`RawNext::End`] or
    /// [`RawNext::Wait`] while nothing is in flight. The default writes one at a time
    /// with [`raw_write`](Self::raw_write).
    ///
    /// # Safety
    /// Each write's `ptr` must stay valid for reads of `len` bytes until `done` is
    /// called with its tag.
    unsafe fn raw_write_stream(&self, src: &mut dyn RawWriteSource) {
        while let RawNext::Write(w) = src.next() {
            // SAFETY: the source keeps `ptr` valid for `len` bytes until `done(tag)`.
            let buf = unsafe { std::slice::from_raw_parts(w.ptr, w.len) };
            let r = self.raw_write(w.fd, w.offset, buf);
            src.done(w.tag, r);
        }
    }

    /// `fdatasync` of the file.
    fn sync_data(&self, file: &IoFile) -> Result<()>;

    /// Opens `path`, with `O_DIRECT` if [`direct`](Self::direct) (falling back to
    /// buffered I/O, with a warning, where the filesystem refuses it).
    fn open(&self, path: &Path, mode: OpenMode) -> Result<IoFile> {
        open_file(path, mode, self.direct())
    }

    /// Fills `buf` from `offset`; an error if the file ends first.
    fn read_at(&self, file: &IoFile, offset: u64, buf: &mut [u8]) -> Result<()> {
        read_exact(self, file, offset, buf)
    }

    /// Several [`read_at`](Self::read_at)s, submitted together where the engine can
    /// (up to [`QUEUE_DEPTH`] in flight with `io_uring`). One result per op.
    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<()>> {
        let mut results: Vec<Option<Result<()>>> = (0..ops.len()).map(|_| None).collect();
        self.read_batch_each(ops, &mut |i, r| results[i] = Some(r.map(|_| ())));
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(StorageError::Io(io::Error::other("read not reported")))))
            .collect()
    }

    /// Several [`read_at`](Self::read_at)s like [`read_batch`](Self::read_batch), each
    /// reported to `done` (its index in `ops`, and its filled buffer or the error) as
    /// soon as it completes, while later ones may still be in flight — so the caller
    /// checks (checksums) one value while the disk reads the others. With `io_uring`
    /// up to [`QUEUE_DEPTH`] reads are in flight, and the ring is refilled as
    /// completions come back. Every op is reported exactly once, in completion order.
    /// `done` runs inside the engine's loop: I/O it does itself on the same thread
    /// goes through POSIX calls.
    fn read_batch_each(&self, ops: &mut [ReadOp<'_>], done: &mut dyn FnMut(usize, Result<&mut [u8]>)) {
        stream::read_batch_each(self, ops, done)
    }

    /// Writes all of `data` at `offset`. With `O_DIRECT`, `offset` must be aligned
    /// and an unaligned tail is padded with zeros to the next 4 KiB boundary.
    fn write_at(&self, file: &IoFile, offset: u64, data: &[u8]) -> Result<()> {
        write_all(self, file, offset, data)
    }

    /// The writes of `src` into `file`, pipelined: with `io_uring` up to
    /// [`QUEUE_DEPTH`] are in flight while `src` prepares the next ones (see
    /// [`WriteSource`]); other engines write one at a time. Each write follows the
    /// rules of [`write_at`](Self::write_at) (with `O_DIRECT`: aligned offsets, an
    /// unaligned tail padded with zeros to 4 KiB). Writes may complete in any order,
    /// so they must not overlap (padding included). Returns once every write handed
    /// over has completed, with the first error if any (after an error no new write is
    /// started). Nothing is synced.
    fn write_stream<'a>(&self, file: &IoFile, src: &mut dyn WriteSource<'a>) -> Result<()> {
        stream::write_stream(self, file, src)
    }

    /// [`write_stream`](Self::write_stream) of `(offset, bytes)` pairs.
    fn write_batch(&self, file: &IoFile, writes: &[(u64, &[u8])]) -> Result<()> {
        self.write_stream(file, &mut SliceWrites::new(writes))
    }
}

/// Which engine [`io_engine`] builds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoKind {
    /// [`IoUringEngine`] (falls back to POSIX where no ring can be made).
    #[default]
    Uring,
    /// [`PosixEngine`].
    Posix,
}

/// Builds an engine; `IoKind::Uring` falls back to [`PosixEngine`] (with a warning)
/// when a ring cannot be created.
pub fn io_engine(kind: IoKind, direct: bool) -> Arc<dyn IoEngine> {
    match kind {
        IoKind::Uring => match IoUringEngine::new(direct) {
            Ok(e) => Arc::new(e),
            Err(e) => {
                tracing::warn!("io_uring unavailable ({e}); using pread/pwrite");
                Arc::new(PosixEngine::new(direct))
            }
        },
        IoKind::Posix => Arc::new(PosixEngine::new(direct)),
    }
}

/// Whether files in `dir` can be opened with `O_DIRECT` (tmpfs refuses it).
pub fn direct_io_supported(dir: &Path) -> bool {
    let path = dir.join(format!(".odirect-probe-{}", std::process::id()));
    let ok = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .and_then(|f| {
            let buf = AlignedBuf::zeroed(IO_ALIGN);
            // SAFETY: `buf` is a live allocation of IO_ALIGN bytes; pwrite only reads it.
            let n = unsafe { libc::pwrite(f.as_raw_fd(), buf.as_ptr().cast(), IO_ALIGN, 0) };
            if n < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(())
            }
        })
        .is_ok();
    let _ = std::fs::remove_file(&path);
    ok
}

static DIRECT_FALLBACK_LOGGED: AtomicBool = AtomicBool::new(false);

pub(crate) fn open_file(path: &Path, mode: OpenMode, direct: bool) -> Result<IoFile> {
    let mut opts = OpenOptions::new();
    opts.read(true);
    match mode {
        OpenMode::Read => {}
        OpenMode::ReadWrite => {
            opts.write(true);
        }
        OpenMode::Create => {
            opts.write(true).create(true).truncate(true);
        }
    }
    if direct {
        let mut d = opts.clone();
        d.custom_flags(libc::O_DIRECT);
        match d.open(path) {
            Ok(file) => return Ok(IoFile { file, direct: true, path: path.to_owned() }),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                if !DIRECT_FALLBACK_LOGGED.swap(true, Ordering::Relaxed) {
                    tracing::warn!("O_DIRECT refused for {} ({e}); using buffered I/O", path.display());
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    let file = opts.open(path)?;
    Ok(IoFile { file, direct: false, path: path.to_owned() })
}

pub(crate) fn is_aligned(x: usize) -> bool {
    x.is_multiple_of(IO_ALIGN)
}

fn eof(file: &IoFile, offset: u64) -> StorageError {
    StorageError::Io(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("{} ends before offset {offset}", file.path.display()),
    ))
}

/// Reads into `buf` until full, retrying short reads and EINTR; `Ok(n < len)` at EOF.
fn read_full<E: IoEngine + ?Sized>(e: &E, fd: RawFd, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let end = (done + MAX_OP).min(buf.len());
        match e.raw_read(fd, offset + done as u64, &mut buf[done..end]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(done)
}

pub(crate) fn read_exact<E: IoEngine + ?Sized>(e: &E, file: &IoFile, offset: u64, buf: &mut [u8]) -> Result<()> {
    let fd = file.fd();
    if !file.direct {
        return if read_full(e, fd, offset, buf)? == buf.len() { Ok(()) } else { Err(eof(file, offset)) };
    }
    let mut pos = 0usize;
    if is_aligned(offset as usize) && is_aligned(buf.as_ptr() as usize) {
        let direct_len = buf.len() / IO_ALIGN * IO_ALIGN;
        if direct_len > 0 {
            let n = read_full(e, fd, offset, &mut buf[..direct_len])?;
            if n < direct_len {
                return Err(eof(file, offset + n as u64));
            }
            pos = direct_len;
        }
    }
    // the rest through bounce buffers covering the aligned enclosing range
    let mut bounce: Option<AlignedBuf> = None;
    while pos < buf.len() {
        let want_off = offset + pos as u64;
        let start = want_off / IO_ALIGN as u64 * IO_ALIGN as u64;
        let skip = (want_off - start) as usize;
        let want = (buf.len() - pos).min(BOUNCE_CHUNK - skip);
        let span = (skip + want).div_ceil(IO_ALIGN) * IO_ALIGN;
        let b = bounce.get_or_insert_with(|| AlignedBuf::zeroed(span.max(IO_ALIGN)));
        if b.len() < span {
            *b = AlignedBuf::zeroed(span);
        }
        let n = read_full(e, fd, start, &mut b[..span])?;
        if n < skip + want {
            return Err(eof(file, start + n as u64));
        }
        buf[pos..pos + want].copy_from_slice(&b[skip..skip + want]);
        pos += want;
    }
    Ok(())
}

fn write_full<E: IoEngine + ?Sized>(e: &E, fd: RawFd, offset: u64, data: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < data.len() {
        let end = (done + MAX_OP).min(data.len());
        match e.raw_write(fd, offset + done as u64, &data[done..end]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "write returned 0")),
            Ok(n) => done += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
}

fn write_all<E: IoEngine + ?Sized>(e: &E, file: &IoFile, offset: u64, data: &[u8]) -> Result<()> {
    let fd = file.fd();
    if !file.direct {
        return Ok(write_full(e, fd, offset, data)?);
    }
    if !is_aligned(offset as usize) {
        return Err(StorageError::InvalidArgument(format!("O_DIRECT write at unaligned offset {offset}")));
    }
    let mut pos = 0usize;
    if is_aligned(data.as_ptr() as usize) {
        pos = data.len() / IO_ALIGN * IO_ALIGN;
        if pos > 0 {
            write_full(e, fd, offset, &data[..pos])?;
        }
    }
    let mut bounce: Option<AlignedBuf> = None;
    while pos < data.len() {
        let n = (data.len() - pos).min(BOUNCE_CHUNK);
        let span = n.div_ceil(IO_ALIGN) * IO_ALIGN;
        let b = bounce.get_or_insert_with(|| AlignedBuf::zeroed(span));
        b[..n].copy_from_slice(&data[pos..pos + n]);
        b[n..span].fill(0);
        write_full(e, fd, offset + pos as u64, &b[..span])?;
        pos += n;
    }
    Ok(())
}

/// A zeroed heap buffer aligned to [`IO_ALIGN`], for `O_DIRECT` transfers.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like a Box<[u8]>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` zero bytes (at least one alignment unit is allocated).
    pub fn zeroed(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least IO_ALIGN).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> std::alloc::Layout {
        // Rounded up without wrapping: a length near `usize::MAX` must not become a
        // zero-sized layout.
        len.max(1)
            .checked_next_multiple_of(IO_ALIGN)
            .and_then(|size| std::alloc::Layout::from_size_align(size, IO_ALIGN).ok())
            .expect("buffer size overflows isize")
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with exactly this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the allocation holds at least `len` initialized (zeroed) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A length whose rounding up to the alignment would wrap is refused with a
    /// panic, never turned into a zero-sized allocation handed out as `len` bytes.
    #[test]
    #[should_panic(expected = "buffer size overflows isize")]
    fn a_length_that_cannot_be_rounded_up_is_refused() {
        let _ = AlignedBuf::zeroed(usize::MAX - 5);
    }

    #[test]
    fn aligned_buffers_round_up_and_are_zeroed() {
        let b = AlignedBuf::zeroed(5000);
        assert_eq!(b.len(), 5000);
        assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
        assert!(b.iter().all(|&x| x == 0));
    }

    fn engines(dir: &Path) -> Vec<Arc<dyn IoEngine>> {
        let mut v = vec![io_engine(IoKind::Uring, false), io_engine(IoKind::Posix, false)];
        if direct_io_supported(dir) {
            v.push(io_engine(IoKind::Uring, true));
            v.push(io_engine(IoKind::Posix, true));
        } else {
            eprintln!("note: O_DIRECT unsupported in {}; direct variants skipped", dir.display());
        }
        v
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn aligned_and_unaligned_reads_and_writes() {
        let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
        for e in engines(dir.path()) {
            let path = dir.path().join(format!("f-{}-{}", e.name(), e.direct()));
            let f = e.open(&path, OpenMode::Create).unwrap();
            let data = pattern(3 * IO_ALIGN + 123, 7);
            e.write_at(&f, 0, &data).unwrap();
            let mut aligned = AlignedBuf::zeroed(2 * IO_ALIGN + 5);
            e.write_at(&f, 8 * IO_ALIGN as u64, &aligned).unwrap();
            aligned.copy_from_slice(&pattern(2 * IO_ALIGN + 5, 9));
            e.write_at(&f, 8 * IO_ALIGN as u64, &aligned).unwrap();
            e.sync_data(&f).unwrap();
            for (off, len) in
                [(0usize, data.len()), (1, 100), (IO_ALIGN - 1, 2), (IO_ALIGN, IO_ALIGN), (5, data.len() - 5)]
            {
                let mut buf = vec![0u8; len];
                e.read_at(&f, off as u64, &mut buf).unwrap();
                assert_eq!(buf, data[off..off + len], "{} direct={} off={off} len={len}", e.name(), e.direct());
            }
            let mut out = AlignedBuf::zeroed(2 * IO_ALIGN + 5);
            e.read_at(&f, 8 * IO_ALIGN as u64, &mut out).unwrap();
            assert_eq!(&out[..], &aligned[..]);
            let mut past = vec![0u8; 10];
            assert!(e.read_at(&f, 20 * IO_ALIGN as u64, &mut past).is_err());
            if f.is_direct() {
                assert!(e.write_at(&f, 3, b"x").is_err(), "unaligned direct write offset is refused");
            }
            // batch
            let mut a = AlignedBuf::zeroed(IO_ALIGN);
            let mut b = vec![0u8; 77];
            let mut c = vec![0u8; 10];
            let mut ops = vec![
                ReadOp { file: &f, offset: IO_ALIGN as u64, buf: &mut a },
                ReadOp { file: &f, offset: 13, buf: &mut b },
                ReadOp { file: &f, offset: 1 << 30, buf: &mut c },
            ];
            let res = e.read_batch(&mut ops);
            assert!(res[0].is_ok() && res[1].is_ok() && res[2].is_err());
            assert_eq!(&a[..], &data[IO_ALIGN..2 * IO_ALIGN]);
            assert_eq!(&b[..], &data[13..90]);
        }
    }

    /// A buffer of `len` bytes starting `misalign` bytes past a 4 KiB boundary.
    struct Placed {
        buf: AlignedBuf,
        misalign: usize,
        len: usize,
    }

    impl Placed {
        fn new(len: usize, misalign: usize) -> Self {
            Placed { buf: AlignedBuf::zeroed(len + misalign), misalign, len }
        }
        fn bytes(&self) -> &[u8] {
            &self.buf[self.misalign..self.misalign + self.len]
        }
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.buf[self.misalign..self.misalign + self.len]
        }
    }

    /// How a test write hands its bytes over.
    #[derive(Clone, Copy, Debug)]
    enum Kind {
        Borrowed {
            misalign: usize,
        },
        /// An owned buffer `extra` bytes longer than the data.
        Owned {
            extra: usize,
        },
    }

    /// A source over planned writes (offset, bytes, kind) that lends at most
    /// `max_owned` owned buffers at once and waits for one to come back beyond that.
    struct Planned<'a> {
        writes: &'a [(u64, Placed, Kind)],
        next: usize,
        max_owned: usize,
        owned_out: usize,
        recycled: usize,
    }

    impl<'a> WriteSource<'a> for Planned<'a> {
        fn next_write(&mut self) -> WriteNext<'a> {
            let Some((offset, data, kind)) = self.writes.get(self.next) else { return WriteNext::Done };
            let data = match *kind {
                Kind::Borrowed { .. } => WriteData::Borrowed(data.bytes()),
                Kind::Owned { extra } => {
                    if self.owned_out == self.max_owned {
                        return WriteNext::Wait;
                    }
                    self.owned_out += 1;
                    let mut buf = AlignedBuf::zeroed(data.len + extra);
                    buf[..data.len].copy_from_slice(data.bytes());
                    // garbage where the padding goes: the stream must zero it
                    buf[data.len..].fill(0xEE);
                    WriteData::Owned { buf, len: data.len }
                }
            };
            self.next += 1;
            WriteNext::Op(WriteOp { offset: *offset, data })
        }
        fn recycle(&mut self, _buf: AlignedBuf) {
            self.owned_out -= 1;
            self.recycled += 1;
        }
    }

    /// Lays `lens` out one after another at 4 KiB-aligned offsets (with `gaps` extra
    /// 4 KiB units before each) and fills them with a pattern; returns the writes and
    /// the model of the file.
    fn plan(lens: &[(usize, Kind, usize)]) -> (Vec<(u64, Placed, Kind)>, Vec<u8>) {
        let mut writes = Vec::new();
        let mut off = 0usize;
        for (i, &(len, kind, gap)) in lens.iter().enumerate() {
            off += gap * IO_ALIGN;
            let misalign = match kind {
                Kind::Borrowed { misalign } => misalign,
                Kind::Owned { .. } => 0,
            };
            let mut p = Placed::new(len, misalign);
            p.bytes_mut().copy_from_slice(&pattern(len, i as u8));
            writes.push((off as u64, p, kind));
            off += len.div_ceil(IO_ALIGN) * IO_ALIGN;
        }
        // up to the last byte written (a buffered file is not padded)
        let end = writes.iter().filter(|w| w.1.len > 0).map(|(o, p, _)| *o as usize + p.len).max().unwrap_or(0);
        let mut model = vec![0u8; end];
        for (o, p, _) in &writes {
            model[*o as usize..*o as usize + p.len].copy_from_slice(p.bytes());
        }
        (writes, model)
    }

    fn check_stream(e: &dyn IoEngine, path: &Path, lens: &[(usize, Kind, usize)], max_owned: usize) {
        let (writes, model) = plan(lens);
        let f = e.open(path, OpenMode::Create).unwrap();
        let mut src = Planned { writes: &writes, next: 0, max_owned, owned_out: 0, recycled: 0 };
        e.write_stream(&f, &mut src).unwrap();
        let owned = writes.iter().filter(|w| matches!(w.2, Kind::Owned { .. }) && w.1.len > 0).count();
        assert_eq!((src.next, src.owned_out), (writes.len(), 0), "{} direct={}", e.name(), e.direct());
        assert!(src.recycled >= owned, "every owned buffer comes back");
        e.sync_data(&f).unwrap();
        let mut all = vec![0u8; model.len()];
        e.read_at(&f, 0, &mut all).unwrap();
        assert!(all == model, "{} direct={}: file differs from the model", e.name(), e.direct());
    }

    #[test]
    fn write_stream_matches_a_model() {
        let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
        let b = |misalign| Kind::Borrowed { misalign };
        let o = |extra| Kind::Owned { extra };
        let cases: Vec<Vec<(usize, Kind, usize)>> = vec![
            // aligned, unaligned tails, unaligned addresses, owned with and without room
            // for the padding, gaps between writes
            vec![(IO_ALIGN, b(0), 0), (100, b(0), 0), (3 * IO_ALIGN + 7, b(1), 1), (5000, o(0), 0), (5000, o(4096), 2)],
            // more writes than the queue holds, and few owned buffers: Wait
            (0..100).map(|i| (1 + i * 977, if i % 3 == 0 { o(i % 2 * IO_ALIGN) } else { b(i % 5) }, i % 2)).collect(),
            // unaligned data past the bounce budget (4 MiB chunks, 16 MiB in flight)
            vec![(20 << 20 | 5, b(3), 0), (1 << 20, b(0), 0), ((1 << 20) + 1, b(0), 0)],
            // nothing at all, and an empty write
            vec![],
            vec![(0, b(0), 0), (10, b(0), 0)],
        ];
        for e in engines(dir.path()) {
            for (c, lens) in cases.iter().enumerate() {
                let path = dir.path().join(format!("s-{}-{}-{c}", e.name(), e.direct()));
                check_stream(&*e, &path, lens, 3);
            }
            let f = e.open(&dir.path().join(format!("b-{}-{}", e.name(), e.direct())), OpenMode::Create).unwrap();
            let (x, y) = (pattern(9000, 1), pattern(IO_ALIGN, 2));
            e.write_batch(&f, &[(3 * IO_ALIGN as u64, &y), (0, &x)]).unwrap();
            let mut back = vec![0u8; 4 * IO_ALIGN];
            e.read_at(&f, 0, &mut back).unwrap();
            assert_eq!((&back[..9000], &back[3 * IO_ALIGN..]), (&x[..], &y[..]));
        }
    }

    #[test]
    fn write_stream_errors() {
        let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
        for e in engines(dir.path()) {
            let path = dir.path().join(format!("e-{}-{}", e.name(), e.direct()));
            let f = e.open(&path, OpenMode::Create).unwrap();
            let data = pattern(3 * IO_ALIGN, 3);
            if f.is_direct() {
                let err = e.write_batch(&f, &[(0, &data), (5, &data)]).unwrap_err();
                assert!(matches!(err, StorageError::InvalidArgument(_)), "{err}");
            }
            // a source that fails, after writes went out
            struct Failing<'a>(&'a [u8], usize);
            impl<'a> WriteSource<'a> for Failing<'a> {
                fn next_write(&mut self) -> WriteNext<'a> {
                    self.1 += 1;
                    match self.1 {
                        1..=40 => WriteNext::Op(WriteOp {
                            offset: (self.1 * IO_ALIGN) as u64,
                            data: WriteData::Borrowed(&self.0[..IO_ALIGN]),
                        }),
                        _ => WriteNext::Fail(StorageError::InvalidArgument("stop".into())),
                    }
                }
            }
            let err = e.write_stream(&f, &mut Failing(&data, 0)).unwrap_err();
            assert!(matches!(err, StorageError::InvalidArgument(ref m) if m == "stop"), "{err}");
            // waiting with nothing in flight is a source bug, reported
            struct Stuck;
            impl<'a> WriteSource<'a> for Stuck {
                fn next_write(&mut self) -> WriteNext<'a> {
                    WriteNext::Wait
                }
            }
            assert!(e.write_stream(&f, &mut Stuck).is_err());
            // an owned write whose length exceeds its buffer
            struct Liar(bool);
            impl<'a> WriteSource<'a> for Liar {
                fn next_write(&mut self) -> WriteNext<'a> {
                    if std::mem::replace(&mut self.0, true) {
                        return WriteNext::Done;
                    }
                    WriteNext::Op(WriteOp {
                        offset: 0,
                        data: WriteData::Owned { buf: AlignedBuf::zeroed(10), len: 11 },
                    })
                }
            }
            assert!(matches!(e.write_stream(&f, &mut Liar(false)), Err(StorageError::InvalidArgument(_))));
            // the kernel refuses: a read-only descriptor
            let ro = e.open(&path, OpenMode::Read).unwrap();
            let many: Vec<(u64, &[u8])> = (0..50).map(|i| ((i * IO_ALIGN) as u64, &data[..IO_ALIGN])).collect();
            assert!(matches!(e.write_batch(&ro, &many), Err(StorageError::Io(_))));
            // the ring is clean afterwards
            e.write_batch(&f, &many).unwrap();
            let mut back = vec![0u8; IO_ALIGN];
            e.read_at(&f, 49 * IO_ALIGN as u64, &mut back).unwrap();
            assert_eq!(back, data[..IO_ALIGN]);
        }
    }

    #[test]
    fn read_batch_each_reports_every_read_once() {
        let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
        for e in engines(dir.path()) {
            let path = dir.path().join(format!("r-{}-{}", e.name(), e.direct()));
            let f = e.open(&path, OpenMode::Create).unwrap();
            let data = pattern(300 * IO_ALIGN + 11, 5);
            e.write_at(&f, 0, &data).unwrap();
            // 100 reads (more than the queue depth): aligned, unaligned, into the
            // padding past the data, past the end of the file, empty
            let specs: Vec<(usize, usize, usize)> = (0..100)
                .map(|i| match i % 5 {
                    0 => (i * IO_ALIGN, IO_ALIGN, 0),
                    1 => (i * 1000 + 3, 5000, 1),
                    2 => (i * IO_ALIGN, 2 * IO_ALIGN, 0),
                    3 => (300 * IO_ALIGN, 11, 0),
                    _ => (i * 77, i, 0),
                })
                .chain([(400 * IO_ALIGN, IO_ALIGN, 0), (300 * IO_ALIGN + 8, IO_ALIGN, 0)])
                .collect();
            let mut bufs: Vec<Placed> = specs.iter().map(|&(_, len, mis)| Placed::new(len, mis)).collect();
            let mut ops: Vec<ReadOp<'_>> = specs
                .iter()
                .zip(bufs.iter_mut())
                .map(|(&(off, _, _), b)| ReadOp { file: &f, offset: off as u64, buf: b.bytes_mut() })
                .collect();
            let mut seen = vec![0u32; specs.len()];
            let mut oks = vec![false; specs.len()];
            e.read_batch_each(&mut ops, &mut |i, r| {
                seen[i] += 1;
                if let Ok(buf) = r {
                    let (off, len, _) = specs[i];
                    assert_eq!(buf.len(), len);
                    assert!(buf[..] == data[off..off + len], "read {i}");
                    oks[i] = true;
                    // I/O from the callback works (POSIX while the ring is busy)
                    let mut one = [0u8; 3];
                    e.read_at(&f, 1, &mut one).unwrap();
                    assert_eq!(one[..], data[1..4]);
                }
            });
            assert!(seen.iter().all(|&n| n == 1), "{} direct={}: {seen:?}", e.name(), e.direct());
            let n = specs.len();
            assert!(oks[..n - 2].iter().all(|&x| x), "{} direct={}", e.name(), e.direct());
            assert!(!oks[n - 2] && !oks[n - 1], "reads past the end fail");
        }
    }

    #[test]
    fn a_panicking_callback_leaves_the_ring_usable() {
        let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
        for e in engines(dir.path()) {
            let path = dir.path().join(format!("p-{}-{}", e.name(), e.direct()));
            let f = e.open(&path, OpenMode::Create).unwrap();
            let data = pattern(64 * IO_ALIGN, 9);
            e.write_at(&f, 0, &data).unwrap();
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut bufs: Vec<AlignedBuf> = (0..64).map(|_| AlignedBuf::zeroed(IO_ALIGN)).collect();
                let mut ops: Vec<ReadOp<'_>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| ReadOp { file: &f, offset: (i * IO_ALIGN) as u64, buf: &mut b[..] })
                    .collect();
                e.read_batch_each(&mut ops, &mut |_, _| panic!("callback fails"));
            }));
            assert!(caught.is_err());
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                struct Boom<'a>(&'a [u8], usize);
                impl<'a> WriteSource<'a> for Boom<'a> {
                    fn next_write(&mut self) -> WriteNext<'a> {
                        self.1 += 1;
                        assert!(self.1 < 10, "source fails");
                        WriteNext::Op(WriteOp {
                            offset: (self.1 * IO_ALIGN) as u64,
                            data: WriteData::Borrowed(&self.0[..IO_ALIGN]),
                        })
                    }
                }
                let _ = e.write_stream(&f, &mut Boom(&data, 0));
            }));
            assert!(caught.is_err());
            // nothing left in flight: plain I/O on this thread still works
            let mut back = vec![0u8; 64 * IO_ALIGN];
            e.read_at(&f, 0, &mut back).unwrap();
            assert!(back == data);
            assert_eq!(
                e.read_batch(&mut [ReadOp { file: &f, offset: 5, buf: &mut back[..10] }])[0].as_ref().ok(),
                Some(&())
            );
        }
    }

    #[test]
    fn allocate_grows_the_file() {
        let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
        for e in engines(dir.path()) {
            let path = dir.path().join(format!("a-{}-{}", e.name(), e.direct()));
            let f = e.open(&path, OpenMode::Create).unwrap();
            if f.allocate(10 * IO_ALIGN as u64).unwrap() {
                assert_eq!(f.len().unwrap(), 10 * IO_ALIGN as u64);
            }
            assert!(f.allocate(0).unwrap());
            let data = pattern(IO_ALIGN, 4);
            e.write_batch(&f, &[(2 * IO_ALIGN as u64, &data)]).unwrap();
            let mut back = vec![1u8; 3 * IO_ALIGN];
            e.read_at(&f, 0, &mut back).unwrap();
            assert!(back[..2 * IO_ALIGN].iter().all(|&x| x == 0), "allocated blocks read as zeros");
            assert_eq!(back[2 * IO_ALIGN..], data[..]);
        }
    }

    mod model {
        use super::*;
        use proptest::prelude::*;

        fn kind() -> impl Strategy<Value = Kind> {
            prop_oneof![
                (0usize..8).prop_map(|m| Kind::Borrowed { misalign: m * 513 % IO_ALIGN }),
                (0usize..2).prop_map(|x| Kind::Owned { extra: x * IO_ALIGN })
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(24))]
            /// Random writes streamed, then random reads reported one by one, against a
            /// byte vector, on every engine.
            #[test]
            fn streamed_writes_and_reads_match_a_vector(
                lens in proptest::collection::vec((1usize..40_000, kind(), 0usize..3), 0..60),
                reads in proptest::collection::vec((any::<prop::sample::Index>(), 0usize..20_000, 0usize..3), 1..80),
                max_owned in 1usize..4,
            ) {
                let dir = tempfile::tempdir_in(crate::test_support::test_root()).unwrap();
                for e in engines(dir.path()) {
                    let path = dir.path().join(format!("m-{}-{}", e.name(), e.direct()));
                    check_stream(&*e, &path, &lens, max_owned);
                    let (_, model) = plan(&lens);
                    if model.is_empty() {
                        continue;
                    }
                    let f = e.open(&path, OpenMode::Read).unwrap();
                    let specs: Vec<(usize, usize, usize)> = reads
                        .iter()
                        .map(|(at, len, mis)| {
                            let off = at.index(model.len());
                            (off, (*len).min(model.len() - off), mis * 1000)
                        })
                        .collect();
                    let mut bufs: Vec<Placed> = specs.iter().map(|&(_, len, mis)| Placed::new(len, mis)).collect();
                    let mut ops: Vec<ReadOp<'_>> = specs
                        .iter()
                        .zip(bufs.iter_mut())
                        .map(|(&(off, _, _), b)| ReadOp { file: &f, offset: off as u64, buf: b.bytes_mut() })
                        .collect();
                    let mut seen = vec![0u32; specs.len()];
                    e.read_batch_each(&mut ops, &mut |i, r| {
                        seen[i] += 1;
                        let (off, len, _) = specs[i];
                        let buf = r.expect("in-range read");
                        assert!(buf[..] == model[off..off + len]);
                    });
                    prop_assert!(seen.iter().all(|&n| n == 1));
                }
            }
        }
    }
}
