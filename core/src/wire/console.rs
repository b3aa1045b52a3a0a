//! The read-only console's data routes on the arbiter's admin port
//! (`extproc/src/console/mod.rs`), read by its page (`console/app.js`), by
//! `lockctl inspect --admin-url` (waiters) and by the console scenario tests.
//! Both need an operator's bearer token; no raw key, token or session appears.
//!
//! | Route | Answer |
//! |---|---|
//! | `GET /console/api/state` | [`ConsoleState`] |
//! | `GET /console/api/history` | [`ConsoleHistory`] |
//! | `GET /console/api/classes/{class}` | [`ConsoleClassDetail`] |
//! | `GET /console/api/waiters/{digest}` | [`ConsoleWaiters`] |
//!
//! A refusal is a [`ConsoleErrorBody`] (`admin.*` and `console.*` codes).

use serde::{Deserialize, Serialize};

use super::{audit::EventKind, inspect::SaturatedKey, status::RegistryStatus};

/// `GET /console/api/state`: everything the page shows, read at `generated_ms`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleState {
    /// Recent audit events from the tailer, if one is configured.
    pub audit: ConsoleAudit,
    /// Every class of the registry in force, with what is held now (over every
    /// cluster; each cluster's part in [`ConsoleClass::clusters`]).
    pub classes: Vec<ConsoleClass>,
    /// Every cluster the arbiter knows (`coord` first, then the others by name),
    /// each read on its own. `[]` from an arbiter that read only the coord cluster
    /// (before issue 18).
    #[serde(default)]
    pub clusters: Vec<ConsoleCluster>,
    /// Classes draining a lowered limit or a prefix move, one row per cluster
    /// whose record drains.
    pub draining: Vec<ConsoleDraining>,
    /// The coord cluster's etcd as this arbiter sees it (every cluster's members:
    /// [`ConsoleCluster::etcd`]).
    pub etcd: ConsoleEtcd,
    /// When the snapshot was taken, unix ms.
    pub generated_ms: u64,
    /// The Grafana dashboard the page links to (`console.grafana_url`), or `null`.
    /// Absent from an arbiter before issue 23.
    #[serde(default)]
    pub grafana_url: Option<String>,
    /// The open holds by age, over every cluster (from the hold scans); `null`
    /// when a scan failed, and from an arbiter before issue 23.
    #[serde(default)]
    pub hold_ages: Option<ConsoleHoldAges>,
    /// Holds and waits by namespace and class (ADR-033): the same figures as the
    /// arbiter's `lockmesh_arbiter_oldest_hold_seconds` and its wait families.
    /// `[]` from an arbiter before issue 21.
    #[serde(default)]
    pub holds_and_waits: Vec<ConsoleHoldWait>,
    /// The signed-in operator.
    pub operator: ConsoleOperator,
    /// Why the class policies could not be read, or `null`.
    pub policies_error: Option<String>,
    /// Each namespace's use against its quotas, per cluster (`lockmesh_core::quota`).
    #[serde(default)]
    pub quotas: Vec<ConsoleQuota>,
    /// The registry file's reload state, or `null` when the policies could not be read.
    pub registry: Option<RegistryStatus>,
    /// The most saturated keys (at their limit), most holders first, over every
    /// cluster; each with `waiters_here` and its `cluster`.
    pub saturated: Vec<SaturatedKey>,
    /// The hold scans the class numbers come from, over every cluster: holds
    /// summed, `truncated` if any was, the coord cluster's `revision`; `error`
    /// (naming the cluster) when one failed.
    pub scan: ConsoleScan,
    /// The arbiter's seal state and the coord cluster's epoch record (every
    /// cluster's: [`ConsoleCluster`]).
    pub seal: ConsoleSeal,
    /// What promoting each class's candidate policy would have changed over the
    /// last 24 hours at this arbiter (shadow policies, docs/CLASSES.md), by class,
    /// decision and reason. `[]` without a candidate, and from an arbiter before
    /// issue 21.
    #[serde(default)]
    pub shadow: Vec<ShadowCount>,
    /// The arbiter's crate version.
    pub version: String,
}

