//! The refusal body of the lock API, the transparent routes and the filter's VM
//! routes: `{"code", "message"[, "reason"][, "region"]}`. Its status and headers
//! come from [`crate::Code`] (the one table); the Wasm filter writes the same bytes
//! by hand with [`crate::code::error_body`].

use serde::{Deserialize, Serialize};

use crate::{
    code::{AnyCode, AnyReason},
    Code, Reason,
};

/// A refusal. Nothing was granted, released or renewed beyond what the code says.
/// Readers tolerate codes and reasons they do not know ([`AnyCode`]) and members
/// they do not know.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The stable code: branch on it, never on the message.
    pub code: AnyCode,
    /// For people: lowercase, names the value and the knob, never a key, a token
    /// or an identity. May change between releases. Empty if the answer had none.
    #[serde(default)]
    pub message: String,
    /// With `contended` only: `key_gated` (the key is at its limit of holders) or
    /// `lock_contended` (a transient conflict with a concurrent grant). Absent
    /// otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<AnyReason>,
    /// With `wrong_region` only: the region whose lock tier homes the key's
    /// namespace (also in [`crate::headers::REGION`]). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// With `quota_exceeded` only: which quota (`sessions`, `holds`, `waiters`,
    /// `acquire_rate`; `lockmesh_core::quota::Quota`). Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<String>,
}

// === impl ErrorBody ===

impl ErrorBody {
    /// A refusal with `code` and `message`, without reason or region.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self { code: code.into(), message: message.into(), reason: None, region: None, quota: None }
    }

    /// The same refusal with a `contended` reason.
    pub fn with_reason(mut self, reason: Reason) -> Self {
        self.reason = Some(reason.into());
        self
    }

    /// The same refusal naming the home region (`wrong_region`).
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }
}

/// fence-proxy's refusal (`fence-proxy/src/respond.rs`): `{"code", "message"}` with
/// the fence's own codes (`stale_token`, `grant_required`, ...; docs/FENCING.md),
/// also in `x-lockmesh-error`. Not a [`crate::Code`]: a fence answers for its
/// store, not for the lock service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceErrorBody {
    /// The stable code.
    pub code: String,
    /// For people; never a token.
    #[serde(default)]
    pub message: String,
}
