//! What a cluster member is told ([`MemberConfig`]), whom it tells
//! ([`GroupHandler`]), and what it reports ([`MemberStats`]).

use std::time::Duration;

use serde::Serialize;

use super::address::{validate_cluster_name, validate_endpoint, EtcdAddress};
use super::credentials::EtcdCredentials;
use super::slots::{validate_groups, DEFAULT_GROUPS};
use crate::error::{Error, Result};

/// How a master joins a cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberConfig {
    /// etcd endpoints: `host:port` or `http://host:port`.
    pub endpoints: Vec<String>,
    /// The cluster's name: `[A-Za-z0-9_.-]{1,64}`.
    pub cluster: String,
    /// This master's RPC address, published for clients.
    pub advertise: String,
    /// The etcd lease's time to live, in whole seconds (rounded up; etcd itself raises
    /// it to its minimum, 2 s by default). A member renews it every third of it and
    /// stops leading two thirds after its last acknowledged renewal was sent; a crashed
    /// member's groups move after about this long. Default 3 s.
    pub lease_ttl: Duration,
    /// Slot groups of the cluster, used only when this member creates it (the first
    /// member to join); afterwards the cluster's own count holds. Default 16.
    pub groups: u32,
    /// How often the scheduler re-checks every group besides reacting to changes.
    /// Default 1 s.
    pub scan_interval: Duration,
    /// How the member authenticates to etcd (default: not at all).
    pub credentials: EtcdCredentials,
}

impl MemberConfig {
    /// A config for joining the cluster at `address`, advertising `advertise`, with the
    /// defaults.
    pub fn new(address: &EtcdAddress, advertise: impl Into<String>) -> MemberConfig {
        MemberConfig {
            endpoints: address.endpoints.clone(),
            cluster: address.cluster.clone(),
            advertise: advertise.into(),
            lease_ttl: Duration::from_secs(3),
            groups: DEFAULT_GROUPS,
            scan_interval: Duration::from_secs(1),
            credentials: EtcdCredentials::default(),
        }
    }

    /// Checks every field; [`Error::InvalidArgument`] names the first bad one.
    pub fn validate(&self) -> Result<()> {
        if self.endpoints.is_empty() {
            return Err(Error::InvalidArgument("member config: no etcd endpoint".into()));
        }
        for e in &self.endpoints {
            let bare = e.strip_prefix("http://").or_else(|| e.strip_prefix("https://")).unwrap_or(e);
            validate_endpoint(bare)?;
        }
        validate_cluster_name(&self.cluster)?;
        validate_groups(self.groups)?;
        if self.advertise.is_empty() {
            return Err(Error::InvalidArgument("member config: empty advertise address".into()));
        }
        if self.lease_ttl.is_zero() || self.lease_ttl > Duration::from_secs(3600) {
            return Err(Error::InvalidArgument(format!(
                "member config: lease_ttl must lie in (0, 1 h], got {:?}",
                self.lease_ttl
            )));
        }
        if self.scan_interval < Duration::from_millis(10) || self.scan_interval > Duration::from_secs(3600) {
            return Err(Error::InvalidArgument(format!(
                "member config: scan_interval must lie in [10 ms, 1 h], got {:?}",
                self.scan_interval
            )));
        }
        Ok(())
    }

    /// The lease TTL asked of etcd, in whole seconds.
    pub(crate) fn ttl_secs(&self) -> i64 {
        self.lease_ttl.as_secs_f64().ceil().max(1.0) as i64
    }

    /// The deadline of one etcd request: half the TTL, within [0.5 s, 5 s].
    pub(crate) fn request_timeout(&self) -> Duration {
        (self.lease_ttl / 2).clamp(Duration::from_millis(500), Duration::from_secs(5))
    }
}

/// Told when this member gains or loses the leadership of a slot group.
///
/// Calls come one at a time, in order, from a thread of their own (never the one
/// renewing the lease, so a slow `acquired`, say one that rebuilds the group's state
/// from the storage nodes, does not cost the lease). A handler must not drop its
/// [`ClusterMember`](super::ClusterMember) from inside a call.
pub trait GroupHandler: Send + Sync + 'static {
    /// The member now leads `group`, with `epoch` (the etcd revision at which it took
    /// the group; larger than any earlier leader's). Called before
    /// [`leads(group)`](super::ClusterMember::leads) turns true.
    fn acquired(&self, group: u32, epoch: u64);
    /// The member no longer leads `group`: it was moved to another member, the lease
    /// lapsed, or the member is leaving. Called after `leads(group)` turned false.
    fn released(&self, group: u32);
}

/// A member's counters, for `/metrics` and the status page.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemberStats {
    /// Groups it leads now (fenced: 0 while its lease is lapsed).
    pub groups_led: u32,
    /// Slots in those groups.
    pub slots_led: u32,
    /// Groups acquired since it joined.
    pub acquired_total: u64,
    /// Of those, groups whose previous leader lost its lease (crash, stall, etcd
    /// outage) rather than handing the group over.
    pub failovers: u64,
    /// Groups released since it joined.
    pub released_total: u64,
    /// Lease renewals etcd acknowledged.
    pub lease_renewals: u64,
    /// Times the lease lapsed (the member stopped leading everything and registered
    /// anew).
    pub lease_lapses: u64,
    /// Whether this member runs the cluster's scheduler now.
    pub is_scheduler: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_checked() {
        let addr: EtcdAddress = "etcd://127.0.0.1:2379/c".parse().unwrap();
        let good = MemberConfig::new(&addr, "127.0.0.1:50051");
        good.validate().unwrap();
        assert_eq!(good.ttl_secs(), 3);
        assert_eq!(good.request_timeout(), Duration::from_millis(1500));
        let with = |f: fn(&mut MemberConfig)| {
            let mut c = good.clone();
            f(&mut c);
            c.validate()
        };
        assert!(with(|c| c.endpoints = vec!["http://127.0.0.1:2379".into()]).is_ok());
        for bad in [
            with(|c| c.endpoints.clear()),
            with(|c| c.endpoints = vec!["nohost".into()]),
            with(|c| c.cluster = "a/b".into()),
            with(|c| c.groups = 3),
            with(|c| c.advertise.clear()),
            with(|c| c.lease_ttl = Duration::ZERO),
            with(|c| c.scan_interval = Duration::from_millis(1)),
        ] {
            assert!(matches!(bad, Err(Error::InvalidArgument(_))), "{bad:?}");
        }
        let mut c = good.clone();
        c.lease_ttl = Duration::from_millis(1500);
        assert_eq!(c.ttl_secs(), 2);
    }
}
