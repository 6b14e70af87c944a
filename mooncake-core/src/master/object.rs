//! The object index: 1024 shards of key -> metadata, each behind its own lock.

use std::collections::HashMap;

use mooncake_alloc::{AllocatedBuffer, SegmentId};
use parking_lot::Mutex;

use crate::master::types::ClientId;

/// Number of index shards; metadata calls on different shards never contend.
pub(crate) const SHARDS: usize = 1024;

/// One replica as the master keeps it: the buffer (freed when dropped) and whether its
/// bytes are all written.
pub(crate) struct StoredReplica {
    pub(crate) buf: AllocatedBuffer,
    pub(crate) complete: bool,
}

impl StoredReplica {
    pub(crate) fn segment(&self) -> SegmentId {
        self.buf.segment_id()
    }
}

/// Metadata of one object. Times are milliseconds of the master's clock.
pub(crate) struct ObjectEntry {
    pub(crate) len: u64,
    pub(crate) checksum: u32,
    pub(crate) soft_pin: bool,
    /// `PutEnd` seen: readable.
    pub(crate) complete: bool,
    /// The client whose put created the entry (it alone may end or revoke it).
    pub(crate) owner: ClientId,
    /// While processing: when the put started. Once complete: last read or write.
    pub(crate) last_access_ms: u64,
    /// Until when the reads in flight may hold the object: the safety net for a
    /// reader that died before releasing its lease.
    pub(crate) lease_until_ms: u64,
    /// Reads (and replica copies) in flight: each replica-list call adds one, each
    /// release takes one away. The object is leased while this is above zero and
    /// `lease_until_ms` has not passed.
    pub(crate) readers: u32,
    pub(crate) replicas: Vec<StoredReplica>,
    /// The client whose SSD holds a `LocalDisk` replica (0: none).
    pub(crate) disk: ClientId,
    /// While an offload of the object is asked for and not yet reported: until when
    /// the master waits for it (0: none). Eviction skips the object meanwhile, and
    /// treats it as an ordinary (droppable) one once the deadline passed.
    pub(crate) offload_deadline_ms: u64,
}

impl ObjectEntry {
    pub(crate) fn leased(&self, now_ms: u64) -> bool {
        self.readers > 0 && self.lease_until_ms > now_ms
    }

    /// One more read in flight, for at most `ttl_ms`. Reads whose lease ran out were
    /// never released (their client died): they no longer count.
    pub(crate) fn lease(&mut self, now_ms: u64, ttl_ms: u64) {
        if self.lease_until_ms <= now_ms {
            self.readers = 0;
        }
        self.readers = self.readers.saturating_add(1);
        self.lease_until_ms = self.lease_until_ms.max(now_ms + ttl_ms);
    }

    /// One read in flight less.
    pub(crate) fn release(&mut self) {
        self.readers = self.readers.saturating_sub(1);
    }

    /// An offload was asked for and may still come.
    pub(crate) fn offload_pending(&self, now_ms: u64) -> bool {
        self.offload_deadline_ms > now_ms
    }

    /// Bytes of memory this object holds (on every segment, or on one).
    pub(crate) fn memory_bytes(&self, segment: Option<SegmentId>) -> u64 {
        self.replicas.iter().filter(|r| segment.is_none_or(|s| r.segment() == s)).map(|r| r.buf.len()).sum()
    }
}

pub(crate) type Shard = HashMap<Box<str>, ObjectEntry, ahash::RandomState>;

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

/// Heap bytes a table spends on its slots (entries inline, plus a control byte each).
pub(crate) fn table_bytes(shard: &Shard) -> u64 {
    (shard.capacity() * (std::mem::size_of::<(Box<str>, ObjectEntry)>() + 1)) as u64
}

/// Heap bytes behind one entry: its key, its replica list, and one allocator node per
/// replica (the offset allocator keeps a node for every allocated block).
pub(crate) fn entry_heap_bytes(e: &ObjectEntry) -> u64 {
    const ALLOCATOR_NODE: usize = 40;
    let replicas = e.replicas.capacity() * std::mem::size_of::<StoredReplica>();
    (replicas + e.replicas.len() * ALLOCATOR_NODE) as u64
}
