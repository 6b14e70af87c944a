//! Configuration types of the store and the master.

use std::sync::Arc;
use std::time::Duration;

use mooncake_alloc::{AllocationStrategy, Random};

use crate::error::{Error, Result};

/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 4096;
/// Largest value, in bytes (4 GiB).
pub const MAX_VALUE_LEN: u64 = 4 << 30;

/// The most replicas one object may ask for ([`ReplicateConfig::replica_num`]):
/// more is `InvalidArgument`. (Each replica lies on a segment of its own, so a
/// larger count could never be placed; the bound keeps a request's placement
/// bookkeeping small whatever a client sends.)
pub const MAX_REPLICA_NUM: usize = 1024;

/// Checks a key: UTF-8 (guaranteed by `&str`), 1..=4096 bytes.
pub(crate) fn check_key(key: &str) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidArgument("empty key".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!("key of {} bytes exceeds {MAX_KEY_LEN}", key.len())));
    }
    Ok(())
}

/// Checks a value size: 1 byte ..= 4 GiB.
pub(crate) fn check_value_len(len: u64) -> Result<()> {
    if len == 0 {
        return Err(Error::InvalidArgument("empty value".into()));
    }
    if len > MAX_VALUE_LEN {
        return Err(Error::InvalidArgument(format!("value of {len} bytes exceeds 4 GiB")));
    }
    Ok(())
}

/// How many copies of an object to keep, and where.
///
/// ```
/// use mooncake_core::ReplicateConfig;
/// let cfg = ReplicateConfig { replica_num: 2, soft_pin: true, ..Default::default() };
/// assert!(cfg.preferred_segments.is_empty());
/// ```
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReplicateConfig {
    /// Number of memory replicas, each on a distinct segment (default 1; 1 to
    /// [`MAX_REPLICA_NUM`]). Placement is best effort: with fewer segments with room,
    /// fewer replicas are made.
    pub replica_num: usize,
    /// Segments (by name) to try first, in order; they bypass the strategy's ranking.
    pub preferred_segments: Vec<String>,
    /// Soft-pinned objects are evicted only when nothing else can be.
    pub soft_pin: bool,
    /// With `soft_pin`: how long the pin lasts after the object was last written or
    /// read (each read renews it); then the object is evictable like any other.
    /// `None` (the default): the pin lasts as long as the object. Kept with
    /// millisecond precision, at most `u32::MAX` ms (about 49 days; longer is
    /// clamped); setting it without `soft_pin` is `InvalidArgument`.
    pub soft_pin_ttl: Option<Duration>,
    /// For an upsert that replaces an object, or a replicate: keep the pin state (and
    /// TTL) the object has, ignoring `soft_pin` and `soft_pin_ttl` (a new object takes
    /// those). Puts ignore it. Default false: the upsert or replicate sets the pin as
    /// `soft_pin` says.
    pub keep_soft_pin: bool,
    /// Fail a put (`NoSpace`) rather than store fewer than `replica_num` replicas
    /// (default false: best effort, counted in `under_replicated_puts`).
    pub require_all_replicas: bool,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        Self {
            replica_num: 1,
            preferred_segments: Vec::new(),
            soft_pin: false,
            soft_pin_ttl: None,
            keep_soft_pin: false,
            require_all_replicas: false,
        }
    }
}

impl ReplicateConfig {
    /// `replica_num` replicas, nothing else changed.
    pub fn replicas(replica_num: usize) -> Self {
        Self { replica_num, ..Self::default() }
    }

    pub(crate) fn check(&self) -> Result<()> {
        if self.replica_num == 0 {
            return Err(Error::InvalidArgument("replica_num must be at least 1".into()));
        }
        if self.replica_num > MAX_REPLICA_NUM {
            return Err(Error::InvalidArgument(format!("replica_num {} exceeds {MAX_REPLICA_NUM}", self.replica_num)));
        }
        if self.soft_pin_ttl.is_some() && !self.soft_pin {
            return Err(Error::InvalidArgument("soft_pin_ttl is set but soft_pin is not".into()));
        }
        Ok(())
    }

