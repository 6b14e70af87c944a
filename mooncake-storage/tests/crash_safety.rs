//! Simulated crashes and disk damage: torn writes, truncated data, corrupt or
//! missing meta, partial records, removals the disk never saw, unreadable files,
//! failed removes. Damaged objects are absent (or fail with `Corrupted`); intact ones
//! read back exactly; wrong bytes are never returned; a remove that fails leaves the
//! object stored. Every test runs over the four I/O variants.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;

use common::{value, Env};
use mooncake_storage::*;

mod bucket {
    crate::io_variants!(crate::common::Kind::Bucket;
        bucket_truncated_data_file, bucket_corrupt_meta, bucket_missing_meta_and_leftovers, bucket_bit_rot,
        bucket_newest_copy_wins, bucket_unreadable_meta_is_left_on_disk, bucket_failed_remove_keeps_the_object,
        bucket_absurd_data_length_is_garbage, bucket_oversized_meta_is_not_read);
}
mod file_per_key {
    crate::io_variants!(crate::common::Kind::FilePerKey;
        fpk_truncated_and_corrupt_files, fpk_bit_rot, fpk_failed_remove_keeps_the_object);
}
mod offset_allocator {
    crate::io_variants!(crate::common::Kind::Offset;
        offset_partial_and_corrupt_records, offset_bit_rot, offset_failed_remove_keeps_the_object,
        offset_records_inside_removed_values_stay_values, offset_files_of_unbound_records_are_read_and_bound,
        offset_unreadable_format_file_refuses_the_open);
}

fn flip_byte(path: &std::path::Path, off: u64) {
    let f = OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0x5A;
    f.write_all_at(&b, off).unwrap();
    f.sync_all().unwrap();
}

fn keys_of(b: &dyn StorageBackend) -> Vec<String> {
    let mut v = Vec::new();
    b.scan_meta(&mut |m| v.push(m.key.clone()));
    v.sort();
    v
}

/// `chattr +i` on a path while the guard lives: writes, creations and unlinks there
/// fail with EPERM, even for root.
struct Immutable(std::path::PathBuf);

impl Immutable {
    /// `None`, with a message, where the filesystem or privileges do not allow it.
    fn set(path: &std::path::Path) -> Option<Immutable> {
        let ok = std::process::Command::new("chattr").arg("+i").arg(path).status().is_ok_and(|s| s.success());
        if !ok {
            eprintln!("skipped: `chattr +i` is not possible on {}", path.display());
            return None;
        }
        Some(Immutable(path.to_owned()))
    }
}

impl Drop for Immutable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr").arg("-i").arg(&self.0).status();
    }
}

fn bucket_files(env: &Env) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(env.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

fn bucket_truncated_data_file(env: &Env) {
    let (a, b2, c) = (value("a", 4096), value("b", 10_000), value("c", 100));
    let bucket = {
        let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
        b.batch_offload(&[("a", &a[..]), ("b", &b2[..])]);
        b.offload("c", &c).unwrap();
        b.bucket_of("a").unwrap()
    };
    // torn: the data file lost its tail (b lies at 4096..14096)
    let data = env.path().join(format!("{bucket}.bucket"));
    OpenOptions::new().write(true).open(&data).unwrap().set_len(4096 + 5000).unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["a", "c"]);
    assert_eq!(b.load_vec("a").unwrap(), a);
    assert_eq!(b.load_vec("c").unwrap(), c);
    assert!(b.load_vec("b").unwrap_err().is_not_found());
    drop(b);
    // the meta was rewritten: still consistent on the next open
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["a", "c"]);
    // truncated to nothing: the bucket is garbage
    drop(b);
    OpenOptions::new().write(true).open(&data).unwrap().set_len(10).unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["c"]);
    assert!(!data.exists() && !env.path().join(format!("{bucket}.meta")).exists(), "garbage removed");
}

