//! How a client's SSD tier is configured: [`SsdOffloadConfig`], and [`SsdBackend`],
//! the built-in on-disk layouts by name.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use mooncake_storage::{
    BackendFactory, BackendOptions, BucketBackend, BucketConfig, EvictionFactory, EvictionPolicy, FilePerKeyBackend,
    IoKind, OffsetAllocatorBackend, StorageBackend, StorageError,
};

use crate::error::{Error, Result};

/// Which built-in on-disk layout the SSD tier uses; a backend of your own plugs in
/// through [`SsdOffloadConfig::backend`] as any [`BackendFactory`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum SsdBackend {
    /// Objects grouped into buckets of a data file and a meta file
    /// ([`BucketBackend`]).
    #[default]
    Bucket,
    /// One file per object ([`FilePerKeyBackend`]).
    FilePerKey,
    /// Records in one preallocated file of the tier's capacity
    /// ([`OffsetAllocatorBackend`]).
    OffsetAllocator,
}

impl std::str::FromStr for SsdBackend {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().replace('-', "_").as_str() {
            "bucket" => Ok(SsdBackend::Bucket),
            "file_per_key" => Ok(SsdBackend::FilePerKey),
            "offset_allocator" => Ok(SsdBackend::OffsetAllocator),
            _ => {
                Err(Error::InvalidArgument(format!("SSD backend {s:?}: use bucket, file_per_key or offset_allocator")))
            }
        }
    }
}

/// Opens the layout with default layout settings. The offset-allocator layout
/// preallocates its data file at the capacity of `options`, which it requires.
impl BackendFactory for SsdBackend {
    fn open(&self, dir: &Path, options: BackendOptions) -> Result<Arc<dyn StorageBackend>, StorageError> {
        Ok(match self {
            SsdBackend::Bucket => Arc::new(BucketBackend::open(dir, options, BucketConfig::default())?),
            SsdBackend::FilePerKey => Arc::new(FilePerKeyBackend::open(dir, options)?),
            SsdBackend::OffsetAllocator => {
                let file_size = options.capacity.ok_or_else(|| {
                    StorageError::InvalidArgument("the offset-allocator layout needs a capacity".into())
                })?;
                Arc::new(OffsetAllocatorBackend::open(dir, file_size, options)?)
            }
        })
    }
}

/// Settings of a client's SSD tier ([`StoreBuilder::ssd_offload`](crate::StoreBuilder::ssd_offload)).
///
/// The on-disk layout and the eviction strategy are the built-in ones by default,
/// chosen by name ([`SsdBackend`], [`EvictionPolicy`]), or your own: any
/// [`BackendFactory`] and any [`EvictionFactory`] (see [`backend`](Self::backend) and
/// [`eviction`](Self::eviction)).
///
/// ```
/// use mooncake_core::{SsdBackend, SsdOffloadConfig, Store};
/// use mooncake_core::storage::EvictionPolicy;
///
/// let dir = std::env::temp_dir().join(format!("mooncake-doc-ssd-{}", std::process::id()));
/// let store = Store::builder()
///     .global_segment_size(8 << 20)
///     .ssd_offload(SsdOffloadConfig::new(&dir, 256 << 20).backend(SsdBackend::Bucket).eviction(EvictionPolicy::Lru))
///     .build()?;
/// store.put("block", &[1u8; 4096])?;
/// assert_eq!(store.get("block")?.len(), 4096);
/// # drop(store); std::fs::remove_dir_all(&dir).ok();
/// # Ok::<(), mooncake_core::Error>(())
/// ```
#[derive(Clone)]
pub struct SsdOffloadConfig {
    /// Directory of the tier (created if missing). Reopening the same directory finds
    /// the objects written before.
    pub dir: PathBuf,
    /// Bytes the tier may use; older objects are evicted (telling the master) past it.
    pub capacity: u64,
    /// Opens the on-disk layout (default [`SsdBackend::Bucket`]).
    pub backend: Arc<dyn BackendFactory>,
    /// Makes the strategy that picks which objects leave the disk first (default
    /// [`EvictionPolicy::Fifo`]).
    pub eviction: Arc<dyn EvictionFactory>,
    /// I/O engine (default `io_uring`, falling back to POSIX).
    pub io: IoKind,
    /// Use `O_DIRECT` where the filesystem supports it (default true).
    pub direct_io: bool,
    /// Bytes of the staging region remote loads are served from (default 64 MiB).
    pub staging_size: u64,
    /// A staged batch not released by its reader is reclaimed after this (default 5 s).
    pub gc_ttl: Duration,
    /// Pause between offload heartbeats when there is nothing to do (default 20 ms).
    pub heartbeat_interval: Duration,
    /// Most objects offloaded per heartbeat (default 256).
    pub offload_batch: usize,
    /// Address the load server listens on (default: the host of the transfer
    /// endpoint, any port).
    pub listen: Option<String>,
}

impl SsdOffloadConfig {
    /// A tier in `dir` of `capacity` bytes, other settings by default.
    pub fn new(dir: impl AsRef<Path>, capacity: u64) -> Self {
        Self {
            dir: dir.as_ref().to_path_buf(),
            capacity,
            backend: Arc::new(SsdBackend::default()),
            eviction: Arc::new(EvictionPolicy::default()),
            io: IoKind::default(),
            direct_io: true,
            staging_size: 64 << 20,
            gc_ttl: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(20),
            offload_batch: 256,
            listen: None,
        }
    }

