//! Placements held ahead: room a client asks for before it knows the key of its
//! next put ([`place_ahead`](MasterService::place_ahead)), writes, then binds to
//! the key ([`put_bind`](MasterService::put_bind)): the put is then one master
//! round trip shorter (no `put_start` before its bytes move).
//!
//! A held placement is an allocation no object owns. The master gives it back when
//! it is bound, after [`HOLD_MS`] (or `put_timeout`, if shorter), when its client is
//! forgotten, and when a segment it is on goes. It never evicts to make room, nor
//! fills a segment past the high watermark: where memory is tight, puts are placed
//! as usual. Master calls refuse it in cluster mode (no key, so no slot group).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use mooncake_alloc::{AllocatedBuffer, SegmentId};
use parking_lot::Mutex;

use crate::config::{check_key, check_value_len, ReplicateConfig};
use crate::error::{Error, Result};
use crate::master::service::MasterService;
use crate::master::types::{ClientId, HeldPlacement, MemoryReplica};

/// How long the master holds a placement (ms), at most: long enough for a client
/// to use it for its next put of a stream of them, short enough that room a client
/// stopped needing comes back soon.
pub(crate) const HOLD_MS: u64 = 500;
/// Placements one client may hold at once (one per size it puts, usually one).
pub(crate) const HELD_PER_CLIENT: usize = 16;

/// The placements held, by id.
#[derive(Default)]
pub(crate) struct HeldPlacements {
    next_id: AtomicU64,
    by_id: Mutex<ahash::HashMap<u64, Held>>,
}

/// One placement held.
struct Held {
    client: ClientId,
    len: u64,
    /// What it was placed for: the put bound to it keeps its soft pin, and a
    /// placement ahead of the next put is placed alike.
    cfg: ReplicateConfig,
    bufs: Vec<AllocatedBuffer>,
    /// When the master gives it back (ms of the master's clock).
    until_ms: u64,
}

impl HeldPlacements {
    /// How many placements are held.
    pub(crate) fn count(&self) -> u64 {
        self.by_id.lock().len() as u64
    }

    /// Gives back every placement `give_back` picks; their room is freed once the
    /// lock is released.
    fn give_back_where(&self, give_back: impl Fn(&Held) -> bool) {
        let mut gone = Vec::new();
        self.by_id.lock().retain(|_, h| {
            if give_back(h) {
                gone.push(std::mem::take(&mut h.bufs));
                return false;
            }
            true
        });
        drop(gone);
    }
}

impl MasterService {
    /// Holds room for `client`'s next put of `len` bytes with `cfg` (replicas on
    /// distinct segments, as [`put_start`](Self::put_start) places them, but never
    /// evicting and never past a segment's high watermark). The client writes the
    /// value there, then binds it to its key with [`put_bind`](Self::put_bind)
    /// within `held_for_ms`. `UnknownClient` for a client the master does not know;
    /// `InvalidArgument` in cluster mode, or for a client holding
    /// [`HELD_PER_CLIENT`] placements already; `NoSpace` where no segment has room.
    pub fn place_ahead(&self, client: ClientId, len: u64, cfg: &ReplicateConfig) -> Result<HeldPlacement> {
        check_value_len(len)?;
        cfg.check()?;
        if self.ownership.get().is_some() {
            return Err(Error::InvalidArgument("a master of a cluster holds no placement ahead of a key".into()));
        }
        let now = self.now_ms();
        match self.clients.read().get(&client) {
            // A client that places is alive: not forgotten (its placements given
            // back) while it may be about to write into one.
            Some(rec) => rec.touch(now),
            None => return Err(Error::UnknownClient(client)),
        }
        let held = self.held.by_id.lock().values().filter(|h| h.client == client).count();
        if held >= HELD_PER_CLIENT {
            return Err(Error::InvalidArgument(format!("client {client:#x} holds {held} placements already")));
        }
        let bufs = self.allocate_with("", len, cfg, None, false)?;
        self.check_replica_count("a placement ahead", len, bufs.len(), cfg)?;
        let held_for_ms = HOLD_MS.min(self.config.put_timeout.as_millis() as u64);
        let replicas = bufs.iter().map(MemoryReplica::of).collect();
        // Numbered from this start's random incarnation: an id a client kept from
        // a master that restarted names nothing here.
        let id = self.incarnation.wrapping_add(self.held.next_id.fetch_add(1, Ordering::Relaxed) + 1);
        let until_ms = now + held_for_ms;
        self.held.by_id.lock().insert(id, Held { client, len, cfg: cfg.clone(), bufs, until_ms });
        Ok(HeldPlacement { id, replicas, held_for_ms })
    }

