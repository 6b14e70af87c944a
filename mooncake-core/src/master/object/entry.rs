//! What the master keeps per object: its entry and replicas.

use mooncake_alloc::{AllocatedBuffer, CompactBuffer, SegmentId};
use smallvec::SmallVec;

use crate::master::record_link::RecordWait;
use crate::master::types::{ClientId, MemoryReplica};

/// One replica as the master keeps it: the range (freed when dropped) and whether its
/// bytes are all written (the buffer's `filled` flag). Its length is the object's
/// (every replica of an object has it), so the replica does not keep it.
pub(crate) struct StoredReplica {
    buf: CompactBuffer,
}

impl StoredReplica {
    pub(crate) fn new(buf: AllocatedBuffer, complete: bool) -> Self {
        let mut buf = CompactBuffer::from(buf);
        buf.set_filled(complete);
        Self { buf }
    }

    pub(crate) fn segment(&self) -> SegmentId {
        self.buf.segment_id()
    }

    pub(crate) fn offset(&self) -> u64 {
        self.buf.offset()
    }

    /// Its bytes are all written: readable.
    pub(crate) fn complete(&self) -> bool {
        self.buf.filled()
    }

    pub(crate) fn set_complete(&mut self) {
        self.buf.set_filled(true);
    }

    /// Where its bytes are, for an object of `len` bytes.
    pub(crate) fn memory(&self, len: u64) -> MemoryReplica {
        MemoryReplica { segment: self.segment(), offset: self.offset(), len }
    }
}

/// An object's replicas: the usual one inline, more on the heap.
pub(crate) type Replicas = SmallVec<[StoredReplica; 1]>;

/// Metadata of one object. Times are milliseconds of the master's clock.
///
/// 72 bytes (see the `memory` bench): what only some objects have lives in `extra`,
/// the length takes 32 bits (values are 1 byte ..= 4 GiB), and one field means the
/// put's owner while the put is in progress and the read lease's end once complete.
pub(crate) struct ObjectEntry {
    pub(crate) replicas: Replicas,
    /// While processing: when the put started. Once complete: last read or write.
    pub(crate) last_access_ms: u64,
    /// While processing: the client whose put created the entry (it alone may end or
    /// revoke it). Once complete: until when the reads in flight may hold the object,
    /// the safety net for a reader that died before releasing its lease. Read through
    /// [`owner`](Self::owner) and [`lease_until_ms`](Self::lease_until_ms).
    holder: u64,
    /// The disk replica, a pending offload, a pin's TTL, an upsert (`None`: none of
    /// them, the usual case).
    pub(crate) extra: Option<Box<Extra>>,
    /// The length minus one.
    len_minus_one: u32,
    pub(crate) checksum: u32,
    /// Reads (and replica copies) in flight: each replica-list call adds one, each
    /// release takes one away. The object is leased while this is above zero and
    /// `lease_until_ms` has not passed.
    pub(crate) readers: u32,
    pub(crate) soft_pin: bool,
    /// `PutEnd` seen: readable.
    complete: bool,
    /// Made from a copy a node offered back (a re-mounted record, an announced file)
    /// and not changed since: a newer copy offered later may replace it
    /// (`master/recovered.rs`).
    recovered: bool,
    /// Made from copies only of nodes that may have missed updates: not served
    /// while a recovery window is open (`master/recovered.rs`).
    unconfirmed: bool,
}

/// What only some objects have, in one side box: the disk replica, a pending
/// offload, a pin's TTL, and an upsert's replacement side (the new replicas it is
/// filling and the old ones it replaced, kept until the reads that may use them are
/// over). Dropped when all of it is back to its default.
#[derive(Default)]
pub(crate) struct Extra {
    /// The client whose SSD holds a `LocalDisk` replica (0: none).
    pub(crate) disk: ClientId,
    /// While an offload of the object is asked for and not yet reported: until when
    /// the master waits for it (0: none). Eviction skips the object meanwhile, and
    /// treats it as an ordinary (droppable) one once the deadline passed.
    pub(crate) offload_deadline_ms: u64,
    /// With `soft_pin`: how long the pin outlives the last access (ms; 0: as long as
    /// the object lives). Each read renews it, as `last_access_ms` moves.
    pub(crate) soft_pin_ttl_ms: u32,
    /// The upsert being written, if any.
    pub(crate) staged: Option<StagedUpsert>,
    /// Replaced replicas, each with the time after which no read that was given it
    /// can still hold a lease.
    pub(crate) retired: Vec<(u64, StoredReplica)>,
    /// A put that declared its checksum: the tickets of the records its declaration queued,
    /// which its end waits for.
    pub(crate) declared_records: Option<RecordWait>,
}

