//! Key slots and the slot map: which master leads the group of slots a key falls in.
//!
//! The key space is cut into [`SLOTS`] slots with Redis Cluster's function (CRC16/XMODEM
//! of the key, or of its `{hash tag}`, mod 16384), so keys that share a tag (one
//! request's prefix blocks, say) share a slot and so a leader. Slots are led in *slot
//! groups*: `G` groups of `16384 / G` consecutive slots each. Leadership moves a whole
//! group at a time, which keeps the coordination state (one etcd key per group) small
//! while the slot function stays the one clients compute.

use std::ops::{Range, RangeInclusive};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Number of key slots (Redis Cluster's 2^14).
pub const SLOTS: u16 = 16384;

/// Most slot groups a cluster may have.
pub const MAX_GROUPS: u32 = 1024;

/// Default number of slot groups of a new cluster.
pub const DEFAULT_GROUPS: u32 = 16;

const CRC16: crc::Crc<u16> = crc::Crc::<u16>::new(&crc::CRC_16_XMODEM);

/// The slot of `key`: CRC16/XMODEM mod 16384, exactly as Redis Cluster computes it.
///
/// When the key holds a `{`, and a `}` follows it with at least one byte between, only
/// the bytes between that first `{` and the first `}` after it (the *hash tag*) are
/// hashed, so `{user1000}.following` and `{user1000}.followers` share a slot. An empty
/// tag (`foo{}{bar}`) hashes the whole key.
///
/// ```
/// use mooncake_core::cluster::key_slot;
/// assert_eq!(key_slot("123456789"), 12739);
/// assert_eq!(key_slot("{user1000}.following"), key_slot("{user1000}.followers"));
/// ```
pub fn key_slot(key: &str) -> u16 {
    key_slot_bytes(key.as_bytes())
}

/// [`key_slot`] of raw bytes.
pub fn key_slot_bytes(key: &[u8]) -> u16 {
    CRC16.checksum(hash_tag(key)) % SLOTS
}

/// The bytes of `key` that are hashed: its non-empty hash tag, or all of it.
fn hash_tag(key: &[u8]) -> &[u8] {
    let Some(open) = key.iter().position(|&b| b == b'{') else { return key };
    let rest = &key[open + 1..];
    match rest.iter().position(|&b| b == b'}') {
        Some(close) if close > 0 => &rest[..close],
        _ => key,
    }
}

/// Checks a slot group count: it must divide 16384 and lie in `1..=1024` (so it is a
/// power of two), or every group would not hold the same whole number of slots.
pub fn validate_groups(groups: u32) -> Result<()> {
    if groups == 0 || groups > MAX_GROUPS || u32::from(SLOTS) % groups != 0 {
        return Err(Error::InvalidArgument(format!(
            "slot groups must divide {SLOTS} and lie in 1..={MAX_GROUPS} (a power of two), got {groups}"
        )));
    }
    Ok(())
}

/// Who leads a slot group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupLeader {
    /// The leading master's member id (random, new per process start).
    pub master: String,
    /// The leading master's RPC address.
    pub addr: String,
    /// The leadership's epoch: the etcd revision at which this leader took the group.
    /// It grows with every new leader of the group, so a larger epoch is a later leader.
    pub epoch: u64,
}

/// The slot map: `G` slot groups and the leader of each, as of one etcd revision.
///
/// ```
/// use mooncake_core::cluster::{key_slot, SlotMap};
/// let map = SlotMap::new(16)?;
/// let group = map.group_of_key("layer0/block7");
/// assert!(map.slots_of(group).contains(&key_slot("layer0/block7")));
/// assert!(map.leader(group).is_none()); // a new map has no leaders
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotMap {
    groups: u32,
    leaders: Vec<Option<GroupLeader>>,
    version: u64,
}

impl SlotMap {
    /// A map of `groups` groups, all leaderless, at version 0. Fails with
    /// [`Error::InvalidArgument`] unless `groups` divides 16384 and lies in `1..=1024`.
    pub fn new(groups: u32) -> Result<SlotMap> {
        validate_groups(groups)?;
        Ok(SlotMap { groups, leaders: vec![None; groups as usize], version: 0 })
    }

