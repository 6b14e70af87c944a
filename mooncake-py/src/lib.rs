//! Python binding of Mooncake Store: `mooncake_rs.store`, a drop-in for the
//! reference's `mooncake.store` module.
//!
//! ```python
//! from mooncake_rs.store import MooncakeDistributedStore  # was: from mooncake.store import ...
//! store = MooncakeDistributedStore()
//! store.setup("localhost", "P2PHANDSHAKE", 512 << 20, 128 << 20, "tcp", "", "127.0.0.1:50051")
//! store.put("key", b"value")
//! ```
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

use pyo3::prelude::*;

mod codes;
mod config;
mod handle;
mod ranges;
mod setup;
mod store;

/// The `mooncake_rs.store` module.
#[pymodule]
#[pyo3(name = "store")]
fn store_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<store::MooncakeDistributedStore>()?;
    m.add_class::<config::ReplicateConfig>()?;
    m.add_class::<config::SoftPinAction>()?;
    m.add_class::<handle::BufferHandle>()?;
    Ok(())
}
