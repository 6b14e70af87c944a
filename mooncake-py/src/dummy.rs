//! `setup_dummy`: a client attached to a storage process on this host.
//!
//! The reference's dummy client forwards every call to a "real" client process over
//! a local socket, and that process moves the bytes. This engine's clients move bytes
//! themselves, and a client on the same host as a storage node maps the node's
//! segment (the `Shm` transport): so the attached client is an ordinary client
//! without a segment of its own, talking to the storage process's master, that
//! reaches the storage process's memory through shared memory. Nothing is forwarded.
//!
//! The master is found where the storage process published it
//! (`mooncake-client serve` writes `client-<port>.attach`, lines `key=value`:
//! `master`, `endpoint`, `pid`, into `$XDG_RUNTIME_DIR/mooncake`, or
//! `/tmp/mooncake-<uid>` without it), else in `$MOONCAKE_MASTER` (a `host:port`).

use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

use mooncake_core::{Protocol, Store};

use crate::codes::{code, INVALID_PARAMS, RPC_FAIL, SEGMENT_NOT_FOUND};
use crate::session::{resolve_in, Session};

/// How long to wait for the storage process to accept a connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The directory storage processes of this user publish themselves in.
fn publish_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("mooncake"),
        // SAFETY: getuid has no preconditions and cannot fail.
        _ => PathBuf::from(format!("/tmp/mooncake-{}", unsafe { libc::getuid() })),
    }
}

/// The master the storage process serving on `port` published, if its file is in a
/// directory only this user can write, names that port, and its process is alive.
fn published_master(port: &str) -> Option<String> {
    let dir = publish_dir();
    let meta = std::fs::metadata(&dir).ok()?;
    // SAFETY: getuid has no preconditions and cannot fail.
    if meta.uid() != unsafe { libc::getuid() } || meta.mode() & 0o022 != 0 {
        return None;
    }
    let text = std::fs::read_to_string(dir.join(format!("client-{port}.attach"))).ok()?;
    let field =
        |name: &str| text.lines().find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix('='))).map(str::trim);
    let endpoint_port = field("endpoint")?.rsplit_once(':')?.1;
    let pid: i32 = field("pid")?.parse().ok()?;
    // SAFETY: kill with signal 0 only checks that the process exists.
    let alive = pid > 0 && unsafe { libc::kill(pid, 0) } == 0;
    (endpoint_port == port && alive).then(|| field("master").map(str::to_owned)).flatten()
}

/// Attaches to the storage process serving at `server` (`host:port`); the session,
/// or the code `setup_dummy` returns.
pub fn attach(server: &str) -> Result<Session, i32> {
    let (_, port) = server.rsplit_once(':').ok_or(INVALID_PARAMS)?;
    let addrs: Vec<_> = server.to_socket_addrs().map_err(|_| INVALID_PARAMS)?.collect();
    if !addrs.iter().any(|a| TcpStream::connect_timeout(a, PROBE_TIMEOUT).is_ok()) {
        return Err(RPC_FAIL);
    }
    let master = published_master(port)
        // SGLang's variable for the master's address (only an address: a path, as
        // some scripts keep there for the master binary, is not one).
        .or_else(|| std::env::var("MOONCAKE_MASTER").ok().filter(|m| m.contains(':') && !m.contains('/')))
        .ok_or(INVALID_PARAMS)?;
    let mut b =
        Store::builder().master_address(&master).global_segment_size(0).protocol(Protocol::Shm).listen("127.0.0.1:0");
    if let Ok(secret) = std::env::var("MOONCAKE_SECRET") {
        b = b.shared_secret(secret.as_bytes());
    }
    let store = b.build().map_err(|e| code(&e))?;
    let names: Vec<String> =
        store.master().stats().map_err(|e| code(&e))?.segment_usage.into_iter().map(|u| u.name).collect();
    let local: Vec<String> =
        names.iter().filter(|n| resolve_in(std::slice::from_ref(n), server).is_some()).cloned().collect();
    if local.is_empty() {
        return Err(SEGMENT_NOT_FOUND);
    }
    Ok(Session::new(store, server.to_owned(), local))
}
