#!/usr/bin/env python3
"""LMCache's `mooncakestore://` backend, call for call, against a real master.

LMCache's connector (`lmcache/v1/storage_backend/connector/mooncakestore_connector.py`)
reads a JSON config, binds the process to the GPU's NUMA node
(`mooncake.store.bind_to_numa_node`), connects with the 7 positional arguments of
`setup`, places on its own segment (`ReplicateConfig.preferred_segment =
get_hostname()`) when `prefer_local_alloc` is set, and registers its pinned CPU
buffer. Then, per chunk of KV:

- with `save_chunk_meta` (the default): `put_parts(key, metadata, kv_bytes)` to save,
  `batch_get_buffer(keys)` to load, read through `memoryview(handle)` and
  `torch.frombuffer(handle, offset=...)` (here `numpy.frombuffer`, same protocol);
- without it: `batch_put_from` / `put_from` from the registered buffer, and
  `batch_get_into` straight into it, with a short last chunk;
- page-first: `batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`;
- lookups: `batch_is_exist`, `is_exist`; the L2 adapter's `setup(dict)` (positional on
  `TypeError`), `put_from`, `get_into`, `remove(key, True)`.

Calls run through `asyncio.to_thread`, as LMCache runs them. Every byte is checked.

    python examples/python/lmcache_backend.py         # starts its own mooncake-master
"""

import asyncio
import ctypes
import json
import os
import pathlib
import random
import socket
import struct
import subprocess
import sys
import tempfile

import numpy as np

from mooncake_rs.store import MooncakeDistributedStore, ReplicateConfig  # was: mooncake.store

CHUNK_TOKENS = 256
TOKEN_BYTES = 2 * 4 * 128 * 2  # K and V, 4 heads of 128 bf16 elements
CHUNK_BYTES = CHUNK_TOKENS * TOKEN_BYTES
METADATA_BYTES = 28  # LMCache's RemoteMetadata: length, format, dtype, shape[4]


def remote_metadata(length, shape, dtype_code, fmt):
    return struct.pack("<7i", length, fmt, dtype_code, *shape)


def parse_metadata(view):
    length, fmt, dtype_code, *shape = struct.unpack("<7i", view)
    return length, fmt, dtype_code, shape


class LocalCPUBackend:
    """LMCache's pinned CPU buffer, chunk slots handed out in order."""

    def __init__(self, chunks):
        self.buffer = (ctypes.c_ubyte * (chunks * CHUNK_BYTES))()
        self.ptr = ctypes.addressof(self.buffer)
        self.next = 0

    def allocate(self):
        slot = self.ptr + self.next * CHUNK_BYTES
        self.next += 1
        return slot


