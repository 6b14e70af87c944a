//! Disk eviction strategies: which *unit* a backend evicts next.
//!
//! A unit is whatever a backend evicts as a whole: a bucket for
//! [`BucketBackend`](crate::BucketBackend), one object for
//! [`FilePerKeyBackend`](crate::FilePerKeyBackend) and
//! [`OffsetAllocatorBackend`](crate::OffsetAllocatorBackend). Backends name units by a
//! [`UnitId`] (`u64`) and keep their own key -> unit mapping.
//!
//! Built in: [`FifoEviction`] (oldest added first) and [`LruEviction`] (never-read
//! units first, in the order they were added, then the least recently read). All
//! operations of both are O(1).

use ahash::AHashMap;

/// Name of an evictable unit (a bucket id, or an object's id inside its backend).
pub type UnitId = u64;

/// Chooses which unit a backend evicts next.
///
/// Backends call [`add`](Self::add) when a unit is written, [`remove`](Self::remove)
/// when the user removes it, [`record_access`](Self::record_access) on every read, and
/// [`select_victim`](Self::select_victim) when a write needs space. Calls are made
/// under the backend's lock, never concurrently. Unknown ids passed to `remove` or
/// `record_access` are ignored (a read may race with the eviction of its unit).
pub trait DiskEvictionStrategy: Send + Sync {
    /// A unit was written. Adding an id that is already tracked is a no-op.
    fn add(&mut self, unit: UnitId);
    /// A unit left the backend by other means than eviction (user removal).
    fn remove(&mut self, unit: UnitId);
    /// A unit was read.
    fn record_access(&mut self, unit: UnitId);
    /// Picks the next unit to evict and stops tracking it; `None` when empty.
    fn select_victim(&mut self) -> Option<UnitId>;
    /// Units tracked.
    fn len(&self) -> usize;
    /// Whether no unit is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Short name for logs and stats (`"fifo"`, `"lru"`).
    fn name(&self) -> &'static str;
}

const NIL: usize = usize::MAX;

#[derive(Clone, Copy, Debug)]
struct Node {
    unit: UnitId,
    prev: usize,
    next: usize,
    list: u8,
}

#[derive(Clone, Copy, Debug)]
struct List {
    head: usize,
    tail: usize,
}

impl List {
    const EMPTY: List = List { head: NIL, tail: NIL };
}

/// O(1) ordered sets of units: a slab of nodes threaded on a few intrusive lists.
#[derive(Debug)]
struct Lists<const N: usize> {
    index: AHashMap<UnitId, usize>,
    nodes: Vec<Node>,
    spare: Vec<usize>,
    lists: [List; N],
}

impl<const N: usize> Lists<N> {
    fn new() -> Self {
        Lists { index: AHashMap::new(), nodes: Vec::new(), spare: Vec::new(), lists: [List::EMPTY; N] }
    }

    fn push_back(&mut self, list: u8, unit: UnitId) -> usize {
        let node = Node { unit, prev: self.lists[list as usize].tail, next: NIL, list };
        let i = match self.spare.pop() {
            Some(i) => {
                self.nodes[i] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.nodes.len() - 1
            }
        };
        self.link_back(list, i);
        i
    }

    fn link_back(&mut self, list: u8, i: usize) {
        let l = &mut self.lists[list as usize];
        self.nodes[i].prev = l.tail;
        self.nodes[i].next = NIL;
        self.nodes[i].list = list;
        if l.tail == NIL {
            l.head = i;
        } else {
            self.nodes[l.tail].next = i;
        }
        l.tail = i;
    }

    fn unlink(&mut self, i: usize) {
        let Node { prev, next, list, .. } = self.nodes[i];
        let l = &mut self.lists[list as usize];
        if prev == NIL {
            l.head = next;
        } else {
            self.nodes[prev].next = next;
        }
        if next == NIL {
            l.tail = prev;
        } else {
            self.nodes[next].prev = prev;
        }
    }

    fn insert(&mut self, list: u8, unit: UnitId) {
        if self.index.contains_key(&unit) {
            return;
        }
        let i = self.push_back(list, unit);
        self.index.insert(unit, i);
    }

    fn remove(&mut self, unit: UnitId) -> bool {
        match self.index.remove(&unit) {
            Some(i) => {
                self.unlink(i);
                self.spare.push(i);
                true
            }
            None => false,
        }
    }

    /// Moves a tracked unit to the back of `list`.
    fn touch(&mut self, list: u8, unit: UnitId) {
        if let Some(&i) = self.index.get(&unit) {
            self.unlink(i);
            self.link_back(list, i);
        }
    }

    fn pop_front(&mut self, list: u8) -> Option<UnitId> {
        let head = self.lists[list as usize].head;
        if head == NIL {
            return None;
        }
        let unit = self.nodes[head].unit;
        self.remove(unit);
        Some(unit)
    }

    fn len(&self) -> usize {
        self.index.len()
    }
}

/// First in, first out: the unit added first is evicted first; reads change nothing.
#[derive(Debug)]
pub struct FifoEviction {
    lists: Lists<1>,
}

impl FifoEviction {
    /// An empty FIFO.
    pub fn new() -> Self {
        FifoEviction { lists: Lists::new() }
    }
}

impl Default for FifoEviction {
    fn default() -> Self {
        Self::new()
    }
}

