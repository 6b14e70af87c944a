//! The master's generation clock: the numbers that order every put, remove and record
//! change of a key (ARCHITECTURE.md, "Generations").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Generations ahead of the wall clock by more than this are not believed (a node
/// offering a record stamped years ahead must not push the clock to its end).
const MAX_AHEAD_NS: u64 = 24 * 3600 * 1_000_000_000;

/// Nanoseconds since the Unix epoch (0 before it).
fn unix_ns() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// A hybrid clock of generations: each is the wall clock in nanoseconds, bumped to
/// be strictly greater than every generation handed out or seen before. So they
/// increase within a master, and a restarted master (or a new slot leader) starts
/// above what the previous one handed out as long as the clocks agree within the
/// time a restart takes; it is raised again by every generation it is offered
/// (records, disk files), which covers a clock that is behind.
pub(crate) struct GenClock {
    last: AtomicU64,
}

impl Default for GenClock {
    fn default() -> Self {
        Self { last: AtomicU64::new(unix_ns()) }
    }
}

impl GenClock {
    /// A new generation, greater than every one before.
    pub(crate) fn next(&self) -> u64 {
        let now = unix_ns();
        let prev = self
            .last
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |g| Some(now.max(g.saturating_add(1))))
            .unwrap_or_else(|g| g);
        now.max(prev.saturating_add(1))
    }

    /// A generation seen elsewhere (a record, a file): later ones are greater.
    /// Generations implausibly far ahead of the wall clock are ignored.
    pub(crate) fn observe(&self, generation: u64) {
        if Self::believable(generation) {
            self.last.fetch_max(generation, Ordering::AcqRel);
        }
    }

    /// Whether `generation` is not implausibly far ahead of the wall clock (more
    /// than a day): a copy stamped so is never taken for a newer object either.
    pub(crate) fn believable(generation: u64) -> bool {
        generation <= unix_ns().saturating_add(MAX_AHEAD_NS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_strictly_increase_across_threads_and_observations() {
        let clock = std::sync::Arc::new(GenClock::default());
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let clock = clock.clone();
                std::thread::spawn(move || (0..10_000).map(|_| clock.next()).collect::<Vec<u64>>())
            })
            .collect();
        let mut all: Vec<u64> = Vec::new();
        for h in handles {
            let gens = h.join().unwrap();
            assert!(gens.windows(2).all(|w| w[0] < w[1]), "increasing within a thread");
            all.extend(gens);
        }
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "no generation handed out twice");
        // A generation seen ahead of the clock (a master whose clock was ahead) is
        // passed; one absurdly far ahead is ignored.
        let ahead = unix_ns() + 3_600_000_000_000;
        clock.observe(ahead);
        assert!(clock.next() > ahead);
        clock.observe(u64::MAX - 1);
        assert!(clock.next() < u64::MAX / 2);
    }
}
