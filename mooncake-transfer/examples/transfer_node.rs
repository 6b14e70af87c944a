//! A transfer endpoint in its own process, for multi-process tests and manual runs.
//!
//! ```text
//! transfer_node [LISTEN_ADDR] [REGION_BYTES]     (defaults: 127.0.0.1:0, 16 MiB)
//! ```
//!
//! Registers one region (memfd-backed, so same-host peers map it), fills it with a
//! known pattern (byte `i` is `i % 251`), prints `endpoint=<host:port> region=<id>`
//! on stdout, and serves until killed or until its stdin closes. `MOONCAKE_SECRET`
//! in the environment makes the listener require that shared secret;
//! `MOONCAKE_RDMA=soft` serves RDMA on two software NICs of the `SoftRdma` seam.

use std::io::{Read, Write};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let listen = args.next().unwrap_or_else(|| "127.0.0.1:0".to_owned());
    let len: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(16 << 20);
    let mut builder = mooncake_transfer::TransferEngine::builder().tcp_listen(listen.as_str()).shared_memory(true);
    if let Ok(secret) = std::env::var("MOONCAKE_SECRET") {
        builder = builder.shared_secret(secret.as_bytes());
    }
    if std::env::var("MOONCAKE_RDMA").is_ok_and(|v| v == "soft") {
        let nics = std::sync::Arc::new(mooncake_transfer::SoftRdma::new(2)?);
        builder = builder.rdma(nics, mooncake_transfer::RdmaConfig::default());
    }
    let engine = builder.build()?;
    let region = engine.register_region(len)?;
    let pattern: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    let mut at = 0u64;
    while at < len {
        // 2^20 is not a multiple of 251: each piece starts the pattern where it is.
        let n = (len - at).min(pattern.len() as u64 - 251) as usize;
        let skew = (at % 251) as usize;
        region.copy_in(at, &pattern[skew..skew + n])?;
        at += n as u64;
    }
    let mut out = std::io::stdout().lock();
    writeln!(out, "endpoint={} region={}", engine.endpoint(), region.id())?;
    out.flush()?;
    drop(out);
    // Serve until stdin reaches EOF (the parent went away) or a signal ends us.
    let mut sink = [0u8; 64];
    while std::io::stdin().read(&mut sink).is_ok_and(|n| n > 0) {}
    Ok(())
}
