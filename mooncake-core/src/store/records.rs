//! The records of a storage node's segment: which objects it holds and where, as the
//! master told it. A restarted master is repopulated from them.
//!
//! The master tells a node of each change either synchronously, on the node's record
//! endpoint (`ApplyRecords`, answered once applied: a put or remove is acknowledged
//! only after that), or with the answers to its heartbeats when the node serves no
//! endpoint or the master has no way to reach it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_alloc::SegmentId;
use parking_lot::Mutex;

use crate::error::Result;
use crate::master::{ObjectRecord, RecordSink, RecordUpdate};
use crate::rpc::wire::{Request, Response, WireError};
use crate::rpc::RpcHandler;

/// The objects of this node's segment, by offset.
#[derive(Default)]
pub(crate) struct SegmentRecords {
    /// The segment the records describe (its id changes when it is re-mounted).
    segment: AtomicU64,
    /// Master incarnation the records are in step with (0: none yet).
    incarnation: AtomicU64,
    records: Mutex<HashMap<u64, ObjectRecord>>,
}

impl SegmentRecords {
    /// Records of `segment`, in step with the master of `incarnation`.
    pub(crate) fn new(segment: SegmentId, incarnation: u64) -> Self {
        Self { segment: AtomicU64::new(segment), incarnation: AtomicU64::new(incarnation), records: Mutex::default() }
    }

    /// Applies the master's changes, in order; changes to other segments are ignored.
    pub(crate) fn apply(&self, updates: Vec<RecordUpdate>) {
        let own = self.segment.load(Ordering::Acquire);
        let mut records = self.records.lock();
        for u in updates {
            match u {
                RecordUpdate::Added { segment, record } if segment == own => {
                    records.insert(record.offset, record);
                }
                RecordUpdate::Removed { segment, key, offset }
                    if segment == own && records.get(&offset).is_some_and(|r| r.key == key) =>
                {
                    records.remove(&offset);
                }
                _ => {}
            }
        }
    }

    /// After registering again with a master of `incarnation`: the records to offer it.
    /// The same incarnation means the master kept running and forgot us (expiry, or
    /// it could not tell us of a change): what we hold is stale, and is dropped.
    /// Records for which `intact` is false (their bytes changed) are dropped too.
    pub(crate) fn rejoin(&self, incarnation: u64, intact: impl Fn(&ObjectRecord) -> bool) -> Vec<ObjectRecord> {
        let mut records = self.records.lock();
        if self.incarnation.swap(incarnation, Ordering::AcqRel) == incarnation {
            records.clear();
        }
        records.retain(|_, r| intact(r));
        records.values().cloned().collect()
    }

    /// The segment was mounted again under a new id.
    pub(crate) fn set_segment(&self, segment: SegmentId) {
        self.segment.store(segment, Ordering::Release);
    }

    /// A copy of the records.
    pub(crate) fn snapshot(&self) -> Vec<ObjectRecord> {
        self.records.lock().values().cloned().collect()
    }
}

/// The in-process form of the record endpoint (a store on a [`Master`](crate::Master)
/// of the same process).
impl RecordSink for SegmentRecords {
    fn apply_records(&self, updates: &[RecordUpdate]) -> Result<()> {
        self.apply(updates.to_vec());
        Ok(())
    }
}

impl RpcHandler for SegmentRecords {
    fn handle(&self, request: Request) -> Response {
        match request {
            Request::ApplyRecords { updates } => {
                self.apply(updates);
                Response::Unit
            }
            _ => Response::Error(WireError::InvalidArgument(
                "this is a storage node's record endpoint: it answers only record updates".into(),
            )),
        }
    }

    /// Applying updates is a few map operations under one lock, and a put waits for
    /// it: answered on the event-loop thread, without a hop to a worker and back.
    fn answers_inline(&self, kind: usize) -> bool {
        kind == Request::APPLY_RECORDS_KIND
    }
}
