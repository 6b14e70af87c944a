"""What SGLang HiCache, LMCache and vLLM call beyond the reference's store tests:
setup's forms, the host-memory allocator, setup_dummy, ReplicateConfig's placement
fields, buffer handles read through the buffer protocol, NUMA binding, back-pressure
(-200) and the master's /get_all_segments."""

import ctypes
import os
import random
import urllib.request
import warnings

import pytest

from conftest import (
    Registered,
    connect,
    start_master,
    start_master_with_metrics,
    start_storage_node,
    stop,
)
from mooncake_rs.store import (
    BufferHandle,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    bind_to_numa_node,
)

INVALID_PARAMS = -600
NO_AVAILABLE_HANDLE = -200
SEGMENT_NOT_FOUND = -101
RPC_FAIL = -900


def payload(n, seed):
    return random.Random(seed).randbytes(n)


# ---------------------------------------------------------------- setup's forms


def test_setup_with_engine_and_keywords_as_sglang_calls_it(master, tmp_path):
    s = MooncakeDistributedStore()
    # 7 positional arguments, the transfer engine (None: none to share), then keywords.
    rc = s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, None, enable_ssd_offload=False)
    assert rc == 0
    assert s.put("sg", b"v") == 0 and s.get("sg") == b"v"
    s.remove_all(True)
    s.close()


def test_unknown_keyword_is_a_type_error_naming_it(master):
    """SGLang retries setup without the keywords a build rejects, found by name in the
    TypeError's message; the reference's binding raises TypeError for them."""
    s = MooncakeDistributedStore()
    kwargs = {"enable_ssd_offload": False, "no_such_option": 1}
    with pytest.raises(TypeError, match="no_such_option"):
        s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, None, **kwargs)
    # The retry, as SGLang does it: drop what the message names, call again.
    while True:
        try:
            rc = s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, None, **kwargs)
            break
        except TypeError as e:
            dropped = [k for k in list(kwargs) if k in str(e)]
            assert dropped, e
            for k in dropped:
                kwargs.pop(k)
    assert rc == 0 and kwargs == {"enable_ssd_offload": False}
    with pytest.raises(TypeError):
        s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, local_hostname="x")
    with pytest.raises(TypeError):
        s.setup(*(["x"] * 14))
    s.close()


def test_setup_with_a_live_engine_listens_beside_the_engines_port(master):
    """SGLang hands over the reference's TransferEngine with `local_hostname` set to
    that engine's `ip:port`: the port is taken (by the engine), so this client serves
    its segment on another port of that host instead of failing to listen."""
    import socket

    engine_port = socket.socket()
    engine_port.bind(("127.0.0.1", 0))
    engine_port.listen()
    taken = f"127.0.0.1:{engine_port.getsockname()[1]}"
    try:
        plain = MooncakeDistributedStore()
        # Without an engine the port is this client's own to take: taken, it fails.
        assert plain.setup(taken, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master) != 0
        s = MooncakeDistributedStore()
        engine = object()  # stands for the TransferEngine SGLang passes
        assert s.setup(taken, "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, engine) == 0
        host = s.get_hostname()
        assert host.startswith("127.0.0.1:") and host != taken, host
        assert s.put("engine-k", b"v") == 0 and s.get("engine-k") == b"v"
        s.remove_all(True)
        s.close()
    finally:
        engine_port.close()


def test_ssd_offload_without_a_path_takes_the_references_variable(master, tmp_path, monkeypatch):
    """`enable_ssd_offload=True` without `ssd_offload_path`: the reference's
    MOONCAKE_OFFLOAD_FILE_STORAGE_PATH names the directory (it used to be -600)."""
    ssd = tmp_path / "ssd"
    monkeypatch.setenv("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", str(ssd))
    s = MooncakeDistributedStore()
    rc = s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, None, enable_ssd_offload=True)
    assert rc == 0
    try:
        assert ssd.is_dir(), "the tier starts in the directory the variable names"
        assert s.put("ssd-k", b"v" * 4096) == 0 and s.get("ssd-k") == b"v" * 4096
    finally:
        s.remove_all(True)
        s.close()


