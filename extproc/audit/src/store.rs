//! The embedded audit store (redb: one file, no server).
//!
//! ```text
//! events      <event key>                                   -> AuditEvent (JSON)
//! by_digest   <digest>/<event key>                          -> ()
//! holds       <cluster>/<timeline>/<grant rev:020>/<etcd key> -> HoldRow (JSON)
//! closed      <cluster>/<timeline>/<session>                -> close revision
//! meta        "checkpoint"                                   -> Checkpoint (JSON)
//! ```
//!
//! A batch of events and the checkpoint after it commit in one redb transaction,
//! so a crash loses neither half: the tailer resumes from the checkpoint and a
//! replayed event overwrites its own row (same key).

use std::path::Path;

use redb::{Database, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use super::event::{AuditEvent, EventKind, HoldEnd, HoldRow};

const EVENTS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("events");
const BY_DIGEST: TableDefinition<'_, &str, ()> = TableDefinition::new("by_digest");
const HOLDS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("holds");
const CLOSED: TableDefinition<'_, &str, i64> = TableDefinition::new("closed");
const META: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("meta");

/// Where the tailer stands.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Cluster id, hex.
    pub cluster_id: String,
    /// Timeline (raised on each restore or cluster change).
    pub timeline: u32,
    /// Last revision whose events are all stored.
    pub revision: i64,
    /// Epoch in force at that revision.
    pub epoch: u64,
    /// Highest epoch ever seen.
    pub max_epoch: u64,
    /// When written, unix ms.
    pub updated_ms: u64,
}

/// A store failure (file, lock, corruption).
#[derive(Debug, thiserror::Error)]
#[error("audit store: {0}")]
pub struct StoreError(String);

/// The tailer's embedded redb event store (one file; tables in the module doc).
pub struct Store {
    db: Database,
}

/// What one commit did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    /// Events not stored before.
    pub new: usize,
    /// Events that replaced an identical key (a replay).
    pub replayed: usize,
}

fn err(e: impl std::fmt::Display) -> StoreError {
    StoreError(e.to_string())
}

fn hold_id(e: &AuditEvent, grant_rev: i64) -> String {
    format!("{}/{:08}/{:020}/{}", e.cluster_id, e.timeline, grant_rev, e.etcd_key)
}

// === impl Store ===

