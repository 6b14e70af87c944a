//! [`GpuTransport`]: device memory of this process as regions of the
//! transfer engine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};

use mooncake_transfer::{
    RegionId, RemoteRegion, TransferError, TransferOp, TransferRequest, Transport, TransportStats,
};
use parking_lot::{Mutex, RwLock};

use crate::device::{DeviceMemory, MemoryLocation, Stager, DEFAULT_CHUNK, DEFAULT_LANES};
use crate::error::{GpuError, Result};

/// Prefix of the endpoints of GPU regions: `gpu:<ordinal>@<host>/<pid>.<n>`
/// for CUDA memory, `gpu:emulated@<host>/<pid>.<n>` for host emulation.
pub const GPU_SCHEME: &str = "gpu:";

static NEXT_TRANSPORT: AtomicU64 = AtomicU64::new(1);

static HOSTNAME: LazyLock<String> = LazyLock::new(|| {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
});

/// The regions of one endpoint, by id.
type Regions = HashMap<RegionId, Arc<dyn DeviceMemory>>;

/// Idle stagers a transport keeps (pinned memory reused across transfers).
const MAX_IDLE_STAGERS: usize = 4;

/// A [`Transport`] whose regions are device memory of this process: register
/// a [`DeviceMemory`] and the [`TransferEngine`](mooncake_transfer::TransferEngine)
/// (or a store whose builder was given this transport) reads and writes it
/// like any remote region, by [`RemoteRegion`].
///
/// Bytes move between the request's host buffer and device memory through
/// pinned staging buffers in chunks, double-buffered (see [`Stager`]): the
/// CPU copies chunk *i + 1* into one staging buffer while the DMA of chunk *i*
/// runs from the other. Every request is bounds-checked against the
/// registered memory first: an out-of-bounds request fails with
/// [`TransferError::OutOfBounds`] and touches nothing.
///
/// Regions are reachable from this process only (the endpoint names this
/// transport instance): a peer elsewhere gets `Unreachable`.
///
/// ```
/// use std::sync::Arc;
/// use mooncake_gpu::{GpuTransport, HostDeviceMemory};
/// use mooncake_transfer::TransferEngine;
///
/// let gpu = Arc::new(GpuTransport::new());
/// let mem = Arc::new(HostDeviceMemory::new(1 << 20)?); // or DeviceBuffer::new(0, 1 << 20)?
/// let region = gpu.register(mem.clone())?;
/// assert!(region.endpoint.starts_with("gpu:"));
///
/// // `transport` replaces the default transports; `transport_first` keeps them.
/// let engine = TransferEngine::builder().transport(gpu.clone()).build()?;
/// engine.write(&region, 4096, b"kv page")?;
/// let mut back = [0u8; 7];
/// engine.read(&region, 4096, &mut back)?;
/// assert_eq!(&back, b"kv page");
/// assert!(engine.read(&region, (1 << 20) - 3, &mut back).is_err()); // out of bounds
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GpuTransport {
    /// `<host>/<pid>.<n>`: what makes this instance's endpoints unique.
    suffix: String,
    /// endpoint -> region id -> memory.
    regions: RwLock<HashMap<String, Regions>>,
    next_region: AtomicU64,
    chunk: usize,
    lanes: usize,
    stagers: Mutex<Vec<Stager>>,
    stats: TransportStats,
}

impl std::fmt::Debug for GpuTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuTransport")
            .field("endpoints", &self.regions.read().keys().cloned().collect::<Vec<_>>())
            .field("chunk", &self.chunk)
            .field("lanes", &self.lanes)
            .finish()
    }
}

impl Default for GpuTransport {
    fn default() -> Self {
        Self::new()
    }
}

impl GpuTransport {
    /// A transport staging through [`DEFAULT_LANES`] pinned buffers of
    /// [`DEFAULT_CHUNK`] bytes.
    pub fn new() -> Self {
        Self::with_staging(DEFAULT_CHUNK, DEFAULT_LANES).expect("the defaults are valid")
    }

    /// A transport staging through `lanes` pinned buffers of `chunk` bytes
    /// (`chunk >= 1`, `lanes >= 1`).
    pub fn with_staging(chunk: usize, lanes: usize) -> Result<Self> {
        if chunk == 0 || lanes == 0 {
            return Err(GpuError::InvalidArgument(format!(
                "staging needs chunk >= 1 and lanes >= 1 ({chunk}, {lanes})"
            )));
        }
        let n = NEXT_TRANSPORT.fetch_add(1, Ordering::Relaxed);
        Ok(Self {
            suffix: format!("{}/{}.{n}", *HOSTNAME, std::process::id()),
            regions: RwLock::new(HashMap::new()),
            // Random base, as the engine does: a stale id never names a newer region.
            next_region: AtomicU64::new((u64::from(rand_u32()) << 24) | 1),
            chunk,
            lanes,
            stagers: Mutex::new(Vec::new()),
            stats: TransportStats::default(),
        })
    }

