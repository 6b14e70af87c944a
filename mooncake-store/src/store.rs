//! `MooncakeStore` and `ReplicateConfig`: the reference's API over
//! [`mooncake_core::Store`].

use std::ffi::{c_void, CString};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_core::{BufferRegistry, Error, Protocol, Store};
use parking_lot::RwLock;

use crate::codes;
use crate::error::StoreError;

/// How long a forced remove waits for readers' leases to run out. The engine never
/// frees memory a reader may still be copying from, so `force` waits out the lease
/// (the master's lease TTL, 5 s by default) instead of skipping it.
const FORCE_DEADLINE: Duration = Duration::from_secs(30);
/// How long a remove without `force` retries an object under lease. This client's
/// own reads give their leases back right after the read, but asynchronously (one
/// batched message to the master), so a remove that follows a get of the same key
/// may find the lease still there for a moment; an object another reader holds is
/// reported `-706` after this grace.
const OWN_LEASE_GRACE: Duration = Duration::from_millis(100);
/// Poll period of a remove that waits for a lease.
const FORCE_POLL: Duration = Duration::from_millis(10);

/// Until when a remove retries objects under lease.
fn lease_deadline(force: bool) -> Instant {
    Instant::now() + if force { FORCE_DEADLINE } else { OWN_LEASE_GRACE }
}

// ---------------------------------------------------------------------------
// ReplicateConfig
// ---------------------------------------------------------------------------

/// Replication settings for a put operation: the reference's struct, field for
/// field.
///
/// Build it with a struct literal or `ReplicateConfig::default()`; `None` where a
/// method takes `Option<&ReplicateConfig>` means the defaults (one replica, no pin).
/// [`mooncake_core::ReplicateConfig`] has more: a soft pin that expires
/// (`soft_pin_ttl`), `require_all_replicas`, and upserts that keep the pin.
#[derive(Debug, Clone, Default)]
pub struct ReplicateConfig {
    /// Number of memory replicas, each on a distinct segment (0 means the default,
    /// 1). Placement is best effort, as in the reference: with fewer segments with
    /// room, fewer replicas are made.
    pub replica_num: usize,
    /// Soft-pin the object: it is evicted only when nothing else can be.
    pub with_soft_pin: bool,
    /// The reference's "never evict". This engine has no hard pin: the object is
    /// soft-pinned instead, the strongest protection it has (evicted only when
    /// nothing else can be).
    pub with_hard_pin: bool,
    /// Segments to try first, in order. The reference names a segment by its
    /// client's hostname; here [`MooncakeStore::get_hostname`] of the writing client
    /// names its own segment (the usual "write locally" preference), and this
    /// engine's segment names (`endpoint#n`, from [`mooncake_core::Store::segment_name`])
    /// pass through (the engine refuses one that is not mounted with
    /// `InvalidArgument`). Other names are skipped, as the reference skips names of
    /// no segment: this layer cannot tell which other client a hostname belongs to.
    pub preferred_segments: Vec<String>,
}

impl ReplicateConfig {
    /// Refuses what the reference refuses before it reaches the engine: segment
    /// names with an interior NUL.
    fn check(&self) -> Result<(), StoreError> {
        self.preferred_segments.iter().try_for_each(|s| check_str(s))
    }

    /// The engine's configuration for these settings, written by the client of
    /// `session` (which names its own segment by its hostname).
    fn to_core(&self, session: &Session) -> mooncake_core::ReplicateConfig {
        let mut preferred: Vec<String> = Vec::with_capacity(self.preferred_segments.len());
        for name in &self.preferred_segments {
            let segment = match &session.segment {
                Some(own) if *name == session.hostname || name == own => Some(own),
                _ if name.contains('#') => Some(name),
                _ => None,
            };
            if let Some(segment) = segment.filter(|s| !preferred.contains(s)) {
                preferred.push(segment.clone());
            }
        }
        mooncake_core::ReplicateConfig {
            replica_num: self.replica_num.max(1),
            preferred_segments: preferred,
            soft_pin: self.with_soft_pin || self.with_hard_pin,
            ..Default::default()
        }
    }
}

/// The engine's configuration for an optional config (`None`: the defaults).
fn core_config(config: Option<&ReplicateConfig>, session: &Session) -> mooncake_core::ReplicateConfig {
    config.map_or_else(mooncake_core::ReplicateConfig::default, |c| c.to_core(session))
}

