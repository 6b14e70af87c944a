//! `mooncake-client`: a storage node (`serve`) and one-shot commands.
//!
//! ```text
//! mooncake-client serve --master ADDR --listen HOST:PORT --segment-size SIZE
//!                 [--ssd-dir DIR --ssd-capacity SIZE [--ssd-backend bucket|file_per_key|offset_allocator]
//!                  [--ssd-eviction fifo|lru]]
//! mooncake-client put  --master ADDR KEY FILE [--replicas N]
//! mooncake-client get  --master ADDR KEY OUTFILE
//! mooncake-client rm|stat --master ADDR KEY ;  mooncake-client ls --master ADDR [--json]
//! mooncake-client drain --master ADDR SEGMENT [--grace SECS]
//! ```
//! `serve` drains on SIGTERM/SIGINT before it stops (moves what only it holds to the
//! other nodes, or to its SSD tier), for at most `--drain-grace` seconds (default 30;
//! 0: stop at once); a second signal stops it at once.
//! `--protocol auto|tcp|shm|rdma` (any command) picks how segments are reached
//! (default `auto`: shared memory on this host, RDMA where both ends have a
//! device, else TCP; `rdma` without a device is an error).
//! Set `MOONCAKE_SECRET` to prove a shared secret to the master and the nodes.
//! A cluster's etcd that asks for credentials gets `--etcd-user USER` (password in
//! `MOONCAKE_ETCD_PASSWORD`) and `--etcd-ca PEM [--etcd-cert PEM --etcd-key PEM]`.
//! Without it a node serves loopback peers only, unless started `serve --insecure`.
//! `MOONCAKE_SOFT_RDMA=N` replaces the RDMA devices by N software NICs that reach
//! peers over loopback (for testing the RDMA path on one host; not RDMA).
//! One-shot commands exit 0 on success and 1 with a one-line error on stderr.

use clap::{Parser, Subcommand};
use mooncake_core::{parse_size, Error, Protocol, ReplicateConfig, SsdBackend, SsdOffloadConfig, Store};

/// Mooncake Store client.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// How segments are reached: auto, tcp, shm or rdma.
    #[arg(long, global = true, default_value = "auto", value_parser = ["auto", "tcp", "shm", "rdma"])]
    protocol: String,
    /// Cluster mode: etcd user (its password in `MOONCAKE_ETCD_PASSWORD`).
    #[arg(long, global = true)]
    etcd_user: Option<String>,
    /// Cluster mode: reach etcd over TLS, trusting this CA (PEM).
    #[arg(long, global = true)]
    etcd_ca: Option<std::path::PathBuf>,
    /// Cluster mode: client certificate (PEM) for etcd, with `--etcd-key`.
    #[arg(long, global = true)]
    etcd_cert: Option<std::path::PathBuf>,
    /// Cluster mode: the private key (PEM) of `--etcd-cert`.
    #[arg(long, global = true)]
    etcd_key: Option<std::path::PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run a storage node: give DRAM (and SSD) to the pool until SIGTERM/SIGINT.
    Serve {
        /// Master address (host:port).
        #[arg(long)]
        master: String,
        /// Transfer endpoint to listen on (host:port; port 0 picks one).
        #[arg(long)]
        listen: String,
        /// DRAM given to the pool (4096, 64MiB, 4GiB).
        #[arg(long, value_parser = size)]
        segment_size: u64,
        /// Directory of the SSD tier.
        #[arg(long, requires = "ssd_capacity")]
        ssd_dir: Option<std::path::PathBuf>,
        /// Capacity of the SSD tier.
        #[arg(long, value_parser = size, requires = "ssd_dir")]
        ssd_capacity: Option<u64>,
        /// On-disk layout of the SSD tier.
        #[arg(long, default_value = "bucket", value_parser = ["bucket", "file_per_key", "offset_allocator"])]
        ssd_backend: String,
        /// Which objects leave the SSD first when it is full.
        #[arg(long, default_value = "fifo", value_parser = ["fifo", "lru"])]
        ssd_eviction: String,
        /// Serve peers on any address without a shared secret (by default, without
        /// `MOONCAKE_SECRET`, only loopback peers are served).
        #[arg(long)]
        insecure: bool,
        /// On SIGTERM/SIGINT, drain for at most this many seconds before stopping
        /// (0: stop at once, what only this node holds is lost).
        #[arg(long, default_value_t = 30.0, value_parser = seconds)]
        drain_grace: f64,
    },
    /// Drain the storage node SEGMENT (its segment name `endpoint#n`, or its
    /// endpoint): it takes no new replica and moves what only it holds elsewhere.
    /// Prints progress; exits 0 once done with nothing lost.
    Drain {
        /// Master address.
        #[arg(long)]
        master: String,
        /// The node's segment name or endpoint.
        segment: String,
        /// Longest the node may take (seconds).
        #[arg(long, default_value_t = 30.0, value_parser = seconds)]
        grace: f64,
    },
    /// Store FILE under KEY.
    Put {
        /// Master address.
        #[arg(long)]
        master: String,
        /// Object key.
        key: String,
        /// File to store.
        file: std::path::PathBuf,
        /// Number of replicas.
        #[arg(long, default_value_t = 1)]
        replicas: usize,
    },
    /// Write the object KEY to OUTFILE.
    Get {
        /// Master address.
        #[arg(long)]
        master: String,
        /// Object key.
        key: String,
        /// Where to write the bytes.
        outfile: std::path::PathBuf,
    },
    /// Remove KEY.
    Rm {
        /// Master address.
        #[arg(long)]
        master: String,
        /// Object key.
        key: String,
    },
    /// Print what the master knows of KEY.
    Stat {
        /// Master address.
        #[arg(long)]
        master: String,
        /// Object key.
        key: String,
    },
    /// Print the slot map of a cluster: slot ranges -> leader, epoch.
    Slots {
        /// The cluster (`etcd://H:P[,H:P...]/NAME`).
        #[arg(long)]
        master: String,
        /// Print JSON instead.
        #[arg(long)]
        json: bool,
    },
    /// List every key, sorted, one a line, escaped (`\n`, `\t`, `\"`, `\u{..}` as in
    /// Rust strings).
    Ls {
        /// Master address.
        #[arg(long)]
        master: String,
        /// Print a JSON array of the keys instead.
        #[arg(long)]
        json: bool,
    },
    /// Print the bearer token of the master's `/metrics`, `/status` and `/drain`
    /// (`Authorization: Bearer <token>`), derived from `MOONCAKE_SECRET`: put it in
    /// scrape configurations instead of the secret, which proves nothing else.
    MetricsToken,
}

