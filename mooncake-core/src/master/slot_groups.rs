//! Cluster mode, the master's side: the facet of [`MasterService`] that fences calls
//! by slot group, mounts extents per group and takes groups up and gives them up
//! (see `ownership` for the rules).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use mooncake_alloc::SegmentId;
use mooncake_transfer::RemoteRegion;

use crate::error::{Error, Result};
use crate::master::ownership::KeyOwnership;
use crate::master::service::{GroupRecovery, MasterService};
use crate::master::types::{ClientId, ObjectRecord};

impl MasterService {
    /// Makes this master a cluster member that answers only for the groups `ownership`
    /// says it leads. Only the first call has an effect.
    pub fn set_ownership(&self, ownership: Arc<dyn KeyOwnership>) {
        let grouping = ownership.clone();
        self.tombstones.set_grouping(Arc::new(move |key: &str| grouping.group_of(key)));
        let _ = self.ownership.set(ownership);
    }

    /// Whether this master answers for `key` (always, outside a cluster): what
    /// [`fence`](Self::fence) checks, without answering or counting a `Moved`.
    pub(crate) fn leads_key(&self, key: &str) -> bool {
        self.ownership.get().is_none_or(|o| o.leads(o.group_of(key)))
    }

    /// Fails with `Moved` unless this master answers for `key`.
    #[inline]
    pub(crate) fn fence(&self, key: &str) -> Result<()> {
        match self.ownership.get() {
            Some(o) if !o.leads(o.group_of(key)) => {
                self.cluster_counters.moved_answers.fetch_add(1, Ordering::Relaxed);
                Err(o.moved(key))
            }
            _ => Ok(()),
        }
    }

    /// The group whose extents `key`'s replicas go to (None: a single master).
    pub(crate) fn placement_group(&self, key: &str) -> Option<u32> {
        self.ownership.get().map(|o| o.group_of(key))
    }

    /// Whether a missing `key` may still come back with a re-mounting node: the master
    /// restarted moments ago, or took the key's group over moments ago.
    pub(crate) fn recovering_key(&self, key: &str) -> bool {
        self.recovering() || self.in_group_window(key, |_| true)
    }

    /// Whether a put of `key`, which the master does not hold, must wait: the key may
    /// still come back with a re-mounting node. Only once a node came back with
    /// objects (after a restart, or into a group taken over): a fresh master, a
    /// fresh cluster's groups or a group whose nodes brought nothing back puts at
    /// once. (Until the first node with objects is back, a put may still take a key
    /// a later one brings back: the window opens with that node.)
    pub(crate) fn recovering_put(&self, key: &str) -> bool {
        self.recovering() || self.in_group_window(key, |r| r.objects_back)
    }

    /// Whether `key`'s group (cluster mode) is in its window after a takeover, and
    /// that window is one `counts`.
    fn in_group_window(&self, key: &str, counts: impl Fn(&GroupRecovery) -> bool) -> bool {
        let Some(group) = self.placement_group(key) else { return false };
        let now = self.now_ms();
        // Every put asks (`claim_key`): the usual answer, no group recovering, without
        // the lock every RPC thread would share.
        if now >= self.group_recovering_latest_ms.load(Ordering::Relaxed) {
            return false;
        }
        self.group_recovering.lock().get(&group).is_some_and(|r| now < r.until_ms && counts(r))
    }

    /// An extent of `group` came back with objects: puts of its missing keys wait
    /// for the rest of its window ([`recovering_put`](Self::recovering_put)).
    pub(crate) fn note_group_objects_back(&self, group: u32) {
        if let Some(r) = self.group_recovering.lock().get_mut(&group) {
            r.objects_back = true;
        }
    }

    /// What a call on `key` answers when the master holds no object under it:
    /// `Recovering` while the key may still come back with a re-mounting node (the
    /// caller retries), else `NotFound`. A remove or an existence check answered
    /// `NotFound` then would be contradicted a moment later.
    pub(crate) fn absent(&self, key: &str) -> Error {
        if self.recovering_key(key) {
            Error::Recovering(format!("{key} not found yet: clients are re-mounting their segments"))
        } else {
            Error::NotFound(key.to_owned())
        }
    }

