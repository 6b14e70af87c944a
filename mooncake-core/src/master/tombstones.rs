//! Tombstones: the generation high-water marks of keys whose old copies may still be
//! offered to the master (ARCHITECTURE.md, "Generations").
//!
//! A copy of an object (a node's record of it, or a file on an SSD) carries the
//! generation it was stamped with while the object existed. It is offered again when
//! a node re-mounts or an SSD announces its files; the master must then refuse it if
//! its key was removed or put again since. Remembering every key ever removed or put
//! would grow without bound, so the master remembers only keys whose copies may be
//! out of its sight:
//! - every removed (or replaced) key, with the generation of the removal;
//! - every key whose replica or disk replica the master dropped without the holder
//!   being told (a node forgotten, an offload that may have been written), as
//!   *lingering*: such copies are good until the key is put or removed again, which
//!   turns the tombstone into a removal's.
//!
//! A removal of a key whose copies may be out of sight is the one thing a restarted
//! master cannot learn back from the copies nodes offer (the copy out of sight is
//! older than the removal, and nothing newer may be left to say so). Such marks are
//! *unseen*: the master hands each removal of them to nodes that keep it for it
//! (`master/carried.rs`), and a restarted master learns them back from those nodes.
//!
//! At most [`MAX_TOMBSTONES`] are kept (each key once, plus 8 bytes of order), oldest
//! first out; forgetting one raises its shard's *floor* to the forgotten mark's
//! generation: an offered copy of a key without a tombstone is admitted only if it is
//! newer than the floor. So forgetting errs on the safe side: a copy older than a
//! removal whose key was forgotten is refused (its node deletes it), never taken for
//! the current object; a copy newer than every forgotten removal is admitted.
//!
//! In cluster mode floors are kept per slot group: a master's marks of a group's keys
//! come only from its terms leading that group, so the removals it forgets in one
//! group never refuse the records another leader stamped in another group. (A floor
//! at the current generation, shared by all groups, refused nearly every record of
//! a group taken over once the master had forgotten any mark.)

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use hashbrown::HashTable;
use parking_lot::Mutex;

/// Most tombstones kept; the oldest go first beyond it.
const MAX_TOMBSTONES: usize = 1 << 20;
/// Shards of the tombstones (each its own lock, taken last: no lock is taken under it).
const SHARDS: usize = 256;
/// Most tombstones of one shard.
const PER_SHARD: usize = MAX_TOMBSTONES / SHARDS;

/// The mark of a key whose copies may linger where the master cannot see them, and
/// that nothing superseded since.
const LINGERING: u64 = 0;

/// The mark of one key.
#[derive(Clone, Copy)]
struct Mark {
    /// The generation of its last removal or put after it lingered, or [`LINGERING`].
    generation: u64,
    /// Copies of the key may be where the master cannot see them (it lingered, or a
    /// node was never told of a removal): its removals are handed to nodes to keep.
    unseen: bool,
}

/// The tombstones of one shard of keys.
#[derive(Default)]
struct Shard {
    /// (key, its mark), found by the key's hash: the key is kept once.
    marks: HashTable<(Box<str>, Mark)>,
    /// Hashes of the keys in insertion order, to forget the oldest beyond [`PER_SHARD`].
    order: VecDeque<u64>,
    /// Per slot group (0 without groups): copies of keys without a mark are admitted
    /// only if newer than this (absent or 0: no mark of a removal was forgotten here).
    floors: ahash::HashMap<u32, u64>,
}

impl Shard {
    fn get_mut(&mut self, hash: u64, key: &str) -> Option<&mut Mark> {
        self.marks.find_mut(hash, |(k, _)| &**k == key).map(|(_, m)| m)
    }
}

/// The tombstones of a master (see the module docs).
pub(crate) struct Tombstones {
    shards: Box<[Mutex<Shard>]>,
    router: ahash::RandomState,
    /// Whether any shard may hold anything: puts skip the locks while none does.
    any: AtomicBool,
    /// Cluster mode: the slot group of a key (unset: one group, 0).
    grouping: OnceLock<Grouping>,
}

/// The slot group of a key.
pub(crate) type Grouping = Arc<dyn Fn(&str) -> u32 + Send + Sync>;

impl Default for Tombstones {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            router: ahash::RandomState::with_seeds(0x746f6d62, 0x73746f6e, 0x65732d6d, 0x61726b73),
            any: AtomicBool::new(false),
            grouping: OnceLock::new(),
        }
    }
}

impl Tombstones {
    /// Cluster mode: floors are kept per slot group, as `grouping` says (only the
    /// first one set is kept).
    pub(crate) fn set_grouping(&self, grouping: Grouping) {
        let _ = self.grouping.set(grouping);
    }

    /// The slot group whose floor covers `key`.
    fn group(&self, key: &str) -> u32 {
        self.grouping.get().map_or(0, |g| g(key))
    }

    /// The key's hash and its shard (the shard from the hash's high bits, the table
    /// slot from the low ones).
    fn shard(&self, key: &str) -> (u64, &Mutex<Shard>) {
        let hash = self.router.hash_one(key);
        (hash, &self.shards[((hash >> 48) as usize) % SHARDS])
    }

