//! Warnings about coordination failures, held back while they repeat: with etcd
//! unreachable every retry fails the same way, and a line per retry (several a second)
//! buries everything else in the log.

use std::time::{Duration, Instant};

/// At most one warning per this long while failures go on.
const EVERY: Duration = Duration::from_secs(30);

/// The failures of one member's coordination since it last worked.
#[derive(Debug, Default)]
pub(crate) struct FailureLog {
    /// When the current run of failures began (`None`: coordination works).
    since: Option<Instant>,
    /// When the last warning was written.
    warned: Option<Instant>,
    /// Failures since then that were logged at debug level only.
    held_back: u64,
}

impl FailureLog {
    /// Logs a failure of `what`: as a warning if it is the first since coordination
    /// last worked or the last warning is [`EVERY`] old (saying how many were held back
    /// meanwhile), else at debug level.
    pub(crate) fn failed(&mut self, member: &str, what: &str, error: &dyn std::fmt::Display) {
        if self.should_warn(Instant::now()) {
            let held_back = std::mem::take(&mut self.held_back);
            tracing::warn!(member, held_back, "{what}: {error}");
        } else {
            tracing::debug!(member, "{what}: {error}");
        }
    }

    /// Notes that a whole turn of coordination worked; says so once after failures.
    pub(crate) fn worked(&mut self, member: &str) {
        if let Some(since) = self.recover() {
            tracing::info!(member, failing_for = ?since, "cluster coordination works again");
        }
    }

    /// Whether a failure at `now` gets a warning (and records it either way).
    fn should_warn(&mut self, now: Instant) -> bool {
        self.since.get_or_insert(now);
        if self.warned.is_none_or(|w| now.duration_since(w) >= EVERY) {
            self.warned = Some(now);
            true
        } else {
            self.held_back += 1;
            false
        }
    }

    /// Ends a run of failures; how long it lasted, if there was one.
    fn recover(&mut self) -> Option<Duration> {
        let since = self.since.take()?;
        self.warned = None;
        self.held_back = 0;
        Some(since.elapsed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_failures_warn_once_per_period_and_recovery_resets() {
        let mut log = FailureLog::default();
        let t0 = Instant::now();
        assert!(log.should_warn(t0), "the first failure warns");
        for s in 1..30 {
            assert!(!log.should_warn(t0 + Duration::from_secs(s)), "held back at {s} s");
        }
        assert_eq!(log.held_back, 29);
        assert!(log.should_warn(t0 + EVERY), "one warning per period");
        assert!(!log.should_warn(t0 + EVERY + Duration::from_secs(1)));
        assert!(log.recover().is_some());
        assert!(log.recover().is_none(), "a recovery is reported once");
        assert_eq!(log.held_back, 0);
        assert!(log.should_warn(t0 + EVERY + Duration::from_secs(2)), "a new outage warns at once");
    }
}
