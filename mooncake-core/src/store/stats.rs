//! Counters of one client.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use crate::master::MasterStats;

#[derive(Default)]
pub(super) struct StoreCounters {
    pub(super) puts: AtomicU64,
    pub(super) put_bytes: AtomicU64,
    pub(super) put_errors: AtomicU64,
    pub(super) gets: AtomicU64,
    pub(super) get_bytes: AtomicU64,
    pub(super) get_errors: AtomicU64,
    pub(super) checksum_mismatches: AtomicU64,
    pub(super) removes: AtomicU64,
    pub(super) under_replicated_puts: AtomicU64,
    pub(super) declared_puts: AtomicU64,
    pub(super) device_direct_bytes: AtomicU64,
    pub(super) device_staged_bytes: AtomicU64,
    pub(super) record_mount_failures: AtomicU64,
    /// Whether calls are timed phase by phase (`StoreBuilder::phase_times`).
    pub(super) phase_times: bool,
    pub(super) write: WriteCounters,
    pub(super) read: ReadCounters,
}

impl StoreCounters {
    pub(super) fn inc(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// Times one phase after another of a call, each added to its counter; does
/// nothing (no clock reading) where the store does not time phases.
pub(super) struct PhaseTimer(Option<Instant>);

impl PhaseTimer {
    /// Starts timing a phase, if `counters` time phases.
    pub(super) fn start(counters: &StoreCounters) -> Self {
        Self(counters.phase_times.then(Instant::now))
    }

    /// Starts timing a phase and counts one in `count` (a call, a round), if
    /// `counters` time phases.
    pub(super) fn counting(counters: &StoreCounters, count: &AtomicU64) -> Self {
        let timer = Self::start(counters);
        timer.count(count);
        timer
    }

    /// Counts one in `count` (a round of the call), if timing.
    pub(super) fn count(&self, count: &AtomicU64) {
        if self.0.is_some() {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Adds the time since the start (or the previous phase) to `counter`.
    pub(super) fn add_to(self, counter: &AtomicU64) {
        let _ = self.next(counter);
    }

    /// Adds the time since the start (or the previous phase) to `counter`, and
    /// times the next phase from now.
    pub(super) fn next(self, counter: &AtomicU64) -> Self {
        let Some(then) = self.0 else { return self };
        let now = Instant::now();
        let ns = u64::try_from(now.duration_since(then).as_nanos()).unwrap_or(u64::MAX);
        counter.fetch_add(ns, Ordering::Relaxed);
        Self(Some(now))
    }
}

/// Declares a public type of phase times: `calls`, `rounds`, then one `u64` of
/// nanoseconds per phase, with [`since`](WriteTime::since) and
/// [`per_call_us`](WriteTime::per_call_us) (the phases' names are the fields'
/// without `_ns`), and the store's live counters of the same fields, whose
/// `snapshot` gives one.
macro_rules! phase_time {
    ($(#[$meta:meta])* $name:ident, $counters:ident { $($(#[$fmeta:meta])* $field:ident => $label:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name {
            /// Calls (a batch is one).
            pub calls: u64,
            /// Rounds of those calls (one each, unless one must try again).
            pub rounds: u64,
            $($(#[$fmeta])* pub $field: u64,)+
        }

        impl $name {
            /// What happened between `earlier` and this snapshot.
            pub fn since(&self, earlier: &$name) -> $name {
                $name {
                    calls: self.calls.saturating_sub(earlier.calls),
                    rounds: self.rounds.saturating_sub(earlier.rounds),
                    $($field: self.$field.saturating_sub(earlier.$field),)+
                }
            }

            /// Each phase's mean per call in microseconds, in the fields' order,
            /// named as the fields without `_ns`; zeros when no call was made.
            pub fn per_call_us(&self) -> [(&'static str, f64); <[&str]>::len(&[$($label),+])] {
                let per = |ns: u64| if self.calls == 0 { 0.0 } else { ns as f64 / self.calls as f64 / 1e3 };
                [$(($label, per(self.$field))),+]
            }
        }

        /// The live counters behind a snapshot of this type: one atomic per field.
        #[derive(Default)]
        pub(super) struct $counters {
            pub(super) calls: AtomicU64,
            pub(super) rounds: AtomicU64,
            $(pub(super) $field: AtomicU64,)+
        }

        impl $counters {
            pub(super) fn snapshot(&self) -> $name {
                $name {
                    calls: self.calls.load(Ordering::Relaxed),
                    rounds: self.rounds.load(Ordering::Relaxed),
                    $($field: self.$field.load(Ordering::Relaxed),)+
                }
            }
        }
    };
}

phase_time! {
    /// Where the time of a client's writes went: puts and upserts of every form
    /// (single, batch, parts, device), summed since the store was built, where the
    /// store times them ([`StoreBuilder::phase_times`](crate::StoreBuilder::phase_times)). Each phase
    /// is wall time of the calling thread; a call runs its phases one after the
    /// other, in rounds (a round places, moves and ends every item still pending; a
    /// failed write or a busy key takes another). Two snapshots' difference
    /// ([`since`](Self::since)) divided by its calls ([`per_call_us`](Self::per_call_us))
    /// says where a call's time goes: checksums, the master's answer, the copy or
    /// DMA, or the end's wait for the master (and, through it, for the nodes'
    /// records).
    WriteTime, WriteCounters {
        /// Summing values on this client's cores (or device): before their
        /// placement, to declare their checksums with it (values up to a size, with
        /// a master daemon or a cluster only), or after their copy where the
        /// transport did not sum them on the way.
        sum_ns => "sum",
        /// Placing: the master's placement (`put_start` and its forms; none for room
        /// held ahead) and the routes to its replicas.
        place_ns => "place",
        /// Moving the bytes into every replica (copies, transfers, DMAs), the device
        /// checksums and what runs beside the DMAs (`declare_ns`) included.
        move_ns => "move",
        /// Of `move_ns`: declaring checksums and binding room held ahead while
        /// device bytes move (`put_declare`, `put_bind`); a DMA longer than this
        /// hides it.
        declare_ns => "declare",
        /// Ending: binding room held ahead that was not bound on the way, revoking
        /// failed writes, and the end itself (`put_end` and its forms), which waits
        /// for the nodes' records of the puts.
        end_ns => "end",
    }
}

phase_time! {
    /// Where the time of a client's reads went: gets of every form (single, batch,
    /// into buffers, into device memory) and the reads of `replicate`, summed since
    /// the store was built, as
    /// [`WriteTime`] does for writes. A round reads one replica of every object
    /// still unread; a replica that fails or fails its checksum takes another.
    ReadTime, ReadCounters {
        /// Locating: asking the master for replica lists (none for a list this
        /// client kept from a recent get) and choosing the replica to read.
        locate_ns => "locate",
        /// Moving the bytes (copies, transfers, DMAs; into pinned chunks and on
        /// to the device for a replica streamed to device memory).
        move_ns => "move",
        /// Checking: the checksums not taken on the way (summed on this client's
        /// cores or, for bytes in device memory, on the device), then the leases'
        /// release.
        check_ns => "check",
        /// Uploading to device memory what was read into host memory first (a disk
        /// replica read for a device destination, say).
        upload_ns => "upload",
    }
}

/// A snapshot of a client's counters plus the master's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StoreStats {
    /// This client's id at the master.
    pub client_id: u64,
    /// Bytes this client gives the pool.
    pub segment_capacity: u64,
    /// Bytes allocated in this client's segment.
    pub segment_used: u64,
    /// Successful puts.
    pub puts: u64,
    /// Bytes of successful puts (once per object, not per replica).
    pub put_bytes: u64,
    /// Failed puts.
    pub put_errors: u64,
    /// Successful gets.
    pub gets: u64,
    /// Bytes returned by successful gets.
    pub get_bytes: u64,
    /// Failed gets (including not found).
    pub get_errors: u64,
    /// Replica reads whose bytes failed the checksum (and were retried elsewhere).
    pub checksum_mismatches: u64,
    /// Successful removes.
    pub removes: u64,
    /// Puts stored with fewer replicas than asked (see
    /// [`ReplicateConfig::require_all_replicas`](crate::ReplicateConfig)).
    pub under_replicated_puts: u64,
    /// Successful puts whose checksum this client declared before their end: with
    /// their placement (summed before it) or, for device memory moved into mapped
    /// segments, beside their DMA, so that a master daemon or cluster records them
    /// on their nodes while their bytes are written (what the master made of it:
    /// [`MasterStats::declared_puts`](crate::MasterStats::declared_puts); a master
    /// without durable records ignores the declaration). Never with a master in this
    /// process, whose records cost nothing to wait for.
    pub declared_puts: u64,
    /// Bytes of objects moved straight between device memory and the pool by
    /// `get_into_device` / `put_from_device` (and their batch forms), with no host
    /// copy: one-sided RDMA to and from GPU memory registered with the NICs, or one
    /// DMA from or into a replica in a segment this process maps (its own, a
    /// same-host peer's), page-locked. Counted once per object.
    pub device_direct_bytes: u64,
    /// Bytes of objects those calls staged through pinned host memory instead (a
    /// replica over TCP, on a disk, or in memory that could not be page-locked or
    /// registered). Counted once per object.
    pub device_staged_bytes: u64,
    /// Bytes of mapped segments (this client's own, same-host peers') page-locked
    /// now for device copies: the pieces replicas moved by DMA lie in (see
    /// [`StoreBuilder::page_lock_piece`](crate::StoreBuilder::page_lock_piece)).
    /// Taken back when a mapping is dropped with its store or replaced.
    pub device_page_locked_bytes: u64,
    /// Connections to this storage node's record endpoint that were refused: they
    /// could not prove the record key only the masters it mounted on know (a forged
    /// record change, say). See [`Store::record_endpoint`](crate::Store::record_endpoint).
    pub record_refusals: u64,
    /// Times the master could not reach this node's record endpoint when the node
    /// joined or re-joined (`mount_records` failed): the node's record changes then
    /// come with its heartbeats only, so an acknowledged put may be unknown to a
    /// master restarted before the next heartbeat.
    pub record_mount_failures: u64,
    /// Where the time of this client's puts and upserts went, phase by phase
    /// (zeros unless [`StoreBuilder::phase_times`](crate::StoreBuilder::phase_times)).
    pub write_time: WriteTime,
    /// Where the time of this client's gets went, phase by phase (zeros unless
    /// [`StoreBuilder::phase_times`](crate::StoreBuilder::phase_times)).
    pub read_time: ReadTime,
    /// The SSD tier's counters, if this client has one.
    pub ssd: Option<super::SsdStats>,
    /// Objects this client pulled from other clients' SSDs.
    pub disk_loads: u64,
    /// Gets served through a replica list kept from a recent get (one round trip,
    /// to the replica, instead of two).
    pub replica_cache_hits: u64,
    /// The master's view.
    pub master: MasterStats,
}

/// Every field, on a few lines:
///
/// ```text
/// client 0x…: segment 1048576/4194304 bytes used
///   puts 10 (…), gets 12 (…), removes 0, checksum retries 0, declared 0, replica cache hits 3, disk loads 0,
///     device bytes 0 direct / 0 staged (0 B page-locked)
///   writes 10 calls (10 rounds), per call: sum 0.0 us, place 6.1 us, move 40.2 us (declare 0.0 us), end 6.3 us
///   reads 12 calls (12 rounds), per call: locate 5.9 us, move 38.0 us, check 0.4 us, upload 0.0 us
///   ssd (bucket, io …): 8 objects, 65536/… B used, 8 offloaded (65536 B, 0 failed), …
///   master (random): 10 objects (…), … evicted (… B), lease refusals 0, put timeouts 0, …
/// ```
impl std::fmt::Display for StoreStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = &self.master;
        writeln!(
            f,
            "client {:#x}: segment {}/{} bytes used",
            self.client_id, self.segment_used, self.segment_capacity
        )?;
        writeln!(
            f,
            "  puts {} ({} B, {} failed), gets {} ({} B, {} failed), removes {}, checksum retries {}, \
             declared {}, replica cache hits {}, disk loads {}, device bytes {} direct / {} staged ({} B page-locked), record refusals {}, \
             record mounts failed {}",
            self.puts,
            self.put_bytes,
            self.put_errors,
            self.gets,
            self.get_bytes,
            self.get_errors,
            self.removes,
            self.checksum_mismatches,
            self.declared_puts,
            self.replica_cache_hits,
            self.disk_loads,
            self.device_direct_bytes,
            self.device_staged_bytes,
            self.device_page_locked_bytes,
            self.record_refusals,
            self.record_mount_failures
        )?;
        let w = &self.write_time;
        let [sum, place, moved, declare, end] = w.per_call_us().map(|(_, us)| us);
        writeln!(
            f,
            "  writes {} calls ({} rounds), per call: sum {sum:.1} us, place {place:.1} us, move {moved:.1} us \
             (declare {declare:.1} us), end {end:.1} us",
            w.calls, w.rounds
        )?;
        let r = &self.read_time;
        let [locate, moved, check, upload] = r.per_call_us().map(|(_, us)| us);
        writeln!(
            f,
            "  reads {} calls ({} rounds), per call: locate {locate:.1} us, move {moved:.1} us, check {check:.1} us, \
             upload {upload:.1} us",
            r.calls, r.rounds
        )?;
        if let Some(s) = &self.ssd {
            let b = &s.backend;
            writeln!(
                f,
                "  ssd ({}, io {}): {} objects in {} units, {}/{} B used, {} evicted ({} units), \
                 {} pending notifications; {} offloaded ({} B, {} failed), {} local loads, {} served loads, \
                 {} discarded ({} pending), {} recovered; staging {:?}",
                b.backend,
                b.io,
                b.objects,
                b.units,
                b.used_bytes,
                b.capacity.map_or_else(|| "unbounded".to_owned(), |c| c.to_string()),
                b.evicted_objects,
                b.evicted_units,
                b.pending_notifications,
                s.offloaded_objects,
                s.offloaded_bytes,
                s.offload_failures,
                s.local_loads,
                s.served_loads,
                s.discarded,
                s.discards_pending,
                s.recovered,
                s.staging
            )?;
        }
        write!(
            f,
            "  master ({}): {} objects ({} B, {} pending puts), {} replicas, {} clients, {} segments, {}/{} B used \
             (max fragmentation {:.2}), {} evicted ({} B), lease refusals {}, put timeouts {}, \
             {} clients expired, {} stall graces, metadata {} B (keys {} B)",
            m.allocation_strategy,
            m.objects,
            m.object_bytes,
            m.pending_puts,
            m.replicas,
            m.clients,
            m.segments,
            m.used_bytes,
            m.capacity_bytes,
            m.max_fragmentation,
            m.evicted_objects,
            m.evicted_bytes,
            m.lease_refusals,
            m.put_timeouts,
            m.expired_clients,
            m.stall_graces,
            m.metadata_bytes,
            m.key_bytes
        )
    }
}
