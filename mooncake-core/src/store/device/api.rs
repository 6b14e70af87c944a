//! The store's device-memory calls: each picks the direct way when the store's
//! RDMA NICs can register the memory, else stages through host memory.
//!
//! Errors of the device layer map into [`Error`]: ranges outside the device
//! memory are `InvalidArgument`, an object larger than the room after the device
//! offset is `BufferTooSmall`, device failures (no GPU, a CUDA error) are
//! `Transport(TransferError::Io(..))` with the device error's text.

use mooncake_gpu::{DeviceMemory, GpuError};
use mooncake_transfer::TransferError;

use super::staging::room_after;
use crate::config::{check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::store::stats::StoreCounters;
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
    /// Reads the object under `key` into device memory `dst` at byte `offset`
    /// and returns its length, like [`get_into`](Self::get_into) for GPU
    /// memory; the call returns when the bytes are in device memory, verified
    /// against the object's checksum.
    ///
    /// Over RDMA, with memory the NICs can register (a dma-buf export), the
    /// replica is READ straight into device memory; otherwise the bytes are read
    /// into a pinned staging buffer and copied to the device with an
    /// asynchronous DMA ([`StoreStats`](crate::StoreStats) counts which).
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
    /// // An in-process store has no RDMA NIC: the bytes were staged.
    /// assert_eq!(store.stats().device_staged_bytes, 100_000);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_into_device(&self, key: &str, dst: &dyn DeviceMemory, offset: u64) -> Result<usize> {
        let room = room_after(dst, offset)?;
        if let Some(direct) = self.direct(dst) {
            return self.get_direct(key, dst, offset, room, &direct);
        }
        let n = self.get_staged(key, dst, offset, room)?;
        StoreCounters::inc(&self.inner.counters.device_staged_bytes, n as u64);
        Ok(n)
    }

    /// Stores `len` bytes of device memory `src` at byte `offset` under
    /// `key`, with the builder's default replication (like [`put`](Self::put)):
    /// over RDMA, with memory the NICs can register, WRITEs every replica
    /// straight from device memory; otherwise copies device -> pinned staging
    /// with an asynchronous DMA and puts the staged bytes. `InvalidArgument` if
    /// the range is outside `src` or empty.
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
        check_value_len(len)?;
        src.check_range(offset, len)?;
        if let Some(direct) = self.direct(src) {
            return self.put_direct(key, src, offset, len, cfg, &direct);
        }
        self.put_staged(key, src, offset, len, cfg)?;
        StoreCounters::inc(&self.inner.counters.device_staged_bytes, len);
        Ok(())
    }

    /// Reads many objects into device memory `dst`, each `(key, offset)` at
    /// its own offset; one result (object length) per item, in order. Staged,
    /// two staging buffers alternate, so the DMA of one object runs while the
    /// next is read from the store; direct (as
    /// [`get_into_device`](Self::get_into_device)), each object is READ into
    /// device memory in turn.
    pub fn batch_get_into_device(&self, items: &[(&str, u64)], dst: &dyn DeviceMemory) -> Vec<Result<usize>> {
        if self.direct(dst).is_some() {
            return items.iter().map(|&(key, offset)| self.get_into_device(key, dst, offset)).collect();
        }
        let results = self.batch_get_staged(items, dst);
        let staged: usize = results.iter().flatten().sum();
        StoreCounters::inc(&self.inner.counters.device_staged_bytes, staged as u64);
        results
    }

    /// Stores many device ranges, each `(key, offset, len)` of `src`, with
    /// `cfg`'s replication; one result per item, in order. Staged, the DMA of
    /// the next range overlaps the `put` of the current one; direct (as
    /// [`put_from_device`](Self::put_from_device)), each range is written from
    /// device memory in turn.
    pub fn batch_put_from_device(
        &self,
        items: &[(&str, u64, u64)],
        src: &dyn DeviceMemory,
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        if self.direct(src).is_some() {
            return items
                .iter()
                .map(|&(key, offset, len)| self.put_from_device_with(key, src, offset, len, cfg))
                .collect();
        }
        let results = self.batch_put_staged(items, src, cfg);
        let staged: u64 = items.iter().zip(&results).filter(|(_, r)| r.is_ok()).map(|(&(_, _, len), _)| len).sum();
        StoreCounters::inc(&self.inner.counters.device_staged_bytes, staged);
        results
    }
}
