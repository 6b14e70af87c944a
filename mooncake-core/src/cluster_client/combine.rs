//! Combining: the parts that concurrent batch calls send to the same master with the
//! same call (and the same other arguments) travel in one request.
//!
//! Why: a message costs about the same whatever it carries (on loopback the sender
//! also pays the receiver's TCP work and wake-up), and a batch split over `M` masters
//! is `M` messages where one master took one. Combined, the messages per batch fall
//! with the number of calls in flight instead of growing with the number of masters.
//!
//! How: per session, a *lane* per request *shape* (the request with an empty batch:
//! the call, the caller's id at that master, the other arguments) has at most one
//! request in flight. A part that finds its lane idle opens it and leads: once every
//! part of its call has joined its lane, it goes out with what queued there meanwhile.
//! A part that finds its lane busy queues. When the answer comes back, the
//! leader splits it among the parts it carried and, while its own call still waits for
//! parts of its own, sends what queued meanwhile as the next combined request; once
//! its call is complete it hands the lane to the call of a queued part, whose thread
//! (waiting for that part anyway) leads it from there. A thread only ever waits for
//! its own call, after the requests it sent were answered: no thread waits for
//! another while holding a request in flight, so no two wait for each other.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::sessions::Session;
use super::{ClusterClient, SESSION_TIMEOUT};
use crate::error::{Error, Result};
use crate::rpc::wire::{Request, Response};
use crate::rpc::Sent;

/// Most parts one combined request carries (the others wait for the next).
const MAX_PARTS: usize = 64;
/// Most items one combined request carries, unless its first part alone has more:
/// with keys of at most `MAX_KEY_LEN` (4 KiB), at most half a frame (64 MiB).
const MAX_ITEMS: usize = 8192;
/// A lane whose request has been in flight this long is taken over by the next part
/// that joins it (its leader died or hangs: its parts time out and are retried).
const STUCK: Duration = Duration::from_secs(2 * SESSION_TIMEOUT.as_secs());

/// Appends the batch of the second request to the first (same call and shape).
pub(crate) type Merge<'a> = &'a (dyn Fn(&mut Request, Request) + Sync);
/// Cuts a combined answer into its parts' answers, by their item counts.
pub(crate) type Cut<'a> = &'a (dyn Fn(Response, &[usize]) -> Vec<Response> + Sync);

/// The lanes of one master that have a request in flight.
#[derive(Default)]
pub(crate) struct Lanes(Mutex<Vec<Lane>>);

struct Lane {
    shape: Request,
    queue: Vec<Entry>,
    /// When its current request was sent.
    since: Instant,
}

/// One part of a batch call, not sent yet.
pub(crate) struct Entry {
    pub(crate) request: Request,
    pub(crate) items: usize,
    pub(crate) call: Arc<Call>,
    pub(crate) part: usize,
}

/// Where the answer to one part of a combined request goes.
struct Slot {
    call: Arc<Call>,
    part: usize,
    items: usize,
}

/// A combined request in flight.
pub(crate) struct Flight {
    session: Arc<Session>,
    shape: Request,
    slots: Vec<Slot>,
    sent: Sent,
}

/// The parts of one batch call: their answers as they arrive, whoever received them,
/// and the lanes handed to its thread to lead.
pub(crate) struct Call {
    state: Mutex<CallState>,
    ready: Condvar,
}

struct CallState {
    answers: Vec<Option<Result<Response>>>,
    missing: usize,
    leads: Vec<(Arc<Session>, Request)>,
    /// Its thread stopped waiting: no lane may be handed to it anymore.
    gone: bool,
}

impl Call {
    /// A call of `parts` parts.
    pub(crate) fn new(parts: usize) -> Arc<Call> {
        Arc::new(Call {
            state: Mutex::new(CallState {
                answers: (0..parts).map(|_| None).collect(),
                missing: parts,
                leads: Vec::new(),
                gone: false,
            }),
            ready: Condvar::new(),
        })
    }

    /// The answer to part `part` arrived (or failed); the first one counts, and none
    /// once the call took its answers (it stopped waiting).
    pub(crate) fn deliver(&self, part: usize, answer: Result<Response>) {
        let mut st = self.state.lock();
        if let Some(slot @ None) = st.answers.get_mut(part) {
            *slot = Some(answer);
            st.missing -= 1;
            if st.missing == 0 {
                self.ready.notify_one();
            }
        }
    }