fn bucket_corrupt_meta(env: &Env) {
    let (x, y) = (value("x", 3000), value("y", 3000));
    let (bx, by) = {
        let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
        b.offload("x", &x).unwrap();
        b.offload("y", &y).unwrap();
        (b.bucket_of("x").unwrap(), b.bucket_of("y").unwrap())
    };
    assert_ne!(bx, by);
    let meta = env.path().join(format!("{bx}.meta"));
    let len = std::fs::metadata(&meta).unwrap().len();
    flip_byte(&meta, len / 2);
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["y"]);
    assert_eq!(b.load_vec("y").unwrap(), y);
    assert!(b.load_vec("x").unwrap_err().is_not_found());
    assert!(!meta.exists() && !env.path().join(format!("{bx}.bucket")).exists(), "garbage bucket removed");
    // a truncated (torn) meta file too
    drop(b);
    let meta = env.path().join(format!("{by}.meta"));
    OpenOptions::new().write(true).open(&meta).unwrap().set_len(len - 3).unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert!(keys_of(&b).is_empty());
    assert!(bucket_files(env).is_empty(), "{:?}", bucket_files(env));
}

fn bucket_missing_meta_and_leftovers(env: &Env) {
    let (x, y) = (value("x", 5000), value("y", 5000));
    let bx = {
        let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
        b.offload("x", &x).unwrap();
        b.offload("y", &y).unwrap();
        b.bucket_of("x").unwrap()
    };
    // crash between data and meta: data without meta, plus a half-written temp meta
    std::fs::remove_file(env.path().join(format!("{bx}.meta"))).unwrap();
    std::fs::write(env.path().join(format!("{bx}.meta.tmp")), b"MCBKMETA partial").unwrap();
    std::fs::write(env.path().join("999.meta"), b"meta without data").unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["y"]);
    assert_eq!(b.load_vec("y").unwrap(), y);
    let files = bucket_files(env);
    assert_eq!(files.len(), 2, "only y's bucket is left: {files:?}");
    // a new write after recovery gets a newer id
    b.offload("z", b"zz").unwrap();
    assert!(b.bucket_of("z").unwrap() > b.bucket_of("y").unwrap());
}

fn bucket_bit_rot(env: &Env) {
    let x = value("x", 9000);
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    b.offload("x", &x).unwrap();
    let id = b.bucket_of("x").unwrap();
    drop(b);
    flip_byte(&env.path().join(format!("{id}.bucket")), 4000);
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert!(matches!(b.load_vec("x"), Err(StorageError::Corrupted { .. })), "never the wrong bytes");
}

fn fpk_truncated_and_corrupt_files(env: &Env) {
    let vals: Vec<(String, Vec<u8>)> = (0..4).map(|i| (format!("k{i}"), value(&format!("k{i}"), 10_000))).collect();
    let paths: Vec<_> = {
        let b = FilePerKeyBackend::open(env.path(), env.opts()).unwrap();
        for (k, v) in &vals {
            b.offload(k, v).unwrap();
        }
        vals.iter().map(|(k, _)| b.path_for(k)).collect()
    };
    // k0: torn (truncated) file; k1: corrupt header; k2: moved to another key's place
    OpenOptions::new().write(true).open(&paths[0]).unwrap().set_len(4096 + 5000).unwrap();
    flip_byte(&paths[1], 10);
    let stray = paths[2].with_file_name("0000000000000000ffffffffffffffff.obj");
    std::fs::rename(&paths[2], &stray).unwrap();
    // a leftover temporary file of an unfinished write
    let tmp = paths[3].with_extension("obj.tmp.77");
    std::fs::write(&tmp, b"partial").unwrap();
    let b = FilePerKeyBackend::open(env.path(), env.opts()).unwrap();
    assert_eq!(keys_of(&b), ["k3"]);
    assert_eq!(b.load_vec("k3").unwrap(), vals[3].1);
    for k in ["k0", "k1", "k2"] {
        assert!(b.load_vec(k).unwrap_err().is_not_found());
    }
    assert!(!paths[0].exists() && !paths[1].exists() && !stray.exists() && !tmp.exists(), "garbage removed");
    // the damaged keys can be written again
    b.offload("k0", b"fresh").unwrap();
    assert_eq!(b.load_vec("k0").unwrap(), b"fresh");
}

fn fpk_bit_rot(env: &Env) {
    let x = value("x", 9000);
    let b = FilePerKeyBackend::open(env.path(), env.opts()).unwrap();
    b.offload("x", &x).unwrap();
    let p = b.path_for("x");
    drop(b);
    flip_byte(&p, 4096 + 100);
    let b = FilePerKeyBackend::open(env.path(), env.opts()).unwrap();
    assert!(matches!(b.load_vec("x"), Err(StorageError::Corrupted { .. })));
}

