//! `mooncake-master`: the master daemon, a command line over
//! [`MasterDaemon`] (run your own, with your own
//! allocation strategy, with that type: see examples/custom_master.rs).
//!
//! Set `MOONCAKE_SECRET` to require clients to prove a shared secret (and HTTP
//! clients of `/metrics`, `/status` and `/drain` to send `Authorization: Bearer
//! <token>`, the token derived from the secret that `mooncake-client metrics-token`
//! prints; the secret itself never crosses the wire).
//! Without it the master serves loopback clients only, unless started `--insecure`.
//! In cluster mode, `--etcd-user` (password in `MOONCAKE_ETCD_PASSWORD`) and
//! `--etcd-ca`/`--etcd-cert`/`--etcd-key` authenticate to etcd.
//!
//! ```text
//! mooncake-master --listen 127.0.0.1:50051 [--metrics-listen ADDR] [--insecure] [--max-connections N]
//!                 [--etcd http://H:P[,H:P] --cluster-id NAME [--advertise ADDR] [--slot-groups 16]
//!                  [--lease-ttl-ms 3000] [--etcd-user USER] [--etcd-ca PEM [--etcd-cert PEM --etcd-key PEM]]]
//!                 [--allocation-strategy random|free_ratio_first|ssd_free_ratio_first]
//!                 [--default-lease-ms 5000] [--client-ttl-ms 10000] [--persist none|lazy|eager]
//! ```
//!
//! The reference master's spellings are accepted too: `--rpc_address`, `--rpc_port`,
//! `--default_kv_lease_ttl` (ms), `--client_ttl` (s), `--eviction_high_watermark_ratio`,
//! `--eviction_ratio`, `--metrics_host`, `--metrics_port`, `--enable_offload`.
//!
//! Once serving it prints `mooncake-master listening on ADDR` and, with metrics,
//! `mooncake-master metrics on ADDR` on stdout; port 0 in either address picks a free
//! port and these lines say which.

use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use mooncake_cli::{http, metrics};
use mooncake_core::rpc::RpcServerConfig;
use mooncake_core::{MasterConfig, MasterDaemon};

