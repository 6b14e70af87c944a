//! `MooncakeDistributedStore`: the reference's Python class over a [`Store`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use mooncake_core::gpu::{DeviceMemory, KeepCurrentContext};
use mooncake_core::{BufferRegistry, Error, Store};
use parking_lot::{RwLock, RwLockReadGuard};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyInt, PyList, PyString, PyTuple};

use std::collections::HashMap;

use crate::codes::{self, code, put_status, status, INVALID_PARAMS};
use crate::config::ReplicateConfig;
use crate::device::{DevicePointers, Target};
use crate::handle::buffer_handle;
use crate::ranges::{self, Dst, Range};
use crate::replicas::{self, ReplicaDescriptor};
use crate::session::Session;
use crate::setup::{SetupArgs, SetupError};
use crate::tasks::{self, QueryTaskResponse};
use crate::tensor;
use crate::tensor_api::Split;

/// How long a forced remove waits for readers' leases to run out. The engine never
/// frees memory a reader may still be copying from, so `force` waits out the lease
/// (the master's lease TTL, 5 s by default) instead of skipping it.
const FORCE_DEADLINE: Duration = Duration::from_secs(30);
/// Poll period of a forced remove.
const FORCE_POLL: Duration = Duration::from_millis(10);

/// Which write a zero-copy call makes.
#[derive(Clone, Copy)]
pub enum WriteMode {
    /// A put: a key that exists keeps its value (code 0, as in the reference).
    Put,
    /// An upsert: the value replaces the stored one.
    Upsert,
}

impl WriteMode {
    /// The code of one write's result.
    fn code(self, res: &mooncake_core::Result<()>) -> i32 {
        match self {
            WriteMode::Put => put_status(res),
            WriteMode::Upsert => status(res),
        }
    }

    /// Writes `data` under `key` (a single put retries on a failed segment).
    fn one(self, store: &Store, key: &str, data: &[u8], cfg: &mooncake_core::ReplicateConfig) -> i32 {
        self.code(&match self {
            WriteMode::Put => store.put_with(key, data, cfg),
            WriteMode::Upsert => store.upsert_with(key, data, cfg),
        })
    }

    /// Writes each object of `items` (the concatenation of its parts) in one batch;
    /// one code each.
    pub fn parts(self, store: &Store, items: &[(&str, &[&[u8]])], cfg: &mooncake_core::ReplicateConfig) -> Vec<i32> {
        let results = match self {
            WriteMode::Put => store.batch_put_parts(items, cfg),
            WriteMode::Upsert => store.batch_upsert_parts(items, cfg),
        };
        results.iter().map(|r| self.code(r)).collect()
    }

    /// Writes `items` in one batch; one code each.
    fn many(self, store: &Store, items: &[(&str, &[u8])], cfg: &mooncake_core::ReplicateConfig) -> Vec<i32> {
        let results = match self {
            WriteMode::Put => store.batch_put(items, cfg),
            WriteMode::Upsert => store.batch_upsert(items, cfg),
        };
        results.iter().map(|r| self.code(r)).collect()
    }
}

/// A Mooncake Store client, with the reference's methods, arguments and return codes.
///
/// Every method returns `0` or a negative code where the reference does (`-704` not
/// found, `-706` leased, `-600` bad arguments or not set up, ...). The
/// GIL is released while the engine works. Raw pointers (`put_from`, `get_into`,
/// ...) must lie inside a buffer given to `register_buffer`; anything else is refused
/// with `-600`.
///
/// GPU memory (a CUDA tensor's `data_ptr()`, registered or not) is recognised by
/// asking the CUDA driver, and moved with device copies, never dereferenced on the
/// host: see `device.rs`.
///
/// `unregister_buffer` and `close` return only once no pointer call is in flight
/// (on any thread, any buffer): a buffer may be freed as soon as they return.
#[pyclass(name = "MooncakeDistributedStore", module = "mooncake_rs.store", frozen, subclass)]
pub struct MooncakeDistributedStore {
    session: RwLock<Option<Arc<Session>>>,
    buffers: BufferRegistry,
    pub(crate) devices: DevicePointers,
    /// The in-flight gate: held shared by each pointer call from the check of its
    /// pointers to its last touch of the memory (all with the GIL released), and
    /// exclusively by `unregister_buffer` and `close` while they forget buffers, so
    /// that they return only after the calls that may still use one are done (and
    /// calls arriving meanwhile wait for them: parking_lot's lock is fair).
    in_flight: RwLock<()>,
}

/// A value given by Python: `bytes` are read in place; other buffer-protocol objects
/// are copied into `bytes` first (the stable ABI this wheel is built for has no
/// buffer protocol before Python 3.11).
fn value_bytes<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.clone());
    }
    if obj.is_instance_of::<PyInt>() || obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err("value must be a bytes-like object"));
    }
    if let Ok(b) = obj.cast::<PyByteArray>() {
        return Ok(PyBytes::new(obj.py(), &b.to_vec()));
    }
    obj.py().get_type::<PyBytes>().call1((obj,))?.cast_into::<PyBytes>().map_err(Into::into)
}

/// A read's answer as the reference gives it: the object's length, or a negative code
/// (`BufferTooSmall` is `-600`, as there).
fn length_or_code(res: &mooncake_core::Result<usize>) -> i64 {
    match res {
        Ok(n) => *n as i64,
        Err(e) => code(e).into(),
    }
}

/// Writes objects whose bytes are in device memory (one `DeviceMemory` each, the
/// whole of it), as puts or upserts, through the store's device forms: one batch,
/// one master round trip per phase; one code each.
pub(crate) fn write_device(
    mode: WriteMode,
    store: &Store,
    items: &[(&str, Arc<dyn DeviceMemory>)],
    cfg: &mooncake_core::ReplicateConfig,
) -> Vec<i32> {
    let ranges: Vec<(&str, &dyn DeviceMemory, u64, u64)> = items.iter().map(|(k, m)| (*k, &**m, 0, m.len())).collect();
    let results = match mode {
        WriteMode::Put => store.batch_put_from_devices(&ranges, cfg),
        WriteMode::Upsert => store.batch_upsert_from_devices(&ranges, cfg),
    };
    // The mode's code, as for host memory: an upsert that gave up on a key another
    // write holds wrote nothing, and says so (-705); only a put takes "exists" as done.
    results.iter().map(|r| mode.code(r)).collect()
}

/// Reads `keys[i]` into device memory `mem` for each `(i, mem)` of `on_device`, in
/// one batch (one master round trip), and puts each length or code in `results[i]`.
pub(crate) fn read_device<M: std::ops::Deref<Target = dyn DeviceMemory>>(
    store: &Store,
    keys: &[String],
    on_device: &[(usize, M)],
    results: &mut [i64],
) {
    if on_device.is_empty() {
        return;
    }
    let items: Vec<(&str, &dyn DeviceMemory, u64)> =
        on_device.iter().map(|(i, mem)| (keys[*i].as_str(), &**mem, 0)).collect();
    for ((i, _), res) in on_device.iter().zip(store.batch_get_into_devices(&items)) {
        results[*i] = length_or_code(&res);
    }
}

/// Copies `data` to the raw address `dst`.
///
/// # Safety
/// `[dst, dst + data.len())` must be writable memory (a registered buffer).
unsafe fn copy_out(data: &[u8], dst: usize) {
    // SAFETY: the caller checked the destination against a registered region; the
    // source is engine-owned memory, so the two cannot overlap.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst as *mut u8, data.len()) };
}

impl MooncakeDistributedStore {
    /// The connected client, if `setup` succeeded and `close` was not called.
    pub fn session(&self) -> Option<Arc<Session>> {
        self.session.read().clone()
    }

    /// The registered buffers.
    pub fn buffers(&self) -> &BufferRegistry {
        &self.buffers
    }