class MooncakestoreConnector:
    def __init__(self, config_path, cpu):
        with open(config_path) as f:
            self.config = json.load(f)
        try:
            from mooncake_rs.store import bind_to_numa_node  # LMCache: from mooncake.store

            if os.path.exists("/sys/devices/system/node/node0"):
                bind_to_numa_node(0)
        except ImportError:
            pass
        self.store = MooncakeDistributedStore()
        status = self.store.setup(
            self.config["local_hostname"],
            self.config["metadata_server"],
            self.config["global_segment_size"],
            self.config["local_buffer_size"],
            self.config["protocol"],
            self.config["device_name"],
            self.config["master_server_address"],
        )
        if status not in (None, 0):
            raise SystemExit(f"Mooncake setup failed: status={status}")
        self.replica_config = ReplicateConfig()
        self.replica_config.replica_num = 1
        if self.config.get("mooncake_prefer_local_alloc"):
            self.replica_config.preferred_segment = self.store.get_hostname()
        self.cpu = cpu
        result = self.store.register_buffer(cpu.ptr, len(cpu.buffer))
        assert result == 0, result

    # save_chunk_meta=True: metadata stored with the data
    async def put_with_metadata(self, key, kv_bytes):
        meta = remote_metadata(len(kv_bytes), [2, CHUNK_TOKENS, 4, 128], 12, 1)
        status = await asyncio.to_thread(self.store.put_parts, key, meta, kv_bytes)
        assert status == 0, status

    async def batch_get_buffer(self, keys):
        buffers = await asyncio.to_thread(self.store.batch_get_buffer, keys)
        out = []
        for buffer in buffers:
            if buffer is None:
                out.append(None)
                continue
            view = memoryview(buffer)
            length, _, _, shape = parse_metadata(view[:METADATA_BYTES])
            assert len(view) == length + METADATA_BYTES and shape == [2, CHUNK_TOKENS, 4, 128]
            # LMCache: torch.frombuffer(buffer, dtype=torch.uint8, offset=..., count=...)
            slot = self.cpu.allocate()
            temp = np.frombuffer(buffer, dtype=np.uint8, offset=METADATA_BYTES, count=length)
            ctypes.memmove(slot, temp.ctypes.data, length)
            out.append((slot, length))
        return out

    # save_chunk_meta=False: zero copy from and into the registered buffer
    async def batched_put_zero_copy(self, keys, slots, sizes):
        statuses = await asyncio.to_thread(self.store.batch_put_from, keys, slots, sizes, self.replica_config)
        assert statuses == [0] * len(keys), statuses

    async def put_without_metadata(self, key, slot, size):
        status = await asyncio.to_thread(self.store.put_from, key, slot, size, self.replica_config)
        assert status == 0, status

    async def batch_get_into(self, keys):
        slots = [self.cpu.allocate() for _ in keys]
        read = await asyncio.to_thread(self.store.batch_get_into, keys, slots, [CHUNK_BYTES] * len(keys))
        return list(zip(slots, read))

    def batched_contains(self, keys):
        hits = 0
        for r in self.store.batch_is_exist(keys):
            if r != 1:
                break
            hits += 1
        return hits

    async def close(self):
        assert self.store.unregister_buffer(self.cpu.ptr) == 0
        self.store.close()


def l2_adapter(master):
    """LMCache's Python L2 adapter: setup(dict) (positional on TypeError), put_from,
    get_into, remove(key, True)."""
    cfg = {
        "local_hostname": "localhost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 64 << 20,
        "local_buffer_size": 16 << 20,
        "protocol": "tcp",
        "rdma_devices": "",
        "master_server_addr": master,
    }
    store = MooncakeDistributedStore()
    try:
        rc = store.setup(cfg)
    except TypeError:
        rc = store.setup(*cfg.values())
    assert rc == 0, rc
    buf = (ctypes.c_ubyte * (2 * CHUNK_BYTES))()
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, len(buf)) == 0
    data = random.Random("l2").randbytes(CHUNK_BYTES)
    ctypes.memmove(ptr, data, CHUNK_BYTES)
    assert store.put_from("l2/obj", ptr, CHUNK_BYTES) == 0
    assert store.get_into("l2/obj", ptr + CHUNK_BYTES, CHUNK_BYTES) == CHUNK_BYTES
    assert ctypes.string_at(ptr + CHUNK_BYTES, CHUNK_BYTES) == data
    assert store.remove("l2/obj", True) == 0
    assert store.unregister_buffer(ptr) == 0
    store.close()


