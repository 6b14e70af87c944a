//! The `TransferEngine`: registered regions plus the transports that reach peers.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::auth::SharedSecret;
use crate::error::{Result, TransferError};
use crate::handshake::{host_id, ControlResponder};
use crate::rdma::{RdmaConfig, RdmaProvider, RdmaResponder, RdmaTransport};
use crate::region::{RegionId, RegisteredRegion, RemoteRegion};
use crate::registry::{self, RegionRegistry};
use crate::transport::{
    Capabilities, LocalTransport, MappedRegion, ServeLimits, ShmTransport, TcpServer, TcpTransport, TransferRequest,
    TransferStats, Transport, LOCAL_SCHEME,
};

static NEXT_LOCAL_ENGINE: AtomicU64 = AtomicU64::new(1);

/// Builds a [`TransferEngine`].
#[derive(Default)]
pub struct TransferEngineBuilder {
    transports: Vec<Arc<dyn Transport>>,
    first: Vec<Arc<dyn Transport>>,
    listen: Option<std::io::Result<Vec<std::net::SocketAddr>>>,
    advertise_host: Option<String>,
    network: bool,
    shared_memory: bool,
    secret: Option<SharedSecret>,
    empty_secret: bool,
    insecure: bool,
    rdma: Option<(Arc<dyn RdmaProvider>, RdmaConfig)>,
}

impl std::fmt::Debug for TransferEngineBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.transports.iter().map(|t| t.name()).collect();
        f.debug_struct("TransferEngineBuilder").field("transports", &names).finish()
    }
}

impl TransferEngineBuilder {
    /// Adds a transport. Transports are asked in the order added; the first that can
    /// reach a target serves it. With none added, the engine uses [`LocalTransport`].
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> Self {
        self.transports.push(transport);
        self
    }

    /// Adds a transport asked before the default ones, which stay (unlike
    /// [`transport`](Self::transport), which replaces the defaults).
    pub fn transport_first(mut self, transport: Arc<dyn Transport>) -> Self {
        self.first.push(transport);
        self
    }

    /// Serves this engine's regions over TCP on `addr` (a `SocketAddr`, or a
    /// `"host:port"` string; port 0 picks one). The endpoint becomes the bound
    /// `host:port` (see [`advertise_host`](Self::advertise_host)). Implies
    /// [`network`](Self::network). Connections are served by one thread each.
    pub fn tcp_listen(mut self, addr: impl std::net::ToSocketAddrs) -> Self {
        self.listen = Some(addr.to_socket_addrs().map(Iterator::collect));
        self.network = true;
        self
    }

    /// The host peers should dial (default: the listener's address), for listeners
    /// bound to a wildcard address.
    pub fn advertise_host(mut self, host: &str) -> Self {
        self.advertise_host = Some(host.to_owned());
        self
    }

    /// Reach peers over the network: adds the `Shm` (if
    /// [`shared_memory`](Self::shared_memory)) and `Tcp` transports after `Local`,
    /// unless transports were given explicitly.
    pub fn network(mut self) -> Self {
        self.network = true;
        self
    }

    /// Back regions with memfds that same-host peers map, and prefer the `Shm`
    /// transport for same-host peers.
    pub fn shared_memory(mut self, on: bool) -> Self {
        self.shared_memory = on;
        self
    }

    /// Require peers to prove `secret` (and prove it to them): connections without
    /// it are refused by this engine's listener, and its transports answer peers'
    /// challenges. An empty secret is refused by [`build`](Self::build).
    pub fn shared_secret(mut self, secret: &[u8]) -> Self {
        self.empty_secret = secret.is_empty();
        self.secret = Some(SharedSecret::new(secret));
        self
    }

    /// Serve peers on any address without a shared secret. By default (protected
    /// mode) a listener without a secret serves loopback peers only.
    pub fn insecure(mut self, insecure: bool) -> Self {
        self.insecure = insecure;
        self
    }