impl Extra {
    fn is_empty(&self) -> bool {
        self.disk == 0
            && self.offload_deadline_ms == 0
            && self.soft_pin_ttl_ms == 0
            && self.staged.is_none()
            && self.retired.is_empty()
            && self.declared_records.is_none()
    }
}

/// An upsert between its start and its end: new replicas being written while the
/// object's current ones stay readable.
pub(crate) struct StagedUpsert {
    /// The client writing it (it alone may end or revoke it).
    pub(crate) owner: ClientId,
    /// Tells this upsert from a later one of the same key.
    pub(crate) id: u64,
    /// Length of the new value.
    pub(crate) len: u64,
    /// Until when the writer may end it (`put_timeout` after it started); then it is
    /// abandoned, and its replicas are taken out at the next occasion and kept a put
    /// timeout more (its writer may still be writing them) before they are freed.
    pub(crate) until_ms: u64,
    /// Pin state the object takes when the upsert ends (`None`: the one it has).
    pub(crate) soft_pin: Option<bool>,
    /// How long that pin outlives the last access (ms; 0: as long as the object lives).
    pub(crate) soft_pin_ttl_ms: u32,
    /// The new replicas (empty while they are being placed).
    pub(crate) replicas: Replicas,
}

/// The 32 bits a length takes in an entry (values are 1 byte ..= 4 GiB; the callers
/// check with `check_value_len`).
fn len_bits(len: u64) -> u32 {
    debug_assert!((1..=1 << 32).contains(&len), "value length {len}");
    len.saturating_sub(1).min(u32::MAX.into()) as u32
}

impl ObjectEntry {
    /// An entry whose put by `owner` starts at `now_ms`.
    pub(crate) fn new(len: u64, owner: ClientId, now_ms: u64) -> Self {
        Self {
            replicas: Replicas::new(),
            last_access_ms: now_ms,
            holder: owner,
            extra: None,
            len_minus_one: len_bits(len),
            checksum: 0,
            readers: 0,
            soft_pin: false,
            complete: false,
            recovered: false,
            unconfirmed: false,
        }
    }

    /// A readable entry, last accessed at `now_ms`.
    pub(crate) fn new_complete(len: u64, checksum: u32, now_ms: u64) -> Self {
        let mut e = Self::new(len, 0, now_ms);
        e.checksum = checksum;
        e.mark_complete();
        e
    }

    /// Length of the value.
    pub(crate) fn len(&self) -> u64 {
        u64::from(self.len_minus_one) + 1
    }

    /// Sets the length (1 byte ..= 4 GiB).
    pub(crate) fn set_len(&mut self, len: u64) {
        self.len_minus_one = len_bits(len);
    }

    /// `PutEnd` seen: readable.
    pub(crate) fn complete(&self) -> bool {
        self.complete
    }

    /// The put ended: the object is readable, and not leased yet.
    pub(crate) fn mark_complete(&mut self) {
        self.complete = true;
        self.holder = 0;
        self.readers = 0;
        let _ = self.take_declared_records();
    }

    /// A put in progress that declared its checksum (`checksum`), when it started
    /// (`put_start_summed`) or since (`put_declare`): its replicas' records were
    /// queued for their nodes then, so that they travel while the bytes are written.
    /// Dropping it must tell them.
    pub(crate) fn declared(&self) -> bool {
        !self.complete && self.extra.as_deref().is_some_and(|x| x.declared_records.is_some())
    }

    /// The put in progress declared its checksum; `wait` holds the tickets of the
    /// records the declaration queued.
    pub(crate) fn set_declared(&mut self, wait: RecordWait) {
        self.extra_mut().declared_records = Some(wait);
    }

    /// The tickets of the records this put's declaration queued (taken).
    pub(crate) fn take_declared_records(&mut self) -> RecordWait {
        let wait = self.extra.as_mut().and_then(|x| x.declared_records.take()).unwrap_or_default();
        self.tidy_extra();
        wait
    }

    /// The client whose put is in progress (`None` once complete).
    pub(crate) fn owner(&self) -> Option<ClientId> {
        (!self.complete).then_some(self.holder)
    }

    /// Until when the reads in flight may hold the object (0 while the put is in
    /// progress: no reads then).
    pub(crate) fn lease_until_ms(&self) -> u64 {
        if self.complete {
            self.holder
        } else {
            0
        }
    }

    /// The side box, made if there is none.
    pub(crate) fn extra_mut(&mut self) -> &mut Extra {
        self.extra.get_or_insert_with(Default::default)
    }

    /// Drops the side box if nothing in it is set.
    fn tidy_extra(&mut self) {
        if self.extra.as_deref().is_some_and(Extra::is_empty) {
            self.extra = None;
        }
    }

    /// Sets one field of the side box (chosen by `field`): a zero value creates no box,
    /// and a box left with nothing set is dropped.
    fn set_extra<T: Default + PartialEq>(&mut self, value: T, field: impl FnOnce(&mut Extra) -> &mut T) {
        if value != T::default() || self.extra.is_some() {
            *field(self.extra_mut()) = value;
            self.tidy_extra();
        }
    }

