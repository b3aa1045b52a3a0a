//! Grants, releases and inspection.
//!
//! The grant transaction (one per grant, so each token is unique):
//!
//! ```text
//! compare  mod_revision(<root>/sys/epoch) == E.mod_revision   epoch unchanged
//!          create_revision(<root>/l/<d>/h/ prefix) == 0        no holder (empty range)
//!          lease(<root>/s/<sid>) == sid                        session alive *at commit*
//! then     put <root>/l/<d>/h/0000 = hold   (lease sid)
//! else     get holders, session record, epoch record          classify the refusal
//! ```
//!
//! Every grant also compares the mod revisions of the authoritative class map and
//! of its class's policy record (`lock::policy`), and takes N from that record.
//!
//! The session compare is what keeps a waiter whose session expired while it
//! waited from being granted (etcd #11456). Release compares the hold's create
//! revision (the token's revision), never deletes by name (etcd #22082).

use std::sync::Arc;

use etcd_client::{Compare, CompareOp, DeleteOptions, GetOptions, KeyValue, PutOptions, Txn, TxnOp};
use lockmesh_core::{
    class::Fairness,
    headers::{LockMode, Permits, SessionId},
    ClassSpec, FencingToken, KeyDigest, LockKey, Reason,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{
    keys, now_ms,
    policy::PolicyGate,
    session::Caller,
    steps::{timed, Step},
    wait::{Handed, HeldBy, Offer},
    EpochState, HoldRecord, Keys, LockError, SessionRecord, Store,
};
use crate::engine::{
    commit::{Sending, Sent},
    grant::{GrantTxn, KeyGrant, SlotCompares},
    handoff::{HandoffTxn, WaiterSession},
    txn::{found, Answer, Branch, TxnBuilder},
};
use crate::test_faults::{self, TestFault};
use crate::upgrade::Capability;

/// An acquire as the API hands it over.
#[derive(Debug, Clone)]
pub struct AcquireRequest {
    pub key: LockKey,
    /// Its class (from the registry).
    pub class: ClassSpec,
    pub caller: Caller,
    /// An existing session to attach to; `None` opens one for this grant.
    pub session: Option<SessionId>,
    /// When to give up.
    pub deadline: Instant,
    /// Try once (`x-lock-wait-ms: 0`).
    pub try_once: bool,
    /// Transparent mode: the filter's hold id (`<vm>/<n>`), recorded in the hold.
    /// A hold of the same session with another hold id is another request's: it
    /// occupies the key like any holder (never an idempotent re-acquire).
    pub hold_id: Option<String>,
    /// Transparent mode: the session's owner (the Envoy and its VM), when it is not
    /// `caller` (the downstream identity the hold is recorded for).
    pub session_owner: Option<Caller>,
    /// The caller a self client claimed (`tls.self_clients`), when it differs from
    /// `caller`: recorded in the hold as unverified, never used to authorise.
    pub unverified_caller: Option<String>,
    /// How many of the key's slots to take, all in the one grant transaction
    /// (`x-lock-permits`; every slot for an exclusive hold).
    pub permits: Permits,
    /// The read-write mode the caller named (`x-lock-mode`), recorded in the hold.
    pub mode: Option<LockMode>,
    /// A campaign (`/v1/elections/campaign`): granted only while the key's
    /// authoritative limit, which the grant compares, is 1.
    pub election: bool,
    /// The session the grant goes on is one an acquire opened for itself (set by
    /// [`Store::in_session`]): the grant puts its hold index key
    /// ([`Keys::hold_index`]) so the session's close at its last release can
    /// compare that it holds nothing.
    pub session_indexed: bool,
}

/// A granted (or already held) lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The fencing token.
    pub token: FencingToken,
    /// The session carrying the hold.
    pub session: SessionId,
    /// The session's TTL, seconds.
    pub ttl_s: u64,
    /// The key's class.
    pub class: String,
    /// True when the session already held the key (idempotent re-acquire).
    pub existing: bool,
    /// True when this acquire opened the session.
    pub new_session: bool,
    /// How many slots the grant holds (1 but for `x-lock-permits` and exclusive holds).
    pub permits: u32,
    /// The hold's read-write mode as recorded in it (`x-lock-mode`), for an
    /// existing hold the one it was granted with, never the one asked for.
    pub mode: Option<LockMode>,
}

impl Grant {
    /// A new grant of `permits` slots for `req` under `token` on `session` (not
    /// an existing hold, the session not opened here; the caller says otherwise).
    pub(crate) fn new(req: &AcquireRequest, token: FencingToken, session: SessionId, permits: u32) -> Self {
        Self {
            token,
            session,
            ttl_s: req.class.ttl_s,
            class: req.class.name.to_string(),
            existing: false,
            new_session: false,
            permits,
            mode: req.mode,
        }
    }
}

/// A holder as inspection shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HolderView {
    pub identity: String,
    /// Time held, ms (from the grant's wall clock; informational).
    pub age_ms: u64,
    /// Token and session, only when the caller is this holder.
    pub own: Option<(FencingToken, SessionId)>,
    /// How many slots the hold takes (all of its slot keys are one holder here).
    pub permits: u32,
    /// Its read-write mode, when its acquire named one.
    pub mode: Option<LockMode>,
}

pub(crate) enum Attempt {
    Granted(Grant),
    Refused { reason: Reason, revision: i64, free_slot: u32 },
    EpochMoved,
}

/// The waiter-order compares of a grant.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fair<'a> {
    /// Memory fairness: the arbiter's FIFO orders waiters; nothing to compare.
    Memory,
    /// Durable, arriving: no durable waiter may be queued for the key.
    Arrival,
    /// Durable, queued as `key` (created at `rev`): it must still exist and be the
    /// oldest waiter; the grant deletes it.
    Waiter { key: &'a str, rev: i64 },
}

impl Fair<'_> {
    pub(crate) fn compares(&self, k: &Keys, d: &KeyDigest) -> Vec<Compare> {
        let q = k.waiters(d);
        match *self {
            Fair::Memory => vec![],
            // An empty range compares as one key with create revision 0.
            Fair::Arrival if test_faults::on(TestFault::SkipQueueCompare) => vec![], // PLANTED BUG (release gate)
            Fair::Arrival => {
                vec![Compare::create_revision(q.as_str(), CompareOp::Equal, 0).with_range(keys::prefix_end(&q))]
            }
            // A range compare holds only if it holds for every key in the range:
            // every waiter was queued at or after this one.
            Fair::Waiter { key, rev } => vec![
                Compare::create_revision(key, CompareOp::Equal, rev),
                Compare::create_revision(q.as_str(), CompareOp::Greater, rev - 1).with_range(keys::prefix_end(&q)),
            ],
        }
    }

    pub(crate) fn ops(&self) -> Vec<TxnOp> {
        match *self {
            Fair::Waiter { key, .. } => vec![TxnOp::delete(key, None::<DeleteOptions>)],
            _ => vec![],
        }
    }
}

/// What a release's hand-off attempt did.
enum HandOff {
    /// Released and granted to the waiter.
    Handed(Grant),
    /// Released; the grant was taken back (sealed, or another cluster answered).
    ReleasedOnly,
    /// Nothing was written.
    NotDone,
}

/// What the read of a key granted here says to do ([`Store::held_read`]).
enum HeldRead {
    /// The answer without waiting: an idempotent re-acquire, or a leak.
    Answer(Result<Grant, LockError>),
    /// Held by another: wait from this revision (with the offer).
    Wait(i64),
    /// Free, or not a mutex by the authoritative limit: run a grant transaction.
    Grant,
}

/// A prefix read.
fn prefix() -> Option<GetOptions> {
    Some(GetOptions::new().with_prefix())
}

/// The commit revision a grant's token carries.
fn token_revision(g: &Grant) -> i64 {
    i64::try_from(g.token.revision()).unwrap_or(i64::MAX)
}

/// The hold `kv` (minted at `epoch`) of session `sid`, answered as an `existing`
/// grant of `req`.
pub(crate) fn existing_grant(
    req: &AcquireRequest,
    sid: SessionId,
    kv: &KeyValue,
    epoch: u64,
) -> Result<Grant, LockError> {
    let rev = u64::try_from(kv.create_revision()).unwrap_or(0);
    let hold = hold_of(kv);
    let (permits, mode) = (hold.as_ref().and_then(|h| h.permits).unwrap_or(1), hold.as_ref().and_then(|h| h.mode));
    let (permits, mode) = if test_faults::on(TestFault::EchoAskedMode) {
        // PLANTED BUG (holder_safety scenario): the asked mode is the answer.
        (req.permits.of(permits), req.mode)
    } else if let Some(why) = mode_change(req, permits, mode) {
        return Err(LockError::ModeConflict(why));
    } else {
        (permits, mode)
    };
    FencingToken::mint(epoch, rev).map_err(internal).map(|token| Grant {
        token,
        session: sid,
        ttl_s: req.class.ttl_s,
        class: req.class.name.to_string(),
        existing: true,
        new_session: false,
        permits,
        mode,
    })
}

/// Why a re-acquire `req` of a key its session holds with `permits` slots in
/// `mode` would change that hold, if it would: an exclusive hold asked of a shared
/// or plain one, a shared hold asked of an exclusive one, or a number of permits
/// other than the held one. A re-acquire that names neither (or the same) is the
/// idempotent re-acquire, answered with what is held.
fn mode_change(req: &AcquireRequest, permits: u32, mode: Option<LockMode>) -> Option<String> {
    let held_exclusive = mode == Some(LockMode::Exclusive);
    let held = match mode {
        Some(m) => m.as_str(),
        None if permits > 1 => "permits",
        None => "plain",
    };
    match (req.mode, req.permits) {
        (Some(LockMode::Exclusive), _) if !held_exclusive => {}
        (Some(LockMode::Shared), _) if held_exclusive => {}
        (_, Permits::Count(k)) if k > 1 && k != permits => {}
        _ => return None,
    }
    Some(format!(
        "x-lock-mode: the session holds the key {held} with {permits} permit(s); a re-acquire never changes a \
         held key's mode: release it first"
    ))
}

