//! Lock-delay (Consul's `LockDelay`; docs/CLASSES.md): a key of a class with
//! `lock_delay_s` stays ungrantable for that long after its hold ended without its
//! holder releasing it (the session expired, or an admin force release), so a
//! paused holder that wakes has time to notice before anyone else starts. A
//! release by the holder, or the holder's own session close, frees the key at once.
//!
//! etcd records no times, and an expiry writes nothing of its own (the lessor
//! deletes the lease's keys in one revision). So the cost lives on delay classes
//! only, inside transactions that run anyway:
//!
//! ```text
//! grant     compare  <root>/g/<d> absent, <root>/d/<d> absent   (beside the grant's)
//!           then     put <root>/g/<d> = {session}               the guard, no lease
//! release   then     delete <root>/g/<d>                        (every release: no read)
//! hand-off  then     put <root>/g/<d> = {waiter's session}
//! ```
//!
//! A guard whose key has no hold marks an end without a release. The first
//! arbiter to see one ([`LockDelay::left`]: a grant attempt refused by the guard,
//! or this module's watch of hold deletes, [`LockDelay::start_watch`]) turns it
//! into the delay record in one transaction (guard unchanged, no hold) on a new
//! lease of `lock_delay_s`: etcd's lease clock ends the delay, the same for every
//! arbiter and across restarts. A guard whose session has a close marker was a
//! holder's close: it is deleted, no delay.
//!
//! The promise (docs/GUARANTEES.md G13): no grant of the key for at least
//! `lock_delay_s` after an arbiter saw the end (no grant can commit before that:
//! a grant compares the guard and the record absent), and the key is grantable
//! again at most `lock_delay_s` + the detection lag (a watch delivery, or the next
//! grant attempt) + one etcd election timeout after the end, unless the etcd
//! leader changes during the delay: etcd 3.5 gives a new leader's leases their
//! full TTL again (no lease checkpoints by default), up to one more `lock_delay_s`.

use std::collections::HashMap;
use std::sync::{atomic::AtomicBool, Arc, RwLock};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, DeleteOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchFilterType};
use lockmesh_core::{ClassRegistry, KeyDigest, Reason};
use lockmesh_keyspace::{DelayGuard, LockDelayRecord};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::engine::txn::{Answer, Branch, TxnBuilder};

use super::test_faults::{on, TestFault};
use super::{keys, now_ms, Cluster, HoldRecord, LockError, Runtime, Store};

/// `lock_delay_s` by class name, for the classes of the registry in force that
/// set one (one arbiter's, [`crate::runtime::Runtime::delays`]: a reload
/// replaces it).
#[derive(Default)]
pub struct Delays(RwLock<HashMap<String, u64>>);

impl Delays {
    /// Takes the delays of `reg`'s classes (at start and at every reload).
    pub fn set_registry(&self, reg: &ClassRegistry) {
        let m: HashMap<String, u64> =
            reg.classes().iter().filter(|c| c.lock_delay_s > 0).map(|c| (c.name.to_string(), c.lock_delay_s)).collect();
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = m;
    }

    /// The delay of `class` (0: none).
    fn of(&self, class: &str) -> u64 {
        self.0.read().unwrap_or_else(|p| p.into_inner()).get(class).copied().unwrap_or(0)
    }

    fn any(&self) -> bool {
        !self.0.read().unwrap_or_else(|p| p.into_inner()).is_empty()
    }
}

/// The guard a grant of a delay class puts for session `sid`.
pub(crate) fn guard_value(sid: lockmesh_core::headers::SessionId) -> Vec<u8> {
    serde_json::to_vec(&DelayGuard { session: sid.to_string() }).unwrap_or_default()
}

// === impl Store ===

/// The lock-delay of one cluster: the guard and record transactions and the
/// watch of hold deletes (see the module doc).
pub struct LockDelay {
    cluster: Arc<Cluster>,
    runtime: Arc<Runtime>,
    /// Whether the watch of hold deletes runs ([`LockDelay::start_watch`]).
    watching: AtomicBool,
}

// === impl LockDelay ===

impl LockDelay {
    pub(crate) fn new(cluster: Arc<Cluster>, runtime: Arc<Runtime>) -> Self {
        Self { cluster, runtime, watching: AtomicBool::new(false) }
    }

    /// Whether any class sets a delay, or a candidate delay other than its own
    /// (shadow mode: the candidate's memory of ends without a release, `shadow`).
    fn any(&self) -> bool {
        self.runtime.delays().any() || self.runtime.shadow().any_delay_candidate()
    }

