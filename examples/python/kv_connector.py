#!/usr/bin/env python3
"""Per-layer KV blocks through Mooncake Store, the way a vLLM store connector moves them.

An inference engine keeps its KV cache as one tensor per layer, each cut into blocks
(block i of every layer holds the same tokens). A connector saves a request's blocks
under one key per chunk of tokens, each key's value being that chunk's block from
every layer (`batch_put_from_multi_buffers`: one buffer per layer, no copy into a
staging area); before computing a new request it asks which chunks are stored
(`batch_is_exist`) and loads the longest stored prefix straight into freshly
allocated blocks (`batch_get_into_multi_buffers`).

Here a "producer" engine saves two requests, and a "consumer" engine in another client
(no segment of its own, so every byte crosses TCP) reloads them into different block
ids and checks every byte.

GPU mode (`--gpu`): the per-layer KV tensors are CUDA tensors (torch), registered by
`data_ptr()` as vLLM does; the same calls move their blocks with device copies. It
needs torch and a CUDA device, and says it skipped GPU mode where there is none.
`--emulate-gpu` runs the same device path over host memory declared to the store as
GPU memory (a test of the binding's logic, not a GPU result).

    python examples/python/kv_connector.py                  # starts its own mooncake-master
    python examples/python/kv_connector.py --master HOST:PORT
    python examples/python/kv_connector.py --gpu            # CUDA tensors, if present
"""

import argparse
import ctypes
import hashlib
import os
import pathlib
import random
import socket
import subprocess
import sys

from mooncake_rs.store import MooncakeDistributedStore  # was: from mooncake.store import ...

LAYERS = 8
BLOCK_TOKENS = 16
BLOCK_BYTES = 2 * 8 * 128 * BLOCK_TOKENS  # K and V, 8 heads of 128 bytes per token
NUM_BLOCKS = 64


class HostLayers:
    """KV tensors in host memory."""

    def __init__(self, store):
        self.bufs = [(ctypes.c_ubyte * (NUM_BLOCKS * BLOCK_BYTES))() for _ in range(LAYERS)]
        self.ptrs = [ctypes.addressof(b) for b in self.bufs]

    def write(self, ptr, data):
        ctypes.memmove(ptr, data, len(data))

    def read(self, ptr, n):
        return ctypes.string_at(ptr, n)


class EmulatedGpuLayers(HostLayers):
    """Host memory declared to the store as GPU memory: moved by the device path."""

    def __init__(self, store):
        super().__init__(store)
        for ptr in self.ptrs:
            assert store._emulate_device_memory(ptr, NUM_BLOCKS * BLOCK_BYTES, 0) == 0


