//! The request/approve flow against etcd (see the module docs of
//! [`crate::admin`] for the key layout).

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use lockmesh_core::{class::Enforcement, headers::SessionId, ClassRegistry, KeyDigest, LockKey};
use serde::{Deserialize, Serialize};

use super::{io, jwt::Operator, AdminError};
use crate::etcd_retry::Etcd;
use lockmesh_lock::{now_ms, HoldRecord, Keys};

/// Longest reason accepted.
pub(crate) const MAX_REASON: usize = 1024;

pub use lockmesh_core::wire::admin::{
    Action, AdminRequest, HoldView, LogEntry, Outcome, Preview, RequestState as State,
};

/// A hold as read for a force release: what the approver is shown, and what the
/// guarded delete needs (never shown).
#[derive(Debug, Clone)]
struct Hold {
    view: HoldView,
    lease: i64,
    mod_revision: i64,
    etcd_key: String,
}

/// The force record (`<root>/f/<digest>`), the audit event's detail.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ForceRecord {
    pub request_id: String,
    /// The requester's reason, trimmed (1..=1024 characters).
    pub reason: String,
    pub requester: Operator,
    pub approver: Operator,
    /// `fenced`, `advisory` or `unknown`, as shown before approval.
    pub enforcement: String,
    /// The holds deleted.
    pub holds: Vec<HoldView>,
    /// Whether the holders' sessions were to be revoked.
    pub revoke_session: bool,
    /// When, unix ms.
    pub at_ms: u64,
}

fn req_key(root: &str, id: &str) -> String {
    format!("{}/adm/req/{id}", root.trim_end_matches('/'))
}

fn force_key(root: &str, digest: &str) -> String {
    format!("{}/f/{digest}", root.trim_end_matches('/'))
}

/// The digest of a raw lock key, validated as the arbiter would.
pub fn digest_of(key: &str) -> Result<KeyDigest, AdminError> {
    LockKey::parse(key.as_bytes()).map(|k| k.digest()).map_err(|e| AdminError::BadKey(e.to_string()))
}

fn check_reason(reason: &str) -> Result<String, AdminError> {
    let r = reason.trim();
    if r.is_empty() || r.chars().count() > MAX_REASON {
        return Err(AdminError::ReasonMissing);
    }
    Ok(r.to_owned())
}

/// Appends a log entry; best effort for refusals (the refusal is reported anyway).
pub async fn log(client: &mut Client, root: &str, entry: &LogEntry) -> Result<(), AdminError> {
    let key = format!("{}/adm/log/{:013}-{:08x}", root.trim_end_matches('/'), entry.at_ms, rand::random::<u32>());
    Etcd::of(client).put(key, serde_json::to_vec(entry).map_err(io)?, None).await.map_err(io)?;
    Ok(())
}

/// Records a refusal of `step` (best effort: etcd may be what failed).
pub async fn log_refusal(
    client: &mut Client,
    root: &str,
    step: &str,
    request_id: Option<&str>,
    operator: Option<&Operator>,
    err: &AdminError,
) {
    let entry = LogEntry {
        step: step.into(),
        request_id: request_id.map(str::to_owned),
        operator: operator.cloned(),
        outcome: err.code().into(),
        detail: err.to_string(),
        at_ms: now_ms(),
    };
    if let Err(e) = log(client, root, &entry).await {
        tracing::warn!(error = %e, code = err.code(), "could not record an admin refusal");
    }
}

/// Every log entry, oldest first.
pub async fn read_log(client: &mut Client, root: &str) -> Result<Vec<LogEntry>, AdminError> {
    let p = format!("{}/adm/log/", root.trim_end_matches('/'));
    let r = Etcd::of(client).get(p, Some(GetOptions::new().with_prefix())).await.map_err(io)?;
    Ok(r.kvs().iter().filter_map(|kv| serde_json::from_slice(kv.value()).ok()).collect())
}

