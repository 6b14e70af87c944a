//! Offline simulation of a trace replay: what hit ratio an LRU DRAM tier (and an
//! SSD tier below it) of the same capacities gives, with the replay's rule.
//!
//! The rule, for each request in order: its blocks are looked up in order and every
//! block present (in DRAM or on SSD) is a hit until the first miss; from the first
//! miss on, every block not present is put into DRAM, and a block already present
//! is left alone (the store answers such a put with `AlreadyExists` and does not
//! touch the object).
//!
//! Tiers follow the store with an SSD tier and the lazy persist policy: a hit in
//! DRAM refreshes the block's recency; a DRAM victim goes to the SSD tier (nothing
//! is promoted back: a hit on SSD leaves the block on SSD, as the store does); the
//! SSD tier evicts by its own policy when it holds more than its capacity.
//!
//! DRAM eviction is modelled after the master's: it is triggered when the tier
//! holds more than `high_watermark` of its capacity and then evicts the least
//! recently used blocks down to `low_watermark` (the master's defaults: 0.95 and
//! 0.95 - 0.05). `high_watermark = low_watermark = 1.0` is a plain LRU.

use std::collections::{BTreeMap, HashMap};

/// Which SSD blocks leave first when the SSD tier is full (the store's
/// `EvictionPolicy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SsdPolicy {
    /// Oldest written first; reads change nothing.
    Fifo,
    /// Never-read blocks first (oldest written first), then the least recently
    /// read: the store's `LruEviction`.
    Lru,
}

impl std::str::FromStr for SsdPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fifo" => Ok(SsdPolicy::Fifo),
            "lru" => Ok(SsdPolicy::Lru),
            _ => Err(format!("SSD eviction {s:?}: use fifo or lru")),
        }
    }
}

/// Capacities and eviction model of a simulation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SimConfig {
    /// DRAM capacity in blocks.
    pub dram_blocks: u64,
    /// Eviction starts when DRAM holds more than this fraction of `dram_blocks`.
    pub high_watermark: f64,
    /// Eviction frees DRAM down to this fraction of `dram_blocks`.
    pub low_watermark: f64,
    /// SSD capacity in blocks (0: no SSD tier).
    pub ssd_blocks: u64,
    /// SSD eviction order.
    pub ssd_policy: SsdPolicy,
}

impl SimConfig {
    /// A plain LRU of `dram_blocks` blocks, no SSD tier.
    pub fn lru(dram_blocks: u64) -> Self {
        SimConfig { dram_blocks, high_watermark: 1.0, low_watermark: 1.0, ssd_blocks: 0, ssd_policy: SsdPolicy::Fifo }
    }
}

/// What a simulation counted.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SimResult {
    /// Requests replayed.
    pub requests: u64,
    /// Blocks looked up (every block of every request).
    pub blocks: u64,
    /// Prefix blocks found in DRAM.
    pub dram_hits: u64,
    /// Prefix blocks found on SSD.
    pub ssd_hits: u64,
    /// Blocks put (absent after the first miss).
    pub puts: u64,
    /// Blocks after the first miss that were present (not put again).
    pub present_after_miss: u64,
    /// Blocks DRAM evicted (to SSD when there is one).
    pub dram_evictions: u64,
    /// Blocks the SSD tier evicted (gone).
    pub ssd_evictions: u64,
}

