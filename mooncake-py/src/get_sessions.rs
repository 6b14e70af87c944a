//! Get sessions: `batch_get_session_start`, `batch_get_into_multi_buffer_ranges`,
//! `batch_get_session_end`. SGLang's layer-wise loads (its direct linker) start a
//! session over a batch of objects, read one slice of each object per layer (one
//! call per layer, into GPU memory), then end it.
//!
//! The reference queries the replicas once at the start and reads each slice straight
//! from a replica, unchecked. A slice cannot be checked alone (an object's crc32c
//! covers all of it), and reading the whole object for every layer's slice would move
//! it once per layer. So here the start reads each object whole, once (one batch, its
//! checksum checked as every read's) into host memory kept until the session ends,
//! and each ranged call copies slices of it: no byte a ranged call writes went
//! unchecked, and an object's bytes cross the network once. The price is that the
//! first layer waits for the whole objects (they are read at the start), and the
//! objects stay in host memory while their session is open.
//!
//! A session is per key and per client: a key started again replaces its bytes (the
//! object may have changed); a ranged read of a key without one, or of a range past
//! the object's end, is `-600`, as in the reference.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use mooncake_core::gpu::DeviceMemory;
use mooncake_core::{BufferRegistry, Error, Store};
use parking_lot::Mutex;

use crate::codes::{code, INVALID_PARAMS};
use crate::device::DevicePointers;

/// The objects of the open get sessions, by key.
#[derive(Default)]
pub struct GetSessions {
    objects: Mutex<HashMap<String, Bytes>>,
}

/// Where one slice goes.
enum Dest {
    /// Registered host memory at this address, with room for the slice.
    Host(usize),
    /// Device memory, from its start.
    Device(Arc<dyn DeviceMemory>),
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
        let bad = vec![i64::from(INVALID_PARAMS); keys.len()];
        if ptrs.len() != keys.len() || sizes.len() != keys.len() || src_offsets.len() != keys.len() {
            return bad;
        }
        // The objects, each slice checked against it and its destination, before any
        // byte moves.
        let objects: Vec<Option<Bytes>> = {
            let sessions = self.objects.lock();
            keys.iter().map(|k| sessions.get(k).cloned()).collect()
        };
        let mut results = bad;
        for (i, object) in objects.iter().enumerate() {
            let Some(object) = object else { continue };
            let (p, n, o) = (&ptrs[i], &sizes[i], &src_offsets[i]);
            if p.len() != n.len() || o.len() != n.len() {
                continue;
            }
            let slices: Option<Vec<(Dest, &[u8])>> = (0..n.len())
                .map(|j| {
                    let bytes = object.get(o[j]..o[j].checked_add(n[j])?)?;
                    let into = match host.capacity(p[j]) {
                        Some(room) if room >= n[j] => Dest::Host(p[j]),
                        Some(_) => return None,
                        None => Dest::Device(devices.range_from(p[j]).filter(|m| m.len() >= n[j] as u64)?),
                    };
                    Some((into, bytes))
                })
                .collect();
            let Some(slices) = slices else { continue };
            results[i] = match copy_slices(&slices) {
                Ok(()) => n.iter().sum::<usize>() as i64,
                Err(c) => i64::from(c),
            };
        }
        results
    }
}

/// Copies each slice to its destination: host slices at once, device slices enqueued
/// on one stream of their memory each, then waited for.
fn copy_slices(slices: &[(Dest, &[u8])]) -> Result<(), i32> {
    let mut streams = Vec::new();
    for (into, bytes) in slices {
        match into {
            // SAFETY: `at` starts a registered buffer's range with room for the
            // slice (checked by the caller, under the in-flight gate that keeps the
            // buffer registered, so allocated); the slice is the session's own bytes,
            // which never alias a caller's buffer.
            Dest::Host(at) => unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *at as *mut u8, bytes.len()) },
            Dest::Device(mem) => {
                let mut stream = mem.open_stream().map_err(|e| code(&Error::from(e)))?;
                // SAFETY: the slice is immutable session bytes, kept alive by the
                // caller's clone of the object until this function returns, after
                // every stream was synchronized (or dropped, which waits).
                unsafe { stream.copy_to_device_async(bytes.as_ptr(), bytes.len(), 0) }
                    .map_err(|e| code(&Error::from(e)))?;
                streams.push(stream);
            }
        }
    }
    for mut stream in streams {
        stream.synchronize().map_err(|e| code(&Error::from(e)))?;
    }
    Ok(())
}
