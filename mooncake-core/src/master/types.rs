//! The data the master hands out and takes in: replicas, replica lists, plans,
//! records, registrations and stats. Plain values; the RPC carries them as they are.

use std::time::Duration;

use mooncake_alloc::{AllocatedBuffer, SegmentId};
use mooncake_transfer::RemoteRegion;
use serde::{Deserialize, Serialize};

/// Identifier of a client of the master (random, never 0).
pub type ClientId = u64;

/// Where one replica's bytes are: `len` bytes at `offset` of segment `segment`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MemoryReplica {
    /// Segment holding the bytes.
    pub segment: SegmentId,
    /// Offset inside the segment.
    pub offset: u64,
    /// Number of bytes (the object's length).
    pub len: u64,
}

impl MemoryReplica {
    pub(crate) fn of(buf: &AllocatedBuffer) -> Self {
        Self { segment: buf.segment_id(), offset: buf.offset(), len: buf.len() }
    }
}

/// Room a client holds ahead of a put whose key it does not know yet
/// ([`MasterApi::place_ahead`](crate::MasterApi::place_ahead)): the client writes
/// the next value of this length there, then binds it to its key
/// ([`MasterApi::put_bind`](crate::MasterApi::put_bind)), saving the `put_start`
/// round trip.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPlacement {
    /// Names the placement in `put_bind`.
    pub id: u64,
    /// Where to write the value's replicas.
    pub replicas: Vec<MemoryReplica>,
    /// How long the master holds it (ms, counted from before it answered: a
    /// client counts from before its request); then, unless bound, its room is
    /// freed and must not be written. A write into it must also end by then: a
    /// `Store` starts its DMA only within the first fifth, and holds room only for
    /// values a DMA moves well within the rest.
    pub held_for_ms: u64,
}

/// The answer to a replica-list call: the complete replicas of an object and the
/// checksum its bytes must match. The object is leased for `lease`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaList {
    /// Object length.
    pub len: u64,
    /// crc32c of the object's bytes.
    pub checksum: u32,
    /// Complete memory replicas.
    pub replicas: Vec<MemoryReplica>,
    /// How long the object is protected from removal and eviction.
    pub lease: Duration,
    /// The client whose SSD holds a `LocalDisk` replica, if any.
    pub disk: Option<ClientId>,
}

/// What the master knows of one object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectInfo {
    /// Object length.
    pub len: u64,
    /// crc32c of its bytes.
    pub checksum: u32,
    /// Complete memory replicas.
    pub replicas: Vec<MemoryReplica>,
    /// Soft-pinned.
    pub soft_pin: bool,
    /// Milliseconds left on the current read lease (0: none).
    pub lease_ms_left: u64,
}

/// One object a client's SSD tier should write: its bytes are `len` bytes at
/// `offset` of the client's own segment `segment`, and must match `checksum`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadTask {
    /// Object key.
    pub key: String,
    /// The client's segment holding a complete replica.
    pub segment: SegmentId,
    /// Offset of that replica in the segment.
    pub offset: u64,
    /// Object length.
    pub len: u64,
    /// crc32c of the object's bytes.
    pub checksum: u32,
    /// The object's generation, written with the file (see [`ObjectRecord::generation`]).
    pub generation: u64,
}

/// The answer to an offload heartbeat.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadPlan {
    /// Objects to write to the SSD, then report with `notify_offload_success`.
    pub tasks: Vec<OffloadTask>,
    /// Keys whose disk replicas the master dropped (the objects were removed): delete them.
    pub discard: Vec<String>,
}

/// A mounted segment, as clients resolve it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentInfo {
    /// Segment id.
    pub id: SegmentId,
    /// Segment name (`endpoint#n`).
    pub name: String,
    /// Client that owns (and serves) it.
    pub owner: ClientId,
    /// Where its bytes are served.
    #[serde(with = "remote_region")]
    pub region: RemoteRegion,
    /// Bytes in the segment.
    pub capacity: u64,
    /// Its node is draining: no new replica goes there, and what it holds is on its
    /// way elsewhere.
    pub draining: bool,
}

/// What a client must do to change an object's replica count: copy the object from a
/// source replica into each target, then call
/// [`MasterService::replicate_end`](crate::MasterService::replicate_end). Extra replicas were already dropped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicatePlan {
    /// Object length.
    pub len: u64,
    /// crc32c of the object's bytes.
    pub checksum: u32,
    /// Complete replicas to copy from (the object is leased while the plan runs).
    pub sources: Vec<MemoryReplica>,
    /// New replicas to fill; not readable until `replicate_end`.
    pub targets: Vec<MemoryReplica>,
    /// Replicas dropped to reach a lower count.
    pub dropped: usize,
}

