//! lockmesh's proxy-wasm HTTP filter, loaded by Envoy (`envoy.filters.http.wasm`,
//! V8 runtime) in front of the ext_proc arbiter.
//!
//! For every request it removes headers only lockmesh may set (in every spelling a
//! server may read as theirs: `_` for `-`, any case), authenticates the
//! caller by the SPIFFE ID in its mTLS peer certificate, classifies the route,
//! validates the lock headers (one canonical form each, no duplicates) and checks the
//! caller's prefix grants (ADR-19), answering `401`, `404`, `400` or `403` before
//! anything reaches the arbiter. Acquire requests then pass an optional Tier-1 local
//! limit and queue per key (ADR-14): only a key's head goes on to the arbiter, the
//! rest wait paused in the filter. A passed request carries the caller's remaining
//! wait budget and the filter's mark, which the arbiter requires.
//!
//! # Layout
//! - `lib.rs`: only registration.
//! - [`root`]: the root context (configuration, tick).
//! - [`http`]: the per-request context: reads host state, applies decisions.
//! - [`worker`]: per-worker state and the host glue of queueing and local limits.
//! - [`decide`], [`route`]: pure request decisions, tested on the host.
//! - [`queue`]: the per-worker FIFO queues, pure (its module doc states who
//!   guarantees what order).
//! - [`roster`]: the Envoy-wide rosters in shared data (backlog, local limits), pure.
//! - [`shared`]: shared-data compare-and-swap updates.
//! - [`transparent`]: request-scoped locks: hold numbers, releases, VM renewal.
//! - [`metrics`]: metric names and lazily defined ids.
//! - [`abi`]: host calls whose SDK wrappers would panic on an error status.
//! - [`config`]: plugin configuration parsing, pure.
//! - `trap`: TEST ONLY, compiled only with the `test-trap` feature: the VM trap a
//!   scenario springs to prove a VM crash fails closed.
//!
//! The filter must never panic (except the test build's `trap`): a panic traps the VM and fails every request on the
//! worker, and strands every request paused in it. Host calls go through
//! `proxy_wasm::hostcalls` (or [`abi`]), whose errors are handled; the SDK's trait
//! helpers that `unwrap` are not used.

pub mod abi;
pub mod config;
pub mod decide;
pub mod http;
pub mod metrics;
pub mod queue;
pub mod root;
pub mod roster;
pub mod route;
pub mod shared;
pub mod transparent;
#[cfg(feature = "test-trap")]
mod trap;
pub mod worker;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|context_id| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::new(context_id))
    });
}}
