//! Combining: concurrent batch calls of the same call (and the same other arguments)
//! travel together, in *rounds*: one request per master carries the parts of every
//! call of the round.
//!
//! Why: a message costs about the same whatever it carries (on loopback the sender
//! also pays the receiver's TCP work and wake-up, and the caller a wake-up per answer),
//! and a batch split over `M` masters is `M` messages where one master took one.
//! Combining per master alone (a request in flight per master, each master's queue
//! sent as soon as its last request was answered) lets every master's queue cycle on
//! its own: the faster a master answers, the fewer parts each of its requests carries,
//! and the messages per call still grew with the masters (1.5 per 256-key call at 4
//! masters against 0.2 at 1, on the 2-core VM). A round gathers the calls that queued
//! while the previous round was in flight, whichever masters they go to, so a round
//! carries as many calls at `M` masters as at one, and messages per call grow with `M`
//! only as `M / calls per round`.
//!
//! How: per request *shape* (the request with an empty batch and no caller id: the
//! call and its other arguments) a *lane* has at most one round in flight. A call
//! that finds its lane idle opens it and leads: it sends the round (its own parts,
//! merged per master with those of the calls queued), waits for the masters' answers
//! with `poll`, and cuts each answer among the parts it carried. A call that finds
//! its lane busy queues, as one entry with all its parts. After a round the leader's
//! call is answered: it hands the lane to the first queued call, whose thread
//! (waiting for its answers anyway) leads the next round, with what queued meanwhile;
//! or closes the lane when nothing queued. A thread only ever waits for its own call,
//! after the requests it sent were answered: no thread waits for another while
//! holding a request in flight, so no two wait for each other.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::sessions::Session;
use super::{ClusterClient, SESSION_TIMEOUT};
use crate::error::Result;
use crate::rpc::wire::{Request, Response};

/// Most calls one round carries (the others wait for the next).
const MAX_CALLS: usize = 64;
/// Most items one round carries, unless its first call alone has more: with keys of
/// at most `MAX_KEY_LEN` (4 KiB), each master's request stays within half a frame
/// (64 MiB).
const MAX_ITEMS: usize = 8192;
/// A lane whose round has been in flight this long is taken over by the next call
/// that joins it (its leader died or hangs: its parts time out and are retried).
const STUCK: Duration = Duration::from_secs(2 * SESSION_TIMEOUT.as_secs());

/// Appends the batch of the second request to the first (same call and shape).
pub(crate) type Merge<'a> = &'a (dyn Fn(&mut Request, Request) + Sync);
/// Cuts a combined answer into its parts' answers, by their item counts.
pub(crate) type Cut<'a> = &'a (dyn Fn(Response, &[usize]) -> Vec<Response> + Sync);

/// The lanes of the cluster client that have a round in flight.
#[derive(Default)]
pub(crate) struct Rounds(Mutex<Vec<Lane>>);

struct Lane {
    shape: Request,
    queue: Vec<Entry>,
    /// When its current round was sent.
    since: Instant,
}

/// One leader's part of a batch call.
pub(crate) struct Part {
    pub(crate) session: Arc<Session>,
    /// The part's request, with the caller's id at that master.
    pub(crate) request: Request,
    /// That request with an empty batch: parts merge into one request only when their
    /// shapes match (the same id at that master).
    pub(crate) shape: Request,
    pub(crate) items: usize,
}

/// A batch call waiting for its round: its parts, in the call's part order.
pub(crate) struct Entry {
    pub(crate) parts: Vec<Part>,
    pub(crate) items: usize,
    pub(crate) call: Arc<Call>,
}

/// The parts of one batch call: their answers as they arrive, whoever received them,
/// and the lane handed to its thread to lead.
pub(crate) struct Call {
    state: Mutex<CallState>,
    ready: Condvar,
}

struct CallState {
    answers: Vec<Option<Result<Response>>>,
    missing: usize,
    leads: Vec<Request>,
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
    /// once the call took its answers (it stopped waiting). The waiting thread is woken
    /// once, when the last part is answered.
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

    /// Gives the call's thread the lane of `shape` to lead, unless it stopped waiting.
    fn hand(&self, shape: &Request) -> bool {
        let mut st = self.state.lock();
        if st.gone {
            return false;
        }
        st.leads.push(shape.clone());
        self.ready.notify_one();
        true
    }

    /// The answers, by part (None: not arrived).
    pub(crate) fn take(&self) -> Vec<Option<Result<Response>>> {
        std::mem::take(&mut self.state.lock().answers)
    }
}

