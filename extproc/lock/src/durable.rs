//! Durable fairness (ADR-14): for `fairness: durable` classes, waiters queue as etcd
//! keys, ordered by create revision, and only the oldest is granted.
//!
//! ```text
//! <root>/q/<digest>/<arbiter lease:016x>-<seq:016x>   {"owner":..,"session":..}   lease: this arbiter's waiter lease
//! ```
//!
//! - **Arrival.** An acquire first tries an ordinary grant that also compares the
//!   key's waiter range empty, so it never overtakes a queued waiter.
//! - **Queueing.** Refused, it puts its waiter key (one write) and waits for its turn:
//!   it watches only the waiter just ahead of it (by create revision), so a release
//!   or a departure wakes one waiter, not all of them; the oldest waiter watches the
//!   holds.
//! - **Grant.** The oldest waiter's grant transaction compares its own waiter key
//!   (still there, same create revision) and that every waiter of the key was queued
//!   at or after it (a range compare holds only if it holds for every key), and
//!   deletes its waiter key with the put of its hold: one write.
//! - **Leaving.** A waiter that gives up (deadline, caller gone, error) deletes its
//!   key at once, from a drop guard, so even an abandoned acquire leaves nothing
//!   behind. Waiter keys live on one lease per arbiter ([`WAITER_TTL_S`], renewed
//!   every second), not on the caller's session: if the arbiter dies, all its waiter
//!   keys vanish together within that TTL. A dead or departed waiter therefore stalls
//!   the queue for at most [`WAITER_TTL_S`] once per dead arbiter, never per waiter
//!   (Redisson's fair lock stalls 5 s per dead waiter).
//! - **Losing a place.** An arbiter paused past the waiter TTL loses its waiters'
//!   keys; each notices at its next step and queues again at the back.
//! - **Orphans.** A waiter key whose waiter is gone but whose delete failed (etcd
//!   electing a leader, say), or whose put timed out yet committed, would sit on the
//!   live waiter lease, ahead of every later arrival, for as long as this arbiter
//!   runs. So the arbiter keeps the names of its live waiters' keys (each listed
//!   before its put, struck when its waiter leaves) and *sweeps*: it lists the keys
//!   on its waiter lease (`LeaseTimeToLive` with keys) and deletes every one no
//!   live waiter here owns, compared on that lease. Key names are never reused (the
//!   lease id and a sequence), so a listed name that is no longer live is an orphan
//!   for good. The sweep runs at the next renewal after a delete failed or a put's
//!   outcome was unknown, and every [`SWEEP_EVERY`] renewals otherwise. This is
//!   owner liveness, with no clock: only the owning arbiter knows its waiters, and
//!   if it dies its lease ends them all. (A deadline in the waiter record, judged
//!   by other arbiters, would depend on their wall clocks agreeing, which the
//!   release gate steps by an hour.) Every orphan is gone within about
//!   [`SWEEP_EVERY`] seconds at the latest, or [`WAITER_TTL_S`] once its arbiter
//!   is dead. Cost: one `LeaseTimeToLive` read per arbiter every [`SWEEP_EVERY`] s
//!   (and after a failure), a delete per orphan; nothing per waiter.
//!
//! Cost per waiter: the waiter key's put, and its delete (inside the grant, or on
//! leaving). Memory fairness costs no writes. Durable classes are never handed over
//! in a release transaction (`mutex`): the order lives in etcd, not here.

use std::{
    collections::HashSet,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    time::Duration,
};

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, GetOptions, LeaseTimeToLiveOptions, PutOptions, SortOrder, SortTarget,
    Txn, TxnOp, WatchOptions,
};
use lockmesh_core::{headers::SessionId, KeyDigest, Reason};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    mutex::{AcquireRequest, Attempt, Fair, Grant},
    LockError, SessionRecord, Store,
};

/// TTL of an arbiter's waiter lease, seconds: the longest a dead arbiter's waiters
/// hold up a queue.
pub(crate) const WAITER_TTL_S: i64 = 3;

/// Without a known failure, the orphan sweep runs at every this many renewals of
/// the waiter lease (one a second).
pub(crate) const SWEEP_EVERY: u64 = 10;

