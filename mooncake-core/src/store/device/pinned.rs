//! Host memory the store maps (its own segment, same-host peers' segments),
//! page-locked with CUDA piece by piece, each piece the first time a replica in it
//! moves to or from device memory, so that the replica moves by DMA straight from
//! or into the segment, with no staging copy (one DMA per piece it lies in).
//! Machines without a GPU take the same decisions over [`HostPinning::emulated`]
//! (device memory that is a [`HostDeviceMemory`](mooncake_gpu::HostDeviceMemory)).
//!
//! Why pieces: page-locking costs time in proportion to the range and more per
//! byte the larger the range (an H100 host: 1.3 s for 2 GiB, 24 s for 32 GiB at
//! once), and the driver makes every other CUDA call of the process wait while it
//! runs, so page-locking a whole segment at the first device call stalled it, and
//! page-locking it in a thread of its own stalled the calls beside it just as long.
//! A piece bounds what one call waits for, and only pieces replicas are moved from
//! or into are ever locked. A DMA never spans two pieces: each piece is a
//! registration of its own, and whether the driver takes a copy across two
//! registrations as one DMA is not something to rely on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};

use mooncake_gpu::{EmulatedPin, HostPinning, PinnedRanges};
use mooncake_transfer::{MappedRegion, RemoteRegion, TransferEngine};
use parking_lot::Mutex;
use smallvec::SmallVec;

/// Bytes of a mapped segment page-locked at a time by default (see
/// [`StoreBuilder::page_lock_piece`](crate::StoreBuilder::page_lock_piece)).
pub(in crate::store) const DEFAULT_PIECE: u64 = 64 << 20;

/// The parts of a replica's range, each `(address, length)` within one page-locked
/// piece, in order.
pub(in crate::store) type PinnedParts = SmallVec<[(*mut u8, usize); 2]>;

/// A replica's region, mapped into this process, page-locked piece by piece.
pub(in crate::store) struct PinnedRegion {
    /// Each piece's pin (`None`: refused), taken on first use. Declared (so
    /// dropped) before the mapping: the pieces are unpinned while still mapped.
    pieces: Box<[OnceLock<Option<Pin>>]>,
    piece: u64,
    emulated: bool,
    /// Bytes page-locked now by the store's regions (this one's pieces' share is
    /// taken back when it is dropped).
    locked: Arc<AtomicU64>,
    /// Whether a refused piece was reported (once per region).
    warned: AtomicBool,
    endpoint: String,
    map: MappedRegion,
}

enum Pin {
    Cuda(#[allow(dead_code)] HostPinning),
    Emulated(#[allow(dead_code)] EmulatedPin),
}

impl PinnedRegion {
    /// The parts of `len` bytes at `offset` of the region, split where its pieces
    /// meet, each piece page-locked first if it was not (waiting for a piece another
    /// call is locking). `None` if the range is not inside the region or a piece of
    /// it cannot be page-locked: the bytes are then staged.
    pub(in crate::store) fn parts(&self, offset: u64, len: u64) -> Option<PinnedParts> {
        let base = self.map.range(offset, len)?;
        let mut parts = PinnedParts::new();
        if len == 0 {
            parts.push((base, 0));
            return Some(parts);
        }
        for (i, start, part) in split_at_pieces(offset, len, self.piece) {
            if !self.pinned(i as usize) {
                return None;
            }
            parts.push((self.map.range(start, part)?, part as usize));
        }
        Some(parts)
    }

    /// Whether piece `i` is page-locked, locking it on first use.
    fn pinned(&self, i: usize) -> bool {
        let Some(cell) = self.pieces.get(i) else { return false };
        cell.get_or_init(|| self.pin(i)).is_some()
    }

    /// Where piece `i` starts in the region, and its length (the last may be
    /// shorter).
    fn piece_range(&self, i: usize) -> (u64, u64) {
        let start = i as u64 * self.piece;
        (start, self.piece.min(self.map.len() - start))
    }

    fn pin(&self, i: usize) -> Option<Pin> {
        let (start, len) = self.piece_range(i);
        let ptr = self.map.range(start, len)?;
        let pin = if self.emulated {
            HostPinning::emulated(&EMULATED, ptr as u64, len).map(Pin::Emulated)
        } else {
            // SAFETY: `self.map` keeps the range mapped, and the pin is dropped
            // before it (field order of `PinnedRegion`).
            unsafe { HostPinning::pin(ptr, len as usize) }.map(Pin::Cuda)
        };
        match pin {
            Ok(pin) => {
                self.locked.fetch_add(len, Ordering::Relaxed);
                Some(pin)
            }
            Err(e) => {
                if !self.warned.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %e, endpoint = self.endpoint, offset = start, len,
                        "cannot page-lock a piece of a segment: device copies to and from it are staged");
                }
                None
            }
        }
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        let locked: u64 = (0..self.pieces.len())
            .filter(|&i| self.pieces[i].get().is_some_and(Option::is_some))
            .map(|i| self.piece_range(i).1)
            .sum();
        self.locked.fetch_sub(locked, Ordering::Relaxed);
    }
}

