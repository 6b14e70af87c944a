//! Plugging a user-written `DiskEvictionStrategy` into a store's SSD tier.
//!
//! `LargestFirst` evicts the unit that takes the most disk space first: under
//! pressure, one big object goes instead of several small ones — even the newest,
//! where FIFO would evict the oldest small objects. Each put is offloaded
//! to a 4 MiB SSD tier (`PersistPolicy::Eager`); once it is full, the strategy prints
//! what it evicts, and the master is told (the evicted objects lose their disk
//! replicas and keep their memory ones).
//!
//! Run: `cargo run --example custom_disk_eviction`

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mooncake_core::storage::{DiskEvictionStrategy, UnitId, UnitInfo};
use mooncake_core::{Error, Master, MasterConfig, PersistPolicy, SsdBackend, SsdOffloadConfig, Store};

/// Evicts the largest unit first (ties: the oldest).
#[derive(Default)]
struct LargestFirst {
    /// Tracked units: their size on disk, what they hold, and when they were added.
    units: HashMap<UnitId, (u64, String, u64)>,
    added: u64,
}

impl DiskEvictionStrategy for LargestFirst {
    fn add(&mut self, unit: UnitId, info: UnitInfo<'_>) {
        self.added += 1;
        let added = self.added;
        self.units.entry(unit).or_insert_with(|| (info.bytes, info.keys.join(", "), added));
    }

    fn remove(&mut self, unit: UnitId) {
        self.units.remove(&unit);
    }

    fn record_access(&mut self, _unit: UnitId) {}

    fn select_victim(&mut self) -> Option<UnitId> {
        let (&unit, _) = self.units.iter().max_by_key(|(_, (bytes, _, added))| (*bytes, u64::MAX - added))?;
        let (bytes, keys, _) = self.units.remove(&unit)?;
        println!("  largest_first evicts {keys} ({} KiB on disk)", bytes >> 10);
        Some(unit)
    }

    fn len(&self) -> usize {
        self.units.len()
    }

    fn name(&self) -> &'static str {
        "largest_first"
    }
}

fn wait_until(mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(10), "the offload did not happen");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn main() -> Result<(), Error> {
    let dir = std::env::temp_dir().join(format!("mooncake-example-disk-eviction-{}", std::process::id()));
    let master = Master::new(MasterConfig { persist: PersistPolicy::Eager, ..Default::default() })?;
    let store = Store::builder()
        .master(&master)
        .global_segment_size(64 << 20)
        .ssd_offload(
            // One file per object, so that every object is a unit of its own.
            SsdOffloadConfig::new(&dir, 4 << 20).backend(SsdBackend::FilePerKey).eviction(LargestFirst::default),
        )
        .build()?;

    let objects: [(&str, usize); 8] = [
        ("small-0", 256 << 10),
        ("big-0", 1536 << 10),
        ("small-1", 256 << 10),
        ("medium-0", 768 << 10),
        ("small-2", 256 << 10),
        ("medium-1", 768 << 10),
        ("big-1", 1024 << 10),
        ("big-2", 1280 << 10),
    ];
    for (i, (key, len)) in objects.iter().enumerate() {
        println!("put {key} ({} KiB)", len >> 10);
        store.put(key, &vec![i as u8; *len])?;
        // One at a time, so that each offload sees the disk the previous ones left.
        wait_until(|| store.ssd_stats().is_some_and(|s| s.offloaded_objects == i as u64 + 1));
    }

    let ssd = store.ssd_stats().expect("the store has an SSD tier");
    println!(
        "\nthe disk holds {} objects ({} KiB of {} KiB); objects evicted: {}",
        ssd.backend.objects,
        ssd.backend.used_bytes >> 10,
        ssd.backend.capacity.unwrap_or(0) >> 10,
        ssd.backend.evicted_objects
    );
    for (key, _) in &objects {
        let list = master.get_replica_list(key)?;
        let where_ = if list.disk.is_some() { "memory and disk" } else { "memory only (evicted from disk)" };
        println!("  {key:9} {where_}");
    }
    drop(store);
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
