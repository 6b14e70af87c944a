//! Pinned host memory between device memory and the store's transports.
//!
//! Device bytes that no transport can move directly are staged: a get from disk
//! reads the object (and checks it) into a pinned buffer, then DMAs it to the
//! device; `stream.rs` streams transport reads and writes through two such
//! buffers. Staging buffers come from a process-wide [`PinnedPool`]
//! (pinned memory costs milliseconds per MiB to allocate; a 64 MiB KV block must
//! not pay that on every call), so steady state allocates nothing.

use std::sync::{Arc, LazyLock};

use mooncake_gpu::{DeviceMemory, DeviceRange, DeviceStream, PinnedPool, PooledBuffer};

use super::pinned::PinnedRegion;
use super::stream::stream_of;
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

/// What a device copy reads from or writes to on the host, kept until the copy is
/// done (held, never read).
#[allow(dead_code)]
pub(in crate::store) enum Keep {
    /// A pinned staging buffer.
    Staged(PooledBuffer<'static>),
    /// A replica's region, mapped and page-locked.
    Mapped(Arc<PinnedRegion>),
}

/// Copies between host and device memory, enqueued at once (one stream per
/// device memory) and waited for once, in [`Copies::finish`].
#[derive(Default)]
pub(in crate::store) struct Copies<'a> {
    /// One stream per device memory object (see `stream_of`).
    streams: Vec<(usize, Box<dyn DeviceStream + 'a>)>,
    /// What each copy needs alive, with the item it belongs to and its stream.
    /// Declared after `streams`, so dropped after them (a stream's drop waits
    /// for its copies).
    pending: Vec<(usize, usize, Keep)>,
    /// The device ranges to sum once the copies are done (see
    /// [`sum_after`](Self::sum_after)).
    sums: Vec<Sum<'a>>,
}

/// A device range to sum once the copies of its stream are done.
struct Sum<'a> {
    item: usize,
    /// The stream of its memory (an index into `streams`).
    at: usize,
    mem: &'a dyn DeviceMemory,
    offset: u64,
    len: u64,
}

/// What [`Copies::finish`] found.
#[derive(Default)]
pub(in crate::store) struct Finished {
    /// The items whose copy (or sum) failed, with why.
    pub failed: Vec<(usize, Error)>,
    /// The sums asked for with [`Copies::sum_after`], by item.
    pub sums: Vec<(usize, u32)>,
}

impl<'a> Copies<'a> {
    /// Enqueues the copy of `len` bytes at `src` to `offset` of `dst` (which has
    /// room for them), for item `item`.
    ///
    /// # Safety
    /// `src` is valid for reads of `len` bytes while `keep` lives, and is not
    /// written until [`finish`](Self::finish) returns.
    pub(in crate::store) unsafe fn enqueue_upload(
        &mut self,
        item: usize,
        dst: &'a dyn DeviceMemory,
        src: *const u8,
        len: usize,
        offset: u64,
        keep: Keep,
    ) -> Result<()> {
        let at = stream_of(&mut self.streams, dst)?;
        // SAFETY: the caller's contract; `keep` is held in `pending` until the
        // stream is synchronized (`finish`) or dropped (which waits).
        unsafe { self.streams[at].1.copy_to_device_async(src, len, offset)? };
        self.pending.push((item, at, keep));
        Ok(())
    }

    /// Enqueues the copy of `len` bytes at `offset` of `src` (a checked range) to
    /// `dst`, for item `item`.
    ///
    /// # Safety
    /// `dst` is valid for writes of `len` bytes while `keep` lives, and nothing
    /// else reads or writes it until [`finish`](Self::finish) returns.
    pub(in crate::store) unsafe fn enqueue_download(
        &mut self,
        item: usize,
        src: &'a dyn DeviceMemory,
        dst: *mut u8,
        len: usize,
        offset: u64,
        keep: Keep,
    ) -> Result<()> {
        let at = stream_of(&mut self.streams, src)?;
        // SAFETY: as `enqueue_upload`.
        unsafe { self.streams[at].1.copy_from_device_async(dst, len, offset)? };
        self.pending.push((item, at, keep));
        Ok(())
    }

