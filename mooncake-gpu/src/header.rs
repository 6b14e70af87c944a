//! The 128-byte object header that lives in the owner heap next to the payload.
//!
//! The layout is documented on [`DeviceObjectHeader`].

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Version written into `header_version` by this crate.
pub const HEADER_VERSION: u32 = 1;

/// Size of one header in bytes.
pub const HEADER_SIZE: usize = 128;

/// Seed of the second key fingerprint stored in `key_fp_hi`.
///
/// The reference stores the high half of an xxh128; we store an independent
/// xxh64 with this seed, which gives the same 128-bit collision guard.
pub const KEY_FP_SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// Byte offsets of the header fields (the device kernels use these).
pub mod header_offsets {
    /// `key_hash: u64`
    pub const KEY_HASH: usize = 0;
    /// `key_fp_hi: u64`
    pub const KEY_FP_HI: usize = 8;
    /// `key_len: u32`
    pub const KEY_LEN: usize = 16;
    /// `header_version: u32`
    pub const HEADER_VERSION: usize = 20;
    /// `payload_base: u64`
    pub const PAYLOAD_BASE: usize = 24;
    /// `bytes_total: u64`
    pub const BYTES_TOTAL: usize = 32;
    /// `page_size: u32`
    pub const PAGE_SIZE: usize = 40;
    /// `n_pages: u32`
    pub const N_PAGES: usize = 44;
    /// `last_page_bytes: u32`
    pub const LAST_PAGE_BYTES: usize = 48;
    /// `epoch: u32`
    pub const EPOCH: usize = 52;
    /// `state: u32`
    pub const STATE: usize = 56;
    /// `reader_refcnt: u32`
    pub const READER_REFCNT: usize = 60;
    /// `state_ts: u64`
    pub const STATE_TS: usize = 64;
    /// `last_access: u64`
    pub const LAST_ACCESS: usize = 72;
    /// `flags: u32`
    pub const FLAGS: usize = 80;
    /// `_pad: u32`
    pub const PAD: usize = 84;
}

/// Life-cycle state of an object header (`state` field).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ObjectState {
    /// Slot claimed by the control plane, header being initialised.
    Reserved = 0,
    /// Plan handed out; a producer is writing pages.
    Writing = 1,
    /// Published: all pages written, readable, immutable.
    Ready = 2,
    /// Retired (removed, evicted or reclaimed); the slot may be reused.
    Dead = 3,
}

impl ObjectState {
    /// Decodes a raw `state` value; `None` for values outside 0..=3.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Reserved),
            1 => Some(Self::Writing),
            2 => Some(Self::Ready),
            3 => Some(Self::Dead),
            _ => None,
        }
    }

    /// The raw value stored in the header.
    pub fn as_u32(self) -> u32 {
        self as u32
    }
}

/// A 32-bit header field that can be accessed atomically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderU32Field {
    /// `key_len`
    KeyLen,
    /// `header_version`
    HeaderVersion,
    /// `page_size`
    PageSize,
    /// `n_pages`
    NPages,
    /// `last_page_bytes`
    LastPageBytes,
    /// `epoch`
    Epoch,
    /// `state`
    State,
    /// `reader_refcnt`
    ReaderRefcnt,
    /// `flags`
    Flags,
}

impl HeaderU32Field {
    /// Byte offset of the field inside the header.
    pub fn offset(self) -> usize {
        match self {
            Self::KeyLen => header_offsets::KEY_LEN,
            Self::HeaderVersion => header_offsets::HEADER_VERSION,
            Self::PageSize => header_offsets::PAGE_SIZE,
            Self::NPages => header_offsets::N_PAGES,
            Self::LastPageBytes => header_offsets::LAST_PAGE_BYTES,
            Self::Epoch => header_offsets::EPOCH,
            Self::State => header_offsets::STATE,
            Self::ReaderRefcnt => header_offsets::READER_REFCNT,
            Self::Flags => header_offsets::FLAGS,
        }
    }
}

/// A 64-bit header field that can be accessed atomically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HeaderU64Field {
    /// `key_hash`
    KeyHash,
    /// `key_fp_hi`
    KeyFpHi,
    /// `payload_base`
    PayloadBase,
    /// `bytes_total`
    BytesTotal,
    /// `state_ts`
    StateTs,
    /// `last_access`
    LastAccess,
}