    /// The client whose SSD holds a `LocalDisk` replica (0: none).
    pub(crate) fn disk(&self) -> ClientId {
        self.extra.as_deref().map_or(0, |x| x.disk)
    }

    /// Sets the client whose SSD holds a `LocalDisk` replica (0: none).
    pub(crate) fn set_disk(&mut self, client: ClientId) {
        self.set_extra(client, |x| &mut x.disk);
    }

    /// Until when an asked-for offload is waited for (0: none).
    pub(crate) fn offload_deadline_ms(&self) -> u64 {
        self.extra.as_deref().map_or(0, |x| x.offload_deadline_ms)
    }

    /// Sets until when an asked-for offload is waited for (0: none).
    pub(crate) fn set_offload_deadline_ms(&mut self, until_ms: u64) {
        self.set_extra(until_ms, |x| &mut x.offload_deadline_ms);
    }

    /// With `soft_pin`: how long the pin outlives the last access (ms; 0: as long as
    /// the object lives).
    pub(crate) fn soft_pin_ttl_ms(&self) -> u32 {
        self.extra.as_deref().map_or(0, |x| x.soft_pin_ttl_ms)
    }

    /// Sets the pin and its TTL (ms; 0: as long as the object lives).
    pub(crate) fn set_soft_pin(&mut self, pin: bool, ttl_ms: u32) {
        self.soft_pin = pin;
        self.set_extra(ttl_ms, |x| &mut x.soft_pin_ttl_ms);
    }

    /// Held by a read in flight, or by an upsert being written (which will replace
    /// the replicas and must find the object where it left it).
    pub(crate) fn leased(&self, now_ms: u64) -> bool {
        (self.readers > 0 && self.lease_until_ms() > now_ms) || self.staged(now_ms).is_some()
    }

    /// One more read in flight, for at most `ttl_ms`. Reads whose lease ran out were
    /// never released (their client died): they no longer count.
    /// Only complete objects are read (the field holds the owner before).
    /// Returns the replicas of an upsert whose writer gave up, as
    /// [`tidy_upsert`](Self::tidy_upsert) does.
    #[must_use = "an abandoned upsert's replicas are quarantined, not dropped"]
    pub(crate) fn lease(&mut self, now_ms: u64, ttl_ms: u64) -> Option<Replicas> {
        debug_assert!(self.complete, "only complete objects are leased");
        if !self.complete {
            return None;
        }
        if self.holder <= now_ms {
            self.readers = 0;
        }
        let abandoned = self.tidy_upsert(now_ms);
        self.readers = self.readers.saturating_add(1);
        self.holder = self.holder.max(now_ms + ttl_ms);
        abandoned
    }

    /// One read in flight less.
    pub(crate) fn release(&mut self) {
        self.readers = self.readers.saturating_sub(1);
        if self.readers == 0 {
            self.drop_retired(0);
            self.tidy_extra();
        }
    }

    /// Frees what an upsert left behind that nothing can use anymore: replaced
    /// replicas (all of them when no read is in flight, else those whose readers'
    /// leases ran out by `now_ms`); and takes out an upsert whose writer gave up (its
    /// time ran out by `now_ms`), returning its replicas: its writer may still be
    /// writing them, so the master keeps them out of every object's reach a while
    /// (`quarantine_abandoned_upsert`) instead of freeing them here.
    #[must_use = "an abandoned upsert's replicas are quarantined, not dropped"]
    pub(crate) fn tidy_upsert(&mut self, now_ms: u64) -> Option<Replicas> {
        self.drop_retired(now_ms);
        let abandoned = self
            .extra
            .as_deref_mut()
            .and_then(|u| u.staged.take_if(|s| s.until_ms <= now_ms))
            .map(|s| s.replicas)
            .filter(|r| !r.is_empty());
        self.tidy_extra();
        abandoned
    }

    /// Frees the replaced replicas no read can use anymore (see
    /// [`tidy_upsert`](Self::tidy_upsert)).
    fn drop_retired(&mut self, now_ms: u64) {
        let Some(u) = self.extra.as_deref_mut() else { return };
        if self.readers == 0 {
            u.retired.clear();
        } else {
            u.retired.retain(|(until, _)| *until > now_ms);
        }
    }

    /// Made from a copy a node offered back, and not changed since.
    pub(crate) fn recovered(&self) -> bool {
        self.recovered
    }

    /// Marks the entry as made from a copy a node offered back (or not).
    pub(crate) fn set_recovered(&mut self, recovered: bool) {
        self.recovered = recovered;
    }

    /// Made from copies only of nodes that may have missed updates.
    pub(crate) fn unconfirmed(&self) -> bool {
        self.unconfirmed
    }

