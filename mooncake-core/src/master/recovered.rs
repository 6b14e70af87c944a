//! Recovered objects: which copy of a key a restarted master keeps when nodes offer
//! it different ones (ARCHITECTURE.md, "Generations").
//!
//! A restarted master (or a new slot leader) rebuilds its index from the copies
//! nodes offer back: records with their re-mounted segments, files their SSD tiers
//! announce. Its tombstones are gone with the old master's memory, so two nodes may
//! offer different objects under one key: a node forgotten before the key was
//! removed and put again still holds the old object; the node of the new put holds
//! the new one. The first copy offered used to decide: the later, newer one was
//! refused and its node told to drop it, losing an acknowledged object for a stale
//! one.
//!
//! Every copy carries the generation it was stamped with while its object existed,
//! and a key's objects are ordered by them: each copy of an object is newer than
//! every copy of the objects its key held before (a copy is stamped after its put
//! and before its removal, and a put of the key follows the removal of what it
//! replaces). So while a recovery window is open the master remembers, for each key
//! it took back from an offered copy, the newest generation of the copies it took;
//! a copy offered later that differs from the object and is newer than that
//! generation replaces it, and the old object's holders are told to drop their
//! copies. A copy older than it is refused as before.
//!
//! Only entries made from offered copies are replaced (`ObjectEntry::recovered`): an
//! object put on this master is newer than anything a node offers back. The
//! generations are kept in the key's index shard, by the key's 64-bit hash (16 bytes
//! a copy taken back, appended under the shard lock the re-mount holds anyway; only
//! while a window is open, dropped by the monitor once none is): two keys sharing a
//! hash share the newer generation, which only makes the master refuse a copy it
//! could have taken, as before. A copy offered once no window is open is refused on a
//! conflict as before: the nodes that come back then are those forgotten long ago.

use std::sync::atomic::Ordering;

use crate::error::{Error, Result};
use crate::master::generations::GenClock;
use crate::master::object::{ObjectEntry, Shard};
use crate::master::service::MasterService;
use crate::master::types::ClientId;

/// What the master makes of a copy of a key a node offers back (a re-mounted
/// record, an announced file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Offered {
    /// The key has no object, and was not removed or put again since the copy was
    /// stamped: the copy is taken, as the key's object.
    Absent,
    /// Older than the key's last removal or put: refused.
    Stale,
    /// A copy of the key's object: it joins it.
    Same,
    /// Newer than the object taken back for the key, which it replaces.
    Newer,
    /// Another object than the key's, and not a newer one: refused.
    Conflict,
}

/// What the master knows, for one node's call offering copies back, of the copies
/// it offers: asked once per call, not per copy.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OfferContext {
    /// A recovery window is open ([`MasterService::recovering_any`]).
    pub(crate) window: bool,
    /// The node said it may have missed updates ([`MasterService::missed_updates`]).
    pub(crate) stale_node: bool,
}

impl MasterService {
    /// `client`, registered again, may have missed record updates before (see
    /// [`MasterApi::missed_updates`](crate::MasterApi::missed_updates)).
    pub fn missed_updates(&self, client: ClientId) -> Result<()> {
        match self.clients.read().get(&client) {
            Some(rec) => {
                rec.missed_updates.store(true, Ordering::Relaxed);
                Ok(())
            }
            None => Err(Error::UnknownClient(client)),
        }
    }

    /// What to make of the copies `client` offers in one call.
    pub(crate) fn offer_context(&self, client: ClientId) -> OfferContext {
        let stale_node = self.clients.read().get(&client).is_some_and(|r| r.missed_updates.load(Ordering::Relaxed));
        OfferContext { window: self.recovering_any(), stale_node }
    }

    /// Whether `e`, the object under `key`, is withheld from readers: taken back only
    /// from nodes that may have missed updates, while the recovery window that may
    /// still bring a newer copy is open (they are answered `Recovering`).
    pub(crate) fn withheld(&self, key: &str, e: &ObjectEntry) -> bool {
        e.unconfirmed() && self.recovering_key(key)
    }

