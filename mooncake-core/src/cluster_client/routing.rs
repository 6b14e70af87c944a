//! Routing: which master each call goes to, and how a batch is split among them.
//!
//! The cost of routing a key does not depend on how many masters there are: the
//! slot map is turned once per map into a table from slot group to leader index
//! ([`Routes`]), a batch is split with a counting sort of its item indices by leader
//! ([`split`]: no allocation per key), the call's parts join the round of concurrent
//! calls of the same shape (`combine`: one request per master carries every call of the
//! round), every request of a round is written on a connection of its session before
//! any answer is read, and one thread waits for all the answers
//! ([`ClusterClient::gather`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_alloc::SegmentId;

use super::combine::{Call, Cut, Entry, Merge, Part as RoundPart};
use super::sessions::Session;
use super::ClusterClient;
use crate::cluster::{key_slot, SlotMap};
use crate::error::{Error, Result};
use crate::master::{ClientId, MemoryReplica, ReplicaList};
use crate::rpc::wire::{Request, Response};
use crate::rpc::Sent;

/// The key a batch item is about (a key, or a tuple that starts with one).
pub(crate) trait KeyOf {
    /// The item's key.
    fn key_of(&self) -> &str;
}

impl KeyOf for &str {
    fn key_of(&self) -> &str {
        self
    }
}

impl<A> KeyOf for (&str, A) {
    fn key_of(&self) -> &str {
        self.0
    }
}

impl<A, B> KeyOf for (&str, A, B) {
    fn key_of(&self) -> &str {
        self.0
    }
}

impl<A, B, C> KeyOf for (&str, A, B, C) {
    fn key_of(&self) -> &str {
        self.0
    }
}

/// Marks a group without a leader in [`Routes`].
const NO_LEADER: u16 = u16::MAX;

/// The routing table of one slot map: the distinct leaders, and each group's leader
/// as an index among them.
pub(crate) struct Routes {
    pub(crate) map: Arc<SlotMap>,
    /// Per group: its leader's index in `leaders`, or [`NO_LEADER`].
    leader_of_group: Vec<u16>,
    /// The leaders' addresses, each once.
    pub(crate) leaders: Vec<String>,
}

impl Routes {
    /// The table of `map`.
    pub(crate) fn new(map: Arc<SlotMap>) -> Routes {
        let mut leaders: Vec<String> = Vec::new();
        // At most `MAX_GROUPS` (1024) groups, hence leaders: indices fit a u16.
        let leader_of_group = (0..map.groups())
            .map(|g| match map.leader(g) {
                None => NO_LEADER,
                Some(l) => match leaders.iter().position(|a| *a == l.addr) {
                    Some(i) => i as u16,
                    None => {
                        leaders.push(l.addr.clone());
                        (leaders.len() - 1) as u16
                    }
                },
            })
            .collect();
        Routes { map, leader_of_group, leaders }
    }

    /// The bucket of `key`: its leader's index, or `leaders.len()` when its group has
    /// no leader.
    #[inline]
    pub(crate) fn bucket(&self, key: &str) -> usize {
        match self.leader_of_group[self.map.group_of_key(key) as usize] {
            NO_LEADER => self.leaders.len(),
            i => i as usize,
        }
    }

    /// The address of the leader of `key`'s group, if it has one.
    fn leader_of_key(&self, key: &str) -> Option<&str> {
        self.leaders.get(self.bucket(key)).map(String::as_str)
    }
}

/// Item indices of a batch grouped by bucket (see [`split`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Split {
    /// The indices, bucket after bucket, each bucket in item order.
    order: Vec<u32>,
    /// Bucket `b` is `order[bounds[b]..bounds[b + 1]]`.
    bounds: Vec<u32>,
}

impl Split {
    /// The item indices of bucket `b` (in item order).
    pub(crate) fn part(&self, b: usize) -> &[u32] {
        &self.order[self.bounds[b] as usize..self.bounds[b + 1] as usize]
    }
}

/// Splits the items `pending` (indices into `items`, ascending) by the leader of
/// their keys' groups: bucket `i < routes.leaders.len()` for leader `i`, the last one
/// for the groups without a leader. A counting sort: a few allocations per call, none
/// per key, and every bucket keeps the items' order.
pub(crate) fn split<I: KeyOf>(routes: &Routes, items: &[I], pending: &[u32]) -> Split {
    let buckets = routes.leaders.len() + 1;
    let mut bucket_of: Vec<u16> = Vec::with_capacity(pending.len());
    let mut bounds = vec![0u32; buckets + 1];
    for &i in pending {
        let b = routes.bucket(items[i as usize].key_of());
        bucket_of.push(b as u16);
        bounds[b + 1] += 1;
    }
    for b in 0..buckets {
        bounds[b + 1] += bounds[b];
    }
    let mut next = bounds.clone();
    let mut order = vec![0u32; pending.len()];
    for (&i, &b) in pending.iter().zip(&bucket_of) {
        let at = &mut next[b as usize];
        order[*at as usize] = i;
        *at += 1;
    }
    Split { order, bounds }
}

