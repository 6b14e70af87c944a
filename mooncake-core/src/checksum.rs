//! The object checksum (crc32c), computed on several cores for large objects.
//!
//! crc32c runs at about the speed of memcpy on one core, so verifying a large object
//! on one thread would halve the bandwidth of a shared-memory get. Large buffers are
//! split, the parts summed in parallel, and the parts' sums combined.

use mooncake_transfer::checksum::{crc32c, crc32c_concat};

/// Objects at least this large are summed in parallel.
const PARALLEL_FROM: usize = 2 << 20;

/// crc32c of the concatenation of `parts`.
pub(crate) fn checksum_parts<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    crc32c_concat(parts.into_iter().map(|p| (checksum(p), p.len())))
}

/// crc32c of `data`.
pub(crate) fn checksum(data: &[u8]) -> u32 {
    let threads = parallelism();
    if data.len() < PARALLEL_FROM || threads < 2 {
        return crc32c(data);
    }
    let part = data.len().div_ceil(threads);
    let sums: Vec<(u32, usize)> = std::thread::scope(|s| {
        let mut parts = data.chunks(part);
        let first = parts.next().unwrap_or_default();
        let handles: Vec<_> = parts.map(|p| s.spawn(move || (crc32c(p), p.len()))).collect();
        let mut sums = vec![(crc32c(first), first.len())];
        // A thread that cannot be joined would be a bug in crc32c; fall back to the
        // sequential sum rather than fail the call.
        for h in handles {
            match h.join() {
                Ok(s) => sums.push(s),
                Err(_) => return Vec::new(),
            }
        }
        sums
    });
    if sums.is_empty() {
        return crc32c(data);
    }
    crc32c_concat(sums)
}

/// The checksum of each item (the concatenation of its parts). A batch with many
/// bytes is summed on several threads, each taking a run of items of about the same
/// size: after a batch transfer the peer is idle, so every core is free to sum.
pub(crate) fn checksum_each(items: &[Vec<&[u8]>]) -> Vec<u32> {
    let bytes: usize = items.iter().flatten().map(|p| p.len()).sum();
    let threads = parallelism().min(items.len());
    if bytes < PARALLEL_FROM || threads < 2 {
        return items.iter().map(|parts| checksum_parts(parts.iter().copied())).collect();
    }
    // Cut the items into `threads` runs of about `bytes / threads` bytes each.
    let share = bytes.div_ceil(threads);
    let mut runs: Vec<&[Vec<&[u8]>]> = Vec::with_capacity(threads);
    let (mut start, mut acc) = (0, 0);
    for (i, parts) in items.iter().enumerate() {
        acc += parts.iter().map(|p| p.len()).sum::<usize>();
        if acc >= share && runs.len() + 1 < threads {
            runs.push(&items[start..=i]);
            (start, acc) = (i + 1, 0);
        }
    }
    runs.push(&items[start..]);
    let sum_run =
        |run: &[Vec<&[u8]>]| run.iter().map(|parts| checksum_parts(parts.iter().copied())).collect::<Vec<u32>>();
    std::thread::scope(|s| {
        let mut runs = runs.into_iter();
        let first = runs.next().unwrap_or_default();
        let handles: Vec<_> = runs.map(|run| (run, s.spawn(move || sum_run(run)))).collect();
        let mut sums = sum_run(first);
        for (run, h) in handles {
            // A thread that cannot be joined would be a bug in crc32c; sum its run
            // here rather than fail the call.
            sums.extend(h.join().unwrap_or_else(|_| sum_run(run)));
        }
        sums
    })
}

fn parallelism() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()).min(4))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_each_matches_one_item_at_a_time() {
        let data: Vec<u8> = (0..(6 << 20)).map(|i: usize| (i * 31 % 251) as u8).collect();
        for cut in [1usize, 7, 64, 300] {
            // Items of uneven sizes, some made of several parts, some empty.
            let mut items: Vec<Vec<&[u8]>> = Vec::new();
            let mut at = 0;
            for k in 0..cut {
                let len = (data.len() / cut) * (k % 3) / 2;
                let end = (at + len).min(data.len());
                let mid = at + (end - at) / 3;
                items.push(vec![&data[at..mid], &data[mid..end]]);
                at = end;
            }
            let each = checksum_each(&items);
            let one: Vec<u32> = items.iter().map(|p| ::crc32c::crc32c(&p.concat())).collect();
            assert_eq!(each, one, "{cut} items");
        }
        assert!(checksum_each(&[]).is_empty());
    }
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
        #[test]
        fn parallel_sum_equals_the_sequential_one(len in 0usize..(9 << 20), seed in any::<u8>()) {
            let data: Vec<u8> = (0..len).map(|i| seed.wrapping_add((i * 7 % 253) as u8)).collect();
            prop_assert_eq!(checksum(&data), ::crc32c::crc32c(&data));
        }
    }
}
