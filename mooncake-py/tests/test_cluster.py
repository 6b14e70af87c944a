"""Cluster mode from Python: `setup(..., master_server_addr="etcd://H:P/CLUSTER")`
against a real etcd, two `mooncake-master --etcd` daemons and a storage node
(`mooncake-client serve`). A master killed with SIGKILL loses no acknowledged object:
its slot groups move to the other master, which rebuilds them from the nodes'
records."""

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

from conftest import connect, master_binary, stop

# Short leases and client TTLs: a dead master's groups move within a few seconds.
LEASE_MS = 2000
CLIENT_TTL_MS = 2000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_binary():
    """`mooncake-client`, built next to the master."""
    path = os.path.join(os.path.dirname(master_binary()), "mooncake-client")
    if not os.path.exists(path):
        pytest.exit(f"no {path}: cargo build -p mooncake-cli --bins", 2)
    return path


def start_etcd(data):
    """etcd on free loopback ports; returns (process, "127.0.0.1:port")."""
    exe = shutil.which("etcd")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed (apt-get install etcd-server)")
        pytest.skip("etcd is not installed")
    for _ in range(10):
        client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        proc = subprocess.Popen(
            [exe, "--name", "t", "--data-dir", os.path.join(data, "etcd")]
            + ["--listen-client-urls", client, "--advertise-client-urls", client]
            + ["--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        host_port = client.removeprefix("http://")
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            # Listening is not serving: etcd is ready once it reports itself healthy.
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as r:
                    if b'"true"' in r.read():
                        return proc, host_port
            except OSError:
                pass
            time.sleep(0.05)
        stop(proc)  # a port was taken (it exited) or it hung: try other ports
    pytest.fail("etcd did not start")


def start_master(etcd, cluster, log):
    """A cluster member logging to the file `log`; returns (process, its RPC address)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [master_binary(), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"]
            + ["--etcd", f"http://{etcd}", "--cluster-id", cluster]
            + ["--lease-ttl-ms", str(LEASE_MS), "--client-ttl-ms", str(CLIENT_TTL_MS)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    line = proc.stdout.readline()
    if "listening on" not in line:
        stop(proc)
        with open(log) as err:
            pytest.fail(f"mooncake-master did not start: {line!r}\n{err.read()[-2000:]}")
    return proc, line.split()[-1]


def leaders(address):
    """The leader address of each slot range (None: no leader), from `mooncake-client
    slots`, or None if the map cannot be read yet."""
    out = subprocess.run(
        [client_binary(), "slots", "--master", address], capture_output=True, text=True, timeout=30
    )
    if out.returncode != 0:
        return None
    return out.stdout.splitlines()[1:]


def wait_led_by(address, masters, timeout=20):
    """Waits until every slot range is led by one of `masters` and each of them
    leads some; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = leaders(address)
        if lines and all(any(m in l for m in masters) for l in lines) and all(
            any(m in l for l in lines) for m in masters
        ):
            return
        time.sleep(0.2)
    pytest.fail(f"the slots of {address} are not led by {masters}: {leaders(address)}")


@pytest.fixture()
def cluster():
    """etcd, two masters and a storage node; yields (etcd:// address, [(process,
    address) of each master])."""
    data = tempfile.mkdtemp(prefix="mooncake-py-cluster-")
    procs = []
    try:
        etcd, endpoint = start_etcd(data)
        procs.append(etcd)
        name = f"py{os.getpid()}"
        address = f"etcd://{endpoint}/{name}"
        masters = [start_master(endpoint, name, os.path.join(data, f"master{i}.log")) for i in range(2)]
        procs.extend(p for p, _ in masters)
        wait_led_by(address, [a for _, a in masters])
        node = subprocess.Popen(
            [client_binary(), "serve", "--master", address, "--listen", "127.0.0.1:0", "--segment-size", "64MiB"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(node)
        line = node.stdout.readline()
        assert line.startswith("mooncake-client serving segment"), line
        yield address, masters
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                stop(p)
        shutil.rmtree(data, ignore_errors=True)


def test_setup_against_etcd_survives_a_master_kill_9(cluster):
    address, masters = cluster
    # This client gives memory too: its extents are re-mounted with the new leader.
    store = connect(address, segment=32 << 20)
    try:
        rng = random.Random(25)
        acked = {}
        for i in range(200):
            key, value = f"py-cluster/{i}", rng.randbytes(rng.randint(1, 8192))
            assert store.put(key, value) == 0, key
            acked[key] = value
        assert all(store.get(k) == v for k, v in acked.items())

        victim, victim_addr = masters[0]
        victim.kill()  # SIGKILL
        victim.wait(timeout=10)
        survivor = masters[1][1]
        wait_led_by(address, [survivor])
        # Every acknowledged object, whichever master led its group, reads back.
        lost = [k for k, v in acked.items() if store.get(k) != v]
        assert not lost, f"{len(lost)} of {len(acked)} lost after the kill of {victim_addr}: {lost[:5]}"
        # And the cluster takes new puts.
        assert store.put("py-cluster/after", b"after the failover") == 0
        assert store.get("py-cluster/after") == b"after the failover"
    finally:
        store.close()
