//! The I/O layer: positional reads and writes of files, through `io_uring` or POSIX.
//!
//! An [`IoEngine`] provides four raw operations ([`raw_read`](IoEngine::raw_read),
//! [`raw_write`](IoEngine::raw_write), [`raw_read_batch`](IoEngine::raw_read_batch),
//! [`sync_data`](IoEngine::sync_data)) and gets from them, as provided methods, exact
//! reads and writes that respect `O_DIRECT` rules: with `O_DIRECT`, buffers, lengths and
//! offsets must be 4 KiB-aligned, so
//! * reads whose buffer and offset are aligned go straight into the caller's buffer
//!   (only an unaligned tail goes through a 4 KiB bounce buffer); other reads go
//!   through aligned bounce buffers (4 MiB at a time);
//! * writes must start at an aligned offset; an unaligned tail (or an unaligned
//!   source buffer) goes through an aligned bounce buffer and **is padded with zeros up
//!   to the next 4 KiB boundary** — the file may grow to the padded length. The
//!   on-disk formats of this crate keep every value 4 KiB-aligned for this reason.
//!
//! Engines:
//! * [`IoUringEngine`]: one ring per thread (thread-local, no lock between threads),
//!   batched reads of up to [`QUEUE_DEPTH`] requests per submission, reads into a
//!   registered fixed buffer use `READ_FIXED`. Falls back to POSIX calls in a thread
//!   whose ring cannot be created.
//! * [`PosixEngine`]: `pread`/`pwrite`, optionally on `O_DIRECT` files.
//!
//! [`io_engine`] builds either, falling back to POSIX when `io_uring` is unavailable.
//! Opening a file with `O_DIRECT` on a filesystem that refuses it (tmpfs) falls back
//! to buffered I/O for that file with a logged warning.

mod posix;
mod uring;

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub use posix::PosixEngine;
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

/// Positional file I/O. Object-safe; engines are shared by every backend thread.
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
    /// (up to [`QUEUE_DEPTH`] at a time with `io_uring`). One result per op.
    fn read_batch(&self, ops: &mut [ReadOp<'_>]) -> Vec<Result<()>> {
        read_batch(self, ops)
    }

    /// Writes all of `data` at `offset`. With `O_DIRECT`, `offset` must be aligned
    /// and an unaligned tail is padded with zeros to the next 4 KiB boundary.
    fn write_at(&self, file: &IoFile, offset: u64, data: &[u8]) -> Result<()> {
        write_all(self, file, offset, data)
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

fn is_aligned(x: usize) -> bool {
    x % IO_ALIGN == 0
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

fn read_exact<E: IoEngine + ?Sized>(e: &E, file: &IoFile, offset: u64, buf: &mut [u8]) -> Result<()> {
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

fn read_batch<E: IoEngine + ?Sized>(e: &E, ops: &mut [ReadOp<'_>]) -> Vec<Result<()>> {
    let mut results: Vec<Option<Result<()>>> = (0..ops.len()).map(|_| None).collect();
    // Ops the kernel can take as they are go in one raw batch; the others one by one.
    let mut raw = Vec::with_capacity(ops.len());
    let mut raw_idx = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter_mut().enumerate() {
        let simple = op.buf.len() <= MAX_OP
            && (!op.file.direct
                || (is_aligned(op.offset as usize)
                    && is_aligned(op.buf.as_ptr() as usize)
                    && is_aligned(op.buf.len())));
        if simple && !op.buf.is_empty() {
            raw.push(RawRead {
                fd: op.file.fd(),
                offset: op.offset,
                ptr: op.buf.as_mut_ptr(),
                len: op.buf.len(),
                result: None,
            });
            raw_idx.push(i);
        } else {
            results[i] = Some(read_exact(e, op.file, op.offset, op.buf));
        }
    }
    if !raw.is_empty() {
        // SAFETY: each `ptr` comes from a distinct `&mut [u8]` of `ops`, which stays
        // borrowed (and is not otherwise accessed) until the call returns.
        unsafe { e.raw_read_batch(&mut raw) };
    }
    for (r, &i) in raw.iter().zip(&raw_idx) {
        let op = &mut ops[i];
        results[i] = Some(match r.result.as_ref() {
            Some(Ok(n)) if *n == op.buf.len() => Ok(()),
            // short read or EINTR: finish the rest the simple way
            Some(Ok(n)) => {
                let n = *n;
                read_exact(e, op.file, op.offset + n as u64, &mut op.buf[n..])
            }
            Some(Err(err)) if err.kind() == io::ErrorKind::Interrupted => read_exact(e, op.file, op.offset, op.buf),
            Some(Err(err)) => Err(io::Error::new(err.kind(), err.to_string()).into()),
            None => read_exact(e, op.file, op.offset, op.buf),
        });
    }
    results.into_iter().map(|r| r.unwrap_or(Ok(()))).collect()
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
        std::alloc::Layout::from_size_align(len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN, IO_ALIGN)
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
}