/// Counters and gauges of the master.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MasterStats {
    /// Complete objects.
    pub objects: u64,
    /// Puts started and not yet ended.
    pub pending_puts: u64,
    /// Logical bytes of complete objects (one replica each).
    pub object_bytes: u64,
    /// Memory replicas (complete or not).
    pub replicas: u64,
    /// Registered clients.
    pub clients: u64,
    /// Mounted segments.
    pub segments: u64,
    /// Bytes of all mounted segments.
    pub capacity_bytes: u64,
    /// Bytes allocated in all mounted segments.
    pub used_bytes: u64,
    /// Worst fragmentation of any segment (0 = none, 1 = all free space in slivers).
    pub max_fragmentation: f64,
    /// Objects evicted since start.
    pub evicted_objects: u64,
    /// Bytes of memory freed by eviction since start.
    pub evicted_bytes: u64,
    /// Removes refused because of a live lease.
    pub lease_refusals: u64,
    /// Puts reclaimed after `put_timeout`.
    pub put_timeouts: u64,
    /// Clients expired after `client_ttl`.
    pub expired_clients: u64,
    /// Puts placed with fewer replicas than asked (fewer segments with room, or
    /// segments a client could not write to).
    pub under_replicated_puts: u64,
    /// Segments a client reported it could not write to (placement skips them until
    /// their owner heartbeats again).
    pub segment_failures: u64,
    /// Storage nodes forgotten because their records could not be delivered: the node
    /// was certainly gone (its endpoint refused connections), or deliveries failed for
    /// a whole client TTL while it heartbeated.
    pub record_failures: u64,
    /// Records and disk files a node offered back and the master refused: their key
    /// was removed or put again after they were written (their generation is older).
    pub stale_copies: u64,
    /// Removals handed to nodes to keep for a restarted master: the key's copies
    /// may have been out of sight (a node forgotten before it was told), and only
    /// such tombstones tell a restarted master of the removal.
    pub carried_tombstones: u64,
    /// Puts that declared their checksum before they ended (when they started,
    /// `put_start_summed`, or while written, `put_declare`) and ended with it: their
    /// records went to the nodes while the bytes were written.
    pub declared_puts: u64,
    /// Times the master noticed it had itself been stalled and granted a grace period.
    pub stall_graces: u64,
    /// Placements clients hold ahead of their puts (`place_ahead`), not bound yet.
    pub held_placements: u64,
    /// Puts written into a placement held ahead and bound to their key (`put_bind`).
    pub bound_puts: u64,
    /// Allocation strategy in use.
    pub allocation_strategy: String,
    /// Bytes of memory the object index uses, keys included (an estimate from the
    /// sizes of its structures: table slots, entries, replica lists, allocator nodes).
    pub metadata_bytes: u64,
    /// Bytes of keys, included in `metadata_bytes`.
    pub key_bytes: u64,
    /// Capacity and use of every mounted segment.
    pub segment_usage: Vec<SegmentUsage>,
    /// Cluster mode: slot groups this master took the lead of since start.
    pub groups_acquired: u64,
    /// Cluster mode: slot groups this master gave up (moved, or its lease lapsed).
    pub groups_released: u64,
    /// Cluster mode: calls answered `Moved` (a key of a group led elsewhere).
    pub moved_answers: u64,
}

impl MasterStats {
    /// Adds `other`'s counts to these (the stats of a cluster: the sum over its
    /// masters; the worst fragmentation; the segment lists joined).
    pub fn merge(&mut self, other: &MasterStats) {
        macro_rules! add {
            ($($f:ident),*) => { $( self.$f += other.$f; )* };
        }
        add!(
            objects,
            pending_puts,
            object_bytes,
            replicas,
            clients,
            segments,
            capacity_bytes,
            used_bytes,
            evicted_objects,
            evicted_bytes,
            lease_refusals,
            put_timeouts,
            expired_clients,
            under_replicated_puts,
            segment_failures,
            record_failures,
            stale_copies,
            carried_tombstones,
            declared_puts,
            stall_graces,
            held_placements,
            bound_puts,
            metadata_bytes,
            key_bytes,
            groups_acquired,
            groups_released,
            moved_answers
        );
        self.max_fragmentation = self.max_fragmentation.max(other.max_fragmentation);
        if self.allocation_strategy.is_empty() {
            self.allocation_strategy = other.allocation_strategy.clone();
        }
        self.segment_usage.extend(other.segment_usage.iter().cloned());
    }
}

/// Capacity and use of one segment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SegmentUsage {
    /// Segment id.
    pub segment: SegmentId,
    /// Segment name.
    pub name: String,
    /// Bytes in the segment.
    pub capacity: u64,
    /// Bytes allocated.
    pub used: u64,
    /// Fragmentation of its free space (0..1).
    pub fragmentation: f64,
}

/// What a client learns when it registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientRegistration {
    /// The client's id.
    pub client: ClientId,
    /// The master expires clients silent for this long (ms); heartbeat well within it.
    pub client_ttl_ms: u64,
    /// Random for each start of a master: a client that must register again with the
    /// same incarnation was forgotten by a master that kept running, with another one
    /// the master restarted. Either way the client offers its records back (the master
    /// refuses those a later removal or put superseded, by their generations).
    pub incarnation: u64,
}

