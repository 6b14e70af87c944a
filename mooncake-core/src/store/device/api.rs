//! The store's device-memory calls: each picks the direct way when the store's
//! RDMA NICs can register the memory, else stages through host memory.
//!
//! Errors of the device layer map into [`Error`]: ranges outside the device
//! memory are `InvalidArgument`, an object larger than the room after the device
//! offset is `BufferTooSmall`, device failures (no GPU, a CUDA error) are
//! `Transport(TransferError::Io(..))` with the device error's text.

use mooncake_gpu::{DeviceMemory, GpuError};
use mooncake_transfer::TransferError;

use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::store::destination::{Dest, Got};
use crate::store::read::Lists;
use crate::store::write::{Source, WriteItem, WriteMode};
use crate::store::Store;

impl From<GpuError> for Error {
    fn from(e: GpuError) -> Self {
        match e {
            GpuError::OutOfBounds(m) => Error::InvalidArgument(format!("device memory: {m}")),
            GpuError::InvalidArgument(m) => Error::InvalidArgument(format!("device memory: {m}")),
            GpuError::BufferTooSmall { need, got } => Error::BufferTooSmall { needed: need, capacity: got },
            other => Error::Transport(TransferError::Io(format!("device memory: {other}"))),
        }
    }
}

impl Store {
    /// Page-locks, now, every piece not yet locked of this client's own segment and
    /// of the segments this store has mapped for device copies so far (same-host
    /// peers': each mapped by the first device call that moved a replica there), and
    /// returns the bytes of mapped segments page-locked after it
    /// ([`StoreStats::device_page_locked_bytes`](crate::StoreStats)). Device calls
    /// lock the pieces they move replicas through when they first do (see
    /// [`StoreBuilder::page_lock_piece`](crate::StoreBuilder::page_lock_piece)); a
    /// server that would rather pay for it at setup calls this then (with CUDA
    /// where a GPU is usable, else in the host emulation). Takes time in proportion
    /// to the bytes (about 0.15-0.75 s per GiB on an H100 host), during which the
    /// CUDA driver holds the process's other CUDA calls. A piece that cannot be
    /// page-locked is logged and left to staging.
    ///
    /// ```
    /// use mooncake_core::gpu::HostDeviceMemory;
    /// use mooncake_core::Store;
    ///
    /// let store = Store::builder().global_segment_size(8 << 20).page_lock_piece(1 << 20).build()?;
    /// store.put("kv/0", &[7u8; 4096])?;
    /// let gpu = HostDeviceMemory::new(1 << 20)?;
    /// store.get_into_device("kv/0", &gpu, 0)?;
    /// // The first call locked the piece it moved the replica through.
    /// assert_eq!(store.stats().device_page_locked_bytes, 1 << 20);
    /// assert_eq!(store.page_lock_segments(), 8 << 20);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn page_lock_segments(&self) -> u64 {
        let inner = &self.inner;
        let own = inner.own_segment.load(std::sync::atomic::Ordering::Acquire);
        if own != 0 {
            // Mapped now if no device call has yet, as the devices this process
            // can use would map it.
            let emulated = !mooncake_gpu::cuda_available();
            if let Ok(route) = inner.routes.get(&*inner.master, &inner.engine, own) {
                if route.caps.maps_peer_memory {
                    inner.pinned.get(&inner.engine, &route.region, emulated);
                }
            }
        }
        inner.pinned.lock_all()
    }

    /// Reads the object under `key` into device memory `dst` at byte `offset`
    /// and returns its length, like [`get_into`](Self::get_into) for GPU
    /// memory; the call returns when the bytes are in device memory, verified
    /// against the object's checksum.
    ///
    /// A replica whose transport moves device memory (RDMA, with memory the NICs
    /// can register: a dma-buf export) is READ straight into device memory; one
    /// in a segment this process maps (its own, a same-host peer's) is copied by
    /// DMA from that segment, the pieces it lies in page-locked on first use (one
    /// DMA per piece, see
    /// [`StoreBuilder::page_lock_piece`](crate::StoreBuilder::page_lock_piece));
    /// otherwise the bytes are read into a pinned staging buffer and copied to the
    /// device with an asynchronous DMA ([`StoreStats`](crate::StoreStats) counts
    /// which).
    ///
    /// Errors: `NotFound`; `BufferTooSmall` if the object is larger than
    /// `dst.len() - offset` (nothing is copied); `InvalidArgument` if `offset`
    /// is beyond `dst`; `Corrupted` if no replica matches its checksum;
    /// `Transport` for a device failure.
    ///
    /// ```
    /// use mooncake_core::gpu::{DeviceMemory, HostDeviceMemory};
    /// use mooncake_core::Store;
    ///
    /// let store = Store::builder().global_segment_size(16 << 20).build()?;
    /// store.put("kv/0", &[7u8; 100_000])?;
    /// // A GPU buffer (`gpu::DeviceBuffer::new(0, len)?`), or its host emulation.
    /// let gpu = HostDeviceMemory::new(1 << 20)?;
    /// assert_eq!(store.get_into_device("kv/0", &gpu, 4096)?, 100_000);
    /// assert!(gpu.to_vec()[4096..104_096].iter().all(|&b| b == 7));
    /// // The replica is in this process's own segment: a DMA from it, no staging.
    /// assert_eq!(store.stats().device_direct_bytes, 100_000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_into_device(&self, key: &str, dst: &dyn DeviceMemory, offset: u64) -> Result<usize> {
        let items = vec![(key, Dest::Device { mem: dst, offset })];
        self.inner
            .read(items, Lists::Cached)
            .pop()
            .unwrap_or_else(|| Err(Error::NotFound(key.to_owned())))
            .map(|g| g.len())
    }

    /// Stores `len` bytes of device memory `src` at byte `offset` under
    /// `key`, with the builder's default replication (like [`put`](Self::put)):
    /// every replica whose transport moves device memory is WRITTEN straight
    /// from it, every replica in a segment this process maps is written by DMA (one
    /// per page-locked piece it lies in); the others are written from a pinned copy
    /// (device -> pinned with an asynchronous DMA). `InvalidArgument` if the range
    /// is outside `src` or empty.
    pub fn put_from_device(&self, key: &str, src: &dyn DeviceMemory, offset: u64, len: u64) -> Result<()> {
        self.put_from_device_with(key, src, offset, len, &self.inner.replicate)
    }

    /// [`put_from_device`](Self::put_from_device) with `cfg`'s replication.
    pub fn put_from_device_with(
        &self,
        key: &str,
        src: &dyn DeviceMemory,
        offset: u64,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Result<()> {
        self.batch_put_from_device(&[(key, offset, len)], src, cfg).pop().unwrap_or(Ok(()))
    }

    /// Reads many objects into device memory `dst`, each `(key, offset)` at
    /// its own offset, with one master round trip and one transfer batch (as
    /// [`get_into_device`](Self::get_into_device) for each); one result (object
    /// length) per item, in order.
    pub fn batch_get_into_device(&self, items: &[(&str, u64)], dst: &dyn DeviceMemory) -> Vec<Result<usize>> {
        let items: Vec<(&str, &dyn DeviceMemory, u64)> =
            items.iter().map(|&(key, offset)| (key, dst, offset)).collect();
        self.batch_get_into_devices(&items)
    }

    /// [`batch_get_into_device`](Self::batch_get_into_device) with a device memory
    /// of its own for each object: `(key, memory, offset)`, the object read to
    /// `offset` of `memory` (which must have room for it from there).
    pub fn batch_get_into_devices(&self, items: &[(&str, &dyn DeviceMemory, u64)]) -> Vec<Result<usize>> {
        let items = items.iter().map(|&(key, mem, offset)| (key, Dest::Device { mem, offset })).collect();
        self.inner.read(items, Lists::Master).into_iter().map(|r| r.map(|g: Got| g.len())).collect()
    }

    /// Stores many device ranges, each `(key, offset, len)` of `src`, with
    /// `cfg`'s replication, with one master round trip per phase (as
    /// [`put_from_device`](Self::put_from_device) for each); one result per
    /// item, in order.
    pub fn batch_put_from_device(
        &self,
        items: &[(&str, u64, u64)],
        src: &dyn DeviceMemory,
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        let items: Vec<(&str, &dyn DeviceMemory, u64, u64)> =
            items.iter().map(|&(key, offset, len)| (key, src, offset, len)).collect();
        self.batch_put_from_devices(&items, cfg)
    }

    /// [`batch_put_from_device`](Self::batch_put_from_device) with a device memory
    /// of its own for each object: `(key, memory, offset, len)`.
    pub fn batch_put_from_devices(
        &self,
        items: &[(&str, &dyn DeviceMemory, u64, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        self.write_devices(items, cfg, WriteMode::Put)
    }

    /// Upserts device ranges, `(key, memory, offset, len)` each: as
    /// [`batch_upsert_parts`](Self::batch_upsert_parts) (the object stored under the
    /// key, if any, replaced atomically) with the bytes moved as
    /// [`put_from_device`](Self::put_from_device) moves them. One result per item.
    pub fn batch_upsert_from_devices(
        &self,
        items: &[(&str, &dyn DeviceMemory, u64, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        self.write_devices(items, cfg, WriteMode::Upsert)
    }

    fn write_devices(
        &self,
        items: &[(&str, &dyn DeviceMemory, u64, u64)],
        cfg: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<Result<()>> {
        let items: Vec<WriteItem<'_>> = items
            .iter()
            .map(|&(key, mem, offset, len)| WriteItem { key, source: Source::Device { mem, offset, len } })
            .collect();
        self.inner.write(&items, cfg, mode)
    }
}
