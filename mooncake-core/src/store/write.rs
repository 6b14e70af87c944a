//! The write engine: every put form (single, batch, parts, upsert, device) is an
//! adapter over [`StoreInner::write`].
//!
//! A call runs in rounds. A round places every pending item (one master round
//! trip), writes every replica of every item (device memory moved directly where
//! the transport can, the rest in one transfer batch from host memory or a pinned
//! copy), takes each item's crc32c (in flight where the transport sums, else on
//! several cores), then ends the items written and revokes the others (one round
//! trip each). An item a replica of which could not be written is placed again
//! without the failed segment (the master is told of it), up to
//! [`PUT_ATTEMPTS`] times; an upsert of a key that another write holds waits for
//! it (up to [`BUSY_WAIT`]); a key that a master recovering from a restart cannot
//! take yet (`Recovering`) waits for the recovery (up to three of the master's
//! client TTLs, at least [`RECOVERING_WAIT_MIN`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::SegmentId;
use mooncake_gpu::DeviceMemory;
use mooncake_transfer::{TransferRequest, WorkOp};
use smallvec::SmallVec;

use super::ahead::{HOLD_FROM, HOLD_UP_TO};
use super::device::{
    move_device, stream_writes, Copies, DeviceMove, Directs, Keep, PinnedParts, PinnedRegion, StreamWrite,
};
use super::routes::Route;
use super::stats::{PhaseTimer, StoreCounters};
use super::StoreInner;
use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::{ClientId, HeldPlacement, MasterApi, MemoryReplica};

/// Puts of host values up to this many bytes each are summed before they are placed,
/// and the checksum declared with the placement (`put_start_summed`): a master daemon
/// then writes the replicas' records to their nodes while the bytes are written,
/// instead of after `put_end` (a round trip to a node less per put). Summing first
/// costs a pass over the bytes that a transport summing on the way hides behind the
/// network, so larger values are declared only while every segment this client
/// reached is mapped memory ([`DECLARE_MAPPED_UP_TO`]). Measured on the 2-vCPU
/// development VM against a master daemon (GB/s, medians of four interleaved runs,
/// before -> after): TCP 256 KiB 1.50 -> 2.22, but 1 MiB 3.48 -> 3.06.
const DECLARE_UP_TO: u64 = 256 << 10;
/// [`DECLARE_UP_TO`] while every segment reached is mapped memory (own, same-host
/// peers), where summing first costs a pass over bytes in cache (16.5 µs at 1 MiB
/// on the VM) and saves the end's wait for the node's records. Measured as above
/// over shm: 256 KiB 4.40 -> 6.53, 1 MiB 10.8 -> 12.1; 4 MiB no better. With the
/// sum folded into the copy (`mooncake_transfer::copies_fold_checksums`) a 1 MiB put
/// summed on the way instead ended 10-12 µs later for the 16.5 saved: even over
/// three rounds (p50 65.6 / 83.1 / 83.1 µs declared, 65.7 / 80.0 / 151.7 not).
const DECLARE_MAPPED_UP_TO: u64 = 1 << 20;
/// How many times an item is placed again after writing to a segment failed.
const PUT_ATTEMPTS: usize = 3;
/// How long an upsert waits for another write of the same key (put or upsert) to
/// finish before giving up with `AlreadyExists`.
const BUSY_WAIT: Duration = Duration::from_secs(5);
/// First pause between two tries of a key another write holds (doubled up to
/// [`BUSY_PAUSE_MAX`]).
const BUSY_PAUSE: Duration = Duration::from_micros(200);
/// Longest pause between two tries of a busy key.
const BUSY_PAUSE_MAX: Duration = Duration::from_millis(20);
/// How long a put of a key waits while the master answers `Recovering` (it
/// restarted, and a node re-mounting may bring the key back): the master's window
/// lasts one client TTL after the last node came back, and a restarted master
/// opens it for up to three TTLs after its start; so a put waits three of the
/// master's TTLs, and at least this. Then it fails with `Recovering` (retryable).
pub(crate) const RECOVERING_WAIT_MIN: Duration = Duration::from_secs(20);
/// Longest pause between two tries while the master recovers: every waiting put
/// asks again, of a master busy taking its nodes back.
const RECOVERING_PAUSE_MAX: Duration = Duration::from_millis(100);

/// Where an object's bytes come from.
pub(super) enum Source<'a> {
    /// Host memory: the object is these slices laid end to end.
    Host(&'a [&'a [u8]]),
    /// `len` bytes of device memory at `offset`.
    Device { mem: &'a dyn DeviceMemory, offset: u64, len: u64 },
}

impl Source<'_> {
    fn len(&self) -> u64 {
        match self {
            Source::Host(parts) => parts.iter().map(|p| p.len() as u64).sum(),
            Source::Device { len, .. } => *len,
        }
    }
}

/// One object to write.
pub(super) struct WriteItem<'a> {
    pub(super) key: &'a str,
    pub(super) source: Source<'a>,
}

/// Which two-phase write runs: the master calls differ, the data path is the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WriteMode {
    /// An object that must not exist yet.
    Put,
    /// An object that may exist: replaced atomically (the master keeps the old
    /// replicas readable while the new ones are written and swaps them in one step).
    Upsert,
}

