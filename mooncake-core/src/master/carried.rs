//! Tombstones carried by nodes: the removals a restarted master learns back
//! (ARCHITECTURE.md, "Generations").
//!
//! A restarted master rebuilds its index from the copies nodes offer back, and a
//! copy's generation tells it whether a later removal or put superseded it, once the
//! master knows of that removal. Its tombstones are gone with the old master's
//! memory, though. When the key was put again, the newer copy says so (a re-mount
//! conflict, `master/recovered.rs`); when it was only removed, nothing offered back
//! says so, and a node forgotten before the removal (paused, cut off past its TTL)
//! brought the removed object back.
//!
//! So a removal of a key whose copies may be out of the master's sight (its
//! tombstone is *unseen*: the key lingered, or a node was never told of a removal)
//! is handed to up to [`CARRIERS`] other nodes with a record endpoint, as a
//! `RecordUpdate::Tombstone` on their links, and the removal is acknowledged once
//! they hold it, as once its holders dropped their records. A node keeps the
//! tombstones it is handed (bounded, `store/records.rs`) and offers them first
//! whenever it registers again ([`MasterService::restore_tombstones`]). The master
//! raises its marks with them; an object it took back in this recovery window
//! from copies all older than such a removal is dropped, its holders told, as a
//! newer copy replaces an older one. Until those nodes are back the object is not
//! served if only nodes that said they may have missed updates hold it
//! (`ObjectEntry::unconfirmed`).
//!
//! Carriers are picked by rendezvous hashing of the key over the nodes registered
//! with a record endpoint (any such node will do: every node offers what it keeps).
//! In cluster mode a slot group's leader hands its removals on alike; a node keeps
//! them with its extent of the key's group and offers them to the group's next
//! leader before it mounts the extent there.

use std::sync::atomic::Ordering;

use crate::config::check_key;
use crate::error::{Error, Result};
use crate::master::generations::GenClock;
use crate::master::record_link::RecordWait;
use crate::master::service::MasterService;
use crate::master::types::{ClientId, RecordUpdate};

/// How many nodes are handed each removal to keep.
pub(crate) const CARRIERS: usize = 2;

impl MasterService {
    /// `key` was removed at `generation` while copies of it may be out of sight:
    /// hands the removal to up to [`CARRIERS`] nodes to keep for a restarted master
    /// (`wait` then waits for them as for the holders' records).
    pub(crate) fn carry_tombstone(&self, key: &str, generation: u64, wait: &mut RecordWait) {
        if !self.config.track_records {
            return;
        }
        // Rendezvous hashing: the nodes whose id hashed with the key ranks highest,
        // so that the same key tends to go to the same nodes.
        let ranker = ahash::RandomState::with_seeds(0x6b65_6570, 0x7468_6973, 0x666f_7220, 0x7573_2121);
        let mut carriers: smallvec::SmallVec<[(u64, ClientId); CARRIERS]> = smallvec::SmallVec::new();
        for (&client, rec) in self.clients.read().iter() {
            if rec.link.lock().is_none() {
                continue;
            }
            let rank = ranker.hash_one((key, client));
            if carriers.len() < CARRIERS {
                carriers.push((rank, client));
            } else if let Some(lowest) = carriers.iter_mut().min_by_key(|(r, _)| *r) {
                if rank > lowest.0 {
                    *lowest = (rank, client);
                }
            }
        }
        for (_, carrier) in carriers {
            self.push_to_client(carrier, |_| RecordUpdate::Tombstone { key: key.to_owned(), generation }, wait);
        }
        self.counters.carried_tombstones.fetch_add(1, Ordering::Relaxed);
    }

    /// Removals (key, generation) some holder of which was given up before it was
    /// told (the removal's call found a node gone, or forgotten meanwhile): handed to
    /// nodes to keep, and waited for, before the removal is acknowledged.
    pub(crate) fn keep_untold_removals(&self, removed: &[(&str, u64)]) {
        let mut wait = RecordWait::default();
        for &(key, generation) in removed {
            self.tombstones.supersede_unseen(key, generation);
            self.carry_tombstone(key, generation, &mut wait);
        }
        self.await_records(wait);
    }

