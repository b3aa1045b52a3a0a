//! The audit tailer's queries (`lockmesh-audit`, `extproc/src/audit/`): `lockctl
//! audit` and the console post a [`Query`] to `POST /v1/audit/query` and read an
//! [`Answer`]; `GET /v1/audit/checkpoint` answers a [`CheckpointReply`]. The same
//! types are what `lockctl audit --json` prints and what the tailer's store keeps.
//!
//! Members are in the order the tailer declared them, which is the order `lockctl
//! audit --json` and the tailer's HTTP answers print. The `detail` of the events
//! the tailer writes itself, [`RestoreDetail`] and [`GapDetail`], goes into an
//! event as a JSON value, so those print their keys sorted and declare them so.

use serde::{Deserialize, Serialize};

use super::opaque::Opaque;

/// A query, tagged by `query`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "query", rename_all = "snake_case")]
pub enum Query {
    /// Every event of one key, by digest (the CLI digests the raw key locally).
    History {
        /// The key digest, 64 hex digits.
        digest: String,
    },
    /// Holds of one identity overlapping `[since_ms, until_ms]`.
    ByIdentity {
        /// The holder's SPIFFE ID.
        identity: String,
        /// Window start, unix ms.
        since_ms: u64,
        /// Window end, unix ms.
        until_ms: u64,
    },
    /// The longest holds (open ones counted up to now).
    Longest {
        /// How many.
        limit: u64,
    },
    /// Holds that ended by expiry, without a release.
    Expiries {
        /// Window start, unix ms.
        since_ms: u64,
    },
    /// The most recent events of the current history, newest first (at most 1000).
    Recent {
        /// How many.
        limit: u64,
    },
    /// Events of one kind (gaps, restores, limit changes...) since a time.
    Events {
        /// The kind.
        kind: EventKind,
        /// Window start, unix ms.
        since_ms: u64,
    },
    /// The reconciliation list (ADR-04): every unprotected grant (a fail-open
    /// class's token-0 grant during a quorum loss) granted in `[since_ms,
    /// until_ms]`, of one outage if named, with how it ended.
    Unprotected {
        /// Window start, unix ms.
        since_ms: u64,
        /// Window end, unix ms.
        until_ms: u64,
        /// Only this outage (`<cluster>-<declared ms>`, as the arbiter logged it).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        outage: Option<String>,
    },
}

/// A query's answer, tagged by `answer`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    /// Events (history, recent, events).
    Events {
        /// In revision order (newest first for `recent`).
        events: Vec<AuditEvent>,
    },
    /// Holds (by_identity, longest, expiries).
    Holds {
        /// Ordered by the query.
        holds: Vec<HoldSpan>,
    },
    /// Unprotected grants, in grant order.
    Unprotected {
        /// One per grant id.
        grants: Vec<UnprotectedGrant>,
    },
}

/// What happened. A closed set: it is also a metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A hold was created (the grant transaction committed).
    Grant,
    /// A hold was deleted together with its release marker (the holder released).
    Release,
    /// A hold ended with its session, which its holder had closed (close marker).
    SessionRelease,
    /// A hold was deleted with its session's lease, with no release and no close
    /// marker: the session expired (or was revoked by the arbiter that opened it).
    Expiry,
    /// A hold was deleted together with a force record (`<root>/f/<digest>`).
    ForceRelease,
    /// A hold was deleted by an epoch advance (same revision as the epoch record).
    EpochPurge,
    /// A hold was deleted with none of the above at its revision.
    UnmarkedDelete,
    /// A session record was created.
    SessionOpen,
    /// A session's holder closed it (close marker written).
    SessionClose,
    /// A session record went with its lease and no close marker.
    SessionExpiry,
    /// A force record was written without a hold deleted at its revision.
    ForceRecord,
    /// A class policy record changed (limit change, drain, resume, cancel).
    LimitChange,
    /// The authoritative prefix-to-class map changed.
    ClassMapChange,
    /// The epoch record changed (created, sealed, advanced, unsealed).
    Epoch,
    /// History the tailer could not read (compacted past its checkpoint, or another cluster).
    Gap,
    /// The cluster's revision went behind the tailer's checkpoint: a restore.
    Restore,
    /// A key's lock-delay began (`<root>/d/<digest>`): its last hold ended
    /// without a release.
    LockDelay,
    /// A class's candidate policy would have refused what the enforced one granted.
    WouldRefuse,
    /// A class's candidate policy would have granted what the enforced one refused.
    WouldGrant,
}

