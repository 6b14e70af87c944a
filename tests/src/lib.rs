//! Integration and multi-process tests of mooncake-rs live in this crate's tests/ folder.