fn size(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.to_string())
}

/// A number of seconds, 0 ..= one day.
fn seconds(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.0..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds in 0..=86400")),
    }
}

/// One line of a drain's progress.
fn drain_line(p: &mooncake_core::DrainProgress) -> String {
    format!(
        "drain {}: {} of {} objects moved ({} bytes: {} copied, {} already replicated, {} to SSD), {} left ({} bytes), {} lost, {:.1} s",
        p.node,
        p.objects_moved(),
        p.objects_total,
        p.bytes_moved(),
        p.objects_copied,
        p.objects_dropped,
        p.objects_on_disk,
        p.objects_left,
        p.bytes_left,
        p.objects_lost,
        p.elapsed_ms as f64 / 1000.0
    )
}

/// `serve`'s stop: drains within `grace` (a second signal from `signals` stops at
/// once), then unmounts by dropping the store.
fn stop_serving(store: Store, mut signals: signal_hook::iterator::Signals, grace: f64) {
    if grace > 0.0 {
        tracing::warn!(grace, "stopping: draining first (a second signal stops at once)");
        let draining = store.clone();
        let grace = std::time::Duration::from_secs_f64(grace);
        // On its own thread: this one waits for it, the signal thread may not.
        let drain = std::thread::spawn(move || draining.drain(grace));
        // A second signal ends the process whatever the drain is doing.
        std::thread::spawn(move || {
            if let Some(sig) = signals.forever().next() {
                eprintln!("second signal ({sig}): stopping at once, without finishing the drain");
                std::process::exit(128 + sig);
            }
        });
        match drain.join() {
            // Not `println!`: a closed standard output (a parent that read the
            // first line only) must not turn a finished drain into a panic.
            Ok(Ok(p)) => {
                use std::io::Write;
                let _ = writeln!(std::io::stdout(), "drained: {}", drain_line(&p));
            }
            Ok(Err(e)) => eprintln!("drain failed: {e}"),
            Err(_) => eprintln!("drain failed: its thread panicked"),
        }
    }
    tracing::info!("stopping; unmounting the segment");
    drop(store);
}