/// One audit event.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// The etcd cluster id, 16 hex digits.
    pub cluster_id: String,
    /// The tailer's timeline: raised each time the cluster's history went back
    /// (restore) or changed cluster, so repeated revisions never collide.
    pub timeline: u32,
    /// The epoch in force (the hold's own epoch for hold events).
    pub epoch: u64,
    /// The etcd revision of the change (0 for an unprotected record).
    pub revision: i64,
    /// The etcd key that changed (never contains a raw lock key).
    pub etcd_key: String,
    /// What happened.
    pub kind: EventKind,
    /// The lock key digest, for hold, release and force events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The raw lock key, from the hold record (the audit store is access-controlled;
    /// it never goes to logs or metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The holder's or session owner's SPIFFE ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// The declared instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// The class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// The session id (16 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The revision of the grant a hold event belongs to (with `epoch`, the grant's
    /// identity; the token itself is not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_revision: Option<i64>,
    /// The hold slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    /// Wall time of the fact, unix ms: from the record (grant, release, close), else
    /// when the tailer read it.
    pub at_ms: u64,
    /// Kind-specific detail, as recorded in etcd (policy, force record, gap range,
    /// epoch record; for an unprotected record: grant id, outage, cluster, ttl or
    /// reason, ship revision).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<Opaque>,
    /// A fail-open class's grant (or its end) made from an arbiter's memory with
    /// token 0 during a quorum loss (ADR-04), shipped from its spool after
    /// recovery. Its `revision` is 0: no etcd revision committed it. Absent when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unprotected: bool,
}

/// One hold's life, kept beside the events for the window queries.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRow {
    /// The key digest.
    pub digest: String,
    /// The raw key.
    pub key: String,
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The class.
    pub class: String,
    /// The epoch of the grant.
    pub epoch: u64,
    /// The grant's etcd revision.
    pub grant_revision: i64,
    /// The session id, 16 hex digits.
    pub session: String,
    /// Grant time, unix ms.
    pub granted_ms: u64,
    /// How it ended; absent while open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<HoldEnd>,
}

/// The end of a hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldEnd {
    /// Release, expiry, force release...
    pub kind: EventKind,
    /// The etcd revision of the end.
    pub revision: i64,
    /// Wall time, unix ms.
    pub at_ms: u64,
}

/// A hold with its duration (the [`HoldRow`] members, flattened, plus two).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldSpan {
    /// The hold.
    #[serde(flatten)]
    pub hold: HoldRow,
    /// Held for, ms (to now for an open hold).
    pub held_ms: u64,
    /// Still open as far as the tailer knows.
    pub open: bool,
}

/// One unprotected grant, joined with its end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnprotectedGrant {
    /// The grant id, 32 hex digits.
    pub grant_id: String,
    /// The outage it was granted in.
    pub outage: String,
    /// The etcd cluster (arbiter config name) whose quorum was lost.
    pub cluster: String,
    /// The etcd cluster id its records were shipped to.
    pub cluster_id: String,
    /// The epoch the arbiter last read there.
    pub epoch: u64,
    /// The key's namespace.
    pub namespace: String,
    /// The class.
    pub class: String,
    /// The key digest.
    pub digest: String,
    /// The raw key (JSON output only; the table shows the digest).
    pub key: String,
    /// The holder's SPIFFE ID.
    pub identity: String,
    /// The holder's instance; absent when it declared none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    /// Grant time, unix ms (the arbiter's clock).
    pub granted_ms: u64,
    /// The class TTL it would lapse after, seconds, when recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// How it ended (release or expiry, with the reason), if that was shipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<UnprotectedEnd>,
}

/// The end of an unprotected grant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnprotectedEnd {
    /// Release or expiry.
    pub kind: EventKind,
    /// When, unix ms.
    pub at_ms: u64,
    /// `ttl`, `arbiter_restart`, `caller_gone` or `reconcile`; absent for a release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Where the tailer stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The etcd cluster id, 16 hex digits.
    pub cluster_id: String,
    /// The timeline (raised on each restore or cluster change).
    pub timeline: u32,
    /// The last revision whose events are all stored.
    pub revision: i64,
    /// The epoch in force at that revision.
    pub epoch: u64,
    /// The highest epoch ever seen.
    pub max_epoch: u64,
    /// When written, unix ms.
    pub updated_ms: u64,
}

/// `GET /v1/audit/checkpoint`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointReply {
    /// The tailer's checkpoint, or `null` before its first or when unreadable.
    pub checkpoint: Option<Checkpoint>,
}

/// A failed query (`500`): `{"error": ...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditErrorBody {
    /// What failed (the store's error).
    pub error: String,
}

