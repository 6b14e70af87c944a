"""MooncakeDistributedStoreAsync: `async_<name>` for every method, run off the event
loop."""

import asyncio
import ctypes
import threading

import numpy as np
import pytest

from mooncake_rs.async_store import MooncakeDistributedStoreAsync as FromAsyncModule
from mooncake_rs.store import MooncakeDistributedStore, MooncakeDistributedStoreAsync

INVALID_PARAMS = -600


@pytest.fixture()
def astore(master):
    s = MooncakeDistributedStoreAsync()
    assert s.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", master) == 0
    yield s
    s.remove_all(True)
    s.close()


def public_methods():
    return [n for n in dir(MooncakeDistributedStore) if not n.startswith("_") and callable(getattr(MooncakeDistributedStore, n))]


def test_every_method_has_an_async_form():
    assert FromAsyncModule is MooncakeDistributedStoreAsync
    assert issubclass(MooncakeDistributedStoreAsync, MooncakeDistributedStore)
    s = MooncakeDistributedStoreAsync()
    names = public_methods()
    assert {"put", "get_tensor", "batch_get_into", "create_copy_task", "setup_dummy"} <= set(names)
    for name in names:
        m = getattr(s, f"async_{name}")
        assert asyncio.iscoroutinefunction(m), name
    with pytest.raises(AttributeError):
        s.async_no_such_method
    with pytest.raises(AttributeError):
        s.no_such_attribute


def test_async_calls_return_what_the_sync_ones_do(astore):
    async def main():
        assert await astore.async_put("k", b"value") == 0
        assert await astore.async_get("k") == b"value"
        assert await astore.async_is_exist("k") == 1
        assert await astore.async_batch_is_exist(["k", "missing"]) == [1, 0]
        assert await astore.async_put_tensor("t", np.arange(6).reshape(2, 3)) == 0
        t = await astore.async_get_tensor("t")
        assert np.array_equal(np.asarray(t), np.arange(6).reshape(2, 3))
        [h] = await astore.async_batch_get_buffer(["k"])
        assert bytes(h) == b"value"
        assert await astore.async_remove("k", True) == 0
        assert await astore.async_get_size("k") == -704
        buf = (ctypes.c_ubyte * 4096)()
        ptr = ctypes.addressof(buf)
        assert await astore.async_register_buffer(ptr, 4096) == 0
        ctypes.memmove(ptr, b"z" * 100, 100)
        assert await astore.async_batch_put_from(["z"], [ptr], [100]) == [0]
        assert await astore.async_batch_get_into(["z"], [ptr + 1000], [1000]) == [100]
        assert ctypes.string_at(ptr + 1000, 100) == b"z" * 100
        assert await astore.async_unregister_buffer(ptr) == 0
        # Keyword arguments and errors pass through.
        assert await astore.async_remove(key="z", force=True) == 0
        with pytest.raises(TypeError):
            await astore.async_put("k", 5)

    asyncio.run(main())


def test_async_calls_run_off_the_loop_and_overlap(astore):
    """Calls run on the loop's thread pool, and the GIL is released inside: calls of
    several threads are in the engine at the same time."""
    seen_threads = set()
    loop_thread = []
    inside = [0, 0]  # now, most at once
    lock = threading.Lock()
    original = astore.put

    def put(key, value):
        seen_threads.add(threading.get_ident())
        with lock:
            inside[0] += 1
            inside[1] = max(inside)
        try:
            return original(key, value)
        finally:
            with lock:
                inside[0] -= 1

    astore.put = put  # the instance attribute is what async_put calls

    async def main():
        loop_thread.append(threading.get_ident())
        data = bytes(4 << 20)
        results = await asyncio.gather(*(astore.async_put(f"big-{i}", data) for i in range(8)))
        assert results == [0] * 8
        assert await astore.async_batch_is_exist([f"big-{i}" for i in range(8)]) == [1] * 8

    asyncio.run(main())
    assert seen_threads and loop_thread[0] not in seen_threads
    assert inside[1] > 1


def test_async_not_set_up_answers_codes():
    async def main():
        s = MooncakeDistributedStoreAsync()
        assert await s.async_health_check() == 1
        assert await s.async_put("k", b"v") == INVALID_PARAMS
        assert await s.async_close() == 0

    asyncio.run(main())
