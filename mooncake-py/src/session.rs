//! A connected client: the store, the names it answers to, and what it resolves
//! against the master (segment names) for the calls that name segments.

use std::time::{Duration, Instant};

use mooncake_core::Store;
use parking_lot::Mutex;

use crate::codes::INVALID_PARAMS;
use crate::config::ReplicateConfig;
use crate::layer_sessions::{GetSessions, PutSessions};
use crate::tasks::TaskTable;

/// How long a list of the mounted segments is reused before the master is asked again
/// (names only change when clients come and go).
const SEGMENTS_TTL: Duration = Duration::from_secs(1);

/// A connected client and the name it reports.
pub struct Session {
    /// The engine's client.
    pub store: Store,
    /// What `get_hostname` answers.
    pub hostname: String,
    /// Segments on this node: the client's own, or the storage process a dummy client
    /// attached to (`prefer_alloc_in_same_node` places there).
    pub local_segments: Vec<String>,
    /// Copy and move tasks started by this client.
    pub tasks: TaskTable,
    /// The objects of the open get sessions (`batch_get_session_start`).
    pub get_sessions: GetSessions,
    /// The objects of the open put sessions (`batch_put_session_start`).
    pub put_sessions: PutSessions,
    segments: Mutex<Option<(Instant, Vec<String>)>>,
}

impl Session {
    /// A session over `store`.
    pub fn new(store: Store, hostname: String, local_segments: Vec<String>) -> Self {
        Self {
            store,
            hostname,
            local_segments,
            tasks: TaskTable::default(),
            get_sessions: GetSessions::default(),
            put_sessions: PutSessions::default(),
            segments: Mutex::new(None),
        }
    }

    /// Names of the mounted segments (`endpoint#n`), as the master reported them at
    /// most [`SEGMENTS_TTL`] ago.
    pub fn segment_names(&self) -> mooncake_core::Result<Vec<String>> {
        if let Some((at, names)) = &*self.segments.lock() {
            if at.elapsed() < SEGMENTS_TTL {
                return Ok(names.clone());
            }
        }
        let names: Vec<String> = self.store.master().stats()?.segment_usage.into_iter().map(|u| u.name).collect();
        *self.segments.lock() = Some((Instant::now(), names.clone()));
        Ok(names)
    }

    /// The mounted segment that `wanted` names: its exact name (`endpoint#n`), or, as
    /// the reference names segments, the `host:port` of its endpoint (what
    /// `get_hostname` returns, or the descriptors' `transport_endpoint`).
    pub fn resolve_segment(&self, wanted: &str) -> Option<String> {
        if wanted.is_empty() {
            return None;
        }
        let names = self.segment_names().ok()?;
        resolve_in(&names, wanted)
    }

    /// The engine's placement for a write of `n` keys with `config`, or the code to
    /// return: the reference's checks (`group_ids` gives one group per key,
    /// `prefer_alloc_in_same_node` wants one replica), preferred segments named as
    /// the reference names them resolved to segment names (unknown ones skipped), and
    /// `prefer_alloc_in_same_node` placing on this node's segments first.
    pub fn write_config(
        &self,
        config: Option<&ReplicateConfig>,
        n: usize,
    ) -> Result<mooncake_core::ReplicateConfig, i32> {
        let default = ReplicateConfig::default();
        let c = config.unwrap_or(&default);
        if c.group_ids.as_ref().is_some_and(|g| g.len() != n) {
            return Err(INVALID_PARAMS);
        }
        if c.prefer_alloc_in_same_node && c.replica_num != 1 {
            return Err(INVALID_PARAMS);
        }
        let mut cfg = c.to_core()?;
        if !cfg.preferred_segments.is_empty() {
            // As in the reference, a preferred segment that is not mounted is skipped
            // (placement goes on with the others), not an error.
            if let Ok(names) = self.segment_names() {
                let mut resolved: Vec<String> = Vec::with_capacity(cfg.preferred_segments.len());
                for p in &cfg.preferred_segments {
                    if let Some(name) = resolve_in(&names, p) {
                        if !resolved.contains(&name) {
                            resolved.push(name);
                        }
                    }
                }
                cfg.preferred_segments = resolved;
            }
        }
        if c.prefer_alloc_in_same_node {
            for s in &self.local_segments {
                if !cfg.preferred_segments.contains(s) {
                    cfg.preferred_segments.push(s.clone());
                }
            }
        }
        Ok(cfg)
    }
}

/// `host:port` of a segment name (`endpoint#n`).
pub fn endpoint_of(name: &str) -> &str {
    name.rsplit_once('#').map_or(name, |(e, _)| e)
}

/// Whether `host` names this machine's loopback interface.
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// The name among `names` that `wanted` designates (see [`Session::resolve_segment`]):
/// exact, then by endpoint, then by port when both hosts are loopback spellings
/// (`localhost:1234` and `127.0.0.1:1234` are one endpoint).
pub fn resolve_in(names: &[String], wanted: &str) -> Option<String> {
    if let Some(n) = names.iter().find(|n| n.as_str() == wanted) {
        return Some(n.clone());
    }
    if let Some(n) = names.iter().find(|n| endpoint_of(n) == wanted) {
        return Some(n.clone());
    }
    let (host, port) = wanted.rsplit_once(':')?;
    names
        .iter()
        .find(|n| {
            endpoint_of(n)
                .rsplit_once(':')
                .is_some_and(|(h, p)| p == port && (h == host || is_loopback(h) && is_loopback(host)))
        })
        .cloned()
}