impl Store {
    /// Opens (or creates) the store at `path`. One process at a time: a second
    /// open fails while the tailer runs (query it over HTTP instead).
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let db = Database::create(path).map_err(|e| StoreError(format!("{}: {e}", path.display())))?;
        let tx = db.begin_write().map_err(err)?;
        {
            tx.open_table(EVENTS).map_err(err)?;
            tx.open_table(BY_DIGEST).map_err(err)?;
            tx.open_table(HOLDS).map_err(err)?;
            tx.open_table(CLOSED).map_err(err)?;
            tx.open_table(META).map_err(err)?;
        }
        tx.commit().map_err(err)?;
        Ok(Self { db })
    }

    /// The checkpoint, if any.
    pub fn checkpoint(&self) -> Result<Option<Checkpoint>, StoreError> {
        let tx = self.db.begin_read().map_err(err)?;
        let t = tx.open_table(META).map_err(err)?;
        let v = t.get("checkpoint").map_err(err)?;
        v.map(|g| serde_json::from_slice(g.value()).map_err(err)).transpose()
    }

    /// Whether a session's close marker was stored (for `cluster`/`timeline`).
    pub(crate) fn is_closed(&self, cluster: &str, timeline: u32, session: &str) -> Result<bool, StoreError> {
        let tx = self.db.begin_read().map_err(err)?;
        let t = tx.open_table(CLOSED).map_err(err)?;
        Ok(t.get(format!("{cluster}/{timeline:08}/{session}").as_str()).map_err(err)?.is_some())
    }

    /// Stores `events` (and the close markers among them) and the checkpoint, in
    /// one transaction.
    pub fn apply(&self, events: &[AuditEvent], cp: &Checkpoint) -> Result<Applied, StoreError> {
        let mut applied = Applied::default();
        let tx = self.db.begin_write().map_err(err)?;
        {
            let mut ev = tx.open_table(EVENTS).map_err(err)?;
            let mut by = tx.open_table(BY_DIGEST).map_err(err)?;
            let mut holds = tx.open_table(HOLDS).map_err(err)?;
            let mut closed = tx.open_table(CLOSED).map_err(err)?;
            for e in events {
                let k = e.event_key();
                let v = serde_json::to_vec(e).map_err(err)?;
                if ev.insert(k.as_str(), v.as_slice()).map_err(err)?.is_some() {
                    applied.replayed += 1;
                } else {
                    applied.new += 1;
                }
                if let Some(d) = &e.digest {
                    by.insert(format!("{d}/{k}").as_str(), ()).map_err(err)?;
                }
                if e.kind == EventKind::SessionClose {
                    if let Some(s) = &e.session {
                        closed
                            .insert(format!("{}/{:08}/{s}", e.cluster_id, e.timeline).as_str(), e.revision)
                            .map_err(err)?;
                    }
                }
                let Some(g) = e.grant_revision else { continue };
                let id = hold_id(e, g);
                if e.kind == EventKind::Grant {
                    let row = HoldRow {
                        digest: e.digest.clone().unwrap_or_default(),
                        key: e.key.clone().unwrap_or_default(),
                        identity: e.identity.clone().unwrap_or_default(),
                        class: e.class.clone().unwrap_or_default(),
                        epoch: e.epoch,
                        grant_revision: g,
                        session: e.session.clone().unwrap_or_default(),
                        granted_ms: e.at_ms,
                        end: None,
                    };
                    // A replayed grant must not reopen a hold whose end is stored.
                    let old: Option<HoldRow> =
                        holds.get(id.as_str()).map_err(err)?.and_then(|g| serde_json::from_slice(g.value()).ok());
                    let row = HoldRow { end: old.and_then(|o| o.end), ..row };
                    holds.insert(id.as_str(), serde_json::to_vec(&row).map_err(err)?.as_slice()).map_err(err)?;
                } else if e.kind.ends_hold() {
                    let old: Option<HoldRow> =
                        holds.get(id.as_str()).map_err(err)?.and_then(|g| serde_json::from_slice(g.value()).ok());
                    // A hold granted before the tailer's history: its record came with the delete.
                    let mut row = old.unwrap_or_else(|| HoldRow {
                        digest: e.digest.clone().unwrap_or_default(),
                        key: e.key.clone().unwrap_or_default(),
                        identity: e.identity.clone().unwrap_or_default(),
                        class: e.class.clone().unwrap_or_default(),
                        epoch: e.epoch,
                        grant_revision: g,
                        session: e.session.clone().unwrap_or_default(),
                        granted_ms: 0,
                        end: None,
                    });
                    row.end = Some(HoldEnd { kind: e.kind, revision: e.revision, at_ms: e.at_ms });
                    holds.insert(id.as_str(), serde_json::to_vec(&row).map_err(err)?.as_slice()).map_err(err)?;
                }
            }
            let mut meta = tx.open_table(META).map_err(err)?;
            meta.insert("checkpoint", serde_json::to_vec(cp).map_err(err)?.as_slice()).map_err(err)?;
        }
        tx.commit().map_err(err)?;
        Ok(applied)
    }

    /// Every event, in key order (cluster, timeline, revision).
    pub fn events(&self) -> Result<Vec<AuditEvent>, StoreError> {
        let tx = self.db.begin_read().map_err(err)?;
        let t = tx.open_table(EVENTS).map_err(err)?;
        let mut out = Vec::new();
        for r in t.iter().map_err(err)? {
            let (_, v) = r.map_err(err)?;
            out.push(serde_json::from_slice(v.value()).map_err(err)?);
        }
        Ok(out)
    }

    /// The `limit` most recent events, newest first: those of the checkpoint's
    /// history (cluster id and timeline), read backwards in revision order, so the
    /// cost is the limit, not the store's size. Empty before the first checkpoint.
    pub fn recent(&self, limit: usize) -> Result<Vec<AuditEvent>, StoreError> {
        let Some(cp) = self.checkpoint()? else { return Ok(Vec::new()) };
        let tx = self.db.begin_read().map_err(err)?;
        let t = tx.open_table(EVENTS).map_err(err)?;
        // Event keys are `<cluster>/<timeline:08>/<revision:020>/...`; '0' follows '/'.
        let (lo, hi) =
            (format!("{}/{:08}/", cp.cluster_id, cp.timeline), format!("{}/{:08}0", cp.cluster_id, cp.timeline));
        let mut out = Vec::new();
        for r in t.range(lo.as_str()..hi.as_str()).map_err(err)?.rev().take(limit) {
            let (_, v) = r.map_err(err)?;
            out.push(serde_json::from_slice(v.value()).map_err(err)?);
        }
        Ok(out)
    }

    /// The history of one key (by digest), in revision order.
    pub fn history(&self, digest: &str) -> Result<Vec<AuditEvent>, StoreError> {
        let tx = self.db.begin_read().map_err(err)?;
        let by = tx.open_table(BY_DIGEST).map_err(err)?;
        let ev = tx.open_table(EVENTS).map_err(err)?;
        let (lo, hi) = (format!("{digest}/"), format!("{digest}0"));
        let mut out = Vec::new();
        for r in by.range(lo.as_str()..hi.as_str()).map_err(err)? {
            let (k, _) = r.map_err(err)?;
            let key = k.value().get(lo.len()..).unwrap_or_default().to_owned();
            if let Some(v) = ev.get(key.as_str()).map_err(err)? {
                out.push(serde_json::from_slice(v.value()).map_err(err)?);
            }
        }
        Ok(out)
    }

    /// Every hold row.
    pub fn holds(&self) -> Result<Vec<HoldRow>, StoreError> {
        let tx = self.db.begin_read().map_err(err)?;
        let t = tx.open_table(HOLDS).map_err(err)?;
        let mut out = Vec::new();
        for r in t.iter().map_err(err)? {
            let (_, v) = r.map_err(err)?;
            out.push(serde_json::from_slice(v.value()).map_err(err)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(rev: i64, kind: EventKind, grant: i64) -> AuditEvent {
        AuditEvent {
            cluster_id: "00000000000000aa".into(),
            timeline: 0,
            epoch: 1,
            revision: rev,
            etcd_key: "/r/l/dd/h/0000".into(),
            kind,
            digest: Some("dd".into()),
            key: Some("a/b".into()),
            identity: Some("spiffe://x/a".into()),
            instance: None,
            class: Some("default".into()),
            session: Some("000000000000001f".into()),
            grant_revision: Some(grant),
            slot: Some(0),
            at_ms: u64::try_from(rev).unwrap() * 1000,
            detail: None,
            unprotected: false,
        }
    }

    #[test]
    fn replays_overwrite_and_holds_join_grant_and_end() {
        let dir = std::env::temp_dir().join(format!("lockmesh-audit-store-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = Store::open(&dir.join("a.redb")).unwrap();
        let cp = Checkpoint { revision: 12, ..Default::default() };
        let batch = [ev(10, EventKind::Grant, 10), ev(12, EventKind::Expiry, 10)];
        assert_eq!(s.apply(&batch, &cp).unwrap(), Applied { new: 2, replayed: 0 });
        // A replay (crash before the checkpoint moved on) adds nothing.
        assert_eq!(s.apply(&batch[..1], &cp).unwrap(), Applied { new: 0, replayed: 1 });
        assert_eq!(s.events().unwrap().len(), 2);
        assert_eq!(s.history("dd").unwrap().len(), 2);
        assert!(s.history("d").unwrap().is_empty());
        let holds = s.holds().unwrap();
        assert_eq!(holds.len(), 1);
        assert_eq!(holds[0].end.as_ref().map(|e| e.kind), Some(EventKind::Expiry));
        assert_eq!(s.checkpoint().unwrap().unwrap().revision, 12);
        // Recent: newest first, bounded, only the checkpoint's history.
        let cp = Checkpoint { revision: 14, cluster_id: "00000000000000aa".into(), ..Default::default() };
        s.apply(&[ev(14, EventKind::Grant, 14)], &cp).unwrap();
        let revs: Vec<i64> = s.recent(2).unwrap().iter().map(|e| e.revision).collect();
        assert_eq!(revs, [14, 12]);
        assert_eq!(s.recent(10).unwrap().len(), 3);
        let other = Checkpoint { timeline: 1, ..cp };
        s.apply(&[], &other).unwrap();
        assert!(s.recent(10).unwrap().is_empty(), "another timeline's history has no events yet");
        drop(s);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