/// Writes a pending request. Nothing else changes.
pub async fn request(
    client: &mut Client,
    root: &str,
    action: Action,
    reason: &str,
    requester: &Operator,
    ttl_s: u64,
) -> Result<AdminRequest, AdminError> {
    let reason = check_reason(reason)?;
    let now = now_ms();
    let req = AdminRequest {
        id: format!("{:016x}", rand::random::<u64>()),
        action,
        reason,
        requester: requester.clone(),
        requested_ms: now,
        expires_ms: now.saturating_add(ttl_s.saturating_mul(1000)),
        state: State::Pending,
        approver: None,
        approved_ms: None,
    };
    let key = req_key(root, &req.id);
    let txn = Txn::new().when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)]).and_then([TxnOp::put(
        key.as_str(),
        serde_json::to_vec(&req).map_err(io)?,
        None::<PutOptions>,
    )]);
    if !Etcd::of(client).txn(txn).await.map_err(io)?.succeeded() {
        return Err(io("request id collision; retry"));
    }
    let entry = LogEntry {
        step: "request".into(),
        request_id: Some(req.id.clone()),
        operator: Some(requester.clone()),
        outcome: "ok".into(),
        detail: serde_json::to_string(&req.action).map_err(io)?,
        at_ms: now,
    };
    log(client, root, &entry).await?;
    Ok(req)
}

async fn read_request(client: &mut Client, root: &str, id: &str) -> Result<(AdminRequest, i64), AdminError> {
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(AdminError::NotFound(id.to_owned()));
    }
    let r = Etcd::of(client).get(req_key(root, id), None).await.map_err(io)?;
    let kv = r.kvs().first().ok_or_else(|| AdminError::NotFound(id.to_owned()))?;
    let req = serde_json::from_slice(kv.value()).map_err(|e| io(format!("request {id}: unreadable record: {e}")))?;
    Ok((req, kv.mod_revision()))
}

async fn holds_of(client: &Etcd, root: &str, digest: &str) -> Result<Vec<Hold>, AdminError> {
    let d = KeyDigest::parse(digest).ok_or_else(|| AdminError::BadKey(format!("{digest:?} is not a digest")))?;
    let keys = Keys::new(root);
    let r = client.get(keys.holds(&d), Some(GetOptions::new().with_prefix())).await.map_err(io)?;
    let now = now_ms();
    Ok(r.kvs()
        .iter()
        .map(|kv| {
            let h: Option<HoldRecord> = serde_json::from_slice(kv.value()).ok();
            let etcd_key = String::from_utf8_lossy(kv.key()).into_owned();
            let view = HoldView {
                slot: etcd_key.rsplit('/').next().and_then(|s| s.parse().ok()).unwrap_or(0),
                owner: h.as_ref().map_or_else(|| "?".into(), |h| h.owner.clone()),
                instance: h.as_ref().and_then(|h| h.instance.clone()),
                class: h.as_ref().map_or_else(|| "?".into(), |h| h.class.clone()),
                session: SessionId::from_lease(kv.lease()).map(|s| s.to_string()),
                grant_revision: kv.create_revision(),
                age_ms: h.as_ref().map_or(0, |h| now.saturating_sub(h.acquired_ms)),
            };
            Hold { view, lease: kv.lease(), mod_revision: kv.mod_revision(), etcd_key }
        })
        .collect())
}

/// The posture of the holds' class(es) by the registry, with what it means.
fn enforcement(holds: &[HoldView], registry: Option<&ClassRegistry>) -> (String, Option<String>) {
    let mut classes: Vec<&str> = holds.iter().map(|h| h.class.as_str()).collect();
    classes.dedup();
    let e = match (registry, classes.as_slice()) {
        (Some(reg), [c]) => match reg.get(c).map(|s| &s.enforcement) {
            Some(Enforcement::Fenced) => "fenced",
            Some(Enforcement::Advisory { .. }) => "advisory",
            None => "unknown",
        },
        _ => "unknown",
    };
    let w = match e {
        "fenced" => None,
        "advisory" => Some(
            "class is ADVISORY (unfenced): a holder that is still running may keep writing after this release, \
             so two writers can overlap; stop the holder first if you can"
                .to_owned(),
        ),
        _ => Some("class posture unknown (pass --registry): assume unfenced".to_owned()),
    };
    (e.to_owned(), w)
}

