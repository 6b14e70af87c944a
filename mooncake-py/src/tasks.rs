//! Copy and move tasks: `create_copy_task`, `create_move_task` and `query_task`.
//!
//! The reference's master hands such tasks to the client that holds the source
//! replica. Here the client that creates a task runs it, on one worker thread per
//! client (tasks run one after the other, off the caller's thread), over the engine's
//! `replicate` (copy to named segments) and `drop_replicas` (a move drops the source
//! replica once the copy is complete). A task is queried by its id on the client that
//! created it.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mooncake_core::{Error, ReplicateConfig};
use parking_lot::Mutex;
use pyo3::prelude::*;

use crate::session::Session;

/// Finished tasks kept for `query_task`; the oldest go first beyond this.
const KEEP_FINISHED: usize = 4096;
/// How long a move waits for readers of the source replica to finish before failing.
const DROP_DEADLINE: Duration = Duration::from_secs(30);
/// Poll period of that wait.
const DROP_POLL: Duration = Duration::from_millis(10);

/// What a task does.
#[pyclass(name = "TaskType", module = "mooncake_rs.store", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskType {
    /// Copy an object to named segments.
    #[pyo3(name = "REPLICA_COPY")]
    ReplicaCopy,
    /// Move a replica from one segment to another.
    #[pyo3(name = "REPLICA_MOVE")]
    ReplicaMove,
}

/// Where a task is.
#[pyclass(name = "TaskStatus", module = "mooncake_rs.store", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskStatus {
    /// Waiting for the worker.
    #[pyo3(name = "PENDING")]
    Pending,
    /// Running.
    #[pyo3(name = "PROCESSING")]
    Processing,
    /// Done.
    #[pyo3(name = "SUCCESS")]
    Success,
    /// Failed; `message` says why.
    #[pyo3(name = "FAILED")]
    Failed,
}

/// The state of one task, as `query_task` returns it.
#[pyclass(name = "QueryTaskResponse", module = "mooncake_rs.store", frozen, get_all)]
#[derive(Clone, Debug)]
pub struct QueryTaskResponse {
    /// The task's id: two 64-bit integers.
    pub id: (u64, u64),
    /// Copy or move.
    #[pyo3(name = "type")]
    pub kind: TaskType,
    /// Where it is.
    pub status: TaskStatus,
    /// When it was created (ms since the Unix epoch).
    pub created_at_ms_epoch: i64,
    /// When its status last changed (ms since the Unix epoch).
    pub last_updated_at_ms_epoch: i64,
    /// The client that runs it: `(0, client id)`.
    pub assigned_client: (u64, u64),
    /// Why it failed ("" otherwise).
    pub message: String,
}

#[pymethods]
impl QueryTaskResponse {
    fn __repr__(&self) -> String {
        format!(
            "QueryTaskResponse(id=({}, {}), type={}, status={}, created_at={}, last_updated_at={}, \
             assigned_client=({}, {}), message={:?})",
            self.id.0,
            self.id.1,
            self.kind as i32,
            self.status as i32,
            self.created_at_ms_epoch,
            self.last_updated_at_ms_epoch,
            self.assigned_client.0,
            self.assigned_client.1,
            self.message
        )
    }
}

/// One task to run.
enum Job {
    Copy { key: String, targets: Vec<String> },
    Move { key: String, source: String, target: String },
}

#[derive(Default)]
struct Inner {
    tasks: HashMap<(u64, u64), QueryTaskResponse>,
    worker: Option<Sender<((u64, u64), Job)>>,
    created: u64,
}

/// The tasks of one client.
#[derive(Default)]
pub struct TaskTable {
    inner: Mutex<Inner>,
}

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

impl TaskTable {
    /// The task `id`, if this client created it (and it was not forgotten).
    pub fn query(&self, id: (u64, u64)) -> Option<QueryTaskResponse> {
        self.inner.lock().tasks.get(&id).cloned()
    }

    fn set(&self, id: (u64, u64), status: TaskStatus, message: String) {
        if let Some(t) = self.inner.lock().tasks.get_mut(&id) {
            t.status = status;
            t.message = message;
            t.last_updated_at_ms_epoch = now_ms();
        }
    }
}

/// Records a task of `session` and hands it to the session's worker; returns its id.
fn submit(session: &Arc<Session>, kind: TaskType, job: Job) -> (u64, u64) {
    let mut inner = session.tasks.inner.lock();
    inner.created += 1;
    let rs = std::collections::hash_map::RandomState::new();
    let id = (rs.hash_one((inner.created, now_ms(), 1u8)), rs.hash_one((inner.created, std::process::id(), 2u8)));
    let t = now_ms();
    inner.tasks.insert(
        id,
        QueryTaskResponse {
            id,
            kind,
            status: TaskStatus::Pending,
            created_at_ms_epoch: t,
            last_updated_at_ms_epoch: t,
            assigned_client: (0, session.store.client_id()),
            message: String::new(),
        },
    );
    forget_old(&mut inner.tasks);
    let sender = inner.worker.get_or_insert_with(|| spawn_worker(Arc::downgrade(session)));
    if sender.send((id, job)).is_err() {
        // The worker could not start (no thread): the task fails at once.
        if let Some(t) = inner.tasks.get_mut(&id) {
            t.status = TaskStatus::Failed;
            t.message = "cannot start the task worker".into();
        }
    }
    id
}

