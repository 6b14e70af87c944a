//! Recycled read buffers for `get` and `batch_get`.
//!
//! A get must hand out memory it owns (`Bytes`). A fresh large allocation costs a
//! page fault and a page clear per 4 KiB the first time it is written, which for a
//! 4 MiB object takes about as long as the copy itself. KV-cache blocks come in a few
//! sizes, so buffers are recycled: when the caller drops the `Bytes`, its buffer goes
//! back to a per-size-class free list (bounded), and the next get of that class
//! reuses memory that is already faulted in.

use bytes::Bytes;
use parking_lot::Mutex;

/// Objects smaller than this use plain allocations (no page faults to save).
const MIN_POOLED: usize = 64 << 10;
/// Size classes: powers of two from 64 KiB to 64 MiB.
const CLASSES: usize = 11;
/// Bytes a class may keep idle.
const IDLE_BYTES_PER_CLASS: usize = 64 << 20;

static POOL: [Mutex<Vec<Vec<u8>>>; CLASSES] = [const { Mutex::new(Vec::new()) }; CLASSES];

fn class_of(len: usize) -> Option<usize> {
    if len < MIN_POOLED {
        return None;
    }
    let class = (len.next_power_of_two().trailing_zeros() - MIN_POOLED.trailing_zeros()) as usize;
    (class < CLASSES).then_some(class)
}

/// A buffer of at least `len` initialized bytes (contents unspecified: the caller
/// overwrites the first `len` before exposing them).
pub(super) fn take(len: usize) -> Vec<u8> {
    match class_of(len) {
        Some(c) => POOL[c].lock().pop().unwrap_or_else(|| vec![0u8; MIN_POOLED << c]),
        None => vec![0u8; len],
    }
}

/// A pooled buffer exposed as its first `len` bytes; returns to the pool on drop.
struct Recycled {
    buf: Vec<u8>,
    len: usize,
}

impl AsRef<[u8]> for Recycled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        if let Some(c) = class_of(buf.len()).filter(|&c| buf.len() == MIN_POOLED << c) {
            let mut free = POOL[c].lock();
            if (free.len() + 1) * buf.len() <= IDLE_BYTES_PER_CLASS.max(buf.len()) {
                free.push(buf);
            }
        }
    }
}

/// The first `len` bytes of `buf` as `Bytes`; a pooled buffer goes back to the
/// pool when the last clone of the `Bytes` is dropped.
pub(super) fn freeze(mut buf: Vec<u8>, len: usize) -> Bytes {
    if class_of(buf.len()).is_some_and(|c| buf.len() == MIN_POOLED << c) {
        Bytes::from_owner(Recycled { buf, len })
    } else {
        buf.truncate(len);
        Bytes::from(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_recycled_and_expose_only_their_length() {
        let len = 100_000;
        let mut b = take(len);
        assert!(b.len() >= len);
        b[..len].fill(7);
        let ptr = b.as_ptr();
        let bytes = freeze(b, len);
        assert_eq!(bytes.len(), len);
        assert!(bytes.iter().all(|&x| x == 7));
        drop(bytes);
        // The same memory comes back for the same class (no other user of the pool
        // in this test's class size).
        let again = take(len + 1);
        assert_eq!(again.as_ptr(), ptr);
        let small = freeze(take(10), 10);
        assert_eq!(small.len(), 10);
    }
}