    /// The compares and the put a grant of a key of a class with a delay adds: no
    /// guard, no delay record; put the guard for `sid`.
    pub(crate) fn grant_ops(
        &self,
        d: &KeyDigest,
        sid: lockmesh_core::headers::SessionId,
    ) -> crate::engine::grant::DelayOps {
        let (g, r) = (self.cluster.keys().delay_guard(d), self.cluster.keys().lock_delay(d));
        crate::engine::grant::DelayOps {
            compares: vec![
                Compare::create_revision(g.as_str(), CompareOp::Equal, 0),
                Compare::create_revision(r.as_str(), CompareOp::Equal, 0),
            ],
            put: TxnOp::put(g.as_str(), guard_value(sid), None),
            reads: [g, r],
        }
    }

    /// Deletes key `d`'s lock-delay guard if it names session `sid` (a grant this
    /// arbiter undoes by revoking the session it opened: no expiry).
    pub(crate) async fn drop_guard(&self, d: &KeyDigest, sid: lockmesh_core::headers::SessionId) {
        let g = self.cluster.keys().delay_guard(d);
        let txn = Txn::new()
            .when([Compare::value(g.as_str(), CompareOp::Equal, guard_value(sid))])
            .and_then([TxnOp::delete(g.as_str(), None::<DeleteOptions>)]);
        if let Err(e) = self.cluster.call(self.cluster.client().txn(txn)).await {
            tracing::debug!(error = %e, key = %d.short(), "could not drop an undone grant's lock-delay guard; the key may see one delay");
        }
    }

    /// How long key `d` (of a class with `delay_s`) is still in its lock-delay,
    /// turning a guard whose hold is gone into the delay record first; `None` when
    /// it may be granted now (as far as the delay goes).
    pub(crate) async fn left(&self, d: &KeyDigest, delay_s: u64) -> Result<Option<Duration>, LockError> {
        for _ in 0..3 {
            let k = self.cluster.keys();
            let (holds, g, r) = (k.holds(d), k.delay_guard(d), k.lock_delay(d));
            let mut b = TxnBuilder::new();
            let held = b.read(Branch::Success, holds.as_str(), Some(GetOptions::new().with_prefix().with_count_only()));
            let (guard, record) =
                (b.read(Branch::Success, g.as_str(), None), b.read(Branch::Success, r.as_str(), None));
            let a = Answer::of(&self.cluster.call(self.cluster.client().txn(b.build())).await?);
            let (held, guard, record) = (a.must(held)?, a.must(guard)?, a.must(record)?);
            if let Some(kv) = record.kvs().first() {
                return Ok(Some(self.lease_left(kv.lease()).await));
            }
            let Some(gkv) = guard.kvs().first() else { return Ok(None) };
            if held.count() > 0 {
                // Held: the guard is its holder's. Not a delay (the key is gated).
                return Ok(None);
            }
            let guard: Option<DelayGuard> = serde_json::from_slice(gkv.value()).ok();
            let cause = self.end_cause(d, guard.as_ref()).await?;
            let unchanged = [
                Compare::mod_revision(g.as_str(), CompareOp::Equal, gkv.mod_revision()),
                Compare::create_revision(holds.as_str(), CompareOp::Equal, 0).with_range(keys::prefix_end(&holds)),
            ];
            let Some(cause) = cause else {
                // The holder closed its session: a release, no delay.
                let txn = Txn::new().when(unchanged).and_then([TxnOp::delete(g.as_str(), None::<DeleteOptions>)]);
                self.cluster.call(self.cluster.client().txn(txn)).await?;
                continue;
            };
            let ttl = i64::try_from(delay_s).map_err(|_| LockError::Internal("lock_delay_s out of range".into()))?;
            let lease = self.cluster.call(self.cluster.client().lease_grant(ttl, None)).await?.id();
            let rec = LockDelayRecord { cause: cause.to_owned(), delay_s, seen_ms: now_ms() };
            let rec = serde_json::to_vec(&rec).map_err(|e| LockError::Internal(e.to_string()))?;
            let txn = Txn::new().when(unchanged).and_then([
                TxnOp::delete(g.as_str(), None::<DeleteOptions>),
                TxnOp::put(r.as_str(), rec, Some(PutOptions::new().with_lease(lease))),
            ]);
            let done = self.cluster.call(self.cluster.client().txn(txn)).await?;
            if done.succeeded() {
                tracing::info!(key = %d.short(), cause, delay_s, "a hold ended without a release: the key is in its lock-delay");
                return Ok(Some(Duration::from_secs(delay_s)));
            }
            // Another arbiter turned it first, or the key was granted meanwhile.
            let _ = self.cluster.call(self.cluster.client().lease_revoke(lease)).await;
        }
        Err(LockError::Unavailable("the lock-delay guard kept changing".into()))
    }