    /// Reach and serve peers with one-sided RDMA on every port of `provider`: the
    /// listener answers peers' RDMA handshakes, and (with the default transports)
    /// the `Rdma` transport comes before `Tcp`, which serves the peers whose RDMA
    /// setup fails. Building fails with [`TransferError::NoDevice`] if the
    /// provider has no port.
    pub fn rdma(mut self, provider: Arc<dyn RdmaProvider>, config: RdmaConfig) -> Self {
        self.rdma = Some((provider, config));
        self
    }

    /// Builds the engine: binds the listener if asked, and makes the engine reachable
    /// by in-process peers.
    pub fn build(self) -> Result<TransferEngine> {
        if self.empty_secret {
            return Err(TransferError::Auth("the shared secret is empty".into()));
        }
        let nics = match &self.rdma {
            Some((provider, _)) => Some(Arc::new(crate::rdma::open_nics(provider.as_ref())?)),
            None => None,
        };
        let mut transports = self.transports;
        let mut rdma = None;
        if transports.is_empty() {
            transports.push(Arc::new(LocalTransport));
            if self.network {
                let (shm, tcp) = match &self.secret {
                    Some(s) => (ShmTransport::with_secret(s.clone()), TcpTransport::with_secret(s.clone())),
                    None => (ShmTransport::new(), TcpTransport::new()),
                };
                if self.shared_memory {
                    transports.push(Arc::new(shm));
                }
                if let (Some(nics), Some((_, config))) = (&nics, &self.rdma) {
                    let tcp = match &self.secret {
                        Some(s) => TcpTransport::with_secret(s.clone()),
                        None => TcpTransport::new(),
                    };
                    let t = Arc::new(RdmaTransport::on(nics.clone(), config.clone(), tcp));
                    rdma = Some(t.clone());
                    transports.push(t);
                }
                transports.push(Arc::new(tcp));
            }
        }
        let transports = {
            let mut all = self.first;
            all.extend(transports);
            all
        };
        let listener = match self.listen {
            Some(Ok(addrs)) => Some(
                std::net::TcpListener::bind(&addrs[..])
                    .map_err(|e| TransferError::Registration(format!("cannot listen on {addrs:?}: {e}")))?,
            ),
            Some(Err(e)) => return Err(TransferError::Registration(format!("bad listen address: {e}"))),
            None => None,
        };
        let endpoint = match &listener {
            Some(l) => {
                let bound = l.local_addr().map_err(|e| TransferError::Io(e.to_string()))?;
                let host = self.advertise_host.clone().unwrap_or_else(|| bound.ip().to_string());
                if host.contains(':') {
                    format!("[{host}]:{}", bound.port())
                } else {
                    format!("{host}:{}", bound.port())
                }
            }
            None => {
                let n = NEXT_LOCAL_ENGINE.fetch_add(1, Ordering::Relaxed);
                format!("{LOCAL_SCHEME}{}/{n}", std::process::id())
            }
        };
        // The listener proves the secret for its socket address and for the endpoint
        // peers are told (an advertised host may be reached through a translation).
        let names = vec![endpoint.clone()];
        let regions = Arc::new(RegionRegistry::new(endpoint, self.shared_memory));
        registry::publish(&regions);
        let responder = nics.map(|nics| Arc::new(RdmaResponder::new(nics)));
        if let Some(r) = &responder {
            let weak = Arc::downgrade(r);
            regions.on_unregister(Box::new(move |id| {
                if let Some(r) = weak.upgrade() {
                    r.forget_region(id);
                }
            }));
        }
        let responder = responder.map(|r| r as Arc<dyn ControlResponder>);
        let server = match listener {
            Some(l) => Some(TcpServer::start(
                l,
                Arc::downgrade(&regions),
                host_id().to_owned(),
                self.secret.clone(),
                self.insecure,
                responder,
                names,
                ServeLimits::default(),
            )?),
            None => None,
        };
        Ok(TransferEngine { regions, transports, rdma, _server: server })
    }
}

