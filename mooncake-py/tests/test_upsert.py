"""The upsert family, soft-pin TTLs, and upserts under concurrent readers (threads of
this process and a second process) against a real master daemon."""

import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from conftest import Registered, connect, start_master, stop
from mooncake_rs.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704


def value(gen, n):
    """`n` bytes that name their generation: an 8-byte header, then bytes that follow
    from it, so that any mix of two values is detected."""
    body = bytes((gen * 131 + i * 7) & 0xFF for i in range(256)) * (n // 256 + 1)
    return (struct.pack("<Q", gen) + body)[:n]


def generation(data):
    """The generation of `data` if it is exactly one value `value` makes, else None."""
    if len(data) < 8:
        return None
    gen = struct.unpack("<Q", data[:8])[0]
    return gen if value(gen, len(data)) == data else None


# ---------------------------------------------------------------- every form


def test_upsert_inserts_then_replaces(store):
    assert store.upsert("u", b"first") == 0
    assert store.get("u") == b"first"
    assert store.upsert("u", b"second, and longer") == 0
    assert store.get("u") == b"second, and longer"
    assert store.get_size("u") == len(b"second, and longer")
    assert store.upsert("u", bytearray(b"3")) == 0
    assert store.get("u") == b"3"
    # A put still keeps what is there (code 0, as the reference answers).
    assert store.put("u", b"put does not replace") == 0
    assert store.get("u") == b"3"
    with pytest.raises(TypeError):
        store.upsert("u", "text")


def test_upsert_parts(store):
    assert store.put("up", b"old") == 0
    assert store.upsert_parts("up", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("up") == b"abcdef"
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    assert store.upsert_parts("up", b"x", b"yz", config=cfg) == 0
    assert store.get("up") == b"xyz"
    assert store.upsert_parts("up") == INVALID_PARAMS  # nothing to store
    assert store.get("up") == b"xyz"


def test_upsert_batch(store):
    keys = [f"ub-{i}" for i in range(10)]
    assert store.put_batch(keys[:5], [b"old"] * 5) == 0
    new = [value(i, 1000 + i) for i in range(10)]
    assert store.upsert_batch(keys, new) == 0
    assert store.get_batch(keys) == new
    assert store.upsert_batch(keys[:2], [b"one"]) == INVALID_PARAMS
    assert store.upsert_batch(["ok", ""], [b"v", b"w"]) == INVALID_PARAMS  # first failure's code
    assert store.get("ok") == b"v"
    assert store.upsert_batch([], []) == 0


def test_upsert_from_and_batch_upsert_from(store):
    n, size = 8, 64 << 10
    keys = [f"uf-{i}" for i in range(n)]
    with Registered(store, 2 * n * size) as buf:
        for i in range(n):
            buf.write(i * size, value(i, size))
        ptrs = [buf.ptr + i * size for i in range(n)]
        assert store.batch_put_from(keys, ptrs, [size] * n) == [0] * n
        # Replace each with a shorter value from the second half of the buffer.
        for i in range(n):
            buf.write((n + i) * size, value(100 + i, size - i))
        new_ptrs = [buf.ptr + (n + i) * size for i in range(n)]
        assert store.batch_upsert_from(keys, new_ptrs, [size - i for i in range(n)]) == [0] * n
        for i in range(n):
            assert store.get(keys[i]) == value(100 + i, size - i)
        assert store.upsert_from(keys[0], buf.ptr, 10) == 0
        assert store.get(keys[0]) == value(0, size)[:10]
        assert store.upsert_from("uf-new", buf.ptr + size, 100) == 0
        assert store.get("uf-new") == value(1, size)[:100]
        # Read back zero-copy after the upserts.
        got = store.batch_get_into(keys, ptrs, [size] * n)
        assert got == [10] + [size - i for i in range(1, n)]
        # Refused: pointers outside registered memory, lengths that disagree.
        assert store.upsert_from(keys[0], 12345, 10) == INVALID_PARAMS
        assert store.upsert_from(keys[0], buf.ptr, 2 * n * size + 1) == INVALID_PARAMS
        assert store.batch_upsert_from(keys[:2], ptrs[:1], [1]) == [INVALID_PARAMS] * 2
        assert store.batch_upsert_from([keys[0], keys[1]], [buf.ptr, 999], [1, 1]) == [0, INVALID_PARAMS]
        assert store.batch_upsert_from([], [], []) == []
    assert store.get(keys[0]) == value(0, size)[:1]


def test_upsert_error_codes(master, store):
    fresh = MooncakeDistributedStore()
    assert fresh.upsert("k", b"v") == INVALID_PARAMS
    assert fresh.upsert_from("k", 4096, 1) == INVALID_PARAMS
    assert fresh.batch_upsert_from(["a"], [4096], [1]) == [INVALID_PARAMS]
    assert fresh.upsert_batch(["a"], [b"v"]) == INVALID_PARAMS
    assert store.upsert("", b"v") == INVALID_PARAMS
    assert store.upsert("k" * 5000, b"v") == INVALID_PARAMS
    assert store.upsert("empty", b"") == INVALID_PARAMS
    ttl_without_pin = ReplicateConfig()
    ttl_without_pin.soft_pin_ttl_ms = 100
    assert store.upsert("k", b"v", ttl_without_pin) == INVALID_PARAMS
    zero = ReplicateConfig()
    zero.replica_num = 0
    assert store.upsert("k", b"v", zero) == INVALID_PARAMS
    # Larger than any segment of the pool: no room, and the old value stays.
    assert store.upsert("big", b"small") == 0
    assert store.upsert("big", bytes(200 << 20)) == NO_AVAILABLE_HANDLE
    assert store.get("big") == b"small"


def test_upsert_with_two_replicas(master, store):
    other = connect(master, segment=16 << 20)
    try:
        two = ReplicateConfig()
        two.replica_num = 2
        assert store.upsert("two", value(1, 5000), two) == 0
        assert store.upsert("two", value(2, 7000), two) == 0
        assert other.get("two") == value(2, 7000)
    finally:
        other.remove_all(True)
        other.close()


# ---------------------------------------------------------------- concurrent readers


def test_upsert_under_reader_threads(master, store):
    reader_store = connect(master, segment=0)  # every read crosses TCP
    try:
        assert store.put("hot", value(0, 50_000)) == 0
        done = threading.Event()
        errors, reads = [], [0] * 4
        acknowledged = [0]

        def reader(t, s):
            last = 0
            with Registered(s, 300_000) as buf:
                while not done.is_set():
                    floor = acknowledged[0]
                    if t % 2 == 0:
                        data = s.get("hot")
                    else:
                        n = s.batch_get_into(["hot"], [buf.ptr], [buf.size])[0]
                        if n < 0:
                            errors.append(f"reader {t}: code {n}")
                            return
                        data = buf.read(0, n)
                    gen = generation(data)
                    if gen is None:
                        errors.append(f"reader {t}: {len(data)} bytes that are no value written")
                        return
                    if gen < last:
                        errors.append(f"reader {t}: went back from {last} to {gen}")
                        return
                    # Batch reads always ask the master: never older than acknowledged.
                    if t % 2 == 1 and gen < floor:
                        errors.append(f"reader {t}: read {gen} after {floor} was acknowledged")
                        return
                    last = gen
                    reads[t] += 1

        threads = [threading.Thread(target=reader, args=(t, [store, reader_store][t // 2])) for t in range(4)]
        [t.start() for t in threads]
        for gen in range(1, 61):
            assert store.upsert("hot", value(gen, 20_000 + gen * 3_001 % 200_000)) == 0
            acknowledged[0] = gen
        done.set()
        [t.join() for t in threads]
        assert not errors, errors
        assert all(r > 0 for r in reads), reads
        assert generation(store.get("hot")) == 60
    finally:
        reader_store.close()


READER = textwrap.dedent(
    """
    import ctypes, struct, sys
    from mooncake_rs.store import MooncakeDistributedStore

    def value(gen, n):
        body = bytes((gen * 131 + i * 7) & 0xFF for i in range(256)) * (n // 256 + 1)
        return (struct.pack("<Q", gen) + body)[:n]

    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[1]) == 0
    buf = (ctypes.c_ubyte * (1 << 20))()
    ptr = ctypes.addressof(buf)
    assert s.register_buffer(ptr, 1 << 20) == 0
    print("ready", flush=True)
    reads, last, bad = 0, 0, []
    while True:
        for use_get in (True, False):
            if use_get:
                data = s.get("shared")
            else:
                n = s.get_into("shared", ptr, 1 << 20)
                data = ctypes.string_at(ptr, n) if n > 0 else b""
            gen = struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else -1
            if gen < 0 or value(gen, len(data)) != data or gen < last:
                bad.append((gen, len(data), last))
            last = max(last, gen)
            reads += 1
        if gen == 10**6:
            break
    print(reads, last, len(bad), bad[:3], flush=True)
    s.close()
    """
)


def test_upsert_under_a_reader_in_another_process(master, store):
    assert store.put("shared", value(0, 30_000)) == 0
    child = subprocess.Popen([sys.executable, "-c", READER, master], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        for gen in range(1, 80):
            assert store.upsert("shared", value(gen, 10_000 + gen * 7_919 % 300_000)) == 0
        # The last value tells the reader to stop.
        assert store.upsert("shared", value(10**6, 1000)) == 0
        reads, last, bad, _ = child.stdout.readline().split(" ", 3)
        assert child.wait(timeout=60) == 0
        assert int(bad) == 0, f"the other process read {bad} mixed, missing or older values"
        assert int(last) == 10**6 and int(reads) > 10
    finally:
        if child.poll() is None:
            child.kill()


# ---------------------------------------------------------------- soft-pin TTL


def test_soft_pin_ttl_is_enforced_by_eviction():
    proc, addr = start_master()
    s = connect(addr, segment=4 << 20)
    try:
        obj = 100_000
        pin = ReplicateConfig()
        pin.soft_pin_action = SoftPinAction.ENABLE
        short = ReplicateConfig()
        short.soft_pin_action = SoftPinAction.ENABLE
        short.soft_pin_ttl_ms = 300
        # The two oldest objects: approximately-LRU eviction would take them first.
        assert s.put("pinned-for-good", b"p" * obj, pin) == 0
        assert s.upsert("pinned-briefly", b"q" * obj, short) == 0
        time.sleep(0.01)
        for i in range(25):
            assert s.put(f"fill-{i}", b"f" * obj) == 0
        time.sleep(0.5)  # the short pin runs out (and the reads' leases with it)
        # Fill the segment far past its watermark: eviction has to choose.
        for i in range(25, 60):
            assert s.put(f"fill-{i}", b"f" * obj) == 0
        assert s.is_exist("pinned-for-good") == 1, "a soft pin without a TTL did not hold"
        assert s.is_exist("pinned-briefly") == 0, "an object whose pin ran out was kept over newer ones"
        assert s.is_exist("fill-59") == 1
    finally:
        s.close()
        stop(proc)
