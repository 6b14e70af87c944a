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
//!
//! No reader goes back from bytes it read to older ones. The master answers a key's
//! calls in order, but answers to calls sent at nearly the same time need not arrive
//! in that order, so every list a get read through is entered here, kept or not: one
//! that may not be reused (asked for before a forget, too short a lease, no memory
//! replica) stays as a *floor* that is never served. A list that differs from the
//! entered one is newer only if it was asked for after that one was entered; if not,
//! which is newer cannot be told, and neither is kept, nor any list asked for until
//! then.

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

/// The last list of a key that a get of this client read through.
struct Entry {
    list: Arc<ReplicaList>,
    /// When it was entered: its answer had come, so the master had answered it.
    entered: Instant,
    /// Until when it may be reused; `None` for a floor, which is never reused.
    until: Option<Instant>,
}

pub(super) struct ReplicaCache {
    capacity: usize,
    lists: Mutex<HashMap<Box<str>, Entry>>,
    hits: AtomicU64,
    /// When the keys of each slot were last forgotten (ns since `base`): a list asked
    /// for before that may predate the change that made us forget (a get racing with
    /// this client's remove or upsert, or with a list it could not order) and is not
    /// reused.
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

    /// Marks `key` forgotten at `now`: no list of it asked for until then is reused.
    fn mark_forgotten(&self, key: &str, now: Instant) {
        self.forgotten_slot(key).fetch_max(self.since_base(now), Ordering::AcqRel);
    }

    /// The list of `key`, if it is still young enough.
    pub(super) fn get(&self, key: &str) -> Option<Arc<ReplicaList>> {
        self.get_at(key, Instant::now())
    }

    fn get_at(&self, key: &str, now: Instant) -> Option<Arc<ReplicaList>> {
        if self.capacity == 0 {
            return None;
        }
        let lists = self.lists.lock();
        let entry = lists.get(key)?;
        entry.until.filter(|until| now + MIN_LEFT < *until).map(|_| entry.list.clone())
    }

    /// Enters `list`, answered to a call sent at `asked_at`, which a get has just
    /// read through. It is reused for its lease period if it has memory replicas (a
    /// disk-only object is read from its owner's SSD, which checks it anyway), a
    /// lease, and was asked for after the last forget of its key.
    pub(super) fn insert(&self, key: &str, list: Arc<ReplicaList>, asked_at: Instant) {
        self.insert_at(key, list, asked_at, Instant::now())
    }

    fn insert_at(&self, key: &str, list: Arc<ReplicaList>, asked_at: Instant, now: Instant) {
        if self.capacity == 0 {
            return;
        }
        let mut lists = self.lists.lock();
        // Checked under the lock `forget` takes: a forget is either seen here or
        // removes what is entered here.
        // A lease from the master may be anything: one past `Instant`'s range is
        // "not reusable", like one too short.
        let until = asked_at.checked_add(list.lease);
        let reusable = list.lease > MIN_LEFT
            && !list.replicas.is_empty()
            && until.is_some_and(|u| u > now + MIN_LEFT)
            && self.forgotten_slot(key).load(Ordering::Acquire) < self.since_base(asked_at);
        let until = until.filter(|_| reusable);
        match lists.get_mut(key) {
            Some(entry) if same_list(&entry.list, &list) => {
                // The same list again: a floor becomes reusable, a kept list lives
                // on (a hot key stays cached past its first lease period).
                entry.until = entry.until.max(until);
                return;
            }
            Some(entry) if asked_at <= entry.entered => {
                // Asked for before the entered list was answered, and different:
                // which is newer cannot be told. Keep neither, nor any list asked
                // for until now.
                self.mark_forgotten(key, now);
                lists.remove(key);
                return;
            }
            // Asked for after the entered list was answered: this one is newer.
            Some(entry) => {
                *entry = Entry { list, entered: now, until };
                return;
            }
            None => {}
        }
        if lists.len() >= self.capacity {
            // Entries dropped are forgotten, so that no older list of them is entered
            // in their place.
            lists.retain(|k, e| {
                let live = e.until.is_some_and(|u| u > now);
                if !live {
                    self.mark_forgotten(k, now);
                }
                live
            });
            if lists.len() >= self.capacity {
                // Every entry is live: make room by dropping an arbitrary one.
                if let Some(k) = lists.keys().next().cloned() {
                    self.mark_forgotten(&k, now);
                    lists.remove(&k);
                }
            }
        }
        lists.insert(key.into(), Entry { list, entered: now, until });
    }

