"""The parts of `mooncake_rs.store` written in Python: `BufferHandle` and
`MooncakeDistributedStoreAsync`. Run once when the extension module loads; `build`
returns the classes, made with the module's own objects."""

import asyncio
import functools


def build(store_class, bytes_address):
    class BufferHandle(bytes):
        """An object read by `get_buffer`: its bytes (`bytes(h)`, `len(h)`, the buffer
        protocol: `memoryview(h)`, `torch.frombuffer(h)`), with `ptr()` and `size()`
        as the reference's handle has."""

        __slots__ = ()

        def ptr(self):
            """Address of the first byte (valid while the handle lives)."""
            return bytes_address(self)

        def size(self):
            """Length in bytes."""
            return len(self)

        def __repr__(self):
            return f"<BufferHandle size={len(self)}>"

    def make_async(name):
        async def method(self, *args, **kwargs):
            # The call runs on the loop's default thread pool; the store releases the
            # GIL while the engine works, so other calls and the loop go on meanwhile.
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(getattr(self, name), *args, **kwargs))

        method.__name__ = f"async_{name}"
        method.__qualname__ = f"MooncakeDistributedStoreAsync.async_{name}"
        method.__doc__ = f"`{name}` off the event loop (awaitable)."
        return method

    namespace = {
        "__doc__": (
            "A `MooncakeDistributedStore` whose every method `m` has an awaitable "
            "`async_m` that runs it on the event loop's thread pool."
        ),
        "__module__": "mooncake_rs.store",
    }
    for name in dir(store_class):
        if not name.startswith("_") and callable(getattr(store_class, name)):
            namespace[f"async_{name}"] = make_async(name)

    def __getattr__(self, name):
        # Like the reference's class: `async_` and any method name, also one added
        # later or by a subclass.
        if name.startswith("async_") and callable(getattr(type(self), name[6:], None)):
            return make_async(name[6:]).__get__(self)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    namespace["__getattr__"] = __getattr__
    BufferHandle.__module__ = "mooncake_rs.store"
    BufferHandle.__qualname__ = "BufferHandle"
    MooncakeDistributedStoreAsync = type("MooncakeDistributedStoreAsync", (store_class,), namespace)
    return BufferHandle, MooncakeDistributedStoreAsync
