//! The floor of any Rust proxy-wasm HTTP filter in Envoy: a root context that
//! creates an HTTP context per request, and an HTTP context that does nothing (every
//! callback keeps the SDK's default, which continues). Built like lockmesh's filter
//! (`release`, `wasm32-wasip1`) with the same proxy-wasm SDK, and run by
//! `lockmesh-load --filter-tax` as `empty-wasm`, so the filter's tax on lock-free
//! requests is measured against what any Wasm filter costs (issue 20), not only
//! against an Envoy without one. Not shipped.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
}}

/// Creates one [`Empty`] per request.
struct Root;

impl Context for Root {}

impl RootContext for Root {
    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Empty))
    }
}

/// A request's context: nothing overridden.
struct Empty;

impl Context for Empty {}

impl HttpContext for Empty {}
