//! Calls on several keys or several buffers: `batch_exists`, zero-copy batch gets,
//! objects put from and read into several buffers (one block's KV split over
//! per-layer buffers), and `flush`/`close`.

use mooncake_alloc::SegmentId;
use std::collections::HashMap;
use std::time::Instant;

use mooncake_transfer::TransferRequest;

use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::{ClientId, ReplicaList};

use super::stats::StoreCounters;
use super::upsert::WriteKind;
use super::{Store, StoreInner};

/// The crc32c of the bytes of `reqs` laid end to end, if the transport took every
/// request's (see `TransferRequest::with_checksum`).
fn summed(reqs: &[TransferRequest<'_>]) -> Option<u32> {
    let pieces: Option<Vec<(u32, usize)>> = reqs.iter().map(|r| Some((r.checksum()?, r.op.len()))).collect();
    pieces.map(mooncake_transfer::checksum::crc32c_concat)
}

/// Pieces of the caller's buffers, each with the offset in the object of its first byte.
type Pieces<'a> = Vec<(u64, &'a mut [u8])>;

/// The parts of `bufs` that hold the first `len` bytes of an object, each with its
/// offset in the object; `BufferTooSmall` if together they hold fewer.
fn cover<'a>(bufs: &'a mut [&mut [u8]], len: u64) -> Result<Pieces<'a>> {
    let capacity: u64 = bufs.iter().map(|b| b.len() as u64).sum();
    if capacity < len {
        return Err(Error::BufferTooSmall { needed: len, capacity });
    }
    let mut at = 0u64;
    let mut out = Vec::with_capacity(bufs.len());
    for b in bufs.iter_mut() {
        if at == len {
            break;
        }
        let n = (len - at).min(b.len() as u64) as usize;
        out.push((at, &mut b[..n]));
        at += n as u64;
    }
    Ok(out)
}

impl StoreInner {
    /// Reads the object of `list` into `parts` (covering exactly `list.len` bytes)
    /// from the first memory replica whose bytes match the checksum, else from its
    /// disk replica.
    fn read_replicas_parts(&self, key: &str, list: &ReplicaList, parts: &mut [(u64, &mut [u8])]) -> Result<()> {
        if let [(_, one)] = parts {
            return self.read_replicas(key, list, one);
        }
        let mut last_err = Error::NotFound(key.to_owned());
        for r in self.read_order(&list.replicas) {
            let route = match self.route(r.segment) {
                Ok(route) => route,
                Err(e) => {
                    last_err = e;
                    continue;
                }
            };
            let sum = self.sums_in_flight(&route, list.len as usize);
            let mut reqs: Vec<TransferRequest<'_>> = parts
                .iter_mut()
                .map(|(at, p)| {
                    let req = TransferRequest::read(&route, r.offset + *at, p);
                    if sum {
                        req.with_checksum()
                    } else {
                        req
                    }
                })
                .collect();
            let read: std::result::Result<Vec<()>, _> = self.engine.transfer(&mut reqs).into_iter().collect();
            let taken = summed(&reqs);
            drop(reqs);
            let sum = || taken.unwrap_or_else(|| crate::checksum::checksum_parts(parts.iter().map(|(_, p)| &**p)));
            match read {
                Ok(_) if sum() == list.checksum => return Ok(()),
                Ok(_) => {
                    self.routes.write().remove(&r.segment);
                    StoreCounters::inc(&self.counters.checksum_mismatches, 1);
                    last_err = Error::Corrupted(key.to_owned());
                }
                Err(e) => {
                    self.routes.write().remove(&r.segment);
                    last_err = e.into();
                }
            }
        }
        match list.disk {
            Some(owner) => {
                let mut whole = vec![0u8; list.len as usize];
                self.read_disk_replica(key, list, owner, &mut whole)?;
                for (at, p) in parts.iter_mut() {
                    let at = *at as usize;
                    p.copy_from_slice(&whole[at..at + p.len()]);
                }
                Ok(())
            }
            None => Err(last_err),
        }
    }