/// The audit part of [`ConsoleState`]: `configured` with `events` or `error`, or
/// not configured with a `message`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleAudit {
    /// True when `console.audit_url` is set.
    pub configured: bool,
    /// Why the tailer's events are missing (configured only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The tailer's most recent events, newest first (configured only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<Vec<ConsoleAuditEvent>>,
    /// What to configure (not configured only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// One audit event as the console shows it: never the raw key, identity or session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleAuditEvent {
    /// Wall time of the fact, unix ms.
    pub at_ms: u64,
    /// The class, when the event has one.
    pub class: Option<String>,
    /// The key digest, when the event has one.
    pub digest: Option<String>,
    /// The epoch in force.
    pub epoch: u64,
    /// What happened.
    pub kind: EventKind,
    /// The etcd revision of the change (0 for an unprotected record).
    pub revision: i64,
}

/// One class in [`ConsoleState`]. Policy members are `null` without a policy
/// record; hold numbers are 0 (ages `null`) when the scan failed. Hold numbers are
/// over every cluster; `limit` is the coord cluster's record's, and `state` is
/// `draining` when any cluster's record drains.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleClass {
    /// The class on each cluster: its holds there and that cluster's own policy
    /// record. `[]` from an arbiter before issue 18.
    #[serde(default)]
    pub clusters: Vec<ConsoleClassCluster>,
    /// The registry's `max_holders`.
    pub desired_max_holders: u32,
    /// Fenced or advisory, with the waiver.
    pub enforcement: ConsoleEnforcement,
    /// `memory` or `durable` (waiter queueing).
    pub fairness: String,
    /// Keys with at least one hold.
    pub keys_held: u64,
    /// The authoritative holder limit per key.
    pub limit: Option<u32>,
    /// The class name.
    pub name: String,
    /// Age of the oldest open hold, ms.
    pub oldest_grant_age_ms: Option<u64>,
    /// Open holds.
    pub open_grants: u64,
    /// A fenced class's pause test; `null` for an advisory class.
    pub pause_test: Option<PauseTest>,
    /// The lowered limit a drain is moving to.
    pub pending_target: Option<u32>,
    /// The key prefixes of the class.
    pub prefixes: Vec<String>,
    /// Keys at their limit.
    pub saturated_keys: u64,
    /// `active` or `draining`.
    pub state: Option<String>,
    /// `coord` or `entity`.
    pub tier: String,
    /// The class TTL, seconds.
    pub ttl_s: u64,
}

/// One class on one cluster (each cluster has its own policy records and holds).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleClassCluster {
    /// The cluster.
    pub cluster: String,
    /// Keys with at least one hold there.
    pub keys_held: u64,
    /// That cluster's authoritative holder limit, or `null` without a record.
    pub limit: Option<u32>,
    /// Age of the oldest open hold there, ms.
    pub oldest_grant_age_ms: Option<u64>,
    /// Open holds there.
    pub open_grants: u64,
    /// Keys at their limit there.
    pub saturated_keys: u64,
    /// `active` or `draining`, or `null` without a record.
    pub state: Option<String>,
}

/// One row of [`ConsoleState::shadow`] (and of `/status` `shadow`): decisions a
/// class's candidate policy would have made differently from the enforced one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShadowCount {
    /// The class.
    pub class: String,
    /// Decisions counted.
    pub count: u64,
    /// `would_refuse` (the enforced policy granted or renewed) or `would_grant`
    /// (it refused).
    pub decision: String,
    /// `key_gated`, `lock_delay` or `session_expired`.
    pub reason: String,
}

