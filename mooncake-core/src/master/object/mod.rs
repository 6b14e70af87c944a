//! The object index and what it keeps per object.
//!
//! `entry` holds an object's metadata and replicas, `shard` one shard's table (each
//! entry and its key in one allocation), `index` the sharded index and its memory
//! estimate.

mod entry;
mod index;
mod shard;

pub(crate) use entry::{ObjectEntry, Replicas, StagedUpsert, StoredReplica};
pub(crate) use index::{entry_heap_bytes, table_bytes, ObjectIndex, SHARDS};
pub(crate) use shard::{Shard, Totals};
