//! `setup`'s arguments: the reference's positional form and its dict form.

use std::collections::HashMap;
use std::hash::BuildHasher;

use mooncake_core::{parse_size, Protocol, SsdOffloadConfig, Store, StoreBuilder};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::codes::INVALID_PARAMS;

/// The names of `setup`'s arguments, in the reference's positional order.
const POSITIONAL: [&str; 13] = [
    "local_hostname",
    "metadata_server",
    "global_segment_size",
    "local_buffer_size",
    "protocol",
    "rdma_devices",
    "master_server_addr",
    "engine",
    "enable_ssd_offload",
    "ssd_offload_path",
    "tenant_id",
    "enable_client_http_server",
    "client_http_port",
];

/// The tenant whose keys this store holds (the only one).
const DEFAULT_TENANT: &str = "default";

/// Ports the reference picks a client's port from when its hostname names none.
const PORT_RANGE: (u16, u16) = (12300, 14300);

/// SSD tier size when `enable_ssd_offload` is set and `MOONCAKE_SSD_CAPACITY` is not.
const DEFAULT_SSD_CAPACITY: u64 = 16 << 30;

/// Where the SSD tier goes when `enable_ssd_offload` is set without a path, as in the
/// reference: this variable, else its default directory.
const SSD_PATH_VARIABLE: &str = "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH";
const DEFAULT_SSD_PATH: &str = "/data/file_storage";

/// Why `setup`'s arguments were refused.
#[derive(Debug)]
pub enum SetupError {
    /// An argument `setup` does not take (raised as `TypeError`, as the reference's
    /// binding does: SGLang retries without the keywords a build lacks).
    Type(String),
    /// A value it refuses: the code `setup` returns.
    Code(i32),
}

impl From<i32> for SetupError {
    fn from(code: i32) -> Self {
        SetupError::Code(code)
    }
}

/// What `setup` was asked for.
#[derive(Debug)]
pub struct SetupArgs {
    /// `host` or `host:port` this client serves its segment on.
    pub local_hostname: String,
    /// Bytes given to the pool.
    pub global_segment_size: u64,
    /// `tcp`, or anything else for shared memory to same-host peers and TCP beyond.
    pub protocol: String,
    /// `host:port` of the master daemon, or `etcd://H:P[,H:P]/CLUSTER` for a cluster
    /// of masters found through etcd.
    pub master_server_addr: String,
    /// SSD tier directory, when offload is on.
    pub ssd_offload_path: Option<String>,
    /// A transfer engine was handed over (SGLang passes the reference's, already
    /// listening at `local_hostname`'s port): that port is the engine's, so this
    /// client listens on another of the same host.
    pub engine_given: bool,
}