    /// Puts objects each made of several parts: one master round trip per phase and
    /// one transfer batch.
    pub(super) fn batch_put_parts(&self, items: &[(&str, &[&[u8]])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        let results = self.write_parts(items, cfg, WriteKind::Put);
        self.count_puts(items, &results);
        results
    }

    /// Counts the puts of `items` (stored, or failed).
    pub(super) fn count_puts(&self, items: &[(&str, &[&[u8]])], results: &[Result<()>]) {
        let c = &self.counters;
        for (res, (_, parts)) in results.iter().zip(items) {
            match res {
                Ok(()) => {
                    StoreCounters::inc(&c.puts, 1);
                    StoreCounters::inc(&c.put_bytes, parts.iter().map(|p| p.len() as u64).sum());
                }
                Err(_) => StoreCounters::inc(&c.put_errors, 1),
            }
        }
    }

    /// Writes objects each made of several parts, as puts or upserts (`kind`): one
    /// master round trip per phase and one transfer batch. Not counted: callers count.
    pub(super) fn write_parts(
        &self,
        items: &[(&str, &[&[u8]])],
        cfg: &ReplicateConfig,
        kind: WriteKind,
    ) -> Vec<Result<()>> {
        let client = self.client();
        let lens: Vec<u64> = items.iter().map(|(_, parts)| parts.iter().map(|p| p.len() as u64).sum()).collect();
        let mut results: Vec<Result<()>> = Vec::with_capacity(items.len());
        let mut valid: Vec<(usize, &str, u64)> = Vec::with_capacity(items.len());
        for (i, (k, _)) in items.iter().enumerate() {
            match check_key(k).and_then(|_| check_value_len(lens[i])).and_then(|_| cfg.check()) {
                Ok(()) => {
                    results.push(Ok(()));
                    valid.push((i, k, lens[i]));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        let start_items: Vec<(&str, u64)> = valid.iter().map(|(_, k, l)| (*k, *l)).collect();
        let starts = kind.start(&*self.master, client, &start_items, cfg);
        let mut plans = Vec::new();
        for ((i, _, _), start) in valid.iter().zip(starts) {
            match start.and_then(|reps| {
                reps.into_iter().map(|r| self.route(r.segment).map(|route| (r, route))).collect::<Result<Vec<_>>>()
            }) {
                Ok(p) => plans.push((*i, p)),
                Err(e) => results[*i] = Err(e),
            }
        }
        // Each item's checksum is taken from the writes of its first replica, as the
        // transport sends them (see `TransferRequest::with_checksum`).
        let mut reqs: Vec<TransferRequest<'_>> = Vec::new();
        let mut owner: Vec<(usize, SegmentId)> = Vec::new();
        // Per plan, the requests of its first replica (`None`: no replica placed).
        let mut summing: Vec<Option<std::ops::Range<usize>>> = vec![None; plans.len()];
        for (k, (i, plan)) in plans.iter().enumerate() {
            let first = reqs.len();
            for (j, (r, route)) in plan.iter().enumerate() {
                let mut at = 0u64;
                let sum = j == 0 && self.sums_in_flight(route, lens[*i] as usize);
                for part in items[*i].1.iter().filter(|p| !p.is_empty()) {
                    let req = TransferRequest::write(route, r.offset + at, part);
                    reqs.push(if sum { req.with_checksum() } else { req });
                    owner.push((*i, r.segment));
                    at += part.len() as u64;
                }
                if j == 0 {
                    summing[k] = Some(first..reqs.len());
                }
            }
        }
        let transferred = self.engine.transfer(&mut reqs);
        let taken: Vec<Option<u32>> = summing.iter().map(|range| summed(&reqs[range.clone()?])).collect();
        drop(reqs);
        // What the transport did not sum (memory copies of large objects, RDMA) is
        // summed here, on several cores for a large batch.
        let missing: Vec<usize> = (0..plans.len()).filter(|&k| taken[k].is_none()).collect();
        let missing_parts: Vec<Vec<&[u8]>> = missing.iter().map(|&k| items[plans[k].0].1.to_vec()).collect();
        let mut sum_of: HashMap<usize, u32> =
            plans.iter().zip(&taken).filter_map(|((i, _), t)| t.map(|crc| (*i, crc))).collect();
        sum_of.extend(missing.iter().map(|&k| plans[k].0).zip(crate::checksum::checksum_each(&missing_parts)));
        let mut failed_segments: Vec<SegmentId> = Vec::new();
        for (res, (i, segment)) in transferred.into_iter().zip(owner) {
            if let Err(e) = res {
                if !failed_segments.contains(&segment) {
                    failed_segments.push(segment);
                }
                if results[i].is_ok() {
                    results[i] = Err(e.into());
                }
            }
        }
        // The master stops placing there; the failed items are the caller's to retry.
        for segment in failed_segments {
            self.routes.write().remove(&segment);
            let _ = self.master.report_segment_failure(client, segment);
        }
        let (mut ends, mut revokes) = (Vec::new(), Vec::new());
        for (i, _) in &plans {
            let key = items[*i].0;
            if results[*i].is_ok() {
                ends.push((*i, key, sum_of[i]));
            } else {
                revokes.push(key);
            }
        }
        kind.revoke(&*self.master, client, &revokes);
        let end_results = kind.end(&*self.master, client, &ends.iter().map(|(_, k, c)| (*k, *c)).collect::<Vec<_>>());
        for ((i, _, _), res) in ends.iter().zip(end_results) {
            results[*i] = res;
        }
        // As a single put counts it: stored, with fewer replicas than asked.
        let short = plans.iter().filter(|(i, p)| p.len() < cfg.replica_num && results[*i].is_ok()).count();
        StoreCounters::inc(&self.counters.under_replicated_puts, short as u64);
        results
    }

    /// Reads objects each into its own buffers with one master round trip and one
    /// transfer batch (reads that fail are retried one by one).
    fn batch_get_parts(&self, keys: &[&str], bufs: &mut [&mut [&mut [u8]]]) -> Vec<Result<usize>> {
        if keys.len() != bufs.len() {
            let e = Error::InvalidArgument(format!("{} keys but {} buffers", keys.len(), bufs.len()));
            return vec![Err(e); keys.len()];
        }
        let lists = self.master.batch_get_replica_list(keys);
        let mut covers: Vec<Result<Pieces<'_>>> = Vec::with_capacity(keys.len());
        for (list, b) in lists.iter().zip(bufs.iter_mut()) {
            covers.push(match list {
                Ok(l) => cover(b, l.len),
                Err(e) => Err(e.clone()),
            });
        }
        let routes: Vec<Option<(u64, std::sync::Arc<mooncake_transfer::RemoteRegion>)>> = lists
            .iter()
            .map(|l| {
                let l = l.as_ref().ok()?;
                let r = self.read_order(&l.replicas).first().copied()?;
                self.route(r.segment).ok().map(|route| (r.offset, route))
            })
            .collect();
        let mut ok = vec![false; keys.len()];
        let mut taken: Vec<Option<u32>> = vec![None; keys.len()];
        {
            let mut reqs: Vec<TransferRequest<'_>> = Vec::new();
            let mut owner = Vec::new();
            for (i, (c, route)) in covers.iter_mut().zip(&routes).enumerate() {
                if let (Ok(parts), Some((offset, route))) = (c, route) {
                    let sum = self.sums_in_flight(route, lists[i].as_ref().map_or(0, |l| l.len as usize));
                    for (at, p) in parts.iter_mut() {
                        let req = TransferRequest::read(route, offset + *at, p);
                        reqs.push(if sum { req.with_checksum() } else { req });
                        owner.push(i);
                    }
                    ok[i] = true;
                }
            }
            for (res, &i) in self.engine.transfer(&mut reqs).into_iter().zip(&owner) {
                ok[i] &= res.is_ok();
            }
            // The checksums the transport took as the bytes arrived (an item's requests
            // are consecutive, in the order of its bytes).
            let mut at = 0;
            while at < reqs.len() {
                let i = owner[at];
                let end = at + owner[at..].iter().take_while(|&&o| o == i).count();
                taken[i] = summed(&reqs[at..end]);
                at = end;
            }
        }
        // Objects only on an SSD: one batch per disk that holds some.
        let mut by_disk: HashMap<ClientId, Vec<usize>> = HashMap::new();
        for (i, list) in lists.iter().enumerate() {
            if let (Ok(l), None, Ok(_)) = (list, &routes[i], &covers[i]) {
                if let Some(disk) = l.disk {
                    by_disk.entry(disk).or_default().push(i);
                }
            }
        }
        for (disk, idxs) in by_disk {
            let mut wholes: Vec<Vec<u8>> =
                idxs.iter().map(|&i| vec![0u8; lists[i].as_ref().map_or(0, |l| l.len as usize)]).collect();
            let mut reqs: Vec<(&str, &mut [u8])> =
                idxs.iter().zip(wholes.iter_mut()).map(|(&i, w)| (keys[i], &mut w[..])).collect();
            let res = self.read_disk_many(disk, &mut reqs);
            drop(reqs);
            for ((r, &i), whole) in res.into_iter().zip(&idxs).zip(&wholes) {
                if let (Ok(()), Ok(parts)) = (r, &mut covers[i]) {
                    for (at, p) in parts.iter_mut() {
                        let at = *at as usize;
                        p.copy_from_slice(&whole[at..at + p.len()]);
                    }
                    ok[i] = true;
                }
            }
        }
        // Every read of the batch is over (a key retried alone takes a lease of its own).
        self.leases.release(keys.iter().zip(&lists).filter(|(_, l)| l.is_ok()).map(|(k, _)| *k));
        // The checksums of every object read: those the transport did not take (read
        // by memory copy or from a disk) are summed here, on several cores for a large
        // batch.
        let mut sums: Vec<Option<u32>> = (0..keys.len()).map(|i| taken[i].filter(|_| ok[i])).collect();
        let read: Vec<usize> = (0..keys.len()).filter(|&i| ok[i] && covers[i].is_ok() && sums[i].is_none()).collect();
        {
            let pieces: Vec<Vec<&[u8]>> = read
                .iter()
                .map(|&i| covers[i].as_ref().map(|c| c.iter().map(|(_, p)| &**p).collect()).unwrap_or_default())
                .collect();
            for (&i, sum) in read.iter().zip(crate::checksum::checksum_each(&pieces)) {
                sums[i] = Some(sum);
            }
        }
        let mut retry = Vec::new();
        let mut results: Vec<Result<usize>> = Vec::with_capacity(keys.len());
        for (i, (list, c)) in lists.into_iter().zip(covers).enumerate() {
            results.push(match (list, c) {
                (Err(e), _) | (_, Err(e)) => Err(e),
                (Ok(l), Ok(_)) => {
                    if sums[i] == Some(l.checksum) {
                        Ok(l.len as usize)
                    } else {
                        retry.push(i);
                        Ok(0)
                    }
                }
            });
        }
        for i in retry {
            results[i] = self.get_into_parts(keys[i], bufs[i]);
        }
        for r in &results {
            let c = &self.counters;
            match r {
                Ok(n) => {
                    StoreCounters::inc(&c.gets, 1);
                    StoreCounters::inc(&c.get_bytes, *n as u64);
                }
                Err(_) => StoreCounters::inc(&c.get_errors, 1),
            }
        }
        results
    }

    /// Reads one object into several buffers (not counted: callers count).
    fn get_into_parts(&self, key: &str, bufs: &mut [&mut [u8]]) -> Result<usize> {
        self.with_replicas(key, |list| {
            let mut parts = cover(bufs, list.len)?;
            self.read_replicas_parts(key, list, &mut parts).map(|()| list.len as usize)
        })
    }
}

impl Store {
    /// Whether a complete object is stored under each key, with one master round
    /// trip. One result per key, in order.
    pub fn batch_exists(&self, keys: &[&str]) -> Vec<Result<bool>> {
        self.inner.master.batch_exists(keys)
    }

    /// Reads each object into the caller's buffer of the same index (no copy through
    /// an intermediate buffer), with one master round trip and one transfer batch;
    /// returns each object's length. A buffer too small gives `BufferTooSmall` for
    /// its key only. One result per key, in order.
    pub fn batch_get_into(&self, keys: &[&str], bufs: &mut [&mut [u8]]) -> Vec<Result<usize>> {
        let mut one: Vec<&mut [&mut [u8]]> = bufs.iter_mut().map(std::slice::from_mut).collect();
        self.inner.batch_get_parts(keys, &mut one)
    }

    /// Stores one object made of `parts`, concatenated (one block's KV cache kept
    /// in per-layer buffers, say), without joining them in memory first.
    pub fn put_parts(&self, key: &str, parts: &[&[u8]]) -> Result<()> {
        self.batch_put_parts(&[(key, parts)], &self.inner.replicate).pop().unwrap_or(Ok(()))
    }

    /// Reads one object into `bufs`, filled in order (the first `bufs[0].len()`
    /// bytes into `bufs[0]`, and so on); returns the object's length.
    /// `BufferTooSmall` if the buffers together cannot hold it (nothing is written).
    pub fn get_into_parts(&self, key: &str, bufs: &mut [&mut [u8]]) -> Result<usize> {
        let res = self.inner.get_into_parts(key, bufs);
        self.count_get(res.as_ref().copied().map_err(|_| ()));
        res
    }

    /// [`put_parts`](Self::put_parts) for many objects, with one master round trip
    /// per phase and one transfer batch. One result per item, in order.
    pub fn batch_put_parts(&self, items: &[(&str, &[&[u8]])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        self.inner.batch_put_parts(items, cfg)
    }

    /// [`get_into_parts`](Self::get_into_parts) for many objects, with one master
    /// round trip and one transfer batch. One result per key, in order.
    pub fn batch_get_into_parts(&self, keys: &[&str], bufs: &mut [&mut [&mut [u8]]]) -> Vec<Result<usize>> {
        self.inner.batch_get_parts(keys, bufs)
    }

    /// Returns once every object this client's segment holds is on its SSD tier, so
    /// that dropping the store loses nothing (under `PersistPolicy::Lazy` objects
    /// otherwise live only in memory until eviction needs their room).
    /// `InvalidArgument` without an SSD tier; `Timeout` after the builder's
    /// [`flush_timeout`](super::StoreBuilder::flush_timeout).
    pub fn flush(&self) -> Result<()> {
        let inner = &self.inner;
        if inner.ssd.is_none() {
            return Err(Error::InvalidArgument("flush needs an SSD tier: build the store with ssd_offload(..)".into()));
        }
        let deadline = Instant::now() + inner.flush_timeout;
        loop {
            let left = inner.master.flush_segments(inner.client())?;
            if left == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout(format!("flush: {left} objects still not on the SSD tier")));
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// Flushes (with an SSD tier) and leaves the master: the segment is unmounted
    /// now rather than when the last handle drops. Other handles of this store fail
    /// afterwards.
    pub fn close(self) -> Result<()> {
        if self.inner.ssd.is_some() {
            self.flush()?;
        }
        let client = self.inner.client.swap(super::CLOSED, std::sync::atomic::Ordering::AcqRel);
        self.inner.master.unregister_client(client).map(|_| ())
    }
}