/// Drops the oldest finished tasks beyond [`KEEP_FINISHED`].
fn forget_old(tasks: &mut HashMap<(u64, u64), QueryTaskResponse>) {
    let finished = |t: &QueryTaskResponse| matches!(t.status, TaskStatus::Success | TaskStatus::Failed);
    let n = tasks.values().filter(|t| finished(t)).count();
    if n <= KEEP_FINISHED {
        return;
    }
    let mut old: Vec<((u64, u64), i64)> =
        tasks.values().filter(|t| finished(t)).map(|t| (t.id, t.created_at_ms_epoch)).collect();
    old.sort_by_key(|&(_, at)| at);
    for (id, _) in old.into_iter().take(n - KEEP_FINISHED) {
        tasks.remove(&id);
    }
}

/// The worker of a session: runs its tasks in order; exits with the session.
fn spawn_worker(session: Weak<Session>) -> Sender<((u64, u64), Job)> {
    let (tx, rx) = channel::<((u64, u64), Job)>();
    let spawned = std::thread::Builder::new().name("mooncake-py-tasks".into()).spawn(move || {
        while let Ok((id, job)) = rx.recv() {
            let Some(s) = session.upgrade() else { return };
            s.tasks.set(id, TaskStatus::Processing, String::new());
            let outcome = match &job {
                Job::Copy { key, targets } => copy(&s, key, targets),
                Job::Move { key, source, target } => {
                    copy(&s, key, std::slice::from_ref(target)).and_then(|()| drop_with_retry(&s, key, source))
                }
            };
            match outcome {
                Ok(()) => s.tasks.set(id, TaskStatus::Success, String::new()),
                Err(why) => s.tasks.set(id, TaskStatus::Failed, why),
            }
        }
    });
    // Without a thread the receiver went with the closure: sends fail, and each task
    // is marked failed at once.
    drop(spawned);
    tx
}

/// Names of the segments holding complete replicas of `key`.
fn holders(s: &Session, key: &str) -> Result<(Vec<String>, bool), String> {
    let info = s.store.master().object_info(key).map_err(|e| e.to_string())?;
    let mut names = Vec::with_capacity(info.replicas.len());
    for r in &info.replicas {
        names.push(s.store.master().segment_info(r.segment).map_err(|e| e.to_string())?.name);
    }
    Ok((names, info.soft_pin))
}

/// Copies `key` to each of `targets` (segment names) that does not hold it yet.
fn copy(s: &Session, key: &str, targets: &[String]) -> Result<(), String> {
    let (before, pinned) = holders(s, key)?;
    let needed: Vec<String> = targets.iter().filter(|t| !before.contains(t)).cloned().collect();
    if needed.is_empty() {
        return Ok(());
    }
    let cfg = ReplicateConfig {
        replica_num: before.len() + needed.len(),
        preferred_segments: needed.clone(),
        // `replicate` sets the pin as the config says: keep the object's.
        soft_pin: pinned,
        ..Default::default()
    };
    s.store.replicate(key, &cfg).map_err(|e| e.to_string())?;
    let (after, _) = holders(s, key)?;
    // Placement falls back to other segments when a target has no room: such a
    // replica was not asked for, and goes.
    for stray in after.iter().filter(|n| !before.contains(n) && !needed.contains(n)) {
        let _ = drop_with_retry(s, key, stray);
    }
    let missing: Vec<&String> = needed.iter().filter(|t| !after.contains(t)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(format!("no room for a replica of {key} on {missing:?}"))
    }
}

/// Drops `key`'s replica on `segment`, waiting (bounded) for readers to finish.
fn drop_with_retry(s: &Session, key: &str, segment: &str) -> Result<(), String> {
    let deadline = Instant::now() + DROP_DEADLINE;
    loop {
        match s.store.drop_replicas(&[key], segment).pop() {
            Some(Err(Error::HasLease(_))) if Instant::now() < deadline => std::thread::sleep(DROP_POLL),
            Some(Err(e)) => return Err(e.to_string()),
            _ => return Ok(()),
        }
    }
}

/// `create_copy_task`: checks the request as the reference's master does, then
/// queues it. `Ok(id)` or the code to return.
pub fn create_copy(s: &Arc<Session>, key: &str, targets: &[String]) -> Result<(u64, u64), i32> {
    use crate::codes::{code, INVALID_PARAMS, OBJECT_NOT_FOUND};
    if targets.is_empty() {
        return Err(INVALID_PARAMS);
    }
    match s.store.exists(key) {
        Ok(true) => {}
        Ok(false) => return Err(OBJECT_NOT_FOUND),
        Err(e) => return Err(code(&e)),
    }
    let mut resolved = Vec::with_capacity(targets.len());
    for t in targets {
        resolved.push(s.resolve_segment(t).ok_or(INVALID_PARAMS)?);
    }
    Ok(submit(s, TaskType::ReplicaCopy, Job::Copy { key: key.to_owned(), targets: resolved }))
}

/// `create_move_task`: checks the request as the reference's master does, then
/// queues it.
pub fn create_move(s: &Arc<Session>, key: &str, source: &str, target: &str) -> Result<(u64, u64), i32> {
    use crate::codes::{INVALID_PARAMS, OBJECT_NOT_FOUND};
    let (holding, _) = match holders(s, key) {
        Ok(h) => h,
        Err(_) => return Err(OBJECT_NOT_FOUND),
    };
    let target = s.resolve_segment(target).ok_or(INVALID_PARAMS)?;
    let source = s.resolve_segment(source).ok_or(INVALID_PARAMS)?;
    if source == target || !holding.contains(&source) {
        return Err(INVALID_PARAMS);
    }
    Ok(submit(s, TaskType::ReplicaMove, Job::Move { key: key.to_owned(), source, target }))
}
