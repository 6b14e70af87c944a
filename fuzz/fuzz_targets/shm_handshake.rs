//! The shared-memory transport's handshakes on a peer's arbitrary answers: the
//! region-mapping answer (`ShmInfo`) and the host identity (`Hello`). Never a panic;
//! what decodes encodes back to the same bytes (the pid aside, which is always this
//! process's when encoding); a short answer is an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_transfer::fuzzing::{decode_shm_info, encode_shm_info, shm_answers};
use mooncake_transfer::{FrameStatus, TransferError};

fuzz_target!(|data: &[u8]| {
    match decode_shm_info(data) {
        Some(info) => {
            assert!(data.len() >= 24);
            let again = decode_shm_info(&encode_shm_info(info.len, info.fd, info.ino, &info.host_id)).unwrap();
            assert_eq!((again.len, again.fd, again.ino, &again.host_id), (info.len, info.fd, info.ino, &info.host_id));
            if let Ok(host) = std::str::from_utf8(&data[24..]) {
                assert_eq!(info.host_id, host);
            }
        }
        None => assert!(data.len() < 24),
    }

    let Some((&status, payload)) = data.split_first() else { return };
    let status = [FrameStatus::Ok, FrameStatus::OutOfBounds, FrameStatus::UnknownRegion, FrameStatus::Refused]
        [usize::from(status % 4)];
    let (hello, info) = shm_answers(status, payload, 5);
    if let Ok(host) = hello {
        assert_eq!((status, host.as_bytes()), (FrameStatus::Ok, payload));
    }
    match info {
        Ok(i) => {
            assert_eq!(status, FrameStatus::Ok);
            assert_eq!(Some(i), decode_shm_info(payload));
        }
        Err(TransferError::UnknownRegion { region, .. }) => {
            assert_eq!((status, region), (FrameStatus::UnknownRegion, 5))
        }
        Err(TransferError::Protocol(_)) => assert!(status != FrameStatus::Ok || payload.len() < 24),
        Err(e) => panic!("unexpected error {e:?}"),
    }
});
