#!/usr/bin/env python3
"""SGLang HiCache's Mooncake backend, call for call, against a real master.

SGLang keeps a host KV pool (L2) that it backs with Mooncake Store (L3). Its backend
(`mem_cache/storage/mooncake_store/mooncake_store.py`) allocates the pool with
`MooncakeHostMemAllocator`, waits on the master's `/get_all_segments` for storage to
come up, connects with `setup(7 positional, engine, **kwargs)` (retrying without the
keywords a build rejects with TypeError) or, in standalone-storage mode, `setup_dummy` against a
storage process on the same host, warms up, registers the pool, and then moves pages:
`batch_is_exist` + `batch_put_from` (with `ReplicateConfig.group_ids` when group
semantics are on) to back pages up, `batch_is_exist` to find the stored prefix,
`batch_get_into` to load it, the multi-buffer forms for layer-first MLA pools, and
`remove_all` to clear. This script replays those calls with the same key scheme
(`{tag}_{page}_{rank}_k` / `_v`), with numpy arrays where SGLang has torch tensors over
the same memory, and checks every byte that comes back.

    python examples/python/sglang_hicache.py          # starts a master and a storage node
"""

import ctypes
import os
import pathlib
import random
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np

from mooncake_rs.store import (  # was: from mooncake.store import ...
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
)

DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024 * 1024
PAGE_SIZE = 16  # tokens per page
LAYERS, HEADS, HEAD_DIM = 4, 2, 64  # bf16 elements: 2 bytes each
NUM_PAGES = 32


class HostKVPool:
    """SGLang's MHA host pool, page_first layout: [2 (K/V), tokens, layers, heads, dim]
    of 2-byte elements, allocated by MooncakeHostTensorAllocator (shared memory)."""

    def __init__(self, num_pages):
        self.allocator = MooncakeHostMemAllocator()
        self.page_bytes = PAGE_SIZE * LAYERS * HEADS * HEAD_DIM * 2
        self.size = 2 * num_pages * self.page_bytes
        self.ptr = self.allocator.alloc(self.size)
        assert self.ptr, "MooncakeHostMemAllocator.alloc failed"
        c_array = (ctypes.c_byte * self.size).from_address(self.ptr)
        # SGLang: torch.frombuffer(c_array, dtype=torch.uint8).view(dtype).view(dims)
        self.kv_buffer = np.frombuffer(c_array, dtype=np.uint16).reshape(2, num_pages * PAGE_SIZE, LAYERS, HEADS, HEAD_DIM)
        self.num_pages = num_pages

    def get_page_buffer_meta(self, indices):
        """Pointers and sizes of the K and V objects of each page, in key order."""
        ptrs, sizes = [], []
        for first_token in indices[::PAGE_SIZE]:
            page = first_token // PAGE_SIZE
            ptrs.append(self.ptr + page * self.page_bytes)
            ptrs.append(self.ptr + (self.num_pages + page) * self.page_bytes)
            sizes += [self.page_bytes, self.page_bytes]
        return ptrs, sizes

    def page(self, page):
        return bytes(self.kv_buffer[:, page * PAGE_SIZE : (page + 1) * PAGE_SIZE].tobytes())

    def fill(self, pages, seed):
        for p in pages:
            data = random.Random(f"{seed}/{p}").randbytes(2 * self.page_bytes)
            self.kv_buffer[:, p * PAGE_SIZE : (p + 1) * PAGE_SIZE] = np.frombuffer(data, np.uint16).reshape(
                2, PAGE_SIZE, LAYERS, HEADS, HEAD_DIM
            )

    def free(self):
        del self.kv_buffer
        assert self.allocator.free(self.ptr) == 0