impl HeaderU64Field {
    /// Byte offset of the field inside the header.
    pub fn offset(self) -> usize {
        match self {
            Self::KeyHash => header_offsets::KEY_HASH,
            Self::KeyFpHi => header_offsets::KEY_FP_HI,
            Self::PayloadBase => header_offsets::PAYLOAD_BASE,
            Self::BytesTotal => header_offsets::BYTES_TOTAL,
            Self::StateTs => header_offsets::STATE_TS,
            Self::LastAccess => header_offsets::LAST_ACCESS,
        }
    }
}

/// The in-heap object header: 128 bytes, `#[repr(C, align(128))]`.
/// [`HeaderSnapshot`] is the plain (non-atomic) copy of the same bytes; the
/// offsets are also in [`header_offsets`].
///
/// Layout (byte offsets, little-endian, all fields naturally aligned):
///
/// | offset | field             | type | notes                                        |
/// |-------:|-------------------|------|----------------------------------------------|
/// |      0 | `key_hash`        | u64  | `xxh64(key, 0)`                              |
/// |      8 | `key_fp_hi`       | u64  | second fingerprint, `xxh64(key, KEY_FP_SEED)` |
/// |     16 | `key_len`         | u32  | key length in bytes                          |
/// |     20 | `header_version`  | u32  | [`HEADER_VERSION`]                           |
/// |     24 | `payload_base`    | u64  | payload offset inside the heap's arena       |
/// |     32 | `bytes_total`     | u64  | object size in bytes                         |
/// |     40 | `page_size`       | u32  | bytes per page                               |
/// |     44 | `n_pages`         | u32  | number of pages                              |
/// |     48 | `last_page_bytes` | u32  | valid bytes of the final page (tail clamp)   |
/// |     52 | `epoch`           | u32  | bumped every time the slot is reused         |
/// |     56 | `state`           | u32  | [`ObjectState`]; the publish flag            |
/// |     60 | `reader_refcnt`   | u32  | readers currently copying the payload        |
/// |     64 | `state_ts`        | u64  | ns timestamp of the last state change        |
/// |     72 | `last_access`     | u64  | ns timestamp of the last read/touch          |
/// |     80 | `flags`           | u32  | reserved, 0                                  |
/// |     84 | `_pad`            | u32  | 0                                            |
/// |  88..128 | reserved        |      | zero, pads the header to 128 bytes           |
///
/// The reference asks for 64-byte alignment; we align to 128 so that one header
/// never shares a 128-byte L2 sector pair with its neighbour.
///
/// Every field is an atomic here because the same header is read
/// by readers while a writer may (after a reclaim) re-initialise it; the fields
/// other than `state` and `reader_refcnt` are accessed with `Relaxed` ordering and
/// are ordered by the `state` release/acquire pair. On the device the same bytes
/// are plain memory accessed with `ld/st` and `atom.*.sys`.
#[repr(C, align(128))]
#[derive(Debug, Default)]
pub struct DeviceObjectHeader {
    /// `xxh64(key, 0)`.
    pub key_hash: AtomicU64,
    /// Second fingerprint of the key, `xxh64(key, KEY_FP_SEED)`.
    pub key_fp_hi: AtomicU64,
    /// Key length in bytes.
    pub key_len: AtomicU32,
    /// [`HEADER_VERSION`].
    pub header_version: AtomicU32,
    /// Payload offset of page 0 inside the heap's payload arena.
    pub payload_base: AtomicU64,
    /// Object size in bytes.
    pub bytes_total: AtomicU64,
    /// Bytes per page.
    pub page_size: AtomicU32,
    /// Number of pages.
    pub n_pages: AtomicU32,
    /// Valid bytes in the last page (1..=page_size).
    pub last_page_bytes: AtomicU32,
    /// Generation of this slot; bumped on every reuse.
    pub epoch: AtomicU32,
    /// [`ObjectState`] as u32.
    pub state: AtomicU32,
    /// Number of readers currently copying the payload.
    pub reader_refcnt: AtomicU32,
    /// Timestamp (ns, owner clock) of the last state change.
    pub state_ts: AtomicU64,
    /// Timestamp (ns, owner clock) of the last read or touch.
    pub last_access: AtomicU64,
    /// Reserved flags, 0.
    pub flags: AtomicU32,
    /// Padding, 0.
    pub _pad: AtomicU32,
    _reserved: [u64; 5],
}