    /// Bytes per staging chunk.
    pub fn chunk_size(&self) -> usize {
        self.chunk
    }

    /// The endpoint this transport serves memory of `location` at.
    pub fn endpoint(&self, location: MemoryLocation) -> String {
        match location {
            MemoryLocation::Emulated => format!("{GPU_SCHEME}emulated@{}", self.suffix),
            MemoryLocation::Cuda { ordinal } => format!("{GPU_SCHEME}{ordinal}@{}", self.suffix),
        }
    }

    /// Makes `mem` reachable as a region; returns how the engine names it.
    /// `InvalidArgument` for empty memory.
    pub fn register(&self, mem: Arc<dyn DeviceMemory>) -> Result<RemoteRegion> {
        if mem.is_empty() {
            return Err(GpuError::InvalidArgument("cannot register a region of zero bytes".into()));
        }
        let endpoint = self.endpoint(mem.location());
        let id = self.next_region.fetch_add(1, Ordering::Relaxed);
        self.regions.write().entry(endpoint.clone()).or_default().insert(id, mem);
        Ok(RemoteRegion { endpoint, region: id })
    }

    /// Stops serving `region`; returns whether it was registered. Requests
    /// running finish; later ones fail with `UnknownRegion`.
    pub fn unregister(&self, region: &RemoteRegion) -> bool {
        let mut regions = self.regions.write();
        let Some(by_id) = regions.get_mut(&region.endpoint) else { return false };
        // The endpoint stays known (requests to it get `UnknownRegion`, not
        // `Unreachable`, as with the engine's own regions).
        by_id.remove(&region.region).is_some()
    }

    /// The memory behind `region`, if this transport serves it.
    pub fn region(&self, region: &RemoteRegion) -> Option<Arc<dyn DeviceMemory>> {
        self.regions.read().get(&region.endpoint)?.get(&region.region).cloned()
    }

    fn lookup(&self, target: &RemoteRegion) -> mooncake_transfer::Result<Arc<dyn DeviceMemory>> {
        let regions = self.regions.read();
        let by_id =
            regions.get(&target.endpoint).ok_or_else(|| TransferError::UnknownEndpoint(target.endpoint.clone()))?;
        by_id
            .get(&target.region)
            .cloned()
            .ok_or_else(|| TransferError::UnknownRegion { endpoint: target.endpoint.clone(), region: target.region })
    }

    /// A stager suited to `mem` (page-locked lanes for a real device).
    fn take_stager(&self, mem: &dyn DeviceMemory) -> Result<Stager> {
        let want_locked = !mem.location().is_emulated();
        {
            let mut idle = self.stagers.lock();
            if let Some(i) = idle.iter().position(|s| s.is_page_locked() || !want_locked) {
                return Ok(idle.swap_remove(i));
            }
        }
        Stager::new(mem, self.chunk, self.lanes)
    }

    fn give_back(&self, stager: Stager) {
        let mut idle = self.stagers.lock();
        if idle.len() < MAX_IDLE_STAGERS {
            idle.push(stager);
        }
    }

    fn one(&self, req: &mut TransferRequest<'_>) -> mooncake_transfer::Result<()> {
        let mem = self.lookup(req.target)?;
        let len = req.op.len() as u64;
        if req.offset.checked_add(len).is_none_or(|end| end > mem.len()) {
            return Err(TransferError::OutOfBounds {
                region: req.target.region,
                offset: req.offset,
                len,
                region_len: mem.len(),
            });
        }
        if len == 0 {
            return Ok(());
        }
        let mut stager = self.take_stager(&*mem).map_err(gpu_to_transfer)?;
        let res = match &mut req.op {
            TransferOp::Read(dst) => stager.download(&*mem, dst, req.offset),
            TransferOp::Write(src) => stager.upload(&*mem, src, req.offset),
        };
        self.give_back(stager);
        res.map_err(gpu_to_transfer)?;
        let counter = match req.op {
            TransferOp::Read(_) => &self.stats.bytes_read,
            TransferOp::Write(_) => &self.stats.bytes_written,
        };
        counter.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }
}

/// A device error as a transfer error (`OutOfBounds` has no region numbers
/// here: the transport checks bounds itself before copying, with them).
pub fn gpu_to_transfer(e: GpuError) -> TransferError {
    TransferError::Io(format!("device memory: {e}"))
}

fn rand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish() as u32
}

impl Transport for GpuTransport {
    fn name(&self) -> &str {
        "gpu"
    }

    fn can_reach(&self, endpoint: &str) -> bool {
        endpoint.starts_with(GPU_SCHEME) && self.regions.read().contains_key(endpoint)
    }

    fn transfer(&self, requests: &mut [TransferRequest<'_>]) -> Vec<mooncake_transfer::Result<()>> {
        requests
            .iter_mut()
            .map(|req| {
                let r = self.one(req);
                if r.is_err() {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                }
                r
            })
            .collect()
    }

    fn stats(&self) -> Option<&TransportStats> {
        Some(&self.stats)
    }
}
