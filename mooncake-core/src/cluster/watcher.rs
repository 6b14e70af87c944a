//! [`SlotMapWatcher`]: the slot map for clients and storage nodes, kept current by an
//! etcd watch on a thread of its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::sync::mpsc;

use super::address::EtcdAddress;
use super::client::Etcd;
use super::credentials::EtcdCredentials;
use super::layout::Layout;
use super::mirror::{read_config, Mirror};
use super::slots::SlotMap;
use crate::error::{Error, Result};

/// Deadline of the watcher's etcd requests.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Pause before reloading after the watch failed.
const RETRY: Duration = Duration::from_millis(200);

struct State {
    map: Arc<SlotMap>,
    members: Vec<(String, String)>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// The slot map of a cluster, for clients and storage nodes: loaded when connecting,
/// then kept current by a watch (reloaded after etcd comes back).
///
/// ```no_run
/// use std::time::Duration;
/// use mooncake_core::cluster::{EtcdAddress, SlotMapWatcher};
/// let watcher = SlotMapWatcher::connect(&"etcd://127.0.0.1:2379/prod".parse()?)?;
/// let map = watcher.map();
/// if let Some(leader) = map.leader_of_key("layer0/block7") {
///     println!("ask {} (epoch {})", leader.addr, leader.epoch);
/// }
/// let newer = watcher.wait_change(map.version(), Duration::from_secs(1));
/// # Ok::<(), mooncake_core::Error>(())
/// ```
pub struct SlotMapWatcher {
    shared: Arc<Shared>,
    stop: mpsc::UnboundedSender<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SlotMapWatcher {
    /// Connects and loads the map. Fails with [`Error::Coordination`] (retryable) when
    /// etcd cannot be reached or no master has created the cluster yet.
    pub fn connect(addr: &EtcdAddress) -> Result<SlotMapWatcher> {
        Self::connect_with(addr, &EtcdCredentials::default())
    }

    /// [`connect`](Self::connect) to an etcd that asks for `credentials`.
    pub fn connect_with(addr: &EtcdAddress, credentials: &EtcdCredentials) -> Result<SlotMapWatcher> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, mut stop_rx) = mpsc::unbounded_channel::<()>();
        let addr = addr.clone();
        let credentials = credentials.clone();
        let thread = std::thread::Builder::new()
            .name("mooncake-slot-watch".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(Error::Coordination(format!("cannot start a runtime: {e}"))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let (etcd, mut mirror) = match load(&addr, &credentials).await {
                        Ok(loaded) => loaded,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let shared = Arc::new(Shared {
                        state: Mutex::new(State {
                            map: Arc::new(mirror.view.slot_map()),
                            members: mirror.view.member_list(),
                        }),
                        changed: Condvar::new(),
                    });
                    let _ = ready_tx.send(Ok(shared.clone()));
                    loop {
                        let watching = mirror.is_watching();
                        tokio::select! {
                            biased;
                            _ = stop_rx.recv() => return,
                            r = mirror.next(), if watching => {
                                if let Err(e) = r {
                                    tracing::warn!(cluster = %addr.cluster, "slot map watch: {e}");
                                }
                            }
                            _ = tokio::time::sleep(RETRY), if !watching => {
                                if let Err(e) = mirror.resync(&etcd).await {
                                    tracing::debug!(cluster = %addr.cluster, "cannot reload the slot map: {e}");
                                }
                            }
                        }
                        publish(&shared, &mirror);
                    }
                });
            })
            .map_err(|e| Error::Coordination(format!("cannot start the slot map thread: {e}")))?;
        let started = ready_rx.recv().unwrap_or_else(|_| Err(Error::Coordination("slot map thread died".into())));
        match started {
            Ok(shared) => Ok(SlotMapWatcher { shared, stop, thread: Some(thread) }),
            Err(e) => {
                let _ = thread.join();
                Err(e)
            }
        }
    }

    /// The latest map.
    pub fn map(&self) -> Arc<SlotMap> {
        self.shared.state.lock().map.clone()
    }

    /// Blocks until the map's version differs from `seen` or `timeout` passed; returns
    /// the map then.
    pub fn wait_change(&self, seen: u64, timeout: Duration) -> Arc<SlotMap> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.state.lock();
        while state.map.version() == seen {
            if self.shared.changed.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        state.map.clone()
    }

    /// Live masters as `(member id, address)`, sorted by id.
    pub fn members(&self) -> Vec<(String, String)> {
        self.shared.state.lock().members.clone()
    }
}

impl Drop for SlotMapWatcher {
    fn drop(&mut self) {
        let _ = self.stop.send(());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for SlotMapWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotMapWatcher").field("version", &self.map().version()).finish()
    }
}

/// Connects, reads the config and loads the cluster.
async fn load(addr: &EtcdAddress, credentials: &EtcdCredentials) -> Result<(Etcd, Mirror)> {
    let etcd = Etcd::connect(&addr.endpoints, REQUEST_TIMEOUT, credentials).await?;
    let layout = Layout::new(&addr.cluster);
    let groups = read_config(&etcd, &layout).await?.ok_or_else(|| {
        Error::Coordination(format!("cluster {addr}: no master has created it yet (no config in etcd)"))
    })?;
    let mut mirror = Mirror::new(layout, groups);
    mirror.resync(&etcd).await?;
    Ok((etcd, mirror))
}

/// Publishes the mirror's map and members if they changed, waking waiters.
fn publish(shared: &Shared, mirror: &Mirror) {
    let mut state = shared.state.lock();
    let version = mirror.view.leaders_revision as u64;
    let mut changed = false;
    if state.map.version() != version {
        state.map = Arc::new(mirror.view.slot_map());
        changed = true;
    }
    let members = mirror.view.member_list();
    if state.members != members {
        state.members = members;
        changed = true;
    }
    if changed {
        shared.changed.notify_all();
    }
}
