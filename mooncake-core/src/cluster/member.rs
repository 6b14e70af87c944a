//! [`ClusterMember`]: a master's membership in a cluster, as a blocking handle over
//! the coordination thread.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::coordinator::{Control, Coordinator, Shared};
use super::member_config::{GroupHandler, MemberConfig, MemberStats};
use super::slots::SlotMap;
use crate::error::{Error, Result};

/// A master's membership in a cluster: it registers in etcd under a lease, leads the
/// slot groups the scheduler assigns to it (telling its [`GroupHandler`]), takes part in
/// electing the scheduler, and answers [`leads`](ClusterMember::leads) for every
/// request.
///
/// Dropping it leaves cleanly: every group is released (handler first), its leader keys
/// are deleted, its lease revoked.
///
/// Fencing: `leads(g)` is true only while the lease deadline is ahead, counted from the
/// last renewal etcd acknowledged, two thirds of the TTL after it was sent. etcd cannot
/// end the lease before a full TTL after that send, and only then can the group go to
/// another member; so two members never both answer for one group, even when one is
/// stopped (SIGSTOP) or cut off from etcd.
pub struct ClusterMember {
    shared: Arc<Shared>,
    control: mpsc::UnboundedSender<Control>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ClusterMember {
    /// Joins the cluster: connects to etcd, creates the cluster if it does not exist
    /// (with `config.groups` groups), registers, and starts the coordination thread.
    /// Returns once registered; groups arrive when the scheduler assigns them.
    ///
    /// Fails with [`Error::InvalidArgument`] for a bad config and
    /// [`Error::Coordination`] (retryable) when etcd cannot be reached.
    pub fn join(config: MemberConfig, handler: Arc<dyn GroupHandler>) -> Result<ClusterMember> {
        config.validate()?;
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (control, control_rx) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("mooncake-cluster".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(Error::Coordination(format!("cannot start a runtime: {e}"))));
                        return;
                    }
                };
                runtime.block_on(async move {
                    match Coordinator::start(config, handler).await {
                        Ok(c) => {
                            let _ = ready_tx.send(Ok(c.shared()));
                            c.run(control_rx).await;
                        }
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                        }
                    }
                });
            })
            .map_err(|e| Error::Coordination(format!("cannot start the coordination thread: {e}")))?;
        let started = ready_rx.recv().unwrap_or_else(|_| Err(Error::Coordination("coordination thread died".into())));
        match started {
            Ok(shared) => Ok(ClusterMember { shared, control, thread: Some(thread) }),
            Err(e) => {
                let _ = thread.join();
                Err(e)
            }
        }
    }

    /// This member's id: random, new per join.
    pub fn id(&self) -> &str {
        &self.shared.id
    }

    /// Whether this member leads `group` now: it holds the group and its lease deadline
    /// is ahead. Two atomic loads; call it for every request.
    pub fn leads(&self, group: u32) -> bool {
        self.shared.leads(group)
    }

    /// The latest slot map this member has seen.
    pub fn slot_map(&self) -> Arc<SlotMap> {
        self.shared.map.lock().clone()
    }

    /// The cluster's slot group count.
    pub fn groups(&self) -> u32 {
        self.shared.groups
    }

    /// The counters.
    pub fn stats(&self) -> MemberStats {
        self.shared.stats()
    }

    /// Stops the coordination thread at once, as if the process died: no handler
    /// calls, no key deleted, the lease left to expire. For tests of failover.
    #[doc(hidden)]
    pub fn crash(mut self) {
        self.stop(Control::Crash);
    }

    /// Blocks the coordination thread (lease renewals included) for `duration`, as if
    /// the process were stopped. For tests of fencing.
    #[doc(hidden)]
    pub fn stall(&self, duration: Duration) {
        let _ = self.control.send(Control::Stall(duration));
    }

    fn stop(&mut self, how: Control) {
        if let Some(thread) = self.thread.take() {
            let _ = self.control.send(how);
            let _ = thread.join();
        }
    }
}

impl Drop for ClusterMember {
    fn drop(&mut self) {
        self.stop(Control::Leave);
    }
}

impl std::fmt::Debug for ClusterMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterMember").field("id", &self.shared.id).field("groups", &self.shared.groups).finish()
    }
}
