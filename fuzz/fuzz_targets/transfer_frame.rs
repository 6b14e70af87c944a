//! The transfer protocol's header decoders (and the refusal decoder both protocols
//! share) on arbitrary bytes: never panic, and what decodes re-encodes to the same
//! bytes within the protocol's limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::{
    decode_frame_header, decode_refusal, encode_refusal, ResponseHeader, MAX_REQUEST_BYTES, REQUEST_HEADER_LEN,
};

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = decode_frame_header(data) {
        assert_eq!(&h.encode()[..], &data[..REQUEST_HEADER_LEN]);
        assert!(h.len <= MAX_REQUEST_BYTES);
    }
    if let Ok(h) = ResponseHeader::decode(data, 1 << 20) {
        assert!(h.len <= 1 << 20);
    }
    let (head, tail) = data.split_at(data.len().min(3));
    let message = decode_refusal(head, tail);
    assert!(message.len() <= 3 * 1024, "a refusal message is cut at 1 KiB");
    if let Ok(text) = std::str::from_utf8(data) {
        if text.len() <= 1024 {
            assert_eq!(decode_refusal(&encode_refusal(text)[4..], &[][..]), text);
        }
    }
});
