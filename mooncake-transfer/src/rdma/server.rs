//! The serving side of RDMA: answers peers' handshakes over the engine's TCP
//! listener (connects queue pairs, registers served regions on every NIC) and
//! deregisters a region the moment the engine stops serving it.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;

use super::handshake::{RdmaHandshake, RdmaRegionInfo, RegionPiece};
use super::registration::{Nics, Registration};
use super::{QueuePair, RemoteAccess};
use crate::frame::FrameStatus;
use crate::frame::{FrameOp, MAX_HANDSHAKE_BYTES};
use crate::handshake::ControlResponder;
use crate::region::{RegionId, RegisteredRegion};

/// Queue pairs kept for peers; beyond, the oldest are closed (their peer
/// reconnects), so that peers that come and go cannot exhaust the device.
const MAX_SERVED_QPS: usize = 1024;

/// A served region's registration on every NIC, and the region (held: its memory
/// must outlive its memory regions; fields drop in order, deregistration first).
type ServedRegion = (Arc<Registration>, Arc<RegisteredRegion>);

/// Answers RDMA handshakes for one engine.
pub(crate) struct RdmaResponder {
    nics: Arc<Nics>,
    qps: Mutex<VecDeque<Box<dyn QueuePair>>>,
    /// Served regions registered so far.
    regions: Mutex<HashMap<RegionId, ServedRegion>>,
}

impl RdmaResponder {
    pub(crate) fn new(nics: Arc<Nics>) -> Self {
        Self { nics, qps: Mutex::new(VecDeque::new()), regions: Mutex::new(HashMap::new()) }
    }

    /// Deregisters region `id` (unregistered, or the engine stops): peers' keys for
    /// it are refused from now on.
    pub(crate) fn forget_region(&self, id: RegionId) {
        let gone = self.regions.lock().remove(&id);
        drop(gone);
    }

    /// Connects one queue pair per offered one, on the matching NIC (the peer's NIC
    /// index modulo ours), at the smaller of both ports' MTUs.
    fn connect(&self, payload: &[u8]) -> Result<Vec<u8>, FrameStatus> {
        let offer = RdmaHandshake::decode(payload).map_err(|_| FrameStatus::Refused)?;
        let mut answer = Vec::with_capacity(offer.qps.len());
        let mut created = Vec::with_capacity(offer.qps.len());
        for remote in &offer.qps {
            let nic = remote.nic as usize % self.nics.pds.len();
            let pd = &self.nics.pds[nic];
            let mtu = remote.mtu.min(pd.port().active_mtu);
            let mut qp = pd.create_qp(64).map_err(|_| FrameStatus::Refused)?;
            qp.to_init().and_then(|()| qp.to_rtr(remote, mtu)).and_then(|()| qp.to_rts()).map_err(|e| {
                tracing::warn!(error = %e, "connecting an RDMA queue pair for a peer");
                FrameStatus::Refused
            })?;
            let mut addr = qp.address();
            addr.nic = nic as u8;
            answer.push(addr);
            created.push(qp);
        }
        let mut qps = self.qps.lock();
        qps.extend(created);
        while qps.len() > MAX_SERVED_QPS {
            qps.pop_front();
        }
        Ok(RdmaHandshake { qps: answer }.encode())
    }

    /// The memory regions of `region`, registering it on every NIC at first ask.
    fn region(&self, region: Arc<RegisteredRegion>) -> Result<Vec<u8>, FrameStatus> {
        let reg = {
            let mut regions = self.regions.lock();
            match regions.get(&region.id()) {
                Some((r, _)) => r.clone(),
                None => {
                    // Peers write only regions their engine lets them write: a
                    // read-only region (an SSD tier's staging buffer) gets no
                    // remote write access, so a peer's WRITE fails at the NIC.
                    let access = if region.peers_may_write() { RemoteAccess::ReadWrite } else { RemoteAccess::Read };
                    // SAFETY: the region's mapping lives as long as the `Arc` held in
                    // `regions` next to the registration, and the registration is
                    // dropped (deregistered) first when the entry goes; peers' writes
                    // into it (where allowed) are what registering a region is for.
                    let r = Arc::new(
                        unsafe { self.nics.register(region.as_mut_ptr(), region.len(), access) }.map_err(|e| {
                            tracing::warn!(error = %e, "registering a served region for RDMA");
                            FrameStatus::Refused
                        })?,
                    );
                    regions.insert(region.id(), (r.clone(), region.clone()));
                    r
                }
            }
        };
        let info = RdmaRegionInfo {
            len: region.len(),
            pieces: reg
                .pieces
                .iter()
                .map(|p| RegionPiece {
                    offset: p.offset,
                    len: p.len,
                    addr: reg.start + p.offset,
                    rkeys: p.mrs.iter().map(|mr| mr.rkey).collect(),
                })
                .collect(),
        };
        let bytes = info.encode();
        if bytes.len() as u64 > MAX_HANDSHAKE_BYTES {
            // More pieces than one answer holds: such a region is served over TCP.
            return Err(FrameStatus::Refused);
        }
        Ok(bytes)
    }
}

impl ControlResponder for RdmaResponder {
    fn answer(
        &self,
        op: FrameOp,
        region: Option<Arc<RegisteredRegion>>,
        payload: &[u8],
    ) -> Result<Vec<u8>, FrameStatus> {
        match (op, region) {
            (FrameOp::RdmaConnect, _) => self.connect(payload),
            (FrameOp::RdmaRegion, Some(region)) => self.region(region),
            (FrameOp::RdmaRegion, None) => Err(FrameStatus::UnknownRegion),
            _ => Err(FrameStatus::Refused),
        }
    }
}
