"""The binding against a real master daemon: every method, its codes, its edge cases."""

import ctypes
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import pytest

from conftest import Registered, connect, master_binary, start_master, start_storage_node, stop
from mooncake_rs.store import BufferHandle, MooncakeDistributedStore, ReplicateConfig, SoftPinAction

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704


def removed_soon(remove, timeout=2.0):
    """Calls `remove` until it reports success, for at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not remove():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def payload(n, seed):
    return random.Random(seed).randbytes(n)


# ---------------------------------------------------------------- configuration


def test_replicate_config_fields():
    c = ReplicateConfig()
    assert c.replica_num == 1
    assert c.soft_pin_action == SoftPinAction.PRESERVE
    assert c.soft_pin_ttl_ms is None
    assert c.preferred_segment == "" and c.preferred_segments == []
    c.replica_num = 2
    c.soft_pin_action = SoftPinAction.ENABLE
    c.preferred_segments = ["a", "b"]
    assert (c.replica_num, c.soft_pin_action, c.preferred_segments) == (2, SoftPinAction.ENABLE, ["a", "b"])
    assert "replica_num: 2" in str(c) and "ENABLE" in str(c)


def test_soft_pin_ttl_conversion():
    c = ReplicateConfig()
    c.soft_pin_ttl_ms = 1000
    assert c.soft_pin_ttl_ms == 1000
    c.soft_pin_ttl_ms = None
    assert c.soft_pin_ttl_ms is None
    with pytest.raises(TypeError):
        c.soft_pin_ttl_ms = -1
    with pytest.raises(TypeError):
        c.soft_pin_ttl_ms = 1 << 64


def test_soft_pin_forwarding(store):
    enable = ReplicateConfig()
    enable.soft_pin_action = SoftPinAction.ENABLE
    enable.soft_pin_ttl_ms = 1000
    assert store.put("pinned", b"soft-pin", enable) == 0
    # A TTL without ENABLE is refused, as by the reference.
    preserve_ttl = ReplicateConfig()
    preserve_ttl.soft_pin_ttl_ms = 1000
    assert store.put("pinned-2", b"x", preserve_ttl) == INVALID_PARAMS
    zero = ReplicateConfig()
    zero.replica_num = 0
    assert store.put("no-replicas", b"x", zero) == INVALID_PARAMS


# ---------------------------------------------------------------- setup / lifecycle


def test_not_set_up_answers_codes():
    s = MooncakeDistributedStore()
    assert s.health_check() == 1
    assert s.put("k", b"v") == INVALID_PARAMS
    assert s.get("k") == b""
    assert s.is_exist("k") == INVALID_PARAMS
    assert s.batch_is_exist(["a", "b"]) == [INVALID_PARAMS] * 2
    assert s.register_buffer(0x1000, 16) == INVALID_PARAMS
    assert s.get_hostname() == ""
    assert s.close() == 0


def test_setup_positional_and_hostname(master):
    s = connect(master)
    host = s.get_hostname()
    # No port given: one of the reference's range.
    assert host.startswith("localhost:") and 12300 <= int(host.split(":")[1]) <= 14300
    assert s.health_check() == 0
    assert s.close() == 0
    assert s.health_check() == 1


def test_setup_keywords_and_optional_arguments(master):
    s = MooncakeDistributedStore()
    rc = s.setup(
        local_hostname="localhost",
        metadata_server="http://127.0.0.1:8080/metadata",
        global_segment_size=16 << 20,
        local_buffer_size=16 << 20,
        protocol="tcp",
        rdma_devices="",
        master_server_addr=master,
        tenant_id="default",
    )
    assert rc == 0
    assert s.put("kw", b"v") == 0 and s.get("kw") == b"v"
    s.remove_all(True)
    s.close()


def test_setup_dict_with_human_sizes(master):
    s = MooncakeDistributedStore()
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": "16MB",
        "local_buffer_size": "16 MB",
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": master,
    }
    assert s.setup(cfg) == 0
    assert s.setup(config=cfg) == 0
    assert s.put("dict-key", b"dict-value") == 0
    assert s.get("dict-key") == b"dict-value"
    s.remove_all(True)
    s.close()
    bad = dict(cfg, global_segment_size="50%")
    assert MooncakeDistributedStore().setup(bad) != 0


def test_setup_refuses_unreachable_master():
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "", 16 << 20, 16 << 20, "tcp", "", "127.0.0.1:1") < 0
    assert s.health_check() == 1


def test_close_takes_the_segment_with_it(master):
    s = connect(master)
    assert s.put("teardown", b"Hello, World!") == 0
    assert s.close() == 0
    s = connect(master)
    assert s.get("teardown") == b""
    assert s.put("teardown", b"again") == 0 and s.get("teardown") == b"again"
    s.remove_all(True)
    s.close()


# ---------------------------------------------------------------- bytes API


@pytest.mark.parametrize("size", [1, 7, 4095, 4096, 65537, 1 << 20, (4 << 20) + 3])
def test_round_trip_sizes(store, size):
    data = payload(size, size)
    key = f"size-{size}"
    assert store.put(key, data) == 0
    assert store.get(key) == data
    assert store.get_size(key) == size
    assert store.is_exist(key) == 1


def test_put_accepts_bytes_likes(store):
    assert store.put("ba", bytearray(b"bytearray")) == 0
    assert store.put("mv", memoryview(b"xxmemoryview")[2:]) == 0
    assert store.get("ba") == b"bytearray" and store.get("mv") == b"memoryview"
    with pytest.raises(TypeError):
        store.put("int", 5)
    with pytest.raises(TypeError):
        store.put("str", "text")


def test_error_codes(store):
    assert store.put("dup", b"one") == 0
    # Objects are immutable; like the reference, a second put of a key succeeds and
    # keeps the first value.
    assert store.put("dup", b"two") == 0
    assert store.get("dup") == b"one"
    assert store.get("missing") == b""
    assert store.get_size("missing") == OBJECT_NOT_FOUND
    assert store.is_exist("missing") == 0
    assert store.remove("missing") == OBJECT_NOT_FOUND
    assert store.put("", b"v") == INVALID_PARAMS
    assert store.put("empty-value", b"") == INVALID_PARAMS
    assert store.put("k" * 5000, b"v") == INVALID_PARAMS


def test_put_parts_and_batches(store):
    assert store.put_parts("parts", b"ab", bytearray(b"cd"), memoryview(b"ef")) == 0
    assert store.get("parts") == b"abcdef"
    keys = [f"batch-{i}" for i in range(10)]
    values = [payload(100 + i, i) for i in range(10)]
    assert store.put_batch(keys, values) == 0
    assert store.get_batch(keys + ["nope"]) == values + [b""]
    assert store.put_batch(keys[:1], [b"other"]) == 0
    assert store.get(keys[0]) == values[0]
    assert store.put_batch(["x"], []) == INVALID_PARAMS


def test_get_buffer(store):
    data = b"Batch Buffer Data! " * 100
    assert store.put("buf", data) == 0
    h = store.get_buffer("buf")
    assert isinstance(h, BufferHandle)
    assert h.size() == len(h) == len(data) and h.ptr() != 0
    assert bytes(h) == data
    assert store.get_buffer("nope") is None
    got = store.batch_get_buffer(["buf", "nope"])
    assert bytes(got[0]) == data and got[1] is None
    assert store.batch_get_buffer([]) == []


def test_batch_is_exist_with_missing_keys(store):
    keys = [f"exist-{i}" for i in range(20)]
    for k in keys[:10]:
        assert store.put(k, b"v") == 0
    assert store.batch_is_exist(keys) == [1] * 10 + [0] * 10
    assert store.batch_is_exist([]) == []
    assert store.batch_is_exist(["nope"]) == [0]


# ---------------------------------------------------------------- zero copy


def test_put_from_get_into(store):
    data = b"Hello, Zero-Copy World! " * 1000
    with Registered(store, len(data) + 1024) as buf:
        buf.write(0, data)
        assert store.put_from("zc", buf.ptr, len(data)) == 0
        assert store.get("zc") == data
        ctypes.memset(buf.ptr, 0, buf.size)
        assert store.get_into("zc", buf.ptr, buf.size) == len(data)
        assert buf.read(0, len(data)) == data
        # The object does not fit: refused, nothing written past the room given.
        assert store.get_into("zc", buf.ptr + 16, len(data) // 2) == INVALID_PARAMS
        assert store.get_into("missing", buf.ptr, buf.size) == OBJECT_NOT_FOUND


def test_bad_pointers_and_sizes_are_refused(store):
    assert store.put("target", b"x" * 100) == 0
    with Registered(store, 4096) as buf:
        end = buf.ptr + buf.size
        bad = [
            (0, 16),  # null
            (12345, 16),  # never registered
            (buf.ptr - 1, 16),  # starts before the region
            (buf.ptr, buf.size + 1),  # runs past its end
            (end - 8, 16),  # runs past its end
            (end, 1),  # starts at its end
            (buf.ptr, 0),  # empty
            (buf.ptr + 8, (1 << 64) - 8),  # wraps the address space
        ]
        for ptr, size in bad:
            assert store.put_from("bad-put", ptr, size) == INVALID_PARAMS, (ptr, size)
            assert store.get_into("target", ptr, size) == INVALID_PARAMS, (ptr, size)
            assert store.batch_get_into(["target"], [ptr], [size]) == [INVALID_PARAMS]
            assert store.batch_put_from(["bad-batch"], [ptr], [size]) == [INVALID_PARAMS]
            assert store.batch_get_into_multi_buffers(["target"], [[ptr]], [[size]]) == [INVALID_PARAMS]
            assert store.batch_put_from_multi_buffers(["bad-multi"], [[ptr]], [[size]]) == [INVALID_PARAMS]
        assert store.is_exist("bad-put") == 0 and store.is_exist("bad-batch") == 0
        with pytest.raises((TypeError, OverflowError)):
            store.get_into("target", -1, 16)
        with pytest.raises((TypeError, OverflowError)):
            store.put_from("x", buf.ptr, -5)
    # Unregistered now: the same pointer is refused.
    assert store.get_into("target", buf.ptr, 4096) == INVALID_PARAMS
    assert store.unregister_buffer(buf.ptr) == INVALID_PARAMS
    assert store.register_buffer(0, 16) == INVALID_PARAMS
    assert store.register_buffer(buf.ptr, 0) == INVALID_PARAMS


def test_views_inside_a_registered_buffer(store):
    with Registered(store, 1 << 20) as buf:
        buf.write(1000, b"inner")
        assert store.put_from("inner", buf.ptr + 1000, 5) == 0
        assert store.get_into("inner", buf.ptr + (1 << 20) - 5, 5) == 5
        assert buf.read((1 << 20) - 5, 5) == b"inner"


def test_get_into_ranges(store):
    data1 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    data2 = b"abcdefghijklmnopqrstuvwxyz0123456789"
    assert store.put("r1", data1) == 0 and store.put("r2", data2) == 0
    with Registered(store, 32) as b0, Registered(store, 32) as b1:
        ctypes.memset(b0.ptr, ord("_"), 32)
        ctypes.memset(b1.ptr, ord("_"), 32)
        res = store.get_into_ranges(
            [b0.ptr, b1.ptr],
            [["r1", "r2"], ["r2", "r1"]],
            [[[0, 20], [8]], [[4], [16]]],
            [[[1, 30], [2]], [[0], [10]]],
            [[[4, 3], [5]], [[6], [4]]],
        )
        assert res == [[[4, 3], [5]], [[6], [4]]]
        assert b0.read(0, 4) == data1[1:5] and b0.read(8, 5) == data2[2:7] and b0.read(20, 3) == data1[30:33]
        assert b1.read(4, 6) == data2[0:6] and b1.read(16, 4) == data1[10:14]
        assert b0.read(4, 4) == b"____"
        mismatch = store.get_into_ranges([b0.ptr], [["r1", "r2"]], [[[0], []]], [[[0, 1], []]], [[[], []]])
        assert len(mismatch) == 1 and len(mismatch[0]) == 2
        assert mismatch[0][0][0] < 0 and mismatch[0][1] == []
        assert store.get_into_ranges([b0.ptr], [["r1"]], [[[0]]], [[[len(data1) - 1]]], [[[4]]])[0][0][0] < 0
        assert store.get_into_ranges([b0.ptr], [["r1"]], [[[31]]], [[[0]]], [[[4]]])[0][0][0] < 0
        missing = store.get_into_ranges([b0.ptr], [["nope", "r1"]], [[[0], [8]]], [[[0], [0]]], [[[4], [4]]])
        assert missing[0][0][0] == OBJECT_NOT_FOUND and missing[0][1][0] == 4
        # Inner lists shorter than the keys: the keys without ranges fail alone.
        short = store.get_into_ranges([b0.ptr], [["r1", "r2"]], [[[0]]], [[[0]]], [[[4]]])
        assert short == [[[4], []]]
        short = store.get_into_ranges([b0.ptr], [["r1", "r2"]], [[[0], [8]]], [[[0]]], [[[4]]])
        assert short == [[[4], [INVALID_PARAMS]]]
        top = store.get_into_ranges([b0.ptr, b1.ptr], [["r1"]], [[[0]]], [[[0]]], [[[4]]])
        assert top == [[[INVALID_PARAMS]]]
        assert store.get_into_ranges([12345], [["r1"]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
        # Ranges past the largest object an object can be (4 GiB) are refused at
        # once: no scratch memory is asked for them (32 TiB here, and 2^63).
        for far in (1 << 45, (1 << 63) + 5):
            assert store.get_into_ranges([b0.ptr], [["r1"]], [[[0]]], [[[far]]], [[[1]]]) == [[[INVALID_PARAMS]]]


def test_batch_put_from_and_batch_get_into(store):
    n, size = 16, 64 << 10
    data = [payload(size - i, i) for i in range(n)]
    keys = [f"bz-{i}" for i in range(n)]
    with Registered(store, n * size) as buf:
        for i, d in enumerate(data):
            buf.write(i * size, d)
        ptrs = [buf.ptr + i * size for i in range(n)]
        assert store.batch_put_from(keys, ptrs, [len(d) for d in data]) == [0] * n
        assert store.batch_put_from(keys[:2], ptrs[:2], [10, 10]) == [0, 0]  # exists: kept as is
        ctypes.memset(buf.ptr, 0, buf.size)
        got = store.batch_get_into(keys + ["missing"], ptrs + [ptrs[0]], [size] * (n + 1))
        assert got == [len(d) for d in data] + [OBJECT_NOT_FOUND]
        for i, d in enumerate(data):
            assert buf.read(i * size, len(d)) == d
        # A destination too small for its object fails alone.
        assert store.batch_get_into(keys[:2], ptrs[:2], [size, 10]) == [len(data[0]), INVALID_PARAMS]
        assert store.batch_get_into(keys[:2], ptrs[:3], [size] * 3) == [INVALID_PARAMS] * 2
        assert store.batch_put_from(["a", "b"], ptrs[:1], [1]) == [INVALID_PARAMS] * 2
        assert store.batch_get_into([], [], []) == []


def test_multi_buffers(store):
    layers, block = 4, 8 << 10
    keys = [f"mb-{i}" for i in range(8)]
    with Registered(store, len(keys) * layers * block) as src, Registered(store, len(keys) * layers * block) as dst:
        expected = []
        all_ptrs, all_sizes = [], []
        for k in range(len(keys)):
            parts = [payload(block, k * 100 + l) for l in range(layers)]
            ptrs = []
            for l, p in enumerate(parts):
                off = (l * len(keys) + k) * block  # layer-major: a key's parts are not adjacent
                src.write(off, p)
                ptrs.append(src.ptr + off)
            expected.append(b"".join(parts))
            all_ptrs.append(ptrs)
            all_sizes.append([block] * layers)
        assert store.batch_put_from_multi_buffers(keys, all_ptrs, all_sizes) == [0] * len(keys)
        for k, key in enumerate(keys):
            assert store.get(key) == expected[k]
        dst_ptrs = [[dst.ptr + (l * len(keys) + k) * block for l in range(layers)] for k in range(len(keys))]
        got = store.batch_get_into_multi_buffers(keys + ["missing"], dst_ptrs + [dst_ptrs[0]], all_sizes + [all_sizes[0]])
        assert got == [layers * block] * len(keys) + [OBJECT_NOT_FOUND]
        for k in range(len(keys)):
            assert b"".join(dst.read(p - dst.ptr, block) for p in dst_ptrs[k]) == expected[k]
        # Parts of different sizes, filled in order.
        split = [[dst.ptr, dst.ptr + 100_000], [1000, layers * block - 1000]]
        assert store.batch_get_into_multi_buffers(keys[:1], [split[0]], [split[1]]) == [layers * block]
        assert dst.read(0, 1000) + dst.read(100_000, layers * block - 1000) == expected[0]
        # Room for less than the object: refused.
        assert store.batch_get_into_multi_buffers(keys[:1], [[dst.ptr]], [[block]]) == [INVALID_PARAMS]
        assert store.batch_put_from_multi_buffers(["x"], [[src.ptr, src.ptr]], [[1]]) == [INVALID_PARAMS]
        assert store.batch_put_from_multi_buffers(["x"], [[]], [[]]) == [INVALID_PARAMS]


# ---------------------------------------------------------------- removes


def test_remove_family(store):
    assert store.put("lease", b"v") == 0
    assert store.get("lease") == b"v"
    # A read holds its lease only while it is in flight: once the get returned, its
    # release reaches the master (batched in the background) and the object can be
    # removed; the reference keeps it leased for its whole TTL.
    assert removed_soon(lambda: store.remove("lease") == 0)
    assert store.is_exist("lease") == 0
    assert store.remove("lease") == OBJECT_NOT_FOUND
    assert store.put("lease", b"v") == 0
    assert store.remove("lease", True) == 0
    assert store.is_exist("lease") == 0

    for i in range(5):
        assert store.put(f"re-a-{i}", b"v") == 0
        assert store.put(f"re-b-{i}", b"v") == 0
    assert store.remove_by_regex("^re-a-[0-2]$") == 3
    assert store.batch_is_exist([f"re-a-{i}" for i in range(5)]) == [0, 0, 0, 1, 1]
    assert store.remove_by_regex("([") == INVALID_PARAMS
    assert store.batch_remove(["re-b-0", "re-b-1", "nope"]) == [0, 0, OBJECT_NOT_FOUND]
    store.get("re-b-2")
    assert removed_soon(lambda: store.batch_remove(["re-b-2"]) == [0])  # the finished get holds no lease
    assert store.batch_remove(["re-b-3"], force=True) == [0]
    assert store.remove_all() == 3
    assert store.batch_is_exist(["re-a-3", "re-b-4"]) == [0, 0]


# ---------------------------------------------------------------- concurrency, processes


def test_gil_is_released(store):
    data = payload(4 << 20, 1)
    assert store.put("gil", data) == 0
    ticks = 0
    stop = threading.Event()

    def tick():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0)

    t = threading.Thread(target=tick)
    t.start()
    before = ticks
    for _ in range(20):
        assert store.get("gil") == data
    stop.set()
    t.join()
    assert ticks > before


def test_threads_share_a_store(store):
    errors = []

    def worker(w):
        try:
            for i in range(50):
                key, data = f"t-{w}-{i}", payload(1000 + i, w * 1000 + i)
                assert store.put(key, data) == 0
                assert store.get(key) == data
        except AssertionError as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert store.batch_is_exist([f"t-{w}-49" for w in range(4)]) == [1] * 4


CHILD = textwrap.dedent(
    """
    import sys
    from mooncake_rs.store import MooncakeDistributedStore
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
    for i in range(20):
        assert s.put(f"child-{i}", bytes([i]) * (10000 + i)) == 0
    print("ready", flush=True)
    key = sys.stdin.readline().strip()
    print(s.get(key).hex(), flush=True)
    sys.stdin.readline()
    s.close()
    """
)


def test_two_processes_share_a_master(master):
    parent = connect(master, segment=0)  # no segment: every byte crosses TCP
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, master], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        keys = [f"child-{i}" for i in range(20)]
        assert parent.batch_is_exist(keys) == [1] * 20
        assert parent.get_batch(keys) == [bytes([i]) * (10000 + i) for i in range(20)]
        with Registered(parent, 1 << 20) as buf:
            assert parent.get_into("child-3", buf.ptr, buf.size) == 10003
            assert buf.read(0, 10003) == bytes([3]) * 10003
        # The other way: the child reads what the parent wrote (to the child's segment).
        assert parent.put("from-parent", b"hello child") == 0
        child.stdin.write("from-parent\n")
        child.stdin.flush()
        assert bytes.fromhex(child.stdout.readline().strip()) == b"hello child"
        child.stdin.write("bye\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
        # Its segment left with it.
        assert parent.is_exist("child-0") == 0
    finally:
        if child.poll() is None:
            child.kill()
        parent.remove_all(True)
        parent.close()


def test_bad_pointers_do_not_crash_the_process(master):
    script = textwrap.dedent(
        """
        import random, sys
        from mooncake_rs.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("localhost", "", 16 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
        assert s.put("victim", b"x" * 4096) == 0
        rng = random.Random(7)
        for _ in range(2000):
            ptr, size = rng.getrandbits(rng.choice([8, 16, 32, 48, 64])), rng.getrandbits(rng.choice([4, 16, 40]))
            assert s.get_into("victim", ptr, size) == -600
            assert s.put_from("p", ptr, size) == -600
            assert s.batch_get_into(["victim"], [ptr], [size]) == [-600]
        s.remove_all(True)
        print("survived")
        """
    )
    out = subprocess.run([sys.executable, "-c", script, master], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "survived"


TEARDOWN_UNDER_CALLS = textwrap.dedent(
    """
    import faulthandler, os, signal, sys, threading, time
    from mooncake_rs.store import MooncakeDistributedStore, MooncakeHostMemAllocator
    faulthandler.enable()
    master, node = sys.argv[1], int(sys.argv[2])
    n = 4 << 20
    s = MooncakeDistributedStore()
    # No segment of its own: the object is on the storage process, which is stopped
    # so that a read of it stays in flight.
    assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
    assert s.put("obj", b"z" * n) == 0
    alloc = MooncakeHostMemAllocator()
    calls = {
        "get_into": lambda ptr: s.get_into("obj", ptr, n),
        "put_from": lambda ptr: s.put_from("new", ptr, n),
    }
    for call, teardown in [("get_into", "unregister_buffer"), ("put_from", "unregister_buffer"), ("get_into", "close")]:
        ptr = alloc.alloc(n)
        assert s.register_buffer(ptr, n) == 0
        os.kill(node, signal.SIGSTOP)
        got = []
        user = threading.Thread(target=lambda: got.append(calls[call](ptr)))
        user.start()
        time.sleep(0.3)
        assert user.is_alive()
        threading.Timer(0.5, os.kill, (node, signal.SIGCONT)).start()
        t0 = time.monotonic()
        assert (s.unregister_buffer(ptr) if teardown == "unregister_buffer" else s.close()) == 0
        waited = time.monotonic() - t0
        # The documented order: unregister (or close), then free. Unmapped, a buffer
        # still in use would crash the process or fail the call.
        assert alloc.free(ptr) == 0
        user.join()
        print(call, teardown, got[0], round(waited, 2), flush=True)
    """
)


def test_unregister_and_close_wait_for_calls_in_flight():
    """`unregister_buffer` and `close` return only once the calls using the buffer on
    other threads are done: freeing it right after never crashes the process, nor
    fails the call."""
    proc, addr = start_master()
    node, _ = start_storage_node(addr, segment=32 << 20)
    try:
        child = subprocess.run(
            [sys.executable, "-c", TEARDOWN_UNDER_CALLS, addr, str(node.pid)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stdout + child.stderr
        lines = [line.split() for line in child.stdout.splitlines()]
        assert [(c, t, int(got)) for c, t, got, _ in lines] == [
            ("get_into", "unregister_buffer", 4 << 20),
            ("put_from", "unregister_buffer", 0),
            ("get_into", "close", 4 << 20),
        ]
        # Each waited for the call (the node resumed 0.5 s after it started waiting).
        assert all(float(waited) >= 0.3 for *_, waited in lines), lines
    finally:
        node.kill()
        node.wait()
        stop(proc)


UNREGISTER_UNDER_CONSTANT_CALLS = textwrap.dedent(
    """
    import ctypes, sys, threading, time
    from mooncake_rs.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", sys.argv[1]) == 0
    n, size = 6, 4 << 20
    busy = (ctypes.c_ubyte * (n * size))()
    other = (ctypes.c_ubyte * 4096)()
    assert s.register_buffer(ctypes.addressof(busy), n * size) == 0
    assert s.register_buffer(ctypes.addressof(other), 4096) == 0
    assert s.put("hot", b"h" * size) == 0
    stop, calls = threading.Event(), [0] * n

    def reader(i):
        while not stop.is_set():
            assert s.get_into("hot", ctypes.addressof(busy) + i * size, size) == size
            calls[i] += 1

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    # Three times: calls that overlap by chance leave it a gap now and then.
    codes, waits = [], []
    for _ in range(3):
        rc = [None]
        start = time.monotonic()
        unregister = threading.Thread(target=lambda: rc.__setitem__(0, s.unregister_buffer(ctypes.addressof(other))))
        unregister.start()
        unregister.join(20)
        waits.append(time.monotonic() - start)
        codes.append(rc[0])
        assert s.register_buffer(ctypes.addressof(other), 4096) == 0
    stop.set()
    for t in threads:
        t.join()
    print(max(codes, key=abs), round(max(waits), 3), sum(calls), flush=True)
    s.close()
    """
)


def test_unregister_is_not_starved_by_calls_that_never_pause(master):
    """Pointer calls on other threads that always overlap one another do not keep
    `unregister_buffer` (of another buffer) waiting: calls that arrive while it waits
    queue behind it."""
    child = subprocess.run(
        [sys.executable, "-c", UNREGISTER_UNDER_CONSTANT_CALLS, master],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stdout + child.stderr
    rc, waited, calls = child.stdout.split()
    assert int(rc) == 0, child.stdout
    # About 10 ms here (queued behind the calls in flight); up to seconds, or never,
    # when calls that arrive while it waits go first.
    assert float(waited) < 1, child.stdout
    assert int(calls) > 0


def test_master_takes_the_reference_flag_spellings():
    # Port 0 for both: the master prints the ports it bound, so no other test can take
    # them between choosing and binding.
    port, metrics = 0, 0
    flags = [
        "--rpc_address=127.0.0.1",
        f"--rpc_port={port}",
        "--default_kv_lease_ttl=200",
        "--client_ttl=5",
        "--eviction_high_watermark_ratio=0.9",
        "--eviction_ratio=0.1",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
        "--enable_offload=false",
    ]
    proc = subprocess.Popen([master_binary(), *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.rsplit(":", 1)[1])
        line = proc.stdout.readline()
        assert "metrics on 127.0.0.1:" in line, line
        metrics = int(line.rsplit(":", 1)[1])
        s = connect(f"127.0.0.1:{port}")
        assert s.put("flags", b"v") == 0 and s.get("flags") == b"v"
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10).read().decode()
        assert "mooncake_objects 1" in text
        s.close()
    finally:
        stop(proc)
