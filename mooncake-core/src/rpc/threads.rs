//! The RPC server's threads, leader/follower: one thread at a time (the leader) polls
//! the listener and every connection ([`Loop`]). When a request needs answering, the
//! leader answers it itself, writing the response straight to the client's socket,
//! and lets a follower take over the polling only if something happens meanwhile.
//!
//! Why: latency here is thread hand-offs. Waking a thread on another core costs tens
//! of microseconds on a virtual machine, more than a loopback round trip. A request
//! polled by one thread and answered by another, whose answer goes back through the
//! first, pays two such hand-offs on the client's path; here the thread that read the
//! request answers it, as a thread per connection would, while an idle connection
//! still costs no thread.
//!
//! How a follower learns that it must lead: one follower at a time (the deputy) waits
//! on a second poll, the *watch*, in which the connections' poll is registered but
//! disabled. A leader about to answer a request either enables it, once (so that the
//! deputy wakes if a connection becomes ready while it answers), or, if more requests
//! wait, wakes the deputy at once. When the answer is quick and nothing happened
//! meanwhile, the leader takes the lead back and no other thread ever woke: a lone
//! client's calls cost no hand-off at all. (Enabling and disabling is an
//! `EPOLL_CTL_MOD`; registering the poll anew each time would cost an `EPOLL_CTL_ADD`,
//! which walks every connection to rule out loops of polls in polls.)

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use mio::{Events, Poll, Token, Waker};
use parking_lot::{Mutex, MutexGuard};

use super::event_loop::{Done, Loop};
use super::handler::{RpcHandler, RpcServerConfig, RpcServerStats};

/// How long a thread beyond the minimum follows idle before it exits.
const THREAD_IDLE: Duration = Duration::from_secs(10);
/// In the watch: the connections' poll has events.
const CONNECTIONS: Token = Token(0);
/// In the watch: the deputy must lead (requests wait, or the server stops).
const KICK: Token = Token(1);

/// The server's threads; dropping it stops and joins them, and closes the listener
/// and every connection.
pub(crate) struct ServerThreads {
    shared: Arc<Shared>,
}

/// The connections and whether they are being watched.
struct Lead {
    conns: Loop,
    /// The connections' poll is enabled in the watch.
    armed: bool,
}

/// What the deputy polls.
struct Watch {
    poll: Poll,
    events: Events,
}

/// What the threads share.
struct Shared {
    /// The connections, polled by whichever thread holds this lock: the leader.
    lead: Mutex<Lead>,
    /// Held by the deputy while it waits for a reason to lead.
    watch: Mutex<Watch>,
    /// The watch's descriptor, in which a leader enables the connections' poll.
    watch_fd: RawFd,
    /// The connections' poll.
    conns_fd: RawFd,
    /// Ends the leader's turn: a connection came back, or the server stops.
    waker: Waker,
    /// Wakes the deputy.
    kick: Waker,
    stop: AtomicBool,
    /// Connections whose requests were answered, back to the leader.
    done: Sender<Done>,
    handler: Arc<dyn RpcHandler>,
    stats: Arc<RpcServerStats>,
    /// Threads kept (even idle), and most threads.
    min: usize,
    max: usize,
    /// Threads running, and those following (neither leading nor answering).
    total: AtomicUsize,
    waiting: AtomicUsize,
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
    /// How long a thread that answered polls for the next request before sleeping.
    spin: Duration,
}

impl ServerThreads {
    /// Serves `listener` with `handler`: `config.workers` threads (0: one per core, 2
    /// to 16), more when none is left to follow (a request may block, as a put
    /// waiting for an offload does), up to `config.max_workers`.
    pub(crate) fn start(
        listener: std::net::TcpListener,
        handler: Arc<dyn RpcHandler>,
        config: RpcServerConfig,
        stats: Arc<RpcServerStats>,
    ) -> std::io::Result<Self> {
        let min = match config.workers {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get()).clamp(2, 16),
            n => n,
        };
        let max = config.max_workers.max(min);
        let spin = config.spin;
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let conns = Loop::new(listener, handler.clone(), config, stats.clone(), done_rx)?;
        let waker = conns.waker()?;
        let conns_fd = conns.poll_fd();
        let watch = Poll::new()?;
        let kick = Waker::new(watch.registry(), KICK)?;
        let watch_fd = watch.as_raw_fd();
        // Registered once, disabled: an empty poll, so the loop check is free.
        epoll_ctl(watch_fd, libc::EPOLL_CTL_ADD, conns_fd, 0)?;
        let shared = Arc::new(Shared {
            lead: Mutex::new(Lead { conns, armed: false }),
            watch: Mutex::new(Watch { poll: watch, events: Events::with_capacity(4) }),
            watch_fd,
            conns_fd,
            waker,
            kick,
            stop: AtomicBool::new(false),
            done: done_tx,
            handler,
            stats,
            min,
            max,
            total: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            handles: Mutex::new(Vec::new()),
            spin,
        });
        for _ in 0..min {
            if let Err(e) = shared.grow() {
                drop(Self { shared });
                return Err(e);
            }
        }
        Ok(Self { shared })
    }
}