class CudaLayers:
    """KV tensors on the GPU (torch CUDA tensors, addressed by `data_ptr()`)."""

    def __init__(self, store):
        import torch

        self.torch = torch
        self.tensors = [torch.zeros(NUM_BLOCKS * BLOCK_BYTES, dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
        self.ptrs = [t.data_ptr() for t in self.tensors]

    def _view(self, ptr, n):
        # The tensor holding `ptr`: the one starting last at or before it.
        i = max((p, i) for i, p in enumerate(self.ptrs) if p <= ptr)[1]
        off = ptr - self.ptrs[i]
        return self.tensors[i][off : off + n]

    def write(self, ptr, data):
        self._view(ptr, len(data)).copy_(self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8))
        self.torch.cuda.synchronize()

    def read(self, ptr, n):
        self.torch.cuda.synchronize()
        return self._view(ptr, n).cpu().numpy().tobytes()


def cuda_missing():
    """Why CUDA tensors cannot be used here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch finds no CUDA device"
    return None


class Engine:
    """One inference engine's KV cache (a registered tensor per layer) and its client."""

    def __init__(self, name, master, segment, memory=HostLayers):
        self.name = name
        self.store = MooncakeDistributedStore()
        rc = self.store.setup("localhost", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master)
        if rc != 0:
            raise SystemExit(f"{name}: setup failed with {rc}")
        self.memory = memory(self.store)
        for ptr in self.memory.ptrs:
            assert self.store.register_buffer(ptr, NUM_BLOCKS * BLOCK_BYTES) == 0
        self.free = list(range(NUM_BLOCKS))

    def allocate(self, n):
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def block_ptrs(self, block):
        """Where `block` lives in every layer: the multi-buffer list of one key."""
        return [ptr + block * BLOCK_BYTES for ptr in self.memory.ptrs]

    def fill(self, block, seed):
        """Computes (here: makes up) the KV of one block in every layer."""
        for layer, ptr in enumerate(self.block_ptrs(block)):
            self.memory.write(ptr, random.Random(f"{seed}/{layer}").randbytes(BLOCK_BYTES))

    def block_bytes(self, block):
        return [self.memory.read(p, BLOCK_BYTES) for p in self.block_ptrs(block)]

    # ------------------------------------------------------------ connector calls

    def lookup(self, keys):
        """How many leading chunks are stored (the reusable prefix)."""
        hits = 0
        for found in self.store.batch_is_exist(keys):
            if found != 1:
                break
            hits += 1
        return hits

    def save(self, keys, blocks):
        ptrs = [self.block_ptrs(b) for b in blocks]
        sizes = [[BLOCK_BYTES] * LAYERS for _ in blocks]
        codes = self.store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        if any(c != 0 for c in codes):
            raise SystemExit(f"{self.name}: save failed: {codes}")

    def load(self, keys, blocks):
        ptrs = [self.block_ptrs(b) for b in blocks]
        sizes = [[BLOCK_BYTES] * LAYERS for _ in blocks]
        got = self.store.batch_get_into_multi_buffers(keys, ptrs, sizes)
        if any(n != LAYERS * BLOCK_BYTES for n in got):
            raise SystemExit(f"{self.name}: load failed: {got}")

    def close(self):
        for ptr in self.memory.ptrs:
            self.store.unregister_buffer(ptr)
        self.store.close()


def chunk_keys(tokens):
    """One key per block of tokens, naming the whole prefix up to it (as vLLM's hashes do)."""
    keys, h = [], hashlib.sha256()
    for i in range(0, len(tokens) - len(tokens) % BLOCK_TOKENS, BLOCK_TOKENS):
        h.update(repr(tokens[i : i + BLOCK_TOKENS]).encode())
        keys.append(f"kv/{h.hexdigest()[:32]}")
    return keys


def start_master():
    """Starts a mooncake-master on a free loopback port: $MOONCAKE_MASTER or a cargo build."""
    binary = os.environ.get("MOONCAKE_MASTER")
    if not binary:
        root = pathlib.Path(__file__).resolve().parents[2]
        target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", root / "target"))
        found = [p for p in (target / "release" / "mooncake-master", target / "debug" / "mooncake-master") if p.exists()]
        if not found:
            raise SystemExit("no mooncake-master: cargo build --release -p mooncake-cli, or pass --master")
        binary = str(max(found, key=lambda p: p.stat().st_mtime))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen([binary, "--listen", addr], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if "listening on" not in proc.stdout.readline():
        raise SystemExit("mooncake-master did not start")
    return proc, addr


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--master", help="host:port of a running mooncake-master (default: start one)")
    ap.add_argument("--gpu", action="store_true", help="KV tensors on the GPU (needs torch and a CUDA device)")
    ap.add_argument(
        "--emulate-gpu", action="store_true", help="the GPU mode's calls over host memory declared as GPU memory"
    )
    args = ap.parse_args()
    memory, mode = HostLayers, "host memory"
    if args.gpu:
        why = cuda_missing()
        if why is not None:
            print(f"GPU mode skipped: {why}")
            return 0
        memory, mode = CudaLayers, "CUDA tensors"
    elif args.emulate_gpu:
        memory, mode = EmulatedGpuLayers, "emulated GPU memory (not a GPU result)"
    proc, master = (None, args.master) if args.master else start_master()
    try:
        producer = Engine("producer", master, segment=64 << 20, memory=memory)
        consumer = Engine("consumer", master, segment=0, memory=memory)

        # Request A: nothing stored yet; compute its 12 blocks and save them.
        tokens_a = list(range(12 * BLOCK_TOKENS))
        keys_a = chunk_keys(tokens_a)
        assert producer.lookup(keys_a) == 0
        blocks_a = producer.allocate(len(keys_a))
        for key, block in zip(keys_a, blocks_a):
            producer.fill(block, key)
        producer.save(keys_a, blocks_a)

        # Request B shares A's first 8 blocks of tokens, then diverges.
        tokens_b = tokens_a[: 8 * BLOCK_TOKENS] + [t + 10_000 for t in range(6 * BLOCK_TOKENS)]
        keys_b = chunk_keys(tokens_b)
        hit = producer.lookup(keys_b)
        assert hit == 8, hit
        blocks_b = producer.allocate(len(keys_b) - hit)
        for key, block in zip(keys_b[hit:], blocks_b):
            producer.fill(block, key)
        producer.save(keys_b[hit:], blocks_b)

        # The consumer reloads both requests into its own (different) blocks.
        for name, keys, source_blocks in (
            ("A", keys_a, blocks_a),
            ("B", keys_b, blocks_a[:hit] + blocks_b),
        ):
            assert consumer.lookup(keys) == len(keys)
            consumer.allocate(3)  # other requests' blocks: ids differ from the producer's
            blocks = consumer.allocate(len(keys))
            consumer.load(keys, blocks)
            for src, dst in zip(source_blocks, blocks):
                assert consumer.block_bytes(dst) == producer.block_bytes(src), f"request {name}: bytes differ"
            print(
                f"request {name}: {len(keys)} chunks x {LAYERS} layers x {BLOCK_BYTES} B reloaded "
                f"in {mode}, every byte checked"
            )
            if memory is not HostLayers:
                direct, staged = consumer.store._device_bytes()
                assert direct + staged >= len(keys) * LAYERS * BLOCK_BYTES, "the device path was not taken"

        consumer.close()
        producer.close()  # its segment, and the objects on it, leave the pool
        print("ok")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
