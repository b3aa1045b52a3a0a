//! The root context: reads and validates the plugin configuration, and ticks.
//!
//! `on_configure` runs for every root context in every worker VM, on the main thread
//! and under `envoy --mode validate`; it only parses and starts the tick, so it is
//! idempotent (beyond recording, in shared data, which configuration's warnings
//! were logged). Returning `false` makes Envoy reject the configuration (startup fails,
//! an xDS update is NACKed); every error is logged at `error` level with its field
//! path first. Warnings (a transparent route whose caller chooses its key) are
//! logged at `warn`, once per Envoy and configuration (not once per worker VM).
//!
//! `on_tick` (every [`TICK`]) answers queued waiters whose deadline passed, passes
//! on heads that became first in the Envoy-wide backlog ([`crate::worker`]) and
//! makes the transparent-mode calls that are due. `on_queue_ready` (this root's
//! wake-up queue) does the same at once when a request ends: a key's next waiter on
//! this worker, a release. `on_http_call_response` reads those calls' answers.

use std::{cell::RefCell, rc::Rc, time::Duration};

use proxy_wasm::{
    hostcalls,
    traits::{Context, HttpContext, RootContext},
    types::{BufferType, ContextType, LogLevel},
};

use crate::{
    config,
    http::Request,
    worker::{now_ms, Worker},
};

/// The tick period: the lateness bound of a filter-side deadline and of a hand-over
/// between workers.
pub(crate) const TICK: Duration = Duration::from_millis(100);

/// The root context.
pub struct Root {
    worker: Rc<RefCell<Worker>>,
}

impl Root {
    /// Root context `id`.
    pub fn new(id: u32) -> Self {
        Self { worker: Rc::new(RefCell::new(Worker::new(id))) }
    }
}

fn log(level: LogLevel, msg: &str) {
    let _ = hostcalls::log(level, msg);
}

impl Root {
    /// Takes the effective context back (hand-overs moved it to requests), then
    /// makes the transparent-mode calls that are due, bound to the root.
    fn calls(&mut self) {
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            let _ = hostcalls::set_effective_context(w.root_id());
            w.calls(now_ms());
        }
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, _num_headers: usize, body_size: usize, _num_trailers: usize) {
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.on_call_response(token_id, body_size, now_ms());
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(e) => {
                log(LogLevel::Error, &format!("lockmesh: cannot read plugin configuration: {e:?}"));
                return false;
            }
        };
        let c = match config::parse(&bytes) {
            Ok(c) => c,
            Err(errs) => {
                for e in errs {
                    log(LogLevel::Error, &format!("lockmesh plugin configuration: {e}"));
                }
                return false;
            }
        };
        #[cfg(feature = "test-trap")]
        if c.test_trap_header.is_some() {
            log(LogLevel::Warn, "lockmesh: TEST ONLY test_trap_header is set");
        }
        if !c.warnings.is_empty() && crate::shared::first_to_load(&bytes) {
            for w in &c.warnings {
                log(LogLevel::Warn, &format!("lockmesh plugin configuration: {w}"));
            }
        }
        if c.grants.is_empty() {
            log(LogLevel::Warn, "lockmesh: no grants configured; every request will be denied");
        }
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            log(LogLevel::Error, "lockmesh: worker state busy in on_configure");
            return false;
        };
        w.configure(c);
        if let Err(e) = hostcalls::set_tick_period(TICK) {
            log(LogLevel::Error, &format!("lockmesh: cannot start the tick: {e:?}"));
            return false;
        }
        true
    }

    fn on_tick(&mut self) {
        match self.worker.try_borrow_mut() {
            Ok(mut w) => {
                // Registered here, on the worker's own thread, so wake-ups reach it.
                w.register_wake();
                w.tick(now_ms());
            }
            Err(_) => return,
        }
        self.calls();
    }

    fn on_queue_ready(&mut self, queue_id: u32) {
        match self.worker.try_borrow_mut() {
            Ok(mut w) => w.on_wake(queue_id, now_ms()),
            Err(_) => return,
        }
        self.calls();
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // Without a configuration (cannot happen after a successful on_configure) the
        // request context refuses everything: fail closed.
        Some(Box::new(Request::new(context_id, self.worker.clone())))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
