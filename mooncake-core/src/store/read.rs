//! The read engine: every get form (single, batch, parts, owned buffers, device)
//! is an adapter over [`StoreInner::read`].
//!
//! A call runs in rounds. The first takes each key's replica list from the replica
//! cache or, for the others, from the master (one round trip for all). Each round
//! then reads every pending object from its next replica in read order (this
//! client's own segment, then memory mapped from this process or host, then the
//! network, then the object's disk replica): device memory straight from replicas
//! whose transport moves it, everything else in one transfer batch, disk replicas
//! in one batch per disk. Each object's crc32c is checked (taken in flight where
//! the transport sums, else on several cores); an object that fails its checksum
//! or its transfer goes on to its next replica in the next round. An object whose
//! replicas all failed asks the master again (its list may be stale: memory freed
//! and reused, a segment gone), up to [`CHECKSUM_RETRIES`] times. Read leases go
//! back once the object's list is done with.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use mooncake_transfer::{TransferError, TransferRequest, WorkOp};

use super::destination::{Dest, Destination, Got};
use super::device::{
    move_device, stream_reads, Copies, DeviceMove, Directs, Keep, PinnedParts, PinnedRegion, StreamRead,
};
use super::routes::Route;
use super::stats::{PhaseTimer, StoreCounters};
use super::write::summed;
use super::StoreInner;
use crate::config::check_key;
use crate::error::{Error, Result};
use crate::master::{ClientId, MemoryReplica, ReplicaList};

/// How many times a get re-asks the master after every replica failed its checksum
/// or its transfer (the list was stale).
const CHECKSUM_RETRIES: usize = 3;

/// Where an object's replica list came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ListFrom {
    /// The replica cache: no lease; on failure, forgotten and asked again.
    Cache,
    /// The master, at this moment: its lease is ours to give back.
    Master(Instant),
    /// The caller (a replica copy): read as given, never asked again.
    Given,
}

/// One object of a call, as read so far.
struct Reading<'a> {
    key: &'a str,
    target: Destination<'a>,
    list: Option<(Arc<ReplicaList>, ListFrom)>,
    /// The replicas in read order, with their routes.
    order: Vec<(MemoryReplica, Result<Arc<Route>>)>,
    next: usize,
    disk_tried: bool,
    asked: usize,
    last_err: Option<Error>,
    done: Option<Result<usize>>,
    /// The registration of a device destination with the NICs.
    direct: Option<usize>,
    /// The attempt that read the object.
    read_by: Option<Attempt>,
    /// The replica's segment, mapped, and the parts of the replica in its
    /// page-locked pieces, for a `Dma` attempt.
    pinned: Option<(Arc<PinnedRegion>, PinnedParts)>,
}

/// What a round does for one object.
#[derive(Clone, Copy)]
enum Attempt {
    /// Read replica `order[n]` with the transport, into host memory.
    Memory(usize),
    /// Read replica `order[n]` straight into device memory (RDMA).
    Device(usize),
    /// Copy replica `order[n]` to device memory by DMA from its mapped,
    /// page-locked segment (`pinned`; one DMA per piece it lies in).
    Dma(usize),
    /// Read replica `order[n]` with the transport into pinned chunks, each
    /// copied to device memory while the next one arrives.
    Stream(usize),
    /// Read the disk replica on this client's SSD.
    Disk(ClientId),
}

impl Attempt {
    /// The bytes go to device memory with no host copy of the caller's: straight
    /// (RDMA) or by DMA from a mapped segment.
    fn is_direct(self) -> bool {
        matches!(self, Attempt::Device(_) | Attempt::Dma(_))
    }

    /// The bytes end up in device memory during the round (direct or streamed):
    /// checked there, and nothing to upload afterwards.
    fn lands_on_device(self) -> bool {
        matches!(self, Attempt::Device(_) | Attempt::Dma(_) | Attempt::Stream(_))
    }
}

impl Reading<'_> {
    fn len(&self) -> usize {
        self.list.as_ref().map_or(0, |(l, _)| l.len as usize)
    }
}

