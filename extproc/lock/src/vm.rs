//! Transparent-mode sessions: the holds of request-scoped locks (`docs/TRANSPARENT.md`).
//!
//! A transparent request's hold is carried by a session of the **filter worker VM**
//! that passed it on, one per VM and class (so the session's TTL is the class TTL).
//! The session is owned by the Envoy (its SPIFFE ID, as the ext_proc client) and the
//! VM (its random id, as the session's instance); the hold itself records the
//! downstream caller's identity. The filter renews every session of its VM from its
//! tick ([`Store::vm_keepalive`]): a dead Envoy or a trapped VM stops renewing, and
//! its holds expire within the class TTL. When a request ends the filter releases its
//! hold by hold id ([`Store::vm_release`]); its keepalives also carry the hold ids
//! still open, so a hold whose release was lost is released by the next reconcile.
//!
//! ```text
//! <root>/v/<vm>/<class>  = session id     (on the session's lease)
//! <root>/s/<session>     = session record (owner: the Envoy, instance: the VM)
//! ```
//!
//! The index key is created in the same transaction as the session record, only if
//! absent, so two arbiters opening a VM's session for one class at once agree on one.
//!
//! **A class TTL change** (a registry reload) never touches a live session: a
//! session keeps the TTL it was opened with until it ends, and so do its holds.
//! The first request of the class after the change finds the index naming a
//! session of the old TTL and *retires* it: in one transaction (only if the index
//! still names it) the index moves to `<root>/v/<vm>/<class>/retired/<session>`, on
//! the same lease, and a session of the new TTL is opened under the index. The
//! keepalive lists every key under the VM's prefix, so a retired session is renewed
//! for as long as it carries holds, and closed once it carries none: one
//! transaction compares its hold index empty and deletes its record, which every
//! grant on it compares (`Store::close_spent`), so an arbiter that still caches it
//! cannot grant on it in the last second of its lease. This arbiter's cache is keyed by the TTL as well, so a reload here
//! opens or finds the new session at the next request instead of granting on one
//! whose TTL the class no longer has (`session_class_mismatch`).
//!
//! ```text
//! <root>/v/<vm>/<class>/retired/<session> = session id   (on that session's lease)
//! ```
//!
//! **Failures are per session.** One session the keepalive cannot renew (its etcd
//! call failed) is counted in [`VmStatus::failed`] and the others are still renewed;
//! `lockmesh_lock::tiers` does the same per cluster and counts each cluster's
//! failures in [`RENEWAL_FAILURES`].
//!
//! **Jeopardy** ([`JEOPARDY`]): a VM session whose last renewal by this arbiter
//! failed (its own call, or the listing of its VM's sessions on that cluster) and
//! whose lease has not run out since this arbiter last renewed it (its TTL from
//! the send time of that renewal) is in jeopardy: its holds may still be renewed in
//! time, or may lapse. An acknowledged renewal clears it; so does the end of that
//! TTL (the lease is gone by then).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use super::{
    mutex::hold_of,
    now_ms,
    session::{cache, Caller},
    LockError, SessionRecord, Store,
};
use etcd_client::{Compare, CompareOp, GetOptions, LeaseTimeToLiveOptions, PutOptions, Txn, TxnOp, TxnOpResponse};
use lockmesh_core::{headers::SessionId, ClassSpec, KeyDigest, LockKey};

/// Length of a VM id: 32 lowercase hex characters (128 random bits).
pub(crate) const VM_ID_LEN: usize = 32;
/// Most open hold ids a keepalive may list.
pub const MAX_OPEN_HOLDS: usize = 100_000;
/// A VM session's instance: this, then the VM id ([`Store::vm_owner`]).
pub(crate) const VM_INSTANCE_PREFIX: &str = "vm/";
/// What follows a class's index key in a retired session's key (then the session id).
const RETIRED: &str = "/retired/";