impl Rounds {
    /// Queues `entry` on the lane of `shape`. If the lane was idle (or stuck) the
    /// caller leads it: it gets the entries of the round to send.
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

    /// A round of the lane of `shape` was answered: the next round, led by the
    /// caller, while `own` (the caller's call) is not complete. Otherwise the lane goes
    /// to the first queued call still waiting (None), or closes when none is.
    fn next(&self, shape: &Request, own: &Call) -> Option<Vec<Entry>> {
        let mut lanes = self.0.lock();
        let i = lanes.iter().position(|l| l.shape == *shape)?;
        if own.complete() {
            let queue = &mut lanes[i].queue;
            while let Some(first) = queue.first() {
                if first.call.hand(shape) {
                    return None;
                }
                // Its thread gave up waiting: nobody reads its answers.
                queue.remove(0);
            }
        }
        if lanes[i].queue.is_empty() {
            lanes.swap_remove(i);
            return None;
        }
        lanes[i].since = Instant::now();
        Some(take_some(&mut lanes[i].queue))
    }

    /// The calls queued on the lane of `shape`, for the thread it was handed to
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

/// The first calls of `queue`, as many as one round carries.
fn take_some(queue: &mut Vec<Entry>) -> Vec<Entry> {
    let (mut n, mut items) = (0, 0);
    while n < queue.len() && n < MAX_CALLS && (n == 0 || items + queue[n].items <= MAX_ITEMS) {
        items += queue[n].items;
        n += 1;
    }
    queue.drain(..n).collect()
}

/// One master's request of a round: the parts (call, part, items) it carries.
struct Out {
    session: Arc<Session>,
    shape: Request,
    request: Request,
    slots: Vec<(Arc<Call>, usize, usize)>,
}

/// Hands each part of `slots` its share of `answer` (a combined answer is cut by the
/// parts' item counts).
fn settle(slots: Vec<(Arc<Call>, usize, usize)>, answer: Result<Response>, cut: Cut<'_>) {
    match answer {
        Ok(r) if slots.len() == 1 => slots[0].0.deliver(slots[0].1, Ok(r)),
        Ok(r) => {
            let lens: Vec<usize> = slots.iter().map(|s| s.2).collect();
            for ((call, part, _), a) in slots.iter().zip(cut(r, &lens)) {
                call.deliver(*part, Ok(a));
            }
        }
        Err(e) => {
            for (call, part, _) in &slots {
                call.deliver(*part, Err(e.clone()));
            }
        }
    }
}

impl ClusterClient {
    /// Sends one round: the parts of `entries` merged into one request per master (and
    /// shape), all written before any answer is read; then hands each part its share
    /// of its master's answer as the answers arrive.
    fn round(&self, entries: Vec<Entry>, merge: Merge<'_>, cut: Cut<'_>) {
        let mut outs: Vec<Out> = Vec::new();
        for e in entries {
            for (k, p) in e.parts.into_iter().enumerate() {
                let slot = (e.call.clone(), k, p.items);
                match outs.iter_mut().find(|o| Arc::ptr_eq(&o.session, &p.session) && o.shape == p.shape) {
                    Some(o) => {
                        merge(&mut o.request, p.request);
                        o.slots.push(slot);
                    }
                    None => {
                        outs.push(Out { session: p.session, shape: p.shape, request: p.request, slots: vec![slot] })
                    }
                }
            }
        }
        let mut sent = Vec::with_capacity(outs.len());
        let mut waiting = Vec::with_capacity(outs.len());
        for o in outs {
            match o.session.rpc.send(&o.request) {
                Ok(s) => {
                    sent.push((o.session, s));
                    waiting.push(Some(o.slots));
                }
                Err(e) => settle(o.slots, Err(e), cut),
            }
        }
        self.gather(sent, |k, answer| {
            if let Some(slots) = waiting[k].take() {
                settle(slots, answer, cut);
            }
        });
    }

    /// Leads the lane of `shape`: sends the round `entries`, then the next ones while
    /// `own` is not complete, then hands the lane on (see the module docs).
    pub(crate) fn lead(&self, shape: &Request, own: &Call, mut entries: Vec<Entry>, merge: Merge<'_>, cut: Cut<'_>) {
        loop {
            self.round(entries, merge, cut);
            match self.rounds.next(shape, own) {
                Some(more) => entries = more,
                None => return,
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
            let Some(shape) = job else { return };
            let entries = self.rounds.take(&shape);
            if !entries.is_empty() {
                self.lead(&shape, call, entries, merge, cut);
            }
        }
    }
}
