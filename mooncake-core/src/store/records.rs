//! The records of a storage node's segment: which objects it holds and where, as the
//! master told it. A restarted master is repopulated from them.
//!
//! The master tells a node of each change either synchronously, on the node's record
//! endpoint (`ApplyRecords`, answered once applied: a put or remove is acknowledged
//! only after that), or with the answers to its heartbeats when the node serves no
//! endpoint or the master has no way to reach it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use mooncake_alloc::SegmentId;
use mooncake_transfer::RegisteredRegion;
use parking_lot::Mutex;

use crate::config::check_value_len;
use crate::error::Result;
use crate::master::{ClientId, MasterApi, ObjectRecord, RecordSink, RecordUpdate};
use crate::rpc::wire::{Request, Response, WireError};
use crate::rpc::RpcHandler;

/// Deletes files of removed objects from this node's SSD tier (the SSD tier
/// implements it; a node without one has none).
pub(crate) trait DiskDiscard: Send + Sync {
    /// Deletes the file of `key` if it was written with `generation` or an older one
    /// (a newer one holds a later put), before returning.
    fn discard(&self, key: &str, generation: u64);
}

/// The objects of this node's segment, by offset.
pub(crate) struct SegmentRecords {
    /// The segment the records describe (its id changes when it is re-mounted).
    segment: AtomicU64,
    records: Mutex<Applied>,
    /// The SSD tier that `Discard` updates are for.
    disk: OnceLock<Arc<dyn DiskDiscard>>,
    /// A master asked this node to drain (`RecordUpdate::Drain`), and whether a drain
    /// runs (`store::drain`).
    pub(crate) drain: super::drain::DrainSignal,
    /// Removals the master handed us to keep (`RecordUpdate::Tombstone`), which the
    /// node offers to a master it registers with again
    /// (`MasterApi::restore_tombstones`): a restarted master learns from them of
    /// removals whose objects a node it forgot may still hold (`master/carried.rs`).
    /// One forgotten (beyond the bounds) lets that removal's object come back if its
    /// old holder returns to a restarted master and no other node kept it.
    kept: Mutex<Removals>,
}

impl Default for SegmentRecords {
    fn default() -> Self {
        Self {
            segment: AtomicU64::new(0),
            records: Default::default(),
            disk: OnceLock::new(),
            drain: Default::default(),
            kept: Mutex::new(Removals::new(MAX_KEPT_TOMBSTONES, MAX_KEPT_KEY_BYTES)),
        }
    }
}

/// Most tombstones a node keeps for the master (the oldest go first beyond it).
const MAX_KEPT_TOMBSTONES: usize = 1 << 16;
/// Most bytes of keys of the tombstones a node keeps (the oldest go first beyond it).
const MAX_KEPT_KEY_BYTES: usize = 16 << 20;
/// Most bytes of keys in one `restore_tombstones` call (a frame holds many times more).
const RESTORE_BATCH_BYTES: usize = 1 << 20;

/// Removals remembered: each key once, with the generation of its newest removal;
/// at most `max_keys` keys and `max_key_bytes` bytes of them, the oldest forgotten
/// first. (The removals a master handed a node to keep; an SSD tier's recent
/// discards.)
pub(crate) struct Removals {
    by_key: HashMap<Arc<str>, u64>,
    /// The keys, oldest first.
    order: std::collections::VecDeque<Arc<str>>,
    /// Bytes of the keys kept.
    key_bytes: usize,
    max_keys: usize,
    max_key_bytes: usize,
}

impl Removals {
    /// None yet, bounded as said.
    pub(crate) fn new(max_keys: usize, max_key_bytes: usize) -> Self {
        Self { by_key: HashMap::new(), order: Default::default(), key_bytes: 0, max_keys, max_key_bytes }
    }

    /// `key` was removed at `generation` (an older removal of it is raised).
    pub(crate) fn keep(&mut self, key: &str, generation: u64) {
        if let Some(g) = self.by_key.get_mut(key) {
            *g = (*g).max(generation);
            return;
        }
        let key: Arc<str> = key.into();
        self.key_bytes += key.len();
        self.by_key.insert(key.clone(), generation);
        self.order.push_back(key);
        while self.order.len() > self.max_keys || self.key_bytes > self.max_key_bytes {
            let Some(old) = self.order.pop_front() else { break };
            self.key_bytes -= old.len();
            self.by_key.remove(&old);
        }
    }