/// A batch of one goes as the single-key call (what the master counts a put as).
impl WriteMode {
    /// Places `items` (key, length, and the checksum if it is declared: a put whose
    /// every item declares one places them with `put_start_summed`).
    fn start(
        self,
        master: &dyn MasterApi,
        client: ClientId,
        items: &[(&str, u64, Option<u32>)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        let summed: Option<Vec<(&str, u64, u32)>> =
            items.iter().map(|&(key, len, crc)| crc.map(|crc| (key, len, crc))).collect();
        match (self, summed) {
            (WriteMode::Put, Some(summed)) => match summed[..] {
                [(key, len, crc)] => vec![master.put_start_summed(client, key, len, crc, cfg)],
                _ => master.batch_put_start_summed(client, &summed, cfg),
            },
            (mode, _) => {
                let items: Vec<(&str, u64)> = items.iter().map(|&(key, len, _)| (key, len)).collect();
                match (mode, &items[..]) {
                    (WriteMode::Put, [(key, len)]) => vec![master.put_start(client, key, *len, cfg)],
                    (WriteMode::Upsert, [(key, len)]) => vec![master.upsert_start(client, key, *len, cfg)],
                    (WriteMode::Put, _) => master.batch_put_start(client, &items, cfg),
                    (WriteMode::Upsert, _) => master.batch_upsert_start(client, &items, cfg),
                }
            }
        }
    }

    fn end(self, master: &dyn MasterApi, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        match (self, items) {
            (_, []) => Vec::new(),
            (WriteMode::Put, [(key, crc)]) => vec![master.put_end(client, key, *crc)],
            (WriteMode::Upsert, [(key, crc)]) => vec![master.upsert_end(client, key, *crc)],
            (WriteMode::Put, _) => master.batch_put_end(client, items),
            (WriteMode::Upsert, _) => master.batch_upsert_end(client, items),
        }
    }

    fn revoke(self, master: &dyn MasterApi, client: ClientId, keys: &[&str]) {
        let _ = match (self, keys) {
            (_, []) => return,
            (WriteMode::Put, [key]) => master.put_revoke(client, key),
            (WriteMode::Upsert, [key]) => master.upsert_revoke(client, key),
            (WriteMode::Put, _) => master.batch_put_revoke(client, keys).into_iter().collect(),
            (WriteMode::Upsert, _) => master.batch_upsert_revoke(client, keys).into_iter().collect(),
        };
    }
}

/// Host slices of one object (most objects are one or two).
type Parts<'a> = SmallVec<[&'a [u8]; 2]>;

/// Where a round placed an item, with the route to each replica.
pub(super) type Placed = SmallVec<[(MemoryReplica, std::sync::Arc<Route>); 2]>;

/// An item's bytes as the engine holds them.
enum Bytes<'a> {
    /// Host slices (empty ones left out).
    Host(Parts<'a>),
    /// Device memory; `direct` its registration when the NICs took it.
    Device { mem: &'a dyn DeviceMemory, offset: u64, direct: Option<usize> },
}

impl Bytes<'_> {
    /// The bytes in host memory, if they are there.
    fn host(&self) -> Option<Parts<'_>> {
        match self {
            Bytes::Host(parts) => Some(parts.iter().copied().collect()),
            Bytes::Device { .. } => None,
        }
    }
}

/// An item of a call, as written so far.
pub(super) struct Writing<'a> {
    key: &'a str,
    len: u64,
    bytes: Bytes<'a>,
    /// Where this round placed it, with the route to each replica.
    placed: Placed,
    /// Why a replica of this round could not be written.
    failed: Option<Error>,
    /// Whether any replica of this item was written from a staged copy.
    staged: bool,
    /// The crc32c of the bytes, once known (taken on the device for memory moved
    /// directly, by the transport on the way, or summed here).
    crc: Option<u32>,
    /// `crc` went to the master with this round's placement
    /// ([`declare_checksums`]) or beside its DMA ([`StoreInner::declare_on_the_way`]);
    /// either way it was taken from the whole source.
    declared: bool,
    /// This round's placement is one held ahead (its id, and the instant after
    /// which no write may start into it), not bound to the key yet (see `ahead.rs`).
    held: Option<(u64, Instant)>,
    /// The master has this round's put of the key in progress for this client (to
    /// end or revoke): placed by a start, or a held placement bound.
    started: bool,
}

impl<'a> Writing<'a> {
    /// An item of host bytes (`parts`, laid end to end), to be written to `placed`.
    pub(super) fn host(key: &'a str, parts: &[&'a [u8]], placed: Placed) -> Self {
        let parts: Parts<'_> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
        let len = parts.iter().map(|p| p.len() as u64).sum();
        Writing { placed, ..Writing::new(key, len, Bytes::Host(parts), None) }
    }

    fn new(key: &'a str, len: u64, bytes: Bytes<'a>, crc: Option<u32>) -> Self {
        Writing {
            key,
            len,
            bytes,
            placed: Placed::new(),
            failed: None,
            staged: false,
            crc,
            declared: false,
            held: None,
            started: false,
        }
    }

    /// The device memory and range of a device item not summed yet (and not
    /// failed).
    fn unsummed_device_range(&self) -> Option<(&'a dyn DeviceMemory, u64, u64)> {
        match &self.bytes {
            Bytes::Device { mem, offset, .. } if self.crc.is_none() && self.failed.is_none() => {
                Some((*mem, *offset, self.len))
            }
            _ => None,
        }
    }
}

