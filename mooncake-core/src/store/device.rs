//! GPU memory as a `get_into` target and a `put` source of the store.
//!
//! Built on the public `Store` API: a get reads the object into a pinned
//! (page-locked) host staging buffer with [`Store::get_into`] and then copies
//! it to the device asynchronously on a stream; a put copies device -> pinned
//! and then [`Store::put`]s the staged bytes. Staging buffers come from a
//! process-wide [`PinnedPool`] (pinned memory costs milliseconds per MiB to
//! allocate; a 64 MiB KV block must not pay that on every call), so steady
//! state allocates nothing.
//!
//! The batch forms pipeline over two staging buffers: the DMA of one object
//! overlaps the store read (or the store write) of the next.
//!
//! Device memory is anything implementing
//! [`DeviceMemory`](mooncake_gpu::DeviceMemory): a CUDA
//! [`DeviceBuffer`](mooncake_gpu::DeviceBuffer), or
//! [`HostDeviceMemory`](mooncake_gpu::HostDeviceMemory) (host emulation,
//! same API) on machines without a GPU.
//!
//! Errors of the device layer map into [`Error`]: ranges outside the device
//! memory are `InvalidArgument`, an object larger than the room after the
//! device offset is `BufferTooSmall`, device failures (no GPU, a CUDA error)
//! are `Transport(TransferError::Io(..))` with the device error's text.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::LazyLock;

use mooncake_gpu::{DeviceMemory, DeviceStream, Fence, GpuError, PinnedPool, PooledBuffer};
use mooncake_transfer::TransferError;

use super::Store;
use crate::config::{check_value_len, ReplicateConfig};
use crate::error::{Error, Result};

/// Idle pinned staging kept for device copies, per process (two 64 MiB
/// objects: what a pipelined batch of the largest blocks uses).
const STAGING_IDLE_BYTES: usize = 128 << 20;

/// First staging size tried when no object was read into a device yet.
const FIRST_GUESS: usize = 1 << 20;

static STAGING: LazyLock<PinnedPool> = LazyLock::new(|| PinnedPool::new(STAGING_IDLE_BYTES));

/// Size of the last object read into a device: the staging size tried first
/// (KV blocks mostly share one size, so a guess rarely misses; a miss costs
/// one more `get_into`, which the store's stats count as a failed get).
static SIZE_HINT: AtomicUsize = AtomicUsize::new(0);

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

/// Bytes of `mem` from `offset` to its end; `InvalidArgument` if the offset
/// lies beyond it.
fn room_after(mem: &dyn DeviceMemory, offset: u64) -> Result<usize> {
    let len = mem.len();
    if offset > len {
        return Err(Error::InvalidArgument(format!(
            "device offset {offset} is beyond the end of the {len}-byte device memory"
        )));
    }
    usize::try_from(len - offset).map_err(|_| Error::InvalidArgument(format!("{len} bytes of device memory")))
}

/// A staging buffer from the pool that holds at least `len` bytes; keeps
/// `lane`'s current one if it is large enough.
fn ensure_staging(lane: &mut Option<PooledBuffer<'static>>, mem: &dyn DeviceMemory, len: usize) -> Result<()> {
    if lane.as_ref().is_none_or(|b| b.len() < len) {
        *lane = None; // back to the pool first: the pool may hand it out again
        *lane = Some(STAGING.take(mem, len)?);
    }
    Ok(())
}

impl Store {
    /// Reads the object under `key` into device memory `dst` at byte `offset`
    /// and returns its length, like [`get_into`](Self::get_into) for GPU
    /// memory: the bytes are read (and checksum-verified) into a pinned
    /// staging buffer, then copied to the device with an asynchronous DMA;
    /// the call returns when they are in device memory.
    ///
    /// Errors: `NotFound`; `BufferTooSmall` if the object is larger than
    /// `dst.len() - offset` (nothing is copied); `InvalidArgument` if `offset`
    /// is beyond `dst`; `Transport` for a device failure.
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
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn get_into_device(&self, key: &str, dst: &dyn DeviceMemory, offset: u64) -> Result<usize> {
        let room = room_after(dst, offset)?;
        let mut lane = None;
        let n = self.stage_object(key, dst, room, &mut lane)?;
        let staged = lane.as_ref().expect("staged");
        let mut stream = dst.open_stream()?;
        // SAFETY: `staged` holds the object's `n` bytes and is neither written
        // nor returned to the pool until the stream is synchronized (below) or
        // dropped (on error: `stream` is declared after `lane`, so it drops, and
        // synchronizes, first).
        unsafe { stream.copy_to_device_async(staged.as_ptr(), n, offset)? };
        stream.synchronize()?;
        Ok(n)
    }

