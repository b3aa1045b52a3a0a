//! The arbiter's `GET /status` on its admin port (`extproc/src/admin.rs`, the class
//! part from `extproc/src/registry.rs`), read by `lockctl doctor` and by operators.
//! Numbers and names only: no key, token or identity. The console's state embeds
//! [`RegistryStatus`].

use serde::{Deserialize, Serialize};

use crate::policy::{ChangeNote, PolicyState};

/// `GET /status`. Every member has a default so a reader accepts an older
/// arbiter's answer that lacks some (`lockctl doctor` reports a missing
/// `version` as "older than lockctl").
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct StatusReply {
    /// The registry and every class's authoritative policy.
    pub classes: ClassesStatus,
    /// One entry per etcd cluster whose fail-open state the arbiter keeps (ADR-04).
    pub fail_open: Vec<FailOpenStatus>,
    /// The durable high-water marks the seal detector compares against.
    pub marks: Marks,
    /// The two-person admin actions' settings; absent when they are off (no
    /// `operators` section).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub operators: Option<OperatorsStatus>,
    /// What the seal rests on (numbers, never keys), or `null` when not sealed.
    pub seal_detail: Option<String>,
    /// Why the arbiter is sealed (`cluster_id_mismatch`, `revision_behind_mark`,
    /// `epoch_behind_mark`, `raft_behind_mark`, `clock_behind_mark`, `explicit`),
    /// or `null`.
    pub seal_reason: Option<String>,
    /// True while the arbiter refuses every request until the epoch advances.
    pub sealed: bool,
    /// When the seal was declared, unix ms, or `null`.
    pub sealed_since_ms: Option<u64>,
    /// What promoting each class's candidate policy would have changed over the
    /// last 24 hours at this arbiter (shadow policies, docs/CLASSES.md).
    #[serde(default)]
    pub shadow: Vec<super::console::ShadowCount>,
    /// The arbiter's crate version (`CARGO_PKG_VERSION`); empty from an arbiter
    /// too old to report it.
    pub version: String,
}

/// The operator safeguards in force (docs/ADMIN.md); `lockctl doctor` flags
/// `weakened`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct OperatorsStatus {
    /// How long a force release's record stays in etcd, seconds.
    pub force_record_retention_s: u64,
    /// The token freshness bound, seconds, or `null` when off.
    pub max_token_age_s: Option<u64>,
    /// True when every operator token must come from an MFA sign-in.
    pub require_mfa: bool,
    /// The safeguards turned off, in words; empty when none is.
    pub weakened: Vec<String>,
}

/// The durable high-water marks (`lock::seal`): what this arbiter has seen of its
/// cluster, so a restored (older) cluster is noticed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Marks {
    /// Highest mod revision of the grant clock (`<root>/sys/clock`) seen in this
    /// epoch; 0 until the first grant.
    pub clock: i64,
    /// Why the grant clock is off (the arbiter's etcd role may not read and write
    /// `sys/clock`, or no seal check has run yet), or `null` when it is on.
    pub clock_off: Option<String>,
    /// The etcd cluster id, 16 hex digits; empty until first seen.
    pub cluster_id: String,
    /// Highest epoch seen.
    pub epoch: u64,
    /// Highest leader raft index seen at `raft_term`.
    pub raft_index: u64,
    /// Highest leader raft term seen in this epoch.
    pub raft_term: u64,
    /// Highest linearizable etcd revision seen in this epoch.
    pub revision: i64,
    /// Last update, unix ms.
    pub updated_ms: u64,
}

/// One cluster's fail-open state (ADR-04).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailOpenStatus {
    /// The etcd cluster's name in the arbiter config.
    pub cluster: String,
    /// The declared outage's id (`<cluster>-<declared ms>`), or `null` when none.
    pub outage: Option<String>,
    /// True while a quorum loss is declared: fail-open classes get unprotected grants.
    pub quorum_loss_declared: bool,
    /// True when a spool is configured (without one nothing fails open).
    pub spool: bool,
    /// Bytes in the spool now.
    pub spool_bytes: u64,
    /// Unprotected holds in the arbiter's memory now.
    pub unprotected_holds: u64,
}

/// The class part of `/status`: a report, or why the policies could not be read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ClassesStatus {
    /// The registry and the policies as read.
    Read(ClassesReport),
    /// The policies could not be read from etcd: `{"error": ...}`.
    Unreadable {
        /// Why (the etcd error).
        error: String,
    },
}

/// The registry file's state and each class with its authoritative policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassesReport {
    /// Every class of the registry in force, in registry order.
    pub classes: Vec<ClassStatus>,
    /// Whether the authoritative prefix-to-class map in etcd matches the registry
    /// in force; `null` when there is no map yet.
    pub map_matches_registry: Option<bool>,
    /// The registry file's reload state.
    pub registry: RegistryStatus,
}

/// The registry file's reload state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryStatus {
    /// Errors of the file on disk when it was refused (the previous registry stays
    /// in force); empty when the file in use is the file on disk.
    pub errors: Vec<String>,
    /// When the registry in force was loaded, unix ms.
    pub loaded_ms: u64,
    /// Files refused since startup.
    pub refused: u64,
    /// Files loaded after startup.
    pub reloads: u64,
    /// True when `errors` is empty.
    pub valid: bool,
}

/// One class in [`ClassesReport`]: the registry's wish and etcd's authoritative
/// policy. The policy members are `null` when no policy record exists yet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassStatus {
    /// The advisory waiver, or `null` for a fenced class.
    pub advisory: Option<Waiver>,
    /// The epoch of the policy's last limit change.
    pub change_epoch: Option<u64>,
    /// True when the registry's `max_holders` is not the authoritative limit (a
    /// change to apply with `lockctl class`), or there is no policy.
    pub desired_differs: bool,
    /// The registry's `max_holders`.
    pub desired_limit: u32,
    /// How long the class has been draining a lowered limit, ms; `null` when active.
    pub draining_age_ms: Option<u64>,
    /// Who changed the policy last, why and when.
    pub last_change: Option<ChangeNote>,
    /// The authoritative holder limit per key.
    pub limit: Option<u32>,
    /// The class name.
    pub name: String,
    /// The lowered limit a drain is moving to.
    pub pending_target: Option<u32>,
    /// The policy record's id.
    pub policy_id: Option<String>,
    /// `active` or `draining`.
    pub state: Option<PolicyState>,
    /// `coord` or `entity`.
    pub tier: String,
    /// The class TTL, seconds.
    pub ttl_s: u64,
}

/// An advisory class's waiver (ADR-01).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiver {
    /// True once the waiver's expiry day has passed.
    pub expired: bool,
    /// Who accepted the risk.
    pub risk_owner: String,
}

// === impl ClassesStatus ===

impl Default for ClassesStatus {
    fn default() -> Self {
        ClassesStatus::Read(ClassesReport::default())
    }
}
