//! Two-person admin actions (ADR-03, ADR-20): force release and epoch advance.
//!
//! An operator *requests* an action with a reason; a *different* operator
//! *approves* it, and only the approval executes. Both are authenticated by a JWT
//! verified against a configured JWKS ([`jwt`]). Everything lives in etcd under
//! the key root:
//!
//! ```text
//! <root>/adm/req/<id>          AdminRequest: action, reason, requester, state, approver
//! <root>/adm/log/<ms>-<rand>   LogEntry: every request, approval and refusal
//! <root>/f/<digest>            ForceRecord: the last force release of a key (audit: force_release)
//! ```
//!
//! A force release deletes the key's holds, writes the force record and marks the
//! request executed in one transaction, guarded by the mod revisions of the request
//! and of each hold as shown to the approver, so it releases exactly what was
//! shown. An epoch advance runs [`crate::restore::advance`] after a guarded
//! transaction marks the request approved (so two approvals cannot both run it).
//!
//! Refusals carry a stable code ([`AdminError::code`]); `docs/ADMIN.md` lists them.

pub mod etcd_roles;
pub mod flow;
pub mod jwt;

/// The arbiter's admin-action routes (on its ext_proc port, mTLS, for
/// `operators.allowed_clients` only; docs/ADMIN.md).
pub mod routes {
    /// Path of a new request.
    pub const REQUEST: &str = "/internal/v1/admin/request";
    /// Path of a request's preview.
    pub const SHOW: &str = "/internal/v1/admin/show";
    /// Path of an approval (executes).
    pub const APPROVE: &str = "/internal/v1/admin/approve";
    /// Path of the request list and action log.
    pub const LIST: &str = "/internal/v1/admin/list";
}

/// Why an admin action was refused or failed. Nothing changed unless the variant
/// says so.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The JWKS file is unusable (field path and why).
    #[error("JWKS: {0}")]
    Jwks(String),
    /// No operator token came with the call (`authorization: Bearer ...`).
    #[error("sign in: an operator token is required (Authorization: Bearer)")]
    TokenMissing,
    /// The token does not verify.
    #[error("token refused: {0}")]
    TokenInvalid(String),
    /// The token's `exp` has passed.
    #[error("token refused: expired {ago_s} s ago; sign in again")]
    TokenExpired {
        /// Seconds since `exp`.
        ago_s: u64,
    },
    /// The token's sign-in (`iat`) is older than the configured freshness bound.
    #[error("token refused: signed in {age_s} s ago, more than {max_s} s; sign in again")]
    TokenStale {
        /// Seconds since `iat`.
        age_s: u64,
        /// The bound (`operators.max_token_age_s`).
        max_s: u64,
    },
    /// The token lacks the operator role.
    #[error("token refused: the role {0:?} is required")]
    RoleMissing(String),
    /// The token was not issued after an MFA sign-in.
    #[error("token refused: an MFA sign-in is required (amr)")]
    MfaMissing,
    /// `--reason` is missing or blank.
    #[error("--reason: required, a sentence saying why (1..=1024 characters)")]
    ReasonMissing,
    /// The approver is the requester.
    #[error("request {id}: the approver {sub:?} is the requester; a different operator must approve")]
    SameOperator {
        id: String,
        /// The one subject.
        sub: String,
    },
    /// No such request.
    #[error("request {0}: not found")]
    NotFound(String),
    /// The request was already approved (or voided).
    #[error("request {id}: already {state}; nothing changed")]
    NotPending {
        id: String,
        /// The request's state as its record stores it (e.g. `executed`).
        state: String,
    },
    /// The request's approval window has passed.
    #[error("request {0}: expired before approval; request again")]
    RequestExpired(String),
    /// The key has no hold to release.
    #[error("no hold on this key (digest {0}); nothing to release")]
    NoHold(String),
    /// The holds changed between what the approver was shown and the approval.
    #[error(
        "the key's holds changed since they were shown ({0}); nothing changed: show the request and approve again"
    )]
    HoldsChanged(String),
    /// The caller's certificate is not one of `operators.allowed_clients`.
    #[error("client certificate {0:?} may not call admin actions (operators.allowed_clients)")]
    ClientDenied(String),
    /// The arbiter has no `operators` section: admin actions are off.
    #[error("admin actions are not configured on this arbiter (operators in its config)")]
    NotConfigured,
    /// The request to the arbiter is malformed (field path and why).
    #[error("bad admin call: {0}")]
    BadCall(String),
    /// The lock key is not a valid key.
    #[error("KEY: {0}")]
    BadKey(String),
    /// A console API request came from a peer outside `console.api_from`: the
    /// admin port is plain HTTP, so an operator token may cross only loopback
    /// (`kubectl port-forward`) or the networks the config names.
    #[error("the console API answers only peers in console.api_from (default loopback: use kubectl port-forward); {0} is not one")]
    RemoteRefused(String),
    /// A console route named something that is not a key digest.
    #[error("digest: 64 lowercase hex digits (lockctl inspect KEY prints it)")]
    BadDigest,
    /// A console route named a class the registry in force does not have.
    #[error("class {0:?} is not in the registry in force")]
    UnknownClass(String),
    /// The epoch advance failed (the request stays approved; re-run `lockctl epoch-advance` to resume).
    #[error("epoch advance: {0}")]
    Advance(String),
    /// etcd or a file.
    #[error("{0}")]
    Io(String),
}