fn offset_partial_and_corrupt_records(env: &Env) {
    let size = 16 << 20;
    let vals: Vec<(String, Vec<u8>)> = (0..4).map(|i| (format!("k{i}"), value(&format!("k{i}"), 50_000))).collect();
    let (offs, path) = {
        let b = OffsetAllocatorBackend::open(env.path(), size, env.opts()).unwrap();
        for (k, v) in &vals {
            b.offload(k, v).unwrap();
        }
        (vals.iter().map(|(k, _)| b.record_offset(k).unwrap()).collect::<Vec<_>>(), b.data_file_path().to_owned())
    };
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    // k0: partial record — the tail of its value never reached the disk
    f.write_all_at(&vec![0u8; 20_000], offs[0] + 4096 + 30_000).unwrap();
    // k1: corrupt header
    f.write_all_at(&[0xFF; 4], offs[1] + 8).unwrap();
    // k2: only the header made it (value all zeros)
    f.write_all_at(&vec![0u8; 50_000], offs[2] + 4096).unwrap();
    f.sync_all().unwrap();
    drop(f);
    let b = OffsetAllocatorBackend::open(env.path(), size, env.opts()).unwrap();
    assert_eq!(keys_of(&b), ["k3"]);
    assert_eq!(b.load_vec("k3").unwrap(), vals[3].1);
    assert!(b.load_vec("k0").unwrap_err().is_not_found());
    // the space of the damaged records is free again
    let big = value("big", 3 * 50_000);
    b.offload("big", &big).unwrap();
    b.offload("k0", &vals[0].1).unwrap();
    drop(b);
    let b = OffsetAllocatorBackend::open(env.path(), size, env.opts()).unwrap();
    assert_eq!(keys_of(&b), ["big", "k0", "k3"]);
    assert_eq!(b.load_vec("big").unwrap(), big);
    assert_eq!(b.load_vec("k0").unwrap(), vals[0].1);
    // removal wipes the record: it does not come back
    b.remove("k3").unwrap();
    drop(b);
    let b = OffsetAllocatorBackend::open(env.path(), size, env.opts()).unwrap();
    assert_eq!(keys_of(&b), ["big", "k0"]);
}

fn offset_bit_rot(env: &Env) {
    let x = value("x", 9000);
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    b.offload("x", &x).unwrap();
    let off = b.record_offset("x").unwrap();
    let path = b.data_file_path().to_owned();
    flip_byte(&path, off + 4096 + 10);
    // the open backend reads the rotten bytes: an error, not the bytes
    let mut buf = vec![0u8; 9000];
    assert!(matches!(b.load("x", &mut buf), Err(StorageError::Corrupted { .. })));
    drop(b);
    // a reopen drops the record (value checksum fails the scan)
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    assert!(keys_of(&b).is_empty());
}

fn bucket_newest_copy_wins(env: &Env) {
    let (old, new, other) = (value("old", 5000), value("new", 5000), value("other", 5000));
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    b.batch_offload(&[("k", &old[..]), ("other", &other[..])]);
    let first = b.bucket_of("k").unwrap();
    let meta = b.meta_file_path(first);
    let saved = std::fs::read(&meta).unwrap();
    b.remove("k").unwrap();
    b.offload("k", &new).unwrap();
    let second = b.bucket_of("k").unwrap();
    assert!(second > first);
    drop(b);
    // The removal from the first bucket never reached the disk (a crash).
    std::fs::write(&meta, saved).unwrap();
    for _ in 0..2 {
        let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
        assert_eq!(b.bucket_of("k"), Some(second), "the newer bucket's copy wins");
        assert_eq!(b.load_vec("k").unwrap(), new);
        assert_eq!(b.load_vec("other").unwrap(), other);
    }
}

fn bucket_unreadable_meta_is_left_on_disk(env: &Env) {
    let x = value("x", 5000);
    let (meta, data) = {
        let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
        b.offload("x", &x).unwrap();
        let id = b.bucket_of("x").unwrap();
        (b.meta_file_path(id), b.data_file_path(id))
    };
    // Reading the meta file fails with an I/O error (EISDIR), not a failed check.
    let saved = std::fs::read(&meta).unwrap();
    std::fs::remove_file(&meta).unwrap();
    std::fs::create_dir(&meta).unwrap();
    {
        let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
        assert!(keys_of(&b).is_empty(), "not served while unreadable");
        assert!(data.exists(), "an I/O error deletes nothing");
        b.offload("y", b"yy").unwrap();
    }
    std::fs::remove_dir(&meta).unwrap();
    std::fs::write(&meta, saved).unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["x", "y"]);
    assert_eq!(b.load_vec("x").unwrap(), x);
}

