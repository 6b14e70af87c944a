//! The tensor methods of `MooncakeDistributedStore` (their Python wrappers are in
//! `store.rs`): writes of numpy arrays and torch tensors, whole or as tensor-parallel
//! shards, reads into new tensors or views of registered buffers.

use std::sync::Arc;

use mooncake_core::gpu::{DeviceMemory, DeviceScatter, HostDeviceMemory, KeepCurrentContext, MemoryLocation};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::codes::INVALID_PARAMS;
use crate::config::ReplicateConfig;
use crate::device::{host_part, Target};
use crate::store::{read_device, write_device, MooncakeDistributedStore, WriteMode};
use crate::tensor::{self, device_error, tp_key, Input, Meta, Refusal, META_LEN};

/// How a write splits its tensors: into `size` shards on dimension `dim`
/// (`size <= 1`: whole).
#[derive(Clone, Copy)]
pub struct Split {
    /// Number of shards (the reference's `tp_size`).
    pub size: i32,
    /// Dimension split (the reference's `split_dim`).
    pub dim: i32,
}

impl Split {
    /// Whole tensors.
    pub const NONE: Split = Split { size: 1, dim: 0 };
}

/// The elements of one object to write.
enum Data {
    /// Ranges `(address, length)` of memory the caller keeps alive: a tensor's
    /// elements, or a registered buffer.
    Borrowed(Vec<(usize, usize)>),
    /// A copy (the shards of a split along an inner dimension are not contiguous).
    Owned(Vec<u8>),
}

/// A tensor object found in a buffer given by address.
struct BufferObject {
    meta: Meta,
    /// Its header, in memory of the call's own.
    header: [u8; META_LEN],
    /// The buffer's device memory, if it is some (`None`: registered host memory).
    device: Option<Arc<dyn DeviceMemory>>,
}

/// One object to write: the key's index in the call, its key, header and elements.
struct Write {
    of: usize,
    key: String,
    header: [u8; META_LEN],
    data: Data,
    /// Whether `data`'s ranges are CUDA device memory (always `Borrowed`).
    on_device: bool,
}

/// The most shards `put_tensor_with_tp` and its forms split a tensor into (more is
/// refused with -600).
const MAX_TP_SIZE: i32 = 4096;

/// The objects of `meta`'s tensor (elements at `base`, in device memory if
/// `on_device`), whole (`tp_size <= 1`) or as `tp_size` shards split on `split_dim`
/// under `key_tp_<rank>`; `None` if it cannot be split so.
fn plan(of: usize, key: &str, meta: &Meta, base: usize, split: Split, on_device: bool) -> Option<Vec<Write>> {
    let (tp_size, split_dim) = (split.size, split.dim);
    if tp_size <= 1 {
        let data = if meta.data_bytes == 0 { vec![] } else { vec![(base, meta.data_bytes)] };
        let header = meta.encode();
        return Some(vec![Write { of, key: key.to_owned(), header, data: Data::Borrowed(data), on_device }]);
    }
    // Checked before anything is reserved for `tp_size` shards: a size that does
    // not divide the dimension is refused, and so is one beyond any tensor-parallel
    // group (an empty dimension is divided by every size).
    if tp_size > MAX_TP_SIZE {
        return None;
    }
    meta.shard(split_dim, 0, tp_size)?;
    let mut out = Vec::with_capacity(tp_size as usize);
    for rank in 0..tp_size {
        let (shard, ranges) = meta.shard(split_dim, rank, tp_size)?;
        // Device memory is never read on the host: a shard's rows stay ranges of it,
        // moved by device copies (one scatter), where host rows are gathered here.
        let data = if ranges.len() <= 1 || on_device {
            Data::Borrowed(ranges.iter().map(|&(off, len)| (base + off, len)).collect())
        } else {
            let mut v = Vec::with_capacity(shard.data_bytes);
            for &(off, len) in &ranges {
                // SAFETY: each range lies inside the tensor's `data_bytes` bytes at
                // `base` (Meta::shard computes them from its shape), kept alive by the
                // caller.
                v.extend_from_slice(unsafe { std::slice::from_raw_parts((base + off) as *const u8, len) });
            }
            Data::Owned(v)
        };
        out.push(Write { of, key: tp_key(key, rank), header: shard.encode(), data, on_device });
    }
    Some(out)
}

