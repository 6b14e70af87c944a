//! The CUDA IPC description of an owner heap, as bytes any channel can carry.

use crate::error::{GpuError, Result};

/// A CUDA IPC description of an owner heap, to open it from another process
/// on the same host ([`CudaDeviceHeap::open_ipc`](crate::CudaDeviceHeap::open_ipc)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcHeapHandle {
    /// `cuIpcGetMemHandle` of the header array.
    pub headers: [u8; 64],
    /// `cuIpcGetMemHandle` of the payload arena.
    pub payload: [u8; 64],
    /// Number of header slots.
    pub header_slots: u32,
    /// Payload arena size in bytes.
    pub payload_bytes: u64,
}

impl IpcHeapHandle {
    const MAGIC: [u8; 4] = *b"NKIP";
    const VERSION: u32 = 1;
    /// Length of [`to_bytes`](Self::to_bytes).
    pub const ENCODED_LEN: usize = 4 + 4 + 4 + 8 + 64 + 64;

    /// Fixed-size little-endian encoding, to send over any channel.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::ENCODED_LEN);
        v.extend_from_slice(&Self::MAGIC);
        v.extend_from_slice(&Self::VERSION.to_le_bytes());
        v.extend_from_slice(&self.header_slots.to_le_bytes());
        v.extend_from_slice(&self.payload_bytes.to_le_bytes());
        v.extend_from_slice(&self.headers);
        v.extend_from_slice(&self.payload);
        v
    }

    /// Parses [`to_bytes`](Self::to_bytes); `InvalidArgument` on anything else.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let bad = |m: &str| GpuError::InvalidArgument(format!("IPC heap handle: {m}"));
        if b.len() != Self::ENCODED_LEN {
            return Err(bad("wrong length"));
        }
        if b[0..4] != Self::MAGIC {
            return Err(bad("bad magic"));
        }
        if u32::from_le_bytes(b[4..8].try_into().expect("4")) != Self::VERSION {
            return Err(bad("unsupported version"));
        }
        let header_slots = u32::from_le_bytes(b[8..12].try_into().expect("4"));
        let payload_bytes = u64::from_le_bytes(b[12..20].try_into().expect("8"));
        if header_slots == 0 || payload_bytes == 0 {
            return Err(bad("empty heap"));
        }
        let mut headers = [0u8; 64];
        headers.copy_from_slice(&b[20..84]);
        let mut payload = [0u8; 64];
        payload.copy_from_slice(&b[84..148]);
        Ok(Self { headers, payload, header_slots, payload_bytes })
    }
}
