//! The per-request context.
//!
//! `on_http_request_headers` may answer locally (returning `Pause` after
//! `send_http_response`, which Envoy performs after the callback returns) or
//! continue. Any host-call failure answers `500 internal`, never forwarding: lock
//! routes fail closed.

use std::rc::Rc;

use lockmesh_core::{code::error_body, headers, Code};
use proxy_wasm::{
    hostcalls,
    traits::{Context, HttpContext},
    types::{Action, LogLevel, MapType},
};

use crate::{
    config::Config,
    decide::{self, Decision},
};

/// One HTTP request.
pub struct Request {
    config: Option<Rc<Config>>,
}

impl Request {
    /// A request context under `config` (`None` refuses everything).
    pub fn new(config: Option<Rc<Config>>) -> Self {
        Self { config }
    }
}

fn reply(status: u32, code: Code, body: &str) -> Action {
    let hdrs = vec![
        ("content-type", "application/json"),
        (headers::ERROR, code.as_str()),
    ];
    if let Err(e) = hostcalls::send_http_response(status, hdrs, Some(body.as_bytes())) {
        let _ = hostcalls::log(
            LogLevel::Error,
            &format!("lockmesh: local reply failed: {e:?}"),
        );
    }
    Action::Pause
}

fn internal(what: &str) -> Action {
    let _ = hostcalls::log(
        LogLevel::Error,
        &format!("lockmesh: {what}; refusing the request"),
    );
    reply(
        500,
        Code::Internal,
        &error_body(Code::Internal, "lock filter error", None),
    )
}

impl Context for Request {}

impl HttpContext for Request {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        let Some(cfg) = self.config.clone() else {
            return internal("no configuration");
        };
        let hdrs: Vec<(String, Vec<u8>)> =
            match hostcalls::get_map_bytes(MapType::HttpRequestHeaders) {
                Ok(h) => h,
                Err(e) => return internal(&format!("cannot read request headers: {e:?}")),
            };
        if let Some(trap) = &cfg.test_trap_header {
            if hdrs.iter().any(|(n, _)| n == trap) {
                // TEST ONLY (config test_trap_header): prove that a VM trap fails closed.
                panic!("lockmesh test trap");
            }
        }
        let peer = match hostcalls::get_property(vec!["connection", "uri_san_peer_certificate"]) {
            Ok(p) => p.filter(|p| !p.is_empty()),
            Err(e) => return internal(&format!("cannot read the peer certificate: {e:?}")),
        };
        match decide::on_request_headers(&cfg, &hdrs, peer.as_deref()) {
            Decision::Reject { status, code, body } => reply(status, code, &body),
            Decision::Forward { remove, set } => {
                for name in &remove {
                    if let Err(e) = hostcalls::remove_map_value(MapType::HttpRequestHeaders, name) {
                        return internal(&format!("cannot remove a header: {e:?}"));
                    }
                }
                for (name, value) in &set {
                    if let Err(e) =
                        hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(value))
                    {
                        return internal(&format!("cannot set a header: {e:?}"));
                    }
                }
                Action::Continue
            }
        }
    }
}