/// Where the read engine takes the objects' replica lists from.
pub(super) enum Lists {
    /// The replica cache where it keeps them, else the master: the single-object
    /// gets (as they always did).
    Cached,
    /// The master, for all the objects in one round trip: the batch forms, each of
    /// whose reads is as fresh as the master's answer (what a read after another
    /// client's acknowledged upsert needs).
    Master,
    /// These lists, read as they are (a replica copy: no cache, no lease, not
    /// counted as gets).
    Given(Vec<ReplicaList>),
}

impl StoreInner {
    /// Reads each `(key, destination)`, the lists taken as `lists` says. One result
    /// per item, in order.
    pub(super) fn read(&self, items: Vec<(&str, Dest<'_>)>, lists: Lists) -> Vec<Result<Got>> {
        let count = !matches!(lists, Lists::Given(_));
        let cached = matches!(lists, Lists::Cached);
        let mut given = match lists {
            Lists::Given(l) => Some(l.into_iter()),
            _ => None,
        };
        let mut directs = Directs::default();
        let mut reading: Vec<Reading<'_>> = Vec::with_capacity(items.len());
        for (key, dest) in items {
            let direct = match &dest {
                Dest::Device { mem, .. } => directs.register(self, *mem),
                _ => None,
            };
            let mut r = Reading {
                key,
                direct,
                target: Destination::new(dest),
                list: None,
                order: Vec::new(),
                next: 0,
                disk_tried: false,
                asked: 0,
                last_err: None,
                done: None,
                read_by: None,
                pinned: None,
            };
            if let Err(e) = check_key(key) {
                r.done = Some(Err(e));
            } else if let Some(list) = given.as_mut().and_then(Iterator::next) {
                self.set_list(&mut r, Arc::new(list), ListFrom::Given);
            } else if let Some(list) = self.cache.get(key).filter(|_| cached) {
                self.set_list(&mut r, list, ListFrom::Cache);
            }
            reading.push(r);
        }
        let c = &self.counters;
        // One clock reading per phase boundary, and none where phases are not
        // timed (a cached `get_into` of 4 KiB takes 0.6 us; a reading 20 ns).
        let mut timer = PhaseTimer::counting(c, &c.read.calls);
        loop {
            let asked = self.ask_lists(&mut reading);
            if reading.iter().all(|r| r.done.is_some()) {
                if asked {
                    timer = timer.next(&c.read.locate_ns);
                }
                break;
            }
            // Each object either gets an attempt, or is finished, or waits for a
            // new list (at most CHECKSUM_RETRIES + 1 times): this ends.
            let attempts = self.pick(&mut reading);
            if attempts.iter().any(Option::is_some) {
                timer.count(&c.read.rounds);
                let moving = timer.next(&c.read.locate_ns);
                timer = self.read_round(&mut reading, &attempts, &directs, moving).next(&c.read.check_ns);
            }
        }
        // What was read into host memory for device memory, uploaded.
        let mut uploads = Copies::default();
        for (k, r) in reading.iter_mut().enumerate() {
            if let (Some(Ok(n)), false) = (&r.done, r.read_by.is_some_and(Attempt::lands_on_device)) {
                let n = *n;
                if let Err(e) = r.target.upload(k, n, &mut uploads) {
                    r.done = Some(Err(e));
                }
            }
        }
        let uploading = uploads.items().next().is_some();
        for (k, e) in uploads.finish().failed {
            reading[k].done = Some(Err(e));
        }
        if uploading {
            timer.add_to(&c.read.upload_ns);
        }
        reading
            .into_iter()
            .map(|r| {
                let res = r.done.unwrap_or_else(|| Err(Error::NotFound(r.key.to_owned())));
                if count {
                    self.count_read(&res, &r.target.dest, r.read_by.is_some_and(Attempt::is_direct));
                }
                res.map(|n| r.target.into_got(n))
            })
            .collect()
    }

    /// Gives `r` its replica list, with the replicas in read order.
    fn set_list(&self, r: &mut Reading<'_>, list: Arc<ReplicaList>, from: ListFrom) {
        let own = self.own_segment.load(std::sync::atomic::Ordering::Acquire);
        let mut order: Vec<(MemoryReplica, Result<Arc<Route>>)> =
            list.replicas.iter().map(|rep| (*rep, self.routes.get(&*self.master, &self.engine, rep.segment))).collect();
        order.sort_by_key(|(rep, route)| route.as_ref().map_or(3, |route| route.distance(rep.segment, own)));
        r.order = order;
        r.next = 0;
        r.disk_tried = false;
        r.list = Some((list, from));
    }

    /// Asks the master for the lists of the objects that need one: one round trip.
    /// Returns whether any needed one.
    fn ask_lists(&self, reading: &mut [Reading<'_>]) -> bool {
        let ask: Vec<usize> =
            (0..reading.len()).filter(|&k| reading[k].done.is_none() && reading[k].list.is_none()).collect();
        if ask.is_empty() {
            return false;
        }
        let asked_at = Instant::now();
        let lists = match ask.as_slice() {
            [one] => vec![self.master.get_replica_list(reading[*one].key)],
            _ => {
                let keys: Vec<&str> = ask.iter().map(|&k| reading[k].key).collect();
                self.master.batch_get_replica_list(&keys)
            }
        };
        for (&k, list) in ask.iter().zip(lists) {
            match list {
                Ok(list) => self.set_list(&mut reading[k], Arc::new(list), ListFrom::Master(asked_at)),
                Err(e) => reading[k].done = Some(Err(e)),
            }
        }
        true
    }

    /// What this round does for each object (`None`: nothing, it is done or waits
    /// for a new list). Objects out of replicas are finished or sent back to the
    /// master here.
    fn pick(&self, reading: &mut [Reading<'_>]) -> Vec<Option<Attempt>> {
        let mut release: Vec<&str> = Vec::new();
        let mut attempts = Vec::with_capacity(reading.len());
        for r in reading.iter_mut() {
            let Some((list, from)) = r.list.clone() else {
                attempts.push(None);
                continue;
            };
            if r.done.is_some() {
                attempts.push(None);
                continue;
            }
            if let Err(e) = r.target.prepare(list.len as usize, false) {
                if matches!(from, ListFrom::Cache) {
                    // A kept list may be of a value since replaced by a smaller one:
                    // the master says what the object is now.
                    self.cache.forget(r.key);
                    r.list = None;
                    attempts.push(None);
                    continue;
                }
                // The destination cannot take it: no other replica helps.
                r.done = Some(Err(e));
                if matches!(from, ListFrom::Master(_)) {
                    release.push(r.key);
                }
                attempts.push(None);
                continue;
            }
            let mut attempt = None;
            while r.next < r.order.len() {
                match &r.order[r.next].1 {
                    Ok(route) => {
                        let (offset, len) = (r.order[r.next].0.offset, r.len() as u64);
                        r.pinned = match &r.target.dest {
                            // By DMA once the pieces the replica lies in are
                            // page-locked (locked here if they were not); else
                            // streamed, as from any transport.
                            Dest::Device { mem, .. } if route.caps.maps_peer_memory => self
                                .pinned
                                .get(&self.engine, &route.region, mem.location().is_emulated())
                                .and_then(|p| p.parts(offset, len).map(|parts| (p, parts))),
                            _ => None,
                        };
                        attempt = Some(if r.direct.is_some() && route.caps.moves_device_memory {
                            Attempt::Device(r.next)
                        } else if r.pinned.is_some() {
                            Attempt::Dma(r.next)
                        } else if matches!(r.target.dest, Dest::Device { .. }) {
                            Attempt::Stream(r.next)
                        } else {
                            Attempt::Memory(r.next)
                        });
                        break;
                    }
                    Err(e) => {
                        r.last_err = Some(e.clone());
                        r.next += 1;
                    }
                }
            }
            if attempt.is_none() && !r.disk_tried {
                attempt = list.disk.map(Attempt::Disk);
            }
            if let Some(Attempt::Memory(_) | Attempt::Disk(_)) = attempt {
                // Through host memory: a device destination needs a pinned buffer.
                if let Err(e) = r.target.prepare(list.len as usize, true) {
                    r.last_err = Some(e);
                    attempt = None;
                }
            }
            if attempt.is_none() {
                // Every replica of this list failed.
                let err = r.last_err.take().unwrap_or_else(|| Error::NotFound(r.key.to_owned()));
                let stale = matches!(err, Error::Corrupted(_) | Error::Transport(_));
                match from {
                    ListFrom::Cache => {
                        // Whatever failed, the master knows better now.
                        self.cache.forget(r.key);
                        r.list = None;
                    }
                    ListFrom::Master(_) => {
                        release.push(r.key);
                        if stale && r.asked < CHECKSUM_RETRIES {
                            r.asked += 1;
                            r.list = None;
                        } else {
                            r.done = Some(Err(err));
                        }
                    }
                    ListFrom::Given => r.done = Some(Err(err)),
                }
            }
            attempts.push(attempt);
        }
        self.leases.release(release);
        attempts
    }

    /// Runs one round's attempts and checks what they read.
    ///
    /// `timer` times the move from the round's start; the one returned times the
    /// check from its start.
    fn read_round(
        &self,
        reading: &mut [Reading<'_>],
        attempts: &[Option<Attempt>],
        directs: &Directs<'_>,
        timer: PhaseTimer,
    ) -> PhaseTimer {
        let mut ok: Vec<Option<Result<()>>> = vec![None; reading.len()];
        // Straight into device memory.
        {
            let mut moves = Vec::new();
            let mut owner = Vec::new();
            for (k, r) in reading.iter().enumerate() {
                let (Some(Attempt::Device(n)), Dest::Device { mem, offset }, Some(direct)) =
                    (attempts[k], &r.target.dest, r.direct.and_then(|d| directs.get(d)))
                else {
                    continue;
                };
                let (rep, Ok(route)) = &r.order[n] else { continue };
                moves.push(DeviceMove {
                    direct,
                    route: &route.region,
                    remote_offset: rep.offset,
                    mem: *mem,
                    offset: *offset,
                    len: r.len() as u64,
                });
                owner.push(k);
            }
            // SAFETY: each device range is the caller's destination, written only
            // by this read (as `get_into` writes its buffer) during the call.
            let moved = unsafe { move_device(WorkOp::Read, &moves) };
            drop(moves);
            for (res, k) in moved.into_iter().zip(owner) {
                ok[k] = Some(res.map_err(Error::from));
            }
        }
        // The sums taken while reading, by the transport (in flight) or by the
        // device behind its copies.
        let mut taken: Vec<Option<u32>> = vec![None; reading.len()];
        // One DMA each from mapped, page-locked segments.
        {
            let mut copies = Copies::default();
            for (k, r) in reading.iter().enumerate() {
                let (Some(Attempt::Dma(_)), Dest::Device { mem, offset }, Some((pinned, parts))) =
                    (attempts[k], &r.target.dest, &r.pinned)
                else {
                    continue;
                };
                let len = r.len();
                // One DMA per page-locked piece the replica lies in, in order (the
                // parts were taken, inside the region, when the attempt was chosen).
                let mut queued = Ok(());
                let mut at = *offset;
                for &(src, part) in parts {
                    // SAFETY: `src` lies in the mapped segment, which `Keep::Mapped`
                    // keeps mapped until the copy is done; a writer of that range in
                    // the meantime (the object freed and reused) can only make the
                    // device bytes fail their checksum below.
                    queued = unsafe { copies.enqueue_upload(k, *mem, src, part, at, Keep::Mapped(pinned.clone())) };
                    if queued.is_err() {
                        break;
                    }
                    at += part as u64;
                }
                // The check of the device bytes, chained behind the copy.
                ok[k] = Some(queued.and_then(|()| copies.sum_after(k, *mem, *offset, len as u64)));
            }
            let done = copies.finish();
            for (k, crc) in done.sums {
                taken[k] = Some(crc);
            }
            for (k, e) in done.failed {
                taken[k] = None;
                ok[k] = Some(Err(e));
            }
        }
        // Through pinned chunks into device memory, DMA overlapping the transport.
        {
            let mut reads = Vec::new();
            let mut owner = Vec::new();
            for (k, r) in reading.iter().enumerate() {
                let (Some(Attempt::Stream(n)), Dest::Device { mem, offset }) = (attempts[k], &r.target.dest) else {
                    continue;
                };
                let (rep, Ok(route)) = &r.order[n] else { continue };
                reads.push(StreamRead {
                    region: &route.region,
                    offset: rep.offset,
                    len: r.len() as u64,
                    mem: *mem,
                    dst: *offset,
                });
                owner.push(k);
            }
            for (res, k) in stream_reads(&self.engine, &reads).into_iter().zip(owner) {
                taken[k] = res.as_ref().ok().copied().flatten();
                ok[k] = Some(res.map(|_| ()));
            }
        }
        // Memory replicas with the transport: one batch.
        {
            let routes: Vec<Option<(u64, Arc<Route>)>> = reading
                .iter()
                .enumerate()
                .map(|(k, r)| match attempts[k] {
                    Some(Attempt::Memory(n)) => {
                        r.order[n].1.as_ref().ok().map(|route| (r.order[n].0.offset, route.clone()))
                    }
                    _ => None,
                })
                .collect();
            let mut reqs: Vec<TransferRequest<'_>> = Vec::new();
            let mut owner: Vec<usize> = Vec::new();
            for (k, r) in reading.iter_mut().enumerate() {
                let Some((offset, route)) = &routes[k] else { continue };
                let len = r.len();
                let sum = route.sums_in_flight(len);
                for (at, piece) in r.target.pieces(len) {
                    // The master's offset plus a piece's: saturated, not wrapped (the
                    // peer then refuses a range past its region).
                    let req = TransferRequest::read(&route.region, offset.saturating_add(at), piece);
                    reqs.push(if sum { req.with_checksum() } else { req });
                    owner.push(k);
                }
                ok[k] = Some(Ok(()));
            }
            for (res, &k) in self.engine.transfer(&mut reqs).into_iter().zip(&owner) {
                if let (Err(e), Some(Ok(()))) = (res, &ok[k]) {
                    ok[k] = Some(Err(e.into()));
                }
            }
            // An object's requests are consecutive, in the order of its bytes.
            let mut at = 0;
            while at < reqs.len() {
                let k = owner[at];
                let end = at + owner[at..].iter().take_while(|&&o| o == k).count();
                taken[k] = summed(&reqs[at..end]);
                at = end;
            }
        }
        // Disk replicas: one batch per disk.
        let mut by_disk: HashMap<ClientId, Vec<usize>> = HashMap::new();
        for (k, a) in attempts.iter().enumerate() {
            if let Some(Attempt::Disk(owner)) = a {
                by_disk.entry(*owner).or_default().push(k);
            }
        }
        for (disk, ks) in by_disk {
            let mut wanted = vec![false; reading.len()];
            ks.iter().for_each(|&k| wanted[k] = true);
            let mut reqs: Vec<(&str, &mut [u8])> = reading
                .iter_mut()
                .enumerate()
                .filter(|(k, _)| wanted[*k])
                .map(|(_, r)| {
                    r.disk_tried = true;
                    let len = r.len();
                    (r.key, r.target.whole(len))
                })
                .collect();
            let loaded = self.read_disk_many(disk, &mut reqs);
            drop(reqs);
            for (res, &k) in loaded.into_iter().zip(&ks) {
                if res.is_ok() {
                    let len = reading[k].len();
                    reading[k].target.spread(len);
                }
                ok[k] = Some(res);
            }
        }
        let timer = timer.next(&self.counters.read.move_ns);
        self.check_round(reading, attempts, ok, taken);
        timer
    }

    /// Checks the checksum of every object read this round, and moves each on:
    /// done, or on to its next replica.
    fn check_round(
        &self,
        reading: &mut [Reading<'_>],
        attempts: &[Option<Attempt>],
        ok: Vec<Option<Result<()>>>,
        taken: Vec<Option<u32>>,
    ) {
        // What the transport did not sum, summed here, on several cores.
        let mut sums: Vec<Option<u32>> = taken;
        let to_sum: Vec<usize> = (0..reading.len())
            .filter(|&k| matches!(ok[k], Some(Ok(()))) && sums[k].is_none())
            .filter(|&k| !attempts[k].is_some_and(Attempt::lands_on_device))
            .collect();
        let pieces: Vec<Vec<&[u8]>> = to_sum.iter().map(|&k| reading[k].target.filled(reading[k].len())).collect();
        for (&k, crc) in to_sum.iter().zip(crate::checksum::checksum_each(&pieces)) {
            sums[k] = Some(crc);
        }
        drop(pieces);
        let mut release: Vec<&str> = Vec::new();
        for (k, r) in reading.iter_mut().enumerate() {
            let (Some(attempt), Some(res)) = (attempts[k], &ok[k]) else { continue };
            let Some((list, from)) = r.list.clone() else { continue };
            let segment = match attempt {
                Attempt::Memory(n) | Attempt::Device(n) | Attempt::Dma(n) | Attempt::Stream(n) => {
                    Some(r.order[n].0.segment)
                }
                Attempt::Disk(_) => None,
            };
            let verdict = match (res, attempt) {
                (Ok(()), a) if a.lands_on_device() => match (sums[k], &r.target.dest) {
                    (Some(crc), _) => Ok(crc),
                    (None, Dest::Device { mem, offset }) => mem.crc32c(*offset, list.len).map_err(Error::from),
                    _ => Err(Error::NotFound(r.key.to_owned())),
                },
                (Ok(()), _) => sums[k].ok_or_else(|| Error::NotFound(r.key.to_owned())),
                (Err(e), _) => Err(e.clone()),
            };
            match verdict {
                Ok(crc) if crc == list.checksum => {
                    r.done = Some(Ok(list.len as usize));
                    r.read_by = Some(attempt);
                    match from {
                        ListFrom::Cache => self.cache.hit(),
                        ListFrom::Master(asked_at) => {
                            release.push(r.key);
                            self.cache.insert(r.key, list.clone(), asked_at);
                        }
                        ListFrom::Given => {}
                    }
                }
                Ok(_) => {
                    StoreCounters::inc(&self.counters.checksum_mismatches, 1);
                    if let Some(segment) = segment {
                        // The route may be stale (segment gone, master restarted).
                        self.routes.forget(segment);
                        tracing::warn!(key = r.key, segment, "replica failed its checksum");
                    }
                    r.last_err = Some(Error::Corrupted(r.key.to_owned()));
                    r.next += usize::from(segment.is_some());
                }
                Err(e) => {
                    if let Some(segment) = segment {
                        self.routes.forget(segment);
                    }
                    if let (Attempt::Device(n), Error::Transport(TransferError::Unreachable(_))) = (attempt, &e) {
                        if let Some(route) = self.relinked(&r.order[n].1) {
                            // No RDMA link to this peer after all: the same
                            // replica, through host memory, next round.
                            r.order[n].1 = Ok(route);
                            continue;
                        }
                    }
                    r.last_err = Some(e);
                    r.next += usize::from(segment.is_some());
                }
            }
        }
        self.leases.release(release);
    }

    /// `route` with its transport's capabilities asked again, if they no longer
    /// say it moves device memory (a peer found to have no RDMA link).
    fn relinked(&self, route: &Result<Arc<Route>>) -> Option<Arc<Route>> {
        let route = route.as_ref().ok()?;
        let caps = self.engine.capabilities(&route.region.endpoint).unwrap_or_default();
        (!caps.moves_device_memory).then(|| Arc::new(Route { region: route.region.clone(), caps }))
    }

    /// Reads objects from the SSD of `owner` (ours, or another client's), each into a
    /// destination of exactly its length; checksums are the caller's to check.
    fn read_disk_many(&self, owner: ClientId, requests: &mut [(&str, &mut [u8])]) -> Vec<Result<()>> {
        match &self.ssd {
            Some(ssd) if owner == self.client() => ssd.load_local_many(requests),
            _ => self
                .disk_peers
                .load_many(&*self.master, &self.engine, owner, requests)
                .unwrap_or_else(|e| vec![Err(e); requests.len()]),
        }
    }

    /// Counts one object read by a get form.
    fn count_read(&self, res: &Result<usize>, dest: &Dest<'_>, direct: bool) {
        let c = &self.counters;
        match res {
            Ok(n) => {
                StoreCounters::inc(&c.gets, 1);
                StoreCounters::inc(&c.get_bytes, *n as u64);
                if matches!(dest, Dest::Device { .. }) {
                    let way = if direct { &c.device_direct_bytes } else { &c.device_staged_bytes };
                    StoreCounters::inc(way, *n as u64);
                }
            }
            Err(_) => StoreCounters::inc(&c.get_errors, 1),
        }
    }
}
