//! Faults while the store works: several clients put, upsert, remove and read their
//! own keys without pause, while a fault thread injects faults. Two runs:
//! - **master kills and node pauses**: the master is killed (`kill -9`, then a
//!   restart on its address) and storage nodes stopped (`SIGSTOP`, `SIGCONT`), now
//!   and then past their TTL, and now and then the master is killed while such a
//!   node is forgotten: the node comes back to a master without tombstones, with
//!   records of objects removed or replaced meanwhile;
//! - **node kills on SSD tiers**: nodes with an SSD tier (objects persisted as soon
//!   as they are put; one node per on-disk layout) are killed (`kill -9`) and restarted on their directory, at
//!   once or after the master forgot them; the master is killed now and then while
//!   every node runs, and nodes are paused.
//!
//! Every client keeps, per key, the set of states the store may hold (a call that
//! failed may or may not have taken effect) and checks each read against it. At the
//! end, with every process running again and once more after a last `kill -9` of
//! the master:
//! - no read ever returned bytes that were not written under that key, at a state
//!   the key could be in: no removed or overwritten version ever comes back (from a
//!   node's records or from its disk);
//! - every key holds one of the states its history allows: an acknowledged put or
//!   upsert is there (or what a later call may have left), an acknowledged remove
//!   stays removed. Objects are put with two replicas on two nodes, so an
//!   acknowledged one may be missing only after two node kills (neither memory
//!   replica left, the disk copy not yet written). After a master kill while a
//!   node was forgotten, a key removed since stays removed (the other nodes kept
//!   the removal for the new master, which never saw it; only a remove under way
//!   at the kill may leave the key at a state it held before), a key put or
//!   upserted since must hold the newer state whichever node comes back first, and
//!   no read may return an older one meanwhile (the node says it may have missed
//!   updates: what only it holds answers `Recovering` until the recovery window
//!   closes, or until a node that kept its removal is back).
//!
//! Seeded: a failure prints its seed; `MOONCAKE_CHAOS_SEED=N` runs that sequence of
//! choices again (the faults' timing still varies), `MOONCAKE_CHAOS_SECS=N` runs
//! longer than the default 25 s.

mod support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_core::{Error, ReplicateConfig, Store};
use proptest::prelude::RngExt;
use proptest::test_runner::{RngAlgorithm, TestRng};
use support::{payload, ssd_node_on, unique_dir, wait_until, Cluster};

/// How long a node's master remembers it without a heartbeat.
const CLIENT_TTL_MS: u64 = 3000;
const NODES: usize = 3;
const WORKERS: usize = 4;
const KEYS_PER_WORKER: usize = 24;

/// One version of one key's bytes: a header naming them, then bytes derived from it.
fn value(key: usize, version: u32, len: usize) -> Vec<u8> {
    let mut v = payload((key as u8).wrapping_mul(31) ^ version as u8, len.max(16));
    v[..4].copy_from_slice(&(key as u32).to_le_bytes());
    v[4..8].copy_from_slice(&version.to_le_bytes());
    v[8..16].copy_from_slice(&(len.max(16) as u64).to_le_bytes());
    v
}

/// The version `bytes` are of, if they are exactly some version of `key`.
fn version_of(key: usize, bytes: &[u8]) -> Option<u32> {
    if bytes.len() < 16 || bytes[..4] != (key as u32).to_le_bytes() {
        return None;
    }
    let version = u32::from_le_bytes(bytes[4..8].try_into().unwrap());
    (value(key, version, bytes.len()) == bytes).then_some(version)
}

