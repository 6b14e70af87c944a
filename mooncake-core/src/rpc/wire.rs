//! The master protocol on the wire: frames and messages.
//!
//! A frame is a 20-byte header followed by a body:
//!
//! ```text
//! 0      4        5       6       8            16         20
//! | MCRP | version | kind | flags | request id | body len | body ...
//! ```
//!
//! Integers are little-endian. `kind` is 1 for a request, 2 for a response; the
//! response carries the request's id, so a client may pipeline requests. Bodies are
//! [`Request`]/[`Response`] encoded with `postcard` (serde). Decoders never panic;
//! every malformed input is a [`FrameError`].

use mooncake_alloc::SegmentId;
use serde::{Deserialize, Serialize};

use crate::config::ReplicateConfig;
use crate::error::Error;
use crate::master::{
    ClientId, ClientRegistration, MasterStats, MemoryReplica, ObjectInfo, ObjectRecord, OffloadPlan, RecordUpdate,
    ReplicaList, ReplicatePlan, SegmentInfo,
};

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MCRP";
/// Protocol version spoken by this build.
pub const VERSION: u8 = 1;
/// Bytes in a frame header.
pub const HEADER_LEN: usize = 20;
/// Default largest body accepted (64 MiB).
pub const DEFAULT_MAX_FRAME: u32 = 64 << 20;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameKind {
    /// A client's request.
    Request = 1,
    /// The master's response.
    Response = 2,
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Request or response.
    pub kind: FrameKind,
    /// Id chosen by the client, echoed by the response.
    pub request_id: u64,
    /// Bytes of body that follow.
    pub body_len: u32,
}

/// Why bytes are not a valid frame.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than a header or than the header announces.
    #[error("truncated frame: {0}")]
    Truncated(String),
    /// The frame does not start with the protocol magic.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("unsupported protocol version {0}")]
    Version(u8),
    /// An unknown frame kind.
    #[error("unknown frame kind {0}")]
    Kind(u8),
    /// The body is larger than the limit.
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Announced length.
        len: u32,
        /// Limit in force.
        max: u32,
    },
    /// The body does not decode as a message.
    #[error("malformed body: {0}")]
    Body(String),
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = VERSION;
        h[5] = self.kind as u8;
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..20].copy_from_slice(&self.body_len.to_le_bytes());
        h
    }

    /// Decodes and checks a header: magic, version, kind, and `body_len <= max_body`.
    pub fn decode(bytes: &[u8], max_body: u32) -> Result<Self, FrameError> {
        let h: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|h| h.try_into().ok())
            .ok_or_else(|| FrameError::Truncated(format!("{} of {HEADER_LEN} header bytes", bytes.len())))?;
        let magic = [h[0], h[1], h[2], h[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if h[4] != VERSION {
            return Err(FrameError::Version(h[4]));
        }
        let kind = match h[5] {
            1 => FrameKind::Request,
            2 => FrameKind::Response,
            k => return Err(FrameError::Kind(k)),
        };
        let mut id = [0u8; 8];
        id.copy_from_slice(&h[8..16]);
        let mut len = [0u8; 4];
        len.copy_from_slice(&h[16..20]);
        let body_len = u32::from_le_bytes(len);
        if body_len > max_body {
            return Err(FrameError::TooLarge { len: body_len, max: max_body });
        }
        Ok(Self { kind, request_id: u64::from_le_bytes(id), body_len })
    }
}

/// Encodes a message into a whole frame (header + body).
pub fn encode_frame<T: Serialize>(kind: FrameKind, request_id: u64, msg: &T) -> Result<Vec<u8>, FrameError> {
    let mut out = vec![0u8; HEADER_LEN];
    let mut out = postcard::to_extend(msg, std::mem::take(&mut out)).map_err(|e| FrameError::Body(e.to_string()))?;
    let body_len = u32::try_from(out.len() - HEADER_LEN)
        .map_err(|_| FrameError::TooLarge { len: u32::MAX, max: DEFAULT_MAX_FRAME })?;
    out[..HEADER_LEN].copy_from_slice(&FrameHeader { kind, request_id, body_len }.encode());
    Ok(out)
}