/// One object held in a segment, as its owner records it so that a restarted master
/// can be told again: a master restart loses nothing (ARCHITECTURE.md, "Durable records").
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectRecord {
    /// Object key.
    pub key: String,
    /// Offset of the replica in the owner's segment.
    pub offset: u64,
    /// Object length.
    pub len: u64,
    /// crc32c of the bytes.
    pub checksum: u32,
    /// The generation the master stamped the record with: later than the key's last
    /// put or remove before it, earlier than any after it (ARCHITECTURE.md,
    /// "Generations"). A record older than what the master knows of its key is
    /// refused when it is offered again.
    pub generation: u64,
}

/// A change to the objects a storage node holds, delivered on its record endpoint (or
/// with the answers to its heartbeats). Each carries a generation, increasing in the
/// order a node's changes are queued: a node applies a change of a segment only if it
/// is newer than the last one applied there, so a late duplicate frame changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordUpdate {
    /// A complete replica now lives in `segment` (the record's generation orders it).
    Added {
        /// The segment (owned by the heartbeating client).
        segment: SegmentId,
        /// The object.
        record: ObjectRecord,
    },
    /// The replica of `key` at `offset` left `segment`.
    Removed {
        /// The segment.
        segment: SegmentId,
        /// Object key.
        key: String,
        /// Offset the replica had.
        offset: u64,
        /// When (the master's generation clock) it left.
        generation: u64,
    },
    /// The object under `key` was removed or replaced: a file of it on the node's SSD
    /// tier written with generation `generation` or older is deleted before the node
    /// answers (a newer one, of a later put, stays).
    Discard {
        /// Object key.
        key: String,
        /// The generation of the removal.
        generation: u64,
    },
    /// The node is asked to drain (`drain_segment`): move its objects away within
    /// `grace_ms`, then report. Ordered like any update; about no key.
    Drain {
        /// The grace period the drain was asked with (ms).
        grace_ms: u64,
        /// When (the master's generation clock) it was asked.
        generation: u64,
    },
    /// `key` was removed (or replaced) at `generation` while a copy of it may be
    /// where the master cannot see it (on a node it forgot): the node keeps this
    /// tombstone and offers it to a master it registers with again
    /// (`MasterApi::restore_tombstones`), so that a restarted master refuses that
    /// copy too. About no segment of the node.
    Tombstone {
        /// Object key.
        key: String,
        /// The generation of the removal.
        generation: u64,
    },
}

impl RecordUpdate {
    /// The generation that orders the update.
    pub fn generation(&self) -> u64 {
        match self {
            RecordUpdate::Added { record, .. } => record.generation,
            RecordUpdate::Removed { generation, .. }
            | RecordUpdate::Discard { generation, .. }
            | RecordUpdate::Drain { generation, .. }
            | RecordUpdate::Tombstone { generation, .. } => *generation,
        }
    }

    /// The key the update is about.
    pub fn key(&self) -> &str {
        match self {
            RecordUpdate::Added { record, .. } => &record.key,
            RecordUpdate::Removed { key, .. }
            | RecordUpdate::Discard { key, .. }
            | RecordUpdate::Tombstone { key, .. } => key,
            RecordUpdate::Drain { .. } => "",
        }
    }

    /// The segment the update is about (`None`: the node's SSD tier).
    pub fn segment(&self) -> Option<SegmentId> {
        match self {
            RecordUpdate::Added { segment, .. } | RecordUpdate::Removed { segment, .. } => Some(*segment),
            RecordUpdate::Discard { .. } | RecordUpdate::Drain { .. } | RecordUpdate::Tombstone { .. } => None,
        }
    }
}

/// What an eviction pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EvictionReport {
    /// Objects removed.
    pub evicted_objects: u64,
    /// Bytes of memory freed (on the segment targeted, or everywhere).
    pub freed_bytes: u64,
    /// Objects kept because they wait to be offloaded to an SSD tier first; their
    /// memory is freed by a later pass, once they are on disk.
    pub awaiting_offload: u64,
}

impl EvictionReport {
    pub(crate) fn add(&mut self, other: EvictionReport) {
        self.evicted_objects += other.evicted_objects;
        self.freed_bytes += other.freed_bytes;
        self.awaiting_offload += other.awaiting_offload;
    }
}

/// `RemoteRegion` (of the transfer crate, which has no serde) as `(endpoint, region)`.
pub(crate) mod remote_region {
    use mooncake_transfer::RemoteRegion;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(crate) fn serialize<S: Serializer>(r: &RemoteRegion, s: S) -> Result<S::Ok, S::Error> {
        (&r.endpoint, r.region).serialize(s)
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<RemoteRegion, D::Error> {
        let (endpoint, region) = <(String, u64)>::deserialize(d)?;
        Ok(RemoteRegion { endpoint, region })
    }
}