/// Owns this endpoint's registered regions and moves bytes to and from peers'
/// regions through its transports.
///
/// ```
/// use mooncake_transfer::TransferEngine;
///
/// let server = TransferEngine::new();
/// let segment = server.register_region(1 << 20)?;
/// let client = TransferEngine::new();
/// let target = server.remote(segment.id());
/// client.write(&target, 128, b"kv block")?;
/// let mut back = [0u8; 8];
/// client.read(&target, 128, &mut back)?;
/// assert_eq!(&back, b"kv block");
/// // Requests outside the registered bytes are refused.
/// assert!(client.read(&target, (1 << 20) - 4, &mut back).is_err());
/// # Ok::<(), mooncake_transfer::TransferError>(())
/// ```
pub struct TransferEngine {
    regions: Arc<RegionRegistry>,
    transports: Vec<Arc<dyn Transport>>,
    /// The `Rdma` transport among `transports`, if the builder made one.
    rdma: Option<Arc<RdmaTransport>>,
    _server: Option<TcpServer>,
}

impl std::fmt::Debug for TransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferEngine")
            .field("endpoint", &self.regions.endpoint())
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl Drop for TransferEngine {
    fn drop(&mut self) {
        // Stop serving now, even if a connection thread still holds the shared part
        // for a moment: in-process peers lose the endpoint, regions are forgotten
        // (later requests fail), and same-host peers' mappings go stale.
        registry::withdraw(self.regions.endpoint());
        self.regions.clear();
    }
}

impl Default for TransferEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl TransferEngine {
    /// An engine with the [`LocalTransport`] only.
    pub fn new() -> Self {
        Self::builder().build().expect("an in-process engine needs no resources that can fail")
    }

    /// A builder to choose transports.
    pub fn builder() -> TransferEngineBuilder {
        TransferEngineBuilder::default()
    }

    /// This engine's endpoint, as peers name it.
    pub fn endpoint(&self) -> &str {
        self.regions.endpoint()
    }

    /// Registers `len` bytes of fresh zeroed memory that peers may read and write.
    pub fn register_region(&self, len: u64) -> Result<Arc<RegisteredRegion>> {
        self.regions.register(len, true)
    }

    /// Registers `len` bytes of fresh zeroed memory that peers may read but never
    /// write: memory this process fills itself (through
    /// [`as_mut_ptr`](RegisteredRegion::as_mut_ptr)) and only hands out, such as
    /// an SSD tier's staging buffer. Every transport refuses a peer's write with
    /// [`TransferError::ReadOnly`] before touching a byte: TCP answers it so, RDMA
    /// registers the region without remote write access, and same-host peers can
    /// map it read-only only (its memfd is sealed against writes from their
    /// mappings; on a kernel without that seal, before Linux 5.1, they reach it
    /// over TCP).
    pub fn register_read_only_region(&self, len: u64) -> Result<Arc<RegisteredRegion>> {
        self.regions.register(len, false)
    }

    /// Stops serving region `id`; returns whether it was registered. Requests already
    /// running finish on the memory they hold; later ones fail with `UnknownRegion`
    /// (same-host peers that mapped the region drop their mapping).
    pub fn unregister_region(&self, id: RegionId) -> bool {
        self.regions.unregister(id)
    }

    /// The registered region `id` of this engine.
    pub fn region(&self, id: RegionId) -> Result<Arc<RegisteredRegion>> {
        self.regions.region(id)
    }

    /// How peers name region `id` of this engine.
    pub fn remote(&self, id: RegionId) -> RemoteRegion {
        RemoteRegion { endpoint: self.regions.endpoint().to_owned(), region: id }
    }

    /// The `Rdma` transport this engine made (with
    /// [`TransferEngineBuilder::rdma`] and the default transports), for what only
    /// it does: moving device memory with
    /// [`transfer_device`](RdmaTransport::transfer_device).
    pub fn rdma(&self) -> Option<&Arc<RdmaTransport>> {
        self.rdma.as_ref()
    }

    /// Names of this engine's transports, in the order they are asked.
    pub fn transport_names(&self) -> Vec<&str> {
        self.transports.iter().map(|t| t.name()).collect()
    }

    /// Name of the transport that serves `endpoint` (`local`, `shm`, `tcp`, …).
    pub fn transport_name(&self, endpoint: &str) -> Option<&str> {
        self.transport_for(endpoint).map(|t| t.name())
    }

