//! The transfer protocol on the wire: request and response headers, their codes
//! and limits (the layout is drawn in the crate documentation).

/// First bytes of every header.
pub const FRAME_MAGIC: [u8; 4] = *b"MCTX";
/// Protocol version of this build (2: authentication verdict, memfd inode in the
/// shared-memory handshake).
pub const FRAME_VERSION: u8 = 2;
/// First bytes a listener that requires a shared secret sends on a new connection.
pub const AUTH_MAGIC: [u8; 4] = *b"MCAU";
/// First bytes of a listener's refusal (protected mode, too many connections, a
/// secret this listener does not have), sent just before it closes the connection.
pub const REFUSE_MAGIC: [u8; 4] = *b"MCNO";
/// Bytes in a request header.
pub const REQUEST_HEADER_LEN: usize = 40;
/// Bytes in a response header.
pub const RESPONSE_HEADER_LEN: usize = 24;
/// Largest read or write one request may move (larger transfers are striped).
pub const MAX_REQUEST_BYTES: u64 = 1 << 30;
/// Largest handshake payload.
pub const MAX_HANDSHAKE_BYTES: u64 = 4096;

/// What a request asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameOp {
    /// Send `len` bytes of `region` at `offset`.
    Read = 1,
    /// Store the `len` bytes that follow into `region` at `offset`.
    Write = 2,
    /// How to map `region` directly (same host only): shared-memory handshake.
    ShmInfo = 3,
    /// Who are you (host identity), for choosing shared memory.
    Hello = 4,
    /// Connect RDMA queue pairs: the `len` bytes that follow are the requester's
    /// queue pair addresses; the answer is the server's (RDMA handshake).
    RdmaConnect = 5,
    /// How to reach `region` with one-sided RDMA: its memory regions and keys.
    RdmaRegion = 6,
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    /// Operation.
    pub op: FrameOp,
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
pub enum FrameStatus {
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
    pub status: FrameStatus,
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

/// Decodes and checks a request header (the first [`REQUEST_HEADER_LEN`] bytes of `b`):
/// magic, version, op, reserved bits and the length limit of the op. Never panics.
///
/// ```
/// use mooncake_transfer::{decode_frame_header, FrameError, FrameOp, RequestHeader};
///
/// let h = RequestHeader { op: FrameOp::Read, request_id: 7, region: 1, offset: 4096, len: 16 };
/// assert_eq!(decode_frame_header(&h.encode()), Ok(h));
/// assert_eq!(decode_frame_header(&[0u8; 3]), Err(FrameError::Truncated(3)));
/// ```
pub fn decode_frame_header(b: &[u8]) -> Result<RequestHeader, FrameError> {
    RequestHeader::decode(b)
}

impl RequestHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; REQUEST_HEADER_LEN] {
        let mut h = [0u8; REQUEST_HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC);
        h[4] = FRAME_VERSION;
        h[5] = self.op as u8;
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..24].copy_from_slice(&self.region.to_le_bytes());
        h[24..32].copy_from_slice(&self.offset.to_le_bytes());
        h[32..40].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Decodes and checks a header (magic, version, op, length limits).
    pub fn decode(b: &[u8]) -> Result<Self, FrameError> {
        if b.len() < REQUEST_HEADER_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != FRAME_MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        if b[4] != FRAME_VERSION {
            return Err(FrameError::Version(b[4]));
        }
        if b[6] != 0 || b[7] != 0 {
            return Err(FrameError::Code(b[6] | b[7]));
        }
        let op = match b[5] {
            1 => FrameOp::Read,
            2 => FrameOp::Write,
            3 => FrameOp::ShmInfo,
            4 => FrameOp::Hello,
            5 => FrameOp::RdmaConnect,
            6 => FrameOp::RdmaRegion,
            c => return Err(FrameError::Code(c)),
        };
        let h = Self { op, request_id: u64_at(b, 8), region: u64_at(b, 16), offset: u64_at(b, 24), len: u64_at(b, 32) };
        let limit = match op {
            FrameOp::Read | FrameOp::Write => MAX_REQUEST_BYTES,
            FrameOp::RdmaConnect => MAX_HANDSHAKE_BYTES,
            FrameOp::ShmInfo | FrameOp::Hello | FrameOp::RdmaRegion => 0,
        };
        if h.len > limit {
            return Err(FrameError::TooLong(h.len));
        }
        Ok(h)
    }
}

impl ResponseHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; RESPONSE_HEADER_LEN] {
        let mut h = [0u8; RESPONSE_HEADER_LEN];
        h[0..4].copy_from_slice(&FRAME_MAGIC);
        h[4] = self.status as u8;
        h[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        h[16..24].copy_from_slice(&self.len.to_le_bytes());
        h
    }

    /// Decodes a header; `len` must not exceed `max_len`.
    pub fn decode(b: &[u8], max_len: u64) -> Result<Self, FrameError> {
        if b.len() < RESPONSE_HEADER_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != FRAME_MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let status = match b[4] {
            0 => FrameStatus::Ok,
            1 => FrameStatus::OutOfBounds,
            2 => FrameStatus::UnknownRegion,
            3 => FrameStatus::Refused,
            c => return Err(FrameError::Code(c)),
        };
        let len = u64_at(b, 16);
        if len > max_len {
            return Err(FrameError::TooLong(len));
        }
        Ok(Self { status, request_id: u64_at(b, 8), len })
    }
}