impl DiskEvictionStrategy for FifoEviction {
    fn add(&mut self, unit: UnitId) {
        self.lists.insert(0, unit);
    }
    fn remove(&mut self, unit: UnitId) {
        self.lists.remove(unit);
    }
    fn record_access(&mut self, _unit: UnitId) {}
    fn select_victim(&mut self) -> Option<UnitId> {
        self.lists.pop_front(0)
    }
    fn len(&self) -> usize {
        self.lists.len()
    }
    fn name(&self) -> &'static str {
        "fifo"
    }
}

/// Least recently used, with never-read units first.
///
/// As in the reference (whose never-read buckets have `last_access == 0`), units that
/// were never read are evicted before any unit that was read, oldest first (FIFO among
/// the unread); then the unit whose last read is the oldest.
#[derive(Debug)]
pub struct LruEviction {
    // list 0: never read, in insertion order; list 1: read, least recent first.
    lists: Lists<2>,
}

impl LruEviction {
    /// An empty LRU.
    pub fn new() -> Self {
        LruEviction { lists: Lists::new() }
    }
}

impl Default for LruEviction {
    fn default() -> Self {
        Self::new()
    }
}

impl DiskEvictionStrategy for LruEviction {
    fn add(&mut self, unit: UnitId) {
        self.lists.insert(0, unit);
    }
    fn remove(&mut self, unit: UnitId) {
        self.lists.remove(unit);
    }
    fn record_access(&mut self, unit: UnitId) {
        self.lists.touch(1, unit);
    }
    fn select_victim(&mut self) -> Option<UnitId> {
        self.lists.pop_front(0).or_else(|| self.lists.pop_front(1))
    }
    fn len(&self) -> usize {
        self.lists.len()
    }
    fn name(&self) -> &'static str {
        "lru"
    }
}

/// The built-in strategies by name, for configuration files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// [`FifoEviction`].
    #[default]
    Fifo,
    /// [`LruEviction`].
    Lru,
}

impl EvictionPolicy {
    /// A fresh strategy of this policy.
    pub fn build(self) -> Box<dyn DiskEvictionStrategy> {
        match self {
            EvictionPolicy::Fifo => Box::new(FifoEviction::new()),
            EvictionPolicy::Lru => Box::new(LruEviction::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[test]
    fn fifo_order_and_remove() {
        let mut f = FifoEviction::new();
        for u in [5, 1, 9, 3] {
            f.add(u);
        }
        f.add(1); // duplicate: no-op
        f.record_access(5);
        f.remove(9);
        f.remove(42);
        assert_eq!(f.len(), 3);
        assert_eq!(f.select_victim(), Some(5));
        assert_eq!(f.select_victim(), Some(1));
        assert_eq!(f.select_victim(), Some(3));
        assert_eq!(f.select_victim(), None);
        assert!(f.is_empty());
    }

    #[test]
    fn lru_evicts_never_read_first_then_least_recent() {
        let mut l = LruEviction::new();
        for u in 1..=5 {
            l.add(u);
        }
        l.record_access(2);
        l.record_access(1);
        l.record_access(2);
        // never read: 3, 4, 5 (insertion order), then read: 1, 2
        let order: Vec<_> = std::iter::from_fn(|| l.select_victim()).collect();
        assert_eq!(order, vec![3, 4, 5, 1, 2]);
    }

    #[test]
    fn object_safe() {
        let mut boxed: Vec<Box<dyn DiskEvictionStrategy>> =
            vec![EvictionPolicy::Fifo.build(), EvictionPolicy::Lru.build()];
        for s in &mut boxed {
            s.add(1);
            assert_eq!(s.select_victim(), Some(1));
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Add(u8),
        Remove(u8),
        Access(u8),
        Victim,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..16).prop_map(Op::Add),
            (0u8..16).prop_map(Op::Remove),
            (0u8..16).prop_map(Op::Access),
            Just(Op::Victim),
        ]
    }

    proptest! {
        #[test]
        fn lru_matches_model(ops in proptest::collection::vec(op(), 0..200)) {
            // model: (unit, last_access or None) in insertion order
            let mut model: VecDeque<(u64, Option<u64>)> = VecDeque::new();
            let mut clock = 0u64;
            let mut lru = LruEviction::new();
            let mut fifo = FifoEviction::new();
            let mut fifo_model: VecDeque<u64> = VecDeque::new();
            for op in ops {
                clock += 1;
                match op {
                    Op::Add(u) => {
                        let u = u as u64;
                        lru.add(u); fifo.add(u);
                        if !model.iter().any(|e| e.0 == u) { model.push_back((u, None)); }
                        if !fifo_model.contains(&u) { fifo_model.push_back(u); }
                    }
                    Op::Remove(u) => {
                        let u = u as u64;
                        lru.remove(u); fifo.remove(u);
                        model.retain(|e| e.0 != u); fifo_model.retain(|&e| e != u);
                    }
                    Op::Access(u) => {
                        let u = u as u64;
                        lru.record_access(u); fifo.record_access(u);
                        if let Some(e) = model.iter_mut().find(|e| e.0 == u) { e.1 = Some(clock); }
                    }
                    Op::Victim => {
                        let expect = model.iter().enumerate()
                            .min_by_key(|(i, e)| (e.1.unwrap_or(0), *i)).map(|(i, e)| (i, e.0));
                        let got = lru.select_victim();
                        prop_assert_eq!(got, expect.map(|x| x.1));
                        if let Some((i, _)) = expect { model.remove(i); }
                        prop_assert_eq!(fifo.select_victim(), fifo_model.pop_front());
                    }
                }
                prop_assert_eq!(lru.len(), model.len());
                prop_assert_eq!(fifo.len(), fifo_model.len());
            }
        }
    }
}
