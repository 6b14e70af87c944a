//! `pread`/`pwrite` engine.

use std::io;
use std::os::fd::RawFd;

use super::{IoEngine, IoFile};
use crate::error::Result;

/// Positional I/O with `pread(2)`/`pwrite(2)`, optionally on `O_DIRECT` files.
#[derive(Debug, Clone)]
pub struct PosixEngine {
    direct: bool,
}

impl PosixEngine {
    /// An engine that opens files with `O_DIRECT` if `direct`.
    pub fn new(direct: bool) -> Self {
        PosixEngine { direct }
    }
}

pub(crate) fn pread(fd: RawFd, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
    let len = buf.len().min(super::MAX_OP);
    // SAFETY: `buf` is valid for `len` writable bytes for the duration of the call.
    let n = unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), len, offset as libc::off_t) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

pub(crate) fn pwrite(fd: RawFd, offset: u64, buf: &[u8]) -> io::Result<usize> {
    let len = buf.len().min(super::MAX_OP);
    // SAFETY: `buf` is valid for `len` readable bytes for the duration of the call.
    let n = unsafe { libc::pwrite(fd, buf.as_ptr().cast(), len, offset as libc::off_t) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

impl IoEngine for PosixEngine {
    fn name(&self) -> &'static str {
        "posix"
    }
    fn direct(&self) -> bool {
        self.direct
    }
    fn raw_read(&self, fd: RawFd, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        pread(fd, offset, buf)
    }
    fn raw_write(&self, fd: RawFd, offset: u64, buf: &[u8]) -> io::Result<usize> {
        pwrite(fd, offset, buf)
    }
    fn sync_data(&self, file: &IoFile) -> Result<()> {
        Ok(file.as_file().sync_data()?)
    }
}
