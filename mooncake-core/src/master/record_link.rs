//! The master's links to storage nodes' record endpoints: the traits a node's records
//! are reached through, one queue per node with group commit, and the tickets a call
//! waits on before it acknowledges.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::Result;
use crate::master::generations::GenClock;
use crate::master::types::{ClientId, RecordUpdate};

/// Where a storage node's records live, as the master sees it: it applies changes to
/// the records of the node's segments and returns once they are applied.
pub trait RecordSink: Send + Sync {
    /// Applies `updates`, in order; returns once they are applied. Applying a batch
    /// twice, or a late copy of it after later ones, changes nothing more (updates are
    /// ordered by their generations).
    fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()>;

    /// After a failed [`apply_records`](Self::apply_records): whether the node is
    /// certainly gone (nothing listens at its endpoint any more), as opposed to slow or
    /// paused. Only a gone node is forgotten at once; a silent one is forgotten by its
    /// TTL. `false` unless the sink can tell.
    fn gone(&self) -> bool {
        false
    }

    /// Writes `updates` to the node without waiting for it to apply them, if that can
    /// be done at once (over a connection already open): the answer is read later by
    /// [`receive_records`](Self::receive_records). `None` when it cannot; the updates
    /// then go with [`apply_records`](Self::apply_records). `None` by default.
    fn send_records(&self, updates: &[RecordUpdate]) -> Option<Result<RecordsInFlight>> {
        let _ = updates;
        None
    }

    /// Waits for the answer to updates [`send_records`](Self::send_records) wrote:
    /// `Ok` once the node applied them.
    fn receive_records(&self, sent: RecordsInFlight) -> Result<()> {
        let _ = sent;
        Ok(())
    }
}

/// Record updates written to a node whose answer is not read yet: what
/// [`RecordSink::send_records`] returns, for [`RecordSink::receive_records`] of the
/// same sink (which knows what it holds).
pub struct RecordsInFlight(pub Box<dyn std::any::Any + Send>);

/// Opens a [`RecordSink`] for the record endpoint a storage node announced with
/// `mount_records`. The master daemon uses the RPC one (`rpc::RpcRecordConnector`).
pub trait RecordConnector: Send + Sync {
    /// Connects to the node's record endpoint, proving the node's record `key` (fails
    /// if it cannot be reached or refuses the key).
    fn connect(&self, endpoint: &str, key: &[u8]) -> Result<Arc<dyn RecordSink>>;
}

/// Most updates sent to a node in one frame.
const MAX_UPDATES_PER_FRAME: usize = 65_536;
/// Most updates written ahead in one frame ([`NodeLink::send_ahead`]), and about
/// the most bytes (keys, plus 64 bytes an update): a frame that small goes whole
/// into an idle socket's buffer.
const MAX_UPDATES_AHEAD: usize = 256;
const MAX_BYTES_AHEAD: usize = 32 << 10;
/// Pause before the first retry of a failed send; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(20);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// The queue of record updates for one storage node. There is no sender thread: a
/// caller that waits for its updates sends, itself, everything queued so far in one
/// frame when no send is in flight (it leads), or waits for the send in flight and
/// then for the next, which carries what queued meanwhile (group commit).
///
/// A send that fails (the node is slow, paused, or unreachable) puts its updates back
/// at the front of the queue; the next waiter (or heartbeat) sends them again after a
/// backoff. Nothing is dropped until the node is forgotten ([`close`](Self::close)).
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
    /// The updates of the frame in flight (one at a time), until its answer is read:
    /// what [`NodeLink::close`] gives back if the node is forgotten meanwhile. Unless
    /// it is `parked`, a thread writes it or reads its answer (the lock released).
    flight: Option<Arc<[RecordUpdate]>>,
    /// The frame was written ahead ([`NodeLink::send_ahead`]) and nobody reads its
    /// answer yet: the next waiter does.
    parked: Option<RecordsInFlight>,
    /// The node was forgotten: nothing more is delivered.
    closed: bool,
    /// Closed because the node's memory passed to its newer client id
    /// ([`NodeLink::close_into`]): that id's link and the ticket there that covers
    /// everything this one had not delivered.
    successor: Option<(Arc<NodeLink>, u64)>,
    /// The node is certainly gone (its endpoint refuses connections).
    gone: bool,
    /// Since when sends have been failing (`None`: the last one worked).
    failing_since: Option<Instant>,
    /// No new send before this (after a failure).
    retry_at: Option<Instant>,
    /// Failed sends in a row (for the backoff).
    failures: u32,
}

