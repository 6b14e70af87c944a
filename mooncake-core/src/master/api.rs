//! `MasterApi`: the calls a client makes to a master, written once.
//!
//! [`master_calls!`] is the one table of those calls. Everything that has to list
//! them follows from it:
//! - the [`MasterApi`] trait (below),
//! - its in-process implementation for [`MasterService`], which forwards each call to
//!   the service's inherent method of the same name (below),
//! - the wire messages, one `Request` and one `Response` variant per call
//!   (`rpc::wire`),
//! - the RPC client (`rpc::client`) and the server's dispatch over `&dyn MasterApi`
//!   (`rpc::server`),
//! - the cluster client's routing of each call (`cluster_client::api`), from the
//!   entry's route tag.
//!
//! Adding a call means one entry in the table (with its route) and one method on
//! `MasterService` (see ARCHITECTURE.md, "How to add a master call").

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;

use crate::config::ReplicateConfig;
use crate::error::Result;
use crate::master::drain::DrainProgress;
use crate::master::service::MasterService;
use crate::master::types::{
    ClientId, ClientRegistration, HeldPlacement, MasterStats, MemoryReplica, ObjectInfo, ObjectRecord, OffloadPlan,
    RecordUpdate, ReplicaList, ReplicatePlan, SegmentInfo,
};

