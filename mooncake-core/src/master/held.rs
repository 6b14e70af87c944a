//! Placements held ahead: room a client asks for before it knows the key of its
//! next put ([`place_ahead`](MasterService::place_ahead)), writes, then binds to
//! the key ([`put_bind`](MasterService::put_bind)): the put is then one master
//! round trip shorter (no `put_start` before its bytes move).
//!
//! A held placement is an allocation no object owns. Its client may be writing
//! into it from the moment it is answered, so its room is freed only when its
//! time is up (`MasterConfig::placement_hold`, 500 ms by default, at most
//! `put_timeout`), never earlier: a bind
//! hands the room to the put (which keeps it until its end), and a refused bind,
//! a client forgotten or a segment gone only close it (no bind takes it any
//! more), its room held a full hold past a refusal for the writes that may still
//! land there. It never evicts to make room, nor fills a segment past the
//! high watermark: where memory is tight, puts are placed as usual. Master calls
//! refuse it in cluster mode (no key, so no slot group).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_alloc::{AllocatedBuffer, SegmentId};
use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::service::MasterService;
use crate::master::types::{ClientId, HeldPlacement, MemoryReplica};

/// Placements one client may hold at once (one per size it puts, usually one).
pub(crate) const HELD_PER_CLIENT: usize = 16;

/// The placements held, by id. Lock order: a shard of the index, then `by_id`,
/// then `segments`; `open` is taken last (nothing is locked under it).
#[derive(Default)]
pub(crate) struct HeldPlacements {
    next_id: AtomicU64,
    by_id: Mutex<ahash::HashMap<u64, Held>>,
    /// Open placements by client (those of [`HELD_PER_CLIENT`]), beside `by_id`'s
    /// entries, which stay until their time is up even once bound.
    open: Mutex<ahash::HashMap<ClientId, usize>>,
}

/// One placement held.
struct Held {
    client: ClientId,
    len: u64,
    /// What it was placed for: the put bound to it keeps its soft pin, and a
    /// placement ahead of the next put is placed alike.
    cfg: ReplicateConfig,
    /// Its room (once bound, what the put did not take: replicas on segments that
    /// went or drain).
    bufs: Vec<AllocatedBuffer>,
    /// When the master frees it (ms of the master's clock).
    until_ms: u64,
    /// How long it was held for (ms).
    held_for_ms: u64,
    state: HeldState,
}

/// Whether a placement can still be bound.
enum HeldState {
    /// Held for its client's next put.
    Open,
    /// Bound to this key: a bind of it asked again (sent again after a broken
    /// connection) answers as the first did.
    Bound(Box<str>),
    /// No bind takes it (refused once, its client forgotten, a segment of it gone).
    Closed,
}

impl Held {
    /// Closes it at `now` (ms): its room is kept a full hold longer, for the
    /// writes its client may still have in flight.
    fn close(&mut self, now: u64, open: &HeldPlacements) {
        self.leave(HeldState::Closed, open);
        self.until_ms = self.until_ms.max(now + self.held_for_ms);
    }

    /// Moves it from open to `state`, counted out of its client's open ones.
    fn leave(&mut self, state: HeldState, open: &HeldPlacements) {
        if matches!(self.state, HeldState::Open) {
            open.count_open(self.client, false);
        }
        self.state = state;
    }
}

impl HeldPlacements {
    /// How many placements can still be bound.
    pub(crate) fn count(&self) -> u64 {
        self.open.lock().values().sum::<usize>() as u64
    }

    /// Counts one open placement of `client` in (`true`) or out.
    fn count_open(&self, client: ClientId, opened: bool) {
        let mut open = self.open.lock();
        let n = open.entry(client).or_default();
        if opened {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&client);
            }
        }
    }

    /// How many placements `client` holds open.
    fn open_of(&self, client: ClientId) -> usize {
        self.open.lock().get(&client).copied().unwrap_or(0)
    }

    /// Closes every open placement `close` picks, at `now` (ms).
    fn close_where(&self, now: u64, close: impl Fn(&Held) -> bool) {
        for h in self.by_id.lock().values_mut() {
            if matches!(h.state, HeldState::Open) && close(h) {
                h.close(now, self);
            }
        }
    }
}