    /// The newest removal of `key` remembered, if any.
    pub(crate) fn get(&self, key: &str) -> Option<u64> {
        self.by_key.get(key).copied()
    }

    /// Every removal remembered, (key, generation), oldest first.
    pub(crate) fn all(&self) -> Vec<(String, u64)> {
        self.order.iter().map(|k| (k.to_string(), self.by_key[k])).collect()
    }
}

/// Most offsets remembered as emptied (with the generation that emptied them) before
/// the oldest are forgotten.
const MAX_CLEARED: usize = 1 << 16;

/// The records by offset, each offset with the generation of its last change.
///
/// Changes may arrive twice (a frame sent again after a timeout, whose first copy the
/// node still applies), late (a copy on a connection the master gave up on), or out
/// of order between the heartbeat answers and the record endpoint: a change of an
/// offset applies only if it is newer than the last one applied there, so the result
/// is the newest change of each offset whatever the arrival order. Emptied offsets are
/// remembered (bounded by [`MAX_CLEARED`]: a late copy arrives within seconds).
#[derive(Default)]
struct Applied {
    by_offset: HashMap<u64, Slot>,
    /// Offsets whose last change was a removal.
    cleared: usize,
    /// While the segment is being mounted: the updates for segments other than the
    /// one it had (its new id is not known until the mount returns, and the master
    /// may place objects there, and tell us, before that), the newest of each offset
    /// of each segment. None may be dropped (the master counts them delivered: a
    /// removal lost would let a removed object come back after a restart), and the
    /// newest of an offset is all that applying them leaves, so they take at most
    /// one entry per offset, as the records do.
    mounting: Option<HashMap<(SegmentId, u64), RecordUpdate>>,
}

/// One offset of the segment.
struct Slot {
    generation: u64,
    record: Option<ObjectRecord>,
}

impl Applied {
    /// Keeps `u`, for a segment not known to be ours yet, while a mount is in
    /// progress, unless a newer change of its offset is kept.
    fn keep_mounting(&mut self, u: RecordUpdate) {
        let Some(kept) = self.mounting.as_mut() else { return };
        let at = match &u {
            RecordUpdate::Added { segment, record } => (*segment, record.offset),
            RecordUpdate::Removed { segment, offset, .. } => (*segment, *offset),
            RecordUpdate::Discard { .. } | RecordUpdate::Drain { .. } | RecordUpdate::Tombstone { .. } => return,
        };
        match kept.entry(at) {
            std::collections::hash_map::Entry::Occupied(mut e) => {
                if e.get().generation() < u.generation() {
                    e.insert(u);
                }
            }
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(u);
            }
        }
    }

    /// Applies one change of the segment, unless a newer one of its offset was.
    fn apply(&mut self, u: RecordUpdate) {
        let generation = u.generation();
        let (offset, record) = match u {
            RecordUpdate::Added { record, .. } => (record.offset, Some(record)),
            // Whatever the offset holds with an older generation predates the removal
            // (the master frees space only after queueing its removal).
            RecordUpdate::Removed { offset, .. } => (offset, None),
            RecordUpdate::Discard { .. } | RecordUpdate::Drain { .. } | RecordUpdate::Tombstone { .. } => return,
        };
        let slot = self.by_offset.entry(offset).or_insert(Slot { generation: 0, record: None });
        if generation <= slot.generation {
            return;
        }
        let was_cleared = slot.generation != 0 && slot.record.is_none();
        slot.generation = generation;
        slot.record = record;
        match (was_cleared, slot.record.is_none()) {
            (false, true) => self.cleared += 1,
            (true, false) => self.cleared -= 1,
            _ => {}
        }
        if self.cleared > MAX_CLEARED {
            self.forget_oldest_cleared();
        }
    }

    /// Forgets the older half of the emptied offsets.
    fn forget_oldest_cleared(&mut self) {
        let mut gens: Vec<u64> = self.by_offset.values().filter(|s| s.record.is_none()).map(|s| s.generation).collect();
        let mid = gens.len() / 2;
        let (_, &mut cut, _) = gens.select_nth_unstable(mid);
        self.by_offset.retain(|_, s| s.record.is_some() || s.generation > cut);
        self.cleared = self.by_offset.values().filter(|s| s.record.is_none()).count();
    }

    fn records(&self) -> impl Iterator<Item = &ObjectRecord> {
        self.by_offset.values().filter_map(|s| s.record.as_ref())
    }
}