/// Refuses a string with an interior NUL as the reference does (its C layer builds a
/// `CString` of every string argument), with the same `NulError`.
fn check_str(s: &str) -> Result<(), StoreError> {
    if !s.as_bytes().contains(&0) {
        return Ok(());
    }
    CString::new(s).map(drop).map_err(StoreError::from)
}

/// A raw batch's shape: one buffer and one size per key, every key valid.
fn check_batch(keys: &[&str], buffers: &[*mut c_void], sizes: &[usize]) -> Result<(), StoreError> {
    if buffers.len() != keys.len() || sizes.len() != keys.len() {
        return Err(StoreError::InvalidArgument("keys, buffers, and sizes must have the same length".into()));
    }
    keys.iter().try_for_each(|key| check_str(key))
}

/// A put's result as the reference reports it: a key that exists is a success
/// (objects are immutable; the first value stays).
fn put_result(res: mooncake_core::Result<()>) -> Result<(), StoreError> {
    match res {
        Ok(()) | Err(Error::AlreadyExists(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// A per-key code: 0, or the reference's code for the error.
fn code_of(res: mooncake_core::Result<()>) -> i32 {
    put_result(res).err().map_or(0, |e| e.code())
}

// ---------------------------------------------------------------------------
// MooncakeStore
// ---------------------------------------------------------------------------

/// A connected client and the name it reports.
struct Session {
    store: Store,
    /// `host:port`, as `get_hostname` reports it.
    hostname: String,
    /// The name of this client's segment at the master, if it gives memory.
    segment: Option<String>,
}

/// A handle to a Mooncake distributed KV-cache store: the reference's
/// `MooncakeStore`, over this engine's [`mooncake_core::Store`].
///
/// # Lifecycle
///
/// ```no_run
/// use mooncake_store::MooncakeStore;
///
/// let store = MooncakeStore::new()?;
/// store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", "127.0.0.1:50051")?;
/// store.put("my-key", b"hello world", None)?;
/// assert_eq!(store.get("my-key")?, b"hello world");
/// # Ok::<(), mooncake_store::StoreError>(())
/// ```
///
/// Every method takes `&self`; the store is `Send + Sync` and is meant to be shared
/// (e.g. in an `Arc`) by the threads of a process. Dropping it leaves the master:
/// its segment is unmounted, with the objects on it.
///
/// The zero-copy methods (`put_from`, `get_into`, `batch_*`) take raw pointers, as
/// the reference does; each range must lie inside a buffer given to
/// [`register_buffer`](Self::register_buffer), else the call fails with
/// [`StoreError::InvalidArgument`] and nothing is read or written. The native
/// [`mooncake_core::Store`] takes slices instead (`put`, `get_into`,
/// `batch_get_into`, `put_parts`, ...): no `unsafe`, no registration.
pub struct MooncakeStore {
    session: RwLock<Option<Arc<Session>>>,
    buffers: BufferRegistry,
}

// The reference promises `Send + Sync`; a field that lost them must fail the build.
const _: () = {
    const fn send_sync<T: Send + Sync>() {}
    send_sync::<MooncakeStore>();
};

impl MooncakeStore {
    // -----------------------------------------------------------------------
    // Lifecycle
    // -----------------------------------------------------------------------

    /// A store that is not connected yet: call [`setup`](Self::setup) before any
    /// data operation (they fail with `OperationFailed(-600)` until then, as in the
    /// reference). Never fails; the `Result` is the reference's signature.
    pub fn new() -> Result<Self, StoreError> {
        Ok(Self { session: RwLock::new(None), buffers: BufferRegistry::default() })
    }

    /// Connects to the master and gives `global_segment_size` bytes of this
    /// process's memory to the pool.
    ///
    /// - `local_hostname`: the address other clients reach this one at, `host` or
    ///   `host:port` (without a port, the system picks a free one).
    /// - `metadata_server`: accepted and not needed (any value: an HTTP URL,
    ///   `P2PHANDSHAKE`, `etcd://...`); this engine keeps no separate metadata
    ///   service.
    /// - `global_segment_size`: bytes given to the pool (pages are committed on
    ///   first write).
    /// - `local_buffer_size`: accepted and not needed: bytes move straight between
    ///   the caller's memory and the segments, with no staging buffer.
    /// - `protocol`: `"tcp"` (or `""`); `"rdma"` with this crate's `rdma` feature
    ///   (without it, `InvalidArgument`); also this engine's `"shm"` and `"auto"`
    ///   (see [`mooncake_core::Protocol`]).
    /// - `device_name`: accepted and not needed (RDMA uses this host's devices).
    /// - `master_server_addr`: `host:port` of a `mooncake-master`, or, with the
    ///   `etcd` feature, `etcd://H:P[,H:P...]/NAME` for a cluster of masters.
    ///
    /// With `MOONCAKE_SECRET` set in the environment, it is the secret shared with
    /// the master and the other clients. Calling `setup` again leaves the master
    /// first and joins anew. A setup refused for a string with a NUL, its protocol,
    /// an `etcd://` address without the feature or an empty hostname changes
    /// nothing; any other failure leaves the store not set up.
    #[allow(clippy::too_many_arguments)] // the reference's signature
    pub fn setup(
        &self,
        local_hostname: &str,
        metadata_server: &str,
        global_segment_size: u64,
        local_buffer_size: u64,
        protocol: &str,
        device_name: &str,
        master_server_addr: &str,
    ) -> Result<(), StoreError> {
        for s in [local_hostname, metadata_server, protocol, device_name, master_server_addr] {
            check_str(s)?;
        }
        // Accepted for the reference's sake and not needed by this engine (see above).
        let _ = (metadata_server, local_buffer_size, device_name);
        let protocol = parse_protocol(protocol)?;
        if mooncake_core::cluster::EtcdAddress::is_etcd(master_server_addr) && !cfg!(feature = "etcd") {
            return Err(StoreError::InvalidArgument(format!(
                "{master_server_addr} names a cluster of masters: build mooncake_store with its `etcd` feature"
            )));
        }
        if local_hostname.is_empty() {
            return Err(StoreError::InvalidArgument("local_hostname is empty".into()));
        }
        let listen = match split_port(local_hostname) {
            Some(_) => local_hostname.to_owned(),
            None => format!("{local_hostname}:0"),
        };
        let mut builder = Store::builder()
            .master_address(master_server_addr)
            .global_segment_size(global_segment_size)
            .protocol(protocol)
            .listen(&listen);
        if let Ok(secret) = std::env::var("MOONCAKE_SECRET") {
            builder = builder.shared_secret(secret.as_bytes());
        }
        // Leave the master before joining again, so the old segment is not counted
        // twice; a failed setup leaves the store not set up.
        drop(self.session.write().take());
        let store = builder.build()?;
        let host = split_port(local_hostname).map_or(local_hostname, |(host, _)| host);
        let hostname = match split_port(store.endpoint()) {
            Some((_, port)) => format!("{host}:{port}"),
            None => local_hostname.to_owned(),
        };
        let segment = store.segment_name()?;
        *self.session.write() = Some(Arc::new(Session { store, hostname, segment }));
        Ok(())
    }

    /// `Ok(())` when set up and the master answers; else `OperationFailed(1)` (not
    /// set up) or `OperationFailed(2)` (the master does not answer), the reference's
    /// health codes.
    pub fn health_check(&self) -> Result<(), StoreError> {
        let Some(s) = self.session.read().clone() else {
            return Err(StoreError::OperationFailed(codes::HEALTH_NOT_INITIALIZED));
        };
        match s.store.master().stats() {
            Ok(_) => Ok(()),
            Err(_) => Err(StoreError::OperationFailed(codes::HEALTH_MASTER_UNREACHABLE)),
        }
    }

    // -----------------------------------------------------------------------
    // Put operations
    // -----------------------------------------------------------------------

    /// Stores `value` under `key`.
    ///
    /// Objects are immutable: a put of a key that exists returns `Ok(())` and keeps
    /// the value stored first, as the reference does (the native
    /// [`Store::put`] says `AlreadyExists`, and [`Store::upsert`] replaces).
    pub fn put(&self, key: &str, value: &[u8], config: Option<&ReplicateConfig>) -> Result<(), StoreError> {
        check_str(key)?;
        config.map(ReplicateConfig::check).transpose()?;
        let s = self.session()?;
        put_result(s.store.put_with(key, value, &core_config(config, &s)))
    }

    /// Stores the `size` bytes at `buffer` under `key`, without an intermediate copy.
    ///
    /// `[buffer, buffer + size)` must lie inside a buffer given to
    /// [`register_buffer`](Self::register_buffer); else `InvalidArgument`, and
    /// nothing is read. Like [`put`](Self::put), a key that exists is `Ok(())`.
    /// The native [`Store::put_with`] takes a slice.
    ///
    /// # Safety
    ///
    /// `buffer` must point to at least `size` bytes of valid memory, not written
    /// during the call, and registered with [`register_buffer`](Self::register_buffer).
    pub unsafe fn put_from(
        &self,
        key: &str,
        buffer: *mut c_void,
        size: usize,
        config: Option<&ReplicateConfig>,
    ) -> Result<(), StoreError> {
        check_str(key)?;
        config.map(ReplicateConfig::check).transpose()?;
        let s = self.session()?;
        self.buffers.check(buffer as usize, size)?;
        // SAFETY: the range lies inside a registered buffer, which the caller
        // promised is valid memory of at least `size` bytes, unchanged during the call.
        let data = unsafe { std::slice::from_raw_parts(buffer as *const u8, size) };
        put_result(s.store.put_with(key, data, &core_config(config, &s)))
    }

    // -----------------------------------------------------------------------
    // Get operations
    // -----------------------------------------------------------------------

    /// Reads the object under `key` into `buffer` (room: `size` bytes) and returns
    /// its length.
    ///
    /// A buffer too small is `OperationFailed(-600)` (nothing written), as in the
    /// reference; a missing key `OperationFailed(-704)`. `[buffer, buffer + size)`
    /// must lie inside a buffer given to [`register_buffer`](Self::register_buffer)
    /// (else `InvalidArgument`). The native [`Store::get_into`] takes a `&mut [u8]`.
    ///
    /// # Safety
    ///
    /// `buffer` must point to at least `size` bytes of writable, valid memory that
    /// nothing else reads or writes during the call.
    pub unsafe fn get_into(&self, key: &str, buffer: *mut c_void, size: usize) -> Result<i64, StoreError> {
        check_str(key)?;
        let s = self.session()?;
        self.buffers.check(buffer as usize, size)?;
        // SAFETY: the range lies inside a registered buffer, which the caller
        // promised is writable memory of at least `size` bytes that nothing else
        // touches during the call, so this is the only reference to it.
        let buf = unsafe { std::slice::from_raw_parts_mut(buffer as *mut u8, size) };
        Ok(s.store.get_into(key, buf)? as i64)
    }

    /// The bytes stored under `key`, in a new `Vec`; a missing key is
    /// `OperationFailed(-704)`.
    ///
    /// One read, verified against the object's checksum. The native [`Store::get`]
    /// returns them as `Bytes` without this copy.
    pub fn get(&self, key: &str) -> Result<Vec<u8>, StoreError> {
        check_str(key)?;
        let s = self.session()?;
        Ok(s.store.get(key)?.to_vec())
    }

    // -----------------------------------------------------------------------
    // Existence / size / hostname
    // -----------------------------------------------------------------------

    /// Whether a complete object is stored under `key`.
    pub fn is_exist(&self, key: &str) -> Result<bool, StoreError> {
        check_str(key)?;
        let s = self.session()?;
        Ok(s.store.exists(key)?)
    }

    /// The length in bytes of the object under `key`; a missing key is
    /// `OperationFailed(-704)`.
    pub fn get_size(&self, key: &str) -> Result<i64, StoreError> {
        check_str(key)?;
        let s = self.session()?;
        Ok(s.store.master().object_info(key)?.len as i64)
    }

    /// `host:port` this client serves its segment on: the name other clients list
    /// in [`ReplicateConfig::preferred_segments`]. Empty before `setup`.
    pub fn get_hostname(&self) -> Result<String, StoreError> {
        Ok(self.session.read().as_ref().map(|s| s.hostname.clone()).unwrap_or_default())
    }

    // -----------------------------------------------------------------------
    // Remove operations
    // -----------------------------------------------------------------------

    /// Removes `key`; a missing key is `OperationFailed(-704)`.
    ///
    /// While a reader holds a lease on the object, the remove fails with
    /// `OperationFailed(-706)` (after a grace of 100 ms: this client's own reads
    /// give their leases back right after the read, asynchronously). With `force`,
    /// it waits for the lease to run out (at most the master's lease TTL, 5 s by
    /// default; it gives up after 30 s) and then removes: this engine never frees
    /// memory a reader may still copy from, where the reference's `force` removes at
    /// once. (The reference keeps every read's lease for its whole TTL, 5 s, so a
    /// remove right after a get fails there; here it succeeds.)
    pub fn remove(&self, key: &str, force: bool) -> Result<(), StoreError> {
        check_str(key)?;
        let s = self.session()?;
        let deadline = lease_deadline(force);
        loop {
            match s.store.remove(key) {
                Err(Error::HasLease(_)) if Instant::now() < deadline => std::thread::sleep(FORCE_POLL),
                res => return Ok(res?),
            }
        }
    }

    /// Removes every key that matches the regular expression `pattern` (searched
    /// anywhere in the key, as `std::regex_search` does in the reference) and returns
    /// how many were removed. A bad expression is `InvalidArgument`. `force` as in
    /// [`remove`](Self::remove); objects under a lease are otherwise skipped (after
    /// its grace).
    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> Result<i64, StoreError> {
        check_str(pattern)?;
        let s = self.session()?;
        let re = regex::Regex::new(pattern).map_err(|e| StoreError::InvalidArgument(e.to_string()))?;
        let keys = s.store.master().all_keys()?;
        let mut pending: Vec<&str> = keys.iter().map(String::as_str).filter(|k| re.is_match(k)).collect();
        let deadline = lease_deadline(force);
        let mut removed = 0;
        loop {
            let answers = s.store.batch_remove(&pending);
            removed += answers.iter().filter(|r| r.is_ok()).count() as i64;
            let leased: Vec<&str> = pending
                .iter()
                .zip(&answers)
                .filter(|(_, r)| matches!(r, Err(Error::HasLease(_))))
                .map(|(k, _)| *k)
                .collect();
            if leased.is_empty() || Instant::now() >= deadline {
                return Ok(removed);
            }
            pending = leased;
            std::thread::sleep(FORCE_POLL);
        }
    }

    /// Removes every object and returns how many were removed. Objects under a
    /// reader's lease are skipped (after the grace of [`remove`](Self::remove)),
    /// unless `force`: then it waits for their leases to run out.
    pub fn remove_all(&self, force: bool) -> Result<i64, StoreError> {
        let s = self.session()?;
        let deadline = lease_deadline(force);
        let mut removed = 0;
        loop {
            removed += s.store.remove_all()? as i64;
            if Instant::now() >= deadline || s.store.master().list_keys(1)?.is_empty() {
                return Ok(removed);
            }
            std::thread::sleep(FORCE_POLL);
        }
    }

    // -----------------------------------------------------------------------
    // Buffer registration (zero-copy operations)
    // -----------------------------------------------------------------------

    /// Declares `[buffer, buffer + size)` as memory the zero-copy methods
    /// ([`put_from`](Self::put_from), [`get_into`](Self::get_into), the batch forms)
    /// may read and write. Registering the same address again takes the new size.
    /// A null or empty buffer is `InvalidArgument`; before `setup`,
    /// `OperationFailed(-600)` as in the reference.
    ///
    /// # Safety
    ///
    /// `buffer` must point to at least `size` bytes of valid memory that stays valid
    /// until [`unregister_buffer`](Self::unregister_buffer) is called (or the store
    /// is dropped).
    pub unsafe fn register_buffer(&self, buffer: *mut c_void, size: usize) -> Result<(), StoreError> {
        self.session()?;
        Ok(self.buffers.register(buffer as usize, size)?)
    }

    /// Forgets the buffer registered at `buffer`; the zero-copy methods refuse its
    /// memory afterwards. A pointer that starts no registered buffer is
    /// `InvalidArgument`.
    ///
    /// # Safety
    ///
    /// `buffer` must be a pointer given to [`register_buffer`](Self::register_buffer).
    /// (Nothing is dereferenced here; `unsafe` is the reference's signature.)
    pub unsafe fn unregister_buffer(&self, buffer: *mut c_void) -> Result<(), StoreError> {
        self.session()?;
        Ok(self.buffers.unregister(buffer as usize)?)
    }

    // -----------------------------------------------------------------------
    // Batch operations
    // -----------------------------------------------------------------------

    /// [`put_from`](Self::put_from) for many keys, in one batch (one master round
    /// trip per phase, one transfer batch). Returns one code per key: 0, or the
    /// reference's negative code (`-600` for a range outside the registered buffers).
    /// Lists of different lengths are `InvalidArgument`.
    ///
    /// The native [`Store::batch_put`] takes slices and returns one typed `Result`
    /// per key.
    ///
    /// # Safety
    ///
    /// As for `put_from`, for each `(buffers[i], sizes[i])`.
    pub unsafe fn batch_put_from(
        &self,
        keys: &[&str],
        buffers: &[*mut c_void],
        sizes: &[usize],
        config: Option<&ReplicateConfig>,
    ) -> Result<Vec<i32>, StoreError> {
        let count = keys.len();
        if count == 0 {
            return Ok(Vec::new());
        }
        check_batch(keys, buffers, sizes)?;
        config.map(ReplicateConfig::check).transpose()?;
        let Ok(s) = self.session() else { return Ok(vec![codes::INVALID_PARAMS; count]) };
        let cfg = core_config(config, &s);
        let mut results = vec![0; count];
        let mut valid = Vec::with_capacity(count);
        for i in 0..count {
            match self.buffers.check(buffers[i] as usize, sizes[i]) {
                Ok(()) => valid.push(i),
                Err(e) => results[i] = StoreError::from(e).code(),
            }
        }
        let items: Vec<(&str, &[u8])> = valid
            .iter()
            .map(|&i| {
                // SAFETY: each range lies inside a registered buffer, which the caller
                // promised is valid memory unchanged during the call; shared slices
                // may overlap.
                let data = unsafe { std::slice::from_raw_parts(buffers[i] as *const u8, sizes[i]) };
                (keys[i], data)
            })
            .collect();
        for (&i, res) in valid.iter().zip(s.store.batch_put(&items, &cfg)) {
            results[i] = code_of(res);
        }
        Ok(results)
    }

    /// [`get_into`](Self::get_into) for many keys, in one batch. Returns one value
    /// per key: the object's length, or the reference's negative code (`-704`
    /// missing, `-600` a buffer too small or outside the registered buffers). Lists
    /// of different lengths are `InvalidArgument`.
    ///
    /// Destinations that overlap are read through the engine's buffers and copied
    /// (two `&mut` slices over the same bytes would alias). The native
    /// [`Store::batch_get_into`] takes `&mut [u8]` slices and returns one typed
    /// `Result` per key.
    ///
    /// # Safety
    ///
    /// As for `get_into`, for each `(buffers[i], sizes[i])`.
    pub unsafe fn batch_get_into(
        &self,
        keys: &[&str],
        buffers: &[*mut c_void],
        sizes: &[usize],
    ) -> Result<Vec<i64>, StoreError> {
        let count = keys.len();
        if count == 0 {
            return Ok(Vec::new());
        }
        check_batch(keys, buffers, sizes)?;
        let Ok(s) = self.session() else { return Ok(vec![codes::INVALID_PARAMS.into(); count]) };
        let mut results = vec![0i64; count];
        let mut wanted = Vec::with_capacity(count);
        for i in 0..count {
            match self.buffers.check(buffers[i] as usize, sizes[i]) {
                Ok(()) => wanted.push(i),
                Err(e) => results[i] = StoreError::from(e).code().into(),
            }
        }
        let wanted_keys: Vec<&str> = wanted.iter().map(|&i| keys[i]).collect();
        let length_or_code = |res: mooncake_core::Result<usize>| match res {
            Ok(n) => n as i64,
            Err(e) => StoreError::from(e).code().into(),
        };
        if BufferRegistry::disjoint(wanted.iter().map(|&i| (buffers[i] as usize, sizes[i])).collect()) {
            let mut bufs: Vec<&mut [u8]> = wanted
                .iter()
                // SAFETY: each range lies inside a registered buffer the caller
                // promised is writable and untouched during the call, and no two of
                // them overlap (`disjoint`), so the slices do not alias.
                .map(|&i| unsafe { std::slice::from_raw_parts_mut(buffers[i] as *mut u8, sizes[i]) })
                .collect();
            for (&i, res) in wanted.iter().zip(s.store.batch_get_into(&wanted_keys, &mut bufs)) {
                results[i] = length_or_code(res);
            }
        } else {
            for (&i, res) in wanted.iter().zip(s.store.batch_get(&wanted_keys)) {
                results[i] = match res {
                    Ok(data) if data.len() <= sizes[i] => {
                        // SAFETY: the destination lies inside a registered buffer of at
                        // least `sizes[i]` bytes; a raw copy creates no reference that
                        // could alias another destination, and the source is the
                        // engine's own memory.
                        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buffers[i] as *mut u8, data.len()) };
                        data.len() as i64
                    }
                    Ok(_) => codes::INVALID_PARAMS.into(),
                    Err(e) => length_or_code(Err(e)),
                };
            }
        }
        Ok(results)
    }

    /// [`is_exist`](Self::is_exist) for many keys with one master round trip.
    ///
    /// As in the reference, an error for any key fails the whole call; the native
    /// [`Store::batch_exists`] returns one `Result` per key.
    pub fn batch_is_exist(&self, keys: &[&str]) -> Result<Vec<bool>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        for key in keys {
            check_str(key)?;
        }
        let s = self.session()?;
        s.store.batch_exists(keys).into_iter().map(|r| r.map_err(StoreError::from)).collect()
    }

    // -----------------------------------------------------------------------
    // Internal helpers
    // -----------------------------------------------------------------------

    /// The connected session; before `setup`, `OperationFailed(-600)`, the
    /// reference's answer to a client that is not initialized.
    fn session(&self) -> Result<Arc<Session>, StoreError> {
        self.session.read().clone().ok_or(StoreError::OperationFailed(codes::INVALID_PARAMS))
    }
}

/// Leaves the master: this client's segment is unmounted (with the objects on it)
/// and its registered buffers are forgotten.
impl Drop for MooncakeStore {
    fn drop(&mut self) {
        // Explicit (rather than the fields' own drop) to say that this is where the
        // store leaves the pool, as `mooncake_store_destroy` does in the reference.
        drop(self.session.get_mut().take());
        self.buffers.clear();
    }
}

/// `tcp`, `rdma` (with the `rdma` feature) and this engine's own protocol names.
fn parse_protocol(protocol: &str) -> Result<Protocol, StoreError> {
    match protocol.to_ascii_lowercase().as_str() {
        "" | "tcp" => Ok(Protocol::Tcp),
        "rdma" if !cfg!(feature = "rdma") => Err(StoreError::InvalidArgument(
            "protocol \"rdma\" needs mooncake_store built with its `rdma` feature (or use \"tcp\")".into(),
        )),
        other => other.parse::<Protocol>().map_err(StoreError::InvalidArgument),
    }
}

/// `("host", port)` when `addr` ends in `:port`.
fn split_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicate_config_maps_to_the_engine() {
        // An embedded master: the session's own segment is real.
        let store = Store::builder().global_segment_size(1 << 20).build().unwrap();
        let segment = store.segment_name().unwrap();
        let own = segment.clone().unwrap();
        let session = Session { store, hostname: "node-a:1234".into(), segment };
        let cfg = ReplicateConfig::default().to_core(&session);
        assert_eq!(cfg.replica_num, 1, "0 means the default, one replica");
        assert!(!cfg.soft_pin);
        let cfg = ReplicateConfig {
            replica_num: 3,
            with_soft_pin: false,
            with_hard_pin: true,
            // Own hostname, unknown names, a native name, the own segment again.
            preferred_segments: vec!["node-a:1234".into(), "seg-0".into(), "10.0.0.9:17000#2".into(), own.clone()],
        }
        .to_core(&session);
        assert_eq!(cfg.replica_num, 3);
        assert!(cfg.soft_pin, "a hard pin is a soft pin here");
        assert_eq!(cfg.preferred_segments, [own.as_str(), "10.0.0.9:17000#2"]);
        let bad = ReplicateConfig { preferred_segments: vec!["bad\0segment".into()], ..Default::default() };
        assert!(matches!(bad.check(), Err(StoreError::InvalidString(_))));
    }

    #[test]
    fn protocols() {
        assert_eq!(parse_protocol("tcp").unwrap(), Protocol::Tcp);
        assert_eq!(parse_protocol("TCP").unwrap(), Protocol::Tcp);
        assert_eq!(parse_protocol("").unwrap(), Protocol::Tcp);
        assert_eq!(parse_protocol("shm").unwrap(), Protocol::Shm);
        assert!(matches!(parse_protocol("nvlink"), Err(StoreError::InvalidArgument(_))));
        match parse_protocol("rdma") {
            Ok(p) => assert!(cfg!(feature = "rdma") && p == Protocol::Rdma),
            Err(StoreError::InvalidArgument(m)) => assert!(!cfg!(feature = "rdma") && m.contains("`rdma` feature")),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn strings_with_nul_are_refused_like_c_strings() {
        assert!(check_str("fine").is_ok());
        match check_str("a\0b") {
            Err(StoreError::InvalidString(e)) => assert_eq!(e.nul_position(), 1),
            other => panic!("{other:?}"),
        }
    }
}
