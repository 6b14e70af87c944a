//! `StoreBuilder`: how a client is configured.

use std::sync::Arc;
use std::time::Duration;

use mooncake_alloc::AllocationStrategy;

use crate::config::{MasterConfig, Protocol, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::{Master, MasterApi};
use crate::rpc::RpcMasterClient;
use mooncake_transfer::{SharedSecret, TransferEngine, TransferError};

use super::Store;

/// Configures and builds a [`Store`]. Reads like a sentence:
///
/// ```
/// use mooncake_core::{ReplicateConfig, Store};
/// use mooncake_alloc::FreeRatioFirst;
///
/// let store = Store::builder()
///     .global_segment_size(64 << 20)
///     .allocation_strategy(FreeRatioFirst)
///     .default_replicate_config(ReplicateConfig::replicas(1))
///     .build()?;
/// store.put("block-0", &[7u8; 4096])?;
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone)]
pub struct StoreBuilder {
    pub(super) global_segment_size: u64,
    pub(super) master: Option<Master>,
    pub(super) master_address: Option<String>,
    pub(super) listen: Option<String>,
    pub(super) secret: Option<Vec<u8>>,
    pub(super) insecure: bool,
    pub(super) transports: Vec<Arc<dyn mooncake_transfer::Transport>>,
    pub(super) master_config: Option<MasterConfig>,
    pub(super) strategy: Option<Arc<dyn AllocationStrategy>>,
    pub(super) protocol: Protocol,
    pub(super) rdma_provider: Option<Arc<dyn mooncake_transfer::RdmaProvider>>,
    pub(super) replicate: ReplicateConfig,
    pub(super) ssd: Option<super::SsdOffloadConfig>,
    pub(super) replica_cache: usize,
    pub(super) master_timeout: Duration,
    pub(super) flush_timeout: Duration,
    pub(super) etcd_credentials: crate::cluster::EtcdCredentials,
    pub(super) page_lock_piece: u64,
    pub(super) phase_times: Option<bool>,
}

impl std::fmt::Debug for StoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreBuilder")
            .field("global_segment_size", &self.global_segment_size)
            .field("shared_master", &self.master.is_some())
            .field("protocol", &self.protocol)
            .field("replicate", &self.replicate)
            .field("ssd", &self.ssd)
            .finish()
    }
}

impl Default for StoreBuilder {
    fn default() -> Self {
        Self {
            global_segment_size: 256 << 20,
            master: None,
            master_address: None,
            listen: None,
            secret: None,
            insecure: false,
            transports: Vec::new(),
            master_config: None,
            strategy: None,
            protocol: Protocol::Local,
            rdma_provider: None,
            replicate: ReplicateConfig::default(),
            ssd: None,
            replica_cache: 1 << 16,
            master_timeout: Duration::from_secs(30),
            flush_timeout: Duration::from_secs(60),
            etcd_credentials: crate::cluster::EtcdCredentials::default(),
            page_lock_piece: super::device::DEFAULT_PIECE,
            phase_times: None,
        }
    }
}

impl StoreBuilder {
    /// Bytes of DRAM this client gives the pool (default 256 MiB; 0: none, the client
    /// only reads and writes other clients' segments). Pages are committed on first
    /// write.
    pub fn global_segment_size(mut self, bytes: u64) -> Self {
        self.global_segment_size = bytes;
        self
    }

    /// Joins an existing in-process master instead of starting an embedded one.
    pub fn master(mut self, master: &Master) -> Self {
        self.master = Some(master.clone());
        self
    }

    /// Talks to a master daemon at `addr` (`host:port`) instead of an embedded one, or
    /// to a cluster of masters found through etcd (`etcd://H:P[,H:P...]/NAME`, with the
    /// `etcd` feature): calls then go to the leader of each key's slot, and the memory
    /// given is cut into one extent per slot group. A client that gives memory must be reachable by the others: without
    /// [`listen`](Self::listen) it serves its segment on the address by which this
    /// host reaches the master, port chosen by the system.
    pub fn master_address(mut self, addr: &str) -> Self {
        self.master_address = Some(addr.to_owned());
        self
    }

    /// Cluster mode: how to authenticate to the cluster's etcd when it asks (user and
    /// password, TLS with a CA and optionally a client certificate). Default: none.
    pub fn etcd_credentials(mut self, credentials: crate::cluster::EtcdCredentials) -> Self {
        self.etcd_credentials = credentials;
        self
    }

