//! What a member or watcher makes of the values it reads back from etcd, exposed to
//! the fuzz targets in `fuzz/` (the `fuzzing` feature). Not a stable API.

use super::layout::Layout;
use super::slots::{validate_groups, SlotMap};
use super::view::{Change, ClusterView};
use crate::error::Result;

/// One change a watch reports: a key, its new value (`None`: deleted), its create
/// revision and its lease.
pub type WatchedChange<'a> = (&'a [u8], Option<&'a [u8]>, i64, i64);

/// Applies `changes` (the first at revision 1, and so on) to an empty view of cluster
/// `name` of `groups` slot groups, as a member's mirror does (keys outside the
/// cluster, and values that do not parse, are left out); returns the slot map and the
/// live members `(id, address)` that view describes.
pub fn mirror_changes(
    name: &str,
    groups: u32,
    changes: &[WatchedChange<'_>],
) -> Result<(SlotMap, Vec<(String, String)>)> {
    validate_groups(groups)?;
    let layout = Layout::new(name);
    let mut view = ClusterView::new(groups, 0);
    for (i, &(key, value, create_revision, lease)) in changes.iter().enumerate() {
        let Some(key) = layout.parse(key) else { continue };
        let change = match value {
            Some(value) => Change::Put { value, create_revision, lease },
            None => Change::Delete,
        };
        view.apply(&key, change, i as i64 + 1);
    }
    Ok((view.slot_map(), view.member_list()))
}

/// The slot group count the value of cluster `name`'s `config` key sets, as a member
/// reads it.
pub fn config_groups(name: &str, value: &[u8]) -> Result<u32> {
    Layout::new(name).config_groups(value)
}
