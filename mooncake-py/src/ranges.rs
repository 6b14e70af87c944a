//! `get_into_ranges`: byte ranges of objects read straight into registered buffers
//! or GPU memory.
//!
//! Each object is read once, whole (its checksum covers all of it), into parts laid
//! end to end: the caller's destinations for the wanted ranges, in the order of their
//! offsets in the object, and scratch memory for the bytes between them. Host-only
//! objects go through `Store::batch_get_into_parts`; an object with a range in GPU
//! memory through `Store::batch_get_into_devices`, the parts seen as one
//! `DeviceScatter` (device ranges, registered host ranges, host scratch), so its
//! bytes reach the GPU the way every device read moves them (by DMA from a mapped
//! segment, streamed from a TCP peer), never through a host copy here. The object's
//! length is not known beforehand: the first read ends at the end of the last range,
//! and an object longer than that is read again with a scratch tail of the exact
//! length the engine reported. Ranges that overlap in the object (or destinations
//! that overlap, which would alias) are read into host scratch memory and copied out
//! instead.

use std::collections::BTreeMap;
use std::sync::Arc;

use mooncake_core::gpu::{DeviceMemory, DeviceScatter, HostDeviceMemory};
use mooncake_core::{BufferRegistry, Error, Store};

use crate::codes::{code, INVALID_PARAMS};
use crate::device::host_part;

/// Where a range's bytes go.
pub enum Dst {
    /// Registered host memory at this address (checked against a registered buffer).
    Host(usize),
    /// Device memory, at this offset of it (the range checked to lie in it).
    Device(Arc<dyn DeviceMemory>, u64),
}

impl Dst {
    /// The address range written, to tell whether destinations overlap (a device
    /// address for device memory: CUDA's unified addressing keeps it apart from host
    /// addresses).
    fn span(&self, len: usize) -> (usize, usize) {
        match self {
            Dst::Host(at) => (*at, len),
            Dst::Device(mem, offset) => ((mem.device_ptr() + offset) as usize, len),
        }
    }
}

/// One range to read: bytes `[src, src + len)` of an object into `dst`; its answer
/// goes to `results[i][j][k]` of the call, `at`.
pub struct Range {
    /// Where the answer goes: buffer, key, range.
    pub at: (usize, usize, usize),
    /// Where the bytes go.
    pub dst: Dst,
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
    /// Whether a range goes to device memory (read through the device API when
    /// `direct`).
    on_device: bool,
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
    let all_disjoint = BufferRegistry::disjoint(ranges.values().flatten().map(|r| r.dst.span(r.len)).collect());
    let plans: Vec<Plan<'_>> = keys
        .iter()
        .map(|&key| {
            let mut rs: Vec<&Range> = ranges.get(key).map(|v| v.iter().collect()).unwrap_or_default();
            rs.sort_by_key(|r| (r.src, r.len));
            let separate = rs.windows(2).all(|w| w[0].src + w[0].len <= w[1].src);
            let end = rs.iter().map(|r| r.src + r.len).max().unwrap_or(0);
            let on_device = rs.iter().any(|r| matches!(r.dst, Dst::Device(..)));
            Plan { key, ranges: rs, direct: all_disjoint && separate, on_device, end }
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
            let copied = match (&r.dst, plan.direct) {
                (_, true) => Ok(()),
                (Dst::Host(dst), false) => {
                    // SAFETY: `dst` was checked against a registered buffer of at
                    // least `r.len` bytes; a raw copy creates no reference that could
                    // alias.
                    unsafe { std::ptr::copy_nonoverlapping(scratch[r.src..].as_ptr(), *dst as *mut u8, r.len) };
                    Ok(())
                }
                (Dst::Device(mem, offset), false) => mem.copy_from_host(*offset, &scratch[r.src..r.src + r.len]),
            };
            match copied {
                Ok(()) => r.len as i64,
                Err(e) => code(&Error::from(e)).into(),
            }
        };
        answers.ranges.push((r.at, value));
    }
}

