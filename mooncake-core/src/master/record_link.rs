//! The master's links to storage nodes' record endpoints: the traits a node's records
//! are reached through, one queue per node with group commit, and the tickets a call
//! waits on before it acknowledges.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::master::types::{ClientId, RecordUpdate};

/// Where a storage node's records live, as the master sees it: it applies changes to
/// the records of the node's segments and returns once they are applied.
pub trait RecordSink: Send + Sync {
    /// Applies `updates`, in order; returns once they are applied.
    fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()>;
}

/// Opens a [`RecordSink`] for the record endpoint a storage node announced with
/// `mount_records`. The master daemon uses the RPC one (`rpc::RpcRecordConnector`).
pub trait RecordConnector: Send + Sync {
    /// Connects to the node's record endpoint, proving the node's record `key` (fails
    /// if it cannot be reached or refuses the key).
    fn connect(&self, endpoint: &str, key: &[u8]) -> Result<Arc<dyn RecordSink>>;
}

/// Most updates sent to a node in one frame.
const MAX_UPDATES_PER_FRAME: usize = 65_536;

/// The queue of record updates for one storage node. There is no sender thread: a
/// caller that waits for its updates sends, itself, everything queued so far in one
/// frame when no send is in flight (it leads), or waits for the send in flight and
/// then for the next, which carries what queued meanwhile (group commit).
pub(crate) struct NodeLink {
    client: ClientId,
    sink: Arc<dyn RecordSink>,
    state: Mutex<LinkState>,
    /// Wakes waiters when a send finished or the link closed.
    cond: Condvar,
}

#[derive(Default)]
struct LinkState {
    queue: VecDeque<RecordUpdate>,
    /// Updates ever queued / ever delivered: a waiter's ticket is `queued` after it
    /// queued its own, and it is done once `delivered` reaches it.
    queued: u64,
    delivered: u64,
    /// A send is in flight (its leader releases the lock meanwhile).
    sending: bool,
    /// The node could not be told, or it was forgotten: nothing more is delivered.
    failed: bool,
}

impl NodeLink {
    pub(crate) fn new(client: ClientId, sink: Arc<dyn RecordSink>) -> Arc<Self> {
        Arc::new(NodeLink { client, sink, state: Mutex::new(LinkState::default()), cond: Condvar::new() })
    }

    /// Queues `update`; returns the ticket to wait for.
    pub(crate) fn push(&self, update: RecordUpdate) -> u64 {
        let mut st = self.state.lock();
        st.queue.push_back(update);
        st.queued += 1;
        st.queued
    }

    /// Waits until every update up to `ticket` is delivered, sending them if no one
    /// else is; false if the node failed or did not answer within `limit`.
    pub(crate) fn wait(&self, ticket: u64, limit: Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut st = self.state.lock();
        loop {
            if st.delivered >= ticket {
                return true;
            }
            if st.failed {
                return false;
            }
            if !st.sending && !st.queue.is_empty() {
                let n = st.queue.len().min(MAX_UPDATES_PER_FRAME);
                let batch: Vec<RecordUpdate> = st.queue.drain(..n).collect();
                st.sending = true;
                drop(st);
                let res = self.sink.apply_records(&batch);
                st = self.state.lock();
                st.sending = false;
                match res {
                    Ok(()) => st.delivered += batch.len() as u64,
                    Err(e) => {
                        tracing::warn!(
                            client = format!("{:#x}", self.client),
                            error = %e,
                            "a storage node cannot be told of its records"
                        );
                        st.failed = true;
                    }
                }
                self.cond.notify_all();
                continue;
            }
            if self.cond.wait_until(&mut st, deadline).timed_out() {
                return st.delivered >= ticket;
            }
        }
    }

    /// Sends whatever is queued (updates nobody waits for, e.g. eviction's).
    pub(crate) fn flush(&self, limit: Duration) -> bool {
        let ticket = self.state.lock().queued;
        self.wait(ticket, limit)
    }

    /// Whether updates are queued and not sent.
    pub(crate) fn has_queued(&self) -> bool {
        !self.state.lock().queue.is_empty()
    }

    /// Delivers nothing more; waiters see the node as failed.
    pub(crate) fn close(&self) {
        self.state.lock().failed = true;
        self.cond.notify_all();
    }
}

/// Record updates a call queued for storage nodes, to wait for before acknowledging.
#[derive(Default)]
#[must_use = "a put or remove is durable only once its record updates are delivered"]
pub(crate) struct RecordWait {
    pub(crate) tickets: Vec<(ClientId, Arc<NodeLink>, u64)>,
}

impl RecordWait {
    pub(crate) fn add(&mut self, client: ClientId, link: Arc<NodeLink>, ticket: u64) {
        match self.tickets.iter_mut().find(|(c, _, _)| *c == client) {
            Some(t) => t.2 = t.2.max(ticket),
            None => self.tickets.push((client, link, ticket)),
        }
    }

    /// Adds every ticket of `other`.
    pub(crate) fn merge(&mut self, other: RecordWait) {
        for (c, l, t) in other.tickets {
            self.add(c, l, t);
        }
    }
}