/// One (namespace, class) label pair in [`ConsoleState::holds_and_waits`]: the
/// labels of the arbiter's metrics (a namespace the registry does not name, or a
/// class it no longer has, is `other`). The holds are fleet-wide (every arbiter
/// follows every cluster's holds and shows the same); everything else is counted
/// at this arbiter since it started (docs/OPERATIONS.md, Holds and waits).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleHoldWait {
    /// The class label.
    pub class: String,
    /// Acquires of the pair waiting here now: gated behind a key at its limit or
    /// behind another waiter.
    pub gated_waiters: u64,
    /// Grants here of the pair's keys while they had gated waiters here (each a
    /// `lockmesh_arbiter_wakeups_per_grant` observation).
    pub grants_after_wait: u64,
    /// Acquires answered `409 contended` with reason `key_gated` here.
    pub key_gated: u64,
    /// Acquires answered `409 contended` with reason `lock_contended` here.
    pub lock_contended: u64,
    /// The namespace label.
    pub namespace: String,
    /// How long the oldest gated waiter here has waited, ms (0 without one).
    pub oldest_gated_wait_ms: u64,
    /// Age of the oldest open hold, ms, over every cluster (0 without one).
    pub oldest_hold_ms: u64,
    /// Open holds, over every cluster.
    pub open_holds: u64,
    /// Mean time from a release here to the next grant here, ms, or `null`
    /// before the first (`lockmesh_arbiter_pickup_latency_seconds`).
    pub pickup_mean_ms: Option<u64>,
    /// Pickups measured (grants here after a release here).
    pub pickups: u64,
    /// Wake-ups of the waiters here over `grants_after_wait` grants.
    pub wakeups: u64,
}

/// One etcd cluster in [`ConsoleState`]: what this arbiter reads of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleCluster {
    /// Its name (`coord` for the config's `etcd:`).
    pub cluster: String,
    /// Its epoch record's current epoch, or `null` when it could not be read.
    pub epoch: Option<u64>,
    /// Its members, each asked through its own connection.
    pub etcd: ClusterView,
    /// Why its class policies could not be read, or `null`.
    pub policies_error: Option<String>,
    /// Its hold scan.
    pub scan: ConsoleScan,
    /// Why this arbiter refuses grants on it (its seal reason), or `null`.
    pub sealed: Option<String>,
}

/// A class's enforcement posture, tagged by `posture`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "posture", rename_all = "snake_case")]
pub enum ConsoleEnforcement {
    /// Writes are fenced (ADR-01).
    Fenced,
    /// Not fenced, under a waiver.
    Advisory {
        /// Who accepted the risk.
        risk_owner: String,
        /// True once the waiver's day has passed.
        waiver_expired: bool,
        /// The waiver's last day, `YYYY-MM-DD`.
        waiver_expiry: String,
    },
}

/// A fenced class's pause test result (ADR-17).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PauseTest {
    /// When the result stops counting, unix seconds, when it could be read.
    pub expires_unix_s: Option<u64>,
    /// A passing, unexpired result exists.
    pub passing: bool,
}

/// One draining class in [`ConsoleState`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleDraining {
    /// The epoch of the limit change.
    pub change_epoch: u64,
    /// The class name.
    pub class: String,
    /// The cluster whose record drains; `null` from an arbiter before issue 18
    /// (which read the coord cluster only).
    #[serde(default)]
    pub cluster: Option<String>,
    /// How long it has been draining, ms.
    pub draining_age_ms: Option<u64>,
    /// The limit in force while draining.
    pub limit: u32,
    /// True when the drain is part of a key move between clusters.
    pub pending_move: bool,
    /// The lowered limit it moves to.
    pub pending_target: Option<u32>,
}

/// etcd as the arbiter sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleEtcd {
    /// Every member, asked through its own connection.
    pub cluster: ClusterView,
    /// The endpoints the arbiter is configured with.
    pub endpoints: u64,
    /// How long etcd calls have been failing, ms (0 when they succeed).
    pub failing_for_ms: u64,
    /// True when the arbiter's last etcd call succeeded.
    pub reachable: bool,
}

/// The etcd cluster (`extproc/src/etcd_view.rs`; `lockctl doctor` checks it).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    /// Active alarms (`NOSPACE`, `CORRUPT`) with the member that raised them.
    pub alarms: Vec<String>,
    /// The cluster id, 16 hex digits.
    pub cluster_id: Option<String>,
    /// Why the member list could not be read, if it could not.
    pub error: Option<String>,
    /// The leader's member id, when the answering members agree on one.
    pub leader: Option<String>,
    /// Members, in member-list order.
    pub members: Vec<MemberView>,
    /// A majority of voting members answered and a leader is known.
    pub quorum: bool,
    /// Voting members.
    pub voting: u64,
    /// Voting members that answered.
    pub voting_reachable: u64,
}