impl SegmentRecords {
    /// Records of `segment` (none yet).
    pub(crate) fn new(segment: SegmentId) -> Self {
        Self { segment: AtomicU64::new(segment), ..Default::default() }
    }

    /// `Discard` updates delete files of `disk` from now on.
    pub(crate) fn set_disk(&self, disk: Arc<dyn DiskDiscard>) {
        let _ = self.disk.set(disk);
    }

    /// Applies the master's changes; changes to other segments, and changes of an
    /// offset older than the last one applied there, are ignored. Files of removed
    /// objects are deleted from the SSD tier before this returns.
    pub(crate) fn apply(&self, updates: Vec<RecordUpdate>) {
        let mut discards = Vec::new();
        {
            let mut applied = self.records.lock();
            // Read under the lock `set_segment` changes it under: an update is either
            // applied here or kept for the new segment, never lost between the two.
            let own = self.segment.load(Ordering::Acquire);
            for u in updates {
                match u {
                    RecordUpdate::Discard { key, generation } => discards.push((key, generation)),
                    RecordUpdate::Drain { grace_ms, .. } => self.drain.asked.ask(grace_ms),
                    RecordUpdate::Tombstone { key, generation } => self.kept.lock().keep(&key, generation),
                    u if u.segment() == Some(own) => applied.apply(u),
                    u => applied.keep_mounting(u),
                }
            }
        }
        if let Some(disk) = self.disk.get() {
            for (key, generation) in discards {
                disk.discard(&key, generation);
            }
        }
    }

    /// After registering again (the master restarted, or it forgot us: we expired or
    /// were out of reach): the records to offer it, all of them, for the master takes
    /// back only those no removal or put superseded meanwhile (their generations tell).
    /// Records whose bytes in `region` (the segment) no longer match their checksum,
    /// or that do not lie in it, are dropped.
    pub(crate) fn rejoin(&self, region: &RegisteredRegion) -> Vec<ObjectRecord> {
        let intact = |r: &ObjectRecord| {
            // The range is checked before anything is allocated for it: a record's
            // length is the master's word.
            if check_value_len(r.len).is_err() || region.check_bounds(r.offset, r.len).is_err() {
                return false;
            }
            let mut buf = vec![0u8; r.len as usize];
            region.copy_out(r.offset, &mut buf).is_ok() && crate::checksum::checksum(&buf) == r.checksum
        };
        let mut applied = self.records.lock();
        // What a mount whose answer never came was told is of our memory too (only
        // our segments' changes come here): the objects placed there meanwhile were
        // acknowledged, and a master that forgot that mount's client has them only
        // from these records. Kept as well, for the case the master answers with
        // that same segment (`set_segment` applies them again; nothing changes).
        let unfinished: Vec<RecordUpdate> =
            applied.mounting.as_ref().map(|kept| kept.values().cloned().collect()).unwrap_or_default();
        for u in unfinished {
            applied.apply(u);
        }
        // The segment is mounted under a new id: changes of the old one (late copies)
        // are ignored by their segment, and the new master's generations start afresh
        // here (its clock may be behind the old one's).
        applied.by_offset.retain(|_, s| s.record.as_ref().is_some_and(&intact));
        for s in applied.by_offset.values_mut() {
            s.generation = 0;
        }
        applied.cleared = 0;
        applied.records().cloned().collect()
    }

    /// A mount (or re-mount) of the segment starts: until [`set_segment`](Self::set_segment)
    /// names its new id, updates for other segments are kept rather than ignored.
    /// What an earlier mount that never finished kept stays: its answer may have been
    /// lost while the master placed objects there and told us, and the master hands
    /// that segment to our next mount (the same memory), answering with its id.
    pub(crate) fn begin_mount(&self) {
        self.records.lock().mounting.get_or_insert_default();
    }

    /// The segment was mounted (again) under `segment`: the updates for it that came
    /// while the mount was in progress are applied.
    pub(crate) fn set_segment(&self, segment: SegmentId) {
        let mut applied = self.records.lock();
        self.segment.store(segment, Ordering::Release);
        for ((of, _), u) in applied.mounting.take().unwrap_or_default() {
            if of == segment {
                applied.apply(u);
            }
        }
    }

