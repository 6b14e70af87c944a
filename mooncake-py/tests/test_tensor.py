"""The tensor API with numpy arrays (torch is not a dependency; when it imports,
tensors come back as torch tensors and these tests compare through numpy)."""

import ctypes
import struct
import types

import numpy as np
import pytest

from conftest import Registered
from mooncake_rs.store import MooncakeDistributedStore, ReplicateConfig

INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
HEADER = 304
MAGIC = 0x4D4F4F4E
# The reference's dtype numbers.
CODES = {
    "float32": 0,
    "float64": 1,
    "int8": 2,
    "uint8": 3,
    "int16": 4,
    "uint16": 5,
    "int32": 6,
    "uint32": 7,
    "int64": 8,
    "uint64": 9,
    "bool": 10,
    "float16": 11,
}

try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def as_numpy(t):
    return t.numpy() if HAVE_TORCH else t


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(size=shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)


def header(obj):
    """The reference's TensorMetadata fields of a stored object."""
    magic, version, size, dtype, ndim, layout, _, offset, nbytes = struct.unpack_from("<IHHiiIIQQ", obj)
    glob = struct.unpack_from("<8q", obj, 40)
    local = struct.unpack_from("<8q", obj, 104)
    axes = struct.unpack_from("<I", obj, 168)[0]
    return dict(
        magic=magic,
        version=version,
        size=size,
        dtype=dtype,
        ndim=ndim,
        layout=layout,
        offset=offset,
        nbytes=nbytes,
        glob=glob,
        local=local,
        axes=axes,
    )


@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4, 5), (0,), (4, 0, 3)])
def test_round_trip_keeps_dtype_and_shape(store, dtype, shape):
    a = sample(dtype, shape)
    key = f"t-{dtype}-{'x'.join(map(str, shape))}"
    assert store.put_tensor(key, a) == 0
    got = as_numpy(store.get_tensor(key))
    assert got.dtype == a.dtype and got.shape == a.shape
    assert np.array_equal(got, a)
    raw = store.get(key)
    h = header(raw)
    assert (h["magic"], h["version"], h["size"], h["offset"]) == (MAGIC, 1, HEADER, HEADER)
    assert h["dtype"] == CODES[dtype] and h["ndim"] == len(shape) and h["layout"] == 0
    assert h["nbytes"] == a.nbytes == len(raw) - HEADER
    assert h["glob"] == h["local"] == tuple(shape) + (-1,) * (8 - len(shape))
    assert raw[HEADER:] == a.tobytes()


def test_non_contiguous_big_endian_and_views(store):
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    cases = {
        "transposed": base.T,
        "strided": base[::2, 1::3],
        "big-endian": np.arange(12, dtype=">f8").reshape(3, 4),
    }
    for key, a in cases.items():
        assert store.put_tensor(key, a) == 0
        got = as_numpy(store.get_tensor(key))
        assert got.shape == a.shape and np.array_equal(got, a), key
    assert as_numpy(store.get_tensor("big-endian")).dtype == np.dtype("<f8")


def test_numpy_scalars_are_stored_from_memory_that_lives(store):
    """A numpy scalar has no memory of its own: its 0-d array must outlive the write
    (each value read back is its own, not a neighbour's freed and reused bytes)."""
    scalars = [np.float64(1.5), np.float64(2.5), np.int32(7), np.float64(-3.0), np.float32(0.25)]
    keys = [f"scalar-{i}" for i in range(len(scalars))]
    assert store.batch_put_tensor(keys, scalars) == [0] * len(scalars)
    assert store.put_tensor("scalar-one", np.float64(3.25)) == 0
    for key, x in zip(keys + ["scalar-one"], scalars + [np.float64(3.25)]):
        got = as_numpy(store.get_tensor(key))
        assert got.shape == () and got.dtype == x.dtype and got == x, (key, got, x)


