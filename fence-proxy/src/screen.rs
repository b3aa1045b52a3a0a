//! What fence-proxy lets through: the request's headers, method and body are
//! screened before anything is classified, and the store gets only headers the
//! fence checked or set.
//!
//! Names are compared as a permissive server reads them (`lockmesh_core::headers::fold`,
//! the fold the Wasm filter uses: ASCII lower-case, `_` read as `-`): a WSGI or CGI
//! store reads `x_lock_token` and `X-Lock-Token` both as `HTTP_X_LOCK_TOKEN`, and joins
//! them with the real one.
//!
//! Refused on every request, read or write ([`screen_headers`], [`screen_body`]):
//! - a name that folds to a lock header (`x-lock-*`) or a lockmesh header
//!   (`x-lockmesh-*`) but is not spelt as the fold (`x_lock_token`, `x-lock_proof`):
//!   `400 header_twin`;
//! - two spellings in one request that fold to one name (`x-tenant` and `x_tenant`,
//!   which a template header could be): `400 header_twin`;
//! - a lock or lockmesh header that appears more than once: `400 duplicate_header`;
//! - a method override ([`METHOD_OVERRIDES`]) or path override ([`PATH_OVERRIDES`])
//!   header in any spelling: `400 override_header` (a store that honours one would
//!   run a write the fence classified as a read, or write another path);
//! - a body on GET, HEAD, OPTIONS or TRACE, and on DELETE unless the route allows
//!   one: `400 body_not_allowed` (a store that does not read it takes its bytes for
//!   the next request on the connection: request smuggling).
//!
//! Forwarded ([`upstream_headers`]): every lock and lockmesh header the client sent
//! is removed; a write gets the verified token as `x-lock-token` (the only lock
//! header the store sees), every request the fence's `x-lockmesh-fence-instance`.
//! Hop-by-hop headers (and those `connection` names), `host`, `expect`,
//! `content-length` and `transfer-encoding` are removed: the fence frames the body
//! it forwards itself.

use std::collections::HashMap;

use http::{header, HeaderMap, HeaderValue, Method};
use lockmesh_core::{headers, FencingToken};

use crate::respond::FenceError;

/// Method and path override headers (folded), refused on every route: the lists
/// the Wasm filter refuses too, kept in `lockmesh_core::headers`.
pub use lockmesh_core::headers::{METHOD_OVERRIDES, PATH_OVERRIDES};
/// Methods that never carry a body through the fence.
pub const BODILESS: [Method; 4] = [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE];

/// Hop-by-hop headers (RFC 9110 7.6.1) and the framing the fence redoes itself.
const NOT_FORWARDED: [&str; 11] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "expect",
    "host",
    "proxy-authorization",
];

/// Whether a folded name is a lock (`x-lock-*`) or lockmesh (`x-lockmesh-*`) header.
pub fn is_lock_header(folded: &str) -> bool {
    folded.starts_with("x-lock-") || folded.starts_with(headers::INTERNAL_PREFIX)
}

/// Whether a folded name is a method or path override header.
pub fn is_override_header(folded: &str) -> bool {
    headers::override_header(folded).is_some()
}

/// Refuses twins, duplicate lock headers and override headers (see the module doc).
pub fn screen_headers(h: &HeaderMap) -> Result<(), FenceError> {
    let mut spellings: HashMap<String, &str> = HashMap::new();
    for name in h.keys() {
        let sent = name.as_str();
        let folded = headers::fold(sent);
        if is_override_header(&folded) {
            return Err(FenceError::OverrideHeader(sent.to_owned()));
        }
        if is_lock_header(&folded) && *folded != *sent {
            return Err(FenceError::HeaderTwin(sent.to_owned(), folded.into_owned()));
        }
        if let Some(other) = spellings.insert(folded.clone().into_owned(), sent) {
            // Report the spelling that is not the fold, if one is.
            let twin = if *folded == *sent { other } else { sent };
            return Err(FenceError::HeaderTwin(twin.to_owned(), folded.into_owned()));
        }
        if is_lock_header(&folded) && h.get_all(name).iter().nth(1).is_some() {
            return Err(FenceError::DuplicateHeader(sent.to_owned()));
        }
    }
    Ok(())
}

/// What a request's framing says about its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BodyFrame {
    /// `content-length` above 0 (or unparsable), or `transfer-encoding` present.
    pub declared: bool,
    /// The body stream is known to be empty (no data will follow the headers).
    pub known_empty: bool,
}