/// This arbiter's cache of VM sessions, by (VM, class): bounded, an entry idle for
/// three of its session's TTLs expires (`session::cache`). A cached session may have
/// ended: the grant on it compares its lease and answers `session_expired`, and the
/// caller forgets it ([`Store::forget_vm_session`]) and opens or finds another.
pub struct VmSessions {
    /// Keyed by (VM, class, class TTL): a class whose TTL changed misses here and
    /// gets the session of its new TTL.
    by_vm_class: moka::sync::Cache<(String, String, u64), VmSession>,
}

/// VM-session renewals that failed, by etcd cluster name (the names of this
/// arbiter's config: a bounded set), for `lockmesh_arbiter_vm_renewal_failures_total`.
pub static RENEWAL_FAILURES: RenewalFailures = RenewalFailures { by_cluster: Mutex::new(BTreeMap::new()) };

/// Counters of failed VM-session renewals per cluster (see [`RENEWAL_FAILURES`]).
#[derive(Debug)]
pub struct RenewalFailures {
    by_cluster: Mutex<BTreeMap<String, u64>>,
}

/// VM sessions in jeopardy by etcd cluster (the module doc), for
/// `lockmesh_arbiter_vm_sessions_in_jeopardy{etcd_cluster}`.
pub static JEOPARDY: VmJeopardy = VmJeopardy { by_cluster: Mutex::new(BTreeMap::new()) };

/// Most VM sessions remembered per cluster: past it (after dropping lapsed ones) a
/// new session is not tracked, and its jeopardy not counted.
const MAX_TRACKED: usize = 65_536;

/// The last renewal by this arbiter of each VM session it renews, by cluster (see
/// [`JEOPARDY`]). Entries are keyed by VM id and session (never a label) and
/// dropped once their TTL has run out.
#[derive(Debug)]
pub struct VmJeopardy {
    by_cluster: Mutex<BTreeMap<String, BTreeMap<(String, SessionId), Renewal>>>,
}

/// One VM session's renewals by this arbiter.
#[derive(Debug, Clone, Copy)]
struct Renewal {
    /// Send time of the last acknowledged renewal (or of the failed call, for a
    /// session first seen failing: its lease ends no later than that plus its TTL).
    ok_sent: Instant,
    ttl: Duration,
    /// The last renewal attempt failed.
    failing: bool,
}

/// A VM's session for one class, and its TTL (the class TTL when it was opened).
#[derive(Debug, Clone, Copy)]
struct VmSession {
    sid: SessionId,
    ttl_s: u64,
}

/// What a VM keepalive found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct VmStatus {
    /// Sessions renewed.
    pub sessions: usize,
    /// The shortest TTL among them, seconds: 0 without sessions, and 0 when a
    /// session or a cluster could not be renewed (the TTLs there are unknown, so
    /// the filter polls every second until every cluster answers again).
    pub min_ttl_s: u64,
    /// Holds released by the reconcile.
    pub reconciled: usize,
    /// Sessions whose renewal (or reconcile) failed this time; the others were
    /// still renewed.
    pub failed: usize,
}

/// A filter's reconcile: the hold numbers it still has open, and the next number it
/// will give out. Holds numbered below `next` and not open belong to ended requests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconcile {
    /// Open hold numbers.
    pub open: Vec<u64>,
    /// The VM's next hold number.
    pub next: u64,
}

/// Checks a VM id's form.
pub fn valid_vm_id(vm: &str) -> bool {
    vm.len() == VM_ID_LEN && vm.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The hold id recorded for hold number `n` of `vm`.
pub fn hold_id(vm: &str, n: u64) -> String {
    format!("{vm}/{n}")
}

fn hold_number(vm: &str, id: &str) -> Option<u64> {
    id.strip_prefix(vm)?.strip_prefix('/')?.parse().ok()
}

// === impl VmSessions ===

impl Default for VmSessions {
    fn default() -> Self {
        Self { by_vm_class: cache::new() }
    }
}

impl cache::SessionTtl for VmSession {
    fn ttl_s(&self) -> u64 {
        self.ttl_s
    }
}

// === impl RenewalFailures ===

impl RenewalFailures {
    /// Makes `cluster`'s series exist (at 0) before its first failure.
    pub fn declare(&self, cluster: &str) {
        self.lock().entry(cluster.to_owned()).or_insert(0);
    }

    /// Counts `n` failed renewals on `cluster`.
    pub fn add(&self, cluster: &str, n: u64) {
        *self.lock().entry(cluster.to_owned()).or_insert(0) += n;
    }

    /// Every cluster's count, by name.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        self.lock().iter().map(|(k, v)| (k.clone(), *v)).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.by_cluster.lock().unwrap_or_else(|p| p.into_inner())
    }
}