    /// Serves this client's segment over TCP on `addr` (`host:port`, port 0 picks
    /// one), so that clients in other processes and on other hosts reach it.
    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = Some(addr.to_owned());
        self
    }

    /// Authenticates this client to the master daemon and to other clients'
    /// transfer endpoints (and requires it of peers reaching this client's segment).
    /// Every process of a deployment must use the same secret; an empty one is
    /// refused by [`build`](Self::build).
    pub fn shared_secret(mut self, secret: &[u8]) -> Self {
        self.secret = Some(secret.to_vec());
        self
    }

    /// Serve this client's segment (and SSD tier) to peers on any address without a
    /// shared secret. By default (protected mode) listeners without a secret serve
    /// loopback peers only.
    pub fn insecure(mut self, insecure: bool) -> Self {
        self.insecure = insecure;
        self
    }

    /// Adds a transport of your own (any [`Transport`](mooncake_transfer::Transport)),
    /// asked before the built-in ones for every peer it says it can reach.
    pub fn transport(mut self, transport: Arc<dyn mooncake_transfer::Transport>) -> Self {
        self.transports.push(transport);
        self
    }

    /// Configuration of the embedded master this builder starts (ignored with
    /// [`master`](Self::master), which is an error to combine it with).
    pub fn master_config(mut self, config: MasterConfig) -> Self {
        self.master_config = Some(config);
        self
    }

    /// Placement strategy of the embedded master (any [`AllocationStrategy`]).
    pub fn allocation_strategy(mut self, strategy: impl AllocationStrategy + 'static) -> Self {
        self.strategy = Some(Arc::new(strategy));
        self
    }

    /// How this client reaches other segments.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.protocol = protocol;
        self
    }

    /// The RDMA ports [`Protocol::Rdma`] and [`Protocol::Auto`] use (default: this
    /// host's devices through libibverbs, with the `rdma` feature).
    pub fn rdma_provider(mut self, provider: Arc<dyn mooncake_transfer::RdmaProvider>) -> Self {
        self.rdma_provider = Some(provider);
        self
    }

    /// Replication used by [`Store::put`] (default: one replica, no pin).
    pub fn default_replicate_config(mut self, cfg: ReplicateConfig) -> Self {
        self.replicate = cfg;
        self
    }

    /// Gives this client an SSD tier: objects of its segment are offloaded there (as
    /// the master's [`PersistPolicy`](crate::PersistPolicy) says), gets of objects
    /// only on disk load them back, and other clients load from it. Objects already
    /// in the directory are registered with the master at start.
    pub fn ssd_offload(mut self, config: super::SsdOffloadConfig) -> Self {
        self.ssd = Some(config);
        self
    }

    /// How many replica lists of recent gets this client keeps (default 65,536; 0:
    /// none), each for one lease period. A repeated get of a kept key goes straight
    /// to the replica, skipping the master. Reads through a kept list are checked
    /// against the object's checksum like every read: a list made stale by a remove
    /// or an eviction elsewhere is detected and the master asked again; until the
    /// memory is reused, such a get may still return the removed object's bytes.
    pub fn replica_cache(mut self, lists: usize) -> Self {
        self.replica_cache = lists;
        self
    }

    /// Longest wait for the master daemon's answer to one call before it fails with
    /// `Timeout` (default 30 s; only with [`master_address`](Self::master_address)).
    pub fn master_timeout(mut self, timeout: Duration) -> Self {
        self.master_timeout = timeout;
        self
    }

    /// Longest wait of [`Store::flush`] for the SSD tier (default 60 s).
    pub fn flush_timeout(mut self, timeout: Duration) -> Self {
        self.flush_timeout = timeout;
        self
    }

    /// Bytes of a mapped segment (this client's own, a same-host peer's) page-locked
    /// at a time for device copies (default 64 MiB; at least 1 MiB, a multiple of
    /// 4 KiB). A replica there moves to or from device memory by DMA straight from
    /// or into the segment once the pieces it lies in are page-locked: each piece
    /// the first time a device call moves a replica in it, that call waiting for it
    /// (page-locking takes time in proportion to the bytes, and the CUDA driver
    /// holds the process's other CUDA calls meanwhile). Smaller pieces: shorter
    /// first calls, more registrations with the driver; one DMA per piece a replica
    /// lies in. [`StoreStats::device_page_locked_bytes`](crate::StoreStats) says how
    /// much is locked.
    pub fn page_lock_piece(mut self, bytes: u64) -> Self {
        self.page_lock_piece = bytes;
        self
    }

    /// Whether to time every write and read call phase by phase
    /// ([`StoreStats::write_time`](crate::StoreStats::write_time) and
    /// [`read_time`](crate::StoreStats::read_time); left at zero when off). Off by
    /// default, unless `MOONCAKE_PHASE_TIMES=1`: the clock readings cost 20 ns each
    /// on a VM, 0.1 us of a 0.6 us cached `get_into` of 4 KiB.
    pub fn phase_times(mut self, on: bool) -> Self {
        self.phase_times = Some(on);
        self
    }

    /// Builds the client: joins (or starts) the master and mounts the segment.
    pub fn build(mut self) -> Result<Store> {
        self.replicate.check()?;
        if self.secret.as_ref().is_some_and(Vec::is_empty) {
            return Err(Error::InvalidArgument("the shared secret is empty".into()));
        }
        let external = self.master.is_some() || self.master_address.is_some();
        if external && (self.master_config.is_some() || self.strategy.is_some()) {
            return Err(Error::InvalidArgument(
                "master_config and allocation_strategy configure an embedded master; \
                 they cannot be combined with master(..) or master_address(..)"
                    .into(),
            ));
        }
        if self.master.is_some() && self.master_address.is_some() {
            return Err(Error::InvalidArgument("give master(..) or master_address(..), not both".into()));
        }
        if let Some(addr) = &self.master_address {
            // A cluster's masters are found through etcd: route as to its first endpoint.
            let route_to = match crate::cluster::EtcdAddress::is_etcd(addr) {
                true => addr.parse::<crate::cluster::EtcdAddress>()?.endpoints[0].clone(),
                false => {
                    check_address("master_address", addr)?;
                    addr.clone()
                }
            };
            if self.global_segment_size > 0 && self.listen.is_none() {
                // Other clients must reach this segment: serve it on the address by
                // which this host reaches the master (the route the master's peers
                // share), rather than in-process only.
                self.listen = Some(reachable_listen_address(&route_to).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "a client that gives memory (global_segment_size {}) to the master at {addr} must be \
                         reachable by the other clients, and no route to the master was found ({e}): set \
                         listen(\"HOST:PORT\") to an address they reach, or global_segment_size(0)",
                        self.global_segment_size
                    ))
                })?);
            }
        }
        if let Some(addr) = &self.listen {
            check_address("listen", addr)?;
        }
        if self.master_timeout.is_zero() || self.flush_timeout.is_zero() {
            return Err(Error::InvalidArgument("master_timeout and flush_timeout must be > 0".into()));
        }
        if self.page_lock_piece < 1 << 20 || !self.page_lock_piece.is_multiple_of(4096) {
            return Err(Error::InvalidArgument(format!(
                "page_lock_piece {} must be at least 1 MiB and a multiple of 4 KiB",
                self.page_lock_piece
            )));
        }
        if let Some(addr) = self.master_address.clone().filter(|a| crate::cluster::EtcdAddress::is_etcd(a)) {
            #[cfg(feature = "etcd")]
            {
                let engine = transfer_engine(&self)?;
                return Store::connect_cluster(self, &addr, engine);
            }
            #[cfg(not(feature = "etcd"))]
            return Err(Error::InvalidArgument(format!(
                "{addr} names a cluster of masters: build mooncake-core with the `etcd` feature"
            )));
        }
        let master: Arc<dyn MasterApi> = match (&self.master, &self.master_address) {
            (Some(m), _) => m.service().clone(),
            (None, Some(addr)) => Arc::new(
                RpcMasterClient::connect_with_timeout(
                    addr,
                    self.secret.as_deref().map(SharedSecret::new),
                    self.master_timeout,
                )?
                .announce_reconnects(),
            ),
            (None, None) => {
                let mut cfg = self.master_config.clone().unwrap_or_default();
                if let Some(s) = &self.strategy {
                    cfg.allocation_strategy = s.clone();
                }
                Master::new(cfg)?.service().clone()
            }
        };
        let engine = transfer_engine(&self)?;
        Store::connect(self, master, engine, Default::default())
    }
}