/// A plain copy of an [`DeviceObjectHeader`] (same layout, same 128 bytes).
#[repr(C, align(128))]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct HeaderSnapshot {
    /// `xxh64(key, 0)`.
    pub key_hash: u64,
    /// Second fingerprint of the key.
    pub key_fp_hi: u64,
    /// Key length in bytes.
    pub key_len: u32,
    /// Header layout version.
    pub header_version: u32,
    /// Payload offset of page 0 inside the heap's payload arena.
    pub payload_base: u64,
    /// Object size in bytes.
    pub bytes_total: u64,
    /// Bytes per page.
    pub page_size: u32,
    /// Number of pages.
    pub n_pages: u32,
    /// Valid bytes in the last page.
    pub last_page_bytes: u32,
    /// Slot generation.
    pub epoch: u32,
    /// Raw [`ObjectState`].
    pub state: u32,
    /// Readers currently copying.
    pub reader_refcnt: u32,
    /// Timestamp of the last state change (ns).
    pub state_ts: u64,
    /// Timestamp of the last access (ns).
    pub last_access: u64,
    /// Reserved flags.
    pub flags: u32,
    /// Padding.
    pub _pad: u32,
    /// Reserved, zero.
    pub _reserved: [u64; 5],
}

macro_rules! assert_layout {
    ($t:ty) => {
        const _: () = {
            use core::mem::{align_of, offset_of, size_of};
            assert!(size_of::<$t>() == HEADER_SIZE);
            assert!(align_of::<$t>() == 128);
            assert!(offset_of!($t, key_hash) == header_offsets::KEY_HASH);
            assert!(offset_of!($t, key_fp_hi) == header_offsets::KEY_FP_HI);
            assert!(offset_of!($t, key_len) == header_offsets::KEY_LEN);
            assert!(offset_of!($t, header_version) == header_offsets::HEADER_VERSION);
            assert!(offset_of!($t, payload_base) == header_offsets::PAYLOAD_BASE);
            assert!(offset_of!($t, bytes_total) == header_offsets::BYTES_TOTAL);
            assert!(offset_of!($t, page_size) == header_offsets::PAGE_SIZE);
            assert!(offset_of!($t, n_pages) == header_offsets::N_PAGES);
            assert!(offset_of!($t, last_page_bytes) == header_offsets::LAST_PAGE_BYTES);
            assert!(offset_of!($t, epoch) == header_offsets::EPOCH);
            assert!(offset_of!($t, state) == header_offsets::STATE);
            assert!(offset_of!($t, reader_refcnt) == header_offsets::READER_REFCNT);
            assert!(offset_of!($t, state_ts) == header_offsets::STATE_TS);
            assert!(offset_of!($t, last_access) == header_offsets::LAST_ACCESS);
            assert!(offset_of!($t, flags) == header_offsets::FLAGS);
            assert!(offset_of!($t, _pad) == header_offsets::PAD);
        };
    };
}
assert_layout!(DeviceObjectHeader);
assert_layout!(HeaderSnapshot);

impl DeviceObjectHeader {
    /// The atomic behind a 32-bit field.
    pub fn u32_field(&self, f: HeaderU32Field) -> &AtomicU32 {
        match f {
            HeaderU32Field::KeyLen => &self.key_len,
            HeaderU32Field::HeaderVersion => &self.header_version,
            HeaderU32Field::PageSize => &self.page_size,
            HeaderU32Field::NPages => &self.n_pages,
            HeaderU32Field::LastPageBytes => &self.last_page_bytes,
            HeaderU32Field::Epoch => &self.epoch,
            HeaderU32Field::State => &self.state,
            HeaderU32Field::ReaderRefcnt => &self.reader_refcnt,
            HeaderU32Field::Flags => &self.flags,
        }
    }

    /// The atomic behind a 64-bit field.
    pub fn u64_field(&self, f: HeaderU64Field) -> &AtomicU64 {
        match f {
            HeaderU64Field::KeyHash => &self.key_hash,
            HeaderU64Field::KeyFpHi => &self.key_fp_hi,
            HeaderU64Field::PayloadBase => &self.payload_base,
            HeaderU64Field::BytesTotal => &self.bytes_total,
            HeaderU64Field::StateTs => &self.state_ts,
            HeaderU64Field::LastAccess => &self.last_access,
        }
    }

    /// Reads all fields: `state` with `Acquire` first, the rest `Relaxed`.
    pub fn snapshot(&self) -> HeaderSnapshot {
        let state = self.state.load(Ordering::Acquire);
        let r = Ordering::Relaxed;
        HeaderSnapshot {
            key_hash: self.key_hash.load(r),
            key_fp_hi: self.key_fp_hi.load(r),
            key_len: self.key_len.load(r),
            header_version: self.header_version.load(r),
            payload_base: self.payload_base.load(r),
            bytes_total: self.bytes_total.load(r),
            page_size: self.page_size.load(r),
            n_pages: self.n_pages.load(r),
            last_page_bytes: self.last_page_bytes.load(r),
            epoch: self.epoch.load(r),
            state,
            reader_refcnt: self.reader_refcnt.load(r),
            state_ts: self.state_ts.load(r),
            last_access: self.last_access.load(r),
            flags: self.flags.load(r),
            _pad: 0,
            _reserved: [0; 5],
        }
    }

