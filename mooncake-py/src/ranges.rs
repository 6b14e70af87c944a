//! `get_into_ranges`: byte ranges of objects read straight into registered buffers.
//!
//! Each object is read once, whole (its checksum covers all of it), with
//! `Store::batch_get_into_parts`: the parts are the caller's destinations for the
//! wanted ranges, in the order of their offsets in the object, and scratch memory for
//! the bytes between them. The object's length is not known beforehand: the first
//! read ends at the end of the last range, and an object longer than that is read
//! again with a scratch tail of the exact length the engine reported. Ranges that
//! overlap in the object (or destinations that overlap, which would alias) are read
//! into scratch memory and copied out instead.

use std::collections::BTreeMap;

use mooncake_core::{BufferRegistry, Error, Store};

use crate::codes::{code, INVALID_PARAMS};

/// One range to read: bytes `[src, src + len)` of an object into the registered
/// memory at `dst`; its answer goes to `results[i][j][k]` of the call, `at`.
pub struct Range {
    /// Where the answer goes: buffer, key, range.
    pub at: (usize, usize, usize),
    /// Destination address (checked against a registered buffer).
    pub dst: usize,
    /// Offset in the object.
    pub src: usize,
    /// Bytes to copy (at least 1; `src + len` does not overflow).
    pub len: usize,
}

/// What to read of one object.
struct Plan<'r> {
    key: &'r str,
    /// Its ranges, by offset in the object.
    ranges: Vec<&'r Range>,
    /// Whether the ranges are read straight into their destinations (else through
    /// scratch memory).
    direct: bool,
    /// End of the last range in the object.
    end: usize,
}

impl Plan<'_> {
    /// Scratch bytes a read needs with a tail of `tail` bytes after the last range.
    fn scratch_len(&self, tail: usize) -> usize {
        if !self.direct {
            return self.end + tail;
        }
        let mut at = 0;
        let mut gaps = 0;
        for r in &self.ranges {
            gaps += r.src - at;
            at = r.src + r.len;
        }
        gaps + tail
    }
}

/// Answers per range (`at` and the bytes copied, or a negative code), and per key
/// occurrence the code of an object that could not be read at all.
pub struct Answers {
    /// `(at, value)` for each range read or refused.
    pub ranges: Vec<((usize, usize, usize), i64)>,
    /// Keys that failed as a whole, with their code.
    pub failed: BTreeMap<String, i64>,
}

/// Reads `ranges` (grouped by key) through `store`. `keys` lists every key asked
/// for, also those without a valid range (their failure still has to be reported).
pub fn read(store: &Store, keys: &[&str], ranges: &BTreeMap<&str, Vec<Range>>) -> Answers {
    let all_disjoint = BufferRegistry::disjoint(ranges.values().flatten().map(|r| (r.dst, r.len)).collect());
    let plans: Vec<Plan<'_>> = keys
        .iter()
        .map(|&key| {
            let mut rs: Vec<&Range> = ranges.get(key).map(|v| v.iter().collect()).unwrap_or_default();
            rs.sort_by_key(|r| (r.src, r.len));
            let separate = rs.windows(2).all(|w| w[0].src + w[0].len <= w[1].src);
            let end = rs.iter().map(|r| r.src + r.len).max().unwrap_or(0);
            Plan { key, ranges: rs, direct: all_disjoint && separate, end }
        })
        .collect();
    let mut answers = Answers { ranges: Vec::new(), failed: BTreeMap::new() };
    let first: Vec<(&Plan<'_>, usize)> = plans.iter().map(|p| (p, 0)).collect();
    let mut again = Vec::new();
    for ((plan, _), (res, scratch)) in first.iter().zip(read_round(store, &first)) {
        match res {
            // Longer than the last range: read again with the rest in scratch memory
            // (a key without ranges has nothing to read).
            Err(Error::BufferTooSmall { needed, .. }) if !plan.ranges.is_empty() => {
                again.push((*plan, (needed as usize).saturating_sub(plan.end)))
            }
            res => settle(plan, res, &scratch, &mut answers),
        }
    }
    for ((plan, _), (res, scratch)) in again.iter().zip(read_round(store, &again)) {
        settle(plan, res, &scratch, &mut answers);
    }
    answers
}

/// Records the answers of one object's read.
fn settle(plan: &Plan<'_>, res: mooncake_core::Result<usize>, scratch: &[u8], answers: &mut Answers) {
    let len = match res {
        Ok(len) => len,
        Err(Error::BufferTooSmall { .. }) => return, // no valid range: they stay refused
        Err(e) => {
            answers.failed.insert(plan.key.to_owned(), code(&e).into());
            return;
        }
    };
    for r in &plan.ranges {
        let value = if r.src + r.len > len {
            INVALID_PARAMS.into()
        } else {
            if !plan.direct {
                // SAFETY: `r.dst` was checked against a registered buffer of at least
                // `r.len` bytes; a raw copy creates no reference that could alias.
                unsafe { std::ptr::copy_nonoverlapping(scratch[r.src..].as_ptr(), r.dst as *mut u8, r.len) };
            }
            r.len as i64
        };
        answers.ranges.push((r.at, value));
    }
}

/// One `batch_get_into_parts` for `plans`, each with its scratch tail; returns each
/// object's result and the scratch memory it was read into.
fn read_round(store: &Store, plans: &[(&Plan<'_>, usize)]) -> Vec<(mooncake_core::Result<usize>, Vec<u8>)> {
    if plans.is_empty() {
        return Vec::new();
    }
    let mut scratch: Vec<Vec<u8>> = plans.iter().map(|(p, tail)| vec![0u8; p.scratch_len(*tail)]).collect();
    let results = {
        let mut pieces: Vec<Vec<&mut [u8]>> = Vec::with_capacity(plans.len());
        for ((plan, _), sc) in plans.iter().zip(scratch.iter_mut()) {
            let mut parts: Vec<&mut [u8]> = Vec::new();
            let mut rest: &mut [u8] = sc;
            if plan.direct {
                let mut at = 0;
                for r in &plan.ranges {
                    let (gap, tail) = std::mem::take(&mut rest).split_at_mut(r.src - at);
                    if !gap.is_empty() {
                        parts.push(gap);
                    }
                    rest = tail;
                    // SAFETY: the destination lies inside a registered buffer (checked
                    // by the caller) and no two destinations of the call overlap
                    // (`direct` requires it), so this slice aliases nothing.
                    parts.push(unsafe { std::slice::from_raw_parts_mut(r.dst as *mut u8, r.len) });
                    at = r.src + r.len;
                }
            }
            if !rest.is_empty() {
                parts.push(rest);
            }
            pieces.push(parts);
        }
        let keys: Vec<&str> = plans.iter().map(|(p, _)| p.key).collect();
        let mut bufs: Vec<&mut [&mut [u8]]> = pieces.iter_mut().map(Vec::as_mut_slice).collect();
        store.batch_get_into_parts(&keys, &mut bufs)
    };
    results.into_iter().zip(scratch).collect()
}
