//! [`FifoEviction`]: the unit added first leaves first.

use super::lists::Lists;
use super::{DiskEvictionStrategy, UnitId, UnitInfo};

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
    fn add(&mut self, unit: UnitId, _info: UnitInfo<'_>) {
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