/// Whether an error means "ask again once the map moved on".
pub(crate) fn follows(e: &Error) -> bool {
    matches!(e, Error::Moved { .. } | Error::MasterUnavailable(_) | Error::Recovering(_) | Error::Timeout(_))
}

/// One leader's part of a batch.
struct Part {
    bucket: usize,
    session: Arc<Session>,
    /// Our id at that master (0: the call names none).
    id: ClientId,
}

impl ClusterClient {
    /// The routing table of the latest map (built once per map).
    pub(crate) fn routes(&self) -> Arc<Routes> {
        let map = self.maps.map();
        let mut routes = self.routes.lock();
        if !Arc::ptr_eq(&routes.map, &map) {
            *routes = Arc::new(Routes::new(map));
        }
        routes.clone()
    }

    /// Our id at `s` if the call names the caller (`needs_id`), else 0.
    fn id_for(&self, s: &Session, needs_id: bool) -> Result<ClientId> {
        if needs_id {
            self.id_at(s)
        } else {
            Ok(0)
        }
    }

    /// One call to one master, its answer read with `answer`; a master that forgot us
    /// (it restarted) is registered with again and asked again.
    fn call_at<T>(
        &self,
        s: &Session,
        needs_id: bool,
        request: impl Fn(ClientId) -> Request,
        answer: impl Fn(Response) -> Result<T>,
    ) -> Result<T> {
        let id = self.id_for(s, needs_id)?;
        match s.rpc.call(&request(id)).and_then(&answer) {
            Err(Error::UnknownClient(_)) => {
                let id = self.register_session(s, id)?;
                s.rpc.call(&request(id)).and_then(&answer)
            }
            other => other,
        }
    }

    /// Runs a call on `key` at the leader of its group, following moves (see the
    /// module docs of `cluster_client`); `learn` sees the answer and who gave it.
    pub(crate) fn on_key<T>(
        &self,
        key: &str,
        needs_id: bool,
        request: impl Fn(ClientId) -> Request,
        answer: impl Fn(Response) -> Result<T>,
        learn: impl Fn(&str, &Result<T>),
    ) -> Result<T> {
        let deadline = Instant::now() + self.retry_for;
        loop {
            let routes = self.routes();
            let res = match routes.leader_of_key(key) {
                None => Err(Error::Moved { slot: key_slot(key), leader: None }),
                Some(addr) => self.session(addr).and_then(|s| {
                    let r = self.call_at(&s, needs_id, &request, &answer);
                    learn(&s.addr, &r);
                    r
                }),
            };
            match res {
                Err(e) if follows(&e) && Instant::now() < deadline => self.wait_for_map(&routes.map, &e),
                other => return other,
            }
        }
    }