    /// The removals the master handed us to keep: (key, generation of the removal),
    /// oldest first.
    pub(crate) fn kept_tombstones(&self) -> Vec<(String, u64)> {
        self.kept.lock().all()
    }

    /// Hands `master`, which knows us as `client`, the removals we keep
    /// (`MasterApi::restore_tombstones`), in calls of at most
    /// [`RESTORE_BATCH_BYTES`] of keys; none when we keep none.
    pub(crate) fn offer_tombstones(&self, master: &dyn MasterApi, client: ClientId) -> Result<()> {
        let kept = self.kept_tombstones();
        let mut rest = kept.as_slice();
        while !rest.is_empty() {
            let mut bytes = 0;
            let n = rest.iter().take_while(|(k, _)| {
                bytes += k.len();
                bytes <= RESTORE_BATCH_BYTES
            });
            let n = n.count().max(1);
            let items: Vec<(&str, u64)> = rest[..n].iter().map(|(k, g)| (k.as_str(), *g)).collect();
            master.restore_tombstones(client, &items)?;
            rest = &rest[n..];
        }
        Ok(())
    }

    /// A copy of the records.
    pub(crate) fn snapshot(&self) -> Vec<ObjectRecord> {
        self.records.lock().records().cloned().collect()
    }
}

/// The in-process form of the record endpoint (a store on a [`Master`](crate::Master)
/// of the same process).
impl RecordSink for SegmentRecords {
    fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
        self.apply(updates.to_vec());
        Ok(())
    }
}

impl RpcHandler for SegmentRecords {
    fn handle(&self, request: Request) -> Response {
        match request {
            Request::ApplyRecords { updates } => {
                self.apply(updates);
                Response::Unit
            }
            _ => Response::Error(WireError::InvalidArgument(
                "this is a storage node's record endpoint: it answers only record updates".into(),
            )),
        }
    }