/// Checks that `addr` reads as `host:port` (the host may be a name, an IPv4 address
/// or a bracketed IPv6 address), so that a typo is an `InvalidArgument` at build
/// rather than an unreachable master later.
fn check_address(what: &str, addr: &str) -> Result<()> {
    let bad = |why: &str| {
        Err(Error::InvalidArgument(format!(
            "{what} {addr:?} is not an address: {why} (use host:port, e.g. 10.0.0.1:50051)"
        )))
    };
    let Some((host, port)) = addr.rsplit_once(':') else { return bad("no port") };
    if port.parse::<u16>().is_err() {
        return bad("the port is not a number from 0 to 65535");
    }
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return match v6.parse::<std::net::Ipv6Addr>() {
            Ok(_) => Ok(()),
            Err(_) => bad("bad IPv6 host"),
        };
    }
    if host.is_empty() || host.contains(|c: char| c.is_whitespace() || c == '/' || c == ':') {
        return bad("bad host (IPv6 addresses go in brackets: [::1]:50051)");
    }
    Ok(())
}

/// `IP:0` for the local address this host uses to reach `master` (found by a
/// connected UDP socket, which sends nothing).
fn reachable_listen_address(master: &str) -> std::io::Result<String> {
    let target = std::net::ToSocketAddrs::to_socket_addrs(master)?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "the name has no address"))?;
    let any = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let socket = std::net::UdpSocket::bind(any)?;
    socket.connect(target)?;
    Ok(std::net::SocketAddr::new(socket.local_addr()?.ip(), 0).to_string())
}