    /// Marks a pointer call in flight until the guard drops: take it with the GIL
    /// released, before checking the pointers, and hold it until the memory is no
    /// longer touched. Fair: a call that arrives while `unregister_buffer` or
    /// `close` waits queues behind it, so calls that always overlap one another
    /// cannot keep them waiting. Never taken twice on one thread (no pointer call
    /// makes another: each runs engine calls only, with no Python in between), so
    /// queueing cannot deadlock; its exclusive holder never needs the GIL.
    pub(crate) fn pointer_call(&self) -> RwLockReadGuard<'_, ()> {
        self.in_flight.read()
    }

    /// Runs `forget` (removing registered buffers) once no pointer call is in flight,
    /// and with none starting meanwhile; the GIL is released while it waits.
    fn forget_buffers<T: Send>(&self, py: Python<'_>, forget: impl FnOnce() -> T + Send) -> T {
        py.detach(|| {
            let _no_call = self.in_flight.write();
            forget()
        })
    }

    /// The session and the store config a write of one key needs, or the code to
    /// return: not set up, or a bad `config`.
    fn writer(
        &self,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Result<(Arc<Session>, mooncake_core::ReplicateConfig), i32> {
        let s = self.session().ok_or(INVALID_PARAMS)?;
        let cfg = s.write_config(config.as_deref(), 1)?;
        Ok((s, cfg))
    }

    /// Lengths of two argument lists agree.
    fn same_len(a: usize, b: usize, c: usize) -> bool {
        a == b && b == c
    }

    /// Removes `key`; with `force`, waits for readers' leases to run out.
    fn remove_one(store: &Store, key: &str, force: bool) -> i32 {
        let deadline = Instant::now() + FORCE_DEADLINE;
        loop {
            match store.remove(key) {
                Err(Error::HasLease(_)) if force && Instant::now() < deadline => std::thread::sleep(FORCE_POLL),
                res => return status(&res),
            }
        }
    }

    /// Removes every key of `keys`, one result each; with `force`, retries the leased
    /// ones until their leases run out.
    fn remove_many(store: &Store, keys: &[&str], force: bool) -> Vec<i32> {
        let deadline = Instant::now() + FORCE_DEADLINE;
        let mut results = vec![0; keys.len()];
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        loop {
            let batch: Vec<&str> = pending.iter().map(|&i| keys[i]).collect();
            let answers = store.batch_remove(&batch);
            let mut leased = Vec::new();
            for (&i, res) in pending.iter().zip(&answers) {
                results[i] = status(res);
                if matches!(res, Err(Error::HasLease(_))) {
                    leased.push(i);
                }
            }
            if !force || leased.is_empty() || Instant::now() >= deadline {
                return results;
            }
            pending = leased;
            std::thread::sleep(FORCE_POLL);
        }
    }

    /// Writes the `sizes[i]` bytes at `buffer_ptrs[i]` (registered memory) under
    /// `keys[i]` in one batch, as puts or upserts; one code each.
    fn write_from(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        let n = keys.len();
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; n] };
        if !Self::same_len(n, buffer_ptrs.len(), sizes.len()) {
            return vec![INVALID_PARAMS; n];
        }
        let cfg = match s.write_config(config.as_deref(), n) {
            Ok(c) => c,
            Err(c) => return vec![c; n],
        };
        let mut results = vec![0; n];
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            let mut valid = Vec::with_capacity(n);
            let mut on_device = Vec::new();
            for i in 0..n {
                match self.devices.resolve(&self.buffers, buffer_ptrs[i], sizes[i]) {
                    Ok(Target::Host) => valid.push(i),
                    Ok(Target::Device(mem)) => on_device.push((i, mem)),
                    Err(c) => results[i] = c,
                }
            }
            if !on_device.is_empty() {
                let items: Vec<(&str, Arc<dyn DeviceMemory>)> =
                    on_device.iter().map(|(i, m)| (keys[*i].as_str(), m.clone())).collect();
                for ((i, _), c) in on_device.iter().zip(write_device(mode, &s.store, &items, &cfg)) {
                    results[*i] = c;
                }
            }
            let items: Vec<(&str, &[u8])> = valid
                .iter()
                .map(|&i| {
                    // SAFETY: each range was checked against a registered region;
                    // shared slices may overlap.
                    let data = unsafe { std::slice::from_raw_parts(buffer_ptrs[i] as *const u8, sizes[i]) };
                    (keys[i].as_str(), data)
                })
                .collect();
            let answers = mode.many(&s.store, &items, &cfg);
            for (&i, c) in valid.iter().zip(answers) {
                results[i] = c;
            }
        });
        results
    }

    /// `put` and `upsert`: one bytes-like value.
    fn write_value(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        let value = value_bytes(value)?;
        let (s, cfg) = match self.writer(config) {
            Ok(w) => w,
            Err(code) => return Ok(code),
        };
        let data = value.as_bytes();
        Ok(py.detach(|| mode.one(&s.store, key, data, &cfg)))
    }

    /// `put_parts` and `upsert_parts`: one object from several bytes-like parts.
    fn write_parts(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        key: &str,
        parts: &Bound<'_, PyTuple>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        let parts: Vec<Bound<'_, PyBytes>> = parts.iter().map(|p| value_bytes(&p)).collect::<PyResult<_>>()?;
        let (s, cfg) = match self.writer(config) {
            Ok(w) => w,
            Err(code) => return Ok(code),
        };
        let slices: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
        Ok(py.detach(|| mode.parts(&s.store, &[(key, &slices)], &cfg).pop().unwrap_or(0)))
    }

    /// `put_batch` and `upsert_batch`: 0, or the first failure's code.
    fn write_batch(
        &self,
        py: Python<'_>,
        mode: WriteMode,
        keys: Vec<String>,
        values: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        let values: Vec<Bound<'_, PyBytes>> = values.iter().map(value_bytes).collect::<PyResult<_>>()?;
        let Some(s) = self.session() else { return Ok(INVALID_PARAMS) };
        if keys.len() != values.len() {
            return Ok(INVALID_PARAMS);
        }
        let cfg = match s.write_config(config.as_deref(), keys.len()) {
            Ok(c) => c,
            Err(c) => return Ok(c),
        };
        let items: Vec<(&str, &[u8])> =
            keys.iter().map(String::as_str).zip(values.iter().map(|v| v.as_bytes())).collect();
        let codes = py.detach(|| mode.many(&s.store, &items, &cfg));
        Ok(codes.into_iter().find(|&c| c != 0).unwrap_or(0))
    }
}

#[pymethods]
impl MooncakeDistributedStore {
    /// A store that is not connected yet: call `setup`.
    #[new]
    fn new() -> Self {
        Self {
            session: RwLock::new(None),
            buffers: BufferRegistry::default(),
            devices: DevicePointers::default(),
            in_flight: RwLock::new(()),
        }
    }

    /// Connects to the master and gives `global_segment_size` bytes to the pool.
    ///
    /// `setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
    /// protocol, rdma_devices, master_server_addr, engine=None, enable_ssd_offload=False,
    /// ssd_offload_path="", tenant_id="default", enable_client_http_server=False,
    /// client_http_port=9300)`, or `setup(config_dict)` with sizes such as `"16 MB"`.
    /// The metadata server, RDMA devices, engine and HTTP server are accepted and not
    /// needed; a `tenant_id` other than `"default"` is a `TypeError` naming it (one
    /// namespace of keys: tenants would share it); with an engine handed over, the port of `local_hostname` is
    /// the engine's, so this client serves its segment on another port of that host.
    /// `enable_ssd_offload` without `ssd_offload_path` puts the SSD tier where the
    /// reference does: `$MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`, else
    /// `/data/file_storage`. Returns 0 or a negative code.
    #[pyo3(signature = (*args, **kwargs))]
    fn setup(&self, py: Python<'_>, args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<i32> {
        let parsed = match SetupArgs::parse(args, kwargs) {
            Ok(p) => p,
            // Like the reference's binding: an argument it does not know is a
            // TypeError (frameworks retry without the keywords a build lacks).
            Err(SetupError::Type(why)) => return Err(PyTypeError::new_err(why)),
            Err(SetupError::Code(c)) => return Ok(c),
        };
        let builder = match parsed.builder() {
            Ok(b) => b,
            Err(c) => return Ok(c),
        };
        let old = self.session.write().take();
        Ok(py.detach(move || {
            drop(old);
            match builder.build() {
                Ok(store) => {
                    let hostname = parsed.hostname(store.endpoint());
                    let local = store.segment_name().ok().flatten().into_iter().collect();
                    *self.session.write() = Some(Arc::new(Session::new(store, hostname, local)));
                    0
                }
                Err(e) => code(&e),
            }
        }))
    }