    /// Applying updates is a few map operations under one lock, and a put waits for
    /// it: answered on the event-loop thread, without a hop to a worker and back.
    fn answers_inline(&self, kind: usize) -> bool {
        kind == Request::APPLY_RECORDS_KIND
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A change the master makes at one of a few offsets, in its order.
    fn changes() -> impl Strategy<Value = Vec<(bool, u8, u8)>> {
        proptest::collection::vec((any::<bool>(), 0u8..3, 0u8..4), 1..40)
    }

    /// The updates a master sends for `changes` (an add where the offset is free, a
    /// removal of what it holds), with increasing generations.
    fn updates_of(segment: SegmentId, changes: &[(bool, u8, u8)]) -> Vec<RecordUpdate> {
        let mut held: HashMap<u64, String> = HashMap::new();
        let mut out = Vec::new();
        for (i, &(add, slot, key)) in changes.iter().enumerate() {
            let (offset, generation) = (u64::from(slot) * 64, 100 + i as u64);
            match (add, held.get(&offset)) {
                (true, None) => {
                    let key = format!("k{key}-{i}");
                    held.insert(offset, key.clone());
                    let record = ObjectRecord { key, offset, len: 1, checksum: 0, generation };
                    out.push(RecordUpdate::Added { segment, record });
                }
                (false, Some(_)) => {
                    let key = held.remove(&offset).unwrap();
                    out.push(RecordUpdate::Removed { segment, key, offset, generation });
                }
                _ => {}
            }
        }
        out
    }

    /// `updates` as they may arrive: every one at least once, then the ones `order`
    /// picks again, each inserted anywhere (sent again, overtaken).
    fn arrivals(updates: &[RecordUpdate], order: &[u16]) -> Vec<RecordUpdate> {
        let mut arrivals = updates.to_vec();
        for pick in order {
            if !updates.is_empty() {
                let u = updates[*pick as usize % updates.len()].clone();
                arrivals.insert(*pick as usize % (arrivals.len() + 1), u);
            }
        }
        arrivals
    }

    fn state(r: &SegmentRecords) -> Vec<(u64, String)> {
        let mut v: Vec<(u64, String)> = r.snapshot().into_iter().map(|r| (r.offset, r.key)).collect();
        v.sort();
        v
    }

    /// Updates for the segment's new id that arrive while it is being re-mounted
    /// (before the mount's answer names the id) are applied once it is known; those
    /// of other segments, and of the old id afterwards, are not.
    #[test]
    fn updates_for_a_segment_being_mounted_wait_for_its_id() {
        let added = |segment, key: &str, offset, generation| RecordUpdate::Added {
            segment,
            record: ObjectRecord { key: key.into(), offset, len: 1, checksum: 0, generation },
        };
        let records = SegmentRecords::new(7);
        records.apply(vec![added(7, "old", 0, 1)]);
        records.begin_mount();
        records.apply(vec![added(9, "new", 64, 2), added(8, "other", 128, 3)]);
        assert_eq!(state(&records), [(0, "old".to_owned())], "nothing applied before the id is known");
        records.set_segment(9);
        assert_eq!(state(&records), [(0, "old".to_owned()), (64, "new".to_owned())]);
        records.apply(vec![added(7, "late", 192, 4), added(9, "after", 256, 5)]);
        assert_eq!(state(&records), [(0, "old".to_owned()), (64, "new".to_owned()), (256, "after".to_owned())]);
        // Without a mount in progress, other segments' updates are not kept.
        records.apply(vec![added(10, "stray", 320, 6)]);
        records.set_segment(10);
        assert_eq!(state(&records).len(), 3);
    }

    /// However many updates for the segment being mounted arrive before the mount's
    /// answer names its id (a re-mount's refused records, each removed, and the puts
    /// placed there meanwhile), none is dropped: the master counts them delivered,
    /// and a removal dropped would let a removed object come back after a restart.
    /// Before, those past the first 65,536 were dropped, answered as applied.
    #[test]
    fn every_update_for_a_segment_being_mounted_is_kept() {
        const N: u64 = 100_000;
        let records = SegmentRecords::new(7);
        records.begin_mount();
        let added = |i: u64, generation| RecordUpdate::Added {
            segment: 9,
            record: ObjectRecord { key: format!("k{i}"), offset: i * 64, len: 1, checksum: 0, generation },
        };
        records.apply((0..N).map(|i| added(i, 10 + i)).collect());
        let removed =
            |i: u64| RecordUpdate::Removed { segment: 9, key: format!("k{i}"), offset: i * 64, generation: 10 * N + i };
        // Removals of the even ones, one of them arriving again, and a copy of an add
        // older than its removal, arriving late.
        records.apply((0..N).step_by(2).map(removed).chain([removed(0), added(2, 12)]).collect());
        records.set_segment(9);
        let held = state(&records);
        assert_eq!(held.len() as u64, N / 2);
        assert!(held.iter().all(|(offset, key)| offset / 64 % 2 == 1 && *key == format!("k{}", offset / 64)));
    }

    /// On a rejoin only records whose bytes still lie in the segment and match their
    /// checksum are offered; one whose range is outside the segment (a length of
    /// 2^50, an offset past the end) is dropped before anything is allocated for it.
    #[test]
    fn a_rejoin_offers_only_intact_records_inside_the_segment() {
        let engine = mooncake_transfer::TransferEngine::new();
        let region = engine.register_region(1 << 16).unwrap();
        let value = b"kv block bytes";
        region.copy_in(4096, value).unwrap();
        let crc = crate::checksum::checksum(value);
        let record = |key: &str, offset: u64, len: u64, checksum: u32, generation: u64| RecordUpdate::Added {
            segment: 7,
            record: ObjectRecord { key: key.into(), offset, len, checksum, generation },
        };
        let records = SegmentRecords::new(7);
        records.apply(vec![
            record("good", 4096, value.len() as u64, crc, 1),
            record("changed", 4096 + 1024, value.len() as u64, crc, 2),
            record("huge", 0, 1 << 50, crc, 3),
            record("past-the-end", u64::MAX - 4, 8, crc, 4),
            record("overflowing", 1 << 15, u64::MAX, crc, 5),
        ]);
        let offered: Vec<String> = records.rejoin(&region).into_iter().map(|r| r.key).collect();
        assert_eq!(offered, ["good"]);
    }

    /// A mount whose answer never came was told of objects placed on its segment
    /// (acknowledged puts): the next rejoin offers them, and without the removals it
    /// was told of.
    #[test]
    fn a_rejoin_offers_what_an_unanswered_mount_was_told() {
        let engine = mooncake_transfer::TransferEngine::new();
        let region = engine.register_region(1 << 16).unwrap();
        let value = b"placed while the answer was lost";
        let crc = crate::checksum::checksum(value);
        for offset in [0, 4096, 8192] {
            region.copy_in(offset, value).unwrap();
        }
        let added = |segment: u64, key: &str, offset: u64, generation: u64| RecordUpdate::Added {
            segment,
            record: ObjectRecord { key: key.into(), offset, len: value.len() as u64, checksum: crc, generation },
        };
        let records = SegmentRecords::new(7);
        records.apply(vec![added(7, "before", 0, 1), added(7, "removed", 8192, 2)]);
        // The mount of segment 9 begins; its answer is lost.
        records.begin_mount();
        let removed = RecordUpdate::Removed { segment: 9, key: "removed".into(), offset: 8192, generation: 4 };
        records.apply(vec![added(9, "placed", 4096, 3), removed]);
        let mut offered: Vec<String> = records.rejoin(&region).into_iter().map(|r| r.key).collect();
        offered.sort();
        assert_eq!(offered, ["before", "placed"]);
    }

    proptest! {
        /// Whatever the order updates arrive in, however often each arrives (a frame
        /// sent again after a timeout, a late copy, heartbeat answers overtaken by the
        /// record endpoint), the records end as the master's order leaves them.
        #[test]
        fn records_end_as_the_masters_order_leaves_them(
            changes in changes(),
            order in proptest::collection::vec(any::<u16>(), 0..80),
            foreign in any::<bool>(),
        ) {
            let updates = updates_of(7, &changes);
            let in_order = SegmentRecords::new(7);
            in_order.apply(updates.clone());
            let mut arrivals = arrivals(&updates, &order);
            if foreign {
                // Changes of another segment (an old mount) change nothing.
                arrivals.extend(updates_of(8, &changes));
            }
            let shuffled = SegmentRecords::new(7);
            for chunk in arrivals.chunks(3) {
                shuffled.apply(chunk.to_vec());
            }
            prop_assert_eq!(state(&shuffled), state(&in_order));
        }

        /// The same for updates that arrive while the segment is being mounted,
        /// kept until the mount's answer names its id (the newest of each offset), also
        /// across a second mount begun after the first one's answer was lost.
        #[test]
        fn records_kept_during_a_mount_end_as_the_masters_order_leaves_them(
            before in changes(),
            changes in changes(),
            order in proptest::collection::vec(any::<u16>(), 0..80),
            split in any::<u8>(),
            again in any::<bool>(),
        ) {
            // What it had, under the id of its previous mount.
            let old = updates_of(7, &before);
            let updates = updates_of(9, &changes);
            let in_order = SegmentRecords::new(7);
            in_order.apply(old.clone());
            in_order.set_segment(9);
            in_order.apply(updates.clone());
            let arrivals = arrivals(&updates, &order);
            let mounting = SegmentRecords::new(7);
            mounting.apply(old);
            mounting.begin_mount();
            // Some arrive before the answer, the rest after it.
            let split = split as usize % (arrivals.len() + 1);
            for chunk in arrivals[..split].chunks(3) {
                mounting.apply(chunk.to_vec());
            }
            if again {
                // The first mount's answer was lost: a second mount, which the master
                // answers with the same segment, keeps what the first kept.
                mounting.begin_mount();
            }
            mounting.set_segment(9);
            mounting.apply(arrivals[split..].to_vec());
            prop_assert_eq!(state(&mounting), state(&in_order));
        }
    }

    /// Removals the master hands us to keep: each key once with its newest removal,
    /// about no segment (a mount in progress keeps none of them aside), at most
    /// `MAX_KEPT_TOMBSTONES`, the oldest forgotten first.
    #[test]
    fn kept_tombstones_are_bounded_and_keep_the_newest_removal() {
        let records = SegmentRecords::new(1);
        records.begin_mount();
        let kept = |key: &str, generation| RecordUpdate::Tombstone { key: key.into(), generation };
        records.apply(vec![kept("a", 5), kept("b", 7), kept("a", 9), kept("a", 3)]);
        assert_eq!(records.kept_tombstones(), [("a".to_string(), 9), ("b".to_string(), 7)]);
        assert!(records.snapshot().is_empty());
        records.apply((0..MAX_KEPT_TOMBSTONES as u64).map(|i| kept(&format!("k{i}"), i + 10)).collect());
        let all = records.kept_tombstones();
        assert_eq!(all.len(), MAX_KEPT_TOMBSTONES);
        assert!(all.iter().all(|(k, _)| k != "a" && k != "b"), "the oldest were kept");
        assert_eq!(all.last(), Some(&(format!("k{}", MAX_KEPT_TOMBSTONES - 1), MAX_KEPT_TOMBSTONES as u64 + 9)));
        // Long keys: bounded by their bytes as well.
        let long = |i: usize| format!("{i:04}{}", "x".repeat(crate::config::MAX_KEY_LEN - 4));
        records.apply((0..MAX_KEPT_KEY_BYTES / crate::config::MAX_KEY_LEN + 8).map(|i| kept(&long(i), 1)).collect());
        let all = records.kept_tombstones();
        assert!(all.iter().map(|(k, _)| k.len()).sum::<usize>() <= MAX_KEPT_KEY_BYTES);
        assert_eq!(all.last().map(|(k, _)| k.clone()), Some(long(MAX_KEPT_KEY_BYTES / crate::config::MAX_KEY_LEN + 7)));
    }
}

/// The master's side and the node's side of records sent ahead, over real sockets.
#[cfg(test)]
mod sent_ahead {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use mooncake_transfer::RemoteRegion;

