//! The Python binding's tensor header parse (`mooncake-py/src/tensor_meta.rs`, compiled
//! as it is) on arbitrary bytes and object lengths: never panics; what it accepts
//! describes exactly the object's bytes, and its encoding parses back to it; the
//! shards of an accepted tensor lie within its bytes.
#![no_main]

#[allow(dead_code)]
#[path = "../../mooncake-py/src/tensor_meta.rs"]
mod tensor_meta;

use libfuzzer_sys::fuzz_target;
use tensor_meta::{Meta, META_LEN};

fuzz_target!(|data: &[u8]| {
    let Some((len, head)) = data.split_first_chunk::<4>() else { return };
    let total = u32::from_le_bytes(*len) as usize;
    let Some(m) = Meta::parse(head, total) else { return };
    assert!(m.data_offset >= META_LEN && m.data_offset + m.data_bytes == total);
    assert_eq!(Meta::parse(&m.encode(), total).as_ref(), Some(&m));
    for dim in 0..m.local.len() as i32 {
        for count in 1..4 {
            for rank in 0..count {
                if let Some((s, ranges)) = m.shard(dim, rank, count) {
                    assert_eq!(ranges.iter().map(|r| r.1).sum::<usize>(), s.data_bytes);
                    assert!(ranges.iter().all(|&(at, n)| at + n <= m.data_bytes));
                }
            }
        }
    }
});