    /// The soft pin's TTL as the master keeps it: milliseconds, 0 for none (a zero
    /// TTL becomes 1 ms: a pin that is already over).
    pub(crate) fn soft_pin_ttl_ms(&self) -> u32 {
        match self.soft_pin_ttl {
            Some(ttl) if self.soft_pin => ttl.as_millis().clamp(1, u32::MAX as u128) as u32,
            _ => 0,
        }
    }
}

/// How a client reaches other clients' segments.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Protocol {
    /// Same process: `memcpy` between registered regions.
    #[default]
    Local,
    /// TCP to every peer, even on the same host.
    Tcp,
    /// Shared memory to peers on the same host, TCP to the others.
    Shm,
    /// One-sided RDMA to every peer that serves it, TCP to the others. Building a
    /// store fails with a `NoDevice` transport error when this host has no RDMA
    /// device (or the build lacks the `rdma` feature and no provider was given).
    Rdma,
    /// Shared memory on the same host, RDMA to peers when both ends have a
    /// device, TCP otherwise.
    Auto,
}

impl std::str::FromStr for Protocol {
    type Err = String;

    /// `local`, `tcp`, `shm`, `rdma` or `auto`.
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "local" => Ok(Self::Local),
            "tcp" => Ok(Self::Tcp),
            "shm" => Ok(Self::Shm),
            "rdma" => Ok(Self::Rdma),
            "auto" => Ok(Self::Auto),
            other => Err(format!("unknown protocol {other} (local, tcp, shm, rdma, auto)")),
        }
    }
}

/// Settings of the master service.
///
/// ```
/// use mooncake_core::MasterConfig;
/// use std::time::Duration;
/// let cfg = MasterConfig { default_lease: Duration::from_millis(500), ..Default::default() };
/// assert_eq!(cfg.high_watermark, 0.95);
/// ```
#[derive(Clone)]
pub struct MasterConfig {
    /// Lease granted to readers by each replica-list call (default 5 s).
    pub default_lease: Duration,
    /// A client silent this long loses its segments (default 10 s). The room of a
    /// revoked put is kept this long before it is placed again (bytes sent to a node
    /// that paused may still land there).
    pub client_ttl: Duration,
    /// A put not ended this long after it started is reclaimed, its room kept this
    /// long again before it is placed again (its writer may still be writing there)
    /// (default 30 s).
    pub put_timeout: Duration,
    /// Eviction starts when the pool, or one segment, is fuller than this (default 0.95).
    pub high_watermark: f64,
    /// Eviction frees down to `high_watermark - eviction_ratio` (default 0.05).
    pub eviction_ratio: f64,
    /// How replicas are placed (default [`Random`]).
    pub allocation_strategy: Arc<dyn AllocationStrategy>,
    /// Period of the background thread that expires clients and puts and runs
    /// eviction (default 100 ms).
    pub monitor_interval: Duration,
    /// Tell segment owners (with their heartbeats) which objects their segments
    /// hold, so that they can repopulate a restarted master (default false: an
    /// embedded master dies with its clients; [`MasterConfig::served`], the
    /// daemon's defaults, turns it on).
    pub track_records: bool,
    /// When objects in memory are written to their owner's SSD tier (default
    /// [`PersistPolicy::Lazy`]). Only clients with an SSD tier are asked.
    pub persist: PersistPolicy,
    /// Longest time a put waits for offloads to make room in memory, when every
    /// object that could be evicted is still waiting to reach an SSD (default 10 s).
    pub offload_wait: Duration,
    /// Longest wait for one delivery of record changes to a storage node (when the
    /// node serves a record endpoint); a delivery that does not answer in time is sent
    /// again, and the put or remove keeps waiting. A node is forgotten only by liveness:
    /// gone (its endpoint refuses connections), silent for `client_ttl`, or its
    /// deliveries failing for `client_ttl` (default 2 s).
    pub record_timeout: Duration,
    /// How long room a client holds ahead of its next put stays held for it
    /// ([`MasterApi::place_ahead`](crate::MasterApi::place_ahead); at most
    /// `put_timeout`); the client writes into it only within the first fifth.
    /// Zero turns placements ahead off (default 500 ms).
    pub placement_hold: Duration,
}

