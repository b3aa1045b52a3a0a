//! The epoch record (`<root>/sys/epoch`): the current epoch and the etcd cluster it
//! was minted for (ADR-03 in docs/DECISIONS.md).

use serde::{Deserialize, Serialize};

/// The first epoch of a new deployment.
pub const FIRST_EPOCH: u64 = 1;

/// The epoch record as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Current epoch, below 2^15.
    pub epoch: u64,
    /// The etcd cluster id it was minted for, 16 hex digits.
    pub cluster_id: String,
    /// An explicit seal (an epoch advance in progress): every arbiter refuses
    /// requests while it is set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed: Option<String>,
    /// The epoch an advance in progress moves to (set with `sealed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<u64>,
    /// Earlier epochs of this cluster whose holds may still be live: a move's
    /// epoch advance keeps them (`lock::home`); a restore advance clears them with
    /// the holds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prior: Vec<u64>,
}

/// Formats a cluster id the way the record stores it.
pub fn cluster_hex(id: u64) -> String {
    format!("{id:016x}")
}
