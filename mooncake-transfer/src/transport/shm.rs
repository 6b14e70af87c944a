//! The `Shm` transport: peers on the same host map each other's memfd-backed
//! regions and copy with `memcpy`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::RwLock;

use super::tcp::TcpTransport;
use super::{copy_with_region, Capabilities, MappedRegion, TransferOp, TransferRequest, Transport, TransportStats};
use crate::auth::SharedSecret;
use crate::error::{Result, TransferError};
use crate::handshake::{self, host_id};
use crate::region::{shared_file_len, RegisteredRegion, RemoteRegion};

/// A peer's region mapped into this process, and how to tell that it is still the
/// peer's: the region's revocation word (set by the owner when it unregisters the
/// region or drops its engine) and a pidfd of the owner (readable once it exited).
/// Without a pidfd (old kernels), the `/proc` path of the peer's descriptor and the
/// memfd's inode are checked instead (a few µs per use).
#[derive(Debug)]
struct PeerMapping {
    region: RegisteredRegion,
    pidfd: Option<std::os::fd::OwnedFd>,
    path: String,
    ino: u64,
}

impl PeerMapping {
    /// Whether the peer still serves this memfd. A mapping outlives the peer's
    /// memory otherwise: without this check an unregistered region or a dead peer's
    /// segment would stay alive (and be served) for as long as it is cached.
    fn is_current(&self) -> bool {
        if self.region.is_revoked() {
            return false;
        }
        match &self.pidfd {
            // A pidfd polls readable once its process exited.
            Some(pidfd) => {
                use std::os::fd::AsFd;
                matches!(crate::answer_wait::readable_now(pidfd.as_fd()), Ok(false))
            }
            None => {
                use std::os::unix::fs::MetadataExt;
                std::fs::metadata(&self.path).is_ok_and(|m| m.ino() == self.ino)
            }
        }
    }
}

/// A pidfd of `pid`, if the kernel has `pidfd_open` (Linux 5.3).
fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: `fd` was just returned by pidfd_open and is owned by nobody else.
    Some(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}

/// Reaches regions of same-host peers by mapping them; asks peers through `Tcp`.
#[derive(Debug, Default)]
pub struct ShmTransport {
    tcp: TcpTransport,
    same_host: RwLock<HashMap<String, bool>>,
    maps: RwLock<HashMap<String, HashMap<u64, Arc<PeerMapping>>>>,
    stats: TransportStats,
}

impl ShmTransport {
    /// A transport with no mappings yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A transport whose handshakes prove `secret` to peers.
    pub fn with_secret(secret: SharedSecret) -> Self {
        Self { tcp: TcpTransport::with_secret(secret), ..Self::default() }
    }

    /// Byte and error counters.
    pub fn stats(&self) -> &TransportStats {
        &self.stats
    }

    /// Peers' regions mapped now (each holds its segment's memory while mapped).
    pub fn mapped_regions(&self) -> usize {
        self.maps.read().values().map(HashMap::len).sum()
    }

