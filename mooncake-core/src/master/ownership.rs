//! Cluster mode: which keys this master answers for.
//!
//! In a cluster, the key space is cut into slot groups and each group has one leader
//! (ARCHITECTURE.md, "Cluster mode"). A master leading some groups is told so through
//! a [`KeyOwnership`]; then:
//! - every call on a key of a group it does not lead (now: the check is fenced by
//!   its etcd lease) fails with [`Error::Moved`], so no client ever gets an answer for
//!   a slot from a master that no longer leads it;
//! - segments are mounted per group ([`mount_extent`](crate::MasterService::mount_extent)):
//!   a storage node cuts its memory into one extent per group and mounts each with
//!   the group's leader, so two leaders never allocate the same bytes, and a key's
//!   replicas are placed only in its group's extents;
//! - when a group arrives ([`acquire_group`](crate::MasterService::acquire_group)) its
//!   objects come back with the extents the nodes re-mount, carrying their records;
//!   until then a missing key of the group is `Recovering`, not `NotFound`;
//! - when a group leaves ([`release_group`](crate::MasterService::release_group)) its
//!   objects and extents are dropped here without touching the nodes' records: they
//!   are what the next leader rebuilds from.
//!
//! Without a `KeyOwnership` (a single master, daemon or embedded) none of this
//! applies: every key is answered and segments belong to no group.

use crate::error::Error;

/// Which slot groups a master leads, as its cluster membership knows it.
pub trait KeyOwnership: Send + Sync {
    /// The slot group of `key`.
    fn group_of(&self, key: &str) -> u32;
    /// Whether this master leads `group` now. Must turn false before another master
    /// can be given the group (fenced by the leadership lease).
    fn leads(&self, group: u32) -> bool;
    /// The answer for a key this master does not lead: [`Error::Moved`] naming the
    /// slot and its leader as far as this master knows.
    fn moved(&self, key: &str) -> Error;
    /// The answer for a group this master does not lead (its first slot).
    fn group_moved(&self, group: u32) -> Error;
}
