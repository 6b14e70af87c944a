//! A master's [`KeyOwnership`] from its cluster membership: it answers for the slot
//! groups its [`ClusterMember`] leads (fenced by the member's lease), and takes
//! groups up and gives them up as the member is told.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use crate::cluster::member::ClusterMember;
use crate::cluster::member_config::GroupHandler;
use crate::cluster::slots::{key_slot, SLOTS};
use crate::error::Error;
use crate::master::{KeyOwnership, MasterService};

/// Ties a master service to its membership (see the module docs).
pub(crate) struct MemberOwnership {
    /// Slot groups of the cluster (as configured until joined; then as etcd says).
    groups: AtomicU32,
    member: OnceLock<ClusterMember>,
}

impl MemberOwnership {
    pub(crate) fn new(groups: u32) -> Arc<Self> {
        Arc::new(Self { groups: AtomicU32::new(groups.max(1)), member: OnceLock::new() })
    }

    /// The membership, once joined (before, nothing is led).
    pub(crate) fn set_member(&self, member: ClusterMember) {
        self.groups.store(member.groups().max(1), Ordering::Release);
        let _ = self.member.set(member);
    }

    fn groups(&self) -> u32 {
        self.groups.load(Ordering::Acquire)
    }

    /// The membership, once joined.
    pub(crate) fn member(&self) -> Option<&ClusterMember> {
        self.member.get()
    }

    /// The group's leader as the map here says, unless that is this master (whose map
    /// lags behind its lapsed lease): then nobody known.
    fn leader_of(&self, group: u32) -> Option<String> {
        let member = self.member.get()?;
        let map = member.slot_map();
        map.leader(group).filter(|l| l.master != member.id()).map(|l| l.addr.clone())
    }
}

impl KeyOwnership for MemberOwnership {
    fn group_of(&self, key: &str) -> u32 {
        (key_slot(key) as u32 * self.groups()) / SLOTS as u32
    }

    fn leads(&self, group: u32) -> bool {
        self.member.get().is_some_and(|m| m.leads(group))
    }

    fn moved(&self, key: &str) -> Error {
        Error::Moved { slot: key_slot(key), leader: self.leader_of(self.group_of(key)) }
    }

    fn group_moved(&self, group: u32) -> Error {
        let slot = (group as u64 * SLOTS as u64 / self.groups() as u64) as u16;
        Error::Moved { slot, leader: self.leader_of(group) }
    }
}

/// The member's callbacks, forwarded to the master service (while it lives).
pub(crate) struct MasterGroups(pub(crate) Weak<MasterService>);

impl GroupHandler for MasterGroups {
    fn acquired(&self, group: u32, epoch: u64) {
        if let Some(master) = self.0.upgrade() {
            tracing::info!(group, epoch, "leading slot group");
            master.acquire_group(group);
        }
    }

    fn released(&self, group: u32) {
        if let Some(master) = self.0.upgrade() {
            master.release_group(group);
        }
    }
}
