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
//!
//! Cost per waiter: the waiter key's put, and its delete (inside the grant, or on
//! leaving). Memory fairness costs no writes. Durable classes are never handed over
//! in a release transaction (`mutex`): the order lives in etcd, not here.

use std::{
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::Duration,
};

use etcd_client::{
    Compare, CompareOp, DeleteOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp, WatchOptions,
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

/// This arbiter's waiter lease and the sequence of its waiter keys.
#[derive(Default)]
pub struct WaiterLease {
    lease: tokio::sync::Mutex<Option<(i64, Arc<AtomicBool>)>>,
    seq: AtomicU64,
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
struct Queued {
    store: Arc<Store>,
    key: String,
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
        if self.done {
            return;
        }
        let (store, key, rev) = (self.store.clone(), std::mem::take(&mut self.key), self.rev);
        // The waiter leaves at once: delete its key (compared, so a re-queued key of
        // the same name could never be hit).
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let cmp = [Compare::create_revision(key.as_str(), CompareOp::Equal, rev)];
                let txn = Txn::new().when(cmp).and_then([TxnOp::delete(key.as_str(), None::<DeleteOptions>)]);
                if let Err(e) = store.call(store.client().txn(txn)).await {
                    tracing::warn!(error = %e, "could not delete a departed durable waiter; it ends with the waiter lease");
                }
            });
        }
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
                            let holds = self.keys().holds(&d).into_bytes();
                            self.wait_delete(holds, true, revision, req.deadline, cancel).await?;
                        }
                        Reason::LockContended => super::wait::backoff(req.deadline, cancel).await?,
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
        let id = self.call(self.client().lease_grant(WAITER_TTL_S, None)).await?.id();
        let alive = Arc::new(AtomicBool::new(true));
        let (client, flag) = (self.client(), alive.clone());
        tokio::spawn(async move {
            let mut client = client;
            loop {
                tokio::time::sleep(Duration::from_millis(1000)).await;
                let r = tokio::time::timeout(Duration::from_secs(2), client.lease_keep_alive(id)).await;
                if let Ok(Err(e)) = &r {
                    if e.to_string().contains("lease not found") {
                        flag.store(false, Ordering::Release);
                        return;
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
        for _ in 0..2 {
            let lease = self.waiter_lease().await?;
            let seq = self.queues().durable.seq.fetch_add(1, Ordering::Relaxed);
            let key = self.keys().waiter(d, lease, seq);
            match self
                .call_by(
                    req.deadline,
                    self.client().put(key.as_str(), value.as_str(), Some(PutOptions::new().with_lease(lease))),
                )
                .await
            {
                Ok(r) => {
                    let rev = r.header().map_or(0, |h| h.revision());
                    return Ok(Queued { store: self.clone(), key, rev, done: false });
                }
                Err(LockError::Unavailable(m)) if m.contains("lease not found") => {
                    if let Some((_, alive)) = &*self.queues().durable.lease.lock().await {
                        alive.store(false, Ordering::Release);
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(LockError::Unavailable("could not obtain a waiter lease".into()))
    }

    /// Whether any durable waiter is queued for `d`.
    async fn waiters_queued(&self, d: &KeyDigest, deadline: Instant) -> Result<bool, LockError> {
        let opts = GetOptions::new().with_prefix().with_count_only();
        let r = self.call_by(deadline, self.client().get(self.keys().waiters(d), Some(opts))).await?;
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
        let r = self.call_by(deadline, self.client().get(self.keys().waiters(d), Some(opts))).await?;
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
        let watch = super::wait::delete_seen(self.client(), key, opts);
        tokio::select! {
            () = watch => Ok(()),
            _ = tokio::time::sleep_until(poll.min(deadline)) => Ok(()),
            _ = cancel.cancelled() => Err(LockError::Cancelled),
        }
    }
}
