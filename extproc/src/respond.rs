//! The one table that turns an error into a response: stable code, HTTP status,
//! JSON body `{code, message[, reason]}` and the `x-lockmesh-error` header.

use lockmesh_core::{code::error_body, Code, Reason};

use crate::lock::LockError;

/// An API answer, before it becomes an ext_proc `ImmediateResponse`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiResponse {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: String,
    /// Extra response headers.
    pub headers: Vec<(&'static str, String)>,
}

/// A refusal from the API layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Stable code.
    pub code: Code,
    /// Human message (never a key or token).
    pub message: String,
    /// Why, for `contended`.
    pub reason: Option<Reason>,
}

impl ApiError {
    /// A refusal with `code`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), reason: None }
    }
}

impl From<LockError> for ApiError {
    fn from(e: LockError) -> Self {
        let code = match &e {
            LockError::Contended(_) => Code::Contended,
            LockError::Leaked => Code::Leaked,
            LockError::NotHolder => Code::NotHolder,
            LockError::SessionExpired => Code::SessionExpired,
            LockError::SessionClassMismatch { .. } => Code::SessionClassMismatch,
            LockError::Sealed(_) => Code::Sealed,
            LockError::Unavailable(_) => Code::Unavailable,
            // Nobody is left to read it; answered for completeness.
            LockError::Cancelled => Code::Unavailable,
            LockError::Internal(_) => Code::Internal,
            LockError::Draining(_) => Code::Draining,
            // Routed again by `tiers`; answered only if the map keeps changing.
            LockError::Moved => Code::Unavailable,
            LockError::SpoolFull(_) => Code::SpoolFull,
        };
        let reason = match e {
            LockError::Contended(r) => Some(r),
            _ => None,
        };
        Self { code, message: e.to_string(), reason }
    }
}

impl From<ApiError> for ApiResponse {
    fn from(e: ApiError) -> Self {
        let mut headers = vec![(lockmesh_core::headers::ERROR, e.code.as_str().to_owned())];
        if matches!(e.code, Code::Unavailable | Code::Sealed | Code::Draining | Code::SpoolFull) {
            headers.push(("retry-after", "1".to_owned()));
        }
        ApiResponse { status: e.code.http_status(), body: error_body(e.code, &e.message, e.reason), headers }
    }
}

impl ApiResponse {
    /// A 200 with a JSON body.
    pub fn ok(body: serde_json::Value) -> Self {
        Self { status: 200, body: body.to_string(), headers: Vec::new() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_lock_error_has_a_stable_code() {
        let cases = [
            (LockError::Contended(Reason::KeyGated), 409, "contended"),
            (LockError::Leaked, 409, "leaked"),
            (LockError::NotHolder, 409, "not_holder"),
            (LockError::SessionExpired, 410, "session_expired"),
            (LockError::Sealed("x".into()), 503, "sealed"),
            (LockError::Unavailable("x".into()), 503, "unavailable"),
            (LockError::Internal("x".into()), 500, "internal"),
            (LockError::SpoolFull("x".into()), 503, "spool_full"),
        ];
        for (e, status, code) in cases {
            let r = ApiResponse::from(ApiError::from(e));
            assert_eq!(r.status, status);
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["code"], code);
            assert!(r.headers.contains(&("x-lockmesh-error", code.to_owned())));
        }
        let r = ApiResponse::from(ApiError::from(LockError::Contended(Reason::LockContended)));
        assert!(r.body.contains("\"reason\":\"lock_contended\""));
    }
}