def test_refusals(store):
    assert store.put_tensor("bad", b"not a tensor") == INVALID_PARAMS
    assert store.put_tensor("bad", [1, 2, 3]) == INVALID_PARAMS
    assert store.put_tensor("bad", np.zeros(3, dtype=np.complex64)) == INVALID_PARAMS
    assert store.put_tensor("bad", np.array(["text"])) == INVALID_PARAMS
    assert store.put_tensor("bad", np.zeros((1,) * 9)) == INVALID_PARAMS
    assert store.get_tensor("missing") is None
    # An object that is not a tensor is not returned as one.
    assert store.put("plain", b"x" * 400) == 0
    assert store.get_tensor("plain") is None
    assert store.batch_put_tensor(["a", "b"], [np.zeros(1)]) == [INVALID_PARAMS] * 2
    assert store.batch_put_tensor([], []) == []
    s = MooncakeDistributedStore()
    assert s.put_tensor("x", np.zeros(2)) == INVALID_PARAMS
    assert s.get_tensor("x") is None and s.batch_get_tensor(["x", "y"]) == [None, None]


class FakeCudaTensor:
    """What the binding reads of a torch CUDA tensor (module `torch`, device `cuda`),
    over a numpy array's memory that the store was told is GPU memory (the emulation,
    `_emulate_device_memory`): its bytes may move only through the device path."""

    def __init__(self, array, device="cuda"):
        self.array = array
        self.device = types.SimpleNamespace(type=device)
        self.dtype = f"torch.{array.dtype.name}"
        self.shape = array.shape

    def contiguous(self):
        return self

    def is_contiguous(self):
        return self.array.flags["C_CONTIGUOUS"]

    def data_ptr(self):
        return self.array.ctypes.data


FakeCudaTensor.__module__ = "torch"


# Arrays declared GPU memory, kept for the whole run: a declaration lasts as long as
# its store, and memory freed and allocated again would be declared twice.
DECLARED = []


def on_gpu(store, array):
    """`array` as a CUDA tensor of the emulation."""
    DECLARED.append(array)
    if array.nbytes:
        assert store._emulate_device_memory(array.ctypes.data, array.nbytes, 0) == 0
    return FakeCudaTensor(array)


def test_cuda_tensors_are_stored_through_the_device_path(store):
    arrays = {
        "f": sample("float32", (6, 10), 1),
        "i": sample("int64", (4, 3, 2), 2),
        "e": np.zeros((0, 3), np.float16),
    }
    gpu = {k: on_gpu(store, a) for k, a in arrays.items()}
    before = sum(store._device_bytes())
    assert store.put_tensor("cuda/f", gpu["f"]) == 0
    assert store.batch_put_tensor(["cuda/i", "cuda/e", "cpu/i"], [gpu["i"], gpu["e"], arrays["i"]]) == [0, 0, 0]
    for k, a in arrays.items():
        got = as_numpy(store.get_tensor(f"cuda/{k}"))
        assert got.dtype == a.dtype and np.array_equal(got, a), k
    # Every CUDA tensor's object (its header, then its elements) went through the
    # device calls; the CPU array did not.
    moved = sum(store._device_bytes()) - before
    assert moved == sum(HEADER + a.nbytes for a in arrays.values())
    # The objects are the ones a CPU tensor makes, byte for byte.
    assert store.get("cuda/i") == store.get("cpu/i")
    # An upsert replaces; a put of a key that exists keeps the first value.
    new = on_gpu(store, sample("float32", (6, 10), 9))
    assert store.put_tensor("cuda/f", new) == 0
    assert np.array_equal(as_numpy(store.get_tensor("cuda/f")), arrays["f"])
    assert store.upsert_tensor("cuda/f", new) == 0
    assert np.array_equal(as_numpy(store.get_tensor("cuda/f")), new.array)