    /// The item of each copy enqueued, in order (an item with several copies
    /// comes as often).
    pub(in crate::store) fn items(&self) -> impl Iterator<Item = usize> + '_ {
        self.pending.iter().map(|&(item, _, _)| item)
    }

    /// Asks for the crc32c of the `len` bytes at `offset` of `mem` (a checked
    /// range), for item `item`, once the copies enqueued to `mem` are done: a
    /// get's check of what it copied in, given by [`finish`](Self::finish).
    /// Where the device can chain the sum behind the copies
    /// ([`DeviceStream::synchronize_and_crc32c`]), one wait covers both.
    pub(in crate::store) fn sum_after(
        &mut self,
        item: usize,
        mem: &'a dyn DeviceMemory,
        offset: u64,
        len: u64,
    ) -> Result<()> {
        let at = stream_of(&mut self.streams, mem)?;
        self.sums.push(Sum { item, at, mem, offset, len });
        Ok(())
    }

    /// Waits for every copy and takes the sums asked for: on several memories of
    /// one device in one batch after every copy ([`across_memories`]), else a
    /// stream's in one batch behind its copies where it can. The items whose copy
    /// or sum failed, with why, and the sums.
    ///
    /// [`across_memories`]: Self::across_memories
    pub(in crate::store) fn finish(mut self) -> Finished {
        let mut done = Finished::default();
        let across = self.across_memories();
        // Every copy first where one batch sums them all; else each stream's sums
        // go behind its copies, and the stream is waited for after them.
        let synced_first = across.is_some();
        if synced_first {
            self.synchronize_each(&mut done);
        }
        let summed = match across.map(|ranges| mooncake_gpu::crc32c_of_device_ranges(&ranges)) {
            Some(Ok(Some(crcs))) => {
                done.sums.extend(self.sums.iter().map(|s| s.item).zip(crcs));
                true
            }
            Some(Err(e)) => {
                let e = Error::from(e);
                done.failed.extend(self.sums.iter().map(|s| (s.item, e.clone())));
                true
            }
            // The device declined them: each stream's below (its copies are done).
            Some(Ok(None)) | None => false,
        };
        for (at, (_, stream)) in self.streams.iter_mut().enumerate() {
            let sums: Vec<&Sum<'_>> = self.sums.iter().filter(|s| s.at == at).collect();
            if summed || sums.is_empty() {
                continue;
            }
            let ranges: Vec<(u64, u64)> = sums.iter().map(|s| (s.offset, s.len)).collect();
            // A stream that cannot chain them has waited: its memory (every sum of
            // one stream is of its one memory) sums them.
            let crcs = stream.synchronize_and_crc32c(&ranges).and_then(|chained| match chained {
                Some(crcs) => Ok(crcs),
                None => sums[0].mem.crc32c_each(&ranges),
            });
            match crcs {
                Ok(crcs) => done.sums.extend(sums.iter().map(|s| s.item).zip(crcs)),
                Err(e) => {
                    let e = Error::from(e);
                    done.failed.extend(sums.iter().map(|s| (s.item, e.clone())));
                }
            }
        }
        if !synced_first {
            self.synchronize_each(&mut done);
        }
        self.streams.clear();
        done
    }

    /// Waits for each stream; a stream that failed fails the items of its copies.
    fn synchronize_each(&mut self, done: &mut Finished) {
        for (at, (_, stream)) in self.streams.iter_mut().enumerate() {
            if let Err(e) = stream.synchronize() {
                let e = Error::from(e);
                done.failed.extend(self.pending.iter().filter(|p| p.1 == at).map(|p| (p.0, e.clone())));
            }
        }
    }

    /// The device ranges of every sum asked for, where they lie on several
    /// memories (a batch's objects, each its own memory, as per-layer tensors
    /// are) and every one is device ranges: then one batch on the device sums
    /// them all after every copy, where each memory's would take a wait of its
    /// own (the device may still decline: ranges of several devices, no GPU).
    fn across_memories(&self) -> Option<Vec<Vec<DeviceRange>>> {
        let first = self.sums.first()?.at;
        if self.sums.iter().all(|s| s.at == first) {
            return None;
        }
        self.sums.iter().map(|s| s.mem.device_ranges(s.offset, s.len)).collect()
    }
}
