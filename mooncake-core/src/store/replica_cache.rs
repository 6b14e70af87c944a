//! Replica lists of recent gets, reused for a while: a repeated get of a hot object
//! (a shared prompt prefix read by every request) goes straight to the replica, one
//! round trip instead of two.
//!
//! The master's read lease covers only the read that asked for the list (it is given
//! back as soon as that read is over), so a kept list is not protected: the object
//! may be removed or evicted, and its memory reused, while the list is kept. Reading
//! through a kept list is still safe because every read is checked against the
//! object's checksum, which the list carries: memory that now holds other bytes fails
//! the check (a torn read of memory being rewritten too), the list is forgotten and
//! the master is asked, exactly as after a failed uncached read. What a kept list can
//! return is therefore only ever the object's own bytes; the one difference from an
//! uncached get is that those bytes may be returned up to one lease period
//! (`MasterConfig::default_lease`) after another client removed the object, while
//! its memory was not yet reused. A client's own `remove` or `upsert` forgets the list
//! at once, and a list asked for before that (by a get racing with it) is not kept.
//! What no lease covers either (the owner of a replica dies, the master restarts) is
//! caught the same way, by the checksum and the transport.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::master::ReplicaList;

/// Lists whose lease ends within this are not reused (slack for a read under way).
const MIN_LEFT: Duration = Duration::from_millis(5);

/// Slots that remember when keys hashing to them were last forgotten.
const FORGET_SLOTS: usize = 256;

/// A kept list and until when it may be used.
type Leased = (Arc<ReplicaList>, Instant);

pub(super) struct ReplicaCache {
    capacity: usize,
    lists: Mutex<HashMap<Box<str>, Leased>>,
    hits: AtomicU64,
    /// When the keys of each slot were last forgotten (ns since `base`): a list asked
    /// for before that may predate the change that made us forget (a get racing with
    /// this client's remove or upsert) and is not kept.
    forgotten: Box<[AtomicU64]>,
    base: Instant,
    router: ahash::RandomState,
}

/// Whether two lists name the same object in the same places.
fn same_list(a: &ReplicaList, b: &ReplicaList) -> bool {
    a.len == b.len && a.checksum == b.checksum && a.replicas == b.replicas
}