    /// Binds `client`'s held `placement`, written, to `key`: from here on it is a
    /// put of `key` in progress, as if [`put_start_summed`](Self::put_start_summed)
    /// had placed it there with `checksum` (with durable records, the replicas'
    /// records go to their nodes now), and [`put_end`](Self::put_end) ends it.
    /// Replicas on segments that went meanwhile are left out. With `ahead`, also
    /// holds a placement like this one for the client's next put (`None` where
    /// none could be placed).
    ///
    /// `AlreadyExists` if `key` is an object or a put in progress (the placement is
    /// given back); `NotFound` if the client holds no such placement (never held,
    /// bound, or given back: expired, or its segments went).
    pub fn put_bind(
        &self,
        client: ClientId,
        placement: u64,
        key: &str,
        checksum: u32,
        ahead: bool,
    ) -> Result<Option<HeldPlacement>> {
        check_key(key)?;
        let now = self.now_ms();
        let mut held = {
            let mut by_id = self.held.by_id.lock();
            match by_id.get(&placement) {
                Some(h) if h.client == client => by_id.remove(&placement),
                _ => None,
            }
        }
        .ok_or_else(|| Error::NotFound(format!("placement {placement} is not held by this client")))?;
        if now >= held.until_ms {
            return Err(Error::NotFound(format!("placement {placement} expired")));
        }
        {
            // The very segment it was placed on (not one mounted since under the
            // same id), still taking new replicas.
            let table = self.segments.read();
            held.bufs.retain(|b| {
                table.by_id.get(&b.segment_id()).is_some_and(|s| Arc::ptr_eq(&s.alloc, b.segment()) && !s.draining)
            });
        }
        if held.bufs.is_empty() {
            return Err(Error::NotFound(format!("placement {placement}: its segments went")));
        }
        self.check_replica_count(key, held.len, held.bufs.len(), &held.cfg)?;
        let under_replicated = held.bufs.len() < held.cfg.replica_num;
        {
            let mut shard = self.index.shard(key).lock();
            self.claim_key(&mut shard, key, now)?;
            let pin = (held.cfg.soft_pin, held.cfg.soft_pin_ttl_ms());
            let bufs = std::mem::take(&mut held.bufs);
            self.open_put(&mut shard, key, held.len, client, now, bufs, pin, Some(checksum))?;
        }
        if under_replicated {
            self.counters.under_replicated_puts.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.bound_puts.fetch_add(1, Ordering::Relaxed);
        Ok(if ahead { self.place_ahead(client, held.len, &held.cfg).ok() } else { None })
    }

    /// Gives back the placements `client` holds (it is forgotten).
    pub(crate) fn give_back_held_of(&self, client: ClientId) {
        self.held.give_back_where(|h| h.client == client);
    }

    /// Gives back the placements with room on any of `segments` (they went).
    pub(crate) fn give_back_held_on(&self, segments: &[SegmentId]) {
        self.held.give_back_where(|h| h.bufs.iter().any(|b| segments.contains(&b.segment_id())));
    }

    /// Gives back the placements held past their time (`now`, ms).
    pub(crate) fn give_back_expired_held(&self, now: u64) {
        self.held.give_back_where(|h| now >= h.until_ms);
    }
}