/// The table of master calls. Calls `$m! { .. }` with one entry per call:
///
/// ```text
/// Variant => fn name(arg: ArgType => WireType, ..) -> ReturnType => route;
/// ```
///
/// `ArgType` is what the trait method takes, `WireType` what the request carries
/// (converted with `rpc::convert::IntoWire` and back with `Lend`/`Arg`).
/// `ReturnType` is `Result<T>` for a call on one object, `Vec<Result<T>>` for a batch
/// call (one result per item, in order). The order of the entries is the order of the
/// variants on the wire: append, never reorder.
///
/// `route` says where the client of a cluster of masters (`cluster_client`) sends the
/// call; everything else ignores it:
/// - `by_key(arg)`: to the leader of the slot group of the key `arg`;
/// - `by_keys(arg)`: a batch call whose items `arg` (keys, or tuples that start with
///   the key) are split by their groups' leaders, one part to each, the answers put
///   back in item order;
/// - `by_segment(arg)`: to the master that handed out the segment `arg`;
/// - `to_all(fold)`: to every master, the answers folded with `fold` (`add`, `merge`,
///   `each`: see `cluster_client::api`);
/// - `refused`: not a call a client of a cluster makes (it fails);
/// - `own`: a hand-written method of the cluster client (`cluster_client::own`).
///
/// `by_key` and `by_keys` may add `+ hook`: a method of the cluster client shown each
/// answer with the master that gave it (`note_placed`, `note_homes`). An argument named
/// `client` is the caller's id; a cluster client sends the id the master it goes to
/// knows it by.
macro_rules! master_calls {
    ($m:ident) => {
        $m! {
            /// Registers a new client.
            RegisterClient => fn register_client() -> Result<ClientRegistration> => own;
            /// Records a heartbeat; returns changes to the client's segments since the last one.
            Heartbeat => fn heartbeat(client: ClientId => ClientId) -> Result<Vec<RecordUpdate>> => own;
            /// Mounts a segment served at `region`.
            MountSegment => fn mount_segment(
                client: ClientId => ClientId,
                region: &RemoteRegion => WireRegion,
                capacity: u64 => u64
            ) -> Result<SegmentId> => refused;
            /// Mounts a segment that already holds objects (after a master restart); records
            /// that conflict with what the master knows are skipped. Returns the segment id
            /// and how many records were taken.
            RemountSegment => fn remount_segment(
                client: ClientId => ClientId,
                region: &RemoteRegion => WireRegion,
                capacity: u64 => u64,
                records: &[ObjectRecord] => Vec<ObjectRecord>
            ) -> Result<(SegmentId, usize)> => refused;
            /// Unmounts a segment; returns how many objects lost their last replica.
            UnmountSegment => fn unmount_segment(client: ClientId => ClientId, segment: SegmentId => SegmentId)
                -> Result<usize> => by_segment(segment);
            /// Unregisters a client and unmounts its segments; returns how many objects went.
            UnregisterClient => fn unregister_client(client: ClientId => ClientId) -> Result<usize> => own;
            /// Where a segment is served.
            SegmentInfo => fn segment_info(segment: SegmentId => SegmentId) -> Result<SegmentInfo> => by_segment(segment);
            /// Phase one of a put: reserves replicas to write.
            PutStart => fn put_start(
                client: ClientId => ClientId,
                key: &str => String,
                len: u64 => u64,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Result<Vec<MemoryReplica>> => by_key(key) + note_placed;
            /// Phase two of a put: the object becomes readable.
            PutEnd => fn put_end(client: ClientId => ClientId, key: &str => String, checksum: u32 => u32) -> Result<()> => by_key(key);
            /// Abandons a put.
            PutRevoke => fn put_revoke(client: ClientId => ClientId, key: &str => String) -> Result<()> => by_key(key);
            /// Complete replicas and a read lease.
            GetReplicaList => fn get_replica_list(key: &str => String) -> Result<ReplicaList> => by_key(key) + note_homes;
            /// Whether a complete object exists.
            Exists => fn exists(key: &str => String) -> Result<bool> => by_key(key);
            /// Removes an object.
            Remove => fn remove(key: &str => String) -> Result<()> => by_key(key);
            /// Removes every unleased object; returns how many.
            RemoveAll => fn remove_all() -> Result<usize> => to_all(add);
            /// Starts a replica-count change.
            ReplicateStart => fn replicate_start(
                client: ClientId => ClientId,
                key: &str => String,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Result<ReplicatePlan> => by_key(key);
            /// Ends a replica-count change.
            ReplicateEnd => fn replicate_end(
                key: &str => String,
                targets: &[MemoryReplica] => Vec<MemoryReplica>,
                ok: bool => bool
            ) -> Result<()> => by_key(key);
            /// Batch [`put_start`](crate::MasterApi::put_start).
            BatchPutStart => fn batch_put_start(
                client: ClientId => ClientId,
                items: &[(&str, u64)] => Vec<(String, u64)>,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Vec<Result<Vec<MemoryReplica>>> => by_keys(items) + note_placed;
            /// Batch [`put_end`](crate::MasterApi::put_end).
            BatchPutEnd => fn batch_put_end(client: ClientId => ClientId, items: &[(&str, u32)] => Vec<(String, u32)>)
                -> Vec<Result<()>> => by_keys(items);
            /// Batch [`put_revoke`](crate::MasterApi::put_revoke).
            BatchPutRevoke => fn batch_put_revoke(client: ClientId => ClientId, keys: &[&str] => Vec<String>)
                -> Vec<Result<()>> => by_keys(keys);
            /// Batch [`get_replica_list`](crate::MasterApi::get_replica_list).
            BatchGetReplicaList => fn batch_get_replica_list(keys: &[&str] => Vec<String>) -> Vec<Result<ReplicaList>> => by_keys(keys) + note_homes;
            /// Batch [`exists`](crate::MasterApi::exists).
            BatchExists => fn batch_exists(keys: &[&str] => Vec<String>) -> Vec<Result<bool>> => by_keys(keys);
            /// Batch [`remove`](crate::MasterApi::remove).
            BatchRemove => fn batch_remove(keys: &[&str] => Vec<String>) -> Vec<Result<()>> => by_keys(keys);
            /// Keys of complete objects, at most `limit`, in no particular order. Over
            /// RPC, also at most [`MAX_LISTED_KEYS`](crate::rpc::MAX_LISTED_KEYS) and a
            /// frame's worth ([`LIST_KEYS_MAX_BYTES`](crate::rpc::LIST_KEYS_MAX_BYTES)):
            /// a server answers no more, whatever the limit. For every key, use
            /// [`all_keys`](crate::MasterApi::all_keys).
            ListKeys => fn list_keys(limit: usize => usize) -> Result<Vec<String>> => own;
            /// Counters and gauges.
            Stats => fn stats() -> Result<MasterStats> => to_all(merge);
            /// What the master knows of one object, without granting a lease.
            ObjectInfo => fn object_info(key: &str => String) -> Result<ObjectInfo> => by_key(key);
            /// Records the SSD capacity of a client.
            ReportSsdCapacity => fn report_ssd_capacity(client: ClientId => ClientId, capacity_bytes: i64 => i64)
                -> Result<()> => to_all(each);
            /// Objects (key, length, checksum, the offload task's generation) a client
            /// wrote to its SSD: `LocalDisk` replicas.
            NotifyOffloadSuccess => fn notify_offload_success(
                client: ClientId => ClientId,
                items: &[(&str, u64, u32, u64)] => Vec<(String, u64, u32, u64)>
            ) -> Vec<Result<()>> => by_keys(items);
            /// Objects a client evicted from its SSD: their `LocalDisk` replicas go.
            BatchEvictDiskReplica => fn batch_evict_disk_replica(client: ClientId => ClientId, keys: &[&str] => Vec<String>)
                -> Vec<Result<()>> => by_keys(keys);
            /// A client offers an SSD tier, serving loads at `endpoint`.
            MountSsd => fn mount_ssd(client: ClientId => ClientId, capacity_bytes: i64 => i64, endpoint: &str => String)
                -> Result<()> => to_all(each);
            /// Where a client serves loads from its SSD.
            DiskEndpoint => fn disk_endpoint(client: ClientId => ClientId) -> Result<String> => own;
            /// What a client's SSD tier should offload (at most `max` objects) and discard.
            OffloadHeartbeat => fn offload_heartbeat(client: ClientId => ClientId, max: usize => usize) -> Result<OffloadPlan> => own;
            /// Objects (key, length, checksum, generation) a client found on its SSD at start.
            RegisterDiskObjects => fn register_disk_objects(
                client: ClientId => ClientId,
                items: &[(&str, u64, u32, u64)] => Vec<(String, u64, u32, u64)>
            ) -> Vec<Result<()>> => by_keys(items);
            /// A storage node serves the records of its segments at `endpoint`: the master
            /// tells it of every change there before acknowledging the put or remove. `key`
            /// (32 random bytes of the node) is what the master proves on that endpoint
            /// (see [`record_endpoint_secret`](crate::rpc::record_endpoint_secret)): only
            /// a master the node mounted on may change its records.
            MountRecords => fn mount_records(client: ClientId => ClientId, endpoint: &str => String, key: &[u8] => Vec<u8>)
                -> Result<()> => own;
            /// A client could not write to `segment`: the master places nothing there until
            /// its owner heartbeats again.
            ReportSegmentFailure => fn report_segment_failure(
                client: ClientId => ClientId,
                segment: SegmentId => SegmentId
            ) -> Result<()> => by_segment(segment);
            /// Ends one read lease of each key: the reads those replica lists served are over.
            ReleaseLeases => fn release_leases(keys: &[&str] => Vec<String>) -> Result<()> => own;
            /// Asks a client's SSD tier to offload what its segments hold that is on no SSD;
            /// returns how many such objects are left.
            FlushSegments => fn flush_segments(client: ClientId => ClientId) -> Result<u64> => to_all(add);
            /// Cluster mode: mounts one extent of a node's memory for slot group `group`,
            /// with the objects it holds (records of other groups' keys are skipped).
            /// Fails with `Moved` unless this master leads the group. Returns the
            /// extent's segment id and how many records were taken.
            MountExtent => fn mount_extent(
                client: ClientId => ClientId,
                region: &RemoteRegion => WireRegion,
                capacity: u64 => u64,
                group: u32 => u32,
                records: &[ObjectRecord] => Vec<ObjectRecord>
            ) -> Result<(SegmentId, usize)> => refused;
            /// Phase one of an upsert: reserves new replicas to write while the object's
            /// current ones stay readable (an absent key is put).
            UpsertStart => fn upsert_start(
                client: ClientId => ClientId,
                key: &str => String,
                len: u64 => u64,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Result<Vec<MemoryReplica>> => by_key(key) + note_placed;
            /// Phase two of an upsert: the new replicas replace the old ones in one step.
            UpsertEnd => fn upsert_end(client: ClientId => ClientId, key: &str => String, checksum: u32 => u32)
                -> Result<()> => by_key(key);
            /// Abandons an upsert; the object keeps its value.
            UpsertRevoke => fn upsert_revoke(client: ClientId => ClientId, key: &str => String) -> Result<()> => by_key(key);
            /// Batch [`upsert_start`](crate::MasterApi::upsert_start).
            BatchUpsertStart => fn batch_upsert_start(
                client: ClientId => ClientId,
                items: &[(&str, u64)] => Vec<(String, u64)>,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Vec<Result<Vec<MemoryReplica>>> => by_keys(items) + note_placed;
            /// Batch [`upsert_end`](crate::MasterApi::upsert_end).
            BatchUpsertEnd => fn batch_upsert_end(
                client: ClientId => ClientId,
                items: &[(&str, u32)] => Vec<(String, u32)>
            ) -> Vec<Result<()>> => by_keys(items);
            /// Batch [`upsert_revoke`](crate::MasterApi::upsert_revoke).
            BatchUpsertRevoke => fn batch_upsert_revoke(client: ClientId => ClientId, keys: &[&str] => Vec<String>)
                -> Vec<Result<()>> => by_keys(keys);
            /// Drops the complete memory replicas that the segment named `segment`
            /// (`endpoint#n`) holds of each key; an object left with no replica at all
            /// is removed. `NotFound` when the object is absent or has no replica there,
            /// `HasLease` while a read or a copy holds it, `InvalidArgument` when no
            /// such segment is mounted.
            BatchDropReplicas => fn batch_drop_replicas(keys: &[&str] => Vec<String>, segment: &str => String)
                -> Vec<Result<()>> => by_keys(keys);
            /// Drains the storage node that `segment` names (`endpoint#n`, or its
            /// endpoint): its segments take no new replica from now on (reads go on), and
            /// the node is told to move its objects away within `grace_ms`. Returns where
            /// the drain stands; `segments` 0: no such node is mounted.
            DrainSegment => fn drain_segment(segment: &str => String, grace_ms: u64 => u64)
                -> Result<DrainProgress> => to_all(drain);
            /// A draining node reports its progress.
            DrainReport => fn drain_report(client: ClientId => ClientId, progress: &DrainProgress => DrainProgress)
                -> Result<()> => to_all(each);
            /// Where the drain of the node that `segment` names stands.
            DrainStatus => fn drain_status(segment: &str => String) -> Result<DrainProgress> => to_all(drain);
            /// [`batch_drop_replicas`](crate::MasterApi::batch_drop_replicas) that never
            /// drops a key's last copy: the replica on `segment` goes only while another
            /// complete memory replica of the key, or a disk replica, stays (else
            /// `NotFound`, and it is kept). Checked under the key's lock, so a node lost after the caller
            /// looked cannot make it drop the last replica (what a drain relies on).
            BatchDropSpareReplicas => fn batch_drop_spare_replicas(
                keys: &[&str] => Vec<String>,
                segment: &str => String
            ) -> Vec<Result<()>> => by_keys(keys);
            /// [`put_start`](crate::MasterApi::put_start) of a value whose crc32c the
            /// writer knows before it writes: with durable records, the records go to the
            /// replicas' nodes while the bytes are written, and a
            /// [`put_end`](crate::MasterApi::put_end) with the same checksum rarely waits
            /// for them.
            PutStartSummed => fn put_start_summed(
                client: ClientId => ClientId,
                key: &str => String,
                len: u64 => u64,
                checksum: u32 => u32,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Result<Vec<MemoryReplica>> => by_key(key) + note_placed;
            /// Batch [`put_start_summed`](crate::MasterApi::put_start_summed): items are
            /// (key, length, checksum).
            BatchPutStartSummed => fn batch_put_start_summed(
                client: ClientId => ClientId,
                items: &[(&str, u64, u32)] => Vec<(String, u64, u32)>,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Vec<Result<Vec<MemoryReplica>>> => by_keys(items) + note_placed;
            /// Declares the crc32c of a put this client started without one, while
            /// its bytes are written: its records go to the replicas' nodes now, as
            /// [`put_start_summed`](crate::MasterApi::put_start_summed)'s do. `NotFound`
            /// when this client has no put of `key` in progress.
            PutDeclare => fn put_declare(client: ClientId => ClientId, key: &str => String, checksum: u32 => u32)
                -> Result<()> => by_key(key);
            /// Batch [`put_declare`](crate::MasterApi::put_declare): items are (key,
            /// checksum).
            BatchPutDeclare => fn batch_put_declare(client: ClientId => ClientId, items: &[(&str, u32)] => Vec<(String, u32)>)
                -> Vec<Result<()>> => by_keys(items);
            /// Holds room for this client's next put of `len` bytes with `cfg`, before
            /// its key is known: the client writes the value there, binds it with
            /// [`put_bind`](crate::MasterApi::put_bind) while it writes, and ends it
            /// with [`put_end`](crate::MasterApi::put_end): no `put_start` round trip
            /// before the bytes move. The room is freed when its hold ends
            /// (`held_for_ms`) unless bound (a room closed by a refused bind, or
            /// with its client or segment, a hold after that). Never evicts. Not
            /// offered in cluster mode.
            PlaceAhead => fn place_ahead(
                client: ClientId => ClientId,
                len: u64 => u64,
                cfg: &ReplicateConfig => ReplicateConfig
            ) -> Result<HeldPlacement> => refused;
            /// Binds this client's held `placement` (see
            /// [`place_ahead`](crate::MasterApi::place_ahead)), written, to `key`: a
            /// put in progress from here on, declared with `checksum` as
            /// [`put_start_summed`](crate::MasterApi::put_start_summed) declares it,
            /// which [`put_end`](crate::MasterApi::put_end) ends. With `ahead`, also
            /// holds a placement like it for the next put. `AlreadyExists` for a key
            /// taken, `NotFound` for a placement not held (a refused placement binds
            /// no more; its room is kept a hold longer, for writes still landing,
            /// then freed). Asked again with the same key, answers `Ok(None)`.
            PutBind => fn put_bind(
                client: ClientId => ClientId,
                placement: u64 => u64,
                key: &str => String,
                checksum: u32 => u32,
                ahead: bool => bool
            ) -> Result<Option<HeldPlacement>> => by_key(key);
            /// Batch [`put_bind`](crate::MasterApi::put_bind): items are (key,
            /// placement, checksum); with `ahead`, a placement ahead for each item
            /// bound.
            BatchPutBind => fn batch_put_bind(
                client: ClientId => ClientId,
                items: &[(&str, u64, u32)] => Vec<(String, u64, u32)>,
                ahead: bool => bool
            ) -> Vec<Result<Option<HeldPlacement>>> => by_keys(items);
            /// One page of the keys of complete objects: the first `limit` keys after
            /// `after` in byte order (from the first key when `after` is empty), sorted.
            /// The next page starts after this page's last key; an empty page ends the
            /// listing ([`all_keys`](crate::MasterApi::all_keys) walks them). Over RPC a
            /// page is also cut at [`MAX_LISTED_KEYS`](crate::rpc::MAX_LISTED_KEYS) and a
            /// frame's worth: the cut drops the page's tail, which the next page begins
            /// with, so no key is skipped.
            ListKeysAfter => fn list_keys_after(after: &str => String, limit: usize => usize)
                -> Result<Vec<String>> => own;
            /// A client whose connection to this master broke is back on a fresh one
            /// (an RPC client of a store says so first on every connection it opens
            /// after one broke, until this is answered). To a master younger than two
            /// client TTLs this means it restarted: the storage nodes are on their way
            /// back with their objects, so for one TTL a key it does not hold is
            /// `Recovering`, not `NotFound`, and is not put, as once a node re-mounted
            /// with objects, but from before the first one is back. Nothing in cluster
            /// mode (a slot group's window opens when it is taken over).
            Reconnected => fn reconnected() -> Result<()> => refused;
            /// `client`, registered again, may have missed record updates before
            /// (silent for longer than a client TTL: the master before may have
            /// forgotten it, and removed or replaced objects it holds without telling
            /// it). While this master's recovery window is open, an object it takes
            /// back only from this client's copies answers `Recovering`, not its bytes:
            /// a node with a newer copy may still be on its way back. Said before the
            /// client re-mounts or announces its SSD (in cluster mode: to each master
            /// it registers with again, before it mounts extents there; the window
            /// is then the group's after a takeover).
            MissedUpdates => fn missed_updates(client: ClientId => ClientId) -> Result<()> => refused;
            /// Tombstones `client` kept for an earlier master (handed to it with
            /// `RecordUpdate::Tombstone`): (key, generation of the removal). The
            /// master refuses copies of these keys older than their removal from now
            /// on, and drops an object it took back in its recovery window only from
            /// such copies. Said right after registering again, before the client
            /// re-mounts or announces its SSD (in cluster mode: to a group's leader
            /// before the extent is mounted there, for that group's keys; items of
            /// groups the master does not lead are ignored).
            RestoreTombstones => fn restore_tombstones(
                client: ClientId => ClientId,
                items: &[(&str, u64)] => Vec<(String, u64)>
            ) -> Result<()> => refused;
        }
    };
}
pub(crate) use master_calls;

/// Declares the trait and its in-process implementation from the table.
macro_rules! define_master_api {
    ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty
        => $route:ident $( ( $($how:tt)* ) )? $( + $hook:ident )?; )*) => {
        /// The calls a client makes to a master. [`MasterService`] implements it in
        /// process; `rpc::RpcMasterClient` implements it over TCP. Every per-key call has a
        /// batch form (one round trip over the network).
        pub trait MasterApi: Send + Sync {
            $( $(#[$doc])* fn $name(&self $(, $arg: $ty)*) -> $ret; )*

            /// A mark of the master as this client reaches it now, for
            /// [`unchanged_since`](Self::unchanged_since).
            fn continuity_mark(&self) -> u64 {
                0
            }

            /// Whether the master has certainly run without a restart since `mark`
            /// ([`continuity_mark`](Self::continuity_mark)) was taken: what a client
            /// checks before it writes into room the master gave it earlier
            /// ([`place_ahead`](Self::place_ahead)), which a restarted master may have
            /// given to another object. The default makes no such promise (`false`).
            fn unchanged_since(&self, _mark: u64) -> bool {
                false
            }

            /// Waits up to `timeout` for the master to go away: `true` as soon as a
            /// master daemon closed a connection this client keeps idle to watch it
            /// (it stopped, or was killed), so that a storage node heartbeats and
            /// re-mounts at once rather than a period later. A master that cannot
            /// go away apart from this process waits out `timeout` (`false`).
            fn await_hangup(&self, timeout: std::time::Duration) -> bool {
                std::thread::sleep(timeout);
                false
            }

            /// When a connection to the master was last refused (nothing listened at
            /// its address: the master process was not running then, so it could
            /// not expire this client meanwhile). `None` for a master that cannot go
            /// away apart from this process.
            fn last_refused(&self) -> Option<std::time::Instant> {
                None
            }

            /// Every key of a complete object, sorted: the pages of
            /// [`list_keys_after`](Self::list_keys_after), however many a master's
            /// answers take. A listing, not a snapshot: a key put or removed while it
            /// runs may be in it or not. A master whose page does not move past the
            /// previous one in order is an error (`MasterUnavailable`), never a loop.
            fn all_keys(&self) -> Result<Vec<String>> {
                let mut keys: Vec<String> = Vec::new();
                loop {
                    let page = self.list_keys_after(keys.last().map_or("", String::as_str), usize::MAX)?;
                    let Some(first) = page.first() else { return Ok(keys) };
                    if keys.last().is_some_and(|last| first <= last) || !page.is_sorted_by(|a, b| a < b) {
                        return Err(crate::error::Error::MasterUnavailable(
                            "the master's pages of keys are out of order".into(),
                        ));
                    }
                    keys.extend(page);
                }
            }
        }

        impl MasterApi for MasterService {
            /// A master in this process runs as long as its handle.
            fn unchanged_since(&self, _mark: u64) -> bool {
                true
            }

            $(
                #[inline]
                fn $name(&self $(, $arg: $ty)*) -> $ret {
                    MasterService::$name(self $(, $arg)*)
                }
            )*
        }
    };
}

master_calls!(define_master_api);
