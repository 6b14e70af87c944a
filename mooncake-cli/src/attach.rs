//! How a storage node (`mooncake-client serve`) tells processes of the same user on
//! its host how to attach to it: the Python binding's `setup_dummy(..., "HOST:PORT")`
//! reads the master's address from here.
//!
//! The file is `client-<port>.attach` (the port the node serves its segment on), with
//! the lines `master=HOST:PORT`, `endpoint=HOST:PORT` and `pid=N`, in
//! `$XDG_RUNTIME_DIR/mooncake`, or `/tmp/mooncake-<uid>` without it: a directory only
//! this user can write (made with mode 0700; a reader ignores one that others can
//! write). The file goes when the node stops; a reader also checks that `pid` lives.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::PathBuf;

/// The directory attach files are in.
pub fn dir() -> std::io::Result<PathBuf> {
    Ok(match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("mooncake"),
        // The owner of /proc/self is this process's user.
        _ => PathBuf::from(format!("/tmp/mooncake-{}", std::fs::metadata("/proc/self")?.uid())),
    })
}

/// A published attach file; removed on drop.
#[derive(Debug)]
pub struct Published(PathBuf);

impl Drop for Published {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Publishes that the node serving at `endpoint` uses the master at `master`.
pub fn publish(master: &str, endpoint: &str) -> std::io::Result<Published> {
    let port = endpoint.rsplit_once(':').map(|(_, p)| p).unwrap_or_default();
    let dir = dir()?;
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let path = dir.join(format!("client-{port}.attach"));
    // Written whole under a temporary name, then renamed: a reader sees all or nothing.
    let tmp = dir.join(format!(".client-{port}.{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp)?;
    write!(f, "master={master}\nendpoint={endpoint}\npid={}\n", std::process::id())?;
    drop(f);
    std::fs::rename(&tmp, &path)?;
    Ok(Published(path))
}