def test_cuda_tensors_split_for_tensor_parallel_ranks(store):
    """Shards of a CUDA tensor: on the first dimension a range of it, on an inner one
    its rows, moved by device copies (never gathered on the host)."""
    full = sample("float32", (4, 6, 2), 3)
    gpu = on_gpu(store, full)
    for split_dim in (0, 1, 2):
        key = f"w{split_dim}"
        assert store.put_tensor_with_tp(key, gpu, tp_rank=0, tp_size=2, split_dim=split_dim) == 0
        for rank, want in enumerate(np.split(full, 2, axis=split_dim)):
            got = as_numpy(store.get_tensor_with_tp(key, tp_rank=rank, tp_size=2, split_dim=split_dim))
            assert np.array_equal(got, want), (split_dim, rank)
    assert store.put_tensor_with_tp("odd", gpu, tp_size=4, split_dim=1) == INVALID_PARAMS


def test_device_tensors_the_binding_cannot_move_are_refused(store):
    """A CUDA tensor whose memory the driver does not know is -600 (nothing is read
    from its address); a tensor on another device raises ValueError."""
    stray = FakeCudaTensor(sample("float32", (8,), 4))
    assert store.put_tensor("gpu", stray) == INVALID_PARAMS
    assert store.batch_put_tensor(["cpu", "gpu"], [np.zeros(2), stray]) == [0, INVALID_PARAMS]
    assert store.is_exist("gpu") == 0 and store.is_exist("cpu") == 1
    with pytest.raises(ValueError, match="mps"):
        store.put_tensor("mps", FakeCudaTensor(np.zeros(2), device="mps"))
    assert store.is_exist("mps") == 0
    assert store.put_tensor("k", np.zeros(8, np.float32)) == 0
    before = stray.array.copy()
    assert store.get_tensor_into_cuda("k", stray) == INVALID_PARAMS
    assert store.batch_get_tensor_into_cuda(["k"], [stray]) == [INVALID_PARAMS]
    assert np.array_equal(stray.array, before), "written through an unknown pointer"


def test_tensors_are_read_into_cuda_tensors(store):
    stored = {"a": sample("float32", (5, 7), 11), "b": sample("int16", (3,), 12), "e": np.zeros((2, 0), np.int8)}
    assert store.batch_put_tensor(list(stored), list(stored.values())) == [0, 0, 0]
    dst = {k: on_gpu(store, np.zeros_like(a)) for k, a in stored.items()}
    before = sum(store._device_bytes())
    assert store.get_tensor_into_cuda("a", dst["a"]) == stored["a"].nbytes
    assert np.array_equal(dst["a"].array, stored["a"])
    got = store.batch_get_tensor_into_cuda(["missing", "b", "e"], [dst["a"], dst["b"], dst["e"]])
    assert got == [OBJECT_NOT_FOUND, stored["b"].nbytes, 0]
    assert np.array_equal(dst["b"].array, stored["b"])
    # Each object read (header and elements) went through the device calls.
    assert sum(store._device_bytes()) - before == sum(HEADER + stored[k].nbytes for k in "abe")
    # A CPU tensor inside a registered buffer is read in place too; outside, -600.
    host = np.zeros_like(stored["a"])
    cpu = FakeCudaTensor(host, device="cpu")
    assert store.get_tensor_into_cuda("a", cpu) == INVALID_PARAMS
    assert not host.any()
    assert store.register_buffer(host.ctypes.data, host.nbytes) == 0
    assert store.get_tensor_into_cuda("a", cpu) == stored["a"].nbytes
    assert np.array_equal(host, stored["a"])
    store.unregister_buffer(host.ctypes.data)


