//! On-disk metadata formats and their parsers.
//!
//! Every parser here takes arbitrary bytes and returns
//! [`StorageError::Corrupted`] on anything it does not accept; none panics (they are
//! fuzzed by `fuzz/fuzz_targets/storage_meta.rs`). All integers are little-endian.
//!
//! The formats are described on [`BucketMeta`] and [`RecordHeader`].

use crate::error::{Result, StorageError};

/// Longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// Alignment of values on disk (and of `O_DIRECT` I/O).
pub(crate) const DISK_ALIGN: u64 = 4096;

const BUCKET_MAGIC: &[u8; 8] = b"MCBKMETA";
/// The version written. Version 1 (no generations) is still read: its entries have
/// generation 0, older than any the store hands out.
const BUCKET_VERSION: u32 = 2;
const BUCKET_FIXED: usize = 8 + 4 + 4 + 8 + 8 + 4;
/// Bytes of the smallest entry of a version-1 meta (a one-byte key); version 2 adds
/// 8 (the generation).
const ENTRY_MIN: usize = 4 + 1 + 8 + 8 + 4;

const HEADER_MAGIC: &[u8; 4] = b"MCOH";
/// Version 1: no generation; version 2: a generation before the header checksum;
/// version 3: version 2's layout, its checksum bound to where the record lies (see
/// [`RecordBinding`]).
const HEADER_VERSION_1: u16 = 1;
const HEADER_VERSION_2: u16 = 2;
const HEADER_VERSION_3: u16 = 3;
/// Bytes of the fixed part of a version-1 [`RecordHeader`] (before the key).
pub(crate) const RECORD_HEADER_FIXED_V1: usize = 36;
/// Bytes of the fixed part of a version-2 [`RecordHeader`] (before the key).
pub(crate) const RECORD_HEADER_FIXED: usize = 44;

/// `x` rounded up to a multiple of [`DISK_ALIGN`] (for lengths this process made
/// or checked: [`checked_align_up`] for lengths read from disk).
pub(crate) fn align_up(x: u64) -> u64 {
    x.div_ceil(DISK_ALIGN) * DISK_ALIGN
}

/// `x` rounded up to a multiple of [`DISK_ALIGN`]; `None` past `u64::MAX`.
pub(crate) fn checked_align_up(x: u64) -> Option<u64> {
    x.checked_next_multiple_of(DISK_ALIGN)
}

/// Longest data a bucket meta may name: no file is longer (`off_t` is signed).
pub const MAX_BUCKET_DATA_LEN: u64 = i64::MAX as u64;

/// Bytes of a bucket meta file holding `keys` entries with the longest keys: what a
/// bucket of at most `keys` objects writes, at most.
pub(crate) fn max_bucket_meta_len(keys: usize) -> u64 {
    const ENTRY_MAX: u64 = (ENTRY_MIN - 1 + MAX_KEY_LEN + 8) as u64;
    (BUCKET_FIXED as u64 + 4).saturating_add((keys as u64).saturating_mul(ENTRY_MAX))
}

/// Checks that a key is 1..=4096 bytes.
pub(crate) fn validate_key(key: &str) -> Result<()> {
    if key.is_empty() || key.len() > MAX_KEY_LEN {
        return Err(StorageError::InvalidArgument(format!("key length {} not in 1..={MAX_KEY_LEN}", key.len())));
    }
    Ok(())
}

/// One object of a bucket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketEntry {
    /// The object's key.
    pub key: String,
    /// Offset of the value in the bucket's data file.
    pub offset: u64,
    /// Length of the value.
    pub len: u64,
    /// crc32c of the value.
    pub checksum: u32,
    /// The object's generation, as the writer handed it (0: none; every entry of a
    /// version-1 meta file). See [`ObjectMeta::generation`](crate::ObjectMeta::generation).
    pub generation: u64,
}

