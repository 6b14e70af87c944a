//! Giving read leases back to the master once the reads they protect are over.

use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{unbounded, Sender};

use crate::error::{Error, Result};
use crate::master::MasterApi;

/// Most keys one release call carries.
const BATCH: usize = 1024;

/// How long the release thread gathers keys after the first before it calls the
/// master. A release per get woke this thread and sent a master call beside the
/// client's next get: on a 2-core VM a same-host `get` of 1 MiB took 110 µs at
/// p50, its replica list 40 µs of it; gathering for a millisecond, 55-59 µs and 9-14
/// µs (a TCP `get` of 4 KiB: 40 -> 21-24 µs at p50). A lease then ends up to this
/// much later, which only a `remove` of the key by another client in that moment
/// would notice (refused, as during the read itself).
const GATHER: Duration = Duration::from_millis(1);

/// How a client ends its read leases.
pub(super) enum LeaseReleaser {
    /// In the master's process: a release is a function call, made at once (a
    /// `remove` right after a `get` then finds no lease).
    Direct(Arc<dyn MasterApi>),
    /// Over the network: releases are queued and sent in batches by a thread of
    /// their own, so that a get stays one master round trip. A release that is late
    /// or lost only keeps the object until its lease's time runs out.
    Batched {
        /// Keys whose lease to end; `None` once dropped.
        queue: Option<Sender<Box<str>>>,
        /// The sending thread, joined on drop so that a process that exits right
        /// after its last get still gives its leases back.
        sender: Option<std::thread::JoinHandle<()>>,
    },
}

impl Drop for LeaseReleaser {
    fn drop(&mut self) {
        if let LeaseReleaser::Batched { queue, sender } = self {
            drop(queue.take());
            if let Some(t) = sender.take() {
                let _ = t.join();
            }
        }
    }
}

impl LeaseReleaser {
    /// A releaser for `master`; `remote` masters get the batching thread, which ends
    /// when the releaser is dropped, after sending what it holds (each call bounded
    /// by the master timeout).
    pub(super) fn new(master: Arc<dyn MasterApi>, remote: bool) -> Result<Self> {
        if !remote {
            return Ok(LeaseReleaser::Direct(master));
        }
        let (tx, rx) = unbounded::<Box<str>>();
        let sender = std::thread::Builder::new()
            .name("mooncake-lease-release".into())
            .spawn(move || {
                while let Ok(first) = rx.recv() {
                    // The releases of the gets of the next moment, gathered into one call.
                    std::thread::sleep(GATHER);
                    let mut keys = vec![first];
                    keys.extend(rx.try_iter().take(BATCH - 1));
                    let refs: Vec<&str> = keys.iter().map(|k| &**k).collect();
                    if let Err(e) = master.release_leases(&refs) {
                        tracing::debug!(error = %e, keys = refs.len(), "lease release failed; the leases expire");
                    }
                }
            })
            .map_err(|e| Error::InvalidArgument(format!("cannot start the lease release thread: {e}")))?;
        Ok(LeaseReleaser::Batched { queue: Some(tx), sender: Some(sender) })
    }

    /// Ends one lease of each key.
    pub(super) fn release<'k>(&self, keys: impl IntoIterator<Item = &'k str>) {
        match self {
            LeaseReleaser::Direct(master) => {
                let keys: Vec<&str> = keys.into_iter().collect();
                if !keys.is_empty() {
                    let _ = master.release_leases(&keys);
                }
            }
            LeaseReleaser::Batched { queue: Some(tx), .. } => {
                for k in keys {
                    let _ = tx.send(k.into());
                }
            }
            LeaseReleaser::Batched { queue: None, .. } => {}
        }
    }
}
