//! The lease deadline that fences a member's leadership.
//!
//! etcd ends a lease `ttl` after the last keepalive it *received*; a keepalive is
//! received after it was *sent*. So if the member counts from the instant it sent a
//! keepalive that etcd acknowledged, its lease cannot end before `sent + ttl`. The
//! member stops answering for its groups at `sent + ttl - ttl/3`: the last third is the
//! margin for the two clocks' rates and for the moments between a check and the answer
//! it guards. A member stopped past its deadline (SIGSTOP, a stall) finds every group
//! fenced when it resumes, before etcd could have given them to anyone else.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The instant until which the member may act as a leader, readable from any thread
/// with one atomic load.
#[derive(Debug)]
pub(crate) struct Fence {
    base: Instant,
    /// Nanoseconds after `base`; 0 means "not valid".
    until: AtomicU64,
}

impl Fence {
    /// A fence that is not valid until [`Fence::extend`] is called.
    pub(crate) fn new() -> Fence {
        Fence { base: Instant::now(), until: AtomicU64::new(0) }
    }

    /// The deadline a keepalive sent at `sent` and acknowledged with `ttl` gives.
    pub(crate) fn deadline(sent: Instant, ttl: Duration) -> Instant {
        sent + ttl - ttl / 3
    }

    /// Whether the deadline is still ahead.
    pub(crate) fn is_valid(&self) -> bool {
        self.nanos(Instant::now()) < self.until.load(Ordering::Acquire)
    }

    /// Moves the deadline to `until` if that is later (renewals may be acknowledged
    /// out of order; the latest send wins).
    pub(crate) fn extend(&self, until: Instant) {
        self.until.fetch_max(self.nanos(until), Ordering::AcqRel);
    }

    /// Ends validity now (the lease was lost or given up).
    pub(crate) fn revoke(&self) {
        self.until.store(0, Ordering::Release);
    }

    /// The deadline, if one was ever set and not revoked.
    pub(crate) fn until(&self) -> Option<Instant> {
        match self.until.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.base + Duration::from_nanos(n)),
        }
    }

    fn nanos(&self, t: Instant) -> u64 {
        // Saturates for instants before `base` (never valid) and centuries ahead.
        u64::try_from(t.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_keeps_a_third_of_the_ttl_as_margin() {
        let t = Instant::now();
        assert_eq!(Fence::deadline(t, Duration::from_secs(3)), t + Duration::from_secs(2));
    }

    #[test]
    fn validity_follows_the_latest_deadline() {
        let f = Fence::new();
        assert!(!f.is_valid());
        assert_eq!(f.until(), None);
        let far = Instant::now() + Duration::from_secs(60);
        f.extend(far);
        assert!(f.is_valid());
        // An older acknowledgment does not pull the deadline back.
        f.extend(Instant::now());
        assert!(f.is_valid());
        assert!(f.until().unwrap() + Duration::from_millis(1) >= far);
        f.revoke();
        assert!(!f.is_valid());
        // A deadline already past is not valid.
        f.extend(Instant::now() - Duration::from_millis(1));
        assert!(!f.is_valid());
    }
}
