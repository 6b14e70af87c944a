"""Mooncake Store in Rust.

``from mooncake_rs.store import MooncakeDistributedStore`` is a drop-in for
``from mooncake.store import MooncakeDistributedStore``.
"""
