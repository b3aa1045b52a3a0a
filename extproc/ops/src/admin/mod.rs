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
        /// Request id.
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
        /// Request id.
        id: String,
        /// Its state.
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

    /// The HTTP status the arbiter answers this refusal with.
    pub fn http_status(&self) -> u16 {
        match exit_code_of(self.code()) {
            77 => 403,
            65 => 409,
            _ if matches!(self, Self::NotConfigured) => 404,
            _ => 503,
        }
    }
}

/// The exit code of a refusal by its stable code (the arbiter answers codes;
/// `lockctl` exits with this): 77 identity, 65 request, 1 etcd, files or the arbiter.
pub fn exit_code_of(code: &str) -> u8 {
    match code {
        "admin.token_invalid"
        | "admin.token_expired"
        | "admin.token_stale"
        | "admin.role_missing"
        | "admin.mfa_missing"
        | "admin.same_operator"
        | "admin.client_denied" => 77,
        "admin.reason_missing"
        | "admin.request_not_found"
        | "admin.request_not_pending"
        | "admin.request_expired"
        | "admin.no_hold"
        | "admin.bad_key"
        | "admin.holds_changed"
        | "admin.bad_call" => 65,
        _ => 1,
    }
}

pub fn io(e: impl std::fmt::Display) -> AdminError {
    AdminError::Io(e.to_string())
}
