"""`from mooncake_rs.async_store import MooncakeDistributedStoreAsync`: the awaitable
store, as the reference's `mooncake.async_store` offers it (the class lives in
`mooncake_rs.store`)."""

from mooncake_rs.store import MooncakeDistributedStoreAsync

__all__ = ["MooncakeDistributedStoreAsync"]