impl AdminError {
    /// The stable code of this refusal, e.g. `admin.same_operator`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Jwks(_) => "admin.jwks_invalid",
            Self::TokenMissing => "admin.token_missing",
            Self::TokenInvalid(_) => "admin.token_invalid",
            Self::TokenExpired { .. } => "admin.token_expired",
            Self::TokenStale { .. } => "admin.token_stale",
            Self::RoleMissing(_) => "admin.role_missing",
            Self::MfaMissing => "admin.mfa_missing",
            Self::ReasonMissing => "admin.reason_missing",
            Self::SameOperator { .. } => "admin.same_operator",
            Self::NotFound(_) => "admin.request_not_found",
            Self::NotPending { .. } => "admin.request_not_pending",
            Self::RequestExpired(_) => "admin.request_expired",
            Self::NoHold(_) => "admin.no_hold",
            Self::BadKey(_) => "admin.bad_key",
            Self::BadDigest => "console.bad_digest",
            Self::RemoteRefused(_) => "console.remote_refused",
            Self::UnknownClass(_) => "console.unknown_class",
            Self::HoldsChanged(_) => "admin.holds_changed",
            Self::ClientDenied(_) => "admin.client_denied",
            Self::NotConfigured => "admin.not_configured",
            Self::BadCall(_) => "admin.bad_call",
            Self::Advance(_) => "admin.advance_failed",
            Self::Io(_) => "admin.unavailable",
        }
    }

    /// The process exit code: 77 (EX_NOPERM) for identity refusals, 65 for a
    /// refused request, 1 for etcd or file trouble.
    pub fn exit_code(&self) -> u8 {
        exit_code_of(self.code())
    }

    /// The HTTP status every port answers this refusal with (the admin-action
    /// routes on the ext_proc port and the console on the admin port): the one
    /// table of the operator plane, by code, never by exit code.
    ///
    /// | Status | Codes |
    /// |---|---|
    /// | 400 | `bad_call`, `bad_key`, `reason_missing`, `console.bad_digest` |
    /// | 401 | `token_missing`, `token_invalid`, `token_expired`, `token_stale` |
    /// | 403 | `role_missing`, `mfa_missing`, `same_operator`, `client_denied`, `console.remote_refused` |
    /// | 404 | `request_not_found`, `not_configured`, `console.unknown_class` |
    /// | 409 | `request_not_pending`, `request_expired`, `no_hold`, `holds_changed` |
    /// | 503 | `jwks_invalid`, `advance_failed`, `unavailable` |
    pub fn status(&self) -> u16 {
        match self {
            Self::BadCall(_) | Self::BadKey(_) | Self::ReasonMissing | Self::BadDigest => 400,
            Self::TokenMissing | Self::TokenInvalid(_) | Self::TokenExpired { .. } | Self::TokenStale { .. } => 401,
            Self::RoleMissing(_)
            | Self::MfaMissing
            | Self::SameOperator { .. }
            | Self::ClientDenied(_)
            | Self::RemoteRefused(_) => 403,
            Self::NotFound(_) | Self::NotConfigured | Self::UnknownClass(_) => 404,
            Self::NotPending { .. } | Self::RequestExpired(_) | Self::NoHold(_) | Self::HoldsChanged(_) => 409,
            Self::Jwks(_) | Self::Advance(_) | Self::Io(_) => 503,
        }
    }

    /// Whether an answer with this refusal asks for a bearer token
    /// (`www-authenticate: Bearer`, RFC 6750): the 401s.
    pub fn wants_token(&self) -> bool {
        self.status() == 401
    }

    /// The refusal body every port answers: `{"code", "message"}`.
    pub fn body(&self) -> lockmesh_core::wire::admin::AdminErrorBody {
        lockmesh_core::wire::admin::AdminErrorBody { code: self.code().to_owned(), message: self.to_string() }
    }
}

