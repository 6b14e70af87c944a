//! The RPC server's threads, leader/follower: one thread at a time (the leader) polls
//! the listener and every connection ([`Loop`]). When a request needs answering, the
//! leader hands the lead to a waiting thread and answers the request itself, writing
//! the response straight to the client's socket.
//!
//! Why: latency here is thread hand-offs. Waking a thread on another core costs tens
//! of microseconds on a virtual machine, more than a loopback round trip. A request
//! polled by one thread and answered by another, whose answer goes back through the
//! first, pays two such hand-offs on the client's path; here the thread that read the
//! request answers it, as a thread per connection would, while idle connections still
//! cost no thread. The hand-offs left (waking the next leader, and telling it that
//! the connection may go on) happen while the request is answered and after the
//! client has its response, not in between.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::Sender;
use mio::Waker;
use parking_lot::Mutex;

use super::event_loop::{Done, Loop};
use super::handler::{RpcHandler, RpcServerConfig, RpcServerStats};

/// How long a thread beyond the minimum waits for the lead before it exits.
const THREAD_IDLE: Duration = Duration::from_secs(10);

/// The server's threads; dropping it stops and joins them, and closes the listener
/// and every connection.
pub(crate) struct ServerThreads {
    shared: Arc<Shared>,
}

/// What the threads share.
struct Shared {
    /// The connections, polled by whichever thread holds this lock: the leader.
    lead: Mutex<Loop>,
    /// Ends the leader's turn: a connection came back, or the server stops.
    waker: Waker,
    stop: AtomicBool,
    /// Connections whose requests were answered, back to the leader.
    done: Sender<Done>,
    handler: Arc<dyn RpcHandler>,
    stats: Arc<RpcServerStats>,
    /// Threads kept (even idle), and most threads.
    min: usize,
    max: usize,
    /// Threads running, and those waiting for the lead.
    total: AtomicUsize,
    waiting: AtomicUsize,
    handles: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl ServerThreads {
    /// Serves `listener` with `handler`: `config.workers` threads (0: one per core, 2
    /// to 16), more when every one is busy answering (a request may block, as a put
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
        let (done_tx, done_rx) = crossbeam_channel::unbounded::<Done>();
        let lead = Loop::new(listener, handler.clone(), config, stats.clone(), done_rx)?;
        let waker = lead.waker()?;
        let shared = Arc::new(Shared {
            lead: Mutex::new(lead),
            waker,
            stop: AtomicBool::new(false),
            done: done_tx,
            handler,
            stats,
            min,
            max,
            total: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            handles: Mutex::new(Vec::new()),
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
    /// Starts a thread (if under the maximum and not stopping), counted as waiting
    /// for the lead from now on.
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
    /// is not the last one waiting (a leader that saw it waiting counts on it to lead
    /// next). Returns whether it exits.
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

    /// A thread: waits for the lead, polls until a request needs answering, hands
    /// the lead on and answers it; again until the server stops.
    fn serve(self: Arc<Self>) {
        let mut held = None;
        loop {
            let mut lead = match held.take() {
                Some(lead) => lead,
                None => {
                    let lead = loop {
                        if let Some(lead) = self.lead.try_lock_for(THREAD_IDLE) {
                            break lead;
                        }
                        if self.retire() {
                            return;
                        }
                    };
                    self.waiting.fetch_sub(1, Ordering::AcqRel);
                    lead
                }
            };
            let job = loop {
                if self.stop.load(Ordering::SeqCst) {
                    return;
                }
                if let Some(job) = lead.next_job() {
                    break job;
                }
                if let Err(e) = lead.turn() {
                    tracing::error!(error = %e, "RPC server cannot poll its connections; it stops");
                    self.stop.store(true, Ordering::SeqCst);
                    return;
                }
            };
            // Someone must lead while this thread answers. At the maximum nobody
            // does until a thread is free again: new requests wait, as they would
            // for a worker.
            if self.waiting.load(Ordering::Acquire) == 0 {
                if let Err(e) = self.grow() {
                    tracing::warn!(error = %e, "cannot start an RPC server thread");
                }
            }
            drop(lead);
            let done = job.answer(&*self.handler, &self.stats);
            match self.lead.try_lock() {
                // Nobody took the lead meanwhile: take it back and go on with the
                // connection here, waking no one.
                Some(mut lead) => {
                    lead.take_back(done);
                    held = Some(lead);
                }
                // The leader polls: it takes the connection back when woken.
                None => {
                    self.waiting.fetch_add(1, Ordering::AcqRel);
                    if self.done.send(done).is_ok() {
                        let _ = self.waker.wake();
                    }
                }
            }
        }
    }
}
