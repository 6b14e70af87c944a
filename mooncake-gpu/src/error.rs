//! The crate's error type.

/// Errors of the GPU cache and of the device heaps.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum GpuError {
    /// No usable GPU: the CUDA driver library (`libcuda.so`) is not present,
    /// or it reports no device. Returned by every CUDA entry point on a
    /// machine without a GPU, instead of panicking.
    #[error("no GPU available: {0}")]
    NoGpu(String),
    /// CUDA is present but a component needed at run time is not (NVRTC,
    /// a too old driver, an unsupported device).
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver error in {op}: {msg}")]
    Cuda {
        /// The operation that failed.
        op: &'static str,
        /// The driver's error text.
        msg: String,
    },
    /// NVRTC failed to compile the kernels.
    #[error("NVRTC compile error: {0}")]
    Nvrtc(String),
    /// The key is not in the cache.
    #[error("not found")]
    NotFound,
    /// The key already exists (objects are immutable: remove, then put).
    #[error("already exists")]
    AlreadyExists,
    /// The object exists but is not published yet (RESERVED or WRITING).
    #[error("not ready")]
    NotReady,
    /// Not enough free space even after evicting every evictable object.
    #[error("no space: need {need} bytes, {free} free of {total}")]
    NoSpace {
        /// Bytes requested (rounded up to whole pages).
        need: u64,
        /// Bytes free at the time of the failure.
        free: u64,
        /// Capacity of the heap's payload arena.
        total: u64,
    },
    /// No free header slot even after evicting every evictable object.
    #[error("no free header slot ({slots} slots)")]
    NoHeaderSlot {
        /// Number of header slots of the heap.
        slots: u32,
    },
    /// The object has readers copying it (`reader_refcnt > 0`); retry later.
    #[error("object in use by {readers} reader(s)")]
    InUse {
        /// Reader count observed.
        readers: u32,
    },
    /// The location or plan is no longer valid: the object was removed,
    /// evicted or reclaimed, or its slot was reused (epoch changed).
    #[error("stale location (object retired or slot reused)")]
    Stale,
    /// The destination buffer is smaller than the object.
    #[error("buffer too small: need {need} bytes, got {got}")]
    BufferTooSmall {
        /// Object size.
        need: u64,
        /// Buffer size.
        got: u64,
    },
    /// An argument is invalid (key length, zero size, page geometry, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The memory cannot do what was asked (export itself as a dma-buf for an RDMA
    /// NIC, on a device or an implementation without it).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An access outside the heap's header slots or payload arena was refused.
    #[error("out of bounds: {0}")]
    OutOfBounds(String),
    /// A header holds an impossible value (corrupt state or geometry).
    #[error("corrupted header: {0}")]
    Corrupted(String),
}

/// `Result` with [`GpuError`].
pub type Result<T, E = GpuError> = std::result::Result<T, E>;
