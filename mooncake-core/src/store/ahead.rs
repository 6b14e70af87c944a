//! Placements held ahead of device puts (the master's side: `master/held.rs`).
//!
//! A device put into mapped memory summed its bytes beside its DMA and told the
//! master their checksum while the DMA ran (`put_declare`); its placement
//! (`put_start`) still cost a round trip before the DMA could begin. With a
//! placement held ahead, the put starts its DMA at once, into room the master gave
//! at the previous put of that size, binds it to its key beside the DMA
//! (`put_bind`, which also asks for the next one) and ends as before: one round
//! trip less before the bytes move.
//!
//! Only where a round trip is worth saving and the DMA hides the bind: a master
//! daemon (not one in this process), device values of [`HOLD_FROM`] bytes and up.
//! A placement is used only while the master certainly still holds it: within a
//! fifth of its hold time, by the client it was given to, from a master that has
//! not restarted since ([`MasterApi::unchanged_since`]); else it is left to expire
//! and the put is placed as usual.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use smallvec::SmallVec;

use crate::config::ReplicateConfig;
use crate::master::{ClientId, HeldPlacement, MasterApi};

/// Device values from this size hold placements ahead: their DMA (25 us and more
/// at 1 MiB over PCIe 5) hides the bind's round trip.
pub(super) const HOLD_FROM: u64 = 1 << 20;
/// Nor larger than this: the DMA into held room must end well within the
/// master's hold (500 ms by default; 64 MiB take 1-3 ms over PCIe 4 and 5), for a refused
/// bind leaves the room to be freed then.
pub(super) const HOLD_UP_TO: u64 = 64 << 20;
/// The longest hold a master's answer is believed (a larger one is taken as this).
const MAX_HOLD_MS: u64 = 60_000;
/// Sizes held for at once (one placement each).
const SIZES: usize = 4;
/// How long placing ahead rests after the master refused it (a cluster, no room).
const REFUSED_REST: Duration = Duration::from_secs(1);

/// One placement held.
struct Held {
    client: ClientId,
    len: u64,
    cfg: ReplicateConfig,
    placement: HeldPlacement,
    /// The master's continuity mark taken before it was asked for.
    mark: u64,
    /// Until when it may be written.
    usable_until: Instant,
}

impl Held {
    /// Whether it is held for `client`'s puts of `len` bytes with `cfg`.
    fn is_for(&self, client: ClientId, len: u64, cfg: &ReplicateConfig) -> bool {
        self.client == client && self.len == len && self.cfg == *cfg
    }
}

/// The placements this client holds, one per size and replication.
pub(super) struct PlacementsAhead {
    /// Off with `MOONCAKE_PLACE_AHEAD=0` (every put placed by a start, as before).
    enabled: bool,
    held: Mutex<SmallVec<[Held; SIZES]>>,
    /// Until when not to ask (the master refused).
    resting_until: Mutex<Option<Instant>>,
}

impl Default for PlacementsAhead {
    fn default() -> Self {
        Self {
            enabled: std::env::var("MOONCAKE_PLACE_AHEAD").map_or(true, |v| v.trim() != "0"),
            held: Default::default(),
            resting_until: Default::default(),
        }
    }
}

impl PlacementsAhead {
    /// Takes the placement held for `client`'s put of `len` bytes with `cfg`, if
    /// there is one the master certainly still holds, with the instant after which
    /// no write may start into it.
    pub(super) fn take(
        &self,
        master: &dyn MasterApi,
        client: ClientId,
        len: u64,
        cfg: &ReplicateConfig,
    ) -> Option<(HeldPlacement, Instant)> {
        let held = {
            let mut held = self.held.lock();
            let at = held.iter().position(|h| h.is_for(client, len, cfg))?;
            held.swap_remove(at)
        };
        (Instant::now() < held.usable_until && master.unchanged_since(held.mark))
            .then_some((held.placement, held.usable_until))
    }

    /// Whether a placement for `client`'s puts of `len` bytes with `cfg` is held or
    /// should not be asked for now.
    pub(super) fn holds_or_rests(&self, client: ClientId, len: u64, cfg: &ReplicateConfig) -> bool {
        !self.enabled
            || self.resting_until.lock().is_some_and(|until| Instant::now() < until)
            || self.held.lock().iter().any(|h| h.is_for(client, len, cfg))
    }

    /// Keeps `placement`, given to `client` for puts of `len` bytes with `cfg` by a
    /// call made after the master's continuity `mark` was taken, and sent at
    /// `asked` (the master's hold starts after it, however late the answer comes).
    /// The oldest held goes when all [`SIZES`] are taken.
    pub(super) fn keep(
        &self,
        client: ClientId,
        len: u64,
        cfg: &ReplicateConfig,
        mark: u64,
        asked: Instant,
        placement: HeldPlacement,
    ) {
        // Written into well within the master's hold: a DMA that starts by then
        // ends long before the room could be freed (see `HOLD_UP_TO`).
        let usable_until = asked + Duration::from_millis(placement.held_for_ms.min(MAX_HOLD_MS) / 5);
        let mut held = self.held.lock();
        held.retain(|h| !h.is_for(client, len, cfg));
        if held.len() == SIZES {
            if let Some(oldest) = (0..held.len()).min_by_key(|&i| held[i].usable_until) {
                held.swap_remove(oldest);
            }
        }
        held.push(Held { client, len, cfg: cfg.clone(), placement, mark, usable_until });
    }

    /// Asks the master for a placement ahead of `client`'s next put of `len` bytes
    /// with `cfg`, and keeps it; after a refusal, asks no more for a while.
    pub(super) fn ask(&self, master: &dyn MasterApi, client: ClientId, len: u64, cfg: &ReplicateConfig) {
        let (mark, asked) = (master.continuity_mark(), Instant::now());
        match master.place_ahead(client, len, cfg) {
            Ok(p) => self.keep(client, len, cfg, mark, asked, p),
            Err(e) => {
                tracing::debug!(error = %e, len, "no placement ahead");
                *self.resting_until.lock() = Some(Instant::now() + REFUSED_REST);
            }
        }
    }
}