    fn mapping(&self, endpoint: &str, region: u64) -> Result<Arc<PeerMapping>> {
        let cached = self.maps.read().get(endpoint).and_then(|regions| regions.get(&region)).cloned();
        if let Some(m) = cached {
            if m.is_current() {
                return Ok(m);
            }
            // The peer closed it (unregistered, or exited): forget the mapping.
            if let Some(regions) = self.maps.write().get_mut(endpoint) {
                regions.remove(&region);
            }
        }
        let info = handshake::shm_info(&self.tcp, endpoint, region)?;
        if info.host_id != host_id() {
            return Err(TransferError::Unreachable(format!("{endpoint} is on another host")));
        }
        // The pidfd first: if the pid was reused before this, the memfd below is not
        // the one the peer named and the inode check refuses it.
        let pidfd = pidfd_open(info.pid);
        let path = format!("/proc/{}/fd/{}", info.pid, info.fd);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| TransferError::Unreachable(format!("cannot open {path}: {e}")))?;
        let meta = file.metadata().map_err(|e| TransferError::Unreachable(format!("{path}: {e}")))?;
        let ino = {
            use std::os::unix::fs::MetadataExt;
            meta.ino()
        };
        // The descriptor may have been closed and its number reused since the peer
        // answered: map only the very memfd it named, of at least the size it named,
        // and with its size sealed (so the mapping can never lose its backing).
        if ino != info.ino || meta.len() < shared_file_len(info.len)? {
            return Err(TransferError::Unreachable(format!("{path} is no longer region {region} of {endpoint}")));
        }
        // SAFETY: F_GET_SEALS on a descriptor we own; it takes no argument and
        // returns the seals or -1.
        let seals = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&file), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(TransferError::Unreachable(format!("{path} is not a size-sealed memfd")));
        }
        // A region its owner registered read-only is sealed against writes from
        // mappings made after its own: ours is read-only, and refuses writes.
        let writable = seals & libc::F_SEAL_FUTURE_WRITE == 0;
        let region_map = RegisteredRegion::map_file(region, &file, info.len, true, writable)
            .map_err(|e| TransferError::Unreachable(format!("cannot map {path}: {e}")))?;
        if region_map.is_revoked() {
            return Err(TransferError::UnknownRegion { endpoint: endpoint.to_owned(), region });
        }
        let m = Arc::new(PeerMapping { region: region_map, pidfd, path, ino });
        let mut maps = self.maps.write();
        // Mappings of peers that exited or unregistered are dropped here, not only when
        // the same region is asked for again (no one asks for a dead node's region
        // again): each holds its whole segment's memory while mapped.
        for regions in maps.values_mut() {
            regions.retain(|_, old| old.is_current());
        }
        maps.retain(|_, regions| !regions.is_empty());
        maps.entry(endpoint.to_owned()).or_default().insert(region, m.clone());
        Ok(m)
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &str {
        "shm"
    }

    fn capabilities(&self, _endpoint: &str) -> Capabilities {
        Capabilities { maps_peer_memory: true, sums_in_flight: true, moves_device_memory: false }
    }

    fn stats(&self) -> Option<&TransportStats> {
        Some(&self.stats)
    }

    fn map_region(&self, target: &RemoteRegion) -> Option<Result<MappedRegion>> {
        Some(self.mapping(&target.endpoint, target.region).map(|m| {
            let (ptr, len, writable) = (m.region.as_mut_ptr(), m.region.len(), m.region.peers_may_write());
            MappedRegion::new(m, ptr, len, writable)
        }))
    }

    fn can_reach(&self, endpoint: &str) -> bool {
        if !self.tcp.can_reach(endpoint) {
            return false;
        }
        if let Some(&same) = self.same_host.read().get(endpoint) {
            return same;
        }
        match handshake::hello(&self.tcp, endpoint) {
            Ok(h) => {
                let same = h == host_id();
                self.same_host.write().insert(endpoint.to_owned(), same);
                same
            }
            // A peer that could not answer now (down, busy, a broken connection) is
            // not known to be elsewhere: asked again next time, not judged for good.
            Err(_) => false,
        }
    }

    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
        requests
            .iter_mut()
            .map(|req| {
                let r = match self.mapping(&req.target.endpoint, req.target.region) {
                    Ok(m) => copy_with_region(&m.region, req).inspect(|_| {
                        let (counter, len) = match &req.op {
                            TransferOp::Read(dst) => (&self.stats.bytes_read, dst.len()),
                            TransferOp::Write(src) => (&self.stats.bytes_written, src.len()),
                        };
                        counter.fetch_add(len as u64, Ordering::Relaxed);
                    }),
                    // The region cannot be mapped (not shared, or /proc refused): TCP.
                    Err(TransferError::Unreachable(_)) | Err(TransferError::Protocol(_)) => {
                        self.tcp.transfer(std::slice::from_mut(req)).pop().unwrap_or(Ok(()))
                    }
                    Err(e) => Err(e),
                };
                if r.is_err() {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                }
                r
            })
            .collect()
    }
}
