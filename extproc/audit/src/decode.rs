//! Turning the changes of one etcd revision into audit events: a pure function.
//!
//! All changes of one revision are decided together, because the facts that tell
//! a release from an expiry sit beside the hold's delete in the same committed
//! entry: the release marker (`r/<digest>`, same transaction as the delete), the
//! force record (`f/<digest>`), the epoch record (an advance purges holds in its
//! own transaction) or the session record (a lease's end deletes every key on it
//! at one revision). The close marker comes one revision earlier than the lease
//! revoke, so closed sessions are looked up in what was decoded before.

use std::collections::HashSet;

use lockmesh_core::headers::SessionId;
use lockmesh_keyspace::{CloseMarker, EpochRecord, ReleaseMarker, SessionRecord};
use serde::{de::DeserializeOwned, Serialize};
use serde_json::Value;

use super::event::{AuditEvent, EventKind, UNVERIFIED_CALLER};
use lockmesh_keyspace::HoldRecord;

/// A put or a delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Put,
    Delete,
}

/// A key's value as it was before the change (watch `prev_kv`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prev {
    pub value: Vec<u8>,
    /// Lease of the previous value.
    pub lease: i64,
    /// Create revision (for a hold: its grant revision).
    pub create_revision: i64,
}

/// One change of a revision, as the watch delivers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Put or delete.
    pub op: Op,
    /// etcd key.
    pub key: Vec<u8>,
    /// New value (empty for a delete).
    pub value: Vec<u8>,
    /// Lease of the new value.
    pub lease: i64,
    /// Create revision of the new value.
    pub create_revision: i64,
    /// The previous value, when etcd still had it.
    pub prev: Option<Prev>,
}

/// What the decoder knows besides the revision.
pub struct Context<'a> {
    /// Key root without a trailing slash.
    pub root: &'a str,
    /// Cluster id, hex.
    pub cluster_id: &'a str,
    /// The tailer's timeline, raised each time the cluster's history went back.
    pub timeline: u32,
    /// Epoch in force before this revision.
    pub epoch: u64,
    /// Wall time to stamp facts that carry none, unix ms.
    pub now_ms: u64,
    /// Whether a session's close marker was seen at an earlier revision.
    pub closed: &'a dyn Fn(&str) -> bool,
}

/// The result of one revision.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Decoded {
    /// Events, in change order.
    pub events: Vec<AuditEvent>,
    /// Sessions whose close marker was written at this revision.
    pub closed: Vec<String>,
    /// The epoch after this revision, if the epoch record changed.
    pub epoch: Option<u64>,
}

