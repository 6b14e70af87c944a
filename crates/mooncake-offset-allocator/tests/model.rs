//! Property tests of the offset allocator against a reference model: a map of live
//! `[offset, offset + size)` intervals.

use std::collections::BTreeMap;

use mooncake_offset_allocator::{Allocation, OffsetAllocator};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
    Free(usize),
    AllocAt(u64, u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (1u64..200_000).prop_map(Op::Alloc),
        1 => (1u64..64).prop_map(|s| Op::Alloc(s << 14)),
        4 => any::<usize>().prop_map(Op::Free),
        1 => (0u64..(4 << 20) / 64, 1u64..100_000).prop_map(|(o, s)| Op::AllocAt(o * 64, s)),
    ]
}

fn check_model(a: &OffsetAllocator, live: &[Allocation]) -> Result<(), TestCaseError> {
    let mut model: BTreeMap<u64, u64> = BTreeMap::new();
    for x in live {
        prop_assert_eq!(x.offset() % 64, 0);
        prop_assert!(x.offset() + x.size() <= a.capacity(), "allocation past the end");
        model.insert(x.offset(), x.size());
    }
    let mut end = 0;
    for (&off, &size) in &model {
        prop_assert!(off >= end, "overlap at {}", off);
        end = off + size;
    }
    prop_assert_eq!(a.used_bytes(), model.values().sum::<u64>());
    let report = a.report();
    prop_assert_eq!(report.free_bytes + report.used_bytes, report.capacity);
    prop_assert!(report.largest_free_region <= report.free_bytes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn no_overlap_frees_coalesce_full_segment_reusable(ops in proptest::collection::vec(op(), 1..300)) {
        let capacity = 4 << 20;
        let mut a = OffsetAllocator::new(capacity);
        let mut live: Vec<Allocation> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(size) => {
                    let free_before = a.free_bytes();
                    match a.allocate(size) {
                        Some(x) => {
                            prop_assert!(x.size() >= size && x.size() < size + 64);
                            live.push(x);
                        }
                        // A failure is only allowed when no single free block fits:
                        // the largest free region is smaller than the request.
                        None => prop_assert!(
                            a.report().largest_free_region < size.div_ceil(64) * 64 || free_before < size,
                            "refused {} with a free block of {}", size, a.report().largest_free_region
                        ),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let x = live.swap_remove(i % live.len());
                    a.free(x);
                }
                Op::Free(_) => {}
                Op::AllocAt(off, size) => {
                    let end = off + size.div_ceil(64) * 64;
                    let free = end <= capacity && live.iter().all(|x| end <= x.offset() || off >= x.offset() + x.size());
                    match a.allocate_at(off, size) {
                        Some(x) => {
                            prop_assert!(free, "allocate_at gave a used range");
                            prop_assert_eq!(x.offset(), off);
                            live.push(x);
                        }
                        None => prop_assert!(!free, "allocate_at refused a free range"),
                    }
                }
            }
            check_model(&a, &live)?;
        }
        for x in live.drain(..) {
            a.free(x);
        }
        let r = a.report();
        prop_assert_eq!(r.free_regions, 1, "frees must coalesce into one block");
        prop_assert_eq!(r.fragmentation, 0.0);
        let all = a.allocate(capacity);
        prop_assert!(all.is_some(), "the full segment is reusable");
    }
}

#[test]
fn uniform_3_12_mb_allocations_fill_99_percent_of_1_gib() {
    let mut a = OffsetAllocator::new(1 << 30);
    let mut n = 0u64;
    let mut kept = Vec::new();
    while let Some(x) = a.allocate(3_120_000) {
        kept.push(x);
        n += 1;
    }
    let utilization = (n * 3_120_000) as f64 / (1u64 << 30) as f64;
    println!("uniform 3.12 MB allocations: {n} fit, utilization {:.2} %", utilization * 100.0);
    assert!(utilization >= 0.99, "utilization {utilization}");
    // Churn: free every other one and fill again; the holes are exactly reusable.
    let mut keep = Vec::new();
    for (i, x) in kept.into_iter().enumerate() {
        if i % 2 == 0 {
            a.free(x);
        } else {
            keep.push(x);
        }
    }
    let mut refilled = 0;
    while let Some(x) = a.allocate(3_120_000) {
        keep.push(x);
        refilled += 1;
    }
    assert!(refilled >= n / 2, "refilled {refilled} of {}", n / 2);
}

#[test]
fn the_last_block_that_fits_is_used() {
    // 10 units of 64 B free; a request of 9 units rounds up to a bin above 10's bin
    // boundary only when bins are coarse: the fallback scan must still find it.
    let mut a = OffsetAllocator::new(64 * 1000);
    let big = a.allocate(64 * 990).unwrap();
    let x = a.allocate(64 * 9 + 1).unwrap();
    assert_eq!(x.offset(), 64 * 990);
    a.free(big);
}
