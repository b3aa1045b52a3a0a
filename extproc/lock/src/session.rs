//! Sessions (ADR-10): one etcd lease each, owned by the identity (and declared
//! instance) that opened it. Holds attach to the lease, so closing or expiring the
//! session releases all of them in one committed entry. The arbiter never renews a
//! session on a holder's behalf.

use std::sync::Arc;

use etcd_client::{Compare, CompareOp, GetOptions, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use lockmesh_core::{headers::SessionId, ClassSpec, FencingToken};

use super::{now_ms, HoldRecord, LockError, SessionRecord, Store};

pub(crate) mod cache;

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// Verified SPIFFE ID.
    pub identity: String,
    /// Declared instance (`x-lock-instance`).
    pub instance: Option<String>,
}

/// A hold as its own session sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnHold {
    /// The raw key.
    pub key: String,
    /// The grant's token.
    pub token: FencingToken,
    /// Class at grant time.
    pub class: String,
    /// Grant time, unix ms.
    pub acquired_ms: u64,
    /// The cluster holding it (its epoch is that cluster's, `docs/SCALE.md`).
    pub cluster: String,
}

// === impl Store ===

impl Store {
    /// Grants a lease for a new session. The record is written by the caller (in
    /// the first grant transaction, or by [`Store::open_session`]).
    pub(crate) async fn grant_lease(&self, ttl_s: u64) -> Result<SessionId, LockError> {
        let ttl = i64::try_from(ttl_s).map_err(|_| LockError::Internal("ttl out of range".into()))?;
        let r = self.cluster.call(self.cluster.client().lease_grant(ttl, None)).await?;
        SessionId::from_lease(r.id()).ok_or_else(|| LockError::Internal("etcd granted lease id 0".into()))
    }

    /// The session record for a new session of `class`.
    pub(crate) fn new_record(caller: &Caller, class: &ClassSpec, ns: &str) -> SessionRecord {
        SessionRecord {
            owner: caller.identity.clone(),
            instance: caller.instance.clone(),
            class: class.name.to_string(),
            ttl_s: class.ttl_s,
            created_ms: now_ms(),
            ns: Some(ns.to_owned()),
            by_acquire: false,
        }
    }

    /// Opens a session for `class` (`POST /v1/sessions`).
    /// It counts against the quota namespace `ns` (`quota`) and is refused
    /// `QuotaExceeded` there, before anything is opened.
    ///
    /// A sealed cluster opens none (`Sealed`): its guarded epoch advance revokes
    /// every session on it, so a session opened there would be ended, with its
    /// holds on other clusters, behind its holder's back.
    pub async fn open_session(&self, caller: &Caller, class: &ClassSpec, ns: &str) -> Result<SessionId, LockError> {
        if !super::test_faults::on(super::test_faults::TestFault::SessionsIgnoreSeal) {
            self.serving().await?;
        }
        self.runtime().quotas().admit_session(self, ns)?;
        let sid = self.grant_lease(super::test_faults::lease_ttl(class.name.as_str(), class.ttl_s)).await?;
        let rec = Self::new_record(caller, class, ns);
        let value = serde_json::to_vec(&rec).map_err(|e| LockError::Internal(e.to_string()))?;
        let opts = Some(PutOptions::new().with_lease(sid.lease()));
        let key = self.cluster.keys().session(sid);
        match self.cluster.call(self.cluster.client().put(key.as_str(), value, opts)).await {
            Ok(r) => {
                let revision = r.header().map_or(0, |h| h.revision());
                self.ledger().note_session(key.as_bytes(), revision, ns);
            }
            Err(e) => {
                self.revoke_quietly(sid).await;
                return Err(e);
            }
        }
        self.sessions.insert(sid, Arc::new(rec));
        Ok(sid)
    }

    /// The record of a session the caller owns; `SessionExpired` for an unknown,
    /// expired or foreign session (the three are indistinguishable on purpose).
    ///
    /// The record may come from this arbiter's cache ([`cache`]): it says who owns
    /// the session and its TTL, which never change, but not that the session is
    /// still alive. Whatever the caller does next asks etcd about the lease (the
    /// grant compares it, keepalive renews it, close revokes it).
    pub(crate) async fn owned_session(&self, sid: SessionId, caller: &Caller) -> Result<Arc<SessionRecord>, LockError> {
        let cached = self.sessions.get(&sid);
        let rec = match cached {
            Some(r) => r,
            None => {
                let r = self.cluster.call(self.cluster.client().get(self.cluster.keys().session(sid), None)).await?;
                let kv = r.kvs().first().ok_or(LockError::SessionExpired)?;
                if kv.lease() != sid.lease() {
                    return Err(LockError::SessionExpired);
                }
                let rec: SessionRecord = serde_json::from_slice(kv.value())
                    .map_err(|e| LockError::Internal(format!("session record is not valid: {e}")))?;
                let rec = Arc::new(rec);
                self.sessions.insert(sid, rec.clone());
                rec
            }
        };
        let instance_ok = rec.instance.is_none() || rec.instance == caller.instance;
        if rec.owner != caller.identity || !instance_ok {
            return Err(LockError::SessionExpired);
        }
        Ok(rec)
    }

