//! Cross-crate examples live in this crate's examples.