/// A builder with the chosen protocol that proves `MOONCAKE_SECRET` when it is set
/// (an empty one is an error).
fn builder(master: &str, protocol: Protocol) -> Result<mooncake_core::StoreBuilder, String> {
    let etcd = ETCD_CREDENTIALS.get().cloned().unwrap_or_default();
    let mut b = Store::builder().master_address(master).protocol(protocol).etcd_credentials(etcd);
    if let Some(nics) = std::env::var("MOONCAKE_SOFT_RDMA").ok().and_then(|n| n.parse::<usize>().ok()) {
        match mooncake_transfer::SoftRdma::new(nics) {
            Ok(soft) => {
                tracing::warn!(nics, "RDMA on software NICs (loopback only, not RDMA)");
                b = b.rdma_provider(std::sync::Arc::new(soft));
            }
            Err(e) => tracing::warn!(error = %e, "cannot start software RDMA NICs"),
        }
    }
    match std::env::var("MOONCAKE_SECRET") {
        Ok(s) if s.is_empty() => Err("MOONCAKE_SECRET is set but empty: give a secret or unset it".into()),
        Ok(s) => Ok(b.shared_secret(s.as_bytes())),
        Err(_) => Ok(b),
    }
}

/// How cluster commands authenticate to etcd (from the flags, set once in `main`).
static ETCD_CREDENTIALS: std::sync::OnceLock<mooncake_core::cluster::EtcdCredentials> = std::sync::OnceLock::new();

fn client(master: &str, protocol: Protocol) -> Result<Store, String> {
    builder(master, protocol)?.global_segment_size(0).build().map_err(|e| e.to_string())
}

/// A key on one line: control characters, quotes and backslashes escaped as in Rust
/// strings, so that no key can pass for two or hide in the terminal.
fn escape_key(key: &str) -> String {
    key.escape_debug().to_string()
}

