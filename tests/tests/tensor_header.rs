//! The Python binding's tensor header (`mooncake-py/src/tensor_meta.rs`, compiled here
//! as it is: the binding is an extension module, which no test harness can link). A
//! `get_tensor` parses headers any client may have written: whatever the bytes, the
//! parse answers without a panic, and what it accepts describes exactly the object's
//! bytes; a whole tensor's header round-trips; a tensor's shards split its bytes
//! exactly, each byte in one shard.

#[allow(dead_code)]
#[path = "../../mooncake-py/src/tensor_meta.rs"]
mod tensor_meta;

use proptest::prelude::*;
use tensor_meta::{Dtype, Meta, META_LEN};

/// A whole tensor's header: a dtype by the reference's number, up to 8 small dims.
fn whole() -> impl Strategy<Value = Meta> {
    (0i32..15, prop::collection::vec(0i64..6, 0..=8))
        .prop_map(|(code, shape)| Meta::full(Dtype::from_code(code).unwrap(), shape).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_whole_tensors_header_round_trips(meta in whole()) {
        let total = META_LEN + meta.data_bytes;
        prop_assert_eq!(Meta::parse(&meta.encode(), total), Some(meta.clone()));
        // The elements must fill the rest of the object exactly.
        prop_assert_eq!(Meta::parse(&meta.encode(), total + 1), None);
        if total > META_LEN {
            prop_assert_eq!(Meta::parse(&meta.encode(), total - 1), None);
        }
        prop_assert_eq!(Meta::parse(&meta.encode()[..META_LEN - 1], total), None);
    }

    #[test]
    fn any_header_bytes_are_parsed_without_panic_and_what_parses_is_exact(
        meta in whole(),
        flips in prop::collection::vec((0usize..META_LEN, any::<u8>()), 0..6),
        extra in 0usize..64,
        shrink in any::<bool>(),
    ) {
        let mut bytes = meta.encode();
        for (at, v) in flips {
            bytes[at] = v;
        }
        let total = if shrink { (META_LEN + meta.data_bytes).saturating_sub(extra) } else { META_LEN + meta.data_bytes + extra };
        if let Some(m) = Meta::parse(&bytes, total) {
            prop_assert!(m.data_offset >= META_LEN);
            prop_assert_eq!(m.data_offset + m.data_bytes, total);
            let elements: i64 = m.local.iter().product();
            prop_assert_eq!(elements as usize * m.dtype.size(), m.data_bytes);
            prop_assert!(m.global.len() <= 8 && m.local.len() == m.global.len());
            // What was accepted is what its encoding says.
            prop_assert_eq!(Meta::parse(&m.encode(), total), Some(m));
        }
    }

    #[test]
    fn a_tensors_shards_split_its_bytes_exactly(meta in whole(), dim in 0usize..8, count in 1i32..5) {
        prop_assume!(dim < meta.local.len());
        let ranks: Vec<_> = (0..count).map(|r| meta.shard(dim as i32, r, count)).collect();
        if meta.local[dim] % i64::from(count) != 0 {
            prop_assert!(ranks.iter().all(Option::is_none), "a dimension the count does not divide");
            return Ok(());
        }
        let mut covered = vec![0u8; meta.data_bytes];
        for (rank, shard) in ranks.into_iter().enumerate() {
            let (m, ranges) = shard.unwrap();
            prop_assert_eq!(ranges.iter().map(|r| r.1).sum::<usize>(), m.data_bytes);
            prop_assert_eq!(m.global.clone(), meta.local.clone());
            prop_assert_eq!(m.local[dim] * i64::from(count), meta.local[dim]);
            for (at, len) in ranges {
                for b in &mut covered[at..at + len] {
                    *b += 1;
                }
            }
            // A shard's header is one the parse accepts, as written.
            prop_assert_eq!(Meta::parse(&m.encode(), META_LEN + m.data_bytes), Some(m), "rank {}", rank);
        }
        prop_assert!(covered.iter().all(|&n| n == 1), "each byte in exactly one shard");
        prop_assert!(meta.shard(dim as i32, count, count).is_none() && meta.shard(dim as i32, -1, count).is_none());
    }
}
