//! Cluster mode: 16384 key slots, led in slot groups by masters that coordinate
//! through etcd.
//!
//! A key's slot is Redis Cluster's `CRC16(key) mod 16384` ([`key_slot`], with `{tag}`
//! hash tags). The slots are cut into `G` slot groups (fixed when the cluster is
//! created); each group has at most one leader, a master holding an etcd lease, and the
//! [`SlotMap`] says who. Clients and nodes name a cluster with an [`EtcdAddress`]
//! (`etcd://H:P[,H:P...]/NAME`).
//!
//! With the `etcd` feature: [`ClusterMember`] joins a master to a cluster, leads the
//! groups the elected scheduler assigns to it and tells its [`GroupHandler`] when it
//! gains or loses one; [`ClusterMember::leads`] is the per-request fencing check.
//! [`SlotMapWatcher`] keeps a client's slot map current. Each runs its etcd client on
//! one coordination thread of its own; the API is blocking.
//!
//! Layout: `slots` (key slots, [`SlotMap`]), `address` ([`EtcdAddress`]), `credentials`
//! ([`EtcdCredentials`]: user, password and TLS for etcd), `layout` (etcd
//! keys and values), `view` (a copy of the cluster's state, kept by applying a watch),
//! `scheduler` (its pure assignment plan), `fence` (the lease deadline `leads` checks);
//! with `etcd`: `client` (requests with deadlines), `mirror` (loading and watching a
//! view), `member_config` (the config, handler trait, stats), `coordinator` (a member's
//! coordination loop), `member` ([`ClusterMember`]), `watcher` ([`SlotMapWatcher`]),
//! `leadership` (a master's `KeyOwnership` from its membership).

mod address;
#[cfg(feature = "etcd")]
mod client;
#[cfg(feature = "etcd")]
mod coordinator;
mod credentials;
#[cfg(feature = "etcd")]
mod failures;
#[cfg(any(feature = "etcd", test))]
mod fence;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
#[cfg(any(feature = "etcd", feature = "fuzzing", test))]
#[cfg_attr(all(feature = "fuzzing", not(feature = "etcd")), allow(dead_code))]
mod layout;
#[cfg(feature = "etcd")]
pub(crate) mod leadership;
#[cfg(feature = "etcd")]
mod member;
#[cfg(feature = "etcd")]
mod member_config;
#[cfg(feature = "etcd")]
mod mirror;
#[cfg(any(feature = "etcd", test))]
mod scheduler;
mod slots;
#[cfg(any(feature = "etcd", feature = "fuzzing", test))]
#[cfg_attr(all(feature = "fuzzing", not(feature = "etcd")), allow(dead_code))]
mod view;
#[cfg(feature = "etcd")]
mod watcher;

pub use address::{validate_cluster_name, EtcdAddress, MAX_CLUSTER_NAME};
pub use credentials::{EtcdCredentials, EtcdTls, ETCD_PASSWORD_ENV};
#[cfg(feature = "etcd")]
pub use member::ClusterMember;
#[cfg(feature = "etcd")]
pub use member_config::{GroupHandler, MemberConfig, MemberStats};
pub use slots::{key_slot, key_slot_bytes, validate_groups, GroupLeader, SlotMap, DEFAULT_GROUPS, MAX_GROUPS, SLOTS};
#[cfg(feature = "etcd")]
pub use watcher::SlotMapWatcher;
