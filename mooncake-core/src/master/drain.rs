//! Draining a storage node: it leaves on purpose without losing what only it holds.
//!
//! `drain_segment` marks every segment of the node draining (placement skips them at
//! once: puts, upserts, replicate targets, cluster extents; reads go on) and tells the
//! node with a `RecordUpdate::Drain` on its record link (or its next heartbeat). The
//! node moves its objects away itself, with the calls any client has (`replicate`,
//! `batch_drop_replicas`, the SSD tier's offloads: `store/drain.rs`), and reports its
//! progress with `drain_report`; `drain_status` answers what the node last reported.

use serde::{Deserialize, Serialize};

use mooncake_alloc::SegmentId;

use crate::error::{Error, Result};
use crate::master::record_link::RecordWait;
use crate::master::service::MasterService;
use crate::master::types::{ClientId, RecordUpdate};

/// Most drains remembered (finished ones are forgotten first).
const MAX_DRAINS: usize = 1024;

/// Where a node's drain stands: what its node last reported, plus how many of its
/// segments the master answering has marked draining. Also the summary
/// [`Store::drain`](crate::Store::drain) returns.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainProgress {
    /// The node: the transfer endpoint its segments are named after (`host:port`).
    pub node: String,
    /// Segments (extents, in a cluster) of the node marked draining, at the masters
    /// that answered (0 in an answer: no such node is mounted there); in the summary
    /// of [`Store::drain`](crate::Store::drain), the node's own segments.
    pub segments: u64,
    /// The node started moving its objects (it reported at least once).
    pub started: bool,
    /// The node finished: nothing is left to move (or the grace period ran out).
    pub done: bool,
    /// Objects (and their bytes) the segment held when the drain began.
    pub objects_total: u64,
    /// Bytes of `objects_total`.
    pub bytes_total: u64,
    /// Objects copied to another segment, then dropped here.
    pub objects_copied: u64,
    /// Bytes of `objects_copied`.
    pub bytes_copied: u64,
    /// Objects that had another complete replica: only the one here was dropped.
    pub objects_dropped: u64,
    /// Bytes of `objects_dropped`.
    pub bytes_dropped: u64,
    /// Objects kept on the node's SSD tier (disk replicas) for lack of room in the
    /// pool; their memory here was dropped.
    pub objects_on_disk: u64,
    /// Bytes of `objects_on_disk`.
    pub bytes_on_disk: u64,
    /// Objects that could go nowhere before the grace period ended: they leave with
    /// the node.
    pub objects_lost: u64,
    /// Bytes of `objects_lost`.
    pub bytes_lost: u64,
    /// Objects still to move.
    pub objects_left: u64,
    /// Bytes of `objects_left`.
    pub bytes_left: u64,
    /// Milliseconds since the node began.
    pub elapsed_ms: u64,
}

impl DrainProgress {
    /// Objects no longer only here: copied, dropped (replicated elsewhere) or on disk.
    pub fn objects_moved(&self) -> u64 {
        self.objects_copied + self.objects_dropped + self.objects_on_disk
    }

    /// Bytes of [`objects_moved`](Self::objects_moved).
    pub fn bytes_moved(&self) -> u64 {
        self.bytes_copied + self.bytes_dropped + self.bytes_on_disk
    }

    /// Folds the answer of another master of a cluster into this one: segments add
    /// up; the node reports the same progress to every master, so the most advanced
    /// report wins.
    pub fn merge(&mut self, other: &DrainProgress) {
        if self.node.is_empty() {
            self.node = other.node.clone();
        }
        self.segments += other.segments;
        let done = match (self.started, other.started) {
            (true, true) => self.done && other.done,
            (true, false) => self.done,
            (false, true) => other.done,
            (false, false) => false,
        };
        let was_started = self.started;
        self.started |= other.started;
        macro_rules! max {
            ($($f:ident),*) => { $( self.$f = self.$f.max(other.$f); )* };
        }
        max!(
            objects_total,
            bytes_total,
            objects_copied,
            bytes_copied,
            objects_dropped,
            bytes_dropped,
            objects_on_disk,
            bytes_on_disk,
            objects_lost,
            bytes_lost,
            elapsed_ms
        );
        // A report of a drain not started says nothing of what is left; otherwise the
        // larger count (a finished drain whose grace ran out may have objects left).
        (self.objects_left, self.bytes_left) = match (was_started, other.started) {
            (false, _) => (other.objects_left, other.bytes_left),
            (true, false) => (self.objects_left, self.bytes_left),
            (true, true) => (self.objects_left.max(other.objects_left), self.bytes_left.max(other.bytes_left)),
        };
        self.done = done;
    }
}

/// The node a segment name names: `endpoint#n` names one segment of the node at
/// `endpoint` (in a cluster, one extent); a bare endpoint names the node.
fn node_of(segment: &str) -> &str {
    match segment.rsplit_once('#') {
        Some((node, n)) if n.parse::<u64>().is_ok() => node,
        _ => segment,
    }
}

