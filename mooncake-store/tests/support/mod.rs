//! A real `mooncake-master` daemon for the tests, and stores connected to it.
//!
//! The daemon is the binary of `mooncake-cli`, found next to the test executable's
//! directory. `cargo test --workspace` builds it; `cargo test -p mooncake_store`
//! alone does not: run `cargo build -p mooncake-cli` first.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

use mooncake_store::MooncakeStore;

/// `target/<profile>/`: where cargo puts the workspace's binaries (the test runs
/// from `target/<profile>/deps/`).
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// Path of a binary of this workspace; a clear failure when it is not built.
pub fn bin(name: &str) -> PathBuf {
    let path = target_dir().join(name);
    assert!(
        path.exists(),
        "{} not built: run `cargo build -p mooncake-cli` (cargo test --workspace builds it)",
        path.display()
    );
    path
}

/// A `mooncake-master` on a free loopback port, killed when dropped.
pub struct Master {
    child: Child,
    /// `127.0.0.1:PORT` it serves clients on.
    pub addr: String,
    /// Kept open so that the daemon never writes into a closed pipe.
    _stdout: BufReader<ChildStdout>,
}

impl Master {
    /// Starts a master with `args` added to its command line.
    pub fn start(args: &[&str]) -> Master {
        let mut child = Command::new(bin("mooncake-master"))
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("cannot start mooncake-master");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        stdout
            .read_line(&mut line)
            .expect("the master's first line");
        assert!(
            line.starts_with("mooncake-master listening on"),
            "unexpected first line {line:?}"
        );
        let addr = line
            .trim()
            .rsplit(' ')
            .next()
            .expect("an address")
            .to_owned();
        Master {
            child,
            addr,
            _stdout: stdout,
        }
    }

    /// `kill -9` and reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Master {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A store set up against `master` with the reference's usual arguments and a
/// segment of `segment` bytes.
pub fn store(master: &Master, segment: u64) -> MooncakeStore {
    let store = MooncakeStore::new().expect("new");
    store
        .setup(
            "127.0.0.1",
            "http://127.0.0.1:8080/metadata",
            segment,
            128 << 20,
            "tcp",
            "",
            &master.addr,
        )
        .expect("setup against the test master");
    store
}

/// Deterministic test bytes.
pub fn payload(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i % 251) as u8))
        .collect()
}
