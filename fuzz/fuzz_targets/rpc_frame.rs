//! The master protocol decoder on arbitrary bytes: header checks and the postcard
//! body decoder must return errors, never panic or allocate without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::wire::{decode_body, decode_request_frame, FrameHeader, Response};

fuzz_target!(|data: &[u8]| {
    let _ = decode_request_frame(data, 1 << 20);
    let _ = FrameHeader::decode(data, u32::MAX);
    let _ = decode_body::<Response>(data);
});
