//! A member's or watcher's copy of the cluster's state in etcd, kept current by
//! applying the changes a watch reports. Pure: no I/O, so the scheduler and the
//! members' decisions can be tested on it directly.

use std::collections::BTreeMap;

use super::layout::{ClusterKey, LeaderValue, MasterValue};
use super::slots::{GroupLeader, SlotMap};

/// A live member, from `masters/<id>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct MemberEntry {
    /// Its RPC address.
    pub addr: String,
    /// Groups it says it leads.
    pub led: u32,
    /// The etcd lease its registration is attached to.
    pub lease: i64,
}

/// A group's leader, from `leaders/<g>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct LeaderEntry {
    /// The leader's member id.
    pub master: String,
    /// Its RPC address.
    pub addr: String,
    /// The key's create revision: the leadership's epoch.
    pub epoch: u64,
    /// The lease the key is attached to.
    pub lease: i64,
}

/// The last leader of a group whose key was deleted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PreviousLeader {
    /// Its member id.
    pub master: String,
    /// Revision of the deletion.
    pub revision: i64,
    /// Whether it gave the group up itself (deleted its key while registered) rather
    /// than lose it with its lease (a crash, a lapse, a leave): etcd deletes a lease's
    /// keys at one revision, so a registration deleted at the same revision as the
    /// leader key means the lease ended.
    pub handed_over: bool,
}

/// One change to a key, as etcd reports it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Change<'a> {
    /// The key was created or written.
    Put {
        /// Its new value.
        value: &'a [u8],
        /// Revision it was created at.
        create_revision: i64,
        /// Its lease (0: none).
        lease: i64,
    },
    /// The key was deleted (or its lease ended).
    Delete,
}

/// The cluster as of one etcd revision.
#[derive(Clone, Debug)]
pub(crate) struct ClusterView {
    groups: u32,
    /// Live members by id.
    pub members: BTreeMap<String, MemberEntry>,
    /// The member each group is assigned to.
    pub assign: Vec<Option<String>>,
    /// The leader of each group.
    pub leaders: Vec<Option<LeaderEntry>>,
    /// The leader of each group whose key was deleted last.
    pub previous: Vec<Option<PreviousLeader>>,
    /// The member running the scheduler, and its lease.
    pub scheduler: Option<(String, i64)>,
    /// The last revision applied.
    pub revision: i64,
    /// The revision of the last change to a group's leader.
    pub leaders_revision: i64,
}

impl ClusterView {
    /// An empty view of a cluster of `groups` slot groups, at `revision`.
    pub(crate) fn new(groups: u32, revision: i64) -> ClusterView {
        let n = groups as usize;
        ClusterView {
            groups,
            members: BTreeMap::new(),
            assign: vec![None; n],
            leaders: vec![None; n],
            previous: vec![None; n],
            scheduler: None,
            revision,
            leaders_revision: revision,
        }
    }

    /// Number of slot groups.
    pub(crate) fn groups(&self) -> u32 {
        self.groups
    }

    /// Applies one change made at `revision`. Values that do not parse are treated as
    /// absent (a foreign or corrupt write must not stop a member). Returns whether a
    /// group's leader changed.
    pub(crate) fn apply(&mut self, key: &ClusterKey, change: Change<'_>, revision: i64) -> bool {
        self.revision = self.revision.max(revision);
        let in_range = |g: &u32| *g < self.groups;
        let changed = match (key, change) {
            (ClusterKey::Config, _) => false, // fixed at creation
            (ClusterKey::Master(id), Change::Put { value, lease, .. }) => {
                match serde_json::from_slice::<MasterValue>(value) {
                    Ok(v) => self.members.insert(id.clone(), MemberEntry { addr: v.addr, led: v.led, lease }),
                    Err(e) => {
                        tracing::warn!(member = %id, "ignoring a malformed registration: {e}");
                        self.members.remove(id)
                    }
                };
                false
            }
            (ClusterKey::Master(id), Change::Delete) => {
                self.members.remove(id);
                for p in self.previous.iter_mut().flatten() {
                    if p.master == *id && p.revision == revision {
                        p.handed_over = false;
                    }
                }
                false
            }
            (ClusterKey::Assign(g), Change::Put { value, .. }) if in_range(g) => {
                self.assign[*g as usize] = std::str::from_utf8(value).ok().map(str::to_string);
                false
            }
            (ClusterKey::Assign(g), Change::Delete) if in_range(g) => {
                self.assign[*g as usize] = None;
                false
            }
            (ClusterKey::Leader(g), Change::Put { value, create_revision, lease }) if in_range(g) => {
                let entry = match serde_json::from_slice::<LeaderValue>(value) {
                    Ok(v) => Some(LeaderEntry { master: v.master, addr: v.addr, epoch: create_revision as u64, lease }),
                    Err(e) => {
                        tracing::warn!(group = g, "ignoring a malformed leader key: {e}");
                        None
                    }
                };
                let slot = &mut self.leaders[*g as usize];
                let changed = *slot != entry;
                *slot = entry;
                changed
            }
            (ClusterKey::Leader(g), Change::Delete) if in_range(g) => {
                let gone = self.leaders[*g as usize].take();
                if let Some(l) = &gone {
                    let handed_over = self.members.get(&l.master).is_some_and(|m| m.lease == l.lease);
                    self.previous[*g as usize] =
                        Some(PreviousLeader { master: l.master.clone(), revision, handed_over });
                }
                gone.is_some()
            }
            (ClusterKey::Scheduler, Change::Put { value, lease, .. }) => {
                self.scheduler = std::str::from_utf8(value).ok().map(|id| (id.to_string(), lease));
                false
            }
            (ClusterKey::Scheduler, Change::Delete) => {
                self.scheduler = None;
                false
            }
            _ => false, // a group out of range: not ours to read
        };
        if changed {
            self.leaders_revision = revision;
        }
        changed
    }