/// One etcd member.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberView {
    /// Backend size, bytes.
    pub db_size: Option<i64>,
    /// Errors the member reports, or why it could not be asked.
    pub errors: Vec<String>,
    /// Member id, 16 hex digits.
    pub id: String,
    /// It is the leader.
    pub leader: bool,
    /// A raft learner (not voting).
    pub learner: bool,
    /// Member name (empty before it started).
    pub name: String,
    /// Raft index.
    pub raft_index: Option<u64>,
    /// Raft term.
    pub raft_term: Option<u64>,
    /// It answered its status request.
    pub reachable: bool,
    /// The client URL it was asked at; `null` when it has not started.
    pub url: Option<String>,
    /// etcd server version.
    pub version: Option<String>,
}

/// The signed-in operator.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleOperator {
    /// The token's verified `sub`.
    pub sub: String,
}

/// The hold scan behind the class numbers: what was read, or why not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ConsoleScan {
    /// The scan ran.
    Done {
        /// Holds read.
        holds: u64,
        /// The etcd revision every page was read at.
        revision: i64,
        /// True when it stopped at its bound before the end.
        truncated: bool,
    },
    /// The scan failed or timed out: `{"error": ...}`.
    Failed {
        /// Why.
        error: String,
    },
}

/// The seal part of [`ConsoleState`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleSeal {
    /// What the seal rests on, or `null`.
    pub detail: Option<String>,
    /// The epoch record's current epoch, or `null` when it could not be read.
    pub epoch: Option<u64>,
    /// The epoch record's explicit seal (an advance in progress), or `null`.
    pub explicit: Option<String>,
    /// Why the arbiter is sealed, or `null`.
    pub reason: Option<String>,
    /// True while every request is refused.
    pub sealed: bool,
    /// When the seal was declared, unix ms, or `null`.
    pub since_ms: Option<u64>,
}

/// Open holds by age: `counts[i]` holds are younger than `bounds_ms[i]` and at
/// least `bounds_ms[i - 1]` old; the last count is of holds at least the last
/// bound old (`counts` has one more member than `bounds_ms`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleHoldAges {
    /// The buckets' upper bounds, ms, ascending.
    pub bounds_ms: Vec<u64>,
    /// Open holds in each bucket.
    pub counts: Vec<u64>,
}

/// `GET /console/api/history`: the arbiter's own figures over its last
/// `capacity` samples, one every `interval_ms` (an hour at the default 10 s),
/// kept in memory and lost at a restart. Columns: every series has one value per
/// member of `at_ms`, oldest first. Counts are per window: from the previous
/// sample (the first: from `started_ms`) to the sample's time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleHistory {
    /// When each sample was taken, unix ms, oldest first.
    pub at_ms: Vec<u64>,
    /// Most samples kept; the oldest is dropped beyond.
    pub capacity: u64,
    /// One series set per class: the registry's classes and every class a kept
    /// sample has, by name.
    pub classes: Vec<HistoryClass>,
    /// etcd as this arbiter's seal checks (one a second) saw it.
    pub etcd: HistoryEtcd,
    /// When this answer was made, unix ms.
    pub generated_ms: u64,
    /// Time between samples, ms (`console.history_interval_s`).
    pub interval_ms: u64,
    /// When sampling began (the arbiter's start), unix ms.
    pub started_ms: u64,
}

/// One class's series in [`ConsoleHistory`]. Grants, refusals and gated waiters
/// are this arbiter's; open holds and the oldest hold are fleet-wide (every
/// cluster's holds, which every arbiter follows: the same on every arbiter).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryClass {
    /// The class label (as the metrics name it).
    pub class: String,
    /// Gated waiters here at each sample (`lockmesh_arbiter_gated_waiters`, summed
    /// over namespaces).
    pub gated_waiters: Vec<u64>,
    /// Acquires answered with a grant here in each window.
    pub grants: Vec<u64>,
    /// Acquires answered with a grant here since the start, at the last sample
    /// (`lockmesh_arbiter_acquires_total{outcome="granted"}` summed over namespaces).
    pub grants_total: u64,
    /// Age of the oldest open hold at each sample, ms
    /// (`lockmesh_arbiter_oldest_hold_seconds`, the highest over namespaces).
    pub oldest_hold_ms: Vec<u64>,
    /// Open holds at each sample (`lockmesh_arbiter_open_holds`, summed).
    pub open_holds: Vec<u64>,
    /// Acquires refused here in each window: every outcome but `granted` and
    /// `cancelled` (the caller left).
    pub refusals: Vec<u64>,
    /// Acquires refused here since the start, at the last sample.
    pub refusals_total: u64,
}

