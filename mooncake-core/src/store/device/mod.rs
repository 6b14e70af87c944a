//! GPU memory as a `get_into` target and a `put` source of the store.
//!
//! Device memory is anything implementing
//! [`DeviceMemory`](mooncake_gpu::DeviceMemory): a CUDA
//! [`DeviceBuffer`](mooncake_gpu::DeviceBuffer), or
//! [`HostDeviceMemory`](mooncake_gpu::HostDeviceMemory) (host emulation, same API)
//! on machines without a GPU. Its bytes take one of two ways, chosen per call:
//!
//! * **Direct** (`direct.rs`): the store's transport is RDMA and its NICs can
//!   register the memory (the driver exports it as a dma-buf, every NIC registers
//!   that, once, cached per allocation). A get READs the replica straight into
//!   device memory, a put WRITEs its replicas straight from it: no host buffer,
//!   no host copy. The checksum is taken of the device bytes
//!   ([`DeviceMemory::crc32c`](mooncake_gpu::DeviceMemory::crc32c)).
//! * **Staged** (`staging.rs`): everything else (TCP or shared memory, memory the
//!   NICs refuse, replicas reached another way, disk replicas): the bytes go
//!   through pinned host buffers, copied to or from the device asynchronously.
//!
//! [`StoreStats::device_direct_bytes`](crate::StoreStats::device_direct_bytes) and
//! [`device_staged_bytes`](crate::StoreStats::device_staged_bytes) say which way
//! the bytes went. The calls themselves are in `api.rs`.

mod api;
mod direct;
mod staging;
