//! Object records: what each storage node is told about the objects in its segments,
//! so that a restarted master can be repopulated by the nodes re-mounting.

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;

use crate::config::check_key;
use crate::error::Result;

use crate::master::object::{ObjectEntry, StoredReplica};
use crate::master::service::MasterService;
use crate::master::types::{ClientId, MemoryReplica, ObjectRecord, RecordUpdate};

impl MasterService {
    /// Queues `update` for the owner of `segment` (no-op unless tracking records).
    pub(crate) fn push_update(&self, segment: SegmentId, update: RecordUpdate) {
        let owner = match self.segments.read().by_id.get(&segment) {
            Some(s) => s.owner,
            None => return,
        };
        if let Some(rec) = self.clients.read().get(&owner) {
            rec.updates.lock().push(update);
        }
    }

    /// Tells the owners of `key`'s complete replicas (or of `only` those) that they hold it.
    pub(crate) fn note_added(&self, key: &str, e: &ObjectEntry, only: Option<&[MemoryReplica]>) {
        if !self.config.track_records {
            return;
        }
        for r in e.replicas.iter().filter(|r| r.complete) {
            let m = MemoryReplica::of(&r.buf);
            if only.is_some_and(|o| !o.contains(&m)) {
                continue;
            }
            let record = ObjectRecord { key: key.to_owned(), offset: m.offset, len: e.len, checksum: e.checksum };
            self.push_update(m.segment, RecordUpdate::Added { segment: m.segment, record });
        }
    }

    /// Tells the owners of these replicas of `key` that they no longer hold it.
    pub(crate) fn note_removed<'a>(&self, key: &str, replicas: impl IntoIterator<Item = &'a StoredReplica>) {
        if !self.config.track_records {
            return;
        }
        for r in replicas.into_iter().filter(|r| r.complete) {
            let segment = r.segment();
            self.push_update(segment, RecordUpdate::Removed { segment, key: key.to_owned(), offset: r.buf.offset() });
        }
    }

    /// Mounts a segment that already holds objects, e.g. when a node re-mounts after
    /// the master restarted. Each record's bytes are reserved at its offset; a record
    /// that overlaps another, falls outside the segment, or disagrees (length,
    /// checksum) with what the master already knows of the key is skipped.
    pub fn remount_segment(
        &self,
        client: ClientId,
        region: &RemoteRegion,
        capacity: u64,
        records: &[ObjectRecord],
    ) -> Result<(SegmentId, usize)> {
        let mut records = records.to_vec();
        let id = self.mount_segment(client, region, capacity)?;
        if !records.is_empty() {
            self.note_recovery();
        }
        let Some(alloc) = self.segments.read().by_id.get(&id).map(|s| s.alloc.clone()) else {
            return Ok((id, 0));
        };
        records.sort_by_key(|r| r.offset);
        let now = self.now_ms();
        let mut taken = 0;
        for r in records {
            if check_key(&r.key).is_err() || r.len == 0 {
                continue;
            }
            let Some(buf) = alloc.allocate_at(r.offset, r.len) else {
                tracing::warn!(key = r.key, offset = r.offset, "record does not fit the segment; skipped");
                continue;
            };
            let mut shard = self.index.shard(&r.key).lock();
            match shard.get_mut(r.key.as_str()) {
                None => {
                    shard.insert(
                        r.key.into_boxed_str(),
                        ObjectEntry {
                            len: r.len,
                            checksum: r.checksum,
                            soft_pin: false,
                            complete: true,
                            owner: client,
                            last_access_ms: now,
                            lease_until_ms: 0,
                            readers: 0,
                            replicas: vec![StoredReplica { buf, complete: true }],
                            disk: 0,
                            offload_deadline_ms: 0,
                        },
                    );
                    taken += 1;
                }
                Some(e) if e.complete && e.len == r.len && e.checksum == r.checksum => {
                    e.replicas.push(StoredReplica { buf, complete: true });
                    taken += 1;
                }
                Some(_) => tracing::warn!(key = r.key, "record conflicts with the master's view; skipped"),
            }
        }
        tracing::info!(segment = id, taken, "segment re-mounted with its objects");
        Ok((id, taken))
    }

    /// Keys of complete objects, at most `limit` (in no particular order).
    pub fn list_keys(&self, limit: usize) -> Result<Vec<String>> {
        let mut keys = Vec::new();
        for shard in self.index.shards() {
            for (k, e) in shard.lock().iter() {
                if keys.len() >= limit {
                    return Ok(keys);
                }
                if e.complete {
                    keys.push(k.to_string());
                }
            }
        }
        Ok(keys)
    }
}
