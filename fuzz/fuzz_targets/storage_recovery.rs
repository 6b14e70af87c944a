//! The SSD tier's recovery on arbitrary files: the bytes become a bucket's `.meta`
//! and `.bucket` files, an offset-allocator data file (with or without its format
//! file), or a file-per-key object file, and the backend opens the directory. It
//! must open or fail, never panic; every object it then lists loads as its listed
//! length and checksum, or fails; and a second open lists no object the first did
//! not.
//!
//! The first byte picks the layout (`% 3`) and flags (`/ 3`): bit 0 makes every
//! record header and bucket meta found pass its checksums (so that the fuzzer
//! reaches what recovery does after them), bit 1 writes an offset-allocator format
//! file (salt: the next 8 bytes), bit 2 says its records are still being bound.
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use libfuzzer_sys::fuzz_target;
use mooncake_storage::{
    io_engine, BackendOptions, BucketBackend, BucketConfig, FilePerKeyBackend, IoKind, OffsetAllocatorBackend,
    StorageBackend,
};
use mooncake_transfer::checksum::crc32c;

const ALIGN: usize = 4096;
const MAGIC: &[u8; 4] = b"MCOH";

/// A fresh directory of this process, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("mooncake-fuzz-recovery-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn options() -> BackendOptions {
    BackendOptions::default().with_io(io_engine(IoKind::Posix, false))
}

/// The keys `b` lists; each listed object loads as listed, or fails.
fn exercise(b: &dyn StorageBackend) -> Vec<String> {
    let mut metas = Vec::new();
    b.scan_meta(&mut |m| metas.push(m.clone()));
    for m in &metas {
        // Every file is the fuzzer's: no object is larger than its input.
        assert!(m.len <= 1 << 30, "{} listed with {} bytes", m.key, m.len);
        let mut buf = vec![0u8; m.len as usize];
        if let Ok(n) = b.load(&m.key, &mut buf) {
            assert_eq!(n as u64, m.len, "{}", m.key);
            assert_eq!(crc32c(&buf), m.checksum, "{}: bytes that are not the object's", m.key);
        }
    }
    let mut keys: Vec<String> = metas.into_iter().map(|m| m.key).collect();
    keys.sort();
    keys
}

