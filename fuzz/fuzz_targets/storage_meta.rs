//! Feeds arbitrary bytes to the on-disk metadata parsers of `mooncake-storage`:
//! they must return `Ok` or `Err`, never panic; an accepted bucket meta must
//! re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_storage::{parse_bucket_meta, parse_record_header};

fuzz_target!(|data: &[u8]| {
    if let Ok(meta) = parse_bucket_meta(data) {
        assert_eq!(meta.encode(), data, "accepted meta re-encodes to itself");
    }
    if let Ok(h) = parse_record_header(data) {
        assert_eq!(&h.encode()[..], &data[..h.encoded_len()]);
    }
});
