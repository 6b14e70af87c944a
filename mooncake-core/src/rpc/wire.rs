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
//! every malformed input is a [`FrameError`]; bodies are decoded within a budget of
//! what they allocate ([`super::budget`]), not only of their bytes.

use mooncake_alloc::SegmentId;
use serde::{Deserialize, Serialize};

use super::budget::{decode, DecodeError, DecodeLimits, PoolAccess, Reservation, ANSWER_RESERVE};
use crate::config::ReplicateConfig;
use crate::error::Error;
use crate::error::Result;
use crate::master::{
    master_calls, ClientId, ClientRegistration, DrainProgress, HeldPlacement, MasterStats, MemoryReplica, ObjectInfo,
    ObjectRecord, OffloadPlan, RecordUpdate, ReplicaList, ReplicatePlan, SegmentInfo,
};
use mooncake_transfer::RemoteRegion;

/// First bytes of every frame.
pub const MAGIC: [u8; 4] = *b"MCRP";
/// Protocol version spoken by this build (7: `MountRecords` carries the record key;
/// 8: records carry generations, `RecordUpdate::Discard`; 9: drains, `DrainSegment`,
/// `DrainReport`, `DrainStatus` and `RecordUpdate::Drain`; 10: `BatchDropSpareReplicas`;
/// 11: `NotifyOffloadSuccess` carries each task's generation; 12: `PutStartSummed`,
/// `BatchPutStartSummed`; 13: `PutDeclare`, `BatchPutDeclare`; 14: `LocalEndpoint`;
/// 15: `PlaceAhead`, `PutBind`, `BatchPutBind`; 16: `ListKeysAfter`; 17: `Reconnected`;
/// 18: `MissedUpdates`; 19: `RestoreTombstones`, `RecordUpdate::Tombstone`,
/// `MasterStats::carried_tombstones`).
pub const VERSION: u8 = 19;
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
    /// The body would decode to more than its budget allows (see [`budget`](super::budget)).
    #[error("{0}")]
    Budget(DecodeError),
}

impl From<DecodeError> for FrameError {
    fn from(e: DecodeError) -> Self {
        match e {
            DecodeError::Malformed(m) => FrameError::Body(m),
            other => FrameError::Budget(other),
        }
    }
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
    // Measured first, so that the frame is allocated once rather than grown a doubling
    // at a time (a batch's frame would be copied a dozen times).
    let size = postcard::serialize_with_flavor(msg, postcard::ser_flavors::Size::default())
        .map_err(|e| FrameError::Body(e.to_string()))?;
    let mut out = Vec::with_capacity(HEADER_LEN + size);
    out.resize(HEADER_LEN, 0);
    let mut out = postcard::to_extend(msg, out).map_err(|e| FrameError::Body(e.to_string()))?;
    let body_len = u32::try_from(out.len() - HEADER_LEN)
        .map_err(|_| FrameError::TooLarge { len: u32::MAX, max: DEFAULT_MAX_FRAME })?;
    out[..HEADER_LEN].copy_from_slice(&FrameHeader { kind, request_id, body_len }.encode());
    Ok(out)
}

/// Decodes a message body as a client does, within [`DecodeLimits::RESPONSE`]: what
/// it allocates is bounded, whatever the body holds. A server decodes requests with
/// [`decode_request`] instead, within its own bounds and pool.
pub fn decode_body<'de, T: Deserialize<'de>>(body: &'de [u8]) -> Result<T, FrameError> {
    Ok(decode(body, DecodeLimits::RESPONSE, None)?.0)
}

/// The kind of request (its index in [`REQUEST_KINDS`]) an encoded request body holds,
/// read from its first bytes without decoding the rest: a server decides with it
/// where the request is answered before paying for its decoding. `None` if those
/// bytes name no kind; the body may still be malformed past them.
pub fn request_kind_of(body: &[u8]) -> Option<usize> {
    // postcard writes the variant index as a LEB128 varint of a u32 (at most 5 bytes)
    // before the variant's fields.
    let mut index: u64 = 0;
    for (i, b) in body.iter().take(5).enumerate() {
        index |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return usize::try_from(index).ok().filter(|&k| k < REQUEST_KINDS.len());
        }
    }
    None
}

/// Decodes a request body as a server does: within `limits`, taking its bytes from
/// `pool`, and, for a call answered per item, [`ANSWER_RESERVE`] bytes more for each
/// item, held until the request is answered. See [`super::budget`].
pub fn decode_request<'p>(
    body: &[u8],
    limits: DecodeLimits,
    pool: Option<PoolAccess<'p>>,
) -> Result<(Request, Reservation<'p>), DecodeError> {
    let (request, mut held) = decode::<Request>(body, limits, pool)?;
    if request.answers_per_item() {
        held.reserve(held.items().saturating_mul(ANSWER_RESERVE), limits, pool.and_then(|p| p.wait))?;
    }
    Ok((request, held))
}