/// The exit code of a refusal by its stable code (the arbiter answers codes;
/// `lockctl` exits with this): 77 identity, 65 request, 1 etcd, files or the arbiter.
pub fn exit_code_of(code: &str) -> u8 {
    match code {
        "admin.token_missing"
        | "admin.token_invalid"
        | "admin.token_expired"
        | "admin.token_stale"
        | "admin.role_missing"
        | "admin.mfa_missing"
        | "admin.same_operator"
        | "admin.client_denied"
        | "console.remote_refused" => 77,
        "admin.reason_missing"
        | "admin.request_not_found"
        | "admin.request_not_pending"
        | "admin.request_expired"
        | "admin.no_hold"
        | "admin.bad_key"
        | "admin.holds_changed"
        | "admin.bad_call"
        | "console.bad_digest"
        | "console.unknown_class" => 65,
        _ => 1,
    }
}

/// The operator token of an `authorization` header value: `Bearer <token>` (the
/// scheme in any case, RFC 7235), or [`AdminError::TokenMissing`]. The token is
/// never logged or stored.
pub fn bearer(authorization: Option<&str>) -> Result<&str, AdminError> {
    let v = authorization.map(str::trim_start).unwrap_or_default();
    let token = match v.split_at_checked(7) {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer ") => rest.trim(),
        _ => "",
    };
    if token.is_empty() {
        Err(AdminError::TokenMissing)
    } else {
        Ok(token)
    }
}

/// An etcd or file failure as an [`AdminError::Io`] (`admin.unavailable`).
pub fn io(e: impl std::fmt::Display) -> AdminError {
    AdminError::Io(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_token_is_taken_in_any_case_and_nothing_else_is() {
        assert_eq!(bearer(Some("Bearer abc")).unwrap(), "abc");
        assert_eq!(bearer(Some("bearer  abc ")).unwrap(), "abc");
        for v in [None, Some(""), Some("Bearer "), Some("Basic abc"), Some("Bearerabc"), Some("abc")] {
            assert!(matches!(bearer(v), Err(AdminError::TokenMissing)), "{v:?}");
        }
    }

    #[test]
    fn every_refusal_has_one_status_and_its_exit_code_agrees() {
        let all = [
            AdminError::Jwks("x".into()),
            AdminError::TokenMissing,
            AdminError::TokenInvalid("x".into()),
            AdminError::TokenExpired { ago_s: 1 },
            AdminError::TokenStale { age_s: 2, max_s: 1 },
            AdminError::RoleMissing("r".into()),
            AdminError::MfaMissing,
            AdminError::ReasonMissing,
            AdminError::SameOperator { id: "i".into(), sub: "s".into() },
            AdminError::NotFound("i".into()),
            AdminError::NotPending { id: "i".into(), state: "executed".into() },
            AdminError::RequestExpired("i".into()),
            AdminError::NoHold("d".into()),
            AdminError::HoldsChanged("x".into()),
            AdminError::ClientDenied("c".into()),
            AdminError::NotConfigured,
            AdminError::BadCall("x".into()),
            AdminError::BadKey("x".into()),
            AdminError::BadDigest,
            AdminError::RemoteRefused("10.0.0.1".into()),
            AdminError::UnknownClass("c".into()),
            AdminError::Advance("x".into()),
            AdminError::Io("x".into()),
        ];
        for e in &all {
            let (status, exit) = (e.status(), e.exit_code());
            // Identity refusals exit 77 and are 401/403; refused requests exit 65
            // and are 4xx; etcd, file or arbiter trouble exits 1.
            match exit {
                77 => assert!(matches!(status, 401 | 403), "{}", e.code()),
                65 => assert!(matches!(status, 400 | 404 | 409), "{}", e.code()),
                _ => assert!(matches!(status, 404 | 503), "{}", e.code()),
            }
            assert_eq!(e.body().code, e.code());
            assert_eq!(e.wants_token(), status == 401);
        }
    }
}