impl LinkState {
    /// A thread writes the frame in flight or reads its answer.
    fn busy(&self) -> bool {
        self.flight.is_some() && self.parked.is_none()
    }

    /// Puts `batch` back at the front of the queue, in order.
    fn requeue(&mut self, batch: &[RecordUpdate]) {
        for u in batch.iter().rev() {
            self.queue.push_front(u.clone());
        }
    }
}

/// How a wait for a ticket ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Delivery {
    /// The node applied every update up to the ticket.
    Done,
    /// Not yet, within the limit: the node is slow or paused (the updates stay queued).
    Pending,
    /// The node is certainly gone: it should be forgotten.
    Gone,
    /// The node was forgotten: the updates will never be delivered.
    Closed,
}

impl NodeLink {
    pub(crate) fn new(client: ClientId, sink: Arc<dyn RecordSink>) -> Arc<Self> {
        Arc::new(NodeLink { client, sink, state: Mutex::new(LinkState::default()), cond: Condvar::new() })
    }

    /// Queues the update `make` builds from a new generation of `clock` (taken under
    /// the queue's lock, so generations increase in queue order); returns the ticket
    /// to wait for.
    pub(crate) fn push(&self, clock: &GenClock, make: impl FnOnce(u64) -> RecordUpdate) -> u64 {
        let mut st = self.state.lock();
        st.queue.push_back(make(clock.next()));
        st.queued += 1;
        st.queued
    }

    /// Waits until every update up to `ticket` is delivered, sending them if no one
    /// else is, for at most `limit`.
    pub(crate) fn wait(&self, ticket: u64, limit: Duration) -> Delivery {
        let deadline = Instant::now() + limit;
        let mut st = self.state.lock();
        loop {
            if st.delivered >= ticket {
                return Delivery::Done;
            }
            if st.closed {
                return Delivery::Closed;
            }
            if st.gone {
                return Delivery::Gone;
            }
            let now = Instant::now();
            let may_send = st.retry_at.is_none_or(|t| now >= t);
            if let Some(sent) = st.parked.take() {
                // Written ahead: read its answer (busy meanwhile).
                drop(st);
                let res = self.sink.receive_records(sent);
                let gone = res.is_err() && self.sink.gone();
                st = self.state.lock();
                self.sent(&mut st, res, gone, now);
                continue;
            }
            if st.flight.is_none() && !st.queue.is_empty() && may_send {
                let batch = self.take_batch(&mut st);
                drop(st);
                let res = self.sink.apply_records(&batch);
                // Only a failed send asks whether the node is gone (a connection attempt).
                let gone = res.is_err() && self.sink.gone();
                st = self.state.lock();
                self.sent(&mut st, res, gone, now);
                continue;
            }
            // Wait for the send in flight, or the end of a backoff, within the limit.
            let until = match st.retry_at {
                Some(t) if !st.busy() && t < deadline => t,
                _ => deadline,
            };
            if self.cond.wait_until(&mut st, until).timed_out() && Instant::now() >= deadline {
                return if st.delivered >= ticket { Delivery::Done } else { Delivery::Pending };
            }
        }
    }

    /// Takes the next frame's updates off the queue: in flight from now on, with the
    /// caller sending it.
    fn take_batch(&self, st: &mut LinkState) -> Arc<[RecordUpdate]> {
        let n = st.queue.len().min(MAX_UPDATES_PER_FRAME);
        let batch: Arc<[RecordUpdate]> = st.queue.drain(..n).collect();
        st.flight = Some(batch.clone());
        batch
    }

