//! fence-proxy: a reverse proxy in front of an HTTP store that cannot check lockmesh
//! fencing tokens itself. It refuses writes whose grant is missing, forged, for
//! another lock, or not above the highest token the resource has seen, and makes
//! each resource's mark durable before it forwards a write. Prefer the store's own
//! conditional write where it has one (ADR-16; `docs/FENCING.md`).
//!
//! # Layout
//! - [`config`]: the YAML configuration and its validation.
//! - [`route`]: routes over `lockmesh_core::template` (the filter's template language):
//!   resources, guarding keys, reads and writes, decided on the canonical path.
//! - [`screen`]: what passes: header twins, duplicates, overrides, bodies on reads;
//!   the headers the store gets.
//! - [`token`]: grant verification and the mark rule (pure).
//! - [`marks`]: durable marks (redb), single-writer lock, instance id.
//! - [`server`]: the proxy, admin endpoints and graceful shutdown.
//! - `metrics`: the `/metrics` registry (prometheus-client).
//! - [`respond`]: the one error-to-response table.
//! - [`pause`]: the pause test kit (ADR-17) behind `lockmesh-pausekit`.
//! - [`store`]: reference fences inside the store (PostgreSQL fence column).
#![forbid(unsafe_code)]

pub mod config;
pub mod marks;
mod metrics;
pub mod pause;
pub mod respond;
pub mod route;
pub mod screen;
pub mod server;
pub mod store;
pub mod token;

pub use self::config::Config;
pub use self::server::run;
