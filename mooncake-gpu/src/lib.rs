//! GPU-resident KV cache for Mooncake Store ("Nano Mooncake": objects live in
//! the memory of an owner GPU, and producers write them there directly).
//!
//! Each owner GPU holds a *device heap*: an array of 128-byte [`DeviceObjectHeader`]s
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
//! * The [`DeviceHeap`] trait (header atomics, page copies, and the
//!   publish / read / retire protocol) and [`HostHeap`], host memory that
//!   emulates a device heap exactly — everything above it is tested on
//!   machines without a GPU. The header layout is [`DeviceObjectHeader`]
//!   (atomics) / [`HeaderSnapshot`] (a plain copy), at [`header_offsets`].
//! * [`NanoKvCache`] over any `DeviceHeap`.
//! * [`CudaDeviceHeap`]: device memory through the CUDA driver API loaded at
//!   run time, kernels compiled with NVRTC at run time, CUDA IPC
//!   export/import ([`IpcHeapHandle`]). On a machine without CUDA every entry
//!   point returns [`GpuError::NoGpu`] instead of panicking.
//! * [`route`]: which owner rank an object goes to; [`KeyId`]: how a header
//!   names its key.
//! * Device memory as a copy target — the [`DeviceMemory`] trait
//!   (asynchronous host <-> device copies on [`DeviceStream`]s, pinned host
//!   staging), [`HostDeviceMemory`] (its host emulation) and [`DeviceBuffer`]
//!   (CUDA; [`allocate_or_emulate`] picks one), the double-buffered chunked
//!   [`Stager`] and the [`PinnedPool`] of reusable staging buffers.
//! * Addresses handed over by callers: [`PointerClassifier`] tells device
//!   memory from host memory ([`CudaPointers`], the driver's answer;
//!   [`EmulatedPointers`], declared host ranges) and lends device ranges as
//!   `DeviceMemory`; [`DeviceScatter`] sees several ranges as one memory;
//!   [`HostPinning`] page-locks host memory allocated elsewhere.
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

//!
//! # Features
//!
//! * `cuda` (default): the CUDA implementation, through `cudarc` (no CUDA
//!   toolkit is needed to build; the driver is loaded at run time). Without
//!   it the crate builds no CUDA code: [`CudaDeviceHeap`], [`DeviceBuffer`]
//!   and the other CUDA entry points still exist, with the same signatures,
//!   and report [`GpuError::NoGpu`]; everything else works unchanged over host
//!   emulation.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod alloc;
mod cache;
mod cuda;
mod device;
mod error;
mod header;
mod heap;
mod key;
mod pointer;
mod transport;

pub use cache::{
    CacheConfig, CacheStats, NanoKvCache, ObjMeta, Watchdog, WritePlan, DEFAULT_PAGE_SIZE, MAX_KEY_LEN, PAYLOAD_ALIGN,
};
pub use cuda::{
    allocate_or_emulate, crc32c_of_device_ranges, cuda_available, cuda_device_count, nvrtc_available, CudaDeviceHeap,
    DeviceBuffer, IpcHeapHandle,
};
pub use device::{
    DeviceMemory, DeviceRange, DeviceScatter, DeviceStream, Fence, HostDeviceMemory, MemoryLocation, PinnedBuffer,
    PinnedPool, PooledBuffer, Stager, DEFAULT_CHUNK, DEFAULT_LANES,
};
pub use error::{GpuError, Result};
pub use header::{
    header_offsets, DeviceObjectHeader, HeaderSnapshot, HeaderU32Field, HeaderU64Field, ObjectState, HEADER_SIZE,
    HEADER_VERSION, KEY_FP_SEED,
};
pub use heap::{DeviceHeap, HostHeap, PageSpan, ReadExpect, RetireOutcome, HOST_WORD};
pub use key::{route, KeyId};
pub use pointer::{
    CudaPointers, DeviceAllocation, EmulatedPin, EmulatedPointers, HostPinning, KeepCurrentContext, PinnedRanges,
    PointerClassifier,
};
pub use transport::{gpu_to_transfer, GpuTransport, GPU_SCHEME};