// === impl VmJeopardy ===

impl VmJeopardy {
    /// The session `sid` of `vm` on `cluster` (TTL `ttl_s`) was renewed by a call
    /// sent at `sent`.
    pub fn renewed(&self, cluster: &str, vm: &str, sid: SessionId, ttl_s: u64, sent: Instant) {
        let mut all = self.lock();
        let sessions = all.entry(cluster.to_owned()).or_default();
        let r = Renewal { ok_sent: sent, ttl: Duration::from_secs(ttl_s), failing: false };
        insert_bounded(sessions, (vm.to_owned(), sid), r, sent);
    }

    /// A renewal of `sid` sent at `sent` failed (seen at `now`). A session renewed
    /// by a call sent at or after `sent` is not failing (its reconcile failed after
    /// the lease was renewed). A session not seen before is tracked if its TTL is
    /// known.
    pub fn failed(&self, cluster: &str, vm: &str, sid: SessionId, ttl_s: Option<u64>, sent: Instant, now: Instant) {
        let mut all = self.lock();
        let sessions = all.entry(cluster.to_owned()).or_default();
        let key = (vm.to_owned(), sid);
        match sessions.get_mut(&key) {
            Some(r) if r.ok_sent >= sent => {}
            Some(r) => r.failing = true,
            None => {
                if let Some(ttl_s) = ttl_s {
                    let r = Renewal { ok_sent: sent, ttl: Duration::from_secs(ttl_s), failing: true };
                    insert_bounded(sessions, key, r, now);
                }
            }
        }
    }

    /// A keepalive of `vm` on `cluster` that started at `started` ended without
    /// renewing its sessions there (the listing failed, or the caller gave up and
    /// the call was dropped): every one this arbiter renewed there, and not since
    /// `started`, is failing.
    pub fn unreachable(&self, cluster: &str, vm: &str, started: Instant) {
        if let Some(sessions) = self.lock().get_mut(cluster) {
            for ((v, _), r) in sessions.iter_mut() {
                if v == vm && r.ok_sent < started {
                    r.failing = true;
                }
            }
        }
    }

    /// The sessions of `vm` on `cluster` are `live` now: every other one it had
    /// there has ended (or is a retired session left to lapse).
    pub fn listed(&self, cluster: &str, vm: &str, live: &[SessionId]) {
        if let Some(sessions) = self.lock().get_mut(cluster) {
            sessions.retain(|(v, sid), _| v != vm || live.contains(sid));
        }
    }

