//! The scheduler's decisions: which live member each slot group should be assigned to.
//!
//! One member runs the scheduler at a time (it holds the `scheduler` key); it calls
//! [`plan`] on its view after every change it sees and on a periodic scan, and writes
//! the assignments that differ from etcd's. The plan is a pure function of the view:
//!
//! 1. A group whose assignee is not a live member is given to its current leader if
//!    that one is live (nothing moves), otherwise to the live member owning the fewest
//!    groups (leaderless groups after a crash go to the least loaded).
//! 2. Then, while the most loaded member owns two or more groups more than the least
//!    loaded, one of its groups moves to the least loaded (a joining member takes a
//!    share). Groups it does not lead yet move first, so a rebalance interrupts as
//!    little leadership as it can.
//!
//! A member *owns* the groups assigned to it. At the end every member owns
//! `floor(G/n)` or `ceil(G/n)` of the `G` groups.

use std::collections::BTreeMap;

use super::view::ClusterView;

/// One assignment to write: group `group` goes to member `member`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Assignment {
    /// The slot group.
    pub group: u32,
    /// The member id it is assigned to.
    pub member: String,
}

/// The assignments that bring `view` to a balanced state in which every group has a
/// live assignee, in group order; empty when there is nothing to change (or no live
/// member to give anything to).
pub(crate) fn plan(view: &ClusterView) -> Vec<Assignment> {
    if view.members.is_empty() {
        return Vec::new();
    }
    let groups = view.groups() as usize;
    let live = |id: &Option<String>| id.as_ref().filter(|id| view.members.contains_key(*id)).cloned();
    let mut owner: Vec<Option<String>> = view.assign.iter().map(live).collect();
    let mut load: BTreeMap<&str, usize> = view.members.keys().map(|id| (id.as_str(), 0)).collect();
    for id in owner.iter().flatten() {
        *load.get_mut(id.as_str()).expect("owners are live members") += 1;
    }
    for (o, leader) in owner.iter_mut().zip(&view.leaders) {
        if o.is_some() {
            continue;
        }
        let target = match live(&leader.as_ref().map(|l| l.master.clone())) {
            Some(leader) => leader,
            None => least_loaded(&load).to_string(),
        };
        *load.get_mut(target.as_str()).expect("targets are live members") += 1;
        *o = Some(target);
    }
    loop {
        let most = most_loaded(&load);
        let least = least_loaded(&load);
        if load[most] <= load[least] + 1 {
            break;
        }
        let led_by = |g: usize| view.leaders[g].as_ref().map(|l| l.master.as_str());
        let owned = (0..groups).rev().filter(|&g| owner[g].as_deref() == Some(most));
        let pick = owned.clone().find(|&g| led_by(g) != Some(most)).or_else(|| owned.clone().next());
        let g = pick.expect("the most loaded member owns groups");
        let (most, least) = (most.to_string(), least.to_string());
        *load.get_mut(most.as_str()).expect("live") -= 1;
        *load.get_mut(least.as_str()).expect("live") += 1;
        owner[g] = Some(least);
    }
    owner
        .into_iter()
        .enumerate()
        .filter_map(|(g, o)| {
            let member = o.expect("every group has an owner by now");
            (view.assign[g].as_ref() != Some(&member)).then_some(Assignment { group: g as u32, member })
        })
        .collect()
}

/// The member owning the fewest groups (the smallest id among equals).
fn least_loaded<'a>(load: &BTreeMap<&'a str, usize>) -> &'a str {
    load.iter().min_by_key(|(id, n)| (**n, **id)).map(|(id, _)| *id).expect("at least one live member")
}