/// One read of `plans`, each with its scratch tail: host-only ones (and those read
/// through scratch memory) in one `batch_get_into_parts`, those with device ranges
/// read straight in one `batch_get_into_devices`. Returns each object's result and
/// the host scratch memory it was read into (empty for a device read: nothing is
/// copied out of it).
fn read_round(store: &Store, plans: &[(&Plan<'_>, usize)]) -> Vec<(mooncake_core::Result<usize>, Vec<u8>)> {
    let (device, host): (Vec<usize>, Vec<usize>) =
        (0..plans.len()).partition(|&i| plans[i].0.direct && plans[i].0.on_device);
    let mut out: Vec<Option<(mooncake_core::Result<usize>, Vec<u8>)>> = (0..plans.len()).map(|_| None).collect();
    let host_plans: Vec<(&Plan<'_>, usize)> = host.iter().map(|&i| plans[i]).collect();
    for (i, got) in host.iter().zip(read_into_host(store, &host_plans)) {
        out[*i] = Some(got);
    }
    let device_plans: Vec<(&Plan<'_>, usize)> = device.iter().map(|&i| plans[i]).collect();
    for (i, got) in device.iter().zip(read_into_device(store, &device_plans)) {
        out[*i] = Some((got, Vec::new()));
    }
    out.into_iter().map(|o| o.expect("every plan read")).collect()
}

/// One `batch_get_into_parts` for `plans` (no device range among their direct
/// ones), each with its scratch tail; returns each object's result and the scratch
/// memory it was read into.
fn read_into_host(store: &Store, plans: &[(&Plan<'_>, usize)]) -> Vec<(mooncake_core::Result<usize>, Vec<u8>)> {
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
                    let Dst::Host(dst) = r.dst else { unreachable!("device plans are read by read_into_device") };
                    // SAFETY: the destination lies inside a registered buffer (checked
                    // by the caller) and no two destinations of the call overlap
                    // (`direct` requires it), so this slice aliases nothing.
                    parts.push(unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, r.len) });
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

/// One `batch_get_into_devices` for `plans` (direct, with a device range each):
/// each object into a scatter of its ranges' destinations and host scratch memory
/// for the gaps between them and its tail.
fn read_into_device(store: &Store, plans: &[(&Plan<'_>, usize)]) -> Vec<mooncake_core::Result<usize>> {
    let mut memories: Vec<Result<DeviceScatter, Error>> = Vec::with_capacity(plans.len());
    for (plan, tail) in plans {
        memories.push(device_scatter(plan, *tail));
    }
    let items: Vec<(&str, &dyn DeviceMemory, u64)> = plans
        .iter()
        .zip(&memories)
        .filter_map(|((p, _), m)| m.as_ref().ok().map(|m| (p.key, m as &dyn DeviceMemory, 0)))
        .collect();
    let mut read = store.batch_get_into_devices(&items).into_iter();
    memories.iter().map(|m| m.as_ref().map_err(Clone::clone).and_then(|_| read.next().expect("one per item"))).collect()
}

/// The parts `plan` is read into, as one memory: its ranges' destinations in the
/// order of their offsets in the object, host scratch for the gaps and `tail`.
fn device_scatter(plan: &Plan<'_>, tail: usize) -> Result<DeviceScatter, Error> {
    let refused = |_| Error::InvalidArgument("a range of get_into_ranges cannot be read into".into());
    let scratch_len = plan.scratch_len(tail);
    let scratch: Option<Arc<dyn DeviceMemory>> = match scratch_len {
        0 => None,
        n => Some(Arc::new(HostDeviceMemory::new(n as u64).map_err(Error::from)?)),
    };
    let mut parts: Vec<(Arc<dyn DeviceMemory>, u64, u64)> = Vec::with_capacity(2 * plan.ranges.len() + 1);
    let (mut at, mut used) = (0usize, 0u64);
    let mut gap = |parts: &mut Vec<(Arc<dyn DeviceMemory>, u64, u64)>, n: usize| {
        if let (Some(s), true) = (&scratch, n > 0) {
            parts.push((s.clone(), used, n as u64));
            used += n as u64;
        }
    };
    for r in &plan.ranges {
        gap(&mut parts, r.src - at);
        match &r.dst {
            Dst::Device(mem, offset) => parts.push((mem.clone(), *offset, r.len as u64)),
            Dst::Host(dst) => parts.push((host_part(*dst, r.len).map_err(refused)?, 0, r.len as u64)),
        }
        at = r.src + r.len;
    }
    gap(&mut parts, tail);
    DeviceScatter::new(parts).map_err(Error::from)
}