    /// Writes every field of `h` except `state` and `reader_refcnt` (`Relaxed`),
    /// then stores `h.state` with `Release`, so a reader that acquires the new
    /// state sees the fields. `reader_refcnt` is left alone: it belongs to readers.
    pub fn store_from(&self, h: &HeaderSnapshot) {
        let r = Ordering::Relaxed;
        self.key_hash.store(h.key_hash, r);
        self.key_fp_hi.store(h.key_fp_hi, r);
        self.key_len.store(h.key_len, r);
        self.header_version.store(h.header_version, r);
        self.payload_base.store(h.payload_base, r);
        self.bytes_total.store(h.bytes_total, r);
        self.page_size.store(h.page_size, r);
        self.n_pages.store(h.n_pages, r);
        self.last_page_bytes.store(h.last_page_bytes, r);
        self.epoch.store(h.epoch, r);
        self.state_ts.store(h.state_ts, r);
        self.last_access.store(h.last_access, r);
        self.flags.store(h.flags, r);
        self.state.store(h.state, Ordering::Release);
    }
}

impl HeaderSnapshot {
    /// Decoded state; `None` for a corrupt value.
    pub fn object_state(&self) -> Option<ObjectState> {
        ObjectState::from_u32(self.state)
    }

    /// The 128 raw bytes (native endianness), as the device stores them.
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        let mut b = [0u8; HEADER_SIZE];
        let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
        put(header_offsets::KEY_HASH, &self.key_hash.to_ne_bytes());
        put(header_offsets::KEY_FP_HI, &self.key_fp_hi.to_ne_bytes());
        put(header_offsets::KEY_LEN, &self.key_len.to_ne_bytes());
        put(header_offsets::HEADER_VERSION, &self.header_version.to_ne_bytes());
        put(header_offsets::PAYLOAD_BASE, &self.payload_base.to_ne_bytes());
        put(header_offsets::BYTES_TOTAL, &self.bytes_total.to_ne_bytes());
        put(header_offsets::PAGE_SIZE, &self.page_size.to_ne_bytes());
        put(header_offsets::N_PAGES, &self.n_pages.to_ne_bytes());
        put(header_offsets::LAST_PAGE_BYTES, &self.last_page_bytes.to_ne_bytes());
        put(header_offsets::EPOCH, &self.epoch.to_ne_bytes());
        put(header_offsets::STATE, &self.state.to_ne_bytes());
        put(header_offsets::READER_REFCNT, &self.reader_refcnt.to_ne_bytes());
        put(header_offsets::STATE_TS, &self.state_ts.to_ne_bytes());
        put(header_offsets::LAST_ACCESS, &self.last_access.to_ne_bytes());
        put(header_offsets::FLAGS, &self.flags.to_ne_bytes());
        put(header_offsets::PAD, &self._pad.to_ne_bytes());
        b
    }

    /// Parses 128 raw bytes (native endianness).
    pub fn from_bytes(b: &[u8; HEADER_SIZE]) -> Self {
        let u64_at = |o: usize| u64::from_ne_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_ne_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        Self {
            key_hash: u64_at(header_offsets::KEY_HASH),
            key_fp_hi: u64_at(header_offsets::KEY_FP_HI),
            key_len: u32_at(header_offsets::KEY_LEN),
            header_version: u32_at(header_offsets::HEADER_VERSION),
            payload_base: u64_at(header_offsets::PAYLOAD_BASE),
            bytes_total: u64_at(header_offsets::BYTES_TOTAL),
            page_size: u32_at(header_offsets::PAGE_SIZE),
            n_pages: u32_at(header_offsets::N_PAGES),
            last_page_bytes: u32_at(header_offsets::LAST_PAGE_BYTES),
            epoch: u32_at(header_offsets::EPOCH),
            state: u32_at(header_offsets::STATE),
            reader_refcnt: u32_at(header_offsets::READER_REFCNT),
            state_ts: u64_at(header_offsets::STATE_TS),
            last_access: u64_at(header_offsets::LAST_ACCESS),
            flags: u32_at(header_offsets::FLAGS),
            _pad: u32_at(header_offsets::PAD),
            _reserved: [0; 5],
        }
    }
}