class MooncakeHiCacheBackend:
    """The calls of SGLang's MooncakeStore, in its order."""

    def __init__(self, config, pool, tp_rank=0, tp_size=1, group_semantics=True):
        self.config, self.pool, self.local_rank = config, pool, tp_rank
        self.store = MooncakeDistributedStore()
        self.supports_group_ids = hasattr(ReplicateConfig, "group_ids")
        self.use_group_semantics = group_semantics and self.supports_group_ids
        self.config_prefix = config.get("extra_backend_tag")
        if config.get("check_server"):
            self.check_server()
        if config.get("standalone_storage"):
            ret = self.store.setup_dummy(pool.size, DEFAULT_LOCAL_BUFFER_SIZE, config["client_server_address"])
        else:
            setup_kwargs = {}
            if config.get("enable_ssd_offload"):
                setup_kwargs["enable_ssd_offload"] = True
            if config.get("ssd_offload_path") is not None:
                setup_kwargs["ssd_offload_path"] = config["ssd_offload_path"]
            if config.get("tenant_id", "default") != "default":
                setup_kwargs["tenant_id"] = config["tenant_id"]
            while True:
                try:
                    ret = self.store.setup(
                        config["local_hostname"],
                        config["metadata_server"],
                        config["global_segment_size"] // tp_size,
                        DEFAULT_LOCAL_BUFFER_SIZE,
                        config["protocol"],
                        config["device_name"],
                        config["master_server_address"],
                        None,  # transfer engine to share: none
                        **setup_kwargs,
                    )
                    break
                except TypeError as e:
                    unsupported = [k for k in list(setup_kwargs) if k in str(e)]
                    if not unsupported:
                        raise
                    for k in unsupported:
                        setup_kwargs.pop(k)
        if ret:
            raise SystemExit(f"Failed to setup Mooncake store, error code: {ret}")
        self.warmup()
        self.register_mem_pool_host()

    def check_server(self):
        master_ip = self.config["master_server_address"].split(":")[0]
        url = f"http://{master_ip}:{self.config['master_metrics_port']}/get_all_segments"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=3) as resp:
                    if resp.read().decode() != "":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit("Launch mooncake store server timeout")

    def warmup(self):
        key = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex
        value = bytes(4 * 1024)
        for _ in range(10):
            if self.store.put(key, value) == 0:
                break
            time.sleep(1.0)
        else:
            raise SystemExit("Warmup put failed")
        assert self.store.is_exist(key) == 1
        assert self.store.get(key) == value

    def register_mem_pool_host(self):
        ret = self.store.register_buffer(self.pool.ptr, self.pool.size)
        if ret != 0:
            raise SystemExit(f"Failed to register buffer, error code: {ret}")

    def _tag_keys(self, keys):
        return keys if self.config_prefix is None else [f"{self.config_prefix}_{k}" for k in keys]

    def _key_strs(self, keys):
        return [f"{k}_{self.local_rank}_{kv}" for k in keys for kv in ("k", "v")]

    def _put_batch_zero_copy_impl(self, keys, ptrs, sizes, group_ids=None):
        if self.use_group_semantics and group_ids is not None:
            config = ReplicateConfig()
            config.group_ids = group_ids
            return self.store.batch_put_from(keys, ptrs, sizes, config)
        return self.store.batch_put_from(keys, ptrs, sizes)

    def batch_set_v1(self, keys, host_indices):
        keys = self._tag_keys(keys)
        key_strs = self._key_strs(keys)
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        group_ids = [f"sglang-hicache:{k}" for k in keys for _ in range(2)]
        exist = self.store.batch_is_exist(key_strs)
        todo = [i for i, e in enumerate(exist) if e != 1]
        results = [0 if e == 1 else -1 for e in exist]
        if todo:
            put = self._put_batch_zero_copy_impl(
                [key_strs[i] for i in todo],
                [ptrs[i] for i in todo],
                [sizes[i] for i in todo],
                [group_ids[i] for i in todo],
            )
            for i, r in zip(todo, put):
                results[i] = r
        return [k == 0 and v == 0 for k, v in zip(results[::2], results[1::2])]

    def batch_exists(self, keys):
        query = self._key_strs(self._tag_keys(keys))
        exist = self.store.batch_is_exist(query)
        for i, e in enumerate(exist):
            if e != 1:
                return i // 2
        return len(query) // 2

    def batch_get_v1(self, keys, host_indices):
        key_strs = self._key_strs(self._tag_keys(keys))
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        got = self.store.batch_get_into(key_strs, ptrs, sizes)
        return [k > 0 and v > 0 for k, v in zip(got[::2], got[1::2])]

    def clear(self):
        self.store.remove_all()


def mla_layer_first_round_trip(store, prefix):
    """A layer-first MLA pool: one object per page made of one buffer per layer
    (batch_put_from_multi_buffers / batch_get_into_multi_buffers)."""
    layer_bytes, pages = PAGE_SIZE * 576 * 2, 4
    src = [(ctypes.c_ubyte * (pages * layer_bytes))() for _ in range(LAYERS)]
    dst = [(ctypes.c_ubyte * (pages * layer_bytes))() for _ in range(LAYERS)]
    for i, layer in enumerate(src + dst):
        assert store.register_buffer(ctypes.addressof(layer), len(layer)) == 0
        if i < LAYERS:
            ctypes.memmove(layer, random.Random(i).randbytes(len(layer)), len(layer))
    keys = [f"{prefix}_mla_page{p}__k" for p in range(pages)]
    ptrs = [[ctypes.addressof(layer) + p * layer_bytes for layer in src] for p in range(pages)]
    sizes = [[layer_bytes] * LAYERS for _ in range(pages)]
    config = ReplicateConfig()
    config.group_ids = [f"sglang-hicache:{k}" for k in keys]
    assert store.batch_put_from_multi_buffers(keys, ptrs, sizes, config) == [0] * pages
    back = [[ctypes.addressof(layer) + (pages - 1 - p) * layer_bytes for layer in dst] for p in range(pages)]
    assert store.batch_get_into_multi_buffers(keys, back, sizes) == [LAYERS * layer_bytes] * pages
    for p in range(pages):
        for s_layer, d_layer in zip(src, dst):
            a = ctypes.string_at(ctypes.addressof(s_layer) + p * layer_bytes, layer_bytes)
            b = ctypes.string_at(ctypes.addressof(d_layer) + (pages - 1 - p) * layer_bytes, layer_bytes)
            assert a == b, "MLA page bytes differ"
    for layer in src + dst:
        assert store.unregister_buffer(ctypes.addressof(layer)) == 0


