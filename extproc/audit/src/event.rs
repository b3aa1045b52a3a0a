//! Audit events and their unique keys.

use serde::{Deserialize, Serialize};

/// What happened. A closed set: it is also a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
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
    /// A key's lock-delay began (`<root>/d/<digest>`, `lockmesh_lock::delay`): its
    /// last hold ended without a release; `detail` names the cause and the delay.
    LockDelay,
    /// A class's candidate policy would have refused what the enforced one
    /// granted (`<root>/w/<class>`, `lockmesh_lock::shadow`): `detail` is the
    /// record (`reason`, `enforced`, `candidate`, `count` decisions it stands for).
    WouldRefuse,
    /// A class's candidate policy would have granted what the enforced one refused.
    WouldGrant,
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
}

/// The `detail` field of a hold event naming the caller a self client (an in-pod
/// sidecar, the arbiter's `tls.self_clients`) claimed. The hold was authorised and
/// recorded under the self client's own identity (`identity`); this one is
/// unverified: nothing but the sidecar said so.
pub const UNVERIFIED_CALLER: &str = "unverified_caller";

/// One audit event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditEvent {
    /// etcd cluster id, 16 hex digits.
    pub cluster_id: String,
    /// The tailer's timeline: raised each time the cluster's history went back
    /// (restore) or changed cluster, so repeated revisions never collide.
    pub timeline: u32,
    /// Epoch in force (the hold's own epoch for hold events).
    pub epoch: u64,
    /// etcd revision of the change.
    pub revision: i64,
    /// The etcd key that changed (never contains a raw lock key).
    pub etcd_key: String,
    pub kind: EventKind,
    /// Lock key digest, for hold, release and force events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Raw lock key, from the hold record (the audit store is access-controlled;
    /// it never goes to logs or metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Holder or session owner SPIFFE ID.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
    /// Holder's declared instance (`x-lock-instance`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Session id (16 hex digits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// Revision of the grant a hold event belongs to (with `epoch`, the grant's
    /// identity; the token itself is not stored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_revision: Option<i64>,
    /// Hold slot, 0..limit-1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    /// Wall time of the fact, unix ms: from the record (grant, release, close), else
    /// when the tailer read it.
    pub at_ms: u64,
    /// Kind-specific detail (policy, force record, gap range, epoch record; for an
    /// unprotected record: grant id, outage, cluster, ttl or reason, ship revision).
    /// A hold event of a hold granted to a self client adds [`UNVERIFIED_CALLER`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<serde_json::Value>,
    /// A fail-open class's grant (or its end) made from an arbiter's memory with
    /// token 0 during a quorum loss (ADR-04), shipped from its spool after
    /// recovery. Its `revision` is 0: no etcd revision committed it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unprotected: bool,
}

/// One hold's life, kept beside the events for the window queries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRow {
    pub digest: String,
    /// Raw key.
    pub key: String,
    /// Holder SPIFFE ID.
    pub identity: String,
    pub class: String,
    /// Epoch of the grant.
    pub epoch: u64,
    /// Revision of the grant (with `epoch`, the grant's identity).
    pub grant_revision: i64,
    /// Session id (16 hex digits).
    pub session: String,
    /// Grant time, unix ms.
    pub granted_ms: u64,
    /// How it ended, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<HoldEnd>,
}

/// The end of a hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldEnd {
    /// Release, expiry, force release...
    pub kind: EventKind,
    /// Revision of the end.
    pub revision: i64,
    /// Wall time, unix ms.
    pub at_ms: u64,
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

    /// The snake_case name (metric label, key component).
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The console and `lockctl` read events as `lockmesh_core::wire::audit`: every
    /// kind the tailer writes must parse there (a kind missing there fails the
    /// console's whole audit panel).
    #[test]
    fn every_kind_is_a_kind_of_the_wire() {
        let ours: Vec<&str> = EventKind::ALL.iter().map(|k| k.as_str()).collect();
        let wire: Vec<&str> = lockmesh_core::wire::audit::EventKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(ours, wire);
        for k in EventKind::ALL {
            let w: Result<lockmesh_core::wire::audit::EventKind, _> =
                serde_json::from_value(serde_json::json!(k.as_str()));
            assert!(w.is_ok(), "{} is not a kind of lockmesh_core::wire::audit", k.as_str());
        }
    }

    #[test]
    fn kinds_round_trip_and_keys_sort_by_revision() {
        for k in EventKind::ALL {
            assert_eq!(EventKind::parse(k.as_str()), Some(k));
            assert_eq!(serde_json::to_value(k).unwrap(), serde_json::json!(k.as_str()));
        }
        let ev = |rev, kind, key: &str| AuditEvent {
            cluster_id: "00000000000000aa".into(),
            timeline: 0,
            epoch: 1,
            revision: rev,
            etcd_key: key.into(),
            kind,
            digest: None,
            key: None,
            identity: None,
            instance: None,
            class: None,
            session: None,
            grant_revision: None,
            slot: None,
            at_ms: 0,
            detail: None,
            unprotected: false,
        };
        let a = ev(9, EventKind::Expiry, "/r/l/aa/h/0000");
        let b = ev(10, EventKind::Expiry, "/r/l/aa/h/0000");
        let c = ev(10, EventKind::Expiry, "/r/l/bb/h/0000");
        let d = ev(10, EventKind::Grant, "/r/l/bb/h/0000");
        assert!(a.event_key() < b.event_key());
        let keys: std::collections::BTreeSet<_> = [&a, &b, &c, &d].iter().map(|e| e.event_key()).collect();
        assert_eq!(keys.len(), 4);
        let mut e = b.clone();
        e.timeline = 1;
        assert_ne!(e.event_key(), b.event_key());
    }
}
