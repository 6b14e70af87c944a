//! Disk eviction strategies: which *unit* a backend evicts next.
//!
//! A unit is whatever a backend evicts as a whole: a bucket for
//! [`BucketBackend`](crate::BucketBackend), one object for
//! [`FilePerKeyBackend`](crate::FilePerKeyBackend) and
//! [`OffsetAllocatorBackend`](crate::OffsetAllocatorBackend). Backends name units by a
//! [`UnitId`] (`u64`) and keep their own key -> unit mapping; when a unit is added the
//! strategy also learns its size and keys ([`UnitInfo`]).
//!
//! Built in: [`FifoEviction`] (oldest added first) and [`LruEviction`] (never-read
//! units first, in the order they were added, then the least recently read). All
//! operations of both are O(1). [`EvictionPolicy`] names them; an
//! [`EvictionFactory`] makes a fresh strategy for each backend opened (a policy, or any
//! closure returning a strategy).

mod fifo;
mod lists;
mod lru;

pub use fifo::FifoEviction;
pub use lru::LruEviction;

use crate::error::StorageError;

/// Name of an evictable unit (a bucket id, or an object's id inside its backend).
pub type UnitId = u64;

/// What a backend tells a strategy about a unit it adds.
///
/// A snapshot taken when the unit is written (or found again when a directory is
/// opened): a user removal of some keys of a bucket does not update it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnitInfo<'a> {
    /// Bytes the unit takes on disk, as counted against the capacity (with padding).
    pub bytes: u64,
    /// Keys of the objects the unit holds (one for the one-object layouts).
    pub keys: &'a [&'a str],
}

/// Chooses which unit a backend evicts next.
///
/// Backends call [`add`](Self::add) when a unit is written, [`remove`](Self::remove)
/// when the user removes it, [`record_access`](Self::record_access) on every read, and
/// [`select_victim`](Self::select_victim) when a write needs space. Calls are made
/// under the backend's lock, never concurrently. Unknown ids passed to `remove` or
/// `record_access` are ignored (a read may race with the eviction of its unit).
///
/// A strategy may keep units it never selects (to pin them on the disk): a write
/// that does not fit without them fails with [`StorageError::NoSpace`].
///
/// ```
/// use mooncake_storage::{DiskEvictionStrategy, UnitId, UnitInfo};
///
/// /// The largest unit goes first.
/// #[derive(Default)]
/// struct LargestFirst(Vec<(UnitId, u64)>);
///
/// impl DiskEvictionStrategy for LargestFirst {
///     fn add(&mut self, unit: UnitId, info: UnitInfo<'_>) {
///         if !self.0.iter().any(|&(u, _)| u == unit) {
///             self.0.push((unit, info.bytes));
///         }
///     }
///     fn remove(&mut self, unit: UnitId) {
///         self.0.retain(|&(u, _)| u != unit);
///     }
///     fn record_access(&mut self, _unit: UnitId) {}
///     fn select_victim(&mut self) -> Option<UnitId> {
///         let i = (0..self.0.len()).max_by_key(|&i| self.0[i].1)?;
///         Some(self.0.swap_remove(i).0)
///     }
///     fn len(&self) -> usize {
///         self.0.len()
///     }
///     fn name(&self) -> &'static str {
///         "largest_first"
///     }
/// }
///
/// let mut s = LargestFirst::default();
/// s.add(1, UnitInfo { bytes: 4096, keys: &["a"] });
/// s.add(2, UnitInfo { bytes: 8192, keys: &["b"] });
/// assert_eq!(s.select_victim(), Some(2));
/// ```
pub trait DiskEvictionStrategy: Send + Sync {
    /// A unit was written (or found when the backend opened). Adding an id that is
    /// already tracked is a no-op.
    fn add(&mut self, unit: UnitId, info: UnitInfo<'_>);
    /// A unit left the backend by other means than eviction (user removal).
    fn remove(&mut self, unit: UnitId);
    /// A unit was read.
    fn record_access(&mut self, unit: UnitId);
    /// Picks the next unit to evict and stops tracking it; `None` when there is
    /// nothing (more) it agrees to evict.
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

/// Makes a fresh [`DiskEvictionStrategy`] for each backend opened.
///
/// A configuration (which may open several backends, or reopen one) holds a factory
/// rather than a strategy, since a strategy tracks one backend's units. Implemented by
/// [`EvictionPolicy`] (the built-ins by name) and by any
/// `Fn() -> S + Send + Sync` closure or function whose `S` is a strategy:
///
/// ```
/// use mooncake_storage::{EvictionFactory, EvictionPolicy, LruEviction};
///
/// fn name_of(factory: impl EvictionFactory) -> &'static str {
///     factory.build().name()
/// }
/// assert_eq!(name_of(EvictionPolicy::Fifo), "fifo");
/// assert_eq!(name_of(LruEviction::new), "lru");
/// ```
pub trait EvictionFactory: Send + Sync {
    /// A new strategy that tracks no unit yet.
    fn build(&self) -> Box<dyn DiskEvictionStrategy>;
}

impl<F, S> EvictionFactory for F
where
    F: Fn() -> S + Send + Sync,
    S: DiskEvictionStrategy + 'static,
{
    fn build(&self) -> Box<dyn DiskEvictionStrategy> {
        Box::new(self())
    }
}

/// The built-in strategies by name, for configuration files and command lines
/// (`"fifo"`, `"lru"`; see [`FromStr`](std::str::FromStr)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// [`FifoEviction`].
    #[default]
    Fifo,
    /// [`LruEviction`].
    Lru,
}

impl EvictionFactory for EvictionPolicy {
    fn build(&self) -> Box<dyn DiskEvictionStrategy> {
        match self {
            EvictionPolicy::Fifo => Box::new(FifoEviction::new()),
            EvictionPolicy::Lru => Box::new(LruEviction::new()),
        }
    }
}

impl std::str::FromStr for EvictionPolicy {
    type Err = StorageError;

    /// `"fifo"` or `"lru"`, in any case.
    fn from_str(s: &str) -> Result<Self, StorageError> {
        match s.to_ascii_lowercase().as_str() {
            "fifo" => Ok(EvictionPolicy::Fifo),
            "lru" => Ok(EvictionPolicy::Lru),
            _ => Err(StorageError::InvalidArgument(format!("disk eviction policy {s:?}: use fifo or lru"))),
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
            f.add(u, UnitInfo::default());
        }
        f.add(1, UnitInfo::default()); // duplicate: no-op
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
            l.add(u, UnitInfo::default());
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
            s.add(1, UnitInfo::default());
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
                        lru.add(u, UnitInfo::default()); fifo.add(u, UnitInfo::default());
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
