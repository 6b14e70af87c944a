//! The `Rdma` transport: one-sided READ for reads and WRITE for writes, straight
//! between registered memory, over a pool of RC queue pairs per peer set up through
//! the peer's TCP listener.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::device::{DeviceRegion, DeviceRegistrations, DeviceTransfer};
use super::handshake::{RdmaHandshake, RdmaRegionInfo};
use super::registration::{Nics, Registration, RegistrationCache};
use super::{Completion, CompletionStatus, DmaBuf, QueuePair, RdmaConfig, RdmaProvider, WorkOp, WorkRequest};
use crate::auth::SharedSecret;
use crate::error::{Result, TransferError};
use crate::frame::{FrameOp, FrameStatus};
use crate::handshake::ControlChannel;
use crate::region::RemoteRegion;
use crate::transport::{Capabilities, TcpTransport, TransferOp, TransferRequest, Transport, TransportStats};

/// Longest a peer that could not be reached is left alone before the next try.
const MAX_COOLDOWN: Duration = Duration::from_secs(5);

/// One queue pair of a peer's pool.
struct LinkQp {
    qp: Box<dyn QueuePair>,
    local_nic: usize,
    remote_nic: usize,
}

/// The queue pairs connected to one peer, and what it said about its regions.
struct Link {
    qps: Vec<Mutex<LinkQp>>,
    /// The local and the remote NIC of each queue pair (read without locking it).
    local_nics: Vec<usize>,
    remote_nics: Vec<usize>,
    regions: RwLock<HashMap<u64, Arc<RdmaRegionInfo>>>,
    path_mtu: u32,
}

/// How a peer is reached now.
enum Peer {
    Linked(Arc<Link>),
    /// Its RDMA setup failed (no device, refused, older peer): TCP serves it.
    Tcp,
    /// It could not be reached, or its link broke: not tried again before `until`.
    Down {
        until: Instant,
    },
}

/// A piece of a request moved by one work request.
struct Chunk {
    req: usize,
    qp: usize,
    wr: WorkRequest,
}

/// Why a request failed on a link.
enum Failure {
    /// The link broke (peer died, queue pair error, stale keys): worth a new link.
    Broken(TransferError),
    /// Final for this request.
    Final(TransferError),
}

/// Reaches peers' regions with one-sided RDMA through an [`RdmaProvider`].
///
/// Every request to a peer is checked against the region's length the peer
/// reported; its bytes move by READ/WRITE work requests between the caller's
/// buffer (registered once, then cached) and the peer's registered region, cut
/// at `stripe` bytes and spread over the queue pairs of every NIC for large
/// requests, or kept on the NIC nearest the buffer's NUMA node for small ones.
/// A peer whose link breaks is reconnected at most `retries` times with a
/// doubling backoff; a peer that cannot be reached is left alone for a cooldown
/// (no reconnection storm); a peer without RDMA is served over TCP.
pub struct RdmaTransport {
    nics: Arc<Nics>,
    tcp: TcpTransport,
    config: RdmaConfig,
    peers: Mutex<HashMap<String, Peer>>,
    /// Consecutive failures per peer (a link that broke, a connection refused):
    /// each doubles the cooldown before the next connection attempt.
    strikes: Mutex<HashMap<String, u32>>,
    cache: RegistrationCache,
    devices: DeviceRegistrations,
    nic_bytes: Vec<AtomicU64>,
    next_qp: AtomicUsize,
    stats: TransportStats,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("implementation", &self.nics.implementation)
            .field("nics", &self.nics.pds.len())
            .finish()
    }
}

impl RdmaTransport {
    /// A transport on every port of `provider`;
    /// [`TransferError::NoDevice`] if it has none.
    pub fn new(provider: &dyn RdmaProvider, config: RdmaConfig) -> Result<Self> {
        Ok(Self::on(Arc::new(open_nics(provider)?), config, TcpTransport::new()))
    }

    /// As [`new`](Self::new), proving `secret` to peers' listeners.
    pub fn with_secret(provider: &dyn RdmaProvider, config: RdmaConfig, secret: SharedSecret) -> Result<Self> {
        Ok(Self::on(Arc::new(open_nics(provider)?), config, TcpTransport::with_secret(secret)))
    }