/// The device items among `items` of `round` not summed yet: their crc32c taken
/// on the device, one batch per device memory
/// ([`DeviceMemory::crc32c_each`](mooncake_gpu::DeviceMemory::crc32c_each)), or
/// the items failed with why they could not be.
fn sum_on_device(round: &mut [&mut Writing<'_>], items: impl IntoIterator<Item = usize>) {
    // Per memory object, its items (an item with several replicas comes once per
    // replica: summed once).
    let mut by_memory: Vec<(&dyn DeviceMemory, Vec<usize>)> = Vec::new();
    let mut asked = vec![false; round.len()];
    for k in items {
        if std::mem::replace(&mut asked[k], true) {
            continue;
        }
        let Some((mem, _, _)) = round[k].unsummed_device_range() else { continue };
        match by_memory.iter_mut().find(|(m, _)| std::ptr::addr_eq(*m as *const dyn DeviceMemory, mem)) {
            Some((_, of)) => of.push(k),
            None => by_memory.push((mem, vec![k])),
        }
    }
    for (mem, of) in by_memory {
        let ranges: Vec<(u64, u64)> =
            of.iter().filter_map(|&k| round[k].unsummed_device_range()).map(|(_, at, n)| (at, n)).collect();
        // A memory of the user's that answers fewer sums than ranges must not leave an
        // item unsummed: it would be summed as host bytes it has none of.
        let sums = mem.crc32c_each(&ranges).and_then(|sums| {
            if sums.len() == ranges.len() {
                Ok(sums)
            } else {
                Err(mooncake_gpu::GpuError::InvalidArgument(format!(
                    "{} checksums for {} ranges of a device memory",
                    sums.len(),
                    ranges.len()
                )))
            }
        });
        match sums {
            Ok(sums) => of.iter().zip(sums).for_each(|(&k, crc)| round[k].crc = Some(crc)),
            Err(e) => {
                let e = Error::from(e);
                of.iter().for_each(|&k| round[k].failed = Some(e.clone()));
            }
        }
    }
}

impl Writing<'_> {
    /// Why writing its replicas failed, if it did.
    pub(super) fn failure(&self) -> Option<&Error> {
        self.failed.as_ref()
    }
}

