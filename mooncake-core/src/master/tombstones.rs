//! Tombstones of keys removed while they had a disk replica.

use std::sync::atomic::Ordering;

/// Most tombstones kept; the oldest go first beyond it.
const MAX_TOMBSTONES: usize = 1 << 20;

/// Keys removed while they had a disk replica. The SSD holding it may be away (its
/// node down) and miss the order to delete the file; when it comes back and
/// announces the file, the key is refused (and the node deletes it) instead of the
/// object returning. A new put of the key clears its tombstone.
#[derive(Default)]
pub(crate) struct Tombstones {
    set: parking_lot::Mutex<TombstoneSet>,
    /// Whether `set` may hold anything: puts skip its lock while it is empty.
    any: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct TombstoneSet {
    keys: ahash::HashSet<Box<str>>,
    /// Insertion order, to forget the oldest beyond [`MAX_TOMBSTONES`] (may name keys
    /// since cleared: they just age out).
    order: std::collections::VecDeque<Box<str>>,
}

impl Tombstones {
    pub(crate) fn insert(&self, key: &str) {
        let mut set = self.set.lock();
        if set.keys.insert(key.into()) {
            set.order.push_back(key.into());
        }
        while set.order.len() > MAX_TOMBSTONES {
            if let Some(old) = set.order.pop_front() {
                set.keys.remove(&old);
            }
        }
        self.any.store(true, Ordering::Release);
    }

    pub(crate) fn remove(&self, key: &str) {
        if self.any.load(Ordering::Acquire) {
            let mut set = self.set.lock();
            set.keys.remove(key);
            if set.keys.is_empty() {
                set.order.clear();
                self.any.store(false, Ordering::Release);
            }
        }
    }

    pub(crate) fn contains(&self, key: &str) -> bool {
        self.any.load(Ordering::Acquire) && self.set.lock().keys.contains(key)
    }
}