/// Decodes a message body.
pub fn decode_body<'de, T: Deserialize<'de>>(body: &'de [u8]) -> Result<T, FrameError> {
    postcard::from_bytes(body).map_err(|e| FrameError::Body(e.to_string()))
}

/// Decodes a whole request frame held in `bytes` (what the fuzz target feeds).
pub fn decode_request_frame(bytes: &[u8], max_body: u32) -> Result<(FrameHeader, Request), FrameError> {
    let header = FrameHeader::decode(bytes, max_body)?;
    if header.kind != FrameKind::Request {
        return Err(FrameError::Kind(header.kind as u8));
    }
    let body = bytes
        .get(HEADER_LEN..HEADER_LEN + header.body_len as usize)
        .ok_or_else(|| FrameError::Truncated(format!("body of {} bytes announced", header.body_len)))?;
    Ok((header, decode_body(body)?))
}

/// A segment's location, as it travels.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSegment {
    /// Segment id.
    pub id: SegmentId,
    /// Name.
    pub name: String,
    /// Owner.
    pub owner: ClientId,
    /// Endpoint serving it.
    pub endpoint: String,
    /// Region id at the endpoint.
    pub region: u64,
    /// Bytes.
    pub capacity: u64,
}

impl From<SegmentInfo> for WireSegment {
    fn from(s: SegmentInfo) -> Self {
        Self {
            id: s.id,
            name: s.name,
            owner: s.owner,
            endpoint: s.region.endpoint,
            region: s.region.region,
            capacity: s.capacity,
        }
    }
}

impl From<WireSegment> for SegmentInfo {
    fn from(s: WireSegment) -> Self {
        Self {
            id: s.id,
            name: s.name,
            owner: s.owner,
            region: mooncake_transfer::RemoteRegion { endpoint: s.endpoint, region: s.region },
            capacity: s.capacity,
        }
    }
}

/// A request to the master. One variant per [`MasterApi`](crate::master::MasterApi) call.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Request {
    RegisterClient,
    Heartbeat {
        client: ClientId,
    },
    MountSegment {
        client: ClientId,
        endpoint: String,
        region: u64,
        capacity: u64,
    },
    RemountSegment {
        client: ClientId,
        endpoint: String,
        region: u64,
        capacity: u64,
        records: Vec<ObjectRecord>,
    },
    UnmountSegment {
        client: ClientId,
        segment: SegmentId,
    },
    UnregisterClient {
        client: ClientId,
    },
    SegmentInfo {
        segment: SegmentId,
    },
    PutStart {
        client: ClientId,
        key: String,
        len: u64,
        cfg: ReplicateConfig,
    },
    PutEnd {
        client: ClientId,
        key: String,
        checksum: u32,
    },
    PutRevoke {
        client: ClientId,
        key: String,
    },
    GetReplicaList {
        key: String,
    },
    Exists {
        key: String,
    },
    Remove {
        key: String,
    },
    RemoveAll,
    ReplicateStart {
        client: ClientId,
        key: String,
        cfg: ReplicateConfig,
    },
    ReplicateEnd {
        key: String,
        targets: Vec<MemoryReplica>,
        ok: bool,
    },
    BatchPutStart {
        client: ClientId,
        items: Vec<(String, u64)>,
        cfg: ReplicateConfig,
    },
    BatchPutEnd {
        client: ClientId,
        items: Vec<(String, u32)>,
    },
    BatchPutRevoke {
        client: ClientId,
        keys: Vec<String>,
    },
    BatchGetReplicaList {
        keys: Vec<String>,
    },
    BatchExists {
        keys: Vec<String>,
    },
    BatchRemove {
        keys: Vec<String>,
    },
    ListKeys {
        limit: u64,
    },
    Stats,
    ObjectInfo {
        key: String,
    },
    ReportSsdCapacity {
        client: ClientId,
        capacity: i64,
    },
    NotifyOffloadSuccess {
        client: ClientId,
        items: Vec<(String, u64, u32)>,
    },
    BatchEvictDiskReplica {
        client: ClientId,
        keys: Vec<String>,
    },
    MountSsd {
        client: ClientId,
        capacity: i64,
        endpoint: String,
    },
    DiskEndpoint {
        client: ClientId,
    },
    OffloadHeartbeat {
        client: ClientId,
        max: u32,
    },
    RegisterDiskObjects {
        client: ClientId,
        items: Vec<(String, u64, u32)>,
    },
    /// To a storage node (not the master): stage these SSD objects for a pull.
    BatchGetOffloadObject {
        keys: Vec<String>,
    },
    /// To a storage node: the pull of a staged batch is done.
    ReleaseOffloadBuffer {
        batch_id: u64,
    },
}