/// The `detail` of a [`EventKind::Restore`] event: the cluster's revision went
/// behind the tailer's checkpoint (its history was restored from a snapshot).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestoreDetail {
    /// The revision of the tailer's checkpoint, which the cluster no longer reaches.
    pub checkpoint: i64,
    /// The cluster's revision when the tailer noticed.
    pub current: i64,
    /// The epoch the explicit seal in the epoch record advances to (the tailer's
    /// own with `seal_on_restore`, or one already there), or `null` when there is
    /// none (`seal_on_restore: false`, no epoch record).
    pub sealed_target: Option<u64>,
}

/// The `detail` of a [`EventKind::Gap`] event: history the tailer could not read,
/// tagged by `reason`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reason")]
pub enum GapDetail {
    /// The audited etcd is another cluster (another cluster id) than the checkpoint's:
    /// its history is not a continuation, and the tailer starts a new timeline at 0.
    #[serde(rename = "cluster changed")]
    ClusterChanged {
        /// The checkpoint's cluster id, 16 hex digits.
        from_cluster: String,
        /// The checkpoint's revision in that cluster.
        from_revision: i64,
    },
    /// etcd compacted past the checkpoint: the revisions between are lost.
    #[serde(rename = "compacted")]
    Compacted {
        /// The first revision lost (the checkpoint's next).
        from_revision: i64,
        /// The last revision lost (the compaction revision's previous).
        to_revision: i64,
    },
}

// === impl EventKind ===

impl EventKind {
    /// Every kind, in label order.
    pub const ALL: [EventKind; 19] = [
        EventKind::Grant,
        EventKind::Release,
        EventKind::SessionRelease,
        EventKind::Expiry,
        EventKind::ForceRelease,
        EventKind::EpochPurge,
        EventKind::UnmarkedDelete,
        EventKind::SessionOpen,
        EventKind::SessionClose,
        EventKind::SessionExpiry,
        EventKind::ForceRecord,
        EventKind::LimitChange,
        EventKind::ClassMapChange,
        EventKind::Epoch,
        EventKind::Gap,
        EventKind::Restore,
        EventKind::LockDelay,
        EventKind::WouldRefuse,
        EventKind::WouldGrant,
    ];

    /// The snake_case name (wire string, metric label, key component).
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Grant => "grant",
            EventKind::Release => "release",
            EventKind::SessionRelease => "session_release",
            EventKind::Expiry => "expiry",
            EventKind::ForceRelease => "force_release",
            EventKind::EpochPurge => "epoch_purge",
            EventKind::UnmarkedDelete => "unmarked_delete",
            EventKind::SessionOpen => "session_open",
            EventKind::SessionClose => "session_close",
            EventKind::SessionExpiry => "session_expiry",
            EventKind::ForceRecord => "force_record",
            EventKind::LimitChange => "limit_change",
            EventKind::ClassMapChange => "class_map_change",
            EventKind::Epoch => "epoch",
            EventKind::Gap => "gap",
            EventKind::Restore => "restore",
            EventKind::LockDelay => "lock_delay",
            EventKind::WouldRefuse => "would_refuse",
            EventKind::WouldGrant => "would_grant",
        }
    }

    /// Parses [`EventKind::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// True for the kinds that end a hold.
    pub fn ends_hold(self) -> bool {
        matches!(
            self,
            EventKind::Release
                | EventKind::SessionRelease
                | EventKind::Expiry
                | EventKind::ForceRelease
                | EventKind::EpochPurge
                | EventKind::UnmarkedDelete
        )
    }
}

// === impl AuditEvent ===

impl AuditEvent {
    /// The event's unique, replay-stable key:
    /// `<cluster>/<timeline>/<revision>/<epoch>/<kind>/<etcd key>`.
    ///
    /// Why it is unique: within one etcd history (one cluster id, one timeline) a
    /// revision is one committed entry, and one entry changes each etcd key at most
    /// once (etcd refuses a transaction naming a key twice); each change yields at
    /// most one event of a kind. So a lease expiry deleting many holds at one
    /// revision gives one key per hold key, and a hand-off (a release and a grant,
    /// or a force record and a delete) at one revision differs by etcd key or kind.
    /// A restore that keeps the cluster id repeats revisions, which is why the
    /// tailer raises the timeline when it sees the revision go back; the epoch
    /// separates histories even where a timeline was lost with a tailer's store.
    /// Replaying a revision derives the same events with the same keys, so a
    /// replay overwrites rows instead of adding them.
    pub fn event_key(&self) -> String {
        format!(
            "{}/{:08}/{:020}/{:05}/{}/{}",
            self.cluster_id,
            self.timeline,
            self.revision,
            self.epoch,
            self.kind.as_str(),
            self.etcd_key
        )
    }
}