    /// What to make of a copy of `key` (`len` bytes, `checksum`) stamped
    /// `generation` that a node offers back, given `shard`, the key's (locked).
    pub(crate) fn classify_offered(
        &self,
        shard: &Shard,
        key: &str,
        len: u64,
        checksum: u32,
        generation: u64,
    ) -> Offered {
        match shard.get(key) {
            None if !self.tombstones.admits(key, generation) => Offered::Stale,
            None => Offered::Absent,
            Some(e) if e.complete() && e.len() == len && e.checksum == checksum => Offered::Same,
            // Taken back from a node that missed the key's removal and put since
            // (and not changed since): this copy is the newer object.
            Some(e)
                if e.complete()
                    && e.recovered()
                    && GenClock::believable(generation)
                    && shard.recovered_generation(key).is_some_and(|newest| generation > newest)
                    && self.tombstones.admits(key, generation) =>
            {
                Offered::Newer
            }
            Some(_) => Offered::Conflict,
        }
    }

    /// A copy of `key` stamped `generation`, offered back, was taken by `e`, the
    /// key's object in `shard`: it made `e` (`made`: the key was absent, or its
    /// object replaced) or joined it. While a recovery window is open, `e` may then
    /// be replaced by a newer copy offered later: returns whether the copy's
    /// generation must be remembered ([`remember_recovered`](Self::remember_recovered),
    /// once `e` is no longer borrowed). A copy joining an object put on this master
    /// changes nothing (that object is newer than the copy says). An object made from
    /// the copy of a node that may have missed updates is withheld from readers
    /// until the window closes or a copy of another node joins it.
    pub(crate) fn recovered_copy(e: &mut ObjectEntry, made: bool, offer: OfferContext) -> bool {
        if made {
            e.set_recovered(offer.window);
            e.set_unconfirmed(offer.window && offer.stale_node);
        } else if !offer.stale_node {
            e.set_unconfirmed(false);
        }
        offer.window && e.recovered()
    }

    /// Remembers the generation of a copy of `key` taken back (see
    /// [`recovered_copy`](Self::recovered_copy)).
    pub(crate) fn remember_recovered(&self, shard: &mut Shard, key: &str, generation: u64) {
        shard.note_recovered(key, generation);
        self.recovered_noted.store(true, Ordering::Release);
    }

    /// Makes `e` the object of a newer copy of `key` (`len` bytes, `checksum`) offered
    /// back ([`Offered::Newer`]; the caller then adds the copy's replica to it). The
    /// owners of the old object's replicas are sent `Removed`, its disk replica and
    /// the files an asked-for offload may have written are discarded (but on
    /// `filer`'s SSD, whose file is the newer copy), and its replicas are kept while
    /// reads in flight may still copy from them. Those removals are not waited for
    /// here (a node of the old object may be slow): the key's next remove, upsert or
    /// put waits for them.
    pub(crate) fn take_newer_copy(
        &self,
        key: &str,
        e: &mut ObjectEntry,
        (len, checksum): (u64, u32),
        filer: Option<ClientId>,
        now: u64,
    ) {
        let mut wait = self.note_removed(key, &e.replicas);
        self.discard_copies(key, e, self.gens.next(), filer, &mut wait);
        e.set_disk(0);
        e.set_offload_deadline_ms(0);
        // As an upsert's swap: a read handed the old replicas holds them for its lease.
        let retire_until = (now + self.config.default_lease.as_millis() as u64).max(e.lease_until_ms());
        if e.retire_replicas(retire_until, now) {
            self.retiring.lock().insert(key.into());
        }
        e.set_len(len);
        e.checksum = checksum;
        e.last_access_ms = now;
        self.unsent_removals.add(key, wait);
        self.counters.stale_copies.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(key, "an object taken back is replaced by a newer copy offered since");
    }

