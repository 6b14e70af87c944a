//! Device heaps: the memory an owner's objects live in (header slots + payload
//! arena), and [`HostHeap`], a host-memory emulation of device memory.
//!
//! The memory-ordering protocol is documented on [`DeviceHeap`].

mod host;

use std::sync::atomic::Ordering;

pub use host::{HostHeap, HOST_WORD};

use crate::error::{GpuError, Result};
use crate::header::{HeaderSnapshot, HeaderU32Field, HeaderU64Field, ObjectState};
use crate::key::KeyId;

/// Page geometry of one object inside a heap's payload arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageSpan {
    /// Offset of page 0 inside the payload arena.
    pub payload_base: u64,
    /// Object size in bytes.
    pub bytes_total: u64,
    /// Bytes per page.
    pub page_size: u32,
    /// Number of pages (`ceil(bytes_total / page_size)`).
    pub n_pages: u32,
    /// Valid bytes of the last page (`1..=page_size`).
    pub last_page_bytes: u32,
}

impl PageSpan {
    /// Most pages of one object: the CUDA heap reads an object out with one launch
    /// whose grid has a row per page, and CUDA caps a grid's rows at 65,535. The host heap
    /// takes the same limit, so an object is refused alike with or without a GPU (16
    /// GiB with the default 256 KiB pages).
    pub const MAX_PAGES: u32 = 65_535;

    /// Geometry of a `bytes_total`-byte object at `payload_base` cut in
    /// `page_size` pages. Errors on a zero size/page or more than
    /// [`MAX_PAGES`](Self::MAX_PAGES) pages.
    pub fn new(payload_base: u64, bytes_total: u64, page_size: u32) -> Result<Self> {
        if bytes_total == 0 {
            return Err(GpuError::InvalidArgument("object size must be >= 1 byte".into()));
        }
        if page_size == 0 {
            return Err(GpuError::InvalidArgument("page size must be >= 1".into()));
        }
        let ps = u64::from(page_size);
        let n = bytes_total.div_ceil(ps);
        let n_pages = u32::try_from(n).ok().filter(|&n| n <= Self::MAX_PAGES).ok_or_else(|| {
            GpuError::InvalidArgument(format!(
                "{bytes_total} bytes in {page_size}-byte pages is {n} pages; an object has at most {} \
                 (use larger pages)",
                Self::MAX_PAGES
            ))
        })?;
        let last = bytes_total - (n - 1) * ps;
        Ok(Self { payload_base, bytes_total, page_size, n_pages, last_page_bytes: last as u32 })
    }

    /// The span described by a header.
    pub fn from_header(h: &HeaderSnapshot) -> Result<Self> {
        let s =
            Self::new(h.payload_base, h.bytes_total, h.page_size).map_err(|e| GpuError::Corrupted(e.to_string()))?;
        if s.n_pages != h.n_pages || s.last_page_bytes != h.last_page_bytes {
            return Err(GpuError::Corrupted(format!(
                "geometry mismatch: header says {} pages / last {}, sizes say {} / {}",
                h.n_pages, h.last_page_bytes, s.n_pages, s.last_page_bytes
            )));
        }
        Ok(s)
    }

    /// Bytes reserved in the arena: whole pages, `n_pages * page_size`.
    pub fn alloc_bytes(&self) -> u64 {
        u64::from(self.n_pages) * u64::from(self.page_size)
    }

    /// Valid bytes of page `i` (the last page is clamped to `last_page_bytes`).
    pub fn page_len(&self, i: u32) -> u32 {
        if i + 1 == self.n_pages {
            self.last_page_bytes
        } else {
            self.page_size
        }
    }

    /// Arena offset of page `i`.
    pub fn page_offset(&self, i: u32) -> u64 {
        self.payload_base + u64::from(i) * u64::from(self.page_size)
    }

    /// Valid bytes of pages `first .. first + count` (tail clamped).
    pub fn range_len(&self, first: u32, count: u32) -> u64 {
        if count == 0 {
            return 0;
        }
        let end = first + count;
        let full = u64::from(count) * u64::from(self.page_size);
        if end == self.n_pages {
            full - u64::from(self.page_size - self.last_page_bytes)
        } else {
            full
        }
    }