/// Opens `dir` with `open` twice: the second open lists no key the first did not.
fn open_twice<B: StorageBackend>(dir: &Path, open: impl Fn(&Path) -> Option<B>) {
    let Some(first) = open(dir).map(|b| exercise(&b)) else { return };
    if let Some(second) = open(dir).map(|b| exercise(&b)) {
        assert!(second.iter().all(|k| first.binary_search(k).is_ok()), "{second:?} after {first:?}");
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// Makes the record header at `at` of `file` (one that starts with the magic) pass
/// its checksums: its value's, when the value lies in `file`, then its own (bound to
/// `salt` and `at` for a version-3 header).
fn fix_record(file: &mut [u8], at: usize, salt: u64) {
    let b = &file[at..];
    if b.len() < 44 || &b[..4] != MAGIC {
        return;
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    let fixed = if version == 1 { 36 } else { 44 };
    let key_len = u32_at(b, 8) as usize;
    if key_len == 0 || key_len > 4096 || b.len() < fixed + key_len {
        return;
    }
    let value_len = u64::from_le_bytes(b[16..24].try_into().expect("8 bytes"));
    let value_at = at + (fixed + key_len).next_multiple_of(ALIGN);
    if let Some(end) = usize::try_from(value_len).ok().and_then(|n| value_at.checked_add(n)) {
        if end <= file.len() {
            let crc = crc32c(&file[value_at..end]);
            file[at + 12..at + 16].copy_from_slice(&crc.to_le_bytes());
        }
    }
    let mut covered = Vec::with_capacity(16 + fixed + key_len);
    if version == 3 {
        covered.extend_from_slice(&salt.to_le_bytes());
        covered.extend_from_slice(&(at as u64).to_le_bytes());
    }
    covered.extend_from_slice(&file[at..at + fixed - 4]);
    covered.extend_from_slice(&file[at + fixed..at + fixed + key_len]);
    let crc = crc32c(&covered);
    file[at + fixed - 4..at + fixed].copy_from_slice(&crc.to_le_bytes());
}

fn bucket(dir: &Path, rest: &[u8], fix: bool) {
    let (len, rest) = match rest {
        [a, b, rest @ ..] => (usize::from(u16::from_le_bytes([*a, *b])).min(rest.len()), rest),
        _ => return,
    };
    let (meta, data) = rest.split_at(len);
    let mut meta = meta.to_vec();
    if fix && meta.len() >= 4 {
        let n = meta.len() - 4;
        let crc = crc32c(&meta[..n]);
        meta[n..].copy_from_slice(&crc.to_le_bytes());
    }
    std::fs::write(dir.join("1.meta"), &meta).expect("write");
    std::fs::write(dir.join("1.bucket"), data).expect("write");
    open_twice(dir, |d| BucketBackend::open(d, options(), BucketConfig::default()).ok());
}

fn offset_allocator(dir: &Path, rest: &[u8], flags: u8) {
    let (salt, data) = match rest.split_first_chunk::<8>() {
        Some((salt, data)) => (u64::from_le_bytes(*salt), data),
        None => (0, rest),
    };
    // At least a few blocks, whole blocks only: the scan then runs past the input.
    let mut file = data.to_vec();
    file.resize(file.len().max(4 * ALIGN).next_multiple_of(ALIGN), 0);
    if flags & 1 != 0 {
        for at in (0..file.len()).step_by(ALIGN) {
            fix_record(&mut file, at, salt);
        }
    }
    std::fs::write(dir.join("kv_cache.data"), &file).expect("write");
    if flags & 2 != 0 {
        let mut format = b"MCOAFMT1".to_vec();
        format.extend_from_slice(&(if flags & 4 != 0 { 1u32 } else { 2 }).to_le_bytes());
        format.extend_from_slice(&salt.to_le_bytes());
        let crc = crc32c(&format);
        format.extend_from_slice(&crc.to_le_bytes());
        std::fs::write(dir.join("kv_cache.format"), format).expect("write");
    }
    open_twice(dir, |d| OffsetAllocatorBackend::open(d, 0, options()).ok());
}

fn file_per_key(dir: &Path, rest: &[u8], fix: bool) {
    let mut file = rest.to_vec();
    if fix {
        fix_record(&mut file, 0, 0);
    }
    // Where the object of the key its header names lives (a path that does not
    // match its key is deleted unread); elsewhere for anything else.
    let key = (file.len() >= 44 && &file[..4] == MAGIC)
        .then(|| {
            let fixed: usize = if u16::from_le_bytes([file[4], file[5]]) == 1 { 36 } else { 44 };
            let key_len = u32_at(&file, 8) as usize;
            file.get(fixed..fixed.checked_add(key_len)?).and_then(|k| std::str::from_utf8(k).ok()).map(str::to_owned)
        })
        .flatten()
        .filter(|k| !k.is_empty());
    let path = match (&key, FilePerKeyBackend::open(dir, options())) {
        (Some(k), Ok(b)) => b.path_for(k),
        _ => dir.join("00").join("00").join("0.obj"),
    };
    std::fs::create_dir_all(path.parent().expect("a parent")).expect("mkdir");
    std::fs::write(&path, &file).expect("write");
    open_twice(dir, |d| FilePerKeyBackend::open(d, options()).ok());
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else { return };
    let (kind, flags) = (first % 3, first / 3);
    let scratch = Scratch::new();
    match kind {
        0 => bucket(&scratch.0, rest, flags & 1 != 0),
        1 => offset_allocator(&scratch.0, rest, flags),
        _ => file_per_key(&scratch.0, rest, flags & 1 != 0),
    }
});
