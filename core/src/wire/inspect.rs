//! What `lockctl inspect KEY --json` and `lockctl saturated --json` print
//! (`extproc/src/inspect/cli.rs`, from `extproc/src/inspect.rs`'s etcd scans).
//! Operators' views: the holder's identity, never a token.

use serde::{Deserialize, Serialize};

/// `lockctl inspect KEY --json`: one key's class, policy and holders, and its
/// waiters summed over the arbiters asked (`--admin-url`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InspectReport {
    /// The key's authoritative class (etcd's prefix map), or `null` without a map.
    pub class: Option<String>,
    /// With `--config` (a split deployment): the cluster the shard map homes the
    /// key on, where its holders and policy were read. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// The key's digest (what etcd, logs and the audit store name it by).
    pub digest: String,
    /// The holders, by slot.
    pub holders: Vec<HolderInfo>,
    /// The class's authoritative holder limit, or `null`.
    pub limit: Option<u32>,
    /// The lowered limit while draining; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_target: Option<u32>,
    /// The etcd revision the holders were read at.
    pub revision: i64,
    /// `active` or `draining`, or `null` without a policy.
    pub state: Option<String>,
    /// One line per arbiter that could not say (`<url>: <status> <code>`).
    #[serde(default)]
    pub waiter_errors: Vec<String>,
    /// Acquires queued for the key, summed over the arbiters that answered; `null`
    /// when none was asked or none answered.
    #[serde(default)]
    pub waiters: Option<u64>,
}

/// One holder of a key, as an operator sees it (never the token).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderInfo {
    /// Time held, ms (from the grant's wall clock; informational).
    pub age_ms: u64,
    /// The epoch of the grant.
    pub epoch: u64,
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The holder's declared instance; absent when it declared none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The session id, 16 hex digits.
    pub session: String,
    /// The hold slot (0 to limit - 1).
    pub slot: u32,
}

/// `lockctl saturated --json`: the keys at their authoritative limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaturatedReport {
    /// Holds read by the scan.
    pub holds_scanned: u64,
    /// The etcd revision the scan read at.
    pub revision: i64,
    /// The keys at their limit, most holders first.
    pub saturated: Vec<SaturatedKey>,
    /// True when the scan stopped at `--max-holds` before the end.
    pub truncated: bool,
}

/// A key at its authoritative limit (also in the console's state).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SaturatedKey {
    /// The class recorded in its holds.
    pub class: String,
    /// The cluster holding it (the console only; absent from `lockctl saturated`,
    /// which reads one cluster, and from a console before issue 18).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// The key digest.
    pub digest: String,
    /// Open holds.
    pub holders: u32,
    /// The class's authoritative limit.
    pub limit: u32,
    /// Age of its oldest hold, ms.
    pub oldest_age_ms: u64,
    /// Acquires of the key queued at the answering arbiter (the console only;
    /// absent from `lockctl saturated`, which asks no arbiter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiters_here: Option<u64>,
}
