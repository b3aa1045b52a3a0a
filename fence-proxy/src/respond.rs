//! fence-proxy's one error-to-response table: stable code, HTTP status, JSON body
//! `{code, message}` and the `x-lockmesh-error` header. Messages never carry a
//! token, a proof or a resource id.

use axum::{
    http::{HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use lockmesh_core::headers;

/// Why fence-proxy refused or could not complete a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    /// A write without `x-lock-proof` (428 `grant_required`).
    #[error("this route is a write: send the grant's x-lock-proof (and optionally x-lock-token)")]
    GrantRequired,
    /// A malformed, oversized or inconsistent grant (400 `bad_token`).
    #[error("{0}")]
    BadToken(String),
    /// Unknown key id or invalid signature (403 `bad_proof`).
    #[error("{0}")]
    BadProof(String),
    /// A genuine proof of another lock than the resource's (403 `wrong_key`).
    #[error("the grant is for another lock than the one guarding this resource")]
    WrongKey,
    /// Below the mark, or equal under `strict` (409 `stale_token`).
    #[error("the token is not above the highest token this resource has seen{0}")]
    StaleToken(&'static str),
    /// No route matches and no unlisted guard is configured (403 `unlisted_route`).
    #[error("no route matches this path; an unlisted route is a write nobody can authorise")]
    UnlistedRoute,
    /// The request target is not in canonical form (400 `bad_request`, as the
    /// filter answers it): the message names the rule it breaks.
    #[error("the request target is not canonical: {0} (docs/TRANSPARENT.md defines the canonical form)")]
    NotCanonical(lockmesh_core::canon::CanonError),
    /// A route template could not be filled (400 `bad_request`).
    #[error("{0}")]
    BadRequest(String),
    /// The body is over `max_body_bytes` (413 `body_too_large`).
    #[error("the request body is over max_body_bytes")]
    BodyTooLarge,
    /// The marks store failed: nothing was forwarded (503 `marks_unavailable`).
    #[error("the marks store failed; nothing was forwarded: {0}")]
    MarksUnavailable(String),
    /// The store could not be reached; it did not receive the write (502 `store_unavailable`).
    #[error("the store could not be reached: {0}")]
    StoreUnavailable(String),
    /// The store did not answer in time: the write may or may not have landed
    /// (504 `store_timeout`); the resource is quarantined.
    #[error(
        "the store did not answer within upstream_timeout_ms; the write may or may not have landed \
         (writes to this resource are refused until the store answers it or quarantine_ms passes)"
    )]
    StoreTimeout,
    /// A header name that a server reading `_` as `-` (and case-insensitively)
    /// would read as a lock or lockmesh header, or as another header of the same
    /// request, in a spelling other than the canonical one (400 `header_twin`).
    /// `.0` is the name as sent, `.1` the name it reads as.
    #[error(
        "header {0:?} reads as {1:?} to a server that reads '_' as '-': fence-proxy checks only the \
         canonical spelling, so it refuses every other one; send {1:?} once, spelt with '-'"
    )]
    HeaderTwin(String, String),
    /// A lock or lockmesh header that appears more than once (400 `duplicate_header`).
    #[error("header {0:?} appears more than once; a lock header may appear once")]
    DuplicateHeader(String),
    /// A method or path override header (400 `override_header`), on every route.
    #[error(
        "header {0:?} asks the store for another method or path than the request's; fence-proxy decides \
         on the request's own method and path and refuses every override header"
    )]
    OverrideHeader(String),
    /// A body on a method that carries none here (GET, HEAD, OPTIONS, TRACE; DELETE
    /// unless its route allows one): 400 `body_not_allowed`. A store that does not
    /// read it would take its bytes for the next request on the connection.
    #[error(
        "a {0} request may not carry a body here (content-length above 0, transfer-encoding or data): \
         a store that does not read it would take it for the next request"
    )]
    BodyNotAllowed(String),
    /// Writes to the resource are refused: an earlier write's outcome is unknown
    /// (the store did not answer in time, or the connection was lost with the
    /// write in flight) and it may still land (503 `fence_quarantined`).
    #[error(
        "an earlier write to this resource is still unaccounted for (the store did not answer it in time \
         or the connection was lost); writes are refused until the store answers it or quarantine_ms passes"
    )]
    Quarantined,
}