impl StoreInner {
    /// Writes every item (a put or an upsert of each, as `mode`), with `cfg`'s
    /// replication, and counts them; one result per item, in order.
    pub(super) fn write(&self, items: &[WriteItem<'_>], cfg: &ReplicateConfig, mode: WriteMode) -> Vec<Result<()>> {
        let mut results: Vec<Result<()>> = Vec::with_capacity(items.len());
        let mut directs = Directs::default();
        let mut writing: Vec<Option<Writing<'_>>> = Vec::with_capacity(items.len());
        for item in items {
            let len = item.source.len();
            let checked = check_key(item.key).and_then(|()| check_value_len(len)).and_then(|()| cfg.check());
            let prepared = checked.and_then(|()| match &item.source {
                Source::Host(parts) => Ok(Writing::host(item.key, parts, Placed::new())),
                Source::Device { mem, offset, len } => {
                    mem.check_range(*offset, *len)?;
                    let direct = directs.register(self, *mem);
                    Ok(device_item(item.key, *mem, *offset, *len, direct))
                }
            });
            results.push(prepared.as_ref().map(|_| ()).map_err(Error::clone));
            writing.push(prepared.ok());
        }
        let timer = PhaseTimer::counting(&self.counters, &self.counters.write.calls);
        if mode == WriteMode::Put {
            let mapped = self.routes.all_map_peer_memory();
            let host_up_to = if mapped { DECLARE_MAPPED_UP_TO } else { DECLARE_UP_TO };
            declare_checksums(&mut writing, host_up_to, self.master_is_remote, !mapped);
        }
        timer.add_to(&self.counters.write.sum_ns);
        let mut pending: Vec<usize> = (0..items.len()).filter(|&i| writing[i].is_some()).collect();
        let start = Instant::now();
        let (busy_until, recovering_until) = (start + BUSY_WAIT, start + self.recovering_wait);
        let (mut pause, mut attempt) = (BUSY_PAUSE, 1);
        while !pending.is_empty() {
            let again = self.write_round(&pending, &mut writing, &directs, &mut results, cfg, mode, attempt);
            // A busy key, or a master recovering from a restart, waits; anything else
            // (a failed write, an upsert whose old object's segments left) is another
            // attempt.
            let waits = |r: &Result<()>| matches!(r, Err(Error::AlreadyExists(_) | Error::Recovering(_)));
            let failed_write = again.iter().any(|&i| !waits(&results[i]));
            let recovering = again.iter().any(|&i| matches!(results[i], Err(Error::Recovering(_))));
            let mut retry = Vec::new();
            let now = Instant::now();
            for i in again {
                let more = match results[i] {
                    Err(Error::AlreadyExists(_)) => now < busy_until,
                    Err(Error::Recovering(_)) => now < recovering_until,
                    _ => attempt < PUT_ATTEMPTS,
                };
                if more {
                    retry.push(i);
                }
            }
            if failed_write {
                attempt += 1;
            } else if !retry.is_empty() {
                std::thread::sleep(pause);
                pause = (pause * 2).min(if recovering { RECOVERING_PAUSE_MAX } else { BUSY_PAUSE_MAX });
            }
            retry.sort_unstable();
            pending = retry;
        }
        // This client's cached lists of the old objects are stale now: an upsert
        // replaced them; a put succeeded only because the key was absent at the
        // master (removed by another client), so any list still cached is of a value
        // gone, which would otherwise be served after our own put (read your writes).
        for item in items {
            self.cache.forget(item.key);
        }
        self.count_writes(&writing, &results, cfg);
        results
    }

    /// One round over the `pending` items: place, write, end or revoke. Returns the
    /// items to try again (a failed write, a busy key, or an upsert whose old
    /// object's segments left).
    #[allow(clippy::too_many_arguments)]
    fn write_round(
        &self,
        pending: &[usize],
        writing: &mut [Option<Writing<'_>>],
        directs: &Directs<'_>,
        results: &mut [Result<()>],
        cfg: &ReplicateConfig,
        mode: WriteMode,
        attempt: usize,
    ) -> Vec<usize> {
        let client = self.client();
        let timer = PhaseTimer::counting(&self.counters, &self.counters.write.rounds);
        // Device puts into room held ahead start without a master call.
        let held: Vec<Option<(HeldPlacement, Instant)>> = pending
            .iter()
            .map(|&i| {
                let w = writing[i].as_ref()?;
                if mode != WriteMode::Put || !self.master_is_remote || !holds_ahead(w) {
                    return None;
                }
                let (p, until) = self.ahead.take(&*self.master, client, w.len, cfg)?;
                // Only where every replica is moved by DMA, the bind beside it
                // (else the room is left to expire).
                let mapped = p.replicas.iter().all(|r| {
                    self.routes.get(&*self.master, &self.engine, r.segment).is_ok_and(|r| r.caps.maps_peer_memory)
                });
                mapped.then_some((p, until))
            })
            .collect();
        let starts = {
            let items: Vec<(&str, u64, Option<u32>)> = pending
                .iter()
                .zip(&held)
                .filter(|(_, h)| h.is_none())
                .filter_map(|(&i, _)| writing[i].as_ref().map(|w| (w.key, w.len, w.crc.filter(|_| w.declared))))
                .collect();
            // A call placed with a plain start (some item not declared) leaves the
            // master without the checksums of the others: declared again on the way,
            // or recorded at their end.
            if items.iter().any(|&(_, _, crc)| crc.is_none()) {
                for &i in pending {
                    if let Some(w) = writing[i].as_mut() {
                        w.declared = false;
                    }
                }
            }
            let mut started =
                if items.is_empty() { Vec::new() } else { mode.start(&*self.master, client, &items, cfg) }.into_iter();
            let unanswered = || Err(Error::MasterUnavailable("no placement in the master's answer".into()));
            held.into_iter()
                .map(|h| match h {
                    Some((h, until)) => (Some((h.id, until)), Ok(h.replicas)),
                    None => (None, started.next().unwrap_or_else(unanswered)),
                })
                .collect::<Vec<_>>()
        };
        let mut again = Vec::new();
        let mut placed = Vec::with_capacity(pending.len());
        for (&i, (held, start)) in pending.iter().zip(starts) {
            let Some(w) = writing[i].as_mut() else { continue };
            w.failed = None;
            w.placed.clear();
            w.held = held;
            w.started = held.is_none() && start.is_ok();
            match start {
                Ok(replicas) => {
                    for r in replicas {
                        match self.routes.get(&*self.master, &self.engine, r.segment) {
                            Ok(route) => w.placed.push((r, route)),
                            Err(e) => {
                                // A segment whose route the master cannot give:
                                // placed again without it, like a failed write.
                                self.report_failed_segment(r.segment, &e);
                                w.failed.get_or_insert(e);
                            }
                        }
                    }
                    placed.push(i);
                }
                Err(e) => {
                    // A key another write holds (an upsert waits for it), or one a
                    // restarted master may still get back from a node: asked again.
                    if (matches!(e, Error::AlreadyExists(_)) && mode == WriteMode::Upsert)
                        || matches!(e, Error::Recovering(_))
                    {
                        again.push(i);
                    }
                    results[i] = Err(e);
                }
            }
        }
        // `pending` is in item order, so `placed` is too.
        let mut is_placed = vec![false; writing.len()];
        placed.iter().for_each(|&i| is_placed[i] = true);
        let mut round: Vec<&mut Writing<'_>> =
            writing.iter_mut().enumerate().filter_map(|(i, w)| if is_placed[i] { w.as_mut() } else { None }).collect();
        let declare = (mode == WriteMode::Put && self.master_is_remote).then_some((client, cfg));
        // Placing ends with the routes to the replicas (a route the store did not
        // know costs a master call).
        let timer = timer.next(&self.counters.write.place_ns);
        let failed_segments = self.write_replicas(&mut round, directs, declare);
        let timer = timer.next(&self.counters.write.move_ns);
        let sums = item_checksums(&mut round);
        let timer = timer.next(&self.counters.write.sum_ns);
        for (segment, e) in &failed_segments {
            self.report_failed_segment(*segment, e);
        }
        // Room held ahead that the DMA's shadow did not bind: bound now, before the
        // end.
        let unbound: SmallVec<[usize; 4]> =
            (0..round.len()).filter(|&k| round[k].held.is_some() && round[k].failed.is_none()).collect();
        self.bind(client, cfg, &mut round, &unbound, false);
        for w in round.iter_mut().filter(|w| w.held.is_some() && w.failed.is_none()) {
            // (Every item written is summed by now: not expected.)
            w.failed = Some(Error::MasterUnavailable("room held ahead not bound".into()));
        }
        let mut ends: SmallVec<[(&str, u32); 4]> = SmallVec::new();
        let mut ended: SmallVec<[usize; 4]> = SmallVec::new();
        let mut revokes: SmallVec<[&str; 4]> = SmallVec::new();
        for ((w, &i), crc) in round.iter().zip(&placed).zip(sums) {
            match &w.failed {
                None => {
                    ends.push((w.key, crc));
                    ended.push(i);
                }
                Some(e) => {
                    results[i] = Err(e.clone());
                    if w.started {
                        revokes.push(w.key);
                    }
                    // A key taken, found when binding room held ahead: final, as
                    // from a start.
                    if w.started || !matches!(e, Error::AlreadyExists(_)) {
                        again.push(i);
                    }
                }
            }
        }
        // A sum taken on the way by a round that failed is not trusted for the next
        // (a transfer cut short may have summed part of the bytes); a declared one
        // was taken from the whole source.
        for w in round.iter_mut().filter(|w| w.failed.is_some() && !w.declared) {
            w.crc = None;
        }
        mode.revoke(&*self.master, client, &revokes);
        for (i, res) in ended.iter().zip(mode.end(&*self.master, client, &ends)) {
            // An upsert whose old object's segments left meanwhile: once more.
            if matches!(res, Err(Error::NotFound(_))) && mode == WriteMode::Upsert && attempt < PUT_ATTEMPTS {
                again.push(*i);
            }
            results[*i] = res;
        }
        timer.add_to(&self.counters.write.end_ns);
        again
    }

    /// Counts the items of a call: stored (with fewer replicas than asked, and
    /// which way device bytes went), or failed.
    fn count_writes(&self, writing: &[Option<Writing<'_>>], results: &[Result<()>], cfg: &ReplicateConfig) {
        let c = &self.counters;
        for (i, res) in results.iter().enumerate() {
            match (res, &writing[i]) {
                (Ok(()), Some(w)) => {
                    StoreCounters::inc(&c.puts, 1);
                    StoreCounters::inc(&c.put_bytes, w.len);
                    // Ended, so every replica placed in its last round was routed.
                    if w.placed.len() < cfg.replica_num {
                        StoreCounters::inc(&c.under_replicated_puts, 1);
                    }
                    if w.declared {
                        StoreCounters::inc(&c.declared_puts, 1);
                    }
                    if matches!(w.bytes, Bytes::Device { .. }) {
                        let way = if w.staged { &c.device_staged_bytes } else { &c.device_direct_bytes };
                        StoreCounters::inc(way, w.len);
                    }
                }
                _ => StoreCounters::inc(&c.put_errors, 1),
            }
        }
    }

    /// Writes `value` to `targets`, replicas the master placed for a copy of `key`
    /// (`replicate`): the engine's replica writer, with no placing or ending.
    pub(super) fn write_copy(&self, key: &str, value: &[u8], crc: u32, targets: &[MemoryReplica]) -> Result<()> {
        let placed = targets
            .iter()
            .map(|r| self.routes.get(&*self.master, &self.engine, r.segment).map(|route| (*r, route)))
            .collect::<Result<Placed>>()?;
        let parts = [value];
        // The checksum is the object's, known: the transport need not take it.
        let mut copy = Writing { crc: Some(crc), ..Writing::host(key, &parts, placed) };
        for (segment, _) in self.write_replicas(&mut [&mut copy], &Directs::default(), None) {
            self.routes.forget(segment);
        }
        copy.failure().map_or(Ok(()), |e| Err(e.clone()))
    }

    /// Tells the master that `segment` cannot be written to (it stops placing
    /// there) and forgets its route.
    fn report_failed_segment(&self, segment: SegmentId, e: &Error) {
        tracing::warn!(segment, error = %e, "cannot write a replica; placing the put again");
        self.routes.forget(segment);
        let _ = self.master.report_segment_failure(self.client(), segment);
    }

    /// Writes every replica of every item in `round` to where it was placed:
    /// device memory directly where the route moves it, everything else in one
    /// transfer batch. Sets each item's `failed`; returns the segments that failed.
    /// `declare`: the items are puts of this client (with this replication) whose
    /// checksums, once summed beside their DMA, are declared to the master while the
    /// DMA runs (see [`declare_checksums`]), and whose room held ahead is bound there.
    pub(super) fn write_replicas(
        &self,
        round: &mut [&mut Writing<'_>],
        directs: &Directs<'_>,
        declare: Option<(ClientId, &ReplicateConfig)>,
    ) -> Vec<(SegmentId, Error)> {
        let mut failed_segments: Vec<(SegmentId, Error)> = Vec::new();
        // Device memory first: a replica whose peer turns out to have no RDMA link
        // is written from a staged copy below.
        let mut by_host: Vec<SmallVec<[usize; 2]>> = vec![SmallVec::new(); round.len()];
        {
            let mut moves = Vec::new();
            let mut owner = Vec::new();
            for (k, w) in round.iter().enumerate() {
                for (j, (r, route)) in w.placed.iter().enumerate() {
                    let direct = match &w.bytes {
                        Bytes::Device { mem, offset, direct: Some(d), .. }
                            if route.caps.moves_device_memory && w.held.is_none() =>
                        {
                            directs.get(*d).map(|direct| (direct, *mem, *offset))
                        }
                        _ => None,
                    };
                    match direct {
                        Some((direct, mem, offset)) => {
                            moves.push(DeviceMove {
                                direct,
                                route: &route.region,
                                remote_offset: r.offset,
                                mem,
                                offset,
                                len: w.len,
                            });
                            owner.push((k, j));
                        }
                        None => by_host[k].push(j),
                    }
                }
            }
            // SAFETY: each item's device range is the caller's to put from and is
            // not written during the call (as `put` borrows its value).
            let moved = unsafe { move_device(WorkOp::Write, &moves) };
            drop(moves);
            for (res, (k, j)) in moved.into_iter().zip(owner) {
                let Err(e) = res else { continue };
                let (r, route) = &round[k].placed[j];
                if matches!(e, mooncake_transfer::TransferError::Unreachable(_))
                    && !self.engine.capabilities(&route.region.endpoint).is_some_and(|c| c.moves_device_memory)
                {
                    // No RDMA link to this peer after all: staged, over TCP.
                    self.routes.forget(r.segment);
                    by_host[k].push(j);
                } else {
                    note_failed(&mut failed_segments, r.segment, &e);
                    round[k].failed.get_or_insert(e.into());
                }
            }
        }
        // One DMA each into replicas in mapped, page-locked segments.
        {
            let mut copies = Copies::default();
            // Room held ahead first: its copies lead their streams, so that they
            // start when its time is checked, not behind other items' copies.
            let mut order: Vec<usize> = (0..round.len()).collect();
            order.sort_by_key(|&k| round[k].held.is_none());
            for k in order {
                let w = &mut *round[k];
                let Bytes::Device { mem, offset, .. } = &w.bytes else { continue };
                let (mem, offset, len) = (*mem, *offset, w.len);
                // Room held ahead: written by DMA only, and only while the master
                // certainly holds it (`ahead.rs`); else not at all, placed again.
                let held = w.held.is_some();
                // The replicas in mapped segments, the pieces each lies in
                // page-locked first (locking may take a while: before the hold's
                // time is checked); the rest staged below.
                let mut targets: SmallVec<[(Arc<PinnedRegion>, PinnedParts); 2]> = SmallVec::new();
                let mut cannot = false;
                by_host[k].retain(|&mut j| {
                    let (r, route) = &w.placed[j];
                    let target = route
                        .caps
                        .maps_peer_memory
                        .then(|| self.pinned.get(&self.engine, &route.region, mem.location().is_emulated()))
                        .flatten()
                        .and_then(|p| p.parts(r.offset, len).map(|parts| (p, parts)));
                    match target {
                        Some(t) => {
                            targets.push(t);
                            false
                        }
                        // Staged below; room held ahead is not written at all.
                        None => {
                            cannot |= held;
                            !held
                        }
                    }
                });
                if w.held.is_some_and(|(_, until)| Instant::now() >= until) {
                    by_host[k].clear();
                    w.failed.get_or_insert(Error::Timeout("room held ahead ran out before its DMA".into()));
                    continue;
                }
                'replicas: for (pinned, parts) in targets {
                    // One DMA per page-locked piece the replica lies in, in order.
                    let mut at = offset;
                    for (dst, part) in parts {
                        // SAFETY: `dst` lies in the replica the master placed for
                        // this put (no one else writes or reads it before
                        // `put_end`; room held ahead: not before its hold ends,
                        // checked above), in a segment `Keep::Mapped` keeps mapped
                        // until the copy is done; `offset..offset + len` of `mem`
                        // was checked, and the parts add up to `len`.
                        let queued =
                            unsafe { copies.enqueue_download(k, mem, dst, part, at, Keep::Mapped(pinned.clone())) };
                        if let Err(e) = queued {
                            w.failed.get_or_insert(e);
                            continue 'replicas;
                        }
                        at += part as u64;
                    }
                }
                if cannot {
                    w.failed.get_or_insert(Error::Transport(mooncake_transfer::TransferError::Unreachable(
                        "room held ahead outside page-locked mapped memory".into(),
                    )));
                }
            }
            // The checksum of each item copied, taken on the device while its DMA
            // runs (both only read the device bytes): its fixed cost overlaps the
            // copy instead of following it.
            sum_on_device(round, copies.items());
            // Their records then travel while the DMA still runs.
            if let Some((client, cfg)) = declare {
                self.declare_on_the_way(client, cfg, round, copies.items());
            }
            // A failed DMA is the device's, not the segment's: the item fails.
            for (k, e) in copies.finish().failed {
                round[k].failed.get_or_insert(e);
            }
        }
        // Device items with replicas to write from host memory: streamed through
        // two pinned chunks (the DMA of one overlapping the transport's write of
        // the other); their checksum is taken on the device.
        {
            let mut writes = Vec::new();
            let mut owner = Vec::new();
            for (k, w) in round.iter_mut().enumerate() {
                if by_host[k].is_empty() || !matches!(w.bytes, Bytes::Device { .. }) {
                    continue;
                }
                w.staged = true;
                let w: &Writing<'_> = w;
                let Bytes::Device { mem, offset, .. } = &w.bytes else { continue };
                let targets = by_host[k].iter().map(|&j| (&w.placed[j].1.region, w.placed[j].0.offset)).collect();
                writes.push(StreamWrite { mem: *mem, src: *offset, len: w.len, targets });
                owner.push(k);
            }
            let written = stream_writes(&self.engine, &writes);
            drop(writes);
            for (done, k) in written.into_iter().zip(owner) {
                if let Some(e) = done.failed {
                    round[k].failed.get_or_insert(e);
                }
                for (res, &j) in done.targets.into_iter().zip(&by_host[k]) {
                    if let Err(e) = res {
                        note_failed(&mut failed_segments, round[k].placed[j].0.segment, &e);
                        round[k].failed.get_or_insert(e.into());
                    }
                }
                by_host[k].clear();
            }
        }
        // Everything else in one batch; each item's checksum is taken from the
        // writes of its first replica where the transport sums them.
        let hosts: Vec<Option<Parts<'_>>> = round.iter().map(|w| w.bytes.host()).collect();
        let mut reqs: Vec<TransferRequest<'_>> = Vec::new();
        let mut owner: Vec<(usize, usize)> = Vec::new();
        for (k, w) in round.iter().enumerate() {
            let Some(parts) = &hosts[k] else { continue };
            for (n, &j) in by_host[k].iter().enumerate() {
                let (r, route) = &w.placed[j];
                let sum = n == 0 && w.crc.is_none() && route.sums_in_flight(w.len as usize);
                let mut at = 0u64;
                for part in parts {
                    // The master's offset plus a part's: checked, not wrapped (the
                    // peer then refuses a range past its region).
                    let req = TransferRequest::write(&route.region, r.offset.saturating_add(at), part);
                    reqs.push(if sum { req.with_checksum() } else { req });
                    owner.push((k, j));
                    at += part.len() as u64;
                }
            }
        }
        let transferred = self.engine.transfer(&mut reqs);
        let mut taken: Vec<Option<u32>> = vec![None; round.len()];
        let mut at = 0;
        while at < reqs.len() {
            let (k, j) = owner[at];
            let end = at + owner[at..].iter().take_while(|&&o| o == (k, j)).count();
            if by_host[k].first() == Some(&j) {
                taken[k] = summed(&reqs[at..end]);
            }
            at = end;
        }
        drop(reqs);
        drop(hosts);
        for (res, (k, j)) in transferred.into_iter().zip(owner) {
            if let Err(e) = res {
                note_failed(&mut failed_segments, round[k].placed[j].0.segment, &e);
                round[k].failed.get_or_insert(e.into());
            }
        }
        for (w, crc) in round.iter_mut().zip(taken) {
            w.crc = w.crc.or(crc);
        }
        failed_segments
    }

    /// Declares to the master the checksums of `client`'s put items `of` (an item
    /// once per replica) of `round` summed while their bytes move and not declared
    /// yet (`put_declare`): the nodes' records then go out while the bytes are still
    /// being written, and `put_end` rarely waits for them. An item the master does
    /// not take stays undeclared (its end records it).
    ///
    /// Items in room held ahead are bound to their key instead (`put_bind`, which
    /// asks for room ahead of the next put of the size); for the others of
    /// [`HOLD_FROM`] bytes and up, room is asked for ahead of the next put of their
    /// size where none is held. All while the DMA runs.
    fn declare_on_the_way(
        &self,
        client: ClientId,
        cfg: &ReplicateConfig,
        round: &mut [&mut Writing<'_>],
        of: impl IntoIterator<Item = usize>,
    ) {
        let mut of: SmallVec<[usize; 4]> = of.into_iter().filter(|&k| round[k].failed.is_none()).collect();
        if of.is_empty() {
            // No device bytes moving (a host write): nothing to declare or bind.
            return;
        }
        let timer = PhaseTimer::start(&self.counters);
        of.sort_unstable();
        of.dedup();
        // Placed by a start: ask for room ahead of the next put of their size.
        let mut asks: SmallVec<[usize; 4]> = of.iter().copied().filter(|&k| round[k].held.is_none()).collect();
        // Room held ahead is bound (summed before or beside the DMA, declared or
        // not); the rest declares what it has not yet.
        let (binds, declares): (SmallVec<[usize; 4]>, SmallVec<[usize; 4]>) = of
            .into_iter()
            .filter(|&k| round[k].crc.is_some() && (round[k].held.is_some() || !round[k].declared))
            .partition(|&k| round[k].held.is_some());
        self.bind(client, cfg, round, &binds, true);
        let items: SmallVec<[(&str, u32); 4]> =
            declares.iter().map(|&k| (round[k].key, round[k].crc.unwrap_or(0))).collect();
        let declared = match items[..] {
            [] => Vec::new(),
            [(key, crc)] => vec![self.master.put_declare(client, key, crc)],
            _ => self.master.batch_put_declare(client, &items),
        };
        for (&k, res) in declares.iter().zip(declared) {
            round[k].declared = res.is_ok();
        }
        // Room ahead of the next put of each size written here that holds none.
        asks.retain(|k| round[*k].failed.is_none());
        for k in asks {
            let w = &round[k];
            if holds_ahead(w) && !self.ahead.holds_or_rests(client, w.len, cfg) {
                self.ahead.ask(&*self.master, client, w.len, cfg);
            }
        }
        timer.add_to(&self.counters.write.declare_ns);
    }

    /// Binds the room held ahead of items `of` of `round`, written, each to its key
    /// with its checksum (`put_bind`, one call for all); with `ahead`, keeps the
    /// room the master holds ahead of the next put of each one's size with `cfg`.
    /// An item the master does not bind fails (placed again, unless its key is
    /// taken).
    fn bind(&self, client: ClientId, cfg: &ReplicateConfig, round: &mut [&mut Writing<'_>], of: &[usize], ahead: bool) {
        // The items with room held and a checksum, and their (key, room, checksum).
        let mut held: SmallVec<[usize; 4]> = SmallVec::new();
        let mut items: SmallVec<[(&str, u64, u32); 4]> = SmallVec::new();
        for &k in of {
            if let (Some((id, _)), Some(crc)) = (round[k].held, round[k].crc) {
                held.push(k);
                items.push((round[k].key, id, crc));
            }
        }
        let (mark, asked) = (self.master.continuity_mark(), Instant::now());
        let mut bound = match items[..] {
            [] => return,
            [(key, id, crc)] => vec![self.master.put_bind(client, id, key, crc, ahead)],
            _ => self.master.batch_put_bind(client, &items, ahead),
        };
        // An answer short of items leaves the rest unanswered: maybe bound.
        bound.resize_with(held.len(), || Err(Error::MasterUnavailable("no answer for this item".into())));
        for (&k, res) in held.iter().zip(bound) {
            let w = &mut round[k];
            w.held = None;
            match res {
                Ok(next) => {
                    w.started = true;
                    w.declared = true;
                    if let Some(next) = next {
                        self.ahead.keep(client, w.len, cfg, mark, asked, next);
                    }
                }
                Err(e) => {
                    // No answer: the master may have bound it (then the key's put is
                    // in progress for this client, revoked before it is placed again).
                    w.started = matches!(e, Error::Timeout(_) | Error::MasterUnavailable(_));
                    w.failed = Some(e);
                }
            }
        }
    }
}

/// Whether item `w` is one that holds room ahead of its puts: device bytes of
/// [`HOLD_FROM`] to [`HOLD_UP_TO`] (see `ahead.rs`).
fn holds_ahead(w: &Writing<'_>) -> bool {
    matches!(w.bytes, Bytes::Device { .. }) && (HOLD_FROM..=HOLD_UP_TO).contains(&w.len) && w.failed.is_none()
}

/// A device item: moved by RDMA where it can be (`direct`, its registration), by
/// DMA into replicas in mapped segments, else from a pinned copy taken when a
/// replica needs one.
fn device_item<'a>(
    key: &'a str,
    mem: &'a dyn DeviceMemory,
    offset: u64,
    len: u64,
    direct: Option<usize>,
) -> Writing<'a> {
    Writing::new(key, len, Bytes::Device { mem, offset, direct }, None)
}

/// Sums the items of a put before they are placed, so that their checksums are
/// declared with the placement, if the master is reached over the network
/// (`remote`) and every item declares: host bytes of at most `host_up_to`, and
/// device bytes if `device_up_front`. All items of a call or none: one master call
/// places them.
///
/// Device bytes are summed on the device. Where their replicas are likely in mapped
/// memory (`device_up_front` false: every segment reached so far is), they are
/// summed beside their DMA instead and declared while it runs
/// ([`StoreInner::declare_on_the_way`]): the sum and the declaration then cost
/// nothing (H200 probe, 4 MiB: the sum before the placement was 22 us of a 136 us
/// put). Elsewhere (RDMA, TCP) the sum's fixed cost comes before the placement,
/// against a master's wait for the nodes' records (tens of microseconds) at the end.
fn declare_checksums(writing: &mut [Option<Writing<'_>>], host_up_to: u64, remote: bool, device_up_front: bool) {
    // An in-process master's records cost nothing to wait for: nothing to declare.
    if !remote {
        return;
    }
    let mut items: Vec<&mut Writing<'_>> = writing.iter_mut().flatten().collect();
    let declares = |w: &Writing<'_>| match w.bytes {
        Bytes::Host(_) => w.len <= host_up_to,
        Bytes::Device { .. } => device_up_front,
    };
    if items.is_empty() || !items.iter().all(|w| declares(w)) {
        return;
    }
    // The write's own summing, before the placement instead of after the copies.
    let _ = item_checksums(&mut items);
    // A device that could not sum: its item is not summed, so the call declares
    // nothing (`WriteMode::start`); the write sums it again, and fails the item if it
    // still cannot.
    for w in items.iter_mut().filter(|w| w.failed.is_some()) {
        w.failed = None;
        w.crc = None;
    }
    for w in items.iter_mut() {
        w.declared = w.crc.is_some();
    }
}

/// The crc32c of each item written: what the device or the transport took, the
/// rest summed here, on several cores for a large batch (0 for an item that
/// failed: it is revoked, not ended).
fn item_checksums(round: &mut [&mut Writing<'_>]) -> Vec<u32> {
    let missing: Vec<usize> =
        (0..round.len()).filter(|&k| round[k].crc.is_none() && round[k].failed.is_none()).collect();
    // Device bytes are summed on the device.
    sum_on_device(round, missing.iter().copied());
    let missing: Vec<usize> =
        missing.into_iter().filter(|&k| round[k].crc.is_none() && round[k].failed.is_none()).collect();
    let sums = {
        let parts: Vec<Vec<&[u8]>> =
            missing.iter().map(|&k| round[k].bytes.host().unwrap_or_default().into_vec()).collect();
        crate::checksum::checksum_each(&parts)
    };
    for (&k, crc) in missing.iter().zip(sums) {
        round[k].crc = Some(crc);
    }
    round.iter().map(|w| w.crc.unwrap_or(0)).collect()
}

/// Adds `segment` to the segments that failed (each once: the master is told once).
fn note_failed(failed: &mut Vec<(SegmentId, Error)>, segment: SegmentId, e: &mooncake_transfer::TransferError) {
    if !failed.iter().any(|(s, _)| *s == segment) {
        failed.push((segment, e.clone().into()));
    }
}

/// The crc32c of the bytes of `reqs` laid end to end, if the transport took every
/// request's (see `TransferRequest::with_checksum`).
pub(super) fn summed(reqs: &[TransferRequest<'_>]) -> Option<u32> {
    let pieces: Option<Vec<(u32, usize)>> = reqs.iter().map(|r| Some((r.checksum()?, r.op.len()))).collect();
    pieces.map(mooncake_transfer::checksum::crc32c_concat)
}
