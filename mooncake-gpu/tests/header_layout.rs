//! Header layout: 128 bytes, 128-byte aligned, field offsets as documented.

use std::mem::{align_of, offset_of, size_of};

use mooncake_gpu::{
    header_offsets, DeviceObjectHeader, HeaderSnapshot, HeaderU32Field, HeaderU64Field, ObjectState, HEADER_SIZE,
};

#[test]
fn size_and_alignment() {
    assert_eq!(size_of::<DeviceObjectHeader>(), 128);
    assert_eq!(size_of::<HeaderSnapshot>(), 128);
    assert_eq!(HEADER_SIZE, 128);
    assert_eq!(align_of::<DeviceObjectHeader>(), 128);
    // an array of headers has no gaps
    assert_eq!(size_of::<[DeviceObjectHeader; 3]>(), 3 * 128);
}

#[test]
fn field_offsets_follow_the_reference_order() {
    let expect = [
        (offset_of!(DeviceObjectHeader, key_hash), 0, header_offsets::KEY_HASH),
        (offset_of!(DeviceObjectHeader, key_fp_hi), 8, header_offsets::KEY_FP_HI),
        (offset_of!(DeviceObjectHeader, key_len), 16, header_offsets::KEY_LEN),
        (offset_of!(DeviceObjectHeader, header_version), 20, header_offsets::HEADER_VERSION),
        (offset_of!(DeviceObjectHeader, payload_base), 24, header_offsets::PAYLOAD_BASE),
        (offset_of!(DeviceObjectHeader, bytes_total), 32, header_offsets::BYTES_TOTAL),
        (offset_of!(DeviceObjectHeader, page_size), 40, header_offsets::PAGE_SIZE),
        (offset_of!(DeviceObjectHeader, n_pages), 44, header_offsets::N_PAGES),
        (offset_of!(DeviceObjectHeader, last_page_bytes), 48, header_offsets::LAST_PAGE_BYTES),
        (offset_of!(DeviceObjectHeader, epoch), 52, header_offsets::EPOCH),
        (offset_of!(DeviceObjectHeader, state), 56, header_offsets::STATE),
        (offset_of!(DeviceObjectHeader, reader_refcnt), 60, header_offsets::READER_REFCNT),
        (offset_of!(DeviceObjectHeader, state_ts), 64, header_offsets::STATE_TS),
        (offset_of!(DeviceObjectHeader, last_access), 72, header_offsets::LAST_ACCESS),
        (offset_of!(DeviceObjectHeader, flags), 80, header_offsets::FLAGS),
        (offset_of!(DeviceObjectHeader, _pad), 84, header_offsets::PAD),
    ];
    for (i, (actual, documented, constant)) in expect.iter().enumerate() {
        assert_eq!(actual, documented, "field #{i}");
        assert_eq!(actual, constant, "field #{i}");
    }
    // field widths from the reference: u64 key_hash..., u32 state/refcnt
    assert_eq!(header_offsets::KEY_FP_HI - header_offsets::KEY_HASH, 8);
    assert_eq!(header_offsets::READER_REFCNT - header_offsets::STATE, 4);
    assert_eq!(header_offsets::LAST_ACCESS - header_offsets::STATE_TS, 8);
    // the snapshot has the same layout
    assert_eq!(offset_of!(HeaderSnapshot, state), 56);
    assert_eq!(offset_of!(HeaderSnapshot, state_ts), 64);
    assert_eq!(HeaderU32Field::State.offset(), 56);
    assert_eq!(HeaderU32Field::ReaderRefcnt.offset(), 60);
    assert_eq!(HeaderU64Field::LastAccess.offset(), 72);
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

    let live = DeviceObjectHeader::default();
    live.reader_refcnt.store(5, std::sync::atomic::Ordering::Relaxed);
    live.store_from(&h);
    let s = live.snapshot();
    // store_from leaves reader_refcnt to the readers
    assert_eq!(s.reader_refcnt, 5);
    assert_eq!(HeaderSnapshot { reader_refcnt: 0, ..s }, h);
}
