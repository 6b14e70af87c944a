//! The engine and the local transport, through the public API only.

use mooncake_transfer::{TransferEngine, TransferError, TransferRequest};
use proptest::prelude::*;

#[test]
fn bytes_written_by_one_engine_are_read_by_another() {
    let server = TransferEngine::new();
    let seg = server.register_region(1 << 20).unwrap();
    let target = server.remote(seg.id());
    let client = TransferEngine::new();
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 31 % 251) as u8).collect();
    client.write(&target, 1000, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    client.read(&target, 1000, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn out_of_region_requests_are_refused_and_touch_nothing() {
    let server = TransferEngine::new();
    let seg = server.register_region(4096).unwrap();
    let target = server.remote(seg.id());
    let client = TransferEngine::new();
    client.write(&target, 0, &[7u8; 4096]).unwrap();
    let err = client.write(&target, 4090, &[1u8; 7]).unwrap_err();
    assert!(matches!(err, TransferError::OutOfBounds { offset: 4090, len: 7, region_len: 4096, .. }), "{err}");
    // offset + len overflowing u64 must not wrap around into bounds.
    let err = client.write(&target, u64::MAX, &[1u8; 2]).unwrap_err();
    assert!(matches!(err, TransferError::OutOfBounds { .. }));
    let mut back = vec![0u8; 4096];
    client.read(&target, 0, &mut back).unwrap();
    assert!(back.iter().all(|&b| b == 7), "a refused write changed memory");
}

#[test]
fn dropped_engines_and_unregistered_regions_are_unreachable() {
    let server = TransferEngine::new();
    let seg = server.register_region(4096).unwrap();
    let target = server.remote(seg.id());
    let client = TransferEngine::new();
    assert!(server.unregister_region(seg.id()));
    assert!(!server.unregister_region(seg.id()));
    assert!(matches!(client.write(&target, 0, b"x"), Err(TransferError::UnknownRegion { .. })));
    let seg2 = server.register_region(4096).unwrap();
    assert_ne!(seg2.id(), seg.id(), "region ids must never be reused");
    let target2 = server.remote(seg2.id());
    drop(server);
    assert!(matches!(client.write(&target2, 0, b"x"), Err(TransferError::Unreachable(_))));
}

#[test]
fn a_batch_reports_each_request_on_its_own() {
    let a = TransferEngine::new();
    let b = TransferEngine::new();
    let ra = a.register_region(4096).unwrap();
    let rb = b.register_region(4096).unwrap();
    let (ta, tb) = (a.remote(ra.id()), b.remote(rb.id()));
    let me = TransferEngine::new();
    let (x, y, z) = (vec![1u8; 10], vec![2u8; 10], vec![3u8; 10]);
    let mut reqs =
        [TransferRequest::write(&ta, 0, &x), TransferRequest::write(&tb, 4095, &y), TransferRequest::write(&tb, 0, &z)];
    let results = me.transfer(&mut reqs);
    assert!(results[0].is_ok());
    assert!(matches!(results[1], Err(TransferError::OutOfBounds { .. })));
    assert!(results[2].is_ok());
    let mut back = [0u8; 10];
    me.read(&tb, 0, &mut back).unwrap();
    assert_eq!(back, [3u8; 10]);
}

#[test]
fn zero_sized_regions_are_refused() {
    assert!(matches!(TransferEngine::new().register_region(0), Err(TransferError::Registration(_))));
}

proptest! {
    /// Any (offset, len) either moves exactly the right bytes or is refused.
    #[test]
    fn bounds_are_exact(offset in 0u64..10_000, len in 0usize..6000) {
        let server = TransferEngine::new();
        let seg = server.register_region(8192).unwrap();
        let target = server.remote(seg.id());
        let src: Vec<u8> = (0..len).map(|i| (i % 256) as u8).collect();
        let res = server.write(&target, offset, &src);
        if offset + len as u64 <= 8192 {
            prop_assert!(res.is_ok());
            let mut back = vec![0u8; len];
            server.read(&target, offset, &mut back).unwrap();
            prop_assert_eq!(back, src);
        } else {
            let is_oob = matches!(res, Err(TransferError::OutOfBounds { .. }));
            prop_assert!(is_oob);
        }
    }
}
