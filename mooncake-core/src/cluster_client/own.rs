//! The master calls a cluster client routes by hand (tagged `own` in the table of
//! master calls): registration and heartbeats (the client's sessions with every
//! master), and the calls whose answers are not a plain fold of every master's.

use std::sync::atomic::Ordering;

use super::ClusterClient;
use crate::error::{Error, Result};
use crate::master::{ClientId, ClientRegistration, MasterApi, OffloadPlan, RecordUpdate};
use crate::rpc::convert::IntoWire;
use crate::rpc::unexpected;
use crate::rpc::wire::{Request, Response};

impl ClusterClient {
    /// Registers with every master of the map and mounts the extents; the id returned
    /// is the one the store sees (each master knows us by its own).
    pub(crate) fn register_client(&self) -> Result<ClientRegistration> {
        self.registered.store(true, Ordering::Release);
        let sessions = self.all_sessions();
        if sessions.is_empty() {
            return Err(Error::MasterUnavailable(format!(
                "no master of the cluster is reachable (is any running?){}",
                self.why_unreachable()
            )));
        }
        for s in sessions {
            if let Err(e) = self.id_at(&s) {
                tracing::warn!(master = s.addr, error = %e, "cannot register with a master");
            }
        }
        self.place_extents();
        let ttl = match self.client_ttl_ms.load(Ordering::Relaxed) {
            u64::MAX => 10_000,
            ttl => ttl,
        };
        Ok(ClientRegistration { client: self.logical, client_ttl_ms: ttl, incarnation: self.logical })
    }

    /// Follows the slot map: connects to new masters, mounts extents with new leaders.
    /// The masters themselves are heartbeaten by one thread per session; this fails only
    /// when none of them answered for half a client TTL.
    pub(crate) fn heartbeat(&self, _client: ClientId) -> Result<Vec<RecordUpdate>> {
        let sessions = self.all_sessions();
        self.place_extents();
        let ttl = self.client_ttl_ms.load(Ordering::Relaxed).min(10_000);
        let silent = self.elapsed_ms().saturating_sub(self.last_answer_ms.load(Ordering::Relaxed));
        if silent > ttl / 2 && !sessions.is_empty() && self.registered.load(Ordering::Acquire) {
            return Err(Error::MasterUnavailable(format!(
                "no master of the cluster answered a heartbeat for {silent} ms"
            )));
        }
        Ok(Vec::new())
    }

    /// Unregisters from every master; returns how many objects went with us.
    pub(crate) fn unregister_client(&self, _client: ClientId) -> Result<usize> {
        self.registered.store(false, Ordering::Release);
        let mut removed = 0;
        for s in self.sessions.read().values() {
            let id = s.client.swap(0, Ordering::AcqRel);
            if id != 0 {
                removed += s.rpc.unregister_client(id).unwrap_or(0);
            }
        }
        Ok(removed)
    }

    /// Keys of every master, at most `limit` in all.
    pub(crate) fn list_keys(&self, limit: usize) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        for s in self.all_sessions() {
            if keys.len() >= limit {
                break;
            }
            keys.extend(s.rpc.list_keys(limit - keys.len())?);
        }
        Ok(keys)
    }

    /// A page of every master's keys after `after`, sorted: each master's page,
    /// merged and cut at the least last key of the masters' pages (past it, a master
    /// whose page was cut may hold keys no page has shown yet), so the next page,
    /// after this one's last key, skips none.
    pub(crate) fn list_keys_after(&self, after: &str, limit: usize) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        let mut cut: Option<String> = None;
        for s in self.all_sessions() {
            let page = s.rpc.list_keys_after(after, limit)?;
            if let Some(last) = page.last() {
                if cut.as_ref().is_none_or(|c| last < c) {
                    cut = Some(last.clone());
                }
            }
            keys.extend(page);
        }
        keys.sort_unstable();
        // A key whose slot group moves may be listed by both masters a moment.
        keys.dedup();
        if let Some(cut) = cut {
            keys.truncate(keys.partition_point(|k| *k <= cut));
        }
        keys.truncate(limit);
        Ok(keys)
    }

    /// Where `client` serves loads from its SSD: asked of the master that told us of
    /// its disk replicas, else of each.
    pub(crate) fn disk_endpoint(&self, client: ClientId) -> Result<String> {
        let home = self.client_home.read().get(&client).cloned();
        if let Some(addr) = home {
            if let Ok(endpoint) = self.session(&addr).and_then(|s| s.rpc.disk_endpoint(client)) {
                return Ok(endpoint);
            }
        }
        let mut last = Error::UnknownClient(client);
        for s in self.all_sessions() {
            match s.rpc.disk_endpoint(client) {
                Ok(endpoint) => return Ok(endpoint),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// The SSD tier's plan: every master's, at most `max` tasks in all.
    pub(crate) fn offload_heartbeat(&self, _client: ClientId, max: usize) -> Result<OffloadPlan> {
        let mut plan = OffloadPlan::default();
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            let part = s.rpc.offload_heartbeat(id, max.saturating_sub(plan.tasks.len()))?;
            plan.tasks.extend(part.tasks);
            plan.discard.extend(part.discard);
        }
        Ok(plan)
    }

    /// Our record endpoint, told to every master (and to those registered later).
    pub(crate) fn mount_records(&self, _client: ClientId, endpoint: &str, key: &[u8]) -> Result<()> {
        self.set_record_endpoint(endpoint.to_owned(), key.to_vec());
        for s in self.all_sessions() {
            let id = self.id_at(&s)?;
            s.rpc.mount_records(id, endpoint, key)?;
        }
        Ok(())
    }

    /// Ends a read lease of each key, at the leaders of their groups (one answer for
    /// the whole batch).
    pub(crate) fn release_leases(&self, keys: &[&str]) -> Result<()> {
        let answers = self.on_keys(
            keys,
            false,
            |_, part| Request::ReleaseLeases { keys: part.into_wire() },
            |response, n| {
                let r = match response {
                    Response::ReleaseLeases(wire) => wire.map_err(Error::from),
                    other => Err(unexpected(other)),
                };
                (0..n).map(|_| r.clone()).collect()
            },
            |_, _| {},
            &|acc, more| {
                if let (Request::ReleaseLeases { keys: all }, Request::ReleaseLeases { keys: tail }) = (acc, more) {
                    all.extend(tail);
                }
            },
            // One answer for a whole request: each part gets it.
            &|response, lens| lens.iter().map(|_| response.clone()).collect(),
        );
        answers.into_iter().find(|r| r.is_err()).unwrap_or(Ok(()))
    }
}
