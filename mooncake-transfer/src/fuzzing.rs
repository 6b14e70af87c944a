//! Decoders of peers' bytes that are private to this crate, exposed to the fuzz
//! targets in `fuzz/` (the `fuzzing` feature). Not a stable API.

use crate::error::Result;
use crate::frame::{FrameOp, FrameStatus};
use crate::handshake::{self, ControlChannel, ShmInfo};

/// A peer's answer about one of its shared regions, as decoded: `len`, `pid`, `fd`,
/// memfd inode and host id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShmInfoFields {
    /// Bytes of the region.
    pub len: u64,
    /// The peer's process id.
    pub pid: u32,
    /// The memfd's descriptor number in the peer.
    pub fd: i32,
    /// The memfd's inode.
    pub ino: u64,
    /// The peer's host identity.
    pub host_id: String,
}

impl From<ShmInfo> for ShmInfoFields {
    fn from(i: ShmInfo) -> Self {
        Self { len: i.len, pid: i.pid, fd: i.fd, ino: i.ino, host_id: i.host_id }
    }
}

/// Decodes a shared-memory handshake answer (`None`: too short).
pub fn decode_shm_info(payload: &[u8]) -> Option<ShmInfoFields> {
    ShmInfo::decode(payload).map(ShmInfoFields::from)
}

/// Encodes this process's answer about a region (the pid is this process's).
pub fn encode_shm_info(len: u64, fd: i32, ino: u64, host_id: &str) -> Vec<u8> {
    ShmInfo::encode(len, fd, ino, host_id)
}

/// A peer that answers every control request with `status` and `payload`.
struct Answers<'a>(FrameStatus, &'a [u8]);

impl ControlChannel for Answers<'_> {
    fn control_with(&self, _: &str, _: FrameOp, _: u64, _: &[u8]) -> Result<(FrameStatus, Vec<u8>)> {
        Ok((self.0, self.1.to_vec()))
    }
}

/// What the shared-memory transport makes of a peer that answers its `Hello` and its
/// `ShmInfo` about `region` with `status` and `payload`: the host id, and the
/// region's mapping information.
pub fn shm_answers(status: FrameStatus, payload: &[u8], region: u64) -> (Result<String>, Result<ShmInfoFields>) {
    let peer = Answers(status, payload);
    let hello = handshake::hello(&peer, "peer:1");
    let info = handshake::shm_info(&peer, "peer:1", region).map(ShmInfoFields::from);
    (hello, info)
}