/// The content of a bucket's `.meta` file.
///
/// Its format (integers little-endian):
///
/// ```text
/// magic      8 B   "MCBKMETA"
/// version    u32   2 (1 is still read)
/// flags      u32   0 (anything else is rejected)
/// bucket_id  u64
/// data_len   u64   length of the data the `.bucket` file must hold
///                  (at most [`MAX_BUCKET_DATA_LEN`])
/// count      u32   number of entries
/// count x {
///   key_len  u32   1..=4096
///   key      key_len bytes, UTF-8
///   offset   u64   of the value in the `.bucket` file
///   len      u64   of the value (>= 1)
///   checksum u32   crc32c of the value
///   generation u64 the object's generation (version 2 only; version 1 reads as 0)
/// }
/// crc        u32   crc32c of every byte before it
/// ```
/// Entries are sorted by offset, do not overlap, lie within `data_len`, and have
/// distinct keys. [`encode`](Self::encode) always writes version 2.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketMeta {
    /// The bucket's id (also its file name).
    pub bucket_id: u64,
    /// Bytes the data file must hold.
    pub data_len: u64,
    /// The objects, sorted by offset.
    pub entries: Vec<BucketEntry>,
}

impl BucketMeta {
    /// Serializes to the meta-file format (see [`BucketMeta`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            BUCKET_FIXED + 4 + self.entries.iter().map(|e| ENTRY_MIN + 8 - 1 + e.key.len()).sum::<usize>(),
        );
        out.extend_from_slice(BUCKET_MAGIC);
        out.extend_from_slice(&BUCKET_VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.bucket_id.to_le_bytes());
        out.extend_from_slice(&self.data_len.to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            out.extend_from_slice(&(e.key.len() as u32).to_le_bytes());
            out.extend_from_slice(e.key.as_bytes());
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
            out.extend_from_slice(&e.checksum.to_le_bytes());
            out.extend_from_slice(&e.generation.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }
}

/// A bounds-checked little-endian reader.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| {
            StorageError::corrupted(self.what, format!("truncated at byte {} (need {n} more)", self.pos))
        })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn key(&mut self, len: u32) -> Result<String> {
        if len == 0 || len as usize > MAX_KEY_LEN {
            return Err(StorageError::corrupted(self.what, format!("key length {len}")));
        }
        let b = self.take(len as usize)?;
        String::from_utf8(b.to_vec()).map_err(|_| StorageError::corrupted(self.what, "key is not UTF-8"))
    }
}

/// Parses a bucket meta file, checking its checksum and every invariant listed on
/// [`BucketMeta`]. Never panics.
pub fn parse_bucket_meta(bytes: &[u8]) -> Result<BucketMeta> {
    const WHAT: &str = "bucket meta";
    if bytes.len() < BUCKET_FIXED + 4 {
        return Err(StorageError::corrupted(WHAT, format!("{} bytes is too short", bytes.len())));
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let actual = crc32c::crc32c(body);
    if stored != actual {
        return Err(StorageError::corrupted(WHAT, format!("checksum {stored:#010x} != {actual:#010x}")));
    }
    let mut c = Cursor { bytes: body, pos: 0, what: WHAT };
    if c.take(8)? != BUCKET_MAGIC {
        return Err(StorageError::corrupted(WHAT, "bad magic"));
    }
    let version = c.u32()?;
    if version != 1 && version != BUCKET_VERSION {
        return Err(StorageError::corrupted(WHAT, format!("unknown version {version} (this build reads 1 and 2)")));
    }
    let entry_min = if version == 1 { ENTRY_MIN } else { ENTRY_MIN + 8 };
    let flags = c.u32()?;
    if flags != 0 {
        return Err(StorageError::corrupted(WHAT, format!("unknown flags {flags:#x}")));
    }
    let bucket_id = c.u64()?;
    let data_len = c.u64()?;
    if data_len > MAX_BUCKET_DATA_LEN {
        return Err(StorageError::corrupted(WHAT, format!("data length {data_len} exceeds any file")));
    }
    let count = c.u32()? as usize;
    if count > (body.len() - c.pos) / entry_min {
        return Err(StorageError::corrupted(WHAT, format!("{count} entries cannot fit")));
    }
    let mut entries = Vec::with_capacity(count);
    let mut keys = ahash::AHashSet::with_capacity(count);
    let mut end_prev = 0u64;
    for _ in 0..count {
        let key_len = c.u32()?;
        let key = c.key(key_len)?;
        let offset = c.u64()?;
        let len = c.u64()?;
        let checksum = c.u32()?;
        let generation = if version == 1 { 0 } else { c.u64()? };
        let end = offset.checked_add(len).ok_or_else(|| StorageError::corrupted(WHAT, "offset overflow"))?;
        if len == 0 || offset < end_prev || end > data_len {
            return Err(StorageError::corrupted(WHAT, format!("entry {key:?} at {offset}+{len} out of place")));
        }
        if !keys.insert(key.clone()) {
            return Err(StorageError::corrupted(WHAT, format!("duplicate key {key:?}")));
        }
        end_prev = end;
        entries.push(BucketEntry { key, offset, len, checksum, generation });
    }
    if c.pos != body.len() {
        return Err(StorageError::corrupted(WHAT, "trailing bytes"));
    }
    Ok(BucketMeta { bucket_id, data_len, entries })
}

/// The header in front of a value in file-per-key files and offset-allocator records:
/// a record is a header, its key, zero padding to 4 KiB, then the value.
///
/// Its format (integers little-endian):
///
/// ```text
/// magic      4 B   "MCOH"
/// version    u16   2 (1 is still read)
/// flags      u16   0 (anything else is rejected)
/// key_len    u32   1..=4096
/// value_crc  u32   crc32c of the value
/// value_len  u64   >= 1
/// seq        u64   write sequence number (newer wins on recovery)
/// generation u64   the object's generation (version 2 only)
/// header_crc u32   crc32c of the bytes above followed by the key
/// key        key_len bytes, UTF-8
/// padding    zeros up to the next 4 KiB boundary (value_offset)
/// value      value_len bytes
/// ```
/// The value starts 4 KiB-aligned so it can be read with `O_DIRECT` straight into an
/// aligned caller buffer.
///
/// Version 3 (written by the offset-allocator layout) has version 2's layout, but
/// its `header_crc` also covers a `RecordBinding` (a secret salt of the data file
/// and the record's offset in it) put before the header bytes: a header is valid only
/// at the place it was written, in the file it was written to, so bytes that look
/// like a record inside some value (a client's bytes) never pass for one. It is
/// parsed only with its binding (by its layout); [`parse_record_header`] refuses it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    /// The object's key.
    pub key: String,
    /// Length of the value.
    pub value_len: u64,
    /// crc32c of the value.
    pub value_crc: u32,
    /// Write sequence number: of two records of one key, the higher wins.
    pub seq: u64,
    /// The object's generation (see [`ObjectMeta::generation`](crate::ObjectMeta::generation));
    /// `None` for a version-1 header, which has no such field (and encodes without it).
    pub generation: Option<u64>,
}