    /// Sets `key`'s mark with `update` (given the current one, if any), making room;
    /// returns the mark set.
    fn mark(&self, key: &str, update: impl FnOnce(Option<Mark>) -> Mark) -> Mark {
        let (hash, shard) = self.shard(key);
        let mut shard = shard.lock();
        let set = match shard.get_mut(hash, key) {
            Some(m) => {
                *m = update(Some(*m));
                *m
            }
            None => {
                let value = update(None);
                let router = &self.router;
                shard.marks.insert_unique(hash, (key.into(), value), |(k, _)| router.hash_one(&**k));
                shard.order.push_back(hash);
                while shard.order.len() > PER_SHARD {
                    let Some(old) = shard.order.pop_front() else { break };
                    // The oldest key of that hash (two keys sharing 64 bits of hash
                    // would only make one forgotten early: the floor covers it).
                    if let Ok(entry) = shard.marks.find_entry(old, |(k, _)| router.hash_one(&**k) == old) {
                        let ((forgotten, mark), _) = entry.remove();
                        let floor = shard.floors.entry(self.group(&forgotten)).or_insert(0);
                        *floor = (*floor).max(mark.generation);
                    }
                }
                value
            }
        };
        self.any.store(true, Ordering::Release);
        set
    }

    /// Copies of `key` may linger where the master does not see them (their holder was
    /// forgotten): they stay admissible until the key is put or removed again.
    pub(crate) fn linger(&self, key: &str) {
        self.mark(key, |m| Mark { generation: m.map_or(LINGERING, |m| m.generation), unseen: true });
    }

    /// `key` was removed (or replaced) at `generation`: copies older than it are
    /// refused from now on. Returns whether copies of the key may be out of the
    /// master's sight (the removal is then to be kept by nodes as well).
    pub(crate) fn supersede(&self, key: &str, generation: u64) -> bool {
        self.mark(key, |m| Mark {
            generation: m.map_or(LINGERING, |m| m.generation).max(generation),
            unseen: m.is_some_and(|m| m.unseen),
        })
        .unseen
    }

    /// A node holding a copy of `key` was never told of its removal at
    /// `generation` (it was forgotten first): that copy is out of sight, and older
    /// than the removal. (The removal is to be kept by nodes as well.)
    pub(crate) fn supersede_unseen(&self, key: &str, generation: u64) {
        self.mark(key, |m| Mark { generation: m.map_or(LINGERING, |m| m.generation).max(generation), unseen: true });
    }

    /// `key` was put at `generation`: if copies of an earlier object of the key may
    /// linger, they are refused from now on (nothing to remember otherwise).
    pub(crate) fn supersede_if_marked(&self, key: &str, generation: u64) {
        if self.any.load(Ordering::Acquire) {
            let (hash, shard) = self.shard(key);
            if let Some(m) = shard.lock().get_mut(hash, key) {
                m.generation = m.generation.max(generation);
            }
        }
    }

