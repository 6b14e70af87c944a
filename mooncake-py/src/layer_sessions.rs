//! Get and put sessions: objects read or written a slice at a time, one call per
//! model layer. SGLang's direct linker loads that way (`batch_get_session_start`,
//! `batch_get_into_multi_buffer_ranges` once per layer, `batch_get_session_end`), and
//! vLLM's Mooncake store connector saves and loads layer by layer when a store has all
//! seven session calls (`batch_put_session_start`, `batch_put_from_multi_buffer_ranges`,
//! `batch_put_session_end`, `batch_put_session_revoke` too).
//!
//! The reference reserves the objects (or looks their replicas up) at the start and
//! moves each slice straight to or from a replica, unchecked. A slice cannot be checked
//! alone here (an object's crc32c covers all of it), and moving the whole object for
//! every layer's slice would move it once per layer. So sessions keep whole objects in
//! host memory: a get session's start reads each object whole, once (its checksum
//! checked as every read's), and its ranged calls copy slices out of it; a put session
//! gathers the slices its ranged calls copy in, and its end puts each object whole
//! (summed as every put), in one batch. No byte goes unchecked, and each object
//! crosses the network once. The price: a load's first layer waits for the whole
//! objects, a save's bytes move at its end, and the objects stay in host memory while
//! their session is open.
//!
//! Sessions are per key and per client. A get session started again replaces its
//! bytes (the object may have changed); a put session started twice is `-600`, as in
//! the reference, and so are ranged calls on a key without a session, a slice outside
//! the object, or a pointer that is neither registered host memory nor GPU memory.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use mooncake_core::gpu::DeviceMemory;
use mooncake_core::{BufferRegistry, Error, ReplicateConfig, Store};
use parking_lot::Mutex;

use crate::codes::{code, put_status, INVALID_PARAMS};
use crate::device::DevicePointers;

/// The objects of the open get sessions, by key.
#[derive(Default)]
pub struct GetSessions {
    objects: Mutex<HashMap<String, Bytes>>,
}

/// The objects of the open put sessions, by key.
#[derive(Default)]
pub struct PutSessions {
    objects: Mutex<HashMap<String, PutObject>>,
}

/// One object of a put session: its bytes as its slices came (zeros where none
/// came yet), and the replication its start asked for (shared by the keys of one
/// start, which end in one batch).
struct PutObject {
    bytes: Vec<u8>,
    cfg: Arc<ReplicateConfig>,
}

/// Caller memory one slice is copied to or from.
enum Place {
    /// Registered host memory at this address, with room for the slice.
    Host(usize),
    /// Device memory, from its start, with room for the slice.
    Device(Arc<dyn DeviceMemory>),
}

impl Place {
    /// The memory at `ptr` if `len` bytes from it are registered host memory or GPU
    /// memory.
    fn of(host: &BufferRegistry, devices: &DevicePointers, ptr: usize, len: usize) -> Option<Place> {
        match host.capacity(ptr) {
            Some(room) if room >= len => Some(Place::Host(ptr)),
            Some(_) => None,
            None => Some(Place::Device(devices.range_from(ptr).filter(|m| m.len() >= len as u64)?)),
        }
    }
}

/// The slices one key's ranged call asks for: `(caller memory, offset in the object,
/// length)`, each checked to lie in the object (`object_len`) and in its caller
/// memory; `None` when one does not, or when the lists' lengths differ.
fn slices_of(
    host: &BufferRegistry,
    devices: &DevicePointers,
    object_len: usize,
    ptrs: &[usize],
    sizes: &[usize],
    offsets: &[usize],
) -> Option<Vec<(Place, usize, usize)>> {
    if ptrs.len() != sizes.len() || offsets.len() != sizes.len() {
        return None;
    }
    (0..sizes.len())
        .map(|j| {
            let end = offsets[j].checked_add(sizes[j])?;
            (end <= object_len).then_some(())?;
            Some((Place::of(host, devices, ptrs[j], sizes[j])?, offsets[j], sizes[j]))
        })
        .collect()
}

/// `len` zero bytes, or `None` when that much memory cannot be had (a refusal, never
/// an abort of the process).
fn zeroed(len: usize) -> Option<Vec<u8>> {
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len).ok()?;
    bytes.resize(len, 0);
    Some(bytes)
}

/// Whether the three per-key lists of a ranged call have one entry per key.
fn lists_match(keys: usize, ptrs: usize, sizes: usize, offsets: usize) -> bool {
    ptrs == keys && sizes == keys && offsets == keys
}

