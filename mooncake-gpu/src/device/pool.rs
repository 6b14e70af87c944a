//! [`PinnedPool`]: pinned staging buffers kept for reuse.

use parking_lot::Mutex;

use super::{DeviceMemory, PinnedBuffer};
use crate::error::Result;

/// Smallest buffer a [`PinnedPool`] allocates.
const MIN_POOLED: usize = 64 << 10;

/// Size a pool allocates for a request of `len` bytes: a power of two from
/// 64 KiB up to 64 MiB, whole MiB beyond (so sizes repeat and buffers get
/// reused, without doubling huge requests).
fn pool_class(len: usize) -> usize {
    if len <= 64 << 20 {
        len.max(MIN_POOLED).next_power_of_two()
    } else {
        len.div_ceil(1 << 20).saturating_mul(1 << 20)
    }
}

/// Pinned buffers kept for reuse (allocating page-locked memory costs
/// milliseconds per MiB; a 64 MiB object must not pay it on every copy).
///
/// [`take`](Self::take) hands out the smallest idle buffer that fits (one
/// that is page-locked when the memory is a real device), or allocates one
/// from the memory; the buffer comes back when the [`PooledBuffer`] drops.
/// At most `max_idle_bytes` stay idle; the oldest go first.
#[derive(Debug)]
pub struct PinnedPool {
    max_idle_bytes: usize,
    idle: Mutex<Vec<PinnedBuffer>>,
}

impl PinnedPool {
    /// A pool keeping at most `max_idle_bytes` of idle buffers.
    pub fn new(max_idle_bytes: usize) -> Self {
        Self { max_idle_bytes, idle: Mutex::new(Vec::new()) }
    }

    /// A buffer of at least `len` bytes suited to copies with `mem` (its
    /// contents are whatever the last user left).
    pub fn take<M: DeviceMemory + ?Sized>(&self, mem: &M, len: usize) -> Result<PooledBuffer<'_>> {
        let need_locked = !mem.location().is_emulated();
        let reused = {
            let mut idle = self.idle.lock();
            idle.iter()
                .enumerate()
                .filter(|(_, b)| b.len() >= len && (b.is_page_locked() || !need_locked))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i)
                .map(|i| idle.remove(i))
        };
        let buf = match reused {
            Some(b) => b,
            None => mem.alloc_pinned(pool_class(len))?,
        };
        Ok(PooledBuffer { buf: Some(buf), pool: self })
    }

    /// Bytes of idle buffers held now.
    pub fn idle_bytes(&self) -> usize {
        self.idle.lock().iter().map(|b| b.len()).sum()
    }

    /// Frees every idle buffer.
    pub fn clear(&self) {
        let freed = std::mem::take(&mut *self.idle.lock());
        drop(freed);
    }

    fn give_back(&self, buf: PinnedBuffer) {
        if buf.len() > self.max_idle_bytes {
            return;
        }
        let mut evicted = Vec::new();
        {
            let mut idle = self.idle.lock();
            let mut total: usize = idle.iter().map(|b| b.len()).sum::<usize>() + buf.len();
            while total > self.max_idle_bytes && !idle.is_empty() {
                let old = idle.remove(0);
                total -= old.len();
                evicted.push(old);
            }
            idle.push(buf);
        }
        // Freed outside the lock (cuMemFreeHost is slow).
        drop(evicted);
    }
}

/// A buffer lent by a [`PinnedPool`]; goes back to it on drop.
#[derive(Debug)]
pub struct PooledBuffer<'a> {
    buf: Option<PinnedBuffer>,
    pool: &'a PinnedPool,
}

impl std::ops::Deref for PooledBuffer<'_> {
    type Target = PinnedBuffer;
    fn deref(&self) -> &PinnedBuffer {
        self.buf.as_ref().expect("present until drop")
    }
}

impl std::ops::DerefMut for PooledBuffer<'_> {
    fn deref_mut(&mut self) -> &mut PinnedBuffer {
        self.buf.as_mut().expect("present until drop")
    }
}

impl Drop for PooledBuffer<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            self.pool.give_back(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostDeviceMemory;

    #[test]
    fn pool_classes_and_reuse() {
        assert_eq!(pool_class(1), 64 << 10);
        assert_eq!(pool_class((64 << 10) + 1), 128 << 10);
        assert_eq!(pool_class(64 << 20), 64 << 20);
        assert_eq!(pool_class((64 << 20) + 1), (64 << 20) + (1 << 20));
        let mem = HostDeviceMemory::new(1).unwrap();
        let pool = PinnedPool::new(1 << 20);
        let p = pool.take(&mem, 100_000).unwrap().as_ptr();
        assert_eq!(pool.idle_bytes(), 128 << 10);
        // The same buffer serves a smaller request.
        assert_eq!(pool.take(&mem, 10).unwrap().as_ptr(), p);
        // Two at once: the second is fresh; both come back within the bound.
        let (a, b) = (pool.take(&mem, 100_000).unwrap(), pool.take(&mem, 100_000).unwrap());
        assert_ne!(a.as_ptr(), b.as_ptr());
        drop((a, b));
        assert_eq!(pool.idle_bytes(), 256 << 10);
        // Larger than the bound: not kept.
        drop(pool.take(&mem, 2 << 20).unwrap());
        assert_eq!(pool.idle_bytes(), 256 << 10);
        // Fill past the bound: the oldest go.
        let held: Vec<_> = (0..9).map(|_| pool.take(&mem, 100_000).unwrap()).collect();
        drop(held);
        assert!(pool.idle_bytes() <= 1 << 20);
        pool.clear();
        assert_eq!(pool.idle_bytes(), 0);
    }
}
