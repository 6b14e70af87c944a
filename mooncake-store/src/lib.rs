//! # mooncake_store
//!
//! A drop-in for the reference's Rust crate `mooncake_store`
//! (`mooncake-store/rust` in [kvcache-ai/Mooncake](https://github.com/kvcache-ai/Mooncake)):
//! the same [`MooncakeStore`], [`ReplicateConfig`] and [`StoreError`], method for
//! method, over this project's pure-Rust engine, [`mooncake_core::Store`]. The
//! reference wraps its C++ client through a C ABI and needs the C++ build (or
//! `libmooncake_store.so`) to build or run; this crate needs neither. It talks to a
//! `mooncake-master` of this project.
//!
//! ## Quick start
//!
//! ```no_run
//! use mooncake_store::{MooncakeStore, ReplicateConfig};
//!
//! let store = MooncakeStore::new()?;
//! store.setup(
//!     "localhost",
//!     "http://127.0.0.1:8080/metadata", // accepted, not needed
//!     512 << 20,                        // global_segment_size
//!     128 << 20,                        // local_buffer_size (accepted, not needed)
//!     "tcp",
//!     "",
//!     "127.0.0.1:50051",                // a `mooncake-master`
//! )?;
//!
//! store.put("hello", b"world", None)?;
//! assert_eq!(store.get("hello")?, b"world");
//! let cfg = ReplicateConfig { replica_num: 2, ..Default::default() };
//! store.put("twice", b"value", Some(&cfg))?;
//! store.remove("hello", false)?;
//! # Ok::<(), mooncake_store::StoreError>(())
//! ```
//!
//! ## Switching from the reference
//!
//! Change the dependency line of `Cargo.toml`; the code stays as it is. Start a
//! `mooncake-master` (this project's `mooncake-cli`) where the reference's
//! `mooncake_master` ran; no metadata server is needed (the `metadata_server`
//! argument is accepted and ignored). Differences in behaviour, all documented on
//! the methods:
//!
//! - The zero-copy methods check every raw range against the buffers given to
//!   [`MooncakeStore::register_buffer`], for reads (`get_into`) as for writes
//!   (`put_from`); a range outside them is [`StoreError::InvalidArgument`] rather
//!   than a read or write of arbitrary memory.
//! - `remove(key, true)` waits for a reader's lease to run out instead of freeing
//!   memory the reader may still copy from.
//! - `with_hard_pin` is a soft pin (this engine has no hard pin).
//! - Failures carry the reference's codes ([`codes`]) in
//!   [`StoreError::OperationFailed`]; bad arguments keep their message in
//!   [`StoreError::InvalidArgument`].
//!
//! ## Where the native API is better
//!
//! This crate is a thin layer kept for compatibility. New code should use
//! [`mooncake_core::Store`] directly: slices instead of raw pointers (no `unsafe`,
//! no buffer registration), typed errors with messages ([`mooncake_core::Error`],
//! `is_retryable`), one `Result` per key from the batch calls, reads without a
//! copy (`Bytes`), upserts, multi-part objects, an SSD tier and GPU memory.
//!
//! ## Features
//!
//! - `rdma`: `setup(.., "rdma", ..)` uses this host's RDMA devices. Without it,
//!   `"rdma"` is refused with [`StoreError::InvalidArgument`] (no silent fallback
//!   to TCP).
//! - `etcd`: `etcd://H:P[,H:P...]/NAME` master addresses, a cluster of masters
//!   found through etcd (building needs `protoc`).
//! - `link`, `dlopen`: the reference's backend features, accepted so that its
//!   dependency lines resolve; they change nothing (there is nothing to link or
//!   load). With `dlopen`, `load_library` exists, as in the reference (and does nothing).
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod codes;
pub mod error;
pub mod store;

pub use error::StoreError;
pub use store::{MooncakeStore, ReplicateConfig};

/// The reference loads `libmooncake_store.so` here under its `dlopen` feature. This
/// crate has nothing to load: the engine is compiled in. Always `Ok(())`.
#[cfg(feature = "dlopen")]
pub fn load_library(path: impl AsRef<std::path::Path>) -> Result<(), StoreError> {
    let _ = path;
    Ok(())
}
