//! GPU-resident KV cache for Mooncake Store, after the "Nano Mooncake" design.
//!
//! Each owner GPU holds a *device heap*: an array of 128-byte [`ObjectHeader`]s
//! and a payload arena cut in pages (128–512 KiB, default 256 KiB). The owner's
//! control plane, [`NanoKvCache`], allocates space (bump pointer + free list),
//! indexes objects and hands producers a [`WritePlan`] (device pointers of the
//! header and of every page) so that a producer kernel pushes pages straight
//! into the owner's memory and then publishes the object by flipping `state`
//! to `READY` with release semantics. Readers acquire `READY`, pin the object
//! with `reader_refcnt` while they copy (the last page clamped to
//! `last_page_bytes`), and re-check the slot `epoch` so that a stale location
//! can never return bytes of another object. Eviction is FIFO between a high
//! and a low watermark and skips objects that are pinned or not `READY`; a
//! watchdog reclaims puts stuck in `RESERVED`/`WRITING`.
//!
//! * [`heap`]: the [`DeviceHeap`] trait (header atomics, page copies, and the
//!   publish / read / retire protocol) and [`HostHeap`], host memory that
//!   emulates a device heap exactly — everything above it is tested on
//!   machines without a GPU.
//! * [`cache`]: [`NanoKvCache`] over any `DeviceHeap`.
//! * [`cuda`]: [`cuda::CudaDeviceHeap`], device memory through the CUDA driver
//!   API loaded at run time, kernels compiled with NVRTC at run time, CUDA IPC
//!   export/import. On a machine without CUDA every entry point returns
//!   [`GpuError::NoGpu`] instead of panicking.
//! * [`route`]: which owner rank an object goes to.
//! * [`device`]: device memory as a copy target — the [`DeviceMemory`] trait
//!   (asynchronous host <-> device copies on streams, pinned host staging),
//!   [`HostDeviceMemory`] (its host emulation) and
//!   [`cuda::DeviceBuffer`] (CUDA), the double-buffered chunked [`Stager`]
//!   and the [`PinnedPool`] of reusable staging buffers.
//! * [`GpuTransport`]: a `mooncake_transfer::Transport` whose regions are
//!   device memory, so the transfer engine (and a store built with it) moves
//!   bytes between host memory and GPU buffers of this process.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use mooncake_gpu::{CacheConfig, GpuError, HostHeap, NanoKvCache};
//!
//! # fn main() -> Result<(), GpuError> {
//! // 64 header slots, 4 MiB of payload, 64 KiB pages.
//! let heap = Arc::new(HostHeap::new(64, 4 << 20)?);
//! let cfg = CacheConfig { page_size: 64 << 10, ..Default::default() };
//! let cache = NanoKvCache::new(heap, cfg)?;
//!
//! // Object API.
//! let value: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
//! cache.put("layer0/prefix-42", &value)?;
//! assert_eq!(cache.get("layer0/prefix-42")?, value);
//!
//! // Plan API: a producer writes pages, then publishes.
//! let plan = cache.open_for_write("layer1/prefix-42", 100_000)?;
//! assert_eq!(plan.n_pages, 2);
//! assert_eq!(plan.page_len(1), 100_000 - 65_536); // tail page clamp
//! assert!(matches!(cache.get_location("layer1/prefix-42"), Err(GpuError::NotReady)));
//! cache.write(&plan, 0, &vec![7u8; 100_000])?;
//! cache.commit(&plan)?;
//! let meta = cache.get_location("layer1/prefix-42")?;
//! assert_eq!((meta.bytes_total, meta.epoch), (100_000, plan.epoch));
//!
//! cache.remove("layer0/prefix-42")?;
//! assert!(matches!(cache.get("layer0/prefix-42"), Err(GpuError::NotFound)));
//!
//! // Which owner an object goes to.
//! let owner = mooncake_gpu::route("layer0/prefix-42", None, 8);
//! assert!(owner < 8);
//! assert_eq!(mooncake_gpu::route("x", Some(3), 8), 3);
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod alloc;
pub mod cache;
pub mod cuda;
pub mod device;
mod error;
pub mod header;
pub mod heap;
mod transport;

pub use cache::{CacheConfig, CacheStats, NanoKvCache, ObjMeta, Watchdog, WritePlan};
pub use device::{DeviceMemory, DeviceStream, HostDeviceMemory, MemoryLocation, PinnedBuffer, PinnedPool, Stager};
pub use error::{GpuError, Result};
pub use header::{HeaderSnapshot, ObjectHeader, ObjectState};
pub use heap::{DeviceHeap, HostHeap, PageSpan, ReadExpect, RetireOutcome};
pub use transport::{gpu_to_transfer, GpuTransport, GPU_SCHEME};

use xxhash_rust::xxh64::xxh64;

/// Identity of a key as stored in a header: `xxh64(key, 0)`, a second
/// fingerprint `xxh64(key, FP_SEED)`, and the length. A reader accepts an
/// object only if all three match.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyId {
    /// `xxh64(key, 0)` (`key_hash`).
    pub hash: u64,
    /// `xxh64(key, FP_SEED)` (`key_fp_hi`).
    pub fp_hi: u64,
    /// Key length in bytes (`key_len`).
    pub len: u32,
}

impl KeyId {
    /// The identity of `key`.
    pub fn of(key: &str) -> Self {
        Self { hash: xxh64(key.as_bytes(), 0), fp_hi: xxh64(key.as_bytes(), header::FP_SEED), len: key.len() as u32 }
    }
}

/// Owner rank of `key` among `world_size` owners: `preferred_segment` when
/// given (returned unchanged: it is the caller's rank), else
/// `xxh64(key) % world_size`.
///
/// # Panics
///
/// If `world_size` is 0 and no preferred segment is given.
pub fn route(key: &str, preferred_segment: Option<usize>, world_size: usize) -> usize {
    match preferred_segment {
        Some(p) => p,
        None => {
            assert!(world_size > 0, "world_size must be > 0");
            (xxh64(key.as_bytes(), 0) % world_size as u64) as usize
        }
    }
}