fn bucket_failed_remove_keeps_the_object(env: &Env) {
    let (a, b2, c) = (value("a", 5000), value("b", 5000), value("c", 5000));
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    b.batch_offload(&[("a", &a[..]), ("b", &b2[..])]);
    b.offload("c", &c).unwrap();
    {
        let Some(_frozen) = Immutable::set(env.path()) else { return };
        // "a" shares its bucket: the meta file cannot be rewritten.
        assert!(b.remove("a").is_err());
        // "c" is alone: its meta file cannot be deleted.
        assert!(b.remove("c").is_err());
        assert_eq!(b.load_vec("a").unwrap(), a, "a failed remove leaves the object stored");
        assert_eq!(b.load_vec("c").unwrap(), c);
        assert_eq!(keys_of(&b), ["a", "b", "c"]);
    }
    b.remove("a").unwrap();
    b.remove("c").unwrap();
    drop(b);
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["b"]);
}

fn fpk_failed_remove_keeps_the_object(env: &Env) {
    let x = value("x", 9000);
    let b = FilePerKeyBackend::open(env.path(), env.opts()).unwrap();
    b.offload("x", &x).unwrap();
    let dir = b.path_for("x").parent().unwrap().to_owned();
    {
        let Some(_frozen) = Immutable::set(&dir) else { return };
        assert!(b.remove("x").is_err(), "the file cannot be unlinked: the remove fails");
        assert_eq!(b.load_vec("x").unwrap(), x, "a failed remove leaves the object stored");
        assert_eq!(keys_of(&b), ["x"]);
    }
    b.remove("x").unwrap();
    drop(b);
    let b = FilePerKeyBackend::open(env.path(), env.opts()).unwrap();
    assert!(keys_of(&b).is_empty());
}

fn offset_failed_remove_keeps_the_object(env: &Env) {
    let x = value("x", 9000);
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    b.offload("x", &x).unwrap();
    {
        let Some(_frozen) = Immutable::set(b.data_file_path()) else { return };
        assert!(b.remove("x").is_err(), "the record cannot be wiped: the remove fails");
        assert_eq!(b.load_vec("x").unwrap(), x, "a failed remove leaves the object stored");
    }
    b.remove("x").unwrap();
    drop(b);
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    assert!(keys_of(&b).is_empty());
}

/// A record as an older build wrote it (an unbound header, version 2 with a
/// generation or 1 without), padded to 4 KiB, then its value.
fn unbound_record(key: &str, value: &[u8], seq: u64, generation: Option<u64>) -> Vec<u8> {
    let h = RecordHeader {
        key: key.into(),
        value_len: value.len() as u64,
        value_crc: crc32c::crc32c(value),
        seq,
        generation,
    };
    let mut out = h.encode();
    out.resize(h.value_offset() as usize, 0);
    out.extend_from_slice(value);
    out
}

/// A value whose bytes hold complete records (headers at 4 KiB boundaries of the
/// file, with their values) stays a value: once it is removed, a reopen finds none
/// of them; nor while it is stored.
fn offset_records_inside_removed_values_stay_values(env: &Env) {
    let mut outer = value("outer", 64 << 10);
    // The outer record's value starts 4 KiB into the file; these lie at 12 KiB and
    // 36 KiB of the file.
    let forged = unbound_record("forged", &value("forged", 5000), u64::MAX, Some(u64::MAX));
    outer[8192..8192 + forged.len()].copy_from_slice(&forged);
    let old = unbound_record("old", &value("old", 100), 1, None);
    outer[32768..32768 + old.len()].copy_from_slice(&old);
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    b.offload("outer", &outer).unwrap();
    assert_eq!(b.record_offset("outer"), Some(0));
    drop(b);
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    assert_eq!(keys_of(&b), ["outer"]);
    assert_eq!(b.load_vec("outer").unwrap(), outer);
    b.remove("outer").unwrap();
    drop(b);
    for _ in 0..2 {
        let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
        assert!(keys_of(&b).is_empty(), "records inside a removed value came back: {:?}", keys_of(&b));
        assert!(b.load_vec("forged").unwrap_err().is_not_found());
    }
}