/// Writes the plans' objects of host memory in one batch (with the GIL released) and
/// folds the codes per key into `results` (a key whose plan failed keeps the code
/// already there).
fn write_planned(
    store: &mooncake_core::Store,
    mode: WriteMode,
    writes: &[&Write],
    cfg: &mooncake_core::ReplicateConfig,
    mut results: Vec<i32>,
) -> Vec<i32> {
    if writes.is_empty() {
        return results;
    }
    let parts: Vec<Vec<&[u8]>> = writes
        .iter()
        .map(|w| {
            let mut p: Vec<&[u8]> = vec![&w.header];
            match &w.data {
                Data::Borrowed(ranges) => {
                    for &(ptr, len) in ranges {
                        // SAFETY: the ranges are a tensor's elements (kept alive by the
                        // caller) or a checked registered buffer, registered until the
                        // call is done (the caller holds the in-flight gate).
                        p.push(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) });
                    }
                }
                Data::Owned(v) => p.push(v),
            }
            p
        })
        .collect();
    let items: Vec<(&str, &[&[u8]])> = writes.iter().zip(&parts).map(|(w, p)| (w.key.as_str(), p.as_slice())).collect();
    for (w, c) in writes.iter().zip(mode.parts(store, &items, cfg)) {
        note_code(&mut results, w.of, c);
    }
    results
}

/// Folds an object's code into its key's: a key's code is the first failure of its
/// objects (a tensor's shards), else 0.
fn note_code(results: &mut [i32], of: usize, code: i32) {
    if code != 0 && results[of] == 0 {
        results[of] = code;
    }
}

