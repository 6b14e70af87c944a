//! Reading the slot map of a benchmark cluster: whether every group has a live
//! leader, and whether the scheduler has balanced the groups.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mooncake_core::cluster::{SlotMap, SlotMapWatcher};

/// Whether every group of `map` is led by one of `live` (RPC addresses).
pub(crate) fn all_led_by(map: &SlotMap, live: &[String]) -> bool {
    (0..map.groups()).all(|g| map.leader(g).is_some_and(|l| live.contains(&l.addr)))
}

/// Groups each of `live` leads in `map`.
pub(crate) fn led_counts(map: &SlotMap, live: &[String]) -> Vec<usize> {
    let mut n: HashMap<&str, usize> = HashMap::new();
    for g in 0..map.groups() {
        if let Some(l) = map.leader(g) {
            *n.entry(l.addr.as_str()).or_default() += 1;
        }
    }
    live.iter().map(|a| n.get(a.as_str()).copied().unwrap_or(0)).collect()
}

/// Every group led by one of `live`, and each of them leading `floor(G/n)` or
/// `ceil(G/n)` groups (what the scheduler converges to).
pub(crate) fn balanced(map: &SlotMap, live: &[String]) -> bool {
    let counts = led_counts(map, live);
    let (min, max) = (counts.iter().min().copied(), counts.iter().max().copied());
    all_led_by(map, live) && matches!((min, max), (Some(lo), Some(hi)) if hi - lo <= 1)
}

/// Waits (following the watcher's updates) until `done` holds for the map; returns
/// how long that took, or an error naming `what` after `limit`.
pub(crate) fn wait_map(
    watcher: &SlotMapWatcher,
    limit: Duration,
    what: &str,
    done: impl Fn(&SlotMap) -> bool,
) -> Result<Duration, String> {
    let start = Instant::now();
    let mut map = watcher.map();
    loop {
        if done(&map) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > limit {
            return Err(format!("{what}: not reached in {limit:?}"));
        }
        // Wakes on the next change, or soon anyway (the poll bounds the error).
        map = watcher.wait_change(map.version(), Duration::from_millis(5));
    }
}