/// `[offset, offset + len)` cut where pieces of `piece` bytes meet: `(piece index,
/// start, length)` of each part, in order (none for an empty range). The caller
/// checked that the range lies in the region (no overflow).
fn split_at_pieces(offset: u64, len: u64, piece: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    let end = offset + len;
    let pieces = if len == 0 { 1..1 } else { offset / piece..(end - 1) / piece + 1 };
    pieces.map(move |i| {
        let start = offset.max(i * piece);
        (i, start, end.min((i + 1) * piece) - start)
    })
}

/// The ranges the emulation page-locked in this process: like CUDA, it refuses to
/// page-lock a range twice.
static EMULATED: LazyLock<Arc<PinnedRanges>> = LazyLock::new(Arc::default);

/// The address a region was mapped at, and its pieces.
type MappedAt = (usize, Arc<PinnedRegion>);

/// The regions one store maps for device copies, each piece page-locked once (CUDA
/// refuses to page-lock a range twice), by region and kind (CUDA or emulated), with
/// the address each was mapped at; a piece that cannot be page-locked is not asked
/// again while its mapping stays the same. Owned by the store: its pins and
/// mappings go with it.
pub(in crate::store) struct PinnedRegions {
    by_region: Mutex<HashMap<(RemoteRegion, bool), MappedAt>>,
    piece: u64,
    locked: Arc<AtomicU64>,
}

impl PinnedRegions {
    /// Regions page-locked `piece` bytes at a time (at least one page, a multiple of
    /// it: checked by the builder).
    pub(in crate::store) fn new(piece: u64) -> Self {
        Self { by_region: Default::default(), piece: piece.max(1), locked: Default::default() }
    }

    /// Bytes of mapped segments page-locked now.
    pub(in crate::store) fn locked_bytes(&self) -> u64 {
        self.locked.load(Ordering::Relaxed)
    }

    /// Page-locks every piece not yet locked of every region mapped so far; the bytes
    /// page-locked after it.
    pub(in crate::store) fn lock_all(&self) -> u64 {
        let regions: Vec<Arc<PinnedRegion>> = self.by_region.lock().values().map(|(_, r)| r.clone()).collect();
        for region in regions {
            for i in 0..region.pieces.len() {
                region.pinned(i);
            }
        }
        self.locked_bytes()
    }

    /// `region` mapped by the transport that reaches it, its pieces page-locked on
    /// first use (with CUDA, or in the emulation when `emulated`); `None`: the
    /// transport does not map it, the bytes are staged.
    pub(in crate::store) fn get(
        &self,
        engine: &TransferEngine,
        region: &RemoteRegion,
        emulated: bool,
    ) -> Option<Arc<PinnedRegion>> {
        // Asked every time: the transport checks that the peer still serves the
        // mapping, and a new mapping is pinned anew.
        let map = engine.map_region(region)?.ok()?;
        let ptr = map.range(0, 0)? as usize;
        let key = (region.clone(), emulated);
        let mut by_region = self.by_region.lock();
        if let Some((at, pinned)) = by_region.get(&key) {
            if *at == ptr {
                return Some(pinned.clone());
            }
        }
        let pieces = map.len().div_ceil(self.piece);
        let pinned = Arc::new(PinnedRegion {
            pieces: (0..pieces).map(|_| OnceLock::new()).collect(),
            piece: self.piece,
            emulated,
            locked: self.locked.clone(),
            warned: AtomicBool::new(false),
            endpoint: region.endpoint.clone(),
            map,
        });
        // A stale entry's pins go with it (unpinned, then unmapped), once no
        // transfer holds it.
        by_region.insert(key, (ptr, pinned.clone()));
        Some(pinned)
    }
}

