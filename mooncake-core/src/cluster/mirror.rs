//! Keeping a [`ClusterView`] current: load the cluster's keys at one revision, then
//! watch every change after it. Used by members and by slot-map watchers.

use etcd_client::{Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions, WatchStream};

use super::client::Etcd;
use super::layout::{ConfigValue, Layout};
use super::view::{Change, ClusterView};
use crate::error::{Error, Result};

/// Reads the cluster's slot group count, creating the cluster with `groups` if it does
/// not exist yet (one transaction, so concurrent first members agree). A member's
/// first contact with etcd: tried again while etcd does not answer, for a while
/// ([`Etcd::call_patiently`]).
pub(crate) async fn ensure_config(etcd: &Etcd, layout: &Layout, groups: u32) -> Result<u32> {
    let key = layout.config();
    let value = serde_json::to_vec(&ConfigValue { groups }).expect("serializable");
    let txn = Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
        key.clone(),
        value,
        None::<PutOptions>,
    )]);
    let kv = etcd.client.kv_client();
    let patience = etcd.first_contact_patience();
    let created = etcd
        .call_patiently("create the cluster config", patience, || {
            let (mut kv, txn) = (kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await?
        .succeeded();
    if created {
        return Ok(groups);
    }
    read_config(etcd, layout).await?.ok_or_else(|| etcd.error("read the cluster config", "deleted while read"))
}

/// The cluster's slot group count, or `None` if no member created the cluster yet.
/// A first contact too (a watcher's): tried again while etcd does not answer.
pub(crate) async fn read_config(etcd: &Etcd, layout: &Layout) -> Result<Option<u32>> {
    let (kv, key) = (etcd.client.kv_client(), layout.config());
    let resp = etcd
        .call_patiently("read the cluster config", etcd.first_contact_patience(), || {
            let (mut kv, key) = (kv.clone(), key.clone());
            async move { kv.get(key, None).await }
        })
        .await?;
    let Some(kv) = resp.kvs().first() else { return Ok(None) };
    layout.config_groups(kv.value()).map(Some)
}

/// A view kept current by a watch.
pub(crate) struct Mirror {
    layout: Layout,
    /// The view, as of the last change applied.
    pub view: ClusterView,
    watch: Option<WatchStream>,
}

impl Mirror {
    /// A mirror of a cluster of `groups` groups that has loaded nothing yet (call
    /// [`Mirror::resync`]).
    pub(crate) fn new(layout: Layout, groups: u32) -> Mirror {
        Mirror { layout, view: ClusterView::new(groups, 0), watch: None }
    }

    /// Whether a watch is open (if not, [`Mirror::resync`]).
    pub(crate) fn is_watching(&self) -> bool {
        self.watch.is_some()
    }

    /// Reloads every key at one revision and watches from the next. Returns whether a
    /// group's leader differs from the view before.
    pub(crate) async fn resync(&mut self, etcd: &Etcd) -> Result<bool> {
        self.watch = None;
        let mut kv = etcd.client.kv_client();
        let prefix = self.layout.prefix().to_string();
        let resp = etcd.call("load the cluster", kv.get(prefix.clone(), Some(GetOptions::new().with_prefix()))).await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut view = ClusterView::new(self.view.groups(), revision);
        for kv in resp.kvs() {
            if let Some(key) = self.layout.parse(kv.key()) {
                let change =
                    Change::Put { value: kv.value(), create_revision: kv.create_revision(), lease: kv.lease() };
                view.apply(&key, change, kv.mod_revision());
            }
        }
        view.revision = revision;
        let changed = view.leaders != self.view.leaders;
        // Keep the version while no leader changed, so waiters do not wake for nothing.
        view.leaders_revision = if changed { revision } else { self.view.leaders_revision };
        view.previous = std::mem::take(&mut self.view.previous);
        self.view = view;
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut watch = etcd.client.watch_client();
        self.watch = Some(etcd.call("watch the cluster", watch.watch(prefix, Some(options))).await?);
        Ok(changed)
    }

    /// Waits for the next batch of changes and applies it. Returns whether a group's
    /// leader changed. An error (etcd gone, the watch canceled or compacted) closes the
    /// watch: [`Mirror::resync`] next.
    pub(crate) async fn next(&mut self) -> Result<bool> {
        let Some(watch) = self.watch.as_mut() else {
            return Err(Error::Coordination("not watching".into()));
        };
        let message = match watch.message().await {
            Ok(Some(m)) => m,
            Ok(None) => {
                self.watch = None;
                return Err(Error::Coordination("etcd closed the watch".into()));
            }
            Err(e) => {
                self.watch = None;
                return Err(Error::Coordination(format!("watch failed: {e}")));
            }
        };
        if message.canceled() {
            self.watch = None;
            return Err(Error::Coordination(format!(
                "watch canceled (compacted at {}): {}",
                message.compact_revision(),
                message.cancel_reason()
            )));
        }
        let mut changed = false;
        for event in message.events() {
            let Some(kv) = event.kv() else { continue };
            let Some(key) = self.layout.parse(kv.key()) else { continue };
            let change = match event.event_type() {
                EventType::Put => {
                    Change::Put { value: kv.value(), create_revision: kv.create_revision(), lease: kv.lease() }
                }
                EventType::Delete => Change::Delete,
            };
            changed |= self.view.apply(&key, change, kv.mod_revision());
        }
        Ok(changed)
    }
}
