//! Pinned host memory between device memory and the store's transports.
//!
//! Device bytes that no transport can move directly are staged: a put copies them
//! device -> pinned with an asynchronous DMA and the write engine writes the
//! pinned copy; a get reads the object (and checks it) into a pinned buffer, then
//! DMAs it to the device. Staging buffers come from a process-wide [`PinnedPool`]
//! (pinned memory costs milliseconds per MiB to allocate; a 64 MiB KV block must
//! not pay that on every call), so steady state allocates nothing.

use std::sync::LazyLock;

use mooncake_gpu::{DeviceMemory, DeviceStream, PinnedPool, PooledBuffer};

use crate::error::{Error, Result};

/// Idle pinned staging kept for device copies, per process (two 64 MiB
/// objects).
const STAGING_IDLE_BYTES: usize = 128 << 20;

static STAGING: LazyLock<PinnedPool> = LazyLock::new(|| PinnedPool::new(STAGING_IDLE_BYTES));

/// Bytes of `mem` from `offset` to its end; `InvalidArgument` if the offset
/// lies beyond it.
pub(in crate::store) fn room_after(mem: &dyn DeviceMemory, offset: u64) -> Result<usize> {
    let len = mem.len();
    if offset > len {
        return Err(Error::InvalidArgument(format!(
            "device offset {offset} is beyond the end of the {len}-byte device memory"
        )));
    }
    usize::try_from(len - offset).map_err(|_| Error::InvalidArgument(format!("{len} bytes of device memory")))
}

/// A staging buffer of at least `len` bytes, for copies to or from `mem`.
pub(in crate::store) fn staging(mem: &dyn DeviceMemory, len: usize) -> Result<PooledBuffer<'static>> {
    Ok(STAGING.take(mem, len)?)
}

/// `len` bytes at `offset` of `src` (a range already checked) copied into a
/// staging buffer; returns once the copy is done.
pub(in crate::store) fn download(src: &dyn DeviceMemory, offset: u64, len: usize) -> Result<PooledBuffer<'static>> {
    let mut staged = staging(src, len)?;
    let mut stream = src.open_stream()?;
    // SAFETY: `staged` has room for `len` bytes and is not touched until the
    // synchronize below (or the stream's drop on error, which waits) returns.
    unsafe { stream.copy_from_device_async(staged.as_mut_ptr(), len, offset)? };
    stream.synchronize()?;
    drop(stream);
    Ok(staged)
}

/// Staged objects on their way to device memory: every copy is enqueued at once
/// (one stream per device memory) and waited for once, in [`Uploads::finish`].
#[derive(Default)]
pub(in crate::store) struct Uploads<'a> {
    /// One stream per device memory written (by its device address).
    streams: Vec<(u64, Box<dyn DeviceStream + 'a>)>,
    /// The buffers being copied out of, with the item each belongs to and its
    /// stream: kept until the copies are done.
    pending: Vec<(usize, usize, PooledBuffer<'static>)>,
}

impl<'a> Uploads<'a> {
    /// Enqueues the copy of the first `len` bytes of `staged` to `offset` of `dst`
    /// (which has room for them), for item `item`.
    pub(in crate::store) fn push(
        &mut self,
        item: usize,
        dst: &'a dyn DeviceMemory,
        staged: PooledBuffer<'static>,
        len: usize,
        offset: u64,
    ) -> Result<()> {
        let at = match self.streams.iter().position(|(ptr, _)| *ptr == dst.device_ptr()) {
            Some(at) => at,
            None => {
                self.streams.push((dst.device_ptr(), dst.open_stream()?));
                self.streams.len() - 1
            }
        };
        // SAFETY: `staged` holds `len` bytes and is kept in `pending`, neither
        // written nor returned to the pool, until `finish` has synchronized the
        // stream (or the stream is dropped: its drop waits for the copy, and
        // `streams` is declared, so dropped, before `pending`).
        unsafe { self.streams[at].1.copy_to_device_async(staged.as_ptr(), len, offset)? };
        self.pending.push((item, at, staged));
        Ok(())
    }

    /// Waits for every copy; returns the items whose copy failed, with why.
    pub(in crate::store) fn finish(mut self) -> Vec<(usize, Error)> {
        let mut failed = Vec::new();
        for (at, (_, stream)) in self.streams.iter_mut().enumerate() {
            if let Err(e) = stream.synchronize() {
                let e = Error::from(e);
                failed.extend(self.pending.iter().filter(|p| p.1 == at).map(|p| (p.0, e.clone())));
            }
        }
        self.streams.clear();
        failed
    }
}