impl GetSessions {
    /// Reads `keys` whole (one batch) and keeps their bytes: one code per key, 0 or
    /// why its object cannot be read (`-704` when there is none).
    pub fn start(&self, store: &Store, keys: &[String]) -> Vec<i32> {
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let read = store.batch_get(&refs);
        let mut objects = self.objects.lock();
        keys.iter()
            .zip(read)
            .map(|(key, res)| match res {
                Ok(bytes) => {
                    objects.insert(key.clone(), bytes);
                    0
                }
                Err(e) => {
                    objects.remove(key);
                    code(&e)
                }
            })
            .collect()
    }

    /// Forgets the sessions of `keys`.
    pub fn end(&self, keys: &[String]) {
        let mut objects = self.objects.lock();
        for key in keys {
            objects.remove(key);
        }
    }

    /// Copies, for each key `i` and each of its slices `j`, the `sizes[i][j]` bytes at
    /// `src_offsets[i][j]` of the object into `ptrs[i][j]` (registered host memory or
    /// GPU memory). One answer per key: the bytes copied (the sum of its sizes), or a
    /// negative code, its slices then partly copied at most.
    pub fn read_ranges(
        &self,
        host: &BufferRegistry,
        devices: &DevicePointers,
        keys: &[String],
        ptrs: &[Vec<usize>],
        sizes: &[Vec<usize>],
        src_offsets: &[Vec<usize>],
    ) -> Vec<i64> {
        let mut results = vec![i64::from(INVALID_PARAMS); keys.len()];
        if !lists_match(keys.len(), ptrs.len(), sizes.len(), src_offsets.len()) {
            return results;
        }
        // Clones of the objects (shared bytes): the map is not held while they move.
        let objects: Vec<Option<Bytes>> = {
            let sessions = self.objects.lock();
            keys.iter().map(|k| sessions.get(k).cloned()).collect()
        };
        for (i, object) in objects.iter().enumerate() {
            let Some(object) = object else { continue };
            let Some(slices) = slices_of(host, devices, object.len(), &ptrs[i], &sizes[i], &src_offsets[i]) else {
                continue;
            };
            results[i] = match copy_out(object, &slices) {
                Ok(()) => sizes[i].iter().sum::<usize>() as i64,
                Err(c) => i64::from(c),
            };
        }
        results
    }
}

impl PutSessions {
    /// Opens a put session per key, for an object of `sizes[i]` bytes placed with
    /// `cfg` at its end. One code per key: 0; `-600` for a session already open or a
    /// size that no object can have; `-705` for a key that exists already (as the
    /// reference's master answers a put of it).
    pub fn start(&self, store: &Store, keys: &[String], sizes: &[usize], cfg: ReplicateConfig) -> Vec<i32> {
        if keys.len() != sizes.len() {
            return vec![INVALID_PARAMS; keys.len()];
        }
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let exists = store.batch_exists(&refs);
        let cfg = Arc::new(cfg);
        let mut objects = self.objects.lock();
        keys.iter()
            .zip(sizes)
            .zip(exists)
            .map(|((key, &size), exists)| {
                if objects.contains_key(key) || size == 0 || size as u64 > mooncake_core::MAX_VALUE_LEN {
                    return INVALID_PARAMS;
                }
                match exists {
                    Ok(false) => match zeroed(size) {
                        Some(bytes) => {
                            objects.insert(key.clone(), PutObject { bytes, cfg: cfg.clone() });
                            0
                        }
                        None => code(&Error::NoSpace {
                            needed: size as u64,
                            largest_free: 0,
                            reason: "no host memory for the session's object".into(),
                        }),
                    },
                    Ok(true) => code(&Error::AlreadyExists(key.clone())),
                    Err(e) => code(&e),
                }
            })
            .collect()
    }

    /// Copies, for each key `i` and each of its slices `j`, the `sizes[i][j]` bytes at
    /// `ptrs[i][j]` (registered host memory or GPU memory) to `dst_offsets[i][j]` of
    /// the session's object. One answer per key: the bytes copied (the sum of its
    /// sizes), or a negative code.
    pub fn write_ranges(
        &self,
        host: &BufferRegistry,
        devices: &DevicePointers,
        keys: &[String],
        ptrs: &[Vec<usize>],
        sizes: &[Vec<usize>],
        dst_offsets: &[Vec<usize>],
    ) -> Vec<i64> {
        let mut results = vec![i64::from(INVALID_PARAMS); keys.len()];
        if !lists_match(keys.len(), ptrs.len(), sizes.len(), dst_offsets.len()) {
            return results;
        }
        // Held while the slices move: they are written into the sessions' objects.
        let mut objects = self.objects.lock();
        for (i, key) in keys.iter().enumerate() {
            let Some(object) = objects.get_mut(key) else { continue };
            let Some(slices) = slices_of(host, devices, object.bytes.len(), &ptrs[i], &sizes[i], &dst_offsets[i])
            else {
                continue;
            };
            results[i] = match copy_in(&mut object.bytes, &slices) {
                Ok(()) => sizes[i].iter().sum::<usize>() as i64,
                Err(c) => i64::from(c),
            };
        }
        results
    }