    /// What the transport that serves `endpoint` can do (see [`Capabilities`]);
    /// `None` if no transport of this engine reaches it.
    pub fn capabilities(&self, endpoint: &str) -> Option<Capabilities> {
        self.transport_for(endpoint).map(|t| t.capabilities(endpoint))
    }

    /// `target` mapped into this process by the transport that reaches it, if that
    /// transport maps peers' memory (see [`Transport::map_region`]).
    pub fn map_region(&self, target: &RemoteRegion) -> Option<Result<MappedRegion>> {
        self.transport_for(&target.endpoint)?.map_region(target)
    }

    fn transport_for(&self, endpoint: &str) -> Option<&Arc<dyn Transport>> {
        self.transports.iter().find(|t| t.can_reach(endpoint))
    }

    fn transport_index(&self, endpoint: &str) -> Option<usize> {
        self.transports.iter().position(|t| t.can_reach(endpoint))
    }

    /// Counters of the transports that keep them (`shm`, `tcp`), in the order they
    /// are asked: which transport moved how many bytes.
    pub fn stats(&self) -> Vec<TransferStats> {
        self.transports.iter().filter_map(|t| t.stats().map(|s| s.snapshot(t.name()))).collect()
    }

    /// Executes a batch, blocking until every request is done; one result per request.
    ///
    /// Requests are grouped by the transport that reaches their target, so a
    /// transport sees its whole share of the batch at once (and may pipeline it).
    pub fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<Result<()>> {
        // Which transport serves each request (asked once per distinct endpoint).
        let mut seen: Vec<(&str, Option<usize>)> = Vec::new();
        let mut route = Vec::with_capacity(requests.len());
        for req in requests.iter() {
            let endpoint = req.target.endpoint.as_str();
            let t = match seen.iter().find(|(e, _)| *e == endpoint) {
                Some(&(_, t)) => t,
                None => {
                    let t = self.transport_index(endpoint);
                    seen.push((endpoint, t));
                    t
                }
            };
            route.push(t);
        }
        // Fast path: one transport serves everything (the common case).
        if let Some(Some(t)) = route.first() {
            if route.iter().all(|r| *r == Some(*t)) {
                return self.transports[*t].transfer(requests);
            }
        }
        let mut results: Vec<Result<()>> =
            requests.iter().map(|r| Err(TransferError::Unreachable(r.target.endpoint.clone()))).collect();
        for (t, transport) in self.transports.iter().enumerate() {
            let mine: Vec<usize> = (0..requests.len()).filter(|&i| route[i] == Some(t)).collect();
            if mine.is_empty() {
                continue;
            }
            // Move this transport's requests into one batch (leaving empty requests in
            // their place), run it, and put them back.
            let mut batch: Vec<TransferRequest<'_>> = mine
                .iter()
                .map(|&i| {
                    let target = requests[i].target;
                    let empty = TransferRequest::write(target, 0, &[]);
                    std::mem::replace(&mut requests[i], empty)
                })
                .collect();
            let out = transport.transfer(&mut batch);
            for (&i, req) in mine.iter().zip(batch) {
                requests[i] = req;
            }
            for (&i, r) in mine.iter().zip(out) {
                results[i] = r;
            }
        }
        results
    }

    /// Reads `dst.len()` bytes of `target` at `offset`.
    pub fn read(&self, target: &RemoteRegion, offset: u64, dst: &mut [u8]) -> Result<()> {
        self.single(TransferRequest::read(target, offset, dst))
    }

    /// Writes `src` into `target` at `offset`.
    pub fn write(&self, target: &RemoteRegion, offset: u64, src: &[u8]) -> Result<()> {
        self.single(TransferRequest::write(target, offset, src))
    }

    fn single(&self, req: TransferRequest<'_>) -> Result<()> {
        let mut reqs = [req];
        self.transfer(&mut reqs)
            .pop()
            .unwrap_or_else(|| Err(TransferError::Unreachable(reqs[0].target.endpoint.clone())))
    }
}
