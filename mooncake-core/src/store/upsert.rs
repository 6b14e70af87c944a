//! Upserts: a put that replaces the object if the key is taken, atomically (a
//! concurrent reader gets the old bytes or the new ones, never a mix, and never
//! `NotFound` for a key that existed throughout). The master keeps the old replicas
//! readable while the new ones are written and swaps them in one step.

use std::time::{Duration, Instant};

use crate::config::ReplicateConfig;
use crate::error::{Error, Result};
use crate::master::{ClientId, MasterApi, MemoryReplica};

use super::Store;

/// How many times an upsert is placed again after writing to a segment failed, as
/// a put is.
const ATTEMPTS: usize = 3;

/// How long an upsert waits for another write of the same key (put or upsert) to
/// finish before giving up with `AlreadyExists`.
const BUSY_WAIT: Duration = Duration::from_secs(5);
/// First pause between two tries of a key another write holds (doubled up to
/// [`BUSY_PAUSE_MAX`]).
const BUSY_PAUSE: Duration = Duration::from_micros(200);
/// Longest pause between two tries of a busy key.
const BUSY_PAUSE_MAX: Duration = Duration::from_millis(20);

/// Which two-phase write the batch write path runs: the master calls differ, the
/// data path is the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum WriteKind {
    /// An object that must not exist yet.
    Put,
    /// An object that may exist: replaced atomically.
    Upsert,
}

impl WriteKind {
    /// Phase one for every item.
    pub(super) fn start(
        self,
        master: &dyn MasterApi,
        client: ClientId,
        items: &[(&str, u64)],
        cfg: &ReplicateConfig,
    ) -> Vec<Result<Vec<MemoryReplica>>> {
        match self {
            WriteKind::Put => master.batch_put_start(client, items, cfg),
            WriteKind::Upsert => master.batch_upsert_start(client, items, cfg),
        }
    }

    /// Phase two for the items written.
    pub(super) fn end(self, master: &dyn MasterApi, client: ClientId, items: &[(&str, u32)]) -> Vec<Result<()>> {
        match self {
            WriteKind::Put => master.batch_put_end(client, items),
            WriteKind::Upsert => master.batch_upsert_end(client, items),
        }
    }

    /// Abandons the items whose writes failed.
    pub(super) fn revoke(self, master: &dyn MasterApi, client: ClientId, keys: &[&str]) -> Vec<Result<()>> {
        match self {
            WriteKind::Put => master.batch_put_revoke(client, keys),
            WriteKind::Upsert => master.batch_upsert_revoke(client, keys),
        }
    }
}

impl Store {
    /// Stores `value` under `key` with the builder's default replication, replacing
    /// the object stored there if any. See [`batch_upsert_parts`](Self::batch_upsert_parts).
    pub fn upsert(&self, key: &str, value: &[u8]) -> Result<()> {
        self.upsert_with(key, value, &self.inner.replicate)
    }

    /// [`upsert`](Self::upsert) with `cfg`'s replication.
    pub fn upsert_with(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> Result<()> {
        self.batch_upsert_parts(&[(key, &[value])], cfg).pop().unwrap_or(Ok(()))
    }

    /// Upserts many objects, with one master round trip per phase and one transfer
    /// batch. One result per item, in order.
    pub fn batch_upsert(&self, items: &[(&str, &[u8])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        let one: Vec<[&[u8]; 1]> = items.iter().map(|(_, v)| [*v]).collect();
        let items: Vec<(&str, &[&[u8]])> = items.iter().zip(&one).map(|((k, _), v)| (*k, &v[..])).collect();
        self.batch_upsert_parts(&items, cfg)
    }

    /// Upserts one object made of `parts`, concatenated, with the builder's default
    /// replication.
    pub fn upsert_parts(&self, key: &str, parts: &[&[u8]]) -> Result<()> {
        self.batch_upsert_parts(&[(key, parts)], &self.inner.replicate).pop().unwrap_or(Ok(()))
    }

    /// Stores each object (made of its parts, concatenated), replacing the object
    /// stored under its key if any. The replacement is atomic: a reader of the key
    /// gets the old bytes or the new ones, never a mix, and never `NotFound` while
    /// the key exists throughout. An upsert of a key that another put or upsert is
    /// writing waits for it (up to 5 s, then `AlreadyExists`), so concurrent upserts
    /// of a key take effect one after the other. A failed write to a segment is
    /// placed again elsewhere, as a put's is. One result per item, in order.
    pub fn batch_upsert_parts(&self, items: &[(&str, &[&[u8]])], cfg: &ReplicateConfig) -> Vec<Result<()>> {
        let inner = &self.inner;
        let mut results: Vec<Result<()>> = vec![Ok(()); items.len()];
        let mut pending: Vec<usize> = (0..items.len()).collect();
        let busy_until = Instant::now() + BUSY_WAIT;
        let mut pause = BUSY_PAUSE;
        let mut attempt = 1;
        while !pending.is_empty() {
            let round: Vec<(&str, &[&[u8]])> = pending.iter().map(|&i| items[i]).collect();
            let answers = inner.write_parts(&round, cfg, WriteKind::Upsert);
            let mut again = Vec::new();
            let mut failed_write = false;
            for (&i, res) in pending.iter().zip(answers) {
                let retry = match &res {
                    // Another write of the key holds it: wait for it to end.
                    Err(Error::AlreadyExists(_)) => Instant::now() < busy_until,
                    // A segment could not be written (the master was told and
                    // places elsewhere), or the object's segments left meanwhile.
                    Err(Error::Transport(_)) | Err(Error::NotFound(_)) => {
                        failed_write = true;
                        attempt < ATTEMPTS
                    }
                    _ => false,
                };
                if retry {
                    again.push(i);
                } else {
                    results[i] = res;
                }
            }
            if failed_write {
                attempt += 1;
            }
            if !again.is_empty() && !failed_write {
                std::thread::sleep(pause);
                pause = (pause * 2).min(BUSY_PAUSE_MAX);
            }
            pending = again;
        }
        // This client's cached lists of the old objects are stale now.
        for (key, _) in items {
            inner.cache.forget(key);
        }
        inner.count_puts(items, &results);
        results
    }
}