impl Drop for ServerThreads {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.waker.wake();
        let _ = self.shared.kick.wake();
        // Threads started meanwhile are in the list before `stop` is seen (see `grow`).
        loop {
            let handles: Vec<_> = self.shared.handles.lock().drain(..).collect();
            if handles.is_empty() {
                break;
            }
            for h in handles {
                let _ = h.join();
            }
        }
        // The last reference: the listener and the connections close here.
    }
}

impl Shared {
    /// Starts a thread (if under the maximum and not stopping), counted as following
    /// from now on.
    fn grow(self: &Arc<Self>) -> std::io::Result<()> {
        // Under the list's lock, so that `drop` joins every thread started before it
        // set `stop`.
        let mut handles = self.handles.lock();
        if self.stop.load(Ordering::SeqCst)
            || self.total.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| (t < self.max).then(|| t + 1)).is_err()
        {
            return Ok(());
        }
        self.waiting.fetch_add(1, Ordering::AcqRel);
        let shared = self.clone();
        match std::thread::Builder::new().name("mooncake-rpc".into()).spawn(move || shared.serve()) {
            Ok(h) => {
                // Forget threads that already exited.
                handles.retain(|h| !h.is_finished());
                handles.push(h);
                Ok(())
            }
            Err(e) => {
                self.total.fetch_sub(1, Ordering::AcqRel);
                self.waiting.fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// A thread idle for a while exits if there are more than the minimum, and if it
    /// is not the last one following (a leader that saw it following counts on it to
    /// take over). Returns whether it exits.
    fn retire(&self) -> bool {
        if self.total.load(Ordering::Acquire) <= self.min {
            return false;
        }
        if self.waiting.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| (w > 1).then(|| w - 1)).is_err() {
            return false;
        }
        if self.total.fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| (t > self.min).then(|| t - 1)).is_err() {
            self.waiting.fetch_add(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Enables the connections' poll in the watch, once: the deputy wakes when a
    /// connection becomes ready (or is ready already).
    fn arm(&self, lead: &mut Lead) {
        let events = (libc::EPOLLIN | libc::EPOLLONESHOT) as u32;
        match epoll_ctl(self.watch_fd, libc::EPOLL_CTL_MOD, self.conns_fd, events) {
            Ok(()) => lead.armed = true,
            Err(e) => {
                // Then the deputy must lead at once.
                tracing::warn!(error = %e, "cannot watch the RPC connections");
                let _ = self.kick.wake();
            }
        }
    }

    /// The leader polls the connections itself: the deputy need not watch them.
    fn disarm(&self, lead: &mut Lead) {
        if lead.armed {
            let _ = epoll_ctl(self.watch_fd, libc::EPOLL_CTL_MOD, self.conns_fd, 0);
            lead.armed = false;
        }
    }

    /// Follows until there is a reason to lead; returns the lead, or `None` if this
    /// thread exits (the server stops, or it retired).
    fn follow(&self) -> Option<MutexGuard<'_, Lead>> {
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            // Nobody leads (the leader is answering, and nothing is ready): lead.
            if let Some(lead) = self.lead.try_lock() {
                return Some(lead);
            }
            let Some(mut watch) = self.watch.try_lock_for(THREAD_IDLE) else {
                if self.retire() {
                    return None;
                }
                continue;
            };
            if self.stop.load(Ordering::SeqCst) {
                return None;
            }
            let Watch { poll, events } = &mut *watch;
            let woke = match poll.poll(events, Some(THREAD_IDLE)) {
                Ok(()) => !events.is_empty(),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => false,
                Err(e) => {
                    // Without a watch, follow by waiting for the lead itself.
                    tracing::warn!(error = %e, "cannot poll the RPC connections' watch");
                    true
                }
            };
            // Another follower may watch while this one waits for the lead.
            drop(watch);
            if woke {
                // Connections became ready while the leader answers, or requests wait.
                return Some(self.lead.lock());
            }
            if self.retire() {
                return None;
            }
        }
    }

    /// A thread: follows until it leads, polls until a request needs answering,
    /// answers it; again until the server stops.
    fn serve(self: Arc<Self>) {
        let mut held = None;
        loop {
            let mut lead = match held.take() {
                Some(lead) => lead,
                None => {
                    let Some(lead) = self.follow() else { return };
                    self.waiting.fetch_sub(1, Ordering::AcqRel);
                    lead
                }
            };
            self.disarm(&mut lead);
            let job = loop {
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(job) = lead.conns.next_job() {
                    break job;
                }
                if let Err(e) = lead.conns.turn() {
                    tracing::error!(error = %e, "RPC server cannot poll its connections; it stops");
                    self.stop.store(true, Ordering::SeqCst);
                    let _ = self.kick.wake();
                    return;
                }
            };
            // Someone must be able to take over while this thread answers. At the
            // maximum nobody can until a thread is free again: new requests wait, as
            // they would for a worker.
            if self.waiting.load(Ordering::Acquire) == 0 {
                if let Err(e) = self.grow() {
                    tracing::warn!(error = %e, "cannot start an RPC server thread");
                }
            }
            if lead.conns.has_jobs() {
                let _ = self.kick.wake();
            } else {
                self.arm(&mut lead);
            }
            drop(lead);
            let reply = job.answer(&*self.handler, &self.stats);
            match self.lead.try_lock() {
                // Nobody took the lead meanwhile: take it back and go on with the
                // connection here, waking no one. The watch is disabled before the
                // response leaves: the client's next request must not wake the deputy.
                Some(mut lead) => {
                    self.disarm(&mut lead);
                    let done = reply.send();
                    lead.conns.take_back(done);
                    self.work_after_answer();
                    lead.conns.spin_for(self.spin);
                    held = Some(lead);
                }
                // Another thread leads: it takes the connection back when woken.
                None => {
                    let done = reply.send();
                    // Counted as following only once its work is done (the leader
                    // starts a thread when none follows).
                    let after = self.handler.has_work_after_answer();
                    if !after {
                        self.waiting.fetch_add(1, Ordering::AcqRel);
                    }
                    if self.done.send(done).is_ok() {
                        let _ = self.waker.wake();
                    }
                    if after {
                        self.handler.work_after_answer();
                        self.waiting.fetch_add(1, Ordering::AcqRel);
                    }
                }
            }
        }
    }

    /// The handler's work after an answer, once its response is out (it never waits).
    fn work_after_answer(&self) {
        if self.handler.has_work_after_answer() {
            self.handler.work_after_answer();
        }
    }
}

/// `epoll_ctl(epfd, op, fd)` for events `events`, reported as [`CONNECTIONS`].
fn epoll_ctl(epfd: RawFd, op: libc::c_int, fd: RawFd, events: u32) -> std::io::Result<()> {
    let mut event = libc::epoll_event { events, u64: CONNECTIONS.0 as u64 };
    // SAFETY: `event` is a valid epoll_event that lives across the call; the kernel
    // only reads it. Both descriptors are owned by `Shared` (the watch and the
    // connections' poll), open for as long as it lives.
    if unsafe { libc::epoll_ctl(epfd, op, fd, &mut event) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use crate::master::{Master, MasterApi};
    use crate::rpc::handler::RpcHandler;
    use crate::rpc::server::{dispatch, RpcServer};
    use crate::rpc::wire::{Request, Response};
    use crate::rpc::RpcMasterClient;
    use crate::MasterConfig;

    /// A master whose next answer leaves slow work (a test's stand-in for work that
    /// takes long).
    struct Slow {
        master: Master,
        armed: AtomicBool,
        ran: AtomicUsize,
    }

    impl RpcHandler for Slow {
        fn handle(&self, request: Request) -> Response {
            dispatch(&*self.master, request)
        }

        fn has_work_after_answer(&self) -> bool {
            self.armed.load(Ordering::SeqCst)
        }

        fn work_after_answer(&self) {
            if self.armed.swap(false, Ordering::SeqCst) {
                std::thread::sleep(SLOW_WORK);
                self.ran.fetch_add(1, Ordering::SeqCst);
            }
        }
    }

    /// How long [`Slow`]'s work after an answer takes.
    const SLOW_WORK: Duration = Duration::from_secs(2);

    /// The work an answer leaves runs once its response is out: the client has its
    /// answer before the work ends, and the work runs once.
    #[test]
    fn work_after_an_answer_runs_once_the_response_is_out() {
        let handler = Arc::new(Slow {
            master: Master::new(MasterConfig::default()).unwrap(),
            armed: AtomicBool::new(true),
            ran: AtomicUsize::new(0),
        });
        let server =
            RpcServer::serve("127.0.0.1:0", handler.clone(), crate::rpc::wire::DEFAULT_MAX_FRAME, None).unwrap();
        let client = RpcMasterClient::connect(&server.local_addr().to_string()).unwrap();
        let asked = Instant::now();
        assert!(!client.exists("k").unwrap());
        // (Well short of the work, yet room for a loaded machine's round trip.)
        assert!(asked.elapsed() < SLOW_WORK * 3 / 4, "the answer waited for the work");
        assert_eq!(handler.ran.load(Ordering::SeqCst), 0);
        // The next request is answered after the work (it ran on the leading thread).
        assert!(!client.exists("k2").unwrap());
        let until = Instant::now() + Duration::from_secs(5);
        while handler.ran.load(Ordering::SeqCst) == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(handler.ran.load(Ordering::SeqCst), 1);
    }
}