    /// Number of slot groups.
    pub fn groups(&self) -> u32 {
        self.groups
    }

    /// Slots in each group.
    pub fn slots_per_group(&self) -> u16 {
        // `validate_groups` makes this exact and at least 16.
        (u32::from(SLOTS) / self.groups) as u16
    }

    /// The group that holds `slot` (taken mod 16384, so any `u16` maps somewhere).
    pub fn group_of_slot(&self, slot: u16) -> u32 {
        u32::from(slot % SLOTS) / u32::from(self.slots_per_group())
    }

    /// The group that holds `key`'s slot.
    pub fn group_of_key(&self, key: &str) -> u32 {
        self.group_of_slot(key_slot(key))
    }

    /// The slots of `group`: `[g * 16384 / G, (g + 1) * 16384 / G)`; empty for a group
    /// out of range.
    pub fn slots_of(&self, group: u32) -> Range<u16> {
        if group >= self.groups {
            return 0..0;
        }
        let per = u32::from(self.slots_per_group());
        // At most 16384, which fits a u16.
        (group * per) as u16..((group + 1) * per) as u16
    }

    /// The leader of `group`, if it has one (none for a group out of range).
    pub fn leader(&self, group: u32) -> Option<&GroupLeader> {
        self.leaders.get(group as usize).and_then(Option::as_ref)
    }

    /// The leader of `key`'s group, if it has one.
    pub fn leader_of_key(&self, key: &str) -> Option<&GroupLeader> {
        self.leader(self.group_of_key(key))
    }

    /// Sets (or clears) the leader of `group`; a group out of range is ignored.
    pub fn set_leader(&mut self, group: u32, leader: Option<GroupLeader>) {
        if let Some(slot) = self.leaders.get_mut(group as usize) {
            *slot = leader;
        }
    }

    /// The etcd revision this map reflects (0 for a map never loaded from etcd). It
    /// changes whenever a leader changes.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Sets the version (the etcd revision of the last leader change seen).
    pub fn set_version(&mut self, version: u64) {
        self.version = version;
    }

    /// Whether every group has a leader.
    pub fn is_complete(&self) -> bool {
        self.leaders.iter().all(Option::is_some)
    }

    /// Ranges of consecutive slots with the same leader (and epoch), in slot order, for
    /// printing.
    pub fn ranges(&self) -> Vec<(RangeInclusive<u16>, Option<GroupLeader>)> {
        let mut out: Vec<(RangeInclusive<u16>, Option<GroupLeader>)> = Vec::new();
        for (group, leader) in self.leaders.iter().enumerate() {
            let slots = self.slots_of(group as u32);
            match out.last_mut() {
                Some((range, last)) if last == leader => *range = *range.start()..=slots.end - 1,
                _ => out.push((slots.start..=slots.end - 1, leader.clone())),
            }
        }
        out
    }

    /// The distinct leading masters as `(member id, address)`, sorted by id.
    pub fn masters(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> =
            self.leaders.iter().flatten().map(|l| (l.master.clone(), l.addr.clone())).collect();
        out.sort();
        out.dedup_by(|a, b| a.0 == b.0);
        out
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn leader(master: &str, epoch: u64) -> GroupLeader {
        GroupLeader { master: master.into(), addr: format!("{master}:1"), epoch }
    }

    #[test]
    fn redis_vectors() {
        // The reference value of CRC16/XMODEM("123456789") is 0x31C3 = 12739.
        assert_eq!(key_slot("123456789"), 12739);
        assert_eq!(key_slot("{user1000}.following"), key_slot("{user1000}.followers"));
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        // An empty tag: the whole key is hashed.
        assert_eq!(hash_tag(b"foo{}{bar}"), b"foo{}{bar}");
        assert_ne!(key_slot("foo{}{bar}"), key_slot("bar"));
        // The tag runs from the first `{` to the first `}` after it.
        assert_eq!(hash_tag(b"foo{{bar}}zap"), b"{bar");
        assert_eq!(key_slot("foo{{bar}}zap"), key_slot("{bar"));
        assert_eq!(hash_tag(b"foo{bar}{zap}"), b"bar");
        assert_eq!(key_slot("foo{bar}{zap}"), key_slot("bar"));
        // No closing brace: the whole key.
        assert_eq!(hash_tag(b"foo{bar"), b"foo{bar");
        assert_eq!(key_slot(""), 0);
    }

    #[test]
    fn group_counts_are_checked() {
        for ok in [1, 2, 16, 256, 1024] {
            assert!(SlotMap::new(ok).is_ok(), "{ok}");
        }
        for bad in [0, 3, 24, 1000, 2048, u32::MAX] {
            let err = SlotMap::new(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(ref m) if m.contains("divide")), "{bad}: {err}");
        }
    }