    /// The end of the send of the frame in flight (`res`): delivered, or back at the
    /// front of the queue to be sent again after a pause. Wakes the waiters. A link
    /// closed meanwhile gave the frame back already.
    fn sent(&self, st: &mut LinkState, res: Result<()>, gone: bool, now: Instant) {
        let Some(batch) = st.flight.take() else {
            self.cond.notify_all();
            return;
        };
        match res {
            Ok(()) => {
                st.delivered += batch.len() as u64;
                st.failing_since = None;
                st.retry_at = None;
                st.failures = 0;
            }
            Err(e) => {
                // Back at the front, in order: sent again after a pause.
                st.requeue(&batch);
                st.failing_since.get_or_insert(now);
                let backoff = FIRST_BACKOFF.saturating_mul(1 << st.failures.min(8)).min(MAX_BACKOFF);
                st.failures = st.failures.saturating_add(1);
                st.retry_at = Some(Instant::now() + backoff);
                st.gone |= gone;
                if st.failures == 1 || gone {
                    tracing::warn!(
                        client = format!("{:#x}", self.client),
                        error = %e,
                        gone,
                        "a storage node cannot be told of its records{}",
                        if gone { ": it is gone" } else { " yet: retrying" }
                    );
                }
            }
        }
        self.cond.notify_all();
    }

    /// Writes what is queued to the node now, without waiting for its answer (the next
    /// waiter reads it), if that can be done at once: no frame in flight, at most
    /// [`MAX_UPDATES_AHEAD`] updates, the last send worked, and the sink writes it
    /// whole without blocking over a connection already open. Never waits: a node
    /// paused or unreachable holds up nobody here.
    pub(crate) fn send_ahead(&self) {
        let mut st = self.state.lock();
        if st.flight.is_some()
            || st.queue.is_empty()
            || st.queue.len() > MAX_UPDATES_AHEAD
            || st.closed
            || st.gone
            || st.failing_since.is_some()
        {
            return;
        }
        // Keys make most of a frame's bytes: a frame that may not fit an idle socket's
        // buffer whole is left to the waiters.
        if st.queue.iter().map(|u| u.key().len() + 64).sum::<usize>() > MAX_BYTES_AHEAD {
            return;
        }
        let batch = self.take_batch(&mut st);
        drop(st);
        let res = self.sink.send_records(&batch);
        let mut st = self.state.lock();
        match res {
            Some(Ok(sent)) => {
                // (A link closed meanwhile has given the frame back.)
                if st.flight.is_some() {
                    st.parked = Some(sent);
                }
                self.cond.notify_all();
            }
            // Not now: back at the front, for the next waiter to send as usual.
            None => {
                if let Some(batch) = st.flight.take() {
                    st.requeue(&batch);
                }
                self.cond.notify_all();
            }
            // A connection that broke while writing: a failed send (whether the node
            // is gone is asked by the next waiter's send, which connects).
            Some(Err(e)) => self.sent(&mut st, Err(e), false, Instant::now()),
        }
    }

    /// Sends whatever is queued (updates nobody waits for, e.g. eviction's).
    pub(crate) fn flush(&self, limit: Duration) -> Delivery {
        let ticket = self.state.lock().queued;
        self.wait(ticket, limit)
    }

    /// Whether the update of `ticket` was delivered, or never will be (the link
    /// closed).
    pub(crate) fn settled(&self, ticket: u64) -> bool {
        let st = self.state.lock();
        st.delivered >= ticket || st.closed
    }

    /// Updates ever queued: waiting for this ticket waits for every update queued so
    /// far (a barrier).
    pub(crate) fn queued(&self) -> u64 {
        self.state.lock().queued
    }

    /// Whether updates wait in the queue, no frame carrying them yet.
    pub(crate) fn has_unsent(&self) -> bool {
        !self.state.lock().queue.is_empty()
    }

    /// Whether updates are queued and not delivered (or written ahead, their answer
    /// not read).
    pub(crate) fn has_queued(&self) -> bool {
        let st = self.state.lock();
        !st.queue.is_empty() || st.flight.is_some()
    }