    /// How many pages starting at `first` a buffer of `len` bytes covers
    /// exactly: it must hold whole pages, except that it may end with the
    /// (shorter) last page of the object.
    pub fn pages_for_len(&self, first: u32, len: usize) -> Result<u32> {
        if len == 0 {
            return Ok(0);
        }
        if first >= self.n_pages {
            return Err(GpuError::OutOfBounds(format!("page {first} of a {}-page object", self.n_pages)));
        }
        let count = (len as u64).div_ceil(u64::from(self.page_size));
        let avail = u64::from(self.n_pages - first);
        if count > avail || self.range_len(first, count as u32) != len as u64 {
            return Err(GpuError::InvalidArgument(format!(
                "{len} bytes at page {first} is not a whole-page range of this object \
                 ({} pages of {}, last {})",
                self.n_pages, self.page_size, self.last_page_bytes
            )));
        }
        Ok(count as u32)
    }
}

/// What a reader expects to find in a header slot: the slot's epoch at the time
/// the location was handed out and the key identity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadExpect {
    /// Header slot.
    pub slot: u32,
    /// Epoch of the slot when the location was handed out.
    pub epoch: u32,
    /// Key identity (hash, fingerprint, length).
    pub key: KeyId,
}

/// Result of [`DeviceHeap::retire`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetireOutcome {
    /// The slot is now `DEAD` with no reader: its payload may be freed.
    Retired,
    /// Readers were copying; the state was restored and nothing changed.
    Pinned(u32),
    /// The state was not the expected one (it is the given raw value).
    StateChanged(u32),
}

/// Memory an owner heap lives in: `header_slots()` 128-byte
/// [`DeviceObjectHeader`](crate::DeviceObjectHeader)s and
/// a payload arena of `payload_capacity()` bytes.
///
/// Implemented by [`HostHeap`] (host memory emulating the device) and by
/// [`CudaDeviceHeap`](crate::CudaDeviceHeap) (device memory). Object-safe and `Send + Sync`.
///
/// Orderings: `load_*`/`store_*` take the ordering to use (a load asked for
/// `Release`/`AcqRel` or a store asked for `Acquire`/`AcqRel` is done `SeqCst`);
/// read-modify-write operations are always `SeqCst`.
///
/// # Memory-ordering protocol
///
/// The protocol is implemented once, in the provided methods of this trait
/// ([`publish`](Self::publish), [`read_object`](Self::read_object), [`retire`](Self::retire)),
/// on top of a few primitive atomics that every heap implements; the CUDA kernels
/// implement the same steps with `ld.acquire.sys` / `st.release.sys` /
/// `atom.*.sys` + `__threadfence_system()`.
///
/// * **Publish** (producer): write every page, then `CAS state WRITING -> READY`
///   (SeqCst, which includes Release): a reader that acquires `READY` sees every
///   page.
/// * **Read**: load `state` with Acquire; if `READY`, `reader_refcnt += 1`
///   (SeqCst), re-load `state` and `epoch` (SeqCst/Acquire) and verify the key
///   identity; copy the pages (tail clamped to `last_page_bytes`);
///   `reader_refcnt -= 1` (SeqCst, which includes Release).
/// * **Retire** (evict/remove/reclaim): `CAS state X -> DEAD` (SeqCst), then load
///   `reader_refcnt` (SeqCst). If it is non-zero a reader may be copying: the
///   state is put back (`DEAD -> X`) and the caller skips the object. Only when
///   it reads 0 may the payload be freed.
///
/// The refcount increment/state re-check on the reader side and the state CAS /
/// refcount load on the retire side form a Dekker pair; they are SeqCst (one
/// notch above the Acquire the reference names) because with Acquire/Release
/// alone both sides could miss each other's write and a reader could copy
/// memory that is being freed. With SeqCst, either the reader sees `DEAD` and
/// backs off, or the retirer sees the reader and backs off.
pub trait DeviceHeap: Send + Sync {
    /// Number of header slots.
    fn header_slots(&self) -> u32;
    /// Size of the payload arena in bytes.
    fn payload_capacity(&self) -> u64;
    /// Address of header `slot` in the heap's address space (a device pointer
    /// for a device heap, a host pointer for [`HostHeap`]).
    fn header_addr(&self, slot: u32) -> u64;
    /// Address of arena offset `offset` in the heap's address space.
    fn payload_addr(&self, offset: u64) -> u64;
    /// Ordinal of the device the heap lives on, `None` for host memory.
    fn device_ordinal(&self) -> Option<usize> {
        None
    }

