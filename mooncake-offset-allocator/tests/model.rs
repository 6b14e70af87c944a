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
    // Sizes of 16..32 units share bins two units wide: a free block of 17 units sits
    // in the bin of 16, a request of 17 units rounds up to the bin of 18 and finds
    // nothing there; the fallback scan of its own bin must still find the block.
    let mut a = OffsetAllocator::new(64 * 1000);
    let big = a.allocate(64 * (1000 - 17)).unwrap();
    let x = a.allocate(64 * 17).unwrap();
    assert_eq!(x.offset(), 64 * 983);
    assert_eq!(a.free_bytes(), 0);
    a.free(x);
    a.free(big);

    // The same with blocks that are too small in front of the one that fits: holes
    // of 16 units (bin of 16) and one of 17, freed first so that it is scanned last
    // (bins are LIFO).
    let mut a = OffsetAllocator::new(64 * 1000);
    let mut keep = Vec::new();
    let mut holes = Vec::new();
    for _ in 0..20 {
        holes.push(a.allocate(64 * 16).unwrap());
        keep.push(a.allocate(64).unwrap());
    }
    let last = a.allocate(64 * 17).unwrap();
    keep.push(a.allocate(a.free_bytes()).unwrap());
    assert_eq!(a.free_bytes(), 0);
    let last_offset = last.offset();
    a.free(last);
    for h in holes {
        a.free(h);
    }
    let x = a.allocate(64 * 17).expect("the 17-unit hole fits");
    assert_eq!(x.offset(), last_offset);
    assert!(a.allocate(64 * 17).is_none(), "only 16-unit holes are left");
}

#[test]
fn allocator_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<OffsetAllocator>();
    check::<Allocation>();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Any alignment and capacity: offsets and sizes aligned, no overlap, frees
    /// coalesce back into the whole (rounded-down) capacity.
    #[test]
    fn any_alignment_and_capacity(
        align_log in 0u32..13,
        capacity in 1u64..(1 << 22),
        ops in proptest::collection::vec((any::<bool>(), 1u64..100_000, any::<usize>()), 1..200),
    ) {
        let align = 1u64 << align_log;
        let Ok(mut a) = OffsetAllocator::with_alignment(capacity, align) else {
            prop_assert!(capacity < align);
            return Ok(());
        };
        prop_assert_eq!(a.capacity(), capacity / align * align);
        let mut live: BTreeMap<u64, Allocation> = BTreeMap::new();
        for (alloc, size, pick) in ops {
            if alloc || live.is_empty() {
                if let Some(x) = a.allocate(size) {
                    prop_assert_eq!(x.offset() % align, 0);
                    prop_assert_eq!(x.size(), size.div_ceil(align) * align);
                    prop_assert!(x.offset() + x.size() <= a.capacity());
                    if let Some((&o, p)) = live.range(..x.offset()).next_back() {
                        prop_assert!(o + p.size() <= x.offset(), "overlap");
                    }
                    if let Some((&o, _)) = live.range(x.offset()..).next() {
                        prop_assert!(x.offset() + x.size() <= o, "overlap");
                    }
                    live.insert(x.offset(), x);
                }
            } else {
                let key = *live.keys().nth(pick % live.len()).unwrap();
                a.free(live.remove(&key).unwrap());
            }
            prop_assert_eq!(a.used_bytes(), live.values().map(Allocation::size).sum::<u64>());
        }
        for (_, x) in std::mem::take(&mut live) {
            a.free(x);
        }
        prop_assert_eq!(a.report().free_regions, 1);
        let all = a.allocate(a.capacity());
        prop_assert!(all.is_some());
    }
}
