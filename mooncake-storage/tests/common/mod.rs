//! Shared helpers of the integration tests: every backend over every I/O variant.
#![allow(dead_code)]

use std::io;
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use mooncake_storage::*;

/// The four I/O variants every backend suite runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Io {
    Uring,
    UringDirect,
    Posix,
    PosixDirect,
}

/// The three backends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Bucket,
    FilePerKey,
    Offset,
}

/// A directory for test files that is not tmpfs (so O_DIRECT works).
pub fn test_root() -> PathBuf {
    let tmp = std::env::temp_dir();
    let root = if is_tmpfs(&tmp) { PathBuf::from("/var/tmp") } else { tmp };
    std::fs::create_dir_all(&root).ok();
    root
}

fn is_tmpfs(p: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else { return false };
    // SAFETY: statfs is plain data; zeroed is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    let r = unsafe { libc::statfs(c.as_ptr(), &mut s) };
    r == 0 && s.f_type == libc::TMPFS_MAGIC
}

/// Where an object's bytes are, to check that eviction has (not yet) deleted them.
#[derive(Clone, Debug)]
pub enum Location {
    File(PathBuf),
    /// The data file, the record's offset and its key.
    Record(PathBuf, u64, String),
}

impl Location {
    pub fn still_there(&self) -> bool {
        match self {
            Location::File(p) => p.exists(),
            Location::Record(p, off, key) => {
                use std::os::unix::fs::FileExt;
                let Ok(f) = std::fs::File::open(p) else { return false };
                let mut head = vec![0u8; 8192];
                // A record header of `key`: its magic, and its key after the 44 bytes
                // of a version 2 or 3 header (a bound one parses only with its salt).
                f.read_exact_at(&mut head, *off).is_ok()
                    && head.starts_with(b"MCOH")
                    && head[8..12] == (key.len() as u32).to_le_bytes()
                    && head.get(44..44 + key.len()) == Some(key.as_bytes())
            }
        }
    }
}

type Locator = Box<dyn Fn(&str) -> Option<Location> + Send + Sync>;

pub struct Opened {
    pub backend: Arc<dyn StorageBackend>,
    locate: Locator,
}

impl Opened {
    pub fn locate(&self, key: &str) -> Option<Location> {
        (self.locate)(key)
    }
}

impl std::ops::Deref for Opened {
    type Target = dyn StorageBackend;
    fn deref(&self) -> &Self::Target {
        &*self.backend
    }
}

pub struct Env {
    pub kind: Kind,
    pub io_variant: Io,
    pub io: Arc<dyn IoEngine>,
    pub dir: tempfile::TempDir,
}

/// Size of the offset backend's file when no capacity is set.
pub const OFFSET_FILE: u64 = 96 << 20;

