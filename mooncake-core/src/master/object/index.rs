//! The object index: 1024 shards of key -> metadata, each behind its own lock.

use parking_lot::Mutex;

use crate::master::object::entry::{Extra, ObjectEntry, StoredReplica};
use crate::master::object::shard::Shard;

/// Number of index shards; metadata calls on different shards never contend.
pub(crate) const SHARDS: usize = 1024;

/// The sharded index.
pub(crate) struct ObjectIndex {
    shards: Box<[Mutex<Shard>]>,
    router: ahash::RandomState,
}

impl ObjectIndex {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            // Fixed seeds: a key's shard must not depend on the process.
            router: ahash::RandomState::with_seeds(0x6d6f6f6e, 0x63616b65, 0x2d72732d, 0x73686172),
        }
    }

    pub(crate) fn shard_of(&self, key: &str) -> usize {
        (self.router.hash_one(key) as usize) % SHARDS
    }

    pub(crate) fn shard(&self, key: &str) -> &Mutex<Shard> {
        &self.shards[self.shard_of(key)]
    }

    pub(crate) fn shard_at(&self, i: usize) -> &Mutex<Shard> {
        &self.shards[i]
    }

    pub(crate) fn shards(&self) -> impl Iterator<Item = &Mutex<Shard>> {
        self.shards.iter()
    }
}

/// Heap bytes a table spends on its slots (one entry pointer, plus a control byte
/// each), and on the generations of copies taken back in a recovery window.
pub(crate) fn table_bytes(shard: &Shard) -> u64 {
    (shard.slots() * (std::mem::size_of::<usize>() + 1) + shard.recovered_bytes()) as u64
}

/// Bytes glibc's malloc takes for a request of `size`: an 8-byte header, rounded up
/// to 16 bytes, at least 32.
fn malloc_chunk(size: usize) -> usize {
    (size + 8).next_multiple_of(16).max(32)
}

/// Heap bytes behind one entry, its key included: the entry's allocation (with the
/// key), its spilled replica list, its side box (disk, offload, pin TTL, upsert), and
/// one offset-allocator node per replica (the allocator keeps one for every allocated
/// block).
pub(crate) fn entry_heap_bytes(key: &str, e: &ObjectEntry) -> u64 {
    key_heap_bytes(key) + entry_variable_heap_bytes(e)
}

/// The part of [`entry_heap_bytes`] fixed by the key for as long as the entry lives:
/// the allocation holding the entry and its key.
pub(crate) fn key_heap_bytes(key: &str) -> u64 {
    malloc_chunk(Shard::entry_alloc_bytes(key)) as u64
}

/// The part of [`entry_heap_bytes`] that changes with the entry: its spilled replica
/// list, its side box and the allocator nodes of its replicas.
pub(crate) fn entry_variable_heap_bytes(e: &ObjectEntry) -> u64 {
    const ALLOCATOR_NODE: usize = 24;
    let replicas = if e.replicas.spilled() {
        malloc_chunk(e.replicas.capacity() * std::mem::size_of::<StoredReplica>())
    } else {
        0
    };
    let extra = e.extra.as_deref().map_or(0, |x| {
        let staged = x.staged.as_ref().map_or(0, |s| s.replicas.len());
        malloc_chunk(std::mem::size_of::<Extra>())
            + (staged + x.retired.len()) * (std::mem::size_of::<StoredReplica>() + 8 + ALLOCATOR_NODE)
    });
    (replicas + extra + e.replicas.len() * ALLOCATOR_NODE) as u64
}

#[cfg(test)]
mod tests {
    use mooncake_alloc::SegmentAllocator;

    use crate::master::object::entry::Replicas;

    use super::*;

    #[test]
    fn entry_layout_stays_compact() {
        // The index's memory per object (see the `memory` bench): a table slot is one
        // pointer; the entry (72 bytes), a one-byte key length and a 31-byte key take
        // one 112-byte malloc chunk; a replica is 24 bytes.
        assert_eq!(std::mem::size_of::<ObjectEntry>(), 72);
        assert_eq!(malloc_chunk(Shard::entry_alloc_bytes(&"k".repeat(31))), 112);
        assert_eq!(std::mem::size_of::<StoredReplica>(), 24);
        assert_eq!(std::mem::size_of::<crate::master::object::shard::EntryBox>(), 8);
        assert_eq!(Shard::entry_alloc_bytes(&"k".repeat(31)), std::mem::size_of::<ObjectEntry>() + 32);
        assert_eq!(Shard::entry_alloc_bytes(&"k".repeat(200)), std::mem::size_of::<ObjectEntry>() + 202);
        let seg = SegmentAllocator::new(1, "s", 1 << 20);
        let mut replicas = Replicas::new();
        replicas.push(StoredReplica::new(seg.allocate(4096).unwrap(), true));
        assert!(!replicas.spilled(), "one replica lives inline");
        replicas.push(StoredReplica::new(seg.allocate(4096).unwrap(), false));
        assert!(replicas.spilled());
        assert_eq!(seg.used_bytes(), 8192);
        drop(replicas);
        assert_eq!(seg.used_bytes(), 0, "dropping the replicas frees their space");
    }
}