    /// Marks the entry as made from copies only of nodes that may have missed
    /// updates (or not).
    pub(crate) fn set_unconfirmed(&mut self, unconfirmed: bool) {
        self.unconfirmed = unconfirmed;
    }

    /// Takes the replicas out, keeping them (retired) until `until_ms` while reads are
    /// in flight, as an upsert's swap does; freed at once when none is. Returns
    /// whether some are kept.
    pub(crate) fn retire_replicas(&mut self, until_ms: u64, now_ms: u64) -> bool {
        let old = std::mem::take(&mut self.replicas);
        if old.is_empty() || self.readers == 0 || self.lease_until_ms() <= now_ms {
            return false;
        }
        self.extra_mut().retired.extend(old.into_iter().map(|r| (until_ms, r)));
        true
    }

    /// Whether the entry holds retired replicas (see [`tidy_upsert`](Self::tidy_upsert)).
    pub(crate) fn has_retired(&self) -> bool {
        self.extra.as_deref().is_some_and(|x| !x.retired.is_empty())
    }

    /// Takes the replicas of an upsert under way or abandoned (its writer may be
    /// writing them), with the time its writer may write until. For an entry about
    /// to be removed.
    pub(crate) fn take_staged_replicas(&mut self) -> Option<(u64, Replicas)> {
        let staged = self.extra.as_deref_mut()?.staged.take()?;
        self.tidy_extra();
        (!staged.replicas.is_empty()).then_some((staged.until_ms, staged.replicas))
    }

    /// The upsert in progress, if its writer's time has not run out at `now_ms`.
    pub(crate) fn staged(&self, now_ms: u64) -> Option<&StagedUpsert> {
        self.extra.as_deref()?.staged.as_ref().filter(|s| s.until_ms > now_ms)
    }

    /// Soft-pinned at `now_ms`: a pin with a TTL ends that long after the last access.
    pub(crate) fn pinned(&self, now_ms: u64) -> bool {
        self.soft_pin
            && (self.soft_pin_ttl_ms() == 0
                || now_ms < self.last_access_ms.saturating_add(self.soft_pin_ttl_ms().into()))
    }

    /// An offload was asked for and may still come.
    pub(crate) fn offload_pending(&self, now_ms: u64) -> bool {
        self.offload_deadline_ms() > now_ms
    }

    /// Bytes of memory this object holds (on every segment, or on one).
    pub(crate) fn memory_bytes(&self, segment: Option<SegmentId>) -> u64 {
        self.replicas.iter().filter(|r| segment.is_none_or(|s| r.segment() == s)).count() as u64 * self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_and_lease_share_a_field_without_mixing() {
        let mut e = ObjectEntry::new(4096, 7, 100);
        assert_eq!((e.owner(), e.lease_until_ms(), e.complete()), (Some(7), 0, false));
        assert!(!e.leased(100), "a put in progress is not leased by its owner's id");
        e.mark_complete();
        assert_eq!((e.owner(), e.lease_until_ms()), (None, 0));
        assert!(!e.leased(100));
        assert!(e.lease(100, 50).is_none());
        assert_eq!((e.readers, e.lease_until_ms()), (1, 150));
        assert!(e.leased(149) && !e.leased(150));
        e.release();
        assert!(!e.leased(120));
    }

    #[test]
    fn lengths_take_32_bits() {
        for len in [1, 4096, (1 << 32) - 1, 1 << 32] {
            let mut e = ObjectEntry::new_complete(len, 0, 0);
            assert_eq!(e.len(), len);
            e.set_len(3);
            assert_eq!(e.len(), 3);
        }
    }

    #[test]
    fn the_side_box_exists_only_while_something_is_in_it() {
        let mut e = ObjectEntry::new_complete(10, 0, 0);
        assert!(e.extra.is_none());
        e.set_disk(0);
        e.set_offload_deadline_ms(0);
        e.set_soft_pin(true, 0);
        assert!(e.extra.is_none(), "defaults make no box");
        e.set_disk(9);
        e.set_offload_deadline_ms(500);
        e.set_soft_pin(true, 1000);
        assert_eq!((e.disk(), e.offload_deadline_ms(), e.soft_pin_ttl_ms()), (9, 500, 1000));
        assert!(e.offload_pending(499) && !e.offload_pending(500));
        assert!(e.pinned(999) && !e.pinned(1000), "the TTL runs from the last access");
        e.set_disk(0);
        e.set_offload_deadline_ms(0);
        assert!(e.extra.is_some(), "the pin's TTL is still in it");
        e.set_soft_pin(false, 0);
        assert!(e.extra.is_none(), "dropped once empty");
        assert_eq!((e.disk(), e.offload_deadline_ms(), e.soft_pin_ttl_ms()), (0, 0, 0));
    }
}