    /// Renews a session once (`POST /v1/sessions/keepalive`); returns the TTL etcd
    /// reports. Renewal is leader-served; a lost quorum fails it (fail closed).
    pub async fn keepalive(&self, sid: SessionId, caller: &Caller) -> Result<u64, LockError> {
        let rec = self.owned_session(sid, caller).await?;
        // Shadow mode (`shadow`): a candidate TTL shorter than the enforced one
        // would have expired a session whose keepalive comes later than it.
        if let Some(class) = self.runtime().shadow().ttl_candidate(&rec.class) {
            let r = self.cluster.call(self.cluster.client().lease_time_to_live(sid.lease(), None)).await;
            if let Ok(t) = r.as_ref().map(|t| t.ttl()).map(|t| u64::try_from(t).unwrap_or(0)) {
                let ns = rec.ns.as_deref().unwrap_or("other");
                self.runtime().shadow().at_keepalive(self, &class, ns, rec.ttl_s, std::time::Duration::from_secs(t));
            }
        }
        // lease_keep_alive sends one renewal and reads its answer; a TTL of zero
        // (the lease is gone) comes back as "lease not found".
        match self.cluster.call(self.cluster.client().lease_keep_alive(sid.lease())).await {
            Ok(_) => Ok(rec.ttl_s),
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => {
                self.forget_session(sid).await;
                Err(LockError::SessionExpired)
            }
            Err(e) => Err(e),
        }
    }