    /// Forgets the generations of copies taken back once no recovery window is
    /// open (the monitor's round).
    pub(crate) fn forget_recovered_generations(&self) {
        if !self.recovering_any() && self.recovered_noted.swap(false, Ordering::AcqRel) {
            for shard in self.index.shards() {
                shard.lock().forget_recovered();
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use mooncake_alloc::SegmentId;
    use mooncake_transfer::RemoteRegion;
    use proptest::prelude::*;

    use crate::config::{MasterConfig, ReplicateConfig};
    use crate::error::Error;
    use crate::master::records::tests::Seen;
    use crate::master::{ClientId, Master, ObjectRecord, RecordUpdate};

    /// A storage node coming back to a restarted master: registered, its record
    /// endpoint attached, and told the master it reconnected (what opens the
    /// recovery window).
    pub(crate) struct Node {
        pub(crate) client: ClientId,
        region: RemoteRegion,
        pub(crate) seen: Arc<Seen>,
    }

    pub(crate) fn node(master: &Master, name: &str) -> Node {
        let client = master.register_client().unwrap().client;
        let seen = Arc::new(Seen::default());
        master.attach_records(client, seen.clone()).unwrap();
        master.reconnected().unwrap();
        Node { client, region: RemoteRegion { endpoint: format!("local://{name}"), region: 1 }, seen }
    }

    /// A version of `k`: its length and checksum tell it, `generation` orders it.
    pub(crate) fn record(version: u32, generation: u64) -> ObjectRecord {
        ObjectRecord { key: "k".into(), offset: 0, len: 100 + u64::from(version), checksum: 1000 + version, generation }
    }

    impl Node {
        /// Re-mounts a 1 MiB segment holding `records`: its id and how many were taken.
        pub(crate) fn remount(&self, master: &Master, records: &[ObjectRecord]) -> (SegmentId, usize) {
            master.remount_segment(self.client, &self.region, 1 << 20, records).unwrap()
        }

        /// Announces an SSD file of `k`'s `version`, stamped `generation`.
        pub(crate) fn announce(&self, master: &Master, version: u32, generation: u64) -> crate::error::Result<()> {
            let r = record(version, generation);
            master.register_disk_objects(self.client, &[("k", r.len, r.checksum, r.generation)]).remove(0)
        }

        /// Whether the node was told to drop its record of `k` in `segment`.
        pub(crate) fn removed(&self, segment: SegmentId) -> bool {
            self.seen
                .0
                .lock()
                .iter()
                .any(|u| matches!(u, RecordUpdate::Removed { segment: s, key, .. } if *s == segment && key == "k"))
        }

        /// The newest generation a `Discard` of `k` told the node (its files of it or
        /// older go).
        pub(crate) fn discarded(&self) -> Option<u64> {
            self.seen
                .0
                .lock()
                .iter()
                .filter_map(|u| match u {
                    RecordUpdate::Discard { key, generation } if key == "k" => Some(*generation),
                    _ => None,
                })
                .max()
        }
    }

    pub(crate) fn master() -> Master {
        Master::new(MasterConfig { track_records: true, ..Default::default() }).unwrap()
    }

    /// A master whose recovery window (one client TTL) closes within half a second.
    pub(crate) fn short_window_master() -> Master {
        Master::new(MasterConfig {
            track_records: true,
            client_ttl: Duration::from_millis(400),
            monitor_interval: Duration::from_millis(10),
            ..Default::default()
        })
        .unwrap()
    }

    /// Heartbeats `nodes` until `master`'s recovery window is closed and `also` no
    /// longer holds.
    pub(crate) fn wait_out_window(master: &Master, nodes: &[&Node], also: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while master.service().recovering_any() || also() {
            assert!(std::time::Instant::now() < deadline, "the window never closed");
            for n in nodes {
                master.heartbeat(n.client).unwrap();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Delivers what the master queued for the nodes without waiting (the removals
    /// of the copies it dropped).
    pub(crate) fn deliver(master: &Master) {
        let svc = master.service();
        svc.await_records(svc.unsent_removals.take("k"));
    }

    /// A node forgotten before `k` was removed and put again comes back first with the
    /// old object; the node of the new put comes back next. The newer copy is the
    /// key's object, and the old one's node is told to drop its record (it was the
    /// other way round: the first copy offered stayed, the newer was dropped).
    #[test]
    fn a_newer_copy_offered_after_an_older_one_replaces_it() {
        let master = master();
        let (a, b) = (node(&master, "a"), node(&master, "b"));
        let (seg_a, taken) = a.remount(&master, &[record(1, 10)]);
        assert_eq!(taken, 1);
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1001);
        let (seg_b, taken) = b.remount(&master, &[record(2, 20)]);
        assert_eq!(taken, 1, "the newer copy was refused");
        let list = master.get_replica_list("k").unwrap();
        assert_eq!((list.len, list.checksum), (102, 1002));
        assert_eq!(list.replicas.iter().map(|r| r.segment).collect::<Vec<_>>(), [seg_b]);
        deliver(&master);
        assert!(a.removed(seg_a), "the old copy's node still lists it");
        assert!(!b.removed(seg_b));
        assert_eq!(master.stats().stale_copies, 1);
    }

    /// The other order: the older copy, offered second, is refused; so is one stamped
    /// implausibly far ahead of the clock (more than a day).
    #[test]
    fn an_older_copy_offered_after_a_newer_one_is_refused() {
        let master = master();
        let (a, b, c) = (node(&master, "a"), node(&master, "b"), node(&master, "c"));
        let (seg_b, _) = b.remount(&master, &[record(2, 20)]);
        let (seg_a, taken) = a.remount(&master, &[record(1, 10)]);
        assert_eq!(taken, 0);
        assert_eq!(c.remount(&master, &[record(3, u64::MAX - 1)]).1, 0, "a copy from the far future was taken");
        let list = master.get_replica_list("k").unwrap();
        assert_eq!(list.checksum, 1002);
        assert_eq!(list.replicas.iter().map(|r| r.segment).collect::<Vec<_>>(), [seg_b]);
        assert!(a.removed(seg_a));
    }

    /// Files and records decide the same way: a newer file replaces an object taken
    /// back from an older record (whose node is told to drop it), a newer record one
    /// taken back from an older file (whose node is told to delete it), and an older
    /// file is refused.
    #[test]
    fn files_and_records_are_ordered_alike() {
        let master = master();
        let (a, b, c) = (node(&master, "a"), node(&master, "b"), node(&master, "c"));
        let (seg_a, _) = a.remount(&master, &[record(1, 10)]);
        b.announce(&master, 2, 21).unwrap();
        let list = master.get_replica_list("k").unwrap();
        assert_eq!((list.checksum, list.disk, list.replicas.len()), (1002, Some(b.client), 0));
        deliver(&master);
        assert!(a.removed(seg_a));
        let (seg_c, taken) = c.remount(&master, &[record(3, 30)]);
        assert_eq!(taken, 1);
        let list = master.get_replica_list("k").unwrap();
        assert_eq!((list.checksum, list.disk), (1003, None));
        assert_eq!(list.replicas.iter().map(|r| r.segment).collect::<Vec<_>>(), [seg_c]);
        deliver(&master);
        assert!(b.discarded().is_some_and(|g| g >= 21), "the old file's node was not told to delete it");
        assert!(matches!(a.announce(&master, 1, 11), Err(Error::AlreadyExists(_))));
        assert_eq!(master.ssd_usage(b.client).map(|(_, used)| used), Some(0), "the old file's usage stays");
    }

    /// An object put on this master is newer than anything a node offers back: a
    /// copy of another object is refused whatever its generation, even after a copy
    /// of the same bytes joined it.
    #[test]
    fn an_object_put_on_this_master_is_never_replaced() {
        let master = master();
        // Put before any node came back (then puts of missing keys wait).
        let a = master.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: "local://a".into(), region: 1 };
        let seg = master.mount_segment(a, &region, 1 << 20).unwrap();
        let name = master.segment_info(seg).unwrap().name;
        let cfg = ReplicateConfig { preferred_segments: vec![name], ..Default::default() };
        master.put_start(a, "k", 101, &cfg).unwrap();
        master.put_end(a, "k", 1001).unwrap();
        let (b, c) = (node(&master, "b"), node(&master, "c"));
        assert_eq!(c.remount(&master, &[record(1, 10)]).1, 1, "a copy of the same bytes joins");
        assert_eq!(b.remount(&master, &[record(2, u64::MAX / 2)]).1, 0);
        assert!(b.announce(&master, 3, u64::MAX / 2).is_err());
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1001);
    }

    /// A node that says it may have missed updates (it was forgotten before the
    /// restart) re-mounts first: what only it holds answers `Recovering` while the
    /// window is open (a node with a newer copy may still come back), never its
    /// bytes. A copy of the same object from another node vouches for it; a newer
    /// copy replaces it; with the window closed, it is served.
    #[test]
    fn what_only_a_node_that_missed_updates_holds_waits_for_the_window() {
        let master = short_window_master();
        let (stale, b, c) = (node(&master, "stale"), node(&master, "b"), node(&master, "c"));
        master.missed_updates(stale.client).unwrap();
        let key =
            |k: &str, version: u32, generation: u64| ObjectRecord { key: k.into(), ..record(version, generation) };
        let records = [key("k", 1, 10), key("same", 1, 10), key("only", 1, 10)];
        let at = |i: u64, r: ObjectRecord| ObjectRecord { offset: i * 4096, ..r };
        let records: Vec<ObjectRecord> = records.into_iter().enumerate().map(|(i, r)| at(i as u64, r)).collect();
        assert_eq!(stale.remount(&master, &records).1, 3);
        for k in ["k", "same", "only"] {
            assert!(matches!(master.get_replica_list(k), Err(Error::Recovering(_))), "{k} served");
            assert!(matches!(master.exists(k), Err(Error::Recovering(_))), "{k} said to exist");
            assert!(matches!(master.object_info(k), Err(Error::Recovering(_))));
        }
        b.remount(&master, &[key("k", 2, 20), at(1, key("same", 1, 10))]);
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1002, "the newer copy is not served");
        assert_eq!(master.get_replica_list("same").unwrap().checksum, 1001, "a vouched copy is withheld");
        assert!(matches!(master.get_replica_list("only"), Err(Error::Recovering(_))));
        // A copy from another node that may have missed updates does not vouch.
        master.missed_updates(c.client).unwrap();
        assert_eq!(c.remount(&master, &[at(2, key("only", 1, 10))]).1, 1);
        assert!(matches!(master.get_replica_list("only"), Err(Error::Recovering(_))));
        wait_out_window(&master, &[&stale, &b, &c], || false);
        assert_eq!(master.get_replica_list("only").unwrap().checksum, 1001, "withheld after the window");
    }

    /// A read handed the old object's replicas may still be copying from them: the
    /// replaced replicas keep their room until it gives its lease back.
    #[test]
    fn a_read_in_flight_keeps_the_replaced_replicas() {
        let master = Master::new(MasterConfig {
            track_records: true,
            default_lease: Duration::from_secs(60),
            ..Default::default()
        })
        .unwrap();
        let (a, b) = (node(&master, "a"), node(&master, "b"));
        let (seg_a, _) = a.remount(&master, &[record(1, 10)]);
        let used = |seg| master.stats().segment_usage.iter().find(|u| u.segment == seg).map_or(0, |u| u.used);
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1001);
        b.remount(&master, &[record(2, 20)]);
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1002);
        assert!(used(seg_a) > 0, "the room of a replica being read was freed");
        master.release_leases(&["k", "k"]).unwrap();
        assert_eq!(used(seg_a), 0);
    }

    /// A restarted master's window closes one client TTL after nodes came back; the
    /// monitor then forgets the generations, and a copy offered later is refused on a
    /// conflict, as before (those nodes were forgotten long ago).
    #[test]
    fn after_the_window_the_first_copy_stays() {
        let master = short_window_master();
        let (a, b) = (node(&master, "a"), node(&master, "b"));
        a.remount(&master, &[record(1, 10)]);
        let remembered = || master.service().index.shard("k").lock().recovered_generation("k").is_some();
        assert!(remembered());
        wait_out_window(&master, &[&a, &b], remembered);
        assert_eq!(b.remount(&master, &[record(2, 20)]).1, 0);
        assert_eq!(master.get_replica_list("k").unwrap().checksum, 1001);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Nodes come back in any order, each with at most one record and one file
        /// of `k`, of any of four versions (the versions' generations in any order;
        /// a version's file is stamped after its records, before the next version):
        /// the master ends with the newest version offered, and every copy of
        /// another version was told to go (its record removed, its file refused or
        /// discarded), so a later restart finds only the newest.
        #[test]
        fn the_newest_version_offered_wins_in_any_order(
            copies in prop::collection::vec((prop::option::of(0u32..4), prop::option::of(0u32..4)), 1..6),
            ranks in Just(vec![0u64, 1, 2, 3]).prop_shuffle(),
            order in Just((0..12usize).collect::<Vec<_>>()).prop_shuffle(),
        ) {
            let gen_of = |version: u32| 100 + 10 * ranks[version as usize];
            let master = master();
            let nodes: Vec<Node> = (0..copies.len()).map(|i| node(&master, &format!("n{i}"))).collect();
            let mut segments = vec![None; nodes.len()];
            let mut refused_files = vec![false; nodes.len()];
            // Each node's record and file, in `order` (steps beyond the nodes skipped).
            for step in order.into_iter().filter(|s| s / 2 < nodes.len()) {
                let (i, file) = (step / 2, step % 2 == 1);
                match (file, copies[i]) {
                    (false, (Some(v), _)) => segments[i] = Some(nodes[i].remount(&master, &[record(v, gen_of(v))]).0),
                    (true, (_, Some(v))) => refused_files[i] = nodes[i].announce(&master, v, gen_of(v) + 1).is_err(),
                    _ => {}
                }
            }
            deliver(&master);
            let offered = copies.iter().flat_map(|&(m, d)| m.into_iter().chain(d));
            let newest = offered.max_by_key(|&v| gen_of(v));
            let Some(newest) = newest else {
                prop_assert!(master.get_replica_list("k").is_err());
                return Ok(());
            };
            let list = master.get_replica_list("k").unwrap();
            prop_assert_eq!(list.checksum, 1000 + newest);
            let mut kept = 0;
            for (i, n) in nodes.iter().enumerate() {
                if let (Some(v), Some(seg)) = (copies[i].0, segments[i]) {
                    let stays = !n.removed(seg);
                    prop_assert!(!stays || v == newest, "node {} keeps a record of version {}", i, v);
                    prop_assert_eq!(stays, list.replicas.iter().any(|r| r.segment == seg));
                    kept += usize::from(stays);
                }
                if let (_, Some(v)) = copies[i] {
                    let stays = !refused_files[i] && n.discarded().is_none_or(|g| g < gen_of(v) + 1);
                    prop_assert!(!stays || v == newest, "node {} keeps a file of version {}", i, v);
                    kept += usize::from(stays);
                }
            }
            prop_assert!(kept > 0, "no copy of the newest version is left");
            if let Some(holder) = list.disk {
                let i = nodes.iter().position(|n| n.client == holder).unwrap();
                prop_assert_eq!(copies[i].1, Some(newest));
            }
        }
    }
}
