//! The regions an engine serves, as one table that the engine fills and the
//! transports serve from (neither needs the other), and the directory of this
//! process's engines that the `Local` transport reaches them through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Weak};

use parking_lot::RwLock;

use crate::error::{Result, TransferError};
use crate::region::{RegionId, RegisteredRegion};

/// The registered regions of one engine, by id, and the endpoint peers name them by.
#[derive(Debug)]
pub(crate) struct RegionRegistry {
    endpoint: String,
    regions: RwLock<HashMap<RegionId, Arc<RegisteredRegion>>>,
    next_region: AtomicU64,
    /// Regions are memfds that same-host peers may map.
    shared: bool,
    /// Told the id of every region the engine stops serving (the RDMA side
    /// deregisters its memory regions).
    on_unregister: RwLock<Vec<UnregisterHook>>,
}

/// A callback told the id of a region the engine stops serving.
struct UnregisterHook(Box<dyn Fn(RegionId) + Send + Sync>);

impl std::fmt::Debug for UnregisterHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UnregisterHook")
    }
}

impl RegionRegistry {
    /// An empty table for the engine at `endpoint`; `shared` backs its regions with
    /// memfds that same-host peers may map.
    pub(crate) fn new(endpoint: String, shared: bool) -> Self {
        Self {
            endpoint,
            regions: RwLock::new(HashMap::new()),
            // Ids start at a random base, so that a restarted process serving the
            // same endpoint never answers to a peer's stale region id (a peer's
            // cached shared-memory mapping or TCP request then fails cleanly
            // instead of reaching the wrong memory).
            next_region: AtomicU64::new(((rand::random::<u32>() as u64) << 24) | 1),
            shared,
            on_unregister: RwLock::new(Vec::new()),
        }
    }

    /// Calls `hook` with the id of every region unregistered from now on.
    pub(crate) fn on_unregister(&self, hook: Box<dyn Fn(RegionId) + Send + Sync>) {
        self.on_unregister.write().push(UnregisterHook(hook));
    }

    fn unregistered(&self, id: RegionId) {
        for hook in self.on_unregister.read().iter() {
            (hook.0)(id);
        }
    }

    /// The endpoint of the engine that owns the table.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Number of regions registered now.
    pub(crate) fn len(&self) -> usize {
        self.regions.read().len()
    }

    /// The registered region `id`, or an error naming it.
    pub(crate) fn region(&self, id: RegionId) -> Result<Arc<RegisteredRegion>> {
        self.regions
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| TransferError::UnknownRegion { endpoint: self.endpoint.clone(), region: id })
    }

    /// Registers `len` bytes of fresh zeroed memory under a new id; `peers_write`:
    /// whether peers may write it (see [`RegisteredRegion::peers_may_write`]).
    pub(crate) fn register(&self, len: u64, peers_write: bool) -> Result<Arc<RegisteredRegion>> {
        let id = self.next_region.fetch_add(1, Ordering::Relaxed);
        let region = Arc::new(if self.shared {
            RegisteredRegion::new_shared(id, len, peers_write)?
        } else {
            RegisteredRegion::new(id, len, peers_write)?
        });
        self.regions.write().insert(id, region.clone());
        Ok(region)
    }

    /// Forgets region `id` and revokes its sharing; whether it was registered.
    pub(crate) fn unregister(&self, id: RegionId) -> bool {
        let removed = self.regions.write().remove(&id);
        if let Some(region) = &removed {
            region.revoke_sharing();
            self.unregistered(id);
        }
        removed.is_some()
    }

    /// Forgets every region and revokes their sharing (the engine stops serving).
    pub(crate) fn clear(&self) {
        let drained: Vec<_> = self.regions.write().drain().collect();
        for (id, region) in drained {
            region.revoke_sharing();
            self.unregistered(id);
        }
    }
}

impl Drop for RegionRegistry {
    fn drop(&mut self) {
        withdraw(&self.endpoint);
        // Regions may outlive the engine (callers hold `Arc`s): same-host peers must
        // stop using their mappings all the same.
        for region in self.regions.get_mut().values() {
            region.revoke_sharing();
        }
    }
}

/// Every live engine of this process, by endpoint. Engines add themselves when built
/// and remove themselves when dropped; a `Weak` keeps a dropped engine unreachable.
static IN_PROCESS: LazyLock<RwLock<HashMap<String, Weak<RegionRegistry>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// Makes `registry` reachable by in-process peers under its endpoint.
pub(crate) fn publish(registry: &Arc<RegionRegistry>) {
    IN_PROCESS.write().insert(registry.endpoint.clone(), Arc::downgrade(registry));
}

/// Makes the engine at `endpoint` unreachable by in-process peers.
pub(crate) fn withdraw(endpoint: &str) {
    IN_PROCESS.write().remove(endpoint);
}

/// The region table of the in-process engine at `endpoint`.
pub(crate) fn lookup(endpoint: &str) -> Result<Arc<RegionRegistry>> {
    IN_PROCESS
        .read()
        .get(endpoint)
        .and_then(Weak::upgrade)
        .ok_or_else(|| TransferError::UnknownEndpoint(endpoint.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_register_unregister_and_revoke() {
        let table = RegionRegistry::new("local://registry-test/1".into(), false);
        let a = table.register(4096, true).unwrap();
        let b = table.register(4096, true).unwrap();
        assert_ne!(a.id(), b.id());
        assert_eq!(table.len(), 2);
        assert_eq!(table.region(a.id()).unwrap().id(), a.id());
        assert!(table.unregister(a.id()));
        assert!(!table.unregister(a.id()), "already gone");
        assert_eq!(
            table.region(a.id()).unwrap_err(),
            TransferError::UnknownRegion { endpoint: "local://registry-test/1".into(), region: a.id() }
        );
        table.clear();
        assert_eq!(table.len(), 0);
    }

    #[test]
    fn in_process_directory_follows_the_registry_lifetime() {
        let endpoint = "local://registry-test/2";
        let table = Arc::new(RegionRegistry::new(endpoint.into(), false));
        publish(&table);
        assert!(Arc::ptr_eq(&lookup(endpoint).unwrap(), &table));
        withdraw(endpoint);
        assert!(matches!(lookup(endpoint), Err(TransferError::UnknownEndpoint(_))));
        publish(&table);
        drop(table); // dropping the table withdraws it too
        assert!(matches!(lookup(endpoint), Err(TransferError::UnknownEndpoint(_))));
    }
}
