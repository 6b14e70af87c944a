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
mod device;
mod dummy;
mod handle;
mod hostmem;
mod layer_sessions;
mod ranges;
mod replicas;
mod session;
mod setup;
mod store;
mod tasks;
mod tensor;
mod tensor_api;
mod tensor_meta;

/// The classes written in Python (`BufferHandle`, `MooncakeDistributedStoreAsync`).
const EXTRAS: &str = include_str!("extras.py");

/// The `mooncake_rs.store` module.
#[pymodule]
#[pyo3(name = "store")]
fn store_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<store::MooncakeDistributedStore>()?;
    m.add_class::<config::ReplicateConfig>()?;
    m.add_class::<config::SoftPinAction>()?;
    m.add_class::<hostmem::MooncakeHostMemAllocator>()?;
    m.add_class::<replicas::ReplicaStatus>()?;
    m.add_class::<replicas::ReplicaDescriptor>()?;
    m.add_class::<replicas::MemoryDescriptor>()?;
    m.add_class::<replicas::DiskDescriptor>()?;
    m.add_class::<replicas::Descriptor>()?;
    m.add_class::<tasks::TaskType>()?;
    m.add_class::<tasks::TaskStatus>()?;
    m.add_class::<tasks::QueryTaskResponse>()?;
    m.add_function(wrap_pyfunction!(hostmem::bind_to_numa_node, m)?)?;
    let address = wrap_pyfunction!(handle::_bytes_address, m)?;
    let extras = PyModule::from_code(
        py,
        &std::ffi::CString::new(EXTRAS)?,
        c"mooncake_rs/store_extras.py",
        c"mooncake_rs._store_extras",
    )?;
    let built = extras.getattr("build")?.call1((m.getattr("MooncakeDistributedStore")?, address))?;
    let (handle_class, async_class): (Bound<'_, PyAny>, Bound<'_, PyAny>) = built.extract()?;
    handle::set_class(py, handle_class.clone());
    m.add("BufferHandle", handle_class)?;
    m.add("MooncakeDistributedStoreAsync", async_class)?;
    Ok(())
}