/// The hold value a grant of `req` at `epoch`, taking `permits` slots, writes
/// into each of its slots (also the arbiter's bench-floor build's, which writes
/// what a grant writes); `attempt` is its fenced attempt id, if any.
pub fn hold_record(
    req: &AcquireRequest,
    epoch: u64,
    permits: u32,
    keys: Option<u32>,
    attempt: Option<&str>,
) -> Result<Vec<u8>, LockError> {
    let hold = HoldRecord {
        key: req.key.as_str().to_owned(),
        owner: req.caller.identity.clone(),
        instance: req.caller.instance.clone(),
        epoch,
        class: req.class.name.to_string(),
        acquired_ms: now_ms(),
        hold_id: req.hold_id.clone(),
        unverified_caller: req.unverified_caller.clone(),
        permits: (permits > 1).then_some(permits),
        mode: req.mode,
        keys,
        attempt: attempt.map(str::to_owned),
    };
    serde_json::to_vec(&hold).map_err(internal)
}

pub(crate) fn hold_of(kv: &KeyValue) -> Option<HoldRecord> {
    serde_json::from_slice(kv.value()).ok()
}

fn internal(e: impl std::fmt::Display) -> LockError {
    LockError::Internal(e.to_string())
}

/// The retry policy of a grant loop (`acquire_in`, `multi`): an epoch record that
/// keeps moving answers `unavailable`; a conflict with a concurrent grant or
/// release is not a wait, so even a try-once retries it at once a few times;
/// otherwise a try-once, or a passed deadline, ends the acquire as contended.
#[derive(Default)]
pub(crate) struct Retries {
    epoch_moves: u32,
    conflicts: u32,
}

/// What a grant loop does after a refusal ([`Retries::refused`]).
pub(crate) enum Next {
    /// Try again at once.
    Now,
    /// Wait for a reason to try again (the refusal's).
    Wait,
}

impl Retries {
    /// The epoch record moved under a grant: try again, a few times.
    pub(crate) fn epoch_moved(&mut self) -> Result<(), LockError> {
        self.epoch_moves += 1;
        if self.epoch_moves > 3 {
            return Err(LockError::Unavailable("the epoch record keeps changing".into()));
        }
        Ok(())
    }

    /// A grant of `req` was refused for `reason`.
    pub(crate) fn refused(&mut self, reason: Reason, req: &AcquireRequest) -> Result<Next, LockError> {
        if reason == Reason::LockContended && self.conflicts < 4 {
            self.conflicts += 1;
            return Ok(Next::Now);
        }
        if req.try_once || Instant::now() >= req.deadline {
            return Err(LockError::Contended(reason));
        }
        Ok(Next::Wait)
    }
}

// === impl Store ===

impl Store {
    /// Refuses (`capability_disabled`) an acquire of `slots` slots whose record
    /// kind `cap` the keyspace has not enabled.
    pub(crate) fn gated(&self, cap: Capability, slots: u32) -> Result<(), LockError> {
        if self.guard().enabled(cap) {
            return Ok(());
        }
        Err(LockError::CapabilityDisabled(format!(
            "this acquire holds {slots} slots of the key, a record kind ({}) this keyspace has not enabled yet: a \
             rolling upgrade is not finished (lockctl upgrade enable {})",
            cap.as_str(),
            cap.as_str()
        )))
    }

    /// Ends session `sid` after a grant on it whose outcome etcd never confirmed,
    /// while attempt fences are not enabled: without a fence nothing can tell
    /// whether it committed, so the session goes (its holder learns it at its next
    /// keepalive, `session_expired`) rather than keep a hold its holder does not
    /// know. Tried in the background for up to a minute.
    pub(crate) fn end_unfenced(self: &Arc<Self>, sid: SessionId) {
        let store = self.clone();
        tokio::spawn(async move {
            let until = Instant::now() + std::time::Duration::from_secs(60);
            loop {
                match store.cluster().call(store.cluster().client().lease_revoke(sid.lease())).await {
                    Ok(_) => break,
                    Err(e) if e.to_string().contains("lease not found") => break,
                    Err(_) if Instant::now() < until => tokio::time::sleep(std::time::Duration::from_millis(500)).await,
                    Err(e) => {
                        tracing::error!(error = %e, "a session whose grant outcome is unknown could not be ended; it lives until its holder stops renewing it");
                        break;
                    }
                }
            }
            store.forget_session(sid).await;
        });
    }

    /// Acquires `req.key`, waiting up to its deadline. A grant that commits after
    /// `cancel` fired is released before this returns `Cancelled`.
    pub async fn acquire(
        self: &Arc<Self>,
        req: &AcquireRequest,
        cancel: &CancellationToken,
    ) -> Result<Grant, LockError> {
        // Quotas first (`quota`): over one, nothing is opened or granted.
        let _admitted = self.runtime().quotas().admit(self, req.key.namespace(), req.session.is_none())?;
        let (mut g, opened) = self
            .in_session(req, async |sid, rec, indexed| {
                let req = indexed_on(req, indexed);
                self.acquire_in(&req, sid, rec, cancel).await
            })
            .await?;
        g.new_session = opened;
        if cancel.is_cancelled() {
            // The caller left while the grant committed: release it at once.
            self.undo(req, &g).await;
            return Err(LockError::Cancelled);
        }
        Ok(g)
    }

