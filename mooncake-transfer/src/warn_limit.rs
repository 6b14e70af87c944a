//! Warnings held back while they repeat: a listener under a flood of connections it
//! refuses (no secret, a wrong one, too many waiting) would otherwise write a line
//! per connection and bury everything else in the log.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// At most one warning per this long for one kind of event.
pub const WARN_EVERY: Duration = Duration::from_secs(10);

/// One kind of warning, written at most once per [`WARN_EVERY`]; the occurrences held
/// back meanwhile are logged at debug level and counted in the next warning.
#[derive(Debug, Default)]
pub struct WarnLimiter {
    state: Mutex<LimiterState>,
}

#[derive(Debug, Default)]
struct LimiterState {
    /// When the last warning was written.
    warned: Option<Instant>,
    /// Occurrences since then that were not warned about.
    held_back: u64,
    /// Occurrences ever.
    total: u64,
}

impl WarnLimiter {
    /// Logs `message` as a warning if none was written for [`WARN_EVERY`] (with how
    /// many were held back), else at debug level.
    pub fn warn(&self, message: std::fmt::Arguments<'_>) {
        match self.admit(Instant::now()) {
            Some(held_back) => tracing::warn!(held_back, "{message}"),
            None => tracing::debug!("{message}"),
        }
    }

    /// How many times this event happened.
    pub fn total(&self) -> u64 {
        self.state.lock().total
    }

    /// Records an occurrence at `now`: `Some(held back)` if it gets a warning.
    fn admit(&self, now: Instant) -> Option<u64> {
        let mut st = self.state.lock();
        st.total += 1;
        if st.warned.is_none_or(|w| now.duration_since(w) >= WARN_EVERY) {
            st.warned = Some(now);
            Some(std::mem::take(&mut st.held_back))
        } else {
            st.held_back += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_warns_once_per_period_and_counts_what_it_held_back() {
        let log = WarnLimiter::default();
        let t0 = Instant::now();
        assert_eq!(log.admit(t0), Some(0), "the first occurrence warns");
        for ms in 1..1000 {
            assert_eq!(log.admit(t0 + Duration::from_millis(ms)), None, "held back at {ms} ms");
        }
        assert_eq!(log.admit(t0 + WARN_EVERY), Some(999), "the next warning says how many were held back");
        assert_eq!(log.admit(t0 + WARN_EVERY + Duration::from_millis(1)), None);
        assert_eq!(log.total(), 1002);
    }
}
