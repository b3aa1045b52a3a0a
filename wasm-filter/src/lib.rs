//! lockmesh's proxy-wasm HTTP filter, loaded by Envoy (`envoy.filters.http.wasm`,
//! V8 runtime) in front of the ext_proc arbiter.
//!
//! For every request it removes headers only lockmesh may set, authenticates the
//! caller by the SPIFFE ID in its mTLS peer certificate, validates the lock headers
//! (one canonical form each, no duplicates) and answers `400 bad_request` naming the
//! header before anything reaches the arbiter. It then stamps the caller's wait
//! budget and its own mark, which the arbiter requires.
//!
//! # Layout
//! - `lib.rs`: only registration.
//! - [`root`]: the root context (configuration).
//! - [`http`]: the per-request context: reads host state, applies a [`decide::Decision`].
//! - [`decide`]: pure decision functions, tested on the host.
//! - [`config`]: plugin configuration parsing, pure.
//!
//! The filter must never panic: a panic traps the VM and fails every request on the
//! worker. Host calls go through `proxy_wasm::hostcalls`, whose errors are handled;
//! the SDK's trait helpers that `unwrap` are not used.

pub mod config;
pub mod decide;
pub mod http;
pub mod root;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(root::Root::default())
    });
}}