    /// Whether any key may still come back with a re-mounting node.
    pub(crate) fn recovering_any(&self) -> bool {
        let now = self.now_ms();
        self.recovering() || self.group_recovering.lock().values().any(|r| now < r.until_ms)
    }

    /// This master now leads `group`: storage nodes will re-mount its extents with the
    /// objects they hold, within about one client TTL. Until then a missing key of the
    /// group is `Recovering`.
    pub fn acquire_group(&self, group: u32) {
        // Whatever a call that raced the last release left of the group is stale.
        self.drop_group_state(group);
        let until = self.now_ms() + self.config.client_ttl.as_millis() as u64;
        self.group_recovering.lock().insert(group, GroupRecovery { until_ms: until, objects_back: false });
        self.group_recovering_latest_ms.fetch_max(until, Ordering::Relaxed);
        self.cluster_counters.groups_acquired.fetch_add(1, Ordering::Relaxed);
        tracing::info!(group, "slot group acquired: waiting for its extents");
    }

    /// This master no longer leads `group`: drops the group's objects and extents.
    /// The nodes are not told (their records stay, for the next leader). Returns how
    /// many objects were dropped.
    pub fn release_group(&self, group: u32) -> usize {
        self.group_recovering.lock().remove(&group);
        let dropped = self.drop_group_state(group);
        self.cluster_counters.groups_released.fetch_add(1, Ordering::Relaxed);
        tracing::info!(group, dropped, "slot group released");
        dropped
    }

    /// Drops the extents and objects of `group`; returns how many objects went.
    fn drop_group_state(&self, group: u32) -> usize {
        let segments: Vec<SegmentId> = {
            let mut table = self.segments.write();
            let ids: Vec<SegmentId> =
                table.by_id.iter().filter(|(_, s)| s.group == Some(group)).map(|(&id, _)| id).collect();
            for id in &ids {
                table.remove(*id);
            }
            ids
        };
        if !segments.is_empty() {
            for rec in self.clients.write().values_mut() {
                rec.segments.retain(|s| !segments.contains(s));
            }
        }
        let Some(ownership) = self.ownership.get() else { return 0 };
        let mut dropped = 0;
        for shard in self.index.shards() {
            shard.lock().retain(|k, e| {
                if ownership.group_of(k) != group {
                    return true;
                }
                dropped += 1;
                if !e.complete() {
                    self.counters.pending_puts.fetch_sub(1, Ordering::Relaxed);
                }
                if e.disk() != 0 {
                    // The file stays on the SSD (the next leader registers it again);
                    // only this master's accounting of it goes.
                    self.add_ssd_used(e.disk(), -(e.len() as i64));
                }
                false
            });
        }
        dropped
    }

    /// Cluster mode: mounts one extent of a storage node's memory for `group`, with
    /// the objects it holds (`records`, as in
    /// [`remount_segment`](Self::remount_segment); records of keys of other groups are
    /// skipped). Fails with `Moved` unless this master leads `group`. Returns the
    /// extent's segment id and how many records were taken.
    pub fn mount_extent(
        &self,
        client: ClientId,
        region: &RemoteRegion,
        capacity: u64,
        group: u32,
        records: &[ObjectRecord],
    ) -> Result<(SegmentId, usize)> {
        let Some(ownership) = self.ownership.get() else {
            return Err(Error::InvalidArgument("mount_extent: this master is not in a cluster".into()));
        };
        if !ownership.leads(group) {
            return Err(ownership.group_moved(group));
        }
        let own: Vec<ObjectRecord> = records.iter().filter(|r| ownership.group_of(&r.key) == group).cloned().collect();
        let (id, taken) = self.mount_records_into(client, region, capacity, Some(group), &own)?;
        // The group may have moved on while we mounted: then it must not keep the extent.
        if !ownership.leads(group) {
            self.release_group(group);
            return Err(ownership.group_moved(group));
        }
        Ok((id, taken))
    }
}