/// Where a key sits in the layout.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place<'k> {
    Hold {
        digest: &'k str,
        slot: u32,
    },
    ReleaseMarker(&'k str),
    CloseMarker(&'k str),
    Session(&'k str),
    Force(&'k str),
    Epoch,
    ClassMap,
    Policy(&'k str),
    /// A shipped unprotected-grant record (`failopen`): `u/<grant>/<op>`.
    Unprotected,
    /// A key's lock-delay record (`d/<digest>`).
    LockDelay(&'k str),
    /// A class's latest shadow decision (`w/<class>`, `lockmesh_lock::shadow`).
    Shadow(&'k str),
    Other,
}

fn place<'k>(root: &str, key: &'k [u8]) -> Place<'k> {
    let Ok(s) = std::str::from_utf8(key) else { return Place::Other };
    let Some(rest) = s.strip_prefix(root).and_then(|r| r.strip_prefix('/')) else { return Place::Other };
    let parts: Vec<&str> = rest.split('/').collect();
    match parts.as_slice() {
        ["l", d, "h", slot] => {
            lockmesh_keyspace::keys::Keys::parse_slot(slot).map_or(Place::Other, |slot| Place::Hold { digest: d, slot })
        }
        ["r", d] => Place::ReleaseMarker(d),
        ["x", sid] => Place::CloseMarker(sid),
        ["s", sid] => Place::Session(sid),
        ["f", d] => Place::Force(d),
        ["sys", "epoch"] => Place::Epoch,
        ["sys", "classmap"] => Place::ClassMap,
        ["c", class] => Place::Policy(class),
        ["u", _, _] => Place::Unprotected,
        ["d", d] => Place::LockDelay(d),
        ["w", class] => Place::Shadow(class),
        _ => Place::Other,
    }
}

fn json(v: &[u8]) -> Option<Value> {
    serde_json::from_slice(v).ok()
}

/// A record the arbiter wrote as one of the keyspace's types; `None` if it is not one.
fn record<T: DeserializeOwned>(v: &[u8]) -> Option<T> {
    serde_json::from_slice(v).ok()
}

/// `detail` of a session open: the lease TTL the session was opened with.
#[derive(Serialize)]
struct SessionOpenDetail {
    ttl_s: u64,
}

/// `detail` of an unprotected grant's event (ADR-04): the spool record's facts
/// that have no column, and where the record was shipped.
#[derive(Serialize)]
struct UnprotectedDetail {
    grant_id: String,
    outage: String,
    cluster: String,
    ttl_s: Option<u64>,
    reason: Option<String>,
    hold_id: Option<String>,
    shipped_revision: i64,
}

/// An event's `detail` object.
fn detail(d: &impl Serialize) -> Option<Value> {
    serde_json::to_value(d).ok()
}

fn session_hex(lease: i64) -> Option<String> {
    SessionId::from_lease(lease).map(|s| s.to_string())
}

/// Decodes the changes of revision `revision`.
pub fn decode(ctx: &Context<'_>, revision: i64, changes: &[Change]) -> Decoded {
    let mut out = Decoded::default();
    // Facts of this revision that explain a hold's delete.
    let mut released: HashSet<(&str, i64)> = HashSet::new();
    let mut forced: std::collections::HashMap<&str, Option<Value>> = std::collections::HashMap::new();
    let mut leases_gone: HashSet<i64> = HashSet::new();
    let mut epoch_written = false;
    for c in changes {
        match (place(ctx.root, &c.key), c.op) {
            (Place::ReleaseMarker(d), Op::Put) => {
                let rev = record::<ReleaseMarker>(&c.value).map_or(-1, |m| m.revision);
                released.insert((d, rev));
            }
            (Place::Force(d), Op::Put) => {
                forced.insert(d, json(&c.value));
            }
            (Place::Session(_), Op::Delete) => {
                if let Some(p) = &c.prev {
                    leases_gone.insert(p.lease);
                }
            }
            (Place::Epoch, Op::Put) => epoch_written = true,
            _ => {}
        }
    }
    let mut epoch = ctx.epoch;
    // The epoch record first: events of this revision are in the new epoch.
    for c in changes {
        if let (Place::Epoch, Op::Put) = (place(ctx.root, &c.key), c.op) {
            if let Some(e) = record::<EpochRecord>(&c.value).map(|r| r.epoch) {
                epoch = e;
                out.epoch = Some(e);
            }
        }
    }
    let closed_here: HashSet<&str> = changes
        .iter()
        .filter(|c| c.op == Op::Put)
        .filter_map(|c| match place(ctx.root, &c.key) {
            Place::CloseMarker(sid) => Some(sid),
            _ => None,
        })
        .collect();
    let is_closed = |sid: &str| closed_here.contains(sid) || (ctx.closed)(sid);
    let hold_deleted: HashSet<&str> = changes
        .iter()
        .filter(|c| c.op == Op::Delete)
        .filter_map(|c| match place(ctx.root, &c.key) {
            Place::Hold { digest, .. } => Some(digest),
            _ => None,
        })
        .collect();
    for c in changes {
        let etcd_key = String::from_utf8_lossy(&c.key).into_owned();
        let base = |kind: EventKind, epoch: u64, at_ms: u64| AuditEvent {
            cluster_id: ctx.cluster_id.to_owned(),
            timeline: ctx.timeline,
            epoch,
            revision,
            etcd_key: etcd_key.clone(),
            kind,
            digest: None,
            key: None,
            identity: None,
            instance: None,
            class: None,
            session: None,
            grant_revision: None,
            slot: None,
            at_ms,
            detail: None,
            unprotected: false,
        };
        let ev = match (place(ctx.root, &c.key), c.op) {
            (Place::Hold { digest, slot }, Op::Put) if c.create_revision == revision => {
                let h: Option<HoldRecord> = serde_json::from_slice(&c.value).ok();
                let mut e = base(EventKind::Grant, h.as_ref().map_or(epoch, |h| h.epoch), ctx.now_ms);
                fill_hold(&mut e, digest, slot, h.as_ref(), c.lease, revision);
                Some(e)
            }
            (Place::Hold { digest, slot }, Op::Delete) => {
                let (h, lease, grant_rev) = match &c.prev {
                    Some(p) => (serde_json::from_slice::<HoldRecord>(&p.value).ok(), p.lease, p.create_revision),
                    None => (None, 0, -1),
                };
                let sid = session_hex(lease);
                let (kind, detail) = if let Some(f) = forced.get(digest) {
                    (EventKind::ForceRelease, f.clone())
                } else if released.contains(&(digest, grant_rev)) {
                    (EventKind::Release, None)
                } else if epoch_written {
                    (EventKind::EpochPurge, None)
                } else if leases_gone.contains(&lease) {
                    if sid.as_deref().is_some_and(is_closed) {
                        (EventKind::SessionRelease, None)
                    } else {
                        (EventKind::Expiry, None)
                    }
                } else {
                    (EventKind::UnmarkedDelete, None)
                };
                let at_ms = match kind {
                    EventKind::Release => changes
                        .iter()
                        .find(|m| place(ctx.root, &m.key) == Place::ReleaseMarker(digest))
                        .and_then(|m| record::<ReleaseMarker>(&m.value))
                        .map(|m| m.released_ms)
                        .unwrap_or(ctx.now_ms),
                    _ => ctx.now_ms,
                };
                let mut e = base(kind, h.as_ref().map_or(epoch, |h| h.epoch), at_ms);
                e.detail = detail;
                fill_hold(&mut e, digest, slot, h.as_ref(), lease, grant_rev);
                Some(e)
            }
            (Place::Session(sid), Op::Put) if c.create_revision == revision => {
                let mut e = base(EventKind::SessionOpen, epoch, ctx.now_ms);
                e.session = Some(sid.to_owned());
                if let Some(r) = record::<SessionRecord>(&c.value) {
                    e.detail = detail(&SessionOpenDetail { ttl_s: r.ttl_s });
                    e.at_ms = r.created_ms;
                    e.identity = Some(r.owner);
                    e.instance = r.instance;
                    e.class = Some(r.class);
                }
                Some(e)
            }
            (Place::Session(sid), Op::Delete) if !is_closed(sid) => {
                let mut e = base(EventKind::SessionExpiry, epoch, ctx.now_ms);
                e.session = Some(sid.to_owned());
                if let Some(r) = c.prev.as_ref().and_then(|p| record::<SessionRecord>(&p.value)) {
                    e.identity = Some(r.owner);
                    e.instance = r.instance;
                    e.class = Some(r.class);
                }
                Some(e)
            }
            (Place::CloseMarker(sid), Op::Put) => {
                out.closed.push(sid.to_owned());
                let mut e = base(EventKind::SessionClose, epoch, ctx.now_ms);
                e.session = Some(sid.to_owned());
                e.at_ms = record::<CloseMarker>(&c.value).map_or(ctx.now_ms, |m| m.closed_ms);
                Some(e)
            }
            (Place::Force(d), Op::Put) if !hold_deleted.contains(d) => {
                let mut e = base(EventKind::ForceRecord, epoch, ctx.now_ms);
                e.digest = Some(d.to_owned());
                e.detail = json(&c.value);
                Some(e)
            }
            (Place::Policy(class), Op::Put) => {
                let mut e = base(EventKind::LimitChange, epoch, ctx.now_ms);
                e.class = Some(class.to_owned());
                e.detail = json(&c.value);
                if let Some(at) = e.detail.as_ref().and_then(|v| v["last"]["at_ms"].as_u64()) {
                    e.at_ms = at;
                }
                Some(e)
            }
            (Place::ClassMap, Op::Put) => {
                let mut e = base(EventKind::ClassMapChange, epoch, ctx.now_ms);
                e.detail = json(&c.value);
                Some(e)
            }
            (Place::Epoch, Op::Put) => {
                let mut e = base(EventKind::Epoch, epoch, ctx.now_ms);
                e.detail = json(&c.value);
                Some(e)
            }
            (Place::Unprotected, Op::Put) => unprotected(ctx, revision, etcd_key.clone(), &c.value),
            (Place::LockDelay(d), Op::Put) => {
                let rec = record::<lockmesh_keyspace::LockDelayRecord>(&c.value);
                let mut e = base(EventKind::LockDelay, epoch, rec.as_ref().map_or(ctx.now_ms, |r| r.seen_ms));
                e.digest = Some(d.to_owned());
                e.detail = json(&c.value);
                Some(e)
            }
            (Place::Shadow(class), Op::Put) => {
                let rec = record::<lockmesh_keyspace::ShadowRecord>(&c.value);
                let kind = match rec.as_ref().map(|r| r.decision) {
                    Some(lockmesh_keyspace::ShadowDecision::WouldGrant) => EventKind::WouldGrant,
                    _ => EventKind::WouldRefuse,
                };
                let mut e = base(kind, epoch, rec.as_ref().map_or(ctx.now_ms, |r| r.at_ms));
                e.class = Some(class.to_owned());
                e.digest = rec.and_then(|r| r.digest);
                e.detail = json(&c.value);
                Some(e)
            }
            _ => None,
        };
        out.events.extend(ev);
    }
    out
}

/// The audit event of a shipped unprotected-grant record (ADR-04). Its revision
/// is 0 (no etcd revision committed the grant; the ship revision is in
/// `detail.shipped_revision`) and its epoch the record's, so its event key is the
/// same however often the record is shipped: a re-ship after a crash between
/// shipping and cutting the spool overwrites the row instead of adding one.
fn unprotected(ctx: &Context<'_>, revision: i64, etcd_key: String, value: &[u8]) -> Option<AuditEvent> {
    let r: lockmesh_keyspace::spool::SpoolRecord = record(value)?;
    let kind = match r.op {
        lockmesh_keyspace::spool::SpoolOp::Grant => EventKind::Grant,
        lockmesh_keyspace::spool::SpoolOp::Release => EventKind::Release,
        lockmesh_keyspace::spool::SpoolOp::Expiry => EventKind::Expiry,
    };
    Some(AuditEvent {
        cluster_id: ctx.cluster_id.to_owned(),
        timeline: ctx.timeline,
        epoch: r.epoch,
        revision: 0,
        etcd_key,
        kind,
        digest: Some(r.digest),
        key: Some(r.key),
        identity: Some(r.identity),
        instance: r.instance,
        class: Some(r.class),
        session: None,
        grant_revision: None,
        slot: None,
        at_ms: r.at_ms,
        detail: detail(&UnprotectedDetail {
            grant_id: r.grant,
            outage: r.outage,
            cluster: r.cluster,
            ttl_s: r.ttl_s,
            reason: r.reason,
            hold_id: r.hold_id,
            shipped_revision: revision,
        }),
        unprotected: true,
    })
}

fn fill_hold(e: &mut AuditEvent, digest: &str, slot: u32, h: Option<&HoldRecord>, lease: i64, grant_rev: i64) {
    e.digest = Some(digest.to_owned());
    e.slot = Some(slot);
    e.session = session_hex(lease);
    e.grant_revision = (grant_rev > 0).then_some(grant_rev);
    if let Some(h) = h {
        e.key = Some(h.key.clone());
        e.identity = Some(h.owner.clone());
        e.instance = h.instance.clone();
        e.class = Some(h.class.clone());
        if e.kind == EventKind::Grant {
            e.at_ms = h.acquired_ms;
        }
        if let Some(claimed) = &h.unverified_caller {
            note_unverified_caller(e, claimed);
        }
    }
}

/// Adds a self client's claimed caller to a hold event's detail
/// (`detail.unverified_caller`, beside a force record's fields if there are any).
fn note_unverified_caller(e: &mut AuditEvent, claimed: &str) {
    let v = Value::String(claimed.to_owned());
    match &mut e.detail {
        Some(Value::Object(m)) => {
            m.insert(UNVERIFIED_CALLER.to_owned(), v);
        }
        Some(_) => {}
        None => e.detail = Some(Value::Object([(UNVERIFIED_CALLER.to_owned(), v)].into_iter().collect())),
    }
}

#[cfg(test)]
mod tests;