/// The RDMA ports of this client: the builder's provider, else this host's
/// devices (`rdma` feature); `NoDevice` when there are none.
fn rdma_provider(cfg: &StoreBuilder) -> std::result::Result<Arc<dyn mooncake_transfer::RdmaProvider>, TransferError> {
    if let Some(p) = &cfg.rdma_provider {
        return Ok(p.clone());
    }
    #[cfg(feature = "rdma")]
    {
        if mooncake_transfer::rdma_device_present() {
            return Ok(Arc::new(mooncake_transfer::VerbsRdma::open()?));
        }
        Err(TransferError::NoDevice("no RDMA device in /sys/class/infiniband".into()))
    }
    #[cfg(not(feature = "rdma"))]
    Err(TransferError::NoDevice("built without the `rdma` feature".into()))
}

/// The transfer engine for a client: which transports, and whether it listens.
///
/// `Local` alone for an embedded store; with a listener or a remote master the
/// network transports join (`Shm` for same-host peers, then `Tcp`), unless
/// `Protocol::Tcp` asks for TCP to every peer.
fn transfer_engine(cfg: &StoreBuilder) -> Result<TransferEngine> {
    let (listen, protocol, secret) = (cfg.listen.as_deref(), cfg.protocol, cfg.secret.as_deref());
    let remote_master = cfg.master_address.is_some();
    // Protocol::Rdma asks for RDMA even to same-host peers.
    let shm = !matches!(protocol, Protocol::Tcp | Protocol::Rdma);
    let mut b = TransferEngine::builder().shared_memory(shm).insecure(cfg.insecure);
    for t in &cfg.transports {
        b = b.transport_first(t.clone());
    }
    if let Some(s) = secret {
        b = b.shared_secret(s);
    }
    if protocol == Protocol::Tcp {
        let tcp = match secret {
            Some(s) => mooncake_transfer::TcpTransport::with_secret(SharedSecret::new(s)),
            None => mooncake_transfer::TcpTransport::new(),
        };
        b = b.transport(std::sync::Arc::new(tcp));
    }
    match (protocol, rdma_provider(cfg)) {
        (Protocol::Rdma | Protocol::Auto, Ok(provider)) => {
            b = b.rdma(provider, mooncake_transfer::RdmaConfig::default()).network();
        }
        (Protocol::Rdma, Err(e)) => return Err(e.into()),
        (Protocol::Auto, Err(_)) => b = b.network(),
        _ => {}
    }
    if let Some(addr) = listen {
        b = b.tcp_listen(addr);
    } else if remote_master || protocol != Protocol::Local {
        b = b.network();
    } else {
        b = b.shared_memory(false);
    }
    Ok(b.build()?)
}
