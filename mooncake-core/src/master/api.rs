//! `MasterApi`: the calls a client makes to a master, in process or over the network.

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;
use serde::{Deserialize, Serialize};

use crate::config::ReplicateConfig;
use crate::error::Result;

use super::{
    ClientId, MasterService, MasterStats, MemoryReplica, ObjectInfo, OffloadPlan, ReplicaList, ReplicatePlan,
    SegmentInfo,
};

/// What a client learns when it registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClientRegistration {
    /// The client's id.
    pub client: ClientId,
    /// The master expires clients silent for this long (ms); heartbeat well within it.
    pub client_ttl_ms: u64,
}

/// One object held in a segment, as its owner records it so that a restarted master
/// can be told again (DESIGN §2: a master restart loses nothing).
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
}

/// A change to the objects of one of a client's segments, delivered with heartbeats.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordUpdate {
    /// A complete replica now lives in `segment`.
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
    },
}

/// The calls a client makes to a master. [`MasterService`] implements it in process;
/// the RPC client implements it over TCP. Every per-key call has a batch form.
pub trait MasterApi: Send + Sync {
    /// Registers a new client.
    fn register_client(&self) -> Result<ClientRegistration>;
    /// Records a heartbeat; returns changes to the client's segments since the last one.
    fn heartbeat(&self, client: ClientId) -> Result<Vec<RecordUpdate>>;
    /// Mounts a segment served at `region`.
    fn mount_segment(&self, client: ClientId, region: RemoteRegion, capacity: u64) -> Result<SegmentId>;
    /// Mounts a segment that already holds objects (after a master restart); records
    /// that conflict with what the master knows are skipped. Returns the segment id
    /// and how many records were taken.
    fn remount_segment(
        &self,
        client: ClientId,
        region: RemoteRegion,
        capacity: u64,
        records: Vec<ObjectRecord>,
    ) -> Result<(SegmentId, usize)>;
    /// Unmounts a segment; returns how many objects lost their last replica.
    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> Result<usize>;
    /// Unregisters a client and unmounts its segments.
    fn unregister_client(&self, client: ClientId) -> Result<usize>;
    /// Where a segment is served.
    fn segment_info(&self, segment: SegmentId) -> Result<SegmentInfo>;
    /// Phase one of a put.
    fn put_start(&self, client: ClientId, key: &str, len: u64, cfg: &ReplicateConfig) -> Result<Vec<MemoryReplica>>;
    /// Phase two of a put.
    fn put_end(&self, client: ClientId, key: &str, checksum: u32) -> Result<()>;
    /// Abandons a put.
    fn put_revoke(&self, client: ClientId, key: &str) -> Result<()>;
    /// Complete replicas and a lease.
    fn get_replica_list(&self, key: &str) -> Result<ReplicaList>;
    /// Whether a complete object exists.
    fn exists(&self, key: &str) -> Result<bool>;
    /// Removes an object.
    fn remove(&self, key: &str) -> Result<()>;
    /// Removes every unleased object.
    fn remove_all(&self) -> Result<usize>;
    /// Starts a replica-count change.
    fn replicate_start(&self, client: ClientId, key: &str, cfg: &ReplicateConfig) -> Result<ReplicatePlan>;
    /// Ends a replica-count change.
    fn replicate_end(&self, key: &str, targets: &[MemoryReplica], ok: bool) -> Result<()>;
    /// Batch [`put_start`](Self::put_start).
    fn batch_put_start(
        &self,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>>;
    /// Batch [`put_end`](Self::put_end).
    fn batch_put_end(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>>;
    /// Batch [`put_revoke`](Self::put_revoke).
    fn batch_put_revoke(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>>;
    /// Batch [`get_replica_list`](Self::get_replica_list).
    fn batch_get_replica_list(&self, keys: &[&str]) -> Vec<Result<ReplicaList>>;
    /// Batch [`exists`](Self::exists).
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>>;
    /// Batch [`remove`](Self::remove).
    fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>>;
    /// Records the SSD capacity of a client.
    fn report_ssd_capacity(&self, client: ClientId, capacity_bytes: i64) -> Result<()>;
    /// Objects (key, length, checksum) a client wrote to its SSD: `LocalDisk` replicas.
    fn notify_offload_success(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>>;
    /// Objects a client evicted from its SSD: their `LocalDisk` replicas go.
    fn batch_evict_disk_replica(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>>;
    /// A client offers an SSD tier, serving loads at `endpoint`.
    fn mount_ssd(&self, client: ClientId, capacity_bytes: i64, endpoint: &str) -> Result<()>;
    /// Where a client serves loads from its SSD.
    fn disk_endpoint(&self, client: ClientId) -> Result<String>;
    /// What a client's SSD tier should offload (at most `max` objects) and discard.
    fn offload_heartbeat(&self, client: ClientId, max: usize) -> Result<OffloadPlan>;
    /// Objects (key, length, checksum) a client found on its SSD at start.
    fn register_disk_objects(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>>;
    /// What the master knows of one object, without granting a lease.
    fn object_info(&self, key: &str) -> Result<ObjectInfo>;
    /// Keys of complete objects, at most `limit`.
    fn list_keys(&self, limit: usize) -> Result<Vec<String>>;
    /// Counters and gauges.
    fn stats(&self) -> Result<MasterStats>;
}

impl MasterApi for MasterService {
    fn register_client(&self) -> Result<ClientRegistration> {
        Ok(ClientRegistration {
            client: MasterService::register_client(self),
            client_ttl_ms: self.config().client_ttl.as_millis() as u64,
        })
    }
    fn heartbeat(&self, client: ClientId) -> Result<Vec<RecordUpdate>> {
        MasterService::heartbeat(self, client)
    }
    fn mount_segment(&self, client: ClientId, region: RemoteRegion, capacity: u64) -> Result<SegmentId> {
        MasterService::mount_segment(self, client, region, capacity)
    }
    fn remount_segment(
        &self,
        client: ClientId,
        region: RemoteRegion,
        capacity: u64,
        records: Vec<ObjectRecord>,
    ) -> Result<(SegmentId, usize)> {
        MasterService::remount_segment(self, client, region, capacity, records)
    }
    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> Result<usize> {
        MasterService::unmount_segment(self, client, segment)
    }
    fn unregister_client(&self, client: ClientId) -> Result<usize> {
        Ok(MasterService::unregister_client(self, client))
    }
    fn segment_info(&self, segment: SegmentId) -> Result<SegmentInfo> {
        MasterService::segment_info(self, segment)
            .ok_or_else(|| crate::Error::NotFound(format!("segment {segment} is not mounted")))
    }
    fn put_start(&self, client: ClientId, key: &str, len: u64, cfg: &ReplicateConfig) -> Result<Vec<MemoryReplica>> {
        MasterService::put_start(self, client, key, len, cfg)
    }
    fn put_end(&self, client: ClientId, key: &str, checksum: u32) -> Result<()> {
        MasterService::put_end(self, client, key, checksum)
    }
    fn put_revoke(&self, client: ClientId, key: &str) -> Result<()> {
        MasterService::put_revoke(self, client, key)
    }
    fn get_replica_list(&self, key: &str) -> Result<ReplicaList> {
        MasterService::get_replica_list(self, key)
    }
    fn exists(&self, key: &str) -> Result<bool> {
        MasterService::exists(self, key)
    }
    fn remove(&self, key: &str) -> Result<()> {
        MasterService::remove(self, key)
    }
    fn remove_all(&self) -> Result<usize> {
        Ok(MasterService::remove_all(self))
    }
    fn replicate_start(&self, client: ClientId, key: &str, cfg: &ReplicateConfig) -> Result<ReplicatePlan> {
        MasterService::replicate_start(self, client, key, cfg)
    }
    fn replicate_end(&self, key: &str, targets: &[MemoryReplica], ok: bool) -> Result<()> {
        MasterService::replicate_end(self, key, targets, ok)
    }
    fn batch_put_start(
        &self,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        MasterService::batch_put_start(self, client, items, cfg)
    }
    fn batch_put_end(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        MasterService::batch_put_end(self, client, items)
    }
    fn batch_put_revoke(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        MasterService::batch_put_revoke(self, client, keys)
    }
    fn batch_get_replica_list(&self, keys: &[&str]) -> Vec<Result<ReplicaList>> {
        MasterService::batch_get_replica_list(self, keys)
    }
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        MasterService::batch_exists(self, keys)
    }
    fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>> {
        MasterService::batch_remove(self, keys)
    }
    fn object_info(&self, key: &str) -> Result<ObjectInfo> {
        MasterService::object_info(self, key)
    }
    fn report_ssd_capacity(&self, client: ClientId, capacity_bytes: i64) -> Result<()> {
        MasterService::report_ssd_capacity(self, client, capacity_bytes)
    }
    fn notify_offload_success(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>> {
        MasterService::notify_offload_success(self, client, items)
    }
    fn batch_evict_disk_replica(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        MasterService::batch_evict_disk_replica(self, client, keys)
    }
    fn list_keys(&self, limit: usize) -> Result<Vec<String>> {
        Ok(MasterService::list_keys(self, limit))
    }
    fn mount_ssd(&self, client: ClientId, capacity_bytes: i64, endpoint: &str) -> Result<()> {
        MasterService::mount_ssd(self, client, capacity_bytes, endpoint)
    }
    fn disk_endpoint(&self, client: ClientId) -> Result<String> {
        MasterService::disk_endpoint(self, client)
    }
    fn offload_heartbeat(&self, client: ClientId, max: usize) -> Result<OffloadPlan> {
        MasterService::offload_heartbeat(self, client, max)
    }
    fn register_disk_objects(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>> {
        MasterService::register_disk_objects(self, client, items)
    }
    fn stats(&self) -> Result<MasterStats> {
        Ok(MasterService::stats(self))
    }
}