    use super::SegmentRecords;
    use crate::master::{Master, MasterApi};
    use crate::rpc::{RpcMasterClient, RpcRecordConnector, RpcServer, RpcServerConfig};
    use crate::{MasterConfig, ReplicateConfig};

    /// Waits up to 2 s for `f` to hold.
    fn eventually(mut f: impl FnMut() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        f()
    }

    /// A master daemon's put that declares its checksum: the node has the record once
    /// the start is answered, before the put ends (the master wrote it ahead after
    /// answering; nothing else asked for it); the end adds nothing and is answered.
    #[test]
    fn a_declared_put_reaches_its_node_before_it_ends() {
        let master = Master::new(MasterConfig::served()).unwrap();
        master.set_record_connector(Arc::new(RpcRecordConnector::new(Duration::from_secs(2))));
        let server =
            RpcServer::serve_with("127.0.0.1:0", master.service().clone(), RpcServerConfig::default()).unwrap();
        let client = RpcMasterClient::connect(&server.local_addr().to_string()).unwrap();
        let node = client.register_client().unwrap().client;
        let region = RemoteRegion { endpoint: "127.0.0.1:1".into(), region: 1 };
        let segment = client.mount_segment(node, &region, 1 << 20).unwrap();
        let records = Arc::new(SegmentRecords::new(segment));
        let key: [u8; crate::rpc::RECORD_KEY_LEN] = rand::random();
        let config = RpcServerConfig { secret: Some(crate::rpc::record_endpoint_secret(&key)), ..Default::default() };
        let endpoint = RpcServer::serve_with("127.0.0.1:0", records.clone(), config).unwrap();
        client.mount_records(node, &endpoint.local_addr().to_string(), &key).unwrap();
        // One put first: the master's connection to the node is open (a record is
        // written ahead only over an open connection, never one it must dial).
        let cfg = ReplicateConfig::default();
        client.put_start(node, "first", 100, &cfg).unwrap();
        client.put_end(node, "first", 1).unwrap();
        assert_eq!(records.snapshot().len(), 1);

        client.put_start_summed(node, "d", 200, 42, &cfg).unwrap();
        let recorded = || records.snapshot().iter().any(|r| r.key == "d" && r.checksum == 42 && r.len == 200);
        assert!(eventually(recorded), "the record did not reach the node before the put ended");
        client.put_end(node, "d", 42).unwrap();
        assert_eq!(records.snapshot().len(), 2, "the end recorded it again");
        assert_eq!(client.get_replica_list("d").unwrap().checksum, 42);
        // Called off: the removal goes with the node's next heartbeat (the frame
        // written ahead for the start waits for its answer to be read first).
        client.put_start_summed(node, "r", 200, 7, &cfg).unwrap();
        assert!(eventually(|| records.snapshot().iter().any(|r| r.key == "r")));
        client.put_revoke(node, "r").unwrap();
        client.heartbeat(node).unwrap();
        assert!(eventually(|| records.snapshot().iter().all(|r| r.key != "r")), "the revoked put's record stayed");
    }
}