def find_binary(name):
    env = {"mooncake-master": "MOONCAKE_MASTER"}.get(name)
    if env and os.environ.get(env) and "/" in os.environ[env]:
        return str(pathlib.Path(os.environ[env]).with_name(name))
    root = pathlib.Path(__file__).resolve().parents[2]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    found = [p for p in (target / "release" / name, target / "debug" / name) if p.exists()]
    if not found:
        raise SystemExit(f"no {name}: cargo build -p mooncake-cli")
    return str(max(found, key=lambda p: p.stat().st_mtime))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    master = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        # Short read leases: `clear` (remove_all) skips objects a read still holds.
        [find_binary("mooncake-master"), "--listen", master, "--metrics-listen", "127.0.0.1:0", "--default-lease-ms", "100"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    node = None
    try:
        assert "listening on" in proc.stdout.readline()
        metrics = proc.stdout.readline().split()[-1]
        config = {
            "local_hostname": "localhost",
            "metadata_server": "P2PHANDSHAKE",
            "global_segment_size": 256 << 20,
            "protocol": "tcp",
            "device_name": "",
            "master_server_address": master,
            "master_metrics_port": int(metrics.rsplit(":", 1)[1]),
            "ssd_offload_path": "",
            "check_server": True,
            "extra_backend_tag": "example",
        }
        # The storage process of this host (SGLang's standalone-storage mode attaches to it).
        node = subprocess.Popen(
            [find_binary("mooncake-client"), "serve", "--master", master, "--listen", "127.0.0.1:0", "--segment-size", "64MiB"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        node_endpoint = node.stdout.readline().split()[-1]

        # Instance A: TP rank 0 of a model, a full client, group semantics on.
        pool_a = HostKVPool(NUM_PAGES)
        a = MooncakeHiCacheBackend(config, pool_a, tp_rank=0, tp_size=1)
        keys = [f"page{i:03d}" for i in range(12)]
        pool_a.fill(range(12), "prefix")
        indices = list(range(12 * PAGE_SIZE))
        assert a.batch_set_v1(keys, indices) == [True] * 12
        # A second backup of the same pages is a no-op (batch_is_exist finds them).
        assert a.batch_set_v1(keys, indices) == [True] * 12
        assert a.batch_exists(keys + ["page999"]) == 12

        # Instance B: standalone storage (setup_dummy on the storage process), its own
        # host pool; it loads A's prefix into other page slots and checks every byte.
        pool_b = HostKVPool(NUM_PAGES)
        b = MooncakeHiCacheBackend(dict(config, standalone_storage=True, client_server_address=node_endpoint), pool_b)
        hit = b.batch_exists(keys)
        assert hit == 12, hit
        slots = [NUM_PAGES - 1 - i for i in range(hit)]
        b_indices = [s * PAGE_SIZE + t for s in slots for t in range(PAGE_SIZE)]
        assert b.batch_get_v1(keys[:hit], b_indices) == [True] * hit
        for i, slot in enumerate(slots):
            assert pool_b.page(slot) == pool_a.page(i), f"page {i}: bytes differ"
        print(f"{hit} pages x 2 objects x {pool_a.page_bytes} B reloaded by a standalone instance, every byte checked")

        # B backs up new pages through the storage process's memory; A reads them.
        pool_b.fill([0, 1], "b-pages")
        assert b.batch_set_v1(["bpage0", "bpage1"], list(range(2 * PAGE_SIZE))) == [True, True]
        assert a.batch_get_v1(["bpage0", "bpage1"], list(range(20 * PAGE_SIZE, 22 * PAGE_SIZE))) == [True, True]
        assert pool_a.page(20) == pool_b.page(0) and pool_a.page(21) == pool_b.page(1)
        mla_layer_first_round_trip(a.store, "example")
        print("standalone backup, layer-first MLA pages: every byte checked")

        time.sleep(0.2)  # the reads' leases run out
        a.clear()
        assert a.batch_exists(keys) == 0
        for backend, pool in ((a, pool_a), (b, pool_b)):
            assert backend.store.unregister_buffer(pool.ptr) == 0
            backend.store.close()
            pool.free()
        print("ok")
    finally:
        for p in (node, proc):
            if p is not None:
                p.terminate()
                p.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