/// This arbiter's waiter lease, the sequence of its waiter keys, and what the
/// orphan sweep needs (module docs).
#[derive(Default)]
pub struct WaiterLease {
    lease: tokio::sync::Mutex<Option<(i64, Arc<AtomicBool>)>>,
    seq: AtomicU64,
    /// The keys of this arbiter's live waiters: listed before their put, struck
    /// when their waiter leaves. A key on the waiter lease that is not here is an
    /// orphan.
    live: Arc<Mutex<HashSet<String>>>,
    /// Set when a waiter key may have been left behind (a failed delete, a put
    /// whose outcome is unknown): the sweep runs at the next renewal.
    suspect: Arc<AtomicBool>,
}

// === impl WaiterLease ===

impl WaiterLease {
    fn list(&self, key: &str) {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_owned());
    }

    fn strike(&self, key: &str) {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).remove(key);
    }
}

/// Where a waiter stands.
enum Position {
    /// Oldest waiter of the key.
    Head,
    /// Behind this waiter key.
    Behind(Vec<u8>),
    /// Its key is gone (the waiter lease lapsed).
    Gone,
}

/// A queued waiter key; dropping it without [`Queued::granted`] deletes the key.
/// Dropping it always strikes the key from the live list, so a delete that fails
/// leaves an orphan the sweep finds.
struct Queued {
    store: Arc<Store>,
    /// The lock key's digest and this waiter's id in the waiters' book (`wait`).
    digest: KeyDigest,
    gate: u64,
    key: String,
    /// The waiter lease the key was put on.
    lease: i64,
    /// Its create revision; 0 while its put has not answered.
    rev: i64,
    done: bool,
}

impl Queued {
    /// The grant deleted the key in its own transaction.
    fn granted(mut self) {
        self.done = true;
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.store.queues().ungate(&self.digest, self.gate);
        let wl = &self.store.queues().durable;
        wl.strike(&self.key);
        if self.done {
            return;
        }
        let (store, key, rev, lease) = (self.store.clone(), std::mem::take(&mut self.key), self.rev, self.lease);
        // The waiter leaves at once: delete its key, compared on its create
        // revision, or on its lease when its put never answered (a name is never
        // put twice, so either only ever hits this waiter's own key).
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            wl.suspect.store(true, Ordering::Release);
            return;
        };
        rt.spawn(async move {
            let cmp = match rev {
                0 => Compare::lease(key.as_str(), CompareOp::Equal, lease),
                _ => Compare::create_revision(key.as_str(), CompareOp::Equal, rev),
            };
            let txn = Txn::new().when([cmp]).and_then([TxnOp::delete(key.as_str(), None::<DeleteOptions>)]);
            if let Err(e) = store.cluster().call(store.cluster().client().txn(txn)).await {
                store.queues().durable.suspect.store(true, Ordering::Release);
                tracing::warn!(error = %e, "could not delete a departed durable waiter; the orphan sweep will");
            }
        });
    }
}

// === impl Store ===

impl Store {
    /// Acquires a key of a `fairness: durable` class (see the module docs).
    pub(crate) async fn acquire_durable(
        self: &Arc<Self>,
        req: &AcquireRequest,
        sid: SessionId,
        mut new_record: Option<SessionRecord>,
        cancel: &CancellationToken,
    ) -> Result<Grant, LockError> {
        let d = req.key.digest();
        if new_record.is_none() {
            if let Some(r) = self.peek(req, &d, sid).await? {
                return r;
            }
        }
        // Arrival: granted only while nobody is queued.
        let (mut slot, mut tries) = (0, 0);
        loop {
            tries += 1;
            match self.try_grant(req, &d, sid, new_record.as_ref(), slot, Fair::Arrival).await? {
                Attempt::Granted(g) => return Ok(g),
                Attempt::EpochMoved if tries < 4 => {}
                Attempt::EpochMoved => return Err(LockError::Unavailable("the epoch record keeps changing".into())),
                Attempt::Refused { reason, free_slot, .. } => {
                    new_record = None;
                    slot = free_slot;
                    if reason == Reason::LockContended && tries < 4 && !self.waiters_queued(&d, req.deadline).await? {
                        continue;
                    }
                    break;
                }
            }
        }
        if req.try_once || Instant::now() >= req.deadline {
            return Err(LockError::Contended(Reason::KeyGated));
        }
        let mut q = self.enqueue(&d, req, sid).await?;
        let mut moves = 0;
        loop {
            if cancel.is_cancelled() {
                return Err(LockError::Cancelled);
            }
            if Instant::now() >= req.deadline {
                return Err(LockError::Contended(Reason::KeyGated));
            }
            let (pos, revision) = self.waiter_position(&d, &q, req.deadline).await?;
            match pos {
                Position::Gone => {
                    // The waiter lease lapsed (this arbiter paused or lost etcd):
                    // queue again, at the back.
                    q.done = true;
                    q = self.enqueue(&d, req, sid).await?;
                    continue;
                }
                Position::Behind(ahead) => {
                    self.wait_delete(ahead, false, revision, req.deadline, cancel).await?;
                    self.queues().woke(&d);
                    continue;
                }
                Position::Head => {}
            }
            let fair = Fair::Waiter { key: &q.key, rev: q.rev };
            match self.try_grant(req, &d, sid, None, slot, fair).await? {
                Attempt::Granted(g) => {
                    q.granted();
                    return Ok(g);
                }
                Attempt::EpochMoved => {
                    moves += 1;
                    if moves > 3 {
                        return Err(LockError::Unavailable("the epoch record keeps changing".into()));
                    }
                }
                Attempt::Refused { reason, revision, free_slot } => {
                    slot = free_slot;
                    match reason {
                        Reason::KeyGated => {
                            let holds = self.cluster.keys().holds(&d).into_bytes();
                            self.wait_delete(holds, true, revision, req.deadline, cancel).await?;
                            self.queues().woke(&d);
                        }
                        Reason::LockContended => super::wait::backoff(req.deadline, cancel).await?,
                        Reason::LockDelay => self.wait_delay(&d, req, sid, cancel).await?,
                    }
                }
            }
        }
    }