/// Where a force release's holds are on a split deployment: another cluster than
/// the coord cluster, whose client `client` is (docs/SCALE.md). The requests, the
/// action log and the approval stay on the coord cluster; the holds, the force
/// record and the session revocations are on this one.
#[derive(Clone)]
pub struct HoldsAt {
    /// The cluster's name.
    pub cluster: String,
    /// A client of it.
    pub client: Client,
}

/// The digest a request force-releases, if it is a force release.
pub async fn request_digest(client: &mut Client, root: &str, id: &str) -> Result<Option<String>, AdminError> {
    let (request, _) = read_request(client, root, id).await?;
    Ok(match request.action {
        Action::ForceRelease { digest, .. } => Some(digest),
        Action::EpochAdvance { .. } => None,
    })
}

/// How many holds of `digest` a cluster has (one count-only read).
pub async fn hold_count(client: &mut Client, root: &str, digest: &str) -> Result<i64, AdminError> {
    let prefix = format!("{}/l/{digest}/h/", root.trim_end_matches('/'));
    let r = Etcd::of(client).get(prefix, Some(GetOptions::new().with_prefix().with_count_only())).await.map_err(io)?;
    Ok(r.count())
}

/// What an approver is shown before approving; `holds_at` names the cluster of
/// the key's holds when it is not `client`'s.
pub async fn preview(
    client: &mut Client,
    holds_at: Option<HoldsAt>,
    root: &str,
    id: &str,
    registry: Option<&ClassRegistry>,
) -> Result<Preview, AdminError> {
    let (request, _) = read_request(client, root, id).await?;
    let cluster = holds_at.as_ref().map(|h| h.cluster.clone());
    let hc = Etcd::new(holds_at.map_or_else(|| client.clone(), |h| h.client));
    let (holds, (enforcement, warning)) = match &request.action {
        Action::ForceRelease { digest, .. } => {
            let holds: Vec<HoldView> = holds_of(&hc, root, digest).await?.into_iter().map(|h| h.view).collect();
            let e = enforcement(&holds, registry);
            (holds, e)
        }
        Action::EpochAdvance { .. } => (
            vec![],
            ("n/a".into(), Some("every hold and waiter under the root is deleted and every session revoked".into())),
        ),
    };
    Ok(Preview { cluster, request, holds, enforcement, warning })
}