impl MasterService {
    /// Holds room for `client`'s next put of `len` bytes with `cfg` (replicas on
    /// distinct segments, as [`put_start`](Self::put_start) places them, but never
    /// evicting and never past a segment's high watermark). The client writes the
    /// value there, then binds it to its key with [`put_bind`](Self::put_bind)
    /// within `held_for_ms`. `UnknownClient` for a client the master does not know;
    /// `InvalidArgument` in cluster mode, or for a client holding
    /// `HELD_PER_CLIENT` (16) placements already; `NoSpace` where no segment has room.
    pub fn place_ahead(&self, client: ClientId, len: u64, cfg: &ReplicateConfig) -> Result<HeldPlacement> {
        check_value_len(len)?;
        cfg.check()?;
        if self.ownership.get().is_some() {
            return Err(Error::InvalidArgument("a master of a cluster holds no placement ahead of a key".into()));
        }
        let held_for_ms = self.config.placement_hold.min(self.config.put_timeout).as_millis() as u64;
        if held_for_ms == 0 {
            return Err(Error::InvalidArgument("this master holds no placements ahead (placement_hold is 0)".into()));
        }
        let now = self.now_ms();
        match self.clients.read().get(&client) {
            // A client that places is alive: not forgotten (its placements closed,
            // its segments unmounted) while it may be about to write into one.
            Some(rec) => rec.touch(now),
            None => return Err(Error::UnknownClient(client)),
        }
        let held = self.held.open_of(client);
        if held >= HELD_PER_CLIENT {
            return Err(Error::InvalidArgument(format!("client {client:#x} holds {held} placements already")));
        }
        let bufs = self.allocate_with("", len, cfg, None, false)?;
        self.check_replica_count("a placement ahead", len, bufs.len(), cfg)?;
        let replicas = bufs.iter().map(MemoryReplica::of).collect();
        // Numbered from this start's random incarnation: an id a client kept from
        // a master that restarted names nothing here.
        let id = self.incarnation.wrapping_add(self.held.next_id.fetch_add(1, Ordering::Relaxed) + 1);
        let until_ms = now + held_for_ms;
        let held = Held { client, len, cfg: cfg.clone(), bufs, until_ms, held_for_ms, state: HeldState::Open };
        {
            // Counted with the insert, under `by_id` (a close in between must find
            // it counted); the limit checked again, as others may have placed.
            let mut by_id = self.held.by_id.lock();
            if self.held.open_of(client) >= HELD_PER_CLIENT {
                drop(by_id);
                drop(held);
                return Err(Error::InvalidArgument(format!("client {client:#x} holds {HELD_PER_CLIENT} placements")));
            }
            by_id.insert(id, held);
            self.held.count_open(client, true);
        }
        Ok(HeldPlacement { id, replicas, held_for_ms })
    }

