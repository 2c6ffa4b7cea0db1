//! Placeholder crate: filled by a later issue. It holds no API yet.
