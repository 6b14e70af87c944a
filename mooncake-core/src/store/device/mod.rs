//! GPU memory as a `get_into` destination and a `put` source of the store.
//!
//! Device memory is anything implementing
//! [`DeviceMemory`](mooncake_gpu::DeviceMemory): a CUDA
//! [`DeviceBuffer`](mooncake_gpu::DeviceBuffer), or
//! [`HostDeviceMemory`](mooncake_gpu::HostDeviceMemory) (host emulation, same API)
//! on machines without a GPU. It is one more source of the write engine and one
//! more destination of the read engine; per replica, its bytes take one of
//! these ways:
//!
//! * **Direct** (`direct.rs`): the replica's transport moves device memory
//!   ([`Capabilities::moves_device_memory`](mooncake_transfer::Capabilities): RDMA)
//!   and its NICs registered the memory (a dma-buf the driver exported, once per
//!   allocation). The replica is READ straight into device memory, or WRITTEN
//!   straight from it; the checksum is taken of the device bytes
//!   ([`DeviceMemory::crc32c`](mooncake_gpu::DeviceMemory::crc32c)).
//! * **By DMA** (`pinned.rs`): the replica's transport maps its memory into this
//!   process (this client's own segment, a same-host peer's): the mapped segment
//!   is page-locked with CUDA piece by piece (each piece once, when a replica in it
//!   first moves), and the replica moves to or from device memory straight from or
//!   into it, one DMA per piece it lies in. The checksum is taken of the device
//!   bytes.
//! * **Streamed** (`stream.rs`): a replica the transport reaches through host
//!   memory (a TCP peer's, a segment that cannot be page-locked) moves through
//!   pinned chunks: a get DMAs each range as the transport tells it landed (one
//!   chunk up to 64 MiB), a put's two chunks take turns (the DMA of one runs
//!   while the transport writes the other). The checksum is taken of the device
//!   bytes.
//! * **Staged** (`staging.rs`): disk replicas are read into a pinned host buffer,
//!   then copied to the device.
//!
//! [`StoreStats::device_direct_bytes`](crate::StoreStats::device_direct_bytes) and
//! [`device_staged_bytes`](crate::StoreStats::device_staged_bytes) say which way
//! the bytes went. The calls themselves are in `api.rs`.

mod api;
mod direct;
mod pinned;
mod staging;
mod stream;

pub(super) use direct::{move_device, DeviceMove, Directs};
pub(super) use pinned::{PinnedParts, PinnedRegion, PinnedRegions, DEFAULT_PIECE};
pub(super) use staging::{room_after, staging, Copies, Keep};
pub(super) use stream::{stream_reads, stream_writes, StreamRead, StreamWrite};
