//! The handshakes that precede shared memory: who a peer is (`Hello`: its host
//! identity) and how to map one of its regions (`ShmInfo`). The TCP transport
//! carries them and answers them; the Shm transport asks them.

use std::sync::LazyLock;

use crate::error::{Result, TransferError};
use crate::frame::{FrameOp, FrameStatus};

/// This host's identity: hostname, boot id and network namespace. Processes in
/// different network namespaces count as different hosts (they may not share memory
/// by design, and tests use namespaces to stand for hosts).
pub fn host_id() -> &'static str {
    static ID: LazyLock<String> = LazyLock::new(|| {
        let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).unwrap_or_default();
        let netns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
        format!("{}/{}/{}", read("/proc/sys/kernel/hostname"), read("/proc/sys/kernel/random/boot_id"), netns)
    });
    &ID
}

/// What a peer said about one of its shared regions.
pub(crate) struct ShmInfo {
    pub(crate) len: u64,
    pub(crate) pid: u32,
    pub(crate) fd: i32,
    /// Inode of the memfd: the opened `/proc/<pid>/fd/<fd>` must be this file.
    pub(crate) ino: u64,
    pub(crate) host_id: String,
}

impl ShmInfo {
    /// The answer of this process about a region of `len` bytes whose memfd is `fd`
    /// (inode `ino`): `len u64 | pid u32 | fd i32 | inode u64 | host id`.
    pub(crate) fn encode(len: u64, fd: i32, ino: u64, host_id: &str) -> Vec<u8> {
        let mut p = Vec::with_capacity(24 + host_id.len());
        p.extend_from_slice(&len.to_le_bytes());
        p.extend_from_slice(&std::process::id().to_le_bytes());
        p.extend_from_slice(&fd.to_le_bytes());
        p.extend_from_slice(&ino.to_le_bytes());
        p.extend_from_slice(host_id.as_bytes());
        p
    }

    pub(crate) fn decode(p: &[u8]) -> Option<Self> {
        let len = u64::from_le_bytes(p.get(0..8)?.try_into().ok()?);
        let pid = u32::from_le_bytes(p.get(8..12)?.try_into().ok()?);
        let fd = i32::from_le_bytes(p.get(12..16)?.try_into().ok()?);
        let ino = u64::from_le_bytes(p.get(16..24)?.try_into().ok()?);
        let host_id = String::from_utf8_lossy(p.get(24..)?).into_owned();
        Some(Self { len, pid, fd, ino, host_id })
    }
}

/// Carries one control request to a peer and brings back its answer (the TCP
/// transport, over its pooled connections).
pub(crate) trait ControlChannel {
    /// Sends a `op` request about `region` to `endpoint`; the answer's status and
    /// payload.
    fn control(&self, endpoint: &str, op: FrameOp, region: u64) -> Result<(FrameStatus, Vec<u8>)> {
        self.control_with(endpoint, op, region, &[])
    }

    /// As [`control`](Self::control), with a request payload (at most
    /// [`MAX_HANDSHAKE_BYTES`](crate::frame::MAX_HANDSHAKE_BYTES)).
    fn control_with(&self, endpoint: &str, op: FrameOp, region: u64, payload: &[u8]) -> Result<(FrameStatus, Vec<u8>)>;
}

/// Answers the control requests a listener does not answer itself (the RDMA
/// handshake), so that the TCP server needs no knowledge of RDMA.
pub(crate) trait ControlResponder: Send + Sync {
    /// The answer to `op` with the request's `payload`; `region` is the addressed
    /// region when the request names one that is registered.
    fn answer(
        &self,
        op: FrameOp,
        region: Option<std::sync::Arc<crate::region::RegisteredRegion>>,
        payload: &[u8],
    ) -> std::result::Result<Vec<u8>, FrameStatus>;
}

