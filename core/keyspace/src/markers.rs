//! Markers: small records written beside the facts they explain, so that a reader
//! of the history (the audit tailer, `extproc/audit/src/decode.rs`) can tell what
//! happened; and a durable waiter's record.
//!
//! Fields are declared in name order, so a record serialises to the bytes the
//! `serde_json::json!` objects it replaced did (their members sort by name).

use serde::{Deserialize, Serialize};

/// `<root>/r/<digest>` ([`super::Keys::release_marker`]): put in the transaction
/// that deletes a released hold, on the arbiter's marker lease (TTL 120 s). Its `revision` names the grant,
/// which tells a release from an expiry, an epoch purge or a force release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseMarker {
    /// The released grant's epoch; absent for a transparent-mode (filter VM)
    /// release, which goes by the hold id rather than the token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Wall time of the release, unix ms (the audit event's time).
    pub released_ms: u64,
    /// The released hold's create revision, the grant revision of its token.
    pub revision: i64,
    /// Whether the filter released it because the request holding it ended.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub transparent: bool,
}

/// `<root>/x/<session>` ([`super::Keys::close_marker`]): put one revision before a
/// closed session's lease is revoked, so the holds that go with the lease are
/// recorded as released with the session rather than expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CloseMarker {
    /// Wall time of the close, unix ms.
    pub closed_ms: u64,
}

/// A durable waiter's value ([`super::Keys::waiter`], `fairness: durable`): who
/// waits, on which of their sessions. The key's create revision is its place in
/// the queue; the value is for people reading the keyspace (`etcdctl get`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WaiterRecord {
    /// The waiting caller's SPIFFE ID.
    pub owner: String,
    /// The session the hold will be attached to, 16 hex digits.
    pub session: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_serialise_to_the_members_the_arbiter_always_wrote() {
        let held = ReleaseMarker { epoch: Some(2), released_ms: 5, revision: 9, transparent: false };
        assert_eq!(serde_json::to_string(&held).unwrap(), r#"{"epoch":2,"released_ms":5,"revision":9}"#);
        let vm = ReleaseMarker { epoch: None, released_ms: 5, revision: 9, transparent: true };
        assert_eq!(serde_json::to_string(&vm).unwrap(), r#"{"released_ms":5,"revision":9,"transparent":true}"#);
        assert_eq!(serde_json::from_str::<ReleaseMarker>(r#"{"revision":9,"released_ms":5}"#).unwrap().epoch, None);
        assert_eq!(serde_json::to_string(&CloseMarker { closed_ms: 7 }).unwrap(), r#"{"closed_ms":7}"#);
        let w = WaiterRecord { owner: "spiffe://t/a".into(), session: "000000000000002a".into() };
        assert_eq!(serde_json::to_string(&w).unwrap(), r#"{"owner":"spiffe://t/a","session":"000000000000002a"}"#);
    }
}

/// `<root>/g/<digest>` ([`super::Keys::delay_guard`]): put (no lease) by every
/// grant of a key of a class with `lock_delay_s`, deleted by its release. Left
/// behind when the hold ends otherwise (its session expired or was closed, a force
/// release), where `lockmesh_lock::delay` finds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelayGuard {
    /// The session the hold is on, 16 hex digits (a close marker of it says the
    /// holder closed the session: a release, no delay).
    pub session: String,
}

/// `<root>/d/<digest>` ([`super::Keys::lock_delay`]): the key is in its class's
/// lock-delay; on a lease of `delay_s`, so it ends with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockDelayRecord {
    /// Why the last hold ended: `expiry` (its session ended without a close) or
    /// `force` (an admin force release).
    pub cause: String,
    /// The class's delay, seconds (the lease's TTL).
    pub delay_s: u64,
    /// When the arbiter that wrote it saw the end, unix ms (informational).
    pub seen_ms: u64,
}

/// What a class's candidate policy would have done instead of the enforced one
/// (`lockmesh_lock::shadow`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShadowDecision {
    /// The enforced policy granted (or renewed); the candidate would have refused.
    WouldRefuse,
    /// The enforced policy refused; the candidate would have granted.
    WouldGrant,
}

impl ShadowDecision {
    /// The label and audit kind.
    pub fn as_str(self) -> &'static str {
        match self {
            ShadowDecision::WouldRefuse => "would_refuse",
            ShadowDecision::WouldGrant => "would_grant",
        }
    }
}

/// The audit record `<root>/w/<class>` ([`super::Keys::shadow_record`]): the latest differing decision of the
/// class's candidate, standing for `count` decisions since the previous record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowRecord {
    /// When, unix ms.
    pub at_ms: u64,
    /// The candidate's value of the field that decided.
    pub candidate: u64,
    /// The class.
    pub class: String,
    /// Decisions this record stands for (records are written at most
    /// `AUDIT_PER_S` a second per class; the rest are counted into the next).
    pub count: u64,
    /// `would_refuse` or `would_grant`.
    pub decision: ShadowDecision,
    /// The key's digest (never the key); none for a session's decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The enforced value of the field that decided.
    pub enforced: u64,
    /// Why (`key_gated`, `lock_delay`, `session_expired`).
    pub reason: String,
}
