//! Header layout: 128 bytes, 128-byte aligned, field offsets as documented.

use std::mem::{align_of, offset_of, size_of};

use mooncake_gpu::header::{offsets, U32Field, U64Field, HEADER_SIZE};
use mooncake_gpu::{HeaderSnapshot, ObjectHeader, ObjectState};

#[test]
fn size_and_alignment() {
    assert_eq!(size_of::<ObjectHeader>(), 128);
    assert_eq!(size_of::<HeaderSnapshot>(), 128);
    assert_eq!(HEADER_SIZE, 128);
    assert_eq!(align_of::<ObjectHeader>(), 128);
    // an array of headers has no gaps
    assert_eq!(size_of::<[ObjectHeader; 3]>(), 3 * 128);
}

#[test]
fn field_offsets_follow_the_reference_order() {
    let expect = [
        (offset_of!(ObjectHeader, key_hash), 0, offsets::KEY_HASH),
        (offset_of!(ObjectHeader, key_fp_hi), 8, offsets::KEY_FP_HI),
        (offset_of!(ObjectHeader, key_len), 16, offsets::KEY_LEN),
        (offset_of!(ObjectHeader, header_version), 20, offsets::HEADER_VERSION),
        (offset_of!(ObjectHeader, payload_base), 24, offsets::PAYLOAD_BASE),
        (offset_of!(ObjectHeader, bytes_total), 32, offsets::BYTES_TOTAL),
        (offset_of!(ObjectHeader, page_size), 40, offsets::PAGE_SIZE),
        (offset_of!(ObjectHeader, n_pages), 44, offsets::N_PAGES),
        (offset_of!(ObjectHeader, last_page_bytes), 48, offsets::LAST_PAGE_BYTES),
        (offset_of!(ObjectHeader, epoch), 52, offsets::EPOCH),
        (offset_of!(ObjectHeader, state), 56, offsets::STATE),
        (offset_of!(ObjectHeader, reader_refcnt), 60, offsets::READER_REFCNT),
        (offset_of!(ObjectHeader, state_ts), 64, offsets::STATE_TS),
        (offset_of!(ObjectHeader, last_access), 72, offsets::LAST_ACCESS),
        (offset_of!(ObjectHeader, flags), 80, offsets::FLAGS),
        (offset_of!(ObjectHeader, _pad), 84, offsets::PAD),
    ];
    for (i, (actual, documented, constant)) in expect.iter().enumerate() {
        assert_eq!(actual, documented, "field #{i}");
        assert_eq!(actual, constant, "field #{i}");
    }
    // field widths from the reference: u64 key_hash..., u32 state/refcnt
    assert_eq!(offsets::KEY_FP_HI - offsets::KEY_HASH, 8);
    assert_eq!(offsets::READER_REFCNT - offsets::STATE, 4);
    assert_eq!(offsets::LAST_ACCESS - offsets::STATE_TS, 8);
    // the snapshot has the same layout
    assert_eq!(offset_of!(HeaderSnapshot, state), 56);
    assert_eq!(offset_of!(HeaderSnapshot, state_ts), 64);
    assert_eq!(U32Field::State.offset(), 56);
    assert_eq!(U32Field::ReaderRefcnt.offset(), 60);
    assert_eq!(U64Field::LastAccess.offset(), 72);
}

#[test]
fn state_values() {
    assert_eq!(ObjectState::Reserved as u32, 0);
    assert_eq!(ObjectState::Writing as u32, 1);
    assert_eq!(ObjectState::Ready as u32, 2);
    assert_eq!(ObjectState::Dead as u32, 3);
    for v in 0..4 {
        assert_eq!(ObjectState::from_u32(v).unwrap().as_u32(), v);
    }
    assert_eq!(ObjectState::from_u32(4), None);
}

#[test]
fn snapshot_bytes_roundtrip_and_store() {
    let h = HeaderSnapshot {
        key_hash: 0x0102_0304_0506_0708,
        key_fp_hi: 0x1112_1314_1516_1718,
        key_len: 21,
        header_version: 1,
        payload_base: 4096,
        bytes_total: 1_000_000,
        page_size: 262_144,
        n_pages: 4,
        last_page_bytes: 213_568,
        epoch: 9,
        state: 2,
        reader_refcnt: 0,
        state_ts: 77,
        last_access: 88,
        flags: 0,
        _pad: 0,
        _reserved: [0; 5],
    };
    let b = h.to_bytes();
    assert_eq!(&b[56..60], &2u32.to_ne_bytes());
    assert_eq!(&b[0..8], &h.key_hash.to_ne_bytes());
    assert!(b[88..].iter().all(|&x| x == 0));
    assert_eq!(HeaderSnapshot::from_bytes(&b), h);

    let live = ObjectHeader::default();
    live.reader_refcnt.store(5, std::sync::atomic::Ordering::Relaxed);
    live.store_from(&h);
    let s = live.snapshot();
    // store_from leaves reader_refcnt to the readers
    assert_eq!(s.reader_refcnt, 5);
    assert_eq!(HeaderSnapshot { reader_refcnt: 0, ..s }, h);
}