    /// Binds `client`'s held `placement`, written, to `key`: from here on it is a
    /// put of `key` in progress, as if [`put_start_summed`](Self::put_start_summed)
    /// had placed it there with `checksum` (with durable records, the replicas'
    /// records go to their nodes now), and [`put_end`](Self::put_end) ends it.
    /// Replicas on segments that went or drain meanwhile are left out. With
    /// `ahead`, also holds a placement like this one for the client's next put
    /// (`None` where none could be placed). A bind asked again with the same key
    /// (sent again after a broken connection) answers `Ok(None)`.
    ///
    /// `AlreadyExists` if `key` is an object or a put in progress; `NotFound` if
    /// the client holds no such placement (never held, bound to another key,
    /// expired, closed). A refused placement is closed, its room kept a while for
    /// the writes still landing there (see the module's comment).
    pub fn put_bind(
        &self,
        client: ClientId,
        placement: u64,
        key: &str,
        checksum: u32,
        ahead: bool,
    ) -> Result<Option<HeldPlacement>> {
        check_key(key)?;
        self.fence(key)?;
        let now = self.now_ms();
        let mut shard = self.index.shard(key).lock();
        let mut by_id = self.held.by_id.lock();
        let h = match by_id.get_mut(&placement) {
            Some(h) if h.client == client => h,
            _ => return Err(Error::NotFound(format!("placement {placement} is not held by this client"))),
        };
        match &h.state {
            HeldState::Open => {}
            HeldState::Bound(k) if **k == *key => return Ok(None),
            _ => return Err(Error::NotFound(format!("placement {placement} is not held any more"))),
        }
        let refuse = |h: &mut Held, e: Error| {
            h.close(now, &self.held);
            Err(e)
        };
        if now >= h.until_ms {
            return refuse(h, Error::NotFound(format!("placement {placement} expired")));
        }
        // The very segment each replica was placed on (not one mounted since under
        // the same id), still taking new replicas.
        let keep: SmallVec<[bool; 2]> = {
            let table = self.segments.read();
            h.bufs
                .iter()
                .map(|b| {
                    table.by_id.get(&b.segment_id()).is_some_and(|s| Arc::ptr_eq(&s.alloc, b.segment()) && !s.draining)
                })
                .collect()
        };
        let kept = keep.iter().filter(|&&k| k).count();
        if kept == 0 {
            return refuse(h, Error::NotFound(format!("placement {placement}: its segments went")));
        }
        if let Err(e) = self.check_replica_count(key, h.len, kept, &h.cfg) {
            return refuse(h, e);
        }
        if let Err(e) = self.claim_key(&mut shard, key, now) {
            return refuse(h, e);
        }
        let (mut taken, mut left) = (Vec::with_capacity(kept), Vec::new());
        for (b, k) in std::mem::take(&mut h.bufs).into_iter().zip(keep) {
            if k {
                taken.push(b);
            } else {
                left.push(b);
            }
        }
        // What the put does not take stays until the hold ends: writes may land there.
        h.bufs = left;
        h.leave(HeldState::Bound(key.into()), &self.held);
        let (len, cfg) = (h.len, h.cfg.clone());
        drop(by_id);
        let under_replicated = taken.len() < cfg.replica_num;
        let pin = (cfg.soft_pin, cfg.soft_pin_ttl_ms());
        if let Err(e) = self.open_put(&mut shard, key, len, client, now, &mut taken, pin, Some(checksum)) {
            // (Not expected: the key's group was fenced above, and a master of a
            // cluster holds no placements.) The room stays held, closed, for the
            // DMA that may be landing there.
            drop(shard);
            let mut by_id = self.held.by_id.lock();
            if let Some(h) = by_id.get_mut(&placement) {
                h.bufs.append(&mut taken);
                h.close(now, &self.held);
            }
            return Err(e);
        }
        drop(shard);
        if under_replicated {
            self.counters.under_replicated_puts.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.bound_puts.fetch_add(1, Ordering::Relaxed);
        Ok(if ahead { self.place_ahead(client, len, &cfg).ok() } else { None })
    }

    /// [`put_bind`](Self::put_bind) for many items (key, placement, checksum); one
    /// result per item.
    pub fn batch_put_bind(
        &self,
        client: ClientId,
        items: &[(&str, u64, u32)],
        ahead: bool,
    ) -> Vec<Result<Option<HeldPlacement>>> {
        items.iter().map(|&(key, placement, checksum)| self.put_bind(client, placement, key, checksum, ahead)).collect()
    }

    /// Closes the placements `client` holds (it is forgotten).
    pub(crate) fn close_held_of(&self, client: ClientId) {
        self.held.close_where(self.now_ms(), |h| h.client == client);
    }

    /// Closes the placements with room on any of `segments` (they went).
    pub(crate) fn close_held_on(&self, segments: &[SegmentId]) {
        self.held.close_where(self.now_ms(), |h| h.bufs.iter().any(|b| segments.contains(&b.segment_id())));
    }

    /// Frees the room of the placements whose time is up (`now`, ms).
    pub(crate) fn free_expired_held(&self, now: u64) {
        let mut freed = Vec::new();
        self.held.by_id.lock().retain(|_, h| {
            if now >= h.until_ms {
                h.leave(HeldState::Closed, &self.held);
                freed.push(std::mem::take(&mut h.bufs));
                return false;
            }
            true
        });
        // Freed once the lock is given up.
        drop(freed);
    }
}

#[cfg(test)]
impl HeldPlacements {
    /// Holds the lock of the placements: a test pauses there whoever closes
    /// placements next, e.g. `forget_client` right after the client's record and
    /// segments left their tables and before its replicas are dropped.
    pub(crate) fn pause(&self) -> impl Sized + '_ {
        self.by_id.lock()
    }
}