    /// Runs a batch call: the items split by their keys' leaders, every part sent
    /// (in a round with the parts of concurrent calls of the same shape, see
    /// `combine`) before any answer is awaited, the answers put back in item order as they
    /// arrive; the items answered with a move (or whose leader did not answer) are
    /// routed again as the map changes. `request` builds a part's request for a client
    /// id, `answer` reads a part's answer (one result per item), `learn` sees each
    /// part's answers and who gave them; `merge` and `cut` combine requests of the call
    /// and cut their answer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn on_keys<I: KeyOf + Clone, T>(
        &self,
        items: &[I],
        needs_id: bool,
        request: impl Fn(ClientId, &[I]) -> Request,
        answer: impl Fn(Response, usize) -> Vec<Result<T>>,
        learn: impl Fn(&str, &[Result<T>]),
        merge: Merge<'_>,
        cut: Cut<'_>,
    ) -> Vec<Result<T>> {
        if items.is_empty() {
            return Vec::new();
        }
        let deadline = Instant::now() + self.retry_for;
        let mut results: Vec<Option<Result<T>>> = (0..items.len()).map(|_| None).collect();
        // Indices as u32: a batch is far smaller than 2^32 items (each answer alone
        // would take more memory than a host has).
        let mut pending: Vec<u32> = (0..items.len() as u32).collect();
        loop {
            let routes = self.routes();
            let split = split(&routes, items, &pending);
            let mut retry: Vec<u32> = Vec::new();
            let mut last_error = None;
            let mut settle = |idx: &[u32], answers: Vec<Result<T>>| {
                let late = Instant::now() >= deadline;
                for (&i, r) in idx.iter().zip(answers) {
                    match r {
                        Err(e) if !late && (follows(&e) || matches!(e, Error::UnknownClient(_))) => {
                            last_error = Some(e);
                            retry.push(i);
                        }
                        r => results[i as usize] = Some(r),
                    }
                }
            };
            let leaderless = split.part(routes.leaders.len());
            if !leaderless.is_empty() {
                let moved = |&i: &u32| Err(Error::Moved { slot: key_slot(items[i as usize].key_of()), leader: None });
                settle(leaderless, leaderless.iter().map(moved).collect());
            }
            // The leaders to ask: each with our id there.
            let mut parts: Vec<Part> = Vec::new();
            for (bucket, addr) in routes.leaders.iter().enumerate() {
                let idx = split.part(bucket);
                if idx.is_empty() {
                    continue;
                }
                match self.session(addr).and_then(|s| Ok((self.id_for(&s, needs_id)?, s))) {
                    Ok((id, session)) => parts.push(Part { bucket, session, id }),
                    Err(e) => settle(idx, idx.iter().map(|_| Err(e.clone())).collect()),
                }
            }
            // The call joins the round of its shape: every part goes out (each merged
            // into its master's request of the round) before any answer is read.
            let call = Call::new(parts.len());
            if !parts.is_empty() {
                let mut entry = Entry { parts: Vec::with_capacity(parts.len()), items: 0, call: call.clone() };
                // The items of one part, gathered for its request: one buffer for all
                // the parts of the call (the request copies them).
                let mut scratch: Vec<I> = Vec::new();
                for p in &parts {
                    let idx = split.part(p.bucket);
                    // The whole batch to one leader (one master, or a batch of one
                    // group's keys) goes as it is.
                    let part_items: &[I] = if idx.len() == items.len() {
                        items
                    } else {
                        scratch.clear();
                        scratch.extend(idx.iter().map(|&i| items[i as usize].clone()));
                        &scratch
                    };
                    entry.items += idx.len();
                    entry.parts.push(RoundPart {
                        session: p.session.clone(),
                        request: request(p.id, part_items),
                        shape: request(p.id, &[]),
                        items: idx.len(),
                    });
                }
                // The lane's shape names no caller id (each master knows us by its own).
                let shape = request(0, &[]);
                if let Some(entries) = self.rounds.join(&shape, entry) {
                    self.lead(&shape, &call, entries, merge, cut);
                }
                self.wait_call(&call, Instant::now() + self.timeout * 3, merge, cut);
            }
            for (p, got) in parts.iter().zip(call.take()) {
                let idx = split.part(p.bucket);
                let n = idx.len();
                let answers = match got {
                    Some(Ok(resp)) => answer(resp, n),
                    Some(Err(e)) => (0..n).map(|_| Err(e.clone())).collect(),
                    None => {
                        let e = Error::Timeout(format!("master {} did not answer in time", p.session.addr));
                        (0..n).map(|_| Err(e.clone())).collect()
                    }
                };
                if answers.iter().any(|r| matches!(r, Err(Error::UnknownClient(_)))) {
                    // The master restarted and forgot us: register again; the items
                    // are asked again with the new id.
                    let _ = self.register_session(&p.session, p.id);
                }
                learn(&p.session.addr, &answers);
                settle(idx, answers);
            }
            match last_error {
                Some(Error::UnknownClient(_)) if !retry.is_empty() => pending = retry,
                Some(e) if !retry.is_empty() => {
                    self.wait_for_map(&routes.map, &e);
                    pending = retry;
                }
                _ => break,
            }
        }
        results.into_iter().map(|r| r.unwrap_or_else(|| Err(Error::Timeout("cluster routing".into())))).collect()
    }

    /// Waits for the answers to the requests `sent` (to distinct masters), handing each
    /// to `on` with its index (the last one's first, then the others as they arrive),
    /// from this one thread; a request not
    /// answered within the client's timeout gets `Timeout` (and its connection is
    /// dropped).
    pub(crate) fn gather(&self, sent: Vec<(Arc<Session>, Sent)>, mut on: impl FnMut(usize, Result<Response>)) {
        if sent.len() <= 1 {
            for (k, (s, req)) in sent.into_iter().enumerate() {
                on(k, s.rpc.receive(req));
            }
            return;
        }
        let deadline = Instant::now() + self.timeout;
        let mut waiting: Vec<Option<(Arc<Session>, Sent)>> = sent.into_iter().map(Some).collect();
        // The request sent last is likely answered last: wait for it first (a blocking
        // read, within the socket's timeout of `self.timeout`). The other answers wait
        // in their sockets meanwhile and are mostly there when it returns, so the
        // thread wakes about once per round instead of once per answer (each wake-up
        // is a context switch, the costliest part of a message on a busy host).
        let last = waiting.len() - 1;
        if let Some((s, req)) = waiting[last].take() {
            on(last, s.rpc.receive(req));
        }
        let mut left = waiting.len() - 1;
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(left);
        let mut which: Vec<usize> = Vec::with_capacity(left);
        while left > 0 {
            fds.clear();
            which.clear();
            for (k, w) in waiting.iter().enumerate() {
                if let Some((_, req)) = w {
                    fds.push(libc::pollfd { fd: req.fd(), events: libc::POLLIN, revents: 0 });
                    which.push(k);
                }
            }
            let wait_ms = deadline.saturating_duration_since(Instant::now()).as_millis().min(i32::MAX as u128);
            // SAFETY: `fds` is a live, initialised array of `fds.len()` pollfd structs,
            // borrowed mutably for the call only; poll writes nothing else.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait_ms as i32) };
            if n < 0 {
                if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                // poll itself failed (it should not): wait for each in turn instead,
                // under the sockets' own timeouts.
                for (k, w) in waiting.iter_mut().enumerate() {
                    if let Some((s, req)) = w.take() {
                        on(k, s.rpc.receive(req));
                    }
                }
                return;
            }
            if n == 0 {
                break;
            }
            for (fd, &k) in fds.iter().zip(&which) {
                if fd.revents != 0 {
                    if let Some((s, req)) = waiting[k].take() {
                        // Readable (or closed): the answer, or the error, is there.
                        on(k, s.rpc.receive(req));
                        left -= 1;
                    }
                }
            }
        }
        for (k, w) in waiting.into_iter().enumerate() {
            if let Some((s, _)) = w {
                on(k, Err(Error::Timeout(format!("master {} did not answer within {:?}", s.addr, self.timeout))));
            }
        }
    }

    /// Runs a call at every master the map names, all in flight at once, and folds
    /// their answers with `fold` (from `T::default()`); the first error wins. A master
    /// that cannot be sent the call (it just died) does not keep it from the others.
    pub(crate) fn to_all<T: Default>(
        &self,
        needs_id: bool,
        request: impl Fn(ClientId) -> Request,
        answer: impl Fn(Response) -> Result<T>,
        fold: impl Fn(T, T) -> T,
    ) -> Result<T> {
        let mut sent = Vec::new();
        let mut error = None;
        for s in self.all_sessions() {
            match self.id_for(&s, needs_id).and_then(|id| s.rpc.send(&request(id))) {
                Ok(req) => sent.push((s, req)),
                Err(e) => {
                    error.get_or_insert(e);
                }
            }
        }
        let mut acc = T::default();
        self.gather(sent, |_, r| match r.and_then(&answer) {
            Ok(v) => acc = fold(std::mem::take(&mut acc), v),
            Err(e) => {
                error.get_or_insert(e);
            }
        });
        match error {
            Some(e) => Err(e),
            None => Ok(acc),
        }
    }

    /// Before retrying after `e`: a newer map (moves, dead leaders), or a short pause
    /// (a new leader waiting for its extents).
    pub(crate) fn wait_for_map(&self, seen: &SlotMap, e: &Error) {
        match e {
            Error::Recovering(_) | Error::HasLease(_) => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                self.maps.wait_change(seen.version(), Duration::from_millis(100));
            }
        }
    }

    /// Runs a call at the master that handed out `segment` (or at each until one
    /// knows it).
    pub(crate) fn on_segment<T>(
        &self,
        segment: SegmentId,
        needs_id: bool,
        request: impl Fn(ClientId) -> Request,
        answer: impl Fn(Response) -> Result<T>,
    ) -> Result<T> {
        let home = self.segment_home.read().get(&segment).cloned();
        if let Some(addr) = home {
            if let Ok(v) = self.session(&addr).and_then(|s| self.call_at(&s, needs_id, &request, &answer)) {
                return Ok(v);
            }
        }
        let mut last = Error::NotFound(format!("segment {segment}"));
        for s in self.all_sessions() {
            match self.call_at(&s, needs_id, &request, &answer) {
                Ok(v) => {
                    self.segment_home.write().insert(segment, s.addr.clone());
                    return Ok(v);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Remembers that the master at `addr` placed `replicas` (their segments are its).
    /// A read lock answers the common case (segments already known) without
    /// serialising the callers.
    pub(crate) fn note_placed(&self, addr: &str, replicas: &[MemoryReplica]) {
        let known = {
            let homes = self.segment_home.read();
            replicas.iter().all(|r| homes.contains_key(&r.segment))
        };
        if !known {
            let mut homes = self.segment_home.write();
            for r in replicas {
                homes.entry(r.segment).or_insert_with(|| addr.to_owned());
            }
        }
    }

    /// Remembers which master answered for the segments and disk owner of `list`.
    pub(crate) fn note_homes(&self, addr: &str, list: &ReplicaList) {
        self.note_placed(addr, &list.replicas);
        if let Some(owner) = list.disk {
            if self.client_home.read().get(&owner).map(String::as_str) != Some(addr) {
                self.client_home.write().insert(owner, addr.to_owned());
            }
        }
    }
}