    /// Attaches to a storage process on this host (the reference's "dummy client"):
    /// `server_address` is where it serves its segment (`mooncake-client serve
    /// --listen`). This client gives no memory to the pool; it reaches the storage
    /// process's segment through shared memory (mapping it) and other segments over
    /// TCP, and `prefer_alloc_in_same_node` places objects there. The master is the
    /// storage process's, which it publishes on this host (see `mooncake-client
    /// serve`), or `$MOONCAKE_MASTER`. `mem_pool_size` and `local_buffer_size` are
    /// checked and not needed: this process copies between its own buffers and the
    /// mapped segment itself. Returns 0, -900 if nothing listens at
    /// `server_address`, -101 if no segment is served there, -600 for bad arguments.
    #[pyo3(signature = (mem_pool_size, local_buffer_size, server_address))]
    fn setup_dummy(&self, py: Python<'_>, mem_pool_size: u64, local_buffer_size: u64, server_address: &str) -> i32 {
        let _ = (mem_pool_size, local_buffer_size);
        let old = self.session.write().take();
        let server = server_address.to_owned();
        py.detach(move || {
            drop(old);
            match crate::dummy::attach(&server) {
                Ok(session) => {
                    *self.session.write() = Some(Arc::new(session));
                    0
                }
                Err(c) => c,
            }
        })
    }

    /// Disconnects: this client's segment leaves the pool (with the objects on it) and
    /// its registered buffers are forgotten, once the pointer calls in flight on other
    /// threads are done (their buffers may be freed when it returns). Returns 0.
    fn close(&self, py: Python<'_>) -> i32 {
        let old = self.forget_buffers(py, || {
            let old = self.session.write().take();
            self.buffers.clear();
            self.devices.clear();
            old
        });
        py.detach(move || drop(old));
        0
    }

    /// 0 when connected and the master answers, 1 when not set up or closed, 2 when the
    /// master does not answer.
    fn health_check(&self, py: Python<'_>) -> i32 {
        let Some(s) = self.session() else { return codes::NOT_INITIALIZED };
        py.detach(move || match s.store.master().stats() {
            Ok(_) => codes::HEALTHY,
            Err(_) => codes::MASTER_UNREACHABLE,
        })
    }

    /// Page-locks, now, this client's segment (and the same-host peers' segments its
    /// GPU calls have mapped) for DMA to and from GPU memory, and returns the bytes
    /// page-locked (0 before `setup`, without a segment, or where the segment is
    /// reached over the network: protocol `tcp`). Without it, a GPU call page-locks
    /// the 64 MiB pieces it moves objects through, the first time it does; a server
    /// that would rather pay it at setup calls this after registering its GPU
    /// buffers. Not in the reference (which registers its whole segment at setup).
    fn page_lock_segments(&self, py: Python<'_>) -> u64 {
        let Some(s) = self.session() else { return 0 };
        py.detach(|| s.store.page_lock_segments())
    }

    /// `host:port` this client serves its segment on ("" before `setup`).
    fn get_hostname(&self) -> String {
        self.session().map(|s| s.hostname.clone()).unwrap_or_default()
    }

    /// Stores `value` (a bytes-like object) under `key`. Returns 0 or a negative code.
    /// Objects are immutable: a put of a key that exists returns 0 and keeps the value
    /// stored first, as the reference does; every put form behaves so.
    #[pyo3(signature = (key, value, config = None))]
    fn put(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.write_value(py, WriteMode::Put, key, value, config)
    }