def test_a_tenant_other_than_the_default_is_refused_by_name(master):
    """One namespace of keys: a non-default `tenant_id` would share it with every other
    tenant, so it is a TypeError naming `tenant_id` (SGLang then stops and says tenants
    need another build, rather than mixing tenants' keys); the default is taken."""
    s = MooncakeDistributedStore()
    with pytest.raises(TypeError, match="tenant_id"):
        s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, None, tenant_id="team-a")
    assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master, None, tenant_id="default") == 0
    s.close()


def test_setup_dict_then_positional_on_type_error(master):
    """LMCache's order: the dict form, and the positional form when a build lacks it."""
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 16 << 20,
        "local_buffer_size": 16 << 20,
        "protocol": "tcp",
        "device_name": "",
        "master_server_addr": master,
    }
    s = MooncakeDistributedStore()
    try:
        rc = s.setup(cfg)
    except TypeError:
        rc = s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master)
    assert rc == 0 and s.health_check() == 0
    s.close()


# ---------------------------------------------------------------- get_hostname, placement


def test_get_hostname_names_this_clients_segment(master):
    a, b = connect(master), connect(master)
    try:
        for s in (a, b):
            host = s.get_hostname()
            assert host.startswith("localhost:")
            # LMCache's prefer_local_alloc: preferred_segment = get_hostname().
            cfg = ReplicateConfig()
            cfg.preferred_segment = s.get_hostname()
            key = f"local-{host}"
            assert s.put(key, b"here", cfg) == 0
            [desc] = a.get_replica_desc(key)
            assert desc.segment_name.split("#")[0].rsplit(":", 1)[1] == host.rsplit(":", 1)[1]
        # A preferred segment that is not mounted is skipped, as by the reference.
        unknown = ReplicateConfig()
        unknown.preferred_segment = "nowhere:1"
        assert a.put("unknown-pref", b"x", unknown) == 0 and a.get("unknown-pref") == b"x"
    finally:
        a.remove_all(True)
        a.close()
        b.close()


def test_prefer_alloc_in_same_node_places_on_this_node(master):
    a, b = connect(master), connect(master)
    try:
        cfg = ReplicateConfig()
        cfg.prefer_alloc_in_same_node = True
        assert "prefer_alloc_in_same_node: 1" in str(cfg)
        for i in range(8):
            assert b.put(f"same-{i}", b"x" * 1000, cfg) == 0
            [desc] = b.get_replica_desc(f"same-{i}")
            assert desc.segment_name.split("#")[0].rsplit(":", 1)[1] == b.get_hostname().rsplit(":", 1)[1]
        # As in the reference, it is for one replica only.
        cfg.replica_num = 2
        assert b.put("same-two", b"x", cfg) == INVALID_PARAMS
    finally:
        a.remove_all(True)
        a.close()
        b.close()


def test_group_ids_one_per_key(store):
    cfg = ReplicateConfig()
    assert cfg.group_ids is None
    cfg.group_ids = ["page-0", "page-0"]
    assert "group_ids" in str(cfg)
    assert store.put_batch(["g0", "g1"], [b"a", b"b"], cfg) == 0
    assert store.get_batch(["g0", "g1"]) == [b"a", b"b"]
    assert store.put_batch(["g2", "g3", "g4"], [b"a", b"b", b"c"], cfg) == INVALID_PARAMS
    assert store.put("g5", b"x", cfg) == INVALID_PARAMS
    cfg.group_ids = ["one"]
    assert store.put("g5", b"x", cfg) == 0
    with Registered(store, 4096) as buf:
        buf.write(0, b"y" * 64)
        cfg.group_ids = ["p", "p"]
        assert store.batch_put_from(["g6", "g7"], [buf.ptr, buf.ptr + 32], [32, 32], cfg) == [0, 0]
        cfg.group_ids = ["p"]
        assert store.batch_put_from(["g8", "g9"], [buf.ptr, buf.ptr + 32], [32, 32], cfg) == [INVALID_PARAMS] * 2