async def scenario(config_path, master):
    producer = MooncakestoreConnector(config_path, LocalCPUBackend(64))
    consumer = MooncakestoreConnector(config_path, LocalCPUBackend(64))
    rng = random.Random(7)

    # 1. Chunks with their metadata (put_parts), loaded with batch_get_buffer.
    keys = [f"lmcache@model@0@meta{i}" for i in range(6)]
    chunks = [rng.randbytes(CHUNK_BYTES) for _ in keys]
    for k, c in zip(keys, chunks):
        await producer.put_with_metadata(k, memoryview(c))
    assert consumer.batched_contains(keys + ["missing"]) == 6
    got = await consumer.batch_get_buffer(keys + ["lmcache@model@0@missing"])
    assert got[-1] is None
    for (slot, length), c in zip(got[:-1], chunks):
        assert ctypes.string_at(slot, length) == c, "chunk bytes differ"
    print(f"{len(keys)} chunks with metadata: put_parts / batch_get_buffer, every byte checked")

    # 2. Zero copy: batch_put_from / put_from from the registered buffer, the last chunk
    # of a request short; batch_get_into into other slots.
    zkeys = [f"lmcache@model@0@zc{i}" for i in range(5)]
    slots = [producer.cpu.allocate() for _ in zkeys]
    sizes = [CHUNK_BYTES] * 4 + [37 * TOKEN_BYTES]
    for s, n in zip(slots, sizes):
        ctypes.memmove(s, rng.randbytes(n), n)
    await producer.batched_put_zero_copy(zkeys[:4], slots[:4], sizes[:4])
    await producer.put_without_metadata(zkeys[4], slots[4], sizes[4])
    assert consumer.store.is_exist(zkeys[4]) == 1
    for (slot, n_read), src, n in zip(await consumer.batch_get_into(zkeys), slots, sizes):
        assert n_read == n, (n_read, n)
        assert ctypes.string_at(slot, n) == ctypes.string_at(src, n), "zero-copy bytes differ"
    print(f"{len(zkeys)} chunks zero-copy (last one {sizes[-1]} B): every byte checked")

    # 3. Page-first: one object per page made of one buffer per layer.
    layers, layer_bytes = 4, 8 * TOKEN_BYTES
    page_keys = [f"lmcache@model@0@page{i}" for i in range(3)]
    src = [[producer.cpu.allocate() for _ in range(layers)] for _ in page_keys]
    for page in src:
        for p in page:
            ctypes.memmove(p, rng.randbytes(layer_bytes), layer_bytes)
    sizes = [[layer_bytes] * layers for _ in page_keys]
    statuses = await asyncio.to_thread(
        producer.store.batch_put_from_multi_buffers, page_keys, src, sizes, producer.replica_config
    )
    assert statuses == [0] * 3, statuses
    dst = [[consumer.cpu.allocate() for _ in range(layers)] for _ in page_keys]
    got = await asyncio.to_thread(consumer.store.batch_get_into_multi_buffers, page_keys, dst, sizes)
    assert got == [layers * layer_bytes] * 3, got
    for sp, dp in zip(src, dst):
        for s, d in zip(sp, dp):
            assert ctypes.string_at(s, layer_bytes) == ctypes.string_at(d, layer_bytes), "page bytes differ"
    print("3 page-first objects x 4 layers: every byte checked")

    # prefer_local_alloc: what the producer wrote with its ReplicateConfig is on its own
    # segment (put_parts takes no config in LMCache's calls).
    port = producer.store.get_hostname().rsplit(":", 1)[1]
    for k in zkeys + page_keys:
        [desc] = producer.store.get_replica_desc(k)
        assert desc.segment_name.split("#")[0].endswith(f":{port}"), desc

    l2_adapter(master)
    print("L2 adapter: setup(dict), put_from / get_into / remove: every byte checked")
    await consumer.close()
    await producer.close()


def find_master():
    binary = os.environ.get("MOONCAKE_MASTER")
    if binary and "/" in binary:
        return binary
    root = pathlib.Path(__file__).resolve().parents[2]
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
    found = [p for p in (target / "release" / "mooncake-master", target / "debug" / "mooncake-master") if p.exists()]
    if not found:
        raise SystemExit("no mooncake-master: cargo build -p mooncake-cli")
    return str(max(found, key=lambda p: p.stat().st_mtime))


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        master = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen([find_master(), "--listen", master], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert "listening on" in proc.stdout.readline()
        with tempfile.TemporaryDirectory() as d:
            config_path = os.path.join(d, "mooncake.json")
            with open(config_path, "w") as f:
                json.dump(
                    {
                        "local_hostname": "localhost",
                        "metadata_server": "P2PHANDSHAKE",
                        "global_segment_size": 64 << 20,
                        "local_buffer_size": 16 << 20,
                        "protocol": "tcp",
                        "device_name": "",
                        "master_server_address": master,
                        "mooncake_prefer_local_alloc": True,
                    },
                    f,
                )
            asyncio.run(scenario(config_path, master))
        print("ok")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
