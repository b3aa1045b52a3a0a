//! The two-person admin actions (ADR-03, ADR-20; docs/ADMIN.md): `lockctl admin`
//! (`extproc/src/admin_action/cli.rs`) calls the arbiter's routes on the ext_proc
//! port (`admin_action/server.rs`), which run the flow (`admin_action/flow.rs`)
//! and answer these types. [`AdminRequest`] and [`LogEntry`] are also the records
//! the flow keeps in etcd (`<root>/adm/req/<id>`, `<root>/adm/log/...`).
//!
//! | Route | Body | Answer |
//! |---|---|---|
//! | `POST /internal/v1/admin/request` | [`RequestBody`] | [`Preview`] |
//! | `POST /internal/v1/admin/show` | [`ShowBody`] | [`Preview`] |
//! | `POST /internal/v1/admin/approve` | [`ApproveBody`] | [`ApproveReply`] |
//! | `POST /internal/v1/admin/list` | [`ListBody`] | [`ListReply`] |
//!
//! A refusal is an [`AdminErrorBody`]. Request bodies refuse unknown members (the
//! arbiter answers `admin.bad_call`); answers tolerate them.

use serde::{Deserialize, Serialize};

/// Who an operator is: the verified token's issuer and subject (never the token).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Operator {
    /// The token's `iss`.
    pub iss: String,
    /// The token's `sub`.
    pub sub: String,
}

/// What a request asks for, tagged by `kind`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Action {
    /// Delete every hold of one key (by digest) and write its force record.
    ForceRelease {
        /// The key's digest, 64 hex digits (the raw key is never stored here).
        digest: String,
        /// Also revoke each holder's session lease (every lock of that session goes).
        revoke_session: bool,
    },
    /// The guarded epoch advance (docs/OPERATIONS.md, restore runbook).
    EpochAdvance {
        /// The epoch the requester saw; the advance is refused if it moved.
        expected_epoch: u64,
        /// The epoch to advance to (above `expected_epoch`).
        new_epoch: u64,
    },
}

/// A request's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestState {
    /// Waiting for a different operator's approval.
    Pending,
    /// Approved; the action ran (or, for an epoch advance, is running).
    Executed,
    /// Approved, but there was nothing left to do (the hold had gone).
    Void,
}

/// A request as recorded and shown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminRequest {
    /// What is asked.
    pub action: Action,
    /// When it was approved, unix ms; absent until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approved_ms: Option<u64>,
    /// Who approved; absent until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approver: Option<Operator>,
    /// The approval window's end, unix ms.
    pub expires_ms: u64,
    /// Random id, 16 hex digits.
    pub id: String,
    /// Why, in the requester's words (1 to 1024 characters).
    pub reason: String,
    /// When it was requested, unix ms.
    pub requested_ms: u64,
    /// Who asked.
    pub requester: Operator,
    /// Its state.
    pub state: RequestState,
}

/// One hold of the key, as shown before approval and kept in the force record.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldView {
    /// Time held, ms (wall clock; informational).
    pub age_ms: u64,
    /// The class at grant time.
    pub class: String,
    /// The grant's etcd revision (the token's low bits): an approval names the
    /// revisions it was shown.
    pub grant_revision: i64,
    /// The holder's instance; absent when it declared none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The holder's SPIFFE ID.
    pub owner: String,
    /// The holder's session (lease id, 16 hex digits), or `null` for a hold on no
    /// lease.
    pub session: Option<String>,
    /// The hold slot.
    pub slot: u32,
}

/// What the approver is shown (the answer to request and show).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preview {
    /// Force release on a split deployment: the cluster the key's holds are on
    /// (absent: the coord cluster, or an epoch advance).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// `fenced`, `advisory` or `unknown` (no registry, or holds of several classes).
    pub enforcement: String,
    /// The key's holds now (force release; empty for an epoch advance).
    pub holds: Vec<HoldView>,
    /// The request.
    pub request: AdminRequest,
    /// What releasing means for this class, in words, or `null`.
    pub warning: Option<String>,
}

/// What an approval did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// Epoch advance: its step log, one line per step.
    pub advance_log: Vec<String>,
    /// Force release on a split deployment: the cluster the holds were deleted on
    /// (absent: the coord cluster). `revision` is that cluster's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// Force release: the holds deleted.
    pub released: Vec<HoldView>,
    /// The request after approval.
    pub request: AdminRequest,
    /// The etcd revision of the executing transaction.
    pub revision: i64,
    /// Force release: the session leases revoked.
    pub sessions_revoked: u64,
}

/// One action log entry: every request, approval and refusal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogEntry {
    /// When, unix ms.
    pub at_ms: u64,
    /// The refusal's message, or what was done.
    pub detail: String,
    /// The operator, when the token verified; `null` otherwise.
    pub operator: Option<Operator>,
    /// `ok` or the refusal's code (`admin.*`).
    pub outcome: String,
    /// The request, when known; `null` otherwise.
    pub request_id: Option<String>,
    /// `request` or `approve`.
    pub step: String,
}

/// `POST /internal/v1/admin/request` (the requester's token in `authorization`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestBody {
    /// What is asked (a force release names the key's digest, never the key).
    pub action: Action,
    /// Why (1 to 1024 characters).
    pub reason: String,
    /// The approval window, seconds (1 to `operators.max_request_ttl_s`).
    pub ttl_s: u64,
}

/// `POST /internal/v1/admin/show` (no token).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShowBody {
    /// The request id.
    pub id: String,
}

/// `POST /internal/v1/admin/approve` (the approver's token in `authorization`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApproveBody {
    /// The request id.
    pub id: String,
    /// Force release: the grant revisions of the holds the approver was shown; the
    /// approval is refused (`admin.holds_changed`) unless the key's holds are
    /// exactly these. `null` for an epoch advance.
    #[serde(default)]
    pub shown: Option<Vec<i64>>,
}

/// `POST /internal/v1/admin/list` (no token): an empty object.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListBody {}

/// The answer to approve: what was shown and what was done.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApproveReply {
    /// What the approval did.
    pub outcome: Outcome,
    /// The preview read just before the approval executed.
    pub preview: Preview,
}

/// The answer to list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ListReply {
    /// The action log, oldest first.
    pub log: Vec<LogEntry>,
    /// Every request record, oldest first.
    pub requests: Vec<AdminRequest>,
}

/// An operator-plane refusal: `{"code", "message"}`, answered by the admin-action
/// routes and the console alike, with the status of `AdminError::status`
/// (extproc/ops/src/admin/mod.rs, the one table). Codes are `admin.*` (and the
/// console's `console.bad_digest`, `console.unknown_class` and
/// `console.remote_refused`; docs/ADMIN.md);
/// `lockctl`'s exit code follows from the code. Arbiters of earlier builds named
/// the code `error`; readers still accept that.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminErrorBody {
    /// The stable code, e.g. `admin.same_operator`.
    #[serde(alias = "error")]
    pub code: String,
    /// For people; may quote the token's claims, never the token.
    #[serde(default)]
    pub message: String,
}