/// Mooncake Store master: object metadata, placement, leases, eviction.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// Address of the RPC listener.
    #[arg(long, default_value = "127.0.0.1:50051")]
    listen: String,
    /// Serve Prometheus text at /metrics and JSON at /status on this address.
    #[arg(long)]
    metrics_listen: Option<String>,
    /// Replica placement strategy.
    #[arg(long, default_value = "random", value_parser = ["random", "free_ratio_first", "ssd_free_ratio_first"])]
    allocation_strategy: String,
    /// Read lease granted with each replica list (ms).
    #[arg(long, alias = "default_kv_lease_ttl", default_value_t = 5000)]
    default_lease_ms: u64,
    /// Clients silent this long lose their segments (ms).
    #[arg(long, default_value_t = 10000)]
    client_ttl_ms: u64,
    /// When objects go to the SSD tiers of the nodes that have one: never, when
    /// memory must be freed, or as soon as they are put.
    #[arg(long, default_value = "lazy", value_parser = ["none", "lazy", "eager"])]
    persist: String,
    /// Serve clients on any address without a shared secret (by default, without
    /// `MOONCAKE_SECRET`, only loopback clients are served).
    #[arg(long)]
    insecure: bool,
    /// Most client connections open at once; more are refused with a message.
    #[arg(long, default_value_t = 65_536)]
    max_connections: usize,
    /// A connection that sends part of a request and then nothing more of it for
    /// this long is closed, and the memory its bytes held is freed (ms).
    #[arg(long, default_value_t = 20_000)]
    frame_timeout_ms: u64,
    /// Cluster mode: etcd endpoints (`http://H:P[,H:P...]`); the master joins the
    /// cluster `--cluster-id` and answers only for the slot groups it leads.
    #[arg(long, requires = "cluster_id")]
    etcd: Option<String>,
    /// Cluster mode: the cluster's name (clients use `etcd://H:P/NAME`).
    #[arg(long)]
    cluster_id: Option<String>,
    /// Cluster mode: the address clients reach this master at (default: the one served;
    /// give a routable one when listening on 0.0.0.0).
    #[arg(long)]
    advertise: Option<String>,
    /// Cluster mode: slot groups, when this master creates the cluster (a divisor of
    /// 16384; the first master fixes it).
    #[arg(long, default_value_t = 16)]
    slot_groups: u32,
    /// Cluster mode: leadership lease (ms, rounded up to whole seconds; etcd's minimum
    /// is 2 s); a master that cannot renew it stops answering for its slots.
    #[arg(long, default_value_t = 3000)]
    lease_ttl_ms: u64,
    /// Cluster mode: etcd user (its password in `MOONCAKE_ETCD_PASSWORD`).
    #[arg(long)]
    etcd_user: Option<String>,
    /// Cluster mode: reach etcd over TLS, trusting this CA (PEM).
    #[arg(long)]
    etcd_ca: Option<std::path::PathBuf>,
    /// Cluster mode: client certificate (PEM) for etcd, with `--etcd-key`.
    #[arg(long)]
    etcd_cert: Option<std::path::PathBuf>,
    /// Cluster mode: the private key (PEM) of `--etcd-cert`.
    #[arg(long)]
    etcd_key: Option<std::path::PathBuf>,
    /// Host of the RPC listener (with `--rpc_port`, instead of `--listen`).
    #[arg(long = "rpc_address", help_heading = "Reference master's spellings")]
    rpc_address: Option<String>,
    /// Port of the RPC listener.
    #[arg(long = "rpc_port", help_heading = "Reference master's spellings")]
    rpc_port: Option<u16>,
    /// Clients silent this long lose their segments (s; instead of `--client-ttl-ms`).
    #[arg(long = "client_ttl", help_heading = "Reference master's spellings")]
    client_ttl_s: Option<u64>,
    /// Eviction starts when memory is fuller than this ratio.
    #[arg(long = "eviction_high_watermark_ratio", help_heading = "Reference master's spellings")]
    eviction_high_watermark_ratio: Option<f64>,
    /// Eviction frees this ratio below the high watermark.
    #[arg(long = "eviction_ratio", help_heading = "Reference master's spellings")]
    eviction_ratio: Option<f64>,
    /// Host of the metrics listener (with `--metrics_port`; default 0.0.0.0).
    #[arg(long = "metrics_host", help_heading = "Reference master's spellings")]
    metrics_host: Option<String>,
    /// Port of the metrics listener (instead of `--metrics-listen`).
    #[arg(long = "metrics_port", help_heading = "Reference master's spellings")]
    metrics_port: Option<u16>,
    /// `true`: objects go to the SSD tiers as soon as they are put (`--persist eager`).
    #[arg(long = "enable_offload", num_args = 0..=1, default_missing_value = "true", help_heading = "Reference master's spellings")]
    enable_offload: Option<bool>,
}

impl Args {
    /// Folds the reference master's spellings into ours.
    fn resolve(mut self) -> Self {
        if self.rpc_address.is_some() || self.rpc_port.is_some() {
            let (host, port) = self.listen.rsplit_once(':').unwrap_or((self.listen.as_str(), "50051"));
            let host = self.rpc_address.clone().unwrap_or_else(|| host.to_owned());
            let port = self.rpc_port.map_or_else(|| port.to_owned(), |p| p.to_string());
            self.listen = format!("{host}:{port}");
        }
        if let Some(s) = self.client_ttl_s {
            self.client_ttl_ms = s.saturating_mul(1000);
        }
        if let Some(port) = self.metrics_port {
            self.metrics_listen = Some(format!("{}:{port}", self.metrics_host.as_deref().unwrap_or("0.0.0.0")));
        }
        if self.enable_offload == Some(true) {
            self.persist = "eager".into();
        }
        self
    }
}

/// `MOONCAKE_SECRET`, if set; an empty one is an error.
fn secret_from_env() -> Result<Option<String>, String> {
    match std::env::var("MOONCAKE_SECRET") {
        Ok(s) if s.is_empty() => Err("MOONCAKE_SECRET is set but empty: give a secret or unset it".into()),
        Ok(s) => Ok(Some(s)),
        Err(_) => Ok(None),
    }
}