def test_reads_into_cuda_tensors_check_what_is_stored(store):
    stored = sample("float32", (4, 6), 13)
    assert store.put_tensor("t", stored) == 0
    # Fewer bytes than stored: -600, the tensor untouched.
    for wrong in (np.zeros((4, 5), np.float32), np.zeros((2, 5), np.float64)):
        gpu = on_gpu(store, wrong)
        assert store.get_tensor_into_cuda("t", gpu) == INVALID_PARAMS, wrong.shape
        assert not wrong.any(), wrong.shape
    # As many bytes or more, as another dtype or shape: -600 as well, found once the
    # object (header and elements) was read.
    for wrong in (
        np.zeros((4, 6), np.int32),
        np.zeros((6, 4), np.float32),
        np.zeros(24, np.float32),
        np.zeros((4, 12), np.float32),
        np.zeros((4, 6), np.float64),
    ):
        assert store.get_tensor_into_cuda("t", on_gpu(store, wrong)) == INVALID_PARAMS, (wrong.dtype, wrong.shape)
    # Not a torch tensor, or not contiguous: -600.
    assert store.get_tensor_into_cuda("t", np.zeros((4, 6), np.float32)) == INVALID_PARAMS
    wide = np.zeros((4, 12), np.float32)
    on_gpu(store, wide)
    assert store.get_tensor_into_cuda("t", FakeCudaTensor(wide[:, ::2])) == INVALID_PARAMS
    assert not wide.any()
    # An object that is not a tensor: -600.
    assert store.put("raw", b"x" * (HEADER + 96)) == 0
    assert store.get_tensor_into_cuda("raw", on_gpu(store, np.zeros((4, 6), np.float32))) == INVALID_PARAMS


def test_batches_and_upserts(store):
    keys = [f"b{i}" for i in range(5)]
    arrays = [sample("float32", (i + 1, 3), i) for i in range(5)]
    assert store.batch_put_tensor(keys, arrays) == [0] * 5
    got = store.batch_get_tensor(keys + ["missing"])
    assert got[-1] is None
    for a, g in zip(arrays, got):
        assert np.array_equal(as_numpy(g), a)
    # Puts keep the first value; upserts replace, dtype and shape too.
    assert store.put_tensor("b0", np.ones(2)) == 0
    assert np.array_equal(as_numpy(store.get_tensor("b0")), arrays[0])
    assert store.upsert_tensor("b0", np.ones((2, 2), dtype=np.int8)) == 0
    got = as_numpy(store.get_tensor("b0"))
    assert got.dtype == np.int8 and got.shape == (2, 2)
    assert store.batch_upsert_tensor(keys[:2], [np.zeros(1), np.full(3, 7, np.int64)]) == [0, 0]
    assert np.array_equal(as_numpy(store.get_tensor("b1")), np.full(3, 7))
    assert store.batch_upsert_tensor(keys[:2], [np.zeros(1)]) == [INVALID_PARAMS] * 2


def test_pub_tensor_takes_a_config(store):
    cfg = ReplicateConfig()
    cfg.preferred_segment = store.get_hostname()
    assert store.pub_tensor("pub", np.arange(4), cfg) == 0
    assert store.batch_pub_tensor(["pub1", "pub2"], [np.arange(2), np.arange(3)], cfg) == [0, 0]
    assert store.upsert_pub_tensor("pub", np.arange(5), cfg) == 0
    assert as_numpy(store.get_tensor("pub")).shape == (5,)
    assert store.batch_upsert_pub_tensor(["pub1"], [np.arange(9)], cfg) == [0]
    # The reference's check: preferred segments name one segment per replica.
    two = ReplicateConfig()
    two.preferred_segments = ["a", "b"]
    assert store.pub_tensor("pub3", np.arange(2), two) == INVALID_PARAMS
    assert store.batch_pub_tensor(["pub3"], [np.arange(2)], two) == [INVALID_PARAMS]
    assert store.pub_tensor_with_tp("pub4", np.arange(8), cfg, 0, 2, 0) == 0
    assert store.batch_pub_tensor_with_tp(["pub5"], [np.arange(8)], cfg, tp_size=4) == [0]
    assert np.array_equal(as_numpy(store.get_tensor_with_tp("pub5", tp_rank=3, tp_size=4)), [6, 7])


