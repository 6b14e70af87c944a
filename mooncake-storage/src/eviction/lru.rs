//! [`LruEviction`]: never-read units first, then the least recently read.

use super::lists::Lists;
use super::{DiskEvictionStrategy, UnitId, UnitInfo};

/// Least recently used, with never-read units first.
///
/// As in the C++ Mooncake store (whose never-read buckets have `last_access == 0`),
/// units that were never read are evicted before any unit that was read, oldest first
/// (FIFO among the unread); then the unit whose last read is the oldest.
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
    fn add(&mut self, unit: UnitId, _info: UnitInfo<'_>) {
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
