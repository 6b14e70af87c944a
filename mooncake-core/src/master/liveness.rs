//! The monitor thread: client TTLs (and of record endpoints), the stall grace period,
//! put timeouts, placements held too long, eviction.

use std::sync::atomic::Ordering;

use crate::master::service::MasterService;
use crate::master::types::ClientId;

impl MasterService {
    /// One round of the monitor.
    pub(crate) fn tick(&self) {
        let now = self.now_ms();
        let last = self.last_tick_ms.swap(now, Ordering::Relaxed);
        let ttl = self.config.client_ttl.as_millis() as u64;
        // If the master itself did not run for a good part of the TTL (paused,
        // starved), clients' heartbeats could not be processed either: expiring them
        // now would punish them for our stall. Grant everyone a fresh TTL instead.
        if now.saturating_sub(last) > (ttl / 4).max(2 * self.config.monitor_interval.as_millis() as u64) {
            self.counters.stall_graces.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(stalled_ms = now - last, "master was stalled; granting clients a grace period");
            for rec in self.clients.read().values() {
                rec.touch(now);
            }
            return;
        }
        let expired: Vec<ClientId> = self
            .clients
            .read()
            .iter()
            .filter(|(_, rec)| now.saturating_sub(rec.last_heartbeat_ms.load(Ordering::Relaxed)) > ttl)
            .map(|(id, _)| *id)
            .collect();
        for client in expired {
            let removed = self.forget_client(client);
            self.counters.expired_clients.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(client = format!("{client:#x}"), removed, "client expired; its segments are unmounted");
        }
        // A node that heartbeats but whose record endpoint has refused every update
        // for a whole TTL is not alive as a storage node either.
        let unreachable: Vec<ClientId> = self
            .clients
            .read()
            .iter()
            .filter(|(_, rec)| rec.link.lock().as_ref().is_some_and(|l| l.failing_for().as_millis() as u64 > ttl))
            .map(|(id, _)| *id)
            .collect();
        for client in unreachable {
            self.forget_unreachable(client, "its records could not be delivered for a client TTL");
        }
        if self.counters.pending_puts.load(Ordering::Relaxed) > 0 {
            let timed_out = self.retain_entries(
                |_, e| !self.put_expired(e, now),
                |k, e| {
                    self.unsent_removals.add(k, self.drop_declared_put(k, e));
                    // Its writer may still be writing (see `quarantine_put`).
                    self.quarantine_put(e, self.config.put_timeout);
                },
            );
            self.counters.put_timeouts.fetch_add(timed_out as u64, Ordering::Relaxed);
        }
        self.free_orphaned_upserts(now);
        self.free_quarantined(now);
        self.free_expired_held(now);
        self.free_retired(now);
        self.forget_recovered_generations();
        self.evict_if_needed();
        // Eviction notices delivered (or whose node was forgotten) need no waiting.
        self.unsent_removals.prune();
    }
}
