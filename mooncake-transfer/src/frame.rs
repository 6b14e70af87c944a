//! The transfer protocol on the wire (TCP transport and the shared-memory handshake).
//!
//! Fixed-layout little-endian headers, no serialization library needed:
//!
//! ```text
//! request  (40 B): magic "MCTX" | version u8 | op u8 | flags u16 | request id u64
//!                  | region u64 | offset u64 | len u64        [+ len bytes for Write]
//! response (24 B): magic "MCTX" | status u8 | 0 u8 x3 | request id u64 | len u64
//!                  [+ len bytes: data of a Read, or the handshake payload]
//! ```
//! Decoders never panic; anything malformed is a [`FrameError`] and the server closes
//! that connection.
//!
//! A listener that requires a shared secret first sends [`AUTH_MAGIC`], then the
//! challenge of [`SharedSecret`](crate::SharedSecret), then one verdict byte (`1`
//! admitted, `0` refused, then closed) before it reads any request.

/// First bytes of every header.
pub const MAGIC: [u8; 4] = *b"MCTX";
/// Protocol version of this build (2: authentication verdict, memfd inode in the
/// shared-memory handshake).
pub const VERSION: u8 = 2;
/// First bytes a listener that requires a shared secret sends on a new connection.
pub const AUTH_MAGIC: [u8; 4] = *b"MCAU";
/// Bytes in a request header.
pub const REQUEST_LEN: usize = 40;
/// Bytes in a response header.
pub const RESPONSE_LEN: usize = 24;
/// Largest read or write one request may move (larger transfers are striped).
pub const MAX_REQUEST_BYTES: u64 = 1 << 30;
/// Largest handshake payload.
pub const MAX_INFO_BYTES: u64 = 4096;

/// What a request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Send `len` bytes of `region` at `offset`.
    Read = 1,
    /// Store the `len` bytes that follow into `region` at `offset`.
    Write = 2,
    /// How to map `region` directly (same host only): shared-memory handshake.
    ShmInfo = 3,
    /// Who are you (host identity), for choosing shared memory.
    Hello = 4,
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// Operation.
    pub op: Op,
    /// Echoed by the response.
    pub request_id: u64,
    /// Region addressed.
    pub region: u64,
    /// Offset in the region.
    pub offset: u64,
    /// Bytes moved.
    pub len: u64,
}

/// Outcome of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Done; `len` bytes follow for a Read or a handshake.
    Ok = 0,
    /// Outside the region's registered bytes; nothing was touched.
    OutOfBounds = 1,
    /// No such region.
    UnknownRegion = 2,
    /// Refused (e.g. shared memory not available for this region).
    Refused = 3,
}

/// A response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseHeader {
    /// Outcome.
    pub status: Status,
    /// The request's id.
    pub request_id: u64,
    /// Bytes that follow.
    pub len: u64,
}

/// Why bytes are not a valid header.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than a header.
    #[error("truncated header: {0} bytes")]
    Truncated(usize),
    /// Not the protocol magic.
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("unsupported version {0}")]
    Version(u8),
    /// Unknown operation or status code.
    #[error("unknown code {0}")]
    Code(u8),
    /// A length over the limit.
    #[error("length {0} over the limit")]
    TooLong(u64),
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Decodes and checks a request header (the first [`REQUEST_LEN`] bytes of `b`):
/// magic, version, op, reserved bits and the length limit of the op. Never panics.
///
/// ```
/// use mooncake_transfer::frame::{decode_frame_header, FrameError, Op, RequestHeader};
///
/// let h = RequestHeader { op: Op::Read, request_id: 7, region: 1, offset: 4096, len: 16 };
/// assert_eq!(decode_frame_header(&h.encode()), Ok(h));
/// assert_eq!(decode_frame_header(&[0u8; 3]), Err(FrameError::Truncated(3)));
/// ```
pub fn decode_frame_header(b: &[u8]) -> Result<RequestHeader, FrameError> {
    RequestHeader::decode(b)
}

impl RequestHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut h = [0u8; REQUEST_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = VERSION;
        h[5] = self.op as u8;
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..24].copy_from_slice(&self.region.to_le_bytes());
        h[24..32].copy_from_slice(&self.offset.to_le_bytes());
        h[32..40].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Decodes and checks a header (magic, version, op, length limits).
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < REQUEST_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != VERSION {
            return Err(FrameError::Version(b[4]));
        }
        if b[6] != 0 || b[7] != 0 {
            return Err(FrameError::Code(b[6] | b[7]));
        }
        let op = match b[5] {
            1 => Op::Read,
            2 => Op::Write,
            3 => Op::ShmInfo,
            4 => Op::Hello,
            c => return Err(FrameError::Code(c)),
        };
        let h = Self { op, request_id: u64_at(b, 8), region: u64_at(b, 16), offset: u64_at(b, 24), len: u64_at(b, 32) };
        let limit = match op {
            Op::Read | Op::Write => MAX_REQUEST_BYTES,
            Op::ShmInfo | Op::Hello => 0,
        };
        if h.len > limit {
            return Err(FrameError::TooLong(h.len));
        }
        Ok(h)
    }
}

impl ResponseHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; RESPONSE_LEN] {
        let mut h = [0u8; RESPONSE_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4] = self.status as u8;
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..24].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Decodes a header; `len` must not exceed `max_len`.
    pub fn decode(b: &[u8], max_len: u64) -> Result<Self, FrameError> {
        if b.len() < RESPONSE_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let status = match b[4] {
            0 => Status::Ok,
            1 => Status::OutOfBounds,
            2 => Status::UnknownRegion,
            3 => Status::Refused,
            c => return Err(FrameError::Code(c)),
        };
        let len = u64_at(b, 16);
        if len > max_len {
            return Err(FrameError::TooLong(len));
        }
        Ok(Self { status, request_id: u64_at(b, 8), len })
    }
}