/// Decodes a whole request frame held in `bytes` (what the fuzz target feeds).
#[cfg(feature = "fuzzing")]
pub fn decode_request_frame(bytes: &[u8], max_body: u32) -> Result<(FrameHeader, Request), FrameError> {
    let header = FrameHeader::decode(bytes, max_body)?;
    if header.kind != FrameKind::Request {
        return Err(FrameError::Kind(header.kind as u8));
    }
    let body = bytes
        .get(HEADER_LEN..HEADER_LEN + header.body_len as usize)
        .ok_or_else(|| FrameError::Truncated(format!("body of {} bytes announced", header.body_len)))?;
    Ok((header, decode_request(body, DecodeLimits::REQUEST, None)?.0))
}

/// Declares the wire messages from the table of master calls.
macro_rules! define_wire_messages {
    ($( $(#[$doc:meta])* $variant:ident => fn $name:ident ( $( $arg:ident : $ty:ty => $wire:ty ),* $(,)? ) -> $ret:ty
        => $route:ident $( ( $($how:tt)* ) )? $( + $hook:ident )?; )*) => {
        /// A request: one variant per [`MasterApi`](crate::master::MasterApi) call (fields
        /// as the call's arguments), then the calls a storage node answers.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        pub enum Request {
            $(
                $(#[$doc])*
                $variant { $(
                    #[allow(missing_docs)]
                    $arg: $wire
                ),* },
            )*
            /// To a storage node (not the master): stage these SSD objects for a pull.
            BatchGetOffloadObject {
                /// Keys to stage.
                keys: Vec<String>,
            },
            /// To a storage node: the pull of a staged batch is done.
            ReleaseOffloadBuffer {
                /// The batch.
                batch_id: u64,
            },
            /// From the master to a storage node: apply these changes to the records of
            /// its segment, and answer only once they are applied (durable records).
            ApplyRecords {
                /// The changes, in the order the master made them.
                updates: Vec<RecordUpdate>,
            },
            /// To any server, answered by its connection loop (not its handler): the
            /// name of its Unix socket for clients of its host, told only to a client
            /// that asks over TCP from the same host (see `rpc::socket`).
            LocalEndpoint {},
        }

        /// An answer: one variant per master call (its result), then the answers that
        /// are not a call's result.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        pub enum Response {
            $(
                $(#[$doc])*
                $variant(<$ret as WireReturn>::Wire),
            )*
            /// The request failed as a whole (malformed, or not served here).
            Error(WireError),
            /// Done, nothing to return (storage-node calls).
            Unit,
            /// A storage node's staged batch.
            OffloadBatch(OffloadBatch),
            /// The server's Unix socket name, to [`Request::LocalEndpoint`] (`None`:
            /// none, or not told to this peer).
            LocalEndpoint(Option<String>),
        }

        /// The kinds of request, in wire order (for metrics).
        #[allow(clippy::enum_variant_names)]
        #[derive(Clone, Copy)]
        enum RequestKind {
            $( $variant, )*
            BatchGetOffloadObject,
            ReleaseOffloadBuffer,
            ApplyRecords,
            LocalEndpoint,
        }

        /// Names of the request kinds, indexed by `Request::kind_index` (for metrics).
        pub const REQUEST_KINDS: &[&str] =
            &[$( stringify!($name), )* "batch_get_offload_object", "release_offload_buffer", "apply_records", "local_endpoint"];

        impl Request {
            /// Index of [`Request::ApplyRecords`] in [`REQUEST_KINDS`].
            pub const APPLY_RECORDS_KIND: usize = RequestKind::ApplyRecords as usize;
            /// Index of [`Request::LocalEndpoint`] in [`REQUEST_KINDS`].
            pub const LOCAL_ENDPOINT_KIND: usize = RequestKind::LocalEndpoint as usize;

            /// Index of this request's kind in [`REQUEST_KINDS`].
            pub fn kind_index(&self) -> usize {
                let kind = match self {
                    $( Request::$variant { .. } => RequestKind::$variant, )*
                    Request::BatchGetOffloadObject { .. } => RequestKind::BatchGetOffloadObject,
                    Request::ReleaseOffloadBuffer { .. } => RequestKind::ReleaseOffloadBuffer,
                    Request::ApplyRecords { .. } => RequestKind::ApplyRecords,
                    Request::LocalEndpoint { .. } => RequestKind::LocalEndpoint,
                };
                kind as usize
            }

            /// Whether the answer holds one result per item of the request (a batch
            /// call): what answering it costs grows with its items.
            pub fn answers_per_item(&self) -> bool {
                match self {
                    $( Request::$variant { .. } => <$ret as WireReturn>::BATCH, )*
                    Request::BatchGetOffloadObject { .. } => true,
                    Request::ReleaseOffloadBuffer { .. } | Request::ApplyRecords { .. } | Request::LocalEndpoint { .. } => false,
                }
            }

            /// Whether the answer to this request carries an error (for metrics).
            pub fn is_error(response: &Response) -> bool {
                match response {
                    $( Response::$variant(r) => <$ret as WireReturn>::is_error(r), )*
                    Response::Error(_) => true,
                    Response::Unit | Response::OffloadBatch(_) | Response::LocalEndpoint(_) => false,
                }
            }
        }
    };
}

master_calls!(define_wire_messages);

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
    NoSpace {
        /// Bytes needed.
        needed: u64,
        /// Largest free block.
        largest_free: u64,
        /// Why.
        reason: String,
    },
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
    /// [`Error::Recovering`].
    Recovering(String),
    /// [`Error::Moved`].
    Moved {
        /// The key's slot.
        slot: u16,
        /// The slot's leader, if known.
        leader: Option<String>,
    },
}

