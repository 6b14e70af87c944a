//! A master's answer as `RpcMasterClient` reads it (refusals, the frame header, one
//! answer and nothing after it, the body), then turned into the result of each call
//! (errors included): never a panic, an allocation past the frame limit, or an error
//! message without bound; what decodes encodes back to the same answer.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::wire::{decode_body, encode_frame, FrameHeader, FrameKind, Response, HEADER_LEN};
use mooncake_core::rpc::{answer_result, decode_answer};

fuzz_target!(|data: &[u8]| {
    let Some((&split, data)) = data.split_first() else { return };
    // Where the first read ends: the rest arrives in later reads.
    let first = usize::from(split >> 1) * 8;
    // Half the inputs are bodies behind the header a master would send, so that
    // the body decoder and the results get most of the time.
    let framed;
    let data = if split & 1 == 1 {
        let header = FrameHeader { kind: FrameKind::Response, request_id: 7, body_len: data.len() as u32 };
        framed = [&header.encode()[..], data].concat();
        &framed[..]
    } else {
        data
    };
    match decode_answer(data, first, 7) {
        Ok(response) => {
            let frame = encode_frame(FrameKind::Response, 7, &response).expect("a decoded answer encodes");
            // Compared encoded: a float field may be NaN, which equals nothing.
            let again = decode_body::<Response>(&frame[HEADER_LEN..]).expect("an encoded answer decodes");
            assert_eq!(encode_frame(FrameKind::Response, 7, &again).unwrap(), frame);
            // The batch it asked about: as many items as the answer has, or another number.
            let items = Some(usize::from(split % 4));
            let _ = answer_result(response, items);
        }
        // A refusal's message is cut at 1 KiB.
        Err(e) => assert!(e.to_string().len() < 8 << 10, "{} bytes of error", e.to_string().len()),
    }
});
