//! [`HostHeap`]: host memory that emulates a device heap exactly.

use std::sync::atomic::{AtomicU64, Ordering};

use super::{DeviceHeap, PageSpan};
use crate::error::{GpuError, Result};
use crate::header::{DeviceObjectHeader, HeaderSnapshot, HeaderU32Field, HeaderU64Field, ObjectState, HEADER_SIZE};

fn load_order(o: Ordering) -> Ordering {
    match o {
        Ordering::Release | Ordering::AcqRel => Ordering::SeqCst,
        o => o,
    }
}

fn store_order(o: Ordering) -> Ordering {
    match o {
        Ordering::Acquire | Ordering::AcqRel => Ordering::SeqCst,
        o => o,
    }
}

/// Alignment of payload bases and of the arena size in [`HostHeap`].
pub const HOST_WORD: u64 = 8;

/// A [`DeviceHeap`] in host memory that emulates device memory exactly: the same
/// 128-byte headers, the same state machine, the same atomics and orderings.
///
/// The payload arena is an array of `AtomicU64` words accessed with `Relaxed`
/// loads/stores, the way device memory behaves for plain `ld/st`: a protocol bug
/// shows up as wrong bytes in a test, never as undefined behaviour.
/// No `unsafe` code.
#[derive(Debug)]
pub struct HostHeap {
    headers: Box<[DeviceObjectHeader]>,
    words: Box<[AtomicU64]>,
    capacity: u64,
}

impl HostHeap {
    /// A heap with `header_slots` headers and a `payload_bytes` arena (rounded
    /// up to a multiple of 8). All headers start `DEAD` with epoch 0.
    pub fn new(header_slots: u32, payload_bytes: u64) -> Result<Self> {
        if header_slots == 0 || payload_bytes == 0 {
            return Err(GpuError::InvalidArgument("a heap needs at least one header slot and one payload byte".into()));
        }
        let n_words = usize::try_from(payload_bytes.div_ceil(HOST_WORD))
            .map_err(|_| GpuError::InvalidArgument("payload too large for this host".into()))?;
        let headers: Box<[DeviceObjectHeader]> = (0..header_slots)
            .map(|_| {
                let h = DeviceObjectHeader::default();
                h.state.store(ObjectState::Dead.as_u32(), Ordering::Relaxed);
                h
            })
            .collect();
        let words: Box<[AtomicU64]> = (0..n_words).map(|_| AtomicU64::new(0)).collect();
        Ok(Self { headers, words, capacity: n_words as u64 * HOST_WORD })
    }

    /// The header of `slot` (bounds-checked).
    pub fn header(&self, slot: u32) -> Result<&DeviceObjectHeader> {
        self.headers
            .get(slot as usize)
            .ok_or_else(|| GpuError::OutOfBounds(format!("header slot {slot} of {}", self.headers.len())))
    }

    fn check_span(&self, span: &PageSpan) -> Result<()> {
        let end = span.payload_base.checked_add(span.alloc_bytes());
        if !span.payload_base.is_multiple_of(HOST_WORD) || u64::from(span.page_size) % HOST_WORD != 0 {
            return Err(GpuError::InvalidArgument(format!(
                "payload base {} and page size {} must be multiples of {HOST_WORD}",
                span.payload_base, span.page_size
            )));
        }
        match end {
            Some(e) if e <= self.capacity => Ok(()),
            _ => Err(GpuError::OutOfBounds(format!(
                "span {}+{} outside the {}-byte arena",
                span.payload_base,
                span.alloc_bytes(),
                self.capacity
            ))),
        }
    }

    fn copy_in(&self, byte_off: u64, src: &[u8]) {
        let mut w = (byte_off / HOST_WORD) as usize;
        let mut chunks = src.chunks_exact(8);
        for c in &mut chunks {
            let v = u64::from_ne_bytes(c.try_into().expect("8-byte chunk"));
            self.words[w].store(v, Ordering::Relaxed);
            w += 1;
        }
        let rem = chunks.remainder();
        if !rem.is_empty() {
            // The rest of this word is the page's own slack: no other object
            // and no other page shares it.
            let mut b = self.words[w].load(Ordering::Relaxed).to_ne_bytes();
            b[..rem.len()].copy_from_slice(rem);
            self.words[w].store(u64::from_ne_bytes(b), Ordering::Relaxed);
        }
    }

    fn copy_out(&self, byte_off: u64, dst: &mut [u8]) {
        let mut w = (byte_off / HOST_WORD) as usize;
        let mut chunks = dst.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.words[w].load(Ordering::Relaxed).to_ne_bytes());
            w += 1;
        }
        let rem = chunks.into_remainder();
        if !rem.is_empty() {
            let b = self.words[w].load(Ordering::Relaxed).to_ne_bytes();
            let n = rem.len();
            rem.copy_from_slice(&b[..n]);
        }
    }
}

impl DeviceHeap for HostHeap {
    fn header_slots(&self) -> u32 {
        self.headers.len() as u32
    }

    fn payload_capacity(&self) -> u64 {
        self.capacity
    }

    fn header_addr(&self, slot: u32) -> u64 {
        self.headers.as_ptr() as u64 + u64::from(slot) * HEADER_SIZE as u64
    }

    fn payload_addr(&self, offset: u64) -> u64 {
        self.words.as_ptr() as u64 + offset
    }

    fn read_header(&self, slot: u32) -> Result<HeaderSnapshot> {
        Ok(self.header(slot)?.snapshot())
    }

    fn write_header(&self, slot: u32, h: &HeaderSnapshot) -> Result<()> {
        self.header(slot)?.store_from(h);
        Ok(())
    }

    fn load_u32(&self, slot: u32, f: HeaderU32Field, order: Ordering) -> Result<u32> {
        Ok(self.header(slot)?.u32_field(f).load(load_order(order)))
    }

    fn store_u32(&self, slot: u32, f: HeaderU32Field, v: u32, order: Ordering) -> Result<()> {
        self.header(slot)?.u32_field(f).store(v, store_order(order));
        Ok(())
    }

    fn compare_exchange_u32(
        &self,
        slot: u32,
        f: HeaderU32Field,
        current: u32,
        new: u32,
    ) -> Result<std::result::Result<u32, u32>> {
        Ok(self.header(slot)?.u32_field(f).compare_exchange(current, new, Ordering::SeqCst, Ordering::SeqCst))
    }

    fn fetch_add_u32(&self, slot: u32, f: HeaderU32Field, delta: i32) -> Result<u32> {
        Ok(self.header(slot)?.u32_field(f).fetch_add(delta as u32, Ordering::SeqCst))
    }

    fn load_u64(&self, slot: u32, f: HeaderU64Field, order: Ordering) -> Result<u64> {
        Ok(self.header(slot)?.u64_field(f).load(load_order(order)))
    }

    fn store_u64(&self, slot: u32, f: HeaderU64Field, v: u64, order: Ordering) -> Result<()> {
        self.header(slot)?.u64_field(f).store(v, store_order(order));
        Ok(())
    }

    fn write_pages(&self, span: &PageSpan, first_page: u32, src: &[u8]) -> Result<u32> {
        self.check_span(span)?;
        let n = span.pages_for_len(first_page, src.len())?;
        self.copy_in(span.page_offset(first_page), src);
        Ok(n)
    }

    fn read_pages(&self, span: &PageSpan, first_page: u32, dst: &mut [u8]) -> Result<u32> {
        self.check_span(span)?;
        let n = span.pages_for_len(first_page, dst.len())?;
        self.copy_out(span.page_offset(first_page), dst);
        Ok(n)
    }
}