# ---------------------------------------------------------------- LMCache's calls


def test_put_parts_and_batch_get_buffer_through_the_buffer_protocol(store):
    """LMCache stores a metadata header and the KV bytes with put_parts, and reads them
    back with batch_get_buffer, then memoryview(handle) and torch.frombuffer(handle)."""
    meta = bytes(range(28))
    kv = memoryview(payload(64 << 10, 1))
    assert store.put_parts("lm", meta, kv) == 0
    [h, missing] = store.batch_get_buffer(["lm", "lm-missing"])
    assert missing is None
    assert isinstance(h, BufferHandle) and isinstance(h, bytes)
    view = memoryview(h)
    assert view.nbytes == len(h) == h.size() == 28 + len(kv)
    assert view[:28] == meta and view[28:] == kv
    assert ctypes.string_at(h.ptr(), 28) == meta
    import numpy as np

    arr = np.frombuffer(h, dtype=np.uint8, offset=28, count=len(kv))
    assert arr.tobytes() == kv.tobytes()
    assert repr(h) == f"<BufferHandle size={len(h)}>"


def test_bind_to_numa_node():
    # Node 0 exists wherever sysfs lists NUMA nodes; binding keeps the thread runnable.
    before = os.sched_getaffinity(0)
    try:
        if os.path.exists("/sys/devices/system/node/node0"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert bind_to_numa_node(0) is None
            assert os.sched_getaffinity(0)
        # An unknown node only warns, as the reference's does.
        with pytest.warns(RuntimeWarning):
            assert bind_to_numa_node(4095) is None
        with pytest.warns(RuntimeWarning):
            bind_to_numa_node(-1)
    finally:
        os.sched_setaffinity(0, before)


# ---------------------------------------------------------------- back-pressure (vLLM)


def test_full_pool_answers_minus_200_per_key():
    """vLLM treats -200 as back-pressure: a put that finds no room says so, for that key
    only, and the store keeps working."""
    proc, addr = start_master()
    try:
        s = MooncakeDistributedStore()
        # No segment anywhere yet: nothing can be placed.
        assert s.setup("localhost", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", addr) == 0
        assert s.put("nowhere", b"x") == NO_AVAILABLE_HANDLE
        s.close()
        s = connect(addr, segment=1 << 20)
        with Registered(s, 4 << 20) as buf:
            buf.write(0, payload(4 << 20, 2))
            got = s.batch_put_from(["too-big", "fits"], [buf.ptr, buf.ptr], [2 << 20, 4096])
            assert got == [NO_AVAILABLE_HANDLE, 0]
            assert s.put_from("too-big", buf.ptr, 2 << 20) == NO_AVAILABLE_HANDLE
            assert s.put_batch(["a", "b"], [b"a", bytes(2 << 20)]) == NO_AVAILABLE_HANDLE
            assert s.get("fits") == buf.read(0, 4096)
        s.remove_all(True)
        s.close()
    finally:
        stop(proc)


# ---------------------------------------------------------------- host memory, dummy client


def test_host_mem_allocator():
    a = MooncakeHostMemAllocator()
    ptr = a.alloc(1 << 20)
    assert ptr != 0 and ptr % 4096 == 0
    assert ctypes.string_at(ptr, 64) == bytes(64)
    ctypes.memmove(ptr + 100, b"written", 7)
    assert ctypes.string_at(ptr + 100, 7) == b"written"
    # Any allocator frees any block (one process-wide pool, as the reference's).
    assert MooncakeHostMemAllocator().free(ptr) == 0
    assert a.free(ptr) == -1
    assert a.alloc(0) == 0
    assert a.free(12345) == -1


def test_setup_dummy_uses_the_storage_process_memory(master, tmp_path, monkeypatch):
    """SGLang's standalone-storage mode: host KV memory from MooncakeHostMemAllocator,
    setup_dummy on the storage process of this host, zero-copy puts and gets that land
    in that process's segment."""
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    node, endpoint = start_storage_node(master, env=env)
    try:
        # It published its master for this user.
        attach = (tmp_path / "mooncake" / f"client-{endpoint.rsplit(':', 1)[1]}.attach").read_text()
        assert f"master={master}" in attach
        alloc = MooncakeHostMemAllocator()
        size = 1 << 20
        ptr = alloc.alloc(size)
        s = MooncakeDistributedStore()
        assert s.setup_dummy(size, 16 << 20, endpoint) == 0
        assert s.get_hostname() == endpoint
        assert s.register_buffer(ptr, size) == 0
        data = payload(size, 3)
        ctypes.memmove(ptr, data, size)
        cfg = ReplicateConfig()
        cfg.prefer_alloc_in_same_node = True
        keys = [f"page-{i}" for i in range(16)]
        page = size // 16
        assert s.batch_put_from(keys, [ptr + i * page for i in range(16)], [page] * 16, cfg) == [0] * 16
        for k in keys:
            [desc] = s.get_replica_desc(k)
            assert desc.get_memory_descriptor().buffer_descriptor.transport_endpoint == endpoint
        ctypes.memset(ptr, 0, size)
        assert s.batch_get_into(keys, [ptr + i * page for i in range(16)], [page] * 16) == [page] * 16
        assert ctypes.string_at(ptr, size) == data
        # Another client (over TCP) reads what the dummy client wrote.
        other = connect(master, segment=0)
        assert other.get("page-3") == data[3 * page : 4 * page]
        other.close()
        s.remove_all(True)
        assert s.unregister_buffer(ptr) == 0
        s.close()
        assert alloc.free(ptr) == 0
    finally:
        stop(node)
    # The storage process stopped cleanly and took its attach file with it.
    assert not (tmp_path / "mooncake" / f"client-{endpoint.rsplit(':', 1)[1]}.attach").exists()


def test_setup_dummy_errors_and_master_from_the_environment(master, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    s = MooncakeDistributedStore()
    # Nothing listens there.
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = f"127.0.0.1:{sock.getsockname()[1]}"
    assert s.setup_dummy(0, 16 << 20, free) == RPC_FAIL
    assert s.setup_dummy(0, 16 << 20, "no-port") == INVALID_PARAMS
    # Something listens but serves no segment (the master itself); no attach file
    # there, so the master comes from $MOONCAKE_MASTER.
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    assert s.setup_dummy(0, 16 << 20, master) == INVALID_PARAMS
    monkeypatch.setenv("MOONCAKE_MASTER", master)
    assert s.setup_dummy(0, 16 << 20, master) == SEGMENT_NOT_FOUND
    assert s.health_check() == 1
    # A storage process started without a runtime directory we can see: found through
    # $MOONCAKE_MASTER.
    node, endpoint = start_storage_node(master, env=dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path / "elsewhere")))
    try:
        assert s.setup_dummy(0, 16 << 20, endpoint) == 0
        assert s.put("env-dummy", b"value") == 0 and s.get("env-dummy") == b"value"
        s.remove_all(True)
        s.close()
    finally:
        stop(node)


# ---------------------------------------------------------------- /get_all_segments


def test_get_all_segments_lists_mounted_segments():
    proc, addr, metrics = start_master_with_metrics()
    url = f"http://{metrics}/get_all_segments"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200 and r.read() == b""
            assert r.headers["Content-Type"].startswith("text/plain")
        a, b = connect(addr), connect(addr)
        with urllib.request.urlopen(url, timeout=10) as r:
            lines = r.read().decode().split("\n")
        assert lines[-1] == "" and len(lines) == 3
        for s in (a, b):
            port = s.get_hostname().rsplit(":", 1)[1]
            assert sum(1 for line in lines if line.split("#")[0].endswith(f":{port}")) == 1
        a.close()
        b.close()
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read() == b""
    finally:
        stop(proc)


# ---------------------------------------------------------------- get sessions (SGLang's direct linker)


def test_layer_wise_loads_through_a_get_session(store):
    """SGLang's direct linker: `batch_get_session_start` over a batch of pages, one
    `batch_get_into_multi_buffer_ranges` per layer (each page's K and V slices of that
    layer into their own places), `batch_get_session_end`. Every answer is what it
    checks: [0] * n, then the sum of each key's sizes, and the bytes land exactly."""
    layers, kv, pages = 4, 1024, 3
    page_len = layers * 2 * kv
    objects = {f"page/{p}": payload(page_len, p) for p in range(pages)}
    for key, value in objects.items():
        assert store.put(key, value) == 0
    keys = list(objects)
    with Registered(store, pages * page_len) as dst:
        assert store.batch_get_session_start(keys) == [0] * pages
        for layer in range(layers):
            # Page p's K of this layer goes to one place, its V to another.
            ptrs = [[dst.ptr + (p * layers + layer) * 2 * kv, dst.ptr + (p * layers + layer) * 2 * kv + kv] for p in range(pages)]
            sizes = [[kv, kv] for _ in range(pages)]
            offsets = [[layer * 2 * kv, layer * 2 * kv + kv] for _ in range(pages)]
            assert store.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offsets) == [2 * kv] * pages
        for p, key in enumerate(keys):
            assert dst.read(p * page_len, page_len) == objects[key], key
        # A slice past the object's end, a pointer outside every registered buffer,
        # and lists that do not match: -600 for that key only.
        assert store.batch_get_into_multi_buffer_ranges(
            keys, [[dst.ptr], [12345], [dst.ptr]], [[kv], [kv], [kv, kv]], [[page_len - kv + 1], [0], [0]]
        ) == [INVALID_PARAMS] * 3
        assert store.batch_get_into_multi_buffer_ranges(keys[:1], [[dst.ptr]], [[kv]], [[0]]) == [kv]
        # The session holds the bytes read at its start, whatever happens to the key.
        assert store.remove(keys[0], True) == 0
        assert store.batch_get_into_multi_buffer_ranges(keys[:1], [[dst.ptr]], [[kv]], [[kv]]) == [kv]
        assert dst.read(0, kv) == objects[keys[0]][kv : 2 * kv]
        assert store.batch_get_session_end(keys) == 0
        # No session (ended, or never started): -600, as in the reference.
        assert store.batch_get_into_multi_buffer_ranges(keys[1:2], [[dst.ptr]], [[kv]], [[0]]) == [INVALID_PARAMS]
        # A key that cannot be read does not start: -704 for a missing object.
        assert store.batch_get_session_start([keys[0], keys[1]]) == [-704, 0]
        assert store.batch_get_into_multi_buffer_ranges([keys[0]], [[dst.ptr]], [[kv]], [[0]]) == [INVALID_PARAMS]
        store.batch_get_session_end([keys[1]])