impl BodyFrame {
    /// Reads the framing headers and the body's own hints.
    pub fn of<B: axum::body::HttpBody>(h: &HeaderMap, body: &B) -> Self {
        let cl_nonzero = h.get_all(header::CONTENT_LENGTH).iter().any(|v| v.as_bytes() != b"0");
        let te = h.contains_key(header::TRANSFER_ENCODING);
        Self { declared: cl_nonzero || te, known_empty: body.is_end_stream() || body.size_hint().exact() == Some(0) }
    }

    /// Whether the request carries (or may carry) a body.
    pub fn has_body(self) -> bool {
        self.declared || !self.known_empty
    }
}

/// Refuses a body on a method that carries none here: GET, HEAD, OPTIONS, TRACE
/// always; DELETE unless `delete_body_allowed` (the route's `delete_body: allow`).
pub fn screen_body(method: &Method, frame: BodyFrame, delete_body_allowed: bool) -> Result<(), FenceError> {
    let bodiless = BODILESS.contains(method) || (*method == Method::DELETE && !delete_body_allowed);
    if bodiless && frame.has_body() {
        return Err(FenceError::BodyNotAllowed(method.as_str().to_owned()));
    }
    Ok(())
}

/// Rewrites a request's headers for the store (see the module doc): `token` is the
/// verified token of a write (`None` on a read), `instance` the marks instance id,
/// `body_len` the length of the body the fence forwards (`None`: no body).
pub fn upstream_headers(h: &mut HeaderMap, token: Option<FencingToken>, instance: &str, body_len: Option<usize>) {
    let nominated: Vec<String> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .filter(|n| !n.is_empty())
        .collect();
    for n in nominated.iter().map(String::as_str).chain(NOT_FORWARDED) {
        h.remove(n);
    }
    let drop: Vec<http::HeaderName> = h
        .keys()
        .filter(|n| {
            let f = headers::fold(n.as_str());
            is_lock_header(&f) || is_override_header(&f)
        })
        .cloned()
        .collect();
    for n in drop {
        h.remove(n);
    }
    if let Some(t) = token {
        if let Ok(v) = HeaderValue::from_str(&t.to_string()) {
            h.insert(headers::TOKEN, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(instance) {
        h.insert(crate::server::INSTANCE_HEADER, v);
    }
    if let Some(n) = body_len {
        h.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdrs(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (n, v) in pairs {
            h.append(http::HeaderName::from_bytes(n.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    fn code(r: Result<(), FenceError>) -> &'static str {
        r.err().map_or("ok", |e| e.code())
    }

    /// The spellings of the review (issue 41, row 2) and more: each folds to a lock
    /// or lockmesh header and is refused, alone or beside the canonical header.
    const TWINS: [&str; 14] = [
        "x_lock_token",
        "X_LOCK_TOKEN",
        "x_lock-token",
        "x-lock_token",
        "X_Lock_Token",
        "x_Lock-Token",
        "X-LOCK_TOKEN",
        "x_lock_proof",
        "x-lock_proof",
        "x_lock_key",
        "x_lockmesh_fence_instance",
        "x-lockmesh_fence-instance",
        "x_lockmesh-error",
        "x_lock_session",
    ];

    #[test]
    fn every_twin_of_a_lock_header_is_refused_alone_and_beside_the_real_one() {
        for t in TWINS {
            assert_eq!(code(screen_headers(&hdrs(&[(t, "7777777777777777")]))), "header_twin", "{t}");
            let beside = hdrs(&[("x-lock-proof", "p"), ("x-lock-token", "5"), (t, "7777777777777777")]);
            assert_eq!(code(screen_headers(&beside)), "header_twin", "{t} beside the real headers");
        }
        // The error names the spelling sent and what it reads as, never the value.
        let e = screen_headers(&hdrs(&[("x_lock_token", "7777777777777777")])).unwrap_err();
        assert_eq!(e, FenceError::HeaderTwin("x_lock_token".into(), "x-lock-token".into()));
        assert!(!e.to_string().contains("7777"));
    }

    #[test]
    fn two_spellings_of_any_header_are_refused_and_a_lone_underscore_name_is_not() {
        assert_eq!(code(screen_headers(&hdrs(&[("x-tenant", "a"), ("x_tenant", "b")]))), "header_twin");
        assert_eq!(code(screen_headers(&hdrs(&[("x_tenant", "b"), ("x-tenant", "a")]))), "header_twin");
        assert_eq!(code(screen_headers(&hdrs(&[("x_custom", "b")]))), "ok");
        assert_eq!(code(screen_headers(&hdrs(&[("x-lockfoo", "b"), ("accept", "*/*")]))), "ok");
    }

    #[test]
    fn duplicate_lock_headers_are_refused_and_single_canonical_ones_pass() {
        for n in ["x-lock-token", "x-lock-proof", "x-lock-key", "x-lockmesh-fence-instance"] {
            assert_eq!(code(screen_headers(&hdrs(&[(n, "1"), (n, "1")]))), "duplicate_header", "{n}");
            assert_eq!(code(screen_headers(&hdrs(&[(n, "1")]))), "ok", "{n}");
        }
        // Repeated ordinary headers are HTTP's business, not the fence's.
        assert_eq!(code(screen_headers(&hdrs(&[("accept", "a"), ("accept", "b")]))), "ok");
    }

    #[test]
    fn override_headers_are_refused_in_every_spelling() {
        for n in [
            "x-http-method-override",
            "X-HTTP-Method-Override",
            "x_http_method_override",
            "x-http-method",
            "x_http_method",
            "x-method-override",
            "X_Method_Override",
            "x-original-url",
            "x_original_url",
            "x-rewrite-url",
            "X_REWRITE_URL",
        ] {
            assert_eq!(code(screen_headers(&hdrs(&[(n, "PUT")]))), "override_header", "{n}");
        }
    }

    fn frame(pairs: &[(&str, &str)], body: &'static str) -> BodyFrame {
        BodyFrame::of(&hdrs(pairs), &axum::body::Body::from(body))
    }

    #[test]
    fn bodies_on_reads_and_by_default_on_delete_are_refused() {
        let empty = frame(&[], "");
        let cl0 = frame(&[("content-length", "0")], "");
        let cl74 = frame(&[("content-length", "74")], "");
        let chunked = frame(&[("transfer-encoding", "chunked")], "");
        let data = frame(&[], "PUT /orders/1 HTTP/1.1");
        for m in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE, Method::DELETE] {
            assert_eq!(code(screen_body(&m, empty, false)), "ok", "{m}");
            assert_eq!(code(screen_body(&m, cl0, false)), "ok", "{m}");
            for f in [cl74, chunked, data] {
                assert_eq!(code(screen_body(&m, f, false)), "body_not_allowed", "{m} {f:?}");
            }
        }
        // A route that allows DELETE bodies; GET stays refused whatever the route says.
        assert_eq!(code(screen_body(&Method::DELETE, cl74, true)), "ok");
        assert_eq!(code(screen_body(&Method::GET, cl74, true)), "body_not_allowed");
        for m in [Method::PUT, Method::POST, Method::PATCH] {
            assert_eq!(code(screen_body(&m, cl74, false)), "ok", "{m}");
        }
    }

    #[test]
    fn the_store_gets_only_the_verified_token_and_the_fences_own_headers() {
        let mut h = hdrs(&[
            ("x-lock-proof", "v1.k1.p.s"),
            ("x-lock-token", "999"),
            ("x-lock-session", "0123456789abcdef"),
            ("x-lockmesh-fence-instance", "forged"),
            ("x-lockmesh-filtered", "1"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("content-length", "74"),
            ("transfer-encoding", "chunked"),
            ("expect", "100-continue"),
            ("host", "fence"),
            ("x-app", "kept"),
        ]);
        let t = FencingToken::from_packed(42).unwrap();
        upstream_headers(&mut h, Some(t), "inst1", Some(3));
        let mut names: Vec<&str> = h.keys().map(http::HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["content-length", "x-app", "x-lock-token", "x-lockmesh-fence-instance"]);
        assert_eq!(h.get("x-lock-token").unwrap(), "42");
        assert_eq!(h.get("x-lockmesh-fence-instance").unwrap(), "inst1");
        assert_eq!(h.get("content-length").unwrap(), "3");
        // A read: no lock header at all, no framing.
        let mut h = hdrs(&[("x-lock-token", "7777777777777777"), ("x-lock-proof", "p"), ("content-length", "0")]);
        upstream_headers(&mut h, None, "inst1", None);
        let names: Vec<&str> = h.keys().map(http::HeaderName::as_str).collect();
        assert_eq!(names, ["x-lockmesh-fence-instance"]);
    }
}