fn run(cmd: Command, protocol: Protocol) -> Result<(), String> {
    match cmd {
        Command::Serve {
            master,
            listen,
            segment_size,
            ssd_dir,
            ssd_capacity,
            ssd_backend,
            ssd_eviction,
            insecure,
            drain_grace,
        } => {
            // Catch the signals before announcing ourselves: a SIGTERM sent right after
            // the first line must stop us cleanly, not kill us.
            let mut signals =
                signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
                    .map_err(|e| e.to_string())?;
            let mut b =
                builder(&master, protocol)?.listen(&listen).global_segment_size(segment_size).insecure(insecure);
            if let (Some(dir), Some(capacity)) = (ssd_dir, ssd_capacity) {
                let eviction = match ssd_eviction.as_str() {
                    "lru" => mooncake_core::storage::EvictionPolicy::Lru,
                    _ => mooncake_core::storage::EvictionPolicy::Fifo,
                };
                let backend = ssd_backend.parse::<SsdBackend>().map_err(|e| e.to_string())?;
                b = b.ssd_offload(SsdOffloadConfig::new(dir, capacity).backend(backend).eviction(eviction));
            }
            let store = b.build().map_err(|e| e.to_string())?;
            // Lets processes of this host attach to this node (`setup_dummy`).
            let _attach = mooncake_cli::attach::publish(&master, store.endpoint())
                .map_err(|e| tracing::warn!(error = %e, "cannot publish the attach file"))
                .ok();
            println!(
                "mooncake-client serving segment {} ({} bytes) at {}",
                store.segment_id().unwrap_or(0),
                segment_size,
                store.endpoint()
            );
            if let Some(sig) = signals.forever().next() {
                tracing::info!(sig, "signal received");
            }
            stop_serving(store, signals, drain_grace);
            Ok(())
        }
        Command::Drain { master, segment, grace } => {
            let store = client(&master, protocol)?;
            let grace_ms = (grace * 1000.0) as u64;
            let p = store.master().drain_segment(&segment, grace_ms).map_err(|e| e.to_string())?;
            if p.segments == 0 {
                return Err(format!("no such segment: {segment} (give its name endpoint#n, or its endpoint)"));
            }
            // The node reports at the latest at its end; a node that never does is
            // gone or stuck.
            let limit = std::time::Duration::from_millis(grace_ms) + std::time::Duration::from_secs(10);
            let start = std::time::Instant::now();
            let mut last = String::new();
            loop {
                let p = store.master().drain_status(&segment).map_err(|e| e.to_string())?;
                let line = drain_line(&p);
                if p.started && line != last {
                    println!("{line}");
                    last = line;
                }
                if p.started && p.done {
                    return match (p.objects_lost, p.objects_left) {
                        (0, 0) => Ok(()),
                        (0, n) => Err(format!(
                            "drain of {} ended with {n} objects still on the node ({} bytes): ask again with a \
                             longer --grace",
                            p.node, p.bytes_left
                        )),
                        (n, _) => {
                            Err(format!("drain of {} ended with {n} objects lost ({} bytes)", p.node, p.bytes_lost))
                        }
                    };
                }
                if start.elapsed() > limit {
                    return Err(format!("drain of {} did not finish within {:.0} s", p.node, limit.as_secs_f64()));
                }
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
        Command::Put { master, key, file, replicas } => {
            let data = std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
            client(&master, protocol)?
                .put_with(&key, &data, &ReplicateConfig::replicas(replicas))
                .map_err(|e| e.to_string())
        }
        Command::Get { master, key, outfile } => {
            let bytes = client(&master, protocol)?.get(&key).map_err(|e| e.to_string())?;
            std::fs::write(&outfile, &bytes).map_err(|e| format!("cannot write {}: {e}", outfile.display()))
        }
        Command::Rm { master, key } => client(&master, protocol)?.remove(&key).map_err(|e| e.to_string()),
        Command::Stat { master, key } => {
            let info = client(&master, protocol)?.master().object_info(&key).map_err(|e| e.to_string())?;
            println!(
                "{key}: {} bytes, {} replica(s), crc32c {:08x}{}",
                info.len,
                info.replicas.len(),
                info.checksum,
                if info.soft_pin { ", soft-pinned" } else { "" }
            );
            Ok(())
        }
        Command::Slots { master, json } => {
            let addr: mooncake_core::cluster::EtcdAddress = master.parse().map_err(|e: Error| e.to_string())?;
            let etcd = ETCD_CREDENTIALS.get().cloned().unwrap_or_default();
            let map =
                mooncake_core::cluster::SlotMapWatcher::connect_with(&addr, &etcd).map_err(|e| e.to_string())?.map();
            let ranges = map.ranges();
            if json {
                let rows: Vec<serde_json::Value> = ranges
                    .iter()
                    .map(|(r, l)| {
                        serde_json::json!({
                            "first": r.start(), "last": r.end(),
                            "leader": l.as_ref().map(|l| &l.addr),
                            "master": l.as_ref().map(|l| &l.master),
                            "epoch": l.as_ref().map(|l| l.epoch),
                        })
                    })
                    .collect();
                println!("{}", serde_json::Value::Array(rows));
            } else {
                println!("{} slot groups", map.groups());
                for (r, l) in ranges {
                    match l {
                        Some(l) => {
                            println!("{}-{} -> {} (master {}, epoch {})", r.start(), r.end(), l.addr, l.master, l.epoch)
                        }
                        None => println!("{}-{} -> no leader", r.start(), r.end()),
                    }
                }
            }
            Ok(())
        }
        Command::MetricsToken => match std::env::var("MOONCAKE_SECRET") {
            Ok(s) if !s.is_empty() => {
                println!("{}", mooncake_transfer::SharedSecret::new(s.as_bytes()).http_token());
                Ok(())
            }
            _ => Err("set MOONCAKE_SECRET: the token is derived from it (without a secret, the master's \
                      HTTP endpoints serve loopback clients only and need no token)"
                .into()),
        },
        Command::Ls { master, json } => {
            let keys = client(&master, protocol)?.master().all_keys().map_err(|e| e.to_string())?;
            if json {
                println!("{}", serde_json::to_string(&keys).map_err(|e| e.to_string())?);
            } else {
                for k in keys {
                    println!("{}", escape_key(&k));
                }
            }
            Ok(())
        }
    }
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    mooncake_cli::limits::raise_open_files_limit();
    let args = Args::parse();
    let etcd = mooncake_core::cluster::EtcdCredentials::from_flags(
        args.etcd_user.as_deref(),
        args.etcd_ca.clone(),
        args.etcd_cert.clone(),
        args.etcd_key.clone(),
    );
    let outcome = etcd
        .map_err(|e| e.to_string())
        .map(|c| ETCD_CREDENTIALS.get_or_init(|| c))
        .and_then(|_| args.protocol.parse::<Protocol>())
        .and_then(|protocol| run(args.command, protocol));
    if let Err(e) = outcome {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