/// The seal checks' series in [`ConsoleHistory`] (per arbiter): how long one
/// linearizable read of the epoch record took (`lockmesh_arbiter_etcd_check_seconds`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HistoryEtcd {
    /// Seal checks in each window.
    pub checks: Vec<u64>,
    /// Seal checks that failed in each window.
    pub failures: Vec<u64>,
    /// The slowest check of each window, µs; `null` without one.
    pub max_us: Vec<Option<u64>>,
    /// The checks' mean time in each window, µs; `null` without one.
    pub mean_us: Vec<Option<u64>>,
}

/// `GET /console/api/classes/{class}`: one class's drill-down, over every cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleClassDetail {
    /// The class.
    pub class: String,
    /// When it was read, unix ms.
    pub generated_ms: u64,
    /// Its open holds by age, or `null` when a scan failed.
    pub hold_ages: Option<ConsoleHoldAges>,
    /// Its rows of [`ConsoleState::holds_and_waits`].
    pub holds_and_waits: Vec<ConsoleHoldWait>,
    /// Its open holds.
    pub open_grants: u64,
    /// Its keys at their limit, most holders then oldest first (at most 100),
    /// each with the acquires waiting for it at this arbiter.
    pub saturated: Vec<SaturatedKey>,
    /// How many of its keys are at their limit.
    pub saturated_keys: u64,
    /// The hold scans read.
    pub scan: ConsoleScan,
}

/// `GET /console/api/waiters/{digest}`: acquires of one key queued at this arbiter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleWaiters {
    /// The key digest asked about, 64 hex digits.
    pub digest: String,
    /// Acquires queued here now (not fleet-wide: sum over the arbiters).
    pub waiters: u64,
}

/// One namespace's use of its quotas on one cluster: a row of the console's
/// quota table and of `lockctl class cost --json`'s `namespaces`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsoleQuota {
    /// The acquire-rate quota, per second (cluster-wide).
    pub acquires_per_s: u64,
    /// True when some use is at or above 80 % of its limit (the alert's threshold).
    pub alert: bool,
    /// The cluster.
    pub cluster: String,
    /// Live holds against the quota.
    pub holds: QuotaUse,
    /// The namespace (a key's first segment, or `*` for sessions of no namespace).
    pub namespace: String,
    /// Live sessions against the quota.
    pub sessions: QuotaUse,
    /// Acquires waiting at this arbiter against its share, or `null` where it is
    /// not counted (`lockctl`, which reads etcd only).
    pub waiters: Option<QuotaUse>,
}

/// A use against a limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaUse {
    /// The limit.
    pub limit: u64,
    /// `used` over `limit`, whole percent (rounded down).
    pub percent: u64,
    /// As counted.
    pub used: u64,
}

impl QuotaUse {
    /// `used` of `limit`.
    pub fn of(used: u64, limit: u64) -> Self {
        Self { used, limit, percent: crate::quota::percent(used, limit) }
    }

    /// At or above the alert threshold (80 %).
    pub fn alerting(&self) -> bool {
        self.used as f64 >= self.limit as f64 * crate::quota::ALERT_RATIO
    }
}

/// `lockctl class cost FILE --endpoints ... --json`: each namespace's sessions and
/// holds on one cluster, listed at `revision`, against the file's quotas.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaReport {
    /// The etcd revision of the list.
    pub revision: i64,
    /// One row per namespace with a session or a hold, or listed in the file.
    pub namespaces: Vec<ConsoleQuota>,
}

/// A console refusal: the operator plane's one refusal body.
pub type ConsoleErrorBody = super::admin::AdminErrorBody;