/// When the master has objects written to an SSD tier (reference: "Eager, Lazy and
/// None" persistence). An object is offloaded by the client owning the segment that
/// holds its first memory replica, if that client has an SSD tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PersistPolicy {
    /// Never: memory eviction drops objects, the SSD tier only serves what it was
    /// given before (after a restart).
    None,
    /// When memory must be freed: eviction first asks for the object to be
    /// offloaded and frees its memory once it is on disk, so nothing is lost while the
    /// SSD has room (puts may wait, bounded by [`MasterConfig::offload_wait`]).
    #[default]
    Lazy,
    /// As soon as a put completes (write-behind): every object also lives on disk,
    /// and eviction never has to wait.
    Eager,
}

impl std::str::FromStr for PersistPolicy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(PersistPolicy::None),
            "lazy" => Ok(PersistPolicy::Lazy),
            "eager" => Ok(PersistPolicy::Eager),
            _ => Err(Error::InvalidArgument(format!("persist policy {s:?}: use none, lazy or eager"))),
        }
    }
}

impl std::fmt::Debug for MasterConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterConfig")
            .field("default_lease", &self.default_lease)
            .field("client_ttl", &self.client_ttl)
            .field("put_timeout", &self.put_timeout)
            .field("high_watermark", &self.high_watermark)
            .field("eviction_ratio", &self.eviction_ratio)
            .field("allocation_strategy", &self.allocation_strategy.name())
            .field("monitor_interval", &self.monitor_interval)
            .field("track_records", &self.track_records)
            .field("persist", &self.persist)
            .field("offload_wait", &self.offload_wait)
            .field("record_timeout", &self.record_timeout)
            .field("placement_hold", &self.placement_hold)
            .finish()
    }
}

impl Default for MasterConfig {
    fn default() -> Self {
        Self {
            default_lease: Duration::from_secs(5),
            client_ttl: Duration::from_secs(10),
            put_timeout: Duration::from_secs(30),
            high_watermark: 0.95,
            eviction_ratio: 0.05,
            allocation_strategy: Arc::new(Random),
            monitor_interval: Duration::from_millis(100),
            track_records: false,
            persist: PersistPolicy::Lazy,
            offload_wait: Duration::from_secs(10),
            record_timeout: Duration::from_secs(2),
            placement_hold: Duration::from_millis(500),
        }
    }
}

impl MasterConfig {
    /// The defaults of a master served to other processes (the daemon's):
    /// [`track_records`](Self::track_records) on, so that clients can repopulate it
    /// after a restart; everything else as [`Default`].
    ///
    /// ```
    /// assert!(mooncake_core::MasterConfig::served().track_records);
    /// ```
    pub fn served() -> Self {
        Self { track_records: true, ..Self::default() }
    }

    pub(crate) fn check(&self) -> Result<()> {
        if !(self.high_watermark > 0.0 && self.high_watermark <= 1.0) {
            return Err(Error::InvalidArgument(format!("high_watermark {} not in (0, 1]", self.high_watermark)));
        }
        if !(0.0..self.high_watermark).contains(&self.eviction_ratio) {
            return Err(Error::InvalidArgument(format!(
                "eviction_ratio {} not in [0, high_watermark)",
                self.eviction_ratio
            )));
        }
        if self.client_ttl.is_zero() || self.monitor_interval.is_zero() {
            return Err(Error::InvalidArgument("client_ttl and monitor_interval must be > 0".into()));
        }
        Ok(())
    }
}

/// Parses a size: `4096`, `64KiB`, `64MiB`, `4GiB`, `1TiB` (also `K`, `M`, `G`, `T`,
/// `KB`, `MB`, `GB`, `TB`, all powers of 1024; case-insensitive).
///
/// ```
/// use mooncake_core::parse_size;
/// assert_eq!(parse_size("4096").unwrap(), 4096);
/// assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
/// assert_eq!(parse_size("4gib").unwrap(), 4 << 30);
/// assert!(parse_size("12 parsecs").is_err());
/// ```
pub fn parse_size(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let bad = || Error::InvalidArgument(format!("bad size {text:?}: use e.g. 4096, 64MiB, 4GiB"));
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(bad)
}
