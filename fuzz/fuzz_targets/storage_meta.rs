//! Feeds arbitrary bytes to the on-disk metadata parsers of `mooncake-storage`:
//! they must return `Ok` or `Err`, never panic; an accepted bucket meta must
//! re-encode to the same bytes (a version-1 meta, which has no generations, to a
//! version-2 one that parses back to the same content), and name a data length
//! the bucket layout can round up to 4 KiB (as recovery does) without overflow.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_storage::{parse_bucket_meta, parse_record_header, MAX_BUCKET_DATA_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(meta) = parse_bucket_meta(data) {
        let again = meta.encode();
        if data[8..12] == 2u32.to_le_bytes() {
            assert_eq!(again, data, "accepted meta re-encodes to itself");
        }
        assert_eq!(parse_bucket_meta(&again).expect("re-encoded meta parses"), meta);
        assert!(meta.data_len <= MAX_BUCKET_DATA_LEN);
        assert!(meta.data_len.checked_next_multiple_of(4096).is_some());
        assert!(meta.entries.iter().all(|e| e.offset + e.len <= meta.data_len));
    }
    if let Ok(h) = parse_record_header(data) {
        assert_eq!(&h.encode()[..], &data[..h.encoded_len()]);
    }
});