@pytest.mark.parametrize("split_dim", [0, 1, 2])
def test_tensor_parallel_shards(store, split_dim):
    full = sample("int16", (4, 6, 8), split_dim)
    tp = 2
    assert store.put_tensor_with_tp("w", full, tp_rank=1, tp_size=tp, split_dim=split_dim) == 0
    assert store.is_exist("w") == 0
    parts = np.split(full, tp, axis=split_dim)
    for rank in range(tp):
        raw = store.get(f"w_tp_{rank}")
        h = header(raw)
        assert h["layout"] == 1 and h["axes"] == 1
        assert h["glob"][:3] == full.shape and h["local"][:3] == parts[rank].shape
        kind, index, shard_rank, count, dim = struct.unpack_from("<5i", raw, 176)
        assert (kind, index, shard_rank, count, dim) == (1, 0, rank, tp, split_dim)
        got = as_numpy(store.get_tensor_with_tp("w", tp_rank=rank, tp_size=tp, split_dim=split_dim))
        assert np.array_equal(got, parts[rank])
    store.remove_all(True)


def test_tensor_parallel_batches_and_refusals(store):
    a, b = np.arange(12).reshape(3, 4), np.arange(8, dtype=np.float32)
    # 3 rows do not split in 2 (only even splits, as the reference).
    assert store.batch_put_tensor_with_tp(["a", "b"], [a, b], tp_size=2) == [INVALID_PARAMS, 0]
    assert store.batch_put_tensor_with_tp(["a"], [a], tp_size=2, split_dim=1) == [0]
    assert store.put_tensor_with_tp("c", a, tp_size=2, split_dim=5) == INVALID_PARAMS
    assert store.put_tensor_with_tp("c", a, tp_size=4, split_dim=1) == 0
    # A size no tensor-parallel group has is refused before anything is reserved for
    # it, even when an empty dimension would divide (every size divides 0).
    empty = np.zeros((0, 4), dtype=np.float32)
    assert store.put_tensor_with_tp("e", empty, tp_size=2**31 - 1, split_dim=0) == INVALID_PARAMS
    assert store.put_tensor_with_tp("e", a, tp_size=2**31 - 1, split_dim=1) == INVALID_PARAMS
    assert store.put_tensor_with_tp("e", empty, tp_size=2, split_dim=0) == 0
    got = store.batch_get_tensor_with_tp(["a", "b", "missing"], tp_rank=1, tp_size=2)
    assert np.array_equal(as_numpy(got[0]), a[:, 2:]) and np.array_equal(as_numpy(got[1]), b[4:])
    assert got[2] is None
    # tp_size 1: the plain key.
    assert store.put_tensor_with_tp("d", b) == 0
    assert np.array_equal(as_numpy(store.get_tensor_with_tp("d")), b)
    assert np.array_equal(as_numpy(store.batch_get_tensor_with_tp(["d"])[0]), b)


def test_get_tensor_into_views_the_buffer(store):
    a = sample("float64", (16, 16))
    assert store.put_tensor("into", a) == 0
    with Registered(store, 1 << 16) as buf:
        t = store.get_tensor_into("into", buf.ptr, 1 << 16)
        assert np.array_equal(as_numpy(t), a)
        # A view of the registered buffer, as the reference's.
        ctypes.memmove(buf.ptr + HEADER, struct.pack("<d", 42.0), 8)
        assert as_numpy(t)[0, 0] == 42.0
        assert store.get_tensor_into("missing", buf.ptr, 1 << 16) is None
        assert store.get_tensor_into("into", buf.ptr, 100) is None
        assert store.get_tensor_into("into", 0, 100) is None
        # Empty and batched reads into halves of the buffer.
        assert store.put_tensor("empty", np.zeros((0, 3), np.uint8)) == 0
        half = 1 << 15
        got = store.batch_get_tensor_into(["into", "empty", "missing"], [buf.ptr, buf.ptr + half, buf.ptr], [half] * 3)
        assert np.array_equal(as_numpy(got[0]), a)
        assert as_numpy(got[1]).shape == (0, 3) and got[2] is None
        assert store.batch_get_tensor_into(["into"], [0], [half]) == [INVALID_PARAMS]
        assert store.batch_get_tensor_into(["into", "x"], [buf.ptr], [half]) == [INVALID_PARAMS] * 2
        # The tp forms read shard keys.
        assert store.put_tensor_with_tp("w", a, tp_size=4) == 0
        t = store.get_tensor_with_tp_into("w", buf.ptr, half, tp_rank=2, tp_size=4)
        assert np.array_equal(as_numpy(t), a[8:12])
        got = store.batch_get_tensor_with_tp_into(["w", "w"], [buf.ptr, buf.ptr + half], [half] * 2, 3, 4)
        assert np.array_equal(as_numpy(got[1]), a[12:])