/// Approves and executes request `id` as `approver`. With `shown`, the grant
/// revisions of the holds the approver was shown (a force release): approval is
/// refused with [`AdminError::HoldsChanged`] unless the key's holds are exactly
/// those, so it releases what was shown and nothing else.
///
/// A force release's record (`<root>/f/<digest>`) rides on a lease of
/// `record_retention_s`: etcd deletes it when that lease expires. The audit
/// tailer archived it when it was written (its `force_release` event carries the
/// whole record), so nothing is lost when it goes.
///
/// With `holds_at` (a key homed on another cluster than `client`'s), the release
/// and the request's update are two transactions: first the holds are deleted
/// with the force record on their cluster (compared as shown), then the request
/// is marked executed on the coord cluster. A crash between leaves the request
/// pending with the holds released and the record written; approving it again
/// finds no hold and voids it.
#[allow(clippy::too_many_arguments)]
pub async fn approve(
    client: &mut Client,
    holds_at: Option<HoldsAt>,
    root: &str,
    id: &str,
    approver: &Operator,
    registry: Option<&ClassRegistry>,
    shown: Option<&[i64]>,
    record_retention_s: u64,
) -> Result<Outcome, AdminError> {
    let cluster = holds_at.as_ref().map(|h| h.cluster.clone());
    let split = holds_at.is_some();
    let hc = Etcd::new(holds_at.map_or_else(|| client.clone(), |h| h.client));
    for _ in 0..5 {
        let (req, req_rev) = read_request(client, root, id).await?;
        if req.state != State::Pending {
            let state = serde_json::to_value(req.state).map_err(io)?.as_str().unwrap_or("done").to_owned();
            return Err(AdminError::NotPending { id: id.into(), state });
        }
        if req.requester == *approver {
            return Err(AdminError::SameOperator { id: id.into(), sub: approver.sub.clone() });
        }
        let now = now_ms();
        if now > req.expires_ms {
            return Err(AdminError::RequestExpired(id.into()));
        }
        let mut done = req.clone();
        done.state = State::Executed;
        done.approver = Some(approver.clone());
        done.approved_ms = Some(now);
        let guard = Compare::mod_revision(req_key(root, id), CompareOp::Equal, req_rev);
        match &req.action {
            Action::ForceRelease { digest, revoke_session } => {
                let read = holds_of(&hc, root, digest).await?;
                let holds: Vec<HoldView> = read.iter().map(|h| h.view.clone()).collect();
                if let Some(shown) = shown {
                    let mut now_revs: Vec<i64> = holds.iter().map(|h| h.grant_revision).collect();
                    let mut shown = shown.to_vec();
                    now_revs.sort_unstable();
                    shown.sort_unstable();
                    if now_revs != shown {
                        return Err(AdminError::HoldsChanged(format!(
                            "shown grant revisions {shown:?}, now {now_revs:?}"
                        )));
                    }
                }
                if holds.is_empty() {
                    done.state = State::Void;
                    let put = TxnOp::put(req_key(root, id), serde_json::to_vec(&done).map_err(io)?, None);
                    if Etcd::of(client).txn(Txn::new().when([guard]).and_then([put])).await.map_err(io)?.succeeded() {
                        return Err(AdminError::NoHold(digest.clone()));
                    }
                    continue;
                }
                let (enforcement, _) = enforcement(&holds, registry);
                let record = ForceRecord {
                    request_id: id.into(),
                    reason: req.reason.clone(),
                    requester: req.requester.clone(),
                    approver: approver.clone(),
                    enforcement,
                    holds: holds.clone(),
                    revoke_session: *revoke_session,
                    at_ms: now,
                };
                let ttl = i64::try_from(record_retention_s).unwrap_or(i64::MAX);
                // The record goes beside the deletes, on the holds' cluster (its
                // audit tailer reads it from that cluster's history).
                let retention = hc.lease_grant(ttl, None).await.map_err(io)?.id();
                let done_put = TxnOp::put(req_key(root, id), serde_json::to_vec(&done).map_err(io)?, None);
                // One cluster: the request's guard and update in the same transaction.
                let mut when = if split { vec![] } else { vec![guard.clone()] };
                let mut ops = vec![TxnOp::put(
                    force_key(root, digest),
                    serde_json::to_vec(&record).map_err(io)?,
                    Some(PutOptions::new().with_lease(retention)),
                )];
                if !split {
                    ops.push(done_put.clone());
                }
                for h in &read {
                    when.push(Compare::mod_revision(h.etcd_key.as_str(), CompareOp::Equal, h.mod_revision));
                    ops.push(TxnOp::delete(h.etcd_key.as_str(), None));
                }
                // An exclusive hold's exclusion record goes with its slots: left, it
                // would keep every shared grant of the key out until its lease ends.
                ops.push(TxnOp::delete(format!("{}/l/{digest}/w", root.trim_end_matches('/')), None));
                if split {
                    // Still pending just before the release (the update below is
                    // the second transaction, on the coord cluster).
                    let (now_req, _) = read_request(client, root, id).await?;
                    if now_req.state != State::Pending {
                        let _ = hc.lease_revoke(retention).await;
                        continue;
                    }
                }
                let r = hc.txn(Txn::new().when(when).and_then(ops)).await;
                if !r.as_ref().is_ok_and(|r| r.succeeded()) {
                    // Nothing rides on the retention lease: revoke it (best effort;
                    // unrevoked, it expires with no key).
                    let _ = hc.lease_revoke(retention).await;
                }
                let r = r.map_err(io)?;
                if !r.succeeded() {
                    continue; // the request or a hold changed: re-read and re-check
                }
                let revision = r.header().map_or(0, |h| h.revision());
                if split {
                    let r = Etcd::of(client).txn(Txn::new().when([guard]).and_then([done_put])).await.map_err(io)?;
                    if !r.succeeded() {
                        return Err(io(format!(
                            "released on cluster {} at revision {revision}, but the request changed before it was \
                             marked executed; show it",
                            cluster.as_deref().unwrap_or("?")
                        )));
                    }
                }
                let mut revoked = 0;
                if *revoke_session {
                    let mut leases: Vec<i64> = read.iter().map(|h| h.lease).filter(|l| *l != 0).collect();
                    leases.sort_unstable();
                    leases.dedup();
                    for l in leases {
                        match hc.lease_revoke(l).await {
                            Ok(_) => revoked += 1,
                            Err(e) if e.to_string().contains("lease not found") => {}
                            Err(e) => return Err(io(format!("released, but revoking a session failed: {e}"))),
                        }
                    }
                }
                let entry = LogEntry {
                    step: "approve".into(),
                    request_id: Some(id.into()),
                    operator: Some(approver.clone()),
                    outcome: "ok".into(),
                    detail: format!(
                        "force release of {digest}: {} holds deleted at revision {revision}{}, {revoked} sessions revoked",
                        holds.len(),
                        cluster.as_deref().map(|c| format!(" of cluster {c}")).unwrap_or_default()
                    ),
                    at_ms: now,
                };
                log(client, root, &entry).await?;
                return Ok(Outcome {
                    cluster,
                    request: done,
                    released: holds,
                    sessions_revoked: revoked,
                    revision,
                    advance_log: vec![],
                });
            }
            Action::EpochAdvance { expected_epoch, new_epoch } => {
                let put = TxnOp::put(req_key(root, id), serde_json::to_vec(&done).map_err(io)?, None);
                let r = Etcd::of(client).txn(Txn::new().when([guard]).and_then([put])).await.map_err(io)?;
                if !r.succeeded() {
                    continue;
                }
                let revision = r.header().map_or(0, |h| h.revision());
                let mut out = Vec::new();
                let target = crate::restore::Target::Given(*new_epoch);
                let res = crate::restore::advance(client, root, *expected_epoch, target, &mut out).await;
                let advance_log: Vec<String> = String::from_utf8_lossy(&out).lines().map(str::to_owned).collect();
                let entry = LogEntry {
                    step: "approve".into(),
                    request_id: Some(id.into()),
                    operator: Some(approver.clone()),
                    outcome: if res.is_ok() { "ok".into() } else { "admin.advance_failed".into() },
                    detail: match &res {
                        Ok(()) => format!("epoch advance {expected_epoch} -> {new_epoch}: {}", advance_log.join("; ")),
                        Err(e) => format!("epoch advance {expected_epoch} -> {new_epoch}: {e}"),
                    },
                    at_ms: now_ms(),
                };
                log(client, root, &entry).await?;
                res.map_err(|e| AdminError::Advance(e.to_string()))?;
                return Ok(Outcome {
                    cluster: None,
                    request: done,
                    released: vec![],
                    sessions_revoked: 0,
                    revision,
                    advance_log,
                });
            }
        }
    }
    Err(io("the request or its holds kept changing under the approval; re-run"))
}

/// Every request, oldest first.
pub async fn list(client: &mut Client, root: &str) -> Result<Vec<AdminRequest>, AdminError> {
    let p = format!("{}/adm/req/", root.trim_end_matches('/'));
    let r = Etcd::of(client).get(p, Some(GetOptions::new().with_prefix())).await.map_err(io)?;
    let mut v: Vec<AdminRequest> = r.kvs().iter().filter_map(|kv| serde_json::from_slice(kv.value()).ok()).collect();
    v.sort_by_key(|r| r.requested_ms);
    Ok(v)
}
