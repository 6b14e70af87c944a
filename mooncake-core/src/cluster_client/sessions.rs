//! Sessions: one per master of the cluster. The client registers with every master
//! (each knows it by an id of its own) and heartbeats each on a thread of its own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_transfer::SharedSecret;
use parking_lot::Mutex;

use super::ClusterClient;
use crate::error::{Error, Result};
use crate::master::{ClientId, MasterApi};
use crate::rpc::RpcMasterClient;

/// One master of the cluster, as this client knows it.
pub(crate) struct Session {
    pub(crate) addr: String,
    pub(crate) rpc: RpcMasterClient,
    /// Our client id at this master (0: not registered).
    pub(crate) client: AtomicU64,
    /// Held while registering (see `register_session`).
    registering: Mutex<()>,
    /// When this master last answered a heartbeat or a registration: silent for
    /// longer than a client TTL while it kept running, we may have been forgotten
    /// and missed removals of what we hold.
    last_heard: Mutex<Instant>,
}

impl ClusterClient {
    /// The session with the master at `addr`, connecting (and registering, once the
    /// store registered) on first use.
    pub(crate) fn session(&self, addr: &str) -> Result<Arc<Session>> {
        if let Some(s) = self.sessions.read().get(addr) {
            return Ok(s.clone());
        }
        let rpc =
            RpcMasterClient::connect_with_timeout(addr, self.secret.as_deref().map(SharedSecret::new), self.timeout)?;
        let session = Arc::new(Session {
            addr: addr.to_owned(),
            rpc,
            client: AtomicU64::new(0),
            registering: Mutex::new(()),
            last_heard: Mutex::new(Instant::now()),
        });
        let (session, new) = {
            let mut sessions = self.sessions.write();
            match sessions.get(addr) {
                Some(s) => (s.clone(), false),
                None => {
                    sessions.insert(addr.to_owned(), session.clone());
                    (session, true)
                }
            }
        };
        if new {
            self.spawn_heartbeats(&session)?;
            if self.registered.load(Ordering::Acquire) {
                self.id_at(&session)?;
            }
        }
        Ok(session)
    }

    /// Heartbeats `s` on a thread of its own, so that a master that stopped answering
    /// delays no other's heartbeats (the others would expire us meanwhile). Ends with
    /// the client, or once the session was replaced.
    fn spawn_heartbeats(&self, s: &Arc<Session>) -> Result<()> {
        let (me, session) = (self.me.clone(), Arc::downgrade(s));
        std::thread::Builder::new()
            .name("mooncake-cluster-heartbeat".into())
            .spawn(move || loop {
                let period = {
                    let Some(me) = me.upgrade() else { return };
                    let ttl = me.client_ttl_ms.load(Ordering::Relaxed).min(10_000);
                    Duration::from_millis((ttl / 4).clamp(1, 250))
                };
                std::thread::sleep(period);
                let (Some(me), Some(s)) = (me.upgrade(), session.upgrade()) else { return };
                if !me.registered.load(Ordering::Acquire) {
                    continue;
                }
                let Ok(id) = me.id_at(&s) else { continue };
                match s.rpc.heartbeat(id) {
                    Ok(updates) => {
                        me.note_answer();
                        *s.last_heard.lock() = Instant::now();
                        let _ = me.apply_updates(updates, super::UpdatesFrom::Heartbeat);
                    }
                    Err(Error::UnknownClient(_)) => {
                        if me.register_session(&s, id).is_ok() {
                            me.note_answer();
                            // Its extents are mounted again on the store's next heartbeat.
                        }
                    }
                    Err(e) => tracing::debug!(master = s.addr, error = %e, "heartbeat failed"),
                }
            })
            .map(|_| ())
            .map_err(|e| Error::InvalidArgument(format!("cannot start a heartbeat thread: {e}")))
    }

    pub(crate) fn elapsed_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// A master answered a heartbeat.
    pub(crate) fn note_answer(&self) {
        self.last_answer_ms.fetch_max(self.elapsed_ms(), Ordering::Relaxed);
    }

    /// Registers with one master, in place of the id `stale` it no longer knows (0:
    /// none yet), and tells it where our records are served. One registration at a
    /// time per master: callers that saw the same stale id share the new one (two ids
    /// would leave extents mounted under one that nobody heartbeats, and it expires).
    pub(crate) fn register_session(&self, s: &Session, stale: ClientId) -> Result<ClientId> {
        let _one = s.registering.lock();
        let current = s.client.load(Ordering::Acquire);
        if current != stale {
            return Ok(current);
        }
        let reg = s.rpc.register_client()?;
        self.note_answer();
        self.client_ttl_ms.fetch_min(reg.client_ttl_ms, Ordering::Relaxed);
        if stale != 0 {
            // Registered again: said before any extent is mounted there, as a single
            // master's node does (a dial the master's address refused proves it was
            // down from then on: that silence does not count).
            let heard = *s.last_heard.lock();
            let gone = s.rpc.last_refused().filter(|&at| at > heard).unwrap_or_else(Instant::now);
            let silent = gone.saturating_duration_since(heard);
            if silent > Duration::from_millis(reg.client_ttl_ms) {
                tracing::warn!(
                    master = s.addr,
                    ?silent,
                    "silent for longer than the client TTL: we may have missed updates"
                );
                if let Err(e) = s.rpc.missed_updates(reg.client) {
                    tracing::debug!(master = s.addr, error = %e, "the master does not take the note");
                }
            }
        }
        *s.last_heard.lock() = Instant::now();
        s.client.store(reg.client, Ordering::Release);
        if let Some((endpoint, key)) = self.record_endpoint.lock().clone() {
            if let Err(e) = s.rpc.mount_records(reg.client, &endpoint, &key) {
                tracing::warn!(master = s.addr, error = %e, "the master cannot reach our record endpoint");
            }
        }
        // Extents it led are not mounted there anymore: mount them again.
        for x in &self.extents {
            let mut m = x.mount.lock();
            if m.as_ref().is_some_and(|(a, _, _)| a == &s.addr) {
                *m = None;
            }
        }
        Ok(reg.client)
    }

    /// Our client id at `s`, registering if needed.
    pub(crate) fn id_at(&self, s: &Session) -> Result<ClientId> {
        match s.client.load(Ordering::Acquire) {
            0 => self.register_session(s, 0),
            id => Ok(id),
        }
    }

    /// Why the masters the slot map names cannot be reached (": " and their errors,
    /// or nothing if the map names none): a refused impostor or a wrong secret must
    /// not read as "is any running?".
    pub(crate) fn why_unreachable(&self) -> String {
        let errors: Vec<String> = self
            .maps
            .map()
            .masters()
            .into_iter()
            .filter_map(|(_, addr)| self.session(&addr).err().map(|e| e.to_string()))
            .collect();
        if errors.is_empty() {
            String::new()
        } else {
            format!(": {}", errors.join("; "))
        }
    }

    /// Sessions with every master the map names (connecting to new ones).
    pub(crate) fn all_sessions(&self) -> Vec<Arc<Session>> {
        let map = self.maps.map();
        for (_, addr) in map.masters() {
            if let Err(e) = self.session(&addr) {
                tracing::debug!(master = addr, error = %e, "master not reachable");
            }
        }
        let live: Vec<String> = map.masters().into_iter().map(|(_, a)| a).collect();
        self.sessions.read().values().filter(|s| live.contains(&s.addr)).cloned().collect()
    }
}
