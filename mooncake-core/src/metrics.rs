//! Prometheus text and JSON status of a master (served by `mooncake-master
//! --metrics-listen`).

use std::fmt::Write;
use std::sync::atomic::Ordering;

use crate::master::MasterStats;
use crate::rpc::wire::REQUEST_KINDS;
use crate::rpc::RpcServerStats;

/// Renders the master's stats (and its RPC counters, if any) in the Prometheus text
/// exposition format.
pub fn prometheus_text(stats: &MasterStats, rpc: Option<&RpcServerStats>) -> String {
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, kind: &str, value: f64| write_metric(&mut out, name, help, kind, value);
    gauge("objects", "Complete objects.", "gauge", stats.objects as f64);
    gauge("object_bytes", "Logical bytes of complete objects.", "gauge", stats.object_bytes as f64);
    gauge("pending_puts", "Puts started and not ended.", "gauge", stats.pending_puts as f64);
    gauge("replicas", "Memory replicas.", "gauge", stats.replicas as f64);
    gauge("clients", "Registered clients.", "gauge", stats.clients as f64);
    gauge("segments", "Mounted segments.", "gauge", stats.segments as f64);
    gauge("capacity_bytes", "Bytes of all mounted segments.", "gauge", stats.capacity_bytes as f64);
    gauge("used_bytes", "Bytes allocated in mounted segments.", "gauge", stats.used_bytes as f64);
    gauge(
        "metadata_bytes",
        "Memory of the object index (estimate, keys included).",
        "gauge",
        stats.metadata_bytes as f64,
    );
    gauge("max_fragmentation", "Worst free-space fragmentation of a segment.", "gauge", stats.max_fragmentation);
    gauge("evicted_objects_total", "Objects evicted.", "counter", stats.evicted_objects as f64);
    gauge("evicted_bytes_total", "Bytes freed by eviction.", "counter", stats.evicted_bytes as f64);
    gauge("lease_refusals_total", "Removes refused because of a live lease.", "counter", stats.lease_refusals as f64);
    gauge("put_timeouts_total", "Puts reclaimed after the put timeout.", "counter", stats.put_timeouts as f64);
    gauge("expired_clients_total", "Clients expired after the TTL.", "counter", stats.expired_clients as f64);
    gauge(
        "under_replicated_puts_total",
        "Puts placed with fewer replicas than asked.",
        "counter",
        stats.under_replicated_puts as f64,
    );
    gauge(
        "segment_failures_total",
        "Segments clients reported they could not write to.",
        "counter",
        stats.segment_failures as f64,
    );
    gauge(
        "record_failures_total",
        "Storage nodes forgotten because they could not be told of a change to their records.",
        "counter",
        stats.record_failures as f64,
    );
    gauge("stall_graces_total", "Grace periods granted after a master stall.", "counter", stats.stall_graces as f64);
    gauge(
        "slot_groups_acquired_total",
        "Slot groups this master took the lead of.",
        "counter",
        stats.groups_acquired as f64,
    );
    gauge("slot_groups_released_total", "Slot groups this master gave up.", "counter", stats.groups_released as f64);
    gauge("moved_answers_total", "Calls answered Moved (slot led elsewhere).", "counter", stats.moved_answers as f64);
    if let Some(rpc) = rpc {
        let _ = writeln!(out, "# HELP mooncake_ops_total Requests served, by kind.\n# TYPE mooncake_ops_total counter");
        for (i, kind) in REQUEST_KINDS.iter().enumerate() {
            let _ =
                writeln!(out, "mooncake_ops_total{{kind=\"{kind}\"}} {}", rpc.ops_by_kind[i].load(Ordering::Relaxed));
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_errors_total Requests answered with an error, by kind.\n# TYPE mooncake_errors_total counter"
        );
        for (i, kind) in REQUEST_KINDS.iter().enumerate() {
            let _ = writeln!(
                out,
                "mooncake_errors_total{{kind=\"{kind}\"}} {}",
                rpc.errors_by_kind[i].load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_bad_frames_total Connections closed for a malformed frame.\n# TYPE mooncake_bad_frames_total counter\nmooncake_bad_frames_total {}",
            rpc.bad_frames.load(Ordering::Relaxed)
        );
        let connection_metrics = [
            ("open_connections", "Client connections open now.", "gauge", &rpc.open_connections),
            (
                "refused_connections_total",
                "Connections refused at once (protected mode, connection limit).",
                "counter",
                &rpc.refused_connections,
            ),
            (
                "hello_timeouts_total",
                "Connections closed for not completing their hello in time.",
                "counter",
                &rpc.hello_timeouts,
            ),
            (
                "auth_failures_total",
                "Connections that failed the shared-secret handshake.",
                "counter",
                &rpc.auth_failures,
            ),
            ("rpc_buffered_bytes", "Bytes of request bodies held in memory now.", "gauge", &rpc.buffered_bytes),
            (
                "rpc_over_budget_total",
                "Requests refused with an error for what decoding them would allocate.",
                "counter",
                &rpc.over_budget,
            ),
            (
                "rpc_decoding_bytes",
                "Bytes charged for decoded requests being answered now.",
                "gauge",
                &rpc.decoding_bytes,
            ),
        ];
        for (name, help, kind, value) in connection_metrics {
            let _ = writeln!(
                out,
                "# HELP mooncake_{name} {help}\n# TYPE mooncake_{name} {kind}\nmooncake_{name} {}",
                value.load(Ordering::Relaxed)
            );
        }
    }
    out
}

/// Renders a cluster member's counters (cluster mode) in the Prometheus text format,
/// to append to [`prometheus_text`].
#[cfg(feature = "etcd")]
pub fn cluster_prometheus_text(stats: &crate::cluster::MemberStats) -> String {
    let mut out = String::new();
    let mut metric = |name: &str, help: &str, kind: &str, value: f64| write_metric(&mut out, name, help, kind, value);
    metric("cluster_groups_led", "Slot groups this master leads now.", "gauge", stats.groups_led as f64);
    metric("cluster_slots_led", "Slots this master leads now.", "gauge", stats.slots_led as f64);
    metric(
        "cluster_failovers_total",
        "Groups taken over from a leader whose lease lapsed.",
        "counter",
        stats.failovers as f64,
    );
    metric(
        "cluster_groups_acquired_total",
        "Groups this master took the lead of.",
        "counter",
        stats.acquired_total as f64,
    );
    metric("cluster_groups_released_total", "Groups this master gave up.", "counter", stats.released_total as f64);
    metric("cluster_lease_renewals_total", "Lease renewals etcd acknowledged.", "counter", stats.lease_renewals as f64);
    metric("cluster_lease_lapses_total", "Times this master's lease lapsed.", "counter", stats.lease_lapses as f64);
    metric(
        "cluster_is_scheduler",
        "1 while this master runs the cluster's scheduler.",
        "gauge",
        u8::from(stats.is_scheduler) as f64,
    );
    out
}

/// One metric in the Prometheus text format: help, type and value lines.
fn write_metric(out: &mut String, name: &str, help: &str, kind: &str, value: f64) {
    let _ = writeln!(out, "# HELP mooncake_{name} {help}\n# TYPE mooncake_{name} {kind}\nmooncake_{name} {value}");
}