def test_put_tensor_from_a_registered_buffer(store):
    """put_tensor_from takes what get_tensor_into leaves: header then elements."""
    a = sample("uint32", (5, 6))
    assert store.put_tensor("src", a) == 0
    with Registered(store, 1 << 16) as buf:
        n = store.get_into("src", buf.ptr, 1 << 16)
        assert n == HEADER + a.nbytes
        assert store.put_tensor_from("dst", buf.ptr, n) == 0
        assert np.array_equal(as_numpy(store.get_tensor("dst")), a)
        assert store.batch_put_tensor_from(["dst2", "dst3"], [buf.ptr, buf.ptr], [n, n]) == [0, 0]
        # One bad buffer fails the whole batch, as in the reference.
        assert store.batch_put_tensor_from(["dst4", "dst5"], [buf.ptr, buf.ptr], [n, n - 1]) == [INVALID_PARAMS] * 2
        assert store.batch_put_tensor_from([], [], []) == []
        assert store.put_tensor_from("dst4", buf.ptr, HEADER - 1) == INVALID_PARAMS
        assert store.put_tensor_from("dst4", 0x1000, n) == INVALID_PARAMS  # not registered
        assert store.is_exist("dst4") == 0
        assert store.upsert_tensor_from("dst", buf.ptr, n) == 0
        assert store.batch_upsert_tensor_from(["dst", "dst2"], [buf.ptr, buf.ptr], [n, n]) == [0, 0]
        # Sharded from the buffer.
        assert store.put_tensor_with_tp_from("ws", buf.ptr, n, 0, 2, 1) == 0
        assert np.array_equal(as_numpy(store.get_tensor("ws_tp_1")), a[:, 3:])
        assert store.batch_put_tensor_with_tp_from(["wa", "wb"], [buf.ptr, buf.ptr], [n, 10], 0, 5, 0) == [
            0,
            INVALID_PARAMS,
        ]
        assert np.array_equal(as_numpy(store.get_tensor("wa_tp_4")), a[4:])


def test_types_numpy_lacks_come_back_raw_without_torch(store):
    """bfloat16 written by another client (the layout is the reference's): without
    torch or ml_dtypes it comes back as its 16-bit storage."""
    if HAVE_TORCH:
        pytest.skip("with torch, bfloat16 comes back as torch.bfloat16")
    bits = np.array([0x3F80, 0x4000, 0xC040], dtype=np.uint16)  # 1.0, 2.0, -3.0
    meta = bytearray(HEADER)
    struct.pack_into("<IHHiiIIQQ", meta, 0, MAGIC, 1, HEADER, 12, 1, 0, 0, HEADER, bits.nbytes)
    struct.pack_into("<8q", meta, 40, 3, *([-1] * 7))
    struct.pack_into("<8q", meta, 104, 3, *([-1] * 7))
    assert store.put("bf16", bytes(meta) + bits.tobytes()) == 0
    got = store.get_tensor("bf16")
    try:
        import ml_dtypes  # noqa: F401

        assert str(got.dtype) == "bfloat16"
    except ImportError:
        assert got.dtype == np.uint16 and np.array_equal(got, bits)
    # A header that lies about its length is not a tensor.
    struct.pack_into("<Q", meta, 32, bits.nbytes + 2)
    assert store.put("bf16-bad", bytes(meta) + bits.tobytes()) == 0
    assert store.get_tensor("bf16-bad") is None