    fn complete(&self) -> bool {
        self.state.lock().missing == 0
    }

    /// Gives the call's thread the lane of `shape` at `session` to lead, unless it
    /// stopped waiting.
    fn hand(&self, session: &Arc<Session>, shape: &Request) -> bool {
        let mut st = self.state.lock();
        if st.gone {
            return false;
        }
        st.leads.push((session.clone(), shape.clone()));
        self.ready.notify_one();
        true
    }

    /// The answers, by part (None: not arrived).
    pub(crate) fn take(&self) -> Vec<Option<Result<Response>>> {
        std::mem::take(&mut self.state.lock().answers)
    }
}

impl Lanes {
    /// Adds `entry` to the lane of `shape`. If the lane was idle the caller leads it:
    /// it gets the entry back to send.
    pub(crate) fn join(&self, shape: &Request, entry: Entry) -> Option<Vec<Entry>> {
        let mut lanes = self.0.lock();
        match lanes.iter_mut().find(|l| l.shape == *shape) {
            Some(lane) if lane.since.elapsed() > STUCK => {
                lane.since = Instant::now();
                lane.queue.push(entry);
                Some(take_some(&mut lane.queue))
            }
            Some(lane) => {
                lane.queue.push(entry);
                None
            }
            None => {
                lanes.push(Lane { shape: shape.clone(), queue: Vec::new(), since: Instant::now() });
                Some(vec![entry])
            }
        }
    }

    /// Adds to `entries`, led by the caller on the lane of `shape`, what queued there
    /// since it opened the lane (within the bounds of one request).
    pub(crate) fn grab(&self, shape: &Request, entries: &mut Vec<Entry>) {
        let mut lanes = self.0.lock();
        if let Some(lane) = lanes.iter_mut().find(|l| l.shape == *shape) {
            let mut items: usize = entries.iter().map(|e| e.items).sum();
            let mut n = 0;
            while n < lane.queue.len() && entries.len() + n < MAX_PARTS && items + lane.queue[n].items <= MAX_ITEMS {
                items += lane.queue[n].items;
                n += 1;
            }
            entries.extend(lane.queue.drain(..n));
        }
    }

    /// The lane's request was answered by `session`: the parts to send next, led by
    /// the caller, while `own` (the caller's call) is not complete. Otherwise the lane
    /// goes to the call of a queued part (None), or closes when nothing queued.
    fn next(&self, session: &Arc<Session>, shape: &Request, own: &Call) -> Option<Vec<Entry>> {
        let mut lanes = self.0.lock();
        let i = lanes.iter().position(|l| l.shape == *shape)?;
        if lanes[i].queue.is_empty() {
            lanes.swap_remove(i);
            return None;
        }
        if own.complete() && lanes[i].queue.iter().any(|e| e.call.hand(session, shape)) {
            return None;
        }
        lanes[i].since = Instant::now();
        Some(take_some(&mut lanes[i].queue))
    }

    /// The parts queued on the lane of `shape`, for the thread it was handed to
    /// (empty, and the lane closed, if none).
    fn take(&self, shape: &Request) -> Vec<Entry> {
        let mut lanes = self.0.lock();
        let Some(i) = lanes.iter().position(|l| l.shape == *shape) else { return Vec::new() };
        if lanes[i].queue.is_empty() {
            lanes.swap_remove(i);
            return Vec::new();
        }
        lanes[i].since = Instant::now();
        take_some(&mut lanes[i].queue)
    }
}

/// The first parts of `queue`, as many as one combined request carries.
fn take_some(queue: &mut Vec<Entry>) -> Vec<Entry> {
    let (mut n, mut items) = (0, 0);
    while n < queue.len() && n < MAX_PARTS && (n == 0 || items + queue[n].items <= MAX_ITEMS) {
        items += queue[n].items;
        n += 1;
    }
    queue.drain(..n).collect()
}

/// A request that could not be sent: its shape, its parts (part, call, items) and why.
pub(crate) type Unsent = (Request, Vec<(usize, Arc<Call>, usize)>, Error);