/// The member owning the most groups (the smallest id among equals).
fn most_loaded<'a>(load: &BTreeMap<&'a str, usize>) -> &'a str {
    load.iter()
        .max_by_key(|(id, n)| (**n, std::cmp::Reverse(**id)))
        .map(|(id, _)| *id)
        .expect("at least one live member")
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::super::layout::ClusterKey;
    use super::super::view::Change;
    use super::*;

    fn view(groups: u32, members: &[&str], assign: &[Option<&str>], leaders: &[Option<&str>]) -> ClusterView {
        let mut v = ClusterView::new(groups, 1);
        let mut rev = 1;
        let mut next = || {
            rev += 1;
            rev
        };
        for m in members {
            let r = next();
            v.apply(
                &ClusterKey::Master(m.to_string()),
                Change::Put { value: br#"{"addr":"x"}"#, create_revision: r, lease: 1 },
                r,
            );
        }
        for (g, a) in assign.iter().enumerate() {
            if let Some(a) = a {
                let r = next();
                v.apply(
                    &ClusterKey::Assign(g as u32),
                    Change::Put { value: a.as_bytes(), create_revision: r, lease: 0 },
                    r,
                );
            }
        }
        for (g, l) in leaders.iter().enumerate() {
            if let Some(l) = l {
                let r = next();
                let value = format!(r#"{{"master":"{l}","addr":"x"}}"#);
                v.apply(
                    &ClusterKey::Leader(g as u32),
                    Change::Put { value: value.as_bytes(), create_revision: r, lease: 1 },
                    r,
                );
            }
        }
        v
    }

    fn apply(v: &ClusterView, plan: &[Assignment]) -> Vec<Option<String>> {
        let mut assign = v.assign.clone();
        for a in plan {
            assign[a.group as usize] = Some(a.member.clone());
        }
        assign
    }

    #[test]
    fn one_member_gets_everything() {
        let v = view(4, &["a"], &[], &[]);
        let p = plan(&v);
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|a| a.member == "a"));
        assert!(plan(&view(4, &[], &[], &[])).is_empty());
    }

    #[test]
    fn a_dead_members_groups_go_to_the_least_loaded() {
        let a = Some("a");
        let b = Some("b");
        let dead = Some("dead");
        // a owns 3, b owns 1; dead owned 4: b gets 3 of them and a 1, so both own 4.
        let v = view(8, &["a", "b"], &[a, a, a, b, dead, dead, dead, dead], &[a, a, a, b, None, None, None, None]);
        let p = plan(&v);
        let after = apply(&v, &p);
        let count = |m: &str| after.iter().filter(|o| o.as_deref() == Some(m)).count();
        assert_eq!((count("a"), count("b")), (4, 4));
        assert!(p.iter().all(|x| x.group >= 4), "nothing already owned moves: {p:?}");
    }

    #[test]
    fn a_live_leader_keeps_its_group_when_the_assignment_is_lost() {
        let v = view(2, &["a", "b"], &[None, Some("b")], &[Some("a"), Some("b")]);
        assert_eq!(plan(&v), vec![Assignment { group: 0, member: "a".into() }]);
    }

    #[test]
    fn a_newcomer_takes_unled_groups_first() {
        let a = Some("a");
        // a owns all 4 but leads only 0 and 1: groups 2 and 3 go to the newcomer.
        let v = view(4, &["a", "b"], &[a, a, a, a], &[a, a, None, None]);
        let mut moved: Vec<u32> = plan(&v).iter().map(|x| x.group).collect();
        moved.sort();
        assert_eq!(moved, vec![2, 3]);
    }

    proptest! {
        /// Against a simple model: after the plan every group has a live assignee,
        /// loads differ by at most one, and planning again changes nothing.
        #[test]
        fn plans_are_balanced_complete_and_stable(
            log in 0u32..7,
            members in proptest::collection::btree_set("[a-e]", 1..5),
            picks in proptest::collection::vec((0usize..7, 0usize..7), 64),
        ) {
            let groups = 1u32 << log;
            let members: Vec<&str> = members.iter().map(String::as_str).collect();
            // Owners and leaders drawn from the members plus two dead ids and none.
            let pool = |i: usize| -> Option<&str> {
                match i { 0 => None, 1 => Some("dead1"), 2 => Some("dead2"), i => members.get(i - 3).copied() }
            };
            let assign: Vec<Option<&str>> = (0..groups as usize).map(|g| pool(picks[g].0)).collect();
            let leaders: Vec<Option<&str>> = (0..groups as usize).map(|g| pool(picks[g].1)).collect();
            let mut v = view(groups, &members, &assign, &leaders);
            let p = plan(&v);
            let after = apply(&v, &p);
            for o in &after {
                prop_assert!(o.as_ref().is_some_and(|o| members.contains(&o.as_str())), "{:?}", after);
            }
            let loads: Vec<usize> = members.iter().map(|m| after.iter().filter(|o| o.as_deref() == Some(*m)).count()).collect();
            let (lo, hi) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
            prop_assert!(hi - lo <= 1, "{:?}", loads);
            prop_assert!(hi <= (groups as usize).div_ceil(members.len()));
            // Written back, the plan is a fixed point.
            let mut rev = 1000;
            for a in &p {
                rev += 1;
                v.apply(&ClusterKey::Assign(a.group), Change::Put { value: a.member.as_bytes(), create_revision: rev, lease: 0 }, rev);
            }
            prop_assert!(plan(&v).is_empty());
        }
    }
}
