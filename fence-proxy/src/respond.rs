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
    /// (504 `store_timeout`).
    #[error("the store did not answer within upstream_timeout_ms; the write may or may not have landed")]
    StoreTimeout,
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
        }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            FenceError::GrantRequired => StatusCode::PRECONDITION_REQUIRED,
            FenceError::BadToken(_) | FenceError::NotCanonical(_) | FenceError::BadRequest(_) => {
                StatusCode::BAD_REQUEST
            }
            FenceError::BadProof(_) | FenceError::WrongKey | FenceError::UnlistedRoute => StatusCode::FORBIDDEN,
            FenceError::StaleToken(_) => StatusCode::CONFLICT,
            FenceError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            FenceError::MarksUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
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
        ];
        for (e, status, code) in cases {
            assert_eq!((e.status().as_u16(), e.code()), (status, code));
            let r = e.into_response();
            assert_eq!(r.headers().get("x-lockmesh-error").unwrap(), code);
        }
    }
}
