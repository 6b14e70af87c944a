"""Fixtures: a `mooncake-master` daemon per test session, and clients of it."""

import os
import pathlib
import socket
import subprocess
import time

import pytest

from mooncake_rs.store import MooncakeDistributedStore

REPO = pathlib.Path(__file__).resolve().parents[2]
# Short read leases keep remove-after-read tests fast.
LEASE_MS = 300


def master_binary():
    """The `mooncake-master` to test against: $MOONCAKE_MASTER, else the newest build."""
    if os.environ.get("MOONCAKE_MASTER"):
        return os.environ["MOONCAKE_MASTER"]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    found = [p for p in (target / "release" / "mooncake-master", target / "debug" / "mooncake-master") if p.exists()]
    if not found:
        pytest.exit("no mooncake-master binary: cargo build -p mooncake-core --bin mooncake-master", 2)
    return str(max(found, key=lambda p: p.stat().st_mtime))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(*extra):
    """Starts a master on a free loopback port; returns (process, "host:port")."""
    for _ in range(5):
        addr = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen(
            [master_binary(), "--listen", addr, "--default-lease-ms", str(LEASE_MS), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = proc.stdout.readline()
        if "listening on" in line:
            return proc, addr
        proc.wait(timeout=10)
    pytest.fail("mooncake-master did not start")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def master():
    proc, addr = start_master()
    yield addr
    stop(proc)


def connect(master, segment=64 << 20, protocol="tcp"):
    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", segment, 16 << 20, protocol, "", master)
    assert rc == 0, f"setup returned {rc}"
    return store


@pytest.fixture()
def store(master):
    s = connect(master)
    yield s
    s.remove_all(True)
    s.close()


def wait_lease():
    """Lets the read leases taken so far run out."""
    time.sleep(LEASE_MS / 1000 * 1.5)