    /// VM sessions on `cluster` in jeopardy at `now`; drops those whose TTL has run
    /// out since their last renewal here.
    pub fn count(&self, cluster: &str, now: Instant) -> u64 {
        let mut all = self.lock();
        let Some(sessions) = all.get_mut(cluster) else { return 0 };
        sessions.retain(|_, r| now < r.ok_sent + r.ttl);
        sessions.values().filter(|r| r.failing).count() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, BTreeMap<(String, SessionId), Renewal>>> {
        self.by_cluster.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One VM keepalive on one cluster: unless [`Attempt::finished`] runs, its end
/// (an early return, or the future dropped because the filter's call timed out
/// first) marks the VM's sessions there failing.
struct Attempt<'a> {
    cluster: &'a str,
    vm: &'a str,
    started: Instant,
    finished: bool,
}

impl Attempt<'_> {
    /// Every session was renewed or found failing or ended, each recorded.
    fn finished(mut self) {
        self.finished = true;
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.finished {
            JEOPARDY.unreachable(self.cluster, self.vm, self.started);
        }
    }
}

/// Inserts unless `sessions` is full of sessions whose TTL has not run out at `now`.
fn insert_bounded(
    sessions: &mut BTreeMap<(String, SessionId), Renewal>,
    key: (String, SessionId),
    r: Renewal,
    now: Instant,
) {
    if sessions.len() >= MAX_TRACKED && !sessions.contains_key(&key) {
        sessions.retain(|_, r| now < r.ok_sent + r.ttl);
        if sessions.len() >= MAX_TRACKED {
            return;
        }
    }
    sessions.insert(key, r);
}

// === impl Store ===

impl Store {
    /// The caller that owns `vm`'s sessions: the Envoy's identity and the
    /// instance `vm/<id>`. No request of the lock API can present that instance
    /// (`x-lock-instance` allows no `/`, `lockmesh_core::headers::parse_instance`),
    /// so a workload holding the same SPIFFE ID as its sidecar (one service
    /// account for the pod) can neither renew, close nor release through a VM's
    /// session: a transparent hold ends with its request only.
    pub fn vm_owner(envoy: &str, vm: &str) -> Caller {
        Caller { identity: envoy.to_owned(), instance: Some(format!("{VM_INSTANCE_PREFIX}{vm}")) }
    }

    /// The session of `vm` (of the Envoy `envoy`) for `class` with the class's
    /// current TTL, opened on first use; one of another TTL is retired (module doc).
    pub async fn vm_session(&self, envoy: &str, vm: &str, class: &ClassSpec) -> Result<SessionId, LockError> {
        let cache_key = (vm.to_owned(), class.name.to_string(), class.ttl_s);
        if let Some(s) = self.vms.by_vm_class.get(&cache_key) {
            return Ok(s.sid);
        }
        let owner = Self::vm_owner(envoy, vm);
        let index = self.cluster.keys().vm_session(vm, class.name.as_str());
        for _ in 0..3 {
            // An existing session of this VM and class (opened by any arbiter).
            let r = self.cluster.call(self.cluster.client().get(index.as_str(), None)).await?;
            if let Some(kv) = r.kvs().first() {
                let sid = SessionId::from_lease(kv.lease()).ok_or(LockError::SessionExpired)?;
                let rec = match self.owned_session(sid, &owner).await {
                    Ok(rec) => rec,
                    // A session an earlier build opened under the bare VM id (or
                    // one that expired under its index): retired, a new one opened.
                    Err(LockError::SessionExpired) => {
                        self.retire_vm_session(vm, class.name.as_str(), sid, kv.mod_revision()).await?;
                        continue;
                    }
                    Err(e) => return Err(e),
                };
                if rec.ttl_s == class.ttl_s {
                    self.vms.by_vm_class.insert(cache_key, VmSession { sid, ttl_s: rec.ttl_s });
                    return Ok(sid);
                }
                // The class TTL changed: the old session keeps its TTL and its holds
                // (still renewed under its retired key); new holds get a new session.
                self.retire_vm_session(vm, class.name.as_str(), sid, kv.mod_revision()).await?;
                continue;
            }
            let sid = self.grant_lease(super::test_faults::lease_ttl(class.name.as_str(), class.ttl_s)).await?;
            let rec = SessionRecord {
                owner: owner.identity.clone(),
                instance: owner.instance.clone(),
                class: class.name.to_string(),
                ttl_s: class.ttl_s,
                created_ms: now_ms(),
                // Counted against the class's one namespace, else `*` (`quota`).
                ns: None,
                by_acquire: false,
            };
            let v = serde_json::to_vec(&rec).map_err(|e| LockError::Internal(e.to_string()))?;
            let lease = Some(PutOptions::new().with_lease(sid.lease()));
            let txn = Txn::new().when([Compare::create_revision(index.as_str(), CompareOp::Equal, 0)]).and_then([
                TxnOp::put(self.cluster.keys().session(sid), v, lease.clone()),
                TxnOp::put(index.as_str(), sid.to_string(), lease),
            ]);
            match self.cluster.call(self.cluster.client().txn(txn)).await {
                Ok(r) if r.succeeded() => {
                    self.vms.by_vm_class.insert(cache_key, VmSession { sid, ttl_s: rec.ttl_s });
                    self.sessions.insert(sid, Arc::new(rec));
                    return Ok(sid);
                }
                // Another arbiter opened it first: use theirs.
                Ok(_) => self.revoke_quietly(sid).await,
                Err(e) => {
                    self.revoke_quietly(sid).await;
                    return Err(e);
                }
            }
        }
        Err(LockError::Unavailable("the VM session keeps changing".into()))
    }