    /// Stores the concatenation of `parts` under `key`. Returns 0 or a negative code.
    #[pyo3(signature = (key, *parts, config = None))]
    fn put_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyTuple>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.write_parts(py, WriteMode::Put, key, parts, config)
    }

    /// Stores `values[i]` under `keys[i]` in one batch. Returns 0, or the first
    /// failure's code.
    #[pyo3(signature = (keys, values, config = None))]
    fn put_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.write_batch(py, WriteMode::Put, keys, values, config)
    }

    /// Stores `value` (a bytes-like object) under `key`, replacing the object stored
    /// there if any. The replacement is atomic: a reader gets the old or the new
    /// bytes, never a mix, and never "not found" for a key that existed throughout.
    /// Returns 0 or a negative code.
    #[pyo3(signature = (key, value, config = None))]
    fn upsert(
        &self,
        py: Python<'_>,
        key: &str,
        value: &Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.write_value(py, WriteMode::Upsert, key, value, config)
    }

    /// Upserts the concatenation of `parts` under `key`. Returns 0 or a negative code.
    #[pyo3(signature = (key, *parts, config = None))]
    fn upsert_parts(
        &self,
        py: Python<'_>,
        key: &str,
        parts: &Bound<'_, PyTuple>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.write_parts(py, WriteMode::Upsert, key, parts, config)
    }

    /// Upserts `values[i]` under `keys[i]` in one batch. Returns 0, or the first
    /// failure's code.
    #[pyo3(signature = (keys, values, config = None))]
    fn upsert_batch(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        values: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        self.write_batch(py, WriteMode::Upsert, keys, values, config)
    }

    /// Upserts the `size` bytes at `buffer_ptr` (inside a registered buffer) under
    /// `key`, without a copy. Returns 0 or a negative code.
    #[pyo3(signature = (key, buffer_ptr, size, config = None))]
    fn upsert_from(
        &self,
        py: Python<'_>,
        key: &str,
        buffer_ptr: usize,
        size: usize,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i32 {
        self.batch_upsert_from(py, vec![key.to_owned()], vec![buffer_ptr], vec![size], config).pop().unwrap_or(0)
    }

    /// Upserts the `sizes[i]` bytes at `buffer_ptrs[i]` under `keys[i]`, in one batch
    /// and without copies. One code per key.
    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None))]
    fn batch_upsert_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        self.write_from(py, WriteMode::Upsert, keys, buffer_ptrs, sizes, config)
    }

    /// The bytes under `key`; `b""` when absent or on error.
    fn get<'py>(&self, py: Python<'py>, key: &str) -> Bound<'py, PyBytes> {
        let data = match self.session() {
            Some(s) => py.detach(|| s.store.get(key).unwrap_or_default()),
            None => Bytes::new(),
        };
        PyBytes::new(py, &data)
    }

    /// The bytes under each key; `b""` for the absent ones.
    fn get_batch<'py>(&self, py: Python<'py>, keys: Vec<String>) -> Vec<Bound<'py, PyBytes>> {
        let found = match self.session() {
            Some(s) => py.detach(|| {
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                s.store.batch_get(&keys).into_iter().map(|r| r.unwrap_or_default()).collect()
            }),
            None => vec![Bytes::new(); keys.len()],
        };
        found.iter().map(|b| PyBytes::new(py, b)).collect()
    }

    /// The object under `key` as a `BufferHandle` (a `bytes` with `ptr()` and
    /// `size()`, and the buffer protocol: `memoryview(h)`, `torch.frombuffer(h)`), or
    /// `None`.
    fn get_buffer<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        let Some(s) = self.session() else { return Ok(None) };
        match py.detach(|| s.store.get(key).ok()) {
            Some(data) => buffer_handle(py, &data).map(Some),
            None => Ok(None),
        }
    }

    /// One `BufferHandle` (or `None`) per key.
    fn batch_get_buffer<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
        let Some(s) = self.session() else { return Ok(keys.iter().map(|_| None).collect()) };
        let found = py.detach(|| {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            s.store.batch_get(&keys)
        });
        found.into_iter().map(|r| r.ok().map(|d| buffer_handle(py, &d)).transpose()).collect()
    }

    /// Declares `[buffer_ptr, buffer_ptr + size)` as memory the zero-copy calls may
    /// read and write: host memory, or GPU memory (the driver says which; a GPU range
    /// must lie inside one device allocation). Returns 0 or -600.
    fn register_buffer(&self, py: Python<'_>, buffer_ptr: usize, size: usize) -> i32 {
        if self.session().is_none() || size == 0 {
            return INVALID_PARAMS;
        }
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        if let Some(c) = py.detach(|| self.devices.register(buffer_ptr, size)) {
            return c;
        }
        status(&self.buffers.register(buffer_ptr, size))
    }

    /// Forgets the buffer registered at `buffer_ptr`. Returns 0, or -600 if none is.
    /// It returns once the pointer calls in flight on other threads (on any buffer)
    /// are done, so the buffer may be freed as soon as it returns.
    fn unregister_buffer(&self, py: Python<'_>, buffer_ptr: usize) -> i32 {
        if self.session().is_none() {
            return INVALID_PARAMS;
        }
        self.forget_buffers(py, || {
            if self.devices.unregister(buffer_ptr) {
                return 0;
            }
            status(&self.buffers.unregister(buffer_ptr))
        })
    }

    /// Test hook (machines without a GPU): from now on this store treats the host
    /// memory `[buffer_ptr, buffer_ptr + size)` as memory of GPU `ordinal`, and only
    /// declared ranges as GPU memory (the CUDA driver is no longer asked). Its bytes
    /// are then moved only by the store's device API, as a GPU's would be. The range
    /// must stay valid until the store is closed. Returns 0, or -600 (empty, or
    /// overlapping a range declared before).
    #[pyo3(signature = (buffer_ptr, size, ordinal = 0))]
    fn _emulate_device_memory(&self, buffer_ptr: usize, size: usize, ordinal: usize) -> i32 {
        // SAFETY: the caller (a test) keeps the range valid while the store lives
        // and does not touch it during calls, as documented.
        unsafe { self.devices.emulate(buffer_ptr, size, ordinal) }
    }

    /// Test hook (machines without a GPU): switches this store to the emulation (as
    /// `_emulate_device_memory`) and makes its "CUDA driver" fail to answer for the
    /// addresses `[buffer_ptr, buffer_ptr + size)`, as a real driver may (no usable
    /// context on the thread). Returns 0, or -600 for an empty or wrapping range.
    fn _emulate_failed_pointer_query(&self, buffer_ptr: usize, size: usize) -> i32 {
        self.devices.emulate_failed_query(buffer_ptr, size)
    }

    /// Test hook: the store's device byte counters, `(direct, staged)`: bytes moved
    /// between GPU memory and the pool straight, or through pinned staging.
    fn _device_bytes(&self) -> (u64, u64) {
        self.session()
            .map(|s| {
                let st = s.store.stats();
                (st.device_direct_bytes, st.device_staged_bytes)
            })
            .unwrap_or((0, 0))
    }

    /// Stores the `size` bytes at `buffer_ptr` (inside a registered buffer) under
    /// `key`, without a copy. Returns 0 or a negative code.
    #[pyo3(signature = (key, buffer_ptr, size, config = None))]
    fn put_from(
        &self,
        py: Python<'_>,
        key: &str,
        buffer_ptr: usize,
        size: usize,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> i32 {
        let Some(s) = self.session() else { return INVALID_PARAMS };
        let cfg = match s.write_config(config.as_deref(), 1) {
            Ok(c) => c,
            Err(c) => return c,
        };
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        // One release of the GIL for the pointer's check and the put (as `get_into`).
        py.detach(|| {
            let _call = self.pointer_call();
            match self.devices.resolve(&self.buffers, buffer_ptr, size) {
                Err(c) => c,
                Ok(Target::Device(mem)) => put_status(&s.store.put_from_device_with(key, &*mem, 0, size as u64, &cfg)),
                Ok(Target::Host) => {
                    // SAFETY: `resolve` found `[buffer_ptr, buffer_ptr + size)` inside a
                    // region Python registered as valid host memory, which stays
                    // registered while the call is in flight (`pointer_call`).
                    let data = unsafe { std::slice::from_raw_parts(buffer_ptr as *const u8, size) };
                    put_status(&s.store.put_with(key, data, &cfg))
                }
            }
        })
    }

    /// Reads the object under `key` into the registered memory at `buffer_ptr` (room:
    /// `size` bytes). Returns its length, or a negative code (-600 if it does not fit).
    fn get_into(&self, py: Python<'_>, key: &str, buffer_ptr: usize, size: usize) -> i64 {
        let Some(s) = self.session() else { return INVALID_PARAMS.into() };
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            match self.devices.resolve(&self.buffers, buffer_ptr, size) {
                Err(c) => c.into(),
                Ok(Target::Device(mem)) => length_or_code(&s.store.get_into_device(key, &*mem, 0)),
                Ok(Target::Host) => {
                    // SAFETY: `resolve` found the range inside a registered host region
                    // (registered until the call is done: `pointer_call`); nothing else
                    // in this process holds a Rust reference to it.
                    let buf = unsafe { std::slice::from_raw_parts_mut(buffer_ptr as *mut u8, size) };
                    length_or_code(&s.store.get_into(key, buf))
                }
            }
        })
    }

    /// Reads byte ranges of objects into registered buffers: for buffer `i` and its
    /// key `j`, range `k` copies `all_sizes[i][j][k]` bytes from offset
    /// `all_src_offsets[i][j][k]` of the object to offset `all_dst_offsets[i][j][k]` of
    /// the buffer. Returns, in the same shape, the bytes copied or a negative code.
    fn get_into_ranges(
        &self,
        py: Python<'_>,
        buffer_ptrs: Vec<usize>,
        all_keys: Vec<Vec<String>>,
        all_dst_offsets: Vec<Vec<Vec<usize>>>,
        all_src_offsets: Vec<Vec<Vec<usize>>>,
        all_sizes: Vec<Vec<Vec<usize>>>,
    ) -> Vec<Vec<Vec<i64>>> {
        // The answer has the shape of the keys and destination offsets, also when the
        // other lists do not match them.
        let mut results: Vec<Vec<Vec<i64>>> = all_keys
            .iter()
            .enumerate()
            .map(|(i, keys)| {
                (0..keys.len())
                    .map(|j| {
                        let n = all_dst_offsets.get(i).and_then(|d| d.get(j)).map_or(0, Vec::len);
                        vec![i64::from(INVALID_PARAMS); n]
                    })
                    .collect()
            })
            .collect();
        let Some(s) = self.session() else { return results };
        let n = buffer_ptrs.len();
        if ![all_keys.len(), all_dst_offsets.len(), all_src_offsets.len(), all_sizes.len()].iter().all(|&l| l == n) {
            return results;
        }
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        // One release of the GIL from the buffers' check to the last copy into them:
        // they stay registered (and so allocated) while the call is in flight.
        py.detach(|| {
            let _call = self.pointer_call();
            let host_caps: Vec<Option<usize>> = buffer_ptrs.iter().map(|&p| self.buffers.capacity(p)).collect();
            // Buffers in GPU memory: the device memory from their address on.
            let device_bufs: Vec<Option<Arc<dyn DeviceMemory>>> = buffer_ptrs
                .iter()
                .zip(&host_caps)
                .map(|(&p, cap)| if cap.is_none() { self.devices.range_from(p) } else { None })
                .collect();
            let capacities: Vec<Option<usize>> = host_caps
                .iter()
                .zip(&device_bufs)
                .map(|(cap, dev)| cap.or_else(|| dev.as_ref().map(|m| m.len() as usize)))
                .collect();
            // The ranges that can be served (inside their buffer, non-empty); the others
            // keep -600. Keys whose lists do not have matching lengths are read only to
            // report a missing object.
            let mut ranges: BTreeMap<&str, Vec<Range>> = BTreeMap::new();
            let mut occurrences: Vec<(usize, usize, &str)> = Vec::new();
            for (i, keys) in all_keys.iter().enumerate() {
                for (j, key) in keys.iter().enumerate() {
                    let (dst, src, len) = (all_dst_offsets[i].get(j), all_src_offsets[i].get(j), all_sizes[i].get(j));
                    let (Some(dst), Some(src), Some(len)) = (dst, src, len) else { continue };
                    if src.len() != dst.len() || len.len() != dst.len() {
                        continue;
                    }
                    occurrences.push((i, j, key.as_str()));
                    for k in 0..dst.len() {
                        let (d, sr, l) = (dst[k], src[k], len[k]);
                        let fits_dst = capacities[i].is_some_and(|cap| d.checked_add(l).is_some_and(|end| end <= cap));
                        // No object reaches past MAX_VALUE_LEN: a range beyond it could
                        // only ask for scratch memory no read will fill.
                        let in_object = sr.checked_add(l).is_some_and(|end| end as u64 <= mooncake_core::MAX_VALUE_LEN);
                        if l == 0 || !fits_dst || !in_object {
                            continue;
                        }
                        let dst = match &device_bufs[i] {
                            Some(mem) => Dst::Device(mem.clone(), d as u64),
                            None => Dst::Host(buffer_ptrs[i] + d),
                        };
                        let r = Range { at: (i, j, k), dst, src: sr, len: l };
                        ranges.entry(key.as_str()).or_default().push(r);
                    }
                }
            }
            let mut unique: Vec<&str> = all_keys.iter().flatten().map(String::as_str).collect();
            unique.sort_unstable();
            unique.dedup();
            let answers = ranges::read(&s.store, &unique, &ranges);
            for ((i, j, k), v) in answers.ranges {
                results[i][j][k] = v;
            }
            for (i, j, key) in occurrences {
                if let Some(&c) = answers.failed.get(key) {
                    results[i][j].iter_mut().for_each(|r| *r = c);
                }
            }
            results
        })
    }

    /// Starts a get session over `keys` (SGLang's layer-wise loads): each object is
    /// read whole, once, its checksum checked, and kept until
    /// [`batch_get_session_end`](Self::batch_get_session_end), so that
    /// `batch_get_into_multi_buffer_ranges` copies its slices without another read.
    /// One code per key: 0, `-704` for a missing object, or why it cannot be read.
    fn batch_get_session_start(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; keys.len()] };
        py.detach(|| s.get_sessions.start(&s.store, &keys))
    }

    /// Copies slices of the objects of started get sessions: for key `i`, the
    /// `all_sizes[i][j]` bytes at `all_src_offsets[i][j]` of its object into
    /// `all_buffer_ptrs[i][j]` (registered host memory, or GPU memory). One answer per
    /// key: the bytes copied (the sum of its sizes), or `-600` for a key with no
    /// session, a slice past the object's end or a destination that is neither.
    fn batch_get_into_multi_buffer_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        all_src_offsets: Vec<Vec<usize>>,
    ) -> Vec<i64> {
        let Some(s) = self.session() else { return vec![i64::from(INVALID_PARAMS); keys.len()] };
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            s.get_sessions.read_ranges(
                &self.buffers,
                &self.devices,
                &keys,
                &all_buffer_ptrs,
                &all_sizes,
                &all_src_offsets,
            )
        })
    }

    /// Ends the get sessions of `keys`: their objects' bytes are let go. Returns 0.
    fn batch_get_session_end(&self, keys: Vec<String>) -> i32 {
        if let Some(s) = self.session() {
            s.get_sessions.end(&keys);
        }
        0
    }

    /// Starts a put session per key (vLLM's layer-wise saves): an object of
    /// `sizes[i]` bytes whose slices `batch_put_from_multi_buffer_ranges` gathers, put
    /// whole (with `config`) by `batch_put_session_end`. One code per key: 0, `-705`
    /// for a key that exists, `-600` for a session already open or a bad size, `-200`
    /// when there is no host memory to gather the object in.
    #[pyo3(signature = (keys, sizes, config = None))]
    fn batch_put_session_start(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; keys.len()] };
        let cfg = match s.write_config(config.as_deref(), keys.len()) {
            Ok(cfg) => cfg,
            Err(c) => return vec![c; keys.len()],
        };
        py.detach(|| s.put_sessions.start(&s.store, &keys, &sizes, cfg))
    }

    /// Copies slices into the objects of started put sessions: for key `i`, the
    /// `all_sizes[i][j]` bytes at `all_buffer_ptrs[i][j]` (registered host memory, or
    /// GPU memory) to `all_dst_offsets[i][j]` of its object. One answer per key: the
    /// bytes copied, or `-600` for a key with no session, a slice past the object's
    /// end or a source that is neither.
    fn batch_put_from_multi_buffer_ranges(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        all_dst_offsets: Vec<Vec<usize>>,
    ) -> Vec<i64> {
        let Some(s) = self.session() else { return vec![i64::from(INVALID_PARAMS); keys.len()] };
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            s.put_sessions.write_ranges(
                &self.buffers,
                &self.devices,
                &keys,
                &all_buffer_ptrs,
                &all_sizes,
                &all_dst_offsets,
            )
        })
    }

    /// Puts the objects of `keys`' put sessions (in one batch per start) and closes
    /// the sessions. One code per key: 0, `-600` for a key without a session, or why
    /// its put failed.
    fn batch_put_session_end(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; keys.len()] };
        py.detach(|| s.put_sessions.end(&s.store, &keys))
    }

    /// Closes the put sessions of `keys` without putting anything. One code per key:
    /// 0, or `-600` for a key without a session.
    fn batch_put_session_revoke(&self, keys: Vec<String>) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; keys.len()] };
        s.put_sessions.revoke(&keys)
    }

    /// Stores the `sizes[i]` bytes at `buffer_ptrs[i]` under `keys[i]`, in one batch
    /// and without copies. One code per key.
    #[pyo3(signature = (keys, buffer_ptrs, sizes, config = None))]
    fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        self.write_from(py, WriteMode::Put, keys, buffer_ptrs, sizes, config)
    }

    /// Reads `keys[i]` into the registered memory at `buffer_ptrs[i]` (room:
    /// `sizes[i]`). One result per key: the object's length or a negative code.
    pub(crate) fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> Vec<i64> {
        let n = keys.len();
        let bad = vec![i64::from(INVALID_PARAMS); n];
        let Some(s) = self.session() else { return bad };
        if !Self::same_len(n, buffer_ptrs.len(), sizes.len()) {
            return bad;
        }
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            let mut results = bad.clone();
            let mut wanted = Vec::with_capacity(n);
            let mut on_device = Vec::new();
            for i in 0..n {
                match self.devices.resolve(&self.buffers, buffer_ptrs[i], sizes[i]) {
                    Ok(Target::Host) => wanted.push(i),
                    // GPU memory, its room the caller's size.
                    Ok(Target::Device(mem)) => on_device.push((i, mem)),
                    Err(c) => results[i] = c.into(),
                }
            }
            read_device(&s.store, &keys, &on_device, &mut results);
            let direct = BufferRegistry::disjoint(wanted.iter().map(|&i| (buffer_ptrs[i], sizes[i])).collect());
            let keys: Vec<&str> = wanted.iter().map(|&i| keys[i].as_str()).collect();
            let found: Vec<i64> = if direct {
                let mut bufs: Vec<&mut [u8]> = wanted
                    .iter()
                    // SAFETY: each range lies inside a registered region (checked
                    // above) and no two of them overlap (`disjoint`), so the slices
                    // do not alias; Python promised the memory stays valid.
                    .map(|&i| unsafe { std::slice::from_raw_parts_mut(buffer_ptrs[i] as *mut u8, sizes[i]) })
                    .collect();
                s.store.batch_get_into(&keys, &mut bufs).iter().map(length_or_code).collect()
            } else {
                // Destinations that overlap: read into the engine's buffers and copy.
                s.store
                    .batch_get(&keys)
                    .iter()
                    .zip(&wanted)
                    .map(|(r, &i)| match r {
                        Ok(data) if data.len() <= sizes[i] => {
                            // SAFETY: the destination lies in a registered region of at
                            // least `sizes[i]` bytes; raw copies create no references.
                            unsafe { copy_out(data, buffer_ptrs[i]) };
                            data.len() as i64
                        }
                        Ok(_) => INVALID_PARAMS.into(),
                        Err(e) => code(e).into(),
                    })
                    .collect()
            };
            for (&i, v) in wanted.iter().zip(found) {
                results[i] = v;
            }
            results
        })
    }

    /// Stores, under `keys[i]`, the concatenation of the buffers `all_buffer_ptrs[i]`
    /// (sizes `all_sizes[i]`), all registered. One code per key.
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, config = None))]
    fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> Vec<i32> {
        let n = keys.len();
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; n] };
        if !Self::same_len(n, all_buffer_ptrs.len(), all_sizes.len()) {
            return vec![INVALID_PARAMS; n];
        }
        let cfg = match s.write_config(config.as_deref(), n) {
            Ok(c) => c,
            Err(c) => return vec![c; n],
        };
        let mut results = vec![0; n];
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            let mut valid = Vec::with_capacity(n);
            let mut on_device: Vec<(usize, Arc<dyn DeviceMemory>)> = Vec::new();
            for i in 0..n {
                let (ptrs, sizes) = (&all_buffer_ptrs[i], &all_sizes[i]);
                match self.devices.resolve_parts(&self.buffers, ptrs, sizes) {
                    _ if ptrs.is_empty() => results[i] = INVALID_PARAMS,
                    Ok(None) => valid.push(i),
                    Ok(Some(mem)) => on_device.push((i, mem)),
                    Err(c) => results[i] = c,
                }
            }
            if !on_device.is_empty() {
                let items: Vec<(&str, Arc<dyn DeviceMemory>)> =
                    on_device.iter().map(|(i, m)| (keys[*i].as_str(), m.clone())).collect();
                for ((i, _), c) in on_device.iter().zip(write_device(WriteMode::Put, &s.store, &items, &cfg)) {
                    results[*i] = c;
                }
            }
            let parts: Vec<Vec<&[u8]>> = valid
                .iter()
                .map(|&i| {
                    let (ptrs, sizes) = (&all_buffer_ptrs[i], &all_sizes[i]);
                    // SAFETY: each part was checked against a registered region.
                    ptrs.iter()
                        .zip(sizes)
                        .map(|(&p, &l)| unsafe { std::slice::from_raw_parts(p as *const u8, l) })
                        .collect()
                })
                .collect();
            let items: Vec<(&str, &[&[u8]])> =
                valid.iter().zip(&parts).map(|(&i, p)| (keys[i].as_str(), p.as_slice())).collect();
            for (&i, res) in valid.iter().zip(s.store.batch_put_parts(&items, &cfg)) {
                results[i] = put_status(&res);
            }
        });
        results
    }

    /// Reads `keys[i]` into the registered buffers `all_buffer_ptrs[i]` (sizes
    /// `all_sizes[i]`), filling them in order. One result per key: the object's length
    /// or a negative code (-600 if it does not fit in them).
    #[pyo3(signature = (keys, all_buffer_ptrs, all_sizes, prefer_alloc_in_same_node = false))]
    fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        all_buffer_ptrs: Vec<Vec<usize>>,
        all_sizes: Vec<Vec<usize>>,
        prefer_alloc_in_same_node: bool,
    ) -> Vec<i64> {
        // Reads already prefer a replica on this host when there is one.
        let _ = prefer_alloc_in_same_node;
        let n = keys.len();
        let bad = vec![i64::from(INVALID_PARAMS); n];
        let Some(s) = self.session() else { return bad };
        if !Self::same_len(n, all_buffer_ptrs.len(), all_sizes.len()) {
            return bad;
        }
        // Device calls bind their memory's CUDA context: give the framework's back.
        let _ctx = KeepCurrentContext::new();
        py.detach(|| {
            let _call = self.pointer_call();
            let mut results = bad.clone();
            let mut wanted = Vec::with_capacity(n);
            let mut on_device = Vec::new();
            for i in 0..n {
                match self.devices.resolve_parts(&self.buffers, &all_buffer_ptrs[i], &all_sizes[i]) {
                    Ok(None) => wanted.push(i),
                    // GPU memory: its parts seen as one memory (an object larger
                    // than their sum is refused, -600).
                    Ok(Some(mem)) => on_device.push((i, mem)),
                    Err(c) => results[i] = c.into(),
                }
            }
            read_device(&s.store, &keys, &on_device, &mut results);
            let direct = BufferRegistry::disjoint(
                wanted
                    .iter()
                    .flat_map(|&i| all_buffer_ptrs[i].iter().copied().zip(all_sizes[i].iter().copied()))
                    .collect(),
            );
            let keys: Vec<&str> = wanted.iter().map(|&i| keys[i].as_str()).collect();
            let found: Vec<i64> = if direct {
                let mut parts: Vec<Vec<&mut [u8]>> = wanted
                    .iter()
                    .map(|&i| {
                        all_buffer_ptrs[i]
                            .iter()
                            .zip(&all_sizes[i])
                            // SAFETY: each part lies inside a registered region and no
                            // two parts of the call overlap (`disjoint`).
                            .map(|(&p, &l)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, l) })
                            .collect()
                    })
                    .collect();
                let mut bufs: Vec<&mut [&mut [u8]]> = parts.iter_mut().map(Vec::as_mut_slice).collect();
                s.store.batch_get_into_parts(&keys, &mut bufs).iter().map(length_or_code).collect()
            } else {
                // Destinations that overlap: read into the engine's buffers and copy.
                s.store
                    .batch_get(&keys)
                    .iter()
                    .zip(&wanted)
                    .map(|(r, &i)| {
                        let data = match r {
                            Ok(d) => d,
                            Err(e) => return code(e).into(),
                        };
                        if data.len() > all_sizes[i].iter().sum::<usize>() {
                            return INVALID_PARAMS.into();
                        }
                        let mut rest: &[u8] = data;
                        for (&p, &l) in all_buffer_ptrs[i].iter().zip(&all_sizes[i]) {
                            let (part, tail) = rest.split_at(l.min(rest.len()));
                            // SAFETY: each destination lies in a registered region of at
                            // least `l >= part.len()` bytes; raw copies create no references.
                            unsafe { copy_out(part, p) };
                            rest = tail;
                        }
                        data.len() as i64
                    })
                    .collect()
            };
            for (&i, v) in wanted.iter().zip(found) {
                results[i] = v;
            }
            results
        })
    }

    /// 1 if a complete object is stored under `key`, 0 if not, or a negative code.
    fn is_exist(&self, py: Python<'_>, key: &str) -> i32 {
        let Some(s) = self.session() else { return INVALID_PARAMS };
        py.detach(|| match s.store.exists(key) {
            Ok(found) => i32::from(found),
            Err(e) => code(&e),
        })
    }

    /// `is_exist` for many keys with one master round trip: 1, 0 or a negative code each.
    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<String>) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; keys.len()] };
        py.detach(|| {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            s.store
                .batch_exists(&keys)
                .iter()
                .map(|r| match r {
                    Ok(found) => i32::from(*found),
                    Err(e) => code(e),
                })
                .collect()
        })
    }

    /// The length of the object under `key`, or a negative code.
    fn get_size(&self, py: Python<'_>, key: &str) -> i64 {
        let Some(s) = self.session() else { return INVALID_PARAMS.into() };
        py.detach(|| match s.store.master().object_info(key) {
            Ok(info) => info.len as i64,
            Err(e) => code(&e).into(),
        })
    }

    /// Removes `key`. A reader's lease makes it fail with -706, unless `force`: then it
    /// waits for the lease to run out. Returns 0 or a negative code.
    #[pyo3(signature = (key, force = false))]
    fn remove(&self, py: Python<'_>, key: &str, force: bool) -> i32 {
        let Some(s) = self.session() else { return INVALID_PARAMS };
        py.detach(|| Self::remove_one(&s.store, key, force))
    }

    /// Removes every key matching the regular expression (searched anywhere in the
    /// key). Returns how many were removed, or a negative code (-600 for a bad
    /// expression).
    #[pyo3(signature = (regex_pattern, force = false))]
    fn remove_by_regex(&self, py: Python<'_>, regex_pattern: &str, force: bool) -> i64 {
        let Some(s) = self.session() else { return INVALID_PARAMS.into() };
        let Ok(re) = regex::Regex::new(regex_pattern) else { return INVALID_PARAMS.into() };
        py.detach(|| {
            let keys = match s.store.master().all_keys() {
                Ok(k) => k,
                Err(e) => return code(&e).into(),
            };
            let matching: Vec<&str> = keys.iter().map(String::as_str).filter(|k| re.is_match(k)).collect();
            Self::remove_many(&s.store, &matching, force).iter().filter(|&&c| c == 0).count() as i64
        })
    }

    /// Removes every object (with `force`, also those leased to readers, once their
    /// leases run out). Returns how many were removed, or a negative code.
    #[pyo3(signature = (force = false))]
    fn remove_all(&self, py: Python<'_>, force: bool) -> i64 {
        let Some(s) = self.session() else { return INVALID_PARAMS.into() };
        py.detach(|| {
            let deadline = Instant::now() + FORCE_DEADLINE;
            let mut removed = 0;
            loop {
                match s.store.remove_all() {
                    Ok(n) => removed += n as i64,
                    Err(e) => return code(&e).into(),
                }
                if !force || Instant::now() >= deadline {
                    return removed;
                }
                match s.store.master().list_keys(1) {
                    Ok(left) if left.is_empty() => return removed,
                    Ok(_) => std::thread::sleep(FORCE_POLL),
                    Err(e) => return code(&e).into(),
                }
            }
        })
    }

    /// Removes each key; one code per key (see `remove` for `force`).
    #[pyo3(signature = (keys, force = false))]
    fn batch_remove(&self, py: Python<'_>, keys: Vec<String>, force: bool) -> Vec<i32> {
        let Some(s) = self.session() else { return vec![INVALID_PARAMS; keys.len()] };
        py.detach(|| {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            Self::remove_many(&s.store, &keys, force)
        })
    }

    // ------------------------------------------------------------ replicas and tasks

    /// The replicas of `key` (`ReplicaDescriptor`s; empty if it is not stored).
    fn get_replica_desc(&self, py: Python<'_>, key: &str) -> Vec<ReplicaDescriptor> {
        let Some(s) = self.session() else { return Vec::new() };
        py.detach(|| replicas::describe(&s, &[key]).pop().flatten().unwrap_or_default())
    }

    /// `{key: [ReplicaDescriptor, ...]}` for the keys that are stored.
    fn batch_get_replica_desc(&self, py: Python<'_>, keys: Vec<String>) -> HashMap<String, Vec<ReplicaDescriptor>> {
        let Some(s) = self.session() else { return HashMap::new() };
        py.detach(|| {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let found = replicas::describe(&s, &refs);
            keys.iter().zip(found).filter_map(|(k, d)| Some((k.clone(), d?))).collect()
        })
    }

    /// Clears the replicas of `keys` and returns the keys cleared: with
    /// `segment_name` "" the objects are removed, else only their replicas on that
    /// segment (an object left with none is removed). Objects being read are skipped.
    /// The reference also skips objects another client wrote; this engine does not
    /// record writers, so any client may clear any object.
    #[pyo3(signature = (keys, segment_name = ""))]
    fn batch_replica_clear(&self, py: Python<'_>, keys: Vec<String>, segment_name: &str) -> Vec<String> {
        let Some(s) = self.session() else { return Vec::new() };
        py.detach(|| {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            replicas::clear(&s, &refs, segment_name)
        })
    }

    /// Starts copying `key` to each of the segments `targets` (names as
    /// `get_replica_desc` gives them, or `host:port`). Returns `(task_id, 0)`, or
    /// `((0, 0), code)`: -600 (no targets, or one is not mounted), -704 (no such
    /// object). The task runs on this client; `query_task` follows it.
    fn create_copy_task(&self, py: Python<'_>, key: &str, targets: Vec<String>) -> ((u64, u64), i32) {
        let Some(s) = self.session() else { return ((0, 0), INVALID_PARAMS) };
        match py.detach(|| tasks::create_copy(&s, key, &targets)) {
            Ok(id) => (id, 0),
            Err(c) => ((0, 0), c),
        }
    }

    /// Starts moving `key`'s replica from segment `source` to segment `target`: a copy
    /// to `target`, then the replica on `source` is dropped (once no read holds it).
    /// Returns `(task_id, 0)` or `((0, 0), code)`: -704 (no such object), -600 (same
    /// segments, an unknown one, or `source` holds no replica of it).
    fn create_move_task(&self, py: Python<'_>, key: &str, source: &str, target: &str) -> ((u64, u64), i32) {
        let Some(s) = self.session() else { return ((0, 0), INVALID_PARAMS) };
        match py.detach(|| tasks::create_move(&s, key, source, target)) {
            Ok(id) => (id, 0),
            Err(c) => ((0, 0), c),
        }
    }

    /// `(QueryTaskResponse, 0)` for a task this client created, else `(None, -1400)`.
    fn query_task(&self, task_id: (u64, u64)) -> (Option<QueryTaskResponse>, i32) {
        let found = self.session().and_then(|s| s.tasks.query(task_id));
        match found {
            Some(t) => (Some(t), 0),
            None => (None, codes::TASK_NOT_FOUND),
        }
    }

    // ------------------------------------------------------------------ tensors

    /// Stores a numpy array or a CPU torch tensor under `key`, with its dtype and
    /// shape (the reference's layout). Returns 0 or a negative code (-600 for what is
    /// not a tensor); a tensor on a GPU raises `ValueError` (not supported yet).
    fn put_tensor(&self, py: Python<'_>, key: String, tensor: Bound<'_, PyAny>) -> PyResult<i32> {
        Ok(self.write_tensors(py, WriteMode::Put, &[key], &[tensor], None, Split::NONE)?[0])
    }

    /// `put_tensor` for many keys in one batch; one code per key.
    fn batch_put_tensor(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<i32>> {
        self.write_tensors(py, WriteMode::Put, &keys, &tensors_list, None, Split::NONE)
    }

    /// `put_tensor` with a placement config.
    #[pyo3(signature = (key, tensor, config = None))]
    fn pub_tensor(
        &self,
        py: Python<'_>,
        key: String,
        tensor: Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        if let Some(Err(c)) = config.as_deref().map(ReplicateConfig::check_pub) {
            return Ok(c);
        }
        Ok(self.write_tensors(py, WriteMode::Put, &[key], &[tensor], config.as_deref(), Split::NONE)?[0])
    }

    /// `batch_put_tensor` with a placement config.
    #[pyo3(signature = (keys, tensors_list, config = None))]
    fn batch_pub_tensor(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Vec<i32>> {
        if let Some(Err(c)) = config.as_deref().map(ReplicateConfig::check_pub) {
            return Ok(vec![c; keys.len()]);
        }
        self.write_tensors(py, WriteMode::Put, &keys, &tensors_list, config.as_deref(), Split::NONE)
    }

    /// Stores `tensor` as `tp_size` shards split evenly on `split_dim`, under
    /// `key_tp_0` .. `key_tp_<tp_size-1>` (all of them: `tp_rank` names the caller,
    /// as in the reference). `tp_size <= 1` stores it whole under `key`. Returns 0 or
    /// the first failure (-600 when `split_dim` is no dimension `tp_size` divides).
    #[pyo3(signature = (key, tensor, tp_rank = 0, tp_size = 1, split_dim = 0))]
    fn put_tensor_with_tp(
        &self,
        py: Python<'_>,
        key: String,
        tensor: Bound<'_, PyAny>,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> PyResult<i32> {
        let _ = tp_rank;
        Ok(self.write_tensors(py, WriteMode::Put, &[key], &[tensor], None, Split { size: tp_size, dim: split_dim })?[0])
    }

    /// `put_tensor_with_tp` for many keys in one batch; one code per base key.
    #[pyo3(signature = (base_keys, tensors_list, tp_rank = 0, tp_size = 1, split_dim = 0))]
    fn batch_put_tensor_with_tp(
        &self,
        py: Python<'_>,
        base_keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> PyResult<Vec<i32>> {
        let _ = tp_rank;
        self.write_tensors(py, WriteMode::Put, &base_keys, &tensors_list, None, Split { size: tp_size, dim: split_dim })
    }

    /// `put_tensor_with_tp` with a placement config.
    #[pyo3(signature = (key, tensor, config = None, tp_rank = 0, tp_size = 1, split_dim = 0))]
    #[allow(clippy::too_many_arguments)]
    fn pub_tensor_with_tp(
        &self,
        py: Python<'_>,
        key: String,
        tensor: Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> PyResult<i32> {
        let _ = tp_rank;
        if let Some(Err(c)) = config.as_deref().map(ReplicateConfig::check_pub) {
            return Ok(c);
        }
        Ok(self.write_tensors(
            py,
            WriteMode::Put,
            &[key],
            &[tensor],
            config.as_deref(),
            Split { size: tp_size, dim: split_dim },
        )?[0])
    }

    /// `batch_put_tensor_with_tp` with a placement config.
    #[pyo3(signature = (base_keys, tensors_list, config = None, tp_rank = 0, tp_size = 1, split_dim = 0))]
    #[allow(clippy::too_many_arguments)]
    fn batch_pub_tensor_with_tp(
        &self,
        py: Python<'_>,
        base_keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> PyResult<Vec<i32>> {
        let _ = tp_rank;
        if let Some(Err(c)) = config.as_deref().map(ReplicateConfig::check_pub) {
            return Ok(vec![c; base_keys.len()]);
        }
        self.write_tensors(
            py,
            WriteMode::Put,
            &base_keys,
            &tensors_list,
            config.as_deref(),
            Split { size: tp_size, dim: split_dim },
        )
    }

    /// Stores `tensor` under `key`, replacing the object there if any.
    fn upsert_tensor(&self, py: Python<'_>, key: String, tensor: Bound<'_, PyAny>) -> PyResult<i32> {
        Ok(self.write_tensors(py, WriteMode::Upsert, &[key], &[tensor], None, Split::NONE)?[0])
    }

    /// `upsert_tensor` for many keys in one batch; one code per key.
    fn batch_upsert_tensor(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<i32>> {
        self.write_tensors(py, WriteMode::Upsert, &keys, &tensors_list, None, Split::NONE)
    }

    /// `upsert_tensor` with a placement config.
    #[pyo3(signature = (key, tensor, config = None))]
    fn upsert_pub_tensor(
        &self,
        py: Python<'_>,
        key: String,
        tensor: Bound<'_, PyAny>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<i32> {
        if let Some(Err(c)) = config.as_deref().map(ReplicateConfig::check_pub) {
            return Ok(c);
        }
        Ok(self.write_tensors(py, WriteMode::Upsert, &[key], &[tensor], config.as_deref(), Split::NONE)?[0])
    }

    /// `batch_upsert_tensor` with a placement config.
    #[pyo3(signature = (keys, tensors_list, config = None))]
    fn batch_upsert_pub_tensor(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
        config: Option<PyRef<'_, ReplicateConfig>>,
    ) -> PyResult<Vec<i32>> {
        if let Some(Err(c)) = config.as_deref().map(ReplicateConfig::check_pub) {
            return Ok(vec![c; keys.len()]);
        }
        self.write_tensors(py, WriteMode::Upsert, &keys, &tensors_list, config.as_deref(), Split::NONE)
    }

    /// The tensor stored under `key` (torch when it imports, else numpy), or `None`.
    fn get_tensor<'py>(&self, py: Python<'py>, key: String) -> PyResult<Option<Bound<'py, PyAny>>> {
        Ok(self.read_tensors(py, &[key])?.pop().flatten())
    }

    /// `get_tensor` for many keys in one batch (`None` for the missing ones).
    fn batch_get_tensor<'py>(&self, py: Python<'py>, keys: Vec<String>) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
        self.read_tensors(py, &keys)
    }

    /// Shard `tp_rank` of the tensor stored by `put_tensor_with_tp` (`key_tp_<rank>`),
    /// or with `tp_size <= 1` the tensor under `key`; `None` if absent.
    #[pyo3(signature = (key, tp_rank = 0, tp_size = 1, split_dim = 0))]
    fn get_tensor_with_tp<'py>(
        &self,
        py: Python<'py>,
        key: String,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let _ = split_dim;
        let key = if tp_size <= 1 { key } else { tensor::tp_key(&key, tp_rank) };
        self.get_tensor(py, key)
    }

    /// `get_tensor_with_tp` for many base keys in one batch.
    #[pyo3(signature = (base_keys, tp_rank = 0, tp_size = 1))]
    fn batch_get_tensor_with_tp<'py>(
        &self,
        py: Python<'py>,
        base_keys: Vec<String>,
        tp_rank: i32,
        tp_size: i32,
    ) -> PyResult<Vec<Option<Bound<'py, PyAny>>>> {
        let keys: Vec<String> =
            if tp_size <= 1 { base_keys } else { base_keys.iter().map(|k| tensor::tp_key(k, tp_rank)).collect() };
        self.read_tensors(py, &keys)
    }

    /// Reads the tensor under `key` into the registered buffer `[buffer_ptr,
    /// buffer_ptr + size)` and returns a tensor over its elements there (not a copy:
    /// valid while the buffer is), or `None`. A buffer in GPU memory gives a torch
    /// CUDA tensor (`ImportError` without torch).
    fn get_tensor_into<'py>(
        &self,
        py: Python<'py>,
        key: String,
        buffer_ptr: usize,
        size: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let got = self.read_tensors_into(py, vec![key], vec![buffer_ptr], vec![size])?;
        let first = got.get_item(0)?;
        // Bad arguments give -600 in the batch form and None here, as in the reference.
        Ok(if first.is_instance_of::<pyo3::types::PyInt>() { py.None().into_bound(py) } else { first })
    }

    /// `get_tensor_into` for many keys in one batch: a tensor or `None` each, or a
    /// list of -600 for bad arguments (as the reference).
    fn batch_get_tensor_into<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.read_tensors_into(py, keys, buffer_ptrs, sizes)
    }

    /// `get_tensor_into` of shard `tp_rank` (`key_tp_<rank>`; `key` itself with
    /// `tp_size <= 1`).
    #[pyo3(signature = (key, buffer_ptr, size, tp_rank = 0, tp_size = 1, split_dim = 0))]
    #[allow(clippy::too_many_arguments)]
    fn get_tensor_with_tp_into<'py>(
        &self,
        py: Python<'py>,
        key: String,
        buffer_ptr: usize,
        size: usize,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let _ = split_dim;
        let key = if tp_size <= 1 { key } else { tensor::tp_key(&key, tp_rank) };
        self.get_tensor_into(py, key, buffer_ptr, size)
    }

    /// `batch_get_tensor_into` of shard `tp_rank` of each base key.
    #[pyo3(signature = (base_keys, buffer_ptrs, sizes, tp_rank = 0, tp_size = 1))]
    fn batch_get_tensor_with_tp_into<'py>(
        &self,
        py: Python<'py>,
        base_keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        tp_rank: i32,
        tp_size: i32,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys: Vec<String> =
            if tp_size <= 1 { base_keys } else { base_keys.iter().map(|k| tensor::tp_key(k, tp_rank)).collect() };
        self.read_tensors_into(py, keys, buffer_ptrs, sizes)
    }

    /// Stores the tensor object (header and elements, as `get_tensor_into` leaves
    /// them) in the registered buffer `[buffer_ptr, buffer_ptr + size)` under `key`,
    /// without a copy. Returns 0 or a negative code (-600 if it holds no tensor).
    fn put_tensor_from(&self, py: Python<'_>, key: String, buffer_ptr: usize, size: usize) -> i32 {
        self.write_tensors_from(py, WriteMode::Put, &[key], &[buffer_ptr], &[size], Split::NONE)[0]
    }

    /// `put_tensor_from` for many keys in one batch; any bad buffer makes every code
    /// -600, as in the reference.
    fn batch_put_tensor_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> Vec<i32> {
        self.write_tensors_from(py, WriteMode::Put, &keys, &buffer_ptrs, &sizes, Split::NONE)
    }

    /// `put_tensor_with_tp` of the tensor object in a registered buffer.
    #[pyo3(signature = (key, buffer_ptr, size, tp_rank = 0, tp_size = 1, split_dim = 0))]
    #[allow(clippy::too_many_arguments)]
    fn put_tensor_with_tp_from(
        &self,
        py: Python<'_>,
        key: String,
        buffer_ptr: usize,
        size: usize,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> i32 {
        let _ = tp_rank;
        self.write_tensors_from(
            py,
            WriteMode::Put,
            &[key],
            &[buffer_ptr],
            &[size],
            Split { size: tp_size, dim: split_dim },
        )[0]
    }

    /// `put_tensor_with_tp_from` for many base keys in one batch.
    #[pyo3(signature = (base_keys, buffer_ptrs, sizes, tp_rank = 0, tp_size = 1, split_dim = 0))]
    #[allow(clippy::too_many_arguments)]
    fn batch_put_tensor_with_tp_from(
        &self,
        py: Python<'_>,
        base_keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
        tp_rank: i32,
        tp_size: i32,
        split_dim: i32,
    ) -> Vec<i32> {
        let _ = tp_rank;
        self.write_tensors_from(
            py,
            WriteMode::Put,
            &base_keys,
            &buffer_ptrs,
            &sizes,
            Split { size: tp_size, dim: split_dim },
        )
    }

    /// `put_tensor_from`, replacing the object under `key` if any.
    fn upsert_tensor_from(&self, py: Python<'_>, key: String, buffer_ptr: usize, size: usize) -> i32 {
        self.write_tensors_from(py, WriteMode::Upsert, &[key], &[buffer_ptr], &[size], Split::NONE)[0]
    }

    /// `batch_put_tensor_from`, replacing the objects there.
    fn batch_upsert_tensor_from(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        buffer_ptrs: Vec<usize>,
        sizes: Vec<usize>,
    ) -> Vec<i32> {
        self.write_tensors_from(py, WriteMode::Upsert, &keys, &buffer_ptrs, &sizes, Split::NONE)
    }

    /// Reads the tensor stored under `key` into `tensor` (a contiguous torch tensor on
    /// a CUDA GPU, moved by device copies or DMA, or on the CPU inside a registered
    /// buffer) of the stored dtype and shape; returns the bytes of elements read, or a
    /// negative code (-600 for a destination that is not such a tensor or does not
    /// match; see `batch_get_tensor_into_cuda`).
    fn get_tensor_into_cuda(&self, py: Python<'_>, key: String, tensor: Bound<'_, PyAny>) -> PyResult<i64> {
        Ok(self.read_tensors_into_cuda(py, &[key], &[tensor])?[0])
    }

    /// `get_tensor_into_cuda` for many keys in one batch (one master round trip); one
    /// result per key. A destination whose dtype or shape differs from the stored
    /// tensor's gets -600; where the stored tensor is not larger than it, its elements
    /// were written into it first (the reference reads the header first and leaves it
    /// as it was).
    fn batch_get_tensor_into_cuda(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
        tensors_list: Vec<Bound<'_, PyAny>>,
    ) -> PyResult<Vec<i64>> {
        self.read_tensors_into_cuda(py, &keys, &tensors_list)
    }
}