/// Serves `/metrics` and `/status` on `addr` (a bounded server: see
/// `mooncake_cli::http`) until the returned server is dropped.
fn serve_metrics(
    addr: &str,
    daemon: Arc<MasterDaemon>,
    secret: Option<String>,
    insecure: bool,
) -> Result<http::HttpServer, String> {
    let token = secret.map(|s| mooncake_transfer::SharedSecret::new(s.as_bytes()).http_token());
    let access = http::HttpAccess { token, insecure };
    metrics::serve_master(addr, daemon, access, http::HttpBounds::default())
        .map_err(|e| format!("cannot listen on {addr} for metrics: {e}"))
}

fn run(args: Args) -> Result<(), String> {
    let strategy = mooncake_core::alloc::strategy_from_name(&args.allocation_strategy)
        .ok_or_else(|| format!("unknown allocation strategy {}", args.allocation_strategy))?;
    let config = MasterConfig {
        default_lease: Duration::from_millis(args.default_lease_ms),
        client_ttl: Duration::from_millis(args.client_ttl_ms),
        monitor_interval: Duration::from_millis((args.client_ttl_ms / 20).clamp(5, 100)),
        allocation_strategy: strategy,
        persist: args.persist.parse().map_err(|e: mooncake_core::Error| e.to_string())?,
        ..MasterConfig::served()
    };
    let config = MasterConfig {
        high_watermark: args.eviction_high_watermark_ratio.unwrap_or(config.high_watermark),
        eviction_ratio: args.eviction_ratio.unwrap_or(config.eviction_ratio),
        ..config
    };
    // Catch the signals before announcing ourselves (see mooncake-client serve).
    let mut signals = signal_hook::iterator::Signals::new([signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT])
        .map_err(|e| e.to_string())?;
    let secret = secret_from_env()?;
    let rpc_config = RpcServerConfig {
        secret: secret.as_deref().map(|s| mooncake_transfer::SharedSecret::new(s.as_bytes())),
        insecure: args.insecure,
        max_connections: args.max_connections,
        frame_timeout: Duration::from_millis(args.frame_timeout_ms.max(1)),
        ..RpcServerConfig::default()
    };
    let mut daemon = MasterDaemon::builder(&args.listen).config(config).rpc_config(rpc_config);
    if let Some(etcd) = &args.etcd {
        let endpoints: Vec<String> = etcd.split(',').map(|e| e.trim().to_owned()).filter(|e| !e.is_empty()).collect();
        let member = mooncake_core::cluster::MemberConfig {
            endpoints,
            cluster: args.cluster_id.clone().unwrap_or_default(),
            advertise: args.advertise.clone().unwrap_or_default(),
            lease_ttl: Duration::from_millis(args.lease_ttl_ms),
            groups: args.slot_groups,
            scan_interval: Duration::from_secs(1),
            credentials: mooncake_core::cluster::EtcdCredentials::from_flags(
                args.etcd_user.as_deref(),
                args.etcd_ca.clone(),
                args.etcd_cert.clone(),
                args.etcd_key.clone(),
            )
            .map_err(|e| e.to_string())?,
        };
        daemon = daemon.cluster(member);
    }
    let daemon = Arc::new(daemon.serve().map_err(|e| e.to_string())?);
    let metrics = match &args.metrics_listen {
        Some(addr) => Some(serve_metrics(addr, daemon.clone(), secret, args.insecure)?),
        None => None,
    };
    // First line: where RPC listens (scripts read it); second: where metrics are.
    println!("mooncake-master listening on {}", daemon.local_addr());
    if let Some(metrics) = &metrics {
        println!("mooncake-master metrics on {}", metrics.local_addr());
    }
    if let Some(sig) = signals.forever().next() {
        tracing::info!(sig, "shutting down");
    }
    Ok(())
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    mooncake_cli::limits::raise_open_files_limit();
    if let Err(e) = run(Args::parse().resolve()) {
        eprintln!("mooncake-master: {e}");
        std::process::exit(1);
    }
}
