//! The staged way between device memory and the store: pinned host buffers.
//!
//! A get reads the object into a pinned (page-locked) host staging buffer with
//! [`Store::get_into`] and then copies it to the device asynchronously on a
//! stream; a put copies device -> pinned and then [`Store::put`]s the staged
//! bytes. Staging buffers come from a process-wide [`PinnedPool`] (pinned memory
//! costs milliseconds per MiB to allocate; a 64 MiB KV block must not pay that on
//! every call), so steady state allocates nothing.
//!
//! The batch forms pipeline over two staging buffers: the DMA of one object
//! overlaps the store read (or the store write) of the next.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::LazyLock;

use mooncake_gpu::{DeviceMemory, DeviceStream, Fence, PinnedPool, PooledBuffer};

use crate::config::{check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::ReplicaList;
use crate::store::Store;

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

/// Bytes of `mem` from `offset` to its end; `InvalidArgument` if the offset
/// lies beyond it.
pub(super) fn room_after(mem: &dyn DeviceMemory, offset: u64) -> Result<usize> {
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

/// `len` bytes at `offset` of `src` (a range already checked) copied into a
/// staging buffer; returns once the copy is done.
pub(super) fn download(src: &dyn DeviceMemory, offset: u64, len: usize) -> Result<PooledBuffer<'static>> {
    let mut lane = None;
    ensure_staging(&mut lane, src, len)?;
    let mut staged = lane.expect("ensured");
    let mut stream = src.open_stream()?;
    // SAFETY: `staged` has room for `len` bytes and is not touched until the
    // synchronize below (or the stream's drop on error, which waits) returns.
    unsafe { stream.copy_from_device_async(staged.as_mut_ptr(), len, offset)? };
    stream.synchronize()?;
    drop(stream);
    Ok(staged)
}

impl Store {
    /// `get_into_device` through pinned staging: the object is read (and
    /// checksum-verified) into a staging buffer, then copied to the device with
    /// an asynchronous DMA; returns when the bytes are in device memory. `room`
    /// is what `dst` holds from `offset` on.
    pub(super) fn get_staged(&self, key: &str, dst: &dyn DeviceMemory, offset: u64, room: usize) -> Result<usize> {
        let mut lane = None;
        let n = self.stage_object(key, dst, room, &mut lane)?;
        let staged = lane.as_ref().expect("staged");
        upload(dst, staged, n, offset)?;
        Ok(n)
    }

    /// The object of `list` read through staging into `dst` at `offset` (which
    /// has room for it): for a get whose list is known, when no replica can be
    /// read straight into device memory. The caller counts the get.
    pub(super) fn stage_list(
        &self,
        key: &str,
        list: &ReplicaList,
        dst: &dyn DeviceMemory,
        offset: u64,
    ) -> Result<usize> {
        let n = list.len as usize;
        let mut lane = None;
        ensure_staging(&mut lane, dst, n)?;
        let staged = lane.as_mut().expect("ensured");
        self.inner.read_replicas(key, list, &mut staged[..n])?;
        upload(dst, staged, n, offset)?;
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

    /// `put_from_device` through pinned staging: device -> pinned with an
    /// asynchronous DMA, then a `put` of the staged bytes (a range already
    /// checked).
    pub(super) fn put_staged(
        &self,
        key: &str,
        src: &dyn DeviceMemory,
        offset: u64,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Result<()> {
        let n = len as usize;
        let staged = download(src, offset, n)?;
        self.put_with(key, &staged[..n], cfg)
    }

    /// `batch_get_into_device` through staging: two staging buffers alternate,
    /// so the DMA of one object runs while the next is read from the store.
    pub(super) fn batch_get_staged(&self, items: &[(&str, u64)], dst: &dyn DeviceMemory) -> Vec<Result<usize>> {
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

    /// `batch_put_from_device` through staging: the DMA of the next range
    /// overlaps the `put` of the current one.
    pub(super) fn batch_put_staged(
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

/// Copies the first `n` bytes of `staged` to `offset` of `dst` and waits for it.
fn upload(dst: &dyn DeviceMemory, staged: &PooledBuffer<'static>, n: usize, offset: u64) -> Result<()> {
    let mut stream = dst.open_stream()?;
    // SAFETY: `staged` holds `n` bytes and is neither written nor returned to the
    // pool until the stream is synchronized (below) or dropped (on error: the
    // stream's drop synchronizes, and it drops before the caller's buffer).
    unsafe { stream.copy_to_device_async(staged.as_ptr(), n, offset)? };
    stream.synchronize()?;
    Ok(())
}
