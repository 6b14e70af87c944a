//! `MasterDaemon`: a master served over TCP, as the `mooncake-master` binary runs
//! it, for programs that run their own (with their own allocation strategy).

use std::net::SocketAddr;
use std::sync::Arc;

use mooncake_alloc::AllocationStrategy;
use mooncake_transfer::SharedSecret;

use crate::config::MasterConfig;
use crate::error::Result;
use crate::master::Master;
use crate::rpc::{RpcRecordConnector, RpcServer, RpcServerConfig, RpcServerStats};

/// A master serving clients in other processes over TCP. It serves until dropped.
///
/// Built with [`MasterDaemon::builder`], whose defaults are those of a served
/// master: [`MasterConfig::served`] (segment owners are told which objects they
/// hold, so that they can repopulate a restarted master).
///
/// ```
/// use mooncake_core::{MasterDaemon, Store};
/// use mooncake_core::alloc::FreeRatioFirst;
///
/// let daemon = MasterDaemon::builder("127.0.0.1:0").allocation_strategy(FreeRatioFirst).serve()?;
/// let addr = daemon.local_addr().to_string();
/// let store = Store::builder().master_address(&addr).global_segment_size(4 << 20).build()?;
/// store.put("k", b"v")?;
/// assert_eq!(daemon.master().stats().allocation_strategy, "free_ratio_first");
/// # Ok::<(), mooncake_core::Error>(())
/// ```
pub struct MasterDaemon {
    master: Master,
    server: RpcServer,
    /// Cluster mode: the master's membership (dropped first: it leaves the cluster).
    #[cfg(feature = "etcd")]
    ownership: Option<Arc<crate::cluster::leadership::MemberOwnership>>,
}

impl std::fmt::Debug for MasterDaemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterDaemon").field("addr", &self.server.local_addr()).finish()
    }
}

impl MasterDaemon {
    /// A daemon that will listen on `listen` (`host:port`, port 0 picks one).
    pub fn builder(listen: &str) -> MasterDaemonBuilder {
        MasterDaemonBuilder {
            listen: listen.to_owned(),
            config: MasterConfig::served(),
            rpc: RpcServerConfig::default(),
            #[cfg(feature = "etcd")]
            cluster: None,
        }
    }

    /// Cluster mode: the membership's counters (None for a single master).
    #[cfg(feature = "etcd")]
    pub fn cluster_stats(&self) -> Option<crate::cluster::MemberStats> {
        self.ownership.as_ref().and_then(|o| o.member()).map(|m| m.stats())
    }

    /// Cluster mode: the slot map as this master knows it.
    #[cfg(feature = "etcd")]
    pub fn slot_map(&self) -> Option<Arc<crate::cluster::SlotMap>> {
        self.ownership.as_ref().and_then(|o| o.member()).map(|m| m.slot_map())
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// The master service (stats, and every call in process).
    pub fn master(&self) -> &Master {
        &self.master
    }

    /// Counters of the RPC server (for metrics).
    pub fn rpc_stats(&self) -> &Arc<RpcServerStats> {
        self.server.stats()
    }
}

/// Configures a [`MasterDaemon`].
#[derive(Clone, Debug)]
pub struct MasterDaemonBuilder {
    listen: String,
    config: MasterConfig,
    rpc: RpcServerConfig,
    #[cfg(feature = "etcd")]
    cluster: Option<crate::cluster::MemberConfig>,
}

impl MasterDaemonBuilder {
    /// The master's configuration (default [`MasterConfig::served`]; start from it
    /// to keep the served defaults: `MasterConfig { .., ..MasterConfig::served() }`).
    pub fn config(mut self, config: MasterConfig) -> Self {
        self.config = config;
        self
    }

    /// Placement strategy (any [`AllocationStrategy`], yours included).
    pub fn allocation_strategy(mut self, strategy: impl AllocationStrategy + 'static) -> Self {
        self.config.allocation_strategy = Arc::new(strategy);
        self
    }

    /// Requires every client to prove this secret (clients set the same one with
    /// `StoreBuilder::shared_secret`).
    pub fn shared_secret(mut self, secret: &[u8]) -> Self {
        self.rpc.secret = Some(SharedSecret::new(secret));
        self
    }

    /// Largest request body accepted, in bytes (default the wire's default).
    pub fn max_frame(mut self, bytes: u32) -> Self {
        self.rpc.max_frame = bytes;
        self
    }

    /// Serves clients on any address without a secret. Off by default (protected
    /// mode): without a secret only loopback clients are served.
    pub fn insecure(mut self, insecure: bool) -> Self {
        self.rpc.insecure = insecure;
        self
    }

    /// The RPC server's limits and access rules (connection cap, memory budget,
    /// hello timeout, workers); replaces what `shared_secret`, `max_frame` and
    /// `insecure` set.
    pub fn rpc_config(mut self, rpc: RpcServerConfig) -> Self {
        self.rpc = rpc;
        self
    }

    /// Cluster mode: joins the cluster `member` names (its etcd endpoints and cluster
    /// name; `advertise` empty: the address served) and answers only for the slot
    /// groups it is given.
    #[cfg(feature = "etcd")]
    pub fn cluster(mut self, member: crate::cluster::MemberConfig) -> Self {
        self.cluster = Some(member);
        self
    }

    /// Starts the master and serves it on background threads.
    pub fn serve(self) -> Result<MasterDaemon> {
        #[cfg(feature = "etcd")]
        let rpc = {
            let mut rpc = self.rpc;
            // Clients dial the address published in etcd: the master proves the secret
            // for it too (it may reach this host through an address translation).
            if let Some(member) = self.cluster.as_ref().filter(|m| !m.advertise.is_empty()) {
                if !rpc.names.contains(&member.advertise) {
                    rpc.names.push(member.advertise.clone());
                }
            }
            rpc
        };
        #[cfg(not(feature = "etcd"))]
        let rpc = self.rpc;
        let master = Master::new(self.config)?;
        // Puts and removes are acknowledged once the storage nodes recorded them.
        let timeout = master.config().record_timeout;
        master.set_record_connector(Arc::new(RpcRecordConnector::new(timeout)));
        #[cfg(feature = "etcd")]
        let ownership = match &self.cluster {
            // Fenced before the first request: a cluster master answers nothing until
            // the membership says what it leads.
            Some(member) => {
                let ownership = crate::cluster::leadership::MemberOwnership::new(member.groups);
                master.set_ownership(ownership.clone());
                Some(ownership)
            }
            None => None,
        };
        let server = RpcServer::serve_with(&self.listen, master.service().clone(), rpc)?;
        #[cfg(feature = "etcd")]
        if let (Some(mut member), Some(ownership)) = (self.cluster, &ownership) {
            if member.advertise.is_empty() {
                member.advertise = server.local_addr().to_string();
            }
            let handler = Arc::new(crate::cluster::leadership::MasterGroups(Arc::downgrade(master.service())));
            ownership.set_member(crate::cluster::ClusterMember::join(member, handler)?);
        }
        Ok(MasterDaemon {
            master,
            server,
            #[cfg(feature = "etcd")]
            ownership,
        })
    }
}