impl MooncakeDistributedStore {
    /// Writes the plans' objects (those of host tensors in one batch, those of CUDA
    /// tensors in another, through the store's device calls) and folds the codes per
    /// key of the call (`n` keys; a key whose plan failed keeps the code already in
    /// `results`).
    fn run_writes(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        writes: &[Write],
        config: Option<&ReplicateConfig>,
        results: Vec<i32>,
    ) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; results.len()] };
        let cfg = match s.write_config(config, results.len()) {
            Ok(c) => c,
            Err(c) => return vec![c; results.len()],
        };
        if !writes.iter().any(|w| w.on_device) {
            return py.detach(|| write_planned(&s.store, mode, &writes.iter().collect::<Vec<_>>(), &cfg, results));
        }
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            self.write_all(&s.store, mode, writes, &cfg, results)
        })
    }

    /// Writes the planned objects, those in device memory through the store's device
    /// calls, the others in one batch from host memory, and folds the codes per key.
    /// The caller holds the in-flight gate, and keeps the thread's CUDA context.
    fn write_all(
        &self,
        store: &mooncake_core::Store,
        mode: WriteMode,
        writes: &[Write],
        cfg: &mooncake_core::ReplicateConfig,
        results: Vec<i32>,
    ) -> Vec<i32> {
        let (on_device, in_host): (Vec<&Write>, Vec<&Write>) = writes.iter().partition(|w| w.on_device);
        let results = if on_device.is_empty() {
            results
        } else {
            self.write_device_tensors(store, mode, &on_device, cfg, results)
        };
        write_planned(store, mode, &in_host, cfg, results)
    }

    /// Writes the objects of CUDA tensors, each its host header and its device ranges
    /// seen as one device memory (a scatter), through the store's device calls; folds
    /// the codes into `results` (-600 for a range the CUDA driver does not know as
    /// device memory). The caller holds the in-flight gate.
    fn write_device_tensors(
        &self,
        store: &mooncake_core::Store,
        mode: WriteMode,
        writes: &[&Write],
        cfg: &mooncake_core::ReplicateConfig,
        mut results: Vec<i32>,
    ) -> Vec<i32> {
        // The headers, in memory of this call's own that the copies read.
        let mut headers: Vec<[u8; META_LEN]> = writes.iter().map(|w| w.header).collect();
        let mut items: Vec<(&str, Arc<dyn DeviceMemory>)> = Vec::with_capacity(writes.len());
        let mut owners = Vec::with_capacity(writes.len());
        for (w, header) in writes.iter().zip(headers.iter_mut()) {
            let Data::Borrowed(ranges) = &w.data else {
                results[w.of] = INVALID_PARAMS;
                continue;
            };
            match self.device_object(header, ranges) {
                Ok(mem) => {
                    items.push((w.key.as_str(), Arc::new(mem)));
                    owners.push(w.of);
                }
                Err(c) => note_code(&mut results, w.of, c),
            }
        }
        for (of, c) in owners.into_iter().zip(write_device(mode, store, &items, cfg)) {
            note_code(&mut results, of, c);
        }
        drop(items);
        drop(headers);
        results
    }

    /// Writes `tensors[i]` under `keys[i]` (numpy arrays or CPU torch tensors), whole
    /// or as `tp_size` shards; one code per key (-600 for what is not a tensor, or a
    /// split the shape does not allow). A tensor on a device raises `ValueError`.
    pub(crate) fn write_tensors(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        keys: &[String],
        tensors: &[Bound<'_, PyAny>],
        config: Option<&ReplicateConfig>,
        split: Split,
    ) -> PyResult<Vec<i32>> {
        let n = keys.len();
        if self.session().is_none() || tensors.len() != n {
            return Ok(vec![INVALID_PARAMS; n]);
        }
        let mut results = vec![0; n];
        let mut inputs: Vec<Input<'_>> = Vec::with_capacity(n);
        let mut writes = Vec::new();
        for (i, (key, t)) in keys.iter().zip(tensors).enumerate() {
            match tensor::input(t) {
                Ok(input) => {
                    match plan(i, key, &input.meta, input.ptr, split, input.on_device) {
                        Some(w) => writes.extend(w),
                        None => results[i] = INVALID_PARAMS,
                    }
                    inputs.push(input);
                }
                Err(Refusal::Invalid) => results[i] = INVALID_PARAMS,
                Err(Refusal::Device(d)) => return Err(device_error(&d)),
            }
        }
        // `inputs` keep the tensors (or their contiguous copies) alive until here.
        let out = self.run_writes(py, mode, &writes, config, results);
        drop(inputs);
        Ok(out)
    }

    /// One object of a CUDA tensor as one device memory: `header` (host memory of the
    /// caller's, read or written by the call's copies only) then the elements'
    /// `ranges` (in order, within one device allocation: the whole tensor, or a
    /// shard's rows), resolved once for the span they cover. -600 if the span is not
    /// device memory the driver knows.
    fn device_object(&self, header: &mut [u8; META_LEN], ranges: &[(usize, usize)]) -> Result<DeviceScatter, i32> {
        // SAFETY: the caller keeps `header` alive and untouched until the transfer of
        // the object (a write reading it, or a read filling it) is done.
        let head = unsafe { HostDeviceMemory::borrowed(header.as_mut_ptr(), META_LEN) }.map_err(|_| INVALID_PARAMS)?;
        let mut parts: Vec<(Arc<dyn DeviceMemory>, u64, u64)> = vec![(Arc::new(head), 0, META_LEN as u64)];
        let start = ranges.iter().map(|&(p, _)| p).min();
        if let (Some(start), Some(end)) = (start, ranges.iter().map(|&(p, l)| p.saturating_add(l)).max()) {
            let span = end.checked_sub(start).ok_or(INVALID_PARAMS)?;
            let mem = match self.devices.resolve(self.buffers(), start, span)? {
                Target::Device(mem) => mem,
                Target::Host => host_part(start, span)?,
            };
            for &(ptr, len) in ranges {
                let off = ptr.checked_sub(start).ok_or(INVALID_PARAMS)?;
                parts.push((mem.clone(), off as u64, len as u64));
            }
        }
        DeviceScatter::new(parts).map_err(|_| INVALID_PARAMS)
    }

    /// Writes the tensor objects at `buffer_ptrs[i]` (registered memory holding a
    /// header and its elements, `sizes[i]` bytes) under `keys[i]`, whole or as
    /// shards. Whole: any bad buffer makes every code -600 (the reference's rule);
    /// split: only that key's.
    pub(crate) fn write_tensors_from(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        keys: &[String],
        buffer_ptrs: &[usize],
        sizes: &[usize],
        split: Split,
    ) -> Vec<i32> {
        let n = keys.len();
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; n] };
        if buffer_ptrs.len() != n || sizes.len() != n {
            return vec![INVALID_PARAMS; n];
        }
        let cfg = match s.write_config(None, n) {
            Ok(c) => c,
            Err(c) => return vec![c; n],
        };
        // Device copies (of buffers in GPU memory) bind their memory's CUDA context:
        // give the framework's back.
        let _ctx = KeepCurrentContext::new();
        // One release of the GIL from the buffers' check to the end of the write:
        // they stay registered (and so allocated) while the call is in flight.
        py.detach(|| {
            let _call = self.pointer_call();
            self.write_buffers(mode, keys, buffer_ptrs, sizes, split, &s.store, &cfg)
        })
    }

    /// `write_tensors_from`'s work, with the GIL released and the in-flight gate held.
    #[allow(clippy::too_many_arguments)]
    fn write_buffers(
        &self,
        mode: WriteMode,
        keys: &[String],
        buffer_ptrs: &[usize],
        sizes: &[usize],
        split: Split,
        store: &mooncake_core::Store,
        cfg: &mooncake_core::ReplicateConfig,
    ) -> Vec<i32> {
        let n = keys.len();
        let mut results = vec![0; n];
        let mut writes = Vec::new();
        for i in 0..n {
            let planned = self.buffer_object(buffer_ptrs[i], sizes[i]).and_then(|object| {
                let on_device = object.device.is_some();
                if split.size <= 1 {
                    // As stored: the buffer is the object.
                    let rest = sizes[i] - META_LEN;
                    let data = if rest == 0 { vec![] } else { vec![(buffer_ptrs[i] + META_LEN, rest)] };
                    Some(vec![Write {
                        of: i,
                        key: keys[i].clone(),
                        header: object.header,
                        data: Data::Borrowed(data),
                        on_device,
                    }])
                } else {
                    let m = &object.meta;
                    plan(i, &keys[i], m, buffer_ptrs[i] + m.data_offset, split, on_device)
                }
            });
            match planned {
                Some(w) => writes.extend(w),
                None if split.size <= 1 => return vec![INVALID_PARAMS; n],
                None => results[i] = INVALID_PARAMS,
            }
        }
        self.write_all(store, mode, &writes, cfg, results)
    }

    /// The tensor object in the buffer `[ptr, ptr + size)` (registered host memory,
    /// or device memory: see `device.rs`), if it holds a whole one: its header is
    /// read in place from host memory, by a device copy from device memory. The
    /// caller keeps the buffer registered until it is done with it: it holds the
    /// in-flight gate, or the GIL throughout (`unregister_buffer` cannot return to
    /// its caller, who would free the buffer, meanwhile).
    fn buffer_object(&self, ptr: usize, size: usize) -> Option<BufferObject> {
        if size < META_LEN {
            return None;
        }
        let mut header = [0u8; META_LEN];
        let device = match self.devices.resolve(self.buffers(), ptr, size).ok()? {
            Target::Host => {
                // SAFETY: `[ptr, ptr + size)` lies inside a registered host buffer
                // (`resolve` checked it), and `size >= META_LEN`.
                header.copy_from_slice(unsafe { std::slice::from_raw_parts(ptr as *const u8, META_LEN) });
                None
            }
            Target::Device(mem) => {
                mem.copy_to_host(0, &mut header).ok()?;
                Some(mem)
            }
        };
        let meta = Meta::parse(&header, size)?;
        Some(BufferObject { meta, header, device })
    }

    /// Reads the tensor objects under `keys[i]` into the tensors `tensors[i]` (contiguous
    /// torch tensors on a CUDA GPU, or on the CPU inside a registered buffer), whose
    /// dtype and shape must be the stored tensor's: one result per key, the bytes of
    /// elements read, or a negative code (-600 for a destination that is not such a
    /// tensor or does not match what is stored, -704 for a missing key). Device
    /// destinations are written by the store's device calls, never on the host. An
    /// object is read in one call, its header into memory of this call's and its
    /// elements straight into the tensor, and the header checked then: a stored tensor
    /// of another dtype or shape gives -600, and where it is not larger than the
    /// destination its elements were written into it (the reference reads the header
    /// first and leaves the tensor as it was).
    pub(crate) fn read_tensors_into_cuda(
        &self,
        py: Python<'_>,
        keys: &[String],
        tensors: &[Bound<'_, PyAny>],
    ) -> PyResult<Vec<i64>> {
        let n = keys.len();
        let bad = i64::from(INVALID_PARAMS);
        let Some(s) = self.session() else { return Ok(vec![bad; n]) };
        if tensors.len() != n {
            return Ok(vec![bad; n]);
        }
        let mut results = vec![bad; n];
        let mut wanted: Vec<(usize, Input<'_>)> = Vec::with_capacity(n);
        for (i, t) in tensors.iter().enumerate() {
            match tensor::destination(t) {
                Ok(input) => wanted.push((i, input)),
                Err(Refusal::Invalid) => {}
                Err(Refusal::Device(d)) => return Err(device_error(&d)),
            }
        }
        // What the read needs of each destination (`wanted` keeps the tensors alive).
        let dests: Vec<(usize, usize, &Meta)> = wanted.iter().map(|(i, input)| (*i, input.ptr, &input.meta)).collect();
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            let mut headers: Vec<[u8; META_LEN]> = vec![[0; META_LEN]; dests.len()];
            let mut reads: Vec<(usize, Arc<dyn DeviceMemory>)> = Vec::with_capacity(dests.len());
            let mut of_read = Vec::with_capacity(dests.len());
            for (k, (&(i, ptr, meta), header)) in dests.iter().zip(headers.iter_mut()).enumerate() {
                let data = if meta.data_bytes == 0 { vec![] } else { vec![(ptr, meta.data_bytes)] };
                if let Ok(mem) = self.device_object(header, &data) {
                    reads.push((i, Arc::new(mem)));
                    of_read.push(k);
                }
            }
            let mut lengths = vec![bad; n];
            read_device(&s.store, keys, &reads, &mut lengths);
            drop(reads);
            for k in of_read {
                let (i, _, want) = dests[k];
                let len = lengths[i];
                results[i] = match usize::try_from(len) {
                    Err(_) => len,
                    Ok(len) => match Meta::parse(&headers[k], len) {
                        Some(m)
                            if m.data_offset == META_LEN
                                && m.dtype == want.dtype
                                && m.local == want.local
                                && m.data_bytes == want.data_bytes =>
                        {
                            m.data_bytes as i64
                        }
                        _ => bad,
                    },
                };
            }
        });
        drop(wanted);
        Ok(results)
    }

    /// New tensors holding the objects under `keys` (`None` for a missing key or an
    /// object that is not a tensor).
    pub(crate) fn read_tensors<'py>(
        &self,
        py: Python<'py>,
        keys: &[String],
    ) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
        let Some(s) = self.session() else { return Ok(keys.iter().map(|_| None).collect()) };
        let found = py.detach(|| {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            s.store.batch_get(&keys)
        });
        found
            .into_iter()
            .map(|r| match r {
                Ok(data) => tensor::from_object(py, &data),
                Err(_) => Ok(None),
            })
            .collect()
    }

    /// Reads `keys[i]` into the registered buffer at `buffer_ptrs[i]` and returns a
    /// tensor over its elements there (a view, not a copy), or `None`. Bad arguments
    /// (not set up, lists of different lengths, a null pointer) give a list of -600,
    /// as the reference's does.
    pub(crate) fn read_tensors_into<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        let n = keys.len();
        if self.session().is_none() || buffer_ptrs.len() != n || sizes.len() != n || buffer_ptrs.contains(&0) {
            return PyList::new(py, vec![INVALID_PARAMS; n]);
        }
        // The headers of objects read into device memory are read back by device
        // copies, which bind the memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        let lengths = self.batch_get_into(py, keys, buffer_ptrs.clone(), sizes);
        let out = PyList::empty(py);
        for (i, len) in lengths.into_iter().enumerate() {
            let object = usize::try_from(len).ok().and_then(|len| self.buffer_object(buffer_ptrs[i], len));
            let view = match object {
                None => None,
                Some(BufferObject { meta, device, .. }) => {
                    let elements = buffer_ptrs[i] + meta.data_offset;
                    match device.map(|mem| mem.location()) {
                        // Host memory, or the host memory that emulates a device.
                        None | Some(MemoryLocation::Emulated) => Some(tensor::view(py, &meta, elements)?),
                        Some(MemoryLocation::Cuda { ordinal }) => {
                            Some(tensor::device_view(py, &meta, elements, ordinal)?)
                        }
                    }
                }
            };
            match view {
                Some(t) => out.append(t)?,
                None => out.append(py.None())?,
            }
        }
        Ok(out)
    }
}
