//! The RDMA handshake decoders (queue pair addresses and region info) never
//! panic, and whatever they accept encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::{RdmaHandshake, RdmaRegionInfo};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = RdmaHandshake::decode(data) {
        assert_eq!(h.encode(), data);
    }
    if let Ok(info) = RdmaRegionInfo::decode(data) {
        assert_eq!(info.encode(), data);
        assert_eq!(info.pieces.iter().map(|p| p.len).sum::<u64>(), info.len);
    }
});