impl RecordHeader {
    /// Bytes of the header and key, before padding.
    pub fn encoded_len(&self) -> usize {
        self.fixed_len() + self.key.len()
    }

    /// Bytes of the fixed part (before the key) in this header's version.
    fn fixed_len(&self) -> usize {
        if self.generation.is_some() {
            RECORD_HEADER_FIXED
        } else {
            RECORD_HEADER_FIXED_V1
        }
    }

    /// Offset of the value from the start of the header: the header and key rounded
    /// up to 4 KiB.
    pub fn value_offset(&self) -> u64 {
        align_up(self.encoded_len() as u64)
    }

    /// Total bytes of header, padding and value.
    pub fn record_len(&self) -> u64 {
        self.value_offset() + self.value_len
    }

    /// Serializes the header and key (no padding).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_with(None)
    }

    /// Serializes the header and key as a version-3 header bound to `binding` (a
    /// generation of 0 where there is none): the same layout and length as version
    /// 2.
    pub(crate) fn encode_bound(&self, binding: RecordBinding) -> Vec<u8> {
        RecordHeader { generation: Some(self.generation.unwrap_or(0)), ..self.clone() }.encode_with(Some(binding))
    }

    fn encode_with(&self, binding: Option<RecordBinding>) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.encoded_len());
        out.extend_from_slice(HEADER_MAGIC);
        let version = match (binding, self.generation) {
            (Some(_), _) => HEADER_VERSION_3,
            (None, Some(_)) => HEADER_VERSION_2,
            (None, None) => HEADER_VERSION_1,
        };
        out.extend_from_slice(&version.to_le_bytes());
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&(self.key.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.value_crc.to_le_bytes());
        out.extend_from_slice(&self.value_len.to_le_bytes());
        out.extend_from_slice(&self.seq.to_le_bytes());
        if let Some(g) = self.generation {
            out.extend_from_slice(&g.to_le_bytes());
        }
        let crc = crc32c::crc32c_append(header_crc_seed(binding, &out), self.key.as_bytes());
        out.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(self.key.as_bytes());
        out
    }
}