/// Names of the request kinds, indexed by [`Request::kind_index`] (for metrics).
pub const REQUEST_KINDS: [&str; 34] = [
    "register_client",
    "heartbeat",
    "mount_segment",
    "remount_segment",
    "unmount_segment",
    "unregister_client",
    "segment_info",
    "put_start",
    "put_end",
    "put_revoke",
    "get_replica_list",
    "exists",
    "remove",
    "remove_all",
    "replicate_start",
    "replicate_end",
    "batch_put_start",
    "batch_put_end",
    "batch_put_revoke",
    "batch_get_replica_list",
    "batch_exists",
    "batch_remove",
    "list_keys",
    "stats",
    "object_info",
    "report_ssd_capacity",
    "notify_offload_success",
    "batch_evict_disk_replica",
    "mount_ssd",
    "disk_endpoint",
    "offload_heartbeat",
    "register_disk_objects",
    "batch_get_offload_object",
    "release_offload_buffer",
];

impl Request {
    /// Index of this request's kind in [`REQUEST_KINDS`].
    pub fn kind_index(&self) -> usize {
        match self {
            Request::RegisterClient => 0,
            Request::Heartbeat { .. } => 1,
            Request::MountSegment { .. } => 2,
            Request::RemountSegment { .. } => 3,
            Request::UnmountSegment { .. } => 4,
            Request::UnregisterClient { .. } => 5,
            Request::SegmentInfo { .. } => 6,
            Request::PutStart { .. } => 7,
            Request::PutEnd { .. } => 8,
            Request::PutRevoke { .. } => 9,
            Request::GetReplicaList { .. } => 10,
            Request::Exists { .. } => 11,
            Request::Remove { .. } => 12,
            Request::RemoveAll => 13,
            Request::ReplicateStart { .. } => 14,
            Request::ReplicateEnd { .. } => 15,
            Request::BatchPutStart { .. } => 16,
            Request::BatchPutEnd { .. } => 17,
            Request::BatchPutRevoke { .. } => 18,
            Request::BatchGetReplicaList { .. } => 19,
            Request::BatchExists { .. } => 20,
            Request::BatchRemove { .. } => 21,
            Request::ListKeys { .. } => 22,
            Request::Stats => 23,
            Request::ObjectInfo { .. } => 24,
            Request::ReportSsdCapacity { .. } => 25,
            Request::NotifyOffloadSuccess { .. } => 26,
            Request::BatchEvictDiskReplica { .. } => 27,
            Request::MountSsd { .. } => 28,
            Request::DiskEndpoint { .. } => 29,
            Request::OffloadHeartbeat { .. } => 30,
            Request::RegisterDiskObjects { .. } => 31,
            Request::BatchGetOffloadObject { .. } => 32,
            Request::ReleaseOffloadBuffer { .. } => 33,
        }
    }
}

