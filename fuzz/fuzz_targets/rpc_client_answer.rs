//! A master's answer as `RpcMasterClient` reads it (refusals, the frame header, one
//! answer and nothing after it, the body), then turned into the result of each call
//! (errors included): never a panic, an allocation past the frame limit, or an error
//! message without bound; what decodes encodes back to the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::wire::{decode_body, encode_frame, FrameKind, HEADER_LEN};
use mooncake_core::rpc::{answer_result, decode_answer};

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else { return };
    // Where the first read ends: the rest arrives in later reads.
    let first = usize::from(split) * 4;
    match decode_answer(data, first, 7) {
        Ok(response) => {
            let frame = encode_frame(FrameKind::Response, 7, &response).expect("a decoded answer encodes");
            assert_eq!(decode_body::<mooncake_core::rpc::wire::Response>(&frame[HEADER_LEN..]).unwrap(), response);
            // The batch it asked about: as many items as the answer has, or another number.
            let items = Some(usize::from(split % 4));
            let _ = answer_result(response, items);
        }
        // A refusal's message is cut at 1 KiB.
        Err(e) => assert!(e.to_string().len() < 8 << 10, "{} bytes of error", e.to_string().len()),
    }
});