impl ReplicaCache {
    /// A cache of at most `capacity` lists (0: none is kept).
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            capacity,
            lists: Mutex::new(HashMap::new()),
            hits: AtomicU64::new(0),
            forgotten: (0..FORGET_SLOTS).map(|_| AtomicU64::new(0)).collect(),
            base: Instant::now(),
            router: ahash::RandomState::new(),
        }
    }

    /// The slot remembering when `key` was last forgotten.
    fn forgotten_slot(&self, key: &str) -> &AtomicU64 {
        &self.forgotten[(self.router.hash_one(key) as usize) % FORGET_SLOTS]
    }

    /// Nanoseconds from the cache's creation to `t` (0 before it).
    fn since_base(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.base).as_nanos() as u64
    }

    /// The list of `key`, if it is still young enough.
    pub(super) fn get(&self, key: &str) -> Option<Arc<ReplicaList>> {
        if self.capacity == 0 {
            return None;
        }
        let lists = self.lists.lock();
        let (list, until) = lists.get(key)?;
        (Instant::now() + MIN_LEFT < *until).then(|| list.clone())
    }

    /// Keeps `list`, answered to a call sent at `asked_at`, for its lease period.
    /// Lists with memory replicas only (a disk-only object is read from its owner's
    /// SSD, which checks it anyway).
    pub(super) fn insert(&self, key: &str, list: Arc<ReplicaList>, asked_at: Instant) {
        if self.capacity == 0 || list.lease <= MIN_LEFT || list.replicas.is_empty() {
            return;
        }
        let until = asked_at + list.lease;
        let now = Instant::now();
        if until <= now + MIN_LEFT {
            return;
        }
        let mut lists = self.lists.lock();
        // Checked under the lock `forget` takes: a forget is either seen here or
        // removes what is inserted here.
        if self.forgotten_slot(key).load(Ordering::Acquire) >= self.since_base(asked_at) {
            return;
        }
        match lists.get(key) {
            Some((kept, _)) if same_list(kept, &list) => return,
            Some(_) => {
                // Two gets of this client met with different lists of one key (it
                // was replaced meanwhile). Which is newer cannot be told: the master
                // answers a key's calls in order, but they need not arrive in order.
                // Keep neither, nor any list asked for until now, so that no reader
                // ever goes back from bytes it read to older ones.
                self.forgotten_slot(key).fetch_max(self.since_base(now), Ordering::AcqRel);
                lists.remove(key);
                return;
            }
            None => {}
        }
        if lists.len() >= self.capacity {
            lists.retain(|_, (_, u)| *u > now);
            if lists.len() >= self.capacity {
                // Every entry is live: make room by dropping an arbitrary one, and
                // keep no older list of it either (as a forget).
                if let Some(k) = lists.keys().next().cloned() {
                    self.forgotten_slot(&k).fetch_max(self.since_base(now), Ordering::AcqRel);
                    lists.remove(&k);
                }
            }
        }
        lists.insert(key.into(), (list, until));
    }

    /// Forgets `key` (a read through its list failed, or it was removed or
    /// replaced); lists of it asked for until now are not kept either.
    pub(super) fn forget(&self, key: &str) {
        if self.capacity > 0 {
            let mut lists = self.lists.lock();
            self.forgotten_slot(key).fetch_max(self.since_base(Instant::now()), Ordering::AcqRel);
            lists.remove(key);
        }
    }

    /// Forgets everything, and lists asked for until now.
    pub(super) fn clear(&self) {
        let mut lists = self.lists.lock();
        let now = self.since_base(Instant::now());
        for slot in self.forgotten.iter() {
            slot.fetch_max(now, Ordering::AcqRel);
        }
        lists.clear();
    }

    pub(super) fn hit(&self) {
        self.hits.fetch_add(1, Ordering::Relaxed);
    }

    /// Gets served through a kept list.
    pub(super) fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(lease_ms: u64, replicas: usize) -> ReplicaList {
        ReplicaList {
            len: 1,
            checksum: 0,
            replicas: (0..replicas)
                .map(|i| crate::master::MemoryReplica { segment: 1, offset: i as u64, len: 1 })
                .collect(),
            lease: Duration::from_millis(lease_ms),
            disk: None,
        }
    }

    impl ReplicaCache {
        fn insert_owned(&self, key: &str, list: ReplicaList, asked_at: Instant) {
            self.insert(key, Arc::new(list), asked_at)
        }
    }

    #[test]
    fn lists_live_exactly_as_long_as_their_lease() {
        let c = ReplicaCache::new(8);
        let asked = Instant::now();
        c.insert_owned("a", list(60, 1), asked);
        c.insert_owned("disk-only", list(60, 0), asked);
        c.insert_owned("no-lease", list(0, 1), asked);
        assert!(c.get("a").is_some());
        assert!(c.get("disk-only").is_none(), "disk replicas are not lease-protected");
        assert!(c.get("no-lease").is_none());
        std::thread::sleep(Duration::from_millis(60));
        assert!(c.get("a").is_none(), "expired with its lease");
        c.insert_owned("b", list(1000, 1), Instant::now());
        c.forget("b");
        assert!(c.get("b").is_none());
    }

    #[test]
    fn a_list_asked_for_before_a_forget_is_not_kept() {
        let c = ReplicaCache::new(8);
        let asked = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        // A remove or upsert of this client lands while the get is under way.
        c.forget("k");
        c.insert_owned("k", list(1000, 1), asked);
        assert!(c.get("k").is_none(), "a list older than the forget was kept");
        // A list asked for after the forget is kept.
        c.insert_owned("k", list(1000, 1), Instant::now());
        assert!(c.get("k").is_some());
    }

    #[test]
    fn two_different_lists_of_a_key_keep_neither() {
        let c = ReplicaCache::new(8);
        let older = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        let newer = Instant::now();
        let mut replaced = list(1000, 1);
        replaced.checksum = 2;
        c.insert_owned("k", replaced.clone(), newer);
        // The same list again is kept.
        c.insert_owned("k", replaced, Instant::now());
        assert_eq!(c.get("k").map(|l| l.checksum), Some(2));
        // A get that asked first (the old object) finishes last: neither is kept,
        // nor the old list when it comes back.
        c.insert_owned("k", list(1000, 1), older);
        assert!(c.get("k").is_none());
        c.insert_owned("k", list(1000, 1), older);
        assert!(c.get("k").is_none(), "an older list came back after the meeting");
    }

    #[test]
    fn capacity_is_a_bound_and_zero_disables() {
        let c = ReplicaCache::new(4);
        for i in 0..20 {
            c.insert_owned(&format!("k{i}"), list(10_000, 1), Instant::now());
        }
        assert!(c.lists.lock().len() <= 4);
        assert!(c.get("k19").is_some(), "the newest is kept");
        let off = ReplicaCache::new(0);
        off.insert_owned("k", list(10_000, 1), Instant::now());
        assert!(off.get("k").is_none());
    }
}