    /// Runs `body` on the request's session, or on a session it opens for it:
    /// `body` gets the session and, for an opened one, the record its grant
    /// transaction must put. Also answers whether it opened one. An opened session
    /// is renewed while `body` runs (the caller cannot: it learns the session only
    /// from the answer) and revoked if `body` fails. `body` also learns whether the
    /// session is one an acquire opened (this one, or an earlier one whose answer
    /// named it) or a VM's: its grants index their holds
    /// ([`AcquireRequest::session_indexed`]).
    pub(crate) async fn in_session<T>(
        self: &Arc<Self>,
        req: &AcquireRequest,
        body: impl AsyncFnOnce(SessionId, Option<SessionRecord>, bool) -> Result<T, LockError>,
    ) -> Result<(T, bool), LockError> {
        let mut by_acquire = true;
        // The lease's TTL runs from about when its grant is sent: renewals are
        // counted from here.
        let sent = tokio::time::Instant::now();
        let (sid, new_record) = match req.session {
            Some(sid) => {
                let rec = self.owned_session(sid, req.session_owner.as_ref().unwrap_or(&req.caller)).await?;
                if rec.ttl_s != req.class.ttl_s {
                    return Err(LockError::SessionClassMismatch {
                        session: rec.ttl_s,
                        class: req.class.name.to_string(),
                        class_ttl: req.class.ttl_s,
                    });
                }
                // A VM's session (transparent mode, `vm`) indexes its holds too: a
                // retired one is closed only while its index is empty.
                let of_vm = rec.instance.as_deref().is_some_and(|i| i.starts_with(super::vm::VM_INSTANCE_PREFIX));
                by_acquire = rec.by_acquire || of_vm;
                (sid, None)
            }
            None => (
                self.grant_lease(test_faults::lease_ttl(req.class.name.as_str(), req.class.ttl_s)).await?,
                Some(SessionRecord {
                    by_acquire: true,
                    ..Self::new_record(&req.caller, &req.class, req.key.namespace())
                }),
            ),
        };
        let opened = new_record.is_some();
        // Aborted when `body` ends, and when this future is dropped before that
        // (a dropped handle would leave the task renewing the lease for ever).
        let renew = opened.then(|| {
            let (store, ttl) = (self.clone(), req.class.ttl_s.max(1));
            AbortOnDrop(tokio::spawn(async move {
                // Every third of the TTL counted from the lease's grant and from
                // each renewal's send, not from its answer: a slow answer does not
                // push the next renewal back. Each renewal runs on its own, ended
                // with this task (the set is dropped with it).
                let period = std::time::Duration::from_millis(ttl * 1000 / 3);
                if test_faults::on(TestFault::RenewAfterAnswer) {
                    // PLANTED BUG (holder_safety scenario): a period after each answer.
                    loop {
                        tokio::time::sleep(period).await;
                        let _ = store.cluster().call(store.cluster().client().lease_keep_alive(sid.lease())).await;
                    }
                }
                let mut tick = tokio::time::interval_at(sent + period, period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                let mut inflight = tokio::task::JoinSet::new();
                loop {
                    tick.tick().await;
                    while inflight.try_join_next().is_some() {}
                    let store = store.clone();
                    inflight.spawn(async move {
                        if let Err(e) =
                            store.cluster().call(store.cluster().client().lease_keep_alive(sid.lease())).await
                        {
                            tracing::debug!(error = %e, "renewing a waiting acquire's session failed");
                        }
                    });
                }
            }))
        });
        let indexed = by_acquire && !test_faults::on(TestFault::SessionHoldsUnindexed);
        // PLANTED BUG (holder_safety scenario) when off: an acquire-opened
        // session's holds are not indexed, so its close cannot see them.
        let result = body(sid, new_record, indexed).await;
        drop(renew);
        match result {
            Ok(t) => Ok((t, opened)),
            Err(e) => {
                if opened {
                    self.revoke_quietly(sid).await;
                }
                Err(e)
            }
        }
    }

    /// Releases a grant made for a caller that can no longer receive it.
    pub async fn undo(&self, req: &AcquireRequest, g: &Grant) {
        if g.existing {
            return;
        }
        if g.new_session {
            if req.class.lock_delay_s > 0 {
                // The revoke ends the hold: not an expiry (`delay`).
                self.delay.drop_guard(&req.key.digest(), g.session).await;
            }
            self.revoke_quietly(g.session).await;
        } else if let Some(hold) = &req.hold_id {
            if let Err(e) = self.release_hold(&req.key.digest(), g.session, hold).await {
                tracing::warn!(error = %e, key = %req.key.digest().short(), "could not release an orphaned transparent grant; it ends with its request's reconcile or its session");
            }
        } else if let Err(e) = self.release(&req.key, g.token, &req.caller, Some(g.session)).await {
            tracing::warn!(error = %e, key = %req.key.digest().short(), "could not release an orphaned grant; it ends with its session");
        }
    }

    async fn acquire_in(
        self: &Arc<Self>,
        req: &AcquireRequest,
        sid: SessionId,
        mut new_record: Option<SessionRecord>,
        cancel: &CancellationToken,
    ) -> Result<Grant, LockError> {
        let d = req.key.digest();
        self.watch_policies();
        if req.class.fairness == Fairness::Durable {
            // Waiters queue in etcd instead of this arbiter's memory.
            return self.acquire_durable(req, sid, new_record, cancel).await;
        }
        if test_faults::on(TestFault::SlowQueueEntry) {
            tokio::time::sleep(std::time::Duration::from_millis(400)).await; // TEST SWITCH (handoff scenario)
        }
        let ticket = self.queues().enter(&d);
        if !ticket.is_head() {
            // Others wait here first. An explicit session may already hold the key
            // (idempotent re-acquire) or leak it: answer that without queueing.
            if new_record.is_none() {
                if let Some(r) = self.peek(req, &d, sid).await? {
                    return r;
                }
            }
            if req.try_once {
                return Err(LockError::Contended(Reason::KeyGated));
            }
            ticket.wait_head(req.deadline, cancel).await?;
        }
        // A mutex key granted here, with no release through here since, is most
        // likely still held: wait for its release with an offer (`wait_for_release`).
        if let Some(g) = self.wait_for_release(req, &d, sid, new_record.as_ref(), &ticket, cancel).await? {
            return Ok(g);
        }
        // A re-acquire on the caller's own session of a key with several slots:
        // the grant transaction compares one slot empty, so with that slot free it
        // would commit a second hold for the same session. Its existing hold is the
        // answer (`existing: true`). A mutex needs no read: its one slot is the one
        // compared, and the refusal's reads find the hold.
        if new_record.is_none() && !matches!(self.policies.cached_limit(req.class.name.as_str(), &req.key), Ok(Some(1)))
        {
            if let Some(g) = self.own_hold(req, &d, sid).await? {
                return Ok(g);
            }
        }
        let mut retries = Retries::default();
        // The slot to try: the lowest free one the last refusal saw.
        let mut slot = 0;
        loop {
            match self.try_grant(req, &d, sid, new_record.as_ref(), slot, Fair::Memory).await? {
                Attempt::Granted(g) => {
                    if req.class.max_holders == 1 && !g.existing {
                        self.queues().note_held(&d, HeldBy::of(req, &g, token_revision(&g)));
                    }
                    return Ok(g);
                }
                Attempt::EpochMoved => retries.epoch_moved()?,
                Attempt::Refused { reason, revision, free_slot } => {
                    // The failure branch wrote the session record; later attempts
                    // compare it like any other session.
                    new_record = None;
                    slot = free_slot;
                    if let Next::Now = retries.refused(reason, req)? {
                        continue;
                    }
                    match reason {
                        Reason::KeyGated => {
                            // The session record exists now (the refusal wrote it),
                            // so a release here may hand the key over directly.
                            let posted = self.post_offer(&d, &ticket, req, sid, None);
                            if let Some(g) =
                                self.wait_offered(&d, revision, req.deadline, cancel, &ticket, req, posted).await?
                            {
                                if req.class.max_holders == 1 {
                                    self.queues().note_held(&d, HeldBy::of(req, &g, token_revision(&g)));
                                }
                                return Ok(g);
                            }
                        }
                        Reason::LockContended => super::wait::backoff(req.deadline, cancel).await?,
                        Reason::LockDelay => self.wait_delay(&d, req, sid, cancel).await?,
                    }
                }
            }
        }
    }

    /// A mutex key granted here, with no release through here since, is most
    /// likely still held: instead of a grant transaction that can only be
    /// refused (a raft proposal), wait for the holder's release with an offer,
    /// so that release hands the key over in its own transaction. A release
    /// anywhere shows in the watch of the holders from the wait's revision.
    ///
    /// When the grant here was another session's and another caller's
    /// (`HeldBy`), nothing but the key's limit can change that, and the limit
    /// comes from the policy cache while the policy watch keeps it fresh
    /// (`policy_watch`): the head waits from the grant's revision with no read
    /// at all (on a hot key, one etcd round trip fewer per hand-over).
    ///
    /// Otherwise it reads the holders (no proposal; it answers an idempotent
    /// re-acquire and a leak) and the authoritative limit (`lock::policy`: the
    /// registry's may be behind a `lockctl limit` change, and a key with free
    /// slots must be granted, not waited for), and waits from that read's
    /// revision. The offer is posted before the read, not after it: a release
    /// that arrives while the read is in flight then still hands the key over
    /// in one transaction. Posted after, such a release found no offer and the
    /// key took two commits (the release's, then the waiter's grant after its
    /// watch woke it): 45 % of a hot key's hand-overs (docs/BENCHMARKS.md). A
    /// read that says not to wait ends the offer first (`settle_offer`): a
    /// releaser that took it meanwhile decides, and its grant is the answer.
    ///
    /// Answers the grant when a release handed the key over (or a read found
    /// the answer), `None` when the caller goes on to its grant transaction.
    async fn wait_for_release(
        self: &Arc<Self>,
        req: &AcquireRequest,
        d: &KeyDigest,
        sid: SessionId,
        new_record: Option<&SessionRecord>,
        ticket: &super::wait::Ticket<'_>,
        cancel: &CancellationToken,
    ) -> Result<Option<Grant>, LockError> {
        let Some(held) = self.queues().held_by(d).filter(|_| !req.try_once) else { return Ok(None) };
        // An acquire that opened its session (the header-only path) offers the
        // session's record with it: the releaser's transaction puts it beside
        // the hold, so its session costs no refused grant first.
        let record = new_record;
        if self.may_skip_held_read(req, sid, held) {
            let posted = self.post_offer(d, ticket, req, sid, record);
            let waited = self.wait_offered(d, held.revision, req.deadline, cancel, ticket, req, posted).await?;
            if let Some(g) = waited {
                self.queues().note_held(d, HeldBy::of(req, &g, token_revision(&g)));
                return Ok(Some(g));
            }
        } else {
            let late = test_faults::on(TestFault::OfferAfterRead);
            let posted = (!late).then(|| self.post_offer(d, ticket, req, sid, record));
            let next = self.held_read(req, d, sid).await;
            if let Ok(HeldRead::Wait(revision)) = next {
                // PLANTED BUG (handoff scenario) when `late`: the offer only now.
                let posted = posted.unwrap_or_else(|| self.post_offer(d, ticket, req, sid, record));
                let waited = self.wait_offered(d, revision, req.deadline, cancel, ticket, req, posted).await?;
                if let Some(g) = waited {
                    self.queues().note_held(d, HeldBy::of(req, &g, token_revision(&g)));
                    return Ok(Some(g));
                }
            } else {
                let settled = match posted {
                    Some(p) => self.settle_offer(d, ticket, p).await,
                    None => None,
                };
                if let Some(g) = settled {
                    self.queues().note_held(d, HeldBy::of(req, &g, token_revision(&g)));
                    return Ok(Some(g));
                }
                if let HeldRead::Answer(answer) = next? {
                    return answer.map(Some);
                }
            }
        }
        Ok(None)
    }

    /// Whether the head of `d`, which this arbiter granted as `held`, may wait
    /// without reading (see [`Store::acquire_in`]): the read could not answer
    /// `req` on `sid` (another session and caller) and the key's limit is 1 by
    /// the policy cache while the policy watch keeps it fresh.
    fn may_skip_held_read(&self, req: &AcquireRequest, sid: SessionId, held: HeldBy) -> bool {
        if test_faults::on(TestFault::SlowHeldRead) || test_faults::on(TestFault::OfferAfterRead) {
            return false; // TEST SWITCHES (handoff scenario) exercise the read
        }
        // PLANTED BUG (held_memo scenario) when on: even the holder's own session
        // and caller skip the read.
        let anyone = test_faults::on(TestFault::SkipReadForAnyone);
        (anyone || !held.may_answer(req, sid))
            && self.policies_watched()
            && matches!(self.policies.cached_limit(req.class.name.as_str(), &req.key), Ok(Some(1)))
    }

    /// The read of a mutex key's holders and authoritative limit that
    /// [`Store::acquire_in`] makes for a key granted here (see there): what it says
    /// to do next.
    async fn held_read(&self, req: &AcquireRequest, d: &KeyDigest, sid: SessionId) -> Result<HeldRead, LockError> {
        if test_faults::on(TestFault::SlowHeldRead) {
            tokio::time::sleep(std::time::Duration::from_secs(3)).await; // TEST SWITCH (handoff scenario)
        }
        let policy_key = self.cluster.keys().class_policy(req.class.name.as_str());
        let reads = |b: &mut TxnBuilder| {
            (b.read(Branch::Success, self.cluster.keys().holds(d), prefix()), b.read(Branch::Success, policy_key, None))
        };
        let Some((revision, a, (holders, policy))) =
            timed(Step::HeldRead, self.checked_read(req.deadline, reads)).await?
        else {
            // The epoch record moved: the grant transaction decides.
            return Ok(HeldRead::Grant);
        };
        let (holders, policy) = (a.get(holders), a.get(policy));
        let limit = policy
            .and_then(|p| p.kvs().first())
            .and_then(|kv| serde_json::from_slice::<lockmesh_core::policy::ClassPolicy>(kv.value()).ok())
            .map(|p| p.limit);
        let (Some(holders), Some(1)) = (holders, limit) else {
            return Ok(HeldRead::Grant);
        };
        if let Some(answer) = self.classify_holders(req, sid, holders.kvs()) {
            return Ok(HeldRead::Answer(answer));
        }
        Ok(if holders.kvs().is_empty() { HeldRead::Grant } else { HeldRead::Wait(revision) })
    }

    /// Reads the holders once to answer an idempotent re-acquire or a leak.
    pub(crate) async fn peek(
        &self,
        req: &AcquireRequest,
        d: &KeyDigest,
        sid: SessionId,
    ) -> Result<Option<Result<Grant, LockError>>, LockError> {
        let read = |b: &mut TxnBuilder| b.read(Branch::Success, self.cluster.keys().holds(d), prefix());
        let Some((_, a, holders)) = self.checked_read(req.deadline, read).await? else { return Ok(None) };
        Ok(a.get(holders).and_then(|holders| self.classify_holders(req, sid, holders.kvs())))
    }

    /// The hold of session `sid` on `d` with the request's hold id, as an
    /// `existing` grant (one read, no proposal).
    async fn own_hold(&self, req: &AcquireRequest, d: &KeyDigest, sid: SessionId) -> Result<Option<Grant>, LockError> {
        let read = |b: &mut TxnBuilder| b.read(Branch::Success, self.cluster.keys().holds(d), prefix());
        let Some((_, a, holders)) = self.checked_read(req.deadline, read).await? else { return Ok(None) };
        let kvs = a.get(holders).map_or(&[][..], |g| g.kvs());
        for kv in kvs.iter().filter(|kv| kv.lease() == sid.lease()) {
            let Some(h) = hold_of(kv) else { continue };
            if h.hold_id == req.hold_id {
                return existing_grant(req, sid, kv, h.epoch).map(Some);
            }
        }
        Ok(None)
    }

    /// The `want` lowest slots below `n` that hold nothing now (one read); the
    /// lowest `want` slots when fewer are free, so that the grant transaction
    /// fails and its refusal says why. A k-permit grant compares each one empty.
    async fn free_slots(&self, d: &KeyDigest, n: u32, want: u32) -> Result<Vec<u32>, LockError> {
        let opts = Some(GetOptions::new().with_prefix().with_keys_only());
        let r = self.cluster.call(self.cluster.client().get(self.cluster.keys().holds(d), opts)).await?;
        let taken: std::collections::HashSet<u32> =
            r.kvs().iter().filter_map(|kv| self.cluster.keys().slot_of(kv.key())).collect();
        let free: Vec<u32> = (0..n).filter(|s| !taken.contains(s)).take(want as usize).collect();
        Ok(if free.len() == want as usize { free } else { (0..want).collect() })
    }

    /// Deletes the holds `hold_keys` this arbiter's grant on session `sid`
    /// committed at `revision`, compared by its create revision: the key may be
    /// another grant's by now (released, expired, granted again), and a delete by
    /// name would free it. The grant's ends go with them: its exclusion record
    /// and the session's hold index key (which would otherwise keep an
    /// acquire-opened session from closing at its last release). Every grant
    /// taken back goes here: one refused after its commit, a hand-off that failed
    /// its checks, a hand-off whose waiter left.
    pub(crate) async fn take_back(&self, hold_keys: &[String], revision: i64, sid: SessionId) {
        let cmp: Vec<Compare> =
            hold_keys.iter().map(|h| Compare::create_revision(h.as_str(), CompareOp::Equal, revision)).collect();
        // With its lock-delay guard (`delay`): a grant taken back is no expiry.
        let mut ops: Vec<TxnOp> = hold_keys.iter().map(|h| TxnOp::delete(h.as_str(), None::<DeleteOptions>)).collect();
        let mut digests: Vec<KeyDigest> =
            hold_keys.iter().filter_map(|h| self.cluster.keys().digest_of_hold(h.as_bytes())).collect();
        digests.dedup();
        for d in digests {
            ops.push(TxnOp::delete(self.cluster.keys().delay_guard(&d), None::<DeleteOptions>));
            // PLANTED BUG (holder_safety scenario) when on: the index key stays.
            let lease = (!test_faults::on(TestFault::TakeBackKeepsIndex)).then_some(sid.lease());
            ops.extend(end_ops(self.cluster.keys(), &d, revision, lease));
        }
        let txn = Txn::new().when(cmp).and_then(ops);
        match self.cluster.call(self.cluster.client().txn(txn)).await {
            Ok(r) if r.succeeded() => tracing::info!(revision, "took back a grant whose answer was not a grant"),
            Ok(_) => tracing::debug!(revision, "a grant to take back had ended already"),
            Err(e) => {
                tracing::warn!(error = %e, "could not take back a grant refused after its commit; it ends with its session")
            }
        }
    }

    pub(crate) fn classify_holders(
        &self,
        req: &AcquireRequest,
        sid: SessionId,
        kvs: &[KeyValue],
    ) -> Option<Result<Grant, LockError>> {
        for kv in kvs {
            let Some(h) = hold_of(kv) else { continue };
            let own = kv.lease() == sid.lease() || test_faults::on(TestFault::ExistingAnySession); // PLANTED BUG when on.
            if own && h.hold_id == req.hold_id {
                return Some(existing_grant(req, sid, kv, h.epoch));
            }
            if req.caller.instance.is_some() && h.owner == req.caller.identity && h.instance == req.caller.instance {
                return Some(Err(LockError::Leaked));
            }
        }
        None
    }

    /// One grant transaction, into holder slot `slot` of a key with at most
    /// `max_holders` = N holders. It compares that the slot is empty and that no
    /// hold exists at slot N or above; since holds exist only as slot keys, the key
    /// then has at most N holders at the commit, however many arbiters race. For
    /// N = 1 the two compares say "no holder at all".
    ///
    /// `fair` adds the durable queue's compares (`lock::durable`): an arrival is
    /// granted only while no durable waiter is queued, a waiter only while it is
    /// the oldest, and its waiter key goes in the same transaction.
    pub(crate) async fn try_grant(
        self: &Arc<Self>,
        req: &AcquireRequest,
        d: &KeyDigest,
        sid: SessionId,
        new_record: Option<&SessionRecord>,
        slot: u32,
        fair: Fair<'_>,
    ) -> Result<Attempt, LockError> {
        // The authoritative class and limit (the policy records), compared.
        let basis = self.grant_basis(req).await?;
        let ep = &basis.ep;
        let k = self.cluster.keys();
        let (n, want) = grant_size(req, &basis.gate)?;
        if want > 1 {
            self.gated(Capability::MultiSlotHolds, want)?;
        }
        let (slots, slot_compares) = match self.grant_slots(d, sid, (n, want), slot).await? {
            Ok(slots) => slots,
            Err(refused) => return Ok(refused),
        };
        let lease = PutOptions::new().with_lease(sid.lease());
        // The attempt's fence (`Keys::attempt`), for a session the caller keeps: an
        // answer etcd never gives is resolved by fencing the attempt off.
        let attempt = (new_record.is_none() && self.guard().enabled(Capability::AttemptFences)).then(attempt_id);
        // Lock-delay (`delay`): a mutex of a class with a delay puts its guard and
        // compares neither a guard nor a delay record left.
        let delay = if n == 1
            && !test_faults::on(TestFault::SkipLockDelay)
            && self.guard().enabled(Capability::LockDelayGuards)
        {
            req.class.lock_delay_s
        } else {
            0
        };
        // Every hold the grant puts, with the namespace the quota counts it in.
        let holds: Vec<(String, &str)> = slots.iter().map(|(_, name)| (name.clone(), req.key.namespace())).collect();
        let key = KeyGrant {
            d,
            slots,
            slot_compares,
            hold: hold_record(req, ep.epoch, want, None, attempt.as_deref())?,
            // Exclusion (`Keys::exclusion`): an exclusive grant puts the record,
            // every grant compares it absent, whatever the limit is now.
            exclusion: exclusion_ops(k, d, req, &lease, self.guard()),
            // An acquire-opened session's hold index (`Keys::hold_index`).
            indexed: req.session_indexed && self.guard().enabled(Capability::SessionHoldIndex),
            delay: (delay > 0).then(|| self.delay.grant_ops(d, sid)),
            fair,
            count_after: super::shadow::wants_count(&req.class, n),
        };
        let spec = GrantTxn {
            keys: k,
            sid,
            opened: new_record.map(serde_json::to_vec).transpose().map_err(internal)?,
            // PLANTED BUG (release gate) when skipped: no epoch compare.
            epoch_rev: (!test_faults::on(TestFault::SkipEpochCompare)).then_some(ep.mod_revision),
            attempt: attempt.as_deref(),
            each: vec![key],
            clock: basis.clock,
            advert: basis.advert.as_ref(),
            gate: &basis.gate,
        };
        let sending = Sending {
            basis: &basis,
            sid,
            new_record,
            attempt: attempt.as_deref(),
            first: d,
            holds: &holds,
            deadline: req.deadline,
        };
        let (sent, reads) = self.send_grant(&spec, sending).await?;
        let (a, revision) = match sent {
            Sent::Granted { token, answer } => {
                let held = reads.count[0].and_then(|c| answer.get(c)).map(|g| u64::try_from(g.count()).unwrap_or(0));
                self.runtime().shadow().after_grant(self, &req.class, &req.key, held, n);
                return Ok(Attempt::Granted(Grant::new(req, token, sid, want)));
            }
            Sent::Resolved(g) => return Ok(Attempt::Granted(Grant { ttl_s: req.class.ttl_s, ..g })),
            Sent::Moved => return Ok(Attempt::EpochMoved),
            Sent::Refused { answer, revision } => (answer, revision),
        };
        self.refusal(req, d, sid, (n, want, delay), &a, &reads, revision).await
    }

    /// The slots a grant of `want` of `n` takes (slot `slot` for one, free ones
    /// read for several) and the compares that guard them; `Err`: a refusal
    /// without a transaction (only under a planted bug).
    async fn grant_slots(
        &self,
        d: &KeyDigest,
        sid: SessionId,
        (n, want): (u32, u32),
        slot: u32,
    ) -> Result<Result<(Vec<(u32, String)>, SlotCompares), Attempt>, LockError> {
        let k = self.cluster.keys();
        if test_faults::on(TestFault::CountBeforeLock) {
            // PLANTED BUG (release gate): count the holders, then lock without comparing.
            let opts = Some(GetOptions::new().with_prefix().with_count_only());
            let c = self.cluster.call(self.cluster.client().get(k.holds(d), opts)).await?;
            let revision = c.header().map_or(0, |h| h.revision());
            if c.count() + i64::from(want) > i64::from(n) {
                return Ok(Err(Attempt::Refused { reason: Reason::KeyGated, revision, free_slot: 0 }));
            }
            let base = 1000 + u32::try_from(sid.lease().rem_euclid(8000)).unwrap_or(0) * 64;
            return Ok(Ok(((0..want).map(|i| (base + i, k.slot(d, base + i))).collect(), SlotCompares::Skipped)));
        }
        let slot_nos = if want == 1 { vec![slot.min(n - 1)] } else { self.free_slots(d, n, want).await? };
        Ok(Ok((slot_nos.iter().map(|s| (*s, k.slot(d, *s))).collect(), SlotCompares::Limit(n))))
    }

    /// What a refused grant of one key means (`a`, read through `reads`, at
    /// `revision`): the caller's own hold (an idempotent re-acquire) or a leak,
    /// an exclusive hold, a lock-delay, a slot freed meanwhile (retry at once) or
    /// the key at its limit (wait).
    #[allow(clippy::too_many_arguments)]
    async fn refusal(
        self: &Arc<Self>,
        req: &AcquireRequest,
        d: &KeyDigest,
        sid: SessionId,
        (n, want, delay): (u32, u32, u64),
        a: &crate::engine::txn::Answer,
        reads: &crate::engine::grant::GrantReads,
        revision: i64,
    ) -> Result<Attempt, LockError> {
        let k = self.cluster.keys();
        let holders = a.must(reads.holders[0])?;
        let delay_kept = reads.delay[0].is_some_and(|[guard, record]| found(a.get(guard)) || found(a.get(record)));
        let excluded = reads.exclusion[0].is_some_and(|x| found(a.get(x)));
        if let Some(r) = self.classify_holders(req, sid, holders.kvs()) {
            return r.map(Attempt::Granted);
        }
        if excluded {
            // An exclusive hold stands, whatever slots the limit leaves free.
            return Ok(Attempt::Refused { reason: Reason::KeyGated, revision, free_slot: 0 });
        }
        if delay_kept && holders.kvs().is_empty() {
            // No holder, and a guard or a delay record: the last hold ended without
            // a release. Turned into the delay here if no arbiter has yet; a guard
            // of a closed session is dropped and the grant retried at once.
            return Ok(match self.delay.left(d, delay).await? {
                Some(_) => Attempt::Refused { reason: Reason::LockDelay, revision, free_slot: 0 },
                None => Attempt::Refused { reason: Reason::LockContended, revision, free_slot: 0 },
            });
        }
        let taken: Vec<u32> = holders.kvs().iter().filter_map(|kv| k.slot_of(kv.key())).collect();
        let free_slot = (0..n).find(|s| !taken.contains(s));
        let free = (0..n).filter(|s| !taken.contains(s)).count();
        let within = holders.kvs().iter().all(|kv| kv.key() < k.slot(d, n).as_bytes());
        // Enough free slots under the limit means a concurrent grant or release
        // moved under us: retry at once. Otherwise the key is at its limit (for
        // this ask: k permits wait until k slots are free at once).
        match free_slot {
            Some(s) if within && free >= want as usize => {
                Ok(Attempt::Refused { reason: Reason::LockContended, revision, free_slot: s })
            }
            _ => {
                let holders = u32::try_from(holders.kvs().len()).unwrap_or(u32::MAX);
                self.runtime().shadow().after_gated(
                    self,
                    &req.class,
                    &req.key,
                    holders,
                    n,
                    &(sid.lease(), d.clone(), req.deadline),
                );
                Ok(Attempt::Refused { reason: Reason::KeyGated, revision, free_slot: 0 })
            }
        }
    }

    /// Resolves grant attempt `attempt` of key `d` on session `sid`, whose
    /// transaction etcd never confirmed (`err`): a read proves nothing (the
    /// transaction may still be in raft and commit after it), so this first puts
    /// the attempt's fence key in a transaction of its own, which also reads the
    /// key's holds. Every grant of the attempt compares that key absent, so after
    /// the fence commits exactly one of the two did: a hold carrying the attempt
    /// id is the grant (answered as granted, after the checks a grant gets), none
    /// means nothing was granted (`err`). Tried until a little after the op
    /// timeout; if etcd never answers, a task keeps fencing in the background and
    /// takes back a grant it finds, so no hold is left on the caller's session
    /// without its holder knowing.
    pub(crate) async fn resolve_attempt(
        self: &Arc<Self>,
        d: &KeyDigest,
        sid: SessionId,
        attempt: &str,
        err: LockError,
    ) -> Result<Grant, LockError> {
        if test_faults::on(TestFault::NoAttemptFence) {
            return Err(err); // PLANTED BUG (holder_safety scenario): the outcome is guessed.
        }
        let until = Instant::now() + self.cluster.op_timeout() * 3;
        loop {
            match self.fence_attempt(d, sid, attempt).await {
                Ok(holds) => return self.attempt_outcome(d, sid, attempt, &holds, err).await,
                Err(_) if Instant::now() < until => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
                Err(e) => {
                    tracing::warn!(error = %e, key = %d.short(), "a grant's outcome is unknown and etcd does not answer; resolving it in the background");
                    let (store, d, attempt) = (self.clone(), d.clone(), attempt.to_owned());
                    tokio::spawn(async move {
                        loop {
                            if let Ok(holds) = store.fence_attempt(&d, sid, &attempt).await {
                                if let Some((slots, rev)) = attempt_holds(&holds, sid, &attempt) {
                                    store.take_back(&slots, rev, sid).await;
                                }
                                return;
                            }
                            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                        }
                    });
                    return Err(err);
                }
            }
        }
    }

    /// Puts attempt `attempt`'s fence key (on the marker lease, if absent) and
    /// reads `d`'s holds in the same transaction.
    async fn fence_attempt(
        &self,
        d: &KeyDigest,
        sid: SessionId,
        attempt: &str,
    ) -> Result<etcd_client::GetResponse, LockError> {
        let (k, lease) = (self.cluster.keys(), self.marker_lease().await?);
        let key = k.attempt(sid, attempt);
        // The fence key put if absent (it may be put already: an earlier try
        // whose answer was lost), and the key's holds read either way.
        let mut b = TxnBuilder::new();
        b.compare(Compare::create_revision(key.as_str(), CompareOp::Equal, 0));
        b.on_success(TxnOp::put(key.as_str(), Vec::<u8>::new(), Some(PutOptions::new().with_lease(lease))));
        let fenced = b.read(Branch::Success, k.holds(d), prefix());
        let already = b.read(Branch::Failure, k.holds(d), prefix());
        let r = match self.cluster.call(self.cluster.client().txn(b.build())).await {
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => {
                self.drop_marker_lease().await;
                return Err(LockError::Unavailable(m));
            }
            r => r?,
        };
        let a = Answer::of(&r);
        a.get(fenced).or(a.get(already)).cloned().ok_or_else(|| internal("an attempt's fence without its read"))
    }

    /// What a fenced attempt did, from the holds its fence read.
    async fn attempt_outcome(
        &self,
        d: &KeyDigest,
        sid: SessionId,
        attempt: &str,
        holds: &etcd_client::GetResponse,
        err: LockError,
    ) -> Result<Grant, LockError> {
        let Some((slots, rev)) = attempt_holds(holds, sid, attempt) else {
            tracing::info!(key = %d.short(), "a grant whose answer was lost did not commit (its attempt is fenced off)");
            return Err(err);
        };
        let Some(hold) = holds.kvs().iter().find(|kv| kv.create_revision() == rev).and_then(hold_of) else {
            return Err(err);
        };
        // The checks a grant's answer gets (`settle`): not sealed, raft at mark.
        // A below-mark term seals; `unsealed` then refuses.
        self.seal().observe_term(holds.header().map_or(0, |h| h.raft_term()), hold.epoch);
        if let Err(e) = self.unsealed() {
            self.take_back(&slots, rev, sid).await;
            return Err(e);
        }
        if let Err(e) = self.epoch().raft_at_mark().await {
            self.take_back(&slots, rev, sid).await;
            return Err(e);
        }
        tracing::info!(key = %d.short(), "a grant whose answer was lost had committed; answered as granted");
        let token = FencingToken::mint(hold.epoch, u64::try_from(rev).unwrap_or(u64::MAX)).map_err(internal)?;
        Ok(Grant {
            token,
            session: sid,
            ttl_s: 0,
            class: hold.class,
            existing: false,
            new_session: false,
            permits: u32::try_from(slots.len()).unwrap_or(1),
            mode: hold.mode,
        })
    }

    /// The clock mark a release or close in `epoch` compares (`engine::clock`).
    pub(crate) fn end_clock(&self, epoch: u64) -> Option<i64> {
        if test_faults::on(TestFault::ReleaseSkipsClock) {
            return None; // PLANTED BUG (edges_grant scenario).
        }
        self.seal().clock_floor(epoch)
    }

    /// Reads `reads` for an answer built from a read rather than from a refused
    /// grant (an existing hold found by a read: an idempotent re-acquire, a
    /// leak), checked as a refused grant's failure branch is: in one transaction
    /// with the epoch record and the grant clock, this arbiter unsealed before and
    /// after, the answer's cluster, its revision and raft term against the marks,
    /// the grant clock at or above its mark. A hold a restore brought back is
    /// never answered as held: the answer's revision, term or clock is behind, and
    /// the arbiter seals. Returns the read's revision and the reads in order, or
    /// `None` when the epoch record moved (the caller goes on to the grant
    /// transaction, which decides with every check).
    pub(crate) async fn checked_read<H>(
        &self,
        deadline: tokio::time::Instant,
        add: impl FnOnce(&mut TxnBuilder) -> H,
    ) -> Result<Option<(i64, Answer, H)>, LockError> {
        let mut b = TxnBuilder::new();
        let reads = add(&mut b);
        if test_faults::on(TestFault::UncheckedExistingRead) {
            // PLANTED BUG (restore scenario) when on: the reads alone.
            let r = self.cluster.call_by(deadline, self.cluster.client().txn(b.build())).await?;
            return Ok(Some((r.header().map_or(0, |h| h.revision()), Answer::of(&r), reads)));
        }
        self.unsealed()?;
        let ep = self.epoch().state().await?;
        if let Some(why) = &ep.sealed {
            return Err(LockError::Sealed(why.clone()));
        }
        let floor = self.seal().revision_floor();
        let clock = self.seal().clock_floor(ep.epoch);
        let epoch_read = b.read(Branch::Success, self.cluster.keys().epoch(), None);
        let clock_read = clock.map(|c| (c, b.read(Branch::Success, self.cluster.keys().clock(), None)));
        let r = self.cluster.call_by(deadline, self.cluster.client().txn(b.build())).await?;
        let header = r.header().ok_or_else(|| internal("etcd txn response without header"))?;
        let (revision, cluster) = (header.revision(), header.cluster_id());
        if revision < floor {
            self.seal().seal(
                super::seal::SealReason::RevisionBehindMark,
                format!("read revision {revision} below mark {floor}"),
            );
        }
        self.seal().observe_term(header.raft_term(), ep.epoch);
        self.epoch().check_cluster(&ep, Some(cluster)).and_then(|()| self.unsealed())?;
        let a = Answer::of(&r);
        if self.refusal_moved(&ep, a.must(epoch_read)?, clock_read.map(|(c, read)| (c, a.get(read))))? {
            return Ok(None);
        }
        self.unsealed()?;
        self.seal().observe_revision(revision, ep.epoch);
        Ok(Some((revision, a, reads)))
    }

    /// The epoch and grant-clock reads of a refused grant (`clock`: this
    /// arbiter's mark and the clock record read): `true` when the epoch record
    /// moved (try again with the new one); sealed when the clock went back with
    /// the epoch unchanged, a restore (a linearizable answer of the cluster that
    /// serves the grants).
    pub(crate) fn refusal_moved(
        &self,
        ep: &super::EpochState,
        epoch: &etcd_client::GetResponse,
        clock: Option<(i64, Option<&etcd_client::GetResponse>)>,
    ) -> Result<bool, LockError> {
        if epoch.kvs().first().map(KeyValue::mod_revision) != Some(ep.mod_revision) {
            self.epoch().forget();
            return Ok(true);
        }
        if let Some((c, read)) = clock {
            let at = read.and_then(|g| g.kvs().first().map(KeyValue::mod_revision)).unwrap_or(0);
            if at < c {
                let why = format!("grant clock {at} below mark {c}");
                self.seal().seal(super::seal::SealReason::ClockBehindMark, why.clone());
                return Err(LockError::Sealed(format!("clock_behind_mark: {why}")));
            }
        }
        Ok(false)
    }

    /// The checks after a grant transaction answered that may still take its holds
    /// `slots` back: the answer's revision against this arbiter's floor, the
    /// cluster that answered, the seal and, for a commit, the raft position (a
    /// bumped restore passes the floor). Returns the answer's revision.
    pub(crate) async fn settle(
        &self,
        ep: &super::EpochState,
        floor: i64,
        clock: Option<i64>,
        r: &crate::engine::txn::Answer,
        slots: &[String],
        sid: SessionId,
    ) -> Result<i64, LockError> {
        let answered = Instant::now();
        let header = r.header().ok_or_else(|| internal("etcd txn response without header"))?;
        let (revision, cluster) = (header.revision, header.cluster_id);
        if r.succeeded() && clock.is_some() {
            self.seal().observe_clock(revision, ep.epoch);
        }
        if revision < floor {
            self.seal().seal(
                super::seal::SealReason::RevisionBehindMark,
                format!("grant revision {revision} below mark {floor}"),
            );
        }
        if r.succeeded() {
            // A below-mark term seals; `unsealed` then refuses and takes back.
            self.seal().observe_term(header.raft_term, ep.epoch);
        }
        if let Err(e) = self.epoch().check_cluster(ep, Some(cluster)).and_then(|()| self.unsealed()) {
            if r.succeeded() {
                self.take_back(slots, revision, sid).await;
            }
            return Err(e);
        }
        if r.succeeded() {
            if let Err(e) = self.epoch().raft_at_mark_since(answered).await {
                self.take_back(slots, revision, sid).await;
                return Err(e);
            }
        }
        self.seal().observe_revision(revision, ep.epoch);
        Ok(revision)
    }

    /// Releases the grant `token` of `key`. A token that is not a current grant
    /// releases nothing (`NotHolder`); a retried release of a finished grant can
    /// never delete a successor, because the compare is on the hold's create
    /// revision.
    pub async fn release(
        &self,
        key: &LockKey,
        token: FencingToken,
        caller: &Caller,
        session: Option<SessionId>,
    ) -> Result<(), LockError> {
        if let Some(sid) = session {
            self.owned_session(sid, caller).await?;
        }
        self.epoch().ensure_holds(token.epoch()).await?;
        let d = key.digest();
        let rev = i64::try_from(token.revision()).map_err(internal)?;
        let marker = lockmesh_keyspace::ReleaseMarker {
            epoch: Some(token.epoch()),
            released_ms: now_ms(),
            revision: rev,
            transparent: false,
        };
        let marker = serde_json::to_string(&marker).map_err(internal)?;
        // A token of a prior epoch (still honoured after a soft advance) goes the
        // read path, which compares the hold's recorded epoch with the token's: the
        // create revision alone names a grant only within one epoch.
        let ep = self.epoch().state().await?;
        let current = ep.epoch == token.epoch();
        if let Some(sid) = session.filter(|_| current) {
            // One round trip for the common case: a mutex hold (slot 0) on the
            // caller's own session, whose owner was checked above. A hold this
            // arbiter handed over sits under the slot's other name.
            let mut slot0 = self.cluster.keys().slot(&d, 0).into_bytes();
            if self.queues().take_handed_name(&d, rev) {
                slot0 = Keys::other_name(&slot0);
            }
            let cmp = own_slot_compares(self.cluster.keys(), &d, &slot0, rev, sid, ep.mod_revision);
            if self.release_txn(&d, slot0, cmp, &marker, (rev, sid.lease())).await? {
                return Ok(());
            }
        }
        let holds = self
            .cluster
            .call(self.cluster.client().get(self.cluster.keys().holds(&d), Some(GetOptions::new().with_prefix())))
            .await?;
        // Every slot of the grant: one for most, k for `x-lock-permits`, N for an
        // exclusive hold; all put by its one transaction, so all at its revision.
        let grant: Vec<&KeyValue> = holds.kvs().iter().filter(|kv| kv.create_revision() == rev).collect();
        let kv = grant.first().ok_or(LockError::NotHolder)?;
        let hold = hold_of(kv).ok_or(LockError::NotHolder)?;
        if hold.epoch != token.epoch() {
            return Err(LockError::NotHolder);
        }
        // Only the holder releases (a token seen in transit is not enough), and
        // through its own session when it names one. A transparent hold (its
        // request's, `hold_id`) ends with its request, through its filter's
        // internal route (`release_hold`), never through the lock API: its
        // request may still be at the upstream under its token.
        let transparent = hold.hold_id.is_some() && !test_faults::on(TestFault::ApiReleasesTransparent);
        if transparent || hold.owner != caller.identity || session.is_some_and(|s| s.lease() != kv.lease()) {
            return Err(LockError::NotHolder);
        }
        if grant.len() > 1 {
            return if self.release_slots(&d, &grant, rev, &marker).await? {
                Ok(())
            } else {
                Err(LockError::NotHolder)
            };
        }
        let cmp = vec![
            Compare::create_revision(kv.key(), CompareOp::Equal, rev),
            Compare::mod_revision(kv.key(), CompareOp::Equal, kv.mod_revision()),
        ];
        if self.release_txn(&d, kv.key().to_vec(), cmp, &marker, (rev, kv.lease())).await? {
            Ok(())
        } else {
            Err(LockError::NotHolder)
        }
    }

    /// Deletes every slot of a multi-slot grant (`grant`, created at `rev`) in one
    /// transaction, each compared by its create revision, with the release
    /// marker. No hand-off: the key's waiters look again (one hint).
    pub(crate) async fn release_slots(
        &self,
        d: &KeyDigest,
        grant: &[&KeyValue],
        rev: i64,
        marker: &str,
    ) -> Result<bool, LockError> {
        // One compare per slot (k of them, at most 64, within etcd's 128 per
        // transaction): its create revision is the grant's, so a slot freed and
        // taken again since the read is another grant's and fails the compare.
        let cmp = grant.iter().map(|kv| Compare::create_revision(kv.key(), CompareOp::Equal, rev)).collect();
        let mut ops: Vec<TxnOp> = grant.iter().map(|kv| TxnOp::delete(kv.key(), None::<DeleteOptions>)).collect();
        ops.extend(end_ops(self.cluster.keys(), d, rev, grant.first().map(|kv| kv.lease())));
        self.release_plain(d, cmp, ops, marker).await
    }

    /// Deletes `hold_key` under `cmp` and writes the release marker in the same
    /// transaction (so an audit reader tells a release from an expiry). Returns
    /// whether the compares held.
    ///
    /// When the key's gated head waiter on this arbiter posted an offer, the
    /// release first tries to hand the slot over in the same transaction
    /// ([`Store::handoff`]); whatever stops the hand-off, the plain release still
    /// runs: a hand-off never makes a release fail.
    pub(crate) async fn release_txn(
        &self,
        d: &KeyDigest,
        hold_key: Vec<u8>,
        cmp: Vec<Compare>,
        marker: &str,
        (rev, lease): (i64, i64),
    ) -> Result<bool, LockError> {
        let ends = end_ops(self.cluster.keys(), d, rev, Some(lease));
        let offer = match self.queues().take_offer(d) {
            Some(o) => Some(o),
            None => self.queues().offer_within_grace(d).await,
        };
        if let Some(offer) = offer {
            // A waiter on the releaser's own session (a transparent VM's other
            // request) is not handed the slot here: its index key would be deleted
            // and put in one transaction, which etcd refuses.
            let outcome = if offer.sid.lease() == lease && offer.req.session_indexed {
                Ok(HandOff::NotDone)
            } else {
                self.handoff(d, &hold_key, &cmp, marker, &ends, &offer).await
            };
            let c = &super::wait::HANDOFFS;
            let (answer, result, counter) = match outcome {
                Ok(HandOff::Handed(g)) => (Handed::Granted(g), Some(Ok(true)), &c.granted),
                Ok(HandOff::ReleasedOnly) => (Handed::Retry, Some(Ok(true)), &c.released_only),
                Ok(HandOff::NotDone) => (Handed::Retry, None, &c.not_done),
                // Unknown outcome: the caller retries its release like any other;
                // the waiter's own transaction finds its hold if this committed.
                Err(e) => (Handed::Retry, Some(Err(e)), &c.failed),
            };
            counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let handed = matches!(answer, Handed::Granted(_));
            self.queues().chain(d, handed);
            if let Err(Handed::Granted(g)) = offer.tx.send(answer) {
                // The waiter is gone (its task ended): take its grant back.
                self.drop_grant(d, &g).await;
            }
            if let Some(r) = result {
                // Handed over: the key is held again and its waiter answered; the
                // queue moves on when that waiter leaves it.
                if matches!(r, Ok(true)) && !handed {
                    self.queues().hint(d);
                }
                return r;
            }
        }
        let mut deletes = vec![TxnOp::delete(hold_key, None::<DeleteOptions>)];
        deletes.extend(ends);
        self.release_plain(d, cmp, deletes, marker).await
    }

    /// The release transaction: `deletes` (the grant's slot keys) under `cmp`, the
    /// release marker on this arbiter's marker lease, and the key's lock-delay
    /// guard deleted (`delay`: a release is no reason for a delay; absent for
    /// classes without one, so no write). Returns whether the compares held; the
    /// key's waiters here are told to look again when they did.
    async fn release_plain(
        &self,
        d: &KeyDigest,
        cmp: Vec<Compare>,
        deletes: Vec<TxnOp>,
        marker: &str,
    ) -> Result<bool, LockError> {
        // The grant clock, as in a grant (`commit_end`): a failed clock compare
        // writes nothing and seals.
        let (answer, ()) = self
            .commit_end(Some(Step::ReleaseTxn), "a release", Some(d), |b, lease| {
                b.compares(cmp.iter().cloned());
                b.on_success_all(deletes.iter().cloned());
                b.on_success(TxnOp::put(
                    self.cluster.keys().release_marker(d),
                    marker,
                    Some(PutOptions::new().with_lease(lease)),
                ));
                b.on_success(TxnOp::delete(self.cluster.keys().delay_guard(d), None::<DeleteOptions>));
            })
            .await?;
        if answer.succeeded() {
            self.queues().hint(d);
        }
        Ok(answer.succeeded())
    }

    /// Releases `hold_key` (under the release compares `release_cmp`) and grants
    /// the offering waiter the same slot under its other name, in one
    /// transaction (`engine::handoff` shows it). Anything that stops the
    /// hand-off before the transaction (a draining class, a slot above a lowered
    /// limit, a sealed service, durable fairness) returns `NotDone` and the
    /// caller releases plainly; so does a failed compare.
    async fn handoff(
        &self,
        d: &KeyDigest,
        hold_key: &[u8],
        release_cmp: &[Compare],
        marker: &str,
        ends: &[TxnOp],
        offer: &Offer,
    ) -> Result<HandOff, LockError> {
        let Some((ep, gate, ad)) = self.handoff_basis(d, hold_key, offer).await else { return Ok(HandOff::NotDone) };
        let (req, k) = (&offer.req, self.cluster.keys());
        let session = match &offer.record {
            Some(rec) if !test_faults::on(TestFault::HandoffDropsRecord) => {
                WaiterSession::Opens(Some(serde_json::to_vec(rec).map_err(internal)?))
            }
            // PLANTED BUG (held_memo scenario): the record is not put.
            Some(_) => WaiterSession::Opens(None),
            None => WaiterSession::Alive,
        };
        let delay_guard = (gate.limit == 1
            && req.class.lock_delay_s > 0
            && !test_faults::on(TestFault::SkipLockDelay)
            && self.guard().enabled(Capability::LockDelayGuards))
        .then(|| super::delay::guard_value(offer.sid));
        let floor = self.seal().revision_floor();
        let clock = self.seal().clock_floor(ep.epoch);
        let lease = self.marker_lease().await?;
        let (txn, new_key) = crate::engine::handoff::build(HandoffTxn {
            keys: k,
            d,
            hold_key,
            release_cmp,
            ends,
            epoch_rev: (!test_faults::on(TestFault::SkipEpochCompare)).then_some(ep.mod_revision),
            waiter: offer.sid,
            session,
            limit: gate.limit,
            gate: &gate,
            advert: ad.as_ref().map(|(key, lease)| (key.as_str(), *lease)),
            marker: (marker, lease),
            hold: hold_record(req, ep.epoch, 1, None, None)?,
            // A waiter that is handed a slot asks for one slot, never exclusion.
            indexed: req.session_indexed && self.guard().enabled(Capability::SessionHoldIndex),
            clock,
            delay_guard,
        });
        let r = match timed(Step::HandoffTxn, self.cluster.call(self.cluster.client().txn(txn.build()))).await {
            Ok(r) => r,
            Err(LockError::Unavailable(m)) if m.contains("lease not found") => {
                // The marker lease lapsed, or the lease of a waiter whose record
                // rides here was revoked (etcd does not say which): nothing ran.
                // The marker lease is taken again at worst once too often.
                self.drop_marker_lease().await;
                return Ok(HandOff::NotDone);
            }
            Err(e) => return Err(e),
        };
        if !r.succeeded() {
            return Ok(HandOff::NotDone);
        }
        let header = r.header().ok_or_else(|| internal("etcd txn response without header"))?;
        if clock.is_some() {
            self.seal().observe_clock(header.revision(), ep.epoch);
        }
        self.handed(d, offer, &ep, floor, new_key, header).await
    }

    /// What a hand-off needs read and checked before its transaction: the epoch
    /// (unsealed), the waiter's class gate and this arbiter's advertisement, and
    /// a slot of the key below the class's limit. `None`: no hand-off (the
    /// waiter asks for several slots, durable fairness, sealed, a slot above a
    /// lowered limit, a read failed).
    async fn handoff_basis(
        &self,
        d: &KeyDigest,
        hold_key: &[u8],
        offer: &Offer,
    ) -> Option<(EpochState, PolicyGate, Option<(String, i64)>)> {
        let req = &offer.req;
        // A hand-off moves one slot: a waiter for several looks again instead.
        if req.class.fairness != Fairness::Memory || self.unsealed().is_err() || req.permits != Permits::Count(1) {
            return None;
        }
        let ep = self.epoch().state().await.ok().filter(|ep| ep.sealed.is_none())?;
        let gate = self.policy_gate(req).await.ok()?;
        // The advertisement, compared as a grant compares it (`try_grant`).
        let ad = self.guard().advertisement().ok()?;
        let k = self.cluster.keys();
        match k.slot_of(hold_key) {
            Some(s) if s < gate.limit && k.digest_of_hold(hold_key).as_ref() == Some(d) => Some((ep, gate, ad)),
            _ => None,
        }
    }

    /// After a hand-off committed at `header`: the same checks as after a grant
    /// (revision floor, raft term, cluster, seal); a hand-off that fails them is
    /// taken back and the release stands (`ReleasedOnly`).
    async fn handed(
        &self,
        d: &KeyDigest,
        offer: &Offer,
        ep: &EpochState,
        floor: i64,
        new_key: Vec<u8>,
        header: &etcd_client::ResponseHeader,
    ) -> Result<HandOff, LockError> {
        let (req, k) = (&offer.req, self.cluster.keys());
        let (revision, cluster) = (header.revision(), header.cluster_id());
        if revision < floor {
            self.seal().seal(
                super::seal::SealReason::RevisionBehindMark,
                format!("hand-off revision {revision} below mark {floor}"),
            );
        }
        // A below-mark term seals; `unsealed` then refuses and takes the grant back.
        self.seal().observe_term(header.raft_term(), ep.epoch);
        let token = FencingToken::mint(ep.epoch, u64::try_from(revision).unwrap_or(u64::MAX));
        let checked = match self.epoch().check_cluster(ep, Some(cluster)).and_then(|()| self.unsealed()) {
            Ok(()) => self.epoch().raft_at_mark().await,
            Err(e) => Err(e),
        };
        let (Ok(()), Ok(token)) = (checked, token) else {
            // Taken back with its lock-delay guard and the waiter's index key.
            self.take_back(&[String::from_utf8_lossy(&new_key).into_owned()], revision, offer.sid).await;
            return Ok(HandOff::ReleasedOnly);
        };
        self.seal().observe_revision(revision, ep.epoch);
        if let Some(rec) = &offer.record {
            // Counted at once, before the ledger's watch shows it (`quota`), and
            // cached, as a grant that puts a record does.
            self.ledger().note_session(k.session(offer.sid).as_bytes(), revision, req.key.namespace());
            if !test_faults::on(TestFault::HandoffDropsRecord) {
                self.sessions.insert(offer.sid, Arc::new(rec.clone()));
            }
        }
        if new_key.ends_with(b".1") {
            self.queues().remember_handed_name(d, revision);
        }
        Ok(HandOff::Handed(Grant::new(req, token, offer.sid, 1)))
    }

    /// Deletes the hold of grant `g` of `d` (compared by create revision and
    /// lease), for a grant nobody can receive any more.
    async fn drop_grant(&self, d: &KeyDigest, g: &Grant) {
        let Ok(rev) = i64::try_from(g.token.revision()) else { return };
        let opts = Some(GetOptions::new().with_prefix());
        let Ok(r) = self.cluster.call(self.cluster.client().get(self.cluster.keys().holds(d), opts)).await else {
            return;
        };
        let held = r.kvs().iter().find(|kv| kv.create_revision() == rev && kv.lease() == g.session.lease());
        if let Some(name) = held.and_then(|kv| kv.key_str().ok()) {
            self.take_back(&[name.to_owned()], rev, g.session).await;
        }
    }

    /// The holders of `key`. Tokens and sessions are shown only to their holder
    /// (same identity, naming its session).
    pub async fn inspect(
        &self,
        key: &LockKey,
        caller: &Caller,
        session: Option<SessionId>,
    ) -> Result<Vec<HolderView>, LockError> {
        if let Some(sid) = session {
            self.owned_session(sid, caller).await?;
        }
        let d = key.digest();
        let r = self
            .cluster
            .call(self.cluster.client().get(self.cluster.keys().holds(&d), Some(GetOptions::new().with_prefix())))
            .await?;
        let now = now_ms();
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for kv in r.kvs() {
            let Some(h) = hold_of(kv) else { continue };
            // A multi-slot hold shows once (its slots share lease and revision).
            if !seen.insert((kv.lease(), kv.create_revision())) {
                continue;
            }
            let own = (h.owner == caller.identity && session.is_some_and(|s| s.lease() == kv.lease()))
                .then(|| {
                    let rev = u64::try_from(kv.create_revision()).ok()?;
                    Some((FencingToken::mint(h.epoch, rev).ok()?, SessionId::from_lease(kv.lease())?))
                })
                .flatten();
            out.push(HolderView {
                identity: h.owner,
                age_ms: now.saturating_sub(h.acquired_ms),
                own,
                permits: h.permits.unwrap_or(1),
                mode: h.mode,
            });
        }
        Ok(out)
    }
}

/// A grant's part in a key's exclusion record ([`Keys::exclusion`]).
pub(crate) struct ExclusionOps {
    /// The record absent (every grant).
    pub compare: Option<Compare>,
    /// The record put, on the grant's lease (an exclusive grant).
    pub put: Option<TxnOp>,
    /// The record, read (keys only) in the failure branch (with the compare).
    pub read: Option<String>,
}

/// The exclusion compares and writes of a grant of `req` on key `d`, on `lease`.
pub(crate) fn exclusion_ops(
    k: &Keys,
    d: &KeyDigest,
    req: &AcquireRequest,
    lease: &PutOptions,
    guard: &super::upgrade::Guard,
) -> ExclusionOps {
    if test_faults::on(TestFault::SkipExclusion) {
        // PLANTED BUG (holder_safety scenario): exclusion decided by the slots alone.
        return ExclusionOps { compare: None, put: None, read: None };
    }
    let key = k.exclusion(d);
    // Before `exclusion_records` is enabled nothing is put (an exclusive hold is
    // then sized by its slots alone, and `lockctl limit change` refuses raises);
    // the compare is kept: a record another arbiter put is always honoured.
    let exclusive = (req.mode == Some(LockMode::Exclusive) || req.permits == Permits::All)
        && guard.enabled(super::upgrade::Capability::ExclusionRecords);
    ExclusionOps {
        compare: Some(Compare::create_revision(key.as_str(), CompareOp::Equal, 0)),
        put: exclusive.then(|| TxnOp::put(key.as_str(), Vec::<u8>::new(), Some(lease.clone()))),
        read: Some(key),
    }
}

/// The writes every end of grant `rev` of `d` on session lease `lease` adds to
/// its transaction: the exclusion record deleted when this grant put it (a
/// nested transaction comparing its create revision, which is the grant's), and
/// the session's hold index key deleted (absent for sessions that keep none).
pub(crate) fn end_ops(k: &Keys, d: &KeyDigest, rev: i64, lease: Option<i64>) -> Vec<TxnOp> {
    let x = k.exclusion(d);
    let mut ops = vec![TxnOp::txn(
        Txn::new()
            .when([Compare::create_revision(x.as_str(), CompareOp::Equal, rev)])
            .and_then([TxnOp::delete(x.as_str(), None::<DeleteOptions>)]),
    )];
    if let Some(sid) = lease.and_then(SessionId::from_lease) {
        ops.push(TxnOp::delete(k.hold_index(sid, d), None::<DeleteOptions>));
    }
    ops
}

/// The limit `n` a grant of `req` is decided under (the authoritative one,
/// `gate`) and how many of its slots it takes (`want`).
fn grant_size(req: &AcquireRequest, gate: &PolicyGate) -> Result<(u32, u32), LockError> {
    let n = if test_faults::on(TestFault::RegistryLimit) {
        req.class.max_holders // PLANTED BUG (release gate): the registry's limit.
    } else if let Some(k) = req.class.candidate.filter(|_| test_faults::on(TestFault::ShadowDecides)) {
        k.max_holders // PLANTED BUG (shadow scenario): the candidate decides.
    } else {
        gate.limit
    };
    // An election has one leader: a campaign is granted only under a limit of
    // 1, read from the policy record this transaction compares (a limit change
    // after this read fails the compare and the grant reads it again).
    if req.election && n != 1 && !test_faults::on(TestFault::CampaignAnyLimit) {
        return Err(LockError::NotElectionClass(format!(
            "x-lock-key: the key's class {} allows {n} holders now (an operator's limit change); an election \
             needs a limit of 1, so nobody is elected while it is above 1",
            req.class.name
        )));
    }
    // k permits (`x-lock-permits`, all N for an exclusive hold): k slots in this
    // one transaction. More than the limit can never be granted.
    let want = if test_faults::on(TestFault::ExclusiveOneSlot) && req.permits == Permits::All {
        1 // PLANTED BUG (release gate): an exclusive hold of one slot.
    } else {
        req.permits.of(n)
    };
    if want > n.min(lockmesh_core::headers::MAX_PERMITS) {
        return Err(LockError::PermitsAboveLimit { asked: want, limit: n.min(lockmesh_core::headers::MAX_PERMITS) });
    }
    Ok((n, want))
}

/// A fresh grant attempt id ([`Keys::attempt`]): 64 random bits.
pub(crate) fn attempt_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// Whether a grant call's error leaves its outcome unknown: no answer in time,
/// a connection that broke, or etcd's own word that it does not know (`Unavailable`,
/// `Unknown`, `DeadlineExceeded`, `Cancelled`: a leader change, a request that timed
/// out inside etcd). Every other answer says the transaction was not applied (an
/// auth store that moved, a permission, a lease not found, a malformed request), and
/// is handed back at once (the stream re-runs a request refused for a login that
/// went stale).
pub(crate) fn outcome_unknown(e: &LockError) -> bool {
    // etcd-client's errors print the gRPC code by its description.
    const UNKNOWN: [&str; 6] = [
        "did not answer within",
        "code: 'The service is currently unavailable'",
        "code: 'Unknown error'",
        "code: 'Deadline expired",
        "code: 'The operation was cancelled'",
        "transport error",
    ];
    matches!(e, LockError::Unavailable(m) if UNKNOWN.iter().any(|s| m.contains(s)))
}

/// The compares of a release's one-round-trip path (see [`Store::release`]):
/// the grant of revision `rev` is slot 0 `slot0` on session `sid`, alone, in
/// the epoch whose record this arbiter read at `epoch_rev`.
fn own_slot_compares(k: &Keys, d: &KeyDigest, slot0: &[u8], rev: i64, sid: SessionId, epoch_rev: i64) -> Vec<Compare> {
    if test_faults::on(TestFault::ReleaseByKeyName) {
        // PLANTED BUG (release gate): delete by key name (etcd #22082).
        vec![Compare::version(slot0.to_vec(), CompareOp::Greater, 0)]
    } else {
        let holds = k.holds(d);
        let mut cmp = vec![
            // The epoch this arbiter read is still the record's: a revision
            // names one grant only within one epoch (a restore rolls
            // revisions back, then advances the epoch), so this path is
            // exact only while the epoch it read is current. Otherwise the
            // compare fails and the read path below compares the hold's own
            // epoch with the token's.
            Compare::mod_revision(k.epoch(), CompareOp::Equal, epoch_rev),
            Compare::create_revision(slot0.to_vec(), CompareOp::Equal, rev),
            Compare::lease(slot0.to_vec(), CompareOp::Equal, sid.lease()),
            // No other slot of this grant (k permits put theirs in one
            // transaction, so they share its revision): those go below.
            Compare::create_revision(k.slot(d, 1), CompareOp::NotEqual, rev).with_range(keys::prefix_end(&holds)),
        ];
        if test_faults::on(TestFault::SkipEpochCompare) {
            cmp.remove(0); // PLANTED BUG (release gate): no epoch compare.
        }
        cmp
    }
}

#[cfg(test)]
mod outcome_tests {
    use super::*;

