//! Sessions, holds and election values, as stored (`<root>/s/<session>`,
//! `<root>/l/<digest>/h/<slot>`, `<root>/l/<digest>/e`).

use serde::{Deserialize, Serialize};

/// A session record, immutable for the session's life.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    /// SPIFFE ID of the creator, the only identity that may use the session.
    pub owner: String,
    /// The creator's declared instance, if any; then requests must carry it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The class it was opened for.
    pub class: String,
    /// Lease TTL, seconds.
    pub ttl_s: u64,
    /// Creation time, unix ms (informational).
    pub created_ms: u64,
    /// The quota namespace it counts against (`lockmesh_core::quota`): the
    /// namespace of the key it was opened for. Absent in records of earlier
    /// builds and of sessions opened with no key: the class's one namespace
    /// then, else `*`. Readers that do not know it ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ns: Option<String>,
    /// Opened by an acquire that named no session (the header-only path), not by
    /// `POST /v1/sessions`: a release naming it ends it once it holds nothing
    /// (docs/API.md). Absent (false) in every other record.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub by_acquire: bool,
}

/// A hold's value. The raw key sits here (never in key names) for the holder's own
/// listing; the token is derived from the key's create revision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRecord {
    /// The raw lock key.
    pub key: String,
    /// Holder SPIFFE ID.
    pub owner: String,
    /// Holder's declared instance (`x-lock-instance`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Epoch compared by the granting transaction.
    pub epoch: u64,
    /// Class at grant time.
    pub class: String,
    /// Grant time, unix ms (for ages; never used for safety).
    pub acquired_ms: u64,
    /// Transparent mode: `<vm>/<n>`, the filter's id for the request that holds it,
    /// by which the filter releases it when the request ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<String>,
    /// The caller a self client (an in-pod sidecar, `tls.self_clients`) claimed,
    /// when it differs from `owner`: unverified, recorded for the audit only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unverified_caller: Option<String>,
    /// How many slots the grant took (`x-lock-permits`, or N for an exclusive
    /// hold), when more than one. Each of its slot keys carries this record; all
    /// were put by one transaction, so they share one create revision (the token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permits: Option<u32>,
    /// A read-write lock's mode (`x-lock-mode`), when the acquire named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<lockmesh_core::headers::LockMode>,
    /// How many keys the grant took together (a multi-key acquire, `x-lock-keys`),
    /// when more than one. Each key's hold carries this record; all were put by one
    /// transaction, so they share one create revision (each key's token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keys: Option<u32>,
    /// The grant attempt that put it (`Keys::attempt`), for a grant on a session
    /// the caller keeps: an attempt whose answer etcd never gave is resolved by
    /// fencing that id and reading which holds carry it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
}

/// An election leader's proclaimed value (`<root>/l/<digest>/e`, on the leader's
/// session lease). Written only by a transaction that compares the leader's hold
/// (its create revision is the token's revision), so it names the leadership it
/// belongs to; a reader shows it only while that hold leads.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElectionValue {
    /// The leader's fencing token, as a decimal string.
    pub token: String,
    /// The value (`x-lock-value`).
    pub value: String,
    /// When it was proclaimed, unix ms (informational).
    pub proclaimed_ms: u64,
}