    /// This arbiter's waiter lease, granted on first use and renewed every second
    /// by a task that stops (and marks it lapsed) when etcd no longer knows it.
    async fn waiter_lease(&self) -> Result<i64, LockError> {
        let wl = &self.queues().durable;
        let mut g = wl.lease.lock().await;
        if let Some((id, alive)) = &*g {
            if alive.load(Ordering::Acquire) {
                return Ok(*id);
            }
        }
        let id = self.cluster.call(self.cluster.client().lease_grant(WAITER_TTL_S, None)).await?.id();
        let alive = Arc::new(AtomicBool::new(true));
        let (client, flag) = (self.cluster.client(), alive.clone());
        let (live, suspect, prefix) = (wl.live.clone(), wl.suspect.clone(), self.cluster.keys().all_waiters());
        tokio::spawn(async move {
            let mut client = client;
            for tick in 1u64.. {
                tokio::time::sleep(Duration::from_millis(1000)).await;
                let r = tokio::time::timeout(Duration::from_secs(2), client.lease_keep_alive(id)).await;
                if let Ok(Err(e)) = &r {
                    if e.to_string().contains("lease not found") {
                        flag.store(false, Ordering::Release);
                        return;
                    }
                }
                if suspect.swap(false, Ordering::AcqRel) || tick.is_multiple_of(SWEEP_EVERY) {
                    if let Err(e) = sweep_orphans(&mut client, id, &prefix, &live).await {
                        suspect.store(true, Ordering::Release);
                        tracing::debug!(error = %e, "durable waiter sweep failed; it runs again at the next renewal");
                    }
                }
            }
        });
        *g = Some((id, alive));
        Ok(id)
    }