    /// For how long sends to the node have been failing (zero: the last one worked).
    pub(crate) fn failing_for(&self) -> Duration {
        self.state.lock().failing_since.map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// Delivers nothing more; waiters see the link closed. Returns the updates never
    /// delivered (their keys may have copies the node still lists).
    pub(crate) fn close(&self) -> Vec<RecordUpdate> {
        let mut st = self.state.lock();
        let left = Self::close_locked(&mut st);
        drop(st);
        self.cond.notify_all();
        left
    }

    fn close_locked(st: &mut LinkState) -> Vec<RecordUpdate> {
        st.closed = true;
        // The frame in flight may or may not have been applied: given back too (its
        // sender, back, finds it gone).
        st.parked = None;
        let flight = st.flight.take();
        flight.iter().flat_map(|b| b.iter().cloned()).chain(st.queue.drain(..)).collect()
    }

    /// Closes this link and queues what it did not deliver on `next`, the link of
    /// the same node under its newer client id: a waiter that finds this link closed
    /// waits on `next` instead ([`successor`](Self::successor)), set before any
    /// waiter can see the link closed.
    pub(crate) fn close_into(&self, clock: &GenClock, next: &Arc<NodeLink>) {
        let mut st = self.state.lock();
        for u in Self::close_locked(&mut st) {
            next.push(clock, |_| u);
        }
        st.successor = Some((next.clone(), next.queued()));
        drop(st);
        self.cond.notify_all();
    }

    /// Where this link's undelivered updates went when it closed, if it closed into
    /// another ([`close_into`](Self::close_into)): that link and the ticket to wait
    /// for there.
    pub(crate) fn successor(&self) -> Option<(Arc<NodeLink>, u64)> {
        self.state.lock().successor.clone()
    }

    /// The client this link delivers to.
    pub(crate) fn client(&self) -> ClientId {
        self.client
    }
}

/// Record updates a call queued for storage nodes, to wait for before acknowledging.
#[derive(Clone, Default)]
#[must_use = "a put or remove is durable only once its record updates are delivered"]
pub(crate) struct RecordWait {
    pub(crate) tickets: Vec<(ClientId, Arc<NodeLink>, u64)>,
}

impl RecordWait {
    pub(crate) fn add(&mut self, client: ClientId, link: Arc<NodeLink>, ticket: u64) {
        // By link, not by client: a node that announced a new endpoint has a new link,
        // whose tickets count from zero.
        match self.tickets.iter_mut().find(|(_, l, _)| Arc::ptr_eq(l, &link)) {
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

    /// Whether every update waited for was delivered (or never will be).
    pub(crate) fn settled(&self) -> bool {
        self.tickets.iter().all(|(_, link, ticket)| link.settled(*ticket))
    }
}

/// Removals queued without waiting (an eviction's, a dropped put's) that have not
/// reached their nodes yet, by key. A later remove of the key, or a later put of
/// it, waits for them: a master restarted after acknowledging it must find no node
/// still listing an older copy. Pruned by the monitor once delivered.
#[derive(Default)]
pub(crate) struct UnsentRemovals {
    by_key: Mutex<ahash::HashMap<Box<str>, RecordWait>>,
    /// Keys in `by_key`: a put looks for its key only while some are (every put
    /// ends with this check).
    keys: std::sync::atomic::AtomicUsize,
}

impl UnsentRemovals {
    /// Keeps the removals of `wait`, queued for copies of `key`.
    pub(crate) fn add(&self, key: &str, wait: RecordWait) {
        if wait.tickets.is_empty() {
            return;
        }
        let mut by_key = self.by_key.lock();
        by_key.entry(Box::from(key)).or_default().merge(wait);
        self.keys.store(by_key.len(), std::sync::atomic::Ordering::Release);
    }

    /// The removals kept for `key`, to wait for.
    pub(crate) fn take(&self, key: &str) -> RecordWait {
        if self.keys.load(std::sync::atomic::Ordering::Acquire) == 0 {
            return RecordWait::default();
        }
        let mut by_key = self.by_key.lock();
        let wait = by_key.remove(key).unwrap_or_default();
        self.keys.store(by_key.len(), std::sync::atomic::Ordering::Release);
        wait
    }

    /// Every removal kept, to wait for.
    pub(crate) fn take_all(&self) -> RecordWait {
        let mut wait = RecordWait::default();
        let mut by_key = self.by_key.lock();
        for (_, w) in by_key.drain() {
            wait.merge(w);
        }
        self.keys.store(0, std::sync::atomic::Ordering::Release);
        wait
    }

    /// Forgets the removals delivered (or whose node was forgotten).
    pub(crate) fn prune(&self) {
        let mut by_key = self.by_key.lock();
        by_key.retain(|_, wait| !wait.settled());
        self.keys.store(by_key.len(), std::sync::atomic::Ordering::Release);
    }
}

/// Links with updates queued by calls that do not wait for them (puts that declared
/// their checksum), to send as soon as the call is answered; one entry per node.
/// Kept only once an RPC server answers for the master (nothing else would send
/// them: an in-process master's waiters do).
#[derive(Default)]
pub(crate) struct LinksToSend {
    links: Mutex<Vec<Arc<NodeLink>>>,
    /// `links` is not empty: checked after every answer, without the lock.
    any: std::sync::atomic::AtomicBool,
    /// An RPC server asked for work after an answer: links are kept from now on.
    served: std::sync::atomic::AtomicBool,
}

impl LinksToSend {
    /// Keeps the links of `wait`.
    pub(crate) fn add(&self, wait: RecordWait) {
        for (_, link, _) in wait.tickets {
            self.add_link(link);
        }
    }

    /// Keeps `link`.
    pub(crate) fn add_link(&self, link: Arc<NodeLink>) {
        if !self.served.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        let mut links = self.links.lock();
        if !links.iter().any(|l| Arc::ptr_eq(l, &link)) {
            links.push(link);
        }
        self.any.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether any link is kept; from now on links are (an RPC server asks this
    /// after every answer).
    pub(crate) fn any(&self) -> bool {
        if !self.served.load(std::sync::atomic::Ordering::Relaxed) {
            self.served.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.any.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The links kept, forgotten here.
    pub(crate) fn take(&self) -> Vec<Arc<NodeLink>> {
        let mut links = self.links.lock();
        self.any.store(false, std::sync::atomic::Ordering::Release);
        std::mem::take(&mut *links)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    /// A node that refuses the first `fail` frames (paused, or slow), then applies
    /// them; `gone` says whether it is gone for good.
    struct Flaky {
        fail: Mutex<usize>,
        gone: bool,
        applied: Mutex<Vec<u64>>,
    }

    impl RecordSink for Flaky {
        fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
            let mut fail = self.fail.lock();
            if *fail > 0 {
                *fail -= 1;
                return Err(Error::Timeout("paused".into()));
            }
            self.applied.lock().extend(updates.iter().map(RecordUpdate::generation));
            Ok(())
        }

        fn gone(&self) -> bool {
            self.gone
        }
    }

    fn discard(generation: u64) -> RecordUpdate {
        RecordUpdate::Discard { key: "k".into(), generation }
    }

    #[test]
    fn a_failed_send_keeps_its_updates_and_they_are_delivered_once_in_order() {
        let clock = GenClock::default();
        let sink = Arc::new(Flaky { fail: Mutex::new(3), gone: false, applied: Mutex::default() });
        let link = NodeLink::new(1, sink.clone());
        let tickets: Vec<u64> = (0..5).map(|_| link.push(&clock, discard)).collect();
        // The node does not answer the first sends: nothing is lost, nothing forgotten.
        assert_eq!(link.wait(tickets[4], Duration::ZERO), Delivery::Pending);
        assert!(link.failing_for() > Duration::ZERO);
        assert!(link.has_queued());
        // Later calls add theirs; the retries deliver everything, in queue order.
        let last = link.push(&clock, discard);
        assert_eq!(link.wait(last, Duration::from_secs(5)), Delivery::Done);
        let applied = sink.applied.lock().clone();
        assert_eq!(applied.len(), 6, "each update delivered once");
        assert!(applied.windows(2).all(|w| w[0] < w[1]), "in the order queued, generations increasing");
        assert_eq!(link.failing_for(), Duration::ZERO);
    }

    /// A node over the network, as the sink sees it: frames written ahead land in
    /// `written`; their answers are read later, and fail while `refuse` is set (the
    /// node was paused before answering).
    #[derive(Default)]
    struct Wire {
        written: Mutex<Vec<u64>>,
        refuse: std::sync::atomic::AtomicBool,
        applied: Mutex<Vec<u64>>,
    }

    impl RecordSink for Wire {
        fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
            if self.refuse.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::Timeout("no answer".into()));
            }
            self.applied.lock().extend(updates.iter().map(RecordUpdate::generation));
            Ok(())
        }

        fn send_records(&self, updates: &[RecordUpdate]) -> Option<Result<RecordsInFlight>> {
            let gens: Vec<u64> = updates.iter().map(RecordUpdate::generation).collect();
            self.written.lock().extend(&gens);
            Some(Ok(RecordsInFlight(Box::new(gens))))
        }

        fn receive_records(&self, sent: RecordsInFlight) -> Result<()> {
            if self.refuse.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::Timeout("no answer".into()));
            }
            let gens = sent.0.downcast::<Vec<u64>>().map_err(|_| Error::InvalidArgument("not ours".into()))?;
            self.applied.lock().extend(*gens);
            Ok(())
        }
    }

    /// Updates written ahead count as delivered only once a waiter read the answer;
    /// one frame is in flight at a time; an answer that fails puts the updates back,
    /// and they are delivered (once each, in order) by the retries; a link closed with
    /// a frame unanswered gives it back.
    #[test]
    fn updates_written_ahead_are_delivered_once_their_answer_is_read() {
        let clock = GenClock::default();
        let sink = Arc::new(Wire::default());
        let link = NodeLink::new(1, sink.clone());
        let first = link.push(&clock, discard);
        link.send_ahead();
        assert_eq!(sink.written.lock().len(), 1, "written at once");
        assert!(!link.settled(first), "not delivered before its answer is read");
        assert!(link.has_queued());
        // A second frame waits for the first's answer.
        let second = link.push(&clock, discard);
        link.send_ahead();
        assert_eq!(sink.written.lock().len(), 1);
        assert_eq!(link.wait(second, Duration::from_secs(5)), Delivery::Done);
        assert_eq!(sink.applied.lock().len(), 2, "the answer read, then the rest sent");
        // No answer: back at the front, sent again (the link stops writing ahead
        // while its sends fail), delivered once.
        let third = link.push(&clock, discard);
        link.send_ahead();
        sink.refuse.store(true, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(link.wait(third, Duration::ZERO), Delivery::Pending);
        assert!(link.failing_for() > Duration::ZERO);
        let fourth = link.push(&clock, discard);
        link.send_ahead();
        assert_eq!(sink.written.lock().len(), 2, "nothing written ahead while sends fail");
        sink.refuse.store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(link.wait(fourth, Duration::from_secs(5)), Delivery::Done);
        let applied = sink.applied.lock().clone();
        assert_eq!(applied.len(), 4, "each update delivered once");
        assert!(applied.windows(2).all(|w| w[0] < w[1]), "in queue order");
        // Closed with a frame written ahead and unanswered: given back.
        link.push(&clock, discard);
        link.send_ahead();
        assert_eq!(link.close().len(), 1);
    }

    /// A sink whose writes wait until the test lets them go.
    struct Held {
        entered: std::sync::Barrier,
        go: std::sync::Barrier,
    }

    impl RecordSink for Held {
        fn apply_records(&self, _: &[RecordUpdate]) -> Result<()> {
            Ok(())
        }

        fn send_records(&self, _: &[RecordUpdate]) -> Option<Result<RecordsInFlight>> {
            self.entered.wait();
            self.go.wait();
            Some(Ok(RecordsInFlight(Box::new(()))))
        }
    }

    /// A node forgotten while a frame to it is being written: `close` gives the
    /// frame's updates back (its keys may have copies the node still lists), and the
    /// writer, back, parks nothing on the closed link.
    #[test]
    fn a_link_closed_during_a_write_gives_the_frame_back() {
        let clock = GenClock::default();
        let sink = Arc::new(Held { entered: std::sync::Barrier::new(2), go: std::sync::Barrier::new(2) });
        let link = NodeLink::new(1, sink.clone());
        link.push(&clock, discard);
        link.push(&clock, discard);
        std::thread::scope(|s| {
            let writer = s.spawn(|| link.send_ahead());
            sink.entered.wait();
            assert_eq!(link.close().len(), 2, "the frame being written is given back");
            sink.go.wait();
            writer.join().unwrap();
        });
        assert!(!link.has_queued(), "nothing parked or queued on a closed link");
    }

    /// Tickets are kept per link: a node that announced a new endpoint (a new link,
    /// counting from zero) has its old link's ticket and its new one waited for apart.
    #[test]
    fn a_wait_keeps_the_tickets_of_two_links_of_one_node_apart() {
        let clock = GenClock::default();
        let old = NodeLink::new(1, Arc::new(Wire::default()));
        let new = NodeLink::new(1, Arc::new(Wire::default()));
        let mut wait = RecordWait::default();
        (0..5).for_each(|_| wait.add(1, old.clone(), old.push(&clock, discard)));
        wait.add(1, new.clone(), new.push(&clock, discard));
        assert_eq!(wait.tickets.len(), 2);
        assert_eq!(wait.tickets.iter().map(|t| t.2).collect::<Vec<_>>(), [5, 1]);
        assert_eq!(new.wait(1, Duration::from_secs(5)), Delivery::Done);
        assert!(!wait.settled());
        assert_eq!(old.wait(5, Duration::from_secs(5)), Delivery::Done);
        assert!(wait.settled());
    }

    /// What a test does to a link.
    #[derive(Clone, Debug)]
    enum Step {
        /// A call queues an update.
        Push,
        /// An RPC thread writes ahead after an answer.
        SendAhead,
        /// A call waits for everything queued so far, without blocking.
        Poll,
        /// The node stops (or starts again) answering.
        Refuse(bool),
    }

    fn steps() -> impl proptest::strategy::Strategy<Value = Vec<Step>> {
        use proptest::prelude::*;
        let step = prop_oneof![
            4 => Just(Step::Push),
            3 => Just(Step::SendAhead),
            2 => Just(Step::Poll),
            1 => any::<bool>().prop_map(Step::Refuse),
        ];
        proptest::collection::vec(step, 1..60)
    }

    proptest::proptest! {
        // Each case may wait out a backoff (20 ms doubling) at its end.
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// Against the simplest model (a FIFO the node applies in order): whatever
        /// mix of writes ahead, waits and refused answers, the node applies the
        /// updates in the order queued, each once, never more than were queued; and
        /// once it answers again a wait delivers every one.
        #[test]
        fn a_link_delivers_in_order_once_whatever_is_written_ahead(steps in steps()) {
            let clock = GenClock::default();
            let sink = Arc::new(Wire::default());
            let link = NodeLink::new(1, sink.clone());
            let mut queued = 0usize;
            for step in steps {
                match step {
                    Step::Push => {
                        link.push(&clock, discard);
                        queued += 1;
                    }
                    Step::SendAhead => link.send_ahead(),
                    Step::Poll => {
                        let _ = link.wait(link.queued(), Duration::ZERO);
                    }
                    Step::Refuse(on) => sink.refuse.store(on, std::sync::atomic::Ordering::Relaxed),
                }
                let applied = sink.applied.lock().clone();
                proptest::prop_assert!(applied.len() <= queued);
                proptest::prop_assert!(applied.windows(2).all(|w| w[0] < w[1]), "out of order or twice: {:?}", applied);
            }
            sink.refuse.store(false, std::sync::atomic::Ordering::Relaxed);
            // Past any backoff.
            proptest::prop_assert_eq!(link.wait(link.queued(), Duration::from_secs(5)), Delivery::Done);
            let applied = sink.applied.lock().clone();
            proptest::prop_assert_eq!(applied.len(), queued);
            proptest::prop_assert!(applied.windows(2).all(|w| w[0] < w[1]));
            proptest::prop_assert!(!link.has_queued());
        }
    }

    #[test]
    fn a_gone_node_is_reported_and_a_closed_link_gives_back_what_it_never_delivered() {
        let clock = GenClock::default();
        let link =
            NodeLink::new(1, Arc::new(Flaky { fail: Mutex::new(usize::MAX), gone: true, applied: Mutex::default() }));
        let t = link.push(&clock, discard);
        assert_eq!(link.wait(t, Duration::from_secs(5)), Delivery::Gone);
        let left = link.close();
        assert_eq!(left.len(), 1);
        assert_eq!(link.wait(t, Duration::from_secs(5)), Delivery::Closed);
    }
}