    /// Forgets `key` (a read through its list failed, or it was removed or
    /// replaced); lists of it asked for until now are not reused either.
    pub(super) fn forget(&self, key: &str) {
        self.forget_at(key, Instant::now())
    }

    fn forget_at(&self, key: &str, now: Instant) {
        if self.capacity > 0 {
            let mut lists = self.lists.lock();
            self.mark_forgotten(key, now);
            lists.remove(key);
        }
    }

    /// Forgets everything, and lists asked for until now.
    pub(super) fn clear(&self) {
        self.clear_at(Instant::now())
    }

    fn clear_at(&self, now: Instant) {
        let mut lists = self.lists.lock();
        let now = self.since_base(now);
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
    fn a_lease_past_the_clock_s_range_is_not_a_panic() {
        let c = ReplicaCache::new(8);
        let mut huge = list(0, 1);
        huge.lease = Duration::MAX;
        c.insert_owned("k", huge, Instant::now());
        assert!(c.get("k").is_none(), "not reusable");
        c.insert_owned("k", list(1000, 1), Instant::now());
        assert!(c.get("k").is_some(), "a later list is still entered");
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

    /// A clock in milliseconds from now (make the cache first: its base must not be
    /// later), and an old and a new list of one key.
    fn two_lists() -> (impl Fn(u64) -> Instant, Arc<ReplicaList>, Arc<ReplicaList>) {
        let t0 = Instant::now();
        let mut new = list(1000, 1);
        new.checksum = 2;
        (move |ms| t0 + Duration::from_millis(ms), Arc::new(list(1000, 1)), Arc::new(new))
    }

    #[test]
    fn a_list_read_but_not_kept_still_keeps_older_ones_out() {
        // The race CI caught: a forget, then two gets of a key that another client
        // replaces meanwhile. The first asked before the forget and got the new
        // list (not reusable); the second asked after the forget but was answered
        // first, with the old list. The old list must not be reused after the new
        // one was read.
        let c = ReplicaCache::new(8);
        let (at, old, new) = two_lists();
        c.forget_at("k", at(2));
        c.insert_at("k", new, at(1), at(5));
        assert!(c.get_at("k", at(5)).is_none(), "asked for before the forget");
        c.insert_at("k", old, at(3), at(6));
        assert!(c.get_at("k", at(6)).is_none(), "an older list is reused after a newer one was read");
    }

    #[test]
    fn a_floor_dropped_for_room_still_keeps_older_lists_out() {
        let c = ReplicaCache::new(1);
        let (at, old, new) = two_lists();
        c.forget_at("k", at(2));
        // The newer list, asked for before the forget, is read and left as a floor.
        c.insert_at("k", new, at(1), at(5));
        // Another key takes the only room.
        c.insert_at("other", Arc::new(list(1000, 1)), at(6), at(6));
        assert!(c.get_at("other", at(6)).is_some());
        // An older list, asked for after the forget, is answered last.
        c.insert_at("k", old, at(3), at(7));
        assert!(c.get_at("k", at(7)).is_none(), "an older list is reused after a newer one was read");
    }

    #[test]
    fn the_same_list_asked_again_keeps_a_hot_key_cached() {
        let c = ReplicaCache::new(8);
        let (at, old, _) = two_lists();
        c.insert_at("k", old.clone(), at(0), at(1));
        assert!(c.get_at("k", at(900)).is_some());
        // Its lease is over: the next get asks the master, which gives the same list.
        assert!(c.get_at("k", at(1000)).is_none());
        c.insert_at("k", old.clone(), at(1000), at(1001));
        assert!(c.get_at("k", at(1900)).is_some(), "a hot key is cached for its first lease period only");
        // An answer asked for earlier never shortens it.
        c.insert_at("k", old, at(500), at(1950));
        assert!(c.get_at("k", at(1960)).is_some());
    }

    #[test]
    fn a_newer_list_replaces_and_a_floor_lets_the_same_list_through() {
        let c = ReplicaCache::new(8);
        let (at, old, new) = two_lists();
        c.insert_at("k", old, at(0), at(1));
        // Asked for after the kept list was entered: newer, so it replaces it.
        c.insert_at("k", new.clone(), at(2), at(3));
        assert_eq!(c.get_at("k", at(4)).map(|l| l.checksum), Some(2));
        // Concurrent gets of an unchanged key after a forget: the one asked before it
        // is a floor, the one asked after it makes the same list reusable.
        c.forget_at("k", at(10));
        c.insert_at("k", new.clone(), at(9), at(11));
        assert!(c.get_at("k", at(11)).is_none());
        c.insert_at("k", new, at(10) + Duration::from_nanos(1), at(12));
        assert_eq!(c.get_at("k", at(12)).map(|l| l.checksum), Some(2));
    }

    /// One step of the model run: the clock, the key's writers, and three readers of
    /// one client, each asking the master (answered in any order) or using the cache.
    #[derive(Clone, Debug)]
    enum Step {
        Tick(u64),
        /// Another client replaces the object.
        Upsert,
        /// This client replaces it (and forgets its list).
        OwnUpsert,
        /// A get of another key enters its list (capacity is shared).
        Other,
        /// Everything forgotten (`remove_all`).
        Clear,
        Start(usize),
        Answer(usize),
        Finish(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => (0u64..8).prop_map(Step::Tick),
            2 => Just(Step::Upsert),
            1 => Just(Step::OwnUpsert),
            1 => Just(Step::Other),
            1 => Just(Step::Clear),
            3 => (0usize..3).prop_map(Step::Start),
            3 => (0usize..3).prop_map(Step::Answer),
            3 => (0usize..3).prop_map(Step::Finish),
        ]
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]
        /// Against a master that answers in order but whose answers arrive in any
        /// order: no reader ever goes back to an older version, and none that
        /// starts after this client's own upsert reads a version before it.
        #[test]
        fn readers_never_go_back_whatever_the_answer_order(
            lease in prop_oneof![Just(0u64), Just(4), Just(30), Just(10_000)],
            capacity in 1usize..3,
            steps in proptest::collection::vec(step(), 1..120),
        ) {
            #[derive(Clone, Copy)]
            enum Reader { Idle, Asked(Instant), Answered(Instant, u64) }
            let c = ReplicaCache::new(capacity);
            let t0 = Instant::now();
            let mut now = t0;
            let version = |v: u64| {
                let mut l = list(lease, 1);
                l.checksum = v as u32;
                l.replicas[0].offset = v;
                Arc::new(l)
            };
            let mut current = 0u64;
            let mut readers = [Reader::Idle; 3];
            // The newest version a read of this client has returned: a read that
            // starts after that never returns an older one.
            let mut returned = 0u64;
            for s in steps {
                match s {
                    Step::Tick(ms) => now += Duration::from_millis(ms),
                    Step::Upsert => current += 1,
                    Step::OwnUpsert => {
                        current += 1;
                        c.forget_at("k", now);
                        returned = current;
                    }
                    Step::Other => c.insert_at("other", version(0), now, now),
                    Step::Clear => c.clear_at(now),
                    Step::Start(t) => if let Reader::Idle = readers[t] {
                        if c.get_at("k", now).is_none() {
                            readers[t] = Reader::Asked(now);
                        }
                    },
                    Step::Answer(t) => if let Reader::Asked(at) = readers[t] {
                        readers[t] = Reader::Answered(at, current);
                    },
                    Step::Finish(t) => if let Reader::Answered(at, v) = readers[t] {
                        c.insert_at("k", version(v), at, now);
                        returned = returned.max(v);
                        readers[t] = Reader::Idle;
                    },
                }
                // Checked after every step: what a cached read would return now.
                if let Some(l) = c.get_at("k", now) {
                    let v = u64::from(l.checksum);
                    prop_assert!(v >= returned, "the cache serves {} after {} was returned", v, returned);
                }
            }
        }
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