/// An error as it travels: the variant and its message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireError {
    /// [`Error::NotFound`].
    NotFound(String),
    /// [`Error::AlreadyExists`].
    AlreadyExists(String),
    /// [`Error::HasLease`].
    HasLease(String),
    /// [`Error::NoSpace`].
    NoSpace(String),
    /// [`Error::BufferTooSmall`].
    BufferTooSmall {
        /// Object size.
        needed: u64,
        /// Buffer size.
        capacity: u64,
    },
    /// [`Error::InvalidArgument`].
    InvalidArgument(String),
    /// [`Error::UnknownClient`].
    UnknownClient(u64),
    /// Any other error, by message.
    Other(String),
    /// [`Error::Storage`].
    Storage(String),
}

impl From<Error> for WireError {
    fn from(e: Error) -> Self {
        match e {
            Error::NotFound(m) => WireError::NotFound(m),
            Error::AlreadyExists(m) => WireError::AlreadyExists(m),
            Error::HasLease(m) => WireError::HasLease(m),
            Error::NoSpace(m) => WireError::NoSpace(m),
            Error::BufferTooSmall { needed, capacity } => WireError::BufferTooSmall { needed, capacity },
            Error::InvalidArgument(m) => WireError::InvalidArgument(m),
            Error::UnknownClient(c) => WireError::UnknownClient(c),
            Error::Storage(e) => WireError::Storage(e.to_string()),
            other => WireError::Other(other.to_string()),
        }
    }
}

impl From<WireError> for Error {
    fn from(e: WireError) -> Self {
        match e {
            WireError::NotFound(m) => Error::NotFound(m),
            WireError::AlreadyExists(m) => Error::AlreadyExists(m),
            WireError::HasLease(m) => Error::HasLease(m),
            WireError::NoSpace(m) => Error::NoSpace(m),
            WireError::BufferTooSmall { needed, capacity } => Error::BufferTooSmall { needed, capacity },
            WireError::InvalidArgument(m) => Error::InvalidArgument(m),
            WireError::UnknownClient(c) => Error::UnknownClient(c),
            WireError::Other(m) => Error::MasterUnavailable(format!("master error: {m}")),
            WireError::Storage(m) => Error::Storage(mooncake_storage::StorageError::Remote(m).into()),
        }
    }
}

/// Per-key result of a batch call.
pub type WireResult<T> = Result<T, WireError>;

/// The master's answer.
#[allow(missing_docs)]
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Response {
    Error(WireError),
    Unit,
    Registered(ClientRegistration),
    Updates(Vec<RecordUpdate>),
    Segment(SegmentId),
    Remounted { segment: SegmentId, taken: u64 },
    Count(u64),
    SegmentInfo(WireSegment),
    Replicas(Vec<MemoryReplica>),
    ReplicaList(ReplicaList),
    Bool(bool),
    Plan(ReplicatePlan),
    BatchReplicas(Vec<WireResult<Vec<MemoryReplica>>>),
    BatchUnit(Vec<WireResult<()>>),
    BatchReplicaLists(Vec<WireResult<ReplicaList>>),
    BatchBool(Vec<WireResult<bool>>),
    Keys(Vec<String>),
    Stats(MasterStats),
    ObjectInfo(ObjectInfo),
    Endpoint(String),
    OffloadPlan(OffloadPlan),
    OffloadBatch(OffloadBatch),
}

/// A storage node's answer to `BatchGetOffloadObject`: the objects sit in its staging
/// region (served by its transfer engine at `endpoint`, region `region`) until the
/// batch is released or `gc_ttl_ms` passed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OffloadBatch {
    /// Batch to release when done.
    pub batch_id: u64,
    /// Transfer endpoint serving the staging region.
    pub endpoint: String,
    /// Region id of the staging region at that endpoint.
    pub region: u64,
    /// The batch may be reclaimed this long after it was staged.
    pub gc_ttl_ms: u64,
    /// Per key, in order: `(offset, len)` in the staging region.
    pub objects: Vec<WireResult<(u64, u64)>>,
}