    /// Closes a session, releasing every hold on it in one committed entry.
    pub async fn close_session(&self, sid: SessionId, caller: &Caller) -> Result<(), LockError> {
        self.owned_session(sid, caller).await?;
        match self.end_session(sid).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(LockError::SessionExpired),
            Err(e) => Err(e),
        }
    }

    /// Ends session `sid` on this cluster (its home, or a cluster it extends to,
    /// whose record is a copy on the same lease) as a close: the close marker, then
    /// the lease revoked. Answers whether the lease existed here. The caller has
    /// checked the owner (on the home).
    ///
    /// The marker lets an audit reader and the lock-delay watch tell this from an
    /// expiry, on every cluster that held the session's holds.
    pub(crate) async fn end_session(&self, sid: SessionId) -> Result<bool, LockError> {
        // One integer member: serialising it cannot fail.
        let marker = serde_json::to_string(&lockmesh_keyspace::CloseMarker { closed_ms: now_ms() }).unwrap_or_default();
        // Only while the session is alive (its record on its lease): a marker
        // written after an expiry would make that expiry read as a close, a
        // release, and let the key skip its lock-delay (`delay::end_cause`;
        // found by the long gate: a holder closing a session that had just
        // expired). And with the grant clock (`commit_end`): a restore that
        // loses this close brings the session and its holds back. Without a
        // marker the lease is still revoked: an audit reader sees an expiry.
        let marked = self
            .commit_end(None, "a session close", None, |b, lease| {
                b.compare(Compare::lease(self.cluster.keys().session(sid), CompareOp::Equal, sid.lease()));
                b.on_success(TxnOp::put(
                    self.cluster.keys().close_marker(sid),
                    marker.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                ));
            })
            .await;
        match marked {
            Err(e @ LockError::Sealed(_)) => return Err(e),
            Err(_) => self.drop_marker_lease().await,
            Ok(_) => {}
        }
        let r = self.cluster.call(self.cluster.client().lease_revoke(sid.lease())).await;
        self.forget_session(sid).await;
        match r {
            Ok(_) => Ok(true),
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Closes session `sid`, which an acquire opened, if its hold index is empty:
    /// one transaction compares the session alive and its index range
    /// ([`lockmesh_keyspace::Keys::hold_indexes`]) empty, deletes its record and
    /// puts its close marker; only then is the lease revoked. Every grant on the
    /// session compares the record, so none commits after the close, and a grant
    /// that committed before it put an index key, which fails the close. Answers
    /// whether it closed the session.
    ///
    /// Before `session_hold_index` is enabled (`upgrade`) no grant keeps the
    /// index, so nothing is closed here: the session lapses with its TTL.
    pub async fn close_if_spent(&self, sid: SessionId, caller: &Caller) -> Result<bool, LockError> {
        self.owned_session(sid, caller).await?;
        self.close_spent(sid).await
    }

    /// [`Store::close_if_spent`] without the owner check: the caller owns `sid` (a
    /// VM session the keepalive found retired, `vm`).
    pub(crate) async fn close_spent(&self, sid: SessionId) -> Result<bool, LockError> {
        use etcd_client::DeleteOptions;
        if !self.guard().enabled(super::upgrade::Capability::SessionHoldIndex) {
            return Ok(false);
        }
        let k = self.cluster.keys();
        let (sess, index) = (k.session(sid), k.hold_indexes(sid));
        // One integer member: serialising it cannot fail.
        let marker = serde_json::to_string(&lockmesh_keyspace::CloseMarker { closed_ms: now_ms() }).unwrap_or_default();
        let (answer, ()) = self
            .commit_end(None, "a session close", None, |b, lease| {
                b.compare(Compare::lease(sess.as_str(), CompareOp::Equal, sid.lease()));
                if !super::test_faults::on(super::test_faults::TestFault::SessionHoldsUnindexed) {
                    // PLANTED BUG (holder_safety scenario) when skipped.
                    b.compare(
                        Compare::create_revision(index.as_str(), CompareOp::Equal, 0)
                            .with_range(lockmesh_keyspace::keys::prefix_end(&index)),
                    );
                }
                b.on_success(TxnOp::delete(sess.as_str(), None::<DeleteOptions>));
                b.on_success(TxnOp::put(
                    k.close_marker(sid),
                    marker.as_str(),
                    Some(PutOptions::new().with_lease(lease)),
                ));
            })
            .await?;
        if !answer.succeeded() {
            return Ok(false);
        }
        self.forget_session(sid).await;
        if let Err(e) = self.cluster.call(self.cluster.client().lease_revoke(sid.lease())).await {
            // Nothing is attached that a grant can use: the record is gone.
            tracing::debug!(error = %e, "a closed session's lease could not be revoked; it expires with its ttl");
        }
        Ok(true)
    }

    /// Lists the holds attached to a session (for a client that lost an acquire's
    /// response).
    pub async fn session_holds(&self, sid: SessionId, caller: &Caller) -> Result<Vec<OwnHold>, LockError> {
        self.owned_session(sid, caller).await?;
        let ttl = self
            .cluster
            .call(
                self.cluster.client().lease_time_to_live(sid.lease(), Some(LeaseTimeToLiveOptions::new().with_keys())),
            )
            .await?;
        if ttl.ttl() <= 0 {
            self.forget_session(sid).await;
            return Err(LockError::SessionExpired);
        }
        let prefix = self.cluster.keys().all_locks();
        let hold_keys: Vec<Vec<u8>> = ttl.keys().iter().filter(|k| k.starts_with(prefix.as_bytes())).cloned().collect();
        if hold_keys.is_empty() {
            return Ok(Vec::new());
        }
        let gets: Vec<TxnOp> = hold_keys.iter().map(|k| TxnOp::get(k.clone(), None::<GetOptions>)).collect();
        let r = self.cluster.call(self.cluster.client().txn(Txn::new().and_then(gets))).await?;
        let mut out = Vec::new();
        for op in r.op_responses() {
            let TxnOpResponse::Get(g) = op else { continue };
            for kv in g.kvs() {
                if kv.lease() != sid.lease() {
                    continue;
                }
                let Ok(h) = serde_json::from_slice::<HoldRecord>(kv.value()) else {
                    continue;
                };
                let rev = u64::try_from(kv.create_revision()).unwrap_or(0);
                if let Ok(token) = FencingToken::mint(h.epoch, rev) {
                    out.push(OwnHold {
                        key: h.key,
                        token,
                        class: h.class,
                        acquired_ms: h.acquired_ms,
                        cluster: self.cluster_name().to_owned(),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Drops the cached record of `sid` (its lease is gone or was revoked).
    pub(crate) async fn forget_session(&self, sid: SessionId) {
        self.sessions.invalidate(&sid);
    }

    /// Revokes a lease, ignoring failures (used to drop a session this arbiter
    /// created for a request that did not get its lock).
    pub(crate) async fn revoke_quietly(&self, sid: SessionId) {
        if let Err(e) = self.cluster.call(self.cluster.client().lease_revoke(sid.lease())).await {
            tracing::warn!(error = %e, "could not revoke an unused session; it expires with its ttl");
        }
        self.forget_session(sid).await;
    }
}