    /// Tombstones `client` kept for an earlier master (handed to it with
    /// `RecordUpdate::Tombstone`): (key, generation of its removal). Each raises the
    /// key's mark; an object this master took back in its recovery window only from
    /// copies older than the removal is dropped (its holders are told; the key's next
    /// remove, upsert or put waits for them), and a copy of it offered later is
    /// refused. In cluster mode, items of groups this master does not lead are
    /// ignored.
    pub fn restore_tombstones(&self, client: ClientId, items: &[(&str, u64)]) -> Result<()> {
        if !self.clients.read().contains_key(&client) {
            return Err(Error::UnknownClient(client));
        }
        let now = self.now_ms();
        let mut dropped = 0u64;
        for &(key, generation) in items {
            check_key(key)?;
            // A removal stamped implausibly far ahead of the clock would refuse
            // every copy of the key for a day: not believed.
            if !GenClock::believable(generation) {
                continue;
            }
            let mut shard = self.index.shard(key).lock();
            // Cluster mode: only the keys of the groups this master leads (a node
            // offers those of the group whose extent it mounts here), checked under
            // the key's shard lock as every change is.
            if !self.leads_key(key) {
                continue;
            }
            self.gens.observe(generation);
            self.tombstones.supersede_unseen(key, generation);
            let superseded = shard.get(key).is_some_and(|e| {
                e.complete()
                    && e.recovered()
                    && self.recovering_key(key)
                    && shard.recovered_generation(key).is_some_and(|newest| newest < generation)
            });
            if !superseded {
                continue;
            }
            let Some(mut e) = shard.remove(key) else { continue };
            let mut wait = self.note_removed(key, &e.replicas);
            self.discard_copies(key, &e, generation, None, &mut wait);
            self.hold_orphaned_upsert(&mut e, now);
            drop(shard);
            // A read handed its replicas (it was served: no node that may have
            // missed updates held it alone) keeps their memory for its lease.
            if e.leased(now) {
                let hold = std::time::Duration::from_millis(e.lease_until_ms().saturating_sub(now));
                self.quarantine_replicas(std::mem::take(&mut e.replicas), hold);
            }
            self.unsent_removals.add(key, wait);
            dropped += 1;
            tracing::debug!(key, "an object taken back is dropped: a node kept its removal");
        }
        self.counters.stale_copies.fetch_add(dropped, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use crate::error::Error;
    use crate::master::recovered::tests::{deliver, master, node, record, short_window_master, wait_out_window, Node};
    use crate::master::{Master, RecordUpdate};

    /// The removals of `k` a node was handed to keep.
    fn kept(n: &Node) -> Vec<u64> {
        n.seen
            .0
            .lock()
            .iter()
            .filter_map(|u| match u {
                RecordUpdate::Tombstone { key, generation } if key == "k" => Some(*generation),
                _ => None,
            })
            .collect()
    }

    /// `k`, held by `holder` and `other` (version 1, stamped 10).
    fn held_twice(master: &Master, holder: &Node, other: &Node) {
        holder.remount(master, &[record(1, 10)]);
        other.remount(master, &[record(1, 10)]);
        assert_eq!(master.get_replica_list("k").unwrap().replicas.len(), 2);
        master.release_leases(&["k"]).unwrap();
    }

    /// A remove of a key whose copy went out of sight with a forgotten node is handed
    /// to two other nodes with a record endpoint (and waited for); a remove of a key
    /// every holder of which is told is handed to none.
    #[test]
    fn a_removal_a_forgotten_node_missed_is_kept_by_two_nodes() {
        let master = master();
        let (gone, holder, b, c) =
            (node(&master, "gone"), node(&master, "holder"), node(&master, "b"), node(&master, "c"));
        held_twice(&master, &gone, &holder);
        master.unregister_client(gone.client).unwrap();
        master.remove("k").unwrap();
        let carriers: Vec<Vec<u64>> = [&holder, &b, &c].into_iter().map(kept).collect();
        assert_eq!(carriers.iter().filter(|k| k.len() == 1).count(), 2, "kept by: {carriers:?}");
        assert!(carriers.iter().all(|k| k.len() <= 1));
        assert!(kept(&gone).is_empty(), "handed to the node that missed it");
        assert_eq!(master.stats().carried_tombstones, 1);

        // Put again on nodes that stay: its removal is handed to nobody more.
        let fresh = |m: &Master| -> u64 { m.stats().carried_tombstones };
        let seen = fresh(&master);
        let r = |name: &str| crate::master::ObjectRecord { key: name.into(), ..record(1, 20) };
        b.remount(&master, &[r("told")]);
        master.remove("told").unwrap();
        assert_eq!(fresh(&master), seen, "a removal every holder was told of was handed on");
    }

    /// A node whose process ended (its endpoint refuses: gone) while a remove told it:
    /// the master gives it up, and the remove is acknowledged only once two other
    /// nodes keep the removal (its copy may come back with it after a restart).
    #[test]
    fn a_removal_a_gone_holder_was_not_told_is_kept_before_it_is_acknowledged() {
        struct Gone;
        impl crate::master::RecordSink for Gone {
            fn apply_records(&self, _: &[RecordUpdate]) -> crate::error::Result<()> {
                Err(Error::MasterUnavailable("connection refused".into()))
            }
            fn gone(&self) -> bool {
                true
            }
        }
        let master = master();
        let (holder, told, b, c) =
            (node(&master, "holder"), node(&master, "told"), node(&master, "b"), node(&master, "c"));
        holder.remount(&master, &[record(1, 10)]);
        told.remount(&master, &[record(1, 10)]);
        master.attach_records(holder.client, std::sync::Arc::new(Gone)).unwrap();
        let before = master.stats().carried_tombstones;
        master.remove("k").unwrap();
        let keepers = [&told, &b, &c].into_iter().filter(|n| !kept(n).is_empty()).count();
        assert_eq!(keepers, 2, "the removal was acknowledged before two nodes kept it");
        assert!(master.stats().carried_tombstones > before);
    }

    /// A restarted master takes `k` back from a node that missed its removal, then
    /// hears the removal from a node that kept it: the object is dropped (and its
    /// node told), and served by no read meanwhile. In the other order the stale
    /// copy is refused. A copy newer than the removal, or an object put on the new
    /// master, stays.
    #[test]
    fn a_kept_removal_drops_or_refuses_older_copies_in_either_order() {
        for kept_first in [false, true] {
            let master = short_window_master();
            let (stale, carrier) = (node(&master, "stale"), node(&master, "carrier"));
            master.missed_updates(stale.client).unwrap();
            let restore = || master.restore_tombstones(carrier.client, &[("k", 15)]).unwrap();
            if kept_first {
                restore();
            }
            let (seg, taken) = stale.remount(&master, &[record(1, 10)]);
            assert_eq!(taken, usize::from(!kept_first), "kept first: {kept_first}");
            assert!(matches!(master.get_replica_list("k"), Err(Error::Recovering(_))));
            if !kept_first {
                restore();
            }
            deliver(&master);
            assert!(stale.removed(seg), "the stale copy's node keeps it (kept first: {kept_first})");
            assert_eq!(master.stats().stale_copies, 1);
            wait_out_window(&master, &[&stale, &carrier], || false);
            assert!(matches!(master.get_replica_list("k"), Err(Error::NotFound(_))), "kept first: {kept_first}");
        }

        // A copy stamped after the removal is a later put's: it stays.
        let master = master();
        let (newer, carrier) = (node(&master, "newer"), node(&master, "carrier"));
        newer.remount(&master, &[record(2, 20)]);
        master.restore_tombstones(carrier.client, &[("k", 15)]).unwrap();
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1002);
        // An older file offered later is refused by the kept removal.
        assert!(carrier.announce(&master, 1, 11).is_err());
    }

    /// A removal stamped implausibly far ahead of the clock is not believed (it would
    /// refuse every copy of its key for a day); a client the master does not know is
    /// told so; a key too long is refused.
    #[test]
    fn kept_removals_are_checked() {
        let master = master();
        let n = node(&master, "n");
        master.restore_tombstones(n.client, &[("k", u64::MAX - 1)]).unwrap();
        assert_eq!(n.remount(&master, &[record(1, 10)]).1, 1, "a removal from the far future refused a copy");
        assert!(matches!(master.restore_tombstones(u64::MAX, &[("k", 1)]), Err(Error::UnknownClient(_))));
        let long = "x".repeat(crate::config::MAX_KEY_LEN + 1);
        assert!(master.restore_tombstones(n.client, &[(&long, 1)]).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Nodes come back to a restarted master in any order, each with at most a
        /// record and a file of `k` (of any of four versions, whose generations come
        /// in any order) and at most a removal it kept (of the object of any version,
        /// stamped after that version's copies and before the next version's): the
        /// key ends with the newest version offered if that is newer than every
        /// removal kept, else with nothing, and every other copy was told to go.
        #[test]
        fn kept_removals_and_copies_in_any_order(
            nodes in prop::collection::vec(
                (prop::option::of(0u32..4), prop::option::of(0u32..4), prop::option::of(0u32..4)),
                1..6,
            ),
            ranks in Just(vec![0u64, 1, 2, 3]).prop_shuffle(),
            order in Just((0..18usize).collect::<Vec<_>>()).prop_shuffle(),
        ) {
            let gen_of = |version: u32| 100 + 10 * ranks[version as usize];
            let master = master();
            let ns: Vec<Node> = (0..nodes.len()).map(|i| node(&master, &format!("n{i}"))).collect();
            let mut segments = vec![None; ns.len()];
            let mut refused_files = vec![false; ns.len()];
            for step in order.into_iter().filter(|s| s / 3 < ns.len()) {
                let (i, what) = (step / 3, step % 3);
                let (rec, file, removal) = nodes[i];
                match (what, rec, file, removal) {
                    (0, Some(v), _, _) => segments[i] = Some(ns[i].remount(&master, &[record(v, gen_of(v))]).0),
                    (1, _, Some(v), _) => refused_files[i] = ns[i].announce(&master, v, gen_of(v) + 1).is_err(),
                    (2, _, _, Some(v)) => master.restore_tombstones(ns[i].client, &[("k", gen_of(v) + 5)]).unwrap(),
                    _ => {}
                }
            }
            deliver(&master);
            let removed_at = nodes.iter().filter_map(|n| n.2).map(|v| gen_of(v) + 5).max().unwrap_or(0);
            let newest = nodes.iter().flat_map(|&(r, f, _)| r.into_iter().chain(f)).max_by_key(|&v| gen_of(v));
            let expected = newest.filter(|&v| gen_of(v) > removed_at);
            let got = master.get_replica_list("k");
            prop_assert_eq!(got.as_ref().ok().map(|l| l.checksum), expected.map(|v| 1000 + v), "{:?}", got);
            for (i, n) in ns.iter().enumerate() {
                if let (Some(v), Some(seg)) = (nodes[i].0, segments[i]) {
                    prop_assert!(n.removed(seg) || Some(v) == expected, "node {} keeps a record of version {}", i, v);
                }
                if let Some(v) = nodes[i].1 {
                    let stays = !refused_files[i] && n.discarded().is_none_or(|g| g < gen_of(v) + 1);
                    prop_assert!(!stays || Some(v) == expected, "node {} keeps a file of version {}", i, v);
                }
            }
        }
    }
}