    /// The slot map this view describes, versioned by the last leader change.
    pub(crate) fn slot_map(&self) -> SlotMap {
        let mut map = SlotMap::new(self.groups).expect("a view's group count was checked when it was made");
        for (g, l) in self.leaders.iter().enumerate() {
            map.set_leader(
                g as u32,
                l.as_ref().map(|l| GroupLeader { master: l.master.clone(), addr: l.addr.clone(), epoch: l.epoch }),
            );
        }
        map.set_version(self.leaders_revision as u64);
        map
    }

    /// Live members as `(id, address)`, sorted by id.
    pub(crate) fn member_list(&self) -> Vec<(String, String)> {
        self.members.iter().map(|(id, m)| (id.clone(), m.addr.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(value: &str, create_revision: i64, lease: i64) -> Change<'_> {
        Change::Put { value: value.as_bytes(), create_revision, lease }
    }

    #[test]
    fn leader_changes_move_the_version_and_the_map() {
        let mut v = ClusterView::new(4, 10);
        v.apply(&ClusterKey::Master("a".into()), put(r#"{"addr":"h:1","led":0}"#, 11, 7), 11);
        assert_eq!(v.member_list(), vec![("a".to_string(), "h:1".to_string())]);
        // Assignments and registrations do not change the slot map's version.
        assert!(!v.apply(&ClusterKey::Assign(2), put("a", 12, 0), 12));
        assert_eq!(v.slot_map().version(), 10);
        assert!(v.apply(&ClusterKey::Leader(2), put(r#"{"master":"a","addr":"h:1"}"#, 13, 7), 13));
        let map = v.slot_map();
        assert_eq!(map.version(), 13);
        assert_eq!(map.leader(2).map(|l| (l.master.as_str(), l.epoch)), Some(("a", 13)));
        // Deleted while "a" is registered with that lease: a handoff.
        assert!(v.apply(&ClusterKey::Leader(2), Change::Delete, 14));
        assert!(v.previous[2].as_ref().unwrap().handed_over);
        assert_eq!(v.slot_map().version(), 14);
        assert!(v.slot_map().leader(2).is_none());
        // The lease ended: registration and leader keys go at one revision (etcd
        // deletes them in key order, leaders first), so the leader lost them.
        v.apply(&ClusterKey::Leader(1), put(r#"{"master":"a","addr":"h:1"}"#, 15, 7), 15);
        v.apply(&ClusterKey::Leader(3), put(r#"{"master":"a","addr":"h:1"}"#, 16, 7), 16);
        v.apply(&ClusterKey::Leader(1), Change::Delete, 17);
        assert!(v.previous[1].as_ref().unwrap().handed_over, "not known yet");
        v.apply(&ClusterKey::Master("a".into()), Change::Delete, 17);
        assert!(!v.previous[1].as_ref().unwrap().handed_over);
        assert!(v.previous[2].as_ref().unwrap().handed_over, "an earlier handoff stays one");
        // The other order (registration first) says the same.
        v.apply(&ClusterKey::Leader(3), Change::Delete, 17);
        assert!(!v.previous[3].as_ref().unwrap().handed_over);
        assert!(v.members.is_empty());
    }

    #[test]
    fn bad_values_and_foreign_groups_are_ignored() {
        let mut v = ClusterView::new(2, 1);
        assert!(!v.apply(&ClusterKey::Leader(1), put("not json", 2, 0), 2));
        assert!(v.leaders[1].is_none());
        assert!(!v.apply(&ClusterKey::Leader(5), put(r#"{"master":"a","addr":"h"}"#, 3, 0), 3));
        assert!(!v.apply(&ClusterKey::Assign(9), put("a", 4, 0), 4));
        v.apply(&ClusterKey::Master("a".into()), put("{", 5, 1), 5);
        assert!(v.members.is_empty());
        assert_eq!(v.revision, 5);
        assert_eq!(v.slot_map(), SlotMap::new(2).unwrap().tap_version(1));
    }

    trait TapVersion {
        fn tap_version(self, v: u64) -> Self;
    }
    impl TapVersion for SlotMap {
        fn tap_version(mut self, v: u64) -> Self {
            self.set_version(v);
            self
        }
    }
}