    /// Why a guard's hold ended: `Some("force")` when the key has a force record
    /// (an approved force release; the record stays, so a later expiry of the key
    /// reads as `force` too: either way the delay applies), `None` when the guard's
    /// session has a close marker (its holder closed it: a release), else
    /// `Some("expiry")`. Close markers live 120 s (the marker lease): an end turned
    /// later than that reads as an expiry.
    async fn end_cause(&self, d: &KeyDigest, guard: Option<&DelayGuard>) -> Result<Option<&'static str>, LockError> {
        let k = self.cluster.keys();
        let mut b = TxnBuilder::new();
        let force = b.read(Branch::Success, k.force_record(d), Some(GetOptions::new().with_count_only()));
        let closed = guard
            .and_then(|g| i64::from_str_radix(&g.session, 16).ok())
            .and_then(lockmesh_core::headers::SessionId::from_lease)
            .map(|sid| b.read(Branch::Success, k.close_marker(sid), Some(GetOptions::new().with_count_only())));
        let a = Answer::of(&self.cluster.call(self.cluster.client().txn(b.build())).await?);
        let count = |read| a.get(read).map_or(0, etcd_client::GetResponse::count);
        if count(force) > 0 {
            return Ok(Some("force"));
        }
        if closed.is_some_and(|read| count(read) > 0) {
            return Ok(None);
        }
        Ok(Some("expiry"))
    }

    /// Whether the hold of `d` deleted at `revision` (on lease `lease`) ended without
    /// a release: no release marker of the key written at that revision, no close
    /// marker of its session. A read at that revision and one of the close marker.
    async fn ended_unreleased(&self, d: &KeyDigest, revision: i64, lease: i64) -> Result<bool, LockError> {
        let k = self.cluster.keys();
        let marker = self.cluster.call(self.cluster.client().get(k.release_marker(d), None)).await?;
        if marker.kvs().first().is_some_and(|kv| kv.mod_revision() == revision) {
            return Ok(false);
        }
        let Some(sid) = lockmesh_core::headers::SessionId::from_lease(lease) else { return Ok(true) };
        let closed = self
            .cluster
            .call(self.cluster.client().get(k.close_marker(sid), Some(GetOptions::new().with_count_only())))
            .await?;
        Ok(closed.count() == 0)
    }

    /// Time left on lease `id` (a delay record's), at least 50 ms while it exists.
    async fn lease_left(&self, id: i64) -> Duration {
        match self.cluster.call(self.cluster.client().lease_time_to_live(id, None)).await {
            Ok(r) if r.ttl() > 0 => Duration::from_secs(u64::try_from(r.ttl()).unwrap_or(1)),
            _ => Duration::from_millis(50),
        }
    }

    /// Time left of key `d`'s lock-delay without turning anything (inspection):
    /// `None` when no delay record exists.
    pub async fn record_left(&self, d: &KeyDigest) -> Result<Option<Duration>, LockError> {
        let r = self.cluster.call(self.cluster.client().get(self.cluster.keys().lock_delay(d), None)).await?;
        match r.kvs().first() {
            Some(kv) => Ok(Some(self.lease_left(kv.lease()).await)),
            None => Ok(None),
        }
    }

    /// Starts (once per store) the watch of hold deletes that turns the guards of
    /// delay classes into delay records as soon as a hold ends without a release.
    /// It watches only while some class sets a delay; otherwise it costs nothing.
    pub fn start_watch(self: &Arc<Self>) {
        if self.watching.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            // The last revision the watch saw through (0: none yet). A watch that
            // breaks resumes after it, so a hold that ended in the gap is still
            // turned into its delay as the watch catches up, not at the key's next
            // grant attempt.
            let mut seen = 0i64;
            loop {
                let Some(store) = weak.upgrade() else { return };
                if !store.any() {
                    // Nothing watched while no class sets a delay: start afresh.
                    drop(store);
                    seen = 0;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
                if on(TestFault::DelayRewatchFromNow) {
                    seen = 0; // PLANTED BUG (recipe_edges scenario): resume from "now".
                }
                let gap = match follow_deletes(&store, &mut seen).await {
                    Err(e) => {
                        tracing::debug!(error = %e, seen, "the lock-delay watch ended; watching again from where it was");
                        Duration::from_secs(1)
                    }
                    // The test fault `delay_watch_gap` broke the watch on purpose.
                    Ok(true) => Duration::from_secs(5),
                    Ok(false) => Duration::from_secs(1),
                };
                drop(store);
                tokio::time::sleep(gap).await;
            }
        });
    }
}

