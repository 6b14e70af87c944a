"""Fixtures: a `mooncake-master` daemon per test session, clients of it, and registered
buffers."""

import ctypes
import os
import pathlib
import subprocess
import time

import pytest

from mooncake_rs.store import MooncakeDistributedStore

REPO = pathlib.Path(__file__).resolve().parents[2]
# Short read leases keep remove-after-read tests fast.
LEASE_MS = 300


# $MOONCAKE_MASTER as the tests started (tests change the variable: it is also the
# master address the binding reads).
MASTER_ENV = os.environ.get("MOONCAKE_MASTER")


def master_binary():
    """The `mooncake-master` to test against: $MOONCAKE_MASTER, else the newest build."""
    if MASTER_ENV:
        return MASTER_ENV
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    found = [p for p in (target / "release" / "mooncake-master", target / "debug" / "mooncake-master") if p.exists()]
    if not found:
        pytest.exit("no mooncake-master binary: cargo build -p mooncake-cli --bin mooncake-master", 2)
    return str(max(found, key=lambda p: p.stat().st_mtime))


def start_master(*extra):
    """Starts a master on a loopback port it chooses (port 0: no other process can
    take it between choosing and binding); returns (process, "host:port")."""
    proc = subprocess.Popen(
        [master_binary(), "--listen", "127.0.0.1:0", "--default-lease-ms", str(LEASE_MS), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        proc.wait(timeout=10)
        pytest.fail(f"mooncake-master did not start: {line!r}")
    return proc, line.split()[-1]


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


class Registered:
    """A ctypes buffer registered with a store; unregistered on exit."""

    def __init__(self, store, size):
        self.store, self.size = store, size
        self.buf = (ctypes.c_ubyte * size)()
        self.ptr = ctypes.addressof(self.buf)

    def __enter__(self):
        assert self.store.register_buffer(self.ptr, self.size) == 0
        return self

    def __exit__(self, *exc):
        assert self.store.unregister_buffer(self.ptr) == 0

    def write(self, offset, data):
        ctypes.memmove(self.ptr + offset, data, len(data))

    def read(self, offset, n):
        return ctypes.string_at(self.ptr + offset, n)


def client_binary():
    """The `mooncake-client` built next to the master under test."""
    path = pathlib.Path(master_binary()).with_name("mooncake-client")
    if not path.exists():
        pytest.exit(f"no {path}: cargo build -p mooncake-cli", 2)
    return str(path)


def start_master_with_metrics(*extra):
    """A master with its metrics listener on a free loopback port; returns (process,
    "host:port" of RPC, "host:port" of metrics)."""
    proc, addr = start_master("--metrics-listen", "127.0.0.1:0", *extra)
    line = proc.stdout.readline()
    if "metrics on" not in line:
        stop(proc)
        pytest.fail(f"mooncake-master printed no metrics address: {line!r}")
    return proc, addr, line.split()[-1]


def start_storage_node(master, segment=32 << 20, env=None):
    """A `mooncake-client serve` storage process; returns (process, "host:port" it
    serves its segment at)."""
    proc = subprocess.Popen(
        [client_binary(), "serve", "--master", master, "--listen", "127.0.0.1:0", "--segment-size", str(segment)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    if "serving segment" not in line:
        stop(proc)
        pytest.fail(f"mooncake-client serve did not start: {line!r}")
    return proc, line.split()[-1]