    /// Puts the objects of `keys`' sessions (one batch per start they came from) and
    /// closes the sessions. One code per key: 0, `-600` for a key without a
    /// session, or why its put failed.
    pub fn end(&self, store: &Store, keys: &[String]) -> Vec<i32> {
        let mut taken: Vec<(usize, PutObject)> = {
            let mut objects = self.objects.lock();
            keys.iter().enumerate().filter_map(|(i, k)| objects.remove(k).map(|o| (i, o))).collect()
        };
        let mut results = vec![INVALID_PARAMS; keys.len()];
        // The keys of one start share its configuration: each such group is one batch.
        while let Some((_, first)) = taken.first() {
            let cfg = first.cfg.clone();
            let (group, rest): (Vec<_>, Vec<_>) = taken.into_iter().partition(|(_, o)| Arc::ptr_eq(&o.cfg, &cfg));
            let items: Vec<(&str, &[u8])> =
                group.iter().map(|(i, o)| (keys[*i].as_str(), o.bytes.as_slice())).collect();
            for ((i, _), res) in group.iter().zip(store.batch_put(&items, &cfg)) {
                results[*i] = put_status(&res);
            }
            taken = rest;
        }
        results
    }

    /// Closes the sessions of `keys`, nothing put. One code per key: 0, or `-600`
    /// for a key without a session.
    pub fn revoke(&self, keys: &[String]) -> Vec<i32> {
        let mut objects = self.objects.lock();
        keys.iter().map(|k| if objects.remove(k).is_some() { 0 } else { INVALID_PARAMS }).collect()
    }
}

/// The code of a device copy that failed.
fn device_code(e: mooncake_core::gpu::GpuError) -> i32 {
    code(&Error::from(e))
}

/// Copies each slice `(place, offset, len)` of `object` to its place: host slices at
/// once, device slices on one copy stream of their memory each, waited for before
/// this returns.
fn copy_out(object: &[u8], slices: &[(Place, usize, usize)]) -> Result<(), i32> {
    let mut streams = Vec::new();
    for (place, offset, len) in slices {
        let bytes = &object[*offset..*offset + *len];
        match place {
            // SAFETY: `at` starts a registered buffer's range with room for the slice
            // (checked in `Place::of`, under the in-flight gate that keeps the buffer
            // registered, so allocated); the session's bytes never alias a caller's
            // buffer.
            Place::Host(at) => unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *at as *mut u8, bytes.len()) },
            Place::Device(mem) => {
                let mut stream = mem.open_stream().map_err(device_code)?;
                // SAFETY: `bytes` are the session's immutable bytes, alive (the
                // caller holds them) until every stream was synchronized below, or
                // dropped on an error (which waits for its copies).
                unsafe { stream.copy_to_device_async(bytes.as_ptr(), bytes.len(), 0) }.map_err(device_code)?;
                streams.push(stream);
            }
        }
    }
    for mut stream in streams {
        stream.synchronize().map_err(device_code)?;
    }
    Ok(())
}

/// Copies each slice `(place, offset, len)` from its place into `object`, as
/// [`copy_out`] copies the other way.
fn copy_in(object: &mut [u8], slices: &[(Place, usize, usize)]) -> Result<(), i32> {
    let base = object.as_mut_ptr();
    let mut streams = Vec::new();
    for (place, offset, len) in slices {
        // SAFETY: `offset + len <= object.len()` (checked in `slices_of`).
        let into = unsafe { base.add(*offset) };
        match place {
            // SAFETY: `at` starts a registered buffer's range with room for the slice,
            // as in `copy_out`; `into` has room for it in the session's object, which
            // no caller's buffer aliases.
            Place::Host(at) => unsafe { std::ptr::copy_nonoverlapping(*at as *const u8, into, *len) },
            Place::Device(mem) => {
                let mut stream = mem.open_stream().map_err(device_code)?;
                // SAFETY: `into` has room for the slice in the session's object, which
                // the caller holds (under the sessions' lock) and nothing else touches
                // until every stream was synchronized below, or dropped on an error.
                unsafe { stream.copy_from_device_async(into, *len, 0) }.map_err(device_code)?;
                streams.push(stream);
            }
        }
    }
    for mut stream in streams {
        stream.synchronize().map_err(device_code)?;
    }
    Ok(())
}