/// The time of day (UTC), as the processes' logs print it.
fn clock() -> String {
    let ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() % 86_400_000;
    format!("{:02}:{:02}:{:02}.{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
}

/// A state a key may be in: absent, or holding one version.
type State = Option<u32>;

/// What one client knows of its keys.
struct Model {
    /// Per key, every state the store may hold now.
    may_hold: Vec<BTreeSet<State>>,
    /// Per key, the node kills counted before the call that set its state last
    /// began: two kills since, and its objects may be gone.
    kills_at_ack: Vec<u64>,
    /// Per key, every change of `may_hold`: (when its call began, when it was
    /// answered, `may_hold` after it), in the order answered.
    history: Vec<Vec<(Instant, Instant, BTreeSet<State>)>>,
    /// The `Faults::stale_returns` this model has taken in.
    stale_returns: Vec<Instant>,
}

impl Model {
    fn new() -> Self {
        Model {
            may_hold: (0..KEYS_PER_WORKER).map(|_| BTreeSet::from([None])).collect(),
            kills_at_ack: vec![0; KEYS_PER_WORKER],
            history: vec![Vec::new(); KEYS_PER_WORKER],
            stale_returns: Vec::new(),
        }
    }

    /// Notes `slot`'s new `may_hold`, set by a call begun at `started`.
    fn changed(&mut self, slot: usize, started: Instant) {
        self.history[slot].push((started, Instant::now(), self.may_hold[slot].clone()));
    }

    /// `slot`'s changes, for a report: each as (began, answered, may hold after), the
    /// times of day as the processes' logs print them.
    fn history_of(&self, slot: usize) -> String {
        let at = |t: Instant| {
            let ago = t.elapsed();
            let now = std::time::SystemTime::now();
            let ms = (now - ago).duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() % 86_400_000;
            format!("{:02}:{:02}:{:02}.{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000)
        };
        let recent = self.history[slot].iter().rev().take(12).rev();
        recent.map(|(s, a, after)| format!("[{} {} {after:?}]", at(*s), at(*a))).collect::<Vec<_>>().join(" ")
    }

    /// Every state `slot` may have held up to `to`.
    fn held_before(&self, slot: usize, to: Instant) -> BTreeSet<State> {
        let mut held = BTreeSet::from([None]);
        for (started, _, after) in &self.history[slot] {
            if *started <= to {
                held.extend(after.iter().copied());
            }
        }
        held
    }

    /// Takes in the master kills that happened while a node was forgotten (the
    /// master dead at `to`), for [`maybe`](Self::maybe). A key removed meanwhile stays
    /// removed (other nodes kept the removal for the restarted master), and a key put
    /// or upserted since holds the newer state (the restarted master keeps the newest
    /// copy offered back).
    fn follow(&mut self, faults: &Faults) {
        self.stale_returns = faults.stale_returns.lock().unwrap().clone();
    }

    /// A call that set `slot` to `state`, begun when `kills` nodes had been killed,
    /// was acknowledged.
    fn acknowledged(&mut self, slot: usize, state: State, kills: u64, started: Instant) {
        self.may_hold[slot] = BTreeSet::from([state]);
        self.kills_at_ack[slot] = kills;
        self.changed(slot, started);
    }

    /// Whether `slot` may be absent although no call of its history says so: two
    /// nodes killed since it was last set (neither replica left in memory, and maybe
    /// not on a disk yet).
    fn may_be_lost(&self, slot: usize, kills_now: u64) -> bool {
        kills_now >= self.kills_at_ack[slot] + 2
    }

    /// A call that would set `slot` to `state`, begun at `started`, failed: it may
    /// have taken effect.
    fn maybe(&mut self, slot: usize, state: State, started: Instant) {
        self.may_hold[slot].insert(state);
        if state.is_none() {
            // A remove under way when the master was killed while a node was
            // forgotten may have taken effect there: the node may bring back what
            // the key held while it was stopped, as for a remove acknowledged then.
            for &to in &self.stale_returns {
                if started <= to {
                    let held = self.held_before(slot, to);
                    self.may_hold[slot].extend(held);
                }
            }
        }
        self.changed(slot, started);
    }

    /// What the answer `res` of a call that sets `slot` to `state`, begun at
    /// `started` after `kills` node kills, says, counted.
    fn answered(
        &mut self,
        tally: &Tally,
        slot: usize,
        state: State,
        (kills, started): (u64, Instant),
        res: &Result<(), Error>,
    ) {
        match res {
            Ok(()) => {
                self.acknowledged(slot, state, kills, started);
                let count = if state.is_some() { &tally.acknowledged_writes } else { &tally.acknowledged_removes };
                count.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.maybe(slot, state, started);
                tally.failed_calls.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What the run saw, for the report and for the test to mean something.
#[derive(Default)]
struct Tally {
    acknowledged_writes: AtomicU64,
    acknowledged_removes: AtomicU64,
    failed_calls: AtomicU64,
    good_reads: AtomicU64,
    master_kills: AtomicU64,
    node_pauses: AtomicU64,
    pauses_past_ttl: AtomicU64,
    master_kills_while_forgotten: AtomicU64,
    nodes_forgotten_killed: AtomicU64,
}

fn client(addr: &str) -> Store {
    Store::builder().master_address(addr).global_segment_size(0).master_timeout(Duration::from_secs(2)).build().unwrap()
}

/// The faults that make `NotFound` legitimate for a key the model says is there.
#[derive(Default)]
struct Faults {
    /// Set from the moment a node is stopped past its TTL until its objects are
    /// surely back (they come back when it re-joins).
    node_forgotten: AtomicBool,
    /// Nodes killed so far (counted before the signal).
    node_kills: AtomicU64,
    /// When the master was dead, for each kill while a node was forgotten (pushed
    /// before its restart).
    stale_returns: std::sync::Mutex<Vec<Instant>>,
}

impl Faults {
    fn kills(&self) -> u64 {
        self.node_kills.load(Ordering::SeqCst)
    }
}

/// One client's loop: random calls on its own keys until `stop`.
fn work(
    worker: usize,
    seed: u64,
    addr: String,
    two: ReplicateConfig,
    stop: Arc<AtomicBool>,
    faults: Arc<Faults>,
    tally: Arc<Tally>,
) -> (Model, Vec<String>) {
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes(seed ^ worker as u64));
    let store = client(&addr);
    let mut model = Model::new();
    let mut problems = Vec::new();
    let mut next_version = 1u32;
    let key_of = |slot: usize| worker * KEYS_PER_WORKER + slot;
    let name = |slot: usize| format!("chaos/{}", key_of(slot));
    let len = |rng: &mut TestRng| match rng.random_range(0..10) {
        0 => rng.random_range(256 << 10..1 << 20),
        _ => rng.random_range(16..96 << 10),
    };
    // A read of `slot` answered `got` (bytes or NotFound); anything else is no news.
    let check = |model: &Model, slot: usize, got: Result<&[u8], &Error>, problems: &mut Vec<String>| {
        let may = &model.may_hold[slot];
        match got {
            Ok(bytes) => match version_of(key_of(slot), bytes) {
                Some(v) if may.contains(&Some(v)) => {
                    tally.good_reads.fetch_add(1, Ordering::Relaxed);
                }
                Some(v) => problems.push(format!(
                    "{} {}: read version {v}, may hold {may:?}; its history: {}",
                    clock(),
                    name(slot),
                    model.history_of(slot)
                )),
                None => problems.push(format!(
                    "{} {}: read {} bytes that were never written",
                    clock(),
                    name(slot),
                    bytes.len()
                )),
            },
            Err(Error::NotFound(_))
                if !may.contains(&None)
                    && !faults.node_forgotten.load(Ordering::SeqCst)
                    && !model.may_be_lost(slot, faults.kills()) =>
            {
                problems.push(format!("{} {}: NotFound, may hold {may:?}", clock(), name(slot)))
            }
            Err(_) => {}
        }
    };
    while !stop.load(Ordering::Relaxed) {
        model.follow(&faults);
        let kills = (faults.kills(), Instant::now());
        let slot = rng.random_range(0..KEYS_PER_WORKER);
        let key = name(slot);
        match rng.random_range(0..100) {
            // Reads, by value and into a buffer.
            0..30 => {
                let got = store.get(&key);
                model.follow(&faults);
                check(&model, slot, got.as_deref(), &mut problems)
            }
            30..35 => {
                let mut buf = vec![0u8; 1 << 20];
                let got = store.get_into(&key, &mut buf).map(|n| &buf[..n]);
                model.follow(&faults);
                check(&model, slot, got.as_deref(), &mut problems);
            }
            // Puts: only of keys the model says are absent (objects are immutable).
            35..55 => {
                if model.may_hold[slot] != BTreeSet::from([None]) {
                    continue;
                }
                next_version += 1;
                let res = store.put_with(&key, &value(key_of(slot), next_version, len(&mut rng)), &two);
                model.answered(&tally, slot, Some(next_version), kills, &res);
            }
            55..75 => {
                next_version += 1;
                let res = store.upsert_with(&key, &value(key_of(slot), next_version, len(&mut rng)), &two);
                model.answered(&tally, slot, Some(next_version), kills, &res);
            }
            75..88 => model.answered(&tally, slot, None, kills, &store.remove(&key)),
            // Batch forms over a few of this client's keys.
            88..94 => {
                let slots: Vec<usize> =
                    (0..rng.random_range(2..6)).map(|_| rng.random_range(0..KEYS_PER_WORKER)).collect();
                let slots: Vec<usize> = slots.into_iter().collect::<BTreeSet<_>>().into_iter().collect();
                let keys: Vec<String> = slots.iter().map(|&s| name(s)).collect();
                let values: Vec<(u32, Vec<u8>)> = slots
                    .iter()
                    .map(|&s| {
                        next_version += 1;
                        (next_version, value(key_of(s), next_version, len(&mut rng)))
                    })
                    .collect();
                let items: Vec<(&str, &[u8])> =
                    keys.iter().zip(&values).map(|(k, (_, v))| (k.as_str(), v.as_slice())).collect();
                for ((&s, (version, _)), r) in slots.iter().zip(&values).zip(store.batch_upsert(&items, &two)) {
                    model.answered(&tally, s, Some(*version), kills, &r);
                }
            }
            94..97 => {
                let slots: Vec<usize> = (0..4).map(|_| rng.random_range(0..KEYS_PER_WORKER)).collect();
                let keys: Vec<String> = slots.iter().map(|&s| name(s)).collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                let got = store.batch_get(&refs);
                model.follow(&faults);
                for (&s, r) in slots.iter().zip(got) {
                    check(&model, s, r.as_deref(), &mut problems);
                }
            }
            _ => {
                let slots: BTreeSet<usize> = (0..3).map(|_| rng.random_range(0..KEYS_PER_WORKER)).collect();
                let keys: Vec<String> = slots.iter().map(|&s| name(s)).collect();
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                for (&s, r) in slots.iter().zip(store.batch_remove(&refs)) {
                    model.answered(&tally, s, None, kills, &r);
                }
            }
        }
    }
    model.follow(&faults);
    (model, problems)
}

fn seed_bytes(seed: u64) -> [u8; 32] {
    let mut bytes = [0u8; 32];
    for (i, chunk) in bytes.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(i as u32 * 7)).to_le_bytes());
    }
    bytes
}

/// A number in the master's JSON status, e.g. `"segments": 2`.
fn status_number(c: &Cluster, field: &str) -> Option<u64> {
    let status = std::panic::catch_unwind(|| c.status()).ok()?;
    let at = status.find(&format!("\"{field}\": "))? + field.len() + 4;
    status[at..].split(|ch: char| !ch.is_ascii_digit()).next()?.parse().ok()
}

/// `kill -9` of the master, then a restart on its address `down` later.
fn kill_master(c: &mut Cluster, down: Duration, tally: &Tally) {
    eprintln!("{} chaos: kill -9 of the master", clock());
    c.master.kill9();
    std::thread::sleep(down);
    c.restart_master();
    tally.master_kills.fetch_add(1, Ordering::Relaxed);
}

/// Master kills and node pauses, at random, until `until`; returns with every
/// process running.
fn inject_master_kills_and_pauses(c: &mut Cluster, rng: &mut TestRng, until: Instant, faults: &Faults, tally: &Tally) {
    let ttl = Duration::from_millis(CLIENT_TTL_MS);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1500)));
        match rng.random_range(0..10) {
            0..3 => {
                let down = Duration::from_millis(rng.random_range(0..500));
                kill_master(c, down, tally);
            }
            3..8 => {
                // Paused well within its TTL; sometimes the master dies meanwhile.
                let node = rng.random_range(0..NODES);
                eprintln!("{} chaos: node {node} stopped", clock());
                c.nodes[node].signal("STOP");
                let pause = Duration::from_millis(rng.random_range(200..2000));
                if rng.random_range(0..4) == 0 {
                    kill_master(c, Duration::ZERO, tally);
                }
                std::thread::sleep(pause);
                c.nodes[node].signal("CONT");
                eprintln!("{} chaos: node {node} continued", clock());
                tally.node_pauses.fetch_add(1, Ordering::Relaxed);
            }
            choice @ 8..10 => {
                // Past its TTL: forgotten, then back with what nothing superseded.
                // With 9 the master is killed while the node is forgotten: the node
                // comes back to a master that never saw what was removed or put
                // again meanwhile (and may be the first back).
                let kill = choice == 9;
                let node = rng.random_range(0..NODES);
                faults.node_forgotten.store(true, Ordering::SeqCst);
                let then = if kill { ", the master to be killed" } else { "" };
                eprintln!("{} chaos: node {node} stopped past its TTL{then}", clock());
                c.nodes[node].signal("STOP");
                std::thread::sleep(ttl + Duration::from_millis(rng.random_range(500..2000)));
                if kill {
                    // The kill's time is taken once the master is dead: a call begun
                    // before may still have been served by it.
                    eprintln!("{} chaos: kill -9 of the master", clock());
                    c.master.kill9();
                    faults.stale_returns.lock().unwrap().push(Instant::now());
                    c.restart_master();
                    tally.master_kills.fetch_add(1, Ordering::Relaxed);
                }
                c.nodes[node].signal("CONT");
                wait_until(Duration::from_secs(20), || status_number(c, "segments") == Some(NODES as u64));
                std::thread::sleep(Duration::from_millis(1000));
                faults.node_forgotten.store(false, Ordering::SeqCst);
                let count = if kill { &tally.master_kills_while_forgotten } else { &tally.pauses_past_ttl };
                count.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// Node kills (with a restart on the node's SSD directory), master kills while
/// every node runs, and node pauses, at random, until `until`; returns with every
/// process running.
fn inject_node_kills(
    c: &mut Cluster,
    dirs: &[PathBuf],
    rng: &mut TestRng,
    until: Instant,
    faults: &Faults,
    tally: &Tally,
) {
    let ttl = Duration::from_millis(CLIENT_TTL_MS);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(rng.random_range(300..1500)));
        match rng.random_range(0..10) {
            0..4 => {
                let node = rng.random_range(0..NODES);
                faults.node_kills.fetch_add(1, Ordering::SeqCst);
                eprintln!("{} chaos: kill -9 of node {node}", clock());
                c.nodes[node].kill9();
                // Back at once (its old segment still mounted, its reads and writes
                // failing), or after the master forgot it.
                if rng.random_range(0..3) == 0 {
                    std::thread::sleep(ttl + Duration::from_millis(rng.random_range(500..1500)));
                    tally.nodes_forgotten_killed.fetch_add(1, Ordering::Relaxed);
                } else {
                    std::thread::sleep(Duration::from_millis(rng.random_range(0..1000)));
                }
                // Returns once what its SSD holds is registered again (or refused and
                // deleted): only then may the master die without the removals it
                // remembers (its tombstones) going with it.
                c.nodes[node] = ssd_node(c, dirs, node);
                eprintln!("{} chaos: node {node} restarted", clock());
            }
            4..6 => {
                let down = Duration::from_millis(rng.random_range(0..500));
                kill_master(c, down, tally);
            }
            6..9 => {
                let node = rng.random_range(0..NODES);
                eprintln!("{} chaos: node {node} stopped", clock());
                c.nodes[node].signal("STOP");
                std::thread::sleep(Duration::from_millis(rng.random_range(200..2000)));
                c.nodes[node].signal("CONT");
                eprintln!("{} chaos: node {node} continued", clock());
                tally.node_pauses.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// The store's answer for `key` once it settles (retryable errors retried): its
/// bytes, or `None` for NotFound.
fn read_settled(store: &Store, key: &str) -> Result<Option<Vec<u8>>, Error> {
    let start = Instant::now();
    loop {
        match store.get(key) {
            Ok(b) => return Ok(Some(b.to_vec())),
            Err(Error::NotFound(_)) => return Ok(None),
            Err(e) if start.elapsed() < Duration::from_secs(20) => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Every key of every model against what the store holds; the problems found.
fn check_all(store: &Store, models: &[Model], faults: &Faults, when: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (worker, model) in models.iter().enumerate() {
        for (slot, may) in model.may_hold.iter().enumerate() {
            let key = worker * KEYS_PER_WORKER + slot;
            let state = match read_settled(store, &format!("chaos/{key}")) {
                Ok(None) => None,
                Ok(Some(bytes)) => match version_of(key, &bytes) {
                    Some(v) => Some(v),
                    None => {
                        problems.push(format!("{when}: chaos/{key}: {} bytes never written", bytes.len()));
                        continue;
                    }
                },
                Err(e) => {
                    problems.push(format!("{when}: chaos/{key}: unreadable ({e})"));
                    continue;
                }
            };
            let lost = state.is_none() && model.may_be_lost(slot, faults.kills());
            if !may.contains(&state) && !lost {
                problems.push(format!("{when}: chaos/{key} holds {state:?}, its history allows {may:?}"));
            }
        }
    }
    problems
}

/// Which faults a run injects.
enum Scenario {
    /// `kill -9` of the master, `SIGSTOP` of nodes (some past their TTL).
    MasterKillsAndPauses,
    /// `kill -9` of nodes with SSD tiers in `dirs`, restarted there; master kills
    /// and node pauses beside them.
    NodeKillsOnSsd { dirs: Vec<PathBuf> },
}

/// Segment and SSD tier of a node of the SSD run.
const SSD_SEGMENT: &str = "64MiB";
const SSD_CAPACITY: &str = "256MiB";
/// Node `i` of the SSD run keeps its tier in layout `SSD_BACKENDS[i]`: every run
/// covers the three.
const SSD_BACKENDS: [&str; NODES] = ["bucket", "file_per_key", "offset_allocator"];

/// Starts node `i` of the SSD run on its directory (again, after a kill).
fn ssd_node(c: &Cluster, dirs: &[PathBuf], i: usize) -> support::Proc {
    ssd_node_on(&c.master_addr, &dirs[i], SSD_SEGMENT, SSD_CAPACITY, SSD_BACKENDS[i])
}

/// Runs the clients against `c` under the faults of `scenario` for the default
/// `default_secs` (or `MOONCAKE_CHAOS_SECS`), then checks every key twice.
fn run(mut c: Cluster, scenario: Scenario, two: ReplicateConfig, default_secs: u64) {
    let seed = std::env::var("MOONCAKE_CHAOS_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    let secs = std::env::var("MOONCAKE_CHAOS_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(default_secs);
    eprintln!("chaos seed {seed} (MOONCAKE_CHAOS_SEED={seed} runs the same choices), {secs} s");
    let stop = Arc::new(AtomicBool::new(false));
    let faults = Arc::new(Faults::default());
    let tally = Arc::new(Tally::default());
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (addr, two) = (c.master_addr.clone(), two.clone());
            let (stop, faults, tally) = (stop.clone(), faults.clone(), tally.clone());
            std::thread::spawn(move || work(w, seed, addr, two, stop, faults, tally))
        })
        .collect();
    let mut rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes(seed));
    let until = Instant::now() + Duration::from_secs(secs);
    match &scenario {
        Scenario::MasterKillsAndPauses => inject_master_kills_and_pauses(&mut c, &mut rng, until, &faults, &tally),
        Scenario::NodeKillsOnSsd { dirs } => inject_node_kills(&mut c, dirs, &mut rng, until, &faults, &tally),
    }
    // Calm: the clients go on a little with everything running (killed nodes'
    // old segments forgotten), then stop.
    wait_until(Duration::from_secs(20), || status_number(&c, "segments") == Some(NODES as u64));
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    let mut models = Vec::new();
    let mut problems = Vec::new();
    for w in workers {
        let (model, found) = w.join().unwrap();
        models.push(model);
        problems.extend(found);
    }
    let t = &*tally;
    let report = format!(
        "seed {seed}: {} writes and {} removes acknowledged, {} calls failed, {} reads checked; \
         {} master kills ({} while a node was forgotten), {} node pauses, {} past the TTL, \
         {} node kills ({} forgotten before the restart)",
        t.acknowledged_writes.load(Ordering::Relaxed),
        t.acknowledged_removes.load(Ordering::Relaxed),
        t.failed_calls.load(Ordering::Relaxed),
        t.good_reads.load(Ordering::Relaxed),
        t.master_kills.load(Ordering::Relaxed),
        t.master_kills_while_forgotten.load(Ordering::Relaxed),
        t.node_pauses.load(Ordering::Relaxed),
        t.pauses_past_ttl.load(Ordering::Relaxed),
        faults.kills(),
        t.nodes_forgotten_killed.load(Ordering::Relaxed),
    );
    eprintln!("{report}");
    let store = client(&c.master_addr);
    problems.extend(check_all(&store, &models, &faults, "with every process running"));
    assert_eq!(status_number(&c, "evicted_objects"), Some(0), "the run must not evict: {}", c.status());
    // What a master rebuilds from the nodes (their records, their disks) is the same.
    c.master.kill9();
    c.restart_master();
    wait_until(Duration::from_secs(20), || status_number(&c, "segments") == Some(NODES as u64));
    problems.extend(check_all(&store, &models, &faults, "after a last kill -9 of the master"));
    assert!(problems.is_empty(), "{report}\n{}", problems.join("\n"));
    assert!(t.acknowledged_writes.load(Ordering::Relaxed) >= 100, "{report}: too few writes to mean anything");
    drop(c);
    if let Scenario::NodeKillsOnSsd { dirs } = scenario {
        for dir in dirs {
            std::fs::remove_dir_all(dir).ok();
        }
    }
}

#[test]
fn no_acknowledged_write_lost_and_no_wrong_bytes_under_kills_and_pauses() {
    let ttl = CLIENT_TTL_MS.to_string();
    let c = Cluster::start(&["--client-ttl-ms", &ttl, "--default-lease-ms", "1"], NODES);
    run(c, Scenario::MasterKillsAndPauses, ReplicateConfig { replica_num: 2, ..Default::default() }, 25);
}

#[test]
fn node_kills_on_ssd_tiers_bring_back_nothing_removed_or_overwritten() {
    let ttl = CLIENT_TTL_MS.to_string();
    let mut c = Cluster::start(&["--client-ttl-ms", &ttl, "--default-lease-ms", "1", "--persist", "eager"], 0);
    let dirs: Vec<PathBuf> = (0..NODES).map(|i| unique_dir(&format!("chaos-ssd-{i}"))).collect();
    for i in 0..NODES {
        let node = ssd_node(&c, &dirs, i);
        c.nodes.push(node);
    }
    // Two replicas on two nodes or the put fails: one node's kill never loses an
    // acknowledged object.
    let two = ReplicateConfig { replica_num: 2, require_all_replicas: true, ..Default::default() };
    run(c, Scenario::NodeKillsOnSsd { dirs }, two, 25);
}