# ---------------------------------------------------------------- put sessions (vLLM's layer-wise saves)

SESSION_METHODS = (
    "batch_put_session_start",
    "batch_put_from_multi_buffer_ranges",
    "batch_put_session_end",
    "batch_put_session_revoke",
    "batch_get_session_start",
    "batch_get_into_multi_buffer_ranges",
    "batch_get_session_end",
)


def test_layer_wise_saves_through_a_put_session(store):
    """vLLM's Mooncake store connector saves layer by layer when a store has all seven
    session calls: `batch_put_session_start`, one `batch_put_from_multi_buffer_ranges`
    per layer (each key's K and V of that layer, from where the layer keeps them), and
    `batch_put_session_end` after the last layer; a key that failed is revoked."""
    assert all(callable(getattr(store, m)) for m in SESSION_METHODS)
    layers, kv, blocks = 3, 2048, 4
    block_len = layers * 2 * kv
    keys = [f"save/{b}" for b in range(blocks)]
    expected = {k: payload(block_len, 100 + b) for b, k in enumerate(keys)}
    assert store.put("save/exists", b"x") == 0
    with Registered(store, blocks * block_len) as src:
        # Where the layers keep them: layer-major, unlike the objects (key-major).
        for b, k in enumerate(keys):
            for layer in range(layers):
                at = (layer * blocks + b) * 2 * kv
                src.write(at, expected[k][layer * 2 * kv : (layer + 1) * 2 * kv])
        assert store.batch_put_session_start(keys + ["save/exists"], [block_len] * (blocks + 1)) == [0] * blocks + [-705]
        # A session cannot be started twice; a size no object can have is refused.
        too_big = (4 << 30) + 1  # beyond any object: refused before any memory is taken
        assert store.batch_put_session_start([keys[0], "save/empty", "save/huge"], [block_len, 0, too_big]) == [
            INVALID_PARAMS
        ] * 3
        for layer in range(layers):
            ptrs = [[src.ptr + (layer * blocks + b) * 2 * kv, src.ptr + (layer * blocks + b) * 2 * kv + kv] for b in range(blocks)]
            sizes = [[kv, kv]] * blocks
            offsets = [[layer * 2 * kv, layer * 2 * kv + kv]] * blocks
            assert store.batch_put_from_multi_buffer_ranges(keys, ptrs, sizes, offsets) == [2 * kv] * blocks
            # Not readable before its end.
            assert store.is_exist(keys[0]) == 0
        # Out of the object, a pointer in no registered buffer, no session: -600.
        assert store.batch_put_from_multi_buffer_ranges(
            [keys[0], keys[1], "save/none"], [[src.ptr], [12345], [src.ptr]], [[kv], [kv], [kv]], [[block_len - 1], [0], [0]]
        ) == [INVALID_PARAMS] * 3
        assert store.batch_put_session_revoke([keys[3], "save/none"]) == [0, INVALID_PARAMS]
        assert store.batch_put_session_end(keys) == [0, 0, 0, INVALID_PARAMS]
    for k in keys[:3]:
        assert store.get(k) == expected[k], k
    assert store.is_exist(keys[3]) == 0, "a revoked session puts nothing"
    # Ended: its keys are no sessions any more.
    assert store.batch_put_session_end(keys[:1]) == [INVALID_PARAMS]


