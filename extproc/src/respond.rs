//! The arbiter's one table from a refusal to an answer, for every route of every
//! port that speaks the lock API's codes: the ext_proc API routes, the
//! transparent-mode refusals and the filter's VM routes (`internal`). Status,
//! `x-lockmesh-error`, `retry-after` and retryability all come from
//! [`Code`] (`core/src/code.rs`); the body is [`ErrorBody`]. The operator plane
//! (admin actions, console) has its own codes and one table of its own:
//! `AdminError::status` in `extproc/ops/src/admin/mod.rs`, answered by
//! [`admin_refusal`].

use axum::{
    http::{header, HeaderName, HeaderValue, StatusCode},
    response::{IntoResponse, Response},
};
use lockmesh_core::{headers, wire::ErrorBody, Code, Reason};
use lockmesh_ops::admin::AdminError;
use serde::Serialize;

use crate::lock::LockError;

/// An API answer, before it becomes an ext_proc `ImmediateResponse` or an HTTP
/// response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiResponse {
    /// HTTP status.
    pub status: u16,
    /// JSON body (a `core::wire` type, serialised).
    pub body: String,
    /// Response headers besides `content-type` (always `application/json`).
    pub headers: Vec<(&'static str, String)>,
    /// The refusal's stable code; `None` on an answer that is not a refusal.
    /// What reads an answer (metrics, the re-run decision) reads this, never the
    /// status or the body.
    pub code: Option<Code>,
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
    /// The home region, for `wrong_region`.
    pub region: Option<String>,
    /// Which quota, for `quota_exceeded`.
    pub quota: Option<lockmesh_core::quota::Quota>,
}

// === impl ApiError ===

impl ApiError {
    /// A refusal with `code`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code, message: message.into(), reason: None, region: None, quota: None }
    }

    /// The `421 wrong_region` refusal: the key's namespace is homed in `region`
    /// (in the body's `region` and in [`headers::REGION`]).
    pub fn wrong_region(namespace: &str, region: &str) -> Self {
        let message =
            format!("namespace {namespace} is homed in region {region}: send the request to that region's lock tier");
        Self { region: Some(region.to_owned()), ..Self::new(Code::WrongRegion, message) }
    }
}

impl From<LockError> for ApiError {
    fn from(e: LockError) -> Self {
        let code = match &e {
            LockError::Contended(_) => Code::Contended,
            LockError::PermitsAboveLimit { .. } => Code::BadRequest,
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
            LockError::QuotaExceeded(_) => Code::QuotaExceeded,
            LockError::KeysSpanClusters(_) => Code::KeysSpanClusters,
            LockError::BadKeys(_) | LockError::NotElectionClass(_) => Code::BadRequest,
            LockError::ModeConflict(_) => Code::ModeConflict,
            LockError::CapabilityDisabled(_) => Code::CapabilityDisabled,
        };
        let reason = match e {
            LockError::Contended(r) => Some(r),
            _ => None,
        };
        let quota = match &e {
            LockError::QuotaExceeded(x) => Some(x.quota),
            _ => None,
        };
        Self { code, message: e.to_string(), reason, region: None, quota }
    }
}

impl From<ApiError> for ApiResponse {
    fn from(e: ApiError) -> Self {
        let mut headers: Vec<_> = e.code.error_headers().map(|(k, v)| (k, v.to_owned())).collect();
        if let Some(region) = &e.region {
            headers.push((headers::REGION, region.clone()));
        }
        let mut body = ErrorBody::new(e.code, e.message);
        body.reason = e.reason.map(Into::into);
        body.region = e.region;
        body.quota = e.quota.map(|q| q.as_str().to_owned());
        ApiResponse { status: e.code.status(), body: to_json(&body), headers, code: Some(e.code) }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        ApiResponse::from(self).into_response()
    }
}

// === impl ApiResponse ===

impl ApiResponse {
    /// A 200 with `body` (a `core::wire` answer).
    pub fn ok(body: &impl Serialize) -> Self {
        Self { status: 200, body: to_json(body), headers: Vec::new(), code: None }
    }
}

impl IntoResponse for ApiResponse {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut r = (status, self.body).into_response();
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        for (k, v) in self.headers {
            if let Ok(v) = HeaderValue::from_str(&v) {
                h.append(HeaderName::from_static(k), v);
            }
        }
        r
    }
}

/// A wire type as JSON. The types of `core::wire` have string keys and no
/// fallible `Serialize`, so this cannot fail; were it to, the answer is still
/// valid JSON naming the `internal` code.
fn to_json(v: &impl Serialize) -> String {
    serde_json::to_string(v).unwrap_or_else(|_| r#"{"code":"internal","message":"answer not serialisable"}"#.into())
}

/// The operator plane's refusal on any port: `AdminError::status`, the body
/// `{code, message}` and, for the 401s, `www-authenticate: Bearer`.
pub(crate) fn admin_refusal(e: &AdminError) -> Response {
    let status = StatusCode::from_u16(e.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(e.body())).into_response();
    if e.wants_token() {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    r
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
            (
                LockError::QuotaExceeded(crate::lock::quota::Exceeded {
                    quota: lockmesh_core::quota::Quota::Holds,
                    namespace: "ns".into(),
                    used: 3,
                    limit: 3,
                }),
                429,
                "quota_exceeded",
            ),
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
        let x = crate::lock::quota::Exceeded {
            quota: lockmesh_core::quota::Quota::AcquireRate,
            namespace: "ns".into(),
            used: 5,
            limit: 5,
        };
        let r = ApiResponse::from(ApiError::from(LockError::QuotaExceeded(x)));
        assert!(r.body.contains("\"quota\":\"acquire_rate\""), "{}", r.body);
        assert!(r.headers.contains(&("retry-after", "1".to_owned())));
    }

    #[test]
    fn every_code_answers_what_core_says() {
        for c in Code::ALL {
            let r = ApiResponse::from(ApiError::new(c, "m \"quoted\"\n"));
            assert_eq!(r.status, c.status(), "{c}");
            assert_eq!(r.code, Some(c), "{c}");
            let want: Vec<_> = c.error_headers().map(|(k, v)| (k, v.to_owned())).collect();
            assert_eq!(r.headers, want, "{c}");
            // The same bytes as the Wasm filter's hand-written body.
            assert_eq!(r.body, lockmesh_core::code::error_body(c, "m \"quoted\"\n", None), "{c}");
        }
    }

    #[test]
    fn the_redirect_names_the_region_in_body_and_header() {
        let r = ApiResponse::from(ApiError::wrong_region("search", "us-1"));
        assert_eq!(r.status, 421);
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!((v["code"].as_str(), v["region"].as_str()), (Some("wrong_region"), Some("us-1")));
        assert!(r.headers.contains(&(headers::REGION, "us-1".to_owned())));
        assert!(r.headers.contains(&("x-lockmesh-error", "wrong_region".to_owned())));
    }
}
