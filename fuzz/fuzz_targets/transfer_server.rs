//! The transfer server's request dispatch on a real listener over loopback: any
//! bytes a peer sends (headers, write payloads, handshake bodies, pipelined requests)
//! get well-formed answers for registered regions (a writable and a read-only one)
//! or a closed connection. Never a panic or a hang, and never an answer longer than
//! a region or a handshake.
#![no_main]

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::{
    FrameStatus, RegisteredRegion, ResponseHeader, TransferEngine, MAX_HANDSHAKE_BYTES, REFUSE_MAGIC,
    RESPONSE_HEADER_LEN,
};

#[path = "common/loopback.rs"]
mod loopback;

/// Bytes of each registered region.
const REGION: u64 = 4096;

/// The listener and its regions (kept registered).
static ENGINE: LazyLock<(TransferEngine, [Arc<RegisteredRegion>; 2])> = LazyLock::new(|| {
    let engine = TransferEngine::builder().tcp_listen("127.0.0.1:0").build().expect("a listener on loopback");
    let writable = engine.register_region(REGION).unwrap();
    let read_only = engine.register_read_only_region(REGION).unwrap();
    (engine, [writable, read_only])
});

fuzz_target!(|data: &[u8]| {
    let (engine, _) = &*ENGINE;
    let c = loopback::connect(engine.endpoint(), Duration::from_secs(20));
    loopback::send_in_pieces(&c, data, usize::MAX);
    let (answer, whole) = loopback::finish(c);
    if !whole {
        return;
    }
    if answer.starts_with(&REFUSE_MAGIC) {
        return;
    }
    // Whole answers, one after the other.
    let max = REGION.max(MAX_HANDSHAKE_BYTES);
    let mut rest = &answer[..];
    while !rest.is_empty() {
        let h = ResponseHeader::decode(rest, max).expect("a well-formed answer header");
        assert!(h.len <= max);
        let end = RESPONSE_HEADER_LEN + h.len as usize;
        if h.status != FrameStatus::Ok {
            assert_eq!(h.len, 0, "a refusal carries no payload");
        }
        assert!(rest.len() >= end, "an answer cut short");
        rest = &rest[end..];
    }
    let _ = engine.endpoint().len();
});