// === impl Store ===

impl Store {
    /// Waits out key `d`'s lock-delay (the grant of `req` on session `sid` was
    /// refused `lock_delay`), or answers `contended` (`lock_delay`) at once when it
    /// outlasts the deadline.
    pub(crate) async fn wait_delay(
        &self,
        d: &KeyDigest,
        req: &super::mutex::AcquireRequest,
        sid: lockmesh_core::headers::SessionId,
        cancel: &CancellationToken,
    ) -> Result<(), LockError> {
        let Some(left) = self.delay.left(d, req.class.lock_delay_s).await? else { return Ok(()) };
        self.runtime().shadow().after_delayed(
            self,
            &req.class,
            &req.key,
            left,
            &(sid.lease(), d.clone(), req.deadline),
        );
        let until = Instant::now() + left;
        if until > req.deadline {
            return Err(LockError::Contended(Reason::LockDelay));
        }
        tokio::select! {
            () = tokio::time::sleep_until(until) => Ok(()),
            () = cancel.cancelled() => Err(LockError::Cancelled),
        }
    }
}

/// Follows hold deletes (with the deleted hold) from the revision after `seen`
/// (from now when `seen` is 0) until the watch breaks or no class sets a delay any
/// more, moving `seen` up to each revision it has handled. A resume point etcd
/// compacted away cannot be replayed: the watch then resumes at the compaction,
/// and a hold that ended before it is turned into its delay by the key's next
/// grant attempt, which its guard refuses (docs/GUARANTEES.md G13). Answers
/// `true` when the test fault `delay_watch_gap` broke it.
async fn follow_deletes(store: &Arc<LockDelay>, seen: &mut i64) -> Result<bool, LockError> {
    let k = store.cluster.keys();
    let mut opts =
        etcd_client::WatchOptions::new().with_prefix().with_prev_key().with_filters([WatchFilterType::NoPut]);
    if *seen > 0 {
        opts = opts.with_start_revision(*seen + 1);
    }
    let mut client = store.cluster.client();
    let mut stream = client.watch(k.all_locks(), Some(opts)).await.map_err(super::unavailable)?;
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(5), stream.message()).await;
        if !store.any() {
            return Ok(false);
        }
        let r = match msg {
            Err(_) => continue,
            Ok(Ok(Some(r))) => r,
            Ok(Ok(None)) => return Err(LockError::Unavailable("the watch ended".into())),
            Ok(Err(e)) => return Err(super::unavailable(e)),
        };
        if r.compact_revision() > 0 {
            tracing::warn!(
                from = *seen + 1,
                compacted = r.compact_revision(),
                "the lock-delay watch resumes after a compaction: an end without a release before it starts its delay at the key's next grant attempt"
            );
            *seen = r.compact_revision() - 1;
            return Err(LockError::Unavailable("the lock-delay watch's resume point was compacted".into()));
        }
        if r.canceled() {
            return Err(LockError::Unavailable("the watch was cancelled".into()));
        }
        if r.created() && *seen == 0 {
            // Watching from now: everything up to the creation's revision is behind it.
            *seen = r.header().map_or(0, |h| h.revision());
        }
        let mut gap = false;
        for ev in r.events() {
            if let Some(kv) = ev.kv() {
                *seen = (*seen).max(kv.mod_revision());
            }
            if ev.event_type() != EventType::Delete {
                continue;
            }
            gap |= on(TestFault::DelayWatchGap);
            let Some(prev) = ev.prev_kv() else { continue };
            let Ok(hold) = serde_json::from_slice::<HoldRecord>(prev.value()) else { continue };
            let delay = store.runtime.delays().of(&hold.class);
            let Some(d) = k.digest_of_hold(prev.key()) else { continue };
            if store.runtime.shadow().delay_candidate(&hold.class).is_some() {
                // Shadow mode: remember when this arbiter saw an end without a release.
                let (store, rev, lease) = (store.clone(), ev.kv().map_or(0, |kv| kv.mod_revision()), prev.lease());
                let d = d.clone();
                tokio::spawn(async move {
                    if let Ok(true) = store.ended_unreleased(&d, rev, lease).await {
                        store.runtime.shadow().saw_end(&d);
                    }
                });
            }
            if delay == 0 {
                continue;
            }
            let store = store.clone();
            tokio::spawn(async move {
                if let Err(e) = store.left(&d, delay).await {
                    tracing::debug!(error = %e, key = %d.short(), "could not check a lock-delay guard; the next grant attempt will");
                }
            });
        }
        if gap {
            // Not a bug (test fault `delay_watch_gap`): a break right after a delete.
            return Ok(true);
        }
    }
}