#[cfg(test)]
mod tests {
    use mooncake_gpu::{DeviceMemory, HostDeviceMemory};

    use super::*;
    use crate::Store;

    const PIECE: u64 = 1 << 20;

    proptest::proptest! {
        /// The parts of a range are the range, in order, each inside one piece and
        /// no two in the same piece: against a byte-by-byte model.
        #[test]
        fn a_range_is_cut_exactly_where_pieces_meet(piece in 1u64..64, offset in 0u64..400, len in 0u64..400) {
            let parts: Vec<(u64, u64, u64)> = split_at_pieces(offset, len, piece).collect();
            let mut at = offset;
            for &(i, start, n) in &parts {
                proptest::prop_assert_eq!(start, at);
                proptest::prop_assert!(n > 0);
                proptest::prop_assert!((start..start + n).all(|b| b / piece == i), "a part spans pieces");
                at += n;
            }
            proptest::prop_assert_eq!(at, offset + len);
            // Byte by byte, the pieces the range touches, each once.
            let touched: std::collections::BTreeSet<u64> = (offset..offset + len).map(|b| b / piece).collect();
            let listed: Vec<u64> = parts.iter().map(|p| p.0).collect();
            proptest::prop_assert_eq!(listed, touched.into_iter().collect::<Vec<_>>());
        }
    }

    /// A piece that cannot be page-locked stages the replicas in it; the other
    /// pieces of the same segment still move by DMA.
    #[test]
    fn a_piece_that_cannot_be_page_locked_is_staged_and_the_others_are_not() {
        let store = Store::builder().global_segment_size(16 << 20).page_lock_piece(PIECE).build().unwrap();
        let dev = HostDeviceMemory::new(4 << 20).unwrap();
        let data = |i: usize| vec![i as u8 + 1; 300 << 10];
        for i in 0..12 {
            store.put(&format!("k{i}"), &data(i)).unwrap();
        }
        // The first object moves by DMA: its pieces are locked, the segment mapped.
        assert_eq!(store.get_into_device("k0", &dev, 0).unwrap(), 300 << 10);
        let s = store.stats();
        assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (300 << 10, 0));
        assert_eq!(s.device_page_locked_bytes, PIECE, "only the first object's piece");
        let base = {
            let by_region = store.inner.pinned.by_region.lock();
            let (_, region) = by_region.values().next().expect("the own segment is mapped");
            region.map.range(0, 0).unwrap() as u64
        };
        // An object whose pieces are not locked yet; someone else locks one of them
        // first (the driver then refuses the store's registration).
        let piece_of = |key: &str| {
            let r = store.master().get_replica_list(key).unwrap().replicas[0];
            (r.offset / PIECE, (r.offset + r.len - 1) / PIECE)
        };
        let (first0, last0) = piece_of("k0");
        let key =
            (1..12).map(|i| format!("k{i}")).find(|k| piece_of(k).0 > last0).expect("an object beyond k0's pieces");
        let (first, _) = piece_of(&key);
        let taken = HostPinning::emulated(&EMULATED, base + first * PIECE, PIECE).unwrap();
        assert_eq!(store.get_into_device(&key, &dev, 0).unwrap(), 300 << 10);
        let mut back = vec![0u8; 300 << 10];
        dev.copy_to_host(0, &mut back).unwrap();
        assert_eq!(back, store.get(&key).unwrap()[..], "staged bytes");
        let s = store.stats();
        assert_eq!((s.device_direct_bytes, s.device_staged_bytes), (300 << 10, 300 << 10));
        // The refusal is remembered for this mapping, even once the range is free.
        drop(taken);
        store.get_into_device(&key, &dev, 0).unwrap();
        assert_eq!(store.stats().device_staged_bytes, 2 * (300 << 10));
        // k0's pieces still move by DMA.
        assert_eq!((first0, last0), piece_of("k0"));
        store.get_into_device("k0", &dev, 0).unwrap();
        assert_eq!(store.stats().device_direct_bytes, 2 * (300 << 10));
        assert!(store.stats().device_page_locked_bytes < 16 << 20);
    }
}
