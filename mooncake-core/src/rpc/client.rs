//! `RpcMasterClient`: the [`MasterApi`] of a master daemon, over TCP.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use mooncake_alloc::SegmentId;
use mooncake_transfer::{RemoteRegion, SharedSecret};
use parking_lot::Mutex;

use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{
    ClientId, ClientRegistration, MasterApi, MasterStats, MemoryReplica, ObjectInfo, ObjectRecord, OffloadPlan,
    RecordUpdate, ReplicaList, ReplicatePlan, SegmentInfo,
};

use super::wire::{encode_frame, FrameHeader, FrameKind, Request, Response, WireResult, DEFAULT_MAX_FRAME, HEADER_LEN};

/// A client of a master daemon. Connections are pooled: concurrent calls use
/// separate connections; a broken connection is dropped and the call retried once on
/// a fresh one (so a restarted master is picked up).
pub struct RpcMasterClient {
    addr: String,
    pool: Mutex<Vec<TcpStream>>,
    next_id: AtomicU64,
    timeout: Duration,
    secret: Option<SharedSecret>,
}

impl std::fmt::Debug for RpcMasterClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcMasterClient").field("addr", &self.addr).finish()
    }
}

impl RpcMasterClient {
    /// Connects to the master at `addr` (`host:port`); fails with
    /// `MasterUnavailable` if it cannot be reached.
    pub fn connect(addr: &str) -> Result<Self> {
        Self::connect_with(addr, None)
    }

    /// [`connect`](Self::connect), proving `secret` on every connection.
    pub fn connect_with(addr: &str, secret: Option<SharedSecret>) -> Result<Self> {
        Self::connect_with_timeout(addr, secret, Duration::from_secs(30))
    }

    /// [`connect_with`](Self::connect_with) where a call fails with `Timeout` when the
    /// master does not answer within `timeout`.
    pub fn connect_with_timeout(addr: &str, secret: Option<SharedSecret>, timeout: Duration) -> Result<Self> {
        let client =
            Self { addr: addr.to_owned(), pool: Mutex::new(Vec::new()), next_id: AtomicU64::new(1), timeout, secret };
        let conn = client.dial()?;
        client.pool.lock().push(conn);
        Ok(client)
    }

    fn dial(&self) -> Result<TcpStream> {
        let unavailable = |e: std::io::Error| Error::MasterUnavailable(format!("{}: {e}", self.addr));
        let addrs: Vec<_> = self.addr.to_socket_addrs().map_err(unavailable)?.collect();
        let mut last = Error::MasterUnavailable(format!("{}: no address", self.addr));
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(self.timeout));
                    if let Some(secret) = &self.secret {
                        let mut c = &s;
                        secret.respond(&mut c).map_err(|e| {
                            Error::MasterUnavailable(format!("{}: authentication failed: {e}", self.addr))
                        })?;
                    }
                    return Ok(s);
                }
                Err(e) => last = unavailable(e),
            }
        }
        Err(last)
    }

    fn round_trip(&self, conn: &mut TcpStream, frame: &[u8], id: u64) -> std::io::Result<Response> {
        conn.write_all(frame)?;
        // Read with the socket's own errors, so that a timeout stays a timeout.
        let mut header = [0u8; HEADER_LEN];
        conn.read_exact(&mut header)?;
        let h = FrameHeader::decode(&header, DEFAULT_MAX_FRAME)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        let mut body = vec![0u8; h.body_len as usize];
        conn.read_exact(&mut body)?;
        if h.kind != FrameKind::Response || h.request_id != id {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "response does not match the request"));
        }
        super::wire::decode_body(&body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Sends `req` and returns the master's response.
    pub fn call(&self, req: &Request) -> Result<Response> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode_frame(FrameKind::Request, id, req).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        for attempt in 0..2 {
            let mut conn = match self.pool.lock().pop() {
                Some(c) => c,
                None => self.dial()?,
            };
            match self.round_trip(&mut conn, &frame, id) {
                Ok(resp) => {
                    self.pool.lock().push(conn);
                    return Ok(resp);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock || e.kind() == std::io::ErrorKind::TimedOut => {
                    return Err(Error::Timeout(format!("master {} did not answer: {e}", self.addr)));
                }
                Err(e) if attempt == 0 => {
                    tracing::debug!(error = %e, "master connection broken; retrying on a new one");
                    // Every pooled connection may be stale (the master restarted).
                    self.pool.lock().clear();
                }
                Err(e) => return Err(Error::MasterUnavailable(format!("{}: {e}", self.addr))),
            }
        }
        Err(Error::MasterUnavailable(self.addr.clone()))
    }
}

