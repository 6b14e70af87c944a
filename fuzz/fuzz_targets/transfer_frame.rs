//! The transfer protocol's header decoders on arbitrary bytes: never panic, and what
//! decodes re-encodes to the same bytes within the protocol's limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::{decode_frame_header, ResponseHeader, MAX_REQUEST_BYTES, REQUEST_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = decode_frame_header(data) {
        assert_eq!(&h.encode()[..], &data[..REQUEST_HEADER_LEN]);
        assert!(h.len <= MAX_REQUEST_BYTES);
    }
    if let Ok(h) = ResponseHeader::decode(data, 1 << 20) {
        assert!(h.len <= 1 << 20);
    }
});
