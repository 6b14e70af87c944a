//! Cross-crate examples live in this crate's examples.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]