    /// Reads a whole header (`state` with Acquire first, then the rest).
    fn read_header(&self, slot: u32) -> Result<HeaderSnapshot>;
    /// Writes every field of `h` but `reader_refcnt`, storing `state` last with
    /// Release.
    fn write_header(&self, slot: u32, h: &HeaderSnapshot) -> Result<()>;
    /// [`write_header`](Self::write_header) without waiting for it: the write
    /// is ordered before whatever this heap does next through its own methods
    /// (on a CUDA heap, everything it runs goes on one stream), but another
    /// process may see it only after the heap's next waited call. For a
    /// reservation its own producer fills on this heap; a plan handed to
    /// another process needs the waited form. A failed write shows up at the
    /// next waited call. By default the waited form.
    fn write_header_in_order(&self, slot: u32, h: &HeaderSnapshot) -> Result<()> {
        self.write_header(slot, h)
    }
    /// Atomic load of a 32-bit field.
    fn load_u32(&self, slot: u32, f: HeaderU32Field, order: Ordering) -> Result<u32>;
    /// Atomic store to a 32-bit field.
    fn store_u32(&self, slot: u32, f: HeaderU32Field, v: u32, order: Ordering) -> Result<()>;
    /// SeqCst compare-exchange of a 32-bit field: `Ok(previous)` when it held
    /// `current` and now holds `new`, `Err(actual)` otherwise.
    fn compare_exchange_u32(
        &self,
        slot: u32,
        f: HeaderU32Field,
        current: u32,
        new: u32,
    ) -> Result<std::result::Result<u32, u32>>;
    /// SeqCst wrapping add of `delta` (may be negative); returns the previous value.
    fn fetch_add_u32(&self, slot: u32, f: HeaderU32Field, delta: i32) -> Result<u32>;
    /// Atomic load of a 64-bit field.
    fn load_u64(&self, slot: u32, f: HeaderU64Field, order: Ordering) -> Result<u64>;
    /// Atomic store to a 64-bit field.
    fn store_u64(&self, slot: u32, f: HeaderU64Field, v: u64, order: Ordering) -> Result<()>;

    /// Copies `src` into pages `first_page ..` of `span`. `src` must cover whole
    /// pages, except that it may end with the object's (clamped) last page.
    /// Returns the number of pages written. Bounds-checked against the arena.
    fn write_pages(&self, span: &PageSpan, first_page: u32, src: &[u8]) -> Result<u32>;
    /// Copies pages `first_page ..` of `span` into `dst` (same length rule as
    /// [`write_pages`](Self::write_pages); the last page is clamped to
    /// `last_page_bytes`). Returns the number of pages read.
    fn read_pages(&self, span: &PageSpan, first_page: u32, dst: &mut [u8]) -> Result<u32>;

    /// Publishes slot `slot` of epoch `epoch`: `CAS state WRITING -> READY`
    /// (Release) after every page was written, and stamps `state_ts = now_ns`.
    /// Idempotent: publishing an already READY object of the same epoch is Ok.
    /// `Err(Stale)` when the slot was reclaimed or reused.
    fn publish(&self, slot: u32, epoch: u32, now_ns: u64) -> Result<()> {
        if self.load_u32(slot, HeaderU32Field::Epoch, Ordering::Acquire)? != epoch {
            return Err(GpuError::Stale);
        }
        let writing = ObjectState::Writing.as_u32();
        let ready = ObjectState::Ready.as_u32();
        match self.compare_exchange_u32(slot, HeaderU32Field::State, writing, ready)? {
            Ok(_) => {
                self.store_u64(slot, HeaderU64Field::StateTs, now_ns, Ordering::Relaxed)?;
                Ok(())
            }
            Err(s) if s == ready => {
                // Published already (e.g. by the device). Make sure it is ours.
                if self.load_u32(slot, HeaderU32Field::Epoch, Ordering::Acquire)? == epoch {
                    Ok(())
                } else {
                    Err(GpuError::Stale)
                }
            }
            Err(_) => Err(GpuError::Stale),
        }
    }

