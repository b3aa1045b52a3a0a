//! Unprotected grants of fail-open classes (ADR-04 in docs/DECISIONS.md): one line of
//! the arbiter's spool, and the same record shipped to `<root>/u/<grant>/<op>`.

use serde::{Deserialize, Serialize};

/// What a spool line records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpoolOp {
    /// An unprotected grant (answered after this line was durable).
    Grant,
    /// Its holder released it (or the caller was gone: `reason`).
    Release,
    /// It ended without a release: its TTL ran out, or the arbiter restarted
    /// (`reason`).
    Expiry,
}

/// One spool line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpoolRecord {
    pub op: SpoolOp,
    /// The grant's id (32 hex characters), shared by its end.
    pub grant: String,
    /// The raw lock key.
    pub key: String,
    pub digest: String,
    /// The key's class.
    pub class: String,
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The holder's declared instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Transparent mode: the filter's hold id (`<vm>/<n>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<String>,
    /// The epoch this arbiter last read on the cluster (0 if none): the grant's
    /// token is 0, the epoch only dates it.
    pub epoch: u64,
    /// The etcd cluster (config name) whose quorum was lost.
    pub cluster: String,
    /// The outage ([`super::quorum::Outage::id`]).
    pub outage: String,
    /// Wall time of the fact, unix ms.
    pub at_ms: u64,
    /// Grants: the class TTL the hold expires after unless released.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// Ends: why (`ttl`, `arbiter_restart`, `caller_gone`, `reconcile`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

// === impl SpoolOp ===

impl SpoolOp {
    /// The wire string (also the etcd key's last segment when shipped).
    pub fn as_str(self) -> &'static str {
        match self {
            SpoolOp::Grant => "grant",
            SpoolOp::Release => "release",
            SpoolOp::Expiry => "expiry",
        }
    }

    /// Parses [`SpoolOp::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        [SpoolOp::Grant, SpoolOp::Release, SpoolOp::Expiry].into_iter().find(|o| o.as_str() == s)
    }
}