    #[test]
    fn ranges_merge_groups_with_one_leader() {
        let mut map = SlotMap::new(4).unwrap();
        assert_eq!(map.ranges(), vec![(0..=16383, None)]);
        map.set_leader(0, Some(leader("a", 5)));
        map.set_leader(1, Some(leader("a", 5)));
        map.set_leader(3, Some(leader("b", 7)));
        assert_eq!(
            map.ranges(),
            vec![(0..=8191, Some(leader("a", 5))), (8192..=12287, None), (12288..=16383, Some(leader("b", 7)))]
        );
        // Another epoch of the same master is another range.
        map.set_leader(1, Some(leader("a", 9)));
        assert_eq!(map.ranges().len(), 4);
        assert_eq!(map.masters(), vec![("a".into(), "a:1".into()), ("b".into(), "b:1".into())]);
        assert!(!map.is_complete());
        map.set_leader(2, Some(leader("b", 8)));
        assert!(map.is_complete());
        // Out of range: ignored and absent.
        map.set_leader(4, Some(leader("c", 1)));
        assert_eq!(map.leader(4), None);
        assert_eq!(map.slots_of(4), 0..0);
    }

    proptest! {
        #[test]
        fn slots_are_in_range(key in ".*") {
            prop_assert!(key_slot(&key) < SLOTS);
        }

        #[test]
        fn keys_with_one_tag_share_a_slot(
            tag in "[^{}]{1,20}", a in "[^{]{0,10}", b in "[^{]{0,10}", c in ".{0,10}", d in ".{0,10}",
        ) {
            let one = format!("{a}{{{tag}}}{c}");
            let two = format!("{b}{{{tag}}}{d}");
            prop_assert_eq!(key_slot(&one), key_slot(&two));
            prop_assert_eq!(key_slot(&one), key_slot(&tag));
        }

        #[test]
        fn groups_partition_the_slots(log in 0u32..=10, slot in 0u16..SLOTS) {
            let map = SlotMap::new(1 << log).unwrap();
            // Every group's slots are consecutive, adjacent to the next group's, and
            // together they are exactly 0..16384.
            let mut next = 0u32;
            for g in 0..map.groups() {
                let r = map.slots_of(g);
                prop_assert_eq!(u32::from(r.start), next);
                prop_assert_eq!(r.len(), usize::from(map.slots_per_group()));
                next = u32::from(r.end);
            }
            prop_assert_eq!(next, u32::from(SLOTS));
            let g = map.group_of_slot(slot);
            prop_assert!(g < map.groups());
            prop_assert!(map.slots_of(g).contains(&slot));
        }

        #[test]
        fn ranges_cover_every_slot_once(leaders in proptest::collection::vec(proptest::option::of(0u8..3), 16)) {
            let mut map = SlotMap::new(16).unwrap();
            for (g, l) in leaders.iter().enumerate() {
                map.set_leader(g as u32, l.map(|m| leader(&m.to_string(), 1)));
            }
            let ranges = map.ranges();
            let mut next = 0u32;
            for (i, (r, l)) in ranges.iter().enumerate() {
                prop_assert_eq!(u32::from(*r.start()), next);
                next = u32::from(*r.end()) + 1;
                // Each slot's leader is its group's; neighbours differ (merged).
                for s in [*r.start(), *r.end()] {
                    prop_assert_eq!(map.leader(map.group_of_slot(s)), l.as_ref());
                }
                if i > 0 {
                    prop_assert_ne!(&ranges[i - 1].1, l);
                }
            }
            prop_assert_eq!(next, u32::from(SLOTS));
        }
    }
}