impl SetupArgs {
    /// Reads `setup(*args, **kwargs)`: either the 7 positional arguments (and the
    /// optional ones after them, by position or name), or one dict (positional or
    /// `config=`) whose values may be strings, with sizes like `"16 MB"`.
    pub fn parse(args: &Bound<'_, PyTuple>, kwargs: Option<&Bound<'_, PyDict>>) -> Result<Self, SetupError> {
        let mut values: HashMap<String, Bound<'_, PyAny>> = HashMap::new();
        let dict = match (args.len(), kwargs) {
            (1, None) => args.get_item(0).ok().and_then(|a| a.cast_into::<PyDict>().ok()),
            (0, Some(kw)) if kw.len() == 1 => {
                kw.get_item("config").ok().flatten().and_then(|a| a.cast_into::<PyDict>().ok())
            }
            _ => None,
        };
        if let Some(d) = dict {
            for (k, v) in d.iter() {
                values.insert(k.str().map_err(|_| INVALID_PARAMS)?.to_string(), v);
            }
        } else {
            if args.len() > POSITIONAL.len() {
                return Err(SetupError::Type(format!(
                    "setup() takes at most {} positional arguments ({} given)",
                    POSITIONAL.len(),
                    args.len()
                )));
            }
            for (name, v) in POSITIONAL.iter().zip(args.iter()) {
                values.insert((*name).to_owned(), v);
            }
            if let Some(kw) = kwargs {
                for (k, v) in kw.iter() {
                    let k = k.str().map_err(|_| INVALID_PARAMS)?.to_string();
                    if !POSITIONAL.contains(&k.as_str()) {
                        return Err(SetupError::Type(format!("setup() got an unexpected keyword argument '{k}'")));
                    }
                    if values.contains_key(&k) {
                        return Err(SetupError::Type(format!("setup() got multiple values for argument '{k}'")));
                    }
                    values.insert(k, v);
                }
            }
        }
        let text = |name: &str, default: &str| -> Result<String, i32> {
            match values.get(name) {
                Some(v) if !v.is_none() => Ok(v.str().map_err(|_| INVALID_PARAMS)?.to_string()),
                _ => Ok(default.to_owned()),
            }
        };
        let size = |name: &str| -> Result<u64, i32> { parse_size(&text(name, "16MB")?).map_err(|_| INVALID_PARAMS) };
        let local_hostname = text("local_hostname", "")?;
        if local_hostname.is_empty() {
            return Err(INVALID_PARAMS.into());
        }
        let offload = matches!(text("enable_ssd_offload", "false")?.to_ascii_lowercase().as_str(), "true" | "1");
        let mut ssd_path = text("ssd_offload_path", "")?;
        if offload && ssd_path.is_empty() {
            ssd_path = std::env::var(SSD_PATH_VARIABLE).unwrap_or_else(|_| DEFAULT_SSD_PATH.to_owned());
        }
        let engine_given = values.get("engine").is_some_and(|e| !e.is_none());
        // One namespace of keys: a tenant other than the default would share it with
        // every other tenant. Refused as an argument this build does not take (SGLang
        // then says tenants need another build, instead of mixing their keys).
        let tenant = text("tenant_id", DEFAULT_TENANT)?;
        if !tenant.is_empty() && tenant != DEFAULT_TENANT {
            return Err(SetupError::Type(format!(
                "setup() got an unsupported keyword argument 'tenant_id' ({tenant:?}): this store has one \
                 namespace of keys, the default tenant's"
            )));
        }
        // The reference's staging buffer size is checked like the reference checks it,
        // then unused: this engine moves bytes straight between the caller's memory
        // and the segments, and recycles read buffers by size class on demand.
        size("local_buffer_size")?;
        Ok(Self {
            local_hostname,
            global_segment_size: size("global_segment_size")?,
            protocol: text("protocol", "tcp")?,
            master_server_addr: text("master_server_addr", "127.0.0.1:50051")?,
            ssd_offload_path: offload.then_some(ssd_path),
            engine_given,
        })
    }

    /// The address to listen on: the hostname with its port, or, like the reference, a
    /// free port of 12300..=14300 (any free port if that range is full); the latter
    /// also when the port is a transfer engine's that was handed over.
    fn listen_address(&self) -> String {
        let host = match split_port(&self.local_hostname) {
            Some(_) if !self.engine_given => return self.local_hostname.clone(),
            Some((host, _)) => host,
            None => self.local_hostname.as_str(),
        };
        let span = u64::from(PORT_RANGE.1 - PORT_RANGE.0) + 1;
        // Start at a random point of the range so that clients started together spread.
        let start = std::collections::hash_map::RandomState::new().hash_one(std::process::id()) % span;
        for i in 0..span.min(64) {
            let port = PORT_RANGE.0 + ((start + i * 7919) % span) as u16;
            // The listener is dropped at once; the engine binds the port right after.
            if std::net::TcpListener::bind((host, port)).is_ok() {
                return format!("{host}:{port}");
            }
        }
        format!("{host}:0")
    }

    /// A builder for the store these arguments describe. `MOONCAKE_SECRET`, when set,
    /// is the secret shared with the master and the other clients.
    pub fn builder(&self) -> Result<StoreBuilder, i32> {
        let protocol = if self.protocol.eq_ignore_ascii_case("tcp") { Protocol::Tcp } else { Protocol::Shm };
        let mut b = Store::builder()
            .master_address(&self.master_server_addr)
            .global_segment_size(self.global_segment_size)
            .protocol(protocol)
            .listen(&self.listen_address());
        if let Ok(secret) = std::env::var("MOONCAKE_SECRET") {
            b = b.shared_secret(secret.as_bytes());
        }
        if let Some(dir) = &self.ssd_offload_path {
            let capacity = match std::env::var("MOONCAKE_SSD_CAPACITY") {
                Ok(c) => parse_size(&c).map_err(|_| INVALID_PARAMS)?,
                Err(_) => DEFAULT_SSD_CAPACITY,
            };
            b = b.ssd_offload(SsdOffloadConfig::new(dir, capacity));
        }
        Ok(b)
    }

    /// `host:port` as `get_hostname` reports it: the given host, with the port the
    /// segment is served on.
    pub fn hostname(&self, endpoint: &str) -> String {
        let host = match split_port(&self.local_hostname) {
            Some((host, _)) => host,
            None => self.local_hostname.as_str(),
        };
        match split_port(endpoint) {
            Some((_, port)) => format!("{host}:{port}"),
            None => self.local_hostname.clone(),
        }
    }
}

/// `("host", port)` when `addr` ends in `:port`.
fn split_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    Some((host, port.parse().ok()?))
}