    /// Puts this acquire's waiter key; its create revision is its place.
    async fn enqueue(
        self: &Arc<Self>,
        d: &KeyDigest,
        req: &AcquireRequest,
        sid: SessionId,
    ) -> Result<Queued, LockError> {
        let value = lockmesh_keyspace::WaiterRecord { owner: req.caller.identity.clone(), session: sid.to_string() };
        let value = serde_json::to_string(&value).map_err(|e| LockError::Internal(e.to_string()))?;
        let wl = &self.queues().durable;
        for _ in 0..2 {
            let lease = self.waiter_lease().await?;
            let seq = wl.seq.fetch_add(1, Ordering::Relaxed);
            let key = self.cluster.keys().waiter(d, lease, seq);
            // Listed before the put: a sweep never takes a live waiter's key. If
            // this future is dropped or the put fails, dropping `q` deletes the
            // key (it may have committed) and strikes it.
            wl.list(&key);
            let gate = self.queues().next_id();
            self.queues().gate(d, gate, Some(req));
            let mut q = Queued { store: self.clone(), digest: d.clone(), gate, key, lease, rev: 0, done: false };
            let mut client = self.cluster.client();
            let put = client.put(q.key.as_str(), value.as_str(), Some(PutOptions::new().with_lease(lease)));
            match self.cluster.call_by(req.deadline, put).await {
                Ok(r) => {
                    q.rev = r.header().map_or(0, |h| h.revision());
                    return Ok(q);
                }
                Err(LockError::Unavailable(m)) if m.contains("lease not found") => {
                    // Nothing was written.
                    q.done = true;
                    if let Some((_, alive)) = &*wl.lease.lock().await {
                        alive.store(false, Ordering::Release);
                    }
                }
                Err(e) => {
                    wl.suspect.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        }
        Err(LockError::Unavailable("could not obtain a waiter lease".into()))
    }

    /// Whether any durable waiter is queued for `d`.
    async fn waiters_queued(&self, d: &KeyDigest, deadline: Instant) -> Result<bool, LockError> {
        let opts = GetOptions::new().with_prefix().with_count_only();
        let r = self
            .cluster
            .call_by(deadline, self.cluster.client().get(self.cluster.keys().waiters(d), Some(opts)))
            .await?;
        Ok(r.count() > 0)
    }

    /// Where waiter `q` stands, and the revision of the read.
    async fn waiter_position(
        &self,
        d: &KeyDigest,
        q: &Queued,
        deadline: Instant,
    ) -> Result<(Position, i64), LockError> {
        let opts = GetOptions::new().with_prefix().with_keys_only().with_sort(SortTarget::Create, SortOrder::Ascend);
        let r = self
            .cluster
            .call_by(deadline, self.cluster.client().get(self.cluster.keys().waiters(d), Some(opts)))
            .await?;
        let revision = r.header().map_or(0, |h| h.revision());
        let kvs = r.kvs();
        let pos = match kvs.iter().position(|kv| kv.key() == q.key.as_bytes() && kv.create_revision() == q.rev) {
            None => Position::Gone,
            Some(0) => Position::Head,
            Some(i) => Position::Behind(kvs[i - 1].key().to_vec()),
        };
        Ok((pos, revision))
    }

    /// Waits for a delete of `key` (of any key under it when `prefix`) after
    /// `revision`, a jittered ~1 s poll (a lost watch is only a lost hint), the
    /// deadline, or cancellation.
    async fn wait_delete(
        &self,
        key: Vec<u8>,
        prefix: bool,
        revision: i64,
        deadline: Instant,
        cancel: &CancellationToken,
    ) -> Result<(), LockError> {
        let poll = super::wait::next_poll();
        let mut opts = WatchOptions::new().with_start_revision(revision + 1);
        if prefix {
            opts = opts.with_prefix();
        }
        let watch = self.delete_seen(key, opts);
        tokio::select! {
            () = watch => Ok(()),
            _ = tokio::time::sleep_until(poll.min(deadline)) => Ok(()),
            _ = cancel.cancelled() => Err(LockError::Cancelled),
        }
    }
}

/// Deletes every key on waiter lease `lease` under `prefix` that no live waiter
/// here owns (module docs, "Orphans"); returns how many it deleted.
async fn sweep_orphans(
    client: &mut Client,
    lease: i64,
    prefix: &str,
    live: &Mutex<HashSet<String>>,
) -> Result<usize, LockError> {
    let unavailable = |e: String| LockError::Unavailable(e);
    let step = Duration::from_secs(2);
    let opts = LeaseTimeToLiveOptions::new().with_keys();
    let r = tokio::time::timeout(step, client.lease_time_to_live(lease, Some(opts)))
        .await
        .map_err(|_| unavailable("etcd did not answer the waiter lease's key list".into()))?
        .map_err(|e| unavailable(e.to_string()))?;
    let orphans: Vec<Vec<u8>> = {
        let live = live.lock().unwrap_or_else(|p| p.into_inner());
        r.keys()
            .iter()
            .filter(|k| k.starts_with(prefix.as_bytes()))
            .filter(|k| !std::str::from_utf8(k).is_ok_and(|s| live.contains(s)))
            .cloned()
            .collect()
    };
    for k in &orphans {
        let cmp = [Compare::lease(k.clone(), CompareOp::Equal, lease)];
        let txn = Txn::new().when(cmp).and_then([TxnOp::delete(k.clone(), None::<DeleteOptions>)]);
        tokio::time::timeout(step, client.txn(txn))
            .await
            .map_err(|_| unavailable("etcd did not answer an orphan's delete".into()))?
            .map_err(|e| unavailable(e.to_string()))?;
    }
    if !orphans.is_empty() {
        tracing::info!(count = orphans.len(), "deleted durable waiter keys no waiter here owns");
    }
    Ok(orphans.len())
}