/// The error a response that is not the expected one stands for.
fn unexpected(r: Response) -> Error {
    match r {
        Response::Error(e) => e.into(),
        other => Error::MasterUnavailable(format!("unexpected response {other:?}")),
    }
}

fn batch<T>(
    n: usize,
    r: Result<Response>,
    pick: impl FnOnce(Response) -> Result<Vec<WireResult<T>>>,
) -> Vec<Result<T>> {
    let fail = |e: Error| (0..n).map(|_| Err(e.clone())).collect();
    match r.map(pick) {
        Ok(Ok(v)) if v.len() == n => v.into_iter().map(|r| r.map_err(Error::from)).collect(),
        Ok(Ok(_)) => fail(Error::MasterUnavailable("batch answer of the wrong length".into())),
        Ok(Err(e)) => fail(e),
        Err(e) => fail(e),
    }
}

fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}

macro_rules! expect {
    ($self:ident, $req:expr, $pat:pat => $out:expr) => {
        match $self.call(&$req)? {
            $pat => Ok($out),
            other => Err(unexpected(other)),
        }
    };
}

impl MasterApi for RpcMasterClient {
    fn register_client(&self) -> Result<ClientRegistration> {
        expect!(self, Request::RegisterClient, Response::Registered(r) => r)
    }
    fn heartbeat(&self, client: ClientId) -> Result<Vec<RecordUpdate>> {
        expect!(self, Request::Heartbeat { client }, Response::Updates(u) => u)
    }
    fn mount_segment(&self, client: ClientId, region: RemoteRegion, capacity: u64) -> Result<SegmentId> {
        let req = Request::MountSegment { client, endpoint: region.endpoint, region: region.region, capacity };
        expect!(self, req, Response::Segment(s) => s)
    }
    fn remount_segment(
        &self,
        client: ClientId,
        region: RemoteRegion,
        capacity: u64,
        records: Vec<ObjectRecord>,
    ) -> Result<(SegmentId, usize)> {
        let req =
            Request::RemountSegment { client, endpoint: region.endpoint, region: region.region, capacity, records };
        expect!(self, req, Response::Remounted { segment, taken } => (segment, taken as usize))
    }
    fn unmount_segment(&self, client: ClientId, segment: SegmentId) -> Result<usize> {
        expect!(self, Request::UnmountSegment { client, segment }, Response::Count(n) => n as usize)
    }
    fn unregister_client(&self, client: ClientId) -> Result<usize> {
        expect!(self, Request::UnregisterClient { client }, Response::Count(n) => n as usize)
    }
    fn segment_info(&self, segment: SegmentId) -> Result<SegmentInfo> {
        expect!(self, Request::SegmentInfo { segment }, Response::SegmentInfo(s) => s.into())
    }
    fn put_start(&self, client: ClientId, key: &str, len: u64, cfg: &ReplicateConfig) -> Result<Vec<MemoryReplica>> {
        let req = Request::PutStart { client, key: key.to_owned(), len, cfg: cfg.clone() };
        expect!(self, req, Response::Replicas(r) => r)
    }
    fn put_end(&self, client: ClientId, key: &str, checksum: u32) -> Result<()> {
        expect!(self, Request::PutEnd { client, key: key.to_owned(), checksum }, Response::Unit => ())
    }
    fn put_revoke(&self, client: ClientId, key: &str) -> Result<()> {
        expect!(self, Request::PutRevoke { client, key: key.to_owned() }, Response::Unit => ())
    }
    fn get_replica_list(&self, key: &str) -> Result<ReplicaList> {
        expect!(self, Request::GetReplicaList { key: key.to_owned() }, Response::ReplicaList(l) => l)
    }
    fn exists(&self, key: &str) -> Result<bool> {
        expect!(self, Request::Exists { key: key.to_owned() }, Response::Bool(b) => b)
    }
    fn remove(&self, key: &str) -> Result<()> {
        expect!(self, Request::Remove { key: key.to_owned() }, Response::Unit => ())
    }
    fn remove_all(&self) -> Result<usize> {
        expect!(self, Request::RemoveAll, Response::Count(n) => n as usize)
    }
    fn replicate_start(&self, client: ClientId, key: &str, cfg: &ReplicateConfig) -> Result<ReplicatePlan> {
        let req = Request::ReplicateStart { client, key: key.to_owned(), cfg: cfg.clone() };
        expect!(self, req, Response::Plan(p) => p)
    }
    fn replicate_end(&self, key: &str, targets: &[MemoryReplica], ok: bool) -> Result<()> {
        let req = Request::ReplicateEnd { key: key.to_owned(), targets: targets.to_vec(), ok };
        expect!(self, req, Response::Unit => ())
    }
    fn batch_put_start(
        &self,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        let req = Request::BatchPutStart {
            client,
            items: items.iter().map(|(k, l)| ((*k).to_owned(), *l)).collect(),
            cfg: cfg.clone(),
        };
        batch(items.len(), self.call(&req), |r| match r {
            Response::BatchReplicas(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn batch_put_end(&self, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        let req = Request::BatchPutEnd { client, items: items.iter().map(|(k, c)| ((*k).to_owned(), *c)).collect() };
        batch(items.len(), self.call(&req), |r| match r {
            Response::BatchUnit(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn batch_put_revoke(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        if keys.is_empty() {
            return Vec::new();
        }
        batch(keys.len(), self.call(&Request::BatchPutRevoke { client, keys: owned(keys) }), |r| match r {
            Response::BatchUnit(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn batch_get_replica_list(&self, keys: &[&str]) -> Vec<Result<ReplicaList>> {
        batch(keys.len(), self.call(&Request::BatchGetReplicaList { keys: owned(keys) }), |r| match r {
            Response::BatchReplicaLists(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        batch(keys.len(), self.call(&Request::BatchExists { keys: owned(keys) }), |r| match r {
            Response::BatchBool(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn batch_remove(&self, keys: &[&str]) -> Vec<Result<()>> {
        batch(keys.len(), self.call(&Request::BatchRemove { keys: owned(keys) }), |r| match r {
            Response::BatchUnit(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn report_ssd_capacity(&self, client: ClientId, capacity: i64) -> Result<()> {
        expect!(self, Request::ReportSsdCapacity { client, capacity }, Response::Unit => ())
    }
    fn notify_offload_success(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>> {
        let req = Request::NotifyOffloadSuccess {
            client,
            items: items.iter().map(|(k, l, c)| ((*k).to_owned(), *l, *c)).collect(),
        };
        batch(items.len(), self.call(&req), |r| match r {
            Response::BatchUnit(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn batch_evict_disk_replica(&self, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        batch(keys.len(), self.call(&Request::BatchEvictDiskReplica { client, keys: owned(keys) }), |r| match r {
            Response::BatchUnit(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn mount_ssd(&self, client: ClientId, capacity: i64, endpoint: &str) -> Result<()> {
        expect!(self, Request::MountSsd { client, capacity, endpoint: endpoint.to_owned() }, Response::Unit => ())
    }
    fn disk_endpoint(&self, client: ClientId) -> Result<String> {
        expect!(self, Request::DiskEndpoint { client }, Response::Endpoint(e) => e)
    }
    fn offload_heartbeat(&self, client: ClientId, max: usize) -> Result<OffloadPlan> {
        let max = u32::try_from(max).unwrap_or(u32::MAX);
        expect!(self, Request::OffloadHeartbeat { client, max }, Response::OffloadPlan(p) => p)
    }
    fn register_disk_objects(&self, client: ClientId, items: &[(&str, u64, u32)]) -> Vec<Result<()>> {
        let req = Request::RegisterDiskObjects {
            client,
            items: items.iter().map(|(k, l, c)| ((*k).to_owned(), *l, *c)).collect(),
        };
        batch(items.len(), self.call(&req), |r| match r {
            Response::BatchUnit(v) => Ok(v),
            other => Err(unexpected(other)),
        })
    }
    fn object_info(&self, key: &str) -> Result<ObjectInfo> {
        expect!(self, Request::ObjectInfo { key: key.to_owned() }, Response::ObjectInfo(i) => i)
    }
    fn list_keys(&self, limit: usize) -> Result<Vec<String>> {
        expect!(self, Request::ListKeys { limit: limit as u64 }, Response::Keys(k) => k)
    }
    fn stats(&self) -> Result<MasterStats> {
        expect!(self, Request::Stats, Response::Stats(s) => s)
    }
}