// === impl FenceError ===

impl FenceError {
    /// The stable code.
    pub fn code(&self) -> &'static str {
        match self {
            FenceError::GrantRequired => "grant_required",
            FenceError::BadToken(_) => "bad_token",
            FenceError::BadProof(_) => "bad_proof",
            FenceError::WrongKey => "wrong_key",
            FenceError::StaleToken(_) => "stale_token",
            FenceError::UnlistedRoute => "unlisted_route",
            FenceError::NotCanonical(_) | FenceError::BadRequest(_) => "bad_request",
            FenceError::BodyTooLarge => "body_too_large",
            FenceError::MarksUnavailable(_) => "marks_unavailable",
            FenceError::StoreUnavailable(_) => "store_unavailable",
            FenceError::StoreTimeout => "store_timeout",
            FenceError::HeaderTwin(..) => "header_twin",
            FenceError::DuplicateHeader(_) => "duplicate_header",
            FenceError::OverrideHeader(_) => "override_header",
            FenceError::BodyNotAllowed(_) => "body_not_allowed",
            FenceError::Quarantined => "fence_quarantined",
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            FenceError::GrantRequired => StatusCode::PRECONDITION_REQUIRED,
            FenceError::BadToken(_)
            | FenceError::NotCanonical(_)
            | FenceError::BadRequest(_)
            | FenceError::HeaderTwin(..)
            | FenceError::DuplicateHeader(_)
            | FenceError::OverrideHeader(_)
            | FenceError::BodyNotAllowed(_) => StatusCode::BAD_REQUEST,
            FenceError::BadProof(_) | FenceError::WrongKey | FenceError::UnlistedRoute => StatusCode::FORBIDDEN,
            FenceError::StaleToken(_) => StatusCode::CONFLICT,
            FenceError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            FenceError::MarksUnavailable(_) | FenceError::Quarantined => StatusCode::SERVICE_UNAVAILABLE,
            FenceError::StoreUnavailable(_) => StatusCode::BAD_GATEWAY,
            FenceError::StoreTimeout => StatusCode::GATEWAY_TIMEOUT,
        }
    }
}

impl IntoResponse for FenceError {
    fn into_response(self) -> Response {
        let body = lockmesh_core::wire::error::FenceErrorBody { code: self.code().into(), message: self.to_string() };
        let body = serde_json::to_string(&body).unwrap_or_default();
        let mut r = (self.status(), [("content-type", "application/json")], body).into_response();
        r.headers_mut().insert(headers::ERROR, HeaderValue::from_static(self.code()));
        if self == FenceError::Quarantined {
            r.headers_mut().insert(headers::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_statuses_are_stable() {
        let cases = [
            (FenceError::GrantRequired, 428, "grant_required"),
            (FenceError::BadToken("x".into()), 400, "bad_token"),
            (FenceError::BadProof("x".into()), 403, "bad_proof"),
            (FenceError::WrongKey, 403, "wrong_key"),
            (FenceError::StaleToken(""), 409, "stale_token"),
            (FenceError::UnlistedRoute, 403, "unlisted_route"),
            (FenceError::NotCanonical(lockmesh_core::canon::CanonError::EmptySegment(1)), 400, "bad_request"),
            (FenceError::BadRequest("x".into()), 400, "bad_request"),
            (FenceError::BodyTooLarge, 413, "body_too_large"),
            (FenceError::MarksUnavailable("x".into()), 503, "marks_unavailable"),
            (FenceError::StoreUnavailable("x".into()), 502, "store_unavailable"),
            (FenceError::StoreTimeout, 504, "store_timeout"),
            (FenceError::HeaderTwin("x_lock_token".into(), "x-lock-token".into()), 400, "header_twin"),
            (FenceError::DuplicateHeader("x-lock-token".into()), 400, "duplicate_header"),
            (FenceError::OverrideHeader("x-http-method-override".into()), 400, "override_header"),
            (FenceError::BodyNotAllowed("GET".into()), 400, "body_not_allowed"),
            (FenceError::Quarantined, 503, "fence_quarantined"),
        ];
        for (e, status, code) in cases {
            assert_eq!((e.status().as_u16(), e.code()), (status, code));
            let r = e.into_response();
            assert_eq!(r.headers().get("x-lockmesh-error").unwrap(), code);
        }
    }
}