impl Env {
    /// `None` (with a note) when the variant cannot run here.
    pub fn new(kind: Kind, io_variant: Io) -> Option<Env> {
        let dir = tempfile::tempdir_in(test_root()).unwrap();
        let direct = matches!(io_variant, Io::UringDirect | Io::PosixDirect);
        if direct && !direct_io_supported(dir.path()) {
            eprintln!("note: O_DIRECT unsupported under {}: {io_variant:?} skipped", dir.path().display());
            return None;
        }
        let io = match io_variant {
            Io::Uring | Io::UringDirect => io_engine(IoKind::Uring, direct),
            Io::Posix | Io::PosixDirect => io_engine(IoKind::Posix, direct),
        };
        if matches!(io_variant, Io::Uring | Io::UringDirect) && io.name() != "io_uring" {
            eprintln!("note: io_uring unavailable; {io_variant:?} runs over the POSIX fallback");
        }
        Some(Env { kind, io_variant, io, dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn opts(&self) -> BackendOptions {
        BackendOptions::default().with_io(self.io.clone())
    }

    /// Bytes one object with a `value_len` value and a short key costs.
    pub fn unit_cost(&self, value_len: u64) -> u64 {
        let v = value_len.div_ceil(4096) * 4096;
        match self.kind {
            Kind::Bucket => v,
            Kind::FilePerKey | Kind::Offset => v + 4096,
        }
    }

    pub fn open(&self, opts: BackendOptions) -> Opened {
        self.open_with(opts, BucketConfig::default())
    }

    pub fn open_with(&self, opts: BackendOptions, cfg: BucketConfig) -> Opened {
        let dir = self.path().to_owned();
        match self.kind {
            Kind::Bucket => {
                let b = Arc::new(BucketBackend::open(&dir, opts, cfg).unwrap());
                let b2 = b.clone();
                Opened {
                    backend: b,
                    locate: Box::new(move |k| b2.bucket_of(k).map(|id| Location::File(b2.data_file_path(id)))),
                }
            }
            Kind::FilePerKey => {
                let b = Arc::new(FilePerKeyBackend::open(&dir, opts).unwrap());
                let b2 = b.clone();
                Opened { backend: b, locate: Box::new(move |k| b2.exists(k).then(|| Location::File(b2.path_for(k)))) }
            }
            Kind::Offset => {
                let size = opts.capacity.unwrap_or(OFFSET_FILE);
                let b = Arc::new(OffsetAllocatorBackend::open(&dir, size, opts).unwrap());
                let b2 = b.clone();
                Opened {
                    backend: b,
                    locate: Box::new(move |k| {
                        b2.record_offset(k)
                            .map(|off| Location::Record(b2.data_file_path().to_owned(), off, k.to_owned()))
                    }),
                }
            }
        }
    }
}

pub fn run(kind: Kind, io: Io, test: fn(&Env)) {
    if let Some(env) = Env::new(kind, io) {
        test(&env);
    }
}

/// Deterministic test bytes for `key`.
pub fn value(key: &str, len: usize) -> Vec<u8> {
    let seed = crc32c::crc32c(key.as_bytes());
    let mut x = seed as u64 | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An engine wrapper whose reads block while armed, to hold a read in flight.
#[derive(Debug)]
pub struct GatedEngine {
    pub inner: Arc<dyn IoEngine>,
    armed: AtomicBool,
    gate: Mutex<(bool, bool)>, // (a read is waiting, open)
    cv: Condvar,
}

impl GatedEngine {
    pub fn new(inner: Arc<dyn IoEngine>) -> Arc<Self> {
        Arc::new(GatedEngine {
            inner,
            armed: AtomicBool::new(false),
            gate: Mutex::new((false, false)),
            cv: Condvar::new(),
        })
    }
    pub fn arm(&self) {
        *self.gate.lock().unwrap() = (false, false);
        self.armed.store(true, Ordering::SeqCst);
    }
    /// Waits until a read is blocked at the gate.
    pub fn wait_blocked(&self) {
        let mut g = self.gate.lock().unwrap();
        while !g.0 {
            g = self.cv.wait(g).unwrap();
        }
    }
    pub fn open_gate(&self) {
        self.armed.store(false, Ordering::SeqCst);
        self.gate.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

impl IoEngine for GatedEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn direct(&self) -> bool {
        self.inner.direct()
    }
    fn raw_read(&self, fd: RawFd, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        if self.armed.load(Ordering::SeqCst) {
            let mut g = self.gate.lock().unwrap();
            g.0 = true;
            self.cv.notify_all();
            while !g.1 {
                g = self.cv.wait(g).unwrap();
            }
        }
        self.inner.raw_read(fd, offset, buf)
    }
    fn raw_write(&self, fd: RawFd, offset: u64, buf: &[u8]) -> io::Result<usize> {
        self.inner.raw_write(fd, offset, buf)
    }
    unsafe fn raw_read_batch(&self, reads: &mut [RawRead]) {
        for r in reads.iter_mut() {
            // SAFETY: forwarded contract of raw_read_batch.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) };
            r.result = Some(self.raw_read(r.fd, r.offset, buf));
        }
    }
    fn sync_data(&self, file: &IoFile) -> Result<()> {
        self.inner.sync_data(file)
    }
}

/// Generates one `#[test]` per I/O variant for each listed test fn of `kind`.
#[macro_export]
macro_rules! io_variants {
    ($kind:expr; $($t:ident),* $(,)?) => {
        mod uring {
            $( #[test] fn $t() { $crate::common::run($kind, $crate::common::Io::Uring, $crate::$t) } )*
        }
        mod uring_direct {
            $( #[test] fn $t() { $crate::common::run($kind, $crate::common::Io::UringDirect, $crate::$t) } )*
        }
        mod posix {
            $( #[test] fn $t() { $crate::common::run($kind, $crate::common::Io::Posix, $crate::$t) } )*
        }
        mod posix_direct {
            $( #[test] fn $t() { $crate::common::run($kind, $crate::common::Io::PosixDirect, $crate::$t) } )*
        }
    };
}

/// Every backend x every I/O variant for each listed test fn.
#[macro_export]
macro_rules! all_backends {
    ($($t:ident),* $(,)?) => {
        mod bucket { $crate::io_variants!($crate::common::Kind::Bucket; $($t),*); }
        mod file_per_key { $crate::io_variants!($crate::common::Kind::FilePerKey; $($t),*); }
        mod offset_allocator { $crate::io_variants!($crate::common::Kind::Offset; $($t),*); }
    };
}