    /// Whether `key` is known to have been removed or put again after `generation`
    /// (its mark is newer; a forgotten mark is not known).
    pub(crate) fn superseded_after(&self, key: &str, generation: u64) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return false;
        }
        let (hash, shard) = self.shard(key);
        let mut shard = shard.lock();
        shard.get_mut(hash, key).is_some_and(|m| m.generation != LINGERING && m.generation > generation)
    }

    /// Whether a copy of `key` stamped `generation` may be taken back while the
    /// master holds no object under the key.
    pub(crate) fn admits(&self, key: &str, generation: u64) -> bool {
        if !self.any.load(Ordering::Acquire) {
            return true;
        }
        let (hash, shard) = self.shard(key);
        let mut shard = shard.lock();
        match shard.get_mut(hash, key).map(|m| m.generation) {
            Some(LINGERING) => true,
            Some(removed) => generation > removed,
            // A file of a version without generations (0) is taken by a master that
            // never forgot a mark here, as before generations existed.
            None => {
                let floor = shard.floors.get(&self.group(key)).copied().unwrap_or(0);
                floor == 0 || generation > floor
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master::generations::GenClock;
    use proptest::prelude::*;

    /// The rule without a bound: a key's last supersession, or lingering; and the
    /// keys whose copies went out of sight.
    #[derive(Default)]
    struct Model(std::collections::HashMap<String, u64>, std::collections::HashSet<String>);

    impl Model {
        fn admits(&self, key: &str, generation: u64) -> bool {
            match self.0.get(key) {
                None | Some(&LINGERING) => true,
                Some(&g) => generation > g,
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Linger(u8),
        Remove(u8),
        Untold(u8),
        Put(u8),
        Offer(u8, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u8>().prop_map(Op::Linger),
            any::<u8>().prop_map(Op::Remove),
            any::<u8>().prop_map(Op::Untold),
            any::<u8>().prop_map(Op::Put),
            (any::<u8>(), any::<u8>()).prop_map(|(k, back)| Op::Offer(k, back)),
        ]
    }

    proptest! {
        /// Within the bound the tombstones answer exactly as the unbounded rule; an
        /// old copy is never admitted where the rule refuses it.
        #[test]
        fn tombstones_follow_the_generation_rule(ops in proptest::collection::vec(op(), 1..300)) {
            let clock = GenClock::default();
            let t = Tombstones::default();
            let mut model = Model::default();
            // Generations handed out so far, to offer copies of old ones.
            let mut stamps: Vec<u64> = vec![clock.next()];
            for op in ops {
                match op {
                    Op::Linger(k) => {
                        let key = k.to_string();
                        t.linger(&key);
                        model.1.insert(key.clone());
                        model.0.entry(key).or_insert(LINGERING);
                    }
                    Op::Remove(k) => {
                        let key = k.to_string();
                        let g = clock.next();
                        stamps.push(g);
                        // A removal is handed to nodes exactly when a copy of the key
                        // went out of sight before, however long ago.
                        prop_assert_eq!(t.supersede(&key, g), model.1.contains(&key), "{}", key);
                        let m = model.0.entry(key).or_insert(LINGERING);
                        *m = (*m).max(g);
                    }
                    Op::Untold(k) => {
                        let key = k.to_string();
                        let g = clock.next();
                        stamps.push(g);
                        t.supersede_unseen(&key, g);
                        model.1.insert(key.clone());
                        let m = model.0.entry(key).or_insert(LINGERING);
                        *m = (*m).max(g);
                    }
                    Op::Put(k) => {
                        let key = k.to_string();
                        let g = clock.next();
                        stamps.push(g);
                        t.supersede_if_marked(&key, g);
                        if let Some(m) = model.0.get_mut(&key) {
                            *m = (*m).max(g);
                        }
                    }
                    Op::Offer(k, back) => {
                        let key = k.to_string();
                        let g = stamps[stamps.len() - 1 - (back as usize % stamps.len())];
                        prop_assert_eq!(t.admits(&key, g), model.admits(&key, g), "{} at {}", key, g);
                    }
                }
            }
        }
    }

    /// Fills the shard of `key` past its bound (by one) with removals of other keys
    /// that `only` accepts, each stamped by `clock`; returns their generations.
    fn overflow_shard_of(t: &Tombstones, key: &str, clock: &GenClock, only: impl Fn(&str) -> bool) -> Vec<u64> {
        let shard_of = |k: &str| ((t.router.hash_one(k) >> 48) as usize) % SHARDS;
        let target = shard_of(key);
        let (mut stamps, mut i) = (Vec::new(), 0u64);
        while stamps.len() <= PER_SHARD {
            let other = format!("other-{i}");
            i += 1;
            if shard_of(&other) == target && other != key && only(&other) {
                let g = clock.next();
                t.supersede(&other, g);
                stamps.push(g);
            }
        }
        stamps
    }

    /// The floor a forgotten mark leaves is that mark's generation, not the current
    /// one: a copy newer than every removal forgotten is still taken back. In cluster
    /// mode floors are per slot group: forgetting the marks of one group's keys
    /// refuses nothing of another group (a new leader of that group takes its
    /// records back, whatever this master removed elsewhere).
    #[test]
    fn floors_are_the_forgotten_generations_per_slot_group() {
        let clock = GenClock::default();
        let t = Tombstones::default();
        let group = |k: &str| u32::from(k.len().is_multiple_of(2));
        t.set_grouping(Arc::new(group));
        let before = clock.next();
        // Removals of odd-length keys (group 0) overflow the shard of "kk" (group 1).
        overflow_shard_of(&t, "kk", &clock, |k| group(k) == 0);
        assert!(t.admits("kk", before), "another group's forgotten marks refuse nothing of group 1");
        // Now removals of group 1's keys overflow it: the oldest of them are forgotten.
        let stamps = overflow_shard_of(&t, "kk", &clock, |k| group(k) == 1);
        assert!(!t.admits("kk", before) && !t.admits("kk", stamps[0]), "older than a forgotten removal");
        // Newer than the removals forgotten, though older than those kept and than now.
        assert!(t.admits("kk", stamps[PER_SHARD / 2]));
        assert!(t.admits("kk", clock.next()));
    }

    #[test]
    fn forgetting_a_tombstone_refuses_old_copies_of_unmarked_keys() {
        let clock = GenClock::default();
        let t = Tombstones::default();
        let old = clock.next();
        assert!(t.admits("k", old) && t.admits("k", 0), "nothing known: everything admitted");
        // Fill one shard past its bound: its oldest marks are forgotten.
        let shard_of = |k: &str| ((t.router.hash_one(k) >> 48) as usize) % SHARDS;
        let target = shard_of("k");
        let mut n = 0;
        let mut i = 0u64;
        while n <= PER_SHARD {
            let key = format!("other-{i}");
            i += 1;
            if shard_of(&key) == target && key != "k" {
                t.supersede(&key, clock.next());
                n += 1;
            }
        }
        // "k" has no mark and its shard forgot one: a copy from before is refused, a
        // later one admitted.
        assert!(!t.admits("k", old));
        assert!(!t.admits("k", 0));
        assert!(t.admits("k", clock.next()));
    }
}