    /// Sets [`backend`](Self::backend): a built-in layout ([`SsdBackend`]) or a
    /// backend of your own, as any [`BackendFactory`] — such as a closure
    /// `|dir: &Path, options: BackendOptions| MyBackend::open(dir, options)`.
    ///
    /// When the store is built it makes the [`BackendOptions`] — its
    /// [`EvictionListener`](mooncake_storage::EvictionListener), which tells the master
    /// which objects eviction removed; the [`capacity`](Self::capacity); the I/O engine;
    /// a fresh strategy from [`eviction`](Self::eviction) — and opens the backend in
    /// [`dir`](Self::dir) with them. A backend that evicts must call the listener
    /// before it deletes anything (see [`StorageBackend`]).
    ///
    /// ```
    /// use std::path::Path;
    /// use mooncake_core::storage::{BackendOptions, BucketBackend, BucketConfig};
    /// use mooncake_core::{SsdOffloadConfig, Store};
    ///
    /// // The bucket layout with buckets of at most 64 objects.
    /// let small_buckets = |dir: &Path, options: BackendOptions| {
    ///     BucketBackend::open(dir, options, BucketConfig { bucket_keys_limit: 64, ..BucketConfig::default() })
    /// };
    /// let dir = std::env::temp_dir().join(format!("mooncake-doc-ssd-backend-{}", std::process::id()));
    /// let store = Store::builder()
    ///     .global_segment_size(8 << 20)
    ///     .ssd_offload(SsdOffloadConfig::new(&dir, 64 << 20).backend(small_buckets))
    ///     .build()?;
    /// assert_eq!(store.ssd_stats().unwrap().backend.backend, "bucket");
    /// # drop(store); std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), mooncake_core::Error>(())
    /// ```
    pub fn backend(mut self, backend: impl BackendFactory + 'static) -> Self {
        self.backend = Arc::new(backend);
        self
    }

    /// Sets [`eviction`](Self::eviction): a built-in policy ([`EvictionPolicy`]) or a
    /// strategy of your own, as any [`EvictionFactory`] — such as `MyStrategy::default`
    /// or a closure `|| MyStrategy::new(..)`. Each backend opened gets a fresh strategy.
    ///
    /// ```
    /// use mooncake_core::storage::{DiskEvictionStrategy, UnitId, UnitInfo};
    /// use mooncake_core::SsdOffloadConfig;
    ///
    /// /// Last in, first out.
    /// #[derive(Default)]
    /// struct Lifo(Vec<UnitId>);
    ///
    /// impl DiskEvictionStrategy for Lifo {
    ///     fn add(&mut self, unit: UnitId, _info: UnitInfo<'_>) {
    ///         if !self.0.contains(&unit) {
    ///             self.0.push(unit);
    ///         }
    ///     }
    ///     fn remove(&mut self, unit: UnitId) {
    ///         self.0.retain(|&u| u != unit);
    ///     }
    ///     fn record_access(&mut self, _unit: UnitId) {}
    ///     fn select_victim(&mut self) -> Option<UnitId> {
    ///         self.0.pop()
    ///     }
    ///     fn len(&self) -> usize {
    ///         self.0.len()
    ///     }
    ///     fn name(&self) -> &'static str {
    ///         "lifo"
    ///     }
    /// }
    ///
    /// let config = SsdOffloadConfig::new("/var/tmp/mooncake-ssd", 1 << 30).eviction(Lifo::default);
    /// assert_eq!(config.eviction.build().name(), "lifo");
    /// ```
    pub fn eviction(mut self, eviction: impl EvictionFactory + 'static) -> Self {
        self.eviction = Arc::new(eviction);
        self
    }

    /// Sets [`io`](Self::io) and [`direct_io`](Self::direct_io).
    pub fn io(mut self, kind: IoKind, direct: bool) -> Self {
        self.io = kind;
        self.direct_io = direct;
        self
    }

    /// Sets [`staging_size`](Self::staging_size).
    pub fn staging_size(mut self, bytes: u64) -> Self {
        self.staging_size = bytes;
        self
    }

    /// Sets [`listen`](Self::listen).
    pub fn listen(mut self, addr: &str) -> Self {
        self.listen = Some(addr.to_owned());
        self
    }

    pub(super) fn check(&self) -> Result<()> {
        if self.capacity == 0 {
            return Err(Error::InvalidArgument("SSD capacity must be positive".into()));
        }
        if self.offload_batch == 0 || self.heartbeat_interval.is_zero() {
            return Err(Error::InvalidArgument("offload_batch and heartbeat_interval must be positive".into()));
        }
        Ok(())
    }
}

/// Shows every setting but the backend and eviction factories (which may be closures).
impl fmt::Debug for SsdOffloadConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SsdOffloadConfig")
            .field("dir", &self.dir)
            .field("capacity", &self.capacity)
            .field("io", &self.io)
            .field("direct_io", &self.direct_io)
            .field("staging_size", &self.staging_size)
            .field("gc_ttl", &self.gc_ttl)
            .field("heartbeat_interval", &self.heartbeat_interval)
            .field("offload_batch", &self.offload_batch)
            .field("listen", &self.listen)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_parse() {
        assert_eq!("bucket".parse::<SsdBackend>().unwrap(), SsdBackend::Bucket);
        assert_eq!("file-per-key".parse::<SsdBackend>().unwrap(), SsdBackend::FilePerKey);
        assert_eq!("offset_allocator".parse::<SsdBackend>().unwrap(), SsdBackend::OffsetAllocator);
        assert!(matches!("tape".parse::<SsdBackend>(), Err(Error::InvalidArgument(_))));
    }
}
