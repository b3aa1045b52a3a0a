//! The per-request context.
//!
//! - `on_http_request_headers` decides ([`crate::decide`]); a refusal is answered
//!   locally (`send_http_response`, performed by Envoy after the callback returns, and
//!   `Pause`). A passed request has its internal and identity headers removed and the
//!   filter's mark set (an unlocked one's in filter state, [`abi::set_unlocked_mark`]);
//!   an acquire then goes through its key's queue
//!   ([`crate::worker`]): `Continue` with its budget when it is the key's head here,
//!   `Pause` when queued (another context or the tick resumes or answers it later).
//!   Any host-call failure answers `500 internal`, never forwarding: lock routes fail
//!   closed.
//! - `on_done` (and `Drop`, should the host delete a context without `on_done`): the
//!   request ended, answered or abandoned; its queue place and local-limit slot are
//!   given back and the next waiter of its key is handed the key.

use std::{cell::RefCell, rc::Rc};

use lockmesh_core::{headers, LockKey};
use proxy_wasm::{
    hostcalls,
    traits::{Context, HttpContext},
    types::{Action, LogLevel, MapType},
};

use crate::{
    abi,
    decide::{self, Decision},
    metrics::Outcome,
    route::Route,
    worker::{self, now_ms, Refusal, Step, Ticket, Worker},
};

/// One HTTP request.
pub struct Request {
    ctx: u32,
    worker: Rc<RefCell<Worker>>,
    /// Held from admission to the end of an acquire: its queue place and slot.
    ticket: Option<Ticket>,
}

impl Request {
    /// Request context `ctx` of `worker`.
    pub fn new(ctx: u32, worker: Rc<RefCell<Worker>>) -> Self {
        Self { ctx, worker, ticket: None }
    }

    /// Gives back the request's queue place, if it had one; whether it had.
    fn finish(&mut self) -> bool {
        let Some(ticket) = self.ticket.take() else {
            return false;
        };
        match self.worker.try_borrow_mut() {
            Ok(mut w) => w.finish(self.ctx, ticket, now_ms()),
            Err(_) => {
                let _ = hostcalls::log(
                    LogLevel::Critical,
                    "lockmesh: worker state busy at request end; its key stays blocked here",
                );
            }
        }
        true
    }
}

fn internal(what: &str) -> Action {
    let _ = hostcalls::log(LogLevel::Error, &format!("lockmesh: {what}; refusing the request"));
    worker::reply(&Refusal::internal());
    Action::Pause
}

impl Context for Request {
    fn on_done(&mut self) -> bool {
        // Hand-overs moved the effective context; later host calls are ours again.
        // A request without a queue place (lock-free, refused, or answered by the
        // arbiter's API without queueing) handed nothing over: no host call.
        if self.finish() {
            let _ = hostcalls::set_effective_context(self.ctx);
        }
        true
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let worker = self.worker.clone();
        let Ok(mut w) = worker.try_borrow_mut() else {
            return internal("worker state busy");
        };
        let Some(cfg) = w.config() else {
            return internal("no configuration");
        };
        let hdrs: Vec<(String, Vec<u8>)> = match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
            Ok(h) => h,
            Err(e) => return internal(&format!("cannot read request headers: {e:?}")),
        };
        #[cfg(feature = "test-trap")]
        crate::trap::spring(&cfg, &hdrs);
        let peer = match hostcalls::get_property(vec!["connection", "uri_san_peer_certificate"]) {
            Ok(p) => p.filter(|p| !p.is_empty()),
            Err(e) => return internal(&format!("cannot read the peer certificate: {e:?}")),
        };
        let pass = match decide::on_request_headers(&cfg, &hdrs, peer.as_deref()) {
            Decision::Reject { status, code, body } => {
                // The namespace of the key, when the key itself is well formed.
                let key = hdrs.iter().find(|(n, _)| n == headers::KEY).and_then(|(_, v)| LockKey::parse(v).ok());
                let ns = cfg.ns_label(key.as_ref().map(LockKey::as_str));
                w.metrics().request(ns, Outcome::of_code(code));
                worker::reply(&Refusal { status, code, body, outcome: Outcome::of_code(code) });
                return Action::Pause;
            }
            Decision::Pass(p) => p,
        };
        let ns = cfg.ns_label(pass.key.as_ref().map(|k| k.as_str())).to_owned();
        for name in &pass.remove {
            if let Err(e) = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name) {
                w.metrics().request(&ns, Outcome::Internal);
                return internal(&format!("cannot remove a header: {e:?}"));
            }
        }
        for (name, value) in &pass.set {
            if abi::set_request_header(name, value).is_err() {
                w.metrics().request(&ns, Outcome::Internal);
                return internal("cannot set a header");
            }
        }
        if pass.unlocked {
            if abi::set_unlocked_mark().is_err() {
                w.metrics().request(&ns, Outcome::Internal);
                return internal("cannot set the unlocked mark");
            }
            w.metrics().request(&ns, Outcome::Unlocked);
            return Action::Continue;
        }
        let (true, Some(key)) = (pass.route.queues(), &pass.key) else {
            w.metrics().request(&ns, Outcome::Forwarded);
            return Action::Continue;
        };
        let now = now_ms();
        let hold = if pass.route == Route::Transparent {
            // The request's own hold: this VM's session carries it, the hold number
            // releases it when the request ends.
            let Ok((vm, n)) = w.open_hold(now) else {
                w.metrics().request(&ns, Outcome::Internal);
                return internal("cannot open a transparent hold");
            };
            let hold = n.to_string();
            if abi::set_request_header(headers::VM, &vm).is_err()
                || abi::set_request_header(headers::HOLD, &hold).is_err()
            {
                // Not admitted: nothing to release (the hold number just stays unused).
                w.metrics().request(&ns, Outcome::Internal);
                return internal("cannot set the hold headers");
            }
            Some(n)
        } else {
            None
        };
        let (step, ticket) = w.admit(&cfg, self.ctx, key, pass.wait_ms, hold, now);
        self.ticket = ticket;
        match step {
            Step::Forward { budget_ms } => {
                let budget = budget_ms.to_string();
                if abi::set_request_header(headers::BUDGET_MS, &budget).is_err() {
                    w.metrics().request(&ns, Outcome::Internal);
                    return internal("cannot set the budget header");
                }
                w.metrics().request(&ns, Outcome::Forwarded);
                Action::Continue
            }
            Step::Pause => Action::Pause,
            Step::Refuse(r) => {
                w.metrics().request(&ns, r.outcome);
                worker::reply(&r);
                Action::Pause
            }
        }
    }
}