    pub(crate) fn on(nics: Arc<Nics>, config: RdmaConfig, tcp: TcpTransport) -> Self {
        let cache = RegistrationCache::new(config.registration_cache);
        let devices = DeviceRegistrations::new(config.registration_cache);
        let nic_bytes = nics.pds.iter().map(|_| AtomicU64::new(0)).collect();
        Self {
            nics,
            tcp,
            config,
            peers: Mutex::new(HashMap::new()),
            strikes: Mutex::new(HashMap::new()),
            cache,
            devices,
            nic_bytes,
            next_qp: AtomicUsize::new(0),
            stats: TransportStats::default(),
        }
    }

    /// Which seam implementation runs underneath (`"soft"` or `"verbs"`).
    pub fn implementation(&self) -> &'static str {
        self.nics.implementation
    }

    /// Byte and error counters.
    pub fn stats(&self) -> &TransportStats {
        &self.stats
    }

    /// Bytes moved through each NIC, in port order.
    pub fn nic_bytes(&self) -> Vec<u64> {
        self.nic_bytes.iter().map(|b| b.load(Ordering::Relaxed)).collect()
    }

    /// Memory regions registered so far on all NICs (a registration cache hit
    /// registers none).
    pub fn registrations(&self) -> u64 {
        self.nics.registrations.load(Ordering::Relaxed)
    }

    /// Forgets every cached registration of local buffers (call it after freeing
    /// buffers that were transferred, before their addresses are mapped again),
    /// and of device memory (registrations and refusals).
    pub fn forget_registrations(&self) {
        self.cache.clear();
        self.devices.clear();
    }

    /// The path MTU of the link to `endpoint` (the smaller of both ports'), if an
    /// RDMA link is up.
    pub fn path_mtu(&self, endpoint: &str) -> Option<u32> {
        match self.peers.lock().get(endpoint) {
            Some(Peer::Linked(link)) => Some(link.path_mtu),
            _ => None,
        }
    }

    /// Whether `endpoint` is served over TCP because its RDMA setup failed.
    pub fn falls_back_to_tcp(&self, endpoint: &str) -> bool {
        matches!(self.peers.lock().get(endpoint), Some(Peer::Tcp))
    }

    /// The link to `endpoint`: `None` if it is served over TCP.
    fn link(&self, endpoint: &str) -> Result<Option<Arc<Link>>> {
        match self.peers.lock().get_mut(endpoint) {
            Some(Peer::Linked(link)) => return Ok(Some(link.clone())),
            Some(Peer::Tcp) => return Ok(None),
            Some(Peer::Down { until }) => {
                let now = Instant::now();
                if now < *until {
                    return Err(TransferError::Unreachable(format!("{endpoint}: link down, not retried yet")));
                }
                // This thread reconnects; the others keep failing fast meanwhile.
                *until = now + self.config.deadline;
            }
            None => {}
        }
        let peer = match self.connect(endpoint) {
            Ok(Some(link)) => Peer::Linked(Arc::new(link)),
            Ok(None) => Peer::Tcp,
            Err(e @ (TransferError::Auth(_) | TransferError::UnknownEndpoint(_))) => return Err(e),
            Err(e) => {
                self.strike(endpoint);
                return Err(e);
            }
        };
        let mut peers = self.peers.lock();
        // Another thread may have linked meanwhile: keep the first.
        let entry = peers.entry(endpoint.to_owned()).or_insert(Peer::Tcp);
        if !matches!(entry, Peer::Linked(_)) {
            *entry = peer;
        }
        Ok(match entry {
            Peer::Linked(link) => Some(link.clone()),
            _ => None,
        })
    }

    /// Forgets `link` (broken): a request after the cooldown connects again.
    fn drop_link(&self, endpoint: &str, link: &Arc<Link>) {
        let current = matches!(self.peers.lock().get(endpoint), Some(Peer::Linked(l)) if Arc::ptr_eq(l, link));
        if current {
            self.strike(endpoint);
        }
    }

    /// One more failure of `endpoint`: no connection attempt before a cooldown
    /// that doubles with each consecutive failure (capped), so that the requests
    /// of every thread to a dead peer do not each reconnect.
    fn strike(&self, endpoint: &str) {
        let strikes = {
            let mut all = self.strikes.lock();
            let n = all.entry(endpoint.to_owned()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        let cooldown = (self.config.backoff * 2u32.saturating_pow(strikes - 1)).min(MAX_COOLDOWN);
        self.peers.lock().insert(endpoint.to_owned(), Peer::Down { until: Instant::now() + cooldown });
    }

    /// Sets up a pool of queue pairs with the peer: `Ok(None)` if the peer is
    /// reachable but its RDMA setup failed.
    fn connect(&self, endpoint: &str) -> Result<Option<Link>> {
        let per_nic = self.config.qps_per_nic.max(1);
        let nics = self.nics.pds.len();
        let mut qps = Vec::with_capacity(nics * per_nic);
        let mut offer = Vec::with_capacity(nics * per_nic);
        for j in 0..nics * per_nic {
            let nic = j % nics;
            let mut qp = self.nics.pds[nic].create_qp(self.config.max_batch as u32 * 2)?;
            qp.to_init()?;
            let mut addr = qp.address();
            addr.nic = nic as u8;
            offer.push(addr);
            qps.push((qp, nic));
        }
        let answer =
            match self.tcp.control_with(endpoint, FrameOp::RdmaConnect, 0, &RdmaHandshake { qps: offer }.encode()) {
                Ok((FrameStatus::Ok, payload)) => RdmaHandshake::decode(&payload).ok(),
                Ok(_) => None,
                // An older peer closes the connection on the unknown request.
                Err(TransferError::Protocol(_)) => None,
                Err(TransferError::Io(e)) if self.tcp.control(endpoint, FrameOp::Hello, 0).is_ok() => {
                    tracing::info!(endpoint, error = %e, "peer closed the RDMA handshake: TCP serves it");
                    None
                }
                Err(e) => return Err(e),
            };
        let Some(answer) = answer.filter(|a| a.qps.len() == qps.len()) else {
            tracing::info!(endpoint, "peer has no RDMA link to offer: TCP serves it");
            return Ok(None);
        };
        let mut link_qps = Vec::with_capacity(qps.len());
        let mut path_mtu = u32::MAX;
        for ((mut qp, nic), remote) in qps.into_iter().zip(&answer.qps) {
            let mtu = remote.mtu.min(self.nics.pds[nic].port().active_mtu);
            path_mtu = path_mtu.min(mtu);
            if let Err(e) = qp.to_rtr(remote, mtu).and_then(|()| qp.to_rts()) {
                tracing::warn!(endpoint, error = %e, "connecting an RDMA queue pair: TCP serves the peer");
                return Ok(None);
            }
            link_qps.push(Mutex::new(LinkQp { qp, local_nic: nic, remote_nic: remote.nic as usize }));
        }
        let local_nics = link_qps.iter().map(|q| q.lock().local_nic).collect();
        let remote_nics = link_qps.iter().map(|q| q.lock().remote_nic).collect();
        tracing::info!(
            endpoint,
            queue_pairs = link_qps.len(),
            path_mtu,
            implementation = self.nics.implementation,
            "RDMA link up"
        );
        Ok(Some(Link { qps: link_qps, local_nics, remote_nics, regions: RwLock::new(HashMap::new()), path_mtu }))
    }

    /// What the peer said about `region` (asked once per link).
    fn region_info(&self, endpoint: &str, link: &Link, region: u64) -> Result<Arc<RdmaRegionInfo>> {
        if let Some(info) = link.regions.read().get(&region) {
            return Ok(info.clone());
        }
        let info = match self.tcp.control(endpoint, FrameOp::RdmaRegion, region)? {
            (FrameStatus::Ok, p) => Arc::new(
                RdmaRegionInfo::decode(&p)
                    .map_err(|e| TransferError::Protocol(format!("RDMA region info of {endpoint}: {e}")))?,
            ),
            (FrameStatus::UnknownRegion, _) => {
                return Err(TransferError::UnknownRegion { endpoint: endpoint.to_owned(), region })
            }
            _ => return Err(TransferError::Protocol(format!("{endpoint} refused RDMA for region {region}"))),
        };
        let nics = info.pieces.first().map_or(0, |p| p.rkeys.len());
        if link.remote_nics.iter().any(|&n| n >= nics) {
            return Err(TransferError::Protocol(format!("{endpoint} named fewer NICs than it connected")));
        }
        link.regions.write().insert(region, info.clone());
        Ok(info)
    }

    /// Queue pairs of the NICs nearest `addr` (its NUMA node, for a host
    /// address), or all.
    fn near_qps(&self, link: &Link, addr: u64, host: bool) -> Vec<usize> {
        let node = if host { numa_node_of(addr) } else { None };
        let near: Vec<usize> = (0..link.qps.len())
            .filter(|&q| node.is_some() && self.nics.pds[link.local_nics[q]].port().numa_node == node)
            .collect();
        if near.is_empty() {
            (0..link.qps.len()).collect()
        } else {
            near
        }
    }

    /// Cuts the jobs `idx` into work requests on `link`'s queue pairs. A job that
    /// cannot go over RDMA gets its failure instead.
    fn plan(
        &self,
        endpoint: &str,
        link: &Link,
        jobs: &[Job<'_>],
        idx: &[usize],
        out: &mut Vec<Chunk>,
        keep: &mut Vec<Arc<Registration>>,
    ) -> Vec<(usize, Failure)> {
        let mut failed = Vec::new();
        let mut wr_id = 0u64;
        for &i in idx {
            let job = &jobs[i];
            let (op, ptr, len) = (job.op, job.addr, job.len);
            let info = match self.region_info(endpoint, link, job.target.region) {
                Ok(info) => info,
                Err(e @ (TransferError::Io(_) | TransferError::Unreachable(_))) => {
                    failed.push((i, Failure::Broken(e)));
                    continue;
                }
                Err(e) => {
                    failed.push((i, Failure::Final(e)));
                    continue;
                }
            };
            if job.offset.checked_add(len).is_none_or(|end| end > info.len) {
                let e = TransferError::OutOfBounds {
                    region: job.target.region,
                    offset: job.offset,
                    len,
                    region_len: info.len,
                };
                failed.push((i, Failure::Final(e)));
                continue;
            }
            if len == 0 {
                continue;
            }
            let local = match &job.device {
                Some(reg) => reg.clone(),
                None => match self.cache.get(&self.nics, ptr as *const u8, len) {
                    Ok(r) => r,
                    Err(e) => {
                        failed.push((i, Failure::Final(e)));
                        continue;
                    }
                },
            };
            let striped = len > self.config.stripe as u64;
            // Device memory has no NUMA node to ask the kernel for: its share goes
            // over every NIC.
            let near = if striped { Vec::new() } else { self.near_qps(link, ptr, job.device.is_none()) };
            let mut pos = 0u64;
            let mut k = 0usize;
            while pos < len {
                let remote_off = job.offset + pos;
                let rp = info.pieces.partition_point(|p| p.offset + p.len <= remote_off);
                let (Some(rpiece), Some((lpiece, local_left))) = (info.pieces.get(rp), local.piece_at(ptr + pos))
                else {
                    failed.push((i, Failure::Final(TransferError::Protocol("region pieces do not cover".into()))));
                    break;
                };
                let n = (len - pos)
                    .min(self.config.stripe as u64)
                    .min(rpiece.offset + rpiece.len - remote_off)
                    .min(local_left)
                    .min(u32::MAX as u64);
                let qp = if striped {
                    k % link.qps.len()
                } else {
                    near[self.next_qp.fetch_add(1, Ordering::Relaxed) % near.len()]
                };
                let (local_nic, remote_nic) = (link.local_nics[qp], link.remote_nics[qp]);
                out.push(Chunk {
                    req: i,
                    qp,
                    wr: WorkRequest {
                        wr_id,
                        op,
                        local_addr: ptr + pos,
                        len: n as u32,
                        lkey: lpiece.mrs[local_nic].lkey,
                        remote_addr: rpiece.addr + (remote_off - rpiece.offset),
                        rkey: rpiece.rkeys[remote_nic],
                    },
                });
                wr_id += 1;
                pos += n;
                k += 1;
            }
            // The registration must outlive the work requests even if the cache
            // evicts it meanwhile.
            keep.push(local);
        }
        failed
    }

    /// Runs `chunks` on the link's queue pairs, in parallel per queue pair; the
    /// status of every chunk (by `wr_id`), or `None` for chunks past the deadline.
    fn execute(&self, link: &Link, chunks: &[Chunk], deadline: Instant) -> HashMap<u64, Option<CompletionStatus>> {
        let mut per_qp: Vec<Vec<WorkRequest>> = vec![Vec::new(); link.qps.len()];
        for c in chunks {
            per_qp[c.qp].push(c.wr);
        }
        let run = |(q, wrs): (usize, Vec<WorkRequest>)| -> Vec<(u64, Option<CompletionStatus>)> {
            let mut lq = link.qps[q].lock();
            let mut done = Vec::with_capacity(wrs.len());
            let mut expired = false;
            for batch in wrs.chunks(self.config.max_batch.max(1)) {
                if expired {
                    done.extend(batch.iter().map(|wr| (wr.wr_id, None)));
                    continue;
                }
                // SAFETY: every local range is a sub-range of a buffer borrowed by
                // this transfer (alive until it returns), inside a registration held
                // by the cache or by `plan`; this function returns only after every
                // posted request completed, or after `to_error` stopped the queue
                // pair from touching memory.
                if let Err(e) = unsafe { lq.qp.post(batch) } {
                    tracing::warn!(error = %e, "posting RDMA work requests");
                    lq.qp.to_error();
                    done.extend(batch.iter().map(|wr| (wr.wr_id, Some(CompletionStatus::Flushed))));
                    continue;
                }
                let mut got: Vec<Completion> = Vec::with_capacity(batch.len());
                while got.len() < batch.len() {
                    let now = Instant::now();
                    if now >= deadline {
                        // Stop the queue pair before giving the buffers back; what
                        // completed before stays done, the rest timed out.
                        lq.qp.to_error();
                        let mut last = Vec::new();
                        let _ = lq.qp.poll(&mut last, Duration::ZERO);
                        got.extend(last.into_iter().filter(|c| c.status == CompletionStatus::Success));
                        break;
                    }
                    let wait = (deadline - now).min(Duration::from_millis(50));
                    if lq.qp.poll(&mut got, wait).is_err() {
                        lq.qp.to_error();
                        break;
                    }
                }
                let mut statuses: HashMap<u64, CompletionStatus> = got.iter().map(|c| (c.wr_id, c.status)).collect();
                for wr in batch {
                    let s = statuses.remove(&wr.wr_id);
                    // The rest of this queue pair's share is past the deadline too.
                    expired |= s.is_none();
                    done.push((wr.wr_id, s));
                }
            }
            if let Some(nic) = self.nic_bytes.get(lq.local_nic) {
                let bytes: u64 = wrs
                    .iter()
                    .zip(&done)
                    .filter(|(_, (_, s))| *s == Some(CompletionStatus::Success))
                    .map(|(wr, _)| u64::from(wr.len))
                    .sum();
                nic.fetch_add(bytes, Ordering::Relaxed);
            }
            done
        };
        let work: Vec<(usize, Vec<WorkRequest>)> =
            per_qp.into_iter().enumerate().filter(|(_, w)| !w.is_empty()).collect();
        let results: Vec<Vec<(u64, Option<CompletionStatus>)>> = if work.len() <= 1 {
            work.into_iter().map(run).collect()
        } else {
            std::thread::scope(|scope| {
                let handles: Vec<_> = work.into_iter().map(|w| scope.spawn(|| run(w))).collect();
                handles.into_iter().map(|h| h.join().unwrap_or_default()).collect()
            })
        };
        results.into_iter().flatten().collect()
    }

    /// One attempt of the jobs `idx` on `link`.
    fn attempt(
        &self,
        endpoint: &str,
        link: &Link,
        jobs: &[Job<'_>],
        idx: &[usize],
        deadline: Instant,
    ) -> Vec<(usize, Result<(), Failure>)> {
        let (mut chunks, mut keep) = (Vec::new(), Vec::new());
        let failed = self.plan(endpoint, link, jobs, idx, &mut chunks, &mut keep);
        let statuses = self.execute(link, &chunks, deadline);
        drop(keep);
        let mut outcome: HashMap<usize, Result<(), Failure>> = idx.iter().map(|&i| (i, Ok(()))).collect();
        for (i, f) in failed {
            outcome.insert(i, Err(f));
        }
        for c in &chunks {
            let failure = match statuses.get(&c.wr.wr_id).copied().flatten() {
                Some(CompletionStatus::Success) => continue,
                None => Failure::Final(TransferError::TimedOut(format!(
                    "{endpoint}: not completed within {:?}",
                    self.config.deadline
                ))),
                Some(CompletionStatus::LocalProtection) => {
                    if jobs[c.req].device.is_none() {
                        self.cache.clear();
                    }
                    Failure::Final(TransferError::Registration("local protection error on an RDMA buffer".into()))
                }
                Some(CompletionStatus::RemoteAccess) => {
                    // Keys went stale (region unregistered, peer restarted): ask again.
                    let region = jobs[c.req].target.region;
                    link.regions.write().remove(&region);
                    Failure::Broken(TransferError::UnknownRegion { endpoint: endpoint.to_owned(), region })
                }
                Some(s) => Failure::Broken(TransferError::Io(format!("RDMA link to {endpoint}: {s:?}"))),
            };
            let slot = outcome.entry(c.req).or_insert(Ok(()));
            // A final failure wins over a broken link: retrying cannot help it.
            if !matches!(slot, Err(Failure::Final(_))) {
                *slot = Err(failure);
            }
        }
        let mut out: Vec<(usize, Result<(), Failure>)> = outcome.into_iter().collect();
        out.sort_by_key(|(i, _)| *i);
        for (i, r) in &out {
            if r.is_ok() {
                let counter = match jobs[*i].op {
                    WorkOp::Read => &self.stats.bytes_read,
                    WorkOp::Write => &self.stats.bytes_written,
                };
                counter.fetch_add(jobs[*i].len, Ordering::Relaxed);
            }
        }
        out
    }

    /// The jobs `idx` (all to `endpoint`), with reconnections; each result goes
    /// into `results`. Returns the jobs left to TCP: the peer turned out to offer
    /// no RDMA.
    fn to_peer(&self, endpoint: &str, jobs: &[Job<'_>], idx: &[usize], results: &mut [Result<()>]) -> Vec<usize> {
        let deadline = Instant::now() + self.config.deadline;
        let mut pending: Vec<usize> = idx.to_vec();
        let mut to_tcp = Vec::new();
        let mut tries = 0u32;
        while !pending.is_empty() {
            let retry: Vec<(usize, TransferError)> = match self.link(endpoint) {
                Ok(Some(link)) => {
                    let out = self.attempt(endpoint, &link, jobs, &pending, deadline);
                    let mut retry = Vec::new();
                    let mut timed_out = false;
                    for (i, r) in out {
                        match r {
                            Ok(()) => results[i] = Ok(()),
                            Err(Failure::Final(e)) => {
                                timed_out |= matches!(e, TransferError::TimedOut(_));
                                results[i] = Err(e);
                            }
                            Err(Failure::Broken(e)) => retry.push((i, e)),
                        }
                    }
                    if timed_out {
                        // Its queue pairs were stopped: the next request links anew.
                        let mut peers = self.peers.lock();
                        if matches!(peers.get(endpoint), Some(Peer::Linked(l)) if Arc::ptr_eq(l, &link)) {
                            peers.remove(endpoint);
                        }
                    }
                    if retry.is_empty() {
                        self.strikes.lock().remove(endpoint);
                    } else {
                        self.drop_link(endpoint, &link);
                    }
                    retry
                }
                Ok(None) => {
                    // TCP serves this peer: the pending jobs go there.
                    to_tcp = pending;
                    break;
                }
                Err(e) => {
                    // The peer cannot be linked now (its failure is counted and
                    // cools down): fail at once instead of waiting on it.
                    for &i in &pending {
                        results[i] = Err(e.clone());
                    }
                    Vec::new()
                }
            };
            tries += 1;
            let wait = self.config.backoff * 2u32.saturating_pow(tries - 1);
            let jitter = Duration::from_micros(rand::random::<u64>() % (wait.as_micros() as u64 / 2 + 1));
            if retry.is_empty() || tries > self.config.retries || Instant::now() + wait + jitter >= deadline {
                for (i, e) in retry {
                    results[i] = Err(e);
                }
                break;
            }
            pending = retry.into_iter().map(|(i, _)| i).collect();
            std::thread::sleep(wait + jitter);
        }
        for &i in idx {
            if results[i].is_err() {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        to_tcp
    }

    /// Every job, grouped by peer; one result per job, and the jobs whose peer
    /// is served over TCP (their result is left as it was).
    fn run_jobs(&self, jobs: &[Job<'_>], results: &mut [Result<()>]) -> Vec<usize> {
        let mut by_peer: Vec<(&str, Vec<usize>)> = Vec::new();
        for (i, j) in jobs.iter().enumerate() {
            match by_peer.iter_mut().find(|(e, _)| *e == j.target.endpoint) {
                Some((_, idx)) => idx.push(i),
                None => by_peer.push((j.target.endpoint.as_str(), vec![i])),
            }
        }
        let mut to_tcp = Vec::new();
        for (endpoint, idx) in by_peer {
            to_tcp.extend(self.to_peer(endpoint, jobs, &idx, results));
        }
        to_tcp
    }

    /// Registers the `len` bytes at device address `addr` of device allocation
    /// `id` on every NIC, from the dma-buf `export` makes (called only when that
    /// range is not registered yet, and which must cover it), for
    /// [`transfer_device`](Self::transfer_device); a registration (or a refusal)
    /// is kept for the next call, like host buffers' registrations.
    ///
    /// `id` must name one allocation for the life of the process, never reused
    /// (CUDA's `CU_POINTER_ATTRIBUTE_BUFFER_ID` is such an id). A NIC or an
    /// implementation that cannot register the dma-buf (no dma-buf support, no
    /// peer-to-peer path to the GPU) fails with
    /// [`TransferError::Registration`]: the caller stages through host memory.
    pub fn register_device(
        &self,
        id: u64,
        addr: u64,
        len: u64,
        export: impl FnOnce() -> Result<DmaBuf>,
    ) -> Result<DeviceRegion> {
        self.devices.get(&self.nics, (id, addr, len), export)
    }

    /// Moves bytes between peers' regions and device memory registered with
    /// [`register_device`](Self::register_device), with one-sided READ and WRITE
    /// straight to and from device memory, striped and retried as host transfers
    /// are. One result per request, in order. A request whose local range lies
    /// outside its device region fails with [`TransferError::Registration`]; one
    /// to a peer that offers no RDMA fails with [`TransferError::Unreachable`]
    /// (device memory cannot go over TCP: stage it through host memory).
    ///
    /// # Safety
    /// Each request's device allocation must be alive, and its local range not
    /// used by anything else (not read or written for a READ, not written for a
    /// WRITE) until this call returns.
    pub unsafe fn transfer_device(&self, requests: &[DeviceTransfer<'_>]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = (0..requests.len()).map(|_| Ok(())).collect();
        let mut jobs = Vec::with_capacity(requests.len());
        let mut valid = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            if r.local.contains(r.local_addr, r.len) {
                valid.push(i);
                jobs.push(Job {
                    target: r.target,
                    offset: r.offset,
                    op: r.op,
                    addr: r.local_addr,
                    len: r.len,
                    device: Some(r.local.reg.clone()),
                });
            } else {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                results[i] = Err(TransferError::Registration(format!(
                    "device range {:#x}+{} outside its registration {:?}",
                    r.local_addr, r.len, r.local
                )));
            }
        }
        let mut out: Vec<Result<()>> = (0..jobs.len()).map(|_| Ok(())).collect();
        for j in self.run_jobs(&jobs, &mut out) {
            out[j] = Err(TransferError::Unreachable(format!(
                "{}: no RDMA link, device memory cannot be reached over TCP",
                jobs[j].target.endpoint
            )));
        }
        for (i, r) in valid.into_iter().zip(out) {
            results[i] = r;
        }
        results
    }
}

/// One request as the planner sees it: a local range (a host buffer, or device
/// memory already registered) and the remote bytes it moves to or from.
struct Job<'r> {
    target: &'r RemoteRegion,
    offset: u64,
    op: WorkOp,
    /// First local byte: a host address, or a device address inside `device`.
    addr: u64,
    len: u64,
    /// The registration of device memory; `None` for a host buffer, registered
    /// through the cache.
    device: Option<Arc<Registration>>,
}

/// The protection domains of every port of `provider`; [`TransferError::NoDevice`] if none.
pub(crate) fn open_nics(provider: &dyn RdmaProvider) -> Result<Nics> {
    Nics::open(provider).map_err(|e| TransferError::NoDevice(e.to_string()))
}

/// The NUMA node of the page holding `addr`, if the kernel says.
fn numa_node_of(addr: u64) -> Option<u32> {
    const MPOL_F_NODE: libc::c_ulong = 1;
    const MPOL_F_ADDR: libc::c_ulong = 2;
    let mut node: libc::c_int = -1;
    // SAFETY: get_mempolicy writes one int to `node`; no node mask is asked for
    // (null, 0); `addr` is only looked up, never dereferenced by us.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut node as *mut libc::c_int,
            std::ptr::null_mut::<libc::c_ulong>(),
            0 as libc::c_ulong,
            addr as *mut libc::c_void,
            MPOL_F_NODE | MPOL_F_ADDR,
        )
    };
    (rc == 0 && node >= 0).then_some(node as u32)
}

impl Transport for RdmaTransport {
    fn name(&self) -> &str {
        "rdma"
    }

    fn capabilities(&self, endpoint: &str) -> Capabilities {
        if self.falls_back_to_tcp(endpoint) {
            // Served by the TCP transport inside: its capabilities.
            return self.tcp.capabilities(endpoint);
        }
        // One-sided READ/WRITE do not sum; a peer not connected yet is tried over
        // RDMA first.
        Capabilities { maps_peer_memory: false, sums_in_flight: false, moves_device_memory: true }
    }

    fn stats(&self) -> Option<&TransportStats> {
        Some(&self.stats)
    }

    fn can_reach(&self, endpoint: &str) -> bool {
        self.tcp.can_reach(endpoint)
    }

    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = (0..requests.len()).map(|_| Ok(())).collect();
        let jobs: Vec<Job<'_>> = requests
            .iter_mut()
            .map(|r| {
                let (op, addr, len) = match &mut r.op {
                    TransferOp::Read(dst) => (WorkOp::Read, dst.as_mut_ptr() as u64, dst.len() as u64),
                    TransferOp::Write(src) => (WorkOp::Write, src.as_ptr() as u64, src.len() as u64),
                };
                Job { target: r.target, offset: r.offset, op, addr, len, device: None }
            })
            .collect();
        let to_tcp = self.run_jobs(&jobs, &mut results);
        drop(jobs);
        if !to_tcp.is_empty() {
            // Move these requests into one TCP batch (leaving empty ones in their
            // place), run it, and put them back.
            let mut moved: Vec<TransferRequest<'_>> = to_tcp
                .iter()
                .map(|&i| {
                    let target = requests[i].target;
                    std::mem::replace(&mut requests[i], TransferRequest::write(target, 0, &[]))
                })
                .collect();
            let out = self.tcp.transfer(&mut moved);
            for ((&i, req), r) in to_tcp.iter().zip(moved).zip(out) {
                requests[i] = req;
                results[i] = r;
            }
        }
        results
    }
}
