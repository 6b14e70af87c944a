//! `mooncake-bench cluster ...`: cluster mode measured with real processes (etcd on
//! loopback, `mooncake-master --etcd`, `mooncake-client serve --master etcd://...`):
//! metadata ops/s with 1 and 2 masters pinned to their own cores (`throughput`),
//! failover time over repeated `kill -9`s (`failover`), and the master's memory per
//! object (`memory`). `bench/cluster.sh` runs all three.

mod daemons;
mod etcd;
mod failover;
mod leaders;
mod memory;
mod throughput;
mod workload;

use std::path::PathBuf;

/// Arguments of `mooncake-bench cluster`.
#[derive(clap::Args, Debug)]
pub(crate) struct ClusterArgs {
    #[command(subcommand)]
    phase: Phase,
}

/// What is measured.
#[derive(clap::Subcommand, Debug)]
enum Phase {
    /// Metadata ops/s (batch puts, lookups, exists) with 1 and with 2 masters, each
    /// pinned to its own core, and the masters' CPU use.
    Throughput(throughput::ThroughputArgs),
    /// Time until every group has a live leader, and until a get of a moved group
    /// succeeds, after each of repeated `kill -9`s of a leading master.
    Failover(failover::FailoverArgs),
    /// One master's RSS growth per object (and its own estimate) over millions of
    /// small objects.
    Memory(memory::MemoryArgs),
}

/// Runs the phase asked for: its JSON, and the file it goes to (stdout if None).
pub(crate) fn run(a: &ClusterArgs) -> Result<(serde_json::Value, Option<PathBuf>), String> {
    match &a.phase {
        Phase::Throughput(t) => throughput::throughput(t).map(|j| (j, t.out.clone())),
        Phase::Failover(f) => failover::failover(f).map(|j| (j, f.out.clone())),
        Phase::Memory(m) => memory::memory(m).map(|j| (j, m.out.clone())),
    }
}