# ---------------------------------------------------------------- `mooncake.store`, unchanged frameworks

ALIASED = (
    "from mooncake.store import MooncakeDistributedStore as M, ReplicateConfig as C\n"
    "from mooncake.async_store import MooncakeDistributedStoreAsync as A\n"
    "import mooncake_rs.store as ours\n"
    "assert M is ours.MooncakeDistributedStore and C is ours.ReplicateConfig\n"
    "assert A is ours.MooncakeDistributedStoreAsync\n"
)


def python(code, **env):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)


def reference_installed():
    import importlib.util

    return importlib.util.find_spec("mooncake") is not None


def test_install_as_mooncake_names_this_store_mooncake_store():
    """A framework that imports `mooncake.store` gets this store once
    `install_as_mooncake()` ran in its process."""
    done = python("import mooncake_rs\nmooncake_rs.install_as_mooncake()\n" + ALIASED)
    assert done.returncode == 0, done.stderr


def test_the_environment_variable_aliases_every_process_started_with_it():
    """`MOONCAKE_RS_AS_MOONCAKE=1`: every interpreter started with it (a framework's
    worker processes too) finds this store as `mooncake.store`, through the `.pth` file
    the wheel installs; without it nothing changes."""
    import site

    places = site.getsitepackages() + [site.getusersitepackages()]
    if not any(os.path.exists(os.path.join(p, "mooncake_rs_alias.pth")) for p in places):
        pytest.skip("mooncake_rs_alias.pth is installed by the wheel (`maturin develop` leaves it out)")
    aliased = python(ALIASED, MOONCAKE_RS_AS_MOONCAKE="1")
    assert aliased.returncode == 0, aliased.stderr
    if not reference_installed():
        plain = python("import mooncake.store", MOONCAKE_RS_AS_MOONCAKE="0")
        assert plain.returncode != 0 and "No module named 'mooncake'" in plain.stderr, plain.stderr