/// The host identity the peer at `endpoint` reports.
pub(crate) fn hello(via: &impl ControlChannel, endpoint: &str) -> Result<String> {
    match via.control(endpoint, FrameOp::Hello, 0)? {
        (FrameStatus::Ok, payload) => {
            String::from_utf8(payload).map_err(|_| TransferError::Protocol("host id is not UTF-8".into()))
        }
        // A refusal's payload is no host identity (taken as one, it could pass for ours).
        (status, _) => Err(TransferError::Protocol(format!("peer answered the hello with {status:?}"))),
    }
}

/// How to map region `region` of the peer at `endpoint`.
pub(crate) fn shm_info(via: &impl ControlChannel, endpoint: &str, region: u64) -> Result<ShmInfo> {
    match via.control(endpoint, FrameOp::ShmInfo, region)? {
        (FrameStatus::Ok, p) => {
            ShmInfo::decode(&p).ok_or_else(|| TransferError::Protocol("short shared-memory handshake".into()))
        }
        (FrameStatus::UnknownRegion, _) => Err(TransferError::UnknownRegion { endpoint: endpoint.to_owned(), region }),
        _ => Err(TransferError::Protocol("peer refused the shared-memory handshake".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_info_round_trips_and_short_answers_are_refused() {
        let p = ShmInfo::encode(1 << 20, 7, 4242, "host/boot/netns");
        let info = ShmInfo::decode(&p).expect("a full answer decodes");
        assert_eq!((info.len, info.pid, info.fd, info.ino), (1 << 20, std::process::id(), 7, 4242));
        assert_eq!(info.host_id, "host/boot/netns");
        for cut in 0..24 {
            assert!(ShmInfo::decode(&p[..cut]).is_none(), "{cut} bytes");
        }
    }

    /// A control channel that answers from a table, as a peer would.
    struct Scripted(Vec<(FrameOp, FrameStatus, Vec<u8>)>);

    impl ControlChannel for Scripted {
        fn control_with(
            &self,
            _endpoint: &str,
            op: FrameOp,
            _region: u64,
            _payload: &[u8],
        ) -> Result<(FrameStatus, Vec<u8>)> {
            let (_, status, payload) = self.0.iter().find(|(o, _, _)| *o == op).expect("scripted op");
            Ok((*status, payload.clone()))
        }
    }

    #[test]
    fn answers_map_to_host_ids_infos_and_errors() {
        let peer = Scripted(vec![
            (FrameOp::Hello, FrameStatus::Ok, b"other-host".to_vec()),
            (FrameOp::ShmInfo, FrameStatus::Ok, ShmInfo::encode(64, 3, 9, "other-host")),
        ]);
        assert_eq!(hello(&peer, "peer:1").unwrap(), "other-host");
        assert_eq!(shm_info(&peer, "peer:1", 5).unwrap().ino, 9);

        let bad_utf8 = Scripted(vec![(FrameOp::Hello, FrameStatus::Ok, vec![0xff, 0xfe])]);
        assert!(matches!(hello(&bad_utf8, "peer:1"), Err(TransferError::Protocol(_))));
        let refused = Scripted(vec![(FrameOp::Hello, FrameStatus::Refused, b"other-host".to_vec())]);
        assert!(matches!(hello(&refused, "peer:1"), Err(TransferError::Protocol(_))));
        let unknown = Scripted(vec![(FrameOp::ShmInfo, FrameStatus::UnknownRegion, vec![])]);
        assert_eq!(
            shm_info(&unknown, "peer:1", 5).err(),
            Some(TransferError::UnknownRegion { endpoint: "peer:1".into(), region: 5 })
        );
        let refused = Scripted(vec![(FrameOp::ShmInfo, FrameStatus::Refused, vec![])]);
        assert!(matches!(shm_info(&refused, "peer:1", 5), Err(TransferError::Protocol(_))));
        let short = Scripted(vec![(FrameOp::ShmInfo, FrameStatus::Ok, vec![0; 10])]);
        assert!(matches!(shm_info(&short, "peer:1", 5), Err(TransferError::Protocol(_))));
    }
}