impl MasterService {
    /// Marks every segment of the node that `segment` names (`endpoint#n`, or the
    /// endpoint) draining: no new replica goes there from now on, reads go on. The
    /// node is told to move its objects away within `grace_ms` (it is told once, when
    /// its segments start draining). Returns where its drain stands; `segments` is 0
    /// when this master has no segment of that node.
    pub fn drain_segment(&self, segment: &str, grace_ms: u64) -> Result<DrainProgress> {
        let node = node_of(segment);
        if node.is_empty() {
            return Err(Error::InvalidArgument("drain: empty segment name".into()));
        }
        let (count, mut newly, owners) = {
            let mut table = self.segments.write();
            let ids: Vec<(SegmentId, ClientId)> = table
                .by_id
                .values()
                .filter(|s| s.region.endpoint == node || s.alloc.name() == segment)
                .map(|s| (s.alloc.id(), s.owner))
                .collect();
            let mut newly: Vec<ClientId> = Vec::new();
            let mut owners: Vec<ClientId> = Vec::new();
            for (id, owner) in &ids {
                if table.set_draining(*id) && !newly.contains(owner) {
                    newly.push(*owner);
                }
                if !owners.contains(owner) {
                    owners.push(*owner);
                }
            }
            (ids.len() as u64, newly, owners)
        };
        if count == 0 {
            return Ok(DrainProgress { node: node.to_owned(), ..Default::default() });
        }
        let mut progress = {
            let mut drains = self.drains.lock();
            // A drain asked for again after the last one ended (its grace ran out, with
            // objects left) runs again, with the new grace: the node is told again.
            if drains.get(node).is_some_and(|p| p.started && p.done) {
                newly = owners;
            }
            if !newly.is_empty() || !drains.contains_key(node) {
                if drains.len() >= MAX_DRAINS {
                    let finished: Option<String> = drains.iter().find(|(_, p)| p.done).map(|(k, _)| k.clone());
                    let victim = finished.or_else(|| drains.keys().next().cloned());
                    if let Some(v) = victim {
                        drains.remove(&v);
                    }
                }
                drains.insert(node.to_owned(), DrainProgress { node: node.to_owned(), ..Default::default() });
            }
            drains.get(node).cloned().unwrap_or_default()
        };
        progress.segments = count;
        // Not waited for: a paused node must not hold the caller; the update goes with
        // the next frame to the node, at the latest when it heartbeats.
        let mut wait = RecordWait::default();
        for owner in newly {
            tracing::info!(node, client = format!("{owner:#x}"), grace_ms, "draining: no new replica goes there");
            self.push_to_client(owner, |generation| RecordUpdate::Drain { grace_ms, generation }, &mut wait);
        }
        Ok(progress)
    }

    /// A draining node reports its progress (see [`DrainProgress`]).
    pub fn drain_report(&self, client: ClientId, progress: &DrainProgress) -> Result<()> {
        if !self.clients.read().contains_key(&client) {
            return Err(Error::UnknownClient(client));
        }
        if progress.node.is_empty() || progress.node.len() > crate::config::MAX_KEY_LEN {
            return Err(Error::InvalidArgument("drain report without a node".into()));
        }
        let mut drains = self.drains.lock();
        if drains.len() >= MAX_DRAINS && !drains.contains_key(&progress.node) {
            let finished: Option<String> = drains.iter().find(|(_, p)| p.done).map(|(k, _)| k.clone());
            match finished {
                Some(v) => drains.remove(&v),
                None => return Err(Error::InvalidArgument("too many drains at once".into())),
            };
        }
        let mut p = progress.clone();
        p.segments = 0;
        drains.insert(p.node.clone(), p);
        Ok(())
    }

    /// Where the drain of the node that `segment` names stands (what it last
    /// reported); `segments` counts its segments this master has marked draining.
    pub fn drain_status(&self, segment: &str) -> Result<DrainProgress> {
        let node = node_of(segment);
        let count =
            self.segments.read().by_id.values().filter(|s| s.draining && s.region.endpoint == node).count() as u64;
        let mut p = self
            .drains
            .lock()
            .get(node)
            .cloned()
            .unwrap_or_else(|| DrainProgress { node: node.to_owned(), ..Default::default() });
        p.segments = count;
        Ok(p)
    }

    /// Every drain this master remembers (for its metrics).
    pub fn drains(&self) -> Vec<DrainProgress> {
        let mut all: Vec<DrainProgress> = self.drains.lock().values().cloned().collect();
        all.sort_by(|a, b| a.node.cmp(&b.node));
        all
    }

    /// Whether one of `segments` is draining.
    pub(crate) fn any_draining(&self, segments: &[SegmentId]) -> bool {
        let table = self.segments.read();
        segments.iter().any(|id| table.by_id.get(id).is_some_and(|s| s.draining))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_segment_name_names_its_node() {
        assert_eq!(node_of("127.0.0.1:5000#3"), "127.0.0.1:5000");
        assert_eq!(node_of("127.0.0.1:5000"), "127.0.0.1:5000");
        assert_eq!(node_of("host#x"), "host#x");
    }

    #[test]
    fn answers_of_several_masters_fold_into_the_most_advanced() {
        let mut a = DrainProgress { node: "n".into(), segments: 2, ..Default::default() };
        let b = DrainProgress {
            node: "n".into(),
            segments: 3,
            started: true,
            done: true,
            objects_total: 10,
            objects_copied: 10,
            ..Default::default()
        };
        a.merge(&b);
        assert_eq!((a.segments, a.started, a.done, a.objects_copied), (5, true, true, 10));
        let mut c = DrainProgress { started: true, objects_left: 4, ..Default::default() };
        c.merge(&b);
        assert!(!c.done, "one master saw the node still at work");
        assert_eq!(c.objects_left, 4);
    }

    #[test]
    fn a_finished_drain_with_objects_left_folds_with_them() {
        let ended = DrainProgress { started: true, done: true, objects_left: 5, bytes_left: 50, ..Default::default() };
        let mut acc = DrainProgress::default();
        acc.merge(&ended);
        assert_eq!((acc.done, acc.objects_left, acc.bytes_left), (true, 5, 50), "its grace ran out: 5 left");
        acc.merge(&ended);
        assert_eq!(acc.objects_left, 5);
    }
}
