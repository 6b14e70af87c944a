//! The transfer protocol's header decoders on arbitrary bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::frame::{RequestHeader, ResponseHeader};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = RequestHeader::decode(data) {
        // What decodes re-encodes to the same bytes.
        assert_eq!(&h.encode()[..], &data[..mooncake_transfer::frame::REQUEST_LEN]);
    }
    let _ = ResponseHeader::decode(data, u64::MAX);
});
