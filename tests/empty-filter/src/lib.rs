//! The floor of any Rust proxy-wasm HTTP filter in Envoy: a root context that
//! creates an HTTP context per request, and an HTTP context that does nothing (every
//! callback keeps the SDK's default, which continues). Built like lockmesh's filter
//! (`release`, `wasm32-wasip1`) with the same proxy-wasm SDK, and run by
//! `lockmesh-load --filter-tax` as `empty-wasm`, so the filter's tax on lock-free
//! requests is measured against what any Wasm filter costs (issue 20), not only
//! against an Envoy without one. Not shipped.
//!
//! With the plugin configuration `floor` it makes, on every request, the host calls
//! lockmesh's design needs whatever its checks cost, and nothing else: it reads the
//! request's header map (a filter must look at every name to strip spoofed
//! `x-lockmesh-*` headers), reads the caller's URI SAN from the connection (no
//! insecure mode: identity is read for every request) and sets the Wasm property
//! `lockmesh_unlocked` to `1` (the filter-state mark the fail-closed ext_proc matcher
//! of `inbound-sidecar.yaml` skips on). The tax run's `design-floor` row runs it
//! before that skipped ext_proc: the least a lock-free request can cost through this
//! design.

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { floor: false }) });
}}

/// Creates one [`Empty`] per request.
struct Root {
    /// The plugin configuration was `floor`.
    floor: bool,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _plugin_configuration_size: usize) -> bool {
        self.floor = self.get_plugin_configuration().is_some_and(|c| c == b"floor");
        true
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Empty { floor: self.floor }))
    }
}

/// A request's context: nothing overridden, or only the design's host calls made.
struct Empty {
    floor: bool,
}

impl Context for Empty {}

impl HttpContext for Empty {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        if self.floor {
            // A bench module: the SDK panics on a status other than Ok, which Envoy
            // does not return for these calls on the request's own headers here.
            std::hint::black_box(self.get_http_request_headers_bytes());
            std::hint::black_box(self.get_property(vec!["connection", "uri_san_peer_certificate"]));
            // lockmesh_core::headers::UNLOCKED_PROPERTY (this crate depends on no
            // lockmesh crate, so the floor's code is only the SDK's).
            self.set_property(vec!["lockmesh_unlocked"], Some(b"1"));
        }
        Action::Continue
    }
}
