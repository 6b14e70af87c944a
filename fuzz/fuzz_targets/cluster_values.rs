//! What a cluster member or watcher makes of the keys and values it reads back from
//! etcd (registrations, group assignments, leader keys, the scheduler key, the
//! cluster config), written by anyone with access: never a panic, values that do not
//! parse are left out, and the slot map stays within the cluster's groups and
//! names only leaders whose values parsed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::cluster::fuzzing::{config_groups, mirror_changes, WatchedChange};
use mooncake_core::cluster::{MAX_GROUPS, SLOTS};

/// Keys the changes are about: the cluster's own, then arbitrary ones.
const KEYS: &[&[u8]] = &[
    b"/mooncake/c/config",
    b"/mooncake/c/scheduler",
    b"/mooncake/c/masters/a",
    b"/mooncake/c/masters/b",
    b"/mooncake/c/assign/0",
    b"/mooncake/c/assign/3",
    b"/mooncake/c/leaders/0",
    b"/mooncake/c/leaders/1",
    b"/mooncake/c/leaders/3",
    b"/mooncake/c/leaders/4",
    b"/mooncake/other/leaders/0",
];

fuzz_target!(|data: &[u8]| {
    if let Ok(groups) = config_groups("c", data) {
        assert!((1..=MAX_GROUPS).contains(&groups));
    }

    // Records: a header byte (key, put or delete), 8 bytes of create revision and
    // lease, a length byte, then the value; the key is raw bytes when the header says so.
    let mut changes: Vec<WatchedChange<'_>> = Vec::new();
    let mut rest = data;
    while let [head, a, b, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        let (value, tail) = tail.split_at(len);
        let key: &[u8] = match usize::from(head >> 1) {
            k if k < KEYS.len() => KEYS[k],
            _ => value,
        };
        let put = head & 1 == 0;
        let create_revision = i64::from(i8::from_le_bytes([*a]));
        let lease = i64::from(*b);
        changes.push((key, put.then_some(value), create_revision, lease));
        rest = tail;
    }
    let (map, members) = mirror_changes("c", 4, &changes).expect("4 groups is a valid cluster");
    assert_eq!(map.groups(), 4);
    assert!(members.len() <= changes.len());
    for slot in (0..SLOTS).step_by(97) {
        let g = map.group_of_slot(slot);
        assert!(g < 4);
        let _ = map.leader(g);
    }
    // A group has a leader only where a leader key of this cluster for that group
    // was written.
    for g in 0..4u32 {
        if map.leader(g).is_some() {
            let written = changes.iter().any(|(key, value, _, _)| {
                value.is_some()
                    && key
                        .strip_prefix(b"/mooncake/c/leaders/")
                        .and_then(|n| std::str::from_utf8(n).ok()?.parse::<u32>().ok())
                        == Some(g)
            });
            assert!(written, "group {g} has a leader no leader key of the cluster named");
        }
    }
    assert!(map.ranges().iter().all(|(r, _)| *r.end() < SLOTS));
    let _ = map.masters();
});