    /// The retired index key of VM session `sid` of `class`.
    fn retired_vm_session(&self, vm: &str, class: &str, sid: SessionId) -> String {
        format!("{}{RETIRED}{sid}", self.cluster.keys().vm_session(vm, class))
    }

    /// Moves the index of `vm`'s session `sid` of `class` (last modified at
    /// `mod_revision`) to its retired key on the same lease, so the keepalive keeps
    /// finding it; nothing when the index changed meanwhile (another arbiter
    /// retired it or opened the next one: the caller reads it again).
    async fn retire_vm_session(
        &self,
        vm: &str,
        class: &str,
        sid: SessionId,
        mod_revision: i64,
    ) -> Result<(), LockError> {
        let index = self.cluster.keys().vm_session(vm, class);
        let lease = Some(PutOptions::new().with_lease(sid.lease()));
        let txn = Txn::new().when([Compare::mod_revision(index.as_str(), CompareOp::Equal, mod_revision)]).and_then([
            TxnOp::put(self.retired_vm_session(vm, class, sid), sid.to_string(), lease),
            TxnOp::delete(index.as_str(), None),
        ]);
        match self.cluster.call(self.cluster.client().txn(txn)).await {
            Ok(r) => {
                if r.succeeded() {
                    tracing::info!(
                        class,
                        "a class TTL changed: a VM session of the old TTL is retired; its holds keep it"
                    );
                }
                Ok(())
            }
            // The lease is gone: the index went with it.
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Forgets a cached VM session of `class` with TTL `ttl_s` (it expired, or its
    /// TTL is not the class's any more).
    pub async fn forget_vm_session(&self, vm: &str, class: &str, ttl_s: u64) {
        self.vms.by_vm_class.invalidate(&(vm.to_owned(), class.to_owned(), ttl_s));
    }

    /// Releases the hold `hold_id` of the key with digest `d` on session `sid`, if it
    /// still exists; returns whether one was released.
    pub(crate) async fn release_hold(&self, d: &KeyDigest, sid: SessionId, hold_id: &str) -> Result<bool, LockError> {
        let r = self
            .cluster
            .call(self.cluster.client().get(self.cluster.keys().holds(d), Some(GetOptions::new().with_prefix())))
            .await?;
        // Every slot of the hold (several for `x-lock-permits` or an exclusive hold).
        let slots: Vec<&etcd_client::KeyValue> = r
            .kvs()
            .iter()
            .filter(|kv| kv.lease() == sid.lease() && hold_of(kv).and_then(|h| h.hold_id).as_deref() == Some(hold_id))
            .collect();
        let Some(kv) = slots.first().copied() else {
            return Ok(false);
        };
        let marker = lockmesh_keyspace::ReleaseMarker {
            epoch: None,
            released_ms: now_ms(),
            revision: kv.create_revision(),
            transparent: true,
        };
        let marker = serde_json::to_string(&marker).map_err(|e| LockError::Internal(e.to_string()))?;
        if slots.len() > 1 {
            return self.release_slots(d, &slots, kv.create_revision(), &marker).await;
        }
        let cmp = vec![
            Compare::create_revision(kv.key(), CompareOp::Equal, kv.create_revision()),
            Compare::lease(kv.key(), CompareOp::Equal, sid.lease()),
        ];
        self.release_txn(d, kv.key().to_vec(), cmp, &marker, (kv.create_revision(), sid.lease())).await
    }

    /// Releases hold number `n` of `vm` on `key` (the filter's request ended).
    pub async fn vm_release(&self, envoy: &str, vm: &str, key: &LockKey, n: u64) -> Result<bool, LockError> {
        let owner = Self::vm_owner(envoy, vm);
        let d = key.digest();
        let id = hold_id(vm, n);
        let r = self
            .cluster
            .call(self.cluster.client().get(self.cluster.keys().holds(&d), Some(GetOptions::new().with_prefix())))
            .await?;
        let Some(kv) = r.kvs().iter().find(|kv| hold_of(kv).and_then(|h| h.hold_id).as_deref() == Some(id.as_str()))
        else {
            return Ok(false);
        };
        // Only the VM's own Envoy may release it.
        let sid = SessionId::from_lease(kv.lease()).ok_or(LockError::NotHolder)?;
        self.owned_session(sid, &owner).await.map_err(|_| LockError::NotHolder)?;
        self.release_hold(&d, sid, &id).await
    }

    /// Renews every session of `vm`, and with `reconcile` releases its holds whose
    /// requests have ended. A session that cannot be renewed is counted in
    /// [`VmStatus::failed`] and the others are still renewed; only a failed listing
    /// of the VM's sessions is an error. A retired session (a class TTL change, see
    /// the module doc) is renewed only while it carries holds.
    pub async fn vm_keepalive(
        &self,
        envoy: &str,
        vm: &str,
        reconcile: Option<&Reconcile>,
    ) -> Result<VmStatus, LockError> {
        let owner = Self::vm_owner(envoy, vm);
        let prefix = self.cluster.keys().vm_sessions(vm);
        let cluster = self.cluster_name();
        let attempt = Attempt { cluster, vm, started: Instant::now(), finished: false };
        // A sealed cluster renews nothing (`Store::renewable`): the VM's sessions
        // there are in jeopardy (the unfinished attempt says so) and lapse.
        self.renewable()?;
        let r = self
            .cluster
            .call(self.cluster.client().get(prefix.as_str(), Some(GetOptions::new().with_prefix())))
            .await?;
        let mut status = VmStatus::default();
        let mut live = Vec::new();
        for kv in r.kvs() {
            let Some(sid) = SessionId::from_lease(kv.lease()) else { continue };
            let sent = Instant::now();
            let rec = match self.owned_session(sid, &owner).await {
                Ok(rec) => rec,
                Err(LockError::SessionExpired) => continue,
                Err(e) => {
                    status.failed += 1;
                    live.push(sid);
                    JEOPARDY.failed(cluster, vm, sid, None, sent, Instant::now());
                    tracing::warn!(error = %e, "could not read a VM session's record; renewing the others");
                    continue;
                }
            };
            let retired = kv.key() != self.cluster.keys().vm_session(vm, &rec.class).as_bytes();
            match self.renew_vm_session(sid, vm, retired, reconcile, rec.ttl_s).await {
                Ok(Some(reconciled)) => {
                    live.push(sid);
                    status.sessions += 1;
                    status.reconciled += reconciled;
                    status.min_ttl_s = if status.min_ttl_s == 0 { rec.ttl_s } else { status.min_ttl_s.min(rec.ttl_s) };
                }
                Ok(None) => {}
                Err(LockError::SessionExpired) => {
                    self.forget_session(sid).await;
                    self.forget_vm_session(vm, &rec.class, rec.ttl_s).await;
                }
                Err(e) => {
                    status.failed += 1;
                    live.push(sid);
                    JEOPARDY.failed(cluster, vm, sid, Some(rec.ttl_s), sent, Instant::now());
                    tracing::warn!(error = %e, "could not renew a VM session; renewing the others");
                }
            }
        }
        JEOPARDY.listed(cluster, vm, &live);
        attempt.finished();
        if status.failed > 0 {
            status.min_ttl_s = 0;
        }
        Ok(status)
    }

    /// Renews one VM session (a retired one only while it carries holds) and
    /// reconciles it: the holds released, or `None` for a retired session left to
    /// lapse; `SessionExpired` when its lease is gone. The renewal is recorded in
    /// [`JEOPARDY`] as soon as it is acknowledged.
    async fn renew_vm_session(
        &self,
        sid: SessionId,
        vm: &str,
        retired: bool,
        reconcile: Option<&Reconcile>,
        ttl_s: u64,
    ) -> Result<Option<usize>, LockError> {
        // A retired session that carries no hold is closed, not just left to lapse:
        // an arbiter whose registry still has the old TTL (a rolling reload) may have
        // it cached and grant on it, and a grant in its last second would be lost
        // before the next renewal. The close compares the session's hold index empty
        // (every VM grant indexes its hold) and deletes the record every grant
        // compares, so a grant either commits first and keeps it renewed, or is
        // refused `session_expired` and its arbiter finds the class's live session.
        if retired && self.lease_hold_keys(sid).await?.is_empty() {
            if crate::test_faults::on(crate::test_faults::TestFault::RetiredLapseByRead) {
                return Ok(None); // PLANTED BUG (edges_vm scenario): left to lapse.
            }
            if self.close_spent(sid).await? {
                return Ok(None);
            }
            // A grant's index key appeared (or the index is not kept yet): renew.
        }
        let sent = Instant::now();
        match self.cluster.call(self.cluster.client().lease_keep_alive(sid.lease())).await {
            Ok(_) => JEOPARDY.renewed(self.cluster_name(), vm, sid, ttl_s, sent),
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => return Err(LockError::SessionExpired),
            Err(e) => return Err(e),
        }
        match reconcile {
            Some(rc) => Ok(Some(self.reconcile_session(sid, vm, rc).await?)),
            None => Ok(Some(0)),
        }
    }

    /// The hold keys attached to lease `sid`.
    async fn lease_hold_keys(&self, sid: SessionId) -> Result<Vec<Vec<u8>>, LockError> {
        let ttl = self
            .cluster
            .call(
                self.cluster.client().lease_time_to_live(sid.lease(), Some(LeaseTimeToLiveOptions::new().with_keys())),
            )
            .await?;
        if ttl.ttl() <= 0 {
            return Err(LockError::SessionExpired);
        }
        let prefix = self.cluster.keys().all_locks();
        Ok(ttl.keys().iter().filter(|k| k.starts_with(prefix.as_bytes())).cloned().collect())
    }

    async fn reconcile_session(&self, sid: SessionId, vm: &str, rc: &Reconcile) -> Result<usize, LockError> {
        let hold_keys = self.lease_hold_keys(sid).await?;
        if hold_keys.is_empty() {
            return Ok(0);
        }
        let gets: Vec<TxnOp> = hold_keys.iter().map(|k| TxnOp::get(k.clone(), None::<GetOptions>)).collect();
        let r = self.cluster.call(self.cluster.client().txn(Txn::new().and_then(gets))).await?;
        let mut released = 0;
        for op in r.op_responses() {
            let TxnOpResponse::Get(g) = op else { continue };
            for kv in g.kvs() {
                let Some(id) = hold_of(kv).and_then(|h| h.hold_id) else { continue };
                let Some(n) = hold_number(vm, &id) else { continue };
                let planted = crate::test_faults::on(crate::test_faults::TestFault::ReconcileOpenHolds);
                if n >= rc.next || (rc.open.contains(&n) && !planted) {
                    continue;
                }
                let Some(d) = self.cluster.keys().digest_of_hold(kv.key()) else { continue };
                if self.release_hold(&d, sid, &id).await? {
                    released += 1;
                }
            }
        }
        if released > 0 {
            tracing::info!(released, "reconcile released transparent holds whose requests had ended");
        }
        Ok(released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_session_is_in_jeopardy_from_a_failed_renewal_until_an_ack_or_the_end_of_its_ttl() {
        let j = VmJeopardy { by_cluster: Mutex::new(BTreeMap::new()) };
        let (vm, other) = ("0123456789abcdef0123456789abcdef", "fedcba9876543210fedcba9876543210");
        let (a, b) = (SessionId::from_lease(1).unwrap(), SessionId::from_lease(2).unwrap());
        let t0 = Instant::now();
        let s = Duration::from_secs;
        j.renewed("shard-a", vm, a, 6, t0);
        j.renewed("shard-a", vm, b, 15, t0);
        j.renewed("shard-a", other, a, 6, t0);
        assert_eq!(j.count("shard-a", t0), 0);
        // A failed renewal of one session: that one, on that cluster only.
        j.failed("shard-a", vm, a, Some(6), t0 + s(2), t0 + s(3));
        assert_eq!((j.count("shard-a", t0 + s(3)), j.count("coord", t0 + s(3))), (1, 0));
        // An ack clears it.
        j.renewed("shard-a", vm, a, 6, t0 + s(4));
        assert_eq!(j.count("shard-a", t0 + s(4)), 0);
        // A failure after a renewal sent during the same call (its reconcile failed)
        // is no jeopardy: the lease was renewed.
        j.failed("shard-a", vm, a, Some(6), t0 + s(4), t0 + s(5));
        assert_eq!(j.count("shard-a", t0 + s(5)), 0);
        // The cluster unreachable: every session of that VM there, not the other VM's,
        // and not one renewed since the failed call started.
        j.unreachable("shard-a", vm, t0 + s(4));
        assert_eq!(j.count("shard-a", t0 + s(5)), 1, "a was renewed at t0 + 4 s");
        j.unreachable("shard-a", vm, t0 + s(5));
        assert_eq!(j.count("shard-a", t0 + s(5)), 2);
        // The end of a session's TTL since its last renewal ends its jeopardy (a lapsed
        // lease) and forgets it; the other is renewed.
        assert_eq!(j.count("shard-a", t0 + s(10)), 1, "a's lease (6 s from t0 + 4 s) lapsed");
        j.renewed("shard-a", vm, b, 15, t0 + s(11));
        assert_eq!(j.count("shard-a", t0 + s(11)), 0);
        // A session no longer listed has ended.
        j.failed("shard-a", vm, b, Some(15), t0 + s(12), t0 + s(13));
        assert_eq!(j.count("shard-a", t0 + s(13)), 1);
        j.listed("shard-a", vm, &[]);
        assert_eq!(j.count("shard-a", t0 + s(13)), 0);
        // A session first seen failing counts if its TTL is known, from the call.
        j.failed("coord", vm, a, None, t0 + s(13), t0 + s(14));
        assert_eq!(j.count("coord", t0 + s(14)), 0);
        j.failed("coord", vm, a, Some(6), t0 + s(13), t0 + s(14));
        assert_eq!((j.count("coord", t0 + s(18)), j.count("coord", t0 + s(19))), (1, 0));
    }

    #[test]
    fn vm_ids_and_hold_numbers() {
        let vm = "0123456789abcdef0123456789abcdef";
        assert!(valid_vm_id(vm));
        assert!(!valid_vm_id(&vm.to_uppercase()));
        assert!(!valid_vm_id(&vm[1..]));
        assert!(!valid_vm_id("0123456789abcdef0123456789abcdeg"));
        assert_eq!(hold_number(vm, &hold_id(vm, 42)), Some(42));
        assert_eq!(hold_number(vm, "ffffffffffffffffffffffffffffffff/42"), None);
        assert_eq!(hold_number(vm, &format!("{vm}/x")), None);
        assert_eq!(hold_number(vm, &format!("{vm}42")), None);
    }
}
