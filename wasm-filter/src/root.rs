//! The root context: reads and validates the plugin configuration.
//!
//! `on_configure` runs for every root context in every worker VM, on the main thread
//! and under `envoy --mode validate`; it only parses, so it is idempotent. Returning
//! `false` makes Envoy reject the configuration (startup fails, an xDS update is
//! NACKed); every error is logged at `error` level with its field path first.

use std::rc::Rc;

use proxy_wasm::{
    hostcalls,
    traits::{Context, HttpContext, RootContext},
    types::{BufferType, ContextType, LogLevel},
};

use crate::{config, http::Request};

/// The root context.
#[derive(Default)]
pub struct Root {
    config: Option<Rc<config::Config>>,
}

impl Context for Root {}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(e) => {
                let _ = hostcalls::log(
                    LogLevel::Error,
                    &format!("lockmesh: cannot read plugin configuration: {e:?}"),
                );
                return false;
            }
        };
        match config::parse(&bytes) {
            Ok(c) => {
                if c.test_trap_header.is_some() {
                    let _ = hostcalls::log(
                        LogLevel::Warn,
                        "lockmesh: TEST ONLY test_trap_header is set",
                    );
                }
                self.config = Some(Rc::new(c));
                true
            }
            Err(errs) => {
                for e in errs {
                    let _ = hostcalls::log(
                        LogLevel::Error,
                        &format!("lockmesh plugin configuration: {e}"),
                    );
                }
                false
            }
        }
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Without a configuration (cannot happen after a successful on_configure) the
        // request context refuses everything: fail closed.
        Some(Box::new(Request::new(self.config.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