impl SimResult {
    /// Hits of both tiers over blocks looked up.
    pub fn hit_ratio(&self) -> f64 {
        ratio(self.dram_hits + self.ssd_hits, self.blocks)
    }
    /// DRAM hits over blocks looked up.
    pub fn dram_hit_ratio(&self) -> f64 {
        ratio(self.dram_hits, self.blocks)
    }
    /// SSD hits over blocks looked up.
    pub fn ssd_hit_ratio(&self) -> f64 {
        ratio(self.ssd_hits, self.blocks)
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Blocks ordered by `(class, time of the last update)`, the first evicted first,
/// with O(log n) updates. Every update takes a fresh time, so ranks never collide
/// (blocks evicted from DRAM together enter the SSD tier in their LRU order).
#[derive(Default)]
struct Ranked {
    rank_of: HashMap<u64, (u8, u64)>,
    order: BTreeMap<(u8, u64), u64>,
    time: u64,
}

impl Ranked {
    fn contains(&self, id: u64) -> bool {
        self.rank_of.contains_key(&id)
    }
    fn len(&self) -> u64 {
        self.rank_of.len() as u64
    }
    /// Inserts `id`, or moves it, to the end of `class`.
    fn set(&mut self, id: u64, class: u8) {
        self.time += 1;
        let rank = (class, self.time);
        if let Some(old) = self.rank_of.insert(id, rank) {
            self.order.remove(&old);
        }
        self.order.insert(rank, id);
    }
    fn pop_first(&mut self) -> Option<u64> {
        let (_, id) = self.order.pop_first()?;
        self.rank_of.remove(&id);
        Some(id)
    }
}

/// Runs the rule over `requests` (each a request's block ids, in trace order).
///
/// ```ignore
/// let r = simulate([&[1, 2][..], &[1, 2, 3][..]], &SimConfig::lru(10));
/// assert_eq!((r.dram_hits, r.puts), (2, 3));
/// ```
pub fn simulate<'a>(requests: impl IntoIterator<Item = &'a [u64]>, cfg: &SimConfig) -> SimResult {
    let mut r = SimResult::default();
    // DRAM ranks by last use; SSD by (class, time) where class 0 = never read and
    // 1 = read (only the LRU policy moves blocks to class 1).
    let (mut dram, mut ssd) = (Ranked::default(), Ranked::default());
    let high = ((cfg.dram_blocks as f64 * cfg.high_watermark).floor() as u64).max(1);
    let low = ((cfg.dram_blocks as f64 * cfg.low_watermark).floor() as u64).min(high);
    for ids in requests {
        r.requests += 1;
        let mut missed = false;
        for &id in ids {
            r.blocks += 1;
            if !missed {
                if dram.contains(id) {
                    dram.set(id, 0);
                    r.dram_hits += 1;
                    continue;
                }
                if ssd.contains(id) {
                    if cfg.ssd_policy == SsdPolicy::Lru {
                        ssd.set(id, 1);
                    }
                    r.ssd_hits += 1;
                    continue;
                }
                missed = true;
            }
            if dram.contains(id) || ssd.contains(id) {
                r.present_after_miss += 1;
                continue;
            }
            r.puts += 1;
            dram.set(id, 0);
            if dram.len() > high {
                while dram.len() > low {
                    let Some(victim) = dram.pop_first() else { break };
                    r.dram_evictions += 1;
                    if cfg.ssd_blocks > 0 {
                        ssd.set(victim, 0);
                        while ssd.len() > cfg.ssd_blocks {
                            ssd.pop_first();
                            r.ssd_evictions += 1;
                        }
                    }
                }
            }
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(trace: &[&[u64]], cfg: &SimConfig) -> SimResult {
        simulate(trace.iter().copied(), cfg)
    }

    #[test]
    fn prefix_until_first_miss_then_puts() {
        // Capacity large enough for everything: only the prefix rule matters.
        let trace: &[&[u64]] = &[&[1, 2, 3], &[1, 2, 4], &[1, 5, 3], &[9, 1, 2]];
        let r = run(trace, &SimConfig::lru(100));
        // req 2: 1,2 hit, 4 put. req 3: 1 hit, 5 put, 3 present (not counted as hit).
        // req 4: 9 misses first, so 1 and 2 are present but not hits.
        assert_eq!(r.blocks, 12);
        assert_eq!(r.dram_hits, 3);
        assert_eq!(r.puts, 3 + 1 + 1 + 1);
        assert_eq!(r.present_after_miss, 1 + 2);
        assert!((r.hit_ratio() - 3.0 / 12.0).abs() < 1e-12);
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        // Capacity 2: [1,2] then [3] evicts 1 (2 was used later), so [2] hits and
        // [1] misses.
        let trace: &[&[u64]] = &[&[1], &[2], &[3], &[2], &[1]];
        let r = run(trace, &SimConfig::lru(2));
        assert_eq!(r.dram_hits, 1);
        assert_eq!(r.dram_evictions, 2); // 1 by 3, then 3 by 1 (2 was refreshed)
                                         // A hit refreshes: [1],[2],[1],[3] evicts 2, so [1] hits again.
        let trace: &[&[u64]] = &[&[1], &[2], &[1], &[3], &[1], &[2]];
        let r = run(trace, &SimConfig::lru(2));
        assert_eq!(r.dram_hits, 2);
    }

    #[test]
    fn watermarks_evict_in_batches() {
        // 10 blocks, evict above 9 (0.95 * 10 = 9.5 -> 9) down to 5.
        let cfg = SimConfig { high_watermark: 0.95, low_watermark: 0.5, ..SimConfig::lru(10) };
        let ids: Vec<u64> = (0..10).collect();
        let r = run(&[&ids, &[9], &[5], &[4]], &cfg);
        // The 10th put passes 9 blocks: 0..=4 are evicted, 5..=9 stay.
        assert_eq!(r.dram_evictions, 5);
        assert_eq!(r.dram_hits, 2);
    }

    #[test]
    fn dram_victims_go_to_ssd_and_ssd_hits_stay_there() {
        let cfg = SimConfig { ssd_blocks: 2, ..SimConfig::lru(1) };
        // 1 then 2: 1 goes to SSD. [1] is an SSD hit and stays on SSD.
        let r = run(&[&[1], &[2], &[1], &[1]], &cfg);
        assert_eq!((r.dram_hits, r.ssd_hits), (0, 2));
        // 1,2,3 put: 1 and 2 on SSD, 3 in DRAM; 4 pushes 3 to SSD, evicting 1 (FIFO):
        // 2 and 3 hit on SSD.
        let r = run(&[&[1], &[2], &[3], &[4], &[2], &[3]], &cfg);
        assert_eq!(r.ssd_evictions, 1);
        assert_eq!((r.ssd_hits, r.puts), (2, 4));
    }

    #[test]
    fn batch_of_dram_victims_all_reach_ssd() {
        // DRAM of 10 evicting 5 at once (above 9, down to 5) into an SSD of 10: every
        // victim is kept, in LRU order (the SSD then drops the oldest first).
        let cfg = SimConfig { high_watermark: 0.95, low_watermark: 0.5, ssd_blocks: 10, ..SimConfig::lru(10) };
        let ids: Vec<u64> = (0..10).collect();
        let r = run(&[&ids, &[0], &[1], &[2], &[3], &[4]], &cfg);
        assert_eq!((r.dram_evictions, r.ssd_hits), (5, 5));
        let cfg = SimConfig { ssd_blocks: 3, ..cfg };
        let r = run(&[&ids, &[0], &[2], &[3], &[4]], &cfg);
        assert_eq!((r.ssd_evictions, r.ssd_hits), (2, 3));
    }

    #[test]
    fn ssd_lru_evicts_never_read_first() {
        // SSD of 2. 1 and 2 go to SSD (via DRAM of 1); 1 is read; 3 and 4 push 2
        // and then 3 to SSD: under LRU the never-read 2 goes first, then 3 (never
        // read) before the read 1; under FIFO 1 goes first.
        let trace: &[&[u64]] = &[&[1], &[2], &[3], &[1], &[4], &[5], &[1]];
        let lru = run(trace, &SimConfig { ssd_blocks: 2, ssd_policy: SsdPolicy::Lru, ..SimConfig::lru(1) });
        let fifo = run(trace, &SimConfig { ssd_blocks: 2, ssd_policy: SsdPolicy::Fifo, ..SimConfig::lru(1) });
        assert_eq!(lru.ssd_hits, 2);
        assert_eq!(fifo.ssd_hits, 1);
    }
}
