//! Reference fences inside the store itself (ADR-16's first recommendation): the
//! token check is part of the store's own write, so it is atomic with it, unlike
//! fence-proxy's check-then-forward. One module per store protocol.

pub mod postgres;
pub mod s3;