impl From<Error> for WireError {
    fn from(e: Error) -> Self {
        match e {
            Error::NotFound(m) => WireError::NotFound(m),
            Error::AlreadyExists(m) => WireError::AlreadyExists(m),
            Error::HasLease(m) => WireError::HasLease(m),
            Error::NoSpace { needed, largest_free, reason } => WireError::NoSpace { needed, largest_free, reason },
            Error::Recovering(m) => WireError::Recovering(m),
            Error::Moved { slot, leader } => WireError::Moved { slot, leader },
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
            WireError::NoSpace { needed, largest_free, reason } => Error::NoSpace { needed, largest_free, reason },
            WireError::Recovering(m) => Error::Recovering(m),
            WireError::Moved { slot, leader } => Error::Moved { slot, leader },
            WireError::BufferTooSmall { needed, capacity } => Error::BufferTooSmall { needed, capacity },
            WireError::InvalidArgument(m) => Error::InvalidArgument(m),
            WireError::UnknownClient(c) => Error::UnknownClient(c),
            WireError::Other(m) => Error::MasterUnavailable(format!("master error: {m}")),
            WireError::Storage(m) => Error::Storage(mooncake_storage::StorageError::Remote(m).into()),
        }
    }
}

/// A [`RemoteRegion`] as it travels (the transfer crate has no serde).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireRegion(#[serde(with = "crate::master::remote_region")] pub RemoteRegion);

/// Per-key result of a call, as it travels.
pub type WireResult<T> = Result<T, WireError>;

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

/// A call's result and its wire form.
pub trait WireReturn: Sized {
    /// What the response carries.
    type Wire;
    /// Whether the call is a batch call (one result per item).
    const BATCH: bool;
    /// The wire form of a result.
    fn into_wire(self) -> Self::Wire;
    /// The result a response stands for; `items` is the batch size, if the call is one.
    fn from_wire(wire: Self::Wire, items: Option<usize>) -> Self;
    /// The result of a call that got no usable response.
    fn failed(error: Error, items: Option<usize>) -> Self;
    /// Whether the wire form carries an error (for metrics).
    fn is_error(wire: &Self::Wire) -> bool;
}

impl<T> WireReturn for Result<T> {
    type Wire = WireResult<T>;
    const BATCH: bool = false;
    fn into_wire(self) -> WireResult<T> {
        self.map_err(WireError::from)
    }
    fn from_wire(wire: WireResult<T>, _: Option<usize>) -> Self {
        wire.map_err(Error::from)
    }
    fn failed(error: Error, _: Option<usize>) -> Self {
        Err(error)
    }
    fn is_error(wire: &WireResult<T>) -> bool {
        wire.is_err()
    }
}

impl<T> WireReturn for Vec<Result<T>> {
    type Wire = Vec<WireResult<T>>;
    const BATCH: bool = true;
    fn into_wire(self) -> Vec<WireResult<T>> {
        self.into_iter().map(|r| r.map_err(WireError::from)).collect()
    }
    fn from_wire(wire: Vec<WireResult<T>>, items: Option<usize>) -> Self {
        match items {
            Some(n) if n != wire.len() => {
                Self::failed(Error::MasterUnavailable(format!("batch answer of {} items for {n}", wire.len())), items)
            }
            _ => wire.into_iter().map(|r| r.map_err(Error::from)).collect(),
        }
    }
    fn failed(error: Error, items: Option<usize>) -> Self {
        (0..items.unwrap_or(0)).map(|_| Err(error.clone())).collect()
    }
    fn is_error(wire: &Vec<WireResult<T>>) -> bool {
        wire.iter().any(|r| r.is_err())
    }
}