    #[test]
    fn only_answers_that_leave_the_outcome_open_are_unknown() {
        let un = |m: &str| outcome_unknown(&LockError::Unavailable(m.into()));
        assert!(un("etcd did not answer within 500ms"));
        let s = |code: tonic::Code| format!("grpc request error: code: '{}', message: \"x\"", code.description());
        for c in [tonic::Code::Unavailable, tonic::Code::Unknown, tonic::Code::DeadlineExceeded, tonic::Code::Cancelled]
        {
            assert!(un(&s(c)), "{c:?}");
        }
        for c in [
            tonic::Code::InvalidArgument,
            tonic::Code::PermissionDenied,
            tonic::Code::NotFound,
            tonic::Code::FailedPrecondition,
        ] {
            assert!(!un(&s(c)), "{c:?}");
        }
        assert!(!outcome_unknown(&LockError::NotHolder));
    }
}

/// `req` with [`AcquireRequest::session_indexed`] set to `indexed` (a copy only
/// when that changes it).
pub(crate) fn indexed_on(req: &AcquireRequest, indexed: bool) -> std::borrow::Cow<'_, AcquireRequest> {
    if req.session_indexed == indexed {
        std::borrow::Cow::Borrowed(req)
    } else {
        std::borrow::Cow::Owned(AcquireRequest { session_indexed: indexed, ..req.clone() })
    }
}

/// The slot keys of session `sid` whose hold carries attempt id `attempt`, and
/// their (shared) create revision.
fn attempt_holds(holds: &etcd_client::GetResponse, sid: SessionId, attempt: &str) -> Option<(Vec<String>, i64)> {
    let ours: Vec<&KeyValue> = holds
        .kvs()
        .iter()
        .filter(|kv| kv.lease() == sid.lease() && hold_of(kv).and_then(|h| h.attempt).as_deref() == Some(attempt))
        .collect();
    let rev = ours.first()?.create_revision();
    Some((ours.iter().map(|kv| String::from_utf8_lossy(kv.key()).into_owned()).collect(), rev))
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