/// What a version-3 [`RecordHeader`]'s checksum is bound to: the salt of its data
/// file (random, kept beside the file, never sent anywhere) and the record's offset
/// in it. Without the salt no one can make a header that passes at any offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecordBinding {
    pub(crate) salt: u64,
    pub(crate) offset: u64,
}

/// The crc32c of a header's fixed bytes, after the binding's bytes for a bound one.
fn header_crc_seed(binding: Option<RecordBinding>, fixed: &[u8]) -> u32 {
    match binding {
        Some(b) => {
            let mut prefix = [0u8; 16];
            prefix[..8].copy_from_slice(&b.salt.to_le_bytes());
            prefix[8..].copy_from_slice(&b.offset.to_le_bytes());
            crc32c::crc32c_append(crc32c::crc32c(&prefix), fixed)
        }
        None => crc32c::crc32c(fixed),
    }
}

/// Whether `bytes` starts with a record-header magic (a cheap pre-check for scans).
pub(crate) fn has_record_header_magic(bytes: &[u8]) -> bool {
    bytes.len() >= 4 && &bytes[..4] == HEADER_MAGIC
}

/// Parses a record header from the start of `bytes` (which may continue with
/// padding and value): version 1 or 2 (a version-3 header is refused: it is valid
/// only with its binding). Never panics.
pub fn parse_record_header(bytes: &[u8]) -> Result<RecordHeader> {
    parse_header(bytes, None).map(|(h, _)| h)
}

/// Parses a record header found at `binding`'s offset of the data file whose salt
/// it names: a version-3 header must be bound to exactly that; versions 1 and 2
/// (bound to nothing) are parsed as [`parse_record_header`] does. Also says whether
/// the header was bound. Never panics.
pub(crate) fn parse_record_header_at(bytes: &[u8], binding: RecordBinding) -> Result<(RecordHeader, bool)> {
    parse_header(bytes, Some(binding))
}

