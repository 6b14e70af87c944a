//! Integration and multi-process tests of mooncake-rs live in this crate's tests/ folder.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]