    /// `get_into` of `key` into the staging buffer in `lane` (grown from the
    /// pool if the object does not fit); returns the object length. At most
    /// `room` bytes are accepted.
    fn stage_object(
        &self,
        key: &str,
        mem: &dyn DeviceMemory,
        room: usize,
        lane: &mut Option<PooledBuffer<'static>>,
    ) -> Result<usize> {
        let hint = SIZE_HINT.load(Ordering::Relaxed);
        let mut want = if hint == 0 { FIRST_GUESS } else { hint }.clamp(1, room.max(1));
        // A second try has the object's size; a third covers an object
        // replaced by a larger one in between.
        for _ in 0..3 {
            ensure_staging(lane, mem, want)?;
            let buf = lane.as_mut().expect("ensured");
            let cap = buf.len().min(room);
            match self.get_into(key, &mut buf[..cap]) {
                Ok(n) => {
                    SIZE_HINT.store(n, Ordering::Relaxed);
                    return Ok(n);
                }
                // The guess was short: once more with the object's size.
                Err(Error::BufferTooSmall { needed, .. }) if needed <= room as u64 && needed as usize > cap => {
                    want = needed as usize;
                }
                Err(Error::BufferTooSmall { needed, .. }) => {
                    return Err(Error::BufferTooSmall { needed, capacity: room as u64 })
                }
                Err(e) => return Err(e),
            }
        }
        Err(Error::Timeout(format!("{key} kept changing size while it was read into device memory")))
    }

    /// Stores `len` bytes of device memory `src` at byte `offset` under
    /// `key`, with the builder's default replication (like [`put`](Self::put)):
    /// device -> pinned staging with an asynchronous DMA, then a `put` of the
    /// staged bytes. `InvalidArgument` if the range is outside `src` or empty.
    pub fn put_from_device(&self, key: &str, src: &dyn DeviceMemory, offset: u64, len: u64) -> Result<()> {
        self.put_from_device_impl(key, src, offset, len, None)
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
        self.put_from_device_impl(key, src, offset, len, Some(cfg))
    }

    fn put_from_device_impl(
        &self,
        key: &str,
        src: &dyn DeviceMemory,
        offset: u64,
        len: u64,
        cfg: Option<&ReplicateConfig>,
    ) -> Result<()> {
        check_value_len(len)?;
        src.check_range(offset, len)?;
        let n = len as usize;
        let mut lane = None;
        ensure_staging(&mut lane, src, n)?;
        let staged = lane.as_mut().expect("ensured");
        {
            let mut stream = src.open_stream()?;
            // SAFETY: `staged` has room for `n` bytes and is not touched until
            // the synchronize below (or the stream's drop on error) returns.
            unsafe { stream.copy_from_device_async(staged.as_mut_ptr(), n, offset)? };
            stream.synchronize()?;
        }
        match cfg {
            Some(cfg) => self.put_with(key, &staged[..n], cfg),
            None => self.put(key, &staged[..n]),
        }
    }

