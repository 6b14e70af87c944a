"""Mooncake Store in Rust.

``from mooncake_rs.store import MooncakeDistributedStore`` is a drop-in for
``from mooncake.store import MooncakeDistributedStore``.

To run a framework unchanged (it imports ``mooncake.store``), set
``MOONCAKE_RS_AS_MOONCAKE=1`` in its environment: every Python process started with
it (worker processes too) then finds this package's store under ``mooncake.store``
and ``mooncake.async_store``, through the ``mooncake_rs_alias.pth`` file this wheel
installs. :func:`install_as_mooncake` does the same in the calling process only.
"""

import importlib
import sys
import types

__all__ = ["install_as_mooncake"]


def install_as_mooncake():
    """Makes ``mooncake.store`` and ``mooncake.async_store`` this package's modules
    in this process, so that ``from mooncake.store import MooncakeDistributedStore``
    gives this store. The reference's ``mooncake`` package, when installed (for its
    transfer engine, say), stays what ``mooncake`` is, with only its store replaced;
    without it, ``mooncake`` becomes a package holding just these two modules.
    Returns the ``mooncake`` package."""
    from mooncake_rs import async_store, store

    package = sys.modules.get("mooncake")
    if package is None:
        try:
            package = importlib.import_module("mooncake")
        except ImportError:
            package = types.ModuleType("mooncake", "mooncake.store from mooncake-rs")
            package.__path__ = []
            sys.modules["mooncake"] = package
    sys.modules["mooncake.store"] = store
    sys.modules["mooncake.async_store"] = async_store
    package.store = store
    package.async_store = async_store
    return package