    /// The reader protocol: acquire `READY`, pin (`reader_refcnt += 1`),
    /// re-check state, epoch and key identity, copy the object (tail clamped)
    /// into the front of `dst`, unpin. Returns the object size.
    ///
    /// `Err(NotReady)` if the expected object is still being written,
    /// `Err(Stale)` if it was retired or the slot reused, `Err(BufferTooSmall)`.
    fn read_object(&self, expect: &ReadExpect, dst: &mut [u8]) -> Result<u64> {
        let slot = expect.slot;
        let st = self.load_u32(slot, HeaderU32Field::State, Ordering::Acquire)?;
        if st != ObjectState::Ready.as_u32() {
            let same_epoch = self.load_u32(slot, HeaderU32Field::Epoch, Ordering::Acquire)? == expect.epoch;
            let in_progress = st == ObjectState::Writing.as_u32() || st == ObjectState::Reserved.as_u32();
            return Err(if same_epoch && in_progress { GpuError::NotReady } else { GpuError::Stale });
        }
        self.fetch_add_u32(slot, HeaderU32Field::ReaderRefcnt, 1)?;
        let copied = (|| {
            let st = self.load_u32(slot, HeaderU32Field::State, Ordering::SeqCst)?;
            let ep = self.load_u32(slot, HeaderU32Field::Epoch, Ordering::Acquire)?;
            if st != ObjectState::Ready.as_u32() || ep != expect.epoch {
                return Err(GpuError::Stale);
            }
            let h = self.read_header(slot)?;
            if h.key_hash != expect.key.hash || h.key_fp_hi != expect.key.fp_hi || h.key_len != expect.key.len {
                return Err(GpuError::Stale);
            }
            let span = PageSpan::from_header(&h)?;
            if (dst.len() as u64) < span.bytes_total {
                return Err(GpuError::BufferTooSmall { need: span.bytes_total, got: dst.len() as u64 });
            }
            self.read_pages(&span, 0, &mut dst[..span.bytes_total as usize])?;
            Ok(span.bytes_total)
        })();
        // Unpin (SeqCst includes Release: our copy happens-before a retirer
        // that reads the decremented count).
        self.fetch_add_u32(slot, HeaderU32Field::ReaderRefcnt, -1)?;
        copied
    }

    /// The retire protocol: `CAS state from -> DEAD`, then check the reader
    /// count; if a reader holds the object, restore `from` and report
    /// [`RetireOutcome::Pinned`]. On `Retired`, `state_ts` is set to `now_ns`.
    fn retire(&self, slot: u32, from: ObjectState, now_ns: u64) -> Result<RetireOutcome> {
        let dead = ObjectState::Dead.as_u32();
        if let Err(actual) = self.compare_exchange_u32(slot, HeaderU32Field::State, from.as_u32(), dead)? {
            return Ok(RetireOutcome::StateChanged(actual));
        }
        let readers = self.load_u32(slot, HeaderU32Field::ReaderRefcnt, Ordering::SeqCst)?;
        if readers != 0 {
            // A reader pinned the object before seeing DEAD; give it back.
            let _ = self.compare_exchange_u32(slot, HeaderU32Field::State, dead, from.as_u32())?;
            return Ok(RetireOutcome::Pinned(readers));
        }
        self.store_u64(slot, HeaderU64Field::StateTs, now_ns, Ordering::Relaxed)?;
        Ok(RetireOutcome::Retired)
    }
}