    /// Reads many objects into device memory `dst`, each `(key, offset)` at
    /// its own offset; one result (object length) per item, in order. Two
    /// staging buffers alternate, so the DMA of one object runs while the
    /// next is read from the store.
    pub fn batch_get_into_device(&self, items: &[(&str, u64)], dst: &dyn DeviceMemory) -> Vec<Result<usize>> {
        let mut results: Vec<Result<usize>> = Vec::with_capacity(items.len());
        // Declared before the stream: dropped after it (the stream's drop waits
        // for outstanding copies out of these buffers).
        let mut lanes: [Option<PooledBuffer<'static>>; 2] = [None, None];
        let mut in_flight: [Option<(Fence, usize)>; 2] = [None, None];
        let mut stream = match dst.open_stream() {
            Ok(s) => s,
            Err(e) => {
                let e = Error::from(e);
                return items.iter().map(|_| Err(e.clone())).collect();
            }
        };
        for (i, &(key, offset)) in items.iter().enumerate() {
            let l = i % 2;
            // The lane's previous copy must be done before the lane is reused.
            if let Some((fence, item)) = in_flight[l].take() {
                if let Err(e) = stream.wait(fence) {
                    results[item] = Err(e.into());
                }
            }
            let staged = room_after(dst, offset).and_then(|room| self.stage_object(key, dst, room, &mut lanes[l]));
            let res = staged.and_then(|n| {
                let buf = lanes[l].as_ref().expect("staged");
                // SAFETY: the lane is not written or released before this
                // copy's fence is waited on (top of the loop, two items on) or
                // the stream synchronized / dropped (after the loop; the
                // stream drops before `lanes`).
                unsafe { stream.copy_to_device_async(buf.as_ptr(), n, offset)? };
                in_flight[l] = Some((stream.fence()?, i));
                Ok(n)
            });
            results.push(res);
        }
        if let Err(e) = stream.synchronize() {
            let e = Error::from(e);
            for (_, item) in in_flight.iter().flatten() {
                results[*item] = Err(e.clone());
            }
        }
        drop(stream);
        results
    }

    /// Stores many device ranges, each `(key, offset, len)` of `src`, with
    /// `cfg`'s replication; one result per item, in order. The DMA of the next
    /// range overlaps the `put` of the current one.
    pub fn batch_put_from_device(
        &self,
        items: &[(&str, u64, u64)],
        src: &dyn DeviceMemory,
        cfg: &ReplicateConfig,
    ) -> Vec<Result<()>> {
        let mut lanes: [Option<PooledBuffer<'static>>; 2] = [None, None];
        let mut stream = match src.open_stream() {
            Ok(s) => s,
            Err(e) => {
                let e = Error::from(e);
                return items.iter().map(|_| Err(e.clone())).collect();
            }
        };
        let mut next =
            items.first().map(|&(_, offset, len)| enqueue_download(&mut *stream, src, &mut lanes[0], offset, len));
        let mut results = Vec::with_capacity(items.len());
        for (i, &(key, _, len)) in items.iter().enumerate() {
            let current = next.take().expect("enqueued");
            // Lane (i + 1) % 2 last held item i - 1, whose put is done.
            if let Some(&(_, offset, len)) = items.get(i + 1) {
                next = Some(enqueue_download(&mut *stream, src, &mut lanes[(i + 1) % 2], offset, len));
            }
            let res = current.and_then(|fence| {
                stream.wait(fence)?;
                let buf = lanes[i % 2].as_ref().expect("staged");
                self.put_with(key, &buf[..len as usize], cfg)
            });
            results.push(res);
        }
        drop(stream);
        results
    }
}

/// Enqueues the copy of `len` bytes at `offset` of `src` into `lane` (grown
/// from the pool if needed) and returns the fence to wait on before reading it.
fn enqueue_download(
    stream: &mut dyn DeviceStream,
    src: &dyn DeviceMemory,
    lane: &mut Option<PooledBuffer<'static>>,
    offset: u64,
    len: u64,
) -> Result<Fence> {
    check_value_len(len)?;
    src.check_range(offset, len)?;
    ensure_staging(lane, src, len as usize)?;
    let buf = lane.as_mut().expect("ensured");
    // SAFETY: the caller does not read, write or release the lane before this
    // fence is waited on, or the stream dropped (it is dropped before the lanes).
    unsafe { stream.copy_from_device_async(buf.as_mut_ptr(), len as usize, offset)? };
    Ok(stream.fence()?)
}