/// A data file written before records were bound to their places (no format file)
/// is read whole, its records bound in place, and from then on only bound records
/// count: an unbound header found later (a value's bytes) is not one.
fn offset_files_of_unbound_records_are_read_and_bound(env: &Env) {
    let (a, c) = (value("a", 10_000), value("c", 3000));
    let data = env.path().join("kv_cache.data");
    {
        let f = OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&data).unwrap();
        f.set_len(1 << 20).unwrap();
        f.write_all_at(&unbound_record("a", &a, 1, Some(5)), 0).unwrap();
        // The largest sequence number there is: the next one saturates, no overflow.
        f.write_all_at(&unbound_record("c", &c, u64::MAX, None), 64 << 10).unwrap();
        f.sync_all().unwrap();
    }
    assert!(!env.path().join("kv_cache.format").exists());
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    assert_eq!(keys_of(&b), ["a", "c"]);
    assert_eq!(b.load_vec("a").unwrap(), a);
    assert_eq!(b.load_vec("c").unwrap(), c);
    assert_eq!(b.object_meta("a").unwrap().generation, 5);
    assert!(env.path().join("kv_cache.format").exists(), "the file's records are bound now");
    drop(b);
    // A record header that is not bound, where a value of a removed object was.
    let f = OpenOptions::new().write(true).open(&data).unwrap();
    f.write_all_at(&unbound_record("planted", &value("planted", 100), 9, Some(9)), 256 << 10).unwrap();
    f.sync_all().unwrap();
    drop(f);
    for _ in 0..2 {
        let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
        assert_eq!(keys_of(&b), ["a", "c"]);
        assert_eq!(b.load_vec("a").unwrap(), a);
        assert_eq!(b.load_vec("c").unwrap(), c);
    }
}

/// A format file this build cannot read refuses the open (its records cannot be told
/// from a value's bytes) and leaves the data file as it was.
fn offset_unreadable_format_file_refuses_the_open(env: &Env) {
    let x = value("x", 9000);
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    b.offload("x", &x).unwrap();
    drop(b);
    let format = env.path().join("kv_cache.format");
    let good = std::fs::read(&format).unwrap();
    let mut bad = good.clone();
    bad[13] ^= 1;
    std::fs::write(&format, &bad).unwrap();
    let Err(err) = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()) else {
        panic!("opened with an unreadable format file")
    };
    assert!(matches!(err, StorageError::Corrupted { .. }), "{err}");
    assert!(err.to_string().contains("kv_cache.format"), "{err}");
    std::fs::write(&format, &good).unwrap();
    let b = OffsetAllocatorBackend::open(env.path(), 1 << 20, env.opts()).unwrap();
    assert_eq!(b.load_vec("x").unwrap(), x);
}

/// Offloads "x" and "y" (3000 bytes each) to a bucket backend at `env`, closed
/// again; the meta and data files of the bucket of "x".
fn x_and_y_offloaded(env: &Env) -> (std::path::PathBuf, std::path::PathBuf) {
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    b.offload("x", &value("x", 3000)).unwrap();
    b.offload("y", &value("y", 3000)).unwrap();
    let id = b.bucket_of("x").unwrap();
    (b.meta_file_path(id), b.data_file_path(id))
}

/// A meta file whose checksum holds but whose data length no file can have (its
/// rounding up to 4 KiB overflows) makes its bucket garbage, without a panic.
fn bucket_absurd_data_length_is_garbage(env: &Env) {
    let (meta, data) = x_and_y_offloaded(env);
    let mut parsed = parse_bucket_meta(&std::fs::read(&meta).unwrap()).unwrap();
    parsed.data_len = u64::MAX - 100;
    std::fs::write(&meta, parsed.encode()).unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["y"]);
    assert!(b.load_vec("x").unwrap_err().is_not_found());
    assert!(!meta.exists() && !data.exists(), "garbage bucket removed");
}

/// A meta file larger than any bucket writes is not read whole: its bucket is left
/// on disk, not served, and the others are.
fn bucket_oversized_meta_is_not_read(env: &Env) {
    let (meta, data) = x_and_y_offloaded(env);
    OpenOptions::new().write(true).open(&meta).unwrap().set_len(1 << 40).unwrap();
    let b = BucketBackend::open(env.path(), env.opts(), BucketConfig::default()).unwrap();
    assert_eq!(keys_of(&b), ["y"]);
    assert!(meta.exists() && data.exists(), "left on disk");
}