impl ClusterClient {
    /// Sends `entries` to `session` as one request. On failure the parts and their
    /// error come back, for [`land`](Self::land).
    pub(crate) fn launch(
        &self,
        session: &Arc<Session>,
        shape: Request,
        entries: Vec<Entry>,
        merge: Merge<'_>,
    ) -> std::result::Result<Flight, Box<Unsent>> {
        let mut slots = Vec::with_capacity(entries.len());
        let mut request: Option<Request> = None;
        for e in entries {
            slots.push(Slot { call: e.call, part: e.part, items: e.items });
            match &mut request {
                None => request = Some(e.request),
                Some(acc) => merge(acc, e.request),
            }
        }
        let sent = match request {
            Some(request) => session.rpc.send(&request),
            None => Err(Error::InvalidArgument("a combined request of no part".into())),
        };
        match sent {
            Ok(sent) => Ok(Flight { session: session.clone(), shape, slots, sent }),
            Err(e) => Err(Box::new((shape, slots.into_iter().map(|s| (s.part, s.call, s.items)).collect(), e))),
        }
    }

    /// Waits for the answers to `flights` (requests this thread sent), hands each part
    /// its share, and keeps leading their lanes while `own` is not complete.
    pub(crate) fn fly(&self, mut flights: Vec<Flight>, own: &Call, merge: Merge<'_>, cut: Cut<'_>) {
        while !flights.is_empty() {
            let mut meta = Vec::with_capacity(flights.len());
            let mut sent = Vec::with_capacity(flights.len());
            for f in flights {
                meta.push(Some((f.session.clone(), f.shape, f.slots)));
                sent.push((f.session, f.sent));
            }
            let mut next = Vec::new();
            self.gather(sent, |k, answer| {
                if let Some((session, shape, slots)) = meta[k].take() {
                    let slots = slots.into_iter().map(|s| (s.part, s.call, s.items)).collect();
                    self.land(&session, shape, slots, answer, own, merge, cut, &mut next);
                }
            });
            flights = next;
        }
    }

    /// Hands the parts `slots` (part, call, items) of a request to `session` their
    /// share of `answer`, then moves the lane on: the next combined request, if this
    /// thread leads it, goes to `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn land(
        &self,
        session: &Arc<Session>,
        mut shape: Request,
        mut slots: Vec<(usize, Arc<Call>, usize)>,
        mut answer: Result<Response>,
        own: &Call,
        merge: Merge<'_>,
        cut: Cut<'_>,
        out: &mut Vec<Flight>,
    ) {
        loop {
            let answers: Vec<Result<Response>> = match answer {
                Ok(r) if slots.len() == 1 => vec![Ok(r)],
                Ok(r) => {
                    let lens: Vec<usize> = slots.iter().map(|s| s.2).collect();
                    cut(r, &lens).into_iter().map(Ok).collect()
                }
                Err(e) => slots.iter().map(|_| Err(e.clone())).collect(),
            };
            for ((part, call, _), a) in slots.iter().zip(answers) {
                call.deliver(*part, a);
            }
            let Some(entries) = session.lanes.next(session, &shape, own) else { return };
            match self.launch(session, shape, entries, merge) {
                Ok(f) => return out.push(f),
                // Sending failed: its parts get the error, and the lane moves on.
                Err(unsent) => {
                    let (s, failed, e) = *unsent;
                    (shape, slots, answer) = (s, failed, Err(e));
                }
            }
        }
    }

    /// Waits until every part of `call` is answered or `deadline` passed, leading the
    /// lanes handed to this thread meanwhile.
    pub(crate) fn wait_call(&self, call: &Call, deadline: Instant, merge: Merge<'_>, cut: Cut<'_>) {
        loop {
            let job = {
                let mut st = call.state.lock();
                loop {
                    if let Some(job) = st.leads.pop() {
                        break Some(job);
                    }
                    if st.missing == 0 || call.ready.wait_until(&mut st, deadline).timed_out() && st.leads.is_empty() {
                        st.gone = true;
                        break None;
                    }
                }
            };
            let Some((session, shape)) = job else { return };
            let entries = session.lanes.take(&shape);
            if entries.is_empty() {
                continue;
            }
            let mut flights = Vec::new();
            match self.launch(&session, shape, entries, merge) {
                Ok(f) => flights.push(f),
                Err(unsent) => {
                    let (shape, slots, e) = *unsent;
                    self.land(&session, shape, slots, Err(e), call, merge, cut, &mut flights)
                }
            }
            self.fly(flights, call, merge, cut);
        }
    }
}
