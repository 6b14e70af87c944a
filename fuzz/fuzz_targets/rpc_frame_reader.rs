//! The master server's incremental frame reader on arbitrary bytes, split into
//! arbitrary chunks under an arbitrary memory allowance: it must never panic, never
//! hold more body than announced, and yield exactly the frames (and the first
//! error) a whole-buffer decoder finds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_core::rpc::wire::{decode_body, FrameHeader, Request, HEADER_LEN};
use mooncake_core::rpc::FrameReader;

const MAX_BODY: u32 = 1 << 16;

fuzz_target!(|data: &[u8]| {
    let [step, allowance, stream @ ..] = data else { return };
    let step = usize::from(*step % 64) + 1;
    let allowance = usize::from(*allowance) + 1;

    let mut reader = FrameReader::new(MAX_BODY);
    let mut frames = Vec::new();
    let mut failed = false;
    let mut at = 0;
    'feed: while at < stream.len() {
        let mut chunk = &stream[at..(at + step).min(stream.len())];
        while !chunk.is_empty() {
            match reader.feed(chunk, allowance) {
                Ok((used, frame)) => {
                    assert!(used > 0 || frame.is_some(), "no progress");
                    assert!(used <= chunk.len());
                    chunk = &chunk[used..];
                    at += used;
                    if let Some((header, body)) = frame {
                        assert_eq!(body.len(), header.body_len as usize);
                        let _ = decode_body::<Request>(&body);
                        frames.push((header, body));
                    }
                    assert!(reader.buffered() <= MAX_BODY as usize);
                }
                Err(_) => {
                    failed = true;
                    break 'feed;
                }
            }
        }
    }

    // The same stream decoded whole.
    let mut expected = Vec::new();
    let mut expected_failure = false;
    let mut pos = 0;
    while stream.len() - pos >= HEADER_LEN {
        match FrameHeader::decode(&stream[pos..], MAX_BODY) {
            Ok(h) => {
                let end = pos + HEADER_LEN + h.body_len as usize;
                if end > stream.len() {
                    break;
                }
                expected.push((h, stream[pos + HEADER_LEN..end].to_vec()));
                pos = end;
            }
            Err(_) => {
                expected_failure = true;
                break;
            }
        }
    }
    assert_eq!(frames, expected);
    assert_eq!(failed, expected_failure);
});