fn parse_header(bytes: &[u8], binding: Option<RecordBinding>) -> Result<(RecordHeader, bool)> {
    const WHAT: &str = "record header";
    let mut c = Cursor { bytes, pos: 0, what: WHAT };
    if c.take(4)? != HEADER_MAGIC {
        return Err(StorageError::corrupted(WHAT, "bad magic"));
    }
    let version = c.u16()?;
    let bound = version == HEADER_VERSION_3;
    if bound && binding.is_none() {
        return Err(StorageError::corrupted(WHAT, "a version-3 header is valid only where its data file put it"));
    }
    if version != HEADER_VERSION_1 && version != HEADER_VERSION_2 && !bound {
        return Err(StorageError::corrupted(WHAT, format!("unknown version {version} (this build reads 1 to 3)")));
    }
    let flags = c.u16()?;
    if flags != 0 {
        return Err(StorageError::corrupted(WHAT, format!("unknown flags {flags:#x}")));
    }
    let key_len = c.u32()?;
    let value_crc = c.u32()?;
    let value_len = c.u64()?;
    let seq = c.u64()?;
    let generation = if version == HEADER_VERSION_1 { None } else { Some(c.u64()?) };
    let fixed = c.pos + 4;
    let stored = c.u32()?;
    if key_len == 0 || key_len as usize > MAX_KEY_LEN {
        return Err(StorageError::corrupted(WHAT, format!("key length {key_len}")));
    }
    let key_bytes = c.take(key_len as usize)?;
    let seed = header_crc_seed(binding.filter(|_| bound), &bytes[..fixed - 4]);
    let actual = crc32c::crc32c_append(seed, key_bytes);
    if stored != actual {
        return Err(StorageError::corrupted(WHAT, format!("checksum {stored:#010x} != {actual:#010x}")));
    }
    if value_len == 0 || value_len > u64::MAX / 2 {
        return Err(StorageError::corrupted(WHAT, format!("value length {value_len}")));
    }
    let key = String::from_utf8(key_bytes.to_vec()).map_err(|_| StorageError::corrupted(WHAT, "key is not UTF-8"))?;
    Ok((RecordHeader { key, value_len, value_crc, seq, generation }, bound))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn meta_strategy() -> impl Strategy<Value = BucketMeta> {
        (
            any::<u64>(),
            proptest::collection::vec(
                ("[a-z0-9/é]{1,40}", 1u64..100_000, any::<u32>(), 0u64..5000, any::<u64>()),
                0..20,
            ),
        )
            .prop_map(|(bucket_id, raw)| {
                let mut offset = 0;
                let mut seen = std::collections::HashSet::new();
                let mut entries = Vec::new();
                for (key, len, checksum, gap, generation) in raw {
                    if !seen.insert(key.clone()) {
                        continue;
                    }
                    offset += gap;
                    entries.push(BucketEntry { key, offset, len, checksum, generation });
                    offset += len;
                }
                BucketMeta { bucket_id, data_len: offset, entries }
            })
    }

    proptest! {
        #[test]
        fn bucket_meta_roundtrip(meta in meta_strategy()) {
            let bytes = meta.encode();
            prop_assert_eq!(parse_bucket_meta(&bytes).unwrap(), meta);
        }

        #[test]
        fn bucket_meta_corruption_is_an_error(meta in meta_strategy(), pos in any::<usize>(), flip in 1u8..=255) {
            let mut bytes = meta.encode();
            let i = pos % bytes.len();
            bytes[i] ^= flip;
            prop_assert!(parse_bucket_meta(&bytes).is_err());
        }

        #[test]
        fn bucket_meta_truncation_is_an_error(meta in meta_strategy(), cut in any::<usize>()) {
            let bytes = meta.encode();
            let n = cut % bytes.len();
            prop_assert!(parse_bucket_meta(&bytes[..n]).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_bucket_meta(&bytes);
            let _ = parse_record_header(&bytes);
        }

        #[test]
        fn record_header_roundtrip(key in "[a-zA-Z0-9_]{1,300}", value_len in 1u64..(1 << 40), value_crc in any::<u32>(), seq in any::<u64>(), generation in proptest::option::of(any::<u64>()), flip_at in any::<usize>(), flip in 1u8..=255) {
            let h = RecordHeader { key, value_len, value_crc, seq, generation };
            let mut bytes = h.encode();
            bytes.resize(h.value_offset() as usize, 0);
            prop_assert_eq!(parse_record_header(&bytes).unwrap(), h.clone());
            let i = flip_at % h.encoded_len();
            bytes[i] ^= flip;
            prop_assert!(parse_record_header(&bytes).is_err());
        }
    }

    proptest! {
        /// A bound header parses only at its own offset under its own salt; the
        /// plain parser refuses it; it is as long as a version-2 header.
        #[test]
        fn bound_headers_are_valid_only_where_they_were_written(key in "[a-z0-9]{1,64}", value_len in 1u64..(1 << 40), seq in any::<u64>(), generation in any::<u64>(), salt in any::<u64>(), offset in any::<u64>(), other in any::<u64>()) {
            let h = RecordHeader { key, value_len, value_crc: 7, seq, generation: Some(generation) };
            let binding = RecordBinding { salt, offset };
            let bytes = h.encode_bound(binding);
            prop_assert_eq!(bytes.len(), h.encode().len());
            prop_assert_eq!(parse_record_header_at(&bytes, binding).unwrap(), (h.clone(), true));
            prop_assert!(parse_record_header(&bytes).is_err());
            if other != offset {
                let moved = RecordBinding { salt, offset: other };
                prop_assert!(parse_record_header_at(&bytes, moved).is_err());
            }
            if other != salt {
                let other_file = RecordBinding { salt: other, offset };
                prop_assert!(parse_record_header_at(&bytes, other_file).is_err());
            }
            // An unbound header still parses where a binding is known, as unbound.
            prop_assert_eq!(parse_record_header_at(&h.encode(), binding).unwrap(), (h, false));
        }
    }

    /// A data length no file can have is refused (rounding it up to 4 KiB would
    /// overflow); the longest possible one is accepted and rounds up.
    #[test]
    fn absurd_data_lengths_are_refused() {
        for data_len in [u64::MAX, u64::MAX - 4095, MAX_BUCKET_DATA_LEN + 1] {
            let meta = BucketMeta { bucket_id: 1, data_len, entries: vec![] };
            let err = parse_bucket_meta(&meta.encode()).unwrap_err().to_string();
            assert!(err.contains("exceeds any file"), "{err}");
        }
        let meta = BucketMeta { bucket_id: 1, data_len: MAX_BUCKET_DATA_LEN, entries: vec![] };
        let parsed = parse_bucket_meta(&meta.encode()).unwrap();
        assert!(checked_align_up(parsed.data_len).is_some());
        assert_eq!(checked_align_up(u64::MAX), None);
        assert_eq!(checked_align_up(4097), Some(8192));
        let most = BucketMeta {
            bucket_id: 1,
            data_len: 3,
            entries: (0..3u8)
                .map(|i| BucketEntry {
                    key: String::from_utf8(vec![b'a' + i; MAX_KEY_LEN]).unwrap(),
                    offset: i as u64,
                    len: 1,
                    checksum: 0,
                    generation: 0,
                })
                .collect(),
        };
        assert_eq!(most.encode().len() as u64, max_bucket_meta_len(3));
    }

    #[test]
    fn checksum_valid_but_inconsistent_meta_is_rejected() {
        // overlapping entries with a correct file checksum
        let meta = BucketMeta {
            bucket_id: 1,
            data_len: 100,
            entries: vec![
                BucketEntry { key: "a".into(), offset: 0, len: 60, checksum: 0, generation: 0 },
                BucketEntry { key: "b".into(), offset: 50, len: 10, checksum: 0, generation: 0 },
            ],
        };
        assert!(parse_bucket_meta(&meta.encode()).is_err());
        let meta = BucketMeta {
            bucket_id: 1,
            data_len: 10,
            entries: vec![BucketEntry { key: "a".into(), offset: 0, len: 60, checksum: 0, generation: 0 }],
        };
        assert!(parse_bucket_meta(&meta.encode()).is_err());
        let meta = BucketMeta {
            bucket_id: 1,
            data_len: 100,
            entries: vec![
                BucketEntry { key: "a".into(), offset: 0, len: 1, checksum: 0, generation: 0 },
                BucketEntry { key: "a".into(), offset: 1, len: 1, checksum: 0, generation: 0 },
            ],
        };
        assert!(parse_bucket_meta(&meta.encode()).is_err());
    }

    /// A version-1 meta file (written before generations existed), byte for byte.
    fn bucket_meta_v1(meta: &BucketMeta) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(BUCKET_MAGIC);
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&meta.bucket_id.to_le_bytes());
        out.extend_from_slice(&meta.data_len.to_le_bytes());
        out.extend_from_slice(&(meta.entries.len() as u32).to_le_bytes());
        for e in &meta.entries {
            out.extend_from_slice(&(e.key.len() as u32).to_le_bytes());
            out.extend_from_slice(e.key.as_bytes());
            out.extend_from_slice(&e.offset.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
            out.extend_from_slice(&e.checksum.to_le_bytes());
        }
        let crc = crc32c::crc32c(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    #[test]
    fn version_1_files_read_with_generation_0() {
        let meta = BucketMeta {
            bucket_id: 7,
            data_len: 8192,
            entries: vec![
                BucketEntry { key: "a".into(), offset: 0, len: 10, checksum: 1, generation: 0 },
                BucketEntry { key: "b".into(), offset: 4096, len: 20, checksum: 2, generation: 0 },
            ],
        };
        let v1 = bucket_meta_v1(&meta);
        assert_eq!(parse_bucket_meta(&v1).unwrap(), meta);
        // Re-encoded, it becomes version 2 with the same content.
        let v2 = meta.encode();
        assert_eq!(u32::from_le_bytes(v2[8..12].try_into().unwrap()), 2);
        assert_eq!(parse_bucket_meta(&v2).unwrap(), meta);
        // A version this build does not know is an error that says so, not a panic.
        let mut v9 = v1.clone();
        v9[8..12].copy_from_slice(&9u32.to_le_bytes());
        let n = v9.len() - 4;
        let crc = crc32c::crc32c(&v9[..n]);
        v9[n..].copy_from_slice(&crc.to_le_bytes());
        let err = parse_bucket_meta(&v9).unwrap_err().to_string();
        assert!(err.contains("unknown version 9"), "{err}");

        let h1 = RecordHeader { key: "k".into(), value_len: 5, value_crc: 3, seq: 4, generation: None };
        let bytes = h1.encode();
        assert_eq!(bytes.len(), RECORD_HEADER_FIXED_V1 + 1);
        assert_eq!(u16::from_le_bytes([bytes[4], bytes[5]]), 1);
        assert_eq!(parse_record_header(&bytes).unwrap(), h1);
        let h2 = RecordHeader { generation: Some(99), ..h1 };
        let bytes = h2.encode();
        assert_eq!(bytes.len(), RECORD_HEADER_FIXED + 1);
        assert_eq!(parse_record_header(&bytes).unwrap(), h2);
    }
}
